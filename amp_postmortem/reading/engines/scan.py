"""The engine-neutral map: read one shard (tensors, or steps), keep the rows
that pass the filter, project the columns. Runs wherever the engine puts it, so a
task holds only plain values (the filter is rebuilt on the worker)."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from recorders.format import schema

_FORMAT = ds.ParquetFileFormat()
NONFINITE_FILTER = (pc.field("nan_count") > 0) | (pc.field("inf_count") > 0)
_filesystems: dict[str, object] = {}
_lock = threading.Lock()


BATCH_ROWS = 1 << 16  # rows per batch given to a `reduces_batches` reducer


def reduces_batches(fn: Callable) -> Callable:
    """Mark a per-shard reduction as one that takes an iterator of the
    shard's record batches rather than the whole shard as one table: its
    memory is then bounded by a batch plus what it keeps, not by the shard."""
    fn.reduces_batches = True
    return fn


@dataclass(frozen=True)
class ShardScan:
    """One shard to read: `path` inside the filesystem named by `root_uri`
    (None: the local filesystem), and the filter."""
    path: str
    root_uri: str | None = None
    columns: tuple[str, ...] | None = None
    nonfinite_only: bool = False
    steps: tuple[int, ...] | None = None
    kinds: tuple[str, ...] | None = None
    first_step: int | None = None
    last_step: int | None = None
    # Optional per-shard reduction run where the shard is read (a top-level
    # function of the rows, so that it pickles): only its result travels.
    reduce: Callable | None = None
    table: str = schema.TENSORS_DIR  # or schema.STEPS_DIR

    def expression(self):
        expr = NONFINITE_FILTER if self.nonfinite_only else None
        for e in (None if self.steps is None else pc.field("step").isin(pa.array(self.steps, pa.int64())),
                  None if self.first_step is None else pc.field("step") >= self.first_step,
                  None if self.last_step is None else pc.field("step") <= self.last_step,
                  None if self.kinds is None else pc.field("kind").isin(pa.array(self.kinds, pa.string()))):
            if e is not None:
                expr = e if expr is None else expr & e
        return expr


@dataclass
class ShardPartial:
    """What a shard gave: its matching rows, or `reduce` of them (both None
    when its statistics ruled every row group out, so it was never read),
    or the error that made it unreadable."""
    table: pa.Table | None
    error: str | None = None
    result: object = None


def scan_shard(task: ShardScan) -> ShardPartial:
    table_schema = schema.STEP_SCHEMA if task.table == schema.STEPS_DIR else schema.TENSOR_SCHEMA
    try:
        fs = _filesystem(task.root_uri)
        if task.path.endswith(schema.JOURNAL_SUFFIX):
            return _scan_journal(task, fs)
        frag = _FORMAT.make_fragment(task.path, filesystem=fs)
        too_big = _oversized_row_group(frag)
        if too_big is not None:
            return ShardPartial(None, too_big)
        expr = task.expression()
        if expr is not None:
            frag = frag.subset(filter=expr, schema=table_schema)
            if frag.num_row_groups == 0:  # statistics rule every row group out
                return ShardPartial(None)
        columns = list(task.columns) if task.columns is not None else None
        if getattr(task.reduce, "reduces_batches", False):
            # The shard's rows in batches, one row group read at a time (a
            # scanner of the whole file reads ahead as far as the consumer
            # lags: most of the shard): never the whole shard in memory.
            batches = (b for rg in frag.split_by_row_group(filter=expr, schema=table_schema)
                       for b in rg.scanner(schema=table_schema, columns=columns, filter=expr,
                                           batch_size=BATCH_ROWS, use_threads=False).to_batches())
            return ShardPartial(None, result=task.reduce(batches))
        table = frag.scanner(schema=table_schema, columns=columns, filter=expr).to_table()
        if task.reduce is not None:
            return ShardPartial(None, result=task.reduce(table))
        return ShardPartial(table)
    except (OSError, pa.ArrowException) as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return ShardPartial(None, f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def _oversized_row_group(frag) -> str | None:
    """Why the shard is not read, when a row group would decompress past
    MAX_ROW_GROUP_BYTES (its size is in the footer: checked before reading)."""
    from ..files.limits import MAX_ROW_GROUP_BYTES
    md = frag.metadata
    for i in range(md.num_row_groups):
        size = md.row_group(i).total_byte_size
        if size > MAX_ROW_GROUP_BYTES:
            return (f"row group {i} decompresses to {size} bytes, more than the {MAX_ROW_GROUP_BYTES} "
                    f"bytes (MAX_ROW_GROUP_BYTES) a reader accepts")
    return None


def _scan_journal(task: ShardScan, fs) -> ShardPartial:
    """A journal (no statistics to prune by): its intact prefix, filtered."""
    from ..journal import read_journal_table
    table = read_journal_table(task.path, task.table, fs)
    expr = task.expression()
    if expr is not None:
        table = table.filter(expr)
    if table.num_rows == 0:
        return ShardPartial(None)  # as a shard whose statistics rule it out
    if task.columns is not None:
        table = table.select(list(task.columns))
    return ShardPartial(None, result=task.reduce(table)) if task.reduce is not None else ShardPartial(table)


def _filesystem(root_uri: str | None):
    """One filesystem object per run URI and process (a worker reuses it)."""
    if root_uri is None:
        from ..store import LOCAL_FS
        return LOCAL_FS
    with _lock:
        fs = _filesystems.get(root_uri)
        if fs is None:
            from recorders.format.locations import open_filesystem
            fs = _filesystems[root_uri] = open_filesystem(root_uri)[0]
        return fs
