"""Priced budgets' draft selection and makespan values (scheduler.priced_budgets), as hypothesis properties and cases."""


import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.acceptance import AcceptanceCalibration
from scheduler.priced_budgets import choose_drafts, drafting_can_pay, keep_bounds, last_finish_probability, raw_cutoffs, token_values

SEEDS = st.integers(0, 2**32 - 1)


def brute_force_best(path_probs, c_base, c_tok):
    """Try every per-row prefix combination (small cases) and return the best expected rate."""
    rows = len(path_probs)
    best = rows / (c_base + c_tok * rows)
    for keep in itertools.product(*[range(len(p) + 1) for p in path_probs]):
        gain = rows + sum(float(np.sum(p[:k])) for p, k in zip(path_probs, keep))
        best = max(best, gain / (c_base + c_tok * (rows + sum(keep))))
    return best


def on_a_line(path_probs, c_base, c_tok):
    """:func:`choose_drafts` under one line ``t = c_base + c_tok * tokens`` for both regimes (DAS Eq. 1)."""
    plain = c_base + c_tok * len(path_probs)
    return choose_drafts(path_probs, plain, plain, c_tok)


@st.composite
def small_rows(draw):
    """1-3 rows of 0-3 non-increasing path probabilities each."""
    rows = draw(st.integers(1, 3))
    out = []
    for _ in range(rows):
        p = draw(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=3))
        out.append(np.cumprod(np.sort(np.array(p, np.float64))[::-1]))
    return out


@settings(max_examples=100, deadline=None)
@given(small_rows(), st.floats(0.001, 0.05), st.floats(0.0001, 0.01))
def test_selection_is_optimal_among_all_prefix_choices(probs, c_base, c_tok):
    keep = on_a_line(probs, c_base, c_tok)
    rows = len(probs)
    rate = (rows + sum(float(np.sum(p[:k])) for p, k in zip(probs, keep))) / (c_base + c_tok * (rows + keep.sum()))
    assert rate == pytest.approx(brute_force_best(probs, c_base, c_tok))


@settings(max_examples=100, deadline=None)
@given(small_rows(), st.floats(0.005, 0.05), st.floats(0.0, 0.01), st.floats(0.0001, 0.01), st.floats(0.0, 4.0))
def test_a_free_region_below_a_knee_keeps_the_best_prefixes_at_that_price(probs, plain, extra, per_draft, free):
    """With ``free_drafts`` (a step flat below a knee) the selection still maximises the rate
    ``(B + sum p) / (spec + per_draft * max(m - free, 0))`` over every prefix choice."""
    def rate(keep):
        m = sum(keep)
        if m == 0:
            return len(probs) / plain
        return (len(probs) + sum(float(np.sum(p[:k])) for p, k in zip(probs, keep))) / (plain + extra + per_draft * max(m - free, 0.0))

    keep = choose_drafts(probs, plain, plain + extra, per_draft, free_drafts=free)
    best = max(rate(k) for k in itertools.product(*[range(len(p) + 1) for p in probs]))
    assert rate(keep.tolist()) == pytest.approx(best)


def test_large_batches_draft_less_than_small_ones():
    probs = np.array([0.9, 0.7, 0.5, 0.3])
    small = on_a_line([probs] * 2, c_base=0.02, c_tok=0.0005)
    large = on_a_line([probs] * 256, c_base=0.02, c_tok=0.0005)
    assert small.sum() / 2 > large.sum() / 256
    assert on_a_line([np.empty(0)] * 3, 0.01, 0.001).tolist() == [0, 0, 0]


def test_bad_costs_are_named():
    with pytest.raises(ValueError, match="plain_s"):
        choose_drafts([np.ones(1)], 0.0, 0.1, 0.1)
    with pytest.raises(ValueError, match="per_draft_s"):
        choose_drafts([np.ones(1)], 0.1, 0.1, -1.0)
    with pytest.raises(ValueError, match="free_drafts"):
        choose_drafts([np.ones(1)], 0.1, 0.1, 0.01, free_drafts=-1.0)


