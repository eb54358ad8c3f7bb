"""One writer per rank directory: a second recorder on the same run and rank
refuses with one warning naming the holder and touches none of its files;
a lease left by a killed process is taken over."""
from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import recorders.lease as lease_module
from amp_postmortem.reading.loader import load_run
from recorders import AmpRecorder
from recorders.format import schema
from recorders.lease import LeaseHeldError, RankLease
from tiny_models import TinyNet, batches, train

TESTS = Path(__file__).resolve().parent


def _job(run):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return AmpRecorder(run, model, optimizer=opt, steps_per_shard=2), model, opt


def _steps(rec, model, opt, n, first=0):
    """n steps of the job through its recorder `rec`, leaving it open."""
    train(model, batches(n, seed=first + 1), recorder=lambda *_: rec, optimizer=opt, dtype=None, scaler=None,
          close=False)


def _files(run: Path) -> dict:
    return {p.relative_to(run).as_posix(): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_second_recorder_in_the_same_process_refuses_and_touches_nothing(tmp_path):
    run = tmp_path / "run"
    first, model, opt = _job(run)
    _steps(first, model, opt, 4)
    first.flush()
    before = _files(run)
    with pytest.warns(RuntimeWarning) as caught:
        second, model2, opt2 = _job(run)
    (w,) = [c for c in caught if "amp-postmortem" in str(c.message)]
    assert (f"is being written by another recorder (host {socket.gethostname()}, pid {os.getpid()}"
            in str(w.message)) and "Training continues unrecorded" in str(w.message)
    assert not second.enabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning, not one per step
        _steps(second, model2, opt2, 4)  # its training goes on
        second.close()
    assert _files(run) == before  # not a byte of the first's files, manifest included
    _steps(first, model, opt, 2, first=4)
    first.close()
    loaded = load_run(run)
    assert loaded.steps["step"].tolist() == list(range(6)) and loaded.warnings == []
    # Released on close(): a third recorder resumes the run.
    third, model3, opt3 = _job(run)
    assert third.enabled
    third.close()


HOLDER = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {tests!r})
    from recorders import AmpRecorder
    from tiny_models import TinyNet
    rec = AmpRecorder({run!r}, TinyNet())
    print("holding", flush=True)
    time.sleep(60)
""")


def test_a_lease_held_by_another_process_refuses_until_it_is_killed(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(tests=str(TESTS), run=str(run))],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.warns(RuntimeWarning, match=f"another recorder \\(host {socket.gethostname()}, "
                                                f"pid {holder.pid},"):
            refused, _, _ = _job(run)
        assert not refused.enabled
        refused.close()
        holder.send_signal(signal.SIGKILL)  # the old job dies without closing
        holder.wait(timeout=30)
        # Its lease is stale (the kernel dropped the lock): the next recorder takes it over.
        rec, model, opt = _job(run)
        assert rec.enabled
        _steps(rec, model, opt, 4)
        rec.close()
        assert json.loads((run / "rank=0" / schema.LEASE_FILE).read_text())["pid"] == os.getpid()
        assert load_run(run).steps["step"].tolist() == list(range(4))
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_without_flock_a_live_pid_holds_and_a_dead_one_is_taken_over(tmp_path, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(lease_module.fcntl, "flock", no_flock)
    rank_dir = tmp_path / "rank=0"
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        rank_dir.mkdir()
        lock = rank_dir / schema.LEASE_FILE
        lock.write_text(json.dumps({"host": socket.gethostname(), "pid": alive.pid, "started_at": 0}))
        with pytest.raises(LeaseHeldError, match=f"pid {alive.pid}"):
            RankLease(rank_dir)
        alive.kill()
        alive.wait()
        taken = RankLease(rank_dir)  # the pid is gone: stale
        assert not taken.flock and json.loads(lock.read_text())["pid"] == os.getpid()
        with pytest.raises(LeaseHeldError, match=f"pid {os.getpid()}"):
            RankLease(rank_dir)  # ours is live
        taken.release()
        assert not lock.exists()
        # Another host's lease: alive while refreshed, stale once old.
        lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "started_at": 0}))
        with pytest.raises(LeaseHeldError, match="host elsewhere"):
            RankLease(rank_dir)
        old = lock.stat().st_mtime - lease_module.STALE_AFTER_S - 5
        os.utime(lock, (old, old))
        RankLease(rank_dir).release()
    finally:
        if alive.poll() is None:
            alive.kill()
            alive.wait()
