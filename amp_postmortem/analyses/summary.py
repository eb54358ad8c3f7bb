"""The one screen a user reads first: run facts and findings by severity.

Findings (kind, severity):
- `nonfinite` (critical): a forward pass turned non-finite (the loss
  becomes NaN/Inf from there), or non-finite gradients reached a step the
  optimizer applied. Non-finite gradients in steps the scaler skipped are how
  a loss scaler calibrates; they are covered by the scale findings.
- `training_instability` (critical): the values ran away before float16
  failed (`instability`: the loss rose and
  activations or weights grew). Claimed (`evidence.verdict`
  "training_instability") only when a float32 re-run of a saved window
  diverges too (`precision_verdict`, given a model: `apply_verdict`);
  otherwise suspected (`evidence.verdict` "undetermined", the message says
  what would decide it). A float32 re-run that stays finite removes it.
- `scale_collapse` (critical): the loss scale is collapsing (`scale`).
- `stuck_low_scale` (error): the scale is pinned low, or never grows
  (`stuck_low`, `growth_blocked`).
- `loss_scaling_mistake` (error, Keras runs): a train step that misuses
  its LossScaleOptimizer: the loss never scaled, the gradients unscaled
  twice, or the scaled loss's gradients applied by the inner optimizer
  (`loss_scaling`): the mistake, its evidence and the exact fix.
- `fp16_reduction_overflow` (error, Flax runs): a module's float16 output
  overflowed where it sums many finite values that float32 would hold (a
  sum pooling, a softmax's normaliser; `fp16_reductions`): the module, its
  first step and the remedy (compute in float32, cast back); with the
  program's site of that module's class (below) when the run has one.
- `fp16_reduction_risk` (warning, JAX runs): a softmax, log_softmax,
  logsumexp or sum the step's program computes on float16/bfloat16 values
  (`fp16_reductions`' sites, read from the jaxpr by the recorder): each
  site's pattern, dtype, values per output, source line and the remedy
  (`jax.nn.softmax(x.astype(jnp.float32)).astype(x.dtype)`); a risk, "not
  observed to overflow". A JAX run whose program was not read says so in
  its facts (`jax_reductions`: `not_traced`, `failed`): undetermined.
- `grad_underflow` (warning): gradients sit in the float16 subnormal range
  or are flushed to zero now (`ranges`, `underflow` flag: the recent
  full-tier steps; structural zeros, zero at any scale, not counted); its
  step is the latest step measured.
- `unscaled_fp16_backward` (error): float16 gradients travelled with no
  loss scale (no GradScaler, a disabled one, a scale of 1) and underflow:
  the cause of what `grad_underflow` would report, which it replaces;
  names the layers that lose the most signal (`unscaled.find_unscaled`)
  and gives the GradScaler lines.
- `zero_gradients` (warning): the float16 gradient reaching some layers was
  zero in every value measured, with no underflow share to read (`ranges`:
  `zeros` undetermined, absmax 0): flushed whole by underflow, or zero in
  any precision; undetermined from the rows, and no update reaches their
  parameters through it either way. Said, not "healthy": a float16
  backward whose loss scale is absent or too small can flush a whole
  gradient, which no share or headroom shows.
- `grad_subnormal` (info): the underflowing gradients are subnormal, not
  flushed (`unscaled.only_subnormal`): values kept with fewer bits; said,
  never warned of.
- `underflow_lapsed` (info): gradients underflowed earlier (`ranges`,
  `underflow_lapsed` flag: during steps a-b) but the recent evidence says
  no more, or nothing recent was measured; dated by the last step it was
  seen, and no warning.
- `overflow_risk` (warning): activations close to or heading for 65504.
- `lost_updates` (warning): the optimizer's updates leave bfloat16/float16
  weights unchanged (`updates.lost_updates`), with the cause and the
  remedies, each with its check (`update_remedies`): not verified here; a
  re-run of the saved window with each, given a model
  (`apply_update_checks`, `whatif/update_trials.py`).
- `reexecution_differs` (warning): a step the sentinel re-executed did not
  reproduce what it recorded (`reexecution`): its rows are not those of
  the step as it ran, so what they show is no evidence of it; the events,
  the recorded and re-executed counts, and how to see the step as it ran.
- `recording_disabled` (error): the recorder stopped part-way (a full disk,
  an internal error) and said so in its status slot or manifest.
- `recording_not_closed` (warning): a recorder ended without closing and
  left no stop record (killed, or still running): later steps may be absent.
- `healthy` (info): none of the above but infos.
"""
from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field, replace

import pandas as pd

from ..errors import BundleError
from ..names import FINDING_KINDS
from ..names import display_name as _display
from ..reading.window import window_spans
from .bundle_choice import choose_bundle, saved_bundles
from ..reading.loader import Run
from .fail_on import SEVERITIES, fail_rule
from .dtype_policies import PolicyProblem, dtype_policy_problems
from .fp16_reductions import Program, find_fp16_reductions
from .loss_scaling import AppliedBy, Basis, ScalingMistake, loss_scaling_mistake
from .instability import find_instability
from .precision_verdict import Verdict, undetermined
from .nans import OriginBasis, applied_nonfinite_steps, basis_words, find_nans, no_rerun_words
from .reexecution import reexecution_mismatches
from .ranges import DTYPE_LIMITS, WINDOW, lapsed_words, layer_ranges, recent_words, sampled_values
from .scale import ScaleStatus, scale_dynamics, underflow_phrase
from .update_remedies import Verification, check_line, unchecked
from .updates import UpdateRemedy, lost_updates, param_dtype, param_dtypes
from .underflow import Zeros
from .unscaled import ScaleAbsence, ZerosBasis, find_unscaled, layer_losses, only_subnormal, zeros_basis
from ..display import report_html, report_repr
from ..op_words import run_op_origin_line
from ..result import CommandResult



@dataclass
class Finding:
    kind: str
    severity: str
    step: int | None
    layer: str | None
    message: str
    next_command: str
    evidence: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "severity": self.severity, "step": self.step, "layer": self.layer,
                "message": self.message, "next_command": self.next_command, "evidence": self.evidence}

    def lines(self) -> list[str]:
        """The finding as `summary` (and `watch`) print it; no layer shown
        where it has none (a healthy run, a recorder that stopped)."""
        where = f"step {'-' if self.step is None else self.step}" + (
            "" if self.layer is None else f"  layer {_display(self.layer)}")
        return [f"  {self.severity.upper():<8}  {self.kind}  {where}",
                f"            {self.message}",
                f"            next: {self.next_command}"]


