"""Compile (or load from numba's disk cache) every kernel an engine's drafter calls, before the engine's first step.

numba compiles a kernel on its first call in a process with new argument types, or loads it from
its cache on disk. Where that cache is missing or stale (a fresh install; an update, after which
:mod:`das.numba_cache` expires every kernel together) the first calls compile: tens of seconds
in all (``start_request``, ``add_tokens_batch`` and ``speculate_batch``, below and from
:data:`das.step_threads.PARALLEL_ROWS` rows). Inside a vLLM engine those first calls are the
first decode steps of the first rollout iteration, which then spends seconds compiling in the
proposer and runs slower than a plain engine (docs/benchmarks.md, "Measurement notes").

:func:`warm_up` runs a small synthetic workload through the verbs the vLLM proposer
(:class:`integrations.vllm_ext.proposer.DASProposer`) calls, with the argument types it passes
(vLLM's ``int32`` ``token_ids_cpu``, ``int64`` row vectors), on a throwaway drafter with the
engine drafter's settings: start, append, draft and stop requests below and from
``PARALLEL_ROWS`` rows, trees that outgrow their first buffers and hash tables, a policy version
that advances until the window expires old rollouts, and a global tree that lets its oldest go.
Then every kernel of that path is compiled or loaded when the engine starts, and its steps run at
their own speed from the first one. With a warm cache it takes under a second (loading the
kernels from disk, which the first steps would do otherwise).
"""

from __future__ import annotations

import time

import numpy as np

from das.drafter import DASDrafter
from das.step_threads import PARALLEL_ROWS

K = 8  # draft tokens asked per row and step


def _rollouts(d: DASDrafter, rng: np.random.Generator, rows: int, steps: int, prompt_len: int, tag: str) -> None:
    """``rows`` requests of 3 problems, ``steps`` engine steps as the proposer makes them: append
    each row's new tokens from an ``int32`` token matrix, then draft for every row. Rows of a
    problem copy its pattern with a few changes, so drafts are found, verified and learned from."""
    width = prompt_len + steps * 3 + K + 2
    tokens = np.zeros((rows, width), np.int32)  # as vLLM's token_ids_cpu: row r = prompt + output so far
    patterns = [rng.integers(0, 5000, 97, dtype=np.int32) for _ in range(3)]
    ids = [(tag, r) for r in range(rows)]
    for r, rid in enumerate(ids):
        tokens[r, :prompt_len] = np.resize(patterns[r % 3], prompt_len)
        if r == 0:  # distinct tokens: a tree whose root outgrows its hash table
            tokens[r, :prompt_len] = rng.permutation(max(5000, prompt_len))[:prompt_len]
        d.start_request(rid, tokens[r, :prompt_len], problem_id=f"{tag}/{r % 3}")
    seen = np.full(rows, prompt_len, np.int64)
    for _ in range(steps):
        ends = seen + rng.integers(1, 4, rows)
        for r in range(rows):
            out = np.resize(patterns[r % 3], int(ends[r]))[int(seen[r]) :]
            flip = rng.random(out.shape[0]) < 0.1
            tokens[r, int(seen[r]) : int(ends[r])] = np.where(flip, rng.integers(0, 5000, out.shape[0]), out)
        d.add_tokens_batch(ids, tokens, seen, ends)
        seen = ends
        d.speculate_batch(ids, np.full(rows, K, np.int64))
    for rid in ids:
        d.stop_request(rid)


def warm_up(**drafter_kwargs) -> float:
    """Compile or load every kernel the vLLM proposer's drafter calls (see the module docstring).

    Args:
        drafter_kwargs: the engine drafter's :class:`das.drafter.DASDrafter` arguments (the same
            settings take the same kernel paths: ``chooser``, ``defer_global``, ``draft_threads``).

    Returns:
        Seconds it took (tens of seconds when the kernels compile, under a second when they load).

    Raises:
        ValueError: bad ``drafter_kwargs``, as :class:`das.drafter.DASDrafter` raises them.
    """
    t0 = time.perf_counter()
    d = DASDrafter(**drafter_kwargs)
    rng = np.random.default_rng(0)
    _rollouts(d, rng, 3, 24, 40, "a")  # one thread
    _rollouts(d, rng, PARALLEL_ROWS + 2, 8, 1500, "b")  # several threads, where the drafter uses them; long prompts grow the trees
    d.begin_iteration(d.policy_version + 1)  # the window advances: older rollouts down-weighted
    _rollouts(d, rng, PARALLEL_ROWS + 2, 4, 40, "a")
    d.begin_iteration(d.policy_version + d.window + 1)  # and expires them: sequences leave the trees
    _rollouts(d, rng, 3, 4, 40, "a")
    g = DASDrafter(**{**drafter_kwargs, "global_rollouts": 1})  # the global tree lets its oldest rollouts go
    _rollouts(g, rng, 3, 4, 40, "g")
    _rollouts(g, rng, 3, 4, 40, "h")
    d.close()  # the deferred global-tree work (defer_global), then its thread goes
    g.close()
    return time.perf_counter() - t0
