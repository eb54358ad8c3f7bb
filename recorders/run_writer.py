"""The recorder's writer side: steps handed over from the training thread,
and everything done with them on the writer thread.

Training thread: `submit(job)` hands a job to the writer thread without
waiting (a full queue drops the step and counts it); `submit_step` holds a
clean step (not sampled, facts showing no event) back until a few more are
there (`HOLD_BACK_STEPS`, `HOLD_BACK_S`): one hand-over, a lock and a
wake-up, for many steps. Any other job sends them first, so the writer's
order is the steps'. Held steps that are due go when the next backward pass
begins (`on_backward_start`), or at the next step if none was seen: the
writer's Python then runs while the training thread is inside the autograd
engine, which holds no GIL. Handed over at `rec.step()`, it ran while the
training thread's next forward needed the GIL at every operation (the
launch-bound proxy of `benchmarks/`, ablated in one process: 0.1-0.25 ms of
a 14 ms step; the trees before and after, each in its own process: within
the machine's run-to-run noise). On a GPU the engine's device thread makes
the call while the training thread waits in `backward()`.

Writer thread: a step becomes table rows (`StepRows.rows`), goes to the
shards and journal (`ShardWriter`), tells the schedule, the event detector
and the bundle triggers what it held, and the manifest follows.

Any thread: `write_stop` writes the stop record at once (a failure, or
`close()` after one), never through the writer thread, which may be what
failed.
"""
from __future__ import annotations

import functools
import time

from .format import schema
from .event_thread import FLUSH_WAIT_S
from .events import EventDetector
from .manifest import failure_reason
from .status_slot import write_fallback
from .step_rows import step_events
from .writer import Publisher, ShardWriter

HOLD_BACK_STEPS = 32
# At most this long (and a quarter of `durable_interval_s`, the loss a node
# failure may cost: a killed job loses the held steps too). Each hand-over
# cost ~0.4 ms of the launch-bound proxy's training thread (the writer's
# wake-up and GIL hand-offs, whatever the steps it carries): at 0.25 s the
# benchmark's interleaved copies, a step each 0.1-0.2 s, paid it every two
# steps (2 points of the default's cost); a lone job at 8 ms a step hands
# over by the count.
HOLD_BACK_S = 1.0


