"""``das-rollout``: RL-style rollout iterations with the DAS drafter inside vLLM, beside baselines.

Each iteration (one policy version) samples P prompts from a pool of problems, generates n
samples per prompt at temperature T (a GRPO group per prompt), and the DAS drafter keeps the
finished rollouts in its per-problem window for the next iterations. The same iterations run for
every compared method (``none``, ``ngram``, ``suffix``), one engine at a time, with the same
prompts and seeds. The policy is fixed here (no training step); :mod:`integrations.rl.grpo` is the
loop whose policy changes.

Sampling is coupled by default (``--independent-sampling`` turns it off): every rollout's token at
index i is fixed by its sample key (the iteration's seed and its place in the batch) and the
policy's distribution there, whatever the drafts, so the methods generate the same rollouts
wherever their logits agree (float32 on the CPU) and the ratios compare like with like; the report
says how many rollouts were identical in every method.

Timing is side by side: every method's engine is built first and kept, and the iterations
alternate between them (A B C, then C B A, ...), so drift in machine speed falls on every method
alike. Each engine runs one warm-up request when it is built and, once every engine is built, one
untimed batch of the first iteration's shape (:meth:`MethodRun.warm_batch`).

Reported per iteration: wall time, tokens per second, the tail (seconds from 90% of the rollouts
finished to the last one), rollout lengths (p50, p90, max), tokens generated, verification steps (engine steps summed over
requests: output tokens - accepted draft tokens, since every request-step yields exactly one
sampled token plus its accepted drafts), acceptance length (tokens per verification step, bonus
token included), the same in the tail (``tail_acc``: after 90% of the rollouts finished, when few
rows share each step's fixed cost and accepted draft tokens shorten the batch most), drafted and
accepted tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

from das.config import DEFAULTS, DASConfig, das_config
from integrations.data.problems import problem_set_name, problem_source
from integrations.data.registry import data_dir_from_env
from integrations.data.registry import names as data_names
from integrations.results import save_figure
from integrations.vllm_ext import cpu_runtime
from integrations.vllm_ext.engine import METHODS, drop_unavailable
from integrations.vllm_ext.rollouts import tail_acceptance_length
from scheduler import budgets

_FIELDS = DASConfig.model_fields

_USER_KV = bool(os.environ.get("VLLM_CPU_KVCACHE_SPACE"))  # the user's own KV-cache size wins


@dataclasses.dataclass
class IterationResult:
    """What one method did in one rollout iteration."""

    iteration: int
    policy_version: int
    rollouts: int
    wall_time_s: float
    tokens: int  # output tokens generated
    verification_steps: int
    acceptance_length: float  # tokens per verification step, bonus token included
    draft_tokens: int
    accepted_tokens: int
    tokens_per_s: float
    longest_rollout_tokens: int
    mean_rollout_tokens: float
    tail_s: float = 0.0  # seconds from 90% of rollouts finished to the last
    p50_rollout_tokens: float = 0.0
    p90_rollout_tokens: float = 0.0
    capped_rollouts: int = 0  # rollouts that hit max_tokens
    tail_acceptance_length: float = 1.0  # tokens per verification step after 90% of rollouts finished
    tail_row_steps: int = 0  # verification steps of the rollouts still running then (summed over rollouts)
    tail_draft_tokens: int = 0  # draft tokens proposed then
    tail_accepted_tokens: int = 0  # draft tokens accepted then
    timeline: dict[str, list[float]] | None = None  # {"t_s": [...], "running": [...]}, at most ~200 points
    proposer: dict[str, Any] | None = None  # DAS proposer counters for this iteration
    rollout_digests: list[str] | None = None  # integrations.results.rollout_digest of each rollout, in (group, sample) order
    engines: list[dict[str, Any]] | None = None  # --engines N: per engine stats (integrations.rollout_engines)
    makespan_s: float | None = None  # --engines N: first dispatch to last result
    placement: dict[str, Any] | None = None  # --engines N: groups and tokens per engine, and each placement's most tokens on one engine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="das-rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=None,
                   help=f"problems: a data set's name ({', '.join(data_names())}; default champ, embedded math; "
                        "`python -m integrations.data list`) or a file (.parquet verl, .json rLLM LeetCode, .jsonl LeetCodeDataset); "
                        "$DAS_DATA_DIR: a directory of local copies that win")
    p.add_argument("--model", default=None, help="local HF model dir (default: SmolLM2-135M-Instruct, converted once into the cache)")
    p.add_argument("--iterations", type=int, default=3, help="rollout iterations (policy versions)")
    p.add_argument("--prompts", type=int, default=3, help="prompts per iteration (P; the default keeps the main job within ~10 min on a 2-core AVX2 CPU)")
    p.add_argument("--pool", type=int, default=None,
                   help="problems to draw prompts from (default: P, so every iteration revisits them, as epochs over a small train set do)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (n, the GRPO group size)")
    p.add_argument("--max-tokens", type=int, default=1024, help="max output tokens per rollout (1024: long enough for a long tail)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--method", default="das", choices=METHODS, help="the method under test")
    p.add_argument("--compare", default="none",
                   help="comma-separated methods run beside --method ('' for none), e.g. none,suffix,suffix-bs; 'das:<budget>' runs DAS with another --budget")
    p.add_argument("--num-spec-tokens", type=int, default=None, help="K for every speculative method (default: per method)")
    p.add_argument("--window", type=int, default=DEFAULTS.window, help=f"DAS window: {_FIELDS['window'].description} (default %(default)s)")
    p.add_argument("--decay", type=float, default=DEFAULTS.decay, help=f"DAS decay: {_FIELDS['decay'].description} (default %(default)s)")
    p.add_argument("--budget", default=DEFAULTS.budget, metavar="{" + ",".join(budgets.names("proposer")) + "}",
                   help=f"DAS speculation budget (scheduler.budgets; default %(default)s): {budgets.describe('proposer')}")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "float16"),
                   help="model dtype (default: decided from this CPU, see integrations.vllm_ext.cpu_runtime)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0, help="problem choice and sampling seed")
    p.add_argument("--sample-seed", type=int, default=0,
                   help="other random draws on the same problems: iteration v samples with seed * 100003 + v + 7919 * sample_seed")
    add_sampling_args(p)
    add_engine_args(p)
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.add_argument("--trace", default=None, help="write the --method's rollouts to this parquet trace (see integrations.data.trace)")
    p.add_argument("--overwrite", action="store_true", help="replace existing --json / --trace files (default: refuse before the run)")
    args = p.parse_args(argv)
    check_sampling_args(args)
    from integrations.results import check_output_path

    if args.trace and not args.trace.lower().endswith(".parquet"):
        p.error(f"--trace must be a .parquet path, got {args.trace!r}")
    for flag in ("json", "trace"):
        if getattr(args, flag):
            try:
                check_output_path(getattr(args, flag), args.overwrite)
            except ValueError as exc:
                p.error(f"--{flag}: {exc}")
    for name in ("iterations", "prompts", "samples", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    args.data_dir = data_dir_from_env()  # $DAS_DATA_DIR, read here at the entry point and passed on
    try:  # where the problems come from, checked without reading them
        problem_source(args.data, args.data_dir)
    except (OSError, ValueError) as exc:
        p.error(f"--data {args.data!r}: {exc}")
    methods = [args.method] + [m.strip() for m in args.compare.split(",") if m.strip() and m.strip() != args.method]
    bad = [m for m in methods if m.split(":")[0] not in METHODS or (":" in m and not m.startswith("das:"))]
    if bad:
        p.error(f"--compare: unknown methods {bad}; expected some of {list(METHODS)} or das:<budget> with a budget in {list(budgets.names('proposer'))}")
    for m in methods:
        if m.startswith("das:"):
            try:
                budgets.resolve(m[4:], "proposer")
            except ValueError as exc:
                p.error(f"--compare {m}: {exc}")
    args.methods = methods
    if args.coupled_sampling:
        from integrations.vllm_ext.patches.coupled_sampling import unsupported_reason

        if (why := unsupported_reason()) is not None:
            if len(methods) > 1:  # a comparison on different rollouts would pass for like with like
                p.error(f"coupled sampling (the default of --compare): {why}; pass --independent-sampling to compare on independent rollouts")
            args.coupled_sampling = False  # one method: nothing is compared, so nothing is coupled
    if args.num_spec_tokens is not None and args.num_spec_tokens < 1:
        p.error(f"--num-spec-tokens must be >= 1, got {args.num_spec_tokens}")
    try:  # the budget's name in the registry, then the DAS settings' own schema, before any engine starts
        budgets.resolve(args.budget, "proposer")
    except ValueError as exc:
        p.error(f"--budget: {exc}")
    try:
        das_config({"window": args.window, "decay": args.decay, "budget": args.budget}, name=lambda k: f"--{k.replace('_', '-')}")
    except ValueError as exc:
        p.error(str(exc))
    if args.engines < 1:
        p.error(f"--engines must be >= 1, got {args.engines}")
    args.pool = args.pool or args.prompts
    if args.pool < args.prompts:
        p.error(f"--pool ({args.pool}) must be >= --prompts ({args.prompts})")
    return args


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """``--independent-sampling`` (coupled sampling is the default) and ``--coupled-sampling``, kept as a no-op."""
    p.add_argument("--independent-sampling", action="store_true",
                   help="let each method draw its own random numbers, so methods sample other rollouts (default: coupled sampling: "
                        "each rollout's token at index i is fixed by (seed, rollout, i) whatever the drafts, so every method "
                        "generates the same rollouts wherever its logits match bit for bit; lossless; "
                        "integrations.vllm_ext.patches.coupled_sampling)")
    p.add_argument("--coupled-sampling", action="store_true", help="the default; accepted for older command lines")


def check_sampling_args(args: argparse.Namespace) -> None:
    """Set ``args.coupled_sampling``: on unless ``--independent-sampling``."""
    args.coupled_sampling = not args.independent_sampling


def request_coupled_sampling(args: argparse.Namespace) -> str | None:
    """With coupled sampling, name the feature in ``DAS_VLLM_FEATURES`` before any engine starts, so that
    workers in other processes (``VLLM_ENABLE_V1_MULTIPROCESSING=1``) install it at their start too.

    Returns the variable's value before (None: unset), for :func:`restore_features`."""
    from integrations.vllm_ext.patches import FEATURES_ENV

    before = os.environ.get(FEATURES_ENV)
    if args.coupled_sampling:
        features = [f.strip() for f in (before or "").split(",") if f.strip()]
        if "coupled_sampling" not in features:
            os.environ[FEATURES_ENV] = ",".join([*features, "coupled_sampling"])
    return before


