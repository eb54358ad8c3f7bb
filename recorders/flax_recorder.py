"""The Flax nnx + optax recorder: writes the run format the PyTorch
recorder writes.

With the helper, the user's step (not jitted yet) is jitted by the recorder
and returns a dict:

    rec = FlaxRecorder("runs/exp1", model, optimizer=optimizer, loss_scale=scale)
    train_step = rec.wrap(train_step)      # was: train_step = nnx.jit(train_step)
    ...
    out = train_step(model, optimizer, scale, batch)   # records one step
    rec.close()

`train_step(...)` returns a dict with `loss` (unscaled) and, when it has
them, `grads` (the unscaled gradients, any pytree; taken out of the dict
the caller gets back), `loss_scale_before` (the scale the backward used),
`loss_scale` (the scale the next step uses) and `skipped` (true when the
dynamic scale refused the update: the step's own finiteness decision, so
the flag is exact). Every module method's output (`nnx.capture` with
`nnx.Intermediate`) and every gradient leaf is reduced inside the jitted
step to five numbers ([absmax, NaN count, Inf count, -, numel]); so are,
in backward order, the gradient reaching each module call's output
(`grad_output`) and what its backward hands its inputs (`grad_input`),
scaled as they travel (`ModuleGradientTaps`). Those and the scalars are
the only values that leave the device. A full-tier step calls a second
jitted step that also reduces the full tier's nine (`xp_stats`, PyTorch's
definitions); the others call the one without them. Which steps are full
is the PyTorch recorder's `RecordSchedule` (`schedule.py`), with its
every-step mode's defaults: every `full_every`-th step (100, from step 0)
and a burst of `full_after_event` steps (20) after the first event of each
kind (a skipped step, NaN/Inf in the forward, in the gradients, in the
loss). Each jitted step is traced once; switching tiers recompiles nothing.

Without the helper, call `rec.step(loss=..., loss_scale_before=...,
loss_scale=..., skipped=..., grad_norm=...)` after each step, and for
module rows return `module_stats(intermediates)` / `tree_stats(grads)`
from your own jitted step and pass them as `forward=` / `grads=`; for
`grad_output` / `grad_input` rows, trace your step inside `with
ModuleGradientTaps(model) as taps:`, return the stats of `taps.rows` from
it and pass the rows as `backward=`.

Replay bundles (`bundles=`, a `host_bundle.BundleTriggers`; None: off):
with the helper, the arguments of the model's first call in the step (the
root module's `__call__`, seen while the step is traced) come back from the
jitted step as device arrays, held by reference until the next step; at
the first step with a non-finite loss, NaN/Inf in a module output or
(the forward finite) NaN/Inf in a gradient, they and the model's
`nnx.Param`s are written pickle-free (`host_bundle.py`) for
`amp-postmortem replay RUN --step N --model FILE:factory`. The parameters
are read after the step: those the forward used when the step was skipped
(`params.exact`).

Order of the `activation` rows: modules in definition order, children
before their parent (how a model written in call order runs); a module
called twice has `call` 0 and 1. The `grad_output` / `grad_input` rows
come in the order the backward ran them (only `__call__` is tapped: other
methods get `activation` rows only).
"""
from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import jax_program, xp_stats
from .format import schema
from .format.flax_names import key_name, module_name, named_params
from .host_bundle import BundleTriggers, encode_tree, write_bundle
from .errors import OptionError, option_float, option_int
from .host_run import HostRun, StepRecord, backward_rows, framework_entry, stats_row, step_events
from .jax_grad_tap import cheap_stats, identity_with_gradient
from .schedule import EVERY_STEP, FULL, RecordSchedule

STAT_WIDTH = 5
# The full tier every 100 steps and in a burst of 20 after the first event
# of each kind by default, as the PyTorch recorder's every-step mode
# (`schedule.EVERY_STEP`): this recorder reduces every step's rows in the
# jitted step and re-executes no failing step (the sentinel's
# `full_after_event=0` leans on that re-execution).
FULL_EVERY = EVERY_STEP["full_every"]
FULL_AFTER_EVENT = EVERY_STEP["full_after_event"]


def _cast(x, dtype):
    return jnp.asarray(x).astype(dtype)


