"""StepPlanner without vLLM: synthetic steps in, kept drafts out."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.budget_protocol import BudgetSetting, Drafts, StepView
from scheduler.budgets import make_budget
from scheduler.planner import SCREEN_STEPS, StepPlanner, likeliest_rows


class Clock:
    """``step(seconds, rows, drafted, accepted=0)``: one clean decode step of ``rows`` rows that
    verified ``drafted`` draft tokens, ``seconds`` after the last, into ``planner``."""

    def __init__(self, planner):
        self.planner, self.now = planner, 0.0

    def step(self, seconds, rows, drafted, accepted=0):
        self.now += seconds
        self.planner.record_step(self.now, rows, drafted, rows + drafted, 100 * rows, True, accepted)


class Drafter:
    """A stand-in drafter: every row's candidates are a fixed row of ``probs`` (non-increasing);
    a row gets its first ``min(cap, len)`` tokens at or above its cutoff (``min_prob``, or its
    own ``floor``, its min_token_prob). Counts drafted tokens."""

    def __init__(self, probs, floor=0.0):
        self.probs = np.asarray(probs, np.float32)
        self.floor = floor
        self.drafted = 0

    def __call__(self, caps, min_prob):
        lengths = np.minimum(caps, self.probs.shape[1]).astype(np.int64)
        cut = np.full(lengths.shape, self.floor) if min_prob is None else np.asarray(min_prob, np.float64)
        lengths = np.minimum(lengths, (self.probs >= cut.astype(np.float32)[:, None]).sum(axis=1))
        self.drafted += int(lengths.sum())
        return Drafts(self.probs.copy(), lengths, np.zeros(self.probs.shape, np.int32))


def run_step(planner, step, drafter, floor=0.0):
    """One step as a host runs it: the planner's plan, one drafter call, the tokens kept."""
    plan = planner.plan(step, floor)
    found = drafter(plan.caps, plan.min_prob)
    return found, planner.keep(step, found)


def _planner(name="cost", given=None, **setting):
    cost = StepPlanner.online_cost(given)
    return StepPlanner(make_budget(name, "proposer", BudgetSetting(cost=cost, **setting)), cost=cost, given_costs=given)


def test_likeliest_rows_bound_warm_up_and_exploration_drafts():
    rows = [[0.2, 0.9], [], [0.9] * 6, [0.5] * 3]
    lengths = np.array([len(r) for r in rows], np.int64)
    probs = np.zeros((4, 6), np.float32)
    for i, r in enumerate(rows):
        probs[i, : len(r)] = r
    assert likeliest_rows(probs, lengths, per_row=4, total=5).tolist() == [0, 0, 4, 1]  # 4 on the likeliest, the rest to the next
    assert likeliest_rows(probs, lengths, per_row=1, total=1).tolist() == [0, 0, 1, 0]
    assert likeliest_rows(probs, lengths, per_row=4, total=100).tolist() == [2, 0, 4, 3]  # never more than a row has


def test_warm_up_alternates_plain_and_drafting_steps_and_keeps_a_quarter_of_a_large_batch():
    # No price yet (a fresh two-regime fit): drafting steps alternate with plain ones, and one
    # over 32 rows that could all draft K tokens keeps at most 32 // 4 = 8 tokens in all.
    planner = _planner()
    drafter = Drafter(np.full((32, 6), 0.9))
    kept = [int(run_step(planner, StepView(np.full(32, 6)), drafter)[1].sum()) for _ in range(4)]
    assert kept[0] == kept[2] == 0 and 0 < kept[1] <= 8 and 0 < kept[3] <= 8
    assert planner.stats.skipped_steps == 2 and planner.stats.fitted_steps == 0


def test_given_prices_price_every_step_and_never_force_a_plain_one():
    """With ``c_base``/``c_tok`` given there is nothing to measure: a step drafts whenever the
    drafts pay, while a fitted planner forces a plain step after 16 drafting ones."""
    given = _planner(given=(0.05, 1e-5))
    fitted = _planner()
    clock = Clock(fitted)
    clock.step(0.1, 8, 0)
    for _ in range(8):
        clock.step(0.1, 8, 0)
        clock.step(0.1 + 0.0001 * 8, 8, 8)
    for _ in range(20):
        clock.step(0.1 + 0.0001 * 8, 8, 8)
    assert fitted.regimes.ready
    for planner in (given, fitted):
        assert planner.plan(StepView(np.full(8, 4))).plain == (planner is fitted)  # the plan says it is the plain step
        drafter = Drafter(np.full((8, 4), 0.95))
        kept = run_step(planner, StepView(np.full(8, 4)), drafter)[1]
        assert (kept.sum() > 0) == (planner is given), planner.given_costs
    assert fitted.stats.skipped_steps == 2 and given.stats.fitted_steps == 1


