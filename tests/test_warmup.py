"""The drafter's kernels are compiled (or loaded from numba's cache) when the proposer is built,
so an engine's decode steps compile nothing (das.warmup)."""

import json
import subprocess
import sys
import textwrap

import pytest

from das.warmup import warm_up

# Runs the proposer in a fresh process (it imports vLLM: seconds), so that only what this
# process loaded counts.
ENGINE_STEPS = textwrap.dedent(
    """
    import json
    from types import SimpleNamespace

    import numpy as np
    from numba.core.dispatcher import Dispatcher

    import das.drafter, das.mix_kernels, das.step_threads, das.suffix_tree, das.trie_kernels
    from das.step_threads import PARALLEL_ROWS
    from integrations.vllm_ext.proposer import DASProposer

    MODULES = (das.trie_kernels, das.mix_kernels, das.step_threads, das.suffix_tree, das.drafter)

    def compiled():
        return {f"{m.__name__}.{n}": len(f.overloads) for m in MODULES for n, f in vars(m).items() if isinstance(f, Dispatcher)}

    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=8),
                          model_config=SimpleNamespace(max_model_len=4096),
                          additional_config={"das": {"budget": "fixed", "defer_global": DEFER, "window": 2, "global_rollouts": 8}})
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=[], num_prompt_tokens=None), requests={})
    prop = DASProposer(cfg, runner=runner)
    before = compiled()
    rng = np.random.default_rng(1)

    def iteration(rows, steps, prompt_len, tag):
        # vLLM's side of a batch: token_ids_cpu (int32), num_tokens_no_spec, each row's sampled tokens
        width = prompt_len + 3 * steps + 2
        tok = np.zeros((rows, width), np.int32)
        base = [rng.integers(0, 3000, 61, dtype=np.int32) for _ in range(4)]
        rids = [f"{tag}-{r}" for r in range(rows)]
        for r, rid in enumerate(rids):
            tok[r] = np.resize(base[r % 4], width)
            runner.requests[rid] = SimpleNamespace(sampling_params=SimpleNamespace(extra_args={"das_problem_id": f"{tag}/{r % 4}"}, max_tokens=None))
        runner.input_batch.req_ids = rids
        runner.input_batch.num_prompt_tokens = np.full(rows, prompt_len, np.int64)
        seen = np.full(rows, prompt_len, np.int64)
        num = seen + 1  # prefill sampled the first token
        for _ in range(steps):
            prop.propose([tok[r, seen[r] : num[r]].tolist() for r in range(rows)], num, tok)
            seen, num = num, num + rng.integers(1, 4, rows)
        for rid in rids:
            del runner.requests[rid]

    iteration(5, 30, 120, "a")
    iteration(PARALLEL_ROWS * 2 + 3, 20, 700, "b")
    prop.begin_iteration(2)
    iteration(PARALLEL_ROWS + 1, 10, 50, "c")
    prop.begin_iteration(5)  # the window (2 versions) expires the history; the global tree (8 rollouts) lets go
    iteration(5, 10, 50, "a")
    after = compiled()
    print(json.dumps({"new": {k: [before.get(k, 0), v] for k, v in after.items() if v != before.get(k, 0)},
                      "drafts": prop.stats.draft_tokens}))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("defer", [False, True], ids=["cpu-engine", "global-tree-deferred"])
def test_an_engine_built_with_the_proposer_compiles_nothing_in_its_steps(defer):
    script = ENGINE_STEPS.replace("DEFER", repr(defer))  # defer_global: off on a CPU engine, on where a GPU verifies
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["drafts"] > 0  # the steps drafted, so the drafting kernels ran
    assert res["new"] == {}, f"kernels first loaded or compiled in an engine step: {res['new']}"


def test_warm_up_takes_the_drafters_settings_and_checks_them():
    assert warm_up(chooser="walk", draft_threads=1) >= 0.0
    with pytest.raises(ValueError, match="window"):
        warm_up(window=0)


def test_close_finishes_the_deferred_work_and_stops_the_thread():
    import threading

    import numpy as np

    from das import DASDrafter

    d = DASDrafter(defer_global=True)
    ids = [("r", i) for i in range(20)]
    tok = np.tile(np.arange(40, dtype=np.int32), (20, 1))
    for i, rid in enumerate(ids):
        d.start_request(rid, tok[i, :10], problem_id="p")
    d.add_tokens_batch(ids, tok, None, np.full(20, 30, np.int64))
    d.speculate_batch(ids, np.full(20, 4, np.int64))  # starts the deferred global-tree append
    assert any(t.name.startswith("das-global") and t.is_alive() for t in threading.enumerate())
    d.close()
    assert not any(t.name.startswith("das-global") and t.is_alive() for t in threading.enumerate())
    assert d.stats()["requests"] == 20  # still usable
