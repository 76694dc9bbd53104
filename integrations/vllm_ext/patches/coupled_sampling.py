"""Feature: coupled sampling, a request's token at index ``i`` fixed by its sample key, ``i`` and the
target distribution there, whichever step samples or verifies it.

Why. vLLM's CPU sampler draws one seed per row and step from torch's generator, so how many
random numbers a run consumes depends on how many tokens each step verifies: a speculative engine
samples other rollouts than a plain one from the same seed, and DAS's cost budget (its choices
depend on measured step times) other rollouts on every run. With a key per request
(``SamplingParams.extra_args["das_sample_key"]``, an int), every token of that request is a
function of (key, index, logits): a plain engine, a speculative one and a rerun sample the same
rollout as long as the target's logits are the same.

How. A keyed row's token at index ``i`` is the inverse CDF of the target distribution ``p``
(token ids in order) at the uniform :func:`index_uniforms` ``(key, i)``, in plain steps (the CPU
sampler wrapped by :mod:`~integrations.vllm_ext.patches.lazy_bonus`) and in verification alike
(:func:`coupled_samples`, read by :mod:`~integrations.vllm_ext.patches.lazy_rejection`):
verification takes that sample at every drafted position ``i = n + j`` (``n`` the request's
verified tokens), accepts draft token ``j`` iff it equals the sample and, at the first mismatch,
emits the sample itself; a row whose drafts were all accepted samples its bonus token at ``n + k``.

Lossless. Each emitted token is an exact inverse-CDF sample of the target distribution at its
position, from a uniform (53 bits) no earlier token saw. For a point-mass draft ``x`` this is
speculative sampling itself: ``x`` is accepted with probability ``p(x)``, and a rejected position
emits a sample of ``p`` conditioned on not being ``x``, i.e. the residual ``max(p - q, 0)``
normalised (Leviathan et al. 2023, Theorem 1).

Switched on only when asked for: :func:`enable` (``generate_rollouts(..., coupled=True)``,
``das-rollout --coupled-sampling``, the recipes' ``rollout.coupled_sampling``) installs the model
runner's hook in every worker of an engine; ``DAS_VLLM_FEATURES=coupled_sampling`` installs it in
every vLLM process at start. Without the hook no step has keyed rows. Rows without a key, greedy
rows, per-request generators, fp64 Gumbel noise and steps that vLLM's own rejection sampler
handles (logprobs, draft probabilities) keep vLLM's behaviour. A token matches a plain engine's
only where the logits match bit for bit: in bf16 a verification forward rounds differently now and
then from a plain one (docs/benchmarks.md, "Evidence from code comments"); in float32 whole runs match.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from integrations.vllm_ext.patches.inverse_cdf import inverse_cdf
from integrations.vllm_ext.patches.patch import Patch, replace

KEY_ARG = "das_sample_key"  # SamplingParams.extra_args key: the request's sample key (int)
TARGET = "vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample"

_M64 = (1 << 64) - 1

# The step being sampled: per row of the input batch its key (-1: none) and its verified token
# count n (the index of the next token). Set by the model runner's hook (:func:`keyed_sampling`).
_keys: np.ndarray | None = None
_next_index: np.ndarray | None = None


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over ``uint64`` values (Steele et al. 2014), elementwise."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def index_uniforms(keys: np.ndarray, index: np.ndarray) -> np.ndarray:
    """The uniform of token ``index`` of request ``keys``.

    Args:
        keys: int64 array, sample keys (non-negative: negative keys are rows without one and must
            not be passed).
        index: int64 array broadcastable with ``keys``, token indices (prompt included).

    Returns:
        float64 array of the broadcast shape in ``[0, 1)``, multiples of 2**-53: SplitMix64 over the
        key, then over the key's hash xor the index (times an odd constant), so that nearby keys and
        indices share nothing.
    """
    k = _splitmix64(np.asarray(keys, np.int64).astype(np.uint64))
    with np.errstate(over="ignore"):
        s = _splitmix64(k ^ (np.asarray(index, np.int64).astype(np.uint64) * np.uint64(0xD6E8FEB86659FD93)))
    return (s >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def rollout_key(seed: int, ordinal: int) -> int:
    """A sample key for request ``ordinal`` of a batch generated with ``seed``: a non-negative int63."""
    h = _splitmix64(np.array([int(seed) & _M64], np.uint64))[0] ^ np.uint64(int(ordinal) & _M64)
    return int(_splitmix64(np.array([h], np.uint64))[0] >> np.uint64(1))


def request_key(params: Any) -> int:
    """The sample key in a request's ``SamplingParams.extra_args``, or -1 (none, or not a non-negative int)."""
    extra = getattr(params, "extra_args", None)
    if not isinstance(extra, dict):
        return -1
    key = extra.get(KEY_ARG)
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool) and 0 <= int(key) < (1 << 63):
        return int(key)
    return -1


