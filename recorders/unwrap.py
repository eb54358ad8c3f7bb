"""The user's objects inside the wrappers frameworks put around them."""
from __future__ import annotations


def unwrap_optimizer(optimizer):
    """The torch optimizer inside Accelerate's `AcceleratedOptimizer` or
    Lightning's `LightningOptimizer`.

    `AcceleratedOptimizer` subclasses `torch.optim.Optimizer` without calling
    its `__init__`: it inherits `register_step_pre_hook` but lacks the
    `_optimizer_step_pre_hooks` it writes to. Follow `.optimizer` /
    `._optimizer` down to an object that has them (the one whose `step()`
    really runs); anything else is returned as it is."""
    seen = set()
    opt = optimizer
    while opt is not None and id(opt) not in seen:
        if hasattr(opt, "_optimizer_step_pre_hooks"):
            return opt
        seen.add(id(opt))
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            inner = getattr(opt, "_optimizer", None)
        if inner is None:
            break
        opt = inner
    return optimizer
