"""One schema for the DAS settings (das.config), one registry of budgets (scheduler.budgets), and the
CLIs refusing bad input before any engine loads (exit status 2, the bad key and value named).

das.config checks ``budget`` only as a non-empty string (das/ does not import scheduler/); the
budget's name is checked where the scheduler builds it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from das.config import DEFAULTS, DRAFTER_KEYS, das_config, drafter_settings, expected
from das.drafter import DASDrafter
from scheduler import budgets

REPO = Path(__file__).resolve().parents[1]


# ---- the schema


def test_drafter_defaults_come_from_the_schema():
    assert drafter_settings(None, {}) == DEFAULTS.drafter_kwargs()
    d = DASDrafter()
    for key in DRAFTER_KEYS:
        if key != "defer_global":  # None: resolved by where the engine runs (off here)
            assert getattr(d, key) == getattr(DEFAULTS, key), key
    assert DEFAULTS.defer_global is None and d.defer_global is False


def test_drafter_docstring_states_the_schema_defaults():
    """DASDrafter's docstring gives each default with its reason: it must agree with the schema."""
    doc = DASDrafter.__doc__
    for key in DRAFTER_KEYS:
        m = re.search(rf"^\s+{key}: .*?Default (True|False|None|[0-9.]*[0-9]|\"\w+\")", doc, re.M | re.S)
        assert m is not None, key
        want = getattr(DEFAULTS, key)
        if isinstance(want, str):
            assert m.group(1) == f'"{want}"', (key, m.group(1))
        elif want is None:
            assert m.group(1) == "None", (key, m.group(1))
        else:
            assert (m.group(1) == str(want)) if isinstance(want, bool) else type(want)(m.group(1)) == want, (key, m.group(1))


def test_schema_accepts_what_the_drafter_accepts():
    cfg = das_config({"window": 4, "decay": 1, "use_request_tree": False, "budget": "fixed", "c_base": 0.01, "c_tok": 0})
    DASDrafter(**cfg.drafter_kwargs())
    assert cfg.section(("window", "budget", "c_tok")) == {"window": 4, "budget": "fixed", "c_tok": 0.0}
    assert DEFAULTS.section() == {k: v for k, v in DEFAULTS.model_dump().items() if v is not None}


@pytest.mark.parametrize("section,message", [
    ({"window": 0}, "additional_config['das']['window'] must be an int >= 1, got 0"),
    ({"window": 2.5}, "['window'] must be an int >= 1, got 2.5"),
    ({"window": True}, "['window'] must be an int >= 1, got True"),
    ({"decay": 1.5}, "['decay'] must be a number in (0, 1], got 1.5"),
    ({"decay": "0.9"}, "['decay'] must be a number in (0, 1], got '0.9'"),
    ({"max_spec_factor": float("inf")}, "['max_spec_factor'] must be a finite number > 0, got inf"),
    ({"max_depth": 1}, "['max_depth'] must be an int in [2, 10000], got 1"),
    ({"use_request_tree": "yes"}, "['use_request_tree'] must be true or false, got 'yes'"),
    ({"c_base": -1, "c_tok": 0}, "['c_base'] must be null or a finite number > 0, got -1"),
    ({"c_base": 0.01}, "give both c_base and c_tok"),
    ({"budget": ""}, "['budget'] must be a budget name (a non-empty string), got ''"),
    ({"budget": "  "}, "['budget'] must be a budget name (a non-empty string), got '  '"),
    ({"budget": 7}, "['budget'] must be a budget name (a non-empty string), got 7"),
    ({"windw": 3}, "unknown key additional_config['das']['windw']"),
])
def test_bad_values_name_the_key_the_value_and_the_expectation(section, message):
    with pytest.raises(ValueError) as exc:
        das_config(section)
    assert message in str(exc.value)


@pytest.mark.parametrize("name", ["cost", "greedy", "unlimited", "class-eq9"])
def test_the_budget_is_a_name_the_scheduler_checks_not_the_schema(name):
    """das_config keeps any non-empty budget name as given: whether it names a budget (and which
    one a former name became) is scheduler.budgets' to say, when the proposer builds its budget."""
    assert das_config({"budget": name}).budget == name
    assert expected("budget") == "a budget name (a non-empty string)"


def test_das_imports_nothing_from_the_scheduler():
    """The drafter is the core: no module of das/ imports scheduler/ (or anything that does)."""
    for path in sorted((REPO / "das").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "scheduler" or n.startswith(("scheduler.", "integrations", "benchmarks")) for n in names), (path.name, names)


def test_not_a_mapping():
    with pytest.raises(ValueError, match="additional_config\\['das'\\] must be a mapping, got list"):
        das_config([1, 2])