def _width(full: bool) -> int:
    return xp_stats.FULL_WIDTH if full else STAT_WIDTH


# ------------------------------------------------------------ in the graph
def array_stats(x, scale=None, full: bool = False, near_overflow: float = schema.FP16_MAX):
    """[absmax, NaN count, Inf count, 0, numel] of one array, float32, in
    the graph; `full`: the full tier's nine after them (`xp_stats`;
    `near_overflow`: the magnitude counted as near overflow)."""
    x = jnp.asarray(x).astype(jnp.float32)
    if scale is not None:
        x = x / scale
    absmax, nans, infs = cheap_stats(x)
    cheap = [absmax, nans, infs, jnp.float32(0), jnp.float32(x.size)]
    if full and x.size:
        cheap += xp_stats.full_tail(x, int(x.size), jnp, _cast, near_overflow)
    elif full:  # empty: no value, every statistic null
        cheap += [jnp.float32(math.nan)] * 4 + [jnp.float32(0)] * 5
    return jnp.stack(cheap)


def merge_stats(parts: list):
    """One row from the stats of its arrays (`xp_stats.merge_rows`)."""
    return xp_stats.merge_rows(parts, jnp, _cast)


def tree_stats(tree, scale=None, full: bool = False, near_overflow: float = schema.FP16_MAX):
    """(names, [n, 5] stats) of every floating leaf of a pytree (gradients):
    names `a.b.kernel`, statistics reduced in the graph; `full`: [n, 14],
    the full tier's after them (`near_overflow`: as `array_stats`')."""
    names, stats = [], []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not hasattr(leaf, "dtype") or not jnp.issubdtype(leaf.dtype, jnp.floating):
            continue
        parts = [str(key_name(k)) for k in path if key_name(k) != "value"]
        names.append((".".join(parts), str(leaf.dtype)))
        stats.append(array_stats(leaf, scale, full, near_overflow))
    return names, (jnp.stack(stats) if stats else jnp.zeros((0, _width(full)), jnp.float32))


def module_stats(intermediates, full: bool = False, near_overflow: float = schema.FP16_MAX):
    """(rows, [n, 5] stats) of `nnx.capture(..., nnx.Intermediate,
    method_outputs=nnx.Intermediate)`'s state: one row per module method
    call, (module name, method, call, dtype); `full`: [n, 14]
    (`near_overflow`: as `array_stats`')."""
    calls: dict = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(intermediates):
        keys = [key_name(k) for k in path]
        call = keys[-1] if isinstance(keys[-1], int) else 0
        names = [k for k in keys if isinstance(k, str) and k != "value"]
        if not names or not hasattr(leaf, "dtype") or not jnp.issubdtype(leaf.dtype, jnp.floating):
            continue
        module, method = tuple(names[:-1]), names[-1]
        calls.setdefault((module, method, call), []).append(leaf)
    rows, stats = [], []
    for (module, method, call), leaves in calls.items():
        rows.append((module, method, call, str(leaves[0].dtype)))
        stats.append(merge_stats([array_stats(leaf, full=full, near_overflow=near_overflow) for leaf in leaves]))
    return rows, (jnp.stack(stats) if stats else jnp.zeros((0, _width(full)), jnp.float32))


def module_order(model) -> dict:
    """Module path -> its position when children finish before their
    parent, in definition order (post-order of the module tree)."""
    pre = list(definition_order(model))
    index = {p: i for i, p in enumerate(pre)}

    def key(p):
        return tuple(index.get(p[:i], math.inf) for i in range(1, len(p) + 1)) + (math.inf,)

    return {p: i for i, p in enumerate(sorted(pre, key=key))}


def definition_order(node, path=(), seen=None):
    """Module paths in pre-order, attributes in the order `__init__` set
    them (`nnx.iter_graph` sorts them by name)."""
    seen = set() if seen is None else seen
    if id(node) in seen:
        return
    seen.add(id(node))
    yield path
    for attr, value in vars(node).items():
        children = [(str(i), v) for i, v in enumerate(value)] if isinstance(value, (list, tuple)) else [(None, value)]
        for sub, child in children:
            if isinstance(child, nnx.Module):
                yield from definition_order(child, path + ((attr,) if sub is None else (attr, sub)), seen)


