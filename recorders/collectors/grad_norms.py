"""Each gradient's L2 norm, every step, in as few operations as the device allows.

The step facts need one norm per gradient (their square sum is the gradient
norm; which ones are NaN/Inf names the parameters a re-execution must
reproduce). On a GPU `torch._foreach_norm` is one fused launch per ~100
tensors. On the CPU it is a loop in C++ over the tensors, ~1.5 us of
dispatch and setup each: 0.43 ms a step for the 288 gradients of a model of
48 narrow blocks, more than the rest of the step facts together. There,
`NormPlan` concatenates the small gradients of one shape (a copy of a few
KiB each costs less than one dispatch) and reduces each row of the result:
two operations for a whole group, whatever its size. A step whose
gradients are all finite needs only their square sum: `NormPlan.facts`
reduces each group whole and takes the rows only when the sum is not
finite.
"""
from __future__ import annotations

import math
import operator

import numpy as np
import torch

# A gradient of at most this many elements is copied into its shape's group:
# copying 4096 float32 values costs about one per-tensor dispatch.
SMALL_NUMEL = 4096
# Fewer gradients of one shape than this are not worth a concatenation.
MIN_GROUP = 4
# A float32/float64 gradient of at least this many elements is reduced by
# `torch.dot` (BLAS: every intra-op thread, float32 lanes), not by
# `_foreach_norm`, whose loop takes each tensor on one thread: 2-3x faster
# from 128K values on 2 cores (AVX-512), 2x for matrices larger than the
# caches (16M values: 2.4 -> 1.2 ms); below, the extra dispatch costs more.
BIG_NUMEL = 1 << 17
_DOT_DTYPES = (torch.float32, torch.float64)
# Gradients and square sums of a few hundred tensors every step, mapped in C
# (a comprehension's loop cost ~0.1 ms a step on the 290 of a model of 48 blocks).
GRAD = operator.attrgetter("grad")


def grad_norms(grads: list, on_host: bool | None = None, as_float64: bool = True) -> torch.Tensor:
    """The L2 norm of each gradient, as a vector on their device.

    On a GPU: one fused pass in float64 (a scaled float16 gradient's norm
    overflows in its own dtype), asynchronous. On the CPU see `cpu_norms`;
    `as_float64` converts its result. `on_host`: None reads it off the
    gradients' device (a test runs the device path on the CPU)."""
    if on_host is None:
        on_host = grads[0].device.type == "cpu"
    if not on_host:
        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64))
    norms, _ = cpu_norms(grads)
    return norms.to(torch.float64) if as_float64 else norms


def cpu_norms(grads: list, work: torch.dtype | None = None, uniform: bool | None = None,
              big: frozenset = frozenset()) -> tuple[torch.Tensor, float]:
    """(each gradient's norm, the square sum of the norms in float64), on the
    CPU, in the order of `grads`, by `_foreach_norm`'s loop (a `NormPlan`
    groups what it can first); the sum is finite exactly when every norm
    is. `work`, `uniform`: the plan's, when known (None: read off `grads`).

    The float64 pass converts every value first and cost ~9x the float32
    one (5 ms a step for 4M values), so the norms are taken in float32
    (relative error ~1e-5; float64 gradients keep float64), and only a norm
    that overflowed there (Inf from finite values too large to square in
    float32) is taken again in float64 (`settle`). `big`: the positions of
    the gradients taken by `torch.dot` (`big_positions`)."""
    if work is None:
        work = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    parts = _foreach_norms(grads, work, uniform, big)
    # One stack and one read, whatever the count: measured in the MLP's
    # step (6 norms, right after its backward pass), reading them one by
    # one and remaking a tensor cost ~5 us more than this.
    return settle(torch.stack(parts), grads.__getitem__)


