"""Numba kernel of a step's insert on several threads: every write the step's verified tokens cause, at once.

A step of :meth:`das.drafter.DASDrafter.add_tokens_batch` does three things that touch disjoint
memory: it appends each row's tokens to its problem and request trees, appends them to the
row's live sequence in the global tree (``mix`` chooser), and teaches the mixer the outcomes of
the rows' pending drafts (weights and outcome tables, ``mix`` chooser). The first is split over
the parts by tree (rows sharing a tree share a part, so no two threads touch one tree); the
global tree's append and the learning run as extra work of two of those parts instead of one
after the other on one thread while the other threads wait (docs/benchmarks.md, "Evidence from code comments").
The results are those of the serial order: no piece of work reads what another writes. From
:data:`das.step_threads.BALANCED_PARTS` parts on,
which part appends which tree is chosen per step by :func:`balance_parts`, so that the parts that
carry the global tree or the learning get fewer trees (below it: tree id modulo the parts).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from das.mix_kernels import learn_rows
from das.trie_kernels import add_batch_global, add_row


@njit(cache=True, parallel=True)
def insert_batch_parallel(trees, ri, rw, handles, tokens, starts, ends, owner, parts, stops, gmem, gpart, gstop, lpart, learned,
                          wt, g2, lr, dtok, dx, dset, dk, outcomes, dprev, dsup, dstop):
    """:func:`das.trie_kernels.add_batch` on ``parts`` threads: part ``p`` appends the rows with
    ``owner[r] == p`` (``int64[rows]`` in ``[0, parts)``; rows that share a tree must share a part)
    to their problem and request trees in row order, and stops at its first row whose tree ran
    short of capacity: ``stops[p] = (row, part, done)`` (``int64[parts, 3]``, as ``add_batch``
    returns; row -1: the part finished; its later rows are left to the caller). Plus, on part ``gpart`` (-1: none), the rows' appends to
    the global tree ``gmem`` (:func:`das.trie_kernels.add_batch_global` from row 0; its return
    value in ``gstop``: ``int64[2]``), and on part ``lpart`` (-1: none) the mixer's learning
    (:func:`das.mix_kernels.learn_rows` with the arguments after ``learned``; the number of
    outcomes learned in ``learned[0]``). ``gpart`` and ``lpart`` are parts in ``[0, parts)``."""
    rows = handles.shape[0]
    for p in prange(parts):
        if p == lpart:
            learned[0] = learn_rows(wt, g2, lr, handles, tokens, starts, ends, dtok, dx, dset, dk, outcomes, dprev, dsup, dstop)
        if p == gpart:
            r, d = add_batch_global(gmem, ri, handles, tokens, starts, ends, 0)
            gstop[0] = r
            gstop[1] = d
        stops[p, 0] = -1
        for r in range(rows):
            if owner[r] != p:
                continue
            part, d = add_row(trees, ri, rw, handles[r], tokens, starts, ends, r)
            if part >= 0:
                stops[p, 0] = r
                stops[p, 1] = part
                stops[p, 2] = d
                break


@njit(cache=True)
def balance_parts(keys, work, parts, base):
    """Which of ``parts`` threads appends each row: rows with the same ``keys[r]`` (their tree,
    ``int64[rows]``, ``>= 0``) get the same part, and whole trees go to parts so that the largest
    load is small (longest first, each to the least loaded part: Graham's LPT rule, at most 4/3 of
    the optimum). ``work``: ``int64[rows]``, tokens each row appends; ``base``: ``float64[parts]``,
    each part's load before any tree (the global tree's append, the learning), in the same units.
    Returns ``int64[rows]`` in ``[0, parts)``. Without it, a part that also carries the global
    tree would get as many trees as the others, and the step would wait for it."""
    rows = keys.shape[0]
    order = np.argsort(keys, kind="mergesort")
    gkey = np.empty(rows, np.int64)  # the distinct keys, and the tokens of each
    gwork = np.zeros(rows, np.float64)
    g = -1
    for i in range(rows):
        r = order[i]
        if g < 0 or keys[r] != gkey[g]:
            g += 1
            gkey[g] = keys[r]
        gwork[g] += work[r]
    n = g + 1
    load = base.copy()
    part_of = np.empty(n, np.int64)
    for g in np.argsort(-gwork[:n], kind="mergesort"):
        best = 0
        for p in range(1, parts):
            if load[p] < load[best]:
                best = p
        part_of[g] = best
        load[best] += gwork[g]
    owner = np.empty(rows, np.int64)
    g = -1
    last = -1
    for i in range(rows):
        r = order[i]
        if g < 0 or keys[r] != last:
            g += 1
            last = keys[r]
        owner[r] = part_of[g]
    return owner