class RunWriter:
    """`thread`: the `WriterThread`; `rows` (`StepRows`), `manifest`
    (`RunManifest`) and `shards` (a `ShardWriter` in `files`' rank
    directory, made here with the `WriterOptions` `writing`): what a step
    becomes;
    `schedule`, `bundles`, `events` (the `EventDispatcher`, with the
    `EventPolicy` `event_policy`, whose detector runs here; None without
    `on_event`), `sentinel` (`reexecute.StepSentinel`, or None): told
    each step's summary; `lost_updates()`: a report for the manifest, or
    None; `update_counts(step)`: the step's (moved, unchanged) updates of
    the low-precision parameters, or None (`LostUpdates.step_counts`; None:
    not asked, when no window is kept), added to its summary as
    `lost_updates` for the bundle triggers; `guard`: the recorder's
    `FailureGuard` (the step being written dates a failure on this thread)."""

    def __init__(self, *, thread, rows, files, manifest, schedule, bundles, guard, writing, world_size: int,
                 event_policy=None, events=None, sentinel=None, lost_updates=None, update_counts=None):
        self.thread = thread
        self.rows = rows
        up = files.uploader
        self.shards = ShardWriter(files.rank_dir, run_id=files.run_id, rank=files.rank, world_size=world_size,
                                  steps_per_shard=writing.steps_per_shard, first_index=files.first_shard,
                                  has_room=up.has_room if up else None,
                                  durable_interval_s=writing.durable_interval_s,
                                  publisher=Publisher(on_error=guard.fail))
        thread.when_idle(self.shards.sync_journal, self.shards.journal.idle_sync_s)
        self.manifest = manifest
        self.schedule = schedule
        self.bundles = bundles
        self.guard = guard
        self.flush_interval_s = writing.flush_interval_s
        self.event_detector = EventDetector.of(event_policy) if event_policy is not None else None
        self.events = events
        if events is not None:
            manifest.set_events(events.report())
        self.sentinel = sentinel
        self.lost_updates = lost_updates
        self.update_counts = update_counts
        self.dropped_steps = 0
        self._last_roll = time.monotonic()
        self._journaled_first_step = False  # the manifest rewritten after it (see write_step)
        self._held_back: list = []
        self._held_back_since = 0.0
        self._hold_back_s = min(HOLD_BACK_S, writing.durable_interval_s / 4)
        self._due = False  # the held steps are to go at the next backward pass's start

    # ------------------------------------------------------ training thread
    def submit(self, job) -> None:
        if self._held_back:
            self.release_held()
        if not self.thread.submit(job):
            # Never make the training wait for the disk: drop and count.
            self.dropped_steps += 1

    def submit_step(self, pending, clean: bool) -> None:
        sentinel = self.sentinel
        if sentinel is not None and sentinel.waits:
            # A step whose facts are device values waits a step for them
            # (`StepSentinel.hand_over`); never a clean one.
            for p in sentinel.hand_over(pending):
                self.queue_step(p, clean and p is pending)
            return
        self.queue_step(pending, clean)

    def queue_step(self, pending, clean: bool) -> None:
        """`pending` to the writer: a clean step with the held ones, any other at once."""
        if not clean:
            self.submit(functools.partial(self.write_step, pending))
            return
        held = self._held_back
        if not held:
            self._held_back_since = time.monotonic()
        held.append(pending)
        if self._due:
            self.release_held()  # due since the last step, and no backward pass began since
        elif len(held) >= HOLD_BACK_STEPS or time.monotonic() - self._held_back_since >= self._hold_back_s:
            self._due = True

    def on_backward_start(self) -> None:
        """A backward pass begins (training thread): the held steps go, if due."""
        if self._due:
            self.release_held()

    def release_held(self) -> None:
        self._due = False
        batch, self._held_back = self._held_back, []
        if batch and not self.thread.submit(functools.partial(self.write_steps, batch)):
            self.dropped_steps += len(batch)

    def _release_waiting(self, reexecute: bool = True) -> None:
        """The row of a step that waits for its device facts (`StepSentinel`),
        judged now: flush and close wait for its copy. Once recording is
        off (the guard), it goes as it was packed; at close (`reexecute`
        False: the recorder's hooks are gone) nothing is re-executed."""
        if self.sentinel is None or not self.sentinel.waits:
            return
        try:
            waiting = self.sentinel.release(judge=self.guard.enabled, reexecute=reexecute)
        except Exception as exc:  # noqa: BLE001 - recording off (the writer then skips its jobs), training on
            self.guard.fail(exc)
            return
        for p in waiting:
            self.queue_step(p, False)

    def flush(self) -> None:
        """`rec.flush()`: the held steps, then (with `on_event`) the callbacks
        of their events (at most `FLUSH_WAIT_S`: a hung callback never holds
        the training longer), then a shard and the manifest; blocks."""
        self._release_waiting()
        self.release_held()
        if self.events is not None:
            self.thread.barrier()
            self.events.wait_idle(FLUSH_WAIT_S)
        self.thread.barrier(functools.partial(self.write_files, "open"))

    def close(self) -> None:
        """`rec.close()`: the held steps, the last events' callbacks (their
        errors reach the final manifest), the final shard and manifest, and
        every rolled pair on disk (the writer skips its jobs once recording
        is off: a pair rolled before stays to be written)."""
        if self.thread.alive:
            self._release_waiting(reexecute=False)
            self.release_held()
        if self.events is not None:
            self.thread.barrier()
            self.events.close()
        self.thread.stop(functools.partial(self.write_files, "closed"))
        if self.shards.publisher is not None:
            self.shards.publisher.close()

    # -------------------------------------------------------- writer thread
    def write_steps(self, batch: list) -> None:
        for pending in batch:
            self.write_step(pending)

    def write_step(self, pending) -> None:
        self.guard.writing_step = pending.step
        step_row, columns, summary = self.rows.rows(pending)
        self.shards.add_step(step_row, columns)
        self.manifest.note_step(pending.step)
        events = step_events(summary)
        if events:
            self.schedule.note_event(pending.step, events)
        if self.event_detector is not None:
            for event in self.event_detector.observe(summary):
                self.events.post(event)
        if self.update_counts is not None:
            summary["lost_updates"] = self.update_counts(pending.step)
        self.bundles.on_step_summary(summary)
        if self.sentinel is not None and (summary.get("reexecution") is not None or self.sentinel.capped
                                          or self.sentinel.undecided):
            self.manifest.note_reexecution(summary.get("reexecution"), self.sentinel.gaps())
        graph_autocast = summary.get("graph_autocast")
        if graph_autocast is not None and not self.manifest.autocast_enabled():
            # The root's forward ran in a compiled graph: no eager hook
            # read autocast, the graph's trace did.
            self.manifest.set_autocast(graph_autocast)
            self._journaled_first_step = False  # on disk with this step
        rolled = self.shards.pending_steps == 0
        if not rolled and time.monotonic() - self._last_roll > self.flush_interval_s:
            self.shards.roll()
            rolled = True
        if rolled:
            self._last_roll = time.monotonic()
        if rolled or not self._journaled_first_step:
            # Also after the first step: what its forward taught the
            # manifest (autocast) is on disk for a job killed before its
            # first shard, whose steps are in the journal.
            self._journaled_first_step = True
            self.write_manifest()

    def write_files(self, status: str) -> None:
        """flush()/close(): the buffered steps as a shard, then the manifest."""
        self.shards.roll()
        self.shards.wait_published()
        self.manifest.set_recording(status=status)
        self.write_manifest()

    def write_manifest(self) -> None:
        self.manifest.set_recording(dropped_steps=self.dropped_steps, failure=self.guard.failure)
        if self.lost_updates is not None:
            self.manifest.set_lost_updates(self.lost_updates())
        self.note_events()
        self.manifest.set_spool_dropped(self.shards.dropped_steps)
        self.manifest.write()

    def note_events(self) -> None:
        if self.events is not None:
            self.manifest.set_events(self.events.report())


