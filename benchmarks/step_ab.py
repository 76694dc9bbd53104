"""Two rules or settings of the drafter's batch verbs, timed in turns inside one process.

``python -m benchmarks.step_ab --ab owner --rows 256`` runs :mod:`benchmarks.step_cost`'s batch
workload (the same trace, rows and steps) with each rule of one pair, A B B A A B ..., and prints
each arm's step time (p50 of a step's fastest over the runs, as ``step_cost``) and each run's
median. The drafts are the same under both rules of a pair (checked: the runs take the same steps
and tokens); only the time differs. Alternating inside one process keeps the machine's drift
(+-25% between runs of one command on these VMs) out of the ratio.

Pairs (``--ab``):

* ``owner``: which thread appends which tree in a threaded step, whatever the number of threads
  (:data:`das.step_threads.BALANCED_PARTS` set for the run). ``modulo`` deals trees by id modulo the
  threads; ``balanced`` is :func:`das.step_kernels.balance_parts` (the threads that also carry
  the global tree's append and the learning get fewer trees).
* ``threshold``: ``one_thread`` below 128 rows (the old :data:`das.step_threads.PARALLEL_ROWS`)
  against ``threads`` from 8 rows on, for steps of ``--rows`` rows.
* ``settings``: two drafter settings, ``--a JSON`` against ``--b JSON`` (e.g. ``--a
  '{"global_depth": 12}' --b '{}'``). Their drafts may differ, so the runs of
  each arm must agree among themselves, not with the other arm's; each arm prints its tokens per
  row and step beside its time.

JSON (``--json``): ``{"ab": ..., "rows": ..., "threads": ..., "machine": ..., "arms": {arm:
{"p50_ms", "add_p50_ms", "p99_ms", "steps", "tokens_per_row_step", "lifecycle_ms_mean", "run_p50_ms": [...]}}}``
(``settings``: ``"settings": {"a": ..., "b": ...}`` too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

import das.step_threads as thread_rules
from benchmarks.replay import load_trace
from benchmarks.step_cost import DEFAULT_K, Workload, cpu_model, find_trace, simulate, summarize, threads_of, warm_up

ARMS = {"owner": ("modulo", "balanced"), "threshold": ("one_thread", "threads"), "settings": ("a", "b")}
OLD_PARALLEL_ROWS = 128


def set_arm(arm: str) -> None:
    """Switch the drafter module's rule to ``arm`` (one of :data:`ARMS`' values)."""
    if arm == "modulo":
        thread_rules.BALANCED_PARTS = 1 << 30
    elif arm == "balanced":
        thread_rules.BALANCED_PARTS = 2
    elif arm == "one_thread":
        thread_rules.PARALLEL_ROWS = OLD_PARALLEL_ROWS
    elif arm == "threads":
        thread_rules.PARALLEL_ROWS = 8
    elif arm in ("a", "b"):
        pass  # the arms differ in their drafter settings (run_pair's ``settings``)
    else:
        raise ValueError(f"arm must be one of {sorted(a for p in ARMS.values() for a in p)}, got {arm!r}")


def run_pair(iterations, ab: str, rows: int, repeats: int, k: int = DEFAULT_K, max_steps: int = 10**6,
             config: dict[str, Any] | None = None, settings: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Both arms of pair ``ab`` on ``rows`` rows, ``repeats`` runs each in turns; returns
    ``{arm: summary}`` (:func:`benchmarks.step_cost.summarize` plus ``run_p50_ms``). ``settings``
    (pair ``settings`` only, required there): ``{"a": {...}, "b": {...}}``, each arm's drafter
    settings over ``config``.

    Raises:
        ValueError: an unknown pair, or ``settings`` missing for ``settings`` (or given for another pair).
        AssertionError: runs that should draft alike took different steps or tokens."""
    if ab not in ARMS:
        raise ValueError(f"ab must be one of {sorted(ARMS)}, got {ab!r}")
    if (ab == "settings") != (settings is not None):
        raise ValueError(f"settings (two drafter settings, 'a' and 'b') go with the pair 'settings' only; got ab={ab!r}, "
                         f"settings={settings!r}")
    per_arm = {a: {**(config or {}), **(settings or {}).get(a, {})} for a in ARMS[ab]}
    arms = ARMS[ab]
    saved = (thread_rules.BALANCED_PARTS, thread_rules.PARALLEL_ROWS)
    work = Workload(iterations, rows)
    runs: dict[str, list] = {a: [] for a in arms}
    try:
        for i in range(repeats):
            for arm in arms if i % 2 == 0 else arms[::-1]:
                set_arm(arm)
                runs[arm].append(simulate(work, "batch", k, max_steps, per_arm[arm]))
    finally:
        thread_rules.BALANCED_PARTS, thread_rules.PARALLEL_ROWS = saved
    groups = list(runs.values()) if ab == "settings" else [[r for rs in runs.values() for r in rs]]
    for group in groups:
        done = {(r["steps"], r["tokens"]) for r in group}
        if len(done) != 1:
            raise AssertionError(f"runs that should draft alike drafted differently (steps, tokens per run: {done})")
    out = {}
    for arm, rs in runs.items():
        s = summarize(rs, rows)
        s["run_p50_ms"] = [round(float(np.median(r["wall_ns"])) / 1e6, 4) for r in rs]
        out[arm] = s
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.step_ab", description=__doc__.split("\n")[0])
    ap.add_argument("--ab", choices=sorted(ARMS), required=True, help="which pair of rules")
    ap.add_argument("--trace", default=None, help="rollout trace (parquet); default: as benchmarks.step_cost")
    ap.add_argument("--rows", type=int, default=256, help="running requests")
    ap.add_argument("--repeats", type=int, default=4, help="runs per arm, in turns")
    ap.add_argument("--threads", type=int, default=0, help="draft_threads (0: the drafter's default)")
    ap.add_argument("--max-steps", type=int, default=10**6, help="engine steps per run at most")
    ap.add_argument("--a", default=None, help="pair 'settings': arm a's drafter settings (JSON)")
    ap.add_argument("--b", default=None, help="pair 'settings': arm b's drafter settings (JSON)")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    settings = None
    if args.ab == "settings":
        if args.a is None or args.b is None:
            ap.error("--ab settings needs --a JSON and --b JSON (two drafter settings)")
        settings = {}
        for arm, text in (("a", args.a), ("b", args.b)):
            try:
                settings[arm] = json.loads(text)
            except json.JSONDecodeError as exc:
                ap.error(f"--{arm} must be a JSON object of drafter settings, got {text!r} ({exc})")
            if not isinstance(settings[arm], dict):
                ap.error(f"--{arm} must be a JSON object of drafter settings, got {text!r}")
    elif args.a is not None or args.b is not None:
        ap.error("--a and --b go with --ab settings")
    trace = find_trace(args.trace)
    if trace is None or not trace.exists():
        print(f"no trace at {trace}; record one (see benchmarks/README.md, Step cost)", file=sys.stderr)
        return 2
    config = {"draft_threads": args.threads} if args.threads else {}
    iterations = load_trace(trace)
    warm_up(iterations, DEFAULT_K, ("batch",), config)  # the threaded kernels too
    arms = run_pair(iterations, args.ab, args.rows, args.repeats, max_steps=args.max_steps, config=config, settings=settings)
    threads = threads_of(config)
    print(f"trace: {trace}; {args.rows} rows; draft threads {threads}; CPU: {cpu_model()} ({os.cpu_count()} cores)")
    for arm, s in arms.items():
        runs = " ".join(f"{x:.3f}" for x in s["run_p50_ms"])
        what = json.dumps(settings[arm]) if settings else arm
        print(f"{args.ab:9s} {what:10s} p50 {s['p50_ms']:.3f} ms  appending {s['add_p50_ms']:.3f}  p99 {s['p99_ms']:.3f}"
              f"  lifecycle {s['lifecycle_ms_mean']:.3f}  steps {s['steps']}  tokens/row/step {s['tokens_per_row_step']:.3f}"
              f"  per run: {runs}")
    if args.json:
        report = {"ab": args.ab, "rows": args.rows, "threads": threads, "trace": str(trace),
                  "machine": {"cpu": cpu_model(), "cpu_count": os.cpu_count()}, "arms": arms}
        if settings:
            report["settings"] = settings
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
