"""Everything that touches the disk: atomic files and Parquet shards.

Runs on the recorder's background thread only; the training thread never
waits for it. Partial files are invisible to readers: they are written under a
hidden `.`-prefixed name that does not end in `.parquet` and renamed on
completion (rename is atomic on POSIX), so a job killed mid-write leaves every
completed shard readable and no torn one.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import schema


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=2, sort_keys=False, allow_nan=True).encode())


def atomic_write_table(path: Path, table: pa.Table, row_group_size: int | None = None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(
        table, tmp,
        row_group_size=row_group_size,
        compression="zstd",
        write_statistics=True,
    )
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _column_array(parts: list, type_: pa.DataType) -> pa.Array:
    """Concatenate per-step column parts; NaN in a numeric part means null
    (a statistic the tier did not compute), which `from_pandas` encodes."""
    if not parts:
        return pa.array([], type=type_)
    if pa.types.is_string(type_):
        return pa.array([v for p in parts for v in p], type=type_)
    values = np.concatenate([np.asarray(p) for p in parts])
    if values.dtype.kind == "f" and not pa.types.is_floating(type_):
        return pa.array(values, from_pandas=True).cast(type_)
    return pa.array(values, type=type_, from_pandas=values.dtype.kind == "f")


class ShardWriter:
    """Buffers the rows of one rank and writes them as step-aligned shards.

    A shard pair (`steps/part-N.parquet`, `tensors/part-N.parquet`) covers a
    contiguous range of steps; both files are complete or absent.
    """

    def __init__(self, rank_dir: Path, *, run_id: str, rank: int, world_size: int,
                 steps_per_shard: int, row_group_rows: int = 1 << 16):
        # ~64k rows per row group: small enough that step and non-finite
        # filters can skip most of a shard by its column statistics.
        self.rank_dir = Path(rank_dir)
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self.steps_per_shard = max(1, int(steps_per_shard))
        self.row_group_rows = row_group_rows
        self._step_rows: list[dict] = []
        self._tensor_batches: list[dict[str, np.ndarray | list]] = []
        self._tensor_rows = 0
        self._nonfinite_rows = 0
        self.shard_index = self._next_index()
        self.shards_written = 0

    def _next_index(self) -> int:
        # Continue numbering after existing shards so a resumed job (same run
        # directory) never overwrites what an earlier process wrote.
        existing = sorted((self.rank_dir / schema.STEPS_DIR).glob("part-*.parquet"))
        if not existing:
            return 0
        return int(existing[-1].stem.split("-")[1]) + 1

    @property
    def pending_steps(self) -> int:
        return len(self._step_rows)

    def add_step(self, step_row: dict, tensor_columns: dict | None) -> None:
        self._step_rows.append(step_row)
        if tensor_columns is not None and len(tensor_columns["step"]):
            self._tensor_batches.append(tensor_columns)
            n = len(tensor_columns["step"])
            self._tensor_rows += n
            nf = (np.asarray(tensor_columns["nan_count"]) > 0) | (np.asarray(tensor_columns["inf_count"]) > 0)
            self._nonfinite_rows += int(nf.sum())
        if len(self._step_rows) >= self.steps_per_shard:
            self.roll()

    def _metadata(self, table: str, first: int, last: int, nonfinite: int) -> dict:
        return {
            schema.META_FORMAT: schema.FORMAT_NAME.encode(),
            schema.META_SCHEMA_VERSION: schema.SCHEMA_VERSION.encode(),
            schema.META_RUN_ID: self.run_id.encode(),
            schema.META_RANK: str(self.rank).encode(),
            schema.META_WORLD_SIZE: str(self.world_size).encode(),
            schema.META_TABLE: table.encode(),
            schema.META_FIRST_STEP: str(first).encode(),
            schema.META_LAST_STEP: str(last).encode(),
            schema.META_NONFINITE_ROWS: str(nonfinite).encode(),
        }

    def roll(self) -> None:
        """Write the buffered steps as one shard pair (tensors first, so a
        steps shard never points at missing tensor rows)."""
        if not self._step_rows:
            return
        steps = [r["step"] for r in self._step_rows]
        first, last = min(steps), max(steps)
        name = schema.SHARD_FILE.format(index=self.shard_index)

        cols = {c.name: [] for c in schema.TENSOR_COLUMNS}
        for batch in self._tensor_batches:
            for c in cols:
                cols[c].append(batch[c])
        arrays = []
        for c in schema.TENSOR_COLUMNS:
            parts = cols[c.name]
            arrays.append(_column_array(parts, c.type))
        tensors = pa.Table.from_arrays(arrays, schema=schema.TENSOR_SCHEMA).replace_schema_metadata(
            self._metadata("tensors", first, last, self._nonfinite_rows))
        atomic_write_table(self.rank_dir / schema.TENSORS_DIR / name, tensors, self.row_group_rows)

        step_table = pa.Table.from_pylist(self._step_rows, schema=schema.STEP_SCHEMA).replace_schema_metadata(
            self._metadata("steps", first, last, 0))
        atomic_write_table(self.rank_dir / schema.STEPS_DIR / name, step_table)

        self.shard_index += 1
        self.shards_written += 1
        self._step_rows = []
        self._tensor_batches = []
        self._tensor_rows = 0
        self._nonfinite_rows = 0
