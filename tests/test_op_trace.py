"""The op trace of a replay (`amp_postmortem/replaying/op_trace.py`): runs with
one op-level fault planted on a `# PLANTED` line (`op_trace_runs`), recorded
by the real recorder, replayed through the CLI. What is pinned is the story
(which op, which line, that it is the first op made non-finite from finite
inputs), never a value a CPU kernel's rounding moves."""
from __future__ import annotations

import inspect
import json

import pytest
from click.testing import CliRunner

import op_trace_runs as R
from amp_postmortem.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# run, model class, the class holding the planted line, the op that must be named, the culprit module
CASES = {
    "exp": (R.exp_run, "ExpNet", R.ExpGate, "aten::exp", "gate"),
    "norm_square": (R.norm_run, "NormNet", R.HandNorm, "aten::mul", "norm"),
    "unscaled_scores": (R.attn_run, "AttnNet", R.RawAttention, "aten::bmm", "blocks.1"),
    "float16_loss": (R.half_loss_run, "HalfLoss", R.HalfLoss, "aten::sum", ""),
}


def replay(run, model: str, *extra):
    return CliRunner().invoke(main, ["replay", str(run), "--step", "0", "--model", f"{R.__file__}:{model}",
                                     "--precisions", "fp16", *extra])


@pytest.fixture(scope="module")
def replays():
    out = {}
    for case, (run, model, *_rest) in CASES.items():
        res = replay(run(), model, "--json")
        assert res.exit_code == 0, res.output
        out[case] = json.loads(res.stdout)
    return out


@pytest.mark.parametrize("case", CASES)
def test_replay_names_the_planted_op_and_line(case, replays):
    _, _, holder, op, culprit = CASES[case]
    doc = replays[case]
    assert doc["culprit"]["name"] == culprit
    origin = doc["op_origin"]
    assert origin["op"] == op and origin["dtype"] == "float16"
    assert origin["file"].endswith("op_trace_runs.py") and origin["line"] == R.planted_line(holder)
    assert origin["code"] == inspect.getsource(holder).splitlines()[
        R.planted_line(holder) - inspect.getsourcelines(holder)[1]].strip()
    assert origin["module"] == culprit and origin["frame_module"] == culprit and origin["function"] == "forward"


@pytest.mark.parametrize("case", CASES)
def test_the_origin_is_the_first_op_made_nonfinite_from_finite_inputs(case, replays):
    trace = replays[case]["op_trace"][0]
    assert trace["module"] == CASES[case][4] and trace["status"] == "origin" and trace["precision"] == "fp16"
    ops = trace["ops"]
    at = next(i for i, o in enumerate(ops) if o["index"] == trace["origin"]["index"])
    assert all(o["nan"] + o["inf"] == 0 for o in ops[:at])   # every op before it is finite
    origin = ops[at]
    assert origin == trace["origin"] == replays[case]["op_origin"]
    assert origin["inputs_finite"] and origin["nan"] + origin["inf"] > 0
    assert origin["local_rel_err"] is None  # JSON has no Infinity: its own error is inf (non-finite only here)


def test_the_text_output_says_the_op_origin_with_the_line():
    run, model, holder, op, culprit = CASES["unscaled_scores"]
    res = replay(run(), model)
    assert res.exit_code == 0, res.output
    line = next(l for l in res.output.splitlines() if l.startswith("op origin: "))
    assert line.startswith(f"op origin: {op} at ")
    assert f"op_trace_runs.py:{R.planted_line(holder)} (scores = q @ k.transpose(-1, -2)" in line
    assert line.endswith(f"in {culprit}.forward, float16")


def test_existing_json_keys_are_kept(replays):
    assert {"step", "rank", "device", "policy", "recorded_precision", "precisions", "reproduced", "fidelity",
            "culprit", "culprits", "first_propagated", "modules", "ranking", "loss", "param_grads", "anomaly",
            "notes", "errors", "thresholds", "backward_start", "op_origin", "op_trace"} <= set(replays["exp"])


