"""AcceptanceCalibration: per-bin acceptance factors learned from verification outcomes."""

import numpy as np
import pytest

from scheduler.acceptance import AcceptanceCalibration
from scheduler.priced_budgets import choose_drafts


def _feed(cal, true_rate, steps=400, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        p = rng.uniform(0.0, 1.0, 32)
        cal.observe(p, rng.uniform(0.0, 1.0, 32) < true_rate(p))


def test_without_evidence_the_map_is_the_identity():
    cal = AcceptanceCalibration()
    p = np.array([0.95, 0.5, 0.05])
    assert np.allclose(cal(p), p)
    assert cal.table() == []


def test_learns_a_bin_dependent_acceptance_rate_that_one_factor_cannot_express():
    # High probabilities nearly right, low ones 2x too high (the shape the DSR-sub replay showed).
    cal = AcceptanceCalibration()
    _feed(cal, lambda p: np.where(p >= 0.9, 0.9 * p, 0.5 * p))
    got = cal(np.array([0.95, 0.45]))
    assert got[0] == pytest.approx(0.9 * 0.95, abs=0.04)
    assert got[1] == pytest.approx(0.5 * 0.45, abs=0.04)
    rows = {r["lo"]: r for r in cal.table()}
    assert rows[0.9]["observed"] == pytest.approx(0.9 * rows[0.9]["predicted"], abs=0.03)
    assert rows[0.4]["calibrated"] == pytest.approx(rows[0.4]["observed"], abs=0.03)


def test_calibrated_probabilities_never_rise_along_a_path():
    cal = AcceptanceCalibration()
    _feed(cal, lambda p: np.where((p > 0.3) & (p < 0.5), 0.95, 0.2 * p))  # a non-monotone truth
    path = np.linspace(1.0, 0.0, 50)
    assert np.all(np.diff(cal(path)) <= 1e-12)
    assert np.all((cal(path) >= 0.0) & (cal(path) <= 1.0))


def test_old_evidence_is_forgotten():
    cal = AcceptanceCalibration(forgetting=0.99)
    _feed(cal, lambda p: 0.1 * p, steps=300)
    _feed(cal, lambda p: p, steps=300, seed=1)  # the policy changed: drafts now right
    assert cal(np.array([0.75]))[0] == pytest.approx(0.75, abs=0.06)


def test_calibrated_prices_keep_confident_drafts_that_a_scalar_factor_drops():
    # 16 rows, plain step 0.1 s, a draft token 5 ms: a token pays when its probability > ~0.8 * 16 / 16.
    cal = AcceptanceCalibration()
    _feed(cal, lambda p: np.where(p >= 0.9, 0.95 * p, 0.3 * p))
    probs = [np.array([0.97, 0.4], np.float32)] * 16
    scalar = cal.global_factor()
    assert choose_drafts(probs, 0.1, 0.1, 0.005, scalar).sum() == 0
    kept = choose_drafts(probs, 0.1, 0.1, 0.005, 1.0, prob_map=cal)
    assert np.all(kept == 1)


@pytest.mark.parametrize("kw", [{"bins": 0}, {"forgetting": 0.0}, {"forgetting": 1.5}, {"prior_weight": 0.0}])
def test_bad_settings_name_the_argument(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        AcceptanceCalibration(**kw)


def test_mismatched_outcomes_are_rejected():
    with pytest.raises(ValueError, match="one length"):
        AcceptanceCalibration().observe(np.ones(3), np.ones(2, bool))
