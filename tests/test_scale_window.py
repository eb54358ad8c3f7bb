"""`scale-window`: the loss scales at which a step's float16 gradients
neither overflow nor underflow, replayed and estimated from the recorded
statistics. The replayed window is checked against a direct, plain-torch
training step at scales inside and just outside it."""
from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

import whatif_runs as W
from amp_postmortem.reading.bundle import load_bundle
from amp_postmortem.cli import main
from amp_postmortem.reading.loader import load_run
from amp_postmortem.names import BackwardFrom
from amp_postmortem.whatif.scale_result import ScalePosition, WindowMethod
from amp_postmortem.whatif.scale_window import (MAX_UNDERFLOW, estimate_scale_window, replay_scale_window,
                                                scaler_settings)
from recorders.format.schema import FP16_MIN_NORMAL


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def replayed():
    return replay_scale_window(W.healthy_run(), W.HEALTHY_BUNDLE_STEP, model=W.AttnNet)


def direct_step(scale: float) -> tuple[bool, float]:
    """A plain training step at `scale` (CPU float16 autocast, the bundle's
    weights, inputs and loss gradient): (overflowed, share of the non-zero
    float64 module-output gradients that are zero or subnormal in float16)."""
    b = load_bundle(W.healthy_run(), step=W.HEALTHY_BUNDLE_STEP)
    (x,), _ = b.inputs[0]
    g_out = b.grad_outputs[0][0]

    def run(dtype, autocast):
        model = W.AttnNet().to(dtype)
        model.load_state_dict({k: v.to(dtype) for k, v in b.state_dict().items()})
        grads = {}
        def keep(name):
            def hook(module, args, out):
                out.register_hook(lambda g: grads.__setitem__(name, g.detach().clone()))
            return hook
        for name, m in model.named_modules():
            m.register_forward_hook(keep(name))
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            out = model(x.to(dtype))
        out.backward((g_out * (scale if autocast else 1.0)).to(out.dtype))
        return grads, [p.grad for p in model.parameters()]

    fp16, params = run(torch.float32, True)
    ref, _ = run(torch.float64, False)
    overflow = any(not torch.isfinite(g).all() for g in list(fp16.values()) + params)
    nz = small = 0
    for name, g in fp16.items():
        if g.dtype == torch.float16:
            mask = ref[name] != 0
            nz += int(mask.sum())
            small += int((mask & (g.abs() < FP16_MIN_NORMAL)).sum())
    return overflow, small / nz


def test_window_holds_the_scales_that_work_and_excludes_those_that_fail(replayed):
    w = replayed.window
    assert w is not None and w["width_bits"] >= 4
    for k in (w["min_k"], w["max_k"], 8):
        overflow, underflow = direct_step(2.0 ** k)
        assert not overflow and underflow <= MAX_UNDERFLOW, k
    overflow, _ = direct_step(2.0 ** (w["max_k"] + 1))
    assert overflow
    overflow, underflow = direct_step(2.0 ** (w["min_k"] - 1))
    assert not overflow and underflow > MAX_UNDERFLOW
    rows = {r["k"]: r for r in replayed.rows}
    assert rows[w["max_k"] + 1]["overflow"] and not rows[w["min_k"] - 1]["usable"]
    assert rows[8]["recorded"] and replayed.recorded_position is ScalePosition.INSIDE


def test_replayed_underflow_share_matches_the_direct_check(replayed):
    for k in (-4, 2, 6):
        _, underflow = direct_step(2.0 ** k)
        assert next(r for r in replayed.rows if r["k"] == k)["underflow_share"] == pytest.approx(underflow, abs=0.02)


def test_settings_stay_inside_the_window(replayed):
    w, s = replayed.window, replayed.settings
    assert w["min_scale"] <= s["init_scale"] <= w["max_scale"]
    assert s["init_scale"] == 2.0 ** (w["max_k"] - 1) and s["backoff_factor"] == 0.5
    assert s["growth_interval"] == 2000
    assert replayed.code.startswith('torch.amp.GradScaler("cpu", init_scale=2.0**')
    narrow, _ = scaler_settings({"min_k": 3, "max_k": 4})
    assert narrow["init_scale"] == 8.0 and narrow["growth_interval"] == 500
    assert scaler_settings(None) == (None, None)