def write_stop(*, guard, files, manifest, events=None, dropped_steps: int = 0, status: str | None = None):
    """The stop record (`disabled_reason`, `disabled_at_step`), written
    from the calling thread: first in the reserved status slot, which a full
    disk still takes (else a fallback file), then in the manifest, best
    effort (the disk may be what failed). Returns the file that holds the
    record (None: none could be written). `files`: the `RankFiles` (None:
    the recorder failed before it had any)."""
    reason = failure_reason(guard.failure) if guard.failure is not None else None
    if files is not None and files.status is not None:
        where = files.status.record(status=status, disabled_reason=reason, disabled_at_step=guard.failed_at_step)
    elif files is not None and files.rank_dir is not None and reason is not None:
        # Failed before the slot was reserved (the disk was full already).
        where = write_fallback(files.rank_dir / schema.STATUS_FILE, {
            "format": schema.STATUS_FORMAT, "run_id": files.run_id, "rank": files.rank,
            "status": status or "open", "disabled_reason": reason, "disabled_at_step": guard.failed_at_step})
    else:
        where = None
    if manifest is not None:
        try:
            if events is not None:
                manifest.set_events(events.report())
            manifest.set_recording(status=status, dropped_steps=dropped_steps, failure=guard.failure,
                                   failed_at_step=guard.failed_at_step)
            manifest.write()
        except Exception:  # noqa: BLE001 - nothing more can be done without a disk
            pass
    return where
