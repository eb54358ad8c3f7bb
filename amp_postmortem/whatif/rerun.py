"""Re-run a saved window of steps under a remedy (`amp-postmortem rerun`).

A counterfactual window (`recorders.BundlePolicy(window_steps=K)`, read by
`amp_postmortem.reading.window`) holds the weights, buffers, optimizer and scaler
state at its first step and every step's inputs and RNG states since.
`rerun_window` trains those steps again, forward, backward through a
`torch.amp.GradScaler` and the optimizer's step, as the job did but under a
remedy: another precision (`fp32`, `bf16`, `fp16`, `fp64`), modules kept
in float32, another initial loss scale, a learning rate scaled by a
factor, float32 parameters where the run held them in bfloat16/float16
(`param_dtype="float32"`: master weights), stochastic rounding of their
updates (`update_rounding="stochastic"`). Each step says whether it stayed
finite (its loss, and the weights after its update), its loss against the
recorded one, whether the scaler skipped it, and, where the run held
parameters in low precision, the share of the optimizer's updates that
left them unchanged (`lost_share`, `weight_updates.UpdateCount`); the run
`carries` the window when every step is finite.

The parameters are held in the dtypes the window saved them in (a model
cast with `model.to(torch.bfloat16)` re-runs in bfloat16 whatever dtype
`--model` builds), except under `param_dtype="float32"` and in a float32
or float64 re-run, which are float32/float64 throughout.

Steps before `from_step` are re-run as recorded (the recorded precision,
scale and learning rate) to reach `from_step`'s state; the remedy applies
from `from_step` on.

What runs and what is never imported:
- the model: the user's `--model` (never a class the run names);
- the optimizer: rebuilt only for the torch.optim classes of
  `OPTIMIZERS`, a fixed allow-list in this module, with the recorded
  hyperparameters and state (`load_state_dict`, tensors by parameter name
  and key); any other class needs `optimizer=` (`--optimizer SPEC`,
  `factory(model)` returning it), whose state is loaded the same way;
- the scaler: `torch.amp.GradScaler` with the recorded settings;
- the loss: the loop's, called as the loop called it, when the window kept
  its calls (`AmpRecorder(..., loss_fn=criterion)`: the targets are in the
  window) and the user names it (`loss=`, `--loss FILE.py:fn`: the
  recorded call's arguments with the model's output in the prediction's
  place); else the model's own (a scalar output, or `.loss` / `["loss"]`),
  else `loss_fn(output, micro_batch)`. The loss is never taken from the
  window: it records only the loss's name, for the messages.
"""
from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field

import pandas as pd

from recorders.format import plain

from ..errors import BundleError, ModelSpecError, OptionError
from ..names import PARAM_DTYPES, RERUN_PRECISIONS, UPDATE_ROUNDINGS
from ..result import CommandResult

# The optimizers rebuilt from a window, by the class name the recorder
# wrote: a name outside this table is never imported.
OPTIMIZERS = {
    "torch.optim.sgd.SGD": "SGD", "torch.optim.adam.Adam": "Adam", "torch.optim.adamw.AdamW": "AdamW",
    "torch.optim.rmsprop.RMSprop": "RMSprop", "torch.optim.adagrad.Adagrad": "Adagrad",
    "torch.optim.adamax.Adamax": "Adamax", "torch.optim.nadam.NAdam": "NAdam",
    "torch.optim.radam.RAdam": "RAdam", "torch.optim.adadelta.Adadelta": "Adadelta",
}
# Hyperparameters a step's recorded groups may set on the rebuilt optimizer.
_STEP_KEYS = ("lr", "momentum", "dampening", "weight_decay", "betas", "eps", "alpha", "nesterov", "rho",
              "lr_decay", "momentum_decay")
STEP_COLUMNS = ["step", "finite", "loss", "recorded_loss", "skipped", "recorded_skipped", "loss_scale", "lost_share"]


