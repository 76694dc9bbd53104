"""docs/configuration.md, generated from the :class:`das.config.DASConfig` schema.

``python -m integrations.config_doc > docs/configuration.md`` writes the page: one table row per setting
(key, type, default, range, what it does: the field's description in the schema), then one line
per default that has evidence behind it, linking to the figure in ``docs/benchmarks.md``.
``tests/test_config_doc.py`` fails when the committed page and the schema disagree, so a changed
field, default, range or description shows up as a stale page.
"""

from __future__ import annotations

import ast
import sys
import types
import typing
from typing import Any, Literal

import annotated_types as at

from das.config import DASConfig, expected
from scheduler.budgets import names as budget_names

BENCHMARKS = "benchmarks.md"

#: Why a default is what it is: one line per key, and the anchor of the figure in docs/benchmarks.md.
EVIDENCE: dict[str, tuple[str, str]] = {
    "window": ("the DAS paper found windows of 16-32 policy versions to balance acceptance and lookup cost", "evidence-for-the-defaults"),
    "decay": ("the paper asks for mild down-weighting without a formula; with 16 versions the oldest weighs 0.9^15 = 0.21",
              "evidence-for-the-defaults"),
    "keep_visits": ("replay with problems returning every 300 versions: acceptance length 2.055 without, 2.219 with 2 visits kept",
                    "evidence-for-the-defaults"),
    "max_depth": ("DSR-sub replay: depth 12 accepts as much as 24 with half the appending work", "evidence-for-the-defaults"),
    "min_token_prob": ("arctic-inference's value; on the replays it drafts fewer tokens per accepted one than arctic on most traces",
                       "replay-against-arctic-inference"),
    "prior": ("replay: continuations seen once were right 78% of the time, and 1 / (1 + 0.3) = 0.77", "evidence-for-the-defaults"),
    "chooser": ("DSR-sub replay: acceptance length 2.50 with `mix`, 2.27 with `walk`, 2.16 for arctic-inference",
                "evidence-for-the-defaults"),
    "global_rollouts": ("replay: live and 256 finished rollouts in the global tree raise acceptance by 1.6-3.5%",
                        "evidence-for-the-defaults"),
    "global_depth": ("replay: depth 4 accepts within 0.3% of 12, with 9-29% less memory and 7-15% less drafter time",
                     "evidence-for-the-defaults"),
    "draft_threads": ("an H200 host's 16-core CPU: 16 threads 0.92-1.08 ms per step at 256 rows against 1.09-1.21 ms on 8",
                      "step-cost"),
    "defer_global": ("on a CPU engine a background thread would take a core from the forward pass", "step-cost"),
    "budget": ("the rollout tables: `cost` wins the long tail and holds parity on a full batch on every CPU measured",
               "rollout-side-by-side"),
}


def type_name(annotation: Any) -> str:
    """``int``, ``float``, ``bool``, ``str``, with `` or null`` for an optional field."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return "str"
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    return getattr(annotation, "__name__", str(annotation))


def value_text(value: Any) -> str:
    """A value as YAML and ``additional_config`` write it: ``true``, ``null``, ``16``, ``mix``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def range_text(key: str) -> str:
    """The values ``key`` accepts: an interval from the schema's bounds, or the choices."""
    field = DASConfig.model_fields[key]
    if key == "budget":  # the names live in scheduler.budgets (das/ imports nothing from scheduler/)
        return ", ".join(f"`{n}`" for n in budget_names("proposer"))
    words = expected(key)
    if words.startswith("one of "):
        try:
            return ", ".join(f"`{c}`" for c in ast.literal_eval(words.removeprefix("one of ")))
        except (ValueError, SyntaxError):
            return words
    if type_name(field.annotation).startswith("bool"):
        return "true, false" + (", null" if "null" in type_name(field.annotation) else "")
    if type_name(field.annotation).startswith("str"):
        return "a file path" + (", or null" if "null" in type_name(field.annotation) else "")
    lo = hi = None
    for m in field.metadata:
        if isinstance(m, at.Ge):
            lo = f"[{m.ge:g}"
        elif isinstance(m, at.Gt):
            lo = f"({m.gt:g}"
        elif isinstance(m, at.Le):
            hi = f"{m.le:g}]"
        elif isinstance(m, at.Lt):
            hi = f"{m.lt:g})"
    text = f"{lo or '(-inf'}, {hi or 'inf)'}"
    return text + (", or null" if "null" in type_name(field.annotation) else "")


