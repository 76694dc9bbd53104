"""Placement: which rollout engine (data-parallel worker) serves which rollout of an iteration.

The one placement code of the project: the Ray driver, ``das-rollout --engines N``, verl's agent
loop, the simulator (:mod:`benchmarks.sim_placement`) and the many-engine replay
(:mod:`benchmarks.replay_engines`) all place through these functions.

Group placement (the DAS paper's rule, arXiv 2511.13841: long requests spread over the GPUs by
predicted length). The unit is the GRPO group: siblings of one problem stay on one engine, where
they share a problem tree in the drafter and see each other's tokens live. A group's predicted
work is the sum of its members' predicted lengths (tokens), :func:`predicted_group_work` from
:class:`scheduler.predictor.LengthPredictor`.

* :func:`assign_groups` ``lpt`` (longest predicted processing time first): groups in decreasing
  predicted work, each to the engine with the least work so far (optionally starting from the
  engines' current loads), ties to the engine with fewer predicted-Long requests, then the lower
  engine id; loads live in a ``sortedcontainers.SortedList`` so each placement is O(log N). LPT's
  makespan is at most 4/3 - 1/(3N) of the optimum (Graham 1969) for exact work. Baselines:
  ``round_robin`` (group j -> engine j mod N, in the order given, as a dispatcher that splits the
  batch evenly does) and ``random`` (a random permutation, then round-robin: equal group counts).
* :class:`StickyPlacement`: a problem keeps the engine of its first visit (affinity routing, so
  its history stays where it was made); problems seen for the first time are placed by ``lpt``
  against the loads of the problems already there.

Rollout placement (:func:`route_rollouts`), where groups are split, as baselines and as the
trainers that do it: ``contiguous`` (the request list cut into N equal chunks, as a trainer that
splits its batch evenly over the workers does), ``interleaved`` (sample ``j`` of group ``p`` to
engine ``(p * S + j) mod N``: every engine an equal share of every problem) and ``least_loaded``
(verl 0.9's ``GlobalRequestLoadBalancer``: each request to an engine with the fewest requests in
flight, ties broken at random; an iteration's requests are all dispatched before any finishes).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
from sortedcontainers import SortedList

__all__ = ["ASSIGNMENTS", "ROLLOUT_ROUTES", "StickyPlacement", "assign_groups", "predicted_group_work", "route_rollouts"]

#: the ways :func:`assign_groups` assigns groups to engines.
ASSIGNMENTS = ("lpt", "round_robin", "random")
#: the ways :func:`route_rollouts` assigns single rollouts to engines.
ROLLOUT_ROUTES = ("contiguous", "interleaved", "least_loaded")


def _check_workers(n_workers) -> None:
    if isinstance(n_workers, bool) or not isinstance(n_workers, (int, np.integer)) or n_workers < 1:
        raise ValueError(f"n_workers must be an int >= 1, got {n_workers!r}")


def assign_groups(work, n_workers: int, method: str = "lpt", *, n_long=None, seed: int | None = 0, loads=None) -> np.ndarray:
    """Engine of each group.

    Args:
        work: float array ``[G]``, predicted work of each group (tokens, >= 0).
        n_workers: number of engines N (>= 1).
        method: one of :data:`ASSIGNMENTS`.
        n_long: optional int array ``[G]``, predicted Long requests per group (LPT tie-break).
        seed: seed of ``random``.
        loads: optional float array ``[N]``, work the engines already hold (tokens, >= 0): ``lpt``
            places the groups on top of it (engines that are busy get less). ``round_robin`` and
            ``random`` balance group counts and ignore it.

    Returns:
        int64 array ``[G]`` of engine ids in ``[0, N)``.

    Raises:
        ValueError: bad ``n_workers``, ``method``, or ``work`` / ``n_long`` / ``loads`` values.
    """
    w = np.asarray(work, np.float64)
    if w.ndim != 1:
        raise ValueError(f"work must be a 1-d array (one entry per group), got shape {w.shape}")
    if np.any(~np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"work must be finite and >= 0, got {w[(~np.isfinite(w)) | (w < 0)][:4]}")
    _check_workers(n_workers)
    if method not in ASSIGNMENTS:
        raise ValueError(f"method must be one of {ASSIGNMENTS}, got {method!r}")
    start = np.zeros(n_workers) if loads is None else np.asarray(loads, np.float64)
    if start.shape != (n_workers,) or np.any(~np.isfinite(start)) or np.any(start < 0):
        raise ValueError(f"loads must be {n_workers} finite values >= 0 (one per engine), got {start if start.size <= 8 else start.shape}")
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
    heap = SortedList((float(start[j]), 0, j) for j in range(n_workers))  # (work, long requests, engine)
    out = np.empty(g, np.int64)
    for i in sorted(range(g), key=lambda i: (-w[i], -nl[i], i)):
        load, longs, j = heap.pop(0)
        out[i] = j
        heap.add((load + float(w[i]), longs + int(nl[i]), j))
    return out


def predicted_group_work(predictor, problem_ids: Sequence[Hashable], group_size) -> tuple[np.ndarray, np.ndarray]:
    """Predicted work and predicted Long requests of each group, for :func:`assign_groups`.

    Args:
        predictor: a :class:`scheduler.predictor.LengthPredictor` fed with the problems' history.
        problem_ids: the problem of each group (``G`` ids).
        group_size: samples per group S (an int >= 1, or an int array ``[G]`` of them).

    Returns:
        ``(work, n_long)``: float64 ``[G]``, S x the expected total length (tokens) of a fresh
        request of the problem (the global row for a problem without history); int64 ``[G]``,
        S x the fraction of the problem's history at or above the Long bound, rounded (0 without
        history).

    Raises:
        ValueError: a group size < 1, or of another length than ``problem_ids``.
    """
    pids = list(problem_ids)
    sizes = np.broadcast_to(np.asarray(group_size), (len(pids),)) if np.ndim(group_size) == 0 else np.asarray(group_size)
    if sizes.shape != (len(pids),) or (sizes.size and (not np.issubdtype(sizes.dtype, np.integer) or sizes.min() < 1)):
        raise ValueError(f"group_size must be an int >= 1 or one per group ({len(pids)}), got {group_size!r}")
    idx = predictor.index(pids)
    work = predictor.predict(idx, np.zeros(len(pids))).expected_total * sizes
    b2 = predictor.bounds[1]
    n_long = np.array([int(round(s * np.mean(h >= b2))) if (h := predictor.history_lengths(p)).size else 0 for p, s in zip(pids, sizes.tolist())],
                      np.int64)
    return np.asarray(work, np.float64), n_long


class StickyPlacement:
    """Affinity placement: a problem stays on the engine of its first visit.

    Args:
        n_workers: number of engines N (>= 1).

    Raises:
        ValueError: bad ``n_workers``.
    """

    def __init__(self, n_workers: int):
        _check_workers(n_workers)
        self.n_workers = int(n_workers)
        self.engine_of: dict[Hashable, int] = {}

    def place(self, problem_ids: Sequence[Hashable], work, n_long=None) -> np.ndarray:
        """Engine of each group (int64 ``[G]``): known problems where they were; the groups of
        new problems by ``lpt`` (:func:`assign_groups`) on top of the work of the known ones
        (groups of one new problem follow its first group).

        Raises:
            ValueError: ``work`` / ``n_long`` of another length than ``problem_ids``, or bad values.
        """
        pids = list(problem_ids)
        w = np.asarray(work, np.float64)
        if w.shape != (len(pids),):
            raise ValueError(f"work must have one entry per group ({len(pids)}), got shape {w.shape}")
        nl = np.zeros(len(pids), np.int64) if n_long is None else np.asarray(n_long, np.int64)
        loads = np.zeros(self.n_workers)
        new = [i for i, p in enumerate(pids) if p not in self.engine_of]
        for i, p in enumerate(pids):
            if p in self.engine_of:
                loads[self.engine_of[p]] += w[i]
        first: dict[Hashable, int] = {}
        for i in new:
            first.setdefault(pids[i], i)
        heads = list(first.values())
        if heads:
            placed = assign_groups(w[heads], self.n_workers, "lpt", n_long=nl[heads], loads=loads)
            for i, e in zip(heads, placed.tolist()):
                self.engine_of[pids[i]] = e
        return np.array([self.engine_of[p] for p in pids], np.int64)


def route_rollouts(group_sizes, n_workers: int, method: str = "least_loaded", *, seed=0) -> np.ndarray:
    """Engine of each rollout when groups are split.

    Args:
        group_sizes: int array ``[G]`` (>= 0 each), rollouts per group, in dispatch order; rollout
            ``r`` of the result is the ``r``-th of the groups' rollouts laid end to end (siblings
            adjacent, as a trainer repeats each prompt ``S`` times).
        n_workers: engines N (>= 1).
        method: one of :data:`ROLLOUT_ROUTES` (module doc).
        seed: seed of ``least_loaded``'s random tie-breaks (anything ``numpy.random.default_rng`` takes).

    Returns:
        int64 array ``[sum(group_sizes)]`` of engine ids in ``[0, N)``.

    Raises:
        ValueError: bad ``group_sizes``, ``n_workers`` or ``method``.
    """
    sizes = np.asarray(group_sizes)
    if sizes.ndim != 1 or (sizes.size and (not np.issubdtype(sizes.dtype, np.integer) or sizes.min() < 0)):
        raise ValueError(f"group_sizes must be a 1-d array of ints >= 0, got {group_sizes!r}")
    _check_workers(n_workers)
    n = int(sizes.sum())
    if method == "contiguous":
        return (np.arange(n, dtype=np.int64) * n_workers) // max(n, 1)
    if method == "interleaved":
        return np.arange(n, dtype=np.int64) % n_workers
    if method == "least_loaded":
        rng = np.random.default_rng(seed)
        inflight = np.zeros(n_workers, np.int64)
        out = np.empty(n, np.int64)
        for r in range(n):
            cands = np.flatnonzero(inflight == inflight.min())
            out[r] = cands[rng.integers(cands.size)]
            inflight[out[r]] += 1
        return out
    raise ValueError(f"method must be one of {ROLLOUT_ROUTES}, got {method!r}")
