"""First-NaN ranking and origins, on runs with planted faults."""
import pandas as pd

from amp_postmortem.analyses.nans import backward_origin, backward_origins, find_nans, forward_origin
from amp_postmortem.reading.loader import load_run

from conftest import INPUT_NAN_STEP, OVERFLOW_STEP


def test_forward_overflow_origin_is_the_planted_module(overflow_run):
    rep = find_nans(load_run(overflow_run))
    assert rep.origin.name == "block.boom"
    assert (rep.origin.phase, rep.origin.kind, rep.origin.step, rep.origin.rank) == \
        ("forward", "activation", OVERFLOW_STEP, 0)
    # The loss was NaN, so the gradient was non-finite where it entered the model.
    assert rep.origins["backward"].name == "<loss>" and rep.origins["backward"].step == OVERFLOW_STEP
    assert rep.nonfinite_loss_steps == [OVERFLOW_STEP]


def test_parents_and_later_layers_propagate(overflow_run):
    layers = find_nans(load_run(overflow_run)).layers
    assert layers["origin"].sum() == 1
    fwd = layers[layers["phase"] == "forward"]
    # children before parents, then later layers, then the loss
    assert list(zip(fwd["name"], fwd["kind"], fwd["origin"])) == [
        ("block.boom", "activation", True), ("block.act", "activation", False),
        ("block", "activation", False), ("amp", "activation", False), ("head", "activation", False),
        ("", "activation", False), ("<loss>", "loss", False)]
    assert (layers["first_step"] == OVERFLOW_STEP).all()
    bwd = layers[layers["phase"] == "backward"]
    assert bwd["order"].is_monotonic_increasing and not bwd["origin"].any()
    assert set(bwd["kind"]) == {"grad_output", "grad_input", "param_grad"}


def test_nan_in_the_batch_is_the_input(input_nan_run):
    rep = find_nans(load_run(input_nan_run))
    assert rep.origin.to_dict()["name"] == "<input>"
    assert (rep.origin.kind, rep.origin.step) == ("input", INPUT_NAN_STEP)
    first = rep.layers.iloc[0]
    assert (first["name"], first["kind"], bool(first["origin"])) == ("<input>", "input", True)
    assert rep.layers["origin"].sum() == 1


def test_json_contract(overflow_run):
    d = find_nans(load_run(overflow_run)).to_dict()
    assert set(d["origin"]) >= {"name", "phase", "kind", "step", "rank"}
    assert set(d["origins"]) == {"forward", "backward"}
    assert set(d["origins"]["forward"]) >= {"name", "step", "rank", "kind"}
    assert set(d["layers"][0]) >= {"name", "kind", "phase", "first_step", "order", "rank", "origin",
                                   "nan_count", "inf_count"}
    assert isinstance(d["layers"][0]["origin"], bool) and isinstance(d["layers"][0]["first_step"], int)


def test_scaler_probe_overflow_is_a_backward_origin_only(collapse_run):
    rep = find_nans(load_run(collapse_run))
    assert rep.origins["forward"] is None
    # step 20: the scale grew to 2**18 and the gradient overflowed on arrival
    assert (rep.origins["backward"].name, rep.origins["backward"].step) == ("<loss>", 20)
    assert rep.origin == rep.origins["backward"]


def test_backward_origin_of_collapse_steps_is_the_amplifying_module(collapse_run):
    origins = backward_origins(load_run(collapse_run), [44, 46, 60])
    assert {s: (o.name, o.kind) for s, o in origins.items()} == {
        44: ("amp", "grad_input"), 46: ("amp", "grad_input"), 60: ("amp", "grad_input")}


def test_healthy_run_has_no_forward_origin(healthy_run):
    rep = find_nans(load_run(healthy_run))
    assert rep.origins["forward"] is None
    assert rep.nonfinite_loss_steps == []


def test_step_range(overflow_run):
    rep = find_nans(load_run(overflow_run), from_step=OVERFLOW_STEP + 1)
    assert rep.origin is None and rep.layers.empty and rep.first_nonfinite_step is None
    assert rep.lines() == ["No NaN/Inf in any recorded tensor."]


def test_shards_without_nonfinite_rows_are_not_scanned(overflow_run):
    rep = find_nans(load_run(overflow_run))
    assert (rep.shards_scanned, rep.shards_total) == (1, 3)


def _rows(*rows):
    cols = ["step", "rank", "name", "kind", "phase", "order", "call", "nan_count", "inf_count",
            "input_nonfinite"]
    return pd.DataFrame([dict(zip(cols, (5, 0) + r)) for r in rows])


