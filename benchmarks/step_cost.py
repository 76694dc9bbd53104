"""Drafter CPU per engine step: the per-row verbs against the batch verbs, on a recorded trace.

``python -m benchmarks.step_cost [--trace PATH] [--rows 16,64,256,1024] [--context 4096,16384] [--k 16] [--json PATH]``

What one engine step asks of the drafter, as vLLM's proposer drives it: every running request
appends the tokens its last verification accepted, then drafts up to K tokens. Measured per step
(wall time, and CPU time of all the process's threads, milliseconds) for two ways of doing it:

* ``per_row``: ``add_tokens(req_id, tokens)`` for each row, then ``speculate(req_id, K)``
  for each row, from Python;
* ``batch``: ``add_tokens_batch(req_ids, token_ids, None, ends)`` (``starts=None``: from
  the drafter's own token counts) and ``speculate_batch(req_ids, budgets)``: two calls, whatever
  the number of rows;
* ``proposer`` (``--paths proposer``): the engine's own caller,
  :class:`integrations.vllm_ext.proposer.DASProposer` with the ``fixed`` budget, fed each step
  as vLLM's model runner feeds it (``propose(sampled_token_ids, num_tokens_no_spec,
  token_ids_cpu)`` with a stand-in runner's ``input_batch`` and ``requests``): the batch verbs
  plus the proposer's own work (bookkeeping and draft selection over the rows' arrays, the
  output lists), and the requests it starts and stops inside the call. Nearly the drafts of ``batch``: a finished
  request leaves the drafter at the proposer's next call, one step later, as in the engine.
  With ``--prices C_BASE,C_TOK`` its budget is ``cost``, priced by the line ``c_base + c_tok *
  tokens`` (seconds): it keeps the drafts an engine with those step times would, and its drafter
  stops where those prices cut (``proposer_stats.cut_steps``). ``0.019,0.000024`` is a 7B model
  on an H100: 25 ms a step at 256 rows, 24 us per token (the simulator's roofline, compute-bound).

The workload: the trace's last iteration is the one being generated, the earlier iterations are
its problems' history (``add_rollout``, one policy version each). ``rows`` requests run at once;
when one finishes, the next rollout of the iteration takes its row (a row's first token comes
from prefill, undrafted). Each step every row gets ``accepted + 1`` tokens, ``accepted`` = the
longest common prefix of its last draft and the rollout's real continuation (what lossless
verification accepts for a deterministic drafter). To reach a row count the iteration's rollouts
are replicated as distinct problems (copy ``c`` of problem ``p`` is problem ``p#c``, with its
own copy of the history, its token ids shifted by ``c x 49,157`` modulo 2**20 so that copies do
not draft from each other through the global tree), so that at least ``3 x rows`` rollouts are queued. Only steps with
every row running count (at most ``--max-steps``). Starting and stopping requests (a few per
step) is timed apart (``lifecycle_ms_mean``), as it is not per-row work.

Both paths make the same drafts (checked: the runs must take the same number of steps). Each
path runs ``--repeats`` times, interleaved; as every repeat does exactly the same work step by
step, a step's time is its fastest over the repeats (which filters out other processes' noise).
The garbage collector is off while timing. From ``das.step_threads.PARALLEL_ROWS`` rows on the batch
path drafts on the drafter's ``draft_threads`` (default: :func:`das.host.default_draft_threads`,
this machine's physical cores per GPU, at most 16, or without a GPU at most 8; ``--das
'{"draft_threads": 1}'`` for one), printed in the header.

Deferred global appends (``--das '{"defer_global": true}' --gpu-ms G``): the drafter leaves each
step's appends to its global tree (and its stopped requests' removals there) to a background thread that runs while the accelerator
verifies; ``--gpu-ms`` waits ``G`` ms after each step, untimed, for that forward pass (a 7B
decode step on a GPU: ~25 ms). A step's time then holds only what the engine waits for (the
appends to the problem and request trees, the learning, the drafts, and any wait for a
background job not yet done); ``deferred_ms`` is the background's own time per step (the appends,
and the global-tree part of the requests stopped since the last step). With
``--gpu-ms 0`` the next step waits for it. The per-row path appends at once, so its drafts differ
and only the batch paths are checked against each other.

GPU shapes (``--context N``): a GPU engine runs 256 to 1,024 rows at contexts of 4K-16K tokens,
where the trace's are a few hundred. Each rollout's prompt is then lengthened at its front with the
trace's text of the other problems (in the copy's alphabet) so that its context ends at ``N``
tokens: the request trees hold ``N`` tokens each (the problem and global trees
only a prompt's last ``max_depth - 1`` tokens, as always), and starting a request costs that
much more (timed apart, in ``lifecycle_ms_mean``).

JSON (``--json``): ``{"rows": {"256": {"p50_ms", "p99_ms", "cpu_p50_ms", "cpu_p99_ms",
"mean_ms", "steps", "context", ..., "per_row": {same keys}}, "256@4096": ...}, "trace": ..., "machine": ..., "draft_threads": ...}``: the top-level
keys of a row count are the batch path's; ``per_row`` and ``proposer`` hold those paths' (when run).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from benchmarks.replay import load_trace
from das.step_threads import PARALLEL_ROWS

DEFAULT_ROWS = (16, 64, 256, 1024)
DEFAULT_K = 16
PATHS = ("per_row", "batch", "proposer")
DEFAULT_PATHS = ("per_row", "batch")  # ``proposer`` imports vLLM (seconds): asked for by name
QUEUE = 3  # rollouts queued per row: the run ends when the queue runs dry (about 300 steps on DSR-sub)


def find_trace(path: str | None, record: bool = True) -> Path:
    """``path``, else the benchmarks' cached trace, recorded first when it is missing
    (:func:`integrations.data.trace.cached_trace`). FileNotFoundError names a missing file."""
    from integrations.data.trace import cached_trace

    return cached_trace(path, record=record)


COPY_SHIFT = 49_157  # token id shift per copy: more than SmolLM2's vocabulary (49,152)


def copy_tokens(tokens: np.ndarray, c: int) -> np.ndarray:
    """Copy ``c``'s tokens (``int32``): ids shifted by ``c * COPY_SHIFT`` modulo 2**20 (the
    drafter's token range), so copies of one rollout do not match each other in a tree shared by
    problems (the global tree): a copy is a distinct problem in its own token alphabet."""
    return ((tokens.astype(np.int64) + c * COPY_SHIFT) % (1 << 20)).astype(np.int32)


def long_prompt(prompt: np.ndarray, output_len: int, context: int, filler: np.ndarray, at: int) -> np.ndarray:
    """``prompt`` lengthened at its front to ``context - output_len`` tokens (unchanged when it is
    as long already) with ``filler``'s tokens from index ``at`` on (cyclically): a rollout whose
    context (prompt + output) ends at ``context`` tokens, as a long multi-turn or long-reasoning
    context on a GPU does."""
    need = context - output_len - prompt.shape[0]
    if need <= 0:
        return prompt
    idx = (at + np.arange(need)) % filler.shape[0]
    return np.concatenate([filler[idx], prompt]).astype(np.int32)


class Workload:
    """The trace, replicated for ``rows`` running requests (see the module docstring). ``context``
    (tokens, 0: the trace's own): each rollout's prompt is lengthened at its front so that its
    context ends at ``context`` tokens (:func:`long_prompt`), with the trace's text of the other
    problems (their rollouts' prompts and outputs, every iteration, in the copy's token alphabet)
    as the filler: never the rollout's own text or its siblings', which would hand the request
    tree the continuation to draft (a problem alone in the trace gets its prompt repeated)."""

    def __init__(self, iterations, rows: int, context: int = 0):
        current = iterations[-1]
        self.history = iterations[:-1]
        copies = max(1, -(-QUEUE * rows // len(current)))
        self.copies = copies
        self.context = context
        # queued rollouts: (problem id, prompt, full = prompt + output)
        self.pool = []
        text = {}  # problem -> the other problems' text
        if context:
            every = [r for rs in iterations for r in rs]
            for pid in {r.pid for r in current}:
                other = [r.full for r in every if r.pid != pid]
                text[pid] = np.concatenate(other or [r.prompt for r in current if r.pid == pid]).astype(np.int32)
        for c in range(copies):
            for i, r in enumerate(current):
                prompt, output = copy_tokens(r.prompt, c), copy_tokens(r.output, c)
                if context:
                    filler = copy_tokens(text[r.pid], c)
                    prompt = long_prompt(prompt, output.shape[0], context, filler, 7919 * (c * len(current) + i))
                self.pool.append((f"{r.pid}#{c}", prompt, np.concatenate([prompt, output]).astype(np.int32)))
        self.width = max(full.shape[0] for _, _, full in self.pool)
        self.rows = rows

    def drafter(self, **config):
        from das import DASDrafter

        d = DASDrafter(**config)
        for v, rollouts in enumerate(self.history):
            d.begin_iteration(v + 1)
            for c in range(self.copies):
                for r in rollouts:
                    d.add_rollout(copy_tokens(r.prompt, c), copy_tokens(r.output, c), problem_id=f"{r.pid}#{c}")
        d.begin_iteration(len(self.history) + 1)
        return d


def stand_in_proposer(drafter, k: int, max_model_len: int, prices: tuple[float, float] | None = None):
    """A :class:`DASProposer` (K = ``k``) around ``drafter``, with a stand-in model runner: the
    attributes of vLLM's runner that the proposer reads (``input_batch.req_ids``,
    ``input_batch.num_prompt_tokens``, ``requests[req_id].sampling_params``). Its budget is
    ``fixed``, or with ``prices = (c_base, c_tok)`` (seconds, seconds per token) the ``cost``
    budget priced by that line: the drafts an engine with those step times would keep."""
    from integrations.vllm_ext.proposer import DASProposer

    das = {"budget": "fixed"} if prices is None else {"budget": "cost", "c_base": prices[0], "c_tok": prices[1]}
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                          model_config=SimpleNamespace(max_model_len=max_model_len), additional_config={"das": das})
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=[], num_prompt_tokens=None), requests={})
    prop = DASProposer(cfg, runner=runner)
    prop.drafter = drafter
    return prop, runner


def wait_forward(ms: float) -> None:
    """Wait ``ms`` milliseconds as an engine's main thread waits for the accelerator's forward
    pass: busy (a core that slept wakes with cold caches, which would charge the drafter for
    the sleep), but giving the GIL away at every turn, as a blocking CUDA copy does, so a
    background thread runs meanwhile."""
    end = time.perf_counter_ns() + int(ms * 1e6)
    while time.perf_counter_ns() < end:
        time.sleep(0)


def simulate(work: Workload, path: str, k: int, max_steps: int, config: dict[str, Any] | None = None,
             gpu_ms: float = 0.0, prices: tuple[float, float] | None = None) -> dict[str, Any]:
    """Run the engine steps of ``work`` through one path; returns per-step times (ns) and counts.
    ``gpu_ms``: the accelerator's forward pass after each step (:func:`wait_forward`, untimed).
    ``prices``: the ``proposer`` path's step-time line (:func:`stand_in_proposer`)."""
    d = work.drafter(**(config or {}))
    R = work.rows
    tok = np.zeros((R, work.width), np.int32)  # as vLLM's token_ids_cpu: row r = its request's tokens
    length = np.zeros(R, np.int64)  # prompt + output length of the row's rollout
    num = np.zeros(R, np.int64)  # tokens verified so far (vLLM's num_tokens_no_spec)
    seen = np.zeros(R, np.int64)  # tokens given to the drafter (per-row path's own bookkeeping)
    rids: list = [None] * R
    drafts = np.full((R, k), -1, np.int32)
    dlen = np.zeros(R, np.int64)
    budgets = np.full(R, k, np.int64)
    nxt = 0
    perf, cpu = time.perf_counter_ns, time.process_time_ns  # CPU of every thread: the drafter's own included
    wall_ns: list[int] = []
    cpu_ns: list[int] = []
    add_ns: list[int] = []  # the appending part of wall_ns
    life_ns = 0
    steps = 0
    tokens = 0
    cols = np.arange(k)
    prompt_len = np.zeros(R, np.int64)
    if path == "proposer":
        prop, runner = stand_in_proposer(d, k, work.width + k + 2, prices)
        runner.input_batch.num_prompt_tokens = prompt_len
        appended = [0]
        add_batch = d.add_tokens_batch

        def timed_add(*args, **kwargs):  # the appending part of the proposer's step
            a0 = perf()
            try:
                return add_batch(*args, **kwargs)
            finally:
                appended[0] += perf() - a0

        d.add_tokens_batch = timed_add

    def start(r: int) -> bool:
        nonlocal nxt
        if nxt >= len(work.pool):
            return False
        pid, prompt, full = work.pool[nxt]
        rid = ("req", nxt)
        nxt += 1
        n = full.shape[0]
        tok[r, :n] = full
        tok[r, n:] = 0
        length[r] = n
        prompt_len[r] = prompt.shape[0]
        if path == "proposer":  # the proposer starts it in the drafter when it first sees its row
            runner.requests[rid] = SimpleNamespace(sampling_params=SimpleNamespace(extra_args={"das_problem_id": pid}, max_tokens=None))
        else:
            d.start_request(rid, prompt, problem_id=pid)
        rids[r] = rid
        num[r] = prompt.shape[0] + 1  # prefill samples the first output token, no draft
        seen[r] = prompt.shape[0]
        dlen[r] = 0
        return True

    gc.collect()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        t0 = perf()
        for r in range(R):
            start(r)
        life_ns += perf() - t0
        while steps < max_steps:
            # this step's tokens: each row's accepted draft prefix + 1, from its real continuation
            fut = np.take_along_axis(tok, np.minimum(num[:, None] + cols, work.width - 1), axis=1)
            match = (drafts == fut) & (cols < dlen[:, None])
            acc = np.cumprod(match, axis=1).sum(axis=1)
            gained = np.minimum(acc + 1, length - num)
            num += np.where(num > seen, 0, gained)  # a fresh row's prefill token is already counted
            tokens += int((num - seen).sum())
            # the drafter's part of the step (timed)
            if path == "per_row":
                w0, c0 = perf(), cpu()
                for r in range(R):
                    s, e = int(seen[r]), int(num[r])
                    if e > s:
                        d.add_tokens(rids[r], tok[r, s:e])
                wa = perf()
                out = [d.speculate(rids[r], k) for r in range(R)]
                c1, w1 = cpu(), perf()
                for r, dr in enumerate(out):
                    n = dr.tokens.shape[0]
                    drafts[r, :n] = dr.tokens
                    dlen[r] = n
            elif path == "proposer":
                runner.input_batch.req_ids = list(rids)
                sampled = [tok[r, seen[r] : num[r]].tolist() for r in range(R)]  # what vLLM's sampler gives it
                appended[0] = 0
                w0, c0 = perf(), cpu()
                out = prop.propose(sampled, num, tok)
                c1, w1 = cpu(), perf()
                wa = w0 + appended[0]
                drafts[:] = -1
                for r, dr in enumerate(out):
                    drafts[r, : len(dr)] = dr
                    dlen[r] = len(dr)
            else:
                w0, c0 = perf(), cpu()
                d.add_tokens_batch(rids, tok, None, num)
                wa = perf()
                res = d.speculate_batch(rids, budgets)
                c1, w1 = cpu(), perf()
                drafts[:, : res.tokens.shape[1]] = res.tokens
                dlen[:] = res.lengths
            wall_ns.append(w1 - w0)
            add_ns.append(wa - w0)
            cpu_ns.append(c1 - c0)
            steps += 1
            if gpu_ms:
                wait_forward(gpu_ms)
            seen[:] = num
            # finished requests leave, queued ones take their rows (timed apart)
            done = np.flatnonzero(num >= length)
            if done.size:
                t0 = perf()
                ok = True
                for r in done.tolist():
                    if path == "proposer":  # the proposer stops it at its next call (timed in the step)
                        del runner.requests[rids[r]]
                    else:
                        d.stop_request(rids[r])
                    ok = start(r) and ok
                life_ns += perf() - t0
                if not ok:
                    break  # the queue ran dry: fewer rows than asked from here on
    finally:
        if gc_was:
            gc.enable()
    return {"wall_ns": np.asarray(wall_ns, np.int64), "cpu_ns": np.asarray(cpu_ns, np.int64),
            "add_ns": np.asarray(add_ns, np.int64), "steps": steps,
            "proposer": prop.stats.as_dict() if path == "proposer" else None,
            "tokens": tokens, "lifecycle_ns": life_ns, "deferred_ns": d.deferred_ns, "drafter": d.stats()}


