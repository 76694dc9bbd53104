"""What the DAS proposer keeps per live request: its numbers, its options, and the lengths of finished rollouts.

* :class:`RequestState`: per-request numbers a step reads and writes, one array each, indexed by
  the request's slot, so that a step's bookkeeping is a few vector operations over its rows, not
  a Python loop per row.
* :func:`request_options`: a request's ``SamplingParams.extra_args`` checked (``das_problem_id``,
  ``das_max_draft_tokens``, ``das_warmup``).
* :class:`LengthHistory`: the output lengths of the rollouts seen to finish, fed to a
  :class:`scheduler.predictor.LengthPredictor` (built on first use) at each policy version.

Units: tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from scheduler.predictor import LengthPredictor

__all__ = ["LengthHistory", "RequestState", "request_options"]


class RequestState:
    """Per-request numbers, indexed by slot (module doc).

    ``seen``: tokens (prompt + output) given to the drafter (``prompt_len`` of them the prompt's,
    at most ``max_tokens`` output tokens); ``cap``: the request's own draft cap per step
    (``das_max_draft_tokens``, default K); ``drafted`` / ``accepted``: draft tokens offered /
    accepted so far; ``steps``: verification steps so far; ``last_len``: draft tokens offered last
    step, ``last_psum`` the sum of their calibrated path probabilities and ``last_probs[:, :k]``
    their raw path probabilities (float32, for the reliability bins); ``predicted``: the sum of the
    calibrated path probabilities of all drafts offered (expected accepted); ``tracked``: False
    for a request with bad options (or a warm-up request); ``problem_id``: its problem (None when
    not tracked).
    """

    INT = ("seen", "cap", "drafted", "accepted", "steps", "last_len", "prompt_len", "max_tokens")
    FLOAT = ("last_psum", "predicted")

    def __init__(self, k: int, slots: int = 64):
        for name in self.INT:
            setattr(self, name, np.zeros(slots, np.int64))
        for name in self.FLOAT:
            setattr(self, name, np.zeros(slots, np.float64))
        self.tracked = np.zeros(slots, bool)
        self.last_probs = np.zeros((slots, max(k, 1)), np.float32)
        self.problem_id: list[Any] = [None] * slots
        self.free = list(range(slots - 1, -1, -1))

    def take(self, prompt_len: int, max_tokens: int, cap: int, tracked: bool, problem_id: Any = None) -> int:
        """A slot for a new request, its numbers zeroed (twice the arrays when none is free)."""
        if not self.free:
            n = self.seen.shape[0]
            for name in (*self.INT, *self.FLOAT, "tracked", "last_probs"):
                a = getattr(self, name)
                setattr(self, name, np.concatenate([a, np.zeros_like(a)]))
            self.problem_id += [None] * n
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
        self.problem_id[i] = problem_id
        return i

    def scheduled(self, slots: np.ndarray, counts: np.ndarray | None, calibrate: Any) -> int:
        """The scheduler verified only the first ``counts[r]`` (int64 ``[rows]``) of the last draft
        tokens offered by the request at ``slots[r]`` (it cuts drafts to its token budget and to
        ``max_model_len``): the cut tokens are taken back, as never offered, from ``last_len``,
        ``drafted`` and ``last_psum`` (recomputed from ``last_probs`` with ``calibrate``, as
        :meth:`offered` does), so that acceptance and calibration learn from the verified tokens
        only. ``counts`` None: nothing was cut. Returns the draft tokens taken back."""
        if counts is None:
            return 0
        offered = self.last_len[slots]
        cut = np.flatnonzero(counts < offered)
        if not cut.shape[0]:
            return 0
        cs, keep = slots[cut], np.maximum(counts[cut], 0)
        removed = offered[cut] - keep
        self.drafted[cs] -= removed
        self.last_len[cs] = keep
        shown = self.last_probs[cs][np.arange(self.last_probs.shape[1]) < keep[:, None]]  # row by row
        rows = np.repeat(np.arange(cs.shape[0]), keep)
        self.last_psum[cs] = np.bincount(rows, weights=np.asarray(calibrate(shown), np.float64), minlength=cs.shape[0]) if shown.size else 0.0
        return int(removed.sum())

    def verified(self, slots: np.ndarray, accepted: np.ndarray) -> np.ndarray:
        """Requests at ``slots`` had ``accepted`` (int64) of their last drafts accepted: add them to
        their evidence; returns what their drafts' calibrated probabilities predicted (float64)."""
        psum = self.last_psum[slots]
        self.accepted[slots] += accepted
        self.predicted[slots] += psum
        return psum

    def offered(self, slots: np.ndarray, live: np.ndarray, kept: np.ndarray, probs: np.ndarray, calibrate: Any) -> np.ndarray:
        """This step's drafts: row ``r`` (request at ``slots[r]``) offers its first ``kept[r]`` draft
        tokens, their raw path probabilities in ``probs[r]`` (float32 ``[rows, K]``); ``calibrate``
        maps raw to calibrated probabilities. Live rows without a draft offer none. Returns the
        drafting rows (int64 indices)."""
        idle = slots[live & (kept == 0)]
        self.last_len[idle] = 0
        self.last_psum[idle] = 0.0
        drafting = np.flatnonzero(kept)
        if drafting.shape[0]:
            ns = kept[drafting]
            shown = probs[drafting][np.arange(probs.shape[1]) < ns[:, None]]  # row by row
            ds = slots[drafting]
            self.last_len[ds] = ns
            self.last_probs[ds, : probs.shape[1]] = probs[drafting]
            self.last_psum[ds] = np.add.reduceat(calibrate(shown), np.cumsum(ns) - ns)  # expected accepted per row
            self.drafted[ds] += ns
        return drafting


