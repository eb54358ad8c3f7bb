"""The op probe (recorders/collectors/probe.py): `intermediate` rows of the
operations inside probed modules, recorded without changing the training."""
import inspect
import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from amp_postmortem.reading.loader import load_run
from conftest import PROBE_STEPS, record_probed_run
from recorders import AmpRecorder, OptionError, ProbeOptions
from recorders.format import schema
from tiny_models import HalfNorm, ProbeNet, batches, recorder_at, train


def _tensors(run):
    return load_run(run).scan_tensors()


def _planted_line() -> int:
    lines, first = inspect.getsourcelines(HalfNorm.forward)
    return first + next(i for i, line in enumerate(lines) if "PLANTED" in line)


def test_every_op_of_a_probed_module_is_a_row_with_its_op_dtype_and_line(probed_run):
    df = _tensors(probed_run)
    inside = df[df["kind"] == "intermediate"]
    assert set(inside["step"]) == set(range(PROBE_STEPS))
    assert set(inside["name"]) == {"block.norm", "block.attn"}
    norm = inside[(inside["name"] == "block.norm") & (inside["step"] == 0)].sort_values("op_index")
    # x.mean, x - mean, xc * xc, .mean, + eps, sqrt, /, * weight: views are not rows
    assert list(norm["op"]) == ["aten::mean", "aten::sub", "aten::mul", "aten::mean", "aten::add",
                                "aten::sqrt", "aten::div", "aten::mul"]
    assert list(norm["op_index"]) == list(range(8))
    # as CPU autocast ran them: float16, until the float32 weight promotes the last
    assert list(norm["dtype"]) == ["float16"] * 7 + ["float32"]
    square = norm.iloc[2]
    assert square["source"].endswith(f"tiny_models.py:{_planted_line()}")
    assert 60000 < square["absmax"] < schema.FP16_MAX
    # The module's output, and every other row kind, are as without a probe.
    out = df[(df["name"] == "block.norm") & (df["kind"] == "activation") & (df["step"] == 0)].iloc[0]
    assert out["absmax"] < 10
    assert int(out["order"]) == int(square["order"])  # the rows sit with their module's output
    others = df[df["kind"] != "intermediate"]
    assert others["op"].isna().all() and others["op_index"].isna().all() and others["source"].isna().all()


def test_the_masks_minus_inf_is_counted_but_is_no_event(probed_run):
    df = _tensors(probed_run)
    fill = df[(df["kind"] == "intermediate") & (df["op"] == "aten::masked_fill")]
    assert len(fill) == PROBE_STEPS and (fill["inf_count"] > 0).all()
    assert (df.loc[df["kind"] != "intermediate", ["nan_count", "inf_count"]] == 0).all().all()
    run = load_run(probed_run)
    # No shard counts a non-finite row, no first NaN/Inf, no full-tier burst.
    assert all(s.nonfinite_rows == 0 for s in run.select_shards())
    assert list(run.steps["tier"]) == ["full"] + ["cheap"] * (PROBE_STEPS - 1)  # step 0 by period only
    assert not run.manifest.get("bundles")  # no nonfinite_tensor bundle either


def test_no_on_event_call_for_a_masks_minus_inf(tmp_path):
    events = []
    run, _ = record_probed_run(tmp_path / "run", steps=2, on_event=events.append)
    assert events == []
    inside = _tensors(run)
    assert (inside.loc[inside["op"] == "aten::masked_fill", "inf_count"] > 0).all()


def test_micro_batches_merge_into_one_row_per_op(tmp_path):
    torch.manual_seed(0)
    train(ProbeNet(), batches(4, shape=(2, 6)), accumulate=2, lr=0.01,
          recorder=recorder_at(tmp_path / "run", probe=["block.norm"]))
    inside = _tensors(tmp_path / "run")
    inside = inside[inside["kind"] == "intermediate"]
    assert sorted(set(inside["step"])) == [0, 1]
    step0 = inside[inside["step"] == 0]
    assert list(step0["op_index"]) == list(range(8)) and set(step0["call"]) == {0}
    assert step0.iloc[2]["numel"] == 2 * 2 * 6 * 16  # x * x of both micro-batches


def test_nested_probes_give_each_op_to_the_innermost_probed_module(tmp_path):
    run, _ = record_probed_run(tmp_path / "run", probe=["block", "block.norm"], steps=1)
    inside = _tensors(run)
    inside = inside[inside["kind"] == "intermediate"]
    by_module = {n: list(g.sort_values("op_index")["op"]) for n, g in inside.groupby("name")}
    assert by_module["block.norm"][2] == "aten::mul" and len(by_module["block.norm"]) == 8
    # block's own ops are attn's (not probed on its own here): its linear, its
    # logits, the mask, the softmax; none of norm's.
    assert "aten::masked_fill" in by_module["block"] and "aten::bmm" in by_module["block"]
    assert "aten::sqrt" not in by_module["block"]


def test_probing_changes_no_loss_no_weight_and_no_gradient_bit(tmp_path):
    def trained(**options):
        torch.manual_seed(0)
        model = ProbeNet()
        grads = []
        out = train(model, batches(3, shape=(2, 6)), lr=0.01,
                    recorder=recorder_at(tmp_path / str(len(list(tmp_path.iterdir()))), **options),
                    before_update=lambda step, m: grads.append([p.grad.clone() for p in m.parameters()]))
        return out, grads

    (plain, plain_grads), (probed, probed_grads) = trained(), trained(probe=["block", "block.norm"])
    assert probed.losses == plain.losses
    assert all(torch.equal(a, b) for a, b in zip(plain.params, probed.params))
    assert all(torch.equal(a, b) for s, t in zip(plain_grads, probed_grads) for a, b in zip(s, t))
    leaves, _ = trained(probe=ProbeOptions(full_tier_leaves=True), full_every=1)
    assert leaves.losses == plain.losses
    assert all(torch.equal(a, b) for a, b in zip(plain.params, leaves.params))


