"""The "mix" draft chooser: context mixing over scopes, weights learned from accept/reject outcomes."""

from __future__ import annotations

import numpy as np
import pytest

from das import DASDrafter
from das import mix_kernels as mixing

PROMPT = [101, 102, 103]


def _bias(d: DASDrafter) -> float:
    return float(d.mixer_weights[0, 0])


def test_mix_is_the_default_and_drafts_what_the_history_repeats():
    d = DASDrafter()
    assert d.chooser == "mix" and d.min_token_prob == 0.1
    for _ in range(3):
        d.add_rollout(PROMPT, [7, 8, 9, 10, 11])
    d.start_request("r", PROMPT)
    d.add_tokens("r", [7])
    got = d.speculate("r", 8)
    assert got.tokens.tolist()[:3] == [8, 9, 10]
    assert np.all(np.diff(got.probs) <= 0) and 0.0 < got.probs[-1] <= got.probs[0] < 1.0
    assert got.score == pytest.approx(float(got.probs.sum()))


def test_a_draft_follows_its_longest_contexts_past_its_first_token():
    """After each draft token every context locus moves down with it: the draft goes on as the long
    context 1 2 3 4 did (5 6), not as the one-token context 4 does in most of the history (10)."""
    d = DASDrafter(global_rollouts=0)
    for _ in range(3):
        d.add_rollout(PROMPT, [1, 2, 3, 4, 5, 6, 7])
    for t in range(20, 32):
        d.add_rollout(PROMPT, [t, 4, 10, 11])
    d.start_request("r", PROMPT)
    d.add_tokens("r", [1, 2, 3])
    assert d.speculate("r", 3).tokens.tolist() == [4, 5, 6]


def _start_on_new_problem(d: DASDrafter, pid, rollouts: int = 2) -> None:
    """A problem whose history is ``rollouts`` copies of 7 8 9 10 11 12, and a live request of it at token 7."""
    for _ in range(rollouts):
        d.add_rollout(PROMPT, [7, 8, 9, 10, 11, 12], problem_id=pid)
    d.start_request(pid, PROMPT, problem_id=pid)
    d.add_tokens(pid, [7])


def test_rejected_drafts_lower_the_acceptance_probability_and_accepted_ones_raise_it():
    """The mixer learns from outcomes: a history the policy keeps contradicting loses confidence."""
    probs = {}
    for outcome in ("rejected", "accepted"):
        d = DASDrafter(global_rollouts=0)
        seen = []
        for i in range(41):  # each time a new problem with the same history: only the mixer changes
            pid = (outcome, i)
            _start_on_new_problem(d, pid)
            draft = d.speculate(pid, 4)
            seen.append(float(draft.probs[0]) if draft.tokens.size else 0.0)
            # the engine verifies: all of the draft accepted (+ bonus), or its first token rejected
            if draft.tokens.size:
                d.add_tokens(pid, np.append(draft.tokens, 99) if outcome == "accepted" else [50])
            d.stop_request(pid)
        probs[outcome] = (seen[0], seen[-1])
        # (rejected: drafting stops once its probability falls below min_token_prob, soon with the outcome tables)
        assert d.outcomes_learned >= 5
    assert probs["rejected"][1] < probs["rejected"][0]
    assert probs["accepted"][1] > probs["accepted"][0]


