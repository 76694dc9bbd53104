"""DAS's length-class budgets (arXiv 2511.13841): Long drafts most, Medium less, Short none.

Classes come from :class:`scheduler.predictor.LengthPredictor` (the problem's past rollouts and
the request's length so far). Three budgets (:mod:`scheduler.budget_protocol`):

* :class:`ClassBudget` (``class``): a fixed table of draft tokens per class (Long 16, Medium 4,
  Short 0, each capped at K), optionally gated by the batch size.
* :class:`PublishedClassBudget` (``class-eq9``): DAS's deployed class policy as published: the class
  budgets from Eq. 7 with ``N_fwd`` from Eq. 9 (:func:`class_budgets`: every request of a class
  planned at the class's mean predicted remaining length and mean estimated acceptance; Eq. 1
  constants fitted offline, as the paper fits them), a quota of :data:`DAS_QUOTA` draft tokens per
  step spent Long first, then by predicted remaining length, and drafts only while at most
  :data:`DAS_GATE` requests run (quota and gate: the authors' public fork of arctic-inference).
* :class:`ClassRooflineBudget` (``class-roofline``, ours): every row may draft up to K, but a step
  verifies at most the draft tokens its price makes free (the roofline knee, the price's
  ``free_drafts``), spent in class order (Long, Medium, Short; within a class by predicted
  remaining length). No batch gate: below the knee a draft is free, so the classes decide who
  drafts only when the step is full. Its price needs a knee: under a linear price it drafts nothing.

Units: tokens; seconds for the Eq. 1 constants.
"""

from __future__ import annotations

import math

import numpy as np

from scheduler.acceptance import DEFAULT_A, DEFAULT_K, estimate_acceptance
from scheduler.budget_protocol import Budget, BudgetSetting, StepView
from scheduler.drain_plan import optimal_proposals, solve_n_fwd
from scheduler.predictor import LONG, MEDIUM, SHORT, LengthPredictor

__all__ = ["DAS_GATE", "DAS_QUOTA", "ClassBudget", "PublishedClassBudget", "ClassRooflineBudget", "class_budgets"]

DAS_QUOTA = 160  # draft tokens per engine step (the authors' public fork)
DAS_GATE = 64  # draft only with at most this many running requests (the same fork)


def _class_order(step: StepView) -> np.ndarray:
    """Live rows, Long first, then Medium, then Short; within a class the longest predicted remaining first."""
    pr = step.prediction()
    return step.live_rows[np.lexsort((-pr.expected_remaining, -pr.cls.astype(np.int64)))]


class ClassBudget(Budget):
    """``class``: draft tokens per step by length class (DAS's deployed policy, fixed table).

    Args:
        long, medium, short: draft tokens per step for each class (ints >= 0).
        max_running: optional batch gate: no drafts in a step with more than this many running
            requests (the authors' public fork drafts only below 64 running requests).
        max_draft: optional K: every cap at most this.

    Raises:
        ValueError: a negative or non-int value (named in the message).
    """

    name = "class"
    summary = "DAS length classes from the length predictor: Long 16, Medium 4, Short 0 draft tokens, capped at K"
    runs_in = frozenset({"proposer", "grpo"})
    length_aware = True

    def __init__(self, long: int = 16, medium: int = 4, short: int = 0, *, max_running: int | None = None, max_draft: int | None = None):
        for name, v in (("long", long), ("medium", medium), ("short", short)):
            if not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"ClassBudget {name} must be an int >= 0, got {v!r}")
        if max_running is not None and (not isinstance(max_running, (int, np.integer)) or max_running < 0):
            raise ValueError(f"max_running must be None or an int >= 0, got {max_running!r}")
        if max_draft is not None and (not isinstance(max_draft, (int, np.integer)) or max_draft < 0):
            raise ValueError(f"max_draft must be None or an int >= 0, got {max_draft!r}")
        self.table = np.array([short, medium, long], dtype=np.int32)
        self.max_running = max_running
        self.max_draft = None if max_draft is None else int(max_draft)

    @classmethod
    def from_setting(cls, setting: BudgetSetting) -> ClassBudget:
        """The ``class_caps`` table (default Long 16, Medium 4, Short 0), each capped at ``max_draft``."""
        k = int(setting.max_draft)
        long, medium, short = setting.class_caps or (16, 4, 0)
        return cls(min(long, k), min(medium, k), min(short, k), max_draft=k)

    def caps_of(self, classes, running: int | None = None) -> np.ndarray:
        """Caps for ``classes`` (int array, 0 Short / 1 Medium / 2 Long) -> int32 array; all 0
        when ``running`` (default ``len(classes)``) exceeds ``max_running``."""
        c = np.asarray(classes, np.int64)
        if np.any((c < 0) | (c > 2)):
            raise ValueError(f"classes must be 0 (Short), 1 (Medium) or 2 (Long), got {np.unique(c[(c < 0) | (c > 2)])}")
        n = c.size if running is None else int(running)
        if self.max_running is not None and n > self.max_running:
            return np.zeros(c.shape, np.int32)
        return self.table[c]

    def _capped(self, caps: np.ndarray) -> np.ndarray:
        return caps if self.max_draft is None else np.minimum(caps, self.max_draft).astype(np.int32)

    def plan(self, step: StepView) -> np.ndarray:
        caps = step.caps.copy()
        if not step.live.any():
            return caps
        rows = step.live_rows
        caps[rows] = np.minimum(caps[rows], self._capped(self.caps_of(step.prediction().cls)))
        return caps

    def priority(self, step: StepView) -> np.ndarray:
        return _class_order(step)

    def request_caps(self, predictor: LengthPredictor, problem_idx: np.ndarray, samples_per_problem: int = 1) -> np.ndarray:
        """The cap of each problem's initial class (its majority class in the history)."""
        return self._capped(self.table[predictor.initial_class(np.asarray(problem_idx, np.int64))]).astype(np.int32)

    def describe(self) -> dict:
        return {"budget": self.name, "long_medium_short": self.table[::-1].tolist(), "max_running": self.max_running}


