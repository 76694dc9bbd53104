"""Budgets that keep the draft tokens that pay for their verification at the step's price.

* :class:`CostBudget` (``cost``, the product's default): the throughput rule of
  :func:`scheduler.draft_selection.choose_drafts`: keep the most probable draft tokens while they
  raise the step's expected tokens per second above a plain step's.
* :class:`MakespanBudget` (``makespan``): the saving rule: a row's accepted draft token is worth
  what it saves a batch that only drains, ``c_row + c_base * q_i`` with ``q_i`` the odds that the
  request finishes last given the length predictor (:mod:`scheduler.makespan`, DAS Eq. 2 split by
  regime); keep the tokens whose expected saving beats their price.

Under a price with a knee (``free_drafts > 0``: a memory-bound GPU step, flat below the knee) both
spend the step's free draft tokens on the rows predicted to finish last first
(:meth:`~CostBudget.free_weights`): in a draining batch those rows set the makespan, so their
accepted tokens save whole steps while a short row's save nearly nothing (DAS spends its drafts
on the Long class first for the same reason); the tokens above the knee follow the rule and the
price. Under a linear price (no knee) nothing is free and the decisions are the price's alone.

Both read from the :class:`scheduler.budget_protocol.StepView` its ``price``
(:class:`scheduler.step_price.LinearPrice`, online :class:`scheduler.knee_cost.KneeCost`), the rows' ``calibration`` factors and the
``prob_map`` of raw to calibrated path probabilities, which the host sets: the vLLM proposer's
:class:`scheduler.planner.StepPlanner` from its online fits; the simulator from its step-cost and
acceptance models.

Besides :meth:`~CostBudget.keep`, a priced budget can say before the drafter runs that no draft
can pay (:meth:`~CostBudget.can_pay`: the host skips the drafter's lookups), and where each row's
draft may stop because the step would cut it there anyway (:meth:`~CostBudget.cutoff`): the same
drafts reach the engine for fewer lookups. Under the throughput rule the cut is guessed near the
last step's keep threshold in large steps (:data:`GUESS_ROWS`) and checked after the selection
(:meth:`~CostBudget.cut_held`); a host drafts again at the safe bound when the check fails. A
price with a knee (``free_drafts > 0``) gets no cut and passes the gate (both rules assume a
linear price).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from scheduler.budget_protocol import Budget, Drafts, StepView
from scheduler.draft_selection import choose_drafts, cut_kept_the_same, drafting_can_pay, keep_bounds
from scheduler.makespan import last_finish_probability, token_values

__all__ = ["FREE_WEIGHT_POWER", "GUESS_ROWS", "GUESS_SHARE", "CostBudget", "DraftCut", "MakespanBudget"]

GUESS_SHARE = 0.9  # a step's drafts are cut at this share of the last step's keep threshold (checked after the selection)
GUESS_ROWS = 128  # ... in steps of this many rows or more, where that threshold moves little from step to step
# Under a knee, a row's draft tokens rank for the free drafts by p * (its predicted remaining / the
# longest's) ** this: a row predicted at half the longest counts an eighth, so the rows on the
# critical path draft first, yet a long row's unlikely tokens do not crowd out a likely token of a
# row nearly as long (the simulator's comparison of powers: docs/benchmarks.md).
FREE_WEIGHT_POWER = 3


class DraftCut(NamedTuple):
    """Where a priced step's drafts may stop, in calibrated probability: ``theta`` (a float for
    all rows, or float64 ``[rows]``, each row's own) and, for a guess, the safe ``bound``
    (:func:`scheduler.draft_selection.keep_bound`) it was guessed above; ``checked``: whether
    :meth:`CostBudget.cut_held` must confirm it after the selection."""

    theta: float | np.ndarray
    bound: float
    checked: bool


class CostBudget(Budget):
    """``cost``: keep the draft tokens whose calibrated path probability pays for their verification.

    Args:
        guess_rows: steps with at least this many rows guess their cut near the last step's keep
            threshold (default :data:`GUESS_ROWS`, read at each step).
        guess_share: the share of that threshold the guess cuts at (:data:`GUESS_SHARE`).
    """

    name = "cost"
    summary = ("keep the draft tokens whose calibrated path probability pays for their verification under the step-cost model "
               "fitted online, with drafts free below a knee where the steps show one (scheduler.draft_selection, scheduler.knee_cost)")
    runs_in = frozenset({"proposer", "simulator"})
    priced = True

    def __init__(self, *, guess_rows: int | None = None, guess_share: float = GUESS_SHARE):
        self.guess_rows = guess_rows
        self.guess_share = float(guess_share)
        self.keep_rate: float | None = None  # tokens per second where the last step's selection peaked

    def values(self, step: StepView) -> np.ndarray | None:
        """Seconds one accepted draft token saves, per row; None: the throughput rule."""
        return None

    def free_weights(self, step: StepView) -> np.ndarray | None:
        """Per row, the weight of its draft tokens for the step's free draft tokens (a price with
        a knee): the row's predicted remaining length (:meth:`StepView.remaining`, at least 1 and
        at most the tokens left before ``max_tokens``) over the batch's longest, to the power
        :data:`FREE_WEIGHT_POWER` (float64 ``[rows]`` in ``[0, 1]``), 0 for rows that
        may not draft, so the free drafts go to the rows predicted to finish last first (the
        makespan's critical path; DAS's Long class first). None under a linear price (no free
        drafts: the decisions are the price's alone), without live rows, or when the host gave no
        length facts (:attr:`StepView.has_facts`: the probabilities alone order the free drafts).
        Computed once per step."""
        if not step.price.free_drafts or not step.live.any() or not step.has_facts:
            return None
        if "free_weights" not in step.memo:
            f = step.facts
            left = np.maximum(np.asarray(f.max_tokens, np.float64) - np.asarray(f.generated, np.float64), 1.0)
            w = np.zeros(step.rows)
            w[step.live_rows] = np.clip(step.remaining(), 1.0, left)
            step.memo["free_weights"] = (w / w.max()) ** FREE_WEIGHT_POWER
        return step.memo["free_weights"]

    def can_pay(self, step: StepView, caps: np.ndarray, best_prob: float) -> bool:
        """Whether any draft could pay this step if every draft token had calibrated probability
        ``best_prob`` (:func:`scheduler.draft_selection.drafting_can_pay`); ``caps``: the rows'
        caps (their sum bounds the draft tokens)."""
        price = step.price
        if price.free_drafts:
            return True
        values = self.values(step)
        return drafting_can_pay(step.rows, int(caps.sum()), *price.as_tuple(), best_prob, None if values is None else float(values.max()))

    def cutoff(self, step: StepView) -> DraftCut | None:
        """Where this step's drafts may stop (:class:`DraftCut`), None: nowhere (a knee price).

        None is kept whose calibrated probability is at or below
        :func:`scheduler.draft_selection.keep_bound` (the saving rule: each row's own). Under the
        throughput rule, in steps of ``guess_rows`` rows or more, the cut is guessed at
        ``guess_share`` of the last step's keep threshold (``per_draft_s`` times the rate its
        selection peaked at), which lies well above that bound, and checked after the selection.
        """
        price = step.price
        if price.free_drafts:
            return None
        values = self.values(step)
        bound = keep_bounds(step.rows, *price.as_tuple(), values)
        if values is not None:
            return DraftCut(bound, 0.0, False)
        theta = bound
        guess_rows = GUESS_ROWS if self.guess_rows is None else self.guess_rows
        if self.keep_rate is not None and step.rows >= guess_rows:
            theta = max(bound, self.guess_share * price.per_draft_s * self.keep_rate)
        return DraftCut(theta, bound, True)

    def cut_held(self, step: StepView, cut: DraftCut) -> bool:
        """Whether drafts stopped at ``cut`` kept what drafts down to its safe bound would
        (:func:`scheduler.draft_selection.cut_kept_the_same`, from ``step.peak``)."""
        return not cut.checked or cut_kept_the_same(cut.theta, cut.bound, step.price.per_draft_s, step.peak)

    def keep(self, step: StepView, drafts: Drafts) -> np.ndarray:
        price = step.price
        return choose_drafts(drafts.probs, *price.as_tuple(), step.calibration, prob_map=step.prob_map, values=self.values(step),
                             lengths=drafts.lengths, peak=step.peak, free_drafts=price.free_drafts,
                             free_weights=self.free_weights(step))

    def learn(self, step: StepView) -> None:
        """After the step's final selection: remember where its rate peaked (the next guess)."""
        if step.peak.get("tokens"):
            self.keep_rate = step.peak["rate"]

    def describe(self) -> dict:
        return {"budget": self.name, "keep_rate": self.keep_rate}


class MakespanBudget(CostBudget):
    """``makespan``: ``cost`` with each row's accepted token valued at what it saves a draining batch."""

    name = "makespan"
    summary = ("'cost', with each row's accepted token valued at what it saves a draining batch: c_row plus c_base times "
               "the odds that its request finishes last, from the length predictor (scheduler.makespan)")
    runs_in = frozenset({"proposer", "simulator"})
    length_aware = True

    def values(self, step: StepView) -> np.ndarray | None:
        """``c_row + c_base * q_i`` per row (seconds per accepted token), with ``q_i`` the odds that
        the row's request finishes last (:func:`scheduler.makespan.last_finish_probability`) from
        the length predictor's expected remaining length (at most ``max_tokens`` so far); rows that
        may not draft have ``q = 0``. None without live rows. Computed once per step."""
        if "values" in step.memo:
            return step.memo["values"]
        values = None
        if step.live.any():
            f = step.facts
            pred = f.predictor
            generated = np.asarray(f.generated, np.float64)
            left = np.maximum(f.max_tokens - generated, 1.0)
            expected = pred.predict(f.problem_idx, np.minimum(generated, pred.max_tokens)).expected_remaining
            q = np.zeros(step.rows)
            q[step.live_rows] = last_finish_probability(np.clip(expected, 1.0, left), left)
            values = token_values(q, step.price.fixed_s, step.price.per_row_s)
        step.memo["values"] = values
        return values
