"""Runs for tests/test_keras_flax_options.py, made in a process of their own
(Keras picks its backend once, at import: `KERAS_BACKEND=jax python
tests/keras_option_runs.py OUT_DIR`). Tiny float16 (`mixed_float16`)
models trained with `model.fit` and recorded by `KerasRecorder`:

- `burst`: `full_every=0, full_after_event=2, near_overflow=1e4`; steps
  0-2 clean, steps 3-7 fed `BIG` (half its values 5e6, half 2e4, signs
  mixed): `d1`'s float16 output overflows from step 3 on, and the loss
  scale skips. The full tier runs on steps 4 and 5 only (the burst after
  step 3's first skip and first NaN/Inf), and the `<input>` row there is
  `BIG` itself: all of it at or above 1e4, half of it above 65504.
- `zeros`, Keras-JAX without jit (`jit_compile=False`, `run_eagerly=True`:
  each op compiled on its first use, some 10 s on the first step, then
  fast): `z`'s kernel and every bias start at zero (Keras' Dense
  default), `full_every=1`: at step 0 the gradient reaching `d1`'s output
  is exactly zero (it passed `z`'s zero kernel), later it is not.
"""
from __future__ import annotations

import sys
from pathlib import Path

import keras
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from recorders.keras_recorder import KerasRecorder  # noqa: E402

BATCH = 8
NEAR_OVERFLOW = 1e4


def big_batch() -> np.ndarray:
    """(8, 4) values of magnitude 5e6 and 2e4, alternating, signs mixed."""
    mags = np.where(np.arange(BATCH * 4) % 2 == 0, 5e6, 2e4).reshape(BATCH, 4)
    signs = np.where(np.arange(BATCH * 4) % 3 == 0, -1.0, 1.0).reshape(BATCH, 4)
    return (mags * signs).astype("float32")


def dense_net(*hidden) -> keras.Model:
    inp = keras.Input((4,))
    h = inp
    for layer in hidden:
        h = layer(h)
    return keras.Model(inp, keras.layers.Dense(1, name="d2")(h), name="net")


def fit(run_dir, net, x, y, *, initial_scale=2.0 ** 8, run_eagerly=False, jit_compile="auto", **options):
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3), initial_scale=initial_scale)
    net.compile(optimizer=opt, loss="mse", run_eagerly=run_eagerly, jit_compile=jit_compile)
    with KerasRecorder(run_dir, net, **options) as rec:
        net.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[rec])


def main(out: str) -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8 * BATCH, 4)) * 0.1).astype("float32")
    y = (rng.standard_normal((8 * BATCH, 1)) * 0.1).astype("float32")
    blown = x.copy()
    blown[3 * BATCH:] = np.tile(big_batch(), (5, 1))
    fit(f"{out}/burst", dense_net(keras.layers.Dense(8, name="d1")), blown, y,
        full_every=0, full_after_event=2, near_overflow=NEAR_OVERFLOW)
    zeros = dense_net(keras.layers.Dense(8, name="d1", activation="relu"),
                      keras.layers.Dense(8, name="z", kernel_initializer="zeros"))
    fit(f"{out}/zeros", zeros, x[:6 * BATCH] * 10.0, y[:6 * BATCH] * 10.0, full_every=1,
        run_eagerly=True, jit_compile=False)


if __name__ == "__main__":
    main(sys.argv[1])
