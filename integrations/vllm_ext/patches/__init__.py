"""das's patches of vLLM, one module per patch, installed by one call: :func:`apply`.

vLLM calls :func:`apply` in every process it starts (the calling process when it builds an
engine, the engine core, each worker), before it builds a model: ``pyproject.toml`` registers it
as a ``vllm.general_plugins`` entry point, vLLM's own way to patch its processes
(``vllm.plugins.load_general_plugins``). Importing a das module (the proposer among them)
patches nothing. Code that runs vLLM's pieces outside an engine (tests of a sampler) calls
:func:`apply` itself; so does :func:`integrations.vllm_ext.engine.make_llm`, for a source
checkout whose entry point is not installed (vLLM's ``VLLM_PLUGINS`` can also leave it out).

Each module holds one patch and its :class:`~integrations.vllm_ext.patches.patch.Patch` record:
its kind (bug fix, speed fix or feature), its upstream issue or pull request, the vLLM versions it
was tested on and the signature of every vLLM function it touches. :func:`apply` installs a patch
only on those versions, on vLLM's CPU build where it is CPU-only, and while those signatures are
the ones it was written for; it logs what it installed and, once, what it left out and why: a
warning for every patch that is needed and left out (another version, changed signatures, a
feature asked for on a build it does not run on), a debug line for a CPU-path fix on a CUDA build,
which does not need it (each patch's ``on_cuda`` says why; docs/gpu.md has the table).

======================  ===========  ==========================================================
patch                   kind         what it changes
======================  ===========  ==========================================================
``expand_batch``        bug fix      float temperatures reach verification intact (vLLM #55005)
``kernel_scan``         bug fix      ``LLM()`` starts in a process that imported numba
``suffix_schedule``     bug fix      ``suffix`` runs with a batch-size schedule of K
``lazy_rejection``      speed fix    recovered tokens only for rejected rows (vLLM PR #41258)
``lazy_bonus``          speed fix    bonus tokens only for rows that keep them
``plain_sampling``      speed fix    a step without drafts takes the plain sampler
``coupled_sampling``    feature      tokens fixed by (sample key, index): asked for only
======================  ===========  ==========================================================
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from integrations.vllm_ext.patches import (
    coupled_sampling,
    expand_batch,
    kernel_scan,
    lazy_bonus,
    lazy_rejection,
    plain_sampling,
    suffix_schedule,
)
from integrations.vllm_ext.patches.patch import Patch, mismatches, vllm_version

__all__ = ["PATCHES", "FEATURES", "FEATURES_ENV", "Patch", "apply", "installed", "vllm_version"]

logger = logging.getLogger(__name__)

# In install order: a patch comes after those it requires.
PATCHES: tuple[Patch, ...] = (
    expand_batch.PATCH,
    kernel_scan.PATCH,
    suffix_schedule.PATCH,
    lazy_rejection.PATCH,
    lazy_bonus.PATCH,
    plain_sampling.PATCH,
    coupled_sampling.PATCH,
)
FEATURES = tuple(p.name for p in PATCHES if p.kind == "feature")
#: Environment variable naming the features (comma-separated) that :func:`apply` installs when not told.
FEATURES_ENV = "DAS_VLLM_FEATURES"

_installed: list[str] = []  # names installed in this process, in order
_reported: set[tuple[str, str]] = set()  # (patch, reason) already logged


def installed() -> tuple[str, ...]:
    """Names of the patches installed in this process, in the order they were installed."""
    return tuple(_installed)


def _requested_features(features: Iterable[str] | None) -> set[str]:
    if features is None:
        features = [f.strip() for f in os.environ.get(FEATURES_ENV, "").split(",") if f.strip()]
    elif isinstance(features, str):
        raise ValueError(f"features must be a list of names, got the string {features!r}")
    wanted = set(features)
    unknown = sorted(wanted - set(FEATURES))
    if unknown:
        raise ValueError(f"unknown das vLLM features {unknown}; expected some of {list(FEATURES)} "
                         f"(from the argument, or {FEATURES_ENV}={os.environ.get(FEATURES_ENV, '')!r})")
    return wanted


def _left_out(patch: Patch, why: str, level: int = logging.WARNING) -> None:
    if (patch.name, why) not in _reported:
        _reported.add((patch.name, why))
        logger.log(level, "das: vLLM patch %s (%s) not installed: %s", patch.name, patch.kind, why)


def apply(features: Iterable[str] | None = None) -> tuple[str, ...]:
    """Install the patches this vLLM needs, and the ``features`` asked for, in this process.

    Idempotent, and safe in any process: with vLLM missing, or a build or version the patches were
    not written for, it changes nothing (and logs why, once). vLLM calls it without arguments
    (the ``vllm.general_plugins`` entry point).

    Args:
        features: names from :data:`FEATURES` to install as well (e.g. ``["coupled_sampling"]``);
            None reads them from the environment variable :data:`FEATURES_ENV` (comma-separated;
            unset: none).

    Returns:
        the names of every patch installed in this process so far (:func:`installed`).

    Raises:
        ValueError: an unknown feature name (in the argument or the environment variable).
    """
    wanted = _requested_features(features)
    try:
        import vllm  # noqa: F401
    except ImportError:  # nothing to patch
        return installed()
    from integrations.vllm_ext.cpu_runtime import is_cpu_build

    version = vllm_version()
    cpu = is_cpu_build()
    untested = []
    for patch in PATCHES:
        if patch.name in _installed or (patch.kind == "feature" and patch.name not in wanted):
            continue
        if patch.cpu_only and not cpu:
            # A feature was asked for and cannot run here: a warning. A fix of the CPU code path is not needed here.
            needed = patch.kind == "feature"
            _left_out(patch, f"this is not vLLM's CPU build; {patch.on_cuda}", logging.WARNING if needed else logging.DEBUG)
            continue
        if version not in patch.versions:
            untested.append(patch.name)
            continue
        missing = [name for name in patch.requires if name not in _installed]
        if missing:
            _left_out(patch, f"it builds on {missing}, which are not installed")
            continue
        differ = mismatches(patch)
        if differ:
            _left_out(patch, "vLLM's functions are not the ones it was written for: " + "; ".join(differ))
            continue
        patch.install()
        _installed.append(patch.name)
        logger.info("das: installed vLLM patch %s (%s; %s): %s", patch.name, patch.kind, patch.upstream, patch.summary)
    if untested and ("", version) not in _reported:
        _reported.add(("", version))
        logger.warning("das: vLLM %s is not a version das's patches were tested on (%s); running without %s "
                       "(on a CPU build check vLLM issue #55005: lossy sampling at temperature > 0)",
                       version, ", ".join(sorted({v for p in PATCHES for v in p.versions})), ", ".join(untested))
    return installed()
