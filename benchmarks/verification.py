"""What verifying draft tokens costs on the CPU: das's rejection sampler, alone.

``python -m benchmarks.verification [--vocab 49152] [--acceptance 0.4] [--repeats 50]``

Times ``integrations.vllm_ext.patches.lazy_rejection.rejection_sample`` (what das installs into vLLM
on the CPU build; vLLM's rejection sampler calls it once per engine step) for point-mass drafts
(n-gram, suffix and DAS drafts carry no probabilities) at several batch shapes (rows x draft
tokens per row), on synthetic target logits where each draft token has probability
``--acceptance`` (so about that share of positions is accepted, and the other rows need a
recovered token). The table gives the median milliseconds per call and per draft token.
vLLM's own ``rejection_sample`` runs triton-cpu kernels that need a live engine, so it is not
timed here (``benchmarks.step_phases`` times verification inside the engine). To compare two
versions of das, run this file with each version's checkout first on ``PYTHONPATH``.
Threads: torch's, as set in this process.
"""

from __future__ import annotations

import argparse
import sys
import time
import types

import numpy as np
import torch

SHAPES = ((1, 8), (2, 5), (4, 5), (16, 2), (32, 1), (32, 4))  # rows, draft tokens per row


def make_step(rows: int, per_row: int, vocab: int, acceptance: float, seed: int = 0) -> tuple:
    """One step's ``rejection_sample`` arguments: random logits with each draft token at ``acceptance``."""
    g = torch.Generator().manual_seed(seed)
    n = rows * per_row
    logits = torch.randn(n, vocab, generator=g) * 2
    drafts = torch.randint(0, vocab, (n,), generator=g)
    logits[torch.arange(n), drafts] = -torch.inf
    others = torch.logsumexp(logits, dim=-1)  # every token but the draft
    logits[torch.arange(n), drafts] = others + float(np.log(acceptance / (1 - acceptance)))
    counts = [per_row] * rows
    cu = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    bonus = torch.randint(0, vocab, (rows, 1), generator=g)
    meta = types.SimpleNamespace(all_greedy=False, all_random=True, temperature=torch.ones(rows), generators={})
    return drafts.to(torch.int32), counts, per_row, cu, None, logits, bonus, meta


def time_call(fn, args: tuple, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls ``fn(*args)``."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.verification", description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size (SmolLM2: 49,152)")
    parser.add_argument("--acceptance", type=float, default=0.4, help="probability of each draft token under the target")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    if not 0.0 < args.acceptance < 1.0:
        parser.error(f"--acceptance must be in (0, 1), got {args.acceptance}")
    from integrations.vllm_ext.patches import lazy_rejection

    print(f"rejection_sample, ms per call (median of {args.repeats}); vocab {args.vocab}, draft-token probability "
          f"{args.acceptance}, torch threads {torch.get_num_threads()}")
    print(f"{'rows':>5} {'drafts/row':>11} {'ms/call':>9} {'us/draft token':>15}")
    for rows, per_row in SHAPES:
        step = make_step(rows, per_row, args.vocab, args.acceptance)
        time_call(lazy_rejection.rejection_sample, step, 3)  # warm-up
        med = float(np.median(time_call(lazy_rejection.rejection_sample, step, args.repeats))) * 1e3
        print(f"{rows:>5} {per_row:>11} {med:>9.3f} {med * 1e3 / (rows * per_row):>15.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
