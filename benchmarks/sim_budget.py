"""Speculation budgets on the simulated GPUs: the scheduler's budget classes and planner, one instance per GPU.

The simulator runs the budgets the product runs (:mod:`scheduler.budgets`; the former names
``unlimited``, ``das`` and ``das-roofline`` are refused with the new one), each behind the
product's own :class:`scheduler.planner.StepPlanner`. :class:`SimBudget` is the simulator's host
for one, as the vLLM proposer is the product's: at each re-plan it builds the
:class:`scheduler.budget_protocol.StepView` of its GPU's rows, asks the planner for the plan
(:meth:`StepPlanner.plan`: the tail rule, the budget's caps and, for a priced budget, the warm-up,
the plain steps that keep the price measured, the payoff guard, exploration and the gate), drafts
once from the acceptance model, and asks the planner which drafted tokens the steps verify
(:meth:`StepPlanner.keep`). It sets each row's draft cap (``Requests.caps``) and the priority
order (``Gpu.order``, highest first), and tells the step loop (:mod:`benchmarks.sim_engine`) how to
spend them: ``spec_on`` (the drafter runs; its CPU time is charged), ``kv_aware`` (drafts never
force a preemption), ``quota_mode`` / ``quota`` (draft tokens per step: 0 unlimited, 1 fixed, 2
the roofline knee, from the budget's ``quota``) and ``gate`` (no drafts while more rows run; -1:
none). A plan holds for the steps until the next re-plan (``replan_every``), where the product
plans every step; a plain step that keeps the price measured holds for one step (``one_step``).

Where the product measures, the simulator stands in with its models:

* a priced budget (``cost``, ``makespan``) is priced, as in the product, by the step price the
  planner fits online to the GPU's own step times (``price="online"``: every step's rows, draft
  tokens, KV tokens, accepted tokens and seconds with 5% noise go to
  :meth:`StepPlanner.record_step` on the simulated clock, prefill steps marked unclean; the
  simulated roofline plays the engine, the planner sees only step times). Each row's draft
  candidates have path probabilities from the acceptance model (perfectly calibrated: draft token
  ``j`` of a row is accepted with probability ``tau(j) - tau(j - 1)``, the expected tokens per step
  ``tau`` of the row's state, up to the drafter's natural draft length outside a loop and K in
  one), so the planner's calibration gets no verification outcomes and stays at its prior.
  Ablations (``benchmarks.simulate --price-ablations``): ``price="linear"``, the Eq. 1 line fitted
  offline to the step-cost model (:func:`benchmarks.sim_workload.fit_linear_cost`, the constants
  ``class-eq9`` gets) given to the planner as ``c_base``/``c_tok``, and ``price="roofline"``, the
  roofline's own price at the step (a plain step's seconds, draft tokens free up to its knee,
  :meth:`benchmarks.sim_workload.Roofline.free_draft_tokens`, and priced at their compute above it:
  what a perfect fit would know), handed to :meth:`StepPlanner.plan`;
* ``eq7`` fits its Eq. 1 + context cost model online from every simulated step time with 5% noise;
* ``class-eq9`` gets the same offline Eq. 1 constants, as the paper fits them offline.

All speculative budgets are KV-aware unless built with ``kv_aware=False``.
"""

from __future__ import annotations

import numpy as np

from scheduler import budgets
from scheduler.budget_protocol import Budget, Drafts, PricedBudget, RowFacts, StepView
from scheduler.drain_plan import CostModel
from scheduler.planner import BATCH_DRAFT, StepPlanner
from scheduler.predictor import LengthPredictor
from scheduler.step_price import LinearPrice

BUDGETS = budgets.names("simulator")  # none, fixed, cost, makespan, class-eq9, class-roofline, eq7
QUOTA_MODES = {None: 0, "fixed": 1, "knee": 2}  # a budget's quota rule -> the step loop's quota_mode
PRICES = ("online", "linear", "roofline")  # a priced budget's step price (module doc)


