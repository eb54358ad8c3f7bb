"""`recommend`: recommendations with their evidence, from the recorded
statistics and, with a model, from what-if replays of the run's bundle."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import whatif_runs as W
from amp_postmortem.analyses.recommend import recommend
from amp_postmortem.cli import main
from amp_postmortem.loader import load_run


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_replayed_recommendations_for_a_module_overflow():
    r = recommend(load_run(W.attn_overflow_run()), model=W.AttnNet)
    assert r.replayed and r.step == 0
    assert r.kinds() == ["keep_fp32", "use_bf16", "scaler_settings"]
    keep = r.get("keep_fp32")
    assert keep.data["modules"] == ["scores"] and "keep_fp32(model.scores)" in keep.code
    assert r.get("use_bf16").data["avoids"] is True
    w = r.get("scaler_settings").data["window"]
    assert w["max_scale"] < W.RECORDED_SCALE  # with scores in fp32 the backward needs a lower scale
    for rec in r.recommendations:
        assert rec.evidence and rec.source == "replay"


def test_no_configuration_that_works_says_do_not_use_mixed_precision():
    r = recommend(load_run(W.root_cancel_run()), model=W.RootCancel)
    assert "avoid_mixed_precision" in r.kinds() and "keep_fp32" not in r.kinds()
    assert r.get("use_bf16").data["avoids"] is False
    assert any("bfloat16: non-finite" in e for e in r.get("avoid_mixed_precision").evidence)


def test_a_few_bad_samples_point_at_the_data_first():
    r = recommend(load_run(W.bad_samples_run()), model=W.AttnNet)
    assert r.kinds()[0] == "check_data" and r.get("check_data").data["bad_samples"] == [3, 11]
    assert "avoid_mixed_precision" not in r.kinds()


def test_a_healthy_step_needs_no_change():
    r = recommend(load_run(W.healthy_run()), model=W.AttnNet)
    assert r.kinds() == ["no_change"]
    assert "inside the replayed window" in r.get("no_change").evidence[0]


def test_recorded_statistics_alone_name_a_candidate_and_scaler_settings():
    r = recommend(load_run(W.attn_overflow_run()))
    assert not r.replayed and r.step is None
    keep = r.get("keep_fp32")
    assert keep.source == "recorded" and keep.data["modules"] == ["scores"] and "fix" in keep.action
    assert r.get("scaler_settings").source == "recorded"
    assert any("pass --model" in n for n in r.notes)


def test_cli_recommend_and_every_whatif_command_is_documented():
    res = CliRunner().invoke(main, ["recommend", str(W.attn_overflow_run()), "--model",
                                    f"{W.__file__}:AttnNet", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [x["kind"] for x in doc["recommendations"]] == ["keep_fp32", "use_bf16", "scaler_settings"]
    assert all(x["evidence"] for x in doc["recommendations"])
    res = CliRunner().invoke(main, ["recommend", str(W.attn_overflow_run())])
    assert res.exit_code == 0 and "[keep_fp32] candidate: keep scores" in res.output
    for name in ("fix", "scale-window", "bisect", "compare", "recommend"):
        help_text = CliRunner().invoke(main, [name, "--help"]).output
        assert "amp-postmortem " + name in help_text and "--json" in help_text
