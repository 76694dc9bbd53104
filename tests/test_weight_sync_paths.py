"""The sync-aware proposer advances the drafter's window once per weight sync, on every path vLLM
offers for one, with a stand-in worker whose methods mirror vLLM's ``Worker`` (``reload_weights``,
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``) and model runner."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # imports the proposer (numba, the drafter's kernels)


def _config():
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4), model_config=SimpleNamespace(max_model_len=64),
                           additional_config={"das": {"budget": "fixed"}}, parallel_config=SimpleNamespace(distributed_executor_backend="uni"))


class _Model:
    def __init__(self):
        self.loads = 0
        self.weights = {}

    def load_weights(self, weights):
        self.loads += 1
        self.weights.update(dict(weights))
        return set(self.weights)


class StandInModelRunner:
    """vLLM builds the drafter inside the model runner's ``__init__``, the runner inside the worker's ``init_device``."""

    def __init__(self):
        from integrations.vllm_ext.weight_sync import SyncAwareDASProposer

        self.input_batch = SimpleNamespace(req_ids=[], num_prompt_tokens=np.zeros(4, np.int64))
        self.requests = {}
        self.model = _Model()
        self.drafter = SyncAwareDASProposer(_config())
        self.drafter.load_model(self.model)

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        if is_checkpoint_format:  # vLLM: the model's load_weights inside a layer-wise reload
            self.model.load_weights(weights_iterator)
        else:  # kernel format: parameters copied directly, load_weights is never called
            self.model.weights.update(dict(weights_iterator))


class StandInWorker:
    def init_device(self):
        self.model_runner = StandInModelRunner()

    def reload_weights(self, *args, **kwargs):
        self.model_runner.reload_weights(*args, **kwargs)

    def start_weight_update(self):
        self.active = True

    def update_weights(self, update_info):  # a transfer engine loading one bucket
        self.model_runner.model.load_weights(update_info["weights"])

    def finish_weight_update(self, *args, **kwargs):  # 0.32: no argument; later vLLM: weight_version
        self.active = False


@pytest.fixture
def worker():
    w = StandInWorker()
    w.init_device()
    return w


def _version(w) -> int:
    return w.model_runner.drafter.drafter.policy_version


def _step(w) -> None:
    w.model_runner.drafter.propose([], np.zeros(4, np.int64), np.zeros((4, 64), np.int32))


def test_bucketed_load_weights_advance_once_at_the_next_step(worker):
    for bucket in range(3):  # a framework's sync in three buckets (verl, TRL call load_weights per bucket)
        worker.model_runner.model.load_weights([(f"w{bucket}", bucket)])
    assert _version(worker) == 0  # the sync's end is not known until the engine steps again
    _step(worker)
    _step(worker)
    assert _version(worker) == 1 and worker.model_runner.drafter.weight_loads == 1


@pytest.mark.parametrize("checkpoint", [True, False], ids=["checkpoint-format", "kernel-format"])
def test_reload_weights_advances_once_when_it_returns(worker, checkpoint):
    worker.reload_weights(weights_iterator=iter([("w", 1), ("b", 2)]), is_checkpoint_format=checkpoint)
    assert worker.model_runner.model.loads == (1 if checkpoint else 0)
    assert _version(worker) == 1  # at once: the reload is the whole sync
    _step(worker)
    assert _version(worker) == 1  # the load_weights inside it counted with it, not again
    worker.reload_weights(weights_iterator=iter([("w", 3)]), is_checkpoint_format=checkpoint)
    assert _version(worker) == 2 and worker.model_runner.drafter.snapshot()["weight_loads"] == 2


@pytest.mark.parametrize("finish", [(), (7,)], ids=["finish()", "finish(weight_version)"])
def test_a_weight_transfer_session_advances_once_at_its_finish(worker, finish):
    worker.start_weight_update()
    for bucket in range(3):
        worker.update_weights({"weights": [(f"w{bucket}", bucket)]})
    assert _version(worker) == 0
    worker.finish_weight_update(*finish)
    assert _version(worker) == 1 and not worker.active
    _step(worker)
    assert _version(worker) == 1 and worker.model_runner.drafter.weight_loads == 1
