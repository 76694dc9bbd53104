"""Placement of a rollout iteration's requests on data-parallel GPUs, and the cluster run.

Placements (``PLACEMENTS``):

* ``none``: contiguous chunks of the request list (groups in data order, siblings adjacent), as a
  trainer that splits its batch evenly over the rollout workers does; whole groups per GPU when
  the number of GPUs divides the number of groups.
* ``lpt``: whole groups, longest predicted group work first, each to the least loaded GPU
  (:func:`scheduler.placement.assign_groups`, ties to fewer predicted-Long requests).
* ``split``: the siblings of every group dealt over the GPUs (sample ``j`` of group ``p`` to GPU
  ``(p * S + j) mod N``): every GPU gets an equal share of every problem; an engine's drafter then
  sees only the siblings on its own GPU.
* ``rebalance``: ``none`` at the start, then at every ``epoch_s`` of simulated time (all GPUs at a
  step boundary) requests move from the GPU with the most predicted remaining work (sum over its
  unfinished requests of the predictor's expected remaining tokens) to the one with the least,
  while that lowers the larger of the two loads, waiting requests first; a running request that
  moves is recomputed on its new GPU (prefill of prompt + generated tokens), like a preemption.
"""

from __future__ import annotations

import numpy as np

from benchmarks.sim_engine import DONE, POS_BINS, RUNNING, WAITING, EngineParams, Gpu, Requests
from scheduler.placement import assign_groups, predicted_group_work, route_rollouts
from scheduler.predictor import LengthPredictor

PLACEMENTS = ("none", "lpt", "split", "rebalance")


def assign(n_groups: int, group_size: int, n_gpus: int, method: str, predictor: LengthPredictor | None = None, problem_ids=None) -> np.ndarray:
    """GPU of every request (int64 ``[n_groups * group_size]``, request ``p * S + j``), by
    :mod:`scheduler.placement` (the engines' placement code): ``none`` and ``rebalance`` start from
    ``contiguous`` chunks, ``split`` is ``interleaved``, ``lpt`` places whole groups by
    :func:`scheduler.placement.predicted_group_work`."""
    if method in ("none", "rebalance"):
        return route_rollouts(np.full(n_groups, group_size), n_gpus, "contiguous")
    if method == "split":
        return route_rollouts(np.full(n_groups, group_size), n_gpus, "interleaved")
    if method == "lpt":
        if predictor is None or problem_ids is None:
            raise ValueError("lpt placement needs the predictor and the problem ids")
        work, n_long = predicted_group_work(predictor, problem_ids, group_size)
        return np.repeat(assign_groups(work, n_gpus, "lpt", n_long=n_long), group_size)
    raise ValueError(f"unknown placement {method!r}; expected one of {PLACEMENTS}")


def rebalance(gpus: list[Gpu], req: Requests, predictor: LengthPredictor, t_now: float, *, max_moves: int = 64, tol: float = 0.05) -> int:
    """One rebalancing round at a step boundary (module doc); returns the requests moved."""
    unf = [g.unfinished() for g in gpus]
    rem = {}
    loads = np.zeros(len(gpus))
    for j, u in enumerate(unf):
        if u.size:
            x = predictor.predict(req.problem_idx[u], req.gen[u]).expected_remaining
            rem.update(zip(u.tolist(), x.tolist()))
            loads[j] = x.sum()
    moved = 0
    taken: set[int] = set()
    while moved < max_moves:
        src, dst = int(np.argmax(loads)), int(np.argmin(loads))
        gap = loads[src] - loads[dst]
        if src == dst or loads[src] <= (1.0 + tol) * loads.mean() or gap <= 0:
            break
        cand = [i for i in gpus[src].unfinished().tolist() if i not in taken and rem[i] < gap]
        if not cand:
            break
        waiting = [i for i in cand if req.status[i] == WAITING]
        pool = waiting or cand
        i = min(pool, key=lambda i: abs(rem[i] - 0.5 * gap))
        if req.status[i] == RUNNING:  # its KV is dropped here and recomputed there
            req.status[i] = WAITING
            req.wait_key[i] = -1e12 - moved
        gpus[src].remove(np.array([i]))
        gpus[dst].add(np.array([i]))
        gpus[dst].t = max(gpus[dst].t, t_now)  # an idle GPU starts the moved request now
        req.moves[i] += 1
        taken.add(i)
        loads[src] -= rem[i]
        loads[dst] += rem[i]
        moved += 1
    return moved


def run_cluster(
    req: Requests,
    gpu_of: np.ndarray,
    n_gpus: int,
    budget_factory,
    params: EngineParams,
    *,
    placement: str = "none",
    predictor: LengthPredictor | None = None,
    epoch_s: float = 5.0,
    seed: int = 0,
    gpu_ids: np.ndarray | None = None,
) -> tuple[list[Gpu], dict]:
    """Run one iteration on ``n_gpus`` engines (``gpu_ids``: only those GPUs, for the sweep).

    Returns:
        ``(gpus, info)``; ``info`` has ``moves`` (rebalancing), ``stats_pos`` ``[2, POS_BINS, 3]``
        (steps, drafted, accepted outside / inside loops per position bin) and ``stats_sib``
        ``[S, 3]`` (the same per finished-sibling count, outside loops).
    """
    n_groups = int(req.group.max()) + 1 if req.n else 1
    stats_pos = np.zeros((2, POS_BINS, 3))
    stats_sib = np.zeros((req.group_size, 3))
    ids = np.arange(n_gpus) if gpu_ids is None else np.asarray(gpu_ids)
    gpus = [Gpu(int(g), req, np.flatnonzero(gpu_of == g), budget_factory(int(g)), params, n_groups, stats_pos, stats_sib, seed=seed + int(g)) for g in ids]
    moves = 0
    if placement == "rebalance":
        if predictor is None:
            raise ValueError("rebalance needs the predictor")
        t = 0.0
        while not all(g.done for g in gpus):
            t += epoch_s
            for g in gpus:
                g.run_until(t)
            if not all(g.done for g in gpus):
                moves += rebalance(gpus, req, predictor, t)
    else:
        for g in gpus:
            g.run_until()
    if np.any(req.status[np.concatenate([g.mem for g in gpus])] != DONE):
        raise RuntimeError("simulation ended with unfinished requests")
    return gpus, {"moves": moves, "stats_pos": stats_pos, "stats_sib": stats_sib}
