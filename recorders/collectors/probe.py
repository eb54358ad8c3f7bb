"""The op probe: the operations inside a probed module's forward, as
`intermediate` rows (options: `recorders.options.ProbeOptions`).

An overflow inside a module often never reaches its output as an Inf: a
hand-written float16 LayerNorm's variance `(x * x).mean()` or attention
logits `q @ k^T` before the softmax get within a factor of 65504 while the
module's output stays finite, until the step where they do not. The
module's `activation` row cannot show that; this probe records, per
operation, the largest finite magnitude and the NaN/Inf counts of its
floating outputs, so `amp-postmortem ranges` names the op nearest to the
dtype's limit before any NaN.

How: while a probed module's forward runs on a recorded step (its forward
pre-hook to its forward hook, registered only when a probe is given), one
`OpProbeMode`, a `TorchDispatchMode`, is on the mode stack. It sees every
aten op below autograd and autocast (autocast's casts are ops of their own,
`aten::_to_copy`), runs it unchanged and then adds the cheap-tier
statistics of its floating outputs (`stats.row_stats`: device work, no
host read on a GPU; kept as the other rows are and copied with the step).
Views are skipped (their values are their base's). The model's source line
is the innermost frame that is neither torch's nor the standard library's;
an op the recorder's own hooks run (the statistics of a module inside the
probed one) is recognised by its frame and not recorded. An op belongs to
the innermost probed module running. Rows are appended at the module's
forward hook, with the order its `activation` row gets, one per floating
output (merged by their key: name, call, op, op index, source line).

Backward passes and activation checkpointing's recomputation are never
probed (the pre-hook asks `ForwardCollector.active`). The forward hook
pops the mode whatever happened (`always_call`, and even after recording
was switched off), so no mode stays pushed. A failure of the probe's own
code turns recording off with the recorder's warning (`fail`); the op's
result is returned as it was computed.
"""
from __future__ import annotations

import os
import sys
import sysconfig
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..format import schema
from ..layout import PLAIN_TENSORS
from ..stats import CHEAP_WIDTH, FULL_WIDTH, pad_row, row_stats
from .state import Shared, dtype_name

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Not views by their schema, but the same values as their input: no row.
_SAME_VALUES = frozenset({"aten::_unsafe_view", "aten::lift_fresh", "aten::lift_fresh_copy"})

