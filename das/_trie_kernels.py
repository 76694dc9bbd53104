"""Numba kernels of :class:`das.suffix_tree.SuffixTree` (flat arrays, no Python object per node).

Every kernel takes the tree's arrays as arguments (``njit(cache=True)``, compiled once per
argument dtype and cached on disk; no jitclass, which numba cannot cache).

Layout (see ``SuffixTree`` for the meaning of a node):

* ``nd``: ``int32[cap, NCOL]``, one row per node id; the columns are the ``C_*`` constants.
  Node 0 is the root (the empty string). A free row has ``C_PARENT == -1`` and is chained into
  the free list through ``C_NEXT``.
* ``wc``: ``float64[cap]``, weighted count of each node (exactly 0.0 when its raw count is 0).
* ``ht``: ``int64[hcap, 2]`` open-addressing hash table (linear probing, backward-shift deletion,
  power-of-two size, load <= 1/2), ``[key, child]`` per slot, key ``-1`` = empty,
  key = ``parent << TOKEN_BITS | token``. Only the children of *hashed* parents are in it: the
  root, and any node that once had ``HASH_MIN_CHILDREN`` children. The children of other nodes are
  found by walking their (short) sibling list, which needs no random access to a big table;
  the cached best child is tried first.
* ``meta``: ``int64[M_LEN]`` scalars (the ``M_*`` constants).

A sequence being extended keeps ``active``: ``int32[max_depth]``, ``active[d]`` = node of the
suffix of length ``d`` ending at its last token (``active[0]`` = root), valid for
``d <= min(len, max_depth - 1)``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

TOKEN_BITS = 20
VOCAB_LIMIT = 1 << TOKEN_BITS  # tokens must lie in [0, VOCAB_LIMIT)

# node columns
C_PARENT = 0  # parent node (-1: root or free row)
C_TOKEN = 1  # last token of the node's string
C_DEPTH = 2  # string length
C_COUNT = 3  # raw (unweighted) occurrence count; the node is freed when it reaches 0
C_FIRST = 4  # first child (-1: none)
C_NEXT = 5  # next sibling (free rows: next free row)
C_PREV = 6  # previous sibling
C_BEST = 7  # child with the largest weighted count, ties: smallest token (-1: no child; root: always -1)
C_LINK = 8  # suffix link: node of the string without its first token (root for depth 1)
C_NCHILD = 9  # number of children
C_HASHED = 10  # 1: the children are in the hash table
NCOL = 11

# meta slots
M_HWM = 0  # rows [0, HWM) have been used at least once
M_FREE = 1  # head of the free list (-1: empty)
M_NFREE = 2  # rows on the free list
M_LIVE = 3  # live nodes, root included
M_HENT = 4  # entries in the hash table
M_HSHIFT = 5  # 64 - log2(hcap)
M_NTOK = 6  # tokens stored (all sequences)
M_MAXD = 7  # max_depth
M_LEN = 8

HASH_MIN_CHILDREN = 8  # a node with this many children moves them to the hash table
_MULT = np.int64(-7046029254386353131)  # 0x9E3779B97F4A7C15 (Fibonacci hashing)


def node_headroom(max_depth: int) -> int:
    """Free node rows a kernel needs before it inserts one more token."""
    return max_depth


def hash_headroom(max_depth: int) -> int:
    """Free hash entries (below half the table) a kernel needs before it inserts one more token."""
    return max_depth * (HASH_MIN_CHILDREN + 1)


# ----------------------------------------------------------------------------- hash table


@njit(cache=True)
def _slot(key, shift, mask):
    return ((key * _MULT) >> shift) & mask


@njit(cache=True)
def _hash_find(ht, shift, key):
    mask = ht.shape[0] - 1
    i = _slot(key, shift, mask)
    while True:
        k = ht[i, 0]
        if k == key:
            return ht[i, 1]
        if k == -1:
            return -1
        i = (i + 1) & mask


@njit(cache=True)
def _hash_insert(ht, shift, key, val):
    mask = ht.shape[0] - 1
    i = _slot(key, shift, mask)
    while ht[i, 0] != -1:
        i = (i + 1) & mask
    ht[i, 0] = key
    ht[i, 1] = val


@njit(cache=True)
def _hash_delete(ht, shift, key):
    mask = ht.shape[0] - 1
    i = _slot(key, shift, mask)
    while ht[i, 0] != key:
        if ht[i, 0] == -1:
            return False
        i = (i + 1) & mask
    j = i
    while True:  # backward-shift deletion: keep every probe chain unbroken
        j = (j + 1) & mask
        kj = ht[j, 0]
        if kj == -1:
            break
        home = _slot(kj, shift, mask)
        if (j > i and (home <= i or home > j)) or (j < i and home <= i and home > j):
            ht[i, 0] = kj
            ht[i, 1] = ht[j, 1]
            i = j
    ht[i, 0] = -1
    ht[i, 1] = -1
    return True


@njit(cache=True)
def _key(parent, token):
    return (np.int64(parent) << TOKEN_BITS) | np.int64(token)


@njit(cache=True)
def rehash(nd, ht, meta, shift):
    """Insert the children of every hashed live node into the empty table ``ht``; returns entries."""
    n = 0
    for p in range(meta[M_HWM]):
        if nd[p, C_HASHED] == 1 and (p == 0 or nd[p, C_PARENT] != -1):
            c = nd[p, C_FIRST]
            while c != -1:
                _hash_insert(ht, shift, _key(p, nd[c, C_TOKEN]), c)
                n += 1
                c = nd[c, C_NEXT]
    return n


# ----------------------------------------------------------------------------- nodes


@njit(cache=True)
def _child(nd, ht, shift, p, t):
    """Child of node ``p`` with token ``t``, or -1."""
    if nd[p, C_HASHED] == 1:
        return np.int64(_hash_find(ht, shift, _key(p, t)))
    b = nd[p, C_BEST]
    if b >= 0 and nd[b, C_TOKEN] == t:
        return np.int64(b)
    c = nd[p, C_FIRST]
    while c != -1:
        if nd[c, C_TOKEN] == t:
            return np.int64(c)
        c = nd[c, C_NEXT]
    return np.int64(-1)


@njit(cache=True)
def _alloc(nd, wc, ht, meta, p, t):
    f = meta[M_FREE]
    if f != -1:
        c = f
        meta[M_FREE] = nd[f, C_NEXT]
        meta[M_NFREE] -= 1
    else:
        c = meta[M_HWM]
        meta[M_HWM] += 1
    nd[c, C_PARENT] = p
    nd[c, C_TOKEN] = t
    nd[c, C_DEPTH] = nd[p, C_DEPTH] + 1
    nd[c, C_COUNT] = 0
    nd[c, C_FIRST] = -1
    nd[c, C_PREV] = -1
    nd[c, C_BEST] = -1
    nd[c, C_LINK] = -1
    nd[c, C_NCHILD] = 0
    nd[c, C_HASHED] = 0
    wc[c] = 0.0
    old = nd[p, C_FIRST]
    nd[c, C_NEXT] = old
    if old != -1:
        nd[old, C_PREV] = c
    nd[p, C_FIRST] = c
    nd[p, C_NCHILD] += 1
    shift = meta[M_HSHIFT]
    if nd[p, C_HASHED] == 1:
        _hash_insert(ht, shift, _key(p, t), c)
        meta[M_HENT] += 1
    elif nd[p, C_NCHILD] >= HASH_MIN_CHILDREN:
        nd[p, C_HASHED] = 1
        x = nd[p, C_FIRST]
        while x != -1:
            _hash_insert(ht, shift, _key(p, nd[x, C_TOKEN]), x)
            meta[M_HENT] += 1
            x = nd[x, C_NEXT]
    meta[M_LIVE] += 1
    return c


@njit(cache=True)
def _free(nd, wc, ht, meta, c):
    """Unlink leaf-or-childless node ``c`` (its children must be freed first) and free its row."""
    p = nd[c, C_PARENT]
    prv = nd[c, C_PREV]
    nxt = nd[c, C_NEXT]
    if prv == -1:
        nd[p, C_FIRST] = nxt
    else:
        nd[prv, C_NEXT] = nxt
    if nxt != -1:
        nd[nxt, C_PREV] = prv
    nd[p, C_NCHILD] -= 1
    if nd[p, C_HASHED] == 1:
        _hash_delete(ht, meta[M_HSHIFT], _key(p, nd[c, C_TOKEN]))
        meta[M_HENT] -= 1
    if nd[p, C_BEST] == c:
        nd[p, C_BEST] = -2  # dirty: recomputed by the caller
    nd[c, C_PARENT] = -1
    nd[c, C_TOKEN] = -1
    nd[c, C_COUNT] = 0
    nd[c, C_FIRST] = -1
    nd[c, C_PREV] = -1
    nd[c, C_BEST] = -1
    nd[c, C_LINK] = -1
    nd[c, C_NCHILD] = 0
    nd[c, C_HASHED] = 0
    wc[c] = 0.0
    nd[c, C_NEXT] = meta[M_FREE]
    meta[M_FREE] = c
    meta[M_NFREE] += 1
    meta[M_LIVE] -= 1


@njit(cache=True)
def _better(nd, wc, a, b):
    """Is child ``a`` preferred over child ``b`` (larger weighted count, ties: smaller token)?"""
    if b < 0:
        return True
    wa = wc[a]
    wb = wc[b]
    return wa > wb or (wa == wb and nd[a, C_TOKEN] < nd[b, C_TOKEN])


@njit(cache=True)
def _recompute_best(nd, wc, p):
    best = -1
    c = nd[p, C_FIRST]
    while c != -1:
        if _better(nd, wc, c, best):
            best = c
        c = nd[c, C_NEXT]
    nd[p, C_BEST] = best


# ----------------------------------------------------------------------------- updates


@njit(cache=True)
def extend(nd, wc, ht, meta, active, seqbuf, seqlen, tokens, weight):
    """Append ``tokens`` to a sequence of current length ``seqlen`` with weight ``weight``.

    Writes the tokens into ``seqbuf[seqlen:]`` and updates ``active``. Stops early (before a
    token) when the node or hash capacity might not suffice for one more token.

    Returns:
        ``>= 0``: number of tokens inserted (the caller grows the arrays and calls again for the
        rest); ``-(i + 1)``: ``tokens[i]`` is out of ``[0, VOCAB_LIMIT)`` (nothing was changed).
    """
    n = tokens.shape[0]
    for i in range(n):
        t = tokens[i]
        if t < 0 or t >= VOCAB_LIMIT:
            return -(i + 1)
    dmax = meta[M_MAXD]
    cap = nd.shape[0]
    half = ht.shape[0] // 2
    need_h = dmax * (HASH_MIN_CHILDREN + 1)
    created = np.empty(dmax + 1, np.int64)
    path = np.empty(dmax + 1, np.int64)
    path[0] = 0
    L = seqlen
    done = 0
    for i in range(n):
        if cap - meta[M_HWM] + meta[M_NFREE] < dmax or meta[M_HENT] + need_h > half:
            break
        t = np.int32(tokens[i])
        nd[0, C_COUNT] += 1
        wc[0] += weight
        top = min(L, dmax - 1)
        ncreated = 0
        shift = meta[M_HSHIFT]
        for d in range(top, -1, -1):
            p = active[d]
            c = _child(nd, ht, shift, p, t)
            if c == -1:
                c = _alloc(nd, wc, ht, meta, p, t)
                shift = meta[M_HSHIFT]
                created[ncreated] = d + 1
                ncreated += 1
            nd[c, C_COUNT] += 1
            wc[c] += weight
            if p != 0:
                b = nd[p, C_BEST]
                if b != c and _better(nd, wc, c, b):
                    nd[p, C_BEST] = c
            path[d + 1] = c
            if d + 1 < dmax:
                active[d + 1] = c
        for j in range(ncreated):
            d1 = created[j]
            nd[path[d1], C_LINK] = path[d1 - 1]
        seqbuf[L] = t
        L += 1
        done += 1
    meta[M_NTOK] += done
    return done


@njit(cache=True)
def remove(nd, wc, ht, meta, tokens, weight):
    """Subtract one sequence (``tokens``, inserted with ``weight``): decrement every suffix node,
    free the nodes whose raw count reaches 0 (deepest first) and repair cached best children."""
    n = tokens.shape[0]
    if n == 0:
        return
    dmax = meta[M_MAXD]
    shift = meta[M_HSHIFT]
    active = np.empty(dmax, np.int64)
    active[0] = 0
    total = 0
    for i in range(n):
        total += min(i, dmax - 1) + 1
    zero = np.empty(total, np.int64)
    dirty = np.empty(total, np.int64)
    nz = 0
    ndirty = 0
    for i in range(n):
        t = tokens[i]
        nd[0, C_COUNT] -= 1
        wc[0] -= weight
        top = min(i, dmax - 1)
        for d in range(top, -1, -1):
            p = active[d]
            c = _child(nd, ht, shift, p, t)
            nd[c, C_COUNT] -= 1
            if nd[c, C_COUNT] == 0:
                wc[c] = 0.0
                zero[nz] = c
                nz += 1
            else:
                wc[c] -= weight
            if p != 0 and nd[p, C_BEST] == c:
                nd[p, C_BEST] = -2
                dirty[ndirty] = p
                ndirty += 1
            if d + 1 < dmax:
                active[d + 1] = c
    if nd[0, C_COUNT] == 0:
        wc[0] = 0.0
    meta[M_NTOK] -= n
    # free the dead nodes, deepest first (a dead node's children are dead too)
    bucket = np.zeros(dmax + 2, np.int64)
    for j in range(nz):
        bucket[nd[zero[j], C_DEPTH]] += 1
    start = np.zeros(dmax + 2, np.int64)
    acc = 0
    for d in range(dmax, 0, -1):
        start[d] = acc
        acc += bucket[d]
    order = np.empty(nz, np.int64)
    for j in range(nz):
        d = nd[zero[j], C_DEPTH]
        order[start[d]] = zero[j]
        start[d] += 1
    for j in range(nz):
        _free(nd, wc, ht, meta, order[j])
    for j in range(ndirty):
        p = dirty[j]
        if nd[p, C_PARENT] != -1 and nd[p, C_BEST] == -2:
            _recompute_best(nd, wc, p)


# ----------------------------------------------------------------------------- queries


@njit(cache=True)
def find(nd, ht, meta, pattern):
    """Node of the string ``pattern`` (root for an empty one), or -1 if absent."""
    shift = meta[M_HSHIFT]
    u = np.int64(0)
    for i in range(pattern.shape[0]):
        t = pattern[i]
        if t < 0 or t >= VOCAB_LIMIT or nd[u, C_DEPTH] >= meta[M_MAXD]:
            return np.int64(-1)
        u = _child(nd, ht, shift, u, t)
        if u == -1:
            return u
    return u


@njit(cache=True)
def children(nd, wc, u):
    """``(tokens int64[k], weighted counts float64[k])`` of the children of node ``u``."""
    k = nd[u, C_NCHILD]
    toks = np.empty(k, np.int64)
    ws = np.empty(k, np.float64)
    c = nd[u, C_FIRST]
    j = 0
    while c != -1:
        toks[j] = nd[c, C_TOKEN]
        ws[j] = wc[c]
        j += 1
        c = nd[c, C_NEXT]
    return toks, ws


@njit(cache=True)
def draft(nd, wc, ht, meta, context, max_tokens, min_prob, factor, min_match, out_tok, out_prob):
    """Match the tail of ``context`` and walk the most-weighted children (see SuffixTree.draft).

    ``out_tok`` / ``out_prob``: scratch of size ``>= 2 * max_tokens``, used as two halves (the
    best draft so far and the current walk). Returns ``(offset, k, score, match_len)``: the best
    draft is ``out_tok[offset:offset + k]`` / ``out_prob[offset:offset + k]``.
    """
    dmax = meta[M_MAXD]
    shift = meta[M_HSHIFT]
    n = context.shape[0]
    w = min(n, dmax - 1)
    # matching statistics over the last w tokens: u = longest suffix of the context that is a
    # node of depth <= dmax - 1 (amortized <= 2 w child look-ups, thanks to suffix links)
    u = np.int64(0)
    for k in range(n - w, n):
        t = context[k]
        if t < 0 or t >= VOCAB_LIMIT:
            u = 0
            continue
        while True:
            if nd[u, C_DEPTH] < dmax - 1:
                c = _child(nd, ht, shift, u, t)
                if c != -1:
                    u = c
                    break
            if u == 0:
                break
            u = nd[u, C_LINK]
    best_off = 0
    cur = max_tokens  # offset of the half the current walk writes into
    best_k = 0
    best_score = 0.0
    best_len = 0
    v = u
    while v != 0 and nd[v, C_DEPTH] >= min_match:
        mlen = nd[v, C_DEPTH]
        limit = min(max_tokens, int(mlen * factor + 1e-9))
        if limit <= best_score:  # every token adds at most 1 to the score
            break
        node = v
        prob = 1.0
        score = 0.0
        k = 0
        while k < limit:
            if nd[node, C_DEPTH] >= dmax:
                node = nd[node, C_LINK]  # re-anchor on the longest suffix that can grow
            b = nd[node, C_BEST]
            if b < 0:
                break
            wn = wc[node]
            wb = wc[b]
            if not wn > 0.0:
                break
            if wb < wn:
                p = prob * (wb / wn)
            else:
                p = prob
            if p < min_prob:
                break
            prob = p
            out_tok[cur + k] = nd[b, C_TOKEN]
            out_prob[cur + k] = p
            score += p
            k += 1
            node = b
        if score > best_score:
            best_score = score
            best_k = k
            best_len = mlen
            best_off, cur = cur, best_off
        v = nd[v, C_LINK]
    return best_off, best_k, best_score, best_len
