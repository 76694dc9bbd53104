"""Shared fixtures: a tiny random model built locally in seconds, and vLLM's CPU settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Directory of a tiny random Llama (float32) that vLLM loads in a few seconds."""
    from integrations.data.models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", seed=0))


@pytest.fixture(scope="session")
def peaked_tiny_model(tiny_model, tmp_path_factory) -> str:
    """The tiny model with its output layer scaled up, so next-token distributions are peaked.

    A random model's logits are nearly uniform, so drafts would almost never be accepted and a
    sampling test would never exercise acceptance. Scaling the LM head by 12 gives entropies of a
    few nats: drafts get accepted and rejected, which is what a losslessness test must exercise.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("peaked") / "llama"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    model.config.tie_word_embeddings = False
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session", autouse=True)
def _vllm_cpu_env(request):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # tiny models: keep every test engine's cache small
    if any(item.get_closest_marker("engine") for item in request.session.items):
        from integrations.vllm_ext.cpu_runtime import apply_cpu_defaults

        apply_cpu_defaults()  # imports torch (seconds): only in a session that starts vLLM
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _fresh_engine_state(request):
    """Before an engine test: collect the engines earlier tests dropped and reset vLLM's
    process-wide parallel state (:func:`integrations.vllm_ext.engine.release_engine_state`). An
    engine left in a reference cycle is otherwise collected whenever the garbage collector next
    runs, possibly during a later test's engine step, whose parallel groups it then shuts down
    ("pipeline model parallel group is not initialized"). No fixture keeps an engine across tests."""
    if request.node.get_closest_marker("engine") is not None:
        from integrations.vllm_ext.engine import release_engine_state

        release_engine_state()
    yield


@pytest.fixture
def length_history():
    """A :class:`scheduler.predictor.LengthPredictor` (16K max tokens, classes split at 2K and 8K)
    that has seen 10 short problems (``short0``..``short9``, 500 tokens each) and 10 long ones
    (``long0``..``long9``, 15,000 tokens), 8 rollouts each, at policy version 1."""
    from scheduler.predictor import LengthPredictor

    pred = LengthPredictor(16384, bounds=(2000, 8000))
    for i in range(10):
        pred.observe(f"short{i}", 1, [500] * 8)
        pred.observe(f"long{i}", 1, [15000] * 8)
    return pred
