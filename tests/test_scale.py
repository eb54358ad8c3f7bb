"""Loss-scale dynamics on recorded runs and on synthetic series."""
import numpy as np
import pandas as pd
import pytest

from amp_postmortem.analyses.scale import ScaleStatus, scale_dynamics, two_segment_breakpoint
from amp_postmortem.reading.loader import Run, load_run

from conftest import COLLAPSE_ONSET, COLLAPSE_STEPS, TINY_SCALE, _collapse, record_run


def test_collapse_with_known_onset(collapse_run):
    rep = scale_dynamics(load_run(collapse_run))
    assert rep.status is ScaleStatus.COLLAPSE
    assert abs(rep.onset_step - COLLAPSE_ONSET) <= 3
    # the first step whose scale fell (41 grew, 42 backed off): the data's onset
    assert rep.onset_step == 42
    # the gradient through `amp` doubles every 2 steps: one halving per 2 steps
    assert rep.halvings_per_kstep == pytest.approx(500.0)
    assert rep.drivers[0] == "amp" and rep.driver_steps["amp"] == 18
    assert rep.final_scale == 0.5
    assert (rep.skipped_steps, rep.longest_skip_streak, rep.growths, rep.backoffs) == (21, 1, 4, 21)
    # before the onset only growth probes skip (2 of 42 steps), after it every other step
    assert rep.skip_rate_before_onset == pytest.approx(2 / 42)
    assert rep.skip_rate_after_onset == pytest.approx(19 / 38)
    assert rep.projected_underflow_step == 99
    assert rep.underflow_scale < rep.final_scale


def test_json_contract(collapse_run):
    d = scale_dynamics(load_run(collapse_run)).to_dict()
    assert {"status", "onset_step", "halvings_per_kstep", "skipped_steps", "skip_rate",
            "longest_skip_streak", "final_scale", "drivers"} <= set(d)
    assert d["drivers"] == ["amp", "<loss>"]
    assert d["status"] == "collapse"  # the enum's value: the --json string


def test_healthy_run(healthy_run):
    rep = scale_dynamics(load_run(healthy_run))
    assert rep.status is ScaleStatus.HEALTHY and rep.onset_step is None
    assert rep.final_scale == 65536.0


def test_tiny_fixed_scale_is_stuck_low(underflow_run):
    rep = scale_dynamics(load_run(underflow_run))
    assert rep.status is ScaleStatus.STUCK_LOW
    assert rep.final_scale == TINY_SCALE and rep.skipped_steps == 0


def test_one_forward_overflow_is_not_a_scale_problem(overflow_run):
    rep = scale_dynamics(load_run(overflow_run))
    assert rep.status is ScaleStatus.HEALTHY
    assert rep.drivers == ["block.boom"]  # the skipped step's overflow was made in the forward


@pytest.fixture(scope="module")
def no_scaler_run(tmp_path_factory):
    return record_run(tmp_path_factory.mktemp("runs") / "no_scaler", steps=3,
                      scaler_kwargs={"enabled": False})


def test_no_scaler(no_scaler_run):
    rep = scale_dynamics(load_run(no_scaler_run))
    assert rep.status is ScaleStatus.NO_SCALER and rep.final_scale is None and rep.drivers == []


def _run(scales_before, scales_after, skipped, **scaler):
    n = len(scales_before)
    steps = pd.DataFrame({"step": np.arange(n), "rank": 0, "loss_scale_before": scales_before,
                          "loss_scale": scales_after, "skipped": skipped, "tensor_rows": 0,
                          "nonfinite_param_grads": 0, "loss_nonfinite": False})
    config = {"enabled": True, "init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
              "growth_interval": 2000, **scaler}
    return Run(path=".", manifest={"scaler": config}, rank_manifests={}, ranks=[0], loaded_steps=steps,
               tensor_shards=[])


