"""Length-aware scheduling for RL rollouts (the second half of DAS, arXiv 2511.13841).

* :mod:`scheduler.predictor`: :class:`LengthPredictor`: per-problem length history, Short /
  Medium / Long classes, run-time class and remaining-length updates; :func:`evaluate_predictor`.
* :mod:`scheduler.acceptance`: the Eq. 3-4 acceptance model, per step and per request estimates.
* :mod:`scheduler.calibration`: :class:`AcceptanceCalibration`, per-bin acceptance factors of
  draft tokens learned from verification outcomes (a reliability diagram, online).
* :mod:`scheduler.cost_model`: :class:`CostModel`, ``t_step = c_base + c_tok * n_tokens`` fitted
  online (Eq. 1).
* :mod:`scheduler.budget`: :class:`ClassBudget`, :class:`Eq7Budget` (Eq. 7 / Eq. 9), per-step caps.
* :mod:`scheduler.budgets`: the registry of speculation budgets (one name per policy, where it runs),
  shared by the proposer, the scheduler, the CLIs, the recipes and the simulator.
* :mod:`scheduler.speculation`: :class:`SpeculationScheduler`, the one object a proposer calls
  per step; :func:`static_budgets`, per-problem budgets for ``SamplingParams.extra_args``.
* :mod:`scheduler.interleave`: :func:`assign_groups`: groups to data-parallel workers (LPT).
"""

from scheduler.acceptance import DEFAULT_A, DEFAULT_K, accepted_tokens, estimate_acceptance, forward_passes, tokens_per_step
from scheduler.budget import ClassBudget, Eq7Budget, Eq7Plan, optimal_proposals, round_caps, solve_n_fwd, step_saves_time
from scheduler.calibration import AcceptanceCalibration
from scheduler.cost_model import CostModel
from scheduler.interleave import METHODS as INTERLEAVE_METHODS
from scheduler.interleave import assign_groups, compare_assignments, worker_loads
from scheduler.predictor import CLASS_NAMES, LONG, MEDIUM, SHORT, LengthPredictor, Prediction, classify, confusion_matrix, evaluate_predictor
from scheduler.speculation import POLICIES, SpeculationScheduler, static_budgets

__all__ = [
    "DEFAULT_A",
    "DEFAULT_K",
    "accepted_tokens",
    "estimate_acceptance",
    "forward_passes",
    "tokens_per_step",
    "ClassBudget",
    "Eq7Budget",
    "Eq7Plan",
    "optimal_proposals",
    "round_caps",
    "solve_n_fwd",
    "step_saves_time",
    "AcceptanceCalibration",
    "CostModel",
    "INTERLEAVE_METHODS",
    "assign_groups",
    "compare_assignments",
    "worker_loads",
    "CLASS_NAMES",
    "SHORT",
    "MEDIUM",
    "LONG",
    "LengthPredictor",
    "Prediction",
    "classify",
    "confusion_matrix",
    "evaluate_predictor",
    "POLICIES",
    "SpeculationScheduler",
    "static_budgets",
]
