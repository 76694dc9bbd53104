"""The speculation budgets: one registry of names, the plain budgets, and per-request caps at submission.

A budget decides how many draft tokens each running request verifies per engine step
(:mod:`scheduler.budget_protocol`). This module is the one place that maps a name to its class
(:data:`BUDGETS`); each class builds itself from what its host knows
(:meth:`scheduler.budget_protocol.Budget.from_setting`). The vLLM proposer
(``additional_config['das']['budget']``, :mod:`integrations.vllm_ext.proposer`), the
``das-rollout`` flags (``--budget``, ``--compare das:<budget>``), the recipes
(``speculative.das.budget``, ``scheduler.budget``) and the long-tail simulator
(``benchmarks/simulate.py --policies``) build their budget with :func:`make_budget`. The families:

* plain (here): ``none`` (:class:`NoneBudget`), ``fixed`` (:class:`FixedBudget`);
* length classes (:mod:`scheduler.length_classes`): ``class``, ``class-eq9``, ``class-roofline``;
* the drain plan (:mod:`scheduler.drain_plan`): ``eq7``;
* priced (:mod:`scheduler.priced_budgets`): ``cost``, ``makespan``.

Where each one is offered is its class's ``runs_in``:

* ``proposer``: inside vLLM, per engine step (:class:`scheduler.planner.StepPlanner`);
* ``grpo``: per-request caps fixed at submission (:class:`RequestCaps`, the GRPO loop's ``scheduler.budget``);
* ``simulator``: ``benchmarks.simulate`` (simulated GPUs, no vLLM).

Old names are refused with an error that gives the new one (:data:`RENAMED`), never mapped
silently, so one budget never shows up under two names in results.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from scheduler.budget_protocol import Budget, BudgetSetting, StepView
from scheduler.drain_plan import DrainPlanBudget
from scheduler.length_classes import ClassBudget, ClassRooflineBudget, PublishedClassBudget
from scheduler.predictor import LengthPredictor
from scheduler.priced_budgets import CostBudget, MakespanBudget

__all__ = ["BUDGETS", "RENAMED", "FixedBudget", "NoneBudget", "RequestCaps", "budget_class", "describe", "make_budget", "names", "resolve"]


class NoneBudget(Budget):
    """``none``: no draft tokens."""

    name = "none"
    summary = ("no draft tokens (in the proposer: vLLM's speculative path and the drafter's inserts, drafting nothing: "
               "their per-step cost on their own, against the method none)")
    runs_in = frozenset({"proposer", "grpo", "simulator"})
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
    runs_in = frozenset({"proposer", "grpo", "simulator"})
    static = True

    def __init__(self, max_draft: int = 16):
        self.max_draft = int(max_draft)

    @classmethod
    def from_setting(cls, setting: BudgetSetting) -> FixedBudget:
        return cls(int(setting.max_draft))

    def request_caps(self, predictor: LengthPredictor, problem_idx: np.ndarray, samples_per_problem: int = 1) -> np.ndarray:
        return np.full(np.asarray(problem_idx).size, self.max_draft, np.int32)


BUDGETS: dict[str, type[Budget]] = {c.name: c for c in (
    NoneBudget, FixedBudget, CostBudget, MakespanBudget, ClassBudget, PublishedClassBudget, ClassRooflineBudget, DrainPlanBudget)}

# Former names: refused with an error that names the new one.
RENAMED: dict[str, str] = {"unlimited": "fixed", "das": "class-eq9", "das-roofline": "class-roofline"}


def names(runs_in: str | None = None) -> tuple[str, ...]:
    """Budget names in registry order, those offered in ``runs_in`` (``proposer``,
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
    """A fresh budget ``name`` (checked as :func:`resolve`) built by its class from what the host
    knows (:meth:`scheduler.budget_protocol.Budget.from_setting`; default: a default setting).

    Raises:
        ValueError: a bad name (as :func:`resolve`), or a setting that lacks what the budget needs
            (``class-eq9`` without ``offline_cost``).
    """
    return budget_class(name, runs_in).from_setting(setting or BudgetSetting())


class RequestCaps:
    """Per-problem ``das_max_draft_tokens`` at submission, iteration after iteration (the GRPO loop's ``scheduler.budget``).

    After each iteration the rollout lengths are recorded (:meth:`observe`, a
    :class:`LengthPredictor` over the last ``window`` policy versions); before the next,
    :meth:`caps` gives every problem its budget's cap (``class``: the cap of its majority class
    among its past rollouts; unseen problems get the most common class). The run-time class
    update (as a rollout grows past its class) needs the proposer's per-step budget; this is the
    submission half.

    Args:
        budget: a budget offered in ``grpo``.
        max_tokens: the rollouts' most output tokens.
        max_draft: K.
        window: policy versions of length history.
        long, medium, short: the ``class`` budget's draft tokens per class.

    Raises:
        ValueError: a budget not offered in ``grpo`` (the message lists those that are).
    """

    def __init__(self, budget: str, *, max_tokens: int, max_draft: int, window: int = 16, long: int = 16, medium: int = 4, short: int = 0):
        try:
            name = resolve(budget, "grpo")
        except ValueError as exc:
            raise ValueError(f"budget: {exc}") from None
        setting = BudgetSetting(max_draft=int(max_draft), class_caps=(int(long), int(medium), int(short)))
        self.budget = make_budget(name, "grpo", setting)
        self.predictor = LengthPredictor(int(max_tokens), window=int(window))
        self.seen = 0

    def caps(self, problem_ids: Sequence[str]) -> list[int | None]:
        """One cap per problem (draft tokens per step); all None (no cap) before any history."""
        if self.seen == 0:
            return [None] * len(problem_ids)
        return [int(c) for c in self.budget.request_caps(self.predictor, self.predictor.index(list(problem_ids)))]

    def observe(self, policy_version: int, problem_ids: Sequence[str], lengths: Sequence[int]) -> None:
        """Record one iteration's rollouts: each one's problem and output length (tokens)."""
        by: dict[str, list[int]] = {}
        for pid, n in zip(problem_ids, lengths):
            by.setdefault(pid, []).append(int(n))
        for pid, ls in by.items():
            self.predictor.observe(pid, int(policy_version), ls)
        self.seen += len(lengths)
