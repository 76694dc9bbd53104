"""The das-rollout main job: argument checking, and one real end-to-end run on the tiny model."""

import json
import os

import pytest

# integrations.rollout imports the proposer, which imports vLLM (seconds): every test here is slow,
# and the module is imported in the tests, not at collection.
pytestmark = pytest.mark.slow


def parse_args(argv):
    from integrations.rollout import parse_args as parse

    return parse(argv)


def iteration_prompts(n, args):
    from integrations.rollout import iteration_prompts as prompts

    return prompts(n, args)

ITERATION_KEYS = {"wall_time_s", "tokens", "verification_steps", "acceptance_length", "draft_tokens", "accepted_tokens"}


def test_methods_and_bad_flags():
    args = parse_args(["--compare", "none,das:fixed"])
    assert args.methods == ["das", "none", "das:fixed"]
    for bad in (["--compare", "beam"], ["--compare", "das:greedy"], ["--prompts", "0"], ["--pool", "2", "--prompts", "4"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_sample_seed_changes_the_draws_not_the_problems():
    from integrations.rollout import iteration_prompts, sampling_seed

    base, other = parse_args(["--iterations", "3", "--pool", "6"]), parse_args(["--iterations", "3", "--pool", "6", "--sample-seed", "2"])
    assert iteration_prompts(50, base) == iteration_prompts(50, other)
    assert [sampling_seed(base, v) for v in (1, 2, 3)] == [1, 2, 3]  # the draws of every earlier run
    assert [sampling_seed(other, v) for v in (1, 2, 3)] == [15839, 15840, 15841]


def test_every_method_sees_the_same_prompts():
    args = parse_args(["--iterations", "3", "--prompts", "2", "--pool", "5"])
    schedule = iteration_prompts(100, args)
    assert schedule == iteration_prompts(100, args)
    assert len(schedule) == 3 and all(len(s) == 2 for s in schedule)
    assert len({i for s in schedule for i in s}) <= 5  # drawn from a pool of 5 problems, revisited


@pytest.mark.engine
def test_main_job_end_to_end_on_tiny_model(tiny_model, tmp_path):
    pytest.importorskip("vllm")
    from integrations.data.trace import read_trace
    from integrations.rollout import main

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
    # coupled sampling by default: the report counts the rollouts both methods generated alike, and says how it ran
    same = report["identical_rollouts"]
    assert report["coupled_sampling"] is True and same["rollouts"] == 8 and 0 <= same["identical"] <= 8
    assert report["methods"]["das"]["summary"]["speedup_vs_none"] > 0
    assert report["code_version"]["commit"] and report["command"].startswith("das-rollout --model") and report["date"]
    assert "DAS_VLLM_FEATURES" not in os.environ or "coupled_sampling" not in os.environ["DAS_VLLM_FEATURES"]


def test_result_paths_are_checked_before_the_run(tmp_path):
    existing = tmp_path / "r.json"
    existing.write_text("{}")
    with pytest.raises(SystemExit):
        parse_args(["--json", str(existing)])  # refused: it exists and --overwrite was not given
    assert parse_args(["--json", str(existing), "--overwrite"]).overwrite
    with pytest.raises(SystemExit):
        parse_args(["--trace", "/proc/das/t.parquet"])  # not writable
    assert existing.read_text() == "{}"


def test_tail_is_measured_from_the_90th_percentile_finish():
    from integrations.vllm_ext.rollouts import Rollout, RolloutBatch

    ends = [1.0] * 9 + [5.0]
    batch = RolloutBatch([Rollout(0, "p", i, [7], [1], "length", t) for i, t in enumerate(ends)], 5.0, 0, 0)
    assert batch.tail_time_s(0.1) == 4.0
    assert batch.tail_time_s(0.0) == 0.0
    with pytest.raises(ValueError, match="fraction"):
        batch.tail_time_s(1.5)


def test_the_summary_pools_the_tails_and_the_table_shows_them():
    """``tail_acc`` over iterations is tokens over verification steps of all their tails pooled
    (not a mean of ratios); an iteration without a tail counts nothing."""
    from integrations.rollout import format_table, summarize

    base = {"wall_time_s": 10.0, "tokens": 100, "verification_steps": 50, "tokens_per_s": 10.0, "iteration": 0,
            "longest_rollout_tokens": 9, "acceptance_length": 2.0, "draft_tokens": 80, "accepted_tokens": 50}
    its = [base | {"tail_row_steps": 10, "tail_accepted_tokens": 30, "tail_acceptance_length": 4.0},
           base | {"tail_row_steps": 30, "tail_accepted_tokens": 10, "tail_acceptance_length": 1.3333},
           base | {"tail_row_steps": 0, "tail_accepted_tokens": 0, "tail_acceptance_length": 1.0}]
    s = summarize(its)
    assert s["tail_acceptance_length"] == pytest.approx((40 + 40) / 40)
    assert summarize([base])["tail_acceptance_length"] == 1.0  # reports from before the field: no tail counted
    text = format_table({"methods": {"das": {"iterations": its, "summary": s}}})
    head = text.splitlines()[0].split()
    assert head[head.index("acc_len") + 1] == "tail_acc"
    assert text.splitlines()[2].split()[head.index("tail_acc")] == "4.00"


def test_kv_cache_size_follows_the_workload(tmp_path):
    from integrations.rollout import kv_cache_gib

    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "num_hidden_layers": 30}))
    # SmolLM2-135M: 2 * 30 layers * 3 heads * 64 * 2 bytes = 23,040 bytes per token in bf16
    assert kv_cache_gib(str(tmp_path), 64, 1300, "bfloat16") == 3  # 1.25 * 64 * 1300 * 23040 B = 2.23 GiB
    assert kv_cache_gib(str(tmp_path), 1, 100, "float32") == 1
    assert kv_cache_gib(str(tmp_path / "missing"), 64, 1300, "bfloat16") == 0


