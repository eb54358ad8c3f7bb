"""Summary findings by severity, on runs with planted faults."""
import json

from amp_postmortem.analyses.summary import FINDING_KINDS, summarize
from amp_postmortem.reading.loader import load_run

from conftest import INPUT_NAN_STEP, OVERFLOW_STEP


def _kinds(s):
    return [f.kind for f in s.findings]


def test_forward_overflow(overflow_run):
    s = summarize(load_run(overflow_run))
    assert _kinds(s) == ["nonfinite"]
    f = s.findings[0]
    assert (f.severity, f.step, f.layer) == ("critical", OVERFLOW_STEP, "block.boom")
    # A bundle was saved at the failing step: its replay is the next step.
    assert f.next_command == f"amp-postmortem replay {overflow_run} --step {OVERFLOW_STEP} --model SPEC"


def test_nan_input(input_nan_run):
    f = summarize(load_run(input_nan_run)).findings[0]
    assert (f.kind, f.step, f.layer) == ("nonfinite", INPUT_NAN_STEP, "<input>")


def test_collapse(collapse_run):
    s = summarize(load_run(collapse_run))
    # skipped-step overflows are the scaler's business: no `nonfinite` finding
    assert _kinds(s)[0] == "scale_collapse" and "nonfinite" not in _kinds(s)
    f = s.findings[0]
    assert (f.severity, f.step, f.layer) == ("critical", 42, "amp")
    assert "scale" in f.next_command


def test_healthy_run_has_only_the_healthy_finding(healthy_run):
    s = summarize(load_run(healthy_run))
    assert _kinds(s) == ["healthy"] and s.findings[0].severity == "info"


def test_underflow_at_a_tiny_scale(underflow_run):
    s = summarize(load_run(underflow_run))
    assert _kinds(s) == ["stuck_low_scale", "grad_underflow"]
    assert [f.severity for f in s.findings] == ["error", "warning"]
    assert "ranges" in s.findings[1].next_command


def test_overflow_risk(rising_run):
    s = summarize(load_run(rising_run))
    assert _kinds(s) == ["overflow_risk"]
    # the finding's step is the step measured; the forecast carries its own
    # step, past the run's last (19): projected, and said so
    f = s.findings[0]
    assert (f.layer, f.step) == ("block.boom", 19)
    assert (f.evidence["forecast_step"], f.evidence["forecast_projected"]) == (31, True)
    assert "forecast to overflow at step 31 (projected, after the run's last step 19)" in f.message


def test_json_contract(overflow_run):
    d = summarize(load_run(overflow_run)).to_dict()
    assert {"steps", "ranks", "dtype", "device_type", "scaler", "run_id"} <= set(d["run"])
    assert d["run"]["steps"] == 12 and d["run"]["dtype"] == "float16"
    for f in d["findings"]:
        assert {"kind", "severity", "step", "layer", "message"} <= set(f)
        assert f["kind"] in FINDING_KINDS


def test_no_layer_none_and_the_loss_at_first_last_and_failure(healthy_run, overflow_run):
    healthy = summarize(load_run(healthy_run))
    text = "\n".join(healthy.lines())
    assert "layer None" not in text and "  INFO      healthy  step 39\n" in text + "\n"
    assert healthy.run["failure_step"] is None and healthy.run["first_loss"] > 0
    assert f"loss {healthy.run['first_loss']:.4g} at step 0, {healthy.run['last_loss']:.4g} at step 39\n" in text
    bad = summarize(load_run(overflow_run))
    # The forward turned Inf at the planted step: the loss there is not finite.
    assert bad.run["failure_step"] == OVERFLOW_STEP
    assert bad.run["failure_loss"] != bad.run["failure_loss"] or abs(bad.run["failure_loss"]) == float("inf")
    assert f"at the failure (step {OVERFLOW_STEP})" in "\n".join(bad.lines())


def test_the_json_keeps_its_keys_and_adds_the_losses(overflow_run):
    d = summarize(load_run(overflow_run)).to_dict()
    # op_origin: added with --model (issue 24); precision_verdict: the failed run's (issue 23);
    # what was saved for replays (issue 38)
    assert set(d) == {"run", "findings", "op_origin", "precision_verdict", "bundles", "windows", "bundle_choice",
                      "replay_command"} and d["op_origin"] is None
    assert {"path", "run_id", "status", "steps", "first_step", "last_step", "ranks", "world_size", "device_type",
            "device_name", "model_class", "autocast", "dtype", "scaler", "scale_status", "final_scale",
            "skipped_steps", "nonfinite_loss_steps", "warnings", "first_loss", "last_loss", "failure_step",
            "failure_loss", "param_dtype", "param_dtypes",
            "jax_reductions", "jax_reductions_error"} == set(d["run"])  # parameters' dtype: issue 42; JAX programs: 39
    assert d["run"]["jax_reductions"] is None  # a PyTorch run: no JAX program to read


# --------------------------------------------- exact zeros, dated underflow
def test_structural_zeros_raise_no_underflow_warning():
    """Padding, absent tokens and a ReLU: zeros at any scale, beside small
    gradients that are not flushed: a healthy run."""
    import zeros_runs as Z
    s = summarize(load_run(Z.masked_tokens_run()))
    assert _kinds(s) == ["healthy"]


