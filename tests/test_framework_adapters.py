"""The framework adapters' own logic, without TRL or verl installed (fast; the framework runs are
``tests/test_framework_trl.py`` and ``tests/test_framework_verl.py``, ``-m framework``)."""

from __future__ import annotations

import numpy as np
import pytest

from integrations.rl.trl import PROBLEM_ID_COLUMNS, row_problem_id
from integrations.rl.verl import PLATFORM, cpu_environment, cpu_overrides


def test_row_problem_id_reads_the_first_id_column_and_prefixes_the_data_source():
    assert PROBLEM_ID_COLUMNS[0] == "das_problem_id"
    assert row_problem_id({"prompt": "p", "problem_id": "count/0", "id": 5}) == "count/0"
    assert row_problem_id({"prompt": "p", "index": np.int64(17), "data_source": "deepscaler"}) == "deepscaler/17"
    assert row_problem_id({"prompt": "p"}) is None  # the proposer then hashes the prompt
    assert row_problem_id({"prompt": "p", "qid": 3}, "qid") == "3"
    assert row_problem_id({"prompt": "p", "a": 1, "b": 2}, lambda r: f"{r['a']}-{r['b']}") == "1-2"
    with pytest.raises(ValueError, match="problem id must be a str or an int, got float"):
        row_problem_id({"problem_id": 1.5})
    with pytest.raises(ValueError, match="got bool"):
        row_problem_id({"problem_id": True})


def test_verl_cpu_environment_and_overrides():
    env = cpu_environment(pythonpath="/opt/das")
    assert env["VERL_USE_EXTERNAL_MODULES"] == "integrations.rl.verl" and env["VERL_PLATFORM"] == PLATFORM
    assert env["PYTHONPATH"].split(":")[0] == "/opt/das"
    ov = cpu_overrides()
    assert "++actor_rollout_ref.rollout.enable_sleep_mode=false" in ov
    assert "actor_rollout_ref.rollout.load_format=auto" in ov
    assert "++actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=integrations.rl.verl.CPUWorkerExtension" in ov