def class_budgets(cls, remaining, k, a, c_base: float, c_tok: float, max_draft: int) -> np.ndarray:
    """DAS class budgets from Eq. 7 / Eq. 9 (draft tokens per step; int ``[3]``: Short, Medium, Long).

    Every request of class ``c`` is planned at the class's mean ``remaining`` and mean ``k, a``;
    ``N_fwd`` solves Eq. 9 over the Medium and Long requests (Short never drafts), each gets Eq. 7's
    ``p_i`` spread over its passes, and the class budget is its mean rate rounded up, at most K.

    Args:
        cls: int ``[B]`` run-time class per request; remaining: float ``[B]`` predicted remaining
            tokens; k, a: float ``[B]`` acceptance estimates; c_base, c_tok: Eq. 1 constants.
    """
    cls = np.asarray(cls, np.int64)
    rem = np.asarray(remaining, np.float64)
    k = np.asarray(k, np.float64)
    a = np.asarray(a, np.float64)
    out = np.zeros(3, np.int64)
    live = cls != SHORT
    if not np.any(live):
        return out
    rr, kk, aa = np.empty(3), np.empty(3), np.empty(3)
    for c in (MEDIUM, LONG):
        m = cls == c
        if np.any(m):
            rr[c], kk[c], aa[c] = rem[m].mean(), k[m].mean(), a[m].mean()
    r_rep, k_rep, a_rep = rr[cls[live]], kk[cls[live]], aa[cls[live]]
    n_fwd = solve_n_fwd(r_rep, k_rep, a_rep, c_base, c_tok)
    p, passes = optimal_proposals(r_rep, k_rep, a_rep, n_fwd)
    rate = p / np.maximum(passes, 1.0)
    for c in (MEDIUM, LONG):
        m = cls[live] == c
        if np.any(m):
            out[c] = min(int(max_draft), int(math.ceil(float(rate[m].mean()) - 1e-9)))
    return out


class PublishedClassBudget(Budget):
    """``class-eq9``: DAS's deployed class policy as published (module doc).

    Args:
        max_draft: K.
        c_base, c_tok: the Eq. 1 constants fitted offline (seconds, seconds per token).
        quota_tokens: draft tokens per step (the fork's 160).
        gate: no drafts with more running requests than this (the fork's 64; -1: no gate).
    """

    name = "class-eq9"
    summary = ("DAS's deployed class policy as published: class budgets from Eq. 7 / Eq. 9 at each class's mean, "
               "a quota of 160 draft tokens per step spent Long first, no drafts above 64 running requests")
    runs_in = frozenset({"simulator"})
    length_aware = True
    quota = "fixed"
    quota_tokens = float(DAS_QUOTA)
    gate = DAS_GATE

    def __init__(self, max_draft: int, c_base: float, c_tok: float, *, quota_tokens: float = DAS_QUOTA, gate: int = DAS_GATE):
        self.max_draft = int(max_draft)
        self.c_base, self.c_tok = float(c_base), float(c_tok)
        self.quota_tokens, self.gate = float(quota_tokens), int(gate)
        self.last_budgets = np.zeros(3, np.int64)  # Short, Medium, Long of the last plan
        self.gated = False

    @classmethod
    def from_setting(cls, setting: BudgetSetting) -> PublishedClassBudget:
        """K and the offline Eq. 1 constants (``offline_cost``).

        Raises:
            ValueError: no ``offline_cost``.
        """
        if setting.offline_cost is None:
            raise ValueError("budget 'class-eq9' needs the Eq. 1 constants fitted offline (BudgetSetting.offline_cost = (c_base, c_tok))")
        return cls(int(setting.max_draft), *setting.offline_cost)

    @property
    def replan_at_events(self) -> bool:
        """True while the gate holds every draft back: the next finish may open it."""
        return self.gated

    def plan(self, step: StepView) -> np.ndarray:
        self.gated = self.gate >= 0 and step.rows > self.gate
        caps = np.zeros(step.rows, np.int64)
        if self.gated or not step.live.any():
            return caps
        f = step.facts
        pr = step.prediction()
        k, a = estimate_acceptance(f.drafted, f.accepted, f.steps, DEFAULT_K, DEFAULT_A)
        b = class_budgets(pr.cls, pr.expected_remaining, k, a, self.c_base, self.c_tok, self.max_draft)
        self.last_budgets = b
        rows = step.live_rows
        caps[rows] = np.minimum(step.caps[rows], b[pr.cls])
        return caps

    def priority(self, step: StepView) -> np.ndarray:
        return _class_order(step)

    def describe(self) -> dict:
        return {"budget": self.name, "c_base": self.c_base, "c_tok": self.c_tok, "quota_tokens": self.quota_tokens, "gate": self.gate}


class ClassRooflineBudget(Budget):
    """``class-roofline`` (module doc): up to K per row, at most the price's free draft tokens per step."""

    name = "class-roofline"
    summary = ("up to K per row, at most the step's roofline-knee draft tokens per step, spent in class order "
               "(Long, Medium, Short; then by predicted remaining length); ours")
    runs_in = frozenset({"simulator"})
    length_aware = True
    quota = "knee"

    def priority(self, step: StepView) -> np.ndarray:
        return _class_order(step)
