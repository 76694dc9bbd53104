"""Speed fix: lazy-recovery rejection sampling, verification that costs nothing for rows without drafts.

vLLM 0.32's ``rejection_sample`` (``vllm/v1/sample/rejection_sampler.py``) draws an exponential
over ``[rows, vocab]`` every step to pre-sample a *recovered* token for every row, drafted or not,
and then runs a pass over ``[draft tokens, vocab]``. On the CPU that is most of the speculative
path's cost, paid even when no row drafted (docs/benchmarks.md, "vLLM on the CPU: what das fixes"). Only one
recovered token per row is ever used, the one at the row's first rejection, so this version
decides acceptance first and samples recovered tokens only for the rejected rows (the "lazy
recovery" of vLLM PR #41258, which does it for the GPU kernels).

How, in a handful of tensor ops whatever the batch: one softmax over every drafted position
(torch's fused softmax is the cheapest pass over the vocabulary on the CPU), the acceptance walk
as a running product over a ``[rows, max_spec_len]`` grid, then one recovered token per rejected
row by a two-level inverse CDF over the same probabilities
(:func:`~integrations.vllm_ext.patches.inverse_cdf.inverse_cdf`).

The distribution is unchanged (speculative sampling, Leviathan et al. 2023, Theorem 1). For a
draft that is a point mass on token ``x`` (n-gram, suffix and DAS drafts carry no probabilities),
position ``t`` is accepted with probability ``min(1, p(x_t) / 1) = p(x_t)`` under the target
distribution ``p`` (temperature, top-k and top-p already applied by vLLM), and at the first
rejection the token is drawn from the residual ``max(p - q, 0)`` normalised, i.e. ``p`` with
``x_t`` removed. Greedy rows (temperature 0) accept while the draft equals the target argmax and
then emit the argmax. When every draft token of a row is accepted, the row gets its bonus token.
Random numbers are drawn per call from torch's global generator. Rows with a sample key (coupled
sampling, when that feature is on) take no random numbers: a draft token is accepted iff it
equals the target's own inverse-CDF sample at its index, and a rejected position emits that
sample (the same distribution: :mod:`integrations.vllm_ext.patches.coupled_sampling`).

What this path does not do goes to vLLM's own ``rejection_sample`` for that call: draft
probabilities, per-request generators (seeded requests), synthetic acceptance, and FLy (vLLM
0.33's ``fly_window_size``: an entropy-gated deferral of rejections that is lossy by design).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from integrations.vllm_ext.patches import coupled_sampling
from integrations.vllm_ext.patches.inverse_cdf import inverse_cdf
from integrations.vllm_ext.patches.patch import Patch, replace

TARGET = "vllm.v1.sample.rejection_sampler.rejection_sample"
PLACEHOLDER_TOKEN_ID = -1  # vLLM's marker for "no token at this position"

_fallback: Callable[..., torch.Tensor] | None = None  # vLLM's own rejection_sample, for the cases above


def set_fallback(fn: Callable[..., torch.Tensor] | None) -> Callable[..., torch.Tensor] | None:
    """Record vLLM's own ``rejection_sample`` (called for what this path does not do); returns the previous one."""
    global _fallback
    previous, _fallback = _fallback, fn
    return previous


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
    fly_window_size: int | None = None,
    fly_entropy_threshold: float | None = None,
    fly_entropy_top_k: int = 3,
) -> torch.Tensor:
    """Verify draft tokens; a drop-in for ``vllm.v1.sample.rejection_sampler.rejection_sample``
    (vLLM 0.32's arguments, and 0.33's ``fly_*`` ones).

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
        synthetic_mode, synthetic_conditional_rates: vLLM's synthetic acceptance; on, the call
            goes to vLLM's sampler.
        use_fp64_gumbel: vLLM's precision of the Gumbel noise of its own recovered tokens; this
            path draws float64 uniforms whatever it says.
        fly_window_size, fly_entropy_threshold, fly_entropy_top_k: vLLM 0.33's FLy verification
            (on when ``fly_window_size`` is not None; the other two matter only then). FLy accepts
            some rejected draft tokens on purpose, which this path does not do: with it on, the
            call goes to vLLM's sampler.

    Returns:
        ``[batch_size, max_spec_len + 1]`` int32: per row the accepted draft tokens, then the
        recovered token (at the first rejection) or the bonus token, then ``-1`` padding.

    Raises:
        RuntimeError: a call this path does not do, before :func:`set_fallback` recorded vLLM's sampler.
    """
    fly = fly_window_size is not None
    if draft_probs is not None or synthetic_mode or sampling_metadata.generators or fly:
        if _fallback is None:
            raise RuntimeError("das lazy rejection sampler: no fallback sampler recorded (call set_fallback first)")
        extra = {"fly_window_size": fly_window_size, "fly_entropy_threshold": fly_entropy_threshold,
                 "fly_entropy_top_k": fly_entropy_top_k} if fly else {}  # vLLM 0.32's sampler has no fly_* arguments
        return _fallback(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                         target_logits, bonus_token_ids, sampling_metadata, synthetic_mode=synthetic_mode,
                         synthetic_conditional_rates=synthetic_conditional_rates, use_fp64_gumbel=use_fp64_gumbel, **extra)
    out, n_accepted, full = verify(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                                   target_logits, sampling_metadata)
    place_bonus(out, n_accepted, full, bonus_token_ids)
    return out


