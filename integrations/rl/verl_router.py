"""DAS routing for verl's rollout servers: a GRPO group on one server, groups placed by predicted work,
every server's drafter fed from the one shared rollout history.

verl (0.9.1) sends each generation request through a global load balancer, a Ray actor that
:class:`verl.workers.rollout.llm_server.LLMServerClient` asks for a server
(``acquire_server(request_id, **fields)``) and tells when the request is done (``release_server``).
Its default, ``GlobalRequestLoadBalancer``, is sticky per request id and otherwise least in-flight,
so a GRPO group's samples scatter over the servers. :class:`DASRouter` takes its place (verl's
router plug-in: ``rollout.router_config_path`` naming ``recipes/verl/das_router.yaml``, or
``load_balancer_cls``) and

- keys each request by its problem (``sampling_params.extra_args.das_problem_id``, set by das's agent
  loop; else the hash of the prompt tokens, :func:`das.problem_store.problem_id`) and sends every
  request of a problem to the server the problem was placed on in this iteration: a GRPO group's
  siblings share one drafter and see each other's tokens;
- places a problem new to this iteration by :func:`scheduler.placement.assign_groups` (``lpt``, the
  project's one placement code) on top of the servers' predicted outstanding work (the predicted
  lengths of their in-flight requests), a request's predicted length from
  :class:`scheduler.predictor.LengthPredictor` (:func:`scheduler.placement.predicted_group_work`), fed by
  the shared history (a problem's stored lengths at first sight) and every rollout published since
  (this iteration's finished siblings included): requests arrive one at a time, so this is online
  list scheduling by predicted work, and long groups spread over the servers (DAS paper, Sec. 5);
- before the first request of a problem reaches a server in an iteration, pulls that problem's
  rollouts the server's drafter does not hold from the shared history
  (:class:`integrations.rl.history.HistoryClient`, one per server) and adds them to the drafter
  through the worker extension's ``das_add_history`` (:class:`integrations.vllm_ext.history_ext.HistoryExtension`,
  mixed into :class:`integrations.rl.verl.CPUWorkerExtension`), by name over ``vLLMHttpServer.collective_rpc``.
  The router is an async actor: only the requests of a problem being pulled wait, and the problems new
  to a server while its pull runs are pulled together in the next one (one store read, one engine RPC);
- takes the finished rollouts from das's agent loop (:func:`das_agent_loop`, ``das_publish``) and
  publishes them to the shared history as the rollouts of the server that generated them.

An iteration ends when the trainer calls ``clear_sticky_cache`` (verl's phase switch) or when a
finished rollout carries a newer policy version (verl's ``global_steps``): problems then get placed
anew, and their history follows them. A removed server's problems are placed anew on their next
request. Failures of the history (store or server RPC) are logged and counted; routing never waits on them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from integrations.rl.history import DEFAULT_NAME, HistoryClient, history_actor
from scheduler.placement import assign_groups, predicted_group_work
from scheduler.predictor import LengthPredictor

logger = logging.getLogger(__name__)

__all__ = ["DASRouter", "ROUTER_CONFIG", "das_agent_loop", "request_problem"]

#: the router plug-in config shipped with das (``actor_rollout_ref.rollout.router_config_path``).
ROUTER_CONFIG = "recipes/verl/das_router.yaml"

_DEFAULTS = {"history_name": DEFAULT_NAME, "window": 16, "keep_visits": 2, "evict_after": 2, "max_tokens": 4096, "timeout_s": 30.0}


def request_problem(sampling_params: Mapping[str, Any] | None, prompt_ids: Sequence[int] | None) -> Hashable:
    """A request's problem id: ``sampling_params["extra_args"]["das_problem_id"]``, else the hash of ``prompt_ids``.

    Raises:
        ValueError: neither is given.
    """
    extra = (sampling_params or {}).get("extra_args") or {}
    if extra.get("das_problem_id") is not None:
        return extra["das_problem_id"]
    if prompt_ids is None:
        raise ValueError("a request needs sampling_params.extra_args.das_problem_id or prompt_ids to be routed by problem")
    from das.problem_store import problem_id

    return problem_id(prompt_ids)


def _call(handle: Any, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
    """``handle.method(*args)``, through Ray when ``handle`` is an actor handle."""
    fn = getattr(handle, method)
    if hasattr(fn, "remote"):
        import ray

        return ray.get(fn.remote(*args, **kwargs), timeout=timeout)
    return fn(*args, **kwargs)


class DASRouter:
    """verl load balancer (the ``RequestLoadBalancer`` protocol of ``verl.workers.rollout.router``):
    problems to servers by predicted work, a problem's requests together, history pulled before drafting.

    Args:
        servers: ``{server address: vLLMHttpServer actor handle}`` (or stand-ins with the same methods).
        config: the router YAML as a dict (verl's plug-in passes it whole): ``history_name`` (the
            :func:`integrations.rl.history.history_actor` name), ``window`` and ``keep_visits`` (policy
            versions, as the drafters' and the length predictor's), ``evict_after`` (policy versions a server
            keeps a problem it no longer serves), ``max_tokens`` (the rollout's ``response_length``, the
            length predictor's range),
            ``timeout_s`` (seconds to wait for the history store or a server).
        store: a :class:`integrations.rl.history.HistoryStore` or an actor handle of one (default: the named actor).
        max_cache_size, full_determinism: verl's arguments to its own balancer; accepted and unused.

    Raises:
        ValueError: a bad config value (names the key).
    """

    def __init__(self, servers: Mapping[str, Any], config: Mapping[str, Any] | None = None, *, store: Any = None,
                 max_cache_size: int = 10000, full_determinism: bool = False):
        cfg = {**_DEFAULTS, **{k: v for k, v in dict(config or {}).items() if k != "router_class"}}
        unknown = set(cfg) - set(_DEFAULTS)
        if unknown:
            raise ValueError(f"DASRouter: unknown config keys {sorted(unknown)}; expected {sorted(_DEFAULTS)}")
        for key in ("window", "evict_after"):  # (max_tokens below)
            if isinstance(cfg[key], bool) or not isinstance(cfg[key], int) or cfg[key] < 1:
                raise ValueError(f"DASRouter: {key} must be an int >= 1, got {cfg[key]!r}")
        if isinstance(cfg["max_tokens"], bool) or not isinstance(cfg["max_tokens"], int) or cfg["max_tokens"] < 1:
            raise ValueError(f"DASRouter: max_tokens must be an int >= 1 (the rollout's response_length), got {cfg['max_tokens']!r}")
        self.config = cfg
        self.timeout_s = float(cfg["timeout_s"])
        self._store = store if store is not None else history_actor(cfg["history_name"], window=cfg["window"], keep_visits=cfg["keep_visits"])
        self._servers: dict[str, Any] = {}
        self._inflight: dict[str, int] = {}
        self._work: dict[str, float] = {}
        self._clients: dict[str, HistoryClient] = {}
        self._requests: dict[str, tuple[str, Hashable, float]] = {}  # request id -> (server, problem, predicted length)
        self._assigned: dict[Hashable, str] = {}  # problem -> server, this iteration
        self._synced: dict[tuple[str, Hashable], asyncio.Future] = {}  # (server, problem) -> done when pulled, this iteration
        self._queue: dict[str, list] = {}  # server -> [(problem, prompt ids, future)] waiting for its next pull
        self._draining: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        self._generated_on: dict[Hashable, str] = {}  # problem -> the server that last generated it
        self.predictor = LengthPredictor(int(cfg["max_tokens"]), window=cfg["window"])  # fed by the shared history and every published rollout
        self._fed: set[Hashable] = set()  # problems whose stored lengths the predictor has read
        self._predicted: dict[Hashable, tuple[float, int]] = {}  # problem -> (predicted length, Long requests) of one request
        self.iteration = 0
        self.version = 0
        self.placements: list[dict[Hashable, str]] = [{}]  # per iteration: problem -> server
        self.routed: list[dict[Hashable, dict[str, int]]] = [{}]  # per iteration: problem -> {server: requests}
        self.counters = {"requests": 0, "placed": 0, "ingest_errors": 0, "predict_errors": 0, "published": 0}
        self.add_servers(servers)

    # -- verl's protocol
    def require_acquire_fields(self) -> list[str]:
        """The problem id travels in ``sampling_params``; ``prompt_ids`` keys requests without one and seeds the history."""
        return ["prompt_ids", "sampling_params"]

    def require_release_fields(self) -> list[str]:
        return ["request_id"]

    async def acquire_server(self, request_id: str, prompt_ids: Sequence[int] | None = None, sampling_params: Mapping[str, Any] | None = None,
                             **extra: Any) -> tuple[str, Any]:
        """The server for this request: its problem's server this iteration, else placed by predicted work.

        The problem's first request on a server in an iteration waits until the server's drafter holds
        the problem's history; the problems arriving for a server while one pull runs are pulled
        together in the next (one store read and one engine RPC per batch). Other requests do not wait.
        Returns ``(server address, actor handle)``.

        Raises:
            RuntimeError: no servers.
        """
        if not self._servers:
            raise RuntimeError("DASRouter: no rollout servers registered")
        pid = request_problem(sampling_params, prompt_ids)
        length, _ = await self._predict(pid)
        if self._assigned.get(pid) not in self._servers:  # new this iteration (or its server was removed)
            sid = self._place(pid)
            self._assigned[pid] = sid
            self.placements[-1][pid] = sid
            self.counters["placed"] += 1
        sid = self._assigned[pid]
        self._requests[request_id] = (sid, pid, length)
        self._inflight[sid] += 1
        self._work[sid] += length
        self.counters["requests"] += 1
        routed = self.routed[-1].setdefault(pid, {})
        routed[sid] = routed.get(sid, 0) + 1
        await self._synced_on(sid, pid, prompt_ids)
        return sid, self._servers[sid]

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        got = self._requests.pop(request_id, None) if request_id is not None else None
        if server_id not in self._inflight:
            return
        self._inflight[server_id] = max(0, self._inflight[server_id] - 1)
        if got is not None and got[0] == server_id:
            self._work[server_id] = max(0.0, self._work[server_id] - got[2])

    def add_servers(self, servers: Mapping[str, Any]) -> None:
        for sid, handle in servers.items():
            self._servers[sid] = handle
            self._inflight.setdefault(sid, 0)
            self._work.setdefault(sid, 0.0)
            if sid in self._clients:
                continue  # a server added again keeps its view of the history
            self._clients[sid] = HistoryClient(self._store, ingest=self._ingester(sid), evict=self._evicter(sid), window=self.config["window"],
                                               evict_after=self.config["evict_after"], timeout_s=self.timeout_s)
            self._clients[sid].version = self.version

    def remove_servers(self, server_ids: Sequence[str]) -> None:
        for sid in server_ids:
            for d in (self._servers, self._inflight, self._work, self._clients):
                d.pop(sid, None)
        self._synced = {k: f for k, f in self._synced.items() if k[0] in self._servers}

    def get_all_servers(self) -> list[str]:
        return list(self._servers)

    def get_total_inflight(self) -> int:
        return sum(self._inflight.values())

    def clear_sticky_cache(self) -> dict:
        """End the iteration: problems are placed anew on their next request (their history follows them)."""
        cleared = len(self._assigned)
        self._new_iteration()
        return {"cleared_entries": cleared, "server_loads": dict(self._inflight)}

    def get_status(self) -> dict:
        return {"servers": dict(self._inflight), "total_inflight": self.get_total_inflight(), "active_servers": len(self._servers),
                "registered_handles": list(self._servers), "predicted_work": dict(self._work), **self.das_stats()}

    # -- das
    async def das_publish(self, problem_id: Hashable, prompt_ids: Sequence[int], output_ids: Sequence[int], policy_version: int | None = None) -> bool:
        """Publish one finished rollout as the rollout of the server that generated its problem.

        ``policy_version`` is verl's ``global_steps`` of the weights that generated it (None: 0); a
        newer one than seen so far starts a new iteration. Returns whether it was published to a server's log.
        """
        version = int(policy_version or 0)
        if version > self.version:
            await self._advance(version)
        sid = self._assigned.get(problem_id) or self._generated_on.get(problem_id)
        if sid not in self._clients:
            return False
        async with self._lock(sid):
            await asyncio.to_thread(self._clients[sid].after_generate, [(problem_id, list(prompt_ids), list(output_ids), version)])
        self.predictor.observe(problem_id, version, [min(len(output_ids), self.predictor.max_tokens)])
        self._fed.add(problem_id)
        self._predicted.pop(problem_id, None)  # its next prediction reads the new length
        self.counters["published"] += 1
        return True

    def das_stats(self) -> dict:
        """``iteration``, ``version``, ``counters``, ``placements`` (per iteration: problem -> server),
        ``routed`` (per iteration: problem -> {server: requests}) and ``history`` (per server: its
        :class:`HistoryClient` counters)."""
        return {"iteration": self.iteration, "version": self.version, "counters": dict(self.counters),
                "placements": [dict(p) for p in self.placements], "routed": [{p: dict(c) for p, c in r.items()} for r in self.routed],
                "history": {sid: dict(c.counters) for sid, c in self._clients.items()}}

    # -- internals
    def _place(self, pid: Hashable) -> str:
        """The server for a problem new to the iteration: :func:`scheduler.placement.assign_groups` ``lpt``
        of its predicted work on top of the servers' predicted outstanding work (ties: fewer predicted
        Long requests, then server order)."""
        sids = list(self._servers)
        work, n_long = self._predicted[pid]
        return sids[int(assign_groups([work], len(sids), "lpt", n_long=[n_long], loads=[self._work[s] for s in sids])[0])]

    async def _predict(self, pid: Hashable) -> tuple[float, int]:
        """``(predicted length in tokens, predicted Long requests)`` of one request of ``pid``
        (:func:`scheduler.placement.predicted_group_work` of a group of one)."""
        if pid in self._predicted:
            return self._predicted[pid]
        if pid not in self._fed:  # first sight: its past lengths from the shared history
            self._fed.add(pid)
            try:
                rows = (await asyncio.to_thread(_call, self._store, "lengths", [pid], timeout=self.timeout_s)).get(pid, [])
                by_version: dict[int, list[int]] = {}
                for version, length in rows:
                    by_version.setdefault(int(version), []).append(min(int(length), self.predictor.max_tokens))
                for version, lengths in sorted(by_version.items()):
                    self.predictor.observe(pid, version, lengths)
            except Exception as exc:  # noqa: BLE001
                self.counters["predict_errors"] += 1
                logger.warning("DASRouter: lengths of %r unavailable (%s: %s)", pid, type(exc).__name__, exc)
        if pid not in self._predicted:  # (another request of pid may have predicted it meanwhile)
            work, n_long = predicted_group_work(self.predictor, [pid], 1)
            self._predicted[pid] = (float(work[0]), int(n_long[0]))
        return self._predicted[pid]

    async def _synced_on(self, sid: str, pid: Hashable, prompt_ids: Sequence[int] | None) -> None:
        """Wait until ``sid``'s drafter holds ``pid``'s history (pulled once per server and iteration)."""
        key = (sid, pid)
        done = self._synced.get(key)
        if done is None:
            done = self._synced[key] = asyncio.get_running_loop().create_future()
            self._queue.setdefault(sid, []).append((pid, list(prompt_ids or ()), done))
            if sid not in self._draining:
                self._draining.add(sid)
                asyncio.get_running_loop().create_task(self._drain(sid))
        await asyncio.shield(done)

    async def _drain(self, sid: str) -> None:
        try:
            while self._queue.get(sid):
                batch, self._queue[sid] = self._queue[sid], []
                client = self._clients.get(sid)
                try:
                    if client is not None:
                        async with self._lock(sid):
                            await asyncio.to_thread(client.before_generate, [(pid, prompt) for pid, prompt, _ in batch])
                except Exception as exc:  # noqa: BLE001 - the server drafts from what it holds
                    self.counters["ingest_errors"] += 1
                    logger.warning("DASRouter: history for %d problems on %s failed (%s: %s)", len(batch), sid, type(exc).__name__, exc)
                for _, _, done in batch:
                    if not done.done():
                        done.set_result(None)
        finally:
            self._draining.discard(sid)

    def _lock(self, sid: str) -> asyncio.Lock:
        """One client call at a time per server (a :class:`HistoryClient` is not thread-safe); servers in parallel."""
        return self._locks.setdefault(sid, asyncio.Lock())

    def _ingester(self, sid: str):
        def ingest(rollouts: list) -> None:
            handle = self._servers[sid]
            batch = [(pid, list(map(int, p)), list(map(int, o)), int(v)) for pid, p, o, v in rollouts]
            _call(handle, "collective_rpc", "das_add_history", timeout=self.timeout_s, args=(batch,))
        return ingest

    def _evicter(self, sid: str):
        def evict(problem_ids: list) -> None:
            if sid in self._servers:
                _call(self._servers[sid], "collective_rpc", "das_evict_problems", timeout=self.timeout_s, args=(list(problem_ids),))
        return evict

    def _new_iteration(self) -> None:
        self._generated_on.update(self._assigned)
        self._assigned.clear()
        self._synced.clear()
        self.iteration += 1
        self.placements.append({})
        self.routed.append({})

    async def _advance(self, version: int) -> None:
        self.version = version
        busy = {pid for _, pid, _ in self._requests.values()}
        keep = {pid: sid for pid, sid in self._assigned.items() if pid in busy}
        kept = {(sid, pid): self._synced[(sid, pid)] for pid, sid in keep.items() if (sid, pid) in self._synced}
        self._new_iteration()
        self._assigned.update(keep)
        self._synced.update(kept)
        self.placements[-1].update(keep)
        try:
            await asyncio.to_thread(_call, self._store, "begin_iteration", version, timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001
            logger.warning("DASRouter: history begin_iteration failed (%s: %s)", type(exc).__name__, exc)
        for sid, client in list(self._clients.items()):
            try:
                async with self._lock(sid):
                    await asyncio.to_thread(client.begin_iteration, version)
            except Exception as exc:  # noqa: BLE001
                logger.warning("DASRouter: eviction on %s failed (%s: %s)", sid, type(exc).__name__, exc)


# ----------------------------------------------------------------------------------------------
# the agent loop that publishes

_LOOPS: dict[type, type] = {}


def das_agent_loop(**kwargs: Any):
    """Hydra ``_target_`` of ``das_single_turn_agent`` (``recipes/verl/das_agent_loops.yaml``): das's tagging
    single-turn loop (:func:`integrations.rl.recipes.verl_das_agent_loop`) that, when verl's load balancer
    is a :class:`DASRouter`, publishes each finished rollout to it (``das_publish``) before returning it."""
    from integrations.rl.recipes import verl_das_agent_loop

    loop = verl_das_agent_loop(**kwargs)
    base = type(loop)
    if base not in _LOOPS:

        class DASPublishingAgentLoop(base):
            async def run(self, sampling_params: dict[str, Any], **kw: Any):
                out = await super().run(sampling_params, **kw)
                await _publish(self, out, kw)
                return out

        _LOOPS[base] = DASPublishingAgentLoop
    loop.__class__ = _LOOPS[base]
    return loop


async def _publish(loop: Any, out: Any, sample: Mapping[str, Any]) -> None:
    router = getattr(getattr(loop, "server_manager", None), "_load_balancer", None)  # LLMServerClient's balancer handle
    response = getattr(out, "response_ids", None)
    if router is None or response is None:
        return
    try:
        publish = router.das_publish
    except AttributeError:
        return  # verl's own balancer: nothing to publish to
    from integrations.rl.recipes import das_request_fields

    pid = das_request_fields(sample).get("das_problem_id")
    if pid is None:
        from das.problem_store import problem_id

        pid = problem_id(out.prompt_ids)
    fields = getattr(out, "extra_fields", None) or {}
    try:
        await publish.remote(pid, list(out.prompt_ids), list(response), fields.get("min_global_steps", fields.get("global_steps")))
    except Exception as exc:  # noqa: BLE001 - the rollout is returned all the same
        logger.warning("das agent loop: publishing %r failed (%s: %s)", pid, type(exc).__name__, exc)
