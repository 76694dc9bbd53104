"""Speculation policies of the long-tail simulator (one object per GPU).

A policy sets, for the running rows of its GPU, a draft cap per row (``Requests.caps``) and a
priority order (``Gpu.order``, highest first), and declares how the engine spends them
(:mod:`benchmarks._sim_engine`): ``spec_on`` (the drafter runs; its CPU time is charged),
``kv_aware`` (drafts never force a preemption), ``quota_mode`` / ``quota`` (draft tokens per step:
0 unlimited, 1 fixed, 2 the roofline knee) and ``gate`` (no drafts while more rows run; -1: none).

Names and one-line summaries are those of :mod:`scheduler.budgets` (the budgets that run in the
simulator; the former names ``unlimited``, ``das`` and ``das-roofline`` are refused with the new one):

* ``none``: no speculation.
* ``fixed``: K drafts for every row in every step (the paper's "unlimited draft budget").
* ``class-eq9``: DAS's deployed class policy as published (arXiv 2511.13841): three length classes
  from the predictor (Short never drafts); Long and Medium budgets from Eq. 7 with ``N_fwd`` from
  Eq. 9 (per class: every request of a class planned at the class's mean predicted remaining
  length and mean estimated acceptance; Eq. 1 constants fitted offline to the step-cost model, as
  the paper fits them offline); a per-step quota of 160 draft tokens spent Long first, then by
  predicted remaining length; drafting only while at most 64 requests run (quota and gate: the
  authors' public fork of arctic-inference).
* ``class-roofline`` (ours, not the paper's): every row may draft up to K (the drafter's own stopping
  rule decides how many it proposes), but a step verifies at most as many draft tokens as fit
  under its roofline knee (the draft tokens it can verify before its compute time reaches its
  memory time, :meth:`Roofline.free_draft_tokens`), spent in DAS's class order (Long, Medium,
  Short; within a class by predicted remaining length). No batch gate: below the knee a draft is
  free, so the length classes decide who drafts only when the step is full.
* ``eq7``: the project's :class:`scheduler.SpeculationScheduler` ``eq7`` per request (Eq. 7 / 9 on
  predicted remaining lengths, per-request acceptance estimates, Eq. 1 + context cost fitted online
  from the simulated step times with 5% noise).

All speculative policies are KV-aware unless built with ``kv_aware=False``.

The scheduler package is used read-only; the class budgets with Eq. 9, the quota and the gate live
here (a scheduler change for them is for the lead: ``scheduler.ClassBudget`` has the gate but
neither Eq. 9 budgets nor a quota).
"""

from __future__ import annotations

import math

import numpy as np

from scheduler import CostModel, LengthPredictor, SpeculationScheduler, budgets, estimate_acceptance, optimal_proposals, solve_n_fwd
from scheduler.acceptance import DEFAULT_A, DEFAULT_K
from scheduler.predictor import LONG, MEDIUM, SHORT

POLICIES = budgets.names("simulator")  # none, fixed, class-eq9, class-roofline, eq7
DAS_QUOTA = 160  # draft tokens per engine step (the authors' public fork)
DAS_GATE = 64  # draft only with at most this many running requests (the same fork)


class Policy:
    name = "none"
    dynamic = False
    spec_on = False
    kv_aware = True
    quota_mode = 0
    quota = 0.0
    gate = -1
    replan_on_events = False

    def plan(self, gpu, rows: np.ndarray) -> None:
        gpu.req.caps[rows] = 0

    def observe(self, gpu, n_tokens, seconds, context) -> None:
        pass


class Unlimited(Policy):
    name = "fixed"
    spec_on = True

    def __init__(self, max_draft: int, *, kv_aware: bool = True):
        self.max_draft = int(max_draft)
        self.kv_aware = kv_aware

    def plan(self, gpu, rows):
        gpu.req.caps[rows] = self.max_draft
        gpu.order = gpu.mem.copy()


def class_budgets(cls, remaining, k, a, c_base: float, c_tok: float, max_draft: int) -> np.ndarray:
    """DAS class budgets from Eq. 7 / Eq. 9 (draft tokens per step; int ``[3]``: Short, Medium,
    Long).

    Every request of class ``c`` is planned at the class's mean ``remaining`` and mean ``k, a``;
    ``N_fwd`` solves Eq. 9 over the Medium and Long requests (Short never drafts), each gets Eq. 7's
    ``p_i`` spread over its passes, and the class budget is its mean rate rounded up, at most K.

    Args:
        cls: int ``[B]`` run-time class per request; remaining: float ``[B]`` predicted remaining
            tokens; k, a: float ``[B]`` acceptance estimates; c_base, c_tok: Eq. 1 constants.
    """
    cls = np.asarray(cls, np.int64)
    rem = np.asarray(remaining, np.float64)
    k = np.asarray(k, np.float64)
    a = np.asarray(a, np.float64)
    out = np.zeros(3, np.int64)
    live = cls != SHORT
    if not np.any(live):
        return out
    rr, kk, aa = np.empty(3), np.empty(3), np.empty(3)
    for c in (MEDIUM, LONG):
        m = cls == c
        if np.any(m):
            rr[c], kk[c], aa[c] = rem[m].mean(), k[m].mean(), a[m].mean()
    r_rep, k_rep, a_rep = rr[cls[live]], kk[cls[live]], aa[cls[live]]
    n_fwd = solve_n_fwd(r_rep, k_rep, a_rep, c_base, c_tok)
    p, passes = optimal_proposals(r_rep, k_rep, a_rep, n_fwd)
    rate = p / np.maximum(passes, 1.0)
    for c in (MEDIUM, LONG):
        m = cls[live] == c
        if np.any(m):
            out[c] = min(int(max_draft), int(math.ceil(float(rate[m].mean()) - 1e-9)))
    return out


