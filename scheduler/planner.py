"""What is decided per engine step, around a speculation budget: :class:`StepPlanner`.

The vLLM proposer (:mod:`integrations.vllm_ext.proposer`) maps rows to requests and hands each
step to a :class:`StepPlanner`, which owns everything that is measured and decided per step:

* **Step cost.** The interval between consecutive steps over pure decode steps is fed to the
  step price (:class:`scheduler.step_price.StepPrice`: the two-regime line of plain and
  speculative steps or, where the steps show one, a knee in the tokens verified below which drafts
  are free), which a priced budget reads, and, for a budget that reads one (``eq7``), to the Eq. 1
  line :class:`scheduler.drain_plan.CostModel`; or the user's ``c_base``/``c_tok`` are used as they are. The engine's first
  :data:`SCREEN_STEPS` clean steps are held back and screened against their medians (its warm-up
  steps compile kernels and take seconds), and intervals long against both the step and the
  per-token averages (idle gaps between ``generate()`` calls) are left out.
* **Acceptance calibration.** Verification outcomes fill the per-probability-bin reliability
  calibration (:class:`scheduler.acceptance.AcceptanceCalibration`); what its bins miss is
  tracked as accepted / predicted, globally and per request (shrunk toward the global factor).
* **The payoff guard.** A factor on every acceptance probability: drafting steps that yield fewer
  tokens per second than the fitted plain step would shrink it, paying ones grow it back (at most
  1), guarding "never slower" against a fit or a calibration that is too optimistic.
* **Measuring the price.** Until the two-regime fit exists, plain and drafting steps alternate
  and a drafting step keeps few tokens (:func:`likeliest_rows`); once fitted, a plain step after
  :data:`PLAIN_EVERY` drafting steps keeps the plain price measured (not with given prices), unless
  the drafting steps paid clearly: their tokens per second, measured, at least
  :data:`PLAIN_PAYOFF` times the fitted plain step's (an EMA over drafting steps). Where drafting
  pays by more than the plain price can be off by (a speculative step's own fixed cost, which the
  fit folds into the plain price when it sees no plain step), a plain step could not change a
  decision, and in a long tail it costs the last rows a whole step's accepted drafts. After 32 steps in
  a row where drafting could not pay, one exploration step drafts the first token of the likeliest
  rows to re-measure acceptance.
* **The draft cap** (:class:`TailDrafts`, the tail rule): a row drafts at most
  :data:`BATCH_DRAFT` tokens before the long tail and up to the engine's K in it, where a priced
  budget keeps what pays.
* **The budget** (:mod:`scheduler.budget_protocol`): its caps before the drafter runs; for a
  :class:`scheduler.budget_protocol.PricedBudget`, whether any draft can pay (else the drafter is
  not asked) and where the drafts may stop (the same drafts, fewer lookups), and which of the
  drafted tokens the step verifies.

One step reads top to bottom: the host records the step that just ended
(:meth:`StepPlanner.record_step`, :meth:`StepPlanner.observe_verified`), asks for the step's plan
(:meth:`StepPlanner.plan`: each row's draft cap and where its draft may stop), runs its drafter
once with it, and asks which of the drafted tokens the step verifies (:meth:`StepPlanner.keep`).
It is tested without vLLM; the long-tail simulator (``benchmarks.sim_budget``) hosts one per
simulated GPU with the simulated clock.

**The tail rule** (:class:`TailDrafts`). The engine's K (vLLM's ``num_speculative_tokens``) bounds
every row's draft. While the batch is full, a draft token is worth what it adds to the step's
throughput, and a row drafts at most :data:`BATCH_DRAFT` tokens. In the long tail, with few rows
left, each accepted token of the last rows saves a whole engine step
(:func:`scheduler.priced_budgets.token_values`: ``v_i = c_row + c_base * q_i``, and ``q_i`` nears 1
for the row that finishes last), and near the length cap the drafts are often loops that the
drafter predicts with high probability: there a row of a priced budget may draft up to K, and the
budget keeps the tokens that pay at the step's price. A budget that prices nothing (``fixed``, the
length-class and drain-plan budgets) cannot tell that drafts pay, so its rows keep the batch cap
everywhere. A step is in the tail when it runs at most :data:`TAIL_SHARE` of the most rows the host
ran recently (a maximum that fades by :data:`PEAK_FADE` per step).

Units: seconds, tokens, rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from scheduler.acceptance import AcceptanceCalibration
from scheduler.budget_protocol import Budget, Drafts, PricedBudget, StepView
from scheduler.drain_plan import CostModel
from scheduler.priced_budgets import raw_cutoffs
from scheduler.step_price import LinearPrice, StepPrice

__all__ = ["BATCH_DRAFT", "PEAK_FADE", "PLAIN_EVERY", "PLAIN_PAYOFF", "SCREEN_STEPS", "TAIL_SHARE", "StepPlan", "StepPlanner", "StepRecord",
           "StepStats", "TailDrafts", "likeliest_rows"]

BATCH_DRAFT = 16  # most draft tokens per row and step before the tail (the engine's K before the tail rule)
TAIL_SHARE = 0.125  # a step is in the tail when it runs at most this share of the recent peak rows
PEAK_FADE = 0.9995  # the peak fades by this factor per step (half-life ~1400 steps)


class TailDrafts:
    """The per-row draft cap of each step (the tail rule, module doc).

    Args:
        max_draft: the engine's K (most draft tokens per row and step, >= 0).
        batch_draft: the cap before the tail (>= 0; at most ``max_draft`` applies).
        tail_share: the tail's share of the peak rows, in ``[0, 1]`` (0: no tail, every step
            keeps the batch cap).
        extends: whether the tail lifts the cap to ``max_draft`` (True for a priced budget).

    Raises:
        ValueError: a negative cap or a share outside ``[0, 1]``.
    """

    def __init__(self, max_draft: int, batch_draft: int = BATCH_DRAFT, tail_share: float = TAIL_SHARE, *, extends: bool = True):
        if not isinstance(max_draft, (int, np.integer)) or max_draft < 0:
            raise ValueError(f"max_draft must be an int >= 0 (draft tokens per row and step), got {max_draft!r}")
        if not isinstance(batch_draft, (int, np.integer)) or batch_draft < 0:
            raise ValueError(f"batch_draft must be an int >= 0 (draft tokens per row and step), got {batch_draft!r}")
        if not 0.0 <= float(tail_share) <= 1.0:
            raise ValueError(f"tail_share must be in [0, 1] (a share of the peak rows), got {tail_share!r}")
        self.max_draft = int(max_draft)
        self.batch_draft = min(int(batch_draft), self.max_draft)
        self.tail_share = float(tail_share)
        self.extends = bool(extends) and self.max_draft > self.batch_draft
        self.peak = 0.0  # the most rows seen recently (fading)

    def observe(self, rows: int) -> None:
        """A step of ``rows`` rows ran (or is planned): the peak follows it."""
        self.peak = max(float(rows), self.peak * PEAK_FADE)

    def in_tail(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows is in the long tail (at most ``tail_share`` of the peak)."""
        return 0 < rows <= self.tail_share * self.peak

    def cap(self, rows: int) -> int:
        """The most draft tokens a row gets in a step of ``rows`` rows (observes the step first)."""
        self.observe(rows)
        return self.max_draft if self.extends and self.in_tail(rows) else self.batch_draft

    def limit(self, caps: np.ndarray) -> np.ndarray:
        """``caps`` (int ``[rows]``, each row's own caps) at most :meth:`cap` of this step; a new array."""
        caps = np.asarray(caps, np.int64)
        return np.minimum(caps, self.cap(caps.shape[0]))

    def describe(self) -> dict:
        return {"max_draft": self.max_draft, "batch_draft": self.batch_draft, "tail_share": self.tail_share,
                "extends": self.extends, "peak_rows": self.peak}


