"""The full tier's statistics of small CPU tensors, reduced by groups.

A full-tier row of a small tensor is a dozen tensor operations on the CPU
(`stats._host_stats`), each a few microseconds of dispatch around
arithmetic that takes less: on a launch-bound model (hundreds of modules of
width 16) the ~1,300 rows of a full step cost ten training steps, and a
sentinel's re-execution of a failing step (every row, at the full tier)
cost as much. Here a row costs one operation, a float32 copy of its tensor
(exact for float16, bfloat16 and float32; the tensor may change in place
after the hook), and at the flush the rows of equal size and loss scale are
stacked and reduced together: about twenty operations a group, whatever its
count.

The values are those of the host path bit for bit: min and max, the counts
and the shares are exact whatever the grouping; the float32 sums behind
mean and rms are each one row's, and torch reduces a row of a stacked
tensor as it reduces that tensor alone (the same cascade, one thread, below
`MAX_NUMEL` values; `tests/test_full_stage.py` checks this on many random
tensors against the definitions). A row holding a NaN or an Inf, or whose
squares could overflow float32, is summarised alone by the general path,
from its copy; so is a group of one.

Not staged (the caller takes the per-tensor path): device tensors,
DTensors and other tensor subclasses, float64, empty, non-contiguous and
larger tensors (arithmetic there outweighs dispatch),
inference tensors, and options other than a loss scale to divide by.
"""
from __future__ import annotations

import math
import weakref

import torch

from .format import schema
from .layout import PLAIN_TENSORS
from .stats import SQUARES_SAFE, fp16_thresholds, row_stats

STAGED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A row's float32 sum runs on one thread below torch's grain size (32,768
# values); a larger tensor's is split across threads, in another order.
MAX_NUMEL = 1 << 14
# Values held in copies before a flush is forced: 16 MiB of float32.
MAX_HELD = 1 << 22
_RECENT_MAX = 64


class FullRow:
    """A full-tier row whose statistics wait in the stage; `value` (a tuple
    of `schema.FULL_STATS`) once it is flushed. `resolve` puts the values in
    its place in the step's containers."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = None


class FullStage:
    """Rows staged since the last `flush` (one owner: the training thread)."""

    def __init__(self, near_overflow: float):
        self.near_overflow = near_overflow
        self.rows: list = []  # (FullRow, float32 copy, loss scale or None)
        self._held = 0
        self._recent: dict = {}  # id(tensor) -> (weakref, version, scale, row): a tensor seen twice
        self.staged = 0  # rows staged so far (tests, benchmarks)
        # Rows flushed whose values `resolve` has not yet put in place: a
        # flush may come mid-step (the optimizer's pre-step reads the rows).
        self.unresolved = False

    def put(self, t, scale=None) -> FullRow | None:
        """Stage the full statistics of the CPU tensor `t` (`scale`: a CPU
        loss-scale tensor the values are divided by); None when `t` is not
        staged (see the module's docstring)."""
        if (type(t) not in PLAIN_TENSORS or t.dtype not in STAGED_DTYPES or not t.is_cpu
                or scale is not None and not scale.is_cpu):
            return None  # a device tensor's values would be read back (a sync); a DTensor is its shard's
        n = t.numel()
        if n == 0 or n > MAX_NUMEL or not t.is_contiguous():
            return None
        try:
            version = t._version
        except RuntimeError:  # an inference tensor
            return None
        key = id(t)
        hit = self._recent.get(key)
        if hit is not None and hit[1] == version and hit[2] is scale and hit[0]() is t:
            return hit[3]  # a container's output is its last child's: summarised once
        if self._held + n > MAX_HELD:
            self.flush()
        d = t.detach() if t.requires_grad else t
        row = FullRow()
        self.rows.append((row, d.to(torch.float32, copy=True).view(-1), scale))
        self._held += n
        self.staged += 1
        self.unresolved = True
        if len(self._recent) >= _RECENT_MAX:
            self._recent.clear()
        try:
            self._recent[key] = (weakref.ref(t), version, scale, row)
        except TypeError:
            pass
        return row

    def flush(self) -> bool:
        """Give every staged row its values; whether there were any."""
        rows = self.rows
        if not rows:
            return False
        self.rows, self._held, self._recent = [], 0, {}
        groups: dict = {}
        for row, x, scale in rows:
            groups.setdefault((x.numel(), id(scale)), []).append((row, x, scale))
        for members in groups.values():
            if len(members) == 1:
                row, x, scale = members[0]
                row.value = self._alone(x, scale)
            else:
                self._group(members)
        return True

    def _alone(self, x, scale):
        return row_stats(x, full=True, scale=scale, unscale=scale is not None, near_overflow=self.near_overflow)

    def _group(self, members) -> None:
        """The rows of `members` (copies of one size, one loss scale), as
        `stats._host_stats` computes each: the same float32 sums, the same
        float64 arithmetic in Python floats, torch's sqrt."""
        scale = members[0][2]
        x = torch.stack([m[1] for m in members])
        n = x.shape[1]
        lo, hi = (v.tolist() for v in torch.aminmax(x, dim=1))
        sums = x.sum(dim=1).tolist()
        squares = (x * x).sum(dim=1).tolist()
        rms = torch.tensor([s / n for s in squares], dtype=torch.float64).sqrt().tolist()
        a = x.abs_()  # x is ours; the sums are taken
        normal, sub, over = fp16_thresholds(scale, torch.float32, self.near_overflow)
        zeros = (a == 0).sum(dim=1).tolist()
        below_normal = (a < normal).sum(dim=1).tolist()
        below_sub = (a < sub).sum(dim=1).tolist()
        near = (a >= over).sum(dim=1).tolist()
        inv = None if scale is None else 1.0 / float(scale.to(torch.float64))
        m = float(n)  # every value is in the share sample below schema.SHARE_SAMPLE_MAX
        for i, (row, copy, _) in enumerate(members):
            mn, mx = lo[i], hi[i]
            top = max(abs(mn), abs(mx))
            if not (math.isfinite(mn) and math.isfinite(mx)) or top * top * n > SQUARES_SAFE:
                row.value = self._alone(copy, scale)  # NaN/Inf, or squares to divide first
                continue
            mean, r, absmax = sums[i] * 1.0 / n, rms[i] * 1.0, top
            if inv is not None:
                absmax, mn, mx, mean, r = top * inv, mn * inv, mx * inv, mean * inv, r * inv
            zero = zeros[i]
            row.value = (absmax, 0.0, 0.0, math.nan, mn, mx, mean, r, zero / m, (below_normal[i] - zero) / m,
                         (below_sub[i] - zero) / m, near[i] / m, m)


assert MAX_NUMEL <= schema.SHARE_SAMPLE_MAX  # `_group`: every value is in the share sample


def resolve(st) -> None:
    """Put each flushed `FullRow`'s values where the step holds it: its
    rows, its parameters' gradient slots and value rows."""
    rows = st.stats
    for i, r in enumerate(rows):
        if type(r) is FullRow:
            rows[i] = r.value
    for slot in st.param_grads.values():
        if type(slot[1]) is FullRow:
            slot[1] = slot[1].value
    if any(type(v[2]) is FullRow for v in st.param_values):
        st.param_values = [(n, info, s.value if type(s) is FullRow else s) for n, info, s in st.param_values]
