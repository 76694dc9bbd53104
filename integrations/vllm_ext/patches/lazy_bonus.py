"""Speed fix: bonus tokens sampled only for the rows that use them.

vLLM's ``RejectionSampler.forward`` samples a bonus token for every row before it verifies, and
each rejected row throws its own away: a Gumbel-max pass over the vocabulary per row, about a
third of what verifying a drafting row costs on the CPU (docs/benchmarks.md, "vLLM on the CPU:
what das fixes"). :func:`rejection_sampler_forward` verifies first
(:func:`integrations.vllm_ext.patches.lazy_rejection.verify`) and has the CPU sampler
(``TopKTopPSampler.forward_cpu``, wrapped by :func:`bonus_rows_only`) sample only the rows whose
drafts were all accepted and the rows without drafts; those rows get the same tokens as before.
Steps with logprobs, draft probabilities, per-request generators, synthetic acceptance or FLy run
vLLM's code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from integrations.vllm_ext.patches import coupled_sampling
from integrations.vllm_ext.patches.lazy_rejection import place_bonus, verify
from integrations.vllm_ext.patches.patch import Patch, replace

FORWARD = "vllm.v1.sample.rejection_sampler.RejectionSampler.forward"
FORWARD_CPU = "vllm.v1.sample.ops.topk_topp_sampler.TopKTopPSampler.forward_cpu"

_bonus_rows: torch.Tensor | None = None  # [batch] bool while forward() samples bonus tokens, else None
_bonus_offsets: torch.Tensor | None = None  # [batch] int64: the rows' draft tokens, while forward() samples bonus tokens


@contextlib.contextmanager
def bonus_rows(rows: torch.Tensor, offsets: torch.Tensor | None = None) -> Iterator[None]:
    """While inside, the wrapped CPU sampler samples only ``rows`` (``[batch]`` bool; the others get
    token 0, never read); ``offsets`` (``[batch]`` int64, draft tokens per row) place each keyed
    row's bonus token at its index ``n + k`` for coupled sampling."""
    global _bonus_rows, _bonus_offsets
    _bonus_rows, _bonus_offsets = rows, offsets
    try:
        yield
    finally:
        _bonus_rows = _bonus_offsets = None


def rejection_sampler_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap vLLM 0.32's ``RejectionSampler.forward``: verify first, then sample bonus tokens only
    for the rows that use them (rows without drafts, and rows whose drafts were all accepted).

    The rows that keep their bonus token get the same token as before: the CPU sampler draws one
    seed per row from torch's generator, for every row as before, and a row's token depends only
    on its logits and its seed (:func:`bonus_rows_only`). Without logprobs the raw target logits
    are not cloned either (vLLM keeps them for logprobs only).

    Steps with draft probabilities, synthetic acceptance, FLy, per-request generators or logprobs
    go to ``original`` unchanged.
    """

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        if (draft_probs is not None or self.synthetic_mode or getattr(self, "use_fly", False) or sampling_metadata.generators
                or sampling_metadata.max_num_logprobs is not None or sampling_metadata.logprob_token_ids):
            # vLLM samples bonus tokens before verifying, at no index we could key: such steps are not coupled
            coupled_sampling.end_step()
            return original(self, metadata, draft_probs, logits, sampling_metadata)
        from vllm.v1.outputs import SamplerOutput
        from vllm.v1.sample import rejection_sampler

        bonus_logits = logits[metadata.bonus_logits_indices]
        target_logits = logits[metadata.target_logits_indices].to(torch.float32)  # indexing copies: safe to edit
        target_logits = self.apply_logits_processors(target_logits, sampling_metadata, metadata)
        target_logits = rejection_sampler.apply_sampling_constraints(target_logits, metadata.cu_num_draft_tokens,
                                                                     sampling_metadata)
        out, n_accepted, full = verify(metadata.draft_token_ids, metadata.num_draft_tokens, metadata.max_spec_len,
                                       metadata.cu_num_draft_tokens, target_logits, sampling_metadata)
        offsets = torch.tensor(metadata.num_draft_tokens, dtype=torch.int64)  # a bonus token's index: n + k
        with bonus_rows(full, offsets):
            bonus = self.sampler(logits=bonus_logits, sampling_metadata=sampling_metadata,
                                 predict_bonus_token=True).sampled_token_ids
        place_bonus(out, n_accepted, full, bonus)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)

    forward.__wrapped__ = original
    return forward


def bonus_rows_only(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap vLLM 0.32's ``TopKTopPSampler.forward_cpu`` so that, inside :func:`bonus_rows`, only
    those rows are sampled (the others get token 0, never read), and keyed rows of coupled
    sampling take their own inverse-CDF sample. The body is vLLM's: top-k/top-p on every row, one
    seed per row drawn for every row, then ``fused_gumbel_argmax`` on the kept rows with their own
    seeds, so each kept row gets the token the full call would give it."""

    def forward_cpu(self, logits, generators, k, p):
        rows = _bonus_rows
        coupled = None if generators or self.use_fp64_gumbel else coupled_sampling.row_uniforms(logits.shape[0], _bonus_offsets)
        if coupled is None and (rows is None or generators or self.use_fp64_gumbel or bool(rows.all())):
            return original(self, logits, generators, k, p)
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        logits = apply_top_k_top_p(logits, k, p)
        logits_to_return = None
        if self.logprobs_mode == "processed_logits":
            logits_to_return = logits
        elif self.logprobs_mode == "processed_logprobs":
            logits_to_return = logits.log_softmax(dim=-1, dtype=torch.float32)
        seeds = torch.randint(0, 2**31, (logits.shape[0],), dtype=torch.long)
        sampled = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        want = torch.ones(logits.shape[0], dtype=torch.bool) if rows is None else rows
        if coupled is not None:  # keyed rows: the inverse CDF at their token's own uniform (coupled sampling)
            keyed = torch.nonzero(want & coupled[0]).squeeze(1)
            if keyed.numel():
                sampled[keyed] = coupled_sampling.sample_rows(logits[keyed], coupled[1][keyed])
            want = want & ~coupled[0]
        kept = torch.nonzero(want).squeeze(1)
        if kept.numel():
            sampled[kept] = torch.ops._C.fused_gumbel_argmax(logits[kept].to(torch.float32), seeds[kept]).to(torch.long)
        return sampled, logits_to_return

    forward_cpu.__wrapped__ = original
    return forward_cpu


def install() -> None:
    replace(FORWARD, rejection_sampler_forward, PATCH.name)
    replace(FORWARD_CPU, bonus_rows_only, PATCH.name)


PATCH = Patch(
    name="lazy_bonus",
    kind="speed fix",
    summary="verification before bonus sampling: the CPU sampler samples bonus tokens only for rows that keep them",
    upstream="not reported upstream: found by this project; a report (with lazy_rejection's measurements) is still to be filed",
    versions=("0.32.0",),
    cpu_only=True,
    expects={
        FORWARD: "(self, metadata, draft_probs, logits, sampling_metadata)",
        FORWARD_CPU: "(self, logits, generators, k, p)",
        # called by the wrappers
        "vllm.v1.sample.rejection_sampler.RejectionSampler.apply_logits_processors": "(self, logits, sampling_metadata, metadata)",
        "vllm.v1.sample.rejection_sampler.apply_sampling_constraints": "(logits, cu_num_draft_tokens, sampling_metadata)",
        "vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p": "(logits, k, p)",
        "vllm.v1.sample.sampler.Sampler.forward": "(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None)",
    },
    install=install,
    on_cuda="not needed: a speed fix of the CPU sampler (TopKTopPSampler.forward_cpu), which a CUDA build never calls",
)
