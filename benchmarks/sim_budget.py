"""Speculation budgets on the simulated GPUs: the scheduler's budget classes, one instance per GPU.

The simulator runs the budgets the product runs (:mod:`scheduler.budgets`; the former names
``unlimited``, ``das`` and ``das-roofline`` are refused with the new one). :class:`SimBudget` is
the simulator's host for one: at each re-plan it builds the
:class:`scheduler.budget_protocol.StepView` of its GPU's rows, sets each row's draft cap
(``Requests.caps``) and the priority order (``Gpu.order``, highest first), and tells the step loop
(:mod:`benchmarks.sim_engine`) how to spend them: ``spec_on`` (the drafter runs; its CPU time is
charged), ``kv_aware`` (drafts never force a preemption), ``quota_mode`` / ``quota`` (draft tokens
per step: 0 unlimited, 1 fixed, 2 the roofline knee, from the budget's ``quota``) and ``gate`` (no
drafts while more rows run; -1: none).

Where the product measures, the simulator stands in with its models:

* a priced budget (``cost``, ``makespan``) gets, as in the product, the step price fitted online
  to the GPU's own step times (``price="online"``: :class:`scheduler.step_price.StepPrice`, the
  two-regime line or a knee where the steps show one, fed each clean step's rows, draft tokens and
  seconds with 5% noise; the simulated roofline plays the engine, the budget sees only step
  times; as the product's planner, a step after :data:`scheduler.planner.PLAIN_EVERY` drafting
  ones drafts nothing, so that the fit keeps seeing plain steps, unless drafting pays at least
  :data:`scheduler.planner.PLAIN_PAYOFF` times a plain step's tokens per second: the product
  measures that, the simulator takes the re-plan's expected tokens at its price). Until that
  fit is ready (both regimes seen), re-plans alternate between no drafts and drafts priced by the
  Eq. 1 line fitted offline (the product's warm-up alternates plain and drafting steps). Each
  row's draft candidates have path probabilities from the acceptance model (perfectly
  calibrated: draft token ``j`` of a row is accepted with probability
  ``tau(j) - tau(j - 1)``, the expected tokens per step ``tau`` of the row's state, up to the
  drafter's natural draft length outside a loop and K in one); a re-plan where no draft can pay
  turns the drafter off (the product skips its lookups then). Ablations (``benchmarks.simulate
  --price-ablations``): ``price="linear"``, the Eq. 1 line fitted offline to the step-cost model
  (:func:`benchmarks.sim_workload.fit_linear_cost`, the constants ``class-eq9`` gets), and
  ``price="roofline"``, the roofline's own price at the step (a plain step's seconds, draft tokens
  free up to its knee, :meth:`benchmarks.sim_workload.Roofline.free_draft_tokens`, and priced at
  their compute above it: what a perfect fit would know);
* ``eq7`` fits its Eq. 1 + context cost model online from the simulated step times with 5% noise;
* ``class-eq9`` gets the same offline Eq. 1 constants, as the paper fits them offline.

All speculative budgets are KV-aware unless built with ``kv_aware=False``.
"""

from __future__ import annotations

import numpy as np

from scheduler import budgets
from scheduler.budget_protocol import Budget, Drafts, PricedBudget, RowFacts, StepView
from scheduler.drain_plan import CostModel
from scheduler.planner import BATCH_DRAFT, PLAIN_EVERY, PLAIN_PAYOFF, TailDrafts
from scheduler.predictor import LengthPredictor
from scheduler.step_price import LinearPrice, StepPrice

BUDGETS = budgets.names("simulator")  # none, fixed, cost, makespan, class-eq9, class-roofline, eq7
QUOTA_MODES = {None: 0, "fixed": 1, "knee": 2}  # a budget's quota rule -> the step loop's quota_mode
PRICES = ("online", "linear", "roofline")  # a priced budget's step price (module doc)


