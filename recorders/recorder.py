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
import weakref
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from . import schema
from .aggregate import merge_rows
from .bundle import BundleCapture
from .stats import CHEAP_WIDTH, FULL_WIDTH, iter_tensors, is_float_tensor, nonfinite_count, tensor_stats
from .writer import ShardWriter, atomic_write_json

try:
    from importlib.metadata import version as _dist_version
    PACKAGE_VERSION = _dist_version("amp-postmortem")
except Exception:  # not installed (running from a source tree)
    PACKAGE_VERSION = "0+unknown"

_SCALAR_KEYS = ("loss", "loss_scale_before", "loss_scale", "growth_tracker", "grad_sqsum")


class _CallContext:
    """One forward call of a watched module, kept alive by its backward hooks."""

    __slots__ = ("name", "call", "input_nonfinite", "grad_out_nonfinite", "pending",
                 "is_root", "micro_batch", "step_id")

    def __init__(self, name, call, input_nonfinite, is_root, micro_batch, step_id):
        self.name = name
        self.call = call
        self.input_nonfinite = input_nonfinite
        self.grad_out_nonfinite = None
        self.pending = {}  # input index -> [expected, arrived, parts, dtype]
        self.is_root = is_root
        self.micro_batch = micro_batch
        self.step_id = step_id


class _StepState:
    def __init__(self, step_id: int, record: bool, full: bool):
        self.step_id = step_id
        self.record = record
        self.full = full
        self.micro_batches = 0
        self.meta: list[tuple] = []
        self.stats: list[torch.Tensor] = []
        self.fwd_order = 0
        self.bwd_order = 0
        self.calls: dict[str, int] = {}
        self.stacks: dict[str, list[_CallContext]] = {}
        self.param_grads: dict[str, list] = {}  # name -> [order, stats, sqnorm, dtype, numel]
        self.contexts: list[_CallContext] = []
        self.nonfinite_cache: dict[int, tuple] = {}
        self.stepped = False
        self.param_values: list[tuple] = []
        self.inv_scale_for = None
        self.device = None


class _TensorInfo:
    """dtype and numel of a tensor, without keeping the tensor alive."""

    __slots__ = ("dtype", "_numel")

    def __init__(self, t):
        self.dtype = t.dtype
        self._numel = t.numel()

    def numel(self):
        return self._numel


class _PendingStep:
    __slots__ = ("step", "wall_time", "tier", "micro_batches", "lr", "meta", "width",
                 "packed", "event", "host_scalars", "dev_scalar_keys", "stepped", "has_scaler")


