"""The Keras recorder's test runs, made in a process of their own (Keras
picks its backend once, at import: `KERAS_BACKEND=tensorflow|jax python
tests/keras_runs.py OUT_DIR`). Three runs under OUT_DIR, each a tiny
float16 (`mixed_float16`) model trained with `model.fit` and recorded by
`KerasRecorder`:

- `overflow`: an `exp` layer (`blowup`) overflows float16 from step 3 on,
  when the inputs grow 100x;
- `collapse`: 10 clean steps, then the inputs grow 100x and a layer
  whose gradient is then 1e20 times what it receives overflows float16 on
  every step: the loss scale halves on every step from step 10 (on
  TensorFlow compiled with `jit_compile=False`; the others, and JAX, with
  Keras' default, XLA);
- `healthy`: the same model without either, a modest initial scale;
- `underflow`: one step (the full tier's: step 0) under a fixed loss scale
  of 2**-12, `d1` starting at zero and `d2`'s bias at zero, so the model
  predicts exactly 0: the gradient reaching `d2`'s output is exactly
  `-y * 2**-14` (mse over 8 values: scale * 2 / 8, powers of two), rounded
  to float16 once, and the one reaching `d1`'s output is each of those
  times each of `d2`'s 8 weights (a product of two float16 values, rounded
  once): much of both below float16's smallest normal.

Beside `underflow`, `underflow_truth.json`: per layer (`d2`, `d1`), the
number of those float16 values that are zero or below 2**-14 and their
count, computed with numpy from the batch's `y` and `d2`'s initial weights
(not the recorder), whatever the kernels or a flush to zero do.

Beside `collapse`, `collapse_truth.json`: `step`, the first step the
LossScaleOptimizer skipped with a finite loss (its own finiteness check,
the steps table's flag), and `layer`, the layer whose own backward turns
that batch's finite scaled-loss gradient non-finite, walked layer by layer
with the backend's own differentiation (not the recorder) on the weights
the run ended with: the step's own, since a skipped step keeps them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import keras
import numpy as np
import pandas as pd
from keras import ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from recorders.keras_recorder import KerasRecorder  # noqa: E402

BATCH = 8


class Blowup(keras.layers.Layer):
    def call(self, x):
        return ops.exp(x)


class HugeGrad(keras.layers.Layer):
    """The identity forward; once its input exceeds 5 in magnitude, its
    gradient is 1e20 times the incoming one: Inf in float16 at any loss
    scale the run reaches."""
    def call(self, x):
        x32 = ops.cast(x, "float32")
        factor = ops.where(ops.max(ops.abs(x32)) > 5.0, 1e20, 0.0)
        big = x32 * ops.stop_gradient(factor)
        return ops.cast(x32 + big - ops.stop_gradient(big), x.dtype)


def model(middle) -> keras.Model:
    inp = keras.Input((4,))
    h = keras.layers.Dense(8, name="d1")(inp)
    h = middle(h)
    out = keras.layers.Dense(1, name="d2")(h)
    return keras.Model(inp, out, name="net")


def backward_origin(net, x, y, scale):
    """The first layer, walking the backward of one batch from the loss,
    whose input gradient is non-finite while its output's is finite (None:
    none). Each layer's gradient is its own vector-Jacobian product
    (`tf.GradientTape` / `jax.vjp`); the loss's is mse's, times `scale`."""
    layers = [layer for layer in net.layers if not isinstance(layer, keras.layers.InputLayer)]
    hs = [ops.convert_to_tensor(x)]
    for layer in layers:
        hs.append(layer(hs[-1]))
    pred = ops.cast(hs[-1], "float32")
    g = ops.cast(scale * 2.0 * (pred - y) / float(np.prod(pred.shape)), hs[-1].dtype)
    for layer, h in zip(reversed(layers), reversed(hs[:-1])):
        g_in = _vjp(layer, h, g)
        if np.all(np.isfinite(ops.convert_to_numpy(g))) and not np.all(np.isfinite(ops.convert_to_numpy(g_in))):
            return layer.name
        g = g_in
    return None


def _vjp(layer, h, g):
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf
        with tf.GradientTape() as tape:
            tape.watch(h)
            y = layer(h)
        return tape.gradient(y, h, output_gradients=g)
    import jax
    _, vjp = jax.vjp(layer, h)
    return vjp(g)[0]


def train(run_dir, net, x, y, initial_scale=2.0 ** 15, jit_compile="auto", **options):
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3), initial_scale=initial_scale)
    net.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    with KerasRecorder(run_dir, net, **options) as rec:
        net.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[rec])


def underflow(out: str, x, y) -> None:
    inp = keras.Input((4,))
    h = keras.layers.Dense(8, name="d1", kernel_initializer="zeros")(inp)
    d2 = keras.layers.Dense(1, name="d2", bias_initializer="zeros")
    net = keras.Model(inp, d2(h), name="net")
    w2 = ops.convert_to_numpy(d2.kernel).astype(np.float16)[:, 0]
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3), initial_scale=2.0 ** -12,
                                              dynamic_growth_steps=10 ** 6)
    net.compile(optimizer=opt, loss="mse")
    with KerasRecorder(f"{out}/underflow", net, full_every=100) as rec:
        net.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[rec])
    g2 = (-y[:BATCH, 0].astype(np.float64) * 2.0 ** -14).astype(np.float16)  # rounded once
    g1 = (g2[:, None].astype(np.float64) * w2[None, :].astype(np.float64)).astype(np.float16)

    def tiny(g):
        return {"below_normal_or_zero": int(np.sum((g == 0) | (np.abs(g) < np.float16(2.0 ** -14)))),
                "numel": int(g.size)}
    Path(out, "underflow_truth.json").write_text(json.dumps({"d2": tiny(g2), "d1": tiny(g1)}))


def main(out: str) -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6 * BATCH, 4)).astype("float32") * 0.1
    y = rng.standard_normal((6 * BATCH, 1)).astype("float32") * 0.1
    big = x.copy()
    big[3 * BATCH:] *= 1000.0  # steps 3..5: exp of values in the hundreds
    # The period alone (no burst after events): its steps' tiers say `full_every`'s.
    train(f"{out}/overflow", model(Blowup(name="blowup")), big, y, full_after_event=0)
    small = np.tile(x, (5, 1))[:30 * BATCH]
    y30 = np.tile(y, (5, 1))[:30 * BATCH]
    grown = small.copy()
    grown[10 * BATCH:] *= 100.0
    collapse = model(HugeGrad(name="hugegrad"))
    # TensorFlow without XLA (a graph still); JAX without jit runs eagerly, some
    # 1 s a step on this model: checked by hand, not here.
    jit = False if keras.backend.backend() == "tensorflow" else "auto"
    train(f"{out}/collapse", collapse, grown, y30, jit_compile=jit)
    steps = pd.read_parquet(f"{out}/collapse/rank=0/steps")
    step = int(steps[steps["skipped"] & np.isfinite(steps["loss"])]["step"].min())
    batch = slice(step * BATCH, (step + 1) * BATCH)
    layer = backward_origin(collapse, grown[batch], y30[batch], steps["loss_scale_before"].iloc[step])
    Path(out, "collapse_truth.json").write_text(json.dumps({"step": step, "layer": layer}))
    train(f"{out}/healthy", model(keras.layers.ReLU(name="relu")), small[:20 * BATCH], y30[:20 * BATCH],
          initial_scale=2.0 ** 8)
    underflow(out, x, rng.standard_normal((6 * BATCH, 1)).astype("float32"))


if __name__ == "__main__":
    main(sys.argv[1])
