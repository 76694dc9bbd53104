"""SuffixTree against a brute-force oracle (counts, continuations, greedy drafts, memory)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from das import trie_kernels as kernels
from das.suffix_tree import VOCAB_LIMIT, Draft, SuffixTree


class Oracle:
    """Stores the weighted sequences; counts every substring occurrence by brute force.

    The occurrences of every substring (up to D tokens) and what follows each are tabulated once
    per change of the stored tokens (weights apply at query time): plain dictionaries, no tree.
    """

    def __init__(self, max_depth):
        self.D = max_depth
        self.seqs = {}  # id -> [tokens list, weight]
        self._index = None  # (pattern -> {sid: occurrences}, pattern -> set of next tokens)

    def add(self, sid, tokens, w):
        self.seqs[sid] = [list(tokens), w]
        self._index = None

    def extend(self, sid, tokens):
        self.seqs[sid][0].extend(tokens)
        self._index = None

    def remove(self, sid):
        del self.seqs[sid]
        self._index = None

    def scale(self, f):
        for s in self.seqs.values():
            s[1] *= f

    def _occurrences(self):
        if self._index is None:
            occ, nxt = {}, {}
            for sid, (toks, _) in self.seqs.items():
                for i in range(len(toks)):
                    for m in range(0, self.D + 1):
                        if i + m > len(toks):
                            break
                        pat = tuple(toks[i : i + m])
                        if m:
                            per = occ.setdefault(pat, {})
                            per[sid] = per.get(sid, 0) + 1
                        if m < self.D and i + m < len(toks):
                            nxt.setdefault(pat, set()).add(toks[i + m])
            self._index = (occ, nxt)
        return self._index

    def raw(self, pat):
        pat = tuple(pat)
        m = len(pat)
        if m > self.D:
            return 0
        if m == 0:
            return sum(len(toks) for toks, _ in self.seqs.values())
        return sum(self._occurrences()[0].get(pat, {}).values())

    def count(self, pat):
        pat = tuple(pat)
        m = len(pat)
        if m > self.D:
            return 0.0
        per = self._occurrences()[0].get(pat, {})
        total = 0.0
        for sid, (toks, w) in self.seqs.items():  # in insertion order, as the sums always were
            total += w * (len(toks) if m == 0 else per.get(sid, 0))
        return total

    def substrings(self):
        return {p for p in self._occurrences()[0] if p}

    def continuations(self, pat):
        pat = tuple(pat)
        if len(pat) >= self.D:
            return {}
        return {t: self.count(pat + (t,)) for t in self._occurrences()[1].get(pat, ())}

    def draft(self, context, max_tokens, min_prob=0.1, factor=1.0, min_match=1, prior=0.0):
        """The documented algorithm, spelled out: every match length, greedy walk, re-anchor."""
        D = self.D
        tail = list(context)[-(D - 1):] if D > 1 else []
        best = ([], [], 0.0, 0)
        if max_tokens == 0:
            return best
        for L in range(len(tail), min_match - 1, -1):
            s = tuple(tail[len(tail) - L :])
            if self.raw(s) == 0:
                continue
            limit = min(max_tokens, int(L * factor + 1e-9))
            cur, prob, toks, probs = s, 1.0, [], []
            while len(toks) < limit:
                if len(cur) >= D:
                    cur = cur[1:]  # re-anchor on the last D - 1 tokens
                conts = self.continuations(cur)
                if not conts:
                    break
                t = min(conts, key=lambda x: (-conts[x], x))  # most weighted, ties: smallest token
                wn, wb = sum(conts.values()), conts[t]  # what follows, not where sequences end
                if not wn > 0:
                    break
                wn += prior
                p = prob * (wb / wn) if wb < wn else prob
                if p < min_prob:
                    break
                prob = p
                toks.append(t)
                probs.append(p)
                cur = cur + (t,)
            score = 0.0
            for p in probs:
                score += p
            if score > best[2]:
                best = (toks, probs, score, L)
        return best


def assert_same(tree: SuffixTree, orc: Oracle, vocab: int, extra_patterns=()):
    subs = orc.substrings()
    assert tree.num_strings == len(subs)
    assert tree.num_nodes <= max(2 * tree.num_tokens, 0)
    assert tree.num_tokens == sum(len(t) for t, _ in orc.seqs.values())
    assert tree.num_sequences == len(orc.seqs)
    pats = set(subs) | {()} | {tuple(p) for p in extra_patterns}
    pats |= {(t,) for t in range(vocab + 1)}
    for p in pats:
        assert tree.count(p) == orc.count(p), p
        assert tree.raw_count(p) == orc.raw(p), p
        assert tree.continuations(p) == orc.continuations(p), p
    tree.check_invariants()


def assert_draft(tree: SuffixTree, orc: Oracle, context, **kw):
    got = tree.draft(context, **kw)
    toks, probs, score, mlen = orc.draft(
        context, kw["max_tokens"], kw.get("min_token_prob", 0.1), kw.get("max_spec_factor", 1.0), kw.get("min_match", 1),
        kw.get("prior", 0.0),
    )
    assert isinstance(got, Draft)
    assert got.tokens.dtype == np.int32 and got.probs.dtype == np.float32
    assert got.tokens.tolist() == toks, (context, kw)
    np.testing.assert_array_equal(got.probs, np.asarray(probs, np.float32))
    assert got.score == pytest.approx(score, rel=1e-12, abs=0)
    assert got.match_len == mlen


def tokens_st(vocab, n):
    return st.lists(st.integers(0, vocab - 1), max_size=n)


WEIGHTS = [0.25, 0.5, 1.0, 2.0, 3.0, 4.0]  # dyadic-friendly: sums are exact, so ties are exact


@st.composite
def scenario(draw, min_adds=0):
    D = draw(st.sampled_from([1, 2, 3, 4, 6] if min_adds == 0 else [2, 3, 4, 6]))
    vocab = draw(st.sampled_from([2, 3, 10]))
    first = [("add", draw(st.lists(st.integers(0, vocab - 1), min_size=4, max_size=40)), draw(st.sampled_from(WEIGHTS)))
             for _ in range(min_adds)]
    ops = first + draw(
        st.lists(
            st.one_of(
                st.tuples(st.just("add"), tokens_st(vocab, 40), st.sampled_from(WEIGHTS)),
                st.tuples(st.just("extend"), st.integers(0, 50), tokens_st(vocab, 12)),
                st.tuples(st.just("remove"), st.integers(0, 50)),
                st.tuples(st.just("scale"), st.sampled_from([0.5, 2.0, 4.0])),
            ),
            max_size=14,
        )
    )
    return D, vocab, ops


def run_ops(D, ops):
    tree, orc = SuffixTree(D), Oracle(D)
    for op in ops:
        ids = sorted(orc.seqs)
        if op[0] == "add":
            sid = tree.add(np.asarray(op[1], np.int64), weight=op[2])
            orc.add(sid, op[1], op[2])
        elif op[0] == "extend" and ids:
            sid = ids[op[1] % len(ids)]
            tree.extend(sid, op[2])
            orc.extend(sid, op[2])
        elif op[0] == "remove" and ids:
            sid = ids[op[1] % len(ids)]
            tree.remove(sid)
            orc.remove(sid)
        elif op[0] == "scale":
            tree.scale(op[1])
            orc.scale(op[1])
    return tree, orc


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_counts_match_oracle_and_memory_returns(sc):
    D, vocab, ops = sc
    tree, orc = run_ops(D, ops)
    assert_same(tree, orc, vocab, extra_patterns=[(0,) * (D + 1), (vocab - 1, 0, vocab - 1)])
    for sid in list(orc.seqs):
        tree.remove(sid)
        orc.remove(sid)
    assert tree.num_nodes == 0 and tree.num_tokens == 0 and tree.num_sequences == 0
    assert tree.nbytes == SuffixTree(D).nbytes  # back to the initial capacity
    assert tree.count([]) == 0.0 and tree.continuations([]) == {}
    tree.check_invariants()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scenario(min_adds=2),
    st.lists(st.tuples(tokens_st(10, 9), st.integers(0, 12) | st.integers(4, 12), st.sampled_from([0.0, 0.1, 0.3, 0.6]),
                       st.sampled_from([0.5, 1.0, 2.0, 3.0]), st.integers(1, 3)), min_size=1, max_size=6),
    st.data(),
)
def test_draft_matches_oracle(sc, queries, data):
    D, vocab, ops = sc
    tree, orc = run_ops(D, ops)
    seqs = [t for t, _ in orc.seqs.values() if t]
    for (ctx, max_tokens, mp, factor, mm), prior in zip(queries, data.draw(st.lists(st.sampled_from([0.0, 0.0, 0.25, 1.0]), min_size=6, max_size=6))):
        if seqs and data.draw(st.integers(0, 3)) > 0:  # a context that surely matches: a piece of a stored sequence
            s = data.draw(st.sampled_from(seqs))
            j = data.draw(st.integers(1, len(s)))
            ctx = list(ctx) + s[max(0, j - data.draw(st.integers(1, 2 * D + 2))) : j]
        ctx = [t % vocab for t in ctx]
        assert_draft(tree, orc, ctx, max_tokens=max_tokens, min_token_prob=mp, max_spec_factor=factor, min_match=mm,
                     prior=prior)
    # a stored sequence's own continuation: draft_seq (anchored on its suffix loci) == draft(its tokens)
    for sid in list(orc.seqs)[:4]:
        for max_tokens, mp, factor, prior in ((6, 0.1, 1.0, 0.0), (9, 0.0, 3.0, 0.25)):
            a = tree.draft_seq(sid, max_tokens, mp, factor, prior=prior)
            b = tree.draft(tree.sequence(sid), max_tokens, mp, factor, prior=prior)
            assert a.tokens.tolist() == b.tokens.tolist() and a.score == b.score and a.match_len == b.match_len
            np.testing.assert_array_equal(a.probs, b.probs)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario(min_adds=2), st.data())
def test_rebuild_after_removals_keeps_counts_and_live_sequences(sc, data):
    """With the rebuild threshold at 0 every removal that leaves referenced tokens rebuilds."""
    import das.suffix_tree as T

    D, vocab, ops = sc
    old = T._REBUILD_MIN_TOKENS, T._REBUILD_RATIO
    T._REBUILD_MIN_TOKENS, T._REBUILD_RATIO = 0, 0
    try:
        tree, orc = run_ops(D, ops + [("remove", i) for i in range(3)] + [("extend", i, [0, 1, 0]) for i in range(3)])
    finally:
        T._REBUILD_MIN_TOKENS, T._REBUILD_RATIO = old
    assert_same(tree, orc, vocab)
    assert tree._zombie_tokens == 0  # each removal that left referenced tokens rebuilt
    for sid in orc.seqs:
        assert tree.sequence(sid).tolist() == orc.seqs[sid][0]
        ctx = orc.seqs[sid][0]
        assert_draft(tree, orc, ctx, max_tokens=5, min_token_prob=0.0, max_spec_factor=2.0)


def test_interleaved_growth_moves_and_compacts_the_pool():
    """Many sequences growing a few tokens at a time (as live requests do), some removed."""
    rng = np.random.default_rng(5)
    D, vocab = 6, 7
    tree, orc = SuffixTree(D), Oracle(D)
    ids = [tree.add([], 1.0) for _ in range(12)]
    for sid in ids:
        orc.add(sid, [], 1.0)
    for step in range(60):
        for sid in list(orc.seqs):
            toks = rng.integers(0, vocab, int(rng.integers(1, 4))).tolist()
            tree.extend(sid, toks)
            orc.extend(sid, toks)
        if step % 10 == 9:
            sid = list(orc.seqs)[int(rng.integers(0, len(orc.seqs)))]
            tree.remove(sid)
            orc.remove(sid)
            nid = tree.add(rng.integers(0, vocab, 5), 2.0)
            orc.add(nid, tree.sequence(nid).tolist(), 2.0)
        if step == 30:
            tree._compact_pool()
            tree.check_invariants()
    tree.check_invariants()
    subs = list(orc.substrings())
    for i in rng.choice(len(subs), 200, replace=False):
        p = subs[i]
        assert tree.count(p) == orc.count(p) and tree.continuations(p) == orc.continuations(p)
    assert tree.num_strings == len(subs)
    for sid in orc.seqs:
        assert tree.sequence(sid).tolist() == orc.seqs[sid][0]
        assert_draft(tree, orc, orc.seqs[sid][0], max_tokens=8, min_token_prob=0.0, max_spec_factor=3.0)


def test_large_vocab_growth_and_hash_promotion_against_oracle():
    rng = np.random.default_rng(0)
    D, vocab = 4, 400
    tree, orc = SuffixTree(D), Oracle(D)
    ids = []
    for k in range(12):
        # a mix of a small hot alphabet (high fan-out, hashed nodes) and a large cold one
        toks = np.where(rng.random(300) < 0.5, rng.integers(0, 12, 300), rng.integers(0, vocab, 300))
        sid = tree.add(toks, weight=float(2 ** (k % 3)))
        orc.add(sid, toks.tolist(), float(2 ** (k % 3)))
        ids.append(sid)
    tree.check_invariants()
    for sid in ids[::2]:
        tree.remove(sid)
        orc.remove(sid)
    tree.check_invariants()
    sid = tree.add(rng.integers(0, 12, 500).astype(np.int32), 0.5)  # reuses freed rows
    orc.add(sid, tree.sequence(sid).tolist(), 0.5)
    subs = list(orc.substrings())
    for i in rng.choice(len(subs), 300, replace=False):
        p = subs[i]
        assert tree.count(p) == orc.count(p)
        assert tree.continuations(p) == orc.continuations(p)
    assert tree.num_strings == len(subs)
    for _ in range(50):
        s = orc.seqs[int(rng.choice(list(orc.seqs)))][0]
        j = int(rng.integers(1, len(s)))
        assert_draft(tree, orc, s[max(0, j - 6) : j], max_tokens=8, min_token_prob=0.0, max_spec_factor=3.0)
    tree.check_invariants()


def test_draft_reanchors_past_max_depth():
    tree = SuffixTree(max_depth=3)
    seq = list(range(1, 21))
    tree.add(seq)
    d = tree.draft([1, 2], max_tokens=15, max_spec_factor=10.0)
    assert d.tokens.tolist() == list(range(3, 18))  # far deeper than max_depth
    assert d.match_len == 2 and d.score == pytest.approx(15.0)
    d = tree.draft([1, 2], max_tokens=15)  # spec factor 1: at most match_len tokens
    assert d.tokens.tolist() == [3, 4]


def test_draft_basics_and_stops():
    tree = SuffixTree(8)
    assert tree.draft([1, 2], 4) == Draft(tree.draft([], 4).tokens, tree.draft([], 4).probs, 0.0, 0)
    tree.add([1, 2, 3, 4, 5], weight=3.0)
    tree.add([1, 2, 9, 9, 9], weight=1.0)
    d = tree.draft(np.array([7, 1, 2], np.int32), 5, min_token_prob=0.0)
    assert d.tokens.tolist() == [3, 4] and d.match_len == 2
    np.testing.assert_allclose(d.probs, [0.75, 0.75])
    assert tree.draft([1, 2], 5, min_token_prob=0.8).tokens.size == 0
    assert tree.draft([1, 2], 0).tokens.size == 0
    assert tree.draft([1, 2], 1).tokens.tolist() == [3]
    assert tree.draft([1, 2], 5, min_match=3).tokens.size == 0
    assert tree.draft([1, 2, VOCAB_LIMIT + 5], 5).tokens.size == 0  # out-of-range tokens match nothing
    assert tree.draft([-1], 5).tokens.size == 0


def test_ties_go_to_smallest_token():
    tree = SuffixTree(4)
    tree.add([5, 9])
    tree.add([5, 7])
    tree.add([5, 8])
    assert tree.best_continuation([5]) == 7
    assert tree.draft([5], 3, min_token_prob=0.0).tokens.tolist() == [7]
    tree.add([5, 9])
    assert tree.best_continuation([5]) == 9


def test_extend_equals_add():
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 5, 200)
    a, b = SuffixTree(5), SuffixTree(5)
    a.add(toks, 2.0)
    sid = b.add([], 2.0)
    for chunk in np.array_split(toks, 37):
        b.extend(sid, chunk)
    for p in [(), (1,), (1, 2), (0, 1, 2, 3, 4)]:
        assert a.count(p) == b.count(p) and a.continuations(p) == b.continuations(p)
    assert a.num_nodes == b.num_nodes
    np.testing.assert_array_equal(b.sequence(sid), toks.astype(np.int32))
    b.check_invariants()


def test_errors():
    with pytest.raises(ValueError, match="max_depth"):
        SuffixTree(0)
    t = SuffixTree(4)
    with pytest.raises(ValueError, match="weight"):
        t.add([1], weight=0.0)
    with pytest.raises(ValueError, match="weight"):
        t.add([1], weight=float("nan"))
    with pytest.raises(ValueError, match=str(VOCAB_LIMIT)):
        t.add([1, VOCAB_LIMIT])
    with pytest.raises(ValueError, match="-3"):
        t.add([1, -3])
    with pytest.raises(ValueError, match="integer"):
        t.add([1.5])
    with pytest.raises(ValueError, match="1-D"):
        t.add([[1, 2]])
    assert t.num_sequences == 0 and t.num_nodes == 0  # nothing stored by failed adds
    sid = t.add([1, 2])
    with pytest.raises(ValueError, match="99999999"):
        t.extend(sid, [3, 99999999])
    assert t.sequence(sid).tolist() == [1, 2] and t.num_strings == 3
    with pytest.raises(KeyError):
        t.extend(sid + 1, [1])
    with pytest.raises(KeyError):
        t.remove(sid + 1)
    with pytest.raises(ValueError, match="factor"):
        t.scale(0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        t.draft([1], -1)
    with pytest.raises(ValueError, match="min_token_prob"):
        t.draft([1], 2, min_token_prob=1.5)
    with pytest.raises(ValueError, match="min_match"):
        t.draft([1], 2, min_match=0)
    t.remove(sid)
    with pytest.raises(KeyError):
        t.remove(sid)


def test_scale_keeps_drafts_and_weights():
    t = SuffixTree(4)
    a = t.add([1, 2, 3], 2.0)
    before = t.draft([1, 2], 2)
    t.scale(1e-3)
    assert t.weight(a) == pytest.approx(2e-3)
    assert t.count([1, 2]) == pytest.approx(2e-3)
    after = t.draft([1, 2], 2)
    assert after.tokens.tolist() == before.tokens.tolist()
    t.extend(a, [1, 2, 4])  # extension uses the scaled weight
    assert t.count([1, 2]) == pytest.approx(4e-3)
    t.remove(a)
    assert t.num_nodes == 0 and t.count([]) == 0.0


def test_kernel_access_slots_buffer_and_listener():
    from das import trie_kernels as kernels

    t = SuffixTree(4)
    a = t.add([1, 2, 3], weight=2.0)
    b = t.add([4, 5])
    assert t.slot_and_weight(a) == (t.slot(a), 2.0) and t.slot(a) != t.slot(b)
    buf = t.buffer
    assert buf.dtype == np.int64 and buf.ndim == 1 and buf.flags.c_contiguous
    seen = []
    t.set_buffer_listener(seen.append)
    t.extend(b, np.arange(2000) % 7)  # outgrows the initial capacity: the trie moves
    assert seen and seen[-1] is t.buffer and t.buffer is not buf
    # the kernels draft from (buffer, slot) exactly what draft_seq returns
    out_t, out_p = np.empty(64, np.int32), np.empty(64, np.float32)
    off, k, score, mlen = kernels.draft_sequence(t.buffer, t.slot(b), 8, 0.0, 2.0, 1, 0.0, out_t, out_p)
    want = t.draft_seq(b, 8, 0.0, 2.0)
    assert out_t[off : off + k].tolist() == want.tokens.tolist() and score == want.score and k > 0
    t.set_buffer_listener(None)
    n = len(seen)
    t.extend(b, np.arange(4000) % 11)
    assert len(seen) == n
    t.remove(a)
    with pytest.raises(KeyError):
        t.slot(a)
    with pytest.raises(KeyError):
        t.slot_and_weight(a)


def test_views_by_address_are_the_buffer_views():
    """``views_at(address_of(buffer))``, how the kernels view a tree without reference counts, reads
    the same arrays as ``buffer_views`` (every view, every element, after growth moved the tree)."""
    from numba import njit

    from das import trie_kernels as kernels

    @njit
    def viewed(mem):
        meta, nodes, weights, hash_table, seqs, pool = kernels.views_at(kernels.address_of(mem))
        return meta.copy(), nodes.copy(), weights.copy(), hash_table.copy(), seqs.copy(), pool.copy()

    t = SuffixTree(6)
    t.add(np.arange(3000) % 13)
    t.add([5, 6, 7, 5, 6, 8])
    got, want = viewed(t.buffer), kernels.buffer_views(t.buffer)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):  # bit for bit: unused rows may hold any bits, NaNs among them
        assert g.dtype == w.dtype and np.array_equal(np.ascontiguousarray(g).view(np.uint8), np.ascontiguousarray(w).view(np.uint8))
    assert got[1].shape[0] > 0 and got[5].shape[0] > 3000


def test_borrow_is_a_view_of_the_same_memory():
    """``borrow(arr)`` (a view without a reference count, how ``mix`` drafts without atomic
    counts) reads and writes ``arr``'s own memory, with its shape and strides, C-contiguous or not."""
    from numba import njit

    from das.trie_kernels import borrow

    @njit
    def touch(a, b):
        v = borrow(a)
        w = borrow(b)
        v[1, 2] = 7.0
        w[1] = 5
        return v.shape[0], v.shape[1], v.strides[0], v.strides[1], w.shape[0], w.strides[0], v.sum() + w.sum()

    a = np.zeros((3, 4))
    base = np.zeros(10, np.int64)
    b = base[::2]  # not contiguous
    assert touch(a, b) == (3, 4, 32, 8, 5, 16, 12.0)
    assert a[1, 2] == 7.0 and base[2] == 5 and a.sum() == 7.0 and base.sum() == 5