def summarize(runs: list[dict[str, Any]], rows: int) -> dict[str, Any]:
    wall = np.min(np.stack([r["wall_ns"] for r in runs]), axis=0) / 1e6
    cpu_ms = np.min(np.stack([r["cpu_ns"] for r in runs]), axis=0) / 1e6
    add = np.min(np.stack([r["add_ns"] for r in runs]), axis=0) / 1e6
    r0 = runs[0]
    return {
        "p50_ms": round(float(np.percentile(wall, 50)), 4),
        "add_p50_ms": round(float(np.percentile(add, 50)), 4),  # appending (the rest of the step: drafting)
        "p99_ms": round(float(np.percentile(wall, 99)), 4),
        "mean_ms": round(float(wall.mean()), 4),
        "cpu_p50_ms": round(float(np.percentile(cpu_ms, 50)), 4),
        "cpu_p99_ms": round(float(np.percentile(cpu_ms, 99)), 4),
        "us_per_row_p50": round(float(np.percentile(wall, 50)) * 1e3 / rows, 3),
        "steps": int(r0["steps"]),
        "tokens_per_row_step": round(r0["tokens"] / (r0["steps"] * rows), 3),
        "lifecycle_ms_mean": round(float(np.mean([r["lifecycle_ns"] for r in runs])) / 1e6 / r0["steps"], 4),
        # the global tree's work on the background thread (``defer_global``: appends, stops), per step: off the step's path
        "deferred_ms_mean": round(float(np.mean([r["deferred_ns"] for r in runs])) / 1e6 / r0["steps"], 4),
        "repeats": len(runs),
        **({"proposer_stats": r0["proposer"]} if r0.get("proposer") else {}),
    }