@dataclass
class RerunStep:
    step: int
    finite: bool                   # loss and weights after the update finite
    loss: float | None
    recorded_loss: float | None
    skipped: bool                  # the scaler skipped the optimizer step
    recorded_skipped: bool | None
    loss_scale: float | None       # in force during the backward
    remedied: bool                 # run under the remedy (False: the prefix before from_step)
    # of the updates asked of the parameters the run held in bf16/fp16, the share left unchanged
    # (None: no such parameter, or the step was skipped)
    lost_share: float | None = None

    def to_dict(self) -> dict:
        return plain({"step": self.step, "finite": self.finite, "loss": self.loss,
                      "recorded_loss": self.recorded_loss, "skipped": self.skipped,
                      "recorded_skipped": self.recorded_skipped, "loss_scale": self.loss_scale,
                      "remedied": self.remedied, "lost_share": self.lost_share}, keep_nonfinite=True)


@dataclass
class RerunResult(CommandResult):
    window_path: str
    rank: int
    window_steps: list             # [first, last] of the saved window
    trigger_step: int | None
    from_step: int
    to_step: int
    precision: str
    recorded_precision: str
    keep_fp32: list
    init_scale: float | None
    lr_scale: float
    optimizer: str                 # the class rebuilt, or "user" (optimizer=)
    steps: list                    # RerunStep, prefix included
    notes: list = field(default_factory=list)
    param_dtype: str = "recorded"          # the parameters' dtype in the re-run: "recorded" or one name
    recorded_param_dtype: str | None = None  # the window's: one name or "mixed (...)"
    update_rounding: str = "nearest"
    # the remedied steps' asked and unchanged updates (low-precision parameters; None: none held)
    updates: tuple | None = None
    # `evaluate=True`: the float32 loss of the window's re-run batches with the weights before and after
    window_loss: tuple | None = None

    @property
    def lost_share(self) -> float | None:
        """The share of the remedied steps' asked updates left unchanged."""
        if not self.updates or not self.updates[0]:
            return None
        return self.updates[1] / self.updates[0]

    @property
    def remedied(self) -> list:
        return [s for s in self.steps if s.remedied]

    @property
    def carries(self) -> bool:
        """Every re-run step finite (the prefix and the remedied steps)."""
        return bool(self.steps) and all(s.finite for s in self.steps)

    @property
    def first_nonfinite_step(self) -> int | None:
        return next((s.step for s in self.steps if not s.finite), None)

    @property
    def skipped_steps(self) -> list:
        return [s.step for s in self.remedied if s.skipped]

    @property
    def recorded_first_nonfinite_step(self) -> int | None:
        return next((s.step for s in self.steps if s.recorded_loss is not None
                     and not math.isfinite(s.recorded_loss)), None)

    def document(self) -> dict:
        return plain({"window": self.window_path, "rank": self.rank, "window_steps": self.window_steps,
                      "trigger_step": self.trigger_step, "from_step": self.from_step, "to_step": self.to_step,
                      "precision": self.precision, "recorded_precision": self.recorded_precision,
                      "keep_fp32": self.keep_fp32, "init_scale": self.init_scale, "lr_scale": self.lr_scale,
                      "optimizer": self.optimizer, "carries": self.carries, "stays_finite": self.carries,
                      "first_nonfinite_step": self.first_nonfinite_step, "skipped_steps": self.skipped_steps,
                      "recorded_first_nonfinite_step": self.recorded_first_nonfinite_step,
                      "steps": [s.to_dict() for s in self.steps], "notes": self.notes,
                      "param_dtype": self.param_dtype, "recorded_param_dtype": self.recorded_param_dtype,
                      "update_rounding": self.update_rounding, "lost_share": self.lost_share},
                     keep_nonfinite=True)

    def table(self) -> pd.DataFrame:
        return pd.DataFrame([{k: getattr(s, k) for k in STEP_COLUMNS} for s in self.steps], columns=STEP_COLUMNS)

    def lines(self) -> list[str]:
        remedy = remedy_words(self)
        out = [f"window steps {self.window_steps[0]}-{self.window_steps[1]} (rank {self.rank}, saved when "
               f"step {self.trigger_step} triggered), re-run steps {self.from_step}-{self.to_step} {remedy}, "
               f"optimizer {self.optimizer}"]
        out += [f"note: {n}" for n in self.notes]
        if self.carries:
            out.append(f"stays finite over all {len(self.remedied)} step(s)"
                       + (f"; the scaler skipped step(s) {', '.join(map(str, self.skipped_steps))}"
                          if self.skipped_steps else ""))
        else:
            out.append(f"does NOT stay finite: non-finite at step {self.first_nonfinite_step}"
                       + (" (before the remedy applies: the recorded prefix)"
                          if not next(s for s in self.steps if not s.finite).remedied else ""))
        rec = self.recorded_first_nonfinite_step
        if rec is not None:
            out.append(f"as recorded, the loss was first non-finite at step {rec}")
        if self.lost_share is not None:
            out.append(f"{self.lost_share:.1%} of the optimizer's updates left the weights the run held in "
                       f"{self.recorded_param_dtype} unchanged")
        return out


