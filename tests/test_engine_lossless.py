"""On a real vLLM engine, DAS speculation changes nothing about what is sampled.

- Greedy: outputs with the DAS proposer are token-for-token identical to outputs without
  speculation (float32, so verification of several tokens cannot flip bf16 near-ties).
- Sampling: per-position next-token frequencies with DAS match those without speculation (a
  chi-square test), and the same test catches a biased verifier (one that verifies at a wrong
  temperature), so it is not a test that cannot fail.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from benchmarks.lossless import chi_square
from integrations.vllm_ext import control
from integrations.vllm_ext.engine import make_llm, release_engine_state, spec_counters

# every test here runs vLLM engines; vLLM and torch are imported inside them, not at collection
pytestmark = [pytest.mark.engine, pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")]

PROMPTS = [[5, 17, 42, 8], [100, 3, 77], [9, 9, 9, 10, 11], [300, 200, 100, 50, 25, 12]]


def _generate(llm, prompts, params, seed):
    import torch
    from vllm import TokensPrompt

    torch.manual_seed(seed)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def test_greedy_outputs_identical_with_das(tiny_model):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    base = make_llm(tiny_model, "none", dtype="float32", max_model_len=256)
    expected = _generate(base, PROMPTS, params, 0)
    del base
    release_engine_state()  # collect it now, not during the next engine's steps
    llm = make_llm(tiny_model, "das", dtype="float32", max_model_len=256, num_speculative_tokens=8, das_config={"budget": "fixed"})
    got = []
    for version in (1, 2):  # the second iteration drafts from the first one's rollouts
        control.begin_iteration(llm, version)
        got.append(_generate(llm, PROMPTS, params, 0))
    counters = spec_counters(llm)
    snap = control.snapshot(llm)[0]
    assert got[0] == expected
    assert got[1] == expected
    assert snap["failures"] == 0
    assert counters["accepted_tokens"] > 0.5 * sum(len(s[0]) for s in expected)  # drafts really were verified


def chi_square_differs(a, b, positions=6):
    """Two-sample chi-square test over the first ``positions`` tokens, pooled over positions
    (:func:`benchmarks.lossless.chi_square`: bins with fewer than 10 counts merged per position,
    alpha = 1e-4). Returns (differs, statistic, critical value)."""
    stat, _, crit = chi_square(np.asarray(a, np.int64), np.asarray(b, np.int64), 0, positions)
    return stat > crit, stat, crit


def _sample_many(llm, params, seed, das):
    prompts = [PROMPTS[0]]
    if das:  # a first iteration fills the drafter's window; the second one is measured
        control.begin_iteration(llm, 1)
        _generate(llm, prompts, params, seed + 1)
        control.begin_iteration(llm, 2)
    before = spec_counters(llm)
    out = _generate(llm, prompts, params, seed)[0]
    after = spec_counters(llm)
    return out, after["accepted_tokens"] - before["accepted_tokens"], after["draft_tokens"] - before["draft_tokens"]


@pytest.fixture(scope="module")
def sampled(peaked_tiny_model):
    """Samples without speculation, with DAS, and with DAS under a biased verifier."""
    from vllm import SamplingParams
    from vllm.v1.sample import rejection_sampler

    params = SamplingParams(n=600, temperature=1.0, max_tokens=8, ignore_eos=True)
    base = make_llm(peaked_tiny_model, "none", dtype="float32", max_model_len=128)
    none, _, _ = _sample_many(base, params, 11, das=False)
    del base
    release_engine_state()  # collect it now, not during the next engine's steps
    llm = make_llm(peaked_tiny_model, "das", dtype="float32", max_model_len=128, num_speculative_tokens=6, das_config={"budget": "fixed"})
    das, accepted, drafted = _sample_many(llm, params, 22, das=True)
    fixed = rejection_sampler.expand_batch_to_tokens

    def wrong_temperature(x, cu, n, replace_from=0, replace_to=0):
        out = fixed(x, cu, n, replace_from, replace_to)
        return out * 0.5 if out.is_floating_point() else out  # verify at half the requested temperature

    rejection_sampler.expand_batch_to_tokens = wrong_temperature
    try:
        biased, _, _ = _sample_many(llm, params, 33, das=False)
    finally:
        rejection_sampler.expand_batch_to_tokens = fixed
    return {"none": none, "das": das, "biased": biased, "accepted": accepted, "drafted": drafted}


def test_sampling_with_das_matches_no_speculation(sampled):
    assert sampled["drafted"] > 0 and sampled["accepted"] > 0  # speculation really ran
    assert sampled["accepted"] < sampled["drafted"]  # and rejections happened too
    differs, stat, crit = chi_square_differs(sampled["none"], sampled["das"])
    assert not differs, f"chi2 {stat:.1f} > critical {crit:.1f}: DAS changed the sampled distribution"


def test_the_test_catches_a_biased_verifier(sampled):
    differs, stat, crit = chi_square_differs(sampled["none"], sampled["biased"])
    assert differs, f"chi2 {stat:.1f} <= critical {crit:.1f}: a verifier at the wrong temperature went unnoticed"


def test_requests_with_logprobs_are_still_drafted(tiny_model):
    """RL frameworks ask for logprobs; vLLM 0.32 still drafts for such requests (checked here)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
    llm = make_llm(tiny_model, "das", dtype="float32", max_model_len=256, num_speculative_tokens=8, das_config={"budget": "fixed"})
    for version in (1, 2):
        control.begin_iteration(llm, version)
        from vllm import TokensPrompt

        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    assert all(len(c.logprobs) == len(c.token_ids) for o in outs for c in o.outputs)
    counters = spec_counters(llm)
    assert counters["draft_tokens"] > 0 and counters["accepted_tokens"] > 0


def test_a_lone_tail_row_drafts_beyond_16_at_k_32_and_stays_lossless(tiny_model, tmp_path, monkeypatch):
    """das at K 32 with the default budget: 15 short requests and a long one; once the
    long one runs alone (the long tail), it gets more than 16 draft tokens in a step, and greedy
    outputs match no speculation."""
    from vllm import SamplingParams

    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv("DAS_STEP_LOG", str(log))
    prompts = [[5 + i, 17, 42, 8] for i in range(16)]
    params = [SamplingParams(temperature=0.0, max_tokens=160 if i == 0 else 8, ignore_eos=True) for i in range(16)]
    base = make_llm(tiny_model, "none", dtype="float32", max_model_len=256)
    expected = _generate(base, prompts, params, 0)
    del base
    release_engine_state()
    llm = make_llm(tiny_model, "das", dtype="float32", max_model_len=256, num_speculative_tokens=32,
                   das_config={"c_base": 0.01, "c_tok": 1e-5})
    got = []
    for version in (1, 2):
        control.begin_iteration(llm, version)
        got.append(_generate(llm, prompts, params, 0))
    assert got == [expected, expected]
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    lone = [s["draft_tokens"] for s in steps if s["rows"] == 1]
    assert lone and max(lone) > 16, lone
