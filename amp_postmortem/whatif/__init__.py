"""What-if replays: change one thing about a saved step and replay it.

    fix.find_fix(...)                 which module kept in float32 saves the step
    scale_window.replay_scale_window  the loss scales that neither overflow nor underflow
    scale_window.estimate_scale_window  the same, estimated from recorded statistics only
    bisect.bisect_samples(...)        which samples of the batch make it non-finite

Each is a pure function of a bundle and a model factory returning a small
report (`to_dict()`, `table()`, `lines()`), built on the replay engine's
what-if hooks (`RunConfig.fp32_modules`, `loss_scale`, `batch`). This module
holds the plumbing they share: opening a step (`prepare`), measuring one
trial against the float64 reference (`trial_metrics`) and the one judgement
of whether a trial saves the step (`judge`, used by fix, bisect and
recommend through `Prepared.trial`), and the run's other saved steps a
remedy found on one is tried on (`other_bundles`, `prepare_like`). Nothing here imports torch at import
time, so `scale-window` without a model stays torch-free.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field

from ..names import ROOT_DISPLAY, BackwardStart

# A replay "saves" the step (`judge`) when it is finite end to end, no
# parameter gradient (one with a real gradient) is further from float64 than
# the replay's propagated broken threshold of its precision
# (attribution.PROPAGATED_BROKEN_REL: 0.25 fp16, 0.5 bf16) and no module's
# own arithmetic is `broken` (the replay's culprit rule,
# attribution.find_culprit). The thresholds are the replay's: one yardstick.
# A trial whose backward overflows is retried at lower scales down to this
# one: below 1 a loss scale protects nothing (analyses.scale.LOW_SCALE).
MIN_BACKOFF_SCALE = 1.0
# The note a step whose float64 run is non-finite carries (words only:
# decisions read `Prepared.reference_finite`).
REFERENCE_NONFINITE_NOTE = ("the float64 reference is itself non-finite: this is not a precision problem "
                            "(check the data: `bisect`)")


class NotSavedBy(enum.Enum):
    """Which check of `judge` a trial failed (the checks run in this order)."""
    NOTHING = "nothing"              # saved
    NONFINITE = "nonfinite"          # NaN/Inf in the forward or the backward, or the run raised
    PARAMS_OFF = "params_off"        # parameter gradients beyond the broken threshold of float64
    BROKEN_MODULE = "broken_module"  # a module's own arithmetic is broken (the culprit)


@dataclass(frozen=True)
class Trial:
    """One trial (`Prepared.trial`): the replay measured against float64
    (`trial_metrics`) and its `judge`ment. What fix, bisect and recommend
    decide on; `to_dict` is its `--json` form (the keys are a contract),
    made only where output is rendered. `modules` and `round` are fix's
    (None: not a fix trial, and the keys are left out). `of` reads a dict
    of those keys (tolerating the ones a partial trial lacks)."""
    saved: bool
    finite: bool
    forward_finite: bool
    backward_finite: bool
    nonfinite_values: int | None
    loss_scale: float | None
    backoffs: int
    grad_rel_err: float | None
    params_off: dict
    culprit: dict | None
    why: str | None
    error: str | None
    modules: tuple | None = None
    round: int | None = None
    nonfinite_params: int | None = None
    loss: float | None = None
    loss_rel_err: float | None = None
    output_rel_err: float | None = None
    worst_param: str | None = None
    worst_param_rel_err: float | None = None

    @classmethod
    def of(cls, t) -> "Trial":
        if isinstance(t, Trial):
            return t
        finite = bool(t.get("finite"))
        return cls(saved=bool(t.get("saved")), finite=finite,
                   forward_finite=bool(t.get("forward_finite", finite)),
                   backward_finite=bool(t.get("backward_finite", finite)),
                   nonfinite_values=t.get("nonfinite_values"), loss_scale=t.get("loss_scale"),
                   backoffs=int(t.get("backoffs") or 0), grad_rel_err=t.get("grad_rel_err"),
                   params_off=dict(t.get("params_off") or {}), culprit=t.get("culprit") or None,
                   why=t.get("why"), error=t.get("error"),
                   modules=tuple(t["modules"]) if t.get("modules") is not None else None,
                   round=t.get("round"), nonfinite_params=t.get("nonfinite_params"), loss=t.get("loss"),
                   loss_rel_err=t.get("loss_rel_err"), output_rel_err=t.get("output_rel_err"),
                   worst_param=t.get("worst_param"), worst_param_rel_err=t.get("worst_param_rel_err"))

    def to_dict(self) -> dict:
        """The trial's `--json` form, its keys in their historical order."""
        head = {} if self.modules is None else {"modules": list(self.modules)}
        if self.round is not None:
            head["round"] = self.round
        return {**head, "finite": self.finite, "forward_finite": self.forward_finite,
                "backward_finite": self.backward_finite, "nonfinite_values": self.nonfinite_values,
                "nonfinite_params": self.nonfinite_params, "loss": self.loss, "loss_rel_err": self.loss_rel_err,
                "output_rel_err": self.output_rel_err, "grad_rel_err": self.grad_rel_err,
                "worst_param": self.worst_param, "worst_param_rel_err": self.worst_param_rel_err,
                "params_off": dict(self.params_off), "error": self.error, "loss_scale": self.loss_scale,
                "backoffs": self.backoffs, "saved": self.saved, "why": self.why, "culprit": self.culprit}

    def with_modules(self, modules, round: int | None = None) -> "Trial":
        return dataclasses.replace(self, modules=tuple(modules), round=round)

    @property
    def not_saved_by(self) -> NotSavedBy:
        if self.saved:
            return NotSavedBy.NOTHING
        if not self.finite:
            return NotSavedBy.NONFINITE
        if self.params_off:
            return NotSavedBy.PARAMS_OFF
        return NotSavedBy.BROKEN_MODULE

    @property
    def nonfinite_phases(self) -> list:
        """"forward" and/or "backward": where the trial holds NaN/Inf."""
        return [w for w, ok in (("forward", self.forward_finite), ("backward", self.backward_finite)) if not ok]

    @property
    def backed_off(self) -> bool:
        return bool(self.backoffs)


