"""A PNG of a replay report (matplotlib): acceptance per iteration, propose latency per drafter."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_png(report: dict[str, Any], path: str | Path) -> Path:
    """Plot ``report`` (from ``benchmarks.replay``) into the PNG ``path``, atomically; returns the path.

    Left: acceptance length per iteration, one line per drafter. Right: propose latency per
    drafter, p99 (light) behind p50 (solid). matplotlib is imported here (Agg backend), so the
    replay runs without it when no plot is asked for.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from integrations.results import save_figure

    drafters = report["drafters"]
    names = list(drafters)
    colors = [f"C{j % 10}" for j in range(len(names))]
    fig, (acc, lat) = plt.subplots(1, 2, figsize=(10, 4))
    for n, c in zip(names, colors):
        ys = [it["acceptance_length"] for it in drafters[n]["iterations"]]
        acc.plot(range(len(ys)), ys, marker="o", color=c, label=n)
    acc.set_title(f"Acceptance length per iteration (K={report['k']})", fontsize=10)
    acc.set_xlabel("iteration")
    acc.set_ylabel("tokens per verification step")
    acc.grid(alpha=0.3)
    if names:
        acc.legend(fontsize=8)
    x = np.arange(len(names))
    lat.bar(x, [drafters[n]["propose_us_p99"] for n in names], 0.6, color=colors, alpha=0.35, label="p99")
    lat.bar(x, [drafters[n]["propose_us_p50"] for n in names], 0.4, color=colors, label="p50")
    lat.set_xticks(x, names)
    lat.set_title("Propose latency (us): p50 solid, p99 light", fontsize=10)
    lat.set_ylabel("us per propose call")
    lat.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path, dpi=100)
