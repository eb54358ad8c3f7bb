"""Device-side statistics of one tensor, as a small float64 vector.

Everything here enqueues device work and returns a device tensor: no
`.item()`, no `.cpu()`, no Python branch on a tensor value, so a hook that
calls these never waits for the GPU. The caller stacks the vectors of a
step and copies them out once.

Layout of the vector follows `schema.CHEAP_STATS` / `schema.FULL_STATS`.
"""
from __future__ import annotations

import math

import torch

from . import schema

CHEAP_WIDTH = len(schema.CHEAP_STATS)
FULL_WIDTH = len(schema.FULL_STATS)

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_float_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in _FLOATING and x.numel() > 0


def iter_tensors(obj, _depth: int = 0):
    """Yield the tensors inside a module's inputs or outputs: tensors, lists,
    tuples, dicts (HF ModelOutput is an OrderedDict) and dataclasses."""
    if _depth > 8:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v, _depth + 1)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v, _depth + 1)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from iter_tensors(getattr(obj, name, None), _depth + 1)


def nonfinite_count(t: torch.Tensor) -> torch.Tensor:
    """Count of NaN/Inf values as a 0-d float64 device tensor."""
    return (~torch.isfinite(t.detach())).sum().to(torch.float64)


def tensor_stats(t: torch.Tensor, *, full: bool, input_nonfinite=None,
                 scale: torch.Tensor | None = None, unscale: bool = False,
                 near_overflow: float = schema.FP16_MAX) -> torch.Tensor:
    """Statistics vector of `t`.

    `input_nonfinite`: a 0-d device tensor (or None: recorded as null).
    `scale`/`unscale`: the gradient is multiplied by the loss scale; with
    `unscale` the value statistics are divided by it (param grads are
    reported unscaled) while the float16 threshold shares are still taken on
    the unscaled values, by comparing against thresholds times the scale.
    """
    d = t.detach()
    a = d.abs()
    nan = torch.isnan(d).sum()
    inf = torch.isinf(d).sum()
    # NaN/Inf are counted separately; the magnitude statistics describe the
    # finite values so that headroom stays meaningful in a step with one Inf.
    finite_abs = torch.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)
    absmax = finite_abs.amax().to(torch.float64)
    inv = None
    if unscale and scale is not None:
        inv = scale.to(torch.float64).reciprocal()
        absmax = absmax * inv
    if input_nonfinite is None:
        inp = torch.full((), math.nan, dtype=torch.float64, device=d.device)
    else:
        inp = input_nonfinite.to(device=d.device, dtype=torch.float64)
    parts = [absmax, nan.to(torch.float64), inf.to(torch.float64), inp]
    if full:
        parts.extend(_full_stats(d, finite_abs, inv, scale if unscale else None, near_overflow))
    return torch.stack(parts)


def _full_stats(d, finite_abs, inv, scale, near_overflow):
    work = torch.float64 if d.dtype == torch.float64 else torch.float32
    x = d.to(work)
    fin = torch.isfinite(x)
    n = d.numel()
    n_fin = fin.sum().to(torch.float64)
    xf = torch.where(fin, x, torch.zeros((), dtype=work, device=x.device))
    inf_t = torch.full((), math.inf, dtype=work, device=x.device)
    mn = torch.where(fin, x, inf_t).amin().to(torch.float64)
    mx = torch.where(fin, x, -inf_t).amax().to(torch.float64)
    mean = xf.sum(dtype=torch.float64) / n_fin
    rms = torch.sqrt((xf.to(torch.float64) ** 2).sum() / n_fin) if work == torch.float64 else \
        torch.sqrt(torch.linalg.vector_norm(xf, dtype=torch.float64) ** 2 / n_fin)
    # No finite value: min/max would be +-inf; report NaN (null) instead.
    nan_t = torch.full((), math.nan, dtype=torch.float64, device=x.device)
    mn = torch.where(n_fin > 0, mn, nan_t)
    mx = torch.where(n_fin > 0, mx, nan_t)
    a = finite_abs.to(work)
    normal = schema.FP16_MIN_NORMAL
    sub = schema.FP16_MIN_SUBNORMAL
    over = near_overflow
    if scale is not None:
        # Thresholds in scaled units: |g/scale| < t  <=>  |g| < t*scale.
        s = scale.to(work)
        normal, sub, over = normal * s, sub * s, over * s
    nonzero = a > 0
    zero = (d == 0).sum().to(torch.float64) / n
    below_normal = (nonzero & (a < normal)).sum().to(torch.float64) / n
    below_sub = (nonzero & (a < sub)).sum().to(torch.float64) / n
    near = (a >= over).sum().to(torch.float64) / n
    if inv is not None:
        mn, mx, mean, rms = mn * inv, mx * inv, mean * inv, rms * inv
    return [mn, mx, mean, rms, zero, below_normal, below_sub, near]
