"""The driver's control verbs, reached by name in every vLLM worker: :class:`DASWorkerExtension`.

vLLM mixes a *worker extension* class into its worker class in every worker process (engine
argument ``worker_extension_cls``, ``vllm.v1.worker.worker_base.WorkerWrapperBase.init_worker``);
``LLM.collective_rpc("name", args=...)`` then calls the method of that name on every worker. A
method name and plain arguments cross vLLM's message encoder in every topology: the engine core
in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), in its own process (vLLM's default),
and workers in further processes (tensor parallel). A Python function does not: vLLM refuses to
send one unless ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``. So every driver verb of das
(:mod:`integrations.vllm_ext.control`, :mod:`integrations.vllm_ext.weight_sync`,
:func:`integrations.vllm_ext.control.enable_coupled_sampling`) calls a ``das_*`` method by name
through :func:`call`.

Plain vLLM: add one argument to ``LLM(...)``::

    LLM(..., worker_extension_cls="integrations.vllm_ext.worker_extension.DASWorkerExtension")

(:func:`integrations.vllm_ext.engine.make_llm` adds it by itself). A framework with its own extension
class (verl) derives from both (``integrations.rl.verl.CPUWorkerExtension``).

What crosses the process boundary, and how:

* Arguments and results are plain msgpack values: vLLM decodes a utility call's arguments and, without
  insecure serialization, its result without type information, so a ``torch.Tensor`` arrives as a
  ``[dtype, shape, buffer index]`` triple whose buffer is gone. Tensors therefore travel as
  :func:`pack_tensor` triples ``(dtype name, shape, bytes)`` and are rebuilt by :func:`unpack_tensor`;
  with the engine core in the calling process they pass as tensors, untouched.
* A worker's exception becomes ``Exception("Call to collective_rpc method failed: ...")`` in the
  driver when the engine core runs in its own process. Each ``das_*`` method therefore returns
  ``{"ok": value}`` or ``{"error": [type name, message]}``, and :func:`call` raises the same
  exception type (``ValueError``, ``RuntimeError``, ``TypeError``) in every topology.
* Tensor parallel: only the drafting rank builds the DAS proposer
  (:func:`integrations.vllm_ext.proposer.drafting_rank`); the others have an idle stand-in and answer
  ``None``, which :func:`call` drops when asked for the drafting workers' answers only.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from integrations.vllm_ext.history_ext import HistoryExtension

EXTENSION = "integrations.vllm_ext.worker_extension.DASWorkerExtension"
_RAISED = {"ValueError": ValueError, "RuntimeError": RuntimeError, "TypeError": TypeError, "KeyError": KeyError}


class ExtensionMissing(RuntimeError):
    """The engine's workers have no DAS worker extension: the engine was built without ``worker_extension_cls``."""


def missing_message(method: str) -> str:
    return (f"this engine's workers have no method {method!r}: build it with "
            f"LLM(..., worker_extension_cls={EXTENSION!r}) (integrations.vllm_ext.engine.make_llm adds it), "
            f"or derive your own worker extension class from it")


# ---------------------------------------------------------------------------------------------- tensors


def pack_tensor(t: Any) -> tuple[str, list[int], bytes]:
    """A tensor as ``(dtype name, shape, raw bytes)``, plain msgpack values (bfloat16 included).

    Args:
        t: a ``torch.Tensor`` on any device (copied to the CPU, made contiguous).
    """
    import torch

    c = t.detach().to("cpu").contiguous()
    raw = c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
    return str(c.dtype).removeprefix("torch."), list(c.shape), raw


def unpack_tensor(packed: Any) -> Any:
    """The tensor of a :func:`pack_tensor` triple (a tensor is returned as it is).

    Raises:
        TypeError: ``packed`` is neither a tensor nor a ``(dtype, shape, bytes)`` triple.
    """
    import torch

    if isinstance(packed, torch.Tensor):
        return packed
    try:
        dtype_name, shape, raw = packed
        dtype = getattr(torch, str(dtype_name))
    except (TypeError, ValueError, AttributeError):
        raise TypeError(f"expected a tensor or a (dtype, shape, bytes) triple, got {type(packed).__name__}") from None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{dtype_name!r} is not a torch dtype")
    if not raw:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(tuple(shape))


def pack_named(named: list[tuple[str, Any]], remote: bool) -> list[tuple[str, Any]]:
    """``(name, tensor)`` pairs for a worker: packed when ``remote`` (the engine core is another process)."""
    return [(name, pack_tensor(t)) for name, t in named] if remote else list(named)