@pytest.mark.parametrize("outcome", ["rejected", "accepted"])
def test_outcome_tables_carry_what_the_policy_did_with_a_draft_token_to_other_problems(outcome):
    """Token 8 after 7, drafted on problem after problem: each outcome counts in the token's row,
    the (7, 8) row and its support profile's row of the outcome tables, and a new problem whose history has 8 after 7
    drafts it with less confidence after rejections (more after acceptances) than the same
    mixer weights without those counts."""
    d = DASDrafter(global_rollouts=0)
    drafted = accepted = 0
    for i in range(12):
        pid = (outcome, i)
        _start_on_new_problem(d, pid)
        draft = d.speculate(pid, 1)
        if draft.tokens.size:
            assert draft.tokens.tolist() == [8]
            drafted += 1
            accepted += outcome == "accepted"
            d.add_tokens(pid, [8, 99] if outcome == "accepted" else [50])
        d.stop_request(pid)
    assert drafted >= 3 and d._mixer.model.outcomes[0, 8].tolist() == [accepted, drafted]
    for table in (1, 2):  # one pair row, (7, 8); one support profile (8 deep in the problem and request trees)
        assert d._mixer.model.outcomes[table].sum(axis=0).tolist() == [accepted, drafted]
        assert np.count_nonzero(d._mixer.model.outcomes[table, :, 1]) == 1
    pid = "new"
    _start_on_new_problem(d, pid, rollouts=1)
    one = np.array([1], np.int64)
    with_counts = d.speculate_batch([pid], one, min_prob=0.0)
    d._mixer.model.outcomes[:] = 0.0
    without = d.speculate_batch([pid], one, min_prob=0.0)
    assert with_counts.tokens[0].tolist() == without.tokens[0].tolist() == [8]
    with_counts, without = float(with_counts.probs[0, 0]), float(without.probs[0, 0])
    assert (with_counts < without) if outcome == "rejected" else (with_counts > without)


def test_a_row_without_new_tokens_keeps_its_draft_pending():
    d = DASDrafter(global_rollouts=0)
    d.add_rollout(PROMPT, [7, 8, 9, 10])
    d.start_request("r", PROMPT)
    d.add_tokens("r", [7])
    assert d.speculate("r", 3).tokens.size
    before = d.mixer_weights.copy()
    tok = np.array([PROMPT + [7, 8]], np.int32)
    n = d.num_tokens(["r"])
    d.add_tokens_batch(["r"], tok, n, n)  # nothing appended: no verification yet
    assert d.outcomes_learned == 0 and (d.mixer_weights == before).all()
    d.add_tokens_batch(["r"], tok, n, n + 1)  # token 8: the first draft token accepted
    assert d.outcomes_learned >= 1 and not (d.mixer_weights == before).all()


def test_the_global_tree_drafts_for_a_problem_never_seen():
    """A new problem has no history; the global tree holds what other problems' rollouts share."""
    common = [40, 41, 42, 43, 44, 45]
    d = DASDrafter()
    for p in range(4):
        d.add_rollout([200 + p, 1], [5 + p] + common)
    assert d.stats()["global_rollouts"] == 4 and d.stats()["global_tree_bytes"] > 0
    d.start_request("new", [300, 1])
    d.add_tokens("new", [9, 40, 41])
    assert d.speculate("new", 4).tokens.tolist()[:2] == [42, 43]
    off = DASDrafter(global_rollouts=0)
    for p in range(4):
        off.add_rollout([200 + p, 1], [5 + p] + common)
    off.start_request("new", [300, 1])
    off.add_tokens("new", [9, 40, 41])
    assert off.speculate("new", 4).tokens.size == 0 and off.stats()["global_rollouts"] == 0


def test_the_global_tree_is_global_depth_deep_and_drafts_from_contexts_that_long():
    """The global tree stores strings of at most ``global_depth`` tokens (at most ``max_depth``),
    so it tells continuations apart by up to ``global_depth - 1`` tokens of context: after
    ``51 52`` the problems' rollouts continue with 53 after ``50`` and with 55 after ``54``."""
    def drafter(depth: int) -> DASDrafter:
        d = DASDrafter(global_depth=depth, use_request_tree=False)
        for p in range(6):
            d.add_rollout([200 + p, 1], [50, 51, 52, 53] if p % 2 else [54, 51, 52, 55])
        return d

    deep, shallow = drafter(4), drafter(2)
    assert deep._global.tree.max_depth == 4 and shallow._global.tree.max_depth == 2
    assert DASDrafter(max_depth=6, global_depth=12)._global.tree.max_depth == 6
    for first, nxt in ((50, 53), (54, 55)):
        for d in (deep, shallow):
            d.start_request(("new", first), [300, 1])
            d.add_tokens(("new", first), [first, 51, 52])
        got = deep.speculate(("new", first), 1)
        assert got.tokens.tolist() == [nxt]
        low = shallow.speculate(("new", first), 1)  # one token of context (52): 53 and 55 alike
        assert low.tokens.size == 0 or low.probs[0] < got.probs[0]
    with pytest.raises(ValueError, match="global_depth must be >= 2, got 1"):
        DASDrafter(global_depth=1)


