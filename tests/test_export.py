"""`export tensorboard`: the event file, read back with TensorBoard's own
reader, holds the recorded values."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from tensorboard.backend.event_processing import event_accumulator

from amp_postmortem.cli import main
from amp_postmortem.export import export_tensorboard
from amp_postmortem.loader import load_run
from conftest import OVERFLOW_STEP

REPO = Path(__file__).resolve().parents[1]
ATTENTION = REPO / "sample_runs" / "attention_overflow"


def read_back(logdir) -> event_accumulator.EventAccumulator:
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.SCALARS: 0})
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
