"""The cheap tier's rows of modules that run inside a compiled graph.

Dynamo traces the hooks of the modules under a `torch.compile` (the
recorder's hooks included, when they are registered before the first
compiled call). Where the eager hooks return at once while dynamo traces,
they call this collector's hooks instead, whose code is tensor operations
only: the compiler puts them in the graph, next to the code that makes each
tensor, and no Python runs per module per step.

Each row has a slot bound at attach time: the model's `<input>` and each
watched module's `activation` in one float64 forward buffer on the model's
device, and each module's `grad_output` and `grad_input` in a small tensor
of its own (see `Probe`), all written in place, their layout in
`recorders.graph_rows`. `absmax` by max, the counts and `numel` by sum
(micro-batches, calls and the tensors of a tuple output add up, as eager
rows merge); `seq` and `enter` are a counter's values when a call ended and
began (the rows' order). The backward rows are written by `Probe`, an
identity autograd Function put on the module's outputs and inputs
(compiled path only: an eager step gets no autograd node of the recorder).
Every write is multiplied by `gate` (1: record, 0: a step not recorded or a
`paused()` pass), a tensor the host chooses, so that pausing and the tier
schedule never change what the graph does: no guard on a Python value, no
recompilation. The forward buffer's last row holds the counter, the
micro-batches (root forwards traced in the graph) and the autocast state as
the trace saw it.

`rec.step()` takes the values (`take`: one copy, the buffers zeroed) when a graph
wrote it this step (`ran`, set by the traced hook: dynamo replays that
attribute store after each call of the graph) and it travels with the
step's one asynchronous copy; the writer thread turns its used slots into
rows (`recorders.graph_rows`, where the buffer's layout is defined).
"""
from __future__ import annotations

import math

import torch

from .. import schema
from ..graph_rows import (ABSMAX, AUTOCAST_DEVICES, AUTOCAST_DTYPE, AUTOCAST_DEVICE, COUNTER, DTYPE, DTYPES, ENTER,
                          INPUT_BAD, MICRO_BATCHES, NAN, SEQ, WIDTH)
from ..stats import float_tensors


def _dtype_code(dtype) -> float:
    for i, d in enumerate(DTYPES):
        if dtype == d:
            return float(i + 1)
    return 0.0


class Probe(torch.autograd.Function):
    """Identity; its backward adds the statistics of the gradient that
    passes to `row`, times the gate as the forward saw it. `row` is a
    tensor of its own per backward slot, written by no forward and by no
    other slot's backward: a compiled graph keeps the tensors its backward
    uses with their version, and a write by another graph (the root's
    hooks are a frame of their own) between its forward and its backward
    would make autograd refuse them. The gate, for the same reason, is
    never written: `set_gate` chooses one of two constant tensors."""

    @staticmethod
    def forward(ctx, x, row, gate):
        ctx.row = row
        ctx.gate = gate
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        write(ctx.row, ctx.gate, grad)
        return grad, None, None


_INT32_MAX = 2 ** 31 - 1


