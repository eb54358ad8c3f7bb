"""The counterfactual window: what re-running the last steps needs.

`BundlePolicy(window_steps=K)`. Owned by `BundleCapture`, which calls it
from its own hooks (training thread) only when K > 0:

- a step's first forward (`on_step_start`): while no trigger has fired, a
  window older than K steps restarts here: the weights, buffers, optimizer
  state tensors and the scaler's scale and growth tracker are copied into
  preallocated device-side sets (`torch._foreach_copy_`, no host sync), and
  the steps held so far are let go. A restart waits (up to 2K steps) until
  the writer thread has decided every earlier step, so that a trigger is
  never lost to a restart;
- every micro-batch (`on_micro_batch`): references to its inputs (the same
  objects the bundle capture holds) and its RNG states;
- optimizer pre-step (`on_pre_step`): the hyperparameters this step used;
- the loss's calls (`BundlePolicy(loss_fn=...)`, `loss_call.LossTap`): the
  call of each micro-batch, its targets held by reference as the inputs are
  and the prediction replaced by its place, shape and dtype;
- a decision (`on_decision`): a window event (`triggers.WINDOW_EVENTS`: the
  first non-finite loss, the first forward NaN/Inf, a scale collapse's
  onset, the first step that lost most of its updates to rounding, a
  request; never one isolated skip) at a step inside the window
  freezes it: it runs on for K more steps and is then handed to the writer
  thread (`write_window`); a new window then rolls from the next step, for
  the next event, while the byte budget lasts.

Bytes are bounded by `max_window_bytes`, for what one window holds and the
windows written together; the writer copies to the host and writes the
directory (`directory.write_bundle`, Parquet, no pickle).
"""
from __future__ import annotations

import functools
import time
import warnings
from pathlib import Path

import torch

from ..format import schema
from ..layout import local_value
from ..format.plain import plain
from ..format.tensor_codec import encode_inputs, encode_tree
from .directory import environment, write_bundle
from .loss_call import LossTap


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Step:
    __slots__ = ("step", "micro_batches", "losses", "groups", "stepped")

    def __init__(self, step: int):
        self.step = step
        self.micro_batches: list = []  # (args, kwargs, input versions, rng)
        self.losses: list = []         # per micro-batch: None or [args, kwargs, calls, [(target, version)]]
        self.groups = None
        self.stepped = None


