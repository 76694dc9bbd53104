"""Replay a recorded rollout trace through drafters, as the engine would use them.

``python -m benchmarks.replay [--trace PATH] [--json PATH] [--plot PATH] [--scale]``;
``python -m benchmarks.replay --engines N --routing {rollout,group,sticky} [--shared-history]``
replays the trace over N engines instead (:mod:`benchmarks.replay_engines`).

Without ``--trace`` it replays the benchmarks' cached trace, recorded first with the real model
when it is missing (:func:`integrations.data.trace.cached_trace`: DSR-sub, shipped with the
package; 5 iterations x 16 prompts x 8 samples, 384
tokens; several minutes on a 2-core CPU).

Replay: the rollouts of one iteration (policy version) run concurrently. Each request's first
token comes from prefill (one verification step, no draft); then, step after step, every running
request (in trace order) gets a draft of at most K tokens from the drafter, the accepted tokens
are the longest common prefix of the draft and the rollout's real continuation plus the bonus
token (for a deterministic drafter this is what lossless speculative sampling accepts on those
same samples), and they are added to the drafter, where siblings see them at once. A request
stops after its last token. Between iterations the drafter's window advances.

Reported per drafter (``drafters.<name>`` in the JSON, at the default K): ``acceptance_length``
(tokens per verification step, bonus included), ``steps_per_rollout`` (mean) and
``steps_per_rollout_longest10`` (mean over the longest 10% of rollouts), ``makespan_steps`` (sum
over iterations of the largest step count of a rollout), ``drafted_per_accepted``,
``propose_us_p50`` / ``propose_us_p99`` (wall time of one propose call from Python),
``insert_ns_per_token`` (wall time of the add calls per token added), ``bytes_per_token`` (C-heap
bytes the drafter holds, per stored token, after every rollout of the trace went through it) and
``bytes_per_token_structural`` (the drafter's own accounting). ``grid`` holds the same for several
K and DAS windows; ``targets`` compares DAS with arctic-inference; ``scale`` (``--scale``) holds
propose / insert cost and memory of the raw trees against the number of stored tokens.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import operator
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.replay_drafters import heap_bytes, make_adapter
from benchmarks.replay_trace import DEFAULT_K, TraceRollout, accepted_prefix, load_trace, replay  # noqa: F401  (public names of this CLI)

DRAFTERS = ("das", "arctic_suffix", "ngram")


def measure_memory(name: str, config: dict[str, Any], iterations: list[list[TraceRollout]], k: int = DEFAULT_K,
                   version_stride: int = 1) -> dict[str, Any]:
    """Heap bytes a drafter holds after every rollout of the trace went through it (all requests
    stopped), per stored output token; plus the drafter's own accounting (structural)."""
    gc.collect()
    h0 = heap_bytes()
    a = make_adapter(name, k, **config)
    for it, rollouts in enumerate(iterations):
        a.begin_iteration(1 + it * version_stride)
        for i, r in enumerate(rollouts):
            a.start((it, i), r.prompt, r.pid)
        for i, r in enumerate(rollouts):  # a few chunks, as a request grows
            for chunk in np.array_split(r.output, 8):
                if chunk.shape[0]:
                    a.add((it, i), chunk)
        for i in range(len(rollouts)):
            a.stop((it, i))
    gc.collect()
    h1 = heap_bytes()
    structural, _ = a.stored()
    tokens = sum(r.output.shape[0] for rs in iterations for r in rs)  # the same denominator for every drafter
    out = {"tokens_stored": int(tokens)}
    if name != "ngram":
        out["bytes_per_token"] = round((h1 - h0) / tokens, 1) if h0 is not None else None
        out["bytes_per_token_structural"] = round(structural / tokens, 1)
    else:
        out["bytes_per_token"] = 0.0  # keeps nothing beyond the engine's own token buffer
        out["bytes_per_token_structural"] = 0.0
    del a
    gc.collect()
    return out


def warm_up(iterations: list[list[TraceRollout]], names) -> None:
    """Compile / page in every code path on a small slice before anything is timed."""
    small = [rs[:4] for rs in iterations[:2]]
    for name in names:
        replay(make_adapter(name, DEFAULT_K, **default_config(name)), small)


