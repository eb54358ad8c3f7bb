"""The recorder's hooks: what runs on the training path.

Every hook only enqueues device work (a statistics vector per tensor, see
`stats.py`) and appends host-side metadata; nothing here reads a device
value. A row's `input_nonfinite` is not computed here: the row notes which
rows hold its inputs (their NaN/Inf counts) and the writer thread adds
them up, so a module costs no tensor op beyond its own statistics. `TrainingHooks` owns the hook handles and the state of the step in
progress (`StepState`); `AmpRecorder` owns the lifecycle and hands the
finished step to the writer thread.
"""
from __future__ import annotations

import functools
import sys
import weakref

import torch

from . import schema
from .layout import local, unwrap
from .manifest import scaler_enabled
from .aggregate import COUNT_KIND
from .stats import CHEAP_WIDTH, FULL_WIDTH, float_tensors, pad_row, row_stats


class _CallContext:
    """One forward call of a watched module, kept alive by its backward hooks."""

    __slots__ = ("name", "call", "input_rows", "grad_out_rows", "pending",
                 "is_root", "micro_batch", "step_id", "no_grad")

    def __init__(self, name, call, input_rows, is_root, micro_batch, step_id):
        self.name = name
        self.call = call
        self.input_rows = input_rows  # rows holding the inputs' NaN/Inf counts (None: no input)
        self.grad_out_rows = None  # rows of the gradients that reached the outputs so far
        self.pending = {}  # input index -> [expected, arrived, parts]
        self.is_root = is_root
        self.micro_batch = micro_batch
        self.step_id = step_id
        # Ran under no_grad inside a recorded forward (a reentrant
        # checkpoint region): its backward hooks are set in the recompute.
        self.no_grad = not torch.is_grad_enabled()


class StepState:
    """What the hooks collected during one optimizer step (training thread)."""

    def __init__(self, step_id: int, record: bool, full: bool):
        self.step_id = step_id
        self.record = record
        self.full = full
        self.micro_batches = 0
        self.forward_open = False  # a micro-batch's forward ran, its backward not yet
        self.opened_by_child = False  # ... and a submodule, not the root, opened it
        self.micro_batch_start = None  # (rows, contexts) before the micro-batch in progress
        self.meta: list[tuple] = []
        self.stats: list = []  # host lists or device vectors (stats.row_stats)
        self.fwd_order = 0
        self.bwd_order = 0
        self.calls: dict[str, int] = {}
        self.stacks: dict[str, list[_CallContext]] = {}
        self.recompute_stacks: dict[str, list] = {}  # reentrant recomputation: (context, input edges)
        self.param_grads: dict[str, list] = {}  # name -> [order, stats, sqnorm, dtype, numel]
        self.contexts: list[_CallContext] = []
        self.producers: dict[int, tuple] = {}  # id(tensor) -> (weakref, row of its statistics)
        # output node of a watched module's call -> (its walk's boundary, the
        # edges that left its walk): see _hook_grad_inputs. Held for one
        # forward (node objects, not their saved tensors).
        self.walks: dict = {}
        self.last_sum = None  # (weak refs to the parts, their sum): the last grad_input summed
        self.stepped = False
        self.grad_sqsum = None  # square sum of this rank's unscaled gradients (local shards), on the device
        self.sharded_sqsum = None  # its part from the local shards of sharded gradients
        self.backward_task = None  # the autograd graph task whose end is awaited
        self.backward_passes = 0  # ended backward passes (counts micro-batches a compiled forward hides)
        self.in_forward = 0  # depth of root forwards being recorded (checkpointing's no_grad regions count)
        self.param_values: list[tuple] = []
        self.device = None


class _TensorInfo:
    """dtype and numel of a tensor, without keeping the tensor alive."""

    __slots__ = ("dtype", "_numel")

    def __init__(self, t):
        self.dtype = t.dtype
        self._numel = local(t).numel()

    def numel(self):
        return self._numel


