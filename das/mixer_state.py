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

    Attributes (arrays the kernels read and write; rows by request handle):
        weights: ``float64[NSETS * NIN]`` mixer weights, one set per draft position 0, 1, 2, 3+.
        grad_sq: ``float64[NSETS * NIN]`` AdaGrad sums of squared gradients.
        outcomes: ``float64[4, OUTCOME_SLOTS, 2]`` (accepted, drafted) of draft tokens: ``[0]`` per
            token id, ``[1]`` per (previous token, token), ``[2]`` per support profile (its first
            ``SUPPORT_ROWS`` rows), ``[3]`` the calibration maps' knots.
        pending_tokens: ``int32[handles, K]`` each handle's pending draft tokens.
        pending_inputs: ``float64[handles, K, NIN]`` their mixer inputs.
        pending_sets: ``int64[handles, K]`` their weight-set offsets.
        pending_profiles: ``int64[handles, K]`` their support profiles.
        pending_lengths: ``int64[handles]`` pending draft lengths (0: none).
        pending_prev: ``int64[handles]`` the context's last token when it drafted.
        pending_stop: ``int64[handles]`` the token its draft stopped before (-1: none).
        learned: draft-token (and stop-token) outcomes learned so far.
    """

    def __init__(self, lr: float, handles: int = 16):
        self.lr = lr
        self.weights = mix_kernels.initial_weights()
        self.grad_sq = np.zeros_like(self.weights)
        self.pending_tokens = np.zeros((handles, 16), np.int32)
        self.pending_inputs = np.zeros((handles, 16, mix_kernels.NIN), np.float64)
        self.pending_sets = np.zeros((handles, 16), np.int64)
        self.pending_lengths = np.zeros(handles, np.int64)
        self.outcomes = np.zeros((4, mix_kernels.OUTCOME_SLOTS, 2), np.float64)
        self.pending_profiles = np.zeros((handles, 16), np.int64)
        self.pending_prev = np.zeros(handles, np.int64)
        self.pending_stop = np.full(handles, -1, np.int64)
        self.learned = 0

    @property
    def handles(self) -> int:
        """Handles the pending arrays hold."""
        return self.pending_lengths.shape[0]

    def grow_handles(self, n: int) -> None:
        """Room for ``n`` handles (more than now): the new ones with nothing pending."""
        add = n - self.pending_lengths.shape[0]
        self.pending_tokens = np.concatenate([self.pending_tokens, np.zeros((add,) + self.pending_tokens.shape[1:], np.int32)])
        self.pending_inputs = np.concatenate([self.pending_inputs, np.zeros((add,) + self.pending_inputs.shape[1:], np.float64)])
        self.pending_sets = np.concatenate([self.pending_sets, np.zeros((add,) + self.pending_sets.shape[1:], np.int64)])
        self.pending_profiles = np.concatenate([self.pending_profiles, np.zeros((add,) + self.pending_profiles.shape[1:], np.int64)])
        self.pending_lengths = np.concatenate([self.pending_lengths, np.zeros(add, np.int64)])
        self.pending_prev = np.concatenate([self.pending_prev, np.zeros(add, np.int64)])
        self.pending_stop = np.concatenate([self.pending_stop, np.full(add, -1, np.int64)])

    def fit_draft_length(self, k: int) -> None:
        """Room for pending drafts of ``k`` tokens per handle. Drafts pending when it grows are
        dropped, not learned from (rare: a larger budget than ever before)."""
        if k <= self.pending_tokens.shape[1]:
            return
        n = self.pending_lengths.shape[0]
        self.pending_tokens = np.zeros((n, k), np.int32)
        self.pending_inputs = np.zeros((n, k, mix_kernels.NIN), np.float64)
        self.pending_sets = np.zeros((n, k), np.int64)
        self.pending_profiles = np.zeros((n, k), np.int64)
        self.drop_pending(slice(None))

    def drop_pending(self, h: int | slice) -> None:
        """Forget handle ``h``'s pending draft and stop token: nothing of them will be learned."""
        self.pending_lengths[h] = 0
        self.pending_stop[h] = -1

    def learn(self, handles: np.ndarray, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        """Learn the outcomes of the rows' pending drafts from their verified tokens
        ``tokens[r, starts[r]:ends[r]]`` (rows checked by the caller)."""
        self.learned += mix_kernels.learn_rows(self.weights, self.grad_sq, self.lr, handles, tokens, starts, ends, self.pending_tokens,
                                               self.pending_inputs, self.pending_sets, self.pending_lengths, self.outcomes,
                                               self.pending_prev, self.pending_profiles, self.pending_stop)

    def age(self, factor: float) -> None:
        """Multiply the outcome counts by ``factor`` (a new policy version: what older policies did weighs less)."""
        self.outcomes *= factor

    def weight_sets(self) -> np.ndarray:
        """A copy of the weights as ``float64[NSETS, NIN]``."""
        return self.weights.reshape(mix_kernels.NSETS, mix_kernels.NIN).copy()
