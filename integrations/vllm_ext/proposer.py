"""DAS as a vLLM ``custom_class`` speculative proposer.

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

Per-request options ride on ``SamplingParams.extra_args``:
``das_problem_id`` (str: the problem's id, instead of the hash of the prompt token ids),
``das_max_draft_tokens`` (int: this request's speculation budget per step, 0 = no drafting) and
``das_warmup`` (bool: a request that only warms the engine up; it gets no drafts and the drafter
never sees it, so no tree and no length history holds it).

Settings (``additional_config['das']``): the keys of :class:`das.config.DASConfig`, which holds
their defaults and ranges; :func:`das_section` checks them when the proposer is built.

Speculation budget (``additional_config['das']['budget']``), one of :data:`BUDGETS` (the budgets
of :mod:`scheduler.budgets` that run in the proposer):

- ``"none"``: no draft tokens; the drafter still receives every verified token. Against an
  engine without speculation this measures what vLLM's speculative path and the inserts cost alone.
- ``"fixed"``: up to K draft tokens per row whenever the drafter finds a match.
- ``"cost"`` (default): keep only the draft tokens whose path probability pays for their
  verification under ``t_step = c_base + c_tok * n_tokens`` (:mod:`scheduler.step_policy`), with
  the drafter's probabilities calibrated online, per probability bin, against the tokens actually
  accepted (:class:`scheduler.calibration.AcceptanceCalibration`; ``snapshot()["reliability"]``).
  The drafter stops each row's draft where the step's prices would cut it anyway (below
  :func:`scheduler.step_policy.keep_bound` at the row's own calibration, or near the last step's
  keep threshold, checked after the selection: :meth:`DASProposer._cutoff`): the same drafts
  reach the engine, for fewer drafter lookups (``ProposerStats.cut_steps`` and ``recut_steps``
  count those steps).
- ``"makespan"``: ``"cost"``, with each row's accepted draft token valued at the time it saves a
  batch that only drains (no request waiting): ``c_row + c_base * q_i``, ``q_i`` the odds that the
  request finishes last given the length predictor's expected remaining length
  (:mod:`scheduler.makespan`), instead of the throughput rule's ``c_row + c_base / B`` for all.
- ``"class"``: DAS's length classes (Long 16, Medium 4, Short 0 draft tokens, capped at K) from
  :class:`scheduler.predictor.LengthPredictor` (per-problem history + length so far).
- ``"eq7"``: DAS Eq. 7 budgets from the predicted remaining length, per-request acceptance
  estimates and the cost model (:class:`scheduler.speculation.SpeculationScheduler`).

The cost model (:class:`scheduler.cost_model.CostModel`) is fitted online from the engine's own
step times (the interval between consecutive ``propose`` calls over pure decode steps), or fixed
with ``c_base``/``c_tok`` (seconds; then no plain step is forced to re-measure the plain price).
Until it is fitted, ``cost`` and ``eq7`` draft as ``fixed``, which also spreads the step sizes
the fit needs. The length history behind ``class`` and ``eq7``
is the lengths of the rollouts this proposer saw finish, added at each ``begin_iteration``.

Step log: with the environment variable ``DAS_STEP_LOG`` set to a file path, every clean decode
step is appended to that file as one JSON line (:data:`STEP_LOG_FIELDS`): its rows, draft tokens
and accepted draft tokens, the accepted draft tokens its drafts' calibrated probabilities
predicted, its seconds, whether the cost fit used it (``false``: an idle gap or a
warm-up step), and the two-regime fit after it (``null`` before one exists). It is how a fit that
prices drafts wrong shows itself (benchmarks/README.md, "Zen 4, the engine's warm-up steps kept
out of the cost fit"). Engines in several processes may share one file: each line has its ``pid``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
import weakref
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np

from das.config import BUDGET_KEYS as _BUDGET_KEYS
from das.config import DRAFTER_KEYS as _DRAFTER_KEYS
from das.config import das_config
from das.drafter import DASDrafter
from das.warmup import warm_up
from scheduler.budgets import names as budget_names
from scheduler.calibration import AcceptanceCalibration
from scheduler.cost_model import CostModel
from scheduler.makespan import last_finish_probability, token_values
from scheduler.regime_cost import TwoRegimeCost
from scheduler.step_policy import choose_drafts, cut_kept_the_same, drafting_can_pay, keep_bounds, raw_cutoffs

logger = logging.getLogger(__name__)

# Live proposers of this process, so an in-process driver can reach them (tests, tools).
_INSTANCES: weakref.WeakSet[DASProposer] = weakref.WeakSet()

DRAFTER_KEYS = frozenset(_DRAFTER_KEYS)
BUDGET_KEYS = frozenset(_BUDGET_KEYS)
BUDGETS = budget_names("proposer")  # the budgets that run here (scheduler.budgets)
PRICED = ("cost", "makespan")  # budgets that price each step's drafts with the two-regime cost model
SCREEN_STEPS = 8  # the engine's first clean steps, held back and screened against their median (warm-up)
STEP_LOG_FIELDS = ("pid", "t", "rows", "draft_tokens", "accepted", "predicted", "seconds", "step_tokens", "context_tokens",
                   "fitted", "c_base", "c_row", "c_draft", "c_spec", "payoff_scale")  # one JSON line per clean step (DAS_STEP_LOG)


GUESS_SHARE = 0.9  # a step's drafts are cut at this share of the last step's keep threshold (checked after the selection)
GUESS_ROWS = 128  # ... in steps of this many rows or more, where that threshold moves little from step to step


class _Cut(NamedTuple):
    """Where a priced step's drafts stop: ``raw``, float64 ``[rows]`` path probabilities (each
    row's calibration turns them into its calibrated bound), from the calibrated ``theta`` (the
    throughput rule: a guess at or above its ``bound``, :func:`scheduler.step_policy.keep_bound`;
    the saving rule: each row's own bound, ``theta`` and ``bound`` 0)."""

    raw: np.ndarray
    theta: float
    bound: float


