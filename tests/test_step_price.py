"""The step price (scheduler.step_price): the two-regime line and the knee, fitted online."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.priced_budgets import choose_drafts, drafting_can_pay
from scheduler.step_price import KNEES, MIN_STEPS, StepPrice, TwoRegimeCost


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


# A compute-bound CPU: median step seconds by tokens verified (rows + draft tokens) from a step
# log of a 2-core AVX2 CPU (issue 51), linear between the points and above the last.
CPU_TOKENS = np.array([1, 2, 4, 8, 16, 32, 48], np.float64)
CPU_SECONDS = np.array([44.5, 47.1, 59.0, 77.2, 113.5, 147.5, 203.0]) * 1e-3


def cpu_seconds(rows, drafts):
    n = rows + drafts
    extra = max(n - 48, 0) * 2.8e-3
    return float(np.interp(n, CPU_TOKENS, CPU_SECONDS)) + extra + (6.4e-3 if drafts else 0.0)


def hinge_seconds(rows, drafts, knee=300.0):
    """A memory-bound step: flat in the tokens verified up to ``knee``, 24 us per token above."""
    return 6e-3 + 2.6e-4 * rows + 2.4e-5 * max(rows + drafts - knee, 0.0)


def roofline_seconds(rows, drafts):
    """``launch + max(memory, compute)``: weights and KV read (6 ms + 50 us per row) against 24 us
    per token verified; its knee is ``(6e-3 + 5e-5 rows) / 2.4e-5`` tokens (252 at one row, 317 at 32)."""
    return 1e-3 + max(6e-3 + 5e-5 * rows, 2.4e-5 * (rows + drafts))


def feed(model, seconds, steps, rng, *, max_rows=64, draft_share=0.6, max_per_row=16, noise=0.05, each=None, context=None):
    """``steps`` steps of random rows and drafts (a share of them drafting, up to ``max_per_row``
    per row) timed by ``seconds(rows, drafts)`` with lognormal noise, reading ``context(rows)`` KV
    tokens (default none); ``each(model, rows)`` after every step."""
    for _ in range(steps):
        rows = int(rng.integers(1, max_rows + 1))
        drafts = int(rng.integers(1, max_per_row * rows + 1)) if rng.random() < draft_share else 0
        t = float(seconds(rows, drafts)) * float(np.exp(noise * rng.standard_normal()))
        model.observe(rows, drafts, t, 0.0 if context is None else context(rows))
        if each is not None:
            each(model, rows)
    return model


def test_compute_bound_steps_keep_the_lines_price_and_its_kept_drafts():
    """On the CPU's step times the knee is never accepted, and every price (hence every kept
    draft) is the two-regime line's, step for step."""
    rng = np.random.default_rng(3)
    line = TwoRegimeCost(refit_every=4)
    probs = np.cumprod(rng.uniform(0.3, 1.0, (32, 16)), axis=1)
    checked = [0]

    def same(model, rows):
        if not model.ready:
            return
        assert model.knee == 0.0
        a, b = model.price(rows), line.price(rows)
        assert a == b
        assert choose_drafts(probs[:rows], *a.as_tuple(), lengths=np.full(rows, 16)).tolist() == \
            choose_drafts(probs[:rows], *b.as_tuple(), lengths=np.full(rows, 16)).tolist()
        checked[0] += 1

    class Both(StepPrice):
        def observe(self, rows, drafts, seconds, context=0.0):
            line.observe(rows, drafts, seconds)
            super().observe(rows, drafts, seconds, context)

    feed(Both(refit_every=4), cpu_seconds, 1500, rng, max_rows=32, max_per_row=2, each=same)
    assert checked[0] > 1400


