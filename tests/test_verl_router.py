"""DASRouter (integrations/rl/verl_router.py) with stand-in servers and a local history store: verl's
load-balancer protocol, a problem's requests on one server, placement by predicted work, history
pulled into a server before its first request of a problem, published rollouts, moved problems."""

from __future__ import annotations

import asyncio
import itertools
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from integrations.rl.history import HistoryStore
from integrations.rl.verl_router import DASRouter, das_agent_loop, request_problem


class StandInServer:
    """The part of verl's ``vLLMHttpServer`` the router calls: ``collective_rpc`` by name into a drafter stand-in."""

    def __init__(self):
        self.rollouts: list = []  # what das_add_history received, in order
        self.evicted: list = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if method == "das_add_history":
            self.rollouts.extend(args[0])
        elif method == "das_evict_problems":
            self.evicted.extend(args[0])
        else:
            raise AssertionError(f"unexpected rpc {method}")


def sp(pid):
    return {"temperature": 1.0, "extra_args": {"das_problem_id": pid}}


def make(n=2, **config):
    servers = {f"s{i}": StandInServer() for i in range(n)}
    return DASRouter(servers, config, store=HistoryStore()), servers


_ids = itertools.count()


def acquire(router, pid, prompt=(1, 2, 3)):
    rid = f"r{next(_ids)}"
    sid, _ = asyncio.run(router.acquire_server(request_id=rid, prompt_ids=list(prompt), sampling_params=sp(pid)))
    return rid, sid


def publish(router, *args):
    return asyncio.run(router.das_publish(*args))


def test_router_declares_the_fields_it_routes_on():
    router, _ = make()
    assert router.require_acquire_fields() == ["prompt_ids", "sampling_params"]
    assert router.require_release_fields() == ["request_id"]
    assert sorted(router.get_all_servers()) == ["s0", "s1"]


def test_a_groups_requests_go_to_one_server_and_groups_spread():
    router, _ = make()
    got = {pid: {acquire(router, pid)[1] for _ in range(8)} for pid in ("a", "b")}
    assert all(len(s) == 1 for s in got.values())  # siblings together
    assert got["a"] != got["b"]  # the second group goes to the server with less predicted work
    assert router.das_stats()["routed"] == [{"a": {got["a"].pop(): 8}, "b": {got["b"].pop(): 8}}]
    assert router.get_total_inflight() == 16


def test_placement_follows_predicted_work_from_the_history():
    router, _ = make(max_tokens=2000)
    # past lengths: "long" 1000 tokens per rollout, the others 10
    router._store.add([(f"u{i}", (pid, [1], [0] * length, 0)) for i, (pid, length) in enumerate([("long", 1000), ("x", 10), ("y", 10), ("z", 10)])])
    _, s_long = acquire(router, "long")
    others = [acquire(router, p)[1] for p in ("x", "y", "z")]
    assert all(s != s_long for s in others)  # 3 short requests together weigh less than the long one


def test_release_returns_predicted_work_and_unknown_release_is_ignored():
    router, _ = make()
    rid, sid = acquire(router, "a")
    assert router.get_status()["predicted_work"][sid] == pytest.approx(router._predicted["a"][0]) and router._predicted["a"][0] > 0
    router.release_server(sid, request_id=rid)
    router.release_server("nowhere", request_id="x")
    assert router.get_status()["predicted_work"][sid] == 0 and router.get_total_inflight() == 0


def test_a_moved_problem_pulls_its_rollouts_on_the_new_server_once():
    router, servers = make()
    _, first = acquire(router, "p", prompt=(7, 8))
    for k in range(3):
        assert publish(router, "p", [7, 8], [100 + k, 5, 6], 0)
    assert servers[first].rollouts == []  # its own rollouts are already in its drafter
    router.clear_sticky_cache()
    router._place = lambda pid: next(s for s in router.get_all_servers() if s != first)  # force the move
    rid, second = acquire(router, "p", prompt=(7, 8))
    acquire(router, "p", prompt=(7, 8))
    assert second != first
    assert sorted(r[2][0] for r in servers[second].rollouts) == [100, 101, 102]  # all of iteration 1, once
    assert all(r[0] == "p" and r[1] == [7, 8] and r[3] == 0 for r in servers[second].rollouts)
    assert router.das_stats()["history"][second]["pulled"] == 3
    assert router.das_stats()["placements"] == [{"p": first}, {"p": second}]


def test_concurrent_requests_of_a_moved_problem_wait_for_one_batched_pull():
    """Requests arriving together: each returns only after its server holds its problem's history;
    the problems new to a server while one pull runs are pulled together in the next."""
    router, servers = make()
    for pid in ("p", "q", "r"):
        acquire(router, pid)
        publish(router, pid, [1], [ord(pid)], 0)
    before = {pid: sid for pid, sid in router.das_stats()["placements"][0].items()}
    router.clear_sticky_cache()
    router._place = lambda pid: next(s for s in router.get_all_servers() if s != before[pid])
    pulls = []
    for server in servers.values():
        rpc = server.collective_rpc

        def recording(method, *a, _rpc=rpc, _server=server, **kw):
            pulls.append((_server, len(kw["args"][0])))
            return _rpc(method, *a, **kw)

        server.collective_rpc = recording

    async def many():
        reqs = [router.acquire_server(request_id=f"c{i}", prompt_ids=[1], sampling_params=sp(pid)) for i, pid in enumerate("pqr" * 4)]
        out = []
        for coro in asyncio.as_completed(reqs):
            sid, handle = await coro
            out.append((sid, sorted({r[0] for r in handle.rollouts})))
        return out

    got = asyncio.run(many())
    for sid, held in got:  # no request returned before its server held its problem's history
        assert held == sorted(p for p, s in before.items() if s != sid)
    assert sum(n for _, n in pulls) == 3 and len(pulls) <= 3  # each moved rollout pulled once
    assert router.das_stats()["counters"]["requests"] == 3 + 12


