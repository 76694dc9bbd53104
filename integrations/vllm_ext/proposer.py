"""DAS as a vLLM ``custom_class`` speculative proposer: the adapter between vLLM's rows and DAS.

Use from plain vLLM, no registration step::

    LLM(model=..., speculative_config={
            "method": "custom_class",
            "model": "integrations.vllm_ext.proposer.DASProposer",
            "num_speculative_tokens": 8},
        additional_config={"das": {"window": 16, "decay": 0.9}})

vLLM builds ``DASProposer(vllm_config)`` inside its model runner and calls :meth:`propose` once
per engine step with the batch's rows. The interface gives no request ids, and rows move when
requests finish, so the proposer keeps a reference to the model runner that built it and reads
``input_batch.req_ids`` (row -> request) and ``requests[req_id]`` (sampling params, liveness) at
each step. Per-request state is keyed by request id, never by row, which keeps it right when rows
move, requests finish out of order, a request is preempted and resumed (its tokens are
reconciled from ``token_ids_cpu``), prefill is chunked (a row that sampled nothing gets no
draft), and n > 1 samples share a prompt (each sample is its own request, all in one problem tree).

Per-request options ride on ``SamplingParams.extra_args`` (``das_problem_id``, ``das_max_draft_tokens``,
``das_warmup``: :func:`integrations.vllm_ext.request_state.request_options`). Settings
(``additional_config['das']``): the keys of :class:`das.config.DASConfig`; the speculation budget
(``budget``, default ``cost``) is one of :data:`BUDGETS` (:mod:`scheduler.budgets`), and
``c_base``/``c_tok`` (seconds) fix the step price instead of the online fit. What is measured and
decided per step is the :class:`scheduler.planner.StepPlanner`'s; this module maps rows to
requests, keeps their state, counts, isolates failures and writes the step log.

One step reads top to bottom in :meth:`DASProposer._propose`: reconcile the rows' tokens and
verification outcomes, record the step that just ended (:meth:`StepPlanner.record_step`), ask the
planner for this step's plan (:meth:`StepPlanner.plan`), run the drafter once with it, and ask
which drafted tokens the step verifies (:meth:`StepPlanner.keep`). Counters are the planner's one
:class:`scheduler.planner.StepStats` (``stats``).

Step log: with ``step_log`` set to a file path (``additional_config['das']['step_log']``;
:func:`integrations.vllm_ext.engine.make_llm` also takes it from ``DAS_STEP_LOG``), every clean
decode step is appended to it as one JSON line (:data:`STEP_LOG_FIELDS`): its rows, draft tokens, accepted draft tokens and what
its drafts' calibrated probabilities predicted, its seconds, whether the cost fit used it
(``false``: an idle gap or a warm-up step) and the step price fitted after it (``null`` before one
exists; ``knee``: tokens verified below which drafts are free, 0 for the line; ``c_ctx``: seconds
per KV token read, 0 for the line); each line has its ``pid`` (engines in several processes may
share one file).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from itertools import repeat
from typing import Any

import numpy as np

from das.config import BUDGET_KEYS, das_config
from das.drafter import DASDrafter
from das.warmup import warm_up
from integrations.vllm_ext.request_state import LengthHistory, RequestState, request_options
from scheduler import budgets
from scheduler.budget_protocol import Drafts, RowFacts, StepView
from scheduler.planner import StepPlanner

logger = logging.getLogger(__name__)

BUDGETS = budgets.names("proposer")  # the budgets that run here (scheduler.budgets)
STEP_LOG_FIELDS = ("pid", "t", "rows", "draft_tokens", "accepted", "predicted", "seconds", "step_tokens", "context_tokens",
                   "fitted", "c_base", "c_row", "c_draft", "c_spec", "c_ctx", "knee", "payoff_scale")  # one JSON line per clean step (step_log)


def das_section(additional_config: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any], str | None]:
    """Check the ``das`` section of vLLM's ``additional_config`` against :class:`das.config.DASConfig`.

    Returns:
        ``(drafter_kwargs, budget_kwargs, step_log)``: every :class:`das.drafter.DASDrafter`
        argument (defaults filled in), the step-budget settings ``budget`` (one of
        :data:`BUDGETS`) and, when given, ``c_base`` and ``c_tok`` (seconds), and the step log's
        path (None: no step log).

    Raises:
        ValueError: the section is not a mapping, has unknown keys or bad values; the message names
            the key, the value and what was expected.
    """
    cfg = das_config((additional_config or {}).get("das", {}))
    budget = cfg.section(frozenset(BUDGET_KEYS))
    try:
        budgets.resolve(budget["budget"], "proposer")
    except ValueError as exc:
        raise ValueError(f"additional_config['das']['budget']: {exc}") from None
    return cfg.drafter_kwargs(), budget, cfg.step_log


def owner_on_stack(class_suffix: str, skip: int = 1) -> Any | None:
    """The nearest ``self`` on the call stack, from ``skip`` frames above the caller's on, whose class, or a base of it, is named
    ``...class_suffix`` (vLLM builds the proposer inside its model runner's ``__init__``, itself inside
    the worker's ``init_device``), or None."""
    frame = sys._getframe(skip + 1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and any(c.__name__.endswith(class_suffix) for c in type(owner).__mro__):
            return owner
        frame = frame.f_back
    return None


def _find_model_runner() -> Any | None:
    """The model runner whose ``__init__`` is constructing us (vLLM builds the drafter there); its
    ``requests`` and ``input_batch`` may not exist yet at that point, so they are read per step."""
    return owner_on_stack("ModelRunner", skip=2)


def drafting_rank(vllm_config: Any) -> bool:
    """Whether this worker's drafts reach vLLM's scheduler, so that it must build trees and draft.

    vLLM takes the drafts (``take_draft_token_ids``) and the sampled tokens of one worker only: the
    first tensor-parallel (and prefill-context-parallel) rank of the last pipeline stage
    (``MultiprocExecutor._get_output_rank``, ``RayDistributedExecutor``'s output rank); the others
    verify the drafts the scheduler sends every rank. With the ``external_launcher`` backend (one
    engine per rank, each with its own scheduler) every rank drafts. True outside a vLLM engine
    (stand-in runners), and whenever vLLM's parallel groups cannot be read.
    """
    parallel = getattr(vllm_config, "parallel_config", None)
    if parallel is None or getattr(parallel, "distributed_executor_backend", None) == "external_launcher":
        return True
    try:
        from vllm.distributed import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return True
        if ps.get_tp_group().rank_in_group != 0 or not ps.get_pp_group().is_last_rank:
            return False
        pcp = getattr(ps, "get_pcp_group", None)
        return pcp is None or getattr(ps, "_PCP", None) is None or pcp().rank_in_group == 0
    except Exception:  # noqa: BLE001 - another vLLM's parallel state: draft, as a single rank would
        return True


class IdleProposer:
    """The proposer of a worker whose drafts vLLM does not use (:func:`drafting_rank`): empty drafts,
    no drafter, no threads, no memory; the control verbs do nothing and ``drafting`` is False."""

    drafting = False

    def __init__(self, vllm_config: Any = None, runner: Any | None = None):
        self.k = int(vllm_config.speculative_config.num_speculative_tokens) if vllm_config is not None else 0

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        pass

    def propose(self, sampled_token_ids: list[list[int]], *args: Any, **kwargs: Any) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]

    def begin_iteration(self, policy_version: int) -> None:
        pass

    def snapshot(self) -> dict[str, Any]:
        return {}


class DASProposer:
    """vLLM ``custom_class`` proposer backed by a :class:`das.drafter.DASDrafter`.

    On a tensor-parallel rank whose drafts vLLM does not use, constructing it gives an
    :class:`IdleProposer` instead (:func:`drafting_rank`).

    Args:
        vllm_config: vLLM's ``VllmConfig``; reads ``speculative_config.num_speculative_tokens``
            (K, the most draft tokens per row and step), ``model_config.max_model_len`` and
            ``additional_config['das']`` (drafter settings, see :func:`das_section`).

    Raises:
        ValueError: bad ``additional_config['das']`` (at engine start, never during a step).
        RuntimeError: not built by a vLLM model runner (then rows cannot be mapped to requests).
    """

    drafting = True

    def __new__(cls, vllm_config: Any = None, *args: Any, **kwargs: Any):
        if vllm_config is not None and not drafting_rank(vllm_config):
            return IdleProposer(vllm_config)
        return super().__new__(cls)

    def __init__(self, vllm_config: Any, runner: Any | None = None):
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        drafter_cfg, budget_cfg, step_log = das_section(getattr(vllm_config, "additional_config", None))
        if drafter_cfg.get("defer_global") is None:  # the global tree's appends overlap a GPU's forward pass
            from integrations.vllm_ext.cpu_runtime import is_cpu_build

            drafter_cfg["defer_global"] = not is_cpu_build()
        self.drafter = DASDrafter(**drafter_cfg)
        self._warm_up(drafter_cfg)
        given = (float(budget_cfg["c_base"]), float(budget_cfg["c_tok"])) if "c_base" in budget_cfg else None
        cost = StepPlanner.online_cost(given)
        # Until the cost model is fitted, eq7 leaves the rows' own caps: the drafts spread the step sizes the fit needs.
        setting = budgets.BudgetSetting(max_draft=self.k, cost=cost, draft_while_unfitted=True)
        budget = budgets.make_budget(budget_cfg["budget"], "proposer", setting)
        self._step_log = open(step_log, "a", buffering=1) if step_log else None  # line-buffered: one write per step
        self.planner = StepPlanner(budget, cost=cost, given_costs=given, step_log=self._log_step if self._step_log is not None else None,
                                   max_draft=self.k)
        self.stats = self.planner.stats  # one counter object: the planner's decisions and this adapter's own
        self._last_drafted = 0  # draft tokens verified in the step now running
        self.lengths = LengthHistory()  # the length-aware budgets' history of finished rollouts
        self.runner = runner if runner is not None else _find_model_runner()
        if self.runner is None:
            raise RuntimeError("DASProposer must be constructed by a vLLM model runner (speculative_config method "
                               "'custom_class'); no runner was found on the call stack")
        self._slot_of: dict[str, int] = {}  # live request id -> its slot in self._state
        self._state = RequestState(self.k)
        self._last_error_log = 0.0

    @staticmethod
    def _warm_up(drafter_cfg: dict[str, Any]) -> None:
        """Compile or load the drafter's kernels at engine start (:mod:`das.warmup`); a failure is logged, never raised."""
        try:
            seconds = warm_up(**drafter_cfg)
        except Exception as exc:  # noqa: BLE001 - the engine must start; the kernels still compile on first use
            logger.warning("das: warming up the drafter's kernels failed (%s); they compile in the first steps instead", exc)
            return
        if seconds > 2.0:  # a warning so that it shows by default: it explains a slow engine start
            logger.warning("das: compiled the drafter's kernels at engine start in %.1f s (cached on disk: once per install or update)",
                           seconds)

    # vLLM calls load_model on drafters; we have no model.
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        pass

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings: Any = None) -> list[list[int]]:
        """Draft tokens for every row of this engine step: one list of at most K token ids per row.

        ``sampled_token_ids``: per row, the tokens accepted this step (bonus token included; empty
        for a row still in (chunked) prefill); ``num_tokens_no_spec``: ``[max_num_reqs]`` int, tokens
        (prompt + output) per row; ``token_ids_cpu``: ``[max_num_reqs, max_model_len]`` int32, each
        row's tokens. Never raises: a failure gives every row an empty draft, is counted in
        ``stats.failures`` and logged (at most every 10 s).
        """
        t0 = time.perf_counter()
        try:
            drafts = self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        except Exception:
            self.stats.failures += 1
            drafts = [[] for _ in sampled_token_ids]
            if t0 - self._last_error_log > 10.0:
                self._last_error_log = t0
                logger.exception("das: propose failed; this step gets no draft (failures so far: %d)", self.stats.failures)
        self.stats.steps += 1
        self.stats.rows += len(sampled_token_ids)
        self.stats.propose_s += time.perf_counter() - t0
        return drafts

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> list[list[int]]:
        # Vector operations over the rows (each request's numbers are in self._state at its slot);
        # Python per row only for a request seen for the first time and for the output lists.
        now = time.perf_counter()
        requests = self.runner.requests
        st = self._state
        rows = len(sampled_token_ids)
        req_ids = self.runner.input_batch.req_ids
        counts = np.asarray(num_tokens_no_spec[:rows], np.int64)
        slots = np.fromiter(map(self._slot_of.get, req_ids[:rows], repeat(-1, rows)), np.int64, rows)
        clean = rows > 0  # every row decoded last step too: the step time is a fit sample
        for row in np.flatnonzero(slots < 0).tolist():
            slots[row] = self._start(req_ids[row], row, requests, token_ids_cpu)
            clean = False
        cut = st.scheduled(slots, self._scheduled_draft_lengths(rows), self.planner.acceptance)
        if cut:  # only the scheduled draft tokens were verified: outcomes, calibration and step sizes count those
            self._last_drafted -= cut
            self.stats.unscheduled_tokens += cut
        tracked = st.tracked[slots]  # False: bad options, never drafts, leaves nothing in the drafter
        st.seen[slots[~tracked]] = counts[~tracked]
        seen = st.seen[slots]
        gained = counts - seen  # verified tokens since last step (more after a preemption)
        grown = tracked & (gained > 0)
        last_len = st.last_len[slots]
        verified = np.flatnonzero(grown & (last_len > 0) & (gained <= last_len + 1))  # rows whose last drafts were verified
        step_accepted, step_predicted = 0, 0.0  # what the forward pass that just ran accepted, and what its drafts predicted
        if verified.shape[0]:
            vs, acc = slots[verified], gained[verified] - 1
            psum = st.verified(vs, acc)
            step_accepted, step_predicted = self.planner.observe_verified(acc, psum, st.last_probs[vs], last_len[verified])
        grown_rows = np.flatnonzero(grown)
        if grown_rows.shape[0]:  # one numba call inserts every row's verified tokens
            ends = counts[grown_rows]
            st.seen[slots[grown_rows]] = ends
            # Row i of the matrix must be grown_rows[i]: token_ids_cpu itself when they are 0..n-1.
            aligned = grown_rows[-1] == grown_rows.shape[0] - 1
            tokens = token_ids_cpu if aligned else token_ids_cpu[grown_rows, : int(ends.max())]
            self.drafter.add_tokens_batch([req_ids[r] for r in grown_rows.tolist()], tokens, seen[grown_rows], ends)
        step_tokens = int((1 + last_len[tracked]).sum())  # tokens in the forward pass that just ran
        context_tokens = int(counts[tracked].sum())  # KV tokens it read
        sampled = np.fromiter(map(len, sampled_token_ids), np.int64, rows) > 0  # empty: still in (chunked) prefill
        live = tracked & sampled  # rows that may draft this step
        if (tracked & ~sampled).any():
            clean = False
        live_slots = slots[live]
        st.steps[live_slots] += 1
        drafted, self._last_drafted = self._last_drafted, 0
        self.planner.record_step(now, rows, drafted, step_tokens, context_tokens, clean, step_accepted, step_predicted)
        caps = np.where(live, np.minimum(self.k, self.max_model_len - counts - 1), 0)
        caps[live] = np.minimum(caps[live], st.cap[live_slots])  # the request's own das_max_draft_tokens
        view = StepView(caps, live, facts=lambda: self._facts(live_slots, live, req_ids), accepted=st.accepted[live_slots],
                        predicted=st.predicted[live_slots])
        plan = self.planner.plan(view, self.drafter.min_token_prob)
        found = self._speculate(live, plan.caps, req_ids, plan.min_prob)
        n = self.planner.keep(view, found)
        drafting = st.offered(slots, live, n, found.probs, self.planner.acceptance)
        total = int(n.sum())
        self._last_drafted += total
        self.stats.drafts += drafting.shape[0]
        self.stats.draft_tokens += total
        out: list[list[int]] = [[] for _ in range(rows)]
        for row, k, toks in zip(drafting.tolist(), n[drafting].tolist(), found.tokens[drafting].tolist()):
            out[row] = toks[:k]
        if len(self._slot_of) > len(requests):
            self._release_finished(requests)
        return out

    def _scheduled_draft_lengths(self, rows: int) -> np.ndarray | None:
        """Per row, the draft tokens vLLM's scheduler scheduled in the step that just ran (the model
        runner's ``input_batch.spec_token_ids``, set from ``scheduler_output.scheduled_spec_decode_tokens``);
        None when the runner does not say (then every offered token counts as scheduled)."""
        spec = getattr(self.runner.input_batch, "spec_token_ids", None)
        if spec is None or len(spec) < rows:
            return None
        return np.fromiter(map(len, spec[:rows]), np.int64, rows)

    def _facts(self, s: np.ndarray, live: np.ndarray, req_ids: list) -> RowFacts:
        """The length facts of the live rows (slots ``s``), for the length-aware budgets."""
        st = self._state
        pred = self.lengths.predictor(st.max_tokens[s], self.drafter.policy_version)
        pids = [st.problem_id[slot] for slot in s.tolist()]
        return RowFacts(pred, pred.index(pids), (st.seen[s] - st.prompt_len[s]).astype(np.float64), st.max_tokens[s],
                        st.drafted[s].astype(np.float64), st.accepted[s].astype(np.float64), st.steps[s].astype(np.float64))

    def _speculate(self, live: np.ndarray, caps: np.ndarray, req_ids: list, min_prob: np.ndarray | None = None) -> Drafts:
        """Every drafting row's draft from one batched drafter call (length 0 for rows that do not
        draft); row ``r``'s draft stops below ``min_prob[r]`` (None: the drafter's ``min_token_prob``)."""
        rows = live.shape[0]
        sub = np.flatnonzero(live & (caps > 0))
        if not sub.shape[0]:
            return Drafts(np.empty((rows, 0), np.float32), np.zeros(rows, np.int64), np.empty((rows, 0), np.int32))
        found = self.drafter.speculate_batch([req_ids[row] for row in sub.tolist()], caps[sub], None if min_prob is None else min_prob[sub])
        if sub.shape[0] == rows:
            return Drafts(found.probs, found.lengths, found.tokens)
        tokens = np.full((rows, found.tokens.shape[1]), -1, np.int32)
        probs = np.zeros((rows, found.probs.shape[1]), np.float32)
        lengths = np.zeros(rows, np.int64)
        tokens[sub], probs[sub], lengths[sub] = found.tokens, found.probs, found.lengths
        return Drafts(probs, lengths, tokens)

    def _start(self, req_id: str, row: int, requests: dict, token_ids_cpu: np.ndarray) -> int:
        """Bookkeeping for a request seen for the first time (returns its slot); a request with bad options is isolated.

        A bad ``extra_args`` value costs that request its drafts only: it is counted in
        ``stats.bad_requests``, logged, and never enters the drafter. A ``das_warmup`` request is
        kept out of the drafter the same way, without being counted or logged.
        """
        num_prompt = int(self.runner.input_batch.num_prompt_tokens[row])
        state = requests.get(req_id)
        params = state.sampling_params if state is not None else None
        max_tokens = min(int(getattr(params, "max_tokens", None) or self.max_model_len), self.max_model_len)
        pid, cap, tracked = None, 0, False  # untracked: no drafts, never in the drafter (a warm-up or bad request)
        try:
            pid, cap, warm = request_options(params, self.k)
            if not warm:
                pid = self.drafter.start_request(req_id, token_ids_cpu[row, :num_prompt], problem_id=pid)
                tracked = True
        except Exception as exc:  # noqa: BLE001 - one request's bad input must not stop the batch
            self.stats.bad_requests += 1
            logger.warning("das: request %s gets no drafts: %s", req_id, exc)
        slot = self._slot_of[req_id] = self._state.take(num_prompt, max_tokens, int(cap) if tracked else 0, tracked, pid if tracked else None)
        return slot

    def _log_step(self, record: dict[str, Any]) -> None:
        rec = {"pid": os.getpid(), **record}
        self._step_log.write(json.dumps({k: rec[k] for k in STEP_LOG_FIELDS}) + "\n")

    @property
    def predictor(self) -> Any:
        """The :class:`scheduler.predictor.LengthPredictor` of the finished rollouts' lengths (None until a budget first reads it)."""
        return self.lengths.model

    def _release_finished(self, requests: dict) -> None:
        # A finished request leaves the runner's request table (a preempted one stays); its
        # rollout stays in the problem tree, only the per-request state is freed, and its length
        # joins the history the length-aware budgets learn from.
        st = self._state
        for req_id in [r for r in self._slot_of if r not in requests]:
            slot = self._slot_of.pop(req_id)
            st.free.append(slot)
            if not st.tracked[slot]:
                continue
            self.lengths.finished(st.problem_id[slot], int(st.seen[slot] - st.prompt_len[slot]))
            self.drafter.stop_request(req_id)

    # ---- control verbs, reached from the driver through LLM.collective_rpc (see integrations.vllm_ext.control)
    def begin_iteration(self, policy_version: int) -> None:
        """Advance the drafter's window to ``policy_version`` (see DASDrafter.begin_iteration) and
        add the lengths of the rollouts finished since the last call to the length history."""
        self._release_finished(self.runner.requests)
        self.lengths.flush(self.drafter.policy_version)
        self.drafter.begin_iteration(policy_version)

    def snapshot(self) -> dict[str, Any]:
        """The step counters, the planner's fits and calibration, and drafter memory statistics."""
        return {**self.stats.as_dict(), **self.planner.snapshot(), **{f"drafter_{k}": v for k, v in self.drafter.stats().items()}}
