"""Length predictor for rollouts: per-problem history, Short/Medium/Long classes, run-time update.

DAS ("Beat the long tail: Distribution-Aware Speculative Decoding for RL Training", arXiv
2511.13841; its deployed policy): a request's initial class is the majority class among its
problem's historical rollouts; at run time it is updated to
``argmax_c P(c | length so far, initial class)`` estimated from history. Here:

* History: per problem, the output lengths (tokens) of its rollouts per policy version; only the
  newest ``window`` policy versions are kept (the drafter's window).
* Class bounds ``(b1, b2)`` (tokens): Short ``L < b1``, Medium ``b1 <= L < b2``, Long
  ``L >= b2``. Default: tertiles of all lengths in the window (so each class is about a third of
  the history), or explicit bounds; with fewer than ``min_history`` lengths in the window,
  ``cold_bounds`` fractions of ``max_tokens`` (default 1/4 and 1/2).
* Initial class ``c0``: majority class of the problem's lengths in the window (ties go to the
  longer class). A problem without history uses the global row (all problems).
* Run-time update: the class of a request that has generated ``x`` tokens is
  ``argmax_c #{history rollouts with initial class c0, class c, L >= x}`` (empirical survival
  counts, ties to the longer class); the expected total length is ``E[L | L >= x]`` over the
  problem's own history shrunk towards the same over all history of its initial class,
  ``(sum_own + m * E_class) / (n_own + m)`` (``n_own`` own rollouts reached ``x``;
  ``m = min_survivors``). Everything is tabulated on a grid of ``n_bins`` lengths at
  :meth:`LengthPredictor.refresh` (automatic after new observations), so a prediction for a whole
  batch is a few numpy gathers.

Units: lengths in tokens (output tokens, prompt excluded).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "SHORT",
    "MEDIUM",
    "LONG",
    "CLASS_NAMES",
    "LengthPredictor",
    "Prediction",
    "classify",
    "confusion_matrix",
    "evaluate_predictor",
]

SHORT, MEDIUM, LONG = 0, 1, 2
CLASS_NAMES = ("short", "medium", "long")
_GLOBAL_ROW = 3  # table row of problems without history


def classify(lengths, bounds: tuple[float, float]) -> np.ndarray:
    """Class of each length: 0 Short (< b1), 1 Medium (< b2), 2 Long. int8 array."""
    b1, b2 = bounds
    x = np.asarray(lengths, np.float64)
    return ((x >= b1).astype(np.int8) + (x >= b2).astype(np.int8)).astype(np.int8)


def confusion_matrix(true_cls, pred_cls, n: int = 3) -> np.ndarray:
    """``[n, n]`` int64 counts; row = true class, column = predicted class."""
    t = np.asarray(true_cls, np.int64)
    p = np.asarray(pred_cls, np.int64)
    if t.shape != p.shape:
        raise ValueError(f"confusion_matrix: shapes differ: {t.shape} vs {p.shape}")
    return np.bincount(t * n + p, minlength=n * n).reshape(n, n)


@dataclass
class Prediction:
    """Per-request predictions (arrays of one entry per request).

    cls: int8 class (0 Short, 1 Medium, 2 Long) given the length so far.
    expected_total: float64 expected final output length, tokens (> generated, <= max_tokens).
    expected_remaining: float64 ``expected_total - generated`` tokens (>= 1 unless at max_tokens).
    median_total: float64 median final length given the length so far (the same shrinkage; the
        better point estimate for absolute error when the tail is heavy).
    """

    cls: np.ndarray
    expected_total: np.ndarray
    expected_remaining: np.ndarray
    median_total: np.ndarray


class LengthPredictor:
    """Per-problem rollout-length history with class and remaining-length predictions.

    Args:
        max_tokens: the rollout's max output length (tokens, > 0).
        window: policy versions of history kept (the newest ``window``).
        bounds: explicit class bounds ``(b1, b2)`` in tokens, ``0 < b1 < b2 <= max_tokens``;
            None derives them from the history (tertiles).
        cold_bounds: fractions of ``max_tokens`` used while the history is too small.
        min_history: lengths in the window needed before tertile bounds are used.
        n_bins: grid resolution of the survival tables (bins over ``[0, max_tokens]``).
        min_survivors: weight ``m`` (in rollouts) of the class estimate against the problem's
            own history in ``E[L | L >= x]`` (module doc).

    Raises:
        ValueError: bad arguments (named in the message).
    """

    def __init__(
        self,
        max_tokens: int,
        *,
        window: int = 16,
        bounds: tuple[float, float] | None = None,
        cold_bounds: tuple[float, float] = (0.25, 0.5),
        min_history: int = 30,
        n_bins: int = 256,
        min_survivors: int = 4,
    ):
        if not isinstance(max_tokens, (int, np.integer)) or max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        if not isinstance(window, (int, np.integer)) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        if bounds is not None:
            b1, b2 = (float(b) for b in bounds)
            if not (0 < b1 < b2 <= max_tokens):
                raise ValueError(f"bounds must satisfy 0 < b1 < b2 <= max_tokens={max_tokens}, got {bounds!r}")
        f1, f2 = (float(f) for f in cold_bounds)
        if not (0 < f1 < f2 <= 1):
            raise ValueError(f"cold_bounds must be fractions 0 < f1 < f2 <= 1, got {cold_bounds!r}")
        if not isinstance(n_bins, (int, np.integer)) or n_bins < 2:
            raise ValueError(f"n_bins must be an int >= 2, got {n_bins!r}")
        if min_survivors < 1 or min_history < 3:
            raise ValueError(f"min_survivors must be >= 1 and min_history >= 3, got {min_survivors}, {min_history}")
        self.max_tokens = int(max_tokens)
        self.window = int(window)
        self.fixed_bounds = None if bounds is None else (float(bounds[0]), float(bounds[1]))
        self.cold_bounds = (f1 * max_tokens, f2 * max_tokens)
        self.min_history = int(min_history)
        self.n_bins = int(n_bins)
        self.min_survivors = int(min_survivors)
        self.bin_width = self.max_tokens / self.n_bins
        self.grid = np.arange(self.n_bins + 1, dtype=np.float64) * self.bin_width
        self._history: dict[Any, dict[int, list[np.ndarray]]] = {}
        self._index: dict[Any, int] = {}
        self._newest = -(1 << 62)
        self._dirty = True
        self._bounds: tuple[float, float] = self.fixed_bounds or self.cold_bounds
        self._c0 = np.zeros(0, np.int8)
        self._cls_table = np.zeros((4, self.n_bins + 1), np.int8)
        self._mean_table = np.zeros((4, self.n_bins + 1))
        self._med_table = np.zeros((4, self.n_bins + 1))
        self._p_med = np.zeros((0, self.n_bins + 1))
        self._p_cnt = np.zeros((0, self.n_bins + 1))
        self._p_sum = np.zeros((0, self.n_bins + 1))
        self.prior = np.full(3, 1.0 / 3)  # global class frequencies

    # ------------------------------------------------------------------ history
    def observe(self, problem_id: Any, policy_version: int, lengths) -> None:
        """Record output lengths (tokens) of rollouts of ``problem_id`` made by ``policy_version``.

        Raises:
            ValueError: a length is negative, not finite, or above ``max_tokens``.
        """
        x = np.atleast_1d(np.asarray(lengths, np.float64))
        if x.size == 0:
            return
        if np.any(~np.isfinite(x)) or np.any(x < 0) or np.any(x > self.max_tokens):
            bad = x[(~np.isfinite(x)) | (x < 0) | (x > self.max_tokens)][:4]
            raise ValueError(f"lengths must be in [0, max_tokens={self.max_tokens}], got {bad} for problem {problem_id!r}")
        v = int(policy_version)
        self._history.setdefault(problem_id, {}).setdefault(v, []).append(x)
        if problem_id not in self._index:
            self._index[problem_id] = len(self._index)
        self._newest = max(self._newest, v)
        self._dirty = True

    def resized(self, max_tokens: int) -> LengthPredictor:
        """A predictor for rollouts of up to ``max_tokens`` tokens, with this one's settings and
        history: what a longer request calls for when the history was sized by shorter ones
        (an engine's warm-up requests, say).

        Raises:
            ValueError: ``max_tokens`` is below this predictor's ``max_tokens``.
        """
        if not isinstance(max_tokens, (int, np.integer)) or max_tokens < self.max_tokens:
            raise ValueError(f"max_tokens must be an int >= {self.max_tokens}, got {max_tokens!r}")
        out = LengthPredictor(
            int(max_tokens),
            window=self.window,
            bounds=self.fixed_bounds,
            cold_bounds=(self.cold_bounds[0] / self.max_tokens, self.cold_bounds[1] / self.max_tokens),
            min_history=self.min_history,
            n_bins=self.n_bins,
            min_survivors=self.min_survivors,
        )
        for pid, versions in self._history.items():
            for v, parts in versions.items():
                for x in parts:
                    out.observe(pid, v, x)
        return out

    def observe_trace(self, rollouts: Iterable[Any]) -> None:
        """Record rollouts of a trace (``integrations.data.trace.Rollout``-like: ``problem_id``,
        ``policy_version``, ``output_ids``)."""
        groups: dict[tuple[Any, int], list[int]] = {}
        for r in rollouts:
            groups.setdefault((r.problem_id, int(r.policy_version)), []).append(len(r.output_ids))
        for (pid, v), ls in groups.items():
            self.observe(pid, v, np.minimum(ls, self.max_tokens))

    def index(self, problem_ids: Sequence[Any]) -> np.ndarray:
        """Stable int index of each problem (-1: never observed). int64 array for :meth:`predict`."""
        return np.array([self._index.get(p, -1) for p in problem_ids], dtype=np.int64)

    @property
    def num_problems(self) -> int:
        return len(self._index)

    def history_lengths(self, problem_id: Any) -> np.ndarray:
        """Lengths of ``problem_id`` in the window (float64, possibly empty)."""
        self.refresh()
        vs = self._history.get(problem_id, {})
        parts = [x for v in sorted(vs) for x in vs[v]]
        return np.concatenate(parts) if parts else np.zeros(0)

    @property
    def bounds(self) -> tuple[float, float]:
        """Current class bounds ``(b1, b2)`` in tokens (module doc)."""
        self.refresh()
        return self._bounds

    # ------------------------------------------------------------------ tables
    def refresh(self) -> None:
        """Drop versions outside the window and rebuild the tables (called lazily)."""
        if not self._dirty:
            return
        self._dirty = False
        oldest = self._newest - self.window + 1
        per_problem: list[np.ndarray] = [np.zeros(0)] * len(self._index)
        for pid, vs in self._history.items():
            for v in [v for v in vs if v < oldest]:
                del vs[v]
            parts = [x for v in sorted(vs) for x in vs[v]]
            per_problem[self._index[pid]] = np.concatenate(parts) if parts else np.zeros(0)
        all_l = np.concatenate(per_problem) if per_problem else np.zeros(0)
        if self.fixed_bounds is not None:
            self._bounds = self.fixed_bounds
        elif all_l.size >= self.min_history:
            b1, b2 = (float(q) for q in np.quantile(all_l, [1 / 3, 2 / 3]))
            b1 = min(max(b1, 1.0), self.max_tokens - 1.0)
            b2 = min(max(b2, b1 + 1.0), float(self.max_tokens))
            self._bounds = (b1, b2)
        else:
            self._bounds = self.cold_bounds
        n_p = len(per_problem)
        c0 = np.full(n_p, _GLOBAL_ROW, np.int8)
        for i, x in enumerate(per_problem):
            if x.size:
                counts = np.bincount(classify(x, self._bounds), minlength=3)
                c0[i] = 2 - int(np.argmax(counts[::-1]))  # ties -> longer class
        self._c0 = c0
        if all_l.size:
            self.prior = np.bincount(classify(all_l, self._bounds), minlength=3) / all_l.size
        grid = self.grid
        cls_table = np.full((4, self.n_bins + 1), LONG, np.int8)
        mean_table = np.empty((4, self.n_bins + 1))
        med_table = np.empty((4, self.n_bins + 1))
        rows = [[x for i, x in enumerate(per_problem) if c0[i] == r] for r in range(3)] + [per_problem]
        for r, parts in enumerate(rows):
            x = np.concatenate(parts) if parts else np.zeros(0)
            if x.size == 0 and r < 3:
                continue  # filled from the global row below
            cls = classify(x, self._bounds)
            surv = np.stack([self._survival(x[cls == c], grid)[0] for c in range(3)])  # [3, bins+1]
            tot = surv.sum(axis=0)
            best = 2 - np.argmax(surv[::-1], axis=0)  # ties -> longer class
            cls_table[r] = np.where(tot > 0, best, LONG)
            cnt, s, med = self._survival(x, grid)
            mean_table[r] = np.where(cnt > 0, s / np.maximum(cnt, 1), 0.5 * (grid + self.max_tokens))
            med_table[r] = np.where(cnt > 0, med, 0.5 * (grid + self.max_tokens))
        for r in range(3):  # a class no problem has: use the global row
            if not rows[r]:
                cls_table[r], mean_table[r], med_table[r] = cls_table[_GLOBAL_ROW], mean_table[_GLOBAL_ROW], med_table[_GLOBAL_ROW]
        self._cls_table, self._mean_table, self._med_table = cls_table, mean_table, med_table
        self._p_cnt = np.zeros((n_p, self.n_bins + 1))
        self._p_sum = np.zeros((n_p, self.n_bins + 1))
        self._p_med = np.zeros((n_p, self.n_bins + 1))
        for i, x in enumerate(per_problem):
            if x.size:
                self._p_cnt[i], self._p_sum[i], self._p_med[i] = self._survival(x, grid)

    @staticmethod
    def _survival(x: np.ndarray, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Count, sum and median of the lengths ``>= g`` for every grid point ``g``."""
        if x.size == 0:
            return np.zeros(grid.size), np.zeros(grid.size), np.zeros(grid.size)
        xs = np.sort(x)
        start = np.searchsorted(xs, grid, side="left")
        tail = np.concatenate([np.cumsum(xs[::-1])[::-1], [0.0]])
        cnt = xs.size - start
        med = np.where(cnt > 0, xs[np.minimum(start + cnt // 2, xs.size - 1)], 0.0)
        return cnt.astype(np.float64), tail[start], med

    # ------------------------------------------------------------------ queries
    def initial_class(self, problem_idx) -> np.ndarray:
        """Initial class per request (int8): the problem's majority class; unseen problems get the
        most frequent class of all history (ties -> longer)."""
        self.refresh()
        idx = np.asarray(problem_idx, np.int64)
        row = self._rows(idx)
        glob = np.int8(2 - int(np.argmax(self.prior[::-1])))
        return np.where(row == _GLOBAL_ROW, glob, row).astype(np.int8)

    def _rows(self, idx: np.ndarray) -> np.ndarray:
        if np.any(idx >= len(self._index)) or np.any(idx < -1):
            raise ValueError(f"problem index out of range [-1, {len(self._index) - 1}]: {idx[(idx >= len(self._index)) | (idx < -1)][:4]}")
        c0 = self._c0 if self._c0.size else np.zeros(0, np.int8)
        safe = np.where(idx >= 0, idx, 0)
        return np.where(idx >= 0, c0[safe] if c0.size else _GLOBAL_ROW, _GLOBAL_ROW).astype(np.int64)

    def predict(self, problem_idx, generated) -> Prediction:
        """Class and expected lengths of running requests.

        Args:
            problem_idx: int array (from :meth:`index`; -1 = unseen problem), one per request.
            generated: int or float array, output tokens generated so far (same shape, >= 0).

        Returns:
            :class:`Prediction` (arrays of the same shape).
        """
        self.refresh()
        idx = np.asarray(problem_idx, np.int64)
        g = np.asarray(generated, np.float64)
        if idx.shape != g.shape:
            raise ValueError(f"predict: problem_idx {idx.shape} and generated {g.shape} must have one shape")
        if np.any(g < 0) or np.any(~np.isfinite(g)):
            raise ValueError(f"predict: generated must be finite and >= 0, got {g[(g < 0) | ~np.isfinite(g)][:4]}")
        g = np.minimum(g, self.max_tokens)
        row = self._rows(idx)
        j = np.minimum((g / self.bin_width).astype(np.int64), self.n_bins)
        cls = self._cls_table[row, j]
        cls = np.maximum(cls, classify(g, self._bounds))
        total = self._mean_table[row, j]
        median = self._med_table[row, j]
        if self._p_cnt.shape[0]:
            safe = np.where(idx >= 0, idx, 0)
            cnt = np.where(idx >= 0, self._p_cnt[safe, j], 0.0)
            ssum = np.where(idx >= 0, self._p_sum[safe, j], 0.0)
            m = float(self.min_survivors)
            total = (ssum + m * total) / (cnt + m)  # own survivors, shrunk towards the class row
            median = (cnt * np.where(cnt > 0, self._p_med[safe, j], 0.0) + m * median) / (cnt + m)
        lo = np.minimum(g + 1.0, self.max_tokens)
        total = np.clip(total, lo, self.max_tokens)
        median = np.clip(median, lo, self.max_tokens)
        return Prediction(cls=cls.astype(np.int8), expected_total=total, expected_remaining=total - g, median_total=median)


# ---------------------------------------------------------------------- evaluation
def _metrics(pred: np.ndarray, true: np.ndarray) -> dict[str, float]:
    err = pred - true
    out = {
        "n": int(true.size),
        "mae": float(np.mean(np.abs(err))) if true.size else math.nan,
        "rmse": float(np.sqrt(np.mean(err**2))) if true.size else math.nan,
        "mean_rel_err": float(np.mean(np.abs(err) / np.maximum(true, 1.0))) if true.size else math.nan,
        "bias": float(np.mean(err)) if true.size else math.nan,
    }
    if true.size > 2 and np.std(pred) > 0 and np.std(true) > 0:
        rp = np.argsort(np.argsort(pred)).astype(np.float64)
        rt = np.argsort(np.argsort(true)).astype(np.float64)
        out["spearman"] = float(np.corrcoef(rp, rt)[0, 1])
    else:
        out["spearman"] = math.nan
    return out


def evaluate_predictor(
    problem_ids: Sequence[Any],
    policy_versions,
    lengths,
    max_tokens: int,
    *,
    checkpoints: Sequence[float] = (0.0, 0.125, 0.25, 0.5),
    **predictor_kwargs: Any,
) -> dict[str, Any]:
    """Evaluate :class:`LengthPredictor` against baselines on recorded rollouts.

    For every policy version ``v`` after the first, the predictor (and the baselines) see only
    versions ``< v`` and predict the final length of each rollout of version ``v``, at the start
    (checkpoint 0) and after it has generated ``x`` tokens, for each checkpoint fraction ``f`` of
    ``max_tokens`` (``x = f * max_tokens``; only rollouts with ``L >= x`` count there).

    Baselines: ``global_mean`` (mean of all history lengths) and ``last_iteration`` (the mean
    length of the problem's group at its most recent version; global mean if unseen); at a
    checkpoint a baseline predicts ``max(baseline, x + 1)``.

    Args:
        problem_ids: one per rollout. policy_versions: int array, one per rollout.
        lengths: output lengths (tokens), one per rollout. max_tokens: the rollouts' cap.
        predictor_kwargs: passed to :class:`LengthPredictor`.

    Returns:
        ``{"checkpoints": {"<x tokens>": {"predictor"|"predictor_median"|"global_mean"|
        "last_iteration": metrics}},
        "confusion": {"initial": [[...]], "<x tokens>": [[...]]}, "bounds": [b1, b2],
        "class_accuracy": {...}}``; metrics = ``n, mae, rmse, mean_rel_err, bias, spearman``;
        confusion rows = true class, columns = predicted (Short, Medium, Long).
    """
    pids = list(problem_ids)
    vers = np.asarray(policy_versions, np.int64)
    lens = np.asarray(lengths, np.float64)
    if not (len(pids) == vers.size == lens.size):
        raise ValueError(f"evaluate_predictor: {len(pids)} problem ids, {vers.size} versions, {lens.size} lengths")
    if any(not (0 <= f < 1) for f in checkpoints):
        raise ValueError(f"checkpoints must be fractions in [0, 1), got {checkpoints!r}")
    order = sorted(set(vers.tolist()))
    if len(order) < 2:
        raise ValueError(f"evaluate_predictor needs rollouts of at least 2 policy versions, got {order}")
    pred = LengthPredictor(max_tokens, **predictor_kwargs)
    xs = [float(f * max_tokens) for f in checkpoints]
    methods = ("predictor", "predictor_median", "global_mean", "last_iteration")
    acc: dict[float, dict[str, list]] = {x: {**{m: [] for m in methods}, "true": [], "cls": [], "true_cls": []} for x in xs}
    init_true, init_pred = [], []
    last_mean: dict[Any, float] = {}
    pid_arr = np.array(pids, dtype=object)

    def feed(v: int) -> None:
        sel = vers == v
        groups: dict[Any, list[float]] = {}
        for p, length in zip(pid_arr[sel], lens[sel]):
            groups.setdefault(p, []).append(length)
        for p, ls in groups.items():
            pred.observe(p, v, ls)
            last_mean[p] = float(np.mean(ls))

    feed(order[0])
    for v in order[1:]:
        pred.refresh()
        sel = np.flatnonzero(vers == v)
        gmean = float(pred._mean_table[_GLOBAL_ROW, 0])  # E[L | L >= 0] over the window
        idx = pred.index(pid_arr[sel])
        true = lens[sel]
        true_cls = classify(true, pred.bounds)
        init_true.append(true_cls)
        init_pred.append(pred.initial_class(idx))
        last = np.array([last_mean.get(p, gmean) for p in pid_arr[sel]])
        for x in xs:
            alive = true >= x
            if not np.any(alive):
                continue
            g = np.full(int(alive.sum()), x)
            pr = pred.predict(idx[alive], g)
            a = acc[x]
            a["predictor"].append(pr.expected_total)
            a["predictor_median"].append(pr.median_total)
            a["global_mean"].append(np.maximum(gmean, g + 1))
            a["last_iteration"].append(np.maximum(last[alive], g + 1))
            a["true"].append(true[alive])
            a["cls"].append(pr.cls)
            a["true_cls"].append(true_cls[alive])
        feed(v)
    out: dict[str, Any] = {"checkpoints": {}, "confusion": {}, "class_accuracy": {}, "bounds": list(pred.bounds)}
    it, ip = np.concatenate(init_true), np.concatenate(init_pred)
    cm = confusion_matrix(it, ip)
    out["confusion"]["initial"] = cm.tolist()
    out["class_accuracy"]["initial"] = float(np.trace(cm) / max(cm.sum(), 1))
    for x in xs:
        a = acc[x]
        if not a["true"]:
            continue
        true = np.concatenate(a["true"])
        key = str(int(x))
        out["checkpoints"][key] = {m: _metrics(np.concatenate(a[m]), true) for m in methods}
        cmx = confusion_matrix(np.concatenate(a["true_cls"]), np.concatenate(a["cls"]))
        out["confusion"][key] = cmx.tolist()
        out["class_accuracy"][key] = float(np.trace(cmx) / max(cmx.sum(), 1))
    return out