@dataclass
class Summary(CommandResult):
    run: dict
    findings: list[Finding]
    # With a model: the op origin of a replayed bundle (`replaying.run_origin`;
    # the API adds it, this analysis never replays). None without one.
    op_origin: dict | None = None
    # Precision or instability (`precision_verdict.PrecisionVerdict`) of a
    # failed run: undetermined here; decided by the API given a model.
    precision_verdict: object = None
    # What the run saved for replays: bundles (`bundle_choice.SavedBundle`)
    # and windows of steps (`window.window_spans`), and the bundle a
    # `replay` without --step takes (`bundle_choice.BundleChoice`, or None).
    bundles: list = field(default_factory=list)
    windows: list = field(default_factory=list)
    bundle_choice: object = None
    replay_command: str | None = None  # the exact `replay` command of that bundle
    show_table = False  # the readable view lists the findings in `lines()`

    def kinds(self) -> set[str]:
        return {f.kind for f in self.findings}

    def failing(self, fail_on) -> list[Finding]:
        """The findings that `--fail-on` fails on (`fail_rule`)."""
        fails = fail_rule(fail_on)
        return [f for f in self.findings if fails(f)]

    def _suggests_replay(self) -> bool:
        """A replay is the next step when something is wrong (an info is no
        ailment) and no finding already points to it."""
        return (self.replay_command is not None and any(f.severity != "info" for f in self.findings)
                and self.replay_command not in (f.next_command for f in self.findings))

    def document(self) -> dict:
        return {"run": self.run, "findings": [f.to_dict() for f in self.findings], "op_origin": self.op_origin,
                "precision_verdict": None if self.precision_verdict is None else self.precision_verdict.to_dict(),
                "bundles": [b.to_dict() for b in self.bundles],
                "windows": [{k: w[k] for k in ("first_step", "last_step", "trigger_step", "rank")}
                            for w in self.windows],
                "bundle_choice": None if self.bundle_choice is None else self.bundle_choice.to_dict(),
                "replay_command": self.replay_command}

    # Readable at the prompt and in Jupyter (display.py).
    __repr__ = report_repr
    _repr_html_ = report_html

    def table(self) -> pd.DataFrame:
        return pd.DataFrame([{"severity": f.severity, "kind": f.kind, "step": f.step,
                              "layer": _display(f.layer), "message": f.message,
                              "next": f.next_command} for f in self.findings],
                            columns=["severity", "kind", "step", "layer", "message", "next"])

    def lines(self) -> list[str]:
        r = self.run
        steps = (f"{r['steps']} steps ({r['first_step']}-{r['last_step']})" if r["steps"] else "no steps")
        return [
            f"run {r['run_id']}  ({r['path']})",
            f"{steps}, ranks {r['ranks']} of world_size {r['world_size']}, recorder {r['status']}",
            f"{r['model_class']} on {r['device_type']} ({r['device_name']}), autocast "
            f"{autocast_words(r.get('autocast'))}{param_words(r.get('param_dtype'))}; "
            f"scaler: {scaler_words(r.get('scaler'))}",
            f"skipped steps {r['skipped_steps']}, non-finite loss steps {r['nonfinite_loss_steps']}",
            _loss_line(r),
        ] + _program_lines(r) + [
            "",
            "findings (most severe first):",
        ] + [line for f in self.findings for line in f.lines()] + (
            [] if self.op_origin is None else ["", run_op_origin_line(self.op_origin)]) + (
            [] if self.precision_verdict is None else ["", self.precision_verdict.sentence()]) + [
            "", saved_words(self.bundles, self.windows)] + (
            [f"next: {self.replay_command}"] if self._suggests_replay() else []) + [
            "",
            # The pictures of the same run (`report`, `export`: the report extra).
            f"plots: amp-postmortem report {shlex.quote(str(r['path']))}",
            f"       amp-postmortem export tensorboard {shlex.quote(str(r['path']))} --logdir DIR"]


def autocast_words(autocast: dict | None) -> str:
    """The recorded autocast as `summary` and the report say it: `float16` or `off`."""
    ac = autocast or {}
    return str(ac.get("dtype")) if ac.get("enabled") else "off"


def param_words(dtype: str | None) -> str:
    """The parameters' dtype beside autocast's, where it is not float32 (a
    model cast to bfloat16 runs without autocast, in bfloat16 all the same)."""
    return "" if dtype in (None, "float32") else f", parameters {dtype}"


def scaler_words(scaler: dict | None) -> str:
    """The recorded loss scaler's settings in words (`none` without one)."""
    sc = scaler
    if not sc:
        return "none"
    settings = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
    if all(sc.get(k) is None for k in settings):
        return "settings not recorded"

    # A manifest may miss a field (a scaler-like object without it): "?", never a crash.
    def num(key) -> str:
        v = sc.get(key)
        if v is None:
            return "?"
        # An interval is a count of steps: 1000000, never 1e+06.
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else f"{v:g}"
    return (f"init {num('init_scale')}, growth x{num('growth_factor')} every "
            f"{num('growth_interval')} clean steps, backoff x{num('backoff_factor')}")


def summarize(run: Run, *, window: int | None = None, model_spec: str | None = None,
              replayed_zeros=None) -> Summary:
    """Run facts and the findings of `nans`, `scale` and `ranges`, most severe first,
    and what the run saved for replays. `model_spec`: the `--model` the
    replay commands it suggests name (default: the placeholder `SPEC`).
    `replayed_zeros`: a saved step's gradient zeros replayed
    (`unscaled.ReplayedZeros`, `whatif/flush.py`; the API passes it given a
    model when the recorded rows cannot tell flushed from structural).

    Each `_*_finding` decides on the analyses' typed results whether its
    finding applies; the words of every finding are made in one place
    below (`# words`)."""
    return summary_parts(run, window=window, model_spec=model_spec).summary(replayed_zeros)


@dataclass
class SummaryParts:
    """What `summarize` reads of a run, once: the API builds the summary
    from it again with a replay's zeros (`summary(replayed_zeros)`) without
    reading the run's other analyses a second time."""
    run: Run
    ranges: object
    target: str
    model_spec: str | None
    nans: object
    scale: object
    per_step: pd.DataFrame
    skipped: set
    verdict: object
    reductions: object
    before: list      # the findings before the underflow ones, as `summarize` orders them
    after: list       # the findings after them
    saved: tuple      # (bundles, windows, choice)

    def summary(self, replayed_zeros=None) -> Summary:
        run, target, model_spec = self.run, self.target, self.model_spec
        found = [*self.before, *_underflow_findings(run, self.ranges, target, replayed_zeros), *self.after]
        findings: list[Finding] = [f for f in found if f is not None]
        bundles, windows, choice = self.saved
        replay = replay_command(target, choice, model_spec)
        findings = [_with_replay(f, bundles, target, model_spec) for f in findings]
        if all(f.severity == "info" for f in findings):  # a lapsed underflow is no ailment
            findings.append(Finding("healthy", "info", run.last_step, None, _healthy_words(self.scale),
                                    f"amp-postmortem ranges {target}", {"scale_status": self.scale.status.value}))

        # Most severe first; among equals the cause before its consequences
        # (a NaN forward before the backoffs it triggers), then by step.
        findings.sort(key=_finding_order)
        facts = _facts(run, self.nans, self.scale, self.skipped)
        facts.update(_program_facts(self.reductions))
        failure = next((f for f in findings if f.severity == "critical" and f.step is not None), None)
        facts.update(_losses(self.per_step, failure.step if failure else None))
        return Summary(run=facts, findings=findings, precision_verdict=self.verdict, bundles=bundles,
                       windows=windows, bundle_choice=choice, replay_command=replay)


def summary_parts(run: Run, *, window: int | None = None, model_spec: str | None = None) -> SummaryParts:
    """The analyses `summarize` reads, every finding but the underflow ones
    (which a replay's zeros may decide: `SummaryParts.summary`)."""
    nans = find_nans(run)
    scale = scale_dynamics(run)
    ranges = layer_ranges(run, window=WINDOW if window is None else window)
    target = shlex.quote(str(run.path))
    per_step = run.step_series().steps  # never the whole steps table: millions of rows at 1,000 ranks
    skipped = set(per_step.loc[per_step["skipped_any"], "step"].astype(int))
    unstable = find_instability(run)
    verdict = undetermined(run, unstable.failure_step) if unstable.failure_step is not None else None
    disabled = _disabled_ranks(run)
    reductions = find_fp16_reductions(run)
    before = [_nonfinite_finding(nans, applied_nonfinite_steps(run), target),
              instability_finding(unstable, verdict, target) if unstable.unstable else None,
              _scale_finding(scale, target)]
    after = [_overflow_risk_finding(run, ranges, target),
             _dtype_policy_finding(run),
             _loss_scaling_finding(run),
             *_fp16_reduction_findings(reductions),
             _lost_updates_finding(run, target),
             _zero_gradients_finding(run, ranges, target),
             _reexecution_finding(run),
             _disabled_finding(run, disabled),
             _not_closed_finding(run, disabled)]
    return SummaryParts(run, ranges, target, model_spec, nans, scale, per_step, skipped, verdict, reductions,
                        before, after, _saved(run))