class AmpRecorder:
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
                 run_id: str | None = None, max_queue: int = 256, **bundle_options):
        self.run_dir = Path(run_dir)
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
        if rank is None or world_size is None:
            dist_rank, dist_world = _dist_rank_world()
            rank = dist_rank if rank is None else rank
            world_size = dist_world if world_size is None else world_size
        self.rank = int(rank)
        self.world_size = int(world_size)
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

        self.bundles = BundleCapture(self, **bundle_options)
        self._manifest = self._initial_manifest()
        self._writer = ShardWriter(self.rank_dir, run_id=self.run_id, rank=self.rank,
                                   world_size=self.world_size, steps_per_shard=steps_per_shard)
        self._write_manifest()

        self._scale_before = self._initial_scale()
        self._state = self._new_state()
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._writer_loop, name="amp-postmortem-writer", daemon=True)
        self._thread.start()
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

    def _scaler_config(self):
        if self.scaler is None:
            return None
        s = self.scaler
        return {
            "class": f"{type(s).__module__}.{type(s).__qualname__}",
            "enabled": self._scaler_enabled(),
            "init_scale": _json_float(getattr(s, "_init_scale", None)),
            "growth_factor": _json_float(getattr(s, "_growth_factor", None)),
            "backoff_factor": _json_float(getattr(s, "_backoff_factor", None)),
            "growth_interval": getattr(s, "_growth_interval", None),
        }

    def _initial_manifest(self) -> dict:
        modules = [{"name": n, "type": f"{type(m).__module__}.{type(m).__qualname__}",
                    "watched": n in set(self._watched)} for m, n in self._module_names.items()]
        device = next((p.device for _, p in self._params), torch.device("cpu"))
        opt = None
        if self.optimizer is not None:
            opt = {"class": f"{type(self.optimizer).__module__}.{type(self.optimizer).__qualname__}",
                   "defaults": _jsonable(getattr(self.optimizer, "defaults", {}))}
        return {
            "format": schema.FORMAT_NAME,
            "schema_version": schema.SCHEMA_VERSION,
            "run_id": self.run_id,
            "created_at": time.time(),
            "package_version": PACKAGE_VERSION,
            "torch_version": torch.__version__,
            "rank": self.rank,
            "world_size": self.world_size,
            "device_type": device.type,
            "device_name": _device_name(device),
            "model_class": f"{type(self.model).__module__}.{type(self.model).__qualname__}",
            "autocast": None,
            "scaler": self._scaler_config(),
            "optimizer": opt,
            "recorder": {
                "include": list(self.include), "exclude": list(self.exclude),
                "cheap_every": self.cheap_every, "full_every": self.full_every,
                "full_after_event": self.full_after_event,
                "steps_per_shard": self._writer_steps_per_shard() if hasattr(self, "_writer") else None,
                "near_overflow": self.near_overflow,
                "bundles": _jsonable(self.bundles.config),
            },
            "modules": modules,
            "params": [{"name": n, "shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", ""),
                        "requires_grad": bool(p.requires_grad)} for n, p in self._params],
            "bundles": [],
            "status": "open",
            "steps_recorded": 0,
            "first_step": None,
            "last_step": None,
            "dropped_steps": 0,
            "disabled_reason": None,
        }

    def _writer_steps_per_shard(self):
        return self._writer.steps_per_shard

    def _write_manifest(self) -> None:
        self._manifest["recorder"]["steps_per_shard"] = self._writer.steps_per_shard
        self._manifest["bundles"] = list(self.bundles.saved)
        atomic_write_json(self.rank_dir / schema.MANIFEST_FILE, self._manifest)
        if self.rank == 0:
            atomic_write_json(self.run_dir / schema.MANIFEST_FILE, self._manifest)

    def _register_hooks(self) -> None:
        by_name = dict(self.model.named_modules())
        self._hooks.append(self.model.register_forward_pre_hook(
            self._guard(self._on_root_pre), with_kwargs=True, prepend=True))
        for name in self._watched:
            m = by_name[name]
            self._hooks.append(m.register_forward_pre_hook(self._guard(self._make_pre(name)), with_kwargs=True))
            self._hooks.append(m.register_forward_hook(self._guard(self._make_post(name)), with_kwargs=True))
        for pname, p in self._params:
            if p.requires_grad and self._param_watched(pname):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._guard(self._make_param_hook(pname))))
        if self.optimizer is not None and hasattr(self.optimizer, "register_step_pre_hook"):
            self._hooks.append(self.optimizer.register_step_pre_hook(self._guard(self._on_opt_pre)))
            self._hooks.append(self.optimizer.register_step_post_hook(self._guard(self._on_opt_post)))

    def _param_watched(self, pname: str) -> bool:
        owner = pname.rpartition(".")[0]
        return owner in set(self._watched) or self._matches(pname)

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

    def _active(self) -> _StepState | None:
        st = self._state
        if self._paused or not st.record or not torch.is_grad_enabled():
            return None
        return st

    def _add_row(self, st, name, kind, phase, order, call, t, stats):
        st.meta.append((name, kind, phase, order, call, str(t.dtype).replace("torch.", ""), t.numel()))
        st.stats.append(stats)
        if st.device is None:
            st.device = stats.device

    def _stats(self, st, t, **kw):
        return tensor_stats(t, full=st.full, near_overflow=self.near_overflow, **kw)

    def _input_nonfinite(self, st, tensors):
        total = None
        for t in tensors:
            cached = st.nonfinite_cache.get(id(t))
            if cached is not None and cached[0]() is t:
                c = cached[1]
            else:
                c = nonfinite_count(t)
            total = c if total is None else total + c
        return total

    def _remember_nonfinite(self, st, t, stats):
        try:
            st.nonfinite_cache[id(t)] = (weakref.ref(t), stats[1] + stats[2])
        except TypeError:
            pass

    def _scale_tensor(self):
        if not self._scaler_enabled():
            return None
        s = getattr(self.scaler, "_scale", None)
        return s if isinstance(s, torch.Tensor) else None

    # ---------------------------------------------------------------- hooks
    def _on_root_pre(self, module, args, kwargs):
        st = self._active()
        if st is None:
            return
        st.micro_batches += 1
        st.fwd_order = 0
        st.bwd_order = 0
        st.calls = {}
        st.nonfinite_cache = {}
        if self._autocast is None:
            self._note_autocast()
        tensors = [t for t in iter_tensors((args, kwargs)) if is_float_tensor(t)]
        if st.micro_batches == 1 and st.full:
            # Values as this forward sees them; their rows are placed after
            # the loss at step end so module orders match cheap-tier steps.
            st.param_values = [(pname, _TensorInfo(p), self._stats(st, p))
                               for pname, p in self._params if p.numel()]
        if tensors:
            for t in tensors:
                s = self._stats(st, t)
                self._add_row(st, schema.INPUT_NAME, "input", "forward", st.fwd_order, 0, t, s)
                self._remember_nonfinite(st, t, s)
            st.fwd_order += 1
        self.bundles.on_micro_batch_start(st.step_id, st.micro_batches - 1, args, kwargs)

    def _note_autocast(self):
        info = {"enabled": False, "device_type": None, "dtype": None}
        for dev in ("cuda", "cpu", "xpu", "mps"):
            try:
                if torch.is_autocast_enabled(dev):
                    info = {"enabled": True, "device_type": dev,
                            "dtype": str(torch.get_autocast_dtype(dev)).replace("torch.", "")}
                    break
            except (RuntimeError, TypeError, AttributeError):
                continue
        info["cache_enabled"] = torch.is_autocast_cache_enabled()
        self._autocast = info
        self._submit(lambda: self._manifest.__setitem__("autocast", info))

    def _make_pre(self, name):
        def pre(module, args, kwargs):
            st = self._active()
            if st is None:
                return
            call = st.calls.get(name, 0)
            st.calls[name] = call + 1
            tensors = [t for t in iter_tensors((args, kwargs)) if is_float_tensor(t)]
            inp = self._input_nonfinite(st, tensors) if tensors else None
            ctx = _CallContext(name, call, inp, name == "", st.micro_batches - 1, st.step_id)
            # Inputs whose gradient this module's backward produces: the
            # autograd edges (grad_fn, output_nr) that point at them.
            keys = {}
            for i, t in enumerate(tensors):
                if t.requires_grad and t.grad_fn is not None:
                    keys.setdefault((t.grad_fn, t.output_nr), i)
            st.stacks.setdefault(name, []).append((ctx, keys))
        return pre

    def _make_post(self, name):
        def post(module, args, kwargs, output):
            st = self._active()
            if st is None:
                return
            stack = st.stacks.get(name)
            if not stack:
                return
            ctx, keys = stack.pop()
            outs = [t for t in iter_tensors(output) if is_float_tensor(t)]
            order = st.fwd_order
            st.fwd_order += 1
            for t in outs:
                s = self._stats(st, t, input_nonfinite=ctx.input_nonfinite)
                self._add_row(st, name, "activation", "forward", order, ctx.call, t, s)
                self._remember_nonfinite(st, t, s)
            grad_outs = [t for t in outs if t.requires_grad]
            for idx, t in enumerate(grad_outs):
                t.register_hook(self._guard(self._make_grad_output_hook(ctx, idx)))
            if ctx.is_root:
                self.bundles.on_model_outputs(ctx.micro_batch, len(grad_outs))
            if keys and grad_outs:
                self._hook_grad_inputs(ctx, keys, grad_outs)
            st.contexts.append(ctx)
        return post

    def _hook_grad_inputs(self, ctx, keys, outs):
        """Hook the autograd nodes inside the module that hand gradients to
        its inputs. `register_full_backward_hook` would insert identity nodes
        and change the order gradient contributions are summed in, hence the
        training's bits; node hooks observe without reshaping the graph."""
        boundary = max(g._sequence_nr() for g, _ in keys)
        edges: dict = {}
        seen = set()
        todo = [t.grad_fn for t in outs if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            for slot, (nxt, nr) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                key = (nxt, nr)
                if key in keys:
                    edges.setdefault(node, []).append((slot, keys[key]))
                    continue
                if type(nxt).__name__ == "AccumulateGrad" or nxt in seen:
                    continue
                # Nodes created before the module's inputs belong to the
                # model around it, not to this module.
                if nxt._sequence_nr() <= boundary:
                    continue
                todo.append(nxt)
        for node, slots in edges.items():
            for _, input_idx in slots:
                acc = ctx.pending.setdefault(input_idx, [0, 0, [], None])
                acc[0] += 1
            node.register_hook(self._guard(self._make_node_hook(ctx, slots)))

    def _make_grad_output_hook(self, ctx, idx):
        def hook(grad):
            st = self._state
            if st.step_id != ctx.step_id or grad is None or not st.record:
                return
            s = self._stats(st, grad)
            self._add_row(st, ctx.name, "grad_output", "backward", st.bwd_order, ctx.call, grad, s)
            st.bwd_order += 1
            nf = s[1] + s[2]
            ctx.grad_out_nonfinite = nf if ctx.grad_out_nonfinite is None else ctx.grad_out_nonfinite + nf
            if ctx.is_root:
                self.bundles.on_model_output_grad(ctx.micro_batch, idx, grad)
        return hook

    def _make_node_hook(self, ctx, slots):
        def hook(grad_inputs, grad_outputs):
            st = self._state
            if st.step_id != ctx.step_id:
                return
            for slot, input_idx in slots:
                acc = ctx.pending.get(input_idx)
                if acc is None:
                    continue
                acc[1] += 1
                g = grad_inputs[slot] if slot < len(grad_inputs) else None
                if g is not None:
                    acc[2].append(g)
                if acc[1] >= acc[0]:
                    self._finish_grad_input(st, ctx, input_idx)
        return hook

    def _finish_grad_input(self, st, ctx, input_idx):
        acc = ctx.pending.pop(input_idx, None)
        if not acc or not acc[2]:
            return
        parts = acc[2]
        # Sum in the gradient's own dtype, in arrival order, as autograd's
        # input buffer does: an fp16 overflow can be born in this sum.
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        s = self._stats(st, total, input_nonfinite=ctx.grad_out_nonfinite)
        self._add_row(st, ctx.name, "grad_input", "backward", st.bwd_order, ctx.call, total, s)
        st.bwd_order += 1

    def _make_param_hook(self, pname):
        def hook(p):
            # Backward runs with grad mode off: check the step, not grad mode.
            st = self._state
            if self._paused or not st.record or p.grad is None:
                return
            g = p.grad
            scale = self._scale_tensor()
            s = self._stats(st, g, scale=scale, unscale=scale is not None)
            sq = torch.linalg.vector_norm(g.detach(), dtype=torch.float64) ** 2
            if scale is not None:
                sq = sq / scale.to(torch.float64) ** 2
            slot = st.param_grads.get(pname)
            # Keep the statistics, not the gradient: `zero_grad()` must be
            # able to free it before `rec.step()`.
            shape = _TensorInfo(g)
            if slot is None:
                st.param_grads[pname] = [st.bwd_order, s, sq, shape]
                st.bwd_order += 1
            else:  # gradient accumulation: the last accumulated value wins
                slot[1], slot[2], slot[3] = s, sq, shape
        return hook

    def _on_opt_pre(self, optimizer, args, kwargs):
        self._state.stepped = True
        self.bundles.on_optimizer_pre_step()

    def _on_opt_post(self, optimizer, args, kwargs):
        pass

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
        if st.param_grads:
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
        if self._failure is not None:
            self._manifest["disabled_reason"] = f"{type(self._failure).__name__}: {self._failure}"
        self._write_manifest()

    def _write_step(self, p: _PendingStep) -> None:
        if p.event is not None:
            p.event.synchronize()
        values = p.packed.numpy() if p.packed is not None else np.empty(0)
        n = len(p.meta)
        rows = values[: n * p.width].reshape(n, p.width) if n else np.empty((0, p.width))
        scalars = dict(p.host_scalars)
        for i, k in enumerate(p.dev_scalar_keys):
            scalars[k] = float(values[n * p.width + i])
        cols = merge_rows(p.meta, rows) if n else None

        skipped = False
        before, after = scalars.get("loss_scale_before"), scalars.get("loss_scale")
        if p.has_scaler:
            backoff = (self._manifest.get("scaler") or {}).get("backoff_factor") or 0.5
            if before is not None and after is not None and backoff < 1 and not math.isnan(before):
                # GradScaler backs off exactly when it found Inf/NaN, i.e.
                # when it skipped optimizer.step(); it never shrinks otherwise.
                skipped = after < before
            elif p.stepped is not None:
                skipped = not p.stepped
        elif p.stepped is not None:
            skipped = not p.stepped and p.micro_batches > 0

        nonfinite_params = 0
        nonfinite_rows = 0
        if cols is not None:
            g = len(cols["name"])
            cols["step"] = np.full(g, p.step, dtype=np.int64)
            cols["rank"] = np.full(g, self.rank, dtype=np.int32)
            bad = (cols["nan_count"] > 0) | (cols["inf_count"] > 0)
            nonfinite_rows = int(bad.sum())
            kinds = np.array(cols["kind"], dtype=object)
            nonfinite_params = int((bad & (kinds == "param_grad")).sum())
        sq = scalars.get("grad_sqsum")
        step_row = {
            "step": p.step,
            "rank": self.rank,
            "wall_time": p.wall_time,
            "loss": scalars.get("loss"),
            "loss_scale": after if p.has_scaler else None,
            "loss_scale_before": before if p.has_scaler else None,
            "growth_tracker": int(scalars["growth_tracker"]) if p.has_scaler and not math.isnan(scalars.get("growth_tracker", math.nan)) else None,
            "skipped": bool(skipped),
            "lr": p.lr,
            "grad_norm": math.sqrt(sq) if sq is not None and not (sq < 0) else None,
            "nonfinite_param_grads": nonfinite_params if cols is not None else None,
            "micro_batches": p.micro_batches,
            "tier": p.tier,
            "tensor_rows": len(cols["name"]) if cols is not None else 0,
        }
        self._writer.add_step(step_row, cols)
        m = self._manifest
        m["steps_recorded"] += 1
        m["first_step"] = p.step if m["first_step"] is None else min(m["first_step"], p.step)
        m["last_step"] = p.step if m["last_step"] is None else max(m["last_step"], p.step)
        loss = scalars.get("loss")
        event = skipped or nonfinite_rows > 0 or (loss is not None and not math.isfinite(loss))
        if event and self.full_after_event > 0:
            # Read by the training thread as a plain int: detail for the
            # next steps without any synchronisation.
            self._full_until = max(self._full_until, p.step + self.full_after_event)
        self.bundles.on_step_summary({
            "step": p.step, "skipped": bool(skipped), "loss": loss,
            "loss_scale": after, "loss_scale_before": before,
            "growth_tracker": step_row["growth_tracker"],
            "nonfinite_rows": nonfinite_rows, "columns": cols,
        })


def _existing_run_id(run_dir: Path, rank: int) -> str | None:
    """A job resumed into its old run directory continues that run: same
    run_id, shard numbering continued, so readers see one run."""
    import json
    for path in (run_dir / schema.RANK_DIR.format(rank=rank) / schema.MANIFEST_FILE,
                 run_dir / schema.MANIFEST_FILE):
        try:
            return json.loads(path.read_text())["run_id"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def _dist_rank_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return 0, 1


def _device_name(device: torch.device) -> str:
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_name(device)
    except Exception:
        pass
    import platform
    return platform.processor() or platform.machine() or device.type


def _json_float(v):
    if isinstance(v, torch.Tensor):
        return float(v.item()) if v.numel() == 1 and v.device.type == "cpu" else None
    if isinstance(v, (int, float)):
        return float(v)
    return None


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, bool)) or obj is None:
        return obj
    if isinstance(obj, (int, float)):
        return obj
    if isinstance(obj, torch.Tensor) and obj.numel() == 1 and obj.device.type == "cpu":
        return obj.item()
    return repr(obj)
