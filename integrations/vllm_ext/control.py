"""Driver-side verbs for the DAS proposer living inside vLLM's workers.

Each verb calls a method of :class:`integrations.vllm_ext.worker_extension.DASWorkerExtension` by name
through ``LLM.collective_rpc``, so it works with the engine core in the calling process or in its own
process, and with workers in further processes (tensor parallel), without
``VLLM_ALLOW_INSECURE_SERIALIZATION``. The engine needs the extension:
``LLM(..., worker_extension_cls="integrations.vllm_ext.worker_extension.DASWorkerExtension")``
(:func:`integrations.vllm_ext.engine.make_llm` adds it).
"""

from __future__ import annotations

from typing import Any

from integrations.vllm_ext.worker_extension import call


def begin_iteration(llm: Any, policy_version: int) -> None:
    """Advance every drafting worker's drafter window to ``policy_version`` (int, non-decreasing).

    Raises:
        ExtensionMissing (a RuntimeError): the engine was built without the DAS worker extension.
        RuntimeError: the engine was not built with the DAS proposer.
        ValueError: ``policy_version`` went backwards, or is not an int.
    """
    if isinstance(policy_version, bool) or not isinstance(policy_version, int) and not hasattr(policy_version, "__index__"):
        raise ValueError(f"policy_version must be an int, got {type(policy_version).__name__}: {policy_version!r}")
    call(llm, "das_begin_iteration", int(policy_version))


def snapshot(llm: Any) -> list[dict[str, Any]]:
    """Per drafting worker (one per engine but with pipeline stages: tensor-parallel ranks other than the
    drafting one have no proposer), the proposer's counters (steps, drafts, draft tokens, failures,
    seconds), the planner's fits and calibration and the drafter's memory, as plain values.

    Raises:
        ExtensionMissing (a RuntimeError): no DAS worker extension. RuntimeError: no DAS proposer.
    """
    return call(llm, "das_snapshot", drafting_only=True)


def enable_coupled_sampling(llm: Any) -> list[bool]:
    """Switch coupled sampling (:mod:`integrations.vllm_ext.patches.coupled_sampling`) on in every worker of ``llm``.

    ``DAS_VLLM_FEATURES=coupled_sampling`` in the environment instead installs it in every vLLM
    process at its start.

    Returns:
        per worker, whether it is on there (False where vLLM runs as shipped: another version or
        a CUDA build, where the keys are ignored; :func:`integrations.vllm_ext.patches.apply` logs why).

    Raises:
        ExtensionMissing (a RuntimeError): the engine was built without the DAS worker extension
            (the message says what to add).
    """
    return [bool(on) for on in call(llm, "das_enable_coupled_sampling")]
