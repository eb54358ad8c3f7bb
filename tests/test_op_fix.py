"""`fix`'s op-level remedy (`amp_postmortem/whatif/op_fix.py`, the replay's
float32 lines in `replay/fp32_lines.py`, the patch in `whatif/line_patch.py`,
the cost in `replaying/op_cost.py`) on runs with one op-level fault planted on a
`# PLANTED` line (`op_trace_runs`), recorded by the real recorder. The story
is pinned (which op, which line, that the printed patch applied to the source
and retrained makes the failed step finite and float32-like, that the line
ranks ahead of its module), never a value a CPU kernel's rounding moves."""
from __future__ import annotations

import importlib.util
import inspect
import json
import math
import sys

import pytest
import torch
from click.testing import CliRunner

import op_trace_runs as R
from amp_postmortem.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# run, model class, the class holding the planted line, the op named, the module, its factory, the loss
CASES = {
    "exp": (R.exp_norm_run, "ExpNormNet", R.ExpNormGate, "aten::exp", "gate", "exp_norm_model", None),
    "norm_square": (R.norm_run, "NormNet", R.HandNorm, "aten::mul", "norm", "norm_model", None),
    "unscaled_scores": (R.attn_run, "AttnNet", R.RawAttention, "aten::bmm", "blocks.1", "attn_model", None),
    "float16_loss": (R.half_loss_run, "HalfLoss", R.HalfLoss, "aten::sum", "", "half_loss_model", "model"),
}


def fix(run, model: str, *extra):
    return CliRunner().invoke(main, ["fix", str(run), "--step", "0", "--model", f"{R.__file__}:{model}", *extra])


@pytest.fixture(scope="module")
def fixes():
    out = {}
    for case, (run, model, *_rest) in CASES.items():
        res = fix(run(), model, "--json")
        assert res.exit_code == 0, res.output
        out[case] = json.loads(res.stdout)
    return out


@pytest.mark.parametrize("case", CASES)
def test_fix_names_the_planted_op_and_its_line(case, fixes):
    _, _, holder, op, module, *_ = CASES[case]
    op_fix = fixes[case]["op_fix"]
    assert op_fix["status"] == "saved" and op_fix["saved"] and op_fix["chosen_by"] == "origin"
    assert op_fix["module"] == module and op_fix["op"]["op"] == op and op_fix["op"]["dtype"] == "float16"
    assert op_fix["op"]["file"].endswith("op_trace_runs.py") and op_fix["op"]["line"] == R.planted_line(holder)
    assert op_fix["where"] == f"{op_fix['op']['file']}:{R.planted_line(holder)}"
    assert op_fix["trial"]["saved"] and op_fix["saved_steps"] == [0] and op_fix["not_saved_steps"] == []


@pytest.mark.parametrize("case", CASES)
def test_the_patch_is_an_exact_rewrite_of_the_line(case, fixes):
    holder = CASES[case][2]
    patch = fixes[case]["op_fix"]["patch"]
    assert patch["kind"] == "rewrite" and patch["exact"] and patch["reason"] is None
    head, body = patch["text"].splitlines()
    assert head == "with torch.autocast('cpu', enabled=False):"
    planted = _planted_text(holder)
    assert body == "    " + planted.replace(*{"exp": ("(h)", "(h.float())"),
                                               "norm_square": ("x * x", "x.float() * x.float()"),
                                               "unscaled_scores": ("q @ k", "q.float() @ k.float()"),
                                               "float16_loss": ("d * d", "d.float() * d.float()")}[case])


@pytest.mark.parametrize("case", CASES)
def test_the_line_ranks_ahead_of_its_module_by_the_float32_work_it_costs(case, fixes):
    doc = fixes[case]
    line, module = doc["remedies"]
    assert line["kind"] == "line" and line["where"] == doc["op_fix"]["where"]
    assert module["kind"] == "modules" and module["modules"] == doc["fix"]
    assert 0 < line["fp32_flops"] <= module["fp32_flops"] and line["fp32_share"] <= module["fp32_share"] <= 1
    if case != "norm_square":  # HandNorm has one other line, which runs in float32 once `var` is float32
        assert line["fp32_flops"] < module["fp32_flops"]


def _planted_text(holder) -> str:
    lines, start = inspect.getsourcelines(holder)
    return lines[R.planted_line(holder) - start].strip()


