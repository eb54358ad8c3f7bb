"""`compare`: where two recorded runs of the same model and data part.
Run B is run A (same seed, same data, the real recorder) with `block.boom`
multiplying by 10 from step 6 on. The noise floor and the persistence rule
are checked on a float32 run against its float16 twin with nothing planted
(every difference is rounding), on a one-step blip and on a one-step NaN."""
from __future__ import annotations

import json

import pandas as pd
import pytest
from click.testing import CliRunner

from amp_postmortem.analyses.compare import compare_runs
from amp_postmortem.cli import main
from amp_postmortem.errors import OptionError
from amp_postmortem.reading.loader import load_run
from conftest import record_run
from tiny_models import recorder_at, train

DIVERGENCE_STEP = 6


def _boom_from(step, model, x):
    model.block.boom.gain = 10.0 if step >= DIVERGENCE_STEP else 1.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    # lr 0: the planted gain is not trained away, so the loss stays apart
    # for the default 3 steps in a row
    kw = dict(steps=10, full_every=1, scaler_kwargs={"init_scale": 2.0 ** 8}, lr=0.0)
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
    with pytest.raises(OptionError, match="threshold 0 must be a positive relative difference"):
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


class ShiftNet:
    """A scalar `shift` added before a LayerNorm: LayerNorm(x + c) does not
    depend on c, so its gradient is zero up to rounding (as an attention's
    key bias is for softmax)."""

    @staticmethod
    def build():
        import torch
        import torch.nn as nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.inp = nn.Linear(4, 8)
                self.shift = nn.Parameter(torch.zeros(1))
                self.norm = nn.LayerNorm(8)
                self.head = nn.Linear(8, 1)

            def forward(self, x):
                return self.head(self.norm(self.inp(x) + self.shift))

        torch.manual_seed(0)
        return Net()


def _record_shift_net(path, *, amp: bool, steps: int = 8):
    import torch

    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(steps)]
    # lr 0: same weights, so every difference between the runs is rounding
    train(ShiftNet.build(), data, recorder=recorder_at(path, full_every=1), lr=0.0,
          dtype=torch.float16 if amp else None, scaler={"init_scale": 2.0 ** 8} if amp else None)
    return path


@pytest.fixture(scope="module")
def rounding_only(tmp_path_factory):
    root = tmp_path_factory.mktemp("rounding")
    return _record_shift_net(root / "fp32", amp=False), _record_shift_net(root / "fp16", amp=True)


def test_a_gradient_that_is_zero_up_to_rounding_does_not_part(rounding_only):
    fp32, fp16 = (load_run(p) for p in rounding_only)
    # The planted noise is there: the shift's gradient is a rounding residue
    # whose two runs differ by far more than the threshold...
    from amp_postmortem.analyses.compare import _layer_values
    a = _layer_values(fp32, [0]).set_index(["name", "kind"]).loc[("shift", "param_grad")]
    b = _layer_values(fp16, [0]).set_index(["name", "kind"]).loc[("shift", "param_grad")]
    top = _layer_values(fp32, [0]).query("kind == 'param_grad'")["norm"].max()
    assert a["norm"] < 1e-6 * top and abs(b["norm"] - a["norm"]) / a["norm"] > 0.1
    # ...and nothing parts: same weights, rounding only
    r = compare_runs(fp32, fp16, persist=1)
    assert r.divergence_step is None and r.first_layers == [] and r.table().empty
    shift = r.layers[(r.layers["name"] == "shift") & (r.layers["kind"] == "param_grad")].iloc[0]
    assert pd.isna(shift["parted_step"]) and shift["max_rel_diff"] == 0.0


def _blip(step, model, x):
    model.block.boom.gain = 10.0 if step == 4 else 1.0


def _nan_at_5(step, model, x):
    if step == 5:
        x[0, 0] = float("nan")


@pytest.fixture(scope="module")
def one_step_faults(tmp_path_factory):
    root = tmp_path_factory.mktemp("one_step")
    kw = dict(steps=10, full_every=1, scaler_kwargs={"init_scale": 2.0 ** 8}, lr=0.0)
    return (record_run(root / "baseline", **kw), record_run(root / "boom_x10_at_step_4_only", plant=_blip, **kw),
            record_run(root / "nan_input_at_step_5", plant=_nan_at_5, **kw))


def test_a_one_step_blip_is_not_a_parting_unless_persist_is_1(one_step_faults):
    a, blip, _ = (load_run(p) for p in one_step_faults)
    r = compare_runs(a, blip)
    assert r.persist == 3 and r.divergence_step is None and r.first_layers == []
    once = compare_runs(a, blip, persist=1)
    assert once.first_layers[0] == {"name": "block.boom", "kind": "activation"}
    assert once.layers["parted_step"].dropna().min() == 4


def test_a_nan_in_one_run_parts_at_once_and_json_says_so_without_infinity(one_step_faults):
    a, _, nan = one_step_faults
    r = compare_runs(load_run(a), load_run(nan))
    assert r.divergence_step == 5 and r.loss["one_side_nonfinite"] is True
    first = r.layers.iloc[0]
    assert (first["name"], first["kind"], first["parted_step"]) == ("inp", "activation", 5)
    assert first["one_side_nonfinite"] and first["nonfinite_step"] == 5
    # the skipped step's overflowed gradients are the scaler's business: not compared
    assert r.layers[r.layers["kind"] != "activation"]["parted_step"].isna().all()
    res = CliRunner().invoke(main, ["compare", str(a), str(nan), "--json"])
    assert res.exit_code == 0, res.output
    assert "Infinity" not in res.stdout and "NaN" not in res.stdout
    doc = json.loads(res.stdout)
    assert doc["loss"]["rel_diff"] is None and doc["loss"]["one_side_nonfinite"] is True
    row = doc["layers"][0]
    assert row["rel_diff"] is None and row["one_side_nonfinite"] is True and row["value_b"] is None
    # the largest relative difference where both runs are finite: a number
    # (0 here: away from step 5 the two runs are the same)
    assert row["max_rel_diff"] == 0.0 and row["nonfinite_step"] == 5
