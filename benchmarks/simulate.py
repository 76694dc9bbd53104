"""Long-tail rollout simulator: makespan of one RL rollout iteration under speculation policies.

``python -m benchmarks.simulate [--json PATH] [--plot PATH] [--trace PATH] ...``

Reproduces the DAS paper's setting (DeepSeek-R1-Distill-Qwen-7B, DSR-sub, 16K max tokens,
128 prompts x 16 samples, 8 H100s) as a discrete-event simulation: continuous batching on each
GPU (:mod:`benchmarks._sim_engine`), per-step cost ``c_base + c_tok * n_tokens + c_ctx * context``
with first-principles constants (:func:`benchmarks._sim_workload.h100_7b_costs`), acceptance from
the Eq. 3 model, lengths from a long-tail model (:class:`benchmarks._sim_workload.LengthModel`) or
a rollout trace (``--trace``: its last iteration is simulated, earlier ones are the history).

Policies (:class:`scheduler.SpeculationScheduler`): ``none``; ``unlimited`` (K drafts per row
and step); ``class`` (Long 16, Medium 4, Short 0 on the predictor's run-time class); ``eq7``
(Eq. 7 / Eq. 9 budgets on predicted remaining lengths, estimated acceptance and a cost model fitted
online from the simulated step times). ``<policy>+interleave`` assigns groups to GPUs by LPT on
predicted work instead of round-robin. Extra rows: ``class_gated`` (class budgets only in steps
with at most ``--gate`` = 64 running requests, as the authors' public fork does) and
``eq7_oracle`` (eq7 given the true lengths and acceptance parameters).

JSON: ``paper_setting.<policy>.makespan_s`` (and tokens, steps, drafts, per-GPU makespans ...)
for ``none, unlimited, class, eq7`` and each ``+interleave``; ``setting``, ``costs``,
``lengths``, ``interleave`` (load balance), ``predictor`` (its evaluation on the history).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._sim_engine import GpuResult, SimParams, make_scheduler, simulate_gpu
from benchmarks._sim_workload import AcceptanceModel, LengthModel, h100_7b_costs, length_stats, prompt_lengths
from scheduler import ClassBudget, LengthPredictor, assign_groups, compare_assignments, evaluate_predictor, tokens_per_step

POLICIES = ("none", "unlimited", "class", "eq7")
REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- workload
def synthetic_workload(
    *,
    n_prompts: int = 128,
    n_samples: int = 16,
    max_tokens: int = 16384,
    window: int = 16,
    history_visits: tuple[int, ...] = (1, 2),
    length_model: LengthModel | None = None,
    acceptance_model: AcceptanceModel | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """One iteration's requests plus a predictor fed with synthetic history.

    History: with 1,209 DSR-sub problems and 128 prompts per step, a problem comes back every ~9.4
    steps, so a window of 16 policy versions holds 1 or 2 earlier groups of each current problem
    (``history_visits``, drawn uniformly), at random earlier versions; the other problems of those
    versions (``(window - 1) * n_prompts`` groups) fill the global tables.

    Returns:
        dict with ``lengths`` int ``[P, S]``, ``k``, ``a`` float ``[P, S]``, ``prompts`` int ``[P]``,
        ``problem_ids`` list ``[P]``, ``predictor`` (LengthPredictor), ``max_tokens``, models.
    """
    lm = length_model or LengthModel(max_tokens=max_tokens)
    am = acceptance_model or AcceptanceModel()
    rng = np.random.default_rng(seed)
    mu = lm.sample_problems(n_prompts, rng)
    lengths = lm.sample(mu, n_samples, rng)
    k, a = am.sample(n_prompts, n_samples, rng)
    prompts = prompt_lengths(n_prompts, rng)
    pred = LengthPredictor(max_tokens, window=window)
    now = window  # the simulated iteration's policy version; history is in [1, window - 1]
    n_bg = (window - 1) * n_prompts
    mu_bg = lm.sample_problems(n_bg, rng)
    hist_bg = lm.sample(mu_bg, n_samples, rng)
    for i in range(n_bg):
        pred.observe(f"bg{i}", 1 + i // n_prompts, hist_bg[i])
    pids = [f"p{i}" for i in range(n_prompts)]
    for i, pid in enumerate(pids):
        visits = int(rng.choice(history_visits))
        for v in sorted(rng.choice(np.arange(1, now), size=visits, replace=False)):
            pred.observe(pid, int(v), lm.sample(mu[i : i + 1], n_samples, rng)[0])
    return dict(lengths=lengths, k=k, a=a, prompts=prompts, problem_ids=pids, predictor=pred, max_tokens=max_tokens, length_model=lm.as_dict(), acceptance_model=am.as_dict())


def trace_workload(path: str, max_tokens: int, *, window: int = 16, seed: int = 0, acceptance_model: AcceptanceModel | None = None) -> dict[str, Any]:
    """Workload from a rollout trace (``integrations.trace``): the last iteration is simulated, the
    earlier ones feed the predictor. Groups with fewer samples than the largest are padded by
    repeating their members (the simulator needs equal group sizes)."""
    from integrations.trace import read_trace

    rows = read_trace(path)
    last = max(r.iteration for r in rows)
    pred = LengthPredictor(max_tokens, window=window)
    pred.observe_trace([r for r in rows if r.iteration < last])
    cur: dict[str, list] = {}
    for r in rows:
        if r.iteration == last:
            cur.setdefault(r.problem_id, []).append(r)
    if not cur:
        raise ValueError(f"{path}: no rollouts in its last iteration {last}")
    s = max(len(v) for v in cur.values())
    pids = sorted(cur)
    lengths = np.array([[max(1, min(len(v[j % len(v)].output_ids), max_tokens)) for j in range(s)] for v in (cur[p] for p in pids)], np.int64)
    prompts = np.array([len(cur[p][0].prompt_ids) for p in pids], np.int64)
    rng = np.random.default_rng(seed)
    am = acceptance_model or AcceptanceModel()
    k, a = am.sample(len(pids), s, rng)
    return dict(lengths=lengths, k=k, a=a, prompts=prompts, problem_ids=pids, predictor=pred, max_tokens=max_tokens, length_model={"trace": str(path)}, acceptance_model=am.as_dict())


# ----------------------------------------------------------------------------- one iteration
def group_assignment(work: dict[str, Any], n_gpus: int, interleave: bool) -> np.ndarray:
    """GPU of each group: round-robin, or LPT on predicted group work (``+interleave``)."""
    pred: LengthPredictor = work["predictor"]
    n_p, n_s = work["lengths"].shape
    if not interleave:
        return assign_groups(np.zeros(n_p), n_gpus, "round_robin")
    idx = pred.index(work["problem_ids"])
    expected = pred.predict(idx, np.zeros(n_p)).expected_total * n_s
    b2 = pred.bounds[1]
    n_long = np.array([int(round(n_s * np.mean(h >= b2))) if (h := pred.history_lengths(p)).size else 0 for p in work["problem_ids"]])
    return assign_groups(expected, n_gpus, "lpt", n_long=n_long)


def run_iteration(work: dict[str, Any], policy: str, n_gpus: int, params: SimParams, *, interleave: bool, oracle: bool = False, class_budget: ClassBudget | None = None, seed: int = 0) -> dict[str, Any]:
    """Simulate one iteration on ``n_gpus`` GPUs; returns the policy's summary and per-GPU results."""
    pred: LengthPredictor = work["predictor"]
    assign = group_assignment(work, n_gpus, interleave)
    n_p, n_s = work["lengths"].shape
    pidx = pred.index(work["problem_ids"])
    gpus: list[GpuResult] = []
    for g in range(n_gpus):
        groups = np.flatnonzero(assign == g)
        sched = make_scheduler(policy, pred, params.max_draft, seed=seed + g, class_budget=class_budget)
        gpus.append(
            simulate_gpu(
                work["lengths"][groups].ravel(),
                np.repeat(work["prompts"][groups], n_s),
                work["k"][groups].ravel(),
                work["a"][groups].ravel(),
                np.repeat(pidx[groups], n_s),
                sched,
                params,
                oracle=oracle,
                seed=seed + 1000 + g,
            )
        )
    tokens = sum(r.tokens for r in gpus)
    steps = sum(r.steps for r in gpus)
    return {
        "makespan_s": max(r.makespan_s for r in gpus),
        "per_gpu_makespan_s": [round(r.makespan_s, 3) for r in gpus],
        "mean_gpu_makespan_s": float(np.mean([r.makespan_s for r in gpus])),
        "tokens": tokens,
        "engine_steps_max": max(r.steps for r in gpus),
        "tokens_per_request_step": tokens / max(tokens - sum(r.accepted for r in gpus), 1.0),
        "drafted_tokens": sum(r.drafted for r in gpus),
        "accepted_tokens": sum(r.accepted for r in gpus),
        "preemptions": sum(r.preemptions for r in gpus),
        "cost_fit": [r.cost_fit for r in gpus] if policy == "eq7" else None,
        "_gpus": gpus,
        "_steps_total": steps,
    }


