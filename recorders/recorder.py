"""AmpRecorder: the black-box recorder that rides along with a training job.

Lifecycle: construct (hooks registered, manifest written), `step()` once per
optimizer step, `flush()` (blocks until everything so far is on disk),
`close()` (idempotent; flushes and removes every hook). Also a context manager.

`AmpRecorder` owns its parts and wires them; each keeps its own state:

- `schedule` (`RecordSchedule`): which step is recorded at which tier;
- `hooks` (`TrainingHooks`): the hooks and the state of the step in progress;
- `rows` (`StepRows`): a finished step packed into one asynchronous copy,
  and, on the writer thread, turned into table rows;
- `manifest` (`RunManifest`): the run's manifest;
- `shards` (`ShardWriter`): the Parquet shards;
- `writer` (`WriterThread`): the background thread that does all the above
  writing, in order;
- `bundles` (`BundleCapture`): replay bundles;
- `losses` (`MicroBatchLosses`) and `loss_tap` (`ScaleTap` or
  `OutputLossTap`): every micro-batch's loss.

The training path only enqueues device work; conversion, Parquet and every
decision taken on values happen on the writer thread, one step (or more)
late.
"""
from __future__ import annotations

import fnmatch
import functools
import os
import threading
import time
import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from . import schema
from .bundles.capture import BundleCapture
from .bundles.triggers import TRIGGERS
from .hooks import TrainingHooks
from .loss_tap import MicroBatchLosses, OutputLossTap, ScaleTap, step_loss
from .manifest import RunManifest, describe_job, distributed_rank_world, existing_run_id
from .plain import plain
from .schedule import RecordSchedule
from .step_rows import StepRows, step_events
from .unwrap import unwrap_optimizer
from .writer import ShardWriter
from .writer_thread import WriterThread