def _simulate(overflows, init=65536.0, interval=2000):
    """GradScaler's rule: back off on overflow, grow after `interval` clean steps."""
    scale, tracker, before, after = init, 0, [], []
    for bad in overflows:
        before.append(scale)
        if bad:
            scale, tracker = scale / 2, 0
        else:
            tracker += 1
            if tracker == interval:
                scale, tracker = scale * 2, 0
        after.append(scale)
    return before, after, list(overflows)


def test_calibration_of_a_fresh_scaler_is_not_a_collapse():
    rep = scale_dynamics(_run(*_simulate([True] * 6 + [False] * 60)))
    assert rep.status is ScaleStatus.HEALTHY and rep.calibration_steps == 6 and rep.skipped_steps == 6
    # The calibration's halvings are no back-offs from a scale that worked.
    assert rep.backoffs == 0 and "0 backoff(s) after 6 calibration skip(s)" in rep.reason


def test_growth_blocked():
    before = [1024.0] * 50
    rep = scale_dynamics(_run(before, before, [False] * 50, init_scale=1024.0, growth_interval=10))
    assert rep.status is ScaleStatus.GROWTH_BLOCKED


def test_frequent_real_overflows_pin_the_scale():
    # two growths, then a probe skip and a real overflow, over and over: no
    # trend, but one step in six lost to an overflow that is not a probe
    flags = [False, False, False, False, True, True] * 12
    rep = scale_dynamics(_run(*_simulate(flags, init=1024.0, interval=2), init_scale=1024.0,
                              growth_interval=2))
    assert rep.status is ScaleStatus.STUCK_LOW and "not growth probes" in rep.reason


def test_growth_probes_alone_are_healthy():
    flags = [False, False, True] * 20  # every skip follows a growth (growth_interval 2)
    rep = scale_dynamics(_run(*_simulate(flags, init=1024.0, interval=2), init_scale=1024.0,
                              growth_interval=2))
    assert rep.status is ScaleStatus.HEALTHY


def test_steady_halving_series_is_a_collapse_with_the_right_onset():
    flags = [False] * 100 + [i % 4 == 0 for i in range(100)]
    rep = scale_dynamics(_run(*_simulate(flags, init=2.0 ** 15), init_scale=2.0 ** 15))
    assert rep.status is ScaleStatus.COLLAPSE
    assert abs(rep.onset_step - 100) <= 3
    assert rep.halvings_per_kstep == pytest.approx(250.0)
    assert rep.skip_rate_before_onset == 0.0


def test_collapse_at_the_end_of_a_long_sawtooth():
    # growth and backoff every 100 steps for 1000 steps, then 10 backoffs in a row
    before, after = [], []
    scale = 2.0 ** 16
    for step in range(1010):
        before.append(scale)
        if step >= 1000 or step % 200 == 199:
            scale /= 2
        elif step % 200 == 99:
            scale *= 2
        after.append(scale)
    skipped = [a < b for a, b in zip(after, before)]
    rep = scale_dynamics(_run(before, after, skipped, init_scale=2.0 ** 16, growth_interval=100))
    assert rep.status is ScaleStatus.COLLAPSE and 998 <= rep.onset_step <= 1001
    assert rep.longest_skip_streak == 11 and rep.longest_skip_streak_start == 999  # 999 is a sawtooth backoff


def test_two_segment_breakpoint():
    x = np.arange(60, dtype=float)
    y = np.where(x < 30, 10.0, 10.0 - 0.5 * (x - 30))
    assert two_segment_breakpoint(x, y) in (30, 31)
    assert two_segment_breakpoint(x[:4], y[:4]) is None


@pytest.fixture(scope="module")
def collapse_past_underflow_run(tmp_path_factory):
    """The collapse of `collapse_run`, recorded for 40 steps longer: the
    scale falls below the level at which the gradients underflow before the
    run ends."""
    return record_run(tmp_path_factory.mktemp("runs") / "scale_collapse_past_underflow",
                      steps=COLLAPSE_STEPS + 40, plant=_collapse, scaler_kwargs={"growth_interval": 10},
                      lr=0.0, fixed_batch=True, steps_per_shard=20, full_every=10)


