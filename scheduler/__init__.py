"""Length-aware scheduling for RL rollouts (the second half of DAS, arXiv 2511.13841).

* :mod:`scheduler.predictor`: :class:`LengthPredictor`: per-problem length history, Short /
  Medium / Long classes, run-time class and remaining-length updates; :func:`evaluate_predictor`.
* :mod:`scheduler.acceptance`: the Eq. 3-4 acceptance model, per step and per request estimates.
* :mod:`scheduler.calibration`: :class:`AcceptanceCalibration`, per-bin acceptance factors of
  draft tokens learned from verification outcomes (a reliability diagram, online).
* :mod:`scheduler.cost_model`: :class:`CostModel`, ``t_step = c_base + c_tok * n_tokens`` fitted
  online (Eq. 1).
* :mod:`scheduler.step_price`: :class:`LinearPrice`, a step's price as a budget reads it;
  :mod:`scheduler.regime_cost` (the two-regime line) and :mod:`scheduler.knee_cost`
  (:class:`KneeCost`: the line, or a knee below which draft tokens are free) fit it online.
* :mod:`scheduler.draft_selection`: which draft tokens pay for their verification at a price.
* :mod:`scheduler.tail_drafts`: :class:`TailDrafts`, the per-row draft cap: 16 before the long
  tail, the engine's K in it for a priced budget.
* :mod:`scheduler.budget_protocol`: what a speculation budget is (:class:`Budget`,
  :class:`StepView`, :class:`Drafts`); the budgets: :mod:`scheduler.budgets` (the registry of
  names, ``none``, ``fixed``), :mod:`scheduler.class_budgets` (``class``, ``class-eq9``,
  ``class-roofline``), :mod:`scheduler.eq7` (``eq7``, Eq. 2-9), :mod:`scheduler.priced_budgets`
  (``cost``, ``makespan``); one registry shared by the proposer, the scheduler, the CLIs, the
  recipes, the GRPO loop and the simulator.
* :mod:`scheduler.planner`: :class:`StepPlanner`, what the vLLM proposer decides per engine step
  (step-cost fits, calibration, payoff guard, warm-up and exploration, the budget).
* :mod:`scheduler.speculation`: :class:`SpeculationScheduler`, caps before the drafter for other
  hosts; :func:`static_budgets` and :class:`RequestCaps`, per-problem caps at submission.
* :mod:`scheduler.placement`: :func:`assign_groups`: groups to data-parallel engines (LPT); the one placement code.
"""

from scheduler.acceptance import DEFAULT_A, DEFAULT_K, accepted_tokens, estimate_acceptance, forward_passes, tokens_per_step
from scheduler.budget_protocol import Budget, Drafts, RowFacts, StepView
from scheduler.budgets import BudgetSetting, make_budget
from scheduler.calibration import AcceptanceCalibration
from scheduler.class_budgets import ClassBudget, ClassEq9Budget, ClassRooflineBudget
from scheduler.cost_model import CostModel
from scheduler.eq7 import Eq7Budget, Eq7Plan, Eq7Solver, optimal_proposals, round_caps, solve_n_fwd, step_saves_time
from scheduler.knee_cost import KneeCost
from scheduler.placement import ASSIGNMENTS, assign_groups
from scheduler.planner import StepPlanner
from scheduler.predictor import CLASS_NAMES, LONG, MEDIUM, SHORT, LengthPredictor, Prediction, classify, confusion_matrix, evaluate_predictor
from scheduler.priced_budgets import CostBudget, MakespanBudget
from scheduler.speculation import RequestCaps, SpeculationScheduler, static_budgets
from scheduler.step_price import LinearPrice
from scheduler.tail_drafts import BATCH_DRAFT, TailDrafts

__all__ = [
    "DEFAULT_A",
    "DEFAULT_K",
    "accepted_tokens",
    "estimate_acceptance",
    "forward_passes",
    "tokens_per_step",
    "Budget",
    "BudgetSetting",
    "Drafts",
    "RowFacts",
    "StepView",
    "make_budget",
    "ClassBudget",
    "ClassEq9Budget",
    "ClassRooflineBudget",
    "CostBudget",
    "MakespanBudget",
    "Eq7Budget",
    "Eq7Plan",
    "Eq7Solver",
    "LinearPrice",
    "BATCH_DRAFT",
    "TailDrafts",
    "StepPlanner",
    "optimal_proposals",
    "round_caps",
    "solve_n_fwd",
    "step_saves_time",
    "AcceptanceCalibration",
    "CostModel",
    "ASSIGNMENTS",
    "assign_groups",
    "KneeCost",
    "CLASS_NAMES",
    "SHORT",
    "MEDIUM",
    "LONG",
    "LengthPredictor",
    "Prediction",
    "classify",
    "confusion_matrix",
    "evaluate_predictor",
    "RequestCaps",
    "SpeculationScheduler",
    "static_budgets",
]
