"""Recipes: our loop's YAML, and the verl / NeMo-RL overlays, checked without either framework installed."""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
import types

import pytest

from integrations.rl.recipes import (
    RECIPES_DIR,
    Recipe,
    check_das_engine_kwargs,
    das_request_fields,
    load_recipe,
    load_yaml,
    nemo_rl_overlay,
    verl_cli_overrides,
    verl_overlay,
    verl_vllm_cli_args,
    with_das_fields,
)

# ---- our loop


@pytest.mark.parametrize("name", ["grpo_dsr_sub", "grpo_leetcode"])
def test_shipped_loop_recipes_load(name):
    r = load_recipe(name)
    assert isinstance(r, Recipe) and r.speculative.method == "das"
    assert r.data in ("dsr_sub", "leetcode")
    assert load_recipe(RECIPES_DIR / f"{name}.yaml").to_dict() == r.to_dict()


@pytest.mark.parametrize("name", ["grpo_dsr_sub", "grpo_leetcode"])
def test_shipped_loop_recipes_show_the_tail_on_recurring_problems(name):
    # issue 50: 5 steps or more, rollouts up to 1024 tokens, problems revisited, this machine's engine
    # dtype, and coupled sampling (the same rollouts with and without speculation)
    r = load_recipe(name)
    assert r.steps >= 5 and r.rollout.max_tokens >= 1024 and r.rollout.max_model_len >= r.rollout.max_tokens + 512
    assert r.pool is not None and r.steps * r.rollout.prompts_per_step >= 2 * r.pool  # every problem drawn twice on average
    assert r.rollout.dtype == "auto" and r.rollout.engine_dtype is None and r.rollout.coupled_sampling


def test_engine_dtype_is_auto_by_default_and_the_users_value_wins():
    assert Recipe().rollout.dtype == "auto" and Recipe().rollout.engine_dtype is None
    for d in ("float32", "bfloat16", "float16"):
        r = load_recipe("grpo_dsr_sub", [f"rollout.dtype={d}"])
        assert r.rollout.dtype == r.rollout.engine_dtype == d


def test_recipe_overrides_and_errors():
    r = load_recipe("grpo_dsr_sub", ["steps=3", "rollout.samples=4", "speculative.das.window=8", "train.betas=[0.9, 0.95]", "log.json=null"])
    assert (r.steps, r.rollout.samples, r.speculative.das["window"], r.train.betas, r.log.json) == (3, 4, 8, (0.9, 0.95), None)
    with pytest.raises(ValueError, match="unknown keys \\['sampels'\\]"):
        load_recipe({"rollout": {"sampels": 4}})
    with pytest.raises(ValueError, match="speculative.method"):
        load_recipe(None, ["speculative.method=eagle"])
    with pytest.raises(ValueError, match="windw"):
        load_recipe(None, ["speculative.das.windw=3"])
    with pytest.raises(ValueError, match="needs speculative.method 'das'"):
        load_recipe(None, ["scheduler.budget=class", "speculative.method=ngram"])
    with pytest.raises(ValueError, match=r"recipe\.scheduler\.policy: is now scheduler\.budget \(null for the old 'none'"):
        load_recipe(None, ["scheduler.policy=class"])
    with pytest.raises(ValueError, match=r"scheduler\.budget must be null or one of \['none', 'fixed', 'class'\], got 'cost'"):
        load_recipe(None, ["scheduler.budget=cost"])
    assert load_recipe(None, ["scheduler.budget=class"]).scheduler.budget == "class"
    with pytest.raises(ValueError, match="not key=value"):
        load_recipe(None, ["steps"])
    with pytest.raises(FileNotFoundError):
        load_recipe("no_such_recipe")
    assert load_recipe(None).speculative.das == {"window": 16, "decay": 0.9, "budget": "cost"}  # das.config.DEFAULTS, SHOWN_KEYS


