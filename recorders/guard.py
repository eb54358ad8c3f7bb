"""The recorder's guard: an exception in a hook, the writer thread or the
constructor turns recording off with one warning; the training goes on.

`FailureGuard` holds whether recording is on and the first failure (and the
step it happened in); `wrap` and `wrap_call` put every hook under it. On the
first failure it calls `on_failure()`, which writes the stop record at once
from the failing thread (not through the writer thread, which may be what
failed), and returns the file that took it.
"""
from __future__ import annotations

import sys
import threading
import warnings

import torch

try:  # dynamo's per-code switch: this frame and every frame it calls run uncompiled
    from torch._C._dynamo.eval_frame import (_FrameAction, _FrameExecStrategy,
                                             set_code_exec_strategy as _set_code_strategy)
except ImportError:  # a torch without it: `torch.compiler.disable`'s wrapper
    _set_code_strategy = None


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


def eager_hook(wrap, fn):
    """A hook under the guard whose `wrap` (`FailureGuard.wrap`) is given,
    that runs eagerly even when called from compiled code (a compiled
    function that steps the optimizer or calls `.backward()` would otherwise
    trace it, or compile its frames once per parameter shape).

    `torch.compiler.disable`'s wrapper did so at ~90 bytecodes and two
    switches of the frame evaluator a call, on every step's optimizer hook
    (a tenth of a point of the launch-bound proxy's ratio by the bytecode
    figure of `benchmarks/RESULTS.md`; too little for a run to resolve). `_EagerHook`'s
    `__call__` is marked once, as torch marks its own disabled wrappers:
    dynamo neither traces nor compiles it nor any frame it calls, and a
    compiled caller breaks its graph there, as for `disable`. Where torch
    lacks the switch (or `wrap` is not a guard's), the wrapper as before,
    and only once dynamo is loaded: a job that never compiles must not pay
    its import (seconds)."""
    guard = getattr(wrap, "__self__", None)
    if _set_code_strategy is not None and isinstance(guard, FailureGuard):
        return _EagerHook(guard, fn)
    hook = wrap(fn, traced=False)
    return torch.compiler.disable(hook) if "torch._dynamo" in sys.modules else hook


class _EagerHook:
    """`FailureGuard.wrap(fn, traced=False)` as one object whose call dynamo
    skips, with every frame under it (`eager_hook`)."""

    __slots__ = ("guard", "fn", "__wrapped__")

    def __init__(self, guard, fn):
        self.guard = guard
        self.fn = fn
        self.__wrapped__ = fn

    def __call__(self, *args, **kwargs):
        if self.guard.enabled:
            try:
                self.fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the training must go on
                self.guard.fail(exc)
        return None


if _set_code_strategy is not None:
    # Inlined from a traced frame, a function so marked breaks the graph
    # (dynamo's "Skip inlining torch.compiler.disable()'d function"); run,
    # its frame and the frames it calls are skipped (SKIP, SKIP).
    _EagerHook.__call__._torchdynamo_disable = True
    _set_code_strategy(_EagerHook.__call__.__code__,
                       _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))


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
