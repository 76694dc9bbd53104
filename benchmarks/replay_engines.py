"""Replay a rollout trace over N engines: where rollouts go, and whether engines share history.

``python -m benchmarks.replay --engines N --routing {rollout,group,sticky} [--shared-history]``
replays one configuration (beside the one-engine replay it is compared with);
``python -m benchmarks.replay_engines --trace A --trace B --engines 1,2,8,64 --json PATH`` runs
the table of docs/benchmarks.md ("Many engines: routing and shared history"): every routing,
with and without shared history (``--histories``), per trace and engine count.

Each engine replays its share of every iteration through its own drafter, exactly as
:func:`benchmarks.replay.replay` replays a trace through one (the engine's rollouts of an
iteration run concurrently; siblings on the same engine see each other's tokens at once).
Routings (:mod:`scheduler.placement`, the engines' own placement code):

* ``rollout``: single rollouts scattered as verl's least-loaded balancer does
  (:func:`scheduler.placement.route_rollouts` ``least_loaded``, in dispatch order: groups in trace
  order, siblings adjacent); a GRPO group's samples land on several engines.
* ``group``: whole groups placed anew each iteration, longest predicted work first
  (:func:`scheduler.placement.assign_groups` ``lpt`` on
  :func:`scheduler.placement.predicted_group_work`, from a :class:`scheduler.LengthPredictor`
  fed with the lengths of every earlier iteration's rollouts, whichever engine made them).
* ``sticky``: a problem always on the engine of its first visit
  (:class:`scheduler.placement.StickyPlacement`).

Without shared history an engine's drafter knows only the rollouts that engine generated. With
``shared_history``, before an engine's first draft of a problem in an iteration, its drafter
receives every rollout of that problem from earlier iterations that it does not hold yet, with
its policy version (DAS: :meth:`das.DASDrafter.add_rollout`, which keeps what is in its window;
arctic-inference: start, response, stop of the cache's public calls, so the response joins its
global tree); as a shared history actor would send it. An engine holds only the history of the
problems it serves (and, arctic and DAS's global tree, those problems' responses). With
``share_global`` as well, every engine's cross-problem tree also receives every other rollout of
the earlier iterations (DAS keeps the newest ``global_rollouts`` of them, a fixed amount).

Reported per drafter: pooled ``acceptance_length`` (tokens per verification step, bonus token
included, over all engines and iterations), ``drafted_per_accepted``, ``makespan_steps`` (sum
over iterations of the largest step count of any rollout on any engine), the history sent
(rollouts and tokens), and memory: each engine's drafter's structural bytes and stored tokens
(the adapter's ``stored()``: DAS's ``stats()``, problem trees and global tree, arctic's
``estimate_memory``) at its peak over iteration ends, as the largest and the mean over the engines
that served anything; for DAS also the global tree's share.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from benchmarks.replay_drafters import make_adapter
from benchmarks.replay_trace import DEFAULT_K, TraceRollout, load_trace, replay
from scheduler.placement import StickyPlacement, assign_groups, predicted_group_work, route_rollouts
from scheduler.predictor import LengthPredictor

ROUTINGS = ("rollout", "group", "sticky")
ENGINE_DRAFTERS = ("das", "arctic_suffix")


def _groups(rollouts: list[TraceRollout]) -> tuple[list[str], np.ndarray]:
    """Problems of an iteration in order of first appearance, and each rollout's group index."""
    order: dict[str, int] = {}
    gid = np.array([order.setdefault(r.pid, len(order)) for r in rollouts], np.int64)
    return list(order), gid


