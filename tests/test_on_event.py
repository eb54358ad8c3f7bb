"""recorders.events, recorders.event_thread and `AmpRecorder(on_event=)`:
the detectors alone on synthetic step summaries, then the real recorder on
tiny CPU models with a NaN planted at a known step (callbacks that record,
raise, sleep, request a stop, a checkpoint, a bundle), and the Trainer and
Lightning callbacks' `stop_on_event`."""
from __future__ import annotations

import json
import math
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from recorders import AmpRecorder, Event, EventKind, EventPolicy, OptionError
from recorders.event_thread import EventDispatcher
from recorders.events import EventDetector, nonfinite_event
from tiny_models import TinyNet, batches, train

NAN_STEP = 3
LAYER = "blocks.1.mlp.0"


# ------------------------------------------------------------ synthetic summaries
def summary(step, *, skipped=False, loss=1.0, scale=None, rows=()):
    """A step summary as `StepRows.rows` makes it; `rows`: (name, kind,
    phase, order, nan_count) of its tensor rows."""
    cols = None
    if rows:
        names, kinds, phases, orders, nans = zip(*rows)
        cols = {"name": np.array(names, dtype=object), "kind": np.array(kinds, dtype=object),
                "phase": np.array(phases, dtype=object), "order": np.array(orders),
                "nan_count": np.array(nans), "inf_count": np.zeros(len(rows), dtype=np.int64)}
    return {"step": step, "skipped": skipped, "loss": loss, "loss_scale": scale, "loss_scale_before": scale,
            "growth_tracker": None, "nonfinite_rows": sum(n > 0 for n in (r[4] for r in rows)), "columns": cols}


def kinds_of(detector, summaries):
    return [(e.kind, e.step) for s in summaries for e in detector.observe(s)]


def test_a_skip_streak_counts_only_after_calibration_and_fires_once():
    det = EventDetector(skip_streak=3, scale_floor=None)
    skips = [True, True, True, True,       # a fresh scaler calibrating: no streak
             False, True, True, False,     # two: short of three
             True, True, True, True, True]  # the streak: fires at its third step, once
    assert kinds_of(det, [summary(i, skipped=s) for i, s in enumerate(skips)]) == [(EventKind.SKIP_STREAK, 10)]


