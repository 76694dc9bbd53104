"""DAS inside TRL 1.16's ``GRPOTrainer`` (colocated vLLM) on this CPU: two real GRPO steps.

The training runs in a subprocess of this environment (``tests/frameworks/trl_check.py``), so that
TRL's process group and its in-process engine end with it; this test asserts on what it saw.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.framework, pytest.mark.engine]


def test_trl_grpo_two_steps_two_policy_versions_and_drafts(tiny_model, tmp_path, framework_check):
    try:
        import trl
    except ImportError:
        pytest.fail("TRL is not installed: run `bash install.sh --frameworks` first")
    assert trl.__version__ == "1.16.0"
    import sys

    seen = framework_check(sys.executable, "trl_check.py", [tiny_model], tmp_path / "trl.json", timeout=900)
    assert seen["global_step"] == 2
    assert seen["speculative_config"] == "custom_class" and seen["proposer_class"] == "SyncAwareDASProposer"
    p = seen["proposer"]
    assert (p["weight_loads"], p["policy_version"]) == (2, 2)  # TRL syncs before each step: two versions, not one per parameter
    assert p["failures"] == 0 and p["bad_requests"] == 0
    assert p["drafter_problems"] == 2  # the two rows share their prompt: only their problem ids tell them apart
    assert (seen["tagged_requests"], seen["untagged_requests"]) == (16, 0)  # 2 steps x 2 problems x 4 generations
    assert p["drafts"] > 0 and seen["spec_decode"]["drafts"] > 0
