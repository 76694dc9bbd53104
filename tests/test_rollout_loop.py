"""The one rollout loop (integrations.vllm_ext.rollouts.generate_rollouts), on a fake engine.

The fake stands in for ``vllm.LLM`` where the loop touches it (``enqueue``, ``llm_engine.step()``,
``llm_engine.has_unfinished_requests()``, the speculative counters, ``collective_rpc`` for the DAS
proposer) and for ``vllm.SamplingParams`` / ``TokensPrompt``; a fake clock advances 0.5 s per
engine step, so finish times are exact. Every running request gets one token per step and the
i-th request queued finishes after ``lengths[i]`` steps.
"""

from __future__ import annotations

import argparse
import sys
import types
from types import SimpleNamespace

import pytest

# Imported here, before any test fakes ``vllm``.
from integrations.rl.ray_rollout import Group, RolloutWorker
from integrations.rollout import IterationResult, MethodRun
from integrations.vllm_ext import rollouts as loop
from scheduler.planner import StepStats

STEP_S = 0.5


class _SamplingParams:
    def __init__(self, **kw):
        self.kw = dict(kw)
        self.__dict__.update(kw)


class _Drafter:
    """The DAS proposer's side of ``control.snapshot`` / ``control.begin_iteration``."""

    def __init__(self):
        self.stats = {k: 10 for k in loop.PROPOSER_COUNTERS} | {"propose_s": 1.5, "drafter_problems": 2, "budget": "cost"}
        self.versions = []

    def begin_iteration(self, version):
        self.versions.append(version)

    def snapshot(self):
        return dict(self.stats)


class _Engine:
    def __init__(self, llm, lengths):
        self.llm, self.lengths = llm, list(lengths)
        self.added = []  # (request id, prompt, params) in the order queued
        self.live = []  # [request id, index queued, tokens so far]

    def add_request(self, request_id, prompt, params):
        self.live.append([request_id, len(self.added), 0])
        self.added.append((request_id, prompt, params))
        return f"{request_id}-cafe0000"  # engine-internal id, as vLLM 0.32 returns

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        self.llm.clock.t += STEP_S
        d = self.llm.drafter.stats
        d["steps"] += 1
        d["fitted_steps"] += 1
        d["skipped_steps"] += d["steps"] % 2
        d["rows"] += len(self.live)
        d["propose_s"] += 0.25
        d["drafter_problems"] = 5
        self.llm._das_spec_counts["draft_tokens"] += 2 * len(self.live)
        self.llm._das_spec_counts["accepted_tokens"] += 1
        outs = []
        for req in list(self.live):
            rid, i, n = req
            req[2] = n = n + 1
            if self.lengths[i] is None:  # aborted: gone without a final output
                self.live.remove(req)
                continue
            done = n >= self.lengths[i]
            reason = "length" if n >= self.added[i][2].max_tokens else "stop"
            out = SimpleNamespace(token_ids=[100 * i + j for j in range(n)], finish_reason=reason)
            outs.append(SimpleNamespace(request_id=rid, finished=done, outputs=[out]))
            if done:
                self.live.remove(req)
        return outs


class FakeLLM:
    def __init__(self, lengths, enqueue=True):
        self.clock = SimpleNamespace(t=100.0)
        self.llm_engine = _Engine(self, lengths)
        self._das_spec_counts = {"drafts": 3.0, "draft_tokens": 50.0, "accepted_tokens": 20.0}
        self.drafter = _Drafter()
        self._next_id = 7
        if enqueue:
            self.enqueue = self._enqueue

    def _enqueue(self, prompts, params, use_tqdm=True):
        ids = []
        for p, sp in zip(prompts, params):
            ids.append(self.llm_engine.add_request(str(self._next_id), p, sp))
            self._next_id += 1
        return ids

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):  # by name, as vLLM runs a worker extension's method
        from integrations.vllm_ext.worker_extension import DASWorkerExtension

        return [getattr(DASWorkerExtension, method)(SimpleNamespace(model_runner=SimpleNamespace(drafter=self.drafter)), *args)]


