"""DASProposer row/request bookkeeping, budgets and failure isolation, with a stand-in model runner.

The runner stand-in has exactly the attributes the proposer reads from vLLM's GPUModelRunner:
``input_batch.req_ids``, ``input_batch.num_prompt_tokens`` and ``requests[req_id].sampling_params``.
"""

import json
from types import SimpleNamespace

import numpy as np
import pytest

# No engine, but importing the proposer module (numba, the drafter and its kernels) takes seconds:
# imported in the tests below, not at collection.
pytestmark = pytest.mark.slow


def DASProposer(*args, **kwargs):
    from integrations.vllm_ext.proposer import DASProposer as cls

    return cls(*args, **kwargs)


def das_section(*args, **kwargs):
    from integrations.vllm_ext.proposer import das_section as fn

    return fn(*args, **kwargs)

K = 6
MAX_LEN = 64


def make_config(das=None, k=K):
    # Bookkeeping tests draft with the ``fixed`` budget: the default ``cost`` budget measures the
    # engine's step times first, which a stand-in runner does not have.
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=MAX_LEN),
        additional_config={"das": das if das is not None else {"budget": "fixed"}},
    )


class Engine:
    """A toy batch: rows of token ids that the test grows as a real engine would."""

    def __init__(self):
        self.runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=[], num_prompt_tokens=np.zeros(8, np.int64)), requests={})
        self.tokens = np.zeros((8, MAX_LEN), np.int32)
        self.lens = np.zeros(8, np.int64)
        self.seqs = {}  # req_id -> list of tokens (prompt + output)
        self.prompt_len = {}

    def add(self, req_id, prompt, extra=None):
        self.seqs[req_id] = list(prompt)
        self.prompt_len[req_id] = len(prompt)
        self.runner.requests[req_id] = SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra, max_tokens=None))

    def finish(self, req_id):
        del self.runner.requests[req_id]
        del self.seqs[req_id]

    def layout(self, order):
        """Place requests on rows in ``order`` (rows move between steps in vLLM)."""
        self.runner.input_batch.req_ids = list(order)
        for row, rid in enumerate(order):
            seq = self.seqs[rid]
            self.tokens[row, : len(seq)] = seq
            self.lens[row] = len(seq)
            self.runner.input_batch.num_prompt_tokens[row] = self.prompt_len[rid]


def sibling_draft(eng, prop, answer):
    """Request a generates ``answer`` first; its sibling b (same prompt) then gets 4 tokens of it
    and drafts on row 0. Returns that step's drafts."""
    prompt = [1, 2, 3]
    eng.add("a", prompt)
    eng.add("b", prompt)
    eng.seqs["a"] += answer
    eng.layout(["a", "b"])
    prop.propose([[answer[-1]], []], eng.lens, eng.tokens)
    eng.seqs["b"] += answer[:4]
    eng.layout(["b", "a"])
    return prop.propose([answer[:4], [answer[-1]]], eng.lens, eng.tokens)


def test_siblings_draft_from_each_other_while_rows_move():
    eng = Engine()
    prop = DASProposer(make_config(), runner=eng.runner)
    answer = [10, 11, 12, 13, 14, 15, 16, 17]
    # b drafts a's continuation although it now sits on row 0.
    drafts = sibling_draft(eng, prop, answer)
    assert drafts[0] == answer[4:8]  # match of 4 tokens: a draft of up to 4 (spec factor 1)
    assert len(drafts[0]) <= K


def test_defer_global_follows_the_engine_device(monkeypatch):
    """``defer_global`` unset: on where torch sees a GPU (the global tree's appends overlap its
    forward pass), off on a CPU engine; a set value wins. Deferred, siblings still draft from
    each other (their problem tree is appended at once)."""
    from integrations.vllm_ext import cpu_runtime

    eng = Engine()
    monkeypatch.setattr(cpu_runtime, "is_cpu_build", lambda: True)
    assert DASProposer(make_config(), runner=eng.runner).drafter.defer_global is False
    monkeypatch.setattr(cpu_runtime, "is_cpu_build", lambda: False)
    assert DASProposer(make_config({"budget": "fixed", "defer_global": False}), runner=eng.runner).drafter.defer_global is False
    prop = DASProposer(make_config(), runner=eng.runner)
    assert prop.drafter.defer_global is True
    answer = [10, 11, 12, 13, 14, 15, 16, 17]
    assert sibling_draft(eng, prop, answer)[0] == answer[4:8]
    assert prop.drafter.deferred_appends == 2


