"""The Keras 3 recorder (recorders/keras_recorder.py) on both backends:
runs made by `tests/keras_runs.py` in a process per backend (Keras picks
its backend at import), read by the real analyzer. What is pinned is the
story (origin layer and step, the collapse's onset, a quiet healthy run,
exact skip flags), not values of CPU float16 kernels."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

importlib.import_module("keras")

from amp_postmortem.cli import main  # noqa: E402
from click.testing import CliRunner  # noqa: E402

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module", params=["tensorflow", "jax"])
def runs(request, tmp_path_factory):
    importlib.import_module(request.param)
    out = tmp_path_factory.mktemp(f"keras_{request.param}")
    env = {**os.environ, "KERAS_BACKEND": request.param, "TF_CPP_MIN_LOG_LEVEL": "3"}
    subprocess.run([sys.executable, str(HERE / "keras_runs.py"), str(out)], env=env, check=True,
                   capture_output=True, text=True, timeout=300)
    return request.param, out


def cli_json(*args) -> dict:
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def findings(run_dir) -> dict:
    return {f["kind"]: f for f in cli_json("summary", str(run_dir))["findings"]}


def test_the_manifest_names_the_framework_and_its_backend(runs):
    backend, out = runs
    manifest = json.loads((out / "overflow" / "manifest.json").read_text())
    assert manifest["framework"]["name"] == "keras"
    assert manifest["framework"]["backend"] == backend
    assert manifest["schema_version"] == "1.5"
    assert manifest["scaler"]["init_scale"] == 2.0 ** 15
    assert manifest["autocast"] == {"enabled": True, "device_type": "cpu", "dtype": "float16",
                                    "cache_enabled": None, "policy": "mixed_float16"}
    assert [m["name"] for m in manifest["modules"]] == ["d1", "blowup", "d2"]


def test_the_planted_exp_overflow_is_traced_to_its_layer_and_step(runs):
    _, out = runs
    found = findings(out / "overflow")
    assert found["nonfinite"]["layer"] == "blowup"
    assert found["nonfinite"]["step"] == 3
    nans = cli_json("nans", str(out / "overflow"))
    assert json.dumps(nans).count('"blowup"') >= 1


def test_each_step_has_its_own_loss_and_rows_in_call_order(runs):
    _, out = runs
    steps = pd.read_parquet(out / "overflow" / "rank=0" / "steps")
    assert list(steps["step"]) == [0, 1, 2, 3, 4, 5]
    # The step's own loss: finite before the overflow, NaN/Inf from it on
    # (the running mean of logs["loss"] would stay NaN, not say which).
    assert steps["loss"].iloc[:3].notna().all() and (steps["loss"].iloc[:3] < 1e3).all()
    assert not steps["loss"].iloc[3:].apply(lambda v: pd.notna(v) and abs(v) < float("inf")).any()
    assert steps["skipped"].iloc[3:].all()
    tensors = pd.read_parquet(out / "overflow" / "rank=0" / "tensors")
    step0 = tensors[tensors.step == 0]
    forward = step0[step0.phase == "forward"].sort_values("order")
    assert list(forward["name"]) == ["<input>", "d1", "blowup", "d2", "<loss>"]
    assert list(forward["dtype"])[1:4] == ["float16"] * 3
    grads = step0[step0.kind == "param_grad"]
    assert sorted(grads["name"]) == ["d1.bias", "d1.kernel", "d2.bias", "d2.kernel"]


def test_the_skip_flag_is_the_loss_scale_optimizers_own(runs):
    _, out = runs
    steps = pd.read_parquet(out / "collapse" / "rank=0" / "steps")
    # Skipped exactly when the scale halved; never skipped when it did not.
    halved = steps["loss_scale"] == steps["loss_scale_before"] / 2
    assert (steps["skipped"] == halved).all()
    assert not steps["skipped"].iloc[:10].any() and steps["skipped"].iloc[10:].all()
    assert (steps["loss_scale_before"].iloc[1:].values == steps["loss_scale"].iloc[:-1].values).all()


def test_the_loss_scale_collapse_is_found(runs):
    _, out = runs
    found = findings(out / "collapse")
    assert found["scale_collapse"]["step"] == 10
    assert "nonfinite" not in found


def test_a_backward_only_overflow_is_traced_to_its_layer_and_step(runs):
    """`hugegrad`'s forward stays finite; from step 10 its backward
    overflows float16 (on TensorFlow, a step compiled without XLA). The
    truth (tests/keras_runs.py): the step, the LossScaleOptimizer's own
    first skip with a finite loss; the layer, walked by hand with the
    backend's differentiation. `nans` and the collapse's finding name them
    from the `grad_output`/`grad_input` rows."""
    _, out = runs
    truth = json.loads((out / "collapse_truth.json").read_text())
    step, layer = truth["step"], truth["layer"]
    assert layer is not None
    origins = cli_json("nans", str(out / "collapse"))["origins"]
    assert origins["forward"] is None
    assert (origins["backward"]["name"], origins["backward"]["step"]) == (layer, step)
    assert origins["backward"]["kind"] == "grad_input" and origins["backward"]["basis"] == "rule"
    collapse = findings(out / "collapse")["scale_collapse"]
    assert (collapse["layer"], collapse["step"]) == (layer, step)
    # Its step is saved for `replay` (the scale had settled: no calibration skip).
    manifest = json.loads((out / "collapse" / "manifest.json").read_text())
    assert [(b["step"], b["reasons"]) for b in manifest["bundles"]] == [(step, ["nonfinite_gradient"])]
    # The rows of a step compiled by XLA too (`overflow`, a clean step), in backward
    # order: the gradient entering the model (""), then each layer's output's and what
    # it hands its inputs, its variables' between them; the model's input gets none.
    tensors = pd.read_parquet(out / "overflow" / "rank=0" / "tensors")
    backward = tensors[(tensors.step == 0) & (tensors.phase == "backward")].sort_values("order")
    assert list(zip(backward["name"], backward["kind"])) == [
        ("", "grad_output"), ("d2", "grad_output"), ("d2.bias", "param_grad"), ("d2.kernel", "param_grad"),
        ("d2", "grad_input"), ("blowup", "grad_output"), ("blowup", "grad_input"), ("d1", "grad_output"),
        ("d1.bias", "param_grad"), ("d1.kernel", "param_grad")]
    assert set(backward[backward.kind != "param_grad"]["dtype"]) == {"float16"}


def test_the_healthy_run_is_quiet(runs):
    _, out = runs
    assert set(findings(out / "healthy")) == {"healthy"}
    for command in ("scale", "ranges"):
        cli_json(command, str(out / "healthy"))


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_recording_changes_no_bit_of_a_classifier_trained_through_its_logits(backend, tmp_path):
    """Plain and recorded, the same classifiers (a softmax layer, a softmax
    in a layer's own code, sigmoid outputs under binary crossentropy) give
    the same losses and weights bit for bit. On TensorFlow, Keras' losses
    differentiate the outputs' logits: the planted confident-and-wrong row
    costs ~200 from the logits and 16.1 from clipped probabilities, so a
    tap that hid the logits could not pass as noise."""
    importlib.import_module(backend)
    out = tmp_path / "bits.json"
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run([sys.executable, str(HERE / "keras_bits_runs.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["backend"] == backend
    for head in ("softmax_layer", "raw_softmax", "sigmoid"):
        plain, recorded = doc[head]["plain"], doc[head]["recorded"]
        assert recorded["running_mean"] == plain["running_mean"], head
        assert recorded["weights"] == plain["weights"], head
        if backend == "tensorflow":
            assert plain["first_loss"] > 200 / 8 - 1, (head, plain["first_loss"])  # the row's 200, over 8


def test_steps_per_execution_above_one_is_refused(tmp_path):
    code = (
        "import keras, numpy as np\n"
        "from recorders.keras_recorder import KerasRecorder, KerasRecorderError\n"
        "m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])\n"
        "m.compile(optimizer='sgd', loss='mse', steps_per_execution=4)\n"
        f"rec = KerasRecorder({str(tmp_path / 'run')!r}, m)\n"
        "try:\n"
        "    m.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=2, verbose=0, callbacks=[rec])\n"
        "except KerasRecorderError as e:\n"
        "    print('refused:', e)\n"
    )
    env = {**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": str(HERE.parent)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "refused: steps_per_execution=4" in out.stdout, out.stderr[-2000:]


def test_each_recorder_counts_its_own_bundles(tmp_path):
    """Two recorders one after another in one process, with the default
    `bundles=`: each saves its run's failing step (the first run's count
    once leaked into the second: no bundle)."""
    code = (
        "import json, sys, keras, numpy as np\n"
        "sys.path.insert(0, 'tests')\n"
        "from recorders.keras_recorder import KerasRecorder\n"
        "from replay_models import keras_model\n"
        "keras.mixed_precision.set_global_policy('mixed_float16')\n"
        "x = np.full((40, 4), 0.01, 'float32'); x[24:] = 5.0\n"
        "y = np.zeros((40, 1), 'float32')\n"
        "for name in ('first', 'second'):\n"
        "    net = keras_model()\n"
        "    net.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3)), loss='mse')\n"
        f"    run = {str(tmp_path)!r} + '/' + name\n"
        "    with KerasRecorder(run, net) as rec:\n"
        "        net.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[rec])\n"
        "    print(name, [b['step'] for b in json.load(open(run + '/manifest.json'))['bundles']])\n"
    )
    env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(HERE.parent)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=HERE.parent)
    assert out.stdout.splitlines() == ["first [3]", "second [3]"], out.stderr[-2000:]


def test_the_full_tier_reports_a_planted_gradient_underflow_for_its_layers(runs):
    """Step 0 of `underflow` is a full-tier step: its rows' below-normal and
    zero shares, `ranges`' underflow share and `summary`'s underflow finding
    agree with the truth counted with numpy from the batch (tests/keras_runs.py)."""
    _, out = runs
    truth = json.loads((out / "underflow_truth.json").read_text())
    steps = pd.read_parquet(out / "underflow" / "rank=0" / "steps")
    assert steps["tier"].tolist() == ["full"]
    rows = pd.read_parquet(out / "underflow" / "rank=0" / "tensors")
    ranges = cli_json("ranges", str(out / "underflow"))["layers"]
    layers = {r["name"]: r for r in ranges if r["kind"] == "grad_output"}
    # d1's zero kernel and bias and d2's zero bias make both outputs all zero: the step's
    # gradient underflow says nothing of them (they were once called flushed).
    assert [r["zeros"] for r in ranges if r["kind"] == "activation"] == ["undetermined", "undetermined"]
    for name in ("d2", "d1"):
        t = truth[name]
        row = rows[(rows["name"] == name) & (rows["kind"] == "grad_output")].iloc[0]
        assert row["share_sample_size"] == row["numel"] == t["numel"]
        assert round((row["below_normal_share"] + row["zero_share"]) * t["numel"]) == t["below_normal_or_zero"]
        assert layers[name]["underflow_share"] == pytest.approx(t["below_normal_or_zero"] / t["numel"])
        assert "underflow" in layers[name]["flags"]
    found = findings(out / "underflow")
    kind = "grad_underflow" if "grad_underflow" in found else "grad_subnormal"  # a flush to zero or not: the kernels'
    assert {"d1", "d2"} <= set(found[kind]["evidence"]["layers"])


def test_only_full_tier_steps_carry_the_full_columns(runs):
    """`overflow`: step 0 is full (full_every=100, full_after_event=0), steps 1-5 cheap, their
    full-tier columns null."""
    _, out = runs
    steps = pd.read_parquet(out / "overflow" / "rank=0" / "steps").sort_values("step")
    assert steps["tier"].tolist() == ["full"] + ["cheap"] * 5
    rows = pd.read_parquet(out / "overflow" / "rank=0" / "tensors")
    full_cols = ["min", "max", "mean", "rms", "zero_share", "below_normal_share", "below_subnormal_share",
                 "near_overflow_share", "share_sample_size"]
    assert rows[rows["step"] > 0][full_cols].isna().all().all()
    first = rows[rows["step"] == 0]
    # Every row has its shares (a gradient with no finite value, as the
    # 2**15 scale's first step makes, has no extremes, mean or rms).
    assert first[full_cols[4:]].notna().all().all()
    assert set(first["kind"]) == {"input", "activation", "loss", "grad_output", "grad_input", "param_grad"}


ADD_LOSS_STEP = '''
import json, sys, keras, numpy as np
from keras import ops
from recorders.keras_recorder import KerasRecorder
keras.mixed_precision.set_global_policy("mixed_float16")
keras.utils.set_random_seed(0)


class OwnLoss(keras.Model):
    """A custom step whose loss is its own formula, not compute_loss: handed
    to the recorder with add_loss (differentiated as returned, or not)."""

    def __init__(self, use_returned):
        super().__init__(name="net")
        self.use_returned = use_returned
        self.d1 = keras.layers.Dense(8, activation="relu", name="d1")
        self.d2 = keras.layers.Dense(1, name="d2")

    def call(self, x):
        return self.d2(self.d1(x))

    def _loss(self, x, y, y_pred):
        loss = ops.mean((ops.cast(y_pred, "float32") - y) ** 2)
        handed = self.rec.add_loss(loss)
        return handed if self.use_returned else loss
'''


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_a_custom_step_hands_its_loss_with_add_loss(backend, tmp_path):
    """A custom train step that computes its loss without `compute_loss` gets
    its loss and forward rows by `loss = rec.add_loss(loss)`; on JAX, a step
    that differentiates another tensor than the one returned records no
    forward row and an unknown loss, never a NaN loss (no false event)."""
    step = {
        "tensorflow": '''
    def train_step(self, data):
        import tensorflow as tf
        x, y = data
        with tf.GradientTape() as tape:
            loss = self._loss(x, y, self(x, training=True))
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}
''',
        "jax": '''
    def compute_loss_and_updates(self, tv, ntv, ov, x, y):
        y_pred, ntv = self.stateless_call(tv, ntv, x)
        loss = self._loss(x, y, y_pred)
        mapping = list(zip(self.optimizer.variables, ov))
        with keras.StatelessScope(state_mapping=mapping):
            scaled = self.optimizer.scale_loss(loss)
        return scaled, (loss, ntv)

    def train_step(self, state, data):
        import jax
        tv, ntv, ov, mv = state
        x, y = data
        (_, (loss, ntv)), grads = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)(
            tv, ntv, ov, x, y)
        tv, ov = self.optimizer.stateless_apply(ov, grads, tv)
        return {"loss": loss}, (tv, ntv, ov, mv)
'''}[backend]
    code = ADD_LOSS_STEP.replace("\n\nclass OwnLoss", "\n\nclass OwnLoss").replace(
        "        return handed if self.use_returned else loss\n",
        "        return handed if self.use_returned else loss\n" + step) + f'''
x = np.random.default_rng(0).standard_normal((16, 4)).astype("float32")
y = np.zeros((16, 1), "float32")
for use in (True, False):
    net = OwnLoss(use)
    net.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3)))
    run = {str(tmp_path)!r} + "/" + str(use)
    with KerasRecorder(run, net) as rec:
        net.rec = rec
        net.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[rec])
'''
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(HERE.parent)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=HERE.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    from amp_postmortem.reading.loader import load_run
    used = load_run(tmp_path / "True")
    assert used.steps["loss"].notna().all() and (used.steps["loss"] > 0).all()
    tensors = used.tensors.to_table().to_pandas()
    forward = tensors[tensors["kind"] == "activation"]
    assert {"d1", "d2"} <= set(forward["name"]) and set(forward["step"]) == {0, 1}
    ignored = load_run(tmp_path / "False")
    if backend == "jax":  # the forward's values could not leave value_and_grad
        assert ignored.steps["loss"].isna().all()
        assert not (ignored.tensors.to_table().to_pandas()["kind"] == "activation").any()
    else:  # TensorFlow's graph values need no carrying
        assert ignored.steps["loss"].notna().all()
    assert "nonfinite_loss" not in {f["kind"] for f in cli_json("summary", str(tmp_path / "False"))["findings"]}