def measure(iterations, rows: int, k: int, max_steps: int, repeats: int, paths=DEFAULT_PATHS,
            config: dict[str, Any] | None = None, gpu_ms: float = 0.0, prices: tuple[float, float] | None = None,
            context: int = 0) -> dict[str, Any]:
    work = Workload(iterations, rows, context)
    runs: dict[str, list] = {p: [] for p in paths}
    for i in range(repeats):
        for p in (paths if i % 2 == 0 else paths[::-1]):
            print(f"rows {rows}{f', context {context}' if context else ''}: {p} (repeat {i + 1}/{repeats}) ...", file=sys.stderr, flush=True)
            runs[p].append(simulate(work, p, k, max_steps, config, gpu_ms, prices))
    # per_row and batch make the same drafts; the proposer stops a finished request one step
    # later (at its next call, as in the engine), which can change a later draft a little
    steps = {p: {r["steps"] for r in rs} for p, rs in runs.items()}
    if (config or {}).get("defer_global"):  # per-row calls append to the global tree at once: other drafts
        steps = {p: v for p, v in steps.items() if p != "per_row"}
    if len({s for p, v in steps.items() if p != "proposer" for s in v}) > 1 or any(len(v) != 1 for v in steps.values()):
        raise AssertionError(f"the paths drafted differently (steps per run: {steps})")
    out = {p: summarize(rs, rows) for p, rs in runs.items()}
    res = dict(out.get("batch", {}))
    for p in ("per_row", "proposer"):
        if p in out:
            res[p] = out[p]
    res["rows"] = rows
    res["context"] = context or None
    res["context_tokens_mean"] = round(float(np.mean([full.shape[0] for _, _, full in work.pool])), 1)
    res["problems"] = len({pid for pid, _, _ in work.pool})
    res["queued_rollouts"] = len(work.pool)
    return res