def _patched_module(tmp_path, holder, patch_text: str):
    """op_trace_runs.py with the printed patch applied at the planted line,
    imported from a file of its own."""
    source = inspect.getsource(R).splitlines()
    at = R.planted_line(holder) - 1
    indent = source[at][:len(source[at]) - len(source[at].lstrip())]
    source[at:at + 1] = [indent + line for line in patch_text.splitlines()]
    path = tmp_path / f"patched_{holder.__name__}.py"
    path.write_text("\n".join(source) + "\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def _train_once(models, factory: str, loss, *, autocast: bool, scale: float = 2.0 ** 8):
    """The recorded step trained again: same seed, same batch, same scaler
    (its initial scale: the recorded one unless given)."""
    from tiny_models import train
    batch = models._batch(0, d_out=R.D) if loss else models._batch(0)
    kwargs = {"loss_fn": models._model_loss} if loss else {}
    trained = train(getattr(models, factory)(), [batch], dtype=torch.float16 if autocast else None,
                    scaler={"init_scale": scale, "growth_interval": 10 ** 6}, lr=0.0, **kwargs)
    return trained.losses[0], trained.scales[0]


@pytest.mark.parametrize("case", CASES)
def test_the_printed_patch_applied_to_the_source_makes_the_step_finite(case, fixes, tmp_path):
    _, _, holder, _, _, factory, loss = CASES[case]
    patched = _patched_module(tmp_path, holder, fixes[case]["op_fix"]["patch"]["text"])
    assert "with torch.autocast('cpu', enabled=False):" in inspect.getsource(getattr(patched, holder.__name__))
    reference, _ = _train_once(R, factory, loss, autocast=False)       # float32, no autocast
    before, before_scale = _train_once(R, factory, loss, autocast=True)
    # The scale the replay judged the patched step at: the recorded one, or where a scaler backs off to.
    scale = fixes[case]["op_fix"]["trial"]["loss_scale"]
    assert scale == 2.0 ** (8 - fixes[case]["op_fix"]["trial"]["backoffs"])
    after, after_scale = _train_once(patched, factory, loss, autocast=True, scale=scale)
    assert math.isfinite(reference)
    # As recorded the step fails: a NaN/Inf loss or a skipped step, or (the norm) a finite loss far off float32.
    assert not (math.isfinite(before) and before_scale == 2.0 ** 8 and
                abs(before - reference) <= 1e-2 * abs(reference))
    # Patched: finite loss, no step skipped (finite gradients), float32's loss within float16's rounding.
    assert math.isfinite(after) and after_scale == scale
    assert abs(after - reference) <= 1e-2 * abs(reference)


def test_the_text_output_leads_with_the_op_level_patch():
    run, model, holder, op, *_ = CASES["unscaled_scores"]
    res = fix(run(), model)
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("op-level fix: "))
    assert f"{op} at " in lines[first] and f"op_trace_runs.py:{R.planted_line(holder)}" in lines[first]
    assert lines[first + 1].endswith(f"op_trace_runs.py:{R.planted_line(holder)}, replace the line with "
                                     "(indented as it is):")
    assert lines[first + 3].strip() == "scores = q.float() @ k.float().transpose(-1, -2)  # PLANTED"
    module = next(i for i, line in enumerate(lines) if line.startswith("fix (module level, costlier): keep blocks.1"))
    ranked = next(i for i, line in enumerate(lines) if line == "remedies by extra float32 work, cheapest first:")
    assert first < module < ranked
    assert lines[ranked + 1].startswith(f"  1. line ") and lines[ranked + 2].startswith("  2. keep blocks.1 in float32")


