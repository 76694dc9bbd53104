"""A verl / NeMo-RL style GRPO loop on this machine: vLLM rollouts with DAS, torch updates, weight sync.

The engine takes the machine's CPU settings as ``das-rollout`` does
(:mod:`integrations.vllm_ext.cpu_runtime`; ``rollout.dtype: auto`` is float32 unless the CPU has
native bf16 matmuls, a recipe's explicit dtype wins) and runs one untimed warm-up batch. One step
(policy version ``v`` generates, then becomes ``v + 1``):

1. generate a GRPO group of ``rollout.samples`` rollouts for each of the step's problems
   (:func:`integrations.rl.workload.plan_workload`) with
   :func:`integrations.vllm_ext.rollouts.generate_rollouts`, the engine seeded with
   ``torch.manual_seed(seed * 1000003 + step)``;
2. score them (:mod:`integrations.rl.rewards`) and compute group-normalised advantages;
3. update the policy (:class:`integrations.rl.trainer.PolicyTrainer`: float32 master weights,
   AdamW, clipped token-level policy-gradient loss, ``train.mini_batches`` optimizer steps);
4. sync the weights into the running engine (:func:`integrations.vllm_ext.weight_sync.sync_weights`)
   and advance the drafter's window (:func:`integrations.vllm_ext.control.begin_iteration`).

``log.json`` writes one JSON line per step (rewards, loss, KL, rollout / train / sync seconds,
tokens per second, acceptance length); ``log.trace`` writes the rollouts as a trace for
``python -m benchmarks.replay --trace``. Speculative decoding is lossless, so the loop trains the
same with and without DAS; ``--compare none,das`` shows it step by step (:mod:`integrations.rl.ab`).
The details of each phase and of the logs are in ``docs/design.md`` ("Our GRPO loop").

Run: ``python -m integrations.rl.grpo --recipe recipes/grpo_dsr_sub.yaml [section.key=value ...]``,
or ``... --compare none,das --json ab.json`` for the A/B.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from integrations.rl.recipes import Recipe, load_recipe
from integrations.rl.trainer import PolicyTrainer, group_advantages
from integrations.rl.workload import Scorer, Workload, plan_workload
from integrations.vllm_ext import cpu_runtime
from integrations.vllm_ext.engine import close_llm, release_engine_state
from integrations.vllm_ext.rollouts import generate_rollouts

__all__ = [
    "group_advantages",
    "PolicyTrainer",
    "request_caps",
    "PolicyRun",
    "GRPOResult",
    "release_engine_state",
    "run",
    "main",
]

_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"


# ----------------------------------------------------------------------------------------------
# length-aware per-request budget


def request_caps(rec: Recipe, budget: str | None = None) -> Any:
    """The per-request draft caps of the recipe's ``scheduler.budget`` (or of ``budget``): a
    :class:`scheduler.budgets.RequestCaps` (``caps(problem_ids)`` before a step,
    ``observe(version, problem_ids, lengths)`` after it), or None: no per-request caps."""
    name = rec.scheduler.budget if budget is None else budget
    if name is None:
        return None
    from scheduler.budgets import RequestCaps

    s = rec.scheduler
    return RequestCaps(name, max_tokens=rec.rollout.max_tokens, max_draft=rec.speculative.num_speculative_tokens or 16, window=s.window,
                       long=s.long, medium=s.medium, short=s.short)


# ----------------------------------------------------------------------------------------------
# one method's engine and trainer


class PolicyRun:
    """One GRPO run's engine (its speculative method), trainer and policy version, stepped one GRPO step at a time.

    :func:`run` steps one; :func:`integrations.rl.ab.compare` steps one per method, alternating.

    Args:
        rec: the recipe (``speculative`` picks the engine's method).
        work: :func:`plan_workload`'s problems, prompts and CPU settings (shared by every method).
        weights_hook: called as ``weights_hook(policy_version, model)`` now and after every update.
    """

    def __init__(self, rec: Recipe, work: Workload, *, weights_hook: Callable[[int, Any], None] | None = None):
        from integrations.vllm_ext import control
        from integrations.vllm_ext.engine import make_llm

        self.rec, self.work, self.weights_hook = rec, work, weights_hook
        spec = rec.speculative
        self.method = spec.method
        self.das = spec.method == "das"
        self.trainer = PolicyTrainer(work.model_dir, rec.train, seed=rec.seed)
        self.driver = None
        self.budget = request_caps(rec)
        self.version = 0
        if rec.rollout.engines > 1:
            self.llm = None
            self.driver = self._start_engines()
            self.driver.sync_weights(self.trainer.model)  # the trainer's weights, as one engine gets them from the checkpoint
            if weights_hook is not None:
                weights_hook(self.version, self.trainer.model)
            return
        saved = os.environ.get(_KV_ENV)
        if work.kv_gib:
            os.environ[_KV_ENV] = str(work.kv_gib)
        try:
            self.llm = make_llm(work.model_dir, spec.method, num_speculative_tokens=spec.num_speculative_tokens if spec.method != "none" else None,
                                das_config=dict(spec.das) if self.das else None, dtype=rec.rollout.engine_dtype,
                                max_model_len=rec.rollout.max_model_len, seed=rec.seed)
        finally:
            if saved is None:
                os.environ.pop(_KV_ENV, None)
            else:
                os.environ[_KV_ENV] = saved
        if self.das:
            control.begin_iteration(self.llm, self.version)
        if weights_hook is not None:
            weights_hook(self.version, self.trainer.model)

    def _start_engines(self):
        """``rollout.engines`` Ray rollout workers (each bound to its own cores), one shared DAS history."""
        import ray

        from integrations.rl.ray_rollout import RayRolloutDriver

        rec, spec = self.rec, self.rec.speculative
        if not ray.is_initialized():
            cores = cpu_runtime.read_cpu_info().cores if cpu_runtime.is_cpu_build() else 0
            ray.init(num_cpus=max(cores, rec.rollout.engines), include_dashboard=False, log_to_driver=False)
        kwargs = {"num_speculative_tokens": spec.num_speculative_tokens if spec.method != "none" else None,
                  "das_config": dict(spec.das) if self.das else None, "dtype": rec.rollout.engine_dtype,
                  "max_model_len": rec.rollout.max_model_len, "seed": rec.seed}
        return RayRolloutDriver(self.work.model_dir, spec.method, rec.rollout.engines, placement=rec.rollout.placement,
                                max_tokens=rec.rollout.max_tokens, temperature=rec.rollout.temperature, engine_kwargs=kwargs,
                                num_cpus_per_worker=0, bind_cpus=True,
                                worker_env={_KV_ENV: str(self.work.kv_gib)} if self.work.kv_gib else None)

    def _generate(self, step: int, chosen: list[int], pids: list[str], caps: Any) -> Any:
        """The step's rollouts as one :class:`~integrations.vllm_ext.rollouts.RolloutBatch`: from the
        engine, or with ``rollout.engines > 1`` from every engine (pooled; finish times from each engine's batch start)."""
        from integrations.rl.ray_rollout import Group
        from integrations.vllm_ext.rollouts import Rollout, RolloutBatch

        work, ro, seed = self.work, self.rec.rollout, self.rec.seed * 1_000_003 + step
        if self.driver is None:
            return generate_rollouts(self.llm, [work.prompts[i] for i in chosen], pids, samples=ro.samples, max_tokens=ro.max_tokens,
                                     temperature=ro.temperature, top_p=ro.top_p, seed=seed, draft_caps=caps, das=self.das,
                                     coupled=ro.coupled_sampling)
        groups = [Group(f"{step}:{g}", pid, work.prompts[i], ro.samples, None if caps is None else caps[g])
                  for g, (i, pid) in enumerate(zip(chosen, pids))]
        sampling = {"top_p": ro.top_p, **({"das_coupled": True} if ro.coupled_sampling else {})}
        out = self.driver.run_iteration(groups, self.version, seed=seed - self.version, sampling=sampling)
        rep = self.driver.last_iteration
        pooled = rep["pooled"]
        rollouts = []
        for g, grp in enumerate(groups):
            fin = self.driver.last_finish.get(grp.group_id) or [("stop", rep["makespan_s"])] * len(out[grp.group_id])
            rollouts += [Rollout(g, grp.problem_id, s, list(grp.prompt_ids), o, f[0], f[1]) for s, (o, f) in enumerate(zip(out[grp.group_id], fin))]
        proposer = {"drafter_" + k: v for k, v in pooled.get("drafter", {}).items()} or None
        return RolloutBatch(rollouts, rep["makespan_s"], pooled["draft_tokens"], pooled["accepted_tokens"], proposer=proposer,
                            tail_row_steps=pooled["tail_row_steps"], tail_accepted_tokens=pooled["tail_accepted_tokens"])

    def warm_up(self) -> None:
        """:func:`integrations.vllm_ext.rollouts.warm_up` with step 0's batch shape (on every engine)."""
        from integrations.vllm_ext.rollouts import warm_up

        lengths = self.work.first_batch_lengths(self.rec.rollout.samples)
        if self.driver is not None:
            self.driver.warm(lengths)
        else:
            warm_up(self.llm, lengths)

    def step(self, step: int, scorer: Scorer) -> tuple[dict[str, Any], Any, list[float]]:
        """GRPO step ``step``: rollouts of the step's problems, rewards, update, weight sync, next policy version.

        Returns ``(record, batch, scores)``: the step's record (see the module doc; seconds per
        phase, ``step_s`` their sum as charged: rollout wall, reward seconds from ``scorer``, train
        and sync wall), the :class:`~integrations.vllm_ext.rollouts.RolloutBatch` and the
        per-rollout scores (reward plus overlong penalty).
        """
        import torch

        from integrations.rl.rewards import overlong_penalty
        from integrations.vllm_ext import control
        from integrations.vllm_ext.weight_sync import sync_weights

        rec, work, ro, rs = self.rec, self.work, self.rec.rollout, self.rec.reward
        chosen = work.schedule[step]
        pids = [work.problems[i].problem_id for i in chosen]
        caps = self.budget.caps(pids) if self.budget is not None else None
        t_roll = time.perf_counter()
        batch = self._generate(step, chosen, pids, caps)
        texts = [work.tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in batch.rollouts]
        t_score = time.perf_counter()
        rewards, score_s = scorer(step, [work.problems[chosen[r.group]] for r in batch.rollouts],
                                  [(chosen[r.group], tuple(r.output_ids)) for r in batch.rollouts], texts)
        scores = [float(getattr(x, "score", x)) for x in rewards]
        if rs.overlong_buffer > 0:
            scores = [sc + overlong_penalty(len(r.output_ids), ro.max_tokens, rs.overlong_buffer, rs.overlong_penalty)
                      for sc, r in zip(scores, batch.rollouts)]
        t_scored = time.perf_counter()
        adv = group_advantages(scores, [r.group for r in batch.rollouts], mode=rec.train.advantage, std_normalize=rec.train.std_normalize)
        t_train = time.perf_counter()
        tm = self.trainer.step([(r.prompt_ids, r.output_ids) for r in batch.rollouts], adv)
        t_sync = time.perf_counter()
        sync_s = sync_weights(self.llm, self.trainer.model).seconds if self.driver is None else self.driver.sync_weights(self.trainer.model)
        self.version += 1
        if self.das and self.driver is None:  # the driver advances its engines at the start of each iteration
            control.begin_iteration(self.llm, self.version)
        if self.budget is not None:
            self.budget.observe(self.version - 1, [r.problem_id for r in batch.rollouts], [len(r.output_ids) for r in batch.rollouts])
        if self.weights_hook is not None:
            self.weights_hook(self.version, self.trainer.model)
        t_end = time.perf_counter()
        lengths = [len(r.output_ids) for r in batch.rollouts]
        record: dict[str, Any] = {
            "step": step, "policy_version": self.version - 1, "problems": pids,
            "reward_mean": sum(scores) / len(scores), "reward_std": float(torch.tensor(scores).std()) if len(scores) > 1 else 0.0,
            "accuracy": sum(bool(getattr(x, "correct", False)) for x in rewards) / len(rewards),
            "format_rate": sum(bool(getattr(x, "formatted", False)) for x in rewards) / len(rewards),
            **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in tm.items()},
            "rollout_s": round(batch.wall_time_s, 3), "tail10_s": round(batch.tail_time_s(0.1), 3),
            "tokens": batch.tokens, "tokens_per_s": round(batch.tokens / batch.wall_time_s, 2) if batch.wall_time_s else 0.0,
            "mean_len": sum(lengths) / len(lengths), "max_len": max(lengths), "p90_len": float(np.quantile(lengths, 0.9, method="inverted_cdf")),
            "truncated": sum(r.finish_reason == "length" for r in batch.rollouts) / len(batch.rollouts),
            "acceptance_length": round(batch.acceptance_length, 4), "tail_acceptance_length": round(batch.tail_acceptance_length, 4),
            "draft_tokens": batch.draft_tokens, "accepted_tokens": batch.accepted_tokens, "draft_caps": caps,
            "score_s": round(score_s, 3), "train_s": round(t_sync - t_train, 3), "sync_s": round(sync_s, 3),
            # the wall time of the step with the reward call's wall time replaced by the seconds charged for it
            "step_s": round(t_end - t_roll - (t_scored - t_score) + score_s, 3),
        }
        if batch.proposer is not None:
            keys = ("drafts", "draft_tokens", "propose_s", "fitted_steps", "drafter_problems", "drafter_tokens")
            record["proposer"] = {k: batch.proposer[k] for k in keys if k in batch.proposer}
        if self.driver is not None:
            rep = self.driver.last_iteration
            record["engines"] = rep["engines"]
            record["placement"] = rep["placement"]
        return record, batch, scores

    def close(self) -> None:
        """Shut the engine(s) down (the trainer, with the final weights, stays)."""
        if getattr(self, "driver", None) is not None:
            self.driver.shutdown()
            self.driver = None
        if getattr(self, "llm", None) is not None:
            close_llm(self.llm)  # the engine core stops here even if a reference to the engine remains
            del self.llm  # the last reference, before the parallel state goes
            release_engine_state()


# ----------------------------------------------------------------------------------------------
# the loop


@dataclasses.dataclass
class GRPOResult:
    """A finished run: its recipe, one record per step, the trainer (with the final weights)."""

    recipe: dict[str, Any]
    steps: list[dict[str, Any]]
    trainer: Any = None
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)


