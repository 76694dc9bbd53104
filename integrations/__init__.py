"""Adapters that put the DAS drafter to work: vLLM proposer, engine factory, rollout driver."""
