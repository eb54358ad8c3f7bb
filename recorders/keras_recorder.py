"""The Keras 3 recorder (TensorFlow and JAX backends): a callback that
writes the run format the PyTorch recorder writes.

    rec = KerasRecorder("runs/exp1", model)
    model.fit(x, y, callbacks=[rec])
    rec.close()

Per step: the step's own loss (what `compute_loss` returned, unscaled; not
the running mean of `logs["loss"]`), the loss scale before and after and an
exact skip flag from the `LossScaleOptimizer` (its own finiteness check of
the gradients), the unscaled gradient norm; and the cheap tier's rows: each
layer's output (`activation`, `input_nonfinite` from its inputs), the
model's `<input>`, the `<loss>` and every trainable variable's unscaled
gradient (`param_grad`); in backward order, the gradient reaching each
layer's output (`grad_output`, the model's output's named "") and what the
layer's backward hands its inputs (`grad_input`), scaled as they travel
(`gradient_tap`). All of it is reduced inside the compiled train step, to
five numbers per row, and leaves the device once per step. A full-tier
step runs a second train function, traced with the full tier's reductions
too (`xp_stats`: 14 numbers per row, PyTorch's definitions); the other
steps run the one without them. Which steps are full is the PyTorch
recorder's `RecordSchedule` (`schedule.py`), with its every-step mode's
defaults: every `full_every`-th step (100, from step 0), and a burst of
`full_after_event` steps (20) after the first event of each kind (a
skipped step, NaN/Inf in the forward, in the gradients, in the loss).
Both train functions are traced once; switching tiers recompiles nothing.

How the numbers leave the step. Every layer's `call`, the model's
`compute_loss` and `train_step` and the optimizer's `apply` /
`stateless_apply` get instance-level wrappers (removed by `close()`), and
the train function is made again so that it traces them. The rows ride in
the train step's logs under a private key, which a wrapper of
`model.train_function` takes out before any other callback sees the logs
(JAX: read when the step's `on_train_batch_end` comes). On JAX the forward
runs inside `jax.value_and_grad`, whose tracers cannot leave it except as
its outputs, and values written into Keras variables inside the step are
dropped by its stateless scope (they stay 0): the forward's statistics
leave it as the residuals of an identity on the loss, whose backward rule
hands them to the train step (`jax_grad_tap.carry_out`). No host callback
runs in the step (two `jax.debug.callback`s and the barrier that waited
for them cost ~2 ms a step on the CPU).

A model with its own `train_step` is recorded as long as that step calls
`self.compute_loss(...)` and `self.optimizer.apply(...)` (as Keras' guide to
custom train steps writes it); a step that computes its loss by other
means hands it over with `rec.add_loss(loss)` inside the step.

Replay bundles (`bundles=`, a `host_bundle.BundleTriggers`; None: off):
at the first step with a non-finite loss, the first with NaN/Inf in a
forward row and the first with NaN/Inf in a backward row only, the step's
batch (x, y, sample weights: the train function is wrapped to hold a
reference to the batch it pulls, nothing is copied unless a bundle is
saved) and the model's variables are written, pickle-free
(`host_bundle.py`); `amp-postmortem replay RUN --step N --model
FILE:factory` re-runs it. The variables are read after the step: exactly
those the forward used when the loss scale skipped the update
(`params.exact`), else the updated ones.

Not supported (refused with `KerasRecorderError`): `steps_per_execution > 1`
(callbacks see every N-th batch, and a train function then runs N steps)
and an optimizer with `gradient_accumulation_steps` (the skip flag would
name micro-batches, not optimizer steps).
"""
from __future__ import annotations

import json
import math
import time

import keras
import numpy as np
from keras import ops

from . import xp_stats
from .format import schema
from .jax_grad_tap import carry_out, cheap_stats, identity_with_gradient
from .format.keras_names import keras_name, layer_name, layers_of
from .errors import OptionError, option_float, option_int
from .host_bundle import BundleTriggers, encode_tree, write_bundle
from .host_run import HostRun, StepRecord, backward_rows, framework_entry, stats_row, step_events
from .keras_loss_scaling import INNER_OPTIMIZER, LOSS_SCALE_OPTIMIZER, LossScalingLog, grad_loss_ratio
from .schedule import EVERY_STEP, FULL, RecordSchedule

LOGS_KEY = "_amp_postmortem"
# [absmax, nan_count, inf_count, input_nonfinite, numel] of one row, float32
# (counts exact up to 2**24 values per row).
STAT_WIDTH = 5
# The full tier every 100 steps and in a burst of 20 after the first event
# of each kind by default, as the PyTorch recorder's every-step mode
# (`schedule.EVERY_STEP`): this recorder reduces every step's rows in the
# graph and re-executes no failing step (the sentinel's `full_after_event=0`
# leans on that re-execution), so the burst is what shows a failure's start.
FULL_EVERY = EVERY_STEP["full_every"]
FULL_AFTER_EVENT = EVERY_STEP["full_after_event"]
SCALARS = ("loss", "loss_scale_before", "loss_scale", "growth_tracker", "skipped", "grad_sqsum", "lr",
           "grad_loss_ratio")


class KerasRecorderError(OptionError):
    """A Keras set-up the recorder cannot record truthfully (one line)."""


# ------------------------------------------------------------ in the graph
def _floating(tree) -> list:
    out = []
    for t in keras.tree.flatten(tree):
        if t is None or not hasattr(t, "dtype") or not hasattr(t, "shape"):
            continue
        try:
            dtype = keras.backend.standardize_dtype(t.dtype)
        except Exception:  # noqa: BLE001 - not an array
            continue
        if "float" in dtype:
            out.append(t)
    return out


def _nonfinite_count(tensors) -> object:
    total = ops.zeros((), "float32")
    for t in tensors:
        total = total + ops.cast(ops.sum(ops.cast(ops.logical_not(ops.isfinite(t)), "int32")), "float32")
    return total


