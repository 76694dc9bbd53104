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



@pytest.mark.parametrize("seed", range(6))
def test_a_draft_matrix_chooses_what_the_per_row_list_chooses(seed):
    """The batched proposer hands the drafter's ``[rows, K]`` output with its lengths (no per-row
    arrays); both forms keep the same tokens, for the throughput and the saving rule."""
    from scheduler.step_policy import choose_drafts

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
        assert want.sum() > 0 and np.all(got <= lengths)
    with pytest.raises(ValueError, match="lengths"):
        choose_drafts(matrix, 0.05, 0.052, 0.001, lengths=lengths + k)


def _random_step(rng):
    """A step's drafts as the drafter returns them (float64 path probabilities, non-increasing
    per row) and the proposer's inputs to the selection: prices, per-row calibration, a learned
    calibration curve and, half the time, per-row values (the saving rule)."""
    from scheduler.calibration import AcceptanceCalibration

    rows, k = int(rng.integers(1, 48)), int(rng.integers(1, 17))
    lengths = rng.integers(0, k + 1, rows)
    p64 = np.zeros((rows, k))
    for r in range(rows):
        p64[r, : lengths[r]] = np.cumprod(rng.uniform(0.2, 0.998, lengths[r]))
    plain = rng.uniform(0.005, 0.05)
    spec = plain * rng.uniform(0.7, 1.5)  # a speculative step may cost less or more than a plain one
    per_draft = plain / rows * rng.uniform(0.0, 3.0)
    cal = rng.uniform(0.3, 1.6, rows)
    acc = AcceptanceCalibration()
    seen = rng.uniform(0, 1, 400)
    acc.observe(seen, rng.uniform(0, 1, 400) < seen * rng.uniform(0.5, 1.5))
    values = rng.uniform(0.0, plain / rows * 4, rows) if rng.uniform() < 0.5 else None
    return p64, lengths, (plain, spec, per_draft), cal, acc, values


@pytest.mark.parametrize("seed", range(300))
def test_drafts_cut_at_never_kept_below_keep_the_same_tokens(seed):
    """A drafter that stops at :func:`never_kept_below`'s probability loses only tokens that the
    selection would have thrown away: the step keeps the same tokens, on every rule, with
    speculative steps cheaper or dearer than plain ones, and the drafts handed over as float32."""
    from scheduler.step_policy import choose_drafts, never_kept_below

    rng = np.random.default_rng(seed)
    p64, lengths, prices, cal, acc, values = _random_step(rng)
    rows = lengths.shape[0]
    cut = never_kept_below(rows, *prices, cal, acc.curve(), values)
    assert 0.0 <= cut <= 1.0
    short = np.array([int(np.sum(p64[r, : lengths[r]] >= cut)) for r in range(rows)])  # the drafter's stop rule
    p32 = p64.astype(np.float32)
    full = choose_drafts(p32, *prices, cal, prob_map=acc, values=values, lengths=lengths)
    cut_short = choose_drafts(p32, *prices, cal, prob_map=acc, values=values, lengths=short)
    assert cut_short.tolist() == full.tolist()
    assert np.all(full <= short)


def test_never_kept_below_rises_with_the_price_of_a_draft_token():
    from scheduler.step_policy import never_kept_below

    cuts = [never_kept_below(64, 0.05, 0.05, c) for c in (0.0, 0.0001, 0.0003, 0.0006)]
    assert cuts[0] == 0.0 and cuts == sorted(cuts) and cuts[-1] < 1.0
    assert cuts[2] == pytest.approx(64 * 0.0003 / 0.05, rel=1e-5)  # identity map: theta itself
    assert never_kept_below(64, 0.05, 0.05, 0.001) == 1.0  # no token can pay: nothing to draft
    assert never_kept_below(64, 0.05, 0.04, 0.0001) == 0.0  # a cheaper speculative step pays for one token at any p
    assert never_kept_below(4, 0.05, 0.05, 0.001, values=np.array([0.0, 0.01])) == pytest.approx(0.1, rel=1e-5)
    assert never_kept_below(4, 0.05, 0.05, 0.001, values=np.zeros(4)) == 1.0
    with pytest.raises(ValueError, match="rows"):
        never_kept_below(-1, 0.05, 0.05, 0.001)
    with pytest.raises(ValueError, match="calibration"):
        never_kept_below(4, 0.05, 0.05, 0.001, calibration=np.array([-1.0, 1.0]))


def test_the_random_steps_above_cut_drafts_that_the_selection_keeps_some_of():
    """The equality test above means something only where the cut drops tokens from steps that
    keep some: most of its random steps are of that kind."""
    from scheduler.step_policy import choose_drafts, never_kept_below

    both = 0
    for seed in range(300):
        p64, lengths, prices, cal, acc, values = _random_step(np.random.default_rng(seed))
        cut = never_kept_below(lengths.shape[0], *prices, cal, acc.curve(), values)
        short = np.array([int(np.sum(p64[r, : lengths[r]] >= cut)) for r in range(lengths.shape[0])])
        kept = choose_drafts(p64.astype(np.float32), *prices, cal, prob_map=acc, values=values, lengths=lengths)
        both += bool(short.sum() < lengths.sum() and kept.sum() > 0)
    assert both >= 75


