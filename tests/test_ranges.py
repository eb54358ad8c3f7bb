"""Per-layer headroom, trend, forecast and underflow, against each row's own dtype's limits."""
import json
import math

import pandas as pd
import pytest

from amp_postmortem.analyses.ranges import layer_ranges
from amp_postmortem.reading.loader import load_run
from recorders.format import schema


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


def test_zero_split_tells_flushed_zeros_from_structural_ones():
    import numpy as np
    from scipy.stats import norm
    from amp_postmortem.analyses.ranges import zero_split
    # (zero_share, below_normal_share, absmax, values) -> verdict, flushed share
    cases = [
        ((0.5, 0.0, 1e-2, 4096), "structural", 0.0),     # a ReLU mask: nothing reaches the subnormal band
        ((0.6, 0.05, 2 ** -11, 4096), "structural", 0.0),  # a mask over small values: their tail stops far above 2^-25
        ((0.98, 0.02, 1e-6, 4096), "flushed", 0.98),     # a tiny scale: every survivor is subnormal
        ((0.0, 0.3, 1e-3, 4096), "none", 0.0),
    ]
    # values log2-normal around 2^-22 (3 bits): their tail below 2^-25 is flushed
    z = float(norm.cdf(-1.0))
    cases.append(((z, float(norm.cdf(8 / 3)) - z, 2.0 ** (-22 + 3 * 3.9), 4096), "flushed", z))
    for (zero, below, absmax, n), verdict, flushed in cases:
        f, v, _ = zero_split([zero], [below], [absmax], [n])
        assert v[0] == verdict, (zero, below, absmax)
        assert f[0] == pytest.approx(flushed, abs=1e-3)
    # every value zero: a zero-initialised gamma and a gradient flushed whole look alike
    f, v, _ = zero_split([1.0], [0.0], [0.0], [4096])
    assert v[0] == "undetermined" and np.isnan(f[0])
    # too few non-zero values for an empty band to prove anything
    f, v, _ = zero_split([0.99], [0.0], [1.0], [1000])
    assert v[0] == "undetermined"


@pytest.fixture(scope="module")
def bf16_rising_run(tmp_path_factory):
    """rising_run's growth (block.boom doubles every 2 steps) under bfloat16 autocast."""
    from conftest import _rising, record_run
    return record_run(tmp_path_factory.mktemp("runs") / "bf16_activation_growing", steps=20, plant=_rising,
                      scaler_kwargs={"init_scale": 2.0 ** 4}, lr=0.0, fixed_batch=True,
                      autocast_dtype="bfloat16")


def test_bfloat16_rows_use_bfloat16_limits_not_float16s(bf16_rising_run):
    rep = layer_ranges(load_run(bf16_rising_run))
    boom = _row(rep, "block.boom", "activation")
    assert (boom["dtype"], boom["range_dtype"]) == ("bfloat16", "bfloat16")
    bf16_max = 3.3895313892515355e38
    assert boom["headroom_bits"] == pytest.approx(math.log2(bf16_max / boom["absmax"]))
    assert boom["headroom_bits"] == pytest.approx(117.95, abs=0.01)
    # The same growth: half a bit per step, now 118 bits from bfloat16's limit,
    # not 6 bits from float16's: far away, and no alarm.
    assert boom["headroom_trend_per_kstep"] == pytest.approx(-500.0)
    assert boom["overflow_forecast_step"] == 19 + math.ceil(boom["headroom_bits"] / 0.5)
    assert boom["flags"] == []
    assert not rep.flagged("overflow_risk").size
    assert "limits: bfloat16 (max 3.38953e+38)" in rep.lines()[1]


def test_float16_run_says_which_limits_each_row_had(rising_run):
    rep = layer_ranges(load_run(rising_run))
    boom = _row(rep, "block.boom", "activation")
    assert (boom["dtype"], boom["range_dtype"]) == ("float16", "float16")
    # The batch enters as float32: its headroom is float32's, its forecast none.
    x = _row(rep, "<input>", "input")
    assert (x["dtype"], x["range_dtype"]) == ("float32", "float32")
    assert x["headroom_bits"] == pytest.approx(math.log2(3.4028234663852886e38 / x["absmax"]))
    assert x["headroom_bits"] == pytest.approx(126.23, abs=0.01) and x["flags"] == []
    d = layer_ranges(load_run(rising_run)).to_dict()
    assert {r["range_dtype"] for r in d["layers"]} == {"float16", "float32"}
    assert d["thresholds"]["dtype_limits"]["float16"] == {"max": 65504.0, "min_normal": 6.103515625e-05}