class SimBudget:
    """One GPU's speculation budget (module doc).

    Args:
        budget: the budget (:func:`scheduler.budgets.make_budget`).
        predictor: the length predictor of the workload (None: the budget reads no lengths).
        max_draft: K, the engine's most draft tokens per row and step.
        linear_cost: ``{"c_base", "c_tok"}``, the Eq. 1 line fitted offline (a priced budget's price).
        cost: the online cost model an ``uses_cost_fit`` budget reads (fed by :meth:`observe`).
        seed: seed of the step-time noise the cost model sees.
        noise: relative noise of those step times.
        kv_aware: drafts never force a preemption.
        price: of a priced budget, one of :data:`PRICES` (module doc).
        batch_draft: the most draft tokens per row before the long tail
            (:class:`scheduler.planner.TailDrafts`, as the product's planner: a priced budget's
            rows may draft up to K in the tail).
    """

    def __init__(self, budget: Budget, predictor: LengthPredictor | None, max_draft: int, linear_cost: dict, *, cost: CostModel | None = None,
                 seed: int = 0, noise: float = 0.05, kv_aware: bool = True, price: str = "online", batch_draft: int = BATCH_DRAFT):
        if price not in PRICES:
            raise ValueError(f"price must be one of {PRICES}, got {price!r}")
        self.price = price
        self.fit = StepPrice(refit_every=4) if isinstance(budget, PricedBudget) and price == "online" else None  # the online step price
        self.plain_every = PLAIN_EVERY + 1 if self.fit is not None else 0  # the step loop drafts nothing in every such step
        self.plans = 0
        self.budget = budget
        self.name = budget.name
        self.pred = predictor
        self.max_draft = int(max_draft)
        self.tail = TailDrafts(self.max_draft, batch_draft, extends=isinstance(budget, PricedBudget))
        self.linear_cost = linear_cost
        self.cost = cost
        self.dynamic = not budget.static
        self.spec_on = budget.drafts
        self.kv_aware = kv_aware
        self.quota_mode = QUOTA_MODES[budget.quota]
        self.quota = float(budget.quota_tokens)
        self.noise = float(noise)
        self.rng = np.random.default_rng(seed + 7919)

    @property
    def gate(self) -> int:
        return int(self.budget.gate)

    @gate.setter
    def gate(self, value: int) -> None:
        self.budget.gate = int(value)

    @property
    def replan_on_events(self) -> bool:
        return bool(getattr(self.budget, "replan_at_events", False))  # a gated class-eq9 opens at a finish

    def plan(self, gpu, rows: np.ndarray) -> None:
        """Caps and priority of ``rows`` (the GPU's running rows; all its members for a static budget)."""
        r = gpu.req
        n = rows.size
        step = StepView(self.tail.limit(np.full(n, self.max_draft, np.int64)), facts=lambda: RowFacts(
            self.pred, r.problem_idx[rows], r.gen[rows], np.full(n, float(gpu.p.max_tokens)), r.drafted[rows], r.accepted[rows],
            r.steps[rows], context=r.prompt[rows] + r.gen[rows]))
        caps = self.budget.plan(step)
        if isinstance(self.budget, PricedBudget):
            step.price = self.step_price(gpu, rows)
            step.calibration = np.ones(n)
            drafts = self.candidates(gpu, rows, caps)
            offered = drafts.lengths > 0
            best = float(drafts.probs[offered, 0].max()) if offered.any() else 0.0
            warming = self.fit is not None and not self.fit.ready
            self.spec_on = self.budget.can_pay(step, caps, best) and not (warming and self.plans % 2 == 0)
            caps = np.minimum(self.budget.keep(step, drafts), drafts.lengths) if self.spec_on else np.zeros(n, np.int64)
            if self.fit is not None:
                kept = np.arange(drafts.probs.shape[1])[None, :] < caps[:, None]
                m = float(caps.sum())
                payoff = (n + float(drafts.probs[kept].sum())) / step.price.speculative_s(m) * step.price.plain_s / n if m else 0.0
                self.plain_every = 0 if payoff >= PLAIN_PAYOFF else PLAIN_EVERY + 1
            self.plans += 1
        r.caps[rows] = caps
        order = self.budget.priority(step)
        gpu.order = rows.copy() if order is None else rows[order]

    def step_price(self, gpu, rows: np.ndarray) -> LinearPrice:
        """The price of a step of ``rows`` (module doc): the online fit (the offline Eq. 1 line
        until it is ready), the offline line, or the roofline's own with its knee (a memory-bound
        step: its fixed cost is the whole plain step, a row's own cost its KV read)."""
        n = rows.size
        if self.fit is not None and self.fit.ready:
            return self.fit.price(n, float((gpu.req.prompt[rows] + gpu.req.gen[rows]).sum()))
        if self.price != "roofline":
            return LinearPrice.given(self.linear_cost["c_base"], self.linear_cost["c_tok"], n)
        roof = gpu.p.roof
        ctx = float((gpu.req.prompt[rows] + gpu.req.gen[rows]).sum())
        plain = float(roof.step_time(n, ctx, ctx + n))
        per_draft = (roof.flops_per_token + roof.attn_flops_per_pair * ctx / max(n, 1)) / roof.flops_per_s
        per_row = roof.kv_bytes_per_token * ctx / max(n, 1) / roof.bytes_per_s
        return LinearPrice(plain, plain, per_draft, plain, per_row, free_drafts=roof.free_draft_tokens(n, ctx))

    def candidates(self, gpu, rows: np.ndarray, caps: np.ndarray) -> Drafts:
        """Each row's draft candidates from the acceptance model: path probability of draft token
        ``j`` = ``tau(j) - tau(j - 1)`` of the row's state (its finished siblings on this GPU, or
        its loop), at most ``ceil(natural_draft)`` tokens outside a loop, K in one, and its cap."""
        r = gpu.req
        k = self.max_draft
        sib = np.minimum(gpu.grp_done[r.group[rows]], r.tau_tab.shape[1] - 1)
        looping = r.gen[rows] >= r.loop_at[rows]
        tau = np.where(looping[:, None], r.tau_loop[None, :], r.tau_tab[rows, sib, :])  # [n, K + 1]
        probs = np.clip(np.diff(tau, axis=1), 0.0, 1.0)
        natural = min(k, int(np.ceil(r.nat_draft)))
        lengths = np.minimum(np.where(looping, k, natural), caps).astype(np.int64)
        return Drafts(probs, np.maximum(lengths, 0))

    def observe(self, gpu, steps: dict) -> None:
        """The steps just run (the GPU's step records: ``b`` rows, ``d`` draft tokens, ``pre``
        prefill tokens, ``n`` tokens, ``ctx`` KV tokens read, ``dt`` seconds), their times with
        ``noise``, into the online fit a budget reads: the Eq. 1 cost model of ``eq7``, or the step
        price of a priced budget (only clean steps: no prefill in them, as the product's)."""
        if self.fit is None and (self.cost is None or not self.budget.uses_cost_fit):
            return
        noisy = steps["dt"] * np.exp(self.noise * self.rng.standard_normal(steps["dt"].size))
        if self.fit is not None:
            clean = steps["pre"] == 0
            self.fit.observe_steps(steps["b"][clean], steps["d"][clean], noisy[clean], steps["ctx"][clean])
        else:
            self.cost.observe(steps["n"], noisy, steps["ctx"])

    def cost_fit(self) -> dict | None:
        """The online fit's coefficients (None: the budget reads none, or not fitted yet): the
        step price's (with its ``knee``) for a priced budget, the Eq. 1 model's for ``eq7``."""
        if self.fit is not None:
            return self.fit.coefficients() if self.fit.ready else None
        return self.cost.coefficients() if self.cost is not None and self.budget.uses_cost_fit else None


def makesim_budget(name: str, predictor: LengthPredictor | None, max_draft: int, linear_cost: dict, *, seed: int = 0,
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
