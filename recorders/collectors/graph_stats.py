"""The cheap tier's rows of modules that run inside a compiled graph.

Dynamo traces the hooks of the modules under a `torch.compile` (the
recorder's hooks included, when they are registered before the first
compiled call). Where the eager hooks return at once while dynamo traces,
they call this collector's hooks instead, whose code is tensor operations
only: the compiler puts them in the graph, next to the code that makes each
tensor, and no Python runs per module per step.

Each row has a slot bound at attach time (a watched module's `activation`,
`grad_output` and `grad_input`, and the model's `<input>`) in one float64
buffer on the model's device, written in place:

    absmax, nan_count, inf_count, input_nonfinite, tensors, numel, seq, dtype

`absmax` by max, the counts and `numel` by sum (micro-batches, calls and
the tensors of a tuple output add up, as eager rows merge); `seq` is the
value of a counter every write advances (the row's place in the graph's
execution order), `dtype` a code (`DTYPES`). The backward rows are written
by `Probe`, an identity autograd Function put on the module's outputs and
inputs (compiled path only: an eager step gets no autograd node of the
recorder). Every write is multiplied by `gate` (1: record, 0: a step not
recorded or a `paused()` pass), a tensor the host fills, so that pausing and
the tier schedule never change what the graph does: no guard on a Python
value, no recompilation. The last buffer row holds the counter, the
micro-batches (root forwards traced in the graph) and the autocast state as
the trace saw it.

`rec.step()` takes the buffer (`take`: one clone, one zero) when a graph
wrote it this step (`ran`, set by the traced hook: dynamo replays that
attribute store after each call of the graph) and it travels with the
step's one asynchronous copy; the writer thread turns its used slots into
rows (`graph_rows`).
"""
from __future__ import annotations

import math

import torch

from .. import schema
from ..aggregate import COUNT_KIND as _COUNT_KIND
from ..stats import float_tensors

WIDTH = 9
ABSMAX, NAN, INF, INPUT_BAD, TENSORS, NUMEL, SEQ, DTYPE, ENTER = range(WIDTH)
# Codes of the dtypes a row may have (0: none seen); also autocast's.
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")
AUTOCAST_DEVICES = ("cuda", "cpu", "xpu", "mps")
# Columns of the forward buffer's last row (the step's own).
COUNTER, MICRO_BATCHES, AUTOCAST_DTYPE, AUTOCAST_DEVICE = range(4)


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
    would make autograd refuse them. The gate is a copy, for the same
    reason (`paused()` may change it in between)."""

    @staticmethod
    def forward(ctx, x, row, gate):
        ctx.row = row
        ctx.gate = gate.clone()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        write(ctx.row, ctx.gate, grad)
        return grad, None, None


def write(row, gate, t, counter=None, input_bad=None) -> None:
    """Add the cheap statistics of `t` to `row` (a buffer row), times
    `gate` (tensor ops only); `counter`: advanced, and its value kept as
    the row's `seq`."""
    d = t.detach()
    # The same definitions as the eager rows (`stats._device_stats`):
    # counts of NaN and Inf, the largest finite magnitude.
    nan = torch.isnan(d).sum().to(torch.float64)
    inf = torch.isinf(d).sum().to(torch.float64)
    top = torch.nan_to_num(d.abs(), nan=0.0, posinf=0.0, neginf=0.0).amax().to(torch.float64)
    one = torch.ones((), dtype=torch.float64, device=row.device)
    bad = input_bad if input_bad is not None else torch.zeros((), dtype=torch.float64, device=row.device)
    row[ABSMAX].copy_(torch.maximum(row[ABSMAX], top * gate))
    row[NAN:SEQ].add_(torch.stack([nan, inf, bad, one, one * d.numel()]) * gate)
    if counter is not None:
        counter.add_(gate)
        row[SEQ].copy_(torch.where(gate > 0, counter, row[SEQ]))
    row[DTYPE].fill_(_dtype_code(d.dtype))


class GraphStats:
    """`watched`: the watched module names ("" the model); `device`: where
    the buffers live (the model's parameters')."""

    def __init__(self, watched: list[str], device):
        self.slots: list[tuple[str, str]] = [(schema.INPUT_NAME, "input")]
        self.index: dict[tuple[str, str], int] = {}
        for name in watched:
            self.index[(name, "activation")] = len(self.slots)
            self.slots.append((name, "activation"))
        self.grad_slots: list[tuple[str, str]] = []
        for name in watched:
            for kind in ("grad_output", "grad_input"):
                self.index[(name, kind)] = len(self.grad_slots)
                self.grad_slots.append((name, kind))
        self.device = torch.device(device)
        self.buffer = torch.zeros(len(self.slots) + 1, WIDTH, dtype=torch.float64, device=self.device)
        self.grads = [torch.zeros(WIDTH, dtype=torch.float64, device=self.device) for _ in self.grad_slots]
        self.gate = torch.ones((), dtype=torch.float64, device=self.device)
        self._gate_on = True
        self.ran = False  # a traced hook ran since the last `take`

    @property
    def size(self) -> int:
        """Values `take` returns."""
        return (len(self.slots) + 1 + len(self.grad_slots)) * WIDTH

    # ------------------------------------------------------------- host
    def set_gate(self, on: bool) -> None:
        if on != self._gate_on:
            self._gate_on = on
            self.gate.fill_(1.0 if on else 0.0)

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
            d = t.detach()
            n = (torch.isnan(d).sum() + torch.isinf(d).sum()).to(torch.float64)
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
        for t in float_tensors((args, kwargs)):
            self.write(0, t)
        return None

    def child_pre(self, module, args):
        """A root's child: autocast may be entered inside the root's forward."""
        self.note_autocast()
        return None

    def module_pre(self, name: str):
        act, grad_in = self.index[(name, "activation")], self.index[(name, "grad_input")]

        def pre(module, args, kwargs):
            self.ran = True
            self.note_input_bad(act, float_tensors((args, kwargs)))
            probed = self.probe_all(grad_in, args)
            return None if probed is None else (probed, kwargs)
        return pre

    def module_post(self, name: str):
        act, grad_out = self.index[(name, "activation")], self.index[(name, "grad_output")]

        def post(module, args, kwargs, output):
            for t in float_tensors(output):
                self.write(act, t)
            return self.probe_all(grad_out, output)
        return post


