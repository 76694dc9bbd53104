"""The drafter's problem trees: a window of policy versions per problem, the problem's own visits, down-weighting, LRU eviction.

One suffix tree per problem (prompt) holds the rollouts of a sliding window of recent policy
versions (DAS, arXiv 2511.13841), each rollout one sequence: the last ``max_depth - 1`` prompt
tokens, then its output, so that the first output tokens can be drafted from how earlier
rollouts began. Live sibling rollouts (GRPO samples of one prompt) are separate sequences of the
same tree, appended to as they are verified, so they see each other's tokens as they grow.

Down-weighting without rewriting trees: a rollout at age clock ``c`` is stored with weight
``decay ** -(c - base)`` (``base``: a per-problem reference). Drafting uses only ratios of counts,
so this is the same as giving each rollout weight ``decay ** age``. When a weight would exceed
``2**40``, the tree is rescaled once (:meth:`das.suffix_tree.SuffixTree.scale`) and ``base``
moves to ``c``.

Visits. The paper's window assumes a problem comes back every few versions (a small data set). On
a large data set a problem returns once per epoch, when the window has long expired its history.
So a problem also keeps the rollouts of its own last ``keep_visits`` visits (a visit: a policy
version in which it got rollouts), however old, and with ``age_in_visits`` the clock counts the
problem's own visits instead of policy versions: a rollout kept across a gap of hundreds of
versions would otherwise weigh ``decay ** gap``, nothing against the prior. When every problem
comes back every version, visits and versions count alike. Memory stays capped by
``max_problems`` (least recently used problems without live requests are evicted first).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Hashable

import numpy as np

from das.checks import as_tokens
from das.request_table import RequestTable
from das.suffix_tree import SuffixTree
from das.tree_table import TreeTable

__all__ = ["Problem", "ProblemStore", "problem_id"]

_RESCALE_LOG2 = 40.0  # rescale a problem tree when a new weight would exceed 2**40


def problem_id(prompt_token_ids) -> str:
    """Stable id of a problem: hex blake2b-128 of the prompt's token ids as int32 little-endian.

    Args:
        prompt_token_ids: 1-D integer array-like.

    Returns:
        32-character lowercase hex string (same across processes and runs).

    Raises:
        ValueError: not a 1-D integer array.
    """
    a = as_tokens(prompt_token_ids, "prompt_token_ids")
    return hashlib.blake2b(a.astype("<i4", copy=False).tobytes(), digest_size=16).hexdigest()


class Problem:
    """A problem's tree and history."""

    __slots__ = ("tree", "base", "by_version", "live", "tree_index", "visits", "last_visit")

    def __init__(self, max_depth: int, base: int):
        self.tree = SuffixTree(max_depth)
        self.base = base  # weight reference (age clock)
        self.by_version: dict[int, list[int]] = {}  # policy version -> sequence ids
        self.live: dict = {}  # request id -> sequence id, of live requests
        self.tree_index = -1  # index in the drafter's tree table
        self.visits = 0  # visits so far (policy versions in which it got rollouts): the age clock with age_in_visits
        self.last_visit = -1  # the version of its latest visit


