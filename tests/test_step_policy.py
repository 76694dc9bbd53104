"""Per-step draft selection under the linear step-cost model."""

import numpy as np
import pytest

from scheduler.step_policy import select_drafts


def brute_force_best(path_probs, c_base, c_tok):
    """Try every per-row prefix combination (small cases) and return the best expected rate."""
    import itertools

    rows = len(path_probs)
    best = rows / (c_base + c_tok * rows)
    for keep in itertools.product(*[range(len(p) + 1) for p in path_probs]):
        gain = rows + sum(float(np.sum(p[:k])) for p, k in zip(path_probs, keep))
        best = max(best, gain / (c_base + c_tok * (rows + sum(keep))))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_selection_is_optimal_among_all_prefix_choices(seed):
    rng = np.random.default_rng(seed)
    probs = [np.sort(rng.uniform(0, 1, rng.integers(0, 4)))[::-1].cumprod() for _ in range(rng.integers(1, 4))]
    c_base, c_tok = rng.uniform(0.001, 0.05), rng.uniform(0.0001, 0.01)
    keep = select_drafts(probs, c_base, c_tok)
    rows = len(probs)
    rate = (rows + sum(float(np.sum(p[:k])) for p, k in zip(probs, keep))) / (c_base + c_tok * (rows + keep.sum()))
    assert rate == pytest.approx(brute_force_best(probs, c_base, c_tok))


def test_large_batches_draft_less_than_small_ones():
    probs = np.array([0.9, 0.7, 0.5, 0.3])
    small = select_drafts([probs] * 2, c_base=0.02, c_tok=0.0005)
    large = select_drafts([probs] * 256, c_base=0.02, c_tok=0.0005)
    assert small.sum() / 2 > large.sum() / 256
    assert select_drafts([np.empty(0)] * 3, 0.01, 0.001).tolist() == [0, 0, 0]


def test_bad_costs_are_named():
    with pytest.raises(ValueError, match="c_base"):
        select_drafts([np.ones(1)], 0.0, 0.1)
    with pytest.raises(ValueError, match="c_tok"):
        select_drafts([np.ones(1)], 0.1, -1.0)



@pytest.mark.parametrize("seed", range(40))
def test_break_even_cutoff_keeps_every_draft_choose_drafts_keeps(seed):
    """Drafts cut at ``break_even_prob`` give ``choose_drafts`` the same choice as uncut drafts
    (every kept token lies above the cutoff), for plain and speculative steps priced apart, a
    learned calibration map and per-row factors; few rows give a lower cutoff than many."""
    from scheduler.calibration import AcceptanceCalibration
    from scheduler.step_policy import break_even_prob, choose_drafts

    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 40))
    probs = [np.sort(rng.uniform(0, 1, rng.integers(0, 12)))[::-1].cumprod() for _ in range(rows)]
    plain = rng.uniform(0.02, 0.2)
    spec_base = plain * rng.uniform(0.9, 1.3)
    per_draft = rng.uniform(0.0005, 0.01)
    cal = rng.uniform(0.5, 1.5, rows)
    calib = AcceptanceCalibration()
    p = rng.uniform(0, 1, 400)
    calib.observe(p, rng.uniform(0, 1, 400) < p * rng.uniform(0.5, 1.2))
    keep = choose_drafts(probs, plain, spec_base, per_draft, cal, prob_map=calib)
    cut = break_even_prob(rows, plain, spec_base, per_draft, float(cal.max()), calib)
    for q, k in zip(probs, keep):
        assert np.all(q[:k] >= cut)
    cut_probs = [q[q >= cut] for q in probs]
    np.testing.assert_array_equal(choose_drafts(cut_probs, plain, spec_base, per_draft, cal, prob_map=calib), keep)
    # the long tail (one row) affords less likely drafts than a full batch (64 rows, a step 8x dearer)
    assert break_even_prob(1, plain, plain, per_draft) < break_even_prob(64, plain * 8, plain * 8, per_draft)


def test_break_even_cutoff_bad_input_is_named():
    from scheduler.step_policy import break_even_prob

    with pytest.raises(ValueError, match="rows must be >= 1, got 0"):
        break_even_prob(0, 0.1, 0.1, 0.01)
    with pytest.raises(ValueError, match="per_draft_s must be >= 0"):
        break_even_prob(4, 0.1, 0.1, -0.01)
    assert break_even_prob(4, 0.1, 0.1, 10.0) == 1.0  # a draft token dearer than a step never pays
