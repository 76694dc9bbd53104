"""Speed fix: a step in which no row drafted takes the plain sampler.

With a speculative method configured, vLLM 0.32 builds speculative metadata for every step and
sends it through the rejection sampler even when no row drafted (``max_spec_len == 0``): the bonus
tokens are then sampled from the same logits by the same sampler, plus indexing, dtype casts and
logits processors over empty draft tensors (docs/benchmarks.md, "vLLM on the CPU: what das fixes"). This wraps the model runner's
``_sample`` so that such a step calls the sampler directly, as an engine without speculation does:
the same call on the same logits, so the same tokens (the sampled token matrix has one column
either way and is parsed the same).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from integrations.vllm_ext.patches.patch import Patch, replace

TARGET = "vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample"


def plain_sampling_without_drafts(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``GPUModelRunner._sample(self, logits, spec_decode_metadata)``: metadata without a
    draft token (``max_spec_len == 0``) is dropped, so vLLM samples the step as a plain one."""

    def _sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
            spec_decode_metadata = None  # no row drafted: the plain engine's sampling
        return original(self, logits, spec_decode_metadata)

    _sample.__wrapped__ = original
    return _sample


def install() -> None:
    replace(TARGET, plain_sampling_without_drafts, PATCH.name)


PATCH = Patch(
    name="plain_sampling",
    kind="speed fix",
    summary="a step in which no row drafted is sampled by the plain sampler, not sent through the rejection sampler",
    upstream="not reported upstream: found by this project; a report is still to be filed",
    versions=("0.32.0",),
    cpu_only=True,
    expects={TARGET: "(self, logits, spec_decode_metadata)"},
    install=install,
    on_cuda=("not needed: a speed fix measured on the CPU, where a step's sampler passes cost milliseconds; on a GPU the rejection sampler of "
             "a step without drafts is a few kernel launches"),
)
