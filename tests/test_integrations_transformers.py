"""recorders.integrations.transformers: the callback on a real `Trainer`
(tiny GPT-2 from a config, CPU, bf16 autocast through Accelerate)."""
from __future__ import annotations

import math

import pytest
import torch

from framework_runs import (TokenDataset, called_modules, manifest, read_table, same_weights,
                            summary_json, tiny_gpt2, token_batches)

STEPS, ACCUM = 3, 2


@pytest.fixture(autouse=True)
def fresh_accelerate_state(one_torch_thread):
    """Accelerate keeps its state in process-wide singletons; each Trainer
    here starts from a clean one."""
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def train(tmp_path, callbacks=(), scaler=None, plant=None):
    from transformers import Trainer, TrainingArguments
    model = tiny_gpt2()
    if plant is not None:
        plant(model)
    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=ACCUM, max_steps=STEPS, bf16=True,
                             use_cpu=True, report_to="none", save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, learning_rate=1e-3, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(STEPS * ACCUM * 2),
                      callbacks=list(callbacks))
    if scaler is not None:
        # Accelerate makes no GradScaler on a CPU; attached here it is the
        # one its optimizer and backward use, as on a GPU with fp16=True.
        trainer.accelerator.scaler = scaler
    trainer.train()
    return model


def test_trainer_run_records_every_step_module_and_loss_without_changing_training(tmp_path):
    from recorders.integrations.transformers import AmpPostmortemCallback

    run = tmp_path / "hf"
    recorded = train(tmp_path, [AmpPostmortemCallback(run, full_every=1)])
    plain = train(tmp_path)
    assert same_weights(recorded, plain)

    steps = read_table(run, "steps").sort_values("step")
    assert steps["step"].tolist() == [0, 1, 2]
    assert (steps["micro_batches"] == ACCUM).all()
    # No scaler under bf16: the loss is the one the model returns (labels=),
    # summed over the step's micro-batches.
    assert steps["loss"].notna().all() and steps["loss"].map(math.isfinite).all()
    assert steps["loss_scale"].isna().all()
    assert [round(lr[0], 6) for lr in steps["lr"]] == [0.001, 0.000667, 0.000333]
    m = manifest(run)
    assert m["autocast"] == {"enabled": True, "device_type": "cpu", "dtype": "bfloat16",
                             "cache_enabled": True}
    assert m["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    assert m["status"] == "closed"

    tensors = read_table(run, "tensors")
    model = tiny_gpt2()
    ran = called_modules(model, lambda: model(**token_batches(1)[0]))
    assert set(tensors[tensors.kind == "activation"]["name"]) == ran
    assert set(tensors[tensors.kind == "param_grad"]["name"]) == {n for n, _ in model.named_parameters()}
    bf16_rows = tensors[(tensors.kind == "activation") & (tensors.name == "transformer.h.0.mlp.c_fc")]
    assert set(bf16_rows["dtype"]) == {"bfloat16"}

    report = summary_json(run)
    assert report["run"]["dtype"] == "bfloat16"
    assert report["run"]["nonfinite_loss_steps"] == 0
    assert [f["kind"] for f in report["findings"]] == ["healthy"]


def _nan_in_third_forward(model):
    calls = []

    def hook(module, args, output):
        calls.append(1)
        return output * math.nan if len(calls) == 3 else output

    model.transformer.ln_f.register_forward_hook(hook)


def test_trainer_with_scaler_counts_a_nan_first_micro_batch_as_nonfinite_loss(tmp_path):
    from recorders.integrations.transformers import AmpPostmortemCallback

    run = tmp_path / "hf_scaler"
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    train(tmp_path, [AmpPostmortemCallback(run)], scaler=scaler, plant=_nan_in_third_forward)
    assert "scale" not in scaler.__dict__  # the tap is gone after training

    steps = read_table(run, "steps").sort_values("step")
    # Forward 3 is the first micro-batch of step 1: its NaN loss is the
    # step's, though the micro-batch after it was finite.
    assert steps["loss"].map(math.isfinite).tolist() == [True, False, True]
    assert steps["skipped"].tolist() == [False, True, False]
    assert steps["loss_scale"].tolist() == [256.0, 128.0, 128.0]
    assert (steps["micro_batches"] == ACCUM).all()
    report = summary_json(run)
    assert report["run"]["nonfinite_loss_steps"] == 1
    assert report["run"]["skipped_steps"] == 1
