"""GPU smoke test: ``none`` against ``das`` on the same prompts, outputs compared, a speed table.

For a user with one GPU and a CUDA build of vLLM in the ``cuda`` extra's range (docs/gpu.md). The
defaults are sized for well under 10 minutes on one GPU (two engine starts with their compilation
and CUDA-graph capture, then 2 x 2 batches of 8 prompts x 8 samples of up to 512 tokens of a 1.5B
model); not yet timed on a GPU (this project has none)::

    python -m benchmarks.gpu_smoke --model Qwen/Qwen2.5-1.5B-Instruct
    python -m benchmarks.gpu_smoke --dry-run     # the same code path on the CPU build, tiny model, seconds

Each method runs in its own engine, one after the other, on the same prompts (the embedded CHAMP
math problems, ``--samples`` rollouts each, as a GRPO group), ``--iterations`` times (das drafts
from the group's siblings and from the earlier iterations). Outputs are compared token for token:

- on vLLM's CPU build the rollouts are keyed (coupled sampling,
  :mod:`integrations.vllm_ext.patches.coupled_sampling`), so at ``--temperature`` > 0 both methods
  sample the same tokens wherever their logits agree bit for bit (float32: whole runs);
- on a CUDA build coupled sampling does not run (docs/gpu.md, "Coupled sampling"): the comparison is
  greedy (temperature 0), where a lossless method gives the plain engine's tokens as long as the
  verification forward's logits round as the plain forward's do. GPU kernels are not batch
  invariant (a K+1-token verification row is another matmul shape than a 1-token row), so a
  difference late in a long rollout can be rounding, not a bug; ``--batch-invariant`` sets vLLM's
  ``VLLM_BATCH_INVARIANT=1`` to take that out.

The table gives per method: wall seconds, output tokens, tokens per second, draft tokens, accepted
tokens, acceptance rate and the speed-up over ``none``. Exit status 0 when every rollout matched,
1 when some differ (the first difference of each is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

METHODS = ("none", "das")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_smoke", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Qwen/Qwen2.5-1.5B-Instruct", help="Hugging Face model name or local directory")
    p.add_argument("--prompts", type=int, default=8, help="problems (GRPO groups)")
    p.add_argument("--samples", type=int, default=8, help="rollouts per problem (the group size)")
    p.add_argument("--iterations", type=int, default=2, help="batches per method (das drafts from the earlier ones too)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=None,
                   help="default: 0.6 where coupled sampling runs (vLLM's CPU build), 0 (greedy) on a CUDA build")
    p.add_argument("--num-spec-tokens", type=int, default=16, help="K, das's most draft tokens per row and step")
    p.add_argument("--dtype", default=None, help="model dtype (default: float32 on the CPU build, bfloat16 on a GPU)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--batch-invariant", action="store_true", help="set VLLM_BATCH_INVARIANT=1 (vLLM's batch-invariant kernels)")
    p.add_argument("--json", default=None, help="write the table and the comparison to this JSON file")
    p.add_argument("--dry-run", action="store_true",
                   help="the tiny test model on vLLM's CPU build, 2 problems x 2 samples x 16 tokens (a check of this script)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.prompts, args.samples, args.iterations, args.max_tokens, args.max_model_len = 2, 2, 2, 16, 2048
    for name in ("prompts", "samples", "iterations", "max_tokens", "num_spec_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def compare_outputs(a: list[list[int]], b: list[list[int]]) -> list[dict[str, Any]]:
    """Rollouts that differ between two runs of the same requests: ``{"rollout", "at", "a", "b"}``
    per differing rollout (``at``: index of the first differing token; ``a``/``b``: 8 tokens from there).

    Raises:
        ValueError: the runs hold different numbers of rollouts.
    """
    if len(a) != len(b):
        raise ValueError(f"the runs differ in rollouts: {len(a)} against {len(b)}")
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            at = next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
            out.append({"rollout": i, "at": at, "a": x[at:at + 8], "b": y[at:at + 8]})
    return out


def speed_table(rows: dict[str, dict[str, float]]) -> str:
    """The speed table (tabulate), the first method the baseline of the speed-up column."""
    from tabulate import tabulate

    base = next(iter(rows.values()))
    table = []
    for name, r in rows.items():
        rate = r["accepted_tokens"] / r["draft_tokens"] if r["draft_tokens"] else 0.0
        table.append([name, f"{r['wall_s']:.2f}", int(r["output_tokens"]), f"{r['output_tokens'] / r['wall_s']:.1f}",
                      int(r["draft_tokens"]), int(r["accepted_tokens"]), f"{rate:.2f}", f"{base['wall_s'] / r['wall_s']:.2f}x"])
    return tabulate(table, headers=["method", "wall s", "output tokens", "tokens/s", "draft tokens", "accepted", "acceptance", "speed-up"])


def _model(args: argparse.Namespace) -> str:
    if not args.dry_run:
        return args.model
    from integrations.data.models import build_tiny_model

    return str(build_tiny_model(Path(tempfile.mkdtemp(prefix="das-gpu-smoke-")) / "llama", seed=0))


def run_method(method: str, model: str, prompts: list[list[int]], pids: list[str], args: argparse.Namespace,
               coupled: bool) -> tuple[dict[str, float], list[list[int]]]:
    """One engine for ``method``: ``--iterations`` batches of the prompts; its totals and every rollout's tokens."""
    from integrations.vllm_ext.engine import close_llm, make_llm, release_engine_state
    from integrations.vllm_ext.rollouts import generate_rollouts

    llm = make_llm(model, method=method, num_speculative_tokens=args.num_spec_tokens, dtype=args.dtype,
                   max_model_len=args.max_model_len, das_config={"budget": "fixed"} if args.dry_run and method == "das" else None)
    totals = {"wall_s": 0.0, "output_tokens": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}
    outputs: list[list[int]] = []
    try:
        for it in range(args.iterations):
            batch = generate_rollouts(llm, prompts, pids, samples=args.samples, max_tokens=args.max_tokens,
                                      temperature=args.temperature, seed=it, das=method == "das", coupled=coupled)
            totals["wall_s"] += batch.wall_time_s
            totals["output_tokens"] += sum(len(r.output_ids) for r in batch.rollouts)
            totals["draft_tokens"] += batch.draft_tokens
            totals["accepted_tokens"] += batch.accepted_tokens
            outputs += [list(r.output_ids) for r in batch.rollouts]
    finally:
        close_llm(llm)
        del llm
        release_engine_state()
    return totals, outputs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.batch_invariant:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    from integrations.vllm_ext.cpu_runtime import is_cpu_build
    from integrations.vllm_ext.patches.coupled_sampling import unsupported_reason

    if args.dry_run and not is_cpu_build():
        print("gpu_smoke: --dry-run runs on vLLM's CPU build (the main venv); this is a CUDA build: run without --dry-run",
              file=sys.stderr)
        return 2
    why = unsupported_reason()
    coupled = why is None
    if args.temperature is None:
        args.temperature = 0.6 if coupled else 0.0
    if args.temperature > 0 and not coupled:
        print(f"gpu_smoke: --temperature {args.temperature} needs coupled sampling to compare outputs, and {why}; "
              "use --temperature 0", file=sys.stderr)
        return 2
    if args.dtype is None and is_cpu_build():
        args.dtype = "float32"  # rollouts are identical across methods in float32 (docs/gpu.md)
    from transformers import AutoTokenizer

    from integrations.data.problems import load_embedded, render_prompts

    model = _model(args)
    problems = load_embedded("math", limit=args.prompts)
    prompts = render_prompts(problems, AutoTokenizer.from_pretrained(model))
    pids = [p.problem_id for p in problems]
    print(f"gpu_smoke: {model}, {len(prompts)} problems x {args.samples} samples x {args.iterations} iterations, "
          f"max {args.max_tokens} tokens, temperature {args.temperature}, K {args.num_spec_tokens}, "
          f"{'coupled sampling' if coupled else 'greedy (' + why + ')'}", file=sys.stderr)
    rows, outputs = {}, {}
    for method in METHODS:
        t0 = time.perf_counter()
        rows[method], outputs[method] = run_method(method, model, prompts, pids, args, coupled)
        print(f"gpu_smoke: {method} done in {time.perf_counter() - t0:.0f} s (engine start included)", file=sys.stderr)
    differ = compare_outputs(outputs["none"], outputs["das"])
    print(speed_table(rows))
    n = len(outputs["none"])
    print(f"\nidentical rollouts: {n - len(differ)} of {n}")
    for d in differ[:10]:
        print(f"  rollout {d['rollout']}: first differs at token {d['at']}: none {d['a']} das {d['b']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "model": model, "coupled": coupled, "methods": rows,
                                               "rollouts": n, "differ": differ}, indent=1))
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
