"""Everything that touches the disk: atomic files and Parquet shards.

Runs on the recorder's background thread only; the training thread never
waits for it. Partial files are invisible to readers: they are written under a
hidden `.`-prefixed name that does not end in `.parquet` and renamed on
completion (rename is atomic on POSIX), so a job killed mid-write leaves every
completed shard readable and no torn one. Every step also goes to the
journal of its pair (`journal.py`) as it arrives, so a job killed before
the pair is written loses seconds of steps, not the pair.
"""
from __future__ import annotations

import json
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .format import schema
from .aggregate import event_rows
from .durable import fsync_dir
from .index import shard_index
from .journal import DEFAULT_DURABLE_INTERVAL_S, URGENT_SYNC_GAP_S, Journal, empty_batch, journal_indexes, read_journal


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


# How late a step with nothing urgent (no NaN/Inf, no skip) may reach the journal
# (the OS): with the journal's fsync interval, a killed job still loses at most
# `durable_interval_s` plus this.
JOURNAL_BATCH_STEPS = 64
JOURNAL_BATCH_S = 0.5


def _troubles(step_row: dict, nonfinite_rows: int) -> frozenset:
    """The kinds of trouble a step shows: a skip, a NaN/Inf loss, gradient
    norm or parameter gradient, NaN/Inf rows. A step with any is urgent
    (journalled and fsynced at once); a burst journals one alone when it
    shows a kind its burst has not: the first NaN loss of a collapsing
    scaler's skips."""
    return frozenset(name for name, hit in (
        ("skipped", step_row.get("skipped")), ("loss", _nonfinite(step_row.get("loss"))),
        ("gradients", _nonfinite(step_row.get("grad_norm")) or step_row.get("nonfinite_param_grads")),
        ("rows", nonfinite_rows)) if hit)


def _nonfinite(v) -> bool:
    return v is not None and not np.isfinite(v)