def test_estimate_from_recorded_statistics_alone(replayed):
    est = estimate_scale_window(load_run(W.healthy_run()), W.HEALTHY_BUNDLE_STEP)
    w, r = est.window, replayed.window
    assert est.method is WindowMethod.ESTIMATE and est.recorded_scale == W.RECORDED_SCALE
    assert est.recorded_position is ScalePosition.INSIDE
    assert est.to_dict()["recorded_position"] == "inside"  # the enum's value: the --json string
    # The overflow edge from output-gradient absmax is an upper bound; the
    # underflow edge from the fitted distribution lands within 2 bits.
    assert w["max_k"] >= r["max_k"] and abs(w["min_k"] - r["min_k"]) <= 2
    layer = next(x for x in est.rows if x["name"] == "q")
    assert layer["below_normal_share"] > 0 and layer["overflow_k"] == math.floor(
        math.log2(65504 / layer["absmax_unscaled"]))


def test_a_nonfinite_forward_has_no_window_until_the_module_is_kept_in_fp32():
    bad = replay_scale_window(W.attn_overflow_run(), 0, model=W.AttnNet, scales=(-2, 4))
    assert bad.window is None and not any(r["forward_finite"] for r in bad.rows)
    assert "forward pass is non-finite at every scale" in bad.notes[0]
    kept = replay_scale_window(W.attn_overflow_run(), 0, model=W.AttnNet, scales=(-2, 4), fp32_modules=("scores",))
    assert kept.window is not None and kept.recorded_position is ScalePosition.ABOVE