# ------------------------------------------------------------ the recorder
class FlaxRecorder:
    """Records a Flax nnx model's training into `run_dir` (docs/FORMAT.md).

    `model`: the `nnx.Module` trained; `optimizer`: the `nnx.Optimizer`
    (its class and learning rate go to the manifest); `loss_scale`: the
    dynamic loss scale in use, jmp's `DynamicLossScale` or any object with
    `loss_scale`, `period` and `factor` (None: no scaling); `every`: write
    the per-row statistics every N steps (and on every step with a skip or a
    non-finite loss); `full_every`: every N-th step (from step 0; 0: never)
    the rows also carry the full tier's statistics (min, max, mean, rms,
    the zero, below-normal, below-subnormal and near-overflow shares,
    `xp_stats`), from a second jitted step traced for those steps (the
    others run without them), and the steps table's `tier` says `full`;
    `full_after_event`: the full tier also for a burst of N steps after
    the first event of each kind (a skipped step, NaN/Inf in the forward,
    in the gradients of a step not skipped, a non-finite loss; 0: never),
    as `RecordSchedule`'s option of that name; `near_overflow`: the
    magnitude the full tier's `near_overflow_share` counts from (65504,
    float16's largest; the PyTorch recorder's option, recorded in the
    manifest's `recorder` as there; without the helper, pass it to
    `array_stats` / `module_stats` / `tree_stats` / `ModuleGradientTaps`
    yourself); `steps_per_shard`: as the PyTorch recorder's;
    `bundles`: when to save a replay bundle (a `BundleTriggers`, of which
    the recorder counts on its own copy; None: never; needs `wrap`)."""

    def __init__(self, run_dir, model, *, optimizer=None, loss_scale=None, every: int = 1,
                 full_every: int = FULL_EVERY, full_after_event: int = FULL_AFTER_EVENT,
                 near_overflow: float = schema.FP16_MAX, steps_per_shard: int = 1000, run_id: str | None = None,
                 bundles: BundleTriggers | None = BundleTriggers()):
        if option_int("every", every) < 1:
            raise OptionError(f"every={every!r}: record every N >= 1 steps")
        if option_int("full_every", full_every) < 0:
            raise OptionError(f"full_every={full_every!r}: the full tier every N >= 1 steps, or 0 for never")
        if option_int("full_after_event", full_after_event) < 0:
            raise OptionError(f"full_after_event={full_after_event!r}: a burst of N >= 1 steps, or 0 for none")
        self.near_overflow = option_float("near_overflow", near_overflow)
        if not self.near_overflow > 0:
            raise OptionError(f"near_overflow={near_overflow!r}: a magnitude above 0")
        self.every = int(every)
        self.full_every = int(full_every)
        # Which steps are full (the rows are written every `every` steps, and on a bad one).
        self.schedule = RecordSchedule(cheap_every=self.every, full_every=self.full_every,
                                       full_after_event=int(full_after_event))
        self.step_index = 0
        self._order = module_order(model)
        self._scaled = loss_scale is not None
        self._model = model
        self.run_dir = run_dir
        # A copy: `fired`/`saved` count one run, and the default argument is
        # one object shared by every recorder built without `bundles=`.
        self.bundles = bundles.fresh() if bundles is not None and bundles.enabled else None
        self._held = None  # (model-call tree, device arrays, step-arguments tree) of the last step
        self._program_read = False  # the step's jaxpr scanned for float16 reductions (once)
        policy_dtype = _param_dtype(model)
        modules = [{"name": module_name(p, "__call__"), "type": _class_name(type(node)), "watched": True}
                   for p, node in ((tuple(str(x) for x in path), node) for path, node in nnx.iter_graph(model))
                   if isinstance(node, nnx.Module)]
        params = [{"name": name, "shape": list(v.shape), "dtype": str(v.dtype), "requires_grad": True}
                  for name, v in named_params(model)]
        self.run = HostRun(
            run_dir, framework=framework_entry("flax", _versions()), model_class=_class_name(type(model)),
            modules=modules, params=params, scaler=describe_loss_scale(loss_scale),
            optimizer=describe_optimizer(optimizer),
            autocast={"enabled": policy_dtype not in (None, "float32"), "device_type": jax.default_backend(),
                      "dtype": policy_dtype, "cache_enabled": None},
            recorder_options={"recorder": "flax", "every": self.every, **self.schedule.config(),
                              "near_overflow": self.near_overflow, "steps_per_shard": steps_per_shard,
                              "bundles": self.bundles.options() if self.bundles is not None else None},
            device_type=jax.default_backend(), steps_per_shard=steps_per_shard, run_id=run_id)

    # ---------------------------------------------------------- the helper
    def wrap(self, step_fn, *, jit: bool = True):
        """`step_fn` jitted (`nnx.jit`) so that each call also returns the
        module and gradient statistics, recorded as one step. See the
        module's docstring for what `step_fn` returns. A full-tier step
        (`is_full_step`) calls a second jitted function, traced with the
        full tier's reductions; the others call one without them."""
        tiers = {}
        sched = self.schedule
        for full in ((False, True) if sched.full_every or sched.full_after_event else (False,)):
            names: dict = {}
            instrumented = self._instrumented(step_fn, full, names)
            tiers[full] = (nnx.jit(instrumented) if jit else instrumented, names)

        def recorded_step(*args, **kwargs):
            full = self.is_full_step(self.step_index)
            compiled, names = tiers[full]
            out, payload, held = compiled(*args, **kwargs)
            if jit and not self._program_read:  # the program read once: jax's cached trace, nothing rerun
                self._program_read = True
                self.run.set_jax_reductions(jax_program.trace_reductions(compiled, args, kwargs,
                                                                         step=self.step_index))
            # Device arrays: copied only for a bundle.
            self._held = (names.get("inputs"), held, names.get("step_args"))
            host = jax.device_get(payload)  # a few numbers per module: one transfer
            self._record(names, host, full)
            return out

        return recorded_step

    def is_full_step(self, step: int) -> bool:
        """Whether `step` carries the full tier (`full_every`, a burst of
        `full_after_event`: `self.schedule`). Without the helper, ask it
        before tracing a step's statistics with `full=`."""
        return self.schedule.tier(step) == FULL

    def _instrumented(self, step_fn, full: bool, names: dict):
        """`step_fn` returning its statistics too (the full tier's with
        `full`); `names` gets the rows' static names as it is traced."""

        def instrumented(*args, **kwargs):
            captured = nnx.capture(step_fn, nnx.Intermediate, method_outputs=nnx.Intermediate)
            with RootCallTap(type(self._model), active=self.bundles is not None) as tap, \
                    ModuleGradientTaps(self._model, full=full, near_overflow=self.near_overflow) as gradient_taps:
                out, intermediates = captured(*args, **kwargs)
            held: dict = {}
            names["inputs"] = None if tap.arguments is None else {
                "args": [encode_tree(a, "input/x", held) for a in tap.arguments[0]],
                "kwargs": [[k, encode_tree(v, "input/x", held)] for k, v in tap.arguments[1].items()]}
            if self.bundles is not None:
                # The step's own arguments (targets, the scale; the model and
                # optimizer are no arrays: their nodes name their class), for
                # a backward replay's loss function.
                names["step_args"] = {
                    "args": [encode_tree(a, "target/step", held) for a in args],
                    "kwargs": [[k, encode_tree(v, "target/step", held)] for k, v in kwargs.items()]}
            if not isinstance(out, dict) or "loss" not in out:
                raise TypeError("a step wrapped by FlaxRecorder.wrap returns a dict with at least 'loss'")
            out = dict(out)
            grads = out.pop("grads", None)
            near = self.near_overflow
            forward_rows, forward = module_stats(intermediates, full, near)
            grad_rows, grad_stats = tree_stats(grads, full=full, near_overflow=near) if grads is not None else ([], None)
            names["forward"], names["grads"] = forward_rows, grad_rows
            loss = jnp.asarray(out["loss"])
            names["loss_dtype"] = str(loss.dtype)
            payload = {"forward": forward, "loss": array_stats(loss, full=full, near_overflow=near)}
            names["backward"] = [row[:4] for row in gradient_taps.rows]
            payload["backward"] = (jnp.stack([row[4] for row in gradient_taps.rows]) if gradient_taps.rows
                                   else jnp.zeros((0, _width(full)), jnp.float32))
            if grads is not None:
                payload["grads"] = grad_stats
                leaves = [g.astype(jnp.float32) for g in jax.tree_util.tree_leaves(grads)
                          if hasattr(g, "dtype") and jnp.issubdtype(g.dtype, jnp.floating)]
                payload["grad_sqsum"] = sum(jnp.sum(g * g) for g in leaves)
            for k in ("loss_scale_before", "loss_scale", "skipped"):
                if k in out:
                    payload[k] = jnp.asarray(out[k]).astype(jnp.float32)
            return out, payload, held

        return instrumented

    def _record(self, names: dict, host: dict, full: bool = False) -> None:
        loss_stats = np.asarray(host["loss"])
        loss = float(loss_stats[0]) if loss_stats[1] == 0 and loss_stats[2] == 0 else math.nan
        forward = []
        for (module, method, call, dtype), v in zip(names["forward"], np.asarray(host["forward"])):
            forward.append((self._order.get(module, len(self._order)), call, module_name(module, method), dtype, v))
        forward.sort(key=lambda r: (r[0], r[1]))
        forward_rows = [(name, "activation", call, dtype, v) for _, call, name, dtype, v in forward]
        forward_rows.append((schema.LOSS_NAME, "loss", 0, names.get("loss_dtype", "float32"), loss_stats))
        grads = None
        if "grads" in host:
            grads = [(name, dtype, v) for (name, dtype), v in zip(names["grads"], np.asarray(host["grads"]))]
        backward = [(*meta, v) for meta, v in zip(names.get("backward", ()), np.asarray(host["backward"]))]
        sq = host.get("grad_sqsum")
        self.step(loss=loss, backward=backward, loss_scale_before=_opt_float(host.get("loss_scale_before")),
                  loss_scale=_opt_float(host.get("loss_scale")),
                  skipped=bool(host["skipped"] >= 0.5) if "skipped" in host else False,
                  grad_norm=math.sqrt(float(sq)) if sq is not None and float(sq) >= 0 else _opt_float(sq),
                  forward=forward_rows, grads=grads, loss_dtype=names.get("loss_dtype"), full=full)

    # ------------------------------------------------- the documented call
    def step(self, *, loss, loss_scale_before=None, loss_scale=None, skipped: bool = False,
             grad_norm=None, lr=None, forward=None, grads=None, loss_dtype=None, step: int | None = None,
             backward=None, full: bool | None = None):
        """Record one optimizer step from host values (floats, or jax
        scalars: read here). `forward`: (name, kind, call, dtype, stats)
        per row in execution order; `grads`: (name, dtype, stats) per
        gradient, stats the five numbers of `array_stats` (unscaled
        gradients); `backward`: (name, kind, call, dtype, stats) per
        `grad_output` / `grad_input` row in the order the backward made
        them (scaled gradients, as they travelled; `ModuleGradientTaps`).
        Stats of 14 numbers (`full=True` given to `array_stats`,
        `module_stats`, `tree_stats`, `ModuleGradientTaps`) carry the full
        tier; `full`: the step's `tier` is `full` (None: when its rows
        have the full tier's numbers)."""
        index = self.step_index if step is None else int(step)
        self.step_index = index + 1
        loss = _opt_float(loss)
        rows = []
        # NaN/Inf in any gradient (a step with rows, as a skip or a non-finite loss).
        backward_bad = any(_nonfinite_stats(r[-1]) for r in (*(grads or ()), *(backward or ())))
        if full is None:
            full = any(len(np.asarray(r[-1])) > STAT_WIDTH for r in (*(forward or ()), *(grads or ()),
                                                                   *(backward or ())))
        if index % self.every == 0 or full or skipped or backward_bad or loss is None or not math.isfinite(loss):
            for order, (name, kind, call, dtype, v) in enumerate(forward or ()):
                # nnx.capture keeps outputs only: the inputs' NaN/Inf are unknown (null).
                rows.append(stats_row(name, kind, "forward", order, call, dtype, v))
            rows.extend(backward_rows(backward or (), grads or ()))
        if self.bundles is not None and self._held is not None and self._held[0] is not None:
            self._maybe_save_bundle(index, loss, bool(skipped), rows, loss_dtype, _opt_float(loss_scale_before),
                                    backward_bad)
        record = StepRecord(
            step=index, loss=loss,
            loss_scale_before=_opt_float(loss_scale_before) if self._scaled else None,
            loss_scale=_opt_float(loss_scale) if self._scaled else None,
            skipped=bool(skipped), lr=[float(lr)] if lr is not None else None,
            grad_norm=_opt_float(grad_norm), loss_dtype=loss_dtype, rows=rows, full=bool(full) and bool(rows),
            wall_time=time.time())
        self.run.write_step(record)
        events = step_events(record)
        if events:  # note_event takes no kinds as one unnamed event
            self.schedule.note_event(index, events)

    def _maybe_save_bundle(self, step, loss, skipped, rows, loss_dtype, loss_scale, backward_bad) -> None:
        bad = [{"name": r.name, "call": r.call} for r in rows
               if r.phase == "forward" and r.kind == "activation" and (r.nan_count or r.inf_count)]
        reasons = self.bundles.reasons(step, loss, bool(bad), backward_bad, skipped=skipped,
                                       loss_scale_before=loss_scale)
        if not reasons:
            return
        tree, held, step_args = self._held
        arrays = dict(jax.device_get(held))
        names = []
        for name, leaf in named_params(self._model):
            arrays[f"param/{name}"] = np.asarray(jax.device_get(leaf))
            names.append(name)
        manifest = self.run.manifest
        meta = {
            "framework": manifest["framework"], "run_id": manifest["run_id"], "world_size": 1,
            "reason": reasons[0], "reasons": reasons, "loss": loss, "loss_dtype": loss_dtype,
            "loss_scale": loss_scale if self._scaled else None, "skipped": skipped, "model_class": manifest["model_class"],
            "policy": {"name": None, "compute_dtype": (manifest["autocast"] or {}).get("dtype"),
                       "variable_dtype": None},
            # Read after the step: unchanged when the step was skipped.
            "params": {"names": names, "exact": skipped, "source": "after_skipped_step" if skipped
                       else "after_update"},
            "inputs": tree, "recorded_nonfinite": bad, "step_arguments": step_args,
        }
        self.run.add_bundle(write_bundle(self.run_dir, rank=0, step=step, meta=meta, arrays=arrays))

    def flush(self):
        self.run.flush()

    def close(self):
        """Write the last shard and mark the run closed. Idempotent."""
        self.run.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class RootCallTap:
    """While a step is traced, the arguments of the first call of a module
    of class `cls` (the model): a class-level wrapper of `__call__`
    (Python looks special methods up on the type), removed on exit."""

    def __init__(self, cls, *, active: bool = True):
        self.cls, self.active, self.arguments = cls, active, None

    def __enter__(self):
        if not self.active:
            return self
        cls, had_own, original = self.cls, "__call__" in self.cls.__dict__, self.cls.__call__
        tap = self

        def __call__(module, *args, **kwargs):
            if tap.arguments is None:
                tap.arguments = (args, kwargs)
            return original(module, *args, **kwargs)

        cls.__call__ = __call__
        self._restore = (had_own, original)
        return self

    def __exit__(self, *exc):
        if self.active:
            had_own, original = self._restore
            if had_own:
                self.cls.__call__ = original
            else:
                del self.cls.__call__
        return False


