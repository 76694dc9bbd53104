"""DAS's cost-model budget, Eq. 2-9 (arXiv 2511.13841): per-request draft rates from remaining lengths.

:class:`Eq7Solver` plans, over the requests' remaining lengths, with ``t_step = c_base + c_tok *
n_tokens`` fitted online (:class:`scheduler.cost_model.CostModel`) and per-request acceptance
parameters ``k_i, a_i`` (Eq. 3, :mod:`scheduler.acceptance`), one int draft cap per running request
for the current engine step. :class:`Eq7Budget` is the ``eq7`` speculation budget
(:mod:`scheduler.budget_protocol`) around it.

The plan (:func:`solve_n_fwd`, :func:`optimal_proposals`). Total time (Eq. 2) is
``c_base * N_fwd + c_tok * N_toks`` with ``N_fwd = max_i N_i`` (Eq. 4). For a target ``N``, each
request with remaining length ``r_i > N`` needs ``p_i(N)`` proposed tokens to finish in ``N``
passes; requests with ``r_i <= N`` end before the makespan and get nothing. Minimising over ``N``
gives the optimality condition (Eq. 9) ``c_base = c_tok * sum_{r_i > N} -dp_i/dN``, solved by
bracketing the root (it falls monotonically in ``N``). ``p_i`` is spent at a constant rate ``p_i / N`` draft tokens per step (the request's
passes under the plan are ``N``), which is exactly Eq. 3 per step (:func:`tokens_per_step`).

Eq. 7 of DAS (arXiv 2511.13841) as we transcribed it, ``p_i = -(l_i/a_i) ln(1 - k_i (1 - N/l_i))``,
is not the inverse of Eq. 4 (``N_i = l_i (1 - k_i + k_i exp(-a_i p_i / l_i))``, see
:mod:`scheduler.acceptance`): with it a request would need
``l_i (1 - k_i^2) + k_i^2 N > N`` passes. ``form="exact"`` (default) inverts Eq. 4:
``p_i = -(l_i/a_i) ln(1 - (1 - N/l_i) / k_i)`` for ``l_i (1 - k_i) < N < l_i``, with
``-dp_i/dN = 1 / (a_i (k_i - 1 + N/l_i))`` in Eq. 9; ``form="paper"`` uses the transcribed
formulas (``-dp_i/dN = k_i / (a_i (1 - k_i + k_i N/l_i))``) and spends ``p_i`` over the passes
Eq. 4 gives it.

Per-request costs (extension, "exact" only): when each pass of request i also costs ``c_req_i``
seconds of its own (its KV-cache read, ``c_ctx * context_i`` with a cost model that fits a context
term), the total is ``c_base * N + sum_i [(c_tok + c_req_i) * N_i + c_tok * p_i]``; a request off
the critical path then drafts at its cheapest rate per token (more drafts cut its passes, each of
which costs ``c_req_i``), and Eq. 9 gains ``sum_crit (c_tok + c_req_i)`` on its left-hand side
(:func:`solve_n_fwd`; the ``c_tok`` per critical request comes from counting each pass's own
sampled token, which the paper's Eq. 9 leaves out). With ``c_req = 0`` this is the paper's plan up
to that term.

Step-level rule (``step_rule=True``): a step's critical drafts (those above a request's cheapest
rate) cost ``c_tok * sum_i d_i`` seconds now; the tokens they are expected to get accepted shorten
the tail by about ``mean_i accepted_i(d_i)`` steps of ``t_tail = c_fixed + sum_i (c_req_i + c_tok
(1 + d_i))`` seconds each. When the cost exceeds that saving, no critical request drafts in the
step (requests off the critical path keep their cheapest rate, 0 without per-request costs).

Units: lengths, drafts and caps in tokens; costs in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from scheduler.acceptance import DEFAULT_A, DEFAULT_K, estimate_acceptance, tokens_per_step
from scheduler.budget_protocol import Budget, StepView
from scheduler.cost_model import CostModel
from scheduler.predictor import LengthPredictor

__all__ = ["Eq7Budget", "Eq7Plan", "Eq7Solver", "solve_n_fwd", "optimal_proposals", "round_caps", "step_saves_time"]


def _check_max_draft(max_draft: int) -> int:
    if not isinstance(max_draft, (int, np.integer)) or max_draft < 0:
        raise ValueError(f"max_draft must be an int >= 0 (draft tokens per step), got {max_draft!r}")
    return int(max_draft)


def _excess(n: np.ndarray, r, k, a, u, c_req_over_tok, form: str) -> np.ndarray:
    """Eq. 9 residual over ``c_tok`` for each candidate ``N`` (``[M]``): ``sum_crit (-dp_i/dN
    [- 1 - c_req_i / c_tok])``; the root of ``residual = c_base / c_tok`` is the optimum."""
    nn = n[None, :]
    rr, kk, aa, uu = r[:, None], k[:, None], a[:, None], u[:, None]
    live = uu > nn
    if form == "exact":
        den = aa * (kk - 1.0 + nn / rr)
        term = 1.0 / np.maximum(den, 1e-300) - 1.0 - c_req_over_tok[:, None]
    else:
        term = kk / (aa * (1.0 - kk + kk * nn / rr))
    return np.where(live, term, 0.0).sum(axis=0)


def solve_n_fwd(
    remaining,
    k,
    a,
    c_base: float,
    c_tok: float,
    *,
    form: str = "exact",
    per_request_cost=None,
    unforced_passes=None,
    rounds: int = 4,
    points: int = 32,
) -> float:
    """Eq. 9: the target forward passes ``N`` of the remaining rollout.

    "paper": ``c_base = c_tok * sum_{r_i > N} k_i / (a_i (1 - k_i + k_i N / r_i))`` (as transcribed).
    "exact": the derivative of ``c_base * N + sum_i [(c_tok + c_req_i) * N_i + c_tok * p_i]``
    (every pass of request i processes its sampled token and its drafts, and costs it ``c_req_i``
    of its own, e.g. its KV-cache read) with ``N_i = N`` on the critical requests:
    ``c_base + sum_crit (c_tok + c_req_i) = c_tok * sum_crit 1 / (a_i (k_i - 1 + N / r_i))``;
    critical = requests whose ``unforced_passes`` (passes at their own cheapest draft rate,
    default ``r_i``: no drafts) exceed ``N``. With ``c_req = 0`` this is the paper's Eq. 9 up to the
    ``c_tok`` per critical request that counting each pass's sampled token adds.

    The residual falls as ``N`` grows; the root is bracketed by evaluating ``points`` candidates
    at once for ``rounds`` rounds (relative precision ``(points + 1) ** -rounds``).

    Args:
        remaining: float array ``[B]``, remaining tokens ``r_i`` (> 0) (the ``l_i`` of Eq. 7 for a
            request that has not started).
        k, a: float arrays ``[B]``, Eq. 3 parameters, k in [0, 1), a > 0.
        c_base, c_tok: seconds per pass and per token (Eq. 1), >= 0.
        form: "exact" or "paper" (module doc).
        per_request_cost: optional float ``[B]``, seconds per pass of each request ("exact").
        unforced_passes: optional float ``[B]`` ("exact").

    Returns:
        ``N`` in passes (float), in ``[max_i r_i (1 - k_i), max_i unforced_i]`` for "exact".
    """
    r, k, a = (np.asarray(x, np.float64) for x in (remaining, k, a))
    if r.size == 0:
        return 0.0
    if c_base < 0 or c_tok < 0:
        raise ValueError(f"c_base and c_tok must be >= 0, got {c_base}, {c_tok}")
    u = r if unforced_passes is None else np.asarray(unforced_passes, np.float64)
    creq = np.zeros_like(r) if per_request_cost is None or c_tok == 0 else np.asarray(per_request_cost, np.float64) / c_tok
    hi = float(u.max())
    lo = min(float(np.max(r * (1.0 - k))), hi) if form == "exact" else 0.0
    if c_tok == 0:
        return lo
    target = c_base / c_tok
    if form == "paper" and _excess(np.array([lo]), r, k, a, u, creq, form)[0] <= target:
        return lo
    for _ in range(rounds):
        cand = np.linspace(lo, hi, points + 2)[1:-1]
        above = _excess(cand, r, k, a, u, creq, form) > target  # True left of the root
        i = int(np.count_nonzero(above))
        lo, hi = (cand[i - 1] if i > 0 else lo), (cand[i] if i < points else hi)
    return hi


def optimal_proposals(remaining, k, a, n_fwd: float, *, form: str = "exact", unforced_passes=None) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 7: proposed tokens ``p_i*`` per request for target ``n_fwd``, and its passes ``N_i``.

    Returns:
        ``(p, passes)``: float64 arrays; ``p_i = 0`` and ``passes_i = r_i`` where ``r_i <= n_fwd``
        (or ``unforced_passes_i <= n_fwd``): the request ends before the makespan, the plan does
        not speculate for it; "exact": ``passes_i = n_fwd`` otherwise (Eq. 4 at ``p_i``).
    """
    r, k, a = (np.asarray(x, np.float64) for x in (remaining, k, a))
    live = r > n_fwd if unforced_passes is None else np.asarray(unforced_passes, np.float64) > n_fwd
    p = np.zeros_like(r)
    passes = r.copy()
    if form == "exact":
        arg = 1.0 - (1.0 - n_fwd / r[live]) / np.maximum(k[live], 1e-12)
        p[live] = -(r[live] / a[live]) * np.log(np.clip(arg, 1e-12, 1.0))
        passes[live] = np.maximum(n_fwd, r[live] * (1.0 - k[live]))
    else:
        arg = 1.0 - k[live] * (1.0 - n_fwd / r[live])
        p[live] = -(r[live] / a[live]) * np.log(np.clip(arg, 1e-12, 1.0))
        passes[live] = r[live] * (1.0 - k[live] + k[live] * np.exp(-a[live] * p[live] / r[live]))
    return p, passes


