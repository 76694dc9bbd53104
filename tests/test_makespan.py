"""The makespan value of an accepted draft token: who finishes last, and the saving rule that uses it."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.priced_budgets import choose_drafts, drafting_can_pay, last_finish_probability, token_values


def test_rows_the_model_cannot_tell_apart_share_equally():
    assert last_finish_probability([300.0] * 4, [1000.0] * 4) == pytest.approx([0.25] * 4)
    # all certain to reach the cap: a four-way tie
    assert last_finish_probability([5000.0] * 4, [100.0] * 4) == pytest.approx([0.25] * 4)
    assert last_finish_probability([10.0], [20.0]).tolist() == [1.0]
    assert last_finish_probability([], []).shape == (0,)


def test_two_exponentials_match_the_closed_form():
    # P(X_b > X_a) for independent exponentials with means a, b is b / (a + b)
    q = last_finish_probability([300.0, 600.0], [1e6, 1e6], grid=4096)
    assert q == pytest.approx([1 / 3, 2 / 3], abs=0.01)


def test_longer_predictions_and_more_room_finish_last_more_often():
    q = last_finish_probability([200.0] * 31 + [600.0], [900.0] * 32)
    assert q.sum() == pytest.approx(1.0)
    assert q[-1] > 5 * q[0]
    assert np.allclose(q[:-1], q[0])
    # the same mean, but one row is nearly at its cap: it cannot be the last
    q = last_finish_probability([300.0, 300.0], [5.0, 900.0])
    assert q[1] > 0.95


def test_many_rows_do_not_underflow():
    rng = np.random.default_rng(0)
    q = last_finish_probability(rng.uniform(50, 600, 1024), np.full(1024, 700.0))
    assert np.all(np.isfinite(q)) and q.sum() == pytest.approx(1.0) and q.min() >= 0


@pytest.mark.parametrize("bad", [([0.0], [10.0]), ([1.0], [-1.0]), ([np.nan], [1.0]), ([1.0, 2.0], [1.0])])
def test_bad_lengths_are_named(bad):
    with pytest.raises(ValueError, match="expected_remaining"):
        last_finish_probability(*bad)


def test_token_values_add_the_fixed_cost_share():
    assert token_values([0.0, 0.5, 1.0], c_base=0.06, c_row=0.004) == pytest.approx([0.004, 0.034, 0.064])
    with pytest.raises(ValueError, match="c_base"):
        token_values([1.0], c_base=-1.0, c_row=0.0)


def _saving(probs, values, keep, per_draft, extra):
    got = sum(float(np.sum(p[:k])) * v for p, v, k in zip(probs, values, keep))
    return got - per_draft * sum(keep) - (extra if sum(keep) else 0.0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.floats(0.0, 1.0), max_size=3), min_size=1, max_size=3), st.data(), st.floats(0.0, 0.01), st.floats(0.001, 0.01))
def test_value_rule_keeps_the_best_prefixes(rows, data, extra, per_draft):
    probs = [np.sort(np.array(r, np.float64))[::-1].cumprod() for r in rows]
    values = np.array(data.draw(st.lists(st.floats(0.0, 0.05), min_size=len(probs), max_size=len(probs))))
    plain = 0.1
    keep = choose_drafts(probs, plain, plain + extra, per_draft, values=values)
    best = max(_saving(probs, values, k, per_draft, extra) for k in itertools.product(*[range(len(p) + 1) for p in probs]))
    assert _saving(probs, values, keep, per_draft, extra) == pytest.approx(max(best, 0.0))


def test_the_row_that_finishes_last_drafts_where_the_others_do_not():
    probs = [np.array([0.5, 0.3, 0.2])] * 32
    q = last_finish_probability([200.0] * 31 + [800.0], [1000.0] * 32)
    keep = choose_drafts(probs, 0.2, 0.2, 0.004, values=token_values(q, c_base=0.07, c_row=0.004))
    assert keep[-1] == 3 and keep[:-1].sum() == 0
    # the throughput rule shares c_base evenly: nobody's 0.5 pays at 32 rows
    assert choose_drafts(probs, 0.2, 0.2, 0.004).sum() == 0
    assert drafting_can_pay(32, 96, 0.2, 0.2, 0.004, 0.5, best_value=0.07 * q.max() + 0.004)
    assert not drafting_can_pay(32, 96, 0.2, 0.2, 0.004, 0.5, best_value=0.004)


def test_value_rule_checks_its_values():
    with pytest.raises(ValueError, match="values"):
        choose_drafts([np.array([0.5])], 0.1, 0.1, 0.01, values=np.array([0.1, 0.2]))