def route(iterations: list[list[TraceRollout]], n_engines: int, routing: str, *, seed: int = 0) -> list[np.ndarray]:
    """Engine of each rollout, per iteration (int64 arrays, one per iteration, in trace order).

    Raises:
        ValueError: unknown ``routing`` or ``n_engines`` < 1.
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if isinstance(n_engines, bool) or not isinstance(n_engines, (int, np.integer)) or n_engines < 1:
        raise ValueError(f"n_engines must be an int >= 1, got {n_engines!r}")
    max_tokens = max((r.output.shape[0] for rs in iterations for r in rs), default=1)
    predictor = LengthPredictor(max(int(max_tokens), 1))
    sticky = StickyPlacement(n_engines)
    out = []
    for it, rollouts in enumerate(iterations):
        pids, gid = _groups(rollouts)
        sizes = np.bincount(gid, minlength=len(pids))
        if routing == "rollout":
            order = np.argsort(gid, kind="stable")  # dispatch order: groups in turn, siblings adjacent
            eng = np.empty(len(rollouts), np.int64)
            eng[order] = route_rollouts(sizes, n_engines, "least_loaded", seed=[seed, it])
        else:
            work, n_long = predicted_group_work(predictor, pids, sizes)
            placed = assign_groups(work, n_engines, "lpt", n_long=n_long) if routing == "group" else sticky.place(pids, work, n_long)
            eng = placed[gid]
        out.append(eng)
        for g, p in enumerate(pids):  # the lengths every engine reports once the iteration is done
            predictor.observe(p, it + 1, [r.output.shape[0] for r, x in zip(rollouts, gid) if x == g])
    return out


def replay_engines(name: str, iterations: list[list[TraceRollout]], n_engines: int, routing: str, *, shared_history: bool = False,
                   share_global: bool = False, k: int = DEFAULT_K, config: dict[str, Any] | None = None, seed: int = 0,
                   engine_of: list[np.ndarray] | None = None) -> dict[str, Any]:
    """Replay ``iterations`` over ``n_engines`` engines, each with its own ``name`` drafter (module doc).

    Args:
        name: a drafter of :func:`benchmarks.replay_drafters.make_adapter`.
        iterations: from :func:`benchmarks.replay.load_trace`; iteration ``it`` is policy version ``it + 1``.
        n_engines, routing: see :func:`route`; ``engine_of`` (one int array per iteration)
            overrides the routing's placement.
        shared_history: engines receive the earlier rollouts of the problems they serve.
        share_global: engines also receive every other earlier rollout into their cross-problem
            tree (DAS's global tree, arctic's cache), as a history that pushes each iteration's
            rollouts to every engine does.
        k: most draft tokens per step; config: the drafter's settings.

    Returns:
        The pooled metrics (module doc) and ``per_engine`` (acceptance length, tokens, peak bytes).

    Raises:
        ValueError: bad routing / engine count, or an ``engine_of`` that does not fit the trace.
    """
    engine_of = route(iterations, n_engines, routing, seed=seed) if engine_of is None else [np.asarray(e, np.int64) for e in engine_of]
    if len(engine_of) != len(iterations) or any(e.shape != (len(rs),) or (e.size and (e.min() < 0 or e.max() >= n_engines))
                                                for e, rs in zip(engine_of, iterations)):
        raise ValueError(f"engine_of must give each rollout of each of the {len(iterations)} iterations an engine in [0, {n_engines})")
    config = dict(config or {})
    adapters: dict[int, Any] = {}
    held: dict[int, set] = {}
    held_global: dict[int, set] = {}
    tot = {"tokens": 0, "verification_steps": 0, "drafted_tokens": 0, "accepted_tokens": 0}
    per_engine = {e: {"rollouts": 0, "tokens": 0, "verification_steps": 0, "peak_bytes": 0, "peak_tokens_stored": 0} for e in range(n_engines)}
    sent_rollouts = sent_tokens = kept = makespan = 0
    per_iteration: list[float] = []
    by_problem: dict[str, list[tuple[int, int]]] = {}  # problem -> (iteration, index) of its finished rollouts
    for it, rollouts in enumerate(iterations):
        eng = engine_of[it]
        longest = 0
        it_tokens = it_steps = 0
        for e in np.unique(eng).tolist():
            idx = np.flatnonzero(eng == e).tolist()
            a = adapters.get(e)
            if a is None:
                a = adapters[e] = make_adapter(name, k, **config)
                held[e] = set()
                held_global[e] = set()
            a.begin_iteration(it + 1)
            if shared_history:
                for pid in dict.fromkeys(rollouts[i].pid for i in idx):
                    for key in by_problem.get(pid, ()):
                        if key not in held[e]:
                            h = iterations[key[0]][key[1]]
                            kept += bool(a.add_history(("history",) + key, h.prompt, h.output, pid, key[0] + 1))
                            held[e].add(key)
                            held_global[e].add(key)
                            sent_rollouts += 1
                            sent_tokens += h.output.shape[0]
            if share_global:
                for key in ((j, i) for j in range(it) for i in range(len(iterations[j]))):
                    if key not in held_global[e]:
                        h = iterations[key[0]][key[1]]
                        kept += bool(a.add_global_history(("global",) + key, h.prompt, h.output))
                        held_global[e].add(key)
                        sent_rollouts += 1
                        sent_tokens += h.output.shape[0]
            res = replay(a, [[rollouts[i] for i in idx]], first_version=it + 1, first_iteration=it)
            held[e].update((it, i) for i in idx)
            held_global[e].update((it, i) for i in idx)
            for key in tot:
                tot[key] += res[key]
            it_tokens += res["tokens"]
            it_steps += res["verification_steps"]
            pe = per_engine[e]
            pe["rollouts"] += len(idx)
            pe["tokens"] += res["tokens"]
            pe["verification_steps"] += res["verification_steps"]
            nbytes, ntok = a.stored()
            pe["peak_bytes"] = max(pe["peak_bytes"], int(nbytes))
            pe["peak_tokens_stored"] = max(pe["peak_tokens_stored"], int(ntok))
            if name == "das":  # of which the global tree (a fixed number of rollouts of any problem)
                pe["peak_global_tree_bytes"] = max(pe.get("peak_global_tree_bytes", 0), int(a.d.stats()["global_tree_bytes"]))
            longest = max(longest, res["iterations"][0]["longest_rollout_steps"])
        makespan += longest
        per_iteration.append(round(it_tokens / it_steps, 4))
        for i, r in enumerate(rollouts):
            by_problem.setdefault(r.pid, []).append((it, i))
    used = [pe for pe in per_engine.values() if pe["verification_steps"]]
    peaks = np.array([pe["peak_bytes"] for pe in used], np.float64)
    acc = tot["accepted_tokens"]
    return {
        "drafter": name, "k": k, "config": config, "engines": n_engines, "routing": routing, "shared_history": shared_history,
        "share_global": share_global,
        "acceptance_length": round(tot["tokens"] / tot["verification_steps"], 4),
        "drafted_per_accepted": round(tot["drafted_tokens"] / acc, 3) if acc else None,
        **tot,
        "makespan_steps": int(makespan),
        "acceptance_per_iteration": per_iteration,
        "engines_used": len(used),
        "history_rollouts_sent": sent_rollouts, "history_rollouts_kept": kept, "history_tokens_sent": sent_tokens,
        "engine_peak_bytes_max": int(peaks.max()), "engine_peak_bytes_mean": round(float(peaks.mean()), 1),
        "engine_peak_tokens_stored_max": max(pe["peak_tokens_stored"] for pe in used),
        **({"engine_peak_global_tree_bytes_max": max(pe["peak_global_tree_bytes"] for pe in used)} if name == "das" else {}),
        "per_engine": [{"engine": e, "acceptance_length": round(pe["tokens"] / pe["verification_steps"], 4), **pe}
                       for e, pe in per_engine.items() if pe["verification_steps"]],
    }


def compare_to_one(entry: dict[str, Any], one: dict[str, Any]) -> dict[str, Any]:
    """``entry`` with its ratios to the one-engine replay ``one`` of the same drafter and trace:
    ``acceptance_vs_one`` and ``engine_peak_bytes_vs_one`` (the largest engine's peak / one engine's)."""
    out = dict(entry)
    out["acceptance_vs_one"] = round(entry["acceptance_length"] / one["acceptance_length"], 4)
    out["engine_peak_bytes_vs_one"] = round(entry["engine_peak_bytes_max"] / one["engine_peak_bytes_max"], 4) if one["engine_peak_bytes_max"] else None
    return out


def available_drafters(names) -> list[str]:
    """``names`` without arctic-inference's drafters where it is not installed (said on stderr)."""
    names = list(names)
    if any(n.startswith("arctic") for n in names):
        try:
            import arctic_inference.suffix_decoding  # noqa: F401
        except ImportError:
            print("arctic-inference is not installed: skipping its drafters", file=sys.stderr)
            names = [n for n in names if not n.startswith("arctic")]
    return names


