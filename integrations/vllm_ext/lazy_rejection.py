"""Lazy-recovery rejection sampling: verification that costs nothing for rows without drafts.

vLLM 0.32's ``rejection_sample`` (``vllm/v1/sample/rejection_sampler.py``) draws an exponential
over ``[rows, vocab]`` every step to pre-sample a *recovered* token for every row, drafted or not,
and then runs a pass over ``[draft tokens, vocab]``. On the CPU that is most of the speculative
path's tax: measured 39 ms per step at 32 rows x 49,152 vocab, paid even when no row drafted.
Only one recovered token per row is ever used, the one at the row's first rejection, so this
version decides acceptance first and samples recovered tokens only for the rejected rows
(the "lazy recovery" of vLLM PR #41258).

How, in a handful of tensor ops whatever the batch: one softmax over every drafted position
(torch's fused softmax is the cheapest pass over the vocabulary on the CPU: 14 us per position
here, where ``max(dim)`` with indices or ``exp`` alone cost ~20 us), the acceptance walk as a
running product over a ``[rows, max_spec_len]`` grid, then one recovered token per rejected row by
a two-level inverse CDF over the same probabilities (block sums, then one block's cumsum).

The distribution is unchanged (speculative sampling, Leviathan et al. 2023, Theorem 1). For a
draft that is a point mass on token ``x`` (n-gram, suffix and DAS drafts carry no probabilities),
position ``t`` is accepted with probability ``min(1, p(x_t) / 1) = p(x_t)`` under the target
distribution ``p`` (temperature, top-k and top-p already applied by vLLM), and at the first
rejection the token is drawn from the residual ``max(p - q, 0)`` normalised, i.e. ``p`` with
``x_t`` removed. Greedy rows (temperature 0) accept while the draft equals the target argmax and
then emit the argmax. When every draft token of a row is accepted, the row gets its bonus token.
Random numbers are drawn per call from torch's global generator (the per-request generators of
seeded requests are not supported by this fast path: such steps fall back to vLLM's sampler).
Rows with a sample key take no random numbers: a draft token is accepted iff it equals the
target's own inverse-CDF sample at its index (from the row's key and the index), and a rejected position emits that sample (the same
distribution: :mod:`integrations.vllm_ext.coupled_sampling`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from integrations.vllm_ext import coupled_sampling

PLACEHOLDER_TOKEN_ID = -1  # vLLM's marker for "no token at this position"

_fallback: Callable[..., torch.Tensor] | None = None  # vLLM's own rejection_sample, for cases we do not handle


def set_fallback(fn: Callable[..., torch.Tensor]) -> None:
    """Record vLLM's original ``rejection_sample`` (called for draft probabilities, seeds, synthetic mode)."""
    global _fallback
    _fallback = fn


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    sampling_metadata: Any,
    synthetic_mode: bool = False,
    synthetic_conditional_rates: torch.Tensor | None = None,
    use_fp64_gumbel: bool = False,
) -> torch.Tensor:
    """Verify draft tokens; a drop-in for ``vllm.v1.sample.rejection_sampler.rejection_sample``.

    Args:
        draft_token_ids: ``[num_tokens]`` int, every row's draft tokens, concatenated.
        num_draft_tokens: ``batch_size`` ints, draft tokens per row (0 for a row without a draft).
        max_spec_len: the most draft tokens of any row (columns of the output, less one).
        cu_num_draft_tokens: ``[batch_size]`` int, cumulative ``num_draft_tokens``.
        draft_probs: ``[num_tokens, vocab]`` draft distributions, or None (point-mass drafts).
        target_logits: ``[num_tokens, vocab]`` float32 target logits at the draft positions,
            temperature / top-k / top-p already applied.
        bonus_token_ids: ``[batch_size, 1]`` int, the token each row samples after its last draft.
        sampling_metadata: vLLM's ``SamplingMetadata`` (``all_greedy``, ``all_random``,
            ``temperature``, ``generators``).
        synthetic_mode, synthetic_conditional_rates, use_fp64_gumbel: vLLM's; any synthetic
            mode goes to vLLM's sampler.

    Returns:
        ``[batch_size, max_spec_len + 1]`` int32: per row the accepted draft tokens, then the
        recovered token (at the first rejection) or the bonus token, then ``-1`` padding.
    """
    if draft_probs is not None or synthetic_mode or sampling_metadata.generators:
        if _fallback is None:
            raise RuntimeError("das lazy rejection sampler: no fallback sampler recorded (call set_fallback first)")
        return _fallback(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                         target_logits, bonus_token_ids, sampling_metadata, synthetic_mode=synthetic_mode,
                         synthetic_conditional_rates=synthetic_conditional_rates, use_fp64_gumbel=use_fp64_gumbel)
    out, n_accepted, full = _verify(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                                    target_logits, sampling_metadata)
    _place_bonus(out, n_accepted, full, bonus_token_ids)
    return out


