"""Lost updates' remedies verified by re-running the saved window (issue
42 item 3): `whatif/update_trials.py` runs the trials,
`analyses/update_remedies.py` judges them, `rerun --param-dtype` and
`--update-rounding` repeat them. The job (`silent_runs`): a language model
cast to bfloat16, AdamW at lr 1e-5, keeping a window of steps from its
first. The truth is measured here, apart from the product: the same job
trained by hand over the window's steps, as recorded and under each
remedy, its weights compared before and after every step, and its loss
measured in float32 on the window's batches."""
from __future__ import annotations

import json
import math

import pytest
import torch

import amp_postmortem as ap
import silent_runs as runs
from amp_postmortem.analyses.update_remedies import UpdateTrial, Verification, judge
from amp_postmortem.analyses.updates import UpdateRemedy
from amp_postmortem.errors import OptionError


def _window(path) -> list:
    spans = json.loads(next((path / "windows").rglob("window.json")).read_text())
    return [spans["first_step"], spans["last_step"]]


def _truth(steps: list, *, master: bool = False, lr_scale: float = 1.0) -> dict:
    """The job trained by hand over `steps` (from its first step): bfloat16
    weights, or float32 ones under bfloat16 autocast (`master`); the share
    of non-zero-gradient positions each step left unchanged, and the mean
    float32 loss of the steps' batches before and after."""
    model = runs.lm_model(bf16_weights=True)
    if master:
        model = model.float()
    batches = [runs.lm_batches(runs.LM_STEPS)[s] for s in steps]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5 * lr_scale)

    def window_loss():
        probe = runs.TinyLM()
        probe.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        with torch.no_grad():
            return sum(float(probe(b[:, :-1], b[:, 1:])) for b in batches) / len(batches)

    before = window_loss()
    asked = kept = 0
    for seq in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=master):
            model(seq[:, :-1], seq[:, 1:]).backward()
        old = [p.detach().clone() for p in model.parameters()]
        opt.step()
        for p, o in zip(model.parameters(), old):
            live = p.grad != 0
            asked += int(live.sum())
            kept += int((live & (p.detach() == o)).sum())
    return {"lost_share": kept / asked, "loss_drop": before - window_loss()}


@pytest.fixture(scope="module")
def checked():
    """summary and recommend given the model: the window re-run with each remedy."""
    path = runs.bf16_weights_window_run()
    s = ap.summary(str(path), model=runs.TinyLM)
    return path, s, next(f for f in s.findings if f.kind == "lost_updates")


def test_each_remedy_is_verified_by_rerunning_the_window(checked):
    path, s, f = checked
    window = _window(path)
    steps = list(range(window[0], window[1] + 1))
    recorded, master = _truth(steps), _truth(steps, master=True)
    v = f.evidence["verification"]
    assert v["window"] == window
    base = v["as_recorded"]
    # The as-recorded re-run loses what the job lost, and learns what it learnt.
    assert recorded["lost_share"] > 0.5 and abs(base["lost_share"] - recorded["lost_share"]) < 0.05
    assert math.isclose(base["loss_drop"], recorded["loss_drop"], rel_tol=0.3, abs_tol=1e-3)
    checks = {c["remedy"]: c for c in v["remedies"]}
    assert list(checks) == f.evidence["remedies"] == ["fp32_master_weights", "larger_learning_rate",
                                                       "stochastic_rounding"]
    # Float32 master weights: the truth keeps every update and learns far more than as recorded.
    assert master["lost_share"] < 0.01 and master["loss_drop"] > 2 * recorded["loss_drop"]
    m = checks["fp32_master_weights"]
    assert m["verified"] and m["status"] == "verified" and m["trial"]["param_dtype"] == "float32"
    assert m["trial"]["lost_share"] < 0.01
    assert math.isclose(m["trial"]["loss_drop"], master["loss_drop"], rel_tol=0.3)
    # A larger learning rate: the factor tried keeps the updates by hand too.
    lr = checks["larger_learning_rate"]
    scaled = _truth(steps, lr_scale=lr["trial"]["lr_scale"])
    assert lr["trial"]["lr_scale"] > 1 and scaled["lost_share"] < 0.25
    assert lr["verified"] == (scaled["loss_drop"] > 1.5 * recorded["loss_drop"])
    # Stochastic rounding keeps the updates in expectation: the loss falls about as with float32 weights.
    sr = checks["stochastic_rounding"]
    assert sr["verified"] and sr["trial"]["update_rounding"] == "stochastic"
    assert 0.5 * master["loss_drop"] < sr["trial"]["loss_drop"] < 1.5 * master["loss_drop"]
    assert "verified by re-running steps" in f.message and "NOT verified" not in f.message
    assert f.next_command.startswith("amp-postmortem rerun ") and "--param-dtype float32" in f.next_command


