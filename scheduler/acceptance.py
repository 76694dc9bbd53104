"""Acceptance of draft tokens: DAS's per-request prior (Eq. 3-4) and the online calibration of the drafter's probabilities.

**The prior** (arXiv 2511.13841, Eq. 3-4). A request with target length ``l`` (tokens), drafter
capacity ``k`` in (0, 1) and accept efficiency ``a > 0`` that is offered ``p`` draft tokens in total
accepts ``A = k * l * (1 - exp(-a * p / l))`` of them; it then needs ``N = l - A = l * (1 - k + k *
exp(-a * p / l))`` forward passes (verification steps). Per engine step (:func:`tokens_per_step`):
a request offered ``d`` draft tokens in every step advances ``tau = l / N`` tokens per step, the
root of ``1 / tau = 1 - k + k * exp(-a * d / tau)``; ``tau(0) = 1``, ``tau`` saturates at ``1 / (1 -
k)``, and ``tau(d) - 1 <= k * a * d``. This memoryless form is exactly Eq. 3 for a request drafted
at a constant rate, which is how :mod:`scheduler.drain_plan` spends a budget.
:func:`estimate_acceptance` fits ``k, a`` per request from its own evidence.

**The calibration** (:class:`AcceptanceCalibration`). A suffix-tree drafter scores each draft
token with a *path probability*: its estimate of P(this token and every earlier draft token of the
row are accepted). Those frequencies are biased in ways one factor cannot fix: a branch seen once
says ``1.0`` and is often wrong, a branch seen in 40 of 50 rollouts says ``0.8`` and is about
right. A priced budget (:func:`scheduler.priced_budgets.choose_drafts`) needs the real
probability, so the map is learned from the engine's own verification outcomes, binned by the
drafter's probability (a reliability diagram, Niculescu-Mizil & Caruana 2005): a row that drafted
tokens with path probabilities ``p[0] >= p[1] >= ...`` and had ``a`` of them accepted contributes,
for token ``i``, one trial in the bin of ``p[i]`` that succeeded iff ``i < a``. Per bin it keeps
forgotten sums of trials, successes and predicted probability; a bin's factor ``(successes + w *
g) / (predicted + w)`` shrinks toward the global factor ``g`` while the bin has little evidence.
Calibrated probabilities are ``p * factor(bin(p))`` at each bin's mean probability, joined
piecewise linearly, made non-decreasing in ``p`` and clipped to [0, 1].

Units: lengths and draft counts in tokens; ``k``, ``a`` and probabilities are dimensionless.
"""

from __future__ import annotations

import numpy as np

__all__ = ["AcceptanceCalibration", "DEFAULT_A", "DEFAULT_K", "accepted_tokens", "estimate_acceptance", "forward_passes", "tokens_per_step"]


#: Population prior for the drafter capacity ``k`` and accept efficiency ``a`` (Eq. 3). With them a
#: request drafted 4 tokens per step advances 2.06 tokens per step, 16 per step 2.49: the range of
#: suffix drafting on a replayed rollout trace (evidence: docs/benchmarks.md).
DEFAULT_K = 0.6
DEFAULT_A = 1.0


def _check_ka(k: np.ndarray, a: np.ndarray) -> None:
    if np.any(~np.isfinite(k)) or np.any((k < 0) | (k >= 1)):
        raise ValueError(f"acceptance capacity k must be in [0, 1), got {k[(~np.isfinite(k)) | (k < 0) | (k >= 1)][:4]}")
    if np.any(~np.isfinite(a)) or np.any(a <= 0):
        raise ValueError(f"accept efficiency a must be > 0, got {a[(~np.isfinite(a)) | (a <= 0)][:4]}")


def accepted_tokens(length, k, a, proposed) -> np.ndarray:
    """Eq. 3: accepted tokens ``k * l * (1 - exp(-a * p / l))``.

    Args: arrays (broadcast) of float: ``length`` l > 0 (tokens), ``k`` in [0, 1), ``a`` > 0,
    ``proposed`` p >= 0 (draft tokens offered over the whole request). Returns float64 tokens.
    """
    length, k, a, proposed = (np.asarray(x, np.float64) for x in (length, k, a, proposed))
    _check_ka(np.atleast_1d(k), np.atleast_1d(a))
    if np.any(length <= 0) or np.any(proposed < 0):
        raise ValueError("accepted_tokens: length must be > 0 and proposed >= 0")
    return k * length * (1.0 - np.exp(-a * proposed / length))


