"""One place that builds vLLM engines for every speculative method the project compares.

``make_llm`` applies this machine's CPU settings by itself (see :mod:`integrations.vllm_ext.cpu_runtime`),
adds das's worker extension (:mod:`integrations.vllm_ext.worker_extension`: the control verbs by name,
in-process or with the engine core in its own process) and builds ``speculative_config`` for ``none``, ``das``, ``ngram`` (vLLM prompt lookup) and
``suffix`` (vLLM's SuffixDecoding, arctic-inference) from :func:`speculative_config`.
"""

from __future__ import annotations

import os
from typing import Any

from das.config import STEP_LOG_ENV
from integrations.vllm_ext import cpu_runtime
from integrations.vllm_ext.worker_extension import EXTENSION

METHODS = ("none", "das", "ngram", "suffix", "suffix-bs")
PROPOSER_CLASS = "integrations.vllm_ext.proposer.DASProposer"
# Default K (most draft tokens per row and step). ngram: vLLM's usual prompt-lookup setting;
# suffix: arctic-inference's own default; das: 16, as suffix, so acceptance compares. A larger K lets
# the priced budgets draft up to K per row in the long tail (scheduler.planner); at 32 it made
# the DSR-sub long tail slower on a CPU (docs/benchmarks.md, "The long tail").
DEFAULT_NUM_SPEC_TOKENS = {"das": 16, "ngram": 4, "suffix": 16, "suffix-bs": 16}
# ``suffix-bs``: vLLM suffix decoding with vLLM's own batch-size schedule
# (``num_speculative_tokens_per_batch_size``, inclusive ranges of running requests -> K): the best a
# user could configure without us. Full drafts in the tail, fewer in mid-size batches, none at full batch.
BATCH_SIZE_SCHEDULE = [(1, 4, 16), (5, 16, 8), (17, 1 << 20, 0)]


def speculative_config(method: str, num_speculative_tokens: int | None = None) -> dict[str, Any] | None:
    """vLLM ``speculative_config`` for ``method`` (None for ``none``).

    Args:
        method: one of :data:`METHODS`.
        num_speculative_tokens: K, the most draft tokens per row and step; None takes
            :data:`DEFAULT_NUM_SPEC_TOKENS`.

    Raises:
        ValueError: unknown method, or K < 1.
    """
    if method not in METHODS:
        raise ValueError(f"unknown speculative method {method!r}; expected one of {list(METHODS)}")
    if method == "none":
        return None
    k = DEFAULT_NUM_SPEC_TOKENS[method] if num_speculative_tokens is None else int(num_speculative_tokens)
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens!r}")
    if method == "das":
        return {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": k}
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    if method == "suffix-bs":
        return {"method": "suffix", "num_speculative_tokens": k,
                "num_speculative_tokens_per_batch_size": [(lo, hi, min(k, kk)) for lo, hi, kk in BATCH_SIZE_SCHEDULE]}
    return {"method": "suffix", "num_speculative_tokens": k}


def make_llm(
    model: str,
    method: str = "das",
    *,
    num_speculative_tokens: int | None = None,
    das_config: dict[str, Any] | None = None,
    dtype: str | None = None,
    max_model_len: int = 2048,
    seed: int = 0,
    **llm_kwargs: Any,
):
    """Build a ``vllm.LLM`` for ``model`` with the given speculative ``method``.

    Args:
        model: local Hugging Face model directory.
        method: ``none`` | ``das`` | ``ngram`` | ``suffix``.
        num_speculative_tokens: K (see :func:`speculative_config`).
        das_config: DAS drafter settings (``additional_config['das']``), das only. Without a
            ``step_log`` key, the environment variable ``DAS_STEP_LOG`` (:data:`das.config.STEP_LOG_ENV`)
            gives the step log's path.
        dtype: model dtype; None decides it from the CPU (:func:`integrations.vllm_ext.cpu_runtime.decide`;
            ``bfloat16`` on CUDA); float32 for token-for-token greedy identity tests.
        max_model_len: tokens (prompt + output) per request.
        seed: engine seed.
        **llm_kwargs: passed to ``vllm.LLM`` (override the defaults here). ``worker_extension_cls``
            defaults to :class:`integrations.vllm_ext.worker_extension.DASWorkerExtension`, which the
            control verbs need; a class of your own must derive from it.

    Raises:
        ValueError: bad method or K; ``das_config`` given for another method.
        ImportError: ``suffix`` without arctic-inference installed.
    """
    spec = speculative_config(method, num_speculative_tokens)
    if das_config and method != "das":
        raise ValueError(f"das_config applies to method 'das' only, got method {method!r}")
    step_log = os.environ.get(STEP_LOG_ENV)
    if method == "das" and step_log and "step_log" not in (das_config or {}):
        das_config = {**(das_config or {}), "step_log": step_log}  # the entry point's override: the proposer reads no environment
    if method in ("suffix", "suffix-bs"):
        try:
            import arctic_inference  # noqa: F401
        except ImportError as exc:
            raise ImportError("method 'suffix' needs arctic-inference (see install.sh)") from exc
    parallel = int(llm_kwargs.get("tensor_parallel_size", 1) or 1) * int(llm_kwargs.get("pipeline_parallel_size", 1) or 1)
    chosen = cpu_runtime.apply_cpu_defaults(dtype, ranks=parallel)
    if dtype is None:
        dtype = chosen.dtype if chosen is not None else "bfloat16"
    from integrations.vllm_ext import patches as vllm_patches

    vllm_patches.apply()  # before LLM(): for an engine core in this process, and for a checkout without the plugin entry point
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=model,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        disable_log_stats=False,  # spec-decode counters come from the stats loggers
        enable_prefix_caching=True,
        # the driver's control verbs (integrations.vllm_ext.control) reach the workers by name through it
        worker_extension_cls=EXTENSION,
    )
    if cpu_runtime.is_cpu_build():
        kwargs["enforce_eager"] = True  # torch.compile costs tens of seconds at start on a CPU
    if spec is not None:
        kwargs["speculative_config"] = spec
    if das_config:
        kwargs["additional_config"] = {"das": dict(das_config)}
    kwargs.update(llm_kwargs)
    # The engine is not bound to a local of this frame: a frame kept alive below this one (an import
    # during ``vllm_patches.apply()`` can keep its frames, and a kept frame holds its callers through
    # ``f_back``) would otherwise keep the engine, and with it its engine core process, alive.
    return _count_spec_decoding(LLM(**kwargs))


