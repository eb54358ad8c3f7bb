"""The recorder in distributed, sharded and compiled jobs: DDP without a
run_id, FSDP1 (with and without `use_orig_params`), FSDP2 (`fully_shard`)
on 2 CPU processes with gloo,
`torch.compile` (recorder attached before and after compiling) and
activation checkpointing (reentrant and not). For each layout: training
bit-identical to the same job without the recorder, rows under the user's
model's names, the global gradient norm before clipping, and `summary`
naming the right ranks."""
from __future__ import annotations

import json
import math
import os

import pandas as pd
import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

import amp_postmortem
from amp_postmortem.cli import main
from recorders import AmpRecorder, BundlePolicy
from tiny_models import TinyNet, batches

LAYOUTS = ("ddp", "fsdp1", "fsdp1_flat", "fsdp2")  # fsdp1_flat: without use_orig_params
FSDP1 = ("fsdp1", "fsdp1_flat")
STEPS = 3
CLIP = 0.5
NAN_RANK, NAN_STEP = 1, 1  # DDP: this rank's batch of this step holds a NaN
SHARDED = ("fsdp1", "fsdp1_flat", "fsdp2")
PLANTED, BUNDLE_STEP = "blocks.1.mlp.0.weight", 1  # rank 1 plants an Inf into its shard of it


class ShardNet(TinyNet):
    """TinyNet with a one-value parameter: sharded over 2 ranks, rank 1's
    shard of it is empty."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return super().forward(x) * self.gain


class TiedNet(nn.Module):
    """Two layers sharing one weight (tied parameters)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


# ------------------------------------------------------------ the workers
def _wrap(layout, model):
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model)
    if layout in FSDP1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        return FSDP(model, use_orig_params=layout == "fsdp1", device_id=torch.device("cpu"))
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _clip(layout, model):
    """The user's clipping; returns the total norm it saw (pre-clip)."""
    if layout in FSDP1:
        return float(model.clip_grad_norm_(CLIP))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def _train(layout, rank, run=None):
    """One job; returns (losses, pre-clip norms, final local weights)."""
    torch.manual_seed(0)
    model = _wrap(layout, ShardNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # GradScaler where plain DDP allows it; FSDP runs bfloat16 without one.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if layout == "ddp" else None
    dtype = torch.float16 if layout == "ddp" else torch.bfloat16
    rec = AmpRecorder(run, model, optimizer=opt, scaler=scaler, full_every=2) if run else None
    # Its own loop: a DDP/FSDP worker's, run in a spawned process per rank.
    losses, norms = [], []
    for step, (x, y) in enumerate(batches(STEPS, seed=rank)):
        if layout == "ddp" and (rank, step) == (NAN_RANK, NAN_STEP):
            x = x.clone()
            x[0, 0, 0] = math.nan
        with torch.autocast("cpu", dtype=dtype):
            loss = ((model(x).float() - y) ** 2).mean()
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        norms.append(_clip(layout, model))
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        if rec:
            rec.step(loss)
        losses.append(loss.item())
    if rec:
        rec.close()
    weights = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in model.parameters()]
    return losses, norms, weights


