"""Data-parallel rollouts on Ray: N workers, each a vLLM engine with the DAS proposer.

The driver assigns whole GRPO groups (all samples of one prompt) to workers, so siblings share
their worker's problem tree, balancing predicted work with :func:`scheduler.placement.assign_groups`
(longest-predicted-first by default; the predictor is :class:`scheduler.predictor.LengthPredictor`,
fed with every finished iteration). Each worker's drafter window advances at the start of every
iteration. If a worker dies mid-iteration, or has not returned its groups within
``task_timeout_s`` of their dispatch (it is then taken as hung and killed), its unfinished groups
are re-dispatched to the surviving worker with the least outstanding predicted work (a replacement
is started when none is left), so every rollout is accounted for. Workers that died or hung
between iterations are found and replaced when the next iteration begins.

Usage::

    driver = RayRolloutDriver(model_dir, method="das", num_workers=2)
    results = driver.run_iteration(groups, policy_version=1)   # {group_id: [token id lists]}
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from integrations.vllm_ext import cpu_runtime

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
        engine_kwargs: passed to :func:`integrations.vllm_ext.engine.make_llm`.
    """

    def __init__(self, model: str, method: str, engine_kwargs: dict[str, Any]):
        cpu_runtime.apply_cpu_defaults()
        from integrations.vllm_ext.engine import make_llm

        self.method = method
        self.llm = make_llm(model, method, **engine_kwargs)

    def begin_iteration(self, policy_version: int) -> None:
        if self.method == "das":
            from integrations.vllm_ext import control

            control.begin_iteration(self.llm, policy_version)

    def generate(self, groups: list[Group], sampling: dict[str, Any], seed: int) -> dict[str, list[list[int]]]:
        """Generate every group; returns ``{group_id: [output token ids per sample]}``.

        Through :func:`integrations.vllm_ext.rollouts.generate_rollouts` (one ``n=1`` request
        per sample, ``torch.manual_seed(seed)``); ``sampling`` holds ``SamplingParams`` fields,
        ``temperature`` and ``max_tokens`` among them.
        """
        from integrations.vllm_ext.rollouts import generate_rollouts

        rest = dict(sampling)
        batch = generate_rollouts(self.llm, [g.prompt_ids for g in groups], [g.problem_id for g in groups], samples=[g.n for g in groups],
                                  max_tokens=rest.pop("max_tokens"), temperature=rest.pop("temperature"), top_p=rest.pop("top_p", 1.0),
                                  seed=seed, sampling=rest)
        out: dict[str, list[list[int]]] = {g.group_id: [] for g in groups}
        for r in batch.rollouts:  # (group, sample) order
            out[groups[r.group].group_id].append(r.output_ids)
        return out

    def pid(self) -> int:
        import os

        return os.getpid()


def _worker_env() -> dict[str, str]:
    if not cpu_runtime.is_cpu_build():
        return {}
    chosen = cpu_runtime.settings()
    env = cpu_runtime.cpu_env(chosen)
    lib = cpu_runtime.iomp_library()
    if chosen.preload_iomp and lib is not None:
        env["LD_PRELOAD"] = str(lib)  # worker processes start with it, so it takes effect
    return env


