"""`compare`: where two recorded runs of the same model and data part.
Run B is run A (same seed, same data, the real recorder) with `block.boom`
multiplying by 10 from step 6 on."""
from __future__ import annotations

import json

import pandas as pd
import pytest
from click.testing import CliRunner

from amp_postmortem.analyses.compare import compare_runs
from amp_postmortem.cli import main
from amp_postmortem.loader import load_run
from conftest import record_run

DIVERGENCE_STEP = 6


def _boom_from(step, model, x):
    model.block.boom.gain = 10.0 if step >= DIVERGENCE_STEP else 1.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    kw = dict(steps=10, full_every=1, scaler_kwargs={"init_scale": 2.0 ** 8})
    a = record_run(root / "baseline", **kw)
    b = record_run(root / "boom_x10_from_step_6", plant=_boom_from, **kw)
    a2 = record_run(root / "baseline_again", **kw)
    return a, b, a2


def test_compare_finds_the_planted_divergence_step_and_layer(runs):
    a, b, _ = runs
    r = compare_runs(load_run(a), load_run(b))
    assert r.divergence_step == DIVERGENCE_STEP and r.common_steps == 10
    assert r.loss["rel_diff"] > 0.1
    first = r.layers.iloc[0]
    assert (first["name"], first["kind"], first["parted_step"]) == ("block.boom", "activation", DIVERGENCE_STEP)
    assert first["rel_diff"] == pytest.approx(9.0, rel=0.01)  # 10x the activation range
    assert r.first_layers[0] == {"name": "block.boom", "kind": "activation"}
    # Nothing parts before the planted step; the layer before Boom only later.
    assert r.layers["parted_step"].dropna().min() == DIVERGENCE_STEP
    fc = r.layers[(r.layers["name"] == "block.fc") & (r.layers["kind"] == "activation")].iloc[0]
    assert pd.isna(fc["parted_step"]) or fc["parted_step"] > DIVERGENCE_STEP
    grads = r.layers[r.layers["kind"] == "param_grad"]
    assert set(grads["metric"].dropna()) == {"grad_norm"}


def test_identical_runs_never_part_and_the_threshold_is_configurable(runs):
    a, b, a2 = runs
    same = compare_runs(load_run(a), load_run(a2))
    assert same.divergence_step is None and same.table().empty and same.first_layers == []
    loose = compare_runs(load_run(a), load_run(b), threshold=100.0)
    assert loose.divergence_step is None
    with pytest.raises(ValueError):
        compare_runs(load_run(a), load_run(b), threshold=0)


def test_cli_compare(runs):
    a, b, _ = runs
    res = CliRunner().invoke(main, ["compare", str(a), str(b), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["divergence_step"] == DIVERGENCE_STEP
    assert doc["first_layer"] == {"name": "block.boom", "kind": "activation"}
    assert doc["layers"][0]["parted_step"] == DIVERGENCE_STEP
    res = CliRunner().invoke(main, ["compare", str(a), str(b), "--threshold", "100"])
    assert res.exit_code == 0 and "never part" in res.output
    res = CliRunner().invoke(main, ["compare", str(a), str(b) + "-missing"])
    assert res.exit_code == 2 and res.output.startswith("Error:")
