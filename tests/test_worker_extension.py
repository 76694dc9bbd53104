"""Driver verbs reach the workers by name, with plain msgpack arguments (integrations.vllm_ext.worker_extension).

A stand-in ``LLM`` runs each ``collective_rpc`` on a stand-in worker that has
:class:`DASWorkerExtension` mixed in, as vLLM does; across a "process boundary" it sends the
method name, arguments and answers through msgpack without any hook (what vLLM's encoder can
carry without ``VLLM_ALLOW_INSECURE_SERIALIZATION``: no functions, no tensors as such).
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from integrations.vllm_ext.worker_extension import EXTENSION, DASWorkerExtension, ExtensionMissing, call, pack_tensor, unpack_tensor

REPO = Path(__file__).resolve().parents[1]


class _Drafter:
    """What the extension reads of a DAS proposer."""

    drafting = True

    def __init__(self):
        self.drafter = SimpleNamespace(policy_version=0)

    def begin_iteration(self, v):
        if v < self.drafter.policy_version:
            raise ValueError(f"policy_version went backwards: {v}")
        self.drafter.policy_version = v

    def snapshot(self):
        return {"steps": np.int64(3), "propose_s": np.float64(0.5), "reliability": [(0.1, 2)], "cost_model": {"c": np.float32(1.0)}}


class _Model:
    def __init__(self):
        import torch

        self.params = {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}

    def named_parameters(self):
        return iter(self.params.items())


class _Worker(DASWorkerExtension):
    def __init__(self, drafting=True):
        self.model_runner = SimpleNamespace(drafter=_Drafter(), model=_Model())
        self.model_runner.drafter.drafting = drafting
        self.reloads = []

    def reload_weights(self, weights_iterator, is_checkpoint_format=True):
        pairs = list(weights_iterator)
        self.reloads.append(([n for n, _ in pairs], is_checkpoint_format))
        for n, t in pairs:
            self.model_runner.model.params[n].copy_(t)


class InprocClient:  # the name vLLM's in-process engine core client has
    pass


class SyncMPClient:
    pass


class FakeLLM:
    """``collective_rpc`` by name on stand-in workers; ``remote``: msgpack across the boundary, both ways."""

    def __init__(self, remote: bool, workers=None, extension: str = EXTENSION):
        self.workers = workers or [_Worker()]
        self.remote = remote
        self.calls = []
        self.llm_engine = SimpleNamespace(engine_core=SyncMPClient() if remote else InprocClient(),
                                          vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(worker_extension_cls=extension)))

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        import msgspec

        self.calls.append((method, args))
        if self.remote:
            method, args = msgspec.msgpack.decode(msgspec.msgpack.encode((method, list(args))))  # raises on a function or a tensor
        answers = []
        for w in self.workers:
            fn = getattr(w, method, None)
            if fn is None:
                message = f"Method {method!r} is not implemented."
                raise (Exception(f"Call to collective_rpc method failed: {message}") if self.remote else NotImplementedError(message))
            answers.append(fn(*args))
        return msgspec.msgpack.decode(msgspec.msgpack.encode(answers)) if self.remote else answers

    def reset_prefix_cache(self):
        return True


def _verbs(llm):
    """Every driver verb of das, once."""
    import torch

    from integrations.vllm_ext import control
    from integrations.vllm_ext.weight_sync import drafter_policy_version, engine_state_dict, sync_weights

    control.begin_iteration(llm, 2)
    snaps = control.snapshot(llm)
    version = drafter_policy_version(llm)
    sync_weights(llm, {"w": torch.ones(2, 3), "b": torch.full((3,), 2.0, dtype=torch.bfloat16)})
    state = engine_state_dict(llm)
    on = control.enable_coupled_sampling(llm)
    return snaps, version, state, on


def _callables(obj) -> list:
    if callable(obj) and not isinstance(obj, type):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [c for v in obj for c in _callables(v)]
    if isinstance(obj, dict):
        return [c for v in obj.values() for c in _callables(v)]
    return []


@pytest.mark.slow  # sync_weights and the coupled-sampling feature import torch and vLLM's patches
@pytest.mark.parametrize("remote", [False, True], ids=["in-process", "other-process"])
def test_every_verb_sends_a_name_and_plain_arguments_and_gets_the_same_answers(remote):
    import torch

    llm = FakeLLM(remote)
    snaps, version, state, on = _verbs(llm)
    assert [m for m, _ in llm.calls] == ["das_begin_iteration", "das_snapshot", "das_policy_version", "das_reload_weights",
                                        "das_state_dict", "das_enable_coupled_sampling"]
    assert all(isinstance(m, str) for m, _ in llm.calls) and not _callables([a for _, a in llm.calls])
    assert version == 2
    assert snaps == [{"steps": 3, "propose_s": 0.5, "reliability": [[0.1, 2]], "cost_model": {"c": 1.0}}]
    assert type(snaps[0]["steps"]) is int  # numpy scalars made plain, in both topologies alike
    assert torch.equal(state["w"], torch.ones(2, 3))
    assert state["b"].dtype == torch.bfloat16 and torch.equal(state["b"], torch.full((3,), 2.0, dtype=torch.bfloat16))
    assert llm.workers[0].reloads == [(["w", "b"], True)]
    assert len(on) == 1


def test_no_module_of_integrations_passes_a_function_to_collective_rpc():
    # Every collective_rpc call names a worker method: a str literal, or the `method` name that
    # worker_extension.call checks is a str.
    offenders = []
    for path in (REPO / "integrations").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "collective_rpc":
                first = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "method"), None)
                named = isinstance(first, ast.Constant) and isinstance(first.value, str)
                checked = isinstance(first, ast.Name) and first.id == "method" and path.name == "worker_extension.py"
                if not (named or checked):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders


def test_call_refuses_a_function():
    with pytest.raises(TypeError, match="name"):
        call(FakeLLM(False), lambda worker: None)


@pytest.mark.parametrize("remote", [False, True])
def test_a_worker_error_is_raised_with_its_own_type_in_both_topologies(remote):
    from integrations.vllm_ext import control

    llm = FakeLLM(remote)
    control.begin_iteration(llm, 3)
    with pytest.raises(ValueError, match="backwards"):
        control.begin_iteration(llm, 1)
    llm.workers[0].model_runner.drafter = None  # an engine without the DAS proposer
    with pytest.raises(RuntimeError, match="DAS proposer"):
        control.snapshot(llm)


@pytest.mark.parametrize("remote", [False, True])
def test_a_missing_extension_says_what_to_add(remote):
    from integrations.vllm_ext import control

    class Plain:  # vLLM's worker without das's extension
        model_runner = None

    with pytest.raises(ExtensionMissing, match="worker_extension_cls"):
        control.begin_iteration(FakeLLM(remote, extension=""), 1)  # known from the engine's config
    with pytest.raises(ExtensionMissing, match="worker_extension_cls='integrations.vllm_ext.worker_extension.DASWorkerExtension'"):
        control.begin_iteration(FakeLLM(remote, workers=[Plain()], extension="my.OwnExtension"), 1)  # known from the worker's answer


def test_ranks_that_do_not_draft_are_left_out_of_the_answers():
    from integrations.vllm_ext import control
    from integrations.vllm_ext.weight_sync import drafter_policy_version

    llm = FakeLLM(True, workers=[_Worker(), _Worker(drafting=False)])
    control.begin_iteration(llm, 4)
    assert drafter_policy_version(llm) == 4 and len(control.snapshot(llm)) == 1
    assert llm.workers[1].model_runner.drafter.drafter.policy_version == 0  # the idle rank was not touched


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(["float32", "bfloat16", "float16", "int64", "int32", "uint8", "bool"]),
       shape=st.lists(st.integers(0, 4), min_size=0, max_size=3), seed=st.integers(0, 2**16))
def test_a_packed_tensor_is_plain_msgpack_and_comes_back_bit_for_bit(dtype, shape, seed):
    import msgspec
    import torch

    t = (torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed)) * 100).to(getattr(torch, dtype))
    packed = msgspec.msgpack.decode(msgspec.msgpack.encode(pack_tensor(t)))
    back = unpack_tensor(packed)
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
    assert unpack_tensor(t) is t  # a tensor passes as it is (the engine core in this process)
    with pytest.raises(TypeError, match="triple"):
        unpack_tensor("weights")
