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

* ``nodes``: ``int32[cap, NCOL]``, one 64-byte row per node, aligned to a cache line (a buffer from
  :func:`new_buffer`); the columns are the ``C_*`` constants.
  Node 0 is the root (the empty string). A free row has ``C_PARENT == -1`` and is chained into the
  free list through ``C_NEXT``.
* ``weights``: ``float64[cap, 2]``, a view of the last 16 bytes of each node row (one cache line
  holds a node): ``[:, 0]`` the node's weighted count, ``[:, 1]`` the sum of its children's
  weighted counts (the weight of the occurrences that continue past the node).
* ``hash_table``: ``int64[hcap, 2]`` open-addressing hash table (linear probing, backward-shift
  deletion, power-of-two size, load <= 1/2), ``[key, child]`` per slot, key ``-1`` = empty,
  key = ``parent << TOKEN_BITS | first token of the child's label``. Only the children of
  *hashed* parents are in it: the root, and any node that once had ``HASH_MIN_CHILDREN`` children.
  The children of other nodes are found by walking their (short) sibling list; the cached best
  child is tried first. Such a node's ``C_FILTER`` has bit :func:`filter_bit` ``(t)`` set for each
  child's first token ``t`` (exactly those bits), so most lookups of a token that is no child end
  there, with no walk. About half of a draft's lookups in these nodes are such: the ``mix``
  chooser scores each candidate token at every locus, and a locus rarely continues with all of them.
* ``seqs``: ``int32[scap, S_LOCI + max_depth + 1]``, one row per sequence slot: its segment of the
  token pool (``S_BASE``, ``S_LEN``, ``S_CAP``), ``S_STATE`` (0 free, 1 stored, 2 removed but its
  tokens still referenced by node labels) and its active loci ``[S_LOCI + d]`` = node where its
  suffix of length ``d`` ends (``d = 0``: root), valid for ``d <= min(len, max_depth)``.
* ``pool``: ``int32[pcap]``, the sequences' tokens; a node's label is
  ``pool[base(seq) + end - label length : base(seq) + end]`` with ``seq, end = nodes[u, C_SEQ],
  nodes[u, C_IDX]``; the token at string position ``d`` (``depth(parent) <= d < depth(u)``) is
  ``pool[base(seq) + end - (depth(u) - d)]``.
* ``meta``: ``int64[M_LEN]`` scalars (the ``M_*`` constants).

All of them are views of one ``int64`` buffer (``meta`` first, then the others at the offsets
``meta`` records), so a kernel call passes one array: numba's per-argument dispatch cost is most
of a small call's cost.

The small helpers (node, hash and view functions, and ``_advance_locus``) are inlined into their
callers at numba's IR level (``inline="always"``): numba does not inline one compiled function
into another otherwise, and a call that passes half a dozen array structs costs more than the few
loads and stores of a leaf extension. Appending tokens for hundreds of requests per engine step
(``add_batch``) runs about a third faster this way.

Entry points (each takes a tree's buffer ``mem``; a sequence is named by its slot ``s``, a row of
``seqs``): :func:`append_tokens`, :func:`remove_sequence`, :func:`find_locus`,
:func:`locus_continuations`, :func:`draft_context`, :func:`draft_sequence`,
:func:`fill_hash_table`; for a request's trees at once :func:`append_tokens_trees` and
:func:`draft_two_trees`; a verb's token argument, checked before anything changes: :func:`first_bad_token`;
for all rows of an engine step :func:`check_batch`, :func:`add_batch`
(:func:`add_batch_global` for the global tree; both on several threads, with the mixer's
learning, in :func:`das.step_threads.insert_batch_parallel`)
and :func:`draft_batch` (:func:`draft_batch_parallel` on several threads). Python side:
:func:`buffer_layout`, :func:`new_buffer` and :func:`buffer_views`. Other numba code may build on
:func:`borrowed_views`, :func:`walk_views`, :func:`greedy_walk` and :func:`prefetch`.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.core import cgutils
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
C_FILTER = 11  # the children's first tokens as a bit filter (:func:`filter_bit`); HASHED: they are in the hash table
NCOL = 16  # int32 columns per row: the 12 above, then the row's two float64 counts (``weights``)
LINE_WORDS = 8  # int64 words per cache line (64 bytes): a node row's size, and its alignment

# sequence columns
S_BASE = 0  # start of the sequence's segment in the pool
S_LEN = 1  # tokens of the sequence
S_CAP = 2  # tokens its segment holds
S_STATE = 3  # 0 free, 1 stored, 2 removed but its tokens still referenced by node labels
S_LOCI = 4  # first of its active loci: [S_LOCI + d] = node where its suffix of length d ends

# meta slots
M_HIGH_WATER = 0  # rows [0, high water) have been used at least once
M_FREE_HEAD = 1  # head of the free list (-1: empty)
M_NUM_FREE = 2  # rows on the free list
M_LIVE_NODES = 3  # live nodes, root included
M_HASH_ENTRIES = 4  # entries in the hash table
M_HASH_SHIFT = 5  # 64 - log2(hash slots)
M_NUM_TOKENS = 6  # tokens of stored sequences
M_MAX_DEPTH = 7  # max_depth
M_NODE_CAP = 8  # node rows
M_NODES_AT = 9  # offset (int64 words) of the node rows in the buffer
M_WEIGHTS_AT = 10  # (unused: the weighted counts live in the node rows)
M_HASH_CAP = 11  # hash slots (a power of two)
M_HASH_AT = 12  # offset of the hash table
M_SEQ_CAP = 13  # sequence slots
M_SEQ_COLS = 14  # int32 columns per sequence slot (even)
M_SEQS_AT = 15  # offset of the sequence table
M_POOL_CAP = 16  # pool tokens (even)
M_POOL_AT = 17  # offset of the pool
M_LEN = 18

HASH_MIN_CHILDREN = 8  # a node with this many children moves them to the hash table
HASHED = -1  # C_FILTER of a node whose children are hashed (a filter uses bits 0-30, so it is never negative)
_FIBONACCI_MULT = np.int64(-7046029254386353131)  # 0x9E3779B97F4A7C15 (Fibonacci hashing)


def node_headroom(max_depth: int) -> int:
    """Free node rows a kernel needs before it inserts one more token."""
    return max_depth + 1


def hash_headroom(max_depth: int) -> int:
    """Free hash entries (below half the table) a kernel needs before it inserts one more token."""
    return (max_depth + 1) * (HASH_MIN_CHILDREN + 1)


# ----------------------------------------------------------------------------- buffer


