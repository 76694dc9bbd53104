"""The RL application built on the engine: what a training run needs beyond generating tokens.

The GRPO loop (``grpo``, the ``das-grpo`` script; its policy update in ``trainer``, what every
method of a run shares in ``workload``, the A/B of whole runs, ``das-grpo --compare``, in ``ab``),
rewards (``rewards``) with the code sandbox (``code_sandbox``, and ``sandbox``: what runs inside
it), recipes and the overlays for verl and NeMo-RL (``recipes``), the TRL and verl adapters
(``trl``, ``verl``), and data-parallel rollout workers on Ray (``ray_rollout``). They use
``integrations.vllm_ext`` for engines and ``integrations.data`` for problems; nothing in
``vllm_ext`` or ``data`` imports from here.
"""