def request_options(params: Any, k: int) -> tuple[Any, int, bool]:
    """``(problem_id, cap, warmup)`` from a request's ``SamplingParams.extra_args``: the problem's
    id (None: the drafter hashes the prompt), its draft cap per step (default ``k``) and whether it
    only warms the engine up.

    Raises:
        ValueError: a bad value; the message names the option, the value and what was expected.
    """
    extra = getattr(params, "extra_args", None) or {}
    if not isinstance(extra, dict):
        raise ValueError(f"extra_args must be a dict, got {type(extra).__name__}")
    cap = extra.get("das_max_draft_tokens", k)
    if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 0:
        raise ValueError(f"das_max_draft_tokens must be an int >= 0, got {cap!r}")
    pid = extra.get("das_problem_id")
    if pid is not None and not isinstance(pid, (str, int)):
        raise ValueError(f"das_problem_id must be a str or int, got {type(pid).__name__}: {pid!r}")
    warm = extra.get("das_warmup", False)
    if not isinstance(warm, bool):
        raise ValueError(f"das_warmup must be a bool, got {type(warm).__name__}: {warm!r}")
    return pid, int(cap), warm


class LengthHistory:
    """The length history behind the length-aware budgets: the output lengths of the rollouts
    seen to finish, per problem, added to the predictor at each :meth:`flush` (a new policy
    version). The predictor is built on first use (:meth:`predictor`), sized by the largest
    ``max_tokens`` of the requests then running, and resized (its history kept) when a request
    with a larger ``max_tokens`` runs: an engine's short warm-up requests must not cap every later
    prediction at their length."""

    def __init__(self):
        self.model: LengthPredictor | None = None
        self._finished: dict[Any, list[int]] = {}  # problem id -> output lengths, since the last flush

    def finished(self, problem_id: Any, length: int) -> None:
        """One rollout of ``problem_id`` finished with ``length`` output tokens."""
        self._finished.setdefault(problem_id, []).append(int(length))

    def predictor(self, max_tokens: np.ndarray, policy_version: int) -> LengthPredictor:
        """The predictor (built now if it is not yet: ``max(max_tokens)`` tokens at most, the
        lengths so far added at ``policy_version``); resized when ``max(max_tokens)`` exceeds its size."""
        need = int(np.max(max_tokens))
        if self.model is None:
            self.model = LengthPredictor(need)
            self.flush(policy_version)
        elif need > self.model.max_tokens:
            self.model = self.model.resized(need)
        return self.model

    def flush(self, policy_version: int) -> None:
        """Add the lengths finished since the last flush to the predictor at ``policy_version``
        (kept for later while there is no predictor)."""
        if self.model is not None:
            for pid, lengths in self._finished.items():
                self.model.observe(pid, policy_version, np.minimum(lengths, self.model.max_tokens))
            self._finished.clear()