class WindowCapture:
    """`inventory`: the capture's `ModelInventory`; `run_info`: as for
    bundles; `post(job)`: the capture's hand-over to the writer thread."""

    def __init__(self, model, optimizer, scaler, *, inventory, steps: int, max_bytes: int,
                 run_dir: Path, run_info: dict, post, loss_fn=None):
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.inventory = inventory
        self.k = int(steps)
        self.budget = int(max_bytes)           # all windows of the run (rank), held and written
        self._spent = 0                        # raw bytes of the windows handed over
        self._covered = None                   # the last step of the last window handed over
        self.run_dir = Path(run_dir)
        self.run_info = run_info
        self._post = post
        self.start: int | None = None
        self.steps: list[_Step] = []
        self.frozen_at: int | None = None      # the triggering step
        self.reasons: list = []
        self.done = False
        self._decided = -1                     # every step up to this one decided
        self._undecided: set[int] = set()
        self._bytes = 0
        self._state_bytes = 0
        self._open = False                     # a step began (first forward) and has not ended
        self._gap = False                      # a step ended without a recorded forward: not re-runnable
        self._sets: dict = {}                  # preallocated copies, by part
        self._snap = None
        self.autocast: dict = {}
        self.precision: dict = {}
        self.windows: list[dict] = []          # the windows written (writer thread)
        self._tap = LossTap(loss_fn, self._on_loss_call) if loss_fn is not None else None
        self.loss = None if self._tap is None else {"name": self._tap.name, "seen_as": self._tap.kind}

    @property
    def max_bytes(self) -> int:
        """What the next (or current) window may hold: the budget left."""
        return self.budget - self._spent

    @property
    def saved(self) -> dict | None:
        """The last window written (None: none yet)."""
        return self.windows[-1] if self.windows else None

    # ------------------------------------------------------ training thread
    def on_step_start(self, step: int, autocast: dict, precision: dict) -> None:
        if self.done:
            return
        if self.frozen_at is None and self._restart_due(step):
            self._restart(step, autocast, precision)
        if self.start is None:
            return
        self.steps.append(_Step(step))
        self._undecided.add(step)
        self._open = True

    def _restart_due(self, step: int) -> bool:
        if self.start is None:
            return True
        age = step - self.start
        if self._bytes > self.max_bytes or self._gap:
            return True
        # Every held step decided: a restart then drops no step a trigger
        # could still ask for (a lagging writer makes the window longer,
        # within max_window_bytes).
        return age >= self.k and not self._undecided

    def _restart(self, step: int, autocast: dict, precision: dict) -> None:
        snap = self._copy_state()
        if snap is None:
            return
        self.start, self._snap, self.steps = step, snap, []
        self._undecided.clear()
        self._gap = False
        self.autocast, self.precision = dict(autocast or {}), dict(precision or {})
        self._bytes = self._state_bytes

    def _copy_state(self):
        inv = self.inventory
        opt_entries, opt_tensors, _ = inv.optimizer_state(self.optimizer)
        scaler_names, scaler_tensors = [], []
        sc = self.scaler
        for name, attr in (("scale", "_scale"), ("growth_tracker", "_growth_tracker")):
            t = getattr(sc, attr, None) if sc is not None else None
            if isinstance(t, torch.Tensor):
                scaler_names.append(name)
                scaler_tensors.append(t)
        parts = {"param": inv.params, "buffer": inv.buffers, "optimizer_state": opt_tensors,
                 "scaler_state": scaler_tensors}
        size = sum(_nbytes(ts) for ts in parts.values())
        if size > self.max_bytes:
            self.done = True
            if not self._spent:
                warnings.warn(f"amp-postmortem: counterfactual window off: the weights and optimizer state "
                              f"({size} bytes) exceed max_window_bytes={self.budget}", RuntimeWarning)
            return None
        snap = {}
        with torch.no_grad():
            for part, src in parts.items():
                src = [local_value(t) for t in src]
                dst = self._sets.get(part)
                if dst is None or len(dst) != len(src) or any(
                        d.shape != s.shape or d.dtype != s.dtype or d.device != s.device for d, s in zip(dst, src)):
                    dst = self._sets[part] = [torch.empty_like(t) for t in src]  # optimizer state appears lazily
                if src:
                    torch._foreach_copy_(dst, src)
                snap[part] = dst
        self._state_bytes = size
        opt = self.optimizer
        snap["optimizer_entries"] = opt_entries
        snap["scaler_names"] = scaler_names
        snap["optimizer_groups"] = None if opt is None else [
            dict(plain({k: v for k, v in g.items() if k != "params"}, keep_nonfinite=True),
                 params=inv.param_names_of(g["params"])) for g in opt.param_groups]
        return snap

    def on_micro_batch(self, args, kwargs, rng: dict, versions: list) -> None:
        """`versions`: [(tensor, _version)] of the inputs, as the capture took them."""
        if self.done or not self.steps:
            return
        self._bytes += _nbytes(t for t, _ in versions)
        self.steps[-1].micro_batches.append((args, kwargs, versions, rng))
        self.steps[-1].losses.append(None)

    def on_micro_batch_aborted(self) -> None:
        if not self.done and self.steps and self.steps[-1].micro_batches:
            self.steps[-1].micro_batches.pop()
            self.steps[-1].losses.pop()

    def _on_loss_call(self, args, kwargs) -> None:
        """The loss was called (`LossTap`): kept for the step's last
        micro-batch (a second call in it is only counted)."""
        if self.done or not self._open or not self.steps or not self.steps[-1].micro_batches:
            return
        from .loss_call import kept_call
        losses = self.steps[-1].losses
        kept = losses[-1]
        if kept is not None:
            kept[2] += 1
            return
        a, k, targets = kept_call(args, kwargs)
        self._bytes += _nbytes(targets)
        losses[-1] = [a, k, 1, [(t, t._version) for t in targets]]

    def on_pre_step(self) -> None:
        if self.done or not self.steps or self.optimizer is None:
            return
        self.steps[-1].groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def on_step_end(self, step: int, stepped) -> None:
        if self.done or not self.steps:
            return
        if not self._open:
            # A step without a recorded forward: the window cannot re-run
            # past it. A frozen one ends before it; a rolling one restarts.
            if self.frozen_at is not None:
                self._hand_over()
            else:
                self._gap = True
            return
        self._open = False
        last = self.steps[-1]
        if last.groups is None and self.optimizer is not None:  # a skipped step: no pre-step hook ran
            self.on_pre_step()
        if last.step != step:  # a caller's own step number: the step closed is this one
            self._undecided.discard(last.step)
            last.step = step
            self._undecided.add(step)
        last.stepped = stepped
        if self.frozen_at is not None and (step >= self.frozen_at + self.k or self._bytes > self.max_bytes):
            self._hand_over()

    def on_decision(self, step: int, order, events=()) -> None:
        """`events`: the window events of `step` (`triggers.WINDOW_EVENTS`);
        a bundle's order alone (an isolated skip) opens no window."""
        if self.done:
            return
        self._undecided.discard(step)
        if (events and self.frozen_at is None and (self._covered is None or step > self._covered)
                and any(s.step == step for s in self.steps)):
            self.frozen_at, self.reasons = step, list(events)

    def close(self, *, write: bool) -> None:
        """The recorder closes: a frozen window is written with the steps it
        has (when `write`: the recording did not fail); an unfrozen one is
        dropped."""
        if write and not self.done and self.frozen_at is not None:
            self._hand_over()
        self.done = True
        self.steps, self._snap, self._sets = [], None, {}
        if self._tap is not None:
            self._tap.remove()

    def _hand_over(self) -> None:
        steps = [s for s in self.steps if s.micro_batches]
        event = None
        devices = [t.device for ts in (self._snap["param"], self._snap["buffer"]) for t in ts if t.device.type == "cuda"]
        if devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(devices[0]))
        job = functools.partial(write_window, self, self._snap, steps, event, self.frozen_at, list(self.reasons),
                                dict(self.autocast), dict(self.precision))
        # The next window rolls from the next step: fresh copies (the writer
        # still reads these), within what is left of the budget.
        self._spent += self._bytes
        self._covered = steps[-1].step if steps else self.frozen_at
        self.steps, self._snap, self._sets = [], None, {}
        self.start, self.frozen_at, self.reasons = None, None, []
        self._undecided.clear()
        self._gap, self._open, self._bytes = False, False, 0
        if self.max_bytes <= 0:
            self.done = True
        self._post(job)


