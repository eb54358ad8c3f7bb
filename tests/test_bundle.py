"""Replay bundles: when they are saved, what they hold, and that a replay of
their contents reproduces the step, bit for bit, on the same machine."""
import json
import math
import threading
import pickle
import shutil

import pyarrow.dataset as ds
import pytest
import torch
import torch.nn as nn

from amp_postmortem.reading.bundle import autocast_dtype, find_bundle, list_bundles, load_bundle
from amp_postmortem.errors import BundleError
from recorders import AmpRecorder
from recorders.format import schema
from recorders.bundles.triggers import BundleTriggers
from recorders.bundles.directory import write_tensors
from recorders.format.plain import json_checksum
from recorders.format.tensor_codec import host_array, tensor_from_bytes
from framework_runs import manifest
from tiny_models import PlantedNet, batches, recorder_at
from tiny_models import train as train_loop


class Counter(nn.Module):
    """A buffer every forward changes (like BatchNorm's running stats)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls += 1
        return x


class LossNet(nn.Module):
    """A planted overflow, dropout (RNG), a changing buffer, nested keyword
    inputs and the loss computed inside, so a replay can recompute it."""

    def __init__(self):
        super().__init__()
        self.counter = Counter()
        self.drop = nn.Dropout(0.25)
        self.body = PlantedNet()

    def forward(self, x, *, target, opts):
        out = self.body(self.drop(self.counter(x)))
        return (((out.float() - target) ** 2) * opts["weights"][0]).mean() * opts["gain"]


def train(run, steps, *, dtype=torch.float16, scaler=True, accumulate=1, arm=(), nan_at=(),
          gain=1.0, gains=None, request=(), lr=0.05, stall=None, **options):
    """The tests' training loop on LossNet; returns what a test compares
    against: per step the state_dict before the step and the gradients that
    optimizer.step() received (scaled, before unscaling), and the recorder.
    `stall=(a, b)`: the writer thread is held from step a's backward to step
    b's, as when it shares a loaded machine's cores with the training."""
    release = threading.Event()
    torch.manual_seed(0)
    weights = torch.linspace(0.5, 1.5, 4)
    seen = []

    def plant(step, model, x):
        model.body.boom.gain = math.nan if step in nan_at else 1e6 if step in arm else 1.0
        seen.append({"before": {k: v.detach().clone() for k, v in model.state_dict().items()}})

    def loss_fn(model, x, y, step, accumulate):
        g = (gains or {}).get(step, gain)
        return model(x, target=y, opts={"weights": (weights, "w"), "gain": g / accumulate})

    def ask_for_bundle(step, micro_batch, rec):
        if step in request and micro_batch == 0:
            rec.save_bundle()
        if stall and micro_batch == 0:
            if step == stall[0]:
                rec.writer.submit(lambda: release.wait(30))
            elif step == stall[1]:
                release.set()

    def grads(step, model):
        seen[-1]["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}

    rec = train_loop(LossNet(), batches(steps * accumulate), recorder=recorder_at(run, **options), dtype=dtype,
                     scaler=scaler, accumulate=accumulate, lr=lr, loss_fn=loss_fn, on_step=plant,
                     after_backward=ask_for_bundle, before_update=grads).rec
    return seen, rec


def replay(bundle, micro_batch=0, *, boom=None):
    """Forward of one micro-batch in a fresh model under the recorded
    autocast policy; `boom`: the planted module's gain (None: 1)."""
    model = LossNet()
    model.load_state_dict(bundle.state_dict(), strict=True)
    model.body.boom.gain = 1.0 if boom is None else boom
    torch.set_rng_state(bundle.micro_batch_rng[micro_batch]["cpu"])
    args, kwargs = bundle.inputs[micro_batch]
    ac = bundle.autocast
    with torch.autocast(ac["device_type"], dtype=autocast_dtype(bundle), enabled=ac["enabled"]):
        return model(*args, **kwargs)