def round_caps(rates, max_draft: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """Draft tokens per step (float rates) -> int32 caps in ``[0, max_draft]``: stochastic
    rounding with ``rng`` (unbiased over steps), nearest without."""
    x = np.clip(np.asarray(rates, np.float64), 0.0, max_draft)
    u = rng.random(x.shape) if rng is not None else 0.5
    return np.minimum(np.floor(x + u), max_draft).astype(np.int32)


def step_saves_time(caps, k, a, c_fixed: float, c_tok: float, per_request_cost_s=None) -> bool:
    """Step-level rule: do this step's drafts save more time than their verification costs?

    Cost now: ``c_tok * sum_i d_i``. Saving: the drafting (critical) requests advance by about
    ``mean_i (tau_i(d_i) - 1)`` extra tokens, which removes as many steps at the end of the
    rollout, each costing ``t_tail = c_fixed + sum_i (c_req_i + c_tok * (1 + d_i))``.

    Args:
        caps: int ``[B]`` draft tokens per row this step; k, a: ``[B]`` Eq. 3 parameters.
        c_fixed, c_tok: seconds per pass and per token; per_request_cost_s: optional ``[B]``.

    Returns:
        True when drafting pays (or nobody drafts).
    """
    d = np.asarray(caps, np.float64)
    if d.size == 0 or not np.any(d > 0):
        return True
    creq = np.zeros_like(d) if per_request_cost_s is None else np.asarray(per_request_cost_s, np.float64)
    gain = float(np.mean(tokens_per_step(d, k, a) - 1.0))
    t_tail = c_fixed + float(np.sum(creq + c_tok * (1.0 + d)))
    return c_tok * float(d.sum()) <= t_tail * gain


@dataclass
class Eq7Plan:
    """One Eq. 7 plan: ``n_fwd`` target passes; per request ``proposals`` (tokens over its
    remaining life), ``rate`` (draft tokens per step), ``caps`` (int32, this step)."""

    n_fwd: float
    proposals: np.ndarray
    rate: np.ndarray
    caps: np.ndarray
    step_rule_fired: bool


class Eq7Solver:
    """Cost-model draft caps (DAS Eq. 7 with Eq. 9), per request and step.

    Args:
        cost: the online :class:`CostModel`; while ``cost.ready`` is False every cap is 0.
        max_draft: most draft tokens per row and step (the proposer's K).
        form: "exact" (inverse of Eq. 4, default) or "paper" (module doc).
        step_rule: apply the step-level no-draft rule.
        seed: seed of the stochastic rounding of rates to caps (None: round to nearest).
    """

    def __init__(self, cost: CostModel, *, max_draft: int = 16, form: str = "exact", step_rule: bool = True, seed: int | None = 0):
        if not isinstance(cost, CostModel):
            raise ValueError(f"cost must be a scheduler.cost_model.CostModel, got {type(cost).__name__}")
        if form not in ("exact", "paper"):
            raise ValueError(f"form must be 'exact' or 'paper', got {form!r}")
        self.cost = cost
        self.max_draft = _check_max_draft(max_draft)
        self.form = form
        self.step_rule = bool(step_rule)
        self.rng = np.random.default_rng(seed) if seed is not None else None
        self.last_plan: Eq7Plan | None = None

    def solve(self, remaining, k, a, *, fixed_cost_s: float | None = None, per_request_cost_s=None) -> Eq7Plan:
        """Plan draft caps for running requests.

        Args:
            remaining: float array ``[B]``, predicted remaining output tokens of each running
                request (>= 0; a request at 0 gets no draft).
            k, a: float arrays ``[B]``, Eq. 3 acceptance estimates (k in [0, 1), a > 0), e.g.
                :func:`scheduler.acceptance.estimate_acceptance`.
            fixed_cost_s: per-pass cost shared by the batch, seconds (default ``cost.c_base``).
            per_request_cost_s: optional float ``[B]``, seconds each pass of request i costs on its
                own besides its tokens (e.g. ``c_ctx * its KV tokens``); "exact" only. With it,
                a request off the critical path drafts at its cheapest rate per token,
                ``argmin_d (c_req_i + c_tok (1 + d)) / tau_i(d)`` (0 when ``c_req_i = 0``).

        Returns:
            :class:`Eq7Plan` (caps are int32 draft tokens for this step, in ``[0, max_draft]``).

        Raises:
            ValueError: shapes differ or values are out of range.
        """
        r, k, a = (np.asarray(x, np.float64) for x in (remaining, k, a))
        if not (r.shape == k.shape == a.shape) or r.ndim != 1:
            raise ValueError(f"remaining {r.shape}, k {k.shape} and a {a.shape} must be equal 1-d shapes")
        if np.any(~np.isfinite(r)) or np.any(r < 0):
            raise ValueError(f"remaining must be finite and >= 0 tokens, got {r[(~np.isfinite(r)) | (r < 0)][:4]}")
        if np.any((k < 0) | (k >= 1)) or np.any(a <= 0) or np.any(~np.isfinite(a)):
            raise ValueError("k must be in [0, 1) and a finite and > 0")
        creq = np.zeros(r.shape) if per_request_cost_s is None else np.asarray(per_request_cost_s, np.float64)
        if creq.shape != r.shape or np.any(~np.isfinite(creq)) or np.any(creq < 0):
            raise ValueError(f"per_request_cost_s must be finite, >= 0 and of shape {r.shape}")
        zeros = np.zeros(r.shape, np.int32)
        if r.size == 0 or self.max_draft == 0 or not self.cost.ready:
            self.last_plan = Eq7Plan(0.0, np.zeros(r.shape), np.zeros(r.shape), zeros, False)
            return self.last_plan
        c_tok = self.cost.c_tok
        c_fixed = self.cost.c_base if fixed_cost_s is None else float(fixed_cost_s)
        if not (c_fixed >= 0) or not math.isfinite(c_fixed):
            raise ValueError(f"fixed_cost_s must be finite and >= 0, got {fixed_cost_s!r}")
        ok = r > 0  # k = 0 requests stay in: they bound N from below (exact form)
        rr, kk, aa, cc = r[ok], k[ok], a[ok], creq[ok]
        p = np.zeros(r.shape)
        rate = np.zeros(r.shape)
        free = np.zeros(r.shape)  # cheapest per-token draft rate of each request
        n_fwd = 0.0
        if rr.size:
            unforced = rr
            if self.form == "exact" and np.any(cc > 0):
                d = np.arange(self.max_draft + 1, dtype=np.float64)
                tau = tokens_per_step(d[None, :], kk[:, None], aa[:, None])
                per_tok = (cc[:, None] + c_tok * (1.0 + d[None, :])) / tau
                best = np.argmin(per_tok, axis=1)
                free[ok] = best
                unforced = rr / tau[np.arange(rr.size), best]
            n_fwd = solve_n_fwd(rr, kk, aa, c_fixed, c_tok, form=self.form, per_request_cost=cc, unforced_passes=unforced)
            pp, passes = optimal_proposals(rr, kk, aa, n_fwd, form=self.form, unforced_passes=unforced)
            p[ok] = pp
            rate[ok] = np.where(pp > 0, pp / np.maximum(passes, 1.0), free[ok])
        critical = rate > free
        caps = round_caps(rate, self.max_draft, self.rng)
        fired = False
        if self.step_rule and np.any(caps[critical] > free[critical]):
            if not step_saves_time(caps[critical], k[critical], a[critical], c_fixed, c_tok, creq[critical]):
                caps = np.where(critical, free, caps).astype(np.int32)
                fired = True
        self.last_plan = Eq7Plan(float(n_fwd), p, rate, caps, fired)
        return self.last_plan

    def caps(self, remaining, k, a, *, fixed_cost_s: float | None = None, per_request_cost_s=None) -> np.ndarray:
        """int32 draft caps ``[B]`` for this step (see :meth:`solve`)."""
        return self.solve(remaining, k, a, fixed_cost_s=fixed_cost_s, per_request_cost_s=per_request_cost_s).caps


class Eq7Budget(Budget):
    """``eq7``: DAS Eq. 7 / Eq. 9 per request (:class:`Eq7Solver`) on the length predictor's
    expected remaining length, per-request acceptance estimates (:func:`estimate_acceptance`, Eq. 3)
    and the host's online :class:`CostModel`.

    Args:
        cost: the online step-cost fit (default: an unfitted ``CostModel()``); the host feeds it.
        max_draft: K, the most draft tokens per row and step.
        k_prior, a_prior, prior_steps: the Eq. 3 acceptance prior and its weight in steps.
        form, step_rule, seed: :class:`Eq7Solver`'s.
        draft_while_unfitted: while ``cost`` is not fitted, leave the rows' own caps (True: the
            drafts spread the step sizes the fit needs) instead of drafting nothing (False).
    """

    name = "eq7"
    summary = "DAS Eq. 7 / Eq. 9 per request: predicted remaining length, per-request acceptance estimates and the online cost model"
    runs_in = frozenset({"proposer", "scheduler", "simulator"})
    uses_cost_fit = True
    length_aware = True

    def __init__(self, cost: CostModel | None = None, *, max_draft: int = 16, k_prior: float = DEFAULT_K, a_prior: float = DEFAULT_A,
                 prior_steps: float = 32.0, form: str = "exact", step_rule: bool = True, seed: int | None = 0,
                 draft_while_unfitted: bool = False):
        self.cost = cost if cost is not None else CostModel()
        self.solver = Eq7Solver(self.cost, max_draft=max_draft, form=form, step_rule=step_rule, seed=seed)
        self.max_draft = self.solver.max_draft
        self.k_prior, self.a_prior, self.prior_steps = k_prior, a_prior, prior_steps
        self.draft_while_unfitted = bool(draft_while_unfitted)

    def plan(self, step: StepView) -> np.ndarray:
        caps = step.caps.copy()
        if not step.live.any():
            return caps
        f = step.facts
        if self.draft_while_unfitted and not self.cost.ready:
            return caps
        remaining = step.remaining()
        k, a = f.k, f.a
        if k is None or a is None:
            k_est, a_est = estimate_acceptance(f.drafted, f.accepted, f.steps, self.k_prior, self.a_prior, self.prior_steps)
            k = k_est if k is None else k
            a = a_est if a is None else a
        per_req = None
        if self.cost.ready and self.cost.use_context and f.context is not None:
            per_req = self.cost.c_ctx * (np.asarray(f.context, np.float64) + 0.5 * remaining)
        got = self.solver.caps(remaining, np.asarray(k, np.float64), np.asarray(a, np.float64), per_request_cost_s=per_req)
        rows = step.live_rows
        caps[rows] = np.minimum(caps[rows], got)
        return caps

    def priority(self, step: StepView) -> np.ndarray:
        """Longest predicted remaining length first."""
        return step.live_rows[np.argsort(-step.remaining(), kind="stable")]

    def request_caps(self, predictor: LengthPredictor, problem_idx: np.ndarray, samples_per_problem: int = 1) -> np.ndarray:
        """The Eq. 7 rate planned at the start of the iteration over every request
        (``samples_per_problem`` per problem, predicted length = the problem's expected length,
        prior acceptance), rounded up; all 0 while the cost model is not fitted."""
        idx = np.asarray(problem_idx, np.int64)
        n = idx.size
        if not self.cost.ready:
            return np.zeros(n, np.int32)
        total = predictor.predict(idx, np.zeros(n)).expected_total
        r = np.repeat(total, samples_per_problem)
        solver = Eq7Solver(self.cost, max_draft=self.max_draft, form=self.solver.form, step_rule=False, seed=None)
        plan = solver.solve(r, np.full(r.size, self.k_prior), np.full(r.size, self.a_prior))
        rate = plan.rate.reshape(n, samples_per_problem).max(axis=1)
        return np.minimum(np.ceil(rate), self.max_draft).astype(np.int32)

    def describe(self) -> dict:
        return {"budget": self.name, "max_draft": self.max_draft, "cost": self.cost.coefficients()}
