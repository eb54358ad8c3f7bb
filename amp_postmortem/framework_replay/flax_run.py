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
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..errors import ModelSpecError
from .attribution import RunCalls

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


class FlaxRunner:
    def __init__(self, bundle, factory, notes: list):
        from recorders.format.flax_names import module_name, named_params
        self._params, self._module_name = named_params, module_name
        self.bundle, self.factory, self.notes = bundle, factory, notes
        compute = (bundle.meta.get("policy") or {}).get("compute_dtype") or "float32"
        self.recorded_precision = PRECISION_OF_DTYPE.get(str(compute), "fp32")
        args, kwargs = bundle.inputs()
        self.args = jax.tree_util.tree_map(_array, args)
        self.kwargs = jax.tree_util.tree_map(_array, kwargs)
        self.calls: dict = {}

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
                calls[(name, index)] = _Call(name, index, module, args, kwargs, [_host(t) for t in _floating(out)])
                order.append((name, index))
            return out

        cls.__call__ = __call__

        def undo():
            if had_own:
                cls.__call__ = original
            else:
                del cls.__call__
        return undo

    def local(self, precision: str, key) -> tuple[list, int]:
        """The module of `precision`'s model alone on float32's inputs of
        the call `key`, rounded to the dtypes `precision`'s run gave it."""
        ref, run = self.calls["fp32"][key], self.calls[precision][key]
        args, kwargs = _rounded((ref.args, ref.kwargs), (run.args, run.kwargs))
        bad = sum(int(np.sum(~np.isfinite(_host(t)))) for t in _floating((args, kwargs)))
        out = run.module(*args, **kwargs)
        return [_host(t) for t in _floating(out)], bad


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
