"""Parameter gradients (`param_grad` rows), the gradient norm taken when
each backward pass ends, and the optimizer's pre-step hook."""
from __future__ import annotations

import math
import weakref

import torch

from ..layout import PLAIN_TENSORS, local
from .grad_norms import GRAD, NormPlan, cpu_norms, grad_norms, settle
from ..guard import eager_hook
from .state import ACCUMULATE_GRAD, GRAPH_TASK_ID, Shared, dtype_name


class ParamGradCollector:
    """`params`: (name, parameter) pairs; `watched(name)`: a parameter is
    recorded when its module is watched or this says so; `sharded`: ids of
    parameters held as local shards; `late_grads`: ids of parameters whose
    gradients no post-accumulate-grad hook reports (FSDP1 sets them as views
    of its flat gradient): read at the end of each backward pass;
    `flat_views`: (name, `FlatView`) of the parameters of an FSDP1 flat
    parameter without `use_orig_params`, whose gradients are read as
    their slices of the flat gradient, also when the backward pass ends."""

    def __init__(self, shared: Shared, *, params: list, watched_modules: set, watch_param, scaler,
                 optimizer, sharded=frozenset(), late_grads=frozenset(), flat_views=()):
        self.shared = shared
        self.params = params
        self._watched_modules = watched_modules
        self._watch_param = watch_param
        self.scaler = scaler
        self.optimizer = optimizer
        self._sharded = set(sharded)
        self._late_grads = set(late_grads)
        self._late_params: list = []
        self._hooks = None  # (name, parameter, its guarded hook), built at the first register
        # Sampled hooks (`TrainingHooks.sampled_hooks`): a plain parameter's
        # gradient is noted by the nodes of the step's own graph that hand
        # it its gradient (`hook_producers`), not by its AccumulateGrad node.
        self.by_producers = False
        self._targets: dict = {}  # id(parameter) -> (name, parameter, hook): found from the graph
        self._step_handles: list | None = None  # the hooks' handles of the step (TrainingHooks.step_handles)
        self._flat_views = list(flat_views)
        # The gradients the norm and the non-finite count are taken over:
        # the watched parameters', hooked or not (a step that is not
        # sampled hooks none of them).
        self._grad_params = [(pname, p) for pname, p in params if p.requires_grad and self._watched(pname)]
        self._grad_views = [(pname, v) for pname, v in self._flat_views
                            if v.requires_grad and self._watched(pname)]
        self._grad_tensors = [p for _, p in self._grad_params]
        self._grad_names = [pname for pname, _ in self._grad_params]
        self._plain_grads = bool(self._grad_tensors) and not self._grad_views and not any(
            id(p) in self._sharded or type(p) not in PLAIN_TENSORS
            for p in self._grad_tensors)
        # The scale a re-execution's gradients were made with (the scale in
        # force during the step re-executed, not the one after its update).
        self.scale_override = None
        self._norm_plan = None  # grad_norms.NormPlan of the plain gradients, at the first backward
        self._plan_names = None  # their names in the plan's order
        # The backward end's callbacks, guarded, and the engine's queue (read once).
        self._guarded_end = self._guarded_queue = self._queue_callback = None
        # The recorder's FailureGuard behind `shared.guard` (its `wrap`), for
        # the callback that checks it itself (None: a guard of another kind).
        self._failure_guard = getattr(shared.guard, "__self__", None)
        self._no_grad = torch.no_grad()  # reusable: entered and left by the training thread only
        # The sentinel's test of a gradient norm against its spike bound, in
        # a job whose update follows every step (`StepSentinel`); None: none.
        self.norm_within = None

    def _watched(self, pname: str) -> bool:
        return pname.rpartition(".")[0] in self._watched_modules or self._watch_param(pname)

    def register_step_hook(self, handles: list) -> None:
        """The optimizer's pre-step hook: on every step, sampled or not."""
        if self.optimizer is not None and hasattr(self.optimizer, "register_step_pre_hook"):
            handles.append(self.optimizer.register_step_pre_hook(eager_hook(self.shared.guard, self._on_opt_pre)))

    def register(self, handles: list) -> None:
        """A post-accumulate-grad hook per watched parameter (built once,
        registered on every sampled step); with `by_producers`, a plain
        parameter's waits for the forward's graph (`hook_producers`)."""
        if self._hooks is None:
            guard = self.shared.guard
            self._hooks, self._late_params = [], []
            for pname, p in self._grad_params:
                hook = self._make_param_hook(pname, p)
                if id(p) in self._late_grads:
                    self._late_params.append((pname, p, hook))
                    continue
                # Run eagerly even when the backward runs inside compiled
                # code: dynamo would otherwise compile one frame per shape.
                self._hooks.append((pname, p, eager_hook(guard, hook)))
            self._targets = {id(entry[1]): entry for entry in self._hooks
                             if type(entry[1]) in PLAIN_TENSORS and entry[1].is_leaf}
        self._step_handles = handles
        for _, p, hook in self._hooks:
            if not (self.by_producers and id(p) in self._targets):
                handles.append(_accumulator_hook(p, hook))

    def hook_waiting(self) -> None:
        """The AccumulateGrad hooks `register` left to `hook_producers`,
        registered now (`by_producers` turned off while attached)."""
        for _, p, hook in self._hooks or ():
            if id(p) in self._targets:
                self._step_handles.append(_accumulator_hook(p, hook))

    def hook_producers(self, st, outputs) -> None:
        """A sampled step's forward has made `outputs` (the root's floating
        outputs): hook the nodes of their graph that hand a watched plain
        parameter its gradient. A hook on the parameter's AccumulateGrad
        node would outlive the step: torch keeps a node's C++ hook after
        its Python hook is removed, and a loop that holds its loss until
        the next forward (as `for` loops do) hands that node from graph to
        graph, so every later backward took the GIL and wrapped every
        gradient for an empty dict (4.7% of the launch-bound proxy's step,
        for good, after the first full-tier step). These nodes die with
        the step's graph. The order is noted when the gradient is made (the
        node runs right before the accumulation, which autograd runs
        first), the statistics are taken from `p.grad` when the backward
        pass ends (`_on_backward_end`): the accumulated value, as the
        AccumulateGrad hook read it last. A parameter the graph does not
        reach (used in a reentrant checkpoint's region, or by the loss
        outside the model), and every parameter of a job with a process
        group, keep the AccumulateGrad hook."""
        targets = self._targets
        if not targets or self._step_handles is None:
            return
        if self._sharded or self._late_grads or self._flat_views or _process_group():
            # A collective may rewrite `p.grad` before the pass ends (DDP
            # copies its averaged buckets back): the rows stay the local
            # gradients, read as they are accumulated.
            found, hit = {}, ()
        else:
            found, hit = _producers(outputs, targets)
        handles, guard_call = self._step_handles, self.shared.guard_call
        for node, slots in found.items():
            handles.append(node.register_hook(guard_call(self._note_producers, st, tuple(slots))))
        if not st.producers_walked:  # the step's first forward: the others' parameters as before
            st.producers_walked = True
            for key, (_, p, hook) in targets.items():
                if key not in hit:
                    handles.append(_accumulator_hook(p, hook))

    def _note_producers(self, st, slots, grad_inputs, grad_outputs) -> None:
        shared = self.shared
        if shared.state is not st or shared.paused or not st.record:
            return
        grads = st.param_grads
        for slot, pname, p in slots:
            if pname not in grads and slot < len(grad_inputs) and grad_inputs[slot] is not None:
                grads[pname] = [st.bwd_order, None, None, None, None]  # its statistics at the pass's end
                st.bwd_order += 1
                st.noted_grads[pname] = p
        self.await_backward_end(st)
        st.forward_open = False

    def scale_tensor(self):
        if self.scale_override is not None:
            return self.scale_override
        if self.scaler is None:
            return None
        s = getattr(self.scaler, "_scale", None)
        return s if isinstance(s, torch.Tensor) else None

    def end_step(self, st) -> None:
        append_row = self.shared.append_row
        for pname, (order, s, _, dtype, numel) in st.param_grads.items():
            if s is not None:  # None: noted (`hook_producers`), no gradient read since
                append_row(st, pname, "param_grad", "backward", order, 0, dtype, numel, s)

    def _make_param_hook(self, pname, registered):
        ref = weakref.ref(registered)
        shared = self.shared

        def hook(p):
            # Backward runs with grad mode off: check the step, not grad mode.
            st = shared.state
            if shared.paused or not st.record or p.grad is None or p is not ref():
                return
            self.await_backward_end(st)
            st.forward_open = False
            self._record_grad(st, pname, p.grad)
        return hook

    def _record_grad(self, st, pname, g) -> None:
        scale = self.scale_tensor()
        shared = self.shared
        # Unscaled by the loss scale when there is one; without, the
        # cheap tier's fast path (no keyword options) serves.
        s = shared.stats(st, g, scale=scale, unscale=True) if scale is not None else shared.stats(st, g)
        # Keep the statistics, not the gradient: `zero_grad()` must be
        # able to free it before `rec.step()`. Slot 2: no norm of its
        # own (the global norm is taken once, when the backward pass ends).
        dtype = dtype_name(g.dtype)
        numel = g.numel() if type(g) in PLAIN_TENSORS else local(g).numel()
        slot = st.param_grads.get(pname)
        if slot is None:
            st.param_grads[pname] = [st.bwd_order, s, None, dtype, numel]
            st.bwd_order += 1
        else:  # gradient accumulation: the last accumulated value wins
            slot[1], slot[3], slot[4] = s, dtype, numel

    # ------------------------------------------------------ gradient norm
    def await_backward_end(self, st) -> None:
        """Take the gradient norm when this backward pass has ended: the
        gradients are complete (DDP's all-reduce and FSDP's reduce-scatter
        done), still scaled, and not yet clipped by the user. Queued once
        per backward pass, from its first hook; the callback queues the
        measurement once more so that it runs after the callbacks that
        DDP and FSDP queue during the same pass."""
        if GRAPH_TASK_ID is None:  # an older torch: no pass to wait for
            return
        task = GRAPH_TASK_ID()
        if task == -1 or st.backward_task == task:
            return
        st.backward_task = task
        if self._guarded_end is None:  # built once: a wrapper per step cost as much as the rest of the hook
            engine = torch.autograd.Variable._execution_engine
            guard = self.shared.guard
            self._guarded_end = guard(self._on_backward_end, traced=False)
            self._guarded_queue = guard(engine.queue_callback, traced=False)
            self._queue_callback = engine.queue_callback
        end = _BackwardEnd()  # its slots set here: no `__init__` frame, every pass
        end.collector, end.st = self, st
        # The callbacks the measurement must follow are those of collective
        # wrappers (DDP, FSDP, DeepSpeed), which need a process group: in a
        # job without one the callback measures at once (a second trip from
        # the engine into Python a step spared). Read every pass: a group
        # may be made after the recorder.
        end.queued = not (self._sharded or self._late_grads or self._flat_views or _process_group())
        self._queue_callback(end)

    def _on_backward_end(self, st) -> None:
        shared = self.shared
        if shared.state is not st or shared.paused:
            return
        st.backward_passes += 1
        if st.record:
            st.last_sum = None  # its gradient need not outlive the pass
            for pname, p, hook in self._late_params:
                hook(p)
            for pname, view in self._grad_views:
                g = view.grad()
                if g is not None:
                    self._record_grad(st, pname, g)
            for pname, p in st.noted_grads.items():  # `hook_producers`: accumulated by now
                g = p.grad
                if g is not None:
                    self._record_grad(st, pname, g)
        self._measure_grad_norm(st, self.scale_tensor())
        sq = st.grad_sq_host  # after the read above: the parameters are in the caches
        self.shared.bundles.on_backward_end(clean=not st.record and sq is not None and math.isfinite(sq))

    def _grad_at(self, i: int):
        """The gradient of the `i`-th plain parameter (`settle`'s float64 retake)."""
        return self._grad_tensors[i].grad

    def _measure_grad_norm(self, st, scale) -> None:
        """Square sums of this rank's gradients (local shards), unscaled
        with `scale` (None: already unscaled); every micro-batch's backward
        overwrites them, so the last one's accumulated gradients count."""
        if torch.is_grad_enabled():
            # A backward with create_graph=True (gradients that carry a
            # graph), or the optimizer's pre-step hook: measured without
            # autograd. The usual backward's end runs with grad mode off,
            # where entering no_grad cost ~6 us of the MLP's step.
            with self._no_grad:
                return self._measure_grad_norm(st, scale)
        if self._plain_grads:
            # The usual job: plain tensors, nothing sharded; one pass for
            # every gradient, in one list (the per-parameter checks below
            # cost a few microseconds a parameter, every step).
            names = self._grad_names
            try:
                # A missing gradient (None) raises: the loop below checks
                # each one (testing each here would cost per-parameter
                # Python every step; `in` compares with ==).
                if self._grad_tensors[0].is_cpu:  # read each time: a model may move
                    plan = self._norm_plan
                    if plan is None:
                        plan = self._norm_plan = NormPlan(self._grad_tensors)
                        self._plan_names = plan.in_order(names)
                    # The gradients read are kept with the step (`grads_read`)
                    # until it ends: letting them go at once cost 1.35 points
                    # of the launch-bound proxy (RESULTS.md, 2026-12-07
                    # 17:05; why is not established: torch keeps each one's
                    # Python object while the gradient lives either way).
                    # They die with the step's state: no longer than to
                    # `rec.step()`, as a loop's gradients live.
                    if plan.simple:
                        # One reduction, one read, the square sum in C
                        # (the usual small model: no group, no big matrix).
                        st.grads_read = grads = list(map(GRAD, self._grad_tensors))
                        norms, st.grad_sq_host = settle(torch.stack(torch._foreach_norm(grads, 2)), self._grad_at)
                    elif plan.useful:
                        # In the plan's order, names alike: no list of
                        # every gradient, no reordering of the norms.
                        st.grads_read = read = []
                        names = self._plan_names
                        if scale is None or _unscales(scale):
                            # Finite gradients: their square sum, no norm
                            # a gradient (`NormPlan.facts`); the writer and
                            # the sentinel need the norms only for a NaN/Inf.
                            norms, st.grad_sq_host = plan.facts(read)
                            if norms is None:
                                st.grad_norms = st.grad_norm_names = None
                                st.grad_scale = scale
                                return
                        else:  # a scale of 0 or Inf: each norm unscaled (`grad_facts`)
                            norms, st.grad_sq_host = settle(plan.norms(read), plan.grad_at)
                    else:
                        st.grads_read = grads = list(map(GRAD, self._grad_tensors))
                        norms, st.grad_sq_host = cpu_norms(grads, plan.work, plan.uniform, plan.big)
                else:
                    norms = grad_norms(list(map(GRAD, self._grad_tensors)), on_host=False)
            except (TypeError, RuntimeError, AttributeError):
                norms = None
            if norms is not None:
                st.grad_norms = norms
                st.grad_norm_names = names
                st.grad_scale = scale  # a flag: its value is read as the step's loss_scale_before
                return
        grads, sharded, names = [], [], []
        for pname, p in self._grad_params:
            g = p.grad
            if g is not None:
                # A gradient needs no detach unless it carries a graph
                # (create_graph=True): a new tensor object per parameter
                # and step otherwise.
                g = local(g.detach() if g.requires_grad else g)
                if g.numel():
                    grads.append(g)
                    sharded.append(id(p) in self._sharded)
                    names.append(pname)
        for pname, view in self._grad_views:
            g = view.grad()
            if g is not None and g.numel():
                grads.append(g)
                sharded.append(view.sharded)
                names.append(pname)
        if not grads:
            return
        if any(sharded):
            # The sharded part's square sum needs the mask: taken here.
            sq = grad_norms(grads) ** 2
            if scale is not None:
                sq = sq / scale.detach().to(torch.float64) ** 2
            st.grad_sqsum = sq.sum()
            st.sharded_sqsum = sq[torch.tensor(sharded, device=sq.device)].sum()
            st.grad_nonfinite = (~torch.isfinite(sq)).sum()
            return
        # One multi-tensor reduction; the square sum, the unscaling and the
        # non-finite count (a gradient's norm is finite exactly when its
        # values are: grad_norms takes a float32 overflow again in float64)
        # are left to whoever reads the norms (`StepRows`, off the training
        # thread, or `reexecute.host_facts` on the CPU).
        st.grad_norms = grad_norms(grads, as_float64=False)
        st.grad_norm_names = names
        st.grad_scale = scale

    @staticmethod
    def _clean_on_host(st) -> bool:
        """Every statistic of the step so far is a host value (the CPU) and
        none counts a NaN or an Inf: no tensor trigger can fire for this
        step, so the bundles need no copy of its weights (the copy of every
        parameter cost as much as all the statistics of a step). Device
        statistics are never read here."""
        if st.device is not None:
            return False
        for row in st.stats:
            if row[1] or row[2]:
                return False
        for slot in st.param_grads.values():
            row = slot[1]
            if type(row) is not tuple or row[1] or row[2]:
                return False
        return True

    def _on_opt_pre(self, optimizer, args, kwargs):
        st = self.shared.state
        st.stepped = True
        if st.grad_sqsum is None and st.grad_norms is None and st.grad_sq_host is None:
            # No backward pass was seen ending (gradients set by hand, say):
            # the gradients as the optimizer gets them. A fused optimizer
            # stepped by GradScaler gets them still scaled, with the scale.
            scale = getattr(optimizer, "grad_scale", None)
            self._measure_grad_norm(st, scale if isinstance(scale, torch.Tensor) else None)
        if st.record:
            self.shared.flush_full()  # the full tier's rows, read below
            clean = self._clean_on_host(st)
        else:
            # Not sampled: no rows, only the gradient facts. On the CPU
            # they are host values (read without a sync): finite gradients
            # under the spike bound leave the loss as the only trigger.
            if st.grad_sq_host is not None:
                sq = st.grad_sq_host  # read when the norms were taken
                clean = math.isfinite(sq)
                if clean and st.grad_scale is None and self.norm_within is not None:
                    # A norm spike is an event too (the sentinel's bound): its
                    # weights are copied before this update changes them.
                    clean = self.norm_within(math.sqrt(sq))
            else:
                norms = st.grad_norms if st.grad_norms is not None else st.grad_sqsum
                clean = norms is not None and norms.is_cpu and bool(torch.isfinite(norms).all())
                if clean and st.grad_scale is None and self.norm_within is not None:
                    # The same bound where the gradients were read one by one
                    # (a parameter without a gradient, say): the square sum
                    # of their norms, or the sum taken, on the host.
                    sq = (float(st.grad_sqsum) if norms is st.grad_sqsum
                          else float(norms.double().square().sum()))
                    clean = math.isfinite(sq) and self.norm_within(math.sqrt(sq))
        self.shared.bundles.on_optimizer_pre_step(clean_on_host=clean)