def _count_spec_decoding(llm: Any) -> Any:
    """Keep this engine's own speculative-decoding counters (read by :func:`spec_counters`); returns ``llm``.

    vLLM's Prometheus metrics are process-wide, and a second engine in the same process
    unregisters the first one's collectors, so ``llm.get_metrics()`` cannot tell engines apart
    (das-rollout keeps one engine per method alive side by side). We add up the per-step
    ``SchedulerStats.spec_decoding_stats`` as the engine records them.
    """
    counts = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}
    manager = getattr(getattr(llm, "llm_engine", None), "logger_manager", None)
    if manager is None:
        return llm
    original = manager.record

    def record(*args: Any, **kwargs: Any):
        stats = kwargs.get("scheduler_stats", args[0] if args else None)
        spec = getattr(stats, "spec_decoding_stats", None)
        if spec is not None:
            counts["drafts"] += spec.num_drafts
            counts["draft_tokens"] += spec.num_draft_tokens
            counts["accepted_tokens"] += spec.num_accepted_tokens
        return original(*args, **kwargs)

    manager.record = record
    llm._das_spec_counts = counts
    return llm


def drop_unavailable(methods: list[str], prog: str) -> list[str]:
    """``methods`` without ``suffix``/``suffix-bs`` when arctic-inference is missing (said on stderr by ``prog``)."""
    if not {"suffix", "suffix-bs"} & set(methods):
        return methods
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except ImportError:
        import sys

        print(f"{prog}: arctic-inference is not installed; skipping methods 'suffix' and 'suffix-bs'", file=sys.stderr)
        return [m for m in methods if m not in ("suffix", "suffix-bs")]
    return methods


def close_llm(llm: Any) -> None:
    """Shut down the engine core of a ``vllm.LLM`` now, whatever else still references the engine.

    An engine core in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``) is shut down by a
    finalizer of vLLM's engine-core client, which runs only when the client is collected. A
    reference left anywhere (a traceback, a stats logger, a caller's local) keeps that process and
    its worker alive, and the interpreter's exit then waits on it. ``EngineCoreClient.shutdown``
    stops the engine core and its workers (or, in-process, the engine core itself) and detaches
    that finalizer; a second call does nothing. The engine is unusable afterwards: drop it and call
    :func:`release_engine_state` before the next engine starts.

    Args:
        llm: a ``vllm.LLM`` (from :func:`make_llm`); an object without ``llm_engine.engine_core`` is left alone.
    """
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    shutdown = getattr(core, "shutdown", None)
    if callable(shutdown):
        shutdown()


def release_engine_state() -> None:
    """Free dropped engines and vLLM's process-wide parallel state, so the next engine starts clean.

    Call it after :func:`close_llm` and deleting the last reference to the old ``LLM``: an engine collected only after
    the next one started shuts down that one's parallel groups ("pipeline model parallel group is
    not initialized" at its first step).
    """
    import gc

    gc.collect()
    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception:  # best effort: a fresh engine re-initialises what it needs
        pass


def spec_counters(llm: Any) -> dict[str, float]:
    """Cumulative speculative-decoding counters of an engine.

    Returns:
        ``{"drafts": verification steps that carried a draft, "draft_tokens": tokens proposed,
        "accepted_tokens": draft tokens accepted}``; zeros for ``none``.
    """
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    }
    own = getattr(llm, "_das_spec_counts", None)
    if own is not None:
        return dict(own)
    out = dict.fromkeys(names.values(), 0.0)
    for metric in llm.get_metrics():
        key = names.get(metric.name)
        if key is not None:
            out[key] += float(getattr(metric, "value", 0.0))
    return out