@dataclass
class Prepared:
    """One saved step, ready for what-if trials."""
    bundle: object
    session: object             # replay.ReplaySession
    precision: str              # the reduced precision the trials run in ("fp16" / "bf16")
    config: object              # replay.RunConfig of that precision, as recorded
    reference: object           # float64 StepCapture (inputs kept when asked)
    notes: list = field(default_factory=list)
    backward_start: BackwardStart = BackwardStart.SAVED  # engine.ReplaySession.start_backward
    # Whether the float64 run's outputs are finite: where it is not, no
    # precision setting repairs the step (fix, recommend decide on this,
    # never on the note that says it).
    reference_finite: bool = True

    @property
    def step(self) -> int:
        return self.bundle.step

    @property
    def rank(self) -> int:
        return self.bundle.rank

    @property
    def loss_scale(self) -> float:
        return float(self.config.loss_scale)

    def run(self, *, capture: bool = False, **changes):
        """Replay the step with `changes` to the recorded config."""
        return self.session.run(self.config.replace(**changes) if changes else self.config, capture=capture)

    def reference_for(self, batch=None, *, keep_inputs: bool = False, running_statistics: bool = False):
        """The float64 run of the whole batch (kept) or of a slice of it,
        with every module's inputs when `keep_inputs` (local comparisons);
        `running_statistics` as the trial it is the reference of."""
        from ..replaying import RunConfig
        if batch is None and not running_statistics:
            if keep_inputs and not any(c.inputs is not None for c in self.reference.calls.values()):
                self.reference = self.session.run(RunConfig("fp64", device=self.config.device), keep_inputs=True)
            return self.reference
        return self.session.run(RunConfig("fp64", device=self.config.device,
                                          batch=None if batch is None else list(batch),
                                          running_statistics=running_statistics), keep_inputs=keep_inputs)

    def trial(self, *, backoff: bool = True, **changes) -> Trial:
        """`trial_metrics` of one replay and its `judge`ment (`saved`,
        `why`, `culprit`). With `backoff`, a trial whose forward is finite
        but whose backward overflows at the recorded loss scale is judged at
        the highest lower power-of-two scale (down to `MIN_BACKOFF_SCALE`)
        where it is finite, as a dynamic scaler would back off to it;
        `loss_scale` and `backoffs` say where."""
        # A slice's float64 run keeps its inputs at once: it is not cached.
        sliced = changes.get("batch") is not None or bool(changes.get("running_statistics"))
        reference = self.reference_for(changes.get("batch"), keep_inputs=sliced,
                                       running_statistics=bool(changes.get("running_statistics")))
        t = self._finite_trial(reference, backoff, changes)
        return dataclasses.replace(t, **judge(self, t, reference, changes).fields())

    def _finite_trial(self, reference, backoff: bool, changes: dict) -> Trial:
        changes = dict(changes)
        scale = float(changes.pop("loss_scale", self.loss_scale))
        first = trial_metrics(self.run(loss_scale=scale, **changes), reference, loss_scale=scale)
        if not backoff or first.finite or not first.forward_finite or scale <= MIN_BACKOFF_SCALE:
            return first
        # Overflow is monotone in the scale: bisect the halvings for the
        # fewest that make the backward finite.
        top = max(0, int(math.floor(math.log2(scale / MIN_BACKOFF_SCALE))))
        lo, hi, best = 1, top, None
        while lo <= hi:
            mid = (lo + hi) // 2
            t = trial_metrics(self.run(loss_scale=scale / 2 ** mid, **changes), reference,
                              loss_scale=scale / 2 ** mid, backoffs=mid)
            if t.finite:
                best, hi = t, mid - 1
            else:
                lo = mid + 1
        return first if best is None else best

    def policy_dict(self) -> dict:
        p = self.config.policy
        device = getattr(p, "device_type", None)
        return {"device_type": device, "emulated": bool(device and device != self.config.device)}