def test_row_in_prefill_gets_no_draft_and_budget_from_extra_args():
    eng = Engine()
    prop = DASProposer(make_config(), runner=eng.runner)
    eng.add("a", [1, 2, 3])
    eng.seqs["a"] += [4, 5, 6, 7, 8, 9, 4, 5, 6]
    eng.add("c", [1, 2, 3], extra={"das_max_draft_tokens": 2})
    eng.seqs["c"] += [4, 5, 6, 7, 8, 9, 4, 5]
    eng.add("d", [1, 2, 3], extra={"das_max_draft_tokens": 0})
    eng.seqs["d"] += [4, 5]
    eng.layout(["a", "c", "d"])
    drafts = prop.propose([[], [5], [5]], eng.lens, eng.tokens)
    assert drafts[0] == []  # sampled nothing this step: chunked prefill
    assert 0 < len(drafts[1]) <= 2
    assert drafts[2] == []


def test_preempted_request_is_reconciled_from_token_ids():
    eng = Engine()
    prop = DASProposer(make_config(), runner=eng.runner)
    eng.add("a", [7, 8])
    eng.seqs["a"] += [1, 2, 3]
    eng.layout(["a"])
    prop.propose([[3]], eng.lens, eng.tokens)
    # a is preempted for three steps (off the batch, still in runner.requests), then resumes.
    eng.seqs["a"] += [4, 5, 1, 2]
    eng.layout(["a"])
    drafts = prop.propose([[2]], eng.lens, eng.tokens)
    # Learnt from tokens it never saw in sampled_token_ids: "1 2" was followed by "3 4 5 1" (and
    # the mix chooser, not bound by a spec factor, follows the repeat on: "2 3 ...").
    assert drafts[0][:4] == [3, 4, 5, 1]


def test_finished_requests_free_their_state_but_keep_history():
    eng = Engine()
    prop = DASProposer(make_config(), runner=eng.runner)
    eng.add("a", [1, 2])
    eng.seqs["a"] += [3, 4, 5, 6, 7, 8, 9, 10]
    eng.layout(["a"])
    prop.propose([[10]], eng.lens, eng.tokens)
    eng.finish("a")
    eng.add("b", [1, 2])
    eng.seqs["b"] += [3, 4, 5]
    eng.layout(["b"])
    drafts = prop.propose([[5]], eng.lens, eng.tokens)
    assert "a" not in prop._slot_of
    assert drafts[0] == [6, 7, 8, 9, 10]  # a's continuation (the problem tree also holds the prompt tail)


def test_failure_gives_empty_drafts_and_is_counted(caplog):
    eng = Engine()
    prop = DASProposer(make_config(), runner=eng.runner)
    eng.add("a", [1, 2])
    eng.layout(["a"])

    def boom(*a, **k):
        raise RuntimeError("drafter exploded")

    prop.drafter.speculate_batch = boom
    drafts = prop.propose([[2]], eng.lens, eng.tokens)
    assert drafts == [[]]
    assert prop.stats.failures == 1
    assert "drafter exploded" in caplog.text


def test_bad_additional_config_names_the_key():
    with pytest.raises(ValueError, match=r"additional_config\['das'\]\['window'\] must be an int >= 1, got 0"):
        das_section({"das": {"window": 0}})
    with pytest.raises(ValueError, match="bogus"):
        das_section({"das": {"bogus": 1}})
    with pytest.raises(ValueError, match="c_tok"):
        das_section({"das": {"c_base": 0.01}})
    with pytest.raises(ValueError, match="window"):
        DASProposer(make_config({"window": 0}), runner=Engine().runner)


def test_needs_a_model_runner():
    with pytest.raises(RuntimeError, match="model runner"):
        DASProposer(make_config())


def _repetitive_batch(prop_config):
    eng = Engine()
    prop = DASProposer(prop_config, runner=eng.runner)
    for rid in ("a", "b", "c"):
        eng.add(rid, [1, 2])
        eng.seqs[rid] += [3, 4, 5, 6, 7, 8, 9, 3, 4, 5, 6, 7, 8, 9, 3, 4]
    eng.layout(["a", "b", "c"])
    return prop.propose([[4], [4], [4]], eng.lens, eng.tokens), prop


