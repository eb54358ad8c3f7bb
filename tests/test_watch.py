"""`amp-postmortem watch` beside a real job: a tiny model trained in a
subprocess under the real recorder, each step slowed by a sleep, with
`watch` running as a CLI subprocess next to it (or a `RunWatcher` in this
process), on a local directory and on S3 (moto's server, as in
test_storage)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from amp_postmortem.analyses.summary import Finding
from amp_postmortem.analyses.watch import EXIT_CODES, Outcome, RunWatcher, fail_rule, finding_key, follow
from amp_postmortem.cli import main
from interrupt import default_sigint
from recorders.storage import spool_dir_for
from test_storage import BUCKET, s3  # noqa: F401  (the S3 endpoint fixture)

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
NAN_STEP = 6        # block.boom multiplies by 1e6 at this step: float16 Inf in the forward
INTERVAL = 1.0      # the watch's --interval in these tests
# The issue asks interval + 2 s from a step on disk to the alert; a shared
# CI machine (two cores, other jobs) gets room: the exact figure is a
# benchmark's, not a test's.
SLACK = 10.0

JOB = textwrap.dedent("""
    import sys, time
    import torch
    from tiny_models import BoomNet, recorder_at, train

    run, steps, nan_step, pause = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(steps)]

    def plant(step, model, x):
        if step > 0:  # the previous step went through rec.step(): its row is on its way to the journal
            print(f"stepped {step - 1} {time.time()}", flush=True)
        model.block.boom.gain = 1e6 if step == nan_step else 1.0
        time.sleep(pause)

    train(BoomNet(), data, recorder=recorder_at(run, steps_per_shard=5, full_every=5),
          scaler={"init_scale": 2.0 ** 8, "growth_interval": 10 ** 6}, lr=0.01, on_step=plant)
    print("closed", flush=True)
""")


def _env():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]), OMP_NUM_THREADS="1")
    env.pop("NO_COLOR", None)
    return env


def _job(tmp_path, run, *, steps, nan_step=-1, pause=0.2):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    return subprocess.Popen([sys.executable, str(script), str(run), str(steps), str(nan_step), str(pause)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


def _watch(run, *args):
    return subprocess.Popen([sys.executable, "-m", "amp_postmortem", "watch", str(run), "--interval",
                             str(INTERVAL), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), preexec_fn=default_sigint)


def _stepped_at(job_stdout: str) -> dict[int, float]:
    return {int(w[1]): float(w[2]) for w in (line.split() for line in job_stdout.splitlines())
            if w and w[0] == "stepped"}


def test_watch_alerts_on_a_planted_nan_and_exits_with_the_fail_code(tmp_path):
    run = tmp_path / "run"
    run.mkdir()  # empty: the watch waits for the job to start
    watch = _watch(run, "--json")
    job = _job(tmp_path, run, steps=60, nan_step=NAN_STEP, pause=0.25)
    try:
        out, err = watch.communicate(timeout=180)
    finally:
        job.kill()
        job_out, _ = job.communicate(timeout=60)
    assert watch.returncode == EXIT_CODES[Outcome.FAIL_ON] == 1, err
    events = [json.loads(line) for line in out.splitlines()]  # every line is one JSON object
    findings = [e for e in events if e["event"] == "finding"]
    nan = next(e for e in findings if e["kind"] == "nonfinite")
    assert (nan["step"], nan["layer"], nan["severity"], nan["fails"]) == (NAN_STEP, "block.boom", "critical", True)
    assert events[-1]["event"] == "end" and events[-1]["outcome"] == "fail_on"
    assert events[-1]["failing"] == {"kind": "nonfinite", "severity": "critical", "step": NAN_STEP,
                                     "layer": "block.boom"}
    # Each finding once.
    assert len({(e["kind"], e["step"], e["layer"]) for e in findings}) == len(findings)
    # From the step leaving rec.step() (an upper bound on it reaching the
    # disk) to the alert.
    latency = nan["seen_at"] - _stepped_at(job_out)[NAN_STEP]
    assert 0 < latency < INTERVAL + SLACK, latency


def test_watch_exits_0_when_a_clean_job_closes(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    watch = _watch(run)
    job = _job(tmp_path, run, steps=8, pause=0.1)
    try:
        job_out, job_err = job.communicate(timeout=180)
        assert job.returncode == 0, job_err
        out, err = watch.communicate(timeout=60)
    finally:
        watch.kill()
    assert watch.returncode == 0, err
    assert out.splitlines()[-1].startswith("the job closed its recording (last step 7)")
    assert "Traceback" not in err


def test_a_run_directory_still_missing_after_the_wait_is_one_line_and_exit_2(tmp_path):
    watch = _watch(tmp_path / "nowhere", "--wait-timeout", "1.5")
    out, err = watch.communicate(timeout=60)
    assert watch.returncode == 2 and out == ""
    assert err.strip().splitlines()[-1] == (f"Error: run directory not found: {tmp_path / 'nowhere'} (waited 1.5 s "
                                            "for it to appear; --wait-timeout)")
    assert "Traceback" not in err


def test_watch_started_before_the_job_waits_for_its_run_directory(tmp_path):
    """docs/RECORDER.md's `python train.py & amp-postmortem watch RUN`, the watch
    first: the directory appears only once the job's recorder starts."""
    run = tmp_path / "not_yet" / "run"
    watch = _watch(run)
    time.sleep(1.5)
    assert watch.poll() is None and not run.exists()  # still waiting
    job = _job(tmp_path, run, steps=8, pause=0.1)
    try:
        job_out, job_err = job.communicate(timeout=180)
        assert job.returncode == 0, job_err
        out, err = watch.communicate(timeout=60)
    finally:
        watch.kill()
    assert watch.returncode == 0, err
    assert out.splitlines()[-1].startswith("the job closed its recording (last step 7)")


