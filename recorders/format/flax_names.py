"""How the Flax recorder names what it records (needs JAX and Flax): a
module call's run name (`module_name`), a pytree path entry's name
(`key_name`) and the parameters by name (`named_params`), which the Flax
replay uses alike to load a bundle's variables and match its calls with the
recorded rows. Defined here, the one place the recorder
(`recorders/flax_recorder.py`) and the replay import them."""
from __future__ import annotations

import jax
from flax import nnx

__all__ = ["module_name", "named_params", "key_name"]


def key_name(k):
    """A pytree path entry's name (a dict key, an attribute, an index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return str(k)


def module_name(module: tuple, method: str) -> str:
    name = ".".join(module)
    return name if method == "__call__" else (f"{name}.{method}" if name else method)


def named_params(model):
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        parts = [str(key_name(k)) for k in path if key_name(k) != "value"]
        yield ".".join(parts), leaf
