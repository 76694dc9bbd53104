"""The drain plan (scheduler.drain_plan): the Eq. 1 cost line, the acceptance model it plans with (Eq. 3-4), Eq. 7 / Eq. 9 plans, the step rule, class caps."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler.acceptance import estimate_acceptance, forward_passes, tokens_per_step
from scheduler.drain_plan import CostModel, DrainPlanSolver, optimal_proposals, solve_n_fwd, step_saves_time
from scheduler.length_classes import ClassBudget

C_BASE, C_TOK, C_CTX = 6.3e-3, 23.8e-6, 21.4e-9


def test_fit_recovers_known_constants_from_noisy_steps():
    rng = np.random.default_rng(0)
    cm = CostModel()
    n = rng.integers(1, 4096, 500)
    t = (C_BASE + C_TOK * n) * np.exp(0.05 * rng.standard_normal(n.size))
    for i in range(0, n.size, 7):  # arrives in chunks, as from an engine
        cm.observe(n[i : i + 7], t[i : i + 7])
    assert cm.ready and cm.n_samples == 500
    assert cm.c_base == pytest.approx(C_BASE, rel=0.05)
    assert cm.c_tok == pytest.approx(C_TOK, rel=0.03)
    assert cm.predict(1000) == pytest.approx(C_BASE + 1000 * C_TOK, rel=0.02)
    assert cm.predict(np.array([1, 10])).shape == (2,)


def test_fit_with_context_term():
    rng = np.random.default_rng(1)
    cm = CostModel(use_context=True)
    n = rng.integers(1, 4096, 400)
    ctx = rng.integers(0, 2_000_000, 400)
    cm.observe(n, C_BASE + C_TOK * n + C_CTX * ctx, ctx)
    c = cm.coefficients()
    assert c["c_base"] == pytest.approx(C_BASE, rel=1e-6)
    assert c["c_tok"] == pytest.approx(C_TOK, rel=1e-6)
    assert c["c_ctx"] == pytest.approx(C_CTX, rel=1e-6)


def test_not_ready_before_min_samples_or_without_spread():
    cm = CostModel(min_samples=16)
    assert not cm.ready and cm.coefficients() is None
    with pytest.raises(RuntimeError, match="not fitted"):
        _ = cm.c_base
    cm.observe(np.full(100, 256), np.full(100, 0.02))  # one n_tokens value: c_base and c_tok inseparable
    assert not cm.ready
    cm.observe(np.arange(1, 10), C_BASE + C_TOK * np.arange(1, 10))
    assert cm.ready


def test_prior_is_used_then_outweighed():
    cm = CostModel(prior=(0.01, 1e-4), prior_weight=1.0)
    assert cm.ready and cm.c_base == pytest.approx(0.01) and cm.c_tok == pytest.approx(1e-4)
    n = np.random.default_rng(2).integers(1, 4096, 20000)
    cm.observe(n, C_BASE + C_TOK * n)
    assert cm.c_base == pytest.approx(C_BASE, rel=0.05) and cm.c_tok == pytest.approx(C_TOK, rel=0.01)


def test_forgetting_tracks_a_change_and_coefficients_stay_non_negative():
    cm = CostModel(forgetting=0.99)
    n = np.tile(np.arange(1, 200), 5)
    cm.observe(n, 0.01 + 1e-5 * n)
    cm.observe(n, 0.002 + 5e-5 * n)  # the engine changed
    assert cm.c_base == pytest.approx(0.002, rel=0.05) and cm.c_tok == pytest.approx(5e-5, rel=0.05)
    neg = CostModel()
    neg.observe(np.arange(1, 50), 0.05 - 1e-4 * np.arange(1, 50))  # falling times: no valid slope
    assert neg.c_tok == 0.0 and neg.c_base > 0


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError, match="forgetting"):
        CostModel(forgetting=0.0)
    with pytest.raises(ValueError, match="min_samples"):
        CostModel(min_samples=1)
    with pytest.raises(ValueError, match="prior"):
        CostModel(prior=(1.0,))
    cm = CostModel()
    with pytest.raises(ValueError, match="seconds"):
        cm.observe([10], [0.0])
    with pytest.raises(ValueError, match="n_tokens"):
        cm.observe([-1], [0.1])
    with pytest.raises(ValueError, match="shapes"):
        cm.observe([1, 2], [0.1])


@pytest.mark.parametrize("use_context", [False, True])
def test_one_step_as_numbers_adds_the_same_sums_as_an_array(use_context):
    # The proposer observes one step at a time as plain numbers (the fast path); the fit must be
    # the one the array path gives for the same steps, forgetting included.
    rng = np.random.default_rng(3)
    one, arrays = CostModel(use_context=use_context, forgetting=0.99), CostModel(use_context=use_context, forgetting=0.99)
    for _ in range(300):
        n, ctx = int(rng.integers(1, 64)), int(rng.integers(0, 50_000))
        t = C_BASE + C_TOK * n + C_CTX * ctx + float(rng.normal()) * 1e-4
        one.observe(n, abs(t), np.int64(ctx))
        arrays.observe(np.array([n]), np.array([abs(t)]), np.array([ctx]))
    np.testing.assert_allclose(one._xtx, arrays._xtx, rtol=1e-12)
    np.testing.assert_allclose(one._xty, arrays._xty, rtol=1e-12)
    assert one.n_samples == arrays.n_samples == 300
    assert one.coefficients() == pytest.approx(arrays.coefficients(), rel=1e-9)
    with pytest.raises(ValueError, match="seconds"):
        one.observe(10, float("nan"))
    with pytest.raises(ValueError, match="n_tokens"):
        one.observe(-1, 0.1)
    with pytest.raises(ValueError, match="context_tokens"):
        one.observe(1, 0.1, -5)


# ---------------------------------------------------------------- Eq. 3-4 per step
def test_tokens_per_step_is_eq4_at_a_constant_draft_rate():
    k, a = np.array([0.3, 0.6, 0.9]), np.array([1.5, 1.0, 1.1])
    assert np.allclose(tokens_per_step(0, k, a), 1.0)
    prev = np.ones(3)
    for d in (1, 2, 4, 8, 16, 64):
        tau = tokens_per_step(d, k, a)
        assert np.all(tau >= prev) and np.all(tau <= 1 + d) and np.all(tau <= 1 / (1 - k) + 1e-9)
        # Eq. 4 with p = d * N and N = l / tau passes
        length = 10_000.0
        n = length / tau
        assert np.allclose(forward_passes(length, k, a, d * n), n, rtol=1e-6)
        prev = tau


def test_estimate_acceptance_recovers_a_and_falls_back_to_the_prior():
    k, a_true, d, steps = 0.6, 0.7, 4.0, 5000.0
    tau = tokens_per_step(d, k, a_true)
    kk, aa = estimate_acceptance([d * steps, 0.0], [(tau - 1) * steps, 0.0], [steps, 10.0], k_prior=k, a_prior=1.0)
    assert aa[0] == pytest.approx(a_true, rel=0.02) and aa[1] == 1.0 and np.all(kk == k)
    with pytest.raises(ValueError, match="accepted must be <= drafted"):
        estimate_acceptance([1.0], [2.0], [1.0])


# ---------------------------------------------------------------- Eq. 7 / Eq. 9
def test_eq7_budgets_are_zero_for_requests_ending_before_the_makespan_and_grow_with_length():
    r = np.array([300.0, 2000.0, 6000.0, 9000.0, 12000.0, 16000.0])
    k, a = np.full(6, 0.6), np.ones(6)
    n = solve_n_fwd(r, k, a, C_BASE, C_TOK)
    p, passes = optimal_proposals(r, k, a, n)
    assert np.all(p[r <= n] == 0) and np.all(p[r > n] > 0)
    assert np.all(np.diff(p) >= 0) and p[-1] > p[-2] > 0
    # the critical requests all finish in n passes (Eq. 4 at p*)
    live = r > n
    assert np.allclose(forward_passes(r[live], k[live], a[live], p[live]), n, rtol=1e-6)
    # Eq. 9 (exact form, c_req = 0): c_base + c_tok * |crit| = c_tok * sum_crit 1 / (a (k - 1 + n / r))
    lhs = C_BASE + C_TOK * live.sum()
    rhs = C_TOK * np.sum(1.0 / (a[live] * (k[live] - 1 + n / r[live])))
    assert rhs == pytest.approx(lhs, rel=1e-3)


def test_eq7_paper_form_matches_the_transcribed_equations():
    r = np.full(3, 16000.0)  # (the paper form's residual jumps where a request leaves the sum)
    k, a = np.full(3, 0.6), np.full(3, 0.01)
    n = solve_n_fwd(r, k, a, C_BASE, C_TOK, form="paper")
    assert 0 < n < r.max()
    p, _ = optimal_proposals(r, k, a, n, form="paper")
    live = r > n
    assert C_TOK * np.sum(k[live] / (a[live] * (1 - k[live] + k[live] * n / r[live]))) == pytest.approx(C_BASE, rel=1e-3)
    assert np.allclose(p[live], -(r[live] / a[live]) * np.log(1 - k[live] * (1 - n / r[live])))


def test_more_expensive_tokens_mean_less_speculation():
    r = np.linspace(500, 16000, 50)
    k, a = np.full(50, 0.6), np.ones(50)
    cheap = solve_n_fwd(r, k, a, C_BASE, C_TOK)
    dear = solve_n_fwd(r, k, a, C_BASE, 20 * C_TOK)
    assert cheap < dear <= r.max()
    assert optimal_proposals(r, k, a, cheap)[0].sum() > optimal_proposals(r, k, a, dear)[0].sum()


def test_eq7_solver_caps_units_and_unready_cost_model():
    b = DrainPlanSolver(CostModel(), max_draft=8)
    r = np.array([100.0, 15000.0])
    assert b.caps(r, np.full(2, 0.6), np.ones(2)).tolist() == [0, 0]  # not fitted: no speculation
    b = DrainPlanSolver(CostModel(prior=(C_BASE, C_TOK)), max_draft=8, seed=None)
    caps = b.caps(r, np.full(2, 0.6), np.ones(2))
    assert caps.dtype == np.int32 and caps[0] == 0 and 0 < caps[1] <= 8
    assert b.last_plan.n_fwd < 15000
    with pytest.raises(ValueError, match="remaining"):
        b.caps(np.array([-1.0]), np.array([0.5]), np.array([1.0]))
    with pytest.raises(ValueError, match="shapes"):
        b.caps(np.array([1.0, 2.0]), np.array([0.5]), np.array([1.0]))


def test_per_request_cost_makes_non_critical_requests_draft_at_their_cheapest_rate():
    cm = CostModel(prior=(C_BASE, C_TOK))
    b = DrainPlanSolver(cm, max_draft=16, seed=None)
    r = np.array([200.0, 16000.0])
    k, a = np.full(2, 0.6), np.ones(2)
    assert b.caps(r, k, a)[0] == 0
    # a request whose own passes cost 20 tokens' worth (a long KV cache) drafts a little
    caps = b.caps(r, k, a, per_request_cost_s=np.array([20 * C_TOK, 20 * C_TOK]))
    d = np.arange(17.0)
    per_tok = (20 * C_TOK + C_TOK * (1 + d)) / tokens_per_step(d, 0.6, 1.0)
    assert caps[0] == int(np.argmin(per_tok)) > 0


def test_step_rule():
    k, a = np.full(100, 0.05), np.ones(100)
    d = np.full(100, 16)
    # 100 rows offering 16 drafts at 5% capacity: verification costs more than it saves
    assert not step_saves_time(d, k, a, C_BASE, C_TOK)
    # a lone straggler with a good drafter: drafting pays
    assert step_saves_time(np.array([16]), np.array([0.6]), np.array([1.0]), C_BASE, C_TOK)
    assert step_saves_time(np.zeros(3, int), np.full(3, 0.6), np.ones(3), C_BASE, C_TOK)


def test_eq7_applies_the_step_rule(monkeypatch):
    import scheduler.drain_plan as drain_plan

    cm = CostModel(prior=(C_BASE, C_TOK))
    r, k, a = np.array([100.0, 16000.0]), np.full(2, 0.6), np.ones(2)
    assert DrainPlanSolver(cm, seed=None).caps(r, k, a)[1] > 0
    monkeypatch.setattr(drain_plan, "step_saves_time", lambda *args, **kw: False)
    plan = DrainPlanSolver(cm, seed=None).solve(r, k, a)
    assert plan.step_rule_fired and plan.caps.tolist() == [0, 0] and plan.rate[1] > 0
    assert DrainPlanSolver(cm, seed=None, step_rule=False).caps(r, k, a)[1] > 0


# ---------------------------------------------------------------- class budgets
def test_class_budget():
    cb = ClassBudget(long=12, medium=3, short=0)
    assert cb.caps_of([0, 1, 2, 2]).tolist() == [0, 3, 12, 12]
    gated = ClassBudget(max_running=2)
    assert gated.caps_of([2, 2, 2]).tolist() == [0, 0, 0] and gated.caps_of([2, 1]).tolist() == [16, 4]
    with pytest.raises(ValueError, match="long"):
        ClassBudget(long=-1)
    with pytest.raises(ValueError, match="classes"):
        cb.caps_of([3])
