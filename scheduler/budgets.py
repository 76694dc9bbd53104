"""The speculation budgets: one registry of names, one class per budget, where each is offered.

A budget decides how many draft tokens each running request verifies per engine step
(:mod:`scheduler.budget_protocol`). This module is the one place that maps a name to its class
(:data:`BUDGETS`); the vLLM proposer (``additional_config['das']['budget']``,
:mod:`integrations.vllm_ext.proposer`), :class:`scheduler.speculation.SpeculationScheduler`, the
``das-rollout`` flags (``--budget``, ``--compare das:<budget>``), the recipes
(``speculative.das.budget``, ``scheduler.budget``) and the long-tail simulator
(``benchmarks/simulate.py --policies``) build their budget with :func:`make_budget`. Where each one
is offered is its class's ``runs_in``:

* ``proposer``: inside vLLM, per engine step (:class:`scheduler.planner.StepPlanner`);
* ``scheduler``: :class:`~scheduler.speculation.SpeculationScheduler` (caps before the drafter);
* ``grpo``: per-request caps fixed at submission (:class:`scheduler.speculation.RequestCaps`);
* ``simulator``: ``benchmarks.simulate`` (simulated GPUs, no vLLM).

Old names are refused with an error that gives the new one (:data:`RENAMED`), never mapped
silently, so one budget never shows up under two names in results.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler.budget_protocol import Budget, StepView
from scheduler.class_budgets import ClassBudget, ClassEq9Budget, ClassRooflineBudget
from scheduler.cost_model import CostModel
from scheduler.eq7 import Eq7Budget
from scheduler.predictor import LengthPredictor
from scheduler.priced_budgets import CostBudget, MakespanBudget

__all__ = ["BUDGETS", "RENAMED", "BudgetSetting", "FixedBudget", "NoneBudget", "budget_class", "describe", "make_budget", "names", "resolve"]


class NoneBudget(Budget):
    """``none``: no draft tokens."""

    name = "none"
    summary = ("no draft tokens (in the proposer: vLLM's speculative path and the drafter's inserts, drafting nothing: "
               "their per-step cost on their own, against the method none)")
    runs_in = frozenset({"proposer", "scheduler", "grpo", "simulator"})
    drafts = False
    static = True

    def plan(self, step: StepView) -> np.ndarray:
        return np.zeros(step.rows, np.int64)

    def request_caps(self, predictor: LengthPredictor, problem_idx: np.ndarray, samples_per_problem: int = 1) -> np.ndarray:
        return np.zeros(np.asarray(problem_idx).size, np.int32)


class FixedBudget(Budget):
    """``fixed``: each row's own cap (up to K) whenever the drafter finds a match.

    Args:
        max_draft: K, the per-request cap :meth:`request_caps` gives.
    """

    name = "fixed"
    summary = "up to K draft tokens per row whenever the drafter finds a match (the paper's 'unlimited draft budget')"
    runs_in = frozenset({"proposer", "scheduler", "grpo", "simulator"})
    static = True

    def __init__(self, max_draft: int = 16):
        self.max_draft = int(max_draft)

    def request_caps(self, predictor: LengthPredictor, problem_idx: np.ndarray, samples_per_problem: int = 1) -> np.ndarray:
        return np.full(np.asarray(problem_idx).size, self.max_draft, np.int32)


BUDGETS: dict[str, type[Budget]] = {c.name: c for c in (
    NoneBudget, FixedBudget, CostBudget, MakespanBudget, ClassBudget, ClassEq9Budget, ClassRooflineBudget, Eq7Budget)}

# Former names: refused with an error that names the new one.
RENAMED: dict[str, str] = {"unlimited": "fixed", "das": "class-eq9", "das-roofline": "class-roofline"}


@dataclass
class BudgetSetting:
    """What a host knows that a budget may need, for :func:`make_budget`.

    Attributes:
        max_draft: K, the most draft tokens per row and step.
        cost: the host's online step-cost fit (``eq7``; default: a fresh unfitted one).
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


def names(runs_in: str | None = None) -> tuple[str, ...]:
    """Budget names in registry order, those offered in ``runs_in`` (``proposer``, ``scheduler``,
    ``grpo``, ``simulator``) or all."""
    return tuple(n for n, c in BUDGETS.items() if runs_in is None or runs_in in c.runs_in)


def resolve(name: object, runs_in: str | None = None) -> str:
    """``name`` checked against the registry (and, with ``runs_in``, against where it is offered).

    Raises:
        ValueError: an unknown name, a former name (the message gives the new one), or a budget that
            is not offered in ``runs_in``; the message lists the valid names.
    """
    valid = names(runs_in)
    where = f" ({runs_in})" if runs_in else ""
    if not isinstance(name, str):
        raise ValueError(f"a budget name must be a string, one of {list(valid)}, got {name!r}")
    if name in RENAMED:
        raise ValueError(f"budget {name!r} is now called {RENAMED[name]!r}")
    if name not in valid:
        if name in BUDGETS:
            runs = sorted(BUDGETS[name].runs_in)
            raise ValueError(f"budget {name!r} runs only in the {' and '.join(runs)}; expected one of {list(valid)}{where}")
        raise ValueError(f"unknown budget {name!r}; expected one of {list(valid)}{where}")
    return name


def budget_class(name: object, runs_in: str | None = None) -> type[Budget]:
    """The class of budget ``name`` (checked as :func:`resolve`)."""
    return BUDGETS[resolve(name, runs_in)]


def describe(runs_in: str | None = None) -> str:
    """One line per budget, ``name: summary`` (for help texts)."""
    return "; ".join(f"'{n}': {BUDGETS[n].summary}" for n in names(runs_in))


def make_budget(name: object, runs_in: str | None = None, setting: BudgetSetting | None = None) -> Budget:
    """A fresh budget ``name`` (checked as :func:`resolve`) built from what the host knows.

    Raises:
        ValueError: a bad name (as :func:`resolve`), or ``class-eq9`` without ``offline_cost``.
    """
    cls = budget_class(name, runs_in)
    s = setting or BudgetSetting()
    k = int(s.max_draft)
    if cls is FixedBudget:
        return FixedBudget(k)
    if cls is ClassBudget:
        long, medium, short = s.class_caps or (16, 4, 0)
        return ClassBudget(min(long, k), min(medium, k), min(short, k), max_draft=k)
    if cls is Eq7Budget:
        return Eq7Budget(s.cost, max_draft=k, seed=s.seed, draft_while_unfitted=s.draft_while_unfitted)
    if cls is ClassEq9Budget:
        if s.offline_cost is None:
            raise ValueError("budget 'class-eq9' needs the Eq. 1 constants fitted offline (BudgetSetting.offline_cost = (c_base, c_tok))")
        return ClassEq9Budget(k, *s.offline_cost)
    return cls()