def cell(text: str) -> str:
    """``text`` fit for one markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


HEADER = """# Configuration

<!-- Generated by `python -m integrations.config_doc > docs/configuration.md` from `das.config.DASConfig`;
tests/test_config_doc.py fails when this page and the schema disagree. Edit the schema, not this page. -->

The DAS drafter and speculation-budget settings have one schema, `das.config.DASConfig`
(pydantic), where every default and range is written once. Every surface reads it:

- vLLM: `LLM(..., additional_config={"das": {"window": 16, "decay": 0.9}})`;
- `das-rollout`: `--window`, `--decay`, `--budget` (the others through the schema's defaults);
- recipe YAML of the GRPO loop and the framework overlays: the `speculative.das` section
  (see `recipes/README.md`);
- `das.DASDrafter(...)` keyword arguments (the drafter's settings only).

Settings are checked at engine start, and by the CLIs and recipes before any engine loads: an
unknown key or a bad value raises `ValueError` naming the key, the value and what was expected,
e.g. `additional_config['das']['window'] must be an int >= 1, got 0`.

The engine's K (vLLM's `num_speculative_tokens`, `das-rollout --num-spec-tokens`) is the most
draft tokens a row may verify in one step: 16 by default for das
(`integrations.vllm_ext.engine.DEFAULT_NUM_SPEC_TOKENS`). With a larger K, every row still drafts
at most 16 per step while the batch is full, and in the long tail (a step running at most 1/8 of
the recent peak rows) the `cost` and `makespan` budgets may give a row up to K where the step
price says they pay (`scheduler.planner`).
"""

#: ``SamplingParams(extra_args=...)`` keys the proposer reads: (key, type, what it does).
PER_REQUEST = (
    ("das_problem_id", "str", "the problem (prompt) the request answers: its rollouts share one suffix tree across policy "
                              "versions (default: a hash of the prompt's token ids)"),
    ("das_max_draft_tokens", "int >= 0", "the most draft tokens this request gets per step (default K; 0: no drafting); "
                                         "the budget may give fewer"),
    ("das_sample_key", "int in `[0, 2**63)`", "coupled sampling: the token at index `i` is the target distribution's "
                                              "inverse-CDF sample at a uniform fixed by (key, `i`), whatever the drafts"),
)

#: Environment variables: (name, what it does).
ENVIRONMENT = (
    ("DAS_CACHE_DIR", "where converted models, rollout traces and the CPU calibration are cached (default `~/.cache/das`)"),
    ("DAS_DATA_DIR", "the directory of the shared data files (`dsr_sub.parquet`, `math500.parquet`, `leetcode_train.json`; "
                     "default `../shared/data` from the repository root)"),
    ("DAS_STEP_LOG", "the step log's path when the engine is built by `make_llm` (`das-rollout`, the GRPO loop) and the "
                     "settings give no `step_log`"),
    ("DAS_IOMP", "`1` or `0`: preload Intel's OpenMP runtime or not, instead of deciding from the CPU"),
)


def render() -> str:
    """The page, as ``python -m integrations.config_doc`` prints it."""
    lines = [HEADER, "## Settings", "", "| key | type | default | range | what it does |", "|---|---|---|---|---|"]
    for key, field in DASConfig.model_fields.items():
        lines.append(f"| `{key}` | {type_name(field.annotation)} | `{value_text(field.default)}` | {range_text(key)} | "
                     f"{cell(field.description or '')} |")
    lines += ["", "## Why the defaults", "",
              "One line per default with evidence behind it; the figures, with their commands, are in "
              f"[{BENCHMARKS}]({BENCHMARKS}).", ""]
    for key, (line, anchor) in EVIDENCE.items():
        lines.append(f"- `{key}` = `{value_text(DASConfig.model_fields[key].default)}`: {line} "
                     f"([figure]({BENCHMARKS}#{anchor})).")
    lines += ["", "## Per request", "", "`SamplingParams(extra_args={...})`:", "", "| key | type | what it does |", "|---|---|---|"]
    lines += [f"| `{key}` | {kind} | {what} |" for key, kind, what in PER_REQUEST]
    lines += ["", "## Environment", "", "| variable | what it does |", "|---|---|"]
    lines += [f"| `{name}` | {what} |" for name, what in ENVIRONMENT]
    return "\n".join(lines) + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