def engine_in_other_process(llm: Any) -> bool:
    """Whether ``llm``'s engine core runs in another process (vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING=1``)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    return core is not None and type(core).__name__ != "InprocClient"


# ---------------------------------------------------------------------------------------------- driver side


def call(llm: Any, method: str, *args: Any, drafting_only: bool = False) -> list[Any]:
    """``llm.collective_rpc(method, args=args)`` with the workers' answers unwrapped.

    Args:
        llm: a ``vllm.LLM`` (anything with ``collective_rpc``).
        method: a ``das_*`` method of :class:`DASWorkerExtension`.
        drafting_only: drop the answers of the ranks that do not draft (``None``).

    Returns:
        One value per worker (per drafting worker with ``drafting_only``).

    Raises:
        ExtensionMissing: the workers have no such method (the engine was built without the extension).
        ValueError, RuntimeError, TypeError, KeyError: what the method raised in a worker.
    """
    if not isinstance(method, str):  # the point of this module: never a function
        raise TypeError(f"method must be a worker method's name, got {type(method).__name__}")
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    if config is not None and not getattr(config.parallel_config, "worker_extension_cls", ""):
        raise ExtensionMissing(missing_message(method))
    try:
        answers = llm.collective_rpc(method, args=tuple(args))
    except Exception as exc:  # noqa: BLE001 - vLLM's run_method: "Method 'x' is not implemented." (wrapped once more across processes)
        text = str(exc)
        if repr(method) in text and ("not implemented" in text or "has no attribute" in text):
            raise ExtensionMissing(missing_message(method)) from exc
        raise
    out = []
    for a in answers:
        if isinstance(a, dict) and "error" in a:
            kind, message = a["error"]
            raise _RAISED.get(kind, RuntimeError)(message)
        value = a.get("ok") if isinstance(a, dict) else a
        if value is None and drafting_only:
            continue
        out.append(value)
    return out


# ---------------------------------------------------------------------------------------------- worker side


def plain(obj: Any) -> Any:
    """``obj`` with numpy scalars and arrays, tuples and non-str keys made JSON/msgpack values."""
    import numpy as np

    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return plain(obj.tolist())
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _answer(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a worker method; its value as ``{"ok": value}``, a raised error as ``{"error": [type, message]}``."""

    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return {"ok": fn(self, *args, **kwargs)}
        except (ValueError, RuntimeError, TypeError, KeyError) as exc:
            return {"error": [type(exc).__name__, str(exc)]}

    return method


def _drafter(worker: Any) -> Any | None:
    """The worker's DAS proposer; None on a rank that does not draft.

    Raises:
        RuntimeError: the engine does not run the DAS proposer.
    """
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    if drafter is None or not hasattr(drafter, "begin_iteration"):
        raise RuntimeError("this engine does not run the DAS proposer (speculative method is not 'das')")
    return drafter if getattr(drafter, "drafting", True) else None


class DASWorkerExtension(HistoryExtension):
    """das's worker methods, mixed into vLLM's worker class (``worker_extension_cls``; module doc).

    Every method returns ``{"ok": value}`` or ``{"error": [type, message]}`` (:func:`call` unwraps it).
    Names start with ``das_``: vLLM refuses an extension whose names the worker class already has.
    The shared history's verbs (``das_add_history``, ``das_problems_served``, ``das_evict_problems``,
    ``das_drafter_stats``) come from :class:`integrations.vllm_ext.history_ext.HistoryExtension`.
    """

    @_answer
    def das_begin_iteration(self, policy_version: int) -> None:
        """Advance the drafter's window to ``policy_version`` (no-op on a rank that does not draft).

        Raises:
            ValueError: ``policy_version`` went backwards. RuntimeError: no DAS proposer.
        """
        drafter = _drafter(self)
        if drafter is not None:
            drafter.begin_iteration(int(policy_version))

    @_answer
    def das_snapshot(self, path: str | None = None) -> dict[str, Any] | None:
        """The proposer's counters (``DASProposer.snapshot``) as plain values; with ``path`` also written
        there as JSON (for callers whose ``collective_rpc`` returns nothing, as verl's server). None on a
        rank that does not draft."""
        drafter = _drafter(self)
        if drafter is None:
            return None
        snap = plain(drafter.snapshot())
        if path:
            Path(path).write_text(json.dumps(snap, default=float))
        return snap

    @_answer
    def das_policy_version(self) -> int | None:
        """The drafter's policy version (None on a rank that does not draft)."""
        drafter = _drafter(self)
        return None if drafter is None else int(drafter.drafter.policy_version)

    @_answer
    def das_reload_weights(self, named: list, is_checkpoint_format: bool = True) -> int:
        """Load ``(name, tensor or packed tensor)`` pairs into this worker's model in place; returns how many.

        ``is_checkpoint_format``: Hugging Face names and layout (vLLM's layer-wise in-place reload), or
        vLLM's own parameter names and layout, already sharded (copied as they are). vLLM builds
        without ``reload_weights`` call the model's ``load_weights`` (checkpoint format only).
        """
        pairs = [(str(name), unpack_tensor(t)) for name, t in named]
        if hasattr(self, "reload_weights"):
            self.reload_weights(weights_iterator=iter(pairs), is_checkpoint_format=bool(is_checkpoint_format))
        elif is_checkpoint_format:
            self.model_runner.model.load_weights(weights=iter(pairs))
        else:
            raise RuntimeError("this vLLM has no reload_weights: kernel-format weights cannot be loaded")
        return len(pairs)

    @_answer
    def das_state_dict(self, names: list[str] | None = None) -> dict[str, Any]:
        """This worker's parameters in vLLM's names, packed (:func:`pack_tensor`); ``names`` None: all."""
        model = self.model_runner.model
        wanted = None if names is None else set(names)
        return {n: pack_tensor(p) for n, p in model.named_parameters() if wanted is None or n in wanted}

    @_answer
    def das_enable_coupled_sampling(self) -> bool:
        """Install the coupled-sampling feature in this worker's process; whether it is on
        (:func:`integrations.vllm_ext.control.enable_coupled_sampling`)."""
        from integrations.vllm_ext import patches
        from integrations.vllm_ext.patches.coupled_sampling import PATCH

        return PATCH.name in patches.apply(features=(PATCH.name,))
