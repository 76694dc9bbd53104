"""Per-step cost model of DAS (arXiv 2511.13841, Eq. 1), fitted online from measured step times.

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
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["CostModel"]

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