def test_recommend_gives_each_remedy_with_its_verification():
    path = runs.bf16_weights_window_run()
    r = ap.recommend(str(path), model=runs.TinyLM)
    kinds = r.kinds()
    assert {"fp32_master_weights", "larger_learning_rate", "stochastic_rounding"} <= set(kinds)
    assert "no_change" not in kinds
    master = r.get("fp32_master_weights")
    assert master.verified and master.source.value == "replay"
    assert "torch.autocast" in master.code and master.data["verification"]["trial"]["lost_share"] < 0.01
    lr = r.get("larger_learning_rate")
    assert f'*= {lr.data["lr_scale"]:g}' in lr.code
    doc = r.to_dict()
    assert [x["kind"] for x in doc["recommendations"]] == kinds


def test_nothing_is_verified_without_a_window_or_a_model():
    # No window saved: each remedy says so, never "verified".
    s = ap.summary(str(runs.bf16_weights_run()), model=runs.TinyLM)
    f = next(f for f in s.findings if f.kind == "lost_updates")
    assert {c["status"] for c in f.evidence["verification"]["remedies"]} == {"no_window"}
    assert not any(c["verified"] for c in f.evidence["verification"]["remedies"])
    assert "saved no window" in f.message
    r = ap.recommend(str(runs.bf16_weights_run()))
    assert r.kinds() == ["fp32_master_weights", "larger_learning_rate", "stochastic_rounding"]
    assert not any(x.verified for x in r.recommendations) and all("no window" in x.why for x in r.recommendations)
    # A window, no model: how to verify it.
    s = ap.summary(str(runs.bf16_weights_window_run()))
    f = next(f for f in s.findings if f.kind == "lost_updates")
    assert {c["status"] for c in f.evidence["verification"]["remedies"]} == {"no_model"}
    assert "--model SPEC" in f.next_command


def test_a_healthy_bf16_autocast_run_runs_no_trial():
    s = ap.summary(str(runs.bf16_autocast_run()), model=runs.TinyLM)
    assert [f.kind for f in s.findings] == ["healthy"]
    assert ap.recommend(str(runs.bf16_autocast_run())).kinds() == ["no_change"]


def _trial(remedy, lost, before, after, finite=True):
    return UpdateTrial(remedy, "fp32", "bfloat16", 1.0, "nearest", finite, None if finite else 3, lost, before,
                       after, "")


def test_the_verdict_rests_on_kept_updates_and_a_loss_that_falls_further():
    base = _trial(None, 0.9, 4.0, 3.99)
    master = UpdateRemedy.FP32_MASTER_WEIGHTS
    assert judge(_trial(master, 0.0, 4.0, 3.9), base) is Verification.VERIFIED
    assert judge(_trial(master, 0.3, 4.0, 3.9), base) is Verification.UPDATES_STILL_LOST
    assert judge(_trial(master, 0.0, 4.0, 3.989), base) is Verification.NO_GAIN   # kept, learns no more
    assert judge(_trial(master, 0.0, 4.0, 4.5), base) is Verification.NO_GAIN
    assert judge(_trial(master, None, 4.0, float("nan"), finite=False), base) is Verification.NONFINITE
    # Stochastic rounding leaves most steps' weights as they were: judged on the loss.
    assert judge(_trial(UpdateRemedy.STOCHASTIC_ROUNDING, 0.9, 4.0, 3.9), base) is Verification.VERIFIED
    # A re-run that does not lose the updates as the run did proves nothing.
    assert judge(_trial(master, 0.0, 4.0, 3.9), _trial(None, 0.05, 4.0, 3.99)) is Verification.NOT_REPRODUCED


def test_rerun_holds_the_recorded_dtypes_and_repeats_each_trial(tmp_path):
    from click.testing import CliRunner

    from amp_postmortem.cli import main
    path = runs.bf16_weights_window_run()
    window = _window(path)
    truth = _truth(list(range(window[0], window[1] + 1)))
    spec = "tests/silent_runs.py:TinyLM"  # builds float32: the re-run holds the window's bfloat16
    out = CliRunner().invoke(main, ["rerun", str(path), "--model", spec, "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["param_dtype"] == "recorded" and doc["recorded_param_dtype"] == "bfloat16"
    assert abs(doc["lost_share"] - truth["lost_share"]) < 0.05 and "lost_share" in doc["steps"][0]
    out = CliRunner().invoke(main, ["rerun", str(path), "--model", spec, "--precision", "bf16", "--param-dtype",
                                    "float32", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["param_dtype"] == "float32" and json.loads(out.output)["lost_share"] < 0.01
    out = CliRunner().invoke(main, ["rerun", str(path), "--model", spec, "--update-rounding", "up"])
    assert out.exit_code == 2
    with pytest.raises(OptionError, match="param_dtype .float64."):
        ap.rerun(str(path), model=runs.TinyLM, param_dtype="float64")
