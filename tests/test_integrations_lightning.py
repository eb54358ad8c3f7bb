"""recorders.integrations.lightning: the callback on a real Lightning
`Trainer` (CPU; bf16-mixed, and 16-mixed through an explicit MixedPrecision
plugin with a CPU GradScaler, since the Trainer rewrites "16-mixed" to bf16
on a CPU). The LightningModule's own forward never runs: `training_step`
calls its submodules."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from recorders.format import schema
from framework_runs import manifest, read_table, same_weights, summary_json

STEPS = 3


def _module(manual: bool, plant_nan_at: int | None = None):
    import lightning.pytorch as L

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
            self.head = nn.Linear(16, 1)
            self.automatic_optimization = not manual
            self.batches = 0

        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.batches == plant_nan_at:
                x = x.clone()
                x[0, 0] = math.nan
            self.batches += 1
            loss = F.mse_loss(self.head(self.body(x)).float(), y)
            if not manual:
                return loss
            opt = self.optimizers()
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Regressor()


def fit(module, *, precision, accumulate=1, callbacks=()):
    import lightning.pytorch as L
    from lightning.pytorch.plugins import MixedPrecision

    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen))
    plugins = []
    if precision == "16-mixed":
        plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, accumulate_grad_batches=accumulate,
                        precision=None if plugins else precision, plugins=plugins, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=list(callbacks))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and logging
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    return trainer


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


def test_automatic_bf16_with_accumulation_records_the_module_completely(tmp_path):
    from recorders.integrations.lightning import AmpPostmortemCallback

    run = tmp_path / "pl_bf16"
    recorded = _module(manual=False)
    fit(recorded, precision="bf16-mixed", accumulate=2, callbacks=[AmpPostmortemCallback(run, full_every=1)])
    plain = _module(manual=False)
    fit(plain, precision="bf16-mixed", accumulate=2)
    assert same_weights(recorded, plain)

    steps = read_table(run, "steps").sort_values("step")
    assert steps["step"].tolist() == [0, 1, 2]
    assert (steps["micro_batches"] == 2).all()
    assert steps["loss"].map(math.isfinite).all()
    assert steps["loss_scale"].isna().all()
    assert manifest(run)["autocast"] == {"enabled": True, "device_type": "cpu", "dtype": "bfloat16",
                                         "cache_enabled": False}
    tensors = read_table(run, "tensors")
    by_kind = tensors.groupby("kind")["name"].agg(set).to_dict()
    # The root's forward never ran: every module below it is recorded, and
    # the batch appears as the first called module's input.
    assert by_kind["activation"] == {"body", "body.0", "body.1", "head"}
    assert by_kind["input"] == {schema.INPUT_NAME}
    assert by_kind["param"] == by_kind["param_grad"] == {"body.0.weight", "body.0.bias", "head.weight", "head.bias"}
    inputs = tensors[tensors.kind == "input"]
    assert inputs.groupby("step")["numel"].sum().tolist() == [2 * 4 * 8] * STEPS  # both micro-batches
    assert summary_json(run)["run"]["dtype"] == "bfloat16"


def test_manual_16_mixed_records_the_scaler_and_a_nan_loss_step(tmp_path):
    from recorders.integrations.lightning import AmpPostmortemCallback

    run = tmp_path / "pl_fp16"
    recorded = _module(manual=True, plant_nan_at=1)
    trainer = fit(recorded, precision="16-mixed", callbacks=[AmpPostmortemCallback(run)])
    plain = _module(manual=True, plant_nan_at=1)
    fit(plain, precision="16-mixed")
    assert same_weights(recorded, plain)
    assert "scale" not in trainer.precision_plugin.scaler.__dict__  # the tap is gone

    steps = read_table(run, "steps").sort_values("step")
    assert steps["step"].tolist() == [0, 1, 2]
    assert (steps["micro_batches"] == 1).all()
    assert steps["loss"].map(math.isfinite).tolist() == [True, False, True]
    assert steps["skipped"].tolist() == [False, True, False]
    assert steps["loss_scale"].tolist() == [256.0, 128.0, 128.0]
    assert manifest(run)["autocast"]["dtype"] == "float16"
    report = summary_json(run)
    assert report["run"]["nonfinite_loss_steps"] == 1 and report["run"]["skipped_steps"] == 1
