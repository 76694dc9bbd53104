"""Two GRPO steps of TRL's ``GRPOTrainer`` (colocated vLLM, CPU) with DAS turned on by ``enable_das``.

``python tests/frameworks/trl_check.py MODEL OUT.json`` trains MODEL (a local Hugging Face directory) for two
steps on a two-row dataset whose rows share their prompt text but not their ``problem_id``, so the proposer's
problem count tells whether the ids reached it (a hash of the prompt would give one problem). Each step
syncs the weights into the engine first (TRL syncs before every step's generation, the first one
included). It writes the proposer's counters, vLLM's speculative-decoding counters and the tags sent as
JSON; ``tests/test_framework_trl.py`` asserts on them. Run from the repository root.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main(model: str, out_path: str) -> None:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from integrations.rl.trl import enable_das
    from integrations.vllm_ext import control
    from integrations.vllm_ext.engine import spec_counters

    torch.manual_seed(0)
    handle = enable_das(num_speculative_tokens=8)  # the one call, before the trainer is built
    prompt = "one two three four five six seven eight nine ten"
    data = Dataset.from_list([{"prompt": prompt, "problem_id": "count/0"}, {"prompt": prompt, "problem_id": "count/1"}])

    def reward(completions, **kwargs):  # varies with the sample, so advantages (and the update) are not zero
        return [float(len(set(c.split()))) for c in completions]

    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, use_cpu=True, bf16=False, report_to=[], save_strategy="no", logging_steps=1, seed=0,
            max_steps=2, per_device_train_batch_size=8, num_generations=4, max_completion_length=32,
            learning_rate=1e-3, temperature=0.7,
            use_vllm=True, vllm_mode="colocate", vllm_max_model_length=256,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data)
        trainer.train()
        llm = trainer.vllm_generation.llm
        report = {
            "global_step": trainer.state.global_step,
            "speculative_config": llm.llm_engine.vllm_config.speculative_config.method,
            "proposer_class": type(llm.llm_engine.model_executor.driver_worker.model_runner.drafter).__name__,
            "proposer": control.snapshot(llm)[0],
            "spec_decode": spec_counters(llm),
            "tagged_requests": handle.tagged_requests,
            "untagged_requests": handle.untagged_requests,
            "log_history": trainer.state.log_history,
        }
    handle.disable()
    Path(out_path).write_text(json.dumps(report, indent=1, default=str))
    print(f"trl_check: wrote {out_path}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