def test_a_file_given_as_the_run_is_not_a_run_directory(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a run")
    result = CliRunner().invoke(main, ["watch", str(notes)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"Error: {notes} is not a run directory (it is a file); pass the directory the recorder writes (the one "
        "that holds manifest.json)"]


def test_the_wait_is_bounded_by_its_timeout_and_looks_every_interval(tmp_path):
    from amp_postmortem.analyses.watch import await_run
    from amp_postmortem.errors import RunNotFoundError
    now = [0.0]
    naps = []

    def sleep(s):
        naps.append(s)
        now[0] += s
    with pytest.raises(RunNotFoundError, match=r"^run directory not found: .*nowhere \(waited 5 s"):
        await_run(tmp_path / "nowhere", timeout=5, interval=2, sleep=sleep, clock=lambda: now[0])
    assert naps == [2, 2, 1]
    made = tmp_path / "made"

    def make(s):
        made.mkdir()
    assert await_run(made, timeout=5, interval=2, sleep=make, clock=lambda: 0.0) == made


@pytest.mark.parametrize("argv, message", [
    (["{run}", "--fail-on", "bogus"], "fail_on 'bogus' is neither a severity"),
    (["{run}", "--interval", "0"], "interval 0.0 is not a positive number"),
    (["{run}", "--wait-timeout", "-1"], "wait_timeout -1.0 is not a number of seconds >= 0"),
])
def test_bad_input_is_one_line_and_exit_2(healthy_run, argv, message):
    result = CliRunner().invoke(main, ["watch", *[a.format(run=healthy_run) for a in argv]])
    assert result.exit_code == 2 and message in result.output
    assert result.output.count("Error:") == 1


def test_a_finished_run_is_read_once_and_its_findings_printed_once(overflow_run, healthy_run):
    watcher = RunWatcher(overflow_run, fail_on=None)
    first = watcher.poll()
    assert [e.finding.kind for e in first.events[:-1]] == ["nonfinite"]
    assert first.end.outcome is Outcome.CLOSED and first.end.exit_code == 0
    again = watcher.poll()  # nothing changed on disk: no analysis, nothing new
    assert [type(e).__name__ for e in again.events] == ["WatchEnd"]
    healthy = RunWatcher(healthy_run).poll()  # the healthy finding is no news
    assert [type(e).__name__ for e in healthy.events] == ["WatchEnd"]


def test_a_disabled_recorder_ends_the_watch_with_code_3(healthy_run, copy_run, edit_manifest):
    # The status slot is where a recorder that failed on a full disk says so.
    run = copy_run(healthy_run)
    edit_manifest(run / "rank=0" / "status.json", disabled_reason="disk full", disabled_at_step=39)
    end = RunWatcher(run).poll().end
    assert (end.outcome, end.exit_code, end.ranks, end.reason) == (Outcome.RECORDING_DISABLED, 3, [0], "disk full")
    assert "recording was switched off on rank(s) 0 (disk full)" in end.lines()[0]


def test_fail_on_takes_a_severity_or_kinds():
    def finding(kind, severity):
        return Finding(kind, severity, 3, "fc", "", "")
    critical = fail_rule("critical")
    assert critical(finding("nonfinite", "critical")) and not critical(finding("stuck_low_scale", "error"))
    assert fail_rule("error")(finding("stuck_low_scale", "error"))
    assert fail_rule("grad_underflow,overflow_risk")(finding("overflow_risk", "warning"))
    assert not fail_rule(None)(finding("nonfinite", "critical"))


def test_a_moving_condition_is_one_finding_an_event_is_keyed_by_its_step():
    assert finding_key(Finding("overflow_risk", "warning", 10, "fc", "", "")) == \
        finding_key(Finding("overflow_risk", "warning", 11, "fc", "", ""))
    assert finding_key(Finding("nonfinite", "critical", 10, "fc", "", "")) != \
        finding_key(Finding("nonfinite", "critical", 11, "fc", "", ""))



def test_a_file_removed_under_the_analysis_is_read_again_at_once(overflow_run, tmp_path, monkeypatch):
    """The job publishes a pair and removes the journal an analysis had
    listed: that analysis fails (`cannot be read`), and the run's files have
    changed since, so the watcher reads it again at once, counting no error.
    Three such looks in a row under load ended a watch with exit 2."""
    import shutil

    from amp_postmortem.analyses import watch as watch_mod
    from amp_postmortem.errors import CorruptRunError
    run = tmp_path / "run"
    shutil.copytree(overflow_run, run)
    real, calls = watch_mod.summarize, []
    gone = CorruptRunError(f"{run}/rank=0/journal/tensors/part-000002.arrows: cannot be read "
                           f"(No such file or directory)")

    def racing(r, **kw):
        calls.append(1)
        if len(calls) == 1:  # the job moves on while this analysis reads
            later = time.time_ns() + 10 ** 9
            os.utime(run / "rank=0" / "manifest.json", ns=(later, later))
            raise gone
        return real(r, **kw)
    monkeypatch.setattr(watch_mod, "summarize", racing)
    watcher = RunWatcher(run, fail_on=None)
    first = watcher.poll()  # a closed run: an error that stands is final (exit 2)
    assert len(calls) == 2 and watcher._errors == 0
    assert [e.finding.kind for e in first.events[:-1]] == ["nonfinite"]

    def failing(r, **kw):
        calls.append(1)
        raise gone
    calls.clear()
    monkeypatch.setattr(watch_mod, "summarize", failing)
    with pytest.raises(CorruptRunError):  # nothing moved: the error stands, read once
        RunWatcher(run, fail_on=None).poll()
    assert len(calls) == 1


def test_a_change_with_no_step_gone_wrong_waits_for_the_rejudge(running_run):
    run = running_run
    watcher = RunWatcher(run)
    assert watcher.poll().end is None and watcher.analyses == 1
    journal = next((run / "rank=0" / "journal" / "steps").glob("part-*.arrows"))
    os.utime(journal, ns=(time.time_ns(), time.time_ns() + 10 ** 9))  # written again, nothing wrong in it
    assert watcher.poll().events == [] and watcher.analyses == 1
    watcher._next_full = time.monotonic()  # the rejudge is due: the change is analysed
    watcher.poll()
    assert watcher.analyses == 2


def test_ctrl_c_stops_the_watch_with_code_130(running_run):
    import signal
    watch = _watch(running_run)
    assert watch.stderr.readline().startswith("watching ")  # said once it looks
    watch.send_signal(signal.SIGINT)
    out, err = watch.communicate(timeout=60)
    assert watch.returncode == 130 and "stopped watching (interrupted)" in err and "Traceback" not in err, err


# ------------------------------------------------------------ a run on S3
def _on_store(s3, uri, job):
    """Waits until the job's run is on the store (its manifest uploaded):
    a URI names no run before (an object store has no empty directory)."""
    prefix = uri[len(f"s3://{BUCKET}/"):]
    deadline = time.monotonic() + 60
    while f"{prefix}/manifest.json" not in s3.keys(prefix):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.1)


def test_watch_of_a_run_on_s3_alerts_on_a_planted_nan(s3, tmp_path):
    uri = f"s3://{BUCKET}/runs/watch-nan"
    pause = 0.25
    job = _job(tmp_path, uri, steps=60, nan_step=NAN_STEP, pause=pause)
    try:
        _on_store(s3, uri, job)
        watch = _watch(uri, "--json")
        out, err = watch.communicate(timeout=180)
    finally:
        job.kill()
        job_out, _ = job.communicate(timeout=60)
    assert watch.returncode == EXIT_CODES[Outcome.FAIL_ON] == 1, err
    events = [json.loads(line) for line in out.splitlines()]
    nan = next(e for e in events if e["event"] == "finding" and e["kind"] == "nonfinite")
    assert (nan["step"], nan["layer"], nan["fails"]) == (NAN_STEP, "block.boom", True)
    assert events[-1]["failing"] == {"kind": "nonfinite", "severity": "critical", "step": NAN_STEP,
                                     "layer": "block.boom"}
    # A store shows published pairs: the step's pair (steps_per_shard=5)
    # is complete a few steps later, then uploaded within about a second.
    latency = nan["seen_at"] - _stepped_at(job_out)[NAN_STEP]
    assert 0 < latency < INTERVAL + SLACK + 5 * pause + 2, latency


def test_watch_of_a_clean_run_on_s3_ends_when_it_closes_and_reads_only_what_changed(s3, tmp_path):
    uri = f"s3://{BUCKET}/runs/watch-clean"
    # 0.25 s a step: the watch starts once the run is on the store (the
    # job's first uploads), and at 0.1 s a busy CI machine left it 6 looks
    # of the job's last steps, too few for what follows to mean anything.
    job = _job(tmp_path, uri, steps=30, pause=0.25)
    try:
        _on_store(s3, uri, job)
        watcher = RunWatcher(uri)
        looks = []

        def sleep(s):
            looks.append(watcher.analyses)
            time.sleep(s)
        events = list(follow(watcher, interval=0.2, sleep=sleep))
        job_out, job_err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0, job_err
    end = events[-1]
    assert (end.outcome, end.exit_code, end.last_step) == (Outcome.CLOSED, 0, 29)
    # A look at an unchanged store downloads nothing: the watch analysed the
    # run at its first look (and its first pair, if the look came before),
    # at the close, and at a rejudge if a loaded machine made the job last
    # 30 s; not once per look (30 steps at 0.25 s: ~35 looks at 0.2 s).
    assert len(looks) >= 8 and watcher.analyses <= 4, (len(looks), watcher.analyses)
    # The watch can end on the uploaded status slot before the job's last
    # uploads (its manifest) land; the job has exited now, so one look
    # catches up with those, and the store is unchanged from then on.
    assert [type(e).__name__ for e in watcher.poll().events] == ["WatchEnd"]
    analysed = watcher.analyses
    for _ in range(3):
        assert [type(e).__name__ for e in watcher.poll().events] == ["WatchEnd"]
    assert watcher.analyses == analysed

    # The job's local spool keeps the journal but gives each published pair
    # up once uploaded: it is no run to watch, and watch says so.
    spool = spool_dir_for(uri, 0)
    assert (spool / "manifest.json").is_file() and not list((spool / "rank=0").rglob("*.parquet"))
    result = CliRunner().invoke(main, ["watch", str(spool)])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"Error: {spool} is the local spool of the run {uri}: it gives each shard pair up once uploaded; "
        f"watch the run's URI instead"]