def test_published_rollouts_go_to_the_generating_servers_log_and_a_new_version_evicts():
    router, servers = make(evict_after=1)
    _, sid = acquire(router, "p")
    publish(router, "p", [1, 2, 3], [4, 5], 0)
    assert router.das_stats()["history"][sid]["published"] == 1
    publish(router, "q", [1], [2], 0)  # never routed: nowhere to attribute it
    assert router.das_stats()["counters"]["published"] == 1
    publish(router, "p", [1, 2, 3], [6], 1)  # newer weights: a new iteration; "p" served at version 0 is evicted
    assert router.version == 1 and router.iteration == 1
    assert servers[sid].evicted == ["p"]


def test_history_failures_do_not_stop_routing():
    class Broken:
        def pull(self, *a):
            raise ConnectionError("store down")

        def lengths(self, *a):
            raise ConnectionError("store down")

    router = DASRouter({"s0": StandInServer()}, store=Broken())
    _, sid = acquire(router, "p")
    assert sid == "s0"
    assert router.das_stats()["history"]["s0"]["store_errors"] == 1
    assert router.das_stats()["counters"]["predict_errors"] == 1


def test_removed_server_problems_are_placed_again_with_their_history():
    router, servers = make()
    _, first = acquire(router, "p")
    publish(router, "p", [1, 2, 3], [9, 9], 0)
    router.remove_servers([first])
    _, second = acquire(router, "p")
    assert second != first and [r[2] for r in servers[second].rollouts] == [[9, 9]]


def test_bad_config_and_requests_are_named():
    with pytest.raises(ValueError, match="unknown config keys"):
        make(windw=3)
    with pytest.raises(ValueError, match="window"):
        make(window=0)
    with pytest.raises(ValueError, match="max_tokens"):
        make(max_tokens=0)
    with pytest.raises(RuntimeError, match="no rollout servers"):
        asyncio.run(DASRouter({}, store=HistoryStore()).acquire_server("r", prompt_ids=[1], sampling_params=sp("a")))
    with pytest.raises(ValueError, match="das_problem_id or prompt_ids"):
        request_problem({}, None)
    assert request_problem({}, [1, 2]) == request_problem(None, [1, 2])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(1, 2000)), min_size=1, max_size=40), st.integers(1, 4))
def test_each_problem_on_one_server_and_new_problems_to_the_least_predicted_work(groups, n):
    """Online placement by predicted work: a problem new to the iteration goes to a server whose predicted
    outstanding work is the least at that moment; a problem never splits within an iteration; the servers'
    predicted work adds up to the requests' predicted lengths."""
    router, _ = make(n=n)
    for pid, length in groups:
        router._predicted.setdefault(pid, (float(length), 0))
    where = {}
    for pid, _ in groups:
        loads = dict(router.get_status()["predicted_work"])
        _, sid = acquire(router, pid)
        if pid not in where:
            assert loads[sid] == min(loads.values())
        assert where.setdefault(pid, sid) == sid
    total = sum(router._predicted[pid][0] for pid, _ in groups)
    assert sum(router.get_status()["predicted_work"].values()) == pytest.approx(total)


def test_agent_loop_publishes_through_a_das_router_only(monkeypatch):
    import sys

    from integrations.rl import recipes

    class SingleTurnAgentLoop:
        def __init__(self, **kwargs):
            self.server_manager = kwargs.get("server_manager")

        async def run(self, sampling_params, **kwargs):
            return types.SimpleNamespace(prompt_ids=[1, 2], response_ids=[3, 4], extra_fields={"min_global_steps": 2})

    names = ["verl", "verl.experimental", "verl.experimental.agent_loop", "verl.experimental.agent_loop.single_turn_agent_loop"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].SingleTurnAgentLoop = SingleTurnAgentLoop
    monkeypatch.setattr(recipes, "_VERL_LOOP", None)
    published = []

    class Remote:
        async def remote(self, *args):
            published.append(args)

    class Handle:  # a Ray actor handle of DASRouter: das_publish.remote(...)
        das_publish = Remote()

    loop = das_agent_loop(server_manager=types.SimpleNamespace(_load_balancer=Handle()))
    asyncio.run(loop.run({}, raw_prompt=[], index=3, data_source="src"))
    assert published == [("src/3", [1, 2], [3, 4], 2)]
    plain = das_agent_loop(server_manager=types.SimpleNamespace(_load_balancer=object()))  # verl's own balancer
    asyncio.run(plain.run({}, raw_prompt=[], index=3, data_source="src"))
    assert len(published) == 1


def test_the_shipped_router_yaml_builds_the_router_as_verls_plugin_does():
    """verl's plug-in builds ``router_class(servers, <the whole YAML>)``."""
    from integrations.rl.recipes import RECIPES_DIR, load_yaml
    from integrations.rl.verl_router import ROUTER_CONFIG

    cfg = load_yaml(RECIPES_DIR.parent / ROUTER_CONFIG)
    module, _, name = cfg["router_class"].rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    router = cls({"s0": StandInServer()}, cfg, store=HistoryStore())
    assert isinstance(router, DASRouter) and router.config["window"] == 16
