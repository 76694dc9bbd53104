"""Long-tail rollout benchmark with the policy updating: ``python -m benchmarks.rollout``.

For each data set (default DSR-sub math and LeetCode code), with the real SmolLM2-135M:

1. **Train** a few GRPO steps with the loop of :mod:`integrations.rl.grpo` and DAS inside vLLM
   (``--train-method``, default ``das``): rollouts, rewards, policy update, weight sync, drafter
   window advance. The policy weights used at every iteration are kept (bfloat16 copies); the
   loop's own rollouts are reported apart (``train_loop_rollouts``), since they ran beside the
   trainer's memory and threads.
2. **Replay** the same iterations for every method (``none``: no speculation, ``ngram``:
   vLLM prompt lookup, ``suffix``: vLLM SuffixDecoding / arctic-inference, ``das-sched``: DAS plus
   the ``class`` budget's per-request caps, :func:`integrations.rl.grpo.request_caps`), one
   engine per method: at iteration ``v`` the engine gets policy ``v`` by an in-place weight sync
   (prefix cache reset, DAS window advanced), then generates the same prompts with the same seed
   through the loop's own rollout function (:func:`integrations.vllm_ext.rollouts.generate_rollouts`).
   Every method thus samples from the same sequence of policies; only speculation differs. The
   train method is replayed too, so all rows are measured the same way. Sampling is coupled
   (``--independent-sampling`` turns it off), so the methods generate the same rollouts wherever
   their logits agree; the summary counts the rollouts identical in every method
   (``identical_rollouts``).

Per iteration and method: rollout wall time, time of the longest 10% of rollouts (wall time minus
the finish time of the 90th-percentile rollout: the tail when the running batch is nearly empty),
tokens per second, acceptance length (tokens per verification step, bonus token included), and the
reward (same reward as training: math-verify / sandboxed unit tests, format reward, overlong penalty).

Writes ``<out>/rollout_<data>.json``, ``<out>/rollout.md`` (tables) and PNG plots
``<out>/rollout_time.png`` (rollout time per iteration per method), ``rollout_acceptance.png``,
``rollout_reward.png`` and ``rollout_batch.png`` (running batch size over time within the last
iteration: the long tail). ``python -m benchmarks.rollout --plot-training LOG.jsonl OUT.png`` plots
a GRPO loop's JSON-lines log instead. Defaults (3 iterations of 4 problems x 6 samples, 256 tokens, both data
sets) take about 15 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from integrations.data.registry import DATASETS, data_dir_from_env, resolve
from integrations.vllm_ext import cpu_runtime
from integrations.vllm_ext.engine import METHODS

#: what is replayed: an engine method (:data:`integrations.vllm_ext.engine.METHODS`), or ``das-sched``:
#: DAS with each request capped by its problem's length class (the recipe's ``scheduler.budget: class``).
REPLAYED = METHODS + ("das-sched",)
DEFAULT_REPLAYED = ("none", "ngram", "suffix", "das", "das-sched")
#: the data sets with a GRPO recipe (:data:`integrations.data.registry.DATASETS`, ``recipe``): name -> recipe
DATA = {d.name: d.recipe for d in DATASETS if d.recipe}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=",".join(DATA), help=f"comma-separated, from {list(DATA)} (each uses its recipe, recipes/<recipe>.yaml; "
                                                         "$DAS_DATA_DIR as for das-rollout)")
    p.add_argument("--methods", default=",".join(DEFAULT_REPLAYED), help=f"comma-separated, from {list(REPLAYED)}")
    p.add_argument("--train-method", default="das", choices=METHODS, help="the method the GRPO loop trains with")
    p.add_argument("--iterations", type=int, default=3, help="GRPO steps (policy versions) per data set")
    p.add_argument("--prompts", type=int, default=4, help="problems per iteration")
    p.add_argument("--samples", type=int, default=6, help="GRPO group size")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--pool", type=int, default=16, help="problems the iterations draw from (small, so problems recur)")
    p.add_argument("--lr", type=float, default=None, help="override train.lr")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/rollout", help="directory for JSON, tables and PNGs (default: runs/rollout, git-ignored)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--overwrite", action="store_true", help="replace result files already in --out (else refuse before running)")
    p.add_argument("--independent-sampling", action="store_true",
                   help="let each method draw its own random numbers (default: coupled sampling, the same rollouts wherever logits agree)")
    p.add_argument("--plot-training", nargs=2, metavar=("LOG.jsonl", "OUT.png"),
                   help="plot a GRPO loop's JSON-lines log (das-grpo log.json) instead of running the benchmark")
    p.add_argument("overrides", nargs="*", help="extra recipe overrides (section.key=value) for every data set")
    args = p.parse_args(argv)
    args.data = [d.strip() for d in args.data.split(",") if d.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [d for d in args.data if d not in DATA] + [m for m in args.methods if m not in REPLAYED]
    if bad:
        p.error(f"unknown data sets / methods: {bad}")
    if args.train_method not in args.methods:
        args.methods.insert(0, args.train_method)
    for name in ("iterations", "prompts", "samples", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.pool < args.prompts:
        p.error("--pool must be >= --prompts")
    args.data_dir = data_dir_from_env()  # $DAS_DATA_DIR, read here at the entry point
    for d in args.data:
        try:
            resolve(d, args.data_dir)
        except (OSError, ValueError) as exc:
            p.error(f"--data {d}: {exc}")
    return args


def _overrides(args: argparse.Namespace, method: str, data: str | None = None) -> list[str]:
    ov = [f"steps={args.iterations}", f"seed={args.seed}", f"pool={args.pool}", f"rollout.prompts_per_step={args.prompts}",
          f"rollout.samples={args.samples}", f"rollout.max_tokens={args.max_tokens}", f"rollout.temperature={args.temperature}",
          f"speculative.method={method}", "log.json=null"]
    if args.lr is not None:
        ov.append(f"train.lr={args.lr}")
    src = resolve(data, getattr(args, "data_dir", None)) if data else None
    if src is not None and src.path is not None and getattr(args, "data_dir", None) is not None and src.path.parent == args.data_dir:
        ov.append(f"data={src.path}")  # the local copy in $DAS_DATA_DIR
    return ov + list(args.overrides)


def _iteration_record(method: str, it: int, batch: Any, scores: list[float], rewards: list[Any], extra: dict | None = None) -> dict[str, Any]:
    lengths = [len(r.output_ids) for r in batch.rollouts]
    rec = {
        "method": method, "iteration": it, "rollouts": len(lengths), "wall_time_s": round(batch.wall_time_s, 3),
        "tail10_s": round(batch.tail_time_s(0.1), 3), "tokens": batch.tokens,
        "tokens_per_s": round(batch.tokens / batch.wall_time_s, 2) if batch.wall_time_s else 0.0,
        "acceptance_length": round(batch.acceptance_length, 4), "draft_tokens": batch.draft_tokens, "accepted_tokens": batch.accepted_tokens,
        "reward_mean": round(sum(scores) / len(scores), 4), "accuracy": round(sum(bool(getattr(x, "correct", False)) for x in rewards) / len(rewards), 4),
        "mean_len": round(sum(lengths) / len(lengths), 1), "max_len": max(lengths),
        "truncated": round(sum(r.finish_reason == "length" for r in batch.rollouts) / len(lengths), 4),
        "finish_times_s": [round(t, 3) for t in batch.finish_times()],
    }
    rec.update(extra or {})
    return rec


def run_dataset(data: str, args: argparse.Namespace, progress: Any = None) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from integrations.data.problems import load_problems, render_prompts
    from integrations.results import identical_rollouts, rollout_digest
    from integrations.rl.grpo import release_engine_state, request_caps, run
    from integrations.rl.recipes import load_recipe
    from integrations.rl.rewards import make_reward_fn, overlong_penalty
    from integrations.vllm_ext import control
    from integrations.vllm_ext.engine import make_llm
    from integrations.vllm_ext.rollouts import generate_rollouts
    from integrations.vllm_ext.weight_sync import sync_weights

    base = load_recipe(DATA[data], _overrides(args, args.train_method, data))
    weights: dict[int, dict[str, Any]] = {}

    def keep(version: int, model: Any) -> None:
        if version < args.iterations:  # the weights that generate iteration `version`
            weights[version] = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}

    t0 = time.perf_counter()
    trained = run(base, keep_batches=True, keep_rollouts=True, weights_hook=keep,
                  on_step=(lambda r: progress.update(1)) if progress is not None else None)
    train_wall = time.perf_counter() - t0
    model_dir = trained.recipe["model"]
    from integrations.data.models import resolve_model

    model_dir = resolve_model(model_dir)
    problems = load_problems(base.data)
    by_id = {p.problem_id: p for p in problems}
    tok = AutoTokenizer.from_pretrained(model_dir)
    rs = base.reward
    score = make_reward_fn(format_weight=rs.format_weight, require_boxed=rs.require_boxed, workers=rs.workers,
                           timeout_s=rs.code_timeout_s, memory_mb=rs.code_memory_mb, network=rs.network, sandbox=rs.sandbox)

    def scored(batch):
        texts = [tok.decode(r.output_ids, skip_special_tokens=True) for r in batch.rollouts]
        rewards = score([by_id[r.problem_id] for r in batch.rollouts], texts)
        scores = [x.score + overlong_penalty(len(r.output_ids), base.rollout.max_tokens, rs.overlong_buffer, rs.overlong_penalty)
                  for x, r in zip(rewards, batch.rollouts)]
        return scores, rewards

    loop: list[dict[str, Any]] = []  # the train method's rollouts inside the loop (trainer in the same process)
    training = []
    for s in trained.steps:
        batch = s["batch"]
        rew = score([by_id[r.problem_id] for r in batch.rollouts], [tok.decode(r.output_ids, skip_special_tokens=True) for r in batch.rollouts])
        loop.append(_iteration_record(f"{args.train_method} (in loop)", s["step"], batch, s["rewards"], rew))
        training.append({k: s[k] for k in ("step", "reward_mean", "accuracy", "format_rate", "loss", "clip_frac", "approx_kl", "grad_norm",
                                            "updates", "rollout_s", "train_s", "sync_s", "step_s", "acceptance_length")})
    results: dict[str, list[dict[str, Any]]] = {}
    schedule = [(s["problems"], s["step"]) for s in trained.steps]
    prompt_ids: dict[str, list[int]] = {}
    needed = sorted({pid for ps, _ in schedule for pid in ps})
    for pid, ids in zip(needed, render_prompts([by_id[pid] for pid in needed], tok)):
        prompt_ids[pid] = ids

    for method in args.methods:  # the train method too: every method measured the same way, in a fresh engine
        engine_method = "das" if method.startswith("das") else method
        das_cfg = dict(base.speculative.das) if engine_method == "das" else None
        llm = make_llm(model_dir, engine_method, num_speculative_tokens=base.speculative.num_speculative_tokens if engine_method != "none" else None,
                       das_config=das_cfg, dtype=base.rollout.engine_dtype, max_model_len=base.rollout.max_model_len, seed=base.seed)
        budget = request_caps(base, "class") if method == "das-sched" else None
        results[method] = []
        try:
            for pids, step in schedule:
                if step > 0:
                    sync_weights(llm, weights[step])
                if engine_method == "das":
                    control.begin_iteration(llm, step)
                caps = budget.caps(pids) if budget is not None else None
                batch = generate_rollouts(llm, [prompt_ids[p] for p in pids], pids, samples=base.rollout.samples, max_tokens=base.rollout.max_tokens,
                                          temperature=base.rollout.temperature, top_p=base.rollout.top_p, seed=base.seed * 1_000_003 + step,
                                          draft_caps=caps, das=engine_method == "das", coupled=not args.independent_sampling)
                if budget is not None:
                    budget.observe(step, [r.problem_id for r in batch.rollouts], [len(r.output_ids) for r in batch.rollouts])
                scores, rew = scored(batch)
                extra = {"rollout_digests": [rollout_digest(r.output_ids) for r in batch.rollouts], **({"draft_caps": caps} if caps else {})}
                results[method].append(_iteration_record(method, step, batch, scores, rew, extra))
                if progress is not None:
                    progress.update(1)
        finally:
            del llm
            release_engine_state()
    summary = {}
    for m, its in results.items():
        wall = sum(r["wall_time_s"] for r in its)
        tokens = sum(r["tokens"] for r in its)
        steps = sum(r["tokens"] - r["accepted_tokens"] for r in its)
        summary[m] = {"wall_time_s": round(wall, 3), "tail10_s": round(sum(r["tail10_s"] for r in its), 3), "tokens": tokens,
                      "tokens_per_s": round(tokens / wall, 2) if wall else 0.0, "acceptance_length": round(tokens / max(steps, 1), 4),
                      "reward_mean": round(sum(r["reward_mean"] for r in its) / len(its), 4)}
    if "none" in summary:
        for m in summary:
            summary[m]["speedup_vs_none"] = round(summary["none"]["wall_time_s"] / summary[m]["wall_time_s"], 3)
            base_tps = summary["none"]["tokens_per_s"]
            summary[m]["tokens_per_s_vs_none"] = round(summary[m]["tokens_per_s"] / base_tps, 3) if base_tps else None
    same = identical_rollouts({m: [r["rollout_digests"] for r in its] for m, its in results.items()})
    return {"data": data, "coupled_sampling": not args.independent_sampling, "identical_rollouts": same,
            "recipe": base.to_dict(), "model": model_dir, "train_method": args.train_method, "train_wall_s": round(train_wall, 1),
            "training": training, "train_loop_rollouts": loop, "methods": results, "summary": summary}


def _markdown(rows: list[list[Any]], cols: list[tuple[str, str]], first_left: bool = True) -> str:
    """A markdown (pipe) table; ``cols`` are (header, number format) pairs, numbers right-aligned."""
    from tabulate import tabulate

    align = ["left" if first_left and i == 0 else "right" for i in range(len(cols))]
    return tabulate(rows, [h for h, _ in cols], tablefmt="pipe", floatfmt=[f for _, f in cols], colalign=align)


def format_tables(report: dict[str, Any]) -> str:
    """Markdown tables: per iteration and per method, then the per-method summary."""
    cols = [("method", ""), ("iter", ""), ("wall s", ".1f"), ("tail 10% s", ".1f"), ("tokens", ""), ("tok/s", ".0f"), ("acc. len", ".2f"),
            ("drafted", ""), ("accepted", ""), ("reward", "+.3f"), ("mean len", ".0f"), ("truncated", ".2f")]
    keys = ["wall_time_s", "tail10_s", "tokens", "tokens_per_s", "acceptance_length", "draft_tokens", "accepted_tokens", "reward_mean",
            "mean_len", "truncated"]
    rows = [[m, int(r["iteration"]), *(r[k] if f == "" else float(r[k]) for k, (_, f) in zip(keys, cols[2:]))]
            for m, its in report["methods"].items() for r in its]
    scols = [("method", ""), ("wall s", ".1f"), ("tail 10% s", ".1f"), ("tok/s", ".0f"), ("acc. len", ".2f"), ("mean reward", "+.3f"),
             ("wall vs none", ""), ("tok/s vs none", "")]
    summary = [[m, *(float(s[k]) for k in ("wall_time_s", "tail10_s", "tokens_per_s", "acceptance_length", "reward_mean")),
                *(f"{s[k]:.2f}x" if s.get(k) else "-" for k in ("speedup_vs_none", "tokens_per_s_vs_none"))] for m, s in report["summary"].items()]
    same = report.get("identical_rollouts")
    same_line = ([f"Rollouts identical in every method: {same['identical']} of {same['rollouts']} "
                  f"({'coupled' if report.get('coupled_sampling') else 'independent'} sampling).", ""] if same else [])
    tcols = [("step", ""), ("reward", "+.3f"), ("acc", ".2f"), ("format", ".2f"), ("loss", "+.4f"), ("clip frac", ".3f"),
             ("approx KL", "+.5f"), ("updates", ""), ("rollout s", ".1f"), ("train s", ".1f"), ("sync s", ".2f")]
    training = [[t["step"], *(float(t[k]) for k in ("reward_mean", "accuracy", "format_rate", "loss", "clip_frac", "approx_kl")),
                 t["updates"], *(float(t[k]) for k in ("rollout_s", "train_s", "sync_s"))] for t in report["training"]]
    return "\n".join([f"### {report['data']} (trained with `{report['train_method']}`)", "", _markdown(rows, cols), "",
                      _markdown(summary, scols), "", *same_line, "Training (the GRPO loop that produced the policies):", "",
                      _markdown(training, tcols, first_left=False)])


PLOTS = ("rollout_time.png", "rollout_acceptance.png", "rollout_reward.png", "rollout_batch.png")


def _save(fig: Any, path: Path) -> None:
    """``fig.savefig`` as PNG, atomically (a failed write keeps the old file)."""
    from integrations.results import atomic_output

    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=80, format="png")


def output_files(args: argparse.Namespace) -> list[Path]:
    """Every file a run writes into ``--out``."""
    out = Path(args.out)
    files = [out / f"rollout_{d}.json" for d in args.data] + [out / "rollout.md"]
    return files + ([] if args.no_plots else [out / f for f in PLOTS])


def plot(reports: list[dict[str, Any]], out: Path) -> list[Path]:
    """The four PNGs (one column per data set)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for key, ylabel, fname in (("wall_time_s", "rollout wall time (s)", "rollout_time.png"),
                               ("acceptance_length", "acceptance length (tokens/step)", "rollout_acceptance.png"),
                               ("reward_mean", "mean reward", "rollout_reward.png")):
        fig, axes = plt.subplots(1, len(reports), figsize=(5 * len(reports), 3.4), squeeze=False)
        for ax, rep in zip(axes[0], reports):
            for m, its in rep["methods"].items():
                ax.plot([r["iteration"] for r in its], [r[key] for r in its], marker="o", label=m)
            ax.set_title(rep["data"])
            ax.set_xlabel("iteration (policy version)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        _save(fig, out / fname)
        plt.close(fig)
        files.append(out / fname)
    fig, axes = plt.subplots(1, len(reports), figsize=(5 * len(reports), 3.4), squeeze=False)
    for ax, rep in zip(axes[0], reports):
        for m, its in rep["methods"].items():
            r = its[-1]
            t = sorted(r["finish_times_s"])
            n = len(t)
            xs, ys = [0.0], [n]
            for i, x in enumerate(t):
                xs += [x, x]
                ys += [n - i, n - i - 1]
            ax.plot(xs, ys, label=f"{m} ({r['wall_time_s']:.0f} s)")
        ax.set_title(f"{rep['data']}: running rollouts, iteration {rep['methods'][next(iter(rep['methods']))][-1]['iteration']}")
        ax.set_xlabel("seconds since the iteration started")
        ax.set_ylabel("rollouts still running")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    _save(fig, out / "rollout_batch.png")
    plt.close(fig)
    files.append(out / "rollout_batch.png")
    return files


def plot_training(log: str | Path, out: str | Path) -> Path:
    """PNG of a GRPO JSON-lines log (``integrations.rl.grpo``, ``log.json``): reward, length, KL, acceptance per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in (json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()) if "step" in r]
    x = [r["step"] for r in steps]
    panels = [("reward_mean", "mean reward"), ("mean_len", "mean length (tokens)"), ("truncated", "truncated fraction"),
              ("approx_kl", "approx. KL (sampling vs updated)"), ("acceptance_length", "acceptance length"), ("rollout_s", "rollout wall time (s)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.0 * len(panels), 2.8))
    for ax, (k, label) in zip(axes, panels):
        ax.plot(x, [r[k] for r in steps], marker="o")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out)
    _save(fig, out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    cpu_runtime.reexec_with_iomp()
    a = sys.argv[1:] if argv is None else list(argv)
    if a[:1] == ["--plot-training"]:
        if len(a) != 3:
            print("usage: python -m benchmarks.rollout --plot-training LOG.jsonl OUT.png", file=sys.stderr)
            return 2
        print(f"wrote {plot_training(a[1], a[2])}")
        return 0
    args = parse_args(argv)
    cpu_runtime.apply_cpu_defaults()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from integrations.vllm_ext.engine import drop_unavailable

    args.methods = drop_unavailable(args.methods, "benchmarks.rollout")
    from tqdm import tqdm

    from integrations.results import check_output_path, provenance, write_atomic

    try:  # before the run, not after it
        for f in output_files(args):
            check_output_path(f, overwrite=args.overwrite)
    except ValueError as exc:
        print(f"benchmarks.rollout: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    total = len(args.data) * args.iterations * (len(args.methods) + 1)
    with tqdm(total=total, desc="rollout benchmark (iterations)", unit="it", file=sys.stderr) as bar:
        for data in args.data:
            rep = run_dataset(data, args, bar)
            rep = {**provenance("python -m benchmarks.rollout", argv), **rep}
            write_atomic(out / f"rollout_{data}.json", json.dumps(rep, indent=1))
            reports.append(rep)
    text = "\n\n".join(format_tables(r) for r in reports)
    write_atomic(out / "rollout.md", text + "\n")
    print(text)
    if not args.no_plots:
        for f in plot(reports, out):
            print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
