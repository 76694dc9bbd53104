"""Scale sweep of the long-tail simulator: 8 to 2048 GPUs, 1 to 64 rollouts per GPU.

For every point (``n_gpus``, ``per_gpu``) one iteration of ``n_gpus * per_gpu`` rollouts (groups of
16 samples, fewer when there are fewer rollouts) is drawn from the same length and acceptance
models as the paper setting, placed with ``split`` (siblings dealt over the GPUs: with fewer than
16 rollouts per GPU a group cannot sit on one GPU anyway) and run under ``none``, ``fixed``
and ``class-roofline``, with the drafter's CPU time (``drafter_ms_per_256`` per step at 256 rows,
linear in rows) on every speculative step.

Pruning: a GPU's makespan depends only on its own requests (no rebalancing here), and the
iteration's makespan is the largest, so only the GPUs that can be the largest are simulated: the
``top`` GPUs by each of two cheap estimates (the no-speculation time, a sum of roofline steps over
the GPU's running batch; and the most decode steps any of its requests needs at its natural draft
rate). ``check_pruning`` compares this with simulating every GPU.

Break-even drafter time: to first order a speculative makespan grows by ``x * R`` when the drafter
costs ``x`` ms per step at 256 rows (``R`` = sum over the critical GPU's steps of rows / 256, in
seconds per ms), so DAS stops paying at ``x* = x0 + (T_none - T_das) / R``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.sim_budget import make_sim_budget
from benchmarks.sim_engine import EngineParams
from benchmarks.sim_placement import run_cluster
from benchmarks.sim_workload import AcceptanceModel, LengthModel, prompt_lengths
from scheduler.placement import route_rollouts

SWEEP_GPUS = (8, 32, 128, 512, 2048)
SWEEP_PER_GPU = (1, 4, 16, 64)
SWEEP_BUDGETS = ("none", "fixed", "class-roofline")


def _workload(n_gpus: int, per_gpu: int, am: AcceptanceModel, max_tokens: int, seed: int) -> dict[str, Any]:
    total = n_gpus * per_gpu
    s = min(16, total)
    p = total // s
    lm = LengthModel(max_tokens=max_tokens)
    rng = np.random.default_rng(10_000 + seed)
    mu = lm.sample_problems(p, rng)
    lengths, loop_at = lm.sample_detail(mu, s, rng)
    k, a = am.sample(p, s, rng)
    prompts = prompt_lengths(p, rng)
    return dict(lengths=lengths, loop_at=loop_at, k=k, a=a, prompts=prompts, mu=mu, lm=lm, rng=rng, max_tokens=max_tokens, acceptance_model=am)


def _estimates(w: dict, gpu_of: np.ndarray, n_gpus: int, params: EngineParams) -> tuple[np.ndarray, np.ndarray]:
    """Per GPU: no-speculation time estimate (s) and the most steps a request needs at its natural
    draft rate."""
    roof = params.roof
    L = w["lengths"].ravel().astype(np.float64)
    loop = np.minimum(w["loop_at"].ravel(), L)
    am: AcceptanceModel = w["acceptance_model"]
    from scheduler.acceptance import tokens_per_step

    kk = w["k"].ravel()
    tau_row = tokens_per_step(np.arange(params.max_draft + 1.0)[None, :], kk[:, None], np.minimum(w["a"].ravel(), 1.0 / kk)[:, None])
    d = min(float(params.max_draft), am.natural_draft)
    d0 = int(d)
    tau = tau_row[:, d0] + (d - d0) * (tau_row[:, min(d0 + 1, params.max_draft)] - tau_row[:, d0])
    spec_steps = loop / tau + (L - loop) / am.loop_tau(params.max_draft)[-1]
    grid = np.linspace(0, w["max_tokens"], 65)[:-1] + 0.5 * w["max_tokens"] / 64
    t_none = np.zeros(n_gpus)
    spec = np.zeros(n_gpus)
    order = np.argsort(gpu_of, kind="stable")
    bounds = np.searchsorted(gpu_of[order], np.arange(n_gpus + 1))
    for g in range(n_gpus):
        idx = order[bounds[g] : bounds[g + 1]]
        if idx.size == 0:
            continue
        lg = L[idx]
        rows = (lg[None, :] > grid[:, None]).sum(axis=1).astype(np.float64)
        ctx = np.minimum(lg[None, :], grid[:, None]).sum(axis=1)
        dt = np.where(rows > 0, roof.step_time(rows, rows * np.maximum(ctx / np.maximum(rows, 1), 1), ctx + rows), 0.0)
        t_none[g] = float(dt.sum() * w["max_tokens"] / 64)
        spec[g] = float(spec_steps[idx].max())
    return t_none, spec


def _sub_work(w: dict, rows: np.ndarray, rng: np.random.Generator) -> dict:
    """The workload dict of ``benchmarks.simulate`` for the requests ``rows`` only (flat indices of
    ``w``), with a predictor fed with synthetic history of their problems."""
    from benchmarks.sim_workload import build_predictor

    p, s = w["lengths"].shape
    probs = np.unique(rows // s)
    pids = [f"p{i}" for i in probs]
    pred = build_predictor(w["lm"], w["mu"][probs], pids, w["max_tokens"], rng, bg_groups=128, n_samples=s)
    idx_full = np.full(p, -1, np.int64)
    idx_full[probs] = pred.index(pids)
    return dict(lengths=w["lengths"], loop_at=w["loop_at"], k=w["k"], a=w["a"], prompts=w["prompts"], predictor=pred, problem_index=idx_full, acceptance_model=w["acceptance_model"], max_tokens=w["max_tokens"])


def _requests(sub: dict, params: EngineParams, rows: np.ndarray):
    from benchmarks.sim_engine import Requests

    p, s = sub["lengths"].shape
    am: AcceptanceModel = sub["acceptance_model"]
    k = sub["k"].ravel()[rows]
    a = sub["a"].ravel()[rows]
    static = dict(
        length=sub["lengths"].ravel()[rows].astype(np.float64),
        prompt=np.repeat(sub["prompts"], s)[rows].astype(np.float64),
        loop_at=sub["loop_at"].ravel()[rows].astype(np.float64),
        group=(rows // s).astype(np.int64),
        problem_idx=sub["problem_index"][rows // s],
        k=k,
        a=a,
        tau_tab=am.tau_table(k, a, s, params.max_draft),
        tau_loop=am.loop_tau(params.max_draft),
        nat_draft=float(am.natural_draft),
    )
    return lambda: Requests(**static)


def run_point(n_gpus: int, per_gpu: int, params: EngineParams, linear: dict, am: AcceptanceModel, *, seed: int, max_tokens: int, top: int = 6, budgets=SWEEP_BUDGETS, all_gpus: bool = False) -> dict[str, Any]:
    """One sweep point, one seed: makespan per speculation budget, and the break-even drafter time."""
    w = _workload(n_gpus, per_gpu, am, max_tokens, seed)
    p, s = w["lengths"].shape
    gpu_of = route_rollouts(np.full(p, s), n_gpus, "interleaved")  # placement split
    if all_gpus or n_gpus <= 2 * top:
        chosen = np.arange(n_gpus)
    else:
        t_none, spec = _estimates(w, gpu_of, n_gpus, params)
        chosen = np.union1d(np.argsort(-t_none)[:top], np.argsort(-spec)[:top])
    rows = np.flatnonzero(np.isin(gpu_of, chosen))
    sub = _sub_work(w, rows, np.random.default_rng(20_000 + seed))
    fresh = _requests(sub, params, rows)
    local_gpu = gpu_of[rows]
    out: dict[str, Any] = {"simulated_gpus": int(chosen.size)}
    for pol in budgets:
        req = fresh()

        def factory(g: int, pol=pol):
            return make_sim_budget(pol, sub["predictor"], params.max_draft, linear, seed=seed * 1009 + g, batch_draft=params.batch_draft)

        gpus, _ = run_cluster(req, local_gpu, n_gpus, factory, params, gpu_ids=chosen, seed=seed)
        crit = max(gpus, key=lambda g: g.makespan_s)
        rec = crit.records()
        out[pol] = {"makespan_s": crit.makespan_s, "critical_rows_sum_per_256": float(rec["b"].sum() / 256.0), "steps": int(crit.off)}
    return out


def run_sweep(params: EngineParams, linear: dict, am: AcceptanceModel, *, seeds: int = 3, max_tokens: int = 16384, gpus=SWEEP_GPUS, per_gpu=SWEEP_PER_GPU, plot_path: Path | None = None) -> dict[str, Any]:
    """The whole grid; returns ``{"points": [...], "pruning_check": {...}}`` (means and 95%
    intervals over seeds)."""
    from benchmarks.sim_report import ci95

    t0 = time.perf_counter()
    points = []
    x0 = params.drafter_ms_per_256
    for n_g in gpus:
        for r in per_gpu:
            runs = [run_point(n_g, r, params, linear, am, seed=s, max_tokens=max_tokens) for s in range(seeds)]
            row: dict[str, Any] = {"gpus": n_g, "per_gpu": r, "rollouts": n_g * r, "simulated_gpus": runs[0]["simulated_gpus"]}
            base = np.array([x["none"]["makespan_s"] for x in runs])
            row["none_s"], row["none_s_ci95"] = ci95(base)
            for pol in SWEEP_BUDGETS[1:]:
                m = np.array([x[pol]["makespan_s"] for x in runs])
                row[f"{pol}_s"], row[f"{pol}_s_ci95"] = ci95(m)
                row[f"{pol}_cut"], row[f"{pol}_cut_ci95"] = ci95(1.0 - m / base)
                be = np.array([x0 + (b - x[pol]["makespan_s"]) / max(x[pol]["critical_rows_sum_per_256"] * 1e-3, 1e-12) for b, x in zip(base, runs)])
                row[f"{pol}_breakeven_drafter_ms_per_256"] = ci95(be)[0]
                row[f"{pol}_drafter_share"] = float(np.mean([x[pol]["critical_rows_sum_per_256"] * 1e-3 * x0 / x[pol]["makespan_s"] for x in runs]))
            points.append(row)
            print(f"  sweep {n_g:5d} GPUs x {r:3d}/GPU: none {row['none_s']:6.1f} s, class-roofline cut {100 * row['class-roofline_cut']:5.1f}% ({time.perf_counter() - t0:.0f} s)", flush=True)
    check = pruning_check(params, linear, am, max_tokens=max_tokens)
    out = {"points": points, "pruning_check": check, "seeds": seeds, "drafter_ms_per_256": x0, "placement": "split", "wall_s": time.perf_counter() - t0}
    if plot_path is not None:
        pp = plot_sweep(points, plot_path)
        out["plot"] = str(pp) if pp else None
    return out


def pruning_check(params: EngineParams, linear: dict, am: AcceptanceModel, *, max_tokens: int, n_gpus: int = 64, per_gpu: int = 16) -> dict[str, Any]:
    """Makespans with pruning against simulating every GPU at one point (seed 0)."""
    pr = run_point(n_gpus, per_gpu, params, linear, am, seed=0, max_tokens=max_tokens)
    full = run_point(n_gpus, per_gpu, params, linear, am, seed=0, max_tokens=max_tokens, all_gpus=True)
    return {"gpus": n_gpus, "per_gpu": per_gpu, **{p: {"pruned_s": pr[p]["makespan_s"], "all_gpus_s": full[p]["makespan_s"]} for p in SWEEP_BUDGETS}}


def print_sweep(sw: dict) -> None:
    print(
        f"sweep (placement split, {sw['seeds']} seeds, drafter {sw['drafter_ms_per_256']} ms/step at 256 rows): makespan s, cut vs none, "
        "break-even drafter ms/step at 256 rows, drafter share of class-roofline's makespan"
    )
    from tabulate import tabulate

    rows = [[r["gpus"], r["per_gpu"], f"{r['none_s']:.1f}+-{r['none_s_ci95']:.1f}", f"{100 * r['fixed_cut']:.1f}+-{100 * r['fixed_cut_ci95']:.1f}%",
             f"{100 * r['class-roofline_cut']:.1f}+-{100 * r['class-roofline_cut_ci95']:.1f}%", float(r["class-roofline_breakeven_drafter_ms_per_256"]),
             f"{100 * r['class-roofline_drafter_share']:.2f}%"] for r in sw["points"]]
    print(tabulate(rows, ["GPUs", "per GPU", "none s", "fixed", "class-roofline", "break-even ms", "drafter share"], floatfmt=".0f",
                   colalign=["right"] * 7))
    c = sw["pruning_check"]
    print(f"pruning check ({c['gpus']} GPUs x {c['per_gpu']}): " + ", ".join(f"{p} {c[p]['pruned_s']:.1f} vs {c[p]['all_gpus_s']:.1f} s" for p in SWEEP_BUDGETS))


def plot_sweep(points: list[dict], path: Path) -> Path | None:
    from benchmarks.sim_report import pyplot

    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
    per = sorted({p["per_gpu"] for p in points})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, r in enumerate(per):
        col = colors[j % len(colors)]
        pts = sorted((p for p in points if p["per_gpu"] == r), key=lambda p: p["gpus"])
        x = [p["gpus"] for p in pts]
        ax[0].errorbar(x, [100 * p["class-roofline_cut"] for p in pts], yerr=[100 * p["class-roofline_cut_ci95"] for p in pts], marker="o", capsize=3, color=col, label=f"{r} rollouts/GPU")
        ax[1].errorbar(x, [p["none_s"] for p in pts], yerr=[p["none_s_ci95"] for p in pts], marker="o", capsize=3, color=col, label=f"none, {r}/GPU")
        ax[1].errorbar(x, [p["class-roofline_s"] for p in pts], yerr=[p["class-roofline_s_ci95"] for p in pts], marker="s", ls="--", capsize=3, color=col, label=f"class-roofline, {r}/GPU")
        ax[2].plot(x, [p["class-roofline_breakeven_drafter_ms_per_256"] for p in pts], marker="o", color=col, label=f"{r} rollouts/GPU")
    for a in ax:
        a.set_xscale("log", base=2)
        a.set_xlabel("GPUs")
    ax[0].set_ylabel("makespan cut vs none (%), 95% interval")
    ax[0].set_title("class-roofline cut (placement split)")
    ax[0].legend(fontsize=8)
    ax[1].set_ylabel("makespan (s)")
    ax[1].set_title("makespan")
    ax[1].legend(fontsize=6, ncol=2)
    ax[2].set_yscale("log")
    ax[2].set_ylabel("drafter ms per step at 256 rows")
    ax[2].set_title("break-even drafter CPU time")
    ax[2].legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
