"""How fast a problem's history goes stale as the policy trains, measured on a rollout trace.

``python -m benchmarks.staleness --trace PATH [--n 4] [--json PATH]``

A problem's earlier rollouts help DAS only as far as its next rollouts repeat them. This asks the
trace directly, with no drafter: for every visit of a problem (its GRPO group at policy version
``v``) and every earlier visit of the same problem (version ``u < v``, policy age ``a = v - u``),
how well does the earlier group predict the later one? For each rollout of the later group and
each output position ``i >= n``, the context is the ``n`` tokens before ``i``:

* *covered*: the context occurs in the reference rollouts (followed by some token);
* *hit*: the reference's most frequent token after that context (ties: the smallest id) is the
  rollout's token at ``i``: what a one-token frequency draft from that history would get right.

The reference for age ``a`` is the earlier group without the sample of the same index, and for
age 0 the rollout's live siblings (its own group without itself), so every reference holds
``G - 1`` rollouts of a group of ``G`` and the rows compare like with like. Printed per age:
visit pairs, positions, coverage (covered / positions), accuracy (hits / covered) and hit rate
(hits / positions). On a trace from a fixed policy (``das-rollout --trace``) the rows fall only
with the randomness of sampling; on one from a training run (``das-grpo ... log.trace=PATH``)
the fall with age beyond that is the policy's drift: what DAS's ``decay`` and ``window`` are for
(:class:`das.drafter.DASDrafter`).

JSON (``--json``): ``{"trace": ..., "n": ..., "ages": [{"age", "pairs", "positions", "covered",
"hits", "coverage", "accuracy", "hit_rate"}, ...]}``, age 0 first.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any


def continuation_tables(group: list[list[int]], n: int, leave_out: int | None) -> dict[tuple[int, ...], int]:
    """The most frequent next token (ties: the smallest id) after every ``n``-token context of the
    rollouts ``group`` (lists of output token ids) except ``group[leave_out]``."""
    counts: dict[tuple[int, ...], Counter] = defaultdict(Counter)
    for j, out in enumerate(group):
        if j == leave_out:
            continue
        for i in range(n, len(out)):
            counts[tuple(out[i - n : i])][out[i]] += 1
    return {ctx: min(c.items(), key=lambda kv: (-kv[1], kv[0]))[0] for ctx, c in counts.items()}


def score(rollout: list[int], table: dict[tuple[int, ...], int], n: int) -> tuple[int, int, int]:
    """``(positions, covered, hits)`` of ``rollout`` against a :func:`continuation_tables` table."""
    covered = hits = 0
    for i in range(n, len(rollout)):
        nxt = table.get(tuple(rollout[i - n : i]))
        if nxt is not None:
            covered += 1
            hits += nxt == rollout[i]
    return max(0, len(rollout) - n), covered, hits


def staleness(rows: list[Any], n: int = 4) -> list[dict[str, Any]]:
    """Coverage, accuracy and hit rate by policy age (see the module docstring).

    Args:
        rows: trace rollouts (:class:`integrations.data.trace.Rollout`: ``problem_id``,
            ``policy_version``, ``sample``, ``output_ids``).
        n: context length in tokens, >= 1.

    Returns:
        One dict per age present (0 = live siblings), ages ascending.

    Raises:
        ValueError: ``n < 1``.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    visits: dict[str, dict[int, dict[int, list[int]]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        visits[r.problem_id][int(r.policy_version)][int(r.sample)] = list(r.output_ids)
    acc: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # pairs, positions, covered, hits
    for groups in visits.values():
        versions = sorted(groups)
        for vi, v in enumerate(versions):
            later = groups[v]
            for u in [v, *versions[:vi]]:
                earlier = groups[u]
                ref = sorted(earlier)
                tab = {s: continuation_tables([earlier[k] for k in ref], n, ref.index(s) if s in earlier else None) for s in later}
                a = acc[v - u]
                a[0] += 1
                for s, out in later.items():
                    p, c, h = score(out, tab[s], n)
                    a[1] += p
                    a[2] += c
                    a[3] += h
    out = []
    for age in sorted(acc):
        pairs, pos, cov, hits = acc[age]
        out.append({"age": age, "pairs": pairs, "positions": pos, "covered": cov, "hits": hits,
                    "coverage": round(cov / pos, 4) if pos else 0.0, "accuracy": round(hits / cov, 4) if cov else 0.0,
                    "hit_rate": round(hits / pos, 4) if pos else 0.0})
    return out


def trace_rows(ap: argparse.ArgumentParser, path: Path) -> list[Any]:
    """The rollouts of the trace at ``path`` (:func:`integrations.data.trace.read_trace`); a file
    that cannot be read is ``ap``'s usage error, naming ``--trace``."""
    from integrations.data.trace import read_trace

    try:
        return read_trace(path)
    except (OSError, ValueError) as exc:
        ap.error(f"--trace: {exc}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.staleness", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, type=Path, help="rollout trace (parquet; das-rollout --trace or das-grpo log.trace)")
    ap.add_argument("--n", type=int, default=4, help="context length in tokens (default 4)")
    ap.add_argument("--json", type=Path, default=None, help="write the table here")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error(f"--n must be >= 1, got {args.n}")
    from tabulate import tabulate

    rows = trace_rows(ap, args.trace)
    ages = staleness(rows, args.n)
    print(f"trace {args.trace} ({len(rows)} rollouts), contexts of {args.n} tokens; age 0 = the live siblings")
    print(tabulate([[a["age"], a["pairs"], a["positions"], a["coverage"], a["accuracy"], a["hit_rate"]] for a in ages],
                   ["policy age", "visit pairs", "positions", "coverage", "accuracy", "hit rate"], floatfmt=".3f"))
    if args.json:
        args.json.write_text(json.dumps({"trace": str(args.trace), "n": args.n, "ages": ages}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
