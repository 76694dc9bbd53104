"""Worker-extension verbs that connect the DAS proposer in a vLLM worker to the shared rollout history.

A mixin of :class:`integrations.vllm_ext.worker_extension.DASWorkerExtension` (the one worker extension,
``worker_extension_cls``, that :func:`integrations.vllm_ext.engine.make_llm` sets): vLLM adds it to the
worker's bases, and the driver calls its methods by name with
``llm.collective_rpc("das_add_history", args=(rollouts,))``, in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and with the engine core in its own process alike. Each call
returns one result per worker. :func:`add_history` and the other functions here are the driver-side calls.
The rollouts come from :class:`integrations.rl.history.HistoryClient`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any


class HistoryExtension:
    """vLLM worker mixin: ingest, list and evict the problems of the worker's DAS drafter."""

    def _das_proposer(self) -> Any:
        """The worker's DAS proposer; None on a rank whose drafts vLLM does not use (no drafter there)."""
        drafter = getattr(getattr(self, "model_runner", None), "drafter", None)
        if drafter is None or not hasattr(drafter, "begin_iteration"):
            raise RuntimeError("this engine does not run the DAS proposer (speculative method is not 'das')")
        return drafter if getattr(drafter, "drafting", True) and hasattr(drafter, "drafter") else None

    def das_add_history(self, rollouts: Sequence[tuple[Hashable, Sequence[int], Sequence[int], int]]) -> int:
        """Add finished rollouts ``(problem id, prompt ids, output ids, policy version)`` to the drafter
        (:meth:`das.drafter.DASDrafter.add_rollout`) and their lengths to the proposer's length history.

        Returns:
            How many the drafter stored (rollouts outside its window are ignored).

        Raises:
            RuntimeError: the engine does not run the DAS proposer.
            ValueError: bad token ids or policy version.
        """
        proposer = self._das_proposer()
        if proposer is None:
            return 0
        stored = 0
        for pid, prompt, output, version in rollouts:
            if proposer.drafter.add_rollout(prompt, output, problem_id=pid, policy_version=int(version)):
                stored += 1
                proposer.lengths.finished(pid, len(output))
        return stored

    def das_problems_served(self) -> list[Hashable]:
        """The problem ids the drafter holds a tree for."""
        proposer = self._das_proposer()
        return [] if proposer is None else list(proposer.drafter._problems.problems)

    def das_evict_problems(self, problem_ids: Sequence[Hashable]) -> int:
        """Drop these problems' trees and history from the drafter; returns how many it held."""
        proposer = self._das_proposer()
        return 0 if proposer is None else sum(bool(proposer.drafter.evict_problem(pid)) for pid in problem_ids)

    def das_drafter_stats(self) -> dict[str, int]:
        """The drafter's memory counters (:meth:`das.drafter.DASDrafter.stats`)."""
        proposer = self._das_proposer()
        return {} if proposer is None else proposer.drafter.stats()


def add_history(llm: Any, rollouts: Sequence[tuple[Hashable, Sequence[int], Sequence[int], int]]) -> int:
    """Ingest ``rollouts`` into every drafting worker's drafter; returns what the first worker (the drafting rank) stored."""
    return llm.collective_rpc("das_add_history", args=([(p, list(a), list(b), int(v)) for p, a, b, v in rollouts],))[0]


def problems_served(llm: Any) -> list[Hashable]:
    """Problem ids in the first worker's drafter."""
    return llm.collective_rpc("das_problems_served")[0]


def evict_problems(llm: Any, problem_ids: Sequence[Hashable]) -> int:
    """Evict ``problem_ids`` from every worker's drafter; returns how many the first worker held."""
    return llm.collective_rpc("das_evict_problems", args=(list(problem_ids),))[0]


def drafter_stats(llm: Any) -> dict[str, int]:
    """The first worker's drafter memory counters."""
    return llm.collective_rpc("das_drafter_stats")[0]
