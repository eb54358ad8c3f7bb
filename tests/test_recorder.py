"""The recorder: what it writes, and that it never changes or stops the training."""
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest
import torch

from framework_runs import read_table as read
from recorders import AmpRecorder
from recorders.format import schema
from tiny_models import FancyOutputs, PlantedNet, TinyNet, batches, mse, recorder_at, train


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_recording_does_not_change_one_bit_of_training(tmp_path, dtype):
    data = batches(8)
    torch.manual_seed(0)
    plain = train(TinyNet(), data, dtype=dtype, scaler=dtype == torch.float16)
    torch.manual_seed(0)
    recorded = train(TinyNet(), data, dtype=dtype, scaler=dtype == torch.float16,
                     recorder=recorder_at(tmp_path / "run", full_every=2))
    assert plain[0] == recorded[0]
    assert plain[1] == recorded[1]
    assert all(torch.equal(a, b) for a, b in zip(plain[2], recorded[2]))
    assert len(read(tmp_path / "run", "steps")) == 8


def test_every_column_round_trips_with_the_documented_types(tmp_path):
    run = tmp_path / "run"
    torch.manual_seed(0)
    losses, scales, _, _ = train(TinyNet(), batches(4), recorder=recorder_at(run, full_every=2))
    steps_file = next((run / "rank=0" / "steps").glob("*.parquet"))
    tensors_file = next((run / "rank=0" / "tensors").glob("*.parquet"))
    assert pq.read_schema(steps_file).remove_metadata() == schema.STEP_SCHEMA
    assert pq.read_schema(tensors_file).remove_metadata() == schema.TENSOR_SCHEMA
    meta = pq.read_schema(tensors_file).metadata
    assert meta[schema.META_SCHEMA_VERSION] == schema.SCHEMA_VERSION.encode()
    assert meta[schema.META_RANK] == b"0" and meta[schema.META_WORLD_SIZE] == b"1"

    steps = read(run, "steps")
    assert steps["step"].tolist() == [0, 1, 2, 3]
    assert steps["loss"].tolist() == pytest.approx(losses, rel=1e-6)
    assert steps["loss_scale"].tolist() == scales
    assert steps["loss_scale_before"].tolist() == [65536.0] + scales[:-1]
    assert steps["tier"].tolist() == ["full", "cheap", "full", "cheap"]
    assert steps["lr"].iloc[0].tolist() == [0.05]
    assert (steps["micro_batches"] == 1).all()

    t = read(run, "tensors")
    assert set(t["kind"]) == {"input", "activation", "grad_output", "grad_input", "param_grad", "param", "loss"}
    s0 = t[t.step == 0]
    assert s0[s0.kind == "param"]["name"].tolist()[:2] == ["embed.weight", "embed.bias"]
    assert s0["min"].notna().all() and t[t.step == 1]["min"].isna().all()
    # forward hooks fire as modules finish: children before parents
    fwd = s0[(s0.kind == "activation")].sort_values("order")["name"].tolist()
    assert fwd.index("blocks.0.attn.qkv") < fwd.index("blocks.0.attn.out") < fwd.index("blocks.0.attn") < fwd.index("blocks.0")
    assert fwd[-1] == ""
    # param grads are unscaled; grad_output rows are scaled by 65536
    head_grad = s0[(s0.name == "head") & (s0.kind == "grad_output")]["absmax"].item()
    assert head_grad > 100
    assert s0[s0.kind == "param_grad"]["absmax"].max() < 10
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "closed"
    assert manifest["autocast"] == {"enabled": True, "device_type": "cpu", "dtype": "float16", "cache_enabled": True}
    assert manifest["scaler"]["init_scale"] == 65536.0
    assert [m["name"] for m in manifest["modules"]][:3] == ["", "embed", "blocks"]
    assert manifest["steps_recorded"] == 4


