"""Per-step draft selection that maximises expected throughput under the linear step-cost model.

A verification step over ``B`` rows carrying ``D`` draft tokens costs
``t = c_base + c_tok * (B + D)`` seconds (DAS Eq. 1) and yields ``B + A`` tokens, where ``A`` is the
number of accepted draft tokens. Draft token ``j`` of a row is accepted only if every earlier draft
token of that row is, so its acceptance probability is the drafter's path probability ``p_j``
(non-increasing along a row). Adding a token with probability ``p`` raises the expected yield by
``p`` and the cost by ``c_tok``, so the best set of draft tokens is a top-m prefix of all tokens
sorted by ``p``: we pick the ``m`` that maximises ``(B + sum p) / (c_base + c_tok * (B + m))``.

When the batch is large and ``c_base`` small (compute-bound verification, as on a CPU or a GPU at
RL batch sizes), the bar for a draft token approaches certainty and the step drafts little or
nothing; in the long tail (few rows, ``c_base`` dominant) it drafts freely. This is the step-level
half of the DAS budget (Eq. 7 spreads drafts over requests by length; this decides how much a
given step can afford) and it is what makes speculation never cost more than it saves, within the
model's accuracy.
"""

from __future__ import annotations

import numpy as np


def select_drafts(path_probs: list[np.ndarray], c_base: float, c_tok: float, calibration: float = 1.0) -> np.ndarray:
    """How many draft tokens each row keeps this step.

    Args:
        path_probs: one float array per row, the path probabilities of that row's draft tokens
            (non-increasing; empty for a row with no draft).
        c_base: fixed seconds per verification step (> 0).
        c_tok: seconds per token in the step (>= 0).
        calibration: multiplies every probability (observed accepted / predicted, online).

    Returns:
        int64 array ``[rows]``: the number of leading draft tokens to keep per row.

    Raises:
        ValueError: ``c_base <= 0``, ``c_tok < 0`` or ``calibration < 0``.
    """
    if not c_base > 0:
        raise ValueError(f"c_base must be > 0 seconds, got {c_base!r}")
    if not c_tok >= 0:
        raise ValueError(f"c_tok must be >= 0 seconds per token, got {c_tok!r}")
    if not calibration >= 0:
        raise ValueError(f"calibration must be >= 0, got {calibration!r}")
    rows = len(path_probs)
    keep = np.zeros(rows, np.int64)
    lengths = np.fromiter((len(p) for p in path_probs), np.int64, rows)
    if lengths.sum() == 0:
        return keep
    probs = np.concatenate([np.asarray(p, np.float64) for p in path_probs]) * calibration
    owner = np.repeat(np.arange(rows), lengths)
    order = np.argsort(-probs, kind="stable")
    gain = rows + np.cumsum(probs[order])  # expected tokens with the top m+1 drafts
    cost = c_base + c_tok * (rows + np.arange(1, len(order) + 1))
    rate = gain / cost
    best = int(np.argmax(rate))
    if rate[best] <= rows / (c_base + c_tok * rows):  # no draft at all beats every choice
        return keep
    np.add.at(keep, owner[order[: best + 1]], 1)
    return keep

