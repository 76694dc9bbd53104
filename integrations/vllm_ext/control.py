"""Driver-side verbs for the DAS proposer living inside vLLM's workers.

They travel through ``LLM.collective_rpc`` so they work with the engine in-process or in worker
processes alike. Each returns one result per worker.
"""

from __future__ import annotations

from typing import Any


def _proposer(worker: Any):
    drafter = getattr(worker.model_runner, "drafter", None)
    if drafter is None or not hasattr(drafter, "begin_iteration"):
        raise RuntimeError("this engine does not run the DAS proposer (speculative method is not 'das')")
    return drafter


def _begin_iteration(worker: Any, policy_version: int) -> None:
    _proposer(worker).begin_iteration(policy_version)


def _snapshot(worker: Any) -> dict[str, Any]:
    return _proposer(worker).snapshot()


def begin_iteration(llm: Any, policy_version: int) -> None:
    """Advance every worker's drafter window to ``policy_version`` (int, non-decreasing).

    Raises:
        RuntimeError: the engine was not built with the DAS proposer.
        ValueError: ``policy_version`` went backwards.
    """
    llm.collective_rpc(_begin_iteration, args=(int(policy_version),))


def snapshot(llm: Any) -> list[dict[str, Any]]:
    """Per-worker proposer counters (steps, drafts, draft tokens, failures, seconds) and drafter memory."""
    return llm.collective_rpc(_snapshot)
