"""Re-run a Keras bundle's step forward under one dtype policy per
precision. Imported only for a Keras bundle's replay: it imports Keras
(with the backend the run recorded, unless Keras is already imported or
KERAS_BACKEND says otherwise: then the note says which ran).

Per precision the user's factory is called under that precision's global
dtype policy (`float32`; the recorded policy, e.g. `mixed_float16`, for the
recorded precision; else `mixed_float16` / `mixed_bfloat16`), after
`keras.backend.clear_session()` and `keras.utils.set_random_seed(0)` (so
auto-generated layer names and dropout draws are the same in every run).
The bundle's variables are assigned by run name (strictly: a missing or
unknown name is an error, unless names differ only by Keras' automatic
numbering and every shape matches in order: then by order, with a note).
Every layer's `call` is wrapped on the instance to keep its arguments and
outputs; the forward runs eagerly, as `train_step` calls it
(`model(x, training=True)`).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np

from ..errors import ModelSpecError
from .attribution import RunCalls

POLICY = {"fp32": "float32", "fp16": "mixed_float16", "bf16": "mixed_bfloat16"}
PRECISION_OF_COMPUTE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}


def import_keras(backend: str | None, notes: list):
    """Keras, with the recorded backend when nothing chose one yet."""
    if "keras" not in sys.modules and backend and not os.environ.get("KERAS_BACKEND"):
        os.environ["KERAS_BACKEND"] = backend
    import keras
    used = keras.backend.backend()
    if backend and used != backend and not any(backend in n for n in notes):
        notes.append(f"the run recorded Keras' {backend} backend; this replay ran on {used} "
                     f"(set KERAS_BACKEND={backend} to replay on the recorded one)")
    return keras


@dataclass
class _Call:
    name: str
    call: int
    layer: object
    args: tuple
    kwargs: dict
    outputs: list


class KerasRunner:
    def __init__(self, bundle, factory, notes: list):
        self.keras = keras = import_keras(bundle.backend, notes)
        from recorders.format.keras_names import keras_name, layer_name, layers_of
        self._names = (keras_name, layer_name, layers_of)
        self.bundle, self.factory, self.notes = bundle, factory, notes
        self.recorded_policy = (bundle.meta.get("policy") or {}).get("name") or "float32"
        compute = (bundle.meta.get("policy") or {}).get("compute_dtype") or "float32"
        self.recorded_precision = PRECISION_OF_COMPUTE.get(compute, "fp32")
        self.calls: dict = {}   # precision -> {(name, call): _Call}
        args, kwargs = bundle.inputs()
        self.args = keras.tree.map_structure(_tensor(keras), args)
        self.kwargs = keras.tree.map_structure(_tensor(keras), kwargs)

    def policy(self, precision: str) -> str:
        return self.recorded_policy if precision == self.recorded_precision else POLICY[precision]

    def _build(self, precision: str):
        keras = self.keras
        before = keras.config.dtype_policy()
        keras.backend.clear_session()
        keras.config.set_dtype_policy(self.policy(precision))
        try:
            keras.utils.set_random_seed(0)
            model = self.factory()
            if not isinstance(model, keras.Model):
                raise ModelSpecError(f"the model factory returned a {type(model).__name__}, not a keras.Model")
            if not model.built:
                model(*self.args, **self.kwargs)
            self._load(model)
        finally:
            keras.config.set_dtype_policy(before)
        return model

    def _load(self, model) -> None:
        keras_name = self._names[0]
        saved = self.bundle.params
        variables = {keras_name(v.path, model.name): v for v in model.weights}
        if set(variables) != set(saved):
            shapes_match = len(variables) == len(saved) and all(
                tuple(v.shape) == tuple(a.shape) for v, a in zip(variables.values(), saved.values()))
            if not shapes_match:
                missing = sorted(set(saved) - set(variables))
                unknown = sorted(set(variables) - set(saved))
                raise ModelSpecError(f"the model's variables are not the bundle's: missing from the model "
                                     f"{missing[:8]}, not in the bundle {unknown[:8]}")
            note = "the model's variable names differ from the recorded ones; the weights were loaded by order"
            if note not in self.notes:
                self.notes.append(note)
            pairs = zip(variables.values(), saved.values())
        else:
            pairs = ((v, saved[n]) for n, v in variables.items())
        for v, a in pairs:
            if tuple(v.shape) != tuple(a.shape):
                raise ModelSpecError(f"variable {v.path}: the model's shape {tuple(v.shape)} is not the "
                                     f"bundle's {tuple(a.shape)}")
            v.assign(a.astype(v.dtype))

    def run(self, precision: str) -> RunCalls:
        keras = self.keras
        model = self._build(precision)
        _, layer_name, layers_of = self._names
        calls: dict = {}
        result = RunCalls(precision)
        undo = []
        for layer in layers_of(model):
            undo.append(_wrap(layer, layer_name(layer, model.name), calls, result.order, keras))
        try:
            model(*self.args, training=True, **self.kwargs)
        except Exception as exc:  # noqa: BLE001 - the user's model may raise anything
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            for u in undo:
                u()
        self.calls[precision] = calls
        result.outputs = {k: c.outputs for k, c in calls.items()}
        return result

    def local(self, precision: str, key) -> tuple[list, int]:
        """The layer of `precision`'s model alone on float32's inputs of the
        call `key`, rounded to the dtypes `precision`'s run gave it:
        (outputs, NaN/Inf count among those rounded inputs)."""
        keras = self.keras
        ref, run = self.calls["fp32"][key], self.calls[precision][key]
        args, kwargs = _rounded(keras, (ref.args, ref.kwargs), (run.args, run.kwargs))
        bad = sum(int(np.sum(~np.isfinite(keras.ops.convert_to_numpy(t).astype(np.float64))))
                  for t in _floating(keras, (args, kwargs)))
        out = run.layer(*args, **kwargs)
        return [_host(keras, t) for t in _floating(keras, out)], bad


def _tensor(keras):
    return lambda a: keras.ops.convert_to_tensor(a) if isinstance(a, np.ndarray) else a


def _floating(keras, tree) -> list:
    out = []
    for t in keras.tree.flatten(tree):
        if t is not None and hasattr(t, "dtype") and hasattr(t, "shape"):
            try:
                if "float" in keras.backend.standardize_dtype(t.dtype):
                    out.append(t)
            except Exception:  # noqa: BLE001 - not an array
                pass
    return out


def _host(keras, t) -> np.ndarray:
    return keras.ops.convert_to_numpy(keras.ops.cast(t, "float32")).astype(np.float64)


def _rounded(keras, ref_tree, run_tree):
    """`ref_tree`'s floating leaves cast to the dtypes of `run_tree`'s."""
    def cast(r, x):
        if _floating(keras, [r]) and _floating(keras, [x]):
            return keras.ops.cast(r, keras.backend.standardize_dtype(x.dtype))
        return r
    try:
        return keras.tree.map_structure(cast, ref_tree, run_tree)
    except (ValueError, TypeError):
        return ref_tree


def _wrap(layer, name, calls: dict, order: list, keras):
    original = layer.call
    had_own = "call" in layer.__dict__

    def call(*args, **kwargs):
        out = original(*args, **kwargs)
        index = sum(1 for n, _ in calls if n == name)
        calls[(name, index)] = _Call(name, index, layer, args, kwargs, [_host(keras, t) for t in _floating(keras, out)])
        order.append((name, index))
        return out

    object.__setattr__(layer, "call", call)

    def undo():
        if had_own:
            object.__setattr__(layer, "call", original)
        else:
            try:
                object.__delattr__(layer, "call")
            except AttributeError:
                pass
    return undo
