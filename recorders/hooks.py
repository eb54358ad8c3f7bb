"""The recorder's hooks: what runs on the training path, assembled.

`TrainingHooks` builds one collector per concern (`recorders/collectors/`:
forward and inputs, backward, parameter gradients and the gradient norm,
checkpoint recompute, autocast, and with a probe the op probe) around one
`Shared` (the step in progress), registers their hooks and removes them;
`graph` (`GraphStats`) is what the module hooks run while dynamo traces
them (the rows of compiled modules), its buffer taken at each step's end.
`AmpRecorder` owns the lifecycle and hands the finished step to the writer
thread.

With `sampled_hooks`, the collectors' hooks are registered only for the
steps recorded (`begin_step` adds them before the step's first forward and
removes them when a step that is not recorded comes): the other steps run
with the root's two hooks and the optimizer's (`SentinelHooks`), so torch's
dispatch finds nothing to call on any other module, parameter or autograd
node. Without it (every step recorded, or a compiled model, whose graphs
guard on its hooks), they stay registered from `register()` to `remove()`.
"""
from __future__ import annotations

import contextlib

from .format import schema
from .collectors.autocast import AutocastWatch
from .collectors.backward import BackwardCollector
from .collectors.forward import ForwardCollector
from .collectors.graph_stats import GraphStats
from .collectors.params import ParamGradCollector
from .collectors.probe import ProbeCollector
from .collectors.recompute import CheckpointRecompute
from .collectors.sentinel import SentinelHooks
from .collectors.updates import LostUpdates
from .collectors.state import Shared, StepState
from .manifest import scaler_enabled


