"""The Keras and Flax recorders' schedule and near-overflow options, as the
PyTorch recorder's (issue 39): a burst of full-tier steps after the first
event of each kind (`full_after_event`, `RecordSchedule`), the
near-overflow threshold (`near_overflow`, in the manifest's `recorder`);
zeros of zero-initialised weights not called flushed; Keras-JAX recorded
without jit. Keras runs come from `tests/keras_option_runs.py` in a
process of its own (the JAX backend); Flax runs here. What is pinned is
the story (which steps are full, a planted input's share, verdicts), not
values of CPU float16 kernels."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pandas as pd
import pytest
from click.testing import CliRunner
from flax import nnx

from amp_postmortem.cli import main
from recorders.flax_recorder import FlaxRecorder

importlib.import_module("keras")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from keras_option_runs import BATCH, NEAR_OVERFLOW, big_batch  # noqa: E402
from test_flax_recorder import DynamicScale, train_step  # noqa: E402


@pytest.fixture(scope="module")
def keras_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("keras_options")
    env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run([sys.executable, str(HERE / "keras_option_runs.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def cli_json(*args) -> dict:
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def tiers(run_dir) -> list:
    return pd.read_parquet(Path(run_dir) / "rank=0" / "steps").sort_values("step")["tier"].tolist()


def planted_share(run_dir, name: str) -> dict:
    """step -> the `near_overflow_share` of row `name` on full-tier steps."""
    rows = pd.read_parquet(Path(run_dir) / "rank=0" / "tensors")
    rows = rows[(rows["name"] == name) & rows["near_overflow_share"].notna()]
    return dict(zip(rows["step"].astype(int), rows["near_overflow_share"]))


# The planted batch: every value at or above NEAR_OVERFLOW, half of them below 65504.
BIG = big_batch()
assert (np.abs(BIG) >= NEAR_OVERFLOW).all() and np.mean(np.abs(BIG) >= 65504.0) == 0.5


def test_keras_full_tier_burst_after_the_first_event_and_the_near_overflow_threshold(keras_runs):
    """`burst`: full_every=0, so only the burst is full: steps 4-5 after
    step 3's first skip and NaN/Inf (later events of those kinds open no
    burst); the `<input>` row there is the planted batch, all of it at or
    above the threshold 1e4 (half of it at float16's 65504 default)."""
    run = keras_runs / "burst"
    assert tiers(run) == ["cheap"] * 4 + ["full"] * 2 + ["cheap"] * 2
    options = json.loads((run / "manifest.json").read_text())["recorder"]
    assert (options["full_every"], options["full_after_event"], options["near_overflow"]) == (0, 2, NEAR_OVERFLOW)
    assert planted_share(run, "<input>") == {4: 1.0, 5: 1.0}


def test_keras_zero_initialised_weights_make_no_flushed_zeros(keras_runs):
    """`zeros`: at step 0 the gradient reaching `d1` is exactly zero (it
    passed `z`'s zero kernel), at the later steps it has no zero at all: its
    layer's other steps are no evidence of a flush, and the zero row is
    undetermined, not an underflow (it was once '100% underflow at step
    0'); the zero biases' and ReLU's zeros are structural or undetermined."""
    run = keras_runs / "zeros"
    rows = pd.read_parquet(run / "rank=0" / "tensors")
    d1 = rows[(rows["name"] == "d1") & (rows["kind"] == "grad_output")].set_index("step")
    assert d1.loc[0, "zero_share"] == 1.0 and (d1.loc[1:, "zero_share"] == 0.0).all()  # the planted case
    layers = cli_json("ranges", str(run))["layers"]
    assert not [r for r in layers if r["zeros"] in ("flushed", "mixed")]
    assert not [r for r in layers if {"underflow", "underflow_lapsed"} & set(r["flags"])]
    kinds = {f["kind"] for f in cli_json("summary", str(run))["findings"]}
    assert not kinds & {"grad_underflow", "grad_subnormal", "underflow_lapsed"}


def test_keras_jax_without_jit_is_recorded(keras_runs):
    """`zeros` ran with jit_compile=False, run_eagerly=True: each step's own
    loss and every row kind at the full tier (full_every=1), read back by
    `summary`."""
    run = keras_runs / "zeros"
    assert tiers(run) == ["full"] * 6
    steps = pd.read_parquet(run / "rank=0" / "steps").sort_values("step")
    assert steps["loss"].notna().all() and not steps["skipped"].any() and steps["loss"].nunique() == 6
    rows = pd.read_parquet(run / "rank=0" / "tensors")
    assert set(rows["kind"]) == {"input", "activation", "loss", "grad_output", "grad_input", "param_grad"}
    assert rows.groupby("step").size().nunique() == 1 and rows["share_sample_size"].notna().all()
    assert cli_json("summary", str(run))["findings"]


class Ident(nnx.Module):
    """Its output is its input: a row that is the batch itself."""
    def __call__(self, x):
        return x * 1.0


class Net(nnx.Module):
    def __init__(self, rngs):
        self.inp = Ident()
        self.d1 = nnx.Linear(4, 8, dtype=jnp.float16, rngs=rngs)
        self.d2 = nnx.Linear(8, 1, dtype=jnp.float16, rngs=rngs)

    def __call__(self, x):
        return self.d2(self.d1(self.inp(x)))


def test_flax_full_tier_burst_after_the_first_event_and_the_near_overflow_threshold(tmp_path):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((BATCH, 4)) * 0.1, jnp.float32)
    y = jnp.asarray(rng.standard_normal((BATCH, 1)) * 0.1, jnp.float32)
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
    run = tmp_path / "burst"
    with FlaxRecorder(run, model, optimizer=optimizer, loss_scale=DynamicScale(2.0 ** 8), full_every=0,
                      full_after_event=2, near_overflow=NEAR_OVERFLOW) as rec:
        step = rec.wrap(train_step)
        s = jnp.float32(2.0 ** 8)
        for batch in [x] * 3 + [jnp.asarray(BIG)] * 5:
            s = step(model, optimizer, s, batch, y)["loss_scale"]
    assert tiers(run) == ["cheap"] * 4 + ["full"] * 2 + ["cheap"] * 2
    options = json.loads((run / "manifest.json").read_text())["recorder"]
    assert (options["full_every"], options["full_after_event"], options["near_overflow"]) == (0, 2, NEAR_OVERFLOW)
    assert planted_share(run, "inp") == {4: 1.0, 5: 1.0}


def test_the_options_are_checked():
    from recorders.errors import OptionError
    model = Net(nnx.Rngs(0))
    with pytest.raises(OptionError, match="full_after_event=-1"):
        FlaxRecorder("unused", model, full_after_event=-1)
    with pytest.raises(OptionError, match="near_overflow=0"):
        FlaxRecorder("unused", model, near_overflow=0)
