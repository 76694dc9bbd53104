"""Drafters compared at the same contexts: at every step of one drafter's replay, the others draft too.

``python -m benchmarks.shadow [--trace PATH] [--lead das] [--shadows arctic_suffix] [--k 16] [--das JSON] [--json PATH]``

:mod:`benchmarks.replay` runs each drafter on its own steps. A step starts where that drafter's
previous draft ended (after its rejected token, or its bonus token), so two drafters are asked
about different contexts, and a ratio such as drafted tokens per accepted token depends on where
each one's steps fall as well as on its drafts. Here the trace is replayed once, driven by the
``lead`` drafter. At each of its steps every ``shadow`` drafter is asked for a draft of the same
context. The shadows get the same ``start`` / ``add`` / ``stop`` calls, so they hold the same
history. Every draft is checked against the trace (its longest common prefix with the real
continuation).

Prints per drafter, over the lead's steps (prefill steps, which draft nothing, left out): the
steps, the steps with a draft, draft tokens drafted and accepted, drafted per accepted, and
accepted draft tokens per step. A draft token counts as accepted when it matches the trace, also
in a draft that reaches the rollout's end; the replay counts one token fewer there (it counts a
step's tokens beyond the first), so the lead's accepted tokens here are a little higher than its
replay's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.replay import CONFIGS, DEFAULT_K, accepted_prefix, load_trace, replay
from benchmarks.replay_drafters import make_adapter
from benchmarks.step_cost import find_trace


class Shadowed:
    """A replay adapter: ``lead`` decides the drafts; each of ``shadows`` gets the same calls and
    drafts at the same contexts. ``iterations`` (from :func:`benchmarks.replay.load_trace`) give
    the real continuations. Counts in :attr:`counts` (name -> ``[steps, drafting steps, drafted,
    accepted]``, all in tokens but the first two).

    Raises:
        ValueError: two drafters with one name."""

    def __init__(self, iterations, lead, shadows):
        self.lead = lead
        self.shadows = list(shadows)
        self.full = {(it, i): r.full for it, rs in enumerate(iterations) for i, r in enumerate(rs)}
        self.counts = {a.name: [0, 0, 0, 0] for a in [lead, *self.shadows]}
        if len(self.counts) != 1 + len(self.shadows):
            raise ValueError(f"drafter names must be distinct, got {[a.name for a in [lead, *self.shadows]]}")
        self.last_probs = None

    def _all(self):
        return (self.lead, *self.shadows)

    def begin_iteration(self, version: int) -> None:
        for a in self._all():
            a.begin_iteration(version)

    def start(self, rid, prompt, pid) -> None:
        for a in self._all():
            a.start(rid, prompt, pid)

    def add(self, rid, tokens) -> None:
        for a in self._all():
            a.add(rid, tokens)

    def stop(self, rid) -> None:
        for a in self._all():
            a.stop(rid)

    def propose(self, rid, ctx):
        full = self.full[rid]
        n = ctx.shape[0]
        out = None
        for a in self._all():
            d = a.propose(rid, ctx)
            c = self.counts[a.name]
            c[0] += 1
            c[1] += len(d) > 0
            c[2] += len(d)
            c[3] += accepted_prefix(d, full, n)
            if a is self.lead:
                out = d
        self.last_probs = getattr(self.lead, "last_probs", None)
        return out


def run(iterations, lead: str, shadows: list[str], k: int) -> dict[str, Any]:
    """Replay ``iterations`` driven by drafter ``lead`` with ``shadows`` asked at its steps (names
    of :func:`benchmarks.replay_drafters.make_adapter`, settings from ``CONFIGS``). Returns the
    lead's replay metrics under ``"replay"`` and the per-drafter counts under ``"drafters"``."""
    adapter = Shadowed(iterations, make_adapter(lead, k, **CONFIGS.get(lead, {})),
                       [make_adapter(s, k, **CONFIGS.get(s, {})) for s in shadows])
    res = replay(adapter, iterations)
    drafters = {}
    for name, (steps, drafting, drafted, accepted) in adapter.counts.items():
        drafters[name] = {"steps": steps, "drafting_steps": drafting, "drafted_tokens": drafted, "accepted_tokens": accepted,
                          "drafted_per_accepted": round(drafted / accepted, 3) if accepted else None,
                          "accepted_per_step": round(accepted / steps, 4) if steps else None}
    return {"lead": lead, "k": k, "replay": {key: res[key] for key in ("acceptance_length", "drafted_per_accepted", "accepted_tokens",
                                                                        "drafted_tokens", "verification_steps")},
            "drafters": drafters}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.shadow", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=None, help="rollout trace (parquet); default: as benchmarks.step_cost (recorded if missing)")
    p.add_argument("--lead", default="das", help="the drafter whose drafts the replay follows")
    p.add_argument("--shadows", default="arctic_suffix", help="drafters asked at the lead's steps (comma-separated)")
    p.add_argument("--k", type=int, default=DEFAULT_K, help="K: most draft tokens per step")
    p.add_argument("--das", default=None, help="JSON of DASDrafter settings (as benchmarks.replay's --das)")
    p.add_argument("--arctic", default=None, help="JSON of arctic settings (as benchmarks.replay's --arctic)")
    p.add_argument("--json", default=None, help="write the report here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    shadows = [s for s in args.shadows.split(",") if s]
    if args.k < 1 or not shadows:
        print(f"--k must be >= 1 and --shadows name at least one drafter, got --k {args.k} --shadows {args.shadows!r}",
              file=sys.stderr)
        return 2
    try:
        trace = find_trace(args.trace)
    except FileNotFoundError as exc:
        print(f"shadow: {exc}", file=sys.stderr)
        return 2
    CONFIGS.clear()
    try:
        for name, text in (("das", args.das), ("arctic_suffix", args.arctic)):
            if text:
                CONFIGS[name] = json.loads(text)
        report = run(load_trace(trace), args.lead, shadows, args.k)
    except ValueError as e:  # json.JSONDecodeError is one
        print(e, file=sys.stderr)
        return 2
    report["trace"] = str(trace)
    from tabulate import tabulate

    rows = [[name, d["steps"], d["drafting_steps"], d["drafted_tokens"], d["accepted_tokens"], d["drafted_per_accepted"],
             d["accepted_per_step"]] for name, d in report["drafters"].items()]
    print(f"trace: {trace}; K = {args.k}; steps of {args.lead} (its replay: acceptance length "
          f"{report['replay']['acceptance_length']:.3f}, drafted per accepted {report['replay']['drafted_per_accepted']})")
    print(tabulate(rows, ["drafter", "steps", "drafting", "drafted", "accepted", "drafted/acc", "accepted/step"],
                   floatfmt=["", "", "", "", "", ".3f", ".3f"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
