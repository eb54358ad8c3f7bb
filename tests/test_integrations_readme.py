"""The snippets of README "Attach to Trainer, Accelerate or Lightning" run
as printed, on tiny CPU models, and write the runs they promise."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from amp_postmortem.loader import load_run
from framework_runs import TokenDataset, manifest, tiny_gpt2
from test_readme import README, fenced_blocks, section

HEADING = "## Attach to Trainer, Accelerate or Lightning"


def _snippets() -> dict:
    text = section(README, HEADING)
    blocks = [b for b in fenced_blocks(README) if b.lang == "python" and "\n".join(b.lines) in text]
    by_framework = {}
    for b in blocks:
        code = "\n".join(b.lines)
        key = "hf" if "transformers" in code else "lightning" if "lightning" in code else "accelerate"
        by_framework[key] = (code, f"README.md:{b.line}")
    return by_framework


def _run(snippet, namespace):
    code, where = snippet
    # The Trainer refuses bf16 on a machine without a bf16 GPU unless told
    # to train on the CPU (the README says so).
    code = code.replace("bf16=True,", "bf16=True, use_cpu=True,")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the frameworks' advice on workers and logging
        exec(compile(code, where, "exec"), namespace)


@pytest.fixture
def workdir(tmp_path, monkeypatch, one_torch_thread):
    from accelerate.state import AcceleratorState, GradientState
    monkeypatch.chdir(tmp_path)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield tmp_path
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_readme_has_a_snippet_per_framework():
    assert set(_snippets()) == {"hf", "accelerate", "lightning"}


def test_trainer_snippet_records_every_step(workdir):
    _run(_snippets()["hf"], {"model": tiny_gpt2(), "train_dataset": TokenDataset(8)})
    run = load_run("runs/hf")
    assert len(run.steps) == 3  # 8 samples, batch 8, 3 epochs
    assert run.steps["loss"].map(math.isfinite).all() and (run.steps["micro_batches"] == 1).all()
    assert manifest("runs/hf")["autocast"]["dtype"] == "bfloat16"


def test_accelerate_snippet_records_every_micro_batch(workdir):
    model = tiny_gpt2()
    _run(_snippets()["accelerate"], {
        "model": model, "opt": torch.optim.AdamW(model.parameters(), lr=1e-3),
        "loader": torch.utils.data.DataLoader(TokenDataset(16), batch_size=2)})
    run = load_run("runs/accelerate")
    assert len(run.steps) == 2 and (run.steps["micro_batches"] == 4).all()
    assert run.steps["loss"].map(math.isfinite).all()
    assert manifest("runs/accelerate")["autocast"]["dtype"] == "bfloat16"


def test_lightning_snippet_records_the_lightning_module(workdir):
    import lightning.pytorch as L
    import torch.nn as nn

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(12, 8, generator=gen), torch.randn(12, 1, generator=gen))
    _run(_snippets()["lightning"], {"lit_module": Regressor(),
                                    "train_loader": torch.utils.data.DataLoader(data, batch_size=4)})
    run = load_run("runs/lightning")
    assert len(run.steps) == 3 and (run.steps["micro_batches"] == 1).all()
    assert run.steps["loss"].map(math.isfinite).all()
    assert manifest("runs/lightning")["autocast"]["dtype"] == "bfloat16"
