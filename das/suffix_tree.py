"""Depth-bounded suffix trie with weighted counts, for frequency-based draft proposals.

The trie stores every token string ``s`` with ``1 <= len(s) <= max_depth`` that occurs in a stored
sequence. ``count(s)`` is the *weighted* number of occurrences of ``s``: the sum over stored
sequences of ``weight(seq) * (number of positions where s ends in seq)``. (The empty string's count
is the weighted number of stored tokens.)

Drafting follows the most-weighted continuation; the conditional probability of token ``t`` after
``s`` is ``count(s + t) / sum_u count(s + u)``: occurrences of ``s`` that nothing follows (the end
of a sequence, above all a live request's own context, which always ends there) do not count
against the continuations. Ties between continuations of equal weighted count go to the smaller
token id. Only ratios of counts matter for drafting, which is what lets a caller down-weight old
sequences by inserting new ones with larger weights (see :class:`das.drafter.DASDrafter`).

Storage (see :mod:`das._trie_kernels`): a path-compressed trie (an edge holds a run of tokens,
read from the sequences' own token pool) in flat numpy arrays, no Python object per node; the hot
paths are numba kernels. Each sequence keeps its last ``max_depth`` suffixes' loci (arctic-
inference's active nodes), so appending a token costs ``O(max_depth)`` and drafting for a stored
sequence's own continuation (:meth:`SuffixTree.draft_seq`) needs no matching at all. About 1.5
nodes per stored token; 64 bytes (one cache line) per node, 4 per pooled token, and a hash table
for the children of high-fan-out nodes (16 bytes per slot, load <= 1/2), all in one int64
buffer. Removed sequences' tokens stay pooled while node labels point into them; the trie is
rebuilt from the stored sequences when those exceed the stored tokens. Capacity grows by
doubling; freed rows are reused; when no sequence is left the buffer goes back to its initial
capacity.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from das import _trie_kernels as kernels

__all__ = ["Draft", "SuffixTree", "VOCAB_LIMIT", "empty_draft"]

VOCAB_LIMIT = kernels.VOCAB_LIMIT

_INIT_NODES = 256
_INIT_SEQS = 4
_INIT_POOL = 256
_MIN_SEG = 16
_REBUILD_MIN_TOKENS = 4096  # rebuild when removed-but-referenced tokens exceed this and _REBUILD_RATIO x the stored ones
# A removed sequence whose tokens node labels still reference keeps only its pool segment (4 bytes a
# token, against ~180 bytes a stored token in node rows), so the rebuild that frees them may wait
# long: at 4x, 16 bytes a stored token at most, and a global tree (256 finished rollouts and 256 live, one removed
# per stop) rebuilds a quarter as often (a rebuild there: 28 ms, 40-80 us a stop at 1x, 2-core Zen 4).
_REBUILD_RATIO = 4
_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)
_INIT_HASH_MIN = 1024


class Draft(NamedTuple):
    """A proposed continuation.

    Attributes:
        tokens: ``np.int32[k]`` draft token ids (``k == 0``: no draft).
        probs: ``np.float32[k]`` path probabilities: ``probs[i]`` is the estimated probability
            that the first ``i + 1`` draft tokens are all accepted (non-increasing).
        score: ``float``, ``sum(probs)``: the expected number of accepted draft tokens.
        match_len: ``int``, length of the context suffix the draft was anchored on (0 when empty).
    """

    tokens: np.ndarray
    probs: np.ndarray
    score: float
    match_len: int


_new_tuple = tuple.__new__  # Draft(...) without NamedTuple's Python-level __new__ (hot path)
_EMPTY_TOKENS = np.empty(0, np.int32)
_EMPTY_TOKENS.flags.writeable = False
_EMPTY_PROBS = np.empty(0, np.float32)
_EMPTY_PROBS.flags.writeable = False
_EMPTY_DRAFT = Draft(_EMPTY_TOKENS, _EMPTY_PROBS, 0.0, 0)


def empty_draft() -> Draft:
    """The empty draft (shared read-only arrays, score 0.0, match_len 0)."""
    return _EMPTY_DRAFT


def as_tokens(tokens, name: str = "tokens") -> np.ndarray:
    """``tokens`` as a C-contiguous 1-D ``int32`` or ``int64`` array (no copy when it already is).

    Range is not checked here (the kernels check ``0 <= token < VOCAB_LIMIT``).

    Raises:
        ValueError: not 1-D, or not integers.
    """
    if type(tokens) is np.ndarray:
        a = tokens
    else:
        a = np.asarray(tokens)
        if a.size == 0:
            a = a.astype(np.int64)
    dt = a.dtype
    if dt is not _I64 and dt is not _I32 and dt != _I64 and dt != _I32:
        if dt.kind not in "iu":
            raise ValueError(f"{name} must be integer token ids, got dtype {dt}")
        if dt.kind == "u" and a.size and int(a.max()) >= VOCAB_LIMIT:
            bad = int(a[np.argmax(a >= VOCAB_LIMIT)])
            raise ValueError(f"token {bad} in {name} is out of range [0, {VOCAB_LIMIT})")
        a = a.astype(np.int64)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    return a



class SuffixTree:
    """Depth-bounded suffix trie over weighted token sequences (see the module docstring).

    Args:
        max_depth: longest stored string (tokens); drafts match at most ``max_depth - 1`` context
            tokens but may run longer than ``max_depth`` (they re-anchor). Default 24, as
            arctic-inference / vLLM's ``suffix`` method.
        capacity: tokens the trie is expected to hold (a sizing hint, default 0): node rows and
            pool are allocated for that many up front, so that a tree growing token by token (a
            live request's) is not moved to a larger buffer every few steps. It grows past it as
            needed.

    Raises:
        ValueError: ``max_depth < 1`` or not an int; ``capacity`` negative or not an int.
    """

    __slots__ = ("rebuilds", "_max_depth", "_buffer", "_nodes", "_weights", "_hash_table", "_meta", "_seq_table", "_pool", "_seqs",
                 "_slots", "_free_slots", "_next_id", "_draft_buf", "_pool_top", "_pool_garbage", "_zombies", "_zombie_tokens",
                 "_buffer_listener", "_capacity")

    def __init__(self, max_depth: int = 24, capacity: int = 0):
        if isinstance(max_depth, bool) or not isinstance(max_depth, (int, np.integer)) or max_depth < 1:
            raise ValueError(f"max_depth must be an int >= 1, got {max_depth!r}")
        if max_depth > 10_000:
            raise ValueError(f"max_depth must be <= 10000, got {max_depth!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0 (tokens), got {capacity!r}")
        self._max_depth = int(max_depth)
        self._capacity = int(capacity)
        self._buffer_listener = None  # called with the new buffer whenever the trie moves to one (see _set_buffer)
        self.rebuilds = 0  # rebuilds so far (each moves the sequences' slots: read slot() again after one)
        self._next_id = 0
        self._draft_buf = (np.empty(0, np.int32), np.empty(0, np.float32))
        self._seqs: dict[int, list] = {}  # seq id -> [slot, weight]
        self._reset()

    # ------------------------------------------------------------------ storage
    def _initial_caps(self) -> tuple[int, int, int, int]:
        """Node rows, hash slots, sequence slots and pool tokens of an empty trie."""
        D = self._max_depth
        ncap = max(_INIT_NODES, 4 * D, 2 * self._capacity)  # a stored token adds at most 2 nodes (a leaf and a split)
        hcap = _pow2(max(_INIT_HASH_MIN, 4 * kernels.hash_headroom(D)))
        return ncap, hcap, _INIT_SEQS, max(_INIT_POOL, self._capacity)

    def _reset(self, caps: tuple[int, int, int, int] | None = None) -> None:
        """Start empty, in a buffer of ``caps`` (node rows, hash slots, sequence slots, pool
        tokens; default :meth:`_initial_caps`)."""
        D = self._max_depth
        ncap, hcap, scap, pcap = caps or self._initial_caps()
        meta, words = kernels.buffer_layout(D, ncap, hcap, scap, pcap)
        self._buffer = np.empty(words, np.int64)
        self._buffer[: kernels.M_LEN] = meta
        self._set_buffer()
        meta = self._meta
        meta[kernels.M_HIGH_WATER] = 1
        meta[kernels.M_FREE_HEAD] = -1
        meta[kernels.M_LIVE_NODES] = 1
        self._hash_table.fill(-1)
        self._seq_table.fill(0)
        root = self._nodes[0]
        root[: kernels.C_FILTER + 1] = -1
        self._weights[0] = 0.0
        root[kernels.C_DEPTH] = 0
        root[kernels.C_COUNT] = 0
        root[kernels.C_NCHILD] = 0
        root[kernels.C_FILTER] = kernels.HASHED  # the root's children are hashed from the start
        root[kernels.C_SEQ] = 0
        root[kernels.C_IDX] = 0
        self._slots: dict[int, int] = {}  # slot -> seq id (stored sequences)
        self._free_slots = list(range(scap - 1, -1, -1))
        self._pool_top = 0
        self._pool_garbage = 0
        self._zombies: list[int] = []  # slots of removed sequences whose tokens stay pooled
        self._zombie_tokens = 0

    def _set_buffer(self) -> None:
        """Point the array views at ``self._buffer``; called whenever the trie moves to a new buffer
        (``_reset``, ``_realloc``), which is also when the buffer listener (if set, see
        :meth:`set_buffer_listener`) hears of it."""
        views = kernels.buffer_views(self._buffer)
        self._meta, self._nodes, self._weights, self._hash_table, self._seq_table, self._pool = views
        if self._buffer_listener is not None:
            self._buffer_listener(self._buffer)

    def _realloc(self, ncap: int, hcap: int, scap: int, pcap: int) -> None:
        """Move the trie into a buffer with these capacities (never smaller than the used parts)."""
        old_meta, nodes, weights, hash_table, seq_table, pool = (self._meta, self._nodes, self._weights, self._hash_table,
                                                                 self._seq_table, self._pool)
        meta, words = kernels.buffer_layout(self._max_depth, ncap, hcap, scap, pcap)
        for k in (kernels.M_HIGH_WATER, kernels.M_FREE_HEAD, kernels.M_NUM_FREE, kernels.M_LIVE_NODES, kernels.M_HASH_ENTRIES,
                  kernels.M_NUM_TOKENS):
            meta[k] = old_meta[k]
        mem = np.empty(words, np.int64)
        mem[: kernels.M_LEN] = meta
        self._buffer = mem
        self._set_buffer()
        hwm = int(meta[kernels.M_HIGH_WATER])
        # node rows >= HWM are never read before they are allocated: no fill needed
        self._nodes[:hwm] = nodes[:hwm]
        self._weights[:hwm] = weights[:hwm]
        self._seq_table[: seq_table.shape[0]] = seq_table
        self._seq_table[seq_table.shape[0] :] = 0
        self._pool[: self._pool_top] = pool[: self._pool_top]
        if hcap == hash_table.shape[0]:
            self._hash_table[:] = hash_table
        else:
            self._hash_table.fill(-1)
            n = kernels.fill_hash_table(mem)
            assert n == meta[kernels.M_HASH_ENTRIES], (n, meta[kernels.M_HASH_ENTRIES])

    def _grow(self) -> None:
        """Grow the node and/or hash capacity until one more token surely fits."""
        meta = self._meta
        D = self._max_depth
        cap = int(meta[kernels.M_NODE_CAP])
        newcap = cap
        while newcap - meta[kernels.M_HIGH_WATER] + meta[kernels.M_NUM_FREE] < kernels.node_headroom(D):
            newcap *= 2
        hcap = int(meta[kernels.M_HASH_CAP])
        newh = hcap
        while meta[kernels.M_HASH_ENTRIES] + kernels.hash_headroom(D) > newh // 2:
            newh *= 2
        if newcap != cap or newh != hcap:
            self._realloc(newcap, newh, int(meta[kernels.M_SEQ_CAP]), int(meta[kernels.M_POOL_CAP]))

    def _new_slot(self) -> int:
        if not self._free_slots:
            m = self._meta
            n = int(m[kernels.M_SEQ_CAP])
            self._realloc(int(m[kernels.M_NODE_CAP]), int(m[kernels.M_HASH_CAP]), 2 * n, int(m[kernels.M_POOL_CAP]))
            self._free_slots = list(range(2 * n - 1, n - 1, -1))
        slot = self._free_slots.pop()
        row = self._seq_table[slot]
        row[:] = 0
        row[kernels.S_BASE] = self._pool_top
        row[kernels.S_STATE] = 1
        return slot

    def _reserve(self, slot: int, n: int) -> None:
        """Make room for ``n`` more tokens in ``slot``'s pool segment (moves it to the pool's end)."""
        seq_table = self._seq_table
        length = int(seq_table[slot, kernels.S_LEN])
        cap = int(seq_table[slot, kernels.S_CAP])
        if length + n <= cap:
            return
        newcap = max(_MIN_SEG, 2 * cap, length + n)
        if self._pool_top + newcap > self._pool.shape[0]:
            if 3 * self._pool_garbage > self._pool_top:  # a third or more is garbage: compact before growing
                self._compact_pool()
            size = self._pool.shape[0]
            while self._pool_top + newcap > size:
                size *= 2
            if size != self._pool.shape[0]:
                m = self._meta
                self._realloc(int(m[kernels.M_NODE_CAP]), int(m[kernels.M_HASH_CAP]), int(m[kernels.M_SEQ_CAP]), size)
                seq_table = self._seq_table
        base = int(seq_table[slot, kernels.S_BASE])
        self._pool[self._pool_top : self._pool_top + length] = self._pool[base : base + length]
        seq_table[slot, kernels.S_BASE] = self._pool_top
        seq_table[slot, kernels.S_CAP] = newcap
        self._pool_garbage += cap
        self._pool_top += newcap

    def _compact_pool(self) -> None:
        """Slide every stored and removed-but-referenced segment down over the garbage."""
        seq_table = self._seq_table
        used = sorted((int(seq_table[s, kernels.S_BASE]), s) for s in list(self._slots) + self._zombies)
        pool = self._pool
        top = 0
        for base, s in used:
            cap = int(seq_table[s, kernels.S_CAP]) if seq_table[s, kernels.S_STATE] == 1 else int(seq_table[s, kernels.S_LEN])
            length = int(seq_table[s, kernels.S_LEN])
            if base != top:
                pool[top : top + length] = pool[base : base + length]  # top < base: safe overlap
            seq_table[s, kernels.S_BASE] = top
            seq_table[s, kernels.S_CAP] = cap
            top += cap
        self._pool_top = top
        self._pool_garbage = 0

    def _insert(self, slot: int, arr: np.ndarray, weight: float) -> None:
        n = arr.shape[0]
        r = kernels.append_tokens(self._buffer, slot, arr, weight)
        if r < 0:
            i = -r - 1
            raise ValueError(f"token {int(arr[i])} at index {i} is out of range [0, {VOCAB_LIMIT})")
        if r < n:
            self._finish_insert(slot, arr[r:], weight)

    def _finish_insert(self, slot: int, arr: np.ndarray, weight: float) -> None:
        """Grow what ran out and insert the rest of ``arr`` (whose tokens are in range)."""
        pos = 0
        n = arr.shape[0]
        while pos < n:
            self._reserve(slot, n - pos)
            self._grow()
            pos += kernels.append_tokens(self._buffer, slot, arr[pos:], weight)

    def _rebuild(self) -> None:
        """Rebuild the trie from the stored sequences (drops the removed ones' pooled tokens), in
        a buffer sized for them up front (each growth on the way would copy it: a global tree of
        256 rollouts rebuilt in 7.0-8.0 ms instead of 11.1-11.9, 2-core Zen 4) and with each
        sequence's room kept (a live rollout's reserve)."""
        seq_table = self._seq_table
        items = [(sid, self.sequence(sid), w, int(seq_table[slot, kernels.S_CAP])) for sid, (slot, w) in sorted(self._seqs.items())]
        m = self._meta
        D = self._max_depth
        init = self._initial_caps()
        old = (int(m[kernels.M_NODE_CAP]), int(m[kernels.M_HASH_CAP]))
        # the same strings, so the same nodes and hashed children; room for them twice over, at most the old capacities
        ncap = max(init[0], min(old[0], _pow2(2 * (int(m[kernels.M_LIVE_NODES]) + kernels.node_headroom(D)))))
        hcap = max(init[1], min(old[1], _pow2(4 * (int(m[kernels.M_HASH_ENTRIES]) + kernels.hash_headroom(D)))))
        # the old sequence slots and pool: they held the removed ones too, so the next adds fit
        self.rebuilds += 1
        self._reset((ncap, hcap, int(m[kernels.M_SEQ_CAP]), int(m[kernels.M_POOL_CAP])))
        self._seqs = {}
        for sid, toks, w, cap in items:
            slot = self._new_slot()
            self._slots[slot] = sid
            self._seqs[sid] = [slot, w]
            self._reserve(slot, max(cap, toks.shape[0]))
            if toks.shape[0]:
                self._insert(slot, toks, w)

    # ------------------------------------------------------------------ updates
    def add(self, tokens=(), weight: float = 1.0, reserve: int = 0) -> int:
        """Store a new sequence.

        Args:
            tokens: 1-D integer array-like of token ids in ``[0, 2**20)``; may be empty (then
                :meth:`extend` it later).
            weight: positive finite float; each occurrence in this sequence counts ``weight``.
            reserve: tokens of room to keep for the sequence in the pool (a sizing hint for one
                that :meth:`extend` will grow, e.g. a live rollout): its tokens are not moved until
                it outgrows ``max(reserve, len(tokens))``. Default 0 (room grows by doubling).

        Returns:
            The new sequence id (int, never reused by this tree).

        Raises:
            ValueError: bad weight, tokens not a 1-D integer array, a token out of range, or a
                negative ``reserve`` (the message names it; nothing is stored then).
        """
        w = _check_weight(weight)
        arr = as_tokens(tokens)
        if arr.shape[0]:
            _check_range(arr)
        if isinstance(reserve, bool) or not isinstance(reserve, (int, np.integer)) or reserve < 0:
            raise ValueError(f"reserve must be an int >= 0 (tokens), got {reserve!r}")
        slot = self._new_slot()
        if reserve > arr.shape[0]:
            self._reserve(slot, int(reserve))
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = [slot, w]
        self._slots[slot] = sid
        if arr.shape[0]:
            self._insert(slot, arr, w)
        return sid

    def extend(self, seq_id: int, tokens) -> None:
        """Append ``tokens`` (1-D integer array-like, may be empty) to sequence ``seq_id``.

        Raises:
            KeyError: unknown (or removed) ``seq_id``.
            ValueError: tokens not a 1-D integer array, or a token out of ``[0, 2**20)`` (then
                nothing is appended).
        """
        s = self._seqs.get(seq_id)
        if s is None:
            raise KeyError(f"unknown sequence id {seq_id!r}")
        if type(tokens) is np.ndarray and tokens.ndim == 1 and (tokens.dtype is _I32 or tokens.dtype is _I64) \
                and tokens.flags.c_contiguous:
            arr = tokens
        else:
            arr = as_tokens(tokens)
        n = arr.shape[0]
        if n:
            r = kernels.append_tokens(self._buffer, s[0], arr, s[1])
            if r != n:
                if r < 0:
                    raise ValueError(f"token {int(arr[-r - 1])} at index {-r - 1} is out of range [0, {VOCAB_LIMIT})")
                self._finish_insert(s[0], arr[r:], s[1])

    def remove(self, seq_id: int) -> None:
        """Remove sequence ``seq_id``: subtract its counts, free the nodes no sequence uses.

        Freed rows are reused by later inserts; when no sequence is left the arrays go back to
        the initial capacity. Cost: ``O(len * max_depth)``, plus now and then a rebuild from the
        stored sequences (when the removed sequences' still-referenced tokens outnumber them
        :data:`_REBUILD_RATIO` to 1).

        Raises:
            KeyError: unknown (or already removed) ``seq_id``.
        """
        s = self._seqs.pop(seq_id, None)
        if s is None:
            raise KeyError(f"unknown sequence id {seq_id!r}")
        slot, w = s
        del self._slots[slot]
        if not self._seqs:
            self._reset()
            return
        n = int(self._seq_table[slot, kernels.S_LEN])
        if n:
            ok = kernels.remove_sequence(self._buffer, slot, w)
            assert ok, "suffix tree corrupted: a stored suffix was not found"
        if self._meta[kernels.M_LIVE_NODES] == 1:  # no node references any pooled token of a removed sequence
            self._seq_table[slot, kernels.S_STATE] = 0
            self._pool_garbage += int(self._seq_table[slot, kernels.S_CAP])
            self._free_slots.append(slot)
            for z in self._zombies:
                self._seq_table[z, kernels.S_STATE] = 0
                self._pool_garbage += int(self._seq_table[z, kernels.S_LEN])
                self._free_slots.append(z)
            self._zombies = []
            self._zombie_tokens = 0
            return
        self._seq_table[slot, kernels.S_STATE] = 2
        self._zombies.append(slot)
        self._zombie_tokens += n
        self._pool_garbage += int(self._seq_table[slot, kernels.S_CAP]) - n
        if self._zombie_tokens > max(_REBUILD_RATIO * self.num_tokens, _REBUILD_MIN_TOKENS):
            self._rebuild()

    def scale(self, factor: float) -> None:
        """Multiply every weighted count (and every sequence's weight) by ``factor``.

        Drafts are unchanged (they use ratios of counts); used to keep growing weights in range.

        Raises:
            ValueError: ``factor`` not a positive finite number.
        """
        f = float(factor)
        if not (f > 0.0 and math.isfinite(f)):
            raise ValueError(f"scale factor must be a positive finite number, got {factor!r}")
        hwm = int(self._meta[kernels.M_HIGH_WATER])
        self._weights[:hwm] *= f
        for s in self._seqs.values():
            s[1] *= f

    # ------------------------------------------------------------------ queries
    def draft(
        self,
        context,
        max_tokens: int,
        min_token_prob: float = 0.1,
        max_spec_factor: float = 1.0,
        min_match: int = 1,
        prior: float = 0.0,
    ) -> Draft:
        """Propose up to ``max_tokens`` tokens that follow ``context``.

        For each suffix of the context's last ``max_depth - 1`` tokens that is in the trie and
        has length ``match_len >= min_match`` (longest first), walk from it to the most-weighted
        continuation (ties: smaller token) repeatedly; token probability =
        ``count(s + t) / (sum_u count(s + u) + prior)``, path probability = running product. A
        walk stops before a token whose path probability would fall below ``min_token_prob``, at
        ``max_tokens`` tokens, at ``floor(match_len * max_spec_factor)`` tokens, or where nothing
        follows. A walk that reaches depth ``max_depth`` re-anchors on the last
        ``max_depth - 1`` tokens of context + draft and goes on, so drafts may be longer than
        ``max_depth``. The draft with the largest score (sum of path probabilities) wins; ties go
        to the longer match. One numba call; ``O(m**2)`` token comparisons for an ``m``-token
        match (:meth:`draft_seq` needs none).

        Args:
            context: 1-D integer array-like (prompt + output so far); only its tail is read.
                Tokens outside ``[0, 2**20)`` simply match nothing.
            max_tokens: int >= 0, draft length cap.
            min_token_prob: float in ``[0, 1]``.
            max_spec_factor: float >= 0.
            min_match: int >= 1, shortest context suffix to anchor on.
            prior: float >= 0, added to every probability's denominator (in units of weighted
                count): shrinks the probabilities of rarely seen continuations.

        Returns:
            :class:`Draft`; empty (score 0.0, match_len 0) when nothing matches.

        Raises:
            ValueError: an argument out of range, or context not 1-D integers.
        """
        max_tokens, min_token_prob, max_spec_factor, min_match, prior = _check_draft_args(
            max_tokens, min_token_prob, max_spec_factor, min_match, prior
        )
        if type(context) is not np.ndarray or context.ndim != 1 or not (context.dtype is _I32 or context.dtype is _I64):
            w = self._max_depth - 1
            context = as_tokens(context[-w:] if w else (), "context")
        return self._draft(context, max_tokens, min_token_prob, max_spec_factor, min_match, prior)

    def _draft(self, context: np.ndarray, max_tokens: int, min_prob: float, factor: float, min_match: int = 1,
               prior: float = 0.0) -> Draft:
        """:meth:`draft` without argument checks: ``context`` is a 1-D int32/int64 ndarray."""
        if max_tokens == 0:
            return _EMPTY_DRAFT
        n = context.shape[0]
        if n >= self._max_depth:
            context = context[n - self._max_depth + 1 :]
        if not context.flags.c_contiguous:
            context = np.ascontiguousarray(context)
        buf = self._scratch(max_tokens)
        off, k, score, mlen = kernels.draft_context(self._buffer, context, max_tokens, min_prob, factor, min_match, prior, buf[0],
                                                    buf[1])
        if k == 0:
            return _EMPTY_DRAFT
        return _new_tuple(Draft, (buf[0][off : off + k].copy(), buf[1][off : off + k].copy(), score, mlen))

    def draft_seq(
        self,
        seq_id: int,
        max_tokens: int,
        min_token_prob: float = 0.1,
        max_spec_factor: float = 1.0,
        min_match: int = 1,
        prior: float = 0.0,
    ) -> Draft:
        """:meth:`draft` with ``context`` = the tokens of stored sequence ``seq_id``, anchored on
        the sequence's own suffix loci: no matching, so cheaper than :meth:`draft`; the same draft.

        Raises:
            KeyError: unknown sequence.
            ValueError: an argument out of range.
        """
        s = self._seqs.get(seq_id)
        if s is None:
            raise KeyError(f"unknown sequence id {seq_id!r}")
        max_tokens, min_token_prob, max_spec_factor, min_match, prior = _check_draft_args(
            max_tokens, min_token_prob, max_spec_factor, min_match, prior
        )
        return self._draft_slot(s[0], max_tokens, min_token_prob, max_spec_factor, min_match, prior)

    def _draft_slot(self, slot: int, max_tokens: int, min_prob: float, factor: float, min_match: int = 1,
                    prior: float = 0.0) -> Draft:
        if max_tokens == 0:
            return _EMPTY_DRAFT
        buf = self._draft_buf
        if buf[0].shape[0] < 4 * max_tokens:
            buf = self._scratch(max_tokens)
        off, k, score, mlen = kernels.draft_sequence(self._buffer, slot, max_tokens, min_prob, factor, min_match, prior, buf[0],
                                                     buf[1])
        if k == 0:
            return _EMPTY_DRAFT
        return _new_tuple(Draft, (buf[0][off : off + k].copy(), buf[1][off : off + k].copy(), score, mlen))

    def _scratch(self, max_tokens: int):
        buf = self._draft_buf
        if buf[0].shape[0] < 4 * max_tokens:
            m = max(4 * max_tokens, 64)
            buf = self._draft_buf = (np.empty(m, np.int32), np.empty(m, np.float32))
        return buf

    def _locus(self, pattern):
        return kernels.find_locus(self._buffer, as_tokens(pattern, "pattern"))

    def count(self, pattern) -> float:
        """Weighted occurrence count of the token string ``pattern`` (1-D integer array-like).

        ``count([])`` is the weighted number of stored tokens. Returns 0.0 for absent strings and
        for strings longer than ``max_depth`` (not stored).
        """
        u, _ = self._locus(pattern)
        return float(self._weights[u, 0]) if u >= 0 else 0.0

    def raw_count(self, pattern) -> int:
        """Unweighted occurrence count of ``pattern`` (0 if absent or longer than ``max_depth``)."""
        u, _ = self._locus(pattern)
        return int(self._nodes[u, kernels.C_COUNT]) if u >= 0 else 0

    def continuations(self, pattern) -> dict[int, float]:
        """``{token: count(pattern + [token])}`` for every token that follows ``pattern``.

        Empty when ``pattern`` is absent or has length ``>= max_depth``.
        """
        u, d = self._locus(pattern)
        if u < 0 or d >= self._max_depth:
            return {}
        toks, ws = kernels.locus_continuations(self._buffer, u, d)
        return {int(t): float(x) for t, x in zip(toks, ws)}

    def best_continuation(self, pattern) -> int | None:
        """The most-weighted next token after ``pattern`` (ties: smallest), or None."""
        c = self.continuations(pattern)
        return min(c, key=lambda t: (-c[t], t)) if c else None

    def sequence(self, seq_id: int) -> np.ndarray:
        """Copy of the tokens (``np.int32[n]``) of sequence ``seq_id``. Raises KeyError if unknown."""
        s = self._seqs.get(seq_id)
        if s is None:
            raise KeyError(f"unknown sequence id {seq_id!r}")
        base, n = int(self._seq_table[s[0], kernels.S_BASE]), int(self._seq_table[s[0], kernels.S_LEN])
        return self._pool[base : base + n].copy()

    def seq_len(self, seq_id: int) -> int:
        """Number of tokens of sequence ``seq_id``. Raises KeyError if unknown."""
        s = self._seqs.get(seq_id)
        if s is None:
            raise KeyError(f"unknown sequence id {seq_id!r}")
        return int(self._seq_table[s[0], kernels.S_LEN])

    def weight(self, seq_id: int) -> float:
        """Current weight of sequence ``seq_id`` (after any :meth:`scale`). Raises KeyError if unknown."""
        s = self._seqs.get(seq_id)
        if s is None:
            raise KeyError(f"unknown sequence id {seq_id!r}")
        return s[1]

    # ------------------------------------------------------------------ kernel access
    @property
    def buffer(self) -> np.ndarray:
        """The trie's storage: one C-contiguous ``np.int64`` array holding the nodes, their weighted
        counts, the hash table, the sequence table and the token pool (layout: :mod:`das._trie_kernels`,
        whose kernels take it as ``mem``; a sequence is named there by its :meth:`slot`).

        The tree moves to a new array whenever it grows, is rebuilt or is emptied, and the old one
        is then stale: read this again after any change, or register :meth:`set_buffer_listener`.
        Change it only through those kernels.
        """
        return self._buffer

    def set_buffer_listener(self, listener: Callable[[np.ndarray], object] | None) -> None:
        """Have ``listener(buffer)`` called with the new :attr:`buffer` every time the trie moves
        to one (growth, rebuild, reset), before the call that moved it returns; ``None`` removes the
        listener. A tree has at most one (a new one replaces the old). An owner that keeps the
        buffer for batch kernels (:class:`das.drafter.DASDrafter`'s tree table) never holds a
        stale one this way. Not called now: read :attr:`buffer` for the current one.
        """
        self._buffer_listener = listener

    def slot(self, seq_id: int) -> int:
        """Row (``int >= 0``) of sequence ``seq_id`` in the trie's sequence table: the ``s`` that
        the kernels of :mod:`das._trie_kernels` take for it. A :meth:`remove` may rebuild the trie,
        which moves the other sequences to new rows: read it again after a removal.

        Raises:
            KeyError: unknown (or removed) ``seq_id``.
        """
        s = self._seqs.get(seq_id)
        if s is None:
            raise KeyError(f"unknown sequence id {seq_id!r}")
        return s[0]

    def slot_and_weight(self, seq_id: int) -> tuple[int, float]:
        """``(slot(seq_id), weight(seq_id))`` in one lookup: the sequence's row in the sequence
        table (``int``) and its current weight (``float > 0``, the weight the kernels append its
        tokens with).

        Raises:
            KeyError: unknown (or removed) ``seq_id``.
        """
        s = self._seqs.get(seq_id)
        if s is None:
            raise KeyError(f"unknown sequence id {seq_id!r}")
        return s[0], s[1]

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def max_depth(self) -> int:
        """Longest stored string, in tokens."""
        return self._max_depth

    @property
    def num_nodes(self) -> int:
        """Live nodes, the root excluded (a node ends an edge, which may hold several tokens)."""
        return int(self._meta[kernels.M_LIVE_NODES]) - 1

    @property
    def num_strings(self) -> int:
        """Distinct stored strings (lengths 1..max_depth): the tokens on all edges. Slow (scans)."""
        nodes = self._nodes
        hwm = int(self._meta[kernels.M_HIGH_WATER])
        live = nodes[1:hwm, kernels.C_PARENT] != -1
        par = nodes[1:hwm, kernels.C_PARENT][live]
        return int((nodes[1:hwm, kernels.C_DEPTH][live] - nodes[par, kernels.C_DEPTH]).sum())

    @property
    def num_tokens(self) -> int:
        """Tokens stored over all sequences."""
        return int(self._meta[kernels.M_NUM_TOKENS])

    @property
    def num_sequences(self) -> int:
        """Stored sequences (empty ones included)."""
        return len(self._seqs)

    @property
    def nbytes(self) -> int:
        """Bytes held by the trie's buffer (nodes, counts, hash table, sequences, pool) and scratch."""
        return self._buffer.nbytes + sum(b.nbytes for b in self._draft_buf)

    def check_invariants(self) -> None:
        """Slow consistency check of the arrays (for tests); raises AssertionError on corruption."""
        nodes, weights, meta, D = self._nodes, self._weights, self._meta, self._max_depth
        seq_table, pool = self._seq_table, self._pool
        hwm = int(meta[kernels.M_HIGH_WATER])
        live = [0] + [i for i in range(1, hwm) if nodes[i, kernels.C_PARENT] != -1]
        assert len(live) == meta[kernels.M_LIVE_NODES], (len(live), meta[kernels.M_LIVE_NODES])
        free = set()
        f = int(meta[kernels.M_FREE_HEAD])
        while f != -1:
            assert f not in free
            free.add(f)
            f = int(nodes[f, kernels.C_NEXT])
        assert len(free) == meta[kernels.M_NUM_FREE] and len(free) + len(live) == hwm
        for slot, sid in self._slots.items():
            assert self._seqs[sid][0] == slot and seq_table[slot, kernels.S_STATE] == 1
        for z in self._zombies:
            assert seq_table[z, kernels.S_STATE] == 2
        assert self._zombie_tokens == sum(int(seq_table[z, kernels.S_LEN]) for z in self._zombies)
        assert self.num_tokens == sum(int(seq_table[s, kernels.S_LEN]) for s in self._slots)
        # segments lie inside the pool and do not overlap
        segs = sorted((int(seq_table[s, kernels.S_BASE]),
                       int(seq_table[s, kernels.S_CAP] if seq_table[s, kernels.S_STATE] == 1 else seq_table[s, kernels.S_LEN]))
                      for s in list(self._slots) + self._zombies)
        top = 0
        for base, cap in segs:
            assert base >= top and base + cap <= self._pool_top <= pool.shape[0]
            top = base + cap

        def label(u):
            p = int(nodes[u, kernels.C_PARENT])
            s, e = int(nodes[u, kernels.C_SEQ]), int(nodes[u, kernels.C_IDX])
            n = int(nodes[u, kernels.C_DEPTH] - nodes[p, kernels.C_DEPTH])
            i = e - n
            assert seq_table[s, kernels.S_STATE] in (1, 2) and 0 <= i and i + n <= seq_table[s, kernels.S_LEN], (u, s, i, n)
            b = int(seq_table[s, kernels.S_BASE])
            return tuple(int(x) for x in pool[b + i : b + i + n])

        strings = {0: ()}
        order = sorted(live[1:], key=lambda u: nodes[u, kernels.C_DEPTH])
        for u in order:
            p = int(nodes[u, kernels.C_PARENT])
            lab = label(u)
            assert len(lab) >= 1 and lab[0] == nodes[u, kernels.C_TOKEN]
            strings[u] = strings[p] + lab
            assert len(strings[u]) == nodes[u, kernels.C_DEPTH] <= D
        hent = 0
        for u in live:
            kids = []
            c = int(nodes[u, kernels.C_FIRST])
            prev = -1
            while c != -1:
                assert nodes[c, kernels.C_PARENT] == u and nodes[c, kernels.C_PREV] == prev
                assert nodes[c, kernels.C_DEPTH] > nodes[u, kernels.C_DEPTH]
                kids.append(c)
                prev, c = c, int(nodes[c, kernels.C_NEXT])
            assert len(kids) == nodes[u, kernels.C_NCHILD]
            assert len({int(nodes[c, kernels.C_TOKEN]) for c in kids}) == len(kids)
            assert nodes[u, kernels.C_COUNT] >= sum(int(nodes[c, kernels.C_COUNT]) for c in kids)
            wsum = sum(float(weights[c, 0]) for c in kids)
            assert abs(weights[u, 1] - wsum) <= 1e-9 * max(1.0, abs(wsum)), (u, weights[u, 1], wsum)
            if u != 0:
                assert nodes[u, kernels.C_COUNT] > 0
                if nodes[u, kernels.C_COUNT] == 1:
                    assert len(kids) <= 1
                best = -1
                for c in kids:
                    if best < 0 or (weights[c, 0], -nodes[c, kernels.C_TOKEN]) > (weights[best, 0], -nodes[best, kernels.C_TOKEN]):
                        best = c
                assert nodes[u, kernels.C_BEST] == best, (u, nodes[u, kernels.C_BEST], best)
            if nodes[u, kernels.C_FILTER] != kernels.HASHED:
                bits = 0
                for c in kids:
                    bits |= int(kernels.filter_bit(int(nodes[c, kernels.C_TOKEN])))
                assert nodes[u, kernels.C_FILTER] == bits, (u, nodes[u, kernels.C_FILTER], bits)
            else:
                for c in kids:
                    key = (u << kernels.TOKEN_BITS) | int(nodes[c, kernels.C_TOKEN])
                    assert kernels.hash_lookup(self._hash_table, meta[kernels.M_HASH_SHIFT], np.int64(key)) == c
                hent += len(kids)
        assert hent == meta[kernels.M_HASH_ENTRIES], (hent, meta[kernels.M_HASH_ENTRIES])
        assert int((self._hash_table[:, 0] != -1).sum()) == hent
        # every stored sequence's active loci end exactly at its suffixes
        for slot in self._slots:
            n = int(seq_table[slot, kernels.S_LEN])
            b = int(seq_table[slot, kernels.S_BASE])
            toks = tuple(int(x) for x in pool[b : b + n])
            for d in range(0, min(n, D) + 1):
                u = int(seq_table[slot, kernels.S_LOCI + d])
                assert u in strings and strings[u] == toks[n - d :], (slot, d)


def _check_range(a: np.ndarray, name: str | None = None) -> None:
    """Raise ValueError naming the first token of ``a`` (1-D int32 or int64, as :func:`as_tokens`
    gives) outside ``[0, VOCAB_LIMIT)``, and ``name`` (the argument it came in) if given."""
    i = kernels.first_bad_token(a)
    if i >= 0:
        where = f" of {name}" if name else ""
        raise ValueError(f"token {int(a[i])} at index {i}{where} is out of range [0, {VOCAB_LIMIT})")


def _check_draft_args(max_tokens, min_token_prob, max_spec_factor, min_match, prior):
    if type(max_tokens) is not int:
        max_tokens = _check_int(max_tokens, "max_tokens")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if not 0.0 <= min_token_prob <= 1.0:
        raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob!r}")
    if not 0.0 <= max_spec_factor < math.inf:
        raise ValueError(f"max_spec_factor must be a finite number >= 0, got {max_spec_factor!r}")
    if type(min_match) is not int:
        min_match = _check_int(min_match, "min_match")
    if min_match < 1:
        raise ValueError(f"min_match must be >= 1, got {min_match}")
    if not 0.0 <= prior < math.inf:
        raise ValueError(f"prior must be a finite number >= 0, got {prior!r}")
    return max_tokens, float(min_token_prob), float(max_spec_factor), min_match, float(prior)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def _check_weight(weight) -> float:
    try:
        w = float(weight)
    except (TypeError, ValueError):
        raise ValueError(f"weight must be a positive finite number, got {weight!r}") from None
    if not (w > 0.0 and math.isfinite(w)):
        raise ValueError(f"weight must be a positive finite number, got {weight!r}")
    return w


def _check_int(x, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {x!r}")
    return int(x)
