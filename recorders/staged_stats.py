"""The cheap tier's statistics of small device tensors, reduced many at once.

On a GPU every tensor operation is a kernel launch, and where the device is
fast the host's time to launch them is the step (issue 27). The statistics
of one row by their definitions (`stats._device_stats`) are about twelve
operations; here a row costs one: its tensor is copied into a float32
staging buffer (exact for float16, bfloat16 and float32, NaN and Inf
included), and the rows staged since the last flush are reduced together by
a fixed number of operations (18) whatever their count (`_reduce`: segment
reductions over the buffer), once at the step's end or when the buffer is
full. A copy, not a reference kept: the tensor may be changed in place after
the hook (an in-place ReLU on a module's output) and no activation outlives
autograd's use of it.

The values are those of the general path bit for bit: the largest finite
magnitude (exact in float32, then float64; a scaled gradient's times the
same float64 reciprocal of the loss scale), the NaN and Inf counts (float32
sums of 0/1, exact below 2^24: a staged tensor has at most `MAX_NUMEL`
values). Nothing is read back: the row is a `StagedRow` whose `value` (a
float64 device vector) is set at the flush, and the step's rows travel in
its one asynchronous copy as before. The segment offsets and masks are
built on the host once per layout of a flush (the same rows every step) and
copied without a host sync (`_const`). On CUDA each one-dimensional
segment reduction is CUB's segmented reduce.

Tensors on the CPU keep the host path (`stats.cheap_host_stats`: their
values are there to read); float64 (not exact in float32), empty and large
tensors keep the general path, which for a large tensor costs launches that
its own kernels dwarf. `StatsStage(on_cpu=True)` stages CPU tensors too: the
tests' way to run this path without a GPU.
"""
from __future__ import annotations

import math
import weakref

import torch

from .format import schema
from .layout import local

STAGED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A tensor of more values takes the general path: its kernels take longer
# than their launches, and the counts' float32 sums stay exact (< 2^24).
MAX_NUMEL = 1 << 20
# The staging buffer, in values (float32): 16 MiB per device.
CAPACITY = 1 << 22
_CHEAP_WIDTH = len(schema.CHEAP_STATS)
_MAX_VIEWS = 1 << 14


class StagedRow:
    """A row whose statistics are in the stage; `value` (a float64 device
    vector of `schema.CHEAP_STATS`) once the stage is flushed."""

    __slots__ = ("value", "device")

    def __init__(self, device):
        self.value = None
        self.device = device

    def __len__(self) -> int:  # a cheap-tier row's width (`stats.pad_row`)
        return _CHEAP_WIDTH