def load_step(source, step=None, rank=None):
    """A `Bundle` from a loaded bundle, a bundle directory, or a run
    directory with `step` (and `rank`; default: the lowest that saved one)."""
    from pathlib import Path

    from ..reading import bundle as bundles
    from ..errors import BundleError
    if isinstance(source, bundles.Bundle):
        return source
    path = Path(source)
    if (path / "bundle.json").is_file():
        return bundles.load_bundle(path)
    if step is None:
        raise BundleError(f"{path} is not a bundle directory; give the step to replay (--step N)")
    return bundles.load_bundle(path, step=step, rank=rank)


def other_bundles(prepared) -> list:
    """(step, path) of the run's other saved bundles of the same rank, by
    step: what a remedy found on one step is tried on (`fix`, the scale
    window). Empty when the bundle does not sit in a run directory."""
    from pathlib import Path

    from ..reading import bundle as bundles
    path = Path(prepared.bundle.path)
    if len(path.parents) < 3 or path.parents[1].name != "bundles":
        return []
    run_dir = path.parents[2]
    return [(s, p) for s, r, p in bundles.list_bundles(run_dir) if r == prepared.rank and s != prepared.step]


def prepare_like(prepared, path, **options) -> "Prepared":
    """Another bundle opened the way `prepared` was (its model class, device,
    policy and precision): the run's steps are tried alike."""
    from ..replaying import ReplaySession, RunConfig
    bundle = load_step(path)
    session = ReplaySession(bundle, prepared.session._base, device=str(prepared.session.device))
    notes = session.start_backward(options.get("loss_fn"))
    config = prepared.config.replace(loss_scale=float(bundle.loss_scale or 1.0),
                                     precision_flags=dict(bundle.precision_flags or {}))
    reference = session.run(RunConfig("fp64", device=prepared.config.device),
                            keep_inputs=options.get("keep_inputs", False))
    reference_finite = _finite(reference.outputs)
    if not reference_finite:
        notes.append(REFERENCE_NONFINITE_NOTE)
    return Prepared(bundle=bundle, session=session, precision=prepared.precision, config=config,
                    reference=reference, notes=notes, backward_start=session.backward_start,
                    reference_finite=reference_finite)


def build(model, bundle):
    """The user's model (see `replaying.model_spec.resolve_model`)."""
    from ..replaying.model_spec import bundle_folders, resolve_model, saved_model_config
    return resolve_model(model, bundle.model_class, saved_model_config(bundle), forbidden=bundle_folders(bundle))


