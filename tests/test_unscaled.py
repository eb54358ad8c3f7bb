"""Unscaled float16 backward, and subnormal versus flushed gradients
(issue 42 items 1, 2, 4), on a BERT classifier trained as users write it
(`silent_runs`); the truth is measured here, apart from the recorder: the
weight gradients of the same model and batch in float32 and in float16."""
from __future__ import annotations

import torch

import amp_postmortem as ap
import silent_runs as runs


def _flush_truth(scale: float) -> dict:
    """Per module: the share of weight-gradient values non-zero in float32
    that float16 autocast at loss scale `scale` makes exactly zero."""
    model = runs.bert_classifier()
    tokens, label = runs.cls_batches(1)[0]
    grads = {}
    for fp16 in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = model(input_ids=tokens, labels=label).loss
        (loss * (scale if fp16 else 1.0)).backward()
        grads[fp16] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    out = {}
    for n, g in grads[False].items():
        live = g != 0
        if n.endswith(".weight") and live.any():
            out[n.rpartition(".")[0]] = float((live & (grads[True][n] == 0)).sum() / live.sum())
    return out


def _kinds(summary) -> list:
    return [f.kind for f in summary.findings]


def test_unscaled_backward_is_named_as_the_cause_with_the_layers_that_lose_signal():
    truth = _flush_truth(1.0)
    s = ap.summary(str(runs.unscaled_run()))
    assert "unscaled_fp16_backward" in _kinds(s) and "grad_underflow" not in _kinds(s)
    f = next(f for f in s.findings if f.kind == "unscaled_fp16_backward")
    assert f.severity == "error" and f.evidence["cause"] == "no_scaler"
    named = [lay["name"] for lay in f.evidence["layers"][:3]]
    # The layers that lose the most signal lead; the truth's worst flushed module is among them.
    worst = sorted(truth, key=truth.get, reverse=True)[:2]
    assert truth[worst[0]] > 0.3 and set(named) & set(worst)
    # Not the layer with the most zeros: its zeros are structural (the positions past [CLS]).
    assert "intermediate" not in f.layer
    assert "torch.amp.GradScaler(\"cpu\")" in f.evidence["code"] and "scaler.scale(loss).backward()" in f.message


def test_unscaled_run_is_advised_a_grad_scaler_never_no_scale_fits():
    r = ap.recommend(str(runs.unscaled_run()))
    add = r.get("add_grad_scaler")
    assert add is not None and "scaler.step(optimizer)" in add.code and not add.verified
    assert all("no loss scale fits" not in rec.action for rec in r.recommendations)
    w = ap.scale_window(str(runs.unscaled_run()))
    assert w.to_dict()["estimate"]["recorded_scale"] is None
    assert not any("no usable scale" in line for line in w.lines())
    assert any("no scale judged" in line for line in w.lines())


def test_a_grad_scaler_keeps_the_gradients_and_subnormals_alone_are_an_info():
    truth = _flush_truth(65536.0)
    assert max(truth.values()) < 0.05  # with a GradScaler almost nothing flushes
    s = ap.summary(str(runs.scaled_run()))
    kinds = _kinds(s)
    assert "unscaled_fp16_backward" not in kinds and "grad_underflow" not in kinds
    # None of this findings warns (a short run's activation forecast may: not ours).
    ours = {"unscaled_fp16_backward", "grad_underflow", "grad_subnormal", "lost_updates"}
    assert all(f.severity == "info" for f in s.findings if f.kind in ours)
    assert ap.recommend(str(runs.scaled_run())).kinds() == ["no_change"]


def test_float32_run_is_quiet():
    s = ap.summary(str(runs.fp32_run()))
    assert _kinds(s) == ["healthy"]
    assert s.run["param_dtype"] == "float32"


class _Rows:
    """`ranges` as `layer_losses` reads it: the rows a flag selects."""

    def __init__(self, rows):
        import pandas as pd
        self.rows = pd.DataFrame(rows)

    def flagged(self, flag):
        return self.rows


def _row(name, told):
    # At float16's flush edge: every value zero or subnormal, the zeros counted as flushed by default.
    return {"name": name, "kind": "grad_output", "range_dtype": "float16", "absmax": 2.0 ** -23,
            "recent_underflow_share": 1.0, "flushed_zero_share": 0.5, "structural_zero_share": 0.0,
            "zero_share": 0.5, "zeros_told": told}


def test_zeros_the_rows_cannot_tell_are_read_from_a_replay_else_undetermined():
    from amp_postmortem.analyses.unscaled import (LayerZeros, ReplayedZeros, Underflow, ZerosBasis, layer_losses,
                                                  zeros_basis)
    ranges = _Rows([_row("mask", False), _row("proj", False), _row("told", True)])
    alone = {lay.name: lay for lay in layer_losses(ranges)}
    assert alone["mask"].zeros_basis is ZerosBasis.UNDETERMINED and alone["told"].zeros_basis is ZerosBasis.RECORDED
    assert zeros_basis(list(alone.values())) is ZerosBasis.UNDETERMINED
    # The replay: mask's zeros are zero in float32 too (structural), proj's were flushed.
    replayed = ReplayedZeros(step=3, rank=0, precision="fp16", loss_scale=1.0, layers={
        "mask": LayerZeros("mask", values=100, live=50, flushed=0, subnormal=50, structural=50),
        "proj": LayerZeros("proj", values=100, live=100, flushed=60, subnormal=40, structural=0)})
    told = layer_losses(ranges, replayed=replayed)
    assert [lay.name for lay in told][:2] == ["proj", "mask"]  # the signal lost leads, not the zeros
    by = {lay.name: lay for lay in told}
    assert by["mask"].zeros_basis is ZerosBasis.REPLAY and by["mask"].underflow is Underflow.SUBNORMAL
    assert by["proj"].underflow is Underflow.FLUSHED and by["told"].zeros_basis is ZerosBasis.RECORDED
    assert zeros_basis(told) is ZerosBasis.REPLAY and by["proj"].to_dict()["replayed"]["flushed_share"] == 0.6
