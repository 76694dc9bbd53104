"""DASDrafter: per-problem, windowed, version-weighted suffix-tree drafter for RL rollouts.

The DAS paper (arXiv 2511.13841) keeps one suffix tree per problem (prompt), built from the
rollouts of a sliding window of recent policy iterations and updated online as tokens are
verified, and also queries a per-request tree over the prompt and the request's own output; the
better-scoring draft wins.

Verbs (arctic-inference-like): :meth:`DASDrafter.begin_iteration`, :meth:`~DASDrafter.start_request`,
:meth:`~DASDrafter.add_tokens`, :meth:`~DASDrafter.speculate`, :meth:`~DASDrafter.stop_request`,
:meth:`~DASDrafter.add_rollout`, :meth:`~DASDrafter.evict_problem`, :meth:`~DASDrafter.stats`.
Per engine step, for all rows at once (one numba call each, no Python loop over rows):
:meth:`~DASDrafter.add_tokens_batch`, :meth:`~DASDrafter.speculate_batch` (the same results as
calling :meth:`~DASDrafter.add_tokens` then :meth:`~DASDrafter.speculate` row by row) and
:meth:`~DASDrafter.num_tokens`.

Down-weighting without rewriting trees: a rollout of policy version ``v`` is stored in its problem
tree with weight ``decay ** -(v - base)`` (``base``: a per-problem reference version). Drafting
uses only ratios of counts, so this is the same as giving each rollout weight ``decay ** age``
(``age`` = versions behind the newest): each version older weighs ``decay`` times less. When the
exponent ``v - base`` would make weights exceed ``2**40``, the tree is rescaled once
(``SuffixTree.scale(decay ** (v - base))``) and ``base`` moves to ``v``.

History by policy age and by the problem's own visits. The paper (arXiv 2511.13841) keeps a
sliding window of recent policy iterations and down-weights older ones; that assumes a problem
comes back every few iterations (a small data set). On a large data set a problem returns once per
epoch, hundreds of versions later, when the window has long expired its history. So a problem also
keeps the rollouts of its own last ``keep_visits`` visits (a visit: a policy version in which it got
rollouts), however old, and with ``age_in_visits`` the age ``decay`` counts is the problem's own
visits, not global versions: weighing a rollout kept across a 300-version gap by ``0.9 ** 300``
would leave it nothing against the prior, so it would never draft. The exponent above is then a
per-problem visit counter instead of ``v``. When every problem comes back every version (a small
set) visits and versions count alike. Memory stays capped by ``max_problems`` (LRU over problems),
each problem holding at most its window's and its last ``keep_visits`` visits' rollouts.

Each problem-tree sequence is one rollout: the last ``max_depth - 1`` prompt tokens, then its
output, so the first output tokens can be drafted from how earlier rollouts began. (The whole
prompt is only in the per-request trees.) Live sibling rollouts (GRPO samples of one prompt) are
separate sequences of the same tree, updated token by token, so they see each other's tokens as
they grow, without the false n-grams of concatenating them. A request's context (prompt + output)
ends with its own sequence in both trees, so drafting anchors on that sequence's suffix loci
(:meth:`das.suffix_tree.SuffixTree.draft_seq`) without matching the context.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from functools import partial
from typing import NamedTuple

import numpy as np

from das import _mix_kernels as mixing
from das import _step_kernels as step_kernels
from das import _trie_kernels as kernels
from das.config import CHOOSERS, DEFAULTS
from das.suffix_tree import VOCAB_LIMIT, Draft, SuffixTree, _check_range, as_tokens, empty_draft

_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)
_new_tuple = tuple.__new__

__all__ = ["DASDrafter", "DraftBatch", "PARALLEL_ROWS", "default_draft_threads", "node_gpus", "physical_cores", "problem_id"]

_RESCALE_LOG2 = 40.0  # rescale a problem tree when a new weight would exceed 2**40
# rows from which the batch verbs run on several threads. `python -m benchmarks.step_ab --ab
# threshold`, one thread against the default threads, ms per step: at 16 rows 0.205 -> 0.190 on 2
# Zen 4 cores, 0.481 -> 0.264 on a 16-core GPU host's Xeon (8 threads); at 32 rows 0.421 -> 0.374
# and 0.671 -> 0.296; at 64 rows 0.871 -> 0.522 and 1.686 -> 0.524 (benchmarks/README.md, "Step
# cost"). Below 16 rows waking the threads would cost about what it saves.
PARALLEL_ROWS = 16
# the global tree's append and the mixer's learning, per appended token, in units of a row's
# appends to its problem and request trees: measured on one thread at 256 rows (step_cost's
# workload, Zen 4): rows 0.73 ms, global tree 0.23 ms, learning 0.12 ms. They set how many trees
# the parts that carry those two pieces get (:func:`das._step_kernels.balance_parts`).
GLOBAL_APPEND_COST = 0.3
LEARN_COST = 0.15
# threads from which a step's trees are balanced so (below: dealt by tree id modulo the threads).
# `step_ab --ab owner` at 256 rows, appending p50: on a 16-core Xeon, 8 threads, 0.69 / 0.46 ms
# balanced against 0.83 / 0.60 by id (two runs); on 2 Zen 4 cores by id was faster (0.58 / 0.66
# against 0.65 / 0.73): with two threads the two pieces already sit on different threads, and the
# balancing's own ~10 us and its tree groups that change from step to step cost more than the
# evening out saves.
BALANCED_PARTS = 4


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


_problem_id = problem_id


class DraftBatch(NamedTuple):
    """Drafts for the rows of one engine step (:meth:`DASDrafter.speculate_batch`).

    ``K`` is the largest budget of the call (0 when there are no rows). Row ``r``'s draft is
    ``tokens[r, :lengths[r]]`` with path probabilities ``probs[r, :lengths[r]]``, exactly what
    :meth:`DASDrafter.speculate` returns as ``Draft.tokens`` / ``Draft.probs``.

    Attributes:
        tokens: ``np.int32[rows, K]`` draft token ids; -1 past each row's length.
        probs: ``np.float32[rows, K]`` path probabilities (non-increasing along a row): the
            estimated probability that the first ``j + 1`` draft tokens are all accepted; 0.0 past
            each row's length.
        lengths: ``np.int64[rows]`` draft lengths, ``0 <= lengths[r] <= budgets[r]``.
    """

    tokens: np.ndarray
    probs: np.ndarray
    lengths: np.ndarray


class _TreeTable:
    """Buffers of a drafter's trees by tree index, in a numba typed List the batch kernels read.

    A registered tree reports every new buffer it moves to (:meth:`SuffixTree.set_buffer_listener`),
    so the table never holds a stale one. ``prior[i]``: the drafting prior of tree ``i`` if it is
    a problem tree (request trees use the drafter's ``prior``). ``free``: indices of released trees,
    reused first."""

    def __init__(self):
        from numba import types
        from numba.typed import List

        self.bufs = List.empty_list(types.int64[::1])
        self.prior = np.zeros(16, np.float64)
        self._none = np.zeros(1, np.int64)  # what a freed index holds (drops the tree's buffer)
        # A typed List compiles each method on its first call in a process (~1 s in all, not
        # cached on disk): call them here, at construction, not in an engine step. Index 0 starts free.
        self.bufs.append(self._none)
        self.bufs[0] = self._none
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
        self.bufs[i] = self._none
        self.prior[i] = 0.0
        self.free.append(i)


class _Problem:
    __slots__ = ("tree", "base", "by_version", "live", "ti", "visits", "last")

    def __init__(self, max_depth: int, base: int):
        self.tree = SuffixTree(max_depth)
        self.base = base  # weight reference version
        self.by_version: dict[int, list[int]] = {}  # policy version -> sequence ids
        self.live: dict = {}  # request id -> sequence id, of live requests
        self.ti = -1  # index in the drafter's tree table
        self.visits = 0  # visits so far (policy versions in which it got rollouts): the age clock with age_in_visits
        self.last = -1  # the version of its latest visit


class _Request:
    __slots__ = ("pid", "problem", "seq", "version", "tree", "tree_seq", "tree_slot", "h", "rti", "plen", "gseq")

    def __init__(self, pid, problem, seq, version, tree, tree_seq, tree_slot, h, rti, plen):
        self.pid = pid
        self.plen = plen  # prompt tokens
        self.problem = problem  # _Problem, or None once evicted
        self.seq = seq  # sequence id in problem.tree
        self.version = version
        self.tree = tree  # per-request SuffixTree or None
        self.tree_seq = tree_seq  # the request tree's only sequence (prompt + output), its id
        self.tree_slot = tree_slot  # and its slot (a request tree never removes, so it never moves)
        self.h = h  # handle: row of the drafter's per-request state arrays
        self.rti = rti  # the request tree's index in the drafter's tree table (-1: none)
        self.gseq = -1  # its live sequence in the drafter's global tree (-1: none)


class DASDrafter:
    """Per-problem windowed suffix-tree drafter (see the module docstring).

    Args (defaults from :class:`das.config.DASConfig`, the one place they are written):
        window: int >= 1, policy versions kept per problem: after ``begin_iteration(v)`` only
            rollouts of versions ``>= v - window + 1`` remain. Default 16 (the paper found windows of
            16-32 iterations best; the smaller bounds memory and lookup cost).
        decay: float in (0, 1], weight of a rollout one policy version older relative to the newest
            (1.0: no down-weighting). Default 0.9: with window 16 the oldest kept version weighs
            0.9**15 ~ 0.2 of the newest; the paper prescribes mild down-weighting without a formula.
        max_depth: int >= 2, suffix tree depth (longest stored string; drafts match at most
            ``max_depth - 1`` context tokens). Default 12 (vLLM's ``suffix`` method: 24): on the
            DSR-sub replay the ``mix`` chooser accepts as much at 12 as at 24 (2.423 vs 2.418
            tokens per step at K = 16) with fewer drafted tokens per accepted (2.94 vs 3.02), 25%
            less memory and half the appending work per token (see benchmarks/README.md).
        max_spec_factor: float > 0, a draft anchored on a ``m``-token match has at most
            ``floor(m * max_spec_factor)`` tokens. Default 2.0 (SuffixDecoding's 1.0 stops drafts
            that re-anchoring could carry on; see benchmarks/README.md).
        min_token_prob: float in [0, 1], drafts stop before the path probability falls below it.
            Default 0.1: the ``"mix"`` chooser's probabilities are calibrated online, and on the
            DSR-sub replay 0.1 keeps drafted tokens per accepted token (3.0) below
            arctic-inference's (3.15) at its defaults (``"walk"`` was tuned at 0.2).
        max_problems: int >= 1, problem trees kept; beyond it the least recently used problem
            without live requests is evicted. Default 4096 (a few epochs' worth of distinct prompts
            of a typical RL data set per engine).
        use_request_tree: bool, also draft from a per-request tree of the prompt + own output.
            Default True (as the paper and arctic-inference).
        prior: float >= 0, added to the denominator of every draft-token probability, in units
            of one current-version rollout's weight (see SuffixTree.draft): a continuation seen
            once gets ``1 / (1 + prior)`` instead of certainty. Default 0.3: on the DSR-sub
            replay, continuations seen once were right 78% of the time (1 / 1.3 = 0.77).
        keep_visits: int >= 0, a problem also keeps the rollouts of its own last ``keep_visits``
            visits (policy versions in which it got rollouts), however old (see the module
            docstring). 0: the window only (the paper's rule). Default 2: on the DSR-sub replay
            with problems back every 300 versions (a large data set, ``--version-stride 300``)
            acceptance length 2.219 instead of 2.055 (1: 2.185; all history: 2.235), and the same
            2.235 as before when they come back every version (benchmarks/README.md).
        age_in_visits: bool, the age ``decay`` counts is the problem's own visits instead of policy
            versions (the prior scales to the problem's latest visit). Default True: the same as
            versions when every problem comes back every version, and rollouts kept across a long
            gap stay useful (aged by versions they weigh 0.9**300 against the prior: 2.059 on that
            replay with ``keep_visits=1``, no better than without them).

        chooser: ``"mix"`` or ``"walk"``, how a draft is chosen from the trees. ``"walk"`` (the
            paper's and SuffixDecoding's rule): from each context suffix (anchor) in each tree, walk
            the most frequent continuation, keep the walk with the largest sum of path
            probabilities (``max_spec_factor`` and ``prior`` shape it). ``"mix"`` (default):
            each draft token from every context suffix of every scope at once (problem tree,
            request tree, global tree), combined by a logistic mixer whose weights are learned
            online from the accept/reject outcomes of the drafter's own drafts (``add_tokens``
            after ``speculate``), which also count per draft token, per (previous token, token)
            pair and per support profile as three more inputs; path probabilities are the
            mixer's, calibrated by that learning (:mod:`das._mix_kernels`). On the DSR-sub replay,
            K = 16: acceptance length 2.48 vs 2.27 for ``"walk"`` and 2.16 for arctic-inference,
            at fewer drafted tokens per accepted token than either (benchmarks/README.md).
            Default "mix".
        global_rollouts: int >= 0, the global tree (the ``"mix"`` chooser's third scope, as
            arctic-inference's global cache: what the rollouts of every problem share, e.g.
            formatting) holds every live request's rollout as it is verified and the last
            ``global_rollouts`` finished ones, oldest out first. Default 256: on the DSR-sub replay
            (finished rollouts only, before live ones were added) acceptance length 2.418 at 236
            bytes per stored token against 2.423 at 373 with 1024 (arctic-inference: 346) and 2.403
            with 128. Live rollouts in it raised the acceptance length on the three replays by
            1.6-3.5% (DSR-sub 2.395 -> 2.434; benchmarks/README.md). 0: no global tree. Unused by
            ``"walk"``.
        global_depth: int >= 2, suffix tree depth of the global tree (longest stored string,
            tokens), at most ``max_depth`` (a larger value is taken as ``max_depth``). What the
            rollouts of every problem share (formatting, common phrases) lies in its contexts of
            1-3 tokens; deeper ones repeat what the problem and request trees know. Default 4: on
            the DSR-sub replay acceptance length 2.497 against 2.500 at 12 (3: 2.486, 2: 2.452),
            memory per stored token 184 instead of 205 bytes (MATH-500: 276 instead of 387), and
            7-15% less drafter time per engine step at 64-256 rows (benchmarks/README.md, "Step
            cost").
        mix_lr: float > 0, AdaGrad step size of the mixer's online logistic regression. Default 0.1.
        draft_threads: int >= 0, threads that append and draft the rows of one
            :meth:`add_tokens_batch` / :meth:`speculate_batch` call at once (numba ``prange``, as
            vLLM's n-gram proposer) from :data:`PARALLEL_ROWS` rows on, with either chooser; the
            trees and drafts are the same as on one thread. 0: :func:`default_draft_threads`,
            the physical cores available to the process (:func:`physical_cores`) per GPU of the
            machine, at most 16, or without a GPU at most 8; 1: one thread. Default 0 (step cost
            at 256 rows on a 2-core Zen 4: 2.0-2.1 ms instead of 4.2 on one thread with
            ``"mix"``, 0.69-0.78 ms with ``"walk"``; on an H200 host's 16-core Xeon 0.92-1.08 ms
            on 16 threads against 1.09-1.21 on 8; see benchmarks/README.md, "Step cost"). The cap
            of 8 without a GPU is vLLM's n-gram proposer's: a CPU engine's frontend (tokenizing)
            and structured outputs need threads too.
        defer_global: bool or None, :meth:`add_tokens_batch` leaves its appends to the global
            tree (one thread's work, most of the 0.53 ms of appending in a 1.0 ms step at 256
            rows on a 16-core GPU host's Xeon on 16 threads) for a background thread, which
            :meth:`speculate_batch` starts once it has drafted, so that they run while the
            accelerator verifies the drafts; any other call waits for them first. So does
            :meth:`stop_request` with its global-tree part (the rollout counted as finished there,
            the oldest one removed: 50-150 us a stop on a 2-core Zen 4, and now and then a
            rebuild). The step's drafts read a global tree one step behind
            (the request's latest tokens are in its problem and request trees; the global scope's
            loci are looked up from the root, :func:`das._mix_kernels._context_loci`). For an
            engine whose forward pass runs on an accelerator: where it runs on the same CPU, the
            background thread takes a core from it. ``"mix"`` chooser with a global tree only.
            Default None: off here; the vLLM proposer turns None on when torch sees a GPU.

    Raises:
        ValueError: an argument of the wrong type or out of range (the message names it).
    """

    def __init__(
        self,
        window: int = DEFAULTS.window,
        decay: float = DEFAULTS.decay,
        max_depth: int = DEFAULTS.max_depth,
        max_spec_factor: float = DEFAULTS.max_spec_factor,
        min_token_prob: float = DEFAULTS.min_token_prob,
        max_problems: int = DEFAULTS.max_problems,
        use_request_tree: bool = DEFAULTS.use_request_tree,
        prior: float = DEFAULTS.prior,
        keep_visits: int = DEFAULTS.keep_visits,
        age_in_visits: bool = DEFAULTS.age_in_visits,
        chooser: str = DEFAULTS.chooser,
        global_rollouts: int = DEFAULTS.global_rollouts,
        global_depth: int = DEFAULTS.global_depth,
        mix_lr: float = DEFAULTS.mix_lr,
        draft_threads: int = DEFAULTS.draft_threads,
        defer_global: bool | None = DEFAULTS.defer_global,
    ):
        self.window = _int_arg(window, "window", 1)
        self.decay = _float_arg(decay, "decay", "a number in (0, 1]", lambda x: 0.0 < x <= 1.0)
        self.max_depth = _int_arg(max_depth, "max_depth", 2, 10_000)
        self.max_spec_factor = _float_arg(
            max_spec_factor, "max_spec_factor", "a finite number > 0", lambda x: 0.0 < x < math.inf
        )
        self.min_token_prob = _float_arg(
            min_token_prob, "min_token_prob", "a number in [0, 1]", lambda x: 0.0 <= x <= 1.0
        )
        self.max_problems = _int_arg(max_problems, "max_problems", 1)
        if not isinstance(use_request_tree, (bool, np.bool_)):
            raise ValueError(f"use_request_tree must be a bool, got {use_request_tree!r}")
        self.use_request_tree = bool(use_request_tree)
        self.prior = _float_arg(prior, "prior", "a finite number >= 0", lambda x: 0.0 <= x < math.inf)
        self.keep_visits = _int_arg(keep_visits, "keep_visits", 0)
        if not isinstance(age_in_visits, (bool, np.bool_)):
            raise ValueError(f"age_in_visits must be a bool, got {age_in_visits!r}")
        self.age_in_visits = bool(age_in_visits)
        if chooser not in CHOOSERS:
            raise ValueError(f"chooser must be one of {', '.join(CHOOSERS)}, got {chooser!r}")
        self.chooser = chooser
        self.global_rollouts = _int_arg(global_rollouts, "global_rollouts", 0)
        self.global_depth = _int_arg(global_depth, "global_depth", 2, 10_000)
        self.mix_lr = _float_arg(mix_lr, "mix_lr", "a finite number > 0", lambda x: 0.0 < x < math.inf)
        self.draft_threads = _int_arg(draft_threads, "draft_threads", 0)
        self._threads = self.draft_threads or default_draft_threads()
        if defer_global is not None and not isinstance(defer_global, (bool, np.bool_)):
            raise ValueError(f"defer_global must be a bool or None, got {defer_global!r}")
        self.defer_global = bool(defer_global) and self.chooser == "mix" and bool(self.global_rollouts)
        self._gtodo = None  # the last add_tokens_batch's global-tree part, deferred: (handles, tokens, ends)
        self._gkeep: list[int] = []  # stopped requests' global sequences, to count as finished rollouts (deferred)
        self._gjob = None  # that part running on the background thread (a Future)
        self._gexec = None  # the background thread (a one-thread pool, made on first use)
        self.deferred_appends = 0  # add_tokens_batch calls whose global-tree part ran in the background
        self.deferred_keeps = 0  # stop_request calls whose global-tree part was deferred (run by a later job or sync)
        self.deferred_ns = 0  # nanoseconds the background work took
        self.parallel_calls = 0  # batch calls (appending or drafting) run on several threads
        self._log_inv_decay = -math.log(self.decay)  # >= 0
        self._version = 0
        self._problems: OrderedDict[Hashable, _Problem] = OrderedDict()
        self._requests: dict[Hashable, _Request] = {}
        self._buf = (np.empty(64, np.int32), np.empty(64, np.float32))
        self._one_learn = (np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64))  # add_tokens()'s learn_rows call
        # speculate()'s one-row call of the mix kernel: handle, budget, tokens, probs, length (reused)
        self._one = (np.zeros(1, np.int64), np.zeros(1, np.int64), np.empty((1, 16), np.int32), np.empty((1, 16), np.float32),
                     np.zeros(1, np.int64))
        self._one_min_prob = np.full(1, self.min_token_prob)  # its cutoff (the kernels take one per row)
        # what the batch kernels read (see the module docstring and das._trie_kernels)
        self._tab = _TreeTable()
        self._handles: dict[Hashable, int] = {}  # live request id -> handle
        # per handle: problem tree index, its slot there, request tree index, its slot, tokens so far (kernels.R_*)
        self._ri = np.full((16, kernels.R_COLS), -1, np.int64)
        self._stamp = np.empty(0, np.int64)  # scratch of _distinct, one slot per handle
        self._rw = np.ones(16, np.float64)  # per handle: weight of its problem-tree sequence
        self._hreq: list[_Request | None] = [None] * 16  # handle -> request
        self._hfree = list(range(15, -1, -1))
        # the "mix" chooser: mixer weights and AdaGrad sums, each handle's pending draft (tokens,
        # inputs, weight-set offsets, length) until its outcome arrives, and the global tree
        self._wt = mixing.initial_weights()
        self._g2 = np.zeros_like(self._wt)
        self._dtok = np.zeros((16, 16), np.int32)
        self._dx = np.zeros((16, 16, mixing.NIN), np.float64)
        self._dset = np.zeros((16, 16), np.int64)
        self._dk = np.zeros(16, np.int64)
        # outcome tables (accepted, drafted) of draft tokens: [0] per token id, [1] per (previous token,
        # token), [2] per support profile (the first SUPPORT_ROWS rows), [3] the calibration maps' knots;
        # each pending draft token's profile
        self._outcomes = np.zeros((4, mixing.OUTCOME_SLOTS, 2), np.float64)
        self._dsup = np.zeros((16, 16), np.int64)
        self._dprev = np.zeros(16, np.int64)  # per handle: the context's last token when it drafted
        self._dstop = np.full(16, -1, np.int64)  # per handle: the token its draft stopped before (-1: none)
        self.outcomes_learned = 0  # draft tokens (and stop tokens) whose accept/reject outcome the mixer learned from
        self._global = None
        self._out_tokens = 0  # output tokens of the rollouts finished so far (stop_request, add_rollout)
        self._out_count = 0
        self._gti = -1
        self._gseqs: deque[int] = deque()
        if self.chooser == "mix" and self.global_rollouts:
            # at most max_depth: the mix kernel's locus arrays hold max_depth loci per scope
            self._global = SuffixTree(min(self.global_depth, self.max_depth))
            self._gti = self._tab.add(self._global)

    # ------------------------------------------------------------------ iterations
    @property
    def policy_version(self) -> int:
        """The current policy version (0 before any :meth:`begin_iteration`)."""
        return self._version

    def begin_iteration(self, policy_version: int) -> None:
        """Start rollouts of ``policy_version``: expire rollouts older than the window.

        Rollouts of versions ``< policy_version - window + 1`` are removed from their problem
        trees (a live request's rollout is removed when it stops), except those of the problem's
        last ``keep_visits`` visits, and problems left without
        rollouts or live requests are dropped. New requests and rollouts are tagged with
        ``policy_version``. The ``"mix"`` chooser's draft-outcome counts are multiplied by
        ``decay ** (policy_version - current)``.

        Raises:
            ValueError: not an int, or smaller than the current version.
        """
        self._sync_global()
        v = _int_arg(policy_version, "policy_version")
        if v < self._version:
            raise ValueError(f"policy_version must not go backwards: got {v}, current is {self._version}")
        if v > self._version and self.decay < 1.0:
            self._outcomes *= self.decay ** (v - self._version)  # what older policies did with a draft token weighs less
        self._version = v
        cutoff = v - self.window + 1
        for pid in list(self._problems):
            prob = self._problems[pid]
            old = [ver for ver in prob.by_version if ver < cutoff]
            if old and self.keep_visits:
                kept = self._kept_visits(prob)
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
                self._drop_problem(pid)
            else:
                self._sync_problem(prob)  # new prior (version); slots, if a removal rebuilt the tree

    def _kept_visits(self, prob: _Problem, extra: int | None = None) -> set[int]:
        """The versions of ``prob``'s last ``keep_visits`` visits (with ``extra`` as one more)."""
        vers = set(prob.by_version) if extra is None else set(prob.by_version) | {extra}
        return set(sorted(vers)[-self.keep_visits:]) if self.keep_visits else set()

    def _expired(self, prob: _Problem, version: int, extra: int | None = None) -> bool:
        """Whether ``prob``'s rollouts of ``version`` are out of both the window and its kept visits."""
        return version < self._version - self.window + 1 and version not in self._kept_visits(prob, extra)

    def _remove_seq(self, prob: _Problem, sid: int) -> None:
        """Remove a sequence from ``prob``'s tree (the caller then calls :meth:`_sync_problem`:
        a removal may rebuild the tree, which moves the live sequences' slots)."""
        if sid in prob.tree:
            prob.tree.remove(sid)

    # ------------------------------------------------------------------ problems
    def _clock(self, prob: _Problem, version: int) -> int:
        """The age clock of a ``version`` rollout of ``prob``: ``version``, or with
        ``age_in_visits`` the problem's visit count (a new, later version is a new visit; an older
        one, out of order, counts the kept visits after it)."""
        if not self.age_in_visits:
            return version
        if version > prob.last:
            prob.visits += 1
            prob.last = version
            self._tab.prior[prob.ti] = self._prior_of(prob)
        elif version < prob.last:
            return prob.visits - sum(1 for u in prob.by_version if u > version)
        return prob.visits

    def _weight(self, prob: _Problem, version: int) -> float:
        """Insertion weight in ``prob`` of a rollout at age clock ``version`` (:meth:`_clock`;
        rescales the tree if needed)."""
        e = (version - prob.base) * self._log_inv_decay
        if e > _RESCALE_LOG2 * math.log(2.0):
            prob.tree.scale(max(self.decay ** (version - prob.base), 1e-300))
            prob.base = version
            e = 0.0
            self._sync_problem(prob)  # new sequence weights and prior
        return max(math.exp(e), 1e-300)

    def _prior_of(self, prob: _Problem) -> float:
        """Drafting prior of ``prob``'s tree, in its weight units (one current-version rollout, or with
        ``age_in_visits`` one rollout of its latest visit, weighs ``decay ** -(clock - base)`` there)."""
        now = prob.visits if self.age_in_visits else self._version
        return self.prior * math.exp((now - prob.base) * self._log_inv_decay) if self.prior else 0.0

    def _problem(self, pid: Hashable) -> _Problem:
        prob = self._problems.get(pid)
        if prob is None:
            prob = _Problem(self.max_depth, 1 if self.age_in_visits else self._version)  # first visit: weight 1
            prob.ti = self._tab.add(prob.tree)
            self._tab.prior[prob.ti] = self._prior_of(prob)
            self._problems[pid] = prob
            self._evict_lru(keep=pid)
        else:
            self._problems.move_to_end(pid)
        return prob

    def _drop_problem(self, pid: Hashable) -> _Problem:
        """Remove a problem and its tree; its live requests (if any) go on without it."""
        prob = self._problems.pop(pid)
        self._tab.release(prob.ti, prob.tree)
        for rid in prob.live:
            req = self._requests[rid]
            req.problem = None
            self._ri[req.h, kernels.R_PROBLEM_TREE] = -1
            self._ri[req.h, kernels.R_PROBLEM_SLOT] = -1
        return prob

    def _sync_problem(self, prob: _Problem) -> None:
        """Refresh what the batch kernels know of ``prob``: its prior, and its live requests'
        sequence slots (moved by a rebuild) and weights (changed by a rescale)."""
        self._tab.prior[prob.ti] = self._prior_of(prob)
        tree = prob.tree
        for rid, sid in prob.live.items():
            h = self._requests[rid].h
            slot, w = tree.slot_and_weight(sid)
            self._ri[h, kernels.R_PROBLEM_SLOT] = slot
            self._rw[h] = w

    def _evict_lru(self, keep: Hashable) -> None:
        """Evict least recently used problems without live requests (never ``keep``) down to
        ``max_problems`` (or as close as live requests allow)."""
        excess = len(self._problems) - self.max_problems
        if excess <= 0:
            return
        for pid in list(self._problems):
            if excess <= 0:
                break
            if pid != keep and not self._problems[pid].live:
                self._drop_problem(pid)
                excess -= 1

    def evict_problem(self, problem_id: Hashable) -> bool:
        """Drop a problem's tree and history. Live requests of it keep drafting from their
        request trees only. Returns whether the problem was known."""
        self._sync_global()
        if problem_id not in self._problems:
            return False
        self._drop_problem(problem_id)
        return True

    def problem_tree(self, problem_id: Hashable) -> SuffixTree | None:
        """The problem's SuffixTree (read-only use), or None."""
        prob = self._problems.get(problem_id)
        return prob.tree if prob is not None else None

    def __contains__(self, problem_id: Hashable) -> bool:
        return problem_id in self._problems

    def request_sequences(self, req_id: Hashable) -> list[tuple[SuffixTree, int]]:
        """What a live request drafts from, in drafting order (ties go to the first): ``(tree,
        sequence id)`` of its rollout in its problem's tree (while the problem is kept), then of its
        prompt + output in its request tree (with ``use_request_tree``). Each sequence holds the
        request's context so far (the problem tree's: only the last ``max_depth - 1`` prompt
        tokens). For inspection and analysis: read-only use.

        Returns:
            A list of 0 to 2 ``(SuffixTree, int)`` pairs.

        Raises:
            KeyError: unknown request.
        """
        req = self._requests.get(req_id)
        if req is None:
            raise KeyError(f"unknown request {req_id!r}")
        out = []
        if req.problem is not None:
            out.append((req.problem.tree, req.seq))
        if req.tree is not None:
            out.append((req.tree, req.tree_seq))
        return out

    # ------------------------------------------------------------------ requests
    def start_request(self, req_id: Hashable, prompt_ids, problem_id: Hashable | None = None) -> Hashable:
        """Register a live rollout.

        Adds a new empty sequence to the problem's tree, tagged with the current policy version
        (it grows with :meth:`add_tokens`), and, if ``use_request_tree``, a per-request tree
        holding the prompt (and, as it grows, the request's output, as one sequence).

        Args:
            req_id: hashable request id, unique among live requests.
            prompt_ids: 1-D integer array-like, token ids in ``[0, 2**20)``.
            problem_id: the problem's id; default :func:`problem_id` of ``prompt_ids``.

        Returns:
            The problem id used.

        Raises:
            ValueError: ``req_id`` already live, or bad prompt tokens.
        """
        self._sync_global(keeps=False)
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} is already live")
        prompt = as_tokens(prompt_ids, "prompt_ids")
        _check_range(prompt, "prompt_ids")
        pid = problem_id if problem_id is not None else _problem_id(prompt)
        tree = tree_seq = tree_slot = None
        grow = self._live_reserve()  # room for the output, so that its tokens are not moved as it grows
        if self.use_request_tree:
            tree = SuffixTree(self.max_depth, capacity=prompt.shape[0] + grow)
            tree_seq = tree.add(prompt, reserve=prompt.shape[0] + grow)  # validates the tokens
            tree_slot = tree.slot(tree_seq)
        prob = self._problem(pid)
        tail = self._prompt_tail(prompt)
        seq = prob.tree.add(tail, self._weight(prob, self._clock(prob, self._version)), reserve=tail.shape[0] + grow)
        prob.by_version.setdefault(self._version, []).append(seq)
        prob.live[req_id] = seq
        h = self._new_handle()
        rti = self._tab.add(tree) if tree is not None else -1
        req = self._requests[req_id] = _Request(pid, prob, seq, self._version, tree, tree_seq, tree_slot, h, rti,
                                                        prompt.shape[0])
        self._handles[req_id] = h
        self._hreq[h] = req
        slot, w = prob.tree.slot_and_weight(seq)
        gslot = -1
        if self._global is not None:  # the live rollout is in the global tree too (as arctic-inference's)
            req.gseq = self._global.add(tail, reserve=tail.shape[0] + grow)
            gslot = self._global.slot(req.gseq)
        self._ri[h] = (prob.ti, slot, rti, tree_slot if tree is not None else -1, prompt.shape[0], gslot)
        self._rw[h] = w
        return pid

    def _live_reserve(self) -> int:
        """Tokens of room to reserve for a new live rollout's output: twice the mean output length
        of the rollouts finished so far (256 before any), at most 8192."""
        if not self._out_count:
            return 256
        return min(8192, int(2 * self._out_tokens / self._out_count))

    def _new_handle(self) -> int:
        if not self._hfree:
            n = self._ri.shape[0]
            self._ri = np.concatenate([self._ri, np.full((n, kernels.R_COLS), -1, np.int64)])
            self._rw = np.concatenate([self._rw, np.ones(n, np.float64)])
            self._hreq.extend([None] * n)
            self._hfree = list(range(2 * n - 1, n - 1, -1))
            self._dtok = np.concatenate([self._dtok, np.zeros_like(self._dtok)])
            self._dx = np.concatenate([self._dx, np.zeros_like(self._dx)])
            self._dset = np.concatenate([self._dset, np.zeros_like(self._dset)])
            self._dsup = np.concatenate([self._dsup, np.zeros_like(self._dsup)])
            self._dk = np.concatenate([self._dk, np.zeros_like(self._dk)])
            self._dprev = np.concatenate([self._dprev, np.zeros_like(self._dprev)])
            self._dstop = np.concatenate([self._dstop, np.full_like(self._dstop, -1)])
        return self._hfree.pop()

    def _prompt_tail(self, prompt: np.ndarray) -> np.ndarray:
        k = min(self.max_depth - 1, prompt.shape[0])
        return prompt[prompt.shape[0] - k :]

    def add_tokens(self, req_id: Hashable, tokens) -> None:
        """Append verified output tokens (1-D integer array-like) to a live request.

        Raises:
            KeyError: unknown request.
            ValueError: bad tokens (nothing is appended).
        """
        self._sync_global()
        req = self._requests.get(req_id)
        if req is None:
            raise KeyError(f"unknown request {req_id!r}")
        if type(tokens) is np.ndarray and tokens.ndim == 1 and (tokens.dtype is _I32 or tokens.dtype is _I64) \
                and tokens.flags.c_contiguous:
            arr = tokens
        else:
            arr = as_tokens(tokens)
        m = arr.shape[0]
        if m == 0:
            return
        if self._dk[req.h] or self._dstop[req.h] >= 0:
            _check_range(arr, "tokens")
            handle, start, end = self._one_learn  # one row's arguments, reused
            handle[0] = req.h
            end[0] = m
            self._learn(handle, arr.reshape(1, m), start, end)
        prob = req.problem
        pt = prob.tree if prob is not None else None
        rt = req.tree
        gs = int(self._ri[req.h, kernels.R_GLOBAL_SLOT])
        if pt is None and rt is None and gs < 0:
            _check_range(arr, "tokens")
            self._ri[req.h, kernels.R_NUM_TOKENS] += m
            return
        ps, pw = pt.slot_and_weight(req.seq) if pt is not None else (-1, 1.0)
        rs = req.tree_slot if rt is not None else -1
        gbuf = self._global.buffer if gs >= 0 else None
        pbuf = pt.buffer if pt is not None else rt.buffer if rt is not None else gbuf  # a skipped tree (slot -1) still needs a buffer
        rbuf = rt.buffer if rt is not None else pbuf
        da, db, dc = kernels.append_tokens_trees(pbuf, ps, pw, rbuf, rs, 1.0, gbuf if gbuf is not None else pbuf, gs, 1.0, arr)
        if da < 0:
            i = -da - 1
            raise ValueError(f"token {int(arr[i])} at index {i} of tokens is out of range [0, {VOCAB_LIMIT})")
        if da < m:  # a tree ran short of capacity: extend grows it and appends the rest
            pt.extend(req.seq, arr[da:])
        if db < m:
            rt.extend(req.tree_seq, arr[db:])
        if dc < m:
            self._global.extend(req.gseq, arr[dc:])
        self._ri[req.h, kernels.R_NUM_TOKENS] += m

    def speculate(self, req_id: Hashable, max_tokens: int) -> Draft:
        """Draft up to ``max_tokens`` tokens for a live request.

        ``"walk"``: drafts from the problem tree and (if enabled) the request tree with the
        request's context (prompt + output so far); returns the higher-score draft (ties: the
        problem tree's). ``"mix"``: the mixed draft of all scopes (:mod:`das._mix_kernels`), its
        ``match_len`` 0 (no single anchor); the draft stays pending until the next
        :meth:`add_tokens`, which teaches the mixer its outcome.

        Raises:
            KeyError: unknown request.
            ValueError: ``max_tokens`` not an int >= 0.
        """
        self._sync_global()
        req = self._requests.get(req_id)
        if req is None:
            raise KeyError(f"unknown request {req_id!r}")
        if type(max_tokens) is not int:
            max_tokens = _int_arg(max_tokens, "max_tokens")
        if max_tokens <= 0:
            if max_tokens < 0:
                raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
            self._drop_pending(req.h)  # no draft: nothing to learn from (as speculate_batch with budget 0)
            return empty_draft()
        if self.chooser == "mix":  # speculate_batch for one row, without its checks and allocations
            one = self._one
            if one[2].shape[1] < max_tokens:
                one = self._one = one[:2] + (np.empty((1, max_tokens), np.int32), np.empty((1, max_tokens), np.float32), one[4])
            handle, budget, tokens, probs, length = one
            handle[0] = req.h
            budget[0] = max_tokens
            self._one_min_prob[0] = self.min_token_prob
            self._mix_drafts(handle, budget, max_tokens, self._one_min_prob, tokens, probs, length, 1)
            k = int(length[0])
            if k == 0:
                return empty_draft()
            p = probs[0, :k].copy()
            # sum over a list: 0.15 us against 0.8 for numpy's float64 sum of a few float32s (it may differ in the last bit)
            return _new_tuple(Draft, (tokens[0, :k].copy(), p, sum(p.tolist()), 0))
        prob = req.problem
        pt = prob.tree if prob is not None else None
        rt = req.tree
        if pt is None:
            if rt is None:
                return empty_draft()
            ps, pprior = -1, 0.0
        else:
            ps = pt.slot(req.seq)  # a rebuild (after removals) may have moved it
            pprior = self._prior_of(prob)
        buf = self._buf
        if buf[0].shape[0] < 4 * max_tokens:
            buf = self._buf = (np.empty(4 * max_tokens, np.int32), np.empty(4 * max_tokens, np.float32))
        pbuf = pt.buffer if pt is not None else rt.buffer
        rbuf = rt.buffer if rt is not None else pbuf
        off, k, score, mlen = kernels.draft_two_trees(
            pbuf, ps, pprior, rbuf, req.tree_slot if rt is not None else -1, self.prior, max_tokens, self.min_token_prob,
            self.max_spec_factor, buf[0], buf[1],
        )
        if k == 0:
            return empty_draft()
        return _new_tuple(Draft, (buf[0][off : off + k].copy(), buf[1][off : off + k].copy(), score, mlen))

    # ------------------------------------------------------------------ batches (one engine step)
    def add_tokens_batch(self, req_ids: Sequence[Hashable], token_ids: np.ndarray, starts, ends) -> np.ndarray:
        """Append verified tokens to many live requests in one call: for each row ``r``,
        ``token_ids[r, starts[r]:ends[r]]`` to request ``req_ids[r]``.

        The same as ``add_tokens(req_ids[r], token_ids[r, starts[r]:ends[r]])`` for ``r`` in
        order (so a request may appear in several rows), but one numba call for all rows and their
        problem and request trees (on ``draft_threads`` threads from :data:`PARALLEL_ROWS` rows
        on, split by problem tree), then one for the global tree. Made for
        vLLM's ``token_ids_cpu`` (row ``r`` = the batch's row ``r``: prompt and output tokens so
        far) with ``starts=None`` and ``ends = num_tokens_no_spec[:rows]``.

        Args:
            req_ids: sequence (``len()``-able) of live request ids, one per row.
            token_ids: 2-D integer array (``int32`` as vLLM's, or ``int64``; any other integer
                dtype is copied), ``shape[0] >= len(req_ids)``; rows past ``len(req_ids)`` are
                not read. Token ids in ``[0, 2**20)``.
            starts: 1-D integer array of ``len(req_ids)``, or None for :meth:`num_tokens` of the
                rows' requests (append what is new; then a request should appear once).
            ends: 1-D integer array of ``len(req_ids)``. Column ranges (tokens) must satisfy
                ``0 <= starts[r] <= ends[r] <= token_ids.shape[1]``; ``starts[r] == ends[r]``
                appends nothing.

        Returns:
            ``np.int64[rows]``: tokens appended per row (``ends - starts``).

        Raises:
            KeyError: an id that is not a live request (nothing is appended).
            ValueError: bad shapes or dtypes, a bad range or an out-of-range token; the message
                names the row and the value. Everything is checked before anything is appended.
        """
        self._sync_global(keeps=False)
        handles = self._handles_of(req_ids)
        rows = handles.shape[0]
        tokens = _token_matrix(token_ids, rows)
        starts = self._ri[handles, kernels.R_NUM_TOKENS] if starts is None else _row_vector(starts, "starts", rows)
        ends = _row_vector(ends, "ends", rows)
        if rows == 0:
            return np.zeros(0, np.int64)
        code, r, c = kernels.check_batch(tokens, starts, ends)
        if code:
            raise ValueError(_batch_error(code, r, c, tokens, starts, ends))
        parts = self._threads_for(rows)
        glob = self._global is not None and not self.defer_global
        if parts > 1:
            self._insert_parallel(handles, tokens, starts, ends, parts, glob)
        else:
            self._learn(handles, tokens, starts, ends)
            self._add_rows(handles, tokens, starts, ends)
            if glob:
                self._add_rows_global(handles, tokens, starts, ends)
        if self.defer_global:
            self._defer_global_rows(handles, tokens, starts, ends)
        return ends - starts

    def _sync_global(self, keeps: bool = True) -> None:
        """Bring the global tree up to date before anything else reads or changes it: wait for
        the background job (re-raising its error), then append a deferred part no
        :meth:`speculate_batch` started, and with ``keeps`` count the deferred stopped requests'
        sequences as finished rollouts. The engine's per-step verbs (:meth:`start_request`,
        :meth:`stop_request`, :meth:`add_tokens_batch`) leave those to the next background job:
        its adds and removals commute with theirs."""
        self._join_global()
        if self._gtodo is not None:
            todo, self._gtodo = self._gtodo, None
            self._append_deferred(*todo)
        if keeps and self._gkeep:
            self._keep_deferred(self._take_keeps())

    def _take_keeps(self) -> list[int]:
        keep, self._gkeep = self._gkeep, []
        return keep

    def close(self) -> None:
        """Finish the global tree's deferred work (``defer_global``) and stop its background thread.
        The drafter stays usable: a later deferred step starts the thread again."""
        self._sync_global()
        if self._gexec is not None:
            self._gexec.shutdown()
            self._gexec = None

    def _join_global(self) -> None:
        """Wait for the background job, if one runs (re-raising its error)."""
        if self._gjob is not None:
            job, self._gjob = self._gjob, None
            job.result()

    def _append_deferred(self, handles: np.ndarray, tokens: np.ndarray, ends: np.ndarray) -> None:
        """The deferred global-tree part of an :meth:`add_tokens_batch` (its own copy of the rows' new tokens)."""
        t0 = time.perf_counter_ns()
        self._add_rows_global(handles, tokens, np.zeros_like(ends), ends)
        self.deferred_ns += time.perf_counter_ns() - t0

    def _keep_deferred(self, seqs: list[int]) -> None:
        """The deferred global-tree part of :meth:`stop_request` calls, in their order."""
        t0 = time.perf_counter_ns()
        for seq in seqs:
            self._keep_global(seq)
        self.deferred_keeps += len(seqs)
        self.deferred_ns += time.perf_counter_ns() - t0

    def _run_deferred(self, todo, keeps: list[int]) -> None:
        if todo is not None:
            self._append_deferred(*todo)
        if keeps:
            self._keep_deferred(keeps)

    def _start_deferred(self) -> None:
        """Run the deferred global-tree work on the background thread (while the engine verifies):
        the last appends, then the stopped requests' rollouts kept (and the oldest removed)."""
        if self._gtodo is None and not self._gkeep:
            return
        if self._gexec is None:
            from concurrent.futures import ThreadPoolExecutor

            self._gexec = ThreadPoolExecutor(max_workers=1, thread_name_prefix="das-global")
        todo, self._gtodo = self._gtodo, None
        self._gjob = self._gexec.submit(self._run_deferred, todo, self._take_keeps())
        self.deferred_appends += todo is not None

    def _defer_global_rows(self, handles, tokens, starts, ends) -> None:
        """Keep the rows' new tokens (a compact copy: the engine reuses its token matrix) for the global tree."""
        n = ends - starts
        width = int(n.max()) if n.shape[0] else 0
        mine = np.zeros((n.shape[0], 0), tokens.dtype)
        if width:  # columns past a row's end are clipped to the matrix and never read
            idx = np.minimum(starts[:, None] + np.arange(width), tokens.shape[1] - 1)
            mine = np.take_along_axis(tokens[: n.shape[0]], idx, axis=1)
        self._gtodo = (handles.copy(), np.ascontiguousarray(mine), n.copy())

    def _add_rows_global(self, handles, tokens, starts, ends, row: int = 0) -> None:
        """Append the rows from ``row`` on to their requests' live sequences in the global tree (one thread)."""
        while row < handles.shape[0]:
            r, done = kernels.add_batch_global(self._global.buffer, self._ri, handles, tokens, starts, ends, row)
            if r < 0:
                break
            self._finish_global_row(handles, tokens, starts, ends, r, done)
            row = r + 1

    def _finish_global_row(self, handles, tokens, starts, ends, r: int, done: int) -> None:
        """Finish row ``r``, whose append to the global tree ran short of capacity after ``done``
        tokens: grow the tree and append the rest."""
        self._global.extend(self._hreq[handles[r]].gseq, np.ascontiguousarray(tokens[r, starts[r] + done : ends[r]]))

    def _add_rows(self, handles: np.ndarray, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        """Append the rows in order on one thread (checked rows), growing trees that run short."""
        row = 0
        while row < handles.shape[0]:
            r, part, done = kernels.add_batch(self._tab.bufs, self._ri, self._rw, handles, tokens, starts, ends, row)
            if r < 0:
                break
            self._finish_row(self._hreq[handles[r]], tokens[r, starts[r] : ends[r]], part, done)
            row = r + 1

    def _insert_parallel(self, handles, tokens, starts, ends, parts: int, glob: bool) -> None:
        """The learning, :meth:`_add_rows` and :meth:`_add_rows_global` on ``parts`` threads, at
        once (:func:`das._step_kernels.insert_batch_parallel`; they touch disjoint memory, so the
        result is the serial one). Rows are split by problem tree (a row without one by its
        request tree), so each tree is appended to by one thread, in row order; the global tree's
        appends run on the last part, the learning on the first, and from :data:`BALANCED_PARTS`
        parts on whole trees go to the least loaded part (:func:`das._step_kernels.balance_parts`),
        those two counted in (below it, trees are dealt by id modulo the parts). A part whose
        tree ran short stops there; that row is finished here and the part's later rows are
        appended on one thread (the global tree's likewise). ``glob``: append to the global tree
        here (False: none, or deferred)."""
        pt = self._ri[handles, kernels.R_PROBLEM_TREE]
        keys = np.where(pt >= 0, pt, self._ri[handles, kernels.R_REQUEST_TREE])
        work = ends - starts
        gpart, lpart = (parts - 1 if glob else -1), (0 if self.chooser == "mix" else -1)
        if parts >= BALANCED_PARTS:
            base = np.zeros(parts)
            total = float(work.sum())
            if glob:
                base[gpart] += GLOBAL_APPEND_COST * total
            if lpart >= 0:
                base[lpart] += LEARN_COST * total
            owner = step_kernels.balance_parts(keys, work, parts, base)
        else:
            owner = keys % parts
        stops = np.empty((parts, 3), np.int64)
        gstop = np.full(2, -1, np.int64)
        learned = np.zeros(1, np.int64)
        gmem = self._global.buffer if glob else self._tab._none
        self._on_threads(parts, step_kernels.insert_batch_parallel, self._tab.bufs, self._ri, self._rw, handles, tokens, starts, ends, owner,
                         parts, stops, gmem, gpart, gstop, lpart, learned, self._wt, self._g2, self.mix_lr, self._dtok, self._dx,
                         self._dset, self._dk, self._outcomes, self._dprev, self._dsup, self._dstop)
        self.outcomes_learned += int(learned[0])
        for p in range(parts):
            r, part, done = (int(x) for x in stops[p])
            if r < 0:
                continue
            self._finish_row(self._hreq[handles[r]], tokens[r, starts[r] : ends[r]], part, done)
            rest = np.flatnonzero(owner[r + 1 :] == p) + r + 1
            if rest.shape[0]:
                self._add_rows(handles[rest], tokens[rest], starts[rest], ends[rest])
        if glob and gstop[0] >= 0:
            r = int(gstop[0])
            self._finish_global_row(handles, tokens, starts, ends, r, int(gstop[1]))
            self._add_rows_global(handles, tokens, starts, ends, r + 1)

    def _finish_row(self, req: _Request, seg: np.ndarray, part: int, done: int) -> None:
        """Finish a row :func:`das._trie_kernels.add_batch` stopped at: a tree ran short of
        capacity after ``done`` tokens (``part`` 0: the problem tree, 1: the request tree)."""
        seg = np.ascontiguousarray(seg)
        if part == 0:
            req.problem.tree.extend(req.seq, seg[done:])  # grows the tree and appends the rest
            if req.tree is not None:
                req.tree.extend(req.tree_seq, seg)
        else:
            req.tree.extend(req.tree_seq, seg[done:])

    def speculate_batch(self, req_ids: Sequence[Hashable], budgets, min_prob: float | np.ndarray | None = None) -> DraftBatch:
        """Draft for many live requests in one call: row ``r`` gets up to ``budgets[r]`` tokens
        for request ``req_ids[r]``.

        Row ``r``'s draft is what ``speculate(req_ids[r], budgets[r])`` returns (the same tokens
        and path probabilities), but one numba call for all rows.

        Args:
            req_ids: sequence (``len()``-able) of live request ids, one per row.
            budgets: 1-D integer array of ``len(req_ids)``, draft tokens per row, each ``>= 0``
                (0: no draft for that row).
            min_prob: float in ``[0, 1]``, this call's ``min_token_prob`` (drafts stop before
                their path probability falls below it), or a 1-D float array of ``len(req_ids)``
                such cutoffs, one per row; None: the drafter's. With the ``mix``
                chooser a cutoff that stops a draft before tokens the engine would verify means
                fewer outcomes to learn from (the token after the verified prefix is learned from
                only if it was drafted or stopped before); one at or below the last token the
                engine keeps learns the same as drafting further (the vLLM proposer's priced
                budgets stop drafts where the step's selection keeps nothing more:
                :func:`scheduler.step_policy.keep_bound`, :meth:`integrations.vllm_ext.proposer.DASProposer._cutoff`).

        Returns:
            :class:`DraftBatch` ``(tokens int32[rows, K], probs float32[rows, K], lengths
            int64[rows])`` with ``K = max(budgets)`` (0 without rows).

        Raises:
            KeyError: an id that is not a live request.
            ValueError: ``budgets`` of the wrong shape or dtype, or a negative budget (the
                message names the row and the value); ``min_prob`` outside ``[0, 1]`` (the
                message names the row), or an array of the wrong shape.
        """
        self._join_global()  # a background append still running (two drafts in a row)
        handles = self._handles_of(req_ids)
        rows = handles.shape[0]
        budgets = _row_vector(budgets, "budgets", rows)
        mp = _min_probs(self.min_token_prob if min_prob is None else min_prob, rows)
        kmax = 0
        if rows:
            if int(budgets.min()) < 0:
                r = int(np.argmax(budgets < 0))
                raise ValueError(f"budgets[{r}] must be >= 0, got {int(budgets[r])}")
            kmax = int(budgets.max())
        tokens = np.empty((rows, kmax), np.int32)
        probs = np.empty((rows, kmax), np.float32)
        lengths = np.zeros(rows, np.int64)
        if rows and self.chooser == "mix":
            self._mix_drafts(handles, budgets, kmax, mp, tokens, probs, lengths, self._parts(handles))
        elif rows:
            args = (self._tab.bufs, self._ri, self._tab.prior, self.prior, handles, budgets, mp, self.max_spec_factor,
                    self.max_depth, tokens, probs, lengths)
            parts = self._threads_for(rows)  # rows write only their own output row: any handles
            if parts > 1:
                self._on_threads(parts, kernels.draft_batch_parallel, *args, parts)
            else:
                kernels.draft_batch(*args)
        self._start_deferred()
        return DraftBatch(tokens, probs, lengths)

    def _mix_drafts(self, handles, budgets, kmax: int, min_probs: np.ndarray, tokens, probs, lengths, parts: int,
                    mix_kernels=mixing) -> None:
        """The ``mix`` kernel for these rows on ``parts`` threads: writes ``tokens`` / ``probs`` /
        ``lengths`` and the rows' pending drafts (``kmax``: the largest budget; ``min_probs``:
        float64, each row's cutoff). ``mix_kernels``:
        the module of the kernels (another version of it in ``benchmarks.kernel_pair``)."""
        if kmax > self._dtok.shape[1]:
            self._grow_pending(kmax)
        args = (self._tab.bufs, self._ri, self._tab.prior, self.prior, self._gti, self.prior, handles, budgets, min_probs,
                self.max_depth, self._wt, tokens, probs, lengths, self._dtok, self._dx, self._dset, self._dk, self._outcomes,
                self._dprev, self._dsup, self._dstop, self.defer_global)  # self._gti: -1 without a global tree
        if parts > 1:
            self._on_threads(parts, mix_kernels.mix_batch_parallel, *args, parts)
        else:
            mix_kernels.mix_batch(*args)

    def _on_threads(self, parts: int, kernel, *args) -> None:
        """Call ``kernel(*args)``, a ``prange`` kernel over ``parts`` parts, with numba's team
        cut to ``parts`` threads. Left alone, numba runs every parallel region on all of
        its threads (one per CPU): on a 16-CPU GPU host 16 threads woke for 8 parts and spun
        between steps (benchmarks/README.md, "Step cost")."""
        import numba

        team = numba.get_num_threads()
        numba.set_num_threads(parts)
        try:
            kernel(*args)
        finally:
            numba.set_num_threads(team)
        self.parallel_calls += 1

    def _threads_for(self, rows: int) -> int:
        """Threads for a batch call of ``rows`` rows: 1 below :data:`PARALLEL_ROWS` (waking
        threads costs more than it saves there), else ``draft_threads`` as far as numba has them."""
        if self._threads < 2 or rows < PARALLEL_ROWS:
            return 1
        import numba

        return min(self._threads, numba.get_num_threads())

    def _parts(self, handles: np.ndarray) -> int:
        """Threads for drafting these rows: as :meth:`_threads_for`, but 1 when a request has
        several rows (they would write its pending draft at once)."""
        parts = self._threads_for(handles.shape[0])
        if parts > 1 and not self._distinct(handles):
            return 1
        return parts

    def _distinct(self, handles: np.ndarray) -> bool:
        """Whether no handle repeats: each row writes its index into its handle's stamp, and a
        repeated handle keeps only one of them (two vector ops; ``np.unique`` sorts, 5x the time
        at 256 rows)."""
        if self._stamp.shape[0] < self._ri.shape[0]:
            self._stamp = np.empty(self._ri.shape[0], np.int64)
        rows = np.arange(handles.shape[0])
        self._stamp[handles] = rows
        return bool(np.array_equal(self._stamp[handles], rows))

    def _grow_pending(self, k: int) -> None:
        """Room for pending drafts of ``k`` tokens per handle (the mixer's learning state)."""
        n = self._dk.shape[0]
        self._dtok = np.zeros((n, k), np.int32)
        self._dx = np.zeros((n, k, mixing.NIN), np.float64)
        self._dset = np.zeros((n, k), np.int64)
        self._dsup = np.zeros((n, k), np.int64)
        self._drop_pending(slice(None))  # drafts pending now are not learned from (rare: a larger budget than ever before)

    def _drop_pending(self, h: int | slice) -> None:
        """Forget handle ``h``'s pending draft and stop token: nothing of them will be learned."""
        self._dk[h] = 0
        self._dstop[h] = -1

    def _learn(self, handles: np.ndarray, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        """Teach the mixer the outcomes of the rows' pending drafts (checked rows only)."""
        if self.chooser == "mix":
            self.outcomes_learned += mixing.learn_rows(self._wt, self._g2, self.mix_lr, handles, tokens, starts, ends,
                                                       self._dtok, self._dx, self._dset, self._dk, self._outcomes, self._dprev, self._dsup, self._dstop)

    @property
    def mixer_weights(self) -> np.ndarray:
        """A copy of the ``"mix"`` chooser's weights: ``float64[NSETS, NIN]`` (one row per draft
        position 0, 1, 2, 3+; inputs as in :mod:`das._mix_kernels`)."""
        return self._wt.reshape(mixing.NSETS, mixing.NIN).copy()

    def num_tokens(self, req_ids: Sequence[Hashable]) -> np.ndarray:
        """Tokens (prompt + output) each request has been given so far (its prompt at
        :meth:`start_request`, then every appended token).

        Returns:
            ``np.int64[len(req_ids)]``: the prompt's length plus every token appended since.

        Raises:
            KeyError: an id that is not a live request.
        """
        return self._ri[self._handles_of(req_ids), kernels.R_NUM_TOKENS]

    def _handles_of(self, req_ids: Sequence[Hashable]) -> np.ndarray:
        """``int64[len(req_ids)]`` handles of live requests (one C-level pass, no Python loop)."""
        try:
            n = len(req_ids)
        except TypeError:
            raise ValueError(f"req_ids must be a sequence of request ids, got {type(req_ids).__name__}") from None
        try:
            return np.fromiter(map(self._handles.__getitem__, req_ids), np.int64, n)
        except KeyError as e:
            raise KeyError(f"unknown request {e.args[0]!r}") from None
        except TypeError as e:
            raise ValueError(f"req_ids must hold hashable request ids: {e}") from None

    def _check_batch_state(self) -> None:
        """Slow check (for tests) that what the batch kernels read agrees with the Python objects;
        raises AssertionError otherwise."""
        self._sync_global()
        tab = self._tab
        assert set(self._handles) == set(self._requests)
        live_ti = {}
        for pid, prob in self._problems.items():
            live_ti[prob.ti] = prob.tree
            assert tab.prior[prob.ti] == self._prior_of(prob), pid
        for rid, req in self._requests.items():
            h = self._handles[rid]
            assert req.h == h and self._hreq[h] is req
            row = self._ri[h]
            if req.problem is not None:
                slot, w = req.problem.tree.slot_and_weight(req.seq)
                assert (row[kernels.R_PROBLEM_TREE], row[kernels.R_PROBLEM_SLOT]) == (req.problem.ti, slot), rid
                assert self._rw[h] == w, rid
            else:
                assert row[kernels.R_PROBLEM_TREE] == -1, rid
            if req.tree is not None:
                assert (row[kernels.R_REQUEST_TREE], row[kernels.R_REQUEST_SLOT]) == (req.rti, req.tree_slot), rid
                live_ti[req.rti] = req.tree
            else:
                assert row[kernels.R_REQUEST_TREE] == -1, rid
        if self._global is not None:
            live_ti[self._gti] = self._global
            for rid, req in self._requests.items():
                assert self._ri[req.h, kernels.R_GLOBAL_SLOT] == self._global.slot(req.gseq), rid
        for ti, tree in live_ti.items():
            buf = tab.bufs[ti]
            assert buf.ctypes.data == tree.buffer.ctypes.data and buf.shape == tree.buffer.shape, ti
        assert len(live_ti) + len(tab.free) == len(tab.bufs)

    def stop_request(self, req_id: Hashable) -> None:
        """Finish a request: free its request tree; its rollout stays in the problem tree (this
        iteration's history). Unknown ids are ignored (idempotent)."""
        self._sync_global(keeps=False)
        req = self._requests.pop(req_id, None)
        if req is None:
            return
        h = self._handles.pop(req_id)
        self._drop_pending(h)
        self._out_tokens += int(self._ri[h, kernels.R_NUM_TOKENS]) - req.plen
        self._out_count += 1
        if req.gseq >= 0:  # its live sequence in the global tree is now a finished rollout there
            if self.defer_global:  # removing the oldest one costs 50-150 us (and now and then a rebuild)
                self._gkeep.append(req.gseq)
            else:
                self._keep_global(req.gseq)
        self._ri[h] = -1
        self._hreq[h] = None
        self._hfree.append(h)
        if req.tree is not None:
            self._tab.release(req.rti, req.tree)
            req.tree = None
        prob = req.problem
        if prob is None:
            return
        prob.live.pop(req_id, None)
        if self._expired(prob, req.version):  # expired while it ran
            self._remove_seq(prob, req.seq)
            lst = prob.by_version.get(req.version)
            if lst is not None and req.seq in lst:
                lst.remove(req.seq)
                if not lst:
                    del prob.by_version[req.version]
            if not prob.by_version and not prob.live and self._problems.get(req.pid) is prob:
                self._drop_problem(req.pid)
            elif self._problems.get(req.pid) is prob:
                self._sync_problem(prob)

    def add_rollout(
        self,
        prompt_ids,
        output_ids,
        problem_id: Hashable | None = None,
        policy_version: int | None = None,
    ) -> bool:
        """Ingest a finished rollout recorded elsewhere (another worker, a trace).

        Args:
            prompt_ids, output_ids: 1-D integer array-likes; the last ``max_depth - 1`` prompt
                tokens and the output become one sequence of the problem tree.
            problem_id: default :func:`problem_id` of ``prompt_ids``.
            policy_version: int, default the current version. Rollouts older than the window and
                not of the problem's last ``keep_visits`` visits are ignored.

        Returns:
            Whether the rollout was stored.

        Raises:
            ValueError: bad tokens or version.
        """
        self._sync_global()
        prompt = as_tokens(prompt_ids, "prompt_ids")
        out = as_tokens(output_ids, "output_ids")
        _check_range(prompt, "prompt_ids")
        _check_range(out, "output_ids")
        v = self._version if policy_version is None else _int_arg(policy_version, "policy_version")
        pid = problem_id if problem_id is not None else _problem_id(prompt)
        if v < self._version - self.window + 1:
            known = self._problems.get(pid)
            if not self.keep_visits or (known is not None and self._expired(known, v, extra=v)):
                return False
        prob = self._problem(pid)
        self._out_tokens += out.shape[0]
        self._out_count += 1
        seq_tokens = np.concatenate([self._prompt_tail(prompt), out])
        seq = prob.tree.add(seq_tokens, self._weight(prob, self._clock(prob, v)))
        prob.by_version.setdefault(v, []).append(seq)
        if self._global is not None:
            self._add_global(seq_tokens)
        return True

    def _add_global(self, seq_tokens: np.ndarray) -> None:
        """Keep a finished rollout (prompt tail + output) in the global tree."""
        self._keep_global(self._global.add(seq_tokens))

    def _keep_global(self, seq: int) -> None:
        """Count sequence ``seq`` of the global tree as a finished rollout; the oldest finished
        ones are removed past ``global_rollouts`` (live requests' sequences stay)."""
        self._gseqs.append(seq)
        moved = self._global.rebuilds
        while len(self._gseqs) > self.global_rollouts:
            self._global.remove(self._gseqs.popleft())
        if self._global.rebuilds != moved:  # a rebuild moved the live sequences' slots
            for req in self._requests.values():
                if req.gseq >= 0:
                    self._ri[req.h, kernels.R_GLOBAL_SLOT] = self._global.slot(req.gseq)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, int]:
        """Counters: ``problems``, ``sequences``, ``tokens`` (stored in problem trees, prompt tails
        included), ``nodes``, ``bytes`` (problem trees and the global tree), ``requests`` (live),
        ``request_tree_bytes``, ``global_rollouts`` (rollouts in the global tree), ``global_tree_bytes``,
        ``mix_outcomes`` (draft-token and stop-token outcomes the ``"mix"`` chooser's mixer learned from),
        ``parallel_calls`` (:meth:`add_tokens_batch` and :meth:`speculate_batch` calls run on
        several threads)."""
        self._sync_global()
        seqs = toks = nodes = nbytes = 0
        for prob in self._problems.values():
            t = prob.tree
            seqs += t.num_sequences
            toks += t.num_tokens
            nodes += t.num_nodes
            nbytes += t.nbytes
        rbytes = sum(r.tree.nbytes for r in self._requests.values() if r.tree is not None)
        gbytes = self._global.nbytes if self._global is not None else 0
        return {
            "problems": len(self._problems),
            "sequences": seqs,
            "tokens": toks,
            "nodes": nodes,
            "bytes": nbytes + gbytes,
            "requests": len(self._requests),
            "request_tree_bytes": rbytes,
            "global_rollouts": len(self._gseqs),
            "global_tree_bytes": gbytes,
            "mix_outcomes": self.outcomes_learned,
            "parallel_calls": self.parallel_calls,
        }


def _token_matrix(a, rows: int) -> np.ndarray:
    """``a`` as a 2-D int32/int64 array with at least ``rows`` rows (no copy when it is one)."""
    if type(a) is not np.ndarray:
        a = np.asarray(a)
    if a.ndim != 2:
        raise ValueError(f"token_ids must be a 2-D array (rows x tokens), got shape {a.shape}")
    if a.dtype != _I32 and a.dtype != _I64:
        if a.dtype.kind not in "iu":
            raise ValueError(f"token_ids must hold integer token ids, got dtype {a.dtype}")
        a = a.astype(np.int64)
    if a.shape[0] < rows:
        raise ValueError(f"token_ids has {a.shape[0]} rows, fewer than the {rows} request ids")
    return a


def _row_vector(a, name: str, rows: int) -> np.ndarray:
    """``a`` as an ``int64[rows]`` array (no copy when it is one)."""
    if type(a) is not np.ndarray or a.dtype != _I64:
        a = np.asarray(a)
        if a.dtype.kind not in "iu" and not (a.size == 0 and a.dtype.kind == "f"):
            raise ValueError(f"{name} must be integers, got dtype {a.dtype}")
        a = a.astype(np.int64)
    if a.shape != (rows,):
        raise ValueError(f"{name} must have shape ({rows},) (one per request id), got {a.shape}")
    return a


def _batch_error(code: int, r: int, c: int, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> str:
    if code == kernels.E_START:
        return f"starts[{r}] must be >= 0, got {int(starts[r])}"
    if code == kernels.E_ORDER:
        return f"ends[{r}] must be >= starts[{r}] = {int(starts[r])}, got {int(ends[r])}"
    if code == kernels.E_END:
        return f"ends[{r}] must be <= token_ids.shape[1] = {tokens.shape[1]}, got {int(ends[r])}"
    return f"token {int(tokens[r, c])} at token_ids[{r}, {c}] is out of range [0, {VOCAB_LIMIT})"


# the default draft threads' caps: where the engine runs on a GPU its CPU cores idle through the
# forward pass, and on an H200 host's 16-core Xeon 16 threads beat 8 at 256 rows in every run in
# turns (back to back 0.92-1.08 ms against 1.09-1.21, with a 20 ms forward pass between steps
# 1.24-1.34 against 1.53-1.76; benchmarks/README.md, "Step cost", "Draft threads on a GPU host");
# on a CPU engine vLLM's n-gram proposer's cap of 8
GPU_HOST_THREADS = 16
CPU_HOST_THREADS = 8


def node_gpus() -> int:
    """NVIDIA GPUs this machine (or container) holds, all of them whatever ``CUDA_VISIBLE_DEVICES``
    shows this process: one entry each in ``/proc/driver/nvidia/gpus``. 0 where that directory
    is missing or unreadable (no NVIDIA driver)."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def default_draft_threads(cores: int | None = None, gpus: int | None = None) -> int:
    """Draft threads when ``draft_threads`` is 0: on a GPU machine the physical cores per GPU
    (each GPU's engine, or tensor-parallel rank, runs its own proposer; vLLM's n-gram proposer
    divides its threads by the tensor-parallel size for the same reason), at most
    :data:`GPU_HOST_THREADS`; without one, the physical cores, at most :data:`CPU_HOST_THREADS`.

    Args:
        cores: physical cores (default :func:`physical_cores`).
        gpus: GPUs of the machine (default :func:`node_gpus`).

    Returns:
        int >= 1.
    """
    cores = physical_cores() if cores is None else cores
    gpus = node_gpus() if gpus is None else gpus
    if gpus > 0:
        return max(1, min(GPU_HOST_THREADS, cores // gpus))
    return max(1, min(CPU_HOST_THREADS, cores))


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyper-threads of one core count
    once), from ``/sys/devices/system/cpu/cpu*/topology``; the CPU count if that is unreadable."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
    cores = set()
    for c in cpus:
        top = f"/sys/devices/system/cpu/cpu{c}/topology"
        try:
            with open(f"{top}/physical_package_id") as f1, open(f"{top}/core_id") as f2:
                cores.add((f1.read().strip(), f2.read().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def _int_arg(x, name: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {x!r}")
    x = int(x)
    if lo is not None and x < lo:
        raise ValueError(f"{name} must be >= {lo}, got {x}")
    if hi is not None and x > hi:
        raise ValueError(f"{name} must be <= {hi}, got {x}")
    return x


def _min_probs(min_prob, rows: int) -> np.ndarray:
    """A call's cutoffs as ``float64[rows]``: a number in [0, 1] for every row, or one per row."""
    if isinstance(min_prob, np.ndarray):
        a = np.ascontiguousarray(min_prob, dtype=np.float64)  # one array type for the kernels: no second compile
        if a.shape != (rows,):
            raise ValueError(f"min_prob must be a number or have shape ({rows},) (one per request id), got {a.shape}")
        bad = np.flatnonzero(~((a >= 0.0) & (a <= 1.0)))
        if bad.shape[0]:
            raise ValueError(f"min_prob[{int(bad[0])}] must be a number in [0, 1], got {float(a[bad[0]])!r}")
        return a
    return np.full(rows, _float_arg(min_prob, "min_prob", "a number in [0, 1]", lambda f: 0.0 <= f <= 1.0))


def _float_arg(x, name: str, expected: str, ok) -> float:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be {expected}, got {x!r}")
    f = float(x)
    if not ok(f):
        raise ValueError(f"{name} must be {expected}, got {x!r}")
    return f
