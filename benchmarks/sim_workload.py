"""Workload and hardware constants of the long-tail simulator (benchmarks.simulate).

Everything here is a stated assumption or a first-principles number; each constant says where it
comes from. Replace the length model by a fit to a real trace with :func:`fit_length_model`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from scheduler.predictor import LengthPredictor

# ----------------------------------------------------------------------------- hardware / model
# DeepSeek-R1-Distill-Qwen-7B = Qwen2.5-Math-7B architecture (its public config.json): 28 layers,
# hidden 3584, MLP 18944, 28 query heads, 4 KV heads of 128, vocab 152064, untied LM head, bf16.
# That is 7.6e9 parameters = 15.2 GB of bf16 weights, and K + V of 28 layers x 4 KV heads x 128 x
# 2 bytes = 57,344 bytes per token of context (the model-config figure for Qwen2-7B-style GQA).
QWEN7B = dict(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, head_dim=128, vocab=152064, bytes_per_param=2)
# H100 SXM5 80 GB public spec sheet: HBM3 3.35 TB/s, dense BF16 989 TFLOP/s (no sparsity), 80 GB.
H100 = dict(hbm_bytes_per_s=3.35e12, bf16_flops=989e12, memory_bytes=80 * 2**30)


@dataclass(frozen=True)
class Roofline:
    """Roofline cost of one engine step on one GPU (seconds).

    ``t = launch_s + max(t_compute, t_memory)`` with
    ``t_compute = (flops_per_token * tokens + attn_flops * attention_pairs) / flops_per_s`` and
    ``t_memory = (weight_bytes + kv_bytes_per_token * kv_tokens) / bytes_per_s``: a decode step is
    bounded by the larger of its arithmetic and its memory traffic (weights once, plus the KV cache
    of every running request), not by their sum. ``tokens`` = tokens in the forward pass (sampled,
    drafted and prefilled); ``attention_pairs`` = sum over query tokens of the context they attend
    to; ``kv_tokens`` = KV-cache tokens read and written.
    """

    launch_s: float
    weight_bytes: float
    kv_bytes_per_token: float
    flops_per_token: float
    attn_flops_per_pair: float
    bytes_per_s: float
    flops_per_s: float
    kv_capacity_tokens: int

    def step_time(self, tokens, attention_pairs, kv_tokens):
        """Seconds of one step (float or array; the arguments broadcast)."""
        comp = (self.flops_per_token * np.asarray(tokens, np.float64) + self.attn_flops_per_pair * np.asarray(attention_pairs, np.float64)) / self.flops_per_s
        mem = (self.weight_bytes + self.kv_bytes_per_token * np.asarray(kv_tokens, np.float64)) / self.bytes_per_s
        out = self.launch_s + np.maximum(comp, mem)
        return float(out) if np.ndim(out) == 0 else out

    def decode_step_time(self, rows, drafts_per_row, context_per_row):
        """A decode step of ``rows`` requests with ``context_per_row`` tokens of KV each, every row
        verifying ``drafts_per_row`` draft tokens (the row's sampled token included in ``1 + d``)."""
        q = np.asarray(rows, np.float64) * (1.0 + np.asarray(drafts_per_row, np.float64))
        ctx = np.asarray(rows, np.float64) * np.asarray(context_per_row, np.float64)
        return self.step_time(q, q * np.asarray(context_per_row, np.float64), ctx + q)

    def free_draft_tokens(self, rows, context_tokens) -> float:
        """Draft tokens a decode step of ``rows`` rows (``context_tokens`` of KV in all) can add
        before its compute time reaches its memory time (the roofline knee): drafts below it cost
        (almost) nothing."""
        if rows <= 0:
            return 0.0
        mem = (self.weight_bytes + self.kv_bytes_per_token * (context_tokens + rows)) / self.bytes_per_s
        comp = (self.flops_per_token * rows + self.attn_flops_per_pair * context_tokens) / self.flops_per_s
        per_tok = (self.flops_per_token + self.attn_flops_per_pair * context_tokens / rows) / self.flops_per_s
        return max(0.0, (mem - comp) / per_tok)

    def as_dict(self) -> dict:
        return asdict(self)


def h100_7b_roofline(
    *,
    hbm_efficiency: float = 0.8,
    mfu: float = 0.6,
    launch_s: float = 1.0e-3,
    gpu_memory_utilization: float = 0.8,
    workspace_bytes: float = 3e9,
) -> Roofline:
    """:class:`Roofline` of DeepSeek-R1-Distill-Qwen-7B (bf16) on one H100 SXM.

    * weights read per step: every matrix but the embedding table (a gather): 7.07e9 params x 2 B
      = 14.1 GB (15.2 GB resident with the embedding);
    * KV: 57,344 B per token (2 x 28 layers x 4 KV heads x 128 x 2 B);
    * FLOPs: 2 x 7.07e9 = 14.1 GFLOP per token in the pass; attention 4 x 28 layers x 28 heads x 128
      = 401,408 FLOP per (query token, context token) pair (QK^T and PV);
    * achieved rates: ``hbm_efficiency`` 0.8 of 3.35 TB/s (what memory-bound GEMV and paged
      attention kernels reach) and ``mfu`` 0.6 of 989 TFLOP/s (large bf16 GEMMs): assumptions;
    * ``launch_s`` 1 ms per step (scheduler, sampler, CUDA-graph launches): an assumption;
    * KV capacity: (80 GiB x ``gpu_memory_utilization`` 0.8 - 15.2 GB weights - 3 GB workspace) /
      57,344 B = 880k tokens (an assumption: verl's rollout memory fraction is 0.5-0.9 by recipe).
    """
    m = QWEN7B
    per_layer = (
        m["hidden"] * m["heads"] * m["head_dim"] * 2  # q, o
        + m["hidden"] * m["kv_heads"] * m["head_dim"] * 2  # k, v
        + 3 * m["hidden"] * m["intermediate"]  # gate, up, down
    )
    matmul_params = m["layers"] * per_layer + m["vocab"] * m["hidden"]  # + LM head
    total_params = matmul_params + m["vocab"] * m["hidden"]  # + embedding table
    kv_per_token = 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * m["bytes_per_param"]
    kv_bytes = H100["memory_bytes"] * gpu_memory_utilization - total_params * m["bytes_per_param"] - workspace_bytes
    return Roofline(
        launch_s=float(launch_s),
        weight_bytes=float(matmul_params * m["bytes_per_param"]),
        kv_bytes_per_token=float(kv_per_token),
        flops_per_token=float(2 * matmul_params),
        attn_flops_per_pair=float(4 * m["layers"] * m["heads"] * m["head_dim"]),
        bytes_per_s=H100["hbm_bytes_per_s"] * hbm_efficiency,
        flops_per_s=H100["bf16_flops"] * mfu,
        kv_capacity_tokens=int(kv_bytes // kv_per_token),
    )


def fit_linear_cost(roof: Roofline, *, max_rows: int = 256, max_draft: int = 16) -> dict:
    """Eq. 1 (``t = c_base + c_tok * n_tokens``) fitted by least squares to roofline step times
    over a profile grid, as DAS fits it offline: rows 1..``max_rows`` (powers of 2), 0..``max_draft``
    drafts per row (powers of 2), 1K / 4K / 8K context per row (capped at the KV capacity).

    Returns:
        ``{"c_base", "c_tok", "mean_rel_error", "points"}`` (seconds, seconds per token).
    """
    rows = 2.0 ** np.arange(0, int(math.log2(max_rows)) + 1)
    drafts = np.concatenate([[0.0], 2.0 ** np.arange(0, int(math.log2(max(max_draft, 1))) + 1)])
    ctxs = np.array([1024.0, 4096.0, 8192.0])
    r, d, c = (x.ravel() for x in np.meshgrid(rows, drafts, ctxs, indexing="ij"))
    ok = r * c <= roof.kv_capacity_tokens
    r, d, c = r[ok], d[ok], c[ok]
    t = roof.decode_step_time(r, d, c)
    n = r * (1.0 + d)
    x = np.stack([np.ones_like(n), n], axis=1)
    coef, *_ = np.linalg.lstsq(x, t, rcond=None)
    c_base, c_tok = max(float(coef[0]), 1e-6), max(float(coef[1]), 0.0)
    err = np.abs(c_base + c_tok * n - t) / t
    return {"c_base": c_base, "c_tok": c_tok, "mean_rel_error": float(err.mean()), "points": int(n.size)}


def h100_7b_costs(
    *,
    hbm_efficiency: float = 0.8,
    mfu: float = 0.6,
    step_overhead_s: float = 1.0e-3,
    gpu_memory_utilization: float = 0.8,
    workspace_bytes: float = 3e9,
) -> dict:
    """The additive (linear) per-step constants of the same model and GPU, kept for the cost-model
    priors and for comparison with :class:`Roofline` (``c_base + c_tok * n + c_ctx * context``
    overcharges a decode step that is memory-bound: it adds compute and memory time).

    Returns:
        dict with ``c_base`` (s), ``c_tok`` (s / token), ``c_ctx`` (s / context token / step),
        ``kv_capacity_tokens`` (int), and the intermediate numbers under ``derivation``.
    """
    roof = h100_7b_roofline(hbm_efficiency=hbm_efficiency, mfu=mfu, launch_s=step_overhead_s, gpu_memory_utilization=gpu_memory_utilization,
                            workspace_bytes=workspace_bytes)
    return {
        "c_base": roof.weight_bytes / roof.bytes_per_s + step_overhead_s,
        "c_tok": roof.flops_per_token / roof.flops_per_s,
        "c_ctx": roof.kv_bytes_per_token / roof.bytes_per_s,
        "kv_capacity_tokens": roof.kv_capacity_tokens,
        "derivation": {
            "weight_bytes_read_per_step": roof.weight_bytes,
            "hbm_bytes_per_s_achieved": roof.bytes_per_s,
            "step_overhead_s": step_overhead_s,
            "flops_per_token": roof.flops_per_token,
            "flops_per_s_achieved": roof.flops_per_s,
            "kv_bytes_per_token": roof.kv_bytes_per_token,
        },
    }


# ----------------------------------------------------------------------------- lengths
@dataclass
class LengthModel:
    """Rollout output lengths of one problem group: a per-problem lognormal, a runaway mode, a cap.

    ``log L = mu_p + sigma_within * z`` with ``mu_p = log(median) + sigma_between * z_p`` per
    problem; with probability ``runaway_p = min(0.5, runaway * exp(runaway_slope * (mu_p -
    log(median))))`` a sample instead falls into a repetition loop and runs to ``max_tokens``
    (harder problems loop more); everything is capped at ``max_tokens`` (finish reason ``length``).
    A looping sample reasons like any other up to its lognormal length, then repeats itself from
    there to the cap (:meth:`sample_detail` ``loop_at``): that is where drafting from its own
    output is accepted almost entirely.

    The defaults are an ASSUMPTION, not a fit: no per-rollout lengths of this model on DSR-sub are
    available here, and the paper gives no distribution, only its long tail (a few stragglers set
    the makespan) and the 16K cap. They give mean ~5.9K, median ~4.6K, p90 ~12.5K tokens and ~6.5%
    of rollouts at the cap (about half of them loops, half reasoning cut off by the cap).
    :func:`fit_length_model` replaces them by a fit to a rollout trace (``--trace``).
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

    def sample_detail(self, mu: np.ndarray, n_samples: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Lengths ``[P, n_samples]`` (int64 tokens) and loop onsets (float64 tokens; ``inf`` for a
        sample that never loops) of one group per problem log-median ``mu``."""
        p = len(mu)
        logl = mu[:, None] + self.sigma_within * rng.standard_normal((p, n_samples))
        natural = np.clip(np.rint(np.exp(logl)), self.min_tokens, None)
        run_p = np.minimum(0.5, self.runaway * np.exp(self.runaway_slope * (mu - math.log(self.median))))
        runaway = rng.random((p, n_samples)) < run_p[:, None]
        lengths = np.where(runaway, self.max_tokens, np.minimum(natural, self.max_tokens))
        loop_at = np.where(runaway & (natural < self.max_tokens), natural, np.inf)
        return lengths.astype(np.int64), loop_at

    def sample(self, mu: np.ndarray, n_samples: int, rng: np.random.Generator) -> np.ndarray:
        """Lengths ``[P, n_samples]`` (int64 tokens) of one group per problem log-median ``mu``."""
        return self.sample_detail(mu, n_samples, rng)[0]

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
    """Acceptance of the drafter for each request, as a function of the request's state.

    Three parts (the truth the simulated engine uses; the policies only see counts):

    * **Base** (Eq. 3 parameters per request): ``k ~ Beta`` with mean ``k_mean`` and concentration
      ``k_conc``, shared half by the problem (its history tree) and half by the sample; ``a``
      lognormal around ``a_median``; ``k * a <= 1``. With the defaults a request offered 1 / 4 / 16
      drafts per step advances about 1.44 / 2.06 / 2.5 tokens per step, the range of a replayed
      trace through the suffix drafters (evidence: docs/benchmarks.md). No acceptance numbers of a
      7B model are published.
    * **Live siblings**: the problem tree of an engine also holds the finished GRPO siblings that
      ran on that engine; with ``c`` of the group's ``S - 1`` siblings finished there, the capacity
      is ``1 - (1 - k) * (1 - sibling_gain * c / (S - 1))`` (``sibling_gain`` 0.25: k 0.6 -> 0.7
      once the whole group is done, about the +10% the replay measured from adding a problem's
      history: an ASSUMPTION, no per-sibling measurement exists).
    * **Loops**: from its ``loop_at`` position to the cap a looping sample repeats itself, and each
      draft token (from the request's own tree) is accepted with probability ``loop_accept``
      independently, so ``d`` drafts advance ``(1 - q^(d+1)) / (1 - q)`` tokens per step
      (0.9: ~8.3 tokens at 16 drafts; an ASSUMPTION standing for the paper's observation that
      acceptance is very high in loops near the length cap; a degenerate loop is one the model
      continues with probability near 1 at T = 0.6).

    * **Draft length**: a suffix drafter stops where its tree becomes unsure, so it proposes fewer
      tokens than K: outside loops ``natural_draft`` = 3.7 tokens per step (from a replayed
      trace, the same at K = 16 and 32; evidence: docs/benchmarks.md), inside a loop all K. A budget ``c`` per step
      then yields ``min(c, natural)`` drafts; "fixed" (no budget) means up to K, not K every step.

    Position in the rollout matters only through the loop onset (and the siblings finishing over
    time); no other drift of acceptance along a rollout is modelled.
    """

    k_mean: float = 0.6
    k_conc: float = 20.0
    a_median: float = 1.0
    a_sigma: float = 0.3
    sibling_gain: float = 0.25
    loop_accept: float = 0.9
    natural_draft: float = 3.7

    def sample(self, n_problems: int, n_samples: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Base ``(k, a)``: float64 ``[P, n_samples]``."""
        kp = rng.beta(self.k_mean * self.k_conc, (1 - self.k_mean) * self.k_conc, n_problems)
        ks = rng.beta(self.k_mean * self.k_conc, (1 - self.k_mean) * self.k_conc, (n_problems, n_samples))
        k = np.clip(0.5 * kp[:, None] + 0.5 * ks, 0.01, 0.95)
        a = self.a_median * np.exp(self.a_sigma * rng.standard_normal((n_problems, n_samples)))
        return k, np.minimum(a, 1.0 / k)

    def sibling_k(self, k, finished_siblings, group_size: int) -> np.ndarray:
        """Capacity with ``finished_siblings`` of the group's ``group_size - 1`` siblings done."""
        f = np.asarray(finished_siblings, np.float64) / max(group_size - 1, 1)
        return 1.0 - (1.0 - np.asarray(k, np.float64)) * (1.0 - self.sibling_gain * np.clip(f, 0.0, 1.0))

    def tau_table(self, k, a, group_size: int, max_draft: int) -> np.ndarray:
        """Tokens per step ``[n, group_size, max_draft + 1]`` outside loops: request ``i`` with
        ``c`` finished siblings and ``d`` drafts (Eq. 3-4 per step, :func:`scheduler.tokens_per_step`)."""
        from scheduler.acceptance import tokens_per_step

        k = np.asarray(k, np.float64).ravel()
        a = np.asarray(a, np.float64).ravel()
        c = np.arange(group_size, dtype=np.float64)
        kk = np.minimum(self.sibling_k(k[:, None], c[None, :], group_size), 0.999)  # [n, S]
        aa = np.minimum(a[:, None], 1.0 / kk)
        d = np.arange(max_draft + 1, dtype=np.float64)
        return tokens_per_step(d[None, None, :], kk[:, :, None], aa[:, :, None])

    def loop_tau(self, max_draft: int) -> np.ndarray:
        """Tokens per step in a loop for ``d = 0..max_draft`` drafts: ``(1 - q^(d+1)) / (1 - q)``."""
        q = float(self.loop_accept)
        d = np.arange(max_draft + 1, dtype=np.float64)
        return d + 1.0 if q >= 1.0 else (1.0 - q ** (d + 1.0)) / (1.0 - q)

    def as_dict(self) -> dict:
        return asdict(self)


def prompt_lengths(n: int, rng: np.random.Generator, data: str | Path | None = None) -> np.ndarray:
    """Prompt tokens of ``n`` problems drawn from DSR-sub (``data``, default the copy shipped with the package,
    :mod:`integrations.data.registry`): characters / 3.5 + 16 template tokens (the Qwen tokenizer is not
    available here); 110 tokens each when the file is missing."""
    from integrations.data.registry import get, package_file

    path = Path(data) if data else package_file(get("dsr_sub"))
    try:
        import pyarrow.parquet as pq

        rows = pq.read_table(path, columns=["prompt"]).column("prompt").to_pylist()
        chars = np.array([sum(len(m["content"]) for m in r) for r in rows], np.float64)
        return np.rint(chars[rng.integers(0, chars.size, n)] / 3.5 + 16).astype(np.int64)
    except Exception:
        return np.full(n, 110, np.int64)


def build_predictor(lm: LengthModel, mu: np.ndarray, pids: list[str], max_tokens: int, rng: np.random.Generator, *, window: int = 16,
                    bg_groups: int, n_samples: int, history_visits=(1, 2)) -> LengthPredictor:
    """A predictor fed with synthetic history: ``bg_groups`` other problems per earlier policy
    version fill the global tables; each current problem was seen in 1 or 2 of the ``window - 1``
    earlier versions (with 1,209 DSR-sub problems and 128 per step a problem comes back every ~9.4
    steps)."""
    pred = LengthPredictor(max_tokens, window=window)
    now = window
    n_bg = (window - 1) * bg_groups
    hist_bg = lm.sample(lm.sample_problems(n_bg, rng), n_samples, rng)
    for i in range(n_bg):
        pred.observe(f"bg{i}", 1 + i // max(bg_groups, 1), hist_bg[i])
    for i, pid in enumerate(pids):
        visits = int(rng.choice(history_visits))
        for v in sorted(rng.choice(np.arange(1, now), size=visits, replace=False)):
            pred.observe(pid, int(v), lm.sample(mu[i : i + 1], n_samples, rng)[0])
    return pred
