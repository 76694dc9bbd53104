"""The step price with a knee (scheduler.step_price): the line where steps are compute-bound, a flat
region below a knee where they are memory-bound, on synthetic step times of both shapes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.priced_budgets import choose_drafts
from scheduler.step_price import KNEES, MIN_STEPS, StepPrice, TwoRegimeCost

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
