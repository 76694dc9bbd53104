"""Lossless check on the real model: per-position token frequencies with and without DAS.

``python -m benchmarks.lossless [--data PATH] [--problem N] [--samples 256] [--tokens 160] [--budget fixed]``

Samples ``--samples`` rollouts of one problem's prompt without speculation and with DAS (after a
first iteration that fills the drafter's window, so the measured one drafts), with the CPU
settings das-rollout would choose (bf16 where the CPU has it: verification of several tokens in
one bf16 pass is the case the tiny-model test in ``tests/test_engine_lossless.py``, float32, does
not cover), and prints a two-sample chi-square test of the token frequencies per band of output
positions (bins with fewer than 10 counts merged per position; critical value at alpha = 1e-4,
Wilson-Hilferty). A statistic above its critical value means the sampled distributions differ.

``--eos``: rollouts stop at EOS (or the cap) instead, and the output lengths are compared: mean,
median, share at the cap, and the Mann-Whitney U test's z (|z| > 3.9: the length distributions
differ at alpha = 1e-4), the check for loops to the cap, which start later than a few hundred
tokens.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np


def chi_square(a: np.ndarray, b: np.ndarray, lo: int, hi: int) -> tuple[float, int, float]:
    """Two-sample chi-square over positions ``[lo, hi)`` of ``a`` and ``b`` (int ``[samples, tokens]``).

    Returns ``(statistic, degrees of freedom, critical value at alpha = 1e-4)``.
    """
    stat, dof = 0.0, 0
    for p in range(lo, hi):
        ta, tb = np.bincount(a[:, p], minlength=1 << 17), np.bincount(b[:, p], minlength=1 << 17)
        big = (ta + tb) >= 10
        ra, rb = np.append(ta[big], ta[~big].sum()), np.append(tb[big], tb[~big].sum())
        keep = (ra + rb) > 0
        ra, rb = ra[keep], rb[keep]
        if len(ra) < 2:
            continue
        tot, na, nb = ra + rb, ra.sum(), rb.sum()
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += float(((ra - ea) ** 2 / ea).sum() + ((rb - eb) ** 2 / eb).sum())
        dof += len(tot) - 1
    if dof == 0:
        return stat, 0, 0.0
    z = 3.719  # one-sided normal quantile, alpha = 1e-4
    return stat, dof, dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="leetcode", help="problems (as das-rollout --data; $DAS_DATA_DIR as there)")
    p.add_argument("--problem", type=int, default=788, help="index of the problem whose prompt is sampled")
    p.add_argument("--samples", type=int, default=256, help="rollouts per method")
    p.add_argument("--tokens", type=int, default=160, help="output tokens per rollout (EOS ignored)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--budget", default="fixed", help="DAS budget (fixed: drafts whenever the drafter matches, the most verification)")
    p.add_argument("--bands", type=int, default=4, help="position bands to test separately")
    p.add_argument("--eos", action="store_true", help="stop at EOS and compare output lengths instead of tokens")
    args = p.parse_args(argv)
    if args.samples < 20 or args.tokens < args.bands or args.bands < 1:
        p.error(f"need --samples >= 20 and --tokens >= --bands >= 1, got {args.samples}, {args.tokens}, {args.bands}")

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from integrations.vllm_ext import cpu_runtime

    chosen = cpu_runtime.apply_cpu_defaults(None)
    import torch
    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    from integrations.data.models import resolve_model
    from integrations.data.problems import load_problems, render_prompts
    from integrations.data.registry import data_dir_from_env
    from integrations.vllm_ext import control
    from integrations.vllm_ext.engine import make_llm, spec_counters

    model = resolve_model(None)
    problems = load_problems(args.data, data_dir=data_dir_from_env())
    if not 0 <= args.problem < len(problems):
        p.error(f"--problem must be in [0, {len(problems)}), got {args.problem}")
    prompt = render_prompts([problems[args.problem]], AutoTokenizer.from_pretrained(model))[0]
    params = SamplingParams(n=1, temperature=args.temperature, max_tokens=args.tokens, ignore_eos=not args.eos,
                            extra_args={"das_problem_id": "lossless"})

    def sample(llm, seed):
        torch.manual_seed(seed)
        outs = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * args.samples, params, use_tqdm=False)
        rows = [list(o.outputs[0].token_ids) for o in outs]
        return rows if args.eos else np.array(rows, np.int64)

    print(f"cpu: {chosen}", file=sys.stderr)
    out, info = {}, {}
    for method in ("none", "das"):
        llm = make_llm(model, method, max_model_len=len(prompt) + args.tokens + 64,
                       das_config={"budget": args.budget} if method == "das" else None)
        if method == "das":  # a first iteration fills the drafter's window; the second is measured
            control.begin_iteration(llm, 1)
            sample(llm, 1)
            control.begin_iteration(llm, 2)
        before = spec_counters(llm)
        t0 = time.perf_counter()
        out[method] = sample(llm, 7)
        after = spec_counters(llm)
        info[method] = (time.perf_counter() - t0, after["draft_tokens"] - before["draft_tokens"],
                        after["accepted_tokens"] - before["accepted_tokens"])
        del llm
    print(f"problem {args.problem} ({len(prompt)} prompt tokens), {args.samples} samples x {args.tokens} tokens, "
          f"temperature {args.temperature}, dtype {chosen.dtype if chosen else 'default'}")
    for method, (secs, drafted, accepted) in info.items():
        print(f"  {method}: {secs:.1f} s, {int(drafted)} draft tokens, {int(accepted)} accepted")
    if args.eos:
        return _compare_lengths({m: np.array([len(r) for r in rows]) for m, rows in out.items()}, args.tokens)
    edges = np.linspace(0, args.tokens, args.bands + 1).astype(int)
    print(f"{'positions':>12} {'chi2':>9} {'dof':>6} {'critical':>9}  differs")
    worst = False
    for lo, hi in zip(edges[:-1], edges[1:]):
        stat, dof, crit = chi_square(out["none"], out["das"], lo, hi)
        worst |= stat > crit
        print(f"{f'{lo}-{hi}':>12} {stat:9.1f} {dof:6d} {crit:9.1f}  {'YES' if stat > crit else 'no'}")
    stat, dof, crit = chi_square(out["none"], out["das"], 0, args.tokens)
    print(f"{'all':>12} {stat:9.1f} {dof:6d} {crit:9.1f}  {'YES' if stat > crit else 'no'}")
    return 1 if worst or stat > crit else 0


def mann_whitney_z(a: np.ndarray, b: np.ndarray) -> float:
    """z of the Mann-Whitney U statistic of samples ``a`` and ``b`` (tie-corrected normal approximation)."""
    both = np.concatenate([a, b]).astype(np.float64)
    order = np.argsort(both, kind="stable")
    ranks = np.empty(len(both))
    ranks[order] = np.arange(1, len(both) + 1)
    for v in np.unique(both):  # average ranks over ties
        tie = both == v
        ranks[tie] = ranks[tie].mean()
    n1, n2 = len(a), len(b)
    u = ranks[:n1].sum() - n1 * (n1 + 1) / 2
    _, counts = np.unique(both, return_counts=True)
    n = n1 + n2
    var = n1 * n2 / 12 * ((n + 1) - (counts**3 - counts).sum() / (n * (n - 1)))
    return float((u - n1 * n2 / 2) / math.sqrt(var)) if var > 0 else 0.0


def _compare_lengths(lengths: dict[str, np.ndarray], cap: int) -> int:
    for m, x in lengths.items():
        print(f"  {m}: mean {x.mean():.1f} tokens, median {np.median(x):.0f}, at the cap {int((x >= cap).sum())} of {len(x)}")
    z = mann_whitney_z(lengths["das"], lengths["none"])
    print(f"  Mann-Whitney z (das vs none): {z:.2f} ({'differ' if abs(z) > 3.9 else 'no difference'} at alpha = 1e-4)")
    return 1 if abs(z) > 3.9 else 0


if __name__ == "__main__":
    raise SystemExit(main())