def test_planted_overflow_saves_one_bundle_at_the_first_nonfinite_step_and_it_reproduces(tmp_path):
    run = tmp_path / "run"
    seen, _ = train(run, 8, arm={5})
    assert [(s, r) for s, r, _ in list_bundles(run)] == [(5, 0)]
    entry, = manifest(run)["bundles"]
    assert entry["step"] == 5 and entry["path"] == "bundles/step=5/rank=0"
    assert entry["reasons"] == ["nonfinite_loss", "nonfinite_tensor"]  # skipped: scale not settled yet

    b = load_bundle(run, step=5)
    assert (b.step, b.rank, b.reason, b.micro_batches) == (5, 0, "nonfinite_loss", 1)
    assert math.isnan(b.loss) and b.loss_scale == 65536.0 and b.exact
    assert b.autocast == {"enabled": True, "device_type": "cpu", "dtype": "float16", "cache_enabled": True}
    assert b.scaler["scale"] == 65536.0 and b.scaler["scale_after"] == 32768.0
    assert b.scaler["growth_tracker"] == 5 and b.scaler["growth_tracker_after"] == 0
    for name, value in seen[5]["before"].items():  # the weights the forward used
        assert torch.equal(b.state_dict()[name], value), name
    assert b.model_class == "test_bundle.LossNet" and b.optimizer["class"] == "torch.optim.sgd.SGD"
    assert not torch.isfinite(replay(b, boom=1e6))


def test_finite_bundles_of_every_micro_batch_replay_the_loss_bit_for_bit(tmp_path):
    run = tmp_path / "run"
    seen, _ = train(run, 5, accumulate=2, bundle_steps=[1], request={3})
    assert [s for s, _, _ in list_bundles(run)] == [1, 3]
    for step, reason in ((1, "step_list"), (3, "request")):
        b = load_bundle(find_bundle(run, step))
        assert b.reason == reason and b.micro_batches == 2 and b.exact
        assert b.meta["params"]["source"] == "pre_step_snapshot"
        assert int(b.buffers["counter.calls"]) == 2 * step  # as at the step's first forward
        args, kwargs = b.inputs[1]
        assert isinstance(args, tuple) and args[0].shape == (4, 5, 8)
        assert kwargs["opts"]["weights"][1] == "w" and isinstance(kwargs["opts"]["weights"], tuple)
        assert kwargs["opts"]["gain"] == 0.5
        for k in range(2):
            raw, = b.grad_outputs_raw[k]
            assert raw.dtype == torch.float32 and raw.item() == 65536.0 * 1.0  # d(scaled loss)/d(loss)
            assert b.grad_outputs[k][0].dtype == torch.float64 and b.grad_outputs[k][0].item() == 1.0
        losses = [replay(b, k).item() for k in range(2)]
        assert losses[1] == b.loss  # the last micro-batch's loss, as passed to rec.step()
        assert losses[0] != losses[1]


def test_backward_replay_reproduces_the_training_gradients_bit_for_bit(tmp_path):
    run = tmp_path / "run"
    seen, _ = train(run, 3, accumulate=2, bundle_steps=[2])
    b = load_bundle(run, step=2)
    model = LossNet()
    model.load_state_dict(b.state_dict(), strict=True)
    for k in range(2):
        torch.set_rng_state(b.micro_batch_rng[k]["cpu"])
        args, kwargs = b.inputs[k]
        with torch.autocast("cpu", dtype=autocast_dtype(b)):
            loss = model(*args, **kwargs)
        torch.autograd.backward([loss], [b.grad_outputs_raw[k][0]])
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, seen[2]["grads"][name]), name


def test_a_lagging_writer_still_saves_the_forwards_buffers(tmp_path):
    # The writer decides on steps 1-8 only after step 9: every held step keeps
    # its forward's buffers (the counter changes at each forward).
    run = tmp_path / "run"
    seen, _ = train(run, 14, arm={5}, stall=(1, 9))
    b = load_bundle(run, step=5)
    assert b.exact and b.meta["buffers"]["source"] == "forward_snapshot"
    for name, value in seen[5]["before"].items():
        assert torch.equal(b.state_dict()[name], value), name