def test_cost_budget_drafts_when_steps_are_fixed_cost_and_not_when_tokens_dominate():
    cheap_tokens, prop = _repetitive_batch(make_config({"budget": "cost", "c_base": 0.05, "c_tok": 1e-5}))
    assert all(len(d) == K for d in cheap_tokens)
    assert prop.stats.fitted_steps == 1
    # a draft token costs c_tok and saves c_tok + c_base / 3: it pays only if accepted with p > 0.9997,
    # above what the drafter ever claims (0.998)
    costly_tokens, _ = _repetitive_batch(make_config({"budget": "cost", "c_base": 1e-5, "c_tok": 0.01}))
    assert all(d == [] for d in costly_tokens)
    fixed, _ = _repetitive_batch(make_config({"budget": "fixed", "c_base": 1e-4, "c_tok": 0.01}))
    assert all(len(d) == K for d in fixed)


def test_none_budget_never_drafts_but_still_feeds_the_drafter():
    # das:none measures the speculative path on its own: every row gets an empty draft, while the
    # verified tokens still go into the drafter (a sibling could draft from them under another budget).
    drafts, prop = _repetitive_batch(make_config({"budget": "none"}))
    assert drafts == [[], [], []]
    assert prop.stats.draft_tokens == 0 and prop.stats.failures == 0
    assert prop.drafter.num_tokens(["a", "b", "c"]).tolist() == [18, 18, 18]
    fixed, _ = _repetitive_batch(make_config({"budget": "fixed"}))
    assert all(len(d) == K for d in fixed)  # the same rows draft under a budget that allows it


def test_makespan_budget_prices_like_cost_when_rows_cannot_be_told_apart():
    # Three equal rows, no length history: each finishes last with odds 1/3, the value of an
    # accepted token is c_row + c_base / 3, the cost budget's; so the same drafts.
    cheap, prop = _repetitive_batch(make_config({"budget": "makespan", "c_base": 0.05, "c_tok": 1e-5}))
    assert all(len(d) == K for d in cheap)
    assert prop.predictor is not None and prop.stats.failures == 0
    costly, _ = _repetitive_batch(make_config({"budget": "makespan", "c_base": 1e-5, "c_tok": 0.01}))  # pays only at p > 0.9997
    assert all(d == [] for d in costly)


def test_length_policies_learn_lengths_from_finished_rollouts():
    eng = Engine()
    prop = DASProposer(make_config({"budget": "class"}), runner=eng.runner)
    prop.begin_iteration(1)
    eng.add("a", [1, 2], extra={"das_problem_id": "short-problem"})
    eng.seqs["a"] += [3, 4, 3, 4, 3, 4]
    eng.layout(["a"])
    prop.propose([[4]], eng.lens, eng.tokens)
    eng.finish("a")
    eng.layout([])
    prop.propose([], eng.lens, eng.tokens)
    prop.begin_iteration(2)
    assert prop.predictor is not None
    assert prop.predictor.history_lengths("short-problem").tolist() == [6]
    snap = prop.snapshot()
    assert snap["budget"] == "class" and snap["failures"] == 0


def test_a_warm_up_request_gets_no_drafts_and_leaves_no_tree_or_length_history():
    eng = Engine()
    prop = DASProposer(make_config({"budget": "class"}), runner=eng.runner)
    prop.begin_iteration(1)
    for rid, extra in (("real", {"das_problem_id": "p"}), ("warm", {"das_problem_id": "p", "das_warmup": True})):
        eng.add(rid, [1, 2, 3], extra=extra)
        eng.seqs[rid] += [4, 5, 6, 7, 8, 9, 4, 5]
    eng.layout(["warm", "real"])
    drafts = prop.propose([[5], [5]], eng.lens, eng.tokens)
    assert drafts[0] == [] and len(drafts[1]) > 0
    assert "warm" not in prop.drafter._requests and prop.stats.bad_requests == 0
    for rid in ("warm", "real"):
        eng.finish(rid)
    eng.layout([])
    prop.propose([], eng.lens, eng.tokens)
    prop.begin_iteration(2)
    assert prop.predictor.history_lengths("p").tolist() == [8]  # the real request's only


@pytest.mark.parametrize("bad", [{"das_max_draft_tokens": "abc"}, {"das_max_draft_tokens": -1}, {"das_problem_id": [1, 2]},
                                 {"das_warmup": 1}])
