"""Lazy-recovery rejection sampling keeps the target distribution (integrations.vllm_ext.patches.lazy_rejection),
and bonus tokens sampled after verification are the ones vLLM's order gives (patches.lazy_bonus).

Speculative sampling with point-mass drafts must emit, at each position, a token distributed as
the target distribution ``p``: the first output token of a row is ``~ p_0`` whatever the draft, and
given the first draft token was accepted the second is ``~ p_1``. We check both with a chi-square
test over many identical rows, and check greedy rows, bonus tokens and the fallback exactly.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from integrations.vllm_ext.patches import lazy_bonus
from integrations.vllm_ext.patches import lazy_rejection as lazy
from integrations.vllm_ext.patches.patch import call_signature, patched_by


def _meta(batch, *, greedy_rows=(), generators=None):
    temperature = torch.ones(batch)
    temperature[list(greedy_rows)] = 0.0
    all_greedy = len(greedy_rows) == batch
    return types.SimpleNamespace(all_greedy=all_greedy, all_random=not greedy_rows, temperature=temperature,
                                 generators=generators or {})


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    expected = probs * counts.sum()
    mask = expected > 5
    stat = float((((counts - expected) ** 2) / expected.clamp(min=1e-12))[mask].sum())
    return stat, int(mask.sum()) - 1


def test_first_token_follows_target_and_second_given_accept():
    torch.manual_seed(0)
    vocab, rows = 8, 40000
    p0_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3, 1.5, -0.5])
    p1_logits = torch.tensor([0.0, 2.5, -1.0, 1.0, 0.0, 0.0, -2.0, 0.5])
    p0, p1 = p0_logits.softmax(-1), p1_logits.softmax(-1)
    drafts = torch.tensor([6, 3] * rows, dtype=torch.int32)  # each row drafts [6, 3]
    logits = torch.stack([p0_logits, p1_logits] * rows)
    cu = torch.arange(1, rows + 1, dtype=torch.int32) * 2
    bonus = torch.full((rows, 1), 7, dtype=torch.int64)
    out = lazy.rejection_sample(drafts, [2] * rows, 2, cu, None, logits, bonus, _meta(rows))
    assert out.shape == (rows, 3) and out.dtype == torch.int32
    first = torch.bincount(out[:, 0].long(), minlength=vocab).float()
    stat, dof = _chi2(first, p0)
    assert stat < 30.0, (stat, dof)  # chi2(7) 99.99th percentile is ~29.9
    accepted = out[:, 0] == 6
    second = torch.bincount(out[accepted, 1].long(), minlength=vocab).float()
    stat, dof = _chi2(second, p1)
    assert stat < 30.0, (stat, dof)
    both = accepted & (out[:, 1] == 3)
    assert torch.all(out[both, 2] == 7)  # every draft accepted: the bonus token follows
    assert torch.all(out[~both, 2] == lazy.PLACEHOLDER_TOKEN_ID)
    assert torch.all(out[~accepted, 1] == lazy.PLACEHOLDER_TOKEN_ID)


def test_recovered_tokens_follow_the_residual_over_a_vocabulary_of_many_blocks():
    # 1,000 entries: four blocks of the two-level inverse CDF, the last one partial. The mass sits
    # in every block, the rejected draft is the likeliest token, and rows of different draft
    # counts share the batch: given a rejection at the first position, the token emitted there is
    # distributed as p without the draft, renormalised.
    torch.manual_seed(4)
    vocab, rows = 1000, 30000
    logits = torch.full((vocab,), -9.0)  # 0.4% of the mass spread thin: the chi-square counts the hot tokens
    hot = torch.tensor([3, 255, 256, 511, 640, 767, 768, 999])
    logits[hot] = torch.tensor([1.0, 0.5, 2.0, 1.5, 0.0, 1.2, 0.8, 1.7])
    draft = 256
    p = logits.softmax(-1)
    counts = [1 + i % 3 for i in range(rows)]
    n = sum(counts)
    drafts = torch.full((n,), draft, dtype=torch.int32)
    cu = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = lazy.rejection_sample(drafts, counts, 3, cu, None, logits.expand(n, vocab).clone(),
                                torch.zeros(rows, 1, dtype=torch.int64), _meta(rows))
    first = out[:, 0].long()
    rejected = first != draft
    assert abs(rejected.float().mean().item() - (1 - p[draft].item())) < 0.01
    residual = p.clone()
    residual[draft] = 0.0
    residual /= residual.sum()
    stat, dof = _chi2(torch.bincount(first[rejected], minlength=vocab).float(), residual)
    assert dof == 6 and stat < 30.0, (stat, dof)  # chi2(6) 99.99th percentile ~27.9
    assert not torch.any(first[rejected] == draft)


def test_a_biased_sampler_would_fail_the_same_check():
    # The check above can fail: tokens drawn at the wrong temperature are caught.
    torch.manual_seed(1)
    p0_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3, 1.5, -0.5])
    wrong = torch.multinomial((p0_logits / 0.7).softmax(-1), 40000, replacement=True)
    stat, _ = _chi2(torch.bincount(wrong, minlength=8).float(), p0_logits.softmax(-1))
    assert stat > 30.0


def test_rows_without_drafts_get_their_bonus_token_only():
    logits = torch.randn(0, 10)
    bonus = torch.tensor([[4], [5], [6]])
    out = lazy.rejection_sample(torch.zeros(0, dtype=torch.int32), [0, 0, 0], 0, torch.zeros(3, dtype=torch.int32),
                                None, logits, bonus, _meta(3))
    assert out.tolist() == [[4], [5], [6]]


def test_greedy_rows_accept_argmax_prefix_then_emit_argmax():
    torch.manual_seed(2)
    logits = torch.randn(5, 10)
    argmax = logits.argmax(-1)
    drafts = argmax.clone()
    drafts[3] = (drafts[3] + 1) % 10  # row 2 mismatches at its second position
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    bonus = torch.tensor([[7], [8], [9]])
    out = lazy.rejection_sample(drafts.to(torch.int32), [2, 0, 3], 3, cu, None, logits, bonus, _meta(3, greedy_rows=(0, 1, 2)))
    assert out[0].tolist() == [argmax[0].item(), argmax[1].item(), 7, -1]
    assert out[1].tolist() == [8, -1, -1, -1]
    assert out[2].tolist() == [argmax[2].item(), argmax[3].item(), -1, -1]


def test_mixed_greedy_and_random_rows():
    torch.manual_seed(3)
    logits = torch.full((2, 6), -30.0)
    logits[0, 2] = 30.0  # greedy row 0: argmax 2, draft 2 -> accepted
    logits[1, 4] = 30.0  # random row 1: p(4) ~ 1, draft 1 -> rejected, recovered is almost surely 4
    drafts = torch.tensor([2, 1], dtype=torch.int32)
    out = lazy.rejection_sample(drafts, [1, 1], 1, torch.tensor([1, 2], dtype=torch.int32), None, logits,
                                torch.tensor([[5], [5]]), _meta(2, greedy_rows=(0,)))
    assert out.tolist() == [[2, 5], [4, -1]]


def test_draft_probabilities_seeded_requests_and_fly_go_to_vllms_sampler():
    calls = []

    def fallback(*args, **kwargs):
        calls.append(kwargs)
        return torch.zeros(1, 2, dtype=torch.int32)

    saved = lazy.set_fallback(fallback)
    try:
        logits = torch.randn(1, 4)
        args = (torch.tensor([1], dtype=torch.int32), [1], 1, torch.tensor([1], dtype=torch.int32))
        lazy.rejection_sample(*args, torch.full((1, 4), 0.25), logits, torch.tensor([[0]]), _meta(1))
        lazy.rejection_sample(*args, None, logits, torch.tensor([[0]]), _meta(1, generators={0: torch.Generator()}))
        # FLy on (vLLM 0.33): its arguments reach vLLM's sampler, which alone implements it
        lazy.rejection_sample(*args, None, logits, torch.tensor([[0]]), _meta(1), fly_window_size=2,
                              fly_entropy_threshold=0.3, fly_entropy_top_k=5)
        # FLy off (window None): the lazy path, whatever the other two say
        out = lazy.rejection_sample(*args, None, logits, torch.tensor([[3]]), _meta(1), fly_entropy_threshold=0.3,
                                    fly_entropy_top_k=5)
    finally:
        lazy.set_fallback(saved)
    assert len(calls) == 3 and out.shape == (1, 2)
    assert "fly_window_size" not in calls[0]  # vLLM 0.32's sampler has no fly_* arguments
    assert {k: calls[2][k] for k in ("fly_window_size", "fly_entropy_threshold", "fly_entropy_top_k")} == {
        "fly_window_size": 2, "fly_entropy_threshold": 0.3, "fly_entropy_top_k": 5}


# vLLM 0.33.0's rejection_sample (vllm/v1/sample/rejection_sampler.py), as call_signature writes it
VLLM_0_33_REJECTION_SAMPLE = (
    "(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits, bonus_token_ids, "
    "sampling_metadata, synthetic_mode=False, synthetic_conditional_rates=None, use_fp64_gumbel=False, "
    "fly_window_size=None, fly_entropy_threshold=None, fly_entropy_top_k=3)")


def test_the_lazy_sampler_takes_every_argument_vllm_0_33_passes():
    assert call_signature(lazy.rejection_sample) == VLLM_0_33_REJECTION_SAMPLE
    assert VLLM_0_33_REJECTION_SAMPLE.startswith(lazy.PATCH.expects[lazy.TARGET][:-1] + ", ")  # 0.32's is its prefix


@settings(max_examples=80, deadline=None)
@given(data=st.data(), counts=st.lists(st.integers(0, 4), min_size=1, max_size=6), greedy=st.booleans())
def test_each_row_is_an_accepted_prefix_then_one_token_then_padding(data, counts, greedy):
    """Whatever the logits: a row emits a prefix of its draft, then exactly one token (the bonus
    token when the whole draft was accepted, else a recovered token other than the rejected draft
    token, the argmax for greedy rows), then -1; greedy rows accept exactly the argmax prefix."""
    vocab, rows, n = 7, len(counts), sum(counts)
    torch.manual_seed(data.draw(st.integers(0, 2**16)))
    logits = torch.randn(n, vocab) * data.draw(st.sampled_from([0.5, 3.0, 8.0]))
    drafts = torch.tensor(data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)), dtype=torch.int32)
    bonus = torch.arange(100, 100 + rows).reshape(rows, 1)
    cu = torch.tensor(counts).cumsum(0).to(torch.int32)
    meta = _meta(rows, greedy_rows=tuple(range(rows)) if greedy else ())
    out = lazy.rejection_sample(drafts, counts, max(counts), cu, None, logits, bonus, meta)
    assert out.shape == (rows, max(counts) + 1)
    start = 0
    for r, c in enumerate(counts):
        row, d = out[r].tolist(), drafts[start:start + c].tolist()
        a = 0
        while a < c and row[a] == d[a]:
            a += 1
        argmax = logits[start:start + c].argmax(-1).tolist()
        if greedy:
            want = next((i for i in range(c) if d[i] != argmax[i]), c)
            assert a == want
        if a == c:
            assert row[c] == 100 + r
        else:
            assert row[a] != d[a] and 0 <= row[a] < vocab
            if greedy:
                assert row[a] == argmax[a]
        assert all(t == lazy.PLACEHOLDER_TOKEN_ID for t in row[a + 1:])
        start += c


@pytest.mark.slow  # imports vLLM
def test_installed_into_vllm_on_the_cpu_build(vllm_patches):
    from vllm.v1.sample import rejection_sampler

    assert "lazy_rejection" in vllm_patches and rejection_sampler.rejection_sample is lazy.rejection_sample


@pytest.mark.slow
def test_bonus_rows_only_gives_the_kept_rows_the_tokens_of_the_full_call(vllm_patches):
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    wrapped = TopKTopPSampler.forward_cpu
    assert patched_by(wrapped, "lazy_bonus")
    sampler = types.SimpleNamespace(use_fp64_gumbel=False, logprobs_mode="raw_logprobs")
    logits = torch.randn(6, 500) * 3
    kept = torch.tensor([True, False, True, False, False, True])
    torch.manual_seed(11)
    full, _ = wrapped.__wrapped__(sampler, logits.clone(), {}, None, None)
    torch.manual_seed(11)
    with lazy_bonus.bonus_rows(kept):
        some, _ = wrapped(sampler, logits.clone(), {}, None, None)
    assert torch.equal(some[kept].long(), full[kept].long())
    assert torch.all(some[~kept] == 0)
    torch.manual_seed(12)
    a, _ = wrapped(sampler, logits.clone(), {}, None, None)  # outside a bonus call: vLLM's sampler as is
    torch.manual_seed(12)
    b, _ = wrapped.__wrapped__(sampler, logits.clone(), {}, None, None)
    assert torch.equal(a, b)


@pytest.mark.slow
def test_rejection_sampler_forward_samples_bonus_tokens_from_the_bonus_distribution(verify_draft_pairs):
    # Through vLLM's own RejectionSampler and Sampler, patched: rows drafting [6, 3] and rows
    # without drafts. Position 0 follows p0 (or, for rows without drafts, the bonus distribution
    # pb); given draft 6 accepted position 1 follows p1; given both accepted the bonus token
    # follows pb: the bonus is sampled after verification, only where used.
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    assert patched_by(RejectionSampler.forward, "lazy_bonus")
    torch.manual_seed(5)
    vocab, pairs = 8, 12000
    p0_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3, 1.5, -0.5])
    p1_logits = torch.tensor([0.0, 2.5, -1.0, 1.0, 0.0, 0.0, -2.0, 0.5])
    pb_logits = torch.tensor([-1.0, 0.0, 1.0, 2.0, 0.5, -0.5, 0.0, 1.5])
    out = verify_draft_pairs(pairs, p0_logits, p1_logits, pb_logits)
    batch = 2 * pairs
    assert out.shape == (batch, 3)
    drafting, plain = out[0::2], out[1::2]
    p0, p1, pb = p0_logits.softmax(-1), p1_logits.softmax(-1), pb_logits.softmax(-1)
    checks = [(drafting[:, 0], p0), (drafting[drafting[:, 0] == 6, 1], p1), (plain[:, 0], pb)]
    both = (drafting[:, 0] == 6) & (drafting[:, 1] == 3)
    checks.append((drafting[both, 2], pb))
    for tokens, probs in checks:
        stat, dof = _chi2(torch.bincount(tokens.long(), minlength=vocab).float(), probs)
        assert dof == 7 and stat < 30.0, (stat, dof)  # chi2(7) 99.99th percentile ~29.9
    assert torch.all(drafting[~both, 2] == lazy.PLACEHOLDER_TOKEN_ID)
    assert torch.all(plain[:, 1:] == lazy.PLACEHOLDER_TOKEN_ID)