@pytest.fixture
def fake_vllm(monkeypatch):
    """``vllm`` (SamplingParams, TokensPrompt, RequestOutputKind) and the loop's clock, faked."""
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = _SamplingParams
    vllm.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    sp_mod = types.ModuleType("vllm.sampling_params")
    sp_mod.RequestOutputKind = SimpleNamespace(FINAL_ONLY="final-only")
    vllm.sampling_params = sp_mod
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sp_mod)
    clocks = []

    def make(lengths, enqueue=True):
        llm = FakeLLM(lengths, enqueue)
        clocks.append(llm.clock)
        return llm

    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: clocks[-1].t))
    return make


def test_groups_samples_finish_times_timeline_counters_and_tail(fake_vllm):
    import torch

    lengths = [4, 1, 3, 2, 6, 2]  # queued in (group, sample) order: group 0 = 0..2, group 1 = 3..5
    llm = fake_vllm(lengths)
    prompts = [[1, 2, 3], [4, 5]]
    batch = loop.generate_rollouts(llm, prompts, ["p0", "p1"], samples=3, max_tokens=6, temperature=0.7, top_p=0.9, seed=1234,
                                 draft_caps=[None, 4], das=True, sampling={"ignore_eos": True})
    assert torch.initial_seed() == 1234
    # the requests: one n=1 request per sample, in (group, sample) order; no sample keys unless coupled
    added = llm.llm_engine.added
    assert [a[1] for a in added] == [{"prompt_token_ids": prompts[k // 3]} for k in range(6)]
    for k, (_, _, sp) in enumerate(added):
        extra = {"das_problem_id": f"p{k // 3}"} | ({"das_max_draft_tokens": 4} if k >= 3 else {})
        assert sp.kw == {"n": 1, "temperature": 0.7, "top_p": 0.9, "max_tokens": 6, "extra_args": extra, "ignore_eos": True}
    # every rollout keeps its group and sample, whatever order the engine finished them in
    assert [(r.group, r.sample, r.problem_id) for r in batch.rollouts] == [(k // 3, k % 3, f"p{k // 3}") for k in range(6)]
    assert [r.output_ids for r in batch.rollouts] == [[100 * k + j for j in range(n)] for k, n in enumerate(lengths)]
    assert [r.prompt_ids for r in batch.rollouts] == [prompts[k // 3] for k in range(6)]
    assert [r.finish_s for r in batch.rollouts] == [STEP_S * n for n in lengths]
    assert [r.finish_reason for r in batch.rollouts] == ["stop"] * 4 + ["length", "stop"]
    # the running batch after each engine step, and the wall time up to the last rollout
    assert batch.step_s.tolist() == [STEP_S * (i + 1) for i in range(6)]
    assert batch.running.tolist() == [5, 3, 2, 1, 1, 0]
    assert batch.wall_time_s == 3.0 and batch.finish_times() == [0.5, 1.0, 1.0, 1.5, 2.0, 3.0]
    assert batch.tail_time_s(0.5) == 2.0  # the 3rd of 6 finished at 1.0 s, the last at 3.0 s
    assert batch.tail_time_s(0.1) == 0.0
    assert batch.tail_row_steps == 0 and batch.tail_acceptance_length == 1.0  # the 6th of 6 is the last: no tail
    # counters: speculative ones as deltas over the batch
    assert batch.tokens == sum(lengths)
    assert batch.draft_tokens == 2 * sum(lengths) and batch.accepted_tokens == 6
    assert batch.verification_steps == sum(lengths) - 6
    assert batch.acceptance_length == pytest.approx(sum(lengths) / (sum(lengths) - 6))
    # proposer counters as deltas, everything else as it stands
    p = batch.proposer
    assert p["steps"] == 6 and p["fitted_steps"] == 6 and p["rows"] == sum(lengths)
    assert p["skipped_steps"] == 3 and p["drafts"] == 0 and p["failures"] == 0 and p["bad_requests"] == 0
    assert p["propose_s"] == pytest.approx(1.5)
    assert p["drafter_problems"] == 5 and p["budget"] == "cost"


def test_coupled_rollouts_carry_one_sample_key_each_from_the_seed_and_their_place(fake_vllm):
    from integrations.vllm_ext.patches.coupled_sampling import KEY_ARG, rollout_key

    def keys(seed, coupled):
        llm = fake_vllm([2, 1, 3, 2])
        loop.generate_rollouts(llm, [[1, 2], [3]], ["p0", "p1"], samples=2, max_tokens=4, temperature=1.0, seed=seed,
                             draft_caps=[3, None], coupled=coupled)
        extras = [sp.kw["extra_args"] for _, _, sp in llm.llm_engine.added]
        assert [{k: v for k, v in e.items() if k != KEY_ARG} for e in extras] == [
            {"das_problem_id": "p0", "das_max_draft_tokens": 3}] * 2 + [{"das_problem_id": "p1"}] * 2
        return [e.get(KEY_ARG) for e in extras]

    assert keys(7, coupled=True) == [rollout_key(7, k) for k in range(4)]
    assert len(set(keys(7, coupled=True))) == 4 and set(keys(7, coupled=True)).isdisjoint(keys(8, coupled=True))
    assert keys(7, coupled=False) == [None] * 4


def test_the_tail_counts_its_own_steps_and_accepted_draft_tokens(fake_vllm):
    """After the 9th of 10 rollouts finished (step 2), the 10th runs alone for 4 more steps: 4 row
    steps, and the fake engine's counters grow by 2 draft tokens per running row and 1 accepted
    token per step there, so the tail yields 2 tokens per verification step."""
    llm = fake_vllm([1] * 8 + [2, 6])
    batch = loop.generate_rollouts(llm, [[1]], ["a"], samples=10, max_tokens=8, temperature=1.0)
    assert batch.running.tolist() == [2, 1, 1, 1, 1, 0]
    assert batch.tail_time_s(0.1) == pytest.approx(2.0)
    assert (batch.tail_row_steps, batch.tail_draft_tokens, batch.tail_accepted_tokens) == (4, 8, 4)
    assert batch.tail_acceptance_length == pytest.approx(2.0)


def test_per_prompt_sample_counts_without_enqueue(fake_vllm):
    llm = fake_vllm([1, 2, 3], enqueue=False)  # older vLLM: requests go to llm_engine.add_request
    batch = loop.generate_rollouts(llm, [[1], [2], [3]], ["a", "b", "c"], samples=[2, 0, 1], max_tokens=8, temperature=0.0)
    assert [(r.group, r.sample, r.problem_id, r.finish_s) for r in batch.rollouts] == [(0, 0, "a", 0.5), (0, 1, "a", 1.0), (2, 0, "c", 1.5)]
    assert all(sp.output_kind == "final-only" for _, _, sp in llm.llm_engine.added)
    assert batch.proposer is None and batch.running.tolist() == [2, 1, 0]


def test_bad_arguments_and_lost_requests(fake_vllm):
    llm = fake_vllm([1])
    for kw in ({"problem_ids": ["a", "b"]}, {"samples": [1, 1]}, {"draft_caps": [1, 2]}, {"samples": -1}):
        args = {"problem_ids": ["a"], "samples": 1} | kw
        with pytest.raises(ValueError):
            loop.generate_rollouts(llm, [[1]], args.pop("problem_ids"), max_tokens=4, temperature=1.0, **args)
    with pytest.raises(RuntimeError, match="never finished"):
        loop.generate_rollouts(fake_vllm([1, None]), [[1]], ["a"], samples=2, max_tokens=4, temperature=1.0)


def test_proposer_counter_list_is_the_proposers():
    import dataclasses

    assert set(loop.PROPOSER_COUNTERS) == {f.name for f in dataclasses.fields(StepStats)}


def test_das_rollout_iteration_and_trace_records(fake_vllm):
    import torch

    lengths = [3, 1, 2, 4]
    llm = fake_vllm(lengths)
    run = MethodRun.__new__(MethodRun)  # the engine is the fake: skip building one
    run.name, run.method, run.llm = "das", "das", llm
    run.args = argparse.Namespace(samples=2, max_tokens=4, temperature=0.6, seed=3, coupled_sampling=True)
    prompts = [[9], [1, 2], [3, 4, 5]]
    records = []
    r = run.run_iteration(1, [2, 0], prompts, ["x", "y", "z"], records)
    assert all("das_sample_key" in sp.kw["extra_args"] for _, _, sp in llm.llm_engine.added)  # --coupled-sampling
    assert isinstance(r, IterationResult) and llm.drafter.versions == [2]
    assert torch.initial_seed() == 3 * 100003 + 2
    assert (r.iteration, r.policy_version, r.rollouts, r.tokens, r.wall_time_s) == (1, 2, 4, 10, 2.0)
    assert (r.draft_tokens, r.accepted_tokens, r.verification_steps) == (20, 4, 6)
    assert r.tail_s == 0.0 and r.longest_rollout_tokens == 4 and r.capped_rollouts == 1
    assert r.timeline == {"t_s": [0.5, 1.0, 1.5, 2.0], "running": [3, 2, 1, 0]}
    assert r.proposer["steps"] == 4
    assert [(t.iteration, t.policy_version, t.problem_id, t.sample, t.prompt_ids, t.output_ids) for t in records] == [
        (1, 2, "z", 0, [3, 4, 5], [0, 1, 2]), (1, 2, "z", 1, [3, 4, 5], [100]),
        (1, 2, "x", 0, [9], [200, 201]), (1, 2, "x", 1, [9], [300, 301, 302, 303])]


def test_ray_worker_returns_each_groups_samples_in_order(fake_vllm):
    llm = fake_vllm([2, 1, 3])
    worker = RolloutWorker.__new__(RolloutWorker)  # the engine is the fake: skip building one
    worker.method, worker.llm = "das", llm
    out = worker.generate([Group("g1", "p1", [5], 2), Group("g2", "p2", [6], 1)], {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}, 11)
    assert out.outputs == {"g1": [[0, 1], [100]], "g2": [[200, 201, 202]]}
    assert out.stats["tokens"] == 6 and out.stats["rollouts"] == 3 and out.stats["lengths"] == [2, 1, 3]
    assert [sp.kw["ignore_eos"] for _, _, sp in llm.llm_engine.added] == [True] * 3


def test_every_engine_prefills_one_untimed_batch_of_the_first_iterations_shape_before_any_timed_iteration(monkeypatch):
    # The first big step after all engines are built pays a one-off cost (page faults, 5 s on
    # an Intel AMX VM) that fell on the method under test: every engine must be past it first.
    import integrations.rollout as rollout

    events = []

    class _Run:
        def __init__(self, method, model, args, kv_gib=0):
            self.name = method
            events.append(("build", method))

        def warm_batch(self, lengths):
            events.append(("warm", self.name, list(lengths)))

        def run_iteration(self, it, chosen, prompts, problem_ids, rollouts=None):
            events.append(("iteration", self.name, it))
            return it

        def close(self):
            events.append(("close", self.name))

    monkeypatch.setattr(rollout, "MethodRun", _Run)
    args = argparse.Namespace(samples=2)
    prompts = [[1, 2, 3], [4], [5, 6]]
    out = rollout.run_side_by_side(["das", "none"], "m", prompts, ["a", "b", "c"], [[2, 0], [1, 2]], args, kv_gib=1)
    assert out == {"das": [0, 1], "none": [0, 1]}
    first_shape = [2, 2, 3, 3]  # problems 2 and 0, two samples each
    assert events[:4] == [("build", "das"), ("build", "none"), ("warm", "das", first_shape), ("warm", "none", first_shape)]
    assert [e for e in events[4:] if e[0] == "iteration"] == [("iteration", "das", 0), ("iteration", "none", 0),
                                                               ("iteration", "none", 1), ("iteration", "das", 1)]


def test_a_warm_batch_is_random_prompts_of_the_given_lengths_marked_as_warm_up(fake_vllm):
    calls = []

    class _LLM:
        llm_engine = SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: 50))

        def generate(self, prompts, params, use_tqdm=True):
            calls.append((prompts, params))

    run = MethodRun.__new__(MethodRun)
    run.llm = _LLM()
    run.warm_batch([3, 1, 5])
    (prompts, params), = calls
    ids = [p["prompt_token_ids"] for p in prompts]  # the fake TokensPrompt is a dict
    assert [len(i) for i in ids] == [3, 1, 5] and all(0 <= t < 50 for i in ids for t in i)
    assert params.kw == {"max_tokens": 2, "temperature": 1.0, "extra_args": {"das_warmup": True}}  # no das_problem_id
