"""Recipes: our GRPO loop's YAML, and DAS overlays for verl and NeMo-RL (checked without either).

Our loop: :func:`load_recipe` reads a YAML file (``recipes/grpo_dsr_sub.yaml`` and friends) into a
:class:`Recipe`: model, data, rollout, speculative decoding (DAS settings), length-aware scheduler,
reward, training and logging, all in one place, with unknown keys rejected by name. Overrides are
``section.key=value`` strings (values parsed as YAML), as on a Hydra command line.

verl (checked against verl ``main`` at 1dda039b, 0.10.0.dev): :func:`verl_overlay` fills
``actor_rollout_ref.rollout.engine_kwargs.vllm`` (``speculative_config`` and ``additional_config``,
which verl passes to ``vllm serve``; MTP rollout must stay off, since it rebuilds
``speculative_config``) and turns ``disable_log_stats`` off; :func:`verl_cli_overrides` writes it
as Hydra overrides (``+`` for new keys); :func:`verl_das_agent_loop` is verl's single-turn agent loop
plus ``SamplingParams.extra_args={"das_problem_id": ...}``.

NeMo-RL (checked against NVIDIA-NeMo/RL ``main`` at 7ea279ab): :func:`nemo_rl_overlay` fills
``policy.generation.vllm_kwargs`` (spread into ``vllm.LLM``) and the workers' ``PYTHONPATH``;
problems are keyed by a hash of the prompt tokens (NeMo-RL sets no ``extra_args``).

Both frameworks own the weight sync, so the overlays name
:class:`integrations.vllm_ext.weight_sync.SyncAwareDASProposer`, which advances the drafter window at
the first engine step after a weight load. How each key travels through the framework, the files
checked and the tested versions: ``recipes/README.md``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from das.config import DEFAULTS, SHOWN_KEYS, das_config
from scheduler import budgets
from scheduler.placement import ASSIGNMENTS

__all__ = [
    "RECIPES_DIR",
    "Recipe",
    "load_recipe",
    "apply_overrides",
    "das_speculative_config",
    "verl_overlay",
    "verl_cli_overrides",
    "verl_vllm_cli_args",
    "check_das_engine_kwargs",
    "nemo_rl_overlay",
    "das_request_fields",
    "verl_das_agent_loop",
    "load_yaml",
]

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
SYNC_AWARE_PROPOSER = "integrations.vllm_ext.weight_sync.SyncAwareDASProposer"
EXPLICIT_PROPOSER = "integrations.vllm_ext.proposer.DASProposer"


# ----------------------------------------------------------------------------------------------
# our loop's recipe


@dataclasses.dataclass
class RolloutSection:
    prompts_per_step: int = 4  # problems per GRPO step
    samples: int = 8  # GRPO group size (n)
    max_tokens: int = 256
    temperature: float = 0.6  # 0 = greedy
    top_p: float = 1.0
    dtype: str = "auto"  # vLLM engine dtype; auto: this machine's (integrations.vllm_ext.cpu_runtime; bfloat16 on CUDA)
    max_model_len: int = 1024
    coupled_sampling: bool = False  # key each rollout's sampling (integrations.vllm_ext.patches.coupled_sampling)
    engines: int = 1  # rollout engines; > 1: Ray workers bound to their own cores, one shared DAS history (integrations.rl.ray_rollout)
    placement: str = "lpt"  # engines > 1: GRPO groups to engines by scheduler.placement (lpt | round_robin | random)

    @property
    def engine_dtype(self) -> str | None:
        """The dtype to build the engine with: None for ``auto`` (the engine factory decides from the CPU)."""
        return None if self.dtype == "auto" else self.dtype


@dataclasses.dataclass
class SpeculativeSection:
    method: str = "das"  # none | das | ngram | suffix
    num_speculative_tokens: int | None = 16
    das: dict = dataclasses.field(default_factory=lambda: DEFAULTS.section(SHOWN_KEYS))  # keys of das.config.DASConfig


@dataclasses.dataclass
class SchedulerSection:
    budget: str | None = None  # null: no per-request caps | class: das_max_draft_tokens from the problem's length class (scheduler.budgets, grpo)
    long: int = 16
    medium: int = 4
    short: int = 0
    window: int = 16  # policy versions of length history


@dataclasses.dataclass
class RewardSection:
    format_weight: float = 0.1
    require_boxed: bool = True
    code_timeout_s: float = 6.0
    code_memory_mb: int = 1024
    network: str = "isolate"  # isolate (require: the same) | allow; code tasks only
    sandbox: str = "bwrap"  # bwrap (namespaces, unprivileged uid) | none (resource limits only; needs network: allow)
    workers: int = 2
    overlong_buffer: int = 0  # DAPO soft overlong punishment over the last this many tokens (0: off)
    overlong_penalty: float = 1.0  # penalty at max_tokens


@dataclasses.dataclass
class TrainSection:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    clip_low: float = 0.2  # PPO clip: ratio in [1 - clip_low, 1 + clip_high] (DAPO clip-higher)
    clip_high: float = 0.28
    kl_coef: float = 0.0  # > 0: k3 KL to the initial (reference) policy
    mini_batches: int = 2  # optimizer steps per GRPO step (the batch split in this many parts)
    epochs: int = 1
    micro_batch_tokens: int = 1024  # tokens per forward/backward pass (gradient accumulation; activation memory)
    max_grad_norm: float = 1.0
    advantage: str = "grpo"  # grpo: (r - group mean) / group std; batch: over the whole batch
    std_normalize: bool = True
    dtype: str = "float32"  # master weights
    autocast_bf16: bool = False  # bf16 autocast for forward/backward (faster on AVX-512 bf16 CPUs)
    skip_zero_advantage_groups: bool = True  # drop groups whose rewards are all equal (no signal)


@dataclasses.dataclass
class LogSection:
    json: str | None = None  # JSON-lines log, one record per step plus a summary
    trace: str | None = None  # rollout trace (.parquet, integrations.data.trace) of every step's rollouts, for benchmarks.replay
    overwrite: bool = False  # replace an existing log.json / log.trace (else the run refuses to start)
    progress: bool = True


@dataclasses.dataclass
class Recipe:
    """Everything the GRPO loop (:mod:`integrations.rl.grpo`) reads."""

    model: str | None = None  # None: SmolLM2-135M-Instruct; 'tiny'; a local HF dir
    data: str | None = "dsr_sub"  # integrations.data.problems.load_problems spec
    pool: int | None = 64  # problems drawn from (a seeded sample); None: all
    seed: int = 0
    steps: int = 10
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    speculative: SpeculativeSection = dataclasses.field(default_factory=SpeculativeSection)
    scheduler: SchedulerSection = dataclasses.field(default_factory=SchedulerSection)
    reward: RewardSection = dataclasses.field(default_factory=RewardSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    log: LogSection = dataclasses.field(default_factory=LogSection)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["train"]["betas"] = list(d["train"]["betas"])
        return d

    def validate(self) -> Recipe:
        """Check every value's type and range (and the cross-field rules); returns self.

        Raises:
            ValueError: ``"bad recipe: <section.key> must be ..., got <value>"`` for each bad value.
        """
        from integrations.vllm_ext.engine import METHODS

        bad = _check_fields(self)
        r, s = self.rollout, self.speculative
        if bad:  # the cross-field rules below assume well-typed values
            raise ValueError("bad recipe: " + "; ".join(bad))
        checks = [
            (self.pool is None or self.pool >= r.prompts_per_step, f"pool ({self.pool}) must be >= rollout.prompts_per_step ({r.prompts_per_step})"),
            (r.max_model_len > r.max_tokens,
             f"rollout.max_model_len ({r.max_model_len}) must exceed rollout.max_tokens ({r.max_tokens}): the prompt needs room too"),
            (s.method in METHODS, f"speculative.method must be one of {list(METHODS)}, got {s.method!r}"),
            (s.method == "none" or s.num_speculative_tokens is not None, f"speculative.num_speculative_tokens is needed for method {s.method!r}"),
            (self.scheduler.budget is None or s.method == "das", f"scheduler.budget {self.scheduler.budget!r} needs speculative.method 'das'"),
            (self.reward.overlong_buffer < r.max_tokens,
             f"reward.overlong_buffer ({self.reward.overlong_buffer}) must be < rollout.max_tokens ({r.max_tokens})"),
            (self.reward.sandbox != "none" or self.reward.network == "allow",
             "reward.sandbox 'none' cannot cut the network: set reward.network to 'allow' as well (trusted code only)"),
        ]
        bad = [msg for ok, msg in checks if not ok]
        if bad:
            raise ValueError("bad recipe: " + "; ".join(bad))
        if s.method == "das":
            try:  # the one schema of the DAS settings: unknown keys, types, ranges; the budget's name in the registry
                if isinstance(s.das, Mapping) and "budget" in s.das:
                    try:
                        budgets.resolve(s.das["budget"], "proposer")
                    except ValueError as exc:
                        raise ValueError(f"speculative.das.budget: {exc}") from None
                das_config(s.das, where="speculative.das", name=lambda k: f"speculative.das.{k}")
            except ValueError as exc:
                raise ValueError(f"bad recipe: {exc}") from None
        return self


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# (section, key) -> (check, what it must be). Every field of every section is listed (a test keeps it so).
_RULES: dict[tuple[str, str], tuple[Callable[[Any], bool], str]] = {
    ("", "model"): (lambda v: v is None or (isinstance(v, str) and v.strip() != ""), "null or a non-empty string"),
    ("", "data"): (lambda v: v is None or (isinstance(v, str) and v.strip() != ""), "null or a non-empty string"),
    ("", "pool"): (lambda v: v is None or (_is_int(v) and v >= 1), "null or an int >= 1"),
    ("", "seed"): (lambda v: _is_int(v) and v >= 0, "an int >= 0"),
    ("", "steps"): (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    ("rollout", "prompts_per_step"): (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    ("rollout", "samples"): (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    ("rollout", "max_tokens"): (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    ("rollout", "temperature"): (lambda v: _is_num(v) and v >= 0, "a number >= 0"),
    ("rollout", "top_p"): (lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
    ("rollout", "dtype"): (lambda v: v in ("bfloat16", "float16", "float32", "auto"), "one of bfloat16, float16, float32, auto"),
    ("rollout", "max_model_len"): (lambda v: _is_int(v) and v >= 2, "an int >= 2"),
    ("rollout", "coupled_sampling"): (lambda v: isinstance(v, bool), "true or false"),
    ("rollout", "engines"): (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    ("rollout", "placement"): (lambda v: v in ASSIGNMENTS, f"one of {list(ASSIGNMENTS)}"),
    ("speculative", "method"): (lambda v: isinstance(v, str), "a string"),
    ("speculative", "num_speculative_tokens"): (lambda v: v is None or (_is_int(v) and v >= 1), "null or an int >= 1"),
    ("speculative", "das"): (lambda v: isinstance(v, dict), "a mapping"),
    ("scheduler", "budget"): (lambda v: v is None or v in budgets.names("grpo"), f"null or one of {list(budgets.names('grpo'))}"),
    ("scheduler", "long"): (lambda v: _is_int(v) and v >= 0, "an int >= 0"),
    ("scheduler", "medium"): (lambda v: _is_int(v) and v >= 0, "an int >= 0"),
    ("scheduler", "short"): (lambda v: _is_int(v) and v >= 0, "an int >= 0"),
    ("scheduler", "window"): (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    ("reward", "format_weight"): (lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]"),
    ("reward", "require_boxed"): (lambda v: isinstance(v, bool), "true or false"),
    ("reward", "code_timeout_s"): (lambda v: _is_num(v) and 0 < v <= 3600, "a number of seconds in (0, 3600]"),
    ("reward", "code_memory_mb"): (lambda v: _is_int(v) and (v == 0 or v >= 64), "0 (no limit) or an int >= 64"),
    ("reward", "network"): (lambda v: v in ("isolate", "require", "allow"), "'isolate' ('require' is the same) or 'allow'"),
    ("reward", "sandbox"): (lambda v: v in ("bwrap", "none"), "'bwrap' or 'none'"),
    ("reward", "workers"): (lambda v: _is_int(v) and 1 <= v <= 256, "an int in [1, 256]"),
    ("reward", "overlong_buffer"): (lambda v: _is_int(v) and v >= 0, "an int >= 0"),
    ("reward", "overlong_penalty"): (lambda v: _is_num(v) and v >= 0, "a number >= 0"),
    ("train", "lr"): (lambda v: _is_num(v) and v > 0, "a number > 0"),
    ("train", "weight_decay"): (lambda v: _is_num(v) and v >= 0, "a number >= 0"),
    ("train", "betas"): (lambda v: isinstance(v, (tuple, list)) and len(v) == 2 and all(_is_num(b) and 0 <= b < 1 for b in v),
                         "two numbers in [0, 1)"),
    ("train", "clip_low"): (lambda v: _is_num(v) and 0 <= v < 1, "a number in [0, 1)"),
    ("train", "clip_high"): (lambda v: _is_num(v) and v >= 0, "a number >= 0"),
    ("train", "kl_coef"): (lambda v: _is_num(v) and v >= 0, "a number >= 0"),
    ("train", "mini_batches"): (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    ("train", "epochs"): (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    ("train", "micro_batch_tokens"): (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    ("train", "max_grad_norm"): (lambda v: _is_num(v) and v > 0, "a number > 0"),
    ("train", "advantage"): (lambda v: v in ("grpo", "batch"), "'grpo' or 'batch'"),
    ("train", "std_normalize"): (lambda v: isinstance(v, bool), "true or false"),
    ("train", "dtype"): (lambda v: v in ("float32", "bfloat16"), "'float32' or 'bfloat16'"),
    ("train", "autocast_bf16"): (lambda v: isinstance(v, bool), "true or false"),
    ("train", "skip_zero_advantage_groups"): (lambda v: isinstance(v, bool), "true or false"),
    ("log", "json"): (lambda v: v is None or (isinstance(v, str) and v.strip() != ""), "null or a path"),
    ("log", "trace"): (lambda v: v is None or (isinstance(v, str) and v.strip().lower().endswith(".parquet")), "null or a .parquet path"),
    ("log", "overwrite"): (lambda v: isinstance(v, bool), "true or false"),
    ("log", "progress"): (lambda v: isinstance(v, bool), "true or false"),
}


def _check_fields(rec: Recipe) -> list[str]:
    bad = []
    for (section, key), (ok, what) in _RULES.items():
        obj = rec if not section else getattr(rec, section)
        value = getattr(obj, key)
        try:
            good = bool(ok(value))
        except Exception:
            good = False
        if not good:
            bad.append(f"{section + '.' if section else ''}{key} must be {what}, got {value!r}")
    return bad


_SECTIONS = {f.name: f.type for f in dataclasses.fields(Recipe)}


# YAML 1.2's float (``1e-4`` included) and the characters such a scalar can start with
_FLOAT_1_2 = r"^[-+]?(?:[0-9][0-9_]*\.?[0-9_]*|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"
_FLOAT_FIRST = "-+0123456789."


@functools.cache
def _yaml_loader() -> Any:
    """PyYAML's safe loader, reading ``1e-4`` as a float as YAML 1.2 does (PyYAML follows YAML
    1.1, where a float needs a dot: ``1e-4`` would be the string ``'1e-4'``, and ``lr=1e-4``
    would fail as not a number)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    for first in _FLOAT_FIRST:
        Loader.yaml_implicit_resolvers[first] = [(tag, rx) for tag, rx in Loader.yaml_implicit_resolvers.get(first, [])
                                                 if tag != "tag:yaml.org,2002:float"]
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(_FLOAT_1_2), list(_FLOAT_FIRST))
    return Loader


