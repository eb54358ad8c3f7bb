"""Flushed or structural zeros read from a replay of a saved step where the
recorded rows cannot tell (issue 42 item 2): `whatif/flush.py` replays
the bundle in float32 and in the recorded precision, `analyses/unscaled.py`
and `summary` rank and qualify with it. The jobs (`silent_runs`): the BERT
classifier under float16 autocast without a GradScaler, and with one, each
keeping step BUNDLE_STEP as a bundle. The truth is measured here, apart
from the product: the same job trained by hand to that step, then the
step's gradients (every module's output gradient and every parameter's)
in float32 and under float16 autocast, compared value by value."""
from __future__ import annotations

import warnings

import pytest
import torch

import amp_postmortem as ap
import silent_runs as runs
from amp_postmortem.whatif.flush import replay_zeros


def _truth(scaled: bool) -> dict:
    """Per module: (flushed share of the values non-zero in float32,
    structural share of all values, values) over its output gradients and
    its own parameters' gradients at step BUNDLE_STEP. A full backward
    hook sees the gradients that reach a module's outputs from outside it:
    an output also used inside the module (BERT's attention probabilities)
    travels with more, and such a module is not compared."""
    from tiny_models import train
    model = runs.bert_classifier()
    batches = runs.cls_batches(runs.CLS_STEPS)
    train(model, batches[:runs.BUNDLE_STEP], optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
          scaler=scaled, dtype=torch.float16,
          loss_fn=lambda model, tokens, label, step, accumulate: model(input_ids=tokens, labels=label).loss)
    tokens, label = batches[runs.BUNDLE_STEP]
    grads = {}
    for fp16 in (False, True):
        seen: dict = {}
        # transformers' modules return dataclasses, which full backward hooks skip (and warn of): their
        # tensors are their children's outputs, counted there.
        warnings.filterwarnings("ignore", "For backward hooks to be called", UserWarning)
        warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
        hooks = [m.register_full_backward_hook(
            lambda mod, gin, gout, name=name: seen.setdefault(name, []).extend(
                g.detach().clone() for g in gout if g is not None))
            for name, m in model.named_modules() if name]
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = model(input_ids=tokens, labels=label).loss
        (loss * (65536.0 if fp16 and scaled else 1.0)).backward()
        for h in hooks:
            h.remove()
        for n, p in model.named_parameters():
            if p.grad is not None:
                seen.setdefault(n.rpartition(".")[0], []).append(p.grad.clone())
        grads[fp16] = seen
    out = {}
    for name, wide in grads[False].items():
        low = grads[True].get(name, [])
        if len(low) != len(wide):
            continue
        live = flushed = structural = values = 0
        for w, g in zip(wide, low):
            values += w.numel()
            live += int((w != 0).sum())
            flushed += int(((w != 0) & (g == 0)).sum())
            structural += int(((w == 0) & (g == 0)).sum())
        out[name] = (flushed / live if live else None, structural / values, values)
    return out


@pytest.fixture(scope="module")
def unscaled_truth():
    return _truth(scaled=False)


def test_the_replay_counts_flushed_and_structural_zeros_per_layer(unscaled_truth):
    z = replay_zeros(str(runs.unscaled_bundle_run()), runs.BUNDLE_STEP, model=runs.bert_classifier)
    assert z.step == runs.BUNDLE_STEP and z.precision == "fp16" and z.loss_scale == 1.0
    compared = 0
    for name, (flushed, structural, values) in unscaled_truth.items():
        lay = z.layers.get(name)
        if lay is None or flushed is None or lay.values != values:
            continue
        compared += 1
        assert abs(lay.flushed_share - flushed) < 0.1, name
        assert abs(lay.structural_share - structural) < 0.1, name
    assert compared >= 30
    worst = max(unscaled_truth, key=lambda n: unscaled_truth[n][0] or 0.0)
    assert unscaled_truth[worst][0] > 0.5 and z.layers[worst].flushed_share > 0.5


def test_a_grad_scaler_leaves_only_structural_zeros():
    truth = _truth(scaled=True)
    z = replay_zeros(str(runs.scaled_bundle_run()), runs.BUNDLE_STEP, model=runs.bert_classifier)
    assert z.loss_scale > 1 and z.flushed_share < 0.05
    assert max(f for f, _, _ in truth.values() if f is not None) < 0.05
    # The last layer's positions past [CLS] feed nothing: zero in any precision, as measured by hand.
    name = "bert.encoder.layer.1.intermediate.intermediate_act_fn"
    assert truth[name][1] > 0.5 and abs(z.layers[name].structural_share - truth[name][1]) < 0.05


def test_summary_reads_the_zeros_from_a_replay_where_the_rows_cannot(unscaled_truth, monkeypatch):
    from amp_postmortem.analyses import summary as summary_module
    path = str(runs.unscaled_bundle_run())
    alone = next(f for f in ap.summary(path).findings if f.kind == "unscaled_fp16_backward")
    assert alone.evidence["zeros_basis"] == "undetermined" and alone.evidence["replayed_zeros"] is None
    assert "undetermined" in alone.message and "--model SPEC" in alone.message
    # With the replay's zeros only the underflow findings are made again:
    # the run's other analyses are read once.
    reads = []
    counted = summary_module.find_nans
    monkeypatch.setattr(summary_module, "find_nans", lambda run: reads.append(1) or counted(run))
    told = next(f for f in ap.summary(path, model=runs.bert_classifier).findings
                if f.kind == "unscaled_fp16_backward")
    assert len(reads) == 1
    assert told.evidence["zeros_basis"] in ("replay", "recorded")
    assert told.evidence["replayed_zeros"]["step"] == runs.BUNDLE_STEP
    # The headline and the layers named first lose the most signal by the truth.
    named = [lay["name"] for lay in told.evidence["layers"][:3]]
    assert told.layer == named[0]
    assert all((unscaled_truth[n][0] or 0.0) > 0.5 for n in named if n in unscaled_truth)
    assert {lay["zeros_basis"] for lay in told.evidence["layers"]} <= {"replay", "recorded"}
    assert "replaying step" in told.message


def test_without_a_bundle_the_zeros_stay_undetermined():
    s = ap.summary(str(runs.unscaled_run()), model=runs.bert_classifier)
    f = next(f for f in s.findings if f.kind == "unscaled_fp16_backward")
    assert f.evidence["zeros_basis"] == "undetermined" and f.evidence["replayed_zeros"] is None
    assert "no bundle was saved" in f.message


def test_a_step_without_a_bundle_is_a_one_line_error():
    from click.testing import CliRunner

    from amp_postmortem.cli import main
    out = CliRunner().invoke(main, ["summary", str(runs.unscaled_bundle_run()), "--model",
                                    "tests/silent_runs.py:bert_classifier", "--step", "99"])
    assert out.exit_code == 2 and out.output.startswith("Error: no bundle for step 99")
    assert len(out.output.strip().splitlines()) == 1
