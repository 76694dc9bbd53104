"""Numba kernels of :class:`das.suffix_tree.SuffixTree`: a depth-bounded, path-compressed suffix
trie over flat arrays (no Python object per node).

Every kernel takes the tree's arrays as arguments (``njit(cache=True)``, compiled once and cached
on disk; no jitclass, which numba cannot cache).

The trie stores every substring of length ``<= max_depth`` of the stored sequences. A *node* is
the end of an edge whose label is a run of tokens; a string that ends inside an edge has the count
of the node below it. As in arctic-inference's suffix tree (which this follows), each of a
sequence's last ``max_depth`` suffixes ends exactly at a node (its *active locus*); appending a
token moves each active locus one token down, creating, splitting, fusing or sliding a node
boundary, so a token costs ``O(max_depth)`` work and the trie holds about two nodes per stored
token instead of one per distinct substring.

Layout:

* ``nd``: ``int32[cap, NCOL]``, one 64-byte row per node; the columns are the ``C_*`` constants.
  Node 0 is the root (the empty string). A free row has ``C_PARENT == -1`` and is chained into the
  free list through ``C_NEXT``.
* ``wf``: ``float64[cap, 2]``, a view of the last 16 bytes of each node row (one cache line holds
  a node): ``[:, 0]`` the node's weighted count, ``[:, 1]`` the sum of its children's weighted
  counts (the weight of the occurrences that continue past the node).
* ``ht``: ``int64[hcap, 2]`` open-addressing hash table (linear probing, backward-shift deletion,
  power-of-two size, load <= 1/2), ``[key, child]`` per slot, key ``-1`` = empty,
  key = ``parent << TOKEN_BITS | first token of the child's label``. Only the children of
  *hashed* parents are in it: the root, and any node that once had ``HASH_MIN_CHILDREN`` children.
  The children of other nodes are found by walking their (short) sibling list; the cached best
  child is tried first.
* ``sq``: ``int32[scap, S_ACT + max_depth + 1]``, one row per sequence slot: its segment of the
  token pool (``S_BASE``, ``S_LEN``, ``S_CAP``), ``S_STATE`` (0 free, 1 stored, 2 removed but its
  tokens still referenced by node labels) and its active loci ``[S_ACT + d]`` = node where its
  suffix of length ``d`` ends (``d = 0``: root), valid for ``d <= min(len, max_depth)``.
* ``pool``: ``int32[pcap]``, the sequences' tokens; a node's label is
  ``pool[base(seq) + end - label length : base(seq) + end]`` with ``seq, end = nd[u, C_SEQ],
  nd[u, C_IDX]``; the token at string position ``d`` (``depth(parent) <= d < depth(u)``) is
  ``pool[base(seq) + end - (depth(u) - d)]``.
* ``meta``: ``int64[M_LEN]`` scalars (the ``M_*`` constants).

All of them are views of one ``int64`` buffer (``meta`` first, then the others at the offsets
``meta`` records), so a kernel call passes one array: numba's per-argument dispatch cost is most
of a small call's cost.

The small helpers (node, hash and view functions, and ``_step``) are inlined into their callers
at numba's IR level (``inline="always"``): numba does not inline one compiled function into
another otherwise, and a call that passes half a dozen array structs costs more than the few
loads and stores of a leaf extension. Appending tokens for hundreds of requests per engine step
(``add_batch``) runs about a third faster this way.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, types
from numba.extending import intrinsic

TOKEN_BITS = 20
VOCAB_LIMIT = 1 << TOKEN_BITS  # tokens must lie in [0, VOCAB_LIMIT)

# node columns
C_PARENT = 0  # parent node (-1: root or free row)
C_TOKEN = 1  # first token of the node's label (its key in the parent)
C_DEPTH = 2  # string length at the node's end
C_COUNT = 3  # raw occurrence count of the node's string (every string on its edge has it too)
C_FIRST = 4  # first child (-1: none)
C_NEXT = 5  # next sibling (free rows: next free row)
C_PREV = 6  # previous sibling
C_BEST = 7  # child with the largest weighted count, ties: smallest token (-1: no child; root: -1)
C_SEQ = 8  # sequence slot holding an occurrence of the node's string
C_IDX = 9  # index in that sequence just past the label's last token
C_NCHILD = 10  # number of children
C_HASHED = 11  # 1: the children are in the hash table
NCOL = 16  # int32 columns per row: the 12 above, then the row's two float64 counts (``wf``)

# sequence columns
S_BASE = 0
S_LEN = 1
S_CAP = 2
S_STATE = 3
S_ACT = 4

# meta slots
M_HWM = 0  # rows [0, HWM) have been used at least once
M_FREE = 1  # head of the free list (-1: empty)
M_NFREE = 2  # rows on the free list
M_LIVE = 3  # live nodes, root included
M_HENT = 4  # entries in the hash table
M_HSHIFT = 5  # 64 - log2(hcap)
M_NTOK = 6  # tokens of stored sequences
M_MAXD = 7  # max_depth
M_NCAP = 8  # node rows
M_ND = 9  # offset (int64 words) of the node rows in the buffer
M_WF = 10  # (unused: the weighted counts live in the node rows)
M_HCAP = 11  # hash slots (a power of two)
M_HT = 12  # offset of the hash table
M_SCAP = 13  # sequence slots
M_SCOL = 14  # int32 columns per sequence slot (even)
M_SQ = 15  # offset of the sequence table
M_PCAP = 16  # pool tokens (even)
M_POOL = 17  # offset of the pool
M_LEN = 18

HASH_MIN_CHILDREN = 8  # a node with this many children moves them to the hash table
_MULT = np.int64(-7046029254386353131)  # 0x9E3779B97F4A7C15 (Fibonacci hashing)


def node_headroom(max_depth: int) -> int:
    """Free node rows a kernel needs before it inserts one more token."""
    return max_depth + 1


def hash_headroom(max_depth: int) -> int:
    """Free hash entries (below half the table) a kernel needs before it inserts one more token."""
    return (max_depth + 1) * (HASH_MIN_CHILDREN + 1)


# ----------------------------------------------------------------------------- buffer


def layout(max_depth: int, ncap: int, hcap: int, scap: int, pcap: int) -> tuple[np.ndarray, int]:
    """``(meta, words)``: a fresh meta block describing a buffer with these capacities, and the
    buffer's size in int64 words."""
    scol = S_ACT + max_depth + 1
    scol += scol & 1
    pcap += pcap & 1
    meta = np.zeros(M_LEN, np.int64)
    off = M_LEN
    meta[M_NCAP] = ncap
    meta[M_ND] = off
    meta[M_WF] = off
    off += ncap * NCOL // 2
    meta[M_HCAP] = hcap
    meta[M_HT] = off
    off += 2 * hcap
    meta[M_SCAP] = scap
    meta[M_SCOL] = scol
    meta[M_SQ] = off
    off += scap * scol // 2
    meta[M_PCAP] = pcap
    meta[M_POOL] = off
    off += pcap // 2
    meta[M_MAXD] = max_depth
    meta[M_HSHIFT] = 64 - (hcap.bit_length() - 1)
    return meta, off


