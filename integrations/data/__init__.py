"""Inputs and records: problems (``problems``: verl parquet, LeetCode JSON, the embedded CHAMP and
HumanEval sets, prompt rendering), models (``models``: SmolLM2 from its GGUF package, the tiny
random test model, resolution of ``--model``) and rollout traces (``trace``: parquet).

No vLLM engine is started here; the modules import only what reading and writing these needs.
"""
