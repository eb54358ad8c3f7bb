"""The recorder's guard: an exception in a hook, the writer thread or the
constructor turns recording off with one warning; the training goes on.

`FailureGuard` holds whether recording is on and the first failure (and the
step it happened in); `wrap` and `wrap_call` put every hook under it. On the
first failure it calls `on_failure()`, which writes the stop record at once
from the failing thread (not through the writer thread, which may be what
failed), and returns the file that took it.
"""
from __future__ import annotations

import threading
import warnings

import torch


class FailureGuard:
    """`current_step()`: the step the training is in. `on_failure()`: write
    the stop record (returns its file, or None); `status_path`: the file a
    record normally goes to (a warning names any other). The writer side
    sets `writer_thread` and `writing_step`, so that a failure on that
    thread is dated by the step it was writing."""

    def __init__(self, *, current_step, on_failure=None):
        self.current_step = current_step
        self.on_failure = on_failure
        self.status_path = None
        self.enabled = True
        self.failure: BaseException | None = None
        self.failed_at_step: int | None = None
        self.warned = False
        self.writer_thread = None
        self.writing_step: int | None = None
        self._lock = threading.Lock()

    def wrap(self, fn, traced: bool = True, in_graph=None):
        """Wrap a hook: any exception switches recording off, never the job.
        A `traced` hook (one that dynamo may trace: module hooks inside a
        compiled model) does not run its eager body while compiling: it
        calls `in_graph` instead (`collectors.graph_stats`: tensor ops the
        graph takes in, no graph break, no recompilation) or returns."""
        def hook(*args, **kwargs):
            # Returns None (`in_graph`'s value while compiling): a forward
            # hook's value would replace the module's output.
            if traced and torch.compiler.is_compiling():
                return in_graph(*args, **kwargs) if in_graph is not None else None
            if self.enabled:
                try:
                    fn(*args, **kwargs)
                except Exception as exc:  # noqa: BLE001 - the training must go on
                    self.fail(exc)
        hook.__wrapped__ = fn
        return hook

    def wrap_call(self, fn, a, b):
        """`wrap` for the backward hooks made anew for every module call of
        every step: `fn(a, b, *args)` as one small object, where a wrapper
        closure around a hook closure made eleven (cells, closure tuples,
        functions, their `__dict__`). They were most of what the recorder
        allocated in a step, and each of Python's garbage collections had to
        visit them."""
        return _GuardedCall(self, fn, a, b)

    def fail(self, exc: BaseException, at_step: int | None = None) -> None:
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = exc
                # `at_step` (the last step of a pair the publisher failed to
                # write), the step being written when the writer thread
                # failed, else the step the training is in.
                on_writer = self.writer_thread is not None and threading.current_thread() is self.writer_thread
                self.failed_at_step = at_step if at_step is not None else \
                    self.writing_step if on_writer and self.writing_step is not None else self.current_step()
            self.enabled = False
        where = self.on_failure() if first and self.on_failure is not None else None
        self.warn_once(f"recording disabled after an internal error: {type(exc).__name__}: {exc}. "
                       f"Training continues unrecorded." + (
                           f" The reason is recorded in {where} (the run directory took no write)."
                           if where is not None and where != self.status_path else ""))

    def refuse(self, message: str) -> None:
        """Recording off from the start, for a reason that is no failure
        (another recorder holds the rank directory)."""
        self.enabled = False
        self.warn_once(message)

    def warn_once(self, message: str) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(f"amp-postmortem: {message}", RuntimeWarning, stacklevel=4)


class _GuardedCall:
    """A traced hook under the guard: `fn(a, b, *args)`, returning None. The
    same checks as `FailureGuard.wrap`'s wrapper, which stays a function for
    the long-lived hooks (`torch.compiler.disable` wraps some of them); this
    one is for the hooks made per step."""

    __slots__ = ("guard", "fn", "a", "b")

    def __init__(self, guard, fn, a, b):
        self.guard = guard
        self.fn = fn
        self.a = a
        self.b = b

    def __call__(self, *args):
        if torch.compiler.is_compiling() or not self.guard.enabled:
            return None
        try:
            self.fn(self.a, self.b, *args)
        except Exception as exc:  # noqa: BLE001 - the training must go on
            self.guard.fail(exc)
        return None