def remedy_words(r) -> str:
    parts = [f"in {r.precision}" + (" (as recorded)" if r.precision == r.recorded_precision else "")]
    if r.keep_fp32:
        parts.append("keeping " + ", ".join(r.keep_fp32) + " in float32")
    if r.init_scale is not None:
        parts.append(f"from loss scale {r.init_scale:g}")
    if r.lr_scale != 1.0:
        parts.append(f"learning rate x{r.lr_scale:g}")
    if r.param_dtype != "recorded":
        parts.append(f"parameters in {r.param_dtype}")
    if r.update_rounding != "nearest":
        parts.append(f"updates rounded {r.update_rounding}ally")
    return ", ".join(parts)


def rerun_command(run, window, *, precision="fp32", model: str | None = None, keep_fp32=(), from_step=None,
                  loss: str | None = None, lr_scale: float = 1.0, param_dtype: str | None = None,
                  update_rounding: str = "nearest") -> str:
    """The command line that re-runs `window` (a `Window`, or (first, last));
    `loss`: the --loss spec, or "FILE.py:FN" where the window kept the loss's
    calls and none was given."""
    first, last = (window.first_step, window.last_step) if hasattr(window, "first_step") else window
    start = first if from_step is None else from_step
    parts = ["amp-postmortem", "rerun", shlex.quote(str(run)), "--from", str(start), "--steps",
             str(last - start + 1), "--precision", precision]
    for m in keep_fp32:
        parts += ["--keep-fp32", shlex.quote(m)]
    if lr_scale != 1.0:
        parts += ["--lr-scale", f"{lr_scale:g}"]
    if param_dtype is not None:
        parts += ["--param-dtype", param_dtype]
    if update_rounding != "nearest":
        parts += ["--update-rounding", update_rounding]
    parts += ["--model", shlex.quote(model) if isinstance(model, str) else "SPEC"]
    if loss is not None:
        parts += ["--loss", shlex.quote(loss)]
    return " ".join(parts)


def loss_kept(window) -> str | None:
    """The name of the loss whose calls `window` kept (None: none kept)."""
    meta = (window.meta if hasattr(window, "meta") else window).get("loss")
    return meta.get("name") if isinstance(meta, dict) and meta.get("kept") else None


class LossNeededError(ModelSpecError):
    """The window kept the calls of the loop's loss (`kept`, its name) and
    no `--loss` named it: the words name the command to add it to."""

    def __init__(self, kept: str | None, command: str = "rerun"):
        self.kept = kept
        super().__init__(loss_needed(kept, command))


def loss_needed(kept: str | None, command: str = "rerun") -> str:
    """How to add the loop's loss to `amp-postmortem COMMAND` (one of the
    commands that take --loss: rerun, summary, fix, scale-window,
    recommend)."""
    return (f"the loop computes its loss outside the model ({_short(kept)}, whose targets the window kept): "
            f"add --loss FILE.py:NAME to `amp-postmortem {command}` (the criterion or function "
            "the loop calls, from your own file: called as the loop called it)")


def resolve_loss(loss):
    """`--loss FILE.py:fn` (or package.module:name, or a callable): the loss
    the loop called; a class (an nn.Module criterion's) is built with no
    arguments."""
    from ..errors import LossFnSpecError
    from ..replaying.model_spec import resolve_factory
    if loss is None:
        return None
    fn = loss if callable(loss) and not isinstance(loss, type) else None
    if fn is None:
        fn = resolve_factory(loss, what="loss spec", error=LossFnSpecError,
                             forms="path/to/file.py:name or package.module:name") if isinstance(loss, str) else loss
        if isinstance(fn, type):
            try:
                fn = fn()
            except Exception as exc:  # noqa: BLE001 - the user's class
                raise LossFnSpecError(f"loss spec {loss!r}: building {fn.__name__}() failed: "
                                      f"{type(exc).__name__}: {exc}") from None
    if not callable(fn):
        raise LossFnSpecError(f"loss spec {loss!r} names {type(fn).__name__}, not a callable loss")
    return fn


