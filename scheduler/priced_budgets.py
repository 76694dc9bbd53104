"""Budgets that keep the draft tokens that pay for their verification at the step's price.

* :class:`CostBudget` (``cost``, the product's default): the throughput rule of
  :func:`choose_drafts`: keep the most probable draft tokens while they raise the step's expected
  tokens per second above a plain step's.
* :class:`MakespanBudget` (``makespan``): the saving rule: a row's accepted draft token is worth
  what it saves a batch that only drains, ``c_row + c_base * q_i`` with ``q_i`` the odds that the
  request finishes last given the length predictor (:func:`last_finish_probability`,
  :func:`token_values`); keep the tokens whose expected saving beats their price.

**The selection** (:func:`choose_drafts`). A verification step over ``B`` rows carrying ``D``
draft tokens costs ``t = c_base + c_tok * (B + D)`` seconds (DAS Eq. 1; split by regime, a
:class:`scheduler.step_price.LinearPrice`: ``plain_s`` without drafts, ``spec_base_s +
per_draft_s * D`` with) and yields ``B + A`` tokens, ``A`` the accepted draft tokens. Draft token
``j`` of a row is accepted only if every earlier one is, so its acceptance probability is the
drafter's path probability ``p_j`` (non-increasing along a row, calibrated by
:class:`scheduler.acceptance.AcceptanceCalibration`). Adding a token with probability ``p``
raises the expected yield by ``p`` and the cost by ``per_draft_s``, so the best set of draft tokens
is a top-m prefix of all tokens sorted by ``p``. With a large batch and a small ``c_base``
(compute-bound verification) the bar for a draft token nears certainty and the step drafts little
or nothing; in the long tail (few rows, ``c_base`` dominant) it drafts freely. This is what makes
speculation never cost more than it saves, within the model's accuracy. ``free_drafts`` (a step
flat below a knee, as a memory-bound GPU step is) prices the first that many draft tokens at nothing.

**The makespan value** (DAS Eq. 2 split by regime). A rollout batch with no request waiting costs
``T = c_base * N_fwd + c_row * sum_i N_i + c_draft * D (+ c_spec per drafting step)`` with ``N_fwd
= max_i N_i`` (Eq. 4): every step pays ``c_base`` until the last request is done. One accepted
draft token of request ``i`` removes one of its steps: ``c_row`` seconds always, and ``c_base`` more
if ``i`` sets ``N_fwd``; so ``v_i = c_row + c_base * q_i``, ``q_i = P(request i finishes last)``. A
throughput rule shares ``c_base`` evenly (``q_i = 1 / B``): right when requests wait for a slot,
wrong for a GRPO batch that only drains. :func:`last_finish_probability` models each request's
remaining length as exponential with the predicted mean, cut at its ``max_tokens``, independent
across requests.

Under a price with a knee both budgets spend the step's free draft tokens on the rows predicted to
finish last first (:meth:`CostBudget.free_weights`: they set the makespan in a draining batch; DAS
drafts for its Long class first for the same reason); the tokens above the knee follow the rule
and the price. Both are :class:`scheduler.budget_protocol.PricedBudget`\\ s: before the drafter
runs they say whether any draft can pay (:meth:`CostBudget.can_pay`, :func:`drafting_can_pay`)
and where each row's draft may stop (:meth:`CostBudget.cutoff`: at :func:`keep_bound`, below
which the selection keeps nothing, so the drafts the engine gets are the same for fewer lookups;
:func:`raw_cutoffs` maps it to the drafter's raw probabilities). A price with a knee gets no cut
and passes the gate (both rules assume a linear price).

Units: seconds (prices, values); tokens; probabilities are dimensionless.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from scheduler.budget_protocol import Drafts, PricedBudget, StepView

__all__ = ["CostBudget", "FREE_WEIGHT_POWER", "MakespanBudget", "last_finish_probability", "token_values"]


def last_finish_probability(expected_remaining, max_remaining, grid: int = 64) -> np.ndarray:
    """``q_i``: the probability that request ``i`` is the last of the batch to finish.

    Args:
        expected_remaining: float ``[rows]``, predicted remaining output tokens (> 0).
        max_remaining: float ``[rows]``, tokens left before the request's ``max_tokens`` (>= 1);
            the remaining length is exponential with the predicted mean, cut there (the cut
            mass finishes at the cap, tied with every other capped request).
        grid: cells over ``[0, max(max_remaining)]`` (>= 2).

    Returns:
        float64 ``[rows]``, non-negative, summing to 1 (uniform where the model cannot tell rows
        apart, e.g. all equal; empty for no rows).

    Raises:
        ValueError: shapes differ, a non-positive or non-finite length, or ``grid < 2``.
    """
    mean = np.asarray(expected_remaining, np.float64)
    cap = np.asarray(max_remaining, np.float64)
    if mean.shape != cap.shape or mean.ndim != 1:
        raise ValueError(f"expected_remaining {mean.shape} and max_remaining {cap.shape} must be one 1-D shape")
    if not isinstance(grid, (int, np.integer)) or grid < 2:
        raise ValueError(f"grid must be an int >= 2 cells, got {grid!r}")
    rows = mean.size
    if rows == 0:
        return np.zeros(0)
    if not (np.all(np.isfinite(mean)) and np.all(mean > 0) and np.all(np.isfinite(cap)) and np.all(cap > 0)):
        raise ValueError(f"expected_remaining must be finite and > 0 and max_remaining finite and > 0 tokens, got {mean[:4]}, {cap[:4]}")
    if rows == 1:
        return np.ones(1)
    t = np.linspace(0.0, float(cap.max()), grid + 1)  # cell k is (t[k], t[k + 1]]
    cdf = np.where(t[None, :] < cap[:, None], -np.expm1(-t[None, :] / mean[:, None]), 1.0)  # [rows, grid + 1]
    mass = np.diff(cdf, axis=1)  # P(request ends in cell k)
    # P(every other request has ended by then): the cell's midpoint CDF of each, in logs (rows can be many).
    log_mid = np.log(np.maximum(0.5 * (cdf[:, :-1] + cdf[:, 1:]), 1e-300))
    logit = np.log(np.maximum(mass, 1e-300)) + log_mid.sum(axis=0)[None, :] - log_mid
    logit = np.where(mass > 0, logit, -np.inf)
    top = logit.max(axis=1, keepdims=True)
    per_row = top[:, 0] + np.log(np.exp(logit - top).sum(axis=1))  # log P(i last), before normalising ties
    per_row -= per_row.max()
    q = np.exp(per_row)
    return q / q.sum()


def token_values(last_probability, c_base: float, c_row: float) -> np.ndarray:
    """Seconds one accepted draft token saves per row: ``c_row + c_base * q_i`` (module doc).

    Args:
        last_probability: float ``[rows]``, :func:`last_finish_probability`.
        c_base: fixed seconds per engine step (>= 0).
        c_row: seconds per row per step (>= 0).

    Returns:
        float64 ``[rows]`` seconds per accepted token.

    Raises:
        ValueError: a negative or non-finite cost.
    """
    if not (np.isfinite(c_base) and np.isfinite(c_row) and c_base >= 0 and c_row >= 0):
        raise ValueError(f"c_base and c_row must be finite and >= 0 seconds, got {c_base!r}, {c_row!r}")
    return c_row + c_base * np.asarray(last_probability, np.float64)


def choose_drafts(path_probs: list[np.ndarray] | np.ndarray, plain_s: float, spec_base_s: float, per_draft_s: float,
                  calibration: float | np.ndarray = 1.0, prob_map: Callable[[np.ndarray], np.ndarray] | None = None,
                  values: np.ndarray | None = None, lengths: np.ndarray | None = None, free_drafts: float = 0.0,
                  free_weights: np.ndarray | None = None) -> np.ndarray:
    """Throughput-optimal draft tokens per row when plain and speculative steps are priced apart.

    A step over ``B`` rows costs ``plain_s`` seconds without drafts and
    ``spec_base_s + per_draft_s * m`` with ``m > 0`` draft tokens (see
    :class:`scheduler.step_price.TwoRegimeCost`); it yields ``B`` tokens plus the accepted drafts.
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
            in, same shape out; e.g. :class:`scheduler.acceptance.AcceptanceCalibration`),
            applied to all rows' probabilities before ``calibration``.
        values: optional float ``[rows]``, seconds one accepted draft token of the row saves
            (:func:`scheduler.priced_budgets.token_values`). Given, the step keeps the draft tokens
            that maximise the expected time saved, ``sum p_k v_k - per_draft_s * m -
            (spec_base_s - plain_s)``, and drafts only when that is positive (a row's ``p v`` is
            non-increasing along it, so the best set is again a prefix of every row). None: the
            throughput rule above, which values every row's token at ``plain_s / B``.
        lengths: int ``[rows]``, each in ``[0, K]``: the draft lengths when ``path_probs`` is a matrix.
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
            :meth:`scheduler.acceptance.AcceptanceCalibration.curve` gives); None: identity.

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


