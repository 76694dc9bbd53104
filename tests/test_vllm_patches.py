"""das's patches of vLLM (integrations.vllm_ext.patches): what each fixes, how they are applied
(vLLM's plugin entry point, never an import), and that a changed vLLM is caught."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from integrations.vllm_ext import patches
from integrations.vllm_ext.patches.expand_batch import expand_batch_to_tokens
from integrations.vllm_ext.patches.patch import KINDS, call_signature, mismatches, patched_by

REPO = Path(__file__).resolve().parents[1]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def run_python(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter (this checkout first on the path); returns the JSON it prints last."""
    full = {**os.environ, "PYTHONPATH": str(REPO), **env}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO, env=full)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- the records


def test_every_patch_says_its_kind_upstream_versions_and_signatures():
    names = [p.name for p in patches.PATCHES]
    assert len(set(names)) == len(names)
    for p in patches.PATCHES:
        assert p.kind in KINDS and p.summary and p.versions and p.expects, p.name
        assert "#" in p.upstream or p.upstream.startswith("not reported upstream: "), p.name
        assert all(name in names[: names.index(p.name)] for name in p.requires), p.name  # installed after what it needs
    assert patches.FEATURES == ("coupled_sampling",)
    with pytest.raises(ValueError, match="kind must be one of"):
        patches.Patch("x", "tweak", "s", "not reported upstream: x", ("0.32.0",), True, {}, lambda: None)


def test_unknown_features_are_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown das vLLM features \['coupled'\]"):
        patches.apply(features=["coupled"])
    with pytest.raises(ValueError, match="a list of names"):
        patches.apply(features="coupled_sampling")
    monkeypatch.setenv(patches.FEATURES_ENV, "coupled_sampling, typo")
    with pytest.raises(ValueError, match=r"\['typo'\].*DAS_VLLM_FEATURES"):
        patches.apply()


# ---- bug fix: expand_batch (vLLM #55005)


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 5), min_size=1, max_size=12), floats=st.booleans(), data=st.data())
def test_expand_repeats_each_requests_value_over_its_positions(counts, floats, data):
    import torch

    values = data.draw(st.lists(st.integers(-3, 3), min_size=len(counts), max_size=len(counts)))
    x = torch.tensor(values, dtype=torch.float32) * 0.3 if floats else torch.tensor(values, dtype=torch.int64)
    cu = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = expand_batch_to_tokens(x, cu, sum(counts), replace_from=0, replace_to=-1)
    want = [(-1 if v == 0 else v) for v, n in zip(x.tolist(), counts) for _ in range(n)]
    assert out.dtype == x.dtype and out.tolist() == want


@pytest.mark.slow  # imports vLLM
@needs_vllm
def test_float_temperatures_expand_intact_once_patched(vllm_patches):
    import torch
    from vllm.v1.sample import rejection_sampler

    assert "expand_batch" in vllm_patches
    temps = torch.tensor([0.6, 1.0, 0.3], dtype=torch.float32)
    out = rejection_sampler.expand_batch_to_tokens(temps, torch.tensor([2, 5, 6], dtype=torch.int32), 6)
    assert out.dtype == torch.float32 and torch.equal(out, torch.tensor([0.6, 0.6, 1.0, 1.0, 1.0, 0.3]))


# ---- bug fix: kernel_scan (LLM() after numba)


@pytest.mark.slow
@needs_vllm
def test_engine_scan_survives_llvmlite_objects(vllm_patches):
    import numba  # noqa: F401  (puts llvmlite's ffi.lib, which fakes __dict__, in sys.modules)
    from llvmlite.binding import ffi
    from vllm.triton_utils import dispatcher

    assert dispatcher.vars(ffi.lib) == {}
    assert dispatcher.vars(dispatcher)["__name__"] == dispatcher.__name__


# ---- speed fix: plain_sampling


@pytest.mark.slow
@needs_vllm
def test_a_step_without_drafts_is_sampled_by_the_plain_sampler(vllm_patches):
    # speculative metadata with no draft token (max_spec_len 0) takes the plain path; a step with
    # drafts still goes through the rejection sampler.
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert patched_by(GPUModelRunner._sample, "plain_sampling")
    calls = []

    class Runner:
        class input_batch:  # noqa: N801 - what _sample reads from the batch
            sampling_metadata = "meta"
            req_ids = []

            @staticmethod
            def update_async_output_token_ids():
                pass

        use_async_scheduling = False
        requests = {}

        def sampler(self, logits, sampling_metadata):
            calls.append(("plain", logits, sampling_metadata))
            return "plain"

        def _get_spec_decode_draft_probs(self, metadata):
            return None

        def rejection_sampler(self, metadata, draft_probs, logits, sampling_metadata):
            calls.append(("rejection", metadata.max_spec_len))
            return "rejection"

    none = SpecDecodeMetadata.make_dummy([[], []], device="cpu")
    some = SpecDecodeMetadata.make_dummy([[5, 6], []], device="cpu")
    runner = Runner()
    assert GPUModelRunner._sample(runner, "logits", none) == "plain"
    assert GPUModelRunner._sample(runner, "logits", some) == "rejection"
    assert GPUModelRunner._sample(runner, "logits", None) == "plain"
    assert calls == [("plain", "logits", "meta"), ("rejection", 2), ("plain", "logits", "meta")]