def test_a_scale_collapse_is_a_fall_by_2_to_the_bits_within_the_window_or_a_scale_below_the_floor():
    # Calibration halves 2**16 down to 2**8 before the first step that runs: not a collapse.
    scales = [2.0 ** 16 / 2 ** i for i in range(9)]
    det = EventDetector(skip_streak=100, collapse_bits=3, collapse_window=4, scale_floor=None)
    calib = [summary(i, skipped=i < 8, scale=s) for i, s in enumerate(scales)]
    assert kinds_of(det, calib) == []
    # A fall of 2**3 from 256 to 32 within 4 steps: a collapse, at step 11.
    fall = [summary(9, skipped=True, scale=128.0), summary(10, skipped=True, scale=64.0),
            summary(11, skipped=True, scale=32.0), summary(12, skipped=True, scale=16.0)]
    assert kinds_of(det, fall) == [(EventKind.SCALE_COLLAPSE, 11)]
    # The same fall spread beyond the window is none.
    slow = EventDetector(skip_streak=100, collapse_bits=3, collapse_window=3, scale_floor=None)
    spread = [summary(i, skipped=i % 2 == 1, scale=256.0 / 2 ** ((i + 1) // 2)) for i in range(8)]
    assert kinds_of(slow, spread) == []
    # Below the floor: a collapse whenever it happens, calibration too.
    floor = EventDetector(skip_streak=100, scale_floor=1.0)
    assert kinds_of(floor, [summary(0, skipped=True, scale=2.0), summary(1, skipped=True, scale=0.5)]) \
        == [(EventKind.SCALE_COLLAPSE, 1)]
    e = EventDetector(scale_floor=1.0).observe(summary(0, skipped=True, scale=0.5))[0]
    assert e.evidence == {"loss_scale": 0.5, "scale_floor": 1.0}
    # Without a scaler there is no scale to collapse.
    assert kinds_of(EventDetector(), [summary(i, scale=None) for i in range(5)]) == []


def test_the_nonfinite_event_is_the_most_upstream_of_its_step_and_fires_once():
    fwd = ("embed", "activation", "forward", 0, 0), ("mid", "activation", "forward", 1, 3), \
          ("mid.weight", "param", "forward", 9, 0), ("<loss>", "loss", "forward", 2, 1), \
          ("head", "grad_output", "backward", 0, 4)
    e = nonfinite_event(summary(5, skipped=True, loss=math.nan, rows=fwd))
    assert (e.kind, e.step, e.layer) == (EventKind.NONFINITE_FORWARD, 5, "mid")
    assert e.evidence["tensor_kind"] == "activation" and e.evidence["nan_count"] == 3
    # A NaN weight: its module is the layer.
    e = nonfinite_event(summary(0, rows=[("mid.weight", "param", "forward", 9, 1)]))
    assert (e.kind, e.layer, e.evidence["tensor"]) == (EventKind.NONFINITE_FORWARD, "mid", "mid.weight")
    # The loss alone, by value or by its row.
    assert nonfinite_event(summary(1, loss=math.inf)).kind == EventKind.NONFINITE_LOSS
    assert nonfinite_event(summary(1, rows=[("<loss>", "loss", "forward", 3, 1)])).kind == EventKind.NONFINITE_LOSS
    # Gradients: of a step that ran the optimizer; the first in backward order.
    grads = [("head.weight", "param_grad", "backward", 3, 1), ("head", "grad_output", "backward", 0, 2)]
    e = nonfinite_event(summary(2, rows=grads))
    assert (e.kind, e.layer) == (EventKind.NONFINITE_GRADIENT, "head")
    # A scaler's skipped step made its overflowing gradients on purpose.
    assert nonfinite_event(summary(2, skipped=True, rows=grads)) is None
    det = EventDetector()
    assert kinds_of(det, [summary(0, loss=math.nan), summary(1, rows=grads)]) == [(EventKind.NONFINITE_LOSS, 0)]


def test_event_policy_checks_its_options_and_takes_a_bare_callable():
    p = EventPolicy(print, skip_streak=0, collapse_bits=2.0)
    assert (p.skip_streak, p.collapse_bits, p.collapse_window, p.scale_floor, p.max_pending) == (1, 2, 100, 1.0, 16)
    with pytest.raises(OptionError, match="give a callable"):
        EventPolicy(42)
    with pytest.raises(OptionError, match="skip_streak"):
        EventPolicy(print, skip_streak="3")
    with pytest.raises(OptionError, match="give a callable"):
        AmpRecorder("unused", TinyNet(), on_event="stop")


def test_the_dispatcher_never_waits_for_a_slow_callback_and_counts_what_it_drops():
    release, started = threading.Event(), threading.Event()
    heard = []

    def slow(event):
        started.set()
        release.wait(10)
        heard.append(event.step)

    events = EventDispatcher(EventPolicy(slow, max_pending=1))
    t0 = time.perf_counter()
    assert events.post(Event(EventKind.SKIP_STREAK, 1))
    started.wait(5)  # the thread holds event 1: the queue is empty again
    assert events.post(Event(EventKind.SKIP_STREAK, 2))
    assert not events.post(Event(EventKind.SKIP_STREAK, 3))  # the queue of one is full
    assert time.perf_counter() - t0 < 1
    release.set()
    events.close()
    assert heard == [1, 2]
    report = events.report()
    assert report["dropped"] == 1 and [e["step"] for e in report["raised"]] == [1, 2, 3]


# ------------------------------------------------------------- the real recorder
def nan_weight_at(step, *, restore: bool):
    """Plants a NaN in `blocks.1.mlp.0.weight` before `step`; `restore`:
    puts the weight back before the next step (the scaler skipped the bad
    step, so training goes on as if nothing happened)."""
    kept = {}

    def on_step(i, model, x):
        w = model.blocks[1].mlp[0].weight
        with torch.no_grad():
            if i == step:
                kept["w"] = w[0, 0].clone()
                w[0, 0] = math.nan
            elif i == step + 1 and restore:
                w[0, 0] = kept["w"]
    return on_step


def recording(run, **options):
    """`train`'s recorder factory, which also keeps the recorder in `.rec`."""
    def make(model, opt, sc):
        make.rec = AmpRecorder(run, model, optimizer=opt, scaler=sc, **options)
        return make.rec
    return make


def flushing(on_step, holder):
    """`on_step` that first flushes the recorder: the last step's events
    reach the callback before this step (deterministic request steps)."""
    def step(i, model, x):
        if i:
            holder.rec.flush()
        on_step(i, model, x)
    return step


def manifest_events(run):
    return json.loads((run / "manifest.json").read_text())["events"]


def test_a_planted_nan_weight_raises_each_kind_once_at_its_step_with_its_layer(tmp_path):
    heard = []
    torch.manual_seed(0)
    train(TinyNet(), batches(10), recorder=recording(tmp_path / "r", on_event=heard.append),
          on_step=nan_weight_at(NAN_STEP, restore=False))
    # The weight stays NaN: every step from 3 is skipped and the scale halves each time.
    assert [(e.kind, e.step, e.layer) for e in heard] == [
        (EventKind.NONFINITE_FORWARD, 3, LAYER), (EventKind.SKIP_STREAK, 5, None),
        (EventKind.SCALE_COLLAPSE, 8, None)]
    first = heard[0].evidence
    assert first["tensor"] == LAYER and first["tensor_kind"] == "activation" and first["skipped"]
    assert math.isnan(first["loss"]) and first["nan_count"] == 4 * 5  # output feature 0 of every position
    assert heard[1].evidence == {"skipped_steps": 3, "first_skipped_step": 3, "loss_scale": 2.0 ** 13}
    assert heard[2].evidence == {"loss_scale": 2.0 ** 10, "peak_scale": 2.0 ** 16, "peak_step": 0, "fell_bits": 6.0}
    m = manifest_events(tmp_path / "r")
    assert [(e["kind"], e["step"], e["layer"]) for e in m["raised"]] == [
        ("nonfinite_forward", 3, LAYER), ("skip_streak", 5, None), ("scale_collapse", 8, None)]
    assert (m["callback"], m["dropped"], m["callback_errors"], m["pending"]) == ("list.append", 0, [], 0)


def test_a_callback_that_raises_changes_no_bit_of_training_and_warns_once(tmp_path):
    calls = []

    def broken(event):
        calls.append(event.kind)
        raise RuntimeError("my checkpoint code is broken")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        recorded = train(TinyNet(), batches(8), recorder=recording(tmp_path / "r", on_event=broken),
                         on_step=nan_weight_at(NAN_STEP, restore=True))
    torch.manual_seed(0)
    plain = train(TinyNet(), batches(8), on_step=nan_weight_at(NAN_STEP, restore=True))
    assert np.array_equal(recorded.losses, plain.losses, equal_nan=True)
    assert all(torch.equal(a, b) for a, b in zip(recorded.params, plain.params))
    assert recorded.rec.enabled  # recording goes on too
    assert calls == [EventKind.NONFINITE_FORWARD]
    ours = [w for w in caught if "on_event" in str(w.message)]
    assert len(ours) == 1 and "nonfinite_forward" in str(ours[0].message)
    m = manifest_events(tmp_path / "r")
    assert m["callback_errors"] == [{"kind": "nonfinite_forward", "step": NAN_STEP,
                                     "error": "RuntimeError: my checkpoint code is broken"}]


def test_a_slow_callback_never_slows_a_training_step(tmp_path):
    """A callback that does not return until the job is over: every step
    runs all the same (no timing: the callback is held until training
    ends, so a training step that waited for it would never finish)."""
    heard, release = [], threading.Event()

    def held(event):
        heard.append(event.kind)
        assert release.wait(60)

    torch.manual_seed(0)
    make = lambda model, opt, sc: AmpRecorder(tmp_path / "r", model, optimizer=opt, scaler=sc,  # noqa: E731
                                              on_event=held)
    trained = train(TinyNet(), batches(12), recorder=make, on_step=nan_weight_at(1, restore=False), close=False)
    assert len(trained.losses) == 12  # every step ran while the first callback was held
    release.set()
    trained.rec.close()  # waits for the callbacks
    assert heard == [EventKind.NONFINITE_FORWARD, EventKind.SKIP_STREAK, EventKind.SCALE_COLLAPSE]


def test_a_hung_callback_holds_flush_for_a_bounded_time_only(tmp_path, monkeypatch):
    import recorders.run_writer as rw
    from amp_postmortem import load_run
    monkeypatch.setattr(rw, "FLUSH_WAIT_S", 0.5)
    release = threading.Event()
    torch.manual_seed(0)
    trained = train(TinyNet(), batches(4), close=False, on_step=nan_weight_at(1, restore=False),
                    recorder=lambda model, opt, sc: AmpRecorder(tmp_path / "r", model, optimizer=opt, scaler=sc,
                                                                on_event=lambda event: release.wait(30)))
    try:
        t0 = time.perf_counter()
        trained.rec.flush()  # the callback of the first event hangs
        assert time.perf_counter() - t0 < 5.0
        assert load_run(tmp_path / "r").steps["step"].tolist() == [0, 1, 2, 3]  # flushed all the same
    finally:
        release.set()
        trained.rec.close()


def test_a_stop_request_is_honoured_at_the_next_step_through_should_stop(tmp_path):
    def stop(event):
        event.request_checkpoint()
        event.request_stop()

    make = recording(tmp_path / "r", on_event=stop)
    torch.manual_seed(0)
    trained = train(TinyNet(), batches(10), recorder=make, on_step=flushing(nan_weight_at(NAN_STEP, restore=True), make),
                    stop_when=lambda rec: rec.should_stop)
    # The event of step 3 reached the callback before step 4 (the flush);
    # step 4's rec.step() took the stop, or step 3's own when the writer and
    # the callback were quicker than the rest of that rec.step().
    assert len(trained.losses) in (NAN_STEP + 1, NAN_STEP + 2)
    assert trained.rec.should_stop and trained.rec.checkpoint_requested
    trained.rec.checkpoint_requested = False  # the loop saved its checkpoint


def test_a_bundle_request_saves_the_next_step(tmp_path):
    from amp_postmortem.reading.bundle import list_bundles

    make = recording(tmp_path / "r", on_event=lambda event: event.request_bundle(), bundle_triggers=())
    torch.manual_seed(0)
    trained = train(TinyNet(), batches(7), recorder=make, on_step=flushing(nan_weight_at(NAN_STEP, restore=True), make))
    assert not trained.rec.should_stop
    # Taken at step 4's rec.step(): step 5, whose forward had not begun (or
    # at step 3's own, as above: step 4).
    assert [step for step, _, _ in list_bundles(tmp_path / "r")] in ([NAN_STEP + 2], [NAN_STEP + 1])


def test_the_parts_api_takes_an_event_policy(tmp_path):
    heard = []
    torch.manual_seed(0)
    train(TinyNet(), batches(6), recorder=recording(tmp_path / "r", on_event=EventPolicy(heard.append, skip_streak=2)),
          on_step=nan_weight_at(NAN_STEP, restore=False))
    assert [(e.kind, e.step) for e in heard] == [(EventKind.NONFINITE_FORWARD, 3), (EventKind.SKIP_STREAK, 4)]
    assert manifest_events(tmp_path / "r")["skip_streak"] == 2


def test_without_on_event_nothing_is_detected_and_the_manifest_has_no_events(tmp_path):
    torch.manual_seed(0)
    trained = train(TinyNet(), batches(3), recorder=recording(tmp_path / "r"))
    assert trained.rec.events is None and not trained.rec.should_stop
    assert "events" not in json.loads((tmp_path / "r" / "manifest.json").read_text())


# ------------------------------------------------------------------ frameworks
def test_trainer_stop_on_event_sets_should_training_stop(tmp_path, one_torch_thread):
    pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState, GradientState
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from framework_runs import TokenDataset, read_table, tiny_gpt2
    from recorders.integrations.transformers import AmpPostmortemCallback

    class Flush(TrainerCallback):  # the event of a step reaches the callback before the next one
        def on_step_end(self, args, state, control, **kwargs):
            ours.recorder.flush()

    ours = AmpPostmortemCallback(tmp_path / "hf", stop_on_event=True,
                                 on_event=lambda event: event.request_stop())
    model = tiny_gpt2()
    calls = []

    def nan_in_third_forward(module, args, output):  # forward 3: the first micro-batch of step 1
        calls.append(1)
        return output * math.nan if len(calls) == 3 else output

    model.transformer.ln_f.register_forward_hook(nan_in_third_forward)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        args = TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, max_steps=8, bf16=True, use_cpu=True,
                                 report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                 learning_rate=1e-3, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(32), callbacks=[ours, Flush()])
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        trainer.train()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    # The NaN at step 1; the stop taken at the first step end after the
    # callback asked for it: step 2's (the Flush callback delivered the
    # event), or step 1's own when the writer and event threads answered
    # before its rec.step() returned (a race a loaded CI machine loses).
    steps = trainer.state.global_step
    assert steps in (2, 3)
    assert read_table(tmp_path / "hf", "steps")["step"].sort_values().tolist() == list(range(steps))


def test_lightning_stop_on_event_sets_trainer_should_stop(tmp_path, one_torch_thread):
    L = pytest.importorskip("lightning.pytorch")
    import torch.nn as nn
    import torch.nn.functional as F

    from framework_runs import read_table
    from recorders.integrations.lightning import AmpPostmortemCallback

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
            self.head = nn.Linear(16, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            if batch_idx == 1:
                x = x.clone()
                x[0, 0] = math.nan
            return F.mse_loss(self.head(self.body(x)).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class Flush(L.Callback):  # after ours in the list: the step's events reach the callback now
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ours.recorder.flush()

    ours = AmpPostmortemCallback(tmp_path / "pl", stop_on_event=True, on_event=lambda event: event.request_stop())
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=gen), torch.randn(64, 1, generator=gen))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=10, precision="bf16-mixed", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ours, Flush()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and logging
        trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=4))
    # bf16 without a scaler: the NaN step 1 ran the optimizer; the stop was
    # taken at step 2 (the Flush callback delivered the event), or at step 1
    # when the writer and event threads answered before its rec.step() returned.
    steps = trainer.global_step
    assert steps in (2, 3)
    assert read_table(tmp_path / "pl", "steps")["step"].sort_values().tolist() == list(range(steps))
