"""Step cost with a knee: flat in the tokens verified up to a knee, linear above it, fitted online.

Where an engine step is compute-bound (a CPU) its time rises with every token it verifies, and the
two-regime line of :mod:`scheduler.regime_cost` prices it. Where it is memory-bound (a GPU decode
step reads the weights and the KV cache whatever it computes) its time is flat in the tokens
verified up to a knee of hundreds of tokens and rises only above it: the roofline,
``launch + max(compute, memory)``. A line fitted over steps on both sides of the knee charges
every draft token of a tail step, where drafts cost nothing. :class:`KneeCost` fits, beside that
line, the hinge

    t = c_base + c_spec [D > 0] + c_row B + c_ctx C + c_draft max(0, B + D - knee)

(seconds; ``B`` rows, ``D`` draft tokens verified, ``B + D`` the tokens verified, ``C`` the KV
tokens the step reads: a memory-bound step's time grows with them, and a fit without them takes
their growth over a rollout for a cost of the drafts) for every knee of a geometric grid
(:data:`KNEES`, 4 to 8192 tokens, 2^(1/4) apart: a knee is found to within 10%), each from its
own exponentially forgotten sums (all updated by a few vector operations per step), and decides
which prices the step:

* every model is fitted by non-negative least squares (every coefficient may be 0) of the relative error (each step weighted
  by ``1 / seconds^2``: a short step in the flat region counts as much as a long one above the
  knee) and compared with the same line with ``C`` (``t = c_base + c_spec [D > 0] + c_row B +
  c_ctx C + c_draft D``), whose forgotten squared error is ``E``; the cut that counts is
  ``gap = margin * max(E, FLOOR^2 W)``, ``margin = max(10%, (ln W + 2 ln G) / W)`` (``W``
  forgotten steps, ``G`` knees: a penalised-likelihood rule that counts the knee search;
  :data:`FLOOR`: no step is timed better than 1%, so a cut within a timer's and a machine's jitter
  never counts);
* the candidates are the grid knees with at least :data:`MIN_SIDE` forgotten steps below them,
  up to one grid point (19%) above the most tokens recently verified, or up to the accepted knee;
  each is fitted with its
  slope above the knee pulled, by a weak pseudo-observation, to the last knee's (or the line's),
  which holds it where few steps lie above;
* **a first knee** is accepted when its fit's error is below ``E - gap``, with at least
  :data:`MIN_SIDE` forgotten steps above it; or when the steps are **flat**: the candidate above
  them all fits within ``E + gap`` (no draft seen so far cost anything measurable), drafting steps
  are among them, and their draft tokens vary enough that drafts at the line's price would have
  raised that fit's error by ``2 gap``;
* **once a knee is accepted** (the engine has shown one), the knee is the largest candidate that
  fits as well as the best one within the noise (its error within a factor ``1 + TIE / W`` of the
  best's, a chi-square of one degree) and within ``E + gap``: a knee moves with the KV cache as a
  rollout grows; where the steps are flat up to the knee, drafts are free one grid point above
  them, the budget drafts further, and the steps show where the knee is; in a long tail every step
  lies below the knee, and nothing there contradicts it. When no candidate fits within ``E + gap``
  the knee is dropped;
* otherwise the two-regime line prices the step: the price is then exactly
  :meth:`scheduler.regime_cost.TwoRegimeCost.price` (compute-bound steps never look flat, so a CPU
  keeps the line's decisions).

The price of a step of ``B`` rows reading ``C`` KV tokens at knee ``k`` (:meth:`KneeCost.price`):
plain ``c_base + c_row B + c_ctx C + c_draft max(0, B - k)``, ``c_spec`` more with drafts,
``c_draft`` per draft token above ``free_drafts = max(0, k - B)``; a row's own seconds (what the
``makespan`` budget values an accepted token by) ``c_row + c_ctx C / B`` (its KV read), plus
``c_draft`` above the knee (:class:`scheduler.step_price.LinearPrice`).

Cost per step: about ten vector operations on ``G`` numbers; a refit (every ``refit_every``
steps) solves the ``G`` systems in one batched call and two or three non-negative fits.

Units: seconds; tokens; rows.
"""

from __future__ import annotations

import math

import numpy as np

from scheduler.regime_cost import TwoRegimeCost, best_subset_fit
from scheduler.step_price import LinearPrice

