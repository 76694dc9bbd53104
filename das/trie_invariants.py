"""A slow check that a suffix trie's arrays are consistent (:meth:`das.suffix_tree.SuffixTree.check_invariants`, for tests).

It reads the buffer as :mod:`das.trie_kernels` lays it out and checks every node against the
strings of the stored sequences: the free list, the sibling lists and their filters or hash
entries, the counts and best children, the pool segments, and each sequence's active loci.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from das import trie_kernels as kernels

__all__ = ["check_trie"]


def check_trie(buffer: np.ndarray, slots: Mapping[int, int], seq_slots: Mapping[int, int], zombies: Sequence[int], zombie_tokens: int,
               pool_top: int) -> None:
    """Check a trie's arrays; raise AssertionError at the first inconsistency.

    Args:
        buffer: the trie's ``int64`` buffer (:attr:`das.suffix_tree.SuffixTree.buffer`).
        slots: sequence slot -> sequence id, of the stored sequences.
        seq_slots: sequence id -> its slot (the inverse of ``slots``).
        zombies: slots of removed sequences whose tokens node labels still reference.
        zombie_tokens: the tokens of those.
        pool_top: the end of the used part of the token pool.
    """
    meta, nodes, weights, hash_table, seq_table, pool = kernels.buffer_views(buffer)
    D = int(meta[kernels.M_MAX_DEPTH])
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
    for slot, sid in slots.items():
        assert seq_slots[sid] == slot and seq_table[slot, kernels.S_STATE] == 1
    for z in zombies:
        assert seq_table[z, kernels.S_STATE] == 2
    assert zombie_tokens == sum(int(seq_table[z, kernels.S_LEN]) for z in zombies)
    assert int(meta[kernels.M_NUM_TOKENS]) == sum(int(seq_table[s, kernels.S_LEN]) for s in slots)
    # segments lie inside the pool and do not overlap
    segs = sorted((int(seq_table[s, kernels.S_BASE]),
                   int(seq_table[s, kernels.S_CAP] if seq_table[s, kernels.S_STATE] == 1 else seq_table[s, kernels.S_LEN]))
                  for s in list(slots) + list(zombies))
    top = 0
    for base, cap in segs:
        assert base >= top and base + cap <= pool_top <= pool.shape[0]
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
                assert kernels.hash_lookup(hash_table, meta[kernels.M_HASH_SHIFT], np.int64(key)) == c
            hent += len(kids)
    assert hent == meta[kernels.M_HASH_ENTRIES], (hent, meta[kernels.M_HASH_ENTRIES])
    assert int((hash_table[:, 0] != -1).sum()) == hent
    # every stored sequence's active loci end exactly at its suffixes
    for slot in slots:
        n = int(seq_table[slot, kernels.S_LEN])
        b = int(seq_table[slot, kernels.S_BASE])
        toks = tuple(int(x) for x in pool[b : b + n])
        for d in range(0, min(n, D) + 1):
            u = int(seq_table[slot, kernels.S_LOCI + d])
            assert u in strings and strings[u] == toks[n - d :], (slot, d)
