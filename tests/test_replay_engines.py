"""The many-engine replay: routings (rollout, group, sticky) and the shared history."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.replay import TraceRollout, load_trace, main, replay
from benchmarks.replay_drafters import make_adapter
from benchmarks.replay_engines import ROUTINGS, replay_engines, route


def _engines_of_groups(its, eng):
    """{(iteration, problem): set of engines its rollouts went to}."""
    out: dict = {}
    for it, (rs, e) in enumerate(zip(its, eng)):
        for r, x in zip(rs, e.tolist()):
            out.setdefault((it, r.pid), set()).add(x)
    return out


@pytest.mark.parametrize("routing", ROUTINGS)
def test_each_rollout_is_replayed_once_and_groups_stay_together(synthetic_trace, routing):
    its = load_trace(synthetic_trace(iterations=3, problems=6, samples=4))
    n = 3
    eng = route(its, n, routing, seed=1)
    assert [e.shape for e in eng] == [(len(rs),) for rs in its]
    assert all(e.dtype == np.int64 and e.min() >= 0 and e.max() < n for e in eng)
    res = replay_engines("das", its, n, routing, engine_of=eng)
    assert sum(p["rollouts"] for p in res["per_engine"]) == sum(len(rs) for rs in its)
    assert res["tokens"] == sum(r.output.shape[0] for rs in its for r in rs)
    assert sum(p["verification_steps"] for p in res["per_engine"]) == res["verification_steps"]
    spread = _engines_of_groups(its, eng)
    if routing == "rollout":
        # a least-loaded balancer: every engine gets its share (+-1) and groups are split
        for e in eng:
            c = np.bincount(e, minlength=n)
            assert c.max() - c.min() <= 1
        assert any(len(s) > 1 for s in spread.values())
    else:
        assert all(len(s) == 1 for s in spread.values())
    if routing == "sticky":  # a problem stays on one engine across iterations
        by_problem: dict = {}
        for (_, pid), s in spread.items():
            by_problem.setdefault(pid, set()).update(s)
        assert all(len(s) == 1 for s in by_problem.values())
        assert len(set().union(*by_problem.values())) == n  # 6 problems spread over all 3 engines


def test_group_routing_spreads_the_longest_groups():
    """LPT on the predictor fed by iteration 0: in iteration 1 the two longest problems go to two engines."""
    rng = np.random.default_rng(0)
    its = []
    for it in range(2):
        rs = []
        for p, length in enumerate([200, 190, 10, 12]):
            for _ in range(4):
                rs.append(TraceRollout(f"p{p}", np.arange(3, dtype=np.int32), rng.integers(0, 9, length).astype(np.int32), it))
        its.append(rs)
    eng = route(its, 2, "group")
    first = {r.pid: e for r, e in zip(its[1], eng[1].tolist())}
    assert first["p0"] != first["p1"]


def test_one_engine_is_the_plain_replay(synthetic_trace):
    its = load_trace(synthetic_trace(iterations=3, problems=3, samples=4))
    plain = replay(make_adapter("das", 16), its)
    for routing in ROUTINGS:
        one = replay_engines("das", its, 1, routing)
        for key in ("acceptance_length", "tokens", "verification_steps", "drafted_tokens", "accepted_tokens", "makespan_steps"):
            assert one[key] == plain[key], (routing, key)


def _repeated_trace(seed: int = 0):
    """Two iterations; iteration 1 repeats iteration 0's rollouts token for token."""
    rng = np.random.default_rng(seed)
    its = [[], []]
    for p in range(2):
        prompt = np.array([100 + p, 200, 201], np.int32)
        outs = [rng.integers(0, 40, int(rng.integers(40, 80))).astype(np.int32) for _ in range(3)]
        for it in range(2):
            its[it] += [TraceRollout(f"p{p}", prompt, o, it) for o in outs]
    return its