def test_memory_bound_steps_find_the_knee_and_price_drafts_below_it_free():
    model = feed(StepPrice(refit_every=4), hinge_seconds, 800, np.random.default_rng(0))
    assert model.knee == pytest.approx(300.0, rel=0.1)
    c = model.coefficients()
    assert c["c_draft"] == pytest.approx(2.4e-5, rel=0.15) and c["c_row"] == pytest.approx(2.6e-4, rel=0.15)
    tail = model.price(4)
    assert tail.free_drafts == pytest.approx(model.knee - 4)
    assert tail.speculative_s(64) == pytest.approx(tail.spec_base_s)  # 16 drafts for each of 4 rows cost nothing of their own
    assert tail.plain_s == pytest.approx(hinge_seconds(4, 0), rel=0.05)
    full = model.price(512)  # above the knee: no free drafts, rows priced at the slope too
    assert full.free_drafts == 0.0 and full.per_draft_s == pytest.approx(2.4e-5, rel=0.15)
    assert full.plain_s == pytest.approx(hinge_seconds(512, 0), rel=0.05)


def test_a_roofline_knee_is_found_within_a_fifth_of_the_truth():
    """Where the knee moves with the rows (the KV read grows with them), the fit lands within 20%
    of the knee at the rows' mean, and prices tail steps' drafts at nothing."""
    model = feed(StepPrice(refit_every=4), roofline_seconds, 1200, np.random.default_rng(1))
    truth = (6e-3 + 5e-5 * 32) / 2.4e-5
    assert model.knee == pytest.approx(truth, rel=0.2)
    assert model.price(2).free_drafts > 200  # the truth at 2 rows: 254 tokens verified
    assert model.price(2).speculative_s(32) <= 1.01 * model.price(2).spec_base_s


def test_the_simulated_gpus_knee_is_found_and_its_kv_read_priced():
    """Step times of the simulator's H100 roofline (a 7B model; rows, drafts and 1-8K tokens of KV
    per row as a rollout has them): the knee within 20% of the roofline's own at the mean step, the
    KV read priced at the memory's rate, and a tail step's drafts free."""
    from benchmarks.sim_workload import h100_7b_roofline

    roof = h100_7b_roofline()
    rng = np.random.default_rng(6)
    model = StepPrice(refit_every=4)
    for _ in range(1500):
        rows, ctx = int(rng.integers(1, 129)), float(rng.uniform(1024, 8192))
        drafts = int(rng.integers(1, 8 * rows + 1)) if rng.random() < 0.6 else 0
        model.observe(rows, drafts, roof.decode_step_time(rows, drafts / rows, ctx) * float(np.exp(0.05 * rng.standard_normal())), rows * ctx)
    truth = roof.free_draft_tokens(64, 64 * 4608.0) + 64
    assert model.knee == pytest.approx(truth, rel=0.2)
    assert model.coefficients()["c_ctx"] == pytest.approx(roof.kv_bytes_per_token / roof.bytes_per_s, rel=0.2)
    tail = model.price(2, 2 * 12000.0)
    assert tail.free_drafts >= 16 * 2 and tail.plain_s == pytest.approx(roof.decode_step_time(2, 0, 12000.0), rel=0.05)


def test_a_knee_stays_through_a_tail_below_it_and_leaves_when_drafts_cost():
    """A tail of small steps below the knee does not contradict it (where the steps cannot tell
    knees apart, the larger one is kept); steps that show drafts costing from the first token (a
    compute-bound engine) bring back the line."""
    rng = np.random.default_rng(2)
    model = feed(StepPrice(refit_every=4), hinge_seconds, 800, rng)
    knee = model.knee
    assert knee == pytest.approx(300.0, rel=0.1)
    feed(model, hinge_seconds, 1500, rng, max_rows=4, max_per_row=16)  # thousands of tail steps, all below the knee
    assert model.knee >= knee
    assert model.price(2).free_drafts == pytest.approx(model.knee - 2)
    feed(model, cpu_seconds, 1500, rng, max_rows=32, max_per_row=2)
    assert model.knee == 0.0


