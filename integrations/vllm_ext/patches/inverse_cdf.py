"""Tokens at given quantiles of a batch of distributions: the sampler of lazy recovery and coupled sampling.

:func:`inverse_cdf` is what :mod:`~integrations.vllm_ext.patches.lazy_rejection` draws recovered
tokens with and what :mod:`~integrations.vllm_ext.patches.coupled_sampling` samples keyed rows
with: the inverse cumulative distribution function over token ids in order, in two levels so that
no pass over the vocabulary is serial.
"""

from __future__ import annotations

import torch

BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens at quantiles ``u`` of the rows of ``probs`` (token ids in order).

    Two levels, one uniform per row: block sums of :data:`BLOCK` entries (one pass over the
    vocabulary), a float64 cumsum over the blocks, then one block's own float64 cumsum (a float64
    cumsum over the whole vocabulary is a serial pass). An entry of weight 0 is never chosen.

    Args:
        probs: ``[R, vocab]`` float32, non-negative (rows need not sum to 1).
        u: ``[R]`` float64 in ``[0, 1)``, scaled by each row's mass.

    Returns:
        ``[R]`` int64 token ids; -1 for a row without mass.
    """
    r, vocab = probs.shape
    pad = (-vocab) % BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(r, -1, BLOCK)
    block_cdf = blocks.sum(dim=-1).to(torch.float64).cumsum_(dim=-1)
    total = block_cdf[:, -1:]
    # u < total, also where the product rounds up: a block without mass is never chosen.
    x = torch.minimum(u.reshape(r, 1).to(torch.float64) * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, x, right=True).clamp_(max=block_cdf.shape[1] - 1)  # [R, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inner = blocks[torch.arange(r, device=probs.device), block.squeeze(1)].to(torch.float64).cumsum_(dim=-1)  # [R, BLOCK]
    # x - before lies in [0, the block's sum); the block's own cumsum can round a hair below that
    # sum, so the offset stays under its last value.
    last = inner[:, -1:]
    offset = torch.minimum(x - before, torch.nextafter(last, torch.zeros_like(last)))
    within = torch.searchsorted(inner, offset, right=True).clamp_(max=BLOCK - 1)
    tokens = (block * BLOCK + within).squeeze(1).clamp_(max=vocab - 1)
    return torch.where(total.squeeze(1) > 0, tokens, -1)
