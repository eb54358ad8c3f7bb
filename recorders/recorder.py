"""AmpRecorder: the black-box recorder that rides along with a training job.

Lifecycle: construct (hooks registered, manifest written), `step()` once per
optimizer step, `flush()` (blocks until everything so far is on disk),
`close()` (idempotent; flushes and removes every hook). Also a context manager.

The training path only enqueues device work: each hook computes a small
statistics vector on the tensor's device and appends it to a list; `step()`
stacks the step's vectors into one tensor and starts one asynchronous copy to
the host. Conversion, Parquet and every decision taken on values happen on
the writer thread, one step (or more) late.
"""
from __future__ import annotations

import fnmatch
import math
import os
import queue
import threading
import time
import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from . import schema
from .bundle import BundleCapture
from .hooks import RecorderHooks, _StepState
from .manifest import ManifestMixin, _dist_rank_world, _existing_run_id, _json_float
from .stats import CHEAP_WIDTH, FULL_WIDTH
from .step_rows import StepRowsMixin
from .storage import DEFAULT_SPOOL_MAX_BYTES, DEFAULT_UPLOAD_TIMEOUT_S, open_run_location
from .writer import ShardWriter


class _PendingStep:
    __slots__ = ("step", "wall_time", "tier", "micro_batches", "lr", "meta", "width",
                 "packed", "event", "host_scalars", "dev_scalar_keys", "stepped", "has_scaler")


