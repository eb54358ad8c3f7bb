"""The forward pass: the root's and every watched module's hooks, the
micro-batches, the model's inputs (`input` rows), each call's outputs
(`activation` rows) and where each call's inputs came from."""
from __future__ import annotations

import sys
import weakref

import torch

from ..format import schema
from ..aggregate import COUNT_KIND
from ..layout import local
from ..stats import CHEAP_WIDTH, FULL_WIDTH, float_tensors, pad_row
from .autocast import AutocastWatch
from .backward import BackwardCollector, input_edges
from .graph_stats import GraphStats
from .recompute import CheckpointRecompute
from .state import CallContext, Shared, TensorInfo, in_backward


class ForwardCollector:
    """`modules`: name -> module to hook (the root "" is the outermost
    module, the one the training loop calls); `watched`: the names hooked;
    `params` and `sharded`: for the full tier's parameter values, with
    `flat_views` ((name, `FlatView`): FSDP1 without `use_orig_params`)."""

    def __init__(self, shared: Shared, *, model, modules: dict, watched: list, params: list,
                 sharded, backward: BackwardCollector, recompute: CheckpointRecompute,
                 autocast: AutocastWatch, flat_views=(), graph: GraphStats | None = None):
        self.shared = shared
        self.graph = graph  # the in-graph rows of compiled modules (None: none)
        self.model = model
        self.modules = modules
        self.watched = watched
        self.params = params
        self.flat_views = list(flat_views)
        self._sharded = sharded
        self.backward = backward
        self.recompute = recompute
        self.autocast = autocast
        self._root_ref = weakref.ref(model)
        self._root_runs = False  # the root's own forward has run (it opens micro-batches)
        self._hooks = None  # (register method, hook, keywords), built at the first register

    def register(self, handles: list) -> None:
        # Built once, registered on every sampled step (a sentinel adds and
        # removes them): making ~800 guarded closures a time cost ms.
        if self._hooks is None:
            self._hooks = self._build_hooks()
        for register, fn, kwargs in self._hooks:
            handles.append(register(fn, **kwargs))

    def _build_hooks(self) -> list:
        """(register method, hook, its keywords), in registration order."""
        graph = self.graph

        def guard(fn, in_graph=None):
            # While dynamo traces, a hook runs the in-graph statistics in
            # place of its eager body (collectors.graph_stats).
            return self.shared.guard(fn) if graph is None else self.shared.guard(fn, in_graph=in_graph)
        hooks = [(self.model.register_forward_pre_hook, guard(self._on_root_pre, graph and graph.root_pre),
                  {"with_kwargs": True, "prepend": True})]
        hooks += self.autocast.hooks(self.model, graph)
        for name in self.watched:
            m = self.modules[name]
            hooks.append((m.register_forward_pre_hook, guard(self._make_pre(name, m), graph and graph.module_pre(name)),
                          {"with_kwargs": True}))
            hooks.append((m.register_forward_hook, guard(self._make_post(name, m), graph and graph.module_post(name)),
                          {"with_kwargs": True}))
        # Registered last, so it runs after the root's own post-hook above;
        # always_call: a forward that raises still ends the root's forward.
        hooks.append((self.model.register_forward_hook, guard(self._on_root_post),
                      {"with_kwargs": True, "always_call": True}))
        return hooks

    def active(self, root: bool = False):
        """The step state when a forward hook should record: not paused, a
        recorded step, not inside a backward pass (activation checkpointing
        re-runs forwards there: a recomputation, not a new forward), and
        grad mode on (eval passes under no_grad are not training) or inside
        a recorded root forward (reentrant checkpointing runs the original
        forward of its region under no_grad)."""
        shared = self.shared
        st = shared.state
        if shared.paused or not st.record:
            return None
        if in_backward():
            return None
        if not torch.is_grad_enabled() and (root or not st.in_forward):
            return None
        return st

    def end_step(self, st) -> None:
        """The loss and the parameter values' rows, after every module's."""
        shared = self.shared
        for pname, info, s in st.param_values:
            shared.add_row(st, pname, "param", "forward", st.fwd_order, 0, info, s)
            st.fwd_order += 1

    # ------------------------------------------------------------ inputs
    def _input_rows(self, st, tensors) -> tuple:
        """The rows holding each input's NaN/Inf count: the row that
        produced it (a watched module's output, the model's input), else a
        count-only row of its own (the cheap statistics; not written)."""
        shared = self.shared
        rows = []
        for t in tensors:
            hit = st.producers.get(id(t))
            if hit is not None and hit[0]() is t:
                rows.append(hit[1])
                continue
            s = shared.count_stats(st, t)
            row = shared.add_row(st, "", COUNT_KIND, "forward", -1, 0, t,
                                 pad_row(s, FULL_WIDTH if st.full else CHEAP_WIDTH))
            shared.note_producer(st, t, row)
            rows.append(row)
        return tuple(rows)

    def _model_input_rows(self, st, args, kwargs):
        tensors = float_tensors((args, kwargs))
        if tensors:
            shared = self.shared
            for t in tensors:
                s = shared.stats(st, t)
                shared.note_producer(st, t, shared.add_row(st, schema.INPUT_NAME, "input", "forward",
                                                           st.fwd_order, 0, t, s))
            st.fwd_order += 1

    # -------------------------------------------------------- micro-batches
    def _on_root_pre(self, module, args, kwargs):
        st = self.active(root=True)
        if st is None or module is not self._root_ref():
            return  # not recording, or a deepcopy of the model carrying our hooks
        st.in_forward += 1
        self._root_runs = True
        if st.forward_open and st.opened_by_child:
            # The loop called a submodule just before the model's first
            # forward (an embedding looked up first): the same micro-batch.
            st.opened_by_child = False
            self._model_input_rows(st, args, kwargs)
            self.shared.bundles.on_micro_batch_start(st.step_id, st.micro_batches - 1, args, kwargs,
                                                     self.autocast.autocast)
        else:
            self._start_micro_batch(st, args, kwargs, from_root=True)
        if st.graph_anchor is None:
            # A compiled model's graph runs inside this eager root call:
            # its forward rows come after the inputs' (step_rows).
            st.graph_anchor = st.fwd_order

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
        st.node_watches = {}
        self.autocast.at_first_forward()
        if st.micro_batches == 1 and st.full:
            # Values as this forward sees them; their rows are placed after
            # the loss at step end so module orders match cheap-tier steps.
            stats = self.shared.stats
            st.param_values = [(pname, TensorInfo(p), stats(st, p))
                               for pname, p in self.params if local(p).numel() or id(p) in self._sharded]
            for pname, view in self.flat_views:
                value = view.value()
                if value is not None:
                    st.param_values.append((pname, TensorInfo(value), stats(st, value)))
        self._model_input_rows(st, args, kwargs)
        if from_root:  # a bundle replays the root's call: no root call, no bundle
            self.shared.bundles.on_micro_batch_start(st.step_id, st.micro_batches - 1, args, kwargs,
                                                     self.autocast.autocast)

    def _on_root_post(self, module, args, kwargs, output):
        st = self.shared.state
        if module is self._root_ref() and st.in_forward:
            st.in_forward -= 1
            if not st.in_forward:
                # The forward is over: let its graph go with the backward.
                st.walks = {}
                st.node_watches = {}
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
        self.shared.bundles.on_micro_batch_aborted()

    # ------------------------------------------------------ module calls
    def _make_pre(self, name, registered):
        # `copy.deepcopy(model)` (an EMA copy, say) copies the hooks too: they
        # must ignore every module but the one they were registered on.
        ref = weakref.ref(registered)

        def pre(module, args, kwargs):
            st = self.active()
            if st is None:
                if module is ref():
                    self.recompute.pre(name, args, kwargs)
                return
            if module is not ref():
                return
            if not st.forward_open and not self._root_runs:
                self._start_micro_batch(st, args, kwargs, from_root=False)
            call = st.calls.get(name, 0)
            st.calls[name] = call + 1
            tensors = float_tensors((args, kwargs))
            inputs = self._input_rows(st, tensors) if tensors else None
            ctx = CallContext(name, call, inputs, name == "", st.micro_batches - 1, st.step_id)
            stack = st.stacks.get(name)
            if stack is None:
                stack = st.stacks[name] = []
            stack.append((ctx, input_edges(tensors)))
        return pre

    def _make_post(self, name, registered):
        ref = weakref.ref(registered)
        shared = self.shared

        def post(module, args, kwargs, output):
            st = self.active()
            if st is None:
                if module is ref():
                    self.recompute.post(name, output)
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
                s = shared.stats(st, t)
                shared.note_producer(st, t, shared.add_row(st, name, "activation", "forward", order,
                                                           ctx.call, t, s, ctx.input_rows))
            grad_outs = [t for t in outs if t.requires_grad]
            self.backward.watch_call(ctx, keys, grad_outs)
            if ctx.is_root:
                shared.bundles.on_model_outputs(ctx.micro_batch, len(grad_outs))
            st.contexts.append(ctx)
        return post
