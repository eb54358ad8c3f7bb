"""amp-postmortem analyzer: reads a recorded run on any machine and answers
the post-mortem questions of a diverged mixed-precision training job.

This module is the Python API, and the command line mirrors it: one function
per command, with the command's name (`scale-window` -> `scale_window`) and
its options as keyword arguments (`--from-step` -> `from_step`). Each takes
the run first (a path, a path string, or a `Run` from `load_run`; `compare`
takes two) and returns the command's result, whose `to_dict()` is what the
command prints with `--json`, `lines()` and `table()` what it prints
without:

    import amp_postmortem
    amp_postmortem.nans("runs/exp1", from_step=1000).to_dict()
    amp_postmortem.fix("runs/exp1", step=79, model="train.py:make_model").fix

Importing it imports neither torch nor pandas: the table commands run where
torch is absent; `replay`, `fix`, `bisect`, `load_bundle` and the replayed
`scale_window`, `recommend`, `nans` and `summary` (given a model) import
torch when called. Errors the user can
fix are `errors.PostmortemError`s with one-line messages.
"""
from __future__ import annotations

import sys

from .names import DEVICES, PRECISIONS, REDUCED_PRECISIONS

__version__ = "0.1.0"

__all__ = ["load_run", "load_bundle", "summary", "watch", "nans", "scale", "ranges", "compare", "replay", "fix",
           "bisect", "scale_window", "recommend", "rerun", "report", "export_tensorboard", "export_mlflow",
           "export_wandb", "record"]

# The CLI's option defaults are read from these signatures;
# tests/test_api.py checks them against the analyses' own defaults.


# ------------------------------------------------------------------ loading
def load_run(run, *, rank: int | None = None, engine: str | None = None, scheduler: str | None = None,
             progress=None):
    """The validated run at `run` (a path, a path string, or a URI such as
    `s3://bucket/runs/exp1`; a loaded `Run` is returned as is, or re-opened
    for `rank`). `engine` (`local` or `dask`, with `scheduler`) runs its
    per-shard reads; `progress(label, done, total)` is called while long
    scans run."""
    from .reading.loader import Run, load_run as load
    if isinstance(run, Run):
        if rank is not None and run.ranks != [int(rank)]:
            run = load(run.path, rank=rank)
    else:
        run = load(run, rank=rank)
    if engine is not None or scheduler is not None:
        from .reading.engines import get_engine
        run.engine = get_engine(engine, scheduler)
    if progress is not None:
        run.progress = progress
    return run


def load_bundle(path, *, step: int | None = None, rank: int | None = None):
    """A replay bundle, checked (checksums, version): a bundle directory, or
    a run directory with `step` (and `rank`; default: the lowest that saved
    one). Imports torch."""
    from .reading.bundle import load_bundle as load
    return load(_path(path), step=step, rank=rank)


# -------------------------------------------------------- table commands
def summary(run, *, rank: int | None = None, window: int = 1000, engine: str = "local",
            scheduler: str | None = None, model=None, step: int | None = None, device: str = "cpu",
            policy: str = "recorded", loss_fn=None, loss=None, progress=None):
    """Run facts and findings, most severe first (`amp-postmortem summary`).
    `window`: the last N steps `ranges` judges (0: the whole run).
    `engine`/`scheduler`: where the per-shard reads run (`local`, or `dask`
    on the cluster at `scheduler`); the same result either way. With
    `model` (and `step`, `device`, `policy`, `loss_fn` as for `replay`),
    a run with a NaN/Inf replays a saved bundle and adds the op origin
    (`op_origin`: `replaying/run_origin.py`), and re-runs the saved window of
    steps in float32 to decide precision or instability
    (`precision_verdict`: `whatif/verdict.py`; `loss`: the loop's loss, as
    for `rerun`), and re-runs it with each remedy of lost updates
    (`lost_updates` finding: `whatif/update_trials.py`); where the recorded
    rows cannot tell flushed gradient zeros from structural ones, it
    replays a saved step in float32 and the recorded precision
    (`whatif/flush.py`: `step`'s bundle, else the one `replay` takes).
    Without it nothing is replayed, the verdict is undetermined, no remedy
    verified, and such zeros stay undetermined."""
    from .analyses.summary import summary_parts
    r = load_run(_replayable(run, model), rank=rank, engine=engine, scheduler=scheduler, progress=progress)
    with _engine_of(r):
        spec = model if isinstance(model, str) else None
        parts = summary_parts(r, window=window, model_spec=spec)
        report = parts.summary()
        if model is not None and _zeros_undetermined(report):
            replayed = _replay_zeros(r, model, step, rank, device, policy, loss_fn, report)
            if replayed is not None:
                # The underflow findings again, with the replay's zeros: the
                # other analyses are read once.
                report = parts.summary(replayed)
        failing = next((f for f in report.findings if f.kind == "nonfinite"), None)
        if failing is not None:
            origin = (failing.evidence.get("origin") or {})
            report.op_origin = _op_origin(r, model, step, rank, origin.get("step") if origin.get("phase") ==
                                          "forward" else None, device, policy, loss_fn)
        if model is not None and report.precision_verdict is not None:
            _decide_precision(report, r, model, rank, device, policy, loss_fn, loss)
        if model is not None and "lost_updates" in report.kinds():
            _verify_update_remedies(report, r, model, rank, device, policy, loss_fn, loss)
        return _result(report, r)