def restore_features(before: str | None) -> None:
    """Put ``DAS_VLLM_FEATURES`` back as :func:`request_coupled_sampling` found it (for callers of :func:`main` in-process)."""
    from integrations.vllm_ext.patches import FEATURES_ENV

    if before is None:
        os.environ.pop(FEATURES_ENV, None)
    else:
        os.environ[FEATURES_ENV] = before


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """``--engines``, ``--placement`` and ``--engine-history`` (the multi-engine run, :mod:`integrations.rollout_engines`)."""
    from scheduler.placement import ASSIGNMENTS

    p.add_argument("--engines", type=int, default=1,
                   help="rollout engines (vLLM on Ray workers, each bound to its own cores); 1: one engine in this process (default)")
    p.add_argument("--placement", default="lpt", choices=ASSIGNMENTS,
                   help="with --engines > 1: how GRPO groups go to engines (lpt: longest predicted work first; default %(default)s)")
    p.add_argument("--engine-history", default="shared", choices=("shared", "own"),
                   help="with --engines > 1: das drafters read one shared rollout history (default) or only their own engine's")


def fit_to_problems(args: argparse.Namespace, num_problems: int) -> str | None:
    """Cap ``--pool`` and ``--prompts`` at the number of problems in the data (before any engine loads).

    Returns the warning to print when they were capped, else None.
    """
    if args.pool <= num_problems:
        return None
    asked = (args.prompts, args.pool)
    args.pool = num_problems
    args.prompts = min(args.prompts, num_problems)
    return (f"das-rollout: warning: --prompts {asked[0]} / --pool {asked[1]} exceed the {num_problems} problems in the data: "
            f"using --prompts {args.prompts} --pool {args.pool}")


