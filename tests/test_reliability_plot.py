"""benchmarks.reliability: reliability diagrams from replay and das-rollout reports."""

import json

import pytest

from benchmarks import reliability

REPLAY = {"drafters": {"das": {"calibration": [
    {"bin": "[0.2,0.3)", "drafted": 100, "mean_prob": 0.25, "accepted_rate": 0.14, "calibrated_prob": 0.15},
    {"bin": "[0.9,1.0)", "drafted": 900, "mean_prob": 0.95, "accepted_rate": 0.83, "calibrated_prob": 0.82}]}}}
ROLLOUT = {"methods": {"das": {"iterations": [{"proposer": {"reliability": [
    {"lo": 0.9, "hi": 1.0, "trials": 50.0, "predicted": 0.95, "observed": 0.8, "calibrated": 0.8}]}}]}}}


def test_series_come_from_both_report_kinds():
    raw, cal = reliability.replay_points(REPLAY)
    assert raw[1:3] == ([0.25, 0.95], [0.14, 0.83])
    assert cal[1] == [0.15, 0.82]
    eng_raw, eng_cal = reliability.rollout_points(ROLLOUT)
    assert eng_raw[1:3] == ([0.95], [0.8]) and eng_cal[1] == [0.8]
    assert reliability.rollout_points({"methods": {"none": {}}}) == []


def test_writes_a_png(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps(REPLAY))
    (tmp_path / "o.json").write_text(json.dumps(ROLLOUT))
    out = tmp_path / "rel.png"
    assert reliability.main(["--replay", str(tmp_path / "r.json"), "--rollout", str(tmp_path / "o.json"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_report_without_bins_is_an_error_that_names_it(tmp_path, capsys):
    (tmp_path / "none.json").write_text(json.dumps({"methods": {}}))
    with pytest.raises(SystemExit) as exc:
        reliability.main(["--rollout", str(tmp_path / "none.json"), "--out", str(tmp_path / "x.png")])
    assert exc.value.code == 2
    assert "none.json" in capsys.readouterr().err
