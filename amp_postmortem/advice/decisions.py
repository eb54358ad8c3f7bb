"""The decisions of `recommend`, on typed outcomes, before any words are
made (`words.py`): from the recorded statistics (`RecordedOrigin`,
`RecordedScale`, the window's drift) and from the what-if replays of a
saved step (`CheckData`, `Instability`, `KeepFp32`, `Bf16Replay`,
`ScaleAdvice`, `Bf16Outcome`, `NoFp16Config`)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from recorders.format import schema

from ..analyses.nans import OriginBasis
from ..reading.loader import Run
from ..names import BackwardStart

SCALE_FINDINGS = {"scale_collapse", "stuck_low_scale", "grad_underflow", "unscaled_fp16_backward"}
DRIFT_BITS = 4        # the window "moves" when its overflow edge shifts by more than this
DRIFT_SAMPLES = 12    # steps at which the window is estimated for that


def forward_finding(summary):
    """The `nonfinite` finding of a forward origin, if any."""
    for f in summary.findings:
        origin = f.evidence.get("origin") if f.kind == "nonfinite" else None
        if origin and origin.get("phase") == "forward":
            return f
    return None


def forward_step(summary) -> int | None:
    f = forward_finding(summary)
    return f.step if f is not None else None


def unscaled_finding(summary):
    """The `unscaled_fp16_backward` finding, if any."""
    return next((f for f in summary.findings if f.kind == "unscaled_fp16_backward"), None)


class RecordedOrigin(enum.Enum):
    """Where the recorded forward overflow was born, as the advice reads it."""
    INPUT = "input"                # the batch (`<input>`): check_data
    WEIGHTS = "weights"            # a layer on weights already NaN/Inf (`OriginBasis.WEIGHTS`): check_weights
    MODULE = "module"              # a module: a keep_fp32 candidate
    OTHER = "other"                # no module (the loss, the root): nothing to keep in float32


def recorded_origin(fwd) -> RecordedOrigin | None:
    """None without a forward origin."""
    if fwd is None:
        return None
    if (fwd.evidence.get("origin") or {}).get("basis") == OriginBasis.WEIGHTS.value:
        return RecordedOrigin.WEIGHTS
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
    if not summary.kinds() & SCALE_FINDINGS:
        return None
    from ..whatif.scale_window import estimate_scale_window
    before = fwd.step if fwd is not None else None
    drift = window_drift(run, before)
    if drift["moves"]:
        return RecordedScale(ScaleAdvice.DRIFT, drift, None, before)
    est = estimate_scale_window(run, before=before)
    return RecordedScale(ScaleAdvice.SETTINGS if est.window else ScaleAdvice.NO_WINDOW, drift, est, before)


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

    from ..whatif.scale_window import estimate_scale_window
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


@dataclass(frozen=True)
class CheckData:
    """check_data decided from the replays: the float64 run of the step is
    non-finite too, and/or `bisect` found the data to blame."""
    step: int
    reference_finite: bool
    bisect: object                 # whatif.bisect.BisectReport

    @property
    def by_samples(self) -> bool:
        from ..whatif.bisect import BisectKind
        return self.bisect.kind is BisectKind.DATA


def decide_check_data(step: int, reference_finite: bool, bisect) -> CheckData | None:
    """check_data when no precision setting is the fix: float64 fails too,
    or a few samples of the batch fail alone with suspicious inputs."""
    from ..whatif.bisect import BisectKind
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


def decide_instability(run, p, step, *, model, device, policy, loss_fn, loss=None) -> Instability:
    from ..analyses.instability import LOSS_RISE, failure_step, find_instability, replay_evidence
    from ..analyses.precision_verdict import Verdict
    from ..whatif.verdict import decide
    unstable = find_instability(run)
    beyond = replay_evidence(run, p.reference, step) if p.reference_finite else None
    rose = bool(unstable.loss_rise) and unstable.loss_rise["ratio"] >= LOSS_RISE
    # The float64 replay beyond float16's range is instability only with a
    # rising loss: a model whose exact values exceed 65504 while it trains
    # well (attention logits) is float16's problem, which keep_fp32 solves.
    is_unstable = unstable.unstable or (beyond is not None and rose)
    # Decided by a float32 re-run of the saved window when there is one
    # (`whatif/verdict.py`): the recorded evidence only suggests it.
    verdict = decide(run, failure_step(run), model=model, rank=p.rank, device=device, policy=policy, loss_fn=loss_fn,
                     loss=loss, command="recommend")
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
        return bf16_outcome(self.avoids, self.confirmed, self.window_check)


def decide_bf16(trial, p, step, *, model, device, policy, loss_fn, loss=None) -> Bf16Replay:
    avoids, confirmed, why = bf16_verdict(trial, p.backward_start)
    check = None
    if avoids and model is not None:
        from ..whatif.window_check import check_over_window, run_of_bundle
        check = check_over_window(run_of_bundle(p.bundle), step, "bfloat16 autocast and no GradScaler",
                                  model=model, rank=p.rank, precision="bf16", device=device, policy=policy,
                                  loss_fn=loss_fn, use_scaler=False, loss=loss, command="recommend")
    return Bf16Replay(trial, avoids, confirmed, why, check)


def bf16_verdict(trial, backward_start: BackwardStart = BackwardStart.SAVED) -> tuple[bool, bool, str | None]:
    """(avoids, gradients_confirmed, why) of a bfloat16 trial, judged like
    every other trial (`whatif.judge`: its `saved`), except that a verdict
    resting on the gradients (parameter gradients off float64, or a module
    broken in the backward) is not decisive when the backward started from
    a substitute output gradient (`BackwardStart.SUBSTITUTE_MEAN`: the
    saved one was NaN/Inf): a finite trial then avoids the problem, with its
    gradient accuracy unconfirmed."""
    from ..whatif import NotSavedBy
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


class ScaleAdvice(enum.Enum):
    """What the loss-scale window advises (replayed: `decide_scale_advice`;
    estimated from the recorded statistics: `decide_recorded_scale`)."""
    DRIFT = "drift"                # the recorded window moves: no fixed setting (gradient_drift)
    SETTINGS = "settings"          # GradScaler settings inside the window (scaler_settings)
    NO_WINDOW = "no_window"        # recorded only: no loss scale fits the recorded gradients (scaler_settings)


def decide_scale_advice(sw, drift_moves: bool, scale_findings: bool, kept) -> ScaleAdvice | None:
    """None when there is no window, or the recorded scale sits inside it
    with nothing that asks about the scale."""
    from ..whatif.scale_result import ScalePosition
    if not sw.window:
        return None
    if drift_moves:
        return ScaleAdvice.DRIFT
    if sw.recorded_position is not ScalePosition.INSIDE or scale_findings or kept:
        return ScaleAdvice.SETTINGS
    return None


class Bf16Outcome(enum.Enum):
    """What the bfloat16 replay of the step (and its window) shows."""
    AVOIDS = "avoids"                      # saved, gradients confirmed
    AVOIDS_UNCONFIRMED = "avoids_unconfirmed"  # finite; its gradients measured from a substitute
    DOES_NOT_AVOID = "does_not_avoid"
    STEP_ONLY = "step_only"                # saves the step, the window re-run in bfloat16 fails


def bf16_outcome(avoids: bool, confirmed: bool, window_check) -> Bf16Outcome:
    from ..whatif.window_check import WindowStatus
    if window_check is not None and window_check.status is WindowStatus.FAILS:
        return Bf16Outcome.STEP_ONLY
    if not avoids:
        return Bf16Outcome.DOES_NOT_AVOID
    return Bf16Outcome.AVOIDS if confirmed else Bf16Outcome.AVOIDS_UNCONFIRMED


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