def warm_up(iterations, k: int, paths=DEFAULT_PATHS, config: dict[str, Any] | None = None,
            prices: tuple[float, float] | None = None) -> None:
    """Load every kernel (numba's disk cache) and the typed-list code before timing."""
    small = [rs[:8] for rs in iterations]
    for p in paths:
        simulate(Workload(small, 4), p, k, 20, config, prices=prices)
    simulate(Workload(small, PARALLEL_ROWS), "batch", k, 5, config)  # the multi-threaded kernel


def threads_of(config: dict[str, Any]) -> int:
    """Threads the drafter of ``config`` runs a step of ``PARALLEL_ROWS`` rows or more on (its
    appending; its drafting too with the ``mix`` chooser)."""
    from das import DASDrafter

    return DASDrafter(**config)._threads_for(PARALLEL_ROWS)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def format_table(report: dict[str, Any]) -> str:
    """The report as text: one row per running-request count and path (tabulate)."""
    from tabulate import tabulate

    rows = []
    for e in report["rows"].values():
        entries = [("per_row", e.get("per_row")), ("batch", e if "p50_ms" in e else None), ("proposer", e.get("proposer"))]
        for name, x in entries:
            if not x:
                continue
            sp = ""
            if name == "batch" and e.get("per_row"):
                sp = f"{e['per_row']['p50_ms'] / x['p50_ms']:.1f}x"
            times = (float(x[k]) for k in ("p50_ms", "add_p50_ms", "p99_ms", "cpu_p50_ms", "cpu_p99_ms", "us_per_row_p50"))
            rows.append([int(e["rows"]), e.get("context") or "trace", name, *times,
                         int(x["steps"]), float(x["tokens_per_row_step"]), float(x.get("deferred_ms_mean", 0.0)), sp])
    head = ["rows", "context", "path", "p50_ms", "append_p50", "p99_ms", "cpu_p50", "cpu_p99", "us/row", "steps", "tok/row/step", "deferred_ms",
            "speedup_p50"]
    machine = report["machine"]
    title = (f"trace: {report['trace']['path']} ({report['trace']['rollouts']} rollouts, {report['trace']['iterations']} iterations); "
             f"K = {report['k']}; CPU: {machine['cpu']} ({machine['cpu_count']} cores); "
             f"draft threads {report.get('draft_threads', 1)} from {report.get('parallel_rows', '-')} rows; "
             f"forward pass between steps {report.get('gpu_ms', 0.0)} ms")
    if report.get("prices"):
        title += f"; proposer priced at c_base {report['prices']['c_base']} s, c_tok {report['prices']['c_tok']} s per token"
    table = tabulate(rows, head, floatfmt=["", "", "", ".3f", ".3f", ".3f", ".3f", ".3f", ".2f", "", ".3f", ".3f", ""], colalign=[
        "right", "right", "left", "decimal", "decimal", "decimal", "decimal", "decimal", "decimal", "decimal", "decimal", "decimal", "right"])
    return f"{title}\n\n{table}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=None,
                   help="rollout trace (parquet); default: the benchmarks' cached trace under ~/.cache/das/traces, "
                        "recorded with the real model first if missing (integrations.data.trace.cached_trace)")
    p.add_argument("--no-record", action="store_true", help="fail instead of recording a trace when none is cached")
    p.add_argument("--rows", action="append", default=None,
                   help="running requests (comma-separated, repeatable); default 16,64,256,1024")
    p.add_argument("--context", action="append", default=None,
                   help="context lengths in tokens (comma-separated, repeatable), each measured at every --rows: each "
                        "rollout's prompt is lengthened at its front with the trace's text so that its context (prompt + "
                        "output) ends there, as at a GPU's 4K-16K token contexts; 0 (default): the trace's own contexts")
    p.add_argument("--k", type=int, default=DEFAULT_K, help="draft budget per row and step (K)")
    p.add_argument("--max-steps", type=int, default=400, help="engine steps per run at most")
    p.add_argument("--repeats", type=int, default=3, help="runs per path, interleaved (a step's time: its fastest)")
    p.add_argument("--paths", default=",".join(DEFAULT_PATHS), help="some of per_row, batch, proposer (comma-separated)")
    p.add_argument("--gpu-ms", type=float, default=0.0,
                   help="the accelerator's forward pass after each step, ms (waited busy, untimed; with --das "
                        "'{\"defer_global\": true}' the global tree's appends and stops run then); default 0")
    p.add_argument("--prices", default=None, metavar="C_BASE,C_TOK",
                   help="the proposer path's cost budget, priced by the step-time line c_base + c_tok * tokens (seconds): "
                        "it keeps (and drafts) only the tokens an engine with those step times would; default: the fixed "
                        "budget (every draft kept). E.g. 0.019,0.000024: a 7B model on an H100, 25 ms at 256 rows")
    p.add_argument("--das", default=None, help="JSON of DASDrafter settings (e.g. '{\"chooser\": \"walk\"}'); default: the defaults")
    p.add_argument("--json", default=None, help="write the report here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    given = args.rows or [",".join(map(str, DEFAULT_ROWS))]
    rows = sorted({int(x) for arg in given for x in arg.split(",") if x.strip()})
    try:
        contexts = sorted({int(x) for arg in (args.context or ["0"]) for x in arg.split(",") if x.strip()})
    except ValueError:
        contexts = [-1]
    if not contexts or min(contexts) < 0:
        print(f"--context must be token counts >= 0 (comma-separated), got {args.context!r}", file=sys.stderr)
        return 2
    if not rows or min(rows) < 1 or args.k < 1 or args.repeats < 1 or args.max_steps < 1:
        print("--rows, --k, --repeats and --max-steps must be >= 1", file=sys.stderr)
        return 2
    if not args.gpu_ms >= 0:
        print(f"--gpu-ms must be >= 0, got {args.gpu_ms}", file=sys.stderr)
        return 2
    paths = tuple(p for p in PATHS if p in {x.strip() for x in args.paths.split(",")})
    if not paths:
        print(f"--paths must name some of {PATHS}", file=sys.stderr)
        return 2
    prices = None
    if args.prices is not None:
        try:
            prices = tuple(float(x) for x in args.prices.split(","))
        except ValueError:
            prices = ()
        if len(prices) != 2 or not (prices[0] > 0 and prices[1] >= 0) or "proposer" not in paths:
            print(f"--prices must be C_BASE,C_TOK (seconds > 0, seconds per token >= 0) with --paths naming proposer, "
                  f"got {args.prices!r} and --paths {args.paths!r}", file=sys.stderr)
            return 2
    try:
        trace = find_trace(args.trace, record=not args.no_record)
    except FileNotFoundError as exc:
        print(f"step_cost: {exc}", file=sys.stderr)
        return 2
    try:
        config = json.loads(args.das) if args.das else {}
    except json.JSONDecodeError as e:
        print(f"--das must be a JSON object of DASDrafter settings, got {args.das!r}: {e}", file=sys.stderr)
        return 2
    if not isinstance(config, dict):
        print(f"--das must be a JSON object of DASDrafter settings, got {args.das!r}", file=sys.stderr)
        return 2
    iterations = load_trace(trace)
    warm_up(iterations, args.k, paths, config, prices)
    report: dict[str, Any] = {
        "trace": {"path": str(trace), "iterations": len(iterations), "rollouts": sum(len(r) for r in iterations),
                  "mean_output_tokens": round(float(np.mean([r.output.shape[0] for rs in iterations for r in rs])), 1)},
        "k": args.k,
        "das": config,
        "prices": None if prices is None else {"c_base": prices[0], "c_tok": prices[1]},
        "draft_threads": threads_of(config),
        "gpu_ms": args.gpu_ms,
        "parallel_rows": PARALLEL_ROWS,
        "machine": {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
                    "loadavg_1m_at_start": round(os.getloadavg()[0], 2)},
        "rows": {},
    }
    for ctx in contexts:
        for n in rows:  # keyed by the rows, and by rows@context for a --context
            key = f"{n}@{ctx}" if ctx else str(n)
            report["rows"][key] = measure(iterations, n, args.k, args.max_steps, args.repeats, paths, config, args.gpu_ms, prices, ctx)
    report["machine"]["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    print(format_table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
