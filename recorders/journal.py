"""The per-step journal: the rows of the shard pair not written yet, on disk
within moments of each step, so that a job killed by SIGKILL, the OOM
killer or a node failure loses seconds of steps, not a shard interval.

A rank appends each step the writer thread handles to two Arrow IPC
streams, `rank=<r>/journal/steps/part-N.arrows` and
`rank=<r>/journal/tensors/part-N.arrows` (the steps and tensors schemas,
one record batch per step, the tensors batch first, empty when the step has
no tensor rows), N being the number the pair will have. Each step is handed
to the OS at once (a killed process loses nothing the OS holds); the files
are fsynced at least every `durable_interval_s` and at once after a step
with a NaN/Inf or a skip (the evidence a post-mortem needs survives a node
failure too). In a burst of them (a diverging job, every step a skip and a
NaN loss) a step whose kinds of trouble the burst's steps fsynced within
`URGENT_SYNC_GAP_S` already showed is gathered as clean steps are and
fsynced with the first write after that gap (`ShardWriter.add_step`): an
fsync a step cost ~0.7 ms of CPU on a virtual disk, 9% of a 9 ms step on 2
cores. When the pair is published (Parquet, then its index) the
journal of that pair is removed: shard counts stay what `steps_per_shard`
and `flush_interval_s` make them, and a journal holds at most one shard
interval.

Readers take a journal's intact prefix: every complete message of the steps
stream, and as many tensors batches (a kill between the two writes leaves
one more tensors batch); a torn last message ends the prefix. A journal
whose steps shard exists is a leftover of a job killed between publishing
the pair and removing the journal, and is ignored.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pyarrow as pa

from .format import schema
from .durable import fsync_dir

DEFAULT_DURABLE_INTERVAL_S = 5.0
# How long a burst of steps with a NaN/Inf or a skip lasts after its last
# step fsynced at once: its later steps that show no new kind of trouble are
# gathered, and fsynced at most this long after that one.
URGENT_SYNC_GAP_S = 1.0
TABLES = (schema.TENSORS_DIR, schema.STEPS_DIR)  # the write order of a step
# Tensor batches are the bulk (thousands of rows a step for a large model):
# lz4 costs the writer thread well under a millisecond a step; a steps batch
# is one row, whose compression would cost more than it saves. No threads:
# with Arrow's pool each batch's columns were handed to other threads, 0.15
# ms for the empty tensors batch of every step with no rows (a skipped step
# of a diverging job), on cores the training uses; on the writer thread
# alone it is 10 us.
_OPTIONS = {schema.TENSORS_DIR: pa.ipc.IpcWriteOptions(compression="lz4", use_threads=False),
            schema.STEPS_DIR: pa.ipc.IpcWriteOptions(use_threads=False)}
_SCHEMAS = {schema.TENSORS_DIR: schema.TENSOR_SCHEMA, schema.STEPS_DIR: schema.STEP_SCHEMA}
_NUMBER = re.compile(r"^part-(\d+)" + re.escape(schema.JOURNAL_SUFFIX) + "$")


def journal_path(rank_dir, table: str, index: int) -> Path:
    return Path(rank_dir) / schema.JOURNAL_DIR / table / schema.JOURNAL_FILE.format(index=index)


def journal_number(name: str) -> int | None:
    """N of `part-N.arrows`, else None (a hidden or foreign file)."""
    m = _NUMBER.match(name)
    return int(m.group(1)) if m else None


def journal_indexes(rank_dir) -> list[int]:
    """The numbers of the journals in a rank directory (either half)."""
    found = set()
    for table in TABLES:
        d = Path(rank_dir) / schema.JOURNAL_DIR / table
        if d.is_dir():
            found.update(n for n in (journal_number(p.name) for p in d.iterdir()) if n is not None)
    return sorted(found)


def read_prefix(source) -> tuple[pa.Schema | None, list[pa.RecordBatch]]:
    """The schema and every complete record batch of one journal stream
    (`source`: a path or a readable pyarrow/Python file). A torn message (the
    writer was killed mid-write) ends the prefix; a stream whose schema
    message is torn has none."""
    try:
        reader = pa.ipc.open_stream(source)
    except (OSError, pa.ArrowInvalid):
        return None, []
    batches = []
    while True:
        try:
            batches.append(reader.read_next_batch())
        except StopIteration:
            break
        except (OSError, pa.ArrowInvalid):
            break  # a torn last message: what came before stands
    return reader.schema, batches


def empty_batch(table: str) -> pa.RecordBatch:
    s = _SCHEMAS[table]
    return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in s], schema=s)


class Journal:
    """The journal streams of one rank: `append` each step, `discard` a
    pair's journal once the pair is published. Writer thread only, but for
    `remove` of a closed journal (the publisher's thread).

    `metadata(table)`: the key-value metadata stamped into a stream's schema
    (the shard footer's keys but the step range, unknown while writing)."""

    def __init__(self, rank_dir, *, metadata, durable_interval_s: float = DEFAULT_DURABLE_INTERVAL_S):
        self.rank_dir = Path(rank_dir)
        self.metadata = metadata
        self.durable_interval_s = max(0.0, float(durable_interval_s))
        self.index: int | None = None  # the pair whose journal is open
        self._files: dict = {}
        self._writers: dict = {}
        self._unsynced_since: float | None = None  # when the oldest write not fsynced was made
        self._soon = False  # a burst's gathered NaN/Inf or skip waits for its fsync (`append`)
        self._last_sync: float | None = None
        self.syncs = 0

    def append(self, index: int, tensors: pa.RecordBatch, steps: pa.RecordBatch, urgent: bool = False,
               soon: bool = False) -> None:
        """A step's batches (or gathered steps'); `urgent` (a NaN/Inf, a
        skip): fsync now; `soon` (more of a burst's, `ShardWriter.add_step`):
        fsync with the first write `URGENT_SYNC_GAP_S` after the last fsync."""
        if self.index != index:
            self.close()
            self._open(index)
        for table, batch in ((schema.TENSORS_DIR, tensors), (schema.STEPS_DIR, steps)):
            self._writers[table].write_batch(batch)
            # To the OS at once: a killed process loses nothing the OS holds.
            self._files[table].flush()
        now = time.monotonic()
        if self._unsynced_since is None:
            self._unsynced_since = now
        # `idle_sync_s` short of the interval: the next chance to sync (the
        # next step, or the writer's idle wake-up) may come that much later.
        self._soon |= soon
        if urgent or now - self._unsynced_since >= self.durable_interval_s - self.idle_sync_s or (
                self._soon and (self._last_sync is None or now - self._last_sync >= URGENT_SYNC_GAP_S)):
            self.sync()

    @property
    def idle_sync_s(self) -> float:
        """How long the writer thread may sit idle before it calls `sync`
        (at most 10 wake-ups a second, whatever the interval)."""
        return max(0.1, min(1.0, self.durable_interval_s / 2))

    def sync(self) -> None:
        """fsync what was written since the last sync (tensors, then steps,
        the order a reader relies on)."""
        if self._unsynced_since is None or self.index is None:
            return
        for table in TABLES:
            os.fsync(self._files[table].fileno())
        self._unsynced_since, self._soon, self._last_sync = None, False, time.monotonic()
        self.syncs += 1

    def _open(self, index: int) -> None:
        for table in TABLES:
            path = journal_path(self.rank_dir, table, index)
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(path, "wb")
            self._files[table] = f
            self._writers[table] = pa.ipc.new_stream(
                f, _SCHEMAS[table].with_metadata(self.metadata(table)), options=_OPTIONS[table])
            f.flush()
        self.index = index
        # The new names must survive a node failure with their first fsync.
        for table in TABLES:
            fsync_dir(journal_path(self.rank_dir, table, index).parent)

    def close(self) -> None:
        """Close the open streams (their files stay)."""
        for table in list(self._files):
            try:
                self._writers.pop(table).close()
            except (OSError, pa.ArrowException, KeyError):
                pass
            try:
                self._files.pop(table).close()
            except OSError:
                pass
        self._files, self._writers = {}, {}
        self.index = None
        self._unsynced_since = None

    def discard(self, index: int) -> None:
        """Remove the journal of pair `index` (published, or dropped). Not
        fsynced: a journal that reappears beside its pair is ignored."""
        if self.index == index:
            self.close()
        self.remove(index)

    def remove(self, index: int) -> None:
        """Unlink the files of a closed journal (any thread: the open
        streams, another pair's, are not touched)."""
        for table in TABLES:
            try:
                journal_path(self.rank_dir, table, index).unlink()
            except FileNotFoundError:
                pass


def read_journal(rank_dir, index: int) -> tuple[dict, pa.Table, pa.Table] | None:
    """(steps metadata, steps table, tensors table) of a journal's intact
    prefix, each table in its stream's own schema; None without a step."""
    steps_schema, steps = _read_file(journal_path(rank_dir, schema.STEPS_DIR, index))
    if not steps:
        return None
    tensors_schema, tensors = _read_file(journal_path(rank_dir, schema.TENSORS_DIR, index))
    tensors = tensors[:len(steps)]
    tensors_table = pa.Table.from_batches(tensors, schema=tensors_schema or schema.TENSOR_SCHEMA)
    return dict(steps_schema.metadata or {}), pa.Table.from_batches(steps, schema=steps_schema), tensors_table


def _read_file(path: Path) -> tuple[pa.Schema | None, list[pa.RecordBatch]]:
    try:
        with pa.OSFile(str(path)) as f:
            return read_prefix(f)
    except FileNotFoundError:
        return None, []