def test_cli_scale_window():
    run = str(W.healthy_run())
    res = CliRunner().invoke(main, ["scale-window", run, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["replay"] is None and doc["estimate"]["window"]["max_k"] >= 16
    res = CliRunner().invoke(main, ["scale-window", run, "--step", str(W.HEALTHY_BUNDLE_STEP), "--model",
                                    f"{W.__file__}:AttnNet", "--scales", "0:20"])
    assert res.exit_code == 0, res.output
    assert "window: 2^5 .. 2^16" in res.output and "GradScaler(" in res.output
    res = CliRunner().invoke(main, ["scale-window", run, "--scales", "9:1"])
    assert res.exit_code == 2


def test_estimate_before_a_step_uses_the_last_clean_step_before_it():
    run = load_run(W.healthy_run())
    assert estimate_scale_window(run).step == 3
    est = estimate_scale_window(run, before=2)
    assert est.step == 1 and est.window is not None
    assert est.window == estimate_scale_window(run, 1).window


def test_estimate_from_flushed_gradients_raises_the_scale_above_the_tiny_recorded_one(underflow_run):
    # At 2**-10 most float16 gradient values are flushed to exact zeros: the
    # survivors alone would make the tiny scale look sufficient. Counting the
    # flushed zeros as values below the limit puts the window well above it.
    est = estimate_scale_window(load_run(underflow_run))
    assert est.recorded_scale == 2.0 ** -10
    assert est.window is not None and est.window["min_k"] > -10
    assert est.recorded_position is ScalePosition.BELOW


# ------------------------------------------------ verified against replays
def _finite_at(run_dir, step, k):
    import advice_runs as A
    from amp_postmortem.whatif import prepare
    p = prepare(run_dir, step, model=A.wide_head)
    return p.run(loss_scale=2.0 ** k, capture=False).finite


def test_estimate_counts_float16_weight_gradients_and_says_it_is_not_verified():
    """`out`'s weight gradient is 7 bits above its output gradient: the
    module rows alone put the overflow edge at 2^13, the weight-gradient
    matmul at 2^6."""
    import advice_runs as A
    est = estimate_scale_window(load_run(A.lower_scale_run()))
    rows = {r["name"]: r for r in est.rows}
    assert rows["out"]["overflow_k"] == 13 and rows["out.weight"]["overflow_k"] == 6
    assert est.window["max_k"] == 6
    assert est.verified is False and "no --model" in est.why
    assert "estimate, not verified" in est.lines()[0]
    assert est.to_dict()["verified"] is False


def test_replayed_window_edges_replay_finite_and_one_past_does_not():
    import advice_runs as A
    run = A.lower_scale_run()
    sw = replay_scale_window(run, 0, model=A.wide_head, scales=(-4, 10), verify=True)
    assert sw.verified and sw.window["max_k"] == 6
    top = sw.window["max_k"]
    assert _finite_at(run, 0, top) and not _finite_at(run, 0, top + 1)
    # the other saved step was checked at the top, and the printed
    # GradScaler settings keep every saved step finite
    assert [c.step for c in sw.checked_steps] == [2] and sw.checked_steps[0].finite_at_max
    k = int(math.log2(sw.settings["init_scale"]))
    assert all(_finite_at(run, s, k) for s in A.LOWER_SCALE_BUNDLES)


# ------------------------------------------------------ structural zeros
def _without_zeros(run_dir):
    """The run with every gradient row's exact zeros removed: the same
    non-zero values (their count, shares and rms), and no zero."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    for shard in run_dir.glob("rank=*/tensors/*.parquet"):
        table = pq.read_table(shard)
        df = table.to_pandas()
        z = df["zero_share"].fillna(0.0)
        rows = (df["kind"] == "grad_output") & (z > 0) & (z < 1)
        keep = 1 - z[rows]
        df.loc[rows, "numel"] = np.round(df.loc[rows, "numel"] * keep).astype("int64")
        df.loc[rows, "below_normal_share"] = df.loc[rows, "below_normal_share"] / keep
        df.loc[rows, "rms"] = df.loc[rows, "rms"] / np.sqrt(keep)
        df.loc[rows, "zero_share"] = 0.0
        pq.write_table(pa.Table.from_pandas(df, schema=table.schema, preserve_index=False), shard)
    return run_dir


def test_estimate_leaves_structural_zeros_out(copy_run):
    """Padding, absent tokens and a ReLU: the estimated underflow edges are
    those of the non-zero values alone, as if the zeros were not there; the
    layers say how many zeros were left out."""
    import zeros_runs as Z
    run_dir = Z.masked_tokens_run()
    est = estimate_scale_window(load_run(run_dir))
    bare = estimate_scale_window(load_run(_without_zeros(copy_run(run_dir))))
    rows = {r["name"]: r for r in est.rows}
    for name, r in {r["name"]: r for r in bare.rows}.items():
        if "." in name:
            continue  # weight gradients: overflow edges only
        assert rows[name]["underflow_k"] == r["underflow_k"], name
        assert rows[name]["log2_mu"] == pytest.approx(r["log2_mu"], abs=0.05), name
    assert est.window == bare.window
    assert rows["act"]["structural_zero_share"] == pytest.approx(Z.MASKED_SHARE)
    assert rows["act"]["flushed_zero_share"] < 1e-6
    assert est.to_dict()["layers"][0]["structural_zero_share"] == pytest.approx(Z.MASKED_SHARE)


def test_estimated_lower_edge_matches_the_job_rerun_at_each_scale(tmp_path):
    """Truth from the same job re-run at fixed scales 2^k: the share of
    non-zero float16 gradient values below 2^-14 at the estimate's step
    falls to at most MAX_UNDERFLOW within a bit of the estimated edge."""
    import zeros_runs as Z
    est = estimate_scale_window(load_run(Z.masked_tokens_run()))
    lo = est.window["min_k"]

    def share_at(k):
        run = load_run(Z.masked_tokens(tmp_path / f"k{k}", init_scale=2.0 ** k))
        df = run.scan_tensors(["name", "kind", "dtype", "numel", "zero_share", "below_normal_share"],
                              steps=[est.step], kinds=["grad_output"])
        df = df[df["dtype"] == "float16"]
        return float((df["numel"] * df["below_normal_share"]).sum() / (df["numel"] * (1 - df["zero_share"])).sum())
    assert share_at(lo + 1) <= MAX_UNDERFLOW
    assert share_at(lo - 2) > MAX_UNDERFLOW


# ------------------------------------------------------ the loss's own dtype
FP16_LOSS_TOP = 15  # 2^16 = 65536 is Inf in float16: the scale itself overflows a float16 loss


def test_a_float16_loss_caps_the_estimate_and_the_job_confirms_it():
    """The loss is float16: the backward's first gradient is the scale
    itself in float16. The estimate's top is below 2^16, named as the
    loss's doing, and the job re-run at 2^17 skips every step while at the
    proposed init_scale it skips none."""
    import loss_dtype_runs as L
    run = load_run(L.half_loss_run())
    assert set(run.steps["loss_dtype"]) == {"float16"}
    est = estimate_scale_window(run)
    assert est.window["max_k"] <= FP16_LOSS_TOP
    assert est.overflow_cause.value == "loss_dtype" and est.overflow_edge_by == "<loss>"
    assert est.loss_dtype == "float16" and est.loss_max_k == FP16_LOSS_TOP
    assert "loss's own dtype (float16)" in "\n".join(est.lines())
    assert est.to_dict()["overflow_cause"] == "loss_dtype"
    # without the loss, the model's gradients alone allow more: the loss is what sets the edge
    gradients_k = min(r["overflow_k"] for r in est.rows if r["overflow_k"] is not None)
    assert gradients_k > FP16_LOSS_TOP
    init = est.settings["init_scale"]
    assert init < 2.0 ** 16
    assert all(L.train(2.0 ** 17)) and all(L.train(2.0 ** 16))
    assert not any(L.train(init))


def test_a_float32_loss_sets_no_loss_limit():
    import loss_dtype_runs as L
    est = estimate_scale_window(load_run(L.float_loss_run()))
    assert est.loss_dtype == "float32" and est.overflow_cause.value != "loss_dtype"
    assert est.window["max_k"] > FP16_LOSS_TOP
    assert not any(L.train(2.0 ** 16, half=False))


def test_a_run_without_the_loss_dtype_says_it_is_unknown(copy_run):
    import pyarrow.parquet as pq
    import loss_dtype_runs as L
    run_dir = copy_run(L.half_loss_run())
    for shard in run_dir.glob("rank=*/steps/*.parquet"):
        table = pq.read_table(shard)
        pq.write_table(table.drop_columns(["loss_dtype"]), shard)
    est = estimate_scale_window(load_run(run_dir))
    assert est.loss_dtype is None and est.overflow_cause.value != "loss_dtype"
    assert any("loss's dtype" in n and "unknown" in n for n in est.notes)
    assert est.loss_caveat() is not None and "2^15" in est.loss_caveat()


def test_a_loss_dtype_that_is_no_floating_dtype_is_unknown(copy_run):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import loss_dtype_runs as L
    run_dir = copy_run(L.half_loss_run())
    for shard in run_dir.glob("rank=*/steps/*.parquet"):
        table = pq.read_table(shard)
        i = table.schema.get_field_index("loss_dtype")
        pq.write_table(table.set_column(i, "loss_dtype", pa.array(["int64"] * len(table), pa.string())), shard)
    est = estimate_scale_window(load_run(run_dir))
    assert est.loss_dtype is None and any("'int64'" in n for n in est.notes)


@pytest.mark.parametrize("case", ["recorded_dtype", "loss_fn", "loss_inside"])
def test_the_replayed_window_starts_from_the_loss_and_stops_below_2_16(case):
    """The replay of a float16-loss step: from the model's own loss output,
    from --loss-fn's loss, or from the saved output gradient with the
    recorded loss dtype standing for the loss; each says which."""
    import amp_postmortem as api
    import loss_dtype_runs as L
    run, model, loss_fn, start = {
        "recorded_dtype": (L.half_loss_run(), L.net, None, "output_gradient"),
        "loss_fn": (L.half_loss_run(), L.net, L.half_loss, "loss_fn"),
        "loss_inside": (L.half_loss_inside_run(), L.loss_net, None, "loss")}[case]
    report = api.scale_window(run, step=L.BUNDLE_STEPS[0], model=model, loss_fn=loss_fn, scales=(10, 20))
    sw = report.replay
    assert sw.backward_from is BackwardFrom(start) and sw.loss_dtype == "float16"
    assert sw.window["max_k"] == FP16_LOSS_TOP and sw.overflow_cause.value == "loss_dtype"
    rows = {r["k"]: r for r in sw.rows}
    assert rows[16]["overflow"] and rows[16]["loss_overflow"] and not rows[15]["loss_overflow"]
    assert "backward started from" in "\n".join(report.lines())
    assert report.to_dict()["replay"]["backward_from"] == start
    assert sw.settings["init_scale"] < 2.0 ** 16


def test_a_replay_from_the_output_gradient_alone_says_the_loss_is_not_checked():
    import loss_dtype_runs as L
    sw = replay_scale_window(L.half_loss_run(), L.BUNDLE_STEPS[0], model=L.net, scales=(10, 20))
    assert sw.backward_from is BackwardFrom.OUTPUT_GRADIENT and sw.loss_dtype is None
    assert sw.window["max_k"] > FP16_LOSS_TOP  # what the replay alone cannot see
    assert any("loss's dtype is unknown" in n and "--loss-fn" in n for n in sw.notes)


def test_a_float32_loss_replayed_from_loss_fn_is_not_capped():
    import amp_postmortem as api
    import loss_dtype_runs as L
    sw = api.scale_window(L.float_loss_run(), step=L.BUNDLE_STEPS[0], model=L.net, loss_fn=L.float_loss,
                          scales=(10, 20)).replay
    assert sw.backward_from is BackwardFrom.LOSS_FN and sw.loss_dtype == "float32"
    assert sw.window["max_k"] > FP16_LOSS_TOP and not any(r["loss_overflow"] for r in sw.rows)
