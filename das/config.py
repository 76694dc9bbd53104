"""DASConfig: the one schema of the DAS settings (drafter and speculation budget), defaults written once.

Every surface reads it: vLLM's ``additional_config['das']`` (:func:`integrations.vllm_ext.proposer.das_section`),
the ``das-rollout`` flags (defaults and help text, :mod:`integrations.rollout`), recipe YAML
(``speculative.das``, :mod:`integrations.rl.recipes`) and the constructor defaults of
:class:`das.drafter.DASDrafter`. :func:`das_config` validates a section before any engine loads
and turns pydantic's errors into a ``ValueError`` that names the key, the value and what was
expected, e.g. ``additional_config['das']['window'] must be an int >= 1, got 0``.

Keys (see each field's description): drafter ``window``, ``decay``, ``keep_visits``, ``age_in_visits``, ``max_depth``,
``max_spec_factor``, ``min_token_prob``, ``max_problems``, ``use_request_tree``, ``prior``, ``chooser``,
``global_rollouts``, ``global_depth``, ``mix_lr``, ``draft_threads``, ``defer_global``;
budget ``budget`` (the name of a speculation budget, checked here only as a non-empty string:
:mod:`scheduler` resolves it, and refuses an unknown one, when the proposer builds its budget; the
drafter does not depend on the scheduler), ``c_base`` and ``c_tok`` (seconds, both or neither);
proposer ``step_log`` (a file path: the step log, one JSON line per clean decode step).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

import annotated_types as at
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = ["CHOOSERS", "DASConfig", "DEFAULTS", "DRAFTER_KEYS", "BUDGET_KEYS", "SHOWN_KEYS", "STEP_LOG_ENV", "das_config", "drafter_settings", "expected"]


class DASConfig(BaseModel):
    """DAS drafter and speculation-budget settings (strict types: no strings for numbers, no bools for ints)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    window: int = Field(16, ge=1, description="policy versions of rollouts kept per problem (the paper found windows of 16-32 "
                                              "iterations best; the smaller bounds memory and lookup cost)")
    decay: float = Field(0.9, gt=0, le=1, description="weight of a rollout one policy version older relative to the newest "
                                                      "(1: no down-weighting; 0.9 with window 16 weighs the oldest kept version ~0.2)")
    keep_visits: int = Field(2, ge=0, description="also keep the rollouts of a problem's own last keep_visits visits (policy versions "
                             "in which it got rollouts), however old, so a problem that returns once per epoch drafts from its last "
                             "visit (0: the window only; memory stays capped by max_problems)")
    age_in_visits: bool = Field(True, description="decay counts a problem's own visits instead of policy versions, so rollouts kept "
                                "across a long gap weigh decay ** (visits behind) rather than ~0 (same as versions when every "
                                "problem comes back every version)")
    max_depth: int = Field(12, ge=2, le=10_000, description="suffix tree depth (longest stored string; vLLM's suffix method: 24); "
                                                          "12 accepts as much as 24 on the DSR-sub replay at half the appending work")
    max_spec_factor: float = Field(2.0, gt=0, description="a draft anchored on an m-token match has at most floor(m * max_spec_factor) tokens")
    min_token_prob: float = Field(0.1, ge=0, le=1, description="drafts stop before the path probability falls below this")
    max_problems: int = Field(4096, ge=1, description="problem trees kept; beyond it the least recently used idle problem is evicted")
    use_request_tree: bool = Field(True, description="also draft from a per-request tree of the prompt and the request's own output")
    prior: float = Field(0.3, ge=0, description="added to the denominator of every draft-token probability, in units of one "
                                                "current-version rollout: a continuation seen once gets 1 / (1 + prior)")
    chooser: Literal["mix", "walk"] = Field("mix", description="how drafts are chosen: mix (every context of every scope, mixed by "
                                            "online logistic weights learned from accept/reject outcomes) or walk (the best single "
                                            "anchor's greedy walk, the paper's rule)")
    global_rollouts: int = Field(256, ge=0, description="finished rollouts of every problem kept in one global tree beside "
                                 "the live ones, the mix chooser's third scope (0: none)")
    global_depth: int = Field(4, ge=2, le=10_000, description="suffix tree depth of the global tree (at most max_depth): what "
                              "the rollouts of every problem share lies in contexts of 1-3 tokens; 4 accepts as much as 12 on the "
                              "replays with 9-29% less memory per stored token and 7-15% less drafter CPU per step")
    mix_lr: float = Field(0.1, gt=0, description="AdaGrad step size of the mix chooser's online logistic regression")
    draft_threads: int = Field(0, ge=0, description="threads that append and draft a step's rows at once (steps of 16 rows or "
                               "more, as vLLM's n-gram proposer); 0: this machine's physical cores per GPU, at most 16, or "
                               "without a GPU at most 8 (das.host.default_draft_threads)")
    defer_global: bool | None = Field(None, description="leave a step's appends to the global tree (and its stopped requests' removals "
                                      "there) to a background thread that "
                                      "runs while the accelerator verifies (the step's drafts read that tree one step behind); "
                                      "None: on where the engine runs on a GPU, off on a CPU engine (the thread would take a core "
                                      "from the forward pass)")
    budget: str = Field("cost", description="speculation budget: the per-step draft rule the vLLM proposer runs, by its "
                                            "name in scheduler.budgets (checked there when the proposer builds it)")
    c_base: float | None = Field(None, gt=0, description="fixed step cost in seconds (with c_tok): used instead of the online fit")
    c_tok: float | None = Field(None, ge=0, description="step cost per token in seconds (with c_base): used instead of the online fit")
    step_log: str | None = Field(None, min_length=1, description="a JSON-lines file the vLLM proposer appends one line per clean decode "
                                                                 "step to (rows, draft tokens, accepted tokens, seconds, the fitted step "
                                                                 "prices); integrations.vllm_ext.engine.make_llm also takes it from "
                                                                 "DAS_STEP_LOG")

    @field_validator("budget")
    @classmethod
    def _budget_name(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("a budget name must not be blank")
        return v

    @model_validator(mode="after")
    def _costs_together(self) -> DASConfig:
        if (self.c_base is None) != (self.c_tok is None):
            raise ValueError(f"give both c_base and c_tok (seconds) or neither, got c_base={self.c_base!r}, c_tok={self.c_tok!r}")
        return self

    def drafter_kwargs(self) -> dict[str, Any]:
        """The :class:`das.drafter.DASDrafter` arguments."""
        return {k: getattr(self, k) for k in DRAFTER_KEYS}

    def section(self, keys: Collection[str] | None = None) -> dict[str, Any]:
        """An ``additional_config['das']`` dict of these settings (``keys`` only, if given; unset costs left out)."""
        return {k: v for k, v in self.model_dump().items() if (keys is None or k in keys) and v is not None}


DRAFTER_KEYS = ("window", "decay", "keep_visits", "age_in_visits", "max_depth", "max_spec_factor", "min_token_prob", "max_problems",
                "use_request_tree", "prior", "chooser", "global_rollouts", "global_depth", "mix_lr", "draft_threads", "defer_global")
CHOOSERS = ("mix", "walk")
BUDGET_KEYS = ("budget", "c_base", "c_tok")
STEP_LOG_ENV = "DAS_STEP_LOG"  # the step log's path, read only where the engine is built (integrations.vllm_ext.engine)
SHOWN_KEYS = ("window", "decay", "budget")  # the keys the shipped recipes and overlays spell out
DEFAULTS = DASConfig()


def drafter_settings(config: DASConfig | Mapping[str, Any] | None, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`das.drafter.DASDrafter` settings: ``config``'s drafter keys (a :class:`DASConfig`, a mapping of
    drafter keys, or None: the defaults), then ``overrides``; every one of :data:`DRAFTER_KEYS`, not yet range-checked.

    Raises:
        ValueError: ``config`` of another type, or a key that is not a drafter setting (the message names it).
    """
    if config is None:
        given: dict[str, Any] = {}
    elif isinstance(config, DASConfig):
        given = config.drafter_kwargs()
    elif isinstance(config, Mapping):
        given = dict(config)
    else:
        raise ValueError(f"DASDrafter settings must be a DASConfig, a mapping or None, got {type(config).__name__}: {config!r}")
    given.update(overrides)
    unknown = sorted(str(k) for k in given if k not in DRAFTER_KEYS)
    if unknown:
        raise ValueError(f"unknown DASDrafter setting(s) {unknown}; expected some of {list(DRAFTER_KEYS)}")
    return {k: given.get(k, getattr(DEFAULTS, k)) for k in DRAFTER_KEYS}


def expected(key: str) -> str:
    """What ``key`` must be, in words, from the schema (e.g. ``"an int >= 1"``, ``"a number in (0, 1]"``)."""
    f = DASConfig.model_fields[key]
    if key == "budget":
        return "a budget name (a non-empty string)"
    if key == "chooser":
        return f"one of {list(CHOOSERS)}"
    if key == "step_log":
        return "null or a file path (a non-empty string)"
    ann = f.annotation
    optional = ann is not None and type(None) in getattr(ann, "__args__", ())
    base = int if ann is int or (optional and int in ann.__args__) else bool if ann is bool else float
    if base is bool:
        return "true or false"
    lo = hi = None
    for m in f.metadata:
        if isinstance(m, (at.Ge, at.Gt)):
            lo = ("[" if isinstance(m, at.Ge) else "(", getattr(m, "ge", getattr(m, "gt", None)))
        elif isinstance(m, (at.Le, at.Lt)):
            hi = ("]" if isinstance(m, at.Le) else ")", getattr(m, "le", getattr(m, "lt", None)))
    what = "an int" if base is int else "a number" if hi is not None else "a finite number"
    if lo and hi:
        what += f" in {lo[0]}{lo[1]:g}, {hi[1]:g}{hi[0]}"
    elif lo:
        what += f" {'>=' if lo[0] == '[' else '>'} {lo[1]:g}"
    elif hi:
        what += f" {'<=' if hi[0] == ']' else '<'} {hi[1]:g}"
    return f"null or {what}" if optional else what


def das_config(section: Mapping[str, Any] | None, where: str = "additional_config['das']",
               name: Callable[[str], str] | None = None) -> DASConfig:
    """Validate a ``das`` settings mapping (missing keys take the defaults).

    Args:
        section: the settings (None: all defaults).
        where: how the mapping is called in messages.
        name: how a key is called in messages (default ``f"{where}[{key!r}]"``; a CLI passes its flags).

    Raises:
        ValueError: one line per bad key, naming the key, the value and what was expected.
    """
    name = name or (lambda k: f"{where}[{k!r}]")
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ValueError(f"{where} must be a mapping, got {type(section).__name__}: {section!r}")
    try:
        return DASConfig.model_validate(dict(section))
    except ValidationError as exc:
        raise ValueError(explain(exc, where, name)) from None


def explain(exc: ValidationError, where: str, name: Callable[[str], str]) -> str:
    """One ``; ``-joined line for pydantic's errors: ``<key> must be <expected>, got <value>``."""
    out = []
    for e in exc.errors(include_url=False):
        key = str(e["loc"][0]) if e["loc"] else None
        if e["type"] == "extra_forbidden":
            out.append(f"unknown key {name(key)}; expected some of {sorted(DASConfig.model_fields)}")
        elif key is None:  # a rule over several keys
            out.append(f"{where}: {e['msg'].removeprefix('Value error, ')}")
        else:
            out.append(f"{name(key)} must be {expected(key)}, got {e['input']!r}")
    return "; ".join(out)
