"""The global tree: every live rollout and the last finished ones of every problem, and the background thread that appends to it.

The ``mix`` chooser's third scope, as arctic-inference's global cache: what the rollouts of every
problem share (formatting, common phrases). It holds each live request's rollout (prompt tail,
then output, appended as it is verified) and the last ``rollouts`` finished ones, oldest out
first. Its depth is small (the drafter's ``global_depth``): what is shared lies in contexts of a
few tokens, and deeper ones repeat what the problem and request trees know.

Deferred work (``defer``): an engine step's appends here, and stopped requests' rollouts counted
as finished (the oldest one removed), run on a background thread that the step's drafting starts
once it has drafted, so that they overlap the accelerator's verification. Every other call first
waits for that thread and runs what is still deferred (:meth:`GlobalTree.sync`); the step's drafts
read this tree one step behind (their loci here are looked up from the root). A stop's removal and
the step's appends commute, so the engine's per-step verbs leave the stops to the next background
job.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from das import trie_kernels as kernels
from das.request_table import RequestTable
from das.suffix_tree import SuffixTree
from das.tree_table import TreeTable

__all__ = ["GlobalTree"]


class GlobalTree:
    """The global tree and its deferred work (see the module docstring).

    Args:
        trees: the drafter's tree table (the tree is registered there).
        requests: the drafter's request table (it holds the live sequences' slots here).
        depth: int >= 2, the tree's ``max_depth``.
        rollouts: int >= 1, finished rollouts kept.
        defer: leave appends and finished rollouts to the background thread.

    Attributes:
        tree: the :class:`das.suffix_tree.SuffixTree`.
        index: its index in the tree table.
        finished: sequence ids of the finished rollouts kept, oldest first.
        deferred_appends: engine steps whose appends ran in the background.
        deferred_keeps: stopped requests whose rollout was counted as finished in the background (or by a later sync).
        deferred_ns: nanoseconds the deferred work took.
    """

    def __init__(self, trees: TreeTable, requests: RequestTable, depth: int, rollouts: int, defer: bool):
        self.tree = SuffixTree(depth)
        self.index = trees.add(self.tree)
        self.rollouts = rollouts
        self.defer = defer
        self.finished: deque[int] = deque()
        self.deferred_appends = 0
        self.deferred_keeps = 0
        self.deferred_ns = 0
        self._requests = requests
        self._todo = None  # the last engine step's appends, deferred: (handles, tokens, ends)
        self._keeps: list[int] = []  # stopped requests' sequences, to count as finished rollouts (deferred)
        self._job = None  # the deferred work running on the background thread (a Future)
        self._executor = None  # the background thread (a one-thread pool, made on first use)

    # ------------------------------------------------------------------ live and finished rollouts
    def add_live(self, tail: np.ndarray, reserve: int) -> tuple[int, int]:
        """A live rollout's sequence (its prompt ``tail`` so far, room for ``reserve`` tokens); returns its id and slot."""
        seq = self.tree.add(tail, reserve=reserve)
        return seq, self.tree.slot(seq)

    def stop_live(self, seq: int) -> None:
        """Live sequence ``seq``'s request stopped: count it as a finished rollout (deferred with ``defer``)."""
        if self.defer:
            self._keeps.append(seq)
        else:
            self._keep(seq)

    def add_finished(self, seq_tokens: np.ndarray) -> None:
        """Keep a finished rollout (prompt tail + output) recorded elsewhere."""
        self._keep(self.tree.add(seq_tokens))

    def _keep(self, seq: int) -> None:
        """Count sequence ``seq`` as a finished rollout; the oldest finished ones are removed past
        ``rollouts`` (live requests' sequences stay)."""
        self.finished.append(seq)
        moved = self.tree.rebuilds
        while len(self.finished) > self.rollouts:
            self.tree.remove(self.finished.popleft())
        if self.tree.rebuilds != moved:  # a rebuild moved the live sequences' slots
            self._requests.follow_global(self.tree)

    # ------------------------------------------------------------------ appends
    def append_rows(self, handles: np.ndarray, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray, row: int = 0) -> None:
        """Append ``tokens[r, starts[r]:ends[r]]`` for rows ``r >= row`` to their requests' live
        sequences (one thread; checked rows), growing the tree when it runs short."""
        while row < handles.shape[0]:
            r, done = kernels.add_batch_global(self.tree.buffer, self._requests.tree_refs, handles, tokens, starts, ends, row)
            if r < 0:
                break
            self.finish_row(handles, tokens, starts, ends, r, done)
            row = r + 1

    def finish_row(self, handles: np.ndarray, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray, r: int, done: int) -> None:
        """Finish row ``r``, whose append ran short of capacity after ``done`` tokens: grow the tree and append the rest."""
        self.tree.extend(self._requests.by_handle[handles[r]].global_seq, np.ascontiguousarray(tokens[r, starts[r] + done : ends[r]]))

    def defer_rows(self, handles: np.ndarray, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        """Keep an engine step's new tokens for the next background job (a compact copy: the engine reuses its token matrix)."""
        n = ends - starts
        width = int(n.max()) if n.shape[0] else 0
        mine = np.zeros((n.shape[0], 0), tokens.dtype)
        if width:  # columns past a row's end are clipped to the matrix and never read
            idx = np.minimum(starts[:, None] + np.arange(width), tokens.shape[1] - 1)
            mine = np.take_along_axis(tokens[: n.shape[0]], idx, axis=1)
        self._todo = (handles.copy(), np.ascontiguousarray(mine), n.copy())

    # ------------------------------------------------------------------ the background thread
    def sync(self, keeps: bool = True) -> None:
        """Bring the tree up to date before anything else reads or changes it: wait for the
        background job (re-raising its error), then append a deferred step no :meth:`start`
        started, and with ``keeps`` count the deferred stopped requests' sequences as finished.
        The engine's per-step verbs pass ``keeps=False``: their changes commute with those."""
        if self._job is not None:
            self.join()
        if self._todo is not None:
            todo, self._todo = self._todo, None
            self._append_deferred(*todo)
        if keeps and self._keeps:
            self._keep_deferred(self._take_keeps())

    def join(self) -> None:
        """Wait for the background job, if one runs (re-raising its error)."""
        if self._job is not None:
            job, self._job = self._job, None
            job.result()

    def start(self) -> None:
        """Run the deferred work on the background thread (while the engine verifies): the last
        step's appends, then the stopped requests' rollouts counted as finished."""
        if self._todo is None and not self._keeps:
            return
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="das-global")
        todo, self._todo = self._todo, None
        self._job = self._executor.submit(self._run_deferred, todo, self._take_keeps())
        self.deferred_appends += todo is not None

    def close(self) -> None:
        """Finish the deferred work and stop the background thread (a later :meth:`start` starts it again)."""
        self.sync()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    @property
    def pending_keeps(self) -> int:
        """Stopped requests whose rollouts wait for the next background job."""
        return len(self._keeps)

    def _take_keeps(self) -> list[int]:
        keep, self._keeps = self._keeps, []
        return keep

    def _run_deferred(self, todo, keeps: list[int]) -> None:
        if todo is not None:
            self._append_deferred(*todo)
        if keeps:
            self._keep_deferred(keeps)

    def _append_deferred(self, handles: np.ndarray, tokens: np.ndarray, ends: np.ndarray) -> None:
        """A deferred step's appends (its own copy of the rows' new tokens, from column 0)."""
        t0 = time.perf_counter_ns()
        self.append_rows(handles, tokens, np.zeros_like(ends), ends)
        self.deferred_ns += time.perf_counter_ns() - t0

    def _keep_deferred(self, seqs: list[int]) -> None:
        """Deferred stops' rollouts counted as finished, in their order."""
        t0 = time.perf_counter_ns()
        for seq in seqs:
            self._keep(seq)
        self.deferred_keeps += len(seqs)
        self.deferred_ns += time.perf_counter_ns() - t0
