import json

import pytest

from benchmarks.staleness import continuation_tables, main, score, staleness
from integrations.data.trace import Rollout, write_trace


def _visit(pid, version, outputs):
    return [Rollout(version - 1, version, pid, s, [1, 2, 3], out, "stop") for s, out in enumerate(outputs)]


def test_most_frequent_continuation_leaves_one_rollout_out_and_breaks_ties_by_token():
    group = [[1, 2, 7], [1, 2, 5], [1, 2, 5], [1, 2, 9]]
    assert continuation_tables(group, 2, None) == {(1, 2): 5}
    assert continuation_tables(group, 2, 1) == {(1, 2): 5}  # 5 once, 7 once, 9 once: the smallest
    assert continuation_tables([[1, 2, 7], [1, 2, 5]], 2, None) == {(1, 2): 5}
    assert score([1, 2, 5, 6], {(1, 2): 5}, 2) == (2, 1, 1)  # (2, 5) -> 6 is not covered


def test_history_that_repeats_scores_one_and_disjoint_history_zero():
    same = [[10, 11, 12, 13, 14, 15]] * 3
    other = [[20, 21, 22, 23, 24, 25]] * 3
    rows = _visit("p", 1, same) + _visit("p", 2, same) + _visit("p", 4, other)
    ages = {a["age"]: a for a in staleness(rows, n=2)}
    assert sorted(ages) == [0, 1, 2, 3]
    assert ages[0]["hit_rate"] == 1.0 and ages[0]["pairs"] == 3  # siblings: every visit's own group
    assert ages[1]["hit_rate"] == 1.0 and ages[1]["pairs"] == 1  # version 2 against version 1
    assert ages[2]["coverage"] == 0.0 and ages[3]["hit_rate"] == 0.0  # version 4 against 2 and 1
    assert ages[1]["positions"] == 3 * 4


def test_other_problems_are_never_a_reference():
    rows = _visit("p", 1, [[1, 2, 3, 4]] * 2) + _visit("q", 2, [[1, 2, 3, 4]] * 2)
    assert [a["age"] for a in staleness(rows, n=2)] == [0]


def test_bad_context_length_is_refused():
    with pytest.raises(ValueError, match="n must be an int >= 1, got 0"):
        staleness([], n=0)


def test_cli_writes_the_table(tmp_path, capsys):
    path = write_trace(tmp_path / "t.parquet", _visit("p", 1, [[5, 6, 7, 8]] * 2) + _visit("p", 3, [[5, 6, 7, 9]] * 2))
    out = tmp_path / "s.json"
    assert main(["--trace", str(path), "--n", "2", "--json", str(out)]) == 0
    ages = json.loads(out.read_text())["ages"]
    assert [(a["age"], a["positions"], a["covered"], a["hits"]) for a in ages] == [(0, 8, 8, 8), (2, 4, 4, 2)]
    assert "policy age" in capsys.readouterr().out
