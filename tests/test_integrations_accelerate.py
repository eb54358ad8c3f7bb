"""Accelerate needs no glue: `AmpRecorder` takes the prepared model, the
`AcceleratedOptimizer` and `accelerator.scaler` as they are (tiny GPT-2 from
a config, CPU, gradient accumulation through `accelerator.accumulate`)."""
from __future__ import annotations

import math

import pytest
import torch

from framework_runs import manifest, read_table, same_weights, summary_json, tiny_gpt2, token_batches
from recorders import AmpRecorder

STEPS, ACCUM = 3, 2


@pytest.fixture(autouse=True)
def fresh_accelerate_state(one_torch_thread):
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def train(run=None, *, mixed_precision="bf16", scaler=None, autocast_dtype=None, nan_at=None):
    """`nan_at`: the micro-batch (counted from 0) whose logits are made NaN."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(mixed_precision=mixed_precision, cpu=True, gradient_accumulation_steps=ACCUM)
    if scaler is not None:
        acc.scaler = scaler  # Accelerate makes none on a CPU; attached before prepare, it is used
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    rec = AmpRecorder(run, model, optimizer=opt, scaler=acc.scaler, full_every=1) if run else None
    # Its own loop: Accelerate's (accumulate(), acc.backward(), sync_gradients), which the test is about.
    for i, batch in enumerate(token_batches(STEPS * ACCUM)):
        with acc.accumulate(model):
            with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
                out = model(**batch)
            loss = out.loss * math.nan if i == nan_at else out.loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        if rec is not None and acc.sync_gradients:
            rec.step()
    if rec is not None:
        rec.close()
    return acc.unwrap_model(model)


def test_prepared_objects_are_recorded_as_they_are_with_accumulation(tmp_path):
    run = tmp_path / "accelerate_bf16"
    recorded = train(run)
    assert same_weights(recorded, train())

    steps = read_table(run, "steps").sort_values("step")
    assert steps["step"].tolist() == [0, 1, 2]
    assert (steps["micro_batches"] == ACCUM).all()
    assert steps["loss"].map(math.isfinite).all()
    assert steps["grad_norm"].notna().all()  # the optimizer hook sat on the real AdamW
    m = manifest(run)
    # Accelerate enters autocast inside the root's forward: read in its children.
    assert m["autocast"]["enabled"] and m["autocast"]["dtype"] == "bfloat16"
    assert m["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    assert summary_json(run)["run"]["nonfinite_loss_steps"] == 0


def test_a_nan_in_any_micro_batch_makes_the_step_a_nonfinite_loss_step(tmp_path):
    run = tmp_path / "accelerate_fp16"
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    train(run, mixed_precision="no", scaler=scaler, autocast_dtype=torch.float16, nan_at=2)

    steps = read_table(run, "steps").sort_values("step")
    # Micro-batch 2 is the first of step 1; the second one's loss was finite.
    assert steps["loss"].map(math.isfinite).tolist() == [True, False, True]
    assert steps["skipped"].tolist() == [False, True, False]
    assert steps["loss_scale"].tolist() == [256.0, 128.0, 128.0]
    assert manifest(run)["autocast"]["dtype"] == "float16"
    report = summary_json(run)
    assert report["run"]["nonfinite_loss_steps"] == 1 and report["run"]["skipped_steps"] == 1