def prepare(source, step=None, *, rank=None, model=None, device: str = "cpu", policy: str = "recorded",
            precision: str | None = None, loss_fn=None, keep_inputs: bool = False,
            loss_scale: float | None = None) -> Prepared:
    """Open a saved step for what-if trials: the bundle, the model with its
    weights, the recorded reduced-precision config and the float64 run.

    `precision` defaults to the recorded one; a step recorded without
    autocast needs it given (`fp16` or `bf16`: "what if I enabled it").
    Where every backward starts is the replay's one rule
    (`ReplaySession.start_backward`): the saved output gradient, or, when it
    holds NaN/Inf (the training loss was already non-finite), the gradient
    of `loss_fn` at the float64 outputs, else the `substitute_mean`."""
    import torch

    from ..errors import DeviceError, PrecisionError
    from ..replaying import RunConfig, ReplaySession, recorded_precision, resolve_policy

    bundle = load_step(source, step, rank)
    net = build(model, bundle)
    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceError("device 'cuda' requested but CUDA is not available here; use --device cpu")
    precision = precision or recorded_precision(bundle)
    if precision not in ("fp16", "bf16"):
        raise PrecisionError(f"step {bundle.step} ran in {precision} (autocast off): nothing to replay in "
                             "reduced precision; pass precision='fp16' or 'bf16' to ask what it would do")
    session = ReplaySession(bundle, net, device=device)
    notes = session.start_backward(loss_fn)
    scale = float(loss_scale if loss_scale is not None else (bundle.loss_scale or 1.0))
    config = RunConfig(precision, device=device, policy=resolve_policy(policy, bundle, precision),
                       loss_scale=scale, precision_flags=dict(bundle.precision_flags or {}))
    reference = session.run(RunConfig("fp64", device=device), keep_inputs=keep_inputs)
    reference_finite = _finite(reference.outputs)
    if not reference_finite:
        notes.append(REFERENCE_NONFINITE_NOTE)
    return Prepared(bundle=bundle, session=session, precision=precision, config=config,
                    reference=reference, notes=notes, backward_start=session.backward_start,
                    reference_finite=reference_finite)


def trial_metrics(run, reference, *, loss_scale: float | None = None, backoffs: int = 0) -> Trial:
    """One replay against float64: finiteness, loss, output and gradient
    error, and the parameters whose gradient is further from float64 than
    the precision's broken threshold (`params_off`); not yet judged
    (`judge`), at `loss_scale`, `backoffs` halvings below the recorded one."""
    import torch

    from ..replaying import attribution
    out_bad = _nonfinite(t for mb in run.outputs for t in mb)
    grad_bad = _nonfinite(run.param_grads.values())
    sq_err = sq_ref = 0.0
    worst, worst_err = None, 0.0
    for name, ref in reference.param_grads.items():
        got = run.param_grads.get(name)
        if got is None:
            continue
        ref64 = ref.to(torch.float64)
        diff = got.to(torch.float64) - ref64
        e, r = float((diff ** 2).sum()), float((ref64 ** 2).sum())
        e = e if math.isfinite(e) else math.inf
        sq_err += e
        sq_ref += r
        rel = math.sqrt(e / r) if r > 0 else (0.0 if e == 0 else math.inf)
        if worst is None or rel > worst_err:
            worst, worst_err = name, rel
    grad_rel = math.sqrt(sq_err / sq_ref) if sq_ref > 0 else (0.0 if sq_err == 0 else math.inf)
    precision = run.config.precision
    limit = attribution.PROPAGATED_BROKEN_REL.get(precision, 0.25)
    per_param = attribution.param_grad_errors(reference.param_grads, {precision: run.param_grads})
    params_off = {n: e["rel_err"][precision] for n, e in per_param.items()
                  if precision in e["rel_err"] and not e["negligible"] and not e["nonfinite"].get(precision)
                  and e["rel_err"][precision] > limit}
    o_err = o_ref = 0.0
    for mb_run, mb_ref in zip(run.outputs, reference.outputs):
        for x, r in zip(mb_run, mb_ref):
            d = x.to(torch.float64) - r.to(torch.float64)
            e = float((d ** 2).sum())
            o_err += e if math.isfinite(e) else math.inf
            o_ref += float((r.to(torch.float64) ** 2).sum())
    out_rel = math.sqrt(o_err / o_ref) if o_ref > 0 else (0.0 if o_err == 0 else math.inf)
    loss, ref_loss = run.loss, reference.loss
    loss_rel = None
    if loss is not None and ref_loss is not None:
        loss_rel = abs(loss - ref_loss) / abs(ref_loss) if ref_loss else abs(loss - ref_loss)
        loss_rel = loss_rel if math.isfinite(loss_rel) else math.inf
    finite = run.error is None and out_bad == 0 and grad_bad == 0
    return Trial(saved=False, finite=finite, forward_finite=run.error is None and out_bad == 0,
                 backward_finite=run.error is None and grad_bad == 0, nonfinite_values=out_bad + grad_bad,
                 nonfinite_params=len(run.nonfinite_param_grads), loss=loss, loss_rel_err=loss_rel,
                 output_rel_err=out_rel, grad_rel_err=grad_rel, worst_param=worst,
                 worst_param_rel_err=worst_err if worst is not None else None, params_off=params_off,
                 error=run.error, loss_scale=loss_scale, backoffs=backoffs, culprit=None, why=None)


