"""One GPU of the long-tail simulator: continuous batching with speculation, step by step.

The step loop runs in numba (:func:`_run_steps`); between calls Python re-plans the per-request
draft caps with a :class:`scheduler.SpeculationScheduler` (every ``replan_every`` steps, and
after any request finished, was admitted or was preempted).

One engine step (vLLM V1-like, all requests arrive at time 0):

1. Admit waiting requests (preempted ones first, most recently preempted first; then in arrival
   order) while fewer than ``max_seqs`` run and their KV cache (prompt + generated tokens) fits in
   ``kv_capacity * (1 - watermark)``; an admitted request is prefilled (prompt + tokens generated
   before a preemption: recompute) and samples one token in this step, without a draft.
2. ``n_tokens = prefill tokens + sum over running requests of (1 + cap_i)``; the step takes
   ``c_base + c_tok * n_tokens + c_ctx * context_tokens`` seconds (context = KV tokens of the
   running requests).
3. A running request offered ``d = cap_i`` drafts advances ``tau_i(d)`` tokens (expected value of
   the Eq. 3 model per step, :func:`scheduler.tokens_per_step`; fractional, deterministic); it
   finishes when it reaches its length.
4. If the running requests' KV cache exceeds ``kv_capacity``, the most recently admitted ones are
   preempted (vLLM's recompute preemption) until it fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numba
import numpy as np

from scheduler import LengthPredictor, SpeculationScheduler, tokens_per_step

WAITING, RUNNING, DONE = 0, 1, 2


@numba.njit(cache=True)
def _run_steps(
    length, prompt, gen, status, stamp, wait_key, caps, tau, drafted, accepted, steps, finish,
    t0, c_base, c_tok, c_ctx, kv_cap, max_seqs, watermark, max_steps, counters,
    rec_t, rec_b, rec_n, rec_ctx, rec_dt, rec_off,
):  # fmt: skip
    n = length.size
    fresh = np.zeros(n, np.bool_)
    t = t0
    s = 0
    while s < max_steps and rec_off + s < rec_t.size:
        event = False
        ctx = 0.0
        nrun = 0
        for i in range(n):
            if status[i] == 1:
                ctx += prompt[i] + gen[i]
                nrun += 1
        prefill = 0.0
        while nrun < max_seqs:
            best = -1
            bk = np.inf
            for i in range(n):
                if status[i] == 0 and wait_key[i] < bk:
                    bk = wait_key[i]
                    best = i
            if best < 0:
                break
            need = prompt[best] + gen[best]
            if nrun > 0 and ctx + need > kv_cap * (1.0 - watermark):
                break
            status[best] = 1
            stamp[best] = counters[0]
            counters[0] += 1
            fresh[best] = True
            prefill += need
            ctx += need
            nrun += 1
            event = True
        if nrun == 0:
            break
        ntok = prefill
        for i in range(n):
            if status[i] == 1:
                ntok += 1.0
                if not fresh[i]:
                    ntok += caps[i]
        dt = c_base + c_tok * ntok + c_ctx * ctx
        for i in range(n):
            if status[i] != 1:
                continue
            d = 0 if fresh[i] else caps[i]
            adv = tau[i, d]
            if gen[i] + adv >= length[i] - 1e-9:
                adv = length[i] - gen[i]
                status[i] = 2
                finish[i] = t + dt
                event = True
            gen[i] += adv
            drafted[i] += d
            accepted[i] += max(adv - 1.0, 0.0)
            steps[i] += 1
            fresh[i] = False
        t += dt
        rec_t[rec_off + s] = t
        rec_b[rec_off + s] = nrun
        rec_n[rec_off + s] = ntok
        rec_ctx[rec_off + s] = ctx
        rec_dt[rec_off + s] = dt
        s += 1
        # preempt (recompute) the most recently admitted requests until the KV cache fits
        ctx2 = 0.0
        nrun2 = 0
        for i in range(n):
            if status[i] == 1:
                ctx2 += prompt[i] + gen[i]
                nrun2 += 1
        while ctx2 > kv_cap and nrun2 > 1:
            victim = -1
            vs = -1
            for i in range(n):
                if status[i] == 1 and stamp[i] > vs:
                    vs = stamp[i]
                    victim = i
            status[victim] = 0
            counters[1] += 1
            wait_key[victim] = -float(counters[1])
            ctx2 -= prompt[victim] + gen[victim]
            nrun2 -= 1
            event = True
        if event:
            break
    return s, t


@dataclass
class GpuResult:
    """What one GPU did in one iteration (times in seconds, tokens in tokens)."""

    makespan_s: float
    steps: int
    tokens: float
    drafted: float
    accepted: float
    preemptions: int
    finish_s: np.ndarray  # per request
    rec_t: np.ndarray  # end time of each step
    rec_batch: np.ndarray  # running requests in each step
    cost_fit: dict | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class SimParams:
    """Engine and cost constants of the simulation (seconds, tokens)."""

    c_base: float
    c_tok: float
    c_ctx: float
    kv_capacity_tokens: float
    max_seqs: int = 1024  # vLLM V1 default on >= 70 GiB GPUs
    watermark: float = 0.01
    max_draft: int = 16
    replan_every: int = 16
    timing_noise: float = 0.05  # relative noise of the step times the cost model observes
    max_records: int = 400_000


def simulate_gpu(
    lengths: np.ndarray,
    prompts: np.ndarray,
    k: np.ndarray,
    a: np.ndarray,
    problem_idx: np.ndarray,
    scheduler: SpeculationScheduler,
    params: SimParams,
    *,
    oracle: bool = False,
    seed: int = 0,
) -> GpuResult:
    """Simulate one GPU's requests of one rollout iteration (all arrive at time 0).

    Args:
        lengths: int ``[n]`` true output lengths (tokens). prompts: int ``[n]`` prompt tokens.
        k, a: float ``[n]`` true Eq. 3 parameters of each request.
        problem_idx: int ``[n]`` predictor index of each request's problem (-1 unseen).
        scheduler: the policy (its cost model observes this GPU's step times).
        oracle: give the policy the true remaining lengths and ``k, a`` (``eq7`` only).
    """
    n = lengths.size
    rng = np.random.default_rng(seed)
    length = lengths.astype(np.float64)
    prompt = prompts.astype(np.float64)
    gen = np.zeros(n)
    status = np.zeros(n, np.int64)
    stamp = np.full(n, -1, np.int64)
    wait_key = np.arange(n, dtype=np.float64)
    caps = np.zeros(n, np.int64)
    kk = params.max_draft
    tau = tokens_per_step(np.arange(kk + 1, dtype=np.float64)[None, :], k[:, None], a[:, None])
    drafted = np.zeros(n)
    accepted = np.zeros(n)
    steps = np.zeros(n, np.int64)
    finish = np.full(n, np.nan)
    counters = np.zeros(2, np.int64)
    m = params.max_records
    rec_t, rec_n, rec_ctx, rec_dt = (np.zeros(m) for _ in range(4))
    rec_b = np.zeros(m, np.int64)
    off = 0
    t = 0.0
    dynamic = scheduler.policy in ("class", "eq7")
    if not dynamic:
        caps[:] = scheduler.caps(problem_idx, gen, drafted, accepted, steps)
    while np.any(status != DONE):
        if dynamic:
            run = np.flatnonzero(status == RUNNING)
            caps[:] = 0
            if run.size:
                extra = {}
                if oracle:
                    extra = dict(remaining=length[run] - gen[run], k=k[run], a=a[run])
                caps[run] = scheduler.caps(
                    problem_idx[run], gen[run], drafted[run], accepted[run], steps[run],
                    context_tokens=prompt[run] + gen[run], **extra,
                )  # fmt: skip
        max_steps = params.replan_every if dynamic else m
        s, t = _run_steps(
            length, prompt, gen, status, stamp, wait_key, caps, tau, drafted, accepted, steps, finish,
            t, params.c_base, params.c_tok, params.c_ctx, float(params.kv_capacity_tokens), params.max_seqs,
            params.watermark, max_steps, counters, rec_t, rec_b, rec_n, rec_ctx, rec_dt, off,
        )  # fmt: skip
        if s == 0:
            if off >= m:
                raise RuntimeError(f"simulation exceeded max_records={m} steps")
            if np.any(status == WAITING) and not np.any(status == RUNNING):
                raise RuntimeError("a waiting request can never be admitted (KV capacity too small)")
            continue
        if scheduler.policy == "eq7":
            noisy = rec_dt[off : off + s] * np.exp(params.timing_noise * rng.standard_normal(s))
            scheduler.observe_step(rec_n[off : off + s], noisy, rec_ctx[off : off + s] if scheduler.cost.use_context else None)
        off += s
    return GpuResult(
        makespan_s=float(np.nanmax(finish)) if n else 0.0,
        steps=off,
        tokens=float(gen.sum()),
        drafted=float(drafted.sum()),
        accepted=float(accepted.sum()),
        preemptions=int(counters[1]),
        finish_s=finish,
        rec_t=rec_t[:off].copy(),
        rec_batch=rec_b[:off].copy(),
        cost_fit=scheduler.cost.coefficients() if scheduler.policy == "eq7" else None,
    )


def make_scheduler(policy: str, predictor: LengthPredictor | None, max_draft: int, *, use_context: bool = True, seed: int = 0, **kwargs) -> SpeculationScheduler:
    """A fresh per-GPU scheduler; ``eq7`` gets an unfitted online cost model (with context term)."""
    from scheduler import CostModel

    cost = CostModel(use_context=use_context, min_samples=16, forgetting=0.999) if policy == "eq7" else None
    return SpeculationScheduler(policy, max_draft=max_draft, predictor=predictor, cost=cost, seed=seed, **kwargs)
