"""Benchmarks: ``python -m benchmarks.replay`` (drafters replayed over a recorded rollout trace)
and ``python -m benchmarks.simulate`` (a rollout iteration's makespan under speculation budgets).

See ``benchmarks/README.md`` for the commands and ``docs/benchmarks.md`` for the current figures.
"""
