"""A remedy is verified over the saved window, not on one step: `fix`'s
fix that saves the saved steps but not the steps that follow says where it
fails. Truth from training the job again with the fix applied."""
from __future__ import annotations

import math

import amp_postmortem as api
import window_runs as runs

LINEAR = "tests/window_runs.py:linear_net"


def test_a_fix_that_saves_the_saved_step_but_not_the_next_is_not_verified():
    from recorders.fp32 import keep_fp32
    model = runs.linear_net()
    keep_fp32(model.lin)
    truth = runs.train(model, runs.linear_batch, lr=runs.INSTABILITY_LR)
    bad = next(i for i, v in enumerate(truth) if not math.isfinite(v))  # the patched job still fails
    f = api.fix(runs.instability_run(), step=1, model=LINEAR)
    assert f.fix == ["lin"] and 1 in f.saved_steps  # the single-step replay says it saves step 1
    c = f.to_dict()["window_check"]
    assert (c["status"], c["verified"]) == ("fails", False)
    assert c["failed_at"] == bad  # where the patched job itself fails
    text = "\n".join(f.lines())
    assert "NOT verified: with keep lin in float32 the re-run of the saved window" in text
    assert f"goes non-finite at step {c['failed_at']}" in text
    assert "verified over the saved window" not in text


def test_without_a_window_a_fix_is_verified_on_the_saved_step_only():
    f = api.fix(runs.instability_run(0), step=1, model=LINEAR)
    c = f.to_dict()["window_check"]
    assert (c["status"], c["verified"]) == ("no_window", False)
    assert "verified on the saved step only, not over the following steps" in "\n".join(f.lines())
