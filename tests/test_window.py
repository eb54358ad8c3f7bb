"""The counterfactual window: held by the recorder (`recorders/bundles/
window.py`), written when a bundle trigger fires, read back and validated
(`amp_postmortem/reading/window.py`) like a bundle."""
from __future__ import annotations

import json

import pytest
import torch

import window_runs as runs
from tiny_models import train
from amp_postmortem.errors import BundleError
from amp_postmortem.reading.window import find_window, list_windows, load_window, window_spans
from recorders.format import schema
from recorders.errors import OptionError


def test_a_window_holds_the_state_at_its_start_and_every_step_since():
    run = runs.precision_run()
    (first, rank, path), = list_windows(run)
    w = load_window(path)
    assert (w.first_step, w.rank, w.trigger_step) == (first, 0, runs.SHIFT_STEP)
    assert w.step_numbers == list(range(w.first_step, w.last_step + 1))
    assert w.last_step >= runs.SHIFT_STEP + runs.WINDOW_STEPS - 1  # K steps from the trigger on
    # The weights at the window's start are the job's: the same seed, the same init.
    if w.first_step == 0:
        for name, t in runs.gain_net().state_dict().items():
            assert torch.equal(w.params[name], t)
    x, y = runs.precision_batch(w.steps[0].step)
    (args, kwargs), = w.steps[0].inputs
    assert torch.equal(args[0], x) and torch.equal(args[1], y) and kwargs == {}
    assert w.steps[0].optimizer_groups[0]["lr"] == runs.PRECISION_LR
    assert w.optimizer["class"] == "torch.optim.sgd.SGD" and w.scaler["init_scale"] == 2.0 ** 8
    assert w.autocast["dtype"] == "float16"


def test_windows_are_off_by_default_and_cost_nothing(tmp_path):
    from recorders import AmpRecorder, BundlePolicy
    model = runs.linear_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = AmpRecorder(tmp_path / "r", model, optimizer=opt)
    try:
        assert rec.bundles.window is None
        assert rec.bundles.config["window_steps"] == 0
    finally:
        rec.close()
    assert not (tmp_path / "r" / schema.WINDOWS_DIR).exists()
    with pytest.raises(OptionError, match="window_steps"):
        BundlePolicy(window_steps="many")
    assert window_spans(runs.instability_run(0)) == [] and find_window(runs.instability_run(0)) is None


def test_a_state_larger_than_the_byte_bound_turns_the_window_off(tmp_path):
    from recorders import AmpRecorder, BundlePolicy
    policy = BundlePolicy(window_steps=2, max_window_bytes=8)
    with pytest.warns(RuntimeWarning, match="max_window_bytes=8"):
        runs.train(runs.linear_net(), runs.linear_batch, lr=runs.INSTABILITY_LR, steps=4,
                   recorder=lambda m, o, s: AmpRecorder(tmp_path / "r", m, optimizer=o, scaler=s, bundles=policy))
    assert list_windows(tmp_path / "r") == []


def _copy(run, tmp_path):
    import shutil
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    (_, _, path), = list_windows(dst)
    return path


def test_an_edited_or_damaged_window_is_refused(tmp_path):
    path = _copy(runs.precision_run(), tmp_path)
    meta_file = path / schema.WINDOW_MANIFEST_FILE
    meta = json.loads(meta_file.read_text())
    meta["trigger_step"] = 0
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(BundleError, match="checksum"):
        load_window(path)
    path = _copy(runs.instability_run(), tmp_path / "b")
    tensors = path / schema.WINDOW_TENSORS_FILE
    data = bytearray(tensors.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tensors.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="sha256"):
        load_window(path)


def test_a_window_of_another_run_put_into_a_run_is_refused(tmp_path):
    # Checksummed anew, so only its run id betrays it: as for bundles.
    from recorders.format.plain import json_checksum
    path = _copy(runs.precision_run(), tmp_path)
    meta_file = path / schema.WINDOW_MANIFEST_FILE
    meta = json.loads(meta_file.read_text())
    meta["run_id"] = "another-run"
    meta["checksum"] = json_checksum(meta)
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(BundleError, match="a window of another run was put here"):
        load_window(path)


def test_a_restarted_window_reruns_the_recorded_steps_from_its_own_start(tmp_path):
    """Adam's moments and the scaler's scale copied at a later restart: the
    re-run as recorded reproduces the recorded losses from there."""
    import math

    import amp_postmortem as api
    from recorders import AmpRecorder, BundlePolicy
    model = runs.gain_net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    losses = train(model, [runs.precision_batch(step - 4) for step in range(12)],  # the float16 overflow from step 8
                   recorder=lambda m, o, s: AmpRecorder(tmp_path / "r", m, optimizer=o, scaler=s,
                                                        bundles=BundlePolicy(window_steps=3)),
                   optimizer=opt, scaler=sc, loss_fn=lambda model, x, y, step, accumulate: model(x, y),
                   # the writer decides before the next step: the window restarts on time
                   after_step=lambda step, rec: rec.flush()).losses
    first = next(i for i, v in enumerate(losses) if not math.isfinite(v))
    (start, _, path), = list_windows(tmp_path / "r")
    w = load_window(path)
    assert 0 < start <= first == w.trigger_step and w.last_step == 11
    assert {k for _, k, _ in w.optimizer_state} >= {"exp_avg", "exp_avg_sq"} and "scale" in w.scaler_state
    r = api.rerun(tmp_path / "r", model="tests/window_runs.py:gain_net")
    assert [s.step for s in r.steps] == list(range(start, 12))
    for s in r.steps:
        if s.step < first:
            assert s.finite and s.loss == pytest.approx(losses[s.step], rel=1e-4)
    assert r.first_nonfinite_step == first
    assert api.rerun(tmp_path / "r", model="tests/window_runs.py:gain_net", precision="fp32").carries
