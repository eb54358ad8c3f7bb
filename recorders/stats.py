"""Device-side statistics of one tensor, as a small float64 vector.

Everything here enqueues device work and returns a device tensor: no
`.item()`, no `.cpu()`, no Python branch on a tensor value, so a hook that
calls these never waits for the GPU. The caller stacks the vectors of a
step and copies them out once.

The one exception is host memory: a CPU tensor's ops have finished when
they return, so reading a value back waits for nothing. On the CPU,
`tensor_stats` first takes one `aminmax` pass; when every value is finite
(almost always) the NaN/Inf counts are zero and the finite maximum is
known without the counting passes, and the full tier skips the threshold
counts that the extremes prove to be zero. A tensor with a NaN or Inf goes
through the general path, which computes the same statistics by their
definitions. A tensor seen twice (a container module's output is its last
child's; one gradient reaches both) is summarised once (see `_Memo`).

The full tier's threshold shares (zero, below normal, below subnormal,
near overflow) are counted on a fixed, evenly strided sample of at most
`schema.SHARE_SAMPLE_MAX` values (`share_sample`): each share is one
comparison pass, and over every value of every tensor they made the full
tier cost more than twice the step. absmax, the NaN/Inf counts, min, max,
mean and rms cover every value; mean and rms are summed in the working
dtype (float32 for 16-bit tensors), over the values divided by their
largest magnitude when their squares could overflow (`_mean_rms`: a tenth
of the cost of float64 sums on the CPU; relative error ~1e-6).

The cheap tier of a small tensor on a GPU does not come here: its rows
are staged and reduced together (`staged_stats`), to the same values.

Layout of the vector follows `schema.CHEAP_STATS` / `schema.FULL_STATS`.
"""
from __future__ import annotations

import functools
import math
import threading
import weakref
from collections import OrderedDict

import numpy as np
import torch

from .format import schema
from .format.tensors import iter_tensors
from .layout import PLAIN_TENSORS, local
from .staged_stats import StagedRow

CHEAP_WIDTH = len(schema.CHEAP_STATS)
FULL_WIDTH = len(schema.FULL_STATS)
_INPUT_NONFINITE = schema.CHEAP_STATS.index("input_nonfinite")

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_float_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in _FLOATING and x.numel() > 0


