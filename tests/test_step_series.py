"""The per-step reduction across ranks: reduced shard by shard, it equals the
one over the steps table, and `scale`/`summary` never read that table."""
from __future__ import annotations

import json
import math
import shutil

import pandas as pd
import pytest
from click.testing import CliRunner

import amp_postmortem.reading.loader as loader
from amp_postmortem.reading import step_facts, step_series
from amp_postmortem.analyses.nans import find_nans
from amp_postmortem.analyses.scale import scale_dynamics
from amp_postmortem.analyses.summary import summarize
from amp_postmortem.cli import main
from amp_postmortem.reading.engines.scan import ShardScan, scan_shard
from amp_postmortem.reading.loader import load_run
from recorders.format import schema


def test_the_series_reduced_shard_by_shard_equals_the_one_from_the_steps_table(uneven_ranks_run):
    run = load_run(uneven_ranks_run)
    fast = run.step_series()
    assert not run.steps_read  # reduced from the shards, never the table
    slow = step_series.from_table(load_run(uneven_ranks_run).steps)
    pd.testing.assert_frame_equal(fast.steps, slow.steps)
    assert fast.rank_last_steps == slow.rank_last_steps == {0: 7, 1: 11, 2: 11}

    s = fast.steps.set_index("step")
    assert s.index.tolist() == list(range(12))
    # Steps 8-11 have no rank-0 row: the lowest rank there is 1, which has no scale.
    assert s["rank"].tolist() == [0] * 8 + [1] * 4
    assert s["loss_scale_before"].tolist()[:8] == [256.0] * 8 and s["loss_scale_before"].iloc[8:].isna().all()
    # ...so the first recorded scale in rank order is rank 2's.
    assert s["loss_scale_before_first"].tolist()[8:] == [2048.0, 2048.0, 2048.0, 4096.0]
    assert s.index[s["skipped_any"]].tolist() == [7]                     # rank 2's skip
    assert s.index[s["loss_nonfinite_any"]].tolist() == [7, 8, 9, 10, 11]  # rank 1's NaN losses
    assert s.index[s["applied_nonfinite_any"]].tolist() == [7, 8, 9, 10, 11]  # rank 1 has no scaler
    assert s["clean_recorded_any"].all() and not s["sharded_grad_any"].any()
    assert not s["skipped"].any()  # the lowest rank's own row was never skipped


def test_partials_merge_in_any_grouping(uneven_ranks_run):
    run = load_run(uneven_ranks_run)
    parts = []
    for shard in run.step_shards:
        part = scan_shard(ShardScan(path=str(shard.path), columns=tuple(step_series.READ_COLUMNS),
                                    reduce=step_series.shard_partial, table=schema.STEPS_DIR))
        assert part.error is None
        parts.append(part.result)
    whole = step_series.finish(step_series.merge(parts))
    halves = step_series.finish(step_series.merge([step_series.merge(parts[1::2]),
                                                   step_series.merge(parts[::2])]))
    pd.testing.assert_frame_equal(whole.steps, halves.steps)
    assert whole.rank_last_steps == halves.rank_last_steps
    pd.testing.assert_frame_equal(whole.steps, run.step_series().steps)


def test_scale_and_summary_never_read_the_steps_table_of_an_indexed_run(uneven_ranks_run, monkeypatch):
    expected_scale = scale_dynamics(_with_table(load_run(uneven_ranks_run))).to_dict()
    expected_summary = summarize(_with_table(load_run(uneven_ranks_run))).to_dict()
    monkeypatch.setattr(loader, "read_steps", lambda *a, **k: pytest.fail("the steps table was read"))
    run = load_run(uneven_ranks_run)
    got = scale_dynamics(run).to_dict()
    assert got == expected_scale
    assert (got["steps"], got["last_step"], got["skipped_steps"]) == (8, 7, 1)  # rank 0's steps
    got = summarize(run).to_dict()
    assert got == expected_summary
    assert (got["run"]["steps"], got["run"]["skipped_steps"], got["run"]["nonfinite_loss_steps"]) == (12, 1, 5)
    assert [(f["kind"], f["step"], f["layer"]) for f in got["findings"]] == [("nonfinite", 7, "block.boom")]
    assert not run.steps_read


def _with_table(run):
    run.steps  # read first: every analysis then reduces the table itself
    return run


def test_a_step_recorded_twice_is_reduced_from_the_table(copy_run, uneven_ranks_run):
    """A resumed job's shards overlap: only the table knows which copy is kept."""
    run_dir = copy_run(uneven_ranks_run)
    steps = run_dir / "rank=2" / schema.STEPS_DIR
    shutil.copy(steps / "part-000000.parquet", steps / "part-000009.parquet")
    run = load_run(run_dir)
    series = run.step_series()
    assert run.steps_read
    assert any("recorded twice" in w for w in run.warnings)
    pd.testing.assert_frame_equal(series.steps, step_series.from_table(run.steps).steps)


def test_an_unreadable_steps_shard_is_named_as_before(copy_run, uneven_ranks_run):
    run_dir = copy_run(uneven_ranks_run)
    (run_dir / "rank=2" / schema.STEPS_DIR / "part-000001.parquet").write_bytes(b"PAR1 truncated")
    doc = json.loads(CliRunner().invoke(main, ["summary", str(run_dir), "--json"]).stdout)
    assert any(w.startswith("skipped unreadable shard rank=2/steps/part-000001.parquet")
               for w in doc["run"]["warnings"])
    assert doc["run"]["steps"] == 12 and doc["run"]["skipped_steps"] == 0  # rank 2's step 7 is gone


def test_a_run_with_one_rank_reads_its_shards_too(overflow_run, monkeypatch):
    monkeypatch.setattr(loader, "read_steps", lambda *a, **k: pytest.fail("the steps table was read"))
    run = load_run(overflow_run)
    assert (run.first_step, run.last_step) == (0, 11)
    s = run.step_series().steps
    assert s["step"].tolist() == list(range(12)) and s.loc[s["skipped_any"], "step"].tolist() == [7]
    assert math.isnan(s.loc[7, "loss"]) and s["loss_nonfinite_any"].sum() == 1


@pytest.mark.parametrize("fixture", ["uneven_ranks_run", "collapse_run", "overflow_run"])
@pytest.mark.parametrize("window", [(None, None), (3, 8), (45, None)])
def test_a_run_without_indexes_takes_its_step_facts_from_the_series(fixture, window, copy_run, request,
                                                                    monkeypatch):
    """A run recorded before the indexes: `nans` still never reads the table."""
    run_dir = copy_run(request.getfixturevalue(fixture))
    for index_dir in run_dir.glob(f"rank=*/{schema.INDEX_DIR}"):
        shutil.rmtree(index_dir)
    slow = step_facts.from_table(load_run(run_dir).steps, *window)
    monkeypatch.setattr(loader, "read_steps", lambda *a, **k: pytest.fail("the steps table was read"))
    run = load_run(run_dir)
    assert run.shard_indexes == {}
    fast = run.step_facts(*window)
    assert (fast.nonfinite_loss_steps, fast.skipped_steps) == (slow.nonfinite_loss_steps, slow.skipped_steps)
    for step in range(0, 80, 3):
        for rank in run.ranks:
            assert fast.row(step, rank) == slow.row(step, rank)
    find_nans(run)  # and the whole analysis