def test_a_line_that_does_not_save_the_step_falls_back_to_modules():
    """ExpNet feeds exp's float32 result (far past 65504) to a float16 head:
    the line alone cannot save it; keeping modules in float32 does."""
    res = fix(R.exp_run(), "ExpNet", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    op_fix = doc["op_fix"]
    assert op_fix["status"] == "not_saved" and not op_fix["saved"] and op_fix["patch"] is None
    assert op_fix["op"]["op"] == "aten::exp" and op_fix["op"]["line"] == R.planted_line(R.ExpGate)
    assert doc["fix"] == ["gate", "head"] and [r["kind"] for r in doc["remedies"]] == ["modules"]
    text = fix(R.exp_run(), "ExpNet").output
    assert "op level: the line of the culprit's first op made NaN/Inf from finite inputs, aten::exp at " in text
    assert "in float32 does not save the step (NaN/Inf in the forward" in text


def test_existing_json_keys_are_kept(fixes):
    assert {"step", "rank", "precision", "policy", "loss_scale", "baseline", "candidates", "trials", "fix",
            "search", "patch", "saved_steps_check", "saved_steps", "not_saved_steps", "notes", "backward_start",
            "thresholds", "op_fix", "remedies", "window_check"} == set(fixes["exp"]) - {"warnings"}  # issue 23 adds it
    assert fixes["unscaled_scores"]["patch"] == "from recorders.fp32 import keep_fp32\nkeep_fp32(model.blocks[1])"


# ------------------------------------------------------------- the patch text
def test_a_line_that_is_not_a_whole_statement_gets_the_block_and_says_so():
    from amp_postmortem.whatif.line_patch import NotExact, PatchKind, line_patch
    patch = line_patch("scores = (q @", {"q"}, others=0, device_type="cuda")
    assert patch.kind is PatchKind.BLOCK and not patch.exact and patch.reason is NotExact.NOT_A_STATEMENT
    assert patch.text == "with torch.autocast('cuda', enabled=False):\n    scores = (q @"
    other = line_patch("y = self.cache @ x", {"x"}, others=1, device_type="cpu")
    assert other.reason is NotExact.INPUT_NOT_A_VARIABLE and other.text.endswith("\n    y = self.cache @ x")


def test_the_rewrite_casts_every_read_of_the_variables_and_keeps_the_rest():
    from amp_postmortem.whatif.line_patch import line_patch
    patch = line_patch("x = x * x + bias  # écart", {"x"}, others=0, device_type="cpu")
    assert patch.exact and patch.cast == ("x",)
    assert patch.text.splitlines()[1] == "    x = x.float() * x.float() + bias  # écart"


def test_an_input_from_an_attribute_is_counted_and_the_patch_is_not_exact():
    """The replay runs the line in float32 all the same (its float16 inputs
    cast), but no rewrite of the line's variables does that."""
    from amp_postmortem.replaying.fp32_lines import float32_lines

    class Cached(torch.nn.Module):
        def forward(self, x):
            self.cache = x * 2.0
            return self.cache @ x.transpose(-1, -2)

    model = Cached()
    line = inspect.getsourcelines(Cached.forward)[1] + 2
    with torch.autocast("cpu", dtype=torch.float16), float32_lines([(__file__, line)], ("cpu",)) as seen:
        out = model(torch.randn(2, 3).half())
    assert out.dtype == torch.float32
    (got,) = seen.values()
    assert got.variables == {"x"} and got.others == 1


def test_the_op_fix_is_tried_on_every_saved_step(tmp_path):
    """Two saved steps that both overflow in q·kᵀ: the line saves both."""
    from whatif_runs import record
    run = record(tmp_path / "two_steps", R.attn_model(), steps=2, batch_fn=R._batch, bundle_steps=(0, 1))
    res = fix(run, "AttnNet", "--json")
    assert res.exit_code == 0, res.output
    op_fix = json.loads(res.stdout)["op_fix"]
    assert op_fix["status"] == "saved" and op_fix["saved_steps"] == [0, 1] and op_fix["not_saved_steps"] == []
    assert [c["saved_as_recorded"] for c in op_fix["saved_steps_check"]] == [False, False]


def big_linear():
    """One nn.Linear whose float16 output overflows: the op runs in torch's
    code (F.linear inside nn.Linear, replayed alone), so no line of the
    model's is there to patch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(R.D_IN, 1))
    with torch.no_grad():
        model[0].weight.fill_(3e4)
        model[0].bias.zero_()
    return model


def test_an_op_in_torch_code_only_leaves_the_module_as_the_remedy(tmp_path):
    from whatif_runs import record
    run = record(tmp_path / "big_linear", big_linear(), steps=1, batch_fn=R._batch, bundle_steps=(0,))
    res = CliRunner().invoke(main, ["fix", str(run), "--step", "0", "--model", f"{__file__}:big_linear", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    op_fix = doc["op_fix"]
    assert op_fix["status"] == "no_line" and op_fix["module"] == "0" and op_fix["op"]["op"] == "aten::addmm"
    assert op_fix["op"]["file"] is None and op_fix["trial"] is None and op_fix["patch"] is None
    assert doc["fix"] == ["0"] and [r["kind"] for r in doc["remedies"]] == ["modules"]
    text = CliRunner().invoke(main, ["fix", str(run), "--step", "0", "--model", f"{__file__}:big_linear"]).output
    assert "runs in torch code only (no line of the model's to patch): a module in float32 is the remedy" in text


def test_without_an_origin_the_op_with_the_largest_own_error_is_chosen():
    from amp_postmortem.replaying.op_trace import ModuleOpTrace, OpRecord, TraceStatus
    from amp_postmortem.whatif.op_fix import ChosenBy, chosen_op

    def op(i, dtype, err):
        return OpRecord(index=i, op="aten::mul", dtype=dtype, absmax=1.0, nan=0, inf=0, inputs_finite=True,
                        local_rel_err=err, module="m", source=None)
    trace = ModuleOpTrace("m", "fp16", TraceStatus.FINITE,
                          ops=[op(0, "float16", 1e-3), op(1, "float32", 0.5), op(2, "float16", 0.2), op(3, "float16", None)])
    chosen, why = chosen_op(trace)
    assert (chosen.index, why) == (2, ChosenBy.LOCAL_ERROR)
    assert chosen_op(ModuleOpTrace("m", "fp16", TraceStatus.FINITE, ops=[op(0, "float32", 0.5)])) == (None, None)
