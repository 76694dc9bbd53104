"""Result files: checked before a run, written atomically.

* :func:`check_output_path` — call it before a run starts: it refuses an existing file unless
  ``overwrite`` is set, a directory in the way, and a location that cannot be written, so a long
  run never ends in a write error or silently replaces an earlier result.
* :func:`write_atomic` / :func:`atomic_output` — write into a temporary file in the target's
  directory and ``os.replace`` it over the target only once it is complete: a failed write leaves
  the old file as it was (and no temporary file behind).
* :func:`provenance` — what every result JSON records about its run: the code version (git commit
  and whether the checkout had uncommitted changes), the date, the CPU model and the command line.
* :func:`rollout_digest` / :func:`identical_rollouts` — whether several methods generated the same
  rollouts, token for token (a comparison of methods is like with like only where they did).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["check_output_path", "write_atomic", "atomic_output", "save_figure", "code_version", "cpu_model", "provenance",
           "rollout_digest", "identical_rollouts"]

REPO = Path(__file__).resolve().parents[1]


def _nearest_existing(p: Path) -> Path:
    q = p
    while not q.exists():
        if q.parent == q:
            break
        q = q.parent
    return q


def check_output_path(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Check that a result can be written to ``path``; returns it as an absolute :class:`Path`.

    Nothing is created except a probe file, removed at once, in the nearest existing directory.

    Raises:
        ValueError: naming the path, if it exists and ``overwrite`` is False, if it is a
            directory, if a parent is not a directory, or if its directory cannot be written.
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"output path must be a non-empty path, got {path!r}")
    p = Path(os.fspath(path)).expanduser().absolute()
    if p.is_dir():
        raise ValueError(f"output path {str(p)!r} is a directory; give a file name")
    if p.exists() and not overwrite:
        raise ValueError(f"output file {str(p)!r} exists; choose another path or allow overwriting it (overwrite)")
    base = _nearest_existing(p.parent)
    if not base.is_dir():
        raise ValueError(f"cannot write {str(p)!r}: {str(base)!r} is not a directory")
    try:  # os.access says yes to root even on read-only file systems: try it
        fd, probe = tempfile.mkstemp(prefix=".das-write-probe-", dir=base)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"cannot write {str(p)!r}: directory {str(base)!r} is not writable ({exc.strerror or exc})") from None
    return p


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on a clean exit it replaces ``path`` (parents are created).

    For writers that want a file name (``pyarrow.parquet.write_table``, ``savefig``). On an
    exception the temporary file is removed and ``path`` is left as it was.
    """
    p = Path(os.fspath(path)).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_path, 0o666 & ~umask)
        os.replace(tmp_path, p)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp_path.unlink()
        raise


def write_atomic(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` (str: UTF-8) to ``path`` atomically (see :func:`atomic_output`); returns the path."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes or str, got {type(data).__name__}")
    p = Path(os.fspath(path)).expanduser()
    with atomic_output(p) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return p


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 110) -> Path:
    """Write a matplotlib figure to ``path`` as PNG atomically (see :func:`atomic_output`), then close it; returns the path."""
    import matplotlib.pyplot as plt

    p = Path(os.fspath(path)).expanduser()
    try:
        with atomic_output(p) as tmp:
            fig.savefig(tmp, dpi=dpi, format="png")
    finally:
        plt.close(fig)
    return p


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_version() -> dict[str, Any]:
    """The checkout's code version: ``{"commit": full sha or None, "dirty": bool or None}``.

    ``dirty`` is True when tracked files differ from the commit (``git status --porcelain
    --untracked-files=no`` is not empty): the result then ran on code no commit holds. Both are
    None outside a git checkout (an installed wheel).
    """
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` prints it (``Model name:``), else ``/proc/cpuinfo``'s; ``""`` when neither says."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, env={**os.environ, "LC_ALL": "C"})
        for line in out.stdout.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name" and value.strip():
                return value.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return ""


def provenance(prog: str, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """What a result JSON records about the run that made it.

    Args:
        prog: the command as a user types it, e.g. ``"das-rollout"`` or ``"python -m benchmarks.rollout"``.
        argv: its arguments (default ``sys.argv[1:]``).

    Returns:
        ``{"code_version": {"commit", "dirty"}, "date": ISO 8601 UTC (seconds), "cpu": lscpu's model
        name, "command": the shell-quoted command line}``.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    return {"code_version": code_version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu_model(), "command": " ".join([prog, *(shlex.quote(a) for a in args)])}


def rollout_digest(token_ids: Sequence[int]) -> str:
    """A 16-hex-digit digest of a rollout's output token ids: equal rollouts, equal digests (BLAKE2b of the ids as int64)."""
    import numpy as np

    return hashlib.blake2b(np.asarray(token_ids, dtype=np.int64).tobytes(), digest_size=8).hexdigest()


def identical_rollouts(digests: Mapping[str, Sequence[Sequence[str]]]) -> dict[str, Any]:
    """How many rollouts every method generated token for token alike.

    Args:
        digests: ``{method: [[digest per rollout] per iteration]}`` (:func:`rollout_digest`), the
            rollouts of an iteration in the same (group, sample) order in every method; the first
            method is the one the others are compared with.

    Returns:
        ``{"identical": rollouts identical in every method, "rollouts": rollouts per method,
        "per_iteration": [identical in every method, per iteration], "vs_first": {method: rollouts
        identical to the first method's}}``.

    Raises:
        ValueError: the methods ran different numbers of iterations or of rollouts in an iteration.
    """
    methods = list(digests)
    if not methods:
        return {"identical": 0, "rollouts": 0, "per_iteration": [], "vs_first": {}}
    base = digests[methods[0]]
    if len({len(digests[m]) for m in methods}) != 1:
        raise ValueError(f"methods ran different numbers of iterations: { {m: len(digests[m]) for m in methods} }")
    per_iteration, vs_first = [], {m: 0 for m in methods[1:]}
    for it, ref in enumerate(base):
        rows = [digests[m][it] for m in methods]
        if len({len(r) for r in rows}) != 1:
            raise ValueError(f"iteration {it}: methods generated different numbers of rollouts: {[len(r) for r in rows]}")
        per_iteration.append(sum(all(r[i] == ref[i] for r in rows[1:]) for i in range(len(ref))))
        for m, r in zip(methods[1:], rows[1:]):
            vs_first[m] += sum(a == b for a, b in zip(r, ref))
    return {"identical": sum(per_iteration), "rollouts": sum(len(r) for r in base), "per_iteration": per_iteration, "vs_first": vs_first}