def test_calibration_skips_of_a_fresh_scaler_do_not_trigger_and_the_cap_holds(tmp_path):
    run = tmp_path / "run"
    # gain 100: the fresh scaler's 65536 overflows the float16 gradients, so
    # the first steps are skipped while it calibrates down.
    with pytest.warns(RuntimeWarning, match="bundle of step 12 not saved: max_bundles=1 reached"):
        train(run, 14, gain=100.0, lr=5e-4, gains={10: 1e5}, nan_at={12}, settle_steps=3, max_bundles=1)
    steps = ds.dataset(run / "rank=0" / "steps", format="parquet").to_table().to_pandas()
    skipped = steps.loc[steps["skipped"], "step"].tolist()
    assert skipped == [0, 1, 2, 3, 4, 10, 12]  # 0-4: calibrating down from 65536
    assert [s for s, _, _ in list_bundles(run)] == [10]
    m = manifest(run)
    assert m["bundles"][0]["reasons"] == ["skipped"]
    missed, = m["bundles_missed"]
    assert missed["step"] == 12 and missed["reasons"] == ["nonfinite_loss", "nonfinite_tensor"]
    assert "max_bundles=1" in missed["why"]
    b = load_bundle(run, step=10)
    assert b.exact and b.meta["params"]["source"] in ("copy_after_forward", "copy_before_next_update")


def test_the_byte_cap_holds(tmp_path):
    run = tmp_path / "run"
    with pytest.warns(RuntimeWarning, match="max_bundle_bytes"):
        train(run, 4, bundle_steps=[1, 2, 3], max_bundle_bytes=15_000)  # one bundle is ~10 kB
    assert [s for s, _, _ in list_bundles(run)] == [1]
    assert [m["step"] for m in manifest(run)["bundles_missed"]] == [2, 3]


def test_bf16_without_a_scaler_saves_the_weights_before_the_update(tmp_path):
    run = tmp_path / "run"
    seen, rec = train(run, 6, dtype=torch.bfloat16, scaler=False, nan_at={3})
    assert not torch.isfinite(rec.model.body.head.weight).all()  # the update spread the NaN
    assert [s for s, _, _ in list_bundles(run)] == [3]
    b = load_bundle(run, step=3)
    assert b.reasons == ["nonfinite_loss", "nonfinite_tensor"]
    assert b.meta["params"] == {**b.meta["params"], "source": "pre_step_snapshot", "exact": True}
    assert b.loss_scale is None and b.scaler is None and b.autocast["dtype"] == "bfloat16"
    for name, value in seen[3]["before"].items():
        assert torch.equal(b.state_dict()[name], value), name
    assert all(torch.isfinite(p).all() for p in b.params.values())
    assert math.isnan(replay(b, boom=math.nan).item())


@pytest.mark.parametrize("mode", ["every_step", "sentinel"])
@pytest.mark.parametrize("when", ["before_forward", "after_backward"])
def test_a_weight_written_after_the_forward_makes_the_bundle_inexact(when, mode, tmp_path):
    """The weights a bundle holds are those of its step's forward only if no
    parameter was written since: a loop's write before the forward (a
    reload, a planted fault) is what the forward used; one after the
    backward, before the update, is not, and the bundle says so."""
    run = tmp_path / "run"

    def poke(step, model):
        if step == 3:
            with torch.no_grad():
                model.body.head.weight[0, 0] += 1.0

    def on_step(step, model, x):
        model.body.boom.gain = math.nan if step == 3 else 1.0
        if when == "before_forward":
            poke(step, model)

    def loss_fn(model, x, y, step, accumulate):
        return model(x, target=y, opts={"weights": (torch.ones(4), "w"), "gain": 1.0})

    train_loop(LossNet(), batches(5), recorder=recorder_at(run, mode=mode), dtype=torch.bfloat16, scaler=False,
               loss_fn=loss_fn, on_step=on_step,
               before_update=poke if when == "after_backward" else None)
    b = load_bundle(run, step=3)
    assert b.meta["params"]["source"] == "pre_step_snapshot"
    assert b.meta["params"]["exact"] is (when == "before_forward")


