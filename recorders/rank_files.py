"""A rank's place in a run: its directory (or a URI run's local spool and
uploads), the lease that makes this recorder its one writer, the run's id,
and the status slot reserved for the stop record."""
from __future__ import annotations

import warnings

from .format import schema
from .lease import LeaseHeldError, RankLease
from .run_id import shared_run_id
from .status_slot import StatusSlot
from .storage import open_run_location


class RankFiles:
    """`open()` opens, in this order: the location (`run_dir`; a URI run's spool,
    with `uploader`), the lease, the store's resumed shard count, the run id
    (every rank waits for rank 0's, a refused rank too, or the others would
    wait for it), then the status slot. A rank directory another live
    recorder holds raises `LeaseHeldError` once the id is shared; any other
    failure leaves what was opened in place (`run_dir`, `rank_dir`) for the
    stop record."""

    def __init__(self, location, rank: int, *, storage, run_id: str | None):
        self.location = location
        self.rank = rank
        self.run_dir = self.rank_dir = None
        self.uploader = None
        self.uploading = False
        self.lease = None
        self.status = None
        self.run_id = run_id
        self.first_shard = 0
        self.upload_report = None
        self.storage = storage

    def open(self) -> None:
        location, rank, storage = self.location, self.rank, self.storage
        self.run_dir, self.uploader = open_run_location(location, rank, spool_dir=storage.spool_dir,
                                                        spool_max_bytes=storage.spool_max_bytes)
        self.rank_dir = self.run_dir / schema.RANK_DIR.format(rank=rank)
        held = None
        try:
            self.lease = RankLease(self.rank_dir)
        except LeaseHeldError as exc:
            held = exc
        if self.uploader is not None and held is None:
            # The store's round trips run on the upload thread; the run
            # waits for its answer (a resumed run's id and shard count) a
            # bounded moment, never for a store that is down.
            self.uploader.start(resume_rank=rank)
            self.uploading = True
            self.first_shard = self.uploader.resume_run(rank)
        self.run_id = shared_run_id(self.run_dir, rank, self.run_id)
        if held is not None:
            raise held
        # The space of the stop record, taken while the disk has room.
        self.status = StatusSlot(self.rank_dir, run_id=self.run_id, rank=rank)

    def notify_uploads(self) -> None:
        """A shard may be waiting: the upload thread looks now (a URI run)."""
        if self.uploader is not None:
            self.uploader.notify()

    def close(self, spool_full_steps: int = 0) -> None:
        """Upload what the spool holds (a URI run), report (never drop) what
        the store did not take, close the status slot, release the lease
        (last: the spool's uploads are this writer's too)."""
        if self.uploader is not None and self.uploading:
            report = self.uploader.close(self.storage.upload_timeout_s)
            report.spool_full_steps = spool_full_steps
            self.upload_report = report
            if report.pending or report.spool_full_steps:
                lost = (f"; {report.spool_full_steps} step(s) were not recorded because the spool was full"
                        if report.spool_full_steps else "")
                warnings.warn(
                    f"amp-postmortem: {len(report.pending)} file(s) of run {report.uri} are not uploaded "
                    f"({report.last_error or 'store unavailable'}); they are kept in {report.spool_dir} "
                    f"(a recorder on the same run uploads them, or copy them there yourself){lost}",
                    RuntimeWarning, stacklevel=4)
        if self.status is not None:
            self.status.close()
        if self.lease is not None:
            self.lease.release()
