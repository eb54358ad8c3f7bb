"""`export tensorboard`: the event file, read back with TensorBoard's own
reader, holds the recorded values: the scalars, the per-step histograms of
the layers' log2 absmax (checked against the run's Parquet read with pandas)
and the findings as text the Text dashboard renders."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
from tensorboard.plugins.text.text_plugin import text_array_to_html
from tensorboard.util import tensor_util

import amp_postmortem
from amp_postmortem.cli import main
from amp_postmortem.export import LAYER_KINDS, export_tensorboard, log2_histogram
from amp_postmortem.reading.loader import load_run
from conftest import OVERFLOW_STEP

REPO = Path(__file__).resolve().parents[1]
ATTENTION = REPO / "sample_runs" / "attention_overflow"


def read_back(logdir) -> event_accumulator.EventAccumulator:
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={
        event_accumulator.SCALARS: 0, event_accumulator.HISTOGRAMS: 0, event_accumulator.TENSORS: 0})
    acc.Reload()
    return acc


def series(acc, tag) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_step_scalars_are_the_recorded_values_nan_loss_included(tmp_path):
    result = export_tensorboard(ATTENTION, tmp_path / "tb")
    acc = read_back(tmp_path / "tb")
    steps = load_run(ATTENTION).steps.set_index("step")
    assert result.steps == 130 and len(result.files) == 1
    loss = series(acc, "loss")
    assert sorted(loss) == list(range(130))
    for step, value in loss.items():
        recorded = np.float32(steps.loc[step, "loss"])  # simple_value is a float32
        assert (math.isnan(value) and math.isnan(recorded)) or value == recorded, step
    assert sum(math.isnan(v) for v in loss.values()) == 21  # the NaN losses stay NaN
    assert series(acc, "loss_scale") == {s: float(np.float32(v)) for s, v in steps["loss_scale"].items()}
    assert series(acc, "skipped") == {s: float(v) for s, v in steps["skipped"].items()}
    assert sum(series(acc, "skipped").values()) == 23
    gn = series(acc, "grad_norm")
    finite = steps["grad_norm"][np.isfinite(steps["grad_norm"])]
    assert all(gn[s] == np.float32(v) for s, v in finite.items())


def test_one_tag_per_layer_holds_its_absmax_and_headroom(tmp_path):
    export_tensorboard(ATTENTION, tmp_path / "tb")
    acc = read_back(tmp_path / "tb")
    tags = acc.Tags()["scalars"]
    assert "absmax/activation/blocks.1.attn" in tags and "headroom/grad_input/blocks.0.attn" in tags
    assert "absmax/activation/(model)" in tags  # the root module; token ids are no float input
    rows = load_run(ATTENTION).scan_tensors(["step", "name", "kind", "absmax", "nan_count", "inf_count"],
                                            kinds=["activation"])
    attn = rows[rows["name"] == "blocks.1.attn"].groupby("step")["absmax"].max()  # calls merged by max
    absmax = series(acc, "absmax/activation/blocks.1.attn")
    assert absmax == {int(s): float(np.float32(v)) for s, v in attn.items()}
    headroom = series(acc, "headroom/activation/blocks.1.attn")
    assert headroom[78] == np.float32(math.log2(65504.0 / attn[78]))
    assert headroom[79] == 0.0  # NaN/Inf in the tensor at step 79: no headroom left


def test_export_command_json_and_a_second_export_into_the_same_directory(overflow_run, tmp_path):
    runner = CliRunner()
    out = runner.invoke(main, ["export", "tensorboard", str(overflow_run), "--logdir", str(tmp_path), "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["steps"] == 12 and doc["step_tags"] == ["grad_norm", "loss", "loss_scale", "skipped"]
    assert doc["histogram_tags"] == [f"log2_absmax/{k}" for k in LAYER_KINDS] and doc["text_tags"] == ["findings"]
    assert doc["findings"] == len(amp_postmortem.summary(overflow_run).findings) > 0
    absmax = recorded_absmax(overflow_run)
    usable = np.isfinite(absmax) & (absmax > 0)
    assert doc["histogram_left_out"] == int((~usable).sum()) > 0  # step 7's NaN gradients have no finite value
    assert doc["histograms"] == usable.groupby(level=["step", "kind"]).any().sum()
    assert {"headroom/activation/block.boom", "absmax/input/<input>"} <= set(doc["layer_tags"])
    assert series(read_back(tmp_path), "headroom/activation/block.boom")[OVERFLOW_STEP] == 0.0
    again = runner.invoke(main, ["export", "tensorboard", str(overflow_run), "--logdir", str(tmp_path)])
    assert again.exit_code == 2
    assert again.output.strip().splitlines() == [
        f"Error: {tmp_path} already holds TensorBoard event files; export into an empty directory "
        f"(or delete them)"]


def test_each_rank_gets_its_own_event_file(two_rank_run, tmp_path):
    result = export_tensorboard(two_rank_run, tmp_path)
    assert [Path(f).parent.name for f in result.files] == ["rank=0", "rank=1"]
    steps = load_run(two_rank_run).steps
    for rank in (0, 1):
        loss = series(read_back(tmp_path / f"rank={rank}"), "loss")
        mine = steps[steps["rank"] == rank].set_index("step")["loss"]
        assert loss == {int(s): float(np.float32(v)) for s, v in mine.items()}
        acc = read_back(tmp_path / f"rank={rank}")
        assert [e.step for e in acc.Histograms("log2_absmax/activation")] == sorted(mine.index.astype(int))
        assert len(acc.Tensors("findings")) == 1  # the run's findings, in each rank's file


# ------------------------------------------------------------ histograms
def recorded_absmax(run_dir) -> pd.Series:
    """Per (step, kind, layer) the recorded absmax, repeated calls merged by
    their maximum: from the run's Parquet files, read with pandas alone."""
    df = pd.read_parquet(Path(run_dir) / "rank=0" / "tensors", columns=["step", "kind", "name", "absmax"])
    return df[df["kind"].isin(LAYER_KINDS)].groupby(["step", "kind", "name"])["absmax"].max()


