"""The snippets of docs/RECORDER.md "Attach to Trainer, Accelerate or
Lightning", and the Trainer and Lightning ones of README.md "Attach in three
lines", run as printed, on tiny CPU models, and write the runs they promise."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from amp_postmortem.reading.loader import load_run
from framework_runs import TokenDataset, manifest, tiny_gpt2
from test_readme import README, RECORDER, section_snippets

SOURCES = {"recorder": (RECORDER, "## Attach to Trainer, Accelerate or Lightning"),
           "readme": (README, "## Attach in three lines")}


def _snippets(source: str = "recorder") -> dict:
    path, heading = SOURCES[source]
    by_framework = {}
    for b in section_snippets(path, heading):
        code = "\n".join(b.lines)
        if source == "readme" and "AmpPostmortemCallback" not in code:
            continue  # the plain loop: tests/test_readme.py
        key = "hf" if "transformers" in code else "lightning" if "lightning" in code else "accelerate"
        by_framework[key] = (code, f"{path.name}:{b.line}")
    return by_framework


def _run(snippet, namespace):
    code, where = snippet
    # The Trainer refuses bf16 on a machine without a bf16 GPU unless told
    # to train on the CPU (the page says so).
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


def test_docs_have_a_snippet_per_framework():
    assert set(_snippets("recorder")) == {"hf", "accelerate", "lightning"}
    assert set(_snippets("readme")) == {"hf", "lightning"}


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_trainer_snippet_records_every_step(workdir, source):
    _run(_snippets(source)["hf"], {"model": tiny_gpt2(), "train_dataset": TokenDataset(8)})
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


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_lightning_snippet_records_the_lightning_module(workdir, source):
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
    _run(_snippets(source)["lightning"], {"lit_module": Regressor(),
                                    "train_loader": torch.utils.data.DataLoader(data, batch_size=4)})
    run = load_run("runs/lightning")
    assert len(run.steps) == 3 and (run.steps["micro_batches"] == 1).all()
    assert run.steps["loss"].map(math.isfinite).all()
    assert manifest("runs/lightning")["autocast"]["dtype"] == "bfloat16"
