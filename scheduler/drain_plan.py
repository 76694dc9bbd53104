"""The drain plan: per-request draft rates that finish a batch in the least time from the requests' remaining lengths (DAS Eq. 1-9, arXiv 2511.13841).

:class:`DrainPlanSolver` plans, over the requests' remaining lengths, with ``t_step = c_base + c_tok *
n_tokens`` fitted online (:class:`CostModel`, below) and per-request acceptance
parameters ``k_i, a_i`` (Eq. 3, :mod:`scheduler.acceptance`), one int draft cap per running request
for the current engine step. :class:`DrainPlanBudget` is the ``eq7`` speculation budget
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

**The step-cost line** (Eq. 1), fitted online from measured step times.

Eq. 1: ``t_step = c_base + c_tok * n_tokens`` (seconds; ``n_tokens`` = tokens in the forward pass,
verified drafts included). The paper fits ``c_base`` and ``c_tok`` offline; :class:`CostModel`
fits them while the engine runs, by weighted least squares over running sums (recursive least
squares with an optional forgetting factor), and can add a third term ``c_ctx * context_tokens``
(tokens of KV cache read in the step: prompt + output of every running request), the
attention-read cost that the paper folds into its 12% fit error.

Before it is fitted: with a ``prior`` the prior's coefficients are used (as pseudo-observations
that real ones outweigh); without one, :attr:`CostModel.ready` is False until ``min_samples``
observations with distinct ``n_tokens`` values arrived, and the coefficient accessors raise
``RuntimeError``. Budget policies treat an unready model as "do not speculate".

Units: lengths, drafts and caps in tokens; costs in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from scheduler.acceptance import DEFAULT_A, DEFAULT_K, estimate_acceptance, tokens_per_step
from scheduler.budget_protocol import Budget, BudgetSetting, StepView

__all__ = ["CostModel", "DrainPlanBudget", "DrainPlan", "DrainPlanSolver", "optimal_proposals", "round_caps", "solve_n_fwd", "step_saves_time"]


# Feature scales: keep the normal equations well conditioned (tokens ~1e3, context ~1e6).
_TOK_SCALE = 1e3
_CTX_SCALE = 1e6
_SCALARS = (int, float, np.integer, np.floating)  # one step given as numbers: the fast path of observe


class CostModel:
    """Online fit of ``t_step = c_base + c_tok * n_tokens [+ c_ctx * context_tokens]`` (Eq. 1).

    Args:
        use_context: also fit ``c_ctx`` (seconds per token of KV cache read per step).
        min_samples: observations needed before the fit is used (without a prior).
        forgetting: per-observation weight decay in (0, 1]; 1 keeps all history, 0.999 forgets
            with a time constant of ~1000 steps (tracks drift, e.g. a changing context length).
        prior: ``(c_base, c_tok)`` or ``(c_base, c_tok, c_ctx)`` in seconds (and seconds per
            token), e.g. an offline fit; used until real observations outweigh it.
        prior_weight: weight of the prior, in observations per anchor point (> 0).

    Raises:
        ValueError: bad arguments (named in the message).
    """

    def __init__(
        self,
        *,
        use_context: bool = False,
        min_samples: int = 16,
        forgetting: float = 1.0,
        prior: tuple[float, ...] | None = None,
        prior_weight: float = 8.0,
    ):
        if not isinstance(min_samples, (int, np.integer)) or min_samples < 2:
            raise ValueError(f"min_samples must be an int >= 2, got {min_samples!r}")
        if not (0.0 < forgetting <= 1.0):
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting!r}")
        if not (prior_weight > 0):
            raise ValueError(f"prior_weight must be > 0, got {prior_weight!r}")
        self.use_context = bool(use_context)
        self.dim = 3 if self.use_context else 2
        self.min_samples = int(min_samples)
        self.forgetting = float(forgetting)
        self._xtx = np.zeros((self.dim, self.dim))
        self._xty = np.zeros(self.dim)
        self._yty = 0.0
        self.n_samples = 0  # real observations (not decayed)
        self._tok_min = math.inf
        self._tok_max = -math.inf
        self._coef: np.ndarray | None = None
        self._dirty = True
        self.has_prior = prior is not None
        if prior is not None:
            prior = tuple(float(c) for c in prior)
            if len(prior) == 2 and self.use_context:
                prior = prior + (0.0,)
            if len(prior) != self.dim or any(not math.isfinite(c) or c < 0 for c in prior):
                raise ValueError(
                    f"prior must be {self.dim} finite non-negative coefficients "
                    f"({'c_base, c_tok, c_ctx' if self.use_context else 'c_base, c_tok'}), got {prior!r}"
                )
            anchors = [(1.0, 0.0), (4096.0, 0.0)] + ([(1.0, 1e6)] if self.use_context else [])
            for n, ctx in anchors:
                x = self._features(np.array([n]), np.array([ctx]))[0]
                y = prior[0] + prior[1] * n + (prior[2] * ctx if self.use_context else 0.0)
                self._xtx += prior_weight * np.outer(x, x)
                self._xty += prior_weight * x * y
                self._yty += prior_weight * y * y

    def _features(self, n_tokens: np.ndarray, context: np.ndarray | None) -> np.ndarray:
        cols = [np.ones_like(n_tokens, dtype=np.float64), n_tokens / _TOK_SCALE]
        if self.use_context:
            cols.append((context if context is not None else np.zeros_like(n_tokens)) / _CTX_SCALE)
        return np.stack(cols, axis=1)

    def observe(self, n_tokens, seconds, context_tokens=None) -> None:
        """Add measured steps.

        Args:
            n_tokens: int or array, tokens in each forward pass (>= 0).
            seconds: float or array (same shape), measured wall time of each step (> 0).
            context_tokens: int or array, KV-cache tokens read in each step (used only with
                ``use_context``; default 0).

        Raises:
            ValueError: shapes differ, or a value is negative / not finite.
        """
        if isinstance(n_tokens, _SCALARS) and isinstance(seconds, _SCALARS) and isinstance(context_tokens, _SCALARS + (type(None),)):
            self._observe_one(float(n_tokens), float(seconds), None if context_tokens is None else float(context_tokens))
            return
        n = np.atleast_1d(np.asarray(n_tokens, np.float64))
        t = np.atleast_1d(np.asarray(seconds, np.float64))
        ctx = None if context_tokens is None else np.atleast_1d(np.asarray(context_tokens, np.float64))
        if n.shape != t.shape or n.ndim != 1 or (ctx is not None and ctx.shape != n.shape):
            raise ValueError(
                f"observe: n_tokens {n.shape}, seconds {t.shape} and context_tokens "
                f"{None if ctx is None else ctx.shape} must be equal 1-d shapes"
            )
        if np.any(~np.isfinite(n)) or np.any(n < 0):
            raise ValueError(f"observe: n_tokens must be finite and >= 0, got {n[(~np.isfinite(n)) | (n < 0)][:4]}")
        if np.any(~np.isfinite(t)) or np.any(t <= 0):
            raise ValueError(f"observe: seconds must be finite and > 0, got {t[(~np.isfinite(t)) | (t <= 0)][:4]}")
        if ctx is not None and (np.any(~np.isfinite(ctx)) or np.any(ctx < 0)):
            raise ValueError("observe: context_tokens must be finite and >= 0")
        m = len(n)
        if m == 0:
            return
        x = self._features(n, ctx)
        if self.forgetting < 1.0:
            w = self.forgetting ** np.arange(m - 1, -1, -1, dtype=np.float64)
            decay = self.forgetting**m
            self._xtx *= decay
            self._xty *= decay
            self._yty *= decay
        else:
            w = np.ones(m)
        xw = x * w[:, None]
        self._xtx += xw.T @ x
        self._xty += xw.T @ t
        self._yty += float(np.dot(w * t, t))
        self.n_samples += m
        self._tok_min = min(self._tok_min, float(n.min()))
        self._tok_max = max(self._tok_max, float(n.max()))
        self._dirty = True

    def _observe_one(self, n: float, t: float, ctx: float | None) -> None:
        """:meth:`observe` for one step given as numbers (what the proposer does every engine step):
        the same sums without building and checking arrays."""
        if not (math.isfinite(n) and n >= 0):
            raise ValueError(f"observe: n_tokens must be finite and >= 0, got {[n]}")
        if not (math.isfinite(t) and t > 0):
            raise ValueError(f"observe: seconds must be finite and > 0, got {[t]}")
        if ctx is not None and not (math.isfinite(ctx) and ctx >= 0):
            raise ValueError("observe: context_tokens must be finite and >= 0")
        x = [1.0, n / _TOK_SCALE] + ([(ctx or 0.0) / _CTX_SCALE] if self.use_context else [])
        if self.forgetting < 1.0:
            f = self.forgetting
            self._xtx *= f
            self._xty *= f
            self._yty *= f
        xv = np.array(x)
        self._xtx += np.outer(xv, xv)
        self._xty += xv * t
        self._yty += t * t
        self.n_samples += 1
        self._tok_min = min(self._tok_min, n)
        self._tok_max = max(self._tok_max, n)
        self._dirty = True

    @property
    def ready(self) -> bool:
        """True when coefficients can be used: a prior was given, or enough varied observations."""
        if self.has_prior:
            return True
        return self.n_samples >= self.min_samples and self._tok_max > self._tok_min and self._solve() is not None

    def _solve(self) -> np.ndarray | None:
        if not self._dirty:
            return self._coef
        self._dirty = False
        self._coef = None
        if not np.any(self._xtx):
            return None
        # Non-negative least squares over the normal equations: try every set of free
        # coefficients (at most 2**3), keep the feasible one with the smallest residual.
        best, best_sse = None, math.inf
        dim = self.dim
        for mask in range(1, 1 << dim):
            idx = [i for i in range(dim) if mask >> i & 1]
            a = self._xtx[np.ix_(idx, idx)]
            if np.linalg.cond(a) > 1e12:
                continue
            sol = np.linalg.solve(a, self._xty[idx])
            if np.any(sol < 0):
                continue
            full = np.zeros(dim)
            full[idx] = sol
            sse = self._yty - 2 * full @ self._xty + full @ self._xtx @ full
            if sse < best_sse - 1e-18:
                best, best_sse = full, sse
        if best is None:
            return None
        scale = np.array([1.0, 1.0 / _TOK_SCALE, 1.0 / _CTX_SCALE][:dim])
        self._coef = best * scale
        return self._coef

    def _require(self) -> np.ndarray:
        coef = self._solve() if self.ready else None
        if coef is None:
            raise RuntimeError(
                f"cost model not fitted: {self.n_samples} of {self.min_samples} observations "
                f"(n_tokens seen in [{self._tok_min}, {self._tok_max}]); give a prior or observe "
                "steps with different token counts"
            )
        return coef

    @property
    def c_base(self) -> float:
        """Seconds per forward pass independent of its tokens (Eq. 1)."""
        return float(self._require()[0])

    @property
    def c_tok(self) -> float:
        """Seconds per token in a forward pass (Eq. 1)."""
        return float(self._require()[1])

    @property
    def c_ctx(self) -> float:
        """Seconds per KV-cache token read in a step (0 without ``use_context``)."""
        return float(self._require()[2]) if self.use_context else 0.0

    def coefficients(self) -> dict[str, float] | None:
        """``{"c_base", "c_tok", "c_ctx"}`` in seconds, or None while not ready."""
        if not self.ready:
            return None
        coef = self._solve()
        if coef is None:
            return None
        return {"c_base": float(coef[0]), "c_tok": float(coef[1]), "c_ctx": float(coef[2]) if self.use_context else 0.0}

    def predict(self, n_tokens, context_tokens=0):
        """Predicted step seconds for ``n_tokens`` (and ``context_tokens``); float or float64 array.

        Raises:
            RuntimeError: not ready (see the module doc).
        """
        coef = self._require()
        n = np.asarray(n_tokens, np.float64)
        out = coef[0] + coef[1] * n
        if self.use_context:
            out = out + coef[2] * np.asarray(context_tokens, np.float64)
        return float(out) if np.ndim(out) == 0 else out


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
class DrainPlan:
    """One Eq. 7 plan: ``n_fwd`` target passes; per request ``proposals`` (tokens over its
    remaining life), ``rate`` (draft tokens per step), ``caps`` (int32, this step)."""

    n_fwd: float
    proposals: np.ndarray
    rate: np.ndarray
    caps: np.ndarray
    step_rule_fired: bool


class DrainPlanSolver:
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
            raise ValueError(f"cost must be a scheduler.drain_plan.CostModel, got {type(cost).__name__}")
        if form not in ("exact", "paper"):
            raise ValueError(f"form must be 'exact' or 'paper', got {form!r}")
        self.cost = cost
        self.max_draft = _check_max_draft(max_draft)
        self.form = form
        self.step_rule = bool(step_rule)
        self.rng = np.random.default_rng(seed) if seed is not None else None
        self.last_plan: DrainPlan | None = None

    def solve(self, remaining, k, a, *, fixed_cost_s: float | None = None, per_request_cost_s=None) -> DrainPlan:
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
            :class:`DrainPlan` (caps are int32 draft tokens for this step, in ``[0, max_draft]``).

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
            self.last_plan = DrainPlan(0.0, np.zeros(r.shape), np.zeros(r.shape), zeros, False)
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
        self.last_plan = DrainPlan(float(n_fwd), p, rate, caps, fired)
        return self.last_plan

    def caps(self, remaining, k, a, *, fixed_cost_s: float | None = None, per_request_cost_s=None) -> np.ndarray:
        """int32 draft caps ``[B]`` for this step (see :meth:`solve`)."""
        return self.solve(remaining, k, a, fixed_cost_s=fixed_cost_s, per_request_cost_s=per_request_cost_s).caps


class DrainPlanBudget(Budget):
    """``eq7``: DAS Eq. 7 / Eq. 9 per request (:class:`DrainPlanSolver`) on the length predictor's
    expected remaining length, per-request acceptance estimates (:func:`estimate_acceptance`, Eq. 3)
    and the host's online :class:`CostModel`.

    Args:
        cost: the online step-cost fit (default: an unfitted ``CostModel()``); the host feeds it.
        max_draft: K, the most draft tokens per row and step.
        k_prior, a_prior, prior_steps: the Eq. 3 acceptance prior and its weight in steps.
        form, step_rule, seed: :class:`DrainPlanSolver`'s.
        draft_while_unfitted: while ``cost`` is not fitted, leave the rows' own caps (True: the
            drafts spread the step sizes the fit needs) instead of drafting nothing (False).
    """

    name = "eq7"
    summary = "DAS Eq. 7 / Eq. 9 per request: predicted remaining length, per-request acceptance estimates and the online cost model"
    runs_in = frozenset({"proposer", "simulator"})
    uses_cost_fit = True
    length_aware = True

    def __init__(self, cost: CostModel | None = None, *, max_draft: int = 16, k_prior: float = DEFAULT_K, a_prior: float = DEFAULT_A,
                 prior_steps: float = 32.0, form: str = "exact", step_rule: bool = True, seed: int | None = 0,
                 draft_while_unfitted: bool = False):
        self.cost = cost if cost is not None else CostModel()
        self.solver = DrainPlanSolver(self.cost, max_draft=max_draft, form=form, step_rule=step_rule, seed=seed)
        self.max_draft = self.solver.max_draft
        self.k_prior, self.a_prior, self.prior_steps = k_prior, a_prior, prior_steps
        self.draft_while_unfitted = bool(draft_while_unfitted)

    @classmethod
    def from_setting(cls, setting: BudgetSetting) -> DrainPlanBudget:
        """K, the host's cost line (``cost``), ``seed`` and ``draft_while_unfitted``."""
        return cls(setting.cost, max_draft=int(setting.max_draft), seed=setting.seed, draft_while_unfitted=setting.draft_while_unfitted)

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

    def describe(self) -> dict:
        return {"budget": self.name, "max_draft": self.max_draft, "cost": self.cost.coefficients()}
