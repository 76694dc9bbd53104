"""Which thread appends which rows in a step's threaded insert (:func:`das.step_threads.balance_parts`)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from das.step_threads import balance_parts


def loads(owner, work, parts, base):
    return base + np.bincount(owner, weights=work, minlength=parts)


def test_rows_of_one_tree_share_a_part_and_every_part_is_in_range():
    keys = np.array([5, 3, 5, 9, 3, 5, 1], np.int64)
    work = np.array([2, 1, 3, 1, 1, 2, 4], np.int64)
    owner = balance_parts(keys, work, 3, np.zeros(3))
    assert owner.dtype == np.int64 and owner.shape == keys.shape
    assert set(owner.tolist()) <= {0, 1, 2}
    for k in np.unique(keys):
        assert len(set(owner[keys == k].tolist())) == 1, f"tree {k} split over parts"


def test_a_part_that_carries_the_global_tree_gets_fewer_trees():
    # eight trees of equal work, two parts; part 1 already carries 4 trees' worth (the global tree)
    keys = np.repeat(np.arange(8, dtype=np.int64), 4)
    work = np.full(32, 3, np.int64)
    owner = balance_parts(keys, work, 2, np.array([0.0, 48.0]))
    per_part = np.bincount(owner, minlength=2)
    assert per_part[1] < per_part[0]
    assert loads(owner, work, 2, np.array([0.0, 48.0])).max() <= (96 + 48) / 2 + 12
    # modulo by tree id would give each part four trees: a load of 48 against 96
    assert loads(np.arange(8).repeat(4) % 2, work, 2, np.array([0.0, 48.0])).max() == 96


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 9)), min_size=1, max_size=120),
       st.integers(1, 8), st.lists(st.floats(0, 50), min_size=8, max_size=8))
def test_the_largest_load_is_within_one_tree_of_the_average(rows, parts, base8):
    """Greedy list scheduling's bound: every tree goes to the least loaded part, so no part ends
    above the average load plus the largest tree (or above its own base load)."""
    keys = np.array([k for k, _ in rows], np.int64)
    work = np.array([w for _, w in rows], np.int64)
    base = np.array(base8[:parts])
    owner = balance_parts(keys, work, parts, base)
    assert owner.min() >= 0 and owner.max() < parts
    for k in np.unique(keys):
        assert np.unique(owner[keys == k]).shape[0] == 1
    tree_work = np.bincount(keys, weights=work)
    bound = max(base.max(), (work.sum() + base.sum()) / parts + tree_work.max())
    assert loads(owner, work, parts, base).max() <= bound + 1e-9


def test_threads_claiming_from_one_counter_get_each_value_once():
    """:func:`das.trie_kernels.fetch_add` is atomic: threads claiming rows from one counter (as
    the ``mix`` drafting kernel's parts do) take every row exactly once."""
    from numba import njit, prange

    from das.trie_kernels import fetch_add

    @njit(parallel=True)
    def claim_all(n, parts):
        counter = np.zeros(1, np.int64)
        claims = np.zeros(n, np.int64)
        for _p in prange(parts):
            while True:
                r = fetch_add(counter, 0, 1)
                if r >= n:
                    break
                claims[r] += 1
        return claims, counter

    claims, counter = claim_all(20_000, 4)
    assert claims.min() == claims.max() == 1, "a row was claimed twice or never"
    assert counter[0] == 20_000 + 4  # each part's last claim went past the end once