def parse_yaml(text: Any) -> Any:
    """YAML text (a string or a file) to Python, with :func:`_yaml_loader`."""
    import yaml

    return yaml.load(text, Loader=_yaml_loader())


def load_yaml(path: str | Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return parse_yaml(f)


def _build(cls: type, data: Mapping[str, Any], where: str):
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in data:
        if (cls, k) in _RENAMED_KEYS:
            raise ValueError(f"{where}.{k}: {_RENAMED_KEYS[cls, k]}")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; expected some of {sorted(fields)}")
    kwargs = {}
    for k, v in data.items():
        sub = _SUB.get((cls, k))
        kwargs[k] = _build(sub, v or {}, f"{where}.{k}") if sub is not None else v
    obj = cls(**kwargs)
    if cls is TrainSection and isinstance(obj.betas, (list, tuple)):
        obj.betas = tuple(obj.betas)
    return obj


# Keys that were renamed: refused with what to write instead.
_RENAMED_KEYS = {(SchedulerSection, "policy"): "is now scheduler.budget (null for the old 'none': no per-request caps; 'class' as before)"}

_SUB = {(Recipe, "rollout"): RolloutSection, (Recipe, "speculative"): SpeculativeSection, (Recipe, "scheduler"): SchedulerSection,
        (Recipe, "reward"): RewardSection, (Recipe, "train"): TrainSection, (Recipe, "log"): LogSection}


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML, ``1e-4`` a float) to a nested dict, in place; returns it."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {p!r} is not a section")
        node[parts[-1]] = parse_yaml(raw) if raw.strip() else None
    return data


