"""Scale mode of the replay benchmark: how insert and propose costs and memory grow with the number
of stored tokens, for the DAS suffix tree and arctic-inference's, both at depth 24.

The stream is synthetic but rollout-like: sequences of 256-2048 tokens over a Zipf-distributed
vocabulary of 50,000 ids, about half of each sequence copied in segments of 8-200 tokens (with a
few token substitutions) from one of the 64 previous sequences, as GRPO siblings and later
rollouts of one problem repeat each other. Tokens are appended 4 at a time (a decode step's worth),
each sequence to its own sequence id. At each checkpoint: insert cost (ns per token, over the
tokens since the previous checkpoint), propose latency of 2,000 drafts (K=16, factor 1, min prob
0.1) for contexts of 24 tokens, half cut from stored sequences and half from the unseen next
sequences, and C-heap bytes per stored token (the heap growth across each tree's own inserts).
"""

from __future__ import annotations

import gc
import sys
import time

import numpy as np

from benchmarks.replay_drafters import heap_bytes

DEPTH = 24
CHUNK = 4


def synthetic_stream(total: int, seed: int = 0) -> list[np.ndarray]:
    """Sequences (int32) whose lengths add up to at least ``total`` tokens (see the module docstring)."""
    rng = np.random.default_rng(seed)
    vocab = 50_000
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    p = ranks**-1.1
    p /= p.sum()
    perm = rng.permutation(vocab).astype(np.int32)
    seqs: list[np.ndarray] = []
    n = 0
    while n < total:
        L = int(rng.integers(256, 2049))
        fresh = perm[rng.choice(vocab, size=L, p=p)]
        out = fresh.copy()
        if seqs:
            src = seqs[-1 - int(rng.integers(0, min(64, len(seqs))))]
            j = 0
            while j < L:
                seg = int(rng.integers(8, 201))
                if rng.random() < 0.5 and src.shape[0] > seg:
                    a = int(rng.integers(0, src.shape[0] - seg))
                    m = min(seg, L - j)
                    out[j : j + m] = src[a : a + m]
                    flips = rng.random(m) < 0.02
                    out[j : j + m][flips] = fresh[j : j + m][flips]
                j += seg
        seqs.append(out)
        n += L
    return seqs


class _Ours:
    name = "das"

    def __init__(self):
        from das.suffix_tree import SuffixTree

        self.t = SuffixTree(DEPTH)
        self.ids: list[int] = []

    def new_seq(self) -> int:
        self.ids.append(self.t.add(np.empty(0, np.int32)))
        return self.ids[-1]

    def extend(self, sid, toks):
        self.t.extend(sid, toks)

    def propose(self, ctx):
        return self.t.draft(ctx, 16, 0.1, 1.0)


class _Arctic:
    name = "arctic"

    def __init__(self):
        from arctic_inference.suffix_decoding._C import SuffixTree

        self.t = SuffixTree(DEPTH)
        self.n = 0

    def new_seq(self) -> int:
        self.n += 1
        return self.n - 1

    def extend(self, sid, toks):
        self.t.extend_ndarray(sid, toks)

    def propose(self, ctx):
        return self.t.speculate_ndarray(ctx, 16, 1.0, 0.0, 0.1, False)


def _measure(classes, seqs: list[np.ndarray], checkpoints: list[int], rng_seed: int = 1) -> dict[str, list[dict]]:
    """Grow every tree in ``classes`` with the same stream, interleaved chunk by chunk (so that
    they share the machine's load alike); measure at each checkpoint."""
    perf = time.perf_counter_ns
    gc.collect()
    trees, heap0 = [], []
    for cls in classes:  # each tree's heap: the growth while it (alone) inserts
        heap0.append(heap_bytes())
        trees.append(cls())
    heap_of = [0] * len(trees)
    out = {t.name: [] for t in trees}
    ins_ns = [0] * len(trees)
    ins_tok = 0
    stored = 0
    rng = np.random.default_rng(rng_seed)
    ci = 0
    for si, s in enumerate(seqs):
        chunks = [s[j : j + CHUNK] for j in range(0, s.shape[0], CHUNK)]
        for q, t in enumerate(trees):  # one sequence at a time per tree, trees alternating
            h = heap_bytes()
            sid = t.new_seq()
            t0 = perf()
            for chunk in chunks:
                t.extend(sid, chunk)
            ins_ns[q] += perf() - t0
            h1 = heap_bytes()
            if h is not None and h1 is not None:
                heap_of[q] += h1 - h
        ins_tok += s.shape[0]
        stored += s.shape[0]
        while ci < len(checkpoints) and stored >= checkpoints[ci]:
            ctxs = []
            for q in range(2000):
                src = seqs[int(rng.integers(0, si + 1))] if q % 2 == 0 else seqs[min(len(seqs) - 1, si + 1 + int(rng.integers(0, 8)))]
                e = int(rng.integers(DEPTH, src.shape[0]))
                ctxs.append(np.ascontiguousarray(src[e - DEPTH : e]))
            lat = np.empty((len(trees), len(ctxs)))
            for c_i, c in enumerate(ctxs):
                for q, t in enumerate(trees):
                    t0 = perf()
                    t.propose(c)
                    lat[q, c_i] = perf() - t0
            lat /= 1e3
            for q, t in enumerate(trees):
                out[t.name].append({"tokens": int(stored), "insert_ns_per_token": round(ins_ns[q] / ins_tok, 1),
                                    "propose_us_p50": round(float(np.percentile(lat[q], 50)), 3),
                                    "propose_us_p99": round(float(np.percentile(lat[q], 99)), 3),
                                    "bytes_per_token": round(heap_of[q] / stored, 1) if heap0[q] is not None else None})
                ins_ns[q] = 0
            ins_tok = 0
            ci += 1
        if ci >= len(checkpoints):
            break
    del trees
    gc.collect()
    return out


def run_scale(checkpoints: list[int], trees=("das", "arctic")) -> dict:
    """Insert/propose cost and memory at each checkpoint (stored tokens) for each tree."""
    checkpoints = sorted(checkpoints)
    seqs = synthetic_stream(checkpoints[-1] + 20_000)
    res = {"depth": DEPTH, "chunk_tokens": CHUNK, "checkpoints": checkpoints}
    classes = [{"das": _Ours, "arctic": _Arctic}[n] for n in trees]
    small = seqs[:4]
    _measure(classes, small, [sum(s.shape[0] for s in small)])  # warm-up (numba compile, first touch)
    print(f"scale: {', '.join(trees)} up to {checkpoints[-1]} tokens ...", file=sys.stderr, flush=True)
    res["trees"] = _measure(classes, seqs, checkpoints)
    return res
