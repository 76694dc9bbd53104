"""Placement (scheduler.placement): siblings together, the longest groups spread, the baselines."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.placement import ROLLOUT_ROUTES, StickyPlacement, assign_groups, predicted_group_work, route_rollouts
from scheduler.predictor import LengthPredictor

works = st.lists(st.floats(1e-3, 1e6, allow_nan=False), min_size=1, max_size=80)


def _loads(work, a, n):
    return np.bincount(a, weights=np.asarray(work, np.float64), minlength=n)


@settings(max_examples=200, deadline=None)
@given(work=works, n=st.integers(1, 12))
def test_lpt_puts_no_two_of_the_n_longest_groups_on_one_engine(work, n):
    a = assign_groups(work, n, "lpt")
    assert a.shape == (len(work),) and a.dtype == np.int64 and a.min() >= 0 and a.max() < n
    top = np.argsort(-np.asarray(work), kind="stable")[: min(n, len(work))]
    assert len(set(a[top].tolist())) == top.size


@settings(max_examples=200, deadline=None)
@given(work=works, n=st.integers(1, 12))
def test_lpt_makespan_is_within_the_list_scheduling_bound(work, n):
    """Any list schedule ends by sum / N + max (Graham 1966); LPT also never loses to round-robin by more than that."""
    w = np.asarray(work)
    lpt = _loads(w, assign_groups(w, n, "lpt"), n).max()
    assert lpt <= w.sum() / n + w.max() * (1 - 1 / n) + 1e-6 * w.sum()
    assert lpt >= max(w.max(), w.sum() / n) - 1e-6 * w.sum()


def test_lpt_balances_a_skewed_instance_better_than_round_robin():
    # 8 huge groups sit at positions that round-robin sends to the same 2 workers
    work = np.ones(64)
    work[[0, 4, 8, 12, 16, 20, 24, 28]] = 40.0
    rr = _loads(work, assign_groups(work, 4, "round_robin"), 4)
    lpt = _loads(work, assign_groups(work, 4, "lpt"), 4)
    assert rr.max() / rr.mean() > 2.0
    assert lpt.max() / lpt.mean() < 1.05


@settings(max_examples=100, deadline=None)
@given(work=works, n=st.integers(1, 8), busy=st.lists(st.floats(0, 1e6), min_size=8, max_size=8))
def test_lpt_on_top_of_current_loads_fills_the_idle_engines_first(work, n, busy):
    loads = np.asarray(busy[:n])
    a = assign_groups(work, n, "lpt", loads=loads)
    w = np.asarray(work)
    # the longest group goes to the engine with the least work
    assert a[int(np.argmax(w))] == int(np.argmin(loads)) or loads[a[int(np.argmax(w))]] == loads.min()
    total = loads + _loads(w, a, n)
    assert total.max() <= max(loads.max(), (loads.sum() + w.sum()) / n + w.max()) + 1e-6 * (loads.sum() + w.sum())


def test_siblings_stay_together_and_every_group_is_assigned():
    rng = np.random.default_rng(0)
    work = rng.pareto(1.2, 128) * 1000
    for method in ("lpt", "round_robin", "random"):
        a = assign_groups(work, 8, method, seed=1)
        assert a.shape == (128,) and a.dtype == np.int64 and set(a.tolist()) <= set(range(8))
    rnd = assign_groups(work, 8, "random", seed=3)
    assert np.all(np.bincount(rnd, minlength=8) == 16)


def test_long_requests_are_spread_when_work_ties():
    work = np.full(8, 10.0)
    n_long = np.array([4, 4, 4, 4, 0, 0, 0, 0])
    a = assign_groups(work, 4, "lpt", n_long=n_long)
    assert np.bincount(a, weights=n_long, minlength=4).tolist() == [4, 4, 4, 4]


def test_predicted_group_work_follows_the_history():
    pred = LengthPredictor(1000)
    rng = np.random.default_rng(0)
    for v in range(3):
        pred.observe("long", v, rng.integers(800, 1000, 8))
        pred.observe("short", v, rng.integers(10, 50, 8))
    work, n_long = predicted_group_work(pred, ["short", "long", "new"], np.array([8, 8, 4]))
    assert work[1] > 10 * work[0] and n_long[1] > n_long[0] == 0 and n_long[2] == 0
    same, _ = predicted_group_work(pred, ["short", "long", "new"], 8)
    assert same[:2] == pytest.approx(work[:2]) and same[2] == pytest.approx(2 * work[2])
    with pytest.raises(ValueError, match="group_size"):
        predicted_group_work(pred, ["short"], 0)


def test_sticky_keeps_a_problem_on_its_engine_and_places_new_ones_by_load():
    s = StickyPlacement(3)
    first = s.place(["a", "b", "c"], [30.0, 20.0, 10.0])
    assert sorted(first.tolist()) == [0, 1, 2]
    again = s.place(["c", "a", "d", "b", "e"], [10.0, 30.0, 15.0, 20.0, 1.0])
    assert again[[1, 3, 0]].tolist() == first.tolist()
    # new problems by LPT on top of the known ones' work [30, 20, 10]: d to c's engine (25), then e to b's (20)
    assert again[2] == first[2] and again[4] == first[1]
    assert s.place(["d"], [1e9]).tolist() == [again[2]]


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 9), max_size=30), n=st.integers(1, 10), seed=st.integers(0, 5))
def test_rollout_routes_cover_every_rollout_and_balance_counts(sizes, n, seed):
    total = sum(sizes)
    for method in ROLLOUT_ROUTES:
        a = route_rollouts(np.array(sizes, np.int64), n, method, seed=seed)
        assert a.shape == (total,) and a.dtype == np.int64
        if total:
            assert a.min() >= 0 and a.max() < n
            c = np.bincount(a, minlength=n)
            assert c.max() - c.min() <= 1
    assert np.array_equal(route_rollouts(np.array(sizes, np.int64), n, "least_loaded", seed=seed),
                          route_rollouts(np.array(sizes, np.int64), n, "least_loaded", seed=seed))


def test_interleaved_deals_the_siblings_and_contiguous_keeps_them_when_n_divides_g():
    a = route_rollouts(np.full(4, 4), 2, "interleaved")
    assert a.reshape(4, 4).tolist() == [[0, 1, 0, 1]] * 4
    c = route_rollouts(np.full(4, 4), 2, "contiguous").reshape(4, 4)
    assert np.all(c == c[:, :1]) and c[:, 0].tolist() == [0, 0, 1, 1]


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError, match="n_workers"):
        assign_groups([1.0], 0)
    with pytest.raises(ValueError, match="method"):
        assign_groups([1.0], 2, "fastest")
    with pytest.raises(ValueError, match="work"):
        assign_groups([-1.0], 2)
    with pytest.raises(ValueError, match="n_long"):
        assign_groups([1.0, 2.0], 2, n_long=[1])
    with pytest.raises(ValueError, match="loads"):
        assign_groups([1.0], 2, loads=[1.0])
    with pytest.raises(ValueError, match="group_sizes"):
        route_rollouts([-1], 2)
    with pytest.raises(ValueError, match="method"):
        route_rollouts([2], 2, "nearest")
    with pytest.raises(ValueError, match="work"):
        StickyPlacement(2).place(["a", "b"], [1.0])
