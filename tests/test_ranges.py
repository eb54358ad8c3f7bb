"""Per-layer float16 headroom, trend, forecast and underflow."""
import math

import pandas as pd
import pytest

from amp_postmortem.analyses.ranges import layer_ranges
from amp_postmortem.loader import load_run
from recorders import schema


def _row(rep, name, kind):
    t = rep.layers
    rows = t[(t["name"] == name) & (t["kind"] == kind)]
    assert len(rows) == 1, (name, kind)
    return rows.iloc[0]


def test_activation_heading_for_overflow_is_flagged_with_a_forecast(rising_run):
    rep = layer_ranges(load_run(rising_run))
    boom = _row(rep, "block.boom", "activation")
    assert boom["step"] == 19
    assert boom["headroom_bits"] == pytest.approx(math.log2(schema.FP16_MAX / boom["absmax"]))
    assert boom["headroom_bits"] == pytest.approx(5.9535, abs=1e-3)
    # the gain doubles every 2 steps: half a bit of headroom lost per step
    assert boom["headroom_trend_per_kstep"] == pytest.approx(-500.0)
    assert boom["overflow_forecast_step"] == 31
    assert boom["flags"] == ["overflow_risk"]
    fc = _row(rep, "block.fc", "activation")  # before the gain: steady
    assert fc["flags"] == [] and fc["headroom_trend_per_kstep"] == 0.0 and pd.isna(fc["overflow_forecast_step"])


def test_gradients_are_not_flagged_for_overflow_risk(rising_run):
    rep = layer_ranges(load_run(rising_run))
    grads = rep.layers[rep.layers["kind"].isin(["grad_output", "grad_input"])]
    assert not any("overflow_risk" in f for f in grads["flags"])


def test_tiny_scale_underflow(underflow_run):
    rep = layer_ranges(load_run(underflow_run))
    flagged = rep.flagged("underflow")
    assert set(flagged["kind"]) == {"grad_output"}
    assert set(flagged["name"]) == {"", "head", "amp", "block.act", "block", "block.boom", "block.fc", "inp"}
    # 98% subnormal and the rest flushed to exact zeros (the non-zero values
    # are tiny, so the zeros count as flushed, not as a ReLU mask)
    assert _row(rep, "inp", "grad_output")["underflow_share"] == pytest.approx(1.0)
    assert _row(rep, "head", "grad_output")["underflow_share"] == pytest.approx(0.375)
    assert not rep.flagged("overflow_risk").size
    assert rep.full_tier_steps == 12


def test_healthy_run_has_no_flags(healthy_run):
    rep = layer_ranges(load_run(healthy_run))
    assert all(f == [] for f in rep.layers["flags"])
    assert set(rep.layers["kind"]) == {"input", "activation", "grad_output", "grad_input"}


def test_latest_overflow_has_zero_headroom(collapse_run):
    rep = layer_ranges(load_run(collapse_run))
    amp_in = _row(rep, "amp", "grad_input")  # step 79 was not skipped; step 78 was
    assert amp_in["step"] == 79
    rep = layer_ranges(load_run(collapse_run), window=None)
    assert rep.first_step == 0


def test_window(healthy_run):
    rep = layer_ranges(load_run(healthy_run), window=5)
    assert (rep.first_step, rep.last_step) == (35, 39)


def test_json_contract(rising_run):
    d = layer_ranges(load_run(rising_run)).to_dict()
    row = d["layers"][0]
    assert {"name", "kind", "headroom_bits", "headroom_trend_per_kstep", "overflow_forecast_step",
            "underflow_share", "flags"} <= set(row)
    boom = next(r for r in d["layers"] if r["name"] == "block.boom" and r["kind"] == "activation")
    assert boom["overflow_forecast_step"] == 31 and isinstance(boom["overflow_forecast_step"], int)


def test_zeros_count_as_flushed_only_when_the_surviving_values_are_tiny():
    from amp_postmortem.analyses.ranges import zeros_look_flushed
    # a ReLU mask: half the gradient is exactly zero, the rest is ordinary
    assert not zeros_look_flushed(0.5, 1e-2)
    # a tiny loss scale: 98% zeros and the survivors are subnormal
    assert zeros_look_flushed(0.98, 1e-6)
    assert zeros_look_flushed(1.0, 0.0)
    assert not zeros_look_flushed(0.0, 0.0)


def test_shares_are_reported_with_the_number_of_values_they_were_counted_on(underflow_run):
    rep = layer_ranges(load_run(underflow_run))
    # Small tensors are counted whole: every value of the (16, 8) gradient.
    assert _row(rep, "inp", "grad_output")["share_sample_size"] == 128
    assert rep.to_dict()["layers"][0]["share_sample_size"] is not None
    assert "worst underflow: inp grad_output, 100% of 128 sampled values" in rep.lines()


def test_a_run_recorded_before_the_sample_size_column_still_reads(copy_run, underflow_run):
    import pyarrow.parquet as pq
    run = copy_run(underflow_run)
    for shard in run.glob("rank=*/tensors/*.parquet"):
        table = pq.read_table(shard)
        pq.write_table(table.drop_columns(["share_sample_size"]).replace_schema_metadata(
            table.schema.metadata), shard)
    rep = layer_ranges(load_run(run))
    row = _row(rep, "inp", "grad_output")
    assert row["underflow_share"] == pytest.approx(1.0) and pd.isna(row["share_sample_size"])
    assert "worst underflow: inp grad_output, 100% of its values" in rep.lines()