def _place_bonus(out: torch.Tensor, n_accepted: torch.Tensor, full: torch.Tensor, bonus_token_ids: torch.Tensor) -> None:
    """Write each row's bonus token after its draft where every draft token was accepted."""
    rows = torch.nonzero(full).squeeze(1)
    out[rows, n_accepted[rows]] = bonus_token_ids.reshape(-1)[rows].to(torch.int32)


def _verify(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    sampling_metadata: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Acceptance and recovered tokens of one step, without the bonus tokens.

    Returns:
        ``out`` (``[batch_size, max_spec_len + 1]`` int32: accepted draft tokens, then the
        recovered token where a row was rejected, ``-1`` elsewhere), ``n_accepted``
        (``[batch_size]`` int64) and ``full`` (``[batch_size]`` bool: every draft token of the
        row accepted, rows without drafts included: these rows take their bonus token next).
    """
    device = target_logits.device
    batch = len(num_draft_tokens)
    out = torch.full((batch, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=device)
    num_tokens = int(draft_token_ids.shape[0])
    if num_tokens == 0:  # no row drafted: the bonus token is the whole step (a plain decode step)
        return out, torch.zeros(batch, dtype=torch.int64, device=device), torch.ones(batch, dtype=torch.bool, device=device)

    counts = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)
    starts = cu_num_draft_tokens.to(torch.int64) - counts
    drafts = draft_token_ids.to(torch.int64)
    # rows at temperature 0 in a mixed batch (an all-greedy batch takes the argmax path below)
    greedy_rows = None if sampling_metadata.all_random or sampling_metadata.all_greedy else sampling_metadata.temperature == 0

    # One softmax over every drafted position, also those after a row's first rejection: a
    # column-by-column walk over the rows still accepting paid a dozen small ops per column, more
    # than the positions it skipped (python -m benchmarks.verification: 0.46-0.51 -> 0.42 ms at
    # 1 row x 8 drafts, 4.2-8.3 -> 1.0 ms at 32 rows x 1).
    greedy_flat = None
    probs = keyed = samples = None
    if sampling_metadata.all_greedy:  # greedy rows accept while the draft is the argmax, then emit the argmax
        accept = target_logits.argmax(dim=-1) == drafts
    else:
        coupled = coupled_sampling.coupled_samples(target_logits, counts)
        if coupled is not None:  # keyed rows: accept iff the draft is the target's own sample there
            keyed, samples = coupled
        if keyed is not None and bool(keyed.all()):
            accept = samples == drafts
        else:
            probs = torch.softmax(target_logits, dim=-1)  # [num_tokens, vocab] float32
            p_x = probs.gather(1, drafts[:, None]).squeeze(1).to(torch.float64)
            accept = torch.rand(num_tokens, dtype=torch.float64, device=device) < p_x
            if keyed is not None:
                accept = torch.where(keyed, samples == drafts, accept)
        if greedy_rows is not None:
            greedy_flat = torch.repeat_interleave(greedy_rows, counts, output_size=num_tokens)
            if bool(greedy_flat.any()):
                accept[greedy_flat] = target_logits[greedy_flat].argmax(dim=-1) == drafts[greedy_flat]
    # A position counts when every earlier one of its row was accepted: cumprod along the row.
    col = torch.arange(max_spec_len, device=device)
    valid = col[None, :] < counts[:, None]  # [batch, max_spec_len]
    flat = (starts[:, None] + col[None, :]).clamp_(max=num_tokens - 1)
    grid = torch.where(valid, accept[flat], False)
    n_accepted = grid.to(torch.int64).cumprod(dim=1).sum(dim=1)  # accepted prefix per row
    shown = col[None, :] < n_accepted[:, None]
    out[:, :max_spec_len] = torch.where(shown, drafts[flat].to(torch.int32), PLACEHOLDER_TOKEN_ID)

    full = n_accepted == counts
    rows = torch.arange(batch, device=device)
    rejected = rows[~full]
    if rejected.numel():
        at = starts[rejected] + n_accepted[rejected]  # each rejected row's first rejected position
        if sampling_metadata.all_greedy:
            recovered = target_logits.index_select(0, at).argmax(dim=-1)
        elif keyed is None:
            recovered = _recovered(probs.index_select(0, at), drafts[at])
        else:  # a keyed row emits the target's own sample at its first rejected position
            recovered = samples[at]
            plain = ~keyed[at]
            if bool(plain.any()):
                recovered[plain] = _recovered(probs.index_select(0, at[plain]), drafts[at[plain]])
        if greedy_flat is not None:
            greedy_at = greedy_flat[at]
            if bool(greedy_at.any()):
                recovered[greedy_at] = target_logits[at[greedy_at]].argmax(dim=-1)  # greedy rows emit the argmax
        out[rejected, n_accepted[rejected]] = recovered.to(torch.int32)
    return out, n_accepted, full


def _recovered(probs: torch.Tensor, rejected_tokens: torch.Tensor) -> torch.Tensor:
    """One token per rejected row from the residual distribution (``p`` without the rejected draft).

    Args:
        probs: ``[R, vocab]`` float32, ``p`` at the rejected positions (a copy: overwritten, the
            rejected token's probability set to 0).
        rejected_tokens: ``[R]`` int64, the draft token rejected there.

    Returns:
        ``[R]`` int64 token ids, by the two-level inverse CDF of
        :func:`integrations.vllm_ext.coupled_sampling.inverse_cdf` at one uniform per row (torch's
        multinomial and exponential draws cost ~16 ns per entry).
    """
    kept = probs.gather(1, rejected_tokens[:, None])
    probs.scatter_(1, rejected_tokens[:, None], 0.0)
    u = torch.rand(probs.shape[0], dtype=torch.float64, device=probs.device)
    tokens = coupled_sampling.inverse_cdf(probs, u)
    empty = tokens < 0  # round-off left no residual mass: sample from p itself
    if bool(empty.any()):
        rows = torch.nonzero(empty).squeeze(1)
        probs[rows] = probs[rows].scatter(1, rejected_tokens[rows, None], kept[rows])
        tokens[rows] = coupled_sampling.inverse_cdf(probs[rows], u[rows])
    return tokens


# ---- lazy bonus tokens: the bonus sampler samples only the rows whose drafts were all accepted

_bonus_rows: torch.Tensor | None = None  # [batch] bool while forward() samples bonus tokens, else None
_bonus_offsets: torch.Tensor | None = None  # [batch] int64: the rows' draft tokens, while forward() samples bonus tokens


def rejection_sampler_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap vLLM 0.32's ``RejectionSampler.forward``: verify first, then sample bonus tokens only
    for the rows that use them (rows without drafts, and rows whose drafts were all accepted).

    vLLM samples a bonus token for every row before verification, and a rejected row throws its
    bonus away: one Gumbel-max pass over the vocabulary per row (0.24 ms on this CPU), about a
    third of what verifying a drafting row costs. The rows that keep their bonus token get the
    same token as before: the CPU sampler draws one seed per row from torch's generator, for
    every row as before, and a row's token depends only on its logits and its seed
    (:func:`bonus_rows_only`). Without logprobs the raw target logits are not cloned either
    (vLLM keeps them for logprobs only).

    Steps with draft probabilities, synthetic acceptance, per-request generators or logprobs go
    to ``original`` unchanged.
    """

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        global _bonus_rows, _bonus_offsets
        if (draft_probs is not None or self.synthetic_mode or sampling_metadata.generators
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
        out, n_accepted, full = _verify(metadata.draft_token_ids, metadata.num_draft_tokens, metadata.max_spec_len,
                                        metadata.cu_num_draft_tokens, target_logits, sampling_metadata)
        _bonus_rows = full
        _bonus_offsets = torch.tensor(metadata.num_draft_tokens, dtype=torch.int64)  # a bonus token's index: n + k
        try:
            bonus = self.sampler(logits=bonus_logits, sampling_metadata=sampling_metadata,
                                 predict_bonus_token=True).sampled_token_ids
        finally:
            _bonus_rows = _bonus_offsets = None
        _place_bonus(out, n_accepted, full, bonus)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)

    forward.__das_fix__ = True
    forward.__wrapped__ = original
    return forward


def bonus_rows_only(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap vLLM 0.32's ``TopKTopPSampler.forward_cpu`` so that, while :func:`rejection_sampler_forward`
    samples bonus tokens, only the rows in ``_bonus_rows`` are sampled (the others get token 0,
    never read). The body is vLLM's: top-k/top-p on every row, one seed per row drawn for every
    row, then ``fused_gumbel_argmax`` on the kept rows with their own seeds, so each kept row
    gets the token the full call would give it."""

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
        if coupled is not None:  # keyed rows: the inverse CDF at their token's own uniform (coupled_sampling)
            keyed = torch.nonzero(want & coupled[0]).squeeze(1)
            if keyed.numel():
                sampled[keyed] = coupled_sampling.sample_rows(logits[keyed], coupled[1][keyed])
            want = want & ~coupled[0]
        kept = torch.nonzero(want).squeeze(1)
        if kept.numel():
            sampled[kept] = torch.ops._C.fused_gumbel_argmax(logits[kept].to(torch.float32), seeds[kept]).to(torch.long)
        return sampled, logits_to_return

    forward_cpu.__das_fix__ = True
    forward_cpu.__wrapped__ = original
    return forward_cpu