def test_global_tree_keeps_the_newest_rollouts_only():
    d = DASDrafter(global_rollouts=3)
    for i in range(5):
        d.add_rollout([1, i], [60 + i, 61 + i])
    assert d.stats()["global_rollouts"] == 3
    d.start_request("r", [1, 2])
    d.stop_request("r")  # a finished live rollout goes in too, the oldest out
    assert d.stats()["global_rollouts"] == 3
    d._check_batch_state()


@pytest.mark.parametrize("rollouts, level", [(1, 0), (4, 1), (12, 2)])
def test_the_longest_context_feeds_the_input_of_its_count_level(rollouts, level):
    """A context seen once and one seen a dozen times give nearly the same stretched probability;
    the scope's longest-locus input goes to the copy of its count level (total weighted count
    below 2, 2 to 8, 8 and more), so the mixer weighs the two apart."""
    d = DASDrafter(global_rollouts=0)
    _start_on_new_problem(d, "p", rollouts=rollouts)
    assert d.speculate("p", 4).tokens.tolist()[:1] == [8]
    x = d._mixer.pending.inputs[d._requests.handles["p"], 0]  # the first draft token's inputs, pending until verified
    slots = [mixing.LONGEST + lv * mixing.NT for lv in range(mixing.COUNT_LEVELS)]  # scope 0: the problem tree
    assert [x[g] != 0.0 for g in slots] == [lv == level for lv in range(mixing.COUNT_LEVELS)]


