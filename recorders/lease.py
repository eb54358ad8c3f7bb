"""One writer per rank directory: a lease held for the recorder's lifetime.

`rank=R/.writer.lock` is locked with `fcntl.flock` (exclusive, never
waited for) from construction to `close()`, and holds the holder's host,
pid and start time for the message a second recorder gives. The kernel
drops the lock when its process dies, however it dies: a lease left by a
killed job is free, and the next recorder takes it over. The name is
hidden: readers and the object-store uploader ignore it.

On a filesystem without `flock` (some network and parallel filesystems
answer ENOLCK, EOPNOTSUPP or ENOSYS) the file's contents decide: a holder
on this host is alive while its pid runs with the same start time; a
holder on another host is alive while the file's modification time is
fresh, which a small heartbeat thread of the holder keeps so.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

from .format import schema

# Without flock: a lease another host has not refreshed for this long is
# taken to be left by a dead job; the holder refreshes it far more often.
STALE_AFTER_S = 120.0
HEARTBEAT_S = 20.0
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class LeaseHeldError(RuntimeError):
    """Another live recorder writes this rank directory."""

    def __init__(self, path: Path, holder: dict):
        self.path = path
        self.holder = holder
        mine = holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid()
        super().__init__(
            f"{path.parent} is being written by another recorder (host {holder.get('host', '?')}, "
            f"pid {holder.get('pid', '?')}, started {_when(holder.get('started_at'))}"
            + ("; an earlier recorder of this process: close() it first" if mine else "") + ")")


class RankLease:
    """The lease of one rank directory, taken at construction (raises
    `LeaseHeldError` when a live holder has it); `release()` gives it back."""

    def __init__(self, rank_dir: Path):
        self.path = Path(rank_dir) / schema.LEASE_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time(),
                       "process_start": _process_start(os.getpid())}
        self.flock = True
        self._fd: int | None = None
        self._stop = threading.Event()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                holder = _read(fd)
                os.close(fd)
                raise LeaseHeldError(self.path, holder) from None
            if exc.errno not in _NO_FLOCK:
                os.close(fd)
                raise
            os.close(fd)
            self.flock = False
            self._take_without_flock()
            return
        try:
            # Ours now: the previous holder's text goes (it was a dead process).
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(self.holder).encode(), 0)
        except BaseException:
            os.close(fd)  # the lock goes with it
            raise
        self._fd = fd

    def _take_without_flock(self) -> None:
        holder = _read_path(self.path)
        if holder and _alive(holder, self.path):
            raise LeaseHeldError(self.path, holder)
        # Written under a unique name and renamed over: of two recorders
        # taking a stale lease at once, the file read back says who won.
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps(self.holder))
        os.replace(tmp, self.path)
        if _read_path(self.path) != self.holder:
            raise LeaseHeldError(self.path, _read_path(self.path) or {})
        threading.Thread(target=self._heartbeat, name="amp-postmortem-lease", daemon=True).start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def __del__(self):
        # A recorder dropped without close(): its descriptor, hence the
        # lock, goes with it rather than with the process.
        self.release()

    def release(self) -> None:
        """Give the lease back (idempotent). With flock the lock goes with
        the descriptor; without, the file is removed if it is still ours."""
        if not hasattr(self, "_stop"):
            return  # failed before it held anything
        self._stop.set()
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        elif not self.flock:
            try:
                if _read_path(self.path) == self.holder:
                    self.path.unlink()
            except OSError:
                pass
            self.flock = True  # released once


def _read(fd: int) -> dict:
    try:
        return _parse(os.pread(fd, 4096, 0))
    except OSError:
        return {}


def _read_path(path: Path) -> dict:
    try:
        return _parse(path.read_bytes()[:4096])
    except OSError:
        return {}


def _parse(data: bytes) -> dict:
    try:
        out = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def _alive(holder: dict, path: Path) -> bool:
    """Whether the holder of a lease on a filesystem without flock still runs."""
    if holder.get("host") == socket.gethostname():
        pid = holder.get("pid")
        if not isinstance(pid, int) or pid <= 0:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # runs, as another user
        # A pid reused by another process since: not the holder.
        start = holder.get("process_start")
        return start is None or _process_start(pid) in (None, start)
    try:
        return time.time() - os.stat(path).st_mtime < STALE_AFTER_S
    except OSError:
        return False


def _process_start(pid: int):
    """The process's start time in clock ticks since boot (Linux), else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _when(t) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(t)))
    except (TypeError, ValueError, OverflowError):
        return "?"