def row_stats(tensors: list, inputs: list = (), scale=None, full: bool = False,
              near_overflow: float = schema.FP16_MAX):
    """The row's five numbers, in the graph: the largest finite magnitude,
    the NaN and Inf counts, the non-finite values among `inputs`, the number
    of values; `scale`: divide by it first (gradients, unscaled). `full`:
    the full tier's nine after them (`xp_stats`; `near_overflow`: the
    magnitude counted as near overflow), on full-tier steps only (their
    own traced train function: cheap steps run none of it)."""
    if full:
        return _full_row_stats(tensors, inputs, scale, near_overflow)
    absmax = ops.zeros((), "float32")
    nans = ops.zeros((), "float32")
    infs = ops.zeros((), "float32")
    numel = 0
    jax_backend = keras.backend.backend() == "jax"
    for t in tensors:
        x = ops.cast(t, "float32")
        if scale is not None:
            x = x / scale
        if jax_backend:  # one pass over the values, not three
            largest, n, i = cheap_stats(x)
        else:
            finite = ops.isfinite(x)
            largest = ops.max(ops.where(finite, ops.abs(x), ops.zeros_like(x)))
            n = ops.cast(ops.sum(ops.cast(ops.isnan(x), "int32")), "float32")
            i = ops.cast(ops.sum(ops.cast(ops.isinf(x), "int32")), "float32")
        absmax, nans, infs = ops.maximum(absmax, largest), nans + n, infs + i
        numel = numel + ops.cast(ops.size(x), "float32")
    return ops.stack([absmax, nans, infs, _nonfinite_count(inputs), ops.cast(numel, "float32")])


def _full_row_stats(tensors, inputs, scale, near_overflow):
    rows = []
    for t in tensors:
        x = ops.cast(t, "float32")
        if scale is not None:
            x = x / scale
        cheap = row_stats([x])
        tail = xp_stats.full_tail(x, _static_size(x), ops, ops.cast, near_overflow)
        rows.append(ops.stack([cheap[0], cheap[1], cheap[2], cheap[3], cheap[4], *tail]))
    merged = xp_stats.merge_rows(rows, ops, ops.cast)
    return ops.concatenate([merged[:3], ops.reshape(_nonfinite_count(inputs), (1,)), merged[4:]])


def _static_size(x) -> int | None:
    """The number of values when the traced shape says it (None: a
    dimension unknown while TensorFlow traces)."""
    n = 1
    for d in x.shape:
        if d is None:
            return None
        n *= int(d)
    return n


def _dtype(tensors) -> str:
    return keras.backend.standardize_dtype(tensors[0].dtype) if tensors else "float32"


# What Keras reads off a tensor further on, carried to its tapped copy: the
# mask, and the logits a softmax or sigmoid output holds (`_keras_logits`),
# from which Keras' crossentropy losses compute the loss instead of from the
# probabilities. Without them the tapped output would be trained by another
# formula (the log of clipped probabilities): other numbers than the job's
# own, and worse ones (a confident wrong class costs 16.1 instead of its
# true loss).
CARRIED = ("_keras_mask", "_keras_logits")
# TensorFlow ops whose output Keras' crossentropy losses recognise by type
# when it holds no `_keras_logits` (`tf.nn.softmax` called in a layer's own
# code): a tap would hide the op, so those outputs are not tapped; the
# model's output is remade from its tapped input instead (the same op on
# the same values: the same bits).
LOGITS_OPS = ("Softmax", "Sigmoid")


def gradient_tap(tree, trace, name: str, kind: str, call: int):
    """`tree` with its floating tensors passed through an identity whose
    gradient adds a `kind` row (`grad_output`: the gradient reaching the
    layer's output; `grad_input`: what the layer's own backward hands its
    inputs) to `trace` when the backward runs it: rows in backward order,
    reduced in the graph. The values are the gradient as it travels (scaled
    by the loss scale, in its own dtype). A tensor the backward never
    reaches (the model's own inputs) gives no row.

    The model's output (`name` "", `grad_output`: the gradient entering the
    model) is tapped where the loss's gradient enters: at the logits a
    softmax or sigmoid output holds, which Keras' crossentropy losses
    differentiate instead of the probabilities; its row is the first of its
    taps the backward reaches."""
    leaves = keras.tree.flatten(tree)
    where = [i for i, t in enumerate(leaves) if _is_floating(t)]
    if not where:
        return tree
    entry = name == "" and kind == "grad_output"

    def on_grads(grads):
        grads = [g for g in grads if g is not None]
        if not grads or trace.own_backward:
            return
        if entry and trace.entered.get(call):
            return  # the loss's gradient entered by another of the output's taps
        if kind == "grad_output":
            stats = trace.row_stats(grads)
            trace.received[(name, call)] = stats[1] + stats[2]
            if entry:
                trace.entered[call] = True
        else:
            # input_nonfinite of a grad_input row: NaN/Inf in the gradient
            # the layer received at its outputs.
            received = trace.received.get((name, call))
            stats = trace.row_stats(grads)
            if received is not None:
                stats = ops.concatenate([stats[:3], ops.reshape(received, (1,)), stats[4:]])
        trace.add_backward(name, kind, call, _dtype(grads), stats)

    ops_out = {i: _logits_op(leaves[i]) for i in where}
    plain = [i for i in where if ops_out[i] is None]
    if plain:
        tapped = _identity_with_gradient([leaves[i] for i in plain], on_grads)
        for i, t in zip(plain, tapped):
            for attr in CARRIED:
                value = getattr(leaves[i], attr, None)
                if value is not None:
                    try:
                        setattr(t, attr, value)
                    except AttributeError:
                        pass
            leaves[i] = t
    if entry:
        # The logits: those the outputs hold, and the inputs of the softmax
        # and sigmoid ops the losses recognise, remade on the tapped inputs.
        held = [i for i in plain if getattr(leaves[i], "_keras_logits", None) is not None]
        made = [i for i in where if ops_out[i] is not None]
        logits = [leaves[i]._keras_logits for i in held] + [leaves[i].op.inputs[0] for i in made]
        if logits:
            logits = _identity_with_gradient(logits, on_grads)
            for i, lg in zip(held, logits):
                leaves[i]._keras_logits = lg
            for i, lg in zip(made, logits[len(held):]):
                leaves[i] = _remake(ops_out[i], lg)
    return keras.tree.pack_sequence_as(tree, leaves)