def _nonfinite_finding(nans, applied_bad: list, target: str) -> Finding | None:
    """A forward that turned non-finite, else non-finite gradients the
    optimizer applied; a non-finite loss on a step that recorded no row
    (before any recorded NaN/Inf) leads, with its layer undetermined."""
    fwd = nans.origins.get("forward")
    if (fwd is not None and fwd.basis is OriginBasis.NOT_REPRODUCED and nans.later_origins.get("forward") is None
            and not nans.nonfinite_loss_steps):
        # A NaN/Inf only the re-execution made, the step's recorded facts
        # finite: `reexecution_differs` says so; no failure of the training.
        fwd = None
    if nans.unrecorded_loss_steps:
        first = nans.unrecorded_loss_steps[0]
        return Finding("nonfinite", "critical", first, None, _unrecorded_words(first, fwd, nans),
                       f"amp-postmortem nans {target}",
                       {"origin": None, "unrecorded_loss_steps": len(nans.unrecorded_loss_steps),
                        "nonfinite_loss_steps": len(nans.nonfinite_loss_steps),
                        "not_reexecuted": nans.unrecorded_why,
                        "first_recorded_origin": fwd.to_dict() if fwd else None})
    if fwd is not None and applied_bad and applied_bad[0] < fwd.step:
        # The update came first: the forward's NaN/Inf is what it left in
        # the weights (`OriginBasis.WEIGHTS`), or followed it.
        return _applied_finding(nans, applied_bad, target, fwd)
    if fwd is not None:
        # The finding's layer: the origin when its step decides it, else
        # the later step's that does, else none (undetermined).
        later = nans.later_origins.get("forward")
        layer = (later.name if later else None) if fwd.undetermined else fwd.name
        return Finding("nonfinite", "critical", fwd.step, layer, _forward_nonfinite_words(fwd, nans),
                       f"amp-postmortem nans {target}",
                       {"origin": fwd.to_dict(), "nonfinite_loss_steps": len(nans.nonfinite_loss_steps),
                        "propagated_layers": int((~nans.layers["origin"]).sum()),
                        "later_origin": later.to_dict() if later else None})
    if not applied_bad:
        return None
    return _applied_finding(nans, applied_bad, target, None)


def _applied_finding(nans, applied_bad: list, target: str, fwd) -> Finding:
    """Non-finite gradients the optimizer applied, first at `applied_bad[0]`
    (born in the backward origin of that step, where one is certain), and
    `fwd`, the forward origin of a later step, or None."""
    bwd = nans.origins.get("backward")
    where = bwd if bwd is not None and bwd.step == applied_bad[0] and not bwd.undetermined else None
    return Finding("nonfinite", "critical", applied_bad[0], where.name if where else None,
                   _applied_nonfinite_words(applied_bad, where) + (_after_update_words(fwd, nans) if fwd else ""),
                   f"amp-postmortem nans {target}",
                   {"applied_steps": len(applied_bad), "origin": where.to_dict() if where else None,
                    "forward_origin": fwd.to_dict() if fwd else None,
                    "nonfinite_loss_steps": len(nans.nonfinite_loss_steps)})


def _saved(run: Run) -> tuple[list, list, object]:
    """The run's bundles, its windows of steps and the bundle `replay` takes
    without --step; none, with a warning, for a folder that cannot be listed."""
    try:
        bundles, choice = saved_bundles(run), choose_bundle(run)
    except BundleError as exc:
        run.warnings.append(f"the replay bundles cannot be listed: {exc}")
        bundles, choice = [], None
    try:
        windows = window_spans(run.path)
    except BundleError as exc:
        run.warnings.append(f"the windows of steps cannot be listed: {exc}")
        windows = []
    return bundles, windows, choice


def _with_replay(f: Finding, bundles: list, target: str, model_spec: str | None) -> Finding:
    """A non-finite finding whose step saved a bundle points to its replay,
    the op-level next step (`nans` names the layers it already says)."""
    at = next((b for b in bundles if b.step == f.step), None)
    if f.kind != "nonfinite" or at is None:
        return f
    return replace(f, next_command=_replay_words(target, at, model_spec))


def replay_command(target: str, choice, model_spec: str | None) -> str | None:
    """The exact `replay` command of the bundle `replay` takes without --step."""
    return None if choice is None else _replay_words(target, choice.bundle, model_spec)


def _scale_finding(scale, target: str) -> Finding | None:
    if scale.status is ScaleStatus.COLLAPSE:
        return Finding(
            "scale_collapse", "critical", scale.onset_step, scale.drivers[0] if scale.drivers else None,
            _collapse_words(scale), f"amp-postmortem scale {target}",
            {k: scale.to_dict()[k] for k in ("onset_step", "halvings_per_kstep", "final_scale",
                                             "skip_rate_before_onset", "skip_rate_after_onset",
                                             "underflow_scale", "projected_underflow_step",
                                             "underflow_reached_step", "drivers")})
    if scale.status in (ScaleStatus.STUCK_LOW, ScaleStatus.GROWTH_BLOCKED):
        return Finding(
            "stuck_low_scale", "error", scale.last_step, scale.drivers[0] if scale.drivers else None,
            f"loss scale {scale.status.value.replace('_', ' ')}: {scale.reason}", f"amp-postmortem scale {target}",
            {"status": scale.status.value, "final_scale": scale.final_scale, "skip_rate": scale.skip_rate,
             "longest_skip_streak": scale.longest_skip_streak})
    return None


def _underflow_findings(run: Run, ranges, target: str, replayed=None) -> list:
    """Gradients that underflow now (`grad_underflow`), else those that did
    earlier (`underflow_lapsed`, an info). `replayed`: a saved step's
    replayed zeros (`unscaled.ReplayedZeros`), read for the layers whose
    rows cannot tell flushed zeros from structural ones: they rank the
    layers and decide flushed or subnormal there."""
    under = ranges.flagged("underflow")
    if len(under):
        unscaled = find_unscaled(run, ranges, replayed)
        losses = layer_losses(ranges, replayed=replayed)
        zeros = _zeros_evidence(run, losses, replayed)
        if unscaled.underflows:
            return [_unscaled_finding(run, ranges, unscaled, under, target, zeros, replayed)]
        subnormal = only_subnormal(losses) and len(losses) == len(under)
        # The layer that loses the most signal leads, not the one with the most zeros.
        lead = losses[0].name if losses else None
        by_share = under.sort_values("recent_underflow_share", ascending=False, kind="stable")
        worst = by_share[by_share["name"] == lead].iloc[0] if lead in set(by_share["name"]) else by_share.iloc[0]
        where = underflow_measured(run, str(worst["name"]), ranges.first_step, limit=worst["range_dtype"])
        kind, severity = ("grad_subnormal", "info") if subnormal else ("grad_underflow", "warning")
        words = (_subnormal_words(len(under), worst) if subnormal else _underflow_words(len(under), worst,
                                                                                       where["phrase"]))
        words += _zeros_words(losses, replayed, zeros["bundles_saved"])
        return [Finding(
            kind, severity, int(worst["evidence_last_step"]), worst["name"], words,
            f"amp-postmortem ranges {target}",
            {"layers": [str(n) for n in under["name"]], "underflow_share": float(worst["underflow_share"]),
             "lost_signal": [lay.to_dict() for lay in losses],
             **_dates(worst), **{k: v for k, v in where.items() if k != "phrase"},
             **{k: v for k, v in zeros.items() if k != "bundles_saved"}})]
    lapsed = ranges.flagged("underflow_lapsed")
    if not len(lapsed):
        return []
    worst = lapsed.sort_values("underflow_episode_share", ascending=False, kind="stable").iloc[0]
    # Nothing measured since (sampled evidence, all old): it may underflow
    # still; a warning that says how old its evidence is, not "none now".
    stale = pd.isna(worst["recent_underflow_share"])
    return [Finding(
        "underflow_lapsed", "warning" if stale else "info", int(worst["underflow_last_step"]), worst["name"],
        _lapsed_words(len(lapsed), worst, stale), f"amp-postmortem ranges {target}",
        {"layers": [str(n) for n in lapsed["name"]], "underflow_share": float(worst["underflow_share"]),
         **_dates(worst)})]


def _unscaled_finding(run: Run, ranges, unscaled, under, target: str, zeros: dict, replayed) -> Finding:
    """`unscaled_fp16_backward`: the cause of the underflow, its layers by the signal they lose."""
    lead = unscaled.layers[0].name
    row = under[under["name"] == lead].iloc[0]
    return Finding(
        "unscaled_fp16_backward", "error", int(row["evidence_last_step"]), lead,
        _unscaled_words(unscaled, len(under), _zeros_words(unscaled.layers, replayed, zeros["bundles_saved"])),
        f"amp-postmortem recommend {target}",
        {**unscaled.to_dict(), "code": grad_scaler_code(unscaled.device_type),
         "underflow_layers": [str(n) for n in under["name"]], **_dates(row),
         **{k: v for k, v in zeros.items() if k != "bundles_saved"}})


