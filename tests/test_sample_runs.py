"""Golden expectations for the sample runs.

The generator is run on its short schedule into a temporary folder and each
run must still show its fault in the recorded data; the committed runs must
still make the analyzer say what their README says.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_runs"


def _tables(run: Path):
    return (pd.read_parquet(run / "rank=0" / "steps").sort_values("step").reset_index(drop=True),
            pd.read_parquet(run / "rank=0" / "tensors"))


def _nonfinite(tensors: pd.DataFrame) -> pd.DataFrame:
    return tensors[(tensors.nan_count > 0) | (tensors.inf_count > 0)]


# The short runs are generated once per session (conftest.short_sample_runs,
# recorded every step), shared with test_sentinel's comparison of the two
# modes; under `-n 2` conftest's scheduler runs both on one worker.
@pytest.fixture
def short_runs(short_sample_runs):
    return short_sample_runs


def test_short_healthy_has_nothing_non_finite(short_runs):
    steps, tensors = _tables(short_runs / "healthy")
    assert len(steps) == 40
    assert steps.loss.notna().all() and _nonfinite(tensors).empty


def test_short_attention_overflow_is_born_in_an_attention_and_bundled(short_runs):
    # The story, not the step: where the NaN first appears moves with the
    # CPU's float16 kernels (step 79 on one machine, 99 on another), so the
    # short schedule runs until it appears and the test pins what it is.
    steps, tensors = _tables(short_runs / "attention_overflow")
    assert steps.loss.isna().any(), "the attention logits never overflowed in 130 steps"
    first = int(steps.step[steps.loss.isna()].min())
    assert steps.loss[steps.step < first].notna().all()
    forward = _nonfinite(tensors[(tensors.phase == "forward") & (tensors.step == first)]).sort_values("order")
    out_proj, attn = forward.name.tolist()[:2]
    # The attention makes it (finite inputs), its out_proj only propagates it.
    assert attn.endswith(".attn") and attn.startswith("blocks.") and out_proj == f"{attn}.out_proj"
    made, propagated = forward.input_nonfinite.tolist()[1], forward.input_nonfinite.tolist()[0]
    assert made == 0 and propagated > 0
    assert (short_runs / "attention_overflow" / "bundles" / f"step={first}" / "rank=0" / "bundle.json").exists()


def test_short_fp32_baseline_stays_finite_with_the_same_start(short_runs):
    base, _ = _tables(short_runs / "fp32_baseline")
    amp, _ = _tables(short_runs / "attention_overflow")
    assert base.loss.notna().all()
    assert base.loss[0] == pytest.approx(amp.loss[0], abs=1e-2)


def test_short_grad_underflow_flushes_gradients_to_zero(short_runs):
    steps, tensors = _tables(short_runs / "grad_underflow")
    assert (steps.loss_scale == 2.0 ** -14).all() and not steps.skipped.any()
    # The float16 gradients inside the blocks; the float32 residual stream
    # between them keeps subnormal-sized values that float16 could not.
    grads = tensors[(tensors.kind == "grad_output") & tensors.name.str.startswith("blocks.")
                    & (tensors.dtype == "float16")]
    assert grads.zero_share.mean() > 0.97


def test_short_scale_collapse_keeps_halving(short_runs):
    steps, _ = _tables(short_runs / "scale_collapse")
    assert steps.skipped.sum() >= 5
    assert steps.loss_scale.iloc[-1] <= steps.loss_scale.max() / 2 ** 5


def test_short_fp16_layernorm_is_silent_and_bundled(short_runs):
    steps, tensors = _tables(short_runs / "fp16_layernorm")
    assert steps.loss.notna().all() and _nonfinite(tensors).empty
    bundle = short_runs / "fp16_layernorm" / "bundles" / "step=19" / "rank=0" / "bundle.json"
    assert json.loads(bundle.read_text())["reason"] == "request"


def test_short_bad_batch_nan_comes_in_with_the_input(short_runs):
    steps, tensors = _tables(short_runs / "bad_batch")
    assert steps.loss.isna().tolist().index(True) == 20 and steps.loss.isna().sum() == 1
    first = _nonfinite(tensors[tensors.phase == "forward"]).sort_values(["step", "order"]).iloc[0]
    assert (first.step, first["name"], first.nan_count) == (20, "<input>", 3)


# --------------------------------------------------- committed runs, analyzer
def _cli(*args):
    from amp_postmortem.cli import main
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)  # stdout alone: warnings and progress go to stderr


@pytest.mark.parametrize("run, name, step", [
    ("attention_overflow", "blocks.1.attn", 79),
    ("bad_batch", "<input>", 60),
])
def test_committed_forward_origin(run, name, step):
    origin = _cli("nans", str(SAMPLES / run))["origins"]["forward"]
    assert (origin["name"], origin["step"]) == (name, step)


@pytest.mark.parametrize("run", ["healthy", "fp32_baseline", "scale_collapse", "grad_underflow", "fp16_layernorm"])
def test_committed_runs_without_forward_nan(run):
    assert _cli("nans", str(SAMPLES / run))["origins"]["forward"] is None


@pytest.mark.parametrize("run, status", [
    ("healthy", "healthy"),
    ("scale_collapse", "collapse"),
    ("grad_underflow", "stuck_low"),
    ("fp32_baseline", "no_scaler"),
])
def test_committed_scale_status(run, status):
    assert _cli("scale", str(SAMPLES / run))["status"] == status


def test_committed_scale_collapse_onset_and_driver():
    result = _cli("scale", str(SAMPLES / "scale_collapse"))
    assert 35 <= result["onset_step"] <= 50
    assert "aux_head" in result["drivers"]


def test_committed_summaries_lead_with_the_fault():
    kinds = {run: [f["kind"] for f in _cli("summary", str(SAMPLES / run))["findings"]]
             for run in ("attention_overflow", "bad_batch", "scale_collapse", "grad_underflow")}
    assert kinds["attention_overflow"][0] == "nonfinite"
    assert kinds["bad_batch"][0] == "nonfinite"
    assert kinds["scale_collapse"][0] == "scale_collapse"
    assert kinds["grad_underflow"][0] == "stuck_low_scale"


def test_committed_healthy_summary_reports_only_healthy():
    findings = _cli("summary", str(SAMPLES / "healthy"))["findings"]
    assert [f["kind"] for f in findings] == ["healthy"]


def test_committed_grad_underflow_is_diagnosed_as_underflow():
    kinds = [f["kind"] for f in _cli("summary", str(SAMPLES / "grad_underflow"))["findings"]]
    assert "grad_underflow" in kinds


def test_committed_attention_overflow_headline_origin_is_the_forward_one():
    result = _cli("nans", str(SAMPLES / "attention_overflow"))
    assert (result["origin"]["name"], result["origin"]["phase"]) == ("blocks.1.attn", "forward")
    assert result["backward_scaler_handled"] is True