def share_sample(d: torch.Tensor) -> torch.Tensor:
    """The values the threshold shares are counted on: all of them up to
    `schema.SHARE_SAMPLE_MAX`, else every `stride`-th value in row-major
    order from the first, stride = ceil(numel / SHARE_SAMPLE_MAX). The
    positions depend on the shape only, so each step samples the same
    ones and a share's trend compares like with like."""
    n = d.numel()
    if n <= schema.SHARE_SAMPLE_MAX:
        return d
    stride = -(-n // schema.SHARE_SAMPLE_MAX)
    # A view of a contiguous tensor: no copy. Otherwise reshape copies,
    # which only the full tier pays.
    return d.reshape(-1)[::stride]


def float_tensors(obj) -> list:
    """The non-empty floating-point tensors of `iter_tensors(obj)`, as a
    list; the usual call arguments (a tuple of tensors, no keywords) without
    the generator's recursion."""
    if type(obj) is tuple and len(obj) == 2 and type(obj[1]) is dict and not obj[1] \
            and type(obj[0]) is tuple:
        obj = obj[0]  # (args, {}) from a forward pre-hook
        if len(obj) == 1 and type(obj[0]) in PLAIN_TENSORS:  # one tensor argument: most calls
            t = obj[0]
            return [t] if t.dtype in _FLOATING and t.numel() > 0 else []
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.dtype in _FLOATING and obj.numel() > 0 else []
    if type(obj) is tuple and all(isinstance(v, torch.Tensor) for v in obj):
        return [v for v in obj if v.dtype in _FLOATING and v.numel() > 0]
    return [t for t in iter_tensors(obj) if is_float_tensor(t)]


def nonfinite_count(t: torch.Tensor) -> torch.Tensor:
    """Count of NaN/Inf values as a 0-d float64 device tensor."""
    d = local(t.detach())
    if d.device.type == "cpu" and d.dtype in _FLOATING and d.numel():
        # Host memory: one reduction decides the usual all-finite case.
        mn, mx = torch.aminmax(d)
        if math.isfinite(float(mn)) and math.isfinite(float(mx)):
            return torch.zeros((), dtype=torch.float64)
    return (~torch.isfinite(d)).sum().to(torch.float64)


def row_stats(t: torch.Tensor, *, full: bool, scale: torch.Tensor | None = None,
              unscale: bool = False, near_overflow: float = schema.FP16_MAX):
    """Statistics of `t` for one row, `input_nonfinite` left null (the
    writer thread fills it from the rows that produced the inputs): a tuple
    of floats when computed on the host, else a float64 device tensor.
    `pack_rows` turns a step's rows into one tensor at once, where a tensor
    per row cost more than the statistics of a small tensor. The result
    may be shared with other rows (memo). A tuple, not a list: the garbage
    collector stops tracking a tuple of floats at its first collection, so
    a step's ~1,000 rows are never promoted to the old generation, whose
    growth sets off full collections (4.7 ms a step, amortised, on the
    launch-bound benchmark when they were lists).

    `scale`/`unscale`: the gradient is multiplied by the loss scale; with
    `unscale` the value statistics are divided by it (param grads are
    reported unscaled) while the float16 threshold shares are still taken on
    the unscaled values, by comparing against thresholds times the scale.

    A sharded tensor (DTensor) is summarised as this rank's local shard;
    an empty shard has count 0 and NaN (null) extremes.
    """
    if not full and scale is None and type(t) in PLAIN_TENSORS and t.is_cpu:
        values = cheap_host_stats(t)
        if values is not None:
            return values
    t = local(t)
    # Detached only where autograd would record the reduction (a forward
    # output); a gradient seen in backward needs no new tensor object.
    d = t.detach() if t.requires_grad else t
    if d.numel() == 0:
        return _empty_stats(full, d.device)
    scale_used = scale if unscale else None
    key = _memo.key(t, full, scale_used, near_overflow)
    cached = _memo.get(t, scale_used, key)
    if cached is not None:
        return cached
    if _on_host(d, None, scale_used):
        values = _host_stats(d, full, scale_used, near_overflow)
        if values is None:
            # Host memory: the general path's result is ready to read.
            values = tuple(_device_stats(d, full, None, scale_used, near_overflow).tolist())
        _memo.put(t, scale_used, key, values)
        return values
    vec = _device_stats(d, full, None, scale_used, near_overflow)
    _memo.put(t, scale_used, key, vec)
    return vec


def cheap_host_stats(t):
    """`row_stats` of the usual row: the cheap tier of a plain CPU tensor,
    no loss scale. The same values and definitions as the general path
    (`_host_stats`), without its calls and checks: this runs for most of
    the ~1,000 rows of a step, so it keeps a memo of its own (`_recent`: a
    dict by id, each entry checked by a weak reference and the version
    counter, emptied when it grows) rather than the general one's keyed,
    ordered entries. None: take the general path (an inference tensor, an
    empty or a non-float one)."""
    try:
        version = t._version
    except RuntimeError:  # inference tensors have no version counter
        return None
    hit = _recent.get(id(t))
    if hit is not None and hit[1] == version and hit[0]() is t:
        return hit[2]
    d = t.detach() if t.requires_grad else t
    if d.dtype not in _FLOATING or d.numel() == 0:
        return None
    mn_t, mx_t = torch.aminmax(d)
    mn, mx = mn_t.item(), mx_t.item()
    if _isfinite(mn) and _isfinite(mx):
        values = (max(abs(mn), abs(mx)), 0.0, 0.0, _NAN)
    else:
        values = _host_nonfinite_stats(d, False, None)  # never None at the cheap tier
    if len(_recent) >= _RECENT_MAX:
        _recent.clear()
    try:
        _recent[id(t)] = (weakref.ref(t), version, values)
    except TypeError:
        pass
    return values


# The last tensors `cheap_host_stats` summarised: a container's output is
# its last child's, one gradient reaches several hooks.
_recent: dict = {}
_RECENT_MAX = 32
_isfinite = math.isfinite
_NAN = math.nan


def _empty_stats(full, device):
    """An empty tensor (a rank's empty shard of an unevenly sharded one):
    no NaN, no Inf, every magnitude and share null."""
    vec = torch.full((FULL_WIDTH if full else CHEAP_WIDTH,), math.nan, dtype=torch.float64, device=device)
    vec[1] = 0.0
    vec[2] = 0.0
    return vec


def tensor_stats(t: torch.Tensor, *, full: bool, input_nonfinite=None,
                 scale: torch.Tensor | None = None, unscale: bool = False,
                 near_overflow: float = schema.FP16_MAX) -> torch.Tensor:
    """Statistics vector of `t` as a float64 tensor on its device, with
    `input_nonfinite` (a 0-d tensor, or None: null) in its slot. See
    `row_stats` for the other options."""
    stats = row_stats(t, full=full, scale=scale, unscale=unscale, near_overflow=near_overflow)
    return _with_input(stats, input_nonfinite, t.device)


def pad_row(stats, width: int):
    """A row widened to `width` with nulls (a cheap-tier row in a full-tier
    step)."""
    missing = width - len(stats)
    if missing <= 0:
        return stats
    if isinstance(stats, tuple):
        return stats + (math.nan,) * missing
    return torch.cat([stats, torch.full((missing,), math.nan, dtype=stats.dtype, device=stats.device)])


def pack_rows(rows: list) -> torch.Tensor:
    """A step's rows (equal widths) as one flat float64 tensor: host rows
    in one call, device rows stacked on their device (no host round trip);
    a staged row (`staged_stats.StagedRow`) by its value, set when the
    stage was flushed."""
    device = next((r.device for r in rows if isinstance(r, (torch.Tensor, StagedRow))), None)
    if device is None:
        return torch.tensor(rows, dtype=torch.float64).reshape(-1)
    return torch.stack([r if isinstance(r, torch.Tensor) else r.value if type(r) is StagedRow
                        else torch.tensor(r, dtype=torch.float64, device=device) for r in rows]).reshape(-1)


def _device_stats(d, full, input_nonfinite, scale, near_overflow):
    """The statistics by their definitions, as device work only."""
    a = d.abs()
    nan = torch.isnan(d).sum()
    inf = torch.isinf(d).sum()
    # NaN/Inf are counted separately; the magnitude statistics describe the
    # finite values so that headroom stays meaningful in a step with one Inf.
    finite_abs = torch.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)
    top = finite_abs.amax()  # in d's dtype; the full tier's mean and rms reuse it
    absmax = top.to(torch.float64)
    inv = None
    if scale is not None:
        inv = scale.to(torch.float64).reciprocal()
        absmax = absmax * inv
    if input_nonfinite is None:
        inp = torch.full((), math.nan, dtype=torch.float64, device=d.device)
    else:
        inp = input_nonfinite.to(device=d.device, dtype=torch.float64)
    parts = [absmax, nan.to(torch.float64), inf.to(torch.float64), inp]
    if full:
        parts.extend(_full_stats(d, finite_abs, top, inv, scale, near_overflow))
    return torch.stack(parts)


