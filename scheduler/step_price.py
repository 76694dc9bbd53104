"""The price of one engine step, as a speculation budget reads it.

A priced budget (:mod:`scheduler.priced_budgets`) keeps the draft tokens that pay for their
verification. What it needs of the step-cost model, for a step of ``B`` rows:

* ``plain_s``: seconds of the step without draft tokens;
* ``spec_base_s``: seconds of the step with draft tokens, before the draft tokens' own cost (it
  can exceed ``plain_s``: the rejection sampler and the draft bookkeeping run only then);
* ``per_draft_s``: seconds per draft token verified;
* ``free_drafts``: draft tokens the step verifies at no cost of their own (a step flat below a
  knee, e.g. a memory-bound GPU decode step: the draft tokens below the knee, for this step's
  rows); 0 for a linear price;
* ``fixed_s`` and ``per_row_s``: the step's fixed seconds and seconds per row (DAS Eq. 1's
  ``c_base`` and ``c_tok`` for a sampled token), which the ``makespan`` budget turns into what one
  accepted token saves (:func:`scheduler.makespan.token_values`).

So ``m`` draft tokens cost ``spec_base_s + per_draft_s * max(m - free_drafts, 0)`` seconds.
:class:`LinearPrice` holds every price: one line from the user's ``c_base``/``c_tok``
(:meth:`LinearPrice.given`), the online fit (:meth:`scheduler.knee_cost.KneeCost.price`: the
two-regime line of :meth:`scheduler.regime_cost.TwoRegimeCost.price`, or a knee below which
draft tokens are free where the steps show one), or the simulator's GPU (``benchmarks.simulate``).

Units: seconds; draft tokens; rows.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LinearPrice"]


@dataclass(frozen=True)
class LinearPrice:
    """One step's price, linear in the draft tokens above ``free_drafts`` (module doc).

    Attributes:
        plain_s: seconds of the step without drafts (> 0).
        spec_base_s: seconds with drafts, before their own cost (> 0).
        per_draft_s: seconds per draft token (>= 0).
        fixed_s: the step's fixed seconds (``c_base``, >= 0).
        per_row_s: seconds per row (``c_row`` / ``c_tok``, >= 0).
        free_drafts: draft tokens priced at nothing (>= 0; 0 for a line).
    """

    plain_s: float
    spec_base_s: float
    per_draft_s: float
    fixed_s: float
    per_row_s: float
    free_drafts: float = 0.0

    @classmethod
    def given(cls, c_base: float, c_tok: float, rows: int) -> LinearPrice:
        """DAS Eq. 1 for both regimes, ``t = c_base + c_tok * tokens``, at ``rows`` rows: a draft
        token costs what a row's token costs (the proposer's ``c_base``/``c_tok`` settings).

        Raises:
            ValueError: a negative or non-finite coefficient.
        """
        if not (c_base >= 0 and c_tok >= 0) or c_base == float("inf") or c_tok == float("inf"):
            raise ValueError(f"c_base and c_tok must be finite and >= 0 seconds, got {c_base!r}, {c_tok!r}")
        plain = max(c_base + c_tok * rows, 1e-9)
        return cls(plain, plain, c_tok, c_base, c_tok)

    def speculative_s(self, drafts: float) -> float:
        """Seconds of the step with ``drafts`` (> 0) draft tokens."""
        return self.spec_base_s + self.per_draft_s * max(drafts - self.free_drafts, 0.0)

    def as_tuple(self) -> tuple[float, float, float]:
        """``(plain_s, spec_base_s, per_draft_s)``, the arguments of :mod:`scheduler.draft_selection`."""
        return self.plain_s, self.spec_base_s, self.per_draft_s
