"""AmpRecorder: the black-box recorder that rides along with a training job.

Lifecycle: construct (hooks registered, manifest written), `step()` once per
optimizer step, `flush()` (blocks until everything so far is on disk),
`close()` (idempotent; flushes and removes every hook). Also a context manager.

`AmpRecorder` assembles its parts and wires them; each keeps its own state:
`files` (`RankFiles`: the rank directory, lease, run id, status slot),
`guard` (`FailureGuard`: an internal error turns recording off),
`schedule` (`RecordSchedule`: which step is sampled at which tier), `hooks`
(`TrainingHooks`: the root's hooks on every step, the collectors' on
sampled ones), `sentinel` (`StepSentinel`: a failing step not sampled,
re-executed in full), `bundles` (`BundleCapture`: what a replay needs),
`stance` (`CompileStance`: a compiled model's eager steps), `rows`
(`StepRows`), `manifest` (`RunManifest`), `shards` (`ShardWriter`) and
`run_writer` (`RunWriter`: the writer thread's side, on `writer`, the
`WriterThread`), `losses` and `loss_tap` (every micro-batch's loss), and
with `on_event=` `events` (`EventDispatcher`). The training path only
enqueues device work; every decision taken on values is made on host
values or on the writer thread, one step (or more) late.
"""
from __future__ import annotations

import functools
import os
import warnings
from contextlib import contextmanager

import torch

