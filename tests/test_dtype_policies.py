"""Dtype policies that disagree (amp_postmortem/analyses/dtype_policies.py):
real Keras runs made by `tests/keras_policy_runs.py` in a process of their
own, the manifest's `dtype_policies` written by the recorder at attach
time, the `dtype_policy_mismatch` finding of `summary` on the run whose
policies disagree, and none on the run whose do not."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from amp_postmortem.cli import main
from amp_postmortem.names import FINDING_KINDS

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    importlib.import_module("keras")
    importlib.import_module("jax")
    out = tmp_path_factory.mktemp("keras_policies")
    env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run([sys.executable, str(HERE / "keras_policy_runs.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def findings(run_dir) -> dict:
    result = CliRunner().invoke(main, ["summary", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    return {f["kind"]: f for f in json.loads(result.output)["findings"]}


def test_the_manifest_holds_each_layers_policy(runs):
    manifest = json.loads((runs / "disagree" / "manifest.json").read_text())
    assert manifest["dtype_policies"] == {
        "model": {"policy": "mixed_float16", "compute_dtype": "float16", "variable_dtype": "float32"},
        "layers": [
            {"name": "d1", "policy": "float16", "compute_dtype": "float16", "variable_dtype": "float16"},
            {"name": "bf", "policy": "mixed_bfloat16", "compute_dtype": "bfloat16", "variable_dtype": "float32"},
            {"name": "d2", "policy": "mixed_float16", "compute_dtype": "float16", "variable_dtype": "float32"}]}
    assert {p["name"]: p["dtype"] for p in manifest["params"]}["d1.kernel"] == "float16"


def test_summary_names_the_layers_and_the_remedy(runs):
    assert "dtype_policy_mismatch" in FINDING_KINDS
    found = findings(runs / "disagree")["dtype_policy_mismatch"]
    assert (found["severity"], found["step"], found["layer"]) == ("warning", None, "d1")
    assert found["evidence"] == {
        "model_policy": "mixed_float16", "model_compute_dtype": "float16",
        "problems": ["low_precision_variables", "layer_policy_differs"],
        "low_precision_variables": {"d1": ["float16"]}, "differing_layers": {"bf": "mixed_bfloat16"}}
    assert found["next_command"].startswith('keras.mixed_precision.set_global_policy("mixed_float16")')
    text = CliRunner().invoke(main, ["summary", str(runs / "disagree")]).output
    assert "variables held in low precision in d1 (float16)" in text
    assert "bf (mixed_bfloat16)" in text and "Remedy: one mixed policy" in text


def test_fail_on_takes_the_kind(runs):
    result = CliRunner().invoke(main, ["summary", str(runs / "disagree"), "--fail-on", "dtype_policy_mismatch"])
    assert result.exit_code == 1 and "Traceback" not in result.output  # 1: a --fail-on finding


def test_a_float32_layer_on_purpose_is_no_disagreement(runs):
    assert set(findings(runs / "agree")) == {"healthy"}
