"""Rollout traces: what a policy generated, per iteration, problem and sample, as one parquet file.

Schema (one row per rollout):

=================  ===================  ==================================================
column             type                 meaning
=================  ===================  ==================================================
``iteration``      int32                rollout iteration, 0-based
``policy_version`` int32                policy version that generated it (iteration + 1)
``problem_id``     string               the problem (prompt) it answers
``sample``         int32                index in its GRPO group, 0..n-1
``prompt_ids``     list<int32>          prompt token ids (chat template applied)
``output_ids``     list<int32>          generated token ids
``finish_reason``  string               ``stop`` or ``length``
=================  ===================  ==================================================

Traces are generated data: write them to a cache or output directory, never to the repository.
The benchmarks that replay a trace share one cached trace (:func:`cached_trace`): the DSR-sub
problems (shipped with the package), recorded with the real model the first time it is needed
(:func:`record_trace`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

SCHEMA = pa.schema(
    [
        ("iteration", pa.int32()),
        ("policy_version", pa.int32()),
        ("problem_id", pa.string()),
        ("sample", pa.int32()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("output_ids", pa.list_(pa.int32())),
        ("finish_reason", pa.string()),
    ]
)


@dataclass
class Rollout:
    """One generated rollout."""

    iteration: int
    policy_version: int
    problem_id: str
    sample: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str


def _check_rollout(i: int, r: Any) -> None:
    if not isinstance(r, Rollout):
        raise ValueError(f"rollout {i}: expected a Rollout, got {type(r).__name__}")
    for name in ("iteration", "policy_version", "sample"):
        v = getattr(r, name)
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
            raise ValueError(f"rollout {i}: {name} must be an int >= 0, got {v!r}")
    for name in ("problem_id", "finish_reason"):
        if not isinstance(getattr(r, name), str):
            raise ValueError(f"rollout {i}: {name} must be a string, got {getattr(r, name)!r}")
    for name in ("prompt_ids", "output_ids"):
        ids = getattr(r, name)
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
            raise ValueError(f"rollout {i}: {name} must be a list of token ids, got {type(ids).__name__}")


def _table(rollouts: list[Rollout]) -> pa.Table:
    """``rollouts`` as a table of :data:`SCHEMA` (checked)."""
    rollouts = list(rollouts)
    for i, r in enumerate(rollouts):
        _check_rollout(i, r)
    columns = {name: [getattr(r, name) for r in rollouts] for name in SCHEMA.names}
    try:
        return pa.table(columns, schema=SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
        raise ValueError(f"rollouts do not fit the trace schema: {exc}") from None


class TraceWriter:
    """A trace written as a run goes: one parquet row group per :meth:`write` (an RL step's
    rollouts), into ``<stem>.partial.parquet`` beside ``path``, moved over ``path`` by
    :meth:`close` once the run completed. Each call writes only its own rollouts, so a long run
    costs what its rollouts do. A run that fails still closes the writer (``complete=False``):
    the partial file then holds the steps written so far, and an earlier file at ``path`` stays
    as it was.

    Raises (constructor):
        ValueError: as :func:`integrations.results.check_output_path` (``path`` exists and
            ``overwrite`` is False, or cannot be written).
    """

    def __init__(self, path: str | Path, *, overwrite: bool = False):
        from integrations.results import check_output_path

        self.path = check_output_path(path, overwrite=overwrite)
        self.partial = self.path.with_name(self.path.stem + ".partial.parquet")
        self._writer: pq.ParquetWriter | None = None
        self.rows = 0

    def write(self, rollouts: list[Rollout]) -> None:
        """Append ``rollouts`` as one row group (ValueError: a rollout that does not fit the schema)."""
        table = _table(rollouts)
        if self._writer is None:
            self.partial.parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self.partial, SCHEMA)
        self._writer.write_table(table)
        self.rows += table.num_rows

    def close(self, complete: bool = True) -> Path | None:
        """Finish the file; with ``complete``, move it over ``path`` and return ``path``, else
        return the partial file's path (None when nothing was written)."""
        if self._writer is None:
            return None
        self._writer.close()
        self._writer = None
        if not complete:
            return self.partial
        os.replace(self.partial, self.path)
        return self.path


def write_trace(path: str | Path, rollouts: list[Rollout], *, overwrite: bool = True) -> Path:
    """Write ``rollouts`` to a parquet file at ``path`` (parent directories are created).

    The file is written next to ``path`` and moved over it only when complete, so a failed write
    leaves an earlier trace as it was.

    Raises:
        ValueError: a rollout has a field of the wrong type or a negative count, or ``path``
            exists and ``overwrite`` is False, or cannot be written (see
            :func:`integrations.results.check_output_path`).
    """
    from integrations.results import atomic_output, check_output_path

    table = _table(rollouts)
    path = check_output_path(path, overwrite=overwrite)
    with atomic_output(path) as tmp:
        pq.write_table(table, tmp)
    return path


