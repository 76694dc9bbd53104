"""What a speculation budget is: the step it sees, the drafts it keeps from, and its two verbs.

A speculation budget decides how many draft tokens each running request verifies per engine
step. Every budget is one subclass of :class:`Budget` and builds itself from what its host knows
(:meth:`Budget.from_setting`, a :class:`BudgetSetting`); the registry of names is
:mod:`scheduler.budgets`. The vLLM proposer (through :class:`scheduler.planner.StepPlanner`), the
GRPO loop (:class:`scheduler.budgets.RequestCaps`) and the long-tail simulator hold instances of
the same classes. A budget acts at two points of a step:

* :meth:`Budget.plan` ``(step) -> caps``, before the drafter runs: the most draft tokens each row
  may get (a length-class or Eq. 7 budget decides here, per request);
* :meth:`Budget.keep` ``(step, drafts) -> kept``, after the drafter proposed: how many leading
  draft tokens of each row the step verifies (a priced budget decides here, from each candidate's
  calibrated path probability and the step's price; a quota budget spends its quota in its
  priority order).

A budget that keeps drafts by the step's price is a :class:`PricedBudget` (the sub-protocol its
host drives: the host sets the step's price, calibration and probability map, asks
:meth:`PricedBudget.can_pay` before any drafter lookup and :meth:`PricedBudget.cutoff` for where
the drafts may stop); hosts tell one by ``isinstance(budget, PricedBudget)``.

The :class:`StepView` holds what the host knows about the step: each row's own cap, which rows
may draft, and (computed only when a budget asks) the rows' length facts (:class:`RowFacts`);
a host that prices steps also sets the step's price, the rows' calibration factors and the
probability map.

Units: tokens (caps, lengths, drafts), seconds (prices).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np

from scheduler.predictor import LengthPredictor, Prediction
from scheduler.step_price import LinearPrice

if TYPE_CHECKING:
    from scheduler.drain_plan import CostModel

__all__ = ["Budget", "BudgetSetting", "Drafts", "PricedBudget", "RowFacts", "StepView", "allot_in_order"]


@dataclass
class BudgetSetting:
    """What a host knows that a budget may need (:meth:`Budget.from_setting`).

    Attributes:
        max_draft: K, the most draft tokens per row and step.
        cost: the host's online step-cost line (``eq7``; default: a fresh unfitted one).
        offline_cost: ``(c_base, c_tok)`` Eq. 1 constants fitted offline (``class-eq9``; seconds).
        class_caps: ``(long, medium, short)`` draft tokens of ``class`` (default ``(16, 4, 0)``,
            each capped at K).
        seed: seed of ``eq7``'s stochastic rounding (None: round to nearest).
        draft_while_unfitted: ``eq7`` leaves the rows' caps while ``cost`` is not fitted (True)
            instead of drafting nothing.
    """

    max_draft: int = 16
    cost: CostModel | None = None
    offline_cost: tuple[float, float] | None = None
    class_caps: tuple[int, int, int] | None = None
    seed: int | None = 0
    draft_while_unfitted: bool = False


class Drafts(NamedTuple):
    """The drafter's candidates for one step: ``probs`` float ``[rows, K]`` raw path probabilities,
    the first ``lengths[r]`` of row ``r`` (non-increasing along a row); ``lengths`` int64 ``[rows]``;
    ``tokens`` int32 ``[rows, K]`` (None where only the probabilities exist, e.g. the simulator)."""

    probs: np.ndarray
    lengths: np.ndarray
    tokens: np.ndarray | None = None


@dataclass
class RowFacts:
    """Length and acceptance facts of the rows that may draft (``StepView.live``, in row order).

    Attributes:
        predictor: the :class:`scheduler.predictor.LengthPredictor` (length history) of the host.
        problem_idx: int64 ``[L]`` from ``predictor.index`` (-1: no history).
        generated: float64 ``[L]`` output tokens so far.
        max_tokens: ``[L]`` each request's most output tokens.
        drafted, accepted, steps: ``[L]`` draft tokens offered, draft tokens accepted and
            verification steps of each request so far (its Eq. 3 acceptance evidence).
        context: optional ``[L]`` prompt + output tokens (KV cache) of each request.
        remaining, k, a: optional ``[L]`` overrides of the predicted remaining tokens and of the
            Eq. 3 acceptance parameters (oracles, tests).
    """

    predictor: LengthPredictor
    problem_idx: np.ndarray
    generated: np.ndarray
    max_tokens: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray
    steps: np.ndarray
    context: np.ndarray | None = None
    remaining: np.ndarray | None = None
    k: np.ndarray | None = None
    a: np.ndarray | None = None


class StepView:
    """One engine step as a budget sees it.

    Args:
        caps: int64 ``[rows]``: each row's own most draft tokens this step (K, the room left
            before the model's length limit, the request's ``das_max_draft_tokens``); 0 for a row
            that may not draft.
        live: bool ``[rows]``: the rows that may draft (default all). A row that is not live is
            still a row of the step (it is verified, and it costs).
        facts: :class:`RowFacts` of the live rows, or a function returning them (called at most
            once, when a budget first reads :attr:`facts`: a host computes no predictions for a
            budget that reads none).
        accepted, predicted: optional ``[L]`` per live row, the request's accepted draft tokens
            and the sum of the calibrated probabilities of the draft tokens it was offered (its own
            calibration evidence; a pricing host reads them).

    Attributes set by a pricing host (:class:`scheduler.planner.StepPlanner`, the simulator):
        price: :class:`scheduler.step_price.LinearPrice` of the step, or None (not measured yet).
        calibration: float64 ``[rows]`` factors on each row's calibrated probabilities.
        prob_map: None or a non-decreasing map of raw to calibrated probabilities with a
            ``curve()`` (:class:`scheduler.acceptance.AcceptanceCalibration`).

    Raises:
        ValueError: ``caps`` not 1-D, or ``live`` of another shape.
    """

    def __init__(self, caps, live=None, *, facts: RowFacts | Callable[[], RowFacts] | None = None, accepted=None, predicted=None):
        self.caps = np.asarray(caps, np.int64)
        if self.caps.ndim != 1:
            raise ValueError(f"caps must be a 1-D int array (draft tokens per row), got shape {self.caps.shape}")
        self.live = np.ones(self.caps.shape, bool) if live is None else np.asarray(live, bool)
        if self.live.shape != self.caps.shape:
            raise ValueError(f"live {self.live.shape} and caps {self.caps.shape} must have one shape")
        self._facts = facts
        self.accepted, self.predicted = accepted, predicted
        self.price: LinearPrice | None = None
        self.calibration: np.ndarray | None = None
        self.prob_map: Any = None
        self.memo: dict[str, Any] = {}  # what a budget computed from this step once (e.g. token values)
        self._live_rows: np.ndarray | None = None

    @property
    def rows(self) -> int:
        """Rows in the step."""
        return int(self.caps.shape[0])

    @property
    def live_rows(self) -> np.ndarray:
        """int64 indices of the live rows (the rows of :attr:`facts`)."""
        if self._live_rows is None:
            self._live_rows = np.flatnonzero(self.live)
        return self._live_rows

    @property
    def has_facts(self) -> bool:
        """Whether the host gave the rows' :class:`RowFacts` (a budget that only refines its
        choice with them goes without when not)."""
        return self._facts is not None

    @property
    def facts(self) -> RowFacts:
        """The live rows' :class:`RowFacts` (computed on first use).

        Raises:
            ValueError: the host gave none (a length-aware budget needs them).
        """
        if callable(self._facts):
            self._facts = self._facts()
        if self._facts is None:
            raise ValueError("this budget needs the rows' length facts (StepView(facts=...)), and the host gave none")
        return self._facts

    def prediction(self) -> Prediction:
        """The length predictor's :class:`scheduler.predictor.Prediction` for the live rows at
        their length so far (computed once per step)."""
        if "prediction" not in self.memo:
            f = self.facts
            self.memo["prediction"] = f.predictor.predict(f.problem_idx, f.generated)
        return self.memo["prediction"]

    def remaining(self) -> np.ndarray:
        """float64 ``[L]`` predicted remaining output tokens of the live rows (the override when given)."""
        f = self.facts
        return np.asarray(f.remaining if f.remaining is not None else self.prediction().expected_remaining, np.float64)


class Budget:
    """Base of every speculation budget (module doc). Subclasses set the class attributes and
    override :meth:`plan` and/or :meth:`keep`.

    Class attributes:
        name, summary: the registry name and its one-line description (:mod:`scheduler.budgets`).
        runs_in: hosts the budget is offered in: ``proposer`` (vLLM, per engine step),
            ``grpo`` (per-request caps at submission, the GRPO loop's ``scheduler.budget``),
            ``simulator`` (``benchmarks.simulate``).
        drafts: False for a budget that never drafts.
        static: True when the caps depend on nothing but the rows' own caps (a host need not
            re-plan as rows progress).
        uses_cost_fit: True for a budget that reads an online :class:`scheduler.drain_plan.CostModel`
            of the host's step times.
        length_aware: True for a budget that reads the length predictor (``StepView.facts``).
        quota: ``None`` (no per-step quota), ``"fixed"`` (:attr:`quota_tokens` draft tokens per
            step) or ``"knee"`` (the step price's ``free_drafts``), spent in :meth:`priority` order.
        quota_tokens: the fixed quota, draft tokens per step.
        gate: no drafts in a step with more running rows than this (-1: no gate).
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    runs_in: ClassVar[frozenset[str]] = frozenset()
    drafts: ClassVar[bool] = True
    static: ClassVar[bool] = False
    uses_cost_fit: ClassVar[bool] = False
    length_aware: ClassVar[bool] = False
    quota: ClassVar[str | None] = None
    quota_tokens: float = 0.0
    gate: int = -1

    @classmethod
    def from_setting(cls, setting: BudgetSetting) -> Budget:
        """A fresh budget of this class from what the host knows (the registry's one way to build
        one, :func:`scheduler.budgets.make_budget`); the base takes no setting.

        Raises:
            ValueError: the setting lacks what the budget needs (named in the message).
        """
        return cls()

    def plan(self, step: StepView) -> np.ndarray:
        """Draft caps before the drafter runs: int64 ``[rows]``, each at most ``step.caps``."""
        return step.caps.copy()

    def keep(self, step: StepView, drafts: Drafts) -> np.ndarray | None:
        """Leading draft tokens each row keeps of ``drafts`` (int64 ``[rows]``), or None: all of
        them. A quota budget spends its quota on the rows' drafts in :meth:`priority` order."""
        if self.quota is None:
            return None
        quota = self.quota_tokens if self.quota == "fixed" else (step.price.free_drafts if step.price is not None else 0.0)
        order = self.priority(step)
        if order is None:
            order = np.arange(step.rows)
        return np.floor(allot_in_order(drafts.lengths.astype(np.float64), order, step.live, float(quota))).astype(np.int64)

    @property
    def replan_at_events(self) -> bool:
        """Whether the budget holds every draft back until an event (a request finishing or
        starting) may change that: a host that plans every few steps plans again at the next event."""
        return False

    def priority(self, step: StepView) -> np.ndarray | None:
        """Rows (int64 indices into the step) in the order that a quota or a scarce KV cache
        serves them, highest first; None: the host's order."""
        return None

    def request_caps(self, predictor: LengthPredictor, problem_idx: np.ndarray, samples_per_problem: int = 1) -> np.ndarray:
        """Per-problem caps fixed at submission (``SamplingParams.extra_args["das_max_draft_tokens"]``):
        int32 ``[P]`` draft tokens per step.

        Raises:
            ValueError: the budget decides per step only.
        """
        raise ValueError(f"budget {self.name!r} decides per engine step; it sets no per-request caps at submission")

    def describe(self) -> dict[str, Any]:
        """The budget's name and settings (for logs)."""
        return {"budget": self.name}


class PricedBudget(Budget):
    """A budget that keeps the draft tokens that pay for their verification at the step's price.

    Its host (:class:`scheduler.planner.StepPlanner`, the simulator) sets, before asking it
    anything, ``StepView.price`` (:class:`scheduler.step_price.LinearPrice`; the planner asks
    nothing while it is None), ``calibration`` and ``prob_map``, and measures the price. Besides
    :meth:`Budget.keep` (which tokens the step verifies), the host asks before the drafter runs
    whether any draft can pay (:meth:`can_pay`: else it skips the lookups) and where each row's
    draft may stop (:meth:`cutoff`: the same drafts reach the engine for fewer lookups).
    """

    def can_pay(self, step: StepView, caps: np.ndarray, best_prob: float) -> bool:
        """Whether any draft could pay this step if every draft token had calibrated probability
        ``best_prob``; ``caps``: int64 ``[rows]``, the rows' caps (their sum bounds the draft tokens)."""
        raise NotImplementedError

    def cutoff(self, step: StepView) -> float | np.ndarray | None:
        """The calibrated probability at or below which the step keeps no draft token (a float for
        all rows, or float64 ``[rows]``), so the drafter may stop there; None: nowhere."""
        raise NotImplementedError


def allot_in_order(want, order, running, budget):
    """Draft tokens per row under a total ``budget`` (tokens), spent on the rows' wanted drafts
    ``want`` (float64 ``[n]``) in ``order`` (row indices, highest priority first); rows not
    ``running`` (bool ``[n]``) get none; the last row served may get a part. Returns float64
    ``[n]``. Plain Python loops over arrays, so that the simulator can compile it with numba
    (``benchmarks.sim_engine``) and run the same rule."""
    out = np.zeros(want.size)
    left = max(budget, 0.0)
    for j in range(order.size):
        if left <= 0:
            break
        i = order[j]
        if not running[i] or want[i] <= 0:
            continue
        g = want[i] if want[i] <= left else left
        out[i] = g
        left -= g
    return out
