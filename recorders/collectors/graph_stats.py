"""The cheap tier's rows of modules that run inside a compiled graph.

Dynamo traces the hooks of the modules under a `torch.compile` (the
recorder's hooks included, when they are registered before the first
compiled call). Where the eager hooks return at once while dynamo traces,
they call this collector's hooks instead, whose code is tensor operations
only: the compiler puts them in the graph, next to the code that makes each
tensor, and no Python runs per module per step.

Each row has a slot bound at attach time, a float64 tensor of its own on
the model's device: the model's `<input>`, each watched module's
`activation`, `grad_output` and `grad_input` (see `Probe`), each replaced
whole in place (`_put`, `_assign`), their layout in `recorders.graph_rows`.
`absmax` by max, the counts and `numel` by sum (micro-batches, calls and
the tensors of a tuple output add up, as eager rows merge); `seq` and
`enter` are a counter's values when a call ended and began (the rows'
order). The backward rows are written by `Probe`, an
identity autograd Function put on the module's outputs and inputs
(compiled path only: an eager step gets no autograd node of the recorder).
Every write is multiplied by `gate` (1: record, 0: a step not recorded or a
`paused()` pass), a tensor the host chooses, so that pausing and the tier
schedule never change what the graph does: no guard on a Python value, no
recompilation. The step's own row holds the micro-batches (root forwards
traced in the graph) and the autocast state as the trace saw it; the
counter is a tensor of its own.

Why a tensor per row, each replaced whole by `where` on its columns: an
indexed write into a shared buffer is a `select_scatter` (or a `stack` to
build the row), operations that AOT autograd's partitioner does not count
as fusible. Its "used far apart" rule then bans recomputing, in the
backward, any operation that reads the same tensor as a statistic and comes
later in the forward: on the benchmark GPT the partitioner stopped
recomputing GELU's derivative in the backward and saved it from the
forward in float32 instead. Whole-row `where`, `add` and `maximum` are
fusible, so the statistics leave the partition as it is without them
(`benchmarks/RESULTS.md`).

`rec.step()` takes the values (`take`: one copy, the buffers zeroed) when a graph
wrote it this step (`ran`, set by the traced hook: dynamo replays that
attribute store after each call of the graph) and it travels with the
step's one asynchronous copy; the writer thread turns its used slots into
rows (`recorders.graph_rows`, where the buffer's layout is defined).
"""
from __future__ import annotations

import math

import torch

from ..format import schema
from ..graph_rows import (ABSMAX, AUTOCAST_DEVICES, AUTOCAST_DTYPE, AUTOCAST_DEVICE, DTYPE, DTYPES, ENTER, INF,
                          INPUT_BAD, MICRO_BATCHES, NAN, NUMEL, SEQ, TENSORS, WIDTH)
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


def overflow_at(dtype) -> float:
    """The least magnitude that `dtype` stores as Inf: for float16 and
    bfloat16, halfway from the largest finite value to the next power of
    two (round to nearest even rounds it up); math.inf for the others."""
    if dtype in (torch.float16, torch.bfloat16):
        top = torch.finfo(dtype).max
        return top + (2.0 ** math.ceil(math.log2(top)) - top) / 2
    return math.inf


def magnitudes(d):
    """(|d|, |d| as compared, the bound it is compared with): the values
    `d`'s dtype stores as Inf are those of magnitude at least the bound.

    Inductor keeps a fused pointwise result in float32 and rounds it to the
    tensor's dtype only where it stores it, and a statistic fused into the
    same kernel reads the float32 value (`emulate_precision_casts` off, its
    default): a float16 product of 70000 is Inf in the tensor and finite to
    a comparison with inf. So float16 and bfloat16 magnitudes are compared
    in float32 with `overflow_at` (a Python number compared with a float16
    tensor would be cast to float16 first, and 65520 is Inf there): the
    counts are the stored values' whether the statistic reads the stored
    tensor or the unrounded one, as rounding is monotonic and rounded
    values lie on the same sides of the bound."""
    a = d.abs()
    bound = overflow_at(d.dtype)
    return a, (a.float() if bound != math.inf else a), bound


