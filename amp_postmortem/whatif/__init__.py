"""What-if replays: change one thing about a saved step and replay it.

    fix.find_fix(...)                 which module kept in float32 saves the step
    scale_window.replay_scale_window  the loss scales that neither overflow nor underflow
    scale_window.estimate_scale_window  the same, estimated from recorded statistics only
    bisect.bisect_samples(...)        which samples of the batch make it non-finite

Each is a pure function of a bundle and a model factory returning a small
report (`to_dict()`, `table()`, `lines()`), built on the replay engine's
what-if hooks (`RunConfig.fp32_modules`, `loss_scale`, `batch`). This module
holds the plumbing they share: opening a step (`prepare`) and measuring one
trial against the float64 reference (`trial_metrics`). Nothing here imports
torch at import time, so `scale-window` without a model stays torch-free.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# A replay "saves" the step when it is finite end to end and its parameter
# gradients are within this relative L2 error of float64: the replay's
# broken threshold for fp16 propagated errors (attribution.PROPAGATED_BROKEN_REL).
GRAD_REL_ERR_OK = 0.25
# A trial whose backward overflows is retried at lower scales down to this
# one: below 1 a loss scale protects nothing (analyses.scale.LOW_SCALE).
MIN_BACKOFF_SCALE = 1.0


@dataclass
class Prepared:
    """One saved step, ready for what-if trials."""
    bundle: object
    session: object             # replay.ReplaySession
    precision: str              # the reduced precision the trials run in ("fp16" / "bf16")
    config: object              # replay.RunConfig of that precision, as recorded
    reference: object           # float64 StepCapture (inputs kept when asked)
    notes: list = field(default_factory=list)

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

    def trial(self, *, backoff: bool = True, **changes) -> dict:
        """`trial_metrics` of one replay. With `backoff`, a trial whose
        forward is finite but whose backward overflows at the recorded loss
        scale is judged at the highest lower power-of-two scale (down to
        `MIN_BACKOFF_SCALE`) where it is finite, as a dynamic scaler would
        back off to it; `loss_scale` and `backoffs` say where."""
        scale = float(changes.pop("loss_scale", self.loss_scale))
        first = trial_metrics(self.run(loss_scale=scale, **changes), self.reference)
        first.update(loss_scale=scale, backoffs=0)
        if not backoff or first["finite"] or not first["forward_finite"] or scale <= MIN_BACKOFF_SCALE:
            return first
        # Overflow is monotone in the scale: bisect the halvings for the
        # fewest that make the backward finite.
        top = max(0, int(math.floor(math.log2(scale / MIN_BACKOFF_SCALE))))
        lo, hi, best = 1, top, None
        while lo <= hi:
            mid = (lo + hi) // 2
            t = trial_metrics(self.run(loss_scale=scale / 2 ** mid, **changes), self.reference)
            if t["finite"]:
                best, hi = (mid, t), mid - 1
            else:
                lo = mid + 1
        if best is None:
            return first
        mid, t = best
        t.update(loss_scale=scale / 2 ** mid, backoffs=mid)
        return t

    def policy_dict(self) -> dict:
        p = self.config.policy
        device = getattr(p, "device_type", None)
        return {"device_type": device, "emulated": bool(device and device != self.config.device)}


def load_step(source, step=None, rank=None):
    """A `Bundle` from a loaded bundle, a bundle directory, or a run
    directory with `step` (and `rank`; default: the lowest that saved one)."""
    from pathlib import Path

    from .. import bundle as bundles
    from ..errors import BundleError
    if isinstance(source, bundles.Bundle):
        return source
    path = Path(source)
    if (path / "bundle.json").is_file():
        return bundles.load_bundle(path)
    if step is None:
        raise BundleError(f"{path} is not a bundle directory; give the step to replay (--step N)")
    return bundles.load_bundle(path, step=step, rank=rank)


def build(model, bundle):
    """The user's model: a spec string, an `nn.Module`, a no-argument
    factory, or None (the recorded class)."""
    import torch

    from ..errors import ModelSpecError
    from ..replay.model_spec import build_model
    if isinstance(model, torch.nn.Module):
        return model
    if model is None or isinstance(model, str):
        return build_model(model, bundle.model_class)
    if callable(model):
        built = model()
        if not isinstance(built, torch.nn.Module):
            raise ModelSpecError(f"the model factory returned {type(built).__name__}, not a torch.nn.Module")
        return built
    raise ModelSpecError(f"model {model!r} is not a spec, a module or a factory")


def prepare(source, step=None, *, rank=None, model=None, device: str = "cpu", policy: str = "recorded",
            precision: str | None = None, loss_fn=None, keep_inputs: bool = False,
            loss_scale: float | None = None) -> Prepared:
    """Open a saved step for what-if trials: the bundle, the model with its
    weights, the recorded reduced-precision config and the float64 run.

    `precision` defaults to the recorded one; a step recorded without
    autocast needs it given (`fp16` or `bf16`: "what if I enabled it").
    When the saved output gradient holds NaN/Inf (the training loss was
    already non-finite), every backward starts from a surrogate; see
    `usable_grad_outputs`."""
    import torch

    from ..errors import ModelSpecError
    from ..replay import RunConfig, ReplaySession, recorded_precision, resolve_policy

    bundle = load_step(source, step, rank)
    net = build(model, bundle)
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelSpecError("device 'cuda' requested but CUDA is not available here; use --device cpu")
    precision = precision or recorded_precision(bundle)
    if precision not in ("fp16", "bf16"):
        raise ModelSpecError(f"step {bundle.step} ran in {precision} (autocast off): nothing to replay in "
                             "reduced precision; pass precision='fp16' or 'bf16' to ask what it would do")
    session = ReplaySession(bundle, net, device=device)
    notes = []
    if loss_fn is not None:
        session.derive_grad_outputs(loss_fn)
    else:
        notes += usable_grad_outputs(session)
    scale = float(loss_scale if loss_scale is not None else (bundle.loss_scale or 1.0))
    config = RunConfig(precision, device=device, policy=resolve_policy(policy, bundle, precision),
                       loss_scale=scale, precision_flags=dict(bundle.precision_flags or {}))
    reference = session.run(RunConfig("fp64", device=device), keep_inputs=keep_inputs)
    if not _finite(reference.outputs):
        notes.append("the float64 reference is itself non-finite: this is not a precision problem "
                     "(check the data: `bisect`)")
    return Prepared(bundle=bundle, session=session, precision=precision, config=config,
                    reference=reference, notes=notes)


def usable_grad_outputs(session) -> list:
    """Replace the NaN/Inf entries of the saved output gradient.

    A step whose loss was already NaN in training saved a NaN gradient of
    the loss, and every backward started from it would be NaN whatever the
    precision. Those entries are replaced by the gradient of the mean of
    that output (1/numel): the backward then still exercises every module
    at the recorded loss scale. Finite entries are kept as saved."""
    import torch
    bad = 0
    fixed = []
    for mb in session.grad_outputs:
        row = []
        for g in mb:
            if g is not None and not bool(torch.isfinite(g).all()):
                n = int((~torch.isfinite(g)).sum())
                bad += n
                g = torch.where(torch.isfinite(g), g, torch.full_like(g, 1.0 / max(g.numel(), 1)))
            row.append(g)
        fixed.append(row)
    if not bad:
        return []
    session.grad_outputs = fixed
    return [f"the saved output gradient holds {bad} NaN/Inf values (the training loss was already "
            "non-finite); the backward starts from the gradient of the mean output there instead"]


def trial_metrics(run, reference) -> dict:
    """One replay against float64: finiteness, loss, output and gradient error."""
    import torch
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
    return {
        "finite": finite,
        "forward_finite": run.error is None and out_bad == 0,
        "backward_finite": run.error is None and grad_bad == 0,
        "nonfinite_values": out_bad + grad_bad,
        "nonfinite_params": len(run.nonfinite_param_grads),
        "loss": loss,
        "loss_rel_err": loss_rel,
        "output_rel_err": out_rel,
        "grad_rel_err": grad_rel,
        "worst_param": worst,
        "worst_param_rel_err": worst_err if worst is not None else None,
        "saved": finite and grad_rel <= GRAD_REL_ERR_OK,
        "error": run.error,
    }


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


def plain(obj):
    """Plain JSON-able data: NaN/Inf floats become None."""
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):
        try:
            return plain(obj.item())
        except (ValueError, TypeError):
            return str(obj)
    return obj


def report_progress(progress, label: str, done: int, total: int) -> None:
    if progress is not None:
        progress(label, done, total)
