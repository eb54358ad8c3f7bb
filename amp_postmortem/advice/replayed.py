"""`recommend` from the what-if replays of one saved step (`fix`, `bisect`,
the bfloat16 replay, `scale-window`, the float32 re-run of the saved
window), each remedy also tried on the run's other saved steps (the
package's doc says which recommendation comes when)."""
from __future__ import annotations

from ..analyses.bundle_choice import pick_bundle
from ..reading.loader import Run
from .decisions import (SCALE_FINDINGS, KeepFp32, ScaleAdvice, decide_bf16, decide_check_data, decide_instability,
                        decide_scale_advice, forward_step, no_fp16_config, unscaled_finding, window_drift)
from .recommendation import Recommendation, RecommendationKind, Source
from .words import (add_grad_scaler_recommendation, avoid_recommendation, bf16_recommendation,
                    check_data_recommendation, check_weights_recommendation, drift_recommendation, fix_lines,
                    instability_recommendation, keep_fp32_recommendation, no_change_recommendation, scaler_settings_recommendation,
                    substitute_caveat)

COMMAND = "recommend"  # the command the window checks are made for (named where they say how to add --loss)


def bundle_to_replay(run: Run, step, rank, notes) -> tuple[int, int | None] | None:
    """(step, rank) of the bundle to replay: `step` as given, else
    `pick_bundle`'s, said in `notes`; None when the run saved none."""
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


def replayed_recommendations(run, step, rank, model, device, policy, loss_fn, progress, notes, summary,
                             loss=None) -> list:
    """The replayed recommendations: each remedy decided on typed outcomes
    (`decide_*`), its words made by the `*_recommendation` functions.
    `loss`: the loop's loss for the re-runs of the saved window (as for
    `rerun`)."""
    from ..replaying import resolve_policy
    from ..whatif import prepare
    from ..whatif.bisect import bisect_samples, slicing_note
    from ..whatif.fix import find_fix
    from ..whatif.scale_result import recorded_loss_dtype
    from ..whatif.scale_window import replay_scale_window

    p = prepare(run.path, step, rank=rank, model=model, device=device, policy=policy, loss_fn=loss_fn,
                keep_inputs=True)
    notes.extend(p.notes)
    bad = p.bundle.nonfinite_params()
    if bad:
        # Every replay of the step runs on them: none can decide a remedy.
        return [check_weights_recommendation(
            step, bad, [f"the bundle of step {step} holds NaN/Inf in {len(bad)} of its "
                        f"{len(p.bundle.meta['params']['names'])} weights as the step's forward used them"
                        + ("" if p.bundle.exact else " (not exact: as held when the step was saved)")],
            Source.REPLAY, verified=True, modules=False)]
    recs = []
    baseline = p.trial()
    fix = find_fix(None, prepared=p, progress=progress, model=model, device=device, policy=policy,
                   loss_fn=loss_fn, loss=loss, command=COMMAND) if p.reference_finite else None
    check_data = None
    if not baseline.saved:
        b = bisect_samples(None, prepared=p, progress=progress)
        note = slicing_note(b.slicing)
        if note:
            notes.append(note)
        check_data = decide_check_data(step, p.reference_finite, b)
        if check_data is not None:
            recs.append(check_data_recommendation(check_data))
    instability = decide_instability(run, p, step, model=model, device=device, policy=policy, loss_fn=loss_fn,
                                     loss=loss)
    window_checks = {}  # RecommendationKind -> the WindowCheck its `verified` is decided on
    keep = None
    if fix is not None and fix.fix:
        keep = KeepFp32(step, p.precision, fix, _modules_window_check(p, fix, model, device, policy, loss_fn, loss),
                        substitute_caveat(p))
        window_checks[RecommendationKind.KEEP_FP32] = keep.window_check
        if not instability.unstable:
            recs.append(keep_fp32_recommendation(keep))
    if instability.unstable:
        recs.append(instability_recommendation(
            instability.report, Source.REPLAY, extra=[instability.verdict.sentence()]
            + ([instability.beyond] if instability.beyond else []) + fix_lines(keep, fix, step, baseline.saved),
            verified=instability.decided))
    scale_findings = bool(summary.kinds() & SCALE_FINDINGS)
    bf16 = None
    if p.precision == "fp16" and (not baseline.saved or scale_findings):
        bf16 = decide_bf16(p.trial(backoff=False, precision="bf16", loss_scale=1.0,
                                   policy=resolve_policy(policy, p.bundle, "bf16")), p, step, model=model,
                           device=device, policy=policy, loss_fn=loss_fn, loss=loss)
        window_checks[RecommendationKind.USE_BF16] = bf16.window_check
        recs.append(bf16_recommendation(bf16, step, substitute_caveat(p)))
    kept = tuple(fix.fix) if fix is not None and fix.fix else ()
    window = None
    if p.precision == "fp16" and p.reference_finite:
        sw = replay_scale_window(None, prepared=p, fp32_modules=kept, progress=progress, verify=True, model=model,
                                 device=device, policy=policy, loss_fn=loss_fn,
                                 loss_dtype=recorded_loss_dtype(run, step)[0], loss=loss, command=COMMAND)
        window = sw.window
        drift = window_drift(run, forward_step(summary)) if scale_findings else {"moves": False}
        advice = decide_scale_advice(sw, drift["moves"], scale_findings, kept)
        unscaled = unscaled_finding(summary)
        if unscaled is not None:
            # A scale the run never applied, judged by replaying the saved step with it.
            window_checks[RecommendationKind.ADD_GRAD_SCALER] = sw.window_check
            recs.append(add_grad_scaler_recommendation(unscaled, None, sw, run))
        elif advice is ScaleAdvice.DRIFT:
            recs.append(drift_recommendation(
                drift, summary, [f"{f.kind}: {f.message}" for f in summary.findings if f.kind in SCALE_FINDINGS],
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
        recs.append(avoid_recommendation(avoid, step, p.precision, baseline, fix, bf16.trial if bf16 else None,
                                          instability.beyond))
    for r in recs:
        _settle_verified(r, window_checks.get(r.kind))
    if not recs:
        recs.append(no_change_recommendation(step, p, baseline, window, summary))
    return recs


def _settle_verified(r: Recommendation, check) -> None:
    """A replayed recommendation is verified by the replays of the saved
    steps unless the re-run of the saved window with it fails."""
    from ..whatif.window_check import WindowStatus
    if check is not None and check.status is WindowStatus.FAILS:
        r.verified = False  # it saves the saved step, not the window's steps after it
        r.why = f"the re-run of the saved window with it goes non-finite at step {check.failed_at}"
    elif r.source is Source.REPLAY and r.kind is not RecommendationKind.TRAINING_INSTABILITY:
        r.verified = True  # each rests on replays of the saved steps
    elif r.kind is RecommendationKind.GRADIENT_DRIFT:
        r.why = "the window's drift is estimated from the recorded statistics of steps spread over the run"


def _modules_window_check(p, fix, model, device, policy, loss_fn, loss=None):
    """The module-level fix re-run over the saved window (`fix` checks its
    cheapest remedy, which may be a line); None without a model."""
    if model is None:
        return None
    from ..whatif.fix import RemedyKind, check_remedy
    if fix.window_check is not None and fix.remedies and fix.remedies[0].kind is RemedyKind.MODULES:
        return fix.window_check
    remedy = next((r for r in fix.remedies if r.kind is RemedyKind.MODULES), None)
    if remedy is None:
        return None
    return check_remedy(p, remedy, model=model, device=device, policy=policy, loss_fn=loss_fn, loss=loss,
                        command=COMMAND)
