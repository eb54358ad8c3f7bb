"""Model factories of the Keras and Flax replay tests
(tests/test_framework_replay.py), given to `replay --model FILE:factory`
as a user gives theirs. `d1` sums its four inputs (kernel of ones), so
inputs of 5.0 make `exp` see 20: e**20 overflows float16, not float32."""
from __future__ import annotations


def keras_model():
    import keras
    from keras import ops

    class Blowup(keras.layers.Layer):
        def call(self, x):
            return ops.exp(x)

    inp = keras.Input((4,))
    h = keras.layers.Dense(8, name="d1", kernel_initializer="ones")(inp)
    h = Blowup(name="blowup")(h)
    out = keras.layers.Dense(1, name="d2")(h)
    return keras.Model(inp, out, name="net")


def keras_sqrt_model():
    """`root` takes the square root of `d1`'s output: its forward is
    finite in float16 for inputs near 1e-6, its backward (1/(2 sqrt x), some
    500 there) times the loss scale's gradient overflows float16's 65504."""
    import keras
    from keras import ops

    class Root(keras.layers.Layer):
        def call(self, x):
            return ops.sqrt(x)

    inp = keras.Input((4,))
    h = keras.layers.Dense(8, name="d1", kernel_initializer="ones")(inp)
    h = Root(name="root")(h)
    out = keras.layers.Dense(1, name="d2", kernel_initializer="ones")(h)
    return keras.Model(inp, out, name="net")


def flax_model():
    import jax.numpy as jnp
    from flax import nnx

    class Blowup(nnx.Module):
        def __call__(self, x):
            return jnp.exp(x)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.d1 = nnx.Linear(4, 8, dtype=jnp.float16, kernel_init=nnx.initializers.ones, rngs=rngs)
            self.mid = Blowup()
            self.d2 = nnx.Linear(8, 1, dtype=jnp.float16, rngs=rngs)

        def __call__(self, x):
            return self.d2(self.mid(self.d1(x)))

    return Net(nnx.Rngs(0))


def flax_loss(model, optimizer, scale, x, y):
    """The step's loss (tests/test_flax_recorder.py's `train_step`), called
    with the step's arguments for a backward replay (`--loss-fn`)."""
    import jax.numpy as jnp
    return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)


def flax_sqrt_model():
    """`root` takes the square root of `d1`'s float16 output's magnitude: finite for
    inputs near 1e-6, its gradient (some 500 there) times the scaled loss's
    overflows float16 (as `keras_sqrt_model`)."""
    import jax.numpy as jnp
    from flax import nnx

    class Root(nnx.Module):
        def __call__(self, x):
            return jnp.sqrt(jnp.abs(x))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.d1 = nnx.Linear(4, 8, dtype=jnp.float16, kernel_init=nnx.initializers.ones, rngs=rngs)
            self.root = Root()
            self.d2 = nnx.Linear(8, 1, dtype=jnp.float16, kernel_init=nnx.initializers.ones, rngs=rngs)

        def __call__(self, x):
            return self.d2(self.root(self.d1(x)))

    return Net(nnx.Rngs(0))
