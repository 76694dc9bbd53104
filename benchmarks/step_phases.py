"""Where an engine step's time goes, by phase of vLLM's model runner, for a das-rollout run.

``python -m benchmarks.step_phases [--jsonl PATH] -- DAS-ROLLOUT ARGS``

Runs ``das-rollout`` with the given arguments (one method: add ``--compare ''``) in this process
and times, for every decode step of the engine, the phases of vLLM 0.32's ``GPUModelRunner``
(the CPU runner inherits them): the forward pass (``_model_forward``), sampling and verification
(``_sample``: the bonus tokens and the rejection sampler), the proposer (``propose_draft_token_ids``:
das's bookkeeping, inserts and drafts) and the input preparation. Each phase's milliseconds per
step are then fitted by least squares as ``a + b * rows + c * draft_tokens + d * [step has
drafts]`` (what DAS's Eq. 1 prices, split by regime as in :mod:`scheduler.step_price`), and
printed with the medians by batch size. ``--jsonl`` writes one line per step: ``rows``,
``draft_tokens``, ``context_tokens`` (KV tokens of the batch's rows), and each phase's seconds.

For comparing two versions of the code on one machine: run it for each, in turns. The timers
add about 1 us per phase and step. Steps longer than 0.3 s (prefill of a new batch, warm-up)
are left out of the fit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

import numpy as np

PHASES = ("_update_states", "_prepare_inputs", "_model_forward", "_sample", "_bookkeeping_sync", "propose_draft_token_ids")


def _instrument(steps: list[dict]) -> None:
    """Wrap the model runner's phases with timers; each finished step appends its record to ``steps``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as Runner

    current: dict = {}

    def timed(name):
        original = getattr(Runner, name)

        def wrapper(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                current[name] = current.get(name, 0.0) + time.perf_counter() - t0

        setattr(Runner, name, wrapper)

    for name in PHASES:
        timed(name)
    execute, sample_tokens = Runner.execute_model, Runner.sample_tokens

    def execute_model(self, scheduler_output, *args, **kwargs):
        current.clear()
        batch = self.input_batch
        current.update(
            rows=len(scheduler_output.num_scheduled_tokens),
            draft_tokens=sum(len(v) for v in (scheduler_output.scheduled_spec_decode_tokens or {}).values()),
            context_tokens=int(batch.num_tokens_no_spec[: batch.num_reqs].sum()),
            t0=time.perf_counter(),
        )
        return execute(self, scheduler_output, *args, **kwargs)

    def sample_then_record(self, *args, **kwargs):
        out = sample_tokens(self, *args, **kwargs)
        if current.get("rows"):
            rec = {k: v for k, v in current.items() if k != "t0"}
            rec["step"] = time.perf_counter() - current["t0"]
            steps.append(rec)
            current.clear()
        return out

    Runner.execute_model, Runner.sample_tokens = execute_model, sample_then_record


def fit(steps: list[dict], phase: str) -> tuple[np.ndarray, float]:
    """``([a, b, c, d], rmse)`` in ms of ``phase`` against ``1, rows, draft_tokens, [draft_tokens > 0]``."""
    rows = np.array([s["rows"] for s in steps], np.float64)
    drafts = np.array([s["draft_tokens"] for s in steps], np.float64)
    y = np.array([s.get(phase, 0.0) for s in steps]) * 1e3
    x = np.column_stack([np.ones_like(rows), rows, drafts, (drafts > 0).astype(np.float64)])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return coef, float(np.sqrt(np.mean((y - x @ coef) ** 2)))


def report(steps: list[dict]) -> str:
    """The fit table and the medians by batch size, as text."""
    steps = [s for s in steps if s["step"] < 0.3]
    lines = [f"{len(steps)} decode steps; ms per step = a + b * rows + c * draft tokens + d * [step has drafts]", ""]
    lines.append(f"{'phase':<26}{'a':>8}{'b (row)':>10}{'c (draft)':>11}{'d (drafted)':>13}{'rmse':>8}")
    for phase in ("step",) + PHASES:
        coef, rmse = fit(steps, phase)
        lines.append(f"{phase:<26}" + "".join(f"{v:>{w}.3f}" for v, w in zip(coef, (8, 10, 11, 13))) + f"{rmse:>8.2f}")
    lines += ["", f"{'rows':>6}{'drafts?':>9}{'steps':>7}{'drafts':>8}" + "".join(f"{p[:12]:>14}" for p in ("step",) + PHASES)]
    groups = defaultdict(list)
    for s in steps:
        r = s["rows"]
        groups[(r if r <= 4 else 8 if r <= 8 else 16 if r <= 16 else 32 if r <= 32 else 64, s["draft_tokens"] > 0)].append(s)
    for (r, drafted), group in sorted(groups.items()):
        if len(group) < 5:
            continue
        med = [np.median([s.get(p, 0.0) for s in group]) * 1e3 for p in ("step",) + PHASES]
        lines.append(f"{'<=' + str(r):>6}{'yes' if drafted else 'no':>9}{len(group):>7}{np.median([s['draft_tokens'] for s in group]):>8.0f}"
                     + "".join(f"{m:>14.2f}" for m in med))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_phases", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jsonl", help="write one JSON line per decode step here")
    parser.add_argument("rollout_args", nargs=argparse.REMAINDER, help="das-rollout's arguments, after --")
    args = parser.parse_args(argv)
    from integrations.vllm_ext import cpu_runtime

    if argv is None:  # as das-rollout does: preload Intel OpenMP where chosen (re-executes once)
        cpu_runtime.reexec_with_iomp()
    rollout_args = args.rollout_args[1:] if args.rollout_args[:1] == ["--"] else args.rollout_args
    from integrations import rollout
    from integrations.vllm_ext import patches

    patches.apply()  # vLLM's modules as the engine will run them, before the runner is wrapped
    steps: list[dict] = []
    _instrument(steps)
    rc = rollout.main(rollout_args)
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            for s in steps:
                f.write(json.dumps(s) + "\n")
    print(report(steps))
    return rc


if __name__ == "__main__":
    sys.exit(main())