def test_a_request_with_bad_options_loses_only_its_own_draft(bad):
    eng = Engine()
    prop = DASProposer(make_config(), runner=eng.runner)
    for rid, extra in (("good", None), ("bad", bad)):
        eng.add(rid, [1, 2, 3], extra=extra)
        eng.seqs[rid] += [4, 5, 6, 7, 8, 9, 4, 5]
    eng.layout(["bad", "good"])
    drafts = prop.propose([[5], [5]], eng.lens, eng.tokens)
    assert drafts[0] == [] and len(drafts[1]) > 0  # the good request still drafts
    assert prop.stats.bad_requests == 1 and prop.stats.failures == 0
    eng.seqs["bad"] += [6]
    eng.seqs["good"] += [6]
    eng.layout(["good", "bad"])  # rows move; the bad request stays isolated
    drafts = prop.propose([[6], [6]], eng.lens, eng.tokens)
    assert len(drafts[0]) > 0 and drafts[1] == [] and prop.stats.bad_requests == 1
    assert "bad" not in prop.drafter._requests
    eng.finish("bad")
    eng.layout(["good"])
    prop.propose([[6]], eng.lens, eng.tokens)
    assert "bad" not in prop._slot_of


def test_cost_budget_warm_up_step_drafts_a_quarter_of_a_large_batch():
    # No prices yet (a fresh two-regime model): a drafting warm-up step over 32 rows that could
    # all draft K tokens keeps at most 32 // 4 = 8 tokens in all, so it stays cheap where the
    # forward is compute-bound.
    rows = 32
    prop_eng = Engine()
    prop_eng.tokens = np.zeros((rows, MAX_LEN), np.int32)
    prop_eng.lens = np.zeros(rows, np.int64)
    prop_eng.runner.input_batch.num_prompt_tokens = np.zeros(rows, np.int64)
    prop = DASProposer(make_config({"budget": "cost"}), runner=prop_eng.runner)
    prop.begin_iteration(1)
    ids = [f"r{i}" for i in range(rows)]
    for rid in ids:
        prop_eng.add(rid, [1, 2], {"das_problem_id": "p"})
        prop_eng.seqs[rid] += [3, 4, 5, 6, 7, 8, 9, 3, 4, 5, 6, 7, 8, 9, 3, 4]
    prop_eng.layout(ids)
    drafted = []
    for _ in range(4):  # warm-up alternates plain and drafting steps
        out = prop.propose([[4]] * rows, prop_eng.lens, prop_eng.tokens)
        drafted.append(sum(len(d) for d in out))
    assert max(drafted) > 0
    assert max(drafted) <= rows // 4


def _hand_clock(prop):
    """``step(seconds, rows, drafted, accepted=0)``: feed the proposer's planner one clean decode
    step of ``rows`` rows that verified ``drafted`` draft tokens, ``seconds`` after the last."""
    now = 0.0

    def step(seconds, rows, drafted, accepted=0):
        nonlocal now
        now += seconds
        prop.planner.record_step(now, rows, drafted, rows + drafted, 100 * rows, True, accepted)

    return step


def test_the_step_log_has_a_line_per_clean_step_and_says_which_ones_the_fit_used(tmp_path, monkeypatch):
    from integrations.vllm_ext.proposer import STEP_LOG_FIELDS
    from scheduler.planner import SCREEN_STEPS

    log = tmp_path / "steps.jsonl"
    prop = DASProposer(make_config({"budget": "cost", "step_log": str(log)}), runner=Engine().runner)
    step = _hand_clock(prop)
    step(0.03, 2, 0)  # starts the clock: not a step
    step(7.2, 2, 0)  # a warm-up step
    n = SCREEN_STEPS - 1 + 20
    for i in range(n):  # 8 rows; every other step verifies 16 draft tokens (1.2 ms each), 8 accepted
        step(0.022 + 0.0014 * 8 + 0.0012 * 16 * (i % 2), 8, 16 * (i % 2), 8 * (i % 2))
    prop._step_log.flush()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == SCREEN_STEPS + 20
    assert all(tuple(rec) == STEP_LOG_FIELDS for rec in lines)
    assert [rec["fitted"] for rec in lines].count(False) == 1
    assert lines[0]["seconds"] == pytest.approx(7.2) and not lines[0]["fitted"]
    assert lines[0]["c_base"] is None  # no fit yet
    last = lines[-1]
    assert (last["rows"], last["draft_tokens"], last["accepted"]) == (8, 16 * ((n - 1) % 2), 8 * ((n - 1) % 2))
    assert last["c_draft"] == pytest.approx(0.0012, rel=0.05)
    assert last["knee"] == 0.0 and last["c_ctx"] == 0.0  # compute-bound steps: the line prices


