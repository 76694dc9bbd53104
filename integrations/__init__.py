"""Adapters that put the DAS drafter to work, split by concern.

``vllm_ext`` runs inside or around the vLLM engine (proposer, engine factory, patches, weight sync),
``rl`` is the RL application (GRPO loop, rewards, recipes, Ray rollout workers), ``data`` loads
problems, models and traces. ``rollout`` (the ``das-rollout`` CLI) and ``results`` (result files,
used by all of them and by ``benchmarks``) stay at the top.
"""