_RECORDER = object()  # a frame of the recorder's own code: the op is the recorder's
_TORCH_DIRS = tuple(os.path.abspath(d) + os.sep for d in (
    os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"]))
_RECORDER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class OpProbeMode(TorchDispatchMode):
    """Runs every op as it is, then tells `probe` about its outputs."""

    def __init__(self, probe: "ProbeCollector"):
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # torch pops this mode while we are in here: the statistics' own ops are not seen.
        out = func(*args, **(kwargs or {}))
        probe = self.probe
        if probe.recording and not getattr(func, "is_view", False):
            try:
                probe.note(func, out)
            except Exception as exc:  # noqa: BLE001 - the training must go on
                probe.fail(exc)
        return out


class _Call:
    """One probed module call in progress: its recorded ops so far."""

    __slots__ = ("name", "call", "module_id", "ops")

    def __init__(self, name, call, module_id):
        self.name = name
        self.call = call
        self.module_id = module_id
        self.ops: list = []  # (op, index, source, [(dtype, numel, stats), ...])


class ProbeCollector:
    """`named`: module names probed on every recorded step; `leaves`: those
    probed on full-tier steps only; `modules`: name -> module to hook;
    `active()`: the step state when a forward hook records (None: not);
    `fail(exc)`: the recorder's failure path (recording off, one warning)."""

    def __init__(self, shared: Shared, *, modules: dict, named, leaves, active, fail, max_ops: int):
        self.shared = shared
        self.modules = modules
        self.named = set(named)
        self.leaves = set(leaves) - self.named
        self.active = active
        self.fail_hook = fail
        self.max_ops = max_ops
        self.mode = OpProbeMode(self)
        self.calls: list[_Call] = []  # the probed calls running, innermost last
        self.recording = False  # the mode is pushed and records
        self.broken = False
        self._counted_state = None  # the StepState and micro-batch `_counts` is for
        self._counts: dict = {}
        self._files: dict = {}  # file -> _RECORDER, None (torch's) or its shown path
        self._ops: dict = {}  # OpOverload -> "aten::name"
        self._cwd = os.getcwd() + os.sep

    def register(self, handles: list) -> None:
        """Register after the forward collector: the pre-hook runs after its
        pre-hooks, the forward hook (prepended) before its forward hooks, so
        the recorder's statistics of the module's inputs and outputs are
        outside the mode."""
        guard = self.shared.guard
        for name in sorted(self.named | self.leaves):
            m = self.modules[name]
            handles.append(m.register_forward_pre_hook(guard(self._make_pre(name, m, name in self.named))))
            handles.append(m.register_forward_hook(self._make_post(m), prepend=True, always_call=True))

    # ------------------------------------------------------------ hooks
    def _make_pre(self, name, registered, every_step: bool):
        ref = weakref.ref(registered)

        def pre(module, args):
            if module is not ref() or self.broken:
                return
            st = self.active()
            if st is None or not st.forward_open or not (every_step or st.full):
                return
            self.calls.append(_Call(name, self._call_index(st, name), id(module)))
            if len(self.calls) == 1:
                self.mode.__enter__()
                self.recording = True
        return pre

    def _make_post(self, registered):
        ref = weakref.ref(registered)

        def post(module, args, output):
            # Not under the recorder's guard: the mode is popped even when
            # recording was switched off during the forward.
            if torch.compiler.is_compiling() or module is not ref():
                return None
            calls = self.calls
            if not calls or calls[-1].module_id != id(module):
                return None  # this call was not probed
            c = calls.pop()
            if not calls:
                self.recording = False
                self.mode.__exit__(None, None, None)
            if self.broken or (output is None and sys.exc_info()[0] is not None):
                return None  # the forward raised: its micro-batch is dropped
            try:
                self._add_rows(self.shared.state, c)
            except Exception as exc:  # noqa: BLE001 - the training must go on
                self.fail(exc)
            return None
        return post

    def _call_index(self, st, name) -> int:
        """Which call of `name` in the micro-batch (as the `call` column)."""
        mark = (st, st.micro_batches)
        if self._counted_state is None or self._counted_state[0] is not st \
                or self._counted_state[1] != st.micro_batches:
            self._counted_state = mark
            self._counts = {}
        call = self._counts.get(name, 0)
        self._counts[name] = call + 1
        return call

    # -------------------------------------------------------------- ops
    def note(self, func, out) -> None:
        """An op ran inside the innermost probed call: its floating outputs'
        statistics, unless the recorder's own code ran it."""
        c = self.calls[-1]
        if len(c.ops) >= self.max_ops:
            return
        if type(out) in PLAIN_TENSORS:
            outs = (out,)
        elif isinstance(out, (tuple, list)):
            outs = out
        else:
            return
        tensors = [t for t in outs if type(t) in PLAIN_TENSORS and t.dtype in _FLOATING
                   and t.layout == torch.strided and t.device.type != "meta" and t.numel()]
        if not tensors:
            return
        op = self._ops.get(func)
        if op is None:
            op = self._ops[func] = func.name().split(".")[0]
        if op in _SAME_VALUES:
            return
        source = self._source(sys._getframe(2))
        if source is _RECORDER:
            return
        near = self.shared.near_overflow
        entries = [(dtype_name(t.dtype), t.numel(), row_stats(t, full=False, near_overflow=near))
                   for t in tensors]
        c.ops.append((op, len(c.ops), source, entries))

    def _source(self, frame):
        """`file:line` of the model's innermost frame, `_RECORDER` when the
        recorder's code comes first, None when only torch's code runs."""
        files = self._files
        while frame is not None:
            path = frame.f_code.co_filename
            shown = files.get(path, False)
            if shown is False:
                shown = files[path] = self._classify(path)
            if shown is _RECORDER:
                return _RECORDER
            if shown is not None:
                return f"{shown}:{frame.f_lineno}"
            frame = frame.f_back
        return None

    def _classify(self, path: str):
        if path.startswith("<"):
            return None  # generated code (`<string>`, frozen modules): not a file of the model
        full = os.path.abspath(path)
        if full.startswith(_RECORDER_DIR):
            return _RECORDER
        if full.startswith(_TORCH_DIRS):
            return None
        return full[len(self._cwd):] if full.startswith(self._cwd) else full

    def _add_rows(self, st, c: _Call) -> None:
        # This hook runs before the forward collector's: its `activation`
        # rows get the order these get.
        order = st.fwd_order
        width = FULL_WIDTH if st.full else CHEAP_WIDTH
        meta, rows = st.meta, st.stats
        for op, index, source, entries in c.ops:
            key = (op, index, source)
            for dtype, numel, s in entries:
                s = pad_row(s, width)
                meta.append((c.name, schema.INTERMEDIATE_KIND, "forward", order, c.call, dtype, numel, None, key))
                rows.append(s)
                if st.device is None and type(s) is not tuple:
                    st.device = s.device

    def fail(self, exc: BaseException) -> None:
        """Probe off for good, recording off with the recorder's warning."""
        self.broken = True
        self.recording = False
        self.fail_hook(exc)