from . import schema
from .bundles.capture import BundleCapture
from .bundles.policy import BundlePolicy
from .errors import OptionError  # noqa: F401 - importable from here, as before recorders.errors
from .event_thread import FLUSH_WAIT_S, EventDispatcher
from .events import EventDetector
from .guard import FailureGuard
from .hooks import TrainingHooks
from .layout import fsdp1_shapes, fsdp1_sharded_params, is_compiled, user_class
from .lease import LeaseHeldError
from .loss_tap import MicroBatchLosses, OutputLossTap, ScaleTap, loss_dtype, step_loss
from .manifest import RunManifest, bare_manifest, describe_job, distributed_rank_world
from .options import StorageOptions, WriterOptions, parts_from_flat, probe_targets
from .plain import plain
from .rank_files import RankFiles
from .reexecute import Reexecutor, Refusal, StepSentinel, reexecute_policy
from .run_writer import RunWriter, write_stop
from .schedule import RecordSchedule
from .stance import CompileStance
from .step_rows import StepRows
from .survey import name_filter, survey_model
from .unwrap import unwrap_optimizer, unwrap_scaler
from .writer import Publisher, ShardWriter
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
        run_dir: the run directory (created; a resumed job may reuse it), or
            a URI of any filesystem pyarrow or fsspec opens (`s3://...`):
            its files are then spooled locally and uploaded off the
            training path.
        model: the model to watch: an `nn.Module`, bare or wrapped (DDP,
            FSDP, `torch.compile`, checkpoint wrappers, as Accelerate
            prepared it; names and class are the unwrapped model's).
        optimizer: its optimizer (Accelerate's and Lightning's wrappers
            unwrapped): the learning rates, the skip flag (its pre-step
            hook) and the weights a bundle or a re-execution holds.
        scaler: the `torch.amp.GradScaler`, if any, or an object holding one
            in `_scaler`, `scaler` or `grad_scaler` (timm's `NativeScaler`,
            an `Accelerator`, Lightning's precision plugin); any other
            object is refused with a RuntimeWarning (recorded as no scaler).
        schedule: the `RecordSchedule`: which step is sampled at which tier
            (default: the `mode`'s).
        bundles: the `BundlePolicy`: which replay bundles are held and
            saved (True: `BundlePolicy()`; False: nothing is held, and no
            step can be re-executed).
        storage: the `StorageOptions` of a URI run (its spool, its uploads).
        writer: the `WriterOptions` (shard size, how often shards are
            written and the journal fsynced, the writer thread's queue).
        on_event: a callable, called on a thread of its own with an `Event`
            (`recorders.events`) at the first non-finite value, a skip streak
            and the onset of a scale collapse; or an `EventPolicy`. It may
            ask for a stop (`rec.should_stop`), a checkpoint
            (`rec.checkpoint_requested`) or a bundle of the next step.
        include: glob patterns of module names to watch (`"*"`: all).
        exclude: glob patterns of module names not to watch.
        near_overflow: the magnitude counted as near overflow (default
            float16's largest finite value).
        rank: this process's rank (default: torch.distributed's, else 0).
        world_size: the number of ranks (default: torch.distributed's, else 1).
        run_id: the run's id (default: `$AMP_POSTMORTEM_RUN_ID`,
            `$TORCHELASTIC_RUN_ID`, the id of a run already in `run_dir`,
            else a new one; rank 0's under a process group).
        capture_loss: capture every micro-batch's loss where the loop scales
            it or the model returns it (`recorders.loss_tap`); a loss passed
            to `step()` wins unless a captured one is NaN/Inf. False: only
            the loss passed.
        eager_full_steps: with a compiled model, run full-tier steps eagerly
            (`recorders.stance.CompileStance`). False: every step stays
            compiled.
        compiled_rows: with a compiled model, compute the cheap tier's rows
            inside the compiled graph (`collectors.graph_stats`; off by
            default: see `recorders.stance`).
        probe: the op probe (off by default): glob patterns of module names
            or a `ProbeOptions` (`recorders.options`): each op's largest
            finite magnitude and NaN/Inf counts inside the probed modules.
        reexecute: re-execute a failing step not sampled, in full, inside
            the job: True (`ReexecutePolicy()`), a `ReexecutePolicy`
            (`recorders.reexecute`, which says what is held and when it is
            refused) or False. The training's numbers are untouched.
        mode: `"sentinel"` (the default): step facts every step, per-module
            rows on sampled steps only (`RecordSchedule()`), no hook on any
            module but the root on the other steps, the failing step
            re-executed; `"every_step"`: every module's rows on every step
            (`RecordSchedule.every_step()`, 3x a launch-bound step). None
            reads `$AMP_POSTMORTEM_MODE`, else "sentinel".
        flat: the flat keywords of earlier versions (`full_every=`,
            `max_bundles=`, `spool_dir=`, ...), each one field of a part
            (`recorders.options.FLAT_OPTIONS`, where each is documented);
            any other keyword is a TypeError.
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
        self.model = model
        # AcceleratedOptimizer inherits register_step_pre_hook without the
        # state it writes to: hook the torch optimizer that really steps.
        self.optimizer = unwrap_optimizer(optimizer)
        scaler, refused = unwrap_scaler(scaler)
        if refused:
            warnings.warn(f"amp-postmortem: {refused}", RuntimeWarning, stacklevel=2)
        self.scaler = scaler
        self.matches = name_filter(include, exclude)
        self.run_location = str(run_dir)
        self.capture_loss = bool(capture_loss)
        self._closed = False
        self._step_counter = 0
        self._should_stop = False
        self.checkpoint_requested = False
        self.guard = FailureGuard(current_step=lambda: self._step_counter, on_failure=self._write_stop)
        self.stance = CompileStance(eager_full_steps=eager_full_steps, compiled_rows=compiled_rows,
                                    guard=self.guard)
        self.rank, self.world_size, self.run_id = int(rank or 0), int(world_size or 1), run_id
        self.files = self.manifest = self.hooks = self.writer = self.run_writer = self.bundles = None
        self.shards = self.events = self.sentinel = self.loss_tap = None
        self.losses = MicroBatchLosses()
        try:
            self._build(run_dir, rank=rank, world_size=world_size, near_overflow=near_overflow)
        except LeaseHeldError as exc:
            # Another live recorder writes this rank directory: touch none
            # of its files (manifest included), record nothing.
            self.guard.refuse(f"not recording: {exc}; one recorder per run directory and rank (pass another "
                              f"run directory for this job). Training continues unrecorded.")
            self._unhook()
        except Exception as exc:  # noqa: BLE001 - the training must go on
            # Whatever broke (an unwritable run directory, a model the
            # recorder does not understand): no hooks, no thread, one
            # warning; step() and close() are no-ops.
            if self.manifest is None and self.run_dir is not None:
                # Failed before the manifest was built: a bare one, so that
                # the run directory still says why nothing was recorded.
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
        self.run_id = self.files.run_id
        self.guard.status_path = self.files.status.path
        survey = survey_model(model, self.matches)
        bundles_enabled = parts.bundles_enabled
        window_off = None
        if (survey.sharded or survey.flat_views) and bundles_enabled and parts.bundle_policy.window_steps > 0:
            # Each rank starts its window when its own writer has decided
            # the steps before: the ranks' windows would start at different
            # steps, whose shards no reader could put together.
            window_off = "sharded parameters (the ranks' windows would not start at one step)"
        self.schedule = parts.schedule
        for s in (parts.bundle_policy.steps if bundles_enabled else ()):
            self.schedule.request(s)  # a bundle asked for up front: its step in full
        probed, probe_leaves = probe_targets(parts.probe, survey.modules, survey.watched)
        writing = parts.writer
        options = {"include": list(self.matches.include), "exclude": list(self.matches.exclude),
                   **self.schedule.config(), "steps_per_shard": writing.steps_per_shard,
                   "near_overflow": float(near_overflow), "eager_full_steps": self.stance.eager_full_steps,
                   "compiled_rows": self.stance.compiled_rows, "flush_interval_s": writing.flush_interval_s,
                   "durable_interval_s": writing.durable_interval_s, "mode": self.mode}
        if parts.probe is not None:
            options["probe"] = {**parts.probe.config(), "probed": probed}
        job = describe_job(run_id=self.run_id, rank=self.rank, world_size=self.world_size, model=model,
                           module_names=survey.module_names, watched=survey.watched, params=survey.params,
                           optimizer=optimizer, scaler=scaler, recorder_options=options,
                           flat_views=survey.flat_views, model_class=user_class(model), sharded=survey.sharded,
                           shapes=fsdp1_shapes(model))
        self.writer = WriterThread(max_queue=writing.max_queue, is_failed=lambda: self.guard.failure is not None,
                                   on_error=self.guard.fail)
        self.guard.writer_thread = self.writer.thread
        run_info = {k: job[k] for k in ("run_id", "rank", "world_size", "package_version",
                                        "device_type", "device_name", "scaler")}
        self.bundles = BundleCapture(model, optimizer, scaler, policy=parts.bundle_policy, enabled=bundles_enabled,
                                     run_dir=self.run_dir, run_info=run_info, post=self.writer.submit,
                                     on_change=lambda saved, missed: self.manifest.save_bundles(saved, missed),
                                     window=window_off is None)
        job["recorder"]["bundles"] = plain(self.bundles.config, keep_nonfinite=True)
        if window_off:
            job["recorder"]["bundles"]["window_disabled"] = window_off
        # Re-execution replays held steps: without bundles nothing is held.
        reexecuting = self.reexecute_policy is not None and bundles_enabled
        refuse = Refusal.DISTRIBUTED if survey.distributed or self.world_size > 1 else None
        job["recorder"]["reexecute"] = (dict(self.reexecute_policy.config(), refused=refuse and refuse.value)
                                        if reexecuting else None)
        self.manifest = RunManifest(self.run_dir, self.rank, job)
        if parts.events is not None:
            self.events = EventDispatcher(parts.events)
            self.manifest.set_events(self.events.report())
        self.rows = StepRows(rank=self.rank, optimizer=optimizer, scaler=scaler)
        self.hooks = TrainingHooks(
            model, optimizer=optimizer, scaler=scaler, watched=survey.watched, modules=dict(survey.modules),
            params=survey.params, sharded=survey.sharded, late_grads=fsdp1_sharded_params(model, sharded_only=False),
            flat_views=survey.flat_views, compiled_rows=self.stance.compiled_rows, watch_param=self.matches,
            near_overflow=float(near_overflow), guard=self.guard.wrap, guard_call=self.guard.wrap_call,
            bundles=self.bundles, probe=parts.probe, probed=probed, probe_leaves=probe_leaves,
            on_probe_error=self.guard.fail,
            on_autocast=lambda info: self.run_writer.submit(functools.partial(self.manifest.set_autocast, info)),
            sampled_hooks=self.schedule.cheap_every > 1 and not is_compiled(model))
        if reexecuting:
            self.sentinel = StepSentinel(self.reexecute_policy,
                                         Reexecutor(model, self.hooks, self.bundles, refuse=refuse),
                                         has_scaler=scaler is not None and optimizer is not None, losses=self.losses)
        self.stance.compiled = is_compiled(model)
        if self.stance.compiled:
            self.manifest.set_compiled(self.stance.info())
        self.hooks.begin_step(0, self.schedule.tier(0))
        up = self.files.uploader
        self.shards = ShardWriter(self.files.rank_dir, run_id=self.run_id, rank=self.rank,
                                  world_size=self.world_size, steps_per_shard=writing.steps_per_shard,
                                  first_index=self.files.first_shard, has_room=up.has_room if up else None,
                                  durable_interval_s=writing.durable_interval_s,
                                  publisher=Publisher(on_error=self.guard.fail))
        self.run_writer = RunWriter(
            thread=self.writer, rows=self.rows, shards=self.shards, manifest=self.manifest, schedule=self.schedule,
            bundles=self.bundles, guard=self.guard, flush_interval_s=writing.flush_interval_s,
            event_detector=EventDetector.of(parts.events) if parts.events is not None else None,
            events=self.events, sentinel=self.sentinel,
            lost_updates=self.hooks.updates.report if getattr(self.hooks, "updates", None) is not None else None)
        self.writer.when_idle(self.shards.sync_journal, self.shards.journal.idle_sync_s)
        if up is not None:
            self.manifest.set_storage(self.run_location)
        self.manifest.write()
        self.writer.start()
        self.hooks.register()
        self.stance.register_hooks(model)
        if self.capture_loss:
            self.loss_tap = self._loss_tap(scaler)
        self.stance.enter_tier(self.schedule.tier(0))

    def _loss_tap(self, scaler):
        # Any scaler object, enabled or not, sees the loss as backpropagated
        # (nanoGPT scales through a disabled one under bf16); without one,
        # the model may return its loss (Hugging Face models with labels=).
        active = lambda: self.guard.enabled and not self.hooks.paused  # noqa: E731
        if scaler is not None and callable(getattr(scaler, "scale", None)):
            return ScaleTap(scaler, self.losses, active)
        return OutputLossTap(self.model, self.losses, lambda: active() and torch.is_grad_enabled())

    def _unhook(self) -> None:
        self.stance.remove()
        if self.hooks is not None:
            self.hooks.remove()
        if self.loss_tap is not None:
            self.loss_tap.remove()
            self.loss_tap = None

    def _write_stop(self, status: str | None = None):
        files = self.files
        return write_stop(guard=self.guard, status_slot=files and files.status,
                          rank_dir=files and files.rank_dir, run_id=self.run_id, rank=self.rank,
                          manifest=self.manifest, events=self.events, status=status,
                          dropped_steps=self.run_writer.dropped_steps if self.run_writer is not None else 0)

    # ------------------------------------------------------------ the state
    @property
    def enabled(self) -> bool:
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
        """True once an `on_event` callback asked for a stop
        (`event.request_stop()`), from the `step()` after it on. The
        recorder stops nothing itself: the loop reads this and ends (the
        Trainer and Lightning callbacks do so with `stop_on_event=True`)."""
        return self._should_stop

    # --------------------------------------------------------------- public
    def step(self, loss=None, step: int | None = None) -> None:
        """Close the current optimizer step. Call once per optimizer step,
        after `scaler.update()` (or `optimizer.step()` without a scaler)."""
        if self._closed:
            return
        if not self.guard.enabled:
            self._unhook()
        else:
            try:
                self._step(loss, step)
            except Exception as exc:  # noqa: BLE001
                self.guard.fail(exc)
                self._unhook()
        if self.events is not None and self.events.requests.pending:
            # What on_event callbacks asked for since the last step: a
            # bundle of the step now beginning (full tier too).
            stop, checkpoint, bundle = self.events.requests.take()
            self._should_stop |= stop
            self.checkpoint_requested |= checkpoint
            if bundle:
                self.save_bundle()

    def _step(self, loss, step):
        step_id = self._step_counter if step is None else int(step)
        taken = self.losses.take()
        dtype = loss_dtype(taken, loss)
        loss = step_loss(taken, loss)
        loss_t = loss.detach() if isinstance(loss, torch.Tensor) else None
        self.stance.leave_tier()
        finished = self.hooks.end_step(loss_t)
        if not self.stance.compiled and finished.record and (
                finished.graph_values is not None or (finished.micro_batches == 0 and finished.param_grads)):
            # A traced hook wrote the in-graph statistics, or gradients
            # arrived but no forward hook ran: the model ran as a compiled
            # graph (compiled after the recorder was attached).
            self.stance.compiled = True
            self.hooks.keep_attached()
            self.run_writer.submit(functools.partial(self.manifest.set_compiled, self.stance.info()))
        reexecution, clean = None, False
        if self.sentinel is not None:
            scale = self.rows.scale_before if isinstance(self.rows.scale_before, torch.Tensor) else None
            reexecution, clean = self.sentinel.close_step(finished, loss_t, scale=scale,
                                                          compiled=self.stance.compiled)
        if clean and self.scaler is not None:
            # A scale below the bundles' floor is a trigger of its own: not clean.
            scale, floor = getattr(self.scaler, "_scale", None), self.parts.bundle_policy.min_loss_scale
            clean = floor is None or (isinstance(scale, torch.Tensor) and scale.device.type == "cpu"
                                      and float(scale) >= floor)
        pending = self.rows.pack(finished, step_id, loss, loss_t, loss_dtype=dtype, graph_slots=self.hooks.graph,
                                 reexecution=reexecution)
        self.bundles.on_step_end(step_id, loss=loss_t if loss_t is not None else loss, stepped=pending.stepped,
                                 clean=clean)
        self.run_writer.submit_step(pending, clean)
        self._step_counter = step_id + 1
        tier = self.schedule.tier(step_id + 1)
        self.hooks.begin_step(step_id + 1, tier)
        self.stance.enter_tier(tier)

    def add_loss(self, loss) -> None:
        """Add one micro-batch's loss as backpropagated (for a framework
        hook that is handed it); summed into the step's loss at `step()`."""
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

    @contextmanager
    def paused(self):
        """Forward/backward passes inside are not recorded (e.g. an eval pass
        with gradients enabled)."""
        hooks = self.hooks
        if hooks is None:
            yield self
            return
        hooks.paused += 1
        try:
            yield self
        finally:
            hooks.paused -= 1

    def flush(self) -> None:
        """Block until every step so far is written to disk (and the
        `on_event` callbacks of its events returned, at most
        `event_thread.FLUSH_WAIT_S`: a hung callback never holds the
        training longer)."""
        if self._closed or self.writer is None or not self.writer.alive:
            return
        self.run_writer.release_held()
        if self.events is not None:
            self.writer.barrier()
            self.events.wait_idle(FLUSH_WAIT_S)
        self.writer.barrier(functools.partial(self.run_writer.write_files, "open"))
        if self.guard.enabled:
            try:
                self.bundles.apply_decisions()
                self.writer.barrier()
            except Exception as exc:  # noqa: BLE001 - flush() must not stop the training
                self.guard.fail(exc)
        if self.files.uploader is not None:
            self.files.uploader.notify()

    def close(self) -> None:
        """Flush, write the final manifest and remove every hook. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._unhook()
        if self.writer is not None and self.writer.alive:
            self.run_writer.release_held()
        if self.events is not None:
            # The last steps' events reach the callback, and its errors the
            # final manifest.
            if self.writer is not None:
                self.writer.barrier()
            self.events.close()
        if self.writer is not None:
            self.writer.stop(functools.partial(self.run_writer.write_files, "closed"))
        if self.shards is not None and self.shards.publisher is not None:
            # Every rolled pair on disk (the writer skips its jobs once
            # recording is off: a pair rolled before stays to be written).
            self.shards.publisher.close()
        if self.guard.failure is not None:
            # The writer skips its jobs once recording is off: the final
            # manifest, with the reason, goes to disk from here.
            self._write_stop(status="closed")
        elif self.files is not None and self.files.status is not None:
            self.files.status.record(status="closed")
        try:
            if self.bundles is not None:
                self.bundles.close(write_decided=self.guard.failure is None and not self.writer.alive)
        except Exception:
            pass
        if self.files is not None:
            self.files.close(spool_full_steps=self.shards.dropped_steps if self.shards is not None else 0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