HISTORIES = {"own": (False, False), "problem": (True, False), "global": (True, True)}


def run_table(traces: dict[str, list[list[TraceRollout]]], engines, routings=ROUTINGS, names=ENGINE_DRAFTERS, *, k: int = DEFAULT_K,
              seed: int = 0, configs: dict[str, dict[str, Any]] | None = None, histories=("own", "problem")) -> list[dict[str, Any]]:
    """Rows of the docs' table: per trace and drafter, one engine, then each engine count > 1 x
    routing x history (``own``: each engine its own; ``problem``: ``shared_history``; ``global``:
    also ``share_global``), each with its ratios to one engine."""
    rows = []
    configs = configs or {}
    for label, iterations in traces.items():
        for name in names:
            cfg = configs.get(name, {})
            one = replay_engines(name, iterations, 1, "group", k=k, config=cfg, seed=seed)
            rows.append({"trace": label, "history": "one", **compare_to_one(one, one)})
            for n in engines:
                if n == 1:
                    continue
                for routing in routings:
                    for hist in histories:
                        shared, glob = HISTORIES[hist]
                        print(f"{label}: {name} N={n} {routing} history={hist} ...", file=sys.stderr, flush=True)
                        e = replay_engines(name, iterations, n, routing, shared_history=shared, share_global=glob, k=k, config=cfg, seed=seed)
                        rows.append({"trace": label, "history": hist, **compare_to_one(e, one)})
    return rows


