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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
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


def write_trace(path: str | Path, rollouts: list[Rollout]) -> Path:
    """Write ``rollouts`` to a parquet file at ``path`` (parent directories are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = {name: [getattr(r, name) for r in rollouts] for name in SCHEMA.names}
    pq.write_table(pa.table(columns, schema=SCHEMA), path)
    return path


def read_trace(path: str | Path) -> list[Rollout]:
    """Read a trace written by :func:`write_trace`.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file lacks a column of :data:`SCHEMA`.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no rollout trace at {path}")
    table = pq.read_table(path)
    missing = [n for n in SCHEMA.names if n not in table.column_names]
    if missing:
        raise ValueError(f"{path} is not a rollout trace: missing columns {missing}; expected {SCHEMA.names}")
    cols = {n: table.column(n).to_pylist() for n in SCHEMA.names}
    return [Rollout(**{n: cols[n][i] for n in SCHEMA.names}) for i in range(table.num_rows)]