def test_skipped_flag_is_exact_against_a_scaler_forced_to_overflow(tmp_path):
    run = tmp_path / "run"
    stepped = []  # the truth: whether optimizer.step() ran, per step

    def recorder_and_truth(model, opt, sc):
        opt.register_step_post_hook(lambda *a: stepped.__setitem__(-1, True))
        return AmpRecorder(run, model, optimizer=opt, scaler=sc)

    def loss_fn(model, x, y, step, accumulate):
        stepped.append(False)
        return mse(model, x, y, step, accumulate) * (1e4 if step == 13 else 1.0)

    torch.manual_seed(0)
    train(TinyNet(), batches(16), recorder=recorder_and_truth, loss_fn=loss_fn, lr=0.01,
          scaler={"init_scale": 2.0 ** 21, "growth_interval": 3})
    steps = read(run, "steps")
    truth = [not s for s in stepped]
    assert truth[0] is True  # 2**21 overflows on the very first step
    assert any(truth) and not all(truth)
    assert steps["skipped"].tolist() == truth


def test_planted_overflow_shows_a_nonfinite_activation_at_its_step_and_order(tmp_path):
    run = tmp_path / "run"
    torch.manual_seed(0)

    def arm(step, model, x):
        model.boom.gain = 1e6 if step >= 3 else 1.0

    train(PlantedNet(), batches(5), recorder=recorder_at(run), on_step=arm)
    t = read(run, "tensors")
    bad = t[(t.nan_count + t.inf_count > 0) & (t.phase == "forward")]
    assert bad["step"].min() == 3
    first = bad[bad.step == 3].sort_values("order").iloc[0]
    assert first["name"] == "boom" and first["kind"] == "activation"
    assert first["input_nonfinite"] == 0
    mid = bad[(bad.step == 3) & (bad.name == "mid")].iloc[0]
    assert mid["input_nonfinite"] > 0  # mid only propagates it
    steps = read(run, "steps")
    assert steps["skipped"].tolist()[3:] == [True, True]
    assert math.isnan(steps["loss"].iloc[3]) or math.isinf(steps["loss"].iloc[3])


def test_gradient_accumulation_aggregates_micro_batches_into_one_step(tmp_path):
    run = tmp_path / "run"
    torch.manual_seed(0)
    train(TinyNet(), batches(6), accumulate=3, recorder=recorder_at(run, full_every=1))
    steps = read(run, "steps")
    assert steps["step"].tolist() == [0, 1]
    assert steps["micro_batches"].tolist() == [3, 3]
    t = read(run, "tensors")
    emb = t[(t.step == 0) & (t.name == "embed") & (t.kind == "activation")]
    assert len(emb) == 1 and emb["numel"].item() == 3 * 4 * 5 * 16
    assert len(t[(t.step == 0) & (t.kind == "param_grad") & (t.name == "embed.weight")]) == 1


def test_outputs_of_any_structure_repeated_calls_frozen_params_and_eval_passes(tmp_path):
    run = tmp_path / "run"
    torch.manual_seed(0)

    def loss_fn(model, x, y, step, accumulate):
        out = model(x)
        return ((out.logits.float() - y) ** 2).mean() + out.aux.float().mean()

    def eval_pass(step, model):
        with torch.no_grad():
            model(data[step][0])  # an eval pass between steps is not a micro-batch

    data = batches(3, d_out=4)
    train(FancyOutputs(), data, recorder=recorder_at(run), lr=0.01, loss_fn=loss_fn, after_update=eval_pass)
    t = read(run, "tensors")
    steps = read(run, "steps")
    assert steps["micro_batches"].tolist() == [1, 1, 1]
    shared = t[(t.step == 0) & (t.name == "shared") & (t.kind == "activation")]
    assert sorted(shared["call"]) == [0, 1]
    assert set(t[t.kind == "activation"]["name"]) == {"", "shared", "frozen", "split", "split.a", "split.b"}
    assert "frozen.weight" not in set(t[t.kind == "param_grad"]["name"])
    root = t[(t.step == 0) & (t.name == "") & (t.kind == "activation")]
    assert root["numel"].item() == 2 * 4 * 5 * 4  # logits + aux of the dataclass


