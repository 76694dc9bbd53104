"""An engine step's rows on the drafter's threads: how they are split, and the threaded append.

The batch verbs of :class:`das.drafter.DASDrafter` run their kernels on several threads (numba
``prange``, as vLLM's n-gram proposer batches its rows) from :data:`PARALLEL_ROWS` rows on: below
that, waking the threads costs about what they save. Drafting splits rows freely (a row writes
only its own output); appending splits them by tree (rows that share a tree share a thread), and
:func:`insert_owners` decides which thread appends which tree. Every kernel runs on a numba team
cut to its parts (:func:`on_threads`). The results are those of one thread.

Appending (:meth:`das.drafter.DASDrafter.add_tokens_batch` checks the rows, then calls
:func:`append_rows` on one thread or :func:`append_rows_threaded` on ``parts`` threads). A step does
three things that touch disjoint memory: it appends each row's tokens to its problem and request
trees, appends them to the row's live sequence in the global tree (``mix`` chooser), and teaches
the mixer the outcomes of the rows' pending drafts (weights and outcome tables, ``mix`` chooser).
On several threads (:func:`insert_batch_parallel`) the first is split over the parts by tree (rows
sharing a tree share a part, so no two threads touch one tree); the global tree's append and the
learning run as extra work of two of those parts instead of one after the other on one thread while
the other threads wait (docs/benchmarks.md, "Evidence from code comments"). The results are those
of the serial order: no piece of work reads what another writes, and each tree is appended to in
row order. From :data:`BALANCED_PARTS` parts on, which part appends which tree is chosen per step
by :func:`balance_parts`, so that the parts that carry the global tree or the learning get fewer
trees (below it: tree id modulo the parts). A tree that runs short of capacity stops its kernel at
that row: the row is finished here (the tree grows) and the kernel goes on from the next row.

The constants are module globals read at each call, so that a benchmark or a test may set them
for a run. The figures behind them: docs/benchmarks.md, "Evidence from code comments".
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from das import trie_kernels as kernels
from das.global_tree import GlobalTree
from das.mix_kernels import learn_rows
from das.mixer_state import MixerState
from das.request_table import Request, RequestTable
from das.tree_table import TreeTable
from das.trie_kernels import add_batch_global, add_row

__all__ = ["BALANCED_PARTS", "GLOBAL_APPEND_COST", "LEARN_COST", "PARALLEL_ROWS", "append_rows", "append_rows_threaded", "balance_parts",
           "finish_row", "insert_batch_parallel", "insert_owners", "on_threads", "threads_for"]


# Rows from which the batch verbs run on several threads.
PARALLEL_ROWS = 16
# The global tree's append and the mixer's learning, per appended token, in units of a row's
# appends to its problem and request trees (on one thread at 256 rows). They set how many
# trees the parts that carry those two pieces get (:func:`balance_parts`).
GLOBAL_APPEND_COST = 0.3
LEARN_COST = 0.15
# Parts from which a step's trees are balanced over the parts (below: dealt by tree id modulo the
# parts). With two or three parts the global tree's append and the learning already sit on
# different threads, and balancing (its own cost, and tree groups that change from step to step)
# costs more than the evening out saves.
BALANCED_PARTS = 4


def threads_for(rows: int, threads: int) -> int:
    """Threads for a batch call of ``rows`` rows by a drafter of ``threads`` draft threads: 1 below
    :data:`PARALLEL_ROWS`, else ``threads`` as far as numba has them."""
    if threads < 2 or rows < PARALLEL_ROWS:
        return 1
    return min(threads, numba.get_num_threads())


def insert_owners(keys: np.ndarray, work: np.ndarray, parts: int, global_part: int, learn_part: int) -> np.ndarray:
    """Which of ``parts`` threads appends each row of a step (``int64[rows]`` in ``[0, parts)``).

    Rows with the same ``keys[r]`` (their tree's index, ``int64[rows]``, ``>= 0``) get the same
    part. From :data:`BALANCED_PARTS` parts on, whole trees go to the least loaded part
    (:func:`balance_parts`), counting ``work`` (``int64[rows]``, tokens each row
    appends) and, on ``global_part`` and ``learn_part`` (-1: none), the global tree's append and
    the mixer's learning (:data:`GLOBAL_APPEND_COST`, :data:`LEARN_COST` per token); below it,
    trees are dealt by index modulo ``parts``.
    """
    if parts >= BALANCED_PARTS:
        base = np.zeros(parts)
        total = float(work.sum())
        if global_part >= 0:
            base[global_part] += GLOBAL_APPEND_COST * total
        if learn_part >= 0:
            base[learn_part] += LEARN_COST * total
        return balance_parts(keys, work, parts, base)
    return keys % parts


def on_threads(parts: int, kernel, *args) -> None:
    """Call ``kernel(*args)``, a ``prange`` kernel over ``parts`` parts, with numba's team cut to
    ``parts`` threads (left alone, numba runs every parallel region on all of its threads, one per
    CPU, which then wake for parts they do not have and spin between steps); the team is restored
    after the call, also when it raises."""
    team = numba.get_num_threads()
    numba.set_num_threads(parts)
    try:
        kernel(*args)
    finally:
        numba.set_num_threads(team)


def append_rows(trees: TreeTable, requests: RequestTable, handles: np.ndarray, tokens: np.ndarray, starts: np.ndarray,
                ends: np.ndarray) -> None:
    """Append ``tokens[r, starts[r]:ends[r]]`` to request ``handles[r]``'s problem and request trees,
    rows in order, on one thread (:func:`das.trie_kernels.add_batch`; checked rows)."""
    row = 0
    while row < handles.shape[0]:
        r, part, done = kernels.add_batch(trees.bufs, requests.tree_refs, requests.problem_weights, handles, tokens, starts, ends, row)
        if r < 0:
            break
        finish_row(requests.by_handle[handles[r]], tokens[r, starts[r] : ends[r]], part, done)
        row = r + 1


def append_rows_threaded(trees: TreeTable, requests: RequestTable, mixer: MixerState, learn: bool, global_tree: GlobalTree | None,
                         handles: np.ndarray, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray, parts: int) -> None:
    """:func:`append_rows`, the mixer's learning (with ``learn``) and the global tree's
    appends (``global_tree``: None for none, or deferred) on ``parts`` threads, at once
    (:func:`insert_batch_parallel`; they touch disjoint memory, so the result is
    the serial one). Rows are split by problem tree (a row without one by its request tree), so
    each tree is appended to by one thread, in row order; the global tree's appends run on the last
    part, the learning on the first (:func:`insert_owners`). A part whose tree
    ran short stops there; that row is finished here and the part's later rows are appended on one
    thread (the global tree's likewise)."""
    refs = requests.tree_refs
    pt = refs[handles, kernels.R_PROBLEM_TREE]
    keys = np.where(pt >= 0, pt, refs[handles, kernels.R_REQUEST_TREE])
    gpart, lpart = (parts - 1 if global_tree is not None else -1), (0 if learn else -1)
    owner = insert_owners(keys, ends - starts, parts, gpart, lpart)
    stops = np.empty((parts, 3), np.int64)
    gstop = np.full(2, -1, np.int64)
    learned = np.zeros(1, np.int64)
    gmem = global_tree.tree.buffer if global_tree is not None else trees.empty
    on_threads(parts, insert_batch_parallel, trees.bufs, refs, requests.problem_weights, (handles, tokens, starts, ends), owner, stops,
               (gpart, gmem, gstop), lpart, tuple(mixer.model), mixer.lr, tuple(mixer.pending), learned)
    mixer.learned += int(learned[0])
    for p in range(parts):
        r, part, done = (int(x) for x in stops[p])
        if r < 0:
            continue
        finish_row(requests.by_handle[handles[r]], tokens[r, starts[r] : ends[r]], part, done)
        rest = np.flatnonzero(owner[r + 1 :] == p) + r + 1
        if rest.shape[0]:
            append_rows(trees, requests, handles[rest], tokens[rest], starts[rest], ends[rest])
    if global_tree is not None and gstop[0] >= 0:
        r = int(gstop[0])
        global_tree.finish_row(handles, tokens, starts, ends, r, int(gstop[1]))
        global_tree.append_rows(handles, tokens, starts, ends, r + 1)


def finish_row(req: Request, seg: np.ndarray, part: int, done: int) -> None:
    """Finish a row :func:`das.trie_kernels.add_batch` stopped at: a tree ran short of capacity
    after ``done`` tokens (``part`` 0: the problem tree, 1: the request tree)."""
    seg = np.ascontiguousarray(seg)
    if part == 0:
        req.problem.tree.extend(req.problem_seq, seg[done:])  # grows the tree and appends the rest
        if req.tree is not None:
            req.tree.extend(req.tree_seq, seg)
    else:
        req.tree.extend(req.tree_seq, seg[done:])


@njit(cache=True, parallel=True)
def insert_batch_parallel(trees, ri, rw, rows, owner, stops, global_job, lpart, model, lr, pending, learned):
    """:func:`das.trie_kernels.add_batch` of the step's ``rows`` (``(handles, tokens, starts,
    ends)``, as ``add_batch`` takes them) on ``parts = stops.shape[0]`` threads: part ``p`` appends the rows with
    ``owner[r] == p`` (``int64[rows]`` in ``[0, parts)``; rows that share a tree must share a part)
    to their problem and request trees in row order, and stops at its first row whose tree ran
    short of capacity: ``stops[p] = (row, part, done)`` (``int64[parts, 3]``, as ``add_batch``
    returns; row -1: the part finished; its later rows are left to the caller). Plus, with
    ``global_job = (gpart, gmem, gstop)``, on part ``gpart`` (-1: none) the rows' appends to the
    global tree ``gmem`` (:func:`das.trie_kernels.add_batch_global` from row 0; its return value in
    ``gstop``: ``int64[2]``), and on part ``lpart`` (-1: none) the mixer's learning (:func:`das.mix_kernels.learn_rows` with
    ``model``, ``lr`` and ``pending``; the number of outcomes learned in ``learned[0]``).
    ``gpart`` and ``lpart`` are parts in ``[0, parts)``."""
    handles, tokens, starts, ends = rows
    gpart, gmem, gstop = global_job
    parts = stops.shape[0]
    for p in prange(parts):
        if p == lpart:
            learned[0] = learn_rows(model, lr, handles, tokens, starts, ends, pending)
        if p == gpart:
            r, d = add_batch_global(gmem, ri, handles, tokens, starts, ends, 0)
            gstop[0] = r
            gstop[1] = d
        stops[p, 0] = -1
        for r in range(handles.shape[0]):
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