def model_device(model):
    """The device of the model's first parameter or buffer (the CPU for
    a model without any)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return "cpu"


class TrainingHooks:
    """The hooks on the model, its parameters and the optimizer, and the
    state of the step in progress. `compiled_rows`: the cheap rows of
    modules traced into a compiled graph are computed there (`GraphStats`).

    `guard(fn)` wraps every hook (the recorder's: an exception turns
    recording off, never the training), `guard_call(fn, a, b)` the
    backward hooks set anew for every module call; `bundles` is the bundle
    capture (its `on_*` hooks); `on_autocast(info)` is told the autocast
    state at the first recorded forward, and again if the root's children
    run under an autocast the root did not see. `probe`: the
    `ProbeOptions` (None: no op probe, no hook of it), with `probed` (the
    module names it probes on every recorded step), `probe_leaves` (on
    full-tier steps) and `on_probe_error(exc)` (the recorder's failure path).
    """

    def __init__(self, model, *, optimizer, scaler, watched: list[str],
                 watch_param, near_overflow: float, guard, guard_call, bundles, on_autocast,
                 modules: dict | None = None, params: list | None = None, sharded=frozenset(),
                 late_grads=frozenset(), flat_views=(), compiled_rows=False, probe=None, probed=(), probe_leaves=(), on_probe_error=None,
                 sampled_hooks: bool = False, on_backward_start=None):
        self.model = model
        self.shared = Shared(near_overflow=near_overflow, guard=guard, guard_call=guard_call, bundles=bundles)
        # name -> module to hook: the unwrapped modules; the root ("") is
        # hooked on the outermost module, the one the training loop calls.
        modules = dict(modules) if modules is not None else dict(model.named_modules())
        modules[""] = model
        params = list(params) if params is not None else list(model.named_parameters())
        watched = list(watched)
        self.params = ParamGradCollector(
            self.shared, params=params, watched_modules=set(watched), watch_param=watch_param,
            scaler=scaler if scaler_enabled(scaler) else None, optimizer=optimizer,
            sharded=sharded, late_grads=late_grads, flat_views=flat_views)
        self.updates = LostUpdates(params=params, optimizer=optimizer, guard=guard,
                                   recording=lambda: self.shared.state.record and not self.shared.paused)
        self.backward = BackwardCollector(self.shared, on_root_grad=self.params.await_backward_end)
        self.recompute = CheckpointRecompute(self.shared, self.backward)
        self.autocast_watch = AutocastWatch(self.shared, on_autocast, active=lambda: self.forward.active())
        # The rows of modules traced into a compiled graph: one slot each,
        # bound now (a hook added after the first compiled call never runs).
        self.graph = GraphStats(watched, device=model_device(model), rows=compiled_rows)
        self.forward = ForwardCollector(
            self.shared, model=model, modules=modules, watched=watched, params=params,
            sharded=set(sharded), backward=self.backward, recompute=self.recompute,
            autocast=self.autocast_watch, flat_views=flat_views, graph=self.graph)
        self.probe = None
        if probe is not None and (probed or probe_leaves):
            self.probe = ProbeCollector(self.shared, modules=modules, named=probed, leaves=probe_leaves,
                                        active=self.forward.active, fail=on_probe_error,
                                        max_ops=probe.max_ops_per_call)
        self.sentinel = SentinelHooks(self.shared, model=model, params=self.params, on_backward_start=on_backward_start)
        self.sampled_hooks = bool(sampled_hooks)
        self.params.by_producers = self.sampled_hooks  # see ParamGradCollector.hook_producers
        self.handles: list = []  # the hooks of every step (the root's, the optimizer's)
        self.step_handles: list = []  # the collectors' hooks
        self.attached = False  # the collectors' hooks are registered
        self.registered = False

    # The state the recorder reads and sets.
    @property
    def state(self) -> StepState:
        return self.shared.state

    @property
    def paused(self) -> int:
        """`paused()` depth: forward/backward passes not recorded."""
        return self.shared.paused

    @paused.setter
    def paused(self, depth: int) -> None:
        self.shared.paused = depth
        self.graph.set_gate(self.shared.state.record and not depth)

    @contextlib.contextmanager
    def pausing(self, value=None):
        """`rec.paused()`: passes inside are not recorded; yields `value`."""
        self.paused += 1
        try:
            yield value
        finally:
            self.paused -= 1

    @property
    def autocast(self) -> dict | None:
        """The autocast state as the first recorded forward saw it."""
        return self.autocast_watch.autocast

    def begin_step(self, step_id: int, tier: str | None) -> None:
        """Start collecting the step `step_id` at `tier` ('full', 'cheap' or
        None: not recorded)."""
        self.shared.state = StepState(step_id, tier is not None, tier == "full")
        # Tests written out, not calls: this runs at every step's end.
        if self.updates.params:  # its hooks exist only then
            self.updates.begin_step(step_id)
        gate = tier is not None and not self.shared.paused
        if gate != self.graph.gate_on:
            self.graph.set_gate(gate)
        if self.registered and self.sampled_hooks:
            if tier is not None:
                self.attach()
            elif self.attached:
                self.detach()

    def raise_to_full(self) -> bool:
        """Record the step in progress at the full tier, when nothing of it
        has been yet (a step not sampled included: its hooks are added
        now); False when its forward has begun (a full step needs full rows
        from its first hook on)."""
        st = self.shared.state
        if st.micro_batches or st.meta:
            return False
        if not st.record:
            if not self.sampled_hooks:
                return True  # every step's hooks are there: an unrecorded step stays so
            st.record = True
            st.containers()
            self.graph.set_gate(not self.shared.paused)
            self.attach()
        st.full = True
        return True

    def keep_attached(self) -> None:
        """From now on the collectors' hooks stay registered (a model found
        compiled: its graphs guard on the hooks they were traced with)."""
        self.sampled_hooks = False
        if self.params.by_producers:
            self.params.by_producers = False
            if self.attached:  # this step's plain parameters waited for the graph: hooked now
                self.params.hook_waiting()
        if self.registered:
            self.attach()

    def register(self) -> None:
        self.registered = True
        self.sentinel.register(self.handles)
        self.params.register_step_hook(self.handles)
        self.updates.register(self.handles)
        if not self.sampled_hooks or self.shared.state.record:
            self.attach()

    def attach(self) -> None:
        """Register the collectors' hooks (no-op when they are)."""
        if self.attached:
            return
        self.attached = True
        self.forward.register(self.step_handles)
        self.params.register(self.step_handles)
        if self.probe is not None:
            self.probe.register(self.step_handles)  # after the forward collector's (see its doc)

    def detach(self) -> None:
        """Remove the collectors' hooks; between steps only (see `remove`)."""
        if self.attached:
            self.attached = False
            _remove_all(self.step_handles)

    def remove(self) -> None:
        # Never called from inside a hook: removing forward hooks while
        # torch iterates over them would break the user's forward pass.
        self.detach()
        _remove_all(self.handles)
        self.registered = False

    def end_step(self, loss) -> StepState:
        """Add the rows known only at step end (gradients still awaited,
        parameter gradients, the loss, parameter values) and return the
        finished step's state. `loss`: the detached loss tensor or None."""
        shared = self.shared
        st = shared.state
        st.grads_read = None  # the optimizer has stepped: the gradients go with the loop's
        if self.autocast_watch.children_ran:
            self.autocast_watch.end_step()
        if not (st.record or st.contexts or st.param_grads or st.param_values):
            # A step not sampled (most steps): no collector holds anything
            # to finish; a compiled graph's values are taken (dropped).
            shared.flush_stage()
            if self.graph.ran:
                self.graph.take()
            return st
        self.backward.end_step(st)
        self.params.end_step(st)
        if st.record and loss is not None and loss.numel():
            s = shared.stats(st, loss.float())
            shared.add_row(st, schema.LOSS_NAME, "loss", "forward", st.fwd_order, 0, loss, s)
            st.fwd_order += 1
        self.forward.end_step(st)
        shared.flush_stage()  # every row is in: the staged ones get their values
        values = self.graph.take()
        st.graph_values = values if st.record else None
        return st


def _remove_all(handles: list) -> None:
    for h in handles:
        try:
            h.remove()
        except Exception:
            pass
    handles.clear()
