"""Benchmarks: ``python -m benchmarks.replay`` (drafters replayed over a recorded rollout trace).

See ``benchmarks/README.md`` for what each one measures and the numbers measured here.
"""
