"""Replay of a Keras or Flax run's saved step, in that framework.

    from amp_postmortem.framework_replay import replay_array_bundle
    result = replay_array_bundle("runs/exp1", step=3, model="train.py:make_model")
    result.culprit      # {"name", "call", "phase", "precision", "reason"} or None

The step's forward runs in float32 (the reference) and in each reduced
precision asked for, then every layer call alone on float32's inputs
rounded as the precision's run rounded them (`attribution.py`); the first
layer whose own arithmetic breaks is the culprit. Then, for a Keras
bundle and for a Flax one given the step's loss (`loss_fn`), the backward: each layer call's output and input gradients and its
variables' (the loss times the recorded scale under float16), against
float32's; when the forward has no culprit, the first layer in backward
order whose own backward turns a finite gradient NaN/Inf is. The framework is the
bundle's (`keras_run.py`, `flax_run.py`, imported only here and only for
such a bundle); the model comes only from the user's factory (`--model
FILE:factory` or `package.module:factory`, called with no arguments):
nothing a bundle names is imported or called.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from recorders.format import schema

from ..reading.array_bundle import ArrayBundle, is_array_bundle, load_array_bundle
from ..errors import BundleError, ModelSpecError, OptionError, PrecisionError
from . import attribution
from ..result import CommandResult

__all__ = ["replay_array_bundle", "FrameworkReplayResult", "bundle_framework"]

REDUCED = ("fp16", "bf16")
_FORMS = "package.module:factory or path/to/file.py:factory"


@dataclass
class FrameworkReplayResult(CommandResult):
    step: int
    rank: int
    framework: str
    backend: str | None
    recorded_precision: str
    precisions: list
    reproduced: bool | None
    fidelity: dict
    culprit: dict | None
    culprits: dict
    modules: list
    loss: dict
    backward: dict = field(default_factory=dict)  # precision -> {"replayed", "error", "first_nonfinite", "culprit"}
    notes: list = field(default_factory=list)
    errors: dict = field(default_factory=dict)
    reference_nonfinite: list = field(default_factory=list)
    bundle_choice: object = None

    def document(self) -> dict:
        return {"step": self.step, "rank": self.rank, "framework": self.framework, "backend": self.backend,
                "device": "cpu", "recorded_precision": self.recorded_precision, "precisions": self.precisions,
                "reproduced": self.reproduced, "fidelity": self.fidelity, "culprit": self.culprit,
                "culprits": self.culprits, "modules": self.modules, "loss": self.loss, "backward": self.backward,
                "notes": self.notes,
                "errors": self.errors, "reference_nonfinite": self.reference_nonfinite,
                "thresholds": {"broken_rel": dict(attribution.BROKEN_REL)},
                "bundle_choice": None if self.bundle_choice is None else self.bundle_choice.to_dict()}

    def lines(self) -> list[str]:
        out = [] if self.bundle_choice is None else [self.bundle_choice.sentence()]
        fw = self.framework + (f" ({self.backend})" if self.backend else "")
        out.append(f"step {self.step}, rank {self.rank}: replayed in {fw}, float32 as the reference, "
                   f"recorded precision {self.recorded_precision}")
        verdict = {True: "reproduced", False: "NOT REPRODUCED", None: "unknown"}[self.reproduced]
        out.append(f"fidelity: {verdict} ({self.fidelity.get('basis')})")
        out.extend(f"note: {n}" for n in self.notes)
        c = self.culprit
        out.append(f"culprit: {c['name'] or '<root>'}, {c['phase']}, {c['precision']}: {c['reason']}" if c
                   else "culprit: none (no layer's own arithmetic is broken in the forward)")
        for p, b in self.backward.items():
            if b.get("error"):
                out.append(f"backward {p}: not replayed ({b['error']})")
            elif b.get("first_nonfinite"):
                first = b["first_nonfinite"]
                out.append(f"backward {p}: first NaN/Inf gradient at {first['name'] or '<root>'} (call {first['call']})")
        out.append("loss: recorded " + ("-" if self.loss.get("recorded") is None else f"{self.loss['recorded']:.6g}"))
        return out

    def table(self):
        import pandas as pd
        precisions = [p for p in self.precisions if p != "fp32"]
        rows = []
        for m in self.modules:
            row = {"name": m["name"], "call": m["call"], "phase": m["phase"]}
            for p in precisions:
                row[p] = m["status"].get(p)
                row[f"{p}_local"] = m["local_rel_err"].get(p)
                row[f"{p}_prop"] = m["propagated_rel_err"].get(p)
            rows.append(row)
        return pd.DataFrame(rows, columns=["name", "call", "phase"] + [
            c for p in precisions for c in (p, f"{p}_local", f"{p}_prop")])


def bundle_framework(source, step: int | None, rank: int | None) -> str | None:
    """The framework of the run or bundle directory `source` when it is a
    Keras or Flax one (read from the JSON, nothing imported), else None."""
    if not isinstance(source, (str, Path)) or "://" in str(source):
        return None  # a loaded bundle, or a run on a store: PyTorch's path
    path = Path(source)
    if (path / schema.BUNDLE_MANIFEST_FILE).is_file():
        return load_array_bundle(path).framework if is_array_bundle(path) else None
    manifest = path / schema.MANIFEST_FILE
    if not manifest.is_file():
        return None
    from ..reading.files.safe import Damaged, parse_json, read_bytes
    from ..reading.files import limits
    try:
        doc = parse_json(read_bytes(manifest, path, BundleError, limits.MAX_JSON_BYTES), manifest, BundleError)
    except Damaged:
        return None
    name = ((doc.get("framework") or {}) if isinstance(doc, dict) else {}).get("name")
    return name if name in ("keras", "flax") else None


def locate(source, step: int | None, rank: int | None) -> ArrayBundle:
    path = Path(source)
    if (path / schema.BUNDLE_MANIFEST_FILE).is_file():
        return load_array_bundle(path)
    from ..reading.bundle_dirs import list_bundles
    found = list_bundles(path)
    if not found:
        raise BundleError(f"no replay bundles in {path} (nothing under {schema.BUNDLES_DIR}/)")
    at = [(r, p) for s, r, p in found if s == int(step) and (rank is None or r == int(rank))]
    if not at:
        steps = ", ".join(str(s) for s in sorted({s for s, _, _ in found}))
        raise BundleError(f"no bundle for step {step}{'' if rank is None else f' rank {rank}'} in {path} "
                          f"(bundles exist for steps: {steps})")
    return load_array_bundle(at[0][1])


def _check_precisions(precisions) -> list:
    if isinstance(precisions, str):
        precisions = [p.strip() for p in precisions.split(",") if p.strip()]
    known = ("fp64", "fp32") + REDUCED
    bad = [p for p in precisions if p not in known]
    if bad:
        raise PrecisionError(f"precision {bad[0]!r} is not one of {', '.join(known)}")
    # fp64 (in the default list) is not replayed: float32 is the reference here.
    return [p for p in REDUCED if p in precisions]


def replay_array_bundle(source, step: int | None = None, *, rank: int | None = None, model=None,
                        precisions=("fp32", "fp16", "bf16"), loss_fn=None, anomaly: bool = False,
                        trace=(), policy: str = "recorded") -> FrameworkReplayResult:
    """Replay a Keras or Flax bundle's step (`source`: a run directory with
    `step`, or a bundle directory) and name the culprit layer. `model`: a
    factory spec or a no-argument callable returning the model."""
    for flag, given in (("--anomaly", anomaly), ("--trace", bool(trace)), ("--policy", policy != "recorded")):
        if given:
            raise OptionError(f"{flag} is for PyTorch runs; a Keras or Flax replay takes --model, --step, "
                              f"--rank, --precisions and, for Flax, --loss-fn")
    bundle = locate(source, step, rank)
    if loss_fn is not None and bundle.framework != "flax":
        raise OptionError("--loss-fn is for PyTorch and Flax runs; a Keras replay takes the model's compiled loss")
    notes: list = []
    reduced = _check_precisions(precisions)
    if bundle.framework == "keras":
        from .keras_run import KerasRunner, import_keras
        import_keras(bundle.backend, notes)  # before the user's file imports Keras with another backend
        runner = KerasRunner(bundle, _factory(model, bundle), notes)
    elif bundle.framework == "flax":
        from .flax_run import FlaxRunner
        runner = FlaxRunner(bundle, _factory(model, bundle), notes, _loss_fn(loss_fn))
    else:
        raise BundleError(f"bundle {bundle.path}: framework {bundle.framework!r} is not keras or flax")
    return _replay(bundle, runner, reduced, notes)


def _factory(model, bundle):
    if model is None:
        cls = bundle.meta.get("model_class")
        raise ModelSpecError(f"the replay needs the model (the run recorded {cls!r}): pass --model {_FORMS}, "
                             f"a function with no arguments that returns it")
    if callable(model):
        return model
    from ..replaying.model_spec import resolve_factory
    return resolve_factory(model)


def _loss_fn(spec):
    """A Flax step's loss function: a callable, or a spec (`FILE:fn`)."""
    if spec is None or callable(spec):
        return spec
    from ..replaying.model_spec import resolve_factory
    return resolve_factory(spec, what="--loss-fn")