def views(mem: np.ndarray):
    """``(meta, nd, wf, ht, sq, pool)`` views of a tree buffer (Python side)."""
    meta = mem[:M_LEN]
    ncap, hcap, scap, scol, pcap = (int(meta[M_NCAP]), int(meta[M_HCAP]), int(meta[M_SCAP]), int(meta[M_SCOL]),
                                    int(meta[M_PCAP]))
    o = int(meta[M_ND])
    rows = mem[o : o + ncap * NCOL // 2]
    nd = rows.view(np.int32).reshape(ncap, NCOL)
    wf = rows.view(np.float64).reshape(ncap, NCOL // 2)[:, NCOL // 2 - 2 :]
    o = int(meta[M_HT])
    ht = mem[o : o + 2 * hcap].reshape(hcap, 2)
    o = int(meta[M_SQ])
    sq = mem[o : o + scap * scol // 2].view(np.int32).reshape(scap, scol)
    o = int(meta[M_POOL])
    pool = mem[o : o + pcap // 2].view(np.int32)
    return meta, nd, wf, ht, sq, pool


def _pointer_to(nbtype):
    """An intrinsic ``f(mem, offset)``: the address of the int64 word ``mem[offset]`` as a pointer to
    ``nbtype`` (for :func:`numba.carray`)."""

    @intrinsic
    def pointer(typingctx, arr, offset):
        sig = types.CPointer(nbtype)(arr, offset)

        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            p = builder.gep(ary.data, [args[1]])
            return builder.bitcast(p, context.get_value_type(types.CPointer(nbtype)))

        return sig, codegen

    return pointer


_ptr_i32 = _pointer_to(types.int32)
_ptr_i64 = _pointer_to(types.int64)
_ptr_f64 = _pointer_to(types.float64)


@njit(cache=True, inline="always")
def _views(mem):
    """:func:`views` inside kernels. The views are borrowed (``numba.carray`` over ``mem``'s
    memory, no reference count): building them costs about a nanosecond instead of ~170 ns for
    slices, reshapes and dtype views, which matters when a call visits hundreds of trees. They
    are valid while ``mem`` is (a kernel argument, or an item of one, always is) and must never
    be returned to Python."""
    meta = carray(_ptr_i64(mem, 0), (M_LEN,))
    ncap = meta[M_NCAP]
    o = meta[M_ND]
    nd = carray(_ptr_i32(mem, o), (ncap, NCOL))
    wf = carray(_ptr_f64(mem, o), (ncap, NCOL // 2))[:, NCOL // 2 - 2 :]
    ht = carray(_ptr_i64(mem, meta[M_HT]), (meta[M_HCAP], 2))
    sq = carray(_ptr_i32(mem, meta[M_SQ]), (meta[M_SCAP], meta[M_SCOL]))
    pool = carray(_ptr_i32(mem, meta[M_POOL]), (meta[M_PCAP],))
    return meta, nd, wf, ht, sq, pool


# ----------------------------------------------------------------------------- hash table


@njit(cache=True, inline="always")
def _slot(key, shift, mask):
    return ((key * _MULT) >> shift) & mask


@njit(cache=True, inline="always")
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


@njit(cache=True, inline="always")
def _hash_insert(ht, shift, key, val):
    mask = ht.shape[0] - 1
    i = _slot(key, shift, mask)
    while ht[i, 0] != -1:
        i = (i + 1) & mask
    ht[i, 0] = key
    ht[i, 1] = val


@njit(cache=True, inline="always")
def _hash_set(ht, shift, key, val):
    """Change the value of an existing key."""
    mask = ht.shape[0] - 1
    i = _slot(key, shift, mask)
    while ht[i, 0] != key:
        i = (i + 1) & mask
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


@njit(cache=True, inline="always")
def _key(parent, token):
    return (np.int64(parent) << TOKEN_BITS) | np.int64(token)


@njit(cache=True)
def rehash(mem):
    """Insert the children of every hashed live node into the (empty) hash table; returns entries."""
    meta, nd, wf, ht, sq, pool = _views(mem)
    shift = meta[M_HSHIFT]
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


@njit(cache=True, inline="always")
def _child(nd, ht, shift, p, t):
    """Child of node ``p`` whose label starts with token ``t``, or -1."""
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


@njit(cache=True, inline="always")
def _new_row(nd, wf, meta):
    f = meta[M_FREE]
    if f != -1:
        c = f
        meta[M_FREE] = nd[f, C_NEXT]
        meta[M_NFREE] -= 1
    else:
        c = meta[M_HWM]
        meta[M_HWM] += 1
    nd[c, C_FIRST] = -1
    nd[c, C_NEXT] = -1
    nd[c, C_PREV] = -1
    nd[c, C_BEST] = -1
    nd[c, C_NCHILD] = 0
    nd[c, C_HASHED] = 0
    wf[c, 0] = 0.0
    wf[c, 1] = 0.0
    meta[M_LIVE] += 1
    return c


@njit(cache=True, inline="always")
def _release_row(nd, wf, meta, c):
    nd[c, C_PARENT] = -1
    nd[c, C_TOKEN] = -1
    nd[c, C_COUNT] = 0
    nd[c, C_FIRST] = -1
    nd[c, C_PREV] = -1
    nd[c, C_BEST] = -1
    nd[c, C_NCHILD] = 0
    nd[c, C_HASHED] = 0
    wf[c, 0] = 0.0
    wf[c, 1] = 0.0
    nd[c, C_NEXT] = meta[M_FREE]
    meta[M_FREE] = c
    meta[M_NFREE] += 1
    meta[M_LIVE] -= 1


@njit(cache=True, inline="always")
def _link(nd, ht, meta, p, c):
    """Make ``c`` (its ``C_TOKEN`` set) a child of ``p``: sibling list, count, hash."""
    nd[c, C_PARENT] = p
    old = nd[p, C_FIRST]
    nd[c, C_NEXT] = old
    nd[c, C_PREV] = -1
    if old != -1:
        nd[old, C_PREV] = c
    nd[p, C_FIRST] = c
    nd[p, C_NCHILD] += 1
    shift = meta[M_HSHIFT]
    if nd[p, C_HASHED] == 1:
        _hash_insert(ht, shift, _key(p, nd[c, C_TOKEN]), c)
        meta[M_HENT] += 1
    elif nd[p, C_NCHILD] >= HASH_MIN_CHILDREN:
        nd[p, C_HASHED] = 1
        x = nd[p, C_FIRST]
        while x != -1:
            _hash_insert(ht, shift, _key(p, nd[x, C_TOKEN]), x)
            meta[M_HENT] += 1
            x = nd[x, C_NEXT]


@njit(cache=True, inline="always")
def _unlink(nd, ht, meta, p, c):
    """Remove child ``c`` from ``p``'s sibling list and hash (``c``'s row is left as is)."""
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
        nd[p, C_BEST] = -2  # dirty: the caller recomputes it


@njit(cache=True, inline="always")
def _replace(nd, ht, meta, p, old, new):
    """Put ``new`` in ``old``'s place among ``p``'s children (same first token, same position)."""
    prv = nd[old, C_PREV]
    nxt = nd[old, C_NEXT]
    nd[new, C_PREV] = prv
    nd[new, C_NEXT] = nxt
    if prv == -1:
        nd[p, C_FIRST] = new
    else:
        nd[prv, C_NEXT] = new
    if nxt != -1:
        nd[nxt, C_PREV] = new
    nd[new, C_PARENT] = p
    if nd[p, C_HASHED] == 1:
        _hash_set(ht, meta[M_HSHIFT], _key(p, nd[old, C_TOKEN]), new)
    if nd[p, C_BEST] == old:
        nd[p, C_BEST] = new


@njit(cache=True, inline="always")
def _rekey(nd, ht, meta, p, c, t):
    """Change the first token of child ``c`` of ``p`` to ``t`` (its key in ``p``'s hash)."""
    if nd[c, C_TOKEN] == t:
        return
    if nd[p, C_HASHED] == 1:
        shift = meta[M_HSHIFT]
        _hash_delete(ht, shift, _key(p, nd[c, C_TOKEN]))
        _hash_insert(ht, shift, _key(p, t), c)
    nd[c, C_TOKEN] = t


@njit(cache=True, inline="always")
def _better(nd, wf, a, b):
    """Is child ``a`` preferred over child ``b`` (larger weighted count, ties: smaller token)?"""
    if b < 0:
        return True
    wa = wf[a, 0]
    wb = wf[b, 0]
    return wa > wb or (wa == wb and nd[a, C_TOKEN] < nd[b, C_TOKEN])


@njit(cache=True)
def _recompute_best(nd, wf, p):
    best = -1
    c = nd[p, C_FIRST]
    while c != -1:
        if _better(nd, wf, c, best):
            best = c
        c = nd[c, C_NEXT]
    nd[p, C_BEST] = best


@njit(cache=True, inline="always")
def _bump(nd, wf, p, c):
    """``c``'s weighted count grew: update ``p``'s cached best child."""
    if p != 0:
        b = nd[p, C_BEST]
        if b != c and _better(nd, wf, c, b):
            nd[p, C_BEST] = c


# ----------------------------------------------------------------------------- updates


@njit(cache=True, inline="always")
def _step(nd, wf, ht, meta, sq, pool, s, node, t, L, w):
    """Move the active locus ``node`` of sequence ``s`` (whose new length is ``L``, last token
    ``t``) one token down; returns the new locus. Cases as arctic-inference's ``append``."""
    if node != 0 and nd[node, C_COUNT] == 1:
        # 1a: a leaf only this suffix reaches (a locus of one occurrence, at the end of s, has
        # no child): lengthen its label (now read from s). Most steps are this one.
        nd[node, C_DEPTH] += 1
        nd[node, C_SEQ] = s
        nd[node, C_IDX] = L
        return node
    shift = meta[M_HSHIFT]
    child = _child(nd, ht, shift, node, t)
    if child == -1:
        # 1b: a new leaf
        c = _new_row(nd, wf, meta)
        nd[c, C_TOKEN] = t
        nd[c, C_DEPTH] = nd[node, C_DEPTH] + 1
        nd[c, C_COUNT] = 1
        nd[c, C_SEQ] = s
        nd[c, C_IDX] = L
        wf[c, 0] = w
        _link(nd, ht, meta, node, c)
        wf[node, 1] += w
        _bump(nd, wf, node, c)
        return c
    elen = nd[child, C_DEPTH] - nd[node, C_DEPTH]
    if node != 0 and nd[node, C_COUNT] == nd[child, C_COUNT] + 1:
        # 2: this suffix is the only one that ends at node; all the others go on into child
        p = nd[node, C_PARENT]
        if elen == 1:
            # 2a: fuse node into child
            nd[child, C_COUNT] += 1
            wf[child, 0] = wf[node, 0]
            nd[child, C_SEQ] = s
            nd[child, C_IDX] = L
            _unlink(nd, ht, meta, node, child)
            nd[child, C_TOKEN] = nd[node, C_TOKEN]
            _replace(nd, ht, meta, p, node, child)
            _release_row(nd, wf, meta, node)
            return child
        # 2b: slide node's boundary one token into child's label
        nd[node, C_DEPTH] += 1
        nd[node, C_SEQ] = s
        nd[node, C_IDX] = L
        _rekey(nd, ht, meta, node, child, _label_at(nd, sq, pool, child, nd[node, C_DEPTH]))
        return node
    if elen == 1:
        # 3a: step into child
        nd[child, C_COUNT] += 1
        wf[child, 0] += w
        wf[node, 1] += w
        _bump(nd, wf, node, child)
        return child
    # 3b: split child's edge after its first token
    m = _new_row(nd, wf, meta)
    nd[m, C_TOKEN] = t
    nd[m, C_DEPTH] = nd[node, C_DEPTH] + 1
    nd[m, C_COUNT] = nd[child, C_COUNT] + 1
    nd[m, C_SEQ] = s
    nd[m, C_IDX] = L
    wf[m, 0] = wf[child, 0] + w
    wf[m, 1] = wf[child, 0]
    _replace(nd, ht, meta, node, child, m)
    nd[child, C_TOKEN] = _label_at(nd, sq, pool, child, nd[m, C_DEPTH])
    nd[child, C_PARENT] = m
    nd[child, C_NEXT] = -1
    nd[child, C_PREV] = -1
    nd[m, C_FIRST] = child
    nd[m, C_NCHILD] = 1
    nd[m, C_BEST] = child
    wf[node, 1] += w
    _bump(nd, wf, node, m)
    return m


@njit(cache=True)
def extend(mem, s, tokens, w):
    """Append ``tokens`` to sequence slot ``s`` (weight ``w``).

    Stops early (before a token) when the node, hash or pool-segment capacity might not suffice
    for one more token.

    Returns:
        ``>= 0``: number of tokens inserted (the caller grows the arrays and calls again for the
        rest); ``-(i + 1)``: ``tokens[i]`` is out of ``[0, VOCAB_LIMIT)`` (nothing was changed).
    """
    n = tokens.shape[0]
    for i in range(n):
        t = tokens[i]
        if t < 0 or t >= VOCAB_LIMIT:
            return -(i + 1)
    meta, nd, wf, ht, sq, pool = _views(mem)
    return _extend(nd, wf, ht, meta, sq, pool, s, tokens, w)


@njit(cache=True)
def _extend(nd, wf, ht, meta, sq, pool, s, tokens, w):
    n = tokens.shape[0]
    D = meta[M_MAXD]
    cap = nd.shape[0]
    half = ht.shape[0] // 2
    need_n = D + 1
    need_h = (D + 1) * (HASH_MIN_CHILDREN + 1)
    base = sq[s, S_BASE]
    scap = sq[s, S_CAP]
    done = 0
    for i in range(n):
        if cap - meta[M_HWM] + meta[M_NFREE] < need_n or meta[M_HENT] + need_h > half or sq[s, S_LEN] >= scap:
            break
        t = np.int32(tokens[i])
        L0 = sq[s, S_LEN]
        pool[base + L0] = t
        L = L0 + 1
        sq[s, S_LEN] = L
        nd[0, C_COUNT] += 1
        wf[0, 0] += w
        top = min(L0, D - 1)
        for d in range(top, -1, -1):
            sq[s, S_ACT + d + 1] = _step(nd, wf, ht, meta, sq, pool, s, sq[s, S_ACT + d], t, L, w)
        done += 1
    meta[M_NTOK] += done
    return done


@njit(cache=True)
def remove(mem, s, w):
    """Subtract sequence slot ``s`` (inserted with weight ``w``): walk each of its suffixes,
    decrement every node on the way, free the subtrees only it reached, merge a node into its only
    child where no suffix ends at it any more, and repair cached best children.

    The sequence's tokens stay in the pool (node labels may still point into them); the caller
    marks the slot as removed."""
    meta, nd, wf, ht, sq, pool = _views(mem)
    n = sq[s, S_LEN]
    if n == 0:
        return True
    D = meta[M_MAXD]
    shift = meta[M_HSHIFT]
    base = sq[s, S_BASE]
    dirty = np.empty(n * (D + 1) + 1, np.int64)
    ndirty = 0
    ok = True
    for start in range(n):
        nd[0, C_COUNT] -= 1
        wf[0, 0] -= w
        node = np.int64(0)
        idx = start
        end = min(n, start + D)
        while idx < end:
            t = pool[base + idx]
            c = _child(nd, ht, shift, node, t)
            if c == -1:
                ok = False
                break
            if nd[c, C_COUNT] > 1:
                nd[c, C_COUNT] -= 1
                wf[c, 0] -= w
                wf[node, 1] -= w
                if node != 0 and nd[node, C_BEST] == c:
                    nd[node, C_BEST] = -2
                    dirty[ndirty] = node
                    ndirty += 1
            else:
                wf[node, 1] -= wf[c, 0]
                _unlink(nd, ht, meta, node, c)
                if node != 0 and nd[node, C_BEST] == -2:
                    dirty[ndirty] = node
                    ndirty += 1
                # only this suffix reached c: c and its descendants form one chain; free it
                u = c
                while u != -1:
                    x = nd[u, C_FIRST]
                    if x != -1 and nd[u, C_HASHED] == 1:
                        _hash_delete(ht, shift, _key(u, nd[x, C_TOKEN]))
                        meta[M_HENT] -= 1
                    _release_row(nd, wf, meta, u)
                    u = x
                break
            idx += nd[c, C_DEPTH] - nd[node, C_DEPTH]
            node = c
        # merge node into its only child if no suffix ends at node any more
        if node != 0 and nd[node, C_NCHILD] == 1:
            k = nd[node, C_FIRST]
            if nd[node, C_COUNT] == nd[k, C_COUNT]:
                p = nd[node, C_PARENT]
                wf[k, 0] = wf[node, 0]
                _unlink(nd, ht, meta, node, k)
                nd[k, C_TOKEN] = nd[node, C_TOKEN]
                _replace(nd, ht, meta, p, node, k)
                _release_row(nd, wf, meta, node)
    if nd[0, C_COUNT] == 0:
        wf[0, 0] = 0.0
        wf[0, 1] = 0.0
    meta[M_NTOK] -= n
    for j in range(ndirty):
        p = dirty[j]
        if nd[p, C_PARENT] != -1 and nd[p, C_BEST] == -2:
            _recompute_best(nd, wf, p)
    return ok


# ----------------------------------------------------------------------------- queries


@njit(cache=True, inline="always")
def _label_at(nd, sq, pool, u, d):
    """The token at string position ``d`` on the edge into ``u`` (``depth(parent) <= d < depth(u)``)."""
    return pool[sq[nd[u, C_SEQ], S_BASE] + nd[u, C_IDX] - (nd[u, C_DEPTH] - d)]


@njit(cache=True)
def _descend(nd, ht, meta, sq, pool, pattern, lo, hi):
    """Locus of ``pattern[lo:hi]``: ``(node, depth)`` with the string ending at ``depth`` on the
    edge into ``node`` (``depth == node's depth``: at the node); ``(-1, 0)`` if absent."""
    shift = meta[M_HSHIFT]
    u = np.int64(0)
    d = 0
    k = lo
    while k < hi:
        t = pattern[k]
        if t < 0 or t >= VOCAB_LIMIT:
            return np.int64(-1), 0
        c = _child(nd, ht, shift, u, t)
        if c == -1:
            return np.int64(-1), 0
        pd = nd[u, C_DEPTH]
        cd = nd[c, C_DEPTH]
        lb = sq[nd[c, C_SEQ], S_BASE] + nd[c, C_IDX] - (cd - pd)
        j = 1
        k += 1
        while j < cd - pd and k < hi:
            if pool[lb + j] != pattern[k]:
                return np.int64(-1), 0
            j += 1
            k += 1
        u = c
        d = pd + j
    return u, d


@njit(cache=True)
def find(mem, pattern):
    """``(node, depth)`` locus of the string ``pattern`` (``(0, 0)`` for an empty one), or
    ``(-1, 0)`` if absent or longer than max_depth."""
    meta, nd, wf, ht, sq, pool = _views(mem)
    if pattern.shape[0] > meta[M_MAXD]:
        return np.int64(-1), 0
    return _descend(nd, ht, meta, sq, pool, pattern, 0, pattern.shape[0])


@njit(cache=True)
def children(mem, u, d):
    """``(tokens int64[k], weighted counts float64[k])`` of the continuations of locus ``(u, d)``."""
    meta, nd, wf, ht, sq, pool = _views(mem)
    if d < nd[u, C_DEPTH]:
        toks = np.empty(1, np.int64)
        ws = np.empty(1, np.float64)
        toks[0] = _label_at(nd, sq, pool, u, d)
        ws[0] = wf[u, 0]
        return toks, ws
    k = nd[u, C_NCHILD]
    toks = np.empty(k, np.int64)
    ws = np.empty(k, np.float64)
    c = nd[u, C_FIRST]
    j = 0
    while c != -1:
        toks[j] = nd[c, C_TOKEN]
        ws[j] = wf[c, 0]
        j += 1
        c = nd[c, C_NEXT]
    return toks, ws


@njit(cache=True)
def _walk(nd, wf, ht, meta, sq, pool, u, d, limit, min_prob, prior, scratch, nscr, out_tok, out_prob, off, floor=0.0):
    """Greedy walk from locus ``(u, d)``: most-weighted child at nodes (probability
    ``wc(child) / (sum of the children's wc + prior)``), the label inside edges (probability 1);
    re-anchors on the last ``max_depth - 1`` tokens (``scratch[:nscr]`` holds the context tail,
    the walk appends to it) when it reaches depth ``max_depth``. Writes ``out_*[off:off + k]``;
    returns ``(k, score)``.

    ``floor > 0``: the caller only wants a walk scoring above ``floor``; the walk gives up, and
    returns ``(0, 0.0)``, as soon as it cannot get there (path probabilities never increase, so
    ``score + prob * (limit - k)`` bounds its final score; 1e-9 relative margin for rounding)."""
    D = meta[M_MAXD]
    prob = 1.0
    score = 0.0
    k = 0
    while k < limit:
        if d < nd[u, C_DEPTH]:
            t = _label_at(nd, sq, pool, u, d)
            if prior > 0.0:  # the only continuation inside an edge: count(u) / (count(u) + prior)
                wb = wf[u, 0]
                p = prob * (wb / (wb + prior))
                if p < min_prob:
                    break
                prob = p
            d += 1
        else:
            if d >= D:
                u, d = _descend(nd, ht, meta, sq, pool, scratch, nscr - (D - 1), nscr)
                if u < 0:
                    break
                continue
            b = nd[u, C_BEST]
            if b < 0:
                break
            wn = wf[u, 1]
            wb = wf[b, 0]
            if not wn > 0.0:
                break
            wn += prior
            p = prob * (wb / wn) if wb < wn else prob
            if p < min_prob:
                break
            prob = p
            t = nd[b, C_TOKEN]
            u = b
            d += 1
        if floor > 0.0 and (score + prob * (limit - k)) * (1.0 + 1e-9) <= floor:
            return 0, 0.0
        out_tok[off + k] = t
        out_prob[off + k] = prob
        score += prob
        scratch[nscr] = t
        nscr += 1
        k += 1
    return k, score


@njit(cache=True)
def _best_of(nd, wf, ht, meta, sq, pool, loci_u, loci_d, nloci, scratch, nscr, max_tokens, min_prob, factor, min_match,
             prior, out_tok, out_prob, floor=0.0):
    """Walk from each locus (``loci_*[L]``: the context suffix of length ``L``; longest first) and
    keep the best score (ties: the longer match). Returns ``(offset, k, score, match_len)``.

    ``floor``: only walks scoring above it count (the caller has a draft that good already);
    when none does, returns ``k == 0`` and ``score == floor``. The walk returned otherwise is the
    one returned without a floor: the first walk (longest match) reaching the best score.

    Walks that cannot win are skipped, which changes no result: a walk's path probabilities never
    increase (each step multiplies by a ratio <= 1, which cannot round up), so its score is at
    most ``limit * p1`` (``p1``: its first token's probability, computed from the locus exactly
    as :func:`_walk` does; a 1e-9 relative margin covers the rounding of the score's sum), and
    a walk wins only with a score above the best so far."""
    D = meta[M_MAXD]
    best_off = 0
    cur = max_tokens
    best_k = 0
    best_score = floor
    best_len = 0
    for L in range(nloci, min_match - 1, -1):
        if L < 1:
            break
        u = loci_u[L]
        if u < 0:
            continue
        limit = min(max_tokens, int(L * factor + 1e-9))
        if limit <= best_score:  # every token adds at most 1 to the score
            break
        d0 = loci_d[L]
        if d0 == nd[u, C_DEPTH] and d0 < D:  # at a node: the first step as _walk takes it
            b = nd[u, C_BEST]
            if b < 0:
                continue
            wn = wf[u, 1]
            if not wn > 0.0:
                continue
            wn += prior
            wb = wf[b, 0]
            p1 = wb / wn if wb < wn else 1.0
            if p1 < min_prob or limit * p1 * (1.0 + 1e-9) <= best_score:
                continue
        k, score = _walk(nd, wf, ht, meta, sq, pool, u, loci_d[L], limit, min_prob, prior, scratch, nscr,
                         out_tok, out_prob, cur, best_score)
        if score > best_score:
            best_score = score
            best_k = k
            best_len = L
            best_off, cur = cur, best_off
    return best_off, best_k, best_score, best_len


@njit(cache=True)
def draft(mem, context, max_tokens, min_prob, factor, min_match, prior, out_tok, out_prob):
    """Match every suffix of ``context`` (up to ``max_depth - 1`` tokens) and keep the best
    greedy walk (see SuffixTree.draft). ``out_tok`` / ``out_prob``: scratch of size
    ``>= 2 * max_tokens``. Returns ``(offset, k, score, match_len)``."""
    meta, nd, wf, ht, sq, pool = _views(mem)
    D = meta[M_MAXD]
    n = context.shape[0]
    w = min(n, D - 1)
    loci_u = np.full(w + 1, -1, np.int64)
    loci_d = np.zeros(w + 1, np.int64)
    m = 0
    for L in range(1, w + 1):
        u, d = _descend(nd, ht, meta, sq, pool, context, n - L, n)
        if u < 0:
            break
        loci_u[L] = u
        loci_d[L] = d
        m = L
    scratch = np.empty(w + max_tokens + 1, np.int32)
    for i in range(w):
        scratch[i] = context[n - w + i]
    return _best_of(nd, wf, ht, meta, sq, pool, loci_u, loci_d, m, scratch, w, max_tokens, min_prob, factor, min_match,
                    prior, out_tok, out_prob)


@njit(cache=True)
def draft_seq(mem, s, max_tokens, min_prob, factor, min_match, prior, out_tok, out_prob):
    """:func:`draft` for the context = sequence slot ``s``'s own tokens, anchored on its active
    loci (no matching needed). Returns ``(offset, k, score, match_len)``."""
    meta, nd, wf, ht, sq, pool = _views(mem)
    return _draft_seq(nd, wf, ht, meta, sq, pool, s, max_tokens, min_prob, factor, min_match, prior, out_tok, out_prob)


@njit(cache=True)
def _draft_seq(nd, wf, ht, meta, sq, pool, s, max_tokens, min_prob, factor, min_match, prior, out_tok, out_prob):
    D = meta[M_MAXD]
    return _draft_seq_in(nd, wf, ht, meta, sq, pool, s, max_tokens, min_prob, factor, min_match, prior, out_tok,
                         out_prob, np.empty(D + 1, np.int64), np.empty(D + 1, np.int64),
                         np.empty(D + max_tokens + 1, np.int32))


@njit(cache=True)
def _draft_seq_in(nd, wf, ht, meta, sq, pool, s, max_tokens, min_prob, factor, min_match, prior, out_tok, out_prob,
                  loci_u, loci_d, scratch, floor=0.0):
    """:func:`_draft_seq` with caller-provided scratch: ``loci_u``, ``loci_d`` of ``>= max_depth + 1``
    and ``scratch`` of ``>= max_depth + max_tokens + 1`` entries; ``floor`` as :func:`_best_of`."""
    D = meta[M_MAXD]
    n = sq[s, S_LEN]
    w = min(n, D - 1)
    for L in range(w + 1):
        loci_u[L] = sq[s, S_ACT + L]
        loci_d[L] = L  # an active locus ends exactly at a node of depth L (no need to read it)
    base = sq[s, S_BASE] + n - w
    for i in range(w):
        scratch[i] = pool[base + i]
    return _best_of(nd, wf, ht, meta, sq, pool, loci_u, loci_d, w, scratch, w, max_tokens, min_prob, factor, min_match,
                    prior, out_tok, out_prob, floor)


# ----------------------------------------------------------------------------- two trees at once


@njit(cache=True)
def extend2(mem_a, s_a, w_a, mem_b, s_b, w_b, tokens):
    """Append ``tokens`` to slot ``s_a`` of tree ``a`` and slot ``s_b`` of tree ``b`` (a negative
    slot skips that tree) in one call. Returns ``(done_a, done_b)`` as :func:`extend` does."""
    n = tokens.shape[0]
    for i in range(n):
        t = tokens[i]
        if t < 0 or t >= VOCAB_LIMIT:
            return -(i + 1), -(i + 1)
    da = n
    db = n
    if s_a >= 0:
        meta, nd, wf, ht, sq, pool = _views(mem_a)
        da = _extend(nd, wf, ht, meta, sq, pool, s_a, tokens, w_a)
    if s_b >= 0:
        meta, nd, wf, ht, sq, pool = _views(mem_b)
        db = _extend(nd, wf, ht, meta, sq, pool, s_b, tokens, w_b)
    return da, db


@njit(cache=True)
def draft2(mem_a, s_a, prior_a, mem_b, s_b, prior_b, max_tokens, min_prob, factor, out_tok, out_prob):
    """:func:`draft_seq` from slot ``s_a`` of tree ``a`` and slot ``s_b`` of tree ``b`` (a
    negative slot skips that tree); the higher score wins, ties go to ``a``. ``out_*`` need
    ``4 * max_tokens``. Returns ``(offset, k, score, match_len)``."""
    D = max(mem_a[M_MAXD], mem_b[M_MAXD])
    return _draft2_in(mem_a, s_a, prior_a, mem_b, s_b, prior_b, max_tokens, min_prob, factor, out_tok, out_prob,
                      np.empty(D + 1, np.int64), np.empty(D + 1, np.int64), np.empty(D + max_tokens + 1, np.int32))


@njit(cache=True)
def _draft2_in(mem_a, s_a, prior_a, mem_b, s_b, prior_b, max_tokens, min_prob, factor, out_tok, out_prob, loci_u,
               loci_d, scratch):
    """:func:`draft2` with caller-provided scratch (see :func:`_draft_seq_in`). Tree ``b`` drafts
    with tree ``a``'s score as its floor: only a better draft can win, so no other is looked for."""
    off = 0
    k = 0
    score = 0.0
    mlen = 0
    if s_a >= 0:
        meta, nd, wf, ht, sq, pool = _views(mem_a)
        off, k, score, mlen = _draft_seq_in(nd, wf, ht, meta, sq, pool, s_a, max_tokens, min_prob, factor, 1, prior_a,
                                            out_tok, out_prob, loci_u, loci_d, scratch)
    if s_b >= 0:
        meta, nd, wf, ht, sq, pool = _views(mem_b)
        ob, kb, sb, mb = _draft_seq_in(nd, wf, ht, meta, sq, pool, s_b, max_tokens, min_prob, factor, 1, prior_b,
                                       out_tok[2 * max_tokens :], out_prob[2 * max_tokens :], loci_u, loci_d, scratch,
                                       score)
        if kb > 0 and sb > score:
            return ob + 2 * max_tokens, kb, sb, mb
    return off, k, score, mlen


# ----------------------------------------------------------------------------- many requests at once
#
# A drafter's requests each draft from (and append to) up to two trees: their problem's tree and
# their own request tree. The batch kernels loop over the rows of an engine step in one call; they
# find the trees through a table of tree buffers (``trees``: a numba typed List of the trees'
# int64 buffers, indexed by tree index) and a per-request state table:
#
# * ``ri``: ``int64[handles, R_COLS]``, per request handle: ``R_PT`` problem tree index (-1: none),
#   ``R_PS`` its sequence slot there, ``R_RT`` request tree index (-1: none), ``R_RS`` its slot
#   there, ``R_N`` tokens (prompt + output) appended so far;
# * ``rw``: ``float64[handles]``, the weight of the request's sequence in its problem tree;
# * ``tprior``: ``float64[tree indices]``, the prior of a problem tree (in its weight units).

R_PT = 0
R_PS = 1
R_RT = 2
R_RS = 3
R_N = 4
R_COLS = 5

# check_batch error codes (with the row and, for 4, the column of the bad value)
E_START = 1  # starts[r] < 0
E_ORDER = 2  # ends[r] < starts[r]
E_END = 3  # ends[r] > width of the token array
E_TOKEN = 4  # tokens[r, c] out of [0, VOCAB_LIMIT)


@njit(cache=True)
def check_batch(tokens, starts, ends):
    """Validate the rows of an :func:`add_batch` call before anything is changed.

    Returns ``(code, row, col)``: ``(0, -1, -1)`` when every row is valid, else the first problem
    found, in row order: one of the ``E_*`` codes with its row (and, for ``E_TOKEN``, the column
    of the out-of-range token)."""
    width = tokens.shape[1]
    for r in range(starts.shape[0]):
        a = starts[r]
        b = ends[r]
        if a < 0:
            return E_START, r, -1
        if b < a:
            return E_ORDER, r, -1
        if b > width:
            return E_END, r, -1
        for c in range(a, b):
            t = tokens[r, c]
            if t < 0 or t >= VOCAB_LIMIT:
                return E_TOKEN, r, c
    return 0, -1, -1


@njit(cache=True)
def add_batch(trees, ri, rw, handles, tokens, starts, ends, row0):
    """Append ``tokens[r, starts[r]:ends[r]]`` to request ``handles[r]``'s trees (problem tree with
    weight ``rw[h]``, then request tree with weight 1), for rows ``r >= row0`` in order, and add
    the count to ``ri[h, R_N]``. The rows must have passed :func:`check_batch`.

    Returns ``(row, part, done)``: ``(-1, 0, 0)`` when every row is in, else the first row whose
    tree ran short of capacity (``part`` 0: its problem tree, 1: its request tree) and how many of
    the row's tokens that tree took; the caller grows that tree, inserts the rest of the row (for
    ``part`` 0 also into the request tree) and calls again from ``row + 1``."""
    for r in range(row0, handles.shape[0]):
        a = starts[r]
        n = ends[r] - a
        if n <= 0:
            continue
        h = handles[r]
        seg = tokens[r, a : a + n]
        ri[h, R_N] += n
        pt = ri[h, R_PT]
        if pt >= 0:
            meta, nd, wf, ht, sq, pool = _views(trees[pt])
            d = _extend(nd, wf, ht, meta, sq, pool, ri[h, R_PS], seg, rw[h])
            if d < n:
                return r, 0, d
        rt = ri[h, R_RT]
        if rt >= 0:
            meta, nd, wf, ht, sq, pool = _views(trees[rt])
            d = _extend(nd, wf, ht, meta, sq, pool, ri[h, R_RS], seg, 1.0)
            if d < n:
                return r, 1, d
    return -1, 0, 0


@njit(cache=True)
def draft_batch(trees, ri, tprior, req_prior, handles, budgets, min_prob, factor, max_depth, out_tok, out_prob,
                out_len):
    """:func:`draft2` for every row: request ``handles[r]`` drafts up to ``budgets[r]`` tokens
    (``<= out_tok.shape[1]``) from its problem tree (prior ``tprior[tree]``) and its request tree
    (prior ``req_prior``), the higher score wins (ties: the problem tree). Writes the draft to
    ``out_tok[r, :k]`` / ``out_prob[r, :k]`` (the rest of the row: -1 / 0.0) and ``k`` to
    ``out_len[r]``. ``max_depth``: the trees' (the largest, if they differ)."""
    width = out_tok.shape[1]
    st = np.empty(4 * width + 4, np.int32)
    sp = np.empty(4 * width + 4, np.float32)
    D = max_depth
    lu = np.empty(D + 1, np.int64)
    ld = np.empty(D + 1, np.int64)
    scr = np.empty(D + width + 1, np.int32)
    for r in range(handles.shape[0]):
        m = budgets[r]
        k = 0
        if m > 0:
            h = handles[r]
            pt = ri[h, R_PT]
            rt = ri[h, R_RT]
            if pt >= 0 or rt >= 0:
                if pt >= 0:
                    ma = trees[pt]
                    sa = ri[h, R_PS]
                    pa = tprior[pt]
                else:
                    ma = trees[rt]
                    sa = -1
                    pa = 0.0
                if rt >= 0:
                    mb = trees[rt]
                    sb = ri[h, R_RS]
                else:
                    mb = ma
                    sb = -1
                off, k, score, mlen = _draft2_in(ma, sa, pa, mb, sb, req_prior, m, min_prob, factor, st, sp, lu, ld,
                                                 scr)
                for j in range(k):
                    out_tok[r, j] = st[off + j]
                    out_prob[r, j] = sp[off + j]
        out_len[r] = k
        for j in range(k, width):
            out_tok[r, j] = -1
            out_prob[r, j] = 0.0
