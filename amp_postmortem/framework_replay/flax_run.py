"""Re-run a Flax nnx bundle's step forward per precision. Imported only for
a Flax bundle's replay: it imports JAX and Flax.

Per precision the user's factory is called (no arguments); the model it
returns runs as built for the recorded precision (its modules' `dtype` as
the training script set them), and with every module's `dtype` attribute
set to float32 / float16 / bfloat16 for the others (`nnx.Linear`, `nnx.Conv`,
`nnx.LayerNorm`, ... compute in their `dtype`; a cast written in the
model's own code stays what it is). The bundle's `nnx.Param`s are loaded
by run name, strictly. Every module's `__call__` is wrapped at its class
(Python looks special methods up on the type) while the forward runs
eagerly, to keep each call's arguments and outputs; the wrappers are
removed after it.

The backward (`backward`, given the step's loss function: `--loss-fn
FILE:fn`, called with the recorded step's own arguments, the replayed
model in the model's place and None for any other object such as the
optimizer, returning the unscaled loss): that loss times the recorded
loss scale under float16, differentiated by `jax.grad` with respect to a
zero added to each module call's floating inputs and outputs and to the
`nnx.Param`s (the model split and merged inside the differentiated
function). Gradients are divided by the scale in float64.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..errors import ModelSpecError
from .attribution import CallGrads, RunCalls

DTYPES = {"fp32": jnp.float32, "fp16": jnp.float16, "bf16": jnp.bfloat16}
PRECISION_OF_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclass
class _Call:
    name: str
    call: int
    module: object
    args: tuple
    kwargs: dict
    outputs: list
    raw_outputs: object = None


class FlaxRunner:
    def __init__(self, bundle, factory, notes: list, loss_fn=None):
        from recorders.format.flax_names import module_name, named_params
        self._params, self._module_name = named_params, module_name
        self.bundle, self.factory, self.notes = bundle, factory, notes
        compute = (bundle.meta.get("policy") or {}).get("compute_dtype") or "float32"
        self.recorded_precision = PRECISION_OF_DTYPE.get(str(compute), "fp32")
        args, kwargs = bundle.inputs()
        self.args = jax.tree_util.tree_map(_array, args)
        self.kwargs = jax.tree_util.tree_map(_array, kwargs)
        self.calls: dict = {}
        self.loss_fn = loss_fn

    def _build(self, precision: str):
        model = self.factory()
        if not isinstance(model, nnx.Module):
            raise ModelSpecError(f"the model factory returned a {type(model).__name__}, not an nnx.Module")
        if precision != self.recorded_precision:
            for _, node in nnx.iter_graph(model):
                if isinstance(node, nnx.Module) and getattr(node, "dtype", None) is not None:
                    node.dtype = DTYPES[precision]
        self._load(model)
        return model

    def _load(self, model) -> None:
        saved = self.bundle.params
        state = nnx.state(model, nnx.Param)
        names = [n for n, _ in self._params(model)]
        if set(names) != set(saved):
            missing = sorted(set(saved) - set(names))
            unknown = sorted(set(names) - set(saved))
            raise ModelSpecError(f"the model's parameters are not the bundle's: missing from the model "
                                 f"{missing[:8]}, not in the bundle {unknown[:8]}")
        leaves, treedef = jax.tree_util.tree_flatten(state)
        new = []
        for name, leaf in zip(names, leaves):
            a = saved[name]
            if tuple(leaf.shape) != tuple(a.shape):
                raise ModelSpecError(f"parameter {name}: the model's shape {tuple(leaf.shape)} is not the "
                                     f"bundle's {tuple(a.shape)}")
            new.append(jnp.asarray(a, dtype=leaf.dtype))
        nnx.update(model, jax.tree_util.tree_unflatten(treedef, new))

    def run(self, precision: str) -> RunCalls:
        model = self._build(precision)
        paths = {id(node): tuple(str(p) for p in path) for path, node in nnx.iter_graph(model)
                 if isinstance(node, nnx.Module)}
        calls: dict = {}
        result = RunCalls(precision)
        restore = []
        for cls in {type(node) for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)}:
            restore.append(self._wrap(cls, paths, calls, result.order))
        try:
            model(*self.args, **self.kwargs)
        except Exception as exc:  # noqa: BLE001 - the user's model may raise anything
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            for undo in restore:
                undo()
        self.calls[precision] = calls
        result.outputs = {k: c.outputs for k, c in calls.items()}
        return result

    def _wrap(self, cls, paths: dict, calls: dict, order: list):
        had_own, original = "__call__" in cls.__dict__, cls.__call__
        module_name = self._module_name

        def __call__(module, *args, **kwargs):
            out = original(module, *args, **kwargs)
            if id(module) in paths:
                name = module_name(paths[id(module)], "__call__")
                index = sum(1 for n, _ in calls if n == name)
                calls[(name, index)] = _Call(name, index, module, args, kwargs, [_host(t) for t in _floating(out)], out)
                order.append((name, index))
            return out

        cls.__call__ = __call__

        def undo():
            if had_own:
                cls.__call__ = original
            else:
                del cls.__call__
        return undo

    def step_arguments(self, model) -> tuple[list, dict]:
        """The recorded step's arguments: arrays as saved, the model in
        the place of an object of the model's class, None for others."""
        spec = self.bundle.meta.get("step_arguments")
        if not spec:
            raise ModelSpecError("the bundle holds no step arguments (recorded before they were saved, or "
                                 "without FlaxRecorder.wrap): the backward cannot be replayed")
        cls = self.bundle.meta.get("model_class")

        def value(node):
            if node.get("kind") == "unsupported":
                return model if node.get("type") == cls else None
            return jax.tree_util.tree_map(_array, self.bundle.tree(node))
        return [value(n) for n in spec["args"]], {k: value(n) for k, n in spec.get("kwargs") or []}

    def backward(self, precision: str, result: RunCalls, scale: float) -> None:
        """Gradients of every module call and parameter of `precision`'s
        model, the step's loss times `scale`, into `result.grads` (unscaled)."""
        if self.loss_fn is None:
            result.backward_error = ("a Flax backward needs the step's loss: --loss-fn FILE:fn, called with the "
                                     "step's arguments (the model in its place) and returning the loss")
            return
        model = self._build(precision)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        keys = list(self.calls[precision])
        probes = [([jnp.zeros(t.shape, t.dtype) for t in _floating((c.args, c.kwargs))],
                   [jnp.zeros(t.shape, t.dtype) for t in _floating(c.raw_outputs)])
                  for c in (self.calls[precision][k] for k in keys)]
        module_name = self._module_name
        # Training differentiates the parameters only: the gradient of the
        # model's own inputs (as a module receives them) is never made there.
        model_inputs = _floating((self.args, self.kwargs))
        skip = {k: [_is_model_input(t, model_inputs) for t in _floating((c.args, c.kwargs))]
                for k, c in self.calls[precision].items()}

        def scaled_loss(probe_values, param_values):
            replica = nnx.merge(graphdef, param_values, rest)
            paths = {id(node): tuple(str(p) for p in path) for path, node in nnx.iter_graph(replica)
                     if isinstance(node, nnx.Module)}
            live = {k: (ins, outs, skip[k]) for k, (ins, outs) in zip(keys, probe_values)}
            counts: dict = {}
            undo = [_probe(cls, paths, live, counts, module_name) for cls in
                    {type(node) for _, node in nnx.iter_graph(replica) if isinstance(node, nnx.Module)}]
            try:
                args, kwargs = self.step_arguments(replica)
                loss = self.loss_fn(*args, **kwargs)
            finally:
                for u in undo:
                    u()
            return jnp.asarray(loss).astype(jnp.float32) * scale

        try:
            probe_grads, param_grads = jax.grad(scaled_loss, argnums=(0, 1))(probes, params)
        except ModelSpecError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's loss may raise anything
            result.backward_error = f"{type(exc).__name__}: {exc}"
            return
        by_module: dict = {}
        # The gradients' state has the parameters' structure: their leaves in `named_params` order.
        names = [n for n, _ in self._params(model)]
        for name, g in zip(names, jax.tree_util.tree_leaves(param_grads)):
            by_module.setdefault(name.rpartition(".")[0], []).append(g)
        for key, (ins, outs) in zip(keys, probe_grads):
            params_here = by_module.get(key[0], []) if key[1] == 0 else []
            result.grads[key] = CallGrads(outputs=[_host(g) / scale for g in outs],
                                          inputs=[_host(g) / scale for g in ins],
                                          params=[_host(g) / scale for g in params_here])

    def local(self, precision: str, key) -> tuple[list, int]:
        """The module of `precision`'s model alone on float32's inputs of
        the call `key`, rounded to the dtypes `precision`'s run gave it."""
        ref, run = self.calls["fp32"][key], self.calls[precision][key]
        args, kwargs = _rounded((ref.args, ref.kwargs), (run.args, run.kwargs))
        bad = sum(int(np.sum(~np.isfinite(_host(t)))) for t in _floating((args, kwargs)))
        out = run.module(*args, **kwargs)
        return [_host(t) for t in _floating(out)], bad


