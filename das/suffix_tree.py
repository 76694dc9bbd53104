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

Storage (see :mod:`das.trie_kernels`): a path-compressed trie (an edge holds a run of tokens,
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

import numpy as np

from das import trie_kernels as kernels
from das.checks import I32, I64, as_tokens, check_range, draft_args, positive_weight
from das.draft import Draft, empty_draft
from das.trie_buffer import TrieBuffer
from das.trie_invariants import check_trie

__all__ = ["Draft", "SuffixTree", "VOCAB_LIMIT", "empty_draft"]

VOCAB_LIMIT = kernels.VOCAB_LIMIT

# The trie is rebuilt when the tokens of removed sequences that node labels still reference exceed
# both _REBUILD_MIN_TOKENS and _REBUILD_RATIO times the stored tokens. Such a token costs 4 bytes
# of pool (a stored one about 180 bytes of node rows), so at 4x they add at most 16 bytes per
# stored token, and a global tree (which removes one rollout per stopped request) rebuilds a
# quarter as often as at 1x.
_REBUILD_MIN_TOKENS = 4096
_REBUILD_RATIO = 4
_new_tuple = tuple.__new__  # Draft(...) without NamedTuple's Python-level __new__ (hot path)
_EMPTY_DRAFT = empty_draft()


class SuffixTree(TrieBuffer):
    """Depth-bounded suffix trie over weighted token sequences (see the module docstring; its
    storage: :class:`das.trie_buffer.TrieBuffer`).

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

    __slots__ = ("rebuilds", "_seqs", "_next_id", "_draft_buf")

    def __init__(self, max_depth: int = 24, capacity: int = 0):
        self.rebuilds = 0  # rebuilds so far (each moves the sequences' slots: read slot() again after one)
        self._next_id = 0
        self._draft_buf = (np.empty(0, np.int32), np.empty(0, np.float32))
        self._seqs: dict[int, list] = {}  # seq id -> [slot, weight]
        super().__init__(max_depth, capacity)  # validates both; starts empty

    # ------------------------------------------------------------------ updates
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
        a buffer sized for them up front (so that no growth on the way copies it) and with each
        sequence's room kept (a live rollout's reserve)."""
        seq_table = self._seq_table
        items = [(sid, self.sequence(sid), w, int(seq_table[slot, kernels.S_CAP])) for sid, (slot, w) in sorted(self._seqs.items())]
        caps = self._rebuild_caps()
        self.rebuilds += 1
        self._reset(caps)
        self._seqs = {}
        for sid, toks, w, cap in items:
            slot = self._new_slot()
            self._slots[slot] = sid
            self._seqs[sid] = [slot, w]
            self._reserve(slot, max(cap, toks.shape[0]))
            if toks.shape[0]:
                self._insert(slot, toks, w)

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
        w = positive_weight(weight)
        arr = as_tokens(tokens)
        if arr.shape[0]:
            check_range(arr)
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
        if type(tokens) is np.ndarray and tokens.ndim == 1 and (tokens.dtype is I32 or tokens.dtype is I64) \
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
        max_tokens, min_token_prob, max_spec_factor, min_match, prior = draft_args(
            max_tokens, min_token_prob, max_spec_factor, min_match, prior
        )
        if type(context) is not np.ndarray or context.ndim != 1 or not (context.dtype is I32 or context.dtype is I64):
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
        max_tokens, min_token_prob, max_spec_factor, min_match, prior = draft_args(
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
    def slot(self, seq_id: int) -> int:
        """Row (``int >= 0``) of sequence ``seq_id`` in the trie's sequence table: the ``s`` that
        the kernels of :mod:`das.trie_kernels` take for it. A :meth:`remove` may rebuild the trie,
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
        """Slow consistency check of the arrays (for tests, :func:`das.trie_invariants.check_trie`);
        raises AssertionError on corruption."""
        check_trie(self._buffer, self._slots, {sid: s[0] for sid, s in self._seqs.items()}, self._zombies, self._zombie_tokens,
                   self._pool_top)