def _zeros_undetermined(report) -> bool:
    from .analyses.summary import zeros_undetermined
    return zeros_undetermined(report)


def _replay_zeros(run, model, step, rank, device, policy, loss_fn, report):
    """A saved step's gradient zeros, flushed or structural, replayed in
    float32 and the recorded precision (`whatif/flush.py`): `step`'s bundle,
    else the one `replay` takes; None, with a warning, when none can be."""
    from .analyses.bundle_choice import pick_bundle
    from .errors import PostmortemError
    from .replaying.model_spec import resolve_loss_fn
    from .whatif.flush import replay_zeros
    picked = (step, rank) if step is not None else pick_bundle(run, rank)
    if picked is None:
        return None
    try:
        return replay_zeros(run.path, picked[0], rank=picked[1], model=model, device=device, policy=policy,
                            loss_fn=resolve_loss_fn(loss_fn))
    except PostmortemError as exc:
        if step is not None:
            raise  # the step the user named: a wrong one is theirs to fix (exit 2)
        # The bundle chosen for them (e.g. recorded without autocast): said, the rest of the answer stands.
        report.run.setdefault("warnings", []).append(f"the gradient zeros of step {picked[0]} could not be "
                                                     f"replayed: {exc}")
        return None


def _verify_update_remedies(report, run, model, rank, device, policy, loss_fn, loss=None):
    """The lost updates' remedies re-run over the saved window
    (`whatif/update_trials.py`), put into the finding (`apply_update_checks`)."""
    from .analyses.summary import apply_update_checks
    from .analyses.updates import lost_updates
    from .replaying.model_spec import resolve_loss_fn
    from .whatif.update_trials import verify_update_remedies
    checks = verify_update_remedies(run, lost_updates(run), model=model, rank=rank, device=device, policy=policy,
                                    loss_fn=resolve_loss_fn(loss_fn), loss=loss)
    apply_update_checks(report, run, checks)


def _decide_precision(report, run, model, rank, device, policy, loss_fn, loss=None):
    """Precision or instability by the float32 re-run of the saved window
    (`whatif/verdict.py`), put into the summary (`apply_verdict`)."""
    import shlex
    from .analyses.instability import find_instability
    from .analyses.summary import apply_verdict
    from .replaying.model_spec import resolve_loss_fn
    from .whatif.verdict import decide
    unstable = find_instability(run)
    verdict = decide(run, report.precision_verdict.failure_step, model=model, rank=rank, device=device,
                     policy=policy, loss_fn=resolve_loss_fn(loss_fn), loss=loss)
    apply_verdict(report, verdict, unstable, shlex.quote(str(run.path)))