def load_recipe(source: str | Path | Mapping[str, Any] | None = None, overrides: Iterable[str] = ()) -> Recipe:
    """Read a loop recipe.

    Args:
        source: a YAML path, a dict, a name under ``recipes/`` without ``.yaml`` (e.g.
            ``"grpo_dsr_sub"``), or None for the defaults of :class:`Recipe`.
        overrides: ``section.key=value`` strings applied on top.

    Raises:
        ValueError: unknown keys (named), bad values.
        FileNotFoundError: no such file.
    """
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, Mapping):
        data = copy.deepcopy(dict(source))
    else:
        p = Path(source)
        if not p.exists() and (RECIPES_DIR / f"{source}.yaml").exists():
            p = RECIPES_DIR / f"{source}.yaml"
        if not p.is_file():
            raise FileNotFoundError(f"recipe not found: {str(source)!r}")
        data = load_yaml(p) or {}
    data = apply_overrides(data, overrides)
    return _build(Recipe, data, "recipe").validate()


# ----------------------------------------------------------------------------------------------
# engine settings shared by all recipes


def das_speculative_config(num_speculative_tokens: int = 16, *, sync_aware: bool = True) -> dict[str, Any]:
    """vLLM ``speculative_config`` for DAS; ``sync_aware`` picks the proposer that advances versions on weight loads."""
    return {"method": "custom_class", "model": SYNC_AWARE_PROPOSER if sync_aware else EXPLICIT_PROPOSER,
            "num_speculative_tokens": int(num_speculative_tokens)}