def begin_step(keys: np.ndarray | None, next_index: np.ndarray | None) -> None:
    """Record the step's rows (``keys`` int64 ``[rows]``, -1 for none; ``next_index`` int64 ``[rows]``); None: no keyed row."""
    global _keys, _next_index
    if keys is None or not bool((keys >= 0).any()):
        _keys = _next_index = None
    else:
        _keys, _next_index = keys, next_index


def end_step() -> None:
    """Forget the step's rows (after sampling)."""
    global _keys, _next_index
    _keys = _next_index = None


def active() -> bool:
    """Whether the step being sampled has keyed rows."""
    return _keys is not None


def row_uniforms(rows: int, offsets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Uniforms of the step's keyed rows for the token ``offsets`` past each row's next index.

    Args:
        rows: rows of the logits being sampled (must equal the step's row count).
        offsets: ``[rows]`` int, draft tokens before the sampled one (bonus tokens), or None (0).

    Returns:
        ``(keyed [rows] bool, u [rows] float64)`` (0 for unkeyed rows), or None when the step has
        no keyed rows or its row count differs from ``rows``.
    """
    if _keys is None or _keys.shape[0] != rows:
        return None
    index = _next_index if offsets is None else _next_index + offsets.cpu().numpy().astype(np.int64)
    keyed = _keys >= 0
    u = np.zeros(rows, np.float64)
    u[keyed] = index_uniforms(_keys[keyed], index[keyed])
    return torch.from_numpy(keyed), torch.from_numpy(u)


def sample_rows(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Keyed rows' tokens: the inverse CDF of ``softmax(logits)`` at ``u``.

    Args:
        logits: ``[R, vocab]`` (temperature, top-k and top-p applied; ``-inf`` for excluded tokens).
        u: ``[R]`` float64 uniforms.

    Returns:
        ``[R]`` int64 token ids.
    """
    return inverse_cdf(torch.softmax(logits.to(torch.float32), dim=-1), u)


def coupled_samples(target_logits: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The target's own sample at every drafted position of the step's keyed rows.

    Args:
        target_logits: ``[num_draft_tokens, vocab]`` float32, temperature, top-k and top-p applied.
        counts: ``[rows]`` int64, draft tokens per row (row order of the step).

    Returns:
        ``(keyed [num_draft_tokens] bool, samples [num_draft_tokens] int64)``: for positions of
        keyed rows :func:`sample_rows` at ``index_uniforms(key, n + j)`` (what a plain step would
        sample at that index from these logits); other positions 0. None when the step has no
        keyed rows or its row count differs from ``counts``.
    """
    rows = counts.shape[0]
    if _keys is None or _keys.shape[0] != rows:
        return None
    c = counts.cpu().numpy().astype(np.int64)
    row_of = np.repeat(np.arange(rows), c)
    j = np.arange(row_of.shape[0]) - np.repeat(np.cumsum(c) - c, c)
    keyed = _keys[row_of] >= 0
    samples = torch.zeros(row_of.shape[0], dtype=torch.int64)
    if keyed.any():
        at = np.flatnonzero(keyed)
        u = torch.from_numpy(index_uniforms(_keys[row_of[at]], _next_index[row_of[at]] + j[at]))
        if at.shape[0] == row_of.shape[0]:
            samples = sample_rows(target_logits, u)
        else:
            samples[torch.from_numpy(at)] = sample_rows(target_logits.index_select(0, torch.from_numpy(at)), u)
    return torch.from_numpy(keyed), samples


def step_keys(runner: Any) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A model runner's input batch: its sample keys (int64 ``[rows]``, -1: none) and verified
    token counts (the index of each row's next token), or ``(None, None)`` when no row has a key.

    A request's key is read once, into a dict on the runner (request ids are unique per engine,
    not across engines); a step whose engine has seen no keyed request costs one membership test
    per row."""
    batch = runner.input_batch
    ids = getattr(batch, "req_ids", None)
    requests = getattr(runner, "requests", None)
    if not ids or requests is None:  # not a runner with requests: nothing to key
        return None, None
    known = runner.__dict__.setdefault("_das_sample_keys", {})
    new = [rid for rid in ids if rid not in known]
    if new:
        if len(known) > 2 * len(requests) + 1024:  # drop finished requests now and then
            known = runner._das_sample_keys = {rid: k for rid, k in known.items() if rid in requests}
        for rid in new:
            known[rid] = request_key(getattr(requests.get(rid), "sampling_params", None))
        runner._das_keyed = any(k >= 0 for k in known.values())
    if not runner.__dict__.get("_das_keyed", False):
        return None, None
    keys = np.fromiter((known[rid] for rid in ids), np.int64, len(ids))
    if not bool((keys >= 0).any()):
        return None, None
    return keys, np.asarray(batch.num_tokens_no_spec[: len(ids)], np.int64).copy()


def keyed_sampling(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``GPUModelRunner._sample(self, logits, spec_decode_metadata)``: record the batch's keys
    and next token indices (:func:`step_keys`) for the samplers while the step is sampled."""

    def _sample(self, logits, spec_decode_metadata):
        begin_step(*step_keys(self))
        try:
            return original(self, logits, spec_decode_metadata)
        finally:
            end_step()

    _sample.__wrapped__ = original
    return _sample


def install() -> None:
    replace(TARGET, keyed_sampling, PATCH.name)


def enable(llm: Any) -> list[bool]:
    """Switch coupled sampling on in every worker of ``llm`` (a ``vllm.LLM``).

    Calls the worker extension's ``das_enable_coupled_sampling`` by name
    (:mod:`integrations.vllm_ext.worker_extension`), so it reaches workers in other processes too.
    ``DAS_VLLM_FEATURES=coupled_sampling`` in the environment instead installs it in every vLLM
    process at its start.

    Returns:
        per worker, whether it is on there (False where vLLM runs as shipped: another version or
        a CUDA build, where the keys are ignored; :func:`integrations.vllm_ext.patches.apply` logs why).

    Raises:
        ExtensionMissing (a RuntimeError): the engine was built without the DAS worker extension
            (the message says what to add).
    """
    from integrations.vllm_ext.worker_extension import call

    return [bool(on) for on in call(llm, "das_enable_coupled_sampling")]


PATCH = Patch(
    name="coupled_sampling",
    kind="feature",
    summary="a keyed request's token at each index fixed by (key, index) and the target distribution, whatever the drafts",
    upstream="not reported upstream: a das feature (reproducible rollouts across speculative and plain engines), no vLLM bug",
    versions=("0.32.0",),
    cpu_only=True,
    expects={TARGET: "(self, logits, spec_decode_metadata)"},
    install=install,
    requires=("lazy_rejection", "lazy_bonus"),
)
