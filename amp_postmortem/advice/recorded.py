"""`recommend` from the recorded run alone: `summary`'s findings and the
loss-scale window estimated from the recorded statistics (the package's
doc says which recommendation comes when)."""
from __future__ import annotations

from ..reading.loader import Run
from .decisions import (RecordedOrigin, decide_recorded_scale, forward_finding, recorded_origin,
                        unscaled_finding)
from .recommendation import Recommendation, RecommendationKind, Source
from .words import (add_grad_scaler_recommendation, check_weights_recommendation, instability_recommendation,
                    recorded_check_data_recommendation, recorded_keep_fp32_recommendation,
                    recorded_scale_recommendation)


def recorded_recommendations(run: Run, summary) -> list:
    """The recommendations of the recorded statistics, each that a replay
    would check marked with what would (`why`)."""
    from ..whatif.scale_estimate import unverified_why
    recs = _recorded_advice(run, summary)
    checks = {RecommendationKind.KEEP_FP32: "replay the saved steps with the module in float32 (`fix`)",
              RecommendationKind.SCALER_SETTINGS: "replay the saved steps at the window's edges",
              RecommendationKind.GRADIENT_DRIFT: "replay the saved steps at the window's edges (the drift is "
                                                 "estimated from steps spread over the run)"}
    for r in recs:
        if r.kind in checks:
            r.why = unverified_why(run, checks[r.kind])
    return recs


def _recorded_advice(run: Run, summary) -> list:
    """The recorded recommendations: each decided on typed outcomes
    (`recorded_origin`, `decide_recorded_scale`), its words made by the
    `recorded_*_recommendation` functions."""
    fwd = forward_finding(summary)
    origin = recorded_origin(fwd)
    if "training_instability" in summary.kinds() and origin is not RecordedOrigin.INPUT:
        from ..analyses.instability import find_instability
        return [instability_recommendation(find_instability(run), Source.RECORDED)]
    if origin is RecordedOrigin.WEIGHTS:
        # The layer ran on weights already NaN/Inf: keeping it in float32
        # or another loss scale leaves them so; the scale's skips from
        # then on are their consequence. The one recommendation.
        return [check_weights_recommendation(fwd.step, [fwd.layer], [f"step {fwd.step}: {fwd.message}"],
                                             Source.RECORDED)]
    recs = []
    if origin is RecordedOrigin.INPUT:
        recs.append(recorded_check_data_recommendation(fwd))
    elif origin is RecordedOrigin.MODULE:
        recs.append(recorded_keep_fp32_recommendation(fwd, run.path))
    unscaled = unscaled_finding(summary)
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
