"""Online reliability calibration of draft-token acceptance probabilities.

A suffix-tree drafter scores each draft token with a *path probability*: the product of the
tree's continuation frequencies up to it, i.e. its estimate of P(this token and every earlier
draft token of the row are accepted). Those frequencies are biased in ways a single factor
cannot fix: a branch seen once says ``1.0`` and is often wrong, a branch seen in 40 of 50
rollouts says ``0.8`` and is about right. A cost budget that prices each draft token by its
probability (:func:`scheduler.draft_selection.choose_drafts`) needs the *real* probability.

:class:`AcceptanceCalibration` learns the map from the engine's own verification outcomes,
binned by the drafter's probability (a reliability diagram, Niculescu-Mizil & Caruana 2005,
"Predicting good probabilities with supervised learning"): a row that drafted tokens with path
probabilities ``p[0] >= p[1] >= ...`` and had ``a`` of them accepted contributes, for token
``i``, one trial in the bin of ``p[i]`` that succeeded iff ``i < a``. Per bin it keeps the sums
(with exponential forgetting, so it follows a policy that changes) of trials, successes and
predicted probability; a bin's factor ``(successes + w * g) / (predicted + w)`` shrinks toward
the global factor ``g`` while the bin has little evidence. Calibrated probabilities are
``p * factor(bin(p))`` at each bin's mean probability, joined piecewise linearly and made
non-decreasing in ``p`` (so a row's calibrated path probabilities stay non-increasing, as a path
probability must), clipped to [0, 1].

Units: probabilities are dimensionless; counts are draft tokens.
"""

from __future__ import annotations

import numpy as np

__all__ = ["AcceptanceCalibration"]


class AcceptanceCalibration:
    """Per-probability-bin acceptance factors learned from accepted / rejected draft tokens.

    Args:
        bins: number of equal-width bins over [0, 1] (>= 1).
        forgetting: factor (0, 1] applied to all sums before each :meth:`observe` call (one
            engine step); 0.999 weighs the last ~1,000 steps.
        prior_weight: draft tokens of pseudo-evidence at the global factor in every bin (> 0).

    Raises:
        ValueError: an argument out of its range (the message names it).
    """

    def __init__(self, bins: int = 10, forgetting: float = 0.999, prior_weight: float = 8.0):
        if type(bins) is not int or bins < 1:
            raise ValueError(f"bins must be an int >= 1, got {bins!r}")
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting!r}")
        if not prior_weight > 0.0:
            raise ValueError(f"prior_weight must be > 0 draft tokens, got {prior_weight!r}")
        self.bins, self.forgetting, self.prior_weight = bins, float(forgetting), float(prior_weight)
        self.trials = np.zeros(bins)  # draft tokens verified, per bin
        self.accepted = np.zeros(bins)  # of which accepted
        self.predicted = np.zeros(bins)  # sum of their raw path probabilities
        self._curve: tuple[np.ndarray, np.ndarray] | None = None  # cached until the next observe

    def _bin(self, probs: np.ndarray) -> np.ndarray:
        return np.minimum((np.clip(probs, 0.0, 1.0) * self.bins).astype(np.int64), self.bins - 1)

    def observe(self, probs: np.ndarray, accepted: np.ndarray) -> None:
        """Add one step's verification outcomes.

        Args:
            probs: float ``[n]`` raw path probabilities of the draft tokens verified this step
                (all rows concatenated).
            accepted: bool ``[n]``: whether each of them was accepted.

        Raises:
            ValueError: shapes differ.
        """
        probs = np.asarray(probs, np.float64)
        accepted = np.asarray(accepted, bool)
        if probs.shape != accepted.shape or probs.ndim != 1:
            raise ValueError(f"probs and accepted must be 1-D of one length, got shapes {probs.shape} and {accepted.shape}")
        self._curve = None
        f = self.forgetting
        self.trials *= f
        self.accepted *= f
        self.predicted *= f
        if probs.shape[0] == 0:
            return
        b = self._bin(probs)
        self.trials += np.bincount(b, minlength=self.bins)
        self.accepted += np.bincount(b, weights=accepted.astype(np.float64), minlength=self.bins)
        self.predicted += np.bincount(b, weights=probs, minlength=self.bins)

    def global_factor(self) -> float:
        """Accepted / predicted over all bins, with 4 tokens of prior at 1.0."""
        return float((self.accepted.sum() + 4.0) / (self.predicted.sum() + 4.0))

    def factors(self) -> np.ndarray:
        """float ``[bins]``: each bin's accepted / predicted, shrunk toward :meth:`global_factor`."""
        g, w = self.global_factor(), self.prior_weight
        return (self.accepted + w * g) / (self.predicted + w)

    def curve(self) -> tuple[np.ndarray, np.ndarray]:
        """The calibration map as points ``(raw, calibrated)``, float ``[bins + 2]`` each, both
        non-decreasing: (0, 0), each bin's mean raw probability (its centre while it has no
        trials) times the bin's factor, and raw 1.0. Non-decreasing keeps a row's calibrated
        path probabilities non-increasing, as path probabilities must be."""
        if self._curve is not None:
            return self._curve
        centre = (np.arange(self.bins) + 0.5) / self.bins
        x = np.where(self.trials > 1e-9, self.predicted / np.maximum(self.trials, 1e-12), centre)
        fac = self.factors()
        y = np.minimum(x * fac, 1.0)
        xs = np.concatenate(([0.0], x, [1.0]))
        ys = np.maximum.accumulate(np.concatenate(([0.0], y, [min(1.0, float(fac[-1]))])))
        self._curve = (xs, ys)
        return self._curve

    def __call__(self, probs: np.ndarray) -> np.ndarray:
        """Calibrated probabilities: float64 of ``probs``' shape, in [0, 1], a non-decreasing
        function of the raw probability (piecewise linear through :meth:`curve`)."""
        xs, ys = self.curve()
        return np.interp(np.clip(np.asarray(probs, np.float64), 0.0, 1.0), xs, ys)

    def table(self) -> list[dict[str, float]]:
        """The reliability diagram: per bin ``lo``, ``hi``, ``trials``, ``predicted`` (mean raw
        probability), ``observed`` (acceptance rate) and ``calibrated`` (mean calibrated
        probability); bins without trials are left out."""
        out = []
        for b in range(self.bins):
            n = float(self.trials[b])
            if n < 1e-9:
                continue
            pm = float(self.predicted[b] / n)
            out.append({"lo": b / self.bins, "hi": (b + 1) / self.bins, "trials": round(n, 2), "predicted": round(pm, 4),
                        "observed": round(float(self.accepted[b] / n), 4), "calibrated": round(float(self(np.array([pm]))[0]), 4)})
        return out
