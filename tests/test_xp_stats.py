"""recorders/xp_stats.py, the Keras and Flax recorders' full tier, run
on numpy (it takes any namespace with numpy's names) against the PyTorch
recorder's own statistics (recorders/stats.py) of the same values: the
same definitions, so `ranges` reads the frameworks' rows alike."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from recorders import xp_stats, stats
from recorders.format import schema


def cast(x, dtype):
    return np.asarray(x).astype(dtype)


def full_row(x16: np.ndarray) -> np.ndarray:
    x = x16.astype(np.float32)
    finite = np.isfinite(x)
    cheap = [np.max(np.where(finite, np.abs(x), 0)), np.sum(np.isnan(x)), np.sum(np.isinf(x)), 0.0, x.size]
    return np.array(cheap + [float(v) for v in xp_stats.full_tail(x, x.size, np, cast)], dtype=np.float64)


def shares(row: np.ndarray) -> np.ndarray:
    """A row with its share counts as shares (`host_run.stats_row`'s)."""
    row = row.copy()
    row[9:13] /= row[13]
    return row


def values(n: int, seed: int = 0) -> np.ndarray:
    """float16 values over its whole range: zeros, subnormals (below
    2**-14 and below 2**-24 before rounding), normals, values near 65504."""
    rng = np.random.default_rng(seed)
    x = np.clip(rng.standard_normal(n) * np.exp2(rng.integers(-30, 16, n)), -65000.0, 65000.0)
    x[::7] = 0.0
    x[1::11] = 65504.0  # float16's largest: near overflow
    return x.astype(np.float16)


@pytest.mark.parametrize("n", [1000, schema.SHARE_SAMPLE_MAX + 12_345])
def test_the_full_tier_is_pytorchs(n):
    x = values(n)
    ours = shares(full_row(x))
    theirs = np.asarray(stats.row_stats(torch.from_numpy(x), full=True), dtype=np.float64)
    # ours: absmax, nan, inf, input_nonfinite, numel, min..share_sample_size; theirs without numel.
    assert ours[4] == n
    assert ours[[0, 1, 2]].tolist() == theirs[[0, 1, 2]].tolist()
    assert ours[[5, 6, 9, 10, 11, 12, 13]].tolist() == theirs[[4, 5, 8, 9, 10, 11, 12]].tolist()
    assert ours[[7, 8]] == pytest.approx(theirs[[6, 7]], rel=1e-5)
    assert 0 < ours[9] < 1 and 0 < ours[10] < 1 and 0 < ours[12] < 1  # zeros, subnormals, near overflow seen


def test_nonfinite_values_are_in_the_sample_but_in_no_share():
    x = values(100)
    x[3], x[5] = np.nan, np.inf
    ours = shares(full_row(x))
    theirs = np.asarray(stats.row_stats(torch.from_numpy(x), full=True), dtype=np.float64)
    assert ours[[1, 2]].tolist() == [1.0, 1.0]
    assert ours[[5, 6, 9, 10, 11, 12, 13]].tolist() == theirs[[4, 5, 8, 9, 10, 11, 12]].tolist()


def test_a_row_of_several_tensors_merges_as_one():
    a, b = values(300, seed=1), values(500, seed=2)
    merged = xp_stats.merge_rows([full_row(a), full_row(b)], np, cast)
    whole = full_row(np.concatenate([a, b]))
    assert merged[[0, 1, 2, 4, 5, 6, 9, 10, 11, 12, 13]].tolist() == pytest.approx(
        whole[[0, 1, 2, 4, 5, 6, 9, 10, 11, 12, 13]].tolist(), abs=1e-12)
    assert merged[[7, 8]] == pytest.approx(whole[[7, 8]], rel=1e-5)


def test_nothing_finite_leaves_the_extremes_null():
    row = full_row(np.array([np.nan, np.inf], dtype=np.float16))
    assert all(math.isnan(v) for v in row[5:9])
    assert row[9:].tolist() == [0.0, 0.0, 0.0, 0.0, 2.0]  # counts


def test_jax_cheap_stats_in_one_pass_match_the_definitions_and_leave_gradients_alone():
    """`jax_grad_tap.cheap_stats` (the Keras-JAX and Flax rows' absmax, NaN
    and Inf counts by one variadic reduction): the largest finite magnitude
    and the exact counts, zeros for an empty array; taken inside
    value_and_grad (as the forward's rows are) it raises nothing and changes
    no gradient."""
    import jax
    import jax.numpy as jnp

    from recorders.jax_grad_tap import cheap_stats

    x = np.array([1.0, -5.0, np.nan, np.inf, -np.inf, 3.0, np.nan, -0.0], np.float32)
    assert [float(v) for v in jax.jit(cheap_stats)(jnp.asarray(x))] == [5.0, 2.0, 2.0]
    assert [float(v) for v in cheap_stats(jnp.zeros((0, 3), jnp.float32))] == [0.0, 0.0, 0.0]
    assert [float(v) for v in cheap_stats(jnp.full((3, 4), np.inf, jnp.float32))] == [0.0, 0.0, 12.0]
    seen = {}

    def loss(w):
        h = jnp.tanh(w * 3.0)
        seen["stats"] = cheap_stats(h)[0]
        return jnp.sum(h ** 2)

    w = jnp.linspace(-1.0, 1.0, 7, dtype=jnp.float32)
    _, with_stats = jax.jit(jax.value_and_grad(loss))(w)
    _, plain = jax.jit(jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(w * 3.0) ** 2)))(w)
    assert np.array_equal(np.asarray(with_stats), np.asarray(plain))