# ------------------------------------------------------------------ running
def rerun_window(run_dir, *, from_step: int | None = None, steps: int | None = None, rank: int | None = None,
                 model=None, precision: str = "recorded", keep_fp32=(), init_scale: float | None = None,
                 lr_scale: float = 1.0, device: str = "cpu", policy: str = "recorded", loss_fn=None,
                 optimizer=None, window=None, recorded=None, fp32_lines=(), use_scaler: bool = True,
                 loss=None, param_dtype: str | None = None, update_rounding: str = "nearest",
                 watchers=(), evaluate: bool = False) -> RerunResult:
    """Re-run the saved window holding `from_step` (default: the first
    window, from its first step) for `steps` steps (default: to its end)
    under the remedy. `recorded`: {step: (loss, skipped, loss_scale_before)}
    of the run (read from `run_dir` when None). `fp32_lines`: (file, line)
    pairs of the model's source run in float32 (`fix`'s op-level remedy).
    A model given as a module is copied: the re-run trains the copy.
    `use_scaler=False`: the remedied steps run without a GradScaler (the
    bfloat16 advice's "no GradScaler"). `loss`: the loop's loss (a callable
    or a `--loss` spec), called as the window's kept calls say.
    `param_dtype`: "recorded" (the window's dtypes) or "float32" (master
    weights where the run held bf16/fp16 ones); None: float32/float64 for
    an fp32/fp64 re-run, else recorded. `update_rounding`: "stochastic"
    rounds the low-precision parameters' updates stochastically from the
    remedied steps on. `watchers`: more `weight_updates` watchers of the
    remedied steps' updates. `evaluate`: measure the float32 loss of the
    re-run's batches with the weights before and after (`window_loss`)."""
    import copy

    import torch

    from ..replaying import resolve_policy
    from ..replaying.model_spec import bundle_folders, resolve_model
    from ..replaying.run_config import preserved_rng
    from ..reading.window import find_window
    from .weight_updates import StochasticRounding, UpdateCount, hold_params, state_in_float32, window_param_dtype

    if precision not in RERUN_PRECISIONS:
        raise OptionError(f"precision {precision!r} is not one of {', '.join(RERUN_PRECISIONS)}")
    if not float(lr_scale) > 0 or not math.isfinite(float(lr_scale)):
        raise OptionError(f"lr_scale {lr_scale!r} is not a positive number")
    if init_scale is not None and not (float(init_scale) > 0 and math.isfinite(float(init_scale))):
        raise OptionError(f"init_scale {init_scale!r} is not a positive number")
    if param_dtype is not None and param_dtype not in PARAM_DTYPES:
        raise OptionError(f"param_dtype {param_dtype!r} is not one of {', '.join(PARAM_DTYPES)}")
    if update_rounding not in UPDATE_ROUNDINGS:
        raise OptionError(f"update_rounding {update_rounding!r} is not one of {', '.join(UPDATE_ROUNDINGS)}")
    w = window or find_window(run_dir, from_step, rank)
    if w is None and from_step is not None:
        from ..reading.window import window_spans
        spans = window_spans(run_dir, rank)
        if spans:
            raise OptionError(f"--from {from_step} is outside the saved windows (steps "
                              + ", ".join(f"{s['first_step']}-{s['last_step']}" for s in spans) + ")")
    if w is None:
        raise BundleError(f"no counterfactual window{'' if from_step is None else f' holding step {from_step}'} "
                          f"in {run_dir}: record with AmpRecorder(..., bundles=BundlePolicy(window_steps=K))")
    start = w.first_step if from_step is None else int(from_step)
    if not w.first_step <= start <= w.last_step:
        raise OptionError(f"--from {start} is outside the window (steps {w.first_step}-{w.last_step})")
    if steps is not None and int(steps) < 1:
        raise OptionError(f"--steps {steps} is not a positive number of steps")
    end = w.last_step if steps is None else min(w.last_step, start + int(steps) - 1)
    loss = _LoopLoss(resolve_loss(loss), loss_kept(w), w) if (loss is not None or loss_kept(w)) else None
    recorded = recorded if recorded is not None else recorded_steps(run_dir, w.rank)
    ac = w.autocast or {}
    recorded_precision = {"float16": "fp16", "bfloat16": "bf16"}.get(ac.get("dtype"), "fp32") \
        if ac.get("enabled") else "fp32"
    wanted = recorded_precision if precision == "recorded" else precision
    dev = torch.device(device)
    with preserved_rng(dev):
        if isinstance(model, torch.nn.Module):
            model = copy.deepcopy(model)
        net = resolve_model(model, w.model_class, forbidden=bundle_folders(w, run_dir))
        from ..replaying.model_spec import load_weights
        load_weights(net, {**w.params, **w.buffers})
        with torch.no_grad():
            for name, b in net.named_buffers():
                if name in w.extra_buffers:
                    b.copy_(w.extra_buffers[name])
        net.to(dev)
        held = param_dtype or ("float32" if wanted in ("fp32", "fp64") and precision != "recorded" else "recorded")
        low = hold_params(net, w, held)  # before the optimizer: its state takes the parameters' dtypes
        if wanted == "fp64":
            net.double()
        net.train(bool(w.meta.get("training", True)))
        opt, opt_name = build_optimizer(net, w, optimizer)
        rounding = None
        if update_rounding == "stochastic" and low:
            rounding = StochasticRounding()
            state_in_float32(opt, [p for _, p in low])  # the update is computed in float32
        count = UpdateCount() if low else None
        watch = tuple(x for x in (count, *watchers, rounding) if x is not None)
        start_loss = _window_loss(net, w, start, end, loss_fn, loss, dev) if evaluate else None
        notes = []
        if w.meta.get("inputs_exact") is False:
            notes.append("some inputs were changed in place after their step: those steps re-run on the "
                         "changed values (record with clone_inputs=True)")
        result = RerunResult(
            window_path=w.path, rank=w.rank, window_steps=[w.first_step, w.last_step], trigger_step=w.trigger_step,
            from_step=start, to_step=end, precision=wanted, recorded_precision=recorded_precision,
            keep_fp32=list(keep_fp32 or ()), init_scale=None if init_scale is None else float(init_scale),
            lr_scale=float(lr_scale), optimizer=opt_name, steps=[], notes=notes,
            param_dtype="recorded" if held == "recorded" else ("float64" if wanted == "fp64" else held),
            recorded_param_dtype=window_param_dtype(w), update_rounding=update_rounding if low else "nearest")
        if rounding is not None:
            notes.append("stochastic rounding: each update computed in float32 (the optimizer's state held in "
                         "float32) and rounded to the parameter's dtype up or down with the odds of its remainder")
        recorded_scaler = _scaler(w, recorded, recorded_precision, dev, None)
        hyper = [_hyper(g) for g in (w.optimizer or {}).get("param_groups") or []]
        remedy_scaler = None
        for s in w.steps:
            if s.step > end:
                break
            remedied = s.step >= start
            if remedied and remedy_scaler is None:
                remedy_scaler = (_scaler(w, recorded, wanted, dev, init_scale, carry=recorded_scaler, first=s.step)
                                 if use_scaler else False)
            scaler = (remedy_scaler or None) if remedied else recorded_scaler
            prec = wanted if remedied else recorded_precision
            config = _config(prec, device, resolve_policy(policy, w, prec) if prec in ("fp16", "bf16") else None,
                             w.precision_flags, tuple(keep_fp32 or ()) if remedied else (),
                             tuple(fp32_lines or ()) if remedied else ())
            hyper = s.optimizer_groups or hyper
            result.steps.append(_train_step(net, opt, scaler, s, hyper, config, recorded.get(s.step),
                                            lr_scale if remedied else 1.0, loss_fn, dev, remedied, loss,
                                            watch if remedied else (count,) if count else (), low))
        if count is not None:
            taken = [i for i, st in enumerate(result.steps) if st.remedied]
            result.updates = (sum(count.moved[i] for i in taken), sum(count.unchanged[i] for i in taken))
        if evaluate:
            result.window_loss = (start_loss, _window_loss(net, w, start, end, loss_fn, loss, dev))
    return result