# ---- the installed vLLM is the one the patches were written for


def _applicable():
    from integrations.vllm_ext.cpu_runtime import is_cpu_build

    version, cpu = patches.vllm_version(), is_cpu_build()
    return [p for p in patches.PATCHES if version in p.versions and (cpu or not p.cpu_only)]


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("name", [p.name for p in patches.PATCHES])
def test_vllms_functions_have_the_signatures_the_patch_was_written_for(name):
    """Fails when the installed vLLM (a version the patch is gated on) changed a function it touches:
    update the patch for it, then its ``expects``."""
    patch = next(p for p in patches.PATCHES if p.name == name)
    if patch not in _applicable():
        pytest.skip(f"vLLM {patches.vllm_version()} is not a version {name} is written for ({', '.join(patch.versions)})")
    assert mismatches(patch) == []


@pytest.mark.slow
@needs_vllm
def test_a_changed_signature_is_caught_and_that_patch_left_out(vllm_patches, monkeypatch, caplog):
    import dataclasses

    real = next(p for p in patches.PATCHES if p.name == "plain_sampling")
    installs = []
    changed = dataclasses.replace(real, name="plain_sampling_v2", install=lambda: installs.append(1), expects={
        next(iter(real.expects)): "(self, logits)",  # vLLM's has one more parameter
        "vllm.v1.worker.gpu_model_runner.no_such_function": "()",  # and lacks this one
    })
    found = mismatches(changed)
    assert len(found) == 2 and "written for" in found[0] + found[1] and "not found" in found[0] + found[1]
    monkeypatch.setattr(patches, "PATCHES", (*patches.PATCHES, changed))
    with caplog.at_level("WARNING", logger="integrations.vllm_ext.patches"):
        names = patches.apply(features=())
    assert "plain_sampling_v2" not in names and installs == []
    assert "plain_sampling_v2" in caplog.text and "not the ones it was written for" in caplog.text


# ---- applied through vLLM's plugin entry point, not by imports


@pytest.mark.slow
@needs_vllm
def test_importing_the_proposer_patches_nothing():
    code = ("import json, integrations.vllm_ext.proposer\n"
            "from vllm.v1.sample import rejection_sampler as r\n"
            "from integrations.vllm_ext import patches\n"
            "out = [r.rejection_sample.__module__, r.expand_batch_to_tokens.__module__, list(patches.installed())]\n"
            "if '--apply' in __import__('sys').argv: patches.apply(); out += [r.rejection_sample.__module__]\n"
            "print(json.dumps(out))\n")
    assert run_python(code) == ["vllm.v1.sample.rejection_sampler", "vllm.v1.sample.rejection_sampler", []]
    if not _applicable():
        pytest.skip("no patch applies to this vLLM: nothing to compare with")
    applied = run_python(code.replace("'--apply' in __import__('sys').argv", "True"))  # the explicit call does patch it
    assert applied[-1] == "integrations.vllm_ext.patches.lazy_rejection"


def _installed_from_this_checkout() -> bool:
    """Whether das-rollout is installed from this checkout (editable, as install.sh does)."""
    for dist in importlib.metadata.distributions():
        if dist.metadata["Name"] == "das-rollout":
            url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
            if url.removeprefix("file://").rstrip("/") == str(REPO):
                return True
    return False


def test_pyproject_registers_apply_as_a_vllm_plugin():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"das_patches": "integrations.vllm_ext.patches:apply"}
    if not _installed_from_this_checkout():
        pytest.skip("das is not installed from this checkout (install.sh): its entry points are another checkout's")
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert found.get("das_patches") == "integrations.vllm_ext.patches:apply"


@pytest.mark.slow
@needs_vllm
def test_vllms_plugin_loading_installs_the_patches_and_only_the_features_asked_for():
    if not _installed_from_this_checkout():
        pytest.skip("das is not installed from this checkout (install.sh): vLLM would load another checkout's entry point")
    if not _applicable():
        pytest.skip("no patch applies to this vLLM")
    code = ("import json\nfrom vllm.plugins import load_general_plugins\nload_general_plugins()\n"
            "from vllm.v1.sample import rejection_sampler as r\nfrom integrations.vllm_ext import patches\n"
            "print(json.dumps([r.rejection_sample.__module__, list(patches.installed())]))\n")
    module, names = run_python(code, DAS_VLLM_FEATURES="")
    assert module == "integrations.vllm_ext.patches.lazy_rejection"
    assert names == [p.name for p in _applicable() if p.kind != "feature"]
    _, names = run_python(code, DAS_VLLM_FEATURES="coupled_sampling")
    assert names[-1] == "coupled_sampling"


def test_signatures_ignore_annotations_but_not_defaults():
    def f(a: int, b: str = "x", *, c=None) -> int:
        return a

    assert call_signature(f) == "(a, b='x', *, c=None)"
