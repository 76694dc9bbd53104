"""An A/B of whole RL runs: ``das-grpo --recipe R --compare none,das --json out.json``.

Trains the same recipe once per speculative method in one process, one engine and one trainer
each (:class:`integrations.rl.grpo.PolicyRun`), alternating the methods step by step (A B, then B
A, ...) so that drift in the machine's speed falls on every method alike. Everything that decides
what a run learns is shared (:func:`integrations.rl.workload.plan_workload`): the problems of every
step, their prompts, the seeds of the engines and of the trainers, the initial weights. Coupled
sampling is on (:mod:`integrations.vllm_ext.patches.coupled_sampling`): a rollout's token at each index is
fixed by its sample key (from the step's seed and its place in the batch) and the policy's
distribution there, whatever the drafts. So where the engines' logits agree bit for bit (float32)
every method samples the same rollouts, gets the same rewards (a rollout sampled by several methods
is scored once, :class:`integrations.rl.workload.Scorer`, each method charged its seconds), computes
the same loss and ends the step with the same weights; the report says how far that held.
In bfloat16 a verification forward (several query tokens per row) can round differently from a plain
decode step, a flipped token changes the rest of its rollout and the runs drift apart while staying
equal in distribution; the report names the dtype.

The report (JSON; the keys the checks read first)::

    {"engine_dtype": "float32", "identical_rollouts": 1.0, "max_reward_diff": 0.0, "max_loss_diff": 0.0,
     "methods": {"none": {"steps": [{"rollout_s", "tokens", "tokens_per_s", "tail_s", "acceptance_length",
                                     "score_s", "train_s", "sync_s", "step_s", "reward_mean", "loss", ...}],
                          "summary": {...}},
                 "das": {...}},
     "speedup": {"das": {"rollout_tokens_per_s": ..., "rollout_s": ..., "step_s": ...}},
     "steps": [{"step", "problems", "identical", "reward_diff", "loss_diff"}],
     "final_weights_identical": true, "max_weight_diff": 0.0, "cpu": "...", "code_version": "...", ...}

``tail_s`` is the seconds from 90% of a step's rollouts finished to the last; ``step_s`` is rollout
+ reward + train + sync seconds (plus bookkeeping). ``speedup`` is against the first method: its
tokens per second in the rollout phase, its total rollout seconds and its total step seconds over
the method's. A PNG beside the JSON overlays the methods' reward curves and splits every step's
seconds into rollout, reward, train and sync.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from integrations.rl.recipes import Recipe, load_recipe

__all__ = ["parse_methods", "method_recipe", "compare", "build_report", "format_report", "plot_report", "code_version", "main"]

REPO = Path(__file__).resolve().parents[2]
_DROPPED = ("problems", "draft_caps", "tail10_s")  # step-record keys the report leaves out (tail10_s becomes tail_s)


def parse_methods(text: str) -> list[str]:
    """``"none,das"`` -> ``["none", "das"]``.

    Raises:
        ValueError: an unknown method, a repeated one, or fewer than two.
    """
    from integrations.vllm_ext.engine import METHODS

    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ValueError(f"unknown methods {bad}; expected some of {list(METHODS)}")
    if len(set(methods)) != len(methods) or len(methods) < 2:
        raise ValueError(f"expected two or more different methods, e.g. none,das; got {text!r}")
    return methods


def method_recipe(rec: Recipe, method: str) -> Recipe:
    """``rec`` with speculative method ``method`` and coupled sampling on. Every speculative method
    drafts up to the recipe's ``speculative.num_speculative_tokens``; the per-request length budget
    (``scheduler.budget``) applies to das only."""
    over = [f"speculative.method={method}", "rollout.coupled_sampling=true"] + (["scheduler.budget=null"] if method != "das" else [])
    return load_recipe(rec.to_dict(), over)


def compare(rec: Recipe, methods: Sequence[str], policy_run: Callable[[Recipe, Any], Any], *,
            reward_fn: Callable[[Sequence[Any], Sequence[str]], Sequence[Any]] | None = None, progress: bool = True) -> dict[str, Any]:
    """Train ``rec`` once per method, side by side (see the module doc); returns the report.

    Args:
        rec: the recipe (its ``speculative.method`` is replaced by each of ``methods``).
        methods: two or more speculative methods (:func:`parse_methods`); the first is the baseline.
        policy_run: ``policy_run(recipe, workload)`` builds one method's run
            (:class:`integrations.rl.grpo.PolicyRun`, passed in by the ``das-grpo`` CLI, which this
            module lies above: the GRPO loop does not import its A/B).
        reward_fn: as :func:`integrations.rl.grpo.run`'s.
        progress: a progress bar on stderr.
    """
    import torch

    from integrations.rl.workload import Scorer, plan_workload
    from integrations.vllm_ext.cpu_runtime import RuntimeSettings, read_cpu_info

    if not rec.rollout.coupled_sampling:
        print("das-grpo: note: --compare turns rollout.coupled_sampling on (the methods sample the same rollouts)", file=sys.stderr)
    recs = {m: method_recipe(rec, m) for m in methods}
    work = plan_workload(recs[methods[0]], reward_fn)
    if "reasons" in work.cpu_settings:
        print(RuntimeSettings(**work.cpu_settings).header(), file=sys.stderr)
    if work.engine_dtype != "float32":
        print(f"das-grpo: note: the engine runs in {work.engine_dtype}: rollouts are token-for-token identical across methods only "
              "in float32 (rollout.dtype=float32); in other dtypes they agree in distribution", file=sys.stderr)
    scorer = Scorer(rec, reward_fn, memo=True)
    runs: dict[str, Any] = {}
    records: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    outputs: dict[str, list[list[list[int]]]] = {m: [] for m in methods}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=rec.steps * len(methods), desc=f"grpo A/B ({','.join(methods)})", unit="step", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        for m in methods:
            runs[m] = policy_run(recs[m], work)
        for m in methods:  # after every engine is built: the first timed step pays no one-off cost
            runs[m].warm_up()
        for step in range(rec.steps):
            for m in (methods if step % 2 == 0 else methods[::-1]):
                record, batch, _ = runs[m].step(step, scorer)
                records[m].append(record)
                outputs[m].append([list(r.output_ids) for r in batch.rollouts])
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix_str(f"{m} step {step}: {record['tokens_per_s']:.0f} tok/s, roll {record['rollout_s']:.0f}s, "
                                        f"train {record['train_s']:.0f}s, reward {record['reward_mean']:+.3f}")
        wall = time.perf_counter() - t0
        weights = [dict(runs[m].trainer.model.named_parameters()) for m in methods]
        max_weight_diff = max((float((w[k].detach() - weights[0][k].detach()).abs().max()) for w in weights[1:] for k in weights[0]), default=0.0)
        weights_equal = all(torch.equal(w[k], weights[0][k]) for w in weights[1:] for k in weights[0])
    finally:
        if bar is not None:
            bar.close()
        for r in runs.values():
            r.close()
    report = build_report(records, outputs)
    report.update(final_weights_identical=weights_equal, max_weight_diff=max_weight_diff, engine_dtype=work.engine_dtype,
                  cpu=read_cpu_info().model_name, code_version=code_version(), model=work.model_dir, cpu_settings=work.cpu_settings,
                  wall_s=round(wall, 1), max_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
                  recipe=rec.to_dict(), compared=list(methods), coupled_sampling=True, reward_memo=True,
                  title=f"{rec.data}: {len(work.schedule[0]) if work.schedule else 0} problems x {rec.rollout.samples} samples per step, "
                        f"{rec.rollout.max_tokens} tokens max, {rec.steps} steps, {work.engine_dtype}")
    return report


def build_report(records: dict[str, list[dict[str, Any]]], outputs: dict[str, list[list[list[int]]]]) -> dict[str, Any]:
    """The A/B report of per-method step records and rollout token ids (``outputs[method][step][rollout]``).

    ``identical_rollouts``: the fraction of rollouts (all steps) whose tokens are the same in every
    method; ``max_reward_diff`` / ``max_loss_diff``: the largest spread between methods of a step's
    reward mean / loss. Raises ``ValueError`` when the methods ran different numbers of steps or rollouts.
    """
    methods = list(records)
    base = methods[0]
    n_steps = {len(records[m]) for m in methods} | {len(outputs[m]) for m in methods}
    if len(n_steps) != 1:
        raise ValueError(f"methods ran different numbers of steps: { {m: len(records[m]) for m in methods} }")
    steps, same, total = [], 0, 0
    for s in range(len(records[base])):
        outs = [outputs[m][s] for m in methods]
        if len({len(o) for o in outs}) != 1:
            raise ValueError(f"step {s}: methods sampled different numbers of rollouts: {[len(o) for o in outs]}")
        k = sum(all(o[i] == outs[0][i] for o in outs[1:]) for i in range(len(outs[0])))
        same, total = same + k, total + len(outs[0])
        rewards = [records[m][s]["reward_mean"] for m in methods]
        losses = [records[m][s]["loss"] for m in methods]
        steps.append({"step": s, "problems": records[base][s].get("problems"), "identical": k / max(1, len(outs[0])),
                      "reward_diff": max(rewards) - min(rewards), "loss_diff": max(losses) - min(losses)})
    report: dict[str, Any] = {
        "identical_rollouts": same / total if total else 1.0,
        "max_reward_diff": max((s["reward_diff"] for s in steps), default=0.0),
        "max_loss_diff": max((s["loss_diff"] for s in steps), default=0.0),
        "methods": {m: {"steps": [_entry(r) for r in records[m]], "summary": _summary(records[m])} for m in methods},
        "steps": steps,
    }
    b = report["methods"][base]["summary"]
    report["speedup"] = {m: {"rollout_tokens_per_s": _ratio(s["tokens_per_s"], b["tokens_per_s"]), "rollout_s": _ratio(b["rollout_s"], s["rollout_s"]),
                             "step_s": _ratio(b["step_s"], s["step_s"])}
                         for m in methods[1:] for s in [report["methods"][m]["summary"]]}
    return report


def _entry(record: dict[str, Any]) -> dict[str, Any]:
    return {**{k: v for k, v in record.items() if k not in _DROPPED}, "tail_s": record.get("tail10_s", 0.0)}


def _summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: round(sum(r[k] for r in records), 3) for k in ("rollout_s", "tail10_s", "score_s", "train_s", "sync_s", "step_s")}
    out["tail_s"] = out.pop("tail10_s")
    tokens = sum(r["tokens"] for r in records)
    verify = sum(r["tokens"] - r["accepted_tokens"] for r in records)
    out.update(tokens=tokens, tokens_per_s=round(tokens / out["rollout_s"], 2) if out["rollout_s"] else 0.0,
               acceptance_length=round(tokens / max(1, verify), 4),
               reward_mean=sum(r["reward_mean"] for r in records) / len(records) if records else 0.0,
               reward_last=records[-1]["reward_mean"] if records else None)
    return out


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def code_version() -> str | None:
    """``git describe --always --dirty`` of this checkout (``--tags`` names when there are tags), or None without git."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--tags"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    version = out.stdout.strip() if out.returncode == 0 else ""
    return version or None


