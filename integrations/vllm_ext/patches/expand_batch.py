"""Bug fix: lossless verification sampling on vLLM's CPU build (vLLM issue #55005).

The CPU override of the rejection sampler's ``expand_kernel`` handles int64 only: it casts the
float per-request temperature and top-p tensors and returns uninitialised memory, so at
temperature > 0 the verification logits are divided by garbage temperatures and the outputs stop
following the target distribution (greedy requests never reach it). This replaces
``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` with a pure-torch version for every
dtype. The rejection sampler looks the function up in its module at call time, so replacing the
module attribute is enough; it must happen in the process that runs the model (vLLM's plugin
loading does that: :mod:`integrations.vllm_ext.patches`).
"""

from __future__ import annotations

import torch

from integrations.vllm_ext.patches.patch import Patch, replace

TARGET = "vllm.v1.sample.rejection_sampler.expand_batch_to_tokens"


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


def install() -> None:
    replace(TARGET, lambda _: expand_batch_to_tokens, PATCH.name)


PATCH = Patch(
    name="expand_batch",
    kind="bug fix",
    summary="float temperatures and top-p reach verification intact (the CPU expand kernel handles int64 only)",
    upstream="vLLM issue #55005",
    versions=("0.32.0",),
    cpu_only=True,
    expects={TARGET: "(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0)"},
    install=install,
    on_cuda=("not needed: the bug is in the CPU override of expand_kernel, which only vLLM's CPU platform registers (vllm.platforms.cpu calls "
             "register_kernels); a CUDA build runs the Triton kernel, which keeps float values"),
)
