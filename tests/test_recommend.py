"""`recommend`: recommendations with their evidence, from the recorded
statistics and, with a model, from what-if replays of the run's bundle."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import whatif_runs as W
from amp_postmortem.advice import Source, recommend
from amp_postmortem.cli import main
from amp_postmortem.reading.loader import load_run


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_replayed_recommendations_for_a_module_overflow():
    r = recommend(load_run(W.attn_overflow_run()), model=W.AttnNet)
    assert r.replayed and r.step == 0
    assert r.kinds() == ["keep_fp32", "use_bf16", "scaler_settings"]
    keep = r.get("keep_fp32")
    assert keep.data["modules"] == ["scores"] and "keep_fp32(model.scores)" in keep.code
    assert r.get("use_bf16").data["avoids"] is True
    w = r.get("scaler_settings").data["window"]
    assert w["max_scale"] < W.RECORDED_SCALE  # with scores in fp32 the backward needs a lower scale
    for rec in r.recommendations:
        assert rec.evidence and rec.source is Source.REPLAY


def test_no_configuration_that_works_says_do_not_use_mixed_precision():
    r = recommend(load_run(W.root_cancel_run()), model=W.RootCancel)
    assert "avoid_mixed_precision" in r.kinds() and "keep_fp32" not in r.kinds()
    assert r.get("use_bf16").data["avoids"] is False
    assert any("bfloat16: non-finite" in e for e in r.get("avoid_mixed_precision").evidence)


def test_a_few_bad_samples_point_at_the_data_first():
    r = recommend(load_run(W.bad_samples_run()), model=W.AttnNet)
    assert r.kinds()[0] == "check_data" and r.get("check_data").data["bad_samples"] == [3, 11]
    assert "avoid_mixed_precision" not in r.kinds()


def test_a_healthy_step_needs_no_change():
    r = recommend(load_run(W.healthy_run()), model=W.AttnNet)
    assert r.kinds() == ["no_change"]
    assert "inside the replayed window" in r.get("no_change").evidence[0]


def test_recorded_statistics_alone_name_a_candidate_and_scaler_settings():
    r = recommend(load_run(W.attn_overflow_run()))
    assert not r.replayed and r.step is None
    keep = r.get("keep_fp32")
    assert keep.source is Source.RECORDED and keep.data["modules"] == ["scores"] and "fix" in keep.action
    assert r.get("scaler_settings").source is Source.RECORDED
    assert any("pass --model" in n for n in r.notes)


def test_cli_recommend_and_every_whatif_command_is_documented():
    res = CliRunner().invoke(main, ["recommend", str(W.attn_overflow_run()), "--model",
                                    f"{W.__file__}:AttnNet", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [x["kind"] for x in doc["recommendations"]] == ["keep_fp32", "use_bf16", "scaler_settings"]
    assert all(x["evidence"] for x in doc["recommendations"])
    assert {x["source"] for x in doc["recommendations"]} == {"replay"}  # the enum's value: the --json string
    res = CliRunner().invoke(main, ["recommend", str(W.attn_overflow_run())])
    assert res.exit_code == 0 and "[keep_fp32] candidate: keep scores" in res.output
    for name in ("fix", "scale-window", "bisect", "compare", "recommend"):
        help_text = CliRunner().invoke(main, [name, "--help"]).output
        assert "amp-postmortem " + name in help_text and "--json" in help_text


# ------------------------------------------------ which bundle, which steps
def _three_bundles_batch(step):
    """Step 1: targets so large that the scaled loss gradient overflows
    float16 (a skipped step, finite loss); step 2: samples 3 and 11 of the
    batch overflow the forward (NaN loss)."""
    x, y = W.batch(step, bad_step=2)
    return x, (y + 1e5 if step == 1 else y)


@pytest.fixture(scope="module")
def three_bundles_run(tmp_path_factory):
    """Bundles at step 0 (`step_list`), 1 (`skipped`) and 2 (`nonfinite_loss`)."""
    torch.manual_seed(0)
    return W.record(tmp_path_factory.mktemp("bundles") / "step_list_skipped_nonfinite", W.AttnNet(), steps=3,
                    batch_fn=_three_bundles_batch, bundle_steps=(0,), settle_steps=0)


def test_the_default_bundle_is_the_earliest_nonfinite_one_not_the_first(three_bundles_run):
    from amp_postmortem.analyses.bundle_choice import pick_bundle
    run = load_run(three_bundles_run)
    reasons = {b["step"]: b["reasons"] for b in run.manifest["bundles"]}
    assert reasons[0] == ["step_list"] and reasons[1] == ["skipped"] and "nonfinite_loss" in reasons[2]
    assert pick_bundle(run)[:2] == (2, 0)
    r = recommend(run, model=W.AttnNet)
    assert r.replayed and r.step == 2
    assert any("replayed the bundle of step 2 (saved for nonfinite_loss" in n for n in r.notes)
    help_text = " ".join(CliRunner().invoke(main, ["recommend", "--help"]).output.split())
    assert "the earliest bundle saved for nonfinite_loss or nonfinite_tensor, else" in help_text


def test_bf16_verdict_does_not_rest_on_gradients_measured_from_a_substitute():
    from amp_postmortem.advice.decisions import bf16_verdict as verdict_of
    from amp_postmortem.names import BackwardStart
    from amp_postmortem.whatif import Trial

    def bf16_verdict(t, start):
        # the typed trial, read from its dict form; the start as the enum of its --json string
        return verdict_of(Trial.of(t), BackwardStart(start))
    off = {"finite": True, "saved": False, "params_off": {"w": 3.0}, "culprit": None,
           "why": "1 parameter gradient(s) more than 0.5 off float64 (worst w: 3)"}
    assert bf16_verdict(off, "substitute_mean")[:2] == (True, False)   # finite; gradients unconfirmed
    assert bf16_verdict(off, "saved")[:2] == (False, True)             # a real gradient: decisive
    assert bf16_verdict(off, "loss_fn")[:2] == (False, True)
    backward = {**off, "params_off": {}, "culprit": {"name": "q", "phase": "backward"}}
    assert bf16_verdict(backward, "substitute_mean")[:2] == (True, False)
    forward = {**off, "params_off": {}, "culprit": {"name": "q", "phase": "forward"}}
    assert bf16_verdict(forward, "substitute_mean")[:2] == (False, True)
    nonfinite = {**off, "finite": False}
    assert bf16_verdict(nonfinite, "substitute_mean")[:2] == (False, True)
    assert bf16_verdict({**off, "saved": True}, "substitute_mean") == (True, True, None)


def test_replayed_bf16_from_a_substituted_output_gradient_says_so():
    # step 0 of this run has a NaN loss: its saved output gradient is NaN
    r = recommend(load_run(W.attn_overflow_run()), model=W.AttnNet)
    bf16 = r.get("use_bf16")
    assert bf16.data["avoids"] is True and bf16.data["trial"]["finite"]
    assert "substitute output gradient" in bf16.evidence[0]


def _forward_overflow_every_other_step_from_20(step, model, x):
    model.block.boom.gain = 1e6 if step >= 20 and step % 2 == 0 else 1.0


@pytest.fixture(scope="module")
def forward_storm_run(tmp_path_factory):
    """block.boom overflows the forward every other step from step 20: each
    NaN step is skipped and halves the scale, which collapses from there."""
    from conftest import record_run
    return record_run(tmp_path_factory.mktemp("storm") / "forward_overflow_storm_from_20", steps=50,
                      plant=_forward_overflow_every_other_step_from_20,
                      scaler_kwargs={"init_scale": 2.0 ** 16, "growth_interval": 10}, full_every=1)


def test_scaler_settings_come_from_before_the_first_nonfinite_forward(forward_storm_run):
    r = recommend(load_run(forward_storm_run))
    assert r.kinds() == ["keep_fp32", "scaler_settings"]
    assert r.get("keep_fp32").data["modules"] == ["block.boom"]
    sc = r.get("scaler_settings")
    assert sc.data["step"] == 19  # the last clean step before the forward overflow at step 20
    assert sc.action.startswith("once the forward overflow is fixed")
    assert any("consequence, fix the forward first" in e for e in sc.evidence)
    assert sc.data["window"]["max_k"] >= 16  # the window of healthy training, not of the NaN storm


def test_a_drifting_gradient_range_is_not_fixed_by_scaler_settings(collapse_run):
    from amp_postmortem.advice.decisions import window_drift
    run = load_run(collapse_run)
    drift = window_drift(run)
    assert drift["moves"] and drift["direction"] == "down" and drift["shift_bits"] <= -10
    r = recommend(run)
    assert r.kinds() == ["gradient_drift"]  # no GradScaler settings offered as the fix
    rec = r.get("gradient_drift")
    assert rec.action.startswith("no fixed GradScaler setting fixes this") and "amp" in rec.action
    assert rec.data["drivers"][0] == "amp"


# ---------------------------------------------- verified against the saved steps
def test_recommended_scaler_settings_keep_every_saved_step_finite():
    """`out`'s float16 weight gradient overflows at the recorded scale 2^8:
    the printed GradScaler settings are replayed on both saved steps."""
    import advice_runs as A
    from amp_postmortem.whatif import prepare
    r = recommend(load_run(A.lower_scale_run()), model=A.wide_head)
    s = r.get("scaler_settings")
    assert s.verified and s.why is None
    assert s.data["window"]["max_k"] == 6 and s.data["settings"]["init_scale"] == 2.0 ** 5
    assert [c["step"] for c in s.data["checked_steps"]] == [2]
    for step in A.LOWER_SCALE_BUNDLES:
        p = prepare(A.lower_scale_run(), step, model=A.wide_head)
        assert p.run(loss_scale=s.data["settings"]["init_scale"], capture=False).finite
        # step 0 overflowed at its recorded scale 2^8 (step 2 ran at 2^6 and did not)
        assert p.run(loss_scale=p.loss_scale, capture=False).finite == (step == 2)
    assert "training_instability" not in r.kinds() and "keep_fp32" not in r.kinds()


def test_keep_fp32_of_a_one_module_job_is_verified_on_every_saved_step():
    import advice_runs as A
    r = recommend(load_run(A.fp32_module_run()), model=A.branch_net)
    keep = r.get("keep_fp32")
    assert keep.verified and keep.data["modules"] == ["spike_a"]
    assert (keep.data["saved_steps"], keep.data["not_saved_steps"]) == ([1, 3], [])
    assert keep.action == "keep spike_a in float32"


def test_advice_from_recorded_statistics_is_marked_estimate_not_verified(copy_run, edit_manifest):
    import advice_runs as A
    r = recommend(load_run(A.fp32_module_run()))
    keep = r.get("keep_fp32")
    assert not keep.verified and keep.why.startswith("no --model given")
    assert "   (estimate, not verified: no --model given" in "\n".join(r.lines())
    assert r.to_dict()["recommendations"][0]["verified"] is False
    # without a bundle there is nothing to replay, and it says so
    bare = copy_run(A.fp32_module_run(), "no_bundles")
    edit_manifest(bare / "manifest.json", bundles=[])
    keep = recommend(load_run(bare)).get("keep_fp32")
    assert keep.why.startswith("the run holds no replay bundle")


def test_no_float16_configuration_saves_it_so_float16_is_not_advisable():
    """The model's own forward overflows float16 (nothing keep_fp32 can
    wrap, no loss scale helps a forward): float16 is not advisable, with
    why; bfloat16's range holds the values."""
    import advice_runs as A
    r = recommend(load_run(A.root_matmul_run()), model=A.root_matmul)
    assert r.kinds() == ["use_bf16", "avoid_mixed_precision"]
    avoid = r.get("avoid_mixed_precision")
    assert avoid.verified and avoid.action.startswith("float16 mixed precision is not advisable for this job")
    assert avoid.evidence[1:] == ["no set of up to 1 candidate modules kept in float32 saves it",
                                  "no loss scale makes it finite", "bfloat16: finite"]
    assert "training_instability" not in r.kinds()


