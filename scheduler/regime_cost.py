"""Step cost with two regimes, plain and speculative, fitted online (DAS Eq. 1, split by regime).

DAS's Eq. 1 prices a forward pass as ``c_base + c_tok * n_tokens``. On a real engine a step that
verifies drafts also pays a fixed cost of its own (the rejection sampler, draft bookkeeping,
the drafter's lookups), and a draft token can cost more than a row's token (its logits are
sampled and verified too), so one line fitted over both kinds of step prices a plain step wrong
and makes "draft nothing" look worse than it is. :class:`TwoRegimeCost` fits

    t_plain(B)    = c_base + c_row * B
    t_spec(B, D)  = c_base + c_spec + c_row * B + c_draft * D

(seconds; ``B`` rows decoding, ``D`` draft tokens verified, ``D > 0``) by non-negative least
squares over exponentially forgotten sums, with weak pseudo-observations that pull
``c_draft`` toward ``c_row`` and ``c_spec`` toward 0 until the data say otherwise.
"""

from __future__ import annotations

import math

import numpy as np

from scheduler.step_price import LinearPrice

__all__ = ["TwoRegimeCost", "best_subset_fit"]

_NAMES = ("c_base", "c_row", "c_draft", "c_spec")
_SCALE = np.array([1.0, 1e-2, 1e-2, 1.0])  # features in units of 100 tokens: well-conditioned sums


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
        x = np.array([1.0, rows, drafts, 1.0 if drafts > 0 else 0.0]) * _SCALE
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
        x = np.stack([np.ones_like(b), b, d, (d > 0).astype(np.float64)], axis=1) * _SCALE
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
        b = coef / _SCALE
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
        self._coef = None if best is None else best * _SCALE
        return self._coef

    def coefficients(self) -> dict[str, float] | None:
        """``{"c_base", "c_row", "c_draft", "c_spec"}`` in seconds (per row / per draft token), or None before any fit."""
        coef = self._solve()
        return None if coef is None else {k: float(v) for k, v in zip(_NAMES, coef)}

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
