"""The words of `recommend`: one function per recommendation, each making
its action, evidence, code and data from the typed outcomes `decisions.py`
decided (and the what-ifs' results they carry)."""
from __future__ import annotations

from ..analyses.updates import UpdateRemedy
from ..names import ROOT_DISPLAY, BackwardStart
from .decisions import (SCALE_FINDINGS, Bf16Outcome, Bf16Replay, CheckData, KeepFp32, NoFp16Config, RecordedScale,
                        ScaleAdvice)
from .recommendation import Recommendation, RecommendationKind, Source

DEFAULT_SCALE_K = 16  # GradScaler's default init_scale, 2^16


def instability_recommendation(unstable, source: Source, extra=(), verified: bool = False) -> Recommendation:
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


def recorded_check_data_recommendation(fwd) -> Recommendation:
    return Recommendation(
        RecommendationKind.CHECK_DATA,
        f"check the data of step {fwd.step}: the non-finite values came in with the batch",
        [f"step {fwd.step}: {fwd.message}"], Source.RECORDED, data={"step": fwd.step})


def check_weights_recommendation(step: int, names: list, evidence: list, source, *, verified: bool = False,
                                 modules: bool = True) -> Recommendation:
    """The weights `names` (modules', or parameters' when `modules` is
    False) were NaN/Inf before step `step` ran: no precision setting or
    loss scale makes that step finite."""
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    whose = f"the weights of {shown}" if modules else shown
    return Recommendation(
        RecommendationKind.CHECK_WEIGHTS,
        f"restore the weights from before step {step} and find what made {whose} NaN/Inf (an update from "
        f"non-finite gradients or optimizer state or one that overflowed them, a load, an in-place write): they "
        f"were already non-finite when the step ran, so no precision setting or loss scale saves it",
        evidence, source, data={"step": step, ("modules" if modules else "params"): list(names)}, verified=verified)


def recorded_keep_fp32_recommendation(fwd, path) -> Recommendation:
    return Recommendation(
        RecommendationKind.KEEP_FP32, f"candidate: keep {fwd.layer} in float32; confirm with "
                                      f"`amp-postmortem fix {path} --step {fwd.step} --model SPEC`",
        [f"step {fwd.step}: {fwd.message}"], Source.RECORDED,
        code=f"from recorders.fp32 import keep_fp32\nkeep_fp32(model.get_submodule({fwd.layer!r}))",
        data={"modules": [fwd.layer], "step": fwd.step})


def recorded_scale_recommendation(scale: RecordedScale, summary, fwd) -> Recommendation:
    """gradient_drift or scaler_settings, citing the scale findings."""
    cited = [f"{f.kind}: {f.message}" for f in summary.findings if f.kind in SCALE_FINDINGS]
    cited += _consequence(summary, fwd)
    if scale.advice is ScaleAdvice.DRIFT:
        return drift_recommendation(scale.drift, summary, cited, Source.RECORDED)
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


def _cause(sw) -> str | None:
    """The window's `EdgeCause` as its JSON value."""
    return sw.overflow_cause.value if sw.overflow_cause is not None else None


def add_grad_scaler_recommendation(finding, estimate, replayed, run) -> Recommendation:
    """add_grad_scaler: float16 gradients travelled unscaled. `replayed`: the
    saved step's replayed scale window (the default 2^16 judged there);
    else `estimate`: the recorded window, whose overflow edge alone is
    known (the underflow edge rests on flushed statistics)."""
    from ..whatif.scale_estimate import unverified_why
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


def drift_recommendation(drift, summary, cited, source: Source, extra=()) -> Recommendation:
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


def scaler_settings_recommendation(sw, step, kept, step_notes) -> Recommendation:
    from ..whatif.scale_window import kept_note
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


def avoid_recommendation(kind: NoFp16Config, step, precision, baseline, fix, bf16, beyond) -> Recommendation:
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


def substitute_caveat(p) -> str:
    if getattr(p, "backward_start", BackwardStart.SAVED) is not BackwardStart.SUBSTITUTE_MEAN:
        return ""
    return " (measured from a substitute output gradient: indicative only)"


def _state(t) -> str:
    """A trial's state in a few words (`whatif.Trial`)."""
    if t.finite:
        return "finite" + (f" (at loss scale {t.loss_scale:g})" if t.backed_off else "")
    return f"non-finite in the {' and '.join(t.nonfinite_phases)} ({t.nonfinite_values} NaN/Inf values)"


def _pct(v) -> str:
    if v is None or v != v:
        return "-"
    return "inf" if v == float("inf") else f"{v:.1%}"


_UPDATE_ACTIONS = {
    UpdateRemedy.FP32_MASTER_WEIGHTS: "keep float32 master weights: build the model in float32 (no model.to(torch.{dtype})) "
                           "and run its forward under torch.autocast(device_type, dtype=torch.{dtype})",
    UpdateRemedy.LARGER_LR: "a larger learning rate, so that the optimizer's updates reach half an ulp of the "
                            "{dtype} weights",
    UpdateRemedy.STOCHASTIC_ROUNDING: "where the weights must stay {dtype}, round the optimizer's updates stochastically "
                           "(or keep a compensation buffer: Kahan summation)",
}


def lost_updates_recommendations(finding, checks) -> list:
    """fp32_master_weights, larger_learning_rate, stochastic_rounding: the
    remedies of a `lost_updates` finding, each verified by the re-run of
    the saved window with it (`checks`, `update_remedies.RemedyChecks`) or
    said why not."""
    from ..analyses.update_remedies import check_line
    ev = finding.evidence
    dtype = ev.get("param_dtype") or "bfloat16"
    cited = (f"lost_updates: {ev['recent_lost_share']:.0%} of the optimizer's updates leave the {dtype} weights "
             f"unchanged (measured from step {ev['recent_from_step']})")
    out = []
    for check in checks.checks:
        trial = check.trial
        line = check_line(check, checks)
        code = None
        if check.remedy is UpdateRemedy.FP32_MASTER_WEIGHTS:
            code = (f"model = make_model()  # float32 parameters: no model.to(torch.{dtype})\n"
                    f"with torch.autocast(device_type, dtype=torch.{dtype}):\n"
                    "    loss = compute_loss(model, batch)")
        elif check.remedy is UpdateRemedy.LARGER_LR and trial is not None:
            code = f"for group in optimizer.param_groups:\n    group[\"lr\"] *= {trial.lr_scale:g}"
        out.append(Recommendation(
            RecommendationKind(check.remedy.value), _UPDATE_ACTIONS[check.remedy].format(dtype=dtype),
            [cited] + ([line] if check.verified else []), Source.REPLAY if trial is not None else Source.RECORDED,
            code=code, data={"verification": check.to_dict(), "window": checks.window,
                             "as_recorded": None if checks.as_recorded is None else checks.as_recorded.to_dict(),
                             "lr_scale": None if trial is None else trial.lr_scale},
            verified=check.verified, why=None if check.verified else line))
    return out
