"""Benchmarks: ``python -m benchmarks.replay`` (drafters replayed over a recorded rollout trace)
and ``python -m benchmarks.simulate`` (a rollout iteration's makespan under speculation policies).

See ``benchmarks/README.md`` for what each one measures and the numbers measured here.
"""
