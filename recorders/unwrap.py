"""The user's objects inside the wrappers frameworks put around them."""
from __future__ import annotations


def unwrap_optimizer(optimizer):
    """The torch optimizer inside Accelerate's `AcceleratedOptimizer` or
    Lightning's `LightningOptimizer`.

    `AcceleratedOptimizer` subclasses `torch.optim.Optimizer` without calling
    its `__init__`: it inherits `register_step_pre_hook` but lacks the
    `_optimizer_step_pre_hooks` it writes to. `LightningOptimizer` forwards
    attribute reads to the optimizer it holds. Follow `.optimizer` /
    `._optimizer` down to the object that owns that hook table (the one whose
    `step()` really runs); anything else is returned as it is."""
    chain, seen = [], set()
    opt = optimizer
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        chain.append(opt)
        if "_optimizer_step_pre_hooks" in getattr(opt, "__dict__", {}):
            return opt
        inner = getattr(opt, "optimizer", None)
        opt = inner if inner is not None else getattr(opt, "_optimizer", None)
    return next((o for o in chain if hasattr(o, "_optimizer_step_pre_hooks")), optimizer)
