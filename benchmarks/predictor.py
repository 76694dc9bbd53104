"""Evaluate the length predictor against baselines: ``python -m benchmarks.predictor [--trace PATH]``.

Each policy version of the rollouts is predicted from the earlier ones
(:func:`scheduler.evaluate_predictor`): final length at the start and after ``x`` generated
tokens; baselines are the global mean and the problem's last-iteration mean. Prints MAE, mean
relative error and Spearman rank correlation per checkpoint, and the class confusion matrices.
Without ``--trace`` the rollouts are synthetic: the simulator's long-tail length model
(:class:`benchmarks.sim_workload.LengthModel`), 256 problems x 8 samples x 6 versions, each
problem revisited with probability 0.5 per version (so history is thin, as in RL epochs).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.sim_workload import LengthModel
from scheduler.predictor import CLASS_NAMES, evaluate_predictor


def synthetic_rollouts(n_problems: int = 256, n_samples: int = 8, versions: int = 6, revisit: float = 0.5, max_tokens: int = 16384, seed: int = 0):
    """``(problem_ids, versions, lengths)`` lists of synthetic rollouts (see the module doc)."""
    rng = np.random.default_rng(seed)
    lm = LengthModel(max_tokens=max_tokens)
    mu = lm.sample_problems(n_problems, rng)
    pids, vers, lens = [], [], []
    for v in range(versions):
        chosen = np.flatnonzero(rng.random(n_problems) < (1.0 if v == 0 else revisit))
        x = lm.sample(mu[chosen], n_samples, rng)
        for i, row in zip(chosen, x):
            pids += [f"p{i}"] * n_samples
            vers += [v] * n_samples
            lens += row.tolist()
    return pids, vers, lens


def print_report(out: dict[str, Any]) -> None:
    from tabulate import tabulate

    b1, b2 = out["bounds"]
    print(f"classes: short < {b1:.0f} <= medium < {b2:.0f} <= long (tokens)")
    rows = [[x, m, r["n"], float(r["mae"]), float(r["mean_rel_err"]), float(r["bias"]), float(r["spearman"])]
            for x, methods in out["checkpoints"].items() for m, r in methods.items()]
    print(tabulate(rows, ["after x tokens", "method", "n", "MAE", "rel err", "bias", "spearman"], floatfmt=["", "", "", ".0f", ".2f", ".0f", ".2f"],
                   colalign=["left", "left"], disable_numparse=[0]))
    for key, cm in out["confusion"].items():
        label = "initial class" if key == "initial" else f"class after {key} tokens"
        print(f"{label} (rows true, cols predicted {'/'.join(CLASS_NAMES)}), accuracy {out['class_accuracy'][key]:.2f}")
        print(tabulate([[name, *(int(v) for v in row)] for name, row in zip(CLASS_NAMES, cm)], ["", *CLASS_NAMES]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.predictor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, help="rollout trace (integrations.data.trace parquet)")
    ap.add_argument("--max-tokens", type=int, default=16384, help="the rollouts' max output tokens")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--checkpoints", default="0,0.125,0.25,0.5", help="fractions of max tokens")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --json file (else refuse before running)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        cps = tuple(float(c) for c in args.checkpoints.split(","))
    except ValueError:
        raise SystemExit(f"--checkpoints must be comma-separated fractions, got {args.checkpoints!r}") from None
    if args.json:
        from integrations.results import check_output_path

        try:
            check_output_path(args.json, overwrite=args.overwrite)
        except ValueError as exc:
            raise SystemExit(f"predictor: {exc}") from None
    if args.trace:
        from integrations.data.trace import read_trace

        rows = read_trace(args.trace)
        if not rows:
            raise SystemExit(f"predictor: trace {str(args.trace)!r} has no rollouts")
        pids = [r.problem_id for r in rows]
        vers = [r.policy_version for r in rows]
        lens = [min(len(r.output_ids), args.max_tokens) for r in rows]
        source = str(args.trace)
    else:
        pids, vers, lens = synthetic_rollouts(max_tokens=args.max_tokens, seed=args.seed)
        source = "synthetic (benchmarks.sim_workload.LengthModel)"
    out = evaluate_predictor(pids, vers, lens, args.max_tokens, checkpoints=cps, window=args.window)
    out["source"] = source
    print(f"rollouts: {len(lens)} from {source}, {len(set(vers))} policy versions, {len(set(pids))} problems")
    print_report(out)
    if args.json:
        from integrations.results import write_atomic

        write_atomic(args.json, json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
