"""Two-regime step cost (scheduler.step_price) and the draft choice that uses it (scheduler.priced_budgets)."""

import numpy as np
import pytest

from scheduler.priced_budgets import choose_drafts, drafting_can_pay
from scheduler.step_price import TwoRegimeCost


def _steps(model, rng, n, c_base=0.015, c_row=0.0008, c_draft=0.001, c_spec=0.004, noise=0.0):
    for _ in range(n):
        rows = int(rng.integers(1, 64))
        drafts = int(rng.integers(0, 3)) * int(rng.integers(1, 40))
        t = c_base + c_row * rows + (c_spec + c_draft * drafts if drafts else 0.0)
        model.observe(rows, drafts, t * (1 + noise * rng.standard_normal()))


def test_recovers_both_regimes_from_mixed_steps():
    model = TwoRegimeCost(forgetting=1.0, prior_weight=0.0)
    _steps(model, np.random.default_rng(0), 200)
    c = model.coefficients()
    assert c["c_base"] == pytest.approx(0.015, rel=1e-6)
    assert c["c_row"] == pytest.approx(0.0008, rel=1e-6)
    assert c["c_draft"] == pytest.approx(0.001, rel=1e-6)
    assert c["c_spec"] == pytest.approx(0.004, rel=1e-6)
    assert model.plain(10) == pytest.approx(0.015 + 0.008)
    assert model.speculative(10, np.array([5]))[0] == pytest.approx(0.015 + 0.004 + 0.008 + 0.005)


def test_not_ready_until_both_regimes_are_seen():
    model = TwoRegimeCost(min_plain=3, min_spec=3)
    for _ in range(10):
        model.observe(8, 0, 0.02)
    assert not model.ready
    for d in (4, 8, 12):
        model.observe(8, d, 0.03 + 0.001 * d)
    assert model.ready
    with pytest.raises(ValueError, match="rows"):
        model.observe(0, 1, 0.1)
    with pytest.raises(ValueError, match="seconds"):
        model.observe(1, 1, float("nan"))
    with pytest.raises(RuntimeError, match="not fitted"):
        TwoRegimeCost().plain(4)


def test_a_speculative_fixed_cost_stops_marginal_drafts():
    probs = [np.array([0.3, 0.1])] * 4
    # Drafts priced like rows and no extra fixed cost: the 0.3 tokens pay at 4 rows.
    assert choose_drafts(probs, 0.02, 0.02, 0.001).sum() > 0
    # The same drafts when a speculative step costs 30% more before any draft: no draft pays.
    assert choose_drafts(probs, 0.02, 0.026, 0.001).sum() == 0


def test_per_row_calibration_moves_drafts_to_rows_that_get_accepted():
    probs = [np.array([0.5, 0.4, 0.3])] * 2
    keep = choose_drafts(probs, 0.02, 0.02, 0.004, calibration=np.array([1.6, 0.3]))
    assert keep[0] > keep[1]


def test_drafting_can_pay_matches_choose_drafts_at_its_bound():
    rng = np.random.default_rng(1)
    for _ in range(200):
        rows, m = int(rng.integers(1, 64)), int(rng.integers(1, 64))
        plain, extra, per = rng.uniform(0.005, 0.05), rng.uniform(0, 0.01), rng.uniform(0, 0.003)
        p = rng.uniform(0.05, 1.0)
        can = drafting_can_pay(rows, m, plain, plain + extra, per, p)
        chosen = choose_drafts([np.full(m, p)] + [np.empty(0)] * (rows - 1), plain, plain + extra, per)
        # choose_drafts sees the same single-probability drafts spread over one row: it drafts iff any m pays
        assert can == (chosen.sum() > 0)


def _exhaustive_nnls(xtx, xty, yty):
    """Reference: every subset of the coefficients with c_base in it, fitted; the best non-negative fit."""
    import itertools

    fits = []
    for size in range(4):
        for rest in itertools.combinations((1, 2, 3), size):
            idx = np.array((0, *rest))
            sub = xtx[np.ix_(idx, idx)]
            if np.linalg.cond(sub) <= 1e12:
                c = np.zeros(4)
                c[idx] = np.linalg.solve(sub, xty[idx])
                if (c >= 0).all():
                    fits.append((yty - 2 * c @ xty + c @ xtx @ c, c))
    return min(fits, key=lambda f: f[0])[1] if fits else None


def test_the_one_solve_shortcut_gives_the_exhaustive_subset_fit():
    # The last fit's support, tried first and kept when it meets the KKT conditions, and the
    # unconstrained solve are shortcuts. Steps whose true costs are non-negative (shortcut taken) and ones with a negative slope in the
    # data (a subset must win): the fit is the exhaustive search's either way.
    from scheduler.step_price import best_subset_fit

    rng = np.random.default_rng(7)
    shortcuts = 0
    for _ in range(200):
        xtx, xty, yty = np.zeros((4, 4)), np.zeros(4), 0.0
        slope = rng.choice([0.0014, -0.0004])  # a negative per-row slope forces a constrained fit
        for _ in range(int(rng.integers(8, 60))):
            rows, drafts = int(rng.integers(1, 64)), int(rng.integers(0, 40)) * int(rng.random() < 0.6)
            t = max(1e-3, 0.03 + slope * rows + 0.001 * drafts + 0.002 * (drafts > 0) + rng.normal() * 0.002)
            x = np.array([1.0, rows * 1e-2, drafts * 1e-2, float(drafts > 0)])
            xtx += np.outer(x, x)
            xty += x * t
            yty += t * t
        xtx += 2.0 * np.diag([0.0, 0.0, 0.0, 1.0])
        want = _exhaustive_nnls(xtx, xty, yty)
        support = 15 if want is None else sum(1 << i for i in range(4) if want[i] > 0)
        # No hint, the answer's own support (the KKT shortcut) and a wrong one: the same fit.
        for hint in (15, support, int(rng.integers(0, 16))):
            got = best_subset_fit(xtx, xty, yty, hint)
            assert (want is None) == (got is None)
            if want is not None:
                np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
        shortcuts += bool(np.all(np.linalg.solve(xtx, xty) >= 0)) if np.linalg.cond(xtx) < 1e12 else 0
    assert 20 < shortcuts < 180  # both paths were exercised


def test_refit_every_n_observations_matches_a_fit_every_step_at_each_refit():
    # Fitted first as soon as it can be, then every 4th observation; in between the last fit holds.
    rng = np.random.default_rng(5)
    every, lazy = TwoRegimeCost(min_plain=2, min_spec=2), TwoRegimeCost(min_plain=2, min_spec=2, refit_every=4)
    since, held, refits = None, None, 0
    for i in range(40):
        rows, drafts = int(rng.integers(1, 32)), int(rng.integers(0, 20)) * (i % 2)
        t = 0.02 + 0.0013 * rows + 0.001 * drafts + 0.003 * (drafts > 0) + float(rng.normal()) * 1e-4
        every.observe(rows, drafts, t)
        lazy.observe(rows, drafts, t)
        since = None if since is None else since + 1
        assert lazy.ready == every.ready
        if not every.ready:
            continue
        if since is None or since == 4:  # the first fit, then every 4th observation
            since, held, refits = 0, every.coefficients(), refits + 1
        assert lazy.coefficients() == pytest.approx(held, rel=1e-12)
        if since:
            assert lazy.coefficients() != pytest.approx(every.coefficients(), rel=1e-9)  # stale in between
    assert refits >= 8
    with pytest.raises(ValueError, match="refit_every"):
        TwoRegimeCost(refit_every=0)