def settle(norms: torch.Tensor, grad_at) -> tuple[torch.Tensor, float]:
    """(norms, their square sum read on the host), an overflowed float32
    norm taken again in float64 from `grad_at(i)`, the gradient of norm `i`."""
    sq = square_sum(norms)
    if math.isfinite(sq):
        return norms, sq
    norms = norms.to(torch.float64)
    overflow = torch.isinf(norms)
    if overflow.any():
        for i in overflow.nonzero().flatten().tolist():
            norms[i] = torch.linalg.vector_norm(grad_at(i), dtype=torch.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            values = norms.numpy()
            sq = float(values @ values)
    return norms, sq


def square_sum(norms: torch.Tensor) -> float:
    """The sum of the squared norms (a host vector), read as one float: one
    dot product in the norms' dtype (10 us less than reading a few hundred
    norms into Python floats and summing them there, on the launch-bound
    proxy's 288). A float32 sum overflows (Inf) from norms of ~1e19:
    `settle` then sums them again in float64; NaN stays NaN."""
    return torch.dot(norms, norms).item()


def big_positions(params: list, work: torch.dtype) -> frozenset:
    """The positions of the parameters whose gradients `cpu_norms` takes by
    `torch.dot`: dense, of at least `BIG_NUMEL` elements, float32 or
    float64 and of dtype `work` (a float16 gradient's dot product would be
    taken in float16)."""
    return frozenset(i for i, p in enumerate(params)
                     if p.numel() >= BIG_NUMEL and p.dtype in _DOT_DTYPES and p.dtype == work
                     and p.layout == torch.strided)


def _foreach_norms(grads, work, uniform: bool | None = None, big: frozenset = frozenset()):
    """`uniform`: every gradient is of dtype `work` (None: test each);
    `big`: positions taken by `torch.dot` (the others by one
    `_foreach_norm`), the norms kept in the order of `grads`. An overflowed
    square (Inf) is taken again by `settle`, as a float32 norm's is."""
    if big:
        small = [g for i, g in enumerate(grads) if i not in big]
        rest = iter(_foreach_norms(small, work, uniform) if small else ())
        out = []
        for i, g in enumerate(grads):
            if i in big:
                flat = g.reshape(-1)
                out.append(torch.dot(flat, flat).sqrt())
            else:
                out.append(next(rest))
        return out
    if uniform if uniform is not None else all(g.dtype == work for g in grads):
        # The usual float32 master gradients: no `dtype`, whose conversion
        # path cost a fifth more here for the same sums.
        return torch._foreach_norm(grads, 2)
    return torch._foreach_norm(grads, 2, dtype=work)


class NormPlan:
    """The CPU's grouping of a fixed list of parameters' gradients, made once
    from the parameters (a gradient has its parameter's shape): groups of at
    least `MIN_GROUP` small gradients of one shape, dtype and device, each
    concatenated and reduced per row; the rest go through `_foreach_norm`.
    A gradient the plan did not foresee (missing, sparse) makes `norms`
    raise: the caller then checks each gradient."""

    def __init__(self, params: list):
        by_kind: dict = {}
        for i, p in enumerate(params):
            by_kind.setdefault((tuple(p.shape), p.dtype, p.device), []).append(i)
        self.groups = [idx for (shape, _, device), idx in by_kind.items()
                       if len(idx) >= MIN_GROUP and shape and device.type == "cpu"
                       and params[idx[0]].numel() <= SMALL_NUMEL]
        grouped = {i for idx in self.groups for i in idx}
        self.rest = [i for i in range(len(params)) if i not in grouped]
        order = [i for idx in self.groups for i in idx] + self.rest
        self.useful = bool(self.groups)
        self.work = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        self.uniform = all(p.dtype == self.work for p in params)
        self.rest_uniform = all(params[i].dtype == self.work for i in self.rest)
        self.big = big_positions(params, self.work)  # in the order of `params`
        self.rest_big = big_positions([params[i] for i in self.rest], self.work)
        self.order = order
        self.group_params = [[params[i] for i in idx] for idx in self.groups]
        self.rest_params = [params[i] for i in self.rest]
        self.ordered_params = [params[i] for i in order]
        # No group, no big matrix, one dtype: one `_foreach_norm` of every
        # gradient as it is (`ParamGradCollector`'s few-line path).
        self.simple = not self.useful and self.uniform and not self.big

    def norms(self, read: list | None = None) -> torch.Tensor | None:
        """The norms of the parameters' gradients in the plan's order
        (`order`): each group's, then the rest's, read off the parameters
        group by group (no list of them all). Raises on gradients the plan
        did not foresee (missing, sparse). `read`: a list that gets the
        lists of gradients read (`ParamGradCollector` keeps them)."""
        if not self.useful:
            return None
        work = self.work
        parts = []
        for params in self.group_params:
            grads = list(map(GRAD, params))
            if read is not None:
                read.append(grads)
            parts.append(_row_norms(torch.cat(grads), len(params), work))
        if self.rest:
            grads = list(map(GRAD, self.rest_params))
            if read is not None:
                read.append(grads)
            parts.append(torch.stack(_foreach_norms(grads, work, self.rest_uniform, self.rest_big)))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def facts(self, read: list | None = None) -> tuple[torch.Tensor | None, float]:
        """(None, the gradients' square sum) when that sum is finite; else
        (the norms in the plan's order, their square sum) as
        `settle(self.norms(read), self.grad_at)` gives them.

        A step whose gradients are all finite needs only their square sum
        (the norms name the NaN/Inf ones): one norm of each group's
        concatenation, not one per row. On the launch-bound proxy's 288
        gradients the per-row norms, their concatenation and the dot product
        of them cost ~55 us of a cold step, the two whole-group norms ~15.
        The concatenations are kept for the norms when the sum is not
        finite (a NaN or Inf among the gradients, or a float32 square sum
        that overflowed: `settle` retakes it in float64)."""
        if not self.useful:
            raise ValueError("no group: the caller takes the norms itself")
        work = self.work
        flats = []
        sq = 0.0
        for params in self.group_params:
            grads = list(map(GRAD, params))
            if read is not None:
                read.append(grads)
            flat = torch.cat(grads)
            flats.append(flat)
            # The norm, not a dot product: accumulated past float32's range
            # of squares; squared here in float64.
            norm = torch.linalg.vector_norm(flat, dtype=work if flat.dtype != work else None).item()
            sq += norm * norm
        rest = None
        if self.rest:
            grads = list(map(GRAD, self.rest_params))
            if read is not None:
                read.append(grads)
            rest = torch.stack(_foreach_norms(grads, work, self.rest_uniform, self.rest_big))
            sq += square_sum(rest)
        if math.isfinite(sq):
            return None, sq
        parts = [_row_norms(flat, len(params), work) for flat, params in zip(flats, self.group_params)]
        if rest is not None:
            parts.append(rest)
        return settle(torch.cat(parts) if len(parts) > 1 else parts[0], self.grad_at)

    def in_order(self, items: list) -> list:
        """`items` (one per parameter) in the plan's order."""
        return [items[i] for i in self.order]

    def grad_at(self, i: int):
        """The gradient of the `i`-th norm in the plan's order."""
        return self.ordered_params[i].grad


def _row_norms(flat: torch.Tensor, rows: int, work: torch.dtype) -> torch.Tensor:
    """The norm of each of the `rows` equal parts of a group's
    concatenation `flat` (one gradient each), taken in `work`."""
    return torch.linalg.vector_norm(flat.reshape(rows, -1), dim=1, dtype=work if flat.dtype != work else None)