def test_a_killed_job_on_s3_is_never_called_gone(s3, tmp_path):
    """A pid on the store names a process of the job's machine: even here,
    where it is this host's, the watch does not judge it (on a local run
    the same kill ends the watch with `job_gone`)."""
    uri = f"s3://{BUCKET}/runs/watch-killed"
    job = _job(tmp_path, uri, steps=200, pause=0.05)
    try:
        _on_store(s3, uri, job)
    finally:
        job.kill()
        job.communicate(timeout=60)
    watcher = RunWatcher(uri)
    assert watcher.poll().end is None and watcher.poll().end is None


def test_a_missing_run_on_s3_is_one_line_and_exit_2(s3):
    result = CliRunner().invoke(main, ["watch", f"s3://{BUCKET}/runs/nothing-here", "--wait-timeout", "0"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1] == f"Error: run directory not found: s3://{BUCKET}/runs/nothing-here"


def test_a_store_that_stops_answering_is_asked_again_then_an_error(tmp_path, monkeypatch):
    """The retry rule of a local run, on a store (fsspec's `memory://`): a
    failed look is no news; three in a row are one error line."""
    from fsspec.implementations.memory import MemoryFileSystem

    from amp_postmortem.errors import RunNotFoundError
    from conftest import record_run
    monkeypatch.setenv("AMP_POSTMORTEM_SPOOL_DIR", str(tmp_path / "spool"))
    uri = "memory://amp-watch/runs/outage"
    record_run(uri, steps=3)
    watcher = RunWatcher(uri)
    assert watcher.poll().end.outcome is Outcome.CLOSED

    def down(self, *args, **kwargs):
        raise ConnectionError("store unreachable")
    with monkeypatch.context() as outage:
        outage.setattr(MemoryFileSystem, "isdir", down)
        assert watcher.poll().events == [] and watcher.poll().events == []
    assert watcher.poll().end.outcome is Outcome.CLOSED  # back: the count starts again
    with monkeypatch.context() as outage:
        outage.setattr(MemoryFileSystem, "isdir", down)
        watcher.poll(), watcher.poll()
        with pytest.raises(RunNotFoundError, match=f"^cannot read the run {uri} "
                                                   r"\(ConnectionError: store unreachable\)$"):
            watcher.poll()
    assert watcher.analyses == 1  # the run never changed: analysed once


def test_a_recorder_making_its_run_is_waited_for_a_stray_directory_is_no_run(tmp_path):
    """Between a recorder's first rank directory and its first manifest the
    directory is a run being made: the watch waits (it once ended there in
    an error). A directory holding anything else is no run."""
    from amp_postmortem.errors import RunNotFoundError

    run = tmp_path / "run"
    (run / "rank=0" / "journal").mkdir(parents=True)
    (run / ".manifest.json.tmp").write_text("{")
    watcher = RunWatcher(run)
    assert watcher.poll().events == []
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("not a run")
    with pytest.raises(RunNotFoundError, match="is not an amp-postmortem run"):
        RunWatcher(other).poll()
