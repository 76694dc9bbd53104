"""Long-tail simulator: makespan of one RL rollout iteration under speculation budgets and placements.

``python -m benchmarks.simulate [--seeds N] [--json PATH] [--plot PATH] [--trace PATH] [--sweep] ...``

The DAS paper's setting (DeepSeek-R1-Distill-Qwen-7B, DSR-sub, 16K max tokens, 128 prompts x 16
samples, 8 H100s, one vLLM engine per GPU) as a discrete-event simulation, repeated over ``--seeds``
workloads (default 5): every figure is a mean over seeds with a 95% t-interval.

* Engine (:mod:`benchmarks.sim_engine`): continuous batching, vLLM-like KV admission and recompute
  preemption, roofline step cost ``launch + max(compute, memory)`` (:class:`Roofline`, H100 SXM
  spec-sheet rates and the model's config), the drafter's CPU time per step (``--drafter-ms-per-256``).
* Workload (:mod:`benchmarks.sim_workload`): long-tail lengths with repetition loops to the cap;
  acceptance that depends on the request's state (base Eq. 3 parameters, finished siblings on the
  same engine, loops).
* Speculation budgets (``--budgets``, also ``--policies``; the scheduler's own classes, :mod:`scheduler.budgets`, one
  instance per GPU through :mod:`benchmarks.sim_budget`): ``none``, ``fixed`` (the paper's
  unlimited draft budget), ``cost`` (the product's default: the draft tokens that pay at the step's
  price) and ``makespan``, priced as in the product by the step price fitted online to the GPU's
  step times (:class:`scheduler.step_price.StepPrice`: it learns the roofline's knee), with
  candidates' probabilities from the acceptance model (``--price-ablations``: also priced by the
  Eq. 1 line fitted offline, and by the roofline's own price); ``class-eq9`` (the published class
  policy), ``class-roofline`` (ours), ``eq7`` (Eq. 7 / 9 per request); all speculative ones KV-aware.
  The budget the product ships is :class:`das.config.DASConfig`'s default (``shipped_budget``).
* Placements (:mod:`benchmarks.sim_placement`): ``none``, ``lpt``, ``split``, ``rebalance``.

JSON: ``paper_setting.<budget>[+<placement>]`` (no suffix: placement ``none``) with ``makespan_s``
(mean over seeds), ``makespan_s_ci95`` (half-width of the 95% t-interval, seconds), ``seeds``
(how many), ``makespan_s_per_seed``, ``cut_vs_none`` (paired, per seed, against ``none`` without
placement) and its ``cut_vs_none_ci95``, tokens, drafts, preemptions, moves ...; ``validation``
(the paper's Figs. 1, 4, 8, 10 against the simulator's; ``shipped_vs_paper`` and
``shipped_vs_roofline``: the shipped budget against ``class-eq9`` and ``class-roofline``, paired
per seed), ``setting``, ``costs``, ``lengths``,
``ablations`` (with ``--ablations``) and ``sweep`` (with ``--sweep``, :mod:`benchmarks.sim_sweep`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.sim_budget import BUDGETS, make_sim_budget
from benchmarks.sim_engine import DONE, EngineParams, Requests
from benchmarks.sim_placement import PLACEMENTS, assign, run_cluster
from benchmarks.sim_report import batch_curve, ci95, config_name, plot_validation, print_table
from benchmarks.sim_workload import AcceptanceModel, LengthModel, build_predictor, fit_linear_cost, h100_7b_roofline, length_stats, prompt_lengths
from das.config import DASConfig
from scheduler import budgets
from scheduler.budget_protocol import PricedBudget
from scheduler.length_classes import DAS_GATE, DAS_QUOTA
from scheduler.predictor import LengthPredictor

REPO = Path(__file__).resolve().parents[1]
LENGTH_AWARE = tuple(n for n in BUDGETS if budgets.BUDGETS[n].length_aware)  # budgets that read the length predictor
SHIPPED = DASConfig().budget  # the budget the product ships (its default)
PAPER_BUDGET = "class-eq9"  # DAS's deployed policy as published

# two-sided 95% quantiles of Student's t, df = 1..30
# ----------------------------------------------------------------------------- workload
def synthetic_workload(
    *,
    n_prompts: int = 128,
    n_samples: int = 16,
    max_tokens: int = 16384,
    window: int = 16,
    length_model: LengthModel | None = None,
    acceptance_model: AcceptanceModel | None = None,
    seed: int = 0,
    with_predictor: bool = True,
) -> dict[str, Any]:
    """One iteration's requests (and a predictor fed with synthetic history).

    Returns:
        dict with ``lengths`` int ``[P, S]``, ``loop_at`` float ``[P, S]`` (inf: no loop), ``k``,
        ``a`` float ``[P, S]``, ``prompts`` int ``[P]``, ``problem_ids``, ``mu`` (log-medians),
        ``predictor``, ``max_tokens``, the models.
    """
    lm = length_model or LengthModel(max_tokens=max_tokens)
    am = acceptance_model or AcceptanceModel()
    rng = np.random.default_rng(seed)
    mu = lm.sample_problems(n_prompts, rng)
    lengths, loop_at = lm.sample_detail(mu, n_samples, rng)
    k, a = am.sample(n_prompts, n_samples, rng)
    prompts = prompt_lengths(n_prompts, rng)
    pids = [f"p{i}" for i in range(n_prompts)]
    pred = build_predictor(lm, mu, pids, max_tokens, rng, window=window, bg_groups=min(n_prompts, 128), n_samples=n_samples) if with_predictor else None
    return dict(lengths=lengths, loop_at=loop_at, k=k, a=a, prompts=prompts, problem_ids=pids, mu=mu, predictor=pred, max_tokens=max_tokens, length_model=lm, acceptance_model=am)


def trace_workload(path: str, max_tokens: int, *, window: int = 16, seed: int = 0, acceptance_model: AcceptanceModel | None = None) -> dict[str, Any]:
    """Workload from a rollout trace (``integrations.data.trace``): the last iteration is simulated, the
    earlier ones feed the predictor. Groups with fewer samples than the largest are padded by
    repeating their members (the simulator needs equal group sizes). Loops are not detected in a
    trace (``loop_at`` = inf): its acceptance is the base model's."""
    from integrations.data.trace import read_trace

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
    return dict(lengths=lengths, loop_at=np.full(lengths.shape, np.inf), k=k, a=a, prompts=prompts, problem_ids=pids, mu=None, predictor=pred, max_tokens=max_tokens, length_model={"trace": str(path)}, acceptance_model=am)


