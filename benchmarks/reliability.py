"""Reliability diagram of DAS's draft-token probabilities: predicted against accepted.

``python -m benchmarks.reliability --out PNG [--replay JSON ...] [--rollout JSON ...]`` plots, per
probability bin, the mean path probability the drafter gave its draft tokens (x) against the
fraction of them the policy accepted (y), from

* a replay report (``python -m benchmarks.replay --json``): ``drafters.das.calibration``: raw
  probabilities, and the online-calibrated ones the ``cost`` budget would have priced
  (``calibrated_prob``) where the report has them;
* a das-rollout report (``das-rollout --json``): the proposer's own reliability bins
  (``methods.das.iterations[-1].proposer.reliability``, :class:`scheduler.acceptance.AcceptanceCalibration`),
  learned from the engine's accept / reject outcomes (exponentially forgotten, so they describe
  the last ~1,000 drafting steps).

A calibrated drafter's points lie on the diagonal.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from integrations.results import save_figure


def replay_points(report: dict[str, Any]) -> list[tuple[str, list[float], list[float], list[float]]]:
    """``(label, predicted, observed, trials)`` series of a replay report (raw, and calibrated if present)."""
    bins = report.get("drafters", {}).get("das", {}).get("calibration") or []
    out = []
    if bins:
        out.append(("replay, raw", [b["mean_prob"] for b in bins], [b["accepted_rate"] for b in bins], [b["drafted"] for b in bins]))
        if all("calibrated_prob" in b for b in bins):
            out.append(("replay, calibrated online", [b["calibrated_prob"] for b in bins], [b["accepted_rate"] for b in bins],
                        [b["drafted"] for b in bins]))
    return out


def rollout_points(report: dict[str, Any]) -> list[tuple[str, list[float], list[float], list[float]]]:
    """``(label, predicted, observed, trials)`` series of a das-rollout report's DAS proposer (raw and calibrated)."""
    its = report.get("methods", {}).get("das", {}).get("iterations") or []
    bins = ((its[-1] if its else {}).get("proposer") or {}).get("reliability") or []
    if not bins:
        return []
    obs, n = [b["observed"] for b in bins], [b["trials"] for b in bins]
    return [("engine, raw", [b["predicted"] for b in bins], obs, n), ("engine, calibrated", [b["calibrated"] for b in bins], obs, n)]


def plot(series: list[tuple[str, list[float], list[float], list[float]]], out: str | Path, title: str = "") -> Path:
    """Write the reliability diagram of ``series`` to ``out`` (PNG); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--", label="calibrated")
    for label, x, y, n in series:
        top = max(max(n), 1.0)
        ax.plot(x, y, marker="o", lw=1.2, label=label)
        ax.scatter(x, y, s=[20 + 120 * v / top for v in n], alpha=0.3)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("predicted acceptance (path probability of the draft token)")
    ax.set_ylabel("accepted fraction")
    ax.set_title(title or "DAS draft tokens: reliability")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return save_figure(fig, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.reliability", description=__doc__.split("\n\n")[0])
    p.add_argument("--replay", action="append", default=[], help="a replay report (JSON); repeatable")
    p.add_argument("--rollout", action="append", default=[], help="a das-rollout report (JSON); repeatable")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    series = []
    for kind, paths, points in (("replay", args.replay, replay_points), ("rollout", args.rollout, rollout_points)):
        for path in paths:
            try:
                report = json.loads(Path(path).read_text())
            except (OSError, json.JSONDecodeError) as exc:
                p.error(f"--{kind} {path}: {exc}")
            got = points(report)
            if not got:
                p.error(f"--{kind} {path}: no DAS reliability bins in it")
            tag = Path(path).stem
            series += [(f"{tag}: {label}", x, y, n) for label, x, y, n in got]
    if not series:
        p.error("give at least one --replay or --rollout report")
    print(f"wrote {plot(series, args.out, args.title)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
