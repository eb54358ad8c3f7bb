"""What to change, each recommendation with its evidence.

From the recorded run alone (`summary`'s findings and the loss-scale window
estimated from the recorded statistics; `keep_fp32`, `scaler_settings` and
`gradient_drift` are then marked not `verified`, with `why`):
- `check_data`: the forward origin is the model's input (`<input>`);
- `training_instability`: `summary` found it: the only recommendation
  (learning rate, warm-up, clipping, the layer whose weights grew), since
  keep_fp32 or a loss scale would only postpone the failure;
- `keep_fp32` (a candidate): the module named as the forward origin of a
  non-finite step, to be confirmed by `fix` (a replay);
- `gradient_drift`: the scale collapses, sits low or gradients underflow,
  and the window estimated at steps spread over the run moves
  (`window_drift`): no fixed GradScaler setting fixes it; the layers whose
  overflows drive the backoffs (`scale`'s drivers) are what grows;
- `scaler_settings`: otherwise, for those findings, GradScaler settings
  inside the window estimated at the last clean full-tier step (the one
  with threshold shares) before the first non-finite forward (after it the statistics describe the failure); a
  collapse driven by that forward overflow is said to be its consequence.

With a model (and a replay bundle in the run), the what-if replays of one
bundle's step decide instead, each remedy also tried on the run's other
saved bundles (`fix`'s saved and not saved steps, the scale window lowered
until every saved step a scale can save is finite) (`step`, else
`pick_bundle`: the earliest bundle saved for nonfinite_loss or
nonfinite_tensor, else request or step_list, else scale_low, else skipped):
- `check_data`: the float64 replay is non-finite too, or a few samples of
  the batch fail alone (`bisect`): no precision setting is the fix;
- `keep_fp32`: the smallest set of modules whose float32 execution makes the
  step finite (`fix`), with the patch;
- `use_bf16`: whether a bfloat16 replay of the step (no loss scale) saves it,
  judged like every trial (`whatif.judge`), except that a judgement resting
  on gradients measured from a substitute output gradient is not decisive
  (`bf16_verdict`);
- `gradient_drift` / `scaler_settings`: the replayed loss-scale window (with
  the `keep_fp32` modules applied) and GradScaler settings inside it, unless
  the recorded window moves;
- `training_instability`: the run's loss rose and its values grew before
  it failed (`instability`), or the loss rose and the float64 replay of the
  step is itself beyond float16's range: the training is the fix (learning
  rate, warm-up, clipping), not keep_fp32, which is then only evidence;
- `avoid_mixed_precision`: no tried configuration (as recorded, any loss
  scale, modules kept in float32, bfloat16) keeps the step finite; or no
  float16 one does (then float16 is not advisable: bfloat16, or the
  instability first).
- `no_change`: nothing to recommend (a healthy run).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import pandas as pd

from recorders import schema

from .loader import Run
from .names import ROOT_DISPLAY, BackwardStart, Word
from .result import CommandResult
from .analyses.bundle_choice import pick_bundle



class RecommendationKind(Word):
    """What a recommendation recommends (the module's doc), in the order
    they are listed; `value` is the `--json` "kind"."""
    CHECK_DATA = "check_data"
    TRAINING_INSTABILITY = "training_instability"
    KEEP_FP32 = "keep_fp32"
    ADD_GRAD_SCALER = "add_grad_scaler"
    GRADIENT_DRIFT = "gradient_drift"
    USE_BF16 = "use_bf16"
    SCALER_SETTINGS = "scaler_settings"
    AVOID_MIXED_PRECISION = "avoid_mixed_precision"
    NO_CHANGE = "no_change"

ORDER = tuple(RecommendationKind)


class Source(Word):
    """What a recommendation rests on; `value` is the `--json` "source"."""
    REPLAY = "replay"              # what-if replays of saved steps
    RECORDED = "recorded"          # the recorded statistics alone
_SCALE_FINDINGS = {"scale_collapse", "stuck_low_scale", "grad_underflow", "unscaled_fp16_backward"}
DEFAULT_SCALE_K = 16  # GradScaler's default init_scale, 2^16
DRIFT_BITS = 4        # the window "moves" when its overflow edge shifts by more than this
DRIFT_SAMPLES = 12    # steps at which the window is estimated for that


@dataclass
class Recommendation:
    kind: RecommendationKind
    action: str
    evidence: list                 # sentences, each citing numbers
    source: Source
    code: str | None = None
    data: dict = field(default_factory=dict)
    # Checked by replaying the run's saved steps; else `why` not.
    verified: bool = False
    why: str | None = None

    def to_dict(self) -> dict:
        return {"kind": self.kind.value, "action": self.action, "evidence": self.evidence, "source": self.source.value,
                "code": self.code, "data": self.data, "verified": self.verified, "why": self.why}


@dataclass
class Recommendations(CommandResult):
    run: str
    step: int | None               # the replayed step, when a replay ran
    replayed: bool
    recommendations: list
    notes: list = field(default_factory=list)
    show_table = False

    def kinds(self) -> list[str]:
        """The recommendations' kinds as their `--json` strings."""
        return [r.kind.value for r in self.recommendations]

    def get(self, kind: RecommendationKind | str) -> Recommendation | None:
        """The recommendation of `kind` (the enum or its `--json` string)."""
        kind = RecommendationKind(kind)
        return next((r for r in self.recommendations if r.kind is kind), None)

    def document(self) -> dict:
        from recorders.plain import plain
        return plain({"run": self.run, "step": self.step, "replayed": self.replayed,
                      "recommendations": [r.to_dict() for r in self.recommendations], "notes": self.notes})

    def table(self) -> pd.DataFrame:
        return pd.DataFrame([{"kind": r.kind.value, "source": r.source.value, "verified": r.verified,
                              "action": r.action, "evidence": " | ".join(r.evidence)}
                             for r in self.recommendations],
                            columns=["kind", "source", "verified", "action", "evidence"])

    def lines(self) -> list[str]:
        head = (f"recommendations for {self.run}" +
                (f" (replayed step {self.step})" if self.replayed else " (recorded statistics only)"))
        out = [head]
        for i, r in enumerate(self.recommendations, 1):
            out += ["", f"{i}. [{r.kind.value}] {r.action}"]
            if not r.verified and r.why:
                out.append(f"   ({'not verified' if r.source is Source.REPLAY else 'estimate, not verified'}: {r.why})")
            out += [f"   evidence ({r.source.value}): {e}" for e in r.evidence]
            if r.code:
                out += ["   " + line for line in r.code.splitlines()]
        out += [f"note: {n}" for n in self.notes]
        return out


def recommend(run: Run, *, model=None, step: int | None = None, rank: int | None = None, device: str = "cpu",
              policy: str = "recorded", loss_fn=None, progress=None) -> Recommendations:
    """Recommendations for `run`; what-if replays when `model` is given
    (`loss_fn(output, micro_batch)` as in `replay`)."""
    from .analyses.summary import summarize

    summary = summarize(run)
    notes: list[str] = []
    if model is not None:
        picked = _bundle_step(run, step, rank, notes)
        if picked is not None:
            bundle_step, bundle_rank = picked
            recs = _replayed(run, bundle_step, bundle_rank, model, device, policy, loss_fn, progress, notes,
                             summary)
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
    from .whatif.scale_estimate import unverified_why
    recs = _recorded_advice(run, summary)
    checks = {RecommendationKind.KEEP_FP32: "replay the saved steps with the module in float32 (`fix`)",
              RecommendationKind.SCALER_SETTINGS: "replay the saved steps at the window's edges",
              RecommendationKind.GRADIENT_DRIFT: "replay the saved steps at the window's edges (the drift is "
                                                 "estimated from steps spread over the run)"}
    for r in recs:
        if r.kind in checks:
            r.why = unverified_why(run, checks[r.kind])
    return recs


def _modules_window_check(p, fix, model, device, policy, loss_fn):
    """The module-level fix re-run over the saved window (`fix` checks its
    cheapest remedy, which may be a line); None without a model."""
    if model is None:
        return None
    from .whatif.fix import RemedyKind, check_remedy
    if fix.window_check is not None and fix.remedies and fix.remedies[0].kind is RemedyKind.MODULES:
        return fix.window_check
    remedy = next((r for r in fix.remedies if r.kind is RemedyKind.MODULES), None)
    if remedy is None:
        return None
    return check_remedy(p, remedy, model=model, device=device, policy=policy, loss_fn=loss_fn)


def _instability_recommendation(unstable, source: Source, extra=(), verified: bool = False) -> Recommendation:
    """Instability: what helps it (learning rate, warm-up, clipping, the
    layer whose weights grew), never keep_fp32 or the loss scale."""
    action = ("fix the training, not the precision: " + "; ".join(unstable.remedies())
              + ". Float32 fails too (a float32 re-run of the saved window diverges): keeping modules in float32 "
                "or changing the loss scale only postpones it" if verified else
              "suspected training instability (undetermined): " + "; ".join(unstable.remedies())
              + " if a float32 run fails too; if it does not, the problem is float16's")
    return Recommendation(
        RecommendationKind.TRAINING_INSTABILITY, action,
        list(unstable.evidence) + list(extra), source, data=unstable.to_dict(), verified=verified,
        why=None if verified else "from the recorded statistics; a float32 re-run of a saved window "
                                  "(`amp-postmortem rerun RUN --precision fp32 --model SPEC`, recorded with "
                                  "BundlePolicy(window_steps=K)) or a float32 run of the job (`amp-postmortem "
                                  "compare FP32_RUN RUN`) decides it")


def _recorded_advice(run: Run, summary) -> list:
    """The recorded recommendations: each decided on typed outcomes
    (`recorded_origin`, `decide_recorded_scale`), its words made by the
    `recorded_*_recommendation` functions."""
    fwd = _forward_finding(summary)
    origin = recorded_origin(fwd)
    if "training_instability" in summary.kinds() and origin is not RecordedOrigin.INPUT:
        from .analyses.instability import find_instability
        return [_instability_recommendation(find_instability(run), Source.RECORDED)]
    recs = []
    if origin is RecordedOrigin.INPUT:
        recs.append(recorded_check_data_recommendation(fwd))
    elif origin is RecordedOrigin.MODULE:
        recs.append(recorded_keep_fp32_recommendation(fwd, run.path))
    unscaled = _unscaled_finding(summary)
    scale = decide_recorded_scale(run, summary, fwd)
    if unscaled is not None:
        # The run applied no scale: its statistics cannot judge one (they are flushed); add the scaler.
        recs.append(add_grad_scaler_recommendation(unscaled, scale.estimate if scale else None, None, run))
    elif scale is not None:
        recs.append(recorded_scale_recommendation(scale, summary, fwd))
    if not recs and summary.kinds() <= {"healthy", "overflow_risk", "grad_subnormal"}:
        recs.append(Recommendation(RecommendationKind.NO_CHANGE, "nothing to change: the run is healthy",
                                   [f.message for f in summary.findings][:3], Source.RECORDED))
    return recs


# ------------------------------------------------ recorded: the decisions
class RecordedOrigin(enum.Enum):
    """Where the recorded forward overflow was born, as the advice reads it."""
    INPUT = "input"                # the batch (`<input>`): check_data
    MODULE = "module"              # a module: a keep_fp32 candidate
    OTHER = "other"                # no module (the loss, the root): nothing to keep in float32


def recorded_origin(fwd) -> RecordedOrigin | None:
    """None without a forward origin."""
    if fwd is None:
        return None
    if fwd.layer == schema.INPUT_NAME:
        return RecordedOrigin.INPUT
    if fwd.layer and not fwd.layer.startswith("<"):
        return RecordedOrigin.MODULE
    return RecordedOrigin.OTHER


@dataclass(frozen=True)
class RecordedScale:
    """What the recorded statistics advise for the scale findings: the
    window's drift over the run (before the forward overflow at `before`),
    else the window estimated at the last clean full-tier step before it."""
    advice: ScaleAdvice            # DRIFT, SETTINGS or NO_WINDOW
    drift: dict                    # window_drift's
    estimate: object               # whatif.scale_result.ScaleWindowResult; None when the window drifts
    before: int | None


def decide_recorded_scale(run: Run, summary, fwd) -> RecordedScale | None:
    """None without a scale finding (collapse, low scale, underflow)."""
    if not summary.kinds() & _SCALE_FINDINGS:
        return None
    from .whatif.scale_window import estimate_scale_window
    before = fwd.step if fwd is not None else None
    drift = window_drift(run, before)
    if drift["moves"]:
        return RecordedScale(ScaleAdvice.DRIFT, drift, None, before)
    est = estimate_scale_window(run, before=before)
    return RecordedScale(ScaleAdvice.SETTINGS if est.window else ScaleAdvice.NO_WINDOW, drift, est, before)


# ------------------------------------------------ recorded: the words
def recorded_check_data_recommendation(fwd) -> Recommendation:
    return Recommendation(
        RecommendationKind.CHECK_DATA,
        f"check the data of step {fwd.step}: the non-finite values came in with the batch",
        [f"step {fwd.step}: {fwd.message}"], Source.RECORDED, data={"step": fwd.step})


def recorded_keep_fp32_recommendation(fwd, path) -> Recommendation:
    return Recommendation(
        RecommendationKind.KEEP_FP32, f"candidate: keep {fwd.layer} in float32; confirm with "
                                      f"`amp-postmortem fix {path} --step {fwd.step} --model SPEC`",
        [f"step {fwd.step}: {fwd.message}"], Source.RECORDED,
        code=f"from recorders.fp32 import keep_fp32\nkeep_fp32(model.get_submodule({fwd.layer!r}))",
        data={"modules": [fwd.layer], "step": fwd.step})


def recorded_scale_recommendation(scale: RecordedScale, summary, fwd) -> Recommendation:
    """gradient_drift or scaler_settings, citing the scale findings."""
    cited = [f"{f.kind}: {f.message}" for f in summary.findings if f.kind in _SCALE_FINDINGS]
    cited += _consequence(summary, fwd)
    if scale.advice is ScaleAdvice.DRIFT:
        return _drift_recommendation(scale.drift, summary, cited, Source.RECORDED)
    est, before, drift = scale.estimate, scale.before, scale.drift
    first = "once the forward overflow is fixed (keep_fp32 above), " if fwd is not None else ""
    if scale.advice is ScaleAdvice.NO_WINDOW:
        return Recommendation(RecommendationKind.SCALER_SETTINGS, f"{first}no loss scale fits the recorded "
                              "gradients; see `scale-window` with --model", cited + est.notes[:1], Source.RECORDED,
                              data={"drift": drift})
    w = est.window
    where = (f"step {est.step}, the last clean full-tier step before the forward overflow at step {before}"
             if before is not None else f"step {est.step}")
    return Recommendation(
        RecommendationKind.SCALER_SETTINGS, f"{first}use GradScaler settings inside the estimated window "
                                            f"2^{w['min_k']}..2^{w['max_k']}",
        cited + [f"{where}: gradient statistics at scale {est.recorded_scale:g} put the window at "
                 f"2^{w['min_k']}..2^{w['max_k']} (recorded scale {est.position_words})"]
        + [line for line in (est.edge_line(), est.loss_caveat()) if line],
        Source.RECORDED, code=est.code, data={"window": w, "settings": est.settings, "step": est.step,
                                         "drift": drift, "overflow_cause": _cause(est)})


def _unscaled_finding(summary):
    """The `unscaled_fp16_backward` finding, if any."""
    return next((f for f in summary.findings if f.kind == "unscaled_fp16_backward"), None)


def add_grad_scaler_recommendation(finding, estimate, replayed, run) -> Recommendation:
    """add_grad_scaler: float16 gradients travelled unscaled. `replayed`: the
    saved step's replayed scale window (the default 2^16 judged there);
    else `estimate`: the recorded window, whose overflow edge alone is
    known (the underflow edge rests on flushed statistics)."""
    from .whatif.scale_estimate import unverified_why
    device = finding.evidence.get("device_type")
    layers = [lay["name"] for lay in finding.evidence.get("layers", [])][:3]
    evidence = [f"{finding.kind}: {finding.message}"]
    k, verified, why = DEFAULT_SCALE_K, False, None
    if replayed is not None and replayed.window:
        w = replayed.window
        inside = w["min_k"] <= DEFAULT_SCALE_K <= w["max_k"]
        k = DEFAULT_SCALE_K if inside else (w["min_k"] + w["max_k"]) // 2
        verified = True
        evidence.append(f"step {replayed.step} replayed at every scale: usable 2^{w['min_k']}..2^{w['max_k']}"
                        + ("; the default init_scale 2^16 lies inside" if inside else ""))
    elif replayed is not None:
        why = f"the replay of step {replayed.step} found no usable scale"
        evidence.append(why)
    else:
        edge = _overflow_edge_k(estimate)
        if edge is not None and edge < DEFAULT_SCALE_K:
            k = max(0, edge - 1)
        if edge is not None:
            evidence.append(f"the recorded gradients overflow float16 above 2^{edge} (estimate); the underflow "
                            "edge cannot be estimated from gradients float16 already flushed")
        why = unverified_why(run, "replay the saved step with the scale")
    code = grad_scaler_code_for(device, k)
    return Recommendation(
        RecommendationKind.ADD_GRAD_SCALER,
        "add a GradScaler: the float16 gradients travel unscaled and underflow"
        + (f" (most signal lost in {', '.join(layers)})" if layers else "")
        + ("" if k == DEFAULT_SCALE_K else f"; start it at init_scale 2^{k}"),
        evidence, Source.REPLAY if replayed is not None else Source.RECORDED, code=code,
        data={"cause": finding.evidence.get("cause"), "layers": layers, "init_scale_k": k,
              "settings": {"init_scale": 2.0 ** k}},
        verified=verified, why=why)


def _overflow_edge_k(estimate):
    rows = getattr(estimate, "rows", None) or []
    edges = [r["overflow_k"] for r in rows if r.get("overflow_k") is not None]
    return min(edges) if edges else None


def grad_scaler_code_for(device_type, k: int) -> str:
    """The GradScaler lines; init_scale only when it is not the default."""
    scale = "" if k == DEFAULT_SCALE_K else f", init_scale=2.0 ** {k}"
    return (f'scaler = torch.amp.GradScaler("{device_type or "cuda"}"{scale})\n'
            "scaler.scale(loss).backward()\nscaler.step(optimizer)\nscaler.update()")


def _cause(sw) -> str | None:
    """The window's `EdgeCause` as its JSON value."""
    return sw.overflow_cause.value if sw.overflow_cause is not None else None


def _forward_finding(summary):
    """The `nonfinite` finding of a forward origin, if any."""
    for f in summary.findings:
        origin = f.evidence.get("origin") if f.kind == "nonfinite" else None
        if origin and origin.get("phase") == "forward":
            return f
    return None


def _consequence(summary, fwd) -> list:
    """A sentence when the scale collapse is the forward overflow's doing:
    the layer whose overflows drive most backoffs (`scale`'s first driver)
    is the forward origin, or the collapse starts after it."""
    collapse = next((f for f in summary.findings if f.kind == "scale_collapse"), None)
    if fwd is None or collapse is None:
        return []
    if collapse.layer != fwd.layer and (collapse.step is None or collapse.step < fwd.step):
        return []
    return [f"the collapse (from step {collapse.step}) is driven by the forward overflow of {fwd.layer} "
            f"(first at step {fwd.step}): the non-finite steps the scaler skips make its backoffs; it is a "
            "consequence, fix the forward first"]


def window_drift(run: Run, before: int | None = None, samples: int = DRIFT_SAMPLES) -> dict:
    """Does the estimated loss-scale window move over the run?

    The window is estimated (`estimate_scale_window`) at up to `samples`
    clean steps with gradient rows, evenly spread over the run (before step
    `before` when given). Its overflow edge is the robust one (from the
    largest gradient of each layer); the window moves when the median of
    that edge over the last third of those steps differs from the median
    over the first third by more than `DRIFT_BITS`: downwards when the
    gradients grow, upwards when they shrink. No fixed GradScaler setting
    then keeps the run inside it for long.
    Returns {"moves", "shift_bits", "direction", "windows": [{"step",
    "min_k", "max_k"}, ...]}."""
    import numpy as np

    from .whatif.scale_window import estimate_scale_window
    s = run.steps
    if before is not None:
        s = s[s["step"] < int(before)]
    clean = s[~s["skipped"].astype(bool) & (s["tensor_rows"].fillna(0) > 0)]
    picked = sorted({int(v) for v in clean["step"]})
    if len(picked) > samples:
        picked = [picked[i] for i in np.linspace(0, len(picked) - 1, samples).round().astype(int)]
    windows = []
    for step in picked:
        w = estimate_scale_window(run, step).window
        if w is not None:
            windows.append({"step": step, "min_k": w["min_k"], "max_k": w["max_k"]})
    out = {"moves": False, "shift_bits": None, "direction": None, "windows": windows}
    if len(windows) < 3:
        return out
    third = max(1, len(windows) // 3)
    early = float(np.median([w["max_k"] for w in windows[:third]]))
    late = float(np.median([w["max_k"] for w in windows[-third:]]))
    out["shift_bits"] = late - early
    out["direction"] = "down" if late < early else ("up" if late > early else None)
    out["moves"] = abs(late - early) > DRIFT_BITS
    return out


def _drift_recommendation(drift, summary, cited, source: Source, extra=()) -> Recommendation:
    scale = next((f for f in summary.findings if f.kind in ("scale_collapse", "stuck_low_scale")), None)
    drivers = list((scale.evidence.get("drivers") if scale else None) or [])
    first, last = drift["windows"][0], drift["windows"][-1]
    # Decided on the shift itself (negative: the overflow edge came down),
    # not on the word `direction` that says it.
    down = drift["shift_bits"] < 0
    moved = (f"the estimated loss-scale window moves {abs(drift['shift_bits']):g} bits "
             f"{'down' if down else 'up'} over the run: 2^{first['min_k']}..2^{first['max_k']} "
             f"at step {first['step']}, 2^{last['min_k']}..2^{last['max_k']} at step {last['step']}")
    if down:
        grows = ", ".join(d or ROOT_DISPLAY for d in drivers[:3]) or "the layers that overflow"
        action = (f"no fixed GradScaler setting fixes this: the gradients keep growing; fix what grows "
                  f"({grows}: its gradients overflow at the skipped steps)")
    else:
        action = ("no fixed GradScaler setting fixes this: the gradients keep shrinking; find what shrinks "
                  "(`amp-postmortem ranges` lists the layers that underflow)")
    return Recommendation(RecommendationKind.GRADIENT_DRIFT, action, cited + [moved] + list(extra), source,
                          data={"drift": drift, "drivers": drivers})


# ---------------------------------------------------------------- replayed
def _bundle_step(run: Run, step, rank, notes) -> tuple[int, int | None] | None:
    if step is not None:
        return int(step), rank
    picked = pick_bundle(run, rank)
    if picked is None:
        notes.append("the run holds no replay bundle: recommendations from the recorded statistics only")
        return None
    s, r, reasons = picked
    notes.append(f"replayed the bundle of step {s} (saved for {', '.join(reasons) or 'an unknown reason'}): "
                 "the earliest of the most telling reason; pass --step to replay another")
    return s, (rank if rank is not None else r)


def _replayed(run, step, rank, model, device, policy, loss_fn, progress, notes, summary) -> list:
    """The replayed recommendations: each remedy decided on typed outcomes
    (`decide_*`), its words made by the `*_recommendation` functions."""
    from .replaying import resolve_policy
    from .whatif import prepare
    from .whatif.bisect import bisect_samples, slicing_note
    from .whatif.fix import find_fix
    from .whatif.scale_result import recorded_loss_dtype
    from .whatif.scale_window import replay_scale_window

    p = prepare(run.path, step, rank=rank, model=model, device=device, policy=policy, loss_fn=loss_fn,
                keep_inputs=True)
    notes.extend(p.notes)
    recs = []
    baseline = p.trial()
    fix = find_fix(None, prepared=p, progress=progress, model=model, device=device, policy=policy,
                   loss_fn=loss_fn) if p.reference_finite else None
    check_data = None
    if not baseline.saved:
        b = bisect_samples(None, prepared=p, progress=progress)
        note = slicing_note(b.slicing)
        if note:
            notes.append(note)
        check_data = decide_check_data(step, p.reference_finite, b)
        if check_data is not None:
            recs.append(check_data_recommendation(check_data))
    instability = decide_instability(run, p, step, model=model, device=device, policy=policy, loss_fn=loss_fn)
    window_checks = {}  # RecommendationKind -> the WindowCheck its `verified` is decided on
    keep = None
    if fix is not None and fix.fix:
        keep = KeepFp32(step, p.precision, fix, _modules_window_check(p, fix, model, device, policy, loss_fn),
                        _substitute(p))
        window_checks[RecommendationKind.KEEP_FP32] = keep.window_check
        if not instability.unstable:
            recs.append(keep_fp32_recommendation(keep))
    if instability.unstable:
        recs.append(_instability_recommendation(
            instability.report, Source.REPLAY, extra=[instability.verdict.sentence()]
            + ([instability.beyond] if instability.beyond else []) + fix_lines(keep, fix, step, baseline.saved),
            verified=instability.decided))
    scale_findings = bool(summary.kinds() & _SCALE_FINDINGS)
    bf16 = None
    if p.precision == "fp16" and (not baseline.saved or scale_findings):
        bf16 = decide_bf16(p.trial(backoff=False, precision="bf16", loss_scale=1.0,
                                   policy=resolve_policy(policy, p.bundle, "bf16")), p, step, model=model,
                           device=device, policy=policy, loss_fn=loss_fn)
        window_checks[RecommendationKind.USE_BF16] = bf16.window_check
        recs.append(bf16_recommendation(bf16, step, _substitute(p)))
    kept = tuple(fix.fix) if fix is not None and fix.fix else ()
    window = None
    if p.precision == "fp16" and p.reference_finite:
        sw = replay_scale_window(None, prepared=p, fp32_modules=kept, progress=progress, verify=True, model=model,
                                 device=device, policy=policy, loss_fn=loss_fn,
                                 loss_dtype=recorded_loss_dtype(run, step)[0])
        window = sw.window
        drift = window_drift(run, _forward_step(summary)) if scale_findings else {"moves": False}
        advice = decide_scale_advice(sw, drift["moves"], scale_findings, kept)
        unscaled = _unscaled_finding(summary)
        if unscaled is not None:
            # A scale the run never applied, judged by replaying the saved step with it.
            window_checks[RecommendationKind.ADD_GRAD_SCALER] = sw.window_check
            recs.append(add_grad_scaler_recommendation(unscaled, None, sw, run))
        elif advice is ScaleAdvice.DRIFT:
            recs.append(_drift_recommendation(
                drift, summary, [f"{f.kind}: {f.message}" for f in summary.findings if f.kind in _SCALE_FINDINGS],
                Source.RECORDED, extra=[f"step {step} replayed: usable 2^{window['min_k']}..2^{window['max_k']} at "
                                   "this step only"]))
        elif advice is ScaleAdvice.SETTINGS:
            window_checks[RecommendationKind.SCALER_SETTINGS] = sw.window_check
            recs.append(scaler_settings_recommendation(sw, step, kept, p.notes))
    fp16_ok = baseline.saved or keep is not None or window is not None
    avoid = no_fp16_config(unstable=instability.unstable, reference_finite=p.reference_finite,
                           data_problem=check_data is not None, fp16_ok=fp16_ok,
                           bf16_ok=bf16 is not None and bf16.avoids, precision=p.precision)
    if avoid is not None:
        recs.append(_avoid_recommendation(avoid, step, p.precision, baseline, fix, bf16.trial if bf16 else None,
                                          instability.beyond))
    for r in recs:
        _settle_verified(r, window_checks.get(r.kind))
    if not recs:
        recs.append(no_change_recommendation(step, p, baseline, window, summary))
    return recs


def _settle_verified(r: Recommendation, check) -> None:
    """A replayed recommendation is verified by the replays of the saved
    steps unless the re-run of the saved window with it fails."""
    from .whatif.window_check import WindowStatus
    if check is not None and check.status is WindowStatus.FAILS:
        r.verified = False  # it saves the saved step, not the window's steps after it
        r.why = f"the re-run of the saved window with it goes non-finite at step {check.failed_at}"
    elif r.source is Source.REPLAY and r.kind is not RecommendationKind.TRAINING_INSTABILITY:
        r.verified = True  # each rests on replays of the saved steps
    elif r.kind is RecommendationKind.GRADIENT_DRIFT:
        r.why = "the window's drift is estimated from the recorded statistics of steps spread over the run"


# ------------------------------------------------ replayed: the decisions
@dataclass(frozen=True)
class CheckData:
    """check_data decided from the replays: the float64 run of the step is
    non-finite too, and/or `bisect` found the data to blame."""
    step: int
    reference_finite: bool
    bisect: object                 # whatif.bisect.BisectReport

    @property
    def by_samples(self) -> bool:
        from .whatif.bisect import BisectKind
        return self.bisect.kind is BisectKind.DATA


def decide_check_data(step: int, reference_finite: bool, bisect) -> CheckData | None:
    """check_data when no precision setting is the fix: float64 fails too,
    or a few samples of the batch fail alone with suspicious inputs."""
    from .whatif.bisect import BisectKind
    if reference_finite and bisect.kind is not BisectKind.DATA:
        return None
    return CheckData(step, reference_finite, bisect)


@dataclass(frozen=True)
class Instability:
    """Whether the replayed step's failure is the training's: `unstable`,
    `decided` by a float32 re-run of the saved window (`verdict`), and the
    float64 replay's range sentence (`beyond`, None when within range)."""
    unstable: bool
    decided: bool
    report: object                 # analyses.instability.InstabilityReport
    verdict: object                # analyses.precision_verdict.PrecisionVerdict
    beyond: str | None


def decide_instability(run, p, step, *, model, device, policy, loss_fn) -> Instability:
    from .analyses.instability import LOSS_RISE, failure_step, find_instability, replay_evidence
    from .analyses.precision_verdict import Verdict
    from .whatif.verdict import decide
    unstable = find_instability(run)
    beyond = replay_evidence(run, p.reference, step) if p.reference_finite else None
    rose = bool(unstable.loss_rise) and unstable.loss_rise["ratio"] >= LOSS_RISE
    # The float64 replay beyond float16's range is instability only with a
    # rising loss: a model whose exact values exceed 65504 while it trains
    # well (attention logits) is float16's problem, which keep_fp32 solves.
    is_unstable = unstable.unstable or (beyond is not None and rose)
    # Decided by a float32 re-run of the saved window when there is one
    # (`whatif/verdict.py`): the recorded evidence only suggests it.
    verdict = decide(run, failure_step(run), model=model, rank=p.rank, device=device, policy=policy, loss_fn=loss_fn)
    if verdict.verdict is Verdict.TRAINING_INSTABILITY:
        is_unstable = True
    elif verdict.verdict is Verdict.PRECISION:
        is_unstable = False
    return Instability(is_unstable, verdict.verdict is Verdict.TRAINING_INSTABILITY, unstable, verdict, beyond)


@dataclass(frozen=True)
class KeepFp32:
    """The modules `fix` found, its trial with them, what it does to the
    other saved steps and the saved window."""
    step: int
    precision: str
    fix: object                    # whatif.fix.FixReport with a fix
    window_check: object           # WindowCheck of the modules, or None
    substitute: str = ""           # the substitute-gradient caveat ("" when none)

    @property
    def trial(self):
        return next(t for t in self.fix.trials if sorted(t.modules) == sorted(self.fix.fix))


@dataclass(frozen=True)
class Bf16Replay:
    """The bfloat16 replay of the step (no loss scale) and its window."""
    trial: object                  # whatif.Trial
    avoids: bool
    confirmed: bool
    why: str | None
    window_check: object           # WindowCheck in bfloat16, or None

    @property
    def outcome(self) -> "Bf16Outcome":
        return _bf16_outcome(self.avoids, self.confirmed, self.window_check)


def decide_bf16(trial, p, step, *, model, device, policy, loss_fn) -> Bf16Replay:
    avoids, confirmed, why = bf16_verdict(trial, p.backward_start)
    check = None
    if avoids and model is not None:
        from .whatif.window_check import check_over_window, run_of_bundle
        check = check_over_window(run_of_bundle(p.bundle), step, "bfloat16 autocast and no GradScaler",
                                  model=model, rank=p.rank, precision="bf16", device=device, policy=policy,
                                  loss_fn=loss_fn, use_scaler=False)
    return Bf16Replay(trial, avoids, confirmed, why, check)


class ScaleAdvice(enum.Enum):
    """What the loss-scale window advises (replayed: `decide_scale_advice`;
    estimated from the recorded statistics: `decide_recorded_scale`)."""
    DRIFT = "drift"                # the recorded window moves: no fixed setting (gradient_drift)
    SETTINGS = "settings"          # GradScaler settings inside the window (scaler_settings)
    NO_WINDOW = "no_window"        # recorded only: no loss scale fits the recorded gradients (scaler_settings)


def decide_scale_advice(sw, drift_moves: bool, scale_findings: bool, kept) -> ScaleAdvice | None:
    """None when there is no window, or the recorded scale sits inside it
    with nothing that asks about the scale."""
    from .whatif.scale_result import ScalePosition
    if not sw.window:
        return None
    if drift_moves:
        return ScaleAdvice.DRIFT
    if sw.recorded_position is not ScalePosition.INSIDE or scale_findings or kept:
        return ScaleAdvice.SETTINGS
    return None


# ---------------------------------------------------- replayed: the words
def check_data_recommendation(c: CheckData) -> Recommendation:
    b = c.bisect
    return Recommendation(
        RecommendationKind.CHECK_DATA, f"check the data of step {c.step}" +
        (f": samples {', '.join(map(str, b.bad_samples))} of the batch" if c.by_samples else ""),
        [b.message] + ([] if c.reference_finite else
                       ["the float64 replay is non-finite too: no precision setting fixes it"]), Source.REPLAY,
        data={"bad_samples": b.bad_samples, "kind": b.kind.value, "slicing": b.slicing.to_dict()})


def fix_lines(keep: KeepFp32 | None, fix, step, saved_as_recorded: bool) -> list:
    """What the module-level fix does, as evidence (keep_fp32's, or the
    instability's when keep_fp32 is only evidence)."""
    if keep is not None:
        t = keep.trial
        return [f"with {', '.join(fix.fix)} in float32 step {step} replays {_state(t)}, gradient error vs "
                f"float64 {_pct(t.grad_rel_err)} ({len(fix.trials)} trials, {fix.search.value} search)"
                + keep.substitute] + _saved_steps_lines(fix)
    if fix is not None and not saved_as_recorded:
        return [f"no set of up to {len(fix.candidates)} candidate modules kept in float32 saves step {step}"]
    return []


def keep_fp32_recommendation(k: KeepFp32) -> Recommendation:
    fix, check = k.fix, k.window_check
    partial = fix.not_saved_steps
    return Recommendation(
        RecommendationKind.KEEP_FP32, f"keep {', '.join(fix.fix)} in float32" + (
            f": it saves step(s) {', '.join(map(str, fix.saved_steps))} but NOT "
            f"{', '.join(map(str, partial))} of the saved steps" if partial else ""),
        [f"step {k.step} in {k.precision} as recorded: {_state(fix.baseline)}"]
        + fix_lines(k, fix, k.step, False) + ([check.line()] if check is not None else []),
        Source.REPLAY, code=fix.patch,
        data={"modules": fix.fix, "trial": k.trial.to_dict(), "saved_steps": fix.saved_steps,
              "not_saved_steps": partial, "window_check": check.to_dict() if check else None},
        verified=True)


def bf16_recommendation(b: Bf16Replay, step, substitute: str) -> Recommendation:
    return Recommendation(
        RecommendationKind.USE_BF16, _bf16_action(b.outcome, step, b.window_check),
        [f"bfloat16 replay of step {step} (no loss scale): {_state(b.trial)}, gradient error vs float64 "
         f"{_pct(b.trial.grad_rel_err)}" + substitute] + ([b.why] if b.why else [])
        + ([b.window_check.line()] if b.window_check is not None else []), Source.REPLAY,
        code=("torch.autocast(device_type, dtype=torch.bfloat16)" if b.avoids else None),
        data={"avoids": b.avoids, "gradients_confirmed": b.confirmed, "trial": b.trial.to_dict(),
              "window_check": b.window_check.to_dict() if b.window_check is not None else None})


def scaler_settings_recommendation(sw, step, kept, step_notes) -> Recommendation:
    from .whatif.scale_window import kept_note
    window = sw.window
    own = [n for n in sw.notes if n not in step_notes and not (kept and n == kept_note(kept))]
    return Recommendation(
        RecommendationKind.SCALER_SETTINGS, f"keep the loss scale within 2^{window['min_k']}..2^{window['max_k']}",
        [f"step {step} replayed at 2^{sw.rows[0]['k']}..2^{sw.rows[-1]['k']}"
         + (f" with {', '.join(kept)} in float32" if kept else "")
         + f": usable 2^{window['min_k']}..2^{window['max_k']}; the recorded scale "
           f"{sw.recorded_scale:g} is {sw.position_words}"]
        + [line for line in (sw.edge_line(),) if line] + [c.line() for c in sw.checked_steps] + own
        + ([sw.window_check.line()] if sw.window_check is not None else []),
        Source.REPLAY, code=sw.code, data={"window": window, "settings": sw.settings,
                                      "checked_steps": [c.to_dict() for c in sw.checked_steps],
                                      "overflow_cause": _cause(sw),
                                      "window_check": sw.window_check.to_dict() if sw.window_check else None},
        verified=True)


def no_change_recommendation(step, p, baseline, window, summary) -> Recommendation:
    inside = (f"; the recorded loss scale {p.loss_scale:g} is inside the replayed window "
              f"2^{window['min_k']}..2^{window['max_k']}" if window else "")
    return Recommendation(RecommendationKind.NO_CHANGE, f"step {step} replays finite as recorded: nothing to change",
                          [f"{p.precision} as recorded: {_state(baseline)}{inside}"] +
                          [f.message for f in summary.findings if f.kind == "healthy"], Source.REPLAY,
                          verified=True)


class Bf16Outcome(enum.Enum):
    """What the bfloat16 replay of the step (and its window) shows."""
    AVOIDS = "avoids"                      # saved, gradients confirmed
    AVOIDS_UNCONFIRMED = "avoids_unconfirmed"  # finite; its gradients measured from a substitute
    DOES_NOT_AVOID = "does_not_avoid"
    STEP_ONLY = "step_only"                # saves the step, the window re-run in bfloat16 fails


def _bf16_outcome(avoids: bool, confirmed: bool, window_check) -> Bf16Outcome:
    from .whatif.window_check import WindowStatus
    if window_check is not None and window_check.status is WindowStatus.FAILS:
        return Bf16Outcome.STEP_ONLY
    if not avoids:
        return Bf16Outcome.DOES_NOT_AVOID
    return Bf16Outcome.AVOIDS if confirmed else Bf16Outcome.AVOIDS_UNCONFIRMED


def _bf16_action(outcome: Bf16Outcome, step, window_check) -> str:
    if outcome is Bf16Outcome.STEP_ONLY:
        return (f"bfloat16 saves step {step} alone, not the steps that follow: the re-run of the saved window "
                f"in bfloat16 goes non-finite at step {window_check.failed_at}")
    if outcome is Bf16Outcome.DOES_NOT_AVOID:
        return "bfloat16 does not avoid the problem"
    action = "bfloat16 avoids the problem: autocast with dtype=torch.bfloat16, no GradScaler"
    if outcome is Bf16Outcome.AVOIDS_UNCONFIRMED:
        action += " (finite; its gradient accuracy is not confirmed)"
    return action


class NoFp16Config(enum.Enum):
    """Why mixed precision is advised against when no float16 configuration
    keeps the step finite (`avoid_mixed_precision`)."""
    INSTABILITY = "instability"   # the training is unstable: fix it first
    USE_BF16 = "use_bf16"         # bfloat16 avoids it
    FLOAT32 = "float32"           # nothing tried avoids it: train in float32


def no_fp16_config(*, unstable: bool, reference_finite: bool, data_problem: bool, fp16_ok: bool, bf16_ok: bool,
                   precision: str) -> NoFp16Config | None:
    """The decision of `avoid_mixed_precision`, None when it does not apply
    (the float64 run fails too, the data is the problem, or a float16
    configuration keeps the step finite)."""
    if not reference_finite or data_problem or fp16_ok:
        return None
    if unstable:
        return NoFp16Config.INSTABILITY
    if bf16_ok:
        return NoFp16Config.USE_BF16 if precision == "fp16" else None
    return NoFp16Config.FLOAT32


def _avoid_recommendation(kind: NoFp16Config, step, precision, baseline, fix, bf16, beyond) -> Recommendation:
    """The words of `avoid_mixed_precision` for the decided `kind`."""
    tried = [f"{precision} as recorded: {_state(baseline)}",
             f"no set of up to {len(fix.candidates) if fix else 0} candidate modules kept in float32 saves it",
             "no loss scale makes it finite"]
    if kind is NoFp16Config.INSTABILITY:
        action = ("float16 mixed precision is not advisable for this job as it trains now: no float16 configuration "
                  f"keeps step {step} finite; fix the instability first (above)")
        evidence = tried + ([beyond] if beyond else [])
    elif kind is NoFp16Config.USE_BF16:
        action = (f"float16 mixed precision is not advisable for this job: no float16 configuration keeps step {step} "
                  "finite; use bfloat16 instead (use_bf16 above)")
        evidence = tried + [f"bfloat16: {_state(bf16)}"]
    else:
        action = ("do not use mixed precision for this model as written: train it in float32 (or move the failing "
                  "code of the model's own forward into a submodule that keep_fp32 can wrap)")
        evidence = tried + [f"bfloat16: {_state(bf16) if bf16 else 'not tried'}"]
    return Recommendation(RecommendationKind.AVOID_MIXED_PRECISION, action, evidence, Source.REPLAY, verified=True)


def _saved_steps_lines(fix) -> list:
    """What the fix does to the run's other saved steps."""
    if len(fix.saved_steps_check) < 2:
        return []
    out = [f"tried on every saved step of the run: saves {', '.join(map(str, fix.saved_steps))}"
           + (f"; does NOT save {', '.join(map(str, fix.not_saved_steps))}" if fix.not_saved_steps else "")]
    out += [f"step {c.step}: {c.why}" for c in fix.saved_steps_check if not c.saved]
    return out


def bf16_verdict(trial, backward_start: BackwardStart = BackwardStart.SAVED) -> tuple[bool, bool, str | None]:
    """(avoids, gradients_confirmed, why) of a bfloat16 trial, judged like
    every other trial (`whatif.judge`: its `saved`), except that a verdict
    resting on the gradients (parameter gradients off float64, or a module
    broken in the backward) is not decisive when the backward started from
    a substitute output gradient (`BackwardStart.SUBSTITUTE_MEAN`: the
    saved one was NaN/Inf): a finite trial then avoids the problem, with its
    gradient accuracy unconfirmed."""
    from .whatif import NotSavedBy
    t = trial
    by, why = t.not_saved_by, t.why
    if by is NotSavedBy.NOTHING:
        return True, True, None
    if by is NotSavedBy.NONFINITE:
        return False, True, None  # the trial's state says where
    on_gradients = by is NotSavedBy.PARAMS_OFF or (t.culprit or {}).get("phase") == "backward"
    if on_gradients and backward_start is BackwardStart.SUBSTITUTE_MEAN:
        return True, False, (f"not decisive: {why}, measured from a substitute output gradient (the saved one "
                             "was NaN/Inf); replay with a loss_fn to confirm")
    return False, True, why


def _substitute(p) -> str:
    if getattr(p, "backward_start", BackwardStart.SAVED) is not BackwardStart.SUBSTITUTE_MEAN:
        return ""
    return " (measured from a substitute output gradient: indicative only)"


def _forward_step(summary) -> int | None:
    f = _forward_finding(summary)
    return f.step if f is not None else None


def _state(t) -> str:
    """A trial's state in a few words (`whatif.Trial`)."""
    if t.finite:
        return "finite" + (f" (at loss scale {t.loss_scale:g})" if t.backed_off else "")
    return f"non-finite in the {' and '.join(t.nonfinite_phases)} ({t.nonfinite_values} NaN/Inf values)"


def _pct(v) -> str:
    if v is None or v != v:
        return "-"
    return "inf" if v == float("inf") else f"{v:.1%}"