def watch(run, *, rank: int | None = None, fail_on="critical", interval: float = 2.0, window: int = 1000,
          wait_timeout: float = 120.0):
    """Follow a running job's run (`amp-postmortem watch`), a directory or a URI: an
    iterator of each new finding of `summary`, once (`FindingSeen`), then
    how the watch ended (`WatchEnd`, with `exit_code`), at the first finding
    at or above `fail_on` (a severity such as "critical", or finding kinds;
    None: never), when the job closes its recording, or when recording
    stops. `interval`: seconds between looks; `window` as for `summary`;
    `wait_timeout`: seconds to wait for a run that does not exist yet (a
    job that has just started), then RunNotFoundError.
    On a store, alerts wait for the step's shard pair to be uploaded, and
    the watch never ends with `job_gone`. See `analyses/watch.py`."""
    from .analyses.watch import watch_run
    from .errors import OptionError
    if not interval > 0:
        raise OptionError(f"interval {interval!r} is not a positive number of seconds (e.g. 2)")
    if not wait_timeout >= 0:
        raise OptionError(f"wait_timeout {wait_timeout!r} is not a number of seconds >= 0 (e.g. 120)")
    return watch_run(_local(run), rank=rank, fail_on=fail_on, window=window, interval=interval,
                     wait_timeout=wait_timeout)


def nans(run, *, rank: int | None = None, from_step: int | None = None, to_step: int | None = None,
         engine: str = "local", scheduler: str | None = None, model=None, step: int | None = None,
         device: str = "cpu", policy: str = "recorded", loss_fn=None, progress=None):
    """Layers by first NaN/Inf and the origins (`amp-postmortem nans`). With
    `model` (and `step`, `device`, `policy`, `loss_fn` as for `replay`), a
    run with a NaN/Inf replays a saved bundle and adds the op origin
    (`op_origin`: `replaying/run_origin.py`); without it nothing is replayed."""
    from .analyses.nans import find_nans
    r = load_run(_replayable(run, model), rank=rank, engine=engine, scheduler=scheduler, progress=progress)
    with _engine_of(r):
        report = find_nans(r, from_step=from_step, to_step=to_step)
        if report.first_nonfinite_step is not None:
            forward = report.origins.get("forward")
            report.op_origin = _op_origin(r, model, step, rank, forward.step if forward else None, device,
                                          policy, loss_fn)
        return _result(report, r)


def scale(run, *, rank: int | None = None, engine: str = "local", scheduler: str | None = None,
          progress=None):
    """Loss-scale dynamics (`amp-postmortem scale`)."""
    from .analyses.scale import scale_dynamics
    r = load_run(run, rank=rank, engine=engine, scheduler=scheduler, progress=progress)
    with _engine_of(r):
        return _result(scale_dynamics(r), r)


def ranges(run, *, rank: int | None = None, window: int = 1000, engine: str = "local",
           scheduler: str | None = None, progress=None):
    """float16 headroom, trend and underflow per layer over the last
    `window` recorded steps, those with module rows (0: the whole run)
    (`amp-postmortem ranges`)."""
    from .analyses.ranges import layer_ranges
    r = load_run(run, rank=rank, engine=engine, scheduler=scheduler, progress=progress)
    with _engine_of(r):
        return _result(layer_ranges(r, window=window or None), r)


def compare(run_a, run_b, *, rank: int | None = None, threshold: float = 0.1, persist: int = 3, progress=None):
    """Where two runs part (`amp-postmortem compare`)."""
    from .analyses.compare import compare_runs
    a = load_run(run_a, rank=rank, progress=progress)
    b = load_run(run_b, rank=rank, progress=progress)
    return _result(compare_runs(a, b, threshold=threshold, persist=persist), a, b)


# ------------------------------------------------------- replay commands
# `model`: a spec (`package.module:factory` or `path/to/file.py:factory`), an
# `nn.Module`, a no-argument factory, or "recorded" (the recorded class, from
# installed code only). None is an error saying so: a run's data never picks
# the code a replay runs.
# `loss_fn(output, micro_batch)`: a callable or a spec naming one; gives the
# losses (and a finite backward start) when the model does not return its loss.