def requests_factory(work: dict[str, Any], params: EngineParams, rows: np.ndarray | None = None):
    """A function returning fresh :class:`Requests` (state reset, static arrays shared) for the
    flat request indices ``rows`` of ``work`` (default all)."""
    P, S = work["lengths"].shape
    rows = np.arange(P * S) if rows is None else np.asarray(rows, np.int64)
    am: AcceptanceModel = work["acceptance_model"]
    K = params.max_draft
    pidx = work["predictor"].index(work["problem_ids"]) if work.get("predictor") is not None else np.full(P, -1)
    static = dict(
        length=work["lengths"].ravel()[rows].astype(np.float64),
        prompt=np.repeat(work["prompts"], S)[rows].astype(np.float64),
        loop_at=work["loop_at"].ravel()[rows].astype(np.float64),
        group=(rows // S).astype(np.int64),
        problem_idx=np.repeat(pidx, S)[rows].astype(np.int64),
        k=work["k"].ravel()[rows],
        a=work["a"].ravel()[rows],
        tau_tab=am.tau_table(work["k"].ravel()[rows], work["a"].ravel()[rows], S, K),
        tau_loop=am.loop_tau(K),
        nat_draft=float(am.natural_draft),
    )
    return lambda: Requests(**static)


# ----------------------------------------------------------------------------- one run
def run_config(work, fresh, budget: str, placement: str, n_gpus: int, params: EngineParams, linear_cost: dict, *, seed: int = 0, keep: bool = False, kv_aware: bool = True, gate: int | None = None, price: str = "online") -> dict[str, Any]:
    """One iteration under speculation budget ``budget`` and ``placement``; returns its summary. ``price``: of a priced budget (:class:`benchmarks.sim_budget.SimBudget`)."""
    req = fresh()
    P, S = work["lengths"].shape
    pred = work["predictor"]
    gpu_of = assign(P, S, n_gpus, placement, pred, work["problem_ids"])
    def factory(g: int):
        b = make_sim_budget(budget, pred, params.max_draft, linear_cost, seed=seed * 1009 + g, kv_aware=kv_aware, price=price,
                            batch_draft=params.batch_draft)
        if gate is not None:
            b.gate = gate
        return b

    gpus, info = run_cluster(req, gpu_of, n_gpus, factory, params, placement=placement, predictor=pred, seed=seed)
    tokens = float(req.gen.sum())
    out = {
        "makespan_s": max(g.makespan_s for g in gpus),
        "per_gpu_makespan_s": [round(g.makespan_s, 3) for g in gpus],
        "tokens": tokens,
        "engine_steps_max": max(g.off for g in gpus),
        "tokens_per_row_step": tokens / max(float(req.steps.sum()), 1.0),
        "drafted_per_token": float(req.drafted.sum()) / tokens,
        "accepted_per_token": float(req.accepted.sum()) / tokens,
        "preemptions": sum(g.preemptions for g in gpus),
        "moves": info["moves"],
        "_stats_pos": info["stats_pos"],
        "_stats_sib": info["stats_sib"],
    }
    fit = gpus[0].budget.cost_fit()
    if fit is not None:
        out["cost_fit_gpu0"] = fit
    if keep:
        out["_curves"] = [(g.records()["t"], g.records()["b"]) for g in gpus]
        out["_finish"] = req.finish.copy()
        out["_length"] = req.length.copy()
    if not np.all(req.status == DONE):
        raise RuntimeError("unfinished requests")
    return out


def lower_bound_s(work: dict[str, Any], params: EngineParams, speculative: bool) -> float:
    """A lower bound on the makespan: the longest request alone on an idle GPU, every step priced
    as a one-row step with an empty KV cache (launch + weights read), advancing one token per step
    without drafts, or with the most its state allows (natural drafts with every sibling finished
    outside its loop, K drafts in it). No drafter time."""
    roof = params.roof
    L = work["lengths"].ravel().astype(np.float64)
    i = int(np.argmax(L))
    t1 = roof.decode_step_time(1, 0, 0)
    if not speculative:
        return float(L[i] * t1)
    am: AcceptanceModel = work["acceptance_model"]
    S = work["lengths"].shape[1]
    d = min(float(params.max_draft), am.natural_draft)
    row = am.tau_table(work["k"].ravel()[i : i + 1], work["a"].ravel()[i : i + 1], S, params.max_draft)[0, -1]
    tau = float(np.interp(d, np.arange(row.size), row))
    lp = min(float(work["loop_at"].ravel()[i]), L[i])
    return float((lp / tau + (L[i] - lp) / am.loop_tau(params.max_draft)[-1]) * t1)


# ----------------------------------------------------------------------------- curves and validation
def collapse_stats(curves, n_requests: int, makespan: float) -> dict[str, float]:
    """When the running batch (all GPUs) falls below 50% / 10% of the requests: in seconds, and in
    decode steps of the GPU that finishes last; the share of the makespan spent below 10%."""
    grid = np.linspace(0, makespan, 4001)
    run = batch_curve(curves, grid)
    crit_t = max((c[0] for c in curves), key=lambda t: t[-1] if t.size else 0.0)
    out: dict[str, float] = {}
    for f in (0.5, 0.1):
        below = np.flatnonzero(run < f * n_requests)
        t_f = float(grid[below[0]]) if below.size else makespan
        out[f"t_below_{int(f * 100)}pct_s"] = t_f
        out[f"steps_below_{int(f * 100)}pct_on_last_gpu"] = int(np.searchsorted(crit_t, t_f))
    out["steps_on_last_gpu"] = int(crit_t.size)
    out["tail_share_below_10pct"] = 1.0 - out["t_below_10pct_s"] / makespan if makespan > 0 else 0.0
    return out


def acceptance_profile(stats_pos: np.ndarray, stats_sib: np.ndarray, max_tokens: int) -> dict[str, Any]:
    """Tokens per step and acceptance per drafted token by position (outside / inside loops) and by
    finished siblings, from the engine's counters."""

    def rows(st):
        steps, dr, acc = st[..., 0], st[..., 1], st[..., 2]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(steps > 0, 1.0 + acc / np.maximum(steps, 1), np.nan), np.where(dr > 0, acc / np.maximum(dr, 1), np.nan), steps

    bins = (np.arange(stats_pos.shape[1]) + 0.5) * max_tokens / stats_pos.shape[1]
    tps, rate, steps = rows(stats_pos)
    stps, srate, ssteps = rows(stats_sib)
    out = {
        "position_tokens": bins.tolist(),
        "tokens_per_step_outside_loops": tps[0].tolist(),
        "tokens_per_step_in_loops": tps[1].tolist(),
        "accept_rate_outside_loops": rate[0].tolist(),
        "accept_rate_in_loops": rate[1].tolist(),
        "share_of_steps_in_loops": (steps[1] / np.maximum(steps[0] + steps[1], 1)).tolist(),
        "tokens_per_step_by_finished_siblings": stps.tolist(),
        "steps_by_finished_siblings": ssteps.tolist(),
    }
    both = stats_pos.sum(axis=0)
    out["tokens_per_step_all_rows"] = np.where(both[:, 0] > 0, 1.0 + both[:, 2] / np.maximum(both[:, 0], 1), np.nan).tolist()
    tot = stats_pos.sum(axis=1)
    out["overall_tokens_per_step_outside_loops"] = float(1 + tot[0, 2] / max(tot[0, 0], 1))
    out["overall_tokens_per_step_in_loops"] = float(1 + tot[1, 2] / max(tot[1, 0], 1))
    return out


# ----------------------------------------------------------------------------- main
def aggregate(per_seed: dict[str, list[dict]], base: str = "none") -> dict[str, dict]:
    """Mean, 95% interval and paired cuts over seeds, per configuration: against ``base`` (no
    speculation, placement none) and against no speculation at the same placement."""
    out: dict[str, dict] = {}
    b = np.array([r["makespan_s"] for r in per_seed[base]])
    for name, runs in per_seed.items():
        m = np.array([r["makespan_s"] for r in runs])
        mean, half = ci95(m)
        cut, cut_h = ci95(1.0 - m / b[: m.size])
        sp, _ = ci95(b[: m.size] / m)
        row = {"makespan_s": mean, "makespan_s_ci95": half, "seeds": int(m.size), "makespan_s_per_seed": m.round(3).tolist(), "cut_vs_none": cut, "cut_vs_none_ci95": cut_h, "speedup_vs_none": sp}
        same = name.split(" (")[0].partition("+")
        same_base = "none" + same[1] + same[2]
        if same_base in per_seed:
            bs = np.array([r["makespan_s"] for r in per_seed[same_base]])[: m.size]
            row["cut_vs_none_same_placement"], row["cut_vs_none_same_placement_ci95"] = ci95(1.0 - m / bs)
        for key in ("tokens", "engine_steps_max", "tokens_per_row_step", "drafted_per_token", "accepted_per_token", "preemptions", "moves"):
            row[key] = float(np.mean([r[key] for r in runs]))
        if "cost_fit_gpu0" in runs[0]:
            row["cost_fit_gpu0_seed0"] = runs[0]["cost_fit_gpu0"]
        out[name] = row
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.simulate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write results as JSON here")
    ap.add_argument("--plot", default=str(REPO / "out" / "simulate_validation.png"), help="PNG of the validation panels ('' or 'none': no plot)")
    ap.add_argument("--trace", type=Path, help="rollout trace (parquet): simulate its last iteration")
    ap.add_argument("--seeds", type=int, default=5, help="workloads (seeds 0..N-1); every figure is a mean with a 95%% t-interval")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--max-draft", type=int, default=16, help="K: the engine's most draft tokens per row and step (das's default; above --batch-draft a priced budget's rows may draft up to it in the long tail)")
    ap.add_argument("--batch-draft", type=int, default=16, help="most draft tokens per row and step before the long tail (scheduler.planner)")
    ap.add_argument("--replan-every", type=int, default=16, help="engine steps between budget re-plans")
    ap.add_argument("--budgets", "--policies", dest="budgets", default=",".join(BUDGETS),
                    help=f"speculation budgets, a comma-separated subset of {','.join(BUDGETS)}")
    ap.add_argument("--placements", default=",".join(PLACEMENTS), help=f"comma-separated subset of {','.join(PLACEMENTS)}")
    ap.add_argument("--kv-capacity", type=float, help="KV cache tokens per GPU (default: from the memory budget)")
    ap.add_argument("--launch-ms", type=float, default=1.0, help="fixed cost per engine step (ms; CUDA graphs ~1, eager mode several)")
    ap.add_argument("--drafter-ms-per-256", type=float, default=1.0, help="drafter CPU time per engine step at 256 rows, linear in rows (ms)")
    ap.add_argument("--loop-accept", type=float, default=AcceptanceModel.loop_accept, help="per-token acceptance inside repetition loops")
    ap.add_argument("--sibling-gain", type=float, default=AcceptanceModel.sibling_gain, help="capacity gain once all siblings on the engine finished")
    ap.add_argument("--additive-cost", action="store_true", help="step cost compute + memory instead of max (the old model)")
    ap.add_argument("--extras", action="store_true", help="also run (placement none) eq7 without KV awareness, class-eq9 without its batch gate, class-roofline with it, and the KV-tight setting")
    ap.add_argument("--price-ablations", action="store_true", help="also run the priced budgets (cost, makespan; placement none) priced by the Eq. 1 line fitted offline and by the roofline's own step price with its knee (what a perfect online fit would know)")
    ap.add_argument("--ablations", action="store_true", help="also run the acceptance and cost ablations (none and the best budget)")
    ap.add_argument("--sweep", action="store_true", help="also run the 8-2048 GPU x 1-64 rollouts/GPU sweep (benchmarks.sim_sweep)")
    ap.add_argument("--sweep-only", action="store_true", help="run only the sweep")
    ap.add_argument("--sweep-plot", default=str(REPO / "out" / "simulate_sweep.png"))
    args = ap.parse_args(argv)
    for name in ("gpus", "prompts", "samples", "max_tokens", "replan_every", "seeds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.launch_ms < 0 or args.drafter_ms_per_256 < 0:
        raise SystemExit("--launch-ms and --drafter-ms-per-256 must be >= 0")
    if not 0.0 <= args.loop_accept < 1.0 or not 0.0 <= args.sibling_gain <= 1.0:
        raise SystemExit("--loop-accept must be in [0, 1) and --sibling-gain in [0, 1]")
    names = [p for p in args.budgets.split(",") if p]
    placements = [p for p in args.placements.split(",") if p]
    for p in names:
        try:
            budgets.resolve(p, "simulator")
        except ValueError as exc:
            raise SystemExit(f"--budgets: {exc}") from None
    for p in placements:
        if p not in PLACEMENTS:
            raise SystemExit(f"unknown placement {p!r}; expected {PLACEMENTS}")
    if "none" not in names:
        names = ["none"] + names
    if "none" not in placements:
        placements = ["none"] + placements

    t_start = time.perf_counter()
    roof = h100_7b_roofline(launch_s=args.launch_ms * 1e-3)
    if args.kv_capacity:
        from dataclasses import replace

        roof = replace(roof, kv_capacity_tokens=int(args.kv_capacity))
    params = EngineParams(roof=roof, max_draft=args.max_draft, batch_draft=args.batch_draft, replan_every=args.replan_every, drafter_ms_per_256=args.drafter_ms_per_256, max_tokens=args.max_tokens, additive_cost=args.additive_cost)
    linear = fit_linear_cost(roof, max_draft=min(args.batch_draft, args.max_draft))
    am = AcceptanceModel(loop_accept=args.loop_accept, sibling_gain=args.sibling_gain)
    out: dict[str, Any] = {}
    if not args.sweep_only:
        out.update(run_paper_setting(args, params, linear, am, names, placements))
    if args.sweep or args.sweep_only:
        from benchmarks.sim_sweep import print_sweep, run_sweep

        sw = run_sweep(params, linear, am, seeds=args.seeds, max_tokens=args.max_tokens, plot_path=None if args.sweep_plot.lower() in ("", "none") else Path(args.sweep_plot))
        print_sweep(sw)
        out["sweep"] = sw
    out["wall_s"] = time.perf_counter() - t_start
    print(f"wall {out['wall_s']:.1f} s")
    if args.json:
        from integrations.results import provenance

        out = {**provenance("python -m benchmarks.simulate", argv), **out}  # the code, date, CPU and command that made it
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=float))
        print(f"json: {args.json}")
    return out


