"""`rerun`: a saved window of steps trained again under a remedy. Truth from
training the same job again (`window_runs.train`), never from the rerun."""
from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

import amp_postmortem as api
import window_runs as runs
from amp_postmortem.cli import main

GAIN = "tests/window_runs.py:gain_net"
LINEAR = "tests/window_runs.py:linear_net"


def test_as_recorded_the_rerun_fails_where_the_run_failed_and_float32_carries_the_window():
    truth_fp32 = runs.train(runs.gain_net(), runs.precision_batch, lr=runs.PRECISION_LR, autocast=False)
    assert all(math.isfinite(v) for v in truth_fp32)  # the planted fault is float16's only
    run = runs.precision_run()
    recorded = api.rerun(run, model=GAIN)
    assert recorded.precision == recorded.recorded_precision == "fp16"
    assert not recorded.carries and recorded.first_nonfinite_step == runs.SHIFT_STEP
    assert recorded.recorded_first_nonfinite_step == runs.SHIFT_STEP
    # Before the failure the re-run is the recorded run, step for step.
    before = [s for s in recorded.steps if s.step < runs.SHIFT_STEP]
    assert before
    for s in before:
        assert s.finite and s.loss == pytest.approx(s.recorded_loss, rel=1e-5)
    fp32 = api.rerun(run, model=GAIN, precision="fp32")
    assert fp32.carries and fp32.first_nonfinite_step is None
    assert fp32.window_steps[0] <= runs.SHIFT_STEP < fp32.window_steps[1]
    assert "stays finite over all" in "\n".join(fp32.lines())


def test_float32_shares_a_runaway_learning_rate():
    truth = runs.train(runs.linear_net(), runs.linear_batch, lr=runs.INSTABILITY_LR, autocast=False)
    assert not all(math.isfinite(v) for v in truth)
    r = api.rerun(runs.instability_run(), model=LINEAR, precision="fp32")
    assert not r.carries and r.first_nonfinite_step is not None
    assert "does NOT stay finite: non-finite at step" in "\n".join(r.lines())


def test_a_smaller_learning_rate_carries_the_runaway_window():
    truth = runs.train(runs.linear_net(), runs.linear_batch, lr=runs.INSTABILITY_LR * 1e-9)
    assert all(math.isfinite(v) for v in truth)
    r = api.rerun(runs.instability_run(), model=LINEAR, lr_scale=1e-9)
    assert r.carries and r.lr_scale == 1e-9


def test_from_a_later_step_the_prefix_reruns_as_recorded():
    first = api.rerun(runs.precision_run(), model=GAIN, steps=1).from_step
    r = api.rerun(runs.precision_run(), model=GAIN, precision="fp32", from_step=first + 1, steps=3)
    assert [(s.step, s.remedied) for s in r.steps] == [(first, False), (first + 1, True), (first + 2, True),
                                                       (first + 3, True)]
    assert (r.from_step, r.to_step) == (first + 1, first + 3) and r.carries


def test_cli_json_and_one_line_errors(tmp_path):
    runner = CliRunner()
    got = runner.invoke(main, ["rerun", str(runs.precision_run()), "--precision", "fp32", "--model", GAIN, "--json"])
    assert got.exit_code == 0, got.output
    doc = json.loads(got.stdout)
    assert doc["carries"] is True and doc["precision"] == "fp32" and doc["steps"][0]["remedied"] is True
    bad = runner.invoke(main, ["rerun", str(runs.instability_run(0)), "--model", LINEAR])
    assert bad.exit_code == 2 and "no counterfactual window" in bad.output and "window_steps" in bad.output
    outside = runner.invoke(main, ["rerun", str(runs.precision_run()), "--from", "99", "--model", GAIN])
    assert outside.exit_code == 2 and "outside the saved windows" in outside.output
    no_model = runner.invoke(main, ["rerun", str(runs.precision_run())])
    assert no_model.exit_code == 2 and "--model" in no_model.output


def test_an_optimizer_outside_the_list_is_never_imported():
    import torch

    from amp_postmortem.errors import ModelSpecError
    from amp_postmortem.whatif.rerun import rerun_window
    from amp_postmortem.reading.window import find_window
    w = find_window(runs.precision_run())
    w.optimizer = dict(w.optimizer, **{"class": "os.system"})
    with pytest.raises(ModelSpecError, match="--optimizer"):
        rerun_window(runs.precision_run(), model=GAIN, window=w)
    r = rerun_window(runs.precision_run(), model=GAIN, window=w, precision="fp32",
                     optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=runs.PRECISION_LR))
    assert r.carries and r.optimizer == "SGD (yours)"
