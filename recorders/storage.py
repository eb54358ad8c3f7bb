"""Where a run is written: a local directory, or any filesystem pyarrow or
fsspec can open (`s3://`, `gs://`, `abfs://`, `hdfs://`, ...).

A local run directory is written in place, as before (hidden temporary
file, fsync, rename). A run on a remote filesystem is written in two
stages so that training never waits for the store:

1. the writer thread writes every file, exactly as for a local run, into a
   bounded local *spool* directory that mirrors the run's layout;
2. an upload thread (`SpoolUploader`) copies each completed file to the
   store as one whole object (an object store has no rename: an object
   exists only once its upload completed, so readers never see a torn
   shard), shards before the manifests that describe them, then deletes its
   spooled copy (manifests are kept, they are rewritten). A failed upload is
   retried with exponential backoff for as long as the recorder runs;
   `close()` waits up to `upload_timeout_s` and then reports, with a
   warning and in `AmpRecorder.upload_report`, every file that is still
   only in the spool. Nothing is deleted from the spool before the store
   holds it, and a later recorder on the same run and spool directory
   uploads leftovers first.

Credentials come only from each filesystem's usual environment (for S3:
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`, profiles,
instance roles), never from the project's files.
"""
from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from .format import schema
from .format.locations import (SPOOL_ENV, StorageError, is_spool, is_uri,  # noqa: F401 - where a run is
                               local_path, open_filesystem, spool_dir_for)

# Bounded so that a store down for hours cannot fill the training node's
# disk; at the default 1,000 steps per shard a shard pair is ~0.1-10 MiB.
DEFAULT_SPOOL_MAX_BYTES = 2 << 30
DEFAULT_UPLOAD_TIMEOUT_S = 120.0
# Backoff between attempts while the store fails: doubles from the first
# to the last value.
BACKOFF_S = (0.5, 30.0)
_POLL_S = 1.0
# How long the constructor waits for the store to say what it holds of the
# run (its manifests, its shard count): a store that answers takes tens of
# milliseconds; one that is down is waited for no longer than this (its
# client's own retries take ~6 s a request), and the run starts without.
STORE_WAIT_S = 0.5
# Uploaded last: the files that describe the others (a reader that finds a
# manifest or a bundle.json finds what it names).
_DESCRIBING = (schema.MANIFEST_FILE, schema.BUNDLE_MANIFEST_FILE, schema.STATUS_FILE)


def open_run_location(location, rank: int, *, spool_dir=None,
                      spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES) -> tuple[Path, "SpoolUploader | None"]:
    """(directory the writer writes, uploader or None) for a run location:
    a local path is written in place; a URI through a spool and an uploader
    (not started yet; no round trip to the store is made here)."""
    if not is_uri(location):
        return local_path(location), None
    uri = str(location).rstrip("/")
    uploader = SpoolUploader(uri, spool_dir_for(uri, rank, spool_dir), max_bytes=spool_max_bytes)
    return uploader.spool_dir, uploader


@dataclass
class UploadReport:
    """What the uploader did; `pending` lists files that are only in the spool."""
    uri: str
    spool_dir: str
    uploaded_files: int = 0
    failed_attempts: int = 0
    last_error: str | None = None
    pending: list[str] = field(default_factory=list)
    spool_full_steps: int = 0  # steps not written because the spool was full

    def to_dict(self) -> dict:
        return {"uri": self.uri, "spool_dir": self.spool_dir, "uploaded_files": self.uploaded_files,
                "failed_attempts": self.failed_attempts, "last_error": self.last_error,
                "pending": list(self.pending), "spool_full_steps": self.spool_full_steps}


