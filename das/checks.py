"""Argument checks of das's public verbs: token arrays, an engine step's token matrix and row vectors, ints, floats.

Each check returns the value in the form the kernels take (no copy where it already is one) or
raises ``ValueError`` naming the argument, the value and what was expected. The token checks
accept what vLLM passes (``int32`` token matrices, ``int64`` row vectors) as they are: the
drafter's verbs call them on every engine step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from das import trie_kernels as kernels
from das.trie_kernels import VOCAB_LIMIT

__all__ = ["I32", "I64", "as_tokens", "batch_error", "check_range", "draft_args", "float_arg", "int_arg", "min_probs", "positive_weight",
           "row_vector", "token_matrix"]

I32 = np.dtype(np.int32)
I64 = np.dtype(np.int64)


def as_tokens(tokens, name: str = "tokens") -> np.ndarray:
    """``tokens`` as a C-contiguous 1-D ``int32`` or ``int64`` array (no copy when it already is).

    Range is not checked here (:func:`check_range`, or the kernels, check ``0 <= token < VOCAB_LIMIT``).

    Raises:
        ValueError: not 1-D, or not integers.
    """
    if type(tokens) is np.ndarray:
        a = tokens
    else:
        a = np.asarray(tokens)
        if a.size == 0:
            a = a.astype(np.int64)
    dt = a.dtype
    if dt is not I64 and dt is not I32 and dt != I64 and dt != I32:
        if dt.kind not in "iu":
            raise ValueError(f"{name} must be integer token ids, got dtype {dt}")
        if dt.kind == "u" and a.size and int(a.max()) >= VOCAB_LIMIT:
            bad = int(a[np.argmax(a >= VOCAB_LIMIT)])
            raise ValueError(f"token {bad} in {name} is out of range [0, {VOCAB_LIMIT})")
        a = a.astype(np.int64)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    return a


def check_range(a: np.ndarray, name: str | None = None) -> None:
    """Raise ValueError naming the first token of ``a`` (1-D int32 or int64, as :func:`as_tokens`
    gives) outside ``[0, VOCAB_LIMIT)``, and ``name`` (the argument it came in) if given."""
    i = kernels.first_bad_token(a)
    if i >= 0:
        where = f" of {name}" if name else ""
        raise ValueError(f"token {int(a[i])} at index {i}{where} is out of range [0, {VOCAB_LIMIT})")


def int_arg(x, name: str, lo: int | None = None, hi: int | None = None) -> int:
    """``x`` as an int in ``[lo, hi]`` (either bound may be None). Bools are refused."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {x!r}")
    x = int(x)
    if lo is not None and x < lo:
        raise ValueError(f"{name} must be >= {lo}, got {x}")
    if hi is not None and x > hi:
        raise ValueError(f"{name} must be <= {hi}, got {x}")
    return x


def float_arg(x, name: str, expected: str, ok: Callable[[float], bool]) -> float:
    """``x`` as a float for which ``ok`` holds; ``expected`` says what that is in the message (e.g. ``"a number in (0, 1]"``)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be {expected}, got {x!r}")
    f = float(x)
    if not ok(f):
        raise ValueError(f"{name} must be {expected}, got {x!r}")
    return f


def positive_weight(weight) -> float:
    """``weight`` as a positive finite float (a sequence's weight in a suffix tree)."""
    try:
        w = float(weight)
    except (TypeError, ValueError):
        raise ValueError(f"weight must be a positive finite number, got {weight!r}") from None
    if not (w > 0.0 and math.isfinite(w)):
        raise ValueError(f"weight must be a positive finite number, got {weight!r}")
    return w


def draft_args(max_tokens, min_token_prob, max_spec_factor, min_match, prior) -> tuple[int, float, float, int, float]:
    """The arguments of :meth:`das.suffix_tree.SuffixTree.draft`, checked: ``max_tokens`` an int
    >= 0, ``min_token_prob`` in [0, 1], ``max_spec_factor`` and ``prior`` finite and >= 0,
    ``min_match`` an int >= 1."""
    if type(max_tokens) is not int:
        max_tokens = int_arg(max_tokens, "max_tokens")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if not 0.0 <= min_token_prob <= 1.0:
        raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob!r}")
    if not 0.0 <= max_spec_factor < math.inf:
        raise ValueError(f"max_spec_factor must be a finite number >= 0, got {max_spec_factor!r}")
    if type(min_match) is not int:
        min_match = int_arg(min_match, "min_match")
    if min_match < 1:
        raise ValueError(f"min_match must be >= 1, got {min_match}")
    if not 0.0 <= prior < math.inf:
        raise ValueError(f"prior must be a finite number >= 0, got {prior!r}")
    return max_tokens, float(min_token_prob), float(max_spec_factor), min_match, float(prior)


def token_matrix(a, rows: int) -> np.ndarray:
    """``a`` as a 2-D int32/int64 array with at least ``rows`` rows (no copy when it is one)."""
    if type(a) is not np.ndarray:
        a = np.asarray(a)
    if a.ndim != 2:
        raise ValueError(f"token_ids must be a 2-D array (rows x tokens), got shape {a.shape}")
    if a.dtype != I32 and a.dtype != I64:
        if a.dtype.kind not in "iu":
            raise ValueError(f"token_ids must hold integer token ids, got dtype {a.dtype}")
        a = a.astype(np.int64)
    if a.shape[0] < rows:
        raise ValueError(f"token_ids has {a.shape[0]} rows, fewer than the {rows} request ids")
    return a


def row_vector(a, name: str, rows: int) -> np.ndarray:
    """``a`` as an ``int64[rows]`` array (no copy when it is one)."""
    if type(a) is not np.ndarray or a.dtype != I64:
        a = np.asarray(a)
        if a.dtype.kind not in "iu" and not (a.size == 0 and a.dtype.kind == "f"):
            raise ValueError(f"{name} must be integers, got dtype {a.dtype}")
        a = a.astype(np.int64)
    if a.shape != (rows,):
        raise ValueError(f"{name} must have shape ({rows},) (one per request id), got {a.shape}")
    return a


def min_probs(min_prob, rows: int) -> np.ndarray:
    """A call's draft cutoffs as ``float64[rows]``: a number in [0, 1] for every row, or one per row."""
    if isinstance(min_prob, np.ndarray):
        a = np.ascontiguousarray(min_prob, dtype=np.float64)  # one array type for the kernels: no second compile
        if a.shape != (rows,):
            raise ValueError(f"min_prob must be a number or have shape ({rows},) (one per request id), got {a.shape}")
        bad = np.flatnonzero(~((a >= 0.0) & (a <= 1.0)))
        if bad.shape[0]:
            raise ValueError(f"min_prob[{int(bad[0])}] must be a number in [0, 1], got {float(a[bad[0]])!r}")
        return a
    return np.full(rows, float_arg(min_prob, "min_prob", "a number in [0, 1]", lambda f: 0.0 <= f <= 1.0))


def batch_error(code: int, r: int, c: int, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> str:
    """The message of :func:`das.trie_kernels.check_batch`'s finding ``(code, r, c)`` in an engine step's rows."""
    if code == kernels.E_START:
        return f"starts[{r}] must be >= 0, got {int(starts[r])}"
    if code == kernels.E_ORDER:
        return f"ends[{r}] must be >= starts[{r}] = {int(starts[r])}, got {int(ends[r])}"
    if code == kernels.E_END:
        return f"ends[{r}] must be <= token_ids.shape[1] = {tokens.shape[1]}, got {int(ends[r])}"
    return f"token {int(tokens[r, c])} at token_ids[{r}, {c}] is out of range [0, {VOCAB_LIMIT})"