def test_a_hook_that_raises_turns_recording_off_and_training_goes_on(tmp_path, monkeypatch):
    import recorders.collectors.state as rr  # where every row's statistics are taken
    data = batches(6)
    torch.manual_seed(0)
    plain = train(TinyNet(), data)
    calls = {"n": 0}
    real = rr.row_stats

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] > 100:
            raise RuntimeError("boom inside a hook")
        return real(*a, **k)

    monkeypatch.setattr(rr, "row_stats", flaky)
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="recording disabled"):
        recorded = train(TinyNet(), data, recorder=recorder_at(tmp_path / "run"))
    assert recorded[0] == plain[0]
    rec = recorded[3]
    assert not rec.enabled and rec.hooks.handles == []


def test_a_full_disk_turns_recording_off_and_training_goes_on(tmp_path, monkeypatch):
    import recorders.writer as rw

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rw, "atomic_write_table", full)
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="No space left"):
        losses, *_ = train(TinyNet(), batches(4), recorder=recorder_at(tmp_path / "run", steps_per_shard=2))
    assert len(losses) == 4
    # The writer failed; the reason still reaches disk, with the step.
    for path in (tmp_path / "run" / "manifest.json", tmp_path / "run" / "rank=0" / "manifest.json"):
        manifest = json.loads(path.read_text())
        assert manifest["disabled_reason"] == "OSError: [Errno 28] No space left on device"
        # the step being written when the first shard (steps 0-1) failed
        assert (manifest["disabled_at_step"], manifest["status"]) == (1, "closed")


def test_a_failing_hook_writes_its_reason_at_once(tmp_path, monkeypatch):
    import recorders.collectors.state as rh  # where every row's statistics are taken

    def broken(*a, **k):
        raise RuntimeError("no statistics today")

    monkeypatch.setattr(rh, "row_stats", broken)
    with pytest.warns(RuntimeWarning, match="recording disabled"):
        trained = train(TinyNet(), batches(3), recorder=recorder_at(tmp_path / "run"), close=False)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())  # before close()
    assert (manifest["disabled_reason"], manifest["disabled_at_step"]) == ("RuntimeError: no statistics today", 0)
    trained.rec.close()


def test_a_failing_constructor_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    import recorders.recorder as rr
    data = batches(3)
    torch.manual_seed(0)
    plain = train(TinyNet(), data)

    def broken(**kwargs):
        raise RuntimeError("a model the recorder does not understand")

    monkeypatch.setattr(rr, "describe_job", broken)
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="recording disabled.*does not understand") as caught:
        recorded = train(TinyNet(), data, recorder=recorder_at(tmp_path / "run"))
    assert len([w for w in caught if "amp-postmortem" in str(w.message)]) == 1
    assert recorded.losses == plain.losses and not recorded.rec.enabled
    assert all(torch.equal(a, b) for a, b in zip(recorded.params, plain.params))
    import amp_postmortem
    from amp_postmortem.errors import EmptyRunError
    with pytest.raises(EmptyRunError, match=r"holds no readable step: no shard written yet .*; recording was "
                                            r"switched off \(RuntimeError: a model the recorder does not understand\)"):
        amp_postmortem.load_run(tmp_path / "run")


def test_a_bad_option_still_raises_at_construction(tmp_path):
    with pytest.raises(ValueError, match="unknown bundle trigger 'nan'"):
        AmpRecorder(tmp_path / "run", TinyNet(), bundle_triggers=["nan"])


def test_close_is_idempotent_and_removes_every_hook(tmp_path):
    model = TinyNet()
    n_hooks = lambda: sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    before = n_hooks()
    rec = AmpRecorder(tmp_path / "run", model)
    assert n_hooks() > before
    rec.close()
    rec.close()
    assert n_hooks() == before
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_include_and_exclude_patterns_choose_the_watched_modules(tmp_path):
    run = tmp_path / "run"
    torch.manual_seed(0)
    train(TinyNet(), batches(2), recorder=recorder_at(run, include=["blocks.*"], exclude=["*.mlp*"]))
    names = set(read(run, "tensors").query("kind == 'activation'")["name"])
    assert "" in names and "blocks.0.attn" in names
    assert not any("mlp" in n for n in names) and "embed" not in names