def run_paper_setting(args, params: EngineParams, linear: dict, am: AcceptanceModel, names: list[str], placements: list[str]) -> dict[str, Any]:
    roof = params.roof
    per_seed: dict[str, list[dict]] = {}
    curves: dict[str, dict] = {}
    profiles: dict[str, list[np.ndarray]] = {}  # budget -> acceptance counters of its runs at placement none
    lengths_all = []
    loops_all = []
    lb = {"none": [], "speculative": []}
    key = "trace_setting" if args.trace else "paper_setting"
    configs = [(p, pl) for pl in placements for p in names]
    if args.extras:
        configs += [("eq7", "none", False), ("class-eq9", "none", True, "gate-flip"), ("class-roofline", "none", True, "gate-flip")]
    if args.price_ablations:
        configs += [(p, "none", True, price) for price in ("linear", "roofline") for p in names if issubclass(budgets.BUDGETS[p], PricedBudget)]
    for seed in range(args.seeds):
        if args.trace:
            work = trace_workload(str(args.trace), args.max_tokens, seed=seed, acceptance_model=am)
        else:
            work = synthetic_workload(n_prompts=args.prompts, n_samples=args.samples, max_tokens=args.max_tokens, acceptance_model=am, seed=seed)
        lengths_all.append(work["lengths"].ravel())
        loops_all.append(np.isfinite(work["loop_at"]).ravel())
        lb["none"].append(lower_bound_s(work, params, False))
        lb["speculative"].append(lower_bound_s(work, params, True))
        fresh = requests_factory(work, params)
        for cfg in configs:
            pol, pl = cfg[0], cfg[1]
            kv = cfg[2] if len(cfg) > 2 else True
            variant = cfg[3] if len(cfg) > 3 else ""
            gate = (-1 if budgets.BUDGETS[pol].gate >= 0 else DAS_GATE) if variant == "gate-flip" else None  # its gate off, or one on
            name = config_name(pol, pl) + ("" if kv else " (KV-unaware)") + ((" (no gate)" if gate < 0 else f" (gate {gate})") if gate is not None else "")
            name += {"linear": " (offline line price)", "roofline": " (roofline price)"}.get(variant, "")
            r = run_config(work, fresh, pol, pl, args.gpus, params, linear, seed=seed, keep=seed == 0 and pl == "none" and kv and not variant, kv_aware=kv, gate=gate,
                           price=variant if variant in ("linear", "roofline") else "online")
            per_seed.setdefault(name, []).append(r)
            if pl == "none" and kv and not variant:
                prof = profiles.setdefault(pol, [np.zeros_like(r["_stats_pos"]), np.zeros_like(r["_stats_sib"])])
                prof[0] += r["_stats_pos"]
                prof[1] += r["_stats_sib"]
            if "_curves" in r:
                curves[name] = {"curves": r["_curves"], "makespan": r["makespan_s"]}
    table = aggregate(per_seed)
    n_p, n_s = args.prompts, args.samples
    if args.trace:
        n_p, n_s = work["lengths"].shape
    lengths = np.concatenate(lengths_all)

    # ---------------------------------------------------------------- validation
    la = [config_name(p, pl) for pl in placements for p in LENGTH_AWARE if config_name(p, pl) in table]
    best = min(la, key=lambda n: table[n]["makespan_s"]) if la else None
    la_none = [p for p in LENGTH_AWARE if p in table]
    best_none = min(la_none, key=lambda n: table[n]["makespan_s"]) if la_none else None
    fig1 = {n: collapse_stats(curves[n]["curves"], n_p * n_s, curves[n]["makespan"]) for n in dict.fromkeys(("none", best_none)) if n in curves}
    accept = acceptance_profile(*profiles["fixed"], args.max_tokens) if "fixed" in profiles else {}
    fig10 = {}
    for pl in placements:
        u = config_name("fixed", pl)
        cands = [config_name(p, pl) for p in LENGTH_AWARE if config_name(p, pl) in table]
        if u in table and cands:
            b = min(cands, key=lambda n: table[n]["makespan_s"])
            ratio = np.array(table[u]["makespan_s_per_seed"]) / np.array(table[b]["makespan_s_per_seed"]) - 1.0
            m, h = ci95(ratio)
            fig10[pl] = {"unlimited": u, "best_length_aware": b, "unlimited_slower_by": m, "unlimited_slower_by_ci95": h}
    validation = {
        "fig1_running_requests": {"paper": "the effective batch collapses after the first few hundred decode steps, leaving a few long stragglers that set the makespan", "simulator": fig1},
        "fig4_acceptance": {"paper": "acceptance rises as siblings finish and is very high in repetition loops near the length cap (as the issue describes Fig. 4; REFERENCES.md reports no acceptance numbers)", "simulator": accept},
        "fig8_makespan": {"paper": "DAS cuts rollout time by more than 50% (7B, DSR-sub, 16K, 8 H100)", "best_length_aware": best, "best_cut": table[best]["cut_vs_none"] if best else None, "best_cut_ci95": table[best]["cut_vs_none_ci95"] if best else None},
        "fig10_unlimited_vs_length_aware": {"paper": "an unlimited draft budget was up to 15% worse than the length-aware one", "simulator": fig10},
        "shipped_vs_paper": shipped_vs(table, PAPER_BUDGET),
        "shipped_vs_roofline": shipped_vs(table, "class-roofline"),
    }
    plot_path = None
    if args.plot and args.plot.lower() != "none" and curves and accept:
        show = {n: curves[n] for n in dict.fromkeys(("none", "fixed", SHIPPED, PAPER_BUDGET, best_none)) if n in curves}
        plot_path = plot_validation(table, show, accept, Path(args.plot), f"{n_p} prompts x {n_s} samples, {args.gpus} GPUs, max {args.max_tokens} tokens, K={args.max_draft} (batch {args.batch_draft}), {args.seeds} seeds")

    ls = length_stats(lengths, args.max_tokens)
    ls["loop_share"] = float(np.concatenate(loops_all).mean())
    out: dict[str, Any] = {
        key: table,
        "shipped_budget": SHIPPED,
        "validation": validation,
        "setting": {
            "model": "DeepSeek-R1-Distill-Qwen-7B (Qwen2.5-7B architecture), bf16",
            "gpu": "H100 SXM 80 GB, one engine per GPU (data parallel)",
            "gpus": args.gpus,
            "prompts": n_p,
            "samples": n_s,
            "max_tokens": args.max_tokens,
            "max_draft": args.max_draft,
            "batch_draft": args.batch_draft,
            "replan_every": args.replan_every,
            "seeds": args.seeds,
            "das_quota_tokens_per_step": DAS_QUOTA,
            "das_gate_running": DAS_GATE,
            "drafter_ms_per_256": args.drafter_ms_per_256,
            "launch_ms": args.launch_ms,
            "additive_cost": args.additive_cost,
            "max_seqs": params.max_seqs,
            "kv_capacity_tokens": roof.kv_capacity_tokens,
            "length_model": work["length_model"].as_dict() if hasattr(work["length_model"], "as_dict") else work["length_model"],
            "acceptance_model": am.as_dict(),
        },
        "costs": {"roofline": roof.as_dict(), "eq1_offline_fit": linear, "step_examples": cost_examples(roof)},
        "lengths": ls,
        "lower_bound_s": {k: ci95(v)[0] for k, v in lb.items()},
        "plot": str(plot_path) if plot_path else None,
    }
    print_table(out, key, names, placements, args)
    if args.extras and not args.trace:
        out["kv_tight"] = run_kv_tight(args, params, linear, am)
    if args.ablations and not args.trace:
        out["ablations"] = run_ablations(args, params, linear, am, best or "class-eq9")
    return out


