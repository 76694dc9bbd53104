"""Group-to-worker assignment: siblings together, LPT balances better than round-robin."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler.placement import assign_groups, compare_assignments, worker_loads


def test_lpt_balances_a_skewed_instance_better_than_round_robin():
    # 8 huge groups sit at positions that round-robin sends to the same 2 workers
    work = np.ones(64)
    work[[0, 4, 8, 12, 16, 20, 24, 28]] = 40.0
    for_rr = worker_loads(work, assign_groups(work, 4, "round_robin"), 4)
    lpt = worker_loads(work, assign_groups(work, 4, "lpt"), 4)
    assert for_rr.max() / for_rr.mean() > 2.0
    assert lpt.max() / lpt.mean() < 1.05
    # LPT bound (Graham): <= (4/3 - 1/(3N)) x the optimum, which is >= max(max w, sum / N)
    opt_lb = max(work.max(), work.sum() / 4)
    assert lpt.max() <= (4 / 3 - 1 / 12) * opt_lb + 1e-9


def test_siblings_stay_together_and_every_group_is_assigned():
    rng = np.random.default_rng(0)
    work = rng.pareto(1.2, 128) * 1000
    for method in ("lpt", "round_robin", "random"):
        a = assign_groups(work, 8, method, seed=1)
        assert a.shape == (128,) and a.dtype == np.int64 and set(a.tolist()) <= set(range(8))
        # one worker per group: expanding to 16 samples keeps each group's siblings on it
        per_request = np.repeat(a, 16).reshape(128, 16)
        assert np.all(per_request == per_request[:, :1])
    rnd = assign_groups(work, 8, "random", seed=3)
    assert np.all(np.bincount(rnd, minlength=8) == 16)


def test_long_requests_are_spread_when_work_ties():
    work = np.full(8, 10.0)
    n_long = np.array([4, 4, 4, 4, 0, 0, 0, 0])
    a = assign_groups(work, 4, "lpt", n_long=n_long)
    longs = np.bincount(a, weights=n_long, minlength=4)
    assert longs.tolist() == [4, 4, 4, 4]


def test_compare_assignments_reports_each_method():
    rng = np.random.default_rng(1)
    true = rng.lognormal(8, 1.0, 128)
    pred = true * rng.lognormal(0, 0.3, 128)
    out = compare_assignments(pred, true, 8, true_long=rng.integers(0, 5, 128))
    assert set(out) == {"lpt", "round_robin", "random"}
    assert out["lpt"]["imbalance"] < out["round_robin"]["imbalance"]
    assert all(v["imbalance"] >= 1.0 for v in out.values())


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError, match="n_workers"):
        assign_groups([1.0], 0)
    with pytest.raises(ValueError, match="method"):
        assign_groups([1.0], 2, "fastest")
    with pytest.raises(ValueError, match="work"):
        assign_groups([-1.0], 2)
    with pytest.raises(ValueError, match="n_long"):
        assign_groups([1.0, 2.0], 2, n_long=[1])
