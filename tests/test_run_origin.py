"""`nans` and `summary` with a model (`amp_postmortem/replaying/run_origin.py`):
the op origin of a replayed bundle, on a run with an op-level fault planted
on a `# PLANTED` line (`op_trace_runs`), recorded by the real recorder. The
story is pinned (which step is replayed and why, which op and line), never
a value a CPU kernel's rounding moves."""
from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

import op_trace_runs as R
from amp_postmortem.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = f"{R.__file__}:AttnNet"


def invoke(*argv):
    res = CliRunner().invoke(main, [str(a) for a in argv])
    assert res.exit_code == 0, res.output
    return res


@pytest.fixture(scope="module")
def nans_doc():
    return json.loads(invoke("nans", R.attn_run(), "--model", MODEL, "--json").stdout)


def test_nans_with_a_model_names_the_op_and_its_line(nans_doc):
    origin = nans_doc["op_origin"]
    assert origin["status"] == "found" and origin["step"] == 0 and origin["rank"] == 0
    assert origin["chosen_by"] == "origin_step" and origin["precision"] == "fp16"
    assert origin["culprit"]["name"] == "blocks.1"
    op = origin["op"]
    assert op["op"] == "aten::bmm" and op["dtype"] == "float16" and op["module"] == "blocks.1"
    assert op["file"].endswith("op_trace_runs.py") and op["line"] == R.planted_line(R.RawAttention)
    assert op["code"] == "scores = q @ k.transpose(-1, -2)  # PLANTED"
    # The analysis itself is unchanged by the model.
    plain = json.loads(invoke("nans", R.attn_run(), "--json").stdout)
    assert plain["op_origin"] is None
    assert {k: v for k, v in nans_doc.items() if k != "op_origin"} == {k: v for k, v in plain.items()
                                                                       if k != "op_origin"}


def test_nans_text_says_the_op_origin_as_replay_does():
    text = invoke("nans", R.attn_run(), "--model", MODEL).output.splitlines()
    line = next(l for l in text if l.startswith("op origin "))
    assert line.startswith("op origin (replay of step 0, rank 0: the forward origin's step, ")
    replayed = invoke("replay", R.attn_run(), "--step", 0, "--model", MODEL, "--precisions", "fp16").output
    said = next(l for l in replayed.splitlines() if l.startswith("op origin: "))[len("op origin: "):]
    assert line.endswith(f": {said}") and said.endswith("in blocks.1.forward, float16")
    assert not any(l.startswith("op origin") for l in invoke("nans", R.attn_run()).output.splitlines())


def test_summary_with_a_model_adds_the_same_op_origin(nans_doc):
    doc = json.loads(invoke("summary", R.attn_run(), "--model", MODEL, "--json").stdout)
    assert doc["op_origin"] == nans_doc["op_origin"]
    assert json.loads(invoke("summary", R.attn_run(), "--json").stdout)["op_origin"] is None
    text = invoke("summary", R.attn_run(), "--model", MODEL).output
    assert "op origin (replay of step 0, rank 0: the forward origin's step, " in text
    assert f"op_trace_runs.py:{R.planted_line(R.RawAttention)} (scores = q @ k.transpose(-1, -2)" in text


def test_a_step_asked_for_is_the_one_replayed():
    doc = json.loads(invoke("nans", R.attn_run(), "--model", MODEL, "--step", 0, "--json").stdout)
    assert doc["op_origin"]["chosen_by"] == "asked" and doc["op_origin"]["op"]["op"] == "aten::bmm"


def test_a_step_without_a_bundle_is_one_line_and_exit_2():
    res = CliRunner().invoke(main, ["nans", str(R.attn_run()), "--model", MODEL, "--step", "5"])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
    assert res.output.startswith("Error: ")


def test_a_run_without_bundles_says_so(tmp_path):
    run = tmp_path / "no_bundles"
    shutil.copytree(R.attn_run(), run)
    shutil.rmtree(run / "bundles")
    doc = json.loads(invoke("nans", run, "--model", MODEL, "--json").stdout)
    assert doc["op_origin"] == {"status": "no_bundle", "step": None, "rank": None, "chosen_by": None,
                                "precision": None, "reproduced": None, "culprit": None, "op": None,
                                "nonfinite_weights": []}
    assert "op origin: not found: the run saved no replay bundle" in invoke("nans", run, "--model", MODEL).output


def test_the_api_takes_the_same_keywords(nans_doc):
    import amp_postmortem as api
    doc = api.nans(R.attn_run(), model=MODEL).to_dict()
    assert doc["op_origin"] == nans_doc["op_origin"]