def test_wider_dtypes_underflow_share_is_known_only_when_nothing_is_below_float16_subnormal():
    import numpy as np
    from amp_postmortem.analyses.underflow import below_normal
    full = pd.DataFrame({"below_normal_share": [0.5, 0.5], "below_subnormal_share": [0.0, 0.1]})
    assert list(below_normal(full, "float16")) == [0.5, 0.5]
    got = below_normal(full, "bfloat16")
    assert got.iloc[0] == 0.0 and np.isnan(got.iloc[1])


def test_shares_are_reported_with_the_number_of_values_they_were_counted_on(underflow_run):
    rep = layer_ranges(load_run(underflow_run))
    # Small tensors are counted whole: every value of the (16, 8) gradient.
    assert _row(rep, "inp", "grad_output")["share_sample_size"] == 128
    assert rep.to_dict()["layers"][0]["share_sample_size"] is not None
    # measured over the recent full-tier steps (the window's last quarter)
    assert any(line.startswith("worst underflow: ") and " grad_output, 100% of 128 sampled values over the "
               "full-tier steps 9-11 " in line for line in rep.lines())


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
    assert any(line.startswith("worst underflow: ") and " grad_output, 100% of its values" in line
               for line in rep.lines())


def _planted_line() -> int:
    import inspect
    from tiny_models import HalfNorm
    lines, first = inspect.getsourcelines(HalfNorm.forward)
    return first + next(i for i, line in enumerate(lines) if "PLANTED" in line)


def test_an_op_near_overflow_inside_a_probed_module_is_named_before_any_nan(probed_run):
    run = load_run(probed_run)
    rep = layer_ranges(run)
    # No NaN/Inf reached any module's boundary, and no module's output is near the limit...
    assert not any(rep.layers["flags"].map(bool))
    assert (run.scan_tensors(kinds=list(schema.KINDS[:-1]))[["nan_count", "inf_count"]] == 0).all().all()
    # ...but inside block.norm the variance's x * x is 0.07 bits below 65504.
    inside = rep.intermediates.set_index("name")
    norm = inside.loc["block.norm"]
    assert norm["op"] == "aten::mul" and norm["dtype"] == "float16" and norm["op_index"] == 2
    assert norm["source"] == f"tests/tiny_models.py:{_planted_line()}"
    assert norm["headroom_bits"] == pytest.approx(math.log2(schema.FP16_MAX / norm["absmax"]))
    assert norm["headroom_bits"] < 0.1 and norm["flags"] == ["overflow_risk"]
    assert norm["output_headroom_bits"] > 100  # the output (promoted to float32 by the weight) shows nothing
    assert norm["min_headroom_op"] == "aten::mul" and norm["step"] == 3
    # The attention's logits are small; its mask's -Inf is counted, not flagged.
    attn = inside.loc["block.attn"]
    assert attn["op"] == "aten::bmm" and attn["flags"] == [] and attn["nonfinite_ops"] == 1
    said = "\n".join(rep.lines())
    assert (f"overflow_risk inside block.norm: aten::mul at tests/tiny_models.py:{_planted_line()} "
            f"reached 62,496 in float16") in said


def test_ranges_json_gains_the_probed_modules(probed_run, overflow_run):
    from click.testing import CliRunner

    from amp_postmortem.cli import main
    doc = json.loads(CliRunner().invoke(main, ["ranges", str(probed_run), "--json"]).output)
    norm = next(r for r in doc["intermediates"] if r["name"] == "block.norm")
    assert norm["op"] == "aten::mul" and norm["flags"] == ["overflow_risk"]
    assert {"layers", "first_step", "last_step", "full_tier_steps", "thresholds"} <= set(doc)
    plain = json.loads(CliRunner().invoke(main, ["ranges", str(overflow_run), "--json"]).output)
    assert plain["intermediates"] == []  # no probe: nothing read, nothing said


# ------------------------------------------- exact zeros and dated evidence
def test_masks_absent_tokens_and_relu_zeros_are_structural_not_underflow():
    """Padding the loss ignores (5 of 8 positions), tokens absent from every
    batch and a ReLU: exact zeros beside small surviving gradients (just
    above 2^-14) are no underflow, and ranges says what they are."""
    import zeros_runs as Z
    rep = layer_ranges(load_run(Z.masked_tokens_run()))
    assert not len(rep.flagged("underflow")) and not len(rep.flagged("underflow_lapsed"))
    for name in ("head", "act"):  # the padding's share of every per-position gradient, exactly
        row = _row(rep, name, "grad_output")
        assert row["zero_share"] == Z.MASKED_SHARE and row["zeros"] == "structural"
        assert row["structural_zero_share"] == pytest.approx(Z.MASKED_SHARE) and row["flushed_zero_share"] < 1e-6
        assert row["underflow_share"] < 0.25  # the subnormal survivors only
    fc = _row(rep, "fc", "grad_output")  # the ReLU's zeros on top of the padding
    assert fc["zero_share"] > Z.MASKED_SHARE and fc["zeros"] == "structural"
    assert any(line.startswith("structural zeros (zero at any scale: not underflow): ") for line in rep.lines())
    # the embedding's gradient has a zero row per absent token: no module row counts it either
    run = load_run(Z.masked_tokens_run())
    grads = run.scan_tensors(["name", "kind", "zero_share"], kinds=["param_grad"])
    assert (grads[grads["name"] == "embed.weight"]["zero_share"] >= 1 - Z.PRESENT / Z.VOCAB).all()