def _zeros_evidence(run: Run, losses: list, replayed) -> dict:
    """Where the underflowing layers' zeros were read (`--json`
    `zeros_basis`, `replayed_zeros`), and whether a bundle could tell."""
    basis = zeros_basis(losses)
    return {"zeros_basis": None if basis is None else basis.value,
            "replayed_zeros": None if replayed is None else replayed.to_dict(),
            "bundles_saved": replayed is not None or _has_bundle(run)}


def _has_bundle(run: Run) -> bool:
    try:
        return bool(saved_bundles(run))
    except BundleError:
        return False



def _lost_updates_finding(run: Run, target: str, checks=None) -> Finding | None:
    """`lost_updates`: the optimizer's updates round away in low-precision
    weights; each remedy with its check (`checks`, `update_remedies.
    RemedyChecks`: a window re-run given a model; else why not verified)."""
    lost = lost_updates(run)
    if not lost.lost:
        return None
    if checks is None:
        checks = unchecked(lost.remedies(), Verification.NO_MODEL if lost.window else Verification.NO_WINDOW,
                           _latest_window(run))
    lead = lost.layers[0] if lost.layers else None
    return Finding(
        "lost_updates", "warning", lost.steps[-1] if lost.steps else None, lead.name if lead else None,
        _lost_updates_words(lost, checks), _lost_updates_next(lost, checks, target),
        {**lost.to_dict(), "verification": checks.to_dict()})


def apply_update_checks(summary: Summary, run: Run, checks) -> Summary:
    """Put the window re-runs of the lost updates' remedies (`checks`,
    `update_remedies.RemedyChecks`) into the summary's `lost_updates` finding."""
    target = shlex.quote(str(run.path))
    summary.findings = [(_lost_updates_finding(run, target, checks) or f) if f.kind == "lost_updates" else f
                        for f in summary.findings]
    return summary


def _latest_window(run: Run) -> list | None:
    try:
        spans = window_spans(run.path)
    except BundleError:
        return None
    return [spans[-1]["first_step"], spans[-1]["last_step"]] if spans else None


def _dtype_policy_finding(run: Run) -> Finding | None:
    """`dtype_policy_mismatch`: Keras variables held in float16/bfloat16, or
    layers computing in another reduced precision than the model's."""
    found = dtype_policy_problems(run)
    if not found.problems:
        return None
    return Finding("dtype_policy_mismatch", "warning", None, found.layers[0], _dtype_policy_words(found),
                   _dtype_policy_next(found), found.to_dict())


def _loss_scaling_finding(run: Run) -> Finding | None:
    """`loss_scaling_mistake`: a Keras step that never scales its loss,
    unscales its gradients twice, or applies scaled gradients."""
    found = loss_scaling_mistake(run)
    if found is None:
        return None
    return Finding("loss_scaling_mistake", "error", found.first_step, None, _loss_scaling_words(found),
                   _loss_scaling_fix(found), found.to_dict())


def _fp16_reduction_findings(found) -> list:
    """`fp16_reduction_overflow`: a Flax module whose float16 reduction
    overflowed while float32 would have held it; `fp16_reduction_risk`:
    the program's float16/bfloat16 reductions the rows do not show failing."""
    out = []
    if found.reductions:
        first = found.reductions[0]
        out.append(Finding("fp16_reduction_overflow", "error", first.first_step, first.module,
                           _fp16_reduction_words(found), _FP16_REDUCTION_NEXT, found.to_dict()))
    if found.risks:
        out.append(Finding("fp16_reduction_risk", "warning", found.program_step, None, _reduction_risk_words(found),
                           _reduction_remedy(found.risks[0]), found.to_dict()))
    return out


def _program_lines(facts: dict) -> list:
    """A JAX run whose step program was not read: its float16 reductions undetermined."""
    state = facts.get("jax_reductions")
    if state == Program.NOT_TRACED.value:
        return ["float16 reductions in the step's program: undetermined (not traced: the recorder did not "
                "read the program: recorded before it did, by the Keras recorder, or a step FlaxRecorder.wrap did not jit)"]
    if state == Program.FAILED.value:
        return [f"float16 reductions in the step's program: undetermined (the recorder could not read it: "
                f"{facts.get('jax_reductions_error')})"]
    return []


def _program_facts(found) -> dict:
    """Whether the step's program was read (JAX runs; None otherwise)."""
    return {"jax_reductions": None if found.program is Program.NOT_JAX else found.program.value,
            "jax_reductions_error": found.trace_error}


def _overflow_risk_finding(run: Run, ranges, target: str) -> Finding | None:
    risk = ranges.flagged("overflow_risk")
    if not len(risk):
        return None
    worst = risk.sort_values("headroom_bits", na_position="last").iloc[0]
    forecast = int(worst["overflow_forecast_step"]) if pd.notna(worst["overflow_forecast_step"]) else None
    beyond = forecast is not None and run.last_step is not None and forecast > run.last_step
    return Finding(
        "overflow_risk", "warning", int(worst["step"]), worst["name"],
        _overflow_risk_words(len(risk), worst, forecast, beyond, run.last_step), f"amp-postmortem ranges {target}",
        {"layers": [str(n) for n in risk["name"]], "headroom_bits": float(worst["headroom_bits"]),
         "measured_step": int(worst["step"]), "forecast_step": forecast, "forecast_projected": beyond})


def _zero_gradients_finding(run: Run, ranges, target: str) -> Finding | None:
    """`zero_gradients`: float16 gradients reaching a layer, zero in every
    value at the last step measured (their zeros undetermined, no absmax)."""
    t = ranges.layers
    if not len(t):
        return None
    zero = t[(t["kind"] == "grad_output") & (t["range_dtype"] == "float16") & (t["zeros"] == Zeros.UNDETERMINED.value)
             & (t["absmax"].fillna(-1) == 0) & (t["name"] != "")]
    if not len(zero):
        return None
    first = zero.iloc[0]
    scaled = run.scaler is not None
    return Finding(
        "zero_gradients", "warning", int(first["step"]), str(first["name"]),
        _zero_gradients_words(zero, scaled), f"amp-postmortem ranges {target}",
        {"layers": [str(n) for n in zero["name"]], "scaled": scaled, "measured_step": int(first["step"])})


def _reexecution_finding(run: Run) -> Finding | None:
    mismatches = reexecution_mismatches(run)
    if not mismatches:
        return None
    first = mismatches[0]
    return Finding(
        "reexecution_differs", "warning", first.step, None, _reexecution_words(mismatches),
        'record the job with AmpRecorder(mode="every_step") to see the failing step as it ran',
        {"mismatches": [m.to_dict() for m in mismatches]})


def _disabled_finding(run: Run, disabled: dict) -> Finding | None:
    """The steps after a recorder's failure are absent: no finding above covers them."""
    if not disabled:
        return None
    r, reason = next(iter(disabled.items()))
    last = run.step_series().rank_last_steps.get(r)
    at = _rank_manifest(run, r).get("disabled_at_step")
    return Finding(
        "recording_disabled", "error", last, None, _disabled_words(disabled, reason, at, last),
        "fix the cause (the recorder warned once in the training log), then record again",
        {"disabled_reasons": {str(k): v for k, v in disabled.items()}, "last_recorded_step": last,
         "disabled_at_step": at})


def _not_closed_finding(run: Run, disabled: dict) -> Finding | None:
    unclosed = [r for r in run.ranks if r not in disabled and _rank_manifest(run, r).get("status") == "open"]
    if not unclosed:
        return None
    last = max((run.step_series().rank_last_steps.get(r, -1) for r in unclosed), default=None)
    return Finding(
        "recording_not_closed", "warning", last, None, _not_closed_words(unclosed, last),
        "check the job's end in its log (OOM killer, node failure, time limit); amp-postmortem summary "
        "again once it ends", {"ranks": unclosed, "last_recorded_step": last})


# ------------------------------------------------------------------ words
def _replay_words(target: str, bundle, model_spec: str | None) -> str:
    rank = f" --rank {bundle.rank}" if bundle.rank else ""
    model = shlex.quote(model_spec) if model_spec else "SPEC"
    return f"amp-postmortem replay {target} --step {bundle.step}{rank} --model {model}"