@pytest.mark.parametrize("override,match", [
    ("reward.code_timeout_s=0", r"reward\.code_timeout_s must be a number of seconds in \(0, 3600\], got 0"),
    ("reward.code_timeout_s=abc", r"reward\.code_timeout_s"),
    ("speculative.das.window=-1", r"speculative\.das\.window must be an int >= 1, got -1"),
    ("speculative.das.decay=2", r"speculative\.das\.decay must be a number in \(0, 1\], got 2"),
    ("speculative.das.budget=7", r"speculative\.das\.budget: a budget name must be a string, one of \['none', .*\], got 7"),
    ("speculative.das.c_base=0.01", r"speculative\.das: give both c_base and c_tok"),
    ("scheduler.window=-1", r"scheduler\.window must be an int >= 1"),
    ("rollout.samples=2.5", r"rollout\.samples must be an int >= 1, got 2\.5"),
    ("steps=abc", r"steps must be an int >= 1, got 'abc'"),
    ("rollout.top_p=0", r"rollout\.top_p"),
    ("rollout.dtype=fp8", r"rollout\.dtype"),
    ("rollout.coupled_sampling=maybe", r"rollout\.coupled_sampling must be true or false, got 'maybe'"),
    ("rollout.max_model_len=100", r"max_model_len \(100\) must exceed rollout\.max_tokens"),
    ("reward.workers=0", r"reward\.workers"),
    ("reward.require_boxed=maybe", r"reward\.require_boxed must be true or false"),
    ("reward.network=open", r"reward\.network"),
    ("reward.sandbox=none", r"set reward\.network to 'allow'"),
    ("reward.overlong_buffer=2000", r"overlong_buffer \(2000\) must be < rollout\.max_tokens"),
    ("train.betas=[2, 3]", r"train\.betas must be two numbers"),
    ("train.lr=0", r"train\.lr"),
    ("log.json=5", r"log\.json must be null or a path"),
    ("pool=0", r"pool must be null or an int >= 1"),
])
def test_recipe_values_are_type_and_range_checked(override, match):
    with pytest.raises(ValueError, match=match):
        load_recipe("grpo_dsr_sub", [override])


def test_every_recipe_field_has_a_rule():
    import dataclasses

    from integrations.rl import recipes

    listed = set(recipes._RULES)
    for f in dataclasses.fields(Recipe):
        sub = recipes._SUB.get((Recipe, f.name))
        if sub is None:
            assert ("", f.name) in listed, f.name
        else:
            for g in dataclasses.fields(sub):
                assert (f.name, g.name) in listed, f"{f.name}.{g.name}"
    assert load_recipe(None, ["reward.sandbox=none", "reward.network=allow"]).reward.sandbox == "none"


# ---- verl


def _verl_engine_kwargs():
    cfg = load_yaml(RECIPES_DIR / "verl" / "das_grpo.yaml")
    return cfg, cfg["actor_rollout_ref"]["rollout"]["engine_kwargs"]["vllm"]


def test_verl_overlay_yaml_matches_the_builder_and_checks():
    cfg, ek = _verl_engine_kwargs()
    assert cfg["defaults"] == ["ppo_trainer", "_self_"]
    assert cfg["hydra"]["searchpath"] == ["pkg://verl.trainer.config"]
    assert cfg["actor_rollout_ref"]["rollout"]["disable_log_stats"] is False
    built = verl_overlay()["actor_rollout_ref"]["rollout"]
    assert built["engine_kwargs"]["vllm"] == ek
    assert built["agent"] == cfg["actor_rollout_ref"]["rollout"]["agent"]
    assert check_das_engine_kwargs(ek) == {"window": 16, "decay": 0.9, "budget": "cost"}