# ------------------------------------------------------------ writer thread
def autocast_info(stats: GraphStats, values) -> dict | None:
    """The autocast state a traced graph saw (None: not traced in a graph,
    or autocast off there: the eager reading stands)."""
    last = values[len(stats.slots) * WIDTH:(len(stats.slots) + 1) * WIDTH]
    code, dev = int(last[AUTOCAST_DTYPE]), int(last[AUTOCAST_DEVICE])
    if not code or not dev:
        return None
    return {"enabled": True, "device_type": AUTOCAST_DEVICES[dev - 1], "dtype": DTYPE_NAMES[code - 1],
            "cache_enabled": None}


def graph_rows(stats: GraphStats, values, width: int) -> tuple[list, list, int]:
    """(meta, stats rows of `width`, micro-batches traced in the graph) of
    the used slots of one step's values (`GraphStats.take`, as a float64
    array). A sort key stands in the `order` field (the caller ranks it
    among the step's eager rows): forward rows by when their call ended;
    backward rows by the reverse of their module's forward (the gradient
    reaching a module's output comes when its forward's end is undone, the
    one it hands its inputs when its beginning is). A `grad_input` row's
    `input_nonfinite` is the NaN/Inf count of the gradients its module's
    outputs received (its `grad_output` slot), as in eager rows."""
    n = len(stats.slots) + 1
    fwd = values[: n * WIDTH].reshape(n, WIDTH)
    bwd = values[n * WIDTH:].reshape(-1, WIDTH)
    used = {}
    for (name, kind), v in list(zip(stats.slots, fwd)) + list(zip(stats.grad_slots, bwd)):
        if v[TENSORS] > 0:
            used[(name, kind)] = v
    pad = (math.nan,) * (width - 4)
    meta, rows = [], []
    for (name, kind), v in used.items():
        act = fwd[stats.index[(name, "activation")]] if kind in ("grad_output", "grad_input") else None
        if kind == "activation":
            phase, key, bad = "forward", float(v[SEQ]), float(v[INPUT_BAD])
        elif kind == "input":
            phase, key, bad = "forward", float(v[SEQ]), math.nan
        elif kind == "grad_output":
            phase, key, bad = "backward", -float(act[SEQ]), math.nan
        else:
            out = used.get((name, "grad_output"))
            phase, key = "backward", -float(act[ENTER])
            bad = float(out[NAN] + out[INF]) if out is not None else math.nan
        code = int(v[DTYPE])
        meta.append((name, kind, phase, key, 0, DTYPE_NAMES[code - 1] if code else None, int(v[NUMEL]), None))
        rows.append((float(v[ABSMAX]), float(v[NAN]), float(v[INF]), bad) + pad)
    return meta, rows, int(fwd[-1][MICRO_BATCHES])


def with_graph_rows(meta: list, rows, gmeta: list, grows: list, fwd_anchor) -> tuple[list, object]:
    """The step's eager rows (`meta`, `rows`: an array) and its graph rows
    together, every row's `order` its rank in the step's execution order,
    per phase. The graph's forward rows come before the eager forward row
    of order `fwd_anchor` (the order the eager root's inputs left off at;
    None: before every eager one: the root ran in the graph); its backward
    rows before the eager parameter gradients (their hooks run after the
    compiled backward) and after any other eager backward row (the
    gradient reaching an eager root's output, which reaches the graph
    next)."""
    import numpy as np

    param_orders = [m[3] for m in meta if m[1] == "param_grad"]
    other_bwd = [m[3] for m in meta if m[2] == "backward" and m[1] != "param_grad"]
    bwd_anchor = min(param_orders) if param_orders else (max(other_bwd) + 1 if other_bwd else 0)
    anchors = {"forward": 0 if fwd_anchor is None else fwd_anchor, "backward": bwd_anchor}
    # (eager order, 1, 0) and (anchor, 0, seq): dense ranks of the keys
    keys = [None if m[1] == _COUNT_KIND else (m[3], 1, 0.0) for m in meta]
    keys += [(anchors[m[2]], 0, m[3]) for m in gmeta]
    all_meta = list(meta) + list(gmeta)
    out = []
    for phase in ("forward", "backward"):
        ranks = {k: r for r, k in enumerate(sorted({k for k, m in zip(keys, all_meta)
                                                    if k is not None and m[2] == phase}))}
        for i, (k, m) in enumerate(zip(keys, all_meta)):
            if m[2] == phase and k is not None:
                keys[i] = ranks[k]
    for k, m in zip(keys, all_meta):
        out.append(m if k is None else (m[0], m[1], m[2], int(k)) + tuple(m[4:]))
    extra = np.asarray(grows, dtype=np.float64).reshape(len(grows), -1)
    return out, np.concatenate([np.asarray(rows).reshape(-1, extra.shape[1]), extra])