def _unscales(scale) -> bool:
    """A CPU loss scale the gradients' square sum can be divided by (not 0,
    NaN or Inf): the norms of each gradient are not needed to unscale it."""
    if not isinstance(scale, torch.Tensor) or not scale.is_cpu or scale.numel() != 1:
        return False
    value = scale.item()
    return value != 0 and math.isfinite(value)


_C10D = torch.distributed.distributed_c10d if torch.distributed.is_available() else None
# torch's `_World`, when it holds the default group in a plain attribute
# (`_default_pg`): read there, not through `GroupMember.WORLD`'s two
# properties (two frames on every backward pass). Any other (another torch,
# a replaced `_world`) is asked through `GroupMember.WORLD`.
_WORLD_TYPE = type(_C10D._world) if _C10D is not None and "_default_pg" in vars(_C10D._world) else None


def _process_group() -> bool:
    """`torch.distributed.is_initialized()` in attribute reads (a function
    call through the package costs ~3 us cold, on every step)."""
    if _C10D is None:
        return False
    world = _C10D._world
    return (world._default_pg if type(world) is _WORLD_TYPE else _C10D.GroupMember.WORLD) is not None


def _producers(outputs, targets: dict) -> tuple[dict, set]:
    """The nodes of `outputs`' graph that hand a parameter of `targets`
    (id -> (name, parameter, hook)) its gradient: ({node: [(slot, name,
    parameter)]}, the ids of the parameters found)."""
    found: dict = {}
    hit = set()
    seen = set()
    todo = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for slot, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            if type(nxt) is ACCUMULATE_GRAD:
                entry = targets.get(id(nxt.variable))
                if entry is not None:
                    found.setdefault(node, []).append((slot, entry[0], entry[1]))
                    hit.add(id(entry[1]))
            elif nxt not in seen:
                todo.append(nxt)
    return found, hit


