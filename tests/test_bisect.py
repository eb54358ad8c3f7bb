"""`bisect`: the samples of the saved batch whose replay is non-finite.
Samples 3 and 11 of one batch are planted 1000x too large (a data
problem); in the `scores` overflow run every sample fails (a model
problem)."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import whatif_runs as W
from amp_postmortem.cli import main
from amp_postmortem.whatif.bisect import bisect_samples


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_bisection_finds_the_planted_bad_samples():
    r = bisect_samples(W.bad_samples_run(), W.BAD_STEP, model=W.AttnNet)
    assert r.kind == "data" and r.bad_samples == list(W.BAD_SAMPLES)
    assert r.batch_size == W.BATCH and r.bad_share == 2 / 16 and r.unresolved == []
    for s in r.samples:
        assert s["fp64_finite"] is True and s["input_nonfinite"] == 0 and s["input_absmax"] > 500
    assert "3, 11" in r.message and "float64 computes them fine" in r.message
    # Whole batch, two halves, then only the failing groups: far fewer than 2n.
    assert r.replays <= 1 + 2 * 2 * 4


def test_every_sample_failing_is_a_model_problem():
    r = bisect_samples(W.attn_overflow_run(), 0, model=W.AttnNet)
    assert r.kind == "model" and r.bad_samples == list(range(W.BATCH))
    assert r.replays == 2 * W.BATCH - 1


def test_a_finite_step_has_nothing_to_bisect():
    r = bisect_samples(W.healthy_run(), W.HEALTHY_BUNDLE_STEP, model=W.AttnNet)
    assert r.kind == "not_reproduced" and r.bad_samples == [] and r.replays == 1


def test_the_replay_budget_leaves_groups_unresolved():
    r = bisect_samples(W.attn_overflow_run(), 0, model=W.AttnNet, max_replays=4)
    assert r.replays <= 4 and r.unresolved
    assert sorted(i for g in r.unresolved for i in g) + r.bad_samples == sorted(
        set(range(W.BATCH)) - set(r.bad_samples)) + r.bad_samples


def test_cli_bisect():
    res = CliRunner().invoke(main, ["bisect", str(W.bad_samples_run()), "--step", str(W.BAD_STEP),
                                    "--model", f"{W.__file__}:AttnNet", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["kind"] == "data" and doc["bad_samples"] == [3, 11]
    res = CliRunner().invoke(main, ["bisect", str(W.bad_samples_run()), "--step", str(W.BAD_STEP),
                                    "--model", f"{W.__file__}:AttnNet", "--csv"])
    assert res.exit_code == 0 and res.output.splitlines()[0].startswith("index,forward_finite")
    assert [line.split(",")[0] for line in res.output.splitlines()[1:]] == ["3", "11"]