def saved_words(bundles: list, windows: list) -> str:
    """What the run saved for replays, in one line."""
    ranked = any(b.rank for b in bundles) or any(w["rank"] for w in windows)

    def on(rank) -> str:
        return f" rank {rank}" if ranked else ""
    saved = (", ".join(f"{b.step}{on(b.rank)} ({', '.join(b.reasons) or 'no reason recorded'})" for b in bundles)
             or "none")
    spans = ", ".join(f"{w['first_step']}-{w['last_step']}{on(w['rank'])}" for w in windows)
    return f"saved for replay: bundles of step(s) {saved}; " + (
        f"windows of steps {spans}" if spans else "no window of steps")


def _forward_nonfinite_words(fwd, nans) -> str:
    # A layer whose own weights were already NaN/Inf is where they were
    # first used (`OriginBasis.WEIGHTS`): no maker, and the brackets say why.
    made = ("first recorded in" if fwd.undetermined else
            "first in" if fwd.basis is OriginBasis.WEIGHTS else "first made by")
    why = "" if fwd.certain else " " + basis_words(
        fwd, nans.later_origins.get("forward"), nans.compiled_without_rows, nans.weights_nonfinite_from)
    return (f"the forward pass turned non-finite at step {fwd.step}: {made} "
            f"{_display(fwd.name)} ({fwd.kind}, rank {fwd.rank}){why}"
            + (f"; the loss was NaN/Inf in {len(nans.nonfinite_loss_steps)} step(s)"
               if nans.nonfinite_loss_steps else ""))


def _unrecorded_words(first: int, fwd, nans) -> str:
    later = (f"; the first recorded NaN/Inf, at step {fwd.step}, is in {_display(fwd.name)} ({fwd.kind}), "
             f"which may only show what step {first} left behind" if fwd is not None else
             "; no recorded row holds a NaN/Inf")
    why = no_rerun_words(nans.unrecorded_why) if nans.unrecorded_why else "reason unknown"
    return (f"the loss turned non-finite at step {first}, a step that recorded no per-layer row (not sampled, and "
            f"not re-executed: {why}): which layer made it "
            f"is undetermined{later}; the loss was NaN/Inf in {len(nans.nonfinite_loss_steps)} step(s). "
            f"AmpRecorder(mode=\"every_step\") records every step's rows")


def _applied_nonfinite_words(applied_bad: list, where) -> str:
    return (f"non-finite gradients were applied by the optimizer in {len(applied_bad)} step(s), first at "
            f"step {applied_bad[0]}" + (f" (born in {_display(where.name)}, {where.kind})" if where else ""))


def _after_update_words(fwd, nans) -> str:
    if fwd.basis is OriginBasis.WEIGHTS:
        then = (f"it made weights NaN/Inf, and the forward pass turned non-finite at step {fwd.step}, first in "
                f"{_display(fwd.name)}, the first layer to use them")
    elif fwd.undetermined:
        then = (f"the forward pass turned non-finite at step {fwd.step}, first recorded in {_display(fwd.name)} "
                + basis_words(fwd, nans.later_origins.get("forward"), nans.compiled_without_rows,
                              nans.weights_nonfinite_from))
    else:
        then = f"the forward pass turned non-finite later, at step {fwd.step}, first made by {_display(fwd.name)}"
    loss = (f"; the loss was NaN/Inf in {len(nans.nonfinite_loss_steps)} step(s)"
            if nans.nonfinite_loss_steps else "")
    return f"; {then}{loss}"


def _zero_gradients_words(zero, scaled: bool) -> str:
    names = ", ".join(_display(n) for n in zero["name"].head(5)) + (", ..." if len(zero) > 5 else "")
    scale = ("" if scaled else "; the float16 backward ran without a loss scale (a GradScaler lifts small "
             "gradients above float16's flush edge)")
    return (f"the float16 gradient reaching {len(zero)} layer(s) ({names}) was zero in every value at step "
            f"{int(zero.iloc[0]['step'])}, the last step measured: flushed whole by underflow, or zero in any "
            f"precision (a dead activation, a detached path): undetermined from the rows, and no update reaches "
            f"their parameters through it either way{scale}")


def _reexecution_words(mismatches: list) -> str:
    first = mismatches[0]
    counts = ""
    if first.recorded_nonfinite is not None and first.reexecuted_nonfinite is not None:
        counts = (f" ({first.recorded_nonfinite} NaN/Inf parameter gradient(s) recorded, "
                  f"{first.reexecuted_nonfinite} in the re-execution)")
    more = f", and {len(mismatches) - 1} more step(s)" if len(mismatches) > 1 else ""
    return (f"the re-execution of step {first.step} ({first.kind}) did not reproduce it{counts}{more}: the rows "
            f"written for it are not those of the step as it ran, so what they show is no evidence of it; the "
            f"step depends on something its held state does not carry (a module that changes from call to call, "
            f"state the loop changes between micro-batches), on kernels nondeterministic beyond rounding, or on "
            f"a faulty device")


def _driver_basis(scale) -> str:
    """How many skipped steps the drivers rest on, when some recorded no
    rows (a sentinel's run: the steps it re-executed); nothing otherwise."""
    n, of = scale.driver_recorded_steps, scale.driver_candidate_steps
    if not scale.drivers or n >= of:
        return ""
    return f" (read from the {n} of its {of} skipped steps that recorded per-layer rows)"


def _collapse_words(scale) -> str:
    drivers = ", ".join(_display(d) for d in scale.drivers[:3]) or "undetermined"
    return (f"the loss scale collapses from step {scale.onset_step}: {scale.halvings_per_kstep:.3g} halvings "
            f"per 1000 steps, now {scale.final_scale:.3g}; skip rate {_pct(scale.skip_rate_before_onset)} "
            f"before, {_pct(scale.skip_rate_after_onset)} after; overflows born in {drivers}{_driver_basis(scale)}"
            + underflow_phrase(scale, "; "))


def _underflow_words(count: int, worst, measured: str) -> str:
    return (f"{count} gradient(s) underflow in {worst['range_dtype']} at the recorded scale: "
            f"{_display(worst['name'])} has {worst['recent_underflow_share']:.0%} of "
            f"{sampled_values(worst['share_sample_size'])} below the normal "
            f"limit {_normal_limit(worst['range_dtype'])} {recent_words(worst)}"
            + _zero_words(worst) + f" ({measured})")


def _subnormal_words(count: int, worst) -> str:
    return (f"{count} gradient(s) hold {worst['range_dtype']} subnormals, almost none flushed to zero: "
            f"{_display(worst['name'])} has {worst['recent_underflow_share']:.0%} of its values below "
            f"{_normal_limit(worst['range_dtype'])}, kept with fewer significant bits (a relative rounding "
            f"error up to 2^-24 / |value| instead of 2^-11); no signal is lost, a larger loss scale would "
            f"restore their precision")


_PRECISION_NAMES = {"fp16": "float16", "bf16": "bfloat16"}

_ABSENCE_WORDS = {ScaleAbsence.NO_SCALER: "no GradScaler",
                  ScaleAbsence.SCALER_DISABLED: "a GradScaler that is disabled (enabled=False)",
                  ScaleAbsence.SCALE_ONE: "a loss scale of 1"}


def _unscaled_words(unscaled, count: int, zeros: str = "") -> str:
    named = ", ".join(
        f"{_display(lay.name)} ({_bits_words(lay.flush_headroom_bits)}"
        + (f", {lay.underflow_share:.0%} subnormal or flushed" if lay.underflow_share is not None else "") + ")"
        for lay in unscaled.layers[:3])
    return (f"float16 gradients travel unscaled ({_ABSENCE_WORDS[unscaled.cause]}): {count} gradient(s) "
            f"underflow, the most signal lost in {named}{zeros}. Add a GradScaler: " + "; ".join(
                grad_scaler_code(unscaled.device_type).splitlines()))


def _zeros_words(losses: list, replayed, bundles_saved: bool) -> str:
    """What a replay said of the zeros, or that nothing could."""
    if zeros_basis(losses) is not ZerosBasis.UNDETERMINED:
        shown = [lay for lay in losses if lay.zeros_basis is ZerosBasis.REPLAY][:3]
        if replayed is None or not shown:
            return ""
        share = replayed.flushed_share
        return (f"; flushed or structural told by replaying step {replayed.step} in float32 and "
                f"{_PRECISION_NAMES.get(replayed.precision, replayed.precision)}"
                + ("" if share is None else f": {share:.0%} of the gradient values non-zero in float32 were "
                                            "flushed to zero")
                + ", most in " + ", ".join(f"{_display(lay.name)} {lay.replayed.flushed_share:.0%}"
                                           for lay in shown if lay.replayed.flushed_share is not None))
    unknown = [lay.name for lay in losses if lay.zeros_basis is ZerosBasis.UNDETERMINED]
    how = ("replay a saved step to tell (`amp-postmortem summary RUN --model SPEC`)" if bundles_saved else
           "no bundle was saved to replay (record with bundles and call rec.save_bundle())")
    return (f"; whether the zeros of {len(unknown)} gradient(s) were flushed or are structural is undetermined: "
            f"their values sit at float16's flush edge, where the recorded rows cannot tell; {how}")