class StatsStage:
    """Rows staged since the last `flush` (one owner: the training thread)."""

    def __init__(self, *, on_cpu: bool = False, capacity: int = CAPACITY, max_numel: int = MAX_NUMEL):
        self.on_cpu = on_cpu
        self.capacity = int(capacity)
        self.max_numel = min(int(max_numel), self.capacity)
        self._buffers: dict = {}  # device -> float32 buffer of `capacity` values
        self._device = None
        self._buffer = None
        self._views: dict = {}  # (start, shape) -> the buffer's view there
        self.rows: list[StagedRow] = []
        self._offsets: list[int] = [0]  # where each staged row starts, and the end of the last
        self._scaled: list[bool] = []
        self._scale = None  # the loss-scale tensor of this flush's scaled rows
        self._recent: dict = {}  # id(tensor) -> (weakref, version, scale, row): a tensor seen twice
        self._consts: dict = {}  # (device, kind, values) -> (device tensor, host tensor kept alive)
        self.staged = 0  # rows staged so far (tests, benchmarks)

    def put(self, t, scale=None) -> StagedRow | None:
        """Stage the cheap statistics of `t` (`scale`: a loss-scale tensor
        the magnitude is divided by, a gradient's unscaling); None when `t`
        is not staged (see the module's docstring)."""
        d = local(t)
        if d.dtype not in STAGED_DTYPES or (d.is_cpu and not self.on_cpu) or d.is_meta:
            return None
        n = d.numel()
        if n == 0 or n > self.max_numel:
            return None
        try:
            version = d._version
        except RuntimeError:  # an inference tensor: the general path
            return None
        key = id(d)
        hit = self._recent.get(key)
        if hit is not None and hit[1] == version and hit[2] is scale and hit[0]() is d:
            return hit[3]  # a container's output is its last child's: staged once
        device = d.device
        start = self._offsets[-1]  # the values staged so far
        if (device != self._device or start + n > self.capacity
                or (scale is not None and self._scale is not None and scale is not self._scale)):
            self.flush()
            if device != self._device:
                self._use(device)
            start = 0
        # The buffer's view for this place and shape, made once: the rows
        # come in the same order every step, and slicing a tensor costs
        # three times the copy.
        where = (start, d.shape)
        dst = self._views.get(where)
        if dst is None:
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            dst = self._views[where] = self._buffer[start:start + n].view(d.shape)
        # One kernel: the copy converts and gathers strides; detached, or
        # the buffer would join the autograd graph of a forward output.
        dst.copy_(d.detach() if d.requires_grad else d)
        row = StagedRow(device)
        self.staged += 1
        self.rows.append(row)
        self._offsets.append(start + n)
        self._scaled.append(scale is not None)
        if scale is not None:
            self._scale = scale
        try:
            self._recent[key] = (weakref.ref(d), version, scale, row)
        except TypeError:
            pass
        return row

    def flush(self) -> None:
        """Reduce the staged rows and set their values (device work only)."""
        rows = self.rows
        if not rows:
            return
        starts, scaled, scale = self._offsets, self._scaled, self._scale
        self.rows, self._offsets, self._scaled, self._scale = [], [0], [], None
        self._recent = {}
        device = self._device
        mask = self._const(device, torch.bool, scaled) if scale is not None else None
        # Offsets, not lengths: CUDA's segment_reduce would otherwise build
        # them on the device, three more launches per reduction.
        offsets = self._const(device, torch.int64, starts)
        values = _reduce(self._buffer[:starts[-1]], offsets, mask, scale)
        for row, v in zip(rows, values.unbind(0)):
            row.value = v

    def _use(self, device) -> None:
        buf = self._buffers.get(device)
        if buf is None:
            buf = self._buffers[device] = torch.empty(self.capacity, dtype=torch.float32, device=device)
        self._device, self._buffer = device, buf
        self._views = {}

    def _const(self, device, dtype, values: list):
        """`values` as a tensor on `device`, built once per distinct list:
        a flush's layout repeats every step. The first copy goes from
        pinned memory without waiting (`torch.tensor(..., device=cuda)`
        would synchronise); the host tensor is kept with it, alive for the
        copy."""
        key = (device, dtype, tuple(values))
        hit = self._consts.get(key)
        if hit is not None:
            return hit[0]
        host = torch.tensor(values, dtype=dtype)
        if device.type == "cpu":
            dev = host
        else:
            if device.type == "cuda":
                host = host.pin_memory()
            dev = host.to(device, non_blocking=True)
        if len(self._consts) >= 64:  # layouts that keep changing: bounded
            self._consts.clear()
        self._consts[key] = (dev, host)
        return dev


def _reduce(x, offsets, mask, scale):
    """The cheap statistics of each segment of `x` (float32; a segment's
    values run from one of `offsets` to the next) as a float64 (segments,
    4) tensor, the definitions of `stats._device_stats`: the largest
    finite magnitude (times the float64 reciprocal of `scale` where
    `mask`), the NaN count, the Inf count and a null `input_nonfinite`.
    `unsafe=True`: the offsets are ours, and checking them reads them back
    (a host sync)."""
    a = x.abs()
    top = torch.segment_reduce(torch.nan_to_num(a, nan=0.0, posinf=0.0), "max", offsets=offsets, unsafe=True)
    # One-dimensional reductions each: CUDA's segment_reduce takes CUB's
    # segmented reduction for those, a thread per segment otherwise.
    nan = torch.segment_reduce((x != x).to(torch.float32), "sum", offsets=offsets, unsafe=True)
    inf = torch.segment_reduce((a == math.inf).to(torch.float32), "sum", offsets=offsets, unsafe=True)
    absmax = top.to(torch.float64)
    if scale is not None:
        absmax = torch.where(mask, absmax * scale.detach().to(torch.float64).reciprocal(), absmax)
    return torch.stack([absmax, nan.to(torch.float64), inf.to(torch.float64), torch.full_like(absmax, math.nan)],
                       dim=1)
