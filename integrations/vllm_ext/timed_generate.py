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
        ends = [r.finished_s for r in self.rollouts]
        if not ends:
            return 0.0
        return float(np.max(ends) - np.quantile(ends, done_fraction, method="inverted_cdf"))


def generate_timed(llm: Any, prompts: list[list[int]], params: list[Any]) -> BatchTimeline:
    """Generate ``params[i].n`` samples of each prompt ``prompts[i]``, recording finish times.

    Args:
        llm: a ``vllm.LLM``.
        prompts: token ids per prompt.
        params: one ``SamplingParams`` per prompt; its ``n`` samples become ``n`` requests with ``n=1``.

    Returns:
        :class:`BatchTimeline`.

    Raises:
        ValueError: ``prompts`` and ``params`` differ in length.
    """
    from vllm import TokensPrompt

    if len(prompts) != len(params):
        raise ValueError(f"prompts ({len(prompts)}) and params ({len(params)}) must have one entry each")
    engine = llm.llm_engine
    keys: dict[str, tuple[int, int]] = {}
    for group, (ids, sp) in enumerate(zip(prompts, params)):
        n = max(1, int(getattr(sp, "n", 1)))
        single = sp.clone()
        single.n = 1
        for sample in range(n):
            req_id = f"das-{next(_ids)}"
            keys[req_id] = (group, sample)
            engine.add_request(req_id, TokensPrompt(prompt_token_ids=list(ids)), single)
    total = len(keys)
    done: dict[tuple[int, int], Rollout] = {}
    step_s, running = [], []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id in keys:
                g, s = keys[out.request_id]
                c = out.outputs[0]
                done[(g, s)] = Rollout(g, s, list(c.token_ids), str(c.finish_reason), time.perf_counter() - t0)
        step_s.append(time.perf_counter() - t0)
        running.append(total - len(done))
    wall = time.perf_counter() - t0
    rollouts = [done[k] for k in sorted(done)]
    return BatchTimeline(rollouts, wall, np.asarray(step_s, np.float64), np.asarray(running, np.int64))