def _window_loss(net, w, start: int, end: int, loss_fn, loss, dev) -> float | None:
    """The mean float32 loss of the window's steps `start`..`end` (their
    recorded inputs and RNG states) with `net`'s weights as they are, on a
    float32 copy without autocast: the same yardstick for every re-run,
    whatever precision it trained in; None where a loss is not finite."""
    import copy

    import torch

    from ..replaying.capture import map_tensors
    from ..replaying.run_config import set_rng
    loop_loss = _LoopLoss(resolve_loss(loss), loss_kept(w), w) if (loss is not None or loss_kept(w)) else None
    probe = copy.deepcopy(net).float()
    total, count = 0.0, 0

    def cast(t):
        t = t.detach().to(dev)
        return t.float() if t.is_floating_point() else t

    with torch.no_grad():
        for s in w.steps:
            if not start <= s.step <= end:
                continue
            for k, ((args, kwargs), rng) in enumerate(zip(s.inputs, s.rng)):
                set_rng(rng.get("cpu"), rng.get("cuda"), dev)
                output = probe(*map_tensors(tuple(args), cast), **map_tensors(dict(kwargs), cast))
                value = _step_loss(output, s, k, cast, loss_fn, loop_loss)
                total += float(value.detach().double())
                count += 1
    return total / count if count and math.isfinite(total) else None