__all__ = ["FLOOR", "KNEES", "MARGIN", "MIN_SIDE", "MIN_STEPS", "KneeCost"]

KNEES = 4.0 * 2.0 ** (np.arange(45) / 4.0)  # candidate knees, tokens verified per step (4 .. 8192)
MARGIN = 0.1  # the least relative cut of the squared error that counts (module doc)
MIN_SIDE = 8.0  # forgotten steps needed on each side of a knee (and drafting steps for "flat")
MIN_STEPS = 32.0  # forgotten steps needed before any knee is considered
TIE = 4.0  # knees whose squared errors differ by less than TIE / W of it (a chi-square of one degree at 95%) tie: the larger wins
FLOOR = 0.01  # relative error of a measured step time that no fit is credited for beating (timer, jitter)
# Features: 1, rows, h (the knee's max(0, tokens - knee), or the line's draft tokens), [drafting],
# KV tokens read; scaled to well-conditioned sums (rows and tokens in 100s, KV tokens in millions).
_SCALE = np.array([1.0, 1e-2, 1e-2, 1.0, 1e-6])
_NAMES = ("c_base", "c_row", "c_draft", "c_spec", "c_ctx")
_SHARED = np.array([0, 1, 3, 4])  # the features every model has, in the order of the shared sums
_ALL = (1 << 5) - 1