class ModuleGradientTaps:
    """While a step is traced: every module call's floating inputs and
    outputs pass through an identity whose backward rule (a `jax.custom_vjp`,
    run by the step's own `value_and_grad` with the step's traced values)
    reduces the gradient reaching the output (`grad_output`) and what the
    module's backward hands its inputs (`grad_input`) to `array_stats`'s
    five numbers (14 with `full`; `near_overflow` as `array_stats`'), appended to `rows` in the order the backward runs them.
    Values as they travel: scaled by the loss scale, in their own dtype.
    The `__call__` of each class that defines the model's modules' one is
    wrapped on entry and restored on exit; a call is named by its module's
    path from the first call of the model's class (`module_name`)."""

    def __init__(self, model, *, full: bool = False, near_overflow: float = schema.FP16_MAX):
        self.full = full            # the full tier's statistics too (xp_stats)
        self.root_cls = type(model)
        self.rows: list = []        # (name, kind, call, dtype, stats) in backward order
        self._paths: dict = {}      # id(module) -> path, from the traced model
        self._calls: dict = {}
        self._received: dict = {}
        self.near_overflow = near_overflow
        owners = {}
        for _, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Module):
                owner = next((c for c in type(node).__mro__ if "__call__" in c.__dict__), None)
                if owner is not None and owner is not nnx.Module:
                    owners[owner] = None
        self._owners = list(owners)
        self._restore: list = []

    def __enter__(self):
        for cls in self._owners:
            original = cls.__dict__["__call__"]
            cls.__call__ = self._wrapper(original)
            self._restore.append((cls, original))
        return self

    def __exit__(self, *exc):
        for cls, original in reversed(self._restore):
            cls.__call__ = original
        self._restore = []
        return False

    def _wrapper(self, original):
        taps = self

        def __call__(module, *args, **kwargs):
            if not taps._paths and isinstance(module, taps.root_cls):
                taps._paths = {id(node): tuple(str(p) for p in path) for path, node in nnx.iter_graph(module)
                               if isinstance(node, nnx.Module)}
            path = taps._paths.get(id(module))
            if path is None:
                return original(module, *args, **kwargs)
            name = module_name(path, "__call__")
            call = taps._calls.get(name, 0)
            taps._calls[name] = call + 1
            args, kwargs = taps._tap((args, kwargs), name, "grad_input", call)
            return taps._tap(original(module, *args, **kwargs), name, "grad_output", call)
        return __call__

    def _tap(self, tree, name, kind, call):
        leaves, treedef = jax.tree_util.tree_flatten(
            tree, is_leaf=lambda x: isinstance(x, (nnx.Module, nnx.Variable)))
        where = [i for i, x in enumerate(leaves)
                 if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)]
        if not where:
            return tree

        def on_grads(grads):
            merged = merge_stats([array_stats(g, full=self.full, near_overflow=self.near_overflow) for g in grads])
            if kind == "grad_output":
                self._received[(name, call)] = merged[1] + merged[2]
            else:
                # input_nonfinite of a grad_input row: NaN/Inf in what the module received.
                merged = merged.at[3].set(self._received.get((name, call), jnp.float32(0)))
            self.rows.append((name, kind, call, str(grads[0].dtype), merged))

        out = identity_with_gradient([leaves[i] for i in where], on_grads)
        for i, t in zip(where, out):
            leaves[i] = t
        return jax.tree_util.tree_unflatten(treedef, leaves)


