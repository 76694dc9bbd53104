"""CostModel: online fit of t_step = c_base + c_tok * n_tokens (+ c_ctx * context), readiness, priors."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler.drain_plan import CostModel

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