def _bits_words(bits) -> str:
    if bits is None:
        return "every value zero"
    return f"largest value {bits:.1f} bit(s) above float16's flush edge"


def grad_scaler_code(device_type: str | None) -> str:
    """The lines that put a GradScaler around a float16 backward."""
    return (f'scaler = torch.amp.GradScaler("{device_type or "cuda"}")\n'
            "scaler.scale(loss).backward()\n"
            "scaler.step(optimizer)\n"
            "scaler.update()")


_REMEDY_WORDS = {
    UpdateRemedy.FP32_MASTER_WEIGHTS: "keep float32 master weights: float32 parameters with autocast over them "
                                      "(drop model.to(torch.bfloat16); wrap the forward in "
                                      "torch.autocast(device_type, dtype=torch.bfloat16))",
    UpdateRemedy.LARGER_LR: "a larger learning rate, so that lr x update reaches half an ulp of the weights",
    UpdateRemedy.STOCHASTIC_ROUNDING: "where the weights must stay low-precision, stochastic rounding or "
                                      "compensated (Kahan) summation in the optimizer's update"}


def _lost_updates_words(lost, checks) -> str:
    named = ", ".join(f"{_display(lay.name)} {lay.recent_lost_share:.0%}" + _trend_words(lay.trend_per_kstep)
                      for lay in lost.layers[:3] if lay.recent_lost_share is not None)
    lr = f" at learning rate {lost.learning_rate:g}" if lost.learning_rate is not None else ""
    opt = f" ({lost.optimizer.rpartition('.')[2]})" if lost.optimizer else ""
    statuses = {c.status for c in checks.checks}
    # Not re-run at all (no window, no model): said once, not per remedy.
    once = len(statuses) == 1 and not any(c.trial for c in checks.checks) and checks.checks
    remedies = []
    for r in lost.remedies():
        check = checks.get(r)
        remedies.append(_REMEDY_WORDS[r] + (f" [{check_line(check, checks)}]" if check is not None and not once
                                            else ""))
    tail = ""
    if once:
        tail = " (" + check_line(checks.checks[0], checks, named=False) + ")"
    return (f"{lost.recent_lost_share:.0%} of the optimizer's updates{opt} leave the {lost.param_dtype} weights "
            f"unchanged (measured from step {lost.recent_from_step}): below half an ulp of the weight{lr}, they "
            f"round away; most lost in {named}. Cause: parameters held in {lost.param_dtype} with no float32 "
            f"master copy, times the learning rate. Remedies: " + "; ".join(remedies) + tail)


def _mixed_policy(found) -> str:
    """The one policy the remedy names: the model's when it is a mixed one."""
    policy = found.model_policy or ""
    return policy if policy.startswith("mixed_") else "mixed_float16"


def _dtype_policy_next(found) -> str:
    return (f'keras.mixed_precision.set_global_policy("{_mixed_policy(found)}") before any layer is built, '
            'no dtype="float16" on a layer or a weight (then record again)')


def _dtype_policy_words(found) -> str:
    def named(layers: dict) -> str:
        shown = [f"{_display(k)} ({', '.join(v) if isinstance(v, list) else v})" for k, v in list(layers.items())[:4]]
        return ", ".join(shown) + (f" and {len(layers) - 4} more" if len(layers) > 4 else "")

    parts = []
    if PolicyProblem.LOW_PRECISION_VARIABLES in found.problems:
        parts.append(f"variables held in low precision in {named(found.low_precision_variables)}: no float32 "
                     "master copy, so updates below half an ulp of a weight round away and float16 weights "
                     "overflow at 65504")
    if PolicyProblem.LAYER_POLICY_DIFFERS in found.problems:
        parts.append(f"layers computing under another policy than the model's {found.model_policy}, "
                     f"{named(found.differing_layers)}: built before set_global_policy, or given their own "
                     "dtype= (compile adds a LossScaleOptimizer only for a mixed_float16 model)")
    mixed = _mixed_policy(found)
    return ("dtype policies disagree: " + "; ".join(parts) + f". Remedy: one mixed policy for the whole model "
            f"({mixed}: float32 variables, {mixed.partition('_')[2]} compute), set before the model is built; "
            "a float32 layer on purpose (a final softmax) is fine")


def _loss_scaling_fix(found) -> str:
    """The exact lines of a right step, in the backend's own idiom."""
    if found.mistake is ScalingMistake.SCALED_GRADIENTS_APPLIED:
        call = ("self.optimizer.stateless_apply(optimizer_variables, grads, trainable_variables)"
                if found.backend == "jax" else "self.optimizer.apply(grads, self.trainable_variables)")
        return (f"{call} on the LossScaleOptimizer itself, not on self.optimizer.inner_optimizer: it divides "
                "the gradients by the scale and skips a step whose gradients hold Inf/NaN")
    if found.backend == "jax":
        fix = ("in the function jax.value_and_grad differentiates, return the scaled loss: with "
               "keras.StatelessScope(state_mapping=list(zip(self.optimizer.variables, optimizer_variables))): "
               "scaled_loss = self.optimizer.scale_loss(loss); then self.optimizer.stateless_apply("
               "optimizer_variables, grads, trainable_variables)")
    else:
        fix = ("inside the GradientTape: scaled_loss = self.optimizer.scale_loss(loss); after it: "
               "grads = tape.gradient(scaled_loss, self.trainable_variables); "
               "self.optimizer.apply(grads, self.trainable_variables)")
    if found.mistake is ScalingMistake.UNSCALED_TWICE:
        fix += " with those gradients as they are (it divides them by the scale itself)"
    elif found.mistake is ScalingMistake.SCALE_UNUSED:
        fix += " on the LossScaleOptimizer, not its inner_optimizer"
    return fix


def _loss_scaling_words(found) -> str:
    scale = f"{found.loss_scale:g}" if found.loss_scale is not None else "the loss scale"
    step = "the custom train_step" if found.custom_train_step else "the train step"
    if found.basis is Basis.MEASURED:
        evidence = (f"measured: the gradients handed to the optimizer were {found.factor:.3g}x the gradients "
                    f"of the step's own loss while the loss scale was {scale} "
                    f"({len(found.measured)} steps measured from step {found.first_step})")
    else:
        calls = found.scale_loss_calls
        evidence = (f"from the traced step: optimizer.scale_loss called {calls} time{'s' if calls != 1 else ''}, "
                    f"the gradients applied by the {'step itself, through the inner optimizer' if found.applied_by is AppliedBy.INNER_OPTIMIZER else 'LossScaleOptimizer'}")
    what = {
        ScalingMistake.LOSS_NOT_SCALED:
            f"{step} never scales its loss (it does not call optimizer.scale_loss) yet hands the gradients "
            f"to LossScaleOptimizer.apply, which divides every gradient by the scale: each update is "
            f"{scale} times too small, and float16 gradients get no protection from underflow",
        ScalingMistake.UNSCALED_TWICE:
            f"{step} calls optimizer.scale_loss, but the gradients reach LossScaleOptimizer.apply at the "
            f"size of the unscaled loss's: they were taken of the unscaled loss, or divided by the scale in "
            f"the step before apply divided them again; each update is {scale} times too small",
        ScalingMistake.SCALED_GRADIENTS_APPLIED:
            f"{step} applies the scaled loss's gradients with optimizer.inner_optimizer.apply: they are never "
            f"divided by the scale (each update {scale} times too large) and a step with Inf/NaN gradients "
            f"is applied instead of skipped",
        ScalingMistake.SCALE_UNUSED:
            f"{step} neither scales its loss nor applies through the LossScaleOptimizer (its "
            f"inner_optimizer applies): no loss scaling at all, float16 gradients unprotected and "
            f"Inf/NaN steps applied",
    }[found.mistake]
    return f"the LossScaleOptimizer is misused: {what} ({evidence})"


