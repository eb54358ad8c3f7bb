"""The sentinel (the recorder's default mode): step facts every step, module
rows on sampled steps, no hook on any module but the root on the others, and
the failing step re-executed in the job. Each planted fault is recorded in
both modes, from the same seed; the answers (origin layer, step, kind, the
summary's lead finding) and the training's numbers must be the same."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pandas as pd
import pytest
import torch
from torch import nn

import amp_postmortem as ap
from conftest import OVERFLOW_STEP, _collapse, _input_nan, _overflow, generate_short_sample_runs, record_run
from recorders import AmpRecorder
from recorders.reexecute import ReexecutePolicy
from recorders.schedule import RecordSchedule
from tiny_models import Boom, BoomNet, ConvBN, TinyNet, batches, recorder_at, train

pytestmark = pytest.mark.usefixtures("sentinel_mode")


def _manifest(run) -> dict:
    return json.loads((run / "rank=0" / "manifest.json").read_text())


def _origins(run) -> dict:
    out = ap.nans(run).to_dict()["origins"]
    return {phase: o and {k: o[k] for k in ("name", "kind", "phase", "step")} for phase, o in out.items()}


def _lead(run) -> tuple:
    findings = ap.summary(run).to_dict()["findings"]
    lead = findings[0]
    return lead["kind"], lead["severity"], lead["step"], lead["layer"]


def _both(tmp_path, **kwargs):
    """The same job recorded in both modes: (sentinel run, every-step run)."""
    runs = []
    for mode in ("sentinel", "every_step"):
        runs.append(record_run(tmp_path / mode, mode=mode, **kwargs))
    return runs


SCENARIOS = {
    "forward_overflow": dict(steps=12, plant=_overflow,
                             scaler_kwargs={"init_scale": 2.0 ** 8, "growth_interval": 10 ** 6}),
    "input_nan": dict(steps=6, plant=_input_nan, scaler_kwargs={"init_scale": 2.0 ** 8}),
    "scale_collapse": dict(steps=80, plant=_collapse, scaler_kwargs={"growth_interval": 10}, lr=0.0,
                           fixed_batch=True),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_both_modes_give_the_same_answers(tmp_path, scenario):
    sentinel, every = _both(tmp_path, **SCENARIOS[scenario])
    assert _origins(sentinel) == _origins(every)
    assert _lead(sentinel) == _lead(every)
    steps_s, steps_e = (ap.load_run(r).steps for r in (sentinel, every))
    # The step facts are every step's in both modes, with the same values.
    for col in ("loss", "loss_scale", "skipped", "grad_norm", "nonfinite_param_grads"):
        assert steps_s[col].tolist() == pytest.approx(steps_e[col].tolist(), nan_ok=True), col
    # The sentinel recorded rows of the sampled steps and the re-executed ones only.
    sampled = steps_s[steps_s["tier"].notna()]
    assert set(sampled["step"]) < set(steps_e["step"])
    assert (sampled[~sampled["reexecuted"].astype(bool)]["step"] % RecordSchedule().cheap_every == 0).all()


def test_collapse_onset_and_drivers_match(tmp_path):
    sentinel, every = _both(tmp_path, **SCENARIOS["scale_collapse"])
    a, b = ap.scale(sentinel).to_dict(), ap.scale(every).to_dict()
    for key in ("status", "onset_step", "skipped_steps", "halvings_per_kstep", "final_scale"):
        assert a[key] == b[key], key
    # The drivers come from the skipped steps' rows: every one in the
    # every-step run, the re-executed ones (the first, then the cap's) in the
    # sentinel's; the lead driver is the same.
    assert a["drivers"][0] == b["drivers"][0] == "amp"
    # Each says how many skipped steps its ranking rests on: every one in
    # the every-step run, the re-executed ones in the sentinel's, and the
    # summary qualifies only the sentinel's.
    assert b["driver_recorded_steps"] == b["driver_candidate_steps"] > 0
    assert 0 < a["driver_recorded_steps"] < a["driver_candidate_steps"] == b["driver_candidate_steps"]
    words = {mode: next(f["message"] for f in ap.summary(run).to_dict()["findings"] if f["kind"] == "scale_collapse")
             for mode, run in (("sentinel", sentinel), ("every", every))}
    assert f"read from the {a['driver_recorded_steps']} of its {a['driver_candidate_steps']} skipped steps" \
        in words["sentinel"]
    assert "read from the" not in words["every"]


def test_the_failing_step_is_reexecuted_exactly_and_training_is_untouched(tmp_path):
    runs, params = [], []
    for mode in ("sentinel", "every_step"):
        torch.manual_seed(0)
        model = BoomNet()
        data = batches(12, d_in=4, d_out=1, shape=(16,))
        t = train(model, data, recorder=recorder_at(tmp_path / mode, mode=mode),
                  on_step=_overflow, scaler={"init_scale": 2.0 ** 8})
        runs.append(tmp_path / mode)
        params.append(t.params)
    # Recording must never change the training's numbers.
    assert all(torch.equal(a, b) for a, b in zip(*params))
    entries = _manifest(runs[0])["reexecutions"]
    assert [(e["step"], e["kind"], e["check"]) for e in entries] == [(7, "nonfinite_loss", "exact")]
    assert entries[0]["backward"] is True
    # Which gradients were non-finite: the step's own reduction and the re-execution's rows agree.
    assert entries[0]["recorded_nonfinite_grads"] == entries[0]["reexecuted_nonfinite_grads"] != []
    steps = ap.load_run(runs[0]).steps.set_index("step")
    assert bool(steps.loc[7, "reexecuted"]) and steps.loc[7, "tier"] == "full"
    assert steps.loc[7, "reexecution"] == "exact"
    assert steps.loc[3, "tensor_rows"] == 0 and not isinstance(steps.loc[3, "reexecution"], str)


def test_steps_not_sampled_carry_no_module_hook(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()

    def hooked():
        subs = [m for name, m in model.named_modules() if name]
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in subs) + sum(
            len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    seen = []
    train(model, batches(6), lr=0.01, dtype=None, scaler=None, pass_loss=False,
          recorder=lambda m, o, s: AmpRecorder(tmp_path / "run", m, optimizer=o,
                                               schedule=RecordSchedule(cheap_every=3, full_every=0)),
          loss_fn=lambda model, x, y, step, accumulate: ((model(x) - y) ** 2).mean(),
          on_step=lambda step, model, x: seen.append(hooked()))
    assert [s > 0 for s in seen] == [True, False, False, True, False, False]
    assert hooked() == 0
    steps = ap.load_run(tmp_path / "run").steps
    assert [t if isinstance(t, str) else None for t in steps["tier"]] == ["cheap", None, None, "cheap", None, None]
    assert steps["grad_norm"].notna().all() and (steps["nonfinite_param_grads"] == 0).all()


def _param_grad_rows(run, monkeypatch, by_producers: bool, hooked: list, group: bool = False):
    """TinyNet plus a temperature only the loss uses, two micro-batches a
    step, the full tier at steps 0 and 3, trained through `train` (whose
    `for` loop holds each loss until the next forward: the graphs hand the
    parameters' AccumulateGrad nodes on); `hooked`: the parameters the
    AccumulateGrad hooks were put on; `group`: as if a process group were
    initialised."""
    import recorders.collectors.params as params_mod
    from recorders.hooks import TrainingHooks

    real_hook, real_init = params_mod._accumulator_hook, TrainingHooks.__init__

    def counting(p, hook):
        hooked.append(p)
        return real_hook(p, hook)

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.params.by_producers = by_producers and self.sampled_hooks

    monkeypatch.setattr(params_mod, "_accumulator_hook", counting)
    monkeypatch.setattr(TrainingHooks, "__init__", init)
    if group:
        monkeypatch.setattr(params_mod, "_process_group", lambda: True)
    torch.manual_seed(0)
    model = TinyNet()
    model.temp = nn.Parameter(torch.tensor(0.5))

    def loss_fn(m, x, y, step, accumulate):
        return ((m(x).float() * m.temp - y) ** 2).mean() / accumulate
    train(model, batches(12), accumulate=2, loss_fn=loss_fn,
          recorder=recorder_at(run, schedule=RecordSchedule(cheap_every=3, full_every=3)))
    monkeypatch.undo()
    rows = ap.load_run(run).scan_tensors(kinds=["param_grad"])
    return model, rows.drop(columns=[c for c in rows.columns if "time" in c]).sort_values(["step", "order"])


def test_sampled_steps_find_parameter_gradients_in_the_graph_not_on_their_accumulators(tmp_path, monkeypatch):
    """A hook on a parameter's AccumulateGrad node outlives its removal in
    torch (the node keeps calling an emptied dict), and a loop that holds
    its loss until the next forward hands that node from graph to graph:
    every later backward paid for it. Sampled steps hook the nodes of
    their own graph instead: the same rows, in the same order."""
    hooked: list = []
    model, rows = _param_grad_rows(tmp_path / "graph", monkeypatch, True, hooked)
    # Only the temperature, which the model's graph does not reach, kept
    # the AccumulateGrad hook (once a sampled step).
    assert {id(p) for p in hooked} == {id(model.temp)} and len(hooked) == 2
    before: list = []
    other, want = _param_grad_rows(tmp_path / "accumulators", monkeypatch, False, before)
    assert {id(p) for p in before} == {id(p) for p in other.parameters()}  # as before: every one
    assert sorted(set(rows["step"])) == [0, 3] and "temp" in set(rows["name"])
    assert len(rows) == 2 * len(list(model.parameters()))
    pd.testing.assert_frame_equal(rows.reset_index(drop=True), want.reset_index(drop=True))
    # With a process group, a collective may rewrite `p.grad` before the
    # backward ends (DDP's averaged buckets): every parameter keeps the
    # AccumulateGrad hook, whose rows are the local gradients.
    grouped: list = []
    third, _ = _param_grad_rows(tmp_path / "group", monkeypatch, True, grouped, group=True)
    assert {id(p) for p in grouped} == {id(p) for p in third.parameters()}


def test_a_batchnorm_cnn_is_reexecuted_with_its_running_statistics_restored(tmp_path):
    def plant(step, model, x):
        if step == 5:
            x.mul_(1e5)  # the first conv's output overflows float16
    results = []
    for mode in ("sentinel", "every_step"):
        torch.manual_seed(0)
        model = ConvBN()
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 10, generator=g)) for _ in range(8)]
        t = train(model, data, recorder=recorder_at(tmp_path / mode, mode=mode), on_step=plant,
                  scaler={"init_scale": 2.0 ** 8})
        results.append((t, [b.clone() for b in model.buffers()]))
    (a, buf_a), (b, buf_b) = results
    same = lambda x, y: torch.allclose(x.double(), y.double(), rtol=0, atol=0, equal_nan=True)  # noqa: E731
    assert all(same(x, y) for x, y in zip(a.params, b.params))
    assert all(same(x, y) for x, y in zip(buf_a, buf_b))
    assert _origins(tmp_path / "sentinel") == _origins(tmp_path / "every_step")
    assert _origins(tmp_path / "sentinel")["forward"]["step"] == 5


@pytest.mark.parametrize("facts", ["host", "device"])
def test_without_a_scaler_the_step_is_reexecuted_from_the_held_weights(tmp_path, monkeypatch, facts):
    """No scaler: the optimizer applied the NaN before the event is known;
    the re-execution runs on the weights held before the update, exactly,
    and the answers are every-step recording's; training is untouched.
    `device`: a GPU job's loss and gradient counts are device values
    `rec.step()` never reads; here the CPU's host facts are withheld
    (`host_facts` says None, as for device tensors): each step's row waits
    one step, until its copy is on the host, and is judged then (the
    optimizer has by then stepped twice since the NaN step's forward)."""
    if facts == "device":
        from recorders import reexecute
        monkeypatch.setattr(reexecute, "host_facts", lambda st, loss_t, *, skipped, scale=None: None)

    def plant(step, model, x):
        if step == 4:
            x[0, 0, 0] = float("nan")
    results = []
    for mode in ("sentinel", "every_step"):
        torch.manual_seed(0)
        t = train(TinyNet(), batches(8), recorder=recorder_at(tmp_path / mode, mode=mode), on_step=plant,
                  dtype=torch.bfloat16, scaler=None)
        results.append(t.params)
    assert all(torch.allclose(x, y, equal_nan=True, rtol=0, atol=0) for x, y in zip(*results))
    entry = _manifest(tmp_path / "sentinel")["reexecutions"][0]
    assert (entry["step"], entry["kind"], entry["check"]) == (4, "nonfinite_loss", "exact")
    steps = ap.load_run(tmp_path / "sentinel").steps.set_index("step")
    assert steps.loc[4, "reexecuted"] and steps.loc[4, "reexecution"] == "exact"
    assert steps.index.tolist() == list(range(8))  # every row written, in order, a waiting one too
    assert _origins(tmp_path / "sentinel") == _origins(tmp_path / "every_step")


def test_a_step_judged_clean_a_step_later_gives_its_weight_copy_back_at_once(tmp_path, monkeypatch):
    """Two sets of the weights are kept (`snapshot_params`): a step whose
    row waited for its device facts and showed no event gives its set back
    when judged, not when the writer thread's decision is applied, so the
    next step's snapshot never waits on the writer (here its decisions are
    never applied after the first, sampled, step)."""
    from recorders import reexecute
    monkeypatch.setattr(reexecute, "host_facts", lambda st, loss_t, *, skipped, scale=None: None)
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rec = AmpRecorder(tmp_path / "run", model, optimizer=opt, snapshot_params=True)
    pool = rec.bundles._param_pool
    held = []
    for step, (x, y) in enumerate(batches(6)):
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        rec.step()
        if step == 0:  # sampled, decided by the writer: let it go, then no decision again
            rec.flush()
            monkeypatch.setattr(rec.bundles, "_service", lambda: None)
        held.append(pool.allocated - len(pool.free))
    rec.close()
    # The step just closed holds one set (the judged one gave its own back),
    # and every step had one to take (else two held, the writer's decisions
    # not applied, and a step without weights).
    assert held[1:] == [1, 1, 1, 1, 1] and pool.allocated == 2


@pytest.mark.parametrize("flush", [True, False])
def test_the_last_steps_waiting_row_is_judged_at_flush_and_written_at_close(tmp_path, monkeypatch, flush):
    """Device facts withheld, a NaN in the last step's input: `flush()`
    judges the waiting row and re-executes the step (the job goes on);
    `close()` writes it judged but not re-executed (the hooks are gone)."""
    from recorders import reexecute
    monkeypatch.setattr(reexecute, "host_facts", lambda st, loss_t, *, skipped, scale=None: None)
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rec = AmpRecorder(tmp_path / "run", model, optimizer=opt)
    data = batches(4)
    for step, (x, y) in enumerate(data):
        if step == len(data) - 1:
            x = x.clone()
            x[0, 0, 0] = float("nan")
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        rec.step()
    if flush:
        rec.flush()
    rec.close()
    steps = ap.load_run(tmp_path / "run").steps.set_index("step")
    assert steps.index.tolist() == [0, 1, 2, 3]
    assert bool(steps.loc[3, "reexecuted"]) is flush
    said = steps.loc[3, "reexecution"]
    assert said == "exact" if flush else said is None or said != said  # null: not re-executed


def test_a_step_whose_copy_is_not_on_the_host_a_step_later_goes_undecided():
    """The device more than a step behind: the waiting row is handed on as
    packed (no wait, no re-execution), and counted."""
    from recorders.reexecute import ReexecutePolicy, StepSentinel, _Deferred

    class Pending:
        def __init__(self, step, done):
            self.step, self.event = step, type("Event", (), {"query": lambda self: done})()

    sentinel = StepSentinel(ReexecutePolicy(), None, scaler=None, optimizer=None, losses=None, rows=object())
    first, second = Pending(3, done=False), Pending(4, done=False)
    sentinel._deferring = _Deferred(type("St", (), {"step_id": 3})(), None, False)
    assert sentinel.hand_over(first) == [] and sentinel.waits
    sentinel._deferring = _Deferred(type("St", (), {"step_id": 4})(), None, False)
    assert sentinel.hand_over(second) == [first] and sentinel.undecided == 1
    assert sentinel.release(judge=False) == [second] and not sentinel.waits
    # The manifest names it: the analyzer says why the step has no rows.
    gaps = sentinel.gaps()
    assert (gaps["reexecutions_undecided"], gaps["reexecutions_undecided_steps"]) == (1, [3])


def test_reexecutions_are_capped_on_a_diverging_job(tmp_path):
    def plant(step, model, x):
        x.mul_(1e6 if step >= 2 else 1.0)  # every step from 2 overflows
    torch.manual_seed(0)
    train(TinyNet(), batches(30),
          recorder=recorder_at(tmp_path / "run", reexecute=ReexecutePolicy(min_interval=10)),
          on_step=plant, scaler={"init_scale": 2.0 ** 8})
    m = _manifest(tmp_path / "run")
    # Every step from 2 has a NaN loss: the first, then one per min_interval.
    assert [(e["step"], e["kind"]) for e in m["reexecutions"]] == [
        (2, "nonfinite_loss"), (12, "nonfinite_loss"), (22, "nonfinite_loss")]
    assert m["reexecutions_capped"] == 30 - 2 - 3
    # The first capped events by step (the counts go on past them).
    assert m["reexecutions_capped_steps"] == [*range(3, 12), *range(13, 20)]
    assert m["reexecutions_undecided"] == 0 and m["reexecutions_undecided_steps"] == []


def test_a_failing_step_the_cap_left_says_so(tmp_path):
    """No re-execution allowed at all: the first NaN step has its facts
    only, and `nans` and `summary` say it was the cap, not an unknown."""
    def plant(step, model, x):
        x.mul_(1e6 if step >= 4 else 1.0)
    torch.manual_seed(0)
    train(TinyNet(), batches(12), recorder=recorder_at(tmp_path / "run", reexecute=ReexecutePolicy(max_reexecutions=0)),
          on_step=plant, scaler={"init_scale": 2.0 ** 8})
    m = _manifest(tmp_path / "run")
    assert "reexecutions" not in m and m["reexecutions_capped_steps"][0] == 4
    nans = ap.nans(tmp_path / "run")
    assert nans.to_dict()["first_unrecorded_loss_step_why"] == {"why": "capped", "reason": None,
                                                               "capped": m["reexecutions_capped"], "undecided": 0}
    assert any("re-execution cap" in line for line in nans.lines())
    lead = ap.summary(tmp_path / "run").to_dict()["findings"][0]
    assert lead["step"] == 4 and "re-execution cap" in lead["message"]
    assert lead["evidence"]["not_reexecuted"]["why"] == "capped"


def test_a_failing_step_without_rows_is_critical_with_its_layer_undetermined(tmp_path):
    """No bundles, so nothing to re-execute: the failing step has its step
    facts only. The summary must still lead with it, name no layer, and say
    why, never call the run healthy."""
    def plant(step, model, x):
        model.block.boom.gain = 1e6 if step in (7, 51) else 1.0
    torch.manual_seed(0)
    train(BoomNet(), batches(60, d_in=4, d_out=1, shape=(16,)),
          recorder=recorder_at(tmp_path / "run", bundles=False), on_step=plant,
          scaler={"init_scale": 2.0 ** 8, "growth_interval": 10 ** 6})
    steps = ap.load_run(tmp_path / "run").steps.set_index("step")
    assert bool(steps.loc[7, "skipped"]) and steps.loc[7, "tensor_rows"] == 0
    nans = ap.nans(tmp_path / "run").to_dict()
    assert nans["first_unrecorded_loss_step"] == 7 and nans["unrecorded_loss_steps"] == 2
    assert _lead(tmp_path / "run") == ("nonfinite", "critical", 7, None)
    lead = ap.summary(tmp_path / "run").to_dict()["findings"][0]
    assert "undetermined" in lead["message"] and "not re-executed" in lead["message"]
    assert "re-executes no step" in lead["message"] and lead["evidence"]["not_reexecuted"]["why"] == "off"


def test_every_step_mode_and_the_env_variable(tmp_path, monkeypatch):
    model = TinyNet()
    assert AmpRecorder(tmp_path / "a", model, mode="every_step").schedule.cheap_every == 1
    monkeypatch.setenv("AMP_POSTMORTEM_MODE", "every_step")
    rec = AmpRecorder(tmp_path / "b", model, full_every=7)
    assert (rec.schedule.cheap_every, rec.schedule.full_every) == (1, 7)
    rec.close()
    monkeypatch.delenv("AMP_POSTMORTEM_MODE")
    rec = AmpRecorder(tmp_path / "c", model)
    assert (rec.schedule.cheap_every, rec.schedule.full_every, rec.mode) == (1000, 10000, "sentinel")
    rec.close()
    from recorders.errors import OptionError
    with pytest.raises(OptionError, match="mode="):
        AmpRecorder(tmp_path / "d", model, mode="sometimes")
    with pytest.raises(OptionError, match="reexecute kinds"):
        ReexecutePolicy(kinds=("skipped", "typo"))


def test_sampled_underflow_evidence_says_how_old_it_is(tmp_path):
    """The scale is stuck low for the whole run, but only step 0 is a
    full-tier step: the summary must not say "no gradient underflows now"."""
    from conftest import TINY_SCALE
    run = record_run(tmp_path / "run", steps=80, scaler_kwargs={"init_scale": TINY_SCALE, "growth_interval": 10 ** 9})
    findings = ap.summary(run).to_dict()["findings"]
    lapsed = next(f for f in findings if f["kind"] == "underflow_lapsed")
    assert lapsed["severity"] == "warning" and lapsed["step"] == 0
    assert "now is unknown" in lapsed["message"] and "no gradient underflows now" not in lapsed["message"]


# ------------------------------------------------------ every sample run
@pytest.fixture(scope="module")
def sample_runs_both_ways(tmp_path_factory, short_sample_runs):
    """The sample runs' jobs (sample_runs/generate.py, short schedule)
    recorded in each mode: {mode: folder}. The every-step recording is the
    session's (test_sample_runs reads it too: conftest's scheduler runs both
    on one worker), generated once."""
    sentinel = generate_short_sample_runs(tmp_path_factory.mktemp("samples_sentinel"), "sentinel")
    return {"sentinel": sentinel, "every_step": short_sample_runs}


@pytest.mark.parametrize("name", ["healthy", "attention_overflow", "fp32_baseline", "bad_batch", "scale_collapse",
                                  "fp16_layernorm", "grad_underflow"])
def test_every_sample_run_gets_the_same_answers_in_both_modes(sample_runs_both_ways, name):
    sentinel, every = (sample_runs_both_ways[m] / name for m in ("sentinel", "every_step"))
    assert _origins(sentinel) == _origins(every)
    assert _lead(sentinel)[:3] == _lead(every)[:3]
    assert _lead(sentinel)[3] in (_lead(every)[3], None) if _lead(every)[0] == "scale_collapse" else \
        _lead(sentinel) == _lead(every)


def test_the_ranges_window_counts_the_steps_sampled_not_step_numbers(tmp_path):
    """A sentinel run has module rows on one step in `cheap_every`: the
    window of `ranges` (and so of `summary`) is its last N such steps, so
    headroom trends stay measurable at the sampling's resolution."""
    torch.manual_seed(0)
    run = tmp_path / "run"
    train(TinyNet(), batches(60), recorder=recorder_at(run, schedule=RecordSchedule(cheap_every=10, full_every=0)))
    sampled = ap.load_run(run).steps.query("tensor_rows > 0")["step"].tolist()
    assert sampled == list(range(0, 60, 10))
    report = ap.ranges(run, window=5).to_dict()
    assert report["first_step"] == sampled[-5] == 10 and report["last_step"] == 59
    assert any(r["headroom_trend_per_kstep"] is not None for r in report["layers"])  # five points: a trend
    assert ap.ranges(run, window=6).to_dict()["first_step"] == 0  # no more than six: the whole run
    # Counted in step numbers, the last five steps (55-59) held no row at all.


def test_the_trigger_tells_a_probe_a_collapse_and_a_failure_apart():
    from recorders.reexecute import ReexecuteTrigger, StepFacts
    trigger = ReexecuteTrigger(ReexecutePolicy(min_interval=5))
    seen = []
    scales = [1024.0] * 3 + [2048.0] + [1024.0] * 3 + [512, 256, 128, 64, 32, 16]
    for step, scale in enumerate(scales):
        skipped = step in (3, 7, 8, 9, 10, 11, 12)
        d = trigger.decide(StepFacts(step, skipped=skipped, loss=1.0, grad_norm=1.0, nonfinite_grads=0,
                                     loss_scale=scale))
        seen.append((step, d.kind, d.capped))
    # 3: the skip that answers the growth; 7: a skip; 9: 2048 / 128 = 16: a collapse.
    assert [s for s in seen if s[1]] == [(3, "growth_probe", False), (7, "skipped", False), (8, "skipped", True),
                                         (9, "scale_collapse", False), (10, "scale_collapse", True),
                                         (11, "scale_collapse", True), (12, "scale_collapse", True)]
    assert trigger.decide(StepFacts(13, skipped=True, loss=float("nan"), loss_scale=16.0)).kind == "nonfinite_loss"


def test_the_quiet_steps_test_judges_as_the_rules_do():
    """`decide`'s test for the usual step (one condition) against the rules
    it stands for: a NaN or an Inf loss or norm is never quiet nor
    remembered, a spike still fires once ten values give a median, and the
    scales of quiet steps are remembered for a later skip's judgement."""
    from recorders.reexecute import ReexecuteTrigger, StepFacts
    nan, inf = float("nan"), float("inf")
    trigger = ReexecuteTrigger(ReexecutePolicy(min_interval=1))
    for step in range(12):
        facts = StepFacts(step, loss=1.0, grad_norm=2.0, nonfinite_grads=0, loss_scale=1024.0)
        assert trigger.decide(facts).kind is None
    assert trigger.decide(StepFacts(12, loss=inf, grad_norm=2.0, nonfinite_grads=0)).kind == "nonfinite_loss"
    assert trigger.decide(StepFacts(13, loss=nan, grad_norm=2.0)).kind == "nonfinite_loss"
    # An Inf norm with no count (a device job's row): no event, and not remembered.
    assert trigger.decide(StepFacts(14, loss=1.0, grad_norm=inf)).kind is None
    assert trigger.decide(StepFacts(15, loss=1.0, grad_norm=nan)).kind is None
    assert trigger._norms.limit == 20.0 and inf not in trigger._norms.ranked
    assert trigger.decide(StepFacts(16, loss=1.0, grad_norm=21.0, nonfinite_grads=0)).kind == "spike"
    assert trigger.decide(StepFacts(17, loss=11.0, grad_norm=2.0, nonfinite_grads=0)).kind == "spike"
    assert trigger.decide(StepFacts(18, loss=1.0, grad_norm=2.0, nonfinite_grads=3)).kind == "nonfinite_gradient"
    # The scale quiet steps saw (1024): a skip at 64 is a collapse.
    assert trigger.decide(StepFacts(19, skipped=True, loss=1.0, loss_scale=64.0)).kind == "scale_collapse"
    fresh = ReexecuteTrigger(ReexecutePolicy())
    assert fresh.decide(StepFacts(0, loss=1e300, grad_norm=1e300, nonfinite_grads=0)).kind is None  # no bound yet


def test_the_gradients_the_norms_read_live_to_the_step_end_and_no_longer(tmp_path):
    """The gradients the facts-only step's norms read stay referenced until
    `rec.step()` (the optimizer then finds their Python objects made), and
    not past it: a loop that frees its gradients frees them then."""
    import weakref
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    rec = AmpRecorder(tmp_path / "run", model, optimizer=opt)
    x = torch.randn(4, 8)
    for step in range(3):
        loss = model(x).float().pow(2).mean()
        loss.backward()
        grads = [weakref.ref(p.grad) for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step:  # a step not sampled (step 0 is the full tier's)
            assert all(g() is not None for g in grads)  # kept by the step's state
        rec.step(loss)
        del loss
        assert all(g() is None for g in grads)
    rec.close()


class _Drifting(nn.Module):
    """A module whose output depends on how often it ran: a re-execution
    cannot reproduce its step (as nondeterministic kernels or a faulty
    device would not)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x) * (1.0 + self.calls)


def test_a_step_the_reexecution_cannot_reproduce_is_said_to_differ(tmp_path):
    """A loss spike at step 12 (a finite event) on a module that drifts with
    each call: the re-execution's gradients are not the recorded ones."""
    torch.manual_seed(0)
    train(_Drifting(), batches(14), recorder=recorder_at(tmp_path / "run", snapshot_params=True), scaler=None,
          dtype=None, lr=1e-4, on_step=lambda step, model, x: x.mul_(1e3 if step == 12 else 1.0))
    entry = _manifest(tmp_path / "run")["reexecutions"][0]
    assert (entry["step"], entry["kind"], entry["check"]) == (12, "spike", "differs")
    assert entry["recorded"]["grad_sqsum"] != entry["reexecuted"]["grad_sqsum"]
    steps = ap.load_run(tmp_path / "run").steps.set_index("step")
    assert steps.loc[12, "reexecution"] == "differs" and bool(steps.loc[12, "reexecuted"])
    # The mismatch is a finding of its own, and `nans` says those rows are no evidence.
    found = {f["kind"]: f for f in ap.summary(tmp_path / "run").to_dict()["findings"]}
    differs = found["reexecution_differs"]
    assert (differs["severity"], differs["step"]) == ("warning", 12)
    assert [(m["step"], m["kind"]) for m in differs["evidence"]["mismatches"]] == [(12, "spike")]
    assert "healthy" not in found
    nans = ap.nans(tmp_path / "run")
    assert nans.to_dict()["reexecution_differs_steps"] == [12]
    assert any("did not reproduce" in line for line in nans.lines())


class _NanOnReexecution(nn.Module):
    """Makes a NaN in `mid` on the second forward of a batch scaled up
    1000-fold (the training's forward is the first, the step's
    re-execution the second): a NaN the step as it ran never had."""

    def __init__(self):
        super().__init__()
        self.fc1, self.mid, self.fc2 = nn.Linear(8, 8), _Poison(), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(self.mid(self.fc1(x), x.abs().max() > 100))


class _Poison(nn.Module):
    def __init__(self):
        super().__init__()
        self.spiked = 0

    def forward(self, h, spiked):
        if spiked:
            self.spiked += 1
            if self.spiked == 2:
                return h * float("nan")
        return h


def test_a_nan_only_the_reexecution_made_is_no_failure_of_the_training(tmp_path):
    """A loss spike (a finite event) whose re-execution makes a NaN the step
    never had: `nans` calls that origin not reproduced, the summary names
    the mismatch and no non-finite failure."""
    torch.manual_seed(0)
    train(_NanOnReexecution(), batches(14), recorder=recorder_at(tmp_path / "run", snapshot_params=True),
          scaler=None, dtype=None, lr=1e-4, on_step=lambda step, model, x: x.mul_(1e3 if step == 12 else 1.0))
    entry = _manifest(tmp_path / "run")["reexecutions"][0]
    assert (entry["step"], entry["kind"], entry["check"]) == (12, "spike", "differs")
    fwd = ap.nans(tmp_path / "run").to_dict()["origins"]["forward"]
    assert (fwd["name"], fwd["step"], fwd["basis"], fwd["certain"]) == ("mid", 12, "not_reproduced", False)
    assert any("did not reproduce the step" in line for line in ap.nans(tmp_path / "run").lines())
    kinds = [f["kind"] for f in ap.summary(tmp_path / "run").to_dict()["findings"]]
    assert "reexecution_differs" in kinds and "nonfinite" not in kinds


class _FailsOnReexecution(nn.Module):
    """Raises in the second forward of a batch scaled up 1000-fold (the
    first is the training's, the second the step's re-execution), after its
    first layer ran: that layer's full-tier rows are staged by then."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)
        self.spiked = 0

    def forward(self, x):
        h = self.fc1(x)
        if x.abs().max() > 100:
            self.spiked += 1
            if self.spiked == 2:
                raise RuntimeError("planted failure in the re-execution")
        return self.fc2(h)


def test_a_reexecution_that_raises_leaves_no_row_staged_for_the_next_step(tmp_path):
    """A spike at step 12 is re-executed, and the re-execution raises after
    `fc1`'s rows were staged. The step says `failed`, training goes on, and
    nothing of the aborted run stays staged (its rows took their values
    into its own state, not the next step's)."""
    torch.manual_seed(0)
    staged_after = {}

    def after_step(step, rec):
        staged_after[step] = rec.hooks.shared.staged

    train(_FailsOnReexecution(), batches(16), recorder=recorder_at(tmp_path / "run", snapshot_params=True),
          scaler=None, dtype=None, lr=1e-4, on_step=lambda step, model, x: x.mul_(1e3 if step == 12 else 1.0),
          after_step=after_step)
    entry = _manifest(tmp_path / "run")["reexecutions"][0]
    assert (entry["step"], entry["kind"], entry["check"], entry["reason"]) == (12, "spike", "refused", "failed")
    assert "planted failure" in entry.get("detail", "")
    assert staged_after[12] is False and not any(staged_after.values())
    steps = ap.load_run(tmp_path / "run").steps
    assert steps["step"].tolist() == list(range(16))


class _TiedLM(nn.Module):
    """A language model whose output layer shares the embedding's weight."""

    def __init__(self, vocab: int = 32, width: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.out = nn.Linear(width, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(torch.tanh(self.mix(self.emb(idx))))


TIED_STEP = 5


def _tied_loss(model, x, y, step, accumulate):
    return nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def _grow_tied_weight(step, model, x):
    # From TIED_STEP on the tied weight is 100x: the forward stays finite
    # (|logits| <= 16 * 100), the scaled gradient reaching the float16 logits
    # too (<= 2^16 / 32), but the output layer's own backward, that gradient
    # times the weight summed over the vocabulary, overflows float16 first.
    if step == TIED_STEP:
        with torch.no_grad():
            model.emb.weight.mul_(100.0)


def test_a_tied_output_layer_whose_backward_overflows_first_is_named_alike(tmp_path):
    """The issue's pattern: the backward overflows first, in a layer whose
    weight is tied to the embedding; the sentinel re-executes the skipped
    step and names the same origin, step and lead finding as every-step."""
    runs = []
    for mode in ("sentinel", "every_step"):
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        data = [(torch.randint(0, 32, (4, 8), generator=gen), torch.randint(0, 32, (4, 8), generator=gen))
                for _ in range(9)]
        train(_TiedLM(), data, recorder=recorder_at(tmp_path / mode, mode=mode), loss_fn=_tied_loss,
              on_step=_grow_tied_weight, scaler={"init_scale": 2.0 ** 16, "growth_interval": 10 ** 6}, lr=0.01)
        runs.append(tmp_path / mode)
    sentinel, every = runs
    origins = _origins(sentinel)
    assert origins == _origins(every)
    backward = origins["backward"]
    assert backward is not None and backward["step"] == TIED_STEP and backward["name"] == "out"
    assert origins["forward"] is None  # the forward stayed finite
    assert _lead(sentinel) == _lead(every)
    steps = ap.load_run(sentinel).steps.set_index("step")
    assert bool(steps.loc[TIED_STEP, "reexecuted"]) and bool(steps.loc[TIED_STEP, "skipped"])


def test_a_clean_step_lets_its_output_gradients_go_and_an_asked_for_one_keeps_them(tmp_path):
    """A CPU job's clean step (facts with no event, no bundle asked for) is
    let go at its close: nothing the writer rules on goes beyond the facts
    just read. With a counterfactual window (whose lost-updates rule does)
    it is held while the writer decides, with its inputs and RNG states
    but not the gradient that reached the model's outputs (a language
    model's logits' is vocabulary x tokens). A step asked for keeps it, and
    its bundle replays the backward from it."""
    torch.manual_seed(0)
    rec = train(TinyNet(), batches(5), recorder=recorder_at(tmp_path / "plain", bundle_steps=(3,))).rec
    assert rec.bundles.saved and not any(s in rec.bundles._held for s in (1, 2, 4))
    run = tmp_path / "run"
    torch.manual_seed(0)
    rec = train(TinyNet(), batches(5), recorder=recorder_at(run, bundle_steps=(3,), window_steps=4),
                close=False).rec
    held = rec.bundles._held
    clean = [s for s in (1, 2, 4) if s in held]
    assert clean, sorted(held)
    for s in clean:
        cap = held[s]
        assert cap.clean and cap.grads_released and cap.micro_batches, s
        assert all(mb.grads == {} and mb.args for mb in cap.micro_batches), s
    rec.close()
    from amp_postmortem.reading.bundle import find_bundle, load_bundle
    bundle = load_bundle(find_bundle(run, 3))
    assert "grad_outputs_released" not in bundle.meta
    assert all(g is not None for grads in bundle.grad_outputs for g in grads)


@pytest.mark.parametrize("job_disabled", [False, True])
def test_the_cyclic_collector_is_paused_for_a_reexecution_only(tmp_path, monkeypatch, job_disabled):
    """The re-execution's short-lived objects set off no collection of the
    whole process (`reexecute._cycles_collected_after`); the job's own
    setting is what it finds after, whatever it was."""
    import gc

    from recorders import reexecute
    seen = []
    run = reexecute.Reexecutor._run

    def watched(self, *args):
        seen.append(gc.isenabled())
        return run(self, *args)
    monkeypatch.setattr(reexecute.Reexecutor, "_run", watched)
    after = []
    if job_disabled:
        gc.disable()
    try:
        torch.manual_seed(0)
        train(BoomNet(), batches(10, d_in=4, d_out=1, shape=(16,)), recorder=recorder_at(tmp_path / "run"),
              on_step=_overflow, scaler={"init_scale": 2.0 ** 8},
              after_step=lambda step, rec: after.append(gc.isenabled()))
    finally:
        gc.enable()
    assert seen == [False]  # the failing step, re-executed with the collector paused
    assert after == [not job_disabled] * 10


def test_a_weight_written_in_place_after_the_forward_refuses_the_reexecution(tmp_path):
    """The skipped step's weights are the live ones only while no parameter
    was written since its forward (`BundleCapture`'s version sum): one
    write, even of the same values, and the re-execution is refused, never
    run on other weights and called a mismatch."""
    torch.manual_seed(0)
    model = BoomNet()
    last = list(model.parameters())[-1]

    def write(step, micro_batch, rec):
        if step == OVERFLOW_STEP:
            with torch.no_grad():
                last.mul_(1.0)  # the same values, a new version
    train(model, batches(10, d_in=4, d_out=1, shape=(16,)), recorder=recorder_at(tmp_path / "run"),
          on_step=_overflow, scaler={"init_scale": 2.0 ** 8}, after_backward=write)
    entries = _manifest(tmp_path / "run")["reexecutions"]
    assert [(e["step"], e["check"], e.get("reason")) for e in entries] == [
        (OVERFLOW_STEP, "refused", "weights_not_held")]
    nans = ap.nans(tmp_path / "run").to_dict()
    assert nans["first_unrecorded_loss_step"] == OVERFLOW_STEP
    assert (nans["first_unrecorded_loss_step_why"]["why"], nans["first_unrecorded_loss_step_why"]["reason"]) == (
        "refused", "weights_not_held")
    assert "refused (weights_not_held)" in ap.summary(tmp_path / "run").to_dict()["findings"][0]["message"]


def test_why_a_step_was_not_reexecuted_reads_odd_manifests_as_unknown():
    """`no_rerun` on manifests it cannot read (hand-edited, older): not
    recorded, never an exception."""
    from amp_postmortem.analyses.nans import no_rerun

    class Run:
        rank_manifests = {1: "not a manifest"}

        def __init__(self, manifest):
            self.manifest = manifest
    odd = {"recorder": {"reexecute": {"refused": None}}, "reexecutions": "x", "reexecutions_capped": "3",
           "reexecutions_capped_steps": 7, "reexecutions_undecided": True}
    assert no_rerun(Run(odd), 7) == {"why": "not_recorded", "reason": None, "capped": 0, "undecided": 0}
    assert no_rerun(Run({}), 7)["why"] == "not_recorded"
    assert no_rerun(Run({"recorder": {"reexecute": None}}), 7)["why"] == "off"
    assert no_rerun(Run({"reexecutions_capped": 2, "reexecutions_capped_steps": [5, 7]}), 7)["why"] == "capped"


@pytest.mark.parametrize("job", ["events", "micro_batches", "float32_no_loss"])
def test_the_quiet_steps_rows_are_the_general_paths(tmp_path, job):
    """`QuietStep` closes the usual step of a job without a scaler in one
    pass; the general path closes every other one and stays the reference:
    the same job recorded both ways writes the same rows (its wall clock
    aside) and the same re-executions, and the one pass did close most of
    its steps."""
    closed = []

    def recorder(run, quiet: bool):
        def make(model, opt, sc):
            rec = AmpRecorder(run, model, optimizer=opt, scaler=sc,
                              schedule=RecordSchedule(cheap_every=7, full_every=0))
            if not quiet:
                rec.quiet = None
            elif rec.quiet is not None:
                close = rec.quiet.close
                rec.quiet.close = lambda loss, step: close(loss, step) and (closed.append(step) or True)
            return rec
        return make

    def fault(step, model, x):
        if job == "events":  # a spike, then a NaN in the input: events the general path judges
            x.mul_(1e3 if step == 14 else 1.0)
            if step == 20:
                x[0, 0] = float("nan")

    options = dict(events=dict(dtype=torch.bfloat16), micro_batches=dict(dtype=torch.bfloat16, accumulate=2),
                   float32_no_loss=dict(dtype=None, pass_loss=False))[job]
    runs = {}
    for quiet in (False, True):
        torch.manual_seed(0)
        run = tmp_path / f"run_{quiet}"
        train(TinyNet(), batches(24 * options.get("accumulate", 1)), recorder=recorder(run, quiet), scaler=None,
              lr=1e-3, on_step=fault, **options)
        runs[quiet] = run
    slow, fast = (ap.load_run(runs[q]).steps.drop(columns=["wall_time"]) for q in (False, True))
    pd.testing.assert_frame_equal(slow, fast)
    assert _manifest(runs[False]).get("reexecutions") == _manifest(runs[True]).get("reexecutions")
    if job == "float32_no_loss":
        assert closed == []  # no loss passed: the general path's
    else:
        # Sampled steps (0, 7, ...) are the general path's, and so are the
        # events: the faults begin at step 14 (the spike, whose weights then
        # diverge, and the NaN).
        assert [s for s in closed if s < 14] == [s for s in range(14) if s % 7]
        if job == "events":
            events = {e["step"] for e in _manifest(runs[True])["reexecutions"]}
            assert events and min(events) >= 14 and not events & set(closed)
        else:
            assert closed == [s for s in range(24) if s % 7]


def test_the_spike_bound_decides_as_the_median_rule_and_sorts_rarely(monkeypatch):
    """`_Recent.within(a)` is `a <= factor * median of the last `size`
    values` (no bound before 10 of them, nor with a median <= 0; NaN and
    Inf never within), step by step, against the rule computed directly on
    series with spikes, zeros and negative values; it sorts the window
    only when its last sorted copy cannot decide, far less than once a step
    on a steady series."""
    import random

    from recorders.reexecute import _NO_LIMIT, _Recent
    rng = random.Random(0)
    for _ in range(60):
        size, factor = rng.choice([10, 11, 50]), rng.choice([10.0, 2.0, 1.2])
        recent, window = _Recent(size, factor), []
        for _ in range(250):
            ranked = sorted(window)
            median = ranked[len(ranked) // 2] if len(ranked) >= 10 else 0.0
            limit = min(factor * median, _NO_LIMIT) if median > 0 else _NO_LIMIT
            v = rng.gauss(1.0, 0.3) if rng.random() < 0.8 else rng.choice(
                [rng.uniform(-5, 5), 0.0, -1.0, 1e3 * rng.random(), 1e300])
            assert recent.fast <= limit  # the one-comparison bound never admits a spike
            for probe in (abs(v), abs(v) * 1.5, limit, limit * 1.0000001, math.inf, math.nan):
                assert recent.within(probe) == (probe <= limit)
            if rng.random() < 0.1:
                assert recent.limit == limit
            recent.add(v)
            window = (window + [v])[-size:]
    rebuilds = []
    monkeypatch.setattr(_Recent, "_rebuild", lambda self, _f=_Recent._rebuild: (rebuilds.append(1), _f(self))[1])
    steady = _Recent(50, 10.0)
    for _ in range(1000):
        v = rng.gauss(1.0, 0.1)
        assert steady.within(v)
        steady.add(v)
    assert len(rebuilds) < 100


APPLIED_AT = 4  # the step whose backward makes non-finite gradients; no scaler skips it


def _unscaled_job(run, mode, *, steps=8, during_reexecution=None):
    """BoomNet in bfloat16 without a scaler: at APPLIED_AT `amp` turns the
    gradient passing back into Inf/NaN, SGD applies it, and from the next
    step every forward is NaN (the weights are). `during_reexecution(rec,
    step)`: called inside each re-execution's forward."""
    import recorders.reexecute as reexecute
    torch.manual_seed(0)
    model = BoomNet()
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(steps)]
    box = {}

    def recorder(model, opt, scaler):
        box["rec"] = AmpRecorder(run, model, optimizer=opt, scaler=scaler, mode=mode, hold_steps=steps + 8)
        return box["rec"]

    def plant(step, model, x):
        model.amp.gain = math.inf if step == APPLIED_AT else 1.0

    find_loss = reexecute.find_loss
    if during_reexecution is not None:
        def spy(output):
            rec = box["rec"]
            during_reexecution(rec, rec.hooks.shared.state.step_id)
            return find_loss(output)
        reexecute.find_loss = spy
    try:
        train(model, data, recorder=recorder, scaler=None, dtype=torch.bfloat16, lr=0.01, on_step=plant,
              loss_fn=lambda m, x, y, step, accumulate: ((m(x).float() - y) ** 2).mean())
    finally:
        reexecute.find_loss = find_loss
    return run


def test_a_forward_on_weights_an_applied_update_made_nonfinite_names_that_update(tmp_path):
    """The loss turns NaN one step after the gradients did: the forward's
    first NaN is in the first layer, whose weights the update made NaN/Inf.
    That layer is where they were first used, not an origin; the failure is
    the update's, born in `amp`'s backward, in both modes."""
    answers = []
    for mode in ("sentinel", "every_step"):
        run = _unscaled_job(tmp_path / mode, mode)
        nans = ap.nans(run).to_dict()
        fwd, bwd = nans["origins"]["forward"], nans["origins"]["backward"]
        assert (bwd["name"], bwd["kind"], bwd["step"], bwd["certain"]) == ("amp", "grad_input", APPLIED_AT, True)
        assert (fwd["name"], fwd["step"], fwd["basis"], fwd["certain"]) == ("inp", APPLIED_AT + 1,
                                                                           "nonfinite_weights", False)
        assert nans["weights_nonfinite_from"] == APPLIED_AT
        table = ap.nans(run).table()
        forward = table[table["phase"] == "forward"]
        assert "ORIGIN" not in set(forward["role"])
        assert forward.iloc[0][["role", "name"]].tolist() == ["weights", "inp"]
        lead = ap.summary(run).to_dict()["findings"][0]
        assert (lead["kind"], lead["severity"], lead["step"], lead["layer"]) == ("nonfinite", "critical",
                                                                                 APPLIED_AT, "amp")
        assert "first in inp, the first layer to use them" in lead["message"]
        assert lead["evidence"]["forward_origin"]["basis"] == "nonfinite_weights"
        answers.append((_origins(run), _lead(run)))
    assert answers[0] == answers[1]


def test_a_forward_origin_after_a_finite_update_keeps_its_rule(tmp_path):
    """A layer that makes a NaN from finite weights after an update that
    applied non-finite gradients elsewhere (its own were finite there)
    stays the origin: the weights' rows decide, not the step order."""
    from amp_postmortem.analyses.nans import Origin, OriginBasis, weights_origin
    run = ap.load_run(_unscaled_job(tmp_path / "run", "every_step"))
    head = Origin("head", "forward", "activation", APPLIED_AT + 1, 0, 9, "head")
    assert weights_origin(run, head) is None  # head's gradients were finite at APPLIED_AT
    inp = Origin("inp", "forward", "activation", APPLIED_AT + 1, 0, 1, "inp")
    assert weights_origin(run, inp) == (replace(inp, basis=OriginBasis.WEIGHTS), APPLIED_AT)
    early = Origin("inp", "forward", "activation", APPLIED_AT, 0, 1, "inp")
    assert weights_origin(run, early) is None  # no update before its step


@pytest.mark.parametrize("dtype, scaled", [(torch.bfloat16, False), (torch.float16, True)])
def test_a_weight_made_nonfinite_outside_the_optimizer_is_no_origin_where_its_rows_show_it(tmp_path, dtype,
                                                                                            scaled):
    """A NaN written into `head`'s weight before step 3's forward (a bad
    load, an in-place write: no update made it). Both modes name `head`,
    step 3, the activation. The sentinel's re-execution recorded the
    step's weight rows: there `head` is where NaN weights were first used,
    not their maker, and nothing names an update; every-step mode, without
    weight rows on that step, keeps the rule's answer."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(6)]

    def plant(step, model, x):
        if step == 3:
            with torch.no_grad():
                model.head.weight[0, 0] = math.nan

    answers = []
    for mode in ("sentinel", "every_step"):
        run = tmp_path / mode
        train(BoomNet(), data, recorder=recorder_at(run, mode=mode), on_step=plant, dtype=dtype, lr=0.01,
              scaler={"init_scale": 2.0 ** 8} if scaled else None,
              loss_fn=lambda m, x, y, step, accumulate: ((m(x).float() - y) ** 2).mean())
        nans = ap.nans(run).to_dict()
        fwd = nans["origins"]["forward"]
        assert (fwd["name"], fwd["kind"], fwd["step"]) == ("head", "activation", 3)
        lead = ap.summary(run).to_dict()["findings"][0]
        assert (lead["kind"], lead["step"], lead["layer"]) == ("nonfinite", 3, "head")
        if mode == "sentinel":
            assert (fwd["basis"], nans["weights_nonfinite_from"]) == ("nonfinite_weights", None)
            assert "its own weights were already NaN/Inf" in lead["message"]
            assert "first made by" not in lead["message"] and "update applied" not in lead["message"]
            table = ap.nans(run).table()
            assert table[table["phase"] == "forward"].iloc[0][["role", "name"]].tolist() == ["weights", "head"]
            # No keep_fp32 of a layer whose weights were NaN already: restore them.
            recs = ap.recommend(run).to_dict()["recommendations"]
            assert [(r["kind"], r["data"]) for r in recs] == [("check_weights", {"step": 3, "modules": ["head"]})]
        # The bundle of step 3 holds the weights the forward used: read, in both modes.
        recs = ap.recommend(run, model=BoomNet).to_dict()["recommendations"]
        assert [(r["kind"], r["data"], r["verified"]) for r in recs] == [
            ("check_weights", {"step": 3, "params": ["head.weight"]}, True)]
        if mode == "every_step":  # and the replay of that bundle names them, as the op origin does
            notes = ap.replay(run, step=3, model=BoomNet).to_dict()["notes"]
            assert any("the step ran on weights already NaN/Inf (head.weight in the bundle)" in n for n in notes)
            op = ap.nans(run, model=BoomNet).to_dict()["op_origin"]
            assert (op["status"], op["step"], op["nonfinite_weights"]) == ("no_op", 3, ["head.weight"])
        answers.append((_origins(run), _lead(run)))
    assert answers[0] == answers[1]


def test_nonfinite_gradients_on_steps_without_rows_leave_the_backward_origin_undetermined(tmp_path):
    """Gradients that went Inf at APPLIED_AT on a step that recorded no
    row (re-execution off): `nans` must not say every backward tensor was
    finite; the step facts show them, so the backward origin is
    undetermined, with the step and why it has no rows."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(6)]

    def plant(step, model, x):
        model.amp.gain = math.inf if step == APPLIED_AT else 1.0

    run = tmp_path / "run"
    train(BoomNet(), data, recorder=recorder_at(run, mode="sentinel", reexecute=False), on_step=plant,
          dtype=torch.bfloat16, scaler=None, lr=0.01,
          loss_fn=lambda m, x, y, step, accumulate: ((m(x).float() - y) ** 2).mean())
    report = ap.nans(run)
    doc = report.to_dict()
    assert doc["origins"]["backward"] is None
    assert doc["first_unrecorded_gradient_step"] == APPLIED_AT and doc["unrecorded_gradient_steps"] >= 1
    assert doc["first_unrecorded_gradient_step_why"]["why"] == "off"
    line = next(x for x in report.lines() if x.startswith("backward origin"))
    assert line.startswith(f"backward origin: undetermined: the gradients were NaN/Inf at step {APPLIED_AT}")
    assert "every backward tensor finite" not in line


def test_a_loss_made_nonfinite_outside_the_model_is_the_origin_in_both_modes(tmp_path):
    """The loop's loss (computed outside the model) is Inf at step 3, the
    model's outputs finite. Every-step recording writes the step's `<loss>`
    row from the loss passed to `rec.step()`; the re-execution writes the
    same row (it wrote none: the sentinel named no origin there, and led
    with a later step)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(6)]

    def loss(m, x, y, step, accumulate):
        return ((m(x).float() - y) ** 2).mean() * (math.inf if step == 3 else 1.0)

    answers = []
    for mode in ("sentinel", "every_step"):
        run = tmp_path / mode
        train(BoomNet(), data, recorder=recorder_at(run, mode=mode), loss_fn=loss, scaler=None,
              dtype=torch.bfloat16, lr=0.01)
        fwd = ap.nans(run).to_dict()["origins"]["forward"]
        assert (fwd["name"], fwd["kind"], fwd["step"]) == ("<loss>", "loss", 3)
        assert _lead(run)[:3] == ("nonfinite", "critical", 3)
        answers.append((_origins(run), _lead(run)))
    assert answers[0] == answers[1]


def test_a_step_written_during_a_later_reexecution_keeps_its_bundle(tmp_path):
    """The writer decides a step's bundle while the training thread may be
    re-executing a later one: the decision stands (it was dropped, and the
    failing step's bundle lost, when the writer read the capture's switch
    that a re-execution turns off)."""
    def drain(rec, step):
        if step == APPLIED_AT + 1:
            rec.run_writer.thread.barrier()  # APPLIED_AT's row is written now, mid re-execution
    run = _unscaled_job(tmp_path / "run", "sentinel", during_reexecution=drain)
    bundles = {b["step"]: b["reasons"] for b in _manifest(run)["bundles"]}
    assert bundles[APPLIED_AT] == ["nonfinite_tensor"]
    assert bundles[APPLIED_AT + 1] == ["nonfinite_loss"]


def test_a_layer_on_a_tied_weight_an_update_poisoned_is_found_by_its_other_name(tmp_path):
    """A tied weight's rows carry its first name (`emb.weight`); the output
    layer that shares it (`out.weight`) ran on the same poisoned weight."""
    from amp_postmortem.analyses.nans import Origin, OriginBasis, weights_origin
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 32, (4, 8), generator=gen), torch.randint(0, 32, (4, 8), generator=gen))
            for _ in range(6)]

    def loss(model, x, y, step, accumulate):
        return _tied_loss(model, x, y, step, accumulate) * (math.inf if step == 3 else 1.0)

    train(_TiedLM(), data, recorder=recorder_at(tmp_path / "run", mode="every_step"), loss_fn=loss,
          scaler=None, dtype=torch.bfloat16, lr=0.01)
    run = ap.load_run(tmp_path / "run")
    out = Origin("out", "forward", "activation", 4, 0, 3, "out")
    assert weights_origin(run, out) == (replace(out, basis=OriginBasis.WEIGHTS), 3)


def test_a_layer_whose_restored_weights_are_finite_keeps_its_rule(tmp_path):
    """The update of step 2 applies non-finite gradients; the loop restores
    the weights before step 3 (as a job that reloads its checkpoint does);
    at step 6 `inp` overflows float16 from a finite input. The re-executed
    step's weight rows show them finite: `inp` made it, an origin."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(8)]
    saved = {}

    def plant(step, model, x):
        model.amp.gain = math.inf if step == 2 else 1.0
        if step == 2:
            saved.update({k: v.clone() for k, v in model.state_dict().items()})
        if step == 3:
            model.load_state_dict(saved)
        if step == 6:
            x.mul_(1e6)

    train(BoomNet(), data, recorder=recorder_at(tmp_path / "run", mode="sentinel"), scaler=None, on_step=plant,
          lr=0.01, loss_fn=lambda m, x, y, step, accumulate: ((m(x).float() - y) ** 2).mean())
    nans = ap.nans(tmp_path / "run").to_dict()
    fwd, bwd = nans["origins"]["forward"], nans["origins"]["backward"]
    assert (fwd["name"], fwd["step"], fwd["basis"]) == ("inp", 6, "rule")
    assert (bwd["name"], bwd["step"]) == ("amp", 2)
    lead = ap.summary(tmp_path / "run").to_dict()["findings"][0]
    assert (lead["step"], lead["layer"]) == (2, "amp")  # the update came first
    assert "first made by inp" in lead["message"]


class _Layouts(nn.Module):
    """One small model in the layouts a loop may use: a dropout, a
    checkpointed block, a frozen first layer, a dict output with the loss,
    keyword inputs. `fault` multiplies by `gain` (a planted Inf/NaN)."""

    def __init__(self, layout: str):
        super().__init__()
        self.layout = layout
        self.inp, self.mid, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.drop = nn.Dropout(0.3 if layout == "dropout" else 0.0)
        self.fault = Boom()
        if layout == "frozen":
            self.inp.requires_grad_(False)

    def _body(self, h):
        return self.fault(torch.relu(self.mid(h)))

    def forward(self, x=None, y=None):
        h = self.drop(torch.relu(self.inp(x)))
        if self.layout == "checkpoint":
            import torch.utils.checkpoint as checkpoint
            h = checkpoint.checkpoint(self._body, h, use_reentrant=False)
        else:
            h = self._body(h)
        out = self.head(h)
        if self.layout == "dict":
            return {"loss": ((out.float() - y) ** 2).mean(), "logits": out}
        return out


def _layouts_loss(model, x, y, step, accumulate):
    if model.layout == "dict":
        return model(x=x, y=y)["loss"] / accumulate
    return ((model(x=x).float() - y) ** 2).mean() / accumulate


LAYOUTS = {  # (layout, autocast dtype, scaler, accumulate, the planted fault's step, what it plants)
    "dropout_fp16": ("dropout", torch.float16, True, 1, 5, 1e6),
    "checkpoint_fp16": ("checkpoint", torch.float16, True, 1, 4, 1e6),
    "frozen_bf16": ("frozen", torch.bfloat16, False, 1, 4, math.nan),
    "dict_bf16": ("dict", torch.bfloat16, False, 1, 3, math.nan),
    "accumulate_fp16": ("plain", torch.float16, True, 2, 3, 1e6),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_loop_layouts_give_the_same_answers_in_both_modes(tmp_path, name):
    """More of the patterns a user's loop takes (dropout, whose mask the
    re-execution must draw again; a checkpointed block; a frozen layer;
    the loss inside the model's dict output; gradient accumulation): the
    same origin, step and lead in both modes, and the origin is the layer
    the fault was planted in."""
    layout, dtype, scaler, accumulate, at, gain = LAYOUTS[name]
    answers = []
    for mode in ("sentinel", "every_step"):
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        data = [(torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen))
                for _ in range(8 * accumulate)]

        def plant(step, model, x):
            model.fault.gain = gain if step == at else 1.0

        train(_Layouts(layout), data, recorder=recorder_at(tmp_path / mode, mode=mode), dtype=dtype,
              scaler={"init_scale": 2.0 ** 8} if scaler else None, accumulate=accumulate, lr=0.01,
              on_step=plant, loss_fn=_layouts_loss)
        answers.append((_origins(tmp_path / mode), _lead(tmp_path / mode)))
    assert answers[0] == answers[1]
    origins, lead = answers[0]
    assert (origins["forward"]["name"], origins["forward"]["step"]) == ("fault", at)
    assert lead[:3] == ("nonfinite", "critical", at)


class _WithUnused(BoomNet):
    """A parameter the forward never uses (an idle head): it gets no
    gradient, so the gradient facts are read parameter by parameter."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(4, 4)


@pytest.mark.parametrize("net", [BoomNet, _WithUnused])
def test_a_gradient_norm_spike_without_a_scaler_is_reexecuted_from_the_weights_of_its_forward(tmp_path, net):
    """A job whose update follows every step has stepped when a spike is
    judged at `rec.step()`: the optimizer's pre-step hook asks the spike
    bound, and the weights of a step whose gradient norm breaks it are
    copied before the update. The spike is re-executed exactly (it was
    refused `weights_not_held`), and the training's numbers are untouched;
    so too where a parameter without a gradient makes the facts be read
    one gradient at a time (there the bound was not asked)."""
    def spike(step, model, x):
        if step == 20:
            x.mul_(100.0)

    runs = {}
    for recorded in (True, False):
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        data = [(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(26)]
        runs[recorded] = train(net(), data, recorder=recorder_at(tmp_path / "run", mode="sentinel")
                               if recorded else None, scaler=None, dtype=torch.bfloat16, lr=1e-3, on_step=spike)
    entry = next(e for e in _manifest(tmp_path / "run")["reexecutions"] if e["step"] == 20)
    assert (entry["kind"], entry["check"]) == ("spike", "exact")
    steps = ap.load_run(tmp_path / "run").steps.set_index("step")
    assert bool(steps.loc[20, "reexecuted"]) and steps.loc[20, "tensor_rows"] > 0
    assert runs[True].losses == runs[False].losses
    assert all(torch.equal(a, b) for a, b in zip(runs[True].params, runs[False].params))
