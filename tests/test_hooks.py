"""recorders.hooks: step boundaries and autocast read where the model's
modules run, not only at the root's forward."""
from __future__ import annotations

import json

import torch
import torch.nn as nn

from framework_runs import read_table
from recorders import AmpRecorder, schema


class Container(nn.Module):
    """Like a LightningModule: the loop calls its submodules, never it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)


def test_a_root_whose_forward_never_runs_is_recorded_per_micro_batch(tmp_path):
    model = Container()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with AmpRecorder(tmp_path / "run", model, optimizer=opt, full_every=1, bundles=False) as rec:
        for _ in range(2):
            for _ in range(3):  # three micro-batches per optimizer step
                x = torch.randn(5, 4, generator=g)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model.head(model.body(x)).float().pow(2).mean()
                loss.backward()
            opt.step()
            opt.zero_grad()
            rec.step(loss)
    steps = read_table(tmp_path / "run", "steps")
    assert steps["micro_batches"].tolist() == [3, 3]
    tensors = read_table(tmp_path / "run", "tensors")
    step0 = tensors[tensors.step == 0]
    inputs = step0[step0.kind == "input"]
    assert inputs["name"].tolist() == [schema.INPUT_NAME] and inputs["numel"].tolist() == [3 * 5 * 4]
    assert set(step0[step0.kind == "activation"]["name"]) == {"body", "head"}
    assert set(step0[step0.kind == "param"]["name"]) == {"body.weight", "body.bias", "head.weight", "head.bias"}
    # The batch comes first, then the modules in the order they ran.
    fwd = step0[step0.phase == "forward"].sort_values("order")
    assert fwd["name"].tolist()[:3] == [schema.INPUT_NAME, "body", "head"]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["autocast"]["dtype"] == "bfloat16"


class AutocastInside(nn.Module):
    """Enters autocast inside its forward, after its pre-hooks ran, as
    Accelerate's prepared model does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.fc(x)


def test_autocast_is_read_where_the_children_run(tmp_path):
    model = AutocastInside()
    with AmpRecorder(tmp_path / "run", model, bundles=False) as rec:
        model(torch.randn(2, 4)).float().sum().backward()
        rec.step()
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["autocast"] == {"enabled": True, "device_type": "cpu", "dtype": "bfloat16",
                                    "cache_enabled": True}


class EmbedFirst(nn.Module):
    """The loop looks the embedding up itself, then calls the model on it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 1)

    def forward(self, h):
        return self.fc(h)


def test_a_submodule_called_before_the_model_opens_no_extra_micro_batch(tmp_path):
    model = EmbedFirst()
    with AmpRecorder(tmp_path / "run", model, bundles=False) as rec:
        for _ in range(3):
            for _ in range(2):
                model(model.embed(torch.arange(6))).sum().backward()
            rec.step()
    assert read_table(tmp_path / "run", "steps")["micro_batches"].tolist() == [2, 2, 2]


class PreparedEmbedFirst(EmbedFirst):
    """Autocast entered inside the root's forward (as Accelerate prepares a
    model), its embedding looked up by the loop outside it."""

    def forward(self, h):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.fc(h)


def test_a_child_called_outside_autocast_does_not_hide_the_autocast_inside(tmp_path):
    model = PreparedEmbedFirst()
    with AmpRecorder(tmp_path / "run", model, bundles=False) as rec:
        for _ in range(2):
            model(model.embed(torch.arange(6))).float().sum().backward()
            rec.step()
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["autocast"] == {"enabled": True, "device_type": "cpu", "dtype": "bfloat16",
                                    "cache_enabled": True}
    assert read_table(tmp_path / "run", "steps")["micro_batches"].tolist() == [1, 1]
