"""Length-aware scheduling for RL rollouts (the second half of DAS, arXiv 2511.13841).

Import from the modules; this package re-exports nothing. One decode step reads top to bottom in
:mod:`scheduler.planner`. The modules, by idea:

* :mod:`scheduler.predictor`: how long a rollout will run: :class:`~scheduler.predictor.LengthPredictor`
  (per-problem length history, Short / Medium / Long classes, remaining-length updates).
* :mod:`scheduler.acceptance`: how many draft tokens get accepted: DAS's per-request prior
  (Eq. 3-4) and :class:`~scheduler.acceptance.AcceptanceCalibration` of the drafter's probabilities.
* :mod:`scheduler.step_price`: what a step costs: :class:`~scheduler.step_price.StepPrice`, the line,
  the two regimes and the knee fitted online, giving each step's :class:`~scheduler.step_price.LinearPrice`.
* :mod:`scheduler.budget_protocol`: what a speculation budget is (:class:`~scheduler.budget_protocol.Budget`,
  its priced sub-protocol :class:`~scheduler.budget_protocol.PricedBudget`, the
  :class:`~scheduler.budget_protocol.StepView` it sees, the :class:`~scheduler.budget_protocol.BudgetSetting`
  it is built from).
* The budgets by family: :mod:`scheduler.budgets` (the registry of names, the plain ``none`` and
  ``fixed``, and :class:`~scheduler.budgets.RequestCaps`, per-problem caps at submission for the GRPO
  loop); :mod:`scheduler.length_classes` (``class``, ``class-eq9``, ``class-roofline``);
  :mod:`scheduler.drain_plan` (``eq7``: per-request rates from remaining lengths, with its Eq. 1
  cost line); :mod:`scheduler.priced_budgets` (``cost``, ``makespan``: the drafts that pay at the
  step's price).
* :mod:`scheduler.planner`: :class:`~scheduler.planner.StepPlanner`, what is measured and decided per
  engine step around a budget (step-price fit, calibration, payoff guard, warm-up, the tail rule).
* :mod:`scheduler.placement`: GRPO groups to data-parallel engines by predicted work.
"""