def check_das_engine_kwargs(engine_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Check the vLLM engine kwargs of a framework recipe: DAS proposer, importable class, valid ``das`` section.

    Returns the ``das`` section. Raises ``ValueError`` naming what is wrong.
    """
    import importlib.util

    spec = engine_kwargs.get("speculative_config")
    if isinstance(spec, str):
        spec = json.loads(spec)
    if not isinstance(spec, Mapping) or spec.get("method") != "custom_class":
        raise ValueError(f"speculative_config must be a mapping with method 'custom_class', got {spec!r}")
    path = str(spec.get("model", ""))
    if path not in (SYNC_AWARE_PROPOSER, EXPLICIT_PROPOSER):
        raise ValueError(f"speculative_config.model must be {SYNC_AWARE_PROPOSER!r} or {EXPLICIT_PROPOSER!r}, got {path!r}")
    # find the module without importing it: importing the proposer imports vLLM (seconds), and the
    # class name is one of the two checked above
    mod = path.rpartition(".")[0]
    if importlib.util.find_spec(mod) is None:
        raise ValueError(f"{path} is not importable")
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"speculative_config.num_speculative_tokens must be an int >= 1, got {k!r}")
    extra = engine_kwargs.get("additional_config") or {}
    if isinstance(extra, str):
        extra = json.loads(extra)
    if not isinstance(extra, Mapping):
        raise ValueError(f"additional_config must be a mapping, got {type(extra).__name__}: {extra!r}")
    das_config(extra.get("das", {}))
    return dict(extra.get("das", {}))


# ----------------------------------------------------------------------------------------------
# verl


def verl_overlay(das: Mapping[str, Any] | None = None, num_speculative_tokens: int = 16, *, agent_loop: bool = True,
                 agent_loop_config_path: str = "recipes/verl/das_agent_loops.yaml") -> dict[str, Any]:
    """The verl config keys that turn DAS on (a nested dict under ``actor_rollout_ref``)."""
    rollout: dict[str, Any] = {
        "name": "vllm",
        "disable_log_stats": False,
        "engine_kwargs": {"vllm": {"speculative_config": das_speculative_config(num_speculative_tokens),
                                   "additional_config": {"das": dict(das or DEFAULTS.section(SHOWN_KEYS))}}},
    }
    if agent_loop:
        rollout["agent"] = {"default_agent_loop": "das_single_turn_agent", "agent_loop_config_path": agent_loop_config_path}
    return {"actor_rollout_ref": {"rollout": rollout}}


def _flatten(d: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping) and v:
            out += _flatten(v, key)
        else:
            out.append((key, v))
    return out


def verl_cli_overrides(overlay: Mapping[str, Any]) -> list[str]:
    """Hydra command-line overrides for ``python -m verl.trainer.main_ppo`` from an overlay.

    Keys under ``engine_kwargs.vllm`` are new keys of an empty dict in verl's config, so they get
    Hydra's ``+`` prefix (verl's own examples do the same); the others exist and are set plainly.
    """
    out = []
    for key, v in _flatten(overlay):
        val = json.dumps(v) if isinstance(v, (Mapping, list)) else ("true" if v is True else "false" if v is False else "null" if v is None else str(v))
        plus = "+" if ".engine_kwargs.vllm." in f".{key}" else ""
        out.append(f"{plus}{key}={val}")
    return out


def verl_vllm_cli_args(engine_kwargs: Mapping[str, Any]) -> list[str]:
    """What verl's ``build_cli_args_from_config`` makes of ``engine_kwargs.vllm`` (same rules, re-implemented).

    None skipped; True a bare ``--key``; False skipped; a list expanded; a dict JSON-encoded.
    """
    args: list[str] = []
    for k, v in engine_kwargs.items():
        if v is None or v is False:
            continue
        if v is True:
            args.append(f"--{k}")
        elif isinstance(v, list):
            if v:
                args += [f"--{k}", *[str(x) for x in v]]
        else:
            args += [f"--{k}", json.dumps(v) if isinstance(v, dict) else str(v)]
    return args


# ----------------------------------------------------------------------------------------------
# NeMo-RL


def nemo_rl_overlay(das: Mapping[str, Any] | None = None, num_speculative_tokens: int = 16, *, pythonpath: str | None = None) -> dict[str, Any]:
    """The NeMo-RL config keys that turn DAS on (nested under ``policy.generation``)."""
    gen: dict[str, Any] = {"vllm_kwargs": {"speculative_config": das_speculative_config(num_speculative_tokens),
                                           "additional_config": {"das": dict(das or DEFAULTS.section(SHOWN_KEYS))}}}
    if pythonpath:
        gen["vllm_cfg"] = {"env_vars": {"PYTHONPATH": pythonpath}}
    return {"policy": {"generation": gen}}


# ----------------------------------------------------------------------------------------------
# per-request fields (verl agent loop)


def das_request_fields(sample: Mapping[str, Any], max_draft_tokens: int | None = None) -> dict[str, Any]:
    """``SamplingParams.extra_args`` for one rollout from a verl dataset row's fields.

    The problem id is ``"<data_source>/<index>"`` with ``index`` from the row's ``index`` or
    ``extra_info['index']``; else the GRPO group ``uid``; else none (the proposer then hashes the
    prompt). Never raises on odd rows.
    """
    extra = sample.get("extra_info")
    index = sample.get("index")
    if index is None and isinstance(extra, Mapping):
        index = extra.get("index")
    out: dict[str, Any] = {}
    if index is not None:
        src = sample.get("data_source")
        out["das_problem_id"] = f"{src}/{index}" if src is not None else str(index)
    elif sample.get("uid") is not None:
        out["das_problem_id"] = str(sample["uid"])
    if max_draft_tokens is not None:
        out["das_max_draft_tokens"] = int(max_draft_tokens)
    return out


_VERL_LOOP: type | None = None


def verl_das_agent_loop(**kwargs: Any):
    """Hydra ``_target_`` for verl's agent-loop registry: a ``SingleTurnAgentLoop`` that tags requests for DAS.

    Listed in ``recipes/verl/das_agent_loops.yaml`` as ``das_single_turn_agent``. verl is imported
    here, on first use inside verl's agent-loop worker, never at module import.
    """
    global _VERL_LOOP
    if _VERL_LOOP is None:
        from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

        class DASSingleTurnAgentLoop(SingleTurnAgentLoop):
            async def run(self, sampling_params: dict[str, Any], **kw: Any):
                return await super().run(with_das_fields(sampling_params, kw), **kw)

        _VERL_LOOP = DASSingleTurnAgentLoop
    return _VERL_LOOP(**kwargs)


def with_das_fields(sampling_params: Mapping[str, Any], sample: Mapping[str, Any], max_draft_tokens: int | None = None) -> dict[str, Any]:
    """A copy of ``sampling_params`` whose ``extra_args`` carry :func:`das_request_fields` (existing keys kept)."""
    sp = dict(sampling_params)
    fields = das_request_fields(sample, max_draft_tokens)
    if fields:
        sp["extra_args"] = {**dict(sp.get("extra_args") or {}), **fields}
    return sp