def _read_autocast() -> dict:
    info = {"enabled": False, "device_type": None, "dtype": None}
    for dev in ("cuda", "cpu", "xpu", "mps"):
        try:
            if torch.is_autocast_enabled(dev):
                info = {"enabled": True, "device_type": dev,
                        "dtype": str(torch.get_autocast_dtype(dev)).replace("torch.", "")}
                break
        except (RuntimeError, TypeError, AttributeError):
            continue
    info["cache_enabled"] = torch.is_autocast_cache_enabled()
    return info


def _in_backward() -> bool:
    try:
        return torch._C._current_graph_task_id() != -1
    except AttributeError:  # an older torch without it: record recomputations too
        return False


def _eager(fn):
    """`fn` run eagerly even when called from compiled code (a compiled
    function that calls `.backward()` would otherwise compile the hook's
    frame once per parameter shape). Only when dynamo is already loaded: a
    job that never compiles must not pay its import (seconds)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.disable(fn)
    return fn


def _grad_norms(grads: list, on_host: bool | None = None) -> torch.Tensor:
    """The L2 norm of each gradient, as a float64 vector on their device.

    On a GPU: one fused pass in float64 (a scaled float16 gradient's norm
    overflows in its own dtype), asynchronous. On the CPU the float64 pass
    converts every value first and cost ~9x the float32 one (5 ms a step for
    4M values, the largest single item of the recorder's cost), so the norms
    are taken in float32 (relative error ~1e-5) and only a norm that
    overflowed there (Inf from finite values too large to square in float32)
    is taken again in float64; reading that flag costs nothing in host
    memory. `on_host`: None reads it off the gradients' device (a test
    runs the device path on the CPU)."""
    if on_host is None:
        on_host = grads[0].device.type == "cpu"
    if not on_host:
        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64))
    # float64 gradients (a float64 model) keep float64: nothing to convert.
    work = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    if all(g.dtype == work for g in grads):
        # The usual float32 master gradients: no `dtype`, whose conversion
        # path cost a fifth more here for the same sums.
        norms = torch._foreach_norm(grads, 2)
    else:
        norms = torch._foreach_norm(grads, 2, dtype=work)
    norms = torch.stack(norms).to(torch.float64)
    overflow = torch.isinf(norms)
    if overflow.any():
        for i in overflow.nonzero().flatten().tolist():
            norms[i] = torch.linalg.vector_norm(grads[i], dtype=torch.float64)
    return norms


# The node that accumulates into a leaf's `.grad`: where a walk ends.
_ACCUMULATE_GRAD = getattr(getattr(torch._C, "_functions", None), "AccumulateGrad", None)

_DTYPE_NAMES: dict = {}


def _dtype_name(dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


class TrainingHooks:
    """The hooks on the model, its parameters and the optimizer, and the
    state of the step in progress.

    `guard(fn)` wraps every hook (the recorder's: an exception turns
    recording off, never the training), `guard_call(fn, a, b)` the
    backward hooks set anew for every module call; `bundles` is the bundle capture
    (its `on_*` hooks); `on_autocast(info)` is told the autocast state at
    the first recorded forward, and again if the root's children run under
    an autocast the root did not see.
    """

    def __init__(self, model: torch.nn.Module, *, optimizer, scaler, watched: list[str],
                 watch_param, near_overflow: float, guard, guard_call, bundles, on_autocast,
                 modules: dict | None = None, params: list | None = None, sharded=frozenset(),
                 late_grads=frozenset()):
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler if scaler_enabled(scaler) else None
        self.watched = list(watched)
        # name -> module to hook: the unwrapped modules; the root ("") is
        # hooked on the outermost module, the one the training loop calls.
        self.modules = dict(modules) if modules is not None else dict(model.named_modules())
        self.modules[""] = model
        self.params = list(params) if params is not None else list(model.named_parameters())
        self._sharded = set(sharded)
        # Parameters whose gradients no post-accumulate-grad hook reports
        # (FSDP1 sets them as views of its flat gradient): read at the end
        # of each backward pass.
        self._late_grads = set(late_grads)
        self.near_overflow = near_overflow
        self.bundles = bundles
        self._guard = guard
        # guard_call(fn, a, b): `guard` for the hooks made per module call
        # and step, as one object each (see AmpRecorder._guard_call).
        self._guard_call = guard_call
        self._grad_output_hook = self._on_grad_output  # bound once, not per hook
        self._node_hook = self._on_node_grads
        self._watch_param = watch_param
        self._on_autocast = on_autocast
        self.autocast: dict | None = None  # as the first recorded forward saw it
        self._autocast_from_child = False  # the root's children have told what ran
        self._children_ran = False  # ... in the step in progress
        self._root_runs = False  # the root's own forward has run (it opens micro-batches)
        self.paused = 0  # paused() depth: forward/backward passes not recorded
        self.state = StepState(0, False, False)
        self.handles: list = []
        self._grad_params: list = []
        self._late_params: list = []

    def begin_step(self, step_id: int, tier: str | None) -> None:
        """Start collecting the step `step_id` at `tier` ('full', 'cheap' or
        None: not recorded)."""
        self.state = StepState(step_id, tier is not None, tier == "full")

    def raise_to_full(self) -> bool:
        """Record the step in progress at the full tier, when it is recorded
        and nothing of it has been yet; False when its forward has begun (a
        full step needs full rows from its first hook on)."""
        st = self.state
        if st.micro_batches or st.meta:
            return False
        st.full = st.record
        return True

    def register(self) -> None:
        by_name = self.modules
        self._root_ref = weakref.ref(self.model)
        self.handles.append(self.model.register_forward_pre_hook(
            self._guard(self._on_root_pre), with_kwargs=True, prepend=True))
        # What autocast really ran is read where the model's modules run:
        # Accelerate wraps the root's `forward` in autocast *after* the
        # root's pre-hooks, and Lightning's root forward never runs.
        for child in unwrap(self.model).children():
            self.handles.append(child.register_forward_pre_hook(self._guard(self._on_child_pre)))
        for name in self.watched:
            m = by_name[name]
            self.handles.append(m.register_forward_pre_hook(self._guard(self._make_pre(name, m)), with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._guard(self._make_post(name, m)), with_kwargs=True))
        # Registered last, so it runs after the root's own post-hook above;
        # always_call: a forward that raises still ends the root's forward.
        self.handles.append(self.model.register_forward_hook(
            self._guard(self._on_root_post), with_kwargs=True, always_call=True))
        watched = set(self.watched)
        for pname, p in self.params:
            if p.requires_grad and (pname.rpartition(".")[0] in watched or self._watch_param(pname)):
                self._grad_params.append(p)
                hook = self._make_param_hook(pname, p)
                if id(p) in self._late_grads:
                    self._late_params.append((pname, p, hook))
                    continue
                # Run eagerly even when the backward runs inside compiled
                # code: dynamo would otherwise compile one frame per shape.
                self.handles.append(p.register_post_accumulate_grad_hook(_eager(self._guard(hook, traced=False))))
        if self.optimizer is not None and hasattr(self.optimizer, "register_step_pre_hook"):
            self.handles.append(self.optimizer.register_step_pre_hook(_eager(self._guard(self._on_opt_pre, traced=False))))

    def remove(self) -> None:
        # Never called from inside a hook: removing forward hooks while
        # torch iterates over them would break the user's forward pass.
        for h in self.handles:
            try:
                h.remove()
            except Exception:
                pass
        self.handles = []

    def end_step(self, loss) -> StepState:
        """Add the rows known only at step end (gradients still awaited,
        parameter gradients, the loss, parameter values) and return the
        finished step's state. `loss`: the detached loss tensor or None."""
        st = self.state
        if self._children_ran:  # a whole step of child calls saw no autocast
            self._autocast_from_child = True
        for ctx in st.contexts:
            for input_idx in list(ctx.pending):
                self._finish_grad_input(st, ctx, input_idx)
        for pname, (order, s, sq, g) in st.param_grads.items():
            self._add_row(st, pname, "param_grad", "backward", order, 0, g, s)
        if st.record and loss is not None and loss.numel():
            s = self._stats(st, loss.float())
            self._add_row(st, schema.LOSS_NAME, "loss", "forward", st.fwd_order, 0, loss, s)
            st.fwd_order += 1
        for pname, info, s in st.param_values:
            self._add_row(st, pname, "param", "forward", st.fwd_order, 0, info, s)
            st.fwd_order += 1
        return st

    # ---------------------------------------------------------------- state
    def _active(self, root: bool = False) -> StepState | None:
        """The step state when a forward hook should record: not paused, a
        recorded step, not inside a backward pass (activation checkpointing
        re-runs forwards there: a recomputation, not a new forward), and
        grad mode on (eval passes under no_grad are not training) or inside
        a recorded root forward (reentrant checkpointing runs the original
        forward of its region under no_grad)."""
        st = self.state
        if self.paused or not st.record:
            return None
        if _in_backward():
            return None
        if not torch.is_grad_enabled() and (root or not st.in_forward):
            return None
        return st

    def _add_row(self, st, name, kind, phase, order, call, t, stats, inputs=None) -> int:
        """Append a row; `inputs`: the rows whose NaN/Inf counts add up to
        its `input_nonfinite` (None: null). Returns the row's index."""
        st.meta.append((name, kind, phase, order, call, _dtype_name(t.dtype), local(t).numel(), inputs))
        st.stats.append(stats)
        if st.device is None and not isinstance(stats, list):
            st.device = stats.device
        return len(st.stats) - 1

    def _stats(self, st, t, **kw):
        return row_stats(t, full=st.full, near_overflow=self.near_overflow, **kw)

    def _input_rows(self, st, tensors) -> tuple:
        """The rows holding each input's NaN/Inf count: the row that
        produced it (a watched module's output, the model's input), else a
        count-only row of its own (the cheap statistics; not written)."""
        rows = []
        for t in tensors:
            hit = st.producers.get(id(t))
            if hit is not None and hit[0]() is t:
                rows.append(hit[1])
                continue
            s = row_stats(t, full=False, near_overflow=self.near_overflow)
            row = self._add_row(st, "", COUNT_KIND, "forward", -1, 0, t,
                                pad_row(s, FULL_WIDTH if st.full else CHEAP_WIDTH))
            self._note_producer(st, t, row)
            rows.append(row)
        return tuple(rows)

    @staticmethod
    def _note_producer(st, t, row):
        try:
            st.producers[id(t)] = (weakref.ref(t), row)
        except TypeError:
            pass

    def _scale_tensor(self):
        if self.scaler is None:
            return None
        s = getattr(self.scaler, "_scale", None)
        return s if isinstance(s, torch.Tensor) else None

    # ---------------------------------------------------------------- hooks
    def _on_root_post(self, module, args, kwargs, output):
        st = self.state
        if module is self._root_ref() and st.in_forward:
            st.in_forward -= 1
            if not st.in_forward:
                st.walks = {}  # the forward is over: let its graph go with the backward
                # always_call runs this hook with no output when the forward
                # raised (the exception is in flight here).
                if output is None and sys.exc_info()[0] is not None:
                    self._abort_micro_batch(st)

    def _abort_micro_batch(self, st) -> None:
        """The forward raised and the loop moved on: the micro-batch's rows,
        calls and bundle inputs go, so that they never merge into the next
        micro-batch (of this step or the next) as a doubled one."""
        if st.micro_batch_start is None:
            return
        rows, contexts = st.micro_batch_start
        del st.meta[rows:]
        del st.stats[rows:]
        del st.contexts[contexts:]
        st.micro_batch_start = None
        st.micro_batches -= 1
        st.forward_open = st.opened_by_child = False
        # Pre-hooks whose post-hooks never ran left their calls on the stacks.
        st.stacks, st.producers, st.calls = {}, {}, {}
        if st.micro_batches == 0:
            st.param_values = []
        self.bundles.on_micro_batch_aborted()

    def _on_root_pre(self, module, args, kwargs):
        st = self._active(root=True)
        if st is None or module is not self._root_ref():
            return  # not recording, or a deepcopy of the model carrying our hooks
        st.in_forward += 1
        self._root_runs = True
        if st.forward_open and st.opened_by_child:
            # The loop called a submodule just before the model's first
            # forward (an embedding looked up first): the same micro-batch.
            st.opened_by_child = False
            self._model_input_rows(st, args, kwargs)
            self.bundles.on_micro_batch_start(st.step_id, st.micro_batches - 1, args, kwargs, self.autocast)
            return
        self._start_micro_batch(st, args, kwargs, from_root=True)

    def _start_micro_batch(self, st, args, kwargs, from_root):
        """A micro-batch starts at the root's forward or, when the root's
        forward never runs (a LightningModule whose `training_step` calls
        `self.net(x)`), at the first watched module called after the last
        backward; its inputs are then that module's arguments. Once the
        root's forward has run, only it opens micro-batches: a submodule the
        loop calls outside it (an embedding looked up first) is no new one."""
        st.micro_batch_start = (len(st.meta), len(st.contexts))
        st.micro_batches += 1
        st.forward_open = True
        st.opened_by_child = not from_root
        st.fwd_order = 0
        st.bwd_order = 0
        st.calls = {}
        st.producers = {}
        st.walks = {}
        if self.autocast is None:
            self._note_autocast(_read_autocast())
        if st.micro_batches == 1 and st.full:
            # Values as this forward sees them; their rows are placed after
            # the loss at step end so module orders match cheap-tier steps.
            st.param_values = [(pname, _TensorInfo(p), self._stats(st, p))
                               for pname, p in self.params if local(p).numel() or id(p) in self._sharded]
        self._model_input_rows(st, args, kwargs)
        if from_root:  # a bundle replays the root's call: no root call, no bundle
            self.bundles.on_micro_batch_start(st.step_id, st.micro_batches - 1, args, kwargs, self.autocast)

    def _model_input_rows(self, st, args, kwargs):
        tensors = float_tensors((args, kwargs))
        if tensors:
            for t in tensors:
                s = self._stats(st, t)
                self._note_producer(st, t, self._add_row(st, schema.INPUT_NAME, "input", "forward",
                                                         st.fwd_order, 0, t, s))
            st.fwd_order += 1

    def _on_child_pre(self, module, args):
        if self._autocast_from_child or self._active() is None:
            return
        self._children_ran = True
        info = _read_autocast()
        if not info["enabled"]:
            # A child called outside the autocast region (an embedding
            # looked up before it) is not the last word: every child call
            # of the step is asked (end_step stops asking).
            return
        self._autocast_from_child = True
        # Only "on" overrides: a child may run in float32 on purpose.
        if not (self.autocast or {}).get("enabled"):
            self._note_autocast(info)
            self.bundles.on_autocast(info)  # the step's capture began at the root

    def _note_autocast(self, info: dict):
        self.autocast = info
        self._on_autocast(info)

    def _make_pre(self, name, registered):
        # `copy.deepcopy(model)` (an EMA copy, say) copies the hooks too: they
        # must ignore every module but the one they were registered on.
        ref = weakref.ref(registered)

        def pre(module, args, kwargs):
            st = self._active()
            if st is None:
                if module is ref():
                    self._recompute_pre(name, args, kwargs)
                return
            if module is not ref():
                return
            if not st.forward_open and not self._root_runs:
                self._start_micro_batch(st, args, kwargs, from_root=False)
            call = st.calls.get(name, 0)
            st.calls[name] = call + 1
            tensors = float_tensors((args, kwargs))
            inputs = self._input_rows(st, tensors) if tensors else None
            ctx = _CallContext(name, call, inputs, name == "", st.micro_batches - 1, st.step_id)
            # Inputs whose gradient this module's backward produces: the
            # autograd edges (grad_fn, output_nr) that point at them.
            keys = {}
            for i, t in enumerate(tensors):
                if t.requires_grad and t.grad_fn is not None:
                    keys.setdefault((t.grad_fn, t.output_nr), i)
            st.stacks.setdefault(name, []).append((ctx, keys))
        return pre

    def _make_post(self, name, registered):
        ref = weakref.ref(registered)

        def post(module, args, kwargs, output):
            st = self._active()
            if st is None:
                if module is ref():
                    self._recompute_post(name, output)
                return
            if module is not ref():
                return
            stack = st.stacks.get(name)
            if not stack:
                return
            ctx, keys = stack.pop()
            outs = float_tensors(output)
            order = st.fwd_order
            st.fwd_order += 1
            for t in outs:
                s = self._stats(st, t)
                self._note_producer(st, t, self._add_row(st, name, "activation", "forward", order,
                                                         ctx.call, t, s, ctx.input_rows))
            grad_outs = [t for t in outs if t.requires_grad]
            for idx, t in enumerate(grad_outs):
                t.register_hook(self._guard_call(self._grad_output_hook, ctx, idx))
            if ctx.is_root:
                self.bundles.on_model_outputs(ctx.micro_batch, len(grad_outs))
            if keys and grad_outs:
                self._hook_grad_inputs(ctx, keys, grad_outs)
            st.contexts.append(ctx)
        return post

    # ------------------------------------------- reentrant checkpointing
    def _recompute_state(self) -> StepState | None:
        """The step state while a reentrant checkpoint recomputes its region
        in backward: the only time that region builds an autograd graph, so
        its modules' backward hooks are set here (no forward row again)."""
        st = self.state
        if self.paused or not st.record or not _in_backward():
            return None
        node = torch._C._current_autograd_node()
        return st if node is not None and type(node).__name__ == "CheckpointFunctionBackward" else None

    def _recompute_pre(self, name, args, kwargs):
        st = self._recompute_state()
        if st is None:
            return
        # The original call it repeats: regions are recomputed last first,
        # so the latest call of this module not yet matched.
        ctx = next((c for c in reversed(st.contexts) if c.name == name and c.no_grad
                    and c.micro_batch == st.micro_batches - 1), None)
        if ctx is None:
            return
        ctx.no_grad = False  # matched
        tensors = float_tensors((args, kwargs))
        keys = {}
        for i, t in enumerate(tensors):
            if t.requires_grad and t.grad_fn is not None:
                keys.setdefault((t.grad_fn, t.output_nr), i)
        st.recompute_stacks.setdefault(name, []).append((ctx, keys))

    def _recompute_post(self, name, output):
        st = self._recompute_state()
        stack = st.recompute_stacks.get(name) if st is not None else None
        if not stack:
            return
        ctx, keys = stack.pop()
        outs = [t for t in float_tensors(output) if t.requires_grad]
        for idx, t in enumerate(outs):
            t.register_hook(self._guard_call(self._grad_output_hook, ctx, idx))
        if keys and outs:
            self._hook_grad_inputs(ctx, keys, outs)

    def _hook_grad_inputs(self, ctx, keys, outs):
        """Hook the autograd nodes inside the module that hand gradients to
        its inputs. `register_full_backward_hook` would insert identity nodes
        and change the order gradient contributions are summed in, hence the
        training's bits; node hooks observe without reshaping the graph.

        The walk goes from the outputs' nodes towards the inputs and stops
        at nodes created before the inputs (the model around the module).
        A watched module inside this one has walked its own part already
        (its post-hook runs first): where this walk reaches that module's
        output node, it takes the edges that left that walk instead of
        walking the same nodes again. Every container would otherwise walk
        its whole subtree once more per level of nesting."""
        st = self.state
        boundary = max(g._sequence_nr() for g, _ in keys)
        edges: dict = {}
        seen = set()
        roots = [t.grad_fn for t in outs if t.grad_fn is not None]
        # The edges leaving this walk, for an enclosing module's walk; only
        # for one output node (an enclosing module may use one output only).
        exits = [] if len(roots) == 1 else None
        todo = list(roots)

        def follow(node, slot, nxt, nr):
            key = (nxt, nr)
            if key in keys:
                slots = edges.setdefault(node, [])
                if (slot, keys[key]) not in slots:
                    slots.append((slot, keys[key]))
            elif nxt in seen:
                return
            # Nodes created before the module's inputs belong to the
            # model around it, not to this module.
            elif nxt._sequence_nr() > boundary:
                todo.append(nxt)
                return
            if exits is not None:
                exits.append((node, slot, nxt, nr))

        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            inner = st.walks.get(node)
            if inner is not None and inner[0] >= boundary:
                for edge in inner[1]:
                    follow(*edge)
                continue
            for slot, (nxt, nr) in enumerate(node.next_functions):
                if nxt is not None and type(nxt) is not _ACCUMULATE_GRAD:
                    follow(node, slot, nxt, nr)
        if exits is not None:
            st.walks[roots[0]] = (boundary, exits)
        for node, slots in edges.items():
            for _, input_idx in slots:
                acc = ctx.pending.setdefault(input_idx, [0, 0, []])
                acc[0] += 1
            node.register_hook(self._guard_call(self._node_hook, ctx, slots))

    def _on_grad_output(self, ctx, idx, grad):
        st = self.state
        if st.step_id != ctx.step_id or grad is None or not st.record:
            return
        st.forward_open = False
        s = self._stats(st, grad)
        row = self._add_row(st, ctx.name, "grad_output", "backward", st.bwd_order, ctx.call, grad, s)
        st.bwd_order += 1
        if ctx.grad_out_rows is None:
            ctx.grad_out_rows = []
        ctx.grad_out_rows.append(row)
        if ctx.is_root:
            self.bundles.on_model_output_grad(ctx.micro_batch, idx, grad)
            self._await_backward_end(st)

    def _on_node_grads(self, ctx, slots, grad_inputs, grad_outputs):
        st = self.state
        if st.step_id != ctx.step_id:
            return
        for slot, input_idx in slots:
            acc = ctx.pending.get(input_idx)
            if acc is None:
                continue
            acc[1] += 1
            g = grad_inputs[slot] if slot < len(grad_inputs) else None
            if g is not None:
                acc[2].append(g)
            if acc[1] >= acc[0]:
                self._finish_grad_input(st, ctx, input_idx)

    def _finish_grad_input(self, st, ctx, input_idx):
        acc = ctx.pending.pop(input_idx, None)
        if not acc or not acc[2]:
            return
        parts = acc[2]
        # Sum in the gradient's own dtype, in arrival order, as autograd's
        # input buffer does: an fp16 overflow can be born in this sum.
        total = parts[0]
        if len(parts) > 1:
            last = st.last_sum
            if last is not None and len(last[0]) == len(parts) and all(r() is p for r, p in zip(last[0], parts)):
                # The same parts in the same order as the sum just taken (a
                # container whose input only its first child uses): the
                # same tensor, which the statistics' memo then knows.
                total = last[1]
            else:
                for p in parts[1:]:
                    total = total + p
                st.last_sum = ([weakref.ref(p) for p in parts], total)
        s = self._stats(st, total)
        # The gradients that reached the outputs by now, as before this sum.
        inputs = tuple(ctx.grad_out_rows) if ctx.grad_out_rows is not None else None
        self._add_row(st, ctx.name, "grad_input", "backward", st.bwd_order, ctx.call, total, s, inputs)
        st.bwd_order += 1

    def _make_param_hook(self, pname, registered):
        ref = weakref.ref(registered)

        def hook(p):
            # Backward runs with grad mode off: check the step, not grad mode.
            st = self.state
            if self.paused or not st.record or p.grad is None or p is not ref():
                return
            self._await_backward_end(st)
            st.forward_open = False
            g = p.grad
            scale = self._scale_tensor()
            s = self._stats(st, g, scale=scale, unscale=scale is not None)
            sq = None  # the global norm is taken once, when the backward pass ends
            slot = st.param_grads.get(pname)
            # Keep the statistics, not the gradient: `zero_grad()` must be
            # able to free it before `rec.step()`.
            shape = _TensorInfo(g)
            if slot is None:
                st.param_grads[pname] = [st.bwd_order, s, sq, shape]
                st.bwd_order += 1
            else:  # gradient accumulation: the last accumulated value wins
                slot[1], slot[2], slot[3] = s, sq, shape
        return hook

    # ------------------------------------------------------ gradient norm
    def _await_backward_end(self, st) -> None:
        """Take the gradient norm when this backward pass has ended: the
        gradients are complete (DDP's all-reduce and FSDP's reduce-scatter
        done), still scaled, and not yet clipped by the user. Queued once
        per backward pass, from its first hook; the callback queues the
        measurement once more so that it runs after the callbacks that
        DDP and FSDP queue during the same pass."""
        try:
            task = torch._C._current_graph_task_id()
        except AttributeError:
            return
        if task == -1 or st.backward_task == task:
            return
        st.backward_task = task
        engine = torch.autograd.Variable._execution_engine
        measure = self._guard(functools.partial(self._on_backward_end, st), traced=False)
        engine.queue_callback(self._guard(lambda: engine.queue_callback(measure), traced=False))

    def _on_backward_end(self, st) -> None:
        if self.state is not st or self.paused or not st.record:
            return
        st.backward_passes += 1
        st.last_sum = None  # its gradient need not outlive the pass
        for pname, p, hook in self._late_params:
            hook(p)
        scale = self._scale_tensor()
        self._measure_grad_norm(st, scale)

    def _measure_grad_norm(self, st, scale) -> None:
        """Square sums of this rank's gradients (local shards), unscaled
        with `scale` (None: already unscaled); every micro-batch's backward
        overwrites them, so the last one's accumulated gradients count."""
        grads, sharded = [], []
        for p in self._grad_params:
            if p.grad is not None:
                g = local(p.grad.detach())
                if g.numel():
                    grads.append(g)
                    sharded.append(id(p) in self._sharded)
        if not grads:
            return
        sq = _grad_norms(grads) ** 2
        if scale is not None:
            sq = sq / scale.detach().to(torch.float64) ** 2
        st.grad_sqsum = sq.sum()
        if any(sharded):
            st.sharded_sqsum = sq[torch.tensor(sharded, device=sq.device)].sum()

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
            if not isinstance(row, list) or row[1] or row[2]:
                return False
        return True

    def _on_opt_pre(self, optimizer, args, kwargs):
        st = self.state
        st.stepped = True
        if st.record and st.grad_sqsum is None:
            # No backward pass was seen ending (gradients set by hand, say):
            # the gradients as the optimizer gets them. A fused optimizer
            # stepped by GradScaler gets them still scaled, with the scale.
            scale = getattr(optimizer, "grad_scale", None)
            self._measure_grad_norm(st, scale if isinstance(scale, torch.Tensor) else None)
        self.bundles.on_optimizer_pre_step(clean_on_host=st.record and self._clean_on_host(st))

