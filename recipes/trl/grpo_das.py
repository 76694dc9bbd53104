"""GRPO with TRL 1.16 and DAS speculative decoding in the colocated vLLM engine.

    PYTHONPATH=/path/to/das python recipes/trl/grpo_das.py --model Qwen/Qwen2.5-0.5B-Instruct --steps 10

The three DAS lines are marked; everything else is an ordinary TRL GRPO script. Each row of the
dataset carries a ``problem_id`` (any of the columns ``das_problem_id``, ``problem_id``, ``id``,
``index``; or pass ``problem_id=`` to ``enable_das``), so every GRPO group and every revisit of a
problem drafts from the same suffix tree. ``--model`` is a local directory or a hub name your
machine can load.
"""

from __future__ import annotations

import argparse

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from integrations.rl.trl import enable_das  # DAS 1/3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--data", default="math", help="'math' (embedded CHAMP problems) or a verl-style parquet file")
    ap.add_argument("--output-dir", default="runs/trl_grpo_das")
    args = ap.parse_args()

    from integrations.data.problems import load_problems
    from integrations.data.registry import data_dir_from_env
    from integrations.rl.rewards import math_reward

    problems = load_problems(args.data, limit=64, data_dir=data_dir_from_env())  # embedded CHAMP math by default; or a verl parquet file
    data = Dataset.from_list([{"prompt": p.messages, "problem_id": p.problem_id, "answer": p.answer} for p in problems])

    def correct(completions, answer, **kwargs):
        return [math_reward(c[-1]["content"] if isinstance(c, list) else c, a).score for c, a in zip(completions, answer)]

    enable_das(num_speculative_tokens=16, das={"window": 16, "decay": 0.9, "budget": "cost"})  # DAS 2/3, before the trainer
    config = GRPOConfig(output_dir=args.output_dir, max_steps=args.steps, num_generations=8, per_device_train_batch_size=8,
                        max_completion_length=512, temperature=0.6, logging_steps=1, report_to=[],
                        use_vllm=True, vllm_mode="colocate")  # DAS 3/3: colocated vLLM
    GRPOTrainer(model=args.model, reward_funcs=correct, args=config, train_dataset=data).train()


if __name__ == "__main__":
    main()
