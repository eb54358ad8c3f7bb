"""Bundles and replay of Keras and Flax runs (recorders/host_bundle.py,
amp_postmortem/reading/array_bundle.py, amp_postmortem/framework_replay/): a
planted `exp` whose input (20) overflows float16 but not float32, recorded
by the real recorders, saved as a pickle-free bundle at the failing step,
replayed through the real CLI with the user's factory
(tests/replay_models.py). Keras runs in a process per backend
(tests/keras_replay_runs.py)."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from amp_postmortem.reading.array_bundle import load_array_bundle
from amp_postmortem.cli import main
from amp_postmortem.errors import BundleError
from recorders.host_bundle import BundleTriggers, write_bundle

HERE = Path(__file__).resolve().parent


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


# ------------------------------------------------------------------ Keras
@pytest.fixture(scope="module", params=["tensorflow", "jax"])
def keras_replay(request, tmp_path_factory):
    importlib.import_module("keras")
    importlib.import_module(request.param)
    out = tmp_path_factory.mktemp(f"keras_replay_{request.param}")
    env = {**os.environ, "KERAS_BACKEND": request.param, "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run([sys.executable, str(HERE / "keras_replay_runs.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return request.param, out


def test_keras_saves_the_failing_steps_bundle_pickle_free(keras_replay):
    backend, out = keras_replay
    manifest = json.loads((out / "run" / "manifest.json").read_text())
    assert [(b["step"], b["reasons"]) for b in manifest["bundles"]] == [(3, ["nonfinite_loss", "nonfinite_tensor"])]
    bundle = load_array_bundle(out / "run" / "bundles" / "step=3" / "rank=0")
    assert (bundle.framework, bundle.backend) == ("keras", backend)
    assert list(bundle.params) == ["d1.kernel", "d1.bias", "d2.kernel", "d2.bias"]
    assert bundle.meta["params"]["exact"] is True  # the loss scale skipped the step: weights untouched
    assert bundle.meta["policy"]["name"] == "mixed_float16"
    assert bundle.meta["recorded_nonfinite"][0] == {"name": "blowup", "call": 0}
    (x,), _ = bundle.inputs()
    assert x.shape == (8, 4) and (x == 5.0).all()


def test_keras_replay_names_the_layer_whose_own_arithmetic_breaks(keras_replay):
    backend, out = keras_replay
    doc = json.loads((out / "replay.json").read_text())
    assert doc.get("exit_code") is None, doc
    assert (doc["framework"], doc["backend"], doc["recorded_precision"]) == ("keras", backend, "fp16")
    assert doc["reproduced"] is True
    assert doc["culprit"]["name"] == "blowup" and doc["culprit"]["precision"] == "fp16"
    status = {m["name"]: m["status"]["fp16"] for m in doc["modules"] if m["phase"] == "forward"}
    assert status == {"d1": "ok", "blowup": "broken", "d2": "inputs_nonfinite"}
    assert doc["culprits"]["bf16"] is None  # bfloat16's range holds e**20
    assert doc["reference_nonfinite"] == []


def test_keras_backward_replay_names_the_layer_whose_backward_overflows(keras_replay):
    """`root`'s forward is finite in float16; its gradient (1/(2 sqrt x) times
    the scaled loss's) is not: the backward replay names it, where the
    forward replay alone found nothing."""
    backend, out = keras_replay
    doc = json.loads((out / "grad.json").read_text())
    assert doc.get("exit_code") is None, doc
    assert doc["culprit"]["name"] == "root" and doc["culprit"]["phase"] == "backward"
    assert doc["culprit"]["precision"] == "fp16"
    assert doc["reproduced"] is True and "skipped" in doc["fidelity"]["basis"]
    fp16 = doc["backward"]["fp16"]
    assert fp16["replayed"] and fp16["first_nonfinite"] == {"name": "root", "call": 0}
    assert doc["backward"]["bf16"]["first_nonfinite"] is None and doc["culprits"]["bf16"] is None
    phases = {(m["name"], m["phase"]): m["status"]["fp16"] for m in doc["modules"]}
    assert phases == {("d1", "forward"): "ok", ("root", "forward"): "ok", ("d2", "forward"): "ok",
                      ("<loss>", "backward"): "ok", ("d2", "backward"): "ok", ("root", "backward"): "broken",
                      ("d1", "backward"): "inputs_nonfinite"}
    # The forward overflow's run: the forward culprit stands, its backward is non-finite from the loss on.
    forward = json.loads((out / "replay.json").read_text())
    assert forward["culprit"]["phase"] == "forward"
    assert forward["backward"]["fp16"]["first_nonfinite"] == {"name": "d2", "call": 0}
    assert {m["status"]["fp16"] for m in forward["modules"] if m["phase"] == "backward"} == {"inputs_nonfinite"}


# ------------------------------------------------------------------- Flax
@pytest.fixture(scope="module")
def flax_run(tmp_path_factory):
    jnp = importlib.import_module("jax.numpy")
    nnx = importlib.import_module("flax.nnx")
    optax = importlib.import_module("optax")
    from recorders.flax_recorder import FlaxRecorder
    from test_flax_recorder import DynamicScale, train_step
    sys.path.insert(0, str(HERE))
    from replay_models import flax_model

    run = tmp_path_factory.mktemp("flax_replay") / "run"
    model = flax_model()
    optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 4)) * 0.1, jnp.float32)
    y = jnp.asarray(rng.standard_normal((8, 1)) * 0.1, jnp.float32)
    with FlaxRecorder(run, model, optimizer=optimizer, loss_scale=DynamicScale(2.0 ** 15)) as rec:
        step = rec.wrap(train_step)
        scale = jnp.float32(2.0 ** 15)
        for batch in [x] * 3 + [jnp.full((8, 4), 5.0, jnp.float32)] * 2:
            scale = step(model, optimizer, scale, batch, y)["loss_scale"]
    return run


def test_flax_saves_the_model_calls_arguments_and_params(flax_run):
    manifest = json.loads((flax_run / "manifest.json").read_text())
    assert [b["step"] for b in manifest["bundles"]] == [3]
    bundle = load_array_bundle(flax_run / "bundles" / "step=3" / "rank=0")
    assert bundle.framework == "flax" and bundle.meta["params"]["exact"] is True
    assert sorted(bundle.params) == ["d1.bias", "d1.kernel", "d2.bias", "d2.kernel"]
    (x,), kwargs = bundle.inputs()
    assert kwargs == {} and x.shape == (8, 4) and (x == 5.0).all()
    assert bundle.loss_scale == 2.0 ** 15


def test_flax_replay_names_the_module_and_takes_the_first_failure_without_step(flax_run):
    result = cli("replay", flax_run, "--model", f"{HERE / 'replay_models.py'}:flax_model", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["bundle_choice"] == {"step": 3, "rank": 0, "reasons": ["nonfinite_loss", "nonfinite_tensor"],
                                    "failure": True}
    assert doc["reproduced"] is True
    assert doc["culprit"]["name"] == "mid" and doc["culprit"]["precision"] == "fp16"
    status = {m["name"]: m["status"]["fp16"] for m in doc["modules"]}
    assert status["d1"] == "ok" and status["mid"] == "broken" and status["d2"] == "inputs_nonfinite"
    text = cli("replay", flax_run, "--step", 3, "--model", f"{HERE / 'replay_models.py'}:flax_model")
    assert text.exit_code == 0 and "culprit: mid, forward, fp16" in text.output


def test_flax_backward_replays_with_the_steps_loss(flax_run):
    """Given the step's loss (`--loss-fn`, called with the step's own
    arguments), the backward is replayed too; the forward culprit stands."""
    bundle = load_array_bundle(flax_run / "bundles" / "step=3" / "rank=0")
    kinds = [n["kind"] for n in bundle.meta["step_arguments"]["args"]]
    assert kinds == ["unsupported", "unsupported", "array", "array", "array"]  # model, optimizer, scale, x, y
    models = f"{HERE / 'replay_models.py'}"
    doc = json.loads(cli("replay", flax_run, "--step", 3, "--model", f"{models}:flax_model",
                         "--loss-fn", f"{models}:flax_loss", "--json").output)
    assert doc["culprit"]["name"] == "mid" and doc["culprit"]["phase"] == "forward"
    assert doc["backward"]["fp16"]["replayed"] and doc["backward"]["fp16"]["loss_scale"] == 2.0 ** 15
    assert doc["backward"]["bf16"]["first_nonfinite"] is None
    without = json.loads(cli("replay", flax_run, "--step", 3, "--model", f"{models}:flax_model", "--json").output)
    assert "--loss-fn" in without["backward"]["fp16"]["error"]


@pytest.fixture(scope="module")
def flax_grad_run(tmp_path_factory):
    """`flax_sqrt_model` with targets near 10 from step 3 on inputs of
    2.5e-7: the forward stays finite in float16, the backward overflows
    (the loss scale skips the step); step 3 saved by its number."""
    jnp = importlib.import_module("jax.numpy")
    nnx = importlib.import_module("flax.nnx")
    optax = importlib.import_module("optax")
    from recorders.flax_recorder import FlaxRecorder
    from recorders.host_bundle import BundleTriggers
    from test_flax_recorder import DynamicScale, train_step
    sys.path.insert(0, str(HERE))
    from replay_models import flax_sqrt_model

    run = tmp_path_factory.mktemp("flax_grad") / "run"
    model = flax_sqrt_model()
    optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
    rng = np.random.default_rng(0)
    x = jnp.asarray(np.abs(rng.standard_normal((8, 4))) * 0.1, jnp.float32)
    y = jnp.asarray(rng.standard_normal((8, 1)) * 0.1 + 10.0, jnp.float32)
    with FlaxRecorder(run, model, optimizer=optimizer, loss_scale=DynamicScale(2.0 ** 15),
                      bundles=BundleTriggers(steps=(3,))) as rec:
        step = rec.wrap(train_step)
        scale = jnp.float32(2.0 ** 15)
        for batch in [x] * 3 + [jnp.full((8, 4), 2.5e-7, jnp.float32)] * 2:
            scale = step(model, optimizer, scale, batch, y)["loss_scale"]
    return run


def test_flax_backward_replay_names_the_module_whose_backward_overflows(flax_grad_run):
    models = f"{HERE / 'replay_models.py'}"
    doc = json.loads(cli("replay", flax_grad_run, "--step", 3, "--model", f"{models}:flax_sqrt_model",
                         "--loss-fn", f"{models}:flax_loss", "--json").output)
    # The last module in the backward whose own backward breaks: d2's bias
    # gradient, a sum over the batch of scaled gradients, passes 65504.
    assert doc["culprit"]["name"] == "d2" and doc["culprit"]["phase"] == "backward"
    assert "variable-gradient" in doc["culprit"]["reason"]
    assert doc["reproduced"] is True and "skipped" in doc["fidelity"]["basis"]
    phases = {(m["name"], m["phase"]): m["status"]["fp16"] for m in doc["modules"]}
    assert all(v == "ok" for (_, phase), v in phases.items() if phase == "forward")
    assert (phases[("d2", "backward")], phases[("root", "backward")], phases[("d1", "backward")]) == (
        "broken", "broken", "inputs_nonfinite")
    assert doc["culprits"]["bf16"] is None


def test_summary_points_to_the_replay(flax_run):
    doc = json.loads(cli("summary", flax_run, "--json").output)
    assert doc["replay_command"].startswith(f"amp-postmortem replay {flax_run} --step 3 --model")


@pytest.mark.parametrize("args, words", [
    ([], "the replay needs the model"),
    (["--step", 9, "--model", "x.py:f"], "no bundle for step 9"),
    (["--step", 3, "--model", "nowhere.py:f"], "does not exist"),
    (["--step", 3, "--model", "tests/replay_models.py:flax_model", "--anomaly"], "--anomaly is for PyTorch runs"),
    (["--step", 3, "--model", "tests/replay_models.py:keras_model"], "not an nnx.Module"),
])
def test_bad_input_is_one_line_and_exit_2(flax_run, args, words):
    result = cli("replay", flax_run, *args)
    assert result.exit_code == 2, result.output
    assert words in result.output and "Traceback" not in result.output


# ------------------------------------------------------ the bundle format
def _bundle(tmp_path, arrays=None):
    arrays = arrays or {"param/w": np.arange(6, dtype=np.float32).reshape(2, 3),
                        "input/x.0": np.ones((2, 2), np.float16)}
    meta = {"framework": {"name": "flax", "version": None, "backend": None}, "reason": "request",
            "reasons": ["request"], "params": {"names": ["w"], "exact": True},
            "inputs": {"args": [{"kind": "array", "name": "input/x.0"}], "kwargs": []}}
    write_bundle(tmp_path, rank=0, step=7, meta=meta, arrays=arrays)
    return tmp_path / "bundles" / "step=7" / "rank=0"


def test_arrays_round_trip_bit_exact_with_bfloat16(tmp_path):
    ml_dtypes = importlib.import_module("ml_dtypes")
    bf = np.array([1.5, -3.25, 65504.0, 1e30], dtype=ml_dtypes.bfloat16)
    path = _bundle(tmp_path, {"param/w": bf, "input/x.0": np.ones((2, 2), np.float16)})
    b = load_array_bundle(path)
    assert b.meta["arrays"]["param/w"]["dtype"] == "bfloat16"
    assert b.params["w"].tolist() == bf.astype(np.float32).tolist()
    assert b.inputs()[0][0].dtype == np.float16


def test_a_tampered_array_file_is_refused_before_it_is_parsed(tmp_path):
    path = _bundle(tmp_path)
    data = bytearray((path / "arrays.npz").read_bytes())
    data[-30] ^= 0xFF
    (path / "arrays.npz").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="fails its sha256"):
        load_array_bundle(path)


def test_an_object_array_needing_pickle_is_refused(tmp_path):
    import hashlib
    import io
    path = _bundle(tmp_path)
    buf = io.BytesIO()
    np.savez(buf, a0=np.array([{"x": 1}], dtype=object), a1=np.ones((2, 2), np.float16))
    (path / "arrays.npz").write_bytes(buf.getvalue())
    meta = json.loads((path / "bundle.json").read_text())
    meta["files"]["arrays.npz"] = {"bytes": len(buf.getvalue()), "sha256": hashlib.sha256(buf.getvalue()).hexdigest()}
    from recorders.format.plain import json_checksum
    meta["checksum"] = json_checksum(meta)
    (path / "bundle.json").write_text(json.dumps(meta))
    with pytest.raises(BundleError, match="without pickle"):
        load_array_bundle(path)


def test_an_edited_bundle_json_is_refused(tmp_path):
    path = _bundle(tmp_path)
    meta = json.loads((path / "bundle.json").read_text())
    meta["step"] = 8
    (path / "bundle.json").write_text(json.dumps(meta))
    with pytest.raises(BundleError, match="checksum"):
        load_array_bundle(path)


def test_triggers_fire_once_each_within_the_cap():
    t = BundleTriggers(max_bundles=2, steps=[5])
    assert t.reasons(0, 1.0, False) == []
    assert t.reasons(1, float("nan"), True) == ["nonfinite_loss", "nonfinite_tensor"]
    assert t.reasons(2, float("nan"), True) == []
    assert t.reasons(5, 1.0, False) == ["step_list"]
    assert t.reasons(6, 1.0, False) == [] and t.saved == 2


def test_reading_a_bundle_imports_no_framework(tmp_path):
    path = _bundle(tmp_path)
    code = ("import sys; from amp_postmortem.reading.array_bundle import load_array_bundle; "
            f"load_array_bundle({str(path)!r}); "
            "print([m for m in ('torch', 'tensorflow', 'keras', 'jax', 'flax') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=HERE.parent, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


# ------------------------------- the other commands read a Flax run as is
def test_compare_report_watch_and_export_read_a_flax_run(flax_run, tmp_path):
    compared = cli("compare", flax_run, flax_run, "--json")
    assert compared.exit_code == 0, compared.output
    watched = cli("watch", flax_run, "--fail-on", "critical", "--json")
    assert watched.exit_code == 1, watched.output
    finding = json.loads(watched.output.splitlines()[-2])
    assert (finding["kind"], finding["step"], finding["layer"]) == ("nonfinite", 3, "mid")
    importlib.import_module("plotly")
    page = tmp_path / "report.html"
    reported = cli("report", flax_run, "-o", page)
    assert reported.exit_code == 0 and "mid" in page.read_text(), reported.output
    importlib.import_module("tensorboard")
    exported = cli("export", "tensorboard", flax_run, "--logdir", tmp_path / "tb")
    assert exported.exit_code == 0 and "of 5 step(s)" in exported.output, exported.output