CONFIGS: dict[str, dict[str, Any]] = {}  # per-drafter overrides of the headline (--das, --arctic)


def default_config(name: str) -> dict[str, Any]:
    """Settings of the headline drafters: their own defaults (DASDrafter's; arctic as vLLM's
    ``suffix`` method; n-gram as vLLM's prompt lookup 2..4) unless --das / --arctic override them."""
    return dict(CONFIGS.get(name, {}))


TIMING_KEYS = ("propose_us_p50", "propose_us_p99", "propose_us_mean", "insert_ns_per_token", "start_us_mean")


def run_entry(name: str, k: int, config: dict[str, Any], iterations, memory: bool = True, version_stride: int = 1) -> dict[str, Any]:
    res = replay(make_adapter(name, k, **config), iterations, version_stride=version_stride)
    entry = {"drafter": name, "k": k, "config": config, **res}
    if memory:
        entry.update(measure_memory(name, config, iterations, k, version_stride))
    return entry


def run_headline(names, k: int, iterations, repeats: int = 3, version_stride: int = 1) -> dict[str, dict[str, Any]]:
    """Each drafter ``repeats`` times, interleaved (ABC, CBA, ABC, ...) so that they share the
    machine's load; timings are the median over the rounds (acceptance is deterministic)."""
    rounds: dict[str, list] = {n: [] for n in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            print(f"replaying {name} (K={k}, round {r + 1}/{repeats}) ...", file=sys.stderr, flush=True)
            rounds[name].append(replay(make_adapter(name, k, **default_config(name)), iterations, version_stride=version_stride))
    out = {}
    for name in names:
        e = dict(rounds[name][0])
        for key in TIMING_KEYS:
            vals = [x[key] for x in rounds[name]]
            e[key] = round(float(np.median(vals)), 3)
            e[key + "_rounds"] = vals
        e.update(measure_memory(name, default_config(name), iterations, k, version_stride))
        out[name] = {"k": k, "config": default_config(name), **e}
    return out


# Acceptance against draft cost: the same trace, K and depth, drafting rules varied.
FRONTIER = (
    ("das", {"chooser": "walk", "max_spec_factor": 1.0, "min_token_prob": 0.1, "prior": 0.0}),
    ("das", {"chooser": "walk", "max_spec_factor": 2.0, "min_token_prob": 0.2, "prior": 0.3}),
    ("das", {"chooser": "walk", "max_spec_factor": 3.0, "min_token_prob": 0.2, "prior": 0.3}),
    ("das", {"chooser": "walk", "max_spec_factor": 4.0, "min_token_prob": 0.1, "prior": 0.3}),
    ("das", {"chooser": "walk", "max_spec_factor": 16.0, "min_token_prob": 0.0, "prior": 0.3}),
    ("das", {"min_token_prob": 0.2}),
    ("das", {"min_token_prob": 0.15}),
    ("das", {"min_token_prob": 0.07}),
    ("das", {"min_token_prob": 0.0}),
    ("arctic_suffix", {"max_spec_factor": 1.0, "min_token_prob": 0.3}),
    ("arctic_suffix", {"max_spec_factor": 2.0, "min_token_prob": 0.1}),
    ("arctic_suffix", {"max_spec_factor": 4.0, "min_token_prob": 0.1}),
    ("arctic_suffix", {"max_spec_factor": 16.0, "min_token_prob": 0.0}),
)


# ----------------------------------------------------------------------------- report


_DIRECTIONS = {"le": ("<=", operator.le), "lt": ("<", operator.lt), "ge": (">=", operator.ge)}
TARGETS = (
    # (metric, direction, ratio): DAS must be <= / < (lower is better) or >= ratio x arctic: no slower
    # to propose or insert, no more memory per token, 1.12x arctic's acceptance length, and fewer
    # drafted tokens per accepted one (docs/benchmarks.md, "Replay").
    ("propose_us_p50", "le", 1.0),
    ("insert_ns_per_token", "le", 1.0),
    ("bytes_per_token", "le", 1.0),
    ("acceptance_length", "ge", 1.12),
    ("drafted_per_accepted", "lt", 1.0),
)


def targets(drafters: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """DAS against arctic-inference: each target, the ratio, met or not, and the gap."""
    das, arc = drafters.get("das"), drafters.get("arctic_suffix")
    out = {}
    if not das or not arc:
        return out
    for metric, how, need in TARGETS:
        a, b = das.get(metric), arc.get(metric)
        if a is None or not b:
            continue
        ratio = a / b
        sign, holds = _DIRECTIONS[how]
        met = holds(ratio, need)
        goal = b * need
        out[metric] = {"das": a, "arctic_suffix": b, "ratio": round(ratio, 3), "target": f"{sign} {need} x arctic",
                       "met": bool(met), "gap": None if met else round(a - goal, 3)}
    return out


def format_table(report: dict[str, Any]) -> str:
    """The report as text: headline table, acceptance per iteration, grid, hindsight bound, targets, scale (tabulate)."""
    from tabulate import tabulate

    cols = [("acc_len", "acceptance_length", ".3f"), ("steps/roll", "steps_per_rollout", ".1f"),
            ("steps/long10", "steps_per_rollout_longest10", ".1f"), ("makespan", "makespan_steps", "d"),
            ("draft/acc", "drafted_per_accepted", ".2f"), ("p50_us", "propose_us_p50", ".2f"),
            ("p99_us", "propose_us_p99", ".2f"), ("ins_ns/tok", "insert_ns_per_token", ".0f"),
            ("B/tok", "bytes_per_token", ".0f")]

    def table(label: str, entries: list[tuple[str, dict[str, Any]]]) -> str:
        rows = [[name] + [None if e.get(key) is None else float(e[key]) if fmt != "d" else int(e[key]) for _, key, fmt in cols]
                for name, e in entries]
        return tabulate(rows, [label] + [h for h, _, _ in cols], floatfmt=[""] + [f for _, _, f in cols], missingval="-")

    trace = report["trace"]
    lines = [f"trace: {trace['path']} ({trace['rollouts']} rollouts, {trace['tokens']} tokens, {trace['iterations']} iterations)", "",
             f"K = {report['k']}", table("drafter", list(report["drafters"].items()))]
    per_it = [[name] + [x["acceptance_length"] for x in e["iterations"]] for name, e in report["drafters"].items()]
    n_it = max((len(r) - 1 for r in per_it), default=0)
    lines += ["", "acceptance length per iteration:", tabulate(per_it, ["drafter"] + [str(i) for i in range(n_it)], floatfmt=".3f")]
    if report.get("grid"):
        short = {"window": "W", "max_spec_factor": "f", "min_token_prob": "mp", "prior": "pr"}
        entries = [(f"{e['drafter'].replace('arctic_suffix', 'arctic')} K={e['k']}"
                    + "".join(f" {v}" if isinstance(v, str) else f" {short.get(a, a)}={v:g}" for a, v in e["config"].items()), e)
                   for e in report["grid"]]
        lines += ["", "grid (K; DAS window W; chooser walk or mix (default); drafting rules: spec factor f, min token prob mp, prior pr):",
                  table("drafter / setting", entries)]
    if report.get("hindsight_bound"):
        h = report["hindsight_bound"]
        lines += ["", f"hindsight bound (DAS trees, K={h['k']}, every anchor walked to K tokens, the one that matches the "
                      f"real continuation longest): acceptance {h['acceptance_length']:.3f}, per iteration "
                      + " ".join(f"{x['acceptance_length']:.3f}" for x in h["iterations"])]
    if report.get("targets"):
        rows = [[metric, t["das"], t["arctic_suffix"], t["ratio"], t["target"], "met" if t["met"] else f"MISSED by {t['gap']:+g}"]
                for metric, t in report["targets"].items()]
        lines += ["", "targets (DAS vs arctic-inference, same trace, K and depth):",
                  tabulate(rows, ["metric", "das", "arctic", "ratio", "target", "status"], floatfmt="g", disable_numparse=[4, 5])]
    if report.get("scale"):
        rows = [[name, p["tokens"], float(p["insert_ns_per_token"]), float(p["propose_us_p50"]), float(p["propose_us_p99"]), p["bytes_per_token"]]
                for name, pts in report["scale"]["trees"].items() for p in pts]
        lines += ["", "scale (raw trees, depth 24, synthetic stream):",
                  tabulate(rows, ["tree", "tokens", "insert_ns/tok", "propose_us_p50", "propose_us_p99", "B/tok"],
                           floatfmt=["", "", ".0f", ".2f", ".2f", ""], missingval="-")]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=None, help="rollout trace (parquet); default: the cached DSR-sub trace, recorded if missing")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--plot", default=None, help="write a PNG plot here (matplotlib; default: next to --json)")
    p.add_argument("--overwrite", action="store_true", help="replace existing --json / --plot files (else refuse before running)")
    p.add_argument("--k", type=int, default=DEFAULT_K, help="K (most draft tokens per step) of the headline comparison")
    p.add_argument("--grid-k", default="4,8,16,32", help="K values of the grid ('' for none)")
    p.add_argument("--grid-window", default="1,2,4,16", help="DAS windows of the grid ('' for none)")
    p.add_argument("--drafters", default=",".join(DRAFTERS), help="drafters of the headline comparison")
    p.add_argument("--das", default=None, help="JSON of DASDrafter settings for the headline (e.g. '{\"prior\": 0}')")
    p.add_argument("--arctic", default=None,
                   help="JSON of arctic settings for the headline (max_tree_depth, max_spec_factor, min_token_prob, max_cached_requests)")
    p.add_argument("--version-stride", type=int, default=1,
                   help="policy versions between iterations: 1 plays a small data set revisited every step, N a large one "
                        "whose problems come back once per epoch of N steps (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the headline (timings: median)")
    p.add_argument("--no-frontier", dest="frontier", action="store_false",
                   help="skip the acceptance-vs-draft-cost runs (drafting rules varied at the headline K)")
    p.add_argument("--no-hindsight", dest="hindsight", action="store_false",
                   help="skip the hindsight bound (DAS trees, anchor chosen knowing the continuation)")
    p.add_argument("--scale", action="store_true", help="also run the scale mode (synthetic stream, raw trees)")
    p.add_argument("--scale-tokens", default="1e4,1e5,1e6,1e7", help="scale mode checkpoints (stored tokens)")
    p.add_argument("--no-record", action="store_true", help="fail instead of recording a trace when none is cached")
    p.add_argument("--model", default=None, help="model for recording (default: das-rollout's)")
    p.add_argument("--engines", type=int, default=None,
                   help="replay over this many engines, each with its own drafter, beside one engine (benchmarks.replay_engines); "
                        "reports pooled acceptance only")
    p.add_argument("--routing", default="group", choices=("rollout", "group", "sticky"),
                   help="with --engines: rollouts scattered by a least-loaded balancer, groups placed by predicted work "
                        "each iteration, or a problem always on one engine (default %(default)s)")
    p.add_argument("--shared-history", action="store_true",
                   help="with --engines: each engine's drafter receives the earlier rollouts of the problems it serves")
    p.add_argument("--share-global", action="store_true",
                   help="with --shared-history: every engine's cross-problem tree also receives every other earlier rollout")
    p.add_argument("--seed", type=int, default=0, help="with --engines: seed of the rollout routing's tie-breaks")
    args = p.parse_args(argv)
    if args.engines is not None and args.engines < 1:
        p.error(f"--engines must be >= 1, got {args.engines}")
    if args.version_stride < 1:
        p.error(f"--version-stride must be >= 1, got {args.version_stride}")
    return args


def main_engines(args: argparse.Namespace, trace, iterations: list[list[TraceRollout]], names: list[str]) -> int:
    """``--engines N``: each drafter over N engines with ``--routing`` (and ``--shared-history``),
    beside one engine; the table, and ``--json`` (``{"trace", "k", "rows"}``)."""
    from benchmarks.replay_engines import compare_to_one, format_rows, replay_engines

    rows = []
    for name in names:
        kw = dict(k=args.k, config=default_config(name), seed=args.seed)
        one = replay_engines(name, iterations, 1, args.routing, **kw)
        rows.append({"trace": Path(trace).stem, **compare_to_one(one, one)})
        if args.engines > 1:
            e = replay_engines(name, iterations, args.engines, args.routing, shared_history=args.shared_history or args.share_global,
                               share_global=args.share_global, **kw)
            rows.append({"trace": Path(trace).stem, **compare_to_one(e, one)})
    print(format_rows(rows))
    if args.json:
        from integrations.results import write_atomic

        write_atomic(args.json, json.dumps({"trace": str(trace), "k": args.k, "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    CONFIGS.clear()
    for name, text in (("das", args.das), ("arctic_suffix", args.arctic)):
        if text:
            CONFIGS[name] = json.loads(text)
    from integrations.results import check_output_path

    plot = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json and args.engines is None else None)
    if plot and importlib.util.find_spec("matplotlib") is None:
        if args.plot:
            print("replay: --plot needs matplotlib (pip install matplotlib, or the cpu / rl extra)", file=sys.stderr)
            return 2
        print("replay: matplotlib is not installed: no plot", file=sys.stderr)
        plot = None
    try:  # before hours of replay, not after
        for out in (args.json, plot):
            if out:
                check_output_path(out, overwrite=args.overwrite)
    except ValueError as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    from integrations.data.trace import cached_trace

    try:
        trace = cached_trace(args.trace, record=not args.no_record, model=args.model)
    except FileNotFoundError as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    try:
        iterations = load_trace(trace)
    except ValueError as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.drafters.split(",") if n.strip()]
    from benchmarks.replay_engines import available_drafters

    names = available_drafters(names)
    if args.engines is not None:
        return main_engines(args, trace, iterations, [n for n in names if n != "ngram"])
    warm_up(iterations, names)
    report: dict[str, Any] = {
        "trace": {"path": str(trace), "iterations": len(iterations), "rollouts": sum(len(r) for r in iterations),
                  "tokens": int(sum(r.output.shape[0] for rs in iterations for r in rs)),
                  "mean_output_tokens": round(float(np.mean([r.output.shape[0] for rs in iterations for r in rs])), 1)},
        "k": args.k,
        "version_stride": args.version_stride,
        "machine": {"cpu_count": os.cpu_count(), "python": sys.version.split()[0]},
        "drafters": {},
        "grid": [],
    }
    report["drafters"] = run_headline(names, args.k, iterations, args.repeats, args.version_stride)
    report["targets"] = targets(report["drafters"])
    ks = [int(x) for x in args.grid_k.split(",") if x.strip()]
    for k in ks:
        for name in names:
            if k == args.k:
                continue
            print(f"grid: {name} K={k} ...", file=sys.stderr, flush=True)
            report["grid"].append(run_entry(name, k, default_config(name), iterations, memory=False,
                                            version_stride=args.version_stride))
    if "das" in names:
        from das import DASDrafter

        default_w = DASDrafter().window
        for w in [int(x) for x in args.grid_window.split(",") if x.strip()]:
            if w == default_w:
                continue
            print(f"grid: das K={args.k} window={w} ...", file=sys.stderr, flush=True)
            report["grid"].append(run_entry("das", args.k, {**default_config("das"), "window": w}, iterations,
                                            version_stride=args.version_stride))
    if args.frontier:
        for name, cfg in FRONTIER:
            if name in names:
                print(f"frontier: {name} K={args.k} {cfg} ...", file=sys.stderr, flush=True)
                report["grid"].append(run_entry(name, args.k, cfg, iterations, memory=False, version_stride=args.version_stride))
    if args.hindsight and "das" in names:
        from benchmarks.replay_drafters import DASHindsightAdapter

        print(f"hindsight bound: das trees, K={args.k} ...", file=sys.stderr, flush=True)
        truth = {(it, i): r.output for it, rs in enumerate(iterations) for i, r in enumerate(rs)}
        res = replay(DASHindsightAdapter(args.k, truth, **default_config("das")), iterations, version_stride=args.version_stride)
        report["hindsight_bound"] = {"k": args.k, **{key: res[key] for key in
                                     ("acceptance_length", "steps_per_rollout", "steps_per_rollout_longest10",
                                      "drafted_per_accepted", "iterations")}}
    if args.scale:
        from benchmarks.replay_scale import run_scale

        report["scale"] = run_scale([int(float(x)) for x in args.scale_tokens.split(",") if x.strip()])
    print(format_table(report))
    if args.json:
        from integrations.results import write_atomic

        write_atomic(args.json, json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    if plot:
        from benchmarks.replay_plot import write_png

        write_png(report, plot)
        print(f"wrote {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