def buffer_layout(max_depth: int, ncap: int, hcap: int, scap: int, pcap: int) -> tuple[np.ndarray, int]:
    """``(meta, words)``: a fresh meta block describing a buffer with these capacities, and the
    buffer's size in int64 words."""
    scol = S_LOCI + max_depth + 1
    scol += scol & 1
    pcap += pcap & 1
    meta = np.zeros(M_LEN, np.int64)
    off = -(-M_LEN // LINE_WORDS) * LINE_WORDS  # node rows start on a cache line (in a buffer from new_buffer)
    meta[M_NODE_CAP] = ncap
    meta[M_NODES_AT] = off
    meta[M_WEIGHTS_AT] = off
    off += ncap * NCOL // 2
    meta[M_HASH_CAP] = hcap
    meta[M_HASH_AT] = off
    off += 2 * hcap
    meta[M_SEQ_CAP] = scap
    meta[M_SEQ_COLS] = scol
    meta[M_SEQS_AT] = off
    off += scap * scol // 2
    meta[M_POOL_CAP] = pcap
    meta[M_POOL_AT] = off
    off += pcap // 2
    meta[M_MAX_DEPTH] = max_depth
    meta[M_HASH_SHIFT] = 64 - (hcap.bit_length() - 1)
    return meta, off


def new_buffer(words: int) -> np.ndarray:
    """An uninitialised ``int64[words]`` buffer whose data starts on a 64-byte boundary, so that
    with :func:`buffer_layout`'s offsets each 64-byte node row is one cache line (numpy's own
    allocations are 16-byte aligned: a row would straddle two lines, and a node read could miss
    twice). A view of a slightly larger array."""
    raw = np.empty(words + LINE_WORDS - 1, np.int64)
    skip = (-raw.ctypes.data // 8) % LINE_WORDS
    return raw[skip : skip + words]


def buffer_views(mem: np.ndarray):
    """``(meta, nodes, weights, hash_table, seqs, pool)``: numpy views of a tree buffer (Python
    side; shapes and dtypes as in the module docstring)."""
    meta = mem[:M_LEN]
    ncap, hcap, scap, scol, pcap = (int(meta[M_NODE_CAP]), int(meta[M_HASH_CAP]), int(meta[M_SEQ_CAP]),
                                    int(meta[M_SEQ_COLS]), int(meta[M_POOL_CAP]))
    o = int(meta[M_NODES_AT])
    rows = mem[o : o + ncap * NCOL // 2]
    nodes = rows.view(np.int32).reshape(ncap, NCOL)
    weights = rows.view(np.float64).reshape(ncap, NCOL // 2)[:, NCOL // 2 - 2 :]
    o = int(meta[M_HASH_AT])
    hash_table = mem[o : o + 2 * hcap].reshape(hcap, 2)
    o = int(meta[M_SEQS_AT])
    seqs = mem[o : o + scap * scol // 2].view(np.int32).reshape(scap, scol)
    o = int(meta[M_POOL_AT])
    pool = mem[o : o + pcap // 2].view(np.int32)
    return meta, nodes, weights, hash_table, seqs, pool


def _pointer_at_intrinsic(nbtype):
    """An intrinsic ``f(address, offset)``: the int64 word ``offset`` words past ``address`` (an
    int64 from :func:`address_of`) as a pointer to ``nbtype`` (for :func:`numba.carray`)."""

    @intrinsic
    def pointer(typingctx, address, offset):
        sig = types.CPointer(nbtype)(address, offset)

        def codegen(context, builder, signature, args):
            p = builder.gep(builder.inttoptr(args[0], ir.IntType(64).as_pointer()), [args[1]])
            return builder.bitcast(p, context.get_value_type(types.CPointer(nbtype)))

        return sig, codegen

    return pointer


@intrinsic
def address_of(typingctx, arr):
    """``address_of(arr)``: the address of ``arr``'s data as an int64. A kernel that keeps several
    tree buffers at hand by address and builds views with :func:`views_at` pays no reference
    counts: choosing between array arguments (``a if s == 0 else b``) makes numba count a
    reference to the chosen array, two atomic operations on a counter that every thread drafting
    from the same tree shares. Valid while ``arr`` is alive (a kernel argument, or an item of one)."""
    sig = types.int64(arr)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.ptrtoint(ary.data, ir.IntType(64))

    return sig, codegen


@intrinsic
def borrow(typingctx, arr):
    """``borrow(arr)``: a view of ``arr`` without a reference count (a null meminfo). numba counts
    references to an array whenever a variable takes it, an inlined helper included, and each
    count is an atomic operation; on a borrowed view the count is a test of a null pointer.
    Valid while ``arr`` is alive: pass it to a call whose caller holds ``arr``; never return it."""
    if not isinstance(arr, types.Array):
        return None
    sig = arr(arr)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        src = context.make_array(aryty)(context, builder, args[0])
        dst = context.make_array(aryty)(context, builder)
        dst.meminfo = cgutils.get_null_value(dst.meminfo.type)
        dst.parent = cgutils.get_null_value(dst.parent.type)
        dst.nitems = src.nitems
        dst.itemsize = src.itemsize
        dst.data = src.data
        dst.shape = src.shape
        dst.strides = src.strides
        return dst._getvalue()

    return sig, codegen


@intrinsic
def prefetch(typingctx, arr, i):
    """``prefetch(arr, i)``: hint the CPU to bring element ``i`` (a flat index) of the C-contiguous
    array ``arr`` into its caches (``llvm.prefetch``: a read, kept close). It changes no value and
    never faults. A kernel that knows a few independent addresses it will read soon issues them
    together, so their cache misses overlap instead of coming one after the other."""
    sig = types.void(arr, i)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        p = builder.bitcast(builder.gep(ary.data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic("llvm.prefetch", [p.type], ir.FunctionType(ir.VoidType(), [p.type, i32, i32, i32]))
        builder.call(fn, [p, i32(0), i32(3), i32(1)])  # read, locality 3 (all cache levels), data
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def fetch_add(typingctx, arr, i, v):
    """``fetch_add(arr, i, v)``: add ``v`` to ``arr[i]`` (``arr``: a C-contiguous ``int64`` array,
    ``i`` a flat index) as one atomic operation and return the value before (``atomicrmw add``,
    monotonic: the counter alone is ordered, no other memory). Threads of a ``prange`` claim
    work from a shared counter with it: each gets a distinct value."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None
    sig = types.int64(arr, i, v)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        val = context.cast(builder, args[2], signature.args[2], types.int64)
        return builder.atomic_rmw("add", ptr, val, "monotonic")

    return sig, codegen


_int32_at = _pointer_at_intrinsic(types.int32)
_int64_at = _pointer_at_intrinsic(types.int64)
_float64_at = _pointer_at_intrinsic(types.float64)


@njit(cache=True, inline="always")
def views_at(address):
    """:func:`borrowed_views` of the tree buffer at ``address`` (:func:`address_of`)."""
    meta = carray(_int64_at(address, 0), (M_LEN,))
    ncap = meta[M_NODE_CAP]
    o = meta[M_NODES_AT]
    nodes = carray(_int32_at(address, o), (ncap, NCOL))
    weights = carray(_float64_at(address, o), (ncap, NCOL // 2))[:, NCOL // 2 - 2 :]
    hash_table = carray(_int64_at(address, meta[M_HASH_AT]), (meta[M_HASH_CAP], 2))
    seqs = carray(_int32_at(address, meta[M_SEQS_AT]), (meta[M_SEQ_CAP], meta[M_SEQ_COLS]))
    pool = carray(_int32_at(address, meta[M_POOL_AT]), (meta[M_POOL_CAP],))
    return meta, nodes, weights, hash_table, seqs, pool


@njit(cache=True, inline="always")
def borrowed_views(mem):
    """:func:`buffer_views` inside kernels. The views are borrowed (``numba.carray`` over ``mem``'s
    memory, no reference count): building them costs about a nanosecond instead of ~170 ns for
    slices, reshapes and dtype views, which matters when a call visits hundreds of trees. They
    are valid while ``mem`` is (a kernel argument, or an item of one, always is) and must never
    be returned to Python."""
    return views_at(address_of(mem))


# ----------------------------------------------------------------------------- hash table


@njit(cache=True, inline="always")
def walk_views(mem):
    """The views a walk reads, as one tuple: ``(nodes, weights, hash_table, meta, seqs, pool)`` (:func:`borrowed_views`' order
    differs: meta first). The walk kernels take it whole and unpack it once at their top (free in numba)."""
    meta, nodes, weights, hash_table, seqs, pool = borrowed_views(mem)
    return nodes, weights, hash_table, meta, seqs, pool


@njit(cache=True, inline="always")
def walk_settings(max_tokens, min_prob, factor, min_match, prior):
    """A walk's settings as one tuple ``(max_tokens int, min_prob float, factor float, min_match int, prior float)``, its
    types fixed here (int64 / float64) so every caller compiles the kernels once."""
    return np.int64(max_tokens), np.float64(min_prob), np.float64(factor), np.int64(min_match), np.float64(prior)


@njit(cache=True, inline="always")
def hash_slot(key, shift, mask):
    return ((key * _FIBONACCI_MULT) >> shift) & mask


@njit(cache=True, inline="always")
def hash_lookup(hash_table, shift, key):
    mask = hash_table.shape[0] - 1
    i = hash_slot(key, shift, mask)
    while True:
        k = hash_table[i, 0]
        if k == key:
            return hash_table[i, 1]
        if k == -1:
            return -1
        i = (i + 1) & mask


@njit(cache=True, inline="always")
def _hash_insert(hash_table, shift, key, val):
    mask = hash_table.shape[0] - 1
    i = hash_slot(key, shift, mask)
    while hash_table[i, 0] != -1:
        i = (i + 1) & mask
    hash_table[i, 0] = key
    hash_table[i, 1] = val


@njit(cache=True, inline="always")
def _hash_update(hash_table, shift, key, val):
    """Change the value of an existing key."""
    mask = hash_table.shape[0] - 1
    i = hash_slot(key, shift, mask)
    while hash_table[i, 0] != key:
        i = (i + 1) & mask
    hash_table[i, 1] = val


@njit(cache=True)
def _hash_delete(hash_table, shift, key):
    mask = hash_table.shape[0] - 1
    i = hash_slot(key, shift, mask)
    while hash_table[i, 0] != key:
        if hash_table[i, 0] == -1:
            return False
        i = (i + 1) & mask
    j = i
    while True:  # backward-shift deletion: keep every probe chain unbroken
        j = (j + 1) & mask
        kj = hash_table[j, 0]
        if kj == -1:
            break
        home = hash_slot(kj, shift, mask)
        if (j > i and (home <= i or home > j)) or (j < i and home <= i and home > j):
            hash_table[i, 0] = kj
            hash_table[i, 1] = hash_table[j, 1]
            i = j
    hash_table[i, 0] = -1
    hash_table[i, 1] = -1
    return True


@njit(cache=True, inline="always")
def child_key(parent, token):
    return (np.int64(parent) << TOKEN_BITS) | np.int64(token)


@njit(cache=True)
def fill_hash_table(mem):
    """Insert the children of every hashed live node into the (empty) hash table; returns entries."""
    meta, nodes, weights, hash_table, seqs, pool = borrowed_views(mem)
    shift = meta[M_HASH_SHIFT]
    n = 0
    for p in range(meta[M_HIGH_WATER]):
        if nodes[p, C_FILTER] == HASHED and (p == 0 or nodes[p, C_PARENT] != -1):
            c = nodes[p, C_FIRST]
            while c != -1:
                _hash_insert(hash_table, shift, child_key(p, nodes[c, C_TOKEN]), c)
                n += 1
                c = nodes[c, C_NEXT]
    return n


# ----------------------------------------------------------------------------- nodes


@njit(cache=True, inline="always")
def filter_bit(t):
    """Token ``t``'s bit in a node's ``C_FILTER``: one of bits 0-30 (Fibonacci hashing of the token)."""
    return np.int64(1) << ((((np.int64(t) * np.int64(2654435761)) & np.int64(0xFFFFFFFF)) * np.int64(31)) >> np.int64(32))


@njit(cache=True, inline="always")
def _children_filter(nodes, p):
    """``C_FILTER`` of unhashed node ``p`` from its children (after one left or changed its first token)."""
    f = np.int64(0)
    c = nodes[p, C_FIRST]
    while c != -1:
        f |= filter_bit(nodes[c, C_TOKEN])
        c = nodes[c, C_NEXT]
    return f


@njit(cache=True, inline="always")
def find_child(nodes, hash_table, shift, p, t):
    """Child of node ``p`` whose label starts with token ``t``, or -1."""
    f = nodes[p, C_FILTER]
    if f == HASHED:
        return np.int64(hash_lookup(hash_table, shift, child_key(p, t)))
    if f & filter_bit(t) == 0:
        return np.int64(-1)
    b = nodes[p, C_BEST]
    if b >= 0 and nodes[b, C_TOKEN] == t:
        return np.int64(b)
    c = nodes[p, C_FIRST]
    while c != -1:
        if nodes[c, C_TOKEN] == t:
            return np.int64(c)
        c = nodes[c, C_NEXT]
    return np.int64(-1)


@njit(cache=True, inline="always")
def _alloc_node(nodes, weights, meta):
    f = meta[M_FREE_HEAD]
    if f != -1:
        c = f
        meta[M_FREE_HEAD] = nodes[f, C_NEXT]
        meta[M_NUM_FREE] -= 1
    else:
        c = meta[M_HIGH_WATER]
        meta[M_HIGH_WATER] += 1
    nodes[c, C_FIRST] = -1
    nodes[c, C_NEXT] = -1
    nodes[c, C_PREV] = -1
    nodes[c, C_BEST] = -1
    nodes[c, C_NCHILD] = 0
    nodes[c, C_FILTER] = 0
    weights[c, 0] = 0.0
    weights[c, 1] = 0.0
    meta[M_LIVE_NODES] += 1
    return c


@njit(cache=True, inline="always")
def _free_node(nodes, weights, meta, c):
    nodes[c, C_PARENT] = -1
    nodes[c, C_TOKEN] = -1
    nodes[c, C_COUNT] = 0
    nodes[c, C_FIRST] = -1
    nodes[c, C_PREV] = -1
    nodes[c, C_BEST] = -1
    nodes[c, C_NCHILD] = 0
    nodes[c, C_FILTER] = 0
    weights[c, 0] = 0.0
    weights[c, 1] = 0.0
    nodes[c, C_NEXT] = meta[M_FREE_HEAD]
    meta[M_FREE_HEAD] = c
    meta[M_NUM_FREE] += 1
    meta[M_LIVE_NODES] -= 1


@njit(cache=True, inline="always")
def _link_child(nodes, hash_table, meta, p, c):
    """Make ``c`` (its ``C_TOKEN`` set) a child of ``p``: sibling list, count, hash."""
    nodes[c, C_PARENT] = p
    old = nodes[p, C_FIRST]
    nodes[c, C_NEXT] = old
    nodes[c, C_PREV] = -1
    if old != -1:
        nodes[old, C_PREV] = c
    nodes[p, C_FIRST] = c
    nodes[p, C_NCHILD] += 1
    shift = meta[M_HASH_SHIFT]
    if nodes[p, C_FILTER] == HASHED:
        _hash_insert(hash_table, shift, child_key(p, nodes[c, C_TOKEN]), c)
        meta[M_HASH_ENTRIES] += 1
    elif nodes[p, C_NCHILD] < HASH_MIN_CHILDREN:
        nodes[p, C_FILTER] |= filter_bit(nodes[c, C_TOKEN])
    else:
        nodes[p, C_FILTER] = HASHED
        x = nodes[p, C_FIRST]
        while x != -1:
            _hash_insert(hash_table, shift, child_key(p, nodes[x, C_TOKEN]), x)
            meta[M_HASH_ENTRIES] += 1
            x = nodes[x, C_NEXT]


@njit(cache=True, inline="always")
def _unlink_child(nodes, hash_table, meta, p, c):
    """Remove child ``c`` from ``p``'s sibling list and hash (``c``'s row is left as is)."""
    prv = nodes[c, C_PREV]
    nxt = nodes[c, C_NEXT]
    if prv == -1:
        nodes[p, C_FIRST] = nxt
    else:
        nodes[prv, C_NEXT] = nxt
    if nxt != -1:
        nodes[nxt, C_PREV] = prv
    nodes[p, C_NCHILD] -= 1
    if nodes[p, C_FILTER] == HASHED:
        _hash_delete(hash_table, meta[M_HASH_SHIFT], child_key(p, nodes[c, C_TOKEN]))
        meta[M_HASH_ENTRIES] -= 1
    else:
        nodes[p, C_FILTER] = _children_filter(nodes, p)
    if nodes[p, C_BEST] == c:
        nodes[p, C_BEST] = -2  # dirty: the caller recomputes it


@njit(cache=True, inline="always")
def _replace_child(nodes, hash_table, meta, p, old, new):
    """Put ``new`` in ``old``'s place among ``p``'s children (same first token, same position)."""
    prv = nodes[old, C_PREV]
    nxt = nodes[old, C_NEXT]
    nodes[new, C_PREV] = prv
    nodes[new, C_NEXT] = nxt
    if prv == -1:
        nodes[p, C_FIRST] = new
    else:
        nodes[prv, C_NEXT] = new
    if nxt != -1:
        nodes[nxt, C_PREV] = new
    nodes[new, C_PARENT] = p
    if nodes[p, C_FILTER] == HASHED:
        _hash_update(hash_table, meta[M_HASH_SHIFT], child_key(p, nodes[old, C_TOKEN]), new)
    if nodes[p, C_BEST] == old:
        nodes[p, C_BEST] = new


@njit(cache=True, inline="always")
def _rekey_child(nodes, hash_table, meta, p, c, t):
    """Change the first token of child ``c`` of ``p`` to ``t`` (its key in ``p``'s hash)."""
    old = nodes[c, C_TOKEN]
    if old == t:
        return
    nodes[c, C_TOKEN] = t
    if nodes[p, C_FILTER] == HASHED:
        shift = meta[M_HASH_SHIFT]
        _hash_delete(hash_table, shift, child_key(p, old))
        _hash_insert(hash_table, shift, child_key(p, t), c)
    else:
        nodes[p, C_FILTER] = _children_filter(nodes, p)


@njit(cache=True, inline="always")
def _is_better_child(nodes, weights, a, b):
    """Is child ``a`` preferred over child ``b`` (larger weighted count, ties: smaller token)?"""
    if b < 0:
        return True
    wa = weights[a, 0]
    wb = weights[b, 0]
    return wa > wb or (wa == wb and nodes[a, C_TOKEN] < nodes[b, C_TOKEN])


@njit(cache=True)
def _recompute_best_child(nodes, weights, p):
    best = -1
    c = nodes[p, C_FIRST]
    while c != -1:
        if _is_better_child(nodes, weights, c, best):
            best = c
        c = nodes[c, C_NEXT]
    nodes[p, C_BEST] = best


@njit(cache=True, inline="always")
def _update_best_child(nodes, weights, p, c):
    """``c``'s weighted count grew: update ``p``'s cached best child."""
    if p != 0:
        b = nodes[p, C_BEST]
        if b != c and _is_better_child(nodes, weights, c, b):
            nodes[p, C_BEST] = c


# ----------------------------------------------------------------------------- updates


@njit(cache=True, inline="always")
def _advance_locus(nodes, weights, hash_table, meta, seqs, pool, s, node, t, L, w):
    """Move the active locus ``node`` of sequence ``s`` (whose new length is ``L``, last token
    ``t``) one token down; returns the new locus. Cases as arctic-inference's ``append``."""
    if node != 0 and nodes[node, C_COUNT] == 1:
        # 1a: a leaf only this suffix reaches (a locus of one occurrence, at the end of s, has
        # no child): lengthen its label (now read from s). Most steps are this one.
        nodes[node, C_DEPTH] += 1
        nodes[node, C_SEQ] = s
        nodes[node, C_IDX] = L
        return node
    shift = meta[M_HASH_SHIFT]
    child = find_child(nodes, hash_table, shift, node, t)
    if child == -1:
        # 1b: a new leaf
        c = _alloc_node(nodes, weights, meta)
        nodes[c, C_TOKEN] = t
        nodes[c, C_DEPTH] = nodes[node, C_DEPTH] + 1
        nodes[c, C_COUNT] = 1
        nodes[c, C_SEQ] = s
        nodes[c, C_IDX] = L
        weights[c, 0] = w
        _link_child(nodes, hash_table, meta, node, c)
        weights[node, 1] += w
        _update_best_child(nodes, weights, node, c)
        return c
    elen = nodes[child, C_DEPTH] - nodes[node, C_DEPTH]
    if node != 0 and nodes[node, C_COUNT] == nodes[child, C_COUNT] + 1:
        # 2: this suffix is the only one that ends at node; all the others go on into child
        p = nodes[node, C_PARENT]
        if elen == 1:
            # 2a: fuse node into child
            nodes[child, C_COUNT] += 1
            weights[child, 0] = weights[node, 0]
            nodes[child, C_SEQ] = s
            nodes[child, C_IDX] = L
            _unlink_child(nodes, hash_table, meta, node, child)
            nodes[child, C_TOKEN] = nodes[node, C_TOKEN]
            _replace_child(nodes, hash_table, meta, p, node, child)
            _free_node(nodes, weights, meta, node)
            return child
        # 2b: slide node's boundary one token into child's label
        nodes[node, C_DEPTH] += 1
        nodes[node, C_SEQ] = s
        nodes[node, C_IDX] = L
        _rekey_child(nodes, hash_table, meta, node, child, edge_token(nodes, seqs, pool, child, nodes[node, C_DEPTH]))
        return node
    if elen == 1:
        # 3a: step into child
        nodes[child, C_COUNT] += 1
        weights[child, 0] += w
        weights[node, 1] += w
        _update_best_child(nodes, weights, node, child)
        return child
    # 3b: split child's edge after its first token
    m = _alloc_node(nodes, weights, meta)
    nodes[m, C_TOKEN] = t
    nodes[m, C_DEPTH] = nodes[node, C_DEPTH] + 1
    nodes[m, C_COUNT] = nodes[child, C_COUNT] + 1
    nodes[m, C_SEQ] = s
    nodes[m, C_IDX] = L
    weights[m, 0] = weights[child, 0] + w
    weights[m, 1] = weights[child, 0]
    _replace_child(nodes, hash_table, meta, node, child, m)
    nodes[child, C_TOKEN] = edge_token(nodes, seqs, pool, child, nodes[m, C_DEPTH])
    nodes[child, C_PARENT] = m
    nodes[child, C_NEXT] = -1
    nodes[child, C_PREV] = -1
    nodes[m, C_FIRST] = child
    nodes[m, C_NCHILD] = 1
    nodes[m, C_FILTER] = filter_bit(nodes[child, C_TOKEN])
    nodes[m, C_BEST] = child
    weights[node, 1] += w
    _update_best_child(nodes, weights, node, m)
    return m


@njit(cache=True, nogil=True)  # nogil: as remove_sequence
def append_tokens(mem, s, tokens, w):
    """Append ``tokens`` to sequence slot ``s`` (weight ``w``).

    Stops early (before a token) when the node, hash or pool-segment capacity might not suffice
    for one more token.

    Returns:
        ``>= 0``: number of tokens inserted (the caller grows the arrays and calls again for the
        rest); ``-(i + 1)``: ``tokens[i]`` is out of ``[0, VOCAB_LIMIT)`` (nothing was changed).
    """
    i = first_bad_token(tokens)
    if i >= 0:
        return -(i + 1)
    meta, nodes, weights, hash_table, seqs, pool = borrowed_views(mem)
    return _append_tokens(nodes, weights, hash_table, meta, seqs, pool, s, tokens, w)


@njit(cache=True)
def _append_tokens(nodes, weights, hash_table, meta, seqs, pool, s, tokens, w):
    n = tokens.shape[0]
    D = meta[M_MAX_DEPTH]
    cap = nodes.shape[0]
    half = hash_table.shape[0] // 2
    need_n = D + 1
    need_h = (D + 1) * (HASH_MIN_CHILDREN + 1)
    base = seqs[s, S_BASE]
    scap = seqs[s, S_CAP]
    # every active locus moves with the first token: start their cache misses at once (an engine
    # step finds them cold, after a forward pass; one after the other they were most of an append)
    for d in range(min(seqs[s, S_LEN], D - 1) + 1):
        prefetch(nodes, seqs[s, S_LOCI + d] * NCOL)
    done = 0
    for i in range(n):
        if cap - meta[M_HIGH_WATER] + meta[M_NUM_FREE] < need_n or meta[M_HASH_ENTRIES] + need_h > half or seqs[s, S_LEN] >= scap:
            break
        t = np.int32(tokens[i])
        L0 = seqs[s, S_LEN]
        pool[base + L0] = t
        L = L0 + 1
        seqs[s, S_LEN] = L
        nodes[0, C_COUNT] += 1
        weights[0, 0] += w
        top = min(L0, D - 1)
        for d in range(top, -1, -1):
            seqs[s, S_LOCI + d + 1] = _advance_locus(nodes, weights, hash_table, meta, seqs, pool, s, seqs[s, S_LOCI + d], t, L, w)
        done += 1
    meta[M_NUM_TOKENS] += done
    return done


@njit(cache=True, nogil=True)  # nogil: run by the drafter's background thread too (``defer_global``)
def remove_sequence(mem, s, w):
    """Subtract sequence slot ``s`` (inserted with weight ``w``): walk each of its suffixes,
    decrement every node on the way, free the subtrees only it reached, merge a node into its only
    child where no suffix ends at it any more, and repair cached best children.

    The sequence's tokens stay in the pool (node labels may still point into them); the caller
    marks the slot as removed."""
    meta, nodes, weights, hash_table, seqs, pool = borrowed_views(mem)
    n = seqs[s, S_LEN]
    if n == 0:
        return True
    D = meta[M_MAX_DEPTH]
    shift = meta[M_HASH_SHIFT]
    base = seqs[s, S_BASE]
    dirty = np.empty(n * (D + 1) + 1, np.int64)
    ndirty = 0
    ok = True
    for start in range(n):
        nodes[0, C_COUNT] -= 1
        weights[0, 0] -= w
        node = np.int64(0)
        idx = start
        end = min(n, start + D)
        while idx < end:
            t = pool[base + idx]
            c = find_child(nodes, hash_table, shift, node, t)
            if c == -1:
                ok = False
                break
            if nodes[c, C_COUNT] > 1:
                nodes[c, C_COUNT] -= 1
                weights[c, 0] -= w
                weights[node, 1] -= w
                if node != 0 and nodes[node, C_BEST] == c:
                    nodes[node, C_BEST] = -2
                    dirty[ndirty] = node
                    ndirty += 1
            else:
                weights[node, 1] -= weights[c, 0]
                _unlink_child(nodes, hash_table, meta, node, c)
                if node != 0 and nodes[node, C_BEST] == -2:
                    dirty[ndirty] = node
                    ndirty += 1
                # only this suffix reached c: c and its descendants form one chain; free it
                u = c
                while u != -1:
                    x = nodes[u, C_FIRST]
                    if x != -1 and nodes[u, C_FILTER] == HASHED:
                        _hash_delete(hash_table, shift, child_key(u, nodes[x, C_TOKEN]))
                        meta[M_HASH_ENTRIES] -= 1
                    _free_node(nodes, weights, meta, u)
                    u = x
                break
            idx += nodes[c, C_DEPTH] - nodes[node, C_DEPTH]
            node = c
        # merge node into its only child if no suffix ends at node any more
        if node != 0 and nodes[node, C_NCHILD] == 1:
            k = nodes[node, C_FIRST]
            if nodes[node, C_COUNT] == nodes[k, C_COUNT]:
                p = nodes[node, C_PARENT]
                weights[k, 0] = weights[node, 0]
                _unlink_child(nodes, hash_table, meta, node, k)
                nodes[k, C_TOKEN] = nodes[node, C_TOKEN]
                _replace_child(nodes, hash_table, meta, p, node, k)
                _free_node(nodes, weights, meta, node)
    if nodes[0, C_COUNT] == 0:
        weights[0, 0] = 0.0
        weights[0, 1] = 0.0
    meta[M_NUM_TOKENS] -= n
    for j in range(ndirty):
        p = dirty[j]
        if nodes[p, C_PARENT] != -1 and nodes[p, C_BEST] == -2:
            _recompute_best_child(nodes, weights, p)
    return ok


# ----------------------------------------------------------------------------- queries


@njit(cache=True, inline="always")
def edge_token(nodes, seqs, pool, u, d):
    """The token at string position ``d`` on the edge into ``u`` (``depth(parent) <= d < depth(u)``)."""
    return pool[seqs[nodes[u, C_SEQ], S_BASE] + nodes[u, C_IDX] - (nodes[u, C_DEPTH] - d)]


@njit(cache=True)
def find_locus_in(nodes, hash_table, meta, seqs, pool, pattern, lo, hi):
    """Locus of ``pattern[lo:hi]``: ``(node, depth)`` with the string ending at ``depth`` on the
    edge into ``node`` (``depth == node's depth``: at the node); ``(-1, 0)`` if absent."""
    shift = meta[M_HASH_SHIFT]
    u = np.int64(0)
    d = 0
    k = lo
    while k < hi:
        t = pattern[k]
        if t < 0 or t >= VOCAB_LIMIT:
            return np.int64(-1), 0
        c = find_child(nodes, hash_table, shift, u, t)
        if c == -1:
            return np.int64(-1), 0
        pd = nodes[u, C_DEPTH]
        cd = nodes[c, C_DEPTH]
        lb = seqs[nodes[c, C_SEQ], S_BASE] + nodes[c, C_IDX] - (cd - pd)
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
def find_locus(mem, pattern):
    """``(node, depth)`` locus of the string ``pattern`` (``(0, 0)`` for an empty one), or
    ``(-1, 0)`` if absent or longer than max_depth."""
    meta, nodes, weights, hash_table, seqs, pool = borrowed_views(mem)
    if pattern.shape[0] > meta[M_MAX_DEPTH]:
        return np.int64(-1), 0
    return find_locus_in(nodes, hash_table, meta, seqs, pool, pattern, 0, pattern.shape[0])


@njit(cache=True)
def locus_continuations(mem, u, d):
    """``(tokens int64[k], weighted counts float64[k])`` of the continuations of locus ``(u, d)``."""
    meta, nodes, weights, hash_table, seqs, pool = borrowed_views(mem)
    if d < nodes[u, C_DEPTH]:
        toks = np.empty(1, np.int64)
        ws = np.empty(1, np.float64)
        toks[0] = edge_token(nodes, seqs, pool, u, d)
        ws[0] = weights[u, 0]
        return toks, ws
    k = nodes[u, C_NCHILD]
    toks = np.empty(k, np.int64)
    ws = np.empty(k, np.float64)
    c = nodes[u, C_FIRST]
    j = 0
    while c != -1:
        toks[j] = nodes[c, C_TOKEN]
        ws[j] = weights[c, 0]
        j += 1
        c = nodes[c, C_NEXT]
    return toks, ws


@njit(cache=True, inline="always")  # inlined (numba IR): a walk's tuples unpack into its caller's locals, as fast as array arguments
def greedy_walk(tree, u, d, limit, min_prob, prior, scratch, nscr, out, off, floor=0.0):
    """Greedy walk from locus ``(u, d)`` in ``tree`` (:func:`walk_views`; ``out``: ``(out_tok int32, out_prob float32)``):
    most-weighted child at nodes (probability
    ``wc(child) / (sum of the children's wc + prior)``), the label inside edges (probability 1);
    re-anchors on the last ``max_depth - 1`` tokens (``scratch[:nscr]`` holds the context tail,
    the walk appends to it) when it reaches depth ``max_depth``. Writes ``out_*[off:off + k]``;
    returns ``(k, score)``.

    ``floor > 0``: the caller only wants a walk scoring above ``floor``; the walk gives up, and
    returns ``(0, 0.0)``, as soon as it cannot get there (path probabilities never increase, so
    ``score + prob * (limit - k)`` bounds its final score; 1e-9 relative margin for rounding)."""
    nodes, weights, hash_table, meta, seqs, pool = tree  # unpacked once: the loop reads locals
    out_tok, out_prob = out
    D = meta[M_MAX_DEPTH]
    prob = 1.0
    score = 0.0
    k = 0
    while k < limit:
        if d < nodes[u, C_DEPTH]:
            t = edge_token(nodes, seqs, pool, u, d)
            if prior > 0.0:  # the only continuation inside an edge: count(u) / (count(u) + prior)
                wb = weights[u, 0]
                p = prob * (wb / (wb + prior))
                if p < min_prob:
                    break
                prob = p
            d += 1
        else:
            if d >= D:
                u, d = find_locus_in(nodes, hash_table, meta, seqs, pool, scratch, nscr - (D - 1), nscr)
                if u < 0:
                    break
                continue
            b = nodes[u, C_BEST]
            if b < 0:
                break
            wn = weights[u, 1]
            wb = weights[b, 0]
            if not wn > 0.0:
                break
            wn += prior
            p = prob * (wb / wn) if wb < wn else prob
            if p < min_prob:
                break
            prob = p
            t = nodes[b, C_TOKEN]
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


@njit(cache=True, inline="always")  # inlined (numba IR): a walk's tuples unpack into its caller's locals, as fast as array arguments
def _best_walk(tree, loci_u, loci_d, nloci, scratch, nscr, walk, out, floor=0.0):
    """Walk (``walk``: ``(max_tokens, min_prob, factor, min_match, prior)``, :func:`walk_settings`) from each locus
    (``loci_*[L]``: the context suffix of length ``L``; longest first) and
    keep the best score (ties: the longer match). Returns ``(offset, k, score, match_len)``.

    ``floor``: only walks scoring above it count (the caller has a draft that good already);
    when none does, returns ``k == 0`` and ``score == floor``. The walk returned otherwise is the
    one returned without a floor: the first walk (longest match) reaching the best score.

    Walks that cannot win are skipped, which changes no result: a walk's path probabilities never
    increase (each step multiplies by a ratio <= 1, which cannot round up), so its score is at
    most ``limit * p1`` (``p1``: its first token's probability, computed from the locus exactly
    as :func:`greedy_walk` does; a 1e-9 relative margin covers the rounding of the score's sum), and
    a walk wins only with a score above the best so far."""
    nodes, weights, hash_table, meta, seqs, pool = tree
    max_tokens, min_prob, factor, min_match, prior = walk
    D = meta[M_MAX_DEPTH]
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
        if d0 == nodes[u, C_DEPTH] and d0 < D:  # at a node: the first step as greedy_walk takes it
            b = nodes[u, C_BEST]
            if b < 0:
                continue
            wn = weights[u, 1]
            if not wn > 0.0:
                continue
            wn += prior
            wb = weights[b, 0]
            p1 = wb / wn if wb < wn else 1.0
            if p1 < min_prob or limit * p1 * (1.0 + 1e-9) <= best_score:
                continue
        k, score = greedy_walk(tree, u, loci_d[L], limit, min_prob, prior, scratch, nscr, out, cur, best_score)
        if score > best_score:
            best_score = score
            best_k = k
            best_len = L
            best_off, cur = cur, best_off
    return best_off, best_k, best_score, best_len


@njit(cache=True)
def draft_context(mem, context, max_tokens, min_prob, factor, min_match, prior, out_tok, out_prob):
    """Match every suffix of ``context`` (up to ``max_depth - 1`` tokens) and keep the best
    greedy walk (see SuffixTree.draft). ``out_tok`` / ``out_prob``: scratch of size
    ``>= 2 * max_tokens``. Returns ``(offset, k, score, match_len)``."""
    meta, nodes, weights, hash_table, seqs, pool = borrowed_views(mem)
    D = meta[M_MAX_DEPTH]
    n = context.shape[0]
    w = min(n, D - 1)
    loci_u = np.full(w + 1, -1, np.int64)
    loci_d = np.zeros(w + 1, np.int64)
    m = 0
    for L in range(1, w + 1):
        u, d = find_locus_in(nodes, hash_table, meta, seqs, pool, context, n - L, n)
        if u < 0:
            break
        loci_u[L] = u
        loci_d[L] = d
        m = L
    scratch = np.empty(w + max_tokens + 1, np.int32)
    for i in range(w):
        scratch[i] = context[n - w + i]
    return _best_walk((nodes, weights, hash_table, meta, seqs, pool), loci_u, loci_d, m, scratch, w,
                      walk_settings(max_tokens, min_prob, factor, min_match, prior), (out_tok, out_prob))


@njit(cache=True)
def draft_sequence(mem, s, max_tokens, min_prob, factor, min_match, prior, out_tok, out_prob):
    """:func:`draft_context` for the context = sequence slot ``s``'s own tokens, anchored on its
    active loci (no matching needed). Returns ``(offset, k, score, match_len)``."""
    return _draft_sequence(walk_views(mem), s, walk_settings(max_tokens, min_prob, factor, min_match, prior), (out_tok, out_prob))


@njit(cache=True)
def _draft_sequence(tree, s, walk, out):
    D = tree[3][M_MAX_DEPTH]
    scr = (np.empty(D + 1, np.int64), np.empty(D + 1, np.int64), np.empty(D + walk[0] + 1, np.int32))
    return _draft_sequence_with_scratch(tree, s, walk, out, scr)


@njit(cache=True, inline="always")  # inlined (numba IR): a walk's tuples unpack into its caller's locals, as fast as array arguments
def _draft_sequence_with_scratch(tree, s, walk, out, scr, floor=0.0):
    """:func:`_draft_sequence` with caller-provided scratch ``scr``: ``(loci_u, loci_d, scratch)``, ``loci_u``, ``loci_d``
    (int64) of ``>= max_depth + 1`` and ``scratch`` (int32) of ``>= max_depth + max_tokens + 1`` entries; ``floor`` as
    :func:`_best_walk`."""
    loci_u, loci_d, scratch = scr
    meta = tree[3]
    seqs = tree[4]
    pool = tree[5]
    D = meta[M_MAX_DEPTH]
    n = seqs[s, S_LEN]
    w = min(n, D - 1)
    for L in range(w + 1):
        loci_u[L] = seqs[s, S_LOCI + L]
        loci_d[L] = L  # an active locus ends exactly at a node of depth L (no need to read it)
    base = seqs[s, S_BASE] + n - w
    for i in range(w):
        scratch[i] = pool[base + i]
    return _best_walk(tree, loci_u, loci_d, w, scratch, w, walk, out, floor)


# ----------------------------------------------------------------------------- two trees at once


@njit(cache=True)
def append_tokens_trees(mem_a, s_a, w_a, mem_b, s_b, w_b, mem_c, s_c, w_c, tokens):
    """Append ``tokens`` to slot ``s_a`` of tree ``a``, slot ``s_b`` of tree ``b`` and slot
    ``s_c`` of tree ``c`` (a negative slot skips that tree) in one call: a request's problem,
    request and global trees. Returns ``(done_a, done_b, done_c)`` as :func:`append_tokens` does
    (a skipped tree: ``len(tokens)``)."""
    n = tokens.shape[0]
    i = first_bad_token(tokens)
    if i >= 0:
        return -(i + 1), -(i + 1), -(i + 1)
    da = n
    db = n
    dc = n
    if s_a >= 0:
        meta, nodes, weights, hash_table, seqs, pool = borrowed_views(mem_a)
        da = _append_tokens(nodes, weights, hash_table, meta, seqs, pool, s_a, tokens, w_a)
    if s_b >= 0:
        meta, nodes, weights, hash_table, seqs, pool = borrowed_views(mem_b)
        db = _append_tokens(nodes, weights, hash_table, meta, seqs, pool, s_b, tokens, w_b)
    if s_c >= 0:
        meta, nodes, weights, hash_table, seqs, pool = borrowed_views(mem_c)
        dc = _append_tokens(nodes, weights, hash_table, meta, seqs, pool, s_c, tokens, w_c)
    return da, db, dc


@njit(cache=True)
def draft_two_trees(mem_a, s_a, prior_a, mem_b, s_b, prior_b, max_tokens, min_prob, factor, out_tok, out_prob):
    """:func:`draft_sequence` from slot ``s_a`` of tree ``a`` and slot ``s_b`` of tree ``b`` (a
    negative slot skips that tree); the higher score wins, ties go to ``a``. ``out_*`` need
    ``4 * max_tokens``. Returns ``(offset, k, score, match_len)``."""
    D = max(mem_a[M_MAX_DEPTH], mem_b[M_MAX_DEPTH])
    scr = (np.empty(D + 1, np.int64), np.empty(D + 1, np.int64), np.empty(D + max_tokens + 1, np.int32))
    return _draft_two_trees_with_scratch(mem_a, s_a, prior_a, mem_b, s_b, prior_b, (max_tokens, min_prob, factor), (out_tok, out_prob), scr)


@njit(cache=True)
def _draft_two_trees_with_scratch(mem_a, s_a, prior_a, mem_b, s_b, prior_b, limits, out, scr):
    """:func:`draft_two_trees` with ``limits`` = ``(max_tokens, min_prob, factor)``, ``out`` = ``(out_tok, out_prob)`` and
    caller-provided scratch ``scr`` (see :func:`_draft_sequence_with_scratch`).
    Tree ``b`` drafts with tree ``a``'s score as its floor: only a better draft can win, so no other
    is looked for."""
    max_tokens, min_prob, factor = limits
    out_tok, out_prob = out
    off = 0
    k = 0
    score = 0.0
    mlen = 0
    if s_a >= 0:
        off, k, score, mlen = _draft_sequence_with_scratch(walk_views(mem_a), s_a, walk_settings(max_tokens, min_prob, factor, 1, prior_a),
                                                           out, scr)
    if s_b >= 0:
        ob, kb, sb, mb = _draft_sequence_with_scratch(walk_views(mem_b), s_b, walk_settings(max_tokens, min_prob, factor, 1, prior_b),
                                                      (out_tok[2 * max_tokens :], out_prob[2 * max_tokens :]), scr, score)
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
# * ``ri``: ``int64[handles, R_COLS]``, per request handle: ``R_PROBLEM_TREE`` problem tree index
#   (-1: none), ``R_PROBLEM_SLOT`` its sequence slot there, ``R_REQUEST_TREE`` request tree index
#   (-1: none), ``R_REQUEST_SLOT`` its slot there, ``R_NUM_TOKENS`` tokens (prompt + output)
#   appended so far, ``R_GLOBAL_SLOT`` the slot of its live sequence in the drafter's global tree
#   (-1: none);
# * ``rw``: ``float64[handles]``, the weight of the request's sequence in its problem tree;
# * ``tprior``: ``float64[tree indices]``, the prior of a problem tree (in its weight units).

R_PROBLEM_TREE = 0
R_PROBLEM_SLOT = 1
R_REQUEST_TREE = 2
R_REQUEST_SLOT = 3
R_NUM_TOKENS = 4
R_GLOBAL_SLOT = 5
R_COLS = 6

# check_batch error codes (with the row and, for 4, the column of the bad value)
E_START = 1  # starts[r] < 0
E_ORDER = 2  # ends[r] < starts[r]
E_END = 3  # ends[r] > width of the token array
E_TOKEN = 4  # tokens[r, c] out of [0, VOCAB_LIMIT)


@njit(cache=True)
def first_bad_token(a):
    """Index of the first token of ``a`` (a 1-D integer array) outside ``[0, VOCAB_LIMIT)``, or -1
    if there is none. The verbs and the append kernels check their tokens with it before changing anything: a
    kernel call costs a fraction of numpy's two comparisons, ``|`` and ``any`` on an array of a
    few tokens, which ``add_tokens`` would pay on every call."""
    for i in range(a.shape[0]):
        t = a[i]
        if t < 0 or t >= VOCAB_LIMIT:
            return i
    return -1


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
    the count to ``ri[h, R_NUM_TOKENS]``. The rows must have passed :func:`check_batch`.

    Returns ``(row, part, done)``: ``(-1, 0, 0)`` when every row is in, else the first row whose
    tree ran short of capacity (``part`` 0: its problem tree, 1: its request tree) and how many of
    the row's tokens that tree took; the caller grows that tree, inserts the rest of the row (for
    ``part`` 0 also into the request tree) and calls again from ``row + 1``."""
    for r in range(row0, handles.shape[0]):
        part, d = add_row(trees, ri, rw, handles[r], tokens, starts, ends, r)
        if part >= 0:
            return r, part, d
    return -1, 0, 0


@njit(cache=True, nogil=True)  # nogil: the drafter may run it on a thread of its own (``defer_global``)
def add_batch_global(mem, ri, handles, tokens, starts, ends, row0):
    """Append ``tokens[r, starts[r]:ends[r]]`` to request ``handles[r]``'s live sequence in the
    global tree ``mem`` (slot ``ri[h, R_GLOBAL_SLOT]``, weight 1; -1: none), for rows ``r >=
    row0`` in order. One thread: every row shares the tree. Returns ``(-1, 0)``, or the first row
    whose append ran short of capacity and how many of its tokens went in (the caller grows the
    tree, appends the rest and calls again from ``row + 1``)."""
    meta, nodes, weights, hash_table, seqs, pool = borrowed_views(mem)
    for r in range(row0, handles.shape[0]):
        s = ri[handles[r], R_GLOBAL_SLOT]
        a = starts[r]
        n = ends[r] - a
        if s < 0 or n <= 0:
            continue
        d = _append_tokens(nodes, weights, hash_table, meta, seqs, pool, s, tokens[r, a : a + n], 1.0)
        if d < n:
            return r, d
    return -1, 0


@njit(cache=True, inline="always")
def add_row(trees, ri, rw, h, tokens, starts, ends, r):
    """Row ``r`` of :func:`add_batch`; returns ``(-1, 0)``, or ``(part, done)`` when a tree ran short."""
    a = starts[r]
    n = ends[r] - a
    if n <= 0:
        return -1, 0
    seg = tokens[r, a : a + n]
    ri[h, R_NUM_TOKENS] += n
    pt = ri[h, R_PROBLEM_TREE]
    if pt >= 0:
        meta, nodes, weights, hash_table, seqs, pool = borrowed_views(trees[pt])
        d = _append_tokens(nodes, weights, hash_table, meta, seqs, pool, ri[h, R_PROBLEM_SLOT], seg, rw[h])
        if d < n:
            return 0, d
    rt = ri[h, R_REQUEST_TREE]
    if rt >= 0:
        meta, nodes, weights, hash_table, seqs, pool = borrowed_views(trees[rt])
        d = _append_tokens(nodes, weights, hash_table, meta, seqs, pool, ri[h, R_REQUEST_SLOT], seg, 1.0)
        if d < n:
            return 1, d
    return -1, 0


@njit(cache=True)
def draft_batch(trees, ri, tprior, req_prior, handles, budgets, min_probs, factor, max_depth, out_tok, out_prob,
                out_len):
    """:func:`draft_two_trees` for every row: request ``handles[r]`` drafts up to ``budgets[r]`` tokens
    (``<= out_tok.shape[1]``) from its problem tree (prior ``tprior[tree]``) and its request tree
    (prior ``req_prior``), the higher score wins (ties: the problem tree). Writes the draft to
    ``out_tok[r, :k]`` / ``out_prob[r, :k]`` (the rest of the row: -1 / 0.0) and ``k`` to
    ``out_len[r]``. Row ``r``'s draft stops before its path probability falls below
    ``min_probs[r]`` (float64, one per row). ``max_depth``: the trees' (the largest, if they
    differ). One thread."""
    _draft_rows(trees, ri, tprior, req_prior, handles, budgets, min_probs, factor, max_depth, (out_tok, out_prob, out_len), 0, 1)


@njit(cache=True, parallel=True)
def draft_batch_parallel(trees, ri, tprior, req_prior, handles, budgets, min_probs, factor, max_depth, outs, parts):
    """:func:`draft_batch` on ``parts`` threads (numba's ``prange``), ``outs`` = ``(out_tok, out_prob, out_len)``: part ``p``
    drafts rows ``p, p + parts, ...``, each part with its own scratch arrays. Rows only read the trees and write their
    own output row, so the drafts are the same as on one thread."""
    for p in prange(parts):
        _draft_rows(trees, ri, tprior, req_prior, handles, budgets, min_probs, factor, max_depth, outs, p, parts)


@njit(cache=True)
def _draft_rows(trees, ri, tprior, req_prior, handles, budgets, min_probs, factor, max_depth, outs, first, stride):
    """:func:`draft_batch` for rows ``first, first + stride, ...`` (``outs``: ``(out_tok, out_prob, out_len)``), with its
    own scratch arrays."""
    out_tok, out_prob, out_len = outs
    width = out_tok.shape[1]
    st = np.empty(4 * width + 4, np.int32)
    sp = np.empty(4 * width + 4, np.float32)
    D = max_depth
    scr = (np.empty(D + 1, np.int64), np.empty(D + 1, np.int64), np.empty(D + width + 1, np.int32))
    out = (st, sp)
    for r in range(first, handles.shape[0], stride):
        m = budgets[r]
        k = 0
        if m > 0:
            h = handles[r]
            pt = ri[h, R_PROBLEM_TREE]
            rt = ri[h, R_REQUEST_TREE]
            if pt >= 0 or rt >= 0:
                if pt >= 0:
                    ma = trees[pt]
                    sa = ri[h, R_PROBLEM_SLOT]
                    pa = tprior[pt]
                else:
                    ma = trees[rt]
                    sa = -1
                    pa = 0.0
                if rt >= 0:
                    mb = trees[rt]
                    sb = ri[h, R_REQUEST_SLOT]
                else:
                    mb = ma
                    sb = -1
                off, k, score, mlen = _draft_two_trees_with_scratch(ma, sa, pa, mb, sb, req_prior, (m, min_probs[r], factor), out, scr)
                for j in range(k):
                    out_tok[r, j] = st[off + j]
                    out_prob[r, j] = sp[off + j]
        out_len[r] = k
        for j in range(k, width):
            out_tok[r, j] = -1
            out_prob[r, j] = 0.0
