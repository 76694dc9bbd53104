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
