"""Float16 reductions that overflow where float32 would not
(amp_postmortem/analyses/fp16_reductions.py): a Flax DeepSets model written
in explicit float16 (`dtype=jnp.float16`) on raw, unnormalised point
coordinates (0-255), recorded with `FlaxRecorder.wrap`. Its sum pooling
adds 512 float16 values per output: past 65504, Inf, though each input
is finite and float32 holds the sum. The same model written correctly sums
in float32 (and keeps the pooled sum and its head in float32): quiet."""
from __future__ import annotations

import json

# Imported outright: CI installs the jax extra, and a missing one must fail, not skip.
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from click.testing import CliRunner
from flax import nnx

from amp_postmortem.analyses.fp16_reductions import FLOAT16_MAX, find_fp16_reductions
from amp_postmortem.cli import main
from amp_postmortem.reading.loader import load_run
from amp_postmortem.names import FINDING_KINDS
from recorders.flax_recorder import FlaxRecorder

SETS, POINTS = 2, 512


class SumPool(nnx.Module):
    def __call__(self, h):
        return h.sum(axis=1)


class SumPoolFloat32(nnx.Module):
    def __call__(self, h):
        return h.astype(jnp.float32).sum(axis=1)


class DeepSet(nnx.Module):
    def __init__(self, pool, head_dtype, rngs):
        self.phi = nnx.Linear(2, 16, dtype=jnp.float16, rngs=rngs)
        self.pool = pool
        self.rho = nnx.Linear(16, 1, dtype=head_dtype, rngs=rngs)

    def __call__(self, points):
        return self.rho(self.pool(jax.nn.relu(self.phi(points.astype(jnp.float16)))))


def train_step(model, optimizer, points, labels):
    def loss_fn(model):
        return optax.sigmoid_binary_cross_entropy(model(points).astype(jnp.float32), labels).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return {"loss": loss, "grads": grads}


def record(run_dir, pool, head_dtype):
    rng = np.random.default_rng(0)
    points = jnp.asarray(rng.uniform(0, 255, (SETS, POINTS, 2)), jnp.float32)
    labels = jnp.asarray(rng.uniform(size=(SETS, 1)) > 0.5, jnp.float32)
    model = DeepSet(pool, head_dtype, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(1e-7), wrt=nnx.Param)
    with FlaxRecorder(run_dir, model, optimizer=optimizer) as rec:
        step = rec.wrap(train_step)
        for _ in range(4):
            step(model, optimizer, points, labels)
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16_reductions")
    return {"float16_sum": record(out / "float16_sum", SumPool(), jnp.float16),
            "float32_sum": record(out / "float32_sum", SumPoolFloat32(), jnp.float32)}


def findings(run_dir) -> dict:
    result = CliRunner().invoke(main, ["summary", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    return {f["kind"]: f for f in json.loads(result.output)["findings"]}


def test_the_float16_sum_pooling_is_found_with_its_evidence(runs):
    found = find_fp16_reductions(load_run(runs["float16_sum"]))
    assert found.steps_read == 4
    (pool,) = found.reductions
    # Steps 0 and 1: the pooling's input is finite; from step 2 on the
    # NaN update reaches phi, the first module, whose input is not recorded.
    assert (pool.module, pool.first_step, pool.steps, pool.values_per_output) == ("pool", 0, (0, 1), POINTS)
    assert pool.bound == pool.input_absmax * POINTS
    assert FLOAT16_MAX <= pool.bound < 3.4e38 and pool.input_absmax < FLOAT16_MAX


def test_summary_names_the_module_and_the_remedy(runs):
    assert "fp16_reduction_overflow" in FINDING_KINDS
    found = findings(runs["float16_sum"])
    assert found["nonfinite"]["layer"] == "pool"
    f = found["fp16_reduction_overflow"]
    assert (f["severity"], f["step"], f["layer"]) == ("error", 0, "pool")
    assert [r["module"] for r in f["evidence"]["reductions"]] == ["pool"]
    assert f["next_command"].startswith("compute the reduction in float32 and cast back: "
                                        "jax.nn.softmax(x.astype(jnp.float32)).astype(x.dtype)")
    text = CliRunner().invoke(main, ["summary", str(runs["float16_sum"])]).output
    assert "a reduction computed in float16 overflowed: pool at step 0 (512 values per output" in text


def test_fail_on_takes_the_kind(runs):
    result = CliRunner().invoke(main, ["summary", str(runs["float16_sum"]), "--fail-on", "fp16_reduction_overflow"])
    assert result.exit_code == 1 and "Traceback" not in result.output  # 1: a --fail-on finding


def test_the_sum_in_float32_is_quiet(runs):
    assert find_fp16_reductions(load_run(runs["float32_sum"])).reductions == []
    assert set(findings(runs["float32_sum"])) == {"healthy"}