class ProblemStore:
    """Problem trees by problem id, least recently used first (see the module docstring).

    Args: the drafter's settings of the same names (checked there), and the drafter's tree table
    (problem trees are registered there, with their priors) and request table (which follows its
    live requests' sequences when a tree moves them).
    """

    def __init__(self, trees: TreeTable, requests: RequestTable, *, window: int, decay: float, keep_visits: int, age_in_visits: bool,
                 max_depth: int, max_problems: int, prior: float):
        self.window = window
        self.decay = decay
        self.keep_visits = keep_visits
        self.age_in_visits = age_in_visits
        self.max_depth = max_depth
        self.max_problems = max_problems
        self.prior = prior
        self.version = 0  # the current policy version
        self.problems: OrderedDict[Hashable, Problem] = OrderedDict()
        self._trees = trees
        self._requests = requests
        self._log_inv_decay = -math.log(decay)  # >= 0

    def __contains__(self, pid: Hashable) -> bool:
        return pid in self.problems

    def __len__(self) -> int:
        return len(self.problems)

    def get(self, pid: Hashable) -> Problem | None:
        return self.problems.get(pid)

    # ------------------------------------------------------------------ versions
    def begin(self, version: int) -> None:
        """Make ``version`` (``>=`` the current one) current: rollouts older than the window and not of
        their problem's last ``keep_visits`` visits leave their trees (a live one when it stops), and
        problems left without rollouts or live requests are dropped."""
        self.version = version
        cutoff = version - self.window + 1
        for pid in list(self.problems):
            prob = self.problems[pid]
            old = [ver for ver in prob.by_version if ver < cutoff]
            if old and self.keep_visits:
                kept = self.kept_visits(prob)
                old = [ver for ver in old if ver not in kept]
            live_seqs = set(prob.live.values())
            for ver in old:
                keep = []
                for sid in prob.by_version.pop(ver):
                    if sid in live_seqs:
                        keep.append(sid)
                    else:
                        self._remove_seq(prob, sid)
                if keep:
                    prob.by_version[ver] = keep
            if not prob.by_version and not prob.live:
                self.drop(pid)
            else:
                self.sync(prob)  # new prior (version); slots, if a removal rebuilt the tree

    def kept_visits(self, prob: Problem, extra: int | None = None) -> set[int]:
        """The versions of ``prob``'s last ``keep_visits`` visits (with ``extra`` as one more)."""
        vers = set(prob.by_version) if extra is None else set(prob.by_version) | {extra}
        return set(sorted(vers)[-self.keep_visits:]) if self.keep_visits else set()

    def expired(self, prob: Problem, version: int, extra: int | None = None) -> bool:
        """Whether ``prob``'s rollouts of ``version`` are out of both the window and its kept visits."""
        return version < self.version - self.window + 1 and version not in self.kept_visits(prob, extra)

    def _remove_seq(self, prob: Problem, sid: int) -> None:
        """Remove a sequence from ``prob``'s tree (the caller then calls :meth:`sync`: a removal may
        rebuild the tree, which moves the live sequences' slots)."""
        if sid in prob.tree:
            prob.tree.remove(sid)

    # ------------------------------------------------------------------ weights
    def clock(self, prob: Problem, version: int) -> int:
        """The age clock of a ``version`` rollout of ``prob``: ``version``, or with
        ``age_in_visits`` the problem's visit count (a new, later version is a new visit; an older
        one, out of order, counts the kept visits after it)."""
        if not self.age_in_visits:
            return version
        if version > prob.last_visit:
            prob.visits += 1
            prob.last_visit = version
            self._trees.prior[prob.tree_index] = self.prior_of(prob)
        elif version < prob.last_visit:
            return prob.visits - sum(1 for u in prob.by_version if u > version)
        return prob.visits

    def weight(self, prob: Problem, clock: int) -> float:
        """Insertion weight in ``prob`` of a rollout at age clock ``clock`` (:meth:`clock`;
        rescales the tree if needed)."""
        e = (clock - prob.base) * self._log_inv_decay
        if e > _RESCALE_LOG2 * math.log(2.0):
            prob.tree.scale(max(self.decay ** (clock - prob.base), 1e-300))
            prob.base = clock
            e = 0.0
            self.sync(prob)  # new sequence weights and prior
        return max(math.exp(e), 1e-300)

    def prior_of(self, prob: Problem) -> float:
        """Drafting prior of ``prob``'s tree, in its weight units (one current-version rollout, or with
        ``age_in_visits`` one rollout of its latest visit, weighs ``decay ** -(clock - base)`` there)."""
        now = prob.visits if self.age_in_visits else self.version
        return self.prior * math.exp((now - prob.base) * self._log_inv_decay) if self.prior else 0.0

    # ------------------------------------------------------------------ problems
    def use(self, pid: Hashable) -> Problem:
        """Problem ``pid``, made if new (least recently used idle problems are then evicted beyond
        ``max_problems``), and marked most recently used."""
        prob = self.problems.get(pid)
        if prob is None:
            prob = Problem(self.max_depth, 1 if self.age_in_visits else self.version)  # first visit: weight 1
            prob.tree_index = self._trees.add(prob.tree)
            self._trees.prior[prob.tree_index] = self.prior_of(prob)
            self.problems[pid] = prob
            self._evict_lru(keep=pid)
        else:
            self.problems.move_to_end(pid)
        return prob

    def drop(self, pid: Hashable) -> Problem:
        """Remove a problem and its tree; its live requests (if any) go on without it."""
        prob = self.problems.pop(pid)
        self._trees.release(prob.tree_index, prob.tree)
        self._requests.detach_problem(prob)
        return prob

    def sync(self, prob: Problem) -> None:
        """Refresh what the batch kernels know of ``prob``: its prior, and its live requests'
        sequence slots (moved by a rebuild) and weights (changed by a rescale)."""
        self._trees.prior[prob.tree_index] = self.prior_of(prob)
        self._requests.follow_problem(prob)

    def _evict_lru(self, keep: Hashable) -> None:
        """Evict least recently used problems without live requests (never ``keep``) down to
        ``max_problems`` (or as close as live requests allow)."""
        excess = len(self.problems) - self.max_problems
        if excess <= 0:
            return
        for pid in list(self.problems):
            if excess <= 0:
                break
            if pid != keep and not self.problems[pid].live:
                self.drop(pid)
                excess -= 1

    # ------------------------------------------------------------------ rollouts
    def prompt_tail(self, prompt: np.ndarray) -> np.ndarray:
        """What a rollout's sequence starts with: the prompt's last ``max_depth - 1`` tokens."""
        k = min(self.max_depth - 1, prompt.shape[0])
        return prompt[prompt.shape[0] - k :]

    def start_rollout(self, pid: Hashable, req_id: Hashable, tail: np.ndarray, reserve: int) -> tuple[Problem, int]:
        """A new live rollout of ``pid`` at the current version: an empty sequence after the prompt
        ``tail``, with room for ``reserve`` tokens. Returns its problem and sequence id."""
        prob = self.use(pid)
        seq = prob.tree.add(tail, self.weight(prob, self.clock(prob, self.version)), reserve=reserve)
        prob.by_version.setdefault(self.version, []).append(seq)
        prob.live[req_id] = seq
        return prob, seq

    def stop_rollout(self, req_id: Hashable, pid: Hashable, prob: Problem, version: int, seq: int) -> None:
        """Live rollout ``req_id`` (sequence ``seq`` of ``prob``, started at ``version``) is finished:
        it stays as history, or leaves the tree if its version expired while it ran."""
        prob.live.pop(req_id, None)
        if self.expired(prob, version):
            self._remove_seq(prob, seq)
            lst = prob.by_version.get(version)
            if lst is not None and seq in lst:
                lst.remove(seq)
                if not lst:
                    del prob.by_version[version]
            if not prob.by_version and not prob.live and self.problems.get(pid) is prob:
                self.drop(pid)
            elif self.problems.get(pid) is prob:
                self.sync(prob)

    def accepts(self, pid: Hashable, version: int) -> bool:
        """Whether a finished rollout of ``version`` would be kept: in the window, or (with
        ``keep_visits``) of one of the problem's last visits."""
        if version < self.version - self.window + 1:
            known = self.problems.get(pid)
            if not self.keep_visits or (known is not None and self.expired(known, version, extra=version)):
                return False
        return True

    def add_rollout(self, prob: Problem, seq_tokens: np.ndarray, version: int) -> None:
        """Store a finished rollout's sequence (prompt tail + output) of ``version`` in ``prob``."""
        seq = prob.tree.add(seq_tokens, self.weight(prob, self.clock(prob, version)))
        prob.by_version.setdefault(version, []).append(seq)

    # ------------------------------------------------------------------ inspection
    def check(self) -> dict[int, SuffixTree]:
        """Slow check (for tests) that the tree table holds each problem tree's prior; returns the
        problem trees by tree index. Raises AssertionError otherwise."""
        for pid, prob in self.problems.items():
            assert self._trees.prior[prob.tree_index] == self.prior_of(prob), pid
        return {prob.tree_index: prob.tree for prob in self.problems.values()}

    def totals(self) -> tuple[int, int, int, int]:
        """``(sequences, tokens, nodes, bytes)`` over the problem trees."""
        seqs = toks = nodes = nbytes = 0
        for prob in self.problems.values():
            t = prob.tree
            seqs += t.num_sequences
            toks += t.num_tokens
            nodes += t.num_nodes
            nbytes += t.nbytes
        return seqs, toks, nodes, nbytes
