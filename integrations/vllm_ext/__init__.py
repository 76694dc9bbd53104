"""Code that runs inside or around a vLLM engine.

The speculative proposer vLLM loads by dotted path (``integrations.vllm_ext.proposer.DASProposer``)
in each worker, the engine factory (``engine.make_llm``) and its CPU settings (``cpu_runtime``),
das's version-gated patches of vLLM (``patches``, one module per patch, installed in every vLLM
process through vLLM's plugin entry point), engine-side control and counters (``control``),
in-place weight sync (``weight_sync``) and the rollout loop every caller uses (``rollouts``).
Modules here may import vLLM; nothing here knows about RL training or data sets.
"""