def replay(run, *, step: int | None = None, rank: int | None = None, model=None, device: str = "cpu",
           precisions=PRECISIONS, policy: str = "recorded", anomaly: bool = False, loss_fn=None, trace=()):
    """Replay a saved step per precision and name the culprit (`amp-postmortem
    replay`). `run` may also be a bundle directory or a loaded `Bundle`.
    `step`: the bundle's step; None: the bundle of the first failure
    (`analyses.bundle_choice.choose_bundle`), said in the result
    (`bundle_choice`). `trace`: module names to trace op by op besides the
    culprit (`--trace`). A Keras or Flax run replays in its own framework
    (`framework_replay`: float32 the reference, the layer whose own
    arithmetic breaks named); its framework is imported only then."""
    _check_device(device)
    from .framework_replay import bundle_framework
    if bundle_framework(getattr(run, "path", run), step, rank) is not None:
        return _framework_replay(run, step=step, rank=rank, model=model, precisions=precisions, policy=policy,
                                 anomaly=anomaly, loss_fn=loss_fn, trace=trace)
    from .replaying import replay as run_replay
    from .replaying.model_spec import resolve_loss_fn
    source = _source(run)
    step, rank, choice = _first_failure_bundle(source, step, rank)
    result = run_replay(source, step, rank=rank, model=model, device=device, precisions=precisions,
                        policy=policy, anomaly=anomaly, loss_fn=resolve_loss_fn(loss_fn), trace=trace)
    result.bundle_choice = choice
    return _result(result)


def _first_failure_bundle(source, step, rank):
    """(step, rank, the `choose_bundle` choice): without a step, a run's
    first failure's bundle (`replay` says so); else as given, no choice."""
    if step is not None or not _is_run(source):
        return step, rank, None
    from .analyses.bundle_choice import choose_bundle
    from .errors import BundleError
    choice = choose_bundle(load_run(source, rank=rank), rank)
    if choice is None:
        raise BundleError(f"no replay bundles in {source} (nothing under bundles/): the recorder saves one "
                          f"at a failing step; give a bundle directory, or record with bundles")
    return choice.bundle.step, choice.bundle.rank, choice


def _framework_replay(run, *, step, rank, **options):
    from .framework_replay import replay_array_bundle
    source = _path(run)
    step, rank, choice = _first_failure_bundle(source, step, rank)
    result = replay_array_bundle(source, step, rank=rank, **options)
    result.bundle_choice = choice
    return _result(result)


def fix(run, *, step: int, rank: int | None = None, model=None, device: str = "cpu", policy: str = "recorded",
        precision: str | None = None, loss_fn=None, max_candidates: int = 12, max_set: int = 4, progress=None,
        loss=None):
    """What kept in float32 saves the step (`amp-postmortem fix`): the
    culprit's op at its source line first (`op_fix`), then modules (`fix`,
    `patch`), ranked by their float32 work (`remedies`). `precision` (fp16,
    bf16; default: the recorded one) asks what a step recorded without
    autocast would do in it. The cheapest remedy is re-run over the saved
    window (`window_check`); `loss`: the loop's loss there, as for `rerun`."""
    _check_device(device, precision)
    from .replaying.model_spec import resolve_loss_fn
    from .whatif.fix import find_fix
    return _result(find_fix(_source(run), step, rank=rank, model=model, device=device, policy=policy,
                            precision=precision, loss_fn=resolve_loss_fn(loss_fn), max_candidates=max_candidates,
                            max_set=max_set, progress=progress, loss=_loop_loss(loss)))


def bisect(run, *, step: int, rank: int | None = None, model=None, device: str = "cpu", policy: str = "recorded",
           precision: str | None = None, loss_fn=None, keep_fp32=(), max_replays: int = 256, progress=None):
    """Which samples of the saved batch make the step fail (`amp-postmortem
    bisect`); `keep_fp32` replays with those modules kept in float32."""
    _check_device(device, precision)
    from .replaying.model_spec import resolve_loss_fn
    from .whatif.bisect import bisect_samples
    return _result(bisect_samples(_source(run), step, rank=rank, model=model, device=device, policy=policy,
                                  precision=precision, loss_fn=resolve_loss_fn(loss_fn),
                                  fp32_modules=_names(keep_fp32), max_replays=max_replays, progress=progress))