SCREEN_STEPS = 8  # the engine's first clean steps, held back and screened against their median (warm-up)
PLAIN_EVERY = 16  # once fitted, a plain step after this many drafting steps in a row keeps the plain price measured ...
PLAIN_PAYOFF = 1.25  # ... unless the drafting steps yield this many times the plain step's tokens per second (module doc)


class StepRecord(NamedTuple):
    """One clean decode step, as the cost models and the step log see it."""

    t: float  # clock seconds at its end (the next step's start)
    rows: int
    draft_tokens: int  # draft tokens it verified
    accepted: int  # of those, accepted
    predicted: float  # accepted draft tokens its drafts' calibrated probabilities predicted
    seconds: float
    step_tokens: int  # tokens in its forward pass
    context_tokens: int  # KV tokens it read


@dataclasses.dataclass
class StepStats:
    """Counters of one planner and its host since they were built (one object: the planner counts
    the step decisions, the host, e.g. the vLLM proposer, the rest)."""

    steps: int = 0  # host: steps asked for drafts
    fitted_steps: int = 0  # planner: steps whose drafts were kept by the fitted (or given) price
    skipped_steps: int = 0  # planner: steps the price ruled out drafting for (no drafter lookups at all)
    cut_steps: int = 0  # planner: steps whose drafts stopped at the step's price, above the drafter's own cutoff
    rows: int = 0  # host: rows seen, all steps
    drafts: int = 0  # host: rows that got a non-empty draft
    draft_tokens: int = 0  # host: draft tokens the steps verify
    unscheduled_tokens: int = 0  # host: draft tokens offered that vLLM's scheduler cut (token budget, max_model_len): never verified
    failures: int = 0  # host: steps that raised and returned empty drafts
    bad_requests: int = 0  # host: requests with bad options: no drafts for them, nothing in the drafter
    propose_s: float = 0.0  # host: wall seconds deciding and drafting

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class StepPlan(NamedTuple):
    """What a step may draft (:meth:`StepPlanner.plan`), for one drafter call.

    Attributes:
        caps: int64 ``[rows]``: each row's most draft tokens (0: no draft).
        min_prob: float64 ``[rows]``: each row's draft stops below this raw path probability;
            None: at the drafter's own cutoff.
        plain: True for a plain step that keeps the plain price measured (a host that holds a
            plan for several steps holds this one for one step only).
    """

    caps: np.ndarray
    min_prob: np.ndarray | None
    plain: bool = False


