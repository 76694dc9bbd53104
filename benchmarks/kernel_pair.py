"""Two versions of the ``mix`` drafting kernel, timed step by step in one process.

``python -m benchmarks.kernel_pair --base PATH [--trace PATH] [--rows 256] [--threads N] [--k 16]``

``PATH`` is another version of ``das/mix_kernels.py`` (e.g. ``git show HEAD:das/mix_kernels.py >
/tmp/base_mix.py``). A cloud VM can drift by tens of percent between runs of one command (and
in spells within one), which hides a change of a few percent between two runs of
``benchmarks.step_cost`` (docs/benchmarks.md, "Measurement notes"). So this runs the ``batch`` path of ``benchmarks.step_cost``'s workload
once, and at every engine step drafts twice on the same drafter state: with the checkout's kernel
(``new``) and with ``PATH``'s (``base``), in alternating order. Drafting only reads the trees and
the mixer, so both calls see the same state; the step goes on with the checkout's drafts (where
the two differ and ``base`` ran last, ``new`` runs once more, untimed). The two kernels' times are paired per step, so drift cancels
out; the second call of a step finds more of the trees in the caches, which the alternating
order shares out evenly.

Prints per kernel the p50 and mean drafting time per step (ms), the ratio of the sums (new /
base), the share of steps where ``new`` was faster, and the steps whose drafts differed (0 for
a change that must draft the same).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.replay import load_trace
from benchmarks.step_cost import Workload, find_trace, simulate

SKIP = 5  # first steps left out: the kernels load from numba's disk cache on their first calls


def load_kernels(path: Path):
    """``path`` (a version of ``das/mix_kernels.py``) as a module of its own."""
    spec = importlib.util.spec_from_file_location("das.mix_kernels_pair_base", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--base {str(path)!r} is not a Python file")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # numba's disk cache finds a kernel's module by its name
    spec.loader.exec_module(mod)
    for name in ("mix_batch", "mix_batch_parallel"):
        if not hasattr(mod, name):
            raise ValueError(f"--base {str(path)!r} has no {name}: expected a version of das/mix_kernels.py")
    return mod


def paired_run(work: Workload, base, k: int, max_steps: int, threads: int) -> dict[str, np.ndarray | int]:
    """The ``batch`` path of ``work`` with every step drafted by both kernels (see the module
    docstring). Returns the per-step times in seconds (``base``, ``new``: ``float64[steps]``)
    and ``differ``, the steps whose drafts differed."""
    from das import drafter as drafter_module
    from das import mix_kernels as new

    times: dict[str, list[float]] = {"base": [], "new": []}
    differ = [0]
    calls = [0]
    original = drafter_module.DASDrafter._mix_drafts

    def both(self, handles, budgets, kmax, min_prob, tokens, probs, lengths, parts):
        order = [("base", base), ("new", new)]
        if calls[0] % 2:
            order.reverse()
        calls[0] += 1
        out = {}
        for name, mod in order:
            t0 = time.perf_counter()
            original(self, handles, budgets, kmax, min_prob, tokens, probs, lengths, parts, mix_kernels=mod)
            times[name].append(time.perf_counter() - t0)
            out[name] = (tokens.copy(), lengths.copy())
        if not (np.array_equal(out["base"][0], out["new"][0]) and np.array_equal(out["base"][1], out["new"][1])):
            differ[0] += 1
            if order[-1][0] == "base":  # the step goes on with the checkout's drafts (and pending drafts)
                original(self, handles, budgets, kmax, min_prob, tokens, probs, lengths, parts, mix_kernels=new)

    drafter_module.DASDrafter._mix_drafts = both
    try:
        simulate(work, "batch", k, max_steps, {"draft_threads": threads})
    finally:
        drafter_module.DASDrafter._mix_drafts = original
    return {"base": np.asarray(times["base"]), "new": np.asarray(times["new"]), "differ": differ[0]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernel_pair", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="another version of das/mix_kernels.py")
    p.add_argument("--trace", default=None, help="rollout trace (parquet); default: as benchmarks.step_cost (recorded if missing)")
    p.add_argument("--rows", type=int, default=256, help="running requests")
    p.add_argument("--threads", type=int, default=1, help="draft threads (the drafter's draft_threads)")
    p.add_argument("--k", type=int, default=16, help="draft budget per row and step (K)")
    p.add_argument("--max-steps", type=int, default=400, help="engine steps at most")
    p.add_argument("--json", default=None, help="write the summary here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rows < 1 or args.threads < 1 or args.k < 1 or args.max_steps <= SKIP:
        print(f"--rows, --threads and --k must be >= 1 and --max-steps > {SKIP}", file=sys.stderr)
        return 2
    try:
        trace = find_trace(args.trace)
    except FileNotFoundError as exc:
        print(f"kernel_pair: {exc}", file=sys.stderr)
        return 2
    try:
        base = load_kernels(Path(args.base))
    except (OSError, ValueError, SyntaxError, ImportError) as e:
        print(f"--base: {e}", file=sys.stderr)
        return 2
    run = paired_run(Workload(load_trace(trace), args.rows), base, args.k, args.max_steps, args.threads)
    b, n = run["base"][SKIP:] * 1e3, run["new"][SKIP:] * 1e3
    if b.size == 0:
        print("too few steps drafted to compare", file=sys.stderr)
        return 2
    summary = {"rows": args.rows, "threads": args.threads, "steps": int(b.size), "trace": str(trace),
               "base_p50_ms": round(float(np.median(b)), 4), "new_p50_ms": round(float(np.median(n)), 4),
               "base_mean_ms": round(float(b.mean()), 4), "new_mean_ms": round(float(n.mean()), 4),
               "ratio_of_sums": round(float(n.sum() / b.sum()), 4), "new_faster_share": round(float(np.mean(n < b)), 3),
               "steps_drafting_differently": int(run["differ"])}
    print(f"{args.rows} rows, {args.threads} thread(s), {b.size} steps: drafting per step p50 base {summary['base_p50_ms']:.3f} "
          f"/ new {summary['new_p50_ms']:.3f} ms, mean {summary['base_mean_ms']:.3f} / {summary['new_mean_ms']:.3f} ms; "
          f"new / base (sums) {summary['ratio_of_sums']:.3f}; new faster in {summary['new_faster_share']:.0%} of steps; "
          f"steps drafting differently: {summary['steps_drafting_differently']}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
