"""A dependency-free SVG of a replay report: acceptance per iteration, propose latency per drafter."""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]


def _axis(x0, y0, w, h, ymin, ymax, ticks=5, fmt="{:.2f}"):
    out = [f'<line x1="{x0}" y1="{y0 + h}" x2="{x0 + w}" y2="{y0 + h}" stroke="#333"/>',
           f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y0 + h}" stroke="#333"/>']
    for i in range(ticks + 1):
        v = ymin + (ymax - ymin) * i / ticks
        y = y0 + h - h * i / ticks
        out.append(f'<line x1="{x0 - 4}" y1="{y:.1f}" x2="{x0 + w}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{x0 - 8}" y="{y + 4:.1f}" font-size="11" text-anchor="end">{fmt.format(v)}</text>')
    return out


def write_svg(report: dict[str, Any], path: str | Path) -> Path:
    drafters = report["drafters"]
    names = list(drafters)
    W, H = 900, 380
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif">',
             '<rect width="100%" height="100%" fill="white"/>']
    # left: acceptance length per iteration
    x0, y0, w, h = 60, 40, 360, 280
    series = {n: [it["acceptance_length"] for it in drafters[n]["iterations"]] for n in names}
    vals = [v for s in series.values() for v in s] or [1.0]
    ymin, ymax = min(1.0, min(vals)), max(vals) * 1.1
    parts.append(f'<text x="{x0}" y="22" font-size="14">Acceptance length per iteration (K={report["k"]})</text>')
    parts += _axis(x0, y0, w, h, ymin, ymax)
    n_it = max(len(s) for s in series.values()) if series else 1
    for i in range(n_it):
        x = x0 + w * (i + 0.5) / n_it
        parts.append(f'<text x="{x:.1f}" y="{y0 + h + 16}" font-size="11" text-anchor="middle">{i}</text>')
    parts.append(f'<text x="{x0 + w / 2}" y="{y0 + h + 32}" font-size="11" text-anchor="middle">iteration</text>')
    for j, n in enumerate(names):
        c = COLORS[j % len(COLORS)]
        pts = [(x0 + w * (i + 0.5) / n_it, y0 + h - h * (v - ymin) / (ymax - ymin)) for i, v in enumerate(series[n])]
        parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in pts)}"/>')
        for a, b in pts:
            parts.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{c}"/>')
        parts.append(f'<rect x="{x0 + 10}" y="{y0 + 8 + 16 * j}" width="10" height="10" fill="{c}"/>')
        parts.append(f'<text x="{x0 + 26}" y="{y0 + 17 + 16 * j}" font-size="11">{escape(n)}</text>')
    # right: propose latency p50 / p99
    x0 = 500
    lat = {n: (drafters[n]["propose_us_p50"], drafters[n]["propose_us_p99"]) for n in names}
    ymax = max([v for p in lat.values() for v in p] + [1.0]) * 1.1
    parts.append(f'<text x="{x0}" y="22" font-size="14">Propose latency (us): p50 solid, p99 light</text>')
    parts += _axis(x0, y0, w, h, 0.0, ymax, fmt="{:.1f}")
    bw = w / max(len(names), 1)
    for j, n in enumerate(names):
        c = COLORS[j % len(COLORS)]
        p50, p99 = lat[n]
        bx = x0 + bw * j + bw * 0.2
        for v, op, off in ((p99, 0.35, 0), (p50, 1.0, bw * 0.15)):
            bh = h * v / ymax
            parts.append(f'<rect x="{bx + off:.1f}" y="{y0 + h - bh:.1f}" width="{bw * 0.45:.1f}" height="{bh:.1f}" fill="{c}" fill-opacity="{op}"/>')
        parts.append(f'<text x="{bx + bw * 0.3:.1f}" y="{y0 + h + 16}" font-size="11" text-anchor="middle">{escape(n)}</text>')
    parts.append("</svg>")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from integrations.results import write_atomic

    write_atomic(path, "\n".join(parts))
    return path
