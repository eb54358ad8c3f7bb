"""Readers' side of the per-step journal (`rank=<r>/journal/{steps,tensors}/
part-N.arrows`, see `recorders/journal.py` and docs/FORMAT.md): the steps a
job wrote before it was killed, or before its recorder failed, and never
published as a shard pair.

A journal becomes a pair of `Shard`s like a pair of Parquet files, so every
analysis reads its rows as it reads a shard's (`engines/scan.py` opens the
file by its name). Its intact prefix is read: a torn last message is
ignored; the tensors half is cut to as many steps as the steps half holds.
A journal whose steps shard is readable is a leftover of a job killed
between publishing the pair and removing the journal: ignored, so no row
counts twice; a lone tensors shard beside a journal (killed between the two
halves of the pair) gives way to the journal, which holds the same rows.
"""
from __future__ import annotations

import os
import posixpath
import re

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from recorders.format import schema

from ..errors import CorruptRunError, MixedRunsError
from .files.ipc import Unbounded, read_stream_prefix
from .files.limits import MAX_JOURNAL_BYTES
from .files.safe import check_entry, check_inside, open_regular, shown
from .shards import Shard, check_version, error_text, shard_files
from .store import StorePath, filesystem_of, fs_path

_SCHEMAS = {schema.STEPS_DIR: schema.STEP_SCHEMA, schema.TENSORS_DIR: schema.TENSOR_SCHEMA}
_NUMBER = re.compile(r"^part-(\d+)\.")


def is_journal(path) -> bool:
    return str(path).endswith(schema.JOURNAL_SUFFIX)


def shard_number(name: str) -> int:
    m = _NUMBER.match(name)
    return int(m.group(1)) if m else -1


def location(path) -> str:
    """The path of a journal as `filesystem_of(path)` opens it."""
    return fs_path(path) if isinstance(path, StorePath) else os.path.abspath(path)


def read_journal_table(path: str, table: str, filesystem) -> pa.Table:
    """The rows of one journal file (`path` inside `filesystem`) in the run's
    schema (unknown columns dropped, missing ones null): its intact prefix;
    for the tensors half, the batches of the steps its steps half holds."""
    batches = _batches(path, filesystem)
    if table == schema.TENSORS_DIR:
        steps = posixpath.join(posixpath.dirname(posixpath.dirname(path)), schema.STEPS_DIR,
                               posixpath.basename(path))
        batches = batches[:len(_batches(steps, filesystem))]
    return conform(pa.Table.from_batches(batches) if batches else None, _SCHEMAS[table])


def _batches(path: str, filesystem) -> list[pa.RecordBatch]:
    # A journal gone since the run was loaded (its pair published meanwhile)
    # raises: the caller names the file it skipped, never reads it as empty.
    with _open(path, filesystem) as f:
        return _read(f, path)[1]


def _read(f, where):
    """`recorders.journal.read_prefix`'s prefix, each batch's decoded size
    bounded before it is decoded (files.ipc): a hostile journal is refused."""
    try:
        return read_stream_prefix(f, MAX_JOURNAL_BYTES)
    except Unbounded as exc:
        raise CorruptRunError(f"{shown(where)}: {exc} (MAX_JOURNAL_BYTES); not a journal this format "
                              f"writes") from None


def _open(path: str, filesystem, root=None):
    """A local journal opened as every file of a run is (files.safe: a
    regular file, never a FIFO that would hang, never through a link);
    one on an object store through its filesystem."""
    if isinstance(filesystem, pafs.LocalFileSystem):
        return open_regular(path, root, CorruptRunError)
    return filesystem.open_input_stream(path)


def conform(table: pa.Table | None, target: pa.Schema) -> pa.Table:
    """`table` with exactly the columns of `target`, in its order and types."""
    if table is None or table.num_rows == 0:
        return target.empty_table()
    arrays = []
    for field in target:
        if field.name in table.column_names:
            col = table.column(field.name)
            arrays.append(col if col.type == field.type else col.cast(field.type))
        else:
            arrays.append(pa.nulls(table.num_rows, field.type))
    return pa.Table.from_arrays(arrays, schema=target)


