"""Reentrant activation checkpointing: the region's forward ran under
no_grad (no graph, so no backward hooks then) and is recomputed in
backward, the only time it builds an autograd graph: its modules'
backward hooks are set there, with no forward row again."""
from __future__ import annotations

import torch

from ..stats import float_tensors
from .backward import BackwardCollector, input_edges
from .state import Shared, in_backward


class CheckpointRecompute:
    def __init__(self, shared: Shared, backward: BackwardCollector):
        self.shared = shared
        self.backward = backward
        # The node watches of the region being recomputed: its calls share a
        # node's hooks as in the forward (a container's output is its last
        # child's), so the rows keep the forward's order; let go when the
        # region's outermost call ends (held to the step's end, they would
        # hold the recomputed graph that checkpointing frees).
        self._watches: dict = {}
        self._depth = 0

    def _state(self):
        """The step state while a reentrant checkpoint recomputes its region."""
        shared = self.shared
        st = shared.state
        if shared.paused or not st.record or not in_backward():
            return None
        node = torch._C._current_autograd_node()
        return st if node is not None and type(node).__name__ == "CheckpointFunctionBackward" else None

    def pre(self, name, args, kwargs):
        st = self._state()
        if st is None:
            return
        # The original call it repeats: regions are recomputed last first,
        # so the latest call of this module not yet matched.
        ctx = next((c for c in reversed(st.contexts) if c.name == name and c.no_grad
                    and c.micro_batch == st.micro_batches - 1), None)
        if ctx is None:
            return
        ctx.no_grad = False  # matched
        st.recompute_stacks.setdefault(name, []).append((ctx, input_edges(float_tensors((args, kwargs)))))
        self._depth += 1

    def post(self, name, output):
        st = self._state()
        stack = st.recompute_stacks.get(name) if st is not None else None
        if not stack:
            return
        ctx, keys = stack.pop()
        try:
            self.backward.watch_call(ctx, keys, [t for t in float_tensors(output) if t.requires_grad],
                                     watches=self._watches)
        finally:
            self._depth -= 1
            if self._depth <= 0:
                self._depth = 0
                self._watches = {}