def shipped_vs(table: dict, other: str) -> dict[str, Any]:
    """The shipped budget (:data:`SHIPPED`) against ``other`` at placement none: both cuts vs
    none, and the shipped budget's makespan cut against ``other``'s (paired per seed, mean and
    95% interval; positive: the shipped budget is faster). Empty where either was not run."""
    if SHIPPED not in table or other not in table:
        return {"shipped": SHIPPED, "other": other}
    a, b = (np.array(table[n]["makespan_s_per_seed"]) for n in (SHIPPED, other))
    m, h = ci95(1.0 - a / b)
    return {"shipped": SHIPPED, "other": other, "shipped_cut_vs_none": table[SHIPPED]["cut_vs_none"],
            "other_cut_vs_none": table[other]["cut_vs_none"], "shipped_cut_vs_other": m, "shipped_cut_vs_other_ci95": h}


def cost_examples(roof) -> dict[str, float]:
    """Step times (ms) of a few decode steps and their roofline knees (draft tokens), for the README."""
    ex = {}
    for rows, d, ctx in ((256, 0, 3000), (256, 4, 3000), (256, 16, 3000), (64, 0, 8000), (64, 16, 8000), (4, 0, 12000), (4, 16, 12000), (1, 0, 12000), (1, 16, 12000)):
        ex[f"rows{rows}_d{d}_ctx{ctx}"] = 1e3 * roof.decode_step_time(rows, d, ctx)
    for rows, ctx in ((256, 3000), (64, 8000), (4, 12000)):
        ex[f"knee_draft_tokens_rows{rows}_ctx{ctx}"] = roof.free_draft_tokens(rows, rows * ctx)
    return ex