_FP16_REDUCTION_NEXT = ("compute the reduction in float32 and cast back: "
                        "jax.nn.softmax(x.astype(jnp.float32)).astype(x.dtype) (then record again)")


def _fp16_reduction_words(found) -> str:
    shown = [f"{_display(r.module)} at step {r.first_step} ({r.values_per_output} values per output, the "
             f"largest input {r.input_absmax:g}: up to {r.bound:.3g})" for r in found.reductions[:3]]
    more = f" and {len(found.reductions) - 3} more" if len(found.reductions) > 3 else ""
    sites = [f"{_site_words(s)} (overflowed at {', '.join(_display(m) for m in s.overflowed_at)}); remedy: "
             f"{_reduction_remedy(s)}" for s in found.sites if s.phase == "forward" and s.overflowed_at][:3]
    return ("a reduction computed in float16 overflowed: " + "; ".join(shown) + more + ". Each module's input "
            "was finite and its float16 output is not: a sum of that many values passes float16's 65504 and "
            "stays far below float32's 3.4e38. Remedy: compute it in float32 and cast back what float16 "
            "holds (a softmax or log_softmax: jax.nn.softmax(x.astype(jnp.float32)).astype(x.dtype)); a "
            "sum above 65504 stays in float32 or becomes a mean"
            + ("" if not sites else ". In the step's program: " + "; ".join(sites)))


# How each pattern of `jax_program` reads, and its float32 form.
_PATTERN_WORDS = {"softmax": "softmax", "log_softmax": "log_softmax", "logsumexp": "logsumexp",
                  "exp_sum": "a sum of exp", "sum": "a sum", "mean": "a mean", "prod": "a product",
                  "cumsum": "a cumulative sum", "cumprod": "a cumulative product",
                  "cumlogsumexp": "a cumulative logsumexp"}
_PATTERN_REMEDY = {"softmax": "jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)",
                   "log_softmax": "jax.nn.log_softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)",
                   "logsumexp": "jax.nn.logsumexp(x.astype(jnp.float32), axis=-1).astype(x.dtype)",
                   "exp_sum": "jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype) (the max "
                              "subtracted, in float32)",
                   "sum": "x.astype(jnp.float32).sum(axis), kept in float32 (or a mean) while it may pass 65504",
                   "mean": "x.astype(jnp.float32).mean(axis).astype(x.dtype)",
                   "prod": "jnp.prod(x.astype(jnp.float32), axis).astype(x.dtype)",
                   "cumsum": "jnp.cumsum(x.astype(jnp.float32), axis), kept in float32 while it may pass 65504",
                   "cumprod": "jnp.cumprod(x.astype(jnp.float32), axis).astype(x.dtype)",
                   "cumlogsumexp": "jax.lax.cumlogsumexp(x.astype(jnp.float32), axis).astype(x.dtype)"}


def _reduction_remedy(site) -> str:
    return f"compute it in float32 and cast back: {_PATTERN_REMEDY[site.pattern]}"


def _site_words(site) -> str:
    where = (f"{site.file}:{site.line}" if site.file else "an unknown line") + (
        f" ({site.function})" if site.function else "")
    how = [f"{site.values_per_output} values per output"]
    if site.accumulation_dtype != site.dtype:
        how.append(f"summed in {site.accumulation_dtype} by jnp, the result held in {site.dtype}"
                   if site.pattern in ("sum", "cumsum") else f"its sum in {site.accumulation_dtype}, the rest in {site.dtype}")
    if site.shifted is False:
        how.append(f"exp of values not shifted by their max: Inf in {site.dtype} past exp(11.09)"
                   if site.dtype == "float16" else "exp of values not shifted by their max")
    return f"{_PATTERN_WORDS[site.pattern]} in {site.dtype} at {where} ({', '.join(how)})"


def _reduction_risk_words(found) -> str:
    risks = found.risks
    shown = [f"{_site_words(s)}; remedy: {_reduction_remedy(s)}" for s in risks[:4]]
    more = f"; and {len(risks) - 4} more" if len(risks) > 4 else ""
    dropped = f" ({found.sites_dropped} more sites not recorded)" if found.sites_dropped else ""
    return ("the step's program computes reductions on float16/bfloat16 values: " + "; ".join(shown) + more
            + dropped + ". Computed in low precision; not observed to overflow in the recorded rows: a risk "
            "(its precision, and an overflow once the values grow), not a failure")


def _lost_updates_next(lost, checks, target: str) -> str:
    verified = next((c for c in checks.checks if c.verified), None)
    if verified is not None:  # the re-run that shows it
        return verified.trial.command
    if any(c.status is Verification.NO_MODEL for c in checks.checks):
        return f"amp-postmortem summary {target} --model SPEC (re-runs the saved window with each remedy)"
    return "cast the parameters back to float32 and train under autocast (then record again)"


def _trend_words(slope) -> str:
    if slope is None:
        return ""
    return f" ({slope * 100:+.1f} points per 1000 steps)"


def _lapsed_words(count: int, worst, stale: bool) -> str:
    if stale:
        a, b = worst["underflow_first_step"], worst["underflow_last_step"]
        when = f"at step {a}" if a == b else f"during steps {a}-{b}"
        return (f"{count} layer(s) lost gradients to underflow when last measured ({_display(worst['name'])} "
                f"{worst['underflow_episode_share']:.0%} {when}); no full-tier step since step "
                f"{worst['evidence_last_step']}, so whether they underflow now is unknown "
                f"(AmpRecorder(schedule=RecordSchedule(full_every=N)) measures more often)")
    return f"no gradient underflows now; {count} did earlier: {_display(worst['name'])} {lapsed_words(worst)}"


def _overflow_risk_words(count: int, worst, forecast, beyond: bool, last_step) -> str:
    return (f"{count} activation(s) near {worst['range_dtype']} overflow: {_display(worst['name'])} has "
            f"{worst['headroom_bits']:.3g} bit(s) of headroom at step {int(worst['step'])}"
            + (f", forecast to overflow at step {forecast}"
               + (f" (projected, after the run's last step {last_step})" if beyond else "")
               if forecast is not None else ""))


def _disabled_words(disabled: dict, reason, at, last) -> str:
    stopped = f"at step {at}" if at is not None else f"after step {last}"
    return (f"recording stopped {stopped} on rank(s) {', '.join(map(str, disabled))} "
            f"({reason}): later steps were not recorded and this analysis cannot see them")


def _not_closed_words(unclosed: list, last) -> str:
    return (f"recording of rank(s) {', '.join(map(str, unclosed))} ended without closing and left no stop "
            f"record (status 'open'): the job was killed or is still running; steps after {last} may be "
            f"missing from this analysis")


def _healthy_words(scale) -> str:
    return (f"no non-finite forward, loss scale {scale.status.value} ({scale.reason}), no layer near float16 "
            f"overflow or underflow")


def _finding_order(f: Finding) -> tuple:
    return (SEVERITIES.index(f.severity), FINDING_KINDS.index(f.kind), f.step if f.step is not None else 1 << 62)


def instability_finding(unstable, verdict, target: str) -> Finding:
    """The `training_instability` finding: claimed when a float32 re-run
    verified it, suspected otherwise (the verdict says what decides it)."""
    verified = verdict is not None and verdict.verdict is Verdict.TRAINING_INSTABILITY
    head = (f"{verdict.sentence()}, not a precision problem: " if verified else
            "suspected training instability (" + (verdict.sentence() if verdict is not None else
                                                  "precision or instability undetermined") + "): ")
    evidence = dict(unstable.to_dict(), verdict=verdict.verdict.value if verdict is not None else "undetermined",
                    verification=verdict.to_dict() if verdict is not None else None)
    return Finding(
        "training_instability", "critical", unstable.failure_step, unstable.grown_layer,
        head + "; ".join(unstable.evidence) + ". " + ("Fix the training: " if verified else "If so, fix the training: ")
        + "; ".join(unstable.remedies()) + " (keeping modules in float32 or another loss scale only postpones it)",
        f"amp-postmortem recommend {target}", evidence)