def test_every_draft_position_reads_one_locus_per_match_length_bucket():
    """After each draft token the loci that follow it are thinned to the longest of each
    match-length bucket again, as at the draft's first token: a bucket's input is one context's
    stretched probability, never the mean of two (here at the fourth draft token, "3 4 5 6"
    and "4 5 6" would share the 3-4 bucket, and say 7 with 0.91 and with 0.41)."""
    d = DASDrafter(global_rollouts=0, use_request_tree=False)
    for _ in range(3):
        d.add_rollout(PROMPT, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    for t in range(40, 44):
        d.add_rollout(PROMPT, [t, 4, 5, 6, 77])
    d.start_request("r", PROMPT)
    d.add_tokens("r", [1, 2, 3])
    assert d.speculate("r", 6).tokens.tolist()[:4] == [4, 5, 6, 7]

    def stretch(count, total):
        return mixing._STRETCH[min(int(count / (total + d.prior) * mixing._LEVELS), mixing._LEVELS - 1)]

    one_locus = [0.0, stretch(3, 3), stretch(3, 7)]  # no locus; a context only the 7s follow; "6", "5 6", "4 5 6"
    x = d._mixer.pending.inputs[d._requests.handles["r"], 3, 1 : 1 + mixing.NB]  # the fourth draft token's problem-tree inputs
    assert all(np.isclose(one_locus, v).any() for v in x), x
    assert np.isclose(x, stretch(3, 7)).sum() == 3  # buckets 1, 2 and 3-4: "6", "5 6", "4 5 6"


def test_initial_weights_average_the_scopes_and_the_schema_names_the_chooser():
    w = mixing.initial_weights().reshape(mixing.NSETS, mixing.NIN)
    assert (w[:, 0] == 0).all() and (w[:, 1 : 1 + mixing.NCTX] == 0.3).all()
    assert (w[:, 1 + mixing.NCTX :] == 0).all()
    assert mixing.LONGEST == 1 + mixing.NCTX and mixing.NIN == 5 + mixing.NCTX + mixing.COUNT_LEVELS * mixing.NT
    with pytest.raises(ValueError, match="chooser must be one of mix, walk, got 'best'"):
        DASDrafter(chooser="best")
    with pytest.raises(ValueError, match="mix_lr must be a finite number > 0, got 0"):
        DASDrafter(mix_lr=0)
    with pytest.raises(ValueError, match="global_rollouts must be >= 0, got -1"):
        DASDrafter(global_rollouts=-1)


@pytest.mark.parametrize("chooser", ["mix", "walk"])
def test_a_calls_min_prob_moves_where_drafts_stop(chooser):
    """``speculate_batch(..., min_prob=p)`` stops drafts before their path probability falls
    below ``p`` instead of ``min_token_prob``: a lower cutoff drafts at least as far
    along the same path, a higher one stops earlier; out of [0, 1] is refused by name."""
    d = DASDrafter(chooser=chooser, global_rollouts=0)
    for i in range(6):  # a history that branches at every other token: path probabilities fall along the draft
        d.add_rollout(PROMPT, [7, 8 + i % 2, 9, 10 + i % 3, 11, 12 + i % 2, 13, 14 + i % 3, 15])
    d.start_request("r", PROMPT)
    d.add_tokens("r", [7])
    got = {p: d.speculate_batch(["r"], [16], min_prob=p) for p in (0.02, 0.1, 0.5)}
    n = {p: int(g.lengths[0]) for p, g in got.items()}
    assert n[0.02] > n[0.5] and n[0.02] >= n[0.1] >= n[0.5]
    for p, g in got.items():
        assert np.all(g.probs[0, : n[p]] >= p)
        np.testing.assert_array_equal(g.tokens[0, : n[0.5]], got[0.5].tokens[0, : n[0.5]])
    with pytest.raises(ValueError, match=r"min_prob must be a number in \[0, 1\], got 1.5"):
        d.speculate_batch(["r"], [4], min_prob=1.5)


def test_live_rollouts_of_other_problems_draft_through_the_global_tree():
    """A live request's tokens are in the global tree as they are verified (as arctic-inference's
    global cache), so a request of another problem drafts from them before either finishes; a
    finished request's sequence stays there as a finished rollout (not stored twice)."""
    for per_row in (True, False):
        d = DASDrafter()
        d.start_request("a", [101, 102], problem_id="p1")
        d.start_request("b", [201, 202], problem_id="p2")
        out = [7, 8, 9, 10, 11, 12] * 3
        if per_row:
            d.add_tokens("a", out)
            d.add_tokens("b", [7, 8])
        else:
            mat = np.array([[101, 102, *out], [201, 202, 7, 8] + [0] * (len(out) - 2)], np.int32)
            d.add_tokens_batch(["a", "b"], mat, None, np.array([2 + len(out), 4]))
        assert d.speculate("b", 4).tokens.tolist()[:3] == [9, 10, 11]
        assert d._global.tree.num_sequences == 2 and d.stats()["global_rollouts"] == 0
        d.stop_request("a")
        assert d._global.tree.num_sequences == 2 and d.stats()["global_rollouts"] == 1
        d._check_batch_state()
    alone = DASDrafter(global_rollouts=0)  # without a global tree: nothing of p1 reaches b
    alone.start_request("a", [101, 102], problem_id="p1")
    alone.start_request("b", [201, 202], problem_id="p2")
    alone.add_tokens("a", out)
    alone.add_tokens("b", [7, 8])
    assert alone.speculate("b", 4).tokens.tolist() == []


def test_a_global_tree_that_runs_short_mid_batch_grows_and_takes_the_rest():
    """The batch path appends to the global tree after the problem and request trees; a row the
    global tree has no room for is finished in Python, and the later rows still go in."""
    d = DASDrafter()
    rows = [f"r{i}" for i in range(3)]
    for i, rid in enumerate(rows):
        d.start_request(rid, [100 + i, 99], problem_id=i)
    rng = np.random.default_rng(0)
    mat = np.zeros((3, 2 + 3000), np.int32)
    for i in range(3):
        mat[i, :2] = [100 + i, 99]
        mat[i, 2:] = rng.integers(0, 50, 3000)
    before = d._global.tree.buffer.shape[0]
    d.add_tokens_batch(rows, mat, None, np.full(3, 3002))
    assert d._global.tree.buffer.shape[0] > before
    for i, rid in enumerate(rows):
        assert d._global.tree.sequence(d._requests.requests[rid].global_seq).tolist()[-3000:] == mat[i, 2:].tolist()
    d._check_batch_state()


@pytest.mark.parametrize("balanced_parts", [2, 1 << 30], ids=["balanced", "by_id"])
def test_parallel_batches_match_one_thread(monkeypatch, balanced_parts):
    """``draft_threads=2`` appends and drafts a step's rows on two threads (numba ``prange``):
    the same trees, draft tokens, path probabilities and learning state as one thread, step after
    step, also when a tree runs short of capacity mid-batch (that part finishes on one thread; the
    global tree, appended with the learning beside the other trees' parts, likewise) and
    when a request has two rows (appended in order; drafted on one thread, as its rows would
    write one pending draft). With the trees dealt to the threads by load
    (:func:`das.step_threads.balance_parts`) and by id."""
    import numba

    from das import step_threads

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has one thread here")
    monkeypatch.setattr(step_threads, "PARALLEL_ROWS", 8)
    monkeypatch.setattr(step_threads, "BALANCED_PARTS", balanced_parts)
    rng = np.random.default_rng(3)
    kw = dict(window=4, max_depth=8, min_token_prob=0.05, global_rollouts=16)
    one, two = DASDrafter(draft_threads=1, **kw), DASDrafter(draft_threads=2, **kw)
    assert (one.draft_threads, two.draft_threads) == (1, 2)
    finished = []  # rows the parallel append (two's) stopped at (a tree ran short), finished in Python
    grow = step_threads.finish_row

    def finish_row(req, seg, part, done):
        if any(req is r for r in two._requests.requests.values()):
            finished.append(part)
        grow(req, seg, part, done)

    monkeypatch.setattr(step_threads, "finish_row", finish_row)
    global_rest = []  # rows after one where the global tree ran short, appended in Python
    rest = two._global.append_rows
    monkeypatch.setattr(two._global, "append_rows", lambda *a: (global_rest.append(a[-1]), rest(*a)))
    patterns = [rng.integers(0, 12, 30) for _ in range(4)]
    for v in range(3):  # history: each problem's rollouts repeat its pattern with noise
        for d in (one, two):
            d.begin_iteration(v)
        for p, pat in enumerate(patterns):
            for _ in range(4):
                out = np.where(rng.random(pat.shape[0]) < 0.2, rng.integers(0, 12, pat.shape[0]), pat)
                for d in (one, two):
                    d.add_rollout([p, 99], out, problem_id=p)
    rows = [f"r{i}" for i in range(24)]
    toks = {rid: [i % 4, 99] for i, rid in enumerate(rows)}
    for rid in rows:
        for d in (one, two):
            d.start_request(rid, toks[rid], problem_id=int(rid[1:]) % 4)
    for step in range(12):
        mat = np.zeros((len(rows), 256), np.int32)
        ends = np.zeros(len(rows), np.int64)
        for r, rid in enumerate(rows):
            pat = patterns[r % 4]
            n = len(toks[rid]) - 2
            many = step == 2 and r % 3 == 0  # a long segment: request and problem trees run short
            toks[rid] += [int(pat[(n + j) % pat.shape[0]]) for j in range(60 if many else int(rng.integers(1, 4)))]
            mat[r, : len(toks[rid])] = toks[rid]
            ends[r] = len(toks[rid])
        budgets = rng.integers(0, 9, len(rows))
        got = []
        for d in (one, two):
            d.add_tokens_batch(rows, mat, None, ends)
            got.append(d.speculate_batch(rows, budgets))
        assert got[0].lengths.tolist() == got[1].lengths.tolist()
        assert got[0].tokens.tolist() == got[1].tokens.tolist()
        assert got[0].probs.tolist() == got[1].probs.tolist()
    assert int(got[1].lengths.sum()) > 0 and finished and global_rest
    assert one.parallel_calls == 0 and two.parallel_calls == 24
    assert one.outcomes_learned == two.outcomes_learned > 0
    assert one.mixer_weights.tolist() == two.mixer_weights.tolist()
    twice = rows[:8] + rows[:1]  # r0 on two rows: appended in order, drafted on one thread
    mat = np.zeros((9, 256), np.int32)
    for r, rid in enumerate(twice):
        toks[rid] += [5] if r < 8 else [6, 7]
        mat[r, : len(toks[rid])] = toks[rid]
    starts = np.array([len(toks[rid]) - 1 for rid in rows[:8]] + [len(toks["r0"]) - 2])
    starts[0] -= 2  # r0's first row appends the 5 only; its second row the 6, 7
    ends = np.array([len(toks[rid]) for rid in rows[:8]] + [len(toks["r0"])])
    ends[0] -= 2
    mat[0, : len(toks["r0"]) - 2] = toks["r0"][:-2]
    for d in (one, two):
        d.add_tokens_batch(twice, mat, starts, ends)
    assert one.num_tokens(rows).tolist() == two.num_tokens(rows).tolist()
    a = one.speculate_batch(twice, np.full(9, 4))
    b = two.speculate_batch(twice, np.full(9, 4))
    assert two.parallel_calls == 25 and a.tokens.tolist() == b.tokens.tolist()
    assert {k: v for k, v in one.stats().items() if k != "parallel_calls"} == \
        {k: v for k, v in two.stats().items() if k != "parallel_calls"}
    with pytest.raises(ValueError, match="draft_threads must be >= 0, got -1"):
        DASDrafter(draft_threads=-1)


def test_outcome_counts_of_older_policies_weigh_less():
    """A new policy version down-weighs the outcome tables as the trees' rollouts are (``decay``
    per version), so what an older policy did with a draft token fades as the policy trains."""
    d = DASDrafter(global_rollouts=0, decay=0.5)
    d.begin_iteration(1)
    _start_on_new_problem(d, "p")
    d.speculate("p", 1)
    d.add_tokens("p", [50])  # its draft token 8 rejected
    assert d._mixer.model.outcomes[0, 8].tolist() == [0.0, 1.0]
    d.begin_iteration(3)
    assert d._mixer.model.outcomes[0, 8].tolist() == [0.0, 0.25]
    # every table fades (table 3: the outcome counts once in each of its two calibration maps)
    assert d._mixer.model.outcomes.sum(axis=1)[:, 1].tolist() == [0.25, 0.25, 0.25, 0.5]
    d.begin_iteration(3)  # the same version: no change
    assert d._mixer.model.outcomes[0, 8].tolist() == [0.0, 0.25]
    flat = DASDrafter(global_rollouts=0, decay=1.0)
    _start_on_new_problem(flat, "p")
    flat.speculate("p", 1)
    flat.add_tokens("p", [50])
    flat.begin_iteration(5)
    assert flat._mixer.model.outcomes[0, 8].tolist() == [0.0, 1.0]


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + np.exp(-z))