def test_backward_origin_rules():
    # grad_input non-finite although its grad_output was finite: origin
    rows = _rows(("b", "grad_input", "backward", 3, 0, 0, 4, 0.0),
                 ("a", "grad_output", "backward", 4, 0, 0, 4, None),
                 ("a", "grad_input", "backward", 5, 0, 0, 4, 4.0))
    assert backward_origin(rows).name == "b"
    # a parameter gradient whose module received a finite gradient
    rows = _rows(("lin.weight", "param_grad", "backward", 2, 0, 0, 1, None),
                 ("lin", "grad_input", "backward", 3, 0, 0, 1, 0.0))
    o = backward_origin(rows)
    assert (o.name, o.kind, o.tensor) == ("lin", "param_grad", "lin.weight")
    # its module's grad_output was already non-finite: propagated
    rows = _rows(("lin", "grad_output", "backward", 1, 0, 0, 1, None),
                 ("lin.weight", "param_grad", "backward", 2, 0, 0, 1, None),
                 ("", "grad_input", "backward", 3, 0, 1, 0, 0.0))
    assert backward_origin(rows).name == ""
    # the gradient arrived non-finite at the model's output
    rows = _rows(("", "grad_output", "backward", 0, 0, 0, 1, None))
    assert backward_origin(rows).name == "<loss>"


def test_forward_origin_rules():
    rows = _rows(("attn.out", "activation", "forward", 2, 0, 3, 0, 3.0),
                 ("attn", "activation", "forward", 3, 0, 3, 0, 0.0))
    assert forward_origin(rows).name == "attn"  # made by the parent's own code
    rows = _rows(("emb", "activation", "forward", 1, 0, 1, 0, None))
    assert forward_origin(rows).name == "emb"   # no float inputs: inputs count as finite
    rows = _rows(("<loss>", "loss", "forward", 9, 0, 1, 0, None))
    assert forward_origin(rows).name == "<loss>"


def test_tied_parameter_overflow_is_the_module_that_made_it():
    """The tiny GPT's output projection shares the embedding's weight: the
    first backward overflow is lm_head's float16 weight-gradient matmul,
    recorded under the parameter's first name `wte.weight`."""
    import advice_runs as A
    run = load_run(A.diverging_gpt_run())
    params = {p["name"]: p for p in run.manifest["params"]}
    assert params["wte.weight"]["aliases"] == ["lm_head.weight"] and "lm_head.weight" not in params
    rep = find_nans(run)
    b = rep.origins["backward"]
    assert (b.name, b.kind, b.tensor, b.step, b.aliases) == ("lm_head", "param_grad", "wte.weight", 1,
                                                             ("wte.weight",))
    line = next(x for x in rep.lines() if x.startswith("backward origin"))
    assert "lm_head (its weight gradient; a tied parameter, also named wte.weight)" in line
    # the scale's drivers name the same module
    from amp_postmortem.analyses.scale import scale_dynamics
    dyn = scale_dynamics(run)
    # The collapse starts at the first overflow (step 1, lm_head's), which
    # the back-offs that follow join; the counts move with the kernels.
    assert dyn.onset_step == b.step == 1
    assert set(dyn.driver_steps) == {"proj", "lm_head"}
    # step 0 was clean: step 1's skip is no calibration and is not called one
    assert rep.backward_scaler_handled and not rep.backward_calibration and "calibration" not in line


def test_calibration_only_for_the_scalers_leading_skips():
    import advice_runs as A
    rep = find_nans(load_run(A.lower_scale_run()))
    assert rep.origins["backward"].step == 0 and rep.backward_calibration
    assert "a calibration skip" in next(x for x in rep.lines() if x.startswith("backward origin"))


def test_a_skip_in_a_run_without_a_scaler_is_the_loops_own_not_the_scalers(tmp_path):
    """No GradScaler: the loop skips `opt.step()` when a gradient is not
    finite (as fairseq's and HF's loops can). The backward origin's step was
    skipped with a finite forward, and the words say the loop skipped it,
    not that a loss scaler backed off."""
    import math

    import torch

    from recorders import AmpRecorder
    from tiny_models import BoomNet

    torch.manual_seed(0)
    model = BoomNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(3)
    # Its own loop: the test is about a loop that skips opt.step() on a non-finite gradient.
    with AmpRecorder(tmp_path / "run", model, optimizer=opt) as rec:
        for step in range(4):
            model.amp.gain = math.nan if step == 2 else 1.0  # a NaN born in the backward pass
            x, y = torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            if all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None):
                opt.step()
            opt.zero_grad()
            rec.step(loss)
    rep = find_nans(load_run(tmp_path / "run"))
    assert rep.origins["backward"].step == 2 and rep.origins["forward"] is None
    assert rep.backward_scaler_handled and not rep.has_scaler and not rep.backward_calibration
    line = next(x for x in rep.lines() if x.startswith("backward origin"))
    assert "the training loop skipped it" in line and "loss scaler skipped" not in line
    assert rep.to_dict()["has_scaler"] is False