def _replay(bundle, runner, reduced: list, notes: list) -> FrameworkReplayResult:
    reference = runner.run("fp32")
    if reference.error:
        raise ModelSpecError(f"the float32 forward of the model raised {reference.error}")
    runs = {p: runner.run(p) for p in reduced}
    comparisons, culprits = {}, {}
    for p, run in runs.items():
        comps = []
        for order, key in enumerate(reference.order):
            if key not in run.outputs:
                continue
            try:
                local, bad = runner.local(p, key)
                local_stats, error = attribution.compare(reference.outputs[key], local), None
            except Exception as exc:  # noqa: BLE001 - a layer that cannot be called alone
                local_stats, bad, error = None, 0, f"{type(exc).__name__}: {exc}"
            comps.append(attribution.CallComparison(key[0], key[1], order,
                                                    attribution.compare(reference.outputs[key], run.outputs[key]),
                                                    local_stats, bad, error))
        comparisons[p] = comps
        found = attribution.find_culprit(comps, p)
        culprits[p] = found.to_dict() if found else None
    primary = runner.recorded_precision
    order = [primary] + [p for p in REDUCED if p != primary]
    backward, backward_rows = _backward(bundle, runner, reference, runs, order)
    for p in order:
        if not culprits.get(p) and (backward.get(p) or {}).get("culprit"):
            culprits[p] = backward[p]["culprit"]
    culprit = next((culprits[p] for p in order if culprits.get(p)), None)
    ref_bad = reference.nonfinite_calls()
    if ref_bad:
        notes.append(f"the float32 reference itself is non-finite (first at {ref_bad[0]['name'] or '<root>'}): "
                     "not a precision problem; check the data and the model")
    notes.extend(f"the {p} replay raised {r.error}" for p, r in runs.items() if r.error)
    if primary in runs:
        fid = attribution.check_fidelity(bundle.meta.get("recorded_nonfinite") or [],
                                         runs[primary].nonfinite_calls(), primary)
        if fid.reproduced is None and primary in backward and not backward[primary].get("error"):
            fid = _backward_fidelity(bool(bundle.meta.get("skipped")), backward[primary], primary)
    else:
        fid = attribution.Fidelity(None, f"recorded precision {primary} not replayed")
    if fid.reproduced is False:
        notes.insert(0, f"the replay did NOT reproduce step {bundle.step} ({fid.basis}): the diagnosis below "
                        "describes the replay, not necessarily what happened in training")
    if not (bundle.meta.get("params") or {}).get("exact", False):
        notes.append("the bundle's weights were read after the step's update (the loss scale did not skip it): "
                     "the replay may not reproduce")
    return FrameworkReplayResult(
        step=bundle.step, rank=bundle.rank, framework=bundle.framework, backend=bundle.backend,
        recorded_precision=primary, precisions=["fp32", *reduced], reproduced=fid.reproduced,
        fidelity=fid.to_dict(), culprit=culprit, culprits=culprits,
        modules=_module_rows(comparisons) + backward_rows, loss={"recorded": bundle.loss}, backward=backward, notes=notes, errors={p: r.error for p, r in runs.items() if r.error},
        reference_nonfinite=[c["name"] for c in ref_bad])


