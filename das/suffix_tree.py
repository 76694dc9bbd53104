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
from typing import NamedTuple

import numpy as np

from das import _trie_kernels as K

__all__ = ["Draft", "SuffixTree", "VOCAB_LIMIT", "empty_draft"]

VOCAB_LIMIT = K.VOCAB_LIMIT

_INIT_NODES = 256
_INIT_SEQS = 4
_INIT_POOL = 256
_MIN_SEG = 16
_REBUILD_MIN_TOKENS = 4096  # rebuild when removed-but-referenced tokens exceed this and the stored ones
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

    Raises:
        ValueError: ``max_depth < 1`` or not an int.
    """

    __slots__ = ("_D", "_mem", "_nd", "_wf", "_ht", "_meta", "_sq", "_pool", "_seqs", "_slots", "_free_slots",
                 "_next_id", "_buf", "_ptop", "_pgarb", "_zombies", "_ztok", "_on_mem")

    def __init__(self, max_depth: int = 24):
        if isinstance(max_depth, bool) or not isinstance(max_depth, (int, np.integer)) or max_depth < 1:
            raise ValueError(f"max_depth must be an int >= 1, got {max_depth!r}")
        if max_depth > 10_000:
            raise ValueError(f"max_depth must be <= 10000, got {max_depth!r}")
        self._D = int(max_depth)
        self._on_mem = None  # called with the new buffer whenever the trie moves to one (see _set_views)
        self._next_id = 0
        self._buf = (np.empty(0, np.int32), np.empty(0, np.float32))
        self._seqs: dict[int, list] = {}  # seq id -> [slot, weight]
        self._reset()

    # ------------------------------------------------------------------ storage
    def _reset(self) -> None:
        D = self._D
        ncap = max(_INIT_NODES, 4 * D)
        hcap = _pow2(max(_INIT_HASH_MIN, 4 * K.hash_headroom(D)))
        meta, words = K.layout(D, ncap, hcap, _INIT_SEQS, _INIT_POOL)
        self._mem = np.empty(words, np.int64)
        self._mem[: K.M_LEN] = meta
        self._set_views()
        meta = self._meta
        meta[K.M_HWM] = 1
        meta[K.M_FREE] = -1
        meta[K.M_LIVE] = 1
        self._ht.fill(-1)
        self._sq.fill(0)
        root = self._nd[0]
        root[: K.C_HASHED + 1] = -1
        self._wf[0] = 0.0
        root[K.C_DEPTH] = 0
        root[K.C_COUNT] = 0
        root[K.C_NCHILD] = 0
        root[K.C_HASHED] = 1
        root[K.C_SEQ] = 0
        root[K.C_IDX] = 0
        self._slots: dict[int, int] = {}  # slot -> seq id (stored sequences)
        self._free_slots = list(range(_INIT_SEQS - 1, -1, -1))
        self._ptop = 0
        self._pgarb = 0
        self._zombies: list[int] = []  # slots of removed sequences whose tokens stay pooled
        self._ztok = 0

    def _set_views(self) -> None:
        """Point the array views at ``self._mem``; called whenever the trie moves to a new buffer
        (``_reset``, ``_realloc``), which is also when ``_on_mem`` (if set) hears of it: an owner
        that hands the buffer to batch kernels (:class:`das.drafter.DASDrafter`) must not keep
        the old one."""
        self._meta, self._nd, self._wf, self._ht, self._sq, self._pool = K.views(self._mem)
        if self._on_mem is not None:
            self._on_mem(self._mem)

    def _realloc(self, ncap: int, hcap: int, scap: int, pcap: int) -> None:
        """Move the trie into a buffer with these capacities (never smaller than the used parts)."""
        old_meta, nd, wf, ht, sq, pool = self._meta, self._nd, self._wf, self._ht, self._sq, self._pool
        meta, words = K.layout(self._D, ncap, hcap, scap, pcap)
        for k in (K.M_HWM, K.M_FREE, K.M_NFREE, K.M_LIVE, K.M_HENT, K.M_NTOK):
            meta[k] = old_meta[k]
        mem = np.empty(words, np.int64)
        mem[: K.M_LEN] = meta
        self._mem = mem
        self._set_views()
        hwm = int(meta[K.M_HWM])
        # node rows >= HWM are never read before they are allocated: no fill needed
        self._nd[:hwm] = nd[:hwm]
        self._wf[:hwm] = wf[:hwm]
        self._sq[: sq.shape[0]] = sq
        self._sq[sq.shape[0] :] = 0
        self._pool[: self._ptop] = pool[: self._ptop]
        if hcap == ht.shape[0]:
            self._ht[:] = ht
        else:
            self._ht.fill(-1)
            n = K.rehash(mem)
            assert n == meta[K.M_HENT], (n, meta[K.M_HENT])

    def _grow(self) -> None:
        """Grow the node and/or hash capacity until one more token surely fits."""
        meta = self._meta
        D = self._D
        cap = int(meta[K.M_NCAP])
        newcap = cap
        while newcap - meta[K.M_HWM] + meta[K.M_NFREE] < K.node_headroom(D):
            newcap *= 2
        hcap = int(meta[K.M_HCAP])
        newh = hcap
        while meta[K.M_HENT] + K.hash_headroom(D) > newh // 2:
            newh *= 2
        if newcap != cap or newh != hcap:
            self._realloc(newcap, newh, int(meta[K.M_SCAP]), int(meta[K.M_PCAP]))

    def _new_slot(self) -> int:
        if not self._free_slots:
            n = int(self._meta[K.M_SCAP])
            self._realloc(int(self._meta[K.M_NCAP]), int(self._meta[K.M_HCAP]), 2 * n, int(self._meta[K.M_PCAP]))
            self._free_slots = list(range(2 * n - 1, n - 1, -1))
        slot = self._free_slots.pop()
        row = self._sq[slot]
        row[:] = 0
        row[K.S_BASE] = self._ptop
        row[K.S_STATE] = 1
        return slot

    def _reserve(self, slot: int, n: int) -> None:
        """Make room for ``n`` more tokens in ``slot``'s pool segment (moves it to the pool's end)."""
        sq = self._sq
        length = int(sq[slot, K.S_LEN])
        cap = int(sq[slot, K.S_CAP])
        if length + n <= cap:
            return
        newcap = max(_MIN_SEG, 2 * cap, length + n)
        if self._ptop + newcap > self._pool.shape[0]:
            if 3 * self._pgarb > self._ptop:  # a third or more is garbage: compact before growing
                self._compact_pool()
            size = self._pool.shape[0]
            while self._ptop + newcap > size:
                size *= 2
            if size != self._pool.shape[0]:
                m = self._meta
                self._realloc(int(m[K.M_NCAP]), int(m[K.M_HCAP]), int(m[K.M_SCAP]), size)
                sq = self._sq
        base = int(sq[slot, K.S_BASE])
        self._pool[self._ptop : self._ptop + length] = self._pool[base : base + length]
        sq[slot, K.S_BASE] = self._ptop
        sq[slot, K.S_CAP] = newcap
        self._pgarb += cap
        self._ptop += newcap

    def _compact_pool(self) -> None:
        """Slide every stored and removed-but-referenced segment down over the garbage."""
        sq = self._sq
        used = sorted((int(sq[s, K.S_BASE]), s) for s in list(self._slots) + self._zombies)
        pool = self._pool
        top = 0
        for base, s in used:
            cap = int(sq[s, K.S_CAP]) if sq[s, K.S_STATE] == 1 else int(sq[s, K.S_LEN])
            length = int(sq[s, K.S_LEN])
            if base != top:
                pool[top : top + length] = pool[base : base + length]  # top < base: safe overlap
            sq[s, K.S_BASE] = top
            sq[s, K.S_CAP] = cap
            top += cap
        self._ptop = top
        self._pgarb = 0

    def _insert(self, slot: int, arr: np.ndarray, weight: float) -> None:
        n = arr.shape[0]
        r = K.extend(self._mem, slot, arr, weight)
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
            pos += K.extend(self._mem, slot, arr[pos:], weight)

    def _rebuild(self) -> None:
        """Rebuild the trie from the stored sequences (drops the removed ones' pooled tokens)."""
        items = [(sid, self.sequence(sid), w) for sid, (slot, w) in sorted(self._seqs.items())]
        self._reset()
        self._seqs = {}
        for sid, toks, w in items:
            slot = self._new_slot()
            self._slots[slot] = sid
            self._seqs[sid] = [slot, w]
            if toks.shape[0]:
                self._insert(slot, toks, w)

    # ------------------------------------------------------------------ updates
    def add(self, tokens=(), weight: float = 1.0) -> int:
        """Store a new sequence.

        Args:
            tokens: 1-D integer array-like of token ids in ``[0, 2**20)``; may be empty (then
                :meth:`extend` it later).
            weight: positive finite float; each occurrence in this sequence counts ``weight``.

        Returns:
            The new sequence id (int, never reused by this tree).

        Raises:
            ValueError: bad weight, tokens not a 1-D integer array, or a token out of range (the
                message names it; nothing is stored then).
        """
        w = _check_weight(weight)
        arr = as_tokens(tokens)
        if arr.shape[0]:
            _check_range(arr)
        slot = self._new_slot()
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
            r = K.extend(self._mem, s[0], arr, s[1])
            if r != n:
                if r < 0:
                    raise ValueError(f"token {int(arr[-r - 1])} at index {-r - 1} is out of range [0, {VOCAB_LIMIT})")
                self._finish_insert(s[0], arr[r:], s[1])

    def remove(self, seq_id: int) -> None:
        """Remove sequence ``seq_id``: subtract its counts, free the nodes no sequence uses.

        Freed rows are reused by later inserts; when no sequence is left the arrays go back to
        the initial capacity. Cost: ``O(len * max_depth)``, plus now and then a rebuild from the
        stored sequences (when the removed sequences' still-referenced tokens outnumber them).

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
        n = int(self._sq[slot, K.S_LEN])
        if n:
            ok = K.remove(self._mem, slot, w)
            assert ok, "suffix tree corrupted: a stored suffix was not found"
        if self._meta[K.M_LIVE] == 1:  # no node references any pooled token of a removed sequence
            self._sq[slot, K.S_STATE] = 0
            self._pgarb += int(self._sq[slot, K.S_CAP])
            self._free_slots.append(slot)
            for z in self._zombies:
                self._sq[z, K.S_STATE] = 0
                self._pgarb += int(self._sq[z, K.S_LEN])
                self._free_slots.append(z)
            self._zombies = []
            self._ztok = 0
            return
        self._sq[slot, K.S_STATE] = 2
        self._zombies.append(slot)
        self._ztok += n
        self._pgarb += int(self._sq[slot, K.S_CAP]) - n
        if self._ztok > max(self.num_tokens, _REBUILD_MIN_TOKENS):
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
        hwm = int(self._meta[K.M_HWM])
        self._wf[:hwm] *= f
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
            w = self._D - 1
            context = as_tokens(context[-w:] if w else (), "context")
        return self._draft(context, max_tokens, min_token_prob, max_spec_factor, min_match, prior)

    def _draft(self, context: np.ndarray, max_tokens: int, min_prob: float, factor: float, min_match: int = 1,
               prior: float = 0.0) -> Draft:
        """:meth:`draft` without argument checks: ``context`` is a 1-D int32/int64 ndarray."""
        if max_tokens == 0:
            return _EMPTY_DRAFT
        n = context.shape[0]
        if n >= self._D:
            context = context[n - self._D + 1 :]
        if not context.flags.c_contiguous:
            context = np.ascontiguousarray(context)
        buf = self._scratch(max_tokens)
        off, k, score, mlen = K.draft(self._mem, context, max_tokens, min_prob, factor, min_match, prior, buf[0], buf[1])
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
        buf = self._buf
        if buf[0].shape[0] < 4 * max_tokens:
            buf = self._scratch(max_tokens)
        off, k, score, mlen = K.draft_seq(self._mem, slot, max_tokens, min_prob, factor, min_match, prior, buf[0], buf[1])
        if k == 0:
            return _EMPTY_DRAFT
        return _new_tuple(Draft, (buf[0][off : off + k].copy(), buf[1][off : off + k].copy(), score, mlen))

    def _scratch(self, max_tokens: int):
        buf = self._buf
        if buf[0].shape[0] < 4 * max_tokens:
            m = max(4 * max_tokens, 64)
            buf = self._buf = (np.empty(m, np.int32), np.empty(m, np.float32))
        return buf

    def _locus(self, pattern):
        return K.find(self._mem, as_tokens(pattern, "pattern"))

    def count(self, pattern) -> float:
        """Weighted occurrence count of the token string ``pattern`` (1-D integer array-like).

        ``count([])`` is the weighted number of stored tokens. Returns 0.0 for absent strings and
        for strings longer than ``max_depth`` (not stored).
        """
        u, _ = self._locus(pattern)
        return float(self._wf[u, 0]) if u >= 0 else 0.0

    def raw_count(self, pattern) -> int:
        """Unweighted occurrence count of ``pattern`` (0 if absent or longer than ``max_depth``)."""
        u, _ = self._locus(pattern)
        return int(self._nd[u, K.C_COUNT]) if u >= 0 else 0

    def continuations(self, pattern) -> dict[int, float]:
        """``{token: count(pattern + [token])}`` for every token that follows ``pattern``.

        Empty when ``pattern`` is absent or has length ``>= max_depth``.
        """
        u, d = self._locus(pattern)
        if u < 0 or d >= self._D:
            return {}
        toks, ws = K.children(self._mem, u, d)
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
        base, n = int(self._sq[s[0], K.S_BASE]), int(self._sq[s[0], K.S_LEN])
        return self._pool[base : base + n].copy()

    def seq_len(self, seq_id: int) -> int:
        """Number of tokens of sequence ``seq_id``. Raises KeyError if unknown."""
        s = self._seqs.get(seq_id)
        if s is None:
            raise KeyError(f"unknown sequence id {seq_id!r}")
        return int(self._sq[s[0], K.S_LEN])

    def weight(self, seq_id: int) -> float:
        """Current weight of sequence ``seq_id`` (after any :meth:`scale`). Raises KeyError if unknown."""
        s = self._seqs.get(seq_id)
        if s is None:
            raise KeyError(f"unknown sequence id {seq_id!r}")
        return s[1]

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def max_depth(self) -> int:
        """Longest stored string, in tokens."""
        return self._D

    @property
    def num_nodes(self) -> int:
        """Live nodes, the root excluded (a node ends an edge, which may hold several tokens)."""
        return int(self._meta[K.M_LIVE]) - 1

    @property
    def num_strings(self) -> int:
        """Distinct stored strings (lengths 1..max_depth): the tokens on all edges. Slow (scans)."""
        nd = self._nd
        hwm = int(self._meta[K.M_HWM])
        live = nd[1:hwm, K.C_PARENT] != -1
        par = nd[1:hwm, K.C_PARENT][live]
        return int((nd[1:hwm, K.C_DEPTH][live] - nd[par, K.C_DEPTH]).sum())

    @property
    def num_tokens(self) -> int:
        """Tokens stored over all sequences."""
        return int(self._meta[K.M_NTOK])

    @property
    def num_sequences(self) -> int:
        """Stored sequences (empty ones included)."""
        return len(self._seqs)

    @property
    def nbytes(self) -> int:
        """Bytes held by the trie's buffer (nodes, counts, hash table, sequences, pool) and scratch."""
        return self._mem.nbytes + sum(b.nbytes for b in self._buf)

    def check_invariants(self) -> None:
        """Slow consistency check of the arrays (for tests); raises AssertionError on corruption."""
        nd, wf, meta, D, sq, pool = self._nd, self._wf, self._meta, self._D, self._sq, self._pool
        hwm = int(meta[K.M_HWM])
        live = [0] + [i for i in range(1, hwm) if nd[i, K.C_PARENT] != -1]
        assert len(live) == meta[K.M_LIVE], (len(live), meta[K.M_LIVE])
        free = set()
        f = int(meta[K.M_FREE])
        while f != -1:
            assert f not in free
            free.add(f)
            f = int(nd[f, K.C_NEXT])
        assert len(free) == meta[K.M_NFREE] and len(free) + len(live) == hwm
        for slot, sid in self._slots.items():
            assert self._seqs[sid][0] == slot and sq[slot, K.S_STATE] == 1
        for z in self._zombies:
            assert sq[z, K.S_STATE] == 2
        assert self._ztok == sum(int(sq[z, K.S_LEN]) for z in self._zombies)
        assert self.num_tokens == sum(int(sq[s, K.S_LEN]) for s in self._slots)
        # segments lie inside the pool and do not overlap
        segs = sorted((int(sq[s, K.S_BASE]), int(sq[s, K.S_CAP] if sq[s, K.S_STATE] == 1 else sq[s, K.S_LEN]))
                      for s in list(self._slots) + self._zombies)
        top = 0
        for base, cap in segs:
            assert base >= top and base + cap <= self._ptop <= pool.shape[0]
            top = base + cap

        def label(u):
            p = int(nd[u, K.C_PARENT])
            s, e = int(nd[u, K.C_SEQ]), int(nd[u, K.C_IDX])
            n = int(nd[u, K.C_DEPTH] - nd[p, K.C_DEPTH])
            i = e - n
            assert sq[s, K.S_STATE] in (1, 2) and 0 <= i and i + n <= sq[s, K.S_LEN], (u, s, i, n)
            b = int(sq[s, K.S_BASE])
            return tuple(int(x) for x in pool[b + i : b + i + n])

        strings = {0: ()}
        order = sorted(live[1:], key=lambda u: nd[u, K.C_DEPTH])
        for u in order:
            p = int(nd[u, K.C_PARENT])
            lab = label(u)
            assert len(lab) >= 1 and lab[0] == nd[u, K.C_TOKEN]
            strings[u] = strings[p] + lab
            assert len(strings[u]) == nd[u, K.C_DEPTH] <= D
        hent = 0
        for u in live:
            kids = []
            c = int(nd[u, K.C_FIRST])
            prev = -1
            while c != -1:
                assert nd[c, K.C_PARENT] == u and nd[c, K.C_PREV] == prev
                assert nd[c, K.C_DEPTH] > nd[u, K.C_DEPTH]
                kids.append(c)
                prev, c = c, int(nd[c, K.C_NEXT])
            assert len(kids) == nd[u, K.C_NCHILD]
            assert len({int(nd[c, K.C_TOKEN]) for c in kids}) == len(kids)
            assert nd[u, K.C_COUNT] >= sum(int(nd[c, K.C_COUNT]) for c in kids)
            wsum = sum(float(wf[c, 0]) for c in kids)
            assert abs(wf[u, 1] - wsum) <= 1e-9 * max(1.0, abs(wsum)), (u, wf[u, 1], wsum)
            if u != 0:
                assert nd[u, K.C_COUNT] > 0
                if nd[u, K.C_COUNT] == 1:
                    assert len(kids) <= 1
                best = -1
                for c in kids:
                    if best < 0 or (wf[c, 0], -nd[c, K.C_TOKEN]) > (wf[best, 0], -nd[best, K.C_TOKEN]):
                        best = c
                assert nd[u, K.C_BEST] == best, (u, nd[u, K.C_BEST], best)
            if nd[u, K.C_HASHED] == 1:
                for c in kids:
                    key = (u << K.TOKEN_BITS) | int(nd[c, K.C_TOKEN])
                    assert K._hash_find(self._ht, meta[K.M_HSHIFT], np.int64(key)) == c
                hent += len(kids)
        assert hent == meta[K.M_HENT], (hent, meta[K.M_HENT])
        assert int((self._ht[:, 0] != -1).sum()) == hent
        # every stored sequence's active loci end exactly at its suffixes
        for slot in self._slots:
            n = int(sq[slot, K.S_LEN])
            b = int(sq[slot, K.S_BASE])
            toks = tuple(int(x) for x in pool[b : b + n])
            for d in range(0, min(n, D) + 1):
                u = int(sq[slot, K.S_ACT + d])
                assert u in strings and strings[u] == toks[n - d :], (slot, d)


def _check_range(a: np.ndarray) -> None:
    bad = (a < 0) | (a >= VOCAB_LIMIT)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"token {int(a[i])} at index {i} is out of range [0, {VOCAB_LIMIT})")


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