class AmpRecorder:
    """Record per-step scalars and per-layer statistics of a training job.

    >>> rec = AmpRecorder("runs/exp1", model, optimizer=opt, scaler=scaler)
    >>> ...   # training loop; after scaler.update() / optimizer.step():
    >>> rec.step(loss)
    >>> rec.close()

    Args:
        run_dir: the run directory (created; a resumed job may reuse it).
        model: the model to watch (an `nn.Module`, DDP-wrapped or not, or
            as Accelerate prepared it).
        optimizer: its optimizer; gives the learning rates, the global
            gradient norm (pre-step hook) and the weights a bundle holds.
            Accelerate's and Lightning's wrappers are unwrapped.
        scaler: the `torch.amp.GradScaler`, if any; gives the loss scale
            and the `skipped` flag.
        include: glob patterns of module names to watch (`"*"`: all).
        exclude: glob patterns of module names not to watch.
        cheap_every: record the cheap statistics every N steps.
        full_every: record the full statistics every N steps (0: only
            after events).
        full_after_event: record the full statistics for a burst of N
            steps after the first event of each kind (a skipped step, a
            NaN/Inf in the forward pass, in the gradients of a step that
            was not skipped, in the loss); later events of a kind seen
            before leave the schedule at `full_every`. Steps in
            `bundle_steps`, a step whose bundle `save_bundle()` asks for
            before its forward, and `request_full()` are full in any case.
        steps_per_shard: steps per Parquet shard pair.
        flush_interval_s: write a shard at least this often (seconds) even
            when it holds fewer than `steps_per_shard` steps.
        near_overflow: the magnitude counted as near overflow (default
            float16's largest finite value).
        rank: this process's rank (default: torch.distributed's, else 0).
        world_size: the number of ranks (default: torch.distributed's, else 1).
        run_id: the run's id (default: `$AMP_POSTMORTEM_RUN_ID`, the id of
            a run already in `run_dir`, else a new one).
        max_queue: steps waiting for the writer thread; beyond it steps are
            dropped and counted, never waited for.
        bundles: save replay bundles at all (False: nothing is held).
        bundle_triggers: the automatic bundle triggers in force (a subset
            of `nonfinite_loss`, `nonfinite_tensor`, `skipped`, `scale_low`).
        bundle_steps: steps to save a bundle of in any case.
        max_bundles: at most this many bundles per rank and run.
        max_bundle_bytes: at most this many raw tensor bytes of bundles per
            rank and run.
        min_loss_scale: the `scale_low` trigger fires below this scale
            (None: never).
        settle_steps: consecutive optimizer steps that end the calibration
            of a fresh GradScaler; skips before that never trigger.
        snapshot_params: copy the weights in the optimizer pre-step hook
            every step (True, False, or "auto": when no GradScaler is
            enabled); at most two copies exist while the writer decides.
        snapshot_buffers_bytes: copy the buffers at each step's first
            forward when they total at most this many bytes.
        hold_steps: finished steps held while the writer thread decides.
        clone_inputs: copy the inputs instead of holding references (for
            loops that change a batch in place after the step).
        capture_loss: capture every micro-batch's loss: where the loop
            scales it (`scaler.scale`, wrapped on that scaler object until
            `close()`; the step's loss is their sum) or, without a scaler,
            from the model's outputs (a `"loss"`, `.loss`, or the one 0-d
            tensor of a tuple; their mean). A loss passed to `step()` wins
            unless a captured one is NaN/Inf. False: only the loss passed.
    """

    def __init__(self, run_dir, model: torch.nn.Module, optimizer=None, scaler=None, *,
                 include=("*",), exclude=(), cheap_every: int = 1, full_every: int = 100,
                 full_after_event: int = 20, steps_per_shard: int = 1000,
                 flush_interval_s: float = 60.0, near_overflow: float = schema.FP16_MAX,
                 rank: int | None = None, world_size: int | None = None,
                 run_id: str | None = None, max_queue: int = 256,
                 bundles: bool = True, bundle_triggers=TRIGGERS, bundle_steps=(),
                 max_bundles: int = 3, max_bundle_bytes: int = 64 << 30,
                 min_loss_scale: float | None = 1.0, settle_steps: int = 10,
                 snapshot_params="auto", snapshot_buffers_bytes: int = 64 << 20,
                 hold_steps: int = 2, clone_inputs: bool = False, capture_loss: bool = True):
        self.run_dir = Path(run_dir)
        self.model = model
        # AcceleratedOptimizer inherits register_step_pre_hook without the
        # state it writes to: hook the torch optimizer that really steps.
        optimizer = unwrap_optimizer(optimizer)
        self.optimizer = optimizer
        self.scaler = scaler
        self.include = tuple([include] if isinstance(include, str) else include)
        self.exclude = tuple([exclude] if isinstance(exclude, str) else exclude)
        self.flush_interval_s = float(flush_interval_s)
        if rank is None or world_size is None:
            dist_rank, dist_world = distributed_rank_world()
            rank = dist_rank if rank is None else rank
            world_size = dist_world if world_size is None else world_size
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.run_id = (run_id or os.environ.get("AMP_POSTMORTEM_RUN_ID")
                       or existing_run_id(self.run_dir, rank) or uuid.uuid4().hex)
        self.rank_dir = self.run_dir / schema.RANK_DIR.format(rank=self.rank)

        self._enabled = True
        self._closed = False
        self._failure: BaseException | None = None
        self._warned = False
        self._step_counter = 0
        self._dropped_steps = 0
        self._last_roll = time.monotonic()
        self._lock = threading.Lock()

        module_names = {}
        watched: list[str] = []
        for name, module in model.named_modules():
            if module in module_names:
                continue  # a module registered twice keeps its first name
            module_names[module] = name
            if name == "" or self._matches(name):
                watched.append(name)
        params = list(model.named_parameters())

        self.schedule = RecordSchedule(cheap_every, full_every, full_after_event)
        for s in (bundle_steps if bundles else ()):  # a bundle asked for up front: its step in full
            self.schedule.request(int(s))
        options = {"include": list(self.include), "exclude": list(self.exclude), **self.schedule.config(),
                   "steps_per_shard": max(1, int(steps_per_shard)), "near_overflow": float(near_overflow)}
        job = describe_job(run_id=self.run_id, rank=self.rank, world_size=self.world_size, model=model,
                           module_names=module_names, watched=watched, params=params,
                           optimizer=optimizer, scaler=scaler, recorder_options=options)
        self.writer = WriterThread(max_queue=max_queue, is_failed=lambda: self._failure is not None,
                                   on_error=self._fail)
        run_info = {k: job[k] for k in ("run_id", "rank", "world_size", "package_version",
                                        "device_type", "device_name", "scaler")}
        self.bundles = BundleCapture(  # a bad option raises here, before anything is written
            model, optimizer, scaler, run_dir=self.run_dir, run_info=run_info,
            post=self.writer.submit, on_change=self._bundles_changed, bundles=bundles,
            bundle_triggers=bundle_triggers, bundle_steps=bundle_steps, max_bundles=max_bundles,
            max_bundle_bytes=max_bundle_bytes, min_loss_scale=min_loss_scale, settle_steps=settle_steps,
            snapshot_params=snapshot_params, snapshot_buffers_bytes=snapshot_buffers_bytes,
            hold_steps=hold_steps, clone_inputs=clone_inputs)
        job["recorder"]["bundles"] = plain(self.bundles.config, keep_nonfinite=True)
        self.manifest = RunManifest(self.run_dir, self.rank, job)
        self.rows = StepRows(rank=self.rank, optimizer=optimizer, scaler=scaler)
        self.hooks = TrainingHooks(
            model, optimizer=optimizer, scaler=scaler, watched=watched, watch_param=self._matches,
            near_overflow=float(near_overflow), guard=self._guard, bundles=self.bundles,
            on_autocast=lambda info: self._submit(functools.partial(self.manifest.set_autocast, info)))
        self.hooks.begin_step(0, self.schedule.tier(0))
        self.capture_loss = bool(capture_loss)
        self.losses = MicroBatchLosses()
        self.loss_tap = None
        self.shards = ShardWriter(self.rank_dir, run_id=self.run_id, rank=self.rank,
                                  world_size=self.world_size, steps_per_shard=options["steps_per_shard"])
        try:
            self.manifest.write()
        except OSError as exc:
            # An unwritable run directory must not stop the job it watches:
            # no hooks, no thread, one warning; step() and close() are no-ops.
            self._fail(exc)
            return
        self.writer.start()
        self.hooks.register()
        if self.capture_loss:
            self.loss_tap = self._loss_tap(scaler)

    def _loss_tap(self, scaler):
        # Any scaler object, enabled or not, sees the loss as backpropagated
        # (nanoGPT scales through a disabled one under bf16); without one,
        # the model may return its loss (Hugging Face models with labels=).
        active = lambda: self._enabled and not self.hooks.paused  # noqa: E731
        if scaler is not None and callable(getattr(scaler, "scale", None)):
            return ScaleTap(scaler, self.losses, active)
        return OutputLossTap(self.model, self.losses, lambda: active() and torch.is_grad_enabled())

    def _unhook(self) -> None:
        self.hooks.remove()
        if self.loss_tap is not None:
            self.loss_tap.remove()
            self.loss_tap = None

    # ------------------------------------------------------------ guard/fail
    def _matches(self, name: str) -> bool:
        if not any(fnmatch.fnmatchcase(name, p) for p in self.include):
            return False
        return not any(fnmatch.fnmatchcase(name, p) for p in self.exclude)

    def _guard(self, fn):
        """Wrap a hook: any exception switches recording off, never the job."""
        def hook(*args, **kwargs):
            if not self._enabled:
                return None
            try:
                fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the training must go on
                self._fail(exc)
            return None
        hook.__wrapped__ = fn
        return hook

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = exc
            self._enabled = False
        if not self._warned:
            self._warned = True
            warnings.warn(f"amp-postmortem: recording disabled after an internal error: "
                          f"{type(exc).__name__}: {exc}. Training continues unrecorded.",
                          RuntimeWarning, stacklevel=2)

    @property
    def enabled(self) -> bool:
        return self._enabled

    # --------------------------------------------------------------- public
    def step(self, loss=None, step: int | None = None) -> None:
        """Close the current optimizer step. Call once per optimizer step,
        after `scaler.update()` (or `optimizer.step()` without a scaler)."""
        if self._closed:
            return
        if not self._enabled:
            self._unhook()
            return
        try:
            self._step(loss, step)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
            self._unhook()

    def add_loss(self, loss) -> None:
        """Add one micro-batch's loss as backpropagated (for a framework
        hook that is handed it); summed into the step's loss at `step()`."""
        if self._enabled and not self._closed and not self.hooks.paused:
            self.losses.add(loss)

    def _step(self, loss, step):
        step_id = self._step_counter if step is None else int(step)
        loss = step_loss(self.losses.take(), loss)
        loss_t = loss.detach() if isinstance(loss, torch.Tensor) else None
        finished = self.hooks.end_step(loss_t)
        pending = self.rows.pack(finished, step_id, loss, loss_t)
        self.bundles.on_step_end(step_id, loss=loss_t if loss_t is not None else loss, stepped=pending.stepped)
        self._submit(functools.partial(self._write_step, pending))
        self._step_counter = step_id + 1
        self.hooks.begin_step(step_id + 1, self.schedule.tier(step_id + 1))

    def _submit(self, job) -> None:
        if not self.writer.submit(job):
            # Never make the training wait for the disk: drop and count.
            self._dropped_steps += 1

    def save_bundle(self) -> None:
        """Ask for a replay bundle of the current step (recorded at the full
        tier too when its forward has not begun)."""
        if self._enabled:
            try:
                self.bundles.request()
                self.hooks.raise_to_full()
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)

    def request_full(self) -> None:
        """Record the current step at the full tier, or the next one when the
        current step's forward has begun; whatever the schedule."""
        if self._enabled and not self.hooks.raise_to_full():
            current = self.hooks.state.step_id
            self.schedule.request(current + 1, current=current)

    @contextmanager
    def paused(self):
        """Forward/backward passes inside are not recorded (e.g. an eval pass
        with gradients enabled)."""
        self.hooks.paused += 1
        try:
            yield self
        finally:
            self.hooks.paused -= 1

    def flush(self) -> None:
        """Block until every step so far is written to disk."""
        if self._closed or not self.writer.alive:
            return
        self.writer.barrier(functools.partial(self._write_files, "open"))
        if self._enabled:
            try:
                self.bundles.apply_decisions()
                self.writer.barrier()
            except Exception as exc:  # noqa: BLE001 - flush() must not stop the training
                self._fail(exc)

    def close(self) -> None:
        """Flush, write the final manifest and remove every hook. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._unhook()
        self.writer.stop(functools.partial(self._write_files, "closed"))
        try:
            self.bundles.close(write_decided=self._failure is None and not self.writer.alive)
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # --------------------------------------------------------- writer thread
    def _write_step(self, pending) -> None:
        step_row, columns, summary = self.rows.rows(pending)
        self.shards.add_step(step_row, columns)
        self.manifest.note_step(pending.step)
        events = step_events(summary)
        if events:
            self.schedule.note_event(pending.step, events)
        self.bundles.on_step_summary(summary)
        rolled = self.shards.pending_steps == 0
        if not rolled and time.monotonic() - self._last_roll > self.flush_interval_s:
            self.shards.roll()
            rolled = True
        if rolled:
            self._last_roll = time.monotonic()
            self._write_manifest()

    def _write_files(self, status: str) -> None:
        """flush()/close(): the buffered steps as a shard, then the manifest."""
        self.shards.roll()
        self.manifest.set_recording(status=status)
        self._write_manifest()

    def _write_manifest(self) -> None:
        self.manifest.set_recording(dropped_steps=self._dropped_steps, failure=self._failure)
        self.manifest.write()

    def _bundles_changed(self, saved: list, missed: list) -> None:
        self.manifest.set_bundles(saved, missed)
        self.manifest.write()
