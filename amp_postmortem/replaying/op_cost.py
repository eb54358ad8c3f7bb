"""How much of a forward pass runs in float16/bfloat16: the yardstick of what
a float32 remedy costs (`fix` ranks its remedies by it).

    counter = ReducedWork()
    with counter:                 # a TorchDispatchMode, replay only
        model(*args)
    counter.flops                 # forward work done in a reduced precision

Every aten op whose floating output is float16 or bfloat16 counts: a matmul
or convolution by its FLOPs (torch's own formulas, `torch.utils.flop_counter`),
any other op by its output's elements; views and casts (`_to_copy`, which
autocast inserts) count nothing. A remedy's extra
float32 work is the reduced-precision work it removes: this count of the
recorded configuration minus that of the remedy's (which includes the ops
downstream that follow it into float32).
"""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

__all__ = ["ReducedWork"]

_REDUCED = (torch.float16, torch.bfloat16)
_NOT_WORK = (torch.ops.aten._to_copy, torch.ops.aten.copy_, torch.ops.aten.clone, torch.ops.aten.detach)


class ReducedWork(TorchDispatchMode):
    """Counts the reduced-precision work of the ops run while it is active."""

    def __init__(self):
        super().__init__()
        self.flops = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "is_view", False) or func._overloadpacket in _NOT_WORK:
            return out
        reduced = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.dtype in _REDUCED]
        if not reduced:
            return out
        formula = flop_registry.get(func._overloadpacket)
        work = None
        if formula is not None:
            try:
                work = float(formula(*args, **kwargs, out_val=out))
            except Exception:  # noqa: BLE001 - a formula that does not take this overload: count elements
                work = None
        self.flops += work if work is not None else float(sum(t.numel() for t in reduced))
        return out
