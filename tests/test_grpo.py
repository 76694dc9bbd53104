"""The GRPO loop: weight sync into a running engine, advantages, and training unchanged by DAS.

Engine tests use the tiny random model in float32 (greedy identity needs float32, see
ENVIRONMENT.md), a few prompts and a handful of tokens, so each engine starts in seconds.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from integrations.rl.grpo import group_advantages
from integrations.vllm_ext.rollouts import Rollout, RolloutBatch


def _release():
    from integrations.rl.grpo import release_engine_state

    release_engine_state()


def _greedy(llm, prompts, max_tokens=12):
    from vllm import SamplingParams, TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _perturbed(model_dir: str, out: Path, scale: float = 0.02, seed: int = 1):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(hf.named_parameters(), key=lambda kv: kv[0]):
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    hf.save_pretrained(out)
    for f in Path(model_dir).iterdir():
        if "token" in f.name or f.suffix == ".jinja":
            shutil.copy(f, out / f.name)
    return hf


# ---- pure pieces


def test_group_advantages_grpo_and_batch():
    adv = group_advantages([1.0, 0.0, 1.0, 1.0, 0.5, 0.5], [0, 0, 1, 1, 2, 2])
    assert adv[0] == pytest.approx(0.5 / math.sqrt(0.5), rel=1e-4)  # unbiased std of (1, 0) and adv[1] == pytest.approx(-adv[0])
    assert adv[2:] == [0.0, 0.0, 0.0, 0.0]  # equal rewards: no signal
    unscaled = group_advantages([1.0, 0.0], [0, 0], std_normalize=False)
    assert unscaled == [0.5, -0.5]
    batch = group_advantages([1.0, 1.0, 0.0, 0.0], [0, 0, 1, 1], mode="batch")
    assert batch[0] > 0 > batch[2] and sum(batch) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError):
        group_advantages([1.0], [0], mode="ppo")


def test_tail_time_is_the_last_tenth():
    rs = [Rollout(0, "p", i, [1], [2], "stop", t) for i, t in enumerate([1.0] * 9 + [10.0])]
    b = RolloutBatch(rs, wall_time_s=10.0, draft_tokens=0, accepted_tokens=0)
    assert b.tail_time_s(0.1) == pytest.approx(9.0)
    assert b.acceptance_length == 1.0


@pytest.mark.slow  # torch training steps on the tiny model
def test_policy_trainer_step_moves_weights_and_reports_clipping(tiny_model):
    import torch

    from integrations.rl.grpo import PolicyTrainer
    from integrations.rl.recipes import TrainSection

    cfg = TrainSection(lr=1e-2, mini_batches=2, micro_batch_tokens=64)
    tr = PolicyTrainer(tiny_model, cfg, seed=0)
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    batch = [([1, 5, 9, 13], [20, 21, 22, 2]), ([1, 5, 9, 14], [30, 31, 2]), ([1, 6], [40, 41, 42, 43, 2]), ([1, 7], [7])]
    m = tr.step(batch, [1.0, -1.0, 0.5, 0.0])
    assert m["updates"] == 2 and m["train_sequences"] == 3  # the zero-advantage response is left out
    assert 0.0 <= m["clip_frac"] <= 1.0 and m["clip_frac"] > 0  # the second mini-batch is off-policy at this lr
    assert any(not torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
    # the update raises the log-probability of the positively rewarded response
    lp_before = PolicyTrainer(tiny_model, cfg).logprobs([batch[0]])[0].sum()
    lp_after = tr.logprobs([batch[0]])[0].sum()
    assert lp_after > lp_before
    assert tr.step(batch, [0.0, 0.0, 0.0, 0.0])["updates"] == 0


@pytest.mark.slow  # torch training steps on the tiny model
def test_trainers_agree_whatever_torch_drew_before_the_update(tiny_model, tmp_path):
    # With dropout the update's masks come from (seed, step), not from the global generator that
    # the engine's sampler shares: two trainers of an A/B agree, and the generator is left as it was.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from integrations.rl.recipes import TrainSection
    from integrations.rl.trainer import PolicyTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.config.attention_dropout = 0.5
    model.save_pretrained(tmp_path / "dropout")
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path / "dropout")
    cfg = TrainSection(lr=1e-2, mini_batches=2, micro_batch_tokens=64)
    batch = [([1, 5, 9, 13], [20, 21, 22, 2]), ([1, 5, 9, 14], [30, 31, 2]), ([1, 6], [40, 41, 42, 43, 2])]
    adv = [1.0, -1.0, 0.5]
    runs = []
    for draws in (3, 11):
        tr = PolicyTrainer(str(tmp_path / "dropout"), cfg, seed=0)
        torch.manual_seed(draws)
        torch.rand(draws)  # the engine sampled something before the update
        state = torch.get_rng_state()
        m = tr.step(batch, adv)
        assert torch.equal(torch.get_rng_state(), state)
        runs.append((m, tr.model.state_dict()))
    assert runs[0][0] == runs[1][0] and all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    # the control: dropout is on (one mini-batch, so the seed changes nothing but the masks)
    one = TrainSection(lr=1e-2, mini_batches=1, micro_batch_tokens=64)
    losses = [PolicyTrainer(str(tmp_path / "dropout"), one, seed=seed).step(batch, adv)["loss"] for seed in (0, 1)]
    assert losses[0] != losses[1]


# ---- weight sync into a running engine


@pytest.mark.engine
def test_weight_sync_matches_a_fresh_engine_and_needs_a_prefix_cache_reset(tiny_model, tmp_path):
    from integrations.vllm_ext.engine import make_llm
    from integrations.vllm_ext.weight_sync import sync_weights

    # one prompt longer than a KV block (so it can be prefix-cached), one short
    prompts = [[5 + (i * 7) % 400 for i in range(400)], list(range(3, 40))]
    new = _perturbed(tiny_model, tmp_path / "new")
    fresh_llm = make_llm(str(tmp_path / "new"), "none", dtype="float32", max_model_len=1024)
    fresh = _greedy(fresh_llm, prompts)
    del fresh_llm
    _release()

    llm = make_llm(tiny_model, "none", dtype="float32", max_model_len=1024)
    try:
        old = _greedy(llm, prompts)
        assert old != fresh
        stale = sync_weights(llm, new, reset_prefix_cache=False)
        assert stale.tensors == len(new.state_dict()) and not stale.prefix_cache_reset
        assert _greedy(llm, prompts)[0] != fresh[0]  # cached KV of the old weights: neither policy
        st = sync_weights(llm, new)
        assert st.prefix_cache_reset and st.bytes > 0
        assert _greedy(llm, prompts) == fresh
    finally:
        del llm
        _release()


@pytest.mark.engine
def test_sync_aware_proposer_advances_on_weight_loads(tiny_model, tmp_path):
    from integrations.rl.recipes import das_speculative_config
    from integrations.vllm_ext.engine import make_llm
    from integrations.vllm_ext.weight_sync import drafter_policy_version, sync_weights

    new = _perturbed(tiny_model, tmp_path / "new")
    llm = make_llm(tiny_model, "none", dtype="float32", max_model_len=512,
                   speculative_config=das_speculative_config(4), additional_config={"das": {"window": 4, "budget": "fixed"}})
    try:
        assert drafter_policy_version(llm) == 0
        _greedy(llm, [list(range(3, 30))], 4)
        assert drafter_policy_version(llm) == 0  # generation alone does not advance
        for v in (1, 2):
            sync_weights(llm, new)
            _greedy(llm, [list(range(3, 30))], 4)
            assert drafter_policy_version(llm) == v
        from integrations.vllm_ext import control

        snap = control.snapshot(llm)[0]
        assert snap["weight_loads"] == 2 and snap["policy_version"] == 2
    finally:
        del llm
        _release()


# ---- the loop: training is unchanged by DAS


def _tiny_recipe(model: str, method: str, *, temperature: float, steps: int = 2, seed: int = 0, samples: int = 2, prompts: int = 3, max_tokens: int = 16):
    return {
        "model": model, "data": "champ", "pool": 8, "steps": steps, "seed": seed,
        "rollout": {"prompts_per_step": prompts, "samples": samples, "max_tokens": max_tokens, "temperature": temperature,
                    "dtype": "float32", "max_model_len": 1024},
        "speculative": {"method": method, "num_speculative_tokens": 4, "das": {"window": 4, "budget": "fixed"}},
        "train": {"lr": 3e-3, "advantage": "batch", "mini_batches": 2, "micro_batch_tokens": 512},
        "log": {"json": None, "progress": False},
    }


def _toy_reward(problems, texts):
    # depends on the text and on the problem, so advantages are non-zero even when greedy outputs agree
    return [sum(c in "aeiou" for c in t) / max(1, len(t)) + 0.1 * (len(p.prompt_text) % 5) for p, t in zip(problems, texts)]


@pytest.mark.engine
def test_greedy_training_curve_is_identical_with_and_without_das(tiny_model, tmp_path):
    import torch

    from integrations.rl.grpo import run

    runs = {}
    for method in ("none", "das"):
        rec = _tiny_recipe(tiny_model, method, temperature=0.0)
        rec["log"]["json"] = str(tmp_path / f"{method}.jsonl")
        rec["log"]["trace"] = str(tmp_path / f"{method}.parquet")
        runs[method] = run(rec, reward_fn=_toy_reward, keep_rollouts=True)
    a, b = runs["none"], runs["das"]
    assert len(a.steps) == len(b.steps) == 2
    for sa, sb in zip(a.steps, b.steps):
        assert sa["rollouts"] == sb["rollouts"]  # every token of every rollout
        assert sa["rewards"] == sb["rewards"]
        for k in ("loss", "pg_loss", "clip_frac", "approx_kl", "grad_norm", "updates", "train_tokens"):
            assert sa[k] == sb[k], k
    assert any(s["updates"] > 0 for s in a.steps)  # the policy did change
    wa, wb = a.trainer.model.state_dict(), b.trainer.model.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # weights after N steps
    # DAS really drafted, and drafts were accepted
    assert sum(s["accepted_tokens"] for s in b.steps) > 0 and sum(s["accepted_tokens"] for s in a.steps) == 0
    assert b.summary["acceptance_length"] > 1.0
    # the JSON log has one line per step plus header and summary
    lines = (tmp_path / "das.jsonl").read_text().strip().splitlines()
    assert len(lines) == 4 and '"summary"' in lines[-1]
    # log.trace: every step's rollouts, iteration = step and policy version = step + 1 (das-rollout's numbering)
    from integrations.data.trace import read_trace

    trace = read_trace(tmp_path / "das.parquet")
    assert [(r.iteration, r.policy_version) for r in trace] == [(s, s + 1) for s in range(2) for _ in b.steps[s]["rollouts"]]
    assert [(r.problem_id, r.sample, r.output_ids) for r in trace] == [tuple(x) for st in b.steps for x in st["rollouts"]]
    assert all(r.prompt_ids and r.finish_reason in ("stop", "length") for r in trace)
    assert not list(tmp_path.glob("*.partial.parquet"))  # moved over log.trace at the end


@pytest.mark.engine
def test_sampled_training_is_identical_with_and_without_das_when_coupled(peaked_tiny_model):
    # coupled sampling: each rollout's token at each index is fixed by (seed, rollout, index), so
    # at temperature 1 the same GRPO run samples the same rollouts, rewards and updates with DAS
    # drafting (accepted and rejected drafts) as without speculation (float32: the same logits).
    import torch

    from integrations.rl.grpo import run

    runs = {}
    for method in ("none", "das"):
        rec = _tiny_recipe(peaked_tiny_model, method, temperature=1.0)
        rec["rollout"]["coupled_sampling"] = True
        runs[method] = run(rec, reward_fn=_toy_reward, keep_rollouts=True)
    a, b = runs["none"], runs["das"]
    for sa, sb in zip(a.steps, b.steps, strict=True):
        assert sa["rollouts"] == sb["rollouts"]
        assert sa["rewards"] == sb["rewards"] and sa["loss"] == sb["loss"]
    wa, wb = a.trainer.model.state_dict(), b.trainer.model.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert sum(s["accepted_tokens"] for s in b.steps) > 0 and b.summary["acceptance_length"] > 1.0
    assert a.steps[0]["rollouts"] != a.steps[1]["rollouts"]  # sampled, not greedy: steps differ


def _ks_statistic(x, y) -> float:
    x, y = np.sort(np.asarray(x, float)), np.sort(np.asarray(y, float))
    grid = np.concatenate([x, y])
    return float(np.max(np.abs(np.searchsorted(x, grid, side="right") / len(x) - np.searchsorted(y, grid, side="right") / len(y))))


@pytest.mark.engine
def test_sampled_training_matches_in_distribution(peaked_tiny_model):
    """Under sampling, DAS changes which random numbers are drawn, not the distribution.

    Compared: per-rollout reward and response length of the first step of the loop (the policy is
    the same for both methods; 2 seeds x 64 rollouts = 128 per method), with and without DAS, by a
    two-sample Kolmogorov-Smirnov test at alpha = 0.001 (critical value 1.95 * sqrt((n+m)/nm)).
    Later steps are not pooled: after an update each method's policy depends on its own samples, so
    their rollouts are clustered by training path, not independent draws of one distribution (over
    6 seeds the second step's rewards gave KS D = 0.22-0.26 against a critical 0.20 between any two
    methods, "walk" and "mix" choosers against each other included, while the first step's gave
    0.05-0.08). That training is unchanged by DAS is checked exactly by the greedy test above.
    """
    from integrations.rl.grpo import run

    pooled = {"none": ([], []), "das": ([], [])}
    accepted = 0
    for seed in range(2):
        for method in ("none", "das"):
            rec = _tiny_recipe(peaked_tiny_model, method, temperature=1.0, seed=seed, samples=8, prompts=8, max_tokens=24, steps=1)
            res = run(rec, reward_fn=_toy_reward, keep_rollouts=True)
            for s in res.steps:
                pooled[method][0].extend(s["rewards"])
                pooled[method][1].extend(len(r[2]) for r in s["rollouts"])
            if method == "das":
                accepted += sum(s["accepted_tokens"] for s in res.steps)
    assert accepted > 0
    n = len(pooled["none"][0])
    crit = 1.95 * math.sqrt(2.0 / n)
    for i, what in enumerate(("reward", "length")):
        d = _ks_statistic(pooled["none"][i], pooled["das"][i])
        assert d < crit, f"{what}: KS D={d:.3f} >= {crit:.3f} (n={n})"


# ---- checked before the engine starts (issue #13)


@pytest.fixture
def no_engine(monkeypatch):
    import integrations.vllm_ext.engine

    def refuse(*a, **k):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(integrations.vllm_ext.engine, "make_llm", refuse)


def test_an_existing_or_unwritable_log_is_refused_before_anything_starts(tmp_path, no_engine):
    from integrations.rl.grpo import run

    log = tmp_path / "log.jsonl"
    log.write_text("an earlier run\n")
    with pytest.raises(ValueError, match="log.jsonl.*exists"):
        run(None, overrides=[f"log.json={log}", "model=/nonexistent"])
    assert log.read_text() == "an earlier run\n"
    with pytest.raises(ValueError, match="cannot write"):
        run(None, overrides=["log.json=/proc/das-no-such-dir/log.jsonl", "model=/nonexistent"])
    with pytest.raises(ValueError, match="code_timeout_s"):
        run(None, overrides=["reward.code_timeout_s=0"])
    trace = tmp_path / "trace.parquet"
    trace.write_bytes(b"an earlier trace")
    with pytest.raises(ValueError, match="trace.parquet.*exists"):
        run(None, overrides=[f"log.trace={trace}", "log.json=null", "model=/nonexistent"])
    assert trace.read_bytes() == b"an earlier trace"
    with pytest.raises(ValueError, match=r"log.trace must be null or a .parquet path, got '/tmp/t.csv'"):
        run(None, overrides=["log.trace=/tmp/t.csv"])


def test_code_data_without_a_sandbox_stops_before_the_engine(tiny_model, no_engine, without_bwrap):
    from integrations.rl import rewards
    from integrations.rl.grpo import run

    with pytest.raises(rewards.SandboxUnavailable, match="bubblewrap"):
        run(None, overrides=[f"model={tiny_model}", "data=humaneval", "pool=8", "log.json=null"])