def _full_stats(d, finite_abs, top, inv, scale, near_overflow):
    work = torch.float64 if d.dtype == torch.float64 else torch.float32
    x = d.to(work)
    fin = torch.isfinite(x)
    n = d.numel()
    n_fin = fin.sum().to(torch.float64)
    xf = torch.where(fin, x, torch.zeros((), dtype=work, device=x.device))
    inf_t = torch.full((), math.inf, dtype=work, device=x.device)
    mn = torch.where(fin, x, inf_t).amin().to(torch.float64)
    mx = torch.where(fin, x, -inf_t).amax().to(torch.float64)
    top = top.to(work)  # exact: a value of d
    one = torch.ones((), dtype=work, device=x.device)
    top = torch.where(top.to(torch.float64) ** 2 * n > SQUARES_SAFE, top, one)
    mean, rms = _mean_rms(xf, top, n_fin, scratch=True)
    # No finite value: min/max would be +-inf; report NaN (null) instead.
    nan_t = torch.full((), math.nan, dtype=torch.float64, device=x.device)
    mn = torch.where(n_fin > 0, mn, nan_t)
    mx = torch.where(n_fin > 0, mx, nan_t)
    sample = share_sample(d)
    m = sample.numel()
    a = share_sample(finite_abs).to(work)
    normal, sub, over = fp16_thresholds(scale, work, near_overflow)
    nonzero = a > 0
    zero = (sample == 0).sum().to(torch.float64) / m
    below_normal = (nonzero & (a < normal)).sum().to(torch.float64) / m
    below_sub = (nonzero & (a < sub)).sum().to(torch.float64) / m
    near = (a >= over).sum().to(torch.float64) / m
    if inv is not None:
        mn, mx, mean, rms = mn * inv, mx * inv, mean * inv, rms * inv
    size = torch.full((), float(m), dtype=torch.float64, device=x.device)
    return [mn, mx, mean, rms, zero, below_normal, below_sub, near, size]