def _accumulator_hook(p, hook):
    """`hook(p)` after each accumulation into `p.grad`, for as long as the
    returned handle is held. A plain parameter's hook goes on its
    AccumulateGrad node, which torch frees when no graph holds it: once the
    handle lets go, the next step's node has none. A tensor's own
    post-accumulate-grad hook never leaves it: torch keeps calling its
    emptied dict on every backward, for every parameter that ever had one
    (taking the GIL each time: 2.5% of the launch-bound proxy's step, its
    288 parameters hooked once by the first full-tier step)."""
    if type(p) in PLAIN_TENSORS and p.is_leaf:
        try:
            with torch.enable_grad():
                node = p.view_as(p).grad_fn
            acc = node.next_functions[0][0] if node is not None and node.next_functions else None
        except RuntimeError:  # inference mode
            acc = None
        if acc is not None and type(acc) is ACCUMULATE_GRAD:
            return _NodeHook(acc, acc.register_hook(lambda grad_inputs, grad_outputs: hook(p)))
    return p.register_post_accumulate_grad_hook(hook)


class _NodeHook:
    """The handle of `_accumulator_hook`'s node hook: holds the node (so that
    every graph of the step accumulates through it) until removed."""

    __slots__ = ("node", "handle")

    def __init__(self, node, handle):
        self.node, self.handle = node, handle

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
        self.node = self.handle = None


class _BackwardEnd:
    """The callback queued when a backward pass begins (one small object
    per pass, holding its step): it queues itself once more (unless made
    `queued`), so that it runs after the callbacks DDP and FSDP queue during
    the pass, then takes the gradient facts (guarded: an exception turns
    recording off)."""

    __slots__ = ("collector", "st", "queued")

    def __call__(self):
        collector = self.collector
        if not self.queued:
            self.queued = True
            collector._guarded_queue(self)
            return
        guard = collector._failure_guard
        if guard is None:
            collector._guarded_end(self.st)
        elif guard.enabled:  # the guard's checks written out: a wrapper's frame a step less
            try:
                collector._on_backward_end(self.st)
            except Exception as exc:  # noqa: BLE001 - the training must go on
                guard.fail(exc)
