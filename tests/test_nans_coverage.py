"""Origins on steps that did not record the rows deciding them: a compiled
model recorded without in-graph rows (`compiled_rows=False`, the default)
has, on its compiled steps, the loss and the parameter gradients (and, with
the recorder attached to the compiled module, the model's boundary), no
module's activation or gradient. There the absence of a non-finite row
proves nothing: `nans`, `summary` and `scale` must not name a layer from
it, and name the one a later step's module rows show when they can.

The jobs compile with `aot_eager` (eager kernels, so fast and
deterministic); the planted Inf is a deterministic fault."""
from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import torch._dynamo

from amp_postmortem.analyses.nans import OriginBasis, Coverage, backward_origin, find_nans, forward_origin
from amp_postmortem.analyses.scale import scale_dynamics
from amp_postmortem.analyses.summary import summarize
from amp_postmortem.reading.loader import load_run
from recorders import AmpRecorder
from tiny_models import TinyNet, batches, train

PLANT_AT = 5  # a compiled (cheap-tier) step: full_every=4 runs steps 0, 4, 8 eagerly
PLANTED = "blocks.0.mlp.0"

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # bundles a compiled step cannot capture


def _job(run, attach: str, steps: int, *, plant: bool = True, scaler_scale: float | None = None,
         loss_mult: float = 1.0) -> None:
    """A bf16 autocast job on a one-block TinyNet, compiled (`attach`:
    "before"/"after" the recorder) or eager ("eager"); an Inf planted in
    PLANTED's weight before step PLANT_AT; `scaler_scale`: a GradScaler
    with that init_scale (None: no scaler, SGD applies what it gets)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyNet(blocks=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=scaler_scale) if scaler_scale else None
    options = dict(optimizer=opt, scaler=scaler, full_every=4)
    rec = AmpRecorder(run, model, **options) if attach in ("before", "eager") else None
    compiled = torch.compile(model, backend="aot_eager") if attach != "eager" else model
    if rec is None:
        rec = AmpRecorder(run, compiled, **options)

    def plant_inf(step, _, x):
        if plant and step == PLANT_AT:
            with torch.no_grad():
                model.blocks[0].mlp[0].weight[3, 5] = math.inf

    train(compiled, batches(steps), recorder=lambda *_: rec, optimizer=opt, dtype=torch.bfloat16, scaler=scaler,
          on_step=plant_inf, loss_fn=lambda m, x, y, step, accumulate: ((m(x).float() - y) ** 2).mean() * loss_mult)


def test_a_compiled_step_without_module_rows_names_no_layer(tmp_path):
    run = tmp_path / "run"
    _job(run, "before", 10)  # no scaler: step 5's update makes the weights NaN
    rep = find_nans(load_run(run))
    fwd, bwd = rep.origins["forward"], rep.origins["backward"]
    assert fwd.step == PLANT_AT and bwd.step == PLANT_AT
    # Only the loss and parameter gradients were recorded on step 5: the
    # first non-finite rows are named, as undetermined, never as origins.
    assert (fwd.name, fwd.basis, fwd.certain) == ("<loss>", OriginBasis.UNRECORDED, False)
    assert (bwd.kind, bwd.basis, bwd.certain) == ("param_grad", OriginBasis.UNRECORDED, False)
    assert rep.compiled_without_rows
    # Step 8 (full tier, eager) has module rows, but ran on the NaN weights
    # step 5's update made: it cannot decide step 5's origin.
    assert rep.later_origins == {"forward": None, "backward": None}
    assert rep.weights_nonfinite_from == PLANT_AT
    table = rep.table()
    assert not (table["role"] == "ORIGIN").any()
    assert set(table.loc[table["role"] == "undetermined", "name"]) == {"<loss>", bwd.tensor}
    d = rep.to_dict()
    assert d["origins"]["forward"]["basis"] == "unrecorded" and d["weights_nonfinite_from"] == PLANT_AT
    assert "undetermined" in rep.lines()[0] and "compiled_rows=True" in rep.lines()[0]

    finding = next(f for f in summarize(load_run(run)).findings if f.kind == "nonfinite")
    assert finding.layer is None
    assert "first recorded in <loss>" in finding.message and "undetermined" in finding.message
    assert "first made by" not in finding.message


@pytest.mark.parametrize("attach", ["before", "after"])
def test_a_later_step_with_module_rows_names_the_layer(tmp_path, attach):
    run = tmp_path / "run"
    # A scaler skips the Inf steps: the weights keep the one planted Inf,
    # so the next eager full-tier step makes the same Inf at its layer.
    _job(run, attach, 10, scaler_scale=2.0 ** 8)
    rep = find_nans(load_run(run))
    fwd = rep.origins["forward"]
    assert fwd.step == PLANT_AT and not fwd.certain
    # Attached to the compiled module the model's output row was recorded:
    # made inside the model, which of its layers undetermined.
    expected = (OriginBasis.UNRECORDED, "<loss>") if attach == "before" else (OriginBasis.WITHIN, "")
    assert (fwd.basis, fwd.name) == expected
    later = rep.later_origins["forward"]
    assert later is not None and later.step > PLANT_AT and later.certain
    assert (later.name, later.kind) == (PLANTED, "activation")
    assert rep.weights_nonfinite_from is None
    table = rep.table()
    origin_rows = table[table["role"] == "ORIGIN"]
    assert (PLANTED, "activation", later.step) in set(zip(origin_rows["name"], origin_rows["kind"],
                                                          origin_rows["first_step"]))
    assert f"names {PLANTED} (activation)" in rep.lines()[0]

    finding = next(f for f in summarize(load_run(run)).findings if f.kind == "nonfinite")
    assert finding.layer == PLANTED and finding.step == PLANT_AT
    assert "undetermined" in finding.message


@pytest.mark.parametrize("attach", ["eager", "before"])
def test_skips_of_compiled_steps_name_no_overflow_driver(tmp_path, attach):
    """A scale so large that the scaled loss (about 5 x 2**127) overflows
    float32 until two back-offs: the eager job's skipped steps show the
    gradient non-finite where it enters the model (`<loss>`); the compiled
    job's steps recorded no gradient of any module, and their parameter
    gradients' order is their hooks', so they name none."""
    run = tmp_path / "run"
    _job(run, attach, 6, plant=False, scaler_scale=2.0 ** 127, loss_mult=4.0)
    run_ = load_run(run)
    assert run_.step_series().steps["skipped_any"].sum() >= 2  # the overflows happened
    report = scale_dynamics(run_)
    assert report.drivers == (["<loss>"] if attach == "eager" else [])


def _rows(*rows):
    cols = ["step", "rank", "name", "kind", "phase", "order", "call", "nan_count", "inf_count", "input_nonfinite"]
    return pd.DataFrame([dict(zip(cols, r)) for r in rows], columns=cols)


NOTHING = Coverage(frozenset(), False, False)
EVERYTHING = Coverage(frozenset({"activation", "grad_output", "grad_input"}), True, True)
BOUNDARY = Coverage(frozenset({"activation", "grad_output"}), False, False)  # attached to a compiled module


def test_the_loss_is_an_origin_only_where_activations_were_recorded():
    rows = _rows((3, 0, "<loss>", "loss", "forward", 0, 0, 1, 0, math.nan))
    assert forward_origin(rows).basis is OriginBasis.RULE  # no coverage given: an eager step
    assert forward_origin(rows, EVERYTHING).certain
    assert forward_origin(rows, BOUNDARY).certain  # the model's output was recorded, finite
    o = forward_origin(rows, NOTHING)
    assert (o.name, o.basis, o.certain) == ("<loss>", OriginBasis.UNRECORDED, False)


def test_the_models_output_alone_is_made_within_the_model():
    rows = _rows((3, 0, "", "activation", "forward", 0, 0, 0, 4, 0))
    o = forward_origin(rows, BOUNDARY, lambda name: True)
    assert (o.name, o.basis, o.certain) == ("", OriginBasis.WITHIN, False)
    assert forward_origin(rows, EVERYTHING, lambda name: True).certain  # its modules were recorded, finite
    assert forward_origin(rows, BOUNDARY, lambda name: False).certain  # a model without watched modules


def test_a_parameter_gradient_is_an_origin_only_where_its_modules_gradient_was_recorded():
    rows = _rows((3, 0, "a.weight", "param_grad", "backward", 0, 0, 0, 9, math.nan),
                 (3, 0, "b.weight", "param_grad", "backward", 1, 0, 0, 9, math.nan))
    o = backward_origin(rows, EVERYTHING)
    assert (o.name, o.kind, o.basis) == ("a", "param_grad", OriginBasis.RULE)
    for covered in (NOTHING, BOUNDARY):
        o = backward_origin(rows, covered)
        assert (o.name, o.basis, o.certain) == ("a.weight", OriginBasis.UNRECORDED, False)
    # A grad_input with its own measured input count decides without coverage.
    rows = _rows((3, 0, "a", "grad_input", "backward", 0, 0, 0, 9, 0))
    assert backward_origin(rows, NOTHING).certain


def test_a_step_whose_origin_needs_no_coverage_is_not_read_again(overflow_run, monkeypatch):
    """An eager run's origins (an activation made from finite inputs, the
    gradient non-finite where it enters the model) are the same whatever
    was recorded: no shard is opened to ask what the step recorded."""
    from amp_postmortem.analyses import nans

    calls = []
    real = nans.coverage
    monkeypatch.setattr(nans, "coverage", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    rep = find_nans(load_run(overflow_run))
    assert rep.origins["forward"].certain and rep.origins["backward"].certain
    assert calls == []


def test_the_reports_spread_line_calls_an_undetermined_origin_so(tmp_path):
    from amp_postmortem.reporting.data import Spread
    from amp_postmortem.reporting.figures import spread_lines

    run = tmp_path / "run"
    _job(run, "before", 7)
    rep = find_nans(load_run(run))
    d = rep.to_dict()
    layers = pd.DataFrame(d["layers"])
    line = spread_lines(Spread(rank=0, origin=d["origin"], origins=d["origins"], layers=layers,
                               total_layers=len(layers)))[0]
    assert line.startswith("forward: origin undetermined, first recorded in <loss> (loss, step 5")
    assert "then <loss>" not in line
