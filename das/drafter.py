"""DASDrafter: per-problem, windowed, version-weighted suffix-tree drafter for RL rollouts.

The DAS paper (arXiv 2511.13841) keeps one suffix tree per problem (prompt), built from the
rollouts of a sliding window of recent policy iterations and updated online as tokens are
verified, and also queries a per-request tree over the prompt and the request's own output.

Verbs (arctic-inference-like): :meth:`DASDrafter.begin_iteration`, :meth:`~DASDrafter.start_request`,
:meth:`~DASDrafter.add_tokens`, :meth:`~DASDrafter.speculate`, :meth:`~DASDrafter.stop_request`,
:meth:`~DASDrafter.add_rollout`, :meth:`~DASDrafter.evict_problem`, :meth:`~DASDrafter.stats`.
Per engine step, for all rows at once (one numba call each, no Python loop over rows):
:meth:`~DASDrafter.add_tokens_batch`, :meth:`~DASDrafter.speculate_batch` (the same results as
calling :meth:`~DASDrafter.add_tokens` then :meth:`~DASDrafter.speculate` row by row) and
:meth:`~DASDrafter.num_tokens`.

The drafter is this facade over parts with one job each:

* :mod:`das.problem_store`: the problem trees, their window of policy versions and the problem's
  own visits, down-weighting of older rollouts, LRU eviction;
* :mod:`das.request_table`: the live requests, their handles and the per-handle arrays the batch
  kernels read;
* :mod:`das.tree_table`: every tree's buffer by index, as the kernels read them;
* :mod:`das.global_tree`: the global tree (the ``mix`` chooser's third scope) and the background
  thread that appends to it;
* :mod:`das.mixer_state`: the ``mix`` chooser's weights, outcome tables and pending drafts;
* :mod:`das.step_threads`: how an engine step's rows are split over threads, and the threaded append; :mod:`das.host`:
  the cores and GPUs that set the default threads.

A request's context (prompt + output) ends with its own sequence in its problem tree and its
request tree (and the global tree), so drafting anchors on that sequence's suffix loci
(:meth:`das.suffix_tree.SuffixTree.draft_seq`) without matching the context.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from das import host, problem_store, step_threads
from das import mix_kernels as mixing
from das import trie_kernels as kernels
from das.checks import I32, I64, as_tokens, batch_error, check_range, float_arg, int_arg, min_probs, row_vector, token_matrix
from das.config import CHOOSERS, DASConfig, drafter_settings
from das.draft import Draft, DraftBatch, empty_draft
from das.global_tree import GlobalTree
from das.mixer_state import MixerState
from das.problem_store import ProblemStore, problem_id
from das.request_table import Request, RequestTable
from das.suffix_tree import VOCAB_LIMIT, SuffixTree
from das.tree_table import TreeTable

_new_tuple = tuple.__new__  # Draft(...) without NamedTuple's Python-level __new__ (hot path)

__all__ = ["DASDrafter", "DraftBatch", "problem_id"]


class DASDrafter:
    """Per-problem windowed suffix-tree drafter (see the module docstring).

    Settings: ``DASDrafter(config, **settings)``, ``config`` a :class:`das.config.DASConfig` (its drafter keys), a mapping
    of the keys below, or None, each keyword overriding it (:func:`das.config.drafter_settings`). Defaults from
    :class:`~das.config.DASConfig`, the one place they are written; its field descriptions say why, and
    docs/benchmarks.md, "Evidence for the defaults", holds the replays that chose them:
        window: int >= 1, policy versions kept per problem: after ``begin_iteration(v)`` only
            rollouts of versions ``>= v - window + 1`` remain (:mod:`das.problem_store`). Default 16.
        decay: float in (0, 1], weight of a rollout one policy version (or visit) older relative to
            the newest; 1.0: no down-weighting. Default 0.9.
        max_depth: int in [2, 10000], suffix tree depth (longest stored string; drafts match at
            most ``max_depth - 1`` context tokens). Default 12.
        max_spec_factor: float > 0, a ``"walk"`` draft anchored on an ``m``-token match has at most
            ``floor(m * max_spec_factor)`` tokens. Default 2.0.
        min_token_prob: float in [0, 1], drafts stop before the path probability falls below it. Default 0.1.
        max_problems: int >= 1, problem trees kept; beyond it the least recently used problem
            without live requests is evicted. Default 4096.
        use_request_tree: bool, also draft from a per-request tree of the prompt + own output. Default True.
        prior: float >= 0, added to the denominator of every draft-token probability, in units of
            one current-version rollout's weight: a continuation seen once gets ``1 / (1 + prior)``. Default 0.3.
        keep_visits: int >= 0, a problem also keeps the rollouts of its own last ``keep_visits``
            visits (policy versions in which it got rollouts), however old; 0: the window only
            (the paper's rule). Default 2.
        age_in_visits: bool, ``decay`` counts the problem's own visits instead of policy versions. Default True.
        chooser: ``"walk"`` (the paper's and SuffixDecoding's rule: from each context suffix in the
            problem and request trees, walk the most frequent continuation; the walk with the
            largest sum of path probabilities wins) or ``"mix"`` (each draft token from every
            context suffix of every scope at once, problem, request and global tree, combined by a
            logistic mixer learned online from the outcomes of the drafter's own drafts:
            :mod:`das.mix_kernels`, :mod:`das.mixer_state`). Default "mix".
        global_rollouts: int >= 0, finished rollouts of every problem kept in the global tree
            beside every live one (the ``"mix"`` chooser's third scope, :mod:`das.global_tree`);
            0: no global tree. Default 256.
        global_depth: int in [2, 10000], suffix tree depth of the global tree, at most
            ``max_depth`` (a larger value is taken as ``max_depth``). Default 4.
        mix_lr: float > 0, AdaGrad step size of the mixer's online logistic regression. Default 0.1.
        draft_threads: int >= 0, threads that append and draft the rows of one batch call from
            :data:`das.step_threads.PARALLEL_ROWS` rows on (numba ``prange``; the same trees and
            drafts as on one thread); 0: :func:`das.host.default_draft_threads` (the physical
            cores per GPU, at most 16, or without a GPU at most 8). Default 0.
        defer_global: bool or None, leave the global tree's appends and finished rollouts to a
            background thread that :meth:`speculate_batch` starts once it has drafted, so that they
            run while the accelerator verifies (a step's drafts then read the global tree one step
            behind; on a CPU engine the thread would take a core from the forward pass). ``"mix"``
            chooser with a global tree only. Default None: off here; the vLLM proposer turns None
            on when torch sees a GPU.

    Raises:
        ValueError: a setting of the wrong type or out of range, or an unknown one (the message names it).
    """

    def __init__(self, config: DASConfig | Mapping[str, Any] | None = None, /, **settings: Any):
        s = drafter_settings(config, settings)
        self.window = int_arg(s["window"], "window", 1)
        self.decay = float_arg(s["decay"], "decay", "a number in (0, 1]", lambda x: 0.0 < x <= 1.0)
        self.max_depth = int_arg(s["max_depth"], "max_depth", 2, 10_000)
        self.max_spec_factor = float_arg(s["max_spec_factor"], "max_spec_factor", "a finite number > 0", lambda x: 0.0 < x < math.inf)
        self.min_token_prob = float_arg(s["min_token_prob"], "min_token_prob", "a number in [0, 1]", lambda x: 0.0 <= x <= 1.0)
        self.max_problems = int_arg(s["max_problems"], "max_problems", 1)
        if not isinstance(s["use_request_tree"], (bool, np.bool_)):
            raise ValueError(f"use_request_tree must be a bool, got {s['use_request_tree']!r}")
        self.use_request_tree = bool(s["use_request_tree"])
        self.prior = float_arg(s["prior"], "prior", "a finite number >= 0", lambda x: 0.0 <= x < math.inf)
        self.keep_visits = int_arg(s["keep_visits"], "keep_visits", 0)
        if not isinstance(s["age_in_visits"], (bool, np.bool_)):
            raise ValueError(f"age_in_visits must be a bool, got {s['age_in_visits']!r}")
        self.age_in_visits = bool(s["age_in_visits"])
        if s["chooser"] not in CHOOSERS:
            raise ValueError(f"chooser must be one of {', '.join(CHOOSERS)}, got {s['chooser']!r}")
        self.chooser = s["chooser"]
        self.global_rollouts = int_arg(s["global_rollouts"], "global_rollouts", 0)
        self.global_depth = int_arg(s["global_depth"], "global_depth", 2, 10_000)
        self.mix_lr = float_arg(s["mix_lr"], "mix_lr", "a finite number > 0", lambda x: 0.0 < x < math.inf)
        self.draft_threads = int_arg(s["draft_threads"], "draft_threads", 0)
        self._threads = self.draft_threads or host.default_draft_threads()
        if s["defer_global"] is not None and not isinstance(s["defer_global"], (bool, np.bool_)):
            raise ValueError(f"defer_global must be a bool or None, got {s['defer_global']!r}")
        self.defer_global = bool(s["defer_global"]) and self.chooser == "mix" and bool(self.global_rollouts)
        self.parallel_calls = 0  # batch calls (appending or drafting) run on several threads
        self._out_tokens = 0  # output tokens of the rollouts finished so far (stop_request, add_rollout)
        self._out_count = 0
        self._walk_buf = (np.empty(64, np.int32), np.empty(64, np.float32))  # speculate()'s draft buffers, "walk"
        self._one_learn = (np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64))  # add_tokens()'s learn call
        # speculate()'s one-row call of the mix kernel: handle, budget, tokens, probs, length (reused), and its cutoff
        self._one = (np.zeros(1, np.int64), np.zeros(1, np.int64), np.empty((1, 16), np.int32), np.empty((1, 16), np.float32),
                     np.zeros(1, np.int64))
        self._one_min_prob = np.full(1, self.min_token_prob)
        self._trees = TreeTable()
        self._requests = RequestTable()
        self._problems = ProblemStore(self._trees, self._requests, window=self.window, decay=self.decay, keep_visits=self.keep_visits,
                                      age_in_visits=self.age_in_visits, max_depth=self.max_depth, max_problems=self.max_problems,
                                      prior=self.prior)
        self._mixer = MixerState(self.mix_lr, self._requests.capacity)
        self._global: GlobalTree | None = None
        self._global_index = -1  # the global tree's index in the tree table (-1: none), as the mix kernels take it
        if self.chooser == "mix" and self.global_rollouts:
            # at most max_depth: the mix kernel's locus arrays hold max_depth loci per scope
            self._global = GlobalTree(self._trees, self._requests, min(self.global_depth, self.max_depth), self.global_rollouts,
                                      self.defer_global)
            self._global_index = self._global.index

    # ------------------------------------------------------------------ iterations and problems
    @property
    def policy_version(self) -> int:
        """The current policy version (0 before any :meth:`begin_iteration`)."""
        return self._problems.version

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
        v = int_arg(policy_version, "policy_version")
        current = self._problems.version
        if v < current:
            raise ValueError(f"policy_version must not go backwards: got {v}, current is {current}")
        if v > current and self.decay < 1.0:
            self._mixer.age(self.decay ** (v - current))  # what older policies did with a draft token weighs less
        self._problems.begin(v)

    def evict_problem(self, problem_id: Hashable) -> bool:
        """Drop a problem's tree and history. Live requests of it keep drafting from their
        request trees only. Returns whether the problem was known."""
        self._sync_global()
        if problem_id not in self._problems:
            return False
        self._problems.drop(problem_id)
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
        req = self._requests.requests.get(req_id)
        if req is None:
            raise KeyError(f"unknown request {req_id!r}")
        out = []
        if req.problem is not None:
            out.append((req.problem.tree, req.problem_seq))
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
        table = self._requests
        if req_id in table.requests:
            raise ValueError(f"request {req_id!r} is already live")
        prompt = as_tokens(prompt_ids, "prompt_ids")
        check_range(prompt, "prompt_ids")
        pid = problem_id if problem_id is not None else problem_store.problem_id(prompt)
        tree = tree_seq = tree_slot = None
        grow = self._live_reserve()  # room for the output, so that its tokens are not moved as it grows
        if self.use_request_tree:
            tree = SuffixTree(self.max_depth, capacity=prompt.shape[0] + grow)
            tree_seq = tree.add(prompt, reserve=prompt.shape[0] + grow)  # validates the tokens
            tree_slot = tree.slot(tree_seq)
        tail = self._problems.prompt_tail(prompt)
        prob, seq = self._problems.start_rollout(pid, req_id, tail, tail.shape[0] + grow)
        h = table.new_handle()
        if self._mixer.handles < table.capacity:
            self._mixer.grow_handles(table.capacity)
        tree_index = self._trees.add(tree) if tree is not None else -1
        req = Request(pid, prob, seq, self._problems.version, tree, tree_seq, tree_slot, h, tree_index, prompt.shape[0])
        table.add(req_id, req)
        slot, w = prob.tree.slot_and_weight(seq)
        global_slot = -1
        if self._global is not None:  # the live rollout is in the global tree too (as arctic-inference's)
            req.global_seq, global_slot = self._global.add_live(tail, tail.shape[0] + grow)
        table.tree_refs[h] = (prob.tree_index, slot, tree_index, tree_slot if tree is not None else -1, prompt.shape[0], global_slot)
        table.problem_weights[h] = w
        return pid

    def _live_reserve(self) -> int:
        """Tokens of room to reserve for a new live rollout's output: twice the mean output length
        of the rollouts finished so far (256 before any), at most 8192."""
        if not self._out_count:
            return 256
        return min(8192, int(2 * self._out_tokens / self._out_count))

    def add_tokens(self, req_id: Hashable, tokens) -> None:
        """Append verified output tokens (1-D integer array-like) to a live request.

        Raises:
            KeyError: unknown request.
            ValueError: bad tokens (nothing is appended).
        """
        self._sync_global()
        req = self._requests.requests.get(req_id)
        if req is None:
            raise KeyError(f"unknown request {req_id!r}")
        if type(tokens) is np.ndarray and tokens.ndim == 1 and (tokens.dtype is I32 or tokens.dtype is I64) and tokens.flags.c_contiguous:
            arr = tokens
        else:
            arr = as_tokens(tokens)
        m = arr.shape[0]
        if m == 0:
            return
        h = req.handle
        pending = self._mixer.pending
        if pending.lengths[h] or pending.stop[h] >= 0:
            check_range(arr, "tokens")
            handle, start, end = self._one_learn  # one row's arguments, reused
            handle[0] = h
            end[0] = m
            self._learn(handle, arr.reshape(1, m), start, end)
        prob = req.problem
        pt = prob.tree if prob is not None else None
        rt = req.tree
        refs = self._requests.tree_refs
        gs = int(refs[h, kernels.R_GLOBAL_SLOT])
        if pt is None and rt is None and gs < 0:
            check_range(arr, "tokens")
            refs[h, kernels.R_NUM_TOKENS] += m
            return
        ps, pw = pt.slot_and_weight(req.problem_seq) if pt is not None else (-1, 1.0)
        rs = req.tree_slot if rt is not None else -1
        gtree = self._global.tree if gs >= 0 else None
        gbuf = gtree.buffer if gtree is not None else None
        pbuf = pt.buffer if pt is not None else rt.buffer if rt is not None else gbuf  # a skipped tree (slot -1) still needs a buffer
        rbuf = rt.buffer if rt is not None else pbuf
        da, db, dc = kernels.append_tokens_trees(pbuf, ps, pw, rbuf, rs, 1.0, gbuf if gbuf is not None else pbuf, gs, 1.0, arr)
        if da < 0:
            i = -da - 1
            raise ValueError(f"token {int(arr[i])} at index {i} of tokens is out of range [0, {VOCAB_LIMIT})")
        if da < m:  # a tree ran short of capacity: extend grows it and appends the rest
            pt.extend(req.problem_seq, arr[da:])
        if db < m:
            rt.extend(req.tree_seq, arr[db:])
        if dc < m:
            gtree.extend(req.global_seq, arr[dc:])
        refs[h, kernels.R_NUM_TOKENS] += m

    def speculate(self, req_id: Hashable, max_tokens: int) -> Draft:
        """Draft up to ``max_tokens`` tokens for a live request.

        ``"walk"``: drafts from the problem tree and (if enabled) the request tree with the
        request's context (prompt + output so far); returns the higher-score draft (ties: the
        problem tree's). ``"mix"``: the mixed draft of all scopes (:mod:`das.mix_kernels`), its
        ``match_len`` 0 (no single anchor); the draft stays pending until the next
        :meth:`add_tokens`, which teaches the mixer its outcome.

        Raises:
            KeyError: unknown request.
            ValueError: ``max_tokens`` not an int >= 0.
        """
        self._sync_global()
        req = self._requests.requests.get(req_id)
        if req is None:
            raise KeyError(f"unknown request {req_id!r}")
        if type(max_tokens) is not int:
            max_tokens = int_arg(max_tokens, "max_tokens")
        if max_tokens <= 0:
            if max_tokens < 0:
                raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
            self._mixer.drop_pending(req.handle)  # no draft: nothing to learn from (as speculate_batch with budget 0)
            return empty_draft()
        if self.chooser == "mix":  # speculate_batch for one row, without its checks and allocations
            one = self._one
            if one[2].shape[1] < max_tokens:
                one = self._one = one[:2] + (np.empty((1, max_tokens), np.int32), np.empty((1, max_tokens), np.float32), one[4])
            handle, budget, tokens, probs, length = one
            handle[0] = req.handle
            budget[0] = max_tokens
            self._one_min_prob[0] = self.min_token_prob
            self._mix_drafts(handle, budget, max_tokens, self._one_min_prob, _new_tuple(DraftBatch, (tokens, probs, length)), 1)
            k = int(length[0])
            if k == 0:
                return empty_draft()
            p = probs[0, :k].copy()
            # a sum over a list: numpy's float64 sum of a few float32s costs more (it may differ in the last bit)
            return _new_tuple(Draft, (tokens[0, :k].copy(), p, sum(p.tolist()), 0))
        prob = req.problem
        pt = prob.tree if prob is not None else None
        rt = req.tree
        if pt is None:
            if rt is None:
                return empty_draft()
            ps, pprior = -1, 0.0
        else:
            ps = pt.slot(req.problem_seq)  # a rebuild (after removals) may have moved it
            pprior = self._problems.prior_of(prob)
        buf = self._walk_buf
        if buf[0].shape[0] < 4 * max_tokens:
            buf = self._walk_buf = (np.empty(4 * max_tokens, np.int32), np.empty(4 * max_tokens, np.float32))
        pbuf = pt.buffer if pt is not None else rt.buffer
        rbuf = rt.buffer if rt is not None else pbuf
        off, k, score, mlen = kernels.draft_two_trees(
            pbuf, ps, pprior, rbuf, req.tree_slot if rt is not None else -1, self.prior, max_tokens, self.min_token_prob,
            self.max_spec_factor, buf[0], buf[1],
        )
        if k == 0:
            return empty_draft()
        return _new_tuple(Draft, (buf[0][off : off + k].copy(), buf[1][off : off + k].copy(), score, mlen))

    def stop_request(self, req_id: Hashable) -> None:
        """Finish a request: free its request tree; its rollout stays in the problem tree (this
        iteration's history). Unknown ids are ignored (idempotent)."""
        self._sync_global(keeps=False)
        table = self._requests
        req = table.pop(req_id)
        if req is None:
            return
        h = req.handle
        self._mixer.drop_pending(h)
        self._out_tokens += int(table.tree_refs[h, kernels.R_NUM_TOKENS]) - req.prompt_len
        self._out_count += 1
        if req.global_seq >= 0:  # its live sequence in the global tree is now a finished rollout there
            self._global.stop_live(req.global_seq)
        table.free_handle(h)
        if req.tree is not None:
            self._trees.release(req.tree_index, req.tree)
            req.tree = None
        if req.problem is not None:
            self._problems.stop_rollout(req_id, req.problem_id, req.problem, req.version, req.problem_seq)

    def add_rollout(self, prompt_ids, output_ids, problem_id: Hashable | None = None, policy_version: int | None = None, *,
                    problem_tree: bool = True) -> bool:
        """Ingest a finished rollout recorded elsewhere (another worker, a trace).

        Args:
            prompt_ids, output_ids: 1-D integer array-likes; the last ``max_depth - 1`` prompt
                tokens and the output become one sequence of the problem tree (and of the global tree).
            problem_id: default :func:`problem_id` of ``prompt_ids``.
            policy_version: int, default the current version. Rollouts older than the window and
                not of the problem's last ``keep_visits`` visits are ignored.
            problem_tree: False: the global tree only (a problem this drafter does not serve).

        Returns:
            Whether the rollout was stored (False for ``problem_tree=False`` without a global tree).

        Raises:
            ValueError: bad tokens or version.
        """
        self._sync_global()
        prompt = as_tokens(prompt_ids, "prompt_ids")
        out = as_tokens(output_ids, "output_ids")
        check_range(prompt, "prompt_ids")
        check_range(out, "output_ids")
        store = self._problems
        v = store.version if policy_version is None else int_arg(policy_version, "policy_version")
        pid = problem_id if problem_id is not None else problem_store.problem_id(prompt)
        if not problem_tree:
            if self._global is not None:
                self._global.add_finished(np.concatenate([store.prompt_tail(prompt), out]))
            return self._global is not None
        if not store.accepts(pid, v):
            return False
        prob = store.use(pid)
        self._out_tokens += out.shape[0]
        self._out_count += 1
        seq_tokens = np.concatenate([store.prompt_tail(prompt), out])
        store.add_rollout(prob, seq_tokens, v)
        if self._global is not None:
            self._global.add_finished(seq_tokens)
        return True

    # ------------------------------------------------------------------ batches (one engine step)
    def add_tokens_batch(self, req_ids: Sequence[Hashable], token_ids: np.ndarray, starts, ends) -> np.ndarray:
        """Append verified tokens to many live requests in one call: for each row ``r``,
        ``token_ids[r, starts[r]:ends[r]]`` to request ``req_ids[r]``.

        The same as ``add_tokens(req_ids[r], token_ids[r, starts[r]:ends[r]])`` for ``r`` in
        order (so a request may appear in several rows), but one numba call for all rows and their
        problem and request trees (on ``draft_threads`` threads from
        :data:`das.step_threads.PARALLEL_ROWS` rows on, split by problem tree), then one for the
        global tree. Made for vLLM's ``token_ids_cpu`` (row ``r`` = the batch's row ``r``: prompt
        and output tokens so far) with ``starts=None`` and ``ends = num_tokens_no_spec[:rows]``.

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
        handles = self._requests.handles_of(req_ids)
        rows = handles.shape[0]
        tokens = token_matrix(token_ids, rows)
        starts = self._requests.tree_refs[handles, kernels.R_NUM_TOKENS] if starts is None else row_vector(starts, "starts", rows)
        ends = row_vector(ends, "ends", rows)
        if rows == 0:
            return np.zeros(0, np.int64)
        code, r, c = kernels.check_batch(tokens, starts, ends)
        if code:
            raise ValueError(batch_error(code, r, c, tokens, starts, ends))
        parts = step_threads.threads_for(rows, self._threads)
        glob = self._global is not None and not self.defer_global
        if parts > 1:
            step_threads.append_rows_threaded(self._trees, self._requests, self._mixer, self.chooser == "mix", self._global if glob else None,
                                             handles, tokens, starts, ends, parts)
            self.parallel_calls += 1
        else:
            self._learn(handles, tokens, starts, ends)
            step_threads.append_rows(self._trees, self._requests, handles, tokens, starts, ends)
            if glob:
                self._global.append_rows(handles, tokens, starts, ends)
        if self.defer_global:
            self._global.defer_rows(handles, tokens, starts, ends)
        return ends - starts

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
                budgets stop drafts where the step's selection keeps nothing more).

        Returns:
            :class:`DraftBatch` ``(tokens int32[rows, K], probs float32[rows, K], lengths
            int64[rows])`` with ``K = max(budgets)`` (0 without rows).

        Raises:
            KeyError: an id that is not a live request.
            ValueError: ``budgets`` of the wrong shape or dtype, or a negative budget (the
                message names the row and the value); ``min_prob`` outside ``[0, 1]`` (the
                message names the row), or an array of the wrong shape.
        """
        if self._global is not None:
            self._global.join()  # a background append still running (two drafts in a row)
        table = self._requests
        handles = table.handles_of(req_ids)
        rows = handles.shape[0]
        budgets = row_vector(budgets, "budgets", rows)
        mp = min_probs(self.min_token_prob if min_prob is None else min_prob, rows)
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
            parts = step_threads.threads_for(rows, self._threads)
            if parts > 1 and not table.distinct(handles):
                parts = 1  # a request on several rows: they would write its pending draft at once
            self._mix_drafts(handles, budgets, kmax, mp, DraftBatch(tokens, probs, lengths), parts)
        elif rows:
            args = (self._trees.bufs, table.tree_refs, self._trees.prior, self.prior, handles, budgets, mp, self.max_spec_factor,
                    self.max_depth)
            parts = step_threads.threads_for(rows, self._threads)  # rows write only their own output row: any handles
            if parts > 1:
                self._on_threads(parts, kernels.draft_batch_parallel, *args, (tokens, probs, lengths), parts)
            else:
                kernels.draft_batch(*args, tokens, probs, lengths)
        if self._global is not None:
            self._global.start()
        return DraftBatch(tokens, probs, lengths)

    def _mix_drafts(self, handles, budgets, kmax: int, min_probs: np.ndarray, out: DraftBatch, parts: int) -> None:
        """The ``mix`` kernel for these rows on ``parts`` threads: writes ``out`` and the rows'
        pending drafts (``kmax``: the largest budget; ``min_probs``: float64, each row's cutoff)."""
        mixer = self._mixer
        if kmax > mixer.pending.tokens.shape[1]:
            mixer.fit_draft_length(kmax)
        scopes = mixing.Scopes(self._requests.tree_refs, self._trees.prior, self.prior, self._global_index, self.prior, self.max_depth)
        # plain tuples: numba's dispatcher types them in C, a NamedTuple in Python (a few microseconds a call)
        args = (self._trees.bufs, tuple(scopes), handles, budgets, min_probs, tuple(mixer.model), tuple(mixer.pending), self.defer_global,
                tuple(out))
        if parts > 1:
            self._on_threads(parts, mixing.mix_batch_parallel, *args, parts)
        else:
            mixing.mix_batch(*args)

    def _on_threads(self, parts: int, kernel, *args) -> None:
        """:func:`das.step_threads.on_threads`, counted in ``parallel_calls``."""
        step_threads.on_threads(parts, kernel, *args)
        self.parallel_calls += 1

    def _threads_for(self, rows: int) -> int:
        """Threads a batch call of ``rows`` rows runs on (:func:`das.step_threads.threads_for`)."""
        return step_threads.threads_for(rows, self._threads)

    def _learn(self, handles: np.ndarray, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        """Teach the mixer the outcomes of the rows' pending drafts (checked rows only; ``mix`` chooser)."""
        if self.chooser == "mix":
            self._mixer.learn(handles, tokens, starts, ends)

    def num_tokens(self, req_ids: Sequence[Hashable]) -> np.ndarray:
        """Tokens (prompt + output) each request has been given so far (its prompt at
        :meth:`start_request`, then every appended token).

        Returns:
            ``np.int64[len(req_ids)]``: the prompt's length plus every token appended since.

        Raises:
            KeyError: an id that is not a live request.
        """
        return self._requests.tree_refs[self._requests.handles_of(req_ids), kernels.R_NUM_TOKENS]

    # ------------------------------------------------------------------ the global tree's deferred work
    def _sync_global(self, keeps: bool = True) -> None:
        """Bring the global tree up to date before a verb reads or changes the trees
        (:meth:`das.global_tree.GlobalTree.sync`)."""
        if self._global is not None:
            self._global.sync(keeps)

    def close(self) -> None:
        """Finish the global tree's deferred work (``defer_global``) and stop its background thread.
        The drafter stays usable: a later deferred step starts the thread again."""
        if self._global is not None:
            self._global.close()

    @property
    def deferred_appends(self) -> int:
        """:meth:`add_tokens_batch` calls whose global-tree part ran in the background."""
        return self._global.deferred_appends if self._global is not None else 0

    @property
    def deferred_keeps(self) -> int:
        """:meth:`stop_request` calls whose global-tree part was deferred (run by a later job or sync)."""
        return self._global.deferred_keeps if self._global is not None else 0

    @property
    def deferred_ns(self) -> int:
        """Nanoseconds the deferred global-tree work took."""
        return self._global.deferred_ns if self._global is not None else 0

    # ------------------------------------------------------------------ inspection
    @property
    def outcomes_learned(self) -> int:
        """Draft tokens (and stop tokens) whose accept/reject outcome the ``"mix"`` chooser's mixer learned from."""
        return self._mixer.learned

    @property
    def mixer_weights(self) -> np.ndarray:
        """A copy of the ``"mix"`` chooser's weights: ``float64[NSETS, NIN]`` (one row per draft
        position 0, 1, 2, 3+; inputs as in :mod:`das.mix_kernels`)."""
        return self._mixer.weight_sets()

    def stats(self) -> dict[str, int]:
        """Counters: ``problems``, ``sequences``, ``tokens`` (stored in problem trees, prompt tails
        included), ``nodes``, ``bytes`` (problem trees and the global tree), ``requests`` (live),
        ``request_tree_bytes``, ``global_rollouts`` (rollouts in the global tree), ``global_tree_bytes``,
        ``mix_outcomes`` (draft-token and stop-token outcomes the ``"mix"`` chooser's mixer learned from),
        ``parallel_calls`` (:meth:`add_tokens_batch` and :meth:`speculate_batch` calls run on
        several threads)."""
        self._sync_global()
        seqs, toks, nodes, nbytes = self._problems.totals()
        rbytes = sum(r.tree.nbytes for r in self._requests.requests.values() if r.tree is not None)
        gbytes = self._global.tree.nbytes if self._global is not None else 0
        return {
            "problems": len(self._problems),
            "sequences": seqs,
            "tokens": toks,
            "nodes": nodes,
            "bytes": nbytes + gbytes,
            "requests": len(self._requests),
            "request_tree_bytes": rbytes,
            "global_rollouts": len(self._global.finished) if self._global is not None else 0,
            "global_tree_bytes": gbytes,
            "mix_outcomes": self._mixer.learned,
            "parallel_calls": self.parallel_calls,
        }

    def _check_batch_state(self) -> None:
        """Slow check (for tests) that what the batch kernels read agrees with the Python objects;
        raises AssertionError otherwise."""
        self._sync_global()
        live = self._problems.check()
        live.update(self._requests.check(self._global.tree if self._global is not None else None))
        if self._global is not None:
            live[self._global.index] = self._global.tree
        self._trees.check(live)