@dataclass(frozen=True)
class Judgement:
    """`judge`'s answer: whether the trial saves the step, why not in one
    sentence (None when saved), the broken module's comparison row."""
    saved: bool
    why: str | None = None
    culprit: dict | None = None

    def fields(self) -> dict:
        return {"saved": self.saved, "why": self.why, "culprit": self.culprit}


def judge(prepared, metrics: Trial, reference, changes: dict) -> Judgement:
    """Whether a trial saves the step: the one criterion of fix, bisect and
    recommend. Saved when (1) the replay is finite end to end, (2) no
    parameter gradient is further from float64 than the replay's broken
    threshold of the precision (`params_off`), and (3) no module's own
    arithmetic is `broken` under the replay's statuses and thresholds (its
    culprit rule, `attribution.find_culprit`, on local comparisons against
    the float64 run of the same batch). The checks run in that order and
    stop at the first that fails (the local replays are the costly one)."""
    from ..replaying import attribution
    if not metrics.finite:
        why = (f"the run raised {metrics.error}" if metrics.error else
               f"NaN/Inf in the {' and '.join(metrics.nonfinite_phases)}")
        return Judgement(False, why)
    if metrics.params_off:
        name, rel = max(metrics.params_off.items(), key=lambda kv: kv[1])
        limit = attribution.PROPAGATED_BROKEN_REL.get(changes.get("precision", prepared.precision), 0.25)
        return Judgement(False, f"{len(metrics.params_off)} parameter gradient(s) more than {limit:g} off "
                                f"float64 (worst {name}: {rel:.3g})")
    local_ref = (reference if any(c.inputs is not None for c in reference.calls.values())
                 else prepared.reference_for(changes.get("batch"), keep_inputs=True,
                                             running_statistics=bool(changes.get("running_statistics"))))
    run_changes = {k: v for k, v in changes.items() if k != "loss_scale"}
    run = prepared.run(capture=True, loss_scale=metrics.loss_scale, **run_changes)
    comparisons = attribution.compare_run(prepared.session, local_ref, run, local=True)
    culprit = attribution.find_culprit(comparisons, run.config.precision)
    if culprit is not None:
        return Judgement(False, f"{culprit['name'] or ROOT_DISPLAY} is broken in the {culprit['phase']}: "
                                f"{culprit['reason']}", culprit)
    return Judgement(True)


def _nonfinite(tensors) -> int:
    import torch
    return sum(int((~torch.isfinite(t)).sum()) for t in tensors)


def _finite(outputs) -> bool:
    return _nonfinite(t for mb in outputs for t in mb) == 0


def fmt_num(v) -> str:
    """Short number for sentences: 3 significant digits, inf/nan spelled."""
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return f"{v:.3g}"


def report_progress(progress, label: str, done: int, total: int) -> None:
    if progress is not None:
        progress(label, done, total)