def _logits_op(t) -> str | None:
    """The type of the TensorFlow op that made `t` when it is one the losses
    recognise (and `t` holds no `_keras_logits`); None otherwise (JAX, eager
    values, every other op)."""
    op = getattr(t, "op", None)
    if op is None or getattr(t, "_keras_logits", None) is not None or keras.backend.backend() != "tensorflow":
        return None
    try:
        kind = op.type
    except AttributeError:  # an eager tensor's op raises
        return None
    return kind if kind in LOGITS_OPS and len(op.inputs) == 1 else None


def _remake(op_type: str, x):
    import tensorflow as tf
    return tf.nn.softmax(x) if op_type == "Softmax" else tf.math.sigmoid(x)


def _is_floating(t) -> bool:
    return bool(_floating([t])) and not isinstance(t, keras.Variable)


def _identity_with_gradient(tensors: list, on_grads) -> list:
    """The identity on `tensors`, whose gradient calls `on_grads(grads)`
    (inside the backward: TensorFlow builds it into the step's graph; JAX
    calls a custom VJP's backward rule with the step's own traced values,
    outside `value_and_grad`'s tracers) and passes the gradients on."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        @tf.custom_gradient
        def tap(*xs):
            def grad(*dys):
                on_grads(list(dys))
                return list(dys)
            return [tf.identity(x) for x in xs], grad

        return list(tap(*tensors))
    return identity_with_gradient(tensors, on_grads)


class _Trace:
    """What one trace of the train step collects (static names, graph values)."""

    def __init__(self, full: bool = False, near_overflow: float = schema.FP16_MAX):
        self.full = full             # the full tier's statistics (a full-tier step's train function)
        self.near_overflow = near_overflow
        self.forward: list = []      # (name, kind, call, dtype)
        self.forward_stats: list = []
        self.calls: dict = {}
        self.grads: list = []        # (name, dtype)
        self.grad_stats: list = []
        # grad_output / grad_input rows, appended by the gradient taps as the
        # backward runs them (backward order): (name, kind, call, dtype).
        self.backward: list = []
        self.backward_stats: list = []
        self.received: dict = {}     # (name, call) -> NaN/Inf count of its grad_output (graph value)
        self.entered: dict = {}      # call -> the model output's grad_output row is taken
        self.own_backward = False    # the recorder's own gradient (grad_loss_ratio): no rows
        self.scalars: dict = {}
        self.loss_dtype: str | None = None
        self.loss_tensor = None           # the step's own loss, as computed (a graph value)
        self.carried = None               # JAX: (forward rows' meta, {forward, loss}) out of the gradient
        # How the step used a LossScaleOptimizer (keras_loss_scaling.py).
        self.scale_loss_calls = 0
        self.applied_by: str | None = None
        self.in_loss_scale_apply = False  # inside LossScaleOptimizer.apply (which calls the inner one)

    def row_stats(self, tensors, inputs=(), scale=None):
        """`row_stats` at this trace's tier and near-overflow threshold."""
        return row_stats(tensors, inputs, scale, full=self.full, near_overflow=self.near_overflow)

    def add_backward(self, name, kind, call, dtype, stats):
        self.backward.append((name, kind, call, dtype))
        self.backward_stats.append(stats)

    def add_forward(self, name, kind, dtype, stats):
        call = self.calls.get((name, kind), 0)
        self.calls[(name, kind)] = call + 1
        self.forward.append((name, kind, call, dtype))
        self.forward_stats.append(stats)


def _stack(stats, full: bool = False):
    width = xp_stats.FULL_WIDTH if full else STAT_WIDTH
    return ops.stack(stats) if stats else ops.zeros((0, width), "float32")


# ---------------------------------------------------------------- taps
class LayerTaps:
    """Wraps every sublayer's `call` so that, while a train step is traced,
    its output's statistics join the trace. `remove()` restores them."""

    def __init__(self, model, trace_of):
        self._wrapped = []
        root = model.name
        for layer in layers_of(model):
            self._wrap(layer, layer_name(layer, root), trace_of)

    def _wrap(self, layer, name, trace_of):
        original = layer.call
        had_own = "call" in layer.__dict__

        def call(*args, **kwargs):
            trace = trace_of()
            # A layer built inside the step (a subclassed model's first
            # call) runs once more in a scratch graph for its output spec:
            # values from there cannot leave it.
            tapped = trace is not None and not _in_symbolic_scope()
            if tapped:
                n = trace.calls.get((name, "activation"), 0)
                args, kwargs = gradient_tap((args, kwargs), trace, name, "grad_input", n)
            out = original(*args, **kwargs)
            if tapped:
                outs = _floating(out)
                if outs:
                    trace.add_forward(name, "activation", _dtype(outs),
                                      trace.row_stats(outs, _floating((args, kwargs))))
                    out = gradient_tap(out, trace, name, "grad_output", n)
            return out

        object.__setattr__(layer, "call", call)
        self._wrapped.append((layer, original, had_own))

    def remove(self):
        for layer, original, had_own in self._wrapped:
            if had_own:
                object.__setattr__(layer, "call", original)
            else:
                try:
                    object.__delattr__(layer, "call")
                except AttributeError:
                    pass
        self._wrapped = []


def _in_symbolic_scope() -> bool:
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope
    return in_symbolic_scope()


def _set(obj, attr, value):
    object.__setattr__(obj, attr, value)


def _restore(obj, attr, had_own, original):
    if had_own:
        _set(obj, attr, original)
    else:
        try:
            object.__delattr__(obj, attr)
        except AttributeError:
            pass