def _backward(bundle, runner, reference, runs: dict, order: list) -> tuple[dict, list]:
    """Replay the backward in float32 and each precision (a runner that
    has one); per precision: its first call with a NaN/Inf gradient and its
    culprit, and the `modules` rows of phase `backward`."""
    if not hasattr(runner, "backward"):
        return {}, []
    runner.backward("fp32", reference, 1.0)
    if reference.backward_error:
        return {p: {"replayed": False, "error": reference.backward_error} for p in ["fp32", *runs]}, []
    scale = bundle.loss_scale if bundle.loss_scale and bundle.loss_scale > 0 else 1.0
    out, comparisons = {}, {}
    for p, run in runs.items():
        if run.error:
            continue
        # A loss scale is float16's: bfloat16 has float32's range (Keras' mixed_bfloat16 scales nothing).
        runner.backward(p, run, scale if p == "fp16" else 1.0)
        if run.backward_error:
            out[p] = {"replayed": False, "error": run.backward_error}
            continue
        comps = attribution.compare_backward(reference, run)
        comparisons[p] = comps
        found = attribution.find_backward_culprit(comps, p)
        bad = run.nonfinite_grads()
        out[p] = {"replayed": True, "error": None, "loss_scale": scale if p == "fp16" else 1.0,
                  "first_nonfinite": bad[0] if bad else None, "culprit": found.to_dict() if found else None}
    rows: dict = {}
    for p, comps in comparisons.items():
        for c in comps:
            row = rows.setdefault((c.name, c.call), {
                "name": c.name, "call": c.call, "phase": "backward", "order": c.order, "status": {},
                "reason": {}, "local_rel_err": {}, "propagated_rel_err": {}, "local": {}, "propagated": {},
                "local_error": {}})
            status = c.status(p)
            row["status"][p] = status.value
            row["reason"][p] = c.reason(p) if status is not attribution.CallStatus.OK else None
            row["local_rel_err"][p] = c.inputs.rel_l2
            row["propagated_rel_err"][p] = c.outputs.rel_l2
            row["local"][p] = c.to_dict()
            row["propagated"][p] = c.outputs.to_dict()
            row["local_error"][p] = None
    out = {p: out[p] for p in order if p in out}
    return out, sorted(rows.values(), key=lambda r: r["order"])


