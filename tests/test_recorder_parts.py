"""recorders.options and the parts `AmpRecorder` takes: `RecordSchedule`,
`BundlePolicy`, `StorageOptions`, `WriterOptions`, each alone (defaults,
validation), and passed to the real recorder instead of the flat keywords
(same manifest, used as given, a conflict refused, `bundles=False`)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from recorders import AmpRecorder, BundlePolicy, OptionError, RecordSchedule, StorageOptions, WriterOptions
from recorders.bundles.triggers import TRIGGERS
from recorders.options import FLAT_OPTIONS, parts_from_flat
from tiny_models import TinyNet, batches, recorder_at, train


def _recorder_options(run) -> dict:
    return json.loads((run / "manifest.json").read_text())["recorder"]


def _tiers(run) -> str:
    from framework_runs import read_table
    steps = read_table(run, "steps").sort_values("step")
    return "".join("F" if t == "full" else "c" for t in steps["tier"])


# ------------------------------------------------------------ each part alone
def test_the_parts_defaults_are_the_documented_defaults_of_the_flat_keywords():
    assert RecordSchedule().config() == {"cheap_every": 1000, "full_every": 10000, "full_after_event": 0}
    assert RecordSchedule.every_step().config() == {"cheap_every": 1, "full_every": 100, "full_after_event": 20}
    assert parts_from_flat({"full_every": 7}, mode="every_step").schedule.config() == {
        "cheap_every": 1, "full_every": 7, "full_after_event": 20}
    assert BundlePolicy() == BundlePolicy(
        triggers=TRIGGERS, steps=(), max_bundles=3, max_bundle_bytes=64 << 30, min_loss_scale=1.0,
        settle_steps=10, snapshot_params="auto", snapshot_buffers_bytes=64 << 20, hold_steps=2,
        clone_inputs=False)
    assert dataclasses.astuple(WriterOptions()) == (1000, 60.0, 5.0, 256)
    assert dataclasses.astuple(StorageOptions()) == (None, 2 << 30, 120.0)
    # no flat keyword given: the default parts
    parts = parts_from_flat({})
    assert parts.bundles_enabled and parts.bundle_policy == BundlePolicy()
    assert parts.writer == WriterOptions() and parts.storage == StorageOptions()
    assert parts.schedule.config() == RecordSchedule().config()


def test_every_flat_keyword_names_a_field_of_its_part():
    fields = {"schedule": {"cheap_every", "full_every", "full_after_event"},
              **{part: {f.name for f in dataclasses.fields(cls)}
                 for part, cls in (("bundles", BundlePolicy), ("storage", StorageOptions),
                                   ("writer", WriterOptions))}}
    assert all(field in fields[part] for part, field in FLAT_OPTIONS.values())
    # and every field of a part has its flat keyword: nothing only one spelling can set
    assert {(p, f) for p, names in fields.items() for f in names} == set(FLAT_OPTIONS.values())


def test_a_part_normalises_its_values_once():
    policy = BundlePolicy(triggers="skipped", steps=[5, 1, 5], hold_steps=0, max_bundles=4.0)
    assert (policy.triggers, policy.steps, policy.hold_steps, policy.max_bundles) == (("skipped",), (1, 5), 1, 4)
    assert WriterOptions(steps_per_shard=0, flush_interval_s=1).steps_per_shard == 1
    assert RecordSchedule(cheap_every=0).cheap_every == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.max_bundles = 9


@pytest.mark.parametrize("make, message", [
    (lambda: BundlePolicy(triggers=["nan"]), "unknown bundle trigger 'nan' (valid: nonfinite_loss, "),
    (lambda: BundlePolicy(snapshot_params="sometimes"), "snapshot_params='sometimes' (valid: 'auto', True, False)"),
    (lambda: BundlePolicy(max_bundles="3"), "max_bundles='3' is not a whole number"),
    (lambda: BundlePolicy(steps=[1.5]), "steps=1.5 is not a whole number"),
    (lambda: BundlePolicy(min_loss_scale="low"), "min_loss_scale='low' is not a number"),
    (lambda: WriterOptions(flush_interval_s="soon"), "flush_interval_s='soon' is not a number"),
    (lambda: WriterOptions(max_queue=None), "max_queue=None is not a whole number"),
    (lambda: StorageOptions(spool_max_bytes=1.5), "spool_max_bytes=1.5 is not a whole number"),
    (lambda: RecordSchedule(full_every="often"), "full_every='often' is not a whole number"),
])
def test_a_bad_value_raises_an_option_error_naming_it(make, message):
    with pytest.raises(OptionError) as caught:
        make()
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


# ------------------------------------------------------ parts in the recorder
FLAT = dict(cheap_every=1, full_every=3, full_after_event=4,
            steps_per_shard=2, flush_interval_s=30.0, durable_interval_s=2.0, max_queue=64,
            bundle_triggers=("skipped", "scale_low"), bundle_steps=[1], max_bundles=2, max_bundle_bytes=1 << 20,
            min_loss_scale=0.5, settle_steps=3, snapshot_params=False, snapshot_buffers_bytes=1 << 10,
            hold_steps=3, clone_inputs=True)
PARTS = dict(schedule=RecordSchedule(cheap_every=1, full_every=3, full_after_event=4),
             writer=WriterOptions(steps_per_shard=2, flush_interval_s=30.0, durable_interval_s=2.0, max_queue=64),
             bundles=BundlePolicy(triggers=("skipped", "scale_low"), steps=[1], max_bundles=2,
                                  max_bundle_bytes=1 << 20, min_loss_scale=0.5, settle_steps=3,
                                  snapshot_params=False, snapshot_buffers_bytes=1 << 10, hold_steps=3,
                                  clone_inputs=True))


def test_parts_and_the_equivalent_flat_keywords_record_the_same_options(tmp_path, sentinel_mode):
    data = batches(4)
    for name, options in (("flat", FLAT), ("parts", PARTS), ("default", {}),
                          ("default_parts", dict(schedule=RecordSchedule(), bundles=BundlePolicy(),
                                                 storage=StorageOptions(), writer=WriterOptions()))):
        torch.manual_seed(0)
        train(TinyNet(), data, recorder=recorder_at(tmp_path / name, **options))
    assert _recorder_options(tmp_path / "flat") == _recorder_options(tmp_path / "parts")
    assert _recorder_options(tmp_path / "default") == _recorder_options(tmp_path / "default_parts")
    assert _recorder_options(tmp_path / "parts") != _recorder_options(tmp_path / "default")
    # the format as before parts existed: the same keys, in the same order
    options = _recorder_options(tmp_path / "parts")
    assert list(options) == ["include", "exclude", "cheap_every", "full_every", "full_after_event",
                             "steps_per_shard", "near_overflow", "eager_full_steps", "compiled_rows", "flush_interval_s",
                             "durable_interval_s", "mode", "bundles", "reexecute"]
    assert options["bundles"] == {
        "bundles": True, "bundle_triggers": ["skipped", "scale_low"], "bundle_steps": [1], "max_bundles": 2,
        "max_bundle_bytes": 1 << 20, "min_loss_scale": 0.5, "settle_steps": 3, "snapshot_params": False,
        "snapshot_buffers_bytes": 1 << 10, "hold_steps": 3, "clone_inputs": True,
        "window_steps": 0, "max_window_bytes": 1 << 30}  # issue 23 added the window's two


def test_a_schedule_passed_in_decides_the_tiers(tmp_path):
    train(TinyNet(), batches(4), recorder=recorder_at(tmp_path / "every", schedule=RecordSchedule(full_every=1)))
    assert _tiers(tmp_path / "every") == "FFFF"

    class OddStepsFull(RecordSchedule):  # a part the user replaces: only `tier` changed
        def tier(self, step):
            return "full" if step % 2 else "cheap"

    train(TinyNet(), batches(4), recorder=recorder_at(tmp_path / "odd", schedule=OddStepsFull()))
    assert _tiers(tmp_path / "odd") == "cFcF"


def test_a_bundle_policy_passed_in_saves_its_steps(tmp_path):
    run = tmp_path / "run"
    trained = train(TinyNet(), batches(4), recorder=recorder_at(run, bundles=BundlePolicy(steps=[2], max_bundles=1)))
    assert [b["step"] for b in trained.rec.bundles.saved] == [2]
    assert _tiers(run) == "FcFc"  # step 0 by period (100), step 2 for its bundle


@pytest.mark.parametrize("options, message", [
    (dict(schedule=RecordSchedule(), full_every=5),
     "schedule=RecordSchedule(...) and full_every= both given: pass full_every= to the RecordSchedule instead"),
    (dict(bundles=BundlePolicy(), bundle_steps=[3]),
     "bundles=BundlePolicy(...) and bundle_steps= both given: pass steps= to the BundlePolicy instead"),
    (dict(writer=WriterOptions(), max_queue=8),
     "writer=WriterOptions(...) and max_queue= both given: pass max_queue= to the WriterOptions instead"),
    (dict(storage=StorageOptions(), spool_dir="/tmp"),
     "storage=StorageOptions(...) and spool_dir= both given: pass spool_dir= to the StorageOptions instead"),
    (dict(schedule={"full_every": 1}), "schedule={'full_every': 1}: give a RecordSchedule"),
    (dict(bundles="yes"), "bundles='yes': give True, False or a BundlePolicy"),
    (dict(bundle_triggers=["nan"]), "unknown bundle trigger 'nan'"),
])
def test_a_part_with_its_own_flat_keyword_or_a_bad_option_raises_before_anything_is_written(
        tmp_path, options, message):
    with pytest.raises(OptionError) as caught:
        AmpRecorder(tmp_path / "run", TinyNet(), **options)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)
    assert not (tmp_path / "run").exists()


def test_bundles_false_holds_nothing_and_records_the_policy_it_was_given(tmp_path):
    trained = train(TinyNet(), batches(3), recorder=recorder_at(tmp_path / "off", bundles=False, max_bundles=5,
                                                                bundle_steps=[1]))
    assert not trained.rec.bundles.enabled and trained.rec.bundles.saved == []
    assert not (tmp_path / "off" / "bundles").exists()
    recorded = _recorder_options(tmp_path / "off")["bundles"]
    assert (recorded["bundles"], recorded["max_bundles"], recorded["bundle_steps"]) == (False, 5, [1])
    assert _tiers(tmp_path / "off") == "Fcc"  # no bundle, so step 1 is not raised to full
    # bundles=True is the default policy
    train(TinyNet(), batches(1), recorder=recorder_at(tmp_path / "on", bundles=True))
    assert _recorder_options(tmp_path / "on")["bundles"] == BundlePolicy().config(enabled=True, snapshot_params=False)


def test_the_recorder_only_assembles_its_parts():
    """recorder.py wires the parts (sentinel, sampler, re-execution, writer
    side, capture) and keeps none of their logic: under 350 lines."""
    import recorders.recorder as module

    lines = Path(module.__file__).read_text().splitlines()
    assert len(lines) < 350, f"recorders/recorder.py has {len(lines)} lines"


# ------------------------------------------------------------ the writer side
def test_clean_steps_are_held_back_at_most_a_quarter_of_the_durable_interval(tmp_path):
    """A killed job loses its held-back steps: they wait at most a second,
    and never more than a quarter of what the journal promises to lose."""
    import recorders.run_writer as rw
    from recorders.options import WriterOptions
    for durable, held in ((5.0, rw.HOLD_BACK_S), (0.4, 0.1)):
        rec = AmpRecorder(tmp_path / str(durable), TinyNet(), writer=WriterOptions(durable_interval_s=durable))
        assert rec.run_writer._hold_back_s == pytest.approx(held) and held <= 1.0
        rec.close()


def test_held_clean_steps_go_to_the_writer_when_a_backward_pass_begins(tmp_path, monkeypatch, sentinel_mode):
    """Clean steps are handed over in batches; a due batch goes when the
    next backward pass begins (the training thread is then inside the
    autograd engine, which holds no GIL, while the writer turns the steps
    into rows), or at the next step when no backward pass began since."""
    import recorders.run_writer as rw
    from amp_postmortem import load_run
    monkeypatch.setattr(rw, "HOLD_BACK_STEPS", 3)
    monkeypatch.setattr(rw, "HOLD_BACK_S", 1e9)  # the count decides, not the clock
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    rec = AmpRecorder(tmp_path / "r", model, optimizer=opt)
    handed = []  # (steps in the batch, in a backward pass)
    submit = rec.writer.submit

    def spy(job):
        if getattr(job, "func", None) == rec.run_writer.write_steps:
            handed.append(([p.step for p in job.args[0]], torch._C._current_graph_task_id() != -1))
        return submit(job)

    monkeypatch.setattr(rec.writer, "submit", spy)
    for x, y in batches(8):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        rec.step()
    # Step 0 is a full-tier step (written alone); 1-3 are due at step 3's
    # end and go at step 4's backward, 4-6 at step 7's.
    assert handed == [([1, 2, 3], True), ([4, 5, 6], True)]
    for _ in range(3):  # steps with no forward and no backward: 7-9 are due at step 9's end ...
        rec.step()
    assert handed[2:] == [([7, 8, 9, 10], False)]  # ... and go at step 10's, no backward having begun
    assert rec.enabled
    rec.close()
    assert load_run(tmp_path / "r").steps["step"].tolist() == list(range(11))
