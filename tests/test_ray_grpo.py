"""The GRPO loop on 2 Ray engines (rollout.engines: 2): weights synced to both, the same training as on one engine."""

import importlib.util

import pytest

from tests.test_grpo import _tiny_recipe, _toy_reward

pytestmark = [pytest.mark.engine, pytest.mark.slow,
              pytest.mark.skipif(None in (importlib.util.find_spec("ray"), importlib.util.find_spec("vllm")), reason="needs ray and vLLM")]


def test_greedy_training_on_two_engines_is_the_training_on_one(tiny_model):
    import ray

    from integrations.rl.grpo import run

    runs = {}
    for engines in (1, 2):
        rec = _tiny_recipe(tiny_model, "das", temperature=0.0, steps=3, prompts=3)
        rec["rollout"]["engines"] = engines
        runs[engines] = run(rec, reward_fn=_toy_reward, keep_rollouts=True)
    ray.shutdown()
    one, two = runs[1], runs[2]
    assert len(one.steps) == len(two.steps) == 3
    for a, b in zip(one.steps, two.steps):
        assert a["rollouts"] == b["rollouts"]  # every token: each engine got the updated weights (greedy, lossless drafts)
        for k in ("loss", "pg_loss", "updates"):
            assert a[k] == b[k], k
    assert any(s["updates"] > 0 for s in two.steps)  # the policy did change, and both engines followed it
    for s in two.steps:
        assert sum(s["placement"]["groups_per_engine"]) == 3 and len(s["engines"]) == 2
    assert sum(s["accepted_tokens"] for s in two.steps) > 0