def read_trace(path: str | Path) -> list[Rollout]:
    """Read a trace written by :func:`write_trace` (an empty trace gives ``[]``).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: naming the path: not a parquet file, a column of :data:`SCHEMA` missing or of
            another type, a null value, or a negative iteration / version / sample.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no rollout trace at {path}")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for non-parquet input
        raise ValueError(f"{path} is not a parquet rollout trace: {exc}") from None
    missing = [n for n in SCHEMA.names if n not in table.column_names]
    if missing:
        raise ValueError(f"{path} is not a rollout trace: missing columns {missing}; expected {SCHEMA.names}")
    for field in SCHEMA:
        col = table.column(field.name)
        if not col.type.equals(field.type):
            try:
                col = col.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise ValueError(f"{path}: column {field.name!r} is {col.type}, expected {field.type} ({exc})") from None
            table = table.set_column(table.column_names.index(field.name), field.name, col)
        if col.null_count:
            raise ValueError(f"{path}: column {field.name!r} has {col.null_count} null values")
        if pa.types.is_list(field.type) and pc.sum(pc.list_value_length(col).is_null()).as_py():
            raise ValueError(f"{path}: column {field.name!r} has null token lists")
    for name in ("iteration", "policy_version", "sample"):
        if table.num_rows and pc.min(table.column(name)).as_py() < 0:
            raise ValueError(f"{path}: column {name!r} has negative values")
    cols = {n: table.column(n).to_pylist() for n in SCHEMA.names}
    for name in ("prompt_ids", "output_ids"):
        if any(t is None for seq in cols[name] for t in seq):
            raise ValueError(f"{path}: column {name!r} has null token ids")
    return [Rollout(**{n: cols[n][i] for n in SCHEMA.names}) for i in range(table.num_rows)]


# ----------------------------------------------------------------------------------------------
# the benchmarks' cached trace

#: What :func:`record_trace` records by default: rollout iterations, problems per iteration,
#: samples per problem (a GRPO group) and the most output tokens of a rollout.
RECORD = {"iterations": 5, "prompts": 16, "samples": 8, "max_tokens": 384}
REPO = Path(__file__).resolve().parents[2]


def trace_cache_dir() -> Path:
    """``<cache>/traces`` (:func:`das.host.cache_dir`: ``$DAS_CACHE_DIR``, else ``~/.cache/das``). Not created here."""
    from das.host import cache_dir

    return cache_dir() / "traces"


def default_trace_data() -> str:
    """The problem set of the default trace: ``"dsr_sub"`` (shipped with the package, :mod:`integrations.data.registry`)."""
    return "dsr_sub"


def default_trace_path(data: str | None = None, **record: int) -> Path:
    """Where the trace of ``data`` (default :func:`default_trace_data`) recorded with ``record``
    (keys of :data:`RECORD`) is cached, e.g. ``~/.cache/das/traces/dsr_sub_i5_p16_n8_t384.parquet``."""
    rec = {**RECORD, **record}
    name = Path(data or default_trace_data()).stem
    return trace_cache_dir() / f"{name}_i{rec['iterations']}_p{rec['prompts']}_n{rec['samples']}_t{rec['max_tokens']}.parquet"


def record_trace(path: str | Path, data: str | None = None, model: str | None = None, **record: int) -> Path:
    """Record a trace at ``path`` with the real model: ``das-rollout --method none --compare ''
    --trace PATH`` in a subprocess (no speculation, so the rollouts are the policy's own samples).

    Args:
        path: the ``.parquet`` file to write.
        data: the problems, as ``das-rollout --data`` takes them (default :func:`default_trace_data`).
        model: a local model directory (default: das-rollout's, SmolLM2-135M-Instruct).
        record: overrides of :data:`RECORD`.

    Raises:
        subprocess.CalledProcessError: das-rollout failed (its own message is on stderr).
    """
    rec = {**RECORD, **record}
    cmd = [sys.executable, "-m", "integrations.rollout", "--data", data or default_trace_data(), "--method", "none",
           "--compare", "", "--iterations", str(rec["iterations"]), "--prompts", str(rec["prompts"]),
           "--samples", str(rec["samples"]), "--max-tokens", str(rec["max_tokens"]), "--trace", str(path)]
    if model:
        cmd += ["--model", model]
    print("recording a rollout trace (once; it is cached):", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)
    return Path(path)


def cached_trace(path: str | Path | None = None, *, record: bool = True, model: str | None = None) -> Path:
    """The trace a benchmark replays: ``path`` when given, else :func:`default_trace_path`,
    recorded first with :func:`record_trace` when it is not cached yet.

    Raises:
        FileNotFoundError: ``path`` was given and does not exist, or the default trace is not
            cached and ``record`` is False; the message names the file.
    """
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no rollout trace at {path}")
        return path
    path = default_trace_path()
    if not path.is_file():
        if not record:
            raise FileNotFoundError(f"no rollout trace cached at {path}")
        record_trace(path, model=model)
    return path