def _four_steps(run, *, grads_by_hand: bool = False, after_grads=None, **options) -> None:
    """A small MLP without a scaler trained 4 steps under
    `AmpRecorder(run, ..., **options)`, its gradients from a backward pass
    or set by hand; `after_grads(step, model, rec)` runs before each update."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = AmpRecorder(run, model, optimizer=opt, **options)
    for step in range(4):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        if grads_by_hand:
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.01)
        else:
            loss.backward()
        if after_grads is not None:
            after_grads(step, model, rec)
        opt.step()
        opt.zero_grad()
        rec.step(loss)
    rec.close()


@pytest.mark.parametrize("mode", ["every_step", "sentinel"])
@pytest.mark.parametrize("grads", ["backward", "by_hand"])
def test_a_step_named_up_front_holds_the_weights_its_forward_used(grads, mode, tmp_path):
    """A step named in `bundle_steps` keeps the copy of its weights taken
    before the update, clean facts or not (a clean step's pooled copy went
    back at its close, and its bundle said `copy_after_update`). The weights
    are judged by the parameters' version counters, read when the step's
    backward ends, or, with gradients set by hand (no backward pass), at the
    optimizer's pre-step hook: exact either way."""
    run = tmp_path / "run"
    _four_steps(run, grads_by_hand=grads == "by_hand", bundle_steps=[2], mode=mode)
    b = load_bundle(run, step=2)
    assert b.meta["params"]["source"] == "pre_step_snapshot"
    assert b.meta["params"]["exact"] is True


@pytest.mark.parametrize("write", [True, False])
def test_a_clean_step_asked_for_after_its_backward_is_never_judged_exact(write, tmp_path):
    """A clean step of a job without a scaler is not judged by its
    weights' version counters at its backward's end (the update follows and
    changes them anyway: `BundleCapture._take_versions`). A bundle asked for once
    that backward has ended holds the weights taken before the update, and
    says they are not known to be the forward's, whether a write came in
    between (then they are not) or not: never wrongly exact."""
    def after_grads(step, model, rec):
        if step == 2:
            if write:
                with torch.no_grad():
                    model[0].weight[0, 0] += 1.0
            rec.save_bundle()

    run = tmp_path / "run"
    _four_steps(run, after_grads=after_grads, mode="sentinel")
    b = load_bundle(run, step=2)
    assert b.meta["params"]["source"] == "pre_step_snapshot"
    assert b.meta["params"]["exact"] is False


def test_clean_cpu_steps_copy_no_weights_and_the_nonfinite_step_still_does(tmp_path, monkeypatch):
    # Without a scaler the weights are copied before each update that may
    # need a bundle; on the CPU a step whose statistics are all finite cannot.
    from recorders.bundles import held
    copies = []
    real = held.SnapshotPool.take
    monkeypatch.setattr(held.SnapshotPool, "take", lambda self: copies.append(self) or real(self))
    run = tmp_path / "run"
    seen, rec = train(run, 6, dtype=torch.bfloat16, scaler=False, nan_at={3})
    # Step 3 (NaN planted), then 4 and 5, whose weights the update made NaN
    # (close() drops the pools: the parameters' pool is the one over them).
    n_params = len(list(rec.model.parameters()))
    assert sum(len(pool.tensors) == n_params for pool in copies) == 3
    b = load_bundle(run, step=3)
    assert b.meta["params"]["source"] == "pre_step_snapshot" and b.meta["params"]["exact"]