SQUARES_SAFE = schema.SQUARES_SAFE  # no sum of squares below it can overflow float32


def _mean_rms(x, top, n, *, scratch: bool, divide: bool = True):
    """Mean and root mean square of `x` (finite values only; `n` of them,
    an int or a float64 0-d tensor), from sums in the working dtype over
    `x / top`, `top` a 0-d tensor of it: 1 when the squares cannot overflow
    (`SQUARES_SAFE`), else the largest magnitude. float32 sums cost a tenth of
    float64 ones on the CPU (converting every value), which made the full
    tier cost more than the step. `scratch`: `x` is a temporary of the
    caller's that may be overwritten (a large buffer fewer: allocating them
    cost as much as the sums); `divide=False` (top is 1, `x` contiguous):
    x / 1 is x, bit for bit, so the pass is skipped. Both paths
    (definitions and host) get equal contiguous operands here, hence the
    same bits."""
    y = x if not divide else x.div_(top) if scratch else x / top
    t = top.to(torch.float64)
    mean = y.sum().to(torch.float64) * t / n
    # Squares summed by the CPU's cascade summation (relative error ~1e-7);
    # vector_norm and dot accumulate plainly in float32 (~1e-5 at 10^5 values).
    if scratch:
        sq = y.mul_(y)
    else:
        out = _scratch.like(y) if y.is_contiguous() else None
        sq = y * y if out is None else torch.mul(y, y, out=out)  # the same products, bit for bit
    rms = torch.sqrt(sq.sum().to(torch.float64) / n) * t
    return mean, rms


def _host_mean_rms(x, top, n: int, *, scratch: bool, divide: bool):
    """`_mean_rms` of a CPU tensor as floats, bit for bit: the same
    float32 sums, then the same float64 arithmetic in Python floats rather
    than 0-d tensor ops (seven of them were a third of the full tier's
    cost on a small tensor). `top`: None for 1 (nothing to divide by), else
    a 0-d tensor of the working dtype."""
    if top is None:
        t = 1.0
        y = x if not divide else x.div_(1.0) if scratch else x / torch.ones((), dtype=x.dtype)
    else:
        t = float(top)
        y = x if not divide else x.div_(top) if scratch else x / top
    mean = float(y.sum()) * t / n
    if scratch:
        sq = y.mul_(y)
    else:
        out = _scratch.like(y) if y.is_contiguous() else None
        sq = y * y if out is None else torch.mul(y, y, out=out)
    # torch's sqrt, not math.sqrt: the definitions' (it differs in the last
    # bit for ~0.6% of values here; the rows must not depend on the path).
    rms = float(torch.sqrt(torch.tensor(float(sq.sum()) / n, dtype=torch.float64))) * t
    return mean, rms