class RayRolloutDriver:
    """Drive N Ray rollout workers through RL iterations.

    Args:
        model: local model directory (every worker loads it).
        method: speculative method of every worker.
        num_workers: N >= 1.
        interleave: how GRPO groups are assigned to workers, one of ``scheduler.placement.ASSIGNMENTS`` (``lpt`` default).
        max_tokens: rollout max output length (tokens); also the length predictor's range.
        temperature: sampling temperature.
        engine_kwargs: passed to :func:`integrations.vllm_ext.engine.make_llm` in each worker.
        num_cpus_per_worker: Ray CPUs reserved per worker.
        task_timeout_s: deadline of one dispatched batch of groups (seconds from its dispatch; None:
            none). A worker that has not returned its batch by then is taken as hung: it is killed
            and its groups are re-dispatched (to the least-loaded live worker, or to a replacement).
        start_timeout_s: how long a new worker may take to start its engine (and begin its first
            iteration) before it is taken as hung and replaced.
        begin_timeout_s: how long a running worker may take to begin an iteration (advance its
            drafter window) before it is taken as hung and replaced.
        max_redispatch: how often one batch may be re-dispatched in an iteration before
            :meth:`run_iteration` gives up with ``RuntimeError``.
        worker_cls: the actor class (default :class:`RolloutWorker`; tests pass a stand-in with the
            same methods: ``begin_iteration``, ``generate``, ``pid``).

    Raises:
        ValueError: ``num_workers < 1``, an unknown ``interleave`` assignment, or a bad timeout.
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
        task_timeout_s: float | None = 3600.0,
        start_timeout_s: float = 900.0,
        begin_timeout_s: float = 120.0,
        max_redispatch: int = 3,
        worker_cls: type | None = None,
    ):
        import ray

        from scheduler.placement import ASSIGNMENTS
        from scheduler.predictor import LengthPredictor

        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if interleave not in ASSIGNMENTS:
            raise ValueError(f"interleave must be one of {list(ASSIGNMENTS)}, got {interleave!r}")
        for name, v in (("task_timeout_s", task_timeout_s), ("start_timeout_s", start_timeout_s), ("begin_timeout_s", begin_timeout_s)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"{name} must be a number > 0{' or None' if name == 'task_timeout_s' else ''}, got {v!r}")
        if isinstance(max_redispatch, bool) or not isinstance(max_redispatch, int) or max_redispatch < 0:
            raise ValueError(f"max_redispatch must be an int >= 0, got {max_redispatch!r}")
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        self.model, self.method, self.interleave = model, method, interleave
        self.sampling = {"temperature": float(temperature), "max_tokens": int(max_tokens)}
        self.engine_kwargs = dict(engine_kwargs or {})
        self.task_timeout_s = None if task_timeout_s is None else float(task_timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.begin_timeout_s = float(begin_timeout_s)
        self.max_redispatch = max_redispatch
        env = _worker_env() if worker_cls is None else {}
        self._actor_cls = ray.remote(num_cpus=num_cpus_per_worker, runtime_env={"env_vars": env})(worker_cls or RolloutWorker)
        self.workers = [self._start_worker() for _ in range(num_workers)]
        self.alive = [True] * num_workers
        self.predictor = LengthPredictor(max_tokens)
        self.redispatched_groups = 0
        self.replaced_workers = 0
        self.hung_workers = 0
        self._fresh: set[int] = set()
        ready = [w.pid.remote() for w in self.workers]
        try:
            ray.get(ready, timeout=self.start_timeout_s)  # engines are up
        except Exception:
            self.shutdown()
            raise

    def _start_worker(self):
        return self._actor_cls.remote(self.model, self.method, self.engine_kwargs)

    def _kill(self, i: int) -> None:
        import ray

        self.alive[i] = False
        try:
            ray.kill(self.workers[i], no_restart=True)
        except Exception:  # already gone
            pass

    def _replace(self, i: int) -> None:
        self._kill(i)
        self.workers[i], self.alive[i] = self._start_worker(), True
        self._fresh.add(i)
        self.replaced_workers += 1

    def _begin(self, policy_version: int) -> None:
        """Replace workers known dead, begin the iteration on every worker, and replace (once) any
        worker that died or hung since the last iteration."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        for i, ok in enumerate(self.alive):
            if not ok:
                self._replace(i)
        for attempt in range(2):
            refs = [w.begin_iteration.remote(policy_version) for w in self.workers]
            failed = []
            for i, ref in enumerate(refs):
                try:
                    ray.get(ref, timeout=self.start_timeout_s if i in self._fresh else self.begin_timeout_s)
                except (RayActorError, GetTimeoutError) as exc:
                    failed.append(i)
                    logger.warning("worker %d is %s at the start of policy version %d; replacing it", i,
                                   "hung" if isinstance(exc, GetTimeoutError) else "dead", policy_version)
                    if isinstance(exc, GetTimeoutError):
                        self.hung_workers += 1
            if not failed:
                self._fresh.clear()
                return
            if attempt == 1:
                raise RuntimeError(f"workers {failed} could not begin policy version {policy_version} even after being replaced")
            for i in failed:
                self._replace(i)

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
        on_dispatch: Callable[[RayRolloutDriver, np.ndarray], None] | None = None,
    ) -> dict[str, list[list[int]]]:
        """Generate every group on the workers; returns ``{group_id: [output token ids per sample]}``.

        Workers lost since the last iteration (dead, or not answering within ``start_timeout_s``)
        are replaced first. During the iteration, a worker that dies, or that has not returned a
        batch within ``task_timeout_s`` of its dispatch (it is then killed), has its unfinished
        groups re-dispatched, so every group is generated exactly once in the result.

        Args:
            groups: the iteration's GRPO groups (unique ``group_id``).
            policy_version: the policy that generates them (drafter windows advance to it).
            seed: sampling seed base (each worker seeds ``seed + policy_version + worker``).
            sampling: ``SamplingParams`` fields overriding the driver's (e.g. ``ignore_eos``).
            on_dispatch: called once after the work is sent, with the driver and the assignment
                (worker id per group); tests use it to kill or stop a worker mid-iteration.

        Raises:
            ValueError: duplicate group ids.
            RuntimeError: a batch was lost more than ``max_redispatch`` times, or workers cannot be started.
        """
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        from scheduler.placement import assign_groups

        if len({g.group_id for g in groups}) != len(groups):
            raise ValueError("group ids must be unique within an iteration")
        self._begin(policy_version)
        if not groups:
            return {}
        work = self.predicted_work(groups)
        assignment = assign_groups(work, len(self.workers), self.interleave)
        sampling = {**self.sampling, **(sampling or {})}
        outstanding = np.zeros(len(self.workers))
        pending: dict[Any, tuple[int, list[int], float, int]] = {}  # ref -> (worker, members, dispatched at, tries)

        def submit(w: int, members: list[int], tries: int = 0) -> None:
            ref = self.workers[w].generate.remote([groups[i] for i in members], sampling, seed + policy_version + w)
            pending[ref] = (w, members, time.monotonic(), tries)
            outstanding[w] += work[members].sum()

        def lost(w: int, members: list[int], tries: int, why: str) -> None:
            if tries >= self.max_redispatch:
                raise RuntimeError(f"groups {[groups[i].group_id for i in members]} were lost {tries + 1} times "
                                   f"(last: worker {w} {why}); giving up after max_redispatch={self.max_redispatch}")
            logger.warning("worker %d %s mid-iteration; re-dispatching %d groups", w, why, len(members))
            survivors = [i for i, ok in enumerate(self.alive) if ok]
            if not survivors:  # nobody left: start a replacement now
                self._replace(w)
                self._begin_one(w, policy_version)
                survivors = [w]
            target = min(survivors, key=lambda i: outstanding[i])
            self.redispatched_groups += len(members)
            submit(target, members, tries + 1)

        for w in range(len(self.workers)):
            members = [int(i) for i in np.flatnonzero(assignment == w)]
            if members:
                submit(w, members)
        if on_dispatch is not None:
            on_dispatch(self, assignment)
        results: dict[str, list[list[int]]] = {}
        while pending:
            timeout = None
            if self.task_timeout_s is not None:
                first_due = min(t for _, _, t, _ in pending.values()) + self.task_timeout_s
                timeout = max(0.0, first_due - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not ready:  # a batch is past its deadline: its worker is hung
                now = time.monotonic()
                hung = sorted({w for w, _, t, _ in pending.values() if now - t >= self.task_timeout_s})
                for w in hung:
                    self.hung_workers += 1
                    self._kill(w)
                    for ref in [r for r, v in pending.items() if v[0] == w]:
                        _, members, _, tries = pending.pop(ref)
                        outstanding[w] -= work[members].sum()
                        lost(w, members, tries, f"did not answer within {self.task_timeout_s:g} s")
                continue
            (ref,) = ready
            w, members, _, tries = pending.pop(ref)
            outstanding[w] -= work[members].sum()
            try:
                results.update(ray.get(ref))
            except (RayActorError, RayTaskError) as exc:
                if isinstance(exc, RayTaskError) and not isinstance(exc.cause, RayActorError):
                    raise
                self.alive[w] = False
                lost(w, members, tries, f"died ({type(exc).__name__})")
        for g in groups:
            self.predictor.observe(g.problem_id, policy_version, [len(t) for t in results[g.group_id]])
        return results

    def _begin_one(self, i: int, policy_version: int) -> None:
        import ray

        ray.get(self.workers[i].begin_iteration.remote(policy_version), timeout=self.start_timeout_s)

    def shutdown(self) -> None:
        """Kill every worker (the Ray runtime stays up)."""
        import ray

        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # already gone
                pass
        self.workers = []