class DasClass(Policy):
    """DAS's class policy as published (module doc)."""

    dynamic = True
    spec_on = True

    def __init__(
        self,
        predictor: LengthPredictor,
        max_draft: int,
        c_base: float,
        c_tok: float,
        *,
        quota_mode: int = 1,
        quota: float = DAS_QUOTA,
        gate: int = DAS_GATE,
        kv_aware: bool = True,
        name: str = "class-eq9",
    ):
        self.pred = predictor
        self.max_draft = int(max_draft)
        self.c_base, self.c_tok = float(c_base), float(c_tok)
        self.quota_mode, self.quota, self.gate = int(quota_mode), float(quota), int(gate)
        self.kv_aware = kv_aware
        self.name = name
        self.last_budgets = np.zeros(3, np.int64)
        self.gated = False

    @property
    def replan_on_events(self) -> bool:
        return self.gated  # the gate opens at a finish: re-plan then, not up to 16 steps later

    def plan(self, gpu, rows):
        r = gpu.req
        self.gated = self.gate >= 0 and rows.size > self.gate
        if self.gated:
            r.caps[rows] = 0
            return
        pr = self.pred.predict(r.problem_idx[rows], r.gen[rows])
        k, a = estimate_acceptance(r.drafted[rows], r.accepted[rows], r.steps[rows], DEFAULT_K, DEFAULT_A)
        b = class_budgets(pr.cls, pr.expected_remaining, k, a, self.c_base, self.c_tok, self.max_draft)
        self.last_budgets = b
        r.caps[rows] = b[pr.cls]
        gpu.order = rows[np.lexsort((-pr.expected_remaining, -pr.cls.astype(np.int64)))]


class RooflinePriority(Policy):
    """``class-roofline`` (module doc)."""

    name = "class-roofline"
    dynamic = True
    spec_on = True
    quota_mode = 2

    def __init__(self, predictor: LengthPredictor, max_draft: int, *, kv_aware: bool = True):
        self.pred = predictor
        self.max_draft = int(max_draft)
        self.kv_aware = kv_aware

    def plan(self, gpu, rows):
        r = gpu.req
        pr = self.pred.predict(r.problem_idx[rows], r.gen[rows])
        r.caps[rows] = self.max_draft
        gpu.order = rows[np.lexsort((-pr.expected_remaining, -pr.cls.astype(np.int64)))]


class Eq7(Policy):
    """The project's per-request Eq. 7 scheduler with its online cost model."""

    name = "eq7"
    dynamic = True
    spec_on = True

    def __init__(self, predictor: LengthPredictor, max_draft: int, *, seed: int = 0, noise: float = 0.05, kv_aware: bool = True):
        cost = CostModel(use_context=True, min_samples=16, forgetting=0.999)
        self.sched = SpeculationScheduler("eq7", max_draft=max_draft, predictor=predictor, cost=cost, seed=seed)
        self.pred = predictor
        self.kv_aware = kv_aware
        self.noise = float(noise)
        self.rng = np.random.default_rng(seed + 7919)

    def plan(self, gpu, rows):
        r = gpu.req
        rem = self.pred.predict(r.problem_idx[rows], r.gen[rows]).expected_remaining
        r.caps[rows] = self.sched.caps(
            r.problem_idx[rows], r.gen[rows], r.drafted[rows], r.accepted[rows], r.steps[rows],
            context_tokens=r.prompt[rows] + r.gen[rows], remaining=rem,
        )  # fmt: skip
        gpu.order = rows[np.argsort(-rem, kind="stable")]

    def observe(self, gpu, n_tokens, seconds, context):
        noisy = seconds * np.exp(self.noise * self.rng.standard_normal(seconds.size))
        self.sched.observe_step(n_tokens, noisy, context)

    def cost_fit(self):
        return self.sched.cost.coefficients()


def make_policy(name: str, predictor: LengthPredictor, max_draft: int, linear_cost: dict, *, seed: int = 0, kv_aware: bool = True) -> Policy:
    """A fresh per-GPU policy. ``linear_cost``: the offline Eq. 1 fit (``c_base``, ``c_tok``)."""
    name = budgets.resolve(name, "simulator")
    if name == "none":
        return Policy()
    if name == "fixed":
        return Unlimited(max_draft, kv_aware=kv_aware)
    if name == "class-eq9":
        return DasClass(predictor, max_draft, linear_cost["c_base"], linear_cost["c_tok"], kv_aware=kv_aware)
    if name == "class-roofline":
        return RooflinePriority(predictor, max_draft, kv_aware=kv_aware)
    if name == "eq7":
        return Eq7(predictor, max_draft, seed=seed, kv_aware=kv_aware)
    raise ValueError(f"unknown policy {name!r}; expected one of {POLICIES}")