def _count_dtype(d):
    """int32 where the size is known to be within its range; int64 where
    it is not, or is symbolic (dynamic shapes, a data-dependent size such
    as a mask's selection): `statically_known_true` decides without adding
    a guard, where comparing the size would add one, or fail to trace a
    data-dependent size (dynamo hides SymInt from `type` and
    `isinstance`). Imported here: it loads sympy, and this runs only while
    dynamo traces."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    return torch.int32 if statically_known_true(d.numel() <= _INT32_MAX) else torch.int64


def nonfinite_counts(d):
    """The NaN and Inf counts of `d` as graph operations: `d != d` and
    `|d| == inf`, summed in int32 (int64 past int32's range or for a
    symbolic size: `_count_dtype`, at trace time). Written so because
    inductor's CPU code for `isnan(d).sum()` and `isinf(d).sum()` (int64
    sums of the masks) is not vectorised: on the benchmark GPT those counts
    were most of the 2.5x the in-graph rows cost; the comparisons and int32
    sums fuse into the one pass that also takes the maximum
    (`benchmarks/RESULTS.md`)."""
    dtype = _count_dtype(d)
    return (d != d).sum(dtype=dtype), (d.abs() == math.inf).sum(dtype=dtype)


def nonfinite_total(d):
    """NaN and Inf together (`input_nonfinite`): the values whose magnitude
    is not below inf, one comparison and one sum."""
    return (~(d.abs() < math.inf)).sum(dtype=_count_dtype(d))


def write(row, gate, t, counter=None, input_bad=None) -> None:
    """Add the cheap statistics of `t` to `row` (a buffer row), times
    `gate` (tensor ops only); `counter`: advanced, and its value kept as
    the row's `seq`. One write of the row: each in-place write of a view
    is a kernel of its own in the graph."""
    d = t.detach()
    # The same definitions as the eager rows (`stats._device_stats`):
    # counts of NaN and Inf, the largest finite magnitude; one pass over
    # `d` once the compiler fuses the three reductions.
    nan, inf = nonfinite_counts(d)
    a = d.abs()
    top = torch.where(a < math.inf, a, 0).amax()
    zero = torch.zeros((), dtype=torch.float64, device=row.device)
    bad = input_bad if input_bad is not None else zero
    if counter is not None:
        counter.add_(gate)
        seq = torch.where(gate > 0, counter, row[SEQ])
    else:
        seq = row[SEQ]
    delta = torch.stack([zero, nan.to(torch.float64), inf.to(torch.float64), bad, zero + 1.0,
                         zero + d.numel(), zero, zero, zero]) * gate
    new = row + delta
    new = torch.stack([torch.maximum(row[ABSMAX], top.to(torch.float64) * gate), *new[NAN:SEQ], seq,
                       zero + _dtype_code(d.dtype), row[ENTER]])
    row.copy_(new)


class GraphStats:
    """`watched`: the watched module names ("" the model); `device`: where
    the buffers live (the model's parameters'); `rows` False: no module's
    statistics in the graph (`AmpRecorder(compiled_rows=False)`), only the
    micro-batches and the autocast state, which read no training tensor."""

    def __init__(self, watched: list[str], device, rows: bool = True):
        self.rows = rows
        self.slots: list[tuple[str, str]] = [(schema.INPUT_NAME, "input")]
        self.index: dict[tuple[str, str], int] = {}
        for name in watched:
            self.index[(name, "activation")] = len(self.slots)
            self.slots.append((name, "activation"))
        self.grad_slots: list[tuple[str, str]] = []
        # Without module rows no probe writes a gradient slot: none are
        # made, so each step's `take` copies and zeroes the last row only.
        for name in (watched if rows else ()):
            for kind in ("grad_output", "grad_input"):
                self.index[(name, kind)] = len(self.grad_slots)
                self.grad_slots.append((name, kind))
        self.device = torch.device(device)
        self.buffer = torch.zeros(len(self.slots) + 1, WIDTH, dtype=torch.float64, device=self.device)
        self.grads = [torch.zeros(WIDTH, dtype=torch.float64, device=self.device) for _ in self.grad_slots]
        # Two constant tensors, the gate one of them: a gate changed in place
        # between a graph's forward and its backward (a `paused()` pass in
        # between) would make autograd refuse the backward (version check).
        self._gates = (torch.zeros((), dtype=torch.float64, device=self.device),
                       torch.ones((), dtype=torch.float64, device=self.device))
        self.gate = self._gates[1]
        self.ran = False  # a traced hook ran since the last `take`

    @property
    def size(self) -> int:
        """Values `take` returns."""
        return (len(self.slots) + 1 + len(self.grad_slots)) * WIDTH

    # ------------------------------------------------------------- host
    def set_gate(self, on: bool) -> None:
        self.gate = self._gates[bool(on)]

    def take(self):
        """The values written since the last take (one flat tensor on the
        buffers' device: the forward buffer, then the gradient rows), the
        buffers zeroed; None when no graph wrote them."""
        if not self.ran:
            return None
        self.ran = False
        out = torch.cat([self.buffer.reshape(-1), torch.stack(self.grads).reshape(-1)]) if self.grads \
            else self.buffer.reshape(-1).clone()
        self.buffer.zero_()
        if self.grads:
            torch._foreach_zero_(self.grads)
        return out

    # ------------------------------------------------------ in the graph
    def write(self, slot: int, t) -> None:
        write(self.buffer[slot], self.gate, t, counter=self.buffer[-1, COUNTER])

    def note_input_bad(self, slot: int, tensors) -> None:
        """Add the NaN/Inf count of a call's inputs to `slot`'s
        `input_nonfinite`; mark where the call began (`ENTER`)."""
        row, gate, counter = self.buffer[slot], self.gate, self.buffer[-1, COUNTER]
        counter.add_(gate)
        row[ENTER].copy_(torch.where(gate > 0, counter, row[ENTER]))
        if not tensors:
            return
        bad = None
        for t in tensors:
            n = nonfinite_total(t.detach()).to(torch.float64)
            bad = n if bad is None else bad + n
        row[INPUT_BAD].add_(bad * gate)

    def note_autocast(self) -> None:
        """The autocast state as this trace runs (dynamo guards on it: a
        graph is traced per state), kept as the buffer's codes."""
        for i, dev in enumerate(AUTOCAST_DEVICES):
            try:
                on = torch.is_autocast_enabled(dev)
            except (RuntimeError, TypeError, AttributeError):
                continue
            if on:
                row = self.buffer[-1]
                row[AUTOCAST_DTYPE].fill_(_dtype_code(torch.get_autocast_dtype(dev)))
                row[AUTOCAST_DEVICE].fill_(float(i + 1))
                return

    def probe(self, slot: int, t):
        return Probe.apply(t, self.grads[slot], self.gate)

    def probe_all(self, slot: int, obj):
        """`obj` with each floating tensor that needs a gradient (itself, or
        the items of a tuple or list) passed through a probe into `slot`;
        None when nothing was probed (other structures keep their tensors)."""
        if isinstance(obj, torch.Tensor):
            return self.probe(slot, obj) if obj.requires_grad and obj.is_floating_point() else None
        if type(obj) in (tuple, list):
            changed = False
            items = []
            for v in obj:
                if isinstance(v, torch.Tensor) and v.requires_grad and v.is_floating_point():
                    items.append(self.probe(slot, v))
                    changed = True
                else:
                    items.append(v)
            return type(obj)(items) if changed else None
        return None

    # hooks (called by the eager hooks' guard while dynamo traces)
    def root_pre(self, module, args, kwargs):
        self.ran = True
        self.buffer[-1, MICRO_BATCHES].add_(self.gate)
        self.note_autocast()
        if not self.rows:
            return None
        for t in float_tensors((args, kwargs)):
            self.write(0, t)
        return None

    def child_pre(self, module, args):
        """A root's child: autocast may be entered inside the root's forward."""
        self.note_autocast()
        return None

    def module_pre(self, name: str):
        if not self.rows:
            return None  # the module's hook returns at once while dynamo traces
        act, grad_in = self.index[(name, "activation")], self.index[(name, "grad_input")]

        def pre(module, args, kwargs):
            self.ran = True
            self.note_input_bad(act, float_tensors((args, kwargs)))
            probed = self.probe_all(grad_in, args)
            return None if probed is None else (probed, kwargs)
        return pre

    def module_post(self, name: str):
        if not self.rows:
            return None
        act, grad_out = self.index[(name, "activation")], self.index[(name, "grad_output")]

        def post(module, args, kwargs, output):
            for t in float_tensors(output):
                self.write(act, t)
            return self.probe_all(grad_out, output)
        return post
