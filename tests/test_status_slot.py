"""A stopped recorder says so on disk: its status slot, reserved at start,
takes the stop record on a real full tmpfs, and `summary` reports it as an
error, never `healthy`; a recorder that ended without closing is a warning.
The mount tests need root (CI runs as root) and clean up in a finally."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import amp_postmortem
from amp_postmortem.reading.loader import load_run
from recorders import AmpRecorder
from recorders.format import schema
from recorders.status_slot import SLOT_BYTES, StatusSlot
from tiny_models import TinyNet, batches, train

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")


@contextmanager
def tmpfs(tmp_path: Path, size: str):
    """A real tmpfs of `size` at tmp_path/mnt, unmounted in any case."""
    mnt = tmp_path / f"mnt-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(directory: Path) -> None:
    """Write until the filesystem refuses (ENOSPC)."""
    with open(directory / "ballast", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def steps(rec, model, opt, scaler, data):
    """Train on `data` through the recorder `rec` of a job, leaving it open."""
    train(model, data, recorder=lambda *_: rec, optimizer=opt, scaler=scaler, close=False)


def _job(run, **options):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    return AmpRecorder(run, model, optimizer=opt, scaler=scaler, **options), model, opt, scaler


def test_the_slot_is_reserved_in_full_and_overwritten_in_place(tmp_path):
    slot = StatusSlot(tmp_path / "rank=0", run_id="r", rank=0)
    path = tmp_path / "rank=0" / schema.STATUS_FILE
    inode = path.stat().st_ino
    assert path.stat().st_size == SLOT_BYTES and path.stat().st_blocks * 512 >= SLOT_BYTES
    assert json.loads(path.read_text())["status"] == "open"
    assert slot.record(disabled_reason="OSError: x" * 2000, disabled_at_step=7) == path
    after = json.loads(path.read_text())
    assert path.stat().st_ino == inode and path.stat().st_size == SLOT_BYTES  # no new file, no new size
    assert after["disabled_at_step"] == 7 and 1000 < len(after["disabled_reason"]) <= 3000  # cut to fit
    slot.close()


@needs_root
def test_a_full_tmpfs_still_takes_the_stop_record_and_summary_says_error(tmp_path):
    with tmpfs(tmp_path, "8m") as mnt:
        run = mnt / "run"
        rec, model, opt, scaler = _job(run, steps_per_shard=5, flush_interval_s=3600)
        data = batches(15)
        steps(rec, model, opt, scaler, data[:5])
        rec.flush()  # steps 0-4 on disk
        fill(mnt)    # the disk fills up while the job runs
        with pytest.warns(RuntimeWarning, match="recording disabled after an internal error: OSError"):
            steps(rec, model, opt, scaler, data[5:])
            rec.close()
        assert not rec.enabled
        # The manifest's rewrite failed (no room for a new file): only the
        # slot, overwritten in its reserved blocks, says why.
        manifest = json.loads((run / "rank=0" / schema.MANIFEST_FILE).read_text())
        assert manifest["status"] == "open" and manifest["disabled_reason"] is None
        status = json.loads((run / "rank=0" / schema.STATUS_FILE).read_text())
        # The journal writes every step: the first step after the disk filled is the one that stops.
        assert status["status"] == "closed" and status["disabled_at_step"] == 5
        assert "No space left on device" in status["disabled_reason"]

        loaded = load_run(run)
        assert loaded.steps["step"].tolist() == [0, 1, 2, 3, 4]
        report = amp_postmortem.summary(run)
        assert "healthy" not in report.kinds() and "recording_not_closed" not in report.kinds()
        finding = next(f for f in report.findings if f.kind == "recording_disabled")
        assert finding.severity == "error" and finding.evidence["disabled_at_step"] == 5
        assert finding.message.startswith("recording stopped at step 5 on rank(s) 0 (OSError: [Errno 28]")


@needs_root
def test_a_read_only_remount_is_refused_while_the_recorder_holds_its_slot(tmp_path):
    """Linux refuses `mount -o remount,ro` (EBUSY) while a file on the mount
    is open for writing: the recorder's slot keeps the filesystem writable
    for as long as it records, and the run ends complete and closed."""
    with tmpfs(tmp_path, "16m") as mnt:
        run = mnt / "run"
        rec, model, opt, scaler = _job(run, steps_per_shard=4)
        data = batches(8)
        steps(rec, model, opt, scaler, data[:4])
        remount = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True)
        assert remount.returncode != 0 and "busy" in remount.stderr.lower(), remount
        steps(rec, model, opt, scaler, data[4:])
        rec.close()
        assert rec.enabled
        assert load_run(run).steps["step"].tolist() == list(range(8))
        assert "healthy" in amp_postmortem.summary(run).kinds()
        # Once closed, nothing pins it: the same remount goes through.
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)


@needs_root
def test_a_filesystem_that_refuses_every_write_leaves_the_record_in_the_fallback(tmp_path, monkeypatch):
    """A filesystem forced read-only under a running job (an error with
    errors=remount-ro; here an ext4 shut down by its ioctl, which fails every
    write the same way) takes not even the slot: the stop record goes to the
    fallback directory, which the warning names."""
    image = tmp_path / "disk.img"
    subprocess.run(["truncate", "-s", "16M", str(image)], check=True)
    mk = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True)
    mnt = tmp_path / "ext4"
    mnt.mkdir()
    if mk.returncode or subprocess.run(["mount", "-o", "loop", str(image), str(mnt)]).returncode:
        pytest.skip("no loop device or mkfs.ext4 here")
    fallback = tmp_path / "fallback"
    monkeypatch.setenv("AMP_POSTMORTEM_STATUS_FALLBACK_DIR", str(fallback))
    try:
        run = mnt / "run"
        rec, model, opt, scaler = _job(run, steps_per_shard=2, flush_interval_s=3600)
        data = batches(6)
        steps(rec, model, opt, scaler, data[:2])
        rec.flush()
        _shutdown(mnt)
        with pytest.warns(RuntimeWarning, match=f"The reason is recorded in {fallback}"):
            steps(rec, model, opt, scaler, data[2:])
            rec.close()
        (record,) = fallback.glob("*-rank0.json")
        doc = json.loads(record.read_text())
        assert doc["slot"] == str(run / "rank=0" / schema.STATUS_FILE)
        # The journal writes every step: step 2, the first after the shutdown, is the one that stops.
        assert doc["disabled_at_step"] == 2 and doc["disabled_reason"].startswith("OSError")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _shutdown(mnt: Path) -> None:
    """EXT4_IOC_SHUTDOWN (_IOR('X', 125, __u32)), flag NOLOGFLUSH: every later write fails."""
    import fcntl
    import struct
    fd = os.open(mnt, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, 0x8004587D, struct.pack("I", 2))
    finally:
        os.close(fd)


def test_a_recorder_that_ended_without_closing_is_a_warning_not_healthy(open_run):
    report = amp_postmortem.summary(open_run)
    assert "healthy" not in report.kinds()
    finding = next(f for f in report.findings if f.kind == "recording_not_closed")
    assert finding.severity == "warning" and finding.evidence == {"ranks": [0], "last_recorded_step": 3}


def test_a_closed_slot_wins_over_a_manifest_whose_last_rewrite_failed(healthy_run, copy_run, edit_manifest):
    run = copy_run(healthy_run)
    edit_manifest(run / "rank=0" / schema.MANIFEST_FILE, status="open")
    assert load_run(run).rank_manifests[0]["status"] == "closed"
    assert "healthy" in amp_postmortem.summary(run).kinds()