def resolve_recipe(recipe: Recipe | dict | str | None, overrides: Sequence[str] = ()) -> Recipe:
    """A checked :class:`Recipe` from a recipe, dict, YAML path or name, plus ``overrides``."""
    rec = recipe if isinstance(recipe, Recipe) else load_recipe(recipe, overrides)
    if isinstance(recipe, Recipe) and overrides:
        rec = load_recipe(recipe.to_dict(), overrides)
    return rec.validate()


def run(
    recipe: Recipe | dict | str | None = None,
    *,
    overrides: Sequence[str] = (),
    reward_fn: Callable[[Sequence[Any], Sequence[str]], Sequence[Any]] | None = None,
    keep_rollouts: bool = False,
    keep_batches: bool = False,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    weights_hook: Callable[[int, Any], None] | None = None,
) -> GRPOResult:
    """Train with GRPO as the recipe says (see the module doc).

    Args:
        recipe: a :class:`Recipe`, a dict, a YAML path or name (see :func:`integrations.rl.recipes.load_recipe`).
        overrides: ``section.key=value`` strings.
        reward_fn: ``(problems, responses) -> list of Reward-like`` (``.score``, optionally
            ``.correct`` / ``.formatted``); default: :func:`integrations.rl.rewards.score_responses`
            with the recipe's reward settings.
        keep_rollouts: put every rollout's token ids into the step records (``rollouts``).
        keep_batches: put the :class:`integrations.vllm_ext.rollouts.RolloutBatch` objects into the step records (``batch``).
        on_step: called with each step's record.
        weights_hook: called as ``weights_hook(policy_version, model)`` after every update (and with
            version 0 before the first), e.g. to keep the weight sequence for a benchmark.

    Raises:
        ValueError: a bad recipe or data, or a log file that exists (without ``log.overwrite``) or cannot be written.
    """
    from integrations.data.trace import Rollout as TraceRow
    from integrations.data.trace import TraceWriter
    from integrations.results import check_output_path

    rec = resolve_recipe(recipe, overrides)
    # Everything that can be checked is checked before the engine starts.
    log_path = check_output_path(rec.log.json, overwrite=rec.log.overwrite) if rec.log.json else None
    tracer = TraceWriter(rec.log.trace, overwrite=rec.log.overwrite) if rec.log.trace else None  # checks the path; writes per step
    work = plan_workload(rec, reward_fn)
    if rec.log.progress and "reasons" in work.cpu_settings:
        print(cpu_runtime.RuntimeSettings(**work.cpu_settings).header(), file=sys.stderr)
    scorer = Scorer(rec, reward_fn)
    spec = rec.speculative
    log_f = None
    if log_path is not None:  # streamed to <log>.partial, moved over <log> when the run completes
        log_path.parent.mkdir(parents=True, exist_ok=True)
        partial = log_path.with_name(log_path.name + ".partial")
        log_f = open(partial, "w", encoding="utf-8")
        log_f.write(json.dumps({"recipe": rec.to_dict(), "model": work.model_dir, "cpu_settings": work.cpu_settings}) + "\n")
    bar = None
    if rec.log.progress:
        from tqdm import tqdm

        bar = tqdm(total=rec.steps, desc=f"grpo ({spec.method})", unit="step", file=sys.stderr)
    records: list[dict[str, Any]] = []
    policy = None
    try:
        policy = PolicyRun(rec, work, weights_hook=weights_hook)
        policy.warm_up()
        for step in range(rec.steps):
            record, batch, scores = policy.step(step, scorer)
            if log_f is not None:
                log_f.write(json.dumps(record) + "\n")
                log_f.flush()
            if tracer is not None:  # one row group per step; policy_version = step + 1 (the version that sampled them, 1-based)
                tracer.write([TraceRow(step, step + 1, r.problem_id, r.sample, list(r.prompt_ids), list(r.output_ids), r.finish_reason)
                              for r in batch.rollouts])
            if keep_rollouts:
                record["rollouts"] = [(r.problem_id, r.sample, r.output_ids) for r in batch.rollouts]
                record["rewards"] = scores
            if keep_batches:
                record["batch"] = batch
            records.append(record)
            if on_step is not None:
                on_step(record)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"reward {record['reward_mean']:.3f} acc {record['accuracy']:.2f} loss {record['loss']:+.4f} "
                                    f"clip {record['clip_frac']:.3f} roll {record['rollout_s']:.1f}s acc_len {record['acceptance_length']:.2f}")
    finally:
        if bar is not None:
            bar.close()
        if log_f is not None and sys.exc_info()[0] is not None:
            log_f.close()  # a failed run leaves <log>.partial; an earlier <log> stays as it was
        if tracer is not None:
            tracer.close(complete=sys.exc_info()[0] is None)  # failed: <trace>.partial.parquet holds the steps done
        if policy is not None:
            policy.close()
    summary = summarize(records, spec.method)
    summary.update(final_policy_version=policy.version, engine_dtype=work.engine_dtype)
    if log_f is not None:
        log_f.write(json.dumps({"summary": summary}) + "\n")
        log_f.close()
        os.replace(partial, log_path)
    return GRPOResult(rec.to_dict(), records, policy.trainer, summary)


