"""load_run: validation, ranks, shard pruning, damage as warnings or errors."""
import json

import pytest

from amp_postmortem.errors import (CorruptRunError, MixedRunsError, RankNotFoundError, RunNotFoundError,
                                   UnsupportedVersionError)
from amp_postmortem.reading.loader import load_run
from recorders.format import schema


def test_loads_steps_and_footers(overflow_run):
    run = load_run(overflow_run)
    assert run.ranks == [0] and run.world_size == 1
    assert run.warnings == []
    assert run.steps["step"].tolist() == list(range(12))
    assert {c.name for c in schema.STEP_COLUMNS} <= set(run.steps.columns)
    # 12 steps, 5 per shard: footers say which steps and how many NaN/Inf rows.
    assert [(s.first_step, s.last_step) for s in run.tensor_shards] == [(0, 4), (5, 9), (10, 11)]
    assert [s.nonfinite_rows > 0 for s in run.tensor_shards] == [False, True, False]
    assert run.autocast["dtype"] == "float16"
    assert run.scaler["init_scale"] == 256.0


def test_nan_loss_is_told_from_missing_loss(overflow_run):
    steps = load_run(overflow_run).steps
    assert steps.loc[steps["loss_nonfinite"], "step"].tolist() == [7]


def test_nonfinite_scan_opens_only_shards_with_nonfinite_rows(overflow_run):
    run = load_run(overflow_run)
    df = run.scan_tensors(["step", "name", "nan_count", "inf_count"], nonfinite_only=True)
    assert set(df["step"]) == {7}
    assert ((df["nan_count"] + df["inf_count"]) > 0).all()
    assert [p.name for p in run.scanned_files] == ["part-000001.parquet"]


def test_scan_by_steps_prunes_shards_and_projects_columns(overflow_run):
    run = load_run(overflow_run)
    df = run.scan_tensors(["step", "name", "absmax"], steps=[10], kinds=["activation"])
    assert list(df.columns) == ["step", "name", "absmax"]
    assert set(df["step"]) == {10}
    assert [p.name for p in run.scanned_files] == ["part-000002.parquet"]


def test_missing_directory(tmp_path):
    with pytest.raises(RunNotFoundError, match="run directory not found"):
        load_run(tmp_path / "nope")


def test_directory_without_manifest(tmp_path):
    with pytest.raises(RunNotFoundError, match="not an amp-postmortem run"):
        load_run(tmp_path)


def test_rank_directory_instead_of_run_gets_a_hint(overflow_run):
    with pytest.raises(RunNotFoundError, match="one rank of a run: pass the run directory .*--rank 0"):
        load_run(overflow_run / "rank=0")
    with pytest.raises(RunNotFoundError, match="not an amp-postmortem run"):
        load_run(overflow_run / "rank=0" / "steps")


def test_wrong_format_name(copy_run, overflow_run, edit_manifest):
    run = copy_run(overflow_run)
    edit_manifest(run / "manifest.json", format="something-else")
    with pytest.raises(CorruptRunError, match="'something-else'.*not an amp-postmortem run"):
        load_run(run)


def test_unreadable_manifest(copy_run, overflow_run):
    run = copy_run(overflow_run)
    (run / "manifest.json").write_text("{not json")
    with pytest.raises(CorruptRunError, match="not a readable manifest"):
        load_run(run)


def test_newer_major_version_is_refused_with_upgrade_message(copy_run, overflow_run, edit_manifest):
    run = copy_run(overflow_run)
    edit_manifest(run / "manifest.json", schema_version=f"{schema.SCHEMA_MAJOR + 1}.0")
    with pytest.raises(UnsupportedVersionError, match="upgrade amp-postmortem"):
        load_run(run)


def test_newer_minor_version_is_read(copy_run, overflow_run, edit_manifest):
    run = copy_run(overflow_run)
    edit_manifest(run / "manifest.json", schema_version=f"{schema.SCHEMA_MAJOR}.99", new_key=1)
    assert len(load_run(run).steps) == 12


def test_torn_shard_is_skipped_with_a_warning_naming_it(copy_run, overflow_run):
    run = copy_run(overflow_run)
    torn = run / "rank=0" / "tensors" / "part-000002.parquet"
    torn.write_bytes(torn.read_bytes()[:100])
    loaded = load_run(run)
    assert any("rank=0/tensors/part-000002.parquet" in w and "unreadable" in w for w in loaded.warnings)
    assert any("steps 10-11 have no tensor rows" in w for w in loaded.warnings)
    assert len(loaded.steps) == 12 and len(loaded.tensor_shards) == 2


def test_torn_steps_shard(copy_run, overflow_run):
    run = copy_run(overflow_run)
    torn = run / "rank=0" / "steps" / "part-000002.parquet"
    torn.write_bytes(b"PAR1garbage")
    loaded = load_run(run)
    assert loaded.steps["step"].tolist() == list(range(10))
    assert any("rank=0/steps/part-000002.parquet" in w for w in loaded.warnings)


def test_temporary_files_are_invisible(copy_run, overflow_run):
    run = copy_run(overflow_run)
    (run / "rank=0" / "tensors" / ".part-000003.parquet.tmp").write_bytes(b"half written")
    assert load_run(run).warnings == []


def test_open_status_warns_that_the_job_did_not_close(open_run):
    run = load_run(open_run)
    assert len(run.steps) == 4
    assert any("not closed" in w and "killed" in w for w in run.warnings)


def test_two_ranks(two_rank_run):
    run = load_run(two_rank_run)
    assert run.ranks == [0, 1] and run.warnings == []
    assert sorted(set(run.steps["rank"])) == [0, 1] and len(run.steps) == 12
    only = load_run(two_rank_run, rank=1)
    assert only.ranks == [1] and set(only.steps["rank"]) == {1}
    with pytest.raises(RankNotFoundError, match="rank 5 is not in .*ranks on disk: 0, 1"):
        load_run(two_rank_run, rank=5)


def test_missing_rank_warns(copy_run, two_rank_run):
    import shutil
    run = copy_run(two_rank_run)
    shutil.rmtree(run / "rank=1")
    loaded = load_run(run)
    assert any("rank(s) 1 of world_size 2 are missing" in w for w in loaded.warnings)


def test_rank_manifests_disagreeing_on_run_id_are_mixed_runs(copy_run, two_rank_run, edit_manifest):
    run = copy_run(two_rank_run)
    edit_manifest(run / "rank=1" / "manifest.json", run_id="another-run")
    with pytest.raises(MixedRunsError, match="mixed runs"):
        load_run(run)
    # One rank at a time, each is readable; the other rank's is not this run.
    assert load_run(run, rank=0).ranks == [0]
    with pytest.raises(MixedRunsError, match="rank 1 has run_id 'another-run'"):
        load_run(run, rank=1)


def test_shard_of_another_run_is_mixed_runs(copy_run, two_rank_run, overflow_run):
    import shutil
    run = copy_run(two_rank_run)
    shutil.copy(overflow_run / "rank=0" / "tensors" / "part-000001.parquet",
                run / "rank=0" / "tensors" / "part-000009.parquet")
    with pytest.raises(MixedRunsError, match="part-000009.parquet belongs to run"):
        load_run(run)


def test_manifest_json_is_what_the_recorder_wrote(overflow_run):
    m = json.loads((overflow_run / "manifest.json").read_text())
    assert load_run(overflow_run).run_id == m["run_id"]
