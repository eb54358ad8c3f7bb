"""Lost updates (issue 42 items 3, 4): a language model whose weights are
cast to bfloat16 and trained by AdamW at a small learning rate, measured
by the recorder (`recorders/collectors/updates.py`) and judged by
`analyses/updates.py`; the truth is computed here: AdamW's first update
against half an ulp of each bfloat16 weight."""
from __future__ import annotations

import json

import torch

import amp_postmortem as ap
import silent_runs as runs


def _lost_truth(lr: float) -> float:
    """The share of non-zero-gradient positions whose first AdamW update
    (lr * g / (|g| + eps), plus the decoupled weight decay) is below half
    an ulp of the bfloat16 weight: computed in float64."""
    torch.manual_seed(0)
    model = runs.TinyLM().to(torch.bfloat16)
    runs.lm_loss(model, runs.lm_batches(1)[0]).backward()
    lost = asked = 0
    for p in model.parameters():
        g, w = p.grad.double(), p.detach().double()
        live = g != 0
        update = lr * g / (g.abs() + 1e-8) + lr * 0.01 * w
        half_ulp = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(1e-38))) - 8)
        lost += int((live & (update.abs() < half_ulp)).sum())
        asked += int(live.sum())
    return lost / asked


def test_bf16_weights_lose_their_updates_and_are_told_why():
    truth = _lost_truth(1e-5)
    path = runs.bf16_weights_run()
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["lost_updates"]["dtypes"]) == {"bfloat16"}
    s = ap.summary(str(path))
    f = next(f for f in s.findings if f.kind == "lost_updates")
    assert truth > 0.5 and f.evidence["recent_lost_share"] > 0.5
    assert abs(f.evidence["recent_lost_share"] - truth) < 0.25
    assert f.evidence["cause"] == "no_master_weights" and f.evidence["param_dtype"] == "bfloat16"
    assert f.evidence["remedies"] == ["fp32_master_weights", "larger_learning_rate", "stochastic_rounding"]
    assert f.evidence["layers"][0]["recent_lost_share"] >= f.evidence["layers"][-1]["recent_lost_share"]
    assert "trend_per_kstep" in f.evidence["layers"][0]
    assert "healthy" not in [x.kind for x in s.findings]
    assert s.run["param_dtype"] == "bfloat16" and "parameters bfloat16" in "\n".join(s.lines())
    assert ap.recommend(str(path)).kinds() != ["no_change"]


def test_compare_states_the_parameters_dtype_beside_autocast():
    c = ap.compare(str(runs.bf16_autocast_run()), str(runs.bf16_weights_run()))
    assert c.run_b["precision"] == "bfloat16 parameters (no autocast)" and c.run_b["param_dtype"] == "bfloat16"
    assert c.run_a["autocast_dtype"] == "bfloat16" and c.run_a["param_dtype"] == "float32"


def test_bf16_autocast_over_float32_weights_is_quiet():
    path = runs.bf16_autocast_run()
    assert "lost_updates" not in json.loads((path / "manifest.json").read_text())
    s = ap.summary(str(path))
    assert [f.kind for f in s.findings] == ["healthy"]