def _backward_fidelity(skipped: bool, backward: dict, precision: str) -> attribution.Fidelity:
    """A step whose forward was finite: whether its gradients went
    non-finite (the loss scale skipped it) in training and in the replay."""
    bad = backward.get("first_nonfinite")
    if skipped and bad:
        return attribution.Fidelity(True, f"the recorded step's gradients overflowed (the loss scale skipped it) "
                                          f"and the {precision} replay's do, first at {bad['name']}")
    if not skipped and not bad:
        return attribution.Fidelity(True, f"the recorded step's gradients were finite (not skipped) and the "
                                          f"{precision} replay's are")
    said = "overflowed (skipped)" if skipped else "were finite"
    return attribution.Fidelity(False, f"the recorded step's gradients {said}; the {precision} replay's "
                                       + (f"first go NaN/Inf at {bad['name']}" if bad else "are finite"))


def _module_rows(comparisons: dict) -> list:
    rows: dict = {}
    for p, comps in comparisons.items():
        for c in comps:
            row = rows.setdefault((c.name, c.call), {
                "name": c.name, "call": c.call, "phase": "forward", "order": c.order, "status": {},
                "reason": {}, "local_rel_err": {}, "propagated_rel_err": {}, "local": {}, "propagated": {},
                "local_error": {}})
            status = c.status(p)
            row["status"][p] = status.value
            row["reason"][p] = c.reason(p) if status is not attribution.CallStatus.OK else None
            row["local_rel_err"][p] = c.local.rel_l2 if c.local is not None else None
            row["propagated_rel_err"][p] = c.propagated.rel_l2
            row["local"][p] = c.local.to_dict() if c.local is not None else None
            row["propagated"][p] = c.propagated.to_dict()
            row["local_error"][p] = c.local_error
    return sorted(rows.values(), key=lambda r: r["order"])
