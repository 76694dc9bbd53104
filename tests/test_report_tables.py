"""Printed tables (tabulate) keep their columns and numbers; the replay plot is a PNG (matplotlib)."""

from __future__ import annotations

import re

import pytest


def _replay_report() -> dict:
    def entry(acc: float, makespan: int, bpt: float | None) -> dict:
        return {"acceptance_length": acc, "steps_per_rollout": 12.34, "steps_per_rollout_longest10": 40.1, "makespan_steps": makespan,
                "drafted_per_accepted": 1.5, "propose_us_p50": 3.21, "propose_us_p99": 10.5, "insert_ns_per_token": 120.4,
                "bytes_per_token": bpt, "iterations": [{"acceptance_length": acc - 0.1}, {"acceptance_length": acc + 0.1}]}

    return {"trace": {"path": "t.parquet", "rollouts": 16, "tokens": 1000, "iterations": 2}, "k": 16,
            "drafters": {"das": entry(2.5, 100, 40.0), "arctic_suffix": entry(2.0, 120, None)},
            "grid": [{"drafter": "das", "k": 4, "config": {"window": 1}, **entry(2.1, 90, 30.5)}],
            "targets": {"acceptance_length": {"das": 2.5, "arctic_suffix": 2.2, "ratio": 1.136, "target": ">= 1.2 x arctic",
                                              "met": False, "gap": -0.14}},
            "scale": {"trees": {"das": [{"tokens": 10000, "insert_ns_per_token": 150.2, "propose_us_p50": 2.5, "propose_us_p99": 9.1,
                                         "bytes_per_token": None}]}}}


def _cells(text: str, first: str) -> list[str]:
    """The cells of the first table row whose first cell is ``first`` (markdown pipes, or columns 2+ spaces apart)."""
    for line in text.splitlines():
        parts = line.strip().strip("|").split("|") if "|" in line else re.split(r"\s{2,}", line.strip())
        cells = [c.strip() for c in parts]
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in\n{text}")


def test_replay_table_keeps_columns_and_numbers():
    from benchmarks.replay import format_table

    text = format_table(_replay_report())
    assert _cells(text, "das") == ["das", "2.500", "12.3", "40.1", "100", "1.50", "3.21", "10.50", "120", "40"]
    assert _cells(text, "arctic_suffix")[-1] == "-"  # no memory figure
    assert _cells(text, "das K=4 W=1")[1:3] == ["2.100", "12.3"]
    assert _cells(text, "acceptance_length") == ["acceptance_length", "2.5", "2.2", "1.136", ">= 1.2 x arctic", "MISSED by -0.14"]
    assert "acc_len" in text and "B/tok" in text and "2.400" in text and "2.600" in text


def test_replay_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.replay_plot import write_png

    path = write_png(_replay_report(), tmp_path / "sub" / "replay.png")
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert [p.name for p in path.parent.iterdir()] == ["replay.png"]  # no temporary file left


def test_rollout_markdown_tables():
    from benchmarks.rollout import format_tables

    it = {"iteration": 0, "wall_time_s": 12.345, "tail10_s": 3.21, "tokens": 1000, "tokens_per_s": 81.2, "acceptance_length": 2.345,
          "draft_tokens": 500, "accepted_tokens": 300, "reward_mean": 0.25, "mean_len": 123.4, "truncated": 0.25}
    summary = {"wall_time_s": 24.0, "tail10_s": 6.4, "tokens_per_s": 80.0, "acceptance_length": 2.3, "reward_mean": -0.1}
    step = {"step": 0, "reward_mean": 0.1, "accuracy": 0.5, "format_rate": 1.0, "loss": 0.01234, "clip_frac": 0.0, "approx_kl": -0.00001,
            "updates": 4, "rollout_s": 10.0, "train_s": 5.0, "sync_s": 0.25}
    text = format_tables({"data": "dsr_sub", "train_method": "none", "methods": {"das": [it]}, "training": [step],
                          "summary": {"none": {**summary, "speedup_vs_none": 1.0}, "das": summary}})
    assert text.startswith("### dsr_sub (trained with `none`)")
    assert _cells(text, "das")[:12] == ["das", "0", "12.3", "3.2", "1000", "81", "2.35", "500", "300", "+0.250", "123", "0.25"]
    assert _cells(text, "none") == ["none", "24.0", "6.4", "80", "2.30", "-0.100", "1.00x", "-"]
    assert "identical in every method" not in text
    same = format_tables({"data": "dsr_sub", "train_method": "none", "methods": {"das": [it]}, "training": [step], "coupled_sampling": True,
                          "identical_rollouts": {"identical": 7, "rollouts": 8}, "summary": {"das": summary}})
    assert "Rollouts identical in every method: 7 of 8 (coupled sampling)." in same
    assert _cells(text, "0")[1:] == ["+0.100", "0.50", "1.00", "+0.0123", "0.000", "-0.00001", "4", "10.0", "5.0", "0.25"]
    assert "|:---" in text and "---:|" in text  # markdown: text left, numbers right


def test_grpo_step_table():
    from integrations.rl.grpo import format_steps

    rec = {"step": 3, "reward_mean": 0.5, "accuracy": 0.25, "format_rate": 1.0, "loss": -0.012345, "clip_frac": 0.01, "approx_kl": 0.00012,
           "rollout_s": 12.34, "tail10_s": 3.21, "tokens_per_s": 150.26, "acceptance_length": 2.345, "train_s": 5.55, "sync_s": 0.123}
    text = format_steps([rec])
    assert text.split("\n")[0].split() == ["step", "reward", "acc", "fmt", "loss", "clip", "kl", "roll_s", "tail_s", "tok/s", "acc_len",
                                           "train_s", "sync_s"]
    assert text.split("\n")[-1].split() == ["3", "0.500", "0.25", "1.00", "-0.01235", "0.010", "+0.00012", "12.3", "3.2", "150.3", "2.35",
                                            "5.5", "0.12"]