def lower_bound_s(work: dict[str, Any], params: SimParams, speculative: bool) -> float:
    """Sequential lower bound: the longest request alone, ``ceil(l / tau(K)) * c_base`` (``tau = 1``
    without speculation)."""
    l = work["lengths"].astype(np.float64)
    tau = tokens_per_step(np.full(l.shape, params.max_draft if speculative else 0.0), work["k"], work["a"])
    return float(np.max(np.ceil(l / tau)) * params.c_base)


# ----------------------------------------------------------------------------- report
def batch_curve(gpus: list[GpuResult], grid: np.ndarray) -> np.ndarray:
    """Running requests summed over GPUs at each time of ``grid`` (seconds)."""
    total = np.zeros(grid.size)
    for r in gpus:
        if r.rec_t.size == 0:
            continue
        i = np.searchsorted(r.rec_t, grid, side="left")
        total += np.where(i < r.rec_t.size, r.rec_batch[np.minimum(i, r.rec_t.size - 1)], 0)
    return total


def plot(results: dict[str, dict], path: Path, title: str) -> Path | None:
    """PNG of running batch size (all GPUs) over time per policy; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return None
    tmax = max(r["makespan_s"] for r in results.values())
    grid = np.linspace(0, tmax * 1.01, 2000)
    fig, axes = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name, r in results.items():
        style = "--" if name.endswith("+interleave") else "-"
        for ax in axes:
            ax.step(grid, batch_curve(r["_gpus"], grid), style, where="post", label=f"{name} ({r['makespan_s']:.0f} s)", lw=1.2)
    axes[0].set_ylabel("running requests (all GPUs)")
    axes[1].set_yscale("symlog", linthresh=10)
    axes[1].set_ylabel("running requests (log)")
    axes[1].set_xlabel("time (s)")
    axes[0].set_title(title)
    axes[0].legend(fontsize=8, ncol=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summarize_predictor(work: dict[str, Any]) -> dict[str, Any]:
    """Predictor vs baselines on the simulated iteration: history (as version 0) -> this iteration."""
    pred: LengthPredictor = work["predictor"]
    pids: list[str] = []
    vers: list[int] = []
    lens: list[float] = []
    for i, pid in enumerate(work["problem_ids"]):
        for v, x in ((0, pred.history_lengths(pid)), (1, work["lengths"][i])):
            pids += [pid] * len(x)
            vers += [v] * len(x)
            lens += list(map(float, x))
    return evaluate_predictor(pids, vers, lens, work["max_tokens"], bounds=tuple(pred.bounds))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.simulate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write results as JSON here")
    ap.add_argument("--plot", default=str(REPO / "out" / "simulate_batch.png"), help="PNG of running batch size over time ('' or 'none': no plot)")
    ap.add_argument("--trace", type=Path, help="rollout trace (parquet): simulate its last iteration")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--max-draft", type=int, default=16, help="K: most draft tokens per row and step")
    ap.add_argument("--replan-every", type=int, default=16, help="engine steps between budget re-plans")
    ap.add_argument("--class-budget", default="16,4,0", help="Long,Medium,Short drafts per step of 'class'")
    ap.add_argument("--kv-capacity", type=float, help="KV cache tokens per GPU (default: first principles)")
    ap.add_argument("--no-context-cost", action="store_true", help="drop the c_ctx * context term (the paper's Eq. 1 only)")
    ap.add_argument("--step-overhead-ms", type=float, default=1.0, help="per-step overhead in c_base (1 ms: CUDA graphs; eager mode is several ms)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gate", type=int, default=64, help="running-request gate of the extra class_gated row")
    ap.add_argument("--no-extras", action="store_true", help="skip the extra rows class_gated and eq7_oracle")
    args = ap.parse_args(argv)
    for name in ("gpus", "prompts", "samples", "max_tokens", "replan_every"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        long_b, med_b, short_b = (int(x) for x in args.class_budget.split(","))
        class_budget = ClassBudget(long=min(long_b, args.max_draft), medium=min(med_b, args.max_draft), short=min(short_b, args.max_draft))
    except ValueError as e:
        raise SystemExit(f"--class-budget must be three ints 'Long,Medium,Short', got {args.class_budget!r} ({e})")

    t_start = time.perf_counter()
    if args.step_overhead_ms < 0:
        raise SystemExit(f"--step-overhead-ms must be >= 0, got {args.step_overhead_ms}")
    costs = h100_7b_costs(step_overhead_s=args.step_overhead_ms * 1e-3)
    params = SimParams(
        c_base=costs["c_base"],
        c_tok=costs["c_tok"],
        c_ctx=0.0 if args.no_context_cost else costs["c_ctx"],
        kv_capacity_tokens=args.kv_capacity or costs["kv_capacity_tokens"],
        max_draft=args.max_draft,
        replan_every=args.replan_every,
    )
    if args.trace:
        work = trace_workload(str(args.trace), args.max_tokens, seed=args.seed)
        key = "trace_setting"
    else:
        work = synthetic_workload(n_prompts=args.prompts, n_samples=args.samples, max_tokens=args.max_tokens, seed=args.seed)
        key = "paper_setting"
    n_p, n_s = work["lengths"].shape
    names = [p + s for s in ("", "+interleave") for p in POLICIES]
    if not args.no_extras:
        names += ["class_gated", "eq7_oracle"]
    gated = ClassBudget(long=int(class_budget.table[2]), medium=int(class_budget.table[1]), short=int(class_budget.table[0]), max_running=args.gate)
    results: dict[str, dict] = {}
    for name in names:
        policy = name.split("+")[0].replace("_oracle", "").replace("_gated", "")
        results[name] = run_iteration(
            work, policy, args.gpus, params, interleave=name.endswith("+interleave"), oracle=name.endswith("_oracle"),
            class_budget=gated if name.startswith("class_gated") else class_budget, seed=args.seed,
        )  # fmt: skip
    base = results["none"]["makespan_s"]
    for r in results.values():
        r["speedup_vs_none"] = base / r["makespan_s"]
        r["time_saved_vs_none"] = 1.0 - r["makespan_s"] / base

    # interleave: predicted vs true group work
    pred: LengthPredictor = work["predictor"]
    idx = pred.index(work["problem_ids"])
    pw = pred.predict(idx, np.zeros(n_p)).expected_total * n_s
    tw = work["lengths"].sum(axis=1).astype(np.float64)
    tl = (work["lengths"] >= pred.bounds[1]).sum(axis=1)
    inter = compare_assignments(pw, tw, args.gpus, true_long=tl, seed=args.seed)

    out: dict[str, Any] = {
        key: {name: {k: v for k, v in r.items() if not k.startswith("_")} for name, r in results.items()},
        "setting": {
            "model": "DeepSeek-R1-Distill-Qwen-7B (Qwen2.5-7B architecture), bf16",
            "gpu": "H100 SXM 80 GB, one engine per GPU (data parallel)",
            "gpus": args.gpus,
            "prompts": n_p,
            "samples": n_s,
            "max_tokens": work["max_tokens"],
            "max_draft": args.max_draft,
            "replan_every": args.replan_every,
            "class_budget": class_budget.table[::-1].tolist(),
            "max_seqs": params.max_seqs,
            "kv_capacity_tokens": params.kv_capacity_tokens,
            "timing_noise": params.timing_noise,
            "seed": args.seed,
            "step_overhead_ms": args.step_overhead_ms,
            "length_model": work["length_model"],
            "acceptance_model": work["acceptance_model"],
            "tokens_per_step_at": {str(d): float(np.mean(tokens_per_step(np.full(work["k"].shape, float(d)), work["k"], work["a"]))) for d in (1, 2, 4, 8, 16)},
        },
        "costs": {"c_base_s": params.c_base, "c_tok_s": params.c_tok, "c_ctx_s": params.c_ctx, "kv_capacity_tokens": costs["kv_capacity_tokens"], "derivation": costs["derivation"]},
        "lengths": length_stats(work["lengths"], work["max_tokens"]),
        "lower_bound_s": {"none": lower_bound_s(work, params, False), "speculative": lower_bound_s(work, params, True)},
        "interleave": inter,
        "predictor": summarize_predictor(work),
        "wall_s": None,
    }

    want_plot = args.plot and args.plot.lower() != "none"
    title = f"{n_p} prompts x {n_s} samples, {args.gpus} GPUs, max {work['max_tokens']} tokens"
    plot_path = plot({k: v for k, v in results.items() if k in names[:8]}, Path(args.plot), title) if want_plot else None
    out["plot"] = str(plot_path) if plot_path else None
    out["wall_s"] = time.perf_counter() - t_start

    ls = out["lengths"]
    print(f"{key}: {n_p} prompts x {n_s} samples on {args.gpus} GPUs, max {work['max_tokens']} tokens, K={args.max_draft}")
    print(f"lengths: mean {ls['mean']:.0f}, median {ls['median']:.0f}, p90 {ls['p90']:.0f}, at cap {100 * ls['capped_share']:.1f}%")
    print(f"costs: c_base {1e3 * params.c_base:.2f} ms, c_tok {1e6 * params.c_tok:.1f} us/token, c_ctx {1e9 * params.c_ctx:.1f} ns/context token, KV {params.kv_capacity_tokens:.0f} tokens/GPU")
    print(f"{'policy':<22}{'makespan s':>11}{'vs none':>9}{'steps':>8}{'tok/step':>9}{'drafted/tok':>12}{'preempt':>8}")
    for name, r in results.items():
        print(f"{name:<22}{r['makespan_s']:>11.1f}{r['speedup_vs_none']:>8.2f}x{r['engine_steps_max']:>8d}{r['tokens_per_request_step']:>9.2f}{r['drafted_tokens'] / r['tokens']:>12.2f}{r['preemptions']:>8d}")
    lb = out["lower_bound_s"]
    print(f"lower bound (longest request alone): {lb['none']:.1f} s without speculation, {lb['speculative']:.1f} s with K={args.max_draft}")
    print("interleave (true work per GPU, max/mean): " + ", ".join(f"{m} {v['imbalance']:.3f}" for m, v in inter.items()))
    p0 = out["predictor"]["checkpoints"].get("0", {})
    if p0:
        print("predictor MAE at start (tokens): " + ", ".join(f"{m} {v['mae']:.0f}" for m, v in p0.items()) + f"; initial-class accuracy {out['predictor']['class_accuracy']['initial']:.2f}")
    if plot_path:
        print(f"plot: {plot_path}")
    print(f"wall {out['wall_s']:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=float))
        print(f"json: {args.json}")
    return out


if __name__ == "__main__":
    main()
