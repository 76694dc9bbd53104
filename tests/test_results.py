"""Result files and traces: refused before a run when they cannot be written, written atomically (issue #13)."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from integrations.data.trace import SCHEMA, Rollout, TraceWriter, read_trace, write_trace
from integrations.results import atomic_output, check_output_path, write_atomic


def test_check_output_path(tmp_path):
    fresh = tmp_path / "sub" / "dir" / "r.json"
    assert check_output_path(fresh) == fresh.absolute()
    assert not (tmp_path / "sub").exists()  # nothing created
    old = tmp_path / "old.json"
    old.write_text("x")
    with pytest.raises(ValueError, match="old.json.*exists"):
        check_output_path(old)
    assert check_output_path(old, overwrite=True) == old
    with pytest.raises(ValueError, match="is a directory"):
        check_output_path(tmp_path, overwrite=True)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        check_output_path(blocker / "r.json")
    with pytest.raises(ValueError, match="cannot write"):
        check_output_path("/proc/das-no-such-dir/r.json")
    with pytest.raises(ValueError):
        check_output_path("")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "old.json"]  # no probe left behind


def test_write_atomic_keeps_the_old_file_when_a_write_fails(tmp_path, monkeypatch):
    f = tmp_path / "a" / "r.json"
    write_atomic(f, "first")
    assert f.read_text() == "first"
    write_atomic(f, b"second")
    assert f.read_bytes() == b"second"
    with pytest.raises(RuntimeError), atomic_output(f) as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk full")
    assert f.read_text() == "second" and os.listdir(f.parent) == ["r.json"]
    with pytest.raises(TypeError):
        write_atomic(f, 3)
    assert f.read_text() == "second"


def _rollouts(n=3):
    return [Rollout(0, 1, f"p{i}", i, [1, 2, 3], [4, 5, 6, 7], "stop") for i in range(n)]


def test_a_failing_trace_write_keeps_the_old_trace(tmp_path, monkeypatch):
    path = tmp_path / "t.parquet"
    write_trace(path, _rollouts())
    before = path.read_bytes()

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", broken)
    with pytest.raises(OSError):
        write_trace(path, _rollouts(5))
    assert path.read_bytes() == before and len(read_trace(path)) == 3
    assert os.listdir(tmp_path) == ["t.parquet"]


def test_trace_rows_are_checked(tmp_path):
    with pytest.raises(ValueError, match="rollout 1: sample must be an int >= 0"):
        write_trace(tmp_path / "t.parquet", [_rollouts()[0], Rollout(0, 1, "p", -1, [1], [2], "stop")])
    with pytest.raises(ValueError, match="rollout 0: problem_id must be a string"):
        write_trace(tmp_path / "t.parquet", [Rollout(0, 1, None, 0, [1], [2], "stop")])
    with pytest.raises(ValueError, match="rollout 0: output_ids must be a list"):
        write_trace(tmp_path / "t.parquet", [Rollout(0, 1, "p", 0, [1], "abc", "stop")])
    existing = tmp_path / "keep.parquet"
    write_trace(existing, _rollouts())
    with pytest.raises(ValueError, match="exists"):
        write_trace(existing, _rollouts(), overwrite=False)
    empty = write_trace(tmp_path / "empty.parquet", [])
    assert read_trace(empty) == []


def test_bad_trace_files_raise_naming_the_file(tmp_path):
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(ValueError, match="junk.parquet"):
        read_trace(junk)
    cols = {n: [r[n] for r in [dict(iteration=0, policy_version=1, problem_id="p", sample=0, prompt_ids=[1], output_ids=[2],
                                    finish_reason="stop")]] for n in SCHEMA.names}
    bad = dict(cols, iteration=[-1])
    pq.write_table(pa.table(bad, schema=SCHEMA), tmp_path / "neg.parquet")
    with pytest.raises(ValueError, match="neg.parquet.*'iteration' has negative"):
        read_trace(tmp_path / "neg.parquet")
    nulls = dict(cols, problem_id=[None])
    pq.write_table(pa.table(nulls, schema=SCHEMA), tmp_path / "null.parquet")
    with pytest.raises(ValueError, match="null.parquet.*'problem_id' has 1 null"):
        read_trace(tmp_path / "null.parquet")
    wrong = dict(cols, sample=["zero"])
    pq.write_table(pa.table(wrong), tmp_path / "type.parquet")
    with pytest.raises(ValueError, match="type.parquet.*'sample'"):
        read_trace(tmp_path / "type.parquet")


def test_trace_writer_appends_steps_and_moves_the_file_only_when_complete(tmp_path):
    path = tmp_path / "runs" / "t.parquet"
    w = TraceWriter(path)
    assert w.close() is None and not path.exists()  # nothing written: no file
    w = TraceWriter(path)
    w.write(_rollouts(2))
    w.write([Rollout(1, 2, "q", 0, [1], [9, 9], "length")])
    assert not path.exists() and w.partial.exists()
    assert w.close() == path and not w.partial.exists()
    assert [(r.iteration, r.problem_id, r.output_ids) for r in read_trace(path)] == [
        (0, "p0", [4, 5, 6, 7]), (0, "p1", [4, 5, 6, 7]), (1, "q", [9, 9])]
    assert pq.ParquetFile(path).num_row_groups == 2  # one per write: a step costs only its own rollouts
    with pytest.raises(ValueError, match="t.parquet.*exists"):
        TraceWriter(path)
    # a run that fails: the finished steps stay in the partial file, the earlier trace as it was
    before = path.read_bytes()
    w = TraceWriter(path, overwrite=True)
    w.write(_rollouts(1))
    with pytest.raises(ValueError, match="rollout 0: sample must be an int >= 0"):
        w.write([Rollout(1, 2, "q", -1, [1], [2], "stop")])
    assert w.close(complete=False) == w.partial
    assert path.read_bytes() == before and len(read_trace(w.partial)) == 1


def test_identical_rollouts_refuses_mismatched_runs():
    from integrations.results import identical_rollouts, rollout_digest

    assert rollout_digest([1, 2, 3]) == rollout_digest((1, 2, 3)) != rollout_digest([1, 2, 4])
    assert len(rollout_digest([])) == 16
    with pytest.raises(ValueError, match="iterations"):
        identical_rollouts({"a": [["x"]], "b": []})
    with pytest.raises(ValueError, match="iteration 0"):
        identical_rollouts({"a": [["x"]], "b": [["x", "y"]]})


def test_result_provenance_names_commit_date_cpu_and_command():
    import datetime
    import subprocess

    from integrations.results import REPO, provenance

    p = provenance("das-rollout", ["--data", "dsr_sub", "--compare", ""])
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert p["code_version"]["commit"] == head and isinstance(p["code_version"]["dirty"], bool)
    assert datetime.datetime.fromisoformat(p["date"]).tzinfo is not None
    assert isinstance(p["cpu"], str) and p["cpu"]
    assert p["command"] == "das-rollout --data dsr_sub --compare ''"
