"""AmpRecorder: the black-box recorder that rides along with a training job.

Lifecycle: construct (hooks registered, manifest written), `step()` once per
optimizer step, `flush()`, `close()` (idempotent); also a context manager. It
assembles its parts (docs/ARCHITECTURE.md lists them), each with its own state.
The training path only enqueues device work; decisions on values are made on
host values or on the writer thread."""
from __future__ import annotations

import contextlib
import functools
import os
import warnings

import torch

from .format import schema
from .bundles.capture import BundleCapture
from .bundles.policy import BundlePolicy
from .errors import OptionError  # noqa: F401 - importable from here, as before recorders.errors
from .event_thread import EventDispatcher
from .guard import FailureGuard
from .hooks import TrainingHooks
from .layout import fsdp1_sharded_params, is_compiled
from .lease import LeaseHeldError
from .loss_tap import MicroBatchLosses, loss_tap_for
from .manifest import RUN_INFO, RunManifest, bare_manifest, describe_job, distributed_rank_world
from .options import StorageOptions, WriterOptions, parts_from_flat, probe_targets, recorded_options
from .format.plain import plain
from .quiet_step import QuietStep
from .rank_files import RankFiles
from .reexecute import Reexecutor, Refusal, StepSentinel, reexecute_policy
from .run_writer import RunWriter, write_stop
from .schedule import RecordSchedule
from .stance import CompileStance
from .step_rows import StepRows
from .survey import name_filter, survey_model
from .unwrap import unwrap_optimizer, unwrap_scaler
from .writer_thread import WriterThread

MODE_ENV = "AMP_POSTMORTEM_MODE"