def _step_loss(output, s, k, cast, loss_fn, loop_loss):
    """The micro-batch's loss from the model's output: the loop's (`--loss`),
    else `loss_fn`'s, else the model's own."""
    import torch

    from ..replaying.outputs import find_loss
    loss = None
    if loop_loss is not None and loss_fn is None:
        loss = loop_loss(output, s, k, cast) if loop_loss.fn is not None else find_loss(output)
        if loss is None:
            loss = loop_loss(output, s, k, cast)  # says what is missing
    if loss is None:
        loss = loss_fn(output, k) if loss_fn is not None else find_loss(output)
    if loss is None or not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ModelSpecError("the rerun needs the loss: the model returned no scalar loss (nor .loss), and "
                             "the window kept no call of the loop's loss: record with "
                             "AmpRecorder(..., loss_fn=criterion) (the criterion the loop calls, its "
                             "targets then kept in the window) and re-run with --loss FILE.py:NAME (rerun, "
                             "summary, fix, scale-window and recommend take it); "
                             "when the targets are among the model's inputs, pass --loss-fn "
                             "package.module:function, called as loss_fn(output, micro_batch)")
    return loss


def _config(precision, device, policy, flags, fp32_modules, fp32_lines):
    from ..replaying.run_config import RunConfig
    return RunConfig(precision, device=device, policy=policy, fp32_modules=fp32_modules, fp32_lines=fp32_lines,
                     precision_flags=flags)


def recorded_steps(run_dir, rank: int) -> dict:
    """{step: (loss, skipped, loss_scale_before)} of the run's rank."""
    from ..reading.loader import load_run
    try:
        run = load_run(run_dir, rank=rank)
    except Exception:  # noqa: BLE001 - a window copied out of its run: no recorded losses
        return {}
    s = run.steps
    out = {}
    for row in s.itertuples(index=False):
        scale = getattr(row, "loss_scale_before", None)
        out[int(row.step)] = (None if row.loss is None else float(row.loss), bool(row.skipped),
                              None if scale is None or scale != scale else float(scale))
    return out


