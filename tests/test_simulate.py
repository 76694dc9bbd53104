"""Long-tail simulator: roofline and KV-capacity rules on hand-computed cases, invariants of every
policy and placement, the CLI's JSON keys."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from benchmarks.sim_budget import BUDGETS, make_sim_budget
from benchmarks.sim_engine import EngineParams, Gpu, Requests, allot_drafts, roofline_time
from benchmarks.sim_placement import PLACEMENTS, assign
from benchmarks.sim_workload import AcceptanceModel, LengthModel, Roofline, fit_length_model, fit_linear_cost, h100_7b_roofline
from benchmarks.simulate import ci95, lower_bound_s, main, requests_factory, run_config, synthetic_workload

# A toy GPU whose numbers are easy by hand: 1 ms launch, 1 GB of weights at 1 TB/s (1 ms), 1 KB of
# KV per token, 1 GFLOP per token at 10 TFLOP/s (0.1 ms per token), no attention FLOPs.
TOY = Roofline(launch_s=1e-3, weight_bytes=1e9, kv_bytes_per_token=1e3, flops_per_token=1e9, attn_flops_per_pair=0.0, bytes_per_s=1e12, flops_per_s=1e13,
               kv_capacity_tokens=230)


def test_roofline_is_the_max_of_compute_and_memory():
    # 2 tokens, 202 KV tokens read + 2 written: compute 0.2 ms, memory 1.000204 ms -> 1 + 1.000204
    assert TOY.step_time(2, 0, 204) == pytest.approx(1e-3 + 1.000204e-3)
    # 26 tokens: compute 2.6 ms > memory 1.000228 ms -> 1 + 2.6 ms (additive would charge 4.600228)
    assert TOY.step_time(26, 0, 228) == pytest.approx(3.6e-3)
    args = (TOY.launch_s, TOY.weight_bytes, TOY.kv_bytes_per_token, TOY.flops_per_token, TOY.attn_flops_per_pair, TOY.bytes_per_s, TOY.flops_per_s)
    assert roofline_time(26.0, 0.0, 228.0, *args) == pytest.approx(3.6e-3)
    assert roofline_time(26.0, 0.0, 228.0, *args, True) == pytest.approx(1e-3 + 2.6e-3 + 1.000228e-3)
    # knee: 2 rows, 200 KV tokens: memory 1.000202 ms, compute 0.2 ms -> 8.00202 more tokens free
    assert TOY.free_draft_tokens(2, 200) == pytest.approx((1.000202e-3 - 0.2e-3) / 1e-4)


def test_h100_constants_are_the_cited_ones():
    roof = h100_7b_roofline()
    assert roof.kv_bytes_per_token == 57_344  # 28 layers x 2 x 4 KV heads x 128 x 2 B
    assert roof.bytes_per_s == pytest.approx(0.8 * 3.35e12) and roof.flops_per_s == pytest.approx(0.6 * 989e12)
    assert roof.weight_bytes == pytest.approx(14.14e9, rel=0.01)  # 15.2 GB resident minus the embedding
    assert 850_000 < roof.kv_capacity_tokens < 900_000
    # a full-batch decode step is memory-bound; a batch-1 step costs launch + weights read
    assert roof.decode_step_time(1, 16, 1000) == pytest.approx(1e-3 + (14.14e9 + 57_344 * 1017) / 2.68e12, rel=1e-3)
    assert roof.decode_step_time(256, 16, 3000) > 3 * roof.decode_step_time(256, 0, 3000)
    fit = fit_linear_cost(roof)
    assert 0.0 < fit["mean_rel_error"] < 0.3 and fit["c_tok"] > 0


def test_allot_drafts_spends_the_budget_in_priority_order():
    want = np.array([4.0, 4.0, 4.0, 4.0])
    running = np.array([True, True, True, False])
    out = allot_drafts(want, np.array([3, 2, 0, 1]), running, 6.0)
    np.testing.assert_allclose(out, [2.0, 0.0, 4.0, 0.0])  # row 3 is not running; row 0 gets the rest
    np.testing.assert_allclose(allot_drafts(want, np.arange(4), running, 100.0), [4, 4, 4, 0])
    np.testing.assert_allclose(allot_drafts(want, np.arange(4), running, -3.0), 0)


def _two_requests(kv_aware: bool):
    """Two looping requests of 12 tokens with 100-token prompts on the toy GPU (KV 230 tokens),
    fixed K=16. Without drafts their KV peaks at 224 tokens: no preemption is needed."""
    am = AcceptanceModel()
    k, a = np.full(2, 0.6), np.full(2, 1.0)
    req = Requests(
        length=np.full(2, 12.0), prompt=np.full(2, 100.0), loop_at=np.zeros(2), group=np.array([0, 1]), problem_idx=np.full(2, -1),
        k=k, a=a, tau_tab=am.tau_table(k, a, 1, 16), tau_loop=am.loop_tau(16), nat_draft=3.7,
    )  # fmt: skip
    params = EngineParams(roof=TOY, max_draft=16, drafter_ms_per_256=0.0, max_tokens=64)
    gpu = Gpu(0, req, np.arange(2), make_sim_budget("fixed", None, 16, {}, kv_aware=kv_aware), params, 2, np.zeros((2, 16, 3)), np.zeros((1, 3)))
    gpu.run_until(0.022)  # step 1 (prefill of 200 tokens, compute-bound) ends at 21 ms, step 2 after it
    after_two = req.gen.copy()
    gpu.run_until()
    return gpu, req, after_two


def test_kv_aware_drafts_never_force_a_preemption():
    gpu, req, after_two = _two_requests(kv_aware=True)
    rec = gpu.records()
    assert rec["dt"][0] == pytest.approx(1e-3 + 200 * 1e-4)
    # step 1: both prefilled (100 + 1 <= 227.7, 202 <= 227.7), one token each. Step 2: KV 202, two
    # sampled slots and two more for the next step leave 230 - 202 - 4 = 24 draft tokens: 16 for
    # row 0 (first in order), 8 for row 1 -> 26 tokens, compute-bound: 1 + 2.6 ms.
    assert rec["n"][1] == pytest.approx(26.0)
    assert rec["dt"][1] == pytest.approx(3.6e-3)
    assert after_two[0] == pytest.approx(1 + (1 - 0.9**17) / 0.1)  # 16 drafts in a loop at q = 0.9
    assert after_two[1] == pytest.approx(1 + (1 - 0.9**9) / 0.1)  # 8 drafts
    assert gpu.preemptions == 0 and np.all(req.status == 2) and req.gen.sum() == pytest.approx(24)


def test_kv_unaware_drafts_preempt():
    gpu, req, after_two = _two_requests(kv_aware=False)
    assert after_two[1] == 1.0  # preempted in step 2 before it could advance
    # step 2 wants 202 + 2 + 32 = 236 > 230 slots: vLLM preempts the newest request
    assert gpu.preemptions >= 1
    assert np.all(req.status == 2) and req.gen.sum() == pytest.approx(24)


def test_ci95_and_class_budgets():
    from scheduler.length_classes import class_budgets

    m, h = ci95([1.0, 2.0, 3.0])
    assert m == 2.0 and h == pytest.approx(4.303 / math.sqrt(3))
    assert ci95([5.0]) == (5.0, 0.0)
    b = class_budgets([0, 0], [100.0, 100.0], [0.6, 0.6], [1.0, 1.0], 6e-3, 2e-5, 16)
    assert b.tolist() == [0, 0, 0]  # Short never drafts
    b = class_budgets([2, 2, 0], [10_000.0, 9_000.0, 50.0], [0.6] * 3, [1.0] * 3, 6e-3, 2e-5, 16)
    assert b[0] == 0 and 1 <= b[2] <= 16


def test_acceptance_model_states():
    am = AcceptanceModel()
    np.testing.assert_allclose(am.loop_tau(3), [1.0, 1.9, 2.71, 3.439])
    k = am.sibling_k(np.array([0.6, 0.6]), np.array([0, 15]), 16)
    assert k[0] == pytest.approx(0.6) and k[1] == pytest.approx(0.7)
    tab = am.tau_table([0.6], [1.0], 16, 4)
    assert tab.shape == (1, 16, 5) and np.all(np.diff(tab[0, :, 4]) > 0) and np.all(tab[0, :, 0] == 1.0)


@pytest.fixture(scope="module")
def small():
    lm = LengthModel(median=600, max_tokens=4096)
    work = synthetic_workload(n_prompts=16, n_samples=4, max_tokens=4096, length_model=lm, seed=3)
    params = EngineParams(roof=h100_7b_roofline(), max_draft=8, max_tokens=4096)
    return work, params, fit_linear_cost(params.roof, max_draft=8)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("budget", BUDGETS)
def test_invariants(small, budget, placement):
    work, params, lin = small
    r = run_config(work, requests_factory(work, params), budget, placement, 2, params, lin, seed=1)
    assert r["tokens"] == pytest.approx(work["lengths"].sum())  # every token generated, none twice
    drafts = r["drafted_per_token"] > 0
    assert r["makespan_s"] >= lower_bound_s(work, params, speculative=drafts) - 1e-9
    assert r["accepted_per_token"] <= r["drafted_per_token"] + 1e-12
    if budget == "none":
        assert r["drafted_per_token"] == 0
        assert r["makespan_s"] >= lower_bound_s(work, params, speculative=False)


def test_placements():
    a = assign(4, 4, 2, "none")
    assert a.tolist() == [0] * 8 + [1] * 8  # whole groups, contiguous
    assert assign(4, 4, 2, "split").tolist() == [0, 1] * 8  # every group over both GPUs
    assert np.bincount(assign(4, 4, 8, "split")).tolist() == [2] * 8


def test_rebalance_moves_work_to_the_idle_gpu():
    lm = LengthModel(median=600, max_tokens=4096)
    work = synthetic_workload(n_prompts=4, n_samples=4, max_tokens=4096, length_model=lm, seed=0)
    work["lengths"][:2] = 4000  # GPU 0's groups are long, GPU 1's short
    work["lengths"][2:] = 200
    work["loop_at"][:] = np.inf
    params = EngineParams(roof=h100_7b_roofline(), max_draft=8, max_tokens=4096)
    lin = fit_linear_cost(params.roof, max_draft=8)
    fresh = requests_factory(work, params)
    none = run_config(work, fresh, "none", "none", 2, params, lin)
    reb = run_config(work, fresh, "none", "rebalance", 2, params, lin)
    assert reb["moves"] > 0 and reb["tokens"] == pytest.approx(work["lengths"].sum())
    assert reb["makespan_s"] < none["makespan_s"]


def test_fit_length_model_recovers_parameters():
    lm = LengthModel(median=3000, sigma_between=0.5, sigma_within=0.3, runaway=0.0, max_tokens=1 << 20)
    rng = np.random.default_rng(1)
    mu = lm.sample_problems(400, rng)
    groups = list(lm.sample(mu, 16, rng))
    fit = fit_length_model(groups, 1 << 20)
    assert fit.median == pytest.approx(3000, rel=0.1)
    assert fit.sigma_between == pytest.approx(0.5, rel=0.1)
    assert fit.sigma_within == pytest.approx(0.3, rel=0.05)
    with pytest.raises(ValueError, match="groups"):
        fit_length_model([np.array([1.0])], 100)


def test_loops_run_to_the_cap():
    lm = LengthModel(runaway=0.3)
    rng = np.random.default_rng(0)
    lengths, loop_at = lm.sample_detail(lm.sample_problems(64, rng), 16, rng)
    loops = np.isfinite(loop_at)
    assert loops.any() and np.all(lengths[loops] == lm.max_tokens) and np.all(loop_at[loops] < lm.max_tokens)


def test_cli_writes_the_required_json_keys(tmp_path, capsys):
    path = tmp_path / "sim.json"
    main(["--prompts", "8", "--samples", "4", "--gpus", "2", "--max-tokens", "2048", "--seeds", "2", "--json", str(path), "--plot", "none",
          "--placements", "none,split"])
    data = json.loads(path.read_text())
    keys = set(BUDGETS) | {f"{p}+split" for p in BUDGETS}
    assert set(data["paper_setting"]) == keys
    for k in keys:
        row = data["paper_setting"][k]
        assert row["makespan_s"] > 0 and row["makespan_s_ci95"] >= 0 and row["seeds"] == 2
        assert row["makespan_s"] == pytest.approx(np.mean(row["makespan_s_per_seed"]), abs=1e-3)
    assert set(data["validation"]) == {"fig1_running_requests", "fig4_acceptance", "fig8_makespan", "fig10_unlimited_vs_length_aware", "shipped_vs_paper",
                                       "shipped_vs_roofline"}
    assert data["validation"]["shipped_vs_roofline"]["other"] == "class-roofline"
    from das.config import DASConfig

    shipped = data["validation"]["shipped_vs_paper"]
    assert data["shipped_budget"] == shipped["shipped"] == DASConfig().budget and shipped["other"] == "class-eq9"
    assert shipped["shipped_cut_vs_other"] == pytest.approx(
        np.mean(1 - np.array(data["paper_setting"][shipped["shipped"]]["makespan_s_per_seed"]) / data["paper_setting"]["class-eq9"]["makespan_s_per_seed"]))
    assert "makespan" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--gpus", "0", "--plot", "none"])


def test_sweep_point_pruning_matches_all_gpus():
    from benchmarks.sim_sweep import run_point

    params = EngineParams(roof=h100_7b_roofline(), max_draft=16, max_tokens=2048)
    lin = fit_linear_cost(params.roof)
    am = AcceptanceModel()
    pr = run_point(32, 1, params, lin, am, seed=0, max_tokens=2048, top=3, budgets=("none", "class-roofline"))
    full = run_point(32, 1, params, lin, am, seed=0, max_tokens=2048, budgets=("none", "class-roofline"), all_gpus=True)
    assert pr["simulated_gpus"] < 32
    for p in ("none", "class-roofline"):
        assert pr[p]["makespan_s"] == pytest.approx(full[p]["makespan_s"])


def test_trace_input(tmp_path):
    from benchmarks import predictor as predictor_cli
    from integrations.data.trace import Rollout, write_trace

    rng = np.random.default_rng(0)
    rows = []
    for it in range(3):
        for p in range(6):
            base = 50 + 60 * p
            for s in range(4):
                n = int(min(512, base + rng.integers(0, 40)))
                rows.append(Rollout(it, it + 1, f"q{p}", s, [1, 2, 3], [7] * n, "stop"))
    path = write_trace(tmp_path / "t.parquet", rows)
    out = main(["--trace", str(path), "--gpus", "2", "--max-tokens", "512", "--plot", "none", "--seeds", "1", "--placements", "none", "--policies", "none,eq7"])
    assert set(out["trace_setting"]) >= {"none", "eq7"}
    assert out["trace_setting"]["none"]["tokens"] == sum(len(r.output_ids) for r in rows if r.iteration == 2)
    ev = predictor_cli.main(["--trace", str(path), "--max-tokens", "512"])
    assert ev["checkpoints"]["0"]["predictor"]["n"] == 2 * 6 * 4


def test_priced_budgets_draft_what_pays_at_the_simulated_price(small):
    """``cost`` and ``makespan`` run in the simulator at the step price fitted online to the GPU's
    step times (the product's), at the Eq. 1 line fitted offline (``price="linear"``: a draft
    token costs a row's token) and at the roofline's own price (``price="roofline"``: drafts free
    below the knee): they draft less than ``fixed`` at the line, more where drafts are free; the
    online fit, on steps that all lie below the knee here, prices a draft token at a fraction of
    the offline line's."""
    work, params, lin = small
    fresh = requests_factory(work, params)
    fixed = run_config(work, fresh, "fixed", "none", 2, params, lin, seed=1)
    for budget in ("cost", "makespan"):
        line = run_config(work, fresh, budget, "none", 2, params, lin, seed=1, price="linear")
        knee = run_config(work, fresh, budget, "none", 2, params, lin, seed=1, price="roofline")
        online = run_config(work, fresh, budget, "none", 2, params, lin, seed=1)
        assert 0 < line["drafted_per_token"] < fixed["drafted_per_token"]
        assert knee["drafted_per_token"] > line["drafted_per_token"]
        assert online["cost_fit_gpu0"]["c_draft"] < 0.5 * lin["c_tok"]
        assert online["drafted_per_token"] > (0.95 if budget == "cost" else 1.1) * line["drafted_per_token"]
        assert knee["tokens"] == online["tokens"] == pytest.approx(work["lengths"].sum())
    with pytest.raises(ValueError, match="price"):
        run_config(work, fresh, "cost", "none", 2, params, lin, price="flat")
