"""The global tree with deferred appends (``defer_global``): the same tree and drafts as appending at
once, its loci looked up from the root, stops and failures of the background job."""

from __future__ import annotations

import numpy as np
import pytest

from das import DASDrafter, suffix_tree
from das import trie_kernels as kernels


def _history_drafters(rng, **kw):
    """Two drafters with the same history of 4 problems (patterns with noise) and 12 live requests."""
    patterns = [rng.integers(0, 12, 30) for _ in range(4)]
    ds = (DASDrafter(defer_global=False, **kw), DASDrafter(defer_global=True, **kw))
    for v in range(2):
        for d in ds:
            d.begin_iteration(v)
        for p, pat in enumerate(patterns):
            for _ in range(3):
                out = np.where(rng.random(pat.shape[0]) < 0.2, rng.integers(0, 12, pat.shape[0]), pat)
                for d in ds:
                    d.add_rollout([p, 99], out, problem_id=p)
    rows = [f"r{i}" for i in range(12)]
    toks = {rid: [i % 4, 99] for i, rid in enumerate(rows)}
    for rid in rows:
        for d in ds:
            d.start_request(rid, toks[rid], problem_id=int(rid[1:]) % 4)
    return ds, patterns, rows, toks


def _grow(rng, patterns, rows, toks):
    """Each row's next 1-3 tokens (its problem's pattern, the engine's token matrix and ends)."""
    mat = np.zeros((len(rows), 128), np.int32)
    ends = np.zeros(len(rows), np.int64)
    for r, rid in enumerate(rows):
        pat = patterns[r % 4]
        n = len(toks[rid]) - 2
        toks[rid] += [int(pat[(n + j) % pat.shape[0]]) for j in range(int(rng.integers(1, 4)))]
        mat[r, : len(toks[rid])] = toks[rid]
        ends[r] = len(toks[rid])
    return mat, ends


def test_global_loci_looked_up_from_the_root_are_the_live_sequence_loci():
    """With ``defer_global`` the global scope's loci come from lookups of the context's suffixes
    (:func:`das.mix_kernels._context_loci`) instead of the request's live sequence there. On an
    up-to-date global tree (per-row calls append at once) they are the same loci: the same
    drafts, probabilities and learning, step after step."""
    rng = np.random.default_rng(5)
    (eager, deferred), patterns, rows, toks = _history_drafters(rng, window=4, max_depth=8, min_token_prob=0.05, global_rollouts=16)
    drafted = 0
    for _ in range(10):
        n0 = {rid: len(toks[rid]) for rid in rows}
        _grow(rng, patterns, rows, toks)
        for rid in rows:
            got = []
            for d in (eager, deferred):
                d.add_tokens(rid, toks[rid][n0[rid]:])
                got.append(d.speculate(rid, 6))
            assert got[0].tokens.tolist() == got[1].tokens.tolist()
            assert got[0].probs.tolist() == got[1].probs.tolist()
            drafted += got[0].tokens.shape[0]
    assert drafted > 0 and deferred.deferred_appends == 0
    assert eager.mixer_weights.tolist() == deferred.mixer_weights.tolist()


def test_deferred_global_appends_run_after_the_drafts_and_leave_the_same_tree():
    """``defer_global``: :meth:`add_tokens_batch` leaves the global tree as it was, the step's
    :meth:`speculate_batch` drafts and then starts the appends on the background thread, and the
    next call waits for them: the global tree then holds every live rollout exactly as the
    eager drafter's does (the drafts differ a little: they read it one step behind)."""
    rng = np.random.default_rng(7)
    (eager, deferred), patterns, rows, toks = _history_drafters(rng, window=4, max_depth=8, min_token_prob=0.05, global_rollouts=16)
    budgets = np.full(len(rows), 6, np.int64)
    for _ in range(8):
        before = {rid: list(toks[rid]) for rid in rows}
        mat, ends = _grow(rng, patterns, rows, toks)
        for d in (eager, deferred):
            d.add_tokens_batch(rows, mat, None, ends)
        for rid in rows:  # the last step's tokens are in (it waited for them), this step's not yet
            assert deferred._global.tree.sequence(deferred._requests.requests[rid].global_seq).tolist() == before[rid]
        got = [d.speculate_batch(rows, budgets) for d in (eager, deferred)]
        assert int(got[1].lengths.sum()) > 0
    deferred._check_batch_state()  # waits for the last background append
    assert deferred.deferred_appends == 8 and deferred.deferred_ns > 0
    for rid in rows:
        e, f = (d._global.tree.sequence(d._requests.requests[rid].global_seq).tolist() for d in (eager, deferred))
        assert e == f == toks[rid]
    assert deferred._global.tree.num_tokens == eager._global.tree.num_tokens