def build_optimizer(net, w, optimizer=None):
    """The optimizer over `net`'s parameters with the window's state."""
    import torch
    rec = w.optimizer
    if rec is None:
        raise ModelSpecError("the window recorded no optimizer: the rerun needs the one the job used")
    named = dict(net.named_parameters(remove_duplicate=False))
    groups = rec.get("param_groups") or []
    if optimizer is not None:
        opt = optimizer(net) if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer) else optimizer
        if not isinstance(opt, torch.optim.Optimizer):
            raise ModelSpecError(f"the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
        name = f"{type(opt).__name__} (yours)"
    else:
        cls_name = OPTIMIZERS.get(rec.get("class"))
        if cls_name is None:
            raise ModelSpecError(f"the run's optimizer {rec.get('class')!r} is not one the rerun rebuilds "
                                 f"({', '.join(sorted(set(OPTIMIZERS.values())))}): pass --optimizer "
                                 "package.module:factory, called as factory(model), returning it")
        cls = getattr(torch.optim, cls_name)
        built = []
        for g in groups:
            try:
                params = [named[n] for n in g["params"]]
            except KeyError as exc:
                raise ModelSpecError(f"the window's optimizer names parameter {exc.args[0]!r}, which the model "
                                     "lacks; build the model the run trained") from None
            built.append({**_hyper(g), "params": params})
        try:
            opt = cls(built, **({"lr": built[0]["lr"]} if built and "lr" in built[0] else {}))
        except Exception as exc:  # noqa: BLE001 - recorded hyperparameters this torch refuses
            raise ModelSpecError(f"rebuilding {cls_name} from the window failed: {type(exc).__name__}: {exc}") from None
        name = cls_name
    _load_state(opt, net, w)
    return opt, name


def _hyper(g: dict) -> dict:
    out = {}
    for k, v in g.items():
        if k == "params" or isinstance(v, dict):
            continue
        out[k] = tuple(v) if isinstance(v, list) else v
    return out


def _load_state(opt, net, w) -> None:
    import torch
    if not w.optimizer_state:
        return
    ids = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    named = dict(net.named_parameters(remove_duplicate=False))
    state: dict = {}
    for pname, key, value in w.optimizer_state:
        p = named.get(pname)
        if p is None or id(p) not in ids:
            raise ModelSpecError(f"the window's optimizer state names parameter {pname!r}, which the optimizer "
                                 "does not hold")
        state.setdefault(ids[id(p)], {})[key] = value.clone() if isinstance(value, torch.Tensor) else value
    sd = opt.state_dict()
    sd["state"] = state
    opt.load_state_dict(sd)


def _scaler(w, recorded, precision, dev, init_scale, *, carry=None, first=None):
    """A GradScaler for `precision` (None for fp32/fp64, or a job without
    an enabled scaler and no `init_scale`): the recorded settings, from
    `init_scale`, else the scale `carry` (the scaler of the recorded prefix)
    reached, else the window's saved scale, else the recorded scale of the
    step."""
    import torch
    sc = w.scaler or {}
    has = w.scaler is not None and sc.get("enabled", True) is not False
    if precision not in ("fp16", "bf16") or not (has or init_scale is not None):
        return None
    scale, tracker = None, 0
    if init_scale is not None:
        scale = float(init_scale)
    elif carry is not None:
        scale, tracker = carry.get_scale(), int(carry._get_growth_tracker())
    elif "scale" in w.scaler_state:
        scale = float(w.scaler_state["scale"].double())
        tracker = int(w.scaler_state["growth_tracker"]) if "growth_tracker" in w.scaler_state else 0
    if scale is None:
        at = recorded.get(first if first is not None else w.first_step)
        scale = (at[2] if at and at[2] else None) or sc.get("init_scale") or 2.0 ** 16
    scaler = torch.amp.GradScaler(dev.type, init_scale=scale, growth_factor=sc.get("growth_factor") or 2.0,
                                  backoff_factor=sc.get("backoff_factor") or 0.5,
                                  growth_interval=sc.get("growth_interval") or 2000)
    scaler._lazy_init_scale_growth_tracker(dev)
    scaler._growth_tracker.fill_(tracker)
    return scaler


class _LoopLoss:
    """The loop's loss (`fn`, the user's) over a window's kept calls (the
    loss named `kept`)."""

    def __init__(self, fn, kept: str | None, w):
        self.fn, self.kept, self.window = fn, kept, w

    def __call__(self, output, step, k, cast):
        from ..reading.window import PREDICTION_KEY
        calls = step.losses[k] if k < len(step.losses) else None
        if calls is None:
            if self.fn is None:
                return None
            raise ModelSpecError(f"--loss needs the loss's targets, and the window kept no call of the loss at "
                                 f"step {step.step}: record with AmpRecorder(..., loss_fn=criterion) (the "
                                 "criterion the loop calls)" if not self.kept else
                                 f"the window kept no call of {self.kept} at step {step.step} (micro-batch "
                                 f"{k}): the loop called it by another name than the one recorded")
        if self.fn is None:
            raise LossNeededError(self.kept)
        if calls["calls"] > 1:
            raise ModelSpecError(f"the loop called {_short(self.kept)} {calls['calls']} times in one micro-batch "
                                 f"(step {step.step}): the window kept the first call only, and the loss of "
                                 "several calls cannot be rebuilt from it")
        preds = _predictions(output)

        def fill(obj):
            if isinstance(obj, dict) and PREDICTION_KEY in obj:
                i = int(obj[PREDICTION_KEY])
                if not preds:
                    raise ModelSpecError("the model's output holds no tensor to put in the loss's prediction")
                p = preds[i] if i < len(preds) else preds[0]
                shape = tuple(obj.get("shape") or ())
                if tuple(p.shape) != shape and p.numel() == math.prod(shape):
                    p = p.reshape(shape)  # the loop's own view of the output (logits.view(-1, V))
                return p
            if isinstance(obj, tuple):
                return tuple(fill(v) for v in obj)
            if isinstance(obj, list):
                return [fill(v) for v in obj]
            if isinstance(obj, dict):
                return {key: fill(v) for key, v in obj.items()}
            return cast(obj) if hasattr(obj, "is_floating_point") else obj

        try:
            return self.fn(*fill(calls["args"]), **fill(calls["kwargs"]))
        except ModelSpecError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's loss
            raise ModelSpecError(f"the loss given with --loss raised at step {step.step}: "
                                 f"{type(exc).__name__}: {exc}") from None


def _short(name: str | None) -> str:
    return (name or "the loss").rpartition(".")[2]


def _predictions(output) -> list:
    """The model output's tensors, in order (`.logits` first)."""
    import torch
    if isinstance(output, torch.Tensor):
        return [output]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return [logits]
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return [t for t in items if isinstance(t, torch.Tensor)]


def _train_step(net, opt, scaler, s, hyper, config, recorded, lr_scale, loss_fn, dev, remedied,
                loop_loss=None, watchers=(), low=()) -> RerunStep:
    import torch

    from ..replaying.engine import fp32_modules_kept
    from ..replaying.fp32_lines import float32_lines
    from ..replaying.run_config import autocast_device_types, autocast_for, numerics_flags, set_rng
    from ..replaying.capture import map_tensors

    # The step's recorded hyperparameters (a scheduler's lr included), the
    # learning rate times lr_scale; a step without them keeps the last ones.
    for g, h in zip(opt.param_groups, hyper):
        for k in _STEP_KEYS:
            if k in h and k in g:
                g[k] = tuple(h[k]) if isinstance(h[k], list) else h[k]
        if "lr" in h and "lr" in g and not isinstance(g["lr"], torch.Tensor):
            g["lr"] = h["lr"] * lr_scale
    dtype = config.dtype

    def cast(t):
        # As the replay engine casts a step's inputs: float32/float64 runs
        # take every floating input in their dtype; reduced runs keep float32
        # inputs and those in their own dtype, others start from float32.
        t = t.detach().to(dev)
        if not t.is_floating_point():
            return t
        if config.precision in ("fp32", "fp64"):
            return t.to(dtype)
        return t if t.dtype in (torch.float32, dtype) else t.float()

    opt.zero_grad(set_to_none=True)
    scale = scaler.get_scale() if scaler is not None else None
    total = 0.0
    finite = True
    with numerics_flags(config):
        for k, ((args, kwargs), rng) in enumerate(zip(s.inputs, s.rng)):
            set_rng(rng.get("cpu"), rng.get("cuda"), dev)
            args, kwargs = map_tensors(tuple(args), cast), map_tensors(dict(kwargs), cast)
            devices = autocast_device_types(config)
            with fp32_modules_kept(net, config.fp32_modules, devices), autocast_for(config), \
                    float32_lines(config.fp32_lines, devices):
                output = net(*args, **kwargs)
                loss = _step_loss(output, s, k, cast, loss_fn, loop_loss)
            value = float(loss.detach().double())
            total += value
            finite = finite and math.isfinite(value)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        skipped = False
        if scaler is not None and watchers:
            scaler.unscale_(opt)  # before the watchers: they see the gradients the optimizer applies
        for w in watchers:
            w.before(low)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            skipped = scaler.get_scale() < scale  # a backoff: the step found Inf/NaN and was skipped
        else:
            opt.step()
        for w in reversed(watchers):
            w.after(low, skipped)
    weights = all(bool(torch.isfinite(p).all()) for p in net.parameters())
    rec_loss, rec_skipped = (recorded[0], recorded[1]) if recorded else (None, None)
    from .weight_updates import UpdateCount
    count = next((w for w in watchers if isinstance(w, UpdateCount)), None)
    return RerunStep(step=s.step, finite=finite and weights, loss=total, recorded_loss=rec_loss, skipped=skipped,
                     recorded_skipped=rec_skipped, loss_scale=scale, remedied=remedied,
                     lost_share=count.share() if count is not None and not skipped else None)