@settings(max_examples=50, deadline=None)
@given(SEEDS)
def test_a_draft_matrix_chooses_what_the_per_row_list_chooses(seed):
    """The batched proposer hands the drafter's ``[rows, K]`` output with its lengths (no per-row
    arrays); both forms keep the same tokens, for the throughput and the saving rule."""
    rng = np.random.default_rng(seed)
    rows, k = 40, 8
    lengths = rng.integers(0, k + 1, rows)
    lengths[rng.integers(0, rows, 5)] = 0
    matrix = np.full((rows, k), 7.0, np.float32)  # beyond a row's length: junk that must be ignored
    per_row = []
    for r in range(rows):
        p = np.cumprod(rng.uniform(0.3, 1.0, lengths[r])).astype(np.float32)
        matrix[r, : lengths[r]] = p
        per_row.append(p)
    cal = rng.uniform(0.5, 1.5, rows)
    values = rng.uniform(0.0, 0.05, rows)
    for kw in ({}, {"values": values}):
        want = choose_drafts(per_row, 0.05, 0.051, 0.0002, cal, **kw)
        got = choose_drafts(matrix, 0.05, 0.051, 0.0002, cal, lengths=lengths, **kw)
        assert got.dtype == np.int64 and got.tolist() == want.tolist()
        assert np.all(got <= lengths)
    with pytest.raises(ValueError, match="lengths"):
        choose_drafts(matrix, 0.05, 0.052, 0.001, lengths=lengths + k)


def _step_of_seed(seed: int):
    """A step's drafts as the drafter returns them (float64 path probabilities, non-increasing
    per row) and the proposer's inputs to the selection: prices (a speculative step dearer or
    cheaper than a plain one), per-row calibration, a learned calibration curve and, half the
    time, per-row values (the saving rule)."""
    rng = np.random.default_rng(seed)
    rows, k = int(rng.integers(1, 48)), int(rng.integers(1, 17))
    lengths = rng.integers(0, k + 1, rows)
    p64 = np.zeros((rows, k))
    for r in range(rows):
        p64[r, : lengths[r]] = np.cumprod(rng.uniform(0.2, 0.998, lengths[r]))
    plain = rng.uniform(0.005, 0.05)
    prices = (plain, plain * rng.uniform(0.7, 1.5), plain / rows * rng.uniform(0.0, 3.0))
    cal = rng.uniform(0.3, 1.6, rows)
    acc = AcceptanceCalibration()
    seen = rng.uniform(0, 1, 400)
    acc.observe(seen, rng.uniform(0, 1, 400) < seen * rng.uniform(0.5, 1.5))
    values = rng.uniform(0.0, plain / rows * 4, rows) if rng.uniform() < 0.5 else None
    return p64, lengths, prices, cal, acc, values


STEPS = SEEDS.map(_step_of_seed)


def _drafted_down_to(p64, lengths, cuts):
    """The drafter's stop rule: each row keeps its tokens at or above its cutoff."""
    cuts = np.broadcast_to(np.asarray(cuts, np.float64), lengths.shape)
    return np.array([int(np.sum(p64[r, : lengths[r]] >= cuts[r])) for r in range(lengths.shape[0])])


def test_the_random_steps_cut_drafts_that_the_selection_keeps_some_of():
    """The equality properties mean something only where the cut drops tokens from steps that
    keep some: most random steps are of that kind."""
    both = 0
    for seed in range(300):
        p64, lengths, prices, cal, acc, values = _step_of_seed(seed)
        cuts = raw_cutoffs(keep_bounds(lengths.shape[0], *prices, values), cal, acc.curve())
        short = _drafted_down_to(p64, lengths, cuts)
        kept = choose_drafts(p64.astype(np.float32), *prices, cal, prob_map=acc, values=values, lengths=lengths)
        both += bool(short.sum() < lengths.sum() and kept.sum() > 0)
    assert both >= 75


