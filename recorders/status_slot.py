"""The recorder's status slot: a small file whose space is taken at start,
so that the reason recording stopped reaches the disk that filled up.

`rank=R/status.json` is written in full (padded JSON, `SLOT_BYTES` bytes)
and fsynced when the recorder starts; every later change overwrites it in
place (`os.pwrite` at offset 0 of the descriptor held open since then), so
it needs no new block, no new inode and no rename: a full disk (ENOSPC), a
full inode table, a quota still take it. A filesystem that copies on write
(btrfs, ZFS) may still refuse, and one that went read-only refuses every
write: then the record goes to a fallback file under the temp directory,
which the recorder's warning names.

The descriptor held open for writing has a side effect worth knowing:
Linux refuses `mount -o remount,ro` of that filesystem (EBUSY) while the
recorder runs, as for any open log file; only a forced read-only switch
(a filesystem error with `errors=remount-ro`, an emergency remount) happens
under it.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
import time
from pathlib import Path

from .format import schema

# One page: the usual unit of an in-place write, and room for a reason of
# ~3,500 characters (a longer one is cut).
SLOT_BYTES = 4096
_REASON_CHARS = 3000
FALLBACK_DIR_ENV = "AMP_POSTMORTEM_STATUS_FALLBACK_DIR"


class StatusSlot:
    """The status file of one rank, reserved at construction. `record()`
    overwrites it; `close()` releases the descriptor. Writes never raise:
    they answer where the record went (None: nowhere)."""

    def __init__(self, rank_dir: Path, *, run_id: str, rank: int):
        self.path = Path(rank_dir) / schema.STATUS_FILE
        self.fields = {"format": schema.STATUS_FORMAT, "run_id": run_id, "rank": rank,
                       "host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time(),
                       "updated_at": time.time(), "status": "open",
                       "disabled_reason": None, "disabled_at_step": None}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Written in full and fsynced now: the blocks are allocated and
        # written, so an overwrite later allocates nothing.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            data = _encode(self.fields)
            if os.pwrite(fd, data, 0) != len(data):
                raise OSError(f"short write reserving {self.path}")
            os.ftruncate(fd, SLOT_BYTES)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.fallback_path: Path | None = None

    def record(self, *, status: str | None = None, disabled_reason: str | None = None,
               disabled_at_step: int | None = None) -> Path | None:
        """Overwrite the slot with the new state; on failure, write the
        fallback file. Returns the file that holds the record, or None."""
        if status is not None:
            self.fields["status"] = status
        if disabled_reason is not None:
            self.fields["disabled_reason"] = disabled_reason[:_REASON_CHARS]
        if disabled_at_step is not None:
            self.fields["disabled_at_step"] = int(disabled_at_step)
        self.fields["updated_at"] = time.time()
        data = _encode(self.fields)
        if self._fd is not None:
            try:
                if os.pwrite(self._fd, data, 0) == len(data):
                    os.fsync(self._fd)
                    return self.path
            except OSError:
                pass
        return self._write_fallback()

    def _write_fallback(self) -> Path | None:
        self.fallback_path = write_fallback(self.path, self.fields) or self.fallback_path
        return self.fallback_path

    def __del__(self):
        self.close()

    def close(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def write_fallback(slot: Path, fields: dict) -> Path | None:
    """The record of a slot that took no write, on another filesystem: the
    temp directory (or `$AMP_POSTMORTEM_STATUS_FALLBACK_DIR`), one file per
    slot (named by its path's hash), with the slot's path inside."""
    base = Path(os.environ.get(FALLBACK_DIR_ENV) or Path(tempfile.gettempdir()) / "amp-postmortem-status")
    key = hashlib.sha256(os.path.abspath(slot).encode()).hexdigest()[:16]
    target = base / f"{key}-rank{fields.get('rank')}.json"
    try:
        base.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps({**fields, "slot": os.path.abspath(slot)}, indent=1) + "\n")
    except OSError:
        return None
    return target


def _encode(fields: dict) -> bytes:
    """The JSON padded with spaces to `SLOT_BYTES` (a JSON reader ignores
    trailing whitespace); a reason too long for the slot is cut."""
    data = json.dumps(fields).encode()
    reason = fields.get("disabled_reason") or ""
    while len(data) > SLOT_BYTES - 1 and reason:
        reason = reason[:len(reason) // 2]
        data = json.dumps({**fields, "disabled_reason": reason + "..."}).encode()
    return data + b" " * (SLOT_BYTES - 1 - len(data)) + b"\n"