def test_gradients_that_really_flush_are_still_flagged_with_their_flushed_zeros():
    import zeros_runs as Z
    rep = layer_ranges(load_run(Z.flushed_run()))
    assert {"head", "act", "fc"} <= set(rep.flagged("underflow")["name"])
    fc = _row(rep, "fc", "grad_output")
    assert fc["zeros"] == "flushed" and fc["flushed_zero_share"] == pytest.approx(fc["zero_share"])
    assert fc["recent_underflow_share"] >= 0.9 and fc["recent_from_step"] == 9
    assert (fc["evidence_first_step"], fc["evidence_last_step"], fc["evidence_steps"]) == (0, 11, 12)


def test_an_underflow_that_stopped_lapses_with_its_dates():
    """The loss weight is tiny for the warm-up's 8 steps, then 1: every
    gradient underflowed during steps 0-7 and none does in the steps the
    recorder measured since (50, 80, 99)."""
    import zeros_runs as Z
    rep = layer_ranges(load_run(Z.warmup_run()))
    assert not len(rep.flagged("underflow"))
    head = _row(rep, "head", "grad_output")
    assert head["flags"] == ["underflow_lapsed"]
    assert (head["underflow_first_step"], head["underflow_last_step"]) == (0, Z.WARMUP_STEPS - 1)
    assert head["underflow_episode_share"] >= 0.9 and head["recent_underflow_share"] < 0.25
    assert head["recent_from_step"] == 75 and head["evidence_last_step"] == 99
    line = next(x for x in rep.lines() if x.startswith("lapsed underflow: "))
    assert f"during steps 0-{Z.WARMUP_STEPS - 1}; " in line and "over steps 75-99" in line
    d = next(r for r in rep.to_dict()["layers"] if r["name"] == "head" and r["kind"] == "grad_output")
    assert d["underflow_last_step"] == Z.WARMUP_STEPS - 1 and isinstance(d["underflow_last_step"], int)


def test_evidence_from_the_first_half_of_the_window_is_stale():
    """Full-tier steps only during the warm-up: nothing says how the
    gradients are now: no current share, a lapse with its dates, no warning."""
    import zeros_runs as Z
    rep = layer_ranges(load_run(Z.stale_run()))
    assert not len(rep.flagged("underflow"))
    head = _row(rep, "head", "grad_output")
    assert head["flags"] == ["underflow_lapsed"] and head["evidence_last_step"] == 9
    assert pd.isna(head["recent_underflow_share"]) and pd.isna(head["recent_from_step"])
    assert (head["underflow_first_step"], head["underflow_last_step"]) == (0, Z.WARMUP_STEPS - 1)
    line = next(x for x in rep.lines() if x.startswith("lapsed underflow: "))
    assert "no full-tier step since step 9" in line and "unknown" in line


def test_an_all_zero_row_is_flushed_only_as_a_gradient_of_a_flushing_step():
    """A row of nothing but zeros (a zero-initialised weight's, at step 0)
    in a layer with no zero at its other steps: those steps are no evidence
    of a flush, the row is undetermined; in a step where other gradients
    underflow a gradient row counts as flushed whole, a forward row never."""
    import numpy as np
    from amp_postmortem.analyses.underflow import row_shares
    full = pd.DataFrame({"step": [0, 1, 2, 0], "lid": [0, 0, 0, 1], "zero_share": [1.0, 0.0, 0.0, 1.0],
                         "below_normal_share": [0.0] * 4, "below_subnormal_share": [0.0] * 4,
                         "absmax": [0.0, 0.5, 0.4, 0.0], "share_sample_size": [64] * 4,
                         "gradient": [True, True, True, False]})
    share, _, verdict, told = row_shares(full, layer="lid")
    assert list(verdict) == ["undetermined", "none", "none", "undetermined"] and not told[0] and np.isnan(share[0])
    share, flushed, verdict, told = row_shares(full, flushing_steps={0}, layer="lid")
    assert (verdict[0], share[0], flushed[0]) == ("flushed", 1.0, 1.0)
    assert verdict[3] == "undetermined" and np.isnan(share[3])