@pytest.mark.parametrize("seed", range(300))
def test_drafts_cut_at_a_guess_keep_the_same_tokens_whenever_the_check_says_so(seed):
    """A guess above :func:`keep_bound` (the last step's keep threshold, say) cuts more; the
    selection's ``peak`` then says whether the cut drafts kept what the full ones keep, and
    when it says so they do (per-row calibration, a learned map, float32 drafts)."""
    from scheduler.step_policy import choose_drafts, cut_kept_the_same, keep_bound, raw_cutoff

    rng = np.random.default_rng(seed)
    p64, lengths, prices, cal, acc, _ = _random_step(rng)
    rows = lengths.shape[0]
    bound = keep_bound(rows, *prices)
    p32 = p64.astype(np.float32)
    full = choose_drafts(p32, *prices, cal, prob_map=acc, lengths=lengths)
    for theta in (bound * rng.uniform(1.0, 4.0), rng.uniform(0.0, 1.0)):
        cut = raw_cutoff(theta, cal, acc.curve())
        short = np.array([int(np.sum(p64[r, : lengths[r]] >= cut)) for r in range(rows)])
        peak = {}
        kept = choose_drafts(p32, *prices, cal, prob_map=acc, lengths=short, peak=peak)
        if cut_kept_the_same(theta, bound, prices[2], peak):
            assert kept.tolist() == full.tolist()


def test_the_guess_check_passes_often_and_refuses_when_the_cut_lost_kept_tokens():
    from scheduler.step_policy import choose_drafts, cut_kept_the_same, keep_bound, raw_cutoff

    passed = refused_right = lost = 0
    for seed in range(300):
        rng = np.random.default_rng(seed)
        p64, lengths, prices, cal, acc, _ = _random_step(rng)
        rows = lengths.shape[0]
        bound = keep_bound(rows, *prices)
        p32 = p64.astype(np.float32)
        whole = {}
        full = choose_drafts(p32, *prices, cal, prob_map=acc, lengths=lengths, peak=whole)
        theta = max(bound, 0.9 * prices[2] * whole["rate"])  # a guess near the keep threshold, as the last step's
        cut = raw_cutoff(theta, cal, acc.curve())
        short = np.array([int(np.sum(p64[r, : lengths[r]] >= cut)) for r in range(rows)])
        peak = {}
        kept = choose_drafts(p32, *prices, cal, prob_map=acc, lengths=short, peak=peak)
        ok = cut_kept_the_same(theta, bound, prices[2], peak)
        passed += ok and short.sum() < lengths.sum() and full.sum() > 0 and theta > bound
        if kept.tolist() != full.tolist():
            lost += 1
            refused_right += not ok
    assert passed >= 40 and lost > 0 and refused_right == lost


@pytest.mark.parametrize("seed", range(300))
def test_drafts_cut_per_row_keep_the_same_tokens(seed):
    """Each row cut at its own :func:`raw_cutoffs` (its own calibration factor; under the saving
    rule its own value too) keeps what the full drafts keep, and cuts at least as much as the one
    cutoff of the largest factor."""
    from scheduler.step_policy import choose_drafts, keep_bounds, never_kept_below, raw_cutoffs

    rng = np.random.default_rng(seed)
    p64, lengths, prices, cal, acc, values = _random_step(rng)
    rows = lengths.shape[0]
    cuts = raw_cutoffs(keep_bounds(rows, *prices, values), cal, acc.curve())
    assert cuts.shape == (rows,) and np.all((cuts >= 0) & (cuts <= 1))
    assert np.all(cuts >= never_kept_below(rows, *prices, cal, acc.curve(), values) - 1e-12)
    short = np.array([int(np.sum(p64[r, : lengths[r]] >= cuts[r])) for r in range(rows)])
    p32 = p64.astype(np.float32)
    full = choose_drafts(p32, *prices, cal, prob_map=acc, values=values, lengths=lengths)
    assert choose_drafts(p32, *prices, cal, prob_map=acc, values=values, lengths=short).tolist() == full.tolist()


def test_raw_cutoffs_invert_the_calibration_row_by_row():
    from scheduler.calibration import AcceptanceCalibration
    from scheduler.step_policy import raw_cutoff, raw_cutoffs

    acc = AcceptanceCalibration()
    acc.observe(np.linspace(0.05, 0.95, 200), np.arange(200) % 3 != 0)
    cal = np.array([0.5, 1.0, 2.0, 0.0])
    cuts = raw_cutoffs(0.3, cal, acc.curve())
    assert cuts[0] > cuts[1] > cuts[2] and cuts[3] == 1.0  # a row that calibrates lower is cut higher; a zero factor: all
    for c, x in zip(cal[:3], cuts[:3]):
        assert acc(np.array([x]))[0] * c == pytest.approx(0.3, rel=1e-4)  # just below theta once calibrated
    assert raw_cutoff(0.3, cal, acc.curve()) == pytest.approx(cuts[2])  # one cutoff: the largest factor's
    assert raw_cutoffs(np.array([0.0, 1.0, np.inf]), 1.0, acc.curve()).tolist() == [0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="theta"):
        raw_cutoffs(-0.1, cal)
