"""The das-rollout main job: argument checking, and one real end-to-end run on the tiny model."""

import json

import pytest

from integrations.rollout import iteration_prompts, parse_args

ITERATION_KEYS = {"wall_time_s", "tokens", "verification_steps", "acceptance_length", "draft_tokens", "accepted_tokens"}


def test_methods_and_bad_flags():
    args = parse_args(["--compare", "none,das:fixed"])
    assert args.methods == ["das", "none", "das:fixed"]
    for bad in (["--compare", "beam"], ["--compare", "das:greedy"], ["--prompts", "0"], ["--pool", "2", "--prompts", "4"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_every_method_sees_the_same_prompts():
    args = parse_args(["--iterations", "3", "--prompts", "2", "--pool", "5"])
    schedule = iteration_prompts(100, args)
    assert schedule == iteration_prompts(100, args)
    assert len(schedule) == 3 and all(len(s) == 2 for s in schedule)
    assert len({i for s in schedule for i in s}) <= 5  # drawn from a pool of 5 problems, revisited


def test_main_job_end_to_end_on_tiny_model(tiny_model, tmp_path):
    pytest.importorskip("vllm")
    from integrations.rollout import main
    from integrations.trace import read_trace

    out, trace = tmp_path / "r.json", tmp_path / "t.parquet"
    rc = main(["--model", tiny_model, "--data", "champ", "--iterations", "2", "--prompts", "2", "--samples", "2",
               "--max-tokens", "16", "--compare", "none", "--dtype", "float32", "--max-model-len", "1024",
               "--json", str(out), "--trace", str(trace)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report["methods"]) == {"das", "none"}
    for m in report["methods"].values():
        assert len(m["iterations"]) == 2
        for it in m["iterations"]:
            assert ITERATION_KEYS <= set(it)
            assert it["verification_steps"] == it["tokens"] - it["accepted_tokens"]
    assert report["methods"]["none"]["iterations"][0]["acceptance_length"] == 1.0
    rollouts = read_trace(trace)
    assert len(rollouts) == 2 * 2 * 2 and {r.policy_version for r in rollouts} == {1, 2}