def place_bonus(out: torch.Tensor, n_accepted: torch.Tensor, full: torch.Tensor, bonus_token_ids: torch.Tensor) -> None:
    """Write each row's bonus token after its draft where every draft token was accepted (in place).

    Args:
        out: ``[batch_size, max_spec_len + 1]`` int32, :func:`verify`'s output.
        n_accepted: ``[batch_size]`` int64 accepted draft tokens per row.
        full: ``[batch_size]`` bool, rows whose drafts were all accepted.
        bonus_token_ids: ``[batch_size, 1]`` (or ``[batch_size]``) int bonus tokens.
    """
    rows = torch.nonzero(full).squeeze(1)
    out[rows, n_accepted[rows]] = bonus_token_ids.reshape(-1)[rows].to(torch.int32)


def verify(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    sampling_metadata: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Acceptance and recovered tokens of one step, without the bonus tokens.

    Args: as :func:`rejection_sample`'s.

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
    # column-by-column walk over the rows still accepting pays a dozen small ops per column, more
    # than the positions it skips (python -m benchmarks.verification).
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
            recovered = recovered_tokens(probs.index_select(0, at), drafts[at])
        else:  # a keyed row emits the target's own sample at its first rejected position
            recovered = samples[at]
            plain = ~keyed[at]
            if bool(plain.any()):
                recovered[plain] = recovered_tokens(probs.index_select(0, at[plain]), drafts[at[plain]])
        if greedy_flat is not None:
            greedy_at = greedy_flat[at]
            if bool(greedy_at.any()):
                recovered[greedy_at] = target_logits[at[greedy_at]].argmax(dim=-1)  # greedy rows emit the argmax
        out[rejected, n_accepted[rejected]] = recovered.to(torch.int32)
    return out, n_accepted, full


def recovered_tokens(probs: torch.Tensor, rejected_tokens: torch.Tensor) -> torch.Tensor:
    """One token per rejected row from the residual distribution (``p`` without the rejected draft).

    Args:
        probs: ``[R, vocab]`` float32, ``p`` at the rejected positions (a copy: overwritten, the
            rejected token's probability set to 0).
        rejected_tokens: ``[R]`` int64, the draft token rejected there.

    Returns:
        ``[R]`` int64 token ids, by the two-level inverse CDF at one uniform per row (torch's
        multinomial and exponential draws pay per vocabulary entry).
    """
    kept = probs.gather(1, rejected_tokens[:, None])
    probs.scatter_(1, rejected_tokens[:, None], 0.0)
    u = torch.rand(probs.shape[0], dtype=torch.float64, device=probs.device)
    tokens = inverse_cdf(probs, u)
    empty = tokens < 0  # round-off left no residual mass: sample from p itself
    if bool(empty.any()):
        rows = torch.nonzero(empty).squeeze(1)
        probs[rows] = probs[rows].scatter(1, rejected_tokens[rows, None], kept[rows])
        tokens[rows] = inverse_cdf(probs[rows], u[rows])
    return tokens


def install() -> None:
    def make(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        set_fallback(original)
        return rejection_sample

    replace(TARGET, make, PATCH.name)


PATCH = Patch(
    name="lazy_rejection",
    kind="speed fix",
    summary="recovered tokens sampled only for rejected rows, after acceptance is decided (no [rows, vocab] draw per step)",
    upstream="vLLM PR #41258 (lazy recovery in the GPU kernels; open); vLLM's CPU path is not covered by it",
    versions=("0.32.0",),
    cpu_only=True,
    expects={TARGET: "(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits, "
                     "bonus_token_ids, sampling_metadata, synthetic_mode=False, synthetic_conditional_rates=None, "
                     "use_fp64_gumbel=False)"},
    install=install,
    on_cuda="not needed: a speed fix of the CPU path; vLLM's GPU rejection sampler is Triton kernels (lazy recovery there is vLLM PR #41258)",
)
