"""How the rows of one engine step are split over the drafter's threads.

The batch verbs of :class:`das.drafter.DASDrafter` run their kernels on several threads (numba
``prange``, as vLLM's n-gram proposer batches its rows) from :data:`PARALLEL_ROWS` rows on: below
that, waking the threads costs about what they save. Drafting splits rows freely (a row writes
only its own output); appending splits them by tree (rows that share a tree share a thread), and
:func:`insert_owners` decides which thread appends which tree. Every kernel runs on a numba team
cut to its parts (:func:`on_threads`). The results are those of one thread.

The constants are module globals read at each call, so that a benchmark or a test may set them
for a run. The figures behind them: docs/benchmarks.md, "Evidence from code comments".
"""

from __future__ import annotations

import numba
import numpy as np

from das import step_kernels

__all__ = ["BALANCED_PARTS", "GLOBAL_APPEND_COST", "LEARN_COST", "PARALLEL_ROWS", "insert_owners", "on_threads", "threads_for"]

# Rows from which the batch verbs run on several threads.
PARALLEL_ROWS = 16
# The global tree's append and the mixer's learning, per appended token, in units of a row's
# appends to its problem and request trees (on one thread at 256 rows). They set how many
# trees the parts that carry those two pieces get (:func:`das.step_kernels.balance_parts`).
GLOBAL_APPEND_COST = 0.3
LEARN_COST = 0.15
# Parts from which a step's trees are balanced over the parts (below: dealt by tree id modulo the
# parts). With two or three parts the global tree's append and the learning already sit on
# different threads, and balancing (its own cost, and tree groups that change from step to step)
# costs more than the evening out saves.
BALANCED_PARTS = 4


def threads_for(rows: int, threads: int) -> int:
    """Threads for a batch call of ``rows`` rows by a drafter of ``threads`` draft threads: 1 below
    :data:`PARALLEL_ROWS`, else ``threads`` as far as numba has them."""
    if threads < 2 or rows < PARALLEL_ROWS:
        return 1
    return min(threads, numba.get_num_threads())


def insert_owners(keys: np.ndarray, work: np.ndarray, parts: int, global_part: int, learn_part: int) -> np.ndarray:
    """Which of ``parts`` threads appends each row of a step (``int64[rows]`` in ``[0, parts)``).

    Rows with the same ``keys[r]`` (their tree's index, ``int64[rows]``, ``>= 0``) get the same
    part. From :data:`BALANCED_PARTS` parts on, whole trees go to the least loaded part
    (:func:`das.step_kernels.balance_parts`), counting ``work`` (``int64[rows]``, tokens each row
    appends) and, on ``global_part`` and ``learn_part`` (-1: none), the global tree's append and
    the mixer's learning (:data:`GLOBAL_APPEND_COST`, :data:`LEARN_COST` per token); below it,
    trees are dealt by index modulo ``parts``.
    """
    if parts >= BALANCED_PARTS:
        base = np.zeros(parts)
        total = float(work.sum())
        if global_part >= 0:
            base[global_part] += GLOBAL_APPEND_COST * total
        if learn_part >= 0:
            base[learn_part] += LEARN_COST * total
        return step_kernels.balance_parts(keys, work, parts, base)
    return keys % parts


def on_threads(parts: int, kernel, *args) -> None:
    """Call ``kernel(*args)``, a ``prange`` kernel over ``parts`` parts, with numba's team cut to
    ``parts`` threads (left alone, numba runs every parallel region on all of its threads, one per
    CPU, which then wake for parts they do not have and spin between steps); the team is restored
    after the call, also when it raises."""
    team = numba.get_num_threads()
    numba.set_num_threads(parts)
    try:
        kernel(*args)
    finally:
        numba.set_num_threads(team)
