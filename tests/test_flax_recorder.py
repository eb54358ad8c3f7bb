"""The Flax nnx + optax recorder (recorders/flax_recorder.py): a tiny
float16 model with a hand-written dynamic loss scale (jmp's rule: halve on
a non-finite gradient and skip the update, double after `period` clean
steps), recorded with `FlaxRecorder.wrap`, read by the real analyzer. The
story is pinned (origin module and step, collapse onset, a quiet healthy
run), not CPU float16 values."""
from __future__ import annotations

import json
from dataclasses import dataclass

# Imported outright: CI installs the jax extra, and a missing one must fail, not skip.
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pandas as pd
import pytest
from click.testing import CliRunner
from flax import nnx

from amp_postmortem.cli import main
from recorders.flax_recorder import FlaxRecorder

BATCH = 8


@dataclass
class DynamicScale:
    """What the manifest reads of a jmp-style scale (jmp.DynamicLossScale)."""
    loss_scale: float
    period: int = 2000
    factor: int = 2


class Blowup(nnx.Module):
    def __call__(self, x):
        return jnp.exp(x)


class HugeGrad(nnx.Module):
    """The identity forward; once its input exceeds 5 in magnitude, its
    gradient is 1e20 times the incoming one (Inf in float16)."""
    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        big = x32 * jax.lax.stop_gradient(jnp.where(jnp.max(jnp.abs(x32)) > 5.0, 1e20, 0.0))
        return (x32 + big - jax.lax.stop_gradient(big)).astype(x.dtype)


class Relu(nnx.Module):
    def __call__(self, x):
        return jax.nn.relu(x)


class Net(nnx.Module):
    def __init__(self, middle, rngs):
        self.d1 = nnx.Linear(4, 8, dtype=jnp.float16, rngs=rngs)
        self.mid = middle
        self.d2 = nnx.Linear(8, 1, dtype=jnp.float16, rngs=rngs)

    def __call__(self, x):
        return self.d2(self.mid(self.d1(x)))


def train_step(model, optimizer, scale, x, y):
    def loss_fn(model):
        pred = model(x).astype(jnp.float32)
        loss = jnp.mean((pred - y) ** 2)
        return loss * scale, loss
    (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
    finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    safe = jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads)
    before = nnx.state(model, nnx.Param)
    optimizer.update(model, safe)
    nnx.update(model, jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                   nnx.state(model, nnx.Param), before))
    new_scale = jnp.where(finite, scale, scale / 2)
    return {"loss": loss, "grads": grads, "loss_scale_before": scale, "loss_scale": new_scale,
            "skipped": jnp.logical_not(finite)}


def record(run_dir, model, xs, y, scale=2.0 ** 15, **options):
    optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
    with FlaxRecorder(run_dir, model, optimizer=optimizer, loss_scale=DynamicScale(scale), **options) as rec:
        step = rec.wrap(train_step)
        s = jnp.float32(scale)
        for x in xs:
            s = step(model, optimizer, s, x, y)["loss_scale"]
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("flax")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((BATCH, 4)) * 0.1, jnp.float32)
    y = jnp.asarray(rng.standard_normal((BATCH, 1)) * 0.1, jnp.float32)
    collapse, grown = Net(HugeGrad(), nnx.Rngs(0)), [x] * 10 + [x * 100.0] * 20
    return {
        # The period alone (no burst after events): its steps' tiers say `full_every`'s.
        "overflow": record(out / "overflow", Net(Blowup(), nnx.Rngs(0)), [x] * 3 + [x * 1000.0] * 3, y,
                           full_after_event=0),
        "collapse": record(out / "collapse", collapse, grown, y),
        "healthy": record(out / "healthy", Net(Relu(), nnx.Rngs(0)), [x] * 20, y, scale=2.0 ** 8),
        # What `collapse` trained, for the truth: its weights at the end are those
        # of every skipped step (a skip keeps them).
        "collapse_trained": (collapse, grown, y),
    }


def backward_origin(model, x, y, scale):
    """Independent of the recorder: the first module, walking the backward
    from `train_step`'s scaled loss, whose input gradient is non-finite
    while its output's is finite (None: none), each module's gradient its
    own `jax.vjp`."""
    modules = [("d1", model.d1), ("mid", model.mid), ("d2", model.d2)]
    hs = [x]
    for _, module in modules:
        hs.append(module(hs[-1]))
    pred = hs[-1].astype(jnp.float32)
    g = (scale * 2.0 * (pred - y) / pred.size).astype(hs[-1].dtype)
    for (name, module), h in zip(reversed(modules), reversed(hs[:-1])):
        g_in = jax.vjp(module, h)[1](g)[0]
        if bool(jnp.all(jnp.isfinite(g))) and not bool(jnp.all(jnp.isfinite(g_in))):
            return name
        g = g_in
    return None