def test_log2_histogram_buckets_are_one_bit_wide_and_zero_or_nan_is_left_out():
    h = log2_histogram([1.0, 2.0, 3.0, 8.0, 0.0, float("nan"), float("inf")])
    assert (h.count, h.min, h.max, h.left_out) == (4, 0.0, 3.0, 3)
    assert h.bucket_limit == [1.0, 2.0, 3.0, 4.0] and h.bucket == [1, 2, 0, 1]  # log2(3) sits in [1, 2)
    assert h.sum == pytest.approx(0 + 1 + math.log2(3) + 3)
    assert h.sum_squares == pytest.approx(0 + 1 + math.log2(3) ** 2 + 9)
    assert log2_histogram([0.0]).count == 0 and log2_histogram([0.0]).left_out == 1


def test_each_step_and_kind_has_a_histogram_of_its_layers_log2_absmax(overflow_run, tmp_path):
    export_tensorboard(overflow_run, tmp_path)
    acc = read_back(tmp_path)
    absmax = recorded_absmax(overflow_run)
    assert sorted(acc.Tags()["histograms"]) == sorted(f"log2_absmax/{k}" for k in LAYER_KINDS)
    seen = 0
    for kind in LAYER_KINDS:
        drawn = {e.step: e.histogram_value for e in acc.Histograms(f"log2_absmax/{kind}")}
        of_kind = absmax.xs(kind, level="kind")
        for step in sorted(absmax.index.get_level_values("step").unique()):
            layers = of_kind.loc[step] if step in of_kind.index.get_level_values("step") else pd.Series([], dtype=float)
            values = np.log2(layers[np.isfinite(layers) & (layers > 0)].to_numpy(float))
            if not len(values):  # step 7's gradients: NaN everywhere, no finite absmax
                assert step not in drawn, (kind, step)
                continue
            h = drawn[step]
            assert h.num == len(values) and sum(h.bucket) == len(values), (kind, step)
            assert (h.min, h.max) == (pytest.approx(values.min()), pytest.approx(values.max())), (kind, step)
            assert h.sum == pytest.approx(values.sum())
            assert list(h.bucket) == [((values >= top - 1) & (values < top)).sum() for top in h.bucket_limit]
            seen += 1
    assert seen > 12 * 3  # every kind at nearly every step
    # No grad_input histogram at step 7, but the forward's is there, with block.boom near 65504.
    assert OVERFLOW_STEP not in {e.step for e in acc.Histograms("log2_absmax/grad_input")}
    forward = {e.step: e.histogram_value for e in acc.Histograms("log2_absmax/activation")}[OVERFLOW_STEP]
    assert forward.max == pytest.approx(math.log2(absmax.loc[(OVERFLOW_STEP, "activation", "block.boom")]))
    # TensorBoard's dashboards read the histograms and the text through their plugins.
    dash = plugin_event_accumulator.EventAccumulator(str(tmp_path))
    dash.Reload()
    assert set(dash.PluginTagToContent("histograms")) == {f"log2_absmax/{k}" for k in LAYER_KINDS}
    assert set(dash.PluginTagToContent("text")) == {"findings"}


# -------------------------------------------------------------- findings
def test_the_findings_text_names_the_planted_fault_as_summary_does(overflow_run, tmp_path):
    export_tensorboard(overflow_run, tmp_path)
    (event,) = read_back(tmp_path).Tensors("findings")
    assert event.step == 11  # after every other event: the reader takes a step going back for a restart
    text = tensor_util.make_ndarray(event.tensor_proto).item().decode()
    lines = text.splitlines()
    assert lines[0] == lines[-1] == "```"
    findings = amp_postmortem.summary(overflow_run).findings
    assert lines[1:-1] == [line for f in findings for line in f.lines()]  # the words of `summary`, once
    assert f"  CRITICAL  nonfinite  step {OVERFLOW_STEP}  layer block.boom" in lines
    page = text_array_to_html(tensor_util.make_ndarray(event.tensor_proto), enable_markdown=True)
    assert page.startswith("<pre><code>") and f"step {OVERFLOW_STEP}  layer block.boom" in page
