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

The backward (`backward`): the model's compiled loss on the bundle's
targets and sample weights (a model the factory did not compile is
compiled with the loss the bundle names: a Keras built-in only, by name or
class), times the recorded loss scale under float16 (1 otherwise, as
Keras' mixed_bfloat16 has none), differentiated with respect to a zero
added to each layer call's floating inputs and outputs (the gradient of a
layer call's output and the one it hands its inputs, exactly: adding zero
changes no value) and to the trainable variables: `tf.GradientTape` on
TensorFlow, `jax.grad` over a `StatelessScope` on JAX. Gradients are
divided by the scale in float64 for the comparison.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np

from ..errors import ModelSpecError
from .attribution import CallGrads, RunCalls

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
    raw_outputs: object = None  # the output tensors as the layer returned them


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
        meta = bundle.meta
        self.targets = [keras.tree.map_structure(_tensor(keras), bundle.tree(meta[k])) if meta.get(k) else None
                        for k in ("targets", "sample_weight")]
        self.loss_config = meta.get("loss_config")

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

    def backward(self, precision: str, result: RunCalls, scale: float) -> None:
        """Gradients of every layer call and variable of `precision`'s
        model, the loss times `scale`, into `result.grads` (unscaled)."""
        keras = self.keras
        keras_name, layer_name, layers_of = self._names
        model = self._build(precision)
        if getattr(model, "_compile_loss", None) is None:
            loss = _builtin_loss(keras, self.loss_config)
            if loss is None:
                result.backward_error = ("the run's loss is not a Keras built-in the bundle can name: compile the "
                                         "model with its loss in the factory to replay the backward")
                return
            model.compile(optimizer="sgd", loss=loss)
        shapes = self.calls[precision]
        probes = {key: ([keras.ops.zeros(t.shape, t.dtype) for t in _floating(keras, (c.args, c.kwargs))],
                        [keras.ops.zeros(t.shape, t.dtype) for t in _floating(keras, c.raw_outputs)])
                  for key, c in shapes.items()}
        keys = list(probes)
        # Training differentiates the variables only: the gradient of the
        # model's own inputs (as a layer receives them, cast) is never made
        # there, so it is not probed here either.
        model_inputs = _floating(keras, (self.args, self.kwargs))
        skip = {key: [_is_model_input(keras, t, model_inputs) for t in _floating(keras, (c.args, c.kwargs))]
                for key, c in shapes.items()}
        x = self.args[0] if len(self.args) == 1 else self.args
        y, sample_weight = self.targets
        variables = list(model.trainable_variables)
        counts: dict = {}

        def scaled_loss(flat_probes):
            live = {k: (flat_probes[2 * i], flat_probes[2 * i + 1], skip[k]) for i, k in enumerate(keys)}
            counts.clear()
            undo = [_probe(layer, layer_name(layer, model.name), live, counts, keras) for layer in layers_of(model)]
            try:
                y_pred = model(*self.args, training=True, **self.kwargs)
                loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
            finally:
                for u in undo:
                    u()
            return keras.ops.multiply(keras.ops.cast(loss, "float32"), scale)

        flat = [p for k in keys for p in probes[k]]
        try:
            probe_grads, var_grads = _gradients(keras, model, variables, scaled_loss, flat)
        except Exception as exc:  # noqa: BLE001 - the user's model may raise anything
            result.backward_error = f"{type(exc).__name__}: {exc}"
            return
        by_layer: dict = {}
        for v, g in zip(variables, var_grads):
            if g is not None:
                by_layer.setdefault(id(v), g)
        first_call = {}
        for layer in layers_of(model):
            first_call[(layer_name(layer, model.name), 0)] = [by_layer[id(v)] for v in layer.trainable_variables
                                                               if id(v) in by_layer]
        def unscale(grads, like):
            # No gradient: the value does not reach the loss (zero).
            return [np.zeros(tuple(p.shape)) if g is None else _host(keras, g) / scale for g, p in zip(grads, like)]

        for i, key in enumerate(keys):
            ins, outs = probe_grads[2 * i], probe_grads[2 * i + 1]
            params = first_call.get(key, [])
            result.grads[key] = CallGrads(outputs=unscale(outs, probes[key][1]), inputs=unscale(ins, probes[key][0]),
                                          params=unscale(params, params))

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


def _builtin_loss(keras, config):
    """The loss a bundle names, looked up among Keras' own (nothing else is
    resolved: a bundle names no code to run); None when it names none."""
    if not isinstance(config, dict):
        return None
    if isinstance(config.get("name"), str):
        try:
            return keras.losses.get(config["name"])
        except (ValueError, TypeError):
            return None
    cls = getattr(keras.losses, str(config.get("class_name")), None)
    if isinstance(cls, type) and issubclass(cls, keras.losses.Loss) and cls.__module__.startswith("keras."):
        return cls(**(config.get("config") or {}))
    return None


def _gradients(keras, model, variables, scaled_loss, flat_probes):
    """(gradients of the probes, of `variables`) of `scaled_loss(probes)`."""
    if keras.backend.backend() == "jax":
        import jax
        values = [v.value for v in variables]
        others = [(v, v.value) for v in model.non_trainable_variables]

        def f(probes, vals):
            with keras.StatelessScope(state_mapping=list(zip(variables, vals)) + others):
                return scaled_loss(probes)

        return jax.grad(f, argnums=(0, 1))(flat_probes, values)
    import tensorflow as tf
    with tf.GradientTape() as tape:
        tape.watch(flat_probes)
        loss = scaled_loss(flat_probes)
    grads = tape.gradient(loss, list(flat_probes) + [v.value for v in variables])
    return grads[:len(flat_probes)], grads[len(flat_probes):]


def _probe(layer, name, live: dict, counts: dict, keras):
    """Wrap `layer.call`: its floating inputs and outputs plus the zeros
    of `live[(name, call)]` (what the gradient is taken of)."""
    original = layer.call
    had_own = "call" in layer.__dict__

    def call(*args, **kwargs):
        index = counts.get(name, 0)
        counts[name] = index + 1
        probes = live.get((name, index))
        if probes is not None:
            args, kwargs = _plus(keras, (args, kwargs), probes[0], probes[2])
        out = original(*args, **kwargs)
        return _plus(keras, out, probes[1]) if probes is not None else out

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


def _plus(keras, tree, probes: list, skip=()):
    """`tree` with the i-th floating leaf plus `probes[i]` (unless `skip[i]`)."""
    flat = keras.tree.flatten(tree)
    floating = {id(t) for t in _floating(keras, tree)}
    out, i = [], 0
    for t in flat:
        if id(t) in floating:
            out.append(t if i < len(skip) and skip[i] else keras.ops.add(t, probes[i]))
            i += 1
        else:
            out.append(t)
    return keras.tree.pack_sequence_as(tree, out)


def _is_model_input(keras, t, model_inputs: list) -> bool:
    """`t` holds one of the model's inputs, cast to its dtype."""
    dtype = keras.backend.standardize_dtype(t.dtype)
    host = _host(keras, t)
    return any(tuple(i.shape) == tuple(t.shape) and np.array_equal(_host(keras, keras.ops.cast(i, dtype)), host)
               for i in model_inputs)


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
        calls[(name, index)] = _Call(name, index, layer, args, kwargs, [_host(keras, t) for t in _floating(keras, out)],
                                     out)
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
