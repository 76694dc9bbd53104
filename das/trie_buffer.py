"""The storage of one suffix trie: its ``int64`` buffer and the views of it, growth, sequence slots and the token pool.

:class:`TrieBuffer` is the base of :class:`das.suffix_tree.SuffixTree`, which adds the sequences
and the queries. The buffer holds the nodes, their weighted counts, the hash table, the sequence
table and the token pool as :mod:`das.trie_kernels` lays them out; the kernels take it as
``mem``. Capacities grow by doubling, a sequence's pool segment doubles when it runs out (moving
to the pool's end), and the pool is compacted before it grows when a third of it is garbage.
Whenever the trie moves to a new buffer, the buffer listener hears of it
(:meth:`TrieBuffer.set_buffer_listener`), so that an owner who keeps the buffer for batch
kernels never holds a stale one.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from das import trie_kernels as kernels

__all__ = ["TrieBuffer"]

_INIT_NODES = 256
_INIT_SEQS = 4
_INIT_POOL = 256
_MIN_SEG = 16
_INIT_HASH_MIN = 1024


class TrieBuffer:
    """A trie's buffer and its bookkeeping (node rows, hash slots, sequence slots, pool tokens).

    Args:
        max_depth: int in [1, 10000], longest stored string (tokens).
        capacity: int >= 0, tokens the trie is expected to hold (a sizing hint): node rows and pool
            are allocated for that many up front.

    Raises:
        ValueError: ``max_depth`` or ``capacity`` not an int or out of range.
    """

    __slots__ = ("_max_depth", "_capacity", "_buffer", "_buffer_listener", "_meta", "_nodes", "_weights", "_hash_table", "_seq_table",
                 "_pool", "_slots", "_free_slots", "_pool_top", "_pool_garbage", "_zombies", "_zombie_tokens")

    def __init__(self, max_depth: int, capacity: int = 0):
        if isinstance(max_depth, bool) or not isinstance(max_depth, (int, np.integer)) or max_depth < 1:
            raise ValueError(f"max_depth must be an int >= 1, got {max_depth!r}")
        if max_depth > 10_000:
            raise ValueError(f"max_depth must be <= 10000, got {max_depth!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0 (tokens), got {capacity!r}")
        self._max_depth = int(max_depth)
        self._capacity = int(capacity)
        self._buffer_listener = None  # called with the new buffer whenever the trie moves to one (see _set_buffer)
        self._reset()

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
        self._buffer = kernels.new_buffer(words)
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
        mem = kernels.new_buffer(words)
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

    def _rebuild_caps(self) -> tuple[int, int, int, int]:
        """Capacities of the buffer a rebuild from the stored sequences starts in: room for the
        same nodes and hashed children twice over (the same strings), at most the old capacities;
        the old sequence slots and pool (they held the removed sequences too, so the next adds fit)."""
        m = self._meta
        D = self._max_depth
        init = self._initial_caps()
        old = (int(m[kernels.M_NODE_CAP]), int(m[kernels.M_HASH_CAP]))
        ncap = max(init[0], min(old[0], _pow2(2 * (int(m[kernels.M_LIVE_NODES]) + kernels.node_headroom(D)))))
        hcap = max(init[1], min(old[1], _pow2(4 * (int(m[kernels.M_HASH_ENTRIES]) + kernels.hash_headroom(D)))))
        return ncap, hcap, int(m[kernels.M_SEQ_CAP]), int(m[kernels.M_POOL_CAP])

    @property
    def buffer(self) -> np.ndarray:
        """The trie's storage: one C-contiguous ``np.int64`` array holding the nodes, their weighted
        counts, the hash table, the sequence table and the token pool (layout: :mod:`das.trie_kernels`,
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


def _pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())