def test_verification_outcomes_fill_the_reliability_bins():
    # b drafts a's continuation (4 tokens); the engine then accepts 2 of them (3 new tokens with
    # the bonus token): the first two draft tokens count as accepted, the next two as rejected.
    eng = Engine()
    prop = DASProposer(make_config(), runner=eng.runner)
    answer = [10, 11, 12, 13, 14, 15, 16, 17]
    drafts = sibling_draft(eng, prop, answer)
    assert len(drafts[0]) == 4
    assert prop.planner.acceptance.trials.sum() == 0
    eng.seqs["b"] += [answer[4], answer[5], 99]
    eng.layout(["b", "a"])
    prop.propose([[answer[4], answer[5], 99], [answer[-1]]], eng.lens, eng.tokens)
    assert prop.planner.acceptance.trials.sum() == pytest.approx(4.0)
    assert prop.planner.acceptance.accepted.sum() == pytest.approx(2.0)
    table = prop.snapshot()["reliability"]
    assert sum(r["trials"] for r in table) == pytest.approx(4.0)


def _priced_stream(cut: bool, budget: str):
    """Four sibling requests decoded for 40 steps by a proposer with given prices (a draft token
    is worth keeping only at a calibrated probability above ~0.29); each row accepts the kept
    draft prefix that matches its own continuation, then one more token. Returns the drafts of
    every step, the tokens the drafter drafted, and the proposer. ``cut`` False: the proposer
    lets the drafter draft down to its own ``min_token_prob``, as before the step's cutoff."""
    rng = np.random.default_rng(3)
    base = rng.integers(20, 60, 120)
    eng = Engine()
    eng.tokens = np.zeros((8, 256), np.int32)
    config = make_config({"budget": budget, "c_base": 0.02, "c_tok": 0.002}, k=12)
    config.model_config.max_model_len = 256
    prop = DASProposer(config, runner=eng.runner)
    if not cut:
        prop.planner.budget.cutoff = lambda step: None  # drafts down to the drafter's own cutoff
    drafted = [0]
    speculate = prop.drafter.speculate_batch

    def counted(*args, **kwargs):
        found = speculate(*args, **kwargs)
        drafted[0] += int(found.lengths.sum())
        return found

    prop.drafter.speculate_batch = counted
    truth = {}
    for i, rid in enumerate("abcd"):
        seq = base.copy()
        flips = rng.uniform(size=seq.shape[0]) < 0.1
        seq[flips] = rng.integers(20, 60, int(flips.sum()))
        truth[rid] = [int(t) for t in seq]
        eng.add(rid, [1, 2, 3])
        eng.seqs[rid] += truth[rid][: 1 + 12 * i]  # siblings at different points of the same text
    pos = {rid: len(eng.seqs[rid]) - 3 for rid in "abcd"}
    sampled = [[eng.seqs[rid][-1]] for rid in "abcd"]
    steps = []
    for _ in range(40):
        eng.layout(list("abcd"))
        drafts = prop.propose(sampled, eng.lens, eng.tokens)
        steps.append(drafts)
        sampled = []
        for rid, draft in zip("abcd", drafts):
            seq, at = truth[rid], pos[rid]
            n = 0
            while n < len(draft) and draft[n] == seq[at + n]:
                n += 1
            new = seq[at : at + n + 1]
            eng.seqs[rid] += new
            pos[rid] += len(new)
            sampled.append(new)
    return steps, drafted[0], prop


@pytest.mark.parametrize("budget", ["cost", "makespan"])
def test_drafts_stop_at_the_steps_price_and_the_engine_gets_the_same_drafts(budget):
    """A priced step keeps no draft token at or below :func:`keep_bound`, so the proposer has the
    drafter stop there (one drafter call per step): every step hands the engine the same drafts
    as when the drafter drafts down to its own cutoff and the selection cuts, for fewer drafted
    tokens."""
    with_cut, drafted_cut, prop = _priced_stream(True, budget)
    without, drafted_all, _ = _priced_stream(False, budget)
    assert with_cut == without
    assert sum(len(d) for step in with_cut for d in step) > 40  # the engine got drafts
    assert prop.stats.cut_steps > 20 and drafted_cut < 0.8 * drafted_all