# Its own loop: a subprocess script that flushes, then kills itself mid-run.
SIGKILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {tests!r})
    from recorders import AmpRecorder
    from tiny_models import TinyNet, batches
    torch.manual_seed(0)
    model = TinyNet(); opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sc = torch.amp.GradScaler("cpu")
    rec = AmpRecorder({run!r}, model, optimizer=opt, scaler=sc, steps_per_shard=5)
    for i, (x, y) in enumerate(batches(100)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ((model(x).float() - y) ** 2).mean()
        sc.scale(loss).backward(); sc.step(opt); sc.update(); opt.zero_grad()
        rec.step(loss)
        if i == 23:
            rec.flush()  # make sure shards 0..3 are on disk, then die hard
            os.kill(os.getpid(), signal.SIGKILL)
""")


def test_sigkill_leaves_every_completed_shard_readable(tmp_path):
    run = tmp_path / "run"
    script = SIGKILL_SCRIPT.format(tests=os.path.dirname(__file__), run=str(run))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    steps = read(run, "steps")
    assert steps["step"].tolist() == list(range(24))
    assert len(read(run, "tensors")) > 0
    assert json.loads((run / "manifest.json").read_text())["status"] == "open"
    assert not list(run.rglob("*.parquet.tmp")) or all(p.name.startswith(".") for p in run.rglob("*.tmp"))


def _ddp_worker(rank, world, run, store):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    # A file rendezvous: no free port to race another test for.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    train(DDP(TinyNet()), batches(3, seed=rank), recorder=recorder_at(run, run_id="ddp-test"))
    dist.destroy_process_group()


def test_ddp_with_two_ranks_writes_one_partition_per_rank(tmp_path):
    import torch.multiprocessing as mp
    run = tmp_path / "run"
    mp.spawn(_ddp_worker, args=(2, str(run), str(tmp_path / "store")), nprocs=2, join=True)
    for rank in (0, 1):
        steps = read(run, "steps", rank)
        assert steps["rank"].unique().tolist() == [rank]
        assert len(steps) == 3
        manifest = json.loads((run / f"rank={rank}" / "manifest.json").read_text())
        assert manifest["world_size"] == 2 and manifest["run_id"] == "ddp-test"
        names = set(read(run, "tensors", rank)["name"])
        assert "blocks.0.attn" in names and not any(n.startswith("module.") for n in names)


def test_a_job_resumed_into_its_run_directory_continues_the_same_run(tmp_path):
    run = tmp_path / "run"
    torch.manual_seed(0)
    train(TinyNet(), batches(3), recorder=recorder_at(run))
    first_id = json.loads((run / "manifest.json").read_text())["run_id"]
    model = TinyNet()
    with AmpRecorder(run, model) as rec:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(batches(1)[0][0]).float().mean()
        loss.backward()
        rec.step(loss, step=3)
    assert json.loads((run / "manifest.json").read_text())["run_id"] == first_id
    steps = read(run, "steps")
    assert steps["step"].tolist() == [0, 1, 2, 3]
    assert sorted(p.name for p in (run / "rank=0" / "steps").glob("*.parquet")) == ["part-000000.parquet", "part-000001.parquet"]


def test_an_unwritable_run_directory_warns_and_training_goes_on(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the run directory should be")
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="recording disabled"):
        losses, _, _, rec = train(TinyNet(), batches(3), recorder=recorder_at(blocker / "run"))
    assert len(losses) == 3 and not rec.enabled


def test_grad_norm_is_the_global_norm_of_the_unscaled_gradients(tmp_path):
    norms = []

    def recorder_and_reference(model, opt, sc):
        # the reference: the norm of the unscaled gradients as the optimizer sees them
        opt.register_step_pre_hook(lambda *a: norms.append(
            torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()))
        return AmpRecorder(tmp_path / "run", model, optimizer=opt, scaler=sc)

    torch.manual_seed(0)
    train(TinyNet(), batches(3), recorder=recorder_and_reference)
    assert read(tmp_path / "run", "steps")["grad_norm"].tolist() == pytest.approx(norms, rel=1e-5)


def test_grad_norm_of_gradients_too_large_to_square_in_float32_is_finite(tmp_path):
    # On the CPU the norms are taken in float32 (collectors.params.grad_norms); squares
    # of 1e25 overflow there, so those norms are taken again in float64.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rec = AmpRecorder(tmp_path / "run", model, optimizer=opt)
    (model(torch.randn(3, 4)) * 1e25).sum().backward()
    expected = float(torch.linalg.vector_norm(torch.cat([p.grad.double().reshape(-1) for p in model.parameters()])))
    opt.step()
    rec.step()
    rec.close()
    assert read(tmp_path / "run", "steps")["grad_norm"].tolist() == pytest.approx([expected], rel=1e-6)
    assert expected > 1e25


def test_grad_norm_is_the_norm_before_the_users_clipping(tmp_path):
    seen = []

    def clip(step, model):
        seen.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1).item())

    torch.manual_seed(0)
    train(TinyNet(), batches(3), recorder=recorder_at(tmp_path / "run"), dtype=torch.bfloat16, scaler=None,
          before_update=clip)
    assert min(seen) > 0.1  # clipping changed every step's gradients
    assert read(tmp_path / "run", "steps")["grad_norm"].tolist() == pytest.approx(seen, rel=1e-6)


def test_grad_norm_with_a_fused_optimizer_is_unscaled_and_skips_are_nonfinite(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    expected = []

    def overflow(step, model, x):
        if step == 1:
            x.mul_(1e4)  # float16 overflow: a skipped step

    def unscaled_norm(step, micro_batch, rec):
        # the user's view: the unscaled gradients, before the fused step
        # (fused: the optimizer unscales; its pre-hook sees scaled gradients)
        expected.append(torch.linalg.vector_norm(torch.stack(
            [(p.grad.double() / scaler.get_scale()).norm() for p in model.parameters()])).item())

    train(model, batches(3), recorder=recorder_at(tmp_path / "run"), optimizer=opt, scaler=scaler,
          on_step=overflow, after_backward=unscaled_norm)
    steps = read(tmp_path / "run", "steps")
    assert steps["skipped"].tolist() == [False, True, False]
    assert not math.isfinite(steps["grad_norm"][1]) and not math.isfinite(expected[1])
    assert steps["grad_norm"][[0, 2]].tolist() == pytest.approx([expected[0], expected[2]], rel=1e-6)


def test_a_deepcopy_of_the_model_does_not_record_into_the_run(tmp_path):
    import copy
    torch.manual_seed(0)
    model = TinyNet()
    with AmpRecorder(tmp_path / "run", model) as rec:
        ema = copy.deepcopy(model)  # carries copies of the hooks
        x, y = batches(1)[0]
        ema(x).sum().backward()      # an EMA/teacher pass: not a micro-batch
        model(x).sum().backward()
        rec.step()
    steps = read(tmp_path / "run", "steps")
    assert steps["micro_batches"].tolist() == [1]
    t = read(tmp_path / "run", "tensors")
    assert len(t[(t.name == "embed") & (t.kind == "activation")]) == 1
    assert t[t.kind == "param_grad"]["name"].value_counts().max() == 1


def test_activation_checkpointing_recomputation_is_not_recorded_as_a_new_forward(tmp_path):
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(TinyNet):
        def forward(self, x):
            h = self.embed(x)
            for block in self.blocks:
                h = checkpoint(block, h, use_reentrant=False)
            return self.head(h)

    data = batches(3)
    torch.manual_seed(0)
    plain = train(Checkpointed(), data)
    torch.manual_seed(0)
    recorded = train(Checkpointed(), data, recorder=recorder_at(tmp_path / "run"))
    assert plain[0] == recorded[0]
    t = read(tmp_path / "run", "tensors")
    attn = t[(t.step == 1) & (t.name == "blocks.0.attn")]
    assert sorted(attn["kind"]) == ["activation", "grad_input", "grad_output"]
    assert (attn["call"] == 0).all()


def test_every_option_is_a_documented_keyword_and_the_flat_ones_are_mapped_in_one_place(tmp_path):
    """The explicit options are documented under Args; the flat keywords of
    earlier versions come through `**flat`, each mapped to one field of a
    part (`FLAT_OPTIONS`), and any other keyword is a TypeError."""
    import inspect
    from recorders.options import FLAT_OPTIONS
    params = list(inspect.signature(AmpRecorder.__init__).parameters.values())
    assert not [p for p in params if p.kind is p.VAR_POSITIONAL]
    assert [p.name for p in params if p.kind is p.VAR_KEYWORD] == ["flat"]
    args = AmpRecorder.__doc__.split("Args:")[1]
    documented = re.findall(r"^ {8}(\w+):", args, re.M)
    assert documented == [p.name for p in params if p.name != "self"]
    assert {"bundle_steps", "max_bundles", "hold_steps", "clone_inputs", "full_every", "spool_dir"} <= set(FLAT_OPTIONS)
    rec = AmpRecorder(tmp_path / "a", TinyNet(), full_every=7, max_bundles=2)
    assert rec.schedule.full_every == 7 and rec.bundles.policy.max_bundles == 2
    rec.close()
    with pytest.raises(TypeError, match="unexpected keyword argument 'full_evry'"):
        AmpRecorder(tmp_path / "b", TinyNet(), full_evry=7)


def _tier_string(run):
    steps = read(run, "steps").sort_values("step")
    return "".join("F" if t == "full" else "c" for t in steps["tier"])


def test_a_diverging_run_gets_one_burst_of_full_steps_then_the_period(tmp_path):
    run = tmp_path / "run"

    def diverge(step, model, x):
        if step == 3:  # NaN weights: NaN in every forward, loss and gradient from here on
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = float("nan")

    def settle(step, micro_batch, rec):
        rec.flush()  # the writer has seen every earlier step: the tiers do not depend on timing

    losses = train(TinyNet(), batches(25), dtype=torch.bfloat16, scaler=None, on_step=diverge,
                   after_backward=settle,
                   recorder=recorder_at(run, full_every=10, full_after_event=4, bundles=False)).losses
    assert all(math.isnan(x) for x in losses[3:]) and not any(math.isnan(x) for x in losses[:3])
    # Step 3's events (forward, gradient, loss) reach the writer while step 4
    # runs: steps 5-7 finish the 4-step burst; later NaN steps are events of
    # kinds seen before, so the period (every 10th) rules again.
    assert _tier_string(run) == "FccccFFFccFcccccccccFcccc"


def test_a_bundle_or_an_explicit_request_still_gets_a_full_step(tmp_path):
    run = tmp_path / "run"
    made = []

    def factory(model, opt, sc):
        made.append(AmpRecorder(run, model, optimizer=opt, scaler=sc, full_every=0,
                                full_after_event=0, bundle_steps=[5]))
        return made[0]

    def before_forward(step, model, x):
        if step == 7:
            made[0].save_bundle()  # before the forward: this very step

    def mid_step(step, micro_batch, rec):
        if step == 2:
            rec.request_full()  # the forward has run: the next step

    train(TinyNet(), batches(10), dtype=torch.bfloat16, scaler=None, on_step=before_forward,
          after_backward=mid_step, recorder=factory)
    assert _tier_string(run) == "cccFcFcFcc"
    assert sorted(b["step"] for b in json.loads((run / "manifest.json").read_text())["bundles"]) == [5, 7]
