"""The in-process A/B of the drafter's threading rules: both arms replay the same steps."""

from __future__ import annotations

import json

import pytest

import das.step_threads as thread_rules
from benchmarks.replay import load_trace
from benchmarks.step_ab import main, run_pair, set_arm
from das import DASDrafter
from tests.test_step_cost import _trace


@pytest.mark.parametrize("ab", ["owner", "threshold"])
def test_both_arms_take_the_same_steps_and_the_rules_are_restored(tmp_path, ab):
    before = (thread_rules.BALANCED_PARTS, thread_rules.PARALLEL_ROWS)
    arms = run_pair(load_trace(_trace(tmp_path)), ab, rows=16, repeats=2, max_steps=30, config={"draft_threads": 2})
    assert len(arms) == 2
    (a, sa), (b, sb) = arms.items()
    assert sa["steps"] == sb["steps"] > 0
    assert len(sa["run_p50_ms"]) == len(sb["run_p50_ms"]) == 2
    assert (thread_rules.BALANCED_PARTS, thread_rules.PARALLEL_ROWS) == before


def test_a_bad_pair_or_arm_names_the_choices():
    with pytest.raises(ValueError, match="ab must be one of"):
        run_pair([], "nope", rows=4, repeats=1)
    with pytest.raises(ValueError, match="arm must be one of"):
        set_arm("fast")


def test_report(tmp_path):
    out = tmp_path / "ab.json"
    assert main(["--ab", "owner", "--trace", str(_trace(tmp_path)), "--rows", "16", "--repeats", "2", "--threads", "2",
                 "--max-steps", "20", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["arms"]) == {"modulo", "balanced"} and report["rows"] == 16
    assert main(["--ab", "owner", "--trace", str(tmp_path / "missing.parquet")]) == 2


def test_the_settings_pair_runs_each_arm_with_its_own_settings(tmp_path, monkeypatch):
    """``settings``: arm a and arm b build their drafters from their own settings (here the
    global tree's depth), and the report names them."""
    made = []
    real = DASDrafter.__init__

    def spy(self, *args, **kwargs):
        made.append(kwargs.get("global_depth"))
        real(self, *args, **kwargs)

    monkeypatch.setattr(DASDrafter, "__init__", spy)
    settings = {"a": {"global_depth": 12}, "b": {"global_depth": 4}}
    arms = run_pair(load_trace(_trace(tmp_path)), "settings", rows=16, repeats=2, max_steps=20, settings=settings)
    assert set(arms) == {"a", "b"} and all(s["steps"] > 0 for s in arms.values())
    assert made == [12, 4, 4, 12]  # in turns: a b, then b a
    with pytest.raises(ValueError, match="settings .* go with the pair 'settings' only"):
        run_pair([], "settings", rows=4, repeats=1)
    with pytest.raises(ValueError, match="settings .* go with the pair 'settings' only"):
        run_pair([], "owner", rows=4, repeats=1, settings=settings)
    out = tmp_path / "ab.json"
    assert main(["--ab", "settings", "--a", '{"global_depth": 12}', "--b", "{}", "--trace", str(_trace(tmp_path)),
                 "--rows", "16", "--repeats", "2", "--max-steps", "20", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["settings"] == {"a": {"global_depth": 12}, "b": {}}
    for bad in (["--ab", "settings", "--a", "{}"], ["--ab", "settings", "--a", "{", "--b", "{}"],
                ["--ab", "settings", "--a", "[1]", "--b", "{}"], ["--ab", "owner", "--a", "{}"]):
        with pytest.raises(SystemExit):
            main(bad)