def test_drafting_that_does_not_pay_on_the_clock_shrinks_the_acceptance_estimates():
    # The cost fit and the calibration can both be too optimistic; the realized tokens per second
    # of drafting steps against the fitted plain step is the check. 8 rows, plain 0.1 s;
    # drafting steps of 8 draft tokens.
    planner = _planner()
    clock = Clock(planner)
    clock.step(0.1, 8, 0)  # the first step only starts the clock
    for _ in range(8):
        clock.step(0.1, 8, 0)
        clock.step(0.1 + 0.01 * 8, 8, 8, 4)  # fits the model: a draft token costs 10 ms
    assert planner.regimes.ready
    start = planner.payoff_scale
    for _ in range(20):
        clock.step(0.4, 8, 8, 1)  # 9 tokens in 0.4 s against 8 in 0.1 s: drafting loses on the clock
    assert 0.25 <= planner.payoff_scale < start
    low = planner.payoff_scale
    assert np.allclose(planner.row_calibration(StepView([0], [False])), planner.calibration() * low)
    for _ in range(20):
        clock.step(0.11, 8, 8, 8)  # 16 tokens in 0.11 s: drafting pays
    assert low < planner.payoff_scale <= 1.0


def test_a_full_batch_after_small_warm_up_steps_is_measured_not_taken_for_idle_gaps():
    # An engine warms up on 2 rows (0.03 s steps), then decodes 64 rows (0.15 s plain steps,
    # more with drafts): those are steps, and the fit must see them all. An idle gap (30 s
    # between generate() calls) is still left out.
    planner = _planner()
    clock = Clock(planner)
    clock.step(0.03, 2, 0)  # starts the clock
    for _ in range(10):
        clock.step(0.03, 2, 0)
    seen = planner.regimes.n_plain + planner.regimes.n_spec
    for i in range(40):
        clock.step(0.15 + 0.001 * 40 * (i % 2), 64, 40 * (i % 2))
    assert planner.regimes.n_plain + planner.regimes.n_spec == seen + 40
    clock.step(30.0, 64, 0)  # an idle gap
    assert planner.regimes.n_plain + planner.regimes.n_spec == seen + 40
    for _ in range(5):  # the tail: one row again, 0.03 s steps
        clock.step(0.03, 1, 0)
    assert planner.regimes.n_plain + planner.regimes.n_spec == seen + 45


def test_the_engines_warm_up_steps_never_reach_the_cost_fit():
    # An engine's first decode steps compile kernels: seconds each, then milliseconds. They are
    # held back with the first SCREEN_STEPS steps and dropped against their median.
    records = []
    planner = _planner()
    planner.step_log = records.append
    clock = Clock(planner)
    clock.step(0.03, 2, 0)  # starts the clock
    clock.step(7.2, 2, 0)
    clock.step(9.3, 2, 0)
    for _ in range(SCREEN_STEPS - 3):
        clock.step(0.026, 2, 0)
    assert planner.regimes.n_plain == 0 and not records  # held back until SCREEN_STEPS clean steps are in
    clock.step(0.026, 2, 0)
    assert planner.regimes.n_plain == SCREEN_STEPS - 2  # both warm-up steps dropped
    assert [r["fitted"] for r in records].count(False) == 2 and len(records) == SCREEN_STEPS
    for i in range(40):  # plain 22 ms + 1.4 ms per row, a draft token 1.2 ms
        rows = 2 + i % 31
        drafted = 4 * rows * (i % 2)
        clock.step(0.022 + 0.0014 * rows + 0.0012 * drafted, rows, drafted)
    c = planner.regimes.coefficients()
    assert c["c_base"] == pytest.approx(0.022, rel=0.05)
    assert c["c_draft"] == pytest.approx(0.0012, rel=0.05)
    assert records[-1]["c_draft"] == pytest.approx(c["c_draft"], rel=0.05)


def test_after_32_steps_where_no_draft_can_pay_one_step_explores():
    planner = _planner(given=(1e-5, 0.01))  # a draft token pays only at p > 0.9997

    def step():  # requests whose drafts were accepted far less often than predicted: calibrated to ~0.07
        return StepView(np.full(4, 6), accepted=np.zeros(4), predicted=np.full(4, 100.0))

    drafter = Drafter(np.array([[0.9] * 6, [0.95] * 6, [0.9] * 6, [0.9] * 6]))
    kept = [run_step(planner, step(), drafter)[1] for _ in range(33)]
    assert all(k.sum() == 0 for k in kept[:32]) and planner.stats.skipped_steps == 32 and drafter.drafted == 6 * 4
    assert kept[32].tolist() == [0, 1, 0, 0]  # the first token of the likeliest row (rows // 8, at least 1)
    assert run_step(planner, step(), drafter)[1].sum() == 0 and planner.stats.skipped_steps == 33  # and back to the price


def test_a_length_budget_caps_before_the_drafter_and_keeps_all_it_drafted(length_history):
    from scheduler.budget_protocol import RowFacts

    planner = _planner("class")
    pred = length_history
    ids = ["short0", "long0"]
    step = StepView(np.array([6, 6]), facts=lambda: RowFacts(pred, pred.index(ids), np.zeros(2), np.full(2, 16384), np.zeros(2),
                                                              np.zeros(2), np.zeros(2)))
    drafter = Drafter(np.full((2, 8), 0.5))
    found, kept = run_step(planner, step, drafter)
    assert found.lengths.tolist() == [0, 6] and kept.tolist() == [0, 6]
    assert step.calibration is None  # an unpriced budget: no price, no calibration