def _probe(cls, paths: dict, live: dict, counts: dict, module_name):
    """Wrap `cls.__call__`: a call's floating inputs and outputs plus the
    zeros of `live[(name, call)]`; returns the undo."""
    had_own, original = "__call__" in cls.__dict__, cls.__call__

    def __call__(module, *args, **kwargs):
        key = None
        if id(module) in paths:
            name = module_name(paths[id(module)], "__call__")
            key = (name, counts.get(name, 0))
            counts[name] = key[1] + 1
        probes = live.get(key)
        if probes is not None:
            args, kwargs = _plus((args, kwargs), probes[0], probes[2])
        out = original(module, *args, **kwargs)
        return _plus(out, probes[1]) if probes is not None else out

    cls.__call__ = __call__

    def undo():
        if had_own:
            cls.__call__ = original
        else:
            del cls.__call__
    return undo


def _plus(tree, probes: list, skip=()):
    """`tree` with its i-th floating leaf plus `probes[i]` (unless `skip[i]`)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out, i = [], 0
    for leaf in leaves:
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
            out.append(leaf if i < len(skip) and skip[i] else leaf + probes[i])
            i += 1
        else:
            out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def _is_model_input(t, model_inputs: list) -> bool:
    """`t` holds one of the model's inputs, cast to its dtype."""
    host = _host(t)
    return any(tuple(i.shape) == tuple(t.shape) and np.array_equal(_host(jnp.asarray(i).astype(t.dtype)), host)
               for i in model_inputs)


def _array(a):
    return jnp.asarray(a) if isinstance(a, np.ndarray) else a


def _floating(tree) -> list:
    return [t for t in jax.tree_util.tree_leaves(tree)
            if hasattr(t, "dtype") and jnp.issubdtype(t.dtype, jnp.floating)]


def _host(t) -> np.ndarray:
    return np.asarray(jnp.asarray(t).astype(jnp.float32), dtype=np.float64)


def _rounded(ref_tree, run_tree):
    def cast(r, x):
        if _floating([r]) and _floating([x]):
            return jnp.asarray(r).astype(x.dtype)
        return r
    try:
        return jax.tree_util.tree_map(cast, ref_tree, run_tree)
    except (ValueError, TypeError):
        return ref_tree