def test_the_calibration_map_follows_the_acceptance_counted_at_each_logit():
    """Outcome table 3 (PAQ's APM): without counts a knot's value is the mixer's own probability
    there; rejections counted at one knot of one map pull the drafted probability at that logit
    down, and leave the other knots alone."""
    out = np.zeros((4, mixing.OUTCOME_SLOTS, 2))
    for z in (-2.0, 0.0, 1.5):
        assert mixing.calibrated(out, 0, 5, z) == pytest.approx(_sigmoid(z))
    row, w = mixing.apm_knot(0, 1.5)  # weight set 0's map, the knot at logit 1.5
    assert w == 0.0
    out[3, row, 1] = 100.0  # drafted 100 times there, never accepted
    assert mixing.calibrated(out, 0, 5, 1.5) < _sigmoid(1.5) - 0.25
    assert mixing.calibrated(out, 0, 5, 1.75) < _sigmoid(1.75) - 0.1  # halfway to the next knot: half the pull
    assert mixing.calibrated(out, 0, 5, -3.0) == pytest.approx(_sigmoid(-3.0))
    assert mixing.calibrated(out, mixing.NIN, 5, 1.5) == pytest.approx(_sigmoid(1.5))  # weight set 1: its own map


def _draft_of(d: DASDrafter, pid, length: int):
    """A draft of exactly ``length`` tokens that stopped by its probability (min_prob raised until it does)."""
    for min_prob in np.linspace(0.999, 0.01, 200):
        draft = d.speculate_batch([pid], np.array([8], np.int64), min_prob=float(min_prob))
        if int(draft.lengths[0]) == length:
            return draft
    raise AssertionError(f"no min_prob drafts exactly {length} tokens")