class _Step(NamedTuple):
    """One clean decode step, as the cost models and the step log see it."""

    t: float  # perf_counter seconds at its end (the next propose call)
    rows: int
    draft_tokens: int  # draft tokens it verified
    accepted: int  # of those, accepted
    predicted: float  # accepted draft tokens its drafts' calibrated probabilities predicted
    seconds: float
    step_tokens: int  # tokens in its forward pass
    context_tokens: int  # KV tokens it read


@dataclasses.dataclass
class ProposerStats:
    """Counters of one proposer since it was built (or last reset)."""

    steps: int = 0  # propose() calls
    fitted_steps: int = 0  # steps whose budget came from the fitted cost model
    skipped_steps: int = 0  # steps the cost model ruled out drafting for (no drafter lookups at all)
    cut_steps: int = 0  # steps whose drafts stopped at the step's price, above the drafter's own cutoff
    recut_steps: int = 0  # of those, steps whose guessed cutoff the selection refused: drafted again at the safe one
    rows: int = 0  # rows seen, all steps
    drafts: int = 0  # rows that got a non-empty draft
    draft_tokens: int = 0
    failures: int = 0  # propose() calls that raised and returned empty drafts
    bad_requests: int = 0  # requests with bad extra_args: no drafts for them, nothing in the drafter
    propose_s: float = 0.0  # wall seconds inside propose()

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(slots=True)
class _Req:
    """What the proposer keeps per live request that a step does not touch; the rest is in
    :class:`_ReqState` at ``slot``."""

    problem_id: Any  # None for a request with bad options (``_ReqState.tracked`` False at its slot)
    slot: int


class _ReqState:
    """Per-request numbers a step reads and writes, one array each, indexed by the request's slot,
    so that a step's bookkeeping is a few vector operations over its rows, not a Python loop
    (``benchmarks/README.md``, "Step cost": the loop took 0.76 ms a step at 256 rows).

    ``seen``: tokens (prompt + output) given to the drafter (``prompt_len`` of them the prompt's,
    at most ``max_tokens`` output tokens); ``cap``: the request's own draft cap
    per step (``das_max_draft_tokens``, default K); ``drafted`` / ``accepted``: draft tokens offered
    / accepted so far; ``steps``: verification steps so far; ``last_len``: draft tokens offered
    last step, ``last_psum`` the sum of their calibrated path probabilities and ``last_probs[:, :k]``
    their raw path probabilities (float32, for the reliability bins); ``predicted``: the sum of the
    path probabilities of all drafts offered (expected accepted); ``tracked``: False for a request
    with bad options."""

    INT = ("seen", "cap", "drafted", "accepted", "steps", "last_len", "prompt_len", "max_tokens")
    FLOAT = ("last_psum", "predicted")

    def __init__(self, k: int, slots: int = 64):
        for name in self.INT:
            setattr(self, name, np.zeros(slots, np.int64))
        for name in self.FLOAT:
            setattr(self, name, np.zeros(slots, np.float64))
        self.tracked = np.zeros(slots, bool)
        self.last_probs = np.zeros((slots, max(k, 1)), np.float32)
        self.free = list(range(slots - 1, -1, -1))

    def take(self, prompt_len: int, max_tokens: int, cap: int, tracked: bool) -> int:
        """A slot for a new request, its numbers zeroed (twice the arrays when none is free)."""
        if not self.free:
            n = self.seen.shape[0]
            for name in (*self.INT, *self.FLOAT, "tracked", "last_probs"):
                a = getattr(self, name)
                setattr(self, name, np.concatenate([a, np.zeros_like(a)]))
            self.free = list(range(2 * n - 1, n - 1, -1))
        i = self.free.pop()
        for name in self.INT:
            getattr(self, name)[i] = 0
        for name in self.FLOAT:
            getattr(self, name)[i] = 0.0
        self.seen[i] = self.prompt_len[i] = prompt_len
        self.max_tokens[i] = max_tokens
        self.cap[i] = cap
        self.tracked[i] = tracked
        return i