def journal_shards(root, rank: int, rank_dir, run_id, published: set[int], warnings) -> list[Shard]:
    """The journals of one rank as (steps, tensors) `Shard`s, except those of
    the pairs in `published` (numbers of readable steps shards)."""
    d = rank_dir / schema.JOURNAL_DIR / schema.STEPS_DIR
    check_inside(rank_dir / schema.JOURNAL_DIR, root, CorruptRunError)
    if not d.is_dir():
        return []
    out = []
    for path in shard_files(d, root, warnings, pattern="part-*" + schema.JOURNAL_SUFFIX):
        number = shard_number(path.name)
        if number in published:
            continue
        rel = path.relative_to(root)
        try:
            with _open(location(path), filesystem_of(path), root) as f:
                stream_schema, batches = _read(f, path)
            steps = conform(pa.Table.from_batches(batches), schema.STEP_SCHEMA) if batches else None
        except (OSError, pa.ArrowException) as exc:
            warnings.append(f"skipped unreadable journal {rel} ({error_text(exc)})")
            continue
        if steps is None or steps.num_rows == 0:
            continue  # killed before its first step was whole
        meta = {k.decode(errors="replace"): v.decode(errors="replace")
                for k, v in (stream_schema.metadata or {}).items()}
        if meta.get(schema.META_FORMAT.decode()) != schema.FORMAT_NAME:
            warnings.append(f"skipped {rel}: not a journal of format {schema.FORMAT_NAME!r}")
            continue
        check_version(meta.get(schema.META_SCHEMA_VERSION.decode()), str(rel))
        journal_run = meta.get(schema.META_RUN_ID.decode())
        if run_id is not None and journal_run != run_id:
            raise MixedRunsError(
                f"mixed runs in {root}: {rel} belongs to run {journal_run!r}, the manifest to {run_id!r}; "
                f"a resumed job must reuse the run id (AMP_POSTMORTEM_RUN_ID) or write to a new directory")
        first, last = pc.min(steps["step"]).as_py(), pc.max(steps["step"]).as_py()
        tensor_rows = int(pc.sum(steps["tensor_rows"]).as_py() or 0)
        out.append(Shard(path=path, rank=rank, table=schema.STEPS_DIR, num_rows=steps.num_rows,
                         first_step=first, last_step=last, nonfinite_rows=0))
        tensors = rank_dir / schema.JOURNAL_DIR / schema.TENSORS_DIR / path.name
        if tensors.exists() or (not isinstance(tensors, StorePath) and os.path.lexists(tensors)):
            check_entry(tensors, root, CorruptRunError)
            # Row and non-finite counts are not known without reading it all:
            # the steps' own count, and None (never pruned by the filter).
            out.append(Shard(path=tensors, rank=rank, table=schema.TENSORS_DIR, num_rows=tensor_rows,
                             first_step=first, last_step=last, nonfinite_rows=None))
    return out


def with_journals(root, ranks: dict, run_id, step_shards: list[Shard], tensor_shards: list[Shard],
                  warnings) -> tuple[list[Shard], list[Shard]]:
    """The shards of `ranks` ({rank: its directory}, in load order) with
    their journals added, each rank's shards in number order (the order the
    recorder wrote them: the last copy of a step written twice wins)."""
    added_steps, added_tensors = [], []
    superseded: set[tuple[int, int]] = set()
    for rank, d in ranks.items():
        published = {shard_number(s.path.name) for s in step_shards if s.rank == rank}
        for shard in journal_shards(root, rank, d, run_id, published, warnings):
            (added_steps if shard.table == schema.STEPS_DIR else added_tensors).append(shard)
            superseded.add((rank, shard_number(shard.path.name)))
    if not added_steps:
        return step_shards, tensor_shards
    tensor_shards = [s for s in tensor_shards if is_journal(s.path)
                     or (s.rank, shard_number(s.path.name)) not in superseded]
    order = {rank: i for i, rank in enumerate(ranks)}

    def key(s: Shard):
        return order.get(s.rank, len(order)), shard_number(s.path.name), is_journal(s.path)

    return sorted(step_shards + added_steps, key=key), sorted(tensor_shards + added_tensors, key=key)