@pytest.mark.parametrize("bonus", [9, 50])
def test_the_token_a_draft_stopped_before_learns_from_the_bonus_token(bonus):
    """When every draft token is accepted, the bonus token is the policy's own sample where the draft
    stopped, so it is an outcome of the token the draft stopped before: accepted iff they are equal
    (the chance of either is the policy's probability of that token)."""
    d = DASDrafter(global_rollouts=0)
    _start_on_new_problem(d, "p")  # history 7 8 9 10 11 12, at 7
    assert _draft_of(d, "p", 1).tokens[0, :1].tolist() == [8]  # stopped before 9
    d.add_tokens("p", [8, bonus])  # 8 accepted, then the bonus token
    assert d.outcomes_learned == 2
    assert d._mixer.model.outcomes[0, 9].tolist() == ([1.0, 1.0] if bonus == 9 else [0.0, 1.0])


def test_the_token_after_a_rejection_teaches_nothing_about_the_stop_token():
    """After a rejected draft token the next token is the engine's recovered token (sampled from what
    is left of the policy's distribution), not a sample of the policy: no outcome for the stop token."""
    d = DASDrafter(global_rollouts=0)
    _start_on_new_problem(d, "p")
    _draft_of(d, "p", 1)
    d.add_tokens("p", [50])  # 8 rejected; 50 recovered
    assert d.outcomes_learned == 1 and d._mixer.model.outcomes[0, 9].tolist() == [0.0, 0.0]
    empty = DASDrafter(global_rollouts=0)  # a draft that stopped before its first token: the next token is a plain sample
    _start_on_new_problem(empty, "p")
    _draft_of(empty, "p", 0)
    empty.add_tokens("p", [8])
    assert empty.outcomes_learned == 1 and empty._mixer.model.outcomes[0, 8].tolist() == [1.0, 1.0]