class Publisher:
    """Writes finished shard pairs on a thread of its own, so the writer
    thread goes on journaling steps while a pair is compressed and written
    (seconds for a shard of millions of rows): a job killed during that
    time loses no more than the journal's bound, and the writer's queue
    does not fill and drop steps. Pairs are published in the order given;
    at most `depth` wait (then `submit` blocks: the writer slows down rather
    than holding shard after shard in memory). `on_error(exc)`: a failed
    publication (a full disk) turns recording off, as on the writer thread;
    `submit(job, step)`: `step`, the pair's last step, is the one named as
    being written when `job` fails (`on_error(exc, step)`)."""

    THREAD_NAME = "amp-postmortem-publisher"

    def __init__(self, on_error, depth: int = 1):
        self.on_error = on_error
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, int(depth)))
        self._thread = threading.Thread(target=self._loop, name=self.THREAD_NAME, daemon=True)
        self._thread.start()

    def submit(self, job, step: int | None = None) -> None:
        if self._thread.is_alive():
            self._queue.put((job, step))
        else:  # closed: publish here rather than lose the pair
            self._run((job, step))

    def wait(self) -> None:
        """Block until every pair submitted so far is published (or failed)."""
        if self._thread.is_alive():
            self._queue.join()

    def close(self, timeout: float | None = None) -> None:
        """Publish what waits, then end the thread. Idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._run(job)
            finally:
                self._queue.task_done()

    def _run(self, item) -> None:
        job, step = item
        try:
            job()
        except Exception as exc:  # noqa: BLE001 - a full disk, ...: recording off, the training goes on
            self.on_error(exc, step)


class ShardWriter:
    """Buffers the rows of one rank and writes them as step-aligned shards.

    A shard pair (`steps/part-N.parquet`, `tensors/part-N.parquet`) covers a
    contiguous range of steps; both files are complete or absent. Until the
    pair is written its steps are in its journal (`journal.Journal`, fsynced
    at least every `durable_interval_s`), which is removed once the pair and
    its index are published; a journal left by a killed process is turned
    into its pair by the first write of the next writer on the rank.
    """

    def __init__(self, rank_dir: Path, *, run_id: str, rank: int, world_size: int,
                 steps_per_shard: int, row_group_rows: int = 1 << 16,
                 first_index: int = 0, has_room=None,
                 durable_interval_s: float = DEFAULT_DURABLE_INTERVAL_S, publisher: Publisher | None = None,
                 gather_rows: bool = False):
        # ~64k rows per row group: small enough that step and non-finite
        # filters can skip most of a shard by its column statistics.
        self.rank_dir = Path(rank_dir)
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self.steps_per_shard = max(1, int(steps_per_shard))
        self.row_group_rows = row_group_rows
        self._step_rows: list[dict] = []
        self._step_batches: list[pa.RecordBatch] = []
        # Steps not yet in the journal, and the tensor columns of those with
        # rows: nothing urgent (no NaN/Inf, no skip) and, unless
        # `gather_rows`, no tensor row. Written together, at most
        # JOURNAL_BATCH_STEPS or JOURNAL_BATCH_S late: one IPC batch and
        # flush a step was most of the writer thread's time, and building
        # ~25 Arrow arrays for each step's few rows half of a Keras or Flax
        # recorder's host time a step.
        self._unjournaled: list[dict] = []
        self._unjournaled_tensors: list[dict] = []
        self._unjournaled_since = 0.0
        self._unjournaled_urgent = False  # one of them a burst's NaN/Inf or skip (its fsync is due)
        self._burst_troubles: frozenset = frozenset()  # what the burst's steps fsynced at once showed
        self._burst_until = 0.0  # the burst ends with no urgent step for URGENT_SYNC_GAP_S
        # Whether steps with tensor rows are gathered too: the Keras and
        # Flax recorders, which write every step's rows from the training
        # thread; the PyTorch recorder's writer thread, whose row steps are
        # sampled ones, journals each at once.
        self.gather_rows = bool(gather_rows)
        self._tensor_batches: list[pa.RecordBatch] = []
        self._tensor_rows = 0
        self._nonfinite_rows = 0
        self._string_columns: dict = {}  # column -> (the step's list, its Arrow array)
        # `first_index`: shards already published elsewhere (a remote store
        # whose spool is this directory); `has_room()`: False drops the next
        # shard's steps rather than overfilling a bounded spool.
        self.shard_index = max(self._next_index(), int(first_index))
        self.has_room = has_room
        self.shards_written = 0
        self.dropped_steps = 0  # steps not written because has_room() said no
        # Who writes a finished pair: `publisher` (its own thread), else
        # `roll()` itself.
        self.publisher = publisher
        self.journal = Journal(self.rank_dir, durable_interval_s=durable_interval_s,
                               metadata=lambda table: self._metadata(table, None, None, None))
        # Journals of earlier processes, made into shards off the training
        # path: by the writer thread's first write.
        self._orphans = journal_indexes(self.rank_dir)

    def _next_index(self) -> int:
        # Continue numbering after existing shards and journals so a resumed
        # job (same run directory) never overwrites what an earlier process
        # wrote.
        existing = sorted((self.rank_dir / schema.STEPS_DIR).glob("part-*.parquet"))
        numbers = [int(p.stem.split("-")[1]) for p in existing[-1:]] + journal_indexes(self.rank_dir)[-1:]
        return max(numbers) + 1 if numbers else 0

    @property
    def pending_steps(self) -> int:
        return len(self._step_rows)

    def add_step(self, step_row: dict, tensor_columns: dict | None) -> None:
        if self._orphans:
            self.compact_orphans()
        has_rows = tensor_columns is not None and len(tensor_columns["step"])
        nonfinite = int(event_rows(tensor_columns).sum()) if has_rows else 0
        self._step_rows.append(step_row)
        troubles = _troubles(step_row, nonfinite)
        urgent = bool(troubles)
        # In a burst of them (a diverging job, every step a skip and a NaN
        # loss), a step that shows no kind of trouble the burst's steps on
        # disk did not is gathered as the others are, fsynced within
        # `URGENT_SYNC_GAP_S`: each one's own batches, writes and fsync cost
        # the writer thread ~0.7 ms of CPU a 9 ms step on 2 cores.
        burst = False
        if urgent:
            now = time.monotonic()
            burst = now < self._burst_until and troubles <= self._burst_troubles
            if not burst:
                self._burst_troubles = troubles | (self._burst_troubles if now < self._burst_until else frozenset())
                self._burst_until = now + URGENT_SYNC_GAP_S
        if (urgent and not burst) or (has_rows and not self.gather_rows):
            # A step with a NaN/Inf or a skip is what a post-mortem needs: on
            # disk before the writer takes the next step, whatever kills the
            # job, after the steps held back (order kept).
            self.journal_pending()
            steps_batch = pa.RecordBatch.from_pylist([step_row], schema=schema.STEP_SCHEMA)
            tensors_batch = self._tensors_batch([tensor_columns]) if has_rows else self._empty_tensors
            self._nonfinite_rows += nonfinite
            self.journal.append(self.shard_index, tensors_batch, steps_batch, urgent=urgent)
            self._step_batches.append(steps_batch)
        else:
            if not self._unjournaled:
                self._unjournaled_since = time.monotonic()
            self._unjournaled.append(step_row)
            if urgent:  # a burst's: fsynced within the gap, not at once
                self._unjournaled_urgent = True
                self._burst_until = time.monotonic() + URGENT_SYNC_GAP_S
            self._nonfinite_rows += nonfinite
            if has_rows:
                self._unjournaled_tensors.append(tensor_columns)
            if (len(self._unjournaled) >= JOURNAL_BATCH_STEPS
                    or time.monotonic() - self._unjournaled_since >= JOURNAL_BATCH_S):
                self.journal_pending()
        if len(self._step_rows) >= self.steps_per_shard:
            self.roll()

    _empty_tensors = empty_batch(schema.TENSORS_DIR)

    def _tensors_batch(self, parts: list) -> pa.RecordBatch:
        """Steps' tensor columns as one batch, Arrow arrays built once here:
        the journal writes it, the pair is the concatenation of them."""
        batch = pa.RecordBatch.from_arrays(
            [self._arrow_column([p[c.name] for p in parts], c) for c in schema.TENSOR_COLUMNS],
            schema=schema.TENSOR_SCHEMA)
        self._tensor_batches.append(batch)
        self._tensor_rows += batch.num_rows
        return batch

    def _arrow_column(self, parts: list, column) -> pa.Array:
        """Steps' parts of a column as one Arrow array. A string part equal
        to the step before's (the very list, as `aggregate.MergePlan` hands
        it while a step's rows keep their structure, or an equal one, as the
        Keras and Flax recorders make each step) reuses its array: building
        ~1,000 strings into Arrow every step held the GIL the training
        thread needs."""
        if not isinstance(parts[0], list):
            return _column_array(parts, column.type)
        arrays = []
        for values in parts:
            cached = self._string_columns.get(column.name)
            if cached is None or (cached[0] is not values and cached[0] != values):
                cached = (values, _column_array([values], column.type))
                self._string_columns[column.name] = cached
            arrays.append(cached[1])
        return arrays[0] if len(arrays) == 1 else pa.concat_arrays(arrays)

    def journal_pending(self) -> None:
        """The steps held back from the journal (`add_step`), written as one
        batch (their tensor rows as one), in order before any later step."""
        if self._unjournaled:
            batch = pa.RecordBatch.from_pylist(self._unjournaled, schema=schema.STEP_SCHEMA)
            tensors = (self._tensors_batch(self._unjournaled_tensors) if self._unjournaled_tensors
                       else self._empty_tensors)
            self._unjournaled, self._unjournaled_tensors = [], []
            soon, self._unjournaled_urgent = self._unjournaled_urgent, False
            self._step_batches.append(batch)
            self.journal.append(self.shard_index, tensors, batch, soon=soon)

    def sync_journal(self) -> None:
        """fsync what the journal holds unsynced (the writer thread, idle),
        the steps held back included."""
        self.journal_pending()
        self.journal.sync()

    def _metadata(self, table: str, first, last, nonfinite, run_id: str | None = None,
                  world_size=None) -> dict:
        meta = {
            schema.META_FORMAT: schema.FORMAT_NAME.encode(),
            schema.META_SCHEMA_VERSION: schema.SCHEMA_VERSION.encode(),
            schema.META_RUN_ID: (run_id or self.run_id).encode(),
            schema.META_RANK: str(self.rank).encode(),
            schema.META_WORLD_SIZE: str(world_size or self.world_size).encode(),
            schema.META_TABLE: table.encode(),
            schema.META_FIRST_STEP: str(first).encode(),
            schema.META_LAST_STEP: str(last).encode(),
            schema.META_NONFINITE_ROWS: str(nonfinite).encode(),
        }
        if first is None:  # a journal: the step range is not known while writing
            for key in (schema.META_FIRST_STEP, schema.META_LAST_STEP, schema.META_NONFINITE_ROWS):
                del meta[key]
        return meta

    def roll(self) -> None:
        """Write the buffered steps as one shard pair (tensors first, so a
        steps shard never points at missing tensor rows), then remove its
        journal."""
        if self._orphans:
            self.compact_orphans()
        if not self._step_rows:
            return
        self.journal_pending()
        if self.has_room is not None and not self.has_room():
            self.dropped_steps += len(self._step_rows)
            self.journal.discard(self.shard_index)
            self._reset()
            return
        number = self.shard_index
        tensors = pa.Table.from_batches(self._tensor_batches, schema=schema.TENSOR_SCHEMA)
        step_table = pa.Table.from_batches(self._step_batches, schema=schema.STEP_SCHEMA)
        rows, nonfinite = self._step_rows, self._nonfinite_rows
        if self.journal.index == number:
            # Complete: synced and closed here; its steps stay readable
            # until the pair replaces it.
            self.journal.sync()
            self.journal.close()
        self.shard_index += 1
        self.shards_written += 1
        self._reset()

        def publish():
            self._publish(number, rows, step_table, tensors, nonfinite)
            self.journal.remove(number)  # files only: the writer thread owns the open streams

        if self.publisher is not None:
            self.publisher.submit(publish, max(r["step"] for r in rows))
        else:
            publish()

    def wait_published(self) -> None:
        """Block until every rolled pair is on disk (flush, close)."""
        if self.publisher is not None:
            self.publisher.wait()

    def _publish(self, number: int, step_rows: list[dict], step_table: pa.Table, tensors: pa.Table,
                 nonfinite_rows: int, run_id: str | None = None, world_size=None) -> None:
        steps = [r["step"] for r in step_rows]
        first, last = min(steps), max(steps)
        name = schema.SHARD_FILE.format(index=number)
        tensors = tensors.replace_schema_metadata(
            self._metadata("tensors", first, last, nonfinite_rows, run_id, world_size))
        index = shard_index(run_id=run_id or self.run_id, rank=self.rank, shard=name, step_rows=step_rows,
                            tensors=tensors, nonfinite_rows=nonfinite_rows)
        atomic_write_table(self.rank_dir / schema.TENSORS_DIR / name, tensors, self.row_group_rows)

        step_table = step_table.replace_schema_metadata(self._metadata("steps", first, last, 0, run_id, world_size))
        atomic_write_table(self.rank_dir / schema.STEPS_DIR / name, step_table)
        # Last: an index names only a complete pair, with the sizes that let
        # a reader tell it from a file damaged or replaced since.
        index["step_bytes"] = os.path.getsize(self.rank_dir / schema.STEPS_DIR / name)
        index["tensor_bytes"] = os.path.getsize(self.rank_dir / schema.TENSORS_DIR / name)
        atomic_write_json(self.rank_dir / schema.INDEX_DIR / schema.INDEX_FILE.format(index=number), index)

    def compact_orphans(self) -> None:
        """Turn the journals an earlier process left into shard pairs with
        their numbers (its run id and world size kept), and remove them. A
        journal this version cannot turn into a pair (another schema, a
        damaged file) stays for the analyzer, which reads it as it is."""
        orphans, self._orphans = self._orphans, []
        for number in orphans:
            if (self.rank_dir / schema.STEPS_DIR / schema.SHARD_FILE.format(index=number)).exists():
                self.journal.discard(number)  # killed between publishing the pair and removing this
                continue
            try:
                found = read_journal(self.rank_dir, number)
                if found is not None:
                    meta, step_table, tensors = found
                    step_table = step_table.cast(schema.STEP_SCHEMA)
                    tensors = tensors.cast(schema.TENSOR_SCHEMA)
                    bad = pc.sum(pc.and_(pc.or_(pc.greater(tensors["nan_count"], 0),
                                                pc.greater(tensors["inf_count"], 0)),
                                         pc.not_equal(tensors["kind"], schema.INTERMEDIATE_KIND))).as_py() or 0
                    self._publish(number, step_table.to_pylist(), step_table, tensors, int(bad),
                                  run_id=meta.get(schema.META_RUN_ID, b"").decode() or None,
                                  world_size=meta.get(schema.META_WORLD_SIZE, b"").decode() or None)
            except (OSError, ValueError, pa.ArrowException):
                continue
            self.journal.discard(number)

    def _reset(self) -> None:
        self._step_rows = []
        self._step_batches = []
        self._unjournaled = []
        self._unjournaled_tensors = []
        self._unjournaled_urgent = False
        self._tensor_batches = []
        self._tensor_rows = 0
        self._nonfinite_rows = 0
