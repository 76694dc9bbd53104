"""Coupled sampling (integrations.vllm_ext.patches.coupled_sampling): a keyed request's token at index ``i``
is the inverse CDF of the target distribution at the uniform of ``(key, i)``, whether a plain step
samples it, verification accepts it as a draft token, emits it at a rejection or samples it as a
bonus token; and the tokens still follow the target distribution (chi-square over many keys).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from integrations.vllm_ext.patches import coupled_sampling as cs
from integrations.vllm_ext.patches.inverse_cdf import BLOCK, inverse_cdf


def test_index_uniforms_are_deterministic_uniform_and_differ_between_neighbours():
    keys = np.array([0, 1, 2, 2**62], np.int64)
    a = cs.index_uniforms(keys, np.array([5, 5, 5, 5]))
    assert a.dtype == np.float64 and np.all((a >= 0) & (a < 1))
    assert np.array_equal(a, cs.index_uniforms(keys, np.array([5, 5, 5, 5])))
    grid = cs.index_uniforms(np.arange(200)[:, None], np.arange(200)[None, :])  # 40,000 (key, index) pairs
    assert len(np.unique(grid)) == grid.size
    counts = np.histogram(grid, bins=20, range=(0, 1))[0]
    assert np.abs(counts - grid.size / 20).max() < 5 * np.sqrt(grid.size / 20)  # flat
    assert cs.rollout_key(3, 0) != cs.rollout_key(3, 1) != cs.rollout_key(4, 1)
    assert all(0 <= cs.rollout_key(s, i) < 2**63 for s in (0, -1, 2**40) for i in (0, 7))


def test_request_key_reads_only_a_non_negative_int():
    def params(extra):
        return types.SimpleNamespace(extra_args=extra)

    assert cs.request_key(params({cs.KEY_ARG: 12})) == 12
    assert cs.request_key(params({cs.KEY_ARG: np.int64(7)})) == 7
    for bad in ({cs.KEY_ARG: -3}, {cs.KEY_ARG: True}, {cs.KEY_ARG: "12"}, {cs.KEY_ARG: 2**63}, {}, None, "x"):
        assert cs.request_key(params(bad)) == -1
    assert cs.request_key(None) == -1


def _plain_sample(logits: torch.Tensor, keys: np.ndarray, index: np.ndarray) -> torch.Tensor:
    """What a plain step samples for keyed rows: the inverse CDF at the uniform of the token's index."""
    return cs.sample_rows(logits, torch.from_numpy(cs.index_uniforms(keys, index)))


def test_inverse_cdf_follows_the_distribution_and_never_picks_zero_weight():
    torch.manual_seed(0)
    probs = torch.zeros(1000)
    probs[[3, 255, 256, 511, 700, 999]] = torch.tensor([0.1, 0.2, 0.05, 0.3, 0.15, 0.2])  # across 4 blocks, the last partial
    n = 40000
    tokens = inverse_cdf(probs.expand(n, 1000).clone(), torch.rand(n, dtype=torch.float64))
    counts = torch.bincount(tokens, minlength=1000).float()
    assert counts[probs == 0].sum() == 0
    expected = probs * n
    mask = probs > 0
    assert float((((counts - expected) ** 2 / expected)[mask]).sum()) < 25.7  # chi2(5) 99.99th percentile
    assert torch.equal(inverse_cdf(torch.zeros(2, 1000), torch.tensor([0.3, 0.9], dtype=torch.float64)), torch.tensor([-1, -1]))


@settings(max_examples=100, deadline=None)
@given(weights=st.lists(st.sampled_from([0.0, 0.0, 1e-6, 0.3, 1.0, 7.0]), min_size=1, max_size=3 * BLOCK + 5),
       u=st.floats(0.0, 1.0, exclude_max=True))
def test_inverse_cdf_returns_the_token_whose_cumulative_range_holds_u(weights, u):
    """The token at quantile ``u`` is the first whose cumulative weight exceeds ``u`` times the
    total (float64 reference), never one of weight 0; a row without mass gives -1."""
    probs = torch.tensor(weights, dtype=torch.float32)
    got = int(inverse_cdf(probs[None, :], torch.tensor([u], dtype=torch.float64))[0])
    w = np.asarray(weights, np.float64)
    if w.sum() == 0:
        assert got == -1
        return
    assert w[got] > 0
    cdf = np.cumsum(w)
    x = u * cdf[-1]
    want = int(np.searchsorted(cdf, x, side="right"))
    lo, hi = sorted((got, want))
    if got != want:  # float32 block sums may move a boundary a hair: only to the next token of positive weight
        assert w[lo + 1 : hi].sum() == 0 and abs(x - cdf[lo]) <= 1e-5 * cdf[-1], (got, want, x, cdf[lo])


