"""The step-cost benchmark: both paths replay the same steps; the report's keys."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from benchmarks.replay import load_trace
from benchmarks.step_cost import Workload, copy_tokens, main, simulate


def test_paths_take_the_same_steps_and_rows_are_replicated(tmp_path, synthetic_trace):
    iterations = load_trace(synthetic_trace(length=60))
    work = Workload(iterations, rows=8)
    assert work.copies == 4 and len(work.pool) == 24  # >= 3 x 8 rollouts queued, as distinct problems
    assert len({pid for pid, _, _ in work.pool}) == 8
    runs = [simulate(work, path, k=8, max_steps=50) for path in ("per_row", "batch")]
    assert runs[0]["steps"] == runs[1]["steps"] > 0 and runs[0]["tokens"] == runs[1]["tokens"]
    assert runs[0]["drafter"] == runs[1]["drafter"]  # the same trees in the end
    assert runs[1]["wall_ns"].shape == (runs[1]["steps"],)


def test_report(tmp_path, capsys, synthetic_trace):
    out = tmp_path / "cost.json"
    args = ["--trace", str(synthetic_trace(length=60)), "--rows", "2,4", "--rows", "2", "--repeats", "1", "--max-steps", "20"]
    assert main(args + ["--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert sorted(report["rows"]) == ["2", "4"]
    e = report["rows"]["4"]
    for key in ("p50_ms", "p99_ms", "cpu_p50_ms", "cpu_p99_ms", "steps"):
        assert key in e and key in e["per_row"]
    assert e["p99_ms"] >= e["p50_ms"] > 0
    assert "per_row" in capsys.readouterr().out
    assert main(["--trace", str(tmp_path / "missing.parquet")]) == 2


@pytest.mark.slow
def test_the_proposer_path_drives_the_engines_proposer_through_the_same_steps(tmp_path, synthetic_trace):
    """``--paths proposer`` feeds :class:`DASProposer` as vLLM's runner does (the drafter's
    requests started and stopped by the proposer itself) and drafts what the batch verbs draft:
    on this workload the same steps and tokens (a finished request leaves the drafter one step
    later, at the proposer's next call, which can change a later draft on larger ones)."""
    iterations = load_trace(synthetic_trace(length=60))
    work = Workload(iterations, rows=8)
    batch, prop = (simulate(work, path, k=8, max_steps=50) for path in ("batch", "proposer"))
    assert prop["steps"] == batch["steps"] > 0 and prop["tokens"] == batch["tokens"]
    assert prop["drafter"]["requests"] == batch["drafter"]["requests"] == 8  # the proposer stopped every finished one
    assert np.all(prop["add_ns"] <= prop["wall_ns"])


@pytest.mark.slow
def test_priced_proposer_path_keeps_what_the_prices_pay_for_and_cuts_drafts_there(tmp_path, capsys, synthetic_trace):
    """``--prices C_BASE,C_TOK`` runs the proposer path with the ``cost`` budget on that line:
    dearer tokens keep fewer drafts (fewer tokens per row and step), the drafts stop at the
    step's price (``cut_steps``), and the report says so; without ``--paths proposer`` it is refused."""
    iterations = load_trace(synthetic_trace(length=60))
    work = Workload(iterations, rows=8)
    free, dear = (simulate(work, "proposer", k=8, max_steps=50, prices=p) for p in ((0.02, 0.0), (0.02, 0.0012)))
    assert free["proposer"]["cut_steps"] == 0 and dear["proposer"]["cut_steps"] > 0
    assert free["tokens"] / free["steps"] > dear["tokens"] / dear["steps"]
    out = tmp_path / "priced.json"
    trace = str(synthetic_trace(length=60))
    args = ["--trace", trace, "--rows", "4", "--repeats", "1", "--max-steps", "20", "--paths", "proposer"]
    assert main(args + ["--prices", "0.02,0.001", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["prices"] == {"c_base": 0.02, "c_tok": 0.001}
    assert "cut_steps" in report["rows"]["4"]["proposer"]["proposer_stats"]
    assert "priced at c_base 0.02" in capsys.readouterr().out
    assert main(args[:-2] + ["--prices", "0.02,0.001"]) == 2  # the batch path has no budget to price
    assert main(args + ["--prices", "0.02"]) == 2


def test_deferred_global_appends_run_between_steps_and_are_reported(tmp_path, synthetic_trace):
    """``--gpu-ms`` waits between steps (untimed) and ``defer_global`` runs the global tree's
    appends then: the report carries their time per step; the drafts read a global tree one
    step behind, so only the batch path runs (the per-row path appends at once)."""
    out = tmp_path / "cost.json"
    args = ["--trace", str(synthetic_trace(length=60)), "--rows", "4", "--repeats", "1", "--max-steps", "20", "--paths", "batch",
            "--gpu-ms", "1", "--das", '{"defer_global": true}', "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["gpu_ms"] == 1.0 and report["das"] == {"defer_global": True}
    assert report["rows"]["4"]["deferred_ms_mean"] > 0
    assert main(args[:-2] + ["--gpu-ms", "-1"]) == 2


def test_without_a_trace_the_default_one_is_recorded_once_then_reused(tmp_path, capsys, monkeypatch, synthetic_trace):
    """A fresh clone has no cached trace: step_cost records the benchmarks' default one (the real
    model's run is stood in for by a copy of a small trace) and reuses it afterwards."""
    import integrations.data.trace as trace_mod

    monkeypatch.setenv("DAS_CACHE_DIR", str(tmp_path / "cache"))
    src = synthetic_trace(length=60)
    recorded = []

    def record(path, data=None, model=None, **record):
        recorded.append(Path(path))
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, path)
        return Path(path)

    monkeypatch.setattr(trace_mod, "record_trace", record)
    args = ["--rows", "4", "--repeats", "1", "--max-steps", "20", "--paths", "batch"]
    out = tmp_path / "out.json"
    assert main(args + ["--json", str(out)]) == 0
    assert recorded == [trace_mod.default_trace_path()]
    assert json.loads(out.read_text())["trace"]["path"] == str(recorded[0])
    assert main(args + ["--no-record"]) == 0 and len(recorded) == 1  # cached now
    monkeypatch.setenv("DAS_CACHE_DIR", str(tmp_path / "empty"))
    capsys.readouterr()
    assert main(args + ["--no-record"]) == 2 and len(recorded) == 1
    assert "no rollout trace cached at" in capsys.readouterr().err


def test_context_lengthens_each_prompt_at_its_front_to_the_gpu_shape(tmp_path, synthetic_trace):
    """``--context N``: every queued rollout's context (prompt + output) ends at ``N`` tokens, its
    own prompt and output unchanged at the end, the filler the other problems' text in the copy's
    alphabet; 0 leaves the trace's rollouts as they are; the report keys the rows by rows@context."""
    iterations = load_trace(synthetic_trace(length=60))
    plain, long = Workload(iterations, rows=8), Workload(iterations, rows=8, context=500)
    assert len(plain.pool) == len(long.pool) and long.width == 500
    for (pid, prompt, full), (pid2, prompt2, full2) in zip(plain.pool, long.pool):
        assert pid == pid2 and full2.shape[0] == 500 and full2.dtype == np.int32
        assert np.array_equal(full2[500 - full.shape[0] :], full) and np.array_equal(prompt2[-prompt.shape[0] :], prompt)
    pid, copy = long.pool[-1][0].split("#")
    others = {int(t) for rs in iterations for r in rs if r.pid != pid for t in copy_tokens(r.full, int(copy))}
    filler = long.pool[-1][1][: 500 - plain.pool[-1][2].shape[0]]
    assert filler.shape[0] > 0 and {int(t) for t in filler} <= others  # the other problems' text, in the copy's alphabet
    run = simulate(long, "batch", k=8, max_steps=20)
    assert run["steps"] > 0
    out = tmp_path / "cost.json"
    args = ["--trace", str(synthetic_trace(length=60)), "--rows", "4", "--context", "300", "--paths", "batch", "--repeats", "1",
            "--max-steps", "10", "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert list(report["rows"]) == ["4@300"] and report["rows"]["4@300"]["context"] == 300
    assert main(args[:4] + ["--context", "-1"]) == 2
