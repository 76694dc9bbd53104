"""Draft caps before the drafter runs, for hosts outside the vLLM proposer.

* :class:`SpeculationScheduler`: per-row facts a host has (problem, tokens generated, draft tokens
  offered and accepted so far, steps) in, one int draft cap per row out, under one of the budgets
  offered in ``scheduler`` (:mod:`scheduler.budgets`: ``none``, ``fixed``, ``class``, ``eq7``);
  it learns the Eq. 1 cost model from measured step times (:meth:`SpeculationScheduler.observe_step`).
* :func:`static_budgets`: per-problem caps fixed at submission, for ``SamplingParams.extra_args``.
* :class:`RequestCaps`: the same for a loop that runs iteration after iteration (the GRPO loop's
  ``scheduler.budget``), with the length history of the rollouts it has seen.

Units: tokens for lengths, drafts and caps; seconds for times.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from scheduler import budgets
from scheduler.acceptance import DEFAULT_A, DEFAULT_K
from scheduler.budget_protocol import RowFacts, StepView
from scheduler.class_budgets import ClassBudget
from scheduler.cost_model import CostModel
from scheduler.eq7 import Eq7Budget
from scheduler.predictor import LengthPredictor

__all__ = ["BUDGETS", "RequestCaps", "SpeculationScheduler", "static_budgets"]

BUDGETS = budgets.names("scheduler")  # none, fixed, class, eq7


def _check_budget(name: str, runs_in: str = "scheduler") -> str:
    try:
        return budgets.resolve(name, runs_in)
    except ValueError as exc:
        raise ValueError(f"budget: {exc}") from None


class SpeculationScheduler:
    """Per-step speculation caps for a batch of running requests.

    Args:
        budget: one of :data:`BUDGETS` (a former name, e.g. ``unlimited``, is refused with the new one).
        max_draft: the proposer's K (most draft tokens per row and step).
        predictor: a :class:`LengthPredictor` with history (required by ``class`` and ``eq7``).
        cost: a :class:`CostModel` (``eq7``; default: an unfitted ``CostModel()``, so ``eq7``
            drafts nothing until ``min_samples`` varied step times were observed).
        class_budget: the :class:`ClassBudget` of ``class`` (default Long 16, Medium 4, Short 0,
            each capped at ``max_draft``).
        k_prior, a_prior: Eq. 3 acceptance prior (scalars or per-request arrays at call time).
        prior_steps: weight of the acceptance prior, in steps.
        form, step_rule, seed: passed to :class:`scheduler.eq7.Eq7Solver`.

    Raises:
        ValueError: unknown budget, or a budget that needs a predictor without one.
    """

    def __init__(
        self,
        budget: str = "eq7",
        *,
        max_draft: int = 16,
        predictor: LengthPredictor | None = None,
        cost: CostModel | None = None,
        class_budget: ClassBudget | None = None,
        k_prior: float = DEFAULT_K,
        a_prior: float = DEFAULT_A,
        prior_steps: float = 32.0,
        form: str = "exact",
        step_rule: bool = True,
        seed: int | None = 0,
    ):
        name = _check_budget(budget)
        if not isinstance(max_draft, (int, np.integer)) or max_draft < 0:
            raise ValueError(f"max_draft must be an int >= 0, got {max_draft!r}")
        self.max_draft = int(max_draft)
        self.cost = cost if cost is not None else CostModel()
        cls = budgets.budget_class(name)
        if cls is Eq7Budget:
            self.budget = Eq7Budget(self.cost, max_draft=self.max_draft, k_prior=k_prior, a_prior=a_prior, prior_steps=prior_steps,
                                    form=form, step_rule=step_rule, seed=seed)
        elif cls is ClassBudget and class_budget is not None:
            t = class_budget.table
            self.budget = ClassBudget(int(t[2]), int(t[1]), int(t[0]), max_running=class_budget.max_running, max_draft=self.max_draft)
        else:
            self.budget = budgets.make_budget(name, "scheduler", budgets.BudgetSetting(max_draft=self.max_draft, cost=self.cost))
        if self.budget.length_aware and predictor is None:
            raise ValueError(f"budget {name!r} needs a LengthPredictor (predictor=...)")
        self.predictor = predictor

    def observe_step(self, n_tokens, seconds, context_tokens=None) -> None:
        """Feed measured step times to the cost model (see :meth:`CostModel.observe`)."""
        self.cost.observe(n_tokens, seconds, context_tokens)

    def caps(self, problem_idx, generated, drafted, accepted, steps, *, context_tokens=None, remaining=None, k=None, a=None) -> np.ndarray:
        """Draft caps for this step, one per running request.

        Args:
            problem_idx: int64 ``[B]`` from ``predictor.index(problem_ids)`` (-1 = unseen).
            generated: ``[B]`` output tokens generated so far.
            drafted, accepted, steps: ``[B]`` draft tokens offered, draft tokens accepted, and
                engine steps of each request so far (its acceptance evidence).
            context_tokens: optional ``[B]`` prompt + output tokens of each request (KV cache);
                with a cost model that fits ``c_ctx``, each pass of request i costs it
                ``c_ctx * (context_i + remaining_i / 2)`` on its own (its mean KV read over the
                rest of its life; :meth:`scheduler.eq7.Eq7Solver.solve` ``per_request_cost_s``).
            remaining, k, a: optional overrides ``[B]`` (oracle lengths or known acceptance).

        Returns:
            int32 ``[B]``: draft tokens the proposer may offer each row this step.
        """
        g = np.asarray(generated, np.float64)
        b = g.shape[0] if g.ndim else 0
        if b == 0:
            return np.zeros(0, np.int32)

        def as_f(x) -> np.ndarray | None:
            return None if x is None else np.asarray(x, np.float64)

        def facts() -> RowFacts:
            return RowFacts(self.predictor, np.asarray(problem_idx, np.int64), g, np.full(b, float(self.predictor.max_tokens)),
                            as_f(drafted), as_f(accepted), as_f(steps), as_f(context_tokens), as_f(remaining), as_f(k), as_f(a))

        return self.budget.plan(StepView(np.full(b, self.max_draft, np.int64), facts=facts)).astype(np.int32)

    def describe(self) -> dict[str, Any]:
        """Budget, K and the cost model's coefficients (None while unfitted)."""
        return {"budget": self.budget.name, "max_draft": self.max_draft, "cost": self.cost.coefficients()}