VOCAB = 8
P0 = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3, 1.5, -0.5])
P1 = torch.tensor([0.0, 2.5, -1.0, 1.0, 0.0, 0.0, -2.0, 0.5])
PB = torch.tensor([-1.0, 0.0, 1.0, 2.0, 0.5, -0.5, 0.0, 1.5])


def _verify_keyed(verify_draft_pairs, pairs: int, keys: np.ndarray, next_index: np.ndarray):
    """vLLM's RejectionSampler, patched, on rows drafting [6, 3] (logits P0, P1, bonus PB) and rows
    without drafts (bonus PB), with the step's keys set as the model runner's hook sets them."""
    cs.begin_step(keys, next_index)
    try:
        return verify_draft_pairs(pairs, P0, P1, PB)
    finally:
        cs.end_step()


def _chi2(tokens: torch.Tensor, logits: torch.Tensor) -> float:
    counts = torch.bincount(tokens.long(), minlength=VOCAB).float()
    expected = logits.softmax(-1) * counts.sum()
    mask = expected > 5
    return float((((counts - expected) ** 2) / expected.clamp(min=1e-12))[mask].sum())


@pytest.mark.slow  # imports vLLM
def test_verification_emits_the_plain_samples_of_each_index(verify_draft_pairs):
    pairs = 300
    keys = np.arange(2 * pairs, dtype=np.int64) * 7919 + 11
    n = np.arange(2 * pairs, dtype=np.int64) % 50 + 20  # each row's verified tokens: the index of its next token
    out = _verify_keyed(verify_draft_pairs, pairs, keys, n)
    drafting, plain = out[0::2].long(), out[1::2].long()
    kd, nd, kp, np_ = keys[0::2], n[0::2], keys[1::2], n[1::2]
    at0 = _plain_sample(P0.expand(pairs, VOCAB), kd, nd)  # what plain steps would sample at n, n + 1, n + 2
    at1 = _plain_sample(P1.expand(pairs, VOCAB), kd, nd + 1)
    at2 = _plain_sample(PB.expand(pairs, VOCAB), kd, nd + 2)
    assert torch.equal(drafting[:, 0], at0)  # accepted draft token or the emitted sample: the plain sample either way
    ok0 = at0 == 6
    assert torch.equal(drafting[ok0, 1], at1[ok0])
    both = ok0 & (at1 == 3)
    assert torch.equal(drafting[both, 2], at2[both])  # the bonus token at n + 2
    assert torch.all(drafting[~ok0, 1] == -1) and torch.all(drafting[ok0 & ~both, 2] == -1)
    assert torch.equal(plain[:, 0], _plain_sample(PB.expand(pairs, VOCAB), kp, np_))  # rows without drafts: index n
    assert 0 < int(ok0.sum()) < pairs and 0 < int(both.sum())  # both outcomes happened
    assert torch.equal(out, _verify_keyed(verify_draft_pairs, pairs, keys, n))  # the same keys: the same tokens, whatever torch's generator


@pytest.mark.slow
def test_keyed_verification_keeps_the_target_distribution(verify_draft_pairs):
    pairs = 12000
    keys = np.arange(2 * pairs, dtype=np.int64) + 10**9
    out = _verify_keyed(verify_draft_pairs, pairs, keys, np.full(2 * pairs, 40, np.int64))
    drafting, plain = out[0::2], out[1::2]
    ok0 = drafting[:, 0] == 6
    both = ok0 & (drafting[:, 1] == 3)
    for tokens, logits in ((drafting[:, 0], P0), (drafting[ok0, 1], P1), (drafting[both, 2], PB), (plain[:, 0], PB)):
        assert _chi2(tokens, logits) < 30.0  # chi2(7) 99.99th percentile is ~29.9
    # the same check fails for a sampler that reuses one index's uniform at the next index
    wrong = _plain_sample(P1.expand(pairs, VOCAB), keys[0::2], np.full(pairs, 40))
    assert _chi2(wrong[ok0], P1) > 30.0


@pytest.mark.slow
def test_plain_steps_sample_keyed_rows_at_their_next_index_and_others_as_before(vllm_patches):
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    sampler = types.SimpleNamespace(use_fp64_gumbel=False, logprobs_mode="raw_logprobs")
    logits = torch.randn(6, 500) * 3
    keys = np.array([5, -1, 9, 9, -1, 123], np.int64)
    n = np.array([10, 11, 12, 13, 14, 15], np.int64)
    cs.begin_step(keys, n)
    try:
        torch.manual_seed(3)
        got, _ = TopKTopPSampler.forward_cpu(sampler, logits.clone(), {}, None, None)
    finally:
        cs.end_step()
    keyed = keys >= 0
    assert torch.equal(got[torch.from_numpy(keyed)].long(), _plain_sample(logits[torch.from_numpy(keyed)], keys[keyed], n[keyed]))
    torch.manual_seed(3)
    unkeyed, _ = TopKTopPSampler.forward_cpu.__wrapped__(sampler, logits.clone(), {}, None, None)
    assert torch.equal(got[torch.from_numpy(~keyed)].long(), unkeyed[torch.from_numpy(~keyed)].long())
    assert not cs.active()  # nothing left over for the next step


