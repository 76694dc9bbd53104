"""The speculation budgets: one registry, one name per policy, one line each, and where it runs.

A budget decides how many draft tokens each running request may verify per engine step. The
same policy has the same name in the vLLM proposer (``additional_config['das']['budget']``,
:mod:`integrations.vllm_ext.proposer`), :class:`scheduler.speculation.SpeculationScheduler` and
:func:`scheduler.speculation.static_budgets`, the ``das-rollout`` flags (``--budget``,
``--compare das:<budget>``), the recipes (``speculative.das.budget``) and the long-tail simulator
(``benchmarks/simulate.py --policies``). Where each one runs is :attr:`Budget.runs_in`:

* ``proposer``: inside vLLM, per engine step (:class:`integrations.vllm_ext.proposer.DASProposer`);
* ``scheduler``: :class:`~scheduler.speculation.SpeculationScheduler` (and ``static_budgets``);
* ``simulator``: :mod:`benchmarks._sim_policy` (simulated GPUs, no vLLM).

Old names are refused with an error that gives the new one (:data:`RENAMED`), never mapped
silently, so one policy never shows up under two names in results.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Budget", "BUDGETS", "RENAMED", "names", "resolve", "describe"]


@dataclass(frozen=True)
class Budget:
    """One speculation policy: its name, what it does in one line, and where it runs."""

    name: str
    summary: str
    runs_in: frozenset[str]


def _b(name: str, summary: str, *runs_in: str) -> Budget:
    return Budget(name, summary, frozenset(runs_in))


BUDGETS: dict[str, Budget] = {b.name: b for b in (
    _b("none", "no draft tokens (in the proposer: vLLM's speculative path and the drafter's inserts, drafting nothing: "
               "their per-step cost on their own, against the method none)", "proposer", "scheduler", "simulator"),
    _b("fixed", "up to K draft tokens per row whenever the drafter finds a match (the paper's 'unlimited draft budget')",
       "proposer", "scheduler", "simulator"),
    _b("cost", "keep the draft tokens whose calibrated path probability pays for their verification under the step-cost model "
               "fitted online (scheduler.step_policy, scheduler.regime_cost)", "proposer"),
    _b("makespan", "'cost', with each row's accepted token valued at what it saves a draining batch: c_row plus c_base times "
                   "the odds that its request finishes last, from the length predictor (scheduler.makespan)", "proposer"),
    _b("class", "DAS length classes from the length predictor: Long 16, Medium 4, Short 0 draft tokens, capped at K",
       "proposer", "scheduler"),
    _b("class-eq9", "DAS's deployed class policy as published: class budgets from Eq. 7 / Eq. 9 at each class's mean, "
                    "a quota of 160 draft tokens per step spent Long first, no drafts above 64 running requests", "simulator"),
    _b("class-roofline", "up to K per row, at most the step's roofline-knee draft tokens per step, spent in class order "
                         "(Long, Medium, Short; then by predicted remaining length); ours", "simulator"),
    _b("eq7", "DAS Eq. 7 / Eq. 9 per request: predicted remaining length, per-request acceptance estimates and the online cost model",
       "proposer", "scheduler", "simulator"),
)}

# Former names: refused with an error that names the new one.
RENAMED: dict[str, str] = {"unlimited": "fixed", "das": "class-eq9", "das-roofline": "class-roofline"}


def names(runs_in: str | None = None) -> tuple[str, ...]:
    """Budget names in registry order, those that run in ``runs_in`` (``proposer``, ``scheduler``, ``simulator``) or all."""
    return tuple(n for n, b in BUDGETS.items() if runs_in is None or runs_in in b.runs_in)


def resolve(name: object, runs_in: str | None = None) -> str:
    """``name`` checked against the registry (and, with ``runs_in``, against where it must run).

    Raises:
        ValueError: an unknown name, a former name (the message gives the new one), or a budget that
            does not run in ``runs_in``; the message lists the valid names.
    """
    valid = names(runs_in)
    where = f" ({runs_in})" if runs_in else ""
    if not isinstance(name, str):
        raise ValueError(f"a budget name must be a string, one of {list(valid)}, got {name!r}")
    if name in RENAMED:
        raise ValueError(f"budget {name!r} is now called {RENAMED[name]!r}")
    if name not in valid:
        if name in BUDGETS:
            runs = sorted(BUDGETS[name].runs_in)
            raise ValueError(f"budget {name!r} runs only in the {' and '.join(runs)}; expected one of {list(valid)}{where}")
        raise ValueError(f"unknown budget {name!r}; expected one of {list(valid)}{where}")
    return name


def describe(runs_in: str | None = None) -> str:
    """One line per budget, ``name: summary`` (for help texts)."""
    return "; ".join(f"'{n}': {BUDGETS[n].summary}" for n in names(runs_in))