class KerasRecorder(keras.callbacks.Callback):
    """Records a Keras 3 model's training into `run_dir` (docs/FORMAT.md).

    `model`: the model `fit` trains (compiled before the first `fit`).
    `every`: record the per-row statistics every N steps (the steps table
    gets every step; N > 1 still computes the rows in the graph every step,
    only fewer reach the disk). `full_every`: every N-th step (from step 0;
    0: never) every row also carries the full tier's statistics (min, max,
    mean, rms, the zero, below-normal, below-subnormal and near-overflow
    shares: `xp_stats`), reduced by a second train function traced for
    those steps, so the other steps run what they ran without it; the
    steps table's `tier` says `full` there. `full_after_event`: the full
    tier also for a burst of N steps after the first event of each kind (a
    skipped step, NaN/Inf in the forward, in the gradients of a step not
    skipped, a non-finite loss; 0: never), as `RecordSchedule`'s option of
    that name. `near_overflow`: the magnitude the full tier's
    `near_overflow_share` counts from (65504, float16's largest; the
    PyTorch recorder's option, recorded in the manifest's `recorder` as
    there). `steps_per_shard`: as the PyTorch
    recorder's; `bundles`: when to save a replay bundle (a
    `BundleTriggers`, of which the recorder counts on its own copy; None:
    never). Use as a callback of `model.fit`;
    `close()` (idempotent) or a `with` block ends the run."""

    def __init__(self, run_dir, model, *, every: int = 1, full_every: int = FULL_EVERY,
                 full_after_event: int = FULL_AFTER_EVENT, near_overflow: float = schema.FP16_MAX,
                 steps_per_shard: int = 1000, run_id: str | None = None,
                 bundles: BundleTriggers | None = BundleTriggers()):
        super().__init__()
        if option_int("every", every) < 1:
            raise KerasRecorderError(f"every={every!r}: record every N >= 1 steps")
        if option_int("full_every", full_every) < 0:
            raise KerasRecorderError(f"full_every={full_every!r}: the full tier every N >= 1 steps, or 0 for never")
        if option_int("full_after_event", full_after_event) < 0:
            raise KerasRecorderError(f"full_after_event={full_after_event!r}: a burst of N >= 1 steps, or 0 for none")
        self.near_overflow = option_float("near_overflow", near_overflow)
        if not self.near_overflow > 0:
            raise KerasRecorderError(f"near_overflow={near_overflow!r}: a magnitude above 0")
        self.run_dir = run_dir
        self.every = int(every)
        self.full_every = int(full_every)
        # Which steps are full (the rows are written every `every` steps, and on a bad one).
        self.schedule = RecordSchedule(cheap_every=self.every, full_every=self.full_every,
                                       full_after_event=int(full_after_event))
        self.backend = keras.backend.backend()
        if self.backend not in ("tensorflow", "jax"):
            raise KerasRecorderError(f"Keras backend {self.backend!r} is not recorded; "
                                     f"use KERAS_BACKEND=tensorflow or jax (or AmpRecorder for torch)")
        self._model = model
        self._steps_per_shard = steps_per_shard
        self._run_id = run_id
        self.run: HostRun | None = None
        self.step_index = 0
        self._trace: _Trace | None = None
        self._full_now = False  # the train function being called is the full tier's
        self._train_steps = {}  # full tier or not -> the train function made for it
        self._restore: list = []
        self._layer_taps: LayerTaps | None = None
        self._received: dict = {}
        self._pending = None  # JAX: the last step's statistics, device arrays
        self._closed = False
        # A copy: `fired`/`saved` count one run, and the default argument is
        # one object shared by every recorder built without `bundles=`.
        self.bundles = bundles.fresh() if bundles is not None and bundles.enabled else None
        self._batch = None  # the batch the last train function call pulled (a reference)
        self._loss_scaling: LossScalingLog | None = None  # with a LossScaleOptimizer

    # ---------------------------------------------------------- lifecycle
    def on_train_begin(self, logs=None):
        model = self._model
        spe = int(getattr(model, "steps_per_execution", 1) or 1)
        if spe > 1:
            raise KerasRecorderError(
                f"steps_per_execution={spe}: Keras runs {spe} steps per call and callbacks see every "
                f"{spe}th batch; compile with steps_per_execution=1 to record every step")
        opt = model.optimizer
        inner = getattr(opt, "inner_optimizer", opt)
        ga = getattr(opt, "gradient_accumulation_steps", None) or getattr(inner, "gradient_accumulation_steps", None)
        if ga and int(ga) > 1:
            raise KerasRecorderError(
                f"gradient_accumulation_steps={ga}: the loss scale's skip flag would count micro-batches; "
                f"record without gradient accumulation")
        if self.run is None:
            self.run = self._start_run(model)
        if self._layer_taps is None:
            self._install(model)
        self._make_train_functions(model)

    def on_train_batch_end(self, batch, logs=None):
        if self._pending is not None:
            import jax
            payload, self._pending = self._pending, None
            self._received.update(self._host_payload(jax.device_get(payload)))  # one transfer
        received, self._received = self._received, {}
        if not received:
            return
        received["full"] = self._full_now
        self._write(received)

    def on_train_end(self, logs=None):
        if self.run is not None:
            self.run.flush()

    def flush(self):
        if self.run is not None:
            self.run.flush()

    def close(self):
        """Remove every wrapper, write the last shard, mark the run closed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for undo in reversed(self._restore):
            undo()
        self._restore = []
        if self._layer_taps is not None:
            self._layer_taps.remove()
        if self.run is not None:
            self.run.close()
        if self._model is not None and getattr(self._model, "train_function", None) is not None:
            self._model.train_function = None  # made again without the wrappers

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def add_loss(self, loss):
        """In a custom `train_step` that does not call `self.compute_loss`:
        hand the step's unscaled loss to the recorder (inside the step), and
        differentiate the loss it returns (`loss = rec.add_loss(loss)`): on
        JAX the forward's rows leave the gradient's scope through it."""
        trace = self._trace
        if trace is not None:
            self._note_loss(trace, loss)
            if self.backend == "jax":
                loss = self._carry_forward(trace, loss)
        return loss

    # ----------------------------------------------------- the manifest
    def _start_run(self, model) -> HostRun:
        opt = model.optimizer
        policy = model.dtype_policy
        compute, variable = policy.compute_dtype, policy.variable_dtype
        version = keras.__version__
        if self.backend == "tensorflow":
            import tensorflow as tf
            version = f"keras {keras.__version__}, tensorflow {tf.__version__}"
        else:
            import jax
            version = f"keras {keras.__version__}, jax {jax.__version__}"
        root = model.name
        modules = [{"name": layer_name(layer, root), "type": _class_name(type(layer)), "watched": True}
                   for layer in layers_of(model)]
        params = [{"name": keras_name(v.path, root), "shape": list(v.shape), "dtype": v.dtype,
                   "requires_grad": bool(v.trainable)} for v in model.weights]
        return HostRun(
            self.run_dir, framework=framework_entry("keras", version, self.backend),
            model_class=_class_name(type(model)), modules=modules, params=params,
            scaler=describe_loss_scale(opt), optimizer=describe_optimizer(opt),
            autocast={"enabled": compute != variable, "device_type": "cpu", "dtype": compute,
                      "cache_enabled": None, "policy": policy.name},
            recorder_options={"recorder": "keras", "every": self.every, **self.schedule.config(),
                              "near_overflow": self.near_overflow, "steps_per_shard": self._steps_per_shard,
                              "bundles": self.bundles.options() if self.bundles is not None else None},
            dtype_policies=dtype_policies(model), steps_per_shard=self._steps_per_shard, run_id=self._run_id)

    # ---------------------------------------------------------- wrappers
    def _install(self, model):
        self._layer_taps = LayerTaps(model, lambda: self._trace)
        self._original_train_step = model.train_step
        self._wrap_method(model, "train_step", self._train_step_wrapper)
        self._wrap_method(model, "compute_loss", self._compute_loss_wrapper)
        opt = model.optimizer
        self._wrap_method(opt, "apply", self._apply_wrapper)
        if self.backend == "jax":
            self._wrap_method(opt, "stateless_apply", self._stateless_apply_wrapper)
        if _is_loss_scale(opt):
            self._loss_scaling = LossScalingLog(custom_train_step=_custom_train_step(model))
            self._wrap_method(opt, "scale_loss", self._scale_loss_wrapper)
            inner = opt.inner_optimizer
            self._wrap_method(inner, "apply", self._inner_apply_wrapper)
            self._wrap_method(inner, "stateless_apply", self._inner_stateless_apply_wrapper)

    def _wrap_method(self, obj, attr, make):
        had_own = attr in obj.__dict__
        original = getattr(obj, attr)
        _set(obj, attr, make(original))
        self._restore.append(lambda: _restore(obj, attr, had_own, original))

    def _make_train_functions(self, model):
        """A train function per tier. Each is made from its own wrapper
        object of `train_step`: jax.jit caches its traces by the function
        it is given, so one object would hand the full tier's steps the
        cheap trace."""
        original = self._original_train_step
        sched = self.schedule
        for full in ((False, True) if sched.full_every or sched.full_after_event else (False,)):
            _set(model, "train_step", self._train_step_wrapper(original))
            model.make_train_function(force=True)
            self._train_steps[full] = model.train_function
        _set(model, "train_step", self._train_step_wrapper(original))
        self._wrap_train_function(model)

    def is_full_step(self, step: int) -> bool:
        """Whether `step` carries the full tier (`full_every`, a burst of
        `full_after_event`: `self.schedule`)."""
        return self.schedule.tier(step) == FULL

    def _wrap_train_function(self, model):
        hold = self.bundles is not None

        def train_function(*args, **kwargs):
            # Read while the chosen function traces (a first call, a new
            # batch shape): the trace's tier.
            self._full_now = self.is_full_step(self.step_index)
            inner = self._train_steps[self._full_now]
            if hold:
                # Pull the batch here (both backends' train functions take a
                # plain iterator too) and keep a reference for a bundle.
                *state, iterator = args
                self._batch = next(iterator)
                args = (*state, iter([self._batch]))
            out = inner(*args, **kwargs)
            if self.backend == "jax":
                if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], dict) and LOGS_KEY in out[0]:
                    logs = dict(out[0])
                    # Device arrays, read by on_train_batch_end: the step
                    # is not waited for here.
                    self._pending = logs.pop(LOGS_KEY)
                    out = (logs, out[1])
                return out
            if isinstance(out, dict) and LOGS_KEY in out:
                out = dict(out)
                payload = out.pop(LOGS_KEY)
                self._received.update(self._host_payload(payload))
            return out

        model.train_function = train_function

    def _train_step_wrapper(self, original):
        def train_step(*args, **kwargs):
            outer, self._trace = self._trace, _Trace(full=self._full_now, near_overflow=self.near_overflow)
            trace = self._trace
            try:
                out = original(*args, **kwargs)
            finally:
                self._trace = outer
            if self._loss_scaling is not None:
                self._loss_scaling.traced(trace.scale_loss_calls, trace.applied_by)
            if self.backend == "tensorflow" and isinstance(out, dict):
                out = dict(out)
                out[LOGS_KEY] = self._graph_payload(trace)
            elif self.backend == "jax" and isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], dict):
                out = ({**out[0], LOGS_KEY: self._graph_payload(trace)}, out[1])
            return out
        return train_step

    def _note_loss(self, trace, loss):
        trace.loss_tensor = loss
        trace.scalars["loss"] = ops.cast(loss, "float32")
        trace.loss_dtype = keras.backend.standardize_dtype(loss.dtype)
        trace.add_forward(schema.LOSS_NAME, "loss", trace.loss_dtype, trace.row_stats([loss]))

    def _compute_loss_wrapper(self, original):
        def compute_loss(*args, **kwargs):
            trace = self._trace
            if trace is not None and not _in_symbolic_scope():
                # The gradient entering the model (the root's grad_output, name
                # ""): NaN/Inf there was made by the loss's own backward.
                # Keras passes (x, y, y_pred, sample_weight) by position.
                call = trace.calls.get(("", "grad_output"), 0)
                if "y_pred" in kwargs:
                    trace.calls[("", "grad_output")] = call + 1
                    kwargs["y_pred"] = gradient_tap(kwargs["y_pred"], trace, "", "grad_output", call)
                elif len(args) > 2:
                    trace.calls[("", "grad_output")] = call + 1
                    args = (*args[:2], gradient_tap(args[2], trace, "", "grad_output", call), *args[3:])
            loss = original(*args, **kwargs)
            if trace is None:
                return loss
            x = kwargs.get("x", args[0] if args else None)
            inputs = _floating(x)
            if inputs:
                stats = trace.row_stats(inputs)
                call = trace.calls.get((schema.INPUT_NAME, "input"), 0)
                trace.calls[(schema.INPUT_NAME, "input")] = call + 1
                trace.forward.insert(0, (schema.INPUT_NAME, "input", call, _dtype(inputs)))
                trace.forward_stats.insert(0, stats)
            self._note_loss(trace, loss)
            if self.backend == "jax":
                loss = self._carry_forward(trace, loss)
            return loss
        return compute_loss

    def _grad_rows(self, trace, grads, variables, scale):
        root = self._model.name
        scale = ops.cast(scale, "float32")
        sqsum = ops.zeros((), "float32")
        for g, v in zip(grads, variables):
            if g is None:
                continue
            trace.grads.append((keras_name(v.path, root), keras.backend.standardize_dtype(g.dtype)))
            trace.grad_stats.append(trace.row_stats([g], scale=scale))
            g32 = ops.cast(g, "float32") / scale
            sqsum = sqsum + ops.sum(g32 * g32)
        return sqsum

    @staticmethod
    def _ratio(trace, grads, variables):
        trace.own_backward = True  # its backward passes the layers' gradient taps again
        try:
            return grad_loss_ratio(trace.loss_tensor, grads, variables)
        finally:
            trace.own_backward = False

    def _variables(self, trainable_variables):
        return list(trainable_variables) if trainable_variables is not None else list(
            self._model.trainable_variables)

    def _apply_wrapper(self, original):
        opt = self._model.optimizer

        def apply(grads, trainable_variables=None, *args, **kwargs):
            trace = self._trace
            if trace is None or self.backend == "jax":
                return original(grads, trainable_variables, *args, **kwargs)
            grads = list(grads)
            scaled = _is_loss_scale(opt)
            before = _scale_value(opt) if scaled else ops.ones((), "float32")
            finite = opt.check_finite(grads) if scaled else ops.convert_to_tensor(True)
            variables = self._variables(trainable_variables)
            sqsum = self._grad_rows(trace, grads, variables, before)
            if scaled:
                trace.applied_by = LOSS_SCALE_OPTIMIZER
                trace.scalars["grad_loss_ratio"] = self._ratio(trace, grads, variables)
            trace.in_loss_scale_apply = scaled
            try:
                out = original(grads, trainable_variables, *args, **kwargs)
            finally:
                trace.in_loss_scale_apply = False
            trace.scalars.update({
                "loss_scale_before": before,
                "loss_scale": _scale_value(opt) if scaled else ops.ones((), "float32"),
                "growth_tracker": ops.cast(opt.step_counter, "float32") if scaled else ops.zeros((), "float32"),
                "skipped": 1.0 - ops.cast(finite, "float32"),
                "grad_sqsum": sqsum, "lr": ops.cast(opt.learning_rate, "float32")})
            return out
        return apply

    def _stateless_apply_wrapper(self, original):
        opt = self._model.optimizer

        def stateless_apply(optimizer_variables, grads, trainable_variables):
            trace = self._trace
            if trace is None:
                return original(optimizer_variables, grads, trainable_variables)
            grads = list(grads)
            scaled = _is_loss_scale(opt)
            ids = [id(v) for v in opt.variables]
            if scaled:
                i_scale, i_count = ids.index(id(opt.dynamic_scale)), ids.index(id(opt.step_counter))
                before = ops.cast(optimizer_variables[i_scale], "float32")
                finite = opt.check_finite(grads)
            else:
                before, finite = ops.ones((), "float32"), ops.convert_to_tensor(True)
            sqsum = self._grad_rows(trace, grads, self._model.trainable_variables, before)
            if scaled:
                trace.applied_by = LOSS_SCALE_OPTIMIZER
            trace.in_loss_scale_apply = scaled
            try:
                new_trainable, new_opt_vars = original(optimizer_variables, grads, trainable_variables)
            finally:
                trace.in_loss_scale_apply = False
            after = ops.cast(new_opt_vars[i_scale], "float32") if scaled else ops.ones((), "float32")
            tracker = ops.cast(new_opt_vars[i_count], "float32") if scaled else ops.zeros((), "float32")
            lr = _jax_lr(opt, optimizer_variables, ids)
            scalars = {"loss_scale_before": before, "loss_scale": after, "growth_tracker": tracker,
                       "skipped": 1.0 - ops.cast(finite, "float32"), "grad_sqsum": sqsum, "lr": lr}
            trace.scalars.update(scalars)
            return new_trainable, new_opt_vars
        return stateless_apply

    def _scale_loss_wrapper(self, original):
        def scale_loss(loss):
            trace = self._trace
            if trace is not None:
                trace.scale_loss_calls += 1
            return original(loss)
        return scale_loss

    def _inner_apply_wrapper(self, original):
        """The inner optimizer's `apply` called by the step itself, not by
        the LossScaleOptimizer: gradients applied without unscaling. The
        step's rows and scalars are taken here then (the scale unchanged,
        nothing skipped: no one checked)."""
        lso = self._model.optimizer

        def apply(grads, trainable_variables=None, *args, **kwargs):
            trace = self._trace
            if trace is None or trace.in_loss_scale_apply or self.backend == "jax":
                return original(grads, trainable_variables, *args, **kwargs)
            grads = list(grads)
            trace.applied_by = INNER_OPTIMIZER
            variables = self._variables(trainable_variables)
            scale = _scale_value(lso)
            # The rows are unscaled gradients: divided by the scale when the
            # step scaled its loss (the optimizer applied them as they are).
            sqsum = self._grad_rows(trace, grads, variables,
                                    scale if trace.scale_loss_calls else ops.ones((), "float32"))
            ratio = self._ratio(trace, grads, variables)
            out = original(grads, trainable_variables, *args, **kwargs)
            tracker = ops.cast(lso.step_counter, "float32") if lso.built else ops.zeros((), "float32")
            trace.scalars.update({
                "loss_scale_before": scale, "loss_scale": scale, "growth_tracker": tracker,
                "skipped": ops.zeros((), "float32"), "grad_sqsum": sqsum,
                "lr": ops.cast(lso.learning_rate, "float32"), "grad_loss_ratio": ratio})
            return out
        return apply

    def _inner_stateless_apply_wrapper(self, original):
        def stateless_apply(optimizer_variables, grads, trainable_variables):
            trace = self._trace
            if trace is not None and not trace.in_loss_scale_apply:
                trace.applied_by = INNER_OPTIMIZER
            return original(optimizer_variables, grads, trainable_variables)
        return stateless_apply

    # ------------------------------------------------------ transports
    def _graph_payload(self, trace: _Trace) -> dict:
        # Names are static: kept on the host, keyed by the trace (TF traces
        # the step once, again for a last batch of another shape: the same
        # names).
        if self.backend == "tensorflow":
            forward_meta, forward = list(trace.forward), _stack(trace.forward_stats, trace.full)
        else:
            # The forward's values, traced inside value_and_grad, left it as
            # the residuals of the loss's identity (`_carry_forward`); none
            # when that loss was not differentiated.
            # Not differentiated (a custom step that ignored `add_loss`'s
            # return): no forward rows, and the loss is unknown, not NaN.
            trace.scalars.pop("loss", None)
            forward_meta, forward = [], _stack([], trace.full)
            if trace.carried is not None:
                forward_meta, values = trace.carried
                forward, trace.scalars["loss"] = values["forward"], values["loss"]
        self._row_meta = (forward_meta, list(trace.grads), list(trace.backward), trace.loss_dtype,
                          "loss" in trace.scalars)
        scalars = [ops.cast(trace.scalars.get(k, math.nan), "float32") for k in SCALARS]
        return {"forward": forward, "grads": _stack(trace.grad_stats, trace.full),
                "backward": _stack(trace.backward_stats, trace.full), "scalars": ops.stack(scalars)}

    def _host_payload(self, payload) -> dict:
        forward_meta, grad_meta, backward_meta, loss_dtype, loss_known = self._row_meta
        scalars = dict(zip(SCALARS, np.asarray(payload["scalars"], dtype=np.float64).tolist()))
        if not loss_known:
            del scalars["loss"]
        return {"forward": (forward_meta, np.asarray(payload["forward"])),
                "update": (grad_meta, np.asarray(payload["grads"])),
                "backward": (backward_meta, np.asarray(payload["backward"])),
                "scalars": scalars, "loss_dtype": loss_dtype}

    @staticmethod
    def _carry_forward(trace: _Trace, loss):
        """JAX: `loss` through an identity whose residuals are the forward's
        statistics and the loss itself, so that they leave
        `jax.value_and_grad` (whose tracers cannot leave it but as its
        outputs): its backward rule, run at the train step's own level,
        hands them to the trace, and the train step returns them in its
        logs. No host callback: each cost ~1 ms a step on the CPU."""
        meta = list(trace.forward)
        values = {"forward": _stack(trace.forward_stats, trace.full), "loss": trace.scalars["loss"]}

        def on_values(carried):
            trace.carried = (meta, carried)

        return carry_out(loss, values, on_values)

    # ----------------------------------------------------------- host side
    def _write(self, received: dict) -> None:
        step = self.step_index
        self.step_index += 1
        s = received.get("scalars", {})
        scaled = _is_loss_scale(self._model.optimizer)
        skipped = bool(s.get("skipped", 0.0) >= 0.5)
        rows = []
        grad_meta, grads = received.get("update", ([], np.empty((0, STAT_WIDTH))))
        backward_meta, backward = received.get("backward", ([], np.empty((0, STAT_WIDTH))))
        # NaN/Inf in any gradient: a step with rows, as a skip or a non-finite loss.
        backward_bad = bool(np.any(grads[:, 1:3]) or np.any(backward[:, 1:3]))
        full = bool(received.get("full"))
        if step % self.every == 0 or full or skipped or backward_bad or not _finite(s.get("loss")):
            forward_meta, forward = received.get("forward", ([], np.empty((0, STAT_WIDTH))))
            for order, ((name, kind, call, dtype), v) in enumerate(zip(forward_meta, forward)):
                rows.append(stats_row(name, kind, "forward", order, call, dtype, v,
                                 input_nonfinite=kind == "activation"))
            rows.extend(backward_rows([(*meta, v) for meta, v in zip(backward_meta, backward)],
                                      [(*meta, v) for meta, v in zip(grad_meta, grads)]))
        sq = s.get("grad_sqsum")
        record = StepRecord(
            step=step, loss=s.get("loss"),
            loss_scale_before=s.get("loss_scale_before") if scaled else None,
            loss_scale=s.get("loss_scale") if scaled else None,
            growth_tracker=int(s["growth_tracker"]) if scaled and _finite(s.get("growth_tracker")) else None,
            skipped=skipped, lr=[s["lr"]] if _finite(s.get("lr")) else None,
            grad_norm=math.sqrt(sq) if sq is not None and sq >= 0 else sq,
            loss_dtype=received.get("loss_dtype"), rows=rows, full=full and bool(rows), wall_time=time.time())
        self.run.write_step(record)
        events = step_events(record)
        if events:  # note_event takes no kinds as one unnamed event
            self.schedule.note_event(step, events)
        if self._loss_scaling is not None:
            self._loss_scaling.observe(step, s.get("grad_loss_ratio"), s.get("loss_scale_before"))
            self.run.set_loss_scaling(self._loss_scaling.entry())
        if self.bundles is not None:
            self._maybe_save_bundle(step, s, skipped, rows, received.get("loss_dtype"), backward_bad)

    def _maybe_save_bundle(self, step, s, skipped, rows, loss_dtype, backward_bad) -> None:
        bad = [{"name": r.name, "call": r.call} for r in rows
               if r.phase == "forward" and r.kind == "activation" and (r.nan_count or r.inf_count)]
        reasons = self.bundles.reasons(step, s.get("loss"), bool(bad), backward_bad, skipped=skipped,
                                       loss_scale_before=s.get("loss_scale_before"))
        if not reasons or self._batch is None:
            return
        model = self.model  # the property syncs the JAX backend's state into the variables
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(self._batch)
        arrays: dict = {}
        root = model.name
        for v in model.weights:
            arrays[f"param/{keras_name(v.path, root)}"] = ops.convert_to_numpy(v)
        inputs = encode_tree(_numpy_tree(x), "input/x", arrays)
        scaled = _is_loss_scale(model.optimizer)
        policy = model.dtype_policy
        meta = {
            "framework": self.run.manifest["framework"], "run_id": self.run.manifest["run_id"],
            "world_size": 1, "reason": reasons[0], "reasons": reasons,
            "loss": s.get("loss"), "loss_dtype": loss_dtype,
            "loss_scale": s.get("loss_scale_before") if scaled else None, "skipped": skipped,
            "model_class": self.run.manifest["model_class"],
            "policy": {"name": policy.name, "compute_dtype": policy.compute_dtype,
                       "variable_dtype": policy.variable_dtype},
            "params": {"names": [keras_name(v.path, root) for v in model.weights],
                       # Read after the step: unchanged when the loss scale refused the update.
                       "exact": bool(skipped), "source": "after_skipped_step" if skipped else "after_update"},
            "inputs": {"args": [inputs], "kwargs": []},
            "targets": encode_tree(_numpy_tree(y), "target/y", arrays),
            "sample_weight": encode_tree(_numpy_tree(sample_weight), "sample_weight/w", arrays),
            "recorded_nonfinite": bad,
            "loss_config": loss_config(model),
        }
        self.run.add_bundle(write_bundle(self.run_dir, rank=0, step=step, meta=meta, arrays=arrays))


def _numpy_tree(tree):
    return keras.tree.map_structure(
        lambda t: ops.convert_to_numpy(t) if t is not None and hasattr(t, "shape") else t, tree)


def loss_config(model) -> dict | None:
    """The compiled loss as a bundle can name it without code: a Keras
    built-in loss, by its name (`compile(loss="mse")`) or class and JSON
    config (`keras.losses.MeanSquaredError(...)`); None for anything else
    (a function or class of the user's, a list or dict of losses): the
    replay's factory then compiles the model itself."""
    loss = getattr(model, "loss", None)
    if isinstance(loss, str):
        return {"name": loss}
    if isinstance(loss, keras.losses.Loss) and type(loss).__module__.startswith("keras."):
        config = loss.get_config()
        config.pop("dtype", None)  # a policy object; the replay's policy decides
        try:
            json.dumps(config)
        except (TypeError, ValueError):
            return None
        return {"class_name": type(loss).__name__, "config": config}
    return None


def _policy_entry(policy) -> dict:
    return {"policy": policy.name, "compute_dtype": policy.compute_dtype, "variable_dtype": policy.variable_dtype}


def dtype_policies(model) -> dict:
    """The manifest's `dtype_policies`: the model's policy and every layer's
    (in `layers_of` order), read when the run starts: evidence for layers
    built under another policy than the model's."""
    root = model.name
    return {"model": _policy_entry(model.dtype_policy),
            "layers": [{"name": layer_name(layer, root), **_policy_entry(layer.dtype_policy)}
                       for layer in layers_of(model) if getattr(layer, "dtype_policy", None) is not None]}


def _finite(v) -> bool:
    return v is not None and math.isfinite(v)


def _class_name(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _custom_train_step(model) -> bool:
    """The model's class has its own `train_step` (not one of Keras')."""
    step = getattr(type(model), "train_step", None)
    return not getattr(step, "__module__", "keras.").startswith("keras.")


def _is_loss_scale(opt) -> bool:
    return isinstance(opt, keras.optimizers.LossScaleOptimizer)


def _scale_value(opt):
    if not opt.built:  # built by its first apply: the scale it starts with
        return ops.cast(opt.initial_scale, "float32")
    return ops.cast(ops.convert_to_tensor(opt.dynamic_scale), "float32")


def _jax_lr(opt, optimizer_variables, ids):
    inner = getattr(opt, "inner_optimizer", opt)
    lr_var = getattr(inner, "_learning_rate", None)
    if lr_var is not None and id(lr_var) in ids:
        return ops.cast(optimizer_variables[ids.index(id(lr_var))], "float32")
    try:
        return ops.cast(ops.convert_to_tensor(opt.learning_rate), "float32")
    except Exception:  # noqa: BLE001 - a schedule: not recorded
        return ops.convert_to_tensor(math.nan, "float32")


def describe_loss_scale(opt) -> dict | None:
    """The manifest's `scaler` for a `LossScaleOptimizer` (None otherwise)."""
    if not _is_loss_scale(opt):
        return None
    return {"class": _class_name(type(opt)), "enabled": True,
            "init_scale": float(opt.initial_scale), "growth_factor": 2.0, "backoff_factor": 0.5,
            "growth_interval": int(opt.dynamic_growth_steps)}


def describe_optimizer(opt) -> dict | None:
    if opt is None:
        return None
    inner = getattr(opt, "inner_optimizer", opt)
    try:
        lr = float(ops.convert_to_numpy(inner.learning_rate))
    except Exception:  # noqa: BLE001 - a schedule
        lr = None
    return {"class": _class_name(type(inner)), "defaults": {"lr": lr}}