def test_bad_settings_are_refused_before_any_engine_starts(tmp_path, capsys):
    for bad in (["--window", "0"], ["--decay", "1.5"], ["--num-spec-tokens", "0"]):
        with pytest.raises(SystemExit) as exc:
            parse_args(bad)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"{bad[0]} must be" in err and f"got {bad[1]}" in err  # more bad inputs: tests/test_config.py


def test_missing_data_file_is_a_one_line_error(tmp_path, capsys):
    from integrations.rollout import main

    missing = tmp_path / "nope.parquet"
    with pytest.raises(SystemExit) as exc:  # refused while parsing: before the model or any engine loads
        main(["--data", str(missing), "--compare", ""])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "das-rollout: error:" in err and "nope.parquet" in err and "Traceback" not in err


def test_sampling_is_coupled_unless_asked_otherwise():
    from integrations.rollout import parse_args

    assert parse_args(["--iterations", "1"]).coupled_sampling is True
    assert parse_args(["--coupled-sampling"]).coupled_sampling is True  # the old flag: the default now
    assert parse_args(["--independent-sampling"]).coupled_sampling is False


def test_coupled_sampling_is_named_for_engines_in_other_processes(monkeypatch):
    import argparse

    from integrations.rollout import request_coupled_sampling, restore_features

    monkeypatch.setenv("DAS_VLLM_FEATURES", "other")
    assert request_coupled_sampling(argparse.Namespace(coupled_sampling=True)) == "other"
    request_coupled_sampling(argparse.Namespace(coupled_sampling=True))
    assert os.environ["DAS_VLLM_FEATURES"] == "other,coupled_sampling"
    restore_features("other")
    assert os.environ["DAS_VLLM_FEATURES"] == "other"
    monkeypatch.delenv("DAS_VLLM_FEATURES")
    before = request_coupled_sampling(argparse.Namespace(coupled_sampling=False))
    assert before is None and "DAS_VLLM_FEATURES" not in os.environ
    request_coupled_sampling(argparse.Namespace(coupled_sampling=True))
    restore_features(before)
    assert "DAS_VLLM_FEATURES" not in os.environ


def _iteration(wall: float, tokens: int, digests: list[str]) -> dict:
    return {"wall_time_s": wall, "tokens": tokens, "verification_steps": tokens, "tokens_per_s": tokens / wall, "iteration": 0,
            "longest_rollout_tokens": 9, "acceptance_length": 1.0, "draft_tokens": 0, "accepted_tokens": 0, "rollout_digests": digests}


def test_the_report_counts_identical_rollouts_and_gives_wall_clock_beside_token_ratios():
    from integrations.rollout import compare_methods, format_table, summarize

    runs = {"das": [_iteration(5.0, 100, ["a", "b", "c"]), _iteration(5.0, 100, ["d", "e", "f"])],
            "none": [_iteration(10.0, 80, ["a", "b", "x"]), _iteration(10.0, 80, ["d", "e", "f"])],
            "suffix": [_iteration(8.0, 100, ["a", "y", "c"]), _iteration(8.0, 100, ["d", "e", "f"])]}
    report = {"coupled_sampling": True, "methods": {m: {"iterations": its, "summary": summarize(its)} for m, its in runs.items()}}
    compare_methods(report)
    same = report["identical_rollouts"]
    assert same == {"identical": 4, "rollouts": 6, "per_iteration": [1, 3], "vs_first": {"none": 5, "suffix": 5}}
    das = report["methods"]["das"]["summary"]
    # other rollouts, other token counts: the wall-clock ratio (2.0) and the tokens-per-second ratio (2.5) differ
    assert das["speedup_vs_none"] == 2.0 and das["tokens_per_s_vs_none"] == 2.5
    assert das["speedup_vs_suffix"] == 1.6 and das["tokens_per_s_vs_suffix"] == 1.6
    assert report["methods"]["none"]["summary"]["speedup_vs_none"] == 1.0
    text = format_table(report)
    assert "wall_vs_suffix" in text and "identical rollouts in every method: 4 of 6 (coupled sampling" in text
    one = {"methods": {"das": report["methods"]["das"]}}
    compare_methods(one)
    assert one["methods"]["das"]["summary"]["speedup_vs_none"] is None and "identical" not in format_table(one)
