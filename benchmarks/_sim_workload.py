"""Workload and hardware constants of the long-tail simulator (benchmarks.simulate).

Everything here is a stated assumption or a first-principles number; each constant says where it
comes from. Replace the length model by a fit to a real trace with :func:`fit_length_model`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

# ----------------------------------------------------------------------------- hardware / model
# DeepSeek-R1-Distill-Qwen-7B = Qwen2.5-Math-7B architecture (its config.json): 28 layers,
# hidden 3584, MLP 18944, 28 query heads, 4 KV heads of 128, vocab 152064, untied LM head, bf16.
QWEN7B = dict(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, head_dim=128, vocab=152064, bytes_per_param=2)
# H100 SXM5 80 GB data sheet: HBM3 3.35 TB/s, dense BF16 989 TFLOP/s, 80 GiB.
H100 = dict(hbm_bytes_per_s=3.35e12, bf16_flops=989e12, memory_bytes=80 * 2**30)


def h100_7b_costs(
    *,
    hbm_efficiency: float = 0.8,
    mfu: float = 0.6,
    step_overhead_s: float = 1.0e-3,
    gpu_memory_utilization: float = 0.8,
    workspace_bytes: float = 3e9,
) -> dict:
    """Per-step cost constants of a 7B model on one H100, from first principles.

    * ``c_base`` = bytes of weights read per step / achievable HBM bandwidth + per-step overhead.
      Weights read per step: every matrix but the embedding table (a gather): 7.07e9 params x 2 B
      = 14.1 GB; bandwidth 3.35 TB/s x ``hbm_efficiency`` 0.8 (what memory-bound GEMV kernels
      reach) = 2.68 TB/s -> 5.3 ms; plus ``step_overhead_s`` 1 ms (scheduler, sampler, launches:
      an assumption) -> 6.3 ms, in line with the ~6-7 ms per token that vLLM serves a 7-8B bf16
      model at batch 1 on an H100.
    * ``c_tok`` = FLOPs per token / achievable FLOP/s: 2 x 7.07e9 matmul params = 14.1 GFLOP per
      token, at 989 TFLOP/s x ``mfu`` 0.6 = 593 TFLOP/s -> 23.9 us per token in the pass.
    * ``c_ctx`` = KV-cache bytes read per context token per step / bandwidth: 2 (K, V) x 28 layers
      x 4 KV heads x 128 x 2 B = 57,344 B -> 21.4 ns per token of context per step.
    * ``kv_capacity_tokens`` = (80 GiB x ``gpu_memory_utilization`` 0.8 - 15.2 GB weights - 3 GB
      activations / workspace) / 57,344 B per token = 880k tokens (an assumption: verl's rollout
      memory fraction varies from 0.5 to 0.9 between recipes).

    Returns:
        dict with ``c_base`` (s), ``c_tok`` (s / token), ``c_ctx`` (s / context token / step),
        ``kv_capacity_tokens`` (int), and the intermediate numbers under ``derivation``.
    """
    m = QWEN7B
    per_layer = (
        m["hidden"] * m["heads"] * m["head_dim"] * 2  # q, o
        + m["hidden"] * m["kv_heads"] * m["head_dim"] * 2  # k, v
        + 3 * m["hidden"] * m["intermediate"]  # gate, up, down
    )
    matmul_params = m["layers"] * per_layer + m["vocab"] * m["hidden"]  # + LM head
    total_params = matmul_params + m["vocab"] * m["hidden"]  # + embedding table
    bw = H100["hbm_bytes_per_s"] * hbm_efficiency
    weight_read = matmul_params * m["bytes_per_param"]
    kv_per_token = 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * m["bytes_per_param"]
    flops_per_token = 2 * matmul_params
    kv_bytes = H100["memory_bytes"] * gpu_memory_utilization - total_params * m["bytes_per_param"] - workspace_bytes
    return {
        "c_base": weight_read / bw + step_overhead_s,
        "c_tok": flops_per_token / (H100["bf16_flops"] * mfu),
        "c_ctx": kv_per_token / bw,
        "kv_capacity_tokens": int(kv_bytes // kv_per_token),
        "derivation": {
            "matmul_params": matmul_params,
            "total_params": total_params,
            "weight_bytes_read_per_step": weight_read,
            "hbm_bytes_per_s_achieved": bw,
            "step_overhead_s": step_overhead_s,
            "flops_per_token": flops_per_token,
            "flops_per_s_achieved": H100["bf16_flops"] * mfu,
            "kv_bytes_per_token": kv_per_token,
            "kv_cache_bytes": kv_bytes,
        },
    }


# ----------------------------------------------------------------------------- lengths
@dataclass
class LengthModel:
    """Rollout output lengths of one problem group: a per-problem lognormal, a runaway mode, a cap.

    ``log L = mu_p + sigma_within * z`` with ``mu_p = log(median) + sigma_between * z_p`` per
    problem; with probability ``runaway_p = min(0.5, runaway * exp(runaway_slope * (mu_p -
    log(median))))`` a sample instead runs to ``max_tokens`` (reasoning models that loop until
    the cap; harder problems loop more); everything is capped at ``max_tokens`` (finish reason
    ``length``).

    The defaults are NOT a fit to a measured trace (none of a 7B model exists here); they are
    chosen to give the summary statistics reported for DeepSeek-R1-Distill-Qwen-7B on
    DeepScaleR-style math at a 16K cap (mean ~6K tokens, median ~4.5K, 6-8% of rollouts hitting
    the cap; DeepScaleR's blog reports ~5.5K mean for the 1.5B distill at 8K, incorrect answers
    ~3x longer than correct ones) and the long tail the DAS paper plots. :func:`fit_length_model`
    replaces them by a fit to a rollout trace.
    """

    median: float = 4500.0
    sigma_between: float = 0.55
    sigma_within: float = 0.45
    runaway: float = 0.025
    runaway_slope: float = 1.5
    max_tokens: int = 16384
    min_tokens: int = 64

    def sample_problems(self, n_problems: int, rng: np.random.Generator) -> np.ndarray:
        """Per-problem log-medians ``mu_p`` (float64 ``[P]``)."""
        return math.log(self.median) + self.sigma_between * rng.standard_normal(n_problems)

    def sample(self, mu: np.ndarray, n_samples: int, rng: np.random.Generator) -> np.ndarray:
        """Lengths ``[P, n_samples]`` (int64 tokens) of one group per problem log-median ``mu``."""
        p = len(mu)
        logl = mu[:, None] + self.sigma_within * rng.standard_normal((p, n_samples))
        lengths = np.exp(logl)
        run_p = np.minimum(0.5, self.runaway * np.exp(self.runaway_slope * (mu - math.log(self.median))))
        runaway = rng.random((p, n_samples)) < run_p[:, None]
        lengths = np.where(runaway, self.max_tokens, lengths)
        return np.clip(np.rint(lengths), self.min_tokens, self.max_tokens).astype(np.int64)

    def as_dict(self) -> dict:
        return asdict(self)


def length_stats(lengths: np.ndarray, max_tokens: int) -> dict:
    """Summary of a length array: mean, median, p90, p99, max, share at the cap."""
    x = np.asarray(lengths, np.float64).ravel()
    return {
        "n": int(x.size),
        "mean": float(x.mean()),
        "median": float(np.median(x)),
        "p90": float(np.percentile(x, 90)),
        "p99": float(np.percentile(x, 99)),
        "max": float(x.max()),
        "capped_share": float(np.mean(x >= max_tokens)),
        "share_of_tokens_in_longest_10pct": float(np.sort(x)[::-1][: max(1, x.size // 10)].sum() / x.sum()),
    }


def fit_length_model(groups: list[np.ndarray], max_tokens: int) -> LengthModel:
    """Fit :class:`LengthModel` to groups of lengths (one array per problem group).

    Method of moments on log lengths below the cap: ``median`` = exp(mean of group means),
    ``sigma_between`` = std of group means, ``sigma_within`` = pooled within-group std;
    ``runaway`` = share of lengths at the cap (slope kept at its default). Censoring at the cap is
    ignored, so the lognormal part is slightly too short and ``runaway`` slightly too large.

    Raises:
        ValueError: fewer than 2 groups with 2+ uncapped lengths.
    """
    means, within, capped, total = [], [], 0, 0
    for g in groups:
        g = np.asarray(g, np.float64)
        total += g.size
        capped += int(np.sum(g >= max_tokens))
        u = np.log(np.maximum(g[g < max_tokens], 1.0))
        if u.size >= 2:
            means.append(u.mean())
            within.append(((u - u.mean()) ** 2).sum() / (u.size - 1))
    if len(means) < 2:
        raise ValueError(f"fit_length_model needs >= 2 groups with >= 2 uncapped lengths, got {len(means)}")
    return LengthModel(
        median=float(math.exp(np.mean(means))),
        sigma_between=float(np.std(means, ddof=1)),
        sigma_within=float(math.sqrt(np.mean(within))),
        runaway=float(capped / max(total, 1)),
        max_tokens=int(max_tokens),
        min_tokens=1,
    )


# ----------------------------------------------------------------------------- acceptance
@dataclass
class AcceptanceModel:
    """Eq. 3 parameters per request: ``k`` (capacity) and ``a`` (efficiency).

    ``k ~ Beta`` with mean ``k_mean`` and concentration ``k_conc``, shared half by the problem
    (its history tree) and half by the sample; ``a`` lognormal around ``a_median``; ``k * a <= 1``.
    Defaults: ``k_mean`` 0.6, ``a_median`` 1.0 give 2.06 tokens per step at 4 drafts and 2.49
    at 16: the range measured for suffix drafting on this machine (SmolLM2, 2.05-2.29 tokens per
    step; ../shared/REFERENCES.md). No acceptance numbers of a 7B model on DSR-sub are published.
    """

    k_mean: float = 0.6
    k_conc: float = 20.0
    a_median: float = 1.0
    a_sigma: float = 0.3

    def sample(self, n_problems: int, n_samples: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``(k, a)``: float64 ``[P, n_samples]``."""
        kp = rng.beta(self.k_mean * self.k_conc, (1 - self.k_mean) * self.k_conc, n_problems)
        ks = rng.beta(self.k_mean * self.k_conc, (1 - self.k_mean) * self.k_conc, (n_problems, n_samples))
        k = np.clip(0.5 * kp[:, None] + 0.5 * ks, 0.01, 0.95)
        a = self.a_median * np.exp(self.a_sigma * rng.standard_normal((n_problems, n_samples)))
        return k, np.minimum(a, 1.0 / k)

    def as_dict(self) -> dict:
        return asdict(self)


def prompt_lengths(n: int, rng: np.random.Generator, data: str | Path | None = None) -> np.ndarray:
    """Prompt tokens of ``n`` problems drawn from DSR-sub (``../shared/data/dsr_sub.parquet``):
    characters / 3.5 + 16 template tokens (the Qwen tokenizer is not available here); 110 tokens
    each when the file is missing."""
    path = Path(data) if data else Path(__file__).resolve().parents[2] / "shared" / "data" / "dsr_sub.parquet"
    try:
        import pyarrow.parquet as pq

        rows = pq.read_table(path, columns=["prompt"]).column("prompt").to_pylist()
        chars = np.array([sum(len(m["content"]) for m in r) for r in rows], np.float64)
        return np.rint(chars[rng.integers(0, chars.size, n)] / 3.5 + 16).astype(np.int64)
    except Exception:
        return np.full(n, 110, np.int64)
