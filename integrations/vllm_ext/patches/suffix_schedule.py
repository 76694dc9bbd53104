"""Bug fix: vLLM's ``suffix`` method runs with a batch-size schedule of K.

With ``num_speculative_tokens_per_batch_size`` (vLLM's schedule of K by running requests) the
scheduler passes the scheduled K to ``SuffixDecodingProposer.propose``, which asserts that it
equals its configured K, so the engine dies at the first step where the schedule lowers K. This
lets it run with its configured K (its cache must still see every sampled token) and cuts each
draft to the scheduled K. Only the ``suffix-bs`` baseline of the benchmarks uses that schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from integrations.vllm_ext.patches.patch import Patch, replace

TARGET = "vllm.v1.spec_decode.suffix_decoding.SuffixDecodingProposer.propose"


def propose_with_scheduled_k(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``SuffixDecodingProposer.propose``: run it at its configured K, cut drafts to the scheduled one."""

    def propose(self, num_speculative_tokens, input_batch, sampled_token_ids, slot_mappings=None):
        drafts = original(self, self.num_speculative_tokens, input_batch, sampled_token_ids, slot_mappings=slot_mappings)
        k = int(num_speculative_tokens)
        return drafts if k >= self.num_speculative_tokens else [d[:k] for d in drafts]

    propose.__wrapped__ = original
    return propose


def install() -> None:
    replace(TARGET, propose_with_scheduled_k, PATCH.name)


PATCH = Patch(
    name="suffix_schedule",
    kind="bug fix",
    summary="suffix decoding survives num_speculative_tokens_per_batch_size (its proposer asserted a fixed K)",
    upstream="not reported upstream: found by this project; a report is still to be filed",
    versions=("0.32.0", "0.33.0"),
    cpu_only=False,
    expects={TARGET: "(self, num_speculative_tokens, input_batch, sampled_token_ids, slot_mappings=None)"},
    install=install,
    on_cuda="applied: SuffixDecodingProposer.propose asserts a fixed K on every build (device-independent Python)",
)
