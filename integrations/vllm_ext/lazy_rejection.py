"""Lazy-recovery rejection sampling: verification that costs nothing for rows without drafts.

vLLM 0.32's ``rejection_sample`` (``vllm/v1/sample/rejection_sampler.py``) draws an exponential
over ``[rows, vocab]`` every step to pre-sample a *recovered* token for every row, drafted or not,
and then runs a pass over ``[draft tokens, vocab]``. On the CPU that is most of the speculative
path's tax: measured 39 ms per step at 32 rows x 49,152 vocab, paid even when no row drafted.
Only one recovered token per row is ever used, the one at the row's first rejection, so this
version decides acceptance first and samples recovered tokens only for the rejected rows
(the "lazy recovery" of vLLM PR #41258).

The distribution is unchanged (speculative sampling, Leviathan et al. 2023, Theorem 1). For a
draft that is a point mass on token ``x`` (n-gram, suffix and DAS drafts carry no probabilities),
position ``t`` is accepted with probability ``min(1, p(x_t) / 1) = p(x_t)`` under the target
distribution ``p`` (temperature, top-k and top-p already applied by vLLM), and at the first
rejection the token is drawn from the residual ``max(p - q, 0)`` normalised, i.e. ``p`` with
``x_t`` removed. Greedy rows (temperature 0) accept while the draft equals the target argmax and
then emit the argmax. When every draft token of a row is accepted, the row gets its bonus token.
Random numbers are drawn per call from torch's global generator (the per-request generators of
seeded requests are not supported by this fast path: such steps fall back to vLLM's sampler).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

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
    device = target_logits.device
    batch = len(num_draft_tokens)
    out = torch.full((batch, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=device)
    bonus = bonus_token_ids.reshape(-1).to(torch.int32)
    num_tokens = int(draft_token_ids.shape[0])
    if num_tokens == 0:  # no row drafted: the bonus token is the whole step (a plain decode step)
        out[:, 0] = bonus
        return out

    counts = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)
    starts = cu_num_draft_tokens.to(torch.int64) - counts
    drafts = draft_token_ids.to(torch.int64)
    greedy_rows = None if sampling_metadata.all_random else (
        torch.ones(batch, dtype=torch.bool, device=device) if sampling_metadata.all_greedy
        else sampling_metadata.temperature == 0)

    # Walk the draft positions column by column, touching only rows still accepting: p(x_t) (one
    # logsumexp over the vocabulary) is computed for about rows x acceptance length positions, not
    # for every drafted token.
    n_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    alive = torch.nonzero(counts > 0).squeeze(1)
    rejected_rows, rejected_flat = [], []
    for j in range(max_spec_len):
        alive = alive[counts[alive] > j]
        if alive.numel() == 0:
            break
        flat = starts[alive] + j
        logits = target_logits.index_select(0, flat)
        tokens = drafts[flat]
        if sampling_metadata.all_greedy:
            accept = logits.argmax(dim=-1) == tokens
        else:
            log_p = logits.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
            accept = torch.rand(len(flat), dtype=torch.float64, device=device) < log_p.to(torch.float64).exp()
            if greedy_rows is not None:
                accept = torch.where(greedy_rows[alive], logits.argmax(dim=-1) == tokens, accept)
        out[alive, j] = tokens.to(torch.int32)  # overwritten below where rejected
        rejected_rows.append(alive[~accept])
        rejected_flat.append(flat[~accept])
        alive = alive[accept]
        n_accepted[alive] = j + 1

    full = n_accepted == counts
    rows = torch.arange(batch, device=device)
    out[rows[full], n_accepted[full]] = bonus[full]
    if rejected_rows:
        rejected, flat = torch.cat(rejected_rows), torch.cat(rejected_flat)
        if rejected.numel():
            out[rejected, n_accepted[rejected]] = _recovered(target_logits.index_select(0, flat), drafts[flat],
                                                             None if greedy_rows is None else greedy_rows[rejected])
    return out


def _recovered(logits: torch.Tensor, rejected_tokens: torch.Tensor, greedy: torch.Tensor | None) -> torch.Tensor:
    """One token per rejected row from the residual distribution (``p`` without the rejected draft).

    Args:
        logits: ``[R, vocab]`` float32 target logits at the rejected positions.
        rejected_tokens: ``[R]`` int64, the draft token rejected there.
        greedy: ``[R]`` bool (rows at temperature 0 emit the argmax), or None (no greedy row).

    Returns:
        ``[R]`` int32 token ids.
    """
    # Inverse-CDF sampling over unnormalised weights: one uniform per row (torch's multinomial and
    # exponential draws cost ~16 ns per vocabulary entry on this CPU, the cumsum ~0.5 ns).
    weights = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
    weights.scatter_(1, rejected_tokens[:, None], 0.0)
    empty = weights.sum(dim=-1) <= 0  # round-off left no residual mass: sample from p itself
    if bool(empty.any()):
        weights[empty] = torch.exp(logits[empty] - logits[empty].max(dim=-1, keepdim=True).values)
    cdf = weights.to(torch.float64).cumsum_(dim=-1)
    u = torch.rand(len(cdf), 1, dtype=torch.float64, device=logits.device) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)
    if greedy is not None:
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    return tokens.to(torch.int32)