def summarize(records: Sequence[dict[str, Any]], method: str) -> dict[str, Any]:
    """Totals over step records: seconds per phase, tokens, acceptance length, first and last reward."""
    return {
        "steps": len(records), "method": method,
        "reward_first": records[0]["reward_mean"] if records else None, "reward_last": records[-1]["reward_mean"] if records else None,
        **{k: round(sum(r[k] for r in records), 3) for k in ("rollout_s", "score_s", "train_s", "sync_s", "step_s")},
        "tokens": sum(r["tokens"] for r in records),
        "acceptance_length": round(sum(r["tokens"] for r in records) / max(1, sum(r["tokens"] - r["accepted_tokens"] for r in records)), 4),
    }


def format_steps(records: Sequence[dict[str, Any]]) -> str:
    """A table of the step records (tabulate)."""
    from tabulate import tabulate

    cols = [("step", "step", "d"), ("reward", "reward_mean", ".3f"), ("acc", "accuracy", ".2f"), ("fmt", "format_rate", ".2f"),
            ("loss", "loss", "+.5f"), ("clip", "clip_frac", ".3f"), ("kl", "approx_kl", "+.5f"), ("roll_s", "rollout_s", ".1f"),
            ("tail_s", "tail10_s", ".1f"), ("tok/s", "tokens_per_s", ".1f"), ("acc_len", "acceptance_length", ".2f"),
            ("train_s", "train_s", ".1f"), ("sync_s", "sync_s", ".2f")]
    rows = [[int(r[key]) if fmt == "d" else float(r[key]) for _, key, fmt in cols] for r in records]
    return tabulate(rows, [h for h, _, _ in cols], floatfmt=[f for _, _, f in cols])