@pytest.mark.engine
def test_a_speculative_engine_samples_the_rollouts_of_a_plain_one(peaked_tiny_model):
    """The same keys give the same sampled tokens with no speculation and with DAS drafting:
    accepted drafts, emitted samples at rejections and bonus tokens are all the plain samples."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams, TokensPrompt

    from integrations.vllm_ext import control
    from integrations.vllm_ext.engine import make_llm, release_engine_state, spec_counters

    prompts = [[5, 17, 42, 8], [100, 3, 77], [9, 9, 9, 10, 11], [300, 200, 100, 50, 25, 12]] * 4

    def generate(llm, seed):
        params = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, extra_args={cs.KEY_ARG: cs.rollout_key(seed, i)})
                  for i in range(len(prompts))]
        torch.manual_seed(seed + 1000)  # torch's generator differs from the keys: keyed rows must not read it
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    base = make_llm(peaked_tiny_model, "none", dtype="float32", max_model_len=128)
    assert all(control.enable_coupled_sampling(base))  # a feature: on only when asked for
    expected = [generate(base, s) for s in (1, 2)]
    del base
    release_engine_state()
    llm = make_llm(peaked_tiny_model, "das", dtype="float32", max_model_len=128, num_speculative_tokens=6, das_config={"budget": "fixed"})
    assert all(control.enable_coupled_sampling(llm))
    got = []
    for version, seed in ((1, 1), (2, 2)):  # the second iteration drafts from the first one's rollouts
        control.begin_iteration(llm, version)
        got.append(generate(llm, seed))
    counters = spec_counters(llm)
    assert counters["accepted_tokens"] > 0 and counters["accepted_tokens"] < counters["draft_tokens"]
    assert got == expected
    assert expected[0] != expected[1]  # other keys, other rollouts


def test_the_model_runner_hook_reads_each_rows_key_once_and_its_next_index():
    def state(extra):
        return types.SimpleNamespace(sampling_params=types.SimpleNamespace(extra_args=extra))

    requests = {"a": state({cs.KEY_ARG: 5}), "b": state({"das_problem_id": "p"}), "c": state({cs.KEY_ARG: 9})}
    runner = types.SimpleNamespace(requests=requests, input_batch=types.SimpleNamespace(
        req_ids=["c", "b", "a"], num_tokens_no_spec=np.array([30, 12, 7, 0], np.int32)))
    keys, nxt = cs.step_keys(runner)
    assert keys.tolist() == [9, -1, 5] and nxt.tolist() == [30, 12, 7] and nxt.dtype == np.int64
    requests["c"].sampling_params.extra_args = {cs.KEY_ARG: 1}  # read once per request: the first key stays
    assert cs.step_keys(runner)[0].tolist() == [9, -1, 5]
    runner.input_batch.req_ids = ["b"]
    assert cs.step_keys(runner) == (None, None)  # no keyed row: nothing to record


def test_the_hook_keys_only_the_step_it_wraps():
    seen = []

    def sample(runner, logits, metadata):
        seen.append((cs.active(), cs.row_uniforms(2) is not None))
        return "sampled"

    hooked = cs.keyed_sampling(sample)
    state = types.SimpleNamespace(sampling_params=types.SimpleNamespace(extra_args={cs.KEY_ARG: 3}))
    runner = types.SimpleNamespace(requests={"a": state, "b": types.SimpleNamespace(sampling_params=None)},
                                   input_batch=types.SimpleNamespace(req_ids=["a", "b"], num_tokens_no_spec=np.array([4, 9])))
    assert hooked(runner, "logits", None) == "sampled" and seen == [(True, True)]
    assert not cs.active()  # forgotten after the step


def test_enable_calls_the_worker_method_by_name_and_says_what_to_add_without_the_extension():
    from integrations.vllm_ext import control
    from integrations.vllm_ext.worker_extension import ExtensionMissing

    class MultiprocessLLM:  # a worker in another process: a name and plain arguments only
        def __init__(self, workers):
            self.workers, self.sent = workers, []

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            self.sent.append(method)
            if not isinstance(method, str):
                raise TypeError("Object of type <class 'function'> is not serializable")
            if not all(hasattr(w, method) for w in self.workers):
                raise Exception(f"Call to collective_rpc method failed: Method {method!r} is not implemented.")
            return [getattr(w, method)() for w in self.workers]

    class Worker:
        def das_enable_coupled_sampling(self):
            return {"ok": True}

    llm = MultiprocessLLM([Worker(), Worker()])
    assert control.enable_coupled_sampling(llm) == [True, True] and llm.sent == ["das_enable_coupled_sampling"]
    with pytest.raises(ExtensionMissing, match="worker_extension_cls"):
        control.enable_coupled_sampling(MultiprocessLLM([object()]))
