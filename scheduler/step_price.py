"""The price of one engine step, fitted online: :class:`StepPrice` (the line, the two regimes and the knee).

A priced budget (:mod:`scheduler.priced_budgets`) keeps the draft tokens that pay for their
verification. What it reads of a step of ``B`` rows is one :class:`LinearPrice`:

* ``plain_s``: seconds of the step without draft tokens;
* ``spec_base_s``: seconds of the step with draft tokens, before the draft tokens' own cost (it
  can exceed ``plain_s``: the rejection sampler and the draft bookkeeping run only then);
* ``per_draft_s``: seconds per draft token verified;
* ``free_drafts``: draft tokens the step verifies at no cost of their own (below a knee); 0 for a line;
* ``fixed_s`` and ``per_row_s``: the step's fixed seconds and seconds per row (DAS Eq. 1's
  ``c_base`` and ``c_tok``), which the ``makespan`` budget turns into what an accepted token saves.

So ``m`` draft tokens cost ``spec_base_s + per_draft_s * max(m - free_drafts, 0)`` seconds. A
price comes from the user's ``c_base``/``c_tok`` (:meth:`LinearPrice.given`), from the simulator's
roofline, or from :class:`StepPrice`, which fits the engine's measured step times online:

**The two regimes** (DAS Eq. 1, ``c_base + c_tok * n_tokens``, split by regime). A step that
verifies drafts also pays a fixed cost of its own (the rejection sampler, the drafter's lookups),
and a draft token can cost more than a row's token, so one line over both kinds of step prices a
plain step wrong. :class:`TwoRegimeCost` fits

    t_plain(B)    = c_base + c_row * B
    t_spec(B, D)  = c_base + c_spec + c_row * B + c_draft * D

(``D > 0`` draft tokens) by non-negative least squares over exponentially forgotten sums, with
weak pseudo-observations that pull ``c_draft`` toward ``c_row`` and ``c_spec`` toward 0.

**The knee.** Where a step is memory-bound (a GPU decode step reads the weights and the KV cache
whatever it computes) its time is flat in the tokens verified up to a knee and rises only above
it (the roofline ``launch + max(compute, memory)``); a line over both sides charges every draft
token of a tail step, where drafts cost nothing. :class:`StepPrice` fits, beside the line (with a
KV term ``c_ctx C``, ``C`` the KV tokens read), the hinge

    t = c_base + c_spec [D > 0] + c_row B + c_ctx C + c_draft max(0, B + D - knee)

for every knee of a geometric grid (:data:`KNEES`, 4 to 8192 tokens, 2^(1/4) apart), each from its
own forgotten sums, and decides which prices the step:

* every model is fitted by non-negative least squares of the relative error (each step weighted
  by ``1 / seconds^2``) and compared with the line with ``C``, whose forgotten squared error is
  ``E``; the cut that counts is ``gap = margin * max(E, FLOOR^2 W)``, ``margin = max(10%, (ln W +
  2 ln G) / W)`` (``W`` forgotten steps, ``G`` knees: a penalised-likelihood rule that counts the
  knee search; :data:`FLOOR`: no step is timed better than 1%);
* the candidates are the grid knees with at least :data:`MIN_SIDE` forgotten steps below them, up
  to one grid point above the most tokens recently verified, or up to the accepted knee; each is
  fitted with its slope above the knee pulled weakly to the last knee's (or the line's);
* **a first knee** is accepted when its fit's error is below ``E - gap`` with at least
  :data:`MIN_SIDE` forgotten steps above it; or when the steps are **flat**: the candidate above
  them all fits within ``E + gap``, drafting steps are among them, and their draft tokens vary
  enough that drafts at the line's price would have raised that fit's error by ``2 gap``;
* **once a knee is accepted**, the knee is the largest candidate that fits as well as the best one
  within the noise (within a factor ``1 + TIE / W``, a chi-square of one degree) and within ``E +
  gap``; when none fits within ``E + gap`` the knee is dropped;
* otherwise the two-regime line prices the step, exactly as :meth:`TwoRegimeCost.price` (compute-
  bound steps never look flat, so a CPU keeps the line's decisions).

The price at knee ``k`` (:meth:`StepPrice.price`): plain ``c_base + c_row B + c_ctx C + c_draft
max(0, B - k)``, ``c_spec`` more with drafts, ``c_draft`` per draft token above ``free_drafts =
max(0, k - B)``; a row's own seconds ``c_row + c_ctx C / B``, plus ``c_draft`` above the knee.
Cost per step: about ten vector operations on ``G`` numbers; a refit (every ``refit_every``
steps) solves the ``G`` systems in one batched call.

Units: seconds; tokens; rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["FLOOR", "KNEES", "StepPrice", "LinearPrice", "MARGIN", "MIN_SIDE", "MIN_STEPS", "TwoRegimeCost", "best_subset_fit"]


@dataclass(frozen=True)
class LinearPrice:
    """One step's price, linear in the draft tokens above ``free_drafts`` (module doc).

    Attributes:
        plain_s: seconds of the step without drafts (> 0).
        spec_base_s: seconds with drafts, before their own cost (> 0).
        per_draft_s: seconds per draft token (>= 0).
        fixed_s: the step's fixed seconds (``c_base``, >= 0).
        per_row_s: seconds per row (``c_row`` / ``c_tok``, >= 0).
        free_drafts: draft tokens priced at nothing (>= 0; 0 for a line).
    """

    plain_s: float
    spec_base_s: float
    per_draft_s: float
    fixed_s: float
    per_row_s: float
    free_drafts: float = 0.0

    @classmethod
    def given(cls, c_base: float, c_tok: float, rows: int) -> LinearPrice:
        """DAS Eq. 1 for both regimes, ``t = c_base + c_tok * tokens``, at ``rows`` rows: a draft
        token costs what a row's token costs (the proposer's ``c_base``/``c_tok`` settings).

        Raises:
            ValueError: a negative or non-finite coefficient.
        """
        if not (c_base >= 0 and c_tok >= 0) or c_base == float("inf") or c_tok == float("inf"):
            raise ValueError(f"c_base and c_tok must be finite and >= 0 seconds, got {c_base!r}, {c_tok!r}")
        plain = max(c_base + c_tok * rows, 1e-9)
        return cls(plain, plain, c_tok, c_base, c_tok)

    def speculative_s(self, drafts: float) -> float:
        """Seconds of the step with ``drafts`` (> 0) draft tokens."""
        return self.spec_base_s + self.per_draft_s * max(drafts - self.free_drafts, 0.0)

    def as_tuple(self) -> tuple[float, float, float]:
        """``(plain_s, spec_base_s, per_draft_s)``, the arguments of :mod:`scheduler.priced_budgets`."""
        return self.plain_s, self.spec_base_s, self.per_draft_s


_LINE_NAMES = ("c_base", "c_row", "c_draft", "c_spec")
_LINE_SCALE = np.array([1.0, 1e-2, 1e-2, 1.0])  # features in units of 100 tokens: well-conditioned sums


def _well_conditioned(a: np.ndarray) -> bool:
    """Symmetric positive definite with a 2-norm condition number <= 1e12 (eigenvalues: cheaper than an SVD)."""
    w = np.linalg.eigvalsh(a)
    return bool(w[0] > 0.0 and w[-1] <= 1e12 * w[0])


def _subset_fit(xtx: np.ndarray, xty: np.ndarray, mask: int) -> np.ndarray | None:
    """The least-squares solution with only the coefficients in ``mask`` (bit i: coefficient i)
    free and the rest 0, as ``float64[n]``; None if that system is ill-conditioned or a free
    coefficient comes out negative."""
    n = xty.shape[0]
    idx = [i for i in range(n) if mask >> i & 1]
    a = xtx[np.ix_(idx, idx)]
    if not _well_conditioned(a):
        return None
    sol = np.linalg.solve(a, xty[idx])
    if np.any(sol < 0):
        return None
    full = np.zeros(n)
    full[idx] = sol
    return full


def best_subset_fit(xtx: np.ndarray, xty: np.ndarray, yty: float, hint: int = 15, base_free: bool = True) -> np.ndarray | None:
    """Non-negative least squares over the ``n`` coefficients from the normal equations
    (``xtx [n, n]``, ``xty [n]``), by subsets.

    Every subset of the coefficients that keeps the first (``c_base``; every subset with
    ``base_free=False``) is solved unconstrained; among the solutions without a negative
    coefficient the one with the smallest squared error wins.

    Shortcut (one solve per step instead of up to 8, each ~15 us of LAPACK overhead): the subset
    ``hint`` (a bit mask; the last fit's support) is solved first, and kept when it meets the
    Karush-Kuhn-Tucker conditions: no coefficient held at 0 has a negative gradient of the squared
    error. The squared error is convex, so such a point is the minimum over all non-negative
    coefficients, which is the subset search's answer. ``hint`` ``2**n - 1`` (all free) is the
    plain unconstrained solution.
    Returns ``float64[n]`` (scaled units) or None if no subset gives a non-negative solution.
    """
    n = xty.shape[0]
    hint = (hint | base_free) & ((1 << n) - 1) or (1 << n) - 1  # c_base always free (by default): a step never costs nothing
    full = _subset_fit(xtx, xty, hint)
    if full is not None:
        gradient = xtx @ full - xty  # half the squared error's gradient
        if all(gradient[i] >= 0.0 for i in range(n) if not hint >> i & 1):
            return full
    best, best_sse = None, math.inf
    for mask in range(1, 1 << n, 2 if base_free else 1):  # odd masks: c_base free
        full = _subset_fit(xtx, xty, mask)
        if full is None:
            continue
        sse = yty - 2 * full @ xty + full @ xtx @ full
        if sse < best_sse - 1e-18:
            best, best_sse = full, sse
    return best


class TwoRegimeCost:
    """Online fit of plain and speculative step times.

    Args:
        forgetting: per-observation weight decay in (0, 1] (0.995: a time constant of ~200 steps).
        min_plain, min_spec: observations of each regime needed before :attr:`ready`.
        prior_weight: weight (in observations) of the pseudo-observations ``c_draft = c_row`` and
            ``c_spec = 0``.
        refit_every: once fitted, solve again after this many observations (>= 1). The fit
            remembers ~200 steps, so a few steps' lag changes little, and an engine step saves
            the solve (~0.15 ms of LAPACK calls from Python on a CPU whose caches the forward
            pass just flushed).

    Raises:
        ValueError: a bad argument (named in the message).
    """

    def __init__(self, *, forgetting: float = 0.995, min_plain: int = 6, min_spec: int = 6, prior_weight: float = 2.0,
                 refit_every: int = 1):
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting!r}")
        if min_plain < 1 or min_spec < 1:
            raise ValueError(f"min_plain and min_spec must be >= 1, got {min_plain!r}, {min_spec!r}")
        if not prior_weight >= 0:
            raise ValueError(f"prior_weight must be >= 0, got {prior_weight!r}")
        if isinstance(refit_every, bool) or not isinstance(refit_every, int) or refit_every < 1:
            raise ValueError(f"refit_every must be an int >= 1, got {refit_every!r}")
        self.refit_every = refit_every
        self._unfitted = 0  # observations since the last solve
        self.forgetting = float(forgetting)
        self.min_plain, self.min_spec = int(min_plain), int(min_spec)
        self.prior_weight = float(prior_weight)
        self._xtx = np.zeros((4, 4))
        self._xty = np.zeros(4)
        self._yty = 0.0
        self.n_plain = self.n_spec = 0
        self._coef: np.ndarray | None = None
        self._support = 15  # bit mask of the last fit's free coefficients: the next fit tries it first
        self._dirty = True

    def observe(self, rows: int, drafts: int, seconds: float) -> None:
        """Add one measured step: ``rows`` decoding rows, ``drafts`` draft tokens verified, its wall ``seconds``.

        Raises:
            ValueError: ``rows < 1``, ``drafts < 0`` or ``seconds`` not finite and > 0.
        """
        if rows < 1 or drafts < 0:
            raise ValueError(f"observe: rows must be >= 1 and drafts >= 0, got rows={rows!r}, drafts={drafts!r}")
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"observe: seconds must be finite and > 0, got {seconds!r}")
        x = np.array([1.0, rows, drafts, 1.0 if drafts > 0 else 0.0]) * _LINE_SCALE
        f = self.forgetting
        self._xtx = f * self._xtx + np.outer(x, x)
        self._xty = f * self._xty + x * seconds
        self._yty = f * self._yty + seconds * seconds
        if drafts > 0:
            self.n_spec += 1
        else:
            self.n_plain += 1
        self._unfitted += 1
        if self._coef is None or self._unfitted >= self.refit_every:
            self._dirty = True

    def observe_steps(self, rows, drafts, seconds) -> None:
        """:meth:`observe` for many steps at once, in order (float arrays of one shape; a
        simulator's steps between two decisions): the same sums as one call per step.

        Raises:
            ValueError: as :meth:`observe`, or arrays of different shapes.
        """
        b, d, t = (np.atleast_1d(np.asarray(a, np.float64)) for a in (rows, drafts, seconds))
        if not (b.shape == d.shape == t.shape and b.ndim == 1):
            raise ValueError(f"observe_steps: rows {b.shape}, drafts {d.shape} and seconds {t.shape} must be one 1-D shape")
        if b.size == 0:
            return
        if np.any(b < 1) or np.any(d < 0) or not np.all(np.isfinite(t) & (t > 0)):
            raise ValueError("observe_steps: rows must be >= 1, drafts >= 0 and seconds finite and > 0")
        x = np.stack([np.ones_like(b), b, d, (d > 0).astype(np.float64)], axis=1) * _LINE_SCALE
        w = self.forgetting ** np.arange(b.size - 1, -1, -1, dtype=np.float64)
        decay = self.forgetting**b.size
        self._xtx = decay * self._xtx + (x * w[:, None]).T @ x
        self._xty = decay * self._xty + (x * w[:, None]).T @ t
        self._yty = decay * self._yty + float(w @ (t * t))
        spec = int(np.count_nonzero(d > 0))
        self.n_spec += spec
        self.n_plain += b.size - spec
        self._unfitted += b.size
        if self._coef is None or self._unfitted >= self.refit_every:
            self._dirty = True

    def squared_error(self) -> float:
        """The fit's forgotten squared error over the observed steps (seconds squared; the
        pseudo-observations left out), or ``inf`` before a fit."""
        coef = self._solve()
        if coef is None:
            return math.inf
        b = coef / _LINE_SCALE
        return float(max(self._yty - 2.0 * b @ self._xty + b @ self._xtx @ b, 0.0))

    @property
    def ready(self) -> bool:
        """Both regimes observed often enough and a non-negative fit exists."""
        return self.n_plain >= self.min_plain and self.n_spec >= self.min_spec and self._solve() is not None

    def _solve(self) -> np.ndarray | None:
        if not self._dirty:
            return self._coef
        self._dirty = False
        self._unfitted = 0
        xtx, xty = self._xtx.copy(), self._xty.copy()
        # Pseudo-observations: (c_draft - c_row) = 0 and c_spec = 0, each with prior_weight.
        # They only matter while the data cannot separate the coefficients.
        scale_t = max(self._yty, 1e-12) ** 0.5 / max(self._xtx[0, 0], 1.0) ** 0.5  # seconds per step, typical
        for row in (np.array([0.0, -1.0, 1.0, 0.0]) * scale_t, np.array([0.0, 0.0, 0.0, 1.0])):
            xtx += self.prior_weight * np.outer(row, row)
        best = best_subset_fit(xtx, xty, self._yty, self._support)
        if best is not None:
            self._support = sum(1 << i for i in range(4) if best[i] > 0.0)
        self._coef = None if best is None else best * _LINE_SCALE
        return self._coef

    def coefficients(self) -> dict[str, float] | None:
        """``{"c_base", "c_row", "c_draft", "c_spec"}`` in seconds (per row / per draft token), or None before any fit."""
        coef = self._solve()
        return None if coef is None else {k: float(v) for k, v in zip(_LINE_NAMES, coef)}

    def plain(self, rows: int) -> float:
        """Predicted seconds of a step with ``rows`` rows and no drafts.

        Raises:
            RuntimeError: nothing fitted yet.
        """
        c = self._require()
        return float(c[0] + c[1] * rows)

    def speculative(self, rows: int, drafts: np.ndarray) -> np.ndarray:
        """Predicted seconds of a step with ``rows`` rows and each of ``drafts`` (int array, > 0) draft tokens."""
        c = self._require()
        return c[0] + c[3] + c[1] * rows + c[2] * np.asarray(drafts, np.float64)

    def price(self, rows: int) -> LinearPrice:
        """The fitted price of a step of ``rows`` rows (:class:`scheduler.step_price.LinearPrice`):
        plain ``c_base + c_row * rows``, speculative before drafts ``+ c_spec``, ``c_draft`` per
        draft token (each time at least 1 ns).

        Raises:
            RuntimeError: nothing fitted yet.
        """
        c = self._require()
        plain = max(float(c[0] + c[1] * rows), 1e-9)
        return LinearPrice(plain, max(float(c[0]) + float(c[3]) + float(c[1]) * rows, 1e-9), float(c[2]), float(c[0]), float(c[1]))

    def _require(self) -> np.ndarray:
        coef = self._solve()
        if coef is None:
            raise RuntimeError(f"step cost not fitted yet ({self.n_plain} plain, {self.n_spec} speculative steps observed)")
        return coef


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


class StepPrice:
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
        (:meth:`scheduler.step_price.TwoRegimeCost.price`) without a knee; with knee ``k``, draft
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