def _true_rollouts(rng, problems: int, per_problem: int, length: int) -> dict:
    """Rollouts that repeat their problem's text with small changes, as a GRPO group's do."""
    out = {}
    for p in range(problems):
        base = rng.integers(200, 260, length)
        for i in range(per_problem):
            seq = base.copy()
            flips = rng.uniform(size=length) < 0.15
            seq[flips] = rng.integers(200, 260, int(flips.sum()))
            out[(p, i)] = seq
    return out


@pytest.mark.parametrize("defer_global", [False, True])
def test_a_draft_stopped_at_the_steps_cut_learns_what_a_draft_cut_by_the_engine_learns(defer_global):
    """The proposer may stop a step's drafts at the probability below which its selection keeps
    nothing (``speculate_batch(..., min_prob=cut)``) instead of drafting further and letting the
    engine cut them there. Over many steps, with the engine keeping at most the tokens at or
    above the cut, both drafters draft the same kept tokens and learn the same mixer weights and
    outcome tables, bit for bit: the token after a cut is learned from either way."""
    rng = np.random.default_rng(7)
    truth = _true_rollouts(rng, problems=3, per_problem=4, length=60)
    deep, cut_short = DASDrafter(defer_global=defer_global), DASDrafter(defer_global=defer_global)
    for p in range(3):  # one earlier iteration of each problem
        for i in range(4):
            for d in (deep, cut_short):
                d.add_rollout(PROMPT, truth[(p, (i + 1) % 4)][: 40 + 5 * i].tolist(), problem_id=p)
    ids = list(truth)
    for d in (deep, cut_short):
        for rid in ids:
            d.start_request(rid, PROMPT, problem_id=rid[0])
            d.add_tokens(rid, truth[rid][:1].tolist())
    pos = dict.fromkeys(ids, 1)
    kept_tokens = cut_tokens = 0
    for _step in range(45):
        live = [r for r in ids if pos[r] < 59]
        cut = float(rng.choice([0.1, 0.2, 0.35, 0.6]))
        budgets = np.full(len(live), 16)
        full = deep.speculate_batch(live, budgets)
        short = cut_short.speculate_batch(live, budgets, min_prob=cut)
        matrix = np.zeros((len(live), 80), np.int32)
        starts, ends = np.zeros(len(live), np.int64), np.zeros(len(live), np.int64)
        for r, rid in enumerate(live):
            n_full, n_short = int(full.lengths[r]), int(short.lengths[r])
            keep = int(np.sum(full.probs[r, :n_full] >= cut))
            keep = min(keep, int(rng.integers(0, keep + 1)) if rng.uniform() < 0.3 else keep)  # the engine may keep fewer
            assert n_short >= keep and n_short <= n_full
            np.testing.assert_array_equal(short.tokens[r, :n_short], full.tokens[r, :n_short])
            np.testing.assert_array_equal(short.probs[r, :n_short], full.probs[r, :n_short])
            kept_tokens += keep
            cut_tokens += n_full - n_short
            seq, at = truth[rid], pos[rid]
            accepted = 0
            while accepted < keep and at + accepted < 59 and full.tokens[r, accepted] == seq[at + accepted]:
                accepted += 1
            new = accepted + 1  # the accepted prefix and the bonus (or recovered) token
            matrix[r, :new] = seq[at : at + new]
            ends[r] = new
            pos[rid] += new
        for d in (deep, cut_short):
            d.add_tokens_batch(live, matrix, starts, ends)
        np.testing.assert_array_equal(deep.mixer_weights, cut_short.mixer_weights)
        np.testing.assert_array_equal(deep._mixer.model.outcomes, cut_short._mixer.model.outcomes)
    assert kept_tokens > 200 and cut_tokens > 200  # the engine kept drafts, and the cut saved drafting
    for d in (deep, cut_short):
        d.close()


