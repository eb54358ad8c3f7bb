"""Lost updates: how many of the optimizer's updates leave a bfloat16 or
float16 weight unchanged, measured on the recorded (sampled) steps.

A weight held in bfloat16 (8 significant bits) or float16 (11) without a
float32 master copy changes only when its update is at least half an ulp
of the weight: with a small learning rate most updates round away, and
the loss stops improving with no NaN. `LostUpdates` counts, per such
parameter, the positions whose gradient is non-zero (the optimizer was
asked to move them) and, of those, the ones whose value the step left
bit-for-bit unchanged: the weights copied in the optimizer's pre-step hook
are compared with themselves in its post-step hook. Float32 parameters
(and everything on steps not recorded) cost nothing: no hook body runs,
no copy is made. The counts are device tensors, read on the writer
thread (`report`, `step_counts`), never on the training path.

`watch_steps()` (a recorder keeping a counterfactual window): each measured
step's counts are also kept until the writer thread reads them for that
step's summary (`step_counts`), where the bundle triggers judge them: a
step that lost most of its updates is a window event (`lost_updates`).

`report()` is the manifest's `lost_updates` (docs/FORMAT.md): the
parameters' names and dtypes and, per measured step, the two counts per
parameter; at most `max_points` steps are kept (every other one is dropped
when full, the first kept), so the manifest stays small on a long run.
"""
from __future__ import annotations

import threading

import torch

from ..guard import eager_hook
from .state import dtype_name

LOW_PRECISION = (torch.bfloat16, torch.float16)
MAX_POINTS = 128
# Steps measured and not yet read by the writer thread (`step_counts`): a
# writer that lags further drops the oldest (only their window event is lost).
MAX_UNREAD = 64


class LostUpdates:
    """`params`: (name, parameter) pairs; `optimizer`: the one whose steps
    are measured (None: nothing is); `recording()`: whether the step in
    progress is recorded (the recorder's schedule decides)."""

    def __init__(self, *, params: list, optimizer, recording, guard, max_points: int = MAX_POINTS):
        self.optimizer = optimizer
        self.recording = recording
        self.guard = guard
        self.max_points = int(max_points)
        self.params = [(n, p) for n, p in params if p.dtype in LOW_PRECISION and p.requires_grad]
        self._before: list | None = None
        self._lock = threading.Lock()
        self._steps: list[int] = []
        self._counts: list = []   # per measured step: int64 tensor [2, n] (moved, unchanged), on the device
        self._unread: dict | None = None  # step -> its counts, for `step_counts` (None: nobody reads them)
        self._step = 0

    def register(self, handles: list) -> None:
        """The optimizer's pre- and post-step hooks, only when a parameter
        is held in low precision (nothing else is measured)."""
        if not self.params or self.optimizer is None or not hasattr(self.optimizer, "register_step_post_hook"):
            return
        guard = self.guard
        handles.append(self.optimizer.register_step_pre_hook(eager_hook(guard, self._pre)))
        handles.append(self.optimizer.register_step_post_hook(eager_hook(guard, self._post)))

    def watch_steps(self):
        """Keep each measured step's counts for the writer thread; returns
        the reader, `step_counts`."""
        self._unread = {}
        return self.step_counts

    def begin_step(self, step_id: int) -> None:
        self._step = int(step_id)

    def _pre(self, optimizer, args, kwargs) -> None:
        self._before = None
        if not self.recording():
            return
        with torch.no_grad():
            self._before = [p.detach().clone() if p.grad is not None else None for _, p in self.params]

    def _post(self, optimizer, args, kwargs) -> None:
        before, self._before = self._before, None
        if before is None:
            return
        moved, kept = [], []
        with torch.no_grad():
            for (_, p), b in zip(self.params, before):
                if b is None or p.grad is None:
                    zero = torch.zeros((), dtype=torch.int64, device=p.device)
                    moved.append(zero)
                    kept.append(zero)
                    continue
                asked = p.grad.detach() != 0
                moved.append(asked.sum())
                kept.append((asked & (p.detach() == b)).sum())
            counts = torch.stack([torch.stack(moved), torch.stack(kept)])
        with self._lock:
            self._steps.append(self._step)
            self._counts.append(counts)
            if self._unread is not None:
                self._unread[self._step] = counts
                if len(self._unread) > MAX_UNREAD:
                    del self._unread[next(iter(self._unread))]
            if len(self._steps) > self.max_points:
                # Thin evenly, the first step kept: the trend spans the run.
                self._steps = self._steps[:1] + self._steps[2::2]
                self._counts = self._counts[:1] + self._counts[2::2]

    def step_counts(self, step: int) -> tuple[int, int] | None:
        """Writer thread: (moved, unchanged) of `step` summed over the
        low-precision parameters (None: the step was not measured, or
        `watch_steps` was not called), read once."""
        with self._lock:
            counts = self._unread.pop(int(step), None) if self._unread else None
        if counts is None:
            return None
        moved, kept = counts.tolist()  # waits for the device here, on the writer thread
        return sum(moved), sum(kept)

    def report(self) -> dict | None:
        """The manifest's `lost_updates` (writer thread); None when no
        parameter is held in low precision."""
        if not self.params:
            return None
        with self._lock:
            steps, counts = list(self._steps), list(self._counts)
        # `.tolist()` of a device tensor waits for it here, on the writer thread.
        moved = [[int(v) for v in c[0].tolist()] for c in counts]
        kept = [[int(v) for v in c[1].tolist()] for c in counts]
        return {"params": [n for n, _ in self.params], "dtypes": [dtype_name(p.dtype) for _, p in self.params],
                "steps": steps, "moved": moved, "unchanged": kept}
