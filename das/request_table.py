"""The drafter's live requests: each request's record, its handle, and the arrays the batch kernels read per handle.

A live request gets a *handle*, a row of the per-handle arrays that every batch kernel indexes:
:attr:`RequestTable.tree_refs` says where its sequences are (its trees' indices in the
:class:`das.tree_table.TreeTable` and its sequences' slots there, as the ``R_*`` columns of
:mod:`das.trie_kernels`) and how many tokens it has; :attr:`RequestTable.problem_weights` the
weight its tokens are appended with in its problem tree. An engine step turns its request ids into
handles in one C-level pass (:meth:`RequestTable.handles_of`); a stopped request's handle is
reused. Whenever a tree moves a live request's sequence (a rebuild after removals, a rescale that
changes its weight, an evicted problem), the table follows (:meth:`RequestTable.follow_problem`,
:meth:`RequestTable.detach_problem`, :meth:`RequestTable.follow_global`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from das.trie_kernels import R_COLS, R_GLOBAL_SLOT, R_PROBLEM_SLOT, R_PROBLEM_TREE, R_REQUEST_SLOT, R_REQUEST_TREE

if TYPE_CHECKING:
    from das.problem_store import Problem
    from das.suffix_tree import SuffixTree

__all__ = ["Request", "RequestTable"]


class Request:
    """A live rollout: what it drafts from and appends to."""

    __slots__ = ("problem_id", "problem", "problem_seq", "version", "tree", "tree_seq", "tree_slot", "handle", "tree_index", "prompt_len",
                 "global_seq")

    def __init__(self, problem_id: Hashable, problem: Problem, problem_seq: int, version: int, tree: SuffixTree | None,
                 tree_seq: int | None, tree_slot: int | None, handle: int, tree_index: int, prompt_len: int):
        self.problem_id = problem_id
        self.problem: Problem | None = problem  # None once the problem is evicted
        self.problem_seq = problem_seq  # its rollout's sequence id in problem.tree
        self.version = version  # the policy version it started in
        self.tree = tree  # its request tree (prompt + own output), or None
        self.tree_seq = tree_seq  # the request tree's only sequence, its id
        self.tree_slot = tree_slot  # and its slot (a request tree never removes, so it never moves)
        self.handle = handle  # its row of the table's per-handle arrays
        self.tree_index = tree_index  # the request tree's index in the tree table (-1: none)
        self.prompt_len = prompt_len  # prompt tokens
        self.global_seq = -1  # its live sequence in the drafter's global tree (-1: none)


class RequestTable:
    """Live requests by id and by handle, and the per-handle arrays of the batch kernels.

    Attributes:
        requests: request id -> :class:`Request`.
        handles: request id -> handle.
        by_handle: handle -> :class:`Request` (None: free).
        tree_refs: ``int64[capacity, R_COLS]``, per handle: problem tree index, its sequence slot,
            request tree index, its slot, tokens so far (prompt + output), global tree slot (the
            ``R_*`` columns of :mod:`das.trie_kernels`; -1: none). Reallocated as it grows: read it
            again after :meth:`new_handle`.
        problem_weights: ``float64[capacity]``, per handle: the weight of its problem-tree sequence.
    """

    def __init__(self, capacity: int = 16):
        self.requests: dict[Hashable, Request] = {}
        self.handles: dict[Hashable, int] = {}
        self.tree_refs = np.full((capacity, R_COLS), -1, np.int64)
        self.problem_weights = np.ones(capacity, np.float64)
        self.by_handle: list[Request | None] = [None] * capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._stamp = np.empty(0, np.int64)  # scratch of distinct(), one slot per handle

    def __contains__(self, req_id: Hashable) -> bool:
        return req_id in self.requests

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def capacity(self) -> int:
        """Handles the per-handle arrays hold."""
        return self.tree_refs.shape[0]

    def new_handle(self) -> int:
        """A free handle (the arrays double when none is left)."""
        if not self._free:
            n = self.tree_refs.shape[0]
            self.tree_refs = np.concatenate([self.tree_refs, np.full((n, R_COLS), -1, np.int64)])
            self.problem_weights = np.concatenate([self.problem_weights, np.ones(n, np.float64)])
            self.by_handle.extend([None] * n)
            self._free = list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()

    def add(self, req_id: Hashable, req: Request) -> None:
        """Register ``req`` (its handle from :meth:`new_handle`) as live request ``req_id``."""
        self.requests[req_id] = req
        self.handles[req_id] = req.handle
        self.by_handle[req.handle] = req

    def pop(self, req_id: Hashable) -> Request | None:
        """Take request ``req_id`` out of the live requests (None if it is not one); its handle stays
        taken until :meth:`free_handle`."""
        req = self.requests.pop(req_id, None)
        if req is not None:
            del self.handles[req_id]
        return req

    def free_handle(self, h: int) -> None:
        """Clear handle ``h``'s row and make it free for the next request."""
        self.tree_refs[h] = -1
        self.by_handle[h] = None
        self._free.append(h)

    def handles_of(self, req_ids: Sequence[Hashable]) -> np.ndarray:
        """``int64[len(req_ids)]`` handles of live requests (one C-level pass, no Python loop).

        Raises:
            KeyError: an id that is not a live request.
            ValueError: ``req_ids`` not a sequence of hashable ids.
        """
        try:
            n = len(req_ids)
        except TypeError:
            raise ValueError(f"req_ids must be a sequence of request ids, got {type(req_ids).__name__}") from None
        try:
            return np.fromiter(map(self.handles.__getitem__, req_ids), np.int64, n)
        except KeyError as e:
            raise KeyError(f"unknown request {e.args[0]!r}") from None
        except TypeError as e:
            raise ValueError(f"req_ids must hold hashable request ids: {e}") from None

    def distinct(self, handles: np.ndarray) -> bool:
        """Whether no handle repeats: each row writes its index into its handle's stamp, and a
        repeated handle keeps only one of them (two vector ops; ``np.unique`` sorts, 5x the time
        at 256 rows)."""
        if self._stamp.shape[0] < self.tree_refs.shape[0]:
            self._stamp = np.empty(self.tree_refs.shape[0], np.int64)
        rows = np.arange(handles.shape[0])
        self._stamp[handles] = rows
        return bool(np.array_equal(self._stamp[handles], rows))

    def follow_problem(self, problem: Problem) -> None:
        """Read the slots (moved by a rebuild) and weights (changed by a rescale) of ``problem``'s live requests' sequences again."""
        tree = problem.tree
        for rid, sid in problem.live.items():
            h = self.requests[rid].handle
            slot, w = tree.slot_and_weight(sid)
            self.tree_refs[h, R_PROBLEM_SLOT] = slot
            self.problem_weights[h] = w

    def detach_problem(self, problem: Problem) -> None:
        """``problem`` is evicted: its live requests go on without its tree."""
        for rid in problem.live:
            req = self.requests[rid]
            req.problem = None
            self.tree_refs[req.handle, R_PROBLEM_TREE] = -1
            self.tree_refs[req.handle, R_PROBLEM_SLOT] = -1

    def follow_global(self, tree: SuffixTree) -> None:
        """Read the slots of the live requests' sequences in the global ``tree`` again (after a rebuild moved them)."""
        for req in self.requests.values():
            if req.global_seq >= 0:
                self.tree_refs[req.handle, R_GLOBAL_SLOT] = tree.slot(req.global_seq)

    def check(self, global_tree: SuffixTree | None) -> dict[int, SuffixTree]:
        """Slow check (for tests) that the per-handle arrays agree with the requests (their trees'
        indices, their sequences' slots and weights, in ``global_tree`` too unless None); returns the
        request trees by tree index. Raises AssertionError otherwise."""
        assert set(self.handles) == set(self.requests)
        trees = {}
        for rid, req in self.requests.items():
            h = self.handles[rid]
            assert req.handle == h and self.by_handle[h] is req
            row = self.tree_refs[h]
            if req.problem is not None:
                slot, w = req.problem.tree.slot_and_weight(req.problem_seq)
                assert (row[R_PROBLEM_TREE], row[R_PROBLEM_SLOT]) == (req.problem.tree_index, slot), rid
                assert self.problem_weights[h] == w, rid
            else:
                assert row[R_PROBLEM_TREE] == -1, rid
            if req.tree is not None:
                assert (row[R_REQUEST_TREE], row[R_REQUEST_SLOT]) == (req.tree_index, req.tree_slot), rid
                trees[req.tree_index] = req.tree
            else:
                assert row[R_REQUEST_TREE] == -1, rid
            if global_tree is not None:
                assert row[R_GLOBAL_SLOT] == global_tree.slot(req.global_seq), rid
        return trees
