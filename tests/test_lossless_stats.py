"""The statistics of benchmarks/lossless.py: they tell equal distributions from different ones."""

import numpy as np

from benchmarks.lossless import chi_square, mann_whitney_z


def test_chi_square_passes_equal_token_distributions_and_flags_shifted_ones():
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 6, (400, 8)), rng.integers(0, 6, (400, 8))
    stat, dof, crit = chi_square(a, b, 0, 8)
    assert dof == 40 and stat < crit
    shifted = np.where(rng.random((400, 8)) < 0.3, 0, b)  # 30% of tokens forced to one value
    stat, dof, crit = chi_square(a, shifted, 0, 8)
    assert stat > crit


def test_mann_whitney_sees_shorter_outputs():
    rng = np.random.default_rng(1)
    same = mann_whitney_z(rng.integers(100, 1024, 300), rng.integers(100, 1024, 300))
    assert abs(same) < 3.9
    shorter = mann_whitney_z(rng.integers(100, 600, 300), rng.integers(100, 1024, 300))
    assert shorter < -3.9
    assert mann_whitney_z(np.full(10, 5), np.full(10, 5)) == 0.0  # all tied: no evidence either way
