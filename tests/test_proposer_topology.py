"""The DAS proposer where vLLM's topology and scheduler matter, with stand-ins for the runner and
vLLM's parallel state: only the drafting tensor-parallel rank builds a drafter, and only the draft
tokens the scheduler scheduled count as verified."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # imports the proposer (numba, the drafter's kernels)

K = 6
MAX_LEN = 64


def _config(backend: str = "mp"):
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=K), model_config=SimpleNamespace(max_model_len=MAX_LEN),
                           additional_config={"das": {"budget": "fixed"}}, parallel_config=SimpleNamespace(distributed_executor_backend=backend))


class _Runner:
    """The model runner attributes the proposer reads (vLLM's GPUModelRunner), spec tokens included."""

    def __init__(self):
        self.input_batch = SimpleNamespace(req_ids=[], num_prompt_tokens=np.zeros(8, np.int64), spec_token_ids=[[] for _ in range(8)])
        self.requests = {}
        self.tokens = np.zeros((8, MAX_LEN), np.int32)
        self.lens = np.zeros(8, np.int64)

    def place(self, seqs: dict, prompt_len: int, scheduled: dict | None = None):
        """Rows in ``seqs``' order; ``scheduled``: each request's draft tokens in this step's forward pass."""
        self.input_batch.req_ids = list(seqs)
        for row, (rid, seq) in enumerate(seqs.items()):
            self.requests.setdefault(rid, SimpleNamespace(sampling_params=SimpleNamespace(extra_args=None, max_tokens=None)))
            self.tokens[row, : len(seq)] = seq
            self.lens[row] = len(seq)
            self.input_batch.num_prompt_tokens[row] = prompt_len
            self.input_batch.spec_token_ids[row] = list((scheduled or {}).get(rid, []))


@pytest.fixture
def parallel_rank(monkeypatch):
    """Set this process's place in vLLM's parallel groups: ``parallel_rank(tp_rank, last_pp_stage)``."""
    from vllm.distributed import parallel_state as ps

    def place(tp_rank: int, last_stage: bool = True):
        monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: True)
        monkeypatch.setattr(ps, "get_tp_group", lambda: SimpleNamespace(rank_in_group=tp_rank))
        monkeypatch.setattr(ps, "get_pp_group", lambda: SimpleNamespace(is_last_rank=last_stage))

    return place


def test_only_the_drafting_rank_builds_a_drafter(parallel_rank, monkeypatch):
    from integrations.vllm_ext import proposer as mod

    runner = _Runner()
    parallel_rank(1)
    built = []
    monkeypatch.setattr(mod, "DASDrafter", lambda **kw: built.append(kw) or pytest.fail("a non-drafting rank built a drafter"))
    threads = threading.active_count()
    idle = mod.DASProposer(_config(), runner=runner)
    assert isinstance(idle, mod.IdleProposer) and not idle.drafting and not built
    assert threading.active_count() == threads  # no drafter threads
    assert idle.propose([[5], [], [7]], np.zeros(3, np.int64), np.zeros((3, 8), np.int32)) == [[], [], []]
    idle.begin_iteration(3)  # the control verbs do nothing there
    assert idle.snapshot() == {}
    parallel_rank(0, last_stage=False)  # the first pipeline stage does not sample, so it does not draft either
    assert isinstance(mod.DASProposer(_config(), runner=runner), mod.IdleProposer)


def test_rank_zero_of_the_last_stage_drafts_and_every_rank_drafts_with_an_external_launcher(parallel_rank):
    from integrations.vllm_ext import proposer as mod
    from integrations.vllm_ext.weight_sync import SyncAwareDASProposer

    runner = _Runner()
    parallel_rank(0)
    assert type(mod.DASProposer(_config(), runner=runner)) is mod.DASProposer
    parallel_rank(1)
    assert isinstance(SyncAwareDASProposer(_config(), runner=runner), mod.IdleProposer)
    # one engine per rank, each with its own scheduler: every rank's drafts are scheduled
    assert type(mod.DASProposer(_config("external_launcher"), runner=runner)) is mod.DASProposer


def _draft_then_verify(scheduled_len: int | None):
    """Request b drafts a's continuation (K tokens offered); the scheduler schedules the first
    ``scheduled_len`` of them (None: all), all are accepted, and the proposer sees the outcome.
    Returns the proposer, b's slot, the offered draft and what ``observe_verified`` was given."""
    from integrations.vllm_ext.proposer import DASProposer

    runner = _Runner()
    prop = DASProposer(_config(), runner=runner)
    seen = []
    observe = prop.planner.observe_verified
    prop.planner.observe_verified = lambda acc, psum, probs, offered: seen.append((acc.copy(), psum.copy(), offered.copy())) or observe(
        acc, psum, probs, offered)
    prompt, answer = [1, 2, 3], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    seqs = {"a": prompt + answer, "b": list(prompt)}
    runner.place(seqs, 3)
    prop.propose([[answer[-1]], []], runner.lens, runner.tokens)
    seqs["b"] += answer[:3]
    runner.place(seqs, 3)
    draft = prop.propose([[answer[-1]], answer[:3]], runner.lens, runner.tokens)[1]
    assert draft == answer[3: 3 + len(draft)] and len(draft) > 2
    slot = prop._slot_of["b"]
    n = len(draft) if scheduled_len is None else scheduled_len
    seqs["b"] += draft[:n] + [answer[3 + n]]  # every scheduled draft token accepted, then the bonus token
    runner.place(seqs, 3, scheduled={"b": draft[:n]})
    prop.propose([[answer[-1]], draft[:n] + [answer[3 + n]]], runner.lens, runner.tokens)
    return prop, slot, draft, seen


def test_draft_tokens_the_scheduler_cut_are_not_counted_as_rejected():
    full, slot, draft, seen_full = _draft_then_verify(None)
    assert seen_full[-1][0].tolist() == [len(draft)] and seen_full[-1][2].tolist() == [len(draft)]
    assert full.stats.unscheduled_tokens == 0
    cut, slot, draft, seen = _draft_then_verify(2)  # the token budget left room for 2 of them
    acc, psum, offered = seen[-1]
    assert acc.tolist() == [2] and offered.tolist() == [2]  # 2 of 2 accepted, not 2 of len(draft)
    assert cut.stats.unscheduled_tokens == len(draft) - 2
    # the request's evidence: the 2 scheduled tokens, then this step's new draft
    assert int(cut._state.drafted[slot]) == 2 + int(cut._state.last_len[slot])
    assert int(full._state.drafted[slot]) == len(draft) + int(full._state.last_len[slot])
    assert int(cut._state.accepted[slot]) == 2
    # what the verified drafts predicted: the calibrated probabilities of the 2 scheduled tokens
    assert 0 < psum[0] < seen_full[-1][1][0]
    # the reliability bins saw 2 accepted draft tokens, no rejected one
    table = cut.planner.acceptance.table()
    assert sum(b["trials"] for b in table) == pytest.approx(2) and all(b["observed"] == 1.0 for b in table)
