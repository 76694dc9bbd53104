"""DAS inside verl 0.9.1's own code on this CPU (the verl environment of ``install.sh --frameworks``).

The scenarios run in the verl environment (``tests/frameworks/verl_check.py``); these tests assert on
what they saw. See ``integrations/rl/verl.py`` for what verl needs on a CPU and ``recipes/README.md``.
"""

from __future__ import annotations

from collections import Counter

import pytest

pytestmark = pytest.mark.framework


def test_verl_agent_loop_tags_every_request_with_its_problem_id(verl_python, tiny_model, tmp_path, framework_check):
    seen = framework_check(verl_python, "verl_check.py", ["agent-loop", tiny_model], tmp_path / "agent_loop.json", timeout=600)
    assert seen["default_agent_loop"] == "das_single_turn_agent"
    assert seen["agent_loop_config_path"] == "recipes/verl/das_agent_loops.yaml"  # verl's worker registers its entries
    rows, requests = seen["rows"], seen["requests"]
    assert len(rows) == 9 and len(requests) == 9 and seen["output_rows"] == 9  # 3 problems x n=3, as verl repeats them
    want = Counter(f"{r['data_source']}/{r['index']}" for r in rows)
    got = Counter(r["extra_args"]["das_problem_id"] for r in requests)
    assert got == want and len(want) == 3  # two rows share their question; their ids still differ
    question = {f"{r['data_source']}/{r['index']}": r["question"] for r in rows}
    for r in requests:
        assert set(r["extra_args"]) == {"das_problem_id"}
        assert question[r["extra_args"]["das_problem_id"]] in r["prompt_text"]
        assert r["sampling_params"]["temperature"] == 1.0  # verl's own sampling params, passed on unchanged


@pytest.mark.engine
def test_verl_server_drafts_and_advances_one_policy_version_per_weight_sync(verl_python, smollm2_model, tmp_path, framework_check):
    seen = framework_check(verl_python, "verl_check.py", ["server", smollm2_model], tmp_path / "server.json", timeout=1500)
    assert seen["platform"] == "CPUPlatform"
    assert seen["server_args"]["worker_extension_cls"] == "integrations.rl.verl.CPUWorkerExtension"
    assert [s["use_shm"] for s in seen["syncs"]] == [True, True]  # verl's shared-memory path, not CUDA IPC
    assert all(s["buckets"] > 1 for s in seen["syncs"])  # several load_weights calls per sync
    batches = seen["batches"]
    assert [b["rows"] for b in batches] == [12, 12, 12]
    for version, b in enumerate(batches):
        p = b["proposer"]
        assert (p["policy_version"], p["weight_loads"]) == (version, version), b  # one version per sync, not per bucket
        assert p["failures"] == 0 and p["bad_requests"] == 0
        assert p["drafter_problems"] == 3  # keyed by das_problem_id: a prompt hash would give 2
    for b in batches[1:]:  # drafts accepted after each sync, from the rollouts of earlier versions
        assert b["drafts"] > 0 and b["proposer"]["drafts"] > 0
        assert 1 + b["accepted_tokens"] / b["drafts"] > 1.3, b


@pytest.mark.engine
def test_verl_two_replicas_keep_groups_together_and_a_moved_problem_drafts_from_its_history(verl_python, smollm2_model, tmp_path, framework_check):
    """verl's servers behind DASRouter: iteration 1 places each GRPO group on one replica; iteration 2 moves
    every problem to the other replica (forced placement), whose drafter pulls the problem's iteration-1
    rollouts from the shared history before its first draft and accepts drafts on them (one sample per
    problem: no siblings to draft from)."""
    seen = framework_check(verl_python, "verl_check.py", ["replicas", smollm2_model], tmp_path / "replicas.json", timeout=1500)
    first, second = seen["iterations"]
    servers = seen["servers"]
    assert len(servers) == 2 and seen["cpus"][0] != seen["cpus"][1]  # one core each
    assert (first["rows"], second["rows"]) == (12, 3)  # 3 problems x 4 samples, then x 1
    # iteration 1: each problem's 4 samples on one replica, and both replicas used
    assert all(len(by_server) == 1 and sum(by_server.values()) == 4 for by_server in first["routed"].values())
    assert set(first["placement"].values()) == set(servers)
    # iteration 2: every problem on the other replica
    assert set(second["placement"]) == set(first["placement"])
    assert all(second["placement"][p] != first["placement"][p] for p in first["placement"])
    assert first["counters"]["published"] == 12 and second["counters"]["ingest_errors"] == 0
    for b in servers:
        moved_in = [p for p, s in second["placement"].items() if s == b]
        before, after = first["servers"][b], second["servers"][b]
        assert before["history"]["pulled"] == 0  # nothing to pull in iteration 1
        assert after["history"]["pulled"] == 4 * len(moved_in) and after["history"]["store_errors"] == 0  # the iteration-1 rollouts, from A
        grown = after["proposer"]["drafter_sequences"] - before["proposer"]["drafter_sequences"]
        assert grown >= after["history"]["pulled"]  # B's drafter stored them
        assert after["proposer"]["drafter_problems"] == 3
        assert after["proposer"]["failures"] == 0 and after["proposer"]["bad_requests"] == 0
    # vLLM's counters during iteration 2 (every problem there is a moved one, one sample each): drafts accepted
    drafts = sum(second["servers"][b]["drafts"] for b in servers)
    accepted = sum(second["servers"][b]["accepted_tokens"] for b in servers)
    assert drafts > 0 and 1 + accepted / drafts > 1.3, second