def window_records(inventory, snap, steps, specs):
    """(name, role, micro_batch, tensor, requires_grad) rows of a window."""
    for name, t, src in zip(inventory.param_names, snap["param"], inventory.params):
        yield name, "param", -1, t, src.requires_grad
    for name, t in zip(inventory.buffer_names, snap["buffer"]):
        yield name, "buffer", -1, t, False
    for i, t in enumerate(snap["optimizer_state"]):
        yield f"state.{i}", "optimizer_state", -1, t, False
    for name, t in zip(snap["scaler_names"], snap["scaler_state"]):
        yield name, "scaler_state", -1, t, False
    k = 0
    for step, step_specs in zip(steps, specs):
        for (args, kwargs, _, rng), tensors, loss in zip(step.micro_batches, step_specs[1], step_specs[2]):
            for name, t in tensors:
                yield name, "input", k, t, t.requires_grad
            for name, t in loss[1]:
                yield name, "input", k, t, False
            yield "cpu", "rng", k, rng["cpu"], False
            for i, state in enumerate(rng.get("cuda", ())):
                yield f"cuda:{i}", "rng", k, state, False
            k += 1


def _encode_step(step) -> tuple[list, list, list]:
    """(micro-batch specs, their input tensors, their loss calls' new
    tensors) of a step."""
    specs, inputs, losses = [], [], []
    for (args, kwargs, _, rng), kept in zip(step.micro_batches, step.losses):
        spec, tensors = encode_inputs(args, kwargs)
        spec["rng"] = {"cpu": "cpu", "cuda": [f"cuda:{i}" for i in range(len(rng.get("cuda", ())))]}
        extra = []
        if kept is not None:
            spec["loss"], extra = _encode_loss(kept, tensors)
        specs.append(spec)
        inputs.append(tensors)
        losses.append((None, extra))
    return specs, inputs, losses