def nonfinite_counts(d):
    """The NaN and Inf counts of `d` as graph operations: `d != d` summed,
    and the Inf count as `nonfinite_total` less the NaN count (a NaN's
    magnitude is not below the bound either), in int32 (int64 past int32's
    range or for a symbolic size: `_count_dtype`, at trace time). Written
    so because inductor's CPU code for `isnan(d).sum()` and `isinf(d).sum()`
    (int64 sums of the masks) is not vectorised: on the benchmark GPT those
    counts were most of the 2.5x the in-graph rows cost; the comparisons and
    int32 sums fuse into the one pass that also takes the maximum
    (`benchmarks/RESULTS.md`). The comparison with the bound is the one the
    maximum and the next module's input count make: fused, the three share
    it, and the Inf count costs one scalar subtraction."""
    nan = (d != d).sum(dtype=_count_dtype(d))
    return nan, nonfinite_total(d) - nan


def nonfinite_total(d):
    """NaN and Inf together (`input_nonfinite`): the values whose magnitude
    is not below the bound (`magnitudes`), as the size less the count of
    those below it. One comparison and one sum; counting `~(m < bound)`
    instead costs a negation of the mask a value, which inductor's CPU code
    does not fold into the comparison (a compiled GELU over 2M bfloat16
    values with the statistics of its input and output, on an AMD Zen 5:
    0.46 ms of statistics with the negation, 0.38 without)."""
    _, m, bound = magnitudes(d)
    return d.numel() - (m < bound).sum(dtype=_count_dtype(d))


def _is_col(row, col: int):
    """True at column `col` of a row (fusible ops: no indexed write)."""
    return torch.arange(WIDTH, device=row.device) == col


def _col(row, col: int):
    """float64 1 at column `col` of a row, 0 elsewhere."""
    return _is_col(row, col).to(torch.float64)


def _put(row, col: int, value, new=None):
    """`new` (default `row`) with column `col` replaced by `value`, a tensor
    of one value: a `where` over the row, not an indexed write (see the
    module's docstring)."""
    return torch.where(_is_col(row, col), value, row if new is None else new)


def _assign(row, new) -> None:
    """`row.copy_(new)` for the finite values a row holds, written as
    `row.mul_(0).add_(new)`: a functional `copy` is an operation the
    partitioner does not fuse, and a row written twice in one graph (a
    module's call begins and ends; a module called twice) would put one
    between the statistics and the rest of the forward."""
    row.mul_(0).add_(new)