def apply_verdict(summary: Summary, verdict, unstable, target: str) -> Summary:
    """Put a decided `verdict` (`precision_verdict.PrecisionVerdict`) into
    the summary: a verified instability is claimed (the finding added when
    the recorded evidence alone did not show it); a precision verdict removes
    the instability finding its re-run refutes."""
    summary.precision_verdict = verdict
    kept = [f for f in summary.findings if f.kind != "training_instability"]
    if verdict.verdict is Verdict.TRAINING_INSTABILITY:
        kept.append(instability_finding(unstable, verdict, target))
    elif verdict.verdict is Verdict.UNDETERMINED:
        kept = summary.findings
    if verdict.verdict is not Verdict.UNDETERMINED:
        kept = [f for f in kept if f.kind != "healthy"] or kept
        kept.sort(key=_finding_order)
    summary.findings = kept
    return summary


def _losses(per_step: pd.DataFrame, failure_step: int | None) -> dict:
    """The loss (the lowest rank's) at the first and last recorded step and
    at the step of the first critical finding. NaN/Inf stay floats here;
    `--json` writes them as null, as every non-finite value."""
    by_step = per_step.set_index("step")

    def at(step):
        if step is None or step not in by_step.index:
            return None
        row = by_step.loc[step]
        if pd.notna(row["loss"]):
            return float(row["loss"])
        # A null loss reads as NaN in pandas: the flag tells a NaN loss from none.
        # math.nan, one object: two summaries of one run compare equal
        # (dict equality tries identity first; NaN != NaN).
        return math.nan if bool(row["loss_nonfinite_any"]) else None

    first = int(per_step["step"].iloc[0]) if len(per_step) else None
    last = int(per_step["step"].iloc[-1]) if len(per_step) else None
    return {"first_loss": at(first), "last_loss": at(last), "failure_step": failure_step,
            "failure_loss": at(failure_step)}


def _loss_line(r: dict) -> str:
    def fmt(v):
        return "not recorded" if v is None else f"{v:.4g}"
    line = f"loss {fmt(r.get('first_loss'))} at step {r['first_step']}, {fmt(r.get('last_loss'))} at step " \
           f"{r['last_step']}"
    if r.get("failure_step") is not None:
        line += f"; {fmt(r.get('failure_loss'))} at the failure (step {r['failure_step']})"
    return line


def _disabled_ranks(run: Run) -> dict:
    """{rank: disabled_reason} of the analysed ranks whose recorder switched itself off."""
    manifests = {r: _rank_manifest(run, r) for r in run.ranks}
    return {r: m["disabled_reason"] for r, m in sorted(manifests.items()) if m.get("disabled_reason")}


def _rank_manifest(run: Run, r: int) -> dict:
    """Rank r's manifest (its status slot laid over), else the run's for the lowest rank."""
    return run.rank_manifests.get(r, run.manifest if r == min(run.ranks) else {})


def underflow_measured(run: Run, name: str, from_step: int | None, limit: str = "float16") -> dict:
    """Where a layer's underflow share was measured: its full-tier
    `grad_output` rows from `from_step` on (the `ranges` window), the loss
    scales they ran at, and the share at the last of them, with a phrase
    for sentences (a median over steps at several scales is said to be one)."""
    import functools

    import pyarrow as pa

    from .ranges import underflow_share_of_rows
    columns = ["step", "rank", "name", "kind", "nan_count", "inf_count", "absmax", "zero_share",
               "below_normal_share", "below_subnormal_share", "share_sample_size"]
    # Only this layer's rows leave each shard: the memory is bounded by a
    # shard, not by every layer's rows of the window.
    parts = list(run.map_tensor_shards(functools.partial(_full_tier_rows_of, name=name), columns,
                                       kinds=["grad_output"], step_range=(from_step, None),
                                       label="reading underflow shares"))
    rows = pa.concat_tables(parts).to_pandas() if parts else pd.DataFrame(columns=columns)
    rows = rows[(rows["name"] == name) & rows["below_normal_share"].notna()
                & ((rows["nan_count"] + rows["inf_count"]) == 0)]
    if rows.empty:
        return {"phrase": "no full-tier step measured it"}
    share = underflow_share_of_rows(rows, limit, layer="name")  # all-zero rows: unknown by themselves, left out
    per_step = pd.DataFrame({"step": rows["step"], "share": share}).dropna().groupby("step")["share"].mean()
    if per_step.empty:
        return {"phrase": "no full-tier step measured it"}
    scales = run.step_series().steps.set_index("step")["loss_scale_before"]  # the lowest rank's
    at = [float(scales.get(s)) if pd.notna(scales.get(s)) else None for s in per_step.index]
    known = [a for a in at if a is not None]
    steps = [int(s) for s in per_step.index]
    last_scale = at[-1]
    scale_txt = ("no loss scale" if not known else f"scale {known[0]:g}" if min(known) == max(known)
                 else f"scales {max(known):g} to {min(known):g}")
    if len(steps) == 1:
        phrase = f"at step {steps[0]}, {scale_txt}"
    else:
        phrase = (f"median over {len(steps)} full-tier steps {steps[0]}-{steps[-1]} at {scale_txt}; "
                  f"{float(per_step.iloc[-1]):.1%} at step {steps[-1]}"
                  + (f", scale {last_scale:g}" if last_scale is not None else ""))
    return {"phrase": phrase, "measured_steps": steps, "measured_scales": at,
            "share_at_last_step": float(per_step.iloc[-1]), "last_step_scale": last_scale}


def _full_tier_rows_of(rows, name: str):
    """The per-shard map of `underflow_measured`: `name`'s full-tier rows
    without NaN/Inf (a top-level function, so that it pickles for an engine)."""
    import pyarrow.compute as pc
    keep = pc.and_(pc.and_(pc.equal(rows["name"], name), pc.is_valid(rows["below_normal_share"])),
                   pc.equal(pc.add(rows["nan_count"], rows["inf_count"]), 0))
    return rows.filter(keep)


def _facts(run: Run, nans, scale, skipped) -> dict:
    m = run.manifest
    return {
        "path": str(run.path), "run_id": run.run_id, "status": m.get("status"),
        "steps": len(run.step_series().steps), "first_step": run.first_step, "last_step": run.last_step,
        "ranks": run.ranks, "world_size": run.world_size,
        "device_type": m.get("device_type"), "device_name": m.get("device_name"),
        "model_class": m.get("model_class"), "autocast": run.autocast, "dtype": run.autocast.get("dtype"),
        "param_dtype": param_dtype(m), "param_dtypes": param_dtypes(m),
        "scaler": run.scaler, "scale_status": scale.status.value, "final_scale": scale.final_scale,
        "skipped_steps": len(skipped), "nonfinite_loss_steps": len(nans.nonfinite_loss_steps),
        "warnings": list(run.warnings),
    }


def _dates(row) -> dict:
    """The steps a `ranges` row's underflow evidence comes from, and what its zeros are (`--json`)."""
    keys = ("evidence_first_step", "evidence_last_step", "evidence_steps", "recent_from_step",
            "recent_underflow_share", "underflow_first_step", "underflow_last_step", "underflow_episode_share",
            "structural_zero_share", "flushed_zero_share", "zeros")
    return {k: (None if row[k] is None or pd.isna(row[k]) else
                int(row[k]) if k.endswith(("_step", "_steps")) else
                row[k] if k == "zeros" else float(row[k])) for k in keys}


def _zero_words(row) -> str:
    """The structural zeros a share leaves out, for the finding's sentence."""
    z = row["structural_zero_share"]
    return "" if z is None or pd.isna(z) or z < 0.005 else f"; {z:.0%} exact zeros left out as structural"


def _pct(v) -> str:
    return "n/a" if v is None else f"{v:.0%}"


def _normal_limit(dtype: str) -> str:
    """The smallest normal of `dtype`, as `6.1e-5` (float16)."""
    return f"{DTYPE_LIMITS[dtype][1]:.2g}".replace("e-0", "e-")


def zeros_undetermined(summary: Summary) -> bool:
    """An underflow finding whose layers' zeros the recorded rows could not
    tell apart (`zeros_basis` undetermined): a replay of a saved step can."""
    return any(f.evidence.get("zeros_basis") == ZerosBasis.UNDETERMINED.value for f in summary.findings
               if f.kind in ("unscaled_fp16_backward", "grad_underflow", "grad_subnormal"))