@settings(max_examples=300, deadline=None)
@given(STEPS)
def test_drafts_cut_per_row_keep_the_same_tokens(step):
    """Each row cut at its own :func:`raw_cutoffs` (its own calibration factor; under the saving
    rule its own value too) loses only tokens that the selection would have thrown away: the step
    keeps the same tokens, on every rule, with speculative steps cheaper or dearer than plain
    ones, and the drafts handed over as float32."""
    p64, lengths, prices, cal, acc, values = step
    rows = lengths.shape[0]
    cuts = raw_cutoffs(keep_bounds(rows, *prices, values), cal, acc.curve())
    assert cuts.shape == (rows,) and np.all((cuts >= 0) & (cuts <= 1))
    short = _drafted_down_to(p64, lengths, cuts)
    p32 = p64.astype(np.float32)
    full = choose_drafts(p32, *prices, cal, prob_map=acc, values=values, lengths=lengths)
    assert choose_drafts(p32, *prices, cal, prob_map=acc, values=values, lengths=short).tolist() == full.tolist()


def test_raw_cutoffs_invert_the_calibration_row_by_row():
    acc = AcceptanceCalibration()
    acc.observe(np.linspace(0.05, 0.95, 200), np.arange(200) % 3 != 0)
    cal = np.array([0.5, 1.0, 2.0, 0.0])
    cuts = raw_cutoffs(0.3, cal, acc.curve())
    assert cuts[0] > cuts[1] > cuts[2] and cuts[3] == 1.0  # a row that calibrates lower is cut higher; a zero factor: all
    for c, x in zip(cal[:3], cuts[:3]):
        assert acc(np.array([x]))[0] * c == pytest.approx(0.3, rel=1e-4)  # just below theta once calibrated
    assert raw_cutoffs(np.array([0.0, 1.0, np.inf]), 1.0, acc.curve()).tolist() == [0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="theta"):
        raw_cutoffs(-0.1, cal)


@settings(max_examples=100, deadline=None)
@given(SEEDS, st.floats(0.005, 0.05), st.floats(0.0, 0.01), st.floats(0.0, 0.01), st.booleans())
def test_row_weights_for_free_drafts_change_nothing_at_a_linear_price(seed, plain, extra, per_draft, saving):
    """Without a knee (``free_drafts`` 0) the free drafts' row weights leave every decision of
    both rules (throughput, saving) exactly as without them."""
    rng = np.random.default_rng(seed)
    rows, k = int(rng.integers(1, 40)), int(rng.integers(1, 17))
    probs = np.sort(rng.random((rows, k)), axis=1)[:, ::-1].astype(np.float32)
    lengths = rng.integers(0, k + 1, rows)
    values = rng.random(rows) * 0.02 if saving else None
    weights = rng.random(rows)
    args = (probs, plain, plain + extra, per_draft)
    base = choose_drafts(*args, values=values, lengths=lengths)
    assert choose_drafts(*args, values=values, lengths=lengths, free_weights=weights).tolist() == base.tolist()


def test_free_drafts_go_to_the_heaviest_rows_first_and_the_price_decides_above_the_knee():
    probs = np.array([[0.9, 0.9, 0.9, 0.9], [0.6, 0.6, 0.6, 0.6]])
    lengths = np.array([4, 4])
    weights = np.array([0.1, 1.0])  # row 1 is predicted to finish last
    kept = choose_drafts(probs, 0.01, 0.01, 1.0, lengths=lengths, free_drafts=4, free_weights=weights)
    assert kept.tolist() == [0, 4]  # the 4 free tokens to row 1 though row 0's are likelier; above: too dear
    assert choose_drafts(probs, 0.01, 0.01, 1.0, lengths=lengths, free_drafts=4).tolist() == [4, 0]  # by probability alone
    cheap = choose_drafts(probs, 0.01, 0.01, 1e-6, lengths=lengths, free_drafts=4, free_weights=weights)
    assert cheap.tolist() == [4, 4]  # above the knee the price keeps the rest
    with pytest.raises(ValueError, match="free_weights"):
        choose_drafts(probs, 0.01, 0.01, 1.0, lengths=lengths, free_drafts=4, free_weights=np.array([1.0, -1.0]))


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
