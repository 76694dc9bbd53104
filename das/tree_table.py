"""The drafter's trees by index, as the batch kernels read them: their buffers in one numba typed List, and their priors."""

from __future__ import annotations

from functools import partial

import numpy as np

from das.suffix_tree import SuffixTree

__all__ = ["TreeTable"]


class TreeTable:
    """Buffers of a drafter's trees (problem, request and global trees) by tree index.

    A registered tree reports every new buffer it moves to (:meth:`SuffixTree.set_buffer_listener`),
    so the table never holds a stale one. Indices of released trees are reused first.

    Attributes:
        bufs: numba typed ``List[int64[::1]]``, tree index -> the tree's buffer (:attr:`empty` where free).
        prior: ``float64[n]``, tree index -> the drafting prior of a problem tree, in its weight
            units (0.0 for the other trees: request trees use the drafter's ``prior``).
        free: free indices, the next one last.
        empty: ``int64[1]``, what a free index holds (and what a kernel gets for a tree it skips).
    """

    def __init__(self):
        from numba import types
        from numba.typed import List

        self.bufs = List.empty_list(types.int64[::1])
        self.prior = np.zeros(16, np.float64)
        self.empty = np.zeros(1, np.int64)
        # A typed List compiles each method on its first call in a process (not cached on disk):
        # call them here, at construction, not in an engine step. Index 0 starts free.
        self.bufs.append(self.empty)
        self.bufs[0] = self.empty
        len(self.bufs)
        self.free: list[int] = [0]

    def add(self, tree: SuffixTree) -> int:
        """Register ``tree``; returns its index."""
        if self.free:
            i = self.free.pop()
            self.bufs[i] = tree.buffer
        else:
            i = len(self.bufs)
            self.bufs.append(tree.buffer)
            if i >= self.prior.shape[0]:
                self.prior = np.concatenate([self.prior, np.zeros_like(self.prior)])
        self.prior[i] = 0.0
        tree.set_buffer_listener(partial(self.bufs.__setitem__, i))
        return i

    def release(self, i: int, tree: SuffixTree) -> None:
        """Forget tree ``i`` (its index may be reused)."""
        tree.set_buffer_listener(None)
        self.bufs[i] = self.empty
        self.prior[i] = 0.0
        self.free.append(i)

    def check(self, live: dict[int, SuffixTree]) -> None:
        """Slow check (for tests): every index of ``live`` (index -> tree, all the registered trees)
        holds its tree's current buffer, and the other indices are free. Raises AssertionError otherwise."""
        for i, tree in live.items():
            buf = self.bufs[i]
            assert buf.ctypes.data == tree.buffer.ctypes.data and buf.shape == tree.buffer.shape, i
        assert len(live) + len(self.free) == len(self.bufs)
