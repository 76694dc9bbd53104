"""The per-row draft cap: the engine's K for a priced budget's rows in the long tail, 16 before it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.sim_budget import make_sim_budget
from scheduler.budget_protocol import BudgetSetting, Drafts, StepView
from scheduler.budgets import make_budget
from scheduler.planner import BATCH_DRAFT, PEAK_FADE, StepPlanner, TailDrafts
from scheduler.priced_budgets import CostBudget
from scheduler.step_price import LinearPrice

K = 32
CPU = (0.047, 0.0033)  # c_base, c_tok seconds: a linear, compute-bound CPU step price (2-core AVX2 step log)


def _planner(name="cost", given=CPU, k=K):
    cost = StepPlanner.online_cost(given)
    return StepPlanner(make_budget(name, "proposer", BudgetSetting(cost=cost, max_draft=k)), cost=cost, given_costs=given, max_draft=k)


def run_step(planner, step, drafter):
    """One step as a host runs it: the planner's plan, one drafter call, the tokens kept."""
    plan = planner.plan(step)
    found = drafter(plan.caps, plan.min_prob)
    return found, planner.keep(step, found)


def _drafter(p):
    """Every row proposes K tokens with path probabilities p, p^2, ... (a loop the drafter knows
    well), stopping below the row's ``min_prob``."""

    def draft(caps, min_prob):
        n = caps.shape[0]
        probs = np.tile(np.float32(p) ** np.arange(1, K + 1, dtype=np.float32), (n, 1))
        lengths = np.minimum(caps, K).astype(np.int64)
        if min_prob is not None:
            lengths = np.minimum(lengths, (probs >= np.asarray(min_prob, np.float32)[:, None]).sum(axis=1))
        return Drafts(probs, lengths, np.zeros((n, K), np.int32))

    return draft


def test_tail_drafts_caps_full_batches_at_16_and_lifts_the_tail_to_k():
    tail = TailDrafts(K)
    assert tail.limit(np.full(64, K)).tolist() == [BATCH_DRAFT] * 64  # a full batch: the batch cap
    assert tail.limit(np.full(17, K)).max() == BATCH_DRAFT  # 17 of 64 rows: not the tail yet
    assert tail.limit(np.full(4, K)).tolist() == [K] * 4  # at most 1/8 of the peak: the tail
    assert tail.limit(np.array([K, 3, 0])).tolist() == [K, 3, 0]  # never above a row's own cap
    quota = TailDrafts(K, extends=False)  # a budget that prices nothing keeps the batch cap everywhere
    quota.observe(64)
    assert quota.limit(np.full(1, K)).tolist() == [BATCH_DRAFT]
    assert TailDrafts(8).limit(np.full(1, 8)).tolist() == [8]  # K below the batch cap: K everywhere


def test_the_peak_fades_so_a_smaller_next_batch_is_not_a_tail_for_ever():
    tail = TailDrafts(K)
    tail.observe(256)
    assert tail.cap(16) == K  # 16 of 256 rows: the tail
    steps = int(np.ceil(np.log(0.5) / np.log(PEAK_FADE))) + 2  # the peak halves: 16 rows are more than 1/8 of it
    for _ in range(steps):
        tail.observe(16)
    assert 16 < tail.peak < 128 and tail.cap(16) == BATCH_DRAFT


@pytest.mark.parametrize("bad", [dict(max_draft=-1), dict(max_draft=32, batch_draft=-2), dict(max_draft=32, tail_share=1.5), dict(max_draft=2.5)])
def test_tail_drafts_refuses_bad_settings(bad):
    with pytest.raises(ValueError, match="must be"):
        TailDrafts(**bad)


def test_a_lone_tail_row_with_high_acceptance_drafts_beyond_16_at_a_linear_cpu_price():
    planner = _planner()
    draft = _drafter(0.995)
    _, full = run_step(planner, StepView(np.full(32, K)), draft)
    assert 0 < full.max() <= BATCH_DRAFT
    _, lone = run_step(planner, StepView(np.full(1, K)), draft)
    assert lone.tolist() == [K]  # each token of the last row saves ~c_base: all 32 pay
    _, poor = run_step(planner, StepView(np.full(1, K)), _drafter(0.6))
    assert poor[0] <= BATCH_DRAFT  # a draft that dies out fast pays for few tokens, K or not


def test_a_lone_tail_row_drafts_beyond_16_at_a_knee_price():
    tail = TailDrafts(K)
    tail.observe(256)
    step = StepView(tail.limit(np.full(1, K)))
    step.price = LinearPrice(0.012, 0.012, 2e-5, 0.012, 1e-5, free_drafts=200.0)  # a memory-bound GPU step: drafts free below 200 tokens
    step.calibration = np.ones(1)
    probs = np.tile(np.float32(0.99) ** np.arange(1, K + 1, dtype=np.float32), (1, 1))
    kept = CostBudget().keep(step, Drafts(probs, np.array([K])))
    assert kept.tolist() == [K]


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(8, 256), c_base=st.floats(0.005, 0.2), c_tok=st.floats(1e-4, 2e-2), p=st.floats(0.5, 0.9999),
       name=st.sampled_from(["cost", "fixed"]))
def test_a_full_batch_never_drafts_more_than_16_per_row_at_a_linear_price(rows, c_base, c_tok, p, name):
    planner = _planner(name, (c_base, c_tok))
    _, kept = run_step(planner, StepView(np.full(rows, K)), _drafter(p))
    assert kept.max() <= BATCH_DRAFT


def test_the_simulator_applies_the_same_rule():
    """SimBudget limits each re-plan's caps by the same TailDrafts: a priced budget's lone tail
    row may get K, a full batch 16; ``fixed`` keeps 16 everywhere."""
    for name, tail_cap in (("cost", K), ("fixed", BATCH_DRAFT)):
        b = make_sim_budget(name, None, K, {"c_base": 0.01, "c_tok": 1e-5})
        assert b.tail.cap(256) == BATCH_DRAFT and b.tail.cap(1) == tail_cap