class SimBudget:
    """One GPU's speculation budget behind the product's planner (module doc).

    Args:
        budget: the budget (:func:`scheduler.budgets.make_budget`).
        predictor: the length predictor of the workload (None: the budget reads no lengths).
        max_draft: K, the engine's most draft tokens per row and step.
        linear_cost: ``{"c_base", "c_tok"}``, the Eq. 1 line fitted offline (``price="linear"``).
        cost: the online cost model a ``uses_cost_fit`` budget reads (fed by :meth:`observe`).
        seed: seed of the step-time noise the fits see.
        noise: relative noise of those step times.
        kv_aware: drafts never force a preemption.
        price: of a priced budget, one of :data:`PRICES` (module doc).
        batch_draft: the most draft tokens per row before the long tail (the planner's
            :class:`scheduler.planner.TailDrafts`: a priced budget's rows may draft up to K in the tail).

    Raises:
        ValueError: ``price`` not one of :data:`PRICES`.
    """

    def __init__(self, budget: Budget, predictor: LengthPredictor | None, max_draft: int, linear_cost: dict, *, cost: CostModel | None = None,
                 seed: int = 0, noise: float = 0.05, kv_aware: bool = True, price: str = "online", batch_draft: int = BATCH_DRAFT):
        if price not in PRICES:
            raise ValueError(f"price must be one of {PRICES}, got {price!r}")
        self.price = price
        self.priced = isinstance(budget, PricedBudget)
        given = (float(linear_cost["c_base"]), float(linear_cost["c_tok"])) if self.priced and price == "linear" else None
        self.max_draft = int(max_draft)
        self.planner = StepPlanner(budget, cost=cost, given_costs=given, max_draft=self.max_draft, batch_draft=batch_draft)
        self.measures = self.priced and price == "online"  # the planner fits the step price to this GPU's step times
        self.clock = 0.0  # the simulated clock as the planner sees it (noisy step times)
        self.budget = budget
        self.name = budget.name
        self.pred = predictor
        self.linear_cost = linear_cost
        self.cost = cost
        self.dynamic = not budget.static
        self.spec_on = budget.drafts
        self.one_step = False  # the plan holds for one step only (the planner's plain step)
        self.kv_aware = kv_aware
        self.quota_mode = QUOTA_MODES[budget.quota]
        self.quota = float(budget.quota_tokens)
        self.noise = float(noise)
        self.rng = np.random.default_rng(seed + 7919)

    @property
    def tail(self):
        """The planner's :class:`scheduler.planner.TailDrafts`."""
        return self.planner.tail

    @property
    def gate(self) -> int:
        return int(self.budget.gate)

    @gate.setter
    def gate(self, value: int) -> None:
        self.budget.gate = int(value)

    @property
    def replan_on_events(self) -> bool:
        return bool(self.budget.replan_at_events)  # a gated class-eq9 opens at a finish

    def plan(self, gpu, rows: np.ndarray) -> None:
        """Caps and priority of ``rows`` (the GPU's running rows; all its members for a static budget)."""
        r = gpu.req
        n = rows.size
        step = StepView(np.full(n, self.max_draft, np.int64), facts=lambda: RowFacts(
            self.pred, r.problem_idx[rows], r.gen[rows], np.full(n, float(gpu.p.max_tokens)), r.drafted[rows], r.accepted[rows],
            r.steps[rows], context=r.prompt[rows] + r.gen[rows]))
        plan = self.planner.plan(step, price=self.roofline_price(gpu, rows) if self.priced and self.price == "roofline" else None)
        caps = plan.caps
        self.one_step = plan.plain
        if self.priced:  # the drafter runs once, at the plan; the planner keeps what the steps verify
            self.spec_on = bool(caps.any())
            caps = self.planner.keep(step, self.candidates(gpu, rows, caps, plan.min_prob))
        r.caps[rows] = caps
        order = self.budget.priority(step)
        gpu.order = rows.copy() if order is None else rows[order]

    def roofline_price(self, gpu, rows: np.ndarray) -> LinearPrice:
        """The roofline's own price of a step of ``rows`` (``price="roofline"``): its fixed cost is
        the whole plain step, a row's own cost its KV read, draft tokens free up to the knee."""
        n = rows.size
        roof = gpu.p.roof
        ctx = float((gpu.req.prompt[rows] + gpu.req.gen[rows]).sum())
        plain = float(roof.step_time(n, ctx, ctx + n))
        per_draft = (roof.flops_per_token + roof.attn_flops_per_pair * ctx / max(n, 1)) / roof.flops_per_s
        per_row = roof.kv_bytes_per_token * ctx / max(n, 1) / roof.bytes_per_s
        return LinearPrice(plain, plain, per_draft, plain, per_row, free_drafts=roof.free_draft_tokens(n, ctx))

    def candidates(self, gpu, rows: np.ndarray, caps: np.ndarray, min_prob: np.ndarray | None = None) -> Drafts:
        """Each row's draft candidates from the acceptance model: path probability of draft token
        ``j`` = ``tau(j) - tau(j - 1)`` of the row's state (its finished siblings on this GPU, or
        its loop), at most ``ceil(natural_draft)`` tokens outside a loop, K in one, and its cap;
        a row's draft stops below ``min_prob[r]`` (None: nowhere), as the drafter's does."""
        r = gpu.req
        k = self.max_draft
        sib = np.minimum(gpu.grp_done[r.group[rows]], r.tau_tab.shape[1] - 1)
        looping = r.gen[rows] >= r.loop_at[rows]
        tau = np.where(looping[:, None], r.tau_loop[None, :], r.tau_tab[rows, sib, :])  # [n, K + 1]
        probs = np.clip(np.diff(tau, axis=1), 0.0, 1.0)
        natural = min(k, int(np.ceil(r.nat_draft)))
        lengths = np.minimum(np.where(looping, k, natural), caps).astype(np.int64)
        if min_prob is not None:
            lengths = np.minimum(lengths, (probs >= np.asarray(min_prob, np.float64)[:, None]).sum(axis=1))
        return Drafts(probs, np.maximum(lengths, 0))

    def observe(self, gpu, steps: dict) -> None:
        """The steps just run (the GPU's step records: ``b`` rows, ``d`` draft tokens, ``pre``
        prefill tokens, ``n`` tokens, ``ctx`` KV tokens read, ``a`` accepted draft tokens, ``dt``
        seconds), their times with ``noise``: on the simulated clock into the planner (a priced
        budget's online price; steps with prefill are not clean, as the product's), or into the
        Eq. 1 cost model of ``eq7``."""
        if not self.measures and (self.cost is None or not self.budget.uses_cost_fit):
            return
        noisy = steps["dt"] * np.exp(self.noise * self.rng.standard_normal(steps["dt"].size))
        if not self.measures:
            self.cost.observe(steps["n"], noisy, steps["ctx"])
            return
        ends = self.clock + np.cumsum(noisy)
        self.clock = float(ends[-1])
        for t, b, d, n, ctx, pre, a in zip(ends.tolist(), steps["b"].tolist(), steps["d"].tolist(), steps["n"].tolist(),
                                           steps["ctx"].tolist(), steps["pre"].tolist(), steps["a"].tolist()):
            self.planner.record_step(t, b, d, n, ctx, pre == 0, a)

    def cost_fit(self) -> dict | None:
        """The online fit's coefficients (None: the budget reads none, or not fitted yet): the
        planner's step price (with its ``knee``) for a priced budget, the Eq. 1 model's for ``eq7``."""
        if self.measures:
            return self.planner.regimes.coefficients() if self.planner.regimes.ready else None
        return self.cost.coefficients() if self.cost is not None and self.budget.uses_cost_fit else None


def make_sim_budget(name: str, predictor: LengthPredictor | None, max_draft: int, linear_cost: dict, *, seed: int = 0,
                    kv_aware: bool = True, price: str = "online", batch_draft: int = BATCH_DRAFT) -> SimBudget:
    """A fresh per-GPU budget ``name`` (one offered in the simulator). ``max_draft``: K;
    ``linear_cost``: the offline Eq. 1 fit (``c_base``, ``c_tok``); ``batch_draft``: the cap before
    the long tail (:class:`SimBudget`).

    Raises:
        ValueError: an unknown or former name (the message gives the valid or the new one).
    """
    cost = CostModel(use_context=True, min_samples=16, forgetting=0.999)
    offline = (linear_cost["c_base"], linear_cost["c_tok"]) if "c_base" in linear_cost else None
    setting = budgets.BudgetSetting(max_draft=max_draft, cost=cost, offline_cost=offline, seed=seed)
    budget = budgets.make_budget(name, "simulator", setting)
    return SimBudget(budget, predictor, max_draft, linear_cost, cost=cost, seed=seed, kv_aware=kv_aware, price=price, batch_draft=batch_draft)
