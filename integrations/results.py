"""Result files: checked before a run, written atomically.

* :func:`check_output_path` — call it before a run starts: it refuses an existing file unless
  ``overwrite`` is set, a directory in the way, and a location that cannot be written, so a long
  run never ends in a write error or silently replaces an earlier result.
* :func:`write_atomic` / :func:`atomic_output` — write into a temporary file in the target's
  directory and ``os.replace`` it over the target only once it is complete: a failed write leaves
  the old file as it was (and no temporary file behind).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["check_output_path", "write_atomic", "atomic_output"]


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
