"""The recorder's one background thread: jobs run in order from a bounded
queue, so the training thread never waits for the disk.

`submit` never blocks (a full queue answers False: the caller drops or
retries); `barrier` blocks until every job submitted before it has run,
then runs its own job there; `stop` does the same and ends the thread.
Once `is_failed()` says so, ordinary jobs are skipped (a barrier still
releases its caller); a job that raises is reported to `on_error`.
`when_idle(job, interval_s)` runs `job()` whenever the queue stayed empty
for `interval_s` (the journal's fsync of what the last steps wrote).
"""
from __future__ import annotations

import queue
import threading

THREAD_NAME = "amp-postmortem-writer"


class _Barrier:
    __slots__ = ("job", "done", "last")

    def __init__(self, job, last):
        self.job, self.done, self.last = job, threading.Event(), last


class WriterThread:
    def __init__(self, *, max_queue: int, is_failed, on_error):
        self.max_queue = max_queue
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._is_failed = is_failed
        self._on_error = on_error
        self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
        self._idle_job = None
        self._idle_s: float | None = None

    def when_idle(self, job, interval_s: float) -> None:
        """Run `job()` on the thread after `interval_s` without a job (set
        before `start`)."""
        self._idle_job, self._idle_s = job, max(0.01, float(interval_s))

    def start(self) -> None:
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def native_id(self) -> int | None:
        """The OS thread id (benchmarks read its CPU time)."""
        return self._thread.native_id

    @property
    def backlog(self) -> int:
        """Jobs waiting (an approximate count, as `queue.Queue.qsize`)."""
        return self._queue.qsize()

    def submit(self, job) -> bool:
        """Queue `job()` without waiting; False when the queue is full or the
        thread is not running."""
        if not self._thread.is_alive():
            return False
        try:
            self._queue.put_nowait(job)
            return True
        except queue.Full:
            return False

    def barrier(self, job=None) -> None:
        """Run `job()` on the thread after everything queued so far, and wait."""
        self._wait(_Barrier(job, last=False))

    def stop(self, job=None, timeout: float = 60) -> None:
        """Like `barrier`, then end the thread."""
        if self._thread.is_alive():
            self._wait(_Barrier(job, last=True))
            self._thread.join(timeout=timeout)

    def _wait(self, barrier: _Barrier) -> None:
        if not self._thread.is_alive():
            return
        self._queue.put(barrier)
        barrier.done.wait()

    def _loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._idle_s)
            except queue.Empty:
                if self._idle_job is not None and not self._is_failed():
                    try:
                        self._idle_job()
                    except Exception as exc:  # noqa: BLE001
                        self._on_error(exc)
                continue
            if isinstance(item, _Barrier):
                try:
                    if item.job is not None and not self._is_failed():
                        item.job()
                except Exception as exc:  # noqa: BLE001 - disk full, bad value, ...
                    self._on_error(exc)
                item.done.set()
                if item.last:
                    return
                continue
            if self._is_failed():
                continue
            try:
                item()
            except Exception as exc:  # noqa: BLE001
                self._on_error(exc)