@pytest.fixture(scope="module")
def saved_bundle(tmp_path_factory):
    run = tmp_path_factory.mktemp("bundle") / "run"
    train(run, 2, bundle_steps=[1])
    return find_bundle(run, 1)


def copy(bundle, tmp_path):
    dst = tmp_path / "b"
    shutil.copytree(bundle, dst)
    return dst


def test_a_tampered_file_is_refused(saved_bundle, tmp_path):
    b = copy(saved_bundle, tmp_path)
    f = b / schema.BUNDLE_TENSORS_FILE
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="tensors.parquet fails its sha256 check"):
        load_bundle(b)


def test_a_truncated_file_is_refused(saved_bundle, tmp_path):
    b = copy(saved_bundle, tmp_path)
    f = b / schema.BUNDLE_TENSORS_FILE
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(BundleError, match=r"tensors.parquet is truncated \(\d+ of \d+ bytes\)"):
        load_bundle(b)
    (b / "bundle.json").write_text((b / "bundle.json").read_text()[:200])
    with pytest.raises(BundleError, match="bundle.json is truncated or not JSON"):
        load_bundle(b)


def test_edited_missing_and_newer_bundles_are_refused(saved_bundle, tmp_path):
    b = copy(saved_bundle, tmp_path)
    meta = json.loads((b / "bundle.json").read_text())
    (b / "bundle.json").write_text(json.dumps(dict(meta, loss=0.0)))
    with pytest.raises(BundleError, match="fails its checksum"):
        load_bundle(b)
    newer = dict(meta, version="2.0")
    newer["checksum"] = json_checksum(newer)
    (b / "bundle.json").write_text(json.dumps(newer))
    with pytest.raises(BundleError, match="newer than this amp-postmortem reads.*upgrade"):
        load_bundle(b)
    (b / "bundle.json").unlink()
    with pytest.raises(BundleError, match="not a replay bundle: .*bundle.json is missing"):
        load_bundle(b)
    with pytest.raises(BundleError, match="bundle not found"):
        load_bundle(tmp_path / "nowhere")
    run = saved_bundle.parent.parent.parent
    with pytest.raises(BundleError, match=r"no bundle for step 7 .*\(bundles exist for steps: 1\)"):
        find_bundle(run, 7)
    with pytest.raises(BundleError, match="is a run directory"):
        load_bundle(run)


def test_a_bundle_of_an_older_minor_version_without_placements_reads_as_before(saved_bundle, tmp_path):
    b = copy(saved_bundle, tmp_path)
    meta = json.loads((b / "bundle.json").read_text())
    assert "placements" not in meta["params"]  # an unsharded job's
    older = dict(meta, version="1.1")
    older["checksum"] = json_checksum(older)
    (b / "bundle.json").write_text(json.dumps(older))
    loaded = load_bundle(b)
    assert loaded.shard_ranks == [] and loaded.params.keys() == load_bundle(saved_bundle).params.keys()


def test_a_sharded_bundle_out_of_its_run_is_refused_in_one_line(saved_bundle, tmp_path):
    b = copy(saved_bundle, tmp_path)
    meta = json.loads((b / "bundle.json").read_text())
    name = meta["params"]["names"][0]
    meta["params"]["placements"] = {name: {"kind": "flat", "global_shape": [4], "flat_offset": 0, "numel": 4}}
    meta["checksum"] = json_checksum(meta)
    (b / "bundle.json").write_text(json.dumps(meta))
    with pytest.raises(BundleError, match=r"holds rank 0's shards only: replay it in its run directory") as e:
        load_bundle(b)
    assert "\n" not in str(e.value)


