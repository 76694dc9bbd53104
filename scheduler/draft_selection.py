"""Per-step draft selection: which draft tokens pay for their verification under a step price.

A verification step over ``B`` rows carrying ``D`` draft tokens costs
``t = c_base + c_tok * (B + D)`` seconds (DAS Eq. 1) and yields ``B + A`` tokens, where ``A`` is the
number of accepted draft tokens. Draft token ``j`` of a row is accepted only if every earlier draft
token of that row is, so its acceptance probability is the drafter's path probability ``p_j``
(non-increasing along a row). Adding a token with probability ``p`` raises the expected yield by
``p`` and the cost by ``c_tok``, so the best set of draft tokens is a top-m prefix of all tokens
sorted by ``p``: we pick the ``m`` that maximises ``(B + sum p) / (c_base + c_tok * (B + m))``.

When the batch is large and ``c_base`` small (compute-bound verification, as on a CPU or a GPU at
RL batch sizes), the bar for a draft token approaches certainty and the step drafts little or
nothing; in the long tail (few rows, ``c_base`` dominant) it drafts freely. This is the step-level
half of the DAS budget (Eq. 7 spreads drafts over requests by length; this decides how much a
given step can afford) and it is what makes speculation never cost more than it saves, within the
model's accuracy.

The price is :class:`scheduler.step_price.LinearPrice` (its three numbers are the ``plain_s``,
``spec_base_s`` and ``per_draft_s`` arguments below). ``free_drafts`` prices the first that many
draft tokens of a step at nothing (a step whose cost is flat below a knee, as a memory-bound GPU
step is); 0 (the linear price) leaves every function exactly as without it. The cut helpers
(:func:`keep_bound`) are conservative there: they cut nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def select_drafts(path_probs: list[np.ndarray], c_base: float, c_tok: float, calibration: float = 1.0) -> np.ndarray:
    """How many draft tokens each row keeps this step, under one line ``t = c_base + c_tok * n``.

    Args:
        path_probs: one float array per row, the path probabilities of that row's draft tokens
            (non-increasing; empty for a row with no draft).
        c_base: fixed seconds per verification step (> 0).
        c_tok: seconds per token in the step (>= 0).
        calibration: multiplies every probability (observed accepted / predicted, online).

    Returns:
        int64 array ``[rows]``: the number of leading draft tokens to keep per row.

    Raises:
        ValueError: ``c_base <= 0``, ``c_tok < 0`` or ``calibration < 0``.
    """
    if not c_base > 0:
        raise ValueError(f"c_base must be > 0 seconds, got {c_base!r}")
    if not c_tok >= 0:
        raise ValueError(f"c_tok must be >= 0 seconds per token, got {c_tok!r}")
    rows = len(path_probs)
    plain = c_base + c_tok * rows
    return choose_drafts(path_probs, plain, plain, c_tok, calibration)


def choose_drafts(path_probs: list[np.ndarray] | np.ndarray, plain_s: float, spec_base_s: float, per_draft_s: float,
                  calibration: float | np.ndarray = 1.0, prob_map: Callable[[np.ndarray], np.ndarray] | None = None,
                  values: np.ndarray | None = None, lengths: np.ndarray | None = None, peak: dict | None = None,
                  free_drafts: float = 0.0, free_weights: np.ndarray | None = None) -> np.ndarray:
    """Throughput-optimal draft tokens per row when plain and speculative steps are priced apart.

    A step over ``B`` rows costs ``plain_s`` seconds without drafts and
    ``spec_base_s + per_draft_s * m`` with ``m > 0`` draft tokens (see
    :class:`scheduler.regime_cost.TwoRegimeCost`); it yields ``B`` tokens plus the accepted drafts.
    The best ``m`` tokens are the ``m`` most probable (a row's path probabilities are
    non-increasing, so that is a prefix of every row); the step drafts only when the best rate
    ``(B + sum p) / (spec_base_s + per_draft_s * m)`` beats ``B / plain_s``.

    Args:
        path_probs: per row, float path probabilities of its draft tokens (non-increasing); or,
            with ``lengths``, a float ``[rows, K]`` matrix whose row ``r`` holds them in its first
            ``lengths[r]`` columns (a batched drafter's output, no per-row arrays to build).
        plain_s: seconds of the step without drafts (> 0).
        spec_base_s: seconds of the step with drafts, before the drafts' own cost (> 0).
        per_draft_s: seconds per draft token (>= 0).
        calibration: scalar or ``[rows]`` factors on the probabilities (clipped to [0, 1] after).
        prob_map: optional non-decreasing map of raw to calibrated probabilities (float64 array
            in, same shape out; e.g. :class:`scheduler.calibration.AcceptanceCalibration`),
            applied to all rows' probabilities before ``calibration``.
        values: optional float ``[rows]``, seconds one accepted draft token of the row saves
            (:func:`scheduler.makespan.token_values`). Given, the step keeps the draft tokens
            that maximise the expected time saved, ``sum p_k v_k - per_draft_s * m -
            (spec_base_s - plain_s)``, and drafts only when that is positive (a row's ``p v`` is
            non-increasing along it, so the best set is again a prefix of every row). None: the
            throughput rule above, which values every row's token at ``plain_s / B``.
        lengths: int ``[rows]``, each in ``[0, K]``: the draft lengths when ``path_probs`` is a matrix.
        peak: optional dict, filled by the throughput rule (no ``values``) with the peak of its
            rate over the draft tokens, whether or not it beats the plain rate: ``tokens`` (how
            many of the most probable it takes), ``rate`` (tokens per second there), ``floor``
            (the calibrated probability of the last of them) and ``drafted`` (all draft tokens
            given); ``tokens`` 0 when none were given. It tells
            whether drafts cut short kept what longer ones would (:func:`cut_kept_the_same`).
        free_drafts: draft tokens per step priced at nothing (>= 0; the knee of a flat step
            price): ``m`` draft tokens cost ``spec_base_s + per_draft_s * max(m - free_drafts, 0)``.
        free_weights: optional float ``[rows]`` (>= 0), used only with ``free_drafts > 0``: the
            free draft tokens go to the tokens with the largest ``p * free_weights[row]`` (a
            makespan rule spends them on the rows predicted to finish last first, as DAS's
            length classes do); the tokens after them follow the rule's own order (``p``, or
            ``p v`` with ``values``) and the price. None, or ``free_drafts`` 0: the rule's own
            order throughout (the linear price's decisions are unchanged by it).

    Returns:
        int64 ``[rows]``: leading draft tokens to keep per row.

    Raises:
        ValueError: a non-positive time, negative ``per_draft_s`` or negative calibration; a
            matrix that is not 2-D or ``lengths`` of the wrong shape or out of ``[0, K]``.
    """
    if not (plain_s > 0 and spec_base_s > 0):
        raise ValueError(f"plain_s and spec_base_s must be > 0 seconds, got {plain_s!r}, {spec_base_s!r}")
    if not per_draft_s >= 0:
        raise ValueError(f"per_draft_s must be >= 0 seconds per token, got {per_draft_s!r}")
    if not free_drafts >= 0:
        raise ValueError(f"free_drafts must be >= 0 draft tokens, got {free_drafts!r}")
    cal = np.asarray(calibration, np.float64)
    if np.any(cal < 0) or np.any(~np.isfinite(cal)):
        raise ValueError(f"calibration must be finite and >= 0, got {calibration!r}")
    if lengths is None:
        rows = len(path_probs)
        lengths = np.fromiter((len(p) for p in path_probs), np.int64, rows)
        matrix = None
    else:
        matrix, lengths = np.asarray(path_probs), np.asarray(lengths, np.int64)
        if matrix.ndim != 2 or lengths.shape != matrix.shape[:1] or np.any(lengths < 0) or np.any(lengths > matrix.shape[1]):
            raise ValueError(f"path_probs must be a [rows, K] matrix and lengths [rows] ints in [0, K], got shapes "
                             f"{matrix.shape} and {lengths.shape}")
        rows = matrix.shape[0]
    keep = np.zeros(rows, np.int64)
    if peak is not None:
        peak.update(tokens=0, rate=0.0, floor=0.0, drafted=int(lengths.sum()))
    if lengths.sum() == 0:
        return keep
    owner = np.repeat(np.arange(rows), lengths)
    if matrix is None:
        probs = np.concatenate([np.asarray(p, np.float64) for p in path_probs])
    else:  # row-major, so in the order of the list form
        probs = matrix[np.arange(matrix.shape[1]) < lengths[:, None]].astype(np.float64)
    if prob_map is not None:
        probs = np.asarray(prob_map(probs), np.float64)
    probs = np.clip(probs * (cal[owner] if cal.ndim else cal), 0.0, 1.0)
    if values is not None:
        v = np.asarray(values, np.float64)
        if v.shape != (rows,) or np.any(~np.isfinite(v)) or np.any(v < 0):
            raise ValueError(f"values must be {rows} finite seconds >= 0 (one per row), got shape {v.shape}")
        saving = probs * v[owner]
        order = _free_first(np.argsort(-saving, kind="stable"), probs, owner, free_drafts, free_weights, rows)
        priced = per_draft_s * (np.arange(len(order)) >= free_drafts) if free_drafts else per_draft_s
        net = np.cumsum(saving[order] - priced) - max(spec_base_s - plain_s, 0.0)
        best = int(np.argmax(net))
        if net[best] <= 0:
            return keep
        return np.bincount(owner[order[: best + 1]], minlength=rows).astype(np.int64)
    order = _free_first(np.argsort(-probs, kind="stable"), probs, owner, free_drafts, free_weights, rows)
    gain = rows + np.cumsum(probs[order])  # expected tokens with the top m+1 drafts
    m = np.arange(1, len(order) + 1)
    rate = gain / (spec_base_s + per_draft_s * (np.maximum(m - free_drafts, 0.0) if free_drafts else m))
    best = int(np.argmax(rate))
    if peak is not None:
        peak.update(tokens=best + 1, rate=float(rate[best]), floor=float(probs[order[best]]))
    if rate[best] <= rows / plain_s:  # no draft at all beats every choice
        return keep
    return np.bincount(owner[order[: best + 1]], minlength=rows).astype(np.int64)


def _free_first(order: np.ndarray, probs: np.ndarray, owner: np.ndarray, free_drafts: float, free_weights: np.ndarray | None,
                rows: int) -> np.ndarray:
    """``order`` with the step's free draft tokens first: the ``ceil(free_drafts)`` tokens of
    largest ``p * free_weights[row]``, then the others in ``order`` (unchanged without a knee or weights)."""
    if not free_drafts or free_weights is None:
        return order
    w = np.asarray(free_weights, np.float64)
    if w.shape != (rows,) or np.any(~np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"free_weights must be {rows} finite weights >= 0 (one per row), got shape {w.shape}")
    n_free = min(int(np.ceil(free_drafts)), len(order))
    first = np.argsort(-(probs * w[owner]), kind="stable")[:n_free]
    rest = np.ones(len(order), bool)
    rest[first] = False
    return np.concatenate([first, order[rest[order]]])


def keep_bound(rows: int, plain_s: float, spec_base_s: float, per_draft_s: float, values: np.ndarray | None = None) -> float:
    """The calibrated probability at or below which :func:`choose_drafts` keeps no draft token.

    The throughput rule keeps the top ``m`` calibrated probabilities that maximise
    ``(B + sum p) / (spec_base_s + per_draft_s m)``; over sorted probabilities that rate is
    unimodal (adding ``p`` raises it iff ``p / per_draft_s`` exceeds it, and the new rate lies
    between the two), so the last token kept has ``p / per_draft_s >=`` the rate it ends at,
    which must beat the plain rate ``B / plain_s``. When a speculative step costs less than a
    plain one, a single kept token needs only ``p > B (per_draft_s - (plain_s - spec_base_s)) /
    plain_s``. Hence ``B max(0, per_draft_s - max(0, plain_s - spec_base_s)) / plain_s``. With
    ``values`` (the saving rule) a kept token has ``p v_row > per_draft_s``: ``per_draft_s /
    max(values)`` (``inf`` when no row has a value).

    Args:
        rows: ``B``, rows in the step (>= 0).
        plain_s, spec_base_s, per_draft_s: the step's prices, as for :func:`choose_drafts`.
        values: optional float ``[rows]`` seconds saved per accepted token (the saving rule).

    Raises:
        ValueError: ``rows < 0``, a non-positive time or a negative ``per_draft_s``.
    """
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows!r}")
    if not (plain_s > 0 and spec_base_s > 0):
        raise ValueError(f"plain_s and spec_base_s must be > 0 seconds, got {plain_s!r}, {spec_base_s!r}")
    if not per_draft_s >= 0:
        raise ValueError(f"per_draft_s must be >= 0 seconds per token, got {per_draft_s!r}")
    if values is not None:
        best = float(np.max(values)) if np.size(values) else 0.0
        return per_draft_s / best if best > 0 else float("inf")
    return rows * max(0.0, per_draft_s - max(0.0, plain_s - spec_base_s)) / plain_s


def keep_bounds(rows: int, plain_s: float, spec_base_s: float, per_draft_s: float, values: np.ndarray | None = None) -> float | np.ndarray:
    """:func:`keep_bound`, per row where the rule has one: the saving rule keeps a token of row
    ``r`` only if ``p v_r > per_draft_s``, so ``per_draft_s / v_r`` (float ``[rows]``, ``inf``
    where ``v_r`` is 0); the throughput rule's bound is one for all rows (a float).

    Raises:
        ValueError: as :func:`keep_bound`.
    """
    bound = keep_bound(rows, plain_s, spec_base_s, per_draft_s, values)
    if values is None:
        return bound
    v = np.asarray(values, np.float64)
    with np.errstate(divide="ignore"):
        return np.where(v > 0, per_draft_s / np.where(v > 0, v, 1.0), np.inf)


def raw_cutoffs(theta: float | np.ndarray, calibration: float | np.ndarray = 1.0,
                curve: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Per row, the raw path probability below which the row's calibrated probabilities are at
    most ``theta`` (the row's own, when ``theta`` is an array).

    The selection's calibrated probability of row ``r`` is ``min(1, prob_map(raw) *
    calibration[r])`` with ``prob_map`` non-decreasing, so raw probabilities up to the largest
    ``x`` with ``prob_map(x) * calibration[r] <= theta[r]`` lie at or below ``theta[r]``.

    Args:
        theta: calibrated probability, scalar or float ``[rows]`` (>= 0; ``inf`` allowed).
        calibration: scalar or float ``[rows]`` factors, as for :func:`choose_drafts`.
        curve: ``(xs, ys)`` float arrays, the points of ``prob_map`` (piecewise linear, ``xs``
            increasing from 0 to 1, ``ys`` non-decreasing, as
            :meth:`scheduler.calibration.AcceptanceCalibration.curve` gives); None: identity.

    Returns:
        float64 array (the broadcast shape of ``theta`` and ``calibration``) in ``[0, 1]``, each a
        hair (1e-6 relative) below that ``x``, so that float32 rounding of a drafter's float64
        probabilities cannot cross it; 1.0 where no calibrated probability can exceed ``theta``.

    Raises:
        ValueError: a negative or non-finite calibration, a negative ``theta``.
    """
    cal = np.asarray(calibration, np.float64)
    th = np.asarray(theta, np.float64)
    if np.any(cal < 0) or not np.all(np.isfinite(cal)):
        raise ValueError(f"calibration must be finite and >= 0, got {calibration!r}")
    if np.any(~(th >= 0)):
        raise ValueError(f"theta must be >= 0, got {theta!r}")
    th, cal = np.broadcast_arrays(th, cal)
    with np.errstate(divide="ignore", invalid="ignore"):
        target = np.where(cal > 0, th / np.where(cal > 0, cal, 1.0), np.inf)  # prob_map(x) at or below it
    if curve is None:
        x = target
    else:
        xs, ys = (np.asarray(a, np.float64) for a in curve)
        j = np.searchsorted(ys, target, side="right")  # the first knot above the target (ys non-decreasing)
        inside = (j > 0) & (j < ys.shape[0])
        jj = np.clip(j, 1, ys.shape[0] - 1)
        rise = ys[jj] - ys[jj - 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            x = xs[jj - 1] + (target - ys[jj - 1]) * (xs[jj] - xs[jj - 1]) / np.where(rise > 0, rise, 1.0)
        x = np.where(inside, x, np.where(j == 0, 0.0, np.inf))
    out = np.clip(x * (1.0 - 1e-6), 0.0, 1.0)
    out = np.where((th >= 1.0) | ~np.isfinite(x), 1.0, out)  # nothing calibrated can exceed theta
    return np.where(th == 0, 0.0, out)


def raw_cutoff(theta: float, calibration: float | np.ndarray = 1.0, curve: tuple[np.ndarray, np.ndarray] | None = None) -> float:
    """The raw path probability below which every row's calibrated probability is at most
    ``theta``: :func:`raw_cutoffs` at the largest calibration factor.

    Returns:
        float in ``[0, 1]``; 1.0 when no calibrated probability can exceed ``theta``.

    Raises:
        ValueError: as :func:`raw_cutoffs`.
    """
    cal = np.asarray(calibration, np.float64)
    if np.any(cal < 0) or not np.all(np.isfinite(cal)):
        raise ValueError(f"calibration must be finite and >= 0, got {calibration!r}")
    return float(raw_cutoffs(theta, float(cal.max()) if cal.size else 0.0, curve))


def never_kept_below(rows: int, plain_s: float, spec_base_s: float, per_draft_s: float, calibration: float | np.ndarray = 1.0,
                     curve: tuple[np.ndarray, np.ndarray] | None = None, values: np.ndarray | None = None) -> float:
    """The raw path probability under which :func:`choose_drafts` keeps no draft token this step:
    :func:`raw_cutoff` of :func:`keep_bound`.

    A drafter told to stop there (``DASDrafter.speculate_batch(..., min_prob=...)``) drafts
    fewer tokens and the step keeps exactly the same ones: the tokens it no longer drafts are
    the ones the selection would have thrown away.

    Returns:
        float in ``[0, 1]``; 1.0 when no token can be kept at all.

    Raises:
        ValueError: as :func:`keep_bound` and :func:`raw_cutoff`.
    """
    return raw_cutoff(keep_bound(rows, plain_s, spec_base_s, per_draft_s, values), calibration, curve)


def cut_kept_the_same(theta: float, bound: float, per_draft_s: float, peak: dict) -> bool:
    """Whether drafts stopped at :func:`raw_cutoff` ``(theta)`` kept, under the throughput rule,
    exactly what drafts down to the safe :func:`keep_bound` ``bound`` would have.

    Every draft token left out has a calibrated probability of at most ``theta``. The cut
    drafts' rate peaks at ``peak["tokens"]`` tokens, the last of them at probability
    ``peak["floor"]``, and the token after them would lower it. If ``theta`` lies below both
    ``peak["floor"]`` and ``per_draft_s * peak["rate"]``, every token left out ranks below
    those tokens and would lower the rate too, and the rate over the sorted tokens is unimodal
    (:func:`keep_bound`): the full drafts peak at the same tokens, so the selection keeps the
    same. (The peak alone is not enough: with per-row calibration a token left out may rank
    above drafted ones.) With no draft token given, nothing is known beyond ``bound``.

    Args:
        theta: the calibrated probability the drafts were cut at.
        bound: :func:`keep_bound` of the step.
        per_draft_s: seconds per draft token.
        peak: :func:`choose_drafts`' ``peak`` of the cut drafts.
    """
    if theta <= bound:
        return True
    return peak["drafted"] > 0 and theta < min(peak["floor"], per_draft_s * peak["rate"])


def drafting_can_pay(rows: int, max_drafts: int, plain_s: float, spec_base_s: float, per_draft_s: float, best_prob: float,
                     best_value: float | None = None) -> bool:
    """Whether any draft could pay this step, if every draft token had probability ``best_prob``.

    The rate ``(B + p m) / (spec_base_s + per_draft_s m)`` is monotone in ``m``, so checking
    ``m = 1`` and ``m = max_drafts`` decides it; a False lets the proposer skip the drafter's
    lookups for the step altogether. With ``best_value`` (the largest row value of
    :func:`choose_drafts`' ``values``, seconds per accepted token) the test is the saving rule's:
    ``max_drafts * (p v - per_draft_s) > spec_base_s - plain_s``.
    """
    if max_drafts < 1 or best_prob <= 0:
        return False
    if best_value is not None:
        return max_drafts * (best_prob * best_value - per_draft_s) > max(spec_base_s - plain_s, 0.0)
    plain_rate = rows / plain_s
    return any((rows + best_prob * m) / (spec_base_s + per_draft_s * m) > plain_rate for m in (1, max_drafts))