def test_expected_states_the_schema_bounds_in_words():
    assert expected("window") == "an int >= 1"
    assert expected("decay") == "a number in (0, 1]"


# ---- the budget registry


def test_one_name_per_budget_everywhere():
    from benchmarks.sim_budget import BUDGETS as SIM
    from integrations.vllm_ext.proposer import BUDGETS

    assert BUDGETS == budgets.names("proposer") == ("none", "fixed", "cost", "makespan", "class", "eq7")
    assert budgets.names("grpo") == ("none", "fixed", "class")
    assert SIM == budgets.names("simulator") == ("none", "fixed", "cost", "makespan", "class-eq9", "class-roofline", "eq7")
    assert DEFAULTS.budget in BUDGETS
    assert all(b.summary and b.runs_in for b in budgets.BUDGETS.values())
    assert not set(budgets.RENAMED) & set(budgets.BUDGETS)
    for old, new in budgets.RENAMED.items():
        with pytest.raises(ValueError, match=f"'{old}' is now called '{new}'"):
            budgets.resolve(old)


def test_simulator_refuses_former_names():
    from benchmarks.sim_budget import make_sim_budget

    with pytest.raises(ValueError, match="'das-roofline' is now called 'class-roofline'"):
        make_sim_budget("das-roofline", None, 16, {})
    assert make_sim_budget("fixed", None, 16, {}).name == "fixed"


# ---- das-rollout: every bad input refused before any model or engine loads


def _rollout_error(capsys, argv: list[str]) -> str:
    from integrations.rollout import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "das-rollout: error:" in err and "Traceback" not in err
    return err


@pytest.mark.parametrize("argv,named", [
    (["--window", "0"], "--window must be an int >= 1, got 0"),
    (["--decay", "1.5"], "--decay must be a number in (0, 1], got 1.5"),
    (["--decay", "0"], "--decay must be a number in (0, 1], got 0.0"),
    (["--budget", ""], "--budget: unknown budget ''; expected one of ['none', 'fixed', 'cost', 'makespan', 'class', 'eq7']"),
    (["--compare", "none,das:unlimited"], "--compare das:unlimited: budget 'unlimited' is now called 'fixed'"),
    (["--compare", "das:class-eq9"], "--compare das:class-eq9: budget 'class-eq9' runs only in the simulator"),
    (["--num-spec-tokens", "0"], "--num-spec-tokens must be >= 1, got 0"),
    (["--prompts", "0"], "--prompts must be >= 1, got 0"),
    (["--data", "/nonexistent/nope.parquet"], "nope.parquet"),
    (["--data", "problems.csv"], "unknown data set 'problems.csv'"),
    (["--trace", "out/rollouts.json"], "--trace must be a .parquet path, got 'out/rollouts.json'"),
])
def test_das_rollout_bad_input_exits_2_naming_it(capsys, argv, named):
    assert named in _rollout_error(capsys, argv)


def test_das_rollout_defaults_and_help_come_from_the_schema(capsys):
    from integrations.rollout import parse_args

    args = parse_args([])
    assert (args.window, args.decay, args.budget) == (DEFAULTS.window, DEFAULTS.decay, DEFAULTS.budget)
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in budgets.names("proposer"))


def test_das_rollout_caps_prompts_at_the_problem_set_with_a_warning():
    from integrations.rollout import fit_to_problems, iteration_prompts, parse_args

    args = parse_args(["--prompts", "100000"])
    warning = fit_to_problems(args, 12)
    assert "--prompts 100000" in warning and "12 problems" in warning
    assert (args.prompts, args.pool) == (12, 12)
    assert all(len(s) == 12 for s in iteration_prompts(12, args))
    assert fit_to_problems(parse_args(["--prompts", "4"]), 12) is None


# ---- das-grpo: a bad recipe is a one-line error, exit 2, before any engine


@pytest.mark.parametrize("argv,named", [
    (["speculative.das.window=0"], "speculative.das.window must be an int >= 1, got 0"),
    (["speculative.das.decay=1.5"], "speculative.das.decay must be a number in (0, 1], got 1.5"),
    (["speculative.das.windw=4"], "unknown key speculative.das.windw"),
    (["rollout.sampels=4"], "unknown keys ['sampels']"),
    (["speculative.num_speculative_tokens=0"], "speculative.num_speculative_tokens must be null or an int >= 1, got 0"),
    (["steps=abc"], "steps must be an int >= 1, got 'abc'"),
    (["--recipe", "no_such_recipe"], "recipe not found: 'no_such_recipe'"),
    (["data=/nonexistent/nope.parquet"], "nope.parquet"),
])
def test_das_grpo_bad_recipe_exits_2_naming_it(capsys, argv, named):
    from integrations.rl.grpo import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "das-grpo: error:" in err and named in err and "Traceback" not in err