def test_no_pickle_is_used_to_write_or_read_bundles(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("pickle used")

    for name in ("dump", "dumps", "load", "loads", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "save", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    run = tmp_path / "run"
    train(run, 3, bundle_steps=[1])
    assert "bundles_missed" not in manifest(run)  # a failed write would be listed there
    b = load_bundle(run, step=1)
    assert b.exact and manifest(run)["bundles"][0]["step"] == 1


def test_save_bundle_then_flush_puts_the_bundle_on_disk_before_close(tmp_path):
    model = PlantedNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = AmpRecorder(tmp_path / "run", model, optimizer=opt)

    def ask(step, model, x):
        if step == 1:
            rec.save_bundle()  # before the forward: this step

    with rec:
        train_loop(model, batches(3), recorder=lambda *_: rec, optimizer=opt, dtype=None, scaler=None, on_step=ask,
                   pass_loss=False, close=False)
        rec.flush()
        assert [s for s, _, _ in list_bundles(tmp_path / "run")] == [1]
        assert manifest(tmp_path / "run")["bundles"][0]["reason"] == "request"
    b = load_bundle(tmp_path / "run", step=1, rank=0)
    assert b.loss is None and b.autocast["enabled"] is False and b.meta["params"]["exact"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                   torch.int64, torch.uint8, torch.bool])
def test_tensors_round_trip_bit_exactly(dtype, tmp_path, monkeypatch):
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)  # every 16-bit pattern
    if dtype in (torch.float16, torch.bfloat16):
        t = bits.view(dtype).reshape(256, 256)  # NaN payloads, -0, subnormals, Inf
    elif dtype == torch.bool:
        t = torch.arange(10) % 3 == 0
    else:
        t = (torch.randn(7, 3, dtype=torch.float64) * 1e3).to(dtype)
    back = tensor_from_bytes(host_array(t).tobytes(), str(dtype).replace("torch.", ""), t.shape)
    assert back.dtype == t.dtype and back.shape == t.shape
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    assert torch.equal(back.view(view), t.view(view))
    # split over several Parquet rows
    monkeypatch.setattr(schema, "BUNDLE_CHUNK_BYTES", 1000)
    write_tensors(tmp_path / "t.parquet", [("t", "param", -1, t, False)], {})
    from amp_postmortem.reading.bundle import _read_tensors
    got = _read_tensors(tmp_path / "t.parquet")[("param", "t", -1)]
    assert torch.equal(got.view(view), t.view(view))


def summary(step, *, loss=1.0, skipped=False, scale=65536.0, forward_nan=0, backward_nan=0):
    cols = {"name": ["a", "b"], "phase": ["forward", "backward"],
            "nan_count": [forward_nan, backward_nan], "inf_count": [0, 0]}
    return {"step": step, "loss": loss, "skipped": skipped, "loss_scale": scale, "columns": cols}


def test_triggers_fire_once_settle_and_respect_the_count_cap():
    t = BundleTriggers(has_scaler=True, settle_steps=2, max_bundles=3, min_loss_scale=1.0)
    assert t.decide(summary(0, skipped=True, backward_nan=5)) == ([], False)   # calibrating
    assert t.decide(summary(1)) == ([], False)
    assert t.decide(summary(2, skipped=True)) == ([], False)                  # run of clean steps restarts
    assert t.decide(summary(3)) == ([], False) and t.decide(summary(4)) == ([], False)
    assert t.decide(summary(5, skipped=True)) == (["skipped"], True)
    assert t.decide(summary(6, skipped=True)) == ([], False)                  # latched
    assert t.decide(summary(7, loss=math.inf, forward_nan=1)) == (["nonfinite_loss", "nonfinite_tensor"], True)
    assert t.decide(summary(8, scale=0.5), ["request"]) == (["scale_low", "request"], True)
    assert t.decide(summary(9), ["step_list"]) == (["step_list"], False)      # cap of 3 reached
    no_scaler = BundleTriggers(has_scaler=False, settle_steps=2)
    assert no_scaler.decide(summary(0, backward_nan=1, scale=None)) == (["nonfinite_tensor"], True)
    with pytest.raises(ValueError, match="unknown bundle trigger 'nan'"):
        BundleTriggers(["nan"], has_scaler=True)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)
        self.head.weight = self.embed.weight
        self.register_buffer("mask", torch.tensor([1.0, 0.0, 1.0, 1.0]), persistent=False)

    def forward(self, x):
        return self.head(self.embed(x)) * self.mask


