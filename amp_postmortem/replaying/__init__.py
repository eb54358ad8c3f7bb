"""Replay of a recorded training step on any machine, following the autocast
policy of the device that recorded it.

    from amp_postmortem.replaying import replay
    result = replay("runs/exp1", step=1234, model="mypkg.models:build")
    result.culprit          # {"name", "phase", "precision", "reason"} or None
    result.reproduced       # True / False / None (no evidence either way)
    result.to_dict()        # the JSON contract of `amp-postmortem replay --json`

The float64 run is the reference; fp32 runs with TF32 off; fp16/bf16 run
float32 master weights under the recorded device's autocast policy (native
on that device type, emulated elsewhere). See `engine.py` for the runs,
`attribution.py` for the metrics and thresholds, `fidelity.py` for
`reproduced`.

The package is `replaying`, not `replay`: `amp_postmortem.replay` is the API
function, which a subpackage of that name would shadow once imported.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from recorders.format import schema

from ..errors import BundleError, DeviceError, ModelSpecError, PolicyError, PrecisionError
from ..names import ROOT_DISPLAY, BackwardStart
from . import attribution, fidelity, op_trace
from .engine import (DTYPES, POLICY_MODES, PRECISION_OF_DTYPE, PRECISIONS, ReplaySession, RunConfig,
                     StepCapture, preserved_rng)
from .model_spec import bundle_folders, resolve_model, saved_model_config
from ..op_words import op_origin_text, trace_line
from ..result import CommandResult

__all__ = ["replay", "ReplayResult", "ReplaySession", "RunConfig", "StepCapture", "PRECISIONS",
           "resolve_policy", "recorded_precision"]


@dataclass
class ReplayResult(CommandResult):
    step: int
    rank: int
    device: str
    policy: dict
    recorded_precision: str | None
    precisions: list
    reproduced: bool | None
    fidelity: dict
    culprit: dict | None
    culprits: dict                  # precision -> culprit or None
    first_propagated: dict          # precision -> first module over the propagated threshold, or None
    modules: list
    ranking: list
    loss: dict
    param_grads: dict
    anomaly: dict | None = None
    notes: list = field(default_factory=list)
    errors: dict = field(default_factory=dict)  # precision -> the error a run raised
    thresholds: dict = field(default_factory=lambda: dict(attribution.THRESHOLDS))
    backward_start: BackwardStart = BackwardStart.SAVED   # engine.start_backward
    op_trace: list = field(default_factory=list)  # op_trace.ModuleOpTrace.to_dict() per traced module
    op_origin: dict | None = None   # the culprit's first op made non-finite from finite inputs, or None
    # Whether every module's float64 output is finite: decisions read this,
    # never the note that says it (not in `to_dict`: `notes` says it there).
    reference_finite: bool = True
    # The modules whose float64 output holds NaN/Inf, in the order they ran
    # (the first is where the reference went non-finite first).
    reference_nonfinite: list = field(default_factory=list)
    # The bundle replayed when no step was given (`bundle_choice.BundleChoice`), else None.
    bundle_choice: object = None

    def document(self) -> dict:
        """Plain data; relative errors are inf where a run is non-finite and
        float64 is not (`--json` writes null there: see the counts)."""
        return {
            "step": self.step, "rank": self.rank, "device": self.device, "policy": self.policy,
            "recorded_precision": self.recorded_precision, "precisions": self.precisions,
            "reproduced": self.reproduced, "fidelity": self.fidelity, "culprit": self.culprit,
            "culprits": self.culprits, "first_propagated": self.first_propagated,
            "modules": self.modules, "ranking": self.ranking, "loss": self.loss,
            "param_grads": self.param_grads, "anomaly": self.anomaly, "notes": self.notes,
            "errors": self.errors, "thresholds": self.thresholds, "backward_start": self.backward_start.value,
            "op_origin": self.op_origin, "op_trace": self.op_trace,
            "reference_nonfinite": self.reference_nonfinite,
            "bundle_choice": None if self.bundle_choice is None else self.bundle_choice.to_dict(),
        }


    def lines(self) -> list[str]:
        """The verdict, fidelity first: never a diagnosis without it."""
        p = self.policy
        out = [] if self.bundle_choice is None else [self.bundle_choice.sentence()]
        out += [f"step {self.step}, rank {self.rank}: replayed on {self.device} under the "
               f"{p['device_type']} autocast policy{' (emulated)' if p['emulated'] else ''}, "
               f"recorded precision {self.recorded_precision}, loss scale {p['loss_scale']:g}"]
        verdict = {True: "reproduced", False: "NOT REPRODUCED", None: "unknown"}[self.reproduced]
        out.append(f"fidelity: {verdict} ({self.fidelity.get('basis')})")
        out.extend(f"note: {n}" for n in self.notes)
        c = self.culprit
        out.append(f"culprit: {_shown(c)}, {c['phase']}, {c['precision']}: {c['reason']}" if c
                   else "culprit: none (no module's own arithmetic is broken)")
        for prec, first in self.first_propagated.items():
            if first:
                out.append(f"first over the threshold end to end in {prec}: {_shown(first)}, "
                           f"{first['phase']} ({first['reason']})")
        if self.op_origin:
            out.append(f"op origin: {op_origin_text(self.op_origin)}")
        # The culprit's trace (the first) is said by the op origin line when it found one.
        out.extend(trace_line(t) for i, t in enumerate(self.op_trace) if i or not self.op_origin)
        if self.anomaly:
            a = self.anomaly
            out.append(f"anomaly ({a.get('precision') or '-'}): {a.get('explanation') or a.get('message')}")
            if a.get("traceback"):
                out.extend("  " + line for line in a["traceback"].splitlines())
        out.append(self._param_grad_line())
        replayed = {k: v for k, v in self.loss.items() if k != "recorded"}
        if any(v is not None for v in replayed.values()):
            out.append("loss: " + ", ".join(f"{k} {_fmt(v)}" for k, v in self.loss.items()))
        else:
            out.append(f"loss: recorded {_fmt(self.loss.get('recorded'))}; the model returns outputs, not a "
                       "loss, so no replayed loss (Python API: replay(..., loss_fn=...) computes one)")
        return out

    def _param_grad_line(self) -> str:
        """Parameters whose gradient is more than 10% off float64, by name;
        those that are NaN/Inf counted per precision (all of them, after a
        non-finite forward: the names would say nothing)."""
        grads = self.param_grads
        nonfinite = {}
        for g in grads.values():
            for prec, count in g["nonfinite"].items():
                if count:
                    nonfinite[prec] = nonfinite.get(prec, 0) + 1
        flagged = [f"{n} ({', '.join(p for p in g['flagged'] if not g['nonfinite'].get(p))})"
                   for n, g in grads.items() if any(not g["nonfinite"].get(p) for p in g["flagged"])]
        stand_in = ("" if self.backward_start is BackwardStart.SAVED else
                    f" (backward from the {self.backward_start.value} start)")
        line = f"parameter gradients > 10% off float64{stand_in}: " + (", ".join(flagged) if flagged else "none")
        line += "".join(f"; NaN/Inf in {prec}: {n} of {len(grads)} parameters" for prec, n in nonfinite.items())
        return line

    def table(self):
        """One row per module and phase: per precision its local status,
        local and propagated relative errors (columns `<prec>`,
        `<prec>_local`, `<prec>_prop`)."""
        import pandas as pd
        precisions = [p for p in self.precisions if p != "fp64"]
        rows = []
        for m in self.modules:
            row = {"name": m.get("label") or m["name"], "phase": m["phase"]}
            for p in precisions:
                row[p] = m["status"].get(p)
                row[f"{p}_local"] = m["local_rel_err"].get(p)
                row[f"{p}_prop"] = m["propagated_rel_err"].get(p)
            rows.append(row)
        return pd.DataFrame(rows, columns=["name", "phase"] + [c for p in precisions
                                                              for c in (p, f"{p}_local", f"{p}_prop")])


def _shown(named: dict) -> str:
    """A module call of a result as people read it: `act#1` for the second
    call of a module called twice, the root module as `(model)`."""
    return named.get("label") or named["name"] or ROOT_DISPLAY


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.6g}"


def recorded_precision(bundle) -> str:
    """The precision the step ran in: the autocast dtype when autocast was
    on, else the dtype of the parameters."""
    ac = bundle.autocast or {}
    if ac.get("enabled") and ac.get("dtype") in PRECISION_OF_DTYPE:
        return PRECISION_OF_DTYPE[ac["dtype"]]
    dtypes = {str(t.dtype).replace("torch.", "") for t in bundle.params.values() if t.is_floating_point()}
    for name in ("float16", "bfloat16", "float32", "float64"):
        if name in dtypes:
            return PRECISION_OF_DTYPE[name]
    return "fp32"


def resolve_policy(mode: str, bundle, precision: str):
    """The AutocastPolicy of a fp16/bf16 replay: the recorded device type's
    (`recorded`), or CUDA's / CPU's when overridden; None for fp64/fp32."""
    if mode not in POLICY_MODES:
        raise PolicyError(f"policy {mode!r} is not one of {', '.join(POLICY_MODES)}")
    if precision not in ("fp16", "bf16"):
        return None
    from .policy import get_policy
    return get_policy(policy_device(mode, bundle), DTYPES[precision])


def _recorded_device(bundle) -> str | None:
    ac = bundle.autocast or {}
    return (bundle.env or {}).get("device_type") or (ac.get("device_type") if ac.get("enabled") else None)


def policy_device(mode: str, bundle) -> str:
    if mode != "recorded":
        return mode
    ac = bundle.autocast or {}
    device = (ac.get("device_type") if ac.get("enabled") else None) or (bundle.env or {}).get("device_type")
    return device if device in ("cuda", "cpu") else "cuda"


def replay(source, step: int | None = None, *, rank: int | None = None, model=None, device: str = "cpu",
           precisions=PRECISIONS, policy: str = "recorded", anomaly: bool = False,
           local: bool = True, loss_fn=None, fp32_modules=(), loss_scale: float | None = None,
           batch=None, run_dir=None, trace=()) -> ReplayResult:
    """Replay a saved step under several precisions and name the culprit.

    `source`: a run directory (with `step`; `rank` None picks the lowest
    rank that saved a bundle), a bundle directory or a loaded `Bundle`.
    `model`: a factory spec (`package.module:factory` or
    `path/to/file.py:factory`), an `nn.Module`, a no-argument callable, or
    None (the recorded class, built with no arguments). `loss_fn(output,
    micro_batch)` gives per-precision losses when the model does not return
    its loss (and a finite start for a backward whose saved output gradient
    is NaN). `local`: replay every module alone (True), none (False) or the
    named ones. `fp32_modules`, `loss_scale` and `batch` replay a what-if.
    `trace`: names of modules to trace op by op (`op_trace.py`) besides the
    culprit, which is always traced when the module replays ran (`local`).
    """
    bundle, run_dir = _locate(source, step, rank, run_dir)
    precisions = _check_precisions(precisions)
    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceError("device 'cuda' requested but CUDA is not available here; use --device cpu")
    # Building the model draws its initial weights: the caller's RNG stays as it was.
    with preserved_rng(torch.device(device)):
        return _replay(bundle, run_dir, precisions, model=model, device=device, policy=policy,
                       anomaly=anomaly, local=local, loss_fn=loss_fn, fp32_modules=fp32_modules,
                       loss_scale=loss_scale, batch=batch, trace=tuple(trace or ()))


def _replay(bundle, run_dir, precisions, *, model, device, policy, anomaly, local, loss_fn, fp32_modules,
            loss_scale, batch, trace) -> ReplayResult:
    net = resolve_model(model, bundle.model_class, saved_model_config(bundle, run_dir),
                        forbidden=bundle_folders(bundle, run_dir))
    _check_traced(net, trace)
    session = ReplaySession(bundle, net, device=device)
    notes = session.start_backward(loss_fn)
    primary = recorded_precision(bundle)
    scale = float(loss_scale if loss_scale is not None else (bundle.loss_scale or 1.0))
    # The recorded backend flags mean something on the recording device type only.
    same_device = _recorded_device(bundle) == torch.device(device).type
    flags = dict(bundle.precision_flags or {}) if same_device else {}
    configs = {p: RunConfig(p, device=device, policy=resolve_policy(policy, bundle, p), loss_scale=scale,
                            fp32_modules=tuple(fp32_modules), batch=batch, precision_flags=flags)
               for p in precisions}
    reference = session.run(configs["fp64"], keep_inputs=bool(local), loss_fn=loss_fn)
    runs = {p: session.run(configs[p], loss_fn=loss_fn) for p in precisions if p != "fp64"}
    only = None if isinstance(local, bool) else set(local)
    comparisons = {p: attribution.compare_run(session, reference, r, local=bool(local), modules=only)
                   for p, r in runs.items()}
    order = [primary] + [p for p in ("fp16", "bf16", "fp32") if p != primary]
    culprits = {p: attribution.find_culprit(comparisons[p], p) for p in runs}
    culprit = next((culprits[p] for p in order if culprits.get(p)), None)
    notes += _notes(bundle, reference, runs, primary, device, same_device)
    what_if = [w for w, on in (("fp32 modules", fp32_modules), ("a slice of the batch", batch is not None),
                               ("another loss scale", scale != float(bundle.loss_scale or 1.0))) if on]
    if what_if:
        fid = {"reproduced": None, "basis": f"a what-if replay ({', '.join(what_if)}) is not the recorded step"}
    elif primary not in precisions:
        fid = {"reproduced": None, "basis": f"recorded precision {primary} not replayed"}
    else:
        fid = fidelity.check(runs[primary] if primary != "fp64" else reference, bundle, run_dir,
                             backward=session.backward_start is BackwardStart.SAVED)
    if fid["reproduced"] is False:
        notes.insert(0, f"the replay did NOT reproduce step {bundle.step} ({fid['basis']}): the diagnosis "
                        "below describes the replay, not necessarily what happened in training")
    elif fid["reproduced"] is None:
        notes.insert(0, f"whether the replay reproduces step {bundle.step} is unknown: {fid['basis']}")
    ranked = primary if primary in runs else next(iter(runs), None)
    traces = _op_traces(session, reference, runs, culprit, primary, trace) if local else []
    origin = next((t.origin for t in traces[:1] if t.origin is not None and culprit is not None
                   and t.module == culprit["name"]), None)
    return ReplayResult(
        step=bundle.step, rank=bundle.rank, device=device,
        policy={"mode": policy, "device_type": policy_device(policy, bundle),
                "emulated": policy_device(policy, bundle) != torch.device(device).type, "loss_scale": scale},
        recorded_precision=primary, precisions=list(precisions), reproduced=fid["reproduced"],
        fidelity=fid, culprit=culprit, culprits=culprits,
        first_propagated={p: attribution.first_propagated(comparisons[p], p) for p in runs},
        modules=_module_rows(comparisons),
        ranking=attribution.rank_by_local_error(comparisons[ranked], ranked) if ranked else [],
        loss={"recorded": bundle.loss, "fp64": reference.loss, **{p: r.loss for p, r in runs.items()}},
        param_grads=attribution.param_grad_errors(reference.param_grads,
                                                  {p: r.param_grads for p, r in runs.items()}),
        anomaly=_anomaly(session, configs, culprit, runs, order, comparisons) if anomaly else None,
        notes=notes, errors={p: r.error for p, r in runs.items() if r.error},
        backward_start=session.backward_start, op_trace=[t.to_dict() for t in traces],
        op_origin=origin.to_dict() if origin is not None else None,
        reference_finite=not _reference_nonfinite_calls(reference),
        reference_nonfinite=_reference_nonfinite_calls(reference))


def _check_traced(net, names) -> None:
    for name in names:
        try:
            net.get_submodule(name)
        except AttributeError:
            known = [n for n, _ in net.named_modules() if n]
            raise ModelSpecError(f"trace module {name!r} is not a module of the model; its modules: "
                                 f"{', '.join(known[:12])}{', ...' if len(known) > 12 else ''}") from None


def _op_traces(session, reference, runs, culprit, primary, names) -> list:
    """The culprit's op trace first (in its precision), then each module of
    `names` in the culprit's precision, else the recorded one when it was
    replayed reduced, else the first replayed."""
    reduced = [p for p in (primary, "fp16", "bf16", "fp32") if p in runs]
    precision = (culprit or {}).get("precision") or next(iter(reduced), None)
    targets = []
    if culprit is not None and culprit["name"] != schema.LOSS_NAME:
        targets.append(culprit["name"])
    targets += [n for n in names if n not in targets]
    if precision is None:
        return []
    return [op_trace.trace_module(session, reference, runs[precision], name) for name in targets]


def _anomaly(session, configs, culprit, runs, order, comparisons) -> dict:
    """detect_anomaly on the failing precision (the culprit's, else the
    first replayed precision that is not finite), said in words: anomaly
    mode checks the backward only and flags NaN only, so after a non-finite
    forward its op is where the NaN reaches the backward, not where it was
    made, and an Inf made in the backward raises nothing. Also the first
    backward op whose result holds NaN/Inf (`first_nonfinite_op`)."""
    failing = (culprit or {}).get("precision") or next(
        (p for p in order if p in runs and not runs[p].finite), None)
    if failing is None:
        return {"precision": None, "raised": False, "op": None, "traceback": None, "first_nonfinite_op": None,
                "forward_nonfinite": False, "forward_origin": None,
                "message": "no replayed precision is non-finite",
                "explanation": "no replayed precision is non-finite: nothing for anomaly mode to find"}
    found = session.run(configs[failing], anomaly=True).anomaly
    origin = _forward_origin(culprit, runs[failing], comparisons.get(failing, []))
    first = found.get("first_nonfinite_op")
    report = {"precision": failing, **found, "forward_nonfinite": origin is not None, "forward_origin": origin}
    where = (lambda f: f"{f['op']}" + (f" (output of {f['module'] or ROOT_DISPLAY})" if f.get("module") is not None
                                       else ""))
    if origin is not None:
        shown = found.get("op") or (first or {}).get("op")
        report["explanation"] = (
            "the forward was already non-finite ("
            + (f"made in {origin or ROOT_DISPLAY}, the culprit" if (culprit or {}).get("phase") == "forward"
               and culprit.get("name") == origin else f"first in the output of {origin or ROOT_DISPLAY}")
            + "); anomaly mode "
            "checks the backward only, so the op it reports"
            + (f", {shown}," if shown else "") + " is where the NaN first reaches the backward, not where "
            "it was made")
    elif found.get("raised"):
        report["explanation"] = (f"{found.get('op')} returned NaN in the backward"
                                 + (f" (output of {first['module'] or ROOT_DISPLAY})"
                                    if first and first.get("op") == found.get("op") and first.get("module")
                                    is not None else ""))
    elif first is not None:
        report["explanation"] = (
            f"no backward op returned NaN, so anomaly mode raised nothing: the backward's non-finite values are "
            f"{first['values']} (float16 rounding or a gradient sum overflowing at loss scale "
            f"{configs[failing].backward_scale:g}), which anomaly mode does not flag; the first backward op "
            f"whose result holds {first['values']}: {where(first)}")
        report["traceback"] = first.get("traceback")
    else:
        report["explanation"] = (f"no backward op returned NaN or Inf in {failing}: the non-finite values "
                                 "are not made by the backward's ops (the run raised, or the output gradient "
                                 "times the loss scale does not fit)")
    return report


def _forward_origin(culprit, run, comparisons):
    """Where the failing precision's forward first turned non-finite (the
    forward culprit when there is one), or None when its forward is finite."""
    calls = sorted(run.calls.values(), key=lambda c: c.forward_order)
    bad = [c for c in calls if any(not bool(torch.isfinite(t).all()) for t in c.outputs)]
    if not bad and all(bool(torch.isfinite(t).all()) for mb in run.outputs for t in mb):
        return None
    if culprit and culprit.get("phase") == "forward":
        return culprit["name"]
    first = attribution.first_propagated([c for c in comparisons if c.phase == "forward"], run.config.precision)
    if first is not None:
        return first["name"]
    return bad[0].name if bad else ""


def _module_rows(comparisons: dict) -> list:
    rows: dict = {}
    for p, comps in comparisons.items():
        for c in comps:
            row = rows.setdefault((c.name, c.call, c.phase), {
                "name": c.name, "call": c.call, "label": c.label, "phase": c.phase, "order": c.order,
                "status": {}, "reason": {},
                "local_rel_err": {}, "propagated_rel_err": {}, "propagated_status": {},
                "broken_inside": {}, "local": {}, "propagated": {}})
            status, reason = c.status
            row["status"][p] = status
            row["reason"][p] = reason
            row["local_rel_err"][p] = c.local.rel_l2 if c.local_done else None
            row["propagated_rel_err"][p] = c.propagated.rel_l2
            row["propagated_status"][p] = attribution.propagated_status(c.propagated, p)[0]
            row["broken_inside"][p] = attribution.broken_inside(comps, c) if status == "broken" else None
            row["local"][p] = c.local.to_dict() if c.local_done else None
            row["propagated"][p] = c.propagated.to_dict()
    return sorted(rows.values(), key=lambda r: (r["phase"] != "forward", r["order"]))


def _reference_nonfinite_calls(reference) -> list:
    """The modules (display names, forward order of the capture) whose
    float64 output holds NaN/Inf."""
    return [c.name or ROOT_DISPLAY for c in reference.calls.values()
            if any(not bool(torch.isfinite(t).all()) for t in c.outputs)]


def _notes(bundle, reference, runs, primary, device, same_device) -> list:
    notes = []
    bad = _reference_nonfinite_calls(reference)
    if bad:
        weights = bundle.nonfinite_params()
        notes.append(f"the float64 reference itself is non-finite (first at {bad[0]}): not a precision problem; "
                     + (f"the step ran on weights already NaN/Inf ({', '.join(weights[:5])}"
                        f"{', ...' if len(weights) > 5 else ''} in the bundle): restore them and find what made "
                        f"them so (`recommend`: check_weights)" if weights else "check the data and the model"))
    notes.extend(f"the {p} replay raised {r.error}" for p, r in runs.items() if r.error)
    meta = bundle.meta if isinstance(bundle.meta, dict) else {}
    inexact = [what for what, key in (("weights", "params"), ("buffers", "buffers"))
               if isinstance(meta.get(key), dict) and meta[key].get("exact") is False]
    if meta.get("inputs_exact") is False:
        inexact.append("inputs")
    if inexact:
        notes.append(f"the bundle's {', '.join(inexact)} may not be exactly those of the step's forward "
                     "(see FORMAT.md, replay bundles): a mismatch may not reproduce")
    ac = bundle.autocast or {}
    if primary in ("fp16", "bf16") and not ac.get("enabled"):
        notes.append(f"the run trained with {primary} weights without autocast; the replay's "
                     f"{primary} run uses float32 master weights under autocast instead")
    flags = bundle.precision_flags or {}
    if not same_device and (flags.get("allow_tf32_matmul") or flags.get("allow_tf32_cudnn")
                            or flags.get("float32_matmul_precision") in ("high", "medium")):
        notes.append(f"training allowed TF32 on {_recorded_device(bundle)}; a replay on {device} cannot "
                     "reproduce it (float32 ops run in full float32 here)")
    return notes


def _check_precisions(precisions) -> tuple:
    if isinstance(precisions, str):
        precisions = [p.strip() for p in precisions.split(",") if p.strip()]
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad:
        raise PrecisionError(f"precision {bad[0]!r} is not one of {', '.join(PRECISIONS)}")
    return tuple(["fp64"] + [p for p in PRECISIONS[1:] if p in precisions])


def _locate(source, step, rank, run_dir):
    """(bundle, run directory or None) from a run dir + step, a bundle dir or a Bundle."""
    from ..reading import bundle as bundles
    if isinstance(source, bundles.Bundle):
        b = source
    else:
        path = Path(source)
        if (path / schema.BUNDLE_MANIFEST_FILE).is_file():
            b = bundles.load_bundle(path)
        else:
            if step is None:
                raise BundleError(f"{path} is not a bundle directory; give the step to replay (--step N)")
            b = bundles.load_bundle(bundles.find_bundle(path, step, rank))
            run_dir = run_dir or path
    if run_dir is None and b.path:
        candidate = Path(b.path).parent.parent.parent
        if (candidate / schema.MANIFEST_FILE).is_file():
            run_dir = candidate
    return b, run_dir
