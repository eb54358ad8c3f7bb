"""The hooks of a step that is not sampled: the root's, and nothing else.

On such a step no watched module, parameter or autograd node carries a hook
of the recorder: the step facts (the loss, the loss scale, the skip, the
gradient norm and non-finite gradient count) need none, and what a
re-execution of the step needs (`reexecute`) is what the root sees: its
inputs and RNG states when its forward begins, the gradients that reach its
outputs when the backward begins (one tensor hook per floating output), and
from that first gradient the end of the backward pass, where the gradient
facts are taken (`ParamGradCollector.await_backward_end`).

On sampled steps the full set (`ForwardCollector` and the others,
registered for that step) records the step as before; the root's forward
hook only hands the forward's outputs to `ParamGradCollector.hook_producers`
(the parameters' gradients, found in that step's graph).
"""
from __future__ import annotations

import weakref

import torch

from ..stats import float_tensors
from .autocast import read_autocast
from .state import Shared, in_backward


class SentinelHooks:
    """`params`: the `ParamGradCollector`, whose backward-end measurement
    gives the gradient facts; `on_backward_start()`: told when a backward
    pass of a step not sampled begins (the writer's held steps go then:
    `RunWriter.on_backward_start`), or None."""

    def __init__(self, shared: Shared, *, model, params, on_backward_start=None):
        self.shared = shared
        self.model = model
        self.params = params
        self.on_backward_start = on_backward_start or _nothing
        self._root_ref = weakref.ref(model)
        self._autocast = None  # as the current step's first forward saw it
        self.tap = None  # the no-scaler job's `loss_tap.OutputLossTap`, carried by the root's forward hook
        self.guard = shared.guard.__self__  # the FailureGuard (`_OutputGrad` checks it itself)

    def __deepcopy__(self, memo):
        # The root's hooks are this object's methods: a deep copy of the
        # model (an EMA copy) carries them bound to this same object, whose
        # tests (`module is not self._root_ref()`) leave the copy unrecorded.
        return self

    def register(self, handles: list) -> None:
        # Traced (the default guard): inside a graph dynamo compiles (the
        # recorder attached before compiling) they do nothing, so that they
        # add no graph break; the optimizer's pre-step hook then takes the
        # gradient facts.
        handles.append(self.model.register_forward_pre_hook(self._on_root_pre, with_kwargs=True))
        handles.append(self.model.register_forward_hook(self._on_root_post, with_kwargs=True))

    # The two hooks below run on every step: their tests are written out in
    # one condition each (a helper call per hook cost as much as the rest),
    # and each is its own guard (`FailureGuard.wrap`'s checks written out:
    # the wrapper's frame a hook less).
    def _on_root_pre(self, module, args, kwargs):
        if torch.compiler.is_compiling() or not self.guard.enabled:
            return None  # traced by dynamo (a model compiled after attaching): nothing, no graph break
        try:
            shared = self.shared
            st = shared.state
            # Not on a sampled step (the collectors record it), nor in a
            # checkpoint's recomputation or an evaluation pass.
            if (st.record or st.in_forward or shared.paused or module is not self._root_ref()
                    or not torch.is_grad_enabled() or in_backward()):
                return None
            st.in_forward = 1
            if not st.micro_batches:
                self._autocast = read_autocast()
            st.micro_batches += 1
            st.forward_open = True
            shared.bundles.on_micro_batch_start(st.step_id, st.micro_batches - 1, args, kwargs, self._autocast)
        except Exception as exc:  # noqa: BLE001 - the training must go on
            self.guard.fail(exc)
        return None

    def _on_root_post(self, module, args, kwargs, output):
        if torch.compiler.is_compiling():
            return self._traced_post(module, args, kwargs, output)
        if not self.guard.enabled:
            return None
        try:
            shared = self.shared
            st = shared.state
            if st.record:
                self._sampled_post(shared, st, module, output)
                return None
            if (not st.in_forward or shared.paused or module is not self._root_ref()
                    or not torch.is_grad_enabled() or in_backward()):
                return None
            st.in_forward = 0
            if self.tap is not None:
                self.tap.take(output)
            if type(output) is torch.Tensor:  # the usual model: no walk of an output tree
                outs = (output,) if output.requires_grad and output.is_floating_point() and output.numel() else ()
            else:
                outs = [t for t in float_tensors(output) if t.requires_grad]
            micro_batch = st.micro_batches - 1
            shared.bundles.on_model_outputs(micro_batch, len(outs))
            for idx, t in enumerate(outs):
                node = t.grad_fn
                if node is not None:
                    # The gradient its node receives is what reaches the output
                    # (a node pre-hook: a third of `Tensor.register_hook`'s cost).
                    node.register_prehook(_OutputGrad(self, st, micro_batch, idx, t.output_nr))
        except Exception as exc:  # noqa: BLE001 - the training must go on
            self.guard.fail(exc)
        return None

    def _sampled_post(self, shared, st, module, output) -> None:
        """The root's forward hook on a sampled step (or a re-execution):
        the collectors record it; its parameters' gradients are found from
        this forward's graph."""
        if (not shared.paused and module is self._root_ref() and torch.is_grad_enabled()
                and not in_backward()):
            if self.tap is not None:
                self.tap.take(output)
            if self.params.by_producers:
                self.params.hook_producers(st, [t for t in float_tensors(output) if t.requires_grad])

    def _traced_post(self, module, args, kwargs, output):
        """The root's forward hook while dynamo traces it (a model compiled
        after the recorder attached): the loss tap only, taken into the
        graph's side effects as a hook of its own was."""
        tap = self.tap
        if (tap is not None and self.guard.enabled and not self.shared.paused and module is self._root_ref()
                and torch.is_grad_enabled()):
            tap.take(output)

def _nothing() -> None:
    return None


class _OutputGrad:
    """The pre-hook on one output's autograd node: one small object, not a
    closure per output and step. An exception turns recording off, never
    the training (the recorder's guard, through `shared.guard`)."""

    __slots__ = ("hooks", "st", "micro_batch", "idx", "slot")

    def __init__(self, hooks, st, micro_batch, idx, slot):
        self.hooks, self.st, self.micro_batch, self.idx, self.slot = hooks, st, micro_batch, idx, slot

    def __call__(self, grad_outputs):
        # The guard's checks written out (a wrapper's frame a step less):
        # never compiled (the engine calls it), recording on, errors off.
        # The gradient reaching output `idx` of the root's call (micro-batch
        # `micro_batch`) is held for a re-execution; its arrival starts the
        # wait for the backward's end, where the gradient facts are taken.
        hooks, st = self.hooks, self.st
        shared = hooks.shared
        if shared.state is st and self.slot < len(grad_outputs) and hooks.guard.enabled:
            try:
                grad = grad_outputs[self.slot]
                if grad is not None:
                    st.forward_open = False
                    shared.bundles.on_model_output_grad(self.micro_batch, self.idx, grad)
                    hooks.params.await_backward_end(st)
                    hooks.on_backward_start()
            except Exception as exc:  # noqa: BLE001 - the training must go on
                hooks.guard.fail(exc)
        return None
