"""Keep chosen modules in float32 inside an autocast region: the one-line fix
that `amp-postmortem fix` prints.

    from recorders.fp32 import keep_fp32
    keep_fp32(model.blocks[3].attn)

The module's floating inputs are cast to float32 and autocast is disabled
while it runs (the playbook's `autocast(enabled=False)` step), so every op in
it, softmax, norms and reductions included, runs in float32 on any device.
Its parameters and state_dict are untouched: only `forward` is wrapped, on
this instance.
"""
from __future__ import annotations

import functools

import torch

_MARK = "_amp_postmortem_fp32_forward"
_REDUCED = (torch.float16, torch.bfloat16)


def _to_fp32(obj):
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in _REDUCED else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_to_fp32(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_fp32(v) for v in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _to_fp32(v)) for k, v in obj.items())
    return obj


def _device_type(args, kwargs) -> str:
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def keep_fp32(module: torch.nn.Module) -> torch.nn.Module:
    """Run `module` (and everything inside it) in float32. Returns the module;
    calling it twice is harmless."""
    if getattr(module, _MARK, None) is not None:
        return module
    original = module.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        device_type = _device_type(args, kwargs)
        with torch.autocast(device_type=device_type, enabled=False):
            return original(*_to_fp32(args), **_to_fp32(kwargs))

    forward.__wrapped_original__ = original
    module.forward = forward
    setattr(module, _MARK, original)
    return module


def release_fp32(module: torch.nn.Module) -> torch.nn.Module:
    """Undo `keep_fp32`."""
    original = getattr(module, _MARK, None)
    if original is not None:
        module.forward = original
        delattr(module, _MARK)
    return module


def is_kept_fp32(module: torch.nn.Module) -> bool:
    return getattr(module, _MARK, None) is not None
