"""What to change, each recommendation with its evidence.

From the recorded run alone (`summary`'s findings and the loss-scale window
estimated from the recorded statistics; `keep_fp32`, `scaler_settings` and
`gradient_drift` are then marked not `verified`, with `why`):
- `check_data`: the forward origin is the model's input (`<input>`);
- `check_weights`: the forward origin is a layer whose own weights were
  already NaN/Inf when its step ran (its `param` rows there, `nans`'
  `nonfinite_weights`): the only recommendation, since no precision
  setting or loss scale makes those weights finite;
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
nonfinite_tensor, else request or step_list, else scale_low, else skipped or
nonfinite_gradient):
- `check_weights`: the bundle's weights hold a NaN/Inf (the parameters
  named): the only recommendation, verified by reading them (every replay
  of the step runs on them);
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

Either way, a `lost_updates` finding adds its remedies,
`fp32_master_weights`, `larger_learning_rate` and `stochastic_rounding`,
each `verified` only by a re-run of the saved window with it that keeps
the updates and makes the loss fall further than as recorded
(`analyses/update_remedies.py`; given a model), else with why not.
"""
from __future__ import annotations

from ..reading.loader import Run
from .recommendation import ORDER, Recommendation, RecommendationKind, Recommendations, Source
from .recorded import recorded_recommendations
from .replayed import bundle_to_replay, replayed_recommendations
from .words import lost_updates_recommendations

__all__ = ["ORDER", "Recommendation", "RecommendationKind", "Recommendations", "Source", "recommend"]


def recommend(run: Run, *, model=None, step: int | None = None, rank: int | None = None, device: str = "cpu",
              policy: str = "recorded", loss_fn=None, progress=None, loss=None) -> Recommendations:
    """Recommendations for `run`; what-if replays when `model` is given
    (`loss_fn(output, micro_batch)` as in `replay`; `loss`: the loop's loss
    for the re-runs of the saved window, as in `rerun`)."""
    from ..analyses.summary import summarize

    summary = summarize(run)
    notes: list[str] = []
    updates = dict(model=model, rank=rank, device=device, policy=policy, loss_fn=loss_fn, loss=loss)
    if model is not None:
        picked = bundle_to_replay(run, step, rank, notes)
        if picked is not None:
            bundle_step, bundle_rank = picked
            recs = replayed_recommendations(run, bundle_step, bundle_rank, model, device, policy, loss_fn,
                                            progress, notes, summary, loss=loss)
            return Recommendations(run=str(run.path), step=bundle_step, replayed=True,
                                   recommendations=_sorted(_with_lost_updates(recs, run, summary, **updates)),
                                   notes=notes)
    elif run.manifest.get("bundles"):
        notes.append("the run holds replay bundles: pass --model to confirm these with replays")
    recs = _with_lost_updates(recorded_recommendations(run, summary), run, summary, **updates)
    return Recommendations(run=str(run.path), step=None, replayed=False, recommendations=_sorted(recs), notes=notes)


def _with_lost_updates(recs, run: Run, summary, **options) -> list:
    """The remedies of a `lost_updates` finding added, each verified by
    re-running the saved window with it given a model
    (`whatif/update_trials.py`); no `no_change` beside them."""
    finding = next((f for f in summary.findings if f.kind == "lost_updates"), None)
    if finding is None:
        return recs
    from ..analyses.updates import lost_updates
    from ..whatif.update_trials import verify_update_remedies
    checks = verify_update_remedies(run, lost_updates(run), command="recommend", **options)
    return [r for r in recs if r.kind is not RecommendationKind.NO_CHANGE] + lost_updates_recommendations(
        finding, checks)


def _sorted(recs):
    return sorted(recs, key=lambda r: ORDER.index(r.kind))