class _Scratch(threading.local):
    """A reusable buffer per thread for the full tier's host temporaries
    (the float32 copy of a 16-bit tensor, the squares): a fresh buffer of a
    few MiB is new pages from the OS every time, and their first touch cost
    more than the arithmetic (the squares of a 2 MiB tensor: 0.4 ms fresh,
    0.08 ms in a buffer used before). Tensors above `MAX_BYTES` get fresh
    buffers, so the buffer stays bounded."""

    MAX_BYTES = 32 << 20

    def __init__(self):
        self.buffers: dict = {}  # dtype -> flat tensor

    def like(self, t, dtype=None):
        """A contiguous tensor of `t`'s shape in `dtype` (default t's), its
        values undefined; None when it would exceed the bound."""
        dtype = dtype or t.dtype
        n = t.numel()
        if n * _ITEM_BYTES[dtype] > self.MAX_BYTES:
            return None
        buf = self.buffers.get(dtype)
        if buf is None or buf.numel() < n:
            buf = self.buffers[dtype] = torch.empty(n, dtype=dtype)
        return buf[:n].view(t.shape)


_scratch = _Scratch()
_ITEM_BYTES = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4, torch.float64: 8}


# ------------------------------------------------------------ host fast path
def fp16_thresholds(scale, work, near_overflow):
    """The float16 normal, subnormal and near-overflow limits, in the units
    of the tensor: |g/scale| < t  <=>  |g| < t*scale for a scaled gradient."""
    normal, sub, over = schema.FP16_MIN_NORMAL, schema.FP16_MIN_SUBNORMAL, near_overflow
    if scale is not None:
        s = scale.to(work)
        normal, sub, over = normal * s, sub * s, over * s
    return normal, sub, over


def _on_host(d, input_nonfinite, scale) -> bool:
    return (d.is_cpu
            and (input_nonfinite is None or input_nonfinite.is_cpu)
            and (scale is None or scale.is_cpu))


def _work_float(value, work) -> float:
    """`value` (a float or a 0-d tensor) rounded to the working dtype, as
    the general path's comparisons see it."""
    if isinstance(value, float):
        return _work_float_cached(value, work)
    return float(value.to(work))


@functools.lru_cache(maxsize=64)
def _work_float_cached(value: float, work) -> float:
    return float(torch.tensor(value, dtype=torch.float64).to(work))