def _nonfinite_stats(stats) -> bool:
    """A row's statistics count a NaN or an Inf (one conversion a row)."""
    v = np.asarray(stats)
    return bool(v[1] or v[2])


def _opt_float(v):
    return None if v is None else float(np.asarray(v))


def _class_name(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _versions() -> str:
    import flax
    import optax
    return f"flax {flax.__version__}, jax {jax.__version__}, optax {optax.__version__}"


def _param_dtype(model) -> str | None:
    """The compute dtype of the model's layers (their `dtype`), when one."""
    for _, node in nnx.iter_graph(model):
        dtype = getattr(node, "dtype", None) if isinstance(node, nnx.Module) else None
        if dtype is not None:
            return str(jnp.dtype(dtype))
    return None


def describe_loss_scale(loss_scale) -> dict | None:
    if loss_scale is None:
        return None
    init = getattr(loss_scale, "loss_scale", None)
    try:
        init = float(np.asarray(init)) if init is not None else None
    except (TypeError, ValueError):
        init = None
    period = getattr(loss_scale, "period", None)
    factor = getattr(loss_scale, "factor", None)
    return {"class": _class_name(type(loss_scale)), "enabled": True, "init_scale": init,
            "growth_factor": float(factor) if factor is not None else None,
            "backoff_factor": 1.0 / float(factor) if factor else None,
            "growth_interval": int(period) if period is not None else None}


def describe_optimizer(optimizer) -> dict | None:
    if optimizer is None:
        return None
    tx = getattr(optimizer, "tx", None)
    return {"class": _class_name(type(optimizer)), "defaults": {"tx": repr(type(tx).__name__) if tx else None}}