def das_section(additional_config: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Check the ``das`` section of vLLM's ``additional_config`` against :class:`das.config.DASConfig`.

    Returns:
        ``(drafter_kwargs, budget_kwargs)``: every :class:`das.drafter.DASDrafter` argument (defaults
        filled in) and the step-budget settings ``budget`` (one of :data:`BUDGETS`) and, when
        given, ``c_base`` and ``c_tok`` (seconds).

    Raises:
        ValueError: the section is not a mapping, has unknown keys or bad values; the message names
            the key, the value and what was expected.
    """
    cfg = das_config((additional_config or {}).get("das", {}))
    budget = cfg.section(BUDGET_KEYS)
    return cfg.drafter_kwargs(), budget


def _find_model_runner() -> Any | None:
    """The model runner whose ``__init__`` is constructing us (vLLM builds the drafter there).

    Its ``requests`` and ``input_batch`` may not exist yet at that point; they are read per step.
    """
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and any(c.__name__.endswith("ModelRunner") for c in type(owner).__mro__):
            return owner
        frame = frame.f_back
    return None



def _likeliest_rows(probs: np.ndarray, lengths: np.ndarray, per_row: int, total: int) -> np.ndarray:
    """Draft tokens to keep per row: up to ``per_row`` on the rows whose first draft token is likeliest, ``total`` at most.

    Args:
        probs: float32 ``[rows, K]`` path probabilities, the first ``lengths[r]`` of row ``r``.
        lengths: int64 ``[rows]`` draft lengths.
        per_row, total: caps in tokens.

    Returns:
        int64 array of kept draft tokens per row.
    """
    keep = np.zeros(lengths.shape[0], np.int64)
    first = np.where(lengths > 0, probs[:, 0], -1.0) if probs.shape[1] else np.full(lengths.shape[0], -1.0)
    for row in np.argsort(-first, kind="stable").tolist():
        if total <= 0 or first[row] < 0:
            break
        keep[row] = min(per_row, int(lengths[row]), total)
        total -= keep[row]
    return keep

class DASProposer:
    """vLLM ``custom_class`` proposer backed by a :class:`das.drafter.DASDrafter`.

    Args:
        vllm_config: vLLM's ``VllmConfig``; reads ``speculative_config.num_speculative_tokens``
            (K, the most draft tokens per row and step), ``model_config.max_model_len`` and
            ``additional_config['das']`` (drafter settings, see :func:`das_section`).

    Raises:
        ValueError: bad ``additional_config['das']`` (at engine start, never during a step).
        RuntimeError: not built by a vLLM model runner (then rows cannot be mapped to requests).
    """

    def __init__(self, vllm_config: Any, runner: Any | None = None):
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        drafter_cfg, budget_cfg = das_section(getattr(vllm_config, "additional_config", None))
        if drafter_cfg.get("defer_global") is None:  # the global tree's appends overlap a GPU's forward pass
            from integrations.vllm_ext.cpu_runtime import is_cpu_build

            drafter_cfg["defer_global"] = not is_cpu_build()
        self.drafter = DASDrafter(**drafter_cfg)
        self._warm_up(drafter_cfg)
        self.budget = budget_cfg["budget"]
        prior = (float(budget_cfg["c_base"]), float(budget_cfg["c_tok"])) if "c_base" in budget_cfg else None
        # A given (c_base, c_tok) is used as is: a prior no measured step outweighs.
        self.cost = CostModel(forgetting=0.995, prior=prior, prior_weight=1e12 if prior else 8.0)
        self.regimes = TwoRegimeCost(refit_every=4)  # plain vs speculative step times, for the ``cost`` budget
        self._given_costs = prior  # the user's (c_base, c_tok): used as is instead of the fit
        self._exploring = False  # this step drafts only to re-measure acceptance (see _cost_allows_drafts)
        self._skipped_run = 0  # steps ruled out since the last one that drafted
        # Measured steps since the last plain one: when every step drafts, the fit cannot tell a
        # speculative step's own fixed cost from the base cost, and prices plain steps too high.
        self._since_plain = 0
        self._last_drafted = 0  # draft tokens verified in the step now running
        self.scheduler = None  # SpeculationScheduler, built on the first step (needs max_tokens)
        self.predictor = None  # LengthPredictor of the class, eq7 and makespan budgets, built on first use
        self._finished_lengths: dict[str, list[int]] = {}  # problem id -> output lengths, since last iteration
        self.runner = runner if runner is not None else _find_model_runner()
        if self.runner is None:
            raise RuntimeError(
                "DASProposer must be constructed by a vLLM model runner (speculative_config method "
                "'custom_class'); no runner was found on the call stack"
            )
        self.stats = ProposerStats()
        self._reqs: dict[str, _Req] = {}  # live request id -> its bookkeeping
        self._slot_of: dict[str, int] = {}  # live request id -> its slot in self._state
        self._state = _ReqState(self.k)
        self._last_start: float | None = None
        # Seconds per clean step and per forward token (EMAs), to drop idle gaps from the fit. A step is
        # a gap only if it is long against both: against the step EMA alone, the first full batch
        # after small warm-up steps (or a tail) looked like gaps for ever, since dropped steps never
        # moved the EMA, and the fit saw only the cheapest steps (a full batch's first iteration
        # then drafted 3x as much as it should, at 0.72x no speculation).
        self._interval_ema: float | None = None
        self._token_ema: float | None = None
        # The engine's first clean steps, held back until SCREEN_STEPS of them are in (None after):
        # its first decode steps compile and warm kernels and take seconds (seen: 7.2 s and 9.3 s
        # at 2 rows, then 26 ms). With no EMA yet such a step went into the cost fit, and its
        # squared error outweighed hundreds of real steps: c_base 0.42 s, c_row and c_draft 0,
        # so drafts looked free and a 32-row step drafted 80 tokens at 0.95x the plain step's
        # tokens per second, for a whole iteration. (The drafter's own kernels now compile at
        # engine start, :meth:`_warm_up`; the engine's first steps can still be slow.)
        self._held: list[_Step] | None = []
        path = os.environ.get("DAS_STEP_LOG")
        self._step_log = open(path, "a", buffering=1) if path else None  # line-buffered: one write per step
        self._accepted = self._predicted = 0.0  # decayed sums: accepted / calibrated-predicted, what the bins miss
        # Per-probability-bin acceptance factors from verification outcomes: the drafter's high
        # path probabilities are nearly right, its low ones 2x too high (replay: 0.94 -> 0.83,
        # 0.35 -> 0.18), which one scalar factor cannot express.
        self.acceptance = AcceptanceCalibration()
        # Realized payoff of drafting, as a factor on every acceptance probability: drafting
        # steps that yield fewer tokens per second than the fitted plain step would shrink it,
        # paying ones grow it back (at most 1). It guards "never slower" against a cost fit or
        # a calibration that is too optimistic (seen on an AVX2 CPU, where a draft token costs
        # about what a row costs).
        self._payoff_scale = 1.0
        self._keep_rate: float | None = None  # the last priced step's selection peaked at this rate (tokens/s)
        self._last_error_log = 0.0
        _INSTANCES.add(self)

    @staticmethod
    def _warm_up(drafter_cfg: dict[str, Any]) -> None:
        """Compile or load the drafter's kernels now, at engine start, not in the first decode
        steps (:mod:`das.warmup`: with a stale numba cache those took 8-12 s of the first
        iteration). A failure here only moves that work back to the first steps: logged, never raised."""
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

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """Draft tokens for every row of this engine step.

        Args:
            sampled_token_ids: per row, the tokens accepted this step (bonus token included);
                empty for a row still in (chunked) prefill.
            num_tokens_no_spec: ``[max_num_reqs]`` int, tokens (prompt + output) per row.
            token_ids_cpu: ``[max_num_reqs, max_model_len]`` int32, each row's tokens.
            slot_mappings: unused.

        Returns:
            One list of at most K draft token ids per row. Never raises: a failure gives every row
            an empty draft, is counted in ``stats.failures`` and logged (at most every 10 s).
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
        batch = self.runner.input_batch
        requests = self.runner.requests
        drafter = self.drafter
        st = self._state
        rows = len(sampled_token_ids)
        req_ids = batch.req_ids
        counts = np.asarray(num_tokens_no_spec[:rows], np.int64)
        slots = np.fromiter(map(self._slot_of.get, req_ids[:rows], repeat(-1, rows)), np.int64, rows)
        clean = rows > 0  # every row decoded last step too: the step time is a fit sample
        for row in np.flatnonzero(slots < 0).tolist():
            slots[row] = self._start(req_ids[row], row, requests, token_ids_cpu).slot
            clean = False
        tracked = st.tracked[slots]  # False: bad options, never drafts, leaves nothing in the drafter
        st.seen[slots[~tracked]] = counts[~tracked]
        seen = st.seen[slots]
        gained = counts - seen  # verified tokens since last step (more after a preemption)
        grown = tracked & (gained > 0)
        last_len = st.last_len[slots]
        verified = np.flatnonzero(grown & (last_len > 0) & (gained <= last_len + 1))  # rows whose last drafts were verified
        step_accepted = 0  # draft tokens the forward pass that just ran accepted
        step_predicted = 0.0  # what the calibrated probabilities of its drafts predicted for that (step log)
        if verified.shape[0]:
            vs = slots[verified]
            acc = gained[verified] - 1
            psum = st.last_psum[vs]
            st.accepted[vs] += acc
            st.predicted[vs] += psum
            # the EMAs over these rows in row order: 0.99 per row, as one row after the other
            m = verified.shape[0]
            fade = 0.99 ** np.arange(m - 1, -1, -1)
            self._accepted = 0.99**m * self._accepted + float(fade @ acc)
            self._predicted = 0.99**m * self._predicted + float(fade @ psum)
            step_accepted, step_predicted = int(acc.sum()), float(psum.sum())
            cols = np.arange(st.last_probs.shape[1])
            offered = cols < last_len[verified][:, None]  # last step's draft tokens, row by row
            self.acceptance.observe(st.last_probs[vs][offered], (cols < acc[:, None])[offered])
        grown_rows = np.flatnonzero(grown)
        if grown_rows.shape[0]:  # one numba call inserts every row's verified tokens
            ends = counts[grown_rows]
            st.seen[slots[grown_rows]] = ends
            # Row i of the matrix must be grown_rows[i]: token_ids_cpu itself when they are 0..n-1.
            aligned = grown_rows[-1] == grown_rows.shape[0] - 1
            tokens = token_ids_cpu if aligned else token_ids_cpu[grown_rows, : int(ends.max())]
            drafter.add_tokens_batch([req_ids[r] for r in grown_rows.tolist()], tokens, seen[grown_rows], ends)
        step_tokens = int((1 + last_len[tracked]).sum())  # tokens in the forward pass that just ran
        context_tokens = int(counts[tracked].sum())  # KV tokens it read
        sampled = np.fromiter(map(len, sampled_token_ids), np.int64, rows) > 0  # empty: still in (chunked) prefill
        live = tracked & sampled  # rows that may draft this step
        if (tracked & ~sampled).any():
            clean = False
        st.steps[slots[live]] += 1
        self._record_step(now, step_tokens, context_tokens, clean, rows, step_accepted, step_predicted)
        budgets = np.where(live, np.minimum(self.k, self.max_model_len - counts - 1), 0)
        budgets = np.minimum(budgets, self._request_caps(slots, live, req_ids))
        if self.budget == "none":  # the speculative path and the inserts with no drafts: their cost alone
            budgets[:] = 0
        prices = cal = values = None
        if self.budget in PRICED:  # priced once per step, used by the gate and by the selection
            prices, cal = self._prices(rows), self._row_calibration(slots, live)
            if self.budget == "makespan" and prices is not None:
                values = self._values(slots, live, req_ids)
        if self.budget in PRICED and not self._cost_allows_drafts(budgets, prices, cal, values):
            self.stats.skipped_steps += 1
            self._skipped_run += 1
            budgets[:] = 0  # drafting cannot pay this step: skip the drafter's lookups too
        cut = self._cutoff(rows, prices, cal, values) if budgets.any() else None
        peak: dict = {}
        tokens, probs, lengths = self._speculate(live, budgets, req_ids, None if cut is None else cut.raw)
        keep = self._step_budget(probs, lengths, prices, cal, values, peak)
        if cut is not None and not cut_kept_the_same(cut.theta, cut.bound, prices[2], peak):
            # the guess cut drafts the selection might have kept: draft again, down to the safe cutoff
            self.stats.recut_steps += 1
            peak = {}
            tokens, probs, lengths = self._speculate(live, budgets, req_ids, self._row_cutoffs(cut.bound, cal))
            keep = self._step_budget(probs, lengths, prices, cal, values, peak, recount=False)
        if peak.get("tokens"):  # the throughput rule's selection peaked: the next step's guess
            self._keep_rate = peak["rate"]
        n = lengths if keep is None else np.minimum(keep, lengths)
        out: list[list[int]] = [[] for _ in range(rows)]
        drafting = np.flatnonzero(n)
        total = int(n.sum())
        self._last_drafted += total
        self.stats.drafts += drafting.shape[0]
        self.stats.draft_tokens += total
        idle = slots[live & (n == 0)]  # live rows without a draft this step
        st.last_len[idle] = 0
        st.last_psum[idle] = 0.0
        if drafting.shape[0]:
            # a row's kept tokens and probabilities, and their calibrated sum (expected accepted tokens)
            ns = n[drafting]
            kept = probs[drafting][np.arange(probs.shape[1]) < ns[:, None]]
            ds = slots[drafting]
            st.last_len[ds] = ns
            st.last_probs[ds, : probs.shape[1]] = probs[drafting]
            st.last_psum[ds] = np.add.reduceat(self.acceptance(kept), np.cumsum(ns) - ns)
            st.drafted[ds] += ns
            for row, k, toks in zip(drafting.tolist(), ns.tolist(), tokens[drafting].tolist()):
                out[row] = toks[:k]
        if len(self._reqs) > len(requests):
            self._release_finished(requests)
        return out

    def _cutoff(self, rows: int, prices: tuple | None, cal: np.ndarray | None, values: np.ndarray | None) -> _Cut | None:
        """Where this step's drafts may stop (None: at the drafter's own ``min_token_prob``).

        A priced step keeps only the draft tokens :func:`choose_drafts` selects; drafting the
        others costs the drafter's lookups for tokens that are thrown away. None is kept whose
        calibrated probability is at or below :func:`keep_bound` (the saving rule: each row's
        own), so each row stops at the raw probability its own calibration factor maps there
        (:func:`raw_cutoffs`): the same tokens and the same learning (the drafter learns from the
        token after a cut as from the token it stopped before).
        The tokens kept end near the last step's keep threshold, ``per_draft_s`` times the rate
        its selection peaked at, well above that bound (1.45x at 256 rows, benchmarks/README.md):
        under the throughput rule, in steps of :data:`GUESS_ROWS` rows or more, the cut is
        guessed at :data:`GUESS_SHARE` of that threshold, and :func:`cut_kept_the_same` checks
        after the selection that the guess lost nothing (else the step drafts again at the
        bound). On ``benchmarks.step_cost``'s DSR-sub workload priced as a 7B model on an H100 the
        guess drafts 14% fewer positions than the bound at 256 rows (7 of 357 steps drafted
        again) and 7% fewer at 128; at 4 rows with a CPU's prices it missed in a quarter of the
        steps and drafted 10% more, hence the rows. Warm-up and exploration steps keep drafts by
        another rule: no cutoff there."""
        if self.budget not in PRICED or prices is None or self._exploring:
            return None
        bound = keep_bounds(rows, *prices, values)
        theta = bound
        if values is None and self._keep_rate is not None and rows >= GUESS_ROWS:
            theta = max(bound, GUESS_SHARE * prices[2] * self._keep_rate)
        raw = self._row_cutoffs(theta, cal)
        if not (raw > self.drafter.min_token_prob).any():
            return None
        self.stats.cut_steps += 1
        if values is not None:
            theta = bound = 0.0  # per-row bounds, no guess: nothing to check after the selection
        return _Cut(raw, theta, bound)

    def _row_cutoffs(self, theta: float | np.ndarray, cal: np.ndarray) -> np.ndarray:
        """float64 ``[rows]``: where each row's draft stops for a calibrated bound ``theta`` (its own
        calibration factor's :func:`raw_cutoffs`), never below the drafter's ``min_token_prob``."""
        return np.maximum(raw_cutoffs(theta, cal, self.acceptance.curve()), self.drafter.min_token_prob)

    def _speculate(self, live: np.ndarray, budgets: np.ndarray, req_ids: list,
                   min_prob: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every drafting row's draft from one batched drafter call: ``(tokens int32[rows, K], probs
        float32[rows, K], lengths int64[rows])``, length 0 for rows that do not draft; row ``r``'s
        draft stops below ``min_prob[r]`` (None: the drafter's ``min_token_prob``)."""
        rows = live.shape[0]
        sub = np.flatnonzero(live & (budgets > 0))
        if not sub.shape[0]:
            return np.empty((rows, 0), np.int32), np.empty((rows, 0), np.float32), np.zeros(rows, np.int64)
        found = self.drafter.speculate_batch([req_ids[row] for row in sub.tolist()], budgets[sub],
                                             None if min_prob is None else min_prob[sub])
        if sub.shape[0] == rows:
            return found.tokens, found.probs, found.lengths
        tokens = np.full((rows, found.tokens.shape[1]), -1, np.int32)
        probs = np.zeros((rows, found.probs.shape[1]), np.float32)
        lengths = np.zeros(rows, np.int64)
        tokens[sub], probs[sub], lengths[sub] = found.tokens, found.probs, found.lengths
        return tokens, probs, lengths

    def _start(self, req_id: str, row: int, requests: dict, token_ids_cpu: np.ndarray) -> _Req:
        """Bookkeeping for a request seen for the first time; a request with bad options is isolated.

        A bad ``extra_args`` value costs that request its drafts only: it is counted in
        ``stats.bad_requests``, logged, and never enters the drafter. A ``das_warmup`` request is
        kept out of the drafter the same way, without being counted or logged.
        """
        batch = self.runner.input_batch
        num_prompt = int(batch.num_prompt_tokens[row])
        state = requests.get(req_id)
        params = state.sampling_params if state is not None else None
        max_tokens = min(int(getattr(params, "max_tokens", None) or self.max_model_len), self.max_model_len)
        pid, cap, tracked = None, 0, False  # untracked: no drafts, never in the drafter (a warm-up or bad request)
        try:
            extra = getattr(params, "extra_args", None) or {}
            if not isinstance(extra, dict):
                raise ValueError(f"extra_args must be a dict, got {type(extra).__name__}")
            cap = extra.get("das_max_draft_tokens", self.k)
            if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 0:
                raise ValueError(f"das_max_draft_tokens must be an int >= 0, got {cap!r}")
            pid = extra.get("das_problem_id")
            if pid is not None and not isinstance(pid, (str, int)):
                raise ValueError(f"das_problem_id must be a str or int, got {type(pid).__name__}: {pid!r}")
            warm = extra.get("das_warmup", False)
            if not isinstance(warm, bool):
                raise ValueError(f"das_warmup must be a bool, got {type(warm).__name__}: {warm!r}")
            if not warm:
                pid = self.drafter.start_request(req_id, token_ids_cpu[row, :num_prompt], problem_id=pid)
                tracked = True
        except Exception as exc:  # noqa: BLE001 - one request's bad input must not stop the batch
            self.stats.bad_requests += 1
            logger.warning("das: request %s gets no drafts: %s", req_id, exc)
        slot = self._slot_of[req_id] = self._state.take(num_prompt, max_tokens, int(cap) if tracked else 0, tracked)
        req = self._reqs[req_id] = _Req(pid if tracked else None, slot)
        return req

    def _request_caps(self, slots: np.ndarray, live: np.ndarray, req_ids: list) -> np.ndarray:
        """Per-row draft caps from the request's own ``das_max_draft_tokens`` and the length policy
        (``slots``: each row's slot in ``self._state``; ``live``: bool, the rows that may draft)."""
        st = self._state
        caps = np.full(slots.shape[0], self.k, np.int64)
        rows = np.flatnonzero(live)
        s = slots[rows]
        caps[rows] = np.minimum(caps[rows], st.cap[s])
        if self.budget not in ("class", "eq7") or not rows.shape[0]:
            return caps
        rs = [self._reqs[req_ids[row]] for row in rows.tolist()]
        if self.scheduler is None:
            from scheduler.speculation import SpeculationScheduler

            self.scheduler = SpeculationScheduler(self.budget, max_draft=self.k, predictor=self._length_predictor(s), cost=self.cost)
        if self.budget == "eq7" and not self.cost.ready:
            return caps  # warm-up: draft freely while the cost model learns
        pred = self.scheduler.predictor
        sched_caps = self.scheduler.caps(
            pred.index([r.problem_id for r in rs]),
            (st.seen[s] - st.prompt_len[s]).astype(np.float64),
            st.drafted[s].astype(np.float64),
            st.accepted[s].astype(np.float64),
            st.steps[s].astype(np.float64),
        )
        caps[rows] = np.minimum(caps[rows], sched_caps)
        return caps

    def _record_step(self, now: float, step_tokens: int, context_tokens: int, clean: bool, rows: int, accepted: int = 0,
                     predicted: float = 0.0) -> None:
        """Feed the interval since the previous step into the cost models, unless it is not a pure decode step."""
        last, self._last_start = self._last_start, now
        drafted, self._last_drafted = self._last_drafted, 0
        if last is None or not clean:
            return
        step = _Step(now, rows, drafted, accepted, predicted, now - last, step_tokens, context_tokens)
        if self._held is None:
            self._observe_step(step)
            return
        self._held.append(step)
        if len(self._held) < SCREEN_STEPS:
            return
        # Screened against their medians: the EMAs start there, so the gap rule below drops the
        # warm-up steps (more than 4x the median) like idle gaps.
        held, self._held = self._held, None
        self._interval_ema = float(np.median([h.seconds for h in held]))
        self._token_ema = float(np.median([h.seconds / max(h.step_tokens, 1) for h in held]))
        for h in held:
            self._observe_step(h)

    def _observe_step(self, step: _Step) -> None:
        """One clean step into the cost models and the payoff scale, unless it is an idle gap; one line
        of the step log (``DAS_STEP_LOG``) either way."""
        fitted = self._fit_step(step)
        if self._step_log is not None:
            c = self.regimes.coefficients() if self.regimes.ready else None
            rec = {"pid": os.getpid(), **step._asdict(), "fitted": fitted}
            rec.update({k: None if c is None else c[k] for k in ("c_base", "c_row", "c_draft", "c_spec")})
            rec["payoff_scale"] = self._payoff_scale
            self._step_log.write(json.dumps({k: rec[k] for k in STEP_LOG_FIELDS}) + "\n")

    def _fit_step(self, step: _Step) -> bool:
        """Feed one clean step to the cost models and the payoff scale; False for an idle gap (left out).
        Only called once the held steps set the EMAs."""
        rows, drafted, interval, tokens = step.rows, step.draft_tokens, step.seconds, step.step_tokens
        if interval > 4.0 * max(self._interval_ema, self._token_ema * tokens):
            return False  # an idle gap between generate() calls, not a step
        self._interval_ema = 0.9 * self._interval_ema + 0.1 * interval
        self._token_ema = 0.9 * self._token_ema + 0.1 * interval / max(tokens, 1)
        self.cost.observe(tokens, interval, step.context_tokens)
        self.regimes.observe(rows, drafted, interval)
        self._since_plain = self._since_plain + 1 if drafted else 0
        if drafted and self.budget in PRICED and self._given_costs is None and self.regimes.ready:
            # tokens per second of this drafting step against the fitted plain step's
            payoff = (rows + step.accepted) / interval * max(self.regimes.plain(rows), 1e-9) / rows
            self._payoff_scale = float(np.clip(self._payoff_scale * payoff**0.1, 0.25, 1.0))
        return True

    def _calibration(self) -> float:
        """Accepted / predicted draft tokens over recent steps, with a prior of 4 tokens at 1.0.

        Predicted with the per-bin calibrated probabilities (:attr:`acceptance`), so this is
        what the bins miss (near 1.0 once they have evidence).

        The prior keeps a run of rejected drafts (say, a junk warm-up request) from pricing every
        later draft at zero, which would stop drafting, and with it the evidence, for good.
        """
        return (self._accepted + 4.0) / (self._predicted + 4.0)

    def _row_calibration(self, slots: np.ndarray, live: np.ndarray) -> np.ndarray:
        """Per-row acceptance calibration: the request's own accepted / predicted, shrunk toward the
        global one (rows not ``live``: the global one)."""
        glob = self._calibration()
        cal = np.full(slots.shape[0], glob)
        s = slots[live]
        cal[live] = (self._state.accepted[s] + 8.0 * glob) / (self._state.predicted[s] + 8.0)
        return cal * self._payoff_scale

    def _cost_allows_drafts(self, budgets: np.ndarray, prices: tuple | None, cal: np.ndarray, values: np.ndarray | None = None) -> bool:
        """``cost`` budget, before any lookup: can a draft pay for its verification this step?

        Warm-up (the two-regime model not fitted yet) alternates plain and drafting steps, so
        both regimes get measured; after it, drafting is ruled out when even drafts at the best
        calibrated acceptance probability would not raise tokens per second.
        """
        rows = len(budgets)
        if rows == 0 or not budgets.any():
            return False
        if prices is not None and self._given_costs is None and self._since_plain >= 16:
            return False  # a plain step now and then keeps the plain regime's price measured (given prices need none)
        if prices is not None and self._skipped_run >= 32:
            self._skipped_run = 0
            self._exploring = True  # after 32 steps ruled out in a row, one step re-measures acceptance
            return True
        if prices is None:
            # Warm-up: alternate plain and drafting steps until both regimes are measured.
            return self.regimes.n_plain >= self.regimes.min_plain or self.stats.steps % 2 == 1
        best = min(1.0, float(cal.max()) * float(self.acceptance.curve()[1][-1]))  # the likeliest a draft token can be
        return drafting_can_pay(rows, int(budgets.sum()), *prices, best, None if values is None else float(values.max()))

    def _prices(self, rows: int) -> tuple[float, float, float] | None:
        """``(plain step s, speculative step s before drafts, s per draft token)`` for ``rows`` rows; None in warm-up.

        From the user's ``c_base``/``c_tok`` when given (one line for both regimes), else from
        the online two-regime fit.
        """
        if self._given_costs is not None:
            c_base, c_tok = self._given_costs
            plain = max(c_base + c_tok * rows, 1e-9)
            return plain, plain, c_tok
        if not self.regimes.ready:
            return None
        c = self.regimes.coefficients()
        plain = max(self.regimes.plain(rows), 1e-9)
        return plain, max(c["c_base"] + c["c_spec"] + c["c_row"] * rows, 1e-9), c["c_draft"]

    def _step_budget(self, probs: np.ndarray, lengths: np.ndarray, prices: tuple | None, cal: np.ndarray | None,
                     values: np.ndarray | None = None, peak: dict | None = None, recount: bool = True) -> np.ndarray | None:
        """Per-row number of draft tokens to keep (``cost`` and ``makespan`` budgets), or None to keep every draft.

        ``probs``: float32 ``[rows, K]`` path probabilities, the first ``lengths[r]`` of row ``r``."""
        if self.budget not in PRICED:
            return None  # other budgets were applied per request
        # Warm-up and exploration steps draft without prices: keep them cheap at any batch size
        # (a draft token costs about what a row costs where the forward is compute-bound, so 4
        # tokens on each of 64 rows made a warm-up step cost ~4 plain steps on an AVX2 CPU).
        rows = lengths.shape[0]
        if prices is None:  # warm-up drafting step: up to 4 tokens per row on the likeliest rows, rows // 4 tokens in all
            return _likeliest_rows(probs, lengths, per_row=4, total=max(4, rows // 4))
        if self._exploring:  # exploration step: the first draft token of the likeliest rows
            self._exploring = False
            return _likeliest_rows(probs, lengths, per_row=1, total=max(1, rows // 8))
        self.stats.fitted_steps += recount
        return choose_drafts(probs, *prices, cal, prob_map=self.acceptance, values=values, lengths=lengths, peak=peak)

    def _values(self, slots: np.ndarray, live: np.ndarray, req_ids: list) -> np.ndarray | None:
        """``makespan`` budget: seconds one accepted draft token saves, per row (:mod:`scheduler.makespan`).

        ``c_row + c_base * q_i``, with ``q_i`` the odds that the row's request finishes last,
        from the length predictor's expected remaining length (per-problem history of earlier
        iterations, length so far). Rows that do not draft get 0.
        """
        st = self._state
        rows = np.flatnonzero(live)
        if not rows.shape[0]:
            return None
        rs = [self._reqs[req_ids[row]] for row in rows.tolist()]
        s = slots[rows]
        pred = self._length_predictor(s)
        generated = (st.seen[s] - st.prompt_len[s]).astype(np.float64)
        left = np.maximum(st.max_tokens[s] - generated, 1.0)
        expected = pred.predict(pred.index([r.problem_id for r in rs]), np.minimum(generated, pred.max_tokens)).expected_remaining
        q = np.zeros(slots.shape[0])
        q[rows] = last_finish_probability(np.clip(expected, 1.0, left), left)
        if self._given_costs is not None:
            c_base, c_row = self._given_costs
        else:
            c = self.regimes.coefficients()
            c_base, c_row = c["c_base"], c["c_row"]
        return token_values(q, c_base, c_row)

    def _length_predictor(self, s: np.ndarray) -> Any:
        """The length history of the rollouts this proposer saw finish (built on first use, sized by
        the largest ``max_tokens`` of the requests at slots ``s``; fed at each ``begin_iteration``)."""
        if self.predictor is None:
            from scheduler.predictor import LengthPredictor

            self.predictor = LengthPredictor(int(self._state.max_tokens[s].max()))
            self._flush_lengths()
        return self.predictor

    def _release_finished(self, requests: dict) -> None:
        # A finished request leaves the runner's request table (a preempted one stays); its
        # rollout stays in the problem tree, only the per-request state is freed, and its length
        # joins the history the length policies learn from.
        for req_id in [r for r in self._reqs if r not in requests]:
            req = self._reqs.pop(req_id)
            del self._slot_of[req_id]
            st, slot = self._state, req.slot
            st.free.append(slot)
            if not st.tracked[slot]:
                continue
            self._finished_lengths.setdefault(req.problem_id, []).append(int(st.seen[slot] - st.prompt_len[slot]))
            self.drafter.stop_request(req_id)

    def _flush_lengths(self) -> None:
        if self.predictor is not None:
            for pid, lengths in self._finished_lengths.items():
                self.predictor.observe(pid, self.drafter.policy_version, np.minimum(lengths, self.predictor.max_tokens))
            self._finished_lengths.clear()

    # ---- control verbs, reached from the driver through LLM.collective_rpc (see integrations.vllm_ext.control)
    def begin_iteration(self, policy_version: int) -> None:
        """Advance the drafter's window to ``policy_version`` (see DASDrafter.begin_iteration) and
        add the lengths of the rollouts finished since the last call to the length history."""
        self._release_finished(self.runner.requests)
        self._flush_lengths()
        self.drafter.begin_iteration(policy_version)

    def snapshot(self) -> dict[str, Any]:
        """Proposer counters plus drafter memory statistics."""
        cost = {"cost_model": self.cost.coefficients(), "cost_samples": self.cost.n_samples, "budget": self.budget,
                "calibration": self._calibration(), "payoff_scale": self._payoff_scale, "step_cost": self.regimes.coefficients(),
                "reliability": self.acceptance.table()}
        return {**self.stats.as_dict(), **cost, **{f"drafter_{k}": v for k, v in self.drafter.stats().items()}}
