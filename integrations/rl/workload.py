"""What every method of a GRPO run shares: each step's problems, their prompts, the engine's CPU settings, the rewards.

:func:`plan_workload` decides, once per run, everything that must be the same for every method an
A/B compares (:mod:`integrations.rl.ab`) and for a rerun: the problem pool and each step's
problems (seeded), the rendered prompts, the engine dtype (the recipe's, or this machine's for
``rollout.dtype: auto``, :mod:`integrations.vllm_ext.cpu_runtime`) and the KV cache per engine
(``das-rollout``'s rule, :func:`integrations.rollout.workload_kv_gib`). :class:`Scorer` turns
rollouts into rewards with the recipe's reward settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from integrations.rl.recipes import Recipe
from integrations.rollout import workload_kv_gib  # imported early: it notes whether the user set the KV cache
from integrations.vllm_ext import cpu_runtime

__all__ = ["Workload", "plan_workload", "Scorer"]



@dataclasses.dataclass
class Workload:
    """The problems a run trains on and what is decided once for every method that runs them.

    Attributes:
        model_dir: the policy's Hugging Face directory (engine and trainer start from it).
        problems: every problem of ``rec.data``.
        schedule: ``[steps][prompts_per_step]`` indices into ``problems``, the problems of each step.
        prompts: prompt token ids of every scheduled problem, by index.
        tokenizer: the policy's tokenizer.
        engine_dtype: the engine's dtype (the recipe's, or this machine's for ``auto``).
        kv_gib: KV cache per engine in GiB sized to a step's batch (0: ``cpu_runtime``'s or the user's).
        cpu_settings: :meth:`integrations.vllm_ext.cpu_runtime.RuntimeSettings.as_dict`, or ``{"device": "cuda"}``.
    """

    model_dir: str
    problems: list[Any]
    schedule: list[list[int]]
    prompts: dict[int, list[int]]
    tokenizer: Any
    engine_dtype: str
    kv_gib: int = 0
    cpu_settings: dict[str, Any] = dataclasses.field(default_factory=dict)

    def first_batch_lengths(self, samples: int) -> list[int]:
        """Prompt lengths of step 0's rollouts (the shape of an engine's warm-up batch)."""
        return [len(self.prompts[i]) for i in self.schedule[0] for _ in range(samples)] if self.schedule else []


def plan_workload(rec: Recipe, reward_fn: Any = None) -> Workload:
    """Load the problems, draw every step's problems, render their prompts and settle the engine's CPU settings.

    The pool is a seeded sample of ``rec.pool`` problems (all of them when the data has fewer),
    less problems without a ground truth or tests; each step samples ``prompts_per_step`` of it
    (``random.Random(rec.seed)``), so every method and every rerun sees the same problems. Data
    with fewer usable problems than ``prompts_per_step`` trains on all of them each step (said on
    stderr). Code problems without a ``reward_fn`` need the sandbox, checked here, before any engine.

    Raises:
        ValueError: no usable problem; bad data (from :func:`integrations.data.problems.load_problems`).
        integrations.rl.rewards.SandboxUnavailable: code problems and no sandbox.
    """
    from transformers import AutoTokenizer

    from integrations.data.models import resolve_model
    from integrations.data.problems import load_problems, render_prompts
    from integrations.rl.rewards import check_sandbox

    chosen = cpu_runtime.apply_cpu_defaults(rec.rollout.engine_dtype)
    model_dir = resolve_model(rec.model)
    problems = load_problems(rec.data)
    rng = random.Random(rec.seed)
    pool = list(range(len(problems))) if rec.pool is None else rng.sample(range(len(problems)), min(rec.pool, len(problems)))
    pool = [i for i in pool if problems[i].kind == "code" or problems[i].answer]  # DSR-sub row 265 has no ground truth
    if not pool:
        raise ValueError(f"data {rec.data!r}: no usable problem (with a ground truth or tests) in the pool")
    per_step = rec.rollout.prompts_per_step
    if len(pool) < per_step:
        print(f"das-grpo: warning: data {rec.data!r} has {len(pool)} usable problems (with a ground truth or tests), fewer than "
              f"rollout.prompts_per_step ({per_step}): every step trains on all {len(pool)}", file=sys.stderr)
        per_step = len(pool)
    if reward_fn is None and any(problems[i].kind == "code" for i in pool):
        rs = rec.reward
        check_sandbox(network=rs.network, sandbox=rs.sandbox)  # raises SandboxUnavailable saying how to allow it
    schedule = [rng.sample(pool, per_step) for _ in range(rec.steps)]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    used = sorted({i for step in schedule for i in step})
    prompts = dict(zip(used, render_prompts([problems[i] for i in used], tokenizer)))
    dtype = rec.rollout.engine_dtype or (chosen.dtype if chosen is not None else "bfloat16")
    # das-rollout's rule: a cache for one step's batch at its longest, unless the user set one (or on CUDA)
    plan = argparse.Namespace(prompts=per_step, samples=rec.rollout.samples, max_tokens=rec.rollout.max_tokens, dtype=dtype)
    kv = workload_kv_gib(model_dir, [prompts.get(i, []) for i in range(len(problems))], schedule, plan)
    settings: dict[str, Any] = {"device": "cuda"}
    if chosen is not None:
        settings = chosen.as_dict()
        settings["dtype"] = dtype
        if kv:
            settings["kvcache_gib"] = kv
            settings["reasons"]["kv_cache"] = f"sized to {per_step * rec.rollout.samples} rollouts of up to {rec.rollout.max_tokens} tokens, per engine"
    return Workload(model_dir, problems, schedule, prompts, tokenizer, dtype, kv, settings)


class Scorer:
    """Rewards of rollouts with the recipe's reward settings (or ``reward_fn``), and the seconds they took.

    With ``memo`` a rollout already scored in the same step (the same problem and output tokens)
    is not scored again: it gets its earlier reward and is charged the seconds that scoring took
    (its share of that batch). The A/B driver (:mod:`integrations.rl.ab`) uses it so that methods
    which sampled the same rollout get the same reward (sandboxed tests have wall-clock limits, so
    scoring twice on a busy machine can disagree) while each method's step still pays for its rewards.
    """

    def __init__(self, rec: Recipe, reward_fn: Callable[[Sequence[Any], Sequence[str]], Sequence[Any]] | None = None, *, memo: bool = False):
        if reward_fn is None:
            from integrations.rl.rewards import make_reward_fn

            rs = rec.reward
            reward_fn = make_reward_fn(format_weight=rs.format_weight, require_boxed=rs.require_boxed, workers=rs.workers,
                                       timeout_s=rs.code_timeout_s, memory_mb=rs.code_memory_mb, network=rs.network, sandbox=rs.sandbox)
        self.fn = reward_fn
        self.memo: dict[Any, tuple[Any, float]] | None = {} if memo else None
        self._step: int | None = None

    def __call__(self, step: int, problems: Sequence[Any], keys: Sequence[Any], texts: Sequence[str]) -> tuple[list[Any], float]:
        """Rewards of ``texts`` (one per problem; ``keys`` identify the rollouts for the memo) and the seconds charged."""
        memo = self.memo
        if memo is not None and step != self._step:
            memo.clear()
            self._step = step
        todo = [i for i, k in enumerate(keys) if memo is None or k not in memo]
        t0 = time.perf_counter()
        fresh = list(self.fn([problems[i] for i in todo], [texts[i] for i in todo])) if todo else []
        share = (time.perf_counter() - t0) / max(1, len(todo))
        got: dict[int, tuple[Any, float]] = {i: (r, share) for i, r in zip(todo, fresh)}
        if memo is not None:
            memo.update((keys[i], got[i]) for i in todo)
        out = [got[i] if i in got else memo[keys[i]] for i in range(len(keys))]
        return [r for r, _ in out], sum(s for _, s in out)
