"""The snippets of docs/RECORDER.md "Attach to Keras or Flax" run as printed, on
tiny CPU float16 models, and write the runs they promise. Keras runs in a
process of its own (it picks its backend at import); a planted `exp`
overflows float16 (Keras: from the first step, as `fit` shuffles; Flax:
at step 3), and `summary` traces it to its layer and step."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from amp_postmortem.cli import main
from test_readme import RECORDER, section_snippets

HERE = Path(__file__).resolve().parent
HEADING = "## Attach to Keras or Flax"


def _snippets() -> dict:
    blocks = section_snippets(RECORDER, HEADING)
    return {("keras" if "KerasRecorder" in "\n".join(b.lines) else "flax"): b for b in blocks}


def _nonfinite(run_dir) -> dict:
    result = CliRunner().invoke(main, ["summary", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    return {f["kind"]: f for f in json.loads(result.output)["findings"]}["nonfinite"]


def test_recorder_guide_has_a_keras_and_a_flax_snippet():
    snippets = _snippets()
    assert set(snippets) == {"keras", "flax"}
    assert len(snippets["keras"].lines) <= 3  # the "at most three lines to attach"


def test_keras_snippet_records_model_fit(tmp_path):
    importlib.import_module("keras")
    importlib.import_module("jax")
    block = _snippets()["keras"]
    setup = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(HERE)!r}); sys.path.insert(0, {str(HERE.parent)!r})
        import keras, numpy as np
        import keras_runs
        keras.mixed_precision.set_global_policy("mixed_float16")
        keras.utils.set_random_seed(0)
        model = keras_runs.model(keras_runs.Blowup(name="blowup"))
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3)), loss="mse")
        x = np.random.default_rng(0).standard_normal((64, 4)).astype("float32") * 100.0  # exp overflows
        y = np.zeros((64, 1), "float32")
    """)
    code = setup + "\n".join(block.lines)
    env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((tmp_path / "runs" / "keras" / "manifest.json").read_text())
    assert manifest["framework"]["name"] == "keras"
    steps = pd.read_parquet(tmp_path / "runs" / "keras" / "rank=0" / "steps")
    assert list(steps["skipped"]) == [True, True]  # fit's default batch of 32: two steps
    found = _nonfinite(tmp_path / "runs" / "keras")
    assert (found["layer"], found["step"]) == ("blowup", 0)


def test_flax_snippet_records_the_wrapped_step(tmp_path, monkeypatch):
    jnp = importlib.import_module("jax.numpy")
    nnx = importlib.import_module("flax.nnx")
    optax = importlib.import_module("optax")
    from test_flax_recorder import Blowup, DynamicScale, Net, train_step

    block = _snippets()["flax"]
    monkeypatch.chdir(tmp_path)
    model = Net(Blowup(), nnx.Rngs(0))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 4)) * 0.1, jnp.float32)
    y = jnp.asarray(rng.standard_normal((8, 1)) * 0.1, jnp.float32)
    namespace = {"model": model, "optimizer": nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param),
                 "dynamic_scale": DynamicScale(2.0 ** 15), "scale": jnp.float32(2.0 ** 15),
                 "train_step": train_step, "loader": [(x, y)] * 3 + [(x * 1000.0, y)] * 3}
    exec(compile("\n".join(block.lines), f"RECORDER.md:{block.line}", "exec"), namespace)
    manifest = json.loads((tmp_path / "runs" / "flax" / "manifest.json").read_text())
    assert manifest["framework"]["name"] == "flax"
    assert [b["step"] for b in manifest["bundles"]] == [3]
    found = _nonfinite(tmp_path / "runs" / "flax")
    assert (found["layer"], found["step"]) == ("mid", 3)