def format_report(report: dict[str, Any]) -> str:
    """Per-step and per-method tables, and the identity line, as text (tabulate)."""
    from tabulate import tabulate

    cols = [("roll_s", "rollout_s"), ("tokens", "tokens"), ("tok/s", "tokens_per_s"), ("tail_s", "tail_s"), ("acc_len", "acceptance_length"),
            ("score_s", "score_s"), ("train_s", "train_s"), ("sync_s", "sync_s"), ("step_s", "step_s"), ("reward", "reward_mean"), ("loss", "loss")]
    rows = [[m, e["step"], *(e[k] for _, k in cols)] for m, d in report["methods"].items() for e in d["steps"]]
    head = ["method", "step", *(h for h, _ in cols)]
    scols = [("roll_s", "rollout_s"), ("tokens", "tokens"), ("tok/s", "tokens_per_s"), ("tail_s", "tail_s"), ("acc_len", "acceptance_length"),
             ("score_s", "score_s"), ("train_s", "train_s"), ("sync_s", "sync_s"), ("step_s", "step_s")]
    srows = []
    for m, d in report["methods"].items():
        sp = report["speedup"].get(m, {})
        srows.append([m, *(d["summary"][k] for _, k in scols), *(f"{sp[k]:.2f}x" if sp.get(k) else "-" for k in ("rollout_tokens_per_s", "step_s"))])
    shead = ["method", *(h for h, _ in scols), "tok/s_vs_base", "step_vs_base"]
    line = (f"identical rollouts {report['identical_rollouts']:.3f}, max reward diff {report['max_reward_diff']:.3g}, "
            f"max loss diff {report['max_loss_diff']:.3g}, final weights identical: {report.get('final_weights_identical')}")
    return tabulate(rows, head, floatfmt=".4g") + "\n\n" + tabulate(srows, shead, floatfmt=".4g") + "\n\n" + line


