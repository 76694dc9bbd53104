"""Acceptance model of DAS (arXiv 2511.13841, Eq. 3-4) and per-request acceptance estimates.

Eq. 3: a request with target length ``l`` (tokens), drafter capacity ``k`` in (0, 1) and accept
efficiency ``a > 0`` that is offered ``p`` draft tokens in total accepts
``A = k * l * (1 - exp(-a * p / l))`` of them; Eq. 4: it then needs ``N = l - A =
l * (1 - k + k * exp(-a * p / l))`` forward passes (verification steps).

Per engine step (:func:`tokens_per_step`): a request that is offered ``d`` draft tokens in every
one of its steps has ``p = d * N``; putting that into Eq. 4 gives the tokens it advances per step,
``tau = l / N``, as the root of ``1 / tau = 1 - k + k * exp(-a * d / tau)``. ``tau(0) = 1``,
``tau`` grows with ``d`` and saturates at ``1 / (1 - k)``; ``tau(d) - 1 <= k * a * d`` (the first
draft token is accepted with probability ``k * a``). This memoryless form is exactly Eq. 3 for a
request drafted at a constant rate, which is how :mod:`scheduler.eq7` spends a budget.

Units: lengths and draft counts in tokens; ``k`` and ``a`` are dimensionless.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "accepted_tokens",
    "forward_passes",
    "tokens_per_step",
    "estimate_acceptance",
    "DEFAULT_K",
    "DEFAULT_A",
]

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