def test_recommend_replays_a_batchnorm_cnn_in_slices_of_two():
    """A BatchNorm CNN in training takes no one-sample slice: recommend's
    bisection keeps two samples per slice and says so."""
    res = CliRunner().invoke(main, ["recommend", str(W.batchnorm_bad_sample_run()),
                                    "--model", f"{W.__file__}:BatchNormCNN", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    check = next(r for r in doc["recommendations"] if r["kind"] == "check_data")
    assert check["data"]["bad_samples"] == [W.CNN_BAD_SAMPLE] and check["data"]["slicing"]["methods"] == ["paired"]
    assert any("normalise over the batch" in n for n in doc["notes"])
    res = CliRunner().invoke(main, ["recommend", str(W.batchnorm_bad_sample_run()),
                                    "--model", f"{W.__file__}:BatchNormCNN"])
    assert res.exit_code == 0 and "note: bn, bn1 normalise over the batch" in res.stdout


@pytest.mark.parametrize("replayed", [False, True])
def test_scaler_settings_never_exceed_what_a_float16_loss_allows(replayed):
    """The loss is float16 and the scale far too low: the settings proposed,
    from the recorded statistics or the replays, start below 2^16 and say
    the loss sets the edge; the job re-run at the proposed scale skips no
    step, at 2^16 every one."""
    import math

    import loss_dtype_runs as L
    r = recommend(load_run(L.low_scale_half_loss_run()), model=L.net if replayed else None)
    settings = r.get("scaler_settings")
    assert settings is not None and settings.data["overflow_cause"] == "loss_dtype"
    init = settings.data["settings"]["init_scale"]
    assert init < 2.0 ** 16 and settings.data["window"]["max_k"] <= 15
    assert any("loss's own dtype (float16)" in e for e in settings.evidence)
    assert not any(L.train(init)) and all(L.train(2.0 ** 16))
    assert math.log2(init) == settings.data["window"]["max_k"] - 1


# ------------------------------------------------ over a saved window (issue 23)
def test_recommend_claims_instability_only_when_float32_diverges_over_the_window():
    import math

    import amp_postmortem as api
    import window_runs as wr
    assert not all(math.isfinite(v) for v in wr.train(wr.linear_net(), wr.linear_batch, lr=wr.INSTABILITY_LR,
                                                      autocast=False))
    r = api.recommend(wr.instability_run(), model="tests/window_runs.py:linear_net")
    by = {x.kind.value: x for x in r.recommendations}
    assert r.kinds()[0] == "training_instability" and by["training_instability"].verified
    assert "keep_fp32" not in r.kinds()
    # bfloat16 saves the saved step, not the runaway steps after it: never verified
    assert not by["use_bf16"].verified and by["use_bf16"].data["window_check"]["status"] == "fails"
    assert "not the steps that follow" in by["use_bf16"].action


def test_recommend_verifies_a_precision_fix_over_the_window():
    import amp_postmortem as api
    import window_runs as wr
    r = api.recommend(wr.precision_run(), model="tests/window_runs.py:gain_net")
    by = {x.kind.value: x for x in r.recommendations}
    assert "training_instability" not in by
    assert by["keep_fp32"].verified and by["keep_fp32"].data["window_check"]["status"] == "verified"
    assert any(e.startswith("verified over the saved window: with keep amp in float32") for e in by["keep_fp32"].evidence)