def scale_window(run, *, step: int | None = None, rank: int | None = None, model=None, device: str = "cpu",
                 policy: str = "recorded", precision: str | None = None, loss_fn=None, scales=(-16, 40),
                 max_underflow: float = 0.05, keep_fp32=(), progress=None, loss=None):
    """The safe loss-scale window (`amp-postmortem scale-window`): replayed
    at every scale 2^k, k in `scales` = (min, max), when `model` is given
    (with `step`), and estimated from the recorded statistics whenever `run`
    is a run (no torch). The replayed window's settings are re-run over the
    saved window (`window_check`); `loss`: the loop's loss there, as for
    `rerun`."""
    from .errors import OptionError
    from .whatif.scale_window import ScaleWindowReport
    lo, hi = (int(k) for k in scales)
    if lo > hi:
        raise OptionError(f"scales {lo}:{hi} is an empty range; give MIN:MAX with MIN <= MAX (e.g. -16:40)")
    is_run = _is_run(run)
    replayed = estimate = opened = None
    if is_run or model is None:
        opened = load_run(run, rank=rank, progress=progress)
    if model is not None:
        _check_device(device, precision)
        if step is None and is_run:
            raise OptionError("a replay (--model) needs the step of a saved bundle: give --step N")
        from .replaying.model_spec import resolve_loss_fn
        from .whatif.scale_result import recorded_loss_dtype
        from .whatif.scale_window import replay_scale_window
        loss_dtype = recorded_loss_dtype(opened, step)[0] if opened is not None else None
        replayed = replay_scale_window(_source(run), step, rank=rank, model=model, device=device, policy=policy,
                                       precision=precision, loss_fn=resolve_loss_fn(loss_fn),
                                       fp32_modules=_names(keep_fp32), scales=(lo, hi),
                                       max_underflow=max_underflow, progress=progress, verify=True,
                                       loss_dtype=loss_dtype, loss=_loop_loss(loss))
    if opened is not None:
        from .whatif.scale_estimate import estimate_scale_window
        estimate = estimate_scale_window(opened, step, scales=(lo, hi), max_underflow=max_underflow)
    return _result(ScaleWindowReport(replay=replayed, estimate=estimate), *([opened] if opened else []))


def recommend(run, *, rank: int | None = None, model=None, step: int | None = None, device: str = "cpu",
              policy: str = "recorded", loss_fn=None, progress=None, loss=None):
    """What to change, with evidence (`amp-postmortem recommend`): from the
    recorded statistics, or from what-if replays of a bundle when `model`
    is given (`step`, else `analyses.bundle_choice.pick_bundle`'s), each
    remedy re-run over the saved window; `loss`: the loop's loss there, as
    for `rerun`."""
    from .advice import recommend as advise
    if model is not None:
        _check_device(device)
        from recorders.format.locations import is_uri
        if is_uri(run):
            run = _path(run)  # the replays read the bundles from a local copy
    r = load_run(run, rank=rank, progress=progress)
    if loss_fn is not None:
        from .replaying.model_spec import resolve_loss_fn
        loss_fn = resolve_loss_fn(loss_fn)
    return _result(advise(r, model=model, step=step, rank=rank, device=device, policy=policy, loss_fn=loss_fn,
                          progress=progress, loss=_loop_loss(loss) if model is not None else None), r)


def _loop_loss(loss):
    """`loss` (a `--loss` spec or a callable) checked to load, the one way
    `rerun` loads it (`whatif.rerun.resolve_loss`: a wrong spec is said at
    once), and passed on as given: a spec's words stay in the commands the
    answers print."""
    if loss is not None:
        from .whatif.rerun import resolve_loss
        resolve_loss(loss)
    return loss


