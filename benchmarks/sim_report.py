"""Reports of the long-tail simulator (:mod:`benchmarks.simulate`): the printed tables and the validation plot."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.sim_budget import BUDGETS
from benchmarks.sim_placement import PLACEMENTS

_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # Student t, 97.5%, df 1..30


def ci95(x) -> tuple[float, float]:
    """Mean and half-width of the 95% t-interval (0 for a single value)."""
    x = np.asarray(x, np.float64)
    if x.size < 2:
        return float(x.mean()) if x.size else float("nan"), 0.0
    df = x.size - 1
    t = _T975[df - 1] if df <= 30 else 1.96 + 2.4 / df
    return float(x.mean()), float(t * x.std(ddof=1) / np.sqrt(x.size))


def config_name(budget: str, placement: str) -> str:
    """``budget`` at placement none, ``budget+placement`` otherwise (the keys of ``paper_setting``)."""
    return budget if placement == "none" else f"{budget}+{placement}"


def batch_curve(curves, grid: np.ndarray) -> np.ndarray:
    """Running requests summed over GPUs at each time of ``grid`` (seconds)."""
    total = np.zeros(grid.size)
    for t, b in curves:
        if t.size == 0:
            continue
        i = np.searchsorted(t, grid, side="left")
        total += np.where(i < t.size, b[np.minimum(i, t.size - 1)], 0)
    return total


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return None


def plot_validation(table: dict, curves: dict, accept: dict, path: Path, title: str) -> Path | None:
    """Four panels: running requests over time (seed 0; Fig. 1), makespan per budget and placement
    with 95% intervals (Fig. 8), unlimited vs length-aware (Fig. 10), acceptance by position
    (Fig. 4)."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    a = ax[0, 0]
    tmax = max(c["makespan"] for c in curves.values())
    grid = np.linspace(0, tmax * 1.01, 2000)
    for name, c in curves.items():
        a.step(grid, batch_curve(c["curves"], grid), where="post", lw=1.2, label=f"{name} ({c['makespan']:.0f} s)")
    a.set_yscale("symlog", linthresh=10)
    a.set_xlabel("time (s)")
    a.set_ylabel("running requests, all GPUs (log)")
    a.set_title("running requests over time (seed 0)  [paper Fig. 1]")
    a.legend(fontsize=8)
    a = ax[0, 1]
    pols = [p for p in BUDGETS if any(p + s in table for s in ("", "+lpt"))]
    width = 0.8 / len(PLACEMENTS)
    for j, pl in enumerate(PLACEMENTS):
        names = [p if pl == "none" else f"{p}+{pl}" for p in pols]
        m = [table[n]["makespan_s"] if n in table else np.nan for n in names]
        e = [table[n]["makespan_s_ci95"] if n in table else 0 for n in names]
        a.bar(np.arange(len(pols)) + (j - (len(PLACEMENTS) - 1) / 2) * width, m, width, yerr=e, capsize=2, label=f"placement {pl}")
    a.set_xticks(np.arange(len(pols)), pols, fontsize=8)
    a.set_ylabel("makespan (s), mean and 95% interval")
    a.set_title("makespan per speculation budget  [paper Fig. 8]")
    a.legend(fontsize=8)
    a = ax[1, 0]
    names = [n for n in ("fixed", "cost", "makespan", "class-eq9", "class-roofline", "eq7") if n in table]
    for j, pl in enumerate(("none", "split")):
        nm = [n if pl == "none" else f"{n}+{pl}" for n in names]
        m = [table[n]["makespan_s"] if n in table else np.nan for n in nm]
        e = [table[n]["makespan_s_ci95"] if n in table else 0 for n in nm]
        a.bar(np.arange(len(names)) + (j - 0.5) * 0.4, m, 0.4, yerr=e, capsize=3, label=f"placement {pl}")
    a.set_xticks(np.arange(len(names)), names)
    a.set_ylabel("makespan (s)")
    a.set_title("fixed (unlimited budget) vs length-aware drafting  [paper Fig. 10]")
    a.legend(fontsize=8)
    a = ax[1, 1]
    x = np.asarray(accept["position_tokens"]) / 1000
    a.plot(x, accept["tokens_per_step_outside_loops"], "o-", label="outside loops")
    a.plot(x, accept["tokens_per_step_in_loops"], "s-", label="in repetition loops")
    a.plot(x, accept["tokens_per_step_all_rows"], "k^--", label="all rows")
    a.set_xlabel("position in the rollout (K tokens)")
    a.set_ylabel("tokens per step, fixed (drafter's own length; K in loops)")
    a2 = a.twinx()
    a2.bar(x, accept["share_of_steps_in_loops"], width=0.6, alpha=0.2, color="gray")
    a2.set_ylabel("share of steps in loops (bars)")
    a.set_title("acceptance by position  [paper Fig. 4]")
    a.legend(fontsize=8, loc="upper left")
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def print_table(out: dict, key: str, budgets, placements, args) -> None:
    """Print the paper setting's tables and the validation lines of ``out`` (:func:`benchmarks.simulate.main`'s)."""
    from tabulate import tabulate

    table = out[key]
    s = out["setting"]
    ls = out["lengths"]
    roof = out["costs"]["roofline"]
    lin = out["costs"]["eq1_offline_fit"]
    print(f"{key}: {s['prompts']} prompts x {s['samples']} samples on {s['gpus']} GPUs, max {s['max_tokens']} tokens, "
          f"K={s['max_draft']} (batch {s.get('batch_draft', s['max_draft'])}), {s['seeds']} seeds (mean +- 95% t-interval)")
    print(f"lengths (all seeds): mean {ls['mean']:.0f}, median {ls['median']:.0f}, p90 {ls['p90']:.0f}, "
          f"at cap {100 * ls['capped_share']:.1f}% (in a repetition loop: {100 * ls['loop_share']:.1f}% of all rollouts)")
    print(f"roofline step: launch {1e3 * roof['launch_s']:.1f} ms + max(compute at {roof['flops_per_s'] / 1e12:.0f} TFLOP/s, "
          f"memory at {roof['bytes_per_s'] / 1e12:.2f} TB/s); KV {roof['kv_capacity_tokens']} tokens/GPU; "
          f"drafter {s['drafter_ms_per_256']:.2f} ms/step at 256 rows")
    ex = out["costs"]["step_examples"]
    steps = "; ".join(f"{r},{d},{c // 1000}K {ex[f'rows{r}_d{d}_ctx{c}']:.{2 if r == 1 else 1}f}"
                      for r, d, c in ((256, 0, 3000), (256, 4, 3000), (256, 16, 3000), (64, 0, 8000), (64, 16, 8000), (1, 0, 12000), (1, 16, 12000)))
    knees = ", ".join(f"{r} rows x {c // 1000}K {ex[f'knee_draft_tokens_rows{r}_ctx{c}']:.0f}" for r, c in ((256, 3000), (64, 8000), (4, 12000)))
    print(f"decode step ms (rows, drafts/row, context/row): {steps}; free draft tokens (knee): {knees}")
    print(f"Eq. 1 fitted offline to it (class-eq9, the priced budgets' warm-up): c_base {1e3 * lin['c_base']:.2f} ms, "
          f"c_tok {1e6 * lin['c_tok']:.1f} us/token, mean relative error {100 * lin['mean_rel_error']:.0f}% (paper: ~12% on a 7B)")
    heads = ["budget"] + [f"placement {pl}" for pl in placements]
    right = ["left"] + ["right"] * len(placements)

    def cell(p: str, pl: str, fmt: Any) -> str:
        r = table.get(config_name(p, pl))
        return fmt(r) if r else "-"

    def makespan(r: dict) -> str:
        return f"{r['makespan_s']:.1f}+-{r['makespan_s_ci95']:.1f} ({100 * r['cut_vs_none']:+.0f}%)"

    def same_cut(r: dict) -> str:
        return f"{100 * r['cut_vs_none_same_placement']:.1f}+-{100 * r['cut_vs_none_same_placement_ci95']:.1f}%"

    print("makespan s, mean +- 95% interval (cut vs none, placement none)")
    print(tabulate([[p] + [cell(p, pl, makespan) for pl in placements] for p in budgets], heads, colalign=right, disable_numparse=True))
    print("cut vs none at the same placement, mean +- 95% interval")
    print(tabulate([[p] + [cell(p, pl, same_cut) for pl in placements] for p in budgets[1:]], heads, colalign=right, disable_numparse=True))
    for n in [n for n in table if n.endswith(")")]:
        r = table[n]
        base = table.get(n.split(" (")[0], r)
        print(f"extra: {n}: {r['makespan_s']:.1f} +- {r['makespan_s_ci95']:.1f} s ({100 * r['cut_vs_none']:+.0f}%), "
              f"preemptions {r['preemptions']:.1f} (as listed: {base['makespan_s']:.1f} s, {base['preemptions']:.1f})")
    for n, r in table.items():
        c = r.get("cost_fit_gpu0_seed0")
        if c and "knee" in c:
            print(f"online step price of {n} (GPU 0, seed 0, at its end): knee {c['knee']:.0f} tokens verified, c_base {1e3 * c['c_base']:.2f} ms, "
                  f"c_row {1e6 * c['c_row']:.1f} us, c_draft {1e6 * c['c_draft']:.1f} us, c_spec {1e6 * c['c_spec']:.1f} us")
    rows = [[n, *(float(r[k]) for k in ("tokens_per_row_step", "drafted_per_token", "preemptions", "moves"))] for n, r in table.items()]
    print(tabulate(rows, ["budget+placement", "tok/row-step", "drafted/tok", "preempt", "moves"], floatfmt=["", ".2f", ".2f", ".1f", ".1f"]))
    lb = out["lower_bound_s"]
    print(f"lower bound, the longest request alone at one-row step cost (mean over seeds): {lb['none']:.1f} s without drafts, "
          f"{lb['speculative']:.1f} s with them")
    v = out["validation"]
    for sv in (v["shipped_vs_paper"], v["shipped_vs_roofline"]):
        if "shipped_cut_vs_other" in sv:
            print(f"the product ships {sv['shipped']!r} (das.config.DASConfig.budget): cut {100 * sv['shipped_cut_vs_none']:.1f}% vs none, "
                  f"{sv['other']} {100 * sv['other_cut_vs_none']:.1f}%; {sv['shipped']} makespan {100 * sv['shipped_cut_vs_other']:+.1f}% "
                  f"+- {100 * sv['shipped_cut_vs_other_ci95']:.1f} shorter than {sv['other']}'s (paired per seed)")
    f8 = v["fig8_makespan"]
    if f8["best_length_aware"]:
        print(f"validation Fig. 8: best length-aware {f8['best_length_aware']}: cut {100 * f8['best_cut']:.1f}% +- "
              f"{100 * f8['best_cut_ci95']:.1f} vs none (paper: > 50%)")
    for pl, f in v["fig10_unlimited_vs_length_aware"]["simulator"].items():
        print(f"validation Fig. 10 (placement {pl}): {f['unlimited']} slower than {f['best_length_aware']} by "
              f"{100 * f['unlimited_slower_by']:.1f}% +- {100 * f['unlimited_slower_by_ci95']:.1f} (paper: up to 15%)")
    for name, f in v["fig1_running_requests"]["simulator"].items():
        print(f"validation Fig. 1 ({name}, seed 0): batch below 50% at {f['t_below_50pct_s']:.0f} s, below 10% at {f['t_below_10pct_s']:.0f} s "
              f"(steps {f['steps_below_50pct_on_last_gpu']} / {f['steps_below_10pct_on_last_gpu']} of {f['steps_on_last_gpu']} on the last GPU); "
              f"{100 * f['tail_share_below_10pct']:.0f}% of the makespan below 10%")
    acc = v["fig4_acceptance"]["simulator"]
    if acc:
        sib = acc["tokens_per_step_by_finished_siblings"]
        pos = acc["position_tokens"]
        k_fixed = min(s["max_draft"], s.get("batch_draft", s["max_draft"]))
        print(f"validation Fig. 4 (fixed, K={k_fixed}): tokens per step outside loops {acc['overall_tokens_per_step_outside_loops']:.2f}, "
              f"in loops {acc['overall_tokens_per_step_in_loops']:.2f}; by finished siblings on the engine ("
              + ", ".join(f"{c}: {x:.2f}" for c, x in enumerate(sib) if c % 5 == 0 or c == len(sib) - 1)
              + "); all rows by position (K tokens): "
              + ", ".join(f"{p / 1000:.1f}: {x:.2f}" for j, (p, x) in enumerate(zip(pos, acc["tokens_per_step_all_rows"])) if j % 3 == 0 or j == len(pos) - 1))
    if out.get("plot"):
        print(f"plot: {out['plot']}")