class KneeCost:
    """Online step cost: the two-regime line, or a hinge with a knee where the steps show one (module doc).

    Args:
        forgetting: per-step weight decay in (0, 1] (0.995: a time constant of ~200 steps).
        min_plain, min_spec: steps of each regime needed before :attr:`ready` (the line's).
        prior_weight: weight (in steps) of the pseudo-observations: the line's (``c_draft =
            c_row``, ``c_spec = 0``) and the knee's (``c_spec = 0``; ``c_draft`` = its last fit).
        refit_every: once fitted, solve again after this many steps (>= 1).
        knees: candidate knees (tokens verified, increasing, > 0); default :data:`KNEES`.
        margin: the least relative cut of the squared error that counts (default :data:`MARGIN`).

    Raises:
        ValueError: a bad argument (named in the message).
    """

    def __init__(self, *, forgetting: float = 0.995, min_plain: int = 6, min_spec: int = 6, prior_weight: float = 2.0,
                 refit_every: int = 1, knees: np.ndarray | None = None, margin: float = MARGIN):
        self.line = TwoRegimeCost(forgetting=forgetting, min_plain=min_plain, min_spec=min_spec, prior_weight=prior_weight,
                                  refit_every=refit_every)
        self.knees = np.asarray(KNEES if knees is None else knees, np.float64)
        if self.knees.ndim != 1 or self.knees.size < 1 or np.any(self.knees <= 0) or np.any(np.diff(self.knees) <= 0):
            raise ValueError(f"knees must be increasing token counts > 0, got {knees!r}")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {margin!r}")
        self.margin = float(margin)
        self.refit_every = self.line.refit_every
        self._unfitted = 0  # steps since the last solve
        self._fitted = False  # solved once with the line fitted
        g = self.knees.size
        # Forgotten sums of the weighted normal equations. The features 1, rows, [drafting] and KV
        # tokens are every model's: their sums are kept once (_uu, _uy). The third feature is the
        # model's own, h: max(0, tokens - knee) for knee g < G, the draft tokens for the line
        # (row G); kept are h * (1, rows, [drafting], KV tokens, seconds) (_hx) and h^2 (_hh).
        self._u = np.zeros(5)  # one step's weighted (1, rows, [drafting], KV tokens, seconds), reused
        self._uu = np.zeros((4, 4))
        self._uy = np.zeros(4)
        self._hx = np.zeros((g + 1, 5))
        self._hh = np.zeros(g + 1)
        self._yty = 0.0  # forgotten sum of the weighted seconds squared: the forgotten steps
        self._above = np.zeros(g)  # forgotten steps with more tokens verified than each knee
        self._drafting = 0.0  # forgotten steps with drafts
        self._offsets = np.append(self.knees, 0.0)  # h = max(0, tokens - offset); row G's is replaced by the drafts
        self._per_row_ctx = 0.0  # the last step's KV tokens per row (a price's default context)
        self._knee: int | None = None  # index of the accepted knee
        self._coef: np.ndarray | None = None  # the coefficients at it (seconds)
        self._support = {}  # each model's last support (best_subset_fit's hint)
        self._dirty = True

    # ------------------------------------------------------------------ observing
    def observe(self, rows: int, drafts: float, seconds: float, context: float = 0.0) -> None:
        """Add one measured step: ``rows`` rows, ``drafts`` draft tokens verified, its wall
        ``seconds``, ``context`` KV tokens read (prompt + output of its rows).

        Raises:
            ValueError: ``rows < 1``, ``drafts < 0``, ``seconds`` not finite and > 0, or a
                negative ``context``.
        """
        self.line.observe(rows, drafts, seconds)
        if not context >= 0:
            raise ValueError(f"observe: context must be >= 0 KV tokens, got {context!r}")
        f = self.line.forgetting
        r = 1.0 / seconds
        u = self._u
        u[0], u[1], u[2], u[3], u[4] = r, rows * 1e-2 * r, r if drafts > 0 else 0.0, context * 1e-6 * r, 1.0
        self._uu *= f
        self._uu += np.outer(u[:4], u[:4])
        self._uy *= f
        self._uy += u[:4]
        h = np.maximum(rows + drafts - self._offsets, 0.0)
        h[-1] = drafts
        h *= 1e-2 * r
        self._hx *= f
        self._hx += np.multiply.outer(h, u)
        self._hh *= f
        self._hh += h * h
        self._above *= f
        self._above += h[:-1] > 0.0
        self._yty = f * self._yty + 1.0
        self._drafting = f * self._drafting + (drafts > 0)
        self._per_row_ctx = context / rows
        self._count(1)

    def observe_steps(self, rows, drafts, seconds, context=None) -> None:
        """:meth:`observe` for many steps at once, in order (1-D arrays of one shape; ``context``
        None: 0): the same sums.

        Raises:
            ValueError: as :meth:`observe`, or arrays of different shapes.
        """
        b, d, t = (np.atleast_1d(np.asarray(a, np.float64)) for a in (rows, drafts, seconds))
        c = np.zeros_like(b) if context is None else np.atleast_1d(np.asarray(context, np.float64))
        self.line.observe_steps(b, d, t)  # checks the values and the shapes
        if c.shape != b.shape or np.any(~(c >= 0)):
            raise ValueError(f"observe_steps: context must be {b.shape} KV token counts >= 0, got shape {c.shape}")
        if b.size == 0:
            return
        f = self.line.forgetting
        w = f ** np.arange(b.size - 1, -1, -1, dtype=np.float64)
        decay = f**b.size
        r = 1.0 / t
        u = np.stack([r, b * 1e-2 * r, (d > 0) * r, c * 1e-6 * r, np.ones_like(r)], axis=1)  # [m, 5]
        uw = u * w[:, None]
        h = np.maximum(b[:, None] + d[:, None] - self._offsets[None, :], 0.0)  # [m, G + 1]
        h[:, -1] = d
        h *= (1e-2 * r)[:, None]
        self._uu = decay * self._uu + uw[:, :4].T @ u[:, :4]
        self._uy = decay * self._uy + uw[:, :4].sum(axis=0)
        self._hx = decay * self._hx + h.T @ uw
        self._hh = decay * self._hh + (h * h).T @ w
        self._above = decay * self._above + (h[:, :-1] > 0.0).T @ w
        self._yty = decay * self._yty + float(w.sum())
        self._drafting = decay * self._drafting + float(w @ (d > 0))
        self._per_row_ctx = float(c[-1] / b[-1])
        self._count(b.size)

    def _count(self, steps: int) -> None:
        """Solve again until the first fit at every step, then after ``refit_every`` steps (the
        line's cadence). The solve runs here, not at the next read: the knee it keeps is state,
        and it must not depend on how often a host reads the price."""
        self._unfitted += steps
        if not self._fitted or self._unfitted >= self.refit_every:
            self._dirty = True
            if self.line.n_plain >= self.line.min_plain and self.line.n_spec >= self.line.min_spec:
                self._solve()

    # ------------------------------------------------------------------ fitting
    @property
    def n_plain(self) -> int:
        """Plain steps observed."""
        return self.line.n_plain

    @property
    def n_spec(self) -> int:
        """Speculative steps observed."""
        return self.line.n_spec

    @property
    def min_plain(self) -> int:
        """Plain steps needed before :attr:`ready`."""
        return self.line.min_plain

    @property
    def ready(self) -> bool:
        """Both regimes observed often enough and the line has a non-negative fit (a knee needs more)."""
        return self.line.ready

    @property
    def knee(self) -> float:
        """The accepted knee, tokens verified per step below which a step is flat; 0.0: none (the line prices)."""
        self._solve()
        return 0.0 if self._knee is None else float(self.knees[self._knee])

    def _normal(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The weighted normal equations ``(xtx [n, 5, 5], xty [n, 5])`` of the models ``idx`` (a
        knee's index, or ``G`` for the line; features 1, rows, h, [drafting], KV tokens, scaled)."""
        xtx = np.zeros((idx.size, 5, 5))
        xtx[:, _SHARED[:, None], _SHARED[None, :]] = self._uu
        hx = self._hx[idx]
        row = np.stack([hx[:, 0], hx[:, 1], self._hh[idx], hx[:, 2], hx[:, 3]], axis=1)
        xtx[:, 2, :] = row
        xtx[:, :, 2] = row
        xty = np.zeros((idx.size, 5))
        xty[:, _SHARED] = self._uy
        xty[:, 2] = hx[:, 4]
        return xtx, xty

    def _fit(self, g: int | None, hold: np.ndarray | None = None) -> tuple[np.ndarray, float] | None:
        """The non-negative fit of model ``g`` (a knee, ``G``: the line with KV tokens, None: no
        draft term) in scaled units, and its forgotten relative squared error; ``c_spec`` pulled to
        0 by a weak pseudo-observation, and with ``hold`` (a last fit) ``c_draft`` to its value (it
        holds the slope above a knee that no recent step reached)."""
        (xtx,), (xty,) = self._normal(np.array([self.knees.size if g is None else g]))
        if g is None:
            xtx[2, :] = xtx[:, 2] = xty[2] = 0.0
            xtx[2, 2] = 1.0  # c_draft pinned to 0
        data = xtx.copy(), xty.copy()
        xtx[3, 3] += self.line.prior_weight
        if hold is not None:
            xtx[2, 2] += self.line.prior_weight
            xty[2] += self.line.prior_weight * hold[2]
        best = best_subset_fit(xtx, xty, self._yty, self._support.get(g, _ALL), base_free=False)
        if best is None:
            return None
        self._support[g] = sum(1 << i for i in range(5) if best[i] > 0.0)
        return best, float(max(self._yty - 2.0 * best @ data[1] + best @ data[0] @ best, 0.0))

    def _shows_drafts(self, slope: float, error: float) -> bool:
        """Whether the steps vary their draft tokens enough (apart from the rows, the drafting
        indicator and the KV tokens) that drafts costing ``slope`` each (scaled units) would have
        raised the squared error of a fit without them by ``error``: only then does a flat fit
        say that drafts cost nothing."""
        (xtx,), _ = self._normal(np.array([self.knees.size]))
        xtx[3, 3] += self.line.prior_weight
        try:
            inv = np.linalg.inv(xtx)[2, 2]
        except np.linalg.LinAlgError:
            return False
        if not inv > 0.0:
            return False
        spread = 1.0 / inv  # the draft tokens' squared residual on the other features
        return bool(slope * slope * spread >= error)

    def _knee_errors(self, idx: np.ndarray, slope: float) -> np.ndarray:
        """The forgotten squared errors of the unconstrained fits at the knees ``idx``, with
        ``c_spec`` pulled to 0 and ``c_draft`` to ``slope`` (scaled) by weak pseudo-observations
        (the slope holds where few steps lie above a knee); ``inf`` where the slope comes out <= 0."""
        xtx, xty = self._normal(idx)
        a, b = xtx.copy(), xty.copy()
        a[:, 3, 3] += self.line.prior_weight
        a[:, 2, 2] += self.line.prior_weight
        b[:, 2] += self.line.prior_weight * slope
        a += (1e-12 * np.trace(a, axis1=1, axis2=2))[:, None, None] * np.eye(5)  # solvable when rows never vary
        sol = np.linalg.solve(a, b[:, :, None])[:, :, 0]
        sse = self._yty - 2.0 * np.einsum("gi,gi->g", sol, xty) + np.einsum("gi,gij,gj->g", sol, xtx, sol)
        return np.where(sol[:, 2] > 0, sse, np.inf)

    def _solve(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        self._unfitted = 0
        if self.line.coefficients() is None:
            self._knee, self._coef = None, None
            return
        self._fitted = True
        w = self._yty
        line = self._fit(self.knees.size) if w >= MIN_STEPS else None
        if line is None:
            self._knee, self._coef = None, None
            return
        e = line[1]
        margin = max(self.margin, (math.log(w) + 2.0 * math.log(self.knees.size)) / w)
        gap = margin * max(e, FLOOR**2 * w)
        # a draft's price above the knee: the last knee's slope, or the line's
        slope = self._coef[2] / _SCALE[2] if self._coef is not None else self.line.coefficients()["c_draft"] / _SCALE[2]
        top = min(int(np.searchsorted(-self._above, -1.0)) + 1, self.knees.size - 1)  # one grid point above the steps seen
        reach = top if self._knee is None else max(top, self._knee)  # a knee no recent step reached stays a candidate
        cand = np.flatnonzero((self._yty - self._above >= MIN_SIDE) & (np.arange(self.knees.size) <= reach))
        g = None
        if cand.size:
            sse = self._knee_errors(cand, slope)
            if self._knee is None:
                firm = (self._above[cand] >= MIN_SIDE) & (sse < e - gap)
                if firm.any():  # a knee that fits clearly better than the line, with steps on both sides
                    g = int(cand[np.argmin(np.where(firm, sse, np.inf))])
                elif (cand[-1] == top and sse[-1] <= e + gap and self._drafting >= MIN_SIDE
                      and self._shows_drafts(slope, 2.0 * gap)):  # flat: no draft seen cost anything measurable
                    g = top
            else:  # the largest knee that fits as well as the best one within the noise, and no worse than the line
                ok = sse <= min(float(sse.min()) * (1.0 + TIE / w), e + gap)
                g = int(cand[ok][-1]) if ok.any() else None
        fit = None if g is None else self._fit(g, np.full(5, slope))
        if fit is None:
            self._knee, self._coef = None, None
            return
        if not fit[0][2] > 0:
            fit[0][2] = slope
        self._knee, self._coef = g, fit[0] * _SCALE

    # ------------------------------------------------------------------ pricing
    def coefficients(self) -> dict[str, float] | None:
        """``{"c_base", "c_row", "c_draft", "c_spec", "c_ctx", "knee"}`` of the model that prices
        (seconds, per row, per token verified above the knee, per KV token; ``knee`` in tokens,
        0.0: the line, whose ``c_draft`` is per draft token and ``c_ctx`` 0), or None before any fit."""
        self._solve()
        if self._knee is None:
            c = self.line.coefficients()
            return None if c is None else {**c, "c_ctx": 0.0, "knee": 0.0}
        return {**{k: float(v) for k, v in zip(_NAMES, self._coef)}, "knee": float(self.knees[self._knee])}

    def plain(self, rows: int, context: float | None = None) -> float:
        """Predicted seconds of a step with ``rows`` rows, no drafts, reading ``context`` KV tokens
        (None: the last step's per row, times ``rows``).

        Raises:
            RuntimeError: nothing fitted yet.
        """
        self._solve()
        if self._knee is None:
            return self.line.plain(rows)
        c, k = self._coef, self.knees[self._knee]
        ctx = self._per_row_ctx * rows if context is None else float(context)
        return float(c[0] + c[1] * rows + c[4] * ctx + c[2] * max(rows - k, 0.0))

    def price(self, rows: int, context: float | None = None) -> LinearPrice:
        """The price of a step of ``rows`` rows reading ``context`` KV tokens (None: the last
        step's per row, times ``rows``) (:class:`scheduler.step_price.LinearPrice`): the line's
        (:meth:`scheduler.regime_cost.TwoRegimeCost.price`) without a knee; with knee ``k``, draft
        tokens free up to ``max(0, k - rows)`` and ``c_draft`` each above (module doc).

        Raises:
            RuntimeError: nothing fitted yet.
        """
        self._solve()
        if self._knee is None:
            return self.line.price(rows)
        c, k = self._coef, float(self.knees[self._knee])
        ctx = self._per_row_ctx * rows if context is None else float(context)
        plain = self.plain(rows, ctx)
        per_row = c[1] + c[4] * ctx / max(rows, 1) + (c[2] if rows > k else 0.0)  # a row's own seconds: its KV read too
        return LinearPrice(max(plain, 1e-9), max(plain + float(c[3]), 1e-9), float(c[2]), float(c[0]), float(per_row),
                           free_drafts=max(k - rows, 0.0))