def test_trace_option_traces_a_named_module_op_by_op():
    run, model = CASES["norm_square"][0], "NormNet"
    res = replay(run(), model, "--trace", "embed", "--json")
    assert res.exit_code == 0, res.output
    traces = {t["module"]: t for t in json.loads(res.stdout)["op_trace"]}
    assert set(traces) == {"norm", "embed"}   # the culprit, then the named one
    embed = traces["embed"]
    assert embed["status"] == "finite" and embed["origin"] is None and embed["ops"]
    assert "aten::addmm" in [o["op"] for o in embed["ops"]]
    # nn.Linear's code is torch's, and it runs alone (not from NormNet.forward): no line of the model's.
    assert {(o["module"], o["line"]) for o in embed["ops"]} == {("embed", None)}
    norm = traces["norm"]
    lines, start = inspect.getsourcelines(R.HandNorm.forward)
    assert {o["line"] for o in norm["ops"]} <= set(range(start, start + len(lines)))
    text = replay(run(), model, "--trace", "embed").output
    assert "op trace of embed (fp16, micro-batch 0, call 0, " in text and "every op's output is finite" in text


def test_trace_of_a_module_that_does_not_exist_is_one_line_and_exit_2():
    res = replay(R.norm_run(), "NormNet", "--trace", "blocks.9")
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [
        "Error: trace module 'blocks.9' is not a module of the model; its modules: embed, norm, head"]


def test_the_trace_is_bounded_and_still_finds_the_origin():
    from amp_postmortem.replaying import _locate, resolve_policy
    from amp_postmortem.replaying.engine import ReplaySession, RunConfig
    from amp_postmortem.replaying.op_trace import TraceStatus, trace_module
    bundle, _ = _locate(R.attn_run(), 0, None, None)
    session = ReplaySession(bundle, R.AttnNet(), device="cpu")
    reference = session.run(RunConfig("fp64"), keep_inputs=True)
    run = session.run(RunConfig("fp16", policy=resolve_policy("recorded", bundle, "fp16"),
                                loss_scale=bundle.loss_scale or 1.0))
    trace = trace_module(session, reference, run, "blocks.1", max_ops=2)
    assert trace.status is TraceStatus.ORIGIN and trace.origin.op == "aten::bmm"
    assert len(trace.ops) == 3 and trace.ops[-1] is trace.origin and trace.ops_seen > 3


def test_report_shows_the_culprits_op_trace_as_a_table(replays, tmp_path):
    from report_browser import check_page

    path = tmp_path / "replay.json"
    path.write_text(json.dumps(replays["unscaled_scores"]))
    out = tmp_path / "r.html"
    res = CliRunner().invoke(main, ["report", str(R.attn_run()), "-o", str(out), "--replay", str(path)])
    assert res.exit_code == 0, res.output
    page = out.read_text()
    assert "<h2 id=\"op-trace\">Op trace of the culprit</h2>" in page
    table = page.split("<table class=\"ops\">", 1)[1].split("</table>", 1)[0]
    assert "<th>op</th><th>line</th><th>code</th><th>dtype</th><th>absmax</th>" in table
    origin = table.split("<tr class=\"origin\">", 1)[1].split("</tr>", 1)[0]
    assert "<td>aten::bmm</td>" in origin and f"op_trace_runs.py:{R.planted_line(R.RawAttention)}" in origin
    # And on the page as chromium draws it: the table shown, its origin row there.
    drawn = check_page(out, tmp_path / "r.png")
    assert drawn["state"] == "ready" and drawn["errors"] == []
    (ops,) = [t for t in drawn["tables"] if t["class"] == "ops"]
    assert ops["shown"] and ops["rows"][0] == ["op", "line", "code", "dtype", "absmax", "local error vs float64"]
    (row,) = [r for r, c in zip(ops["rows"], ops["row_classes"]) if c == "origin"]
    assert row[0] == "aten::bmm" and row[1].endswith(f"op_trace_runs.py:{R.planted_line(R.RawAttention)}")
