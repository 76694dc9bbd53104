"""``das-rollout --engines N``: the rollout iterations on N vLLM engines (Ray workers), one history for all.

Each method gets a :class:`integrations.rl.ray_rollout.RayRolloutDriver` with N workers; on a CPU
build each engine's OpenMP threads are bound to its own cores (:func:`integrations.rl.ray_rollout.engine_cpus`),
so that the N engines share this machine without competing. A GRPO group goes to one engine; the
groups are placed by ``--placement`` (``lpt``: longest predicted work first, from the length
predictor fed by every finished iteration; ``round_robin``; ``random``), and with ``das`` every
engine's drafter reads the shared rollout history (:mod:`integrations.rl.history`).
The methods alternate per iteration as in the single-engine run (A B, then B A).

Reported per iteration, beside the single-engine columns (pooled over the engines): ``engines``
(per engine: tokens, tokens/s, acceptance length, tail, when its last batch returned, drafter memory),
``makespan_s`` (the driver's wall time from the first dispatch to the last result: the iteration's
wall time here) and ``placement`` (groups and tokens per engine; for the same groups, the most
tokens any engine got under each placement method, placed by the same predictions).
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from integrations.vllm_ext import cpu_runtime


def _engine_kwargs(method: str, args: argparse.Namespace) -> dict[str, Any]:
    base, _, budget = method.partition(":")
    das_config = {"window": args.window, "decay": args.decay, "budget": budget or args.budget} if base == "das" else None
    return {"num_speculative_tokens": args.num_spec_tokens, "das_config": das_config, "dtype": args.dtype,
            "max_model_len": args.max_model_len, "seed": args.seed}


def start_drivers(methods: list[str], model: str, args: argparse.Namespace, kv_gib: int = 0) -> dict[str, Any]:
    """One :class:`RayRolloutDriver` of ``args.engines`` workers per method (Ray started if it is not)."""
    import ray

    from integrations.rl.ray_rollout import RayRolloutDriver

    if not ray.is_initialized():
        cores = cpu_runtime.read_cpu_info().cores if cpu_runtime.is_cpu_build() else None
        ray.init(num_cpus=max(cores or 0, args.engines), include_dashboard=False, log_to_driver=False)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib)} if kv_gib else {}
    drivers: dict[str, Any] = {}
    try:
        for m in methods:
            drivers[m] = RayRolloutDriver(model, m.partition(":")[0], args.engines, placement=args.placement, max_tokens=args.max_tokens,
                                          temperature=args.temperature, engine_kwargs=_engine_kwargs(m, args), num_cpus_per_worker=0,
                                          shared_history=args.engine_history == "shared", bind_cpus=True, worker_env=env)
    except BaseException:
        for d in drivers.values():
            d.shutdown()
        raise
    return drivers


def iteration_result(it: int, version: int, results: dict[str, list[list[int]]], report: dict[str, Any], max_tokens: int):
    """The fields of one :class:`integrations.rollout.IterationResult` (a dict) from a driver's iteration (pooled over its engines)."""
    pooled = report["pooled"]
    lengths = np.array([len(s) for outs in results.values() for s in outs])
    wall = report["makespan_s"]
    return dict(
        iteration=it, policy_version=version, rollouts=len(lengths), wall_time_s=round(wall, 3), tokens=pooled["tokens"],
        verification_steps=pooled["verification_steps"], acceptance_length=pooled["acceptance_length"], draft_tokens=pooled["draft_tokens"],
        accepted_tokens=pooled["accepted_tokens"], tokens_per_s=round(pooled["tokens"] / wall, 2) if wall else 0.0,
        longest_rollout_tokens=int(lengths.max()), mean_rollout_tokens=round(float(lengths.mean()), 1), tail_s=pooled["tail_s"],
        p50_rollout_tokens=float(np.percentile(lengths, 50)), p90_rollout_tokens=float(np.percentile(lengths, 90)),
        capped_rollouts=int((lengths >= max_tokens).sum()), tail_acceptance_length=pooled["tail_acceptance_length"],
        tail_row_steps=pooled["tail_row_steps"], tail_accepted_tokens=pooled["tail_accepted_tokens"],
        engines=report["engines"], makespan_s=report["makespan_s"], placement=report["placement"],
        proposer={"drafter": pooled["drafter"], "history": pooled.get("history")} if "drafter" in pooled else None,
    )