def likeliest_rows(probs: np.ndarray, lengths: np.ndarray, per_row: int, total: int) -> np.ndarray:
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


class StepPlanner:
    """Per-step measurement and decisions around one speculation budget (module doc).

    Args:
        budget: the :class:`scheduler.budget_protocol.Budget` (from :func:`scheduler.budgets.make_budget`).
        cost: the Eq. 1 line it feeds for a budget that reads one (``uses_cost_fit``: share it
            with the ``eq7`` budget); default: fitted online (``forgetting`` 0.995), or fixed at
            ``given_costs``. Not fitted for other budgets (None).
        given_costs: ``(c_base, c_tok)`` seconds: the price as given, no fit (and no plain steps forced).
        step_log: optional function called with one dict per clean step once the fit saw it (its
            :class:`StepRecord` fields, ``fitted``, the step price's coefficients ``c_base``,
            ``c_row``, ``c_draft``, ``c_spec``, ``c_ctx`` and ``knee`` (:meth:`scheduler.step_price.StepPrice.coefficients`;
            None before a fit) and ``payoff_scale``).
        max_draft: the engine's K; with it, each step's caps are limited by a
            :class:`TailDrafts` (K in the long tail for a priced budget, ``batch_draft`` before
            it); None: the rows' caps as the host gives them.
        batch_draft: the cap before the tail (:data:`BATCH_DRAFT`).
    """

    def __init__(self, budget: Budget, *, cost: CostModel | None = None, given_costs: tuple[float, float] | None = None,
                 step_log: Callable[[dict], None] | None = None, max_draft: int | None = None, batch_draft: int = BATCH_DRAFT):
        self.budget = budget
        self.priced = isinstance(budget, PricedBudget)
        self.tail = None if max_draft is None else TailDrafts(max_draft, batch_draft, extends=self.priced)
        self.given_costs = None if given_costs is None else (float(given_costs[0]), float(given_costs[1]))
        self.cost = None
        if budget.uses_cost_fit:
            self.cost = cost if cost is not None else self.online_cost(self.given_costs)
        self.regimes = StepPrice(refit_every=4)  # plain vs speculative step times, with a knee where they show one: the priced budgets' price
        self._floor = 0.0  # the drafter's own cutoff this step (plan's ``floor``)
        self.stats = StepStats()
        self.step_log = step_log
        # Per-probability-bin acceptance factors from verification outcomes: the drafter's high
        # path probabilities are nearly right, its low ones 2x too high, which one scalar factor
        # cannot express.
        self.acceptance = AcceptanceCalibration()
        self._accepted = self._predicted = 0.0  # decayed sums: accepted / calibrated-predicted, what the bins miss
        self.payoff_scale = 1.0  # the payoff guard (module doc)
        self.paid = 1.0  # EMA of drafting steps' measured tokens per second / the fitted plain step's (forced plain steps)
        self._plans = 0  # keep() calls: warm-up alternates plain and drafting steps by their parity
        self._exploring = False  # this step drafts only to re-measure acceptance
        self._plain = False  # this step is plain to keep the plain price measured
        self._skipped_run = 0  # steps ruled out since the last one that drafted
        # Measured steps since the last plain one: when every step drafts, the fit cannot tell a
        # speculative step's own fixed cost from the base cost, and prices plain steps too high.
        self._since_plain = 0
        self._last_t: float | None = None
        # Seconds per clean step and per forward token (EMAs), to drop idle gaps from the fit. A
        # step is a gap only if it is long against both: against the step EMA alone, the first
        # full batch after small warm-up steps (or a tail) would look like a gap for ever, since
        # dropped steps never move the EMA.
        self._interval_ema: float | None = None
        self._token_ema: float | None = None
        # The engine's first clean steps, held back until SCREEN_STEPS of them are in (None after):
        # its first decode steps compile and warm kernels and take seconds; in the fit, one such
        # step's squared error outweighs hundreds of real steps and makes drafts look free.
        self._held: list[StepRecord] | None = []

    @staticmethod
    def online_cost(given_costs: tuple[float, float] | None = None) -> CostModel:
        """The Eq. 1 fit a planner feeds (``forgetting`` 0.995: ~200 steps); a given ``(c_base,
        c_tok)`` is used as is: a prior that no measured step outweighs."""
        prior = None if given_costs is None else (float(given_costs[0]), float(given_costs[1]))
        return CostModel(forgetting=0.995, prior=prior, prior_weight=1e12 if prior else 8.0)

    # ------------------------------------------------------------------ measuring
    def observe_verified(self, accepted: np.ndarray, psum: np.ndarray, probs: np.ndarray, offered: np.ndarray) -> tuple[int, float]:
        """The verification outcomes of the rows whose last drafts the step just verified.

        Args:
            accepted: int64 ``[m]`` draft tokens each row had accepted.
            psum: float64 ``[m]`` the calibrated probabilities of its drafts, summed (expected accepted).
            probs: float32 ``[m, K]`` their raw path probabilities, the first ``offered[r]`` of row ``r``.
            offered: int64 ``[m]`` draft tokens each row was offered.

        Returns:
            ``(accepted, predicted)`` of the step, summed over the rows.
        """
        m = accepted.shape[0]
        # the EMAs over these rows in row order: 0.99 per row, as one row after the other
        fade = 0.99 ** np.arange(m - 1, -1, -1)
        self._accepted = 0.99**m * self._accepted + float(fade @ accepted)
        self._predicted = 0.99**m * self._predicted + float(fade @ psum)
        cols = np.arange(probs.shape[1])
        shown = cols < offered[:, None]  # last step's draft tokens, row by row
        self.acceptance.observe(probs[shown], (cols < accepted[:, None])[shown])
        return int(accepted.sum()), float(psum.sum())

    def record_step(self, now: float, rows: int, draft_tokens: int, step_tokens: int, context_tokens: int, clean: bool,
                    accepted: int = 0, predicted: float = 0.0) -> None:
        """The step that just ended at clock ``now`` (seconds): it ran ``rows`` rows with
        ``draft_tokens`` draft tokens (``accepted`` of them accepted, ``predicted`` expected),
        ``step_tokens`` tokens in its forward pass and ``context_tokens`` KV tokens read. Its
        interval since the previous call goes into the fits unless it is not ``clean`` (a row in
        prefill, a new request: not a pure decode step)."""
        last, self._last_t = self._last_t, now
        if last is None or not clean:
            return
        step = StepRecord(now, rows, draft_tokens, accepted, predicted, now - last, step_tokens, context_tokens)
        if self._held is None:
            self._observe(step)
            return
        self._held.append(step)
        if len(self._held) < SCREEN_STEPS:
            return
        # Screened against their medians: the EMAs start there, so the gap rule drops the
        # warm-up steps (more than 4x the median) like idle gaps.
        held, self._held = self._held, None
        self._interval_ema = float(np.median([h.seconds for h in held]))
        self._token_ema = float(np.median([h.seconds / max(h.step_tokens, 1) for h in held]))
        for h in held:
            self._observe(h)

    def _observe(self, step: StepRecord) -> None:
        fitted = self._fit(step)
        if self.step_log is not None:
            c = self.regimes.coefficients() if self.regimes.ready else None
            rec = {**step._asdict(), "fitted": fitted}
            rec.update({k: None if c is None else c[k] for k in ("c_base", "c_row", "c_draft", "c_spec", "c_ctx", "knee")})
            rec["payoff_scale"] = self.payoff_scale
            self.step_log(rec)

    def _fit(self, step: StepRecord) -> bool:
        """One clean step into the cost models and the payoff scale; False for an idle gap (left out)."""
        rows, drafted, interval, tokens = step.rows, step.draft_tokens, step.seconds, step.step_tokens
        if interval > 4.0 * max(self._interval_ema, self._token_ema * tokens):
            return False  # an idle gap between generate() calls, not a step
        self._interval_ema = 0.9 * self._interval_ema + 0.1 * interval
        self._token_ema = 0.9 * self._token_ema + 0.1 * interval / max(tokens, 1)
        if self.cost is not None:
            self.cost.observe(tokens, interval, step.context_tokens)
        self.regimes.observe(rows, drafted, interval, step.context_tokens)
        self._since_plain = self._since_plain + 1 if drafted else 0
        if drafted and self.priced and self.given_costs is None and self.regimes.ready:
            # tokens per second of this drafting step against the fitted plain step's
            payoff = (rows + step.accepted) / interval * max(self.regimes.plain(rows), 1e-9) / rows
            self.payoff_scale = float(np.clip(self.payoff_scale * payoff**0.1, 0.25, 1.0))
            self.paid = 0.9 * self.paid + 0.1 * payoff
        return True

    def calibration(self) -> float:
        """Accepted / predicted draft tokens over recent steps, with a prior of 4 tokens at 1.0.

        Predicted with the per-bin calibrated probabilities, so this is what the bins miss (near
        1.0 once they have evidence). The prior keeps a run of rejected drafts (a junk warm-up
        request) from pricing every later draft at zero, which would stop drafting, and with it
        the evidence, for good.
        """
        return (self._accepted + 4.0) / (self._predicted + 4.0)

    def row_calibration(self, step: StepView) -> np.ndarray:
        """float64 ``[rows]``: each live row's request's own accepted / predicted (``step.accepted``,
        ``step.predicted``), shrunk toward the global one (other rows: the global one), times
        the payoff scale."""
        glob = self.calibration()
        cal = np.full(step.rows, glob)
        if step.accepted is not None:
            cal[step.live] = (step.accepted + 8.0 * glob) / (step.predicted + 8.0)
        return cal * self.payoff_scale

    def price(self, rows: int) -> LinearPrice | None:
        """The price of a step of ``rows`` rows: the given one, the fitted one, or None (warm-up)."""
        if self.given_costs is not None:
            return LinearPrice.given(*self.given_costs, rows)
        if not self.regimes.ready:
            return None
        return self.regimes.price(rows)

    # ------------------------------------------------------------------ deciding
    def plan(self, step: StepView, floor: float = 0.0, price: LinearPrice | None = None) -> StepPlan:
        """This step's plan: each row's draft cap and where its draft may stop.

        Args:
            step: the :class:`StepView` (the planner limits its caps by the tail rule and, for a
                priced budget, sets its price, calibration and probability map).
            floor: the drafter's own cutoff (its ``min_token_prob``): a cut never goes below it.
            price: the step's price where the host knows it (the simulator's roofline ablation),
                instead of the given or fitted one (:meth:`price`).

        Returns:
            :class:`StepPlan` for one drafter call; then :meth:`keep` with its drafts.
        """
        budget = self.budget
        self._floor = float(floor)
        if self.tail is not None:
            step.caps = self.tail.limit(step.caps)
        caps = budget.plan(step)
        min_prob = None
        self._plain = False
        if self.priced:
            step.price = price if price is not None else self.price(step.rows)
            step.calibration = self.row_calibration(step)
            step.prob_map = self.acceptance
            if not self._allows_drafts(step, caps):
                self.stats.skipped_steps += 1
                self._skipped_run += 1
                caps[:] = 0  # drafting cannot pay this step: skip the drafter's lookups too
            min_prob = self._cutoff(step) if caps.any() else None
        return StepPlan(caps, min_prob, self._plain)

    def keep(self, step: StepView, drafts: Drafts) -> np.ndarray:
        """int64 ``[rows]``: the leading draft tokens of each row of ``drafts`` (the drafter's
        candidates for :meth:`plan`'s plan of ``step``) that the step verifies (at most each length)."""
        keep = self._keep(step, drafts)
        self._plans += 1
        return drafts.lengths if keep is None else np.minimum(keep, drafts.lengths)

    def _allows_drafts(self, step: StepView, caps: np.ndarray) -> bool:
        """A priced budget, before any lookup: can a draft pay for its verification this step?

        Warm-up (no price yet) alternates plain and drafting steps, so both regimes get measured;
        after it, drafting is ruled out when even drafts at the best calibrated acceptance
        probability would not raise tokens per second.
        """
        if step.rows == 0 or not caps.any():
            return False
        price = step.price
        if price is not None and self.given_costs is None and self._since_plain >= PLAIN_EVERY and self.paid < PLAIN_PAYOFF:
            self._plain = True
            return False  # a plain step now and then keeps the plain regime's price measured (given prices need none)
        if price is not None and self._skipped_run >= 32:
            self._skipped_run = 0
            self._exploring = True  # after 32 steps ruled out in a row, one step re-measures acceptance
            return True
        if price is None:
            return self.regimes.n_plain >= self.regimes.min_plain or self._plans % 2 == 1
        best = min(1.0, float(step.calibration.max()) * float(self.acceptance.curve()[1][-1]))  # the likeliest a draft token can be
        return self.budget.can_pay(step, caps, best)

    def _cutoff(self, step: StepView) -> np.ndarray | None:
        """float64 ``[rows]``: where this step's drafts may stop (None: at the drafter's own
        ``min_token_prob``): the budget's calibrated cut, mapped to each row's raw probability by
        its own calibration factor and the calibration curve
        (:func:`scheduler.priced_budgets.raw_cutoffs`), never below the drafter's cutoff. Warm-up
        and exploration steps keep drafts by another rule: no cut there."""
        if step.price is None or self._exploring:
            return None
        theta = self.budget.cutoff(step)
        if theta is None:
            return None
        raw = np.maximum(raw_cutoffs(theta, step.calibration, self.acceptance.curve()), self._floor)
        if not (raw > self._floor).any():
            return None
        self.stats.cut_steps += 1
        return raw

    def _keep(self, step: StepView, drafts: Drafts) -> np.ndarray | None:
        """Per-row draft tokens to keep, or None to keep every draft. Warm-up and exploration steps
        keep few, at any batch size (a draft token costs about what a row costs where the forward
        is compute-bound)."""
        if not self.priced:
            return self.budget.keep(step, drafts)
        rows = drafts.lengths.shape[0]
        if step.price is None:  # warm-up drafting step: up to 4 tokens per row on the likeliest rows, rows // 4 tokens in all
            return likeliest_rows(drafts.probs, drafts.lengths, per_row=4, total=max(4, rows // 4))
        if self._exploring:  # exploration step: the first draft token of the likeliest rows
            self._exploring = False
            return likeliest_rows(drafts.probs, drafts.lengths, per_row=1, total=max(1, rows // 8))
        self.stats.fitted_steps += 1
        return self.budget.keep(step, drafts)

    def snapshot(self) -> dict[str, Any]:
        """The fits and the calibration: ``cost_model``, ``cost_samples`` (the Eq. 1 line; None and 0
        for a budget that reads none), ``budget``,
        ``calibration``, ``payoff_scale``, ``step_cost`` and ``reliability``."""
        return {"cost_model": None if self.cost is None else self.cost.coefficients(),
                "cost_samples": 0 if self.cost is None else self.cost.n_samples, "budget": self.budget.name,
                "calibration": self.calibration(), "payoff_scale": self.payoff_scale, "step_cost": self.regimes.coefficients(),
                "reliability": self.acceptance.table()}