def cli_json(*args) -> dict:
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def findings(run_dir) -> dict:
    return {f["kind"]: f for f in cli_json("summary", str(run_dir))["findings"]}


def test_the_manifest_names_flax(runs):
    manifest = json.loads((runs["overflow"] / "manifest.json").read_text())
    assert manifest["framework"]["name"] == "flax"
    assert manifest["scaler"]["init_scale"] == 2.0 ** 15 and manifest["scaler"]["backoff_factor"] == 0.5
    assert manifest["autocast"]["dtype"] == "float16"


def test_the_planted_exp_overflow_is_traced_to_its_module_and_step(runs):
    found = findings(runs["overflow"])
    assert found["nonfinite"]["layer"] == "mid"
    assert found["nonfinite"]["step"] == 3


def test_rows_in_call_order_with_the_steps_own_loss(runs):
    tensors = pd.read_parquet(runs["overflow"] / "rank=0" / "tensors")
    step0 = tensors[(tensors.step == 0) & (tensors.phase == "forward")].sort_values("order")
    assert list(step0["name"]) == ["d1", "mid", "d2", "", "<loss>"]
    grads = tensors[(tensors.step == 0) & (tensors.kind == "param_grad")]
    assert sorted(grads["name"]) == ["d1.bias", "d1.kernel", "d2.bias", "d2.kernel"]
    steps = pd.read_parquet(runs["overflow"] / "rank=0" / "steps")
    assert steps["loss"].iloc[:3].notna().all()
    assert steps["skipped"].iloc[3:].all() and not steps["skipped"].iloc[:3].any()


def test_the_loss_scale_collapse_is_found(runs):
    found = findings(runs["collapse"])
    assert found["scale_collapse"]["step"] == 10
    assert "nonfinite" not in found


def test_a_backward_only_overflow_is_traced_to_its_module_and_step(runs):
    """`mid`'s forward stays finite; from step 10 its backward overflows
    float16. The truth: the step, the scale's own first skip with a finite
    loss; the module, walked by hand (`backward_origin`). `nans` and the
    collapse's finding name them from the `grad_output`/`grad_input` rows."""
    steps = pd.read_parquet(runs["collapse"] / "rank=0" / "steps")
    step = int(steps[steps["skipped"] & np.isfinite(steps["loss"])]["step"].min())
    model, xs, y = runs["collapse_trained"]
    module = backward_origin(model, xs[step], y, steps["loss_scale_before"].iloc[step])
    assert module is not None
    origins = cli_json("nans", str(runs["collapse"]))["origins"]
    assert origins["forward"] is None
    assert (origins["backward"]["name"], origins["backward"]["step"]) == (module, step)
    assert origins["backward"]["kind"] == "grad_input" and origins["backward"]["basis"] == "rule"
    collapse = findings(runs["collapse"])["scale_collapse"]
    assert (collapse["layer"], collapse["step"]) == (module, step)
    # Its step is saved for `replay` (the scale had settled: no calibration skip).
    manifest = json.loads((runs["collapse"] / "manifest.json").read_text())
    assert [(b["step"], b["reasons"]) for b in manifest["bundles"]] == [(step, ["nonfinite_gradient"])]
    tensors = pd.read_parquet(runs["collapse"] / "rank=0" / "tensors")
    backward = tensors[(tensors.step == 0) & (tensors.phase == "backward")].sort_values("order")
    assert [(n, k) for n, k in zip(backward["name"], backward["kind"]) if k != "param_grad"] == [
        ("", "grad_output"), ("d2", "grad_output"), ("d2", "grad_input"), ("mid", "grad_output"),
        ("mid", "grad_input"), ("d1", "grad_output")]


def test_the_healthy_run_is_quiet(runs):
    assert set(findings(runs["healthy"])) == {"healthy"}
    for command in ("scale", "ranges", "nans"):
        cli_json(command, str(runs["healthy"]))


def test_step_without_the_helper(tmp_path):
    model = Net(Relu(), nnx.Rngs(0))
    with FlaxRecorder(tmp_path / "run", model, loss_scale=DynamicScale(1024.0)) as rec:
        rec.step(loss=0.5, loss_scale_before=1024.0, loss_scale=1024.0, skipped=False, grad_norm=0.1)
        rec.step(loss=float("nan"), loss_scale_before=1024.0, loss_scale=512.0, skipped=True)
    steps = pd.read_parquet(tmp_path / "run" / "rank=0" / "steps")
    assert list(steps["skipped"]) == [False, True]
    assert list(steps["loss_scale"]) == [1024.0, 512.0]


