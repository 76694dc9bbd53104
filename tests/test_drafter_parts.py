"""The parts of DASDrafter, each on its own: problem store, request table, tree table, mixer state,
global tree, step threads, argument checks and the trie's invariant check."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from das import checks, step_threads
from das import trie_kernels as kernels
from das.global_tree import GlobalTree
from das.mixer_state import MixerState
from das.problem_store import ProblemStore
from das.request_table import Request, RequestTable
from das.suffix_tree import SuffixTree
from das.tree_table import TreeTable
from das.trie_invariants import check_trie

TAIL = np.array([7, 8, 9], np.int64)


def store_of(**kw):
    trees, table = TreeTable(), RequestTable()
    settings_ = dict(window=2, decay=0.5, keep_visits=0, age_in_visits=False, max_depth=6, max_problems=8, prior=0.3) | kw
    return trees, table, ProblemStore(trees, table, **settings_)


def start_live(store: ProblemStore, table: RequestTable, pid, rid) -> Request:
    """A live request of ``pid`` as the drafter registers one (no request tree, no global tree)."""
    prob, seq = store.start_rollout(pid, rid, TAIL, 0)
    h = table.new_handle()
    req = Request(pid, prob, seq, store.version, None, None, None, h, -1, TAIL.shape[0])
    table.add(rid, req)
    slot, w = prob.tree.slot_and_weight(seq)
    table.tree_refs[h] = (prob.tree_index, slot, -1, -1, TAIL.shape[0], -1)
    table.problem_weights[h] = w
    return req


# ---------------------------------------------------------------------- problem store


def test_the_window_keeps_the_last_versions_and_the_kept_visits():
    _, _, store = store_of(window=2)
    for v in (0, 1, 2, 3):
        store.begin(v)
        store.add_rollout(store.use("p"), np.array([1, 2, v]), v)
    assert sorted(store.get("p").by_version) == [2, 3] and store.get("p").tree.num_sequences == 2
    store.begin(10)  # everything expired: the problem goes
    assert "p" not in store
    _, _, kept = store_of(window=2, keep_visits=1)
    for v in (0, 1):
        kept.begin(v)
        kept.add_rollout(kept.use("p"), np.array([1, 2, v]), v)
    kept.begin(300)  # back once per epoch: the last visit stays, however old
    assert sorted(kept.get("p").by_version) == [1]
    assert kept.accepts("p", 1) and not kept.accepts("p", 0) and kept.accepts("q", 0)  # q: unknown, its last visit would be 0
    assert not store.accepts("p", 0)


def test_the_age_clock_counts_visits_and_weights_grow_by_one_over_decay():
    _, _, store = store_of(age_in_visits=True, window=100)
    prob = store.use("p")
    clocks = []
    for v in (0, 5, 300):
        store.begin(v)
        clocks.append(store.clock(prob, v))
        prob.by_version.setdefault(v, [])
    assert clocks == [1, 2, 3]  # three visits, whatever the versions
    assert store.clock(prob, 5) == 2 and store.clock(prob, 2) == 1  # out of order: the kept visits after it
    assert store.weight(prob, 3) == pytest.approx(0.5 ** -(3 - prob.base))


def test_a_rescale_moves_the_base_and_the_live_requests_follow():
    trees, table, store = store_of(window=1000, decay=0.5)
    req = start_live(store, table, "p", "r")
    prob = req.problem
    store.begin(100)
    w = store.weight(prob, 100)  # 0.5 ** -100 > 2**40: rescaled to 1
    assert w == 1.0 and prob.base == 100
    assert table.problem_weights[req.handle] == prob.tree.weight(req.problem_seq) == pytest.approx(0.5 ** 100)
    assert trees.prior[prob.tree_index] == store.prior_of(prob)


def test_lru_eviction_spares_live_problems_and_the_new_one():
    _, table, store = store_of(max_problems=2)
    start_live(store, table, "live", "r")
    store.use("a")
    store.use("b")  # over the limit: "a" (idle, least recently used) goes, "live" stays
    assert list(store.problems) == ["live", "b"]
    store.use("live")
    store.use("c")
    assert list(store.problems) == ["live", "c"]


def test_dropping_a_problem_detaches_its_live_requests():
    trees, table, store = store_of()
    req = start_live(store, table, "p", "r")
    ti = req.problem.tree_index
    store.drop("p")
    assert req.problem is None and ti in trees.free
    assert table.tree_refs[req.handle, kernels.R_PROBLEM_TREE] == -1 and table.tree_refs[req.handle, kernels.R_PROBLEM_SLOT] == -1


def test_a_rollout_that_outlived_its_window_leaves_when_it_stops():
    _, table, store = store_of(window=1)
    req = start_live(store, table, "p", "r")
    store.begin(5)
    assert "p" in store  # live: kept
    table.pop("r")
    store.stop_rollout("r", "p", req.problem, req.version, req.problem_seq)
    assert "p" not in store


# ---------------------------------------------------------------------- request table


def test_handles_are_reused_and_the_arrays_grow_keeping_their_rows():
    table = RequestTable(capacity=2)
    a, b = table.new_handle(), table.new_handle()
    table.tree_refs[a, kernels.R_NUM_TOKENS] = 11
    c = table.new_handle()  # none free: the arrays double
    assert table.capacity == 4 and len({a, b, c}) == 3 and table.tree_refs[a, kernels.R_NUM_TOKENS] == 11
    table.free_handle(b)
    assert table.new_handle() == b and (table.tree_refs[b] == -1).all()


def test_handles_of_names_what_is_wrong():
    table = RequestTable()
    req = Request("p", None, 0, 0, None, None, None, table.new_handle(), -1, 3)
    table.add("r", req)
    assert table.handles_of(["r", "r"]).tolist() == [req.handle] * 2 and "r" in table and len(table) == 1
    with pytest.raises(KeyError, match="unknown request 'x'"):
        table.handles_of(["r", "x"])
    with pytest.raises(ValueError, match="sequence of request ids"):
        table.handles_of(5)
    with pytest.raises(ValueError, match="hashable"):
        table.handles_of([["r"]])
    assert table.pop("r") is req and table.pop("r") is None and "r" not in table


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=60))
def test_distinct_says_whether_a_handle_repeats(handles):
    table = RequestTable(capacity=64)
    h = np.array(handles, np.int64)
    assert table.distinct(h) == (len(set(handles)) == len(handles))
    assert table.distinct(np.unique(h))  # an earlier call's stamps do not linger


def test_the_table_follows_live_sequences_a_global_rebuild_moved():
    table = RequestTable()
    g = SuffixTree(4)
    reqs = []
    for i in range(3):
        req = Request("p", None, 0, 0, None, None, None, table.new_handle(), -1, 0)
        req.global_seq = g.add([i, i + 1])
        table.add(i, req)
        table.tree_refs[req.handle, kernels.R_GLOBAL_SLOT] = 99  # stale
        reqs.append(req)
    table.follow_global(g)
    assert [table.tree_refs[r.handle, kernels.R_GLOBAL_SLOT] for r in reqs] == [g.slot(r.global_seq) for r in reqs]
    assert table.check(g) == {}  # no request trees


# ---------------------------------------------------------------------- tree table


def test_the_tree_table_holds_each_trees_current_buffer_and_reuses_indices():
    trees = TreeTable()
    a, b = SuffixTree(4), SuffixTree(4)
    ia, ib = trees.add(a), trees.add(b)
    assert ia != ib
    sid = a.add([1, 2, 3])
    a.extend(sid, np.arange(5000) % 17)  # outgrows its buffer: the table hears of the new one
    trees.check({ia: a, ib: b})
    trees.release(ib, b)
    b.add(np.arange(5000) % 13)  # no longer registered: the table keeps the empty placeholder
    assert trees.bufs[ib] is trees.empty and trees.add(SuffixTree(4)) == ib
    with pytest.raises(AssertionError):
        trees.check({ia: b})


# ---------------------------------------------------------------------- mixer state


def test_the_mixer_grows_with_the_handles_and_keeps_what_is_pending():
    m = MixerState(0.1, handles=2)
    m.pending.lengths[1] = 3
    m.pending.tokens[1, :3] = (5, 6, 7)
    m.pending.stop[0] = 9
    m.grow_handles(4)
    assert m.handles == 4 and m.pending.tokens.shape == (4, 16) and m.pending.inputs.shape[:2] == (4, 16)
    assert m.pending.tokens[1, :3].tolist() == [5, 6, 7] and m.pending.lengths.tolist() == [0, 3, 0, 0]
    assert m.pending.stop.tolist() == [9, -1, -1, -1]
    m.drop_pending(0)
    assert m.pending.stop[0] == -1
    m.fit_draft_length(8)  # long enough already: nothing dropped
    assert m.pending.lengths[1] == 3
    m.fit_draft_length(32)  # a longer draft than ever: room for it, pending drafts dropped
    assert m.pending.tokens.shape == (4, 32) and m.pending.sets.shape == (4, 32) and not m.pending.lengths.any()


def test_the_outcome_tables_age_and_the_weights_are_copied():
    m = MixerState(0.1)
    m.model.outcomes[0, 5] = (2.0, 4.0)
    m.age(0.5)
    assert m.model.outcomes[0, 5].tolist() == [1.0, 2.0]
    w = m.weight_sets()
    w[:] = 7.0
    assert not (m.model.weights == 7.0).any()


# ---------------------------------------------------------------------- global tree


def test_the_global_tree_keeps_the_newest_finished_rollouts():
    trees, table = TreeTable(), RequestTable()
    g = GlobalTree(trees, table, depth=4, rollouts=2, defer=False)
    for i in range(4):
        g.add_finished(np.array([i, i, i]))
    assert [g.tree.sequence(s).tolist() for s in g.finished] == [[2, 2, 2], [3, 3, 3]] and g.tree.num_sequences == 2
    seq, slot = g.add_live(TAIL, 10)
    assert g.tree.slot(seq) == slot
    g.stop_live(seq)  # counted as finished at once: the oldest goes
    assert list(g.finished)[-1] == seq and len(g.finished) == 2


def test_deferred_work_waits_for_the_background_thread_or_a_sync():
    trees, table = TreeTable(), RequestTable()
    g = GlobalTree(trees, table, depth=4, rollouts=1, defer=True)
    req = Request("p", None, 0, 0, None, None, None, table.new_handle(), -1, 0)
    req.global_seq, slot = g.add_live(TAIL, 10)
    table.add("r", req)
    table.tree_refs[req.handle, kernels.R_GLOBAL_SLOT] = slot
    tokens = np.array([[1, 2, 3, 4]], np.int32)
    g.defer_rows(np.array([req.handle]), tokens, np.array([1]), np.array([4]))
    assert g.tree.sequence(req.global_seq).tolist() == TAIL.tolist()  # not yet
    g.start()
    assert any(t.name.startswith("das-global") for t in threading.enumerate())
    g.sync()
    assert g.tree.sequence(req.global_seq).tolist() == TAIL.tolist() + [2, 3, 4] and g.deferred_appends == 1
    g.stop_live(req.global_seq)
    assert g.pending_keeps == 1 and not g.finished
    g.sync(keeps=False)  # the engine's per-step verbs leave stops to the next job
    assert g.pending_keeps == 1
    g.close()
    assert g.pending_keeps == 0 and list(g.finished) == [req.global_seq] and g.deferred_keeps == 1


def test_an_error_on_the_background_thread_is_raised_by_the_next_sync(monkeypatch):
    trees, table = TreeTable(), RequestTable()
    g = GlobalTree(trees, table, depth=4, rollouts=1, defer=True)

    def broken(*args):
        raise RuntimeError("append failed")

    monkeypatch.setattr(g, "append_rows", broken)
    g.defer_rows(np.zeros(1, np.int64), np.zeros((1, 2), np.int32), np.zeros(1, np.int64), np.ones(1, np.int64))
    g.start()
    with pytest.raises(RuntimeError, match="append failed"):
        g.sync()
    g.sync()  # raised once


# ---------------------------------------------------------------------- step threads


def test_threads_for_a_step_start_at_parallel_rows(monkeypatch):
    import numba

    monkeypatch.setattr(step_threads, "PARALLEL_ROWS", 16)
    assert step_threads.threads_for(15, 8) == 1 and step_threads.threads_for(100, 1) == 1
    assert step_threads.threads_for(16, 8) == min(8, numba.get_num_threads())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 9)), min_size=1, max_size=80), st.integers(2, 8), st.booleans(), st.booleans())
def test_insert_owners_keep_a_tree_on_one_part(rows, parts, glob, learn):
    keys = np.array([k for k, _ in rows], np.int64)
    work = np.array([w for _, w in rows], np.int64)
    owner = step_threads.insert_owners(keys, work, parts, parts - 1 if glob else -1, 0 if learn else -1)
    assert owner.shape == keys.shape and owner.min() >= 0 and owner.max() < parts
    for k in np.unique(keys):
        assert np.unique(owner[keys == k]).shape[0] == 1
    if parts < step_threads.BALANCED_PARTS:
        assert owner.tolist() == (keys % parts).tolist()


def test_on_threads_cuts_numbas_team_for_the_call_and_restores_it():
    import numba

    team = numba.get_num_threads()
    seen = []
    step_threads.on_threads(1, lambda *a: seen.append((numba.get_num_threads(), a)), "x")
    assert seen == [(1, ("x",))] and numba.get_num_threads() == team
    with pytest.raises(RuntimeError):
        step_threads.on_threads(1, lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert numba.get_num_threads() == team


# ---------------------------------------------------------------------- argument checks


def test_checks_name_the_argument_and_the_value():
    assert checks.int_arg(np.int64(3), "n", 1, 5) == 3
    for bad, match in ((True, "n must be an int, got True"), (2.0, "n must be an int"), (0, "n must be >= 1, got 0"), (6, "n must be <= 5")):
        with pytest.raises(ValueError, match=match):
            checks.int_arg(bad, "n", 1, 5)
    with pytest.raises(ValueError, match=r"x must be a number in \(0, 1\], got 2"):
        checks.float_arg(2, "x", "a number in (0, 1]", lambda f: 0 < f <= 1)
    with pytest.raises(ValueError, match=r"token -1 at index 1 of ids is out of range"):
        checks.check_range(np.array([0, -1], np.int64), "ids")
    with pytest.raises(ValueError, match=r"min_prob\[1\] must be a number in \[0, 1\], got 1.5"):
        checks.min_probs(np.array([0.1, 1.5]), 2)
    assert checks.min_probs(0.25, 3).tolist() == [0.25] * 3
    m = np.zeros((2, 3), np.int32)
    assert checks.token_matrix(m, 2) is m and checks.token_matrix(m.astype(np.uint8), 1).dtype == np.int64
    v = np.arange(2, dtype=np.int64)
    assert checks.row_vector(v, "ends", 2) is v


@given(st.lists(st.integers(0, 2**20 - 1), max_size=20), st.sampled_from([np.int8, np.uint16, np.int32, np.int64, np.uint32]))
def test_as_tokens_gives_int32_or_int64_without_copying_those(values, dtype):
    if np.iinfo(dtype).max < max(values, default=0):
        return
    a = np.asarray(values, dtype=dtype)
    t = checks.as_tokens(a)
    assert t.dtype in (np.int32, np.int64) and t.tolist() == values
    if dtype in (np.int32, np.int64):
        assert t is a


# ---------------------------------------------------------------------- the trie's invariant check


def test_check_trie_finds_a_corrupted_count():
    tree = SuffixTree(4)
    tree.add([1, 2, 3, 1, 2, 4])
    tree.check_invariants()
    buf = tree.buffer.copy()
    meta, nodes, weights, hash_table, seqs, pool = kernels.buffer_views(buf)
    args = ({s: s for s in range(1)}, {0: 0}, [], 0, int(seqs[0, kernels.S_CAP]))
    check_trie(buf, *args)
    u = int(nodes[0, kernels.C_FIRST])
    weights[u, 0] += 1.0  # a child's weighted count no longer sums into its parent's
    with pytest.raises(AssertionError):
        check_trie(buf, *args)
