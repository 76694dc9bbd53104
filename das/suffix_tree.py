"""Depth-bounded suffix trie with weighted counts, for frequency-based draft proposals.

A node is a token string ``s`` with ``1 <= len(s) <= max_depth`` (the root is the empty string)
that occurs in at least one stored sequence. ``count(s)`` is the *weighted* number of occurrences
of ``s``: the sum over stored sequences of ``weight(seq) * (number of positions where s ends in
seq)``. (The empty string's count is the weighted number of stored tokens.) Every substring of a
node is a node, so the trie is closed under taking suffixes; each node keeps a suffix link.

Storage is a structure of flat numpy arrays (no Python object per node); the hot paths are numba
kernels in :mod:`das._trie_kernels`. Each sequence keeps its tokens (so that it can be removed) and
its *active nodes* (the nodes of its suffixes of length ``0 .. max_depth - 1``), so appending a
token costs ``O(max_depth)`` child look-ups.

Drafting follows the most-weighted child; the conditional probability of a token is
``count(s + t) / count(s)``. Ties between children of equal weighted count go to the smaller token
id. Only ratios of counts matter for drafting, which is what lets a caller down-weight old
sequences by inserting new ones with larger weights (see :class:`das.drafter.DASDrafter`).

Memory: 44 bytes per node row plus 8 for its weighted count; the hash table holds only the
children of high-fan-out nodes (16 bytes per slot, load <= 1/2). Capacity grows by doubling; freed
rows are reused; an empty trie goes back to its initial capacity.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from das import _trie_kernels as K

__all__ = ["Draft", "SuffixTree", "VOCAB_LIMIT", "empty_draft"]

VOCAB_LIMIT = K.VOCAB_LIMIT

_INIT_NODES = 256
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


class _Seq:
    __slots__ = ("tokens", "n", "weight", "active")

    def __init__(self, capacity: int, weight: float, max_depth: int):
        self.tokens = np.empty(max(capacity, 16), np.int32)
        self.n = 0
        self.weight = weight
        self.active = np.full(max_depth, -1, np.int32)
        self.active[0] = 0


class SuffixTree:
    """Depth-bounded suffix trie over weighted token sequences (see the module docstring).

    Args:
        max_depth: longest stored string (tokens); drafts match at most ``max_depth - 1`` context
            tokens but may run longer than ``max_depth`` (they re-anchor). Default 24, as
            arctic-inference / vLLM's ``suffix`` method.

    Raises:
        ValueError: ``max_depth < 1`` or not an int.
    """

    __slots__ = ("_D", "_nd", "_wc", "_ht", "_meta", "_seqs", "_next_id", "_buf")

    def __init__(self, max_depth: int = 24):
        if isinstance(max_depth, bool) or not isinstance(max_depth, (int, np.integer)) or max_depth < 1:
            raise ValueError(f"max_depth must be an int >= 1, got {max_depth!r}")
        if max_depth > 10_000:
            raise ValueError(f"max_depth must be <= 10000, got {max_depth!r}")
        self._D = int(max_depth)
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0
        self._buf = (np.empty(0, np.int32), np.empty(0, np.float32))
        self._reset()

    # ------------------------------------------------------------------ storage
    def _reset(self) -> None:
        D = self._D
        ncap = max(_INIT_NODES, 4 * D)
        hcap = _pow2(max(_INIT_HASH_MIN, 4 * K.hash_headroom(D)))
        self._nd = np.empty((ncap, K.NCOL), np.int32)
        self._wc = np.zeros(ncap, np.float64)
        self._ht = np.full((hcap, 2), -1, np.int64)
        meta = np.zeros(K.M_LEN, np.int64)
        meta[K.M_HWM] = 1
        meta[K.M_FREE] = -1
        meta[K.M_LIVE] = 1
        meta[K.M_HSHIFT] = 64 - (hcap.bit_length() - 1)
        meta[K.M_MAXD] = D
        self._meta = meta
        root = self._nd[0]
        root[:] = -1
        root[K.C_DEPTH] = 0
        root[K.C_COUNT] = 0
        root[K.C_NCHILD] = 0
        root[K.C_HASHED] = 1

    def _grow(self) -> None:
        """Double the node and/or hash capacity until one more token surely fits."""
        meta = self._meta
        D = self._D
        cap = self._nd.shape[0]
        newcap = cap
        while newcap - meta[K.M_HWM] + meta[K.M_NFREE] < K.node_headroom(D):
            newcap *= 2
        if newcap != cap:
            # rows >= HWM are never read before _alloc sets all their fields: no fill needed
            hwm = int(meta[K.M_HWM])
            nd = np.empty((newcap, K.NCOL), np.int32)
            nd[:hwm] = self._nd[:hwm]
            wc = np.empty(newcap, np.float64)
            wc[:hwm] = self._wc[:hwm]
            self._nd, self._wc = nd, wc
        hcap = self._ht.shape[0]
        newh = hcap
        while meta[K.M_HENT] + K.hash_headroom(D) > newh // 2:
            newh *= 2
        if newh != hcap:
            ht = np.full((newh, 2), -1, np.int64)
            shift = 64 - (newh.bit_length() - 1)
            n = K.rehash(self._nd, ht, meta, shift)
            assert n == meta[K.M_HENT], (n, meta[K.M_HENT])
            self._ht = ht
            meta[K.M_HSHIFT] = shift

    def _insert(self, s: _Seq, arr: np.ndarray) -> None:
        n = arr.shape[0]
        need = s.n + n
        if need > s.tokens.shape[0]:
            buf = np.empty(max(need, 2 * s.tokens.shape[0]), np.int32)
            buf[: s.n] = s.tokens[: s.n]
            s.tokens = buf
        r = K.extend(self._nd, self._wc, self._ht, self._meta, s.active, s.tokens, s.n, arr, s.weight)
        if r < 0:
            i = -r - 1
            raise ValueError(f"token {int(arr[i])} at index {i} is out of range [0, {VOCAB_LIMIT})")
        s.n += r
        pos = r
        while pos < n:
            self._grow()
            r = K.extend(self._nd, self._wc, self._ht, self._meta, s.active, s.tokens, s.n, arr[pos:], s.weight)
            s.n += r
            pos += r

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
        s = _Seq(arr.shape[0], w, self._D)
        if arr.shape[0]:
            self._insert(s, arr)
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = s
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
        arr = as_tokens(tokens)
        if arr.shape[0]:
            self._insert(s, arr)

    def remove(self, seq_id: int) -> None:
        """Remove sequence ``seq_id``: subtract its counts, free the nodes no sequence uses.

        Freed rows are reused by later inserts; when the trie becomes empty its arrays go back to
        the initial capacity. Cost: ``O(len * max_depth)``.

        Raises:
            KeyError: unknown (or already removed) ``seq_id``.
        """
        s = self._seqs.pop(seq_id, None)
        if s is None:
            raise KeyError(f"unknown sequence id {seq_id!r}")
        if s.n:
            K.remove(self._nd, self._wc, self._ht, self._meta, s.tokens[: s.n], s.weight)
            if self._meta[K.M_LIVE] == 1:
                self._reset()

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
        self._wc[:hwm] *= f
        for s in self._seqs.values():
            s.weight *= f

    # ------------------------------------------------------------------ queries
    def draft(
        self,
        context,
        max_tokens: int,
        min_token_prob: float = 0.1,
        max_spec_factor: float = 1.0,
        min_match: int = 1,
    ) -> Draft:
        """Propose up to ``max_tokens`` tokens that follow ``context``.

        For each suffix of the context's last ``max_depth - 1`` tokens that is in the trie and
        has length ``match_len >= min_match`` (longest first), walk from its node to the
        most-weighted child (ties: smaller token) repeatedly; token probability =
        ``count(child) / count(node)``, path probability = running product. A walk stops before a
        token whose path probability would fall below ``min_token_prob``, at ``max_tokens``
        tokens, at ``floor(match_len * max_spec_factor)`` tokens, or where the node has no child.
        A walk that reaches depth ``max_depth`` re-anchors on the node of the last
        ``max_depth - 1`` tokens of context + draft (its suffix link) and goes on, so drafts may be
        longer than ``max_depth``. The draft with the largest score (sum of path probabilities)
        wins; ties go to the longer match. Single numba call; ``O(max_depth)`` hash look-ups.

        Args:
            context: 1-D integer array-like (prompt + output so far); only its tail is read.
                Tokens outside ``[0, 2**20)`` simply match nothing.
            max_tokens: int >= 0, draft length cap.
            min_token_prob: float in ``[0, 1]``.
            max_spec_factor: float >= 0.
            min_match: int >= 1, shortest context suffix to anchor on.

        Returns:
            :class:`Draft`; empty (score 0.0, match_len 0) when nothing matches.

        Raises:
            ValueError: an argument out of range, or context not 1-D integers.
        """
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
        if type(context) is not np.ndarray or context.ndim != 1 or not (context.dtype is _I32 or context.dtype is _I64):
            w = self._D - 1
            context = as_tokens(context[-w:] if w else (), "context")
        return self._draft(context, max_tokens, float(min_token_prob), float(max_spec_factor), min_match)

    def _draft(self, context: np.ndarray, max_tokens: int, min_prob: float, factor: float, min_match: int) -> Draft:
        """:meth:`draft` without argument checks: ``context`` is a 1-D int32/int64 ndarray."""
        if max_tokens == 0:
            return _EMPTY_DRAFT
        n = context.shape[0]
        if n >= self._D:
            context = context[n - self._D + 1 :]
        if not context.flags.c_contiguous:
            context = np.ascontiguousarray(context)
        buf = self._buf
        if buf[0].shape[0] < 2 * max_tokens:
            m = max(2 * max_tokens, 32)
            buf = self._buf = (np.empty(m, np.int32), np.empty(m, np.float32))
        off, k, score, mlen = K.draft(
            self._nd, self._wc, self._ht, self._meta, context, max_tokens, min_prob, factor, min_match, buf[0], buf[1]
        )
        if k == 0:
            return _EMPTY_DRAFT
        return _new_tuple(Draft, (buf[0][off : off + k].copy(), buf[1][off : off + k].copy(), score, mlen))

    def count(self, pattern) -> float:
        """Weighted occurrence count of the token string ``pattern`` (1-D integer array-like).

        ``count([])`` is the weighted number of stored tokens. Returns 0.0 for absent strings and
        for strings longer than ``max_depth`` (not stored).
        """
        u = K.find(self._nd, self._ht, self._meta, as_tokens(pattern, "pattern"))
        return float(self._wc[u]) if u >= 0 else 0.0

    def raw_count(self, pattern) -> int:
        """Unweighted occurrence count of ``pattern`` (0 if absent or longer than ``max_depth``)."""
        u = K.find(self._nd, self._ht, self._meta, as_tokens(pattern, "pattern"))
        return int(self._nd[u, K.C_COUNT]) if u >= 0 else 0

    def continuations(self, pattern) -> dict[int, float]:
        """``{token: count(pattern + [token])}`` for every token that follows ``pattern``.

        Empty when ``pattern`` is absent or has length ``>= max_depth``.
        """
        u = K.find(self._nd, self._ht, self._meta, as_tokens(pattern, "pattern"))
        if u < 0:
            return {}
        toks, ws = K.children(self._nd, self._wc, u)
        return {int(t): float(x) for t, x in zip(toks, ws)}

    def best_continuation(self, pattern) -> int | None:
        """The cached most-weighted next token after ``pattern`` (ties: smallest), or None."""
        u = K.find(self._nd, self._ht, self._meta, as_tokens(pattern, "pattern"))
        if u < 0:
            return None
        if u == 0:
            c = self.continuations([])
            return min(c, key=lambda t: (-c[t], t)) if c else None
        b = int(self._nd[u, K.C_BEST])
        return int(self._nd[b, K.C_TOKEN]) if b >= 0 else None

    def sequence(self, seq_id: int) -> np.ndarray:
        """Copy of the tokens (``np.int32[n]``) of sequence ``seq_id``. Raises KeyError if unknown."""
        s = self._seqs.get(seq_id)
        if s is None:
            raise KeyError(f"unknown sequence id {seq_id!r}")
        return s.tokens[: s.n].copy()

    def weight(self, seq_id: int) -> float:
        """Current weight of sequence ``seq_id`` (after any :meth:`scale`). Raises KeyError if unknown."""
        s = self._seqs.get(seq_id)
        if s is None:
            raise KeyError(f"unknown sequence id {seq_id!r}")
        return s.weight

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
        """Live nodes, the root excluded (distinct strings of length 1..max_depth)."""
        return int(self._meta[K.M_LIVE]) - 1

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
        """Bytes held by all numpy arrays of the trie (node rows, counts, hash table, sequences)."""
        n = self._nd.nbytes + self._wc.nbytes + self._ht.nbytes + self._meta.nbytes
        n += sum(b.nbytes for b in self._buf)
        for s in self._seqs.values():
            n += s.tokens.nbytes + s.active.nbytes
        return n

    def check_invariants(self) -> None:
        """Slow consistency check of the arrays (for tests); raises AssertionError on corruption."""
        nd, wc, meta, D = self._nd, self._wc, self._meta, self._D
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
        hent = 0
        for u in live:
            kids = []
            c = int(nd[u, K.C_FIRST])
            prev = -1
            while c != -1:
                assert nd[c, K.C_PARENT] == u and nd[c, K.C_PREV] == prev
                assert nd[c, K.C_DEPTH] == nd[u, K.C_DEPTH] + 1 <= D
                kids.append(c)
                prev, c = c, int(nd[c, K.C_NEXT])
            assert len(kids) == nd[u, K.C_NCHILD]
            assert nd[u, K.C_COUNT] >= sum(int(nd[c, K.C_COUNT]) for c in kids)
            if u != 0:
                assert nd[u, K.C_COUNT] > 0
                best = -1
                for c in kids:
                    if best < 0 or (wc[c], -nd[c, K.C_TOKEN]) > (wc[best], -nd[best, K.C_TOKEN]):
                        best = c
                assert nd[u, K.C_BEST] == best, (u, nd[u, K.C_BEST], best)
                link = int(nd[u, K.C_LINK])
                assert nd[link, K.C_DEPTH] == nd[u, K.C_DEPTH] - 1 and (link == 0 or nd[link, K.C_PARENT] != -1)
            if nd[u, K.C_HASHED] == 1:
                for c in kids:
                    key = (u << K.TOKEN_BITS) | int(nd[c, K.C_TOKEN])
                    assert K._hash_find(self._ht, meta[K.M_HSHIFT], np.int64(key)) == c
                hent += len(kids)
        strings = {0: ()}
        for u in live[1:]:
            path, x = [], u
            while x != 0:
                path.append(int(nd[x, K.C_TOKEN]))
                x = int(nd[x, K.C_PARENT])
            strings[u] = tuple(reversed(path))
        for u in live[1:]:
            assert strings[int(nd[u, K.C_LINK])] == strings[u][1:]
        assert hent == meta[K.M_HENT], (hent, meta[K.M_HENT])
        assert int((self._ht[:, 0] != -1).sum()) == hent


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