def plot_report(report: dict[str, Any], path: str | Path) -> Path | None:
    """PNG: the methods' reward curves overlaid, and every step's seconds split into rollout, reward, train and sync."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from integrations.results import save_figure

    methods = list(report["methods"])
    fig, (ax_r, ax_t) = plt.subplots(1, 2, figsize=(12, 4.2))
    markers, styles = "osD^v", ["-", "--", ":", "-."]
    for j, m in enumerate(methods):
        st = report["methods"][m]["steps"]
        ax_r.plot([e["step"] for e in st], [e["reward_mean"] for e in st], marker=markers[j % 5], linestyle=styles[j % 4],
                  markersize=9 - 3 * j, label=m, alpha=0.85)
    steps = [e["step"] for e in report["methods"][methods[0]]["steps"]]
    for ax in (ax_r, ax_t):
        ax.set_xticks(steps)
    ax_r.set_xlabel("GRPO step")
    ax_r.set_ylabel("reward mean")
    ax_r.set_title(f"reward (identical rollouts {report['identical_rollouts']:.1%})", fontsize=9)
    ax_r.grid(alpha=0.3)
    ax_r.legend(fontsize=8)
    parts = [("rollout_s", "rollout", "tab:blue"), ("score_s", "reward", "tab:gray"), ("train_s", "train", "tab:orange"), ("sync_s", "sync", "tab:green")]
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        st = report["methods"][m]["steps"]
        x = [e["step"] - 0.4 + width * (j + 0.5) for e in st]
        bottom = [0.0] * len(st)
        for key, label, color in parts:
            h = [e[key] for e in st]
            ax_t.bar(x, h, width * 0.95, bottom=bottom, color=color, label=label if j == 0 else None, hatch="//" if j else None,
                     edgecolor="white" if j else None)
            bottom = [b + v for b, v in zip(bottom, h)]
        for xi, top in zip(x, bottom):
            ax_t.text(xi, top, m, ha="center", va="bottom", fontsize=6, rotation=90)
    ax_t.margins(y=0.12)  # room for the method names over the bars
    ax_t.set_xlabel("GRPO step")
    ax_t.set_ylabel("seconds")
    sp = report["speedup"].get(methods[-1], {})
    ax_t.set_title(f"step time ({methods[-1]} vs {methods[0]}: rollout tok/s {sp.get('rollout_tokens_per_s') or 0:.2f}x, "
                   f"step {sp.get('step_s') or 0:.2f}x)", fontsize=9)
    ax_t.legend(fontsize=8)
    ax_t.grid(alpha=0.3, axis="y")
    fig.suptitle(report.get("title", "GRPO A/B"), fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)


def main(p: argparse.ArgumentParser, args: argparse.Namespace, check_recipe: Callable[[argparse.ArgumentParser, argparse.Namespace], Recipe],
         policy_run: Callable[[Recipe, Any], Any]) -> int:
    """``das-grpo --compare``: check the methods, output paths and recipe (``p.error``, exit status 2), run, print, write.

    ``check_recipe`` and ``policy_run``: :func:`integrations.rl.grpo.check_recipe` and
    :class:`integrations.rl.grpo.PolicyRun`, given by the CLI (:func:`integrations.rl.grpo.main`)."""
    from integrations.results import check_output_path, write_atomic
    from integrations.vllm_ext.engine import drop_unavailable

    try:
        methods = parse_methods(args.compare)
    except ValueError as exc:
        p.error(f"--compare {args.compare}: {exc}")
    methods = drop_unavailable(methods, "das-grpo")
    if len(methods) < 2:
        p.error(f"--compare {args.compare}: fewer than two methods available")
    from integrations.vllm_ext.patches.coupled_sampling import unsupported_reason

    if (why := unsupported_reason()) is not None:  # --compare's identical rollouts need coupled sampling
        p.error(f"--compare: {why}")
    png = None
    if args.json:
        png = Path(args.json).with_suffix(".png")
        for path in (args.json, png):
            try:
                check_output_path(path, overwrite=args.overwrite)
            except ValueError as exc:
                p.error(f"--json: {exc}")
    rec = check_recipe(p, args)
    report = compare(rec, methods, policy_run, progress=rec.log.progress)
    print(format_report(report))
    if args.json:
        write_atomic(args.json, json.dumps(report, indent=1, default=_jsonable))
        print(f"wrote {args.json}")
        if plot_report(report, png) is not None:
            print(f"wrote {png}")
    return 0


def _jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)

