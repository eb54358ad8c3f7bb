"""AmpRecorder: the black-box recorder that rides along with a training job.

Lifecycle: construct (hooks registered, manifest written), `step()` once per
optimizer step, `flush()` (blocks until everything so far is on disk),
`close()` (idempotent; flushes and removes every hook). Also a context manager.

`AmpRecorder` owns its parts and wires them; each keeps its own state. The
user may pass five of them in (`recorders.options`): `schedule=`,
`bundles=` (a `BundlePolicy`, the options of `BundleCapture`), `storage=`
(`StorageOptions`), `writer=` (`WriterOptions`) and `on_event=` (a
callback or an `EventPolicy`); the flat keywords of earlier versions are
mapped to them in `options.parts_from_flat`.

- `schedule` (`RecordSchedule`): which step is recorded at which tier;
- `hooks` (`TrainingHooks`): the hooks and the state of the step in progress;
- `rows` (`StepRows`): a finished step packed into one asynchronous copy,
  and, on the writer thread, turned into table rows;
- `manifest` (`RunManifest`): the run's manifest;
- `shards` (`ShardWriter`): the Parquet shards and the per-step journal;
- `writer` (`WriterThread`): the background thread that does all the above
  writing, in order;
- `bundles` (`BundleCapture`): replay bundles;
- `losses` (`MicroBatchLosses`) and `loss_tap` (`ScaleTap` or
  `OutputLossTap`): every micro-batch's loss;
- with `on_event=`: `event_detector` (`EventDetector`, writer thread) and
  `events` (`EventDispatcher`: the callback's thread and the requests it
  makes, taken at `step()`).

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
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from . import schema
from .bundles.capture import BundleCapture
from .bundles.policy import BundlePolicy
from .errors import OptionError  # noqa: F401 - importable from here, as before recorders.errors
from .event_thread import FLUSH_WAIT_S, EventDispatcher
from .events import EventDetector
from .hooks import TrainingHooks
from .lease import LeaseHeldError, RankLease
from .layout import (canonical_modules, canonical_parameters, fsdp1_flat_views, fsdp1_shapes, fsdp1_sharded_params,
                     is_compiled, is_distributed_wrapper, sharded_param_ids, user_class)
from .loss_tap import MicroBatchLosses, OutputLossTap, ScaleTap, loss_dtype, step_loss
from .manifest import RunManifest, bare_manifest, describe_job, distributed_rank_world, failure_reason
from .options import FLAT_OPTIONS, UNSET, StorageOptions, WriterOptions, parts_from_flat
from .plain import plain
from .reexecute import ReexecuteTrigger, Reexecutor, Refusal, host_facts, reexecute_policy
from .run_id import shared_run_id
from .schedule import RecordSchedule
from .status_slot import StatusSlot, write_fallback
from .step_rows import StepRows, step_events
from .storage import open_run_location
from .unwrap import unwrap_optimizer, unwrap_scaler
from .writer import Publisher, ShardWriter
from .writer_thread import WriterThread


MODE_ENV = "AMP_POSTMORTEM_MODE"

# Clean steps handed to the writer thread together (`_hold_back`): at most
# this many, at most this late.
HOLD_BACK_STEPS = 32
HOLD_BACK_S = 0.25

COMPILED_STEPS_RECORD = (
    "the cheap tier's rows of every watched module (activation, grad_output, grad_input, <input>), "
    "computed by tensor operations inside the compiled graph (inductor's fused rounding), one row "
    "per module and kind (call 0: a module's calls merged), min/max/mean/rms and the shares null; "
    "loss, loss scale, skipped, parameter gradients (param_grad rows, grad_norm) as eager")

COMPILED_STEPS_WITHOUT_ROWS = (
    "loss, loss scale, skipped, parameter gradients (param_grad rows, grad_norm) and, with the "
    "recorder attached to the compiled module, the model's inputs and outputs (compiled_rows=False: "
    "no statistic inside the graph)")


class AmpRecorder:
    """Record per-step scalars and per-layer statistics of a training job.

    >>> rec = AmpRecorder("runs/exp1", model, optimizer=opt, scaler=scaler)
    >>> ...   # training loop; after scaler.update() / optimizer.step():
    >>> rec.step(loss)
    >>> rec.close()

    Args:
        run_dir: the run directory (created; a resumed job may reuse it), or
            a URI of any filesystem pyarrow or fsspec opens (`s3://...`,
            `gs://...`, `abfs://...`, `hdfs://...`): its files are then
            spooled locally and uploaded off the training path.
        model: the model to watch: an `nn.Module`, bare or wrapped (DDP,
            FSDP, `torch.compile`, checkpoint wrappers, as Accelerate
            prepared it; names and class are the unwrapped model's). With
            `torch.compile`, attach before the first compiled call.
        optimizer: its optimizer; gives the learning rates, the global
            gradient norm (pre-step hook) and the weights a bundle holds.
            Accelerate's and Lightning's wrappers are unwrapped.
        scaler: the `torch.amp.GradScaler`, if any; gives the loss scale
            and the `skipped` flag. An object that holds one in `_scaler`,
            `scaler` or `grad_scaler` (timm's `NativeScaler`, an
            `Accelerator`, Lightning's precision plugin) is unwrapped; any
            other object is refused with a RuntimeWarning (recorded as no
            scaler).
        schedule: the `RecordSchedule`: which step is recorded at which
            tier (default `RecordSchedule()`: cheap every step, full every
            100 steps and in a burst after the first event of each kind).
        bundles: the `BundlePolicy`: which replay bundles are held and
            saved (True: `BundlePolicy()`; False: nothing is held).
        storage: the `StorageOptions` of a URI run: its local spool and how
            long `close()` waits for the uploads.
        writer: the `WriterOptions`: shard size, how often shards are
            written and the journal fsynced, the writer thread's queue.
        on_event: a callable, called with an `Event` (`recorders.events`:
            kind, step, layer, evidence) at the first non-finite value, a
            skip streak and the onset of a scale collapse, on a thread of
            its own; or an `EventPolicy(callback, ...)` with the detectors'
            options. Through the event it may ask for a stop
            (`rec.should_stop`), a checkpoint (`rec.checkpoint_requested`)
            or a bundle of the next step, all taken at the next `step()`.
        include: glob patterns of module names to watch (`"*"`: all).
        exclude: glob patterns of module names not to watch.
        near_overflow: the magnitude counted as near overflow (default
            float16's largest finite value).
        rank: this process's rank (default: torch.distributed's, else 0).
        world_size: the number of ranks (default: torch.distributed's, else 1).
        run_id: the run's id (default: `$AMP_POSTMORTEM_RUN_ID`,
            `$TORCHELASTIC_RUN_ID`, the id of a run already in `run_dir`,
            else a new one); under an initialised process group, rank 0's
            id is used by every rank.
        capture_loss: capture every micro-batch's loss: where the loop
            scales it (`scaler.scale`, wrapped on that scaler object until
            `close()`; the step's loss is their sum) or, without a scaler,
            from the model's outputs (`loss_tap.find_loss`: a `"loss"`,
            `.loss`, or the loss of a tuple; their mean). A loss passed to
            `step()` wins unless a captured one is NaN/Inf. False: only the
            loss passed.
        eager_full_steps: with a compiled model, run full-tier steps eagerly
            (`torch.compiler.set_stance("force_eager")`, process-wide: held
            during the model's forwards when the recorder is attached to
            the compiled module, from the previous `step()` when attached
            before compiling; see `_enter_tier`) so they record the full
            tier's statistics; such a step computes with eager rounding,
            which a backend like inductor may not share. False: every step
            stays compiled (the cheap tier's rows, computed in the graph:
            `collectors.graph_stats`).
        compiled_rows: with a compiled model, True computes the cheap
            tier's rows of every watched module inside the compiled graph on
            every recorded step (`collectors.graph_stats`). Off by default:
            on the CPU it costs 1.2x the compiled step of the benchmark GPT
            (`benchmarks/RESULTS.md`), and the statistics, which read
            tensors only, give the compiler more consumers of them, which
            can change its fusion and so the training's rounding by a bit
            (as `eager_full_steps` does on full-tier steps). False: no
            statistic in the graph; compiled steps carry the loss, the loss
            scale and the parameter gradients, and per-module rows come from
            the eager full-tier steps. With `eager_full_steps=False` too the
            training is bit-identical to the compiled job's without the
            recorder.
        probe: the op probe, off by default: glob patterns of module names
            (`["blocks.*.attn"]`) or a `ProbeOptions` (`recorders.options`,
            its options documented there). While a probed module's forward
            runs on a recorded step, the largest finite magnitude and the
            NaN/Inf counts of each operation inside it are recorded
            (`intermediate` rows: the op, its dtype, the model's source
            line), so `ranges` names an op near float16's 65504 that never
            reaches the module's output. Costs a Python call and cheap
            statistics per op of the probed modules; nothing without it.
        reexecute: re-execute in full, inside the job, a step that was not
            sampled and whose step facts show an event (a skip, a NaN/Inf
            loss or gradient, a spike): True (`ReexecutePolicy()`: the
            first of each kind, then one per 1000 steps of a kind, at most
            16), a `ReexecutePolicy` (`recorders.reexecute`, its options
            documented there) or False. It re-runs the step's forward and
            backward from the held inputs, RNG states, output gradients and
            weights, with every hook, writes those rows marked re-executed
            and checks them against the recorded facts; the training's
            numbers are untouched. Needs bundles (what they hold is what it
            re-runs); refused under DDP/FSDP and on compiled models.
        mode: `"sentinel"` (the default): step facts every step (loss,
            loss scale, skip, gradient norm and non-finite gradient count),
            per-module rows on sampled steps only (`RecordSchedule()`: every
            50th step, the full tier every 500th), no hook on any other
            module on the other steps, and the failing step re-executed;
            `"every_step"`: every module's rows on every step
            (`RecordSchedule.every_step()`), 3x a launch-bound step. Flat
            schedule keywords override the mode's fields; None reads
            `$AMP_POSTMORTEM_MODE`, else "sentinel".

    The flat keywords of earlier versions set one field of a part each
    (`recorders.options.FLAT_OPTIONS`); a part and one of its own flat
    keywords together are an `OptionError`:

        cheap_every: `RecordSchedule(cheap_every=)`.
        full_every: `RecordSchedule(full_every=)`.
        full_after_event: `RecordSchedule(full_after_event=)`.
        steps_per_shard: `WriterOptions(steps_per_shard=)`.
        flush_interval_s: `WriterOptions(flush_interval_s=)`.
        durable_interval_s: `WriterOptions(durable_interval_s=)`.
        max_queue: `WriterOptions(max_queue=)`.
        bundle_triggers: `BundlePolicy(triggers=)`.
        bundle_steps: `BundlePolicy(steps=)`.
        max_bundles: `BundlePolicy(max_bundles=)`.
        max_bundle_bytes: `BundlePolicy(max_bundle_bytes=)`.
        min_loss_scale: `BundlePolicy(min_loss_scale=)`.
        settle_steps: `BundlePolicy(settle_steps=)`.
        snapshot_params: `BundlePolicy(snapshot_params=)`.
        snapshot_buffers_bytes: `BundlePolicy(snapshot_buffers_bytes=)`.
        hold_steps: `BundlePolicy(hold_steps=)`.
        clone_inputs: `BundlePolicy(clone_inputs=)`.
        window_steps: `BundlePolicy(window_steps=)`.
        max_window_bytes: `BundlePolicy(max_window_bytes=)`.
        spool_dir: `StorageOptions(spool_dir=)`.
        spool_max_bytes: `StorageOptions(spool_max_bytes=)`.
        upload_timeout_s: `StorageOptions(upload_timeout_s=)`.
    """

    def __init__(self, run_dir, model: torch.nn.Module, optimizer=None, scaler=None, *,
                 schedule: RecordSchedule | None = None, bundles: bool | BundlePolicy = True,
                 storage: StorageOptions | None = None, writer: WriterOptions | None = None,
                 on_event=None, include=("*",), exclude=(), near_overflow: float = schema.FP16_MAX,
                 rank: int | None = None, world_size: int | None = None, run_id: str | None = None,
                 capture_loss: bool = True, eager_full_steps: bool = True, compiled_rows: bool = False, probe=None,
                 reexecute=True, mode: str | None = None,
                 cheap_every=UNSET, full_every=UNSET, full_after_event=UNSET,
                 steps_per_shard=UNSET, flush_interval_s=UNSET, durable_interval_s=UNSET, max_queue=UNSET,
                 bundle_triggers=UNSET, bundle_steps=UNSET, max_bundles=UNSET, max_bundle_bytes=UNSET,
                 min_loss_scale=UNSET, settle_steps=UNSET, snapshot_params=UNSET,
                 snapshot_buffers_bytes=UNSET, hold_steps=UNSET, clone_inputs=UNSET,
                 window_steps=UNSET, max_window_bytes=UNSET,
                 spool_dir=UNSET, spool_max_bytes=UNSET, upload_timeout_s=UNSET):
        flat = {name: value for name, value in locals().items() if name in FLAT_OPTIONS and value is not UNSET}
        # A bad option raises here, in the caller's line, before anything is written.
        # $AMP_POSTMORTEM_MODE: the mode of a job whose script is not edited.
        mode = mode if mode is not None else os.environ.get(MODE_ENV) or "sentinel"
        self.mode = mode
        self.parts = parts = parts_from_flat(flat, schedule=schedule, bundles=bundles, storage=storage,
                                             writer=writer, on_event=on_event, probe=probe, mode=mode)
        self.run_location = str(run_dir)
        self.upload_report = None  # storage.UploadReport after close() of a URI run
        self.run_dir = None  # the local directory written (a URI run's spool), once opened
        self.rank_dir = None
        self.lease = None  # RankLease: this recorder is the rank directory's one writer
        self.status = None  # StatusSlot: the stop record, with its space reserved
        self.uploader = None
        self._uploading = False
        self.shards = None
        self.model = model
        # AcceleratedOptimizer inherits register_step_pre_hook without the
        # state it writes to: hook the torch optimizer that really steps.
        optimizer = unwrap_optimizer(optimizer)
        self.optimizer = optimizer
        # A wrapper (timm's NativeScaler, an Accelerator, a precision plugin)
        # is unwrapped once here: every part below reads a real GradScaler.
        scaler, refused = unwrap_scaler(scaler)
        if refused:
            warnings.warn(f"amp-postmortem: {refused}", RuntimeWarning, stacklevel=2)
        self.scaler = scaler
        self.include = tuple([include] if isinstance(include, str) else include)
        self.exclude = tuple([exclude] if isinstance(exclude, str) else exclude)
        self.eager_full_steps = bool(eager_full_steps)
        self.compiled_rows = bool(compiled_rows)
        self._enabled = True
        self._closed = False
        self._failure: BaseException | None = None
        self._failed_at_step: int | None = None
        self._writing_step: int | None = None  # the step the writer thread is writing
        self._prior_stance = None  # the compiler stance to restore after an eager step
        # Whether the next forwards of the model run eagerly (a full-tier step
        # of a compiled model whose root's hooks run outside its graph).
        self._eager_forwards = False
        self._stance_handles: list = []
        self.compiled = False
        self.rank = int(rank or 0)
        self.world_size = int(world_size or 1)
        self.run_id = run_id
        self._warned = False
        self._step_counter = 0
        self._dropped_steps = 0
        self._last_roll = time.monotonic()
        self._journaled_first_step = False  # the manifest rewritten after it (see _write_step)
        self._held_back: list = []  # clean steps not yet handed to the writer thread (_hold_back)
        self._held_back_since = 0.0
        self._lock = threading.Lock()
        self.manifest = None
        self.hooks = None
        self.writer = None
        self.bundles = None
        self.event_detector = None
        self.events = None  # EventDispatcher, with on_event=
        self._should_stop = False
        self.checkpoint_requested = False
        self.capture_loss = bool(capture_loss)
        self.losses = MicroBatchLosses()
        self.loss_tap = None
        self.reexecute_policy = reexecute_policy(reexecute)  # a bad value raises here
        self.reexec_trigger = None
        self.reexecutor = None
        try:
            self._build(run_dir, model, optimizer, scaler, rank=rank, world_size=world_size, run_id=run_id,
                        parts=parts, near_overflow=near_overflow)
        except LeaseHeldError as exc:
            # Another live recorder writes this rank directory: touch none
            # of its files (manifest included), record nothing.
            self._enabled = False
            self._warned = True
            self._unhook()
            warnings.warn(f"amp-postmortem: not recording: {exc}; one recorder per run directory and "
                          f"rank (pass another run directory for this job). Training continues unrecorded.",
                          RuntimeWarning, stacklevel=2)
        except Exception as exc:  # noqa: BLE001 - the training must go on
            # Whatever broke (an unwritable run directory, a model the
            # recorder does not understand): no hooks, no thread, one
            # warning; step() and close() are no-ops.
            if self.manifest is None and self.run_dir is not None:
                # Failed before the manifest was built: a bare one, so that
                # the run directory still says why nothing was recorded.
                self.manifest = bare_manifest(self.run_dir, self.rank, self.world_size, self.run_id)
            self._fail(exc)
            self._unhook()

    def _build(self, run_dir, model, optimizer, scaler, *, rank, world_size, run_id, parts, near_overflow):
        if rank is None or world_size is None:
            dist_rank, dist_world = distributed_rank_world()
            rank = dist_rank if rank is None else rank
            world_size = dist_world if world_size is None else world_size
        self.rank = int(rank)
        self.world_size = int(world_size)
        # A URI run is written to a local spool that `uploader` publishes.
        self.run_dir, self.uploader = open_run_location(run_dir, self.rank, spool_dir=parts.storage.spool_dir,
                                                        spool_max_bytes=parts.storage.spool_max_bytes)
        self.rank_dir = self.run_dir / schema.RANK_DIR.format(rank=self.rank)
        # Before anything is written: one writer per rank directory.
        held = None
        try:
            self.lease = RankLease(self.rank_dir)
        except LeaseHeldError as exc:
            held = exc
        first_shard = 0
        if self.uploader is not None and held is None:
            # The store's round trips run on the upload thread; the run
            # waits for its answer (a resumed run's id and shard count) a
            # bounded moment, never for a store that is down.
            self.uploader.start(resume_rank=self.rank)
            self._uploading = True
            first_shard = self.uploader.resume_run(self.rank)
        # Before anything else can fail: every rank waits for rank 0's id
        # (a refused rank too, or the others would wait for it).
        self.run_id = shared_run_id(self.run_dir, self.rank, run_id)
        if held is not None:
            raise held
        # The space of the stop record, taken while the disk has room.
        self.status = StatusSlot(self.rank_dir, run_id=self.run_id, rank=self.rank)

        # Names as the user's model gives them, whatever wraps it (compile,
        # DDP, FSDP, checkpoint wrappers); hooks go on the wrapped modules,
        # except the root's, which stay on the outermost module: the only
        # one that runs eagerly around a compiled model.
        modules = canonical_modules(model)
        module_names = {m: name for name, m in modules}
        watched = [name for name, _ in modules if name == "" or self._matches(name)]
        params = canonical_parameters(modules)
        sharded = sharded_param_ids(model, params)
        # FSDP1 without use_orig_params: the parameters as slices of the
        # flat parameters, recorded and described like the others.
        flat_views = fsdp1_flat_views(model, module_names)
        sharded |= {id(v) for _, v in flat_views if v.sharded}
        bundles_enabled = parts.bundles_enabled
        # Sharded parameters: each rank's bundle holds its shards with their
        # placement, which the analyzer reassembles from every rank's bundle
        # of the step. A window's optimizer state is not placed yet.
        window_off = None
        if (sharded or flat_views) and bundles_enabled and parts.bundle_policy.window_steps > 0:
            # Each rank starts its window when its own writer has decided
            # the steps before: the ranks' windows would start at different
            # steps, whose shards no reader could put together.
            window_off = "sharded parameters (the ranks' windows would not start at one step)"

        self.schedule = parts.schedule
        for s in (parts.bundle_policy.steps if bundles_enabled else ()):
            # a bundle asked for up front: its step in full
            self.schedule.request(s)
        probed, probe_leaves = probe_targets(parts.probe, modules, watched)
        writing = parts.writer
        options = {"include": list(self.include), "exclude": list(self.exclude), "mode": self.mode,
                   **self.schedule.config(),
                   "steps_per_shard": writing.steps_per_shard, "near_overflow": float(near_overflow),
                   "eager_full_steps": self.eager_full_steps, "compiled_rows": self.compiled_rows,
                   "flush_interval_s": writing.flush_interval_s, "durable_interval_s": writing.durable_interval_s}
        if parts.probe is not None:
            options["probe"] = {**parts.probe.config(), "probed": probed}
        job = describe_job(run_id=self.run_id, rank=self.rank, world_size=self.world_size, model=model,
                           module_names=module_names, watched=watched, params=params,
                           optimizer=optimizer, scaler=scaler, recorder_options=options, flat_views=flat_views,
                           model_class=user_class(model), sharded=sharded, shapes=fsdp1_shapes(model))
        self.writer = WriterThread(max_queue=writing.max_queue, is_failed=lambda: self._failure is not None,
                                   on_error=self._fail)
        run_info = {k: job[k] for k in ("run_id", "rank", "world_size", "package_version",
                                        "device_type", "device_name", "scaler")}
        self.bundles = BundleCapture(model, optimizer, scaler, policy=parts.bundle_policy, enabled=bundles_enabled,
                                     run_dir=self.run_dir, run_info=run_info, post=self.writer.submit,
                                     on_change=self._bundles_changed, window=window_off is None)
        job["recorder"]["bundles"] = plain(self.bundles.config, keep_nonfinite=True)
        if window_off:
            job["recorder"]["bundles"]["window_disabled"] = window_off
        # Re-execution replays held steps: without bundles nothing is held.
        refuse = None
        if self.reexecute_policy is not None and bundles_enabled:
            self.reexec_trigger = ReexecuteTrigger(self.reexecute_policy)
            if self.world_size > 1 or sharded or flat_views or is_distributed_wrapper(model):
                refuse = Refusal.DISTRIBUTED
        job["recorder"]["reexecute"] = (dict(self.reexecute_policy.config(), refused=refuse and refuse.value)
                                        if self.reexec_trigger is not None else None)
        self.manifest = RunManifest(self.run_dir, self.rank, job)
        if parts.events is not None:
            self.event_detector = EventDetector.of(parts.events)
            self.events = EventDispatcher(parts.events)
            self._note_events()
        self.rows = StepRows(rank=self.rank, optimizer=optimizer, scaler=scaler)
        self.hooks = TrainingHooks(
            model, optimizer=optimizer, scaler=scaler, watched=watched, modules=dict(modules),
            params=params, sharded=sharded, late_grads=fsdp1_sharded_params(model, sharded_only=False),
            flat_views=flat_views, compiled_rows=self.compiled_rows,
            watch_param=self._matches,
            near_overflow=float(near_overflow), guard=self._guard, guard_call=self._guard_call,
            bundles=self.bundles, probe=parts.probe, probed=probed, probe_leaves=probe_leaves,
            on_probe_error=self._fail,
            on_autocast=lambda info: self._submit(functools.partial(self.manifest.set_autocast, info)),
            sampled_hooks=self.schedule.cheap_every > 1 and not is_compiled(model))
        if self.reexec_trigger is not None:
            self.reexecutor = Reexecutor(model, self.hooks, self.bundles, refuse=refuse)
        self.compiled = is_compiled(model)
        self._note_compiled()
        self.hooks.begin_step(0, self.schedule.tier(0))
        up = self.uploader
        self.shards = ShardWriter(self.rank_dir, run_id=self.run_id, rank=self.rank,
                                  world_size=self.world_size, steps_per_shard=writing.steps_per_shard,
                                  first_index=first_shard,
                                  has_room=up.has_room if up else None,
                                  durable_interval_s=writing.durable_interval_s,
                                  publisher=Publisher(on_error=self._fail))
        self.writer.when_idle(self.shards.sync_journal, self.shards.journal.idle_sync_s)
        if up is not None:
            self.manifest.data["storage"] = {"uri": self.run_location, "spool_dropped_steps": 0}
        self.manifest.write()
        self.writer.start()
        self.hooks.register()
        self._register_stance_hooks(model)
        if self.capture_loss:
            self.loss_tap = self._loss_tap(scaler)
        self._enter_tier(self.schedule.tier(0))

    def _loss_tap(self, scaler):
        # Any scaler object, enabled or not, sees the loss as backpropagated
        # (nanoGPT scales through a disabled one under bf16); without one,
        # the model may return its loss (Hugging Face models with labels=).
        active = lambda: self._enabled and not self.hooks.paused  # noqa: E731
        if scaler is not None and callable(getattr(scaler, "scale", None)):
            return ScaleTap(scaler, self.losses, active)
        return OutputLossTap(self.model, self.losses, lambda: active() and torch.is_grad_enabled())

    def _unhook(self) -> None:
        self._leave_tier()
        self._eager_forwards = False
        for h in self._stance_handles:
            h.remove()
        self._stance_handles = []
        if self.hooks is not None:
            self.hooks.remove()
        if self.loss_tap is not None:
            self.loss_tap.remove()
            self.loss_tap = None

    # ------------------------------------------------------------ guard/fail
    def _matches(self, name: str) -> bool:
        if not any(fnmatch.fnmatchcase(name, p) for p in self.include):
            return False
        return not any(fnmatch.fnmatchcase(name, p) for p in self.exclude)

    def _guard(self, fn, traced: bool = True, in_graph=None):
        """Wrap a hook: any exception switches recording off, never the job.
        A `traced` hook (one that dynamo may trace: module hooks inside a
        compiled model) does not run its eager body while compiling: it
        calls `in_graph` instead (`collectors.graph_stats`: tensor ops the
        graph takes in, no graph break, no recompilation) or returns."""
        def hook(*args, **kwargs):
            if traced and torch.compiler.is_compiling():
                return in_graph(*args, **kwargs) if in_graph is not None else None
            if not self._enabled:
                return None
            try:
                fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the training must go on
                self._fail(exc)
            return None
        hook.__wrapped__ = fn
        return hook

    def _guard_call(self, fn, a, b):
        """`_guard` for the backward hooks made anew for every module call
        of every step: `fn(a, b, *args)` as one small object, where a
        wrapper closure around a hook closure made eleven (cells, closure
        tuples, functions, their `__dict__`). They were most of what the
        recorder allocated in a step, and each of Python's garbage
        collections had to visit them."""
        return _GuardedCall(self, fn, a, b)

    def _fail(self, exc: BaseException, at_step: int | None = None) -> None:
        with self._lock:
            first = self._failure is None
            if first:
                self._failure = exc
                # `at_step` (the last step of a pair the publisher failed to
                # write), the step being written when the writer thread
                # failed, else the step the training is in.
                on_writer = self.writer is not None and threading.current_thread() is self.writer.thread
                self._failed_at_step = at_step if at_step is not None else \
                    self._writing_step if on_writer and self._writing_step is not None else self._step_counter
            self._enabled = False
        # On disk at once, not through the writer thread (which may be
        # what failed, and skips its jobs from now on).
        where = self._write_disabled() if first else None
        if not self._warned:
            self._warned = True
            aside = (f" The reason is recorded in {where} (the run directory took no write)."
                     if where is not None and where != getattr(self.status, "path", None) else "")
            warnings.warn(f"amp-postmortem: recording disabled after an internal error: "
                          f"{type(exc).__name__}: {exc}. Training continues unrecorded.{aside}",
                          RuntimeWarning, stacklevel=2)

    def _write_disabled(self, status: str | None = None):
        """The stop record (`disabled_reason`, `disabled_at_step`), written
        from the calling thread: first in the reserved status slot, which a
        full disk still takes (else a fallback file), then in the manifest,
        best effort (the disk may be what failed). Returns the file that
        holds the record (None: none could be written)."""
        reason = failure_reason(self._failure) if self._failure is not None else None
        if self.status is not None:
            where = self.status.record(status=status, disabled_reason=reason,
                                       disabled_at_step=self._failed_at_step)
        elif self.rank_dir is not None and reason is not None:
            # Failed before the slot was reserved (the disk was full already).
            where = write_fallback(self.rank_dir / schema.STATUS_FILE, {
                "format": schema.STATUS_FORMAT, "run_id": self.run_id, "rank": self.rank,
                "status": status or "open", "disabled_reason": reason,
                "disabled_at_step": self._failed_at_step})
        else:
            where = None
        if self.manifest is not None:
            try:
                self._note_events()
                self.manifest.set_recording(status=status, dropped_steps=self._dropped_steps,
                                            failure=self._failure, failed_at_step=self._failed_at_step)
                self.manifest.write()
            except Exception:  # noqa: BLE001 - nothing more can be done without a disk
                pass
        return where

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
        else:
            try:
                self._step(loss, step)
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
                self._unhook()
        if self.events is not None and self.events.requests.pending:
            self._take_requests()

    def _take_requests(self) -> None:
        """What on_event callbacks asked for since the last step: a bundle
        of the step now beginning (its forward has not run: full tier too)."""
        stop, checkpoint, bundle = self.events.requests.take()
        self._should_stop |= stop
        self.checkpoint_requested |= checkpoint
        if bundle:
            self.save_bundle()

    @property
    def should_stop(self) -> bool:
        """True once an `on_event` callback asked for a stop
        (`event.request_stop()`), from the `step()` after it on. The
        recorder stops nothing itself: the loop reads this and ends (the
        Trainer and Lightning callbacks do so with `stop_on_event=True`)."""
        return self._should_stop

    def add_loss(self, loss) -> None:
        """Add one micro-batch's loss as backpropagated (for a framework
        hook that is handed it); summed into the step's loss at `step()`."""
        if self._enabled and not self._closed and not self.hooks.paused:
            self.losses.add(loss)

    def _step(self, loss, step):
        step_id = self._step_counter if step is None else int(step)
        taken = self.losses.take()
        dtype = loss_dtype(taken, loss)
        loss = step_loss(taken, loss)
        loss_t = loss.detach() if isinstance(loss, torch.Tensor) else None
        self._leave_tier()
        finished = self.hooks.end_step(loss_t)
        if not self.compiled and finished.record and (
                finished.graph_values is not None or (finished.micro_batches == 0 and finished.param_grads)):
            # A traced hook wrote the in-graph statistics, or gradients
            # arrived but no forward hook ran: the model ran as a compiled
            # graph (compiled after the recorder was attached).
            self.compiled = True
            self.hooks.keep_attached()
            self._note_compiled()
        reexecution, clean = self._reexecute(finished, loss_t) if self.reexec_trigger is not None else (None, False)
        pending = self.rows.pack(finished, step_id, loss, loss_t, loss_dtype=dtype, graph_slots=self.hooks.graph,
                                 reexecution=reexecution)
        self.bundles.on_step_end(step_id, loss=loss_t if loss_t is not None else loss, stepped=pending.stepped)
        if clean:
            self._hold_back(pending)
        else:
            self._submit(functools.partial(self._write_step, pending))
        self._step_counter = step_id + 1
        tier = self.schedule.tier(step_id + 1)
        self.hooks.begin_step(step_id + 1, tier)
        self._enter_tier(tier)

    def _reexecute(self, finished, loss_t):
        """A step not sampled whose host facts show an event, re-executed in
        full (`reexecute`): (its `Outcome`, or None when none is asked for or
        the cap says no; whether the step is clean: not sampled, its facts
        host values that show no event)."""
        if finished.record:
            return None, False  # sampled: its rows are there
        skipped = (self.scaler is not None and self.optimizer is not None and not finished.stepped
                   and (finished.micro_batches or finished.backward_passes) > 0)
        scale = self.rows.scale_before if self.scaler is not None else None
        scale = scale if isinstance(scale, torch.Tensor) else None
        facts = host_facts(finished, loss_t, skipped=skipped, scale=scale)
        if facts is None:
            return None, False
        decision = self.reexec_trigger.decide(facts)
        if decision.kind is None or decision.capped:
            return None, decision.kind is None
        outcome = self.reexecutor.run(finished.step_id, decision.kind, scale=scale, compiled=self.compiled)
        self.losses.take()  # what the re-execution's forward handed the loss tap
        return outcome, False

    # -------------------------------------------------------------- compile
    def _enter_tier(self, tier) -> None:
        """A full-tier step of a compiled model runs eagerly, so that every
        module's hooks fire; compiled steps keep their graphs (a stance
        change neither invalidates nor recompiles them).

        The stance is the whole process's: every compiled function runs
        eagerly while it holds. Where the root's hooks run outside the
        compiled graph (the recorder attached to the compiled module), it
        holds only during the root's forwards (`_register_stance_hooks`),
        so that other compiled code (a compiled loss or optimizer step, an
        EMA or evaluation model, another recorded job) keeps its graphs.
        Attached before compiling, the root's hooks run inside the graph,
        too late to choose it: the stance then holds from the previous
        `step()` to this step's."""
        full = self.compiled and self.eager_full_steps and tier == "full"
        if self._stance_handles:
            self._eager_forwards = full
            return
        if full:
            self._force_eager()

    def _force_eager(self) -> None:
        if self._prior_stance is None:
            from torch._dynamo import eval_frame
            self._prior_stance = eval_frame._set_stance(eval_frame.DynamoStance("force_eager"))

    def _register_stance_hooks(self, model) -> None:
        """The root's forwards of a full-tier step run eagerly: only for a
        model compiled before it was attached whose own hooks run outside
        the graph (an `OptimizedModule`, or a wrapper around one; not
        `module.compile()`, whose hooks are compiled with it)."""
        if not (self.compiled and self.eager_full_steps) or getattr(model, "_compiled_call_impl", None) is not None:
            return

        def enter(module, args):
            if self._eager_forwards:
                self._force_eager()

        def leave(module, args, output):
            self._leave_tier()
        self._stance_handles = [model.register_forward_pre_hook(self._guard(enter, traced=False), prepend=True),
                                model.register_forward_hook(self._guard(leave, traced=False), always_call=True)]

    def _leave_tier(self) -> None:
        if self._prior_stance is None:
            return
        from torch._dynamo import eval_frame
        prior, self._prior_stance = self._prior_stance, None
        eval_frame._set_stance(prior)

    def _note_compiled(self) -> None:
        if not self.compiled:
            return
        info = {"detected": True,
                "compiled_steps": COMPILED_STEPS_RECORD if self.compiled_rows else COMPILED_STEPS_WITHOUT_ROWS,
                "eager_steps": ("full-tier steps run eagerly (torch.compiler.set_stance('force_eager')) "
                                "and carry every row of an eager run, computed with eager rounding"
                                if self.eager_full_steps else "none (eager_full_steps=False)")}
        if self.writer is not None and self.writer.alive:
            self._submit(functools.partial(self.manifest.set_compiled, info))
        else:
            self.manifest.set_compiled(info)

    def _hold_back(self, pending) -> None:
        """A clean step (`_reexecute`) waits for a few more before they go to
        the writer thread as one job: one hand-over (a lock and a wake-up)
        per HOLD_BACK_STEPS steps, at most HOLD_BACK_S late. Any other job
        sends them first (`_submit`), so the writer's order is the steps'."""
        if not self._held_back:
            self._held_back_since = time.monotonic()
        self._held_back.append(pending)
        if len(self._held_back) >= HOLD_BACK_STEPS or time.monotonic() - self._held_back_since >= HOLD_BACK_S:
            self._release_held()

    def _release_held(self) -> None:
        batch, self._held_back = self._held_back, []
        if batch and not self.writer.submit(functools.partial(self._write_steps, batch)):
            self._dropped_steps += len(batch)

    def _submit(self, job) -> None:
        if self._held_back:
            self._release_held()
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
        self._release_held()
        if self.events is not None:
            self.writer.barrier()
            self.events.wait_idle(FLUSH_WAIT_S)
        self.writer.barrier(functools.partial(self._write_files, "open"))
        if self._enabled:
            try:
                self.bundles.apply_decisions()
                self.writer.barrier()
            except Exception as exc:  # noqa: BLE001 - flush() must not stop the training
                self._fail(exc)
        if self.uploader is not None:
            self.uploader.notify()

    def close(self) -> None:
        """Flush, write the final manifest and remove every hook. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._unhook()
        if self.writer is not None and self.writer.alive and self._held_back:
            self._release_held()
        if self.events is not None:
            # The last steps' events reach the callback, and its errors the
            # final manifest.
            if self.writer is not None:
                self.writer.barrier()
            self.events.close()
        if self.writer is not None:
            self.writer.stop(functools.partial(self._write_files, "closed"))
        if self.shards is not None and self.shards.publisher is not None:
            # Every rolled pair on disk (the writer skips its jobs once
            # recording is off: a pair rolled before stays to be written).
            self.shards.publisher.close()
        if self._failure is not None:
            # The writer skips its jobs once recording is off: the final
            # manifest, with the reason, goes to disk from here.
            self._write_disabled(status="closed")
        elif self.status is not None:
            self.status.record(status="closed")
        try:
            if self.bundles is not None:
                self.bundles.close(write_decided=self._failure is None and not self.writer.alive)
        except Exception:
            pass
        if self.uploader is not None and self._uploading:
            self._close_uploads()
        if self.status is not None:
            self.status.close()
        if self.lease is not None:
            self.lease.release()  # last: the spool's uploads are this writer's too

    def _close_uploads(self) -> None:
        """Upload what the spool holds; report (never drop) what the store
        did not take."""
        report = self.uploader.close(self.parts.storage.upload_timeout_s)
        report.spool_full_steps = self.shards.dropped_steps if self.shards is not None else 0
        self.upload_report = report
        if report.pending or report.spool_full_steps:
            lost = (f"; {report.spool_full_steps} step(s) were not recorded because the spool was full"
                    if report.spool_full_steps else "")
            warnings.warn(
                f"amp-postmortem: {len(report.pending)} file(s) of run {report.uri} are not uploaded "
                f"({report.last_error or 'store unavailable'}); they are kept in {report.spool_dir} "
                f"(a recorder on the same run uploads them, or copy them there yourself){lost}",
                RuntimeWarning, stacklevel=3)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # --------------------------------------------------------- writer thread
    def _write_steps(self, batch: list) -> None:
        for pending in batch:
            self._write_step(pending)

    def _write_step(self, pending) -> None:
        self._writing_step = pending.step
        step_row, columns, summary = self.rows.rows(pending)
        self.shards.add_step(step_row, columns)
        self.manifest.note_step(pending.step)
        events = step_events(summary)
        if events:
            self.schedule.note_event(pending.step, events)
        if self.event_detector is not None:
            for event in self.event_detector.observe(summary):
                self.events.post(event)
        self.bundles.on_step_summary(summary)
        if self.reexec_trigger is not None and (summary.get("reexecution") is not None
                                                or self.reexec_trigger.capped):
            self.manifest.note_reexecution(summary.get("reexecution"), self.reexec_trigger.capped)
        graph_autocast = summary.get("graph_autocast")
        if graph_autocast is not None and not (self.manifest.data.get("autocast") or {}).get("enabled"):
            # The root's forward ran in a compiled graph: no eager hook
            # read autocast, the graph's trace did.
            self.manifest.set_autocast(graph_autocast)
            self._journaled_first_step = False  # on disk with this step
        rolled = self.shards.pending_steps == 0
        if not rolled and time.monotonic() - self._last_roll > self.parts.writer.flush_interval_s:
            self.shards.roll()
            rolled = True
        if rolled:
            self._last_roll = time.monotonic()
        if rolled or not self._journaled_first_step:
            # Also after the first step: what its forward taught the
            # manifest (autocast) is on disk for a job killed before its
            # first shard, whose steps are in the journal.
            self._journaled_first_step = True
            self._write_manifest()

    def _write_files(self, status: str) -> None:
        """flush()/close(): the buffered steps as a shard, then the manifest."""
        self.shards.roll()
        self.shards.wait_published()
        self.manifest.set_recording(status=status)
        self._write_manifest()

    def _write_manifest(self) -> None:
        self.manifest.set_recording(dropped_steps=self._dropped_steps, failure=self._failure)
        self._note_events()
        if "storage" in self.manifest.data:
            self.manifest.data["storage"]["spool_dropped_steps"] = self.shards.dropped_steps
        self.manifest.write()

    def _note_events(self) -> None:
        if self.events is not None:
            self.manifest.data["events"] = self.events.report()

    def _bundles_changed(self, saved: list, missed: list) -> None:
        self.manifest.set_bundles(saved, missed)
        self.manifest.write()


def probe_targets(probe, modules: list, watched: list) -> tuple[list, list]:
    """The modules an op probe hooks: (those its patterns name, probed on
    every recorded step; the watched modules without children, probed on
    full-tier steps when `full_tier_leaves`). A pattern that names no module
    is warned about: a typo would otherwise probe nothing, silently."""
    if probe is None:
        return [], []
    probed = [name for name, _ in modules if any(fnmatch.fnmatchcase(name, p) for p in probe.modules)]
    unmatched = [p for p in probe.modules if not any(fnmatch.fnmatchcase(name, p) for name, _ in modules)]
    if unmatched:
        warnings.warn(f"amp-postmortem: probe pattern(s) {', '.join(map(repr, unmatched))} name no module "
                      f"of the model (names as named_modules() gives them)", RuntimeWarning, stacklevel=4)
    leaves = []
    if probe.full_tier_leaves:
        watched = set(watched)
        leaves = [name for name, m in modules if name in watched and next(m.children(), None) is None]
    return probed, leaves


class _GuardedCall:
    """A traced hook under the recorder's guard: `fn(a, b, *args)`,
    returning None. The same checks as `AmpRecorder._guard`'s wrapper,
    which stays a function for the long-lived hooks (`torch.compiler.disable`
    wraps some of them); this one is for the hooks made per step."""

    __slots__ = ("rec", "fn", "a", "b")

    def __init__(self, rec, fn, a, b):
        self.rec = rec
        self.fn = fn
        self.a = a
        self.b = b

    def __call__(self, *args):
        if torch.compiler.is_compiling() or not self.rec._enabled:
            return None
        try:
            self.fn(self.a, self.b, *args)
        except Exception as exc:  # noqa: BLE001 - the training must go on
            self.rec._fail(exc)
        return None
