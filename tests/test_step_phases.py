"""benchmarks.step_phases: the per-phase fit of engine step times recovers known costs."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import step_phases


def _steps(rng, n=400):
    steps = []
    for _ in range(n):
        rows = int(rng.integers(1, 33))
        drafts = int(rng.integers(1, 30)) if rng.random() < 0.6 else 0
        sample = (0.2 + 0.25 * rows + 0.07 * drafts + 1.1 * (drafts > 0) + rng.normal() * 0.01) / 1e3
        forward = (18.0 + 1.0 * rows + 1.1 * drafts) / 1e3
        steps.append({"rows": rows, "draft_tokens": drafts, "context_tokens": 100 * rows, "_sample": sample,
                      "_model_forward": forward, "step": sample + forward + 0.002})
    return steps


def test_fit_recovers_per_row_per_draft_and_drafted_step_costs():
    coef, rmse = step_phases.fit(_steps(np.random.default_rng(0)), "_sample")
    assert coef == pytest.approx([0.2, 0.25, 0.07, 1.1], abs=0.01)
    assert rmse < 0.02


def test_report_leaves_out_long_steps_and_groups_by_batch_size():
    steps = _steps(np.random.default_rng(1))
    steps.append({"rows": 32, "draft_tokens": 0, "step": 5.0, "_model_forward": 4.9})  # a prefill: left out
    text = step_phases.report(steps)
    assert text.startswith("400 decode steps")
    lines = {line.split()[0]: line.split() for line in text.splitlines() if line.strip()}
    assert float(lines["_model_forward"][1]) == pytest.approx(18.0, abs=0.01)  # a, in ms
    assert "<=32" in lines and lines["<=32"][1] in ("yes", "no")