def rerun(run, *, from_step: int | None = None, steps: int | None = None, rank: int | None = None, model=None,
          precision: str = "recorded", keep_fp32=(), init_scale: float | None = None, lr_scale: float = 1.0,
          device: str = "cpu", policy: str = "recorded", loss_fn=None, optimizer=None, loss=None,
          param_dtype: str | None = None, update_rounding: str = "nearest"):
    """Re-run the saved window of steps under a remedy (`amp-postmortem
    rerun`): from `from_step` (default: the window's first) for `steps`
    steps (default: to its end) in `precision` (recorded, fp64, fp32,
    bf16, fp16), `keep_fp32` modules in float32, from loss scale
    `init_scale`, the learning rate times `lr_scale`. Per step: finite or
    not, the loss vs the recorded loss, skipped. `optimizer`: a spec or
    `factory(model)` for an optimizer outside the rebuilt torch.optim ones.
    `loss`: the loss the loop computes outside the model (a callable, or
    `path/to/file.py:name`), called as the loop called it on the targets
    the window kept (recorded with `AmpRecorder(..., loss_fn=criterion)`).
    `param_dtype`: `recorded` (the dtypes the window saved the parameters
    in) or `float32` (master weights); None: float32 in a fp32/fp64
    re-run, else recorded. `update_rounding`: `nearest` or `stochastic`
    (the bfloat16/float16 parameters' updates rounded stochastically).
    Each step and the result say the share of the updates that left those
    parameters unchanged (`lost_share`)."""
    _check_device(device)
    from .replaying.model_spec import resolve_factory, resolve_loss_fn
    from .whatif.rerun import rerun_window
    if isinstance(optimizer, str):
        optimizer = resolve_factory(optimizer, what="optimizer spec")
    return _result(rerun_window(_path(run), from_step=from_step, steps=steps, rank=rank, model=model,
                                precision=precision,
                                keep_fp32=_names(keep_fp32 if isinstance(keep_fp32, str) else ",".join(keep_fp32)),
                                init_scale=init_scale,
                                lr_scale=lr_scale, device=device, policy=policy, loss_fn=resolve_loss_fn(loss_fn),
                                optimizer=optimizer, loss=loss, param_dtype=param_dtype,
                                update_rounding=update_rounding))


# ------------------------------------------------------------- pictures
def report(run, *, rank: int | None = None, output=None, replay=None, progress=None):
    """Write one self-contained HTML report (`amp-postmortem report`):
    findings, loss and scale, headroom heatmaps, the first-NaN spread.
    `output`: the HTML file (default `<run name>-report.html` here);
    `replay`: a file written by `replay --json`, charted per module. Needs
    the `report` extra (plotly)."""
    from .reporting import report as write, require_plotly
    require_plotly()  # before the run is read: the missing extra is the first thing to say
    r = load_run(run, rank=rank, progress=progress)
    return _result(write(r, output=output, replay=replay), r)


def export_tensorboard(run, *, logdir, rank: int | None = None, progress=None):
    """Write the run to TensorBoard (`amp-postmortem export tensorboard`):
    scalars (loss, scale, grad norm, skipped; per layer absmax and
    headroom), per step and kind a histogram of the layers' log2 absmax,
    the findings as text. Needs the `report` extra (tensorboard)."""
    from .export import export_tensorboard as write, require_tensorboard
    require_tensorboard()
    r = load_run(run, rank=rank, progress=progress)
    return _result(write(r, logdir), r)


def export_mlflow(run, *, tracking_uri=None, experiment: str | None = None, rank: int | None = None,
                  progress=None):
    """Log the run to MLflow (`amp-postmortem export mlflow`): loss, scale,
    grad norm, skipped; per layer headroom; the findings as tags and the
    table artifact findings.json. Needs the `mlflow` (or `report`) extra."""
    from .export_tracking import export_mlflow as write, require_mlflow
    require_mlflow()
    r = load_run(run, rank=rank, progress=progress)
    return _result(write(r, tracking_uri=tracking_uri, experiment=experiment), r)


def export_wandb(run, *, project: str | None = None, offline: bool = False, directory=None,
                 rank: int | None = None, progress=None):
    """Log the run to W&B (`amp-postmortem export wandb`): the metrics of
    `export_mlflow`, the findings as tags, summary keys and a table;
    `offline` (or WANDB_MODE=offline) writes it for `wandb sync`. Needs the
    `wandb` extra."""
    from .export_tracking import export_wandb as write, require_wandb
    require_wandb()
    r = load_run(run, rank=rank, progress=progress)
    return _result(write(r, project=project, offline=offline, directory=directory), r)