class AmpRecorder(RecorderHooks, ManifestMixin, StepRowsMixin):
    """Record per-step scalars and per-layer statistics of a training job.

    >>> rec = AmpRecorder("runs/exp1", model, optimizer=opt, scaler=scaler)
    >>> ...   # training loop; after scaler.update() / optimizer.step():
    >>> rec.step(loss)
    >>> rec.close()
    """

    def __init__(self, run_dir, model: torch.nn.Module, optimizer=None, scaler=None, *,
                 include=("*",), exclude=(), cheap_every: int = 1, full_every: int = 100,
                 full_after_event: int = 20, steps_per_shard: int = 1000,
                 flush_interval_s: float = 60.0, near_overflow: float = schema.FP16_MAX,
                 rank: int | None = None, world_size: int | None = None,
                 run_id: str | None = None, max_queue: int = 256, spool_dir=None,
                 spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES,
                 upload_timeout_s: float = DEFAULT_UPLOAD_TIMEOUT_S, **bundle_options):
        # `run_dir` may be a URI (s3://, gs://, abfs://, hdfs://, ...): the
        # files are then written to a local spool of at most
        # `spool_max_bytes` (under `spool_dir`, default
        # $AMP_POSTMORTEM_SPOOL_DIR or the temp directory) and uploaded by a
        # background thread; close() waits up to `upload_timeout_s` for it.
        self.run_location = str(run_dir)
        self.upload_timeout_s = float(upload_timeout_s)
        self.upload_report = None  # storage.UploadReport after close() of a remote run
        self._uploader = None
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.include = tuple([include] if isinstance(include, str) else include)
        self.exclude = tuple([exclude] if isinstance(exclude, str) else exclude)
        self.cheap_every = max(1, int(cheap_every))
        self.full_every = int(full_every)
        self.full_after_event = int(full_after_event)
        self.near_overflow = float(near_overflow)
        self.flush_interval_s = float(flush_interval_s)
        self.steps_per_shard = max(1, int(steps_per_shard))
        if rank is None or world_size is None:
            dist_rank, dist_world = _dist_rank_world()
            rank = dist_rank if rank is None else rank
            world_size = dist_world if world_size is None else world_size
        self.rank = int(rank)
        self.world_size = int(world_size)
        location_error = None
        try:
            self.run_dir, self._uploader = open_run_location(run_dir, self.rank, spool_dir=spool_dir,
                                                             spool_max_bytes=spool_max_bytes)
        except (OSError, ValueError) as exc:  # a bad URI, a missing extra: reported below
            self.run_dir, location_error = Path(os.devnull) / "amp-postmortem", exc
        self.run_id = (run_id or os.environ.get("AMP_POSTMORTEM_RUN_ID")
                       or _existing_run_id(self.run_dir, rank) or uuid.uuid4().hex)
        self.rank_dir = self.run_dir / schema.RANK_DIR.format(rank=self.rank)

        self._enabled = True
        self._closed = False
        self._failure: BaseException | None = None
        self._warned = False
        self._hooks: list = []
        self._step_counter = 0
        self._next_step_id = 0
        self._full_until = -1  # set by the writer thread after an event
        self._dropped_steps = 0
        self._paused = 0
        self._autocast = None
        self._lock = threading.Lock()

        self._module_names = {}
        self._watched: list[str] = []
        for name, module in model.named_modules():
            if module in self._module_names:
                continue  # a module registered twice keeps its first name
            self._module_names[module] = name
            if name == "" or self._matches(name):
                self._watched.append(name)
        self._params = [(n, p) for n, p in model.named_parameters()]

        self.bundles = BundleCapture(self, **bundle_options)  # a bad option raises here
        self._manifest = self._initial_manifest()
        self._scale_before = self._initial_scale()
        self._state = self._new_state()
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._writer_loop, name="amp-postmortem-writer", daemon=True)
        up = self._uploader
        self._writer = ShardWriter(self.rank_dir, run_id=self.run_id, rank=self.rank,
                                   world_size=self.world_size, steps_per_shard=self.steps_per_shard,
                                   first_index=up.next_shard_index(self.rank) if up else 0,
                                   has_room=up.has_room if up else None)
        if up is not None:
            self._manifest["storage"] = {"uri": self.run_location, "spool_dropped_steps": 0}
        try:
            if location_error is not None:
                raise location_error
            self._write_manifest()
        except (OSError, ValueError) as exc:
            # An unwritable run directory must not stop the job it watches:
            # no hooks, no thread, one warning; step() and close() are no-ops.
            self._fail(exc)
            return
        self._thread.start()
        if self._uploader is not None:
            self._uploader.start()
        self._register_hooks()

    # ------------------------------------------------------------------ setup
    def _matches(self, name: str) -> bool:
        if not any(fnmatch.fnmatchcase(name, p) for p in self.include):
            return False
        return not any(fnmatch.fnmatchcase(name, p) for p in self.exclude)

    def _scaler_enabled(self) -> bool:
        s = self.scaler
        return s is not None and (s.is_enabled() if hasattr(s, "is_enabled") else True)

    def _initial_scale(self):
        if not self._scaler_enabled():
            return None
        scale = getattr(self.scaler, "_scale", None)
        if isinstance(scale, torch.Tensor):
            return scale.detach().clone()
        return float(getattr(self.scaler, "_init_scale", math.nan))

    # ------------------------------------------------------------ guard/fail
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

    def _remove_hooks(self) -> None:
        # Never called from inside a hook: removing forward hooks while
        # torch iterates over them would break the user's forward pass.
        for h in self._hooks:
            try:
                h.remove()
            except Exception:
                pass
        self._hooks = []

    @property
    def enabled(self) -> bool:
        return self._enabled

    # ---------------------------------------------------------------- state
    def _tier(self, step_id: int) -> tuple[bool, bool]:
        record = step_id % self.cheap_every == 0
        full = (self.full_every > 0 and step_id % self.full_every == 0) or step_id <= self._full_until
        return record or full, full

    def _new_state(self) -> _StepState:
        record, full = self._tier(self._next_step_id)
        return _StepState(self._next_step_id, record, full)

    # --------------------------------------------------------------- public
    def step(self, loss=None, step: int | None = None) -> None:
        """Close the current optimizer step. Call once per optimizer step,
        after `scaler.update()` (or `optimizer.step()` without a scaler)."""
        if self._closed:
            return
        if not self._enabled:
            self._after_failure()
            return
        try:
            self._step(loss, step)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
            self._after_failure()

    def _step(self, loss, step):
        st = self._state
        step_id = self._step_counter if step is None else int(step)
        for ctx in st.contexts:
            for input_idx in list(ctx.pending):
                self._finish_grad_input(st, ctx, input_idx)
        for pname, (order, s, sq, g) in st.param_grads.items():
            self._add_row(st, pname, "param_grad", "backward", order, 0, g, s)
        loss_t = loss.detach() if isinstance(loss, torch.Tensor) else None
        if st.record and loss_t is not None and loss_t.numel():
            s = self._stats(st, loss_t.float())
            self._add_row(st, schema.LOSS_NAME, "loss", "forward", st.fwd_order, 0, loss_t, s)
            st.fwd_order += 1
        for pname, info, s in st.param_values:
            self._add_row(st, pname, "param", "forward", st.fwd_order, 0, info, s)
            st.fwd_order += 1

        p = _PendingStep()
        p.step = step_id
        p.wall_time = time.time()
        p.tier = "full" if st.full else "cheap"
        p.micro_batches = st.micro_batches
        p.lr = None
        if self.optimizer is not None:
            p.lr = [_json_float(g.get("lr")) for g in self.optimizer.param_groups]
        p.meta = st.meta
        p.width = FULL_WIDTH if st.full else CHEAP_WIDTH
        p.stepped = st.stepped if self.optimizer is not None else None
        p.has_scaler = self._scaler_enabled()
        host, dev, keys = {}, [], []

        def put(key, value):
            if isinstance(value, torch.Tensor):
                dev.append(value.detach().reshape(()).to(torch.float64))
                keys.append(key)
            else:
                host[key] = math.nan if value is None else float(value)

        if loss_t is not None and loss_t.numel() == 1:
            put("loss", loss_t)
        elif isinstance(loss, (int, float)):
            put("loss", loss)
        else:
            host["loss"] = None  # no loss given: null, never a fake NaN loss
        if p.has_scaler:
            put("loss_scale_before", self._scale_before)
            scale = getattr(self.scaler, "_scale", None)
            put("loss_scale", scale if isinstance(scale, torch.Tensor) else getattr(self.scaler, "_init_scale", None))
            tracker = getattr(self.scaler, "_growth_tracker", None)
            put("growth_tracker", tracker if isinstance(tracker, torch.Tensor) else None)
            # The scale the next step's backward uses; cloned because
            # GradScaler.update() changes it in place.
            self._scale_before = scale.detach().clone() if isinstance(scale, torch.Tensor) else self._scale_before
        if st.grad_sqsum is not None:
            put("grad_sqsum", st.grad_sqsum)
        elif st.param_grads and all(v[2] is not None for v in st.param_grads.values()):
            put("grad_sqsum", torch.stack([v[2] for v in st.param_grads.values()]).sum())

        device = st.device or (dev[0].device if dev else torch.device("cpu"))
        flat = [torch.stack(st.stats).reshape(-1)] if st.stats else []
        flat += [d.to(device).reshape(1) for d in dev]
        p.host_scalars = host
        p.dev_scalar_keys = keys
        p.event = None
        if flat:
            packed = torch.cat(flat) if len(flat) > 1 else flat[0]
            if packed.device.type == "cuda":
                # One asynchronous copy per step; the writer thread waits on
                # the event, never the training thread.
                p.packed = packed.to("cpu", non_blocking=True)
                p.event = torch.cuda.Event()
                p.event.record()
            elif packed.device.type == "cpu":
                p.packed = packed
            else:
                p.packed = packed.to("cpu", non_blocking=True)
        else:
            p.packed = None
        self.bundles.on_step_end(step_id, loss=loss_t if loss_t is not None else loss, stepped=p.stepped)
        self._submit(p)

        self._step_counter = step_id + 1
        self._next_step_id = step_id + 1
        self._state = self._new_state()

    def _submit(self, item) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            # Never make the training wait for the disk: drop and count.
            self._dropped_steps += 1

    def save_bundle(self) -> None:
        """Ask for a replay bundle of the current step."""
        if self._enabled:
            try:
                self.bundles.request()
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)

    @contextmanager
    def paused(self):
        """Forward/backward passes inside are not recorded (e.g. an eval pass
        with gradients enabled)."""
        self._paused += 1
        try:
            yield self
        finally:
            self._paused -= 1

    def flush(self) -> None:
        """Block until every step so far is written to disk."""
        if self._closed or not self._thread.is_alive():
            return
        done = threading.Event()
        self._queue.put(("flush", done))
        done.wait()
        if self._enabled:
            self.bundles.flush()
        if self._uploader is not None:
            self._uploader.notify()

    def close(self) -> None:
        """Flush, write the final manifest and remove every hook. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._remove_hooks()
        if self._thread.is_alive():
            done = threading.Event()
            self._queue.put(("close", done))
            done.wait()
            self._thread.join(timeout=60)
        try:
            self.bundles.close()
        except Exception:
            pass
        if self._uploader is not None:
            self._close_uploads()

    def _close_uploads(self) -> None:
        """Upload what the spool holds; report (never drop) what the store
        did not take."""
        report = self._uploader.close(self.upload_timeout_s)
        report.spool_full_steps = self._writer.dropped_steps
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

    def _after_failure(self):
        if self._hooks:
            self._remove_hooks()

    # --------------------------------------------------------- writer thread
    def _writer_loop(self) -> None:
        last_roll = time.monotonic()
        while True:
            item = self._queue.get()
            try:
                if isinstance(item, tuple) and item[0] in ("flush", "close"):
                    if self._failure is None:
                        self._writer.roll()
                        self._manifest["status"] = "closed" if item[0] == "close" else "open"
                        self._finish_manifest()
                    item[1].set()
                    if item[0] == "close":
                        return
                    continue
                if self._failure is not None:
                    continue
                if callable(item):
                    item()
                    continue
                self._write_step(item)
                rolled = self._writer.pending_steps == 0
                if not rolled and time.monotonic() - last_roll > self.flush_interval_s:
                    self._writer.roll()
                    rolled = True
                if rolled:
                    last_roll = time.monotonic()
                    self._finish_manifest()
            except Exception as exc:  # noqa: BLE001 - disk full, bad value, ...
                self._fail(exc)
                if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], threading.Event):
                    item[1].set()
                    if item[0] == "close":
                        return

    def _finish_manifest(self):
        self._manifest["dropped_steps"] = self._dropped_steps
        if "storage" in self._manifest:
            self._manifest["storage"]["spool_dropped_steps"] = self._writer.dropped_steps
        if self._failure is not None:
            self._manifest["disabled_reason"] = f"{type(self._failure).__name__}: {self._failure}"
        self._write_manifest()