def iteration_prompts(num_problems: int, args: argparse.Namespace) -> list[list[int]]:
    """Indices of the problems each iteration samples: identical for every method."""
    rng = random.Random(args.seed)
    pool = rng.sample(range(num_problems), min(args.pool, num_problems))
    return [rng.sample(pool, min(args.prompts, len(pool))) for _ in range(args.iterations)]


def sampling_seed(args: argparse.Namespace, version: int) -> int:
    """The torch seed of iteration ``version``'s sampling: ``seed * 100003 + version + 7919 * sample_seed``
    (``--sample-seed`` draws other tokens for the same problems, which ``--seed`` alone chooses;
    an ``args`` without ``sample_seed``, built by a caller rather than parsed, counts as 0)."""
    return args.seed * 100003 + version + 7919 * getattr(args, "sample_seed", 0)


def kv_cache_gib(model: str, rows: int, tokens_per_row: int, dtype: str) -> int:
    """KV cache (GiB, rounded up, >= 1) that holds ``rows`` rollouts of ``tokens_per_row`` tokens, plus 25%.

    Reads layers, KV heads and head size from the model's ``config.json``; returns 0 when it
    cannot (then the CPU default stands).
    """
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        per_token = 2 * int(cfg["num_hidden_layers"]) * int(cfg.get("num_key_value_heads", heads)) * head_dim * (4 if dtype == "float32" else 2)
    except (OSError, KeyError, ValueError, TypeError):
        return 0
    return max(1, -(-int(1.25 * rows * tokens_per_row * per_token) // 2**30))


def workload_kv_gib(model: str, prompts: list[list[int]], schedule: list[list[int]], args: argparse.Namespace) -> int:
    """KV cache per engine for this run's batches (0 off the CPU build, or when the user set it)."""
    if not cpu_runtime.is_cpu_build() or _USER_KV:
        return 0
    longest_prompt = max((len(prompts[i]) for chosen in schedule for i in chosen), default=0)
    return kv_cache_gib(model, args.prompts * args.samples, longest_prompt + args.max_tokens, args.dtype or cpu_runtime.settings().dtype)


class MethodRun:
    """One method's engine, kept across iterations so that methods can alternate.

    ``method`` is a speculative method, or ``das:<budget>`` for DAS with a budget other than ``args.budget``.
    """

    def __init__(self, method: str, model: str, args: argparse.Namespace, kv_gib: int = 0):
        from integrations.vllm_ext.engine import make_llm

        self.name = method
        self.method, _, budget = method.partition(":")
        self.args = args
        das_config = {"window": args.window, "decay": args.decay, "budget": budget or args.budget} if self.method == "das" else None
        saved = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
        if kv_gib and not _USER_KV:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
        try:
            self.llm = make_llm(model, self.method, num_speculative_tokens=args.num_spec_tokens, das_config=das_config,
                                dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed)
        finally:
            if saved is not None:
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved
        from vllm import SamplingParams, TokensPrompt

        # Warm-up: the first steps of an engine (and the drafter's first lookups) pay one-off costs
        # that are not rollout time. Twice, so a second rollout of one prompt drafts from the first.
        for _ in range(2):
            self.llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])], SamplingParams(n=2, temperature=1.0, max_tokens=16), use_tqdm=False)

    def warm_batch(self, prompt_lengths: list[int]) -> None:
        """Prefill one untimed batch of random prompts of ``prompt_lengths`` tokens each (one decode step).

        The first step with a batch of this size after all engines are built pays a one-off cost
        that no method's rollouts should carry: page faults, where the VM backs guest memory
        lazily and a second engine's footprint reaches into memory not touched recently (seconds
        for one step; docs/benchmarks.md, "One-off costs kept out of the timed iterations"). It
        would fall on whichever engine ran first, which is the method under test.
        The prompts are random tokens, marked ``das_warmup`` (the DAS proposer leaves them out of
        its trees and length history); suffix's response cache does keep their 2-token responses.
        """
        from vllm import SamplingParams, TokensPrompt

        try:
            vocab = int(self.llm.llm_engine.model_config.get_vocab_size())
        except Exception:  # noqa: BLE001 - an engine without the attribute: any id of a real vocabulary
            vocab = 32000
        rng = np.random.default_rng(len(prompt_lengths))
        prompts = [TokensPrompt(prompt_token_ids=rng.integers(0, vocab, max(1, n)).tolist()) for n in prompt_lengths]
        self.llm.generate(prompts, SamplingParams(max_tokens=2, temperature=1.0, extra_args={"das_warmup": True}), use_tqdm=False)

    def run_iteration(self, it: int, chosen: list[int], prompts: list[list[int]], problem_ids: list[str], rollouts: list | None = None) -> IterationResult:
        """Generate iteration ``it`` (policy version ``it + 1``) for the problems ``chosen``.

        ``args.samples`` rollouts of each chosen prompt through
        :func:`integrations.vllm_ext.rollouts.generate_rollouts`, seeded with
        ``args.seed * 100003 + version + 7919 * args.sample_seed``; with ``rollouts`` a list, one
        :class:`integrations.data.trace.Rollout` per rollout is appended to it.
        """
        from integrations.vllm_ext import control
        from integrations.vllm_ext.rollouts import generate_rollouts

        args, llm, version = self.args, self.llm, it + 1
        if self.method == "das":
            control.begin_iteration(llm, version)
        batch = generate_rollouts(llm, [prompts[i] for i in chosen], [problem_ids[i] for i in chosen], samples=args.samples,
                                  max_tokens=args.max_tokens, temperature=args.temperature, seed=sampling_seed(args, version),
                                  das=self.method == "das", coupled=getattr(args, "coupled_sampling", False))
        from integrations.results import rollout_digest

        lengths = np.array([len(r.output_ids) for r in batch.rollouts])
        if rollouts is not None:
            from integrations.data.trace import Rollout

            for r in batch.rollouts:
                rollouts.append(Rollout(it, version, r.problem_id, r.sample, list(r.prompt_ids), list(r.output_ids), r.finish_reason))
        tokens = batch.tokens
        steps = batch.verification_steps
        stride = max(1, len(batch.step_s) // 200)
        keep = sorted(set(range(0, len(batch.step_s), stride)) | {len(batch.step_s) - 1}) if len(batch.step_s) else []
        wall = batch.wall_time_s
        return IterationResult(
            iteration=it, policy_version=version, rollouts=len(lengths), wall_time_s=round(wall, 3), tokens=tokens,
            verification_steps=steps, acceptance_length=round(tokens / max(steps, 1), 4),
            draft_tokens=batch.draft_tokens, accepted_tokens=batch.accepted_tokens,
            tokens_per_s=round(tokens / wall, 2), longest_rollout_tokens=int(lengths.max()), mean_rollout_tokens=round(tokens / len(lengths), 1),
            tail_s=round(batch.tail_time_s(), 3), p50_rollout_tokens=float(np.percentile(lengths, 50)),
            p90_rollout_tokens=float(np.percentile(lengths, 90)), capped_rollouts=int((lengths >= args.max_tokens).sum()),
            tail_acceptance_length=round(batch.tail_acceptance_length, 4), tail_row_steps=batch.tail_row_steps,
            tail_draft_tokens=batch.tail_draft_tokens, tail_accepted_tokens=batch.tail_accepted_tokens,
            timeline={"t_s": [round(float(batch.step_s[i]), 3) for i in keep], "running": [int(batch.running[i]) for i in keep]},
            proposer=batch.proposer, rollout_digests=[rollout_digest(r.output_ids) for r in batch.rollouts],
        )

    def close(self) -> None:
        from integrations.vllm_ext.engine import close_llm, release_engine_state

        close_llm(self.llm)  # the engine core stops here even if a reference to the engine remains
        del self.llm  # the last reference, before the parallel state goes
        release_engine_state()


def run_side_by_side(methods: list[str], model: str, prompts: list[list[int]], problem_ids: list[str], schedule: list[list[int]],
                     args: argparse.Namespace, progress=None, trace_method: str | None = None, rollouts: list | None = None,
                     kv_gib: int | None = None) -> dict[str, list[IterationResult]]:
    """Every iteration of ``schedule`` for every method, alternating their order (A B, B A, ...).

    ``kv_gib``: KV cache per engine (CPU build; None: :func:`workload_kv_gib`). Returns
    ``{method: [IterationResult per iteration]}``; the rollouts of ``trace_method`` are appended
    to ``rollouts`` when it is a list.
    """
    kv = workload_kv_gib(model, prompts, schedule, args) if kv_gib is None else kv_gib
    runs: dict[str, MethodRun] = {}
    results: dict[str, list[IterationResult]] = {m: [] for m in methods}
    try:
        for m in methods:
            runs[m] = MethodRun(m, model, args, kv)
        if schedule:
            first = [len(prompts[i]) for i in schedule[0] for _ in range(args.samples)]
            for m in methods:
                runs[m].warm_batch(first)
        for it, chosen in enumerate(schedule):
            for m in (methods if it % 2 == 0 else methods[::-1]):
                r = runs[m].run_iteration(it, chosen, prompts, problem_ids, rollouts if m == trace_method else None)
                results[m].append(r)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix_str(f"{m} it{it}: {r.tokens_per_s:.0f} tok/s, {r.acceptance_length:.2f} tok/step, tail {r.tail_s:.1f}s")
    finally:
        for run in runs.values():
            run.close()
    return results


def run_method(method: str, model: str, prompts: list[list[int]], problem_ids: list[str], schedule: list[list[int]], args, progress=None,
               rollouts: list | None = None) -> list[IterationResult]:
    """Every iteration of ``schedule`` with one engine of ``method`` (see :func:`run_side_by_side`)."""
    return run_side_by_side([method], model, prompts, problem_ids, schedule, args, progress, method, rollouts)[method]


def plot_timelines(report: dict[str, Any], path: str | Path) -> Path | None:
    """PNG of rollouts still running over time, per iteration, one line per method (DAS paper Fig. 1)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    methods = report["methods"]
    iters = max(len(m["iterations"]) for m in methods.values())
    fig, axes = plt.subplots(1, iters, figsize=(4.2 * iters, 3.4), squeeze=False, sharey=True)
    for i, ax in enumerate(axes[0]):
        for name, m in methods.items():
            if i < len(m["iterations"]) and m["iterations"][i].get("timeline"):
                tl = m["iterations"][i]["timeline"]
                ax.step(tl["t_s"], tl["running"], where="post", label=f"{name} ({m['iterations'][i]['tokens_per_s']:.0f} tok/s)")
        ax.set_title(f"iteration {i}")
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("rollouts running")
    fig.suptitle(report.get("title", "running rollouts over time"), fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)


def format_table(report: dict[str, Any]) -> str:
    """The per-iteration table plus a per-method summary, as text (tabulate)."""
    from tabulate import tabulate

    rows = []
    for name, m in report["methods"].items():
        for r in m["iterations"]:
            rows.append([name, r["iteration"], r["wall_time_s"], r["tokens"], r["tokens_per_s"], r.get("tail_s", 0.0),
                         r.get("p50_rollout_tokens", 0), r.get("p90_rollout_tokens", 0), r["longest_rollout_tokens"],
                         r["verification_steps"], r["acceptance_length"], r.get("tail_acceptance_length", 1.0), r["draft_tokens"],
                         r["accepted_tokens"]])
    head = ["method", "iter", "wall_s", "tokens", "tok/s", "tail_s", "p50_len", "p90_len", "max_len", "steps", "acc_len", "tail_acc",
            "drafted", "accepted"]
    summary = []
    for name, m in report["methods"].items():
        s = m["summary"]
        summary.append([name, s["wall_time_s"], s["tokens"], s["tokens_per_s"], s.get("tail_s", 0.0), s["acceptance_length"],
                        s.get("tail_acceptance_length", 1.0), _ratio(s.get("speedup_vs_none")), _ratio(s.get("tokens_per_s_vs_none")),
                        _ratio(s.get("speedup_vs_suffix")), _ratio(s.get("tokens_per_s_vs_suffix"))])
    shead = ["method", "wall_s", "tokens", "tok/s", "tail_s", "acc_len", "tail_acc", "wall_vs_none", "tok/s_vs_none", "wall_vs_suffix",
             "tok/s_vs_suffix"]
    text = tabulate(rows, head, floatfmt=".2f") + "\n\n" + tabulate(summary, shead, floatfmt=".2f")
    line = identical_line(report)
    return text + ("\n\n" + line if line else "")


def identical_line(report: dict[str, Any]) -> str:
    """One line: how many rollouts every method generated alike, and how sampling was done ("" for one method)."""
    same = report.get("identical_rollouts")
    if not same or len(report["methods"]) < 2:
        return ""
    mode = "coupled sampling" if report.get("coupled_sampling") else "independent sampling (--independent-sampling)"
    per = ", ".join(f"{m} {k}" for m, k in same["vs_first"].items())
    return (f"identical rollouts in every method: {same['identical']} of {same['rollouts']} ({mode}; "
            f"the same as {next(iter(report['methods']))}'s: {per}); wall_vs_* is the ratio of wall-clock seconds, tok/s_vs_* of tokens per second")


def compare_methods(report: dict[str, Any]) -> None:
    """Add to ``report`` (``methods.<m>.summary`` filled) what compares the methods: per method the ratios of
    wall-clock seconds (``speedup_vs_none``, ``speedup_vs_suffix``: the other's seconds over this one's) and of
    tokens per second (``tokens_per_s_vs_none``, ``tokens_per_s_vs_suffix``), None where that method did not run;
    and ``identical_rollouts`` (:func:`integrations.results.identical_rollouts`, the method under test first)."""
    from integrations.results import identical_rollouts

    methods = report["methods"]
    for ref in ("none", "suffix"):
        base = methods.get(ref)
        for m in methods.values():
            s = m["summary"]
            s[f"speedup_vs_{ref}"] = round(base["summary"]["wall_time_s"] / s["wall_time_s"], 3) if base and s["wall_time_s"] else None
            s[f"tokens_per_s_vs_{ref}"] = (round(s["tokens_per_s"] / base["summary"]["tokens_per_s"], 3)
                                           if base and base["summary"]["tokens_per_s"] else None)
    digests = {name: [r.get("rollout_digests") or [] for r in m["iterations"]] for name, m in methods.items()}
    report["identical_rollouts"] = identical_rollouts(digests)


def _ratio(x: float | None) -> str:
    return f"{x:.2f}x" if x else "-"


def summarize(iterations: list[dict[str, Any]]) -> dict[str, Any]:
    wall = sum(r["wall_time_s"] for r in iterations)
    tokens = sum(r["tokens"] for r in iterations)
    steps = sum(r["verification_steps"] for r in iterations)
    tail_steps = sum(r.get("tail_row_steps", 0) for r in iterations)
    tail_acc = sum(r.get("tail_accepted_tokens", 0) for r in iterations)
    return {"wall_time_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 2) if wall else 0.0,
            "tail_s": round(sum(r.get("tail_s", 0.0) for r in iterations), 3), "acceptance_length": round(tokens / max(steps, 1), 4),
            "tail_acceptance_length": round(tail_acceptance_length(tail_steps, tail_acc), 4)}


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # run as a command: preload Intel OpenMP (re-executes this process once)
        cpu_runtime.reexec_with_iomp()
    args = parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the table readable; set it to see vLLM's logs
    features = request_coupled_sampling(args)
    try:
        return run_main(args, argv)
    finally:
        restore_features(features)


def run_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    """:func:`main` after its arguments are parsed and the engine's environment is set."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from integrations.data.models import resolve_model
    from integrations.data.problems import load_problems, render_prompts

    args.methods = drop_unavailable(args.methods, "das-rollout")
    try:
        problems = load_problems(args.data, data_dir=args.data_dir)
        capped = fit_to_problems(args, len(problems))
        if capped:
            print(capped, file=sys.stderr)
        model = resolve_model(args.model)
    except (OSError, ValueError, KeyError) as exc:
        print(f"das-rollout: error: {exc}", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(model)
    schedule = iteration_prompts(len(problems), args)
    used = sorted({i for chosen in schedule for i in chosen})
    prompt_ids = render_prompts([problems[i] for i in used], tokenizer)
    prompts = {i: ids for i, ids in zip(used, prompt_ids)}
    all_prompts = [prompts.get(i, []) for i in range(len(problems))]
    problem_ids = [p.problem_id for p in problems]
    chosen = cpu_runtime.apply_cpu_defaults(args.dtype)
    kv = workload_kv_gib(model, all_prompts, schedule, args)
    if chosen is not None and kv:
        chosen.kvcache_gib = kv
        chosen.reasons["kv_cache"] = f"sized to {args.prompts * args.samples} rollouts of up to {args.max_tokens} tokens, per engine"
    settings = chosen.as_dict() if chosen is not None else {"device": "cuda"}
    if chosen is not None:
        print(chosen.header())
    from integrations.results import provenance

    report: dict[str, Any] = {**provenance("das-rollout", argv), "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                              "model": model, "cpu_settings": settings, "coupled_sampling": args.coupled_sampling, "methods": {}}
    record: list | None = [] if args.trace else None
    with tqdm(total=len(args.methods) * args.iterations, desc="rollout iterations", unit="it", file=sys.stderr) as bar:
        if args.engines > 1:
            from integrations.rollout_engines import run_engines

            fields = run_engines(args.methods, model, all_prompts, problem_ids, schedule, args, progress=bar, trace_method=args.method,
                                 rollouts=record, kv_gib=kv, seed_of=lambda version: sampling_seed(args, version))
            results = {m: [IterationResult(**f) for f in fs] for m, fs in fields.items()}
        else:
            results = run_side_by_side(args.methods, model, all_prompts, problem_ids, schedule, args, progress=bar,
                                       trace_method=args.method, rollouts=record, kv_gib=kv)
    if record is not None:
        from integrations.data.trace import write_trace

        write_trace(args.trace, record, overwrite=args.overwrite)
    for method in args.methods:
        its = [dataclasses.asdict(r) for r in results[method]]
        report["methods"][method] = {"iterations": its, "summary": summarize(its)}
    compare_methods(report)
    report["title"] = f"{problem_set_name(args.data)}: {args.prompts} prompts x {args.samples} samples, {args.max_tokens} tokens max"
    print(format_table(report))
    if args.engines > 1:
        from integrations.rollout_engines import format_engines

        print("\n" + format_engines(report))
    if args.json:
        from integrations.results import write_atomic

        write_atomic(args.json, json.dumps(report, indent=2))
        print(f"wrote {args.json}")
        png = plot_timelines(report, Path(args.json).with_suffix(".png"))
        if png is not None:
            print(f"wrote {png}")
    if args.trace:
        print(f"wrote {args.trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
