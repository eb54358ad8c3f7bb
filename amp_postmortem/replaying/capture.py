"""What one replayed run of a step leaves behind, and the hooks that collect it.

`CallRecorder` puts a forward pre-hook and a forward hook on every module
(each once, even when registered under two names) and a tensor hook on each
floating output, so that every module call yields a `ModuleCall`: its
outputs, the gradients that reached them, and on request its inputs and the
RNG state before it (what a local replay of the module needs). Every handle
is removed on exit.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from dataclasses import dataclass, field

import torch

from recorders.format.tensors import iter_tensors

from ..names import BackwardFrom

_FLOATING = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def is_floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in _FLOATING


def round_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` rounded to `dtype` for a module replayed alone, its own dtype's
    largest values (the "minus infinity" of attention masks, built as
    `torch.finfo(dtype).min` in each run's own dtype) mapped to `dtype`'s
    instead of overflowing: a mask is not an overflow. Any other value too
    large for `dtype` still becomes Inf."""
    out = t.to(dtype)
    if t.dtype in _FLOATING and dtype in _FLOATING and torch.finfo(dtype).max < torch.finfo(t.dtype).max:
        big, small = torch.finfo(t.dtype).max, torch.finfo(dtype).max
        out = torch.where(t == big, small, torch.where(t == -big, -small, out))
    return out