class SpoolUploader:
    """Mirrors a local spool directory to a remote filesystem, off the
    training path, with retries. See the module docstring."""

    def __init__(self, uri: str, spool_dir: Path, *, max_bytes: int = DEFAULT_SPOOL_MAX_BYTES,
                 filesystem: pafs.FileSystem | None = None, base: str | None = None):
        self.uri = str(uri).rstrip("/")
        if filesystem is None:
            filesystem, base = open_filesystem(self.uri)
        self.fs = filesystem
        self.base = base.rstrip("/")
        self.spool_dir = Path(spool_dir)
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self.report = UploadReport(self.uri, str(self.spool_dir))
        self._made_dirs: set[str] = set()
        self._uploaded_versions: dict[str, tuple[int, int]] = {}  # manifests: (mtime_ns, size) sent
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        # One sweep at a time (the thread's, or close()'s once it stopped);
        # never held by the writer thread, which only reads sizes.
        self._sweep_lock = threading.Lock()
        self._backoff = 0.0
        self._closing = False
        self._thread: threading.Thread | None = None
        self._resume_rank: int | None = None
        self._store_read = threading.Event()
        self._store_run: tuple[dict, int] | None = None  # (describing files, next shard number)

    # ----------------------------------------------------------- remote run
    def resume_run(self, rank: int, wait_s: float = STORE_WAIT_S) -> int:
        """What the store holds of the run, as the uploader thread read it
        (`start(resume_rank=rank)`), waited for at most `wait_s`: its and
        this rank's manifest put into an empty spool, so that a resumed job
        continues the run (same run id); returns the first shard number for
        the writer. A store that did not answer in time: nothing is put,
        and the shards are numbered after any plausible count (the time in
        seconds) rather than risk overwriting one; readers order shards by
        their step ranges, not by number. A late answer is dropped."""
        if not self._store_read.wait(max(0.0, wait_s)) or self._store_run is None:
            return int(time.time())
        files, next_index = self._store_run
        with self._sweep_lock:
            for rel, data in files.items():
                local = self.spool_dir / rel
                if local.exists():
                    continue
                local.parent.mkdir(parents=True, exist_ok=True)
                local.write_bytes(data)
                st = local.stat()
                self._uploaded_versions[rel] = (st.st_mtime_ns, st.st_size)
        return next_index

    def _read_store_run(self, rank: int) -> tuple[dict, int]:
        """(the run's and `rank`'s manifests the store holds, the next shard
        number of `rank` there); raises when the store does not answer."""
        next_index = self._count_shards(rank)
        files = {}
        for rel in (schema.MANIFEST_FILE, f"{schema.RANK_DIR.format(rank=rank)}/{schema.MANIFEST_FILE}"):
            try:
                with self.fs.open_input_stream(f"{self.base}/{rel}") as f:
                    files[rel] = f.read()
            except FileNotFoundError:
                continue  # a new run
        return files, next_index

    def next_shard_index(self, rank: int) -> int:
        """First free shard number of `rank` on the store (spooled shards are
        counted by the writer itself); the time in seconds when the store
        is unreachable (see `resume_run`). Makes round trips: never on the
        training thread."""
        try:
            return self._count_shards(rank)
        except (OSError, pa.ArrowException):
            return int(time.time())

    def _count_shards(self, rank: int) -> int:
        d = f"{self.base}/{schema.RANK_DIR.format(rank=rank)}/{schema.STEPS_DIR}"
        infos = self.fs.get_file_info(pafs.FileSelector(d, allow_not_found=True))
        numbers = [int(m.group(1)) for i in infos
                   if (m := re.fullmatch(r"part-([0-9]+)\.parquet", i.base_name))]
        return max(numbers) + 1 if numbers else 0

    # ------------------------------------------------------------ lifecycle
    def start(self, resume_rank: int | None = None) -> None:
        """Start the upload thread; with `resume_rank`, its first job is to
        read what the store holds of the run (see `resume_run`)."""
        self._resume_rank = resume_rank
        self._thread = threading.Thread(target=self._loop, name="amp-postmortem-upload", daemon=True)
        self._thread.start()

    def notify(self) -> None:
        """New files in the spool: upload soon (never blocks)."""
        self._wake.set()

    def has_room(self) -> bool:
        """Whether the spool may take another shard (checked by the writer
        thread before each shard; a full spool drops the shard's steps)."""
        return self.spool_bytes() < self.max_bytes

    def count_spool_full(self, steps: int) -> None:
        self.report.spool_full_steps += int(steps)

    def spool_bytes(self) -> int:
        total = 0
        for dirpath, _dirs, files in os.walk(self.spool_dir):
            for f in files:
                try:
                    total += os.path.getsize(os.path.join(dirpath, f))
                except OSError:
                    pass
        return total

    def close(self, timeout_s: float = DEFAULT_UPLOAD_TIMEOUT_S) -> UploadReport:
        """Upload what is left, for at most `timeout_s`, stop the thread and
        return the report (its `pending` files stayed in the spool)."""
        deadline = time.monotonic() + max(0.0, float(timeout_s))
        self._closing = True
        self._backoff = 0.0  # the last round starts at once
        self._wake.set()
        while True:
            if self._thread is None or not self._thread.is_alive():
                self._sweep()
            if not self.pending() or time.monotonic() >= deadline:
                break
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, deadline - time.monotonic()))
        self.report.pending = self.pending()
        return self.report

    def pending(self) -> list[str]:
        """Spooled files the store does not hold yet (relative paths)."""
        out = []
        for rel, path in self._spooled():
            if rel in self._uploaded_versions:
                st = path.stat()
                if self._uploaded_versions[rel] == (st.st_mtime_ns, st.st_size):
                    continue
            out.append(rel)
        return out

    # ---------------------------------------------------------- upload loop
    def _loop(self) -> None:
        if self._resume_rank is not None:
            try:
                self._store_run = self._read_store_run(self._resume_rank)
            except (OSError, pa.ArrowException) as exc:
                self.report.last_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self._store_read.set()
        while not self._stop.is_set():
            self._wake.wait(_POLL_S if self._backoff == 0 else self._backoff)
            self._wake.clear()
            if self._stop.is_set():
                break
            self._sweep()

    def _spooled(self) -> list[tuple[str, Path]]:
        out = []
        for dirpath, dirs, files in os.walk(self.spool_dir):
            # Hidden names are partial files or directories being written;
            # a journal is appended to until its pair replaces it, so it
            # stays in the spool (its pair is what gets uploaded).
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != schema.JOURNAL_DIR]
            for f in files:
                if f.startswith("."):
                    continue
                p = Path(dirpath) / f
                out.append((p.relative_to(self.spool_dir).as_posix(), p))
        # Data first, then the files that describe it; shards by name, so the
        # tensors of a pair come before its steps (as written locally).
        out.sort(key=lambda rp: (rp[1].name in _DESCRIBING, schema.INDEX_DIR + "/" in rp[0],
                                 schema.STEPS_DIR + "/" in rp[0], rp[0]))
        return out

    def _sweep(self) -> None:
        with self._sweep_lock:
            for rel, path in self._spooled():
                # Kept and sent again when rewritten: manifests and the
                # status slot (overwritten in place; never unlinked under
                # the recorder that holds it open).
                describing = path.name in (schema.MANIFEST_FILE, schema.STATUS_FILE)
                try:
                    st = path.stat()
                except OSError:
                    continue  # replaced or removed meanwhile
                version = (st.st_mtime_ns, st.st_size)
                if describing and self._uploaded_versions.get(rel) == version:
                    continue
                try:
                    self._put(rel, path)
                except (OSError, pa.ArrowException) as exc:
                    self.report.failed_attempts += 1
                    self.report.last_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    # While closing, retry often: the job is waiting to end.
                    cap = 2.0 if self._closing else BACKOFF_S[1]
                    self._backoff = (BACKOFF_S[0] if self._backoff == 0
                                     else min(cap, self._backoff * 2))
                    return  # the store is failing: retry the whole sweep later
                self._backoff = 0.0
                self.report.uploaded_files += 1
                if describing:
                    self._uploaded_versions[rel] = version
                else:
                    try:
                        path.unlink()
                    except OSError:
                        pass

    def _put(self, rel: str, path: Path) -> None:
        data = path.read_bytes()
        target = f"{self.base}/{rel}"
        parent = target.rpartition("/")[0]
        if parent and parent not in self._made_dirs and self.fs.type_name in ("local", "hdfs", "py"):
            # Object stores need no directories (creating them costs round
            # trips); filesystems with real directories do.
            self.fs.create_dir(parent, recursive=True)
            self._made_dirs.add(parent)
        # One write of the whole object: it exists on the store only once
        # the upload completed (an object store has no rename to hide a
        # partial one behind).
        with self.fs.open_output_stream(target) as out:
            out.write(data)
