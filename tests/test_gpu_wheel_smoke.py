"""benchmarks/gpu_smoke.py's CPU dry run: the script a GPU user runs, end to end on vLLM's CPU build."""

import pytest

from benchmarks.gpu_smoke import compare_outputs, speed_table


def test_compare_outputs_names_the_first_difference():
    assert compare_outputs([[1, 2, 3], [4]], [[1, 2, 3], [4]]) == []
    assert compare_outputs([[1, 2, 3], [4, 5]], [[1, 9, 3], [4]]) == [{"rollout": 0, "at": 1, "a": [2, 3], "b": [9, 3]},
                                                                   {"rollout": 1, "at": 1, "a": [5], "b": []}]
    with pytest.raises(ValueError, match="1 against 2"):
        compare_outputs([[1]], [[1], [2]])


def test_speed_table_gives_the_speed_up_over_the_first_method():
    rows = {"none": {"wall_s": 4.0, "output_tokens": 100, "draft_tokens": 0, "accepted_tokens": 0},
            "das": {"wall_s": 2.0, "output_tokens": 100, "draft_tokens": 40, "accepted_tokens": 30}}
    table = speed_table(rows).splitlines()
    assert table[-2].split()[-1] == "1.00x" and table[-1].split()[-1] == "2.00x"
    assert "0.75" in table[-1]


@pytest.mark.engine
def test_dry_run_runs_none_and_das_and_finds_identical_rollouts(tmp_path, capsys):
    import json

    from benchmarks.gpu_smoke import main

    out = tmp_path / "smoke.json"
    assert main(["--dry-run", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["coupled"] is True and report["differ"] == []
    assert report["rollouts"] == 2 * 2 * 2
    assert set(report["methods"]) == {"none", "das"}
    assert report["methods"]["none"]["draft_tokens"] == 0 and report["methods"]["das"]["draft_tokens"] > 0
    text = capsys.readouterr().out
    assert "identical rollouts: 8 of 8" in text and "speed-up" in text
