"""What to change, each recommendation with its evidence.

From the recorded run alone (`summary`'s findings and the loss-scale window
estimated from the recorded statistics):
- `scaler_settings`: GradScaler settings inside the estimated window, when
  the scale collapses, sits low, or gradients underflow;
- `keep_fp32` (a candidate): the module named as the forward origin of a
  non-finite step, to be confirmed by `fix` (a replay).

With a model (and a replay bundle in the run), the what-if replays of the
bundle's step (the first non-finite one, or `step`) decide instead:
- `check_data`: the float64 replay is non-finite too, or a few samples of
  the batch fail alone (`bisect`): no precision setting is the fix;
- `keep_fp32`: the smallest set of modules whose float32 execution makes the
  step finite (`fix`), with the patch;
- `use_bf16`: whether a bfloat16 replay of the step (no loss scale) is
  finite and within the gradient tolerance of float64;
- `scaler_settings`: the replayed loss-scale window (with the `keep_fp32`
  modules applied) and GradScaler settings inside it;
- `avoid_mixed_precision`: no tried configuration (as recorded, any loss
  scale, modules kept in float32, bfloat16) keeps the step finite.
- `no_change`: nothing to recommend (a healthy run).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from ..loader import Run

ORDER = ("check_data", "keep_fp32", "use_bf16", "scaler_settings", "avoid_mixed_precision", "no_change")
_SCALE_FINDINGS = {"scale_collapse", "stuck_low_scale", "grad_underflow"}


@dataclass
class Recommendation:
    kind: str
    action: str
    evidence: list                 # sentences, each citing numbers
    source: str                    # "replay" | "recorded"
    code: str | None = None
    data: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "action": self.action, "evidence": self.evidence, "source": self.source,
                "code": self.code, "data": self.data}


@dataclass
class Recommendations:
    run: str
    step: int | None               # the replayed step, when a replay ran
    replayed: bool
    recommendations: list
    notes: list = field(default_factory=list)
    show_table = False

    def kinds(self) -> list[str]:
        return [r.kind for r in self.recommendations]

    def get(self, kind: str) -> Recommendation | None:
        return next((r for r in self.recommendations if r.kind == kind), None)

    def to_dict(self) -> dict:
        from ..whatif import plain
        return plain({"run": self.run, "step": self.step, "replayed": self.replayed,
                      "recommendations": [r.to_dict() for r in self.recommendations], "notes": self.notes})

    def table(self) -> pd.DataFrame:
        return pd.DataFrame([{"kind": r.kind, "source": r.source, "action": r.action,
                              "evidence": " | ".join(r.evidence)} for r in self.recommendations],
                            columns=["kind", "source", "action", "evidence"])

    def lines(self) -> list[str]:
        head = (f"recommendations for {self.run}" +
                (f" (replayed step {self.step})" if self.replayed else " (recorded statistics only)"))
        out = [head]
        for i, r in enumerate(self.recommendations, 1):
            out += ["", f"{i}. [{r.kind}] {r.action}"]
            out += [f"   evidence ({r.source}): {e}" for e in r.evidence]
            if r.code:
                out += ["   " + line for line in r.code.splitlines()]
        out += [f"note: {n}" for n in self.notes]
        return out


def recommend(run: Run, *, model=None, step: int | None = None, rank: int | None = None, device: str = "cpu",
              policy: str = "recorded", progress=None) -> Recommendations:
    """Recommendations for `run`; what-if replays when `model` is given."""
    from .summary import summarize

    summary = summarize(run)
    notes: list[str] = []
    if model is not None:
        bundle_step = _bundle_step(run, step, rank, notes)
        if bundle_step is not None:
            recs = _replayed(run, bundle_step, rank, model, device, policy, progress, notes, summary)
            return Recommendations(run=str(run.path), step=bundle_step, replayed=True,
                                   recommendations=_sorted(recs), notes=notes)
    elif run.manifest.get("bundles"):
        notes.append("the run holds replay bundles: pass --model to confirm these with replays")
    return Recommendations(run=str(run.path), step=None, replayed=False,
                           recommendations=_sorted(_recorded(run, summary)), notes=notes)


def _sorted(recs):
    return sorted(recs, key=lambda r: ORDER.index(r.kind))


# ---------------------------------------------------------------- recorded
def _recorded(run: Run, summary) -> list:
    recs = []
    kinds = summary.kinds()
    for f in summary.findings:
        if f.kind == "nonfinite" and f.layer and not f.layer.startswith("<") and f.layer != "":
            recs.append(Recommendation(
                "keep_fp32", f"candidate: keep {f.layer} in float32; confirm with "
                             f"`amp-postmortem fix {run.path} --step {f.step} --model SPEC`",
                [f"step {f.step}: {f.message}"], "recorded",
                code=f"from recorders.fp32 import keep_fp32\nkeep_fp32(model.get_submodule({f.layer!r}))",
                data={"modules": [f.layer], "step": f.step}))
            break
    if kinds & _SCALE_FINDINGS:
        from ..whatif.scale_window import estimate_scale_window
        est = estimate_scale_window(run)
        cited = [f"{f.kind}: {f.message}" for f in summary.findings if f.kind in _SCALE_FINDINGS]
        if est.window:
            w = est.window
            recs.append(Recommendation(
                "scaler_settings", f"use GradScaler settings inside the estimated window 2^{w['min_k']}..2^{w['max_k']}",
                cited + [f"step {est.step}: gradient statistics at scale {est.recorded_scale:g} put the "
                         f"window at 2^{w['min_k']}..2^{w['max_k']} (recorded scale {est.recorded_position})"],
                "recorded", code=est.code, data={"window": w, "settings": est.settings}))
        else:
            recs.append(Recommendation("scaler_settings", "no loss scale fits the recorded gradients; "
                                       "see `scale-window` with --model", cited + est.notes[:1], "recorded"))
    if not recs and kinds <= {"healthy", "overflow_risk"}:
        recs.append(Recommendation("no_change", "nothing to change: the run is healthy",
                                   [f.message for f in summary.findings][:3], "recorded"))
    return recs


# ---------------------------------------------------------------- replayed
def _bundle_step(run: Run, step, rank, notes) -> int | None:
    from ..bundle import list_bundles
    found = [(s, r) for s, r, _ in list_bundles(run.path) if rank is None or r == rank]
    if step is not None:
        return int(step)
    if not found:
        notes.append("the run holds no replay bundle: recommendations from the recorded statistics only")
        return None
    bad = set()
    steps = run.steps
    if len(steps):
        bad = set(steps.loc[steps["skipped"].astype(bool) | steps["loss_nonfinite"].astype(bool), "step"]) \
            if "loss_nonfinite" in steps else set(steps.loc[steps["skipped"].astype(bool), "step"])
    pick = next((s for s, _ in found if s in bad), found[0][0])
    return int(pick)


def _replayed(run, step, rank, model, device, policy, progress, notes, summary) -> list:
    from ..replay import resolve_policy
    from ..whatif import prepare
    from ..whatif.bisect import bisect_samples
    from ..whatif.fix import find_fix
    from ..whatif.scale_window import replay_scale_window

    p = prepare(run.path, step, rank=rank, model=model, device=device, policy=policy, keep_inputs=True)
    notes.extend(p.notes)
    recs = []
    baseline = p.trial()
    ref_bad = any(n.startswith("the float64 reference") for n in p.notes)
    fix = find_fix(None, prepared=p, progress=progress) if not ref_bad else None
    if not baseline["saved"]:
        b = bisect_samples(None, prepared=p, progress=progress)
        if ref_bad or b.kind == "data":
            recs.append(Recommendation(
                "check_data", f"check the data of step {step}" +
                (f": samples {', '.join(map(str, b.bad_samples))} of the batch" if b.kind == "data" else ""),
                [b.message] + (["the float64 replay is non-finite too: no precision setting fixes it"]
                               if ref_bad else []), "replay", data={"bad_samples": b.bad_samples, "kind": b.kind}))
    if fix is not None and fix.fix:
        t = next(t for t in fix.trials if sorted(t["modules"]) == sorted(fix.fix))
        recs.append(Recommendation(
            "keep_fp32", f"keep {', '.join(fix.fix)} in float32",
            [f"step {step} in {p.precision} as recorded: {_state(fix.baseline)}",
             f"with {', '.join(fix.fix)} in float32: {_state(t)}, gradient error vs float64 "
             f"{_pct(t['grad_rel_err'])} ({len(fix.trials)} trials, {fix.search} search)"],
            "replay", code=fix.patch, data={"modules": fix.fix, "trial": t}))
    scale_findings = bool(summary.kinds() & _SCALE_FINDINGS)
    if p.precision == "fp16" and (not baseline["saved"] or scale_findings):
        bf16 = p.trial(backoff=False, precision="bf16", loss_scale=1.0,
                       policy=resolve_policy(policy, p.bundle, "bf16"))
        avoids = bool(bf16["saved"])
        recs.append(Recommendation(
            "use_bf16", ("bfloat16 avoids the problem: autocast with dtype=torch.bfloat16, no GradScaler"
                         if avoids else "bfloat16 does not avoid the problem"),
            [f"bfloat16 replay of step {step} (no loss scale): {_state(bf16)}, gradient error vs float64 "
             f"{_pct(bf16['grad_rel_err'])}"], "replay",
            code=("torch.autocast(device_type, dtype=torch.bfloat16)" if avoids else None),
            data={"avoids": avoids, "trial": bf16}))
    else:
        bf16 = None
    kept = tuple(fix.fix) if fix is not None and fix.fix else ()
    window = None
    if p.precision == "fp16" and not ref_bad:
        sw = replay_scale_window(None, prepared=p, fp32_modules=kept, progress=progress)
        window = sw.window
        own = [n for n in sw.notes if n not in p.notes and not n.startswith("replayed with")]
        if window and (sw.recorded_position != "inside" or scale_findings or kept):
            recs.append(Recommendation(
                "scaler_settings", f"keep the loss scale within 2^{window['min_k']}..2^{window['max_k']}",
                [f"step {step} replayed at 2^{sw.rows[0]['k']}..2^{sw.rows[-1]['k']}"
                 + (f" with {', '.join(kept)} in float32" if kept else "")
                 + f": usable 2^{window['min_k']}..2^{window['max_k']}; the recorded scale "
                   f"{sw.recorded_scale:g} is {sw.recorded_position}"] + own,
                "replay", code=sw.code, data={"window": window, "settings": sw.settings}))
    fp16_ok = baseline["saved"] or (fix is not None and bool(fix.fix)) or window is not None
    data_problem = any(r.kind == "check_data" for r in recs)
    if not ref_bad and not data_problem and not fp16_ok and not (bf16 and bf16["saved"]):
        recs.append(Recommendation(
            "avoid_mixed_precision",
            "do not use mixed precision for this model as written: train it in float32 (or move the failing "
            "code of the model's own forward into a submodule that keep_fp32 can wrap)",
            [f"{p.precision} as recorded: {_state(baseline)}",
             f"no set of up to {len(fix.candidates) if fix else 0} candidate modules kept in float32 saves it",
             "no loss scale makes it finite",
             f"bfloat16: {_state(bf16) if bf16 else 'not tried'}"], "replay"))
    if not recs:
        inside = (f"; the recorded loss scale {p.loss_scale:g} is inside the replayed window "
                  f"2^{window['min_k']}..2^{window['max_k']}" if window else "")
        recs.append(Recommendation("no_change", f"step {step} replays finite as recorded: nothing to change",
                                   [f"{p.precision} as recorded: {_state(baseline)}{inside}"] +
                                   [f.message for f in summary.findings if f.kind == "healthy"], "replay"))
    return recs


def _state(t: dict) -> str:
    if t["finite"]:
        return "finite" + (f" (at loss scale {t['loss_scale']:g})" if t.get("backoffs") else "")
    where = [w for w, ok in (("forward", t["forward_finite"]), ("backward", t["backward_finite"])) if not ok]
    return f"non-finite in the {' and '.join(where)} ({t['nonfinite_values']} NaN/Inf values)"


def _pct(v) -> str:
    if v is None or v != v:
        return "-"
    return "inf" if v == float("inf") else f"{v:.1%}"