def test_deferred_stops_keep_the_same_finished_rollouts_in_the_global_tree(monkeypatch):
    """``defer_global``: :meth:`stop_request` leaves its global-tree part (the rollout counted as
    finished there, the oldest ones removed past ``global_rollouts``, now and then a rebuild that
    moves the live sequences' slots) to the next background job. Requests stop and start every
    step; once synced, the global tree holds the same finished and live rollouts as the eager
    drafter's, and every live request's global slot is its sequence's."""
    monkeypatch.setattr(suffix_tree, "_REBUILD_MIN_TOKENS", 16)  # rebuild soon (else only past 4096 removed tokens)
    monkeypatch.setattr(suffix_tree, "_REBUILD_RATIO", 1)
    rng = np.random.default_rng(11)
    (eager, deferred), patterns, rows, toks = _history_drafters(rng, window=4, max_depth=8, min_token_prob=0.05, global_rollouts=6)
    rows = list(rows)
    budgets = np.full(len(rows), 6, np.int64)
    fresh = 0
    for step in range(12):
        mat, ends = _grow(rng, patterns, rows, toks)
        for d in (eager, deferred):
            d.add_tokens_batch(rows, mat, None, ends)
            d.speculate_batch(rows, budgets)
        kept = len(deferred._global.finished)
        for r in (step % len(rows), (step + 5) % len(rows)):  # two requests finish, two new ones take their rows
            old, new = rows[r], f"n{fresh}"
            fresh += 1
            toks[new] = [r % 4, 99]
            for d in (eager, deferred):
                d.stop_request(old)
                d.start_request(new, toks[new], problem_id=r % 4)
            rows[r] = new
        assert len(deferred._global.finished) == kept and deferred._global.pending_keeps == 2  # not yet: the next job's work
    for d in (eager, deferred):
        d._check_batch_state()  # syncs: runs what is left
    assert deferred.deferred_keeps == 2 * 12 and eager.deferred_keeps == 0
    assert deferred._global.tree.rebuilds > 0  # slots moved while requests were live
    finished = [[d._global.tree.sequence(s).tolist() for s in d._global.finished] for d in (eager, deferred)]
    assert finished[0] == finished[1]
    assert len(deferred._global.finished) == 6 and deferred._global.tree.num_tokens == eager._global.tree.num_tokens
    for rid in rows:
        req = deferred._requests.requests[rid]
        assert deferred._global.tree.sequence(req.global_seq).tolist() == toks[rid]
        assert deferred._requests.tree_refs[req.handle, kernels.R_GLOBAL_SLOT] == deferred._global.tree.slot(req.global_seq)


def test_a_failing_background_append_surfaces_at_the_next_call(monkeypatch):
    """An error on the background thread is raised by the drafter's next call, not lost."""
    rng = np.random.default_rng(9)
    (_, d), patterns, rows, toks = _history_drafters(rng, global_rollouts=16)

    def broken(*args, **kwargs):
        raise RuntimeError("global tree append failed")

    monkeypatch.setattr(d._global, "append_rows", broken)
    mat, ends = _grow(rng, patterns, rows, toks)
    d.add_tokens_batch(rows, mat, None, ends)
    d.speculate_batch(rows, np.full(len(rows), 4, np.int64))  # starts the broken append
    with pytest.raises(RuntimeError, match="global tree append failed"):
        d.stop_request(rows[0])


def test_defer_global_is_a_bool_or_none_and_needs_a_global_tree():
    assert DASDrafter().defer_global is False
    assert DASDrafter(defer_global=True).defer_global is True
    assert DASDrafter(defer_global=True, global_rollouts=0).defer_global is False
    assert DASDrafter(defer_global=True, chooser="walk").defer_global is False
    with pytest.raises(ValueError, match="defer_global must be a bool or None, got 'yes'"):
        DASDrafter(defer_global="yes")
