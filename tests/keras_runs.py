"""The Keras recorder's test runs, made in a process of their own (Keras
picks its backend once, at import: `KERAS_BACKEND=tensorflow|jax python
tests/keras_runs.py OUT_DIR`). Three runs under OUT_DIR, each a tiny
float16 (`mixed_float16`) model trained with `model.fit` and recorded by
`KerasRecorder`:

- `overflow`: an `exp` layer (`blowup`) overflows float16 from step 3 on,
  when the inputs grow 100x;
- `collapse`: 10 clean steps, then the inputs grow 100x and a layer
  whose gradient is then 1e20 times what it receives overflows float16 on
  every step: the loss scale halves on every step from step 10;
- `healthy`: the same model without either, a modest initial scale.
"""
from __future__ import annotations

import sys

import keras
import numpy as np
from keras import ops

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
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


def train(run_dir, net, x, y, initial_scale=2.0 ** 15):
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3), initial_scale=initial_scale)
    net.compile(optimizer=opt, loss="mse")
    with KerasRecorder(run_dir, net) as rec:
        net.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[rec])


def main(out: str) -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6 * BATCH, 4)).astype("float32") * 0.1
    y = rng.standard_normal((6 * BATCH, 1)).astype("float32") * 0.1
    big = x.copy()
    big[3 * BATCH:] *= 1000.0  # steps 3..5: exp of values in the hundreds
    train(f"{out}/overflow", model(Blowup(name="blowup")), big, y)
    small = np.tile(x, (5, 1))[:30 * BATCH]
    y30 = np.tile(y, (5, 1))[:30 * BATCH]
    grown = small.copy()
    grown[10 * BATCH:] *= 100.0
    train(f"{out}/collapse", model(HugeGrad(name="hugegrad")), grown, y30)
    train(f"{out}/healthy", model(keras.layers.ReLU(name="relu")), small[:20 * BATCH], y30[:20 * BATCH],
          initial_scale=2.0 ** 8)


if __name__ == "__main__":
    main(sys.argv[1])