def test_reserve_and_capacity_keep_a_growing_sequence_in_place():
    """``add(..., reserve=n)`` keeps room for the sequence to grow to ``n`` tokens without moving its
    pooled tokens, and ``SuffixTree(capacity=n)`` sizes the buffer so that the trie is not moved to a
    larger one while it grows to ``n`` tokens; counts are as without the hints."""
    from das import trie_kernels as kernels

    rng = np.random.default_rng(0)
    toks = rng.integers(0, 50, 300)
    hinted = SuffixTree(12, capacity=320)
    plain = SuffixTree(12)
    h = hinted.add(toks[:20], reserve=320)
    p = plain.add(toks[:20])
    buf = hinted._buffer
    base = int(hinted._seq_table[hinted.slot(h), kernels.S_BASE])
    moves = 0
    for i in range(20, 300, 7):
        hinted.extend(h, toks[i : i + 7])
        plain.extend(p, toks[i : i + 7])
        moves += hinted._buffer is not buf
        assert int(hinted._seq_table[hinted.slot(h), kernels.S_BASE]) == base
    assert moves == 0
    np.testing.assert_array_equal(hinted.sequence(h), plain.sequence(p))
    for ctx in ([int(toks[50])], toks[100:104].tolist(), toks[200:210].tolist()):
        assert hinted.continuations(ctx) == plain.continuations(ctx)
    hinted.check_invariants()
    with pytest.raises(ValueError, match=r"reserve must be an int >= 0 \(tokens\), got -1"):
        hinted.add([1], reserve=-1)
    with pytest.raises(ValueError, match=r"capacity must be an int >= 0 \(tokens\), got 2.5"):
        SuffixTree(12, capacity=2.5)


