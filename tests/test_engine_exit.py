"""A process that builds two engines with the engine core in its own process exits by itself.

``das-rollout --compare`` and ``das-grpo --compare`` keep one engine per method side by side and
release them at the end. With ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` each engine's core is a child
process, shut down by a finalizer of vLLM's engine-core client; an engine still referenced when
it is released would keep its core alive and the interpreter's exit would wait on it.
:func:`integrations.vllm_ext.engine.close_llm` shuts the core down explicitly. The script (this
file run in a fresh interpreter, without ``VLLM_ALLOW_INSECURE_SERIALIZATION``) imports vLLM only
inside ``make_llm``, as the command-line tools do, builds two ``none`` engines side by side,
generates with each, closes both, and must then return.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.engine
def test_two_engines_with_the_engine_core_in_its_own_process_exit(tiny_model, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_CPU_OMP_THREADS_BIND")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    done = tmp_path / "done"
    proc = subprocess.Popen([sys.executable, __file__, tiny_model, str(done)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and the engine cores it left behind
        stdout, stderr = proc.communicate()
        pytest.fail(f"the script did not exit within 600 s (work finished: {done.exists()})\n--- stderr ---\n{stderr[-6000:]}")
    assert done.exists(), f"exit {proc.returncode} before the work finished\n--- stderr ---\n{stderr[-6000:]}"
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout ---\n{stdout[-2000:]}\n--- stderr ---\n{stderr[-6000:]}"


def _two_engines(model: str, done: str) -> None:
    from integrations.vllm_ext.engine import close_llm, make_llm, release_engine_state

    engines = {name: make_llm(model, "none", dtype="float32", max_model_len=256) for name in ("a", "b")}
    from vllm import SamplingParams

    for llm in engines.values():
        out = llm.generate(["one two three"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    del llm, out
    for name in list(engines):
        close_llm(engines[name])
        del engines[name]
        release_engine_state()
    Path(done).write_text("ok")


if __name__ == "__main__":
    _two_engines(sys.argv[1], sys.argv[2])