def run_kv_tight(args, params: EngineParams, linear: dict, am: AcceptanceModel, utilization: float = 0.5) -> dict[str, Any]:
    """The KV-capacity rule where memory is tight: verl's default rollout memory fraction (0.5)
    leaves ~431K tokens of KV per GPU; ``fixed`` and ``eq7`` with and without KV-aware drafts."""
    from dataclasses import replace

    roof = h100_7b_roofline(launch_s=params.roof.launch_s, gpu_memory_utilization=utilization)
    pp = replace(params, roof=roof)
    rows = [("none", True), ("fixed", True), ("fixed", False), ("eq7", True), ("eq7", False), ("class-roofline", True)]
    res: dict[str, dict[str, list[float]]] = {}
    for seed in range(args.seeds):
        work = synthetic_workload(n_prompts=args.prompts, n_samples=args.samples, max_tokens=args.max_tokens, acceptance_model=am, seed=seed)
        fresh = requests_factory(work, pp)
        for pol, kv in rows:
            r = run_config(work, fresh, pol, "none", args.gpus, pp, linear, seed=seed, kv_aware=kv)
            d = res.setdefault(pol + ("" if kv else " (KV-unaware)"), {"makespan_s": [], "preemptions": []})
            d["makespan_s"].append(r["makespan_s"])
            d["preemptions"].append(r["preemptions"])
    out: dict[str, Any] = {"gpu_memory_utilization": utilization, "kv_capacity_tokens": roof.kv_capacity_tokens}
    print(f"KV-tight ({utilization} memory fraction: {roof.kv_capacity_tokens} KV tokens/GPU, placement none, {args.seeds} seeds):")
    for name, d in res.items():
        m, h = ci95(d["makespan_s"])
        out[name] = {"makespan_s": m, "makespan_s_ci95": h, "preemptions": float(np.mean(d["preemptions"]))}
        print(f"  {name:<26}{m:8.1f} +- {h:4.1f} s, preemptions {np.mean(d['preemptions']):7.1f}")
    return out