def run_engines(methods: list[str], model: str, prompts: list[list[int]], problem_ids: list[str], schedule: list[list[int]],
                args: argparse.Namespace, progress=None, trace_method: str | None = None, rollouts: list | None = None,
                kv_gib: int = 0, seed_of=lambda version: version) -> dict[str, list[dict[str, Any]]]:
    """Every iteration of ``schedule`` for every method on ``args.engines`` engines each (see the module docstring).

    ``seed_of(version)`` is iteration ``version``'s sampling seed (das-rollout's ``sampling_seed``).
    Returns ``{method: [the fields of an IterationResult, per iteration]}``, as :func:`integrations.rollout.run_side_by_side`'s results;
    the rollouts of ``trace_method`` are appended to ``rollouts`` when it is a list (finish reason
    ``length`` for a rollout of ``max_tokens`` tokens, else ``stop``).
    """
    from integrations.results import rollout_digest
    from integrations.rl.ray_rollout import Group

    drivers = start_drivers(methods, model, args, kv_gib)
    results: dict[str, list] = {m: [] for m in methods}
    sampling = {"das_coupled": True} if getattr(args, "coupled_sampling", False) else {}
    try:
        if schedule:
            first = [len(prompts[i]) for i in schedule[0] for _ in range(args.samples)]
            for d in drivers.values():
                d.warm(first)
        for it, chosen in enumerate(schedule):
            version = it + 1
            groups = [Group(f"{version}:{k}", problem_ids[i], prompts[i], args.samples) for k, i in enumerate(chosen)]
            for m in (methods if it % 2 == 0 else methods[::-1]):
                drv = drivers[m]
                out = drv.run_iteration(groups, version, seed=seed_of(version) - version, sampling=sampling)
                r = iteration_result(it, version, out, drv.last_iteration, args.max_tokens)
                r["rollout_digests"] = [rollout_digest(o) for g in groups for o in out[g.group_id]]  # (group, sample) order, as one engine's
                results[m].append(r)
                if rollouts is not None and m == trace_method:
                    from integrations.data.trace import Rollout

                    for g in groups:
                        for s, o in enumerate(out[g.group_id]):
                            rollouts.append(Rollout(it, version, g.problem_id, s, list(g.prompt_ids), list(o),
                                                    "length" if len(o) >= args.max_tokens else "stop"))
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix_str(f"{m} it{it}: {r['tokens_per_s']:.0f} tok/s, {r['acceptance_length']:.2f} tok/step, "
                                            f"makespan {r['makespan_s']:.1f}s")
    finally:
        for d in drivers.values():
            d.shutdown()
    return results


def format_engines(report: dict[str, Any]) -> str:
    """Per engine and pooled rows of every method and iteration, and the placement comparison (tabulate)."""
    from tabulate import tabulate

    rows, place = [], []
    for name, m in report["methods"].items():
        for r in m["iterations"]:
            for e, st in enumerate(r.get("engines") or []):
                rows.append([name, r["iteration"], e, st.get("tokens", 0), st.get("tokens_per_s", 0.0), st.get("acceptance_length", 1.0),
                             st.get("tail_s", 0.0), st.get("done_s", 0.0), (st.get("drafter") or {}).get("bytes", "-"),
                             (st.get("drafter") or {}).get("problems", "-")])
            rows.append([name, r["iteration"], "pooled", r["tokens"], r["tokens_per_s"], r["acceptance_length"], r.get("tail_s", 0.0),
                         r.get("makespan_s", 0.0), ((r.get("proposer") or {}).get("drafter") or {}).get("bytes", "-"), ""])
            p = r.get("placement") or {}
            place.append([name, r["iteration"], p.get("method"), p.get("groups_per_engine"), [round(t) for t in p.get("tokens_per_engine", [])],
                          *[round(p.get("max_tokens", {}).get(k, 0)) for k in ("lpt", "round_robin", "random")]])
    head = ["method", "iter", "engine", "tokens", "tok/s", "acc_len", "tail_s", "done_s", "drafter_bytes", "problems"]
    phead = ["method", "iter", "placement", "groups/engine", "tokens/engine", "max_tok lpt", "max_tok round_robin", "max_tok random"]
    return tabulate(rows, head, floatfmt=".2f") + "\n\n" + tabulate(place, phead)