@pytest.mark.parametrize("chooser", ["mix", "walk"])
def test_a_min_prob_per_row_stops_each_row_at_its_own_cutoff(chooser):
    """``speculate_batch(..., min_prob=array)`` gives each row its own cutoff: every row drafts
    what a call with that row's cutoff for all rows drafts; a wrong shape or a value out of
    [0, 1] is refused, naming the row."""
    def fresh():
        d = DASDrafter(chooser=chooser, global_rollouts=0)
        for i in range(6):
            d.add_rollout(PROMPT, [7, 8 + i % 2, 9, 10 + i % 3, 11, 12 + i % 2, 13, 14 + i % 3, 15])
        for r in ("a", "b", "c"):
            d.start_request(r, PROMPT)
            d.add_tokens(r, [7])
        return d

    cuts = np.array([0.02, 0.5, 0.1])
    got = fresh().speculate_batch(["a", "b", "c"], [16, 16, 16], min_prob=cuts)
    for r, cut in enumerate(cuts):
        want = fresh().speculate_batch(["a", "b", "c"], [16, 16, 16], min_prob=float(cut))
        n = int(want.lengths[r])
        assert int(got.lengths[r]) == n
        np.testing.assert_array_equal(got.tokens[r, :n], want.tokens[r, :n])
    assert got.lengths[0] > got.lengths[1]
    d = fresh()
    with pytest.raises(ValueError, match=r"min_prob must be a number or have shape \(3,\)"):
        d.speculate_batch(["a", "b", "c"], [4, 4, 4], min_prob=np.array([0.1, 0.2]))
    with pytest.raises(ValueError, match=r"min_prob\[1\] must be a number in \[0, 1\], got 1.5"):
        d.speculate_batch(["a", "b", "c"], [4, 4, 4], min_prob=np.array([0.1, 1.5, 0.2]))