def _worker(rank, world, root, store):
    import torch.distributed as dist
    os.environ.pop("AMP_POSTMORTEM_RUN_ID", None)
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    # A file rendezvous, not a TCP port picked free and then bound by the
    # ranks: another test's server (xdist's other worker) could take it in
    # between.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    out = {}
    for layout in LAYOUTS:
        plain_losses, plain_norms, plain_weights = _train(layout, rank)
        losses, norms, weights = _train(layout, rank, run=os.path.join(root, layout))
        out[layout] = {
            # repr: NaN equals NaN
            "identical": repr(plain_losses + plain_norms) == repr(losses + norms)
            and all(torch.equal(a, b) for a, b in zip(plain_weights, weights)),
            "losses": losses, "norms": norms}
    out["truth"] = _reference_grads(rank, world)
    for layout in FSDP1:
        out[f"{layout}_planted"] = _planted_job(layout, rank, os.path.join(root, f"{layout}_fp32"))
    _tied_job(rank, os.path.join(root, "fsdp1_flat_tied"))
    for layout in SHARDED:
        recorded = _bundle_job(layout, rank, root)
        out[f"{layout}_bundle_identical"] = all(
            torch.equal(a.view(torch.int32), b.view(torch.int32))  # bit for bit: NaN included
            for a, b in zip(recorded, _bundle_job(layout, rank, root, record=False)))
    with open(os.path.join(root, f"result-{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def _reference_grads(rank, world):
    """The unsharded model's step-0 gradients as FSDP averages them (each
    rank's batch, all-reduced), float32 without autocast: per parameter
    its absmax, and the initial weights' absmax."""
    import torch.distributed as dist
    torch.manual_seed(0)
    model = ShardNet()
    x, y = batches(1, seed=rank)[0]
    ((model(x) - y) ** 2).mean().backward()
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        out[name] = {"grad_absmax": float((g / world).abs().max()), "absmax": float(p.detach().abs().max())}
    return out


def _planted_job(layout, rank, run):
    """Two float32 steps, every one at the full tier; at step 1 each rank
    plants a NaN into its part of the parameter that its shard boundary
    cuts (the first on rank 1, the last on rank 0), through FSDP's
    communication hook: the same parameter's gradient, non-finite on both
    ranks. Returns that parameter's name."""
    from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState, reduce_scatter_hook
    torch.manual_seed(0)
    model = _wrap(layout, ShardNet())
    flat = model._handle.flat_param
    infos = [(fqn, info) for fqn, info in zip(flat._fqns, flat._shard_param_infos) if info.in_shard]
    fqn, info = infos[-1] if rank == 0 else infos[0]
    at = info.offset_in_shard + (info.numel_in_shard - 1 if rank == 0 else 0)
    state, step = DefaultState(torch.distributed.group.WORLD), [0]

    def hook(state, grad, output):
        reduce_scatter_hook(state, grad, output)
        if step[0] == 1:
            output[at] = math.nan
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # Its own loop: a DDP/FSDP worker's, run in a spawned process per rank.
    with AmpRecorder(run, model, optimizer=opt, full_every=1, steps_per_shard=1) as rec:
        for step[0], (x, y) in enumerate(batches(2, seed=rank)):
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()  # step 1's NaN reaches the weights after the job's last forward
            opt.zero_grad()
            rec.step(loss)
    return fqn


def _plant_inf(layout, model, rank):
    """Rank `rank` sets the first value of its shard of `PLANTED` to +Inf
    (every rank's forward then all-gathers it)."""
    with torch.no_grad():
        if layout == "fsdp2":
            model.get_submodule(PLANTED.rpartition(".")[0]).weight.to_local().view(-1)[0] = math.inf
            return
        flat = model._handle.flat_param
        info = dict(zip(flat._fqns, flat._shard_param_infos))[PLANTED]
        assert info.in_shard, "the planted parameter must have a part on the planting rank"
        flat.data[info.offset_in_shard] = math.inf


def _bundle_job(layout, rank, root, record=True):
    """Two bfloat16 steps; before step 1's forward rank 1 plants an Inf
    into its shard of `PLANTED`: every rank's loss goes non-finite and
    every rank saves a bundle of its shards. The full weights step 1's
    forward used, gathered by torch itself, are saved beside the run as
    truth (`<layout>_truth.npz`, rank 0). The recorder keeps a window
    asked for off (sharded). Returns the final local weights."""
    import numpy as np
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    torch.manual_seed(0)
    model = _wrap(layout, ShardNet())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    rec = AmpRecorder(os.path.join(root, f"{layout}_bundles"), model, optimizer=opt, full_every=1,
                      bundles=BundlePolicy(window_steps=2)) if record else None
    # Its own loop: a DDP/FSDP worker's, run in a spawned process per rank.
    for step, (x, y) in enumerate(batches(2, seed=rank)):
        if step == BUNDLE_STEP:
            if rank == 1:
                _plant_inf(layout, model, rank)
            truth = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ((model(x).float() - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rec:
            rec.step(loss)
    if rec:
        rec.close()
    # The bundle copies the optimizer state when it is saved: after step 1's update.
    state = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))["state"]
    if rank == 0 and record:
        truth.update({f"{n}:{k}": v for n, keys in state.items() for k, v in keys.items()})
        np.savez(os.path.join(root, f"{layout}_truth.npz"),
                 **{n: t.detach().float().numpy() for n, t in truth.items()})
    return [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in model.parameters()]


def _tied_job(rank, run):
    torch.manual_seed(0)
    model = _wrap("fsdp1_flat", TiedNet())
    # Its own step: a worker's, one micro-batch under no_sync() (accumulation by hand).
    with AmpRecorder(run, model, full_every=1) as rec:
        (x, y), (x2, y2) = batches(2, d_out=8, seed=rank)
        with model.no_sync():  # gradient accumulation: an unsharded flat gradient first
            ((model(x2) - y2) ** 2).mean().backward()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        rec.step(loss)


@pytest.fixture(scope="module")
def distributed_runs(tmp_path_factory):
    """One spawn of 2 gloo ranks training every distributed layout."""
    import torch.multiprocessing as mp
    root = tmp_path_factory.mktemp("distributed")
    store = tmp_path_factory.mktemp("rendezvous") / "store"
    mp.spawn(_worker, args=(2, str(root), str(store)), nprocs=2, join=True)
    results = [json.loads((root / f"result-{r}.json").read_text()) for r in (0, 1)]
    return root, results


# ------------------------------------------------------------ the checks
MODULES = {"", "embed", "blocks", "blocks.0", "blocks.0.norm", "blocks.0.attn", "blocks.0.attn.qkv",
           "blocks.0.attn.out", "blocks.0.mlp", "blocks.0.mlp.0", "blocks.0.mlp.1", "blocks.0.mlp.2",
           "blocks.1", "blocks.1.norm", "blocks.1.attn", "blocks.1.attn.qkv", "blocks.1.attn.out",
           "blocks.1.mlp", "blocks.1.mlp.0", "blocks.1.mlp.1", "blocks.1.mlp.2", "head"}
PARAMS = {n for n, _ in ShardNet().named_parameters()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_is_bit_identical_with_the_recorder(distributed_runs, layout):
    _, results = distributed_runs
    assert [r[layout]["identical"] for r in results] == [True, True]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rank_writes_one_run_under_the_users_names(distributed_runs, layout):
    root, _ = distributed_runs
    run = amp_postmortem.load_run(root / layout)
    ids = {json.loads((root / layout / f"rank={r}" / "manifest.json").read_text())["run_id"] for r in (0, 1)}
    assert len(ids) == 1 and run.ranks == [0, 1]
    assert run.manifest["model_class"] == "test_distributed.ShardNet"
    rows = run.scan_tensors(["step", "rank", "name", "kind", "numel"])
    for rank in (0, 1):
        mine = rows[rows["rank"] == rank]
        assert set(mine.loc[mine["kind"] == "activation", "name"]) == MODULES
    grads = rows[rows["kind"] == "param_grad"]
    if layout == "ddp":  # replicated: every rank holds every gradient
        assert grads.groupby("step")["name"].count().tolist() == [2 * len(PARAMS)] * STEPS
    else:  # sharded: one merged row per parameter and step, the full size
        assert grads.groupby("step")["name"].count().tolist() == [len(PARAMS)] * STEPS
        assert set(grads["name"]) == PARAMS
        assert grads.loc[grads["name"] == "gain", "numel"].tolist() == [1] * STEPS
        assert grads.loc[grads["name"] == "embed.weight", "numel"].tolist() == [128] * STEPS


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grad_norm_is_the_global_norm_before_clipping(distributed_runs, layout):
    root, results = distributed_runs
    steps = amp_postmortem.load_run(root / layout).steps
    for rank in (0, 1):
        recorded = steps.loc[steps["rank"] == rank, "grad_norm"].tolist()
        expected = results[rank][layout]["norms"]
        if layout == "ddp":  # the step whose gradients went non-finite
            assert math.isnan(recorded[NAN_STEP]) and math.isnan(expected[NAN_STEP])
            del recorded[NAN_STEP], expected[NAN_STEP]
        assert recorded == pytest.approx(expected, rel=1e-5)
        assert min(expected) > CLIP  # clipping changed the gradients: the norm is the one before


def test_sharded_rows_of_one_rank_hold_its_shard(distributed_runs):
    root, _ = distributed_runs
    one = amp_postmortem.load_run(root / "fsdp2", rank=1)
    gain = one.scan_tensors(["name", "kind", "numel", "absmax", "nan_count"], kinds=["param_grad"])
    gain = gain[gain["name"] == "gain"]
    assert gain["numel"].tolist() == [0] * STEPS and gain["nan_count"].tolist() == [0] * STEPS
    assert gain["absmax"].isna().all()
    assert one.steps["grad_norm"].notna().all()  # this rank's own norm, said so when the steps are read
    assert any("covers only their shards" in w for w in one.warnings)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_summary_names_the_ranks_and_exits_0(distributed_runs, layout):
    root, _ = distributed_runs
    result = CliRunner().invoke(main, ["summary", str(root / layout)])
    assert result.exit_code == 0, result.output
    assert "ranks [0, 1] of world_size 2" in result.output
    if layout == "ddp":
        assert f"first made by <input> (input, rank {NAN_RANK})" in result.output


def test_summary_says_which_rank_went_nonfinite_first(distributed_runs):
    root, _ = distributed_runs
    origin = amp_postmortem.nans(root / "ddp").origin
    assert (origin.name, origin.phase, origin.step, origin.rank) == ("<input>", "forward", NAN_STEP, NAN_RANK)


def test_run_id_precedence_argument_env_torchrun_existing_run(tmp_path, monkeypatch):
    from recorders.run_id import local_run_id
    monkeypatch.delenv("AMP_POSTMORTEM_RUN_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's value without a rendezvous id
    fresh = local_run_id(tmp_path, 0, None)
    assert len(fresh) == 32 and fresh != local_run_id(tmp_path, 0, None)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "elastic-7")
    assert local_run_id(tmp_path, 0, None) == "elastic-7"
    monkeypatch.setenv("AMP_POSTMORTEM_RUN_ID", "mine")
    assert local_run_id(tmp_path, 0, None) == "mine"
    assert local_run_id(tmp_path, 0, "given") == "given"


# ------------------------------------- FSDP1: parameters from the flat one
@pytest.mark.parametrize("layout", FSDP1)
def test_fsdp1_rows_merge_to_the_unsharded_models_values(distributed_runs, layout):
    """Both use_orig_params settings record every parameter under its own
    name, marked sharded; merged, step 0's rows are the unsharded model's:
    its initial weights exactly, its averaged float32 gradients."""
    root, results = distributed_runs
    run = amp_postmortem.load_run(root / f"{layout}_fp32")
    assert run.sharded_params == PARAMS
    rows = run.scan_tensors(["step", "rank", "name", "kind", "numel", "absmax", "nan_count"],
                            kinds=["param", "param_grad"])
    step0 = rows[rows["step"] == 0]
    truth = results[0]["truth"]
    for kind in ("param", "param_grad"):
        mine = step0[step0["kind"] == kind].set_index("name")
        assert sorted(mine.index) == sorted(PARAMS)  # one row each, all ranks merged
        assert (mine["nan_count"] == 0).all()
        sizes = {n: p.numel() for n, p in ShardNet().named_parameters()}
        assert mine["numel"].to_dict() == sizes
    weights = step0[step0["kind"] == "param"].set_index("name")["absmax"]
    assert weights.to_dict() == {n: t["absmax"] for n, t in truth.items()}
    grads = step0[step0["kind"] == "param_grad"].set_index("name")["absmax"]
    for name, t in truth.items():
        assert grads[name] == pytest.approx(t["grad_absmax"], rel=1e-5), name


@pytest.mark.parametrize("layout", FSDP1)
def test_nans_names_a_sharded_gradient_once_not_once_per_rank(distributed_runs, layout):
    root, results = distributed_runs
    planted = {r[f"{layout}_planted"] for r in results}
    assert len(planted) == 1  # the shard boundary cuts one parameter
    name = planted.pop()
    report = amp_postmortem.nans(root / f"{layout}_fp32")
    grads = report.layers[report.layers["kind"] == "param_grad"]
    assert grads["name"].tolist() == [name]
    row = grads.iloc[0]
    assert (row["first_step"], row["nonfinite_steps"], row["nan_count"]) == (1, 1, 2)
    origin = report.origins["backward"]
    assert (origin.tensor, origin.step, origin.rank) == (name, 1, 0)  # the lowest rank holding a NaN of it
    assert not report.backward_scaler_handled


@pytest.mark.parametrize("layout", FSDP1)
def test_streamed_rows_merge_shards_and_keep_each_ranks_step_order(distributed_runs, layout):
    """What the streaming readers read (`nans`, the report, the exports):
    one row per sharded parameter and step, as `scan_tensors` has them,
    in frames whose steps never go back within a rank (a shard a step)."""
    root, _ = distributed_runs
    run = amp_postmortem.load_run(root / f"{layout}_fp32")
    cols = ["step", "rank", "name", "kind", "numel", "absmax", "nan_count"]
    frames = list(run.iter_tensor_frames(cols, kinds=["activation", "param_grad"]))
    last = {}
    for f in frames:
        for rank, g in f.groupby("rank"):
            assert g["step"].is_monotonic_increasing and g["step"].min() >= last.get(rank, 0)
            last[rank] = g["step"].max()
    streamed = pd.concat(frames, ignore_index=True)
    grads = streamed[streamed["kind"] == "param_grad"]
    assert sorted(zip(grads["step"], grads["name"])) == sorted((s, n) for s in (0, 1) for n in PARAMS)
    whole = run.scan_tensors(cols, kinds=["activation", "param_grad"])
    key = ["step", "rank", "name", "kind"]
    assert streamed.sort_values(key).reset_index(drop=True).equals(whole.sort_values(key).reset_index(drop=True))
    batches_ = run.iter_tensor_batches(cols, kinds=["param_grad"], merged=True)
    assert sum(b.num_rows for b in batches_) == len(grads)


@pytest.mark.parametrize("layout", FSDP1)
def test_export_and_report_read_sharded_runs(distributed_runs, layout, tmp_path):
    root, _ = distributed_runs
    run = amp_postmortem.load_run(root / f"{layout}_fp32")
    from amp_postmortem.export import layer_rows
    from amp_postmortem.reporting.data import DTYPE_MAX, scan_tensors
    for rank in run.ranks:
        steps = [step for step, _ in layer_rows(run, rank, DTYPE_MAX)]
        assert steps == [0, 1]
    heatmaps, _ = scan_tensors(run)
    assert heatmaps


def test_fsdp1_flat_tied_parameter_is_recorded_once_with_its_alias(distributed_runs):
    root, _ = distributed_runs
    run = amp_postmortem.load_run(root / "fsdp1_flat_tied")
    params = {p["name"]: p for m in run.rank_manifests.values() for p in m["params"]}
    assert set(params) == {"a.weight", "a.bias", "b.bias"}
    assert params["a.weight"]["aliases"] == ["b.weight"] and params["a.weight"]["shape"] == [8, 8]
    grads = run.scan_tensors(["name", "kind", "numel"], kinds=["param_grad"])
    assert dict(zip(grads["name"], grads["numel"])) == {"a.weight": 64, "a.bias": 8, "b.bias": 8}
    assert run.steps["grad_norm"].notna().all()


# ------------------------------------------ bundles of sharded jobs
@pytest.mark.parametrize("layout", SHARDED)
def test_every_rank_saves_its_shards_and_they_reassemble_to_the_full_weights(distributed_runs, layout):
    import numpy as np
    root, _ = distributed_runs
    run = root / f"{layout}_bundles"
    assert [p.name for p in sorted((run / "bundles" / f"step={BUNDLE_STEP}").iterdir())] == ["rank=0", "rank=1"]
    metas = [json.loads((run / "bundles" / f"step={BUNDLE_STEP}" / f"rank={r}" / "bundle.json").read_text())
             for r in (0, 1)]
    for m in metas:
        assert m["version"] == "1.3" and m["params"]["exact"] and m["params"]["source"] == "pre_step_snapshot"
        kinds = {p["kind"] for p in m["params"]["placements"].values()}
        assert kinds == {"dtensor" if layout == "fsdp2" else "flat"}
    local = amp_postmortem.load_bundle(run, step=BUNDLE_STEP, rank=1)
    truth = np.load(root / f"{layout}_truth.npz", allow_pickle=False)
    assert local.shard_ranks == [0, 1]
    assert sorted(local.params) == sorted(n for n in truth.files if ":" not in n) == sorted(PARAMS)
    for name in PARAMS:
        got = local.params[name]
        assert list(got.shape) == list(truth[name].shape), name
        assert torch.equal(got, torch.from_numpy(truth[name])), name
    # Adam's state, reassembled like the weights (its scalar `step` whole)
    state = {f"{n}:{k}": v for n, k, v in local.optimizer_state}
    assert sorted(state) == sorted(n for n in truth.files if ":" in n)
    assert {k.split(":")[1] for k in state} == {"step", "exp_avg", "exp_avg_sq"}
    for key, got in state.items():
        torch.testing.assert_close(got.float(), torch.from_numpy(truth[key]), rtol=0, atol=0, equal_nan=True,
                                   msg=key)
    assert local.meta["optimizer"]["state_source"] == "copy_after_update"
    assert torch.isinf(local.params[PLANTED]).sum() == 1
    assert local.rank == 1 and local.meta["rank"] == 1  # its own inputs and loss
    assert math.isinf(local.loss) or math.isnan(local.loss)


@pytest.mark.parametrize("layout", SHARDED)
def test_replay_of_a_sharded_step_goes_nonfinite_where_the_job_did(distributed_runs, layout):
    root, _ = distributed_runs
    run = root / f"{layout}_bundles"
    origin = amp_postmortem.nans(run).origin
    assert (origin.name, origin.step) == (PLANTED.rpartition(".")[0], BUNDLE_STEP)
    result = CliRunner().invoke(main, ["replay", str(run), "--step", str(BUNDLE_STEP), "--rank", "1",
                                       "--model", f"{__file__}:ShardNet", "--precisions", "fp32,bf16", "--json"])
    assert result.exit_code == 0, result.output
    replayed = json.loads(result.stdout)
    assert replayed["rank"] == 1 and replayed["reproduced"] is True
    assert replayed["reference_nonfinite"][0] == origin.name


@pytest.mark.parametrize("layout", SHARDED)
def test_saving_sharded_bundles_leaves_training_bit_identical_and_keeps_no_window(distributed_runs, layout):
    root, results = distributed_runs
    assert [r[f"{layout}_bundle_identical"] for r in results] == [True, True]
    run = root / f"{layout}_bundles"
    for r in (0, 1):
        bundles = json.loads((run / f"rank={r}" / "manifest.json").read_text())["recorder"]["bundles"]
        assert bundles["window_steps"] == 2 and "sharded parameters" in bundles["window_disabled"]
    assert not (run / "windows").exists()
    verdict = summary_verdict(run)
    assert "window_steps" not in verdict["command"] and "keeps no window here: sharded" in verdict["command"]


def summary_verdict(run):
    result = CliRunner().invoke(main, ["summary", str(run), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["precision_verdict"]


def test_fix_scale_window_and_recommend_run_on_a_sharded_step(distributed_runs):
    """The what-ifs on the reassembled step as on an eager one: the planted
    Inf is in the weights, so float64 fails too and no precision remedy is
    offered; recommend says to restore the weights, naming the planted one
    (read from the reassembled bundle)."""
    root, _ = distributed_runs
    run, model = str(root / "fsdp1_flat_bundles"), f"{__file__}:ShardNet"
    at = ["--step", str(BUNDLE_STEP), "--rank", "1", "--model", model, "--json"]
    fixed = CliRunner().invoke(main, ["fix", run, *at])
    assert fixed.exit_code == 0, fixed.output
    fixed = json.loads(fixed.stdout)
    assert (fixed["rank"], fixed["fix"], fixed["baseline"]["forward_finite"]) == (1, None, False)
    window = CliRunner().invoke(main, ["scale-window", run, *at])
    assert window.exit_code == 0, window.output
    assert json.loads(window.stdout)["replay"]["rank"] == 1
    advice = CliRunner().invoke(main, ["recommend", run, "--model", model, "--json"])
    assert advice.exit_code == 0, advice.output
    advice = json.loads(advice.stdout)
    assert advice["step"] == BUNDLE_STEP and [(r["kind"], r["data"]) for r in advice["recommendations"]] == [
        ("check_weights", {"step": BUNDLE_STEP, "params": [PLANTED]})]


def test_a_missing_ranks_bundle_is_named_in_one_line_exit_2(distributed_runs, tmp_path):
    import shutil
    root, _ = distributed_runs
    run = tmp_path / "run"
    shutil.copytree(root / "fsdp2_bundles", run)
    shutil.rmtree(run / "bundles" / f"step={BUNDLE_STEP}" / "rank=1")
    result = CliRunner().invoke(main, ["replay", str(run), "--step", str(BUNDLE_STEP),
                                       "--model", f"{__file__}:ShardNet"])
    assert result.exit_code == 2
    line, = result.output.strip().splitlines()
    assert "no bundle of rank 1" in line and f"step {BUNDLE_STEP}" in line