def static_budgets(
    problem_ids,
    predictor: LengthPredictor,
    budget: str = "eq7",
    *,
    max_draft: int = 16,
    cost: CostModel | None = None,
    samples_per_problem: int = 1,
    class_budget: ClassBudget | None = None,
    k_prior: float = DEFAULT_K,
    a_prior: float = DEFAULT_A,
) -> np.ndarray:
    """Per-problem draft budgets fixed at submission, for ``SamplingParams.extra_args
    ["das_max_draft_tokens"]`` (one value per problem: GRPO siblings share their params).

    ``class``: the budget of the problem's initial class. ``eq7``: the Eq. 7 rate planned at the
    start of the iteration over every request (``samples_per_problem`` per problem, predicted
    length = the problem's expected length, prior acceptance), rounded up; needs a ready ``cost``
    (else all 0). ``none`` / ``fixed``: 0 / ``max_draft``. The per-step
    :class:`SpeculationScheduler` is better where the proposer can call it; this is the fallback
    when budgets can only ride on the requests.

    Returns:
        int32 ``[len(problem_ids)]`` draft tokens per step.
    """
    _check_budget(budget)
    if not isinstance(samples_per_problem, (int, np.integer)) or samples_per_problem < 1:
        raise ValueError(f"samples_per_problem must be an int >= 1, got {samples_per_problem!r}")
    sched = SpeculationScheduler(budget, max_draft=max_draft, predictor=predictor, cost=cost, class_budget=class_budget,
                                 k_prior=k_prior, a_prior=a_prior)
    return sched.budget.request_caps(predictor, predictor.index(list(problem_ids)), samples_per_problem)


class RequestCaps:
    """Per-problem ``das_max_draft_tokens`` at submission, iteration after iteration (the GRPO loop's ``scheduler.budget``).

    After each iteration the rollout lengths are recorded (:meth:`observe`, a
    :class:`LengthPredictor` over the last ``window`` policy versions); before the next,
    :meth:`caps` gives every problem its budget's cap (``class``: the cap of its majority class
    among its past rollouts; unseen problems get the most common class). The run-time class
    update (as a rollout grows past its class) needs the proposer's per-step budget; this is the
    submission half.

    Args:
        budget: a budget offered in ``grpo`` (:mod:`scheduler.budgets`).
        max_tokens: the rollouts' most output tokens.
        max_draft: K.
        window: policy versions of length history.
        long, medium, short: the ``class`` budget's draft tokens per class.

    Raises:
        ValueError: a budget not offered in ``grpo`` (the message lists those that are).
    """

    def __init__(self, budget: str, *, max_tokens: int, max_draft: int, window: int = 16, long: int = 16, medium: int = 4, short: int = 0):
        name = _check_budget(budget, "grpo")
        setting = budgets.BudgetSetting(max_draft=int(max_draft), class_caps=(int(long), int(medium), int(short)))
        self.budget = budgets.make_budget(name, "grpo", setting)
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