@pytest.mark.parametrize("config", [{"chooser": "walk"}, {}], ids=["walk", "default"])
def test_a_moved_problem_drafts_from_its_history_on_the_new_engine(config):
    """Problem p0 on engine 0 in iteration 0 and on engine 1 in iteration 1: with the shared
    history, engine 1 accepts the repeated rollouts exactly as one engine holding everything does;
    without it, it has only the siblings it generates itself."""
    its = _repeated_trace()
    # iteration 0: both problems on engine 0; iteration 1: p0 on engine 1, p1 stays
    eng = [np.zeros(6, np.int64), np.array([1, 1, 1, 0, 0, 0])]
    shared = replay_engines("das", its, 2, "group", shared_history=True, config=config, engine_of=eng)
    own = replay_engines("das", its, 2, "group", shared_history=False, config=config, engine_of=eng)
    b_shared = next(p for p in shared["per_engine"] if p["engine"] == 1)
    b_own = next(p for p in own["per_engine"] if p["engine"] == 1)
    one_p0 = replay(make_adapter("das", 16, **config), [its[0], its[1][:3]])["iterations"][1]
    if config.get("chooser") == "walk":  # drafts depend on the trees only: exactly one engine's
        assert b_shared["verification_steps"] == one_p0["verification_steps"]
    assert b_shared["acceptance_length"] > 1.5 * b_own["acceptance_length"]
    assert shared["history_rollouts_sent"] == 3 and shared["history_rollouts_kept"] == 3
    assert own["history_rollouts_sent"] == 0


def test_shared_history_reaches_arctic():
    pytest.importorskip("arctic_inference.suffix_decoding")
    its = _repeated_trace(1)
    eng = [np.zeros(6, np.int64), np.array([1, 1, 1, 0, 0, 0])]
    shared = replay_engines("arctic_suffix", its, 2, "group", shared_history=True, engine_of=eng)
    own = replay_engines("arctic_suffix", its, 2, "group", shared_history=False, engine_of=eng)
    b = [next(p for p in r["per_engine"] if p["engine"] == 1)["acceptance_length"] for r in (shared, own)]
    assert b[0] > 1.5 * b[1]


def test_memory_per_engine_is_bounded_by_its_problems(synthetic_trace):
    """Sticky routing, 4 problems on 4 engines: each engine stores about a quarter of one engine's history."""
    its = load_trace(synthetic_trace(iterations=3, problems=4, samples=4))
    one = replay_engines("das", its, 1, "sticky")
    four = replay_engines("das", its, 4, "sticky", shared_history=True)
    assert four["engines_used"] == 4
    assert four["engine_peak_tokens_stored_max"] < 0.5 * one["engine_peak_tokens_stored_max"]


def test_bad_routing_and_placement_are_clear_errors(synthetic_trace):
    its = load_trace(synthetic_trace())
    with pytest.raises(ValueError, match="routing"):
        route(its, 2, "anywhere")
    with pytest.raises(ValueError, match="n_engines"):
        route(its, 0, "group")
    with pytest.raises(ValueError, match="engine_of"):
        replay_engines("das", its, 2, "group", engine_of=[np.full(len(rs), 2) for rs in its])


def test_cli_engines_writes_rows(tmp_path, synthetic_trace):
    trace = synthetic_trace(iterations=2, problems=3, samples=3)
    out = tmp_path / "e.json"
    assert main(["--trace", str(trace), "--engines", "2", "--routing", "rollout", "--shared-history", "--drafters", "das",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["engines"], r["routing"], r["shared_history"]) for r in rows] == [(1, "rollout", False), (2, "rollout", True)]
    assert rows[0]["acceptance_vs_one"] == 1.0 and rows[1]["acceptance_length"] >= 1.0


def test_global_share_fills_the_cross_problem_tree_only():
    from das import DASDrafter

    d = DASDrafter()
    assert d.add_rollout([1, 2, 3], [4, 5, 6, 7], problem_id="elsewhere", problem_tree=False)
    assert "elsewhere" not in d and d.stats()["global_rollouts"] == 1 and d.stats()["problems"] == 0
    assert not DASDrafter(global_rollouts=0).add_rollout([1, 2], [3], problem_id="x", problem_tree=False)
    its = _repeated_trace(2)
    eng = [np.array([0, 0, 0, 1, 1, 1])] * 2  # p0 on engine 0, p1 on engine 1, both iterations
    plain = replay_engines("das", its, 2, "sticky", shared_history=True, engine_of=eng)
    glob = replay_engines("das", its, 2, "sticky", shared_history=True, share_global=True, engine_of=eng)
    assert plain["history_rollouts_sent"] == 0 and glob["history_rollouts_sent"] == 6  # each engine: the other's 3 of iteration 0
    assert glob["engine_peak_global_tree_bytes_max"] > plain["engine_peak_global_tree_bytes_max"]
    assert glob["tokens"] == plain["tokens"]
