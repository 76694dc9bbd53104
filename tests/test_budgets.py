"""The speculation budgets: the registry of names and each budget class on a StepView (no vLLM)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import budgets
from scheduler.budget_protocol import Budget, BudgetSetting, Drafts, PricedBudget, RowFacts, StepView, allot_in_order
from scheduler.budgets import FixedBudget, NoneBudget, RequestCaps, make_budget
from scheduler.drain_plan import CostModel, DrainPlanBudget
from scheduler.length_classes import DAS_GATE, DAS_QUOTA, ClassBudget, ClassRooflineBudget, PublishedClassBudget
from scheduler.priced_budgets import CostBudget, MakespanBudget, choose_drafts, keep_bound
from scheduler.step_price import LinearPrice

C_BASE, C_TOK = 6.3e-3, 23.8e-6
SEEDS_ = st.integers(0, 2**32 - 1)


def _view(pred, pids, generated, *, caps=16, live=None, drafted=None, accepted=None, steps=None, max_tokens=16384):
    n = len(pids)
    live = np.ones(n, bool) if live is None else np.asarray(live, bool)
    zeros = np.zeros(int(live.sum()))

    def facts():
        rows = np.flatnonzero(live)
        return RowFacts(pred, pred.index([pids[r] for r in rows]), np.asarray(generated, np.float64)[rows], np.full(rows.size, max_tokens),
                        zeros if drafted is None else drafted, zeros if accepted is None else accepted, zeros if steps is None else steps)

    return StepView(np.where(live, caps, 0), live, facts=facts)


# ---------------------------------------------------------------- the registry
def test_every_budget_is_one_registered_class_with_its_name():
    assert budgets.names() == ("none", "fixed", "cost", "makespan", "class", "class-eq9", "class-roofline", "eq7")
    for name, cls in budgets.BUDGETS.items():
        assert issubclass(cls, Budget) and cls.name == name and cls.summary and cls.runs_in
    assert budgets.names("proposer") == ("none", "fixed", "cost", "makespan", "class", "eq7")
    assert budgets.names("grpo") == ("none", "fixed", "class")
    assert set(budgets.names("simulator")) >= {"none", "fixed", "cost", "makespan", "class-eq9", "class-roofline", "eq7"}


def test_bad_names_list_the_valid_ones_and_former_names_give_the_new_one():
    with pytest.raises(ValueError, match=r"unknown budget 'greedy'; expected one of \['none', 'fixed'"):
        make_budget("greedy")
    for old, new in budgets.RENAMED.items():
        with pytest.raises(ValueError, match=f"budget '{old}' is now called '{new}'"):
            make_budget(old, "simulator")
    with pytest.raises(ValueError, match="'class-eq9' runs only in the simulator"):
        make_budget("class-eq9", "proposer")
    with pytest.raises(ValueError, match="must be a string"):
        budgets.resolve(7)
    with pytest.raises(ValueError, match="offline"):
        make_budget("class-eq9", "simulator")


def test_make_budget_builds_each_class_from_the_setting():
    cost = CostModel()
    s = BudgetSetting(max_draft=8, cost=cost, offline_cost=(C_BASE, C_TOK), class_caps=(12, 3, 1), draft_while_unfitted=True)
    built = {n: make_budget(n, None, s) for n in budgets.names()}
    assert {n: type(b) for n, b in built.items()} == budgets.BUDGETS
    assert built["class"].table.tolist() == [1, 3, 8]  # (short, medium, long), each at most K
    assert built["eq7"].cost is cost and built["eq7"].draft_while_unfitted and built["eq7"].max_draft == 8
    assert (built["class-eq9"].c_base, built["class-eq9"].gate, built["class-eq9"].quota_tokens) == (C_BASE, DAS_GATE, DAS_QUOTA)


# ---------------------------------------------------------------- before the drafter
def test_none_and_fixed():
    step = StepView(np.array([16, 3, 0]), np.array([True, True, False]))
    assert NoneBudget().plan(step).tolist() == [0, 0, 0]
    assert FixedBudget().plan(step).tolist() == [16, 3, 0]
    assert FixedBudget().keep(step, Drafts(np.ones((3, 2)), np.array([2, 1, 0]))) is None  # keeps every drafted token
    assert FixedBudget(5).request_caps(None, np.arange(3)).tolist() == [5, 5, 5]


def test_class_budget_caps_by_length_class_and_never_above_the_rows_own(length_history):
    pred = length_history
    b = ClassBudget(max_draft=16)
    step = _view(pred, ["short0", "long0", "long1", "short1"], [0, 0, 10000, 0], caps=np.array([16, 16, 5, 16]))
    assert b.plan(step).tolist() == [0, 16, 5, 0]
    order = b.priority(step)
    assert set(order[:2].tolist()) == {1, 2}  # Long first
    assert b.request_caps(pred, pred.index(["short0", "long0"])).tolist() == [0, 16]
    not_live = _view(pred, ["short0", "long0"], [0, 0], live=[True, False])
    assert b.plan(not_live).tolist() == [0, 0]
    assert b.plan(StepView(np.zeros(2, np.int64), np.zeros(2, bool))).tolist() == [0, 0]  # no live row: no facts read


def test_eq7_budget_waits_for_its_cost_model_or_drafts_freely_while_unfitted(length_history):
    pred = length_history
    step = _view(pred, ["short0", "long0"], [0.0, 0.0])
    assert DrainPlanBudget(CostModel(), seed=None).plan(step).tolist() == [0, 0]
    assert DrainPlanBudget(CostModel(), seed=None, draft_while_unfitted=True).plan(step).tolist() == [16, 16]
    fitted = DrainPlanBudget(CostModel(prior=(C_BASE, C_TOK)), seed=None).plan(_view(pred, ["short0", "long0"], [0.0, 0.0]))
    assert fitted[0] == 0 and 0 < fitted[1] <= 16


def test_class_eq9_gates_large_batches_and_spends_its_quota_long_first(length_history):
    pred = length_history
    b = PublishedClassBudget(16, C_BASE, C_TOK)
    big = _view(pred, ["long0"] * (DAS_GATE + 1), np.zeros(DAS_GATE + 1))
    assert b.plan(big).sum() == 0 and b.replan_at_events
    small = _view(pred, ["short0", "long0", "long1"], [0.0, 0.0, 0.0])
    caps = b.plan(small)
    assert not b.replan_at_events and caps[0] == 0 and caps[1] > 0 and b.last_budgets[2] == caps[1]
    quota = PublishedClassBudget(16, C_BASE, C_TOK, quota_tokens=5)
    kept = quota.keep(small, Drafts(np.ones((3, 4)), np.array([4, 4, 4])))
    assert kept.sum() == 5 and kept[0] == 0  # the quota goes to the Long rows


def test_class_roofline_spends_the_prices_free_draft_tokens_in_class_order(length_history):
    pred = length_history
    b = ClassRooflineBudget()
    step = _view(pred, ["short0", "long0", "long1"], [0.0, 0.0, 0.0])
    assert b.plan(step).tolist() == [16, 16, 16]
    drafts = Drafts(np.ones((3, 8)), np.array([8, 8, 8]))
    step.price = LinearPrice(0.01, 0.01, 1e-4, 0.01, 1e-5, free_drafts=10.0)
    kept = b.keep(step, drafts)
    assert kept.sum() == 10 and kept[0] == 0
    step.price = LinearPrice.given(C_BASE, C_TOK, 3)  # a linear price has no knee: nothing is free
    assert b.keep(step, drafts).sum() == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 20), min_size=1, max_size=12), st.floats(0, 100), st.randoms(use_true_random=False))
def test_allot_in_order_serves_rows_in_order_up_to_the_budget(want, budget, rnd):
    want = np.array(want)
    order = np.array(rnd.sample(range(want.size), want.size))
    running = np.array([rnd.random() < 0.8 for _ in range(want.size)])
    got = allot_in_order(want, order, running, budget)
    assert np.all(got <= want + 1e-12) and np.all(got[~running] == 0)
    assert got.sum() == pytest.approx(min(budget, want[running].sum()))
    served = [i for i in order if running[i] and want[i] > 0]
    partial = [i for i in served if 0 < got[i] < want[i]]
    assert len(partial) <= 1  # only the last row served gets a part
    full = [got[i] == want[i] for i in served]
    assert full == sorted(full, reverse=True)  # once a row is short, no later row gets anything


# ---------------------------------------------------------------- after the drafter: priced budgets
def _priced(step, price, calibration=None):
    step.price = price
    step.calibration = np.ones(step.rows) if calibration is None else calibration
    return step


def test_cost_budget_keeps_what_the_throughput_rule_keeps():
    probs = np.array([[0.9, 0.8, 0.3], [0.5, 0.2, 0.0]], np.float32)
    drafts = Drafts(probs, np.array([3, 2]))
    price = LinearPrice.given(0.02, 0.002, 2)
    b = CostBudget()
    step = _priced(StepView(np.array([3, 3])), price)
    kept = b.keep(step, drafts)
    assert kept.tolist() == choose_drafts(probs, *price.as_tuple(), lengths=np.array([3, 2])).tolist()
    assert b.can_pay(step, np.array([3, 3]), 0.9) and not b.can_pay(_priced(StepView(np.array([3, 3])), LinearPrice.given(1e-5, 0.01, 2)),
                                                                       np.array([3, 3]), 0.99)


def test_cost_budget_cuts_its_drafts_at_the_keep_bound():
    b = CostBudget()
    price = LinearPrice.given(0.05, 0.001, 4)
    assert b.cutoff(_priced(StepView(np.full(4, 8)), price)) == pytest.approx(keep_bound(4, *price.as_tuple()))
    assert isinstance(b, PricedBudget) and not isinstance(FixedBudget(), PricedBudget)
    knee = LinearPrice(0.05, 0.05, 0.001, 0.05, 0.001, free_drafts=4.0)
    assert b.cutoff(_priced(StepView(np.full(4, 8)), knee)) is None  # a knee price: no cut, and the gate passes
    assert b.can_pay(_priced(StepView(np.full(4, 8)), knee), np.full(4, 8), 0.01)


def test_makespan_budget_values_the_row_that_finishes_last(length_history):
    pred = length_history
    b = MakespanBudget()
    step = _priced(_view(pred, ["short0"] * 7 + ["long0"], np.zeros(8)), LinearPrice(0.2, 0.2, 0.004, 0.07, 0.004))
    v = b.values(step)
    assert v is b.values(step)  # once per step
    assert v[-1] == v.max() and v[0] < v[-1] and np.all(v >= 0.004)
    cut = b.cutoff(step)
    assert np.shape(cut) == (8,) and cut[-1] == cut.min()  # each row its own bound: the last row's token is worth the most
    probs = np.tile(np.array([0.5, 0.3, 0.2], np.float32), (8, 1))
    kept = b.keep(step, Drafts(probs, np.full(8, 3)))
    assert kept[-1] > 0 and kept[:-1].sum() == 0
    assert b.values(_priced(StepView(np.zeros(2, np.int64), np.zeros(2, bool)), LinearPrice.given(0.02, 0.001, 2))) is None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(SEEDS_, st.sampled_from([CostBudget, MakespanBudget]))
def test_priced_budgets_keep_exactly_the_price_rule_at_a_linear_price(length_history, seed, cls):
    """At a linear price (no knee) the rows' predicted lengths weigh nothing in the free drafts:
    the budget keeps what :func:`choose_drafts` keeps from the probabilities (and, for
    ``makespan``, its values) alone, on random batches."""
    rng = np.random.default_rng(seed)
    rows, k = int(rng.integers(1, 48)), int(rng.integers(1, 17))
    pids = [f"{'long' if rng.random() < 0.5 else 'short'}{rng.integers(10)}" for _ in range(rows)]
    b = cls()
    step = _priced(_view(length_history, pids, rng.integers(0, 12000, rows).astype(np.float64)),
                   LinearPrice.given(float(rng.uniform(1e-3, 0.05)), float(rng.uniform(1e-6, 1e-3)), rows))
    probs = np.sort(rng.random((rows, k)), axis=1)[:, ::-1].astype(np.float32)
    drafts = Drafts(probs, rng.integers(0, k + 1, rows))
    assert b.free_weights(step) is None
    want = choose_drafts(probs, *step.price.as_tuple(), step.calibration, values=b.values(step), lengths=drafts.lengths)
    assert b.keep(step, drafts).tolist() == want.tolist()


@pytest.mark.parametrize("cls", [CostBudget, MakespanBudget])
def test_under_a_knee_the_row_predicted_to_finish_last_gets_the_free_drafts_first(length_history, cls):
    b = cls()
    step = _priced(_view(length_history, ["short0", "long0"], np.zeros(2)), LinearPrice(0.01, 0.01, 1.0, 0.01, 1e-5, free_drafts=4.0))
    w = b.free_weights(step)
    assert w[1] == 1.0 and w[0] < w[1]
    probs = np.array([[0.9, 0.9, 0.9, 0.9], [0.6, 0.6, 0.6, 0.6]], np.float32)  # the short row's drafts are likelier
    assert b.keep(step, Drafts(probs, np.array([4, 4]))).tolist() == [0, 4]


# ---------------------------------------------------------------- at submission (the GRPO loop)
def test_request_caps_give_no_cap_before_history_then_the_class_cap():
    rc = RequestCaps("class", max_tokens=16384, max_draft=16, window=4)
    assert rc.caps(["a", "b"]) == [None, None]
    rc.observe(0, ["a"] * 8 + ["b"] * 8, [300] * 8 + [15000] * 8)
    assert rc.caps(["a", "b"]) == [0, 16]
    assert RequestCaps("fixed", max_tokens=100, max_draft=6).budget.request_caps(None, np.arange(2)).tolist() == [6, 6]
    with pytest.raises(ValueError, match="'cost' runs only in the proposer and simulator"):
        RequestCaps("cost", max_tokens=100, max_draft=6)


def test_hosts_outside_the_scheduler_call_only_what_the_budget_protocol_declares():
    """The simulator's and the proposer's budget objects are reached only through the names that
    :class:`Budget` and :class:`PricedBudget` declare (no method a single budget class adds)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    declared = set(dir(PricedBudget))
    for rel, least in (("benchmarks/sim_budget.py", 5), ("integrations/vllm_ext/proposer.py", 0)):  # the proposer reaches it through the planner
        used = set(re.findall(r"\bbudget\.([A-Za-z_]\w*)", (root / rel).read_text()))
        assert len(used) >= least and used <= declared, (rel, sorted(used - declared))