# Under a knee, a row's draft tokens rank for the free drafts by p * (its predicted remaining / the
# longest's) ** this: a row predicted at half the longest counts an eighth, so the rows on the
# critical path draft first, yet a long row's unlikely tokens do not crowd out a likely token of a
# row nearly as long (the simulator's comparison of powers: docs/benchmarks.md).
FREE_WEIGHT_POWER = 3


class CostBudget(PricedBudget):
    """``cost``: keep the draft tokens whose calibrated path probability pays for their verification."""

    name = "cost"
    summary = ("keep the draft tokens whose calibrated path probability pays for their verification under the step-cost model "
               "fitted online, with drafts free below a knee where the steps show one (scheduler.priced_budgets, scheduler.step_price)")
    runs_in = frozenset({"proposer", "simulator"})

    def values(self, step: StepView) -> np.ndarray | None:
        """Seconds one accepted draft token saves, per row; None: the throughput rule."""
        return None

    def free_weights(self, step: StepView) -> np.ndarray | None:
        """Per row, the weight of its draft tokens for the step's free draft tokens (a price with
        a knee): the row's predicted remaining length (:meth:`StepView.remaining`, at least 1 and
        at most the tokens left before ``max_tokens``) over the batch's longest, to the power
        :data:`FREE_WEIGHT_POWER` (float64 ``[rows]`` in ``[0, 1]``), 0 for rows that
        may not draft, so the free drafts go to the rows predicted to finish last first (the
        makespan's critical path; DAS's Long class first). None under a linear price (no free
        drafts: the decisions are the price's alone), without live rows, or when the host gave no
        length facts (:attr:`StepView.has_facts`: the probabilities alone order the free drafts).
        Computed once per step."""
        if not step.price.free_drafts or not step.live.any() or not step.has_facts:
            return None
        if "free_weights" not in step.memo:
            f = step.facts
            left = np.maximum(np.asarray(f.max_tokens, np.float64) - np.asarray(f.generated, np.float64), 1.0)
            w = np.zeros(step.rows)
            w[step.live_rows] = np.clip(step.remaining(), 1.0, left)
            step.memo["free_weights"] = (w / w.max()) ** FREE_WEIGHT_POWER
        return step.memo["free_weights"]

    def can_pay(self, step: StepView, caps: np.ndarray, best_prob: float) -> bool:
        """:func:`drafting_can_pay` at the step's price (always True under a knee)."""
        price = step.price
        if price.free_drafts:
            return True
        values = self.values(step)
        return drafting_can_pay(step.rows, int(caps.sum()), *price.as_tuple(), best_prob, None if values is None else float(values.max()))

    def cutoff(self, step: StepView) -> float | np.ndarray | None:
        """:func:`keep_bounds` at the step's price (each row's own under the saving rule); None under a knee."""
        price = step.price
        if price.free_drafts:
            return None
        return keep_bounds(step.rows, *price.as_tuple(), self.values(step))

    def keep(self, step: StepView, drafts: Drafts) -> np.ndarray:
        price = step.price
        return choose_drafts(drafts.probs, *price.as_tuple(), step.calibration, prob_map=step.prob_map, values=self.values(step),
                             lengths=drafts.lengths, free_drafts=price.free_drafts, free_weights=self.free_weights(step))


