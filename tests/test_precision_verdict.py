"""Precision or instability: decided by a float32 re-run of the saved
window, undetermined (with the command that decides it) otherwise. Truth
from training the same job again in float32 (`window_runs.train`)."""
from __future__ import annotations

import json
import math
import shlex

from click.testing import CliRunner

import amp_postmortem as api
import window_runs as runs
from amp_postmortem.cli import main

GAIN = "tests/window_runs.py:gain_net"
LINEAR = "tests/window_runs.py:linear_net"


def test_a_float16_only_overflow_is_a_precision_problem():
    assert all(math.isfinite(v) for v in runs.train(runs.gain_net(), runs.precision_batch, lr=runs.PRECISION_LR,
                                                    autocast=False))
    s = api.summary(runs.precision_run(), model=GAIN)
    v = s.to_dict()["precision_verdict"]
    assert (v["verdict"], v["basis"], v["verified"]) == ("precision", "fp32_rerun_finite", True)
    assert v["failure_step"] == runs.SHIFT_STEP and v["diverged_at"] is None
    assert "training_instability" not in s.kinds()
    assert "a precision problem, not training instability" in "\n".join(s.lines())


def test_an_instability_float32_shares_is_claimed_verified():
    truth = runs.train(runs.linear_net(), runs.linear_batch, lr=runs.INSTABILITY_LR, autocast=False)
    assert not all(math.isfinite(v) for v in truth)
    s = api.summary(runs.instability_run(), model=LINEAR)
    v = s.to_dict()["precision_verdict"]
    assert (v["verdict"], v["basis"], v["verified"]) == ("training_instability", "fp32_rerun_diverged", True)
    assert v["diverged_at"] is not None
    f = next(f for f in s.findings if f.kind == "training_instability")
    assert f.severity == "critical" and f.evidence["verdict"] == "training_instability"
    assert f.message.startswith("training instability, verified: a float32 re-run of steps")


def test_without_a_model_the_verdict_is_undetermined_and_its_command_decides_it():
    run = runs.instability_run()
    v = api.summary(run).to_dict()["precision_verdict"]
    assert (v["verdict"], v["basis"], v["verified"]) == ("undetermined", "no_model", False)
    command = v["command"].split(" (or ")[0]
    argv = shlex.split(command.replace("SPEC", LINEAR))
    assert argv[:3] == ["amp-postmortem", "rerun", str(run)]
    got = CliRunner().invoke(main, argv[1:] + ["--json"])
    assert got.exit_code == 0, got.output
    assert json.loads(got.stdout)["carries"] is False  # the command decides: float32 diverges too


def test_without_a_window_the_verdict_is_undetermined_even_with_a_model():
    run = runs.instability_run(0)
    for s in (api.summary(run), api.summary(run, model=LINEAR)):
        v = s.to_dict()["precision_verdict"]
        assert (v["verdict"], v["basis"], v["verified"]) == ("undetermined", "no_window", False)
        assert "window_steps=" in v["command"] and "compare" in v["command"]
        assert "precision or instability undetermined" in "\n".join(s.lines())


def test_a_suspected_instability_says_so():
    """The recorded evidence alone (the loss rose, activations grew) makes
    the finding suspected, never a claim that float32 would fail too."""
    from advice_runs import diverging_gpt_run
    from amp_postmortem.analyses.summary import summarize
    from amp_postmortem.reading.loader import load_run
    f = next(f for f in summarize(load_run(diverging_gpt_run())).findings if f.kind == "training_instability")
    assert f.evidence["verdict"] == "undetermined" and f.evidence["verification"]["basis"] == "no_window"
    assert f.message.startswith("suspected training instability (precision or instability undetermined")
    assert "float32 would fail too" not in f.message


def test_a_healthy_run_has_no_verdict():
    from whatif_runs import healthy_run
    assert api.summary(healthy_run()).to_dict()["precision_verdict"] is None


def test_a_window_that_cannot_be_rerun_leaves_the_verdict_undetermined_and_says_why(tmp_path):
    """A model without its loss (and no loss_fn): no verdict, and why."""
    import torch.nn as nn

    class Logits(nn.Module):  # the same weights, but it returns the prediction, not the loss
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x, y):
            return self.lin(x)

    from amp_postmortem.reading.loader import load_run
    from amp_postmortem.whatif.verdict import decide
    v = decide(load_run(runs.instability_run()), 1, model=Logits())
    assert (v.verdict.value, v.basis.value, v.verified) == ("undetermined", "rerun_failed", False)
    assert "--loss-fn" in v.why and "could not be re-run" in v.sentence()
