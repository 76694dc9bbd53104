"""How many draft tokens a row may get per step: the engine's K in the long tail, fewer before it.

The engine's K (vLLM's ``num_speculative_tokens``) bounds every row's draft. While the batch is
full, a draft token is worth what it adds to the step's throughput, and a row drafts at most
:data:`BATCH_DRAFT` tokens, as before this rule existed. In the long tail, with few rows left,
each accepted token of the last rows saves a whole engine step (:mod:`scheduler.makespan`:
``v_i = c_row + c_base * q_i``, and ``q_i`` nears 1 for the row that finishes last), and near the
length cap the drafts are often loops that the drafter predicts with high probability: there a
row of a priced budget may draft up to K, and the budget keeps the tokens that pay at the step's
price (:mod:`scheduler.priced_budgets`). A budget that prices nothing (``fixed``, the length-class
and Eq. 7 budgets) has no way to tell that drafts pay, so its rows keep the batch cap everywhere.

A step is in the tail when it runs at most :data:`TAIL_SHARE` of the most rows the host ran
recently (a maximum that fades by :data:`PEAK_FADE` per step, so that a smaller next batch
becomes the reference after a while). The vLLM proposer (through
:class:`scheduler.planner.StepPlanner`) and the long-tail simulator (``benchmarks.sim_budget``)
hold one :class:`TailDrafts` each and apply it to the rows' caps before the budget plans.

Units: tokens (caps), rows.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BATCH_DRAFT", "PEAK_FADE", "TAIL_SHARE", "TailDrafts"]

BATCH_DRAFT = 16  # most draft tokens per row and step before the tail (the engine's K before the tail rule)
TAIL_SHARE = 0.125  # a step is in the tail when it runs at most this share of the recent peak rows
PEAK_FADE = 0.9995  # the peak fades by this factor per step (half-life ~1400 steps)


class TailDrafts:
    """The per-row draft cap of each step (module doc).

    Args:
        max_draft: the engine's K (most draft tokens per row and step, >= 0).
        batch_draft: the cap before the tail (>= 0; at most ``max_draft`` applies).
        tail_share: the tail's share of the peak rows, in ``[0, 1]`` (0: no tail, every step
            keeps the batch cap).
        extends: whether the tail lifts the cap to ``max_draft`` (True for a priced budget).

    Raises:
        ValueError: a negative cap or a share outside ``[0, 1]``.
    """

    def __init__(self, max_draft: int, batch_draft: int = BATCH_DRAFT, tail_share: float = TAIL_SHARE, *, extends: bool = True):
        if not isinstance(max_draft, (int, np.integer)) or max_draft < 0:
            raise ValueError(f"max_draft must be an int >= 0 (draft tokens per row and step), got {max_draft!r}")
        if not isinstance(batch_draft, (int, np.integer)) or batch_draft < 0:
            raise ValueError(f"batch_draft must be an int >= 0 (draft tokens per row and step), got {batch_draft!r}")
        if not 0.0 <= float(tail_share) <= 1.0:
            raise ValueError(f"tail_share must be in [0, 1] (a share of the peak rows), got {tail_share!r}")
        self.max_draft = int(max_draft)
        self.batch_draft = min(int(batch_draft), self.max_draft)
        self.tail_share = float(tail_share)
        self.extends = bool(extends) and self.max_draft > self.batch_draft
        self.peak = 0.0  # the most rows seen recently (fading)

    def observe(self, rows: int) -> None:
        """A step of ``rows`` rows ran (or is planned): the peak follows it."""
        self.peak = max(float(rows), self.peak * PEAK_FADE)

    def in_tail(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows is in the long tail (at most ``tail_share`` of the peak)."""
        return 0 < rows <= self.tail_share * self.peak

    def cap(self, rows: int) -> int:
        """The most draft tokens a row gets in a step of ``rows`` rows (observes the step first)."""
        self.observe(rows)
        return self.max_draft if self.extends and self.in_tail(rows) else self.batch_draft

    def limit(self, caps: np.ndarray) -> np.ndarray:
        """``caps`` (int ``[rows]``, each row's own caps) at most :meth:`cap` of this step; a new array."""
        caps = np.asarray(caps, np.int64)
        return np.minimum(caps, self.cap(caps.shape[0]))

    def describe(self) -> dict:
        return {"max_draft": self.max_draft, "batch_draft": self.batch_draft, "tail_share": self.tail_share,
                "extends": self.extends, "peak_rows": self.peak}
