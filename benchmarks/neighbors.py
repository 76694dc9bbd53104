"""What other problems' rollouts could add to a problem's drafts, measured on a rollout trace.

``python -m benchmarks.neighbors --trace PATH [--n 3,8] [--k 4] [--json PATH]``

Issue 11 lists "a cluster of similar problems" among the scopes a draft could come from. This
asks a trace, with no drafter (as :mod:`benchmarks.staleness` does for a problem's own history),
what such a scope could give beyond the problem's own tree. For every rollout of a problem's group
at iteration ``v`` and every output position ``i >= n``, the ``n`` tokens before ``i`` are looked
up in three references, each of which drafts its most frequent next token after them (ties: the
smallest id, as :func:`benchmarks.staleness.continuation_tables`):

* ``own``: the problem's other rollouts of iteration ``v`` (its live GRPO siblings) and all its
  rollouts of earlier iterations: what DAS's problem tree holds;
* ``similar``: the rollouts (iterations ``<= v``) of the ``k`` problems whose prompts are most
  similar to this one's, among those with rollouts by iteration ``v``: TF-IDF cosine over the
  prompts' token unigrams and bigrams, IDF over the trace's problems (no model);
* ``others``: the rollouts (iterations ``<= v``) of every other problem: what a global tree of
  unbounded size and depth would hold. Other problems' rollouts of iteration ``v`` count whole, so
  ``similar`` and ``others`` are upper bounds: an engine sees them only as far as they are verified.

Printed per context length ``n``: positions, each reference's coverage (it has the context) and hit
rate (its token is the rollout's), and the *extra* hit rate of ``similar`` and ``others``: positions
where ``own`` has no token or a wrong one and theirs is right, the most that a scope built from them
could add to the problem tree at that context length.

JSON (``--json``): ``{"trace": ..., "k": ..., "problems": ..., "similarity_mean": ..., "rows": [{"n",
"positions", "own_coverage", "own_hit_rate", "similar_coverage", "similar_hit_rate", "similar_extra",
"others_coverage", "others_hit_rate", "others_extra"}, ...]}`` (the mean is each problem's best
similarity to another).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

Counts = dict[tuple[int, ...], Counter]


def _counts(outputs: list[list[int]], n: int) -> Counts:
    """Next-token counts after every ``n``-token context of ``outputs``."""
    c: Counts = defaultdict(Counter)
    for out in outputs:
        for i in range(n, len(out)):
            c[tuple(out[i - n : i])][out[i]] += 1
    return c


def _best(total: Counter) -> int | None:
    """Most frequent token of ``total`` (ties: the smallest id), counts <= 0 left out; None if none."""
    kept = [(-v, t) for t, v in total.items() if v > 0]
    return min(kept)[1] if kept else None


def prompt_similarity(prompts: dict[str, list[int]]) -> dict[str, list[tuple[float, str]]]:
    """Every problem's other problems, most similar prompt first: ``[(cosine, problem_id), ...]``.

    TF-IDF over each prompt's token unigrams and bigrams (IDF ``ln((1 + P) / (1 + df))`` over the
    ``P`` problems), cosine of the vectors. Shapes: ``prompts`` maps a problem id to its prompt's
    token ids."""
    feats = {p: Counter(x) + Counter(zip(x, x[1:])) for p, x in prompts.items()}
    df = Counter(f for c in feats.values() for f in c)
    P = len(prompts)
    vec = {}
    for p, c in feats.items():
        v = {f: k * math.log((1 + P) / (1 + df[f])) for f, k in c.items()}
        norm = math.sqrt(sum(x * x for x in v.values())) or 1.0
        vec[p] = {f: x / norm for f, x in v.items()}

    def cos(a: dict, b: dict) -> float:
        if len(a) > len(b):
            a, b = b, a
        return sum(x * b.get(f, 0.0) for f, x in a.items())

    return {p: sorted(((cos(vec[p], vec[q]), q) for q in prompts if q != p), key=lambda s: (-s[0], s[1])) for p in prompts}


def neighbors(rows: list[Any], ns: tuple[int, ...] = (3, 8), k: int = 4) -> dict[str, Any]:
    """Coverage, hit rate and extra hit rate per reference and context length (see the module docstring).

    Args:
        rows: trace rollouts (:class:`integrations.data.trace.Rollout`: ``iteration``,
            ``problem_id``, ``sample``, ``prompt_ids``, ``output_ids``).
        ns: context lengths in tokens, each >= 1.
        k: similar problems per problem, >= 1.

    Returns:
        ``{"problems", "similarity_mean", "rows": [one dict per n]}``.

    Raises:
        ValueError: an ``n < 1`` or ``k < 1``.
    """
    if not ns or any(not isinstance(n, int) or n < 1 for n in ns):
        raise ValueError(f"context lengths must be ints >= 1, got {list(ns)!r}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    groups: dict[str, dict[int, dict[int, list[int]]]] = defaultdict(lambda: defaultdict(dict))
    prompts: dict[str, list[int]] = {}
    for r in rows:
        groups[r.problem_id][int(r.iteration)][int(r.sample)] = list(r.output_ids)
        prompts[r.problem_id] = list(r.prompt_ids)
    similar = prompt_similarity(prompts)
    first = {p: min(g) for p, g in groups.items()}
    iterations = sorted({v for g in groups.values() for v in g})
    best_sims = [similar[p][0][0] for p in groups if similar[p]]
    out = []
    for n in ns:
        cnt = {p: {v: _counts(list(g[v].values()), n) for v in g} for p, g in groups.items()}
        acc = Counter()
        for v in iterations:
            total: Counts = defaultdict(Counter)  # every problem's rollouts of iterations <= v
            for p in groups:
                for u, c in cnt[p].items():
                    if u <= v:
                        for ctx, nxt in c.items():
                            total[ctx].update(nxt)
            for p, g in groups.items():
                if v not in g:
                    continue
                mine = [cnt[p][u] for u in g if u <= v]
                near = [cnt[q][u] for _, q in [s for s in similar[p] if first[s[1]] <= v][:k] for u in cnt[q] if u <= v]
                for out_ids in g[v].values():
                    self_c = _counts([out_ids], n)
                    for i in range(n, len(out_ids)):
                        ctx, tok = tuple(out_ids[i - n : i]), out_ids[i]
                        own = Counter()
                        for c in mine:
                            own.update(c.get(ctx, {}))
                        rest = Counter(total.get(ctx, {}))
                        rest.subtract(own)
                        own.subtract(self_c[ctx])
                        sim = Counter()
                        for c in near:
                            sim.update(c.get(ctx, {}))
                        b_own, b_sim, b_rest = _best(own), _best(sim), _best(rest)
                        own_hit = b_own == tok
                        acc["positions"] += 1
                        acc["own_covered"] += b_own is not None
                        acc["own_hits"] += own_hit
                        acc["similar_covered"] += b_sim is not None
                        acc["similar_hits"] += b_sim == tok
                        acc["similar_extra"] += b_sim == tok and not own_hit
                        acc["others_covered"] += b_rest is not None
                        acc["others_hits"] += b_rest == tok
                        acc["others_extra"] += b_rest == tok and not own_hit
        pos = acc["positions"] or 1
        row: dict[str, Any] = {"n": n, "positions": acc["positions"]}
        for ref in ("own", "similar", "others"):
            row[f"{ref}_coverage"] = round(acc[f"{ref}_covered"] / pos, 4)
            row[f"{ref}_hit_rate"] = round(acc[f"{ref}_hits"] / pos, 4)
            if ref != "own":
                row[f"{ref}_extra"] = round(acc[f"{ref}_extra"] / pos, 4)
        out.append(row)
    return {"problems": len(groups), "similarity_mean": round(sum(best_sims) / len(best_sims), 4) if best_sims else 0.0,
            "rows": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.neighbors", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, type=Path, help="rollout trace (parquet; das-rollout --trace or das-grpo log.trace)")
    ap.add_argument("--n", default="3,8", help="context lengths in tokens, comma-separated (default 3,8)")
    ap.add_argument("--k", type=int, default=4, help="similar problems per problem (default 4)")
    ap.add_argument("--json", type=Path, default=None, help="write the table here")
    args = ap.parse_args(argv)
    try:
        ns = tuple(int(x) for x in args.n.split(",") if x.strip())
    except ValueError:
        ap.error(f"--n must be comma-separated ints >= 1, got {args.n!r}")
    if not ns or min(ns) < 1:
        ap.error(f"--n must be comma-separated ints >= 1, got {args.n!r}")
    if args.k < 1:
        ap.error(f"--k must be >= 1, got {args.k}")
    from tabulate import tabulate

    from benchmarks.staleness import trace_rows

    rows = trace_rows(ap, args.trace)
    res = neighbors(rows, ns, args.k)
    print(f"trace {args.trace} ({len(rows)} rollouts, {res['problems']} problems); similar = the {args.k} most similar "
          f"prompts (mean best similarity {res['similarity_mean']:.3f}); rates per output position")
    print(tabulate([[r["n"], r["positions"], r["own_coverage"], r["own_hit_rate"], r["similar_coverage"], r["similar_hit_rate"],
                     r["similar_extra"], r["others_coverage"], r["others_hit_rate"], r["others_extra"]] for r in res["rows"]],
                   ["n", "positions", "own: covered", "own: hits", "similar: covered", "similar: hits", "similar: extra",
                    "others: covered", "others: hits", "others: extra"], floatfmt=".3f"))
    if args.json:
        args.json.write_text(json.dumps({"trace": str(args.trace), "k": args.k, **res}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