def test_a_crossed_underflow_level_is_reported_where_it_was_crossed(collapse_past_underflow_run):
    run = load_run(collapse_past_underflow_run)
    rep = scale_dynamics(run)
    assert rep.status is ScaleStatus.COLLAPSE and rep.final_scale < rep.underflow_scale
    # already below: the step since which it is, not a "projection" at the last step
    assert rep.projected_underflow_step is None
    assert rep.underflow_reached_step == 100
    scale_after = run.steps.set_index("step")["loss_scale"]
    assert scale_after[rep.underflow_reached_step] < rep.underflow_scale <= scale_after[rep.underflow_reached_step - 1]
    assert (scale_after.loc[rep.underflow_reached_step:] < rep.underflow_scale).all()
    assert "already below the gradient underflow level" in rep.reason
    assert f"since step {rep.underflow_reached_step}" in rep.reason
    d = rep.to_dict()
    assert d["underflow_reached_step"] == 100 and d["projected_underflow_step"] is None


def test_summary_words_a_crossed_underflow_level_as_already_below(collapse_past_underflow_run):
    from amp_postmortem.analyses.summary import summarize
    f = next(f for f in summarize(load_run(collapse_past_underflow_run)).findings if f.kind == "scale_collapse")
    assert "already below the gradient underflow level" in f.message and "reaches" not in f.message
    assert f.evidence["underflow_reached_step"] == 100 and f.evidence["projected_underflow_step"] is None


def test_a_future_crossing_is_projected(collapse_run):
    rep = scale_dynamics(load_run(collapse_run))
    assert rep.underflow_reached_step is None and rep.projected_underflow_step == 99
    assert "at this rate it reaches the gradient underflow level" in rep.reason


def _planted_halvings(path, bad_steps, steps=40, scaler=None):
    """BoomNet under the real recorder and a GradScaler("cpu") (default:
    growth_interval 2000, no growth in 40 steps), its head's weight
    gradient made Inf after the backward of each step in `bad_steps`: the
    scaler skips and halves exactly there, whatever the CPU's kernels."""
    import torch
    from tiny_models import BoomNet, recorder_at, train

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(steps)]

    def plant(step, model):
        if step in bad_steps:
            model.head.weight.grad.mul_(float("inf"))

    train(BoomNet(), data, recorder=recorder_at(path), scaler=scaler or {}, lr=0.01, before_update=plant)
    return load_run(path)


@pytest.mark.parametrize("bad_steps, onset, calibration, scaler", [
    # the overflow grows more frequent: 2 clean steps, then 1, 1, then every step
    ({20, 23, 25, 27} | set(range(28, 40)), 20, 0, None),
    # the same after two calibration skips of the fresh scaler: they are no onset
    ({0, 1, 20, 23, 25, 27} | set(range(28, 40)), 20, 2, None),
    # a lone back-off 10 steps before the run is not part of it
    ({10} | set(range(20, 40)), 20, 0, None),
    # growth every 5 clean steps (4, 9, 14): the back-off at 15 is the growth's probe (back to 1024,
    # where the scale was); the run that falls below starts at 18
    ({15, 18, 20} | set(range(21, 40)), 18, 0, {"init_scale": 256.0, "growth_interval": 5}),
])
def test_the_collapse_onset_is_the_first_planted_halving(tmp_path, one_torch_thread, bad_steps, onset,
                                                         calibration, scaler):
    run = _planted_halvings(tmp_path / "planted", bad_steps, scaler=scaler)
    scale_after = run.steps.set_index("step")["loss_scale"]
    scale_before = run.steps.set_index("step")["loss_scale_before"]
    assert all(scale_after[s] == scale_before[s] / 2 for s in bad_steps)   # each plant took
    rep = scale_dynamics(run)
    assert rep.status is ScaleStatus.COLLAPSE and rep.calibration_steps == calibration
    assert rep.onset_step == onset
    assert f"since step {onset} " in rep.reason
    before = [s for s in range(calibration, onset)]
    assert rep.skip_rate_before_onset == pytest.approx(sum(s in bad_steps for s in before) / len(before))
