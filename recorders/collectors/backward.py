"""Each watched call's backward: the gradients that reach its outputs
(`grad_output` rows) and those its backward hands its inputs
(`grad_input` rows).

`register_full_backward_hook` would insert identity nodes and change the
order gradient contributions are summed in, hence the training's bits;
hooks on the outputs and on the autograd nodes inside the module observe
without reshaping the graph.
"""
from __future__ import annotations

import weakref

import torch

from .state import ACCUMULATE_GRAD, Shared

# The node that accumulates into a leaf's `.grad`: where a walk ends.


def input_edges(tensors) -> dict:
    """The autograd edges (grad_fn, output_nr) of the inputs whose gradient
    a module's backward produces -> the input's index."""
    keys = {}
    for i, t in enumerate(tensors):
        if t.requires_grad and t.grad_fn is not None:
            keys.setdefault((t.grad_fn, t.output_nr), i)
    return keys


class BackwardCollector:
    """`on_root_grad(st)`: told when a gradient reaches the model's output
    (a backward pass has begun: ParamGradCollector awaits its end)."""

    def __init__(self, shared: Shared, on_root_grad):
        self.shared = shared
        self._on_root_grad = on_root_grad
        self._grad_output_hook = self._on_grad_output  # bound once, not per hook
        self.on_node_pre = self._on_node_pre
        self.on_node_post = self._on_node_post
        # module name -> the plans its calls' graphs were found to follow
        # (`_build_plan`), and how many calls found none that fitted.
        self._plans: dict[str, list] = {}
        self._misses: dict[str, int] = {}

    def watch_call(self, ctx, keys: dict, outs: list, watches: dict | None = None) -> None:
        """Hook the call's outputs that need a gradient and the nodes that
        hand gradients to its inputs (`keys`: `input_edges`).

        The gradient reaching an output is what its node receives (a node
        pre-hook: what a tensor hook on the output sees, for a third of
        `Tensor.register_hook`'s cost); the gradients handed to the inputs
        are what nodes inside the module return (node hooks). A node gets
        one hook of each kind whatever number of calls watch it (a
        container's output is its last child's): `watches` (node ->
        `_NodeWatch`; default the forward's, `StepState.node_watches`)
        lists them in the order their calls ended, as separate hooks would
        run."""
        if watches is None:
            watches = self.shared.state.node_watches
        roots = []
        for idx, t in enumerate(outs):
            node = t.grad_fn
            if node is None:  # a leaf the module returns: no node to hook, a hook on the tensor for the step
                self.shared.state.leaf_hooks.append(
                    t.register_hook(self.shared.guard_call(self._grad_output_hook, ctx, idx)))
                continue
            roots.append(node)
            watch = watches.get(node)
            if watch is None:
                watch = watches[node] = _NodeWatch(self)
            watch.add_output(node, ctx, idx, t.output_nr)
        if keys and roots:
            self._hook_grad_inputs(ctx, keys, roots, watches)

    def end_step(self, st) -> None:
        """Gradients still awaited (an input whose other contributions
        never came) are summed as they are; the hooks put on leaves go
        (each sampled step's stayed on the tensor for good: a parameter a
        module returns carried one more each time, every backward called
        them all, and each held its step's call context)."""
        for handle in st.leaf_hooks:
            handle.remove()
        for ctx in st.contexts:
            for input_idx in list(ctx.pending):
                self._finish_grad_input(st, ctx, input_idx)

    def _hook_grad_inputs(self, ctx, keys, roots, watches):
        """Hook the autograd nodes inside the module that hand gradients to
        its inputs (`roots`: the outputs' nodes): found by the module's
        cached plan when it still fits this call's graph (`_plan_edges`),
        else by walking the graph."""
        boundary = -1
        for node, _ in keys:
            seq = node._sequence_nr()
            if seq > boundary:
                boundary = seq
        name = ctx.name
        plans = self._plans.get(name)
        edges = _plan_edges(plans, roots, keys, boundary) if plans is not None else None
        if edges is None:
            misses = self._misses.get(name, 0)
            if misses < _MAX_PLANS:
                self._misses[name] = misses + 1
                plan, edges = _build_plan(roots, keys, boundary)
                self._plans.setdefault(name, []).append(plan)
            else:  # a graph that changes from call to call: walked every time
                edges = self._walk(keys, roots, boundary)
        pending = ctx.pending
        for node, slots in edges:
            for _, input_idx in slots:
                acc = pending.get(input_idx)
                if acc is None:
                    pending[input_idx] = acc = [0, 0, []]
                acc[0] += 1
            watch = watches.get(node)
            if watch is None:
                watch = watches[node] = _NodeWatch(self)
            watch.add_inputs(node, ctx, slots)

    def _walk(self, keys, roots, boundary) -> list:
        """The nodes that hand gradients to the inputs, by a walk from the
        outputs' nodes towards the inputs that stops at nodes created
        before the inputs (the model around the module).

        A watched module inside this one has walked its own part already
        (its post-hook runs first): where this walk reaches that module's
        output node, it takes the edges that left that walk instead of
        walking the same nodes again. Every container would otherwise walk
        its whole subtree once more per level of nesting."""
        st = self.shared.state
        edges: dict = {}
        seen = set()
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
                if nxt is not None and type(nxt) is not ACCUMULATE_GRAD:
                    follow(node, slot, nxt, nr)
        if exits is not None:
            st.walks[roots[0]] = (boundary, exits)
        return [(node, tuple(slots)) for node, slots in edges.items()]

    def _on_grad_output(self, ctx, idx, grad):
        shared = self.shared
        st = shared.state
        if st.step_id != ctx.step_id or grad is None or not st.record:
            return
        st.forward_open = False
        s = shared.stats(st, grad)
        row = shared.add_row(st, ctx.name, "grad_output", "backward", st.bwd_order, ctx.call, grad, s)
        st.bwd_order += 1
        if ctx.grad_out_rows is None:
            ctx.grad_out_rows = []
        ctx.grad_out_rows.append(row)
        if ctx.is_root:
            shared.bundles.on_model_output_grad(ctx.micro_batch, idx, grad)
            self._on_root_grad(st)

    def _on_node_pre(self, watch, _, grad_outputs):
        self._grads_received(watch, grad_outputs)

    def _on_node_post(self, watch, _, grad_inputs, grad_outputs):
        if not watch.pre:
            self._grads_received(watch, grad_outputs)
        for ctx, slots in watch.inputs:
            self._on_node_grads(ctx, slots, grad_inputs)

    def _grads_received(self, watch, grad_outputs):
        for ctx, idx, nr in watch.outputs:
            self._on_grad_output(ctx, idx, grad_outputs[nr] if nr < len(grad_outputs) else None)

    def _on_node_grads(self, ctx, slots, grad_inputs):
        st = self.shared.state
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
        shared = self.shared
        s = shared.stats(st, total)
        # The gradients that reached the outputs by now, as before this sum.
        inputs = tuple(ctx.grad_out_rows) if ctx.grad_out_rows is not None else None
        shared.add_row(st, ctx.name, "grad_input", "backward", st.bwd_order, ctx.call, total, s, inputs)
        st.bwd_order += 1