def test_each_recorder_counts_its_own_bundles(tmp_path):
    """Recorders made one after another in one process, wrapping the same
    step function, with the default `bundles=` and with one
    `BundleTriggers` given to both: each saves its run's failing step (the
    first run's count once leaked into the next: no bundle)."""
    from recorders.host_bundle import BundleTriggers
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((BATCH, 4)) * 0.1, jnp.float32)
    y = jnp.asarray(rng.standard_normal((BATCH, 1)) * 0.1, jnp.float32)
    shared = BundleTriggers(max_bundles=1)
    for name, kwargs in [("first", {}), ("second", {}), ("shared1", {"bundles": shared}),
                         ("shared2", {"bundles": shared})]:
        model = Net(Blowup(), nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
        with FlaxRecorder(tmp_path / name, model, optimizer=optimizer,
                          loss_scale=DynamicScale(2.0 ** 15), **kwargs) as rec:
            step = rec.wrap(train_step)
            s = jnp.float32(2.0 ** 15)
            for batch in [x] * 3 + [x * 1000.0] * 2:
                s = step(model, optimizer, s, batch, y)["loss_scale"]
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        assert [(b["step"], b["reasons"]) for b in manifest["bundles"]] == \
            [(3, ["nonfinite_loss", "nonfinite_tensor"])], name
    assert shared.saved == 0 and shared.fired == set()


class Identity(nnx.Module):
    def __call__(self, x):
        return x


def test_the_full_tier_reports_a_planted_gradient_underflow_for_its_modules(tmp_path):
    """One step (step 0: the full tier's) under a fixed loss scale of 2**-12,
    `d1` at zero and `d2`'s bias at zero: the model predicts exactly 0, the
    gradient reaching `d2`'s output is exactly -y * 2**-14 rounded to
    float16 once, the one reaching `d1`'s output each of those times each of
    `d2`'s weights, rounded once. The rows, `ranges` and `summary` agree
    with those values counted here with numpy (zero or below 2**-14, so a
    flush to zero changes nothing)."""
    model = Net(Identity(), nnx.Rngs(0))
    model.d1.kernel[...] = jnp.zeros_like(model.d1.kernel[...])
    w2 = np.asarray(model.d2.kernel[...]).astype(np.float16)[:, 0]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((BATCH, 4)), jnp.float32)
    y = rng.standard_normal((BATCH, 1)).astype(np.float32)
    run = record(tmp_path / "underflow", model, [x], jnp.asarray(y), scale=2.0 ** -12)
    g2 = (-y[:, 0].astype(np.float64) * 2.0 ** -14).astype(np.float16)
    g1 = (g2[:, None].astype(np.float64) * w2[None, :].astype(np.float64)).astype(np.float16)
    truth = {"d2": g2, "d1": g1}
    assert pd.read_parquet(run / "rank=0" / "steps")["tier"].tolist() == ["full"]
    rows = pd.read_parquet(run / "rank=0" / "tensors")
    layers = {r["name"]: r for r in cli_json("ranges", str(run))["layers"] if r["kind"] == "grad_output"}
    for name, g in truth.items():
        tiny = int(np.sum((g == 0) | (np.abs(g) < np.float16(2.0 ** -14))))
        row = rows[(rows["name"] == name) & (rows["kind"] == "grad_output")].iloc[0]
        assert row["share_sample_size"] == row["numel"] == g.size
        assert round((row["below_normal_share"] + row["zero_share"]) * g.size) == tiny
        assert layers[name]["underflow_share"] == pytest.approx(tiny / g.size)
        assert "underflow" in layers[name]["flags"]
    found = findings(run)
    kind = "grad_underflow" if "grad_underflow" in found else "grad_subnormal"  # a flush to zero or not: the kernels'
    assert {"d1", "d2"} <= set(found[kind]["evidence"]["layers"])


def test_only_full_tier_steps_carry_the_full_columns(runs):
    """`overflow` (6 steps, full_every=100, full_after_event=0): step 0 full, the others cheap
    with null full-tier columns."""
    steps = pd.read_parquet(runs["overflow"] / "rank=0" / "steps").sort_values("step")
    assert steps["tier"].tolist() == ["full"] + ["cheap"] * 5
    rows = pd.read_parquet(runs["overflow"] / "rank=0" / "tensors")
    full_cols = ["min", "max", "mean", "rms", "zero_share", "below_normal_share", "below_subnormal_share",
                 "near_overflow_share", "share_sample_size"]
    assert rows[rows["step"] > 0][full_cols].isna().all().all()
    assert rows[rows["step"] == 0][full_cols[4:]].notna().all().all()
