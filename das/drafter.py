"""DASDrafter: per-problem, windowed, version-weighted suffix-tree drafter for RL rollouts.

The DAS paper (arXiv 2511.13841) keeps one suffix tree per problem (prompt), built from the
rollouts of a sliding window of recent policy iterations and updated online as tokens are
verified, and also queries a per-request tree over the prompt and the request's own output; the
better-scoring draft wins.

Verbs (arctic-inference-like): :meth:`DASDrafter.begin_iteration`, :meth:`~DASDrafter.start_request`,
:meth:`~DASDrafter.add_tokens`, :meth:`~DASDrafter.speculate`, :meth:`~DASDrafter.stop_request`,
:meth:`~DASDrafter.add_rollout`, :meth:`~DASDrafter.evict_problem`, :meth:`~DASDrafter.stats`.

Down-weighting without rewriting trees: a rollout of policy version ``v`` is stored in its problem
tree with weight ``decay ** -(v - base)`` (``base``: a per-problem reference version). Drafting
uses only ratios of counts, so this is the same as giving each rollout weight ``decay ** age``
(``age`` = versions behind the newest): each version older weighs ``decay`` times less. When the
exponent ``v - base`` would make weights exceed ``2**40``, the tree is rescaled once
(``SuffixTree.scale(decay ** (v - base))``) and ``base`` moves to ``v``.

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
from collections import OrderedDict
from typing import Hashable

import numpy as np

from das import _trie_kernels as K
from das.suffix_tree import VOCAB_LIMIT, Draft, SuffixTree, as_tokens, empty_draft

_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)
_new_tuple = tuple.__new__

__all__ = ["DASDrafter", "problem_id"]

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


_problem_id = problem_id


def _check_range(a: np.ndarray, name: str) -> None:
    if a.shape[0]:
        bad = (a < 0) | (a >= VOCAB_LIMIT)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"token {int(a[i])} at index {i} of {name} is out of range [0, {VOCAB_LIMIT})")


class _Problem:
    __slots__ = ("tree", "base", "by_version", "live")

    def __init__(self, max_depth: int, base: int):
        self.tree = SuffixTree(max_depth)
        self.base = base  # weight reference version
        self.by_version: dict[int, list[int]] = {}  # policy version -> sequence ids
        self.live: dict = {}  # request id -> sequence id, of live requests


class _Request:
    __slots__ = ("pid", "problem", "seq", "version", "tree", "tree_slot", "n")

    def __init__(self, pid, problem, seq, version, tree, tree_slot, n):
        self.pid = pid
        self.problem = problem  # _Problem, or None once evicted
        self.seq = seq  # sequence id in problem.tree
        self.version = version
        self.tree = tree  # per-request SuffixTree or None
        self.tree_slot = tree_slot  # the request tree's only sequence (id 0), its slot
        self.n = n  # tokens (prompt + output) so far


class DASDrafter:
    """Per-problem windowed suffix-tree drafter (see the module docstring).

    Args:
        window: int >= 1, policy versions kept per problem: after ``begin_iteration(v)`` only
            rollouts of versions ``>= v - window + 1`` remain. Default 16 (the paper found windows of
            16-32 iterations best; the smaller bounds memory and lookup cost).
        decay: float in (0, 1], weight of a rollout one policy version older relative to the newest
            (1.0: no down-weighting). Default 0.9: with window 16 the oldest kept version weighs
            0.9**15 ~ 0.2 of the newest; the paper prescribes mild down-weighting without a formula.
        max_depth: int >= 2, suffix tree depth (longest stored string; drafts match at most
            ``max_depth - 1`` context tokens). Default 24, as vLLM's ``suffix`` method.
        max_spec_factor: float > 0, a draft anchored on a ``m``-token match has at most
            ``floor(m * max_spec_factor)`` tokens. Default 2.0 (SuffixDecoding's 1.0 stops drafts
            that re-anchoring could carry on; see benchmarks/README.md).
        min_token_prob: float in [0, 1], drafts stop before the path probability falls below it.
            Default 0.2 (with ``prior`` the probabilities are calibrated, and 0.2 keeps drafted
            tokens per accepted token below arctic-inference's at its defaults).
        max_problems: int >= 1, problem trees kept; beyond it the least recently used problem
            without live requests is evicted. Default 4096 (a few epochs' worth of distinct prompts
            of a typical RL data set per engine).
        use_request_tree: bool, also draft from a per-request tree of the prompt + own output.
            Default True (as the paper and arctic-inference).
        prior: float >= 0, added to the denominator of every draft-token probability, in units
            of one current-version rollout's weight (see SuffixTree.draft): a continuation seen
            once gets ``1 / (1 + prior)`` instead of certainty. Default 0.3: on the DSR-sub
            replay, continuations seen once were right 78% of the time (1 / 1.3 = 0.77).

    Raises:
        ValueError: an argument of the wrong type or out of range (the message names it).
    """

    def __init__(
        self,
        window: int = 16,
        decay: float = 0.9,
        max_depth: int = 24,
        max_spec_factor: float = 2.0,
        min_token_prob: float = 0.2,
        max_problems: int = 4096,
        use_request_tree: bool = True,
        prior: float = 0.3,
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
        self._log_inv_decay = -math.log(self.decay)  # >= 0
        self._version = 0
        self._problems: OrderedDict[Hashable, _Problem] = OrderedDict()
        self._requests: dict[Hashable, _Request] = {}
        self._buf = (np.empty(64, np.int32), np.empty(64, np.float32))

    # ------------------------------------------------------------------ iterations
    @property
    def policy_version(self) -> int:
        """The current policy version (0 before any :meth:`begin_iteration`)."""
        return self._version

    def begin_iteration(self, policy_version: int) -> None:
        """Start rollouts of ``policy_version``: expire rollouts older than the window.

        Rollouts of versions ``< policy_version - window + 1`` are removed from their problem
        trees (a live request's rollout is removed when it stops), and problems left without
        rollouts or live requests are dropped. New requests and rollouts are tagged with
        ``policy_version``.

        Raises:
            ValueError: not an int, or smaller than the current version.
        """
        v = _int_arg(policy_version, "policy_version")
        if v < self._version:
            raise ValueError(f"policy_version must not go backwards: got {v}, current is {self._version}")
        self._version = v
        cutoff = v - self.window + 1
        for pid in list(self._problems):
            prob = self._problems[pid]
            old = [ver for ver in prob.by_version if ver < cutoff]
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
                del self._problems[pid]

    def _remove_seq(self, prob: _Problem, sid: int) -> None:
        if sid in prob.tree:
            prob.tree.remove(sid)

    # ------------------------------------------------------------------ problems
    def _weight(self, prob: _Problem, version: int) -> float:
        """Insertion weight of a ``version`` rollout in ``prob`` (rescales the tree if needed)."""
        e = (version - prob.base) * self._log_inv_decay
        if e > _RESCALE_LOG2 * math.log(2.0):
            prob.tree.scale(max(self.decay ** (version - prob.base), 1e-300))
            prob.base = version
            e = 0.0
        return max(math.exp(e), 1e-300)

    def _problem(self, pid: Hashable) -> _Problem:
        prob = self._problems.get(pid)
        if prob is None:
            prob = _Problem(self.max_depth, self._version)
            self._problems[pid] = prob
            self._evict_lru(keep=pid)
        else:
            self._problems.move_to_end(pid)
        return prob

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
                del self._problems[pid]
                excess -= 1

    def evict_problem(self, problem_id: Hashable) -> bool:
        """Drop a problem's tree and history. Live requests of it keep drafting from their
        request trees only. Returns whether the problem was known."""
        prob = self._problems.pop(problem_id, None)
        if prob is None:
            return False
        for rid in prob.live:
            self._requests[rid].problem = None
        return True

    def problem_tree(self, problem_id: Hashable) -> SuffixTree | None:
        """The problem's SuffixTree (read-only use), or None."""
        prob = self._problems.get(problem_id)
        return prob.tree if prob is not None else None

    def __contains__(self, problem_id: Hashable) -> bool:
        return problem_id in self._problems

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
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} is already live")
        prompt = as_tokens(prompt_ids, "prompt_ids")
        _check_range(prompt, "prompt_ids")
        pid = problem_id if problem_id is not None else _problem_id(prompt)
        tree = tree_slot = None
        if self.use_request_tree:
            tree = SuffixTree(self.max_depth)
            tree_slot = tree._seqs[tree.add(prompt)][0]  # validates the tokens
        prob = self._problem(pid)
        seq = prob.tree.add(self._prompt_tail(prompt), self._weight(prob, self._version))
        prob.by_version.setdefault(self._version, []).append(seq)
        prob.live[req_id] = seq
        self._requests[req_id] = _Request(pid, prob, seq, self._version, tree, tree_slot, prompt.shape[0])
        return pid

    def _prompt_tail(self, prompt: np.ndarray) -> np.ndarray:
        k = min(self.max_depth - 1, prompt.shape[0])
        return prompt[prompt.shape[0] - k :]

    def add_tokens(self, req_id: Hashable, tokens) -> None:
        """Append verified output tokens (1-D integer array-like) to a live request.

        Raises:
            KeyError: unknown request.
            ValueError: bad tokens (nothing is appended).
        """
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
        prob = req.problem
        pt = prob.tree if prob is not None else None
        rt = req.tree
        if pt is None and rt is None:
            _check_range(arr, "tokens")
            req.n += m
            return
        ps, pw = pt._seqs[req.seq] if pt is not None else (-1, 1.0)
        rs = req.tree_slot if rt is not None else -1
        da, db = K.extend2(pt._mem if pt is not None else rt._mem, ps, pw, rt._mem if rt is not None else pt._mem, rs, 1.0, arr)
        if da < 0:
            i = -da - 1
            raise ValueError(f"token {int(arr[i])} at index {i} of tokens is out of range [0, {VOCAB_LIMIT})")
        if da < m:
            pt._finish_insert(ps, arr[da:], pw)
        if db < m:
            rt._finish_insert(rs, arr[db:], 1.0)
        req.n += m

    def speculate(self, req_id: Hashable, max_tokens: int) -> Draft:
        """Draft up to ``max_tokens`` tokens for a live request.

        Drafts from the problem tree and (if enabled) the request tree with the request's context
        (prompt + output so far); returns the higher-score draft (ties: the problem tree's).

        Raises:
            KeyError: unknown request.
            ValueError: ``max_tokens`` not an int >= 0.
        """
        req = self._requests.get(req_id)
        if req is None:
            raise KeyError(f"unknown request {req_id!r}")
        if type(max_tokens) is not int:
            max_tokens = _int_arg(max_tokens, "max_tokens")
        if max_tokens <= 0:
            if max_tokens < 0:
                raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
            return empty_draft()
        prob = req.problem
        pt = prob.tree if prob is not None else None
        rt = req.tree
        if pt is None:
            if rt is None:
                return empty_draft()
            ps, pprior = -1, 0.0
        else:
            ps = pt._seqs[req.seq][0]  # a rebuild (after removals) may have moved it
            pprior = self.prior * math.exp((self._version - prob.base) * self._log_inv_decay) if self.prior else 0.0
        buf = self._buf
        if buf[0].shape[0] < 4 * max_tokens:
            buf = self._buf = (np.empty(4 * max_tokens, np.int32), np.empty(4 * max_tokens, np.float32))
        off, k, score, mlen = K.draft2(
            pt._mem if pt is not None else rt._mem, ps, pprior, rt._mem if rt is not None else pt._mem,
            req.tree_slot if rt is not None else -1, self.prior, max_tokens, self.min_token_prob, self.max_spec_factor,
            buf[0], buf[1],
        )
        if k == 0:
            return empty_draft()
        return _new_tuple(Draft, (buf[0][off : off + k].copy(), buf[1][off : off + k].copy(), score, mlen))

    def stop_request(self, req_id: Hashable) -> None:
        """Finish a request: free its request tree; its rollout stays in the problem tree (this
        iteration's history). Unknown ids are ignored (idempotent)."""
        req = self._requests.pop(req_id, None)
        if req is None:
            return
        req.tree = None
        prob = req.problem
        if prob is None:
            return
        prob.live.pop(req_id, None)
        if req.version < self._version - self.window + 1:  # expired while it ran
            self._remove_seq(prob, req.seq)
            lst = prob.by_version.get(req.version)
            if lst is not None and req.seq in lst:
                lst.remove(req.seq)
                if not lst:
                    del prob.by_version[req.version]
            if not prob.by_version and not prob.live and self._problems.get(req.pid) is prob:
                del self._problems[req.pid]

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
            policy_version: int, default the current version. Rollouts older than the window are
                ignored.

        Returns:
            Whether the rollout was stored.

        Raises:
            ValueError: bad tokens or version.
        """
        prompt = as_tokens(prompt_ids, "prompt_ids")
        out = as_tokens(output_ids, "output_ids")
        _check_range(prompt, "prompt_ids")
        _check_range(out, "output_ids")
        v = self._version if policy_version is None else _int_arg(policy_version, "policy_version")
        if v < self._version - self.window + 1:
            return False
        pid = problem_id if problem_id is not None else _problem_id(prompt)
        prob = self._problem(pid)
        seq = prob.tree.add(np.concatenate([self._prompt_tail(prompt), out]), self._weight(prob, v))
        prob.by_version.setdefault(v, []).append(seq)
        return True

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, int]:
        """Counters: ``problems``, ``sequences``, ``tokens`` (stored in problem trees, prompt tails
        included), ``nodes``, ``bytes`` (problem trees), ``requests`` (live), ``request_tree_bytes``."""
        seqs = toks = nodes = nbytes = 0
        for prob in self._problems.values():
            t = prob.tree
            seqs += t.num_sequences
            toks += t.num_tokens
            nodes += t.num_nodes
            nbytes += t.nbytes
        rbytes = sum(r.tree.nbytes for r in self._requests.values() if r.tree is not None)
        return {
            "problems": len(self._problems),
            "sequences": seqs,
            "tokens": toks,
            "nodes": nodes,
            "bytes": nbytes,
            "requests": len(self._requests),
            "request_tree_bytes": rbytes,
        }


def _int_arg(x, name: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {x!r}")
    x = int(x)
    if lo is not None and x < lo:
        raise ValueError(f"{name} must be >= {lo}, got {x}")
    if hi is not None and x > hi:
        raise ValueError(f"{name} must be <= {hi}, got {x}")
    return x


def _float_arg(x, name: str, expected: str, ok) -> float:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be {expected}, got {x!r}")
    f = float(x)
    if not ok(f):
        raise ValueError(f"{name} must be {expected}, got {x!r}")
    return f
