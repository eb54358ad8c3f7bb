"""The thread that calls the user's `on_event` callback.

The writer thread `post`s each event (`recorders.events`) without waiting;
this thread calls the callback, one event at a time, in order. A callback
may be slow (it may save a checkpoint) or raise: the training thread never
waits for it, nor does the writer's journal; the queue is bounded
(`EventPolicy.max_pending`) and what a full queue refuses is dropped and
counted. An exception is caught, warned about once per event kind and kept
for the manifest (`report()`). What the callback requests goes through the
event's `EventRequests`, which the training thread takes at its next
`rec.step()`.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import warnings

from .events import Event, EventPolicy, EventRequests

THREAD_NAME = "amp-postmortem-events"
# How long `close()` waits for callbacks still running or queued: a
# callback may save a checkpoint; one that hangs must not hang the job's end.
CLOSE_WAIT_S = 60.0
# What `flush()` waits for callbacks of events already raised: a callback
# that hangs must not hold the training thread at every flush for long.
FLUSH_WAIT_S = 5.0
_STOP = object()


class EventDispatcher:
    def __init__(self, policy: EventPolicy):
        self.policy = policy
        self.requests = EventRequests()
        self._queue: queue.Queue = queue.Queue(maxsize=policy.max_pending)
        self._lock = threading.Lock()
        self._raised: list[dict] = []
        self._errors: list[dict] = []
        self._warned: set[str] = set()
        self._dropped = 0
        self._unfinished = 0
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def post(self, event: Event) -> bool:
        """Queue `event` for the callback without waiting; False (and
        counted) when the queue is full or the thread has ended."""
        event = dataclasses.replace(event, requests=self.requests)
        with self._lock:
            self._raised.append(event.to_json())
            if self._thread.is_alive():
                try:
                    self._queue.put_nowait(event)
                    self._unfinished += 1
                    return True
                except queue.Full:
                    pass
            self._dropped += 1
            return False

    def wait_idle(self, timeout: float = CLOSE_WAIT_S) -> bool:
        """Block until every queued event's callback returned (or `timeout`);
        True when none is left."""
        with self._idle:
            return self._idle.wait_for(lambda: self._unfinished == 0, timeout=timeout)

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Let queued callbacks run (at most `timeout`), then end the thread.
        Idempotent; a callback still running is left to its daemon thread."""
        if not self._thread.is_alive():
            return
        self.wait_idle(timeout)
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:
            return  # a hung callback: the daemon thread ends with the process
        self._thread.join(timeout=1.0)

    def report(self) -> dict:
        """The manifest's `events` entry (a copy)."""
        with self._lock:
            return {**self.policy.config(), "raised": list(self._raised), "dropped": self._dropped,
                    "callback_errors": list(self._errors), "pending": self._unfinished}

    def _loop(self) -> None:
        while True:
            event = self._queue.get()
            if event is _STOP:
                return
            try:
                self.policy.callback(event)
            except Exception as exc:  # noqa: BLE001 - the user's code must never stop the training
                self._callback_failed(event, exc)
            finally:
                with self._idle:
                    self._unfinished -= 1
                    self._idle.notify_all()

    def _callback_failed(self, event: Event, exc: Exception) -> None:
        kind = event.kind.value
        with self._lock:
            self._errors.append({"kind": kind, "step": event.step, "error": f"{type(exc).__name__}: {exc}"})
            first = kind not in self._warned
            self._warned.add(kind)
        if first:
            warnings.warn(f"amp-postmortem: the on_event callback raised at a {kind} event (step {event.step}): "
                          f"{type(exc).__name__}: {exc}. Training and recording go on; the error is in the "
                          f"manifest's events.callback_errors.", RuntimeWarning, stacklevel=2)