def test_tied_weights_and_non_persistent_buffers_load_strictly(tmp_path):
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with AmpRecorder(tmp_path / "run", model, optimizer=opt, bundle_steps=[0]) as rec:
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        rec.step()
    b = load_bundle(tmp_path / "run", step=0)
    assert b.meta["params"]["aliases"] == {"head.weight": "embed.weight"}
    assert b.params["head.weight"] is b.params["embed.weight"]
    assert set(b.extra_buffers) == {"mask"} and not b.buffers
    fresh = Tied()
    fresh.load_state_dict(b.state_dict(), strict=True)


def test_a_step_asked_for_but_not_sampled_is_saved_all_the_same(tmp_path):
    # The root's hooks hold every step's inputs, sampled or not (what a
    # re-execution needs): a step the schedule does not record still has
    # its bundle.
    train_loop(PlantedNet(), batches(3), recorder=recorder_at(tmp_path / "run", cheap_every=2, bundle_steps=[1, 2]),
               dtype=None, scaler=None, lr=0.1, pass_loss=False)
    assert [s for s, _, _ in list_bundles(tmp_path / "run")] == [1, 2]
    assert "bundles_missed" not in manifest(tmp_path / "run")


def _adam_job(run, **options):
    """Adam under a GradScaler; step 1's batch holds an Inf (the scaler skips it)."""
    from tiny_models import TinyNet
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def inf_at_step_1(step, model, x):
        if step == 1:
            x[0, 0, 0] = math.inf

    train_loop(model, batches(2), recorder=recorder_at(run, **options), optimizer=opt,
               scaler={"init_scale": 2.0 ** 8}, on_step=inf_at_step_1)
    return model, opt


def test_the_optimizer_state_is_saved_and_is_the_one_a_skipped_step_would_have_used(tmp_path):
    """The state saved with the skipped step's bundle is the one its update
    would have used (no optimizer step since), `state_exact`."""
    model, opt = _adam_job(tmp_path / "run")
    b = load_bundle(tmp_path / "run", step=1)
    assert b.meta["optimizer"]["state_source"] == "copy_before_update" and b.meta["optimizer"]["state_exact"]
    names = dict(model.named_parameters())
    saved = {(n, k): v for n, k, v in b.optimizer_state}
    expected = {(n, k): v for n, p in names.items() for k, v in opt.state[p].items()}
    assert saved.keys() == expected.keys() and len(saved) == 3 * len(names)
    assert all(torch.equal(saved[k], expected[k]) for k in saved)


def raw_bytes(bundle_dir) -> int:
    """The raw bytes of a bundle's tensors, as its byte cap counts them."""
    import pyarrow.parquet as pq
    from recorders.format.tensor_codec import itemsize, parse_dtype
    rows = pq.read_table(bundle_dir / schema.BUNDLE_TENSORS_FILE, columns=["dtype", "shape", "offset"]).to_pylist()
    return sum(math.prod(r["shape"]) * itemsize(parse_dtype(r["dtype"])) for r in rows if r["offset"] == 0)


def test_a_bundle_that_fits_only_without_the_optimizer_state_is_saved_without_it(tmp_path):
    _adam_job(tmp_path / "whole")
    whole = load_bundle(tmp_path / "whole", step=1)
    state = sum(t.numel() * t.element_size() for _, _, t in whole.optimizer_state)
    raw = raw_bytes(find_bundle(tmp_path / "whole", 1))
    _adam_job(tmp_path / "cut", max_bundle_bytes=raw - state // 2)
    cut = load_bundle(tmp_path / "cut", step=1)
    assert cut.optimizer_state == [] and "max_bundle_bytes" in cut.meta["optimizer"]["state_omitted"]
    assert cut.params.keys() == whole.params.keys()