def _host_stats(d, full, scale, near_overflow):
    """Statistics of a CPU tensor (see `_host_nonfinite_stats` for one with a
    NaN or an Inf; None sends it to the general path). Same definitions and the same floating-point
    operations as `_device_stats`; passes whose result the extremes decide
    (every |x| above a threshold, or none) are skipped."""
    if d.dtype not in _FLOATING or d.numel() == 0:
        return None
    mn_t, mx_t = torch.aminmax(d)
    mn, mx = float(mn_t), float(mx_t)
    if not (math.isfinite(mn) and math.isfinite(mx)):
        return _host_nonfinite_stats(d, full, scale)
    absmax_w = max(abs(mn), abs(mx))  # exact in the working dtype
    absmax = absmax_w
    inv = None
    if scale is not None:
        inv = 1.0 / float(scale.to(torch.float64))
        absmax = absmax * inv
    if not full:
        return (absmax, 0.0, 0.0, math.nan)
    work = torch.float64 if d.dtype == torch.float64 else torch.float32
    if d.dtype == work:
        x = d
    else:  # a copy: into the thread's buffer when d is contiguous (d.to(work)'s values and layout)
        x = _scratch.like(d, work) if d.is_contiguous() else None
        x = d.to(work) if x is None else x.copy_(d)
    n = d.numel()
    big = absmax_w * absmax_w * n > SQUARES_SAFE
    top = torch.tensor(absmax_w, dtype=work) if big else None
    mean, rms = _host_mean_rms(x, top, n, scratch=x is not d, divide=big or not x.is_contiguous())
    normal, sub, over = fp16_thresholds(scale, work, near_overflow)
    a = share_sample(d).to(work).abs()  # x is overwritten; upcasting is exact
    m = a.numel()
    absmin = float(a.amin())
    # The extremes of every value bound the sample's: none of them near
    # overflow means none in the sample either.
    zeros = 0 if absmin > 0 else int(torch.count_nonzero(a == 0))

    def below(threshold):
        # Non-zero values with |x| < threshold: every |x| >= threshold
        # (the smallest included) means none.
        if absmin >= _work_float(threshold, work):
            return 0
        return int(torch.count_nonzero(a < threshold)) - zeros

    below_normal = below(normal)
    # Below the subnormal limit implies below the normal one: none of the
    # latter, none of the former.
    below_sub = 0 if below_normal == 0 and _work_float(sub, work) <= _work_float(normal, work) \
        else below(sub)
    near = 0 if absmax_w < _work_float(over, work) else int(torch.count_nonzero(a >= over))
    if inv is not None:
        mn, mx, mean, rms = mn * inv, mx * inv, mean * inv, rms * inv
    return (absmax, 0.0, 0.0, math.nan, mn, mx, mean, rms,
            zeros / m, below_normal / m, below_sub / m, near / m, float(m))


# Floating dtype -> (integer dtype of its size, mask of all bits but the
# sign, the exponent's bits): a NaN's bits (sign dropped) exceed them.
_NAN_BITS = {
    torch.float16: (torch.int16, 0x7FFF, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
    torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000),
}


def _all_nan(d) -> bool:
    """Every value of the CPU tensor `d` is a NaN, read off its bit
    patterns as integers: one `aminmax` pass, no allocation, when the NaNs
    share a sign (computed NaNs are negative on x86), else the smallest
    pattern without the sign. The boolean passes (`isnan` and a count)
    cost ~8 times as much here, on every tensor of every step once a job
    has diverged."""
    spec = _NAN_BITS.get(d.dtype)
    if spec is None:
        return bool(torch.isnan(d).all())
    itype, mask, exponent = spec
    bits = d.view(itype)
    lo, hi = (int(v) for v in torch.aminmax(bits))
    if lo >= 0:  # every sign bit clear: positive NaNs lie above +Inf's pattern
        return lo > exponent
    if hi < 0:  # every sign bit set: negative NaNs lie above -Inf's, as signed integers
        return lo > exponent - (mask + 1)
    return int((bits & mask).amin()) > exponent


def _host_nonfinite_stats(d, full, scale):
    """Statistics of a CPU tensor holding a NaN or an Inf, in a few passes
    (integer ones when all are NaN): a diverged job has NaN in nearly every
    tensor of every step, and the general path's ~10 full passes made the
    recorder cost more than the step. Same values as `_device_stats`. None (general path) for a full-tier
    tensor with finite values left: its min/max/mean/rms need the
    definitions."""
    if _all_nan(d):  # as in a diverged job: everything is decided
        nan, fin, n_fin = d.numel(), None, 0
    else:
        nan = int(torch.isnan(d).count_nonzero())
        fin = torch.isfinite(d)
        n_fin = int(fin.count_nonzero())
        if full and n_fin:
            return None
    inf = d.numel() - n_fin - nan
    absmax = 0.0  # no finite value: the definitions' amax over zeros
    if n_fin:
        absmax = float(torch.where(fin, d.abs(), torch.zeros((), dtype=d.dtype)).amax())
        if scale is not None:
            absmax = absmax * (1.0 / float(scale.to(torch.float64)))
    if not full:
        return (absmax, float(nan), float(inf), math.nan)
    # Nothing finite: min/max/mean/rms are null, and a NaN or an Inf is
    # neither zero, nor below a threshold, nor counted near overflow (the
    # definitions compare the finite magnitudes, zero for these).
    m = float(share_sample(d).numel())
    return (absmax, float(nan), float(inf), math.nan, math.nan, math.nan, math.nan, math.nan,
            0.0, 0.0, 0.0, 0.0, m)


