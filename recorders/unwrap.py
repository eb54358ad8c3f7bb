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


# Where scaler wrappers keep the GradScaler they drive: timm's NativeScaler
# (`_scaler`), Accelerate's Accelerator and Lightning's precision plugins
# (`scaler`), and user classes named either way.
SCALER_ATTRIBUTES = ("_scaler", "scaler", "grad_scaler")
_MAX_SCALER_DEPTH = 4


def is_grad_scaler(obj) -> bool:
    """A `torch.amp.GradScaler` (its subclasses: the CUDA one, FSDP's
    ShardedGradScaler, a user's), or an object with its whole interface
    (`scale`, `unscale_`, `update`, `get_scale`)."""
    import torch
    if isinstance(obj, torch.amp.GradScaler):
        return True
    return all(callable(getattr(obj, name, None)) for name in ("scale", "unscale_", "update", "get_scale"))


def unwrap_scaler(scaler) -> tuple[object | None, str | None]:
    """(the GradScaler to record, why the object passed was refused).

    A GradScaler is returned as it is. An object that holds one in
    `SCALER_ATTRIBUTES` (followed a few levels down) gives that one; one
    whose attribute is None (Accelerate or Lightning in bfloat16) holds no
    scaler: (None, None). Anything else is refused: (None, the sentence that
    says what to pass), so that the recorder never reads a scale that is
    not there."""
    if scaler is None or is_grad_scaler(scaler):
        return scaler, None
    obj, seen = scaler, set()
    for _ in range(_MAX_SCALER_DEPTH):
        seen.add(id(obj))
        held = [name for name in SCALER_ATTRIBUTES if _has_attribute(obj, name)]
        if not held:
            break
        inner = getattr(obj, held[0], None)
        if inner is None:
            return None, None
        if is_grad_scaler(inner):
            return inner, None
        if id(inner) in seen:
            break
        obj = inner
    cls = f"{type(scaler).__module__}.{type(scaler).__qualname__}"
    return None, (f"scaler= got a {cls}, which is not a torch.amp.GradScaler and holds none in "
                  f"{', '.join('.' + a for a in SCALER_ATTRIBUTES)}: the loss scale is not recorded; pass "
                  "the GradScaler itself (timm's NativeScaler: scaler=loss_scaler._scaler; Accelerate: "
                  "accelerator.scaler; Lightning: trainer.precision_plugin.scaler)")


def _has_attribute(obj, name: str) -> bool:
    try:
        return hasattr(obj, name)
    except Exception:  # noqa: BLE001 - a property of the user's class may raise anything
        return False
