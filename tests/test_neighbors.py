import json

import pytest

from benchmarks.neighbors import main, neighbors, prompt_similarity
from integrations.data.trace import Rollout, write_trace


def _group(pid, iteration, prompt, outputs):
    return [Rollout(iteration, iteration, pid, s, prompt, out, "stop") for s, out in enumerate(outputs)]


def test_prompt_similarity_ranks_shared_tokens_first():
    sim = prompt_similarity({"p": [10, 11, 12], "q": [10, 11, 13], "r": [20, 21, 22]})
    assert [q for _, q in sim["p"]] == ["q", "r"]
    assert sim["p"][0][0] > 0.0 and sim["p"][1][0] == 0.0
    same = prompt_similarity({"a": [1, 2, 3], "b": [1, 2, 3], "c": [4, 5]})
    assert same["a"][0] == (pytest.approx(1.0), "b")


def test_a_similar_problem_adds_what_the_own_group_lacks():
    rows = (_group("p", 0, [10, 11, 12], [[1, 2, 3, 4], [1, 2, 3, 4]])
            + _group("q", 0, [10, 11, 13], [[1, 2, 3, 9], [7, 7, 7, 7]]))
    (row,) = neighbors(rows, ns=(2,), k=1)["rows"]
    assert row["positions"] == 8
    assert (row["own_coverage"], row["own_hit_rate"]) == (0.5, 0.5)  # p's siblings repeat each other; q's do not
    # q's (1, 2) -> 3 is in p's rollouts, where q's own group has no such context: one extra hit
    assert (row["similar_coverage"], row["similar_hit_rate"], row["similar_extra"]) == (0.75, 0.375, 0.125)
    assert (row["others_coverage"], row["others_hit_rate"], row["others_extra"]) == (0.75, 0.375, 0.125)


def test_problems_first_seen_later_and_the_rollout_itself_are_never_a_reference():
    rows = _group("p", 0, [10, 11, 12], [[1, 2, 3]]) + _group("q", 1, [10, 11, 13], [[1, 2, 3]])
    (row,) = neighbors(rows, ns=(2,), k=1)["rows"]
    assert row["positions"] == 2
    assert row["own_coverage"] == 0.0  # no siblings, no history: not even its own tokens
    assert (row["similar_hit_rate"], row["others_hit_rate"], row["others_extra"]) == (0.5, 0.5, 0.5)  # q from p, not p from q


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"context lengths must be ints >= 1, got \[0\]"):
        neighbors([], ns=(0,))
    with pytest.raises(ValueError, match="k must be an int >= 1, got 0"):
        neighbors([], k=0)


def test_cli_writes_the_table(tmp_path, capsys):
    path = write_trace(tmp_path / "t.parquet", _group("p", 0, [10, 11, 12], [[1, 2, 3, 4], [1, 2, 3, 4]])
                       + _group("q", 0, [10, 11, 13], [[1, 2, 3, 9], [7, 7, 7, 7]]))
    out = tmp_path / "n.json"
    assert main(["--trace", str(path), "--n", "2", "--k", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["k"] == 1 and res["problems"] == 2 and res["rows"][0]["similar_extra"] == 0.125
    assert "similar: extra" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--trace", str(path), "--n", "0"])
