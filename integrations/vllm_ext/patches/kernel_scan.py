"""Bug fix: a CPU engine starts in a process that imported numba first.

When vLLM's CPU platform registers its kernel overrides, ``vllm.triton_utils.dispatcher``
scans every module in ``sys.modules`` and calls ``vars(value).get("kernel")`` on each attribute
that has a ``__dict__``. llvmlite's ``ffi.lib`` (imported by numba, which the DAS drafter uses)
answers any attribute, ``__dict__`` included, with a C-function wrapper, so ``vars`` returns a
non-mapping and ``LLM(...)`` dies with ``'_lib_fn_wrapper' object has no attribute 'get'``. This
shadows ``vars`` in the dispatcher's module with :func:`safe_vars`, which returns ``{}`` for such
objects; the scan then skips them, as it skips any object without a kernel.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping

from integrations.vllm_ext.patches.patch import Patch, resolve

SCAN = "vllm.triton_utils.dispatcher._rebind_kernels"


def safe_vars(obj: object) -> Mapping:
    """``vars(obj)`` when it is a mapping, else ``{}`` (objects that fake ``__dict__``)."""
    try:
        namespace = builtins.vars(obj)
    except TypeError:
        return {}
    return namespace if isinstance(namespace, Mapping) else {}


def install() -> None:
    resolve("vllm.triton_utils.dispatcher").vars = safe_vars  # a module global shadows the builtin inside the scan


PATCH = Patch(
    name="kernel_scan",
    kind="bug fix",
    summary="vLLM's kernel-override scan skips objects that fake __dict__ (llvmlite's ffi.lib), so LLM() starts after numba",
    upstream="not reported upstream: found by this project; a report (vllm/triton_utils/dispatcher.py, "
             "the scan in _rebind_kernels) is still to be filed",
    versions=("0.32.0",),
    cpu_only=True,
    expects={SCAN: "(overrides)"},
    install=install,
    on_cuda="not needed: the scan runs when a platform registers kernel overrides, which only vLLM's CPU platform does",
)