def _encode_loss(kept, inputs) -> tuple[dict, list]:
    """A kept loss call as JSON (`{"args", "kwargs", "calls"}`, each
    prediction a `{PREDICTION_KEY: i, "shape", "dtype"}` dict) and its
    tensors not among the micro-batch's inputs (named `loss.args.1`, ...);
    a target that is also an input is named as that input."""
    args, kwargs, calls, _ = kept
    by_id = {id(t): n for n, t in inputs}
    extra: list = []

    def name_tensor(path, t):
        if id(t) not in by_id:
            by_id[id(t)] = f"loss.{path}" + (f"#{len(extra)}" if any(n == f"loss.{path}" for n, _ in extra) else "")
            extra.append((by_id[id(t)], t))
        return by_id[id(t)]

    spec = {"args": encode_tree(tuple(args), name_tensor, "args"),
            "kwargs": encode_tree(dict(kwargs), name_tensor, "kwargs"), "calls": int(calls)}
    return spec, extra


def write_window(window: WindowCapture, snap, steps, event, trigger_step, reasons, autocast, precision) -> None:
    """Writer thread: copy the window to the host and write it."""
    run, inv = window.run_info, window.inventory
    rank = run["rank"]
    try:
        if event is not None:
            event.synchronize()
        if not steps:
            return
        encoded = [_encode_step(s) for s in steps]
        records = list(window_records(inv, snap, steps, encoded))
        k = 0
        step_meta = []
        for s, (specs, _, _) in zip(steps, encoded):
            mbs = []
            for spec in specs:
                mbs.append(dict(spec, index=k))
                k += 1
            step_meta.append({"step": s.step, "stepped": s.stepped, "micro_batches": mbs,
                              "optimizer_groups": plain(s.groups, keep_nonfinite=True)})
        opt = window.optimizer
        optimizer = None
        if opt is not None:
            optimizer = {
                "class": f"{type(opt).__module__}.{type(opt).__qualname__}",
                "defaults": plain({k: v for k, v in opt.defaults.items() if k != "params"}, keep_nonfinite=True),
                "param_groups": snap["optimizer_groups"],
                "state": [{"param": p, "key": key, **({"tensor": f"state.{v}"} if isinstance(v, int) else v)}
                          for p, key, v in snap["optimizer_entries"]]}
        scaler = None
        if run.get("scaler") is not None:
            scaler = dict(run["scaler"], tensors=list(snap["scaler_names"]))
        meta = {
            "format": schema.WINDOW_FORMAT_NAME, "version": schema.WINDOW_SCHEMA_VERSION,
            "run_id": run["run_id"], "rank": rank, "world_size": run["world_size"], "created_at": time.time(),
            "first_step": steps[0].step, "last_step": steps[-1].step, "trigger_step": trigger_step,
            "reasons": reasons, "window_steps": window.k,
            "inputs_exact": all(t._version == v for s in steps for _, _, vs, _ in s.micro_batches for t, v in vs)
            and all(t._version == v for s in steps for kept in s.losses if kept is not None for t, v in kept[3]),
            "training": bool(window.model.training),
            "params": {"names": inv.param_names, "aliases": inv.aliases},
            "buffers": {"names": inv.buffer_names, "non_persistent": inv.non_persistent},
            "optimizer": optimizer, "scaler": plain(scaler, keep_nonfinite=True),
            "autocast": plain(autocast, keep_nonfinite=True),
            "precision_flags": plain(precision, keep_nonfinite=True),
            "model_class": inv.model_class, "name_prefix_removed": inv.prefix or None,
            "steps": step_meta,
            **({"loss": dict(window.loss, kept=sum(kept is not None for s in steps for kept in s.losses))}
               if window.loss is not None else {}),
            "env": environment(run["package_version"], run["device_type"], run["device_name"]),
        }
        rel = f"{schema.WINDOWS_DIR}/{schema.WINDOW_DIR.format(step=steps[0].step, rank=rank)}"
        files = write_bundle(window.run_dir / rel, records, meta, manifest_file=schema.WINDOW_MANIFEST_FILE,
                             format_name=schema.WINDOW_FORMAT_NAME, version=schema.WINDOW_SCHEMA_VERSION)
        window.windows.append({"path": rel, "first_step": steps[0].step, "last_step": steps[-1].step,
                               "trigger_step": trigger_step, "reasons": reasons,
                               "bytes": sum(f["bytes"] for f in files.values())})
    except Exception as exc:  # noqa: BLE001 - a failed window never stops the recording
        warnings.warn(f"amp-postmortem: counterfactual window not saved: {type(exc).__name__}: {exc}",
                      RuntimeWarning)
