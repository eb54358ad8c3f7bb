"""What autocast really ran, read where the model's modules run.

Accelerate wraps the root's `forward` in autocast *after* the root's
pre-hooks, and Lightning's root forward never runs: the state is read at
the first recorded forward and again at the root's children's calls, until
one of them has seen it on (or a whole step of child calls saw it off).
"""
from __future__ import annotations

import torch

from ..layout import unwrap


# One call for "no autocast on any device" (read at every step's forward).
_any_enabled = getattr(torch._C, "_is_any_autocast_enabled", None)
_last: list = [None, None]  # (device, dtype, cache) last read, and the dict made of it


def read_autocast() -> dict:
    """The autocast state: enabled, device_type, dtype (name), cache_enabled.
    Read at every step's forward: the usual device is tried first, and the
    dict of an unchanged state is made once (never changed in place)."""
    cache = torch.is_autocast_cache_enabled()
    found = (None, None, cache)
    if _any_enabled is None or _any_enabled():
        for dev in ("cuda", "cpu", "xpu", "mps"):
            try:
                if torch.is_autocast_enabled(dev):
                    found = (dev, torch.get_autocast_dtype(dev), cache)
                    break
            except (RuntimeError, TypeError, AttributeError):
                continue
    if _last[0] != found:
        dev, dtype, cache = found
        _last[:] = [found, {"enabled": dev is not None, "device_type": dev,
                            "dtype": str(dtype).replace("torch.", "") if dtype is not None else None,
                            "cache_enabled": cache}]
    return _last[1]


class AutocastWatch:
    """`on_autocast(info)` is told the autocast state at the first recorded
    forward, and again if the root's children run under an autocast the
    root did not see. `active()`: the step state when a forward hook
    records (ForwardCollector.active)."""

    def __init__(self, shared, on_autocast, active):
        self.shared = shared
        self._on_autocast = on_autocast
        self._active = active
        self.autocast: dict | None = None  # as the first recorded forward saw it
        self._from_child = False  # the root's children have told what ran
        self.children_ran = False  # ... in the step in progress

    def hooks(self, model, graph=None) -> list:
        """(register method, hook, keywords) of a pre-hook on each of the
        root's children; `graph`: the in-graph statistics
        (`graph_stats.GraphStats`), which read autocast where dynamo traces
        the children."""
        hook = self.shared.guard(self._on_child_pre) if graph is None else \
            self.shared.guard(self._on_child_pre, in_graph=graph.child_pre)
        return [(child.register_forward_pre_hook, hook, {}) for child in unwrap(model).children()]

    def at_first_forward(self) -> None:
        if self.autocast is None:
            self._note(read_autocast())

    def end_step(self) -> None:
        if self.children_ran:  # a whole step of child calls saw no autocast
            self._from_child = True
            self.children_ran = False  # asked no more: nothing for later steps' ends to do

    def _on_child_pre(self, module, args):
        if self._from_child or self._active() is None:
            return
        self.children_ran = True
        info = read_autocast()
        if not info["enabled"]:
            # A child called outside the autocast region (an embedding
            # looked up before it) is not the last word: every child call
            # of the step is asked (end_step stops asking).
            return
        self._from_child = True
        # Only "on" overrides: a child may run in float32 on purpose.
        if not (self.autocast or {}).get("enabled"):
            self._note(info)
            self.shared.bundles.on_autocast(info)  # the step's capture began at the root

    def _note(self, info: dict):
        self.autocast = info
        self._on_autocast(info)