def write(row, gate, t, counter=None, input_bad=None) -> None:
    """Add the cheap statistics of `t` to `row` (a row tensor), times
    `gate` (tensor ops only); `counter`: advanced, and its value kept as
    the row's `seq`. One write of the row, whole: an indexed write would be
    an operation the partitioner does not fuse (the module's docstring)."""
    d = t.detach()
    # The same definitions as the eager rows (`stats._device_stats`):
    # counts of NaN and Inf, the largest finite magnitude, of the values as
    # `d`'s dtype stores them (`magnitudes`); one pass over `d` once the
    # compiler fuses the three reductions. The maximum is taken in `d`'s
    # dtype: an unrounded float32 maximum is rounded as the tensor's values
    # are (the largest rounded value is the rounded largest value).
    nan, inf = nonfinite_counts(d)
    a, m, bound = magnitudes(d)
    top = torch.where(m < bound, a, 0).amax().to(torch.float64)
    delta = (_col(row, NAN) * nan.to(torch.float64) + _col(row, INF) * inf.to(torch.float64)
             + _col(row, TENSORS) + _col(row, NUMEL) * d.numel())
    if input_bad is not None:
        delta = delta + _col(row, INPUT_BAD) * input_bad
    new = row + delta * gate
    new = _put(row, ABSMAX, torch.maximum(row[ABSMAX], top * gate), new)
    if counter is not None:
        counter.add_(gate)
        new = _put(row, SEQ, torch.where(gate > 0, counter, row[SEQ]), new)
    new = _put(row, DTYPE, torch.full((), _dtype_code(d.dtype), dtype=torch.float64, device=row.device), new)
    _assign(row, new)


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
        # made, so each step's `take` copies and zeroes the step's row only.
        for name in (watched if rows else ()):
            for kind in ("grad_output", "grad_input"):
                self.index[(name, kind)] = len(self.grad_slots)
                self.grad_slots.append((name, kind))
        self.device = torch.device(device)
        # A tensor per forward slot, then the step's own row (`fwd[-1]`),
        # and per gradient slot (the module's docstring says why).
        self.fwd = [torch.zeros(WIDTH, dtype=torch.float64, device=self.device) for _ in range(len(self.slots) + 1)]
        self.grads = [torch.zeros(WIDTH, dtype=torch.float64, device=self.device) for _ in self.grad_slots]
        # One value, not 0-d: under AOT autograd (torch 2.13) an in-place
        # change of a 0-d tensor held by a Python object was dropped, with
        # the writes that read it (seen with `aot_eager` and inductor).
        self.counter = torch.zeros(1, dtype=torch.float64, device=self.device)
        # Two constant tensors, the gate one of them: a gate changed in place
        # between a graph's forward and its backward (a `paused()` pass in
        # between) would make autograd refuse the backward (version check).
        self._gates = (torch.zeros((), dtype=torch.float64, device=self.device),
                       torch.ones((), dtype=torch.float64, device=self.device))
        self.gate_on = True  # which of them `gate` is (read at every step's start: `TrainingHooks.begin_step`)
        self.gate = self._gates[1]
        self.ran = False  # a traced hook ran since the last `take`

    @property
    def size(self) -> int:
        """Values `take` returns."""
        return (len(self.slots) + 1 + len(self.grad_slots)) * WIDTH

    # ------------------------------------------------------------- host
    def set_gate(self, on: bool) -> None:
        self.gate_on = bool(on)
        self.gate = self._gates[self.gate_on]

    def take(self):
        """The values written since the last take (one flat tensor on the
        rows' device: the forward rows, the step's row, then the gradient
        rows), the rows zeroed; None when no graph wrote them."""
        if not self.ran:
            return None
        self.ran = False
        rows = self.fwd + self.grads
        out = torch.cat(rows)  # a new tensor: zeroing the rows leaves it
        torch._foreach_zero_(rows + [self.counter])
        return out

    # ------------------------------------------------------ in the graph
    def write(self, slot: int, t) -> None:
        write(self.fwd[slot], self.gate, t, counter=self.counter)

    def note_input_bad(self, slot: int, tensors) -> None:
        """Add the NaN/Inf count of a call's inputs to `slot`'s
        `input_nonfinite`; mark where the call began (`ENTER`)."""
        row, gate, counter = self.fwd[slot], self.gate, self.counter
        counter.add_(gate)
        new = _put(row, ENTER, torch.where(gate > 0, counter, row[ENTER]))
        bad = None
        for t in tensors:
            n = nonfinite_total(t.detach()).to(torch.float64)
            bad = n if bad is None else bad + n
        if bad is not None:
            new = new + _col(row, INPUT_BAD) * (bad * gate)
        _assign(row, new)

    def note_autocast(self) -> None:
        """The autocast state as this trace runs (dynamo guards on it: a
        graph is traced per state), kept as the step's row's codes."""
        for i, dev in enumerate(AUTOCAST_DEVICES):
            try:
                on = torch.is_autocast_enabled(dev)
            except (RuntimeError, TypeError, AttributeError):
                continue
            if on:
                row = self.fwd[-1]
                code = torch.full((), _dtype_code(torch.get_autocast_dtype(dev)), dtype=torch.float64,
                                  device=row.device)
                where = torch.full((), float(i + 1), dtype=torch.float64, device=row.device)
                _assign(row, _put(row, AUTOCAST_DEVICE, where, _put(row, AUTOCAST_DTYPE, code)))
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
        step = self.fwd[-1]
        step.add_(_col(step, MICRO_BATCHES) * self.gate)
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
