"""LengthPredictor: cold start, classes, run-time update, window, evaluation against baselines."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler.predictor import LONG, SHORT, LengthPredictor, classify, confusion_matrix, evaluate_predictor

MAX = 16384


def test_cold_start_without_any_history():
    p = LengthPredictor(MAX)
    assert p.bounds == (MAX / 4, MAX / 2)  # documented cold bounds
    idx = p.index(["never-seen"])
    assert idx.tolist() == [-1]
    pr = p.predict(idx, np.array([0.0]))
    # no history: E[L | L >= x] of a uniform length on [0, max]
    assert pr.expected_total[0] == pytest.approx(MAX / 2)
    assert pr.expected_remaining[0] == pytest.approx(MAX / 2)
    later = p.predict(idx, np.array([12000.0]))
    assert later.cls[0] == LONG and later.expected_total[0] > 12000


def test_unseen_problem_uses_the_global_prior():
    p = LengthPredictor(MAX, bounds=(1000, 5000))
    rng = np.random.default_rng(0)
    for i in range(40):  # mostly short problems
        p.observe(f"s{i}", 1, rng.integers(100, 900, 8))
    for i in range(5):
        p.observe(f"l{i}", 1, rng.integers(6000, 9000, 8))
    idx = p.index(["new", "s0", "l0"])
    assert p.initial_class(idx).tolist() == [SHORT, SHORT, LONG]
    pr = p.predict(idx, np.zeros(3))
    glob = np.concatenate([p.history_lengths(f"s{i}") for i in range(40)] + [p.history_lengths(f"l{i}") for i in range(5)])
    assert pr.expected_total[0] == pytest.approx(glob.mean(), rel=0.01)
    assert pr.expected_total[2] > 6000 > pr.expected_total[1]


def test_initial_class_is_the_majority_and_runtime_update_uses_survival():
    p = LengthPredictor(MAX, bounds=(1000, 5000))
    # 20 "short" problems: 70% of rollouts 100 tokens, 30% run to 10,000 (Long).
    for i in range(20):
        p.observe(f"q{i}", 3, [100] * 7 + [10000] * 3)
    idx = p.index(["q0"])
    assert p.initial_class(idx)[0] == SHORT
    assert p.predict(idx, np.array([0])).cls[0] == SHORT
    # after 500 tokens (still inside Short) only the 10,000-token rollouts survive: Long
    pr = p.predict(idx, np.array([500]))
    assert pr.cls[0] == LONG
    assert pr.expected_total[0] == pytest.approx(10000, rel=0.01)
    assert pr.median_total[0] == pytest.approx(10000, rel=0.01)
    # the class never falls below the class of the length already generated
    assert p.predict(idx, np.array([5200])).cls[0] == LONG


def test_expected_length_is_consistent_and_batch_shaped():
    rng = np.random.default_rng(1)
    p = LengthPredictor(MAX)
    for i in range(30):
        mu = rng.normal(np.log(3000), 0.6)
        for v in range(3):
            p.observe(i, v, np.minimum(MAX, rng.lognormal(mu, 0.4, 16)).astype(int))
    b1, b2 = p.bounds
    assert 0 < b1 < b2 < MAX  # tertiles of the history
    all_l = np.concatenate([p.history_lengths(i) for i in range(30)])
    assert np.mean(all_l < b1) == pytest.approx(1 / 3, abs=0.02)
    idx = np.repeat(p.index(list(range(30))), 5)
    g = np.tile([0, 1000, 4000, 9000, 16000], 30).astype(float)
    pr = p.predict(idx, g)
    assert pr.cls.dtype == np.int8 and pr.cls.shape == g.shape
    assert np.all(pr.expected_total >= np.minimum(g + 1, MAX)) and np.all(pr.expected_total <= MAX)
    assert np.allclose(pr.expected_remaining, pr.expected_total - g)
    # expected total grows with the length so far for each problem
    tot = pr.expected_total.reshape(30, 5)
    assert np.all(np.diff(tot, axis=1) >= -1e-9)


def test_window_drops_old_versions():
    p = LengthPredictor(MAX, window=2, bounds=(1000, 5000))
    p.observe("a", 1, [100, 100])
    p.observe("a", 2, [200])
    p.observe("a", 3, [8000])
    assert sorted(p.history_lengths("a").tolist()) == [200, 8000]


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError, match="max_tokens"):
        LengthPredictor(0)
    with pytest.raises(ValueError, match="bounds"):
        LengthPredictor(100, bounds=(50, 20))
    p = LengthPredictor(100)
    with pytest.raises(ValueError, match="lengths"):
        p.observe("a", 0, [101])
    with pytest.raises(ValueError, match="generated"):
        p.predict(np.array([-1]), np.array([-5.0]))
    with pytest.raises(ValueError, match="shape"):
        p.predict(np.array([-1, -1]), np.array([1.0]))
    with pytest.raises(ValueError, match="out of range"):
        p.predict(np.array([3]), np.array([1.0]))


def test_classify_and_confusion():
    assert classify([0, 999, 1000, 4999, 5000], (1000, 5000)).tolist() == [0, 0, 1, 1, 2]
    cm = confusion_matrix([0, 1, 2, 2], [0, 2, 2, 1])
    assert cm.tolist() == [[1, 0, 0], [0, 0, 1], [0, 1, 1]]


def test_evaluation_beats_the_global_mean_on_problem_structured_lengths():
    rng = np.random.default_rng(2)
    pids, vers, lens = [], [], []
    mus = rng.normal(np.log(3000), 0.8, 60)
    for v in range(4):
        for i, mu in enumerate(mus):
            x = np.minimum(MAX, rng.lognormal(mu, 0.3, 8)).astype(int)
            pids += [f"p{i}"] * 8
            vers += [v] * 8
            lens += x.tolist()
    out = evaluate_predictor(pids, vers, lens, MAX, checkpoints=(0.0, 0.25))
    c0 = out["checkpoints"]["0"]
    assert c0["predictor"]["n"] == 3 * 60 * 8
    assert c0["predictor"]["mae"] < 0.6 * c0["global_mean"]["mae"]
    assert c0["predictor_median"]["mae"] <= c0["last_iteration"]["mae"] * 1.1
    cm = np.array(out["confusion"]["initial"])
    assert cm.shape == (3, 3) and cm.sum() == 3 * 60 * 8
    assert out["class_accuracy"]["initial"] > 0.6
    assert set(out["checkpoints"]) == {"0", "4096"}
    with pytest.raises(ValueError, match="2 policy versions"):
        evaluate_predictor(["a"], [0], [10], MAX)


def test_resized_keeps_settings_and_history_and_refuses_to_shrink():
    p = LengthPredictor(256, window=4, min_history=5, n_bins=64)
    p.observe("a", 0, [10, 200])
    p.observe("b", 1, [256])
    q = p.resized(1024)
    assert (q.max_tokens, q.window, q.min_history, q.n_bins) == (1024, 4, 5, 64)
    assert q.cold_bounds == (256.0, 512.0)  # the same fractions of the new size
    assert sorted(q.history_lengths("a").tolist()) == [10, 200] and q.history_lengths("b").tolist() == [256]
    assert q.index(["a", "b"]).tolist() == p.index(["a", "b"]).tolist()
    with pytest.raises(ValueError, match="max_tokens"):
        p.resized(128)