def _with_input(stats, input_nonfinite, device):
    """The statistics vector with this call's `input_nonfinite` filled in
    (it describes the caller's inputs, not the tensor)."""
    if isinstance(stats, tuple):
        values = list(stats)
        values[_INPUT_NONFINITE] = math.nan if input_nonfinite is None else float(input_nonfinite)
        return torch.tensor(values, dtype=torch.float64)
    vec = stats.clone()
    if input_nonfinite is None:
        vec[_INPUT_NONFINITE] = math.nan
    else:
        vec[_INPUT_NONFINITE] = input_nonfinite.to(device=device, dtype=torch.float64)
    return vec


class _Memo:
    """The last few tensors summarised, so that the same tensor reaching
    several hooks (a container's output is its last child's output; the
    same gradient reaches both) is summarised once.

    An entry holds weak references: a hit needs the very same live tensor
    object (an `id` alone could be reused once it is freed) at the same
    `_version` (an in-place change misses), with the same options and the
    same live scale tensor at the same version. Bounded, so it holds no
    memory beyond a few small vectors."""

    def __init__(self, size: int = 16):
        self.size = size
        self.entries: OrderedDict = OrderedDict()

    @staticmethod
    def key(t, full, scale, near_overflow):
        try:
            scale_key = None if scale is None else (id(scale), scale._version)
            return (id(t), t._version, bool(full), scale_key, float(near_overflow))
        except RuntimeError:  # inference tensors have no version counter
            return None

    def get(self, t, scale, key):
        hit = self.entries.get(key) if key is not None else None
        if hit is None:
            return None
        ref, scale_ref, stats = hit
        if ref() is not t or (scale_ref is not None and scale_ref() is not scale):
            del self.entries[key]
            return None
        return stats

    def put(self, t, scale, key, stats):
        if key is None:
            return
        try:
            refs = (weakref.ref(t), None if scale is None else weakref.ref(scale))
        except TypeError:
            return
        self.entries[key] = (*refs, stats)
        if len(self.entries) > self.size:
            self.entries.popitem(last=False)


_memo = _Memo()


def grad_facts(norms, unscale_by: float | None) -> tuple[float, int, list]:
    """From each gradient's norm (as taken: scaled by the loss scale when
    `unscale_by` is given): the square sum of the unscaled gradients, how
    many gradients hold a NaN/Inf (a norm is finite exactly when its values
    are) and their positions. float64 on the host, off the training path
    (on the CPU, once a step on it: the finite case is one dot product)."""
    norms = np.asarray(norms.numpy() if hasattr(norms, "numpy") else norms).astype(np.float64, copy=False)
    # A float32 norm squared stays far below float64's range: no overflow.
    sq = float(norms @ norms)
    if math.isfinite(sq) and unscale_by:
        return sq / unscale_by / unscale_by, 0, []
    if math.isfinite(sq) and unscale_by is None:
        return sq, 0, []
    if unscale_by is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            norms = norms / unscale_by
    bad = np.flatnonzero(~np.isfinite(norms))
    with np.errstate(over="ignore", invalid="ignore"):
        sq = float(np.sum(norms * norms))
    return sq, int(len(bad)), bad.tolist()