@st.composite
def priced_streams(draw):
    """A stream of steps: rows, each row's candidates (non-increasing path probabilities), and
    step times that give the two-regime fit something to learn; prices given or fitted."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    given = draw(st.sampled_from([None, (0.02, 0.002), (0.05, 0.0005)]))
    steps = []
    for i in range(draw(st.integers(30, 80))):
        rows = int(rng.integers(1, 12))
        k = 8
        probs = np.cumprod(rng.uniform(0.4, 1.0, (rows, k)), axis=1)
        caps = rng.integers(0, k + 1, rows)
        seconds = 0.02 + 0.001 * rows + 0.0015 * rng.integers(0, 3 * rows) * (i % 3 > 0)
        steps.append((probs, caps, seconds, rng.uniform(0.0, 1.0, rows)))
    return draw(st.sampled_from(["cost", "makespan"])), given, steps


@settings(max_examples=20, deadline=None)
@given(priced_streams())
def test_drafts_cut_at_the_price_keep_what_uncut_drafts_keep(stream):
    """The planner has the drafter stop where the step's price would cut anyway (at the bound
    below which the selection keeps nothing), drafting once: every step keeps the same tokens as
    drafting down to the drafter's own cutoff, and the drafter drafts no more."""
    from scheduler.budget_protocol import RowFacts
    from scheduler.predictor import LengthPredictor

    name, given, steps = stream
    pred = LengthPredictor(1024)
    pred.observe("p", 1, [100, 400, 900])
    cut, uncut = _planner(name, given), _planner(name, given)
    uncut.budget.cutoff = lambda step: None
    for planner in (cut, uncut):
        planner.kept, planner.drafter_calls = [], 0
        clock = Clock(planner)
        for j, (probs, caps, seconds, accepted_share) in enumerate(steps):
            drafter = Drafter(probs, floor=0.05)
            n = caps.size
            facts = RowFacts(pred, pred.index(["p"] * n), 10.0 * (np.arange(n) + j), np.full(n, 1024), np.zeros(n), np.zeros(n), np.zeros(n))
            view = StepView(caps, facts=facts, accepted=np.zeros(n), predicted=np.zeros(n))
            found, kept = run_step(planner, view, drafter, floor=0.05)
            planner.kept.append(kept.tolist())
            planner.drafter_calls += drafter.drafted
            acc = np.floor(kept * accepted_share).astype(np.int64)
            offered = np.flatnonzero(kept)
            if offered.size:
                planner.observe_verified(acc[offered], probs[offered].sum(axis=1) * 0.5, found.probs[offered], kept[offered])
            clock.step(seconds, caps.size, int(kept.sum()), int(acc.sum()))
    assert cut.kept == uncut.kept
    assert cut.drafter_calls <= uncut.drafter_calls


def test_on_compute_bound_steps_the_knee_price_keeps_what_the_line_keeps():
    """The step price learns a knee only where the steps show one: on a CPU's step times (no flat
    region) every step keeps the drafts that the two-regime line's price keeps."""
    from scheduler.step_price import TwoRegimeCost

    tokens = np.array([1, 2, 4, 8, 16, 32, 48], np.float64)  # median step seconds by tokens verified, a 2-core AVX2 CPU
    seconds = np.array([44.5, 47.1, 59.0, 77.2, 113.5, 147.5, 203.0]) * 1e-3
    rng = np.random.default_rng(11)
    stream = [(int(rng.integers(1, 33)), np.cumprod(rng.uniform(0.3, 1.0, (32, 8)), axis=1), float(np.exp(0.05 * rng.standard_normal())))
              for _ in range(400)]
    kept = {}
    for name in ("knee", "line"):
        planner = _planner("cost")
        if name == "line":
            class Line(TwoRegimeCost):
                def observe(self, rows, drafts, seconds, context=0.0):
                    super().observe(rows, drafts, seconds)

            planner.regimes = Line(refit_every=4)
        clock, out = Clock(planner), []
        for rows, probs, noise in stream:
            _, k = run_step(planner, StepView(np.full(rows, 8)), Drafter(probs[:rows]), floor=0.0)
            out.append(k.tolist())
            n = rows + int(k.sum())
            clock.step((np.interp(n, tokens, seconds) + 2.8e-3 * max(n - 48, 0) + 6.4e-3 * bool(k.sum())) * noise, rows, int(k.sum()),
                       int(k.sum()) // 2)
        kept[name] = out
        if name == "knee":
            assert planner.regimes.ready and planner.regimes.knee == 0.0
            assert planner.stats.fitted_steps > 300
    assert kept["knee"] == kept["line"]
    assert sum(map(sum, kept["line"])) > 1000  # and they draft
