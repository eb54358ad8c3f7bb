"""The loss a loop computes outside the model (`BundlePolicy(loss_fn=...)`):
how its calls are seen, and how one call is kept in a window.

`loss = loss_fn(model(x), y)`: the window holds `x` (the model's inputs) but
not `y`. Given the loss the loop calls, the window keeps each micro-batch's
call to it: the arguments that are not the prediction (the targets, held by
reference as the inputs are, written as the inputs are: raw tensor bytes in
Parquet), the prediction's place, shape and dtype, and the loss's name for
messages. The loss object itself is never written (no pickle): the analyzer
is given it by the user (`amp-postmortem rerun --loss FILE.py:fn`).

How a call is seen:
- an `nn.Module` criterion (`nn.CrossEntropyLoss()`): a forward pre-hook
  (removed at close);
- a function defined at a module's top level: that module's attribute is
  replaced by a wrapper while the recorder is open (restored at close), so
  that a loop calling it by that name (a global lookup, `F.cross_entropy`)
  is seen. A name bound elsewhere before the recorder was made (`f = loss`)
  is not: the window then holds no call, and `rerun` says so.

The prediction: the call's tensors that require a gradient (computed from
the model's output); when none does (the loss computed under no_grad), the
first tensor argument.
"""
from __future__ import annotations

import functools
import sys

import torch

from ..errors import OptionError
from ..format.schema import WINDOW_PREDICTION_KEY as PREDICTION_KEY  # a prediction's place in a kept call (JSON)
from ..stats import iter_tensors


def loss_target(fn) -> tuple[str, str]:
    """(the loss's name, how its calls are seen: "module" or "function");
    OptionError for one whose calls cannot be seen."""
    if isinstance(fn, torch.nn.Module):
        cls = type(fn)
        return f"{cls.__module__}.{cls.__qualname__}", "module"
    if not callable(fn):
        raise OptionError(f"loss_fn={fn!r}: give the loss the loop calls (an nn.Module criterion or a function)")
    name = getattr(fn, "__name__", None)
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    qual = getattr(fn, "__qualname__", name)
    if module is None or not name or qual != name or getattr(module, name, None) is not _unwrapped(fn):
        raise OptionError(
            f"loss_fn={fn!r}: its calls cannot be seen (not an nn.Module, nor a function defined at a module's "
            "top level): pass the criterion module (nn.CrossEntropyLoss(), ...) or a top-level function")
    return f"{module.__name__}.{name}", "function"


def _unwrapped(fn):
    return getattr(fn, "__amp_postmortem_wrapped__", fn)


class LossTap:
    """Sees the calls of `fn` and hands each to `on_call(args, kwargs)`
    (training thread) until `remove()`."""

    def __init__(self, fn, on_call):
        self.name, self.kind = loss_target(fn)
        self._on_call = on_call
        self._handle = None
        self._module = self._attr = self._wrapper = self._original = None
        if self.kind == "module":
            self._handle = fn.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        else:
            self._original = fn = _unwrapped(fn)
            self._module, self._attr = sys.modules[fn.__module__], fn.__name__

            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                self._seen(args, kwargs)
                return fn(*args, **kwargs)

            wrapper.__amp_postmortem_wrapped__ = fn
            self._wrapper = wrapper
            setattr(self._module, self._attr, wrapper)

    def _pre_hook(self, module, args, kwargs):
        self._seen(args, kwargs)
        return None

    def _seen(self, args, kwargs) -> None:
        try:
            self._on_call(args, kwargs)
        except Exception:  # noqa: BLE001 - seeing a call never breaks the loss
            pass

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._wrapper is not None:
            if getattr(self._module, self._attr, None) is self._wrapper:
                setattr(self._module, self._attr, self._original)
            self._wrapper = None


def kept_call(args, kwargs) -> tuple[tuple, dict, list]:
    """(args, kwargs, the target tensors) of a loss call, each prediction
    tensor replaced by {PREDICTION_KEY: i, "shape", "dtype"}: the
    prediction is never held (nor its graph)."""
    tensors = list(iter_tensors((args, kwargs)))
    preds = [t for t in tensors if t.requires_grad]
    if not preds and tensors:
        preds = [tensors[0]]
    pred_ids = {id(t): i for i, t in enumerate(preds)}

    def strip(obj, depth=0):
        if isinstance(obj, torch.Tensor):
            i = pred_ids.get(id(obj))
            if i is None:
                return obj  # a target (no gradient: the prediction's are); the object itself, so that
                            # one that is also a model input is saved once
            return {PREDICTION_KEY: i, "shape": list(obj.shape), "dtype": str(obj.dtype).replace("torch.", "")}
        if depth > 32:
            return None
        if type(obj) in (tuple, list):
            return type(obj)(strip(v, depth + 1) for v in obj)
        if type(obj) is dict:
            return {k: strip(v, depth + 1) for k, v in obj.items()}
        return obj

    a, k = strip(tuple(args)), strip(dict(kwargs or {}))
    targets = [t for t in iter_tensors((a, k))]
    return a, k, targets