def forward_passes(length, k, a, proposed) -> np.ndarray:
    """Eq. 4 (per request): forward passes ``l * (1 - k + k * exp(-a * p / l))`` (float64)."""
    return np.asarray(length, np.float64) - accepted_tokens(length, k, a, proposed)


def tokens_per_step(drafts, k, a, iterations: int = 8) -> np.ndarray:
    """Tokens a request advances per engine step when offered ``drafts`` draft tokens each step.

    Solves ``1 / tau = 1 - k + k * exp(-a * d / tau)`` (Eq. 4 with ``p = d * N``, module doc) by
    Newton's method on ``u = 1 / tau``, which converges monotonically after the first step.

    Args:
        drafts: float or int array, draft tokens offered per step (>= 0).
        k, a: acceptance parameters (broadcast with ``drafts``), k in [0, 1), a > 0.

    Returns:
        float64 array of ``tau`` in [1, 1 / (1 - k)], the sampled token included; the accepted
        draft tokens per step are ``tau - 1`` (never more than ``drafts``).
    """
    d, k, a = np.broadcast_arrays(*(np.asarray(x, np.float64) for x in (drafts, k, a)))
    _check_ka(np.atleast_1d(k), np.atleast_1d(a))
    if np.any(d < 0) or np.any(~np.isfinite(d)):
        raise ValueError(f"drafts per step must be finite and >= 0, got {d[(d < 0) | ~np.isfinite(d)][:4]}")
    ad = a * d
    u = np.ones_like(d)
    lo = 1.0 - k
    for _ in range(iterations):
        e = np.exp(-ad * u)
        f = u - lo - k * e
        fp = 1.0 + k * ad * e
        u = np.maximum(u - f / fp, lo + 1e-12)
    tau = 1.0 / u
    return np.minimum(tau, 1.0 + d)


def estimate_acceptance(
    drafted,
    accepted,
    steps,
    k_prior=DEFAULT_K,
    a_prior=DEFAULT_A,
    prior_steps: float = 32.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-request acceptance parameters from observed counts, shrunk towards a prior.

    The capacity ``k`` is taken from the prior (per problem or global: one point of the Eq. 3
    curve cannot separate ``k`` from ``a``); ``a`` is solved from the observed tokens per step
    ``tau = (steps + accepted) / steps`` at the observed draft rate ``d = drafted / steps``
    (:func:`tokens_per_step` inverted), after adding ``prior_steps`` pseudo-steps that drafted
    ``d`` tokens each and accepted what the prior predicts. No drafts yet: ``a = a_prior``.

    Args:
        drafted, accepted, steps: arrays (one entry per request) of draft tokens offered,
            draft tokens accepted, and engine steps so far (all >= 0, accepted <= drafted).
        k_prior, a_prior: scalars or per-request arrays (the Eq. 3 prior).
        prior_steps: weight of the prior, in engine steps (> 0).

    Returns:
        ``(k, a)``: float64 arrays; ``a`` is clipped to [1e-3, 1 / k] so that ``k * a <= 1``.
    """
    drafted, accepted, steps = (np.asarray(x, np.float64) for x in (drafted, accepted, steps))
    if prior_steps <= 0:
        raise ValueError(f"prior_steps must be > 0, got {prior_steps}")
    if np.any(drafted < 0) or np.any(accepted < 0) or np.any(steps < 0):
        raise ValueError("estimate_acceptance: drafted, accepted and steps must be >= 0")
    if np.any(accepted > drafted + 1e-9):
        raise ValueError("estimate_acceptance: accepted must be <= drafted")
    k = np.broadcast_to(np.asarray(k_prior, np.float64), drafted.shape).copy()
    a0 = np.broadcast_to(np.asarray(a_prior, np.float64), drafted.shape).copy()
    _check_ka(np.atleast_1d(k), np.atleast_1d(a0))
    a = a0.copy()
    has = (drafted > 0) & (steps > 0)
    if np.any(has):
        d = drafted[has] / steps[has]
        prior_acc = prior_steps * (tokens_per_step(d, k[has], a0[has]) - 1.0)
        tau = (steps[has] + prior_steps + accepted[has] + prior_acc) / (steps[has] + prior_steps)
        kk = k[has]
        # 1/tau = 1 - k + k exp(-a d / tau)  =>  a = -(tau / d) ln((1/tau - 1 + k) / k)
        ratio = np.clip((1.0 / tau - 1.0 + kk) / np.maximum(kk, 1e-12), 1e-12, 1.0)
        a[has] = -(tau / d) * np.log(ratio)
    return k, np.clip(a, 1e-3, 1.0 / np.maximum(k, 1e-12))


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