class MakespanBudget(CostBudget):
    """``makespan``: ``cost`` with each row's accepted token valued at what it saves a draining batch."""

    name = "makespan"
    summary = ("'cost', with each row's accepted token valued at what it saves a draining batch: c_row plus c_base times "
               "the odds that its request finishes last, from the length predictor (scheduler.priced_budgets)")
    runs_in = frozenset({"proposer", "simulator"})
    length_aware = True

    def values(self, step: StepView) -> np.ndarray | None:
        """``c_row + c_base * q_i`` per row (seconds per accepted token), with ``q_i`` the odds that
        the row's request finishes last (:func:`last_finish_probability`) from the length
        predictor's expected remaining length (at most ``max_tokens`` so far); rows that may not
        draft have ``q = 0``. None without live rows. Computed once per step."""
        if "values" in step.memo:
            return step.memo["values"]
        values = None
        if step.live.any():
            f = step.facts
            pred = f.predictor
            generated = np.asarray(f.generated, np.float64)
            left = np.maximum(f.max_tokens - generated, 1.0)
            expected = pred.predict(f.problem_idx, np.minimum(generated, pred.max_tokens)).expected_remaining
            q = np.zeros(step.rows)
            q[step.live_rows] = last_finish_probability(np.clip(expected, 1.0, left), left)
            values = token_values(q, step.price.fixed_s, step.price.per_row_s)
        step.memo["values"] = values
        return values
