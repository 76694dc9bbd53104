"""The ``mix`` chooser's learning state: mixer weights, their AdaGrad sums, outcome tables, and each request's pending draft.

The mix kernels (:mod:`das.mix_kernels`) draft from every context of every scope, mixed by
online logistic weights. A draft stays *pending* under its request's handle (its tokens, each
token's mixer inputs, weight set and support profile, the context's last token, and the token it
stopped before) until the request's next verified tokens arrive; then
:func:`das.mix_kernels.learn_rows` learns the outcome of each drafted token (accepted tokens, then
the first rejected one) and counts it in the outcome tables, which fade by the drafter's ``decay``
per policy version as its rollouts do (:meth:`MixerState.age`).
"""

from __future__ import annotations

import numpy as np

from das import mix_kernels

__all__ = ["MixerState"]


class MixerState:
    """Weights, outcome tables and pending drafts of the ``mix`` chooser.

    Args:
        lr: float > 0, AdaGrad step size (the drafter's ``mix_lr``).
        handles: request handles the pending arrays hold at first (they grow with the request table).

    Attributes (the kernels read and write the arrays; built here, the one place):
        model: :class:`das.mix_kernels.MixModel`: ``weights`` (``float64[NSETS * NIN]``, one set per
            draft position 0, 1, 2, 3+), ``grad_sq`` (their AdaGrad sums of squared gradients) and
            ``outcomes`` (``float64[4, OUTCOME_SLOTS, 2]`` (accepted, drafted) of draft tokens:
            ``[0]`` per token id, ``[1]`` per (previous token, token), ``[2]`` per support profile
            (its first ``SUPPORT_ROWS`` rows), ``[3]`` the calibration maps' knots).
        pending: :class:`das.mix_kernels.Pending`, rows by request handle: each handle's pending
            draft (``tokens`` ``int32[handles, K]``, their mixer ``inputs`` ``float64[handles, K,
            NIN]``, weight-set offsets ``sets`` and support ``profiles`` ``int64[handles, K]``),
            its ``lengths`` (0: none), the context's last token when it drafted (``prev``) and the
            token it stopped before (``stop``, -1: none), ``int64[handles]`` each. Rebuilt when it
            grows (read it again after :meth:`grow_handles` or :meth:`fit_draft_length`).
        learned: draft-token (and stop-token) outcomes learned so far.
    """

    def __init__(self, lr: float, handles: int = 16):
        self.lr = lr
        weights = mix_kernels.initial_weights()
        self.model = mix_kernels.MixModel(weights, np.zeros_like(weights), np.zeros((4, mix_kernels.OUTCOME_SLOTS, 2), np.float64))
        self.pending = _new_pending(handles, 16)
        self.learned = 0

    @property
    def handles(self) -> int:
        """Handles the pending arrays hold."""
        return self.pending.lengths.shape[0]

    def grow_handles(self, n: int) -> None:
        """Room for ``n`` handles (more than now): the new ones with nothing pending."""
        old = self.pending
        new = _new_pending(n, old.tokens.shape[1])
        h = old.lengths.shape[0]
        for a, b in zip(old, new):
            b[:h] = a
        self.pending = new

    def fit_draft_length(self, k: int) -> None:
        """Room for pending drafts of ``k`` tokens per handle. Drafts pending when it grows are
        dropped, not learned from (rare: a larger budget than ever before)."""
        if k <= self.pending.tokens.shape[1]:
            return
        old = self.pending
        self.pending = _new_pending(old.lengths.shape[0], k)._replace(prev=old.prev)

    def drop_pending(self, h: int | slice) -> None:
        """Forget handle ``h``'s pending draft and stop token: nothing of them will be learned."""
        self.pending.lengths[h] = 0
        self.pending.stop[h] = -1

    def learn(self, handles: np.ndarray, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        """Learn the outcomes of the rows' pending drafts from their verified tokens
        ``tokens[r, starts[r]:ends[r]]`` (rows checked by the caller)."""
        self.learned += mix_kernels.learn_rows(tuple(self.model), self.lr, handles, tokens, starts, ends, tuple(self.pending))

    def age(self, factor: float) -> None:
        """Multiply the outcome counts by ``factor`` (a new policy version: what older policies did weighs less)."""
        self.model.outcomes[:] *= factor

    def weight_sets(self) -> np.ndarray:
        """A copy of the weights as ``float64[NSETS, NIN]``."""
        return self.model.weights.reshape(mix_kernels.NSETS, mix_kernels.NIN).copy()


def _new_pending(handles: int, k: int) -> mix_kernels.Pending:
    """Pending arrays for ``handles`` handles and drafts of ``k`` tokens, nothing pending."""
    return mix_kernels.Pending(tokens=np.zeros((handles, k), np.int32), inputs=np.zeros((handles, k, mix_kernels.NIN), np.float64),
                               sets=np.zeros((handles, k), np.int64), lengths=np.zeros(handles, np.int64),
                               prev=np.zeros(handles, np.int64), profiles=np.zeros((handles, k), np.int64),
                               stop=np.full(handles, -1, np.int64))
