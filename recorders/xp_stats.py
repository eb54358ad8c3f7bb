"""The full tier's statistics, reduced inside another framework's compiled
step (the Keras recorder's `keras.ops`, the Flax recorder's `jax.numpy`):
the definitions of `stats.py` (PyTorch), written once for any array
namespace `xp` with numpy's names. Imports no framework: the caller hands
over its namespace and its cast (`cast(x, "float32")`).

A row's vector (`FULL_WIDTH` float32 numbers): the cheap tier's five
([absmax, NaN count, Inf count, input_nonfinite, numel]) then
`schema.FULL_STATS`' nine ([min, max, mean, rms, zero count,
below-normal count, below-subnormal count, near-overflow count, share
sample size]): the shares leave as counts over the sample (exact in
float32), divided by its size on the host in float64 (`host_run.stats_row`),
as PyTorch's are.

Definitions, as `stats.py`'s: min, max, mean and rms over the finite
values, mean and rms summed in float32 over the values divided by their
largest magnitude when their squares could overflow; the four shares
counted on the evenly strided sample of at most `schema.SHARE_SAMPLE_MAX`
values (`share_sample`), against the float16 limits whatever the tensor's
dtype (docs/FORMAT.md: "below normal" is float16's 2**-14), the
comparisons in float32; a NaN or an Inf is in the sample's size but in no
share. Counts are float32: exact up to 2**24 values per row.
"""
from __future__ import annotations

import math

from .format import schema

CHEAP_WIDTH = 5
FULL_WIDTH = CHEAP_WIDTH + len(schema.FULL_STATS) - len(schema.CHEAP_STATS)
SQUARES_SAFE = schema.SQUARES_SAFE  # stats.py's rule


def share_sample(flat, n: int | None, xp, cast):
    """(the sample the shares are counted on, its size) of a flat array of
    `n` values (None: not known while tracing, a TensorFlow batch
    dimension): every `ceil(n / SHARE_SAMPLE_MAX)`-th value from the first,
    as `stats.share_sample`."""
    most = schema.SHARE_SAMPLE_MAX
    if n is not None:
        stride = max(1, -(-n // most))
        return flat[::stride], float(-(-n // stride))
    size = xp.size(flat)
    stride = (size + most - 1) // most
    sample = flat[::stride]
    return sample, cast(xp.size(sample), "float32")


def full_tail(x, n: int | None, xp, cast, near_overflow: float = schema.FP16_MAX) -> list:
    """The nine full-tier numbers of `x` (float32, already unscaled; `n`
    its static size or None), as 0-d float32 arrays; the shares as counts."""
    f32 = lambda v: cast(v, "float32")  # noqa: E731
    flat = xp.reshape(x, (-1,))
    finite = xp.isfinite(flat)
    zeros = xp.zeros_like(flat)
    xf = xp.where(finite, flat, zeros)
    a = xp.abs(xf)
    absmax = xp.max(a)
    n_fin = xp.sum(f32(finite))
    nan = f32(math.nan)
    has = xp.greater(n_fin, 0.0)
    mn = xp.where(has, xp.min(xp.where(finite, flat, zeros + math.inf)), nan)
    mx = xp.where(has, xp.max(xp.where(finite, flat, zeros - math.inf)), nan)
    size = f32(n) if n is not None else f32(xp.size(flat))
    top = xp.where(xp.greater(absmax * absmax * size, SQUARES_SAFE), absmax, f32(1.0))
    y = xf / top
    mean = xp.sum(y) / n_fin * top
    rms = xp.sqrt(xp.sum(y * y) / n_fin) * top
    sample, m = share_sample(flat, n, xp, cast)
    sa = xp.abs(xp.where(xp.isfinite(sample), sample, xp.zeros_like(sample)))
    nonzero = xp.greater(sa, 0.0)

    def share(mask):
        return xp.sum(f32(mask))

    return [mn, mx, mean, rms,
            share(xp.equal(sample, 0.0)),
            share(xp.logical_and(nonzero, xp.less(sa, schema.FP16_MIN_NORMAL))),
            share(xp.logical_and(nonzero, xp.less(sa, schema.FP16_MIN_SUBNORMAL))),
            share(xp.greater_equal(sa, near_overflow)),
            f32(m)]


def merge_rows(rows: list, xp, cast):
    """One row's vector from the vectors of its tensors (a tuple output,
    several inputs), cheap or full width alike: counts and sizes summed,
    extremes of all, mean and rms over every finite value, the share
    counts summed. `input_nonfinite` is the first's (the
    caller sets it)."""
    if len(rows) == 1:
        return rows[0]
    v = xp.stack(rows)
    absmax = xp.max(v[:, 0])
    cheap = [absmax, xp.sum(v[:, 1]), xp.sum(v[:, 2]), v[0, 3], xp.sum(v[:, 4])]
    if int(v.shape[1]) == CHEAP_WIDTH:
        return xp.stack(cheap)
    f32 = lambda t: cast(t, "float32")  # noqa: E731
    n_fin = v[:, 4] - v[:, 1] - v[:, 2]
    has = xp.greater(n_fin, 0.0)
    total = xp.sum(n_fin)
    nan = f32(math.nan)
    some = xp.greater(total, 0.0)
    mn = xp.where(some, xp.min(xp.where(has, v[:, 5], xp.zeros_like(n_fin) + math.inf)), nan)
    mx = xp.where(some, xp.max(xp.where(has, v[:, 6], xp.zeros_like(n_fin) - math.inf)), nan)
    mean = xp.sum(xp.where(has, v[:, 7], xp.zeros_like(n_fin)) * n_fin) / total
    top = xp.where(xp.greater(absmax, 0.0), absmax, f32(1.0))
    r = xp.where(has, v[:, 8] / top, xp.zeros_like(n_fin))
    rms = xp.sqrt(xp.sum(r * r * n_fin) / total) * top
    counts = [xp.sum(v[:, i]) for i in range(9, 14)]
    return xp.stack(cheap + [mn, mx, mean, rms, *counts])
