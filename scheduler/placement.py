"""Placement: assign the GRPO groups of a rollout iteration to data-parallel rollout workers.

Siblings of one problem (a GRPO group) stay on one worker: they share a problem tree in the
drafter and see each other's tokens. The unit of assignment is therefore the group; its predicted
work is the sum of its members' predicted lengths (tokens), from
:class:`scheduler.predictor.LengthPredictor`.

``lpt`` (longest predicted processing time first): groups in decreasing predicted work, each to
the worker with the least assigned work so far, ties to the worker with fewer predicted-Long
requests, then the lower worker id; worker loads live in a ``sortedcontainers.SortedList`` so
each placement is O(log N). LPT's makespan is at most 4/3 - 1/(3N) of the optimum (Graham 1969)
for exact work. Baselines: ``round_robin`` (group j -> worker j mod N, the order given, as a
dispatcher that splits the batch evenly does) and ``random`` (a random permutation, then
round-robin: equal group counts per worker).
"""

from __future__ import annotations

import numpy as np
from sortedcontainers import SortedList

__all__ = ["ASSIGNMENTS", "assign_groups", "worker_loads", "compare_assignments"]

#: the ways :func:`assign_groups` assigns groups to workers.
ASSIGNMENTS = ("lpt", "round_robin", "random")


def assign_groups(work, n_workers: int, method: str = "lpt", *, n_long=None, seed: int | None = 0) -> np.ndarray:
    """Worker of each group.

    Args:
        work: float array ``[G]``, predicted work of each group (tokens, >= 0).
        n_workers: number of workers N (>= 1).
        method: one of :data:`ASSIGNMENTS`.
        n_long: optional int array ``[G]``, predicted Long requests per group (LPT tie-break).
        seed: seed of ``random``.

    Returns:
        int64 array ``[G]`` of worker ids in ``[0, N)``.

    Raises:
        ValueError: bad ``n_workers``, ``method``, or ``work`` / ``n_long`` values.
    """
    w = np.asarray(work, np.float64)
    if w.ndim != 1:
        raise ValueError(f"work must be a 1-d array (one entry per group), got shape {w.shape}")
    if np.any(~np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"work must be finite and >= 0, got {w[(~np.isfinite(w)) | (w < 0)][:4]}")
    if not isinstance(n_workers, (int, np.integer)) or n_workers < 1:
        raise ValueError(f"n_workers must be an int >= 1, got {n_workers!r}")
    if method not in ASSIGNMENTS:
        raise ValueError(f"method must be one of {ASSIGNMENTS}, got {method!r}")
    g = w.size
    if method == "round_robin":
        return np.arange(g, dtype=np.int64) % n_workers
    if method == "random":
        out = np.empty(g, np.int64)
        out[np.random.default_rng(seed).permutation(g)] = np.arange(g) % n_workers
        return out
    nl = np.zeros(g, np.int64) if n_long is None else np.asarray(n_long, np.int64)
    if nl.shape != w.shape or np.any(nl < 0):
        raise ValueError(f"n_long must be a non-negative int array of shape {w.shape}, got {nl.shape}")
    loads = SortedList((0.0, 0, j) for j in range(n_workers))  # (work, long requests, worker)
    out = np.empty(g, np.int64)
    for i in sorted(range(g), key=lambda i: (-w[i], -nl[i], i)):
        load, longs, j = loads.pop(0)
        out[i] = j
        loads.add((load + float(w[i]), longs + int(nl[i]), j))
    return out


def worker_loads(work, assignment, n_workers: int) -> np.ndarray:
    """Sum of ``work`` per worker: float64 ``[N]``."""
    a = np.asarray(assignment, np.int64)
    w = np.asarray(work, np.float64)
    if a.shape != w.shape:
        raise ValueError(f"assignment {a.shape} and work {w.shape} must have one shape")
    if np.any((a < 0) | (a >= n_workers)):
        raise ValueError(f"assignment has worker ids outside [0, {n_workers})")
    return np.bincount(a, weights=w, minlength=n_workers)


def compare_assignments(predicted_work, true_work, n_workers: int, *, n_long=None, true_long=None, seed: int = 0) -> dict[str, dict[str, float]]:
    """Assign by ``predicted_work`` with each method; score with ``true_work``.

    Returns:
        ``{method: {"max_load", "mean_load", "imbalance" (max / mean), "max_long", "min_long"}}``
        (loads in the units of ``true_work``; ``*_long`` from ``true_long`` per group, if given).
    """
    out: dict[str, dict[str, float]] = {}
    for m in ASSIGNMENTS:
        a = assign_groups(predicted_work, n_workers, m, n_long=n_long, seed=seed)
        loads = worker_loads(true_work, a, n_workers)
        row = {"max_load": float(loads.max()), "mean_load": float(loads.mean()), "imbalance": float(loads.max() / max(loads.mean(), 1e-12))}
        if true_long is not None:
            longs = worker_loads(np.asarray(true_long, np.float64), a, n_workers)
            row["max_long"], row["min_long"] = float(longs.max()), float(longs.min())
        out[m] = row
    return out
