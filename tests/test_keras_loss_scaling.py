"""A Keras train step that misuses its LossScaleOptimizer
(recorders/keras_loss_scaling.py, amp_postmortem/analyses/loss_scaling.py):
real custom `train_step`s made by `tests/keras_scaling_runs.py` in a
process per backend, recorded by `KerasRecorder`, read by `summary`.

TensorFlow: the factor between the gradients applied and the loss's own is
measured in the graph (the scale when right, 1 when the loss was never
scaled or the gradients were unscaled twice); JAX: the step's code alone
(`scale_loss` never called)."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

importlib.import_module("keras")

from amp_postmortem.analyses.loss_scaling import GradScaling, classify  # noqa: E402
from amp_postmortem.cli import main  # noqa: E402

HERE = Path(__file__).resolve().parent
SCALE = 2.0 ** 15


_MADE: dict = {}


def made(backend: str, tmp_path_factory) -> Path:
    """The runs of one backend, made once per test session."""
    if backend not in _MADE:
        importlib.import_module(backend)
        out = tmp_path_factory.mktemp(f"keras_scaling_{backend}")
        env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
        done = subprocess.run([sys.executable, str(HERE / "keras_scaling_runs.py"), str(out)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        _MADE[backend] = out
    return _MADE[backend]


@pytest.fixture(scope="module", params=["tensorflow", "jax"])
def runs(request, tmp_path_factory):
    return request.param, made(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def tf_runs(tmp_path_factory):
    """The mistakes a stateful `apply` makes possible (TensorFlow backend)."""
    return made("tensorflow", tmp_path_factory)


def summary(run_dir) -> dict:
    result = CliRunner().invoke(main, ["summary", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    return {f["kind"]: f for f in json.loads(result.output)["findings"]}


def loss_scaling(run_dir) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())["loss_scaling"]


def test_the_recorder_writes_how_the_step_used_the_scale(runs):
    backend, out = runs
    right, wrong = loss_scaling(out / "correct"), loss_scaling(out / "noscale")
    assert (right["custom_train_step"], right["scale_loss_calls"], right["applied_by"]) == (
        True, 1, "loss_scale_optimizer")
    assert (wrong["scale_loss_calls"], wrong["applied_by"]) == (0, "loss_scale_optimizer")
    if backend == "tensorflow":
        # Step 1 overflowed float16 at 32768 (Inf gradients: not measured).
        assert right["measured"] == [[0, SCALE, SCALE], [2, SCALE / 2, SCALE / 2], [3, SCALE / 2, SCALE / 2]]
        assert [m[1] for m in wrong["measured"]] == [1.0] * 4
    else:
        assert right["measured"] == wrong["measured"] == []


def test_a_step_that_never_scales_its_loss_is_named_with_its_fix(runs):
    backend, out = runs
    found = summary(out / "noscale")["loss_scaling_mistake"]
    assert found["severity"] == "error" and found["step"] == 0
    assert found["evidence"]["mistake"] == "loss_not_scaled"
    assert found["evidence"]["basis"] == ("measured" if backend == "tensorflow" else "step_code")
    assert "never scales its loss" in found["message"] and "32768 times too small" in found["message"]
    if backend == "tensorflow":
        assert found["evidence"]["factor"] == 1.0
        assert found["next_command"].startswith("inside the GradientTape: scaled_loss = "
                                                "self.optimizer.scale_loss(loss)")
    else:
        assert "keras.StatelessScope(state_mapping=" in found["next_command"]


def test_a_step_that_uses_the_scale_right_is_quiet(runs):
    _, out = runs
    assert "loss_scaling_mistake" not in summary(out / "correct")


def test_scaled_gradients_applied_by_the_inner_optimizer(tf_runs):
    out = tf_runs
    assert loss_scaling(out / "inner")["applied_by"] == "inner_optimizer"
    found = summary(out / "inner")["loss_scaling_mistake"]
    assert found["evidence"]["mistake"] == "scaled_gradients_applied"
    assert found["evidence"]["factor"] == SCALE
    assert "not on self.optimizer.inner_optimizer" in found["next_command"]


def test_gradients_unscaled_twice(tf_runs):
    out = tf_runs
    found = summary(out / "twice")["loss_scaling_mistake"]
    assert found["evidence"]["mistake"] == "unscaled_twice"
    assert found["evidence"]["scale_loss_calls"] == 1 and found["evidence"]["factor"] == 1.0
    assert "as they are" in found["next_command"]


def test_a_measured_factor_is_classified_against_the_scale():
    assert classify(32768.0, 32768.0) is GradScaling.SCALED
    assert classify(20000.0, 32768.0) is GradScaling.SCALED
    assert classify(1.3, 32768.0) is GradScaling.UNSCALED
    assert classify(300.0, 32768.0) is GradScaling.OTHER
    assert classify(1.0, 2.0) is GradScaling.OTHER  # too small a scale to tell
