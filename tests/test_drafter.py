"""DASDrafter: windows, version weighting, live siblings, request trees, argument checks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from das import DASDrafter as _DASDrafter
from das import problem_id
from das.suffix_tree import VOCAB_LIMIT

# These tests pin the "walk" chooser (the paper's rule: the best single anchor's greedy walk, from
# the problem and request trees) and its former default min_token_prob, so that exact drafts can
# be asserted; the "mix" chooser (the default) is tested in tests/test_mix_chooser.py and by the
# batch-vs-row tests below, which run both.
WALK = dict(chooser="walk", min_token_prob=0.2)


def DASDrafter(**kw):  # noqa: N802 (stands in for the class)
    return _DASDrafter(**{**WALK, **kw})


PROMPT = [101, 102, 103]
# SuffixDecoding's drafting rules (spec factor 1, min prob 0.1, no prior): exact draft lengths below
PLAIN = dict(max_spec_factor=1.0, min_token_prob=0.1, prior=0.0)
BY_VERSIONS = dict(keep_visits=0, age_in_visits=False)  # the paper's rule: a window of policy versions, age in versions


def test_problem_id_is_stable_and_dtype_independent():
    a = problem_id([1, 2, 3])
    assert a == problem_id(np.array([1, 2, 3], np.int32)) == problem_id(np.array([1, 2, 3], np.int64))
    assert a != problem_id([1, 2, 4]) and isinstance(a, str) and len(a) == 32
    assert problem_id([]) == problem_id(np.array([], np.int32))


def test_window_expiry_removes_exactly_the_old_versions():
    d = DASDrafter(window=3, decay=0.9, **BY_VERSIONS)
    pid = problem_id(PROMPT)
    for v in range(5):
        d.begin_iteration(v)
        d.add_rollout(PROMPT, [v, 50 + v, 60 + v])
    tree = d.problem_tree(pid)
    # versions 2, 3, 4 remain (window 3)
    assert tree.num_sequences == 3
    for v in range(5):
        assert tree.count([v, 50 + v]) == (0.0 if v < 2 else pytest.approx(0.9 ** -(v - 0)))
    d.begin_iteration(6)  # keeps versions 4..6
    assert tree.num_sequences == 1 and tree.count([4, 54]) > 0 and tree.count([3, 53]) == 0
    d.begin_iteration(7)  # keeps 5..7: nothing left, the problem is dropped
    assert pid not in d and d.stats()["problems"] == 0
    # old rollouts are ignored, current ones stored
    assert d.add_rollout(PROMPT, [1, 2], policy_version=4) is False
    assert d.add_rollout(PROMPT, [1, 2], policy_version=5) is True


def _continuation_after(d, prefix, k=1):
    d.start_request("probe", PROMPT)
    d.add_tokens("probe", prefix)
    out = d.speculate("probe", k).tokens.tolist()
    d.stop_request("probe")
    return out


def _visits(d, versions, out=(4, 5, 7), n=2):
    """``n`` rollouts of PROMPT at each of ``versions`` (a problem coming back once per epoch)."""
    for v in versions:
        d.begin_iteration(v)
        for _ in range(n):
            d.add_rollout(PROMPT, [*out, v])


def test_a_problem_back_after_a_long_gap_drafts_from_its_last_visits():
    pid = problem_id(PROMPT)
    d = DASDrafter(window=16, keep_visits=2, use_request_tree=False)
    _visits(d, [1, 301, 601])
    d.begin_iteration(901)  # every kept version is 300+ versions out of the window
    tree = d.problem_tree(pid)
    assert tree is not None and tree.num_sequences == 4  # the last 2 visits' rollouts
    assert tree.count([4, 5, 7, 1]) == 0 and tree.count([4, 5, 7, 301]) > 0 and tree.count([4, 5, 7, 601]) > 0
    assert _continuation_after(d, [4, 5]) == [7]
    # window only (the paper's rule): the history is gone when the problem comes back
    d0 = DASDrafter(window=16, keep_visits=0, use_request_tree=False)
    _visits(d0, [1, 301, 601])
    d0.begin_iteration(901)
    assert pid not in d0 and _continuation_after(d0, [4, 5]) == []
    # within the window keep_visits changes nothing: versions 1..3 all stay with window 16
    d1 = DASDrafter(window=16, keep_visits=1, use_request_tree=False)
    _visits(d1, [1, 2, 3])
    assert d1.problem_tree(pid).num_sequences == 6


def test_kept_rollouts_are_aged_by_visits_not_by_the_version_gap():
    """A problem back after 300 versions drafts as if it had been away one version (age in visits);
    aged by versions its kept rollouts weigh 0.9**300 against the prior and never draft."""
    near = DASDrafter(use_request_tree=False)  # the problem comes back the next version
    _visits(near, [1])
    near.begin_iteration(2)
    far = DASDrafter(keep_visits=1, age_in_visits=True, use_request_tree=False)
    _visits(far, [1])
    far.begin_iteration(301)
    dn, df = near.speculate, far.speculate
    for d in (near, far):
        d.start_request("probe", PROMPT)
        d.add_tokens("probe", [4, 5])
    a, b = dn("probe", 1), df("probe", 1)
    assert a.tokens.tolist() == b.tokens.tolist() == [7] and b.probs[0] == pytest.approx(a.probs[0], rel=1e-6)
    assert b.probs[0] == pytest.approx(0.9 * 2 / (0.9 * 2 + 0.3), rel=1e-6)  # 2 rollouts one visit old vs the prior
    by_versions = DASDrafter(keep_visits=1, age_in_visits=False, use_request_tree=False)
    _visits(by_versions, [1])
    by_versions.begin_iteration(301)
    assert problem_id(PROMPT) in by_versions  # kept ...
    assert _continuation_after(by_versions, [4, 5]) == []  # ... but weighed ~0


@pytest.mark.parametrize("section, needle", [({"keep_visits": -1}, "keep_visits"), ({"keep_visits": "2"}, "keep_visits"),
                                             ({"age_in_visits": 1}, "age_in_visits")])
def test_bad_visit_settings_are_refused_by_name(section, needle):
    from das.config import das_config

    with pytest.raises(ValueError, match=f"additional_config\\['das'\\]\\['{needle}'\\] must be"):
        das_config(section)


@pytest.mark.parametrize("decay, expect", [(1.0, 7), (0.5, 8)])
def test_down_weighting_changes_the_winner(decay, expect):
    # version 0: three rollouts continue 5 -> 7; version 2: one rollout continues 5 -> 8.
    d = DASDrafter(window=4, decay=decay, use_request_tree=False, **BY_VERSIONS)
    d.begin_iteration(0)
    for _ in range(3):
        d.add_rollout(PROMPT, [4, 5, 7])
    d.begin_iteration(2)
    d.add_rollout(PROMPT, [4, 5, 8])
    # decay 1: 3 vs 1, old wins. decay 0.5: new weighs 0.5**-2 = 4 > 3, new wins.
    d.begin_iteration(3)  # a probe of version 3 must not change the ratio (it is empty there)
    assert _continuation_after(d, [4, 5]) == [expect]


def test_rescaling_keeps_weights_bounded_and_ratios():
    d = DASDrafter(window=400, decay=0.5, use_request_tree=False)
    pid = problem_id(PROMPT)
    for v in range(0, 300, 3):
        d.begin_iteration(v)
        d.add_rollout(PROMPT, [4, 5, 7 if v < 150 else 8])
    tree = d.problem_tree(pid)
    assert tree.count([]) < 2.0**42 and tree.count([]) > 0
    assert d._problems.get(pid).base > 0  # rescaled (more than once: 2**300 would not fit a float)
    # the newest rollout weighs 2**3 times the one a step (3 versions) older
    expect = sum(8.0**-i for i in range(50)) / sum(8.0**-i for i in range(100))
    assert tree.count([4, 5, 8]) / tree.count([4, 5]) == pytest.approx(expect)
    d.begin_iteration(300)
    assert _continuation_after(d, [4, 5]) == [8]


def test_siblings_see_each_other_live():
    d = DASDrafter(**PLAIN)
    d.start_request("a", PROMPT)
    d.start_request("b", PROMPT)
    answer = list(range(10, 30))
    d.add_tokens("a", answer)
    d.add_tokens("b", answer[:6])
    dr = d.speculate("b", 8)
    # problem-tree sequences start with the prompt's tail: prompt + 6 tokens match, 8 drafted
    assert dr.tokens.tolist() == answer[6:14]
    assert dr.match_len == 9
    assert d.speculate("b", 4).tokens.tolist() == answer[6:10]
    # b's request tree alone cannot know a's tokens
    d2 = DASDrafter(use_request_tree=True, **PLAIN)
    d2.start_request("b", PROMPT)
    d2.add_tokens("b", answer[:6])
    assert d2.speculate("b", 8).tokens.size == 0
    # siblings are separate sequences: no false n-gram across a's end and b's start
    tree = d.problem_tree(problem_id(PROMPT))
    assert tree.num_sequences == 2
    assert tree.count([answer[-1], PROMPT[0]]) == 0.0
    # a fresh sibling drafts its first tokens from how the others began (prompt tail + output)
    d.start_request("c", PROMPT)
    assert d.speculate("c", 8).tokens.tolist() == answer[:3]  # 3-token match (the prompt)
    d3 = DASDrafter()
    d3.start_request("c", PROMPT)
    assert d3.speculate("c", 3).tokens.size == 0  # no history, nothing in the prompt repeats
    d.add_tokens("c", answer[:1])
    assert d.speculate("c", 8).tokens.tolist() == answer[1:5]


def test_request_tree_wins_when_it_scores_higher():
    out = [5, 6, 7, 8, 5, 6]
    for use_rt in (True, False):
        d = DASDrafter(use_request_tree=use_rt, **PLAIN)
        for t in (1, 2, 3, 4):  # in the problem's history "5 6" is followed by many tokens
            d.add_rollout(PROMPT, [9, 5, 6, t])
        d.start_request("r", PROMPT)
        d.add_tokens("r", out)
        dr = d.speculate("r", 4)
        if use_rt:
            # "5 6" was followed by "7 8" once; its other occurrence is the context's own end,
            # which does not count against what follows
            assert dr.tokens.tolist() == [7, 8] and dr.score == pytest.approx(2.0)
        else:
            # five continuations of "5 6" (1, 2, 3, 4 and the request's own 7), one each
            assert dr.tokens.tolist() == [1] and dr.score == pytest.approx(1 / 5)


def test_ties_go_to_the_problem_tree():
    from das import trie_kernels as kernels
    from das.suffix_tree import SuffixTree

    d = DASDrafter(**PLAIN)
    d.start_request("r", PROMPT)
    d.add_tokens("r", [5, 6, 7, 5, 6])
    # both trees hold exactly prompt-tail + output: the same draft and score
    assert d.speculate("r", 4).tokens.tolist() == [7, 5]
    # equal scores, different drafts: the first tree (the problem tree's place) wins
    a, b = SuffixTree(8), SuffixTree(8)
    a.add([7, 1, 2, 3])
    b.add([7, 1, 2, 4])
    sa, sb = a.slot(a.add([7, 1, 2])), b.slot(b.add([7, 1, 2]))
    out_t, out_p = np.empty(16, np.int32), np.empty(16, np.float32)
    for (x, sx, tx), (y, sy, _ty) in (((a, sa, 3), (b, sb, 4)), ((b, sb, 4), (a, sa, 3))):
        off, k, score, mlen = kernels.draft_two_trees(x.buffer, sx, 0.0, y.buffer, sy, 0.0, 4, 0.1, 1.0, out_t, out_p)
        assert out_t[off : off + k].tolist() == [tx] and score == 1.0 and mlen == 3


def test_request_sequences_name_what_a_request_drafts_from():
    d = DASDrafter(**PLAIN)
    d.start_request("r", PROMPT)
    d.add_tokens("r", [5, 6, 7])
    (pt, ps), (rt, rs) = d.request_sequences("r")
    assert pt is d.problem_tree(problem_id(PROMPT))
    assert pt.sequence(ps).tolist() == PROMPT + [5, 6, 7] and rt.sequence(rs).tolist() == PROMPT + [5, 6, 7]
    d.evict_problem(problem_id(PROMPT))
    assert [tree for tree, _ in d.request_sequences("r")] == [rt]
    with pytest.raises(KeyError):
        d.request_sequences("never")


def test_stop_request_keeps_the_rollout_and_is_idempotent():
    d = DASDrafter(window=2)
    d.begin_iteration(0)
    d.start_request("r", PROMPT)
    d.add_tokens("r", [1, 2, 3])
    s = d.stats()
    assert s["requests"] == 1 and s["request_tree_bytes"] > 0
    d.stop_request("r")
    d.stop_request("r")
    d.stop_request("never")
    s = d.stats()
    assert s["requests"] == 0 and s["sequences"] == 1 and s["tokens"] == len(PROMPT) + 3
    with pytest.raises(KeyError):
        d.add_tokens("r", [4])
    with pytest.raises(KeyError):
        d.speculate("r", 4)


def test_live_request_outliving_its_window():
    d = DASDrafter(window=1, **BY_VERSIONS)
    d.begin_iteration(0)
    d.start_request("r", PROMPT)
    d.add_tokens("r", [1, 2])
    d.begin_iteration(5)  # r's rollout is out of the window but r is still running
    d.add_tokens("r", [3, 4])
    pid = problem_id(PROMPT)
    assert d.problem_tree(pid).count([3, 4]) > 0
    d.stop_request("r")  # now it goes
    assert pid not in d and d.stats()["sequences"] == 0


def test_lru_eviction_and_evict_problem():
    d = DASDrafter(max_problems=2)
    for p in ([1], [2], [3]):
        d.add_rollout(p, [7, 8])
    assert problem_id([1]) not in d and problem_id([2]) in d and problem_id([3]) in d
    d.start_request("r", [2], problem_id="custom")
    d.add_tokens("r", [7, 8, 9])
    assert "custom" in d and d.stats()["problems"] == 2
    assert d.evict_problem("custom") is True and d.evict_problem("custom") is False
    d.add_tokens("r", [7, 8])  # still drafts from its request tree
    assert d.speculate("r", 2).tokens.tolist() == [9, 7]
    d.stop_request("r")


def test_speculate_budget_and_stats():
    d = DASDrafter()
    d.add_rollout(PROMPT, list(range(40, 80)))
    d.start_request("r", PROMPT)
    d.add_tokens("r", np.arange(40, 50, dtype=np.int32))
    assert d.speculate("r", 0).tokens.size == 0
    dr = d.speculate("r", 3)
    assert dr.tokens.tolist() == [50, 51, 52] and dr.probs.dtype == np.float32
    s = d.stats()
    assert s["problems"] == 1 and s["sequences"] == 2 and s["tokens"] == 2 * len(PROMPT) + 40 + 10
    assert s["nodes"] > 0 and s["bytes"] > 0


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"window": 0}, "window"),
        ({"window": 2.5}, "window"),
        ({"decay": 0.0}, "decay"),
        ({"decay": 1.5}, "decay"),
        ({"decay": float("nan")}, "decay"),
        ({"max_depth": 1}, "max_depth"),
        ({"max_spec_factor": 0}, "max_spec_factor"),
        ({"max_spec_factor": float("inf")}, "max_spec_factor"),
        ({"min_token_prob": -0.1}, "min_token_prob"),
        ({"min_token_prob": 2}, "min_token_prob"),
        ({"max_problems": 0}, "max_problems"),
        ({"use_request_tree": "yes"}, "use_request_tree"),
        ({"window": True}, "window"),
        ({"keep_visits": -1}, "keep_visits"),
        ({"keep_visits": 1.5}, "keep_visits"),
        ({"age_in_visits": "yes"}, "age_in_visits"),
    ],
)
def test_bad_constructor_arguments(kwargs, needle):
    with pytest.raises(ValueError) as e:
        DASDrafter(**kwargs)
    msg = str(e.value)
    assert needle in msg and repr(next(iter(kwargs.values()))) in msg


def test_settings_from_a_config_or_mapping_with_keyword_overrides():
    from das.config import DASConfig

    d = _DASDrafter(DASConfig(window=3, decay=0.5, chooser="walk"), decay=0.8)
    assert (d.window, d.decay, d.chooser, d.max_depth) == (3, 0.8, "walk", DASConfig().max_depth)
    m = _DASDrafter({"window": 5}, prior=0.0)
    assert (m.window, m.prior, m.chooser) == (5, 0.0, DASConfig().chooser)
    for bad, needle in (({"windows": 3}, "windows"), ({"budget": "cost"}, "budget"), ([("window", 3)], "list")):
        with pytest.raises(ValueError, match=needle):
            _DASDrafter(bad)
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        _DASDrafter({"window": 1}, window=0)


def test_bad_call_arguments():
    d = DASDrafter()
    d.begin_iteration(3)
    with pytest.raises(ValueError, match="backwards.*2"):
        d.begin_iteration(2)
    with pytest.raises(ValueError, match="policy_version"):
        d.begin_iteration(3.5)
    d.start_request("r", PROMPT)
    with pytest.raises(ValueError, match="already live"):
        d.start_request("r", PROMPT)
    with pytest.raises(ValueError, match="-4"):
        d.speculate("r", -4)
    with pytest.raises(ValueError, match=str(VOCAB_LIMIT + 1)):
        d.add_tokens("r", [1, VOCAB_LIMIT + 1])
    with pytest.raises(ValueError, match="-7"):
        d.start_request("s", [1, -7])
    assert d.stats()["requests"] == 1
    with pytest.raises(ValueError, match="-2"):
        d.add_rollout(PROMPT, [-2])
    d.add_tokens("r", [1, 2])
    assert d.stats()["tokens"] == len(PROMPT) + 2


def test_no_request_tree_mode_and_many_requests():
    rng = np.random.default_rng(0)
    d = DASDrafter(window=2, use_request_tree=False, max_problems=3)
    for it in range(4):
        d.begin_iteration(it)
        for p in range(5):
            prompt = [p, p + 1]
            for s in range(4):
                rid = (it, p, s)
                d.start_request(rid, prompt)
                for _ in range(5):
                    d.add_tokens(rid, rng.integers(0, 20, 7))
                    dr = d.speculate(rid, 5)
                    assert dr.tokens.size <= 5
                d.stop_request(rid)
    assert d.stats()["problems"] <= 3
    for prob in d._problems.problems.values():
        prob.tree.check_invariants()


def test_new_problem_is_not_evicted_when_older_ones_are_live():
    d = DASDrafter(max_problems=1)
    d.start_request("a", [1])
    d.start_request("b", [2])  # over the limit, but "a" is live and "b" is the new one
    assert problem_id([1]) in d and problem_id([2]) in d
    d.stop_request("a")
    d.add_rollout([3], [4])  # now the least recently used idle problems go
    assert problem_id([3]) in d and d.stats()["problems"] == 1 + 1  # "b" is still live


def _occ(seq, pat):
    m = len(pat)
    return sum(seq[i : i + m] == pat for i in range(len(seq) - m + 1))


def test_problem_tree_counts_are_version_weighted_window_of_rollouts():
    """Brute force: count(p) / count(q) equals the decay-weighted ratio over the kept rollouts."""
    rng = np.random.default_rng(3)
    decay, window, D = 0.5, 3, 5
    d = DASDrafter(window=window, decay=decay, max_depth=D, use_request_tree=False, **BY_VERSIONS)
    prompts = [[7, 8, 9, 1, 2, 3, 4], [5, 5]]
    kept = []  # (prompt index, version, sequence) as the tree should hold it
    v = 0
    for _step in range(14):
        v += int(rng.integers(0, 3))
        d.begin_iteration(v)
        kept = [k for k in kept if k[1] >= v - window + 1]
        for _ in range(2):
            p = int(rng.integers(0, 2))
            out = rng.integers(0, 3, int(rng.integers(0, 12))).tolist()
            d.add_rollout(prompts[p], out)
            kept.append((p, v, prompts[p][-(D - 1):] + out))  # stored: prompt tail + output
    for p in range(2):
        tree = d.problem_tree(problem_id(prompts[p]))
        mine = [(ver, s) for q, ver, s in kept if q == p]
        if not mine:
            assert tree is None
            continue
        assert tree.num_sequences == len(mine)
        pats = [[0], [1], [0, 1], [1, 1, 2], [2, 0], [4, 0], [0, 0, 0]]
        oracle = {tuple(x): sum(decay ** -(ver - v) * _occ(s, x) for ver, s in mine) for x in pats}
        tot_o = sum(decay ** -(ver - v) * len(s) for ver, s in mine)
        tot_t = tree.count([])
        for x in pats:
            assert tree.count(x) / tot_t == pytest.approx(oracle[tuple(x)] / tot_o, rel=1e-9, abs=1e-15)


def test_speculate_is_the_better_of_the_two_trees_drafts():
    """The fused kernels (one call for both trees) agree with drafting each tree on its own."""
    rng = np.random.default_rng(7)
    d = DASDrafter(window=4, decay=1.0, prior=0.25, max_spec_factor=2.0, min_token_prob=0.05)
    prompts = [[7, 8, 9], [1, 1, 2, 3, 5]]
    for v in range(3):
        d.begin_iteration(v)
        for p in prompts:
            d.add_rollout(p, rng.integers(0, 6, 40))
    d.begin_iteration(3)
    rids = [(p, s) for p in range(2) for s in range(3)]
    for rid in rids:
        d.start_request(rid, prompts[rid[0]])
    for _ in range(15):
        for rid in rids:
            d.add_tokens(rid, rng.integers(0, 6, int(rng.integers(1, 4))).astype(np.int32))
            req = d._requests.requests[rid]
            a = req.problem.tree.draft_seq(req.problem_seq, 8, 0.05, 2.0, prior=0.25)
            b = req.tree.draft_seq(0, 8, 0.05, 2.0, prior=0.25)
            want = b if b.score > a.score else a
            got = d.speculate(rid, 8)
            assert got.tokens.tolist() == want.tokens.tolist() and got.score == want.score
            assert got.match_len == want.match_len


def test_prior_shrinks_what_was_seen_once():
    d = DASDrafter(use_request_tree=False)  # defaults: prior 0.3
    d.add_rollout(PROMPT, [4, 5, 6, 7])
    d.start_request("r", PROMPT)
    d.add_tokens("r", [4, 5])
    dr = d.speculate("r", 4)
    assert dr.tokens.tolist()[:1] == [6]
    assert dr.probs[0] == pytest.approx(1 / 1.3)
    assert DASDrafter(prior=0.0, use_request_tree=False).prior == 0.0
    with pytest.raises(ValueError, match="prior"):
        DASDrafter(prior=-1.0)


# ---------------------------------------------------------------------- batch verbs (one engine step)


def _step_both(rng, a, b, live, toks, width=160):
    """One engine step: every live request (rows in random order) gets 0-4 tokens, then drafts
    with a random budget; ``a`` per row, ``b`` with the batch verbs. Drafts must be identical."""
    rows = [live[i] for i in rng.permutation(len(live))]
    mat = np.full((len(rows) + 1, width), -5, np.int32)  # an extra row and junk past the ends: not read
    starts = np.zeros(len(rows), np.int64)
    ends = np.zeros(len(rows), np.int64)
    for r, rid in enumerate(rows):
        s0 = len(toks[rid])
        toks[rid] += rng.integers(0, 4, int(rng.integers(0, 5))).tolist()
        mat[r, : len(toks[rid])] = toks[rid]
        starts[r], ends[r] = s0, len(toks[rid])
        a.add_tokens(rid, mat[r, s0 : ends[r]])
    assert b.num_tokens(rows).tolist() == starts.tolist()
    appended = b.add_tokens_batch(rows, mat, starts if rng.random() < 0.5 else None, ends)
    assert appended.tolist() == (ends - starts).tolist()
    assert b.num_tokens(rows).tolist() == ends.tolist()
    budgets = rng.integers(0, 9, len(rows))
    got = b.speculate_batch(rows, budgets)
    assert got.tokens.dtype == np.int32 and got.probs.dtype == np.float32 and got.lengths.dtype == np.int64
    assert got.tokens.shape == got.probs.shape == (len(rows), int(budgets.max(initial=0)))
    for r, rid in enumerate(rows):
        want = a.speculate(rid, int(budgets[r]))
        k = int(got.lengths[r])
        assert got.tokens[r, :k].tolist() == want.tokens.tolist()
        assert got.probs[r, :k].tolist() == want.probs.tolist()
        assert (got.tokens[r, k:] == -1).all() and (got.probs[r, k:] == 0.0).all()


@pytest.mark.parametrize("chooser", ["walk", "mix"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), use_request_tree=st.booleans())
def test_batch_verbs_match_the_per_row_verbs(chooser, seed, use_request_tree):
    """Random workloads through both paths: windows expire, weights rescale, trees rebuild, grow
    and are evicted, problems are evicted under live requests; drafts stay identical. The batch
    path runs its rows on two threads from 2 rows on (where the machine has two cores), so the threaded
    kernels are held to the per-row drafts as well."""
    import das.suffix_tree as st_module
    from das import step_threads

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(st_module, "_REBUILD_MIN_TOKENS", 16)  # rebuild often (moves live sequences' slots)
        mp.setattr(st_module, "_REBUILD_RATIO", 1)
        mp.setattr(step_threads, "PARALLEL_ROWS", 2)
        _batch_and_row_workload(np.random.default_rng(seed), chooser, use_request_tree)


def _batch_and_row_workload(rng, chooser, use_request_tree):
    kw = dict(window=2, decay=0.5, max_problems=3, use_request_tree=use_request_tree, max_depth=6, prior=0.3,
              min_token_prob=0.05, chooser=chooser, global_rollouts=5)
    a, b = DASDrafter(**kw), DASDrafter(**kw)
    live, toks, nid = [], {}, 0
    for v in range(0, 60, 3):  # decay 0.5, 3 versions a step: rescales within a problem's life
        a.begin_iteration(v)
        b.begin_iteration(v)
        for _ in range(int(rng.integers(1, 4))):
            prompt = [int(rng.integers(0, 5))] * int(rng.integers(1, 4))
            a.start_request(nid, prompt)
            b.start_request(nid, prompt)
            live.append(nid)
            toks[nid] = list(prompt)
            nid += 1
        if rng.random() < 0.2:
            pid = a._requests.requests[live[0]].problem_id
            assert a.evict_problem(pid) == b.evict_problem(pid)
        for _ in range(int(rng.integers(1, 5))):
            _step_both(rng, a, b, live, toks)
            b._check_batch_state()
        for rid in list(live):
            if rng.random() < 0.3 or len(toks[rid]) > 120:
                a.stop_request(rid)
                b.stop_request(rid)
                live.remove(rid)
        b._check_batch_state()
    sa, sb = a.stats(), b.stats()
    assert sa.pop("parallel_calls") == 0
    sb.pop("parallel_calls")
    assert sa == sb
    assert a.mixer_weights.tolist() == b.mixer_weights.tolist()
    if b._threads_for(2) > 1:  # two threads here (physical cores and numba's)
        assert b.parallel_calls > 0
    if chooser == "mix":
        assert b.outcomes_learned > 0
        assert b._global.tree.rebuilds > 0  # live requests' global-tree slots were moved and followed


def test_batch_insert_grows_trees_and_repeats_rows():
    """Many tokens at once overflow fresh trees mid-batch (the kernel stops, Python grows the
    tree and resumes); a request on several rows gets its rows in order."""
    a, b = DASDrafter(**PLAIN), DASDrafter(**PLAIN)
    rng = np.random.default_rng(11)
    seqs = {rid: rng.integers(0, 50, 700).astype(np.int32) for rid in ("x", "y", "z")}
    for d in (a, b):
        for rid in seqs:
            d.start_request(rid, PROMPT)
    rows = ["x", "y", "x", "z", "y", "z"]
    mat = np.stack([seqs[r] for r in rows])
    cuts = {"x": [0, 300, 700], "y": [0, 650, 700], "z": [0, 0, 700]}
    seen = {r: 0 for r in seqs}
    starts, ends = [], []
    for r in rows:
        i = seen[r]
        starts.append(cuts[r][i])
        ends.append(cuts[r][i + 1])
        seen[r] += 1
        a.add_tokens(r, seqs[r][starts[-1] : ends[-1]])
    b.add_tokens_batch(rows, mat, np.array(starts), np.array(ends, np.int32))
    b._check_batch_state()
    for rid in seqs:
        got = b.speculate_batch([rid], [8])
        assert a.speculate(rid, 8).tokens.tolist() == got.tokens[0, : got.lengths[0]].tolist()
        assert b.num_tokens([rid]).tolist() == [len(PROMPT) + 700]
    assert a.stats() == b.stats()
    for prob in b._problems.problems.values():
        prob.tree.check_invariants()


def test_batch_verbs_accept_views_and_empty_batches():
    d = DASDrafter(**PLAIN)
    d.add_rollout(PROMPT, list(range(40, 60)))
    d.start_request("r", PROMPT)
    big = np.zeros((3, 40), np.int64)
    big[1, :10] = np.arange(40, 50)
    view = big[1:, ::2]  # not contiguous, int64
    d.add_tokens_batch(["r"], big[1:, :], [0], [6])
    d.add_tokens_batch(["r"], view, [3], [5])  # view[0, 3:5] = tokens 46, 48
    assert d.problem_tree(problem_id(PROMPT)).sequence(d._requests.requests["r"].problem_seq).tolist()[-8:] == [40, 41, 42, 43, 44, 45, 46, 48]
    out = d.speculate_batch([], np.zeros(0, np.int64))
    assert out.tokens.shape == (0, 0) and out.lengths.shape == (0,)
    d.add_tokens_batch([], np.zeros((0, 5), np.int32), [], [])
    assert d.speculate_batch(["r"], [0]).tokens.shape == (1, 0)
    assert d.num_tokens([]).shape == (0,)


@pytest.mark.parametrize(
    "call, err, needle",
    [
        (lambda d, m: d.add_tokens_batch(["r", "s"], m, [0, -1], [2, 2]), ValueError, r"starts\[1\].*-1"),
        (lambda d, m: d.add_tokens_batch(["r", "s"], m, [0, 3], [2, 2]), ValueError, r"ends\[1\].*starts\[1\] = 3.*got 2"),
        (lambda d, m: d.add_tokens_batch(["r", "s"], m, [0, 0], [9, 2]), ValueError, r"ends\[0\].*8.*got 9"),
        (lambda d, m: d.add_tokens_batch(["r", "s"], m, [0, 0], [2, 5]), ValueError, rf"token {VOCAB_LIMIT}.*\[1, 4\]"),
        (lambda d, m: d.add_tokens_batch(["r", "s"], m, [0, 0], [2, 4]), None, None),  # (valid, for contrast)
        (lambda d, m: d.add_tokens_batch(["r", "s"], m, [0], [2, 2]), ValueError, r"starts.*\(2,\).*\(1,\)"),
        (lambda d, m: d.add_tokens_batch(["r", "s"], m, [0.0, 1.0], [2, 2]), ValueError, "starts.*float64"),
        (lambda d, m: d.add_tokens_batch(["r", "s"], m[0], [0, 0], [2, 2]), ValueError, r"2-D.*\(8,\)"),
        (lambda d, m: d.add_tokens_batch(["r", "s"], m[:1], [0, 0], [2, 2]), ValueError, "1 rows.*2 request"),
        (lambda d, m: d.add_tokens_batch(["r", "s"], m.astype(np.float32), [0, 0], [2, 2]), ValueError, "float32"),
        (lambda d, m: d.add_tokens_batch(["r", "nope"], m, [0, 0], [2, 2]), KeyError, "nope"),
        (lambda d, m: d.speculate_batch(["r", "s"], [4, -3]), ValueError, r"budgets\[1\].*-3"),
        (lambda d, m: d.speculate_batch(["r", "s"], [4]), ValueError, r"budgets.*\(2,\)"),
        (lambda d, m: d.speculate_batch(["r", "s"], [4.5, 1]), ValueError, "budgets.*float64"),
        (lambda d, m: d.speculate_batch(["r", "gone"], [4, 1]), KeyError, "gone"),
        (lambda d, m: d.num_tokens(["r", "gone"]), KeyError, "gone"),
        (lambda d, m: d.speculate_batch(7, [4]), ValueError, "req_ids.*int"),
    ],
)
def test_batch_verbs_reject_bad_input_and_change_nothing(call, err, needle):
    d = DASDrafter()
    d.start_request("r", PROMPT)
    d.start_request("s", PROMPT)
    m = np.arange(16, dtype=np.int32).reshape(2, 8)
    m[1, 4] = VOCAB_LIMIT
    before = d.stats()
    if err is None:
        call(d, m)
        assert d.num_tokens(["r", "s"]).tolist() == [len(PROMPT) + 2, len(PROMPT) + 4]
        return
    with pytest.raises(err, match=needle):
        call(d, m)
    assert d.stats() == before and d.num_tokens(["r", "s"]).tolist() == [len(PROMPT)] * 2


def test_threaded_kernels_run_on_a_team_of_their_parts():
    """A batch verb's ``prange`` kernel runs with numba's team cut to its parts, and the caller's
    team is back after it, also when the kernel raises (left alone, numba runs every parallel
    region on all of its threads, one per CPU)."""
    import numba

    team = numba.get_num_threads()
    if team < 2:
        pytest.skip("numba has one thread on this machine")
    d = DASDrafter(**PLAIN)
    seen = []
    d._on_threads(1, lambda *args: seen.append((numba.get_num_threads(), args)), "rows", 1)
    assert seen == [(1, ("rows", 1))]
    assert numba.get_num_threads() == team and d.parallel_calls == 1

    def failing(*args):
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        d._on_threads(1, failing)
    assert numba.get_num_threads() == team


def test_a_request_on_several_rows_drafts_on_one_thread():
    """Rows of one request would write its pending draft at once, so a batch that repeats a
    request drafts on one thread; distinct requests draft on ``draft_threads``."""
    import numba

    if numba.get_num_threads() < 2:
        pytest.skip("numba has one thread on this machine")
    from das.step_threads import PARALLEL_ROWS

    d = _DASDrafter(draft_threads=2)  # the "mix" chooser
    ids = [f"r{i}" for i in range(PARALLEL_ROWS + 1)]
    for rid in ids:
        d.start_request(rid, PROMPT)
    budgets = np.full(len(ids), 4)
    d.speculate_batch(ids, budgets)
    assert d.parallel_calls == 1
    for i in (0, 1, PARALLEL_ROWS):  # the repeat first, in the middle, last
        repeated = list(ids)
        repeated[i] = ids[(i + 7) % len(ids)]
        d.speculate_batch(repeated, budgets)
        assert d.parallel_calls == 1
    d.speculate_batch(ids, budgets)
    assert d.parallel_calls == 2  # the stamps of an earlier call do not linger


def test_default_draft_threads_read_this_machine(monkeypatch):
    """``draft_threads=0`` takes :func:`das.host.default_draft_threads` of the machine's cores and GPUs."""
    from das import host

    monkeypatch.setattr(host, "physical_cores", lambda: 16)
    monkeypatch.setattr(host, "node_gpus", lambda: 1)
    assert DASDrafter(draft_threads=0)._threads == 16
    monkeypatch.setattr(host, "node_gpus", lambda: 0)
    assert DASDrafter(draft_threads=0)._threads == 8
    assert DASDrafter(draft_threads=3)._threads == 3  # a given count wins
