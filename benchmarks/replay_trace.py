"""Replay one iteration list of a recorded rollout trace through one drafter (the core of :mod:`benchmarks.replay`).

:func:`load_trace` reads a trace into iterations of :class:`TraceRollout`; :func:`replay` runs them
through a drafter adapter (:mod:`benchmarks.replay_drafters`) as the engine would, and counts verification
steps and accepted tokens. :mod:`benchmarks.replay` (one engine) and :mod:`benchmarks.replay_engines`
(N engines) both build on it.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import numpy as np

from scheduler.acceptance import AcceptanceCalibration

DEFAULT_K = 16  # most draft tokens per verification step

# ----------------------------------------------------------------------------- trace


class TraceRollout:
    __slots__ = ("pid", "prompt", "output", "out_list", "full", "iteration")

    def __init__(self, pid: str, prompt: np.ndarray, output: np.ndarray, iteration: int):
        self.pid = pid
        self.prompt = prompt
        self.output = output
        self.out_list = output.tolist()
        self.full = np.concatenate([prompt, output]).astype(np.int32)
        self.iteration = iteration


def load_trace(path: str | Path) -> list[list[TraceRollout]]:
    """Rollouts of a trace (see :mod:`integrations.data.trace`), grouped by iteration, in file order.

    Rollouts with an empty output are dropped (nothing to replay).

    Raises:
        ValueError: naming the path, when the trace has no rollout with output tokens (an empty
            trace replays nothing, and every rate would divide by zero).
    """
    from integrations.data.trace import read_trace

    iters: dict[int, list[TraceRollout]] = {}
    rows = read_trace(path)
    for r in rows:
        if not r.output_ids:
            continue
        iters.setdefault(r.iteration, []).append(
            TraceRollout(r.problem_id, np.asarray(r.prompt_ids, np.int32), np.asarray(r.output_ids, np.int32), r.iteration)
        )
    if not iters:
        raise ValueError(f"trace {str(path)!r} has nothing to replay: {len(rows)} rollouts, none with output tokens")
    return [iters[i] for i in sorted(iters)]


# ----------------------------------------------------------------------------- replay


def accepted_prefix(draft, truth, start: int) -> int:
    """Draft tokens a deterministic drafter gets accepted: the length of the longest common prefix
    of ``draft`` and ``truth[start:]`` (the real continuation; both sequences of token ids)."""
    m = 0
    lim = min(len(draft), len(truth) - start)
    while m < lim and draft[m] == truth[start + m]:
        m += 1
    return m


def replay(adapter, iterations: list[list[TraceRollout]], first_version: int = 1, version_stride: int = 1, *,
           first_iteration: int = 0) -> dict[str, Any]:
    """Replay ``iterations`` through ``adapter``; returns the metrics (see the module docstring).

    Iteration ``it`` runs at policy version ``first_version + it * version_stride``: a stride of 1
    is a small data set whose problems come back every step; a stride of ``N`` plays each problem
    coming back once per epoch of ``N`` steps (a large data set). Its rollouts' request ids are
    ``(first_iteration + it, i)`` (``i``: the rollout's index in its iteration's list), so that a
    drafter replaying a trace one iteration at a time sees each request id once."""
    lat: list[int] = []
    add_ns = 0
    add_tokens = 0
    start_ns = 0
    nstart = 0
    drafted = 0
    tokens_total = 0
    steps_total = 0
    per_iter = []
    all_steps: list[int] = []
    all_lens: list[int] = []
    makespan = 0
    perf = time.perf_counter_ns
    calib = hasattr(adapter, "last_probs")  # drafters that report their token probabilities
    cal_n = np.zeros(10)
    cal_p = np.zeros(10)
    cal_acc = np.zeros(10)
    cal_c = np.zeros(10)  # calibrated probabilities, as the proposer's cost budget would price them
    online = AcceptanceCalibration()  # learns from the outcomes so far only, as in the engine
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for it, rollouts in enumerate(iterations):
            adapter.begin_iteration(first_version + it * version_stride)
            n = len(rollouts)
            pos = [0] * n
            steps = [0] * n
            rids = [(first_iteration + it, i) for i in range(n)]
            # prefill: the first token, one verification step without a draft
            for i, r in enumerate(rollouts):
                t0 = perf()
                adapter.start(rids[i], r.prompt, r.pid)
                t1 = perf()
                adapter.add(rids[i], r.output[:1])
                t2 = perf()
                start_ns += t1 - t0
                nstart += 1
                add_ns += t2 - t1
                add_tokens += 1
                pos[i] = 1
                steps[i] = 1
            active = []
            for i, r in enumerate(rollouts):
                if r.output.shape[0] > 1:
                    active.append(i)
                else:
                    adapter.stop(rids[i])
            it_drafted = 0
            while active:
                still = []
                for i in active:
                    r = rollouts[i]
                    p = pos[i]
                    out = r.out_list
                    L = len(out)
                    rid = rids[i]
                    ctx = r.full[: r.prompt.shape[0] + p]
                    t0 = perf()
                    d = adapter.propose(rid, ctx)
                    t1 = perf()
                    lat.append(t1 - t0)
                    nd = len(d)
                    it_drafted += nd
                    m = 0
                    if nd:
                        if type(d) is not list:
                            d = d.tolist()
                        m = accepted_prefix(d, out, p)
                    new = min(m + 1, L - p)
                    if calib and nd and adapter.last_probs is not None:
                        pr = np.asarray(adapter.last_probs, np.float64)
                        b = np.minimum((pr * 10).astype(np.int64), 9)
                        cal_n += np.bincount(b, minlength=10)
                        cal_p += np.bincount(b, weights=pr, minlength=10)
                        cal_acc += np.bincount(b[:m], minlength=10)
                        cal_c += np.bincount(b, weights=online(pr), minlength=10)
                        online.observe(pr, np.arange(nd) < m)
                    t0 = perf()
                    adapter.add(rid, r.output[p : p + new])
                    t1 = perf()
                    add_ns += t1 - t0
                    add_tokens += new
                    p += new
                    pos[i] = p
                    steps[i] += 1
                    if p < L:
                        still.append(i)
                    else:
                        adapter.stop(rid)
                active = still
            toks = sum(r.output.shape[0] for r in rollouts)
            st = sum(steps)
            drafted += it_drafted
            tokens_total += toks
            steps_total += st
            makespan += max(steps)
            all_steps += steps
            all_lens += [r.output.shape[0] for r in rollouts]
            per_iter.append({"iteration": first_iteration + it, "rollouts": n, "tokens": toks, "verification_steps": st,
                             "acceptance_length": round(toks / st, 4), "drafted_tokens": it_drafted,
                             "longest_rollout_steps": max(steps)})
    finally:
        if gc_was:
            gc.enable()
    lat_us = np.asarray(lat, np.float64) / 1e3
    accepted = tokens_total - steps_total
    order = np.argsort(np.asarray(all_lens), kind="stable")[::-1]
    top = order[: max(1, len(order) // 10)]
    steps_arr = np.asarray(all_steps)
    return {
        "acceptance_length": round(tokens_total / steps_total, 4),
        "tokens": tokens_total,
        "verification_steps": steps_total,
        "steps_per_rollout": round(float(steps_arr.mean()), 2),
        "steps_per_rollout_longest10": round(float(steps_arr[top].mean()), 2),
        "tokens_per_rollout_longest10": round(float(np.asarray(all_lens)[top].mean()), 2),
        "makespan_steps": int(makespan),
        "drafted_tokens": int(drafted),
        "accepted_tokens": int(accepted),
        "drafted_per_accepted": round(drafted / accepted, 3) if accepted else None,
        "propose_calls": int(lat_us.shape[0]),
        "propose_us_p50": round(float(np.percentile(lat_us, 50)), 3) if lat_us.size else 0.0,
        "propose_us_p99": round(float(np.percentile(lat_us, 99)), 3) if lat_us.size else 0.0,
        "propose_us_mean": round(float(lat_us.mean()), 3) if lat_us.size else 0.0,
        "insert_ns_per_token": round(add_ns / max(add_tokens, 1), 1),
        "start_us_mean": round(start_ns / max(nstart, 1) / 1e3, 2),
        "iterations": per_iter,
        **({"calibration": [{"bin": f"[{j / 10:.1f},{(j + 1) / 10:.1f})", "drafted": int(cal_n[j]),
                             "mean_prob": round(cal_p[j] / cal_n[j], 3), "accepted_rate": round(cal_acc[j] / cal_n[j], 3),
                             "calibrated_prob": round(cal_c[j] / cal_n[j], 3)}
                            for j in range(10) if cal_n[j]]} if calib else {}),
    }