class AmpRecorder:
    """Record step facts every step and per-layer statistics of sampled and
    failing steps of a training job.

    >>> rec = AmpRecorder("runs/exp1", model, optimizer=opt, scaler=scaler)
    >>> ...   # training loop; after scaler.update() / optimizer.step():
    >>> rec.step(loss)
    >>> rec.close()

    Args:
        run_dir: the run directory (a resumed job may reuse it) or a URI (`s3://...`).
        model: the `nn.Module`, bare or wrapped (DDP, FSDP, `torch.compile`,
            checkpoint wrappers); names and class are the unwrapped model's.
        optimizer: its optimizer (wrappers unwrapped): learning rates, the
            skip flag (its pre-step hook), the weights a bundle holds.
        scaler: the `GradScaler`, or an object holding one in `_scaler`, `scaler` or `grad_scaler` (else refused).
        schedule: the `RecordSchedule` (default: the `mode`'s).
        bundles: the `BundlePolicy` (True: the default; False: none, no re-execution).
        storage: the `StorageOptions` of a URI run.
        writer: the `WriterOptions` (shards, journal, queue).
        on_event: a callable (or an `EventPolicy`) called on its own thread
            with an `Event` (`recorders.events`); it may ask for a stop
            (`should_stop`), a checkpoint or a bundle of the next step.
        include: glob patterns of module names to watch (`"*"`: all).
        exclude: glob patterns of module names not to watch.
        near_overflow: the magnitude counted as near overflow (65504).
        rank: this process's rank (default: torch.distributed's, else 0).
        world_size: the number of ranks (default: torch.distributed's, else 1).
        run_id: the run's id (default: `$AMP_POSTMORTEM_RUN_ID`, the run's, else new).
        capture_loss: capture every micro-batch's loss (`recorders.loss_tap`);
            the loss passed to `step()` wins unless one captured is NaN/Inf.
        eager_full_steps: a compiled model's full-tier steps run eagerly (`recorders.stance`).
        compiled_rows: a compiled model's cheap rows computed in its graph (`recorders.stance`).
        probe: the op probe: module name patterns or a `ProbeOptions`.
        reexecute: re-execute a failing step in the job: True, a `ReexecutePolicy` or False.
        mode: `"sentinel"` (default: step facts every step, module rows on sampled steps, the
            failing step re-executed) or `"every_step"` (every module's rows every step); None: `$AMP_POSTMORTEM_MODE`.
        flat: the flat keywords of earlier versions (`recorders.options.FLAT_OPTIONS`).
    """

    def __init__(self, run_dir, model: torch.nn.Module, optimizer=None, scaler=None, *,
                 schedule: RecordSchedule | None = None, bundles: bool | BundlePolicy = True,
                 storage: StorageOptions | None = None, writer: WriterOptions | None = None,
                 on_event=None, include=("*",), exclude=(), near_overflow: float = schema.FP16_MAX,
                 rank: int | None = None, world_size: int | None = None, run_id: str | None = None,
                 capture_loss: bool = True, eager_full_steps: bool = True, compiled_rows: bool = False,
                 probe=None, reexecute=True, mode: str | None = None, **flat):
        # A bad option raises here, in the caller's line, before anything is written.
        self.mode = mode if mode is not None else os.environ.get(MODE_ENV) or "sentinel"
        self.parts = parts_from_flat(flat, schedule=schedule, bundles=bundles, storage=storage, writer=writer,
                                     on_event=on_event, probe=probe, mode=self.mode)
        self.reexecute_policy = reexecute_policy(reexecute)
        # The torch optimizer that really steps (AcceleratedOptimizer has the
        # pre-step hook without its state), a real GradScaler (or None).
        self.model, self.optimizer = model, unwrap_optimizer(optimizer)
        self.scaler, refused = unwrap_scaler(scaler)
        if refused:
            warnings.warn(f"amp-postmortem: {refused}", RuntimeWarning, stacklevel=2)
        self.matches, self.run_location, self.capture_loss = name_filter(include, exclude), str(run_dir), capture_loss
        self._closed, self._step_counter, self._should_stop, self.checkpoint_requested = False, 0, False, False
        self.guard = FailureGuard(current_step=lambda: self._step_counter, on_failure=self._write_stop)
        self.stance = CompileStance(eager_full_steps=eager_full_steps, compiled_rows=compiled_rows,
                                    compiled=is_compiled(model), guard=self.guard)
        self.rank, self.world_size, self.run_id = int(rank or 0), int(world_size or 1), run_id
        self.files = self.manifest = self.hooks = self.writer = self.run_writer = self.bundles = None
        self.shards = self.events = self.sentinel = self.loss_tap = self.quiet = None
        self.losses = MicroBatchLosses()
        try:
            self._build(run_dir, rank=rank, world_size=world_size, near_overflow=near_overflow)
        except LeaseHeldError as exc:  # another live recorder's: touch none of its files
            self.guard.refuse(f"not recording: {exc}; one recorder per run directory and rank (pass another "
                              f"run directory for this job). Training continues unrecorded.")
            self._unhook()
        except Exception as exc:  # noqa: BLE001 - the training goes on: no hooks, no thread, one warning
            if self.manifest is None and self.run_dir is not None:
                # A bare manifest: the run directory still says why nothing was recorded.
                self.manifest = bare_manifest(self.run_dir, self.rank, self.world_size, self.run_id)
            self.guard.fail(exc)
            self._unhook()

    def _build(self, run_dir, *, rank, world_size, near_overflow):
        parts, model, optimizer, scaler = self.parts, self.model, self.optimizer, self.scaler
        if rank is None or world_size is None:
            dist_rank, dist_world = distributed_rank_world()
            self.rank = int(dist_rank if rank is None else rank)
            self.world_size = int(dist_world if world_size is None else world_size)
        self.files = RankFiles(run_dir, self.rank, storage=parts.storage, run_id=self.run_id)
        self.files.open()
        self.run_id, self.guard.status_path = self.files.run_id, self.files.status.path
        survey = survey_model(model, self.matches)
        bundles_enabled = parts.bundles_enabled
        window_off = parts.bundle_policy.window_refusal(sharded=bool(survey.sharded or survey.flat_views),
                                                        enabled=bundles_enabled)
        self.schedule = parts.schedule
        for s in (parts.bundle_policy.steps if bundles_enabled else ()):
            self.schedule.request(s)  # a bundle asked for up front: its step in full
        probed, probe_leaves = probe_targets(parts.probe, survey.modules, survey.watched)
        options = recorded_options(parts, matches=self.matches, near_overflow=near_overflow, stance=self.stance,
                                   mode=self.mode, probed=probed)
        job = describe_job(run_id=self.run_id, rank=self.rank, world_size=self.world_size, model=model,
                           survey=survey, optimizer=optimizer, scaler=scaler, recorder_options=options)
        self.writer = WriterThread(max_queue=parts.writer.max_queue, is_failed=lambda: self.guard.failure is not None,
                                   on_error=self.guard.fail)
        self.guard.writer_thread = self.writer.thread
        self.bundles = BundleCapture(model, optimizer, scaler, policy=parts.bundle_policy, enabled=bundles_enabled,
                                     run_dir=self.run_dir, run_info={k: job[k] for k in RUN_INFO},
                                     post=self.writer.submit,
                                     on_change=lambda saved, missed: self.manifest.save_bundles(saved, missed),
                                     window=window_off is None)
        job["recorder"]["bundles"] = dict(plain(self.bundles.config, keep_nonfinite=True),
                                          **({"window_disabled": window_off} if window_off else {}))
        # Re-execution replays held steps: without bundles nothing is held.
        policy = self.reexecute_policy if bundles_enabled else None
        refuse = Refusal.DISTRIBUTED if survey.distributed or self.world_size > 1 else None
        job["recorder"]["reexecute"] = policy.config(refused=refuse) if policy is not None else None
        self.manifest = RunManifest(self.run_dir, self.rank, job)
        self.events = EventDispatcher(parts.events) if parts.events is not None else None
        self.rows = StepRows(rank=self.rank, optimizer=optimizer, scaler=scaler)
        self.hooks = TrainingHooks(
            model, optimizer=optimizer, scaler=scaler, watched=survey.watched, modules=dict(survey.modules),
            params=survey.params, sharded=survey.sharded, late_grads=fsdp1_sharded_params(model, sharded_only=False),
            flat_views=survey.flat_views, compiled_rows=self.stance.compiled_rows, watch_param=self.matches,
            near_overflow=float(near_overflow), guard=self.guard.wrap, guard_call=self.guard.wrap_call,
            bundles=self.bundles, probe=parts.probe, probed=probed, probe_leaves=probe_leaves,
            on_probe_error=self.guard.fail, on_backward_start=lambda: self.run_writer.on_backward_start(),
            on_autocast=lambda info: self.run_writer.submit(functools.partial(self.manifest.set_autocast, info)),
            sampled_hooks=self.schedule.cheap_every > 1 and not self.stance.compiled)
        if policy is not None:
            self.sentinel = StepSentinel(policy, Reexecutor(model, self.hooks, self.bundles, refuse=refuse,
                                                            eager_when_compiled=self.stance.eager_full_steps),
                                         scaler=scaler, optimizer=optimizer, losses=self.losses, rows=self.rows,
                                         scale_floor=parts.bundle_policy.min_loss_scale)
        if self.stance.compiled:
            self.manifest.set_compiled(self.stance.info())
        self.hooks.begin_step(0, self.schedule.tier(0))
        self.run_writer = RunWriter(
            thread=self.writer, rows=self.rows, files=self.files, manifest=self.manifest, schedule=self.schedule,
            bundles=self.bundles, guard=self.guard, writing=parts.writer, world_size=self.world_size,
            event_policy=parts.events, events=self.events, sentinel=self.sentinel,
            lost_updates=self.hooks.updates.report,
            # A step that lost most of its updates freezes a window (bundles.triggers).
            update_counts=self.hooks.updates.watch_steps() if self.bundles.window is not None else None)
        self.shards = self.run_writer.shards
        self.quiet = QuietStep.of(self)  # the usual step's end in one pass (None: a scaler's job)
        if self.files.uploader is not None:
            self.manifest.set_storage(self.run_location)
        self.manifest.write()
        self.writer.start()
        if self.capture_loss:  # before the hooks: the root's forward hook carries the no-scaler job's tap
            self.loss_tap = loss_tap_for(self.hooks.sentinel, scaler, self.losses, lambda: self.guard.enabled and not self.hooks.paused)
        self.hooks.register()
        self.stance.register_hooks(model)
        self.stance.enter_tier(self.schedule.tier(0))

    def _unhook(self) -> None:
        self.stance.remove()
        if self.hooks is not None:
            self.hooks.remove()
        if self.loss_tap is not None:
            self.loss_tap.remove()
            self.loss_tap = None

    def _write_stop(self, status: str | None = None):
        return write_stop(guard=self.guard, files=self.files, manifest=self.manifest, events=self.events,
                          status=status, dropped_steps=self.run_writer.dropped_steps if self.run_writer else 0)

    @property
    def enabled(self) -> bool:
        """Recording is on (an internal error turns it off for good)."""
        return self.guard.enabled

    @property
    def failure(self) -> BaseException | None:
        """The internal error that turned recording off (None: none)."""
        return self.guard.failure

    @property
    def run_dir(self):
        """The local directory written (a URI run's spool), once opened."""
        return self.files.run_dir if self.files is not None else None

    @property
    def upload_report(self):
        """`storage.UploadReport` after `close()` of a URI run."""
        return self.files.upload_report if self.files is not None else None

    @property
    def should_stop(self) -> bool:
        """An `on_event` callback asked for a stop: the loop reads this and
        ends (the Trainer and Lightning callbacks with `stop_on_event=True`)."""
        return self._should_stop

    def step(self, loss=None, step: int | None = None) -> None:
        """Close the current optimizer step. Call once per optimizer step,
        after `scaler.update()` (or `optimizer.step()` without a scaler)."""
        if self._closed:
            return
        if not self.guard.enabled:
            self._unhook()
        else:
            try:
                step_id = self._step_counter if step is None else int(step)
                if self.quiet is not None and self.quiet.close(loss, step_id):  # the usual step: no frame more
                    self._step_counter = step_id + 1
                else:
                    self._step(loss, step_id)
            except Exception as exc:  # noqa: BLE001
                self.guard.fail(exc)
                self._unhook()
        if self.events is not None and self.events.requests.pending:  # what on_event callbacks asked for
            stop, checkpoint, bundle = self.events.requests.take()
            self._should_stop |= stop
            self.checkpoint_requested |= checkpoint
            if bundle:
                self.save_bundle()

    def _step(self, loss, step_id: int):
        loss, dtype = self.losses.close_step(loss)
        loss_t = (loss.detach() if loss.requires_grad else loss) if isinstance(loss, torch.Tensor) else None
        stance = self.stance
        stance.leave_tier()
        finished = self.hooks.end_step(loss_t)
        if finished.record and stance.found_compiled(finished):
            self.hooks.keep_attached()
            self.run_writer.submit(functools.partial(self.manifest.set_compiled, stance.info()))
        reexecution, clean = self.sentinel.close_step(finished, loss_t, scale_before=self.rows.scale_before,
                                                      compiled=stance.compiled) if self.sentinel else (None, False)
        pending = self.rows.pack(finished, step_id, loss, loss_t, loss_dtype=dtype, graph_slots=self.hooks.graph,
                                 reexecution=reexecution)
        self.bundles.on_step_end(step_id, loss=loss_t if loss_t is not None else loss, stepped=pending.stepped,
                                 clean=clean)
        self.run_writer.submit_step(pending, clean)
        self._step_counter = step_id + 1
        tier = self.schedule.tier(step_id + 1)
        self.hooks.begin_step(step_id + 1, tier)
        if stance.compiled:  # else no compiler stance to set (`CompileStance`)
            stance.enter_tier(tier)

    def add_loss(self, loss) -> None:
        """Add one micro-batch's loss as backpropagated (a framework hook's): summed at `step()`."""
        if self.guard.enabled and not self._closed and not self.hooks.paused:
            self.losses.add(loss)

    def save_bundle(self) -> None:
        """Ask for a replay bundle of the current step (recorded at the full
        tier too when its forward has not begun)."""
        if self.guard.enabled:
            try:
                self.bundles.request()
                self.hooks.raise_to_full()
            except Exception as exc:  # noqa: BLE001
                self.guard.fail(exc)

    def request_full(self) -> None:
        """Record the current step at the full tier, or the next one when the
        current step's forward has begun; whatever the schedule."""
        if self.guard.enabled and not self.hooks.raise_to_full():
            current = self.hooks.state.step_id
            self.schedule.request(current + 1, current=current)

    def paused(self):
        """A context manager: passes inside are not recorded (an eval pass with gradients enabled, say)."""
        return self.hooks.pausing(self) if self.hooks is not None else contextlib.nullcontext(self)

    def flush(self) -> None:
        """Block until every step so far is written to disk (and the
        `on_event` callbacks of its events returned, at most
        `event_thread.FLUSH_WAIT_S`)."""
        if self._closed or self.run_writer is None or not self.writer.alive:
            return
        self.run_writer.flush()
        if self.guard.enabled:
            try:
                self.bundles.apply_decisions()
                self.writer.barrier()
            except Exception as exc:  # noqa: BLE001 - flush() must not stop the training
                self.guard.fail(exc)
        self.files.notify_uploads()

    def close(self) -> None:
        """Flush, write the final manifest and remove every hook. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._unhook()
        if self.run_writer is not None:
            self.run_writer.close()
        elif self.writer is not None:
            self.writer.stop()
        if self.guard.failure is not None:
            # The writer skips its jobs once recording is off: the final
            # manifest, with the reason, goes to disk from here.
            self._write_stop(status="closed")
        elif self.files is not None and self.files.status is not None:
            self.files.status.record(status="closed")
        with contextlib.suppress(Exception):  # the bundles' last writes never fail close()
            if self.bundles is not None:
                self.bundles.close(write_decided=self.guard.failure is None and not self.writer.alive)
        if self.files is not None:
            self.files.close(spool_full_steps=self.shards.dropped_steps if self.shards is not None else 0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