def map_tensors(obj, fn, _depth: int = 0, *, other=None):
    """Rebuild `obj` with every tensor replaced by `fn(tensor)`, visiting
    tensors in `iter_tensors` order (lists, tuples, dicts, dataclasses);
    `other(value)`, when given, replaces every other leaf."""
    if _depth > 8:
        return obj
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    again = lambda v: map_tensors(v, fn, _depth + 1, other=other)  # noqa: E731
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(again(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(again(v) for v in obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps OrderedDict / ModelOutput types
        for k, v in obj.items():
            out[k] = again(v)
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: again(getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    return obj if other is None else other(obj)


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.nn.Module, type)


def stateful_copy(obj):
    """A copy of an object argument that a call may change (a Hugging Face
    `Cache`, which each attention layer's call appends its keys and values
    to), its tensors detached: a module replayed alone gets it as it was
    before the call, every time. Plain values, modules and callables pass
    as they are. `copy.deepcopy` will not do: it refuses tensors that are
    part of the autograd graph (an earlier layer's cached keys)."""
    if isinstance(obj, _PLAIN) or callable(obj) or not hasattr(obj, "__dict__"):
        return obj
    return _copy_state(obj, {}, 0)


def _copy_state(obj, memo: dict, depth: int):
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        out = obj.detach().clone()
    elif depth > 8 or isinstance(obj, _PLAIN) or callable(obj):
        return obj
    elif isinstance(obj, list):
        out = [_copy_state(v, memo, depth + 1) for v in obj]
    elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        out = tuple(_copy_state(v, memo, depth + 1) for v in obj)
    elif isinstance(obj, dict):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = _copy_state(v, memo, depth + 1)
    elif hasattr(obj, "__dict__"):
        try:
            out = copy.copy(obj)
        except Exception:  # noqa: BLE001 - an object that cannot be copied is shared, as the call shared it
            return obj
        memo[id(obj)] = out
        for k, v in vars(obj).items():
            out.__dict__[k] = _copy_state(v, memo, depth + 1)
    else:
        return obj
    memo[id(obj)] = out
    return out


@dataclass
class ModuleCall:
    """One call of one module during a run."""
    name: str
    call: int                       # which call of the module in its micro-batch
    micro_batch: int
    forward_order: int              # completion order of the forward (post-order)
    input_dtypes: list = field(default_factory=list)      # floating inputs, iter_tensors order
    outputs: list = field(default_factory=list)           # floating outputs (detached copies)
    output_requires_grad: list = field(default_factory=list)
    grad_outputs: list = field(default_factory=list)      # per output: gradient as it travelled, or None
    backward_order: int | None = None                      # when its first output-gradient arrived
    inputs: tuple | None = None     # (args, kwargs) detached copies, when the run keeps inputs
    input_requires_grad: list = field(default_factory=list)
    rng_state: torch.Tensor | None = None  # CPU RNG state before the call (kept with inputs)
    cuda_rng_state: torch.Tensor | None = None

    @property
    def key(self) -> tuple:
        return (self.micro_batch, self.name, self.call)


@dataclass
class StepCapture:
    """What one run of the step produced."""
    config: object                  # the RunConfig it ran under
    calls: dict = field(default_factory=dict)       # (micro_batch, name, call) -> ModuleCall, forward order
    outputs: list = field(default_factory=list)     # per micro-batch: floating model outputs
    losses: list = field(default_factory=list)      # per micro-batch loss (float) when known
    param_grads: dict = field(default_factory=dict)  # name -> gradient divided by the loss scale (float64)
    error: str | None = None                          # the run raised (reduced precisions only)
    anomaly: dict | None = None
    # Where the backward started (None: no backward ran); `loss_dtype` the
    # started-from loss's dtype.
    backward_from: BackwardFrom | None = None
    loss_dtype: str | None = None

    @property
    def loss_scale(self) -> float:
        return self.config.backward_scale

    @property
    def loss(self) -> float | None:
        vals = [v for v in self.losses if v is not None]
        return sum(vals) / len(vals) if vals and len(vals) == len(self.losses) else None

    @property
    def finite(self) -> bool:
        """No NaN/Inf in the outputs, the captured gradients or the parameter gradients."""
        if self.error is not None:
            return False
        tensors = [t for mb in self.outputs for t in mb] + list(self.param_grads.values())
        return all(bool(torch.isfinite(t).all()) for t in tensors)

    @property
    def nonfinite_param_grads(self) -> list:
        return [n for n, g in self.param_grads.items() if not bool(torch.isfinite(g).all())]


class CallRecorder:
    """Forward hooks on every module: a `ModuleCall` per call, with tensor
    hooks on its outputs for the gradients that reach them. Every handle is
    removed on exit."""

    def __init__(self, model: torch.nn.Module, *, keep_inputs: bool):
        self.model = model
        self.keep_inputs = keep_inputs
        self.calls: dict = {}
        self.micro_batch = 0
        self._handles = []
        self._stacks: dict = {}
        self._counts: dict = {}
        self._forward = 0
        self._backward = 0
        # grad_fn of each module call's outputs -> the innermost module that
        # returned it (BackwardWatch names the module of a backward op).
        self.output_nodes: dict = {}

    def __enter__(self):
        seen = set()
        for name, module in self.model.named_modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            self._handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(name), with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        self.output_nodes = {}
        return False

    def _pre(self, name):
        def hook(module, args, kwargs):
            key = (self.micro_batch, name)
            call = self._counts.get(key, 0)
            self._counts[key] = call + 1
            floats = [t for t in iter_tensors((args, kwargs)) if is_floating(t)]
            rec = ModuleCall(name=name, call=call, micro_batch=self.micro_batch, forward_order=-1,
                             input_dtypes=[t.dtype for t in floats],
                             input_requires_grad=[bool(t.requires_grad) for t in floats])
            if self.keep_inputs:
                snap = lambda t: t.detach().clone()  # noqa: E731
                rec.inputs = (map_tensors(tuple(args), snap, other=stateful_copy),
                              map_tensors(dict(kwargs), snap, other=stateful_copy))
                rec.rng_state = torch.get_rng_state()
                if floats and floats[0].is_cuda:
                    rec.cuda_rng_state = (floats[0].device, torch.cuda.get_rng_state(floats[0].device))
            self._stacks.setdefault(key, []).append(rec)
        return hook

    def _post(self, name):
        def hook(module, args, kwargs, output):
            stack = self._stacks.get((self.micro_batch, name))
            if not stack:
                return
            rec = stack.pop()
            rec.forward_order = self._forward
            self._forward += 1
            outs = [t for t in iter_tensors(output) if is_floating(t)]
            rec.outputs = [t.detach().clone() for t in outs]
            rec.output_requires_grad = [bool(t.requires_grad) for t in outs]
            rec.grad_outputs = [None] * len(outs)
            for i, t in enumerate(outs):
                if t.requires_grad:
                    t.register_hook(self._grad_hook(rec, i))
                    if t.grad_fn is not None:
                        self.output_nodes.setdefault(t.grad_fn, name)
            self.calls[rec.key] = rec
        return hook

    def _grad_hook(self, rec: ModuleCall, index: int):
        def hook(grad):
            if rec.backward_order is None:
                rec.backward_order = self._backward
                self._backward += 1
            rec.grad_outputs[index] = grad.detach().clone()
        return hook


class AnomalyCatcher:
    """`torch.autograd.detect_anomaly` around a run; turns the error it
    raises and the forward traceback it warns about into a small report."""

    def __enter__(self):
        self._warnings = warnings.catch_warnings(record=True)
        self.caught = self._warnings.__enter__()
        warnings.simplefilter("always")
        self._mode = torch.autograd.detect_anomaly(check_nan=True)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._warnings.__exit__(*exc)
        return False

    @staticmethod
    def is_anomaly(exc: BaseException) -> bool:
        return isinstance(exc, RuntimeError) and "returned nan values" in str(exc)

    def report(self, exc: BaseException) -> dict:
        message = str(exc)
        op = None
        if message.startswith("Function '"):
            op = message.split("'")[1]
        trace = None
        for w in self.caught:
            text = str(w.message)
            if "Traceback of forward call" in text:
                trace = text.split("Traceback of forward call that caused the error:", 1)[-1]
                trace = _model_frames(trace.split("(Triggered internally", 1)[0].rstrip())
                if op is None and text.startswith("Error detected in "):
                    op = text[len("Error detected in "):].split(".", 1)[0]
        return {"raised": True, "op": op, "message": message.splitlines()[0] if message else "",
                "traceback": trace}


class BackwardWatch:
    """A hook on every node of the autograd graph below a run's outputs:
    the first backward op (in execution order) whose result holds a NaN or
    an Inf. Anomaly mode raises on NaN only; an Inf (a scaled gradient
    overflowing float16) passes it silently, and this still finds it. The
    forward traceback is the one anomaly mode stores on the node; the module
    is the innermost one whose output the node produced, when it is one.
    Every handle is removed by `close()`."""

    def __init__(self, recorder: CallRecorder | None = None):
        self.recorder = recorder
        self.first: dict | None = None
        self._handles = []

    def watch(self, outputs) -> None:
        stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen = set()
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            self._handles.append(node.register_hook(self._hook(node)))
            stack.extend(f for f, _ in node.next_functions)

    def _hook(self, node):
        def hook(grad_inputs, grad_outputs):
            if self.first is not None:
                return
            bad = [g for g in grad_inputs if isinstance(g, torch.Tensor) and not bool(torch.isfinite(g).all())]
            if not bad:
                return
            nan = any(bool(torch.isnan(g).any()) for g in bad)
            module = (self.recorder.output_nodes.get(node) if self.recorder is not None else None)
            trace = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
            self.first = {"op": node.name(), "module": module, "values": "NaN" if nan else "Inf",
                          "traceback": _model_frames("".join(trace)) if trace else None}
        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _model_frames(trace: str) -> str:
    """The forward traceback from the model's own call on, without torch's
    own frames (module call plumbing), paths relative to the current
    directory where they lie under it: the frames of the replay machinery
    and of torch say nothing about the model."""
    lines = trace.splitlines()
    cut = max((i for i, line in enumerate(lines) if "amp_postmortem/replaying/engine.py" in line
               or "amp_postmortem\\replay\\engine.py" in line), default=-1)
    if cut >= 0:
        lines = lines[cut + 2:]  # the frame line and its source line
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    cwd = os.getcwd() + os.sep
    out, skip = [], False
    for line in lines:
        stripped = line.lstrip()
        if stripped.startswith('File "'):
            path = stripped[len('File "'):].split('"', 1)[0]
            skip = path.startswith(torch_dir)
            if skip:
                continue
            if path.startswith(cwd):
                line = line.replace(path, path[len(cwd):], 1)
        elif skip:
            continue  # the source line (and carets) of a skipped frame
        out.append(line)
    return "\n".join(out).strip("\n")