class _NodeWatch:
    """The calls that watch one autograd node: (context, output index,
    the node's output number) of each call whose output it made, and
    (context, (slot, input index) edges) of each call whose inputs it hands
    gradients to. Its hooks are registered once, as the first call asks.

    The gradients a node received are read in its post-hook, with those it
    returned: one hook, not two, for the usual node (a Linear's output node
    also hands its input its gradient). Nothing of the recorder runs between
    a C++ node's pre- and post-hooks, so the rows keep the order a hook on
    the output tensor gave them. A node of a Python autograd Function may
    run a backward inside its own (a reentrant checkpoint does, recording
    its region's rows): the gradients it received are read before it runs,
    in a pre-hook."""

    # Not the node itself: its hooks hold the watch, and a watch holding
    # the node would be a cycle through C++ that no garbage collection sees.
    __slots__ = ("collector", "outputs", "inputs", "post", "pre")

    def __init__(self, collector):
        self.collector = collector
        self.outputs = ()  # a list once a call adds one (most nodes have one kind only)
        self.inputs = ()
        self.post = False  # its post-hook is registered
        self.pre = False

    def add_output(self, node, ctx, idx, nr):
        if isinstance(node, _PYTHON_NODE):
            if not self.pre:
                self.pre = True
                c = self.collector
                node.register_prehook(c.shared.guard_call(c.on_node_pre, self, None))
        else:
            self._hook_post(node)
        if not self.outputs:
            self.outputs = []
        self.outputs.append((ctx, idx, nr))

    def add_inputs(self, node, ctx, slots):
        self._hook_post(node)
        if not self.inputs:
            self.inputs = []
        self.inputs.append((ctx, slots))

    def _hook_post(self, node):
        if not self.post:
            self.post = True
            c = self.collector
            node.register_hook(c.shared.guard_call(c.on_node_post, self, None))