def test_planted_underflow_is_a_warning_dated_by_its_evidence():
    import zeros_runs as Z
    s = summarize(load_run(Z.flushed_run()))
    f = next(f for f in s.findings if f.kind == "grad_underflow")
    assert f.severity == "warning" and f.step == 11  # the latest step measured
    ev = f.evidence
    assert (ev["evidence_first_step"], ev["evidence_last_step"], ev["recent_from_step"]) == (0, 11, 9)
    assert ev["recent_underflow_share"] >= 0.9 and "underflow_share" in ev and "measured_steps" in ev
    assert "over the full-tier steps 9-11" in f.message


def test_an_underflow_that_stopped_is_an_info_with_its_dates_not_a_warning():
    """Underflow during the warm-up (steps 0-7), none at the full-tier steps
    50, 80 and 99: the run is healthy, and the info says when it was."""
    import zeros_runs as Z
    s = summarize(load_run(Z.warmup_run()))
    assert _kinds(s) == ["underflow_lapsed", "healthy"]
    f = s.findings[0]
    assert (f.severity, f.step, f.layer) == ("info", Z.WARMUP_STEPS - 1, "head")
    assert f"was 100% during steps 0-{Z.WARMUP_STEPS - 1}; 0.0% over steps 75-99" in f.message
    assert (f.evidence["underflow_first_step"], f.evidence["underflow_last_step"]) == (0, Z.WARMUP_STEPS - 1)
    assert f.evidence["recent_underflow_share"] == 0.0
    d = s.to_dict()["findings"][0]
    assert d["kind"] == "underflow_lapsed" and d["kind"] in FINDING_KINDS


# ------------------------------------------------- saved bundles, next: replay
def _cli(*args):
    from click.testing import CliRunner
    from amp_postmortem.cli import main
    return CliRunner().invoke(main, [str(a) for a in args])


def test_summary_lists_the_saved_bundles_and_points_the_failure_to_its_replay(overflow_run):
    out = _cli("summary", overflow_run).stdout.splitlines()
    replay = f"amp-postmortem replay {overflow_run} --step {OVERFLOW_STEP} --model SPEC"
    assert f"            next: {replay}" in out  # the non-finite finding's next step
    assert f"saved for replay: bundles of step(s) {OVERFLOW_STEP} (nonfinite_loss, nonfinite_tensor); " \
           "no window of steps" in out
    assert out.count(f"next: {replay}") + out.count(f"            next: {replay}") == 1  # said once
    doc = json.loads(_cli("summary", overflow_run, "--json").stdout)
    assert doc["bundles"] == [{"step": OVERFLOW_STEP, "rank": 0, "reasons": ["nonfinite_loss", "nonfinite_tensor"]}]
    assert doc["windows"] == [] and doc["replay_command"] == replay
    assert doc["bundle_choice"] == {**doc["bundles"][0], "failure": True}
    assert doc["findings"][0]["next_command"] == replay
    assert {"run", "findings", "op_origin", "precision_verdict"} <= set(doc)  # the keys that were there stay


def test_a_collapse_suggests_the_replay_of_its_most_telling_bundle(collapse_run):
    out = _cli("summary", collapse_run).stdout.splitlines()
    assert "saved for replay: bundles of step(s) 44 (skipped), 78 (scale_low); no window of steps" in out
    assert f"next: amp-postmortem replay {collapse_run} --step 78 --model SPEC" in out


def test_a_healthy_run_lists_its_bundle_but_suggests_no_replay(healthy_run):
    out = _cli("summary", healthy_run).stdout
    assert "saved for replay: bundles of step(s) 15 (skipped); no window of steps" in out
    assert "amp-postmortem replay" not in out
    assert json.loads(_cli("summary", healthy_run, "--json").stdout)["bundle_choice"]["failure"] is False


def test_a_damaged_bundles_folder_is_a_warning_not_an_error(overflow_run, copy_run):
    run = copy_run(overflow_run)
    (run / "bundles" / f"step={OVERFLOW_STEP}").rename(run / "bundles" / f"step=0{OVERFLOW_STEP}")
    result = _cli("summary", run, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["bundles"] == [] and doc["replay_command"] is None
    assert any(w.startswith("the replay bundles cannot be listed: ") for w in doc["warnings"])


def test_a_float16_gradient_flushed_whole_is_a_warning_in_both_modes(tmp_path, monkeypatch):
    """`amp` scales the gradient passing back by 1e-9 in a float16 backward
    without a loss scale: every value below it is flushed, so no underflow
    share or headroom can be read. Not "healthy": the layers it reaches
    are named, their zeros said undetermined, in both recorder modes."""
    import torch
    from tiny_models import BoomNet, recorder_at, train

    def plant(step, model, x):
        model.amp.gain = 1e-9

    found = []
    for mode in ("sentinel", "every_step"):
        monkeypatch.delenv("AMP_POSTMORTEM_MODE", raising=False)
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        data = [(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(6)]
        train(BoomNet(), data, recorder=recorder_at(tmp_path / mode, mode=mode), scaler=None, on_step=plant)
        findings = summarize(load_run(tmp_path / mode)).to_dict()["findings"]
        assert "healthy" not in [f["kind"] for f in findings]
        zero = next(f for f in findings if f["kind"] == "zero_gradients")
        assert zero["severity"] == "warning" and zero["evidence"]["scaled"] is False
        assert {"block", "block.fc", "inp"} <= set(zero["evidence"]["layers"])
        assert "head" not in zero["evidence"]["layers"]  # above `amp`: its gradient is not flushed
        assert "undetermined" in zero["message"]
        found.append((zero["layer"], zero["evidence"]["layers"]))
    assert found[0] == found[1]


def test_a_healthy_run_has_no_zero_gradients_finding(healthy_run):
    assert "zero_gradients" not in _kinds(summarize(load_run(healthy_run)))
