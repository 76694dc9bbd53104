"""The drafters the replay benchmark compares, behind one small interface.

Each adapter is driven exactly as a vLLM proposer drives its drafter: ``start`` when a request
first samples (its prompt), ``add`` with the tokens each verification step produced, ``propose``
for the next step, ``stop`` when the request finishes; ``begin_iteration`` between policy
versions. ``propose`` gets the request's context (prompt + output so far, an ``int32`` view) and
returns the draft (a sequence of at most ``k`` token ids). The many-engine replay
(:mod:`benchmarks.replay_engines`) also hands an engine's drafter rollouts finished on other
engines: ``add_history`` (a problem it serves, with its policy version) and
``add_global_history`` (any problem, into the cross-problem tree only).

* :class:`DASAdapter`: :class:`das.DASDrafter` (per-problem trees + request tree).
* :class:`ArcticAdapter`: arctic-inference's ``SuffixDecodingCache`` configured and called as
  vLLM's ``suffix`` method does (``vllm/v1/spec_decode/suffix_decoding.py``): one global tree of
  cached responses (FIFO, 10,000 requests) plus a per-request tree of the prompt and response,
  ``speculate(pattern=last max_tree_depth tokens)``.
* :class:`NgramAdapter`: vLLM's n-gram prompt lookup over the request's own context, the same
  algorithm as ``vllm/v1/spec_decode/ngram_proposer.py`` (longest suffix n-gram with
  ``min_n <= n <= max_n``; of equally long matches the earliest; up to ``k`` following tokens).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
from numba import njit

from das import numba_cache
from das import trie_kernels as kernels

numba_cache.register(__file__)  # its kernels inline the trie's helpers: cached with the kernel modules' stamps


class DASAdapter:
    name = "das"

    def __init__(self, k: int, **config: Any):
        from das import DASDrafter

        self.k = k
        self.config = dict(config)
        self.d = DASDrafter(**config)
        self.last_probs = None

    def begin_iteration(self, version: int) -> None:
        self.d.begin_iteration(version)

    def start(self, rid, prompt: np.ndarray, pid: str) -> None:
        self.d.start_request(rid, prompt, problem_id=pid)

    def add(self, rid, tokens: np.ndarray) -> None:
        self.d.add_tokens(rid, tokens)

    def propose(self, rid, ctx: np.ndarray):
        d = self.d.speculate(rid, self.k)
        self.last_probs = d.probs
        return d.tokens

    def stop(self, rid) -> None:
        self.d.stop_request(rid)

    def add_history(self, hid, prompt: np.ndarray, output: np.ndarray, pid: str, version: int) -> bool:
        """Ingest a rollout finished on another engine (:meth:`das.DASDrafter.add_rollout`, with its
        policy version); returns whether the drafter kept it (in the window)."""
        return self.d.add_rollout(prompt, output, problem_id=pid, policy_version=version)

    def add_global_history(self, hid, prompt: np.ndarray, output: np.ndarray) -> bool:
        """Ingest a rollout of a problem this engine does not serve into the global tree only
        (:meth:`das.DASDrafter.add_rollout` with ``problem_tree=False``)."""
        return self.d.add_rollout(prompt, output, problem_tree=False)

    def stored(self) -> tuple[int, int]:
        """(structural bytes, tokens) of the history (problem trees)."""
        s = self.d.stats()
        return s["bytes"], s["tokens"]


class ArcticAdapter:
    name = "arctic_suffix"

    def __init__(self, k: int, max_tree_depth: int = 24, max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 max_cached_requests: int = 10_000, per_problem: bool = False):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self._cls = SuffixDecodingCache
        self.k = k
        self.depth = max_tree_depth
        self.factor = max_spec_factor
        self.min_prob = min_token_prob
        self.max_cached = max_cached_requests
        self.per_problem = per_problem
        self.config = dict(max_tree_depth=max_tree_depth, max_spec_factor=max_spec_factor, min_token_prob=min_token_prob,
                           max_cached_requests=max_cached_requests, per_problem=per_problem)
        self.caches: dict[Any, Any] = {}
        self.cache_of: dict[Any, Any] = {}
        self.tokens = 0
        self.last_probs = None

    def _cache(self, pid):
        key = pid if self.per_problem else None
        c = self.caches.get(key)
        if c is None:
            c = self.caches[key] = self._cls(max_tree_depth=self.depth, max_cached_requests=self.max_cached)
        return c

    def begin_iteration(self, version: int) -> None:
        pass  # the cache keeps the last max_cached_requests responses (vLLM has no notion of iterations)

    def start(self, rid, prompt: np.ndarray, pid: str) -> None:
        c = self._cache(pid)
        self.cache_of[rid] = c
        c.start_request(rid, prompt)

    def add(self, rid, tokens: np.ndarray) -> None:
        self.cache_of[rid].add_active_response(rid, tokens)
        self.tokens += tokens.shape[0]

    def propose(self, rid, ctx: np.ndarray):
        n = ctx.shape[0]
        pattern = ctx[n - self.depth:] if n > self.depth else ctx
        d = self.cache_of[rid].speculate(rid, pattern, max_spec_tokens=self.k, max_spec_factor=self.factor,
                                         min_token_prob=self.min_prob)
        self.last_probs = d.probs
        return d.token_ids

    def stop(self, rid) -> None:
        self.cache_of.pop(rid).stop_request(rid)

    def add_history(self, hid, prompt: np.ndarray, output: np.ndarray, pid: str, version: int) -> bool:
        """Ingest a rollout finished on another engine through the cache's public calls (start,
        the whole response, stop: its response joins the global tree as a cached response);
        ``hid`` is its request id, distinct from every replayed one. The cache has no policy
        versions: ``version`` is not used."""
        c = self._cache(pid)
        c.start_request(hid, prompt)
        c.add_active_response(hid, output)
        c.stop_request(hid)
        self.tokens += output.shape[0]
        return True

    def add_global_history(self, hid, prompt: np.ndarray, output: np.ndarray) -> bool:
        """The cache has one cross-problem tree: as :meth:`add_history` (the shared cache, per problem, when ``per_problem``)."""
        return self.add_history(hid, prompt, output, None, 0) if not self.per_problem else False

    def stored(self) -> tuple[int, int]:
        """(arctic's own ``estimate_memory`` of its global trees, tokens added)."""
        return sum(c._global_tree.estimate_memory() for c in self.caches.values()), self.tokens


@njit(cache=True)
def ngram_propose(tokens, min_n, max_n, k):
    """vLLM's ``_find_longest_matched_ngram_and_propose_tokens`` (vllm 0.32, Apache-2.0): KMP over
    the reversed context finds the longest suffix n-gram (``min_n <= n <= max_n``) that occurred
    before (the earliest of equally long ones); returns up to ``k`` tokens that followed it."""
    total = tokens.shape[0]
    if total < min_n or k <= 0:
        return tokens[:0]
    rev = tokens[::-1]
    lps = np.zeros(max_n, dtype=np.int32)
    longest = 0
    position = 0
    prev = 0
    i = 1
    while i < total:
        if rev[prev] == rev[i]:
            prev += 1
            if prev >= longest:
                longest = prev
                position = i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev != 0:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return tokens[:0]
    start = total - 1 - position + longest
    k = min(k, total - start)
    return tokens[start:start + k]


class NgramAdapter:
    name = "ngram"

    def __init__(self, k: int, min_n: int = 2, max_n: int = 4):
        self.k = k
        self.min_n = min_n
        self.max_n = max_n
        self.config = dict(min_n=min_n, max_n=max_n)

    def begin_iteration(self, version: int) -> None:
        pass

    def start(self, rid, prompt, pid) -> None:
        pass

    def add(self, rid, tokens) -> None:
        pass  # the engine's token buffer is the context: nothing to store

    def propose(self, rid, ctx: np.ndarray):
        return ngram_propose(ctx, self.min_n, self.max_n, self.k)

    def stop(self, rid) -> None:
        pass

    def add_history(self, hid, prompt, output, pid, version) -> bool:
        return False  # drafts from the request's own context only

    def add_global_history(self, hid, prompt, output) -> bool:
        return False

    def stored(self) -> tuple[int, int]:
        return 0, 0


def make_adapter(name: str, k: int, **config: Any):
    """Build the adapter ``name`` (``das``, ``arctic_suffix``, ``arctic_per_problem``, ``ngram``)."""
    if name == "das":
        return DASAdapter(k, **config)
    if name == "arctic_suffix":
        return ArcticAdapter(k, **config)
    if name == "arctic_per_problem":
        a = ArcticAdapter(k, per_problem=True, **config)
        a.name = name
        return a
    if name == "ngram":
        return NgramAdapter(k, **config)
    raise ValueError(f"unknown drafter {name!r}")


# ----------------------------------------------------------------------------- heap accounting


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = None


def heap_bytes() -> int | None:
    """Bytes the C heap has handed out and not taken back (glibc ``mallinfo2``: in-use chunks of
    every arena plus mmapped blocks), or None where that is not available. numpy array data and
    C++ ``new`` both come from here; Python's small objects do not (pymalloc arenas)."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.mallinfo2.restype = _MallInfo2
        m = _libc.mallinfo2()
        return int(m.uordblks + m.hblkhd)
    except (OSError, AttributeError):
        return None


# ----------------------------------------------------------------------------- hindsight bound


@njit(cache=True)
def _hindsight(mem, s, truth, k, out):
    """Of the greedy walks (no probability floor, no spec factor, up to ``k`` tokens) from every
    suffix locus of slot ``s``, the one sharing the longest prefix with ``truth``; writes it to
    ``out`` and returns ``(length, common prefix)``."""
    meta, nodes, weights, hash_table, seqs, pool = kernels.borrowed_views(mem)
    D = meta[kernels.M_MAX_DEPTH]
    n = seqs[s, kernels.S_LEN]
    w = min(n, D - 1)
    scratch = np.empty(w + k + 1, np.int32)
    base = seqs[s, kernels.S_BASE] + n - w
    tok = np.empty(k, np.int32)
    prob = np.empty(k, np.float32)
    best_m = -1
    best_n = 0
    for L in range(w, 0, -1):
        for i in range(w):
            scratch[i] = pool[base + i]
        u = seqs[s, kernels.S_LOCI + L]
        got, _ = kernels.greedy_walk((nodes, weights, hash_table, meta, seqs, pool), u, nodes[u, kernels.C_DEPTH], k, 0.0, 0.0,
                                     scratch, w, (tok, prob), 0)
        m = 0
        while m < got and m < truth.shape[0] and tok[m] == truth[m]:
            m += 1
        if m > best_m:
            best_m = m
            best_n = got
            out[:got] = tok[:got]
    return best_n, max(best_m, 0)


class DASHindsightAdapter(DASAdapter):
    """DAS's trees with the anchor chosen in hindsight: of every suffix match in the problem and
    request trees, the walk (up to K tokens, no probability floor) that shares the longest prefix
    with the real continuation. No drafter that picks one greedy path from these trees can accept
    more: an upper bound for anchor-selection rules, not a drafter."""

    name = "das_hindsight"

    def __init__(self, k: int, truth: dict, **config: Any):
        super().__init__(k, **config)
        self.truth = truth  # rid -> output tokens (int32)
        self.pos: dict = {}
        self.out = np.empty(k, np.int32)

    def start(self, rid, prompt, pid):
        super().start(rid, prompt, pid)
        self.pos[rid] = 0

    def add(self, rid, tokens):
        super().add(rid, tokens)
        self.pos[rid] += tokens.shape[0]

    def propose(self, rid, ctx):
        truth = self.truth[rid][self.pos[rid] : self.pos[rid] + self.k]
        best, best_m = [], -1
        for tree, seq in self.d.request_sequences(rid):
            n, m = _hindsight(tree.buffer, tree.slot(seq), truth, self.k, self.out)
            if m > best_m:
                best, best_m = self.out[:n].tolist(), m
        self.last_probs = None
        return best

    def stop(self, rid):
        super().stop(rid)
        del self.pos[rid]
