"""The A/B of whole GRPO runs (``das-grpo --compare``) and what every method of a run shares (issue 50).

Fast tests check the workload (a verl parquet with fewer problems than the pool), the reward memo,
the report and the command line without an engine; one engine test runs ``--compare none,das`` on
the tiny model and checks that both runs stay identical step by step.
"""

from __future__ import annotations

import json
import os

import pytest

from integrations.rl.ab import build_report, format_report, method_recipe, parse_methods, plot_report
from integrations.rl.recipes import load_recipe


def _write_verl_parquet(path, rows):
    """A verl-style RL parquet: ``rows`` of (question, ground truth)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "data_source": ["toy"] * len(rows),
        "prompt": [[{"role": "user", "content": f"{q} Let's think step by step and output the final answer within \\boxed{{}}."}]
                   for q, _ in rows],
        "ability": ["math"] * len(rows),
        "reward_model": [{"style": "rule", "ground_truth": a} for _, a in rows],
        "extra_info": [{"index": i, "split": "train"} for i in range(len(rows))],
    })
    pq.write_table(table, path)
    return str(path)


TOY_ROWS = [("What is 1 + 1?", "2"), ("What is 2 + 3?", "5"), ("Name a colour.", ""), ("What is 3 * 3?", "9")]


@pytest.fixture
def saved_environ():
    """Restore os.environ after a test that applies the CPU defaults (they set vLLM's variables)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# ---- the workload: the same problems, prompts and settings for every method


def test_a_parquet_with_fewer_problems_than_the_pool_trains_on_all_of_them(tiny_model, tmp_path, capsys, saved_environ):
    from integrations.rl.workload import plan_workload
    from integrations.vllm_ext import cpu_runtime

    data = _write_verl_parquet(tmp_path / "toy.parquet", TOY_ROWS)
    rec = load_recipe("grpo_dsr_sub", [f"model={tiny_model}", f"data={data}", "pool=64", "rollout.prompts_per_step=4", "steps=3", "log.json=null"])
    work = plan_workload(rec)
    usable = {0, 1, 3}  # row 2 has no ground truth
    assert len(work.schedule) == 3 and all(sorted(s) == sorted(usable) for s in work.schedule)
    assert "3 usable problems" in capsys.readouterr().err  # prompts_per_step 4 capped, said on stderr
    assert set(work.prompts) == usable and all(len(work.prompts[i]) > 5 for i in usable)
    assert [work.problems[i].problem_id for i in sorted(usable)] == ["toy/0", "toy/1", "toy/3"]
    # rollout.dtype auto: this machine's choice; an explicit value wins
    assert work.engine_dtype == (cpu_runtime.settings().dtype if cpu_runtime.is_cpu_build() else "bfloat16")
    assert plan_workload(load_recipe(rec.to_dict(), ["rollout.dtype=float32"])).engine_dtype == "float32"
    # a rerun (or another method) draws the same problems
    assert plan_workload(rec).schedule == work.schedule


def test_a_step_draws_from_a_pool_smaller_than_the_data(tiny_model, tmp_path, saved_environ):
    from integrations.rl.workload import plan_workload

    data = _write_verl_parquet(tmp_path / "toy.parquet", TOY_ROWS * 3)  # 12 rows, 9 usable
    rec = load_recipe("grpo_dsr_sub", [f"model={tiny_model}", f"data={data}", "pool=4", "rollout.prompts_per_step=2", "steps=6", "log.json=null"])
    work = plan_workload(rec)
    drawn = {i for s in work.schedule for i in s}
    assert all(len(s) == 2 and len(set(s)) == 2 for s in work.schedule) and len(drawn) <= 4
    assert all(work.problems[i].answer for i in drawn)


def test_scorer_memo_scores_a_rollout_once_per_step_and_charges_its_seconds():
    from integrations.rl.workload import Scorer

    calls = []

    def fn(problems, texts):
        calls.append(list(texts))
        return [float(len(t)) for t in texts]

    sc = Scorer(load_recipe(None), fn, memo=True)
    r1, s1 = sc(0, ["p", "p"], [("a",), ("b",)], ["aa", "bbb"])
    r2, s2 = sc(0, ["p", "p"], [("a",), ("b",)], ["aa", "bbb"])  # the other method, same rollouts
    assert r1 == r2 == [2.0, 3.0] and calls == [["aa", "bbb"]] and s2 == s1 > 0
    r3, _ = sc(0, ["p", "p"], [("a",), ("c",)], ["aa", "c"])  # one new rollout: only it is scored
    assert r3 == [2.0, 1.0] and calls[-1] == ["c"]
    sc(1, ["p"], [("a",)], ["aa"])  # a new step forgets the last one's rewards
    assert calls[-1] == ["aa"]
    plain = Scorer(load_recipe(None), fn)
    plain(0, ["p"], [("a",)], ["aa"])
    plain(0, ["p"], [("a",)], ["aa"])
    assert calls[-2:] == [["aa"], ["aa"]]


# ---- the report


def _record(step, roll, tokens, accepted, reward, loss, train=4.0):
    return {"step": step, "problems": ["p/0"], "rollout_s": roll, "tail10_s": roll / 4, "tokens": tokens, "tokens_per_s": tokens / roll,
            "acceptance_length": tokens / (tokens - accepted), "accepted_tokens": accepted, "draft_caps": None, "score_s": 0.5,
            "train_s": train, "sync_s": 0.25, "step_s": roll + 0.5 + train + 0.25, "reward_mean": reward, "loss": loss}


def test_report_counts_identical_rollouts_and_the_largest_differences(tmp_path):
    records = {"none": [_record(0, 10.0, 100, 0, 0.5, 0.1), _record(1, 12.0, 120, 0, 0.25, 0.2)],
               "das": [_record(0, 5.0, 100, 40, 0.5, 0.1), _record(1, 8.0, 120, 50, 0.125, 0.5)]}
    outputs = {"none": [[[1, 2], [3]], [[4], [5, 6], [7], [8]]], "das": [[[1, 2], [3]], [[4], [5, 9], [7], [8]]]}
    rep = build_report(records, outputs)
    assert rep["identical_rollouts"] == pytest.approx(5 / 6)
    assert rep["max_reward_diff"] == pytest.approx(0.125) and rep["max_loss_diff"] == pytest.approx(0.3)
    assert [s["identical"] for s in rep["steps"]] == [1.0, 0.75]
    none, das = rep["methods"]["none"], rep["methods"]["das"]
    assert none["summary"]["tokens_per_s"] == pytest.approx(220 / 22.0, abs=0.01) and das["summary"]["tokens_per_s"] == pytest.approx(220 / 13.0, abs=0.01)
    assert rep["speedup"]["das"]["rollout_tokens_per_s"] == pytest.approx(22.0 / 13.0, abs=1e-3)
    assert rep["speedup"]["das"]["step_s"] == pytest.approx((22.0 + 2 * 4.75) / (13.0 + 2 * 4.75), abs=1e-3)
    assert das["summary"]["acceptance_length"] == pytest.approx(220 / 130, abs=1e-4)
    step = das["steps"][0]
    for key in ("rollout_s", "tokens", "tokens_per_s", "tail_s", "acceptance_length", "train_s", "sync_s", "step_s", "reward_mean", "loss"):
        assert key in step, key
    assert "problems" not in step and "tail10_s" not in step and step["tail_s"] == 1.25
    text = format_report(rep)
    assert "identical rollouts 0.833" in text and "1.69x" in text
    png = plot_report(rep, tmp_path / "ab.png")
    assert png is not None and png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(ValueError, match="different numbers of steps"):
        build_report({"none": records["none"], "das": records["das"][:1]}, {"none": outputs["none"], "das": outputs["das"][:1]})


def test_methods_and_their_recipes():
    assert parse_methods(" none, das ") == ["none", "das"]
    for bad, match in (("none,eagle", "unknown methods"), ("das", "two or more"), ("das,das", "two or more")):
        with pytest.raises(ValueError, match=match):
            parse_methods(bad)
    rec = load_recipe("grpo_dsr_sub", ["scheduler.budget=class", "rollout.coupled_sampling=false", "log.json=null"])
    none, das, ngram = (method_recipe(rec, m) for m in ("none", "das", "ngram"))
    assert (none.speculative.method, none.scheduler.budget, none.rollout.coupled_sampling) == ("none", None, True)
    assert (das.speculative.method, das.scheduler.budget, das.speculative.num_speculative_tokens) == ("das", "class", 16)
    assert ngram.speculative.num_speculative_tokens == 16 and ngram.scheduler.budget is None
    assert das.to_dict()["train"] == none.to_dict()["train"] == rec.to_dict()["train"]


# ---- the command line, checked before any engine


@pytest.fixture
def no_engine(monkeypatch):
    import integrations.vllm_ext.engine

    def refuse(*a, **k):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(integrations.vllm_ext.engine, "make_llm", refuse)


@pytest.mark.parametrize("argv,named", [
    (["--compare", "none,eagle"], "unknown methods ['eagle']"),
    (["--compare", "das"], "two or more different methods"),
    (["--json", "x.json"], "--json goes with --compare"),
])
def test_compare_arguments_are_checked(capsys, no_engine, argv, named):
    from integrations.rl.grpo import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "das-grpo: error:" in err and named in err


def test_compare_refuses_existing_results_before_the_run(tmp_path, capsys, no_engine):
    from integrations.rl.grpo import main

    out = tmp_path / "ab.json"
    for existing in (out, tmp_path / "ab.png"):  # the report and its plot
        existing.write_text("an earlier result")
        with pytest.raises(SystemExit) as exc:  # (the recipe's log.json is not written with --compare, so not checked)
            main(["--compare", "none,das", "--json", str(out), "data=champ", "log.json=/proc/no-such-dir/log.jsonl"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and existing.name in err and "exists" in err
        assert existing.read_text() == "an earlier result"
        existing.unlink()


# ---- the A/B itself


@pytest.mark.engine
def test_compare_none_das_trains_identically_step_by_step(peaked_tiny_model, tmp_path, monkeypatch):
    # coupled sampling at temperature 1 on a float32 engine: both methods sample the same rollouts
    # (das drafting, accepting and rejecting), score them the same, compute the same losses and end
    # with the same weights. The toy reward depends on the text, so the groups carry a signal.
    from integrations.rl import rewards
    from integrations.rl.grpo import main

    def toy_reward(problems, texts):
        return [sum(c in "aeiou" for c in t) / max(1, len(t)) for t in texts]

    monkeypatch.setattr(rewards, "make_reward_fn", lambda **kw: toy_reward)
    data = _write_verl_parquet(tmp_path / "toy.parquet", TOY_ROWS)  # 3 usable problems, fewer than the pool
    out = tmp_path / "ab.json"
    argv = ["--recipe", "grpo_dsr_sub", "--compare", "none,das", "--json", str(out), f"model={peaked_tiny_model}", f"data={data}",
            "pool=64", "steps=2", "rollout.prompts_per_step=2", "rollout.samples=4", "rollout.max_tokens=24", "rollout.temperature=1.0",
            "rollout.dtype=float32", "rollout.max_model_len=512", "reward.overlong_buffer=0", "speculative.num_speculative_tokens=4",
            "speculative.das.window=4", "speculative.das.budget=fixed", "train.lr=3e-3", "train.advantage=batch", "train.micro_batch_tokens=512",
            "log.progress=false"]
    assert main(argv) == 0
    rep = json.loads(out.read_text())
    assert rep["engine_dtype"] == "float32" and rep["coupled_sampling"] is True
    assert rep["identical_rollouts"] == 1.0 and rep["max_reward_diff"] == 0.0 and rep["max_loss_diff"] == 0.0
    assert rep["final_weights_identical"] is True and rep["max_weight_diff"] == 0.0
    none, das = rep["methods"]["none"]["steps"], rep["methods"]["das"]["steps"]
    assert len(none) == len(das) == 2
    for entry in none + das:
        for key in ("rollout_s", "tokens", "tokens_per_s", "tail_s", "acceptance_length", "train_s", "sync_s", "step_s", "reward_mean", "loss"):
            assert key in entry, key
    assert any(e["updates"] > 0 and e["loss"] != 0.0 for e in none)  # the policy did train
    assert sum(e["accepted_tokens"] for e in das) > 0 and sum(e["accepted_tokens"] for e in none) == 0  # das did draft
    assert [e["tokens"] for e in none] == [e["tokens"] for e in das]
    assert isinstance(rep["cpu"], str) and "code_version" in rep and rep["max_rss_gib"] > 0
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(SystemExit):  # an existing report is not overwritten without --overwrite
        main(argv)
