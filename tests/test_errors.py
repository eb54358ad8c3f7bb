"""One error model: what the user can fix is a `PostmortemError` (one line,
exit 2), anything else is a bug (exit 1, one line, the traceback with
--debug); a run with no readable step is an error that says why, and a run
whose recording stopped part-way says so in `summary`."""
from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import amp_postmortem
from amp_postmortem.cli import main
from amp_postmortem.errors import (DeviceError, EmptyRunError, LossFnSpecError, OptionError, PolicyError,
                                   PostmortemError, PrecisionError, RunNotFoundError)
from conftest import record_run
from recorders.journal import Journal

DISK_FULL = "No space left on device"


def _failing_writes(monkeypatch, allowed: int, journal_steps: int = 0):
    """Parquet writes fail after `allowed` succeed, and the journal's from
    then on: a disk that fills up."""
    real = pq.write_table
    calls = {"n": 0}

    def write_table(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > allowed:
            raise OSError(28, DISK_FULL)
        return real(*args, **kwargs)

    append = Journal.append
    # The journal takes `journal_steps` steps (those the allowed shard
    # writes hold), then the disk is full for it too: counted by appends,
    # not by when the pair's writes (on the publisher's thread) happened.
    appends = {"n": 0}

    def journal_append(self, *args, **kwargs):
        appends["n"] += 1
        if appends["n"] > journal_steps:
            raise OSError(28, DISK_FULL)
        return append(self, *args, **kwargs)

    monkeypatch.setattr(pq, "write_table", write_table)
    monkeypatch.setattr(Journal, "append", journal_append)


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """Recording switched itself off at the second shard: steps 0-4 on disk."""
    mp = pytest.MonkeyPatch()
    try:
        _failing_writes(mp, allowed=2, journal_steps=5)  # one shard pair: steps and tensors of steps 0-4
        with pytest.warns(RuntimeWarning, match="recording disabled"):
            run = record_run(tmp_path_factory.mktemp("err") / "stopped", steps=12, steps_per_shard=5)
    finally:
        mp.undo()
    return run


def _cli(*argv):
    return CliRunner().invoke(main, [str(a) for a in argv])


def _one_error_line(result, code: int) -> str:
    assert result.exit_code == code, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in result.output
    return lines[0]


# ----------------------------------------------------------- bad runs
def test_run_without_a_shard_yet_is_an_error_not_healthy(tmp_path):
    run = record_run(tmp_path / "zero", steps=0)
    with pytest.raises(EmptyRunError, match="holds no readable step: no shard written yet"):
        amp_postmortem.summary(run)
    line = _one_error_line(_cli("summary", run), 2)
    assert line == (f"Error: {run} holds no readable step: no shard written yet (the recorder writes one "
                    "every steps_per_shard steps and on close)")


def test_run_whose_every_shard_is_unreadable_names_the_first(overflow_run, tmp_path):
    run = tmp_path / "truncated"
    shutil.copytree(overflow_run, run)
    for f in run.rglob("part-*.parquet"):
        f.write_bytes(f.read_bytes()[:100])
    line = _one_error_line(_cli("nans", run), 2)
    assert line == (f"Error: {run} holds no readable step: no steps shard among its 6 shard file(s) could be "
                    "used; first: skipped unreadable shard rank=0/steps/part-000000.parquet (ArrowInvalid: Parquet "
                    "magic bytes not found in footer. Either the file is corrupted or this is not a parquet file.); "
                    "a job killed while writing it leaves such a file")


def test_run_of_foreign_parquet_files_is_an_error(overflow_run, tmp_path):
    run = tmp_path / "foreign"
    shutil.copytree(overflow_run, run)
    for f in run.rglob("part-*.parquet"):
        pq.write_table(pa.table({"epoch": [1, 2], "accuracy": [0.5, 0.7]}), f)
    with pytest.raises(EmptyRunError, match=r"first: skipped rank=0/\w+/part-\d+\.parquet: not a \w+ shard of this "
                                            r"format \(no column 'step'\)"):
        amp_postmortem.scale(run)


def test_manifest_without_rank_directories_is_an_error(overflow_run, tmp_path):
    run = tmp_path / "bare"
    shutil.copytree(overflow_run, run)
    shutil.rmtree(run / "rank=0")
    line = _one_error_line(_cli("ranges", run), 2)
    assert line == f"Error: {run} has a manifest but no rank=<r> directories: nothing was recorded"


def test_recording_disabled_before_the_first_shard_gives_its_reason(monkeypatch, tmp_path):
    _failing_writes(monkeypatch, allowed=0)
    with pytest.warns(RuntimeWarning, match="recording disabled"):
        run = record_run(tmp_path / "full_disk", steps=3)
    monkeypatch.undo()
    line = _one_error_line(_cli("summary", run), 2)
    assert line.startswith(f"Error: {run} holds no readable step: no shard written yet")
    assert line.endswith(f"; recording was switched off (OSError: [Errno 28] {DISK_FULL})")


def test_recording_stopped_part_way_is_an_error_finding_that_fail_on_gates(stopped_run):
    report = amp_postmortem.summary(stopped_run)
    finding = next(f for f in report.findings if f.kind == "recording_disabled")
    assert (finding.severity, finding.step) == ("error", 4)
    assert finding.evidence == {"disabled_reasons": {"0": f"OSError: [Errno 28] {DISK_FULL}"},
                                "last_recorded_step": 4, "disabled_at_step": 5}
    # Step 5 is the journal's first write after the disk filled: there it stops.
    assert finding.message.startswith("recording stopped at step 5 on rank(s) 0 (OSError")
    assert "healthy" not in report.kinds()
    assert _cli("summary", stopped_run, "--fail-on", "recording_disabled").exit_code == 1
    assert _cli("summary", stopped_run, "--fail-on", "nonfinite").exit_code == 0


# ------------------------------------------------------- user vs bug
def test_missing_run_is_a_user_error():
    line = _one_error_line(_cli("scale", "no/such/run"), 2)
    assert line == "Error: run directory not found: no/such/run"
    with pytest.raises(RunNotFoundError):
        amp_postmortem.load_run("no/such/run")


def test_an_unexpected_exception_is_an_internal_error_with_exit_1(overflow_run, monkeypatch):
    import amp_postmortem.analyses.scale as scale

    def broken(run):
        raise ZeroDivisionError("division by zero\nsecond line")

    monkeypatch.setattr(scale, "scale_dynamics", broken)
    line = _one_error_line(_cli("scale", overflow_run), 1)
    assert line == ("Error: internal error: ZeroDivisionError: division by zero "
                    "(re-run with --debug for the traceback)")
    debug = _cli("--debug", "scale", overflow_run)
    assert debug.exit_code == 1 and isinstance(debug.exception, ZeroDivisionError)
    monkeypatch.setenv("AMP_POSTMORTEM_DEBUG", "1")
    assert isinstance(_cli("scale", overflow_run).exception, ZeroDivisionError)


def test_debug_shows_the_user_error_raised():
    result = _cli("--debug", "nans", "no/such/run")
    assert isinstance(result.exception, RunNotFoundError)


@pytest.mark.parametrize("call,error,message", [
    (lambda run: amp_postmortem.scale_window(run, scales=(4, 2)), OptionError,
     "scales 4:2 is an empty range; give MIN:MAX with MIN <= MAX (e.g. -16:40)"),
    (lambda run: amp_postmortem.scale_window(run, step=10_000), PostmortemError,
     "step 10000 is not in the run (recorded steps 0..11)"),
    (lambda run: amp_postmortem.compare(run, run, threshold=0), OptionError,
     "threshold 0 must be a positive relative difference, e.g. 0.1 for 10%"),
])
def test_bad_values_are_named_errors_naming_the_value(overflow_run, call, error, message):
    with pytest.raises(error) as raised:
        call(overflow_run)
    assert str(raised.value) == message


def test_replay_option_errors_have_their_own_classes():
    from amp_postmortem.replaying import _check_precisions, resolve_policy
    from amp_postmortem.replaying.model_spec import resolve_loss_fn
    with pytest.raises(PrecisionError, match="precision 'fp8' is not one of fp64, fp32, fp16, bf16"):
        _check_precisions(["fp8"])
    with pytest.raises(PolicyError, match="policy 'tpu' is not one of recorded, cuda, cpu"):
        resolve_policy("tpu", None, "fp16")
    with pytest.raises(LossFnSpecError, match="loss-fn spec 'nowhere' is not of the form "
                                              "package.module:function or path/to/file.py:function"):
        resolve_loss_fn("nowhere")
    with pytest.raises(LossFnSpecError, match=r"loss-fn spec 'json:nope': 'nope' not found in 'json'"):
        resolve_loss_fn("json:nope")
    assert resolve_loss_fn("json:dumps") is json.dumps
    assert issubclass(DeviceError, PostmortemError)


def test_replay_values_are_checked_before_any_replay(overflow_run):
    with pytest.raises(DeviceError, match="device 'tpu' is not one of cpu, cuda"):
        amp_postmortem.fix(overflow_run, step=7, device="tpu")
    with pytest.raises(PrecisionError, match="precision 'fp32' is not one of fp16, bf16"):
        amp_postmortem.bisect(overflow_run, step=7, precision="fp32")


def test_a_run_of_tensor_shards_only_says_so(overflow_run, tmp_path):
    run = tmp_path / "no_steps"
    shutil.copytree(overflow_run, run)
    shutil.rmtree(run / "rank=0" / "steps")
    with pytest.raises(EmptyRunError, match=r"holds no readable step: none of its 3 shard file\(s\) is a steps shard"):
        amp_postmortem.load_run(run)
