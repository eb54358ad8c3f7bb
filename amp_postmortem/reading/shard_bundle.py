"""A sharded job's replay bundle made whole: each rank's bundle of a step
holds that rank's shards of the parameters with their placement
(`bundle.json` `params.placements`, docs/FORMAT.md); `reassemble` puts the
full tensors back together from every rank's shards, checking that they
agree (global shape, dtype, values where shards overlap, as replicated
dimensions do) and that every element is covered. Torch only for the
tensors; the ranks' bundles are read and checked by `bundle.py`.
"""
from __future__ import annotations

import math

import torch

from recorders.format import schema

from ..errors import BundleError
from .files import limits

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t` as integers of its width: NaN equals NaN, -0.0 differs from 0.0."""
    if t.dtype == torch.bool or not (t.is_floating_point() or t.is_complex()):
        return t
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().view(_SAME_SIZE_INT[t.element_size()])


def _region(full: torch.Tensor, covered: torch.Tensor, shard: torch.Tensor, placement: dict, where: str):
    """(the part of `full`, of `covered`, and the shard's values shaped like it)."""
    kind = placement.get("kind")
    if kind == "flat" and placement.get("flat_offset") is not None and placement.get("numel") is not None:
        start, numel = int(placement["flat_offset"]), int(placement["numel"])
        if shard.numel() != numel or start < 0 or start + numel > full.numel():
            raise BundleError(f"{where}: its {shard.numel()} values at flat offset {start} do not fit "
                              f"its placement ({numel} values) in shape {list(full.shape)}")
        return full.view(-1)[start:start + numel], covered.view(-1)[start:start + numel], shard.reshape(-1)
    if kind == "dtensor" and placement.get("global_offset") is not None:
        offset = [int(o) for o in placement["global_offset"]]
        if len(offset) != full.dim() or shard.dim() != full.dim() or any(
                o < 0 or o + s > g for o, s, g in zip(offset, shard.shape, full.shape)):
            raise BundleError(f"{where}: its shard of shape {list(shard.shape)} at offset {offset} does not fit "
                              f"in shape {list(full.shape)}")
        index = tuple(slice(o, o + s) for o, s in zip(offset, shard.shape))
        return full[index], covered[index], shard
    raise BundleError(f"{where}: placement {kind!r} is not one of {', '.join(schema.PLACEMENT_KINDS)} "
                      f"with its offsets (flat: flat_offset, numel; dtensor: global_offset)")


def reassemble(name: str, pieces: list[tuple[int, torch.Tensor, dict]], step: int) -> torch.Tensor:
    """The full tensor `name` of `step` from `pieces`, (rank, local shard,
    placement) of every rank that holds a part of it. BundleError when the
    ranks disagree on its global shape or dtype, when shards overlap with
    different values, or when some element is on no rank."""
    what = f"step {step}: parameter {name!r}"
    shapes = {tuple(p["global_shape"]) for _, _, p in pieces}
    dtypes = {t.dtype for _, t, _ in pieces}
    if len(shapes) != 1 or len(dtypes) != 1:
        said = "; ".join(f"rank {r}: {list(p['global_shape'])} {t.dtype}" for r, t, p in pieces)
        raise BundleError(f"{what}: the ranks' shards disagree on its global shape or dtype ({said})")
    shape = list(shapes.pop())
    if any(d < 0 for d in shape) or math.prod(shape) > limits.MAX_TENSOR_ELEMENTS:
        raise BundleError(f"{what}: global shape {shape} is outside the limits of a bundle tensor")
    dtype = dtypes.pop()
    full = torch.zeros(shape, dtype=dtype)
    covered = torch.zeros(shape, dtype=torch.bool)
    for rank, shard, placement in pieces:
        where = f"{what}, rank {rank}"
        into, seen, values = _region(full, covered, shard, placement, where)
        if seen.any() and not torch.equal(_bits(into[seen]), _bits(values[seen])):
            raise BundleError(f"{where}: its shard overlaps another rank's with different values")
        into.copy_(values)
        seen.fill_(True)
    if not bool(covered.all()):
        missing = int((~covered).sum())
        ranks = ", ".join(str(r) for r, _, _ in pieces) or "none"
        raise BundleError(f"{what}: {missing} of its {full.numel()} elements are in no rank's shard "
                          f"(shards from ranks {ranks})")
    return full