@pytest.mark.slow  # imports vLLM (several seconds of CPU); the fast loop stays free of it
def test_verl_engine_kwargs_reach_vllm_speculative_and_additional_config():
    """verl turns engine_kwargs.vllm into `vllm serve` arguments; parse them with vLLM's own parser."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    _, ek = _verl_engine_kwargs()
    args = verl_vllm_cli_args(ek)
    assert args[0] == "--speculative_config" and json.loads(args[1])["method"] == "custom_class"
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    ea = EngineArgs.from_cli_args(parser.parse_args(["--model", "m", *args]))
    assert ea.speculative_config == ek["speculative_config"]
    assert ea.additional_config == ek["additional_config"]


def test_verl_cli_overrides_use_plus_for_new_engine_kwargs():
    ov = verl_cli_overrides(verl_overlay(num_speculative_tokens=8))
    assert "actor_rollout_ref.rollout.disable_log_stats=false" in ov
    assert "+actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.num_speculative_tokens=8" in ov
    assert "+actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.das.window=16" in ov
    assert "actor_rollout_ref.rollout.agent.default_agent_loop=das_single_turn_agent" in ov


def test_check_das_engine_kwargs_rejects_mistakes():
    with pytest.raises(ValueError, match="custom_class"):
        check_das_engine_kwargs({"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}})
    with pytest.raises(ValueError, match="speculative_config.model"):
        check_das_engine_kwargs({"speculative_config": {"method": "custom_class", "model": "x.Y", "num_speculative_tokens": 4}})
    ok = {"method": "custom_class", "model": "integrations.vllm_ext.proposer.DASProposer", "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        check_das_engine_kwargs({"speculative_config": {**ok, "num_speculative_tokens": 0}})
    with pytest.raises(ValueError, match="windw"):
        check_das_engine_kwargs({"speculative_config": json.dumps(ok), "additional_config": {"das": {"windw": 4}}})


def test_das_request_fields_from_verl_rows():
    assert das_request_fields({"data_source": "deepscaler", "index": 17}) == {"das_problem_id": "deepscaler/17"}
    assert das_request_fields({"extra_info": {"index": 3}}) == {"das_problem_id": "3"}
    assert das_request_fields({"uid": "u-1"}, max_draft_tokens=4) == {"das_problem_id": "u-1", "das_max_draft_tokens": 4}
    assert das_request_fields({}) == {}
    sp = with_das_fields({"temperature": 1.0, "extra_args": {"kv_transfer_params": 1}}, {"index": 5, "data_source": "d"})
    assert sp == {"temperature": 1.0, "extra_args": {"kv_transfer_params": 1, "das_problem_id": "d/5"}}


def test_verl_agent_loop_adapter_with_a_stand_in_verl(monkeypatch):
    """The registry entry builds a SingleTurnAgentLoop subclass that adds extra_args (verl replaced by a stub)."""
    import integrations.rl.recipes as recipes

    seen = {}

    class SingleTurnAgentLoop:  # the part of verl's class the adapter relies on
        def __init__(self, **kwargs):
            self.kwargs = kwargs

        async def run(self, sampling_params, **kwargs):
            seen["sampling_params"] = sampling_params
            seen["kwargs"] = kwargs
            return "output"

    names = ["verl", "verl.experimental", "verl.experimental.agent_loop", "verl.experimental.agent_loop.single_turn_agent_loop"]
    for n in names:
        monkeypatch.setitem(sys.modules, n, types.ModuleType(n))
    sys.modules[names[-1]].SingleTurnAgentLoop = SingleTurnAgentLoop
    monkeypatch.setattr(recipes, "_VERL_LOOP", None)

    entry = load_yaml(RECIPES_DIR / "verl" / "das_agent_loops.yaml")[0]
    assert entry["name"] == "das_single_turn_agent"
    module, _, fn = entry["_target_"].rpartition(".")
    target = getattr(importlib.import_module(module), fn)
    loop = target(trainer_config=None, server_manager=None, tokenizer=None)  # what hydra.utils.instantiate does
    assert isinstance(loop, SingleTurnAgentLoop)
    out = asyncio.run(loop.run({"temperature": 0.6}, raw_prompt=[], index=9, data_source="deepscaler"))
    assert out == "output"
    assert seen["sampling_params"] == {"temperature": 0.6, "extra_args": {"das_problem_id": "deepscaler/9"}}
    assert seen["kwargs"]["index"] == 9


# ---- NeMo-RL


@pytest.mark.engine
def test_nemo_rl_recipe_matches_builder_and_runs_in_vllm(tiny_model):
    """NeMo-RL spreads policy.generation.vllm_kwargs into vllm.LLM(...): do the same with the recipe's kwargs."""
    from vllm import SamplingParams, TokensPrompt

    from integrations.rl.grpo import release_engine_state
    from integrations.vllm_ext import control
    from integrations.vllm_ext.engine import make_llm

    cfg = load_yaml(RECIPES_DIR / "nemo_rl" / "grpo_math_1B_das.yaml")
    assert cfg["defaults"] == "grpo_math_1B.yaml"
    vk = cfg["policy"]["generation"]["vllm_kwargs"]
    assert vk == nemo_rl_overlay()["policy"]["generation"]["vllm_kwargs"]
    assert "PYTHONPATH" in cfg["policy"]["generation"]["vllm_cfg"]["env_vars"]
    check_das_engine_kwargs(vk)
    vk = {**vk, "speculative_config": {**vk["speculative_config"], "num_speculative_tokens": 4}}
    llm = make_llm(tiny_model, "none", dtype="float32", max_model_len=512, **vk)
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(range(3, 40)))], SamplingParams(n=2, temperature=0.8, max_tokens=24), use_tqdm=False)
        assert len(outs[0].outputs) == 2
        snap = control.snapshot(llm)[0]
        assert snap["steps"] > 0 and snap["policy_version"] == 0 and snap["failures"] == 0
    finally:
        del llm
        release_engine_state()


def test_exponent_floats_without_a_dot_are_numbers(tmp_path):
    # PyYAML follows YAML 1.1, where 1e-4 is a string; recipes read it as YAML 1.2 does
    r = load_recipe("grpo_dsr_sub", ["train.lr=1e-4", "train.weight_decay=2E-2", "log.json=null"])
    assert (r.train.lr, r.train.weight_decay) == (1e-4, 0.02)
    path = tmp_path / "r.yaml"
    path.write_text("steps: 3\ntrain:\n  lr: 5e-6\n  mini_batches: 1\nlog:\n  json: null\n")
    r = load_recipe(path)
    assert r.train.lr == 5e-6 and isinstance(r.train.lr, float) and r.train.mini_batches == 1
    assert load_recipe("grpo_dsr_sub", ["log.json=1e-4x"]).log.json == "1e-4x"  # not a number: stays a string
