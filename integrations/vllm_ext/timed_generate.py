"""Generate a batch of rollouts and record the shape of the batch over time (the long tail).

``LLM.generate`` returns when the last rollout ends and says nothing about when the others did.
:func:`generate_timed` drives vLLM's engine step by step instead (the same loop ``LLM.generate``
runs), with every sample of a GRPO group as its own request (vLLM fans ``n > 1`` out into such
child requests anyway, so the engine does the same work), and records when each rollout
finished and how many were running after each engine step: the DAS paper's Fig. 1.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import numpy as np

_ids = itertools.count()


@dataclasses.dataclass
class Rollout:
    """One finished sample: its group (prompt index), sample index, tokens and finish time."""

    group: int
    sample: int
    token_ids: list[int]
    finish_reason: str
    finished_s: float  # seconds since the batch started


@dataclasses.dataclass
class BatchTimeline:
    """What one batch did over time.

    Attributes:
        rollouts: one :class:`Rollout` per sample, in (group, sample) order.
        wall_s: seconds from the first request added to the last rollout finished.
        step_s: ``[steps]`` float64, seconds since the start at the end of each engine step.
        running: ``[steps]`` int64, rollouts still running after each engine step.
    """

    rollouts: list[Rollout]
    wall_s: float
    step_s: np.ndarray
    running: np.ndarray

    def tail_s(self, done_fraction: float = 0.9) -> float:
        """Seconds from the moment ``done_fraction`` of the rollouts had finished to the last one.

        Raises:
            ValueError: ``done_fraction`` not in (0, 1].
        """
        if not 0.0 < done_fraction <= 1.0:
            raise ValueError(f"done_fraction must be in (0, 1], got {done_fraction!r}")
        ends = np.sort([r.finished_s for r in self.rollouts])
        if len(ends) == 0:
            return 0.0
        k = max(0, int(np.ceil(done_fraction * len(ends))) - 1)
        return float(ends[-1] - ends[k])


def generate_timed(llm: Any, prompts: list[list[int]], params: list[Any], *, share_prefill: bool = True) -> BatchTimeline:
    """Generate ``params[i].n`` samples of each prompt ``prompts[i]``, recording finish times.

    Args:
        llm: a ``vllm.LLM``.
        prompts: token ids per prompt.
        params: one ``SamplingParams`` per prompt; its ``n`` samples become ``n`` requests with ``n=1``.
        share_prefill: prefill each prompt once: the first sample of every group is added first,
            the other ``n - 1`` once every first sample has its first token, so they find the
            prompt's KV blocks in vLLM's prefix cache. Added together, the ``n`` samples of a
            group are scheduled in one step and each prefills the whole prompt (a 22% prefix-cache
            hit rate was seen for 8 x 8 rollouts): on a 2-core CPU that prefill took ~40% of a
            256-token rollout batch. Sampling is unchanged (every sample is its own request either way).

    Returns:
        :class:`BatchTimeline`.

    Raises:
        ValueError: ``prompts`` and ``params`` differ in length.
    """
    from vllm import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    if len(prompts) != len(params):
        raise ValueError(f"prompts ({len(prompts)}) and params ({len(params)}) must have one entry each")
    engine = llm.llm_engine
    keys: dict[str, tuple[int, int]] = {}
    later: list[tuple[str, list[int], Any]] = []  # samples held back until their prompt is prefilled
    leaders: set[str] = set()  # first samples still without a token
    cache_on = bool(getattr(getattr(getattr(engine, "vllm_config", None), "cache_config", None), "enable_prefix_caching", False))
    t0 = time.perf_counter()
    for group, (ids, sp) in enumerate(zip(prompts, params)):
        n = max(1, int(getattr(sp, "n", 1)))
        single = sp.clone()
        single.n = 1
        for sample in range(n):
            req_id = f"das-{next(_ids)}"
            keys[req_id] = (group, sample)
            if sample and share_prefill and cache_on:
                later.append((req_id, ids, single))
                continue
            leaders.add(req_id)
            lead = single
            if share_prefill and n > 1 and single.output_kind != RequestOutputKind.CUMULATIVE:
                lead = single.clone()
                lead.output_kind = RequestOutputKind.CUMULATIVE  # its first token must show in a step's outputs
            engine.add_request(req_id, TokensPrompt(prompt_token_ids=list(ids)), lead)
    if not later:
        leaders.clear()
    total = len(keys)
    done: dict[tuple[int, int], Rollout] = {}
    step_s, running = [], []
    while engine.has_unfinished_requests() or later:
        outs = engine.step() if engine.has_unfinished_requests() else []
        if later:
            leaders.difference_update(o.request_id for o in outs if o.outputs and (o.outputs[0].token_ids or o.finished))
            if not leaders or not engine.has_unfinished_requests():
                for req_id, ids, single in later:
                    engine.add_request(req_id, TokensPrompt(prompt_token_ids=list(ids)), single)
                later.clear()
        for out in outs:
            if out.finished and out.request_id in keys:
                g, s = keys[out.request_id]
                c = out.outputs[0]
                done[(g, s)] = Rollout(g, s, list(c.token_ids), str(c.finish_reason), time.perf_counter() - t0)
        step_s.append(time.perf_counter() - t0)
        running.append(total - len(done))
    wall = time.perf_counter() - t0
    rollouts = [done[k] for k in sorted(done)]
    return BatchTimeline(rollouts, wall, np.asarray(step_s, np.float64), np.asarray(running, np.int64))
