"""What an accepted draft token saves when the batch drains: the odds that its request finishes last.

A rollout batch with no request waiting costs (DAS Eq. 2, arXiv 2511.13841, split by regime)
``T = c_base * N_fwd + c_row * sum_i N_i + c_draft * D (+ c_spec per drafting step)``, with
``N_fwd = max_i N_i`` (Eq. 4): every step pays ``c_base`` until the last request is done. One
accepted draft token of request ``i`` removes one of its steps: ``c_row`` seconds always, and
``c_base`` more if ``i`` is the request that sets ``N_fwd``. So its expected saving is

    v_i = c_row + c_base * q_i,        q_i = P(request i finishes last)         (seconds / token)

A per-step throughput rule shares ``c_base`` evenly (``q_i = 1 / B``): right when requests wait
for a free slot, wrong for a GRPO batch that only drains, where the requests predicted to run
longest own the fixed cost of every late step and the short ones own none of it. When nothing
tells the rows apart (no history, equal lengths so far) ``q_i = 1 / B`` and both rules agree.

:func:`last_finish_probability` models each request's remaining length as exponential with the
predicted mean (memoryless: a wide, honest spread for a heavy-tailed length), cut at its
``max_tokens``, independent across requests.
"""

from __future__ import annotations

import numpy as np

__all__ = ["last_finish_probability", "token_values"]


def last_finish_probability(expected_remaining, max_remaining, grid: int = 64) -> np.ndarray:
    """``q_i``: the probability that request ``i`` is the last of the batch to finish.

    Args:
        expected_remaining: float ``[rows]``, predicted remaining output tokens (> 0).
        max_remaining: float ``[rows]``, tokens left before the request's ``max_tokens`` (>= 1);
            the remaining length is exponential with the predicted mean, cut there (the cut
            mass finishes at the cap, tied with every other capped request).
        grid: cells over ``[0, max(max_remaining)]`` (>= 2).

    Returns:
        float64 ``[rows]``, non-negative, summing to 1 (uniform where the model cannot tell rows
        apart, e.g. all equal; empty for no rows).

    Raises:
        ValueError: shapes differ, a non-positive or non-finite length, or ``grid < 2``.
    """
    mean = np.asarray(expected_remaining, np.float64)
    cap = np.asarray(max_remaining, np.float64)
    if mean.shape != cap.shape or mean.ndim != 1:
        raise ValueError(f"expected_remaining {mean.shape} and max_remaining {cap.shape} must be one 1-D shape")
    if not isinstance(grid, (int, np.integer)) or grid < 2:
        raise ValueError(f"grid must be an int >= 2 cells, got {grid!r}")
    rows = mean.size
    if rows == 0:
        return np.zeros(0)
    if not (np.all(np.isfinite(mean)) and np.all(mean > 0) and np.all(np.isfinite(cap)) and np.all(cap > 0)):
        raise ValueError(f"expected_remaining must be finite and > 0 and max_remaining finite and > 0 tokens, got {mean[:4]}, {cap[:4]}")
    if rows == 1:
        return np.ones(1)
    t = np.linspace(0.0, float(cap.max()), grid + 1)  # cell k is (t[k], t[k + 1]]
    cdf = np.where(t[None, :] < cap[:, None], -np.expm1(-t[None, :] / mean[:, None]), 1.0)  # [rows, grid + 1]
    mass = np.diff(cdf, axis=1)  # P(request ends in cell k)
    # P(every other request has ended by then): the cell's midpoint CDF of each, in logs (rows can be many).
    log_mid = np.log(np.maximum(0.5 * (cdf[:, :-1] + cdf[:, 1:]), 1e-300))
    logit = np.log(np.maximum(mass, 1e-300)) + log_mid.sum(axis=0)[None, :] - log_mid
    logit = np.where(mass > 0, logit, -np.inf)
    top = logit.max(axis=1, keepdims=True)
    per_row = top[:, 0] + np.log(np.exp(logit - top).sum(axis=1))  # log P(i last), before normalising ties
    per_row -= per_row.max()
    q = np.exp(per_row)
    return q / q.sum()


def token_values(last_probability, c_base: float, c_row: float) -> np.ndarray:
    """Seconds one accepted draft token saves per row: ``c_row + c_base * q_i`` (module doc).

    Args:
        last_probability: float ``[rows]``, :func:`last_finish_probability`.
        c_base: fixed seconds per engine step (>= 0).
        c_row: seconds per row per step (>= 0).

    Returns:
        float64 ``[rows]`` seconds per accepted token.

    Raises:
        ValueError: a negative or non-finite cost.
    """
    if not (np.isfinite(c_base) and np.isfinite(c_row) and c_base >= 0 and c_row >= 0):
        raise ValueError(f"c_base and c_row must be finite and >= 0 seconds, got {c_base!r}, {c_row!r}")
    return c_row + c_base * np.asarray(last_probability, np.float64)