def check_recipe(p: argparse.ArgumentParser, args: argparse.Namespace) -> Recipe:
    """The recipe of ``args``, with everything checkable checked before any engine loads.

    A bad recipe file, key or value, a missing data file or a refused log path ends in
    ``p.error`` (``<prog>: error: ...``, exit status 2), naming the key and the value. With
    ``--compare`` the recipe's own logs are not written (the A/B report replaces them).
    """
    import yaml

    from integrations.data.registry import data_dir_from_env, resolve
    from integrations.results import check_output_path

    overrides = list(args.overrides) + (["log.overwrite=true"] if args.overwrite and not args.compare else [])
    if args.compare:
        overrides += ["log.json=null", "log.trace=null"]
    try:
        rec = load_recipe(args.recipe, overrides)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        p.error(f"--recipe {args.recipe}: {exc}")
    data_dir = data_dir_from_env()  # $DAS_DATA_DIR, read at the entry point: a local copy of a named set wins
    try:
        src = resolve(rec.data, data_dir)
    except (OSError, ValueError) as exc:
        p.error(f"data {rec.data!r}: {exc}")
    if data_dir is not None and src.path is not None and src.path.parent == data_dir:
        rec.data = str(src.path)
    for key in ("json", "trace"):
        path = getattr(rec.log, key)
        if path:
            try:
                check_output_path(path, overwrite=rec.log.overwrite)
            except ValueError as exc:
                p.error(f"log.{key}: {exc}")
    return rec


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # run as a command: preload Intel OpenMP (re-executes this process once)
        cpu_runtime.reexec_with_iomp()
    p = argparse.ArgumentParser(prog="das-grpo", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="grpo_dsr_sub", help="recipe YAML path or name under recipes/ (default: grpo_dsr_sub)")
    p.add_argument("--compare", default=None, metavar="M1,M2",
                   help="train the recipe once per speculative method (e.g. none,das) in this process, alternating step by step, "
                        "with coupled sampling: per-step timings and whether the runs stay identical (integrations.rl.ab)")
    p.add_argument("--json", default=None, help="with --compare: write the A/B report to this JSON file, and its plot beside it (.png)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing result files (--json and its .png; without --compare the recipe's log.json / log.trace)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. steps=3 rollout.samples=4 speculative.das.budget=fixed")
    args = p.parse_args(argv)
    if args.json and not args.compare:
        p.error("--json goes with --compare (a single run writes the recipe's log.json)")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if args.compare:
        from integrations.rl import ab

        return ab.main(p, args, check_recipe, PolicyRun)
    res = run(check_recipe(p, args))
    print(format_steps(res.steps))
    print(json.dumps(res.summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