def test_many_steps_at_once_give_the_sums_of_one_at_a_time():
    rng = np.random.default_rng(4)
    rows = rng.integers(1, 64, 300)
    drafts = rng.integers(0, 600, 300) * (rng.random(300) < 0.6)
    seconds = np.array([roofline_seconds(b, d) for b, d in zip(rows, drafts)]) * np.exp(0.03 * rng.standard_normal(300))
    one, many = StepPrice(refit_every=4), StepPrice(refit_every=4)
    for b, d, t in zip(rows, drafts, seconds):
        one.observe(int(b), int(d), float(t))
    for lo in range(0, 300, 16):
        many.observe_steps(rows[lo : lo + 16], drafts[lo : lo + 16], seconds[lo : lo + 16])
    every = np.arange(KNEES.size + 1)  # each knee's and the line's normal equations
    for a, b in zip(one._normal(every), many._normal(every)):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    assert one.knee > 0 and many.knee > 0  # (each solves at its own cadence: the states may differ by a refit)


@st.composite
def linear_steps(draw):
    """Step times from a random two-regime line (no flat region), with up to 10% noise."""
    c_base = draw(st.floats(1e-3, 0.1))
    c_row = draw(st.floats(0.0, 5e-3))
    c_draft = draw(st.floats(1e-5, 5e-3))
    c_spec = draw(st.floats(0.0, 0.01))
    noise = draw(st.floats(0.0, 0.1))
    max_rows = draw(st.integers(1, 256))
    max_per_row = draw(st.integers(1, 16))
    seed = draw(st.integers(0, 2**31))
    return (lambda b, d: c_base + c_row * b + (c_spec + c_draft * d if d else 0.0)), noise, max_rows, max_per_row, seed


@settings(max_examples=40, deadline=None)
@given(linear_steps())
def test_a_knee_never_appears_on_linear_steps_within_their_noise(case):
    seconds, noise, max_rows, max_per_row, seed = case
    knees = []
    feed(StepPrice(refit_every=4), seconds, 400, np.random.default_rng(seed), max_rows=max_rows, max_per_row=max_per_row, noise=noise,
         each=lambda m, rows: knees.append(m.knee) if m.ready else None)
    assert not any(knees)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from(["cpu", "hinge", "roofline", "wild"]), st.integers(1, 1024))
def test_the_price_is_never_negative(seed, shape, rows):
    """Any step times (also ones no model fits: random seconds) give a price with positive step
    seconds and no negative part."""
    rng = np.random.default_rng(seed)
    seconds = {"cpu": cpu_seconds, "hinge": hinge_seconds, "roofline": roofline_seconds,
               "wild": lambda b, d: float(rng.uniform(1e-4, 0.5))}[shape]
    model = feed(StepPrice(refit_every=1), seconds, 300, rng, noise=0.3)
    if not model.ready:
        return
    p = model.price(rows)
    assert p.plain_s > 0 and p.spec_base_s > 0
    assert min(p.per_draft_s, p.fixed_s, p.per_row_s, p.free_drafts) >= 0.0
    assert all(v >= 0 for v in model.coefficients().values())
    assert model.plain(rows) >= 0


def test_no_knee_before_enough_steps_and_bad_arguments_are_named():
    model = StepPrice()
    feed(model, hinge_seconds, int(MIN_STEPS) - 2, np.random.default_rng(5))
    assert model.knee == 0.0  # too few steps to accept a knee
    assert KNEES[0] == 4.0 and KNEES[-1] == pytest.approx(8192.0)
    with pytest.raises(ValueError, match="knees"):
        StepPrice(knees=np.array([8.0, 4.0]))
    with pytest.raises(ValueError, match="margin"):
        StepPrice(margin=1.0)
    with pytest.raises(ValueError, match="rows"):
        model.observe(0, 1, 0.01)
    with pytest.raises(ValueError, match="one 1-D shape"):
        model.observe_steps([1, 2], [0], [0.01, 0.02])
    with pytest.raises(RuntimeError, match="not fitted"):
        StepPrice().price(4)
