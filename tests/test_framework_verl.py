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