# The nodes of Python autograd Functions (a custom Function's backward, a
# reentrant checkpoint's).
_PYTHON_NODE = torch.autograd.function.BackwardCFunction


# ------------------------------------------------------------ walk plans
# A module's backward graph is the same from call to call (the same code
# runs the same ops): the walk that finds the nodes handing gradients to its
# inputs is done once per shape of graph and kept as a plan, the path of
# next_functions slots from an output's node to each such node. A call
# follows the plans instead of walking (a Linear: one step instead of a
# walk of its nodes; a container: one path per input edge instead of its
# subtree). A plan serves a call only if (1) as many autograd nodes were
# created between the inputs and the output as when it was made (the
# thread's sequence numbers), (2) the output's node and every node on each
# path are of the plan's types, and (3) each end node's edges to the inputs
# are exactly the plan's. A module whose calls keep missing (a graph that
# depends on the data) is walked every call, as before plans.
_MAX_PLANS = 8


class _Plan:
    __slots__ = ("span", "root_types", "entries")

    def __init__(self, span, root_types, entries):
        self.span = span  # output node's sequence number minus the inputs' largest
        self.root_types = root_types  # type of each output's node
        self.entries = entries  # (root index, path of (slot, node type), end node's (slot, input) edges)


def _input_slots(node, keys) -> tuple:
    """(slot, input index) of each of `node`'s edges that point at an input."""
    slots = ()
    for slot, edge in enumerate(node.next_functions):
        if edge in keys:
            slots += ((slot, keys[edge]),)
    return slots


def _plan_edges(plans, roots, keys, boundary):
    """[(node, slots)] by the first plan that fits this call's graph, else None."""
    root = roots[0]
    span = root._sequence_nr() - boundary
    for plan in plans:
        if plan.span != span or len(plan.root_types) != len(roots):
            continue
        if len(roots) == 1:
            if type(root) is not plan.root_types[0]:
                continue
        elif tuple(type(r) for r in roots) != plan.root_types:
            continue
        edges = []
        for root_idx, path, slots in plan.entries:
            node = roots[root_idx]
            for slot, node_type in path:
                nexts = node.next_functions
                node = nexts[slot][0] if slot < len(nexts) else None
                if type(node) is not node_type:
                    break
            else:
                if _input_slots(node, keys) == slots:
                    edges.append((node, slots))
                    continue
            break
        else:
            return edges
    return None


def _build_plan(roots, keys, boundary):
    """Walk the call's graph (no shortcut through inner modules' walks: the
    plan needs every path) and return (its plan, [(node, slots)])."""
    paths = {}  # node -> (root index, path from it)
    todo = []
    for i, root in enumerate(roots):
        if root not in paths:
            paths[root] = (i, ())
            todo.append(root)
    edges = []
    while todo:
        node = todo.pop()
        slots = _input_slots(node, keys)
        if slots:
            edges.append((node, slots))
        root_idx, path = paths[node]
        for slot, (nxt, nr) in enumerate(node.next_functions):
            if nxt is None or type(nxt) is ACCUMULATE_GRAD or (nxt, nr) in keys or nxt in paths:
                continue
            if nxt._sequence_nr() > boundary:  # created inside the module's call
                paths[nxt] = (root_idx, path + ((slot, type(nxt)),))
                todo.append(nxt)
    entries = tuple((*paths[node], slots) for node, slots in edges)
    plan = _Plan(roots[0]._sequence_nr() - boundary, tuple(type(r) for r in roots), entries)
    return plan, edges
