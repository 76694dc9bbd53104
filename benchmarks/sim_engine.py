"""GPUs of the long-tail simulator: continuous batching with speculation, step by step.

The step loop runs in numba (:func:`_run_steps`); between calls Python re-plans the per-request
draft caps with a speculation budget (:mod:`benchmarks.sim_budget`; every ``replan_every`` steps, and
after any request finished, was admitted or was preempted) and, for the ``rebalance`` placement, moves
requests between GPUs at common time boundaries (:mod:`benchmarks.sim_placement`).

One engine step (vLLM V1-like; all requests arrive at time 0):

Re-planning: static budgets at every event; dynamic ones every ``replan_every`` steps, and
at events (a finish, an admission, a preemption) only when they ask for it (``class-eq9`` while its
batch gate is closed, so that it opens at the step the batch falls to the gate). A row admitted
between re-plans keeps cap 0 until the next one.

1. Every running request needs one KV slot for the token it samples; while they do not fit, the
   most recently admitted request is preempted (recompute: its KV is dropped, it goes to the front
   of the waiting queue and is prefilled again, prompt + generated tokens, when re-admitted).
2. Drafts: a budget caps each running row at ``caps[i]`` tokens (a priced budget's caps are the
   product's :class:`scheduler.planner.StepPlanner`'s kept drafts at the re-plan). A batch gate (no drafts while
   more than ``gate`` rows run) and a per-step quota (``quota_mode`` 1: a fixed number of draft
   tokens; 2: the roofline knee, :meth:`Roofline.free_draft_tokens`) are spent in the budget's
   priority order. KV-aware (``kv_aware``): the step's drafts also fit in the free KV slots, so no
   draft ever forces a preemption; otherwise (vLLM's own behaviour) drafts that do not fit preempt
   the newest requests like any other slot demand.
3. Admission (only in a step without preemption): waiting requests in queue order while fewer than
   ``max_seqs`` run and their prompt (+ generated tokens) fits under ``kv_capacity * (1 -
   watermark)``; an admitted request is prefilled and samples one token in this step, no draft.
4. Cost (:class:`benchmarks.sim_workload.Roofline`): ``launch + max(compute, memory)`` over the
   step's tokens (sampled + drafted + prefilled), attention pairs and KV traffic, plus the
   drafter's CPU time (``drafter_s_per_row`` x running rows) when the budget speculates.
5. Advance: a row offered ``d`` drafts advances ``tau(d)`` tokens (expected value): outside a loop
   the Eq. 3-4 per-step value for its base acceptance and the siblings finished on this GPU
   (``tau_tab[i, c, d]``), inside its loop ``tau_loop[d]``
   (:class:`benchmarks.sim_workload.AcceptanceModel`). It finishes at its length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numba
import numpy as np

from benchmarks.sim_workload import Roofline
from scheduler.budget_protocol import allot_in_order

WAITING, RUNNING, DONE = 0, 1, 2
POS_BINS = 16  # acceptance statistics: bins of the position in the rollout over [0, max_tokens]


@numba.njit(cache=True)
def roofline_time(tokens, attn_pairs, kv_tokens, launch, w_bytes, kv_b, f_tok, f_attn, bw, flops, additive=False):
    """Seconds of one step (see :meth:`Roofline.step_time`); ``additive``: compute + memory
    instead of their maximum (the old model, for comparison)."""
    comp = (f_tok * tokens + f_attn * attn_pairs) / flops
    mem = (w_bytes + kv_b * kv_tokens) / bw
    if additive:
        return launch + comp + mem
    return launch + max(comp, mem)


# The quota rule of the budgets (scheduler.budget_protocol.allot_in_order), compiled for the step loop.
allot_drafts = numba.njit(cache=True)(allot_in_order)


@numba.njit(cache=True)
def _newest_running(mem, status, stamp):
    victim = -1
    vs = -1
    for j in range(mem.size):
        i = mem[j]
        if status[i] == 1 and stamp[i] > vs:
            vs = stamp[i]
            victim = i
    return victim


@numba.njit(cache=True)
def _run_steps(
    mem, length, prompt, loop_at, grp, gen, status, stamp, wait_key, caps, order, tau_tab, tau_loop, nat_draft,
    drafted, accepted, steps, finish, grp_done, stats_pos, stats_sib,
    t0, t_stop, max_steps, kv_cap, max_seqs, watermark,
    launch, w_bytes, kv_b, f_tok, f_attn, bw, flops, drafter_s_row, spec_on,
    kv_aware, quota_mode, quota_fixed, gate, max_tokens, additive,
    counters, rec_t, rec_b, rec_n, rec_ctx, rec_dt, rec_d, rec_pre, rec_a, rec_off,
):  # fmt: skip
    n = length.size
    n_sib = tau_tab.shape[1]
    nbins = stats_pos.shape[1]
    d_step = np.zeros(n)
    want = np.zeros(n)
    kmax = tau_tab.shape[2] - 1
    fresh = np.zeros(n, np.bool_)
    run_mask = np.zeros(n, np.bool_)
    t = t0
    s = 0
    while s < max_steps and rec_off + s < rec_t.size and t < t_stop:
        event = False
        ctx = 0.0
        nrun = 0
        nwait = 0
        for j in range(mem.size):
            i = mem[j]
            fresh[i] = False
            d_step[i] = 0
            if status[i] == 1:
                ctx += prompt[i] + gen[i]
                nrun += 1
            elif status[i] == 0:
                nwait += 1
        if nrun == 0 and nwait == 0:
            break
        # 1. one slot per running row
        preempted = False
        while nrun > 1 and ctx + nrun > kv_cap:
            v = _newest_running(mem, status, stamp)
            status[v] = 0
            counters[1] += 1
            wait_key[v] = -float(counters[1])
            ctx -= prompt[v] + gen[v]
            nrun -= 1
            preempted = True
            event = True
        if nrun == 1 and ctx + 1 > kv_cap:
            counters[2] = 1  # one request alone does not fit: the KV capacity is too small
            break
        # 2. drafts: a row wants min(cap, what the drafter proposes: nat_draft outside a loop, K in it)
        ndraft = 0.0
        drafting = spec_on
        if drafting and nrun > 0 and (gate < 0 or nrun <= gate):
            budget = 1e18
            if quota_mode == 1:
                budget = quota_fixed
            elif quota_mode == 2:
                m_t = (w_bytes + kv_b * (ctx + nrun)) / bw
                c_t = (f_tok * nrun + f_attn * ctx) / flops
                per = (f_tok + f_attn * ctx / nrun) / flops
                budget = max(0.0, (m_t - c_t) / per)
            if kv_aware:  # the drafts' slots, and the next step's sampled tokens after them, fit
                budget = min(budget, kv_cap - ctx - 2.0 * nrun)
            for j in range(mem.size):
                i = mem[j]
                run_mask[i] = status[i] == 1
                w = float(min(caps[i], kmax))
                if gen[i] < loop_at[i] and w > nat_draft:
                    w = nat_draft
                want[i] = w if run_mask[i] else 0.0
            if budget >= 1e17:
                for j in range(mem.size):
                    i = mem[j]
                    d_step[i] = want[i]
            else:
                d_step[:] = allot_drafts(want, order, run_mask, budget)
            for j in range(mem.size):
                ndraft += d_step[mem[j]]
        if not kv_aware:  # drafts that do not fit preempt the newest requests (vLLM)
            while nrun > 1 and ctx + nrun + ndraft > kv_cap:
                v = _newest_running(mem, status, stamp)
                status[v] = 0
                counters[1] += 1
                wait_key[v] = -float(counters[1])
                ctx -= prompt[v] + gen[v]
                ndraft -= d_step[v]
                d_step[v] = 0.0
                nrun -= 1
                preempted = True
                event = True
        # 3. admission
        prefill = 0.0
        attn = 0.0
        if not preempted:
            used = ctx + nrun + ndraft
            while nrun < max_seqs:
                best = -1
                bk = np.inf
                for j in range(mem.size):
                    i = mem[j]
                    if status[i] == 0 and wait_key[i] < bk:
                        bk = wait_key[i]
                        best = i
                if best < 0:
                    break
                need = prompt[best] + gen[best]
                if used + need + 1 > kv_cap * (1.0 - watermark):
                    if nrun == 0:
                        counters[2] = 1
                    break
                status[best] = 1
                stamp[best] = counters[0]
                counters[0] += 1
                fresh[best] = True
                prefill += need
                attn += 0.5 * need * need
                used += need + 1
                nrun += 1
                event = True
        if counters[2] != 0 or nrun == 0:
            break
        # 4. cost
        qtok = 0.0
        kvread = 0.0
        for j in range(mem.size):
            i = mem[j]
            if status[i] == 1 and not fresh[i]:
                q = 1.0 + d_step[i]
                c_i = prompt[i] + gen[i]
                qtok += q
                attn += q * c_i
                kvread += c_i
        tokens = qtok + prefill
        dt = roofline_time(tokens, attn, kvread + tokens, launch, w_bytes, kv_b, f_tok, f_attn, bw, flops, additive)
        if drafting:
            dt += drafter_s_row * nrun
        # 5. advance
        step_acc = 0.0
        for j in range(mem.size):
            i = mem[j]
            run_mask[i] = False
            if status[i] != 1:
                continue
            d = d_step[i]
            if fresh[i]:
                adv = 1.0
            else:
                b = int(gen[i] * nbins / max_tokens)
                if b >= nbins:
                    b = nbins - 1
                d0 = int(d)
                fr = d - d0
                d1 = d0 + 1 if d0 < kmax else d0
                if gen[i] >= loop_at[i]:
                    adv = (1.0 - fr) * tau_loop[d0] + fr * tau_loop[d1]
                    lp = 1
                else:
                    c = grp_done[grp[i]]
                    if c > n_sib - 1:
                        c = n_sib - 1
                    adv = (1.0 - fr) * tau_tab[i, c, d0] + fr * tau_tab[i, c, d1]
                    lp = 0
                    stats_sib[c, 0] += 1
                    stats_sib[c, 1] += d
                    stats_sib[c, 2] += adv - 1.0
                stats_pos[lp, b, 0] += 1
                stats_pos[lp, b, 1] += d
                stats_pos[lp, b, 2] += adv - 1.0
            if gen[i] + adv >= length[i] - 1e-9:
                adv = length[i] - gen[i]
                status[i] = 2
                finish[i] = t + dt
                run_mask[i] = True  # finished in this step
                event = True
            gen[i] += adv
            drafted[i] += d
            acc = max(min(adv - 1.0, d), 0.0)
            accepted[i] += acc
            step_acc += acc
            steps[i] += 1
        for j in range(mem.size):
            i = mem[j]
            if run_mask[i]:
                grp_done[grp[i]] += 1
                run_mask[i] = False
        t += dt
        rec_t[rec_off + s] = t
        rec_b[rec_off + s] = nrun
        rec_n[rec_off + s] = tokens
        rec_ctx[rec_off + s] = kvread
        rec_dt[rec_off + s] = dt
        rec_d[rec_off + s] = ndraft
        rec_pre[rec_off + s] = prefill
        rec_a[rec_off + s] = step_acc
        s += 1
        if event:
            break
    return s, t


@dataclass
class EngineParams:
    """Engine, cost and drafting constants of the simulation (seconds, tokens)."""

    roof: Roofline
    max_seqs: int = 1024  # vLLM V1 default on >= 70 GiB GPUs
    watermark: float = 0.01
    max_draft: int = 16  # K, the engine's most draft tokens per row and step (das's default; above batch_draft: a priced budget's tail rows)
    batch_draft: int = 16  # most draft tokens per row and step before the long tail (scheduler.planner)
    replan_every: int = 16
    drafter_ms_per_256: float = 1.0  # drafter CPU time per step at 256 rows (linear in rows)
    timing_noise: float = 0.05  # relative noise of the step times a cost model observes
    kv_aware: bool = True  # no draft forces a preemption (all speculative budgets)
    max_tokens: int = 16384
    additive_cost: bool = False  # compute + memory instead of max (the old model; ablation only)

    @property
    def kv_capacity_tokens(self) -> float:
        return float(self.roof.kv_capacity_tokens)


@dataclass
class Requests:
    """The requests being simulated (flat arrays, one entry per request) and their mutable state."""

    length: np.ndarray  # float64 true output length
    prompt: np.ndarray  # float64 prompt tokens
    loop_at: np.ndarray  # float64 loop onset (inf: no loop)
    group: np.ndarray  # int64 global GRPO group
    problem_idx: np.ndarray  # int64 predictor index of the problem
    k: np.ndarray  # float64 base Eq. 3 capacity
    a: np.ndarray  # float64 base Eq. 3 efficiency
    tau_tab: np.ndarray  # float64 [n, S, K + 1]
    tau_loop: np.ndarray  # float64 [K + 1]
    nat_draft: float  # draft tokens the drafter proposes per step outside loops when not capped
    gen: np.ndarray = field(default=None)
    status: np.ndarray = field(default=None)
    stamp: np.ndarray = field(default=None)
    wait_key: np.ndarray = field(default=None)
    caps: np.ndarray = field(default=None)
    drafted: np.ndarray = field(default=None)
    accepted: np.ndarray = field(default=None)
    steps: np.ndarray = field(default=None)
    finish: np.ndarray = field(default=None)
    gpu: np.ndarray = field(default=None)
    moves: np.ndarray = field(default=None)

    def __post_init__(self):
        n = self.length.size
        self.gen = np.zeros(n)
        self.status = np.zeros(n, np.int64)
        self.stamp = np.full(n, -1, np.int64)
        self.wait_key = np.arange(n, dtype=np.float64)
        self.caps = np.zeros(n, np.int64)
        self.drafted = np.zeros(n)
        self.accepted = np.zeros(n)
        self.steps = np.zeros(n, np.int64)
        self.finish = np.full(n, np.nan)
        self.gpu = np.zeros(n, np.int64)
        self.moves = np.zeros(n, np.int64)

    @property
    def n(self) -> int:
        return int(self.length.size)

    @property
    def group_size(self) -> int:
        return int(self.tau_tab.shape[1])


class Gpu:
    """One engine: its member requests, clock, speculation budget (:class:`benchmarks.sim_budget.SimBudget`) and step records."""

    def __init__(self, gid: int, req: Requests, members: np.ndarray, budget, params: EngineParams, n_groups: int,
                 stats_pos: np.ndarray, stats_sib: np.ndarray, seed: int = 0):
        self.gid = gid
        self.req = req
        self.mem = np.asarray(members, np.int64)
        req.gpu[self.mem] = gid
        self.budget = budget
        self.p = params
        self.t = 0.0
        self.order = self.mem.copy()
        self.grp_done = np.zeros(n_groups, np.int64)
        self.counters = np.zeros(3, np.int64)
        self.stats_pos, self.stats_sib = stats_pos, stats_sib
        self.rng = np.random.default_rng(seed)
        cap = 4096
        self.rec = {k: np.zeros(cap) for k in ("t", "n", "ctx", "dt", "d", "pre", "a")}  # ... draft tokens, prefill tokens, accepted
        self.rec["b"] = np.zeros(cap, np.int64)
        self.off = 0
        self.since_plan = 1 << 30
        self.events = True

    # ------------------------------------------------------------------ membership
    def add(self, idx: np.ndarray) -> None:
        idx = np.asarray(idx, np.int64)
        self.mem = np.concatenate([self.mem, idx])
        self.req.gpu[idx] = self.gid
        self.events = True
        self.since_plan = 1 << 30

    def remove(self, idx: np.ndarray) -> None:
        self.mem = self.mem[~np.isin(self.mem, idx)]
        self.order = self.order[~np.isin(self.order, idx)]
        self.events = True
        self.since_plan = 1 << 30

    @property
    def done(self) -> bool:
        return bool(np.all(self.req.status[self.mem] == DONE))

    def unfinished(self) -> np.ndarray:
        return self.mem[self.req.status[self.mem] != DONE]

    # ------------------------------------------------------------------ stepping
    def _grow(self) -> None:
        for k, v in self.rec.items():
            self.rec[k] = np.concatenate([v, np.zeros_like(v)])

    def run_until(self, t_stop: float = np.inf) -> None:
        """Step until every member finished or the clock passes ``t_stop``."""
        r, p, pol = self.req, self.p, self.budget
        roof = p.roof
        while self.t < t_stop and not self.done:
            if pol.dynamic and (self.since_plan >= p.replan_every or (self.events and pol.replan_on_events)):
                run = self.mem[r.status[self.mem] == RUNNING]
                if run.size:
                    pol.plan(self, run)
                self.since_plan = 0
                self.events = False
            elif not pol.dynamic and self.events:
                pol.plan(self, self.mem)
                self.events = False
            if self.off >= self.rec["t"].size:
                self._grow()
            max_steps = (1 if pol.one_step else max(p.replan_every - self.since_plan, 1)) if pol.dynamic else 1 << 40
            s, t = _run_steps(
                self.mem, r.length, r.prompt, r.loop_at, r.group, r.gen, r.status, r.stamp, r.wait_key, r.caps, self.order, r.tau_tab, r.tau_loop, r.nat_draft,
                r.drafted, r.accepted, r.steps, r.finish, self.grp_done, self.stats_pos, self.stats_sib,
                self.t, t_stop, max_steps, float(roof.kv_capacity_tokens), p.max_seqs, p.watermark,
                roof.launch_s, roof.weight_bytes, roof.kv_bytes_per_token, roof.flops_per_token, roof.attn_flops_per_pair, roof.bytes_per_s, roof.flops_per_s,
                p.drafter_ms_per_256 * 1e-3 / 256.0, pol.spec_on, pol.kv_aware and p.kv_aware, pol.quota_mode, float(pol.quota), pol.gate,
                float(p.max_tokens), p.additive_cost,
                self.counters, self.rec["t"], self.rec["b"], self.rec["n"], self.rec["ctx"], self.rec["dt"], self.rec["d"], self.rec["pre"],
                self.rec["a"], self.off,
            )  # fmt: skip
            if self.counters[2]:
                raise RuntimeError(f"GPU {self.gid}: a request can never be admitted (KV capacity {roof.kv_capacity_tokens} tokens too small)")
            self.t = t
            if s:
                o = self.off
                pol.observe(self, {k: v[o : o + s] for k, v in self.rec.items()})
                self.off += s
                self.since_plan += s
                if pol.one_step:  # the planner's plain step: plan again after it
                    self.since_plan = p.replan_every
                # an event (finish / admission / preemption) ends a call early: re-plan
                if s < max_steps and self.t < t_stop and not self.done:
                    self.events = True
            elif self.off < self.rec["t"].size and self.t < t_stop and not self.done:
                raise RuntimeError(f"GPU {self.gid}: no step ran at t={self.t:.3f} s with unfinished requests")

    # ------------------------------------------------------------------ results
    def records(self) -> dict[str, np.ndarray]:
        return {k: v[: self.off].copy() for k, v in self.rec.items()}

    @property
    def preemptions(self) -> int:
        return int(self.counters[1])

    @property
    def makespan_s(self) -> float:
        f = self.req.finish[self.mem]
        return float(np.nanmax(f)) if f.size and np.any(np.isfinite(f)) else 0.0