def test_without_a_probe_nothing_is_hooked_or_written(tmp_path):
    torch.manual_seed(0)
    plain = train(ProbeNet(), batches(2, shape=(2, 6)), recorder=recorder_at(tmp_path / "plain"), close=False).rec
    torch.manual_seed(0)
    probed = train(ProbeNet(), batches(2, shape=(2, 6)), close=False,
                   recorder=recorder_at(tmp_path / "probed", probe=["block.norm"])).rec
    assert plain.hooks.probe is None
    assert len(probed.hooks.step_handles) == len(plain.hooks.step_handles) + 2  # one pre-hook, one forward hook
    plain.close()
    probed.close()
    assert "probe" not in load_run(tmp_path / "plain").manifest["recorder"]
    assert load_run(tmp_path / "probed").manifest["recorder"]["probe"]["probed"] == ["block.norm"]
    df = _tensors(tmp_path / "plain")
    assert "intermediate" not in set(df["kind"]) and df["op"].isna().all()


def test_full_tier_leaves_are_probed_on_full_tier_steps_only(tmp_path):
    run, _ = record_probed_run(tmp_path / "run", probe=ProbeOptions(full_tier_leaves=True), steps=3,
                               full_every=2)
    inside = _tensors(run)
    inside = inside[inside["kind"] == "intermediate"]
    assert sorted(set(inside["step"])) == [0, 2]
    # the watched leaves: embed, block.norm, block.attn.qkv, head (attn has a child)
    assert set(inside["name"]) == {"embed", "block.norm", "block.attn.qkv", "head"}
    linear = inside[inside["name"] == "embed"]
    assert "aten::_to_copy" in set(linear["op"])  # autocast's casts are ops of their own


def test_ops_beyond_max_ops_per_call_are_not_recorded(tmp_path):
    run, _ = record_probed_run(tmp_path / "run", probe=ProbeOptions(["block.norm"], max_ops_per_call=3), steps=1)
    inside = _tensors(run)
    assert list(inside.loc[inside["kind"] == "intermediate", "op_index"]) == [0, 1, 2]


def test_a_probe_failure_turns_recording_off_and_the_training_goes_on(tmp_path, monkeypatch):
    from recorders.collectors import probe as probe_module

    def broken(*args, **kwargs):
        raise RuntimeError("probe statistics broke")

    monkeypatch.setattr(probe_module, "row_stats", broken)
    torch.manual_seed(0)
    plain = train(ProbeNet(), batches(3, shape=(2, 6)), lr=0.01)
    with pytest.warns(RuntimeWarning, match="recording disabled.*probe statistics broke"):
        torch.manual_seed(0)
        probed = train(ProbeNet(), batches(3, shape=(2, 6)), lr=0.01,
                       recorder=recorder_at(tmp_path / "run", probe=["block.norm"]))
    assert not probed.rec.enabled
    assert probed.losses == plain.losses  # the op's result went on as computed
    assert torch._C._len_torch_dispatch_stack() == 0  # the mode did not stay pushed


def test_a_forward_that_raises_inside_a_probed_module_pops_the_mode(tmp_path):
    model = ProbeNet()
    rec = AmpRecorder(tmp_path / "run", model, probe=["block.norm"])
    model.block.norm.weight.data = torch.ones(3)  # a shape mismatch inside the probed forward
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 6, 8))
    assert torch._C._len_torch_dispatch_stack() == 0
    rec.close()


def test_probe_options_are_checked_at_construction(tmp_path):
    with pytest.raises(OptionError, match="probe=3"):
        AmpRecorder(tmp_path / "a", ProbeNet(), probe=3)
    with pytest.raises(OptionError, match="max_ops_per_call=0"):
        ProbeOptions(["x"], max_ops_per_call=0)
    with pytest.warns(RuntimeWarning, match="'blocks.0' name no module"):
        AmpRecorder(tmp_path / "b", ProbeNet(), probe=["blocks.0"]).close()


class CheckpointedProbeNet(ProbeNet):
    """ProbeNet with its block under activation checkpointing: the block's
    forward runs again in the backward pass."""

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return self.head(checkpoint(self.block, self.embed(x), use_reentrant=False))


def test_a_checkpoints_recomputation_in_backward_is_not_probed(tmp_path):
    def trained(**options):
        torch.manual_seed(0)
        return train(CheckpointedProbeNet(), batches(2, shape=(2, 6)), lr=0.01,
                     recorder=recorder_at(tmp_path / str(len(list(tmp_path.iterdir()))), **options))

    plain, probed = trained(), trained(probe=["block.norm"])
    assert probed.losses == plain.losses
    assert all(torch.equal(a, b) for a, b in zip(plain.params, probed.params))
    inside = _tensors(tmp_path / "1")
    inside = inside[inside["kind"] == "intermediate"]
    # the forward's 8 ops once per step (call 0), none from the recomputation
    assert len(inside) == 2 * 8 and set(inside["call"]) == {0}