def _history(r: dict[str, Any]) -> str:
    return r.get("history") or ("one" if r["engines"] == 1 else "global" if r.get("share_global") else "problem" if r["shared_history"] else "own")


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The table as text (tabulate): one line per trace, drafter, N and routing; per history
    (own, shared problem history, and that plus the global share where run) the pooled acceptance
    length, its ratio to one engine, drafted per accepted and the largest engine's peak MB."""
    from tabulate import tabulate

    index: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in rows:
        index.setdefault((r["trace"], r["drafter"], r["engines"], r["routing"] if r["engines"] > 1 else "-"), {})[_history(r)] = r
    hists = [h for h in ("one", "own", "problem", "global") if any(h in by for by in index.values())]
    table = []
    for (trace, name, n, routing), by in index.items():
        line = [trace, name, n, routing]
        for h in hists:
            e = by.get(h)
            line += [e and e["acceptance_length"], e and e["acceptance_vs_one"], e and e["drafted_per_accepted"], e and e["engine_peak_bytes_max"] / 1e6]
        table.append(line)
    head = ["trace", "drafter", "N", "routing"] + [f"{h} {c}" for h in hists for c in ("acc", "x one", "d/a", "MB/eng")]
    return tabulate(table, head, floatfmt=["", "", "", ""] + [".3f", ".3f", ".2f", ".2f"] * len(hists), missingval="-")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.replay_engines", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", action="append", required=True, help="rollout trace (parquet); repeat for several, LABEL=PATH to name it")
    p.add_argument("--engines", default="1,2,8,64", help="engine counts (comma-separated; 1 is always run: the reference)")
    p.add_argument("--routing", default=",".join(ROUTINGS), help=f"routings, a subset of {','.join(ROUTINGS)}")
    p.add_argument("--drafters", default=",".join(ENGINE_DRAFTERS), help="drafters (das, arctic_suffix)")
    p.add_argument("--histories", default="own,problem",
                   help="histories of the engines: own (each its own), problem (shared problem history), global (that and every "
                        "other earlier rollout in the cross-problem tree); comma-separated")
    p.add_argument("--k", type=int, default=DEFAULT_K, help="most draft tokens per step")
    p.add_argument("--seed", type=int, default=0, help="seed of the rollout routing's tie-breaks")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json")
    args = p.parse_args(argv)
    from integrations.results import check_output_path, write_atomic

    try:
        engines = [int(x) for x in args.engines.split(",") if x.strip()]
        routings = [x.strip() for x in args.routing.split(",") if x.strip()]
        histories = [x.strip() for x in args.histories.split(",") if x.strip()]
        if not engines or min(engines) < 1 or any(r not in ROUTINGS for r in routings) or any(h not in HISTORIES for h in histories):
            raise ValueError(f"--engines must be ints >= 1, --routing a subset of {ROUTINGS} and --histories of {tuple(HISTORIES)}, "
                             f"got {args.engines!r}, {args.routing!r}, {args.histories!r}")
        if args.json:
            check_output_path(args.json, overwrite=args.overwrite)
        traces = {}
        for spec in args.trace:
            label, _, path = spec.rpartition("=")
            traces[label or path] = load_trace(path)
    except (ValueError, FileNotFoundError) as exc:
        print(f"replay_engines: {exc}", file=sys.stderr)
        return 2
    names = available_drafters(x.strip() for x in args.drafters.split(",") if x.strip())
    rows = run_table(traces, engines, routings, names, k=args.k, seed=args.seed, histories=histories)
    print(format_rows(rows))
    if args.json:
        import os
        import platform

        report = {"traces": {label: {"path": spec.rpartition("=")[2], "iterations": len(its), "rollouts": sum(len(r) for r in its),
                                     "tokens": int(sum(r.output.shape[0] for rs in its for r in rs))}
                             for (label, its), spec in zip(traces.items(), args.trace)},
                  "k": args.k, "seed": args.seed, "engines": engines, "routings": routings, "histories": histories,
                  "machine": {"cpu_count": os.cpu_count(), "processor": platform.processor(), "python": sys.version.split()[0]},
                  "rows": rows}
        write_atomic(args.json, json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