# ------------------------------------------------------------ recording
def record(command, *, run=None, mode: str | None = None, include=(), exclude=(), options=None,
           loss: str | None = None) -> int:
    """Run a training script with an `AmpRecorder` attached to the model,
    optimizer and GradScaler it builds (`amp-postmortem record -- python
    train.py ARGS`), no edit to it; the script's exit code. `command`:
    `["python", "train.py", *args]` (or `-m module`); `run`: the run
    directory (default `runs/<script>-<time>`); `mode`, `include`,
    `exclude`, `options` (`{keyword: literal}`): `AmpRecorder`'s keywords;
    `loss`: the loss the loop computes outside the model (`criterion`, a
    name at the script's top level, or `package.module:function`), its
    `loss_fn`. See `record_script.py` and `recorders/attach.py`."""
    from .record_script import record as run_recorded
    return run_recorded(command, run=run, mode=mode, include=include, exclude=exclude, options=options,
                        loss=loss)


# ----------------------------------------------------------------- helpers
def _result(report, *runs):
    """The command's result with the loaders' `warnings` of `runs` set
    (`result.CommandResult`): its `to_dict()` is then exactly the document
    `--json` prints."""
    report.warnings = []
    for r in runs:
        report.warnings.extend(w for w in r.warnings if w not in report.warnings)
    return report


def _local(run):
    """A run given as a path or a loaded `Run`: its location."""
    return getattr(run, "path", run)


def _path(run):
    """A local directory: a remote run (a URI) is copied to the local cache
    first, since the replays read bundles from disk."""
    from pathlib import Path

    from recorders.format.locations import is_uri
    location = getattr(run, "path", run)
    if is_uri(location) or _loaded(location, "amp_postmortem.reading.store", "StorePath"):
        from .reading.store import local_copy
        return local_copy(str(location))
    return Path(location)


def _replayable(run, model):
    """The run as given; with a model, a remote run is copied here first
    (the replay reads its bundles from disk)."""
    if model is None:
        return run
    from recorders.format.locations import is_uri
    return _path(run) if is_uri(run) else run


def _op_origin(run, model, step, rank, forward_step, device, policy, loss_fn):
    """`run_origin.op_origin_of_run(...).to_dict()` with a model; None (and
    no import of torch) without one."""
    if model is None:
        return None
    _check_device(device)
    from .replaying.model_spec import resolve_loss_fn
    from .replaying.run_origin import op_origin_of_run
    return op_origin_of_run(run, model=model, step=step, rank=rank, forward_step=forward_step, device=device,
                            policy=policy, loss_fn=resolve_loss_fn(loss_fn)).to_dict()


def _engine_of(run):
    """Closes the engine (a Dask client this call connected) when the
    command is done."""
    import contextlib
    return contextlib.closing(run.engine)


def _loaded(run, module: str, cls: str) -> bool:
    """Whether `run` is a `cls` of `module`, without importing it (if the
    module was never imported, `run` cannot be one)."""
    mod = sys.modules.get(module)
    return mod is not None and isinstance(run, getattr(mod, cls))


def _source(run):
    """What the replays take: a loaded bundle as is, else a directory."""
    return run if _loaded(run, "amp_postmortem.reading.bundle", "Bundle") else _path(run)


def _is_run(run) -> bool:
    from recorders.format import schema
    from recorders.format.locations import is_uri
    if _loaded(run, "amp_postmortem.reading.loader", "Run"):
        return True
    if is_uri(run):
        from .reading.store import run_location
        return (run_location(run) / schema.MANIFEST_FILE).is_file()
    return (_path(run) / schema.MANIFEST_FILE).is_file()


def _check_device(device: str, precision: str | None = None) -> None:
    """Values the replays would only fail on later, named now."""
    from .errors import DeviceError, PrecisionError
    if device not in DEVICES:
        raise DeviceError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    if precision is not None and precision not in REDUCED_PRECISIONS:
        raise PrecisionError(f"precision {precision!r} is not one of {', '.join(REDUCED_PRECISIONS)} "
                             "(the what-ifs replay a reduced precision)")


def _names(modules) -> tuple:
    """Module names from a list or a comma-separated string."""
    if isinstance(modules, str):
        modules = modules.split(",")
    return tuple(m.strip() for m in modules if m.strip())

