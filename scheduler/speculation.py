"""One object for the proposer to call each engine step: predictor + acceptance + cost + budget.

:class:`SpeculationScheduler` turns per-row facts the proposer has (problem, tokens generated,
draft tokens offered and accepted so far, steps) into one int draft cap per row, under one of
the budgets of :mod:`scheduler.budgets` that run here: ``none`` (0), ``fixed`` (``max_draft``), ``class`` (:class:`ClassBudget` on the
predictor's run-time class) or ``eq7`` (:class:`Eq7Budget` on the predictor's expected remaining
length, :func:`estimate_acceptance` and the online :class:`CostModel`), and learns the cost model
from measured step times (:meth:`SpeculationScheduler.observe_step`).

Units: tokens for lengths, drafts and caps; seconds for times.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from scheduler import budgets
from scheduler.acceptance import DEFAULT_A, DEFAULT_K, estimate_acceptance
from scheduler.budget import ClassBudget, Eq7Budget
from scheduler.cost_model import CostModel
from scheduler.predictor import LengthPredictor

__all__ = ["POLICIES", "SpeculationScheduler", "static_budgets"]

POLICIES = budgets.names("scheduler")  # none, fixed, class, eq7


def _check_policy(policy: str) -> str:
    try:
        return budgets.resolve(policy, "scheduler")
    except ValueError as exc:
        raise ValueError(f"policy: {exc}") from None


class SpeculationScheduler:
    """Per-step speculation caps for a batch of running requests.

    Args:
        policy: one of :data:`POLICIES` (a former name, e.g. ``unlimited``, is refused with the new one).
        max_draft: the proposer's K (most draft tokens per row and step).
        predictor: a :class:`LengthPredictor` with history (required by ``class`` and ``eq7``).
        cost: a :class:`CostModel` (``eq7``; default: an unfitted ``CostModel()``, so ``eq7``
            drafts nothing until ``min_samples`` varied step times were observed).
        class_budget: the :class:`ClassBudget` of ``class`` (default Long 16, Medium 4, Short 0,
            each capped at ``max_draft``).
        k_prior, a_prior: Eq. 3 acceptance prior (scalars or per-request arrays at call time).
        prior_steps: weight of the acceptance prior, in steps.
        form, step_rule, seed: passed to :class:`Eq7Budget`.

    Raises:
        ValueError: unknown policy, or a policy that needs a predictor without one.
    """

    def __init__(
        self,
        policy: str = "eq7",
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
        policy = _check_policy(policy)
        if policy in ("class", "eq7") and predictor is None:
            raise ValueError(f"policy {policy!r} needs a LengthPredictor (predictor=...)")
        if not isinstance(max_draft, (int, np.integer)) or max_draft < 0:
            raise ValueError(f"max_draft must be an int >= 0, got {max_draft!r}")
        self.policy = policy
        self.max_draft = int(max_draft)
        self.predictor = predictor
        self.cost = cost if cost is not None else CostModel()
        self.class_budget = class_budget or ClassBudget(long=min(16, self.max_draft), medium=min(4, self.max_draft), short=0)
        self.k_prior, self.a_prior, self.prior_steps = k_prior, a_prior, prior_steps
        self.eq7 = Eq7Budget(self.cost, max_draft=self.max_draft, form=form, step_rule=step_rule, seed=seed)

    def observe_step(self, n_tokens, seconds, context_tokens=None) -> None:
        """Feed measured step times to the cost model (see :meth:`CostModel.observe`)."""
        self.cost.observe(n_tokens, seconds, context_tokens)

    def caps(
        self,
        problem_idx,
        generated,
        drafted,
        accepted,
        steps,
        *,
        context_tokens=None,
        remaining=None,
        k=None,
        a=None,
    ) -> np.ndarray:
        """Draft caps for this step, one per running request.

        Args:
            problem_idx: int64 ``[B]`` from ``predictor.index(problem_ids)`` (-1 = unseen).
            generated: ``[B]`` output tokens generated so far.
            drafted, accepted, steps: ``[B]`` draft tokens offered, draft tokens accepted, and
                engine steps of each request so far (its acceptance evidence).
            context_tokens: optional ``[B]`` prompt + output tokens of each request (KV cache);
                with a cost model that fits ``c_ctx``, each pass of request i costs it
                ``c_ctx * (context_i + remaining_i / 2)`` on its own (its mean KV read over the
                rest of its life; :meth:`Eq7Budget.plan` ``per_request_cost_s``).
            remaining, k, a: optional overrides ``[B]`` (oracle lengths or known acceptance).

        Returns:
            int32 ``[B]``: draft tokens the proposer may offer each row this step.
        """
        g = np.asarray(generated, np.float64)
        b = g.shape[0] if g.ndim else 0
        if self.policy == "none" or b == 0:
            return np.zeros(b, np.int32)
        if self.policy == "fixed":
            return np.full(b, self.max_draft, np.int32)
        idx = np.asarray(problem_idx, np.int64)
        if self.policy == "class":
            pred = self.predictor.predict(idx, g)
            return np.minimum(self.class_budget.caps(pred.cls), self.max_draft).astype(np.int32)
        if remaining is None:
            remaining = self.predictor.predict(idx, g).expected_remaining
        remaining = np.asarray(remaining, np.float64)
        if k is None or a is None:
            k_est, a_est = estimate_acceptance(drafted, accepted, steps, self.k_prior, self.a_prior, self.prior_steps)
            k = k_est if k is None else k
            a = a_est if a is None else a
        per_req = None
        if self.cost.ready and self.cost.use_context and context_tokens is not None:
            ctx = np.asarray(context_tokens, np.float64)
            per_req = self.cost.c_ctx * (ctx + 0.5 * remaining)
        return self.eq7.caps(remaining, np.asarray(k, np.float64), np.asarray(a, np.float64), per_request_cost_s=per_req)

    def describe(self) -> dict[str, Any]:
        """Policy, K and the cost model's coefficients (None while unfitted)."""
        return {"policy": self.policy, "max_draft": self.max_draft, "cost": self.cost.coefficients()}


def static_budgets(
    problem_ids,
    predictor: LengthPredictor,
    policy: str = "eq7",
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
    policy = _check_policy(policy)
    if not isinstance(samples_per_problem, (int, np.integer)) or samples_per_problem < 1:
        raise ValueError(f"samples_per_problem must be an int >= 1, got {samples_per_problem!r}")
    idx = predictor.index(list(problem_ids))
    n = idx.size
    if policy == "none":
        return np.zeros(n, np.int32)
    if policy == "fixed":
        return np.full(n, max_draft, np.int32)
    if policy == "class":
        cb = class_budget or ClassBudget(long=min(16, max_draft), medium=min(4, max_draft))
        return np.minimum(cb.table[predictor.initial_class(idx)], max_draft).astype(np.int32)
    if cost is None or not cost.ready:
        return np.zeros(n, np.int32)
    total = predictor.predict(idx, np.zeros(n)).expected_total
    r = np.repeat(total, samples_per_problem)
    plan = Eq7Budget(cost, max_draft=max_draft, step_rule=False, seed=None).plan(r, np.full(r.size, k_prior), np.full(r.size, a_prior))
    rate = plan.rate.reshape(n, samples_per_problem).max(axis=1)
    return np.minimum(np.ceil(rate), max_draft).astype(np.int32)
