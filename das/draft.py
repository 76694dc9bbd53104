"""What a drafter proposes: :class:`Draft` for one request, :class:`DraftBatch` for the rows of one engine step."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Draft", "DraftBatch", "empty_draft"]


class Draft(NamedTuple):
    """A proposed continuation.

    Attributes:
        tokens: ``np.int32[k]`` draft token ids (``k == 0``: no draft).
        probs: ``np.float32[k]`` path probabilities: ``probs[i]`` is the estimated probability
            that the first ``i + 1`` draft tokens are all accepted (non-increasing).
        score: ``float``, ``sum(probs)``: the expected number of accepted draft tokens.
        match_len: ``int``, length of the context suffix the draft was anchored on (0 when empty,
            and for the ``mix`` chooser's drafts, which rest on every context at once).
    """

    tokens: np.ndarray
    probs: np.ndarray
    score: float
    match_len: int


class DraftBatch(NamedTuple):
    """Drafts for the rows of one engine step (:meth:`das.drafter.DASDrafter.speculate_batch`).

    ``K`` is the largest budget of the call (0 when there are no rows). Row ``r``'s draft is
    ``tokens[r, :lengths[r]]`` with path probabilities ``probs[r, :lengths[r]]``, exactly what
    :meth:`das.drafter.DASDrafter.speculate` returns as ``Draft.tokens`` / ``Draft.probs``.

    Attributes:
        tokens: ``np.int32[rows, K]`` draft token ids; -1 past each row's length.
        probs: ``np.float32[rows, K]`` path probabilities (non-increasing along a row): the
            estimated probability that the first ``j + 1`` draft tokens are all accepted; 0.0 past
            each row's length.
        lengths: ``np.int64[rows]`` draft lengths, ``0 <= lengths[r] <= budgets[r]``.
    """

    tokens: np.ndarray
    probs: np.ndarray
    lengths: np.ndarray


_EMPTY_TOKENS = np.empty(0, np.int32)
_EMPTY_TOKENS.flags.writeable = False
_EMPTY_PROBS = np.empty(0, np.float32)
_EMPTY_PROBS.flags.writeable = False
_EMPTY_DRAFT = Draft(_EMPTY_TOKENS, _EMPTY_PROBS, 0.0, 0)


def empty_draft() -> Draft:
    """The empty draft (shared read-only arrays, score 0.0, match_len 0)."""
    return _EMPTY_DRAFT

