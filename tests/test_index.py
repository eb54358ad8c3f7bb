"""The per-shard index: written beside each shard pair by the recorder,
read instead of footers and of the steps table, and never needed."""
from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from amp_postmortem.analyses.nans import find_nans
from amp_postmortem.cli import main
from amp_postmortem.reading.loader import load_run
from amp_postmortem.reading.step_facts import from_table
from conftest import OVERFLOW_STEP
from recorders.format import schema


def _index(run, n, rank=0):
    return json.loads((run / f"rank={rank}" / schema.INDEX_DIR / f"part-{n:06d}.json").read_text())


def test_each_shard_pair_has_an_index_with_the_documented_keys(overflow_run):
    docs = [_index(overflow_run, n) for n in range(3)]
    assert [list(d) for d in docs] == [[c.name for c in schema.INDEX_COLUMNS]] * 3
    assert [(d["first_step"], d["last_step"], d["step_rows"]) for d in docs] == [(0, 4, 5), (5, 9, 5), (10, 11, 2)]
    d = docs[1]  # the pair holding the planted overflow of step 7
    assert d["shard"] == "part-000001.parquet" and d["rank"] == 0
    assert d["skipped_steps"] == [OVERFLOW_STEP] and d["nonfinite_loss_steps"] == [OVERFLOW_STEP]
    assert d["applied_nonfinite_steps"] == []
    assert (d["loss_scale_first"], d["loss_scale_last"], d["loss_scale_min"], d["scale_backoffs"]) == (256, 128, 128, 1)
    assert d["first_nonfinite"][0] == {"name": "block.boom", "kind": "activation", "phase": "forward",
                                       "first_step": OVERFLOW_STEP, "last_step": OVERFLOW_STEP, "steps": 1}
    assert [x["nonfinite_rows"] for x in docs] == [0, len(d["first_nonfinite"]), 0]
    assert docs[0]["first_nonfinite"] == [] and docs[0]["tensor_bytes"] == (
        overflow_run / "rank=0" / "tensors" / "part-000000.parquet").stat().st_size


def test_an_indexed_run_is_loaded_without_footers_or_the_steps_table(overflow_run, monkeypatch):
    import amp_postmortem.reading.loader as loader
    monkeypatch.setattr(loader, "read_footer", lambda *a, **k: pytest.fail("a footer was read"))
    run = load_run(overflow_run)
    assert [(s.first_step, s.last_step, s.nonfinite_rows) for s in run.tensor_shards] == [(0, 4, 0), (5, 9, 27), (10, 11, 0)]
    report = find_nans(run)
    assert not run.steps_read  # nans took the step facts from the indexes
    assert report.shards_scanned == 1 and report.nonfinite_loss_steps == [OVERFLOW_STEP]
    assert report.skipped_steps == 1 and len(run.steps) == 12  # read when asked for


@pytest.mark.parametrize("fixture", ["overflow_run", "collapse_run", "two_rank_run", "input_nan_run"])
@pytest.mark.parametrize("window", [(None, None), (3, 8), (45, None), (None, 2)])
def test_step_facts_from_indexes_equal_those_from_the_table(fixture, window, request):
    run = load_run(request.getfixturevalue(fixture))
    lo, hi = window
    fast = run.step_facts(lo, hi)
    slow = from_table(run.steps, lo, hi)
    assert fast.nonfinite_loss_steps == slow.nonfinite_loss_steps
    assert fast.skipped_steps == slow.skipped_steps
    for step in range(0, 80, 3):
        for rank in run.ranks:
            assert fast.row(step, rank) == slow.row(step, rank)


@pytest.mark.parametrize("command", ["nans", "scale", "ranges", "summary"])
def test_a_run_without_indexes_gives_the_same_answers(overflow_run, collapse_run, tmp_path, command):
    for run in (overflow_run, collapse_run):
        old = tmp_path / run.name
        shutil.copytree(run, old)
        shutil.rmtree(old / "rank=0" / schema.INDEX_DIR)
        new_doc = CliRunner().invoke(main, [command, str(run), "--json"]).stdout.replace(str(run), "RUN")
        old_doc = CliRunner().invoke(main, [command, str(old), "--json"]).stdout.replace(str(old), "RUN")
        assert json.loads(new_doc) == json.loads(old_doc)


def test_an_index_that_no_longer_matches_its_shard_is_ignored(copy_run, overflow_run):
    run = copy_run(overflow_run)
    idx = run / "rank=0" / schema.INDEX_DIR / "part-000001.json"
    doc = json.loads(idx.read_text())
    doc["nonfinite_rows"] = 0            # a lie...
    doc["tensor_bytes"] += 1             # ...that the file size gives away
    idx.write_text(json.dumps(doc))
    loaded = load_run(run)
    assert [s.nonfinite_rows for s in loaded.tensor_shards] == [0, 27, 0]  # from the footer