def test_rebuild_sizes_its_buffer_up_front_and_keeps_each_sequences_room(monkeypatch):
    """A rebuild moves the trie once: no growth on the way (each would copy the buffer), the
    same strings and counts after it, and a live rollout's reserved room is still there (its next
    tokens do not move its segment)."""
    rng = np.random.default_rng(3)
    tree = SuffixTree(5)
    ids = [tree.add(rng.integers(0, 40, 300), weight=1.0 + i % 3) for i in range(40)]
    live = tree.add(rng.integers(0, 40, 20), reserve=500)
    for sid in ids[:30]:
        tree.remove(sid)
    before = {sid: tree.sequence(sid).tolist() for sid in ids[30:] + [live]}
    nodes, toks = tree.num_nodes, tree.num_tokens
    moves = []
    real = SuffixTree._realloc
    monkeypatch.setattr(SuffixTree, "_realloc", lambda self, *a: (moves.append(a), real(self, *a)))
    tree._rebuild()
    assert moves == [] and tree._zombies == []
    assert {sid: tree.sequence(sid).tolist() for sid in before} == before
    assert (tree.num_nodes, tree.num_tokens) == (nodes, toks)
    slot = tree.slot(live)
    base = int(tree._seq_table[slot, kernels.S_BASE])
    assert int(tree._seq_table[slot, kernels.S_CAP]) >= 500
    tree.extend(live, rng.integers(0, 40, 400))
    assert int(tree._seq_table[tree.slot(live), kernels.S_BASE]) == base and moves == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([-(2**31), -2, -1, 0, 1, 7, VOCAB_LIMIT - 1, VOCAB_LIMIT, VOCAB_LIMIT + 3, 2**31 - 1]), max_size=12),
       st.sampled_from([np.int32, np.int64]))
def test_first_bad_token_is_the_first_index_outside_the_vocabulary_range(values, dtype):
    a = np.asarray(values, dtype=dtype)
    bad = np.flatnonzero((a < 0) | (a >= VOCAB_LIMIT))
    assert kernels.first_bad_token(a) == (int(bad[0]) if bad.size else -1)
