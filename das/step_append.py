"""An engine step's appends: every row's verified tokens into its request's problem and request trees, on one thread or several.

:meth:`das.drafter.DASDrafter.add_tokens_batch` checks the rows, then calls :func:`append_rows`
(one thread) or :func:`append_rows_threaded` (``parts`` threads, with the mixer's learning and the
global tree's appends as extra work of two parts). Both append each row in row order within its
tree, so the trees are the same either way. A tree that runs short of capacity stops its
kernel at that row: the row is finished here (the tree grows) and the kernel goes on from the
next row.
"""

from __future__ import annotations

import numpy as np

from das import step_kernels, step_threads
from das import trie_kernels as kernels
from das.global_tree import GlobalTree
from das.mixer_state import MixerState
from das.request_table import Request, RequestTable
from das.tree_table import TreeTable

__all__ = ["append_rows", "append_rows_threaded", "finish_row"]


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
    (:func:`das.step_kernels.insert_batch_parallel`; they touch disjoint memory, so the result is
    the serial one). Rows are split by problem tree (a row without one by its request tree), so
    each tree is appended to by one thread, in row order; the global tree's appends run on the last
    part, the learning on the first (:func:`das.step_threads.insert_owners`). A part whose tree
    ran short stops there; that row is finished here and the part's later rows are appended on one
    thread (the global tree's likewise)."""
    refs = requests.tree_refs
    pt = refs[handles, kernels.R_PROBLEM_TREE]
    keys = np.where(pt >= 0, pt, refs[handles, kernels.R_REQUEST_TREE])
    gpart, lpart = (parts - 1 if global_tree is not None else -1), (0 if learn else -1)
    owner = step_threads.insert_owners(keys, ends - starts, parts, gpart, lpart)
    stops = np.empty((parts, 3), np.int64)
    gstop = np.full(2, -1, np.int64)
    learned = np.zeros(1, np.int64)
    gmem = global_tree.tree.buffer if global_tree is not None else trees.empty
    m = mixer
    step_threads.on_threads(parts, step_kernels.insert_batch_parallel, trees.bufs, refs, requests.problem_weights, handles, tokens, starts,
                            ends, owner, parts, stops, gmem, gpart, gstop, lpart, learned, m.weights, m.grad_sq, m.lr, m.pending_tokens,
                            m.pending_inputs, m.pending_sets, m.pending_lengths, m.outcomes, m.pending_prev, m.pending_profiles,
                            m.pending_stop)
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