def run_ablations(args, params: EngineParams, linear: dict, am: AcceptanceModel, best: str) -> dict[str, Any]:
    """``none``, ``fixed`` and the best length-aware configuration under variations of the
    modelled effects (same seeds, the best configuration's placement for all three): which effect
    carries how much of the cut."""
    from dataclasses import replace

    pol, _, pl = best.partition("+")
    pl = pl or "none"
    variants = {
        "as modelled": (params, am),
        "no loops (loops drafted at the base rate)": (params, am),
        "what-if: every capped rollout loops": (params, am),
        "loop acceptance 0.8": (params, replace(am, loop_accept=0.8)),
        "loop acceptance 0.95": (params, replace(am, loop_accept=0.95)),
        "no sibling gain": (params, replace(am, sibling_gain=0.0)),
        f"drafter proposes K={params.max_draft} every step": (params, replace(am, natural_draft=float(params.max_draft))),
        "additive step cost (compute + memory)": (replace(params, additive_cost=True), am),
        "drafter 4 ms per step at 256 rows": (replace(params, drafter_ms_per_256=4.0), am),
    }
    out: dict[str, Any] = {"budget": best, "policy": best, "placement": pl, "seeds": args.seeds}  # "policy": the key's former name
    print(f"ablations (placement {pl}, {args.seeds} seeds; cut vs none at that placement, mean +- 95% interval):", flush=True)
    rows = []
    for label, (pp, aa) in variants.items():
        mk: dict[str, list[float]] = {"none": [], "fixed": [], pol: []}
        for seed in range(args.seeds):
            work = synthetic_workload(n_prompts=args.prompts, n_samples=args.samples, max_tokens=args.max_tokens, acceptance_model=aa, seed=seed)
            if label.startswith("no loops"):
                work["loop_at"] = np.full(work["loop_at"].shape, np.inf)
            elif label.startswith("what-if"):  # capped without a loop: loops from its problem's median length on
                capped = (work["lengths"] >= args.max_tokens) & ~np.isfinite(work["loop_at"])
                onset = np.minimum(np.exp(work["mu"])[:, None], args.max_tokens - 1.0)
                work["loop_at"] = np.where(capped, np.broadcast_to(onset, capped.shape), work["loop_at"])
            fresh = requests_factory(work, pp)
            for p in mk:
                mk[p].append(run_config(work, fresh, p, pl, args.gpus, pp, linear, seed=seed)["makespan_s"])
        base = np.array(mk["none"])
        row: dict[str, Any] = {"none_s": ci95(base)[0], "none_s_ci95": ci95(base)[1]}
        for p in ("fixed", pol):
            m = np.array(mk[p])
            row[f"{p}_s"] = ci95(m)[0]
            row[f"{p}_cut"], row[f"{p}_cut_ci95"] = ci95(1.0 - m / base)
        out[label] = row
        rows.append([label, f"{row['none_s']:.1f}"] + [f"{row[f'{p}_s']:.1f} ({100 * row[f'{p}_cut']:+.0f}+-{100 * row[f'{p}_cut_ci95']:.0f}%)"
                                                      for p in ("fixed", pol)])
    from tabulate import tabulate

    print(tabulate(rows, ["variant", "none s", "fixed", pol], colalign=["left", "right", "right", "right"], disable_numparse=True))
    return out


if __name__ == "__main__":
    main()
