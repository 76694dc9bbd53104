"""The shared rollout history (integrations.rl.history) without Ray: the store and the engines' clients.

A fake drafter per engine records what it was given; the properties say that wherever a problem
is served, its engine holds every rollout of the problem within the window, exactly once.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from integrations.rl.history import HistoryClient, HistoryStore


class FakeDrafter:
    """What an engine's drafter holds: problem -> list of (output ids, version), in arrival order."""

    def __init__(self):
        self.held: dict[str, list[tuple[tuple[int, ...], int]]] = {}
        self.evicted: list[str] = []

    def ingest(self, rollouts):
        for pid, _prompt, out, v in rollouts:
            self.held.setdefault(pid, []).append((tuple(out), v))

    def evict(self, pids):
        for p in pids:
            self.held.pop(p, None)
            self.evicted.append(p)


class Engine:
    """A client plus its drafter; generate() makes unique outputs and 'drafts' them live (adds them to the drafter)."""

    counter = 0

    def __init__(self, store, window=16, evict_after=2):
        self.drafter = FakeDrafter()
        self.client = HistoryClient(store, self.drafter.ingest, self.drafter.evict, window=window, evict_after=evict_after)

    def generate(self, pid, n=2):
        self.client.before_generate([(pid, [1, 2])])
        seen = list(self.drafter.held.get(pid, []))
        outs = []
        for _ in range(n):
            Engine.counter += 1
            outs.append((pid, [1, 2], [Engine.counter], self.client.version))
        self.drafter.ingest(outs)  # the live requests' rollouts stay in the drafter
        self.client.after_generate(outs)
        return seen


def all_rollouts(store, pid):
    got = store.pull([pid])
    return sorted((tuple(r[3]), r[2]) for r in got["rollouts"].get(pid, []))


def test_an_engine_new_to_a_problem_gets_its_history_before_drafting():
    store = HistoryStore(window=4)
    a, b = Engine(store), Engine(store)
    for e in (a, b):
        e.client.begin_iteration(1)
    a.generate("p")
    for e in (a, b):
        e.client.begin_iteration(2)
    seen = b.generate("p")
    assert sorted(seen) == all_rollouts(store, "p")[:2] and len(seen) == 2
    assert [v for _, v in seen] == [1, 1]
    # b's own rollouts are not sent back to it as new ones
    b.client.before_generate([("p", [1, 2])])
    assert len(b.drafter.held["p"]) == 4


def test_the_store_keeps_the_window_and_the_last_visits():
    store = HistoryStore(window=2, keep_visits=1)
    store.add([("u1", ("p", [1], [10], 1)), ("u2", ("q", [1], [20], 1)), ("u3", ("q", [1], [21], 3))])
    info = store.begin_iteration(4)  # window keeps versions >= 3; p keeps its last visit (version 1), q loses version 1
    assert info["rollouts"] == 2
    assert all_rollouts(store, "p") == [((10,), 1)] and all_rollouts(store, "q") == [((21,), 3)]
    assert store.add([("u3", ("q", [1], [21], 3))])["added"] == 0  # a uid is stored once
    with pytest.raises(ValueError, match="window"):
        HistoryStore(window=0)


def test_problems_not_served_recently_leave_the_drafter_and_come_back_whole():
    store = HistoryStore(window=8)
    a, b = Engine(store, evict_after=1), Engine(store, evict_after=1)
    a.client.begin_iteration(1)
    a.generate("p")
    a.client.begin_iteration(2)
    assert a.drafter.evicted == ["p"] and "p" not in a.drafter.held  # not served in version 2's begin: gone
    b.client.begin_iteration(2)
    b.generate("p")
    a.client.begin_iteration(3)
    a.generate("p")  # back: its own version-1 rollouts and b's version-2 ones
    assert sorted(a.drafter.held["p"]) == all_rollouts(store, "p")


def test_an_unreachable_store_leaves_the_engine_drafting_from_what_it_holds():
    class Down:
        def __getattr__(self, name):
            raise ConnectionError("history actor is restarting")

    e = Engine(Down())
    e.client.begin_iteration(1)
    assert e.generate("p") == [] and e.client.counters["store_errors"] == 2  # pull and publish both failed, nothing raised
    assert len(e.drafter.held["p"]) == 2


def test_a_restarted_store_is_refilled_from_the_engines_and_nobody_ingests_twice():
    stores = [HistoryStore(window=8)]
    a, b = Engine(lambda: stores[-1]), Engine(lambda: stores[-1])
    for e in (a, b):
        e.client.begin_iteration(1)
    a.generate("p")
    b.generate("q")
    for e in (a, b):
        e.client.begin_iteration(2)
    a.generate("q")  # a pulls q from b
    stores.append(HistoryStore(window=8))  # the actor restarted: empty, new epoch
    b.generate("p")  # b sees the new epoch, re-publishes its own rollouts, then pulls p: a's are not there yet
    a.generate("p")  # a re-publishes its own (p and q)
    b.generate("p")
    assert sorted(b.drafter.held["p"]) == all_rollouts(stores[-1], "p")
    assert len(b.drafter.held["p"]) == len(set(b.drafter.held["p"])) == 8  # a: 2 + 2, b: 2 + 2
    assert sorted(a.drafter.held["q"]) == all_rollouts(stores[-1], "q") and len(a.drafter.held["q"]) == 4
    assert a.client.counters["resyncs"] == b.client.counters["resyncs"] == 1


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from("pqrs"), st.integers(0, 2)), min_size=1, max_size=4), min_size=1, max_size=6),
       st.integers(1, 3), st.integers(1, 3))
def test_wherever_a_problem_is_served_its_engine_holds_its_whole_window_once(iterations, window, evict_after):
    store = HistoryStore(window=window, keep_visits=0)
    engines = [Engine(store, window=window, evict_after=evict_after) for _ in range(3)]
    for version, placed in enumerate(iterations, start=1):
        store.begin_iteration(version)
        for e in engines:
            e.client.begin_iteration(version)
        for pid, engine in placed:
            e = engines[engine]
            e.generate(pid)
            held = [r for r in e.drafter.held[pid] if r[1] >= version - window + 1]
            assert len(held) == len(set(held))  # nothing twice
            assert sorted(held) == all_rollouts(store, pid)  # the whole window, whoever generated it
