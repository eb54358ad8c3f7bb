"""Per-module rows inside compiled graphs (`recorders/collectors/graph_stats.py`),
with inductor, the recorder attached before and after `torch.compile`: every
recorded step has eager's set of (name, kind) rows, dynamo's counters stay
clean after warm-up (no graph break, no new graph on full-tier steps or in
a `paused()` pass), the training is the same job's without the recorder, a
planted Inf is found at its layer, and bf16 autocast is read from the graph.

Inductor compiles take tens of seconds on 2 cores: one compiled job per
attach mode and one without the recorder, shared by the module's tests."""
from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo
import torch._inductor.config
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import amp_postmortem
from recorders import AmpRecorder
from recorders.collectors.graph_stats import GraphStats
from recorders.graph_rows import graph_rows, with_graph_rows
from tiny_models import TinyNet, batches, train

STEPS = 6
FULL_EVERY = 4  # steps 0 and 4 full (eager), the others compiled
PAUSED_AT = 2  # a paused forward pass (gradients on) in this step
PLANT_AT = 5  # an Inf planted in PLANTED's weight before this step's forward
PLANTED = "blocks.0.mlp.0"  # its Inf reaches mlp.2, the residual sum and the head


def _job(attach, run, backend="inductor", on_close=None, **options):
    """(losses, graph breaks, frames compiled after each step, unique graphs
    after each step) of a bf16 autocast job on a one-block TinyNet (its
    residual sums, LayerNorm, attention and MLP are what inductor fuses;
    a second block doubled the compile times)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = TinyNet(blocks=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rec = None
    options.setdefault("compiled_rows", True)  # off by default: the rows in the graph are what is tested
    if attach == "before":
        rec = AmpRecorder(run, model, optimizer=opt, full_every=FULL_EVERY, **options)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter) if attach != "eager" else model
    if attach in ("after", "eager"):
        rec = AmpRecorder(run, compiled, optimizer=opt, full_every=FULL_EVERY, **options)
    frames, graphs = [], []

    def plant(step, _, x):
        if step == PLANT_AT:
            with torch.no_grad():
                model.blocks[0].mlp[0].weight[3, 5] = math.inf

    def loss_fn(m, x, y, step, accumulate):
        loss = ((m(x).float() - y) ** 2).mean()
        if step == PAUSED_AT and rec is not None:
            with rec.paused():
                m(x)  # an eval pass with gradients enabled: not recorded
        return loss

    def compiled_so_far(step, _):
        frames.append(counter.frame_count)
        graphs.append(counters["stats"]["unique_graphs"])

    losses = train(compiled, batches(STEPS), recorder=(lambda *_: rec) if rec is not None else None, optimizer=opt,
                   dtype=torch.bfloat16, scaler=None, on_step=plant, loss_fn=loss_fn, after_update=compiled_so_far,
                   close=False).losses
    breaks = dict(counters["graph_break"])
    if rec is not None:
        rec.close()
    if on_close is not None:  # after the last rec.step() (`after_update` runs before it)
        on_close(counter)
    return losses, breaks, frames, graphs


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    out = {"plain": _job("plain", None)}
    for attach in ("eager", "after", "before"):
        out[attach] = (root / attach, *_job(attach, root / attach))
    return out


def _pairs(run, step):
    rows = amp_postmortem.load_run(run).scan_tensors(["step", "name", "kind"], steps=[step])
    return set(zip(rows["name"], rows["kind"]))


@pytest.mark.parametrize("attach", ["after", "before"])
def test_every_recorded_step_has_eagers_rows(jobs, attach):
    run, eager = jobs[attach][0], jobs["eager"][0]
    for step in range(STEPS):
        want = _pairs(eager, step)
        if attach == "before" and step == 0:
            # Attached before compiling, the recorder learns of the graph
            # when its first step ends: that full-tier step ran compiled,
            # with the graph's cheap rows and no `param` (weight) rows.
            want = {(name, kind) for name, kind in want if kind != "param"}
        assert _pairs(run, step) == want, step
    compiled_step = amp_postmortem.load_run(run).scan_tensors(["step", "name", "kind", "call"], steps=[1])
    kinds = set(compiled_step["kind"])
    assert {"input", "activation", "grad_output", "grad_input", "param_grad", "loss"} <= kinds
    assert set(compiled_step["call"]) == {0}


@pytest.mark.parametrize("attach", ["after", "before"])
def test_compiled_rows_equal_eager_rows_of_the_same_values(jobs, attach):
    """Step 1 computes from the same weights in both runs (step 0 ran
    eagerly in the compiled runs too); inductor rounds its fused kernels
    its own way, so values are compared loosely, sizes and dtypes exactly."""
    cols = ["name", "kind", "numel", "dtype", "absmax", "nan_count", "inf_count"]
    run, eager = jobs[attach][0], jobs["eager"][0]
    got = amp_postmortem.load_run(run).scan_tensors(["step", *cols], steps=[1]).set_index(["name", "kind"])
    want = amp_postmortem.load_run(eager).scan_tensors(["step", *cols], steps=[1]).set_index(["name", "kind"])
    got = got.loc[want.index]
    assert got["numel"].tolist() == want["numel"].tolist()
    assert got["dtype"].tolist() == want["dtype"].tolist()
    assert (got["nan_count"] + got["inf_count"]).sum() == 0
    assert ((got["absmax"] - want["absmax"]).abs() <= 0.05 * want["absmax"] + 1e-3).all()


@pytest.mark.parametrize("attach", ["after", "before"])
def test_no_graph_break_and_no_recompilation_after_warm_up(jobs, attach):
    _, _, breaks, frames, graphs = jobs[attach]
    _, plain_breaks, plain_frames, _ = jobs["plain"]
    assert breaks == plain_breaks == {}
    # Compiled by step 1 (step 0 is full tier: eager when attached after);
    # the eager full-tier step 4, the paused pass of step 2 and the planted
    # Inf compile nothing new.
    assert len(set(frames[1:])) == 1 and len(set(graphs[1:])) == 1, (frames, graphs)
    assert len(set(plain_frames)) == 1


@pytest.mark.parametrize("attach", ["after", "before"])
def test_training_is_the_jobs_without_the_recorder(jobs, attach):
    losses, plain = jobs[attach][1], jobs["plain"][0]
    # The recorder's statistics only read the tensors; where inductor fuses
    # them into its kernels the training's bits may move (see FORMAT.md):
    # up to the planted step, the losses agree to bf16's resolution.
    assert losses[:PLANT_AT] == pytest.approx(plain[:PLANT_AT], rel=2 ** -7)
    assert not math.isfinite(losses[PLANT_AT]) and not math.isfinite(plain[PLANT_AT])


@pytest.mark.parametrize("attach", ["after", "before"])
def test_a_planted_inf_is_found_at_its_layer(jobs, attach):
    report = amp_postmortem.nans(jobs[attach][0])
    assert report.first_nonfinite_step == PLANT_AT
    assert report.origins["forward"].name == PLANTED


@pytest.mark.parametrize("attach", ["after", "before"])
def test_paused_passes_are_not_recorded(jobs, attach):
    run = amp_postmortem.load_run(jobs[attach][0])
    rows = run.scan_tensors(["step", "name", "kind", "numel"], steps=[PAUSED_AT - 1, PAUSED_AT])
    a = rows[rows["step"] == PAUSED_AT - 1].set_index(["name", "kind"])["numel"]
    b = rows[rows["step"] == PAUSED_AT].set_index(["name", "kind"])["numel"]
    assert b.loc[a.index].tolist() == a.tolist()
    assert run.steps["micro_batches"].tolist() == [1] * STEPS


@pytest.mark.parametrize("attach", ["after", "before"])
def test_bf16_autocast_is_read_under_compile(jobs, attach):
    manifest = amp_postmortem.load_run(jobs[attach][0]).manifest
    assert manifest["autocast"]["enabled"] is True
    assert manifest["autocast"]["dtype"] == "bfloat16"
    assert manifest["compiled"]["detected"] is True


def test_graph_rows_are_ranked_among_the_eager_rows():
    """Host side, no compile: a written buffer becomes rows whose orders
    interleave with the eager rows (inputs first, the graph, the eager
    root; the gradient reaching the eager root, the graph's backward, the
    parameter gradients)."""
    import numpy as np
    stats = GraphStats(["", "a"], device="cpu")
    act = stats.index[("a", "activation")]
    stats.fwd[act][[0, 4, 5, 6, 7, 8]] = torch.tensor([2.0, 1, 6, 2, 2, 1], dtype=torch.float64)
    stats.grads[stats.index[("a", "grad_output")]][[0, 2, 4, 5, 7]] = torch.tensor(
        [1.0, 1, 1, 6, 2], dtype=torch.float64)
    stats.grads[stats.index[("a", "grad_input")]][[0, 4, 5, 7]] = torch.tensor([1.0, 1, 4, 2], dtype=torch.float64)
    stats.ran = True
    values = stats.take().numpy()
    assert stats.take() is None and all(float(r.abs().sum()) == 0 for r in stats.fwd + stats.grads)
    gmeta, grows, _ = graph_rows(stats, values, 4)
    eager_meta = [("<input>", "input", "forward", 0, 0, "float32", 4, None),
                  ("", "activation", "forward", 1, 0, "float32", 2, None),
                  ("", "grad_output", "backward", 0, 0, "float32", 2, None),
                  ("w", "param_grad", "backward", 1, 0, "float32", 6, None)]
    meta, rows = with_graph_rows(eager_meta, np.zeros((4, 4)), gmeta, grows, fwd_anchor=1)
    order = {(m[0], m[1]): m[3] for m in meta}
    assert order == {("<input>", "input"): 0, ("a", "activation"): 1, ("", "activation"): 2,
                     ("", "grad_output"): 0, ("a", "grad_output"): 1, ("a", "grad_input"): 2,
                     ("w", "param_grad"): 3}
    grad_input = rows[[i for i, m in enumerate(meta) if m[1] == "grad_input"][0]]
    assert grad_input[3] == 1.0  # its output's gradient held one Inf
    assert [m[5] for m in meta if m[0] == "a"] == ["bfloat16"] * 3


def test_compiled_rows_off_puts_no_statistic_in_the_graph_and_changes_no_bit(jobs, tmp_path):
    """`compiled_rows=False` with `eager_full_steps=False`: the inductor job
    trains to the bit as the same compiled job without the recorder (the
    in-graph statistics, and eager full-tier steps, can change inductor's
    rounding), and compiled steps keep the loss and the parameter
    gradients, no module row."""
    run = tmp_path / "off"
    losses, breaks, frames, _ = _job("before", run, compiled_rows=False, eager_full_steps=False)
    plain_losses = jobs["plain"][0]
    assert losses[:PLANT_AT] == plain_losses[:PLANT_AT]
    assert not breaks and frames[-1] == frames[1]
    loaded = amp_postmortem.load_run(run)
    assert loaded.manifest["recorder"]["compiled_rows"] is False
    rows = loaded.scan_tensors(["step", "name", "kind"])
    for step in range(1, STEPS):
        kinds = set(rows.loc[rows["step"] == step, "kind"])
        assert "param_grad" in kinds and "loss" in kinds
        assert not kinds & {"activation", "grad_output", "grad_input"}, (step, kinds)


def test_a_failing_compiled_step_is_re_executed_eagerly_in_sentinel_mode(tmp_path, sentinel_mode):
    """The recorder's default mode, attached to the compiled module: the
    planted Inf's step is not sampled, so its rows come from re-executing it
    eagerly (`force_eager`) from what the recorder held; `nans` names the
    planted layer from them, and the re-execution compiles nothing (dynamo's
    frame count is unchanged after the job). `aot_eager` (no inductor: the
    same rounding eagerly or compiled, so the facts reproduce exactly)."""
    run = tmp_path / "run"
    frames_after = []
    losses, breaks, frames, _ = _job("after", run, backend="aot_eager", compiled_rows=False,
                                     on_close=lambda counter: frames_after.append(counter.frame_count))
    assert not math.isfinite(losses[PLANT_AT]) and not breaks
    assert frames_after == [frames[PLANT_AT]]  # the re-execution at step PLANT_AT's rec.step() compiled nothing
    loaded = amp_postmortem.load_run(run)
    assert loaded.manifest["recorder"]["mode"] == "sentinel"
    (entry,) = loaded.manifest["reexecutions"]
    assert (entry["step"], entry["kind"], entry["eager"], entry["check"]) == (PLANT_AT, "nonfinite_loss", True, "exact")
    assert loaded.steps.set_index("step").loc[PLANT_AT, "reexecuted"]
    report = amp_postmortem.nans(run)
    assert report.first_nonfinite_step == PLANT_AT
    assert report.origins["forward"].name == PLANTED
    # eager_full_steps=False: no eager execution at all, the step refused as compiled.
    _job("after", tmp_path / "off", backend="aot_eager", compiled_rows=False, eager_full_steps=False)
    (entry,) = amp_postmortem.load_run(tmp_path / "off").manifest["reexecutions"]
    assert (entry["check"], entry["reason"]) == ("refused", "compiled")


def test_in_graph_rows_change_no_bit_where_the_rounding_does_not_follow_the_fusion(tmp_path):
    """The in-graph rows only read tensors. Where the backend rounds a
    tensor the same whether or not something else reads it (inductor with
    `emulate_precision_casts`: fused kernels keep eager's bfloat16 casts),
    the job with every module's rows, attached before or after compiling,
    trains to the bit as the compiled job without the recorder. Under
    inductor's default the same rows may move a bit of rounding
    (`test_training_is_the_jobs_without_the_recorder`): a read intermediate
    is stored in bfloat16 where a fused kernel would have kept it in
    float32, which is why `compiled_rows` is off by default."""
    with torch._inductor.config.patch(emulate_precision_casts=True):
        plain = _job("plain", None)[0]
        for attach in ("before", "after"):
            run = tmp_path / attach
            losses, breaks, _, _ = _job(attach, run, eager_full_steps=False)
            assert losses[:PLANT_AT] == plain[:PLANT_AT], attach
            assert not breaks
            kinds = set(amp_postmortem.load_run(run).scan_tensors(["step", "kind"], steps=[1])["kind"])
            assert {"activation", "grad_output", "grad_input"} <= kinds, (attach, kinds)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_in_graph_statistics_are_the_eager_definitions_under_inductor(dtype):
    """`graph_stats.write` compiled by inductor counts NaN and Inf exactly
    and takes the largest finite magnitude, as `isnan`, `isinf` and
    `nan_to_num` define them eagerly (the graph's formulation differs for
    speed: comparisons and int32 sums), as does the inputs' NaN/Inf total;
    an all-non-finite tensor's maximum is 0, and a planted value is found
    wherever it lies."""
    from recorders.collectors import graph_stats
    from recorders.graph_rows import ABSMAX, INF, NAN, NUMEL, WIDTH

    def stats(t):
        row = torch.zeros(WIDTH, dtype=torch.float64)
        graph_stats.write(row, torch.ones((), dtype=torch.float64), t)
        return row

    compiled = torch.compile(stats, backend="inductor", fullgraph=True)
    compiled_total = torch.compile(graph_stats.nonfinite_total, backend="inductor", fullgraph=True)
    g = torch.Generator().manual_seed(3)
    cases = []
    x = torch.randn(257, 131, generator=g).to(dtype)
    cases.append(x)
    y = x.clone()
    y.view(-1)[[0, 77, 33000]] = float("nan")
    y.view(-1)[[5, 9000]] = float("inf")
    y.view(-1)[-1] = float("-inf")
    y.view(-1)[123] = 60000.0 if dtype != torch.bfloat16 else 1e30
    cases.append(y)
    cases.append(torch.full((64,), float("nan"), dtype=dtype))
    cases.append(torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=dtype))
    for t in cases:
        got = compiled(t)
        assert got[NAN] == torch.isnan(t).sum().item()
        assert got[INF] == torch.isinf(t).sum().item()
        assert got[NUMEL] == t.numel()
        want = torch.nan_to_num(t.abs().double(), nan=0.0, posinf=0.0, neginf=0.0).max().item()
        assert got[ABSMAX].item() == want
        assert compiled_total(t).item() == (~torch.isfinite(t)).sum().item()


@pytest.mark.parametrize("dtype,k", [(torch.float16, 1000.0), (torch.bfloat16, 3.4e36), (torch.float32, 1e37)])
def test_in_graph_statistics_of_a_fused_product_count_its_stored_values(dtype, k):
    """A tensor made by a pointwise op in the same compiled graph: inductor
    fuses the statistics into the kernel that makes it and hands them the
    float32 product before its rounding to `dtype`. Products past the
    dtype's largest value are Inf in the tensor (and in eager's rows), and
    the in-graph counts say so (they once counted none, with an Inf
    maximum, as 70000 < inf in float32). The products are exact in
    float32, so eager's rounding and the compiled one agree bit for bit."""
    from recorders.collectors import graph_stats
    from recorders.graph_rows import ABSMAX, INF, NAN, WIDTH

    def stats(x, k):
        y = x * k
        row = torch.zeros(WIDTH, dtype=torch.float64)
        graph_stats.write(row, torch.ones((), dtype=torch.float64), y)
        return y, row, graph_stats.nonfinite_total(y)

    torch._dynamo.reset()
    # 65.5 and 65.51 times 1000 round to float16's largest value, 66 and
    # 100 past it; the bfloat16 and float32 products of 100 overflow too.
    x = torch.tensor([1.0, 100.0, -66.0, 2.0, -3.0, 65.5, 65.51, 0.5] * 40, dtype=dtype)
    y, row, total = torch.compile(stats, backend="inductor", fullgraph=True)(x, k)
    want_inf = torch.isinf(y).sum().item()
    assert want_inf > 0 and torch.equal(y, x * k)
    assert row[INF] == want_inf and row[NAN] == 0 and total == want_inf
    assert row[ABSMAX] == y[torch.isfinite(y)].abs().max().double()


def test_a_float16_overflow_made_in_the_graph_is_found_at_its_module(tmp_path):
    """End to end, float16 autocast, inductor, `compiled_rows`: a module
    whose product overflows float16 inside the compiled graph is where
    `nans` finds the first Inf, with eager's count, attached before
    compiling (hooks traced) and after (the root's own rows eager)."""
    from collections import OrderedDict

    class Gain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("k", torch.ones((), dtype=torch.float16))

        def forward(self, x):
            return x.to(torch.float16) * self.k

    x = torch.arange(-100.0, 100.0, 2.0).reshape(25, 4)  # exact in float16
    want_inf = int((x.abs() * 1000 >= 65520).sum())
    for attach in ("before", "after"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(OrderedDict(
            [("gain", Gain()), ("head", torch.nn.Linear(4, 1))]))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        run = tmp_path / attach
        rec = AmpRecorder(run, model, optimizer=opt, full_every=100, compiled_rows=True) \
            if attach == "before" else None
        compiled = torch.compile(model, backend="inductor")
        if rec is None:
            rec = AmpRecorder(run, compiled, optimizer=opt, full_every=100, compiled_rows=True)

        def gain_up(step, _, x, gain=model.gain):
            if step == 2:
                gain.k.fill_(1000.0)

        train(compiled, [(x, None)] * 3, recorder=lambda *_: rec, optimizer=opt, scaler=None, on_step=gain_up,
              loss_fn=lambda m, x, y, step, accumulate: m(x).float().mean())
        rows = amp_postmortem.load_run(run).scan_tensors(["step", "name", "kind", "inf_count", "input_nonfinite"],
                                                         steps=[2])
        gain = rows[(rows["name"] == "gain") & (rows["kind"] == "activation")]
        head = rows[(rows["name"] == "head") & (rows["kind"] == "activation")]
        assert len(gain) == 1 and len(head) == 1, attach
        assert gain["input_nonfinite"].iloc[0] == 0 and gain["inf_count"].iloc[0] == want_inf, attach
        assert head["input_nonfinite"].iloc[0] == gain["inf_count"].iloc[0], attach
        report = amp_postmortem.nans(run)
        assert report.first_nonfinite_step == 2, attach
        assert report.origins["forward"].name == "gain", attach


def test_in_graph_statistics_are_operations_the_partitioner_fuses():
    """Every operation the in-graph rows add to AOT autograd's joint graph
    (inductor's decompositions applied) is one its partitioner counts as
    fusible, but the `copy_` that applies a row's final value to its
    tensor. An unfusible one (the `stack` and `select_scatter` of an
    indexed write into a shared buffer, a functional `copy`) between a
    statistic and the rest of the forward makes the partitioner's "used
    far apart" rule ban recomputing later readers of the same tensor in the
    backward: on the benchmark GPT it saved GELU's derivative from the
    forward in float32 instead of recomputing it (`benchmarks/RESULTS.md`)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import get_default_op_list, min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    op_types = get_default_op_list()
    unfusible = set()

    def partition(joint, inputs, **kwargs):
        for node in joint.graph.nodes:
            if node.op == "call_function" and not op_types.is_fusible(node) and not op_types.is_view(node):
                unfusible.add(node.target)
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    def unfusible_of(fn):
        torch._dynamo.reset()
        unfusible.clear()
        x = torch.randn(8, 4, requires_grad=True)
        torch.compile(fn, backend=backend, fullgraph=True)(x).sum().backward()
        return set(unfusible)

    def keep(graph, _):
        return make_boxed_func(graph.forward)

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=partition,
                           decompositions=select_decomp_table())
    stats = GraphStats(["", "m"], device="cpu")
    model = torch.nn.Linear(4, 4)

    def plain(x):
        return model(x).relu()

    def recorded(x):
        stats.root_pre(model, (x,), {})
        stats.module_pre("m")(model, (x,), {})
        y = model(x).relu()
        return stats.module_post("m")(model, (x,), {}, y)

    assert unfusible_of(recorded) - unfusible_of(plain) == {torch.ops.aten.copy_.default}
    values = stats.take()
    assert values is not None and values.abs().sum() > 0


def test_full_tier_eager_forwards_leave_other_compiled_code_compiled(tmp_path):
    """Attached to the compiled module, a full-tier step runs the model's
    forwards eagerly (every module's rows) while every other compiled
    function of the process (a compiled loss, an EMA or evaluation model,
    another job) keeps running compiled, before, inside and after the
    step: the compiler's stance is process-wide and is held only during the
    root's forwards. The old recorder held it from one `step()` to the next
    (and from construction), so `other` ran eagerly there."""
    torch._dynamo.reset()

    def probe(x):
        # Traced by dynamo: the compiled branch; run eagerly: the other.
        return x + 1 if torch.compiler.is_compiling() else x - 1

    other = torch.compile(probe, backend="eager")
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    compiled = torch.compile(model, backend="eager")
    rec = AmpRecorder(tmp_path / "run", compiled, optimizer=opt, full_every=2, compiled_rows=False)
    z = torch.zeros(3)
    ran_compiled = []
    # Its own loop: it probes other compiled code right after rec.step() too, where train() has no callback.
    for step, (x, y) in enumerate(batches(4)):
        ran_compiled.append(other(z)[0].item() == 1)
        loss = ((compiled(x) - y) ** 2).mean()
        ran_compiled.append(other(z)[0].item() == 1)
        loss.backward()
        opt.step()
        opt.zero_grad()
        rec.step(loss)
        ran_compiled.append(other(z)[0].item() == 1)
    rec.close()
    assert all(ran_compiled), ran_compiled
    rows = amp_postmortem.load_run(tmp_path / "run").scan_tensors(["step", "name", "kind"])
    activations = rows[rows["kind"] == "activation"].groupby("step")["name"].nunique()
    # Full-tier steps 0 and 2 ran eagerly: every watched module's rows.
    assert activations.get(0, 0) == activations.get(2, 0) > 1


@pytest.mark.parametrize("dynamic", [False, True])
def test_in_graph_statistics_trace_symbolic_and_data_dependent_sizes(dynamic):
    """A module output whose size is symbolic (dynamic shapes) or data
    dependent (a mask's selection, as in mixture-of-experts routing) traces
    with no guard on its size and counts exactly: the counts' dtype is
    chosen without comparing the size."""
    from recorders.collectors import graph_stats
    from recorders.graph_rows import ABSMAX, INF, NAN, NUMEL, WIDTH
    torch._dynamo.reset()

    def stats(x):
        y = x[x > 0.5]
        row = torch.zeros(WIDTH, dtype=torch.float64)
        graph_stats.write(row, torch.ones((), dtype=torch.float64), y)
        return row, graph_stats.nonfinite_total(y), y

    compiled = torch.compile(stats, backend="inductor", fullgraph=True, dynamic=dynamic)
    for n in (100, 300):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        x[3], x[7] = math.inf, math.nan  # NaN is not > 0.5: not selected
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
            row, total, y = compiled(x)
        assert row[NAN] == 0 and row[INF] == 1 and total == 1
        assert row[NUMEL] == y.numel()
        assert row[ABSMAX] == y[torch.isfinite(y)].abs().max().double()


def test_the_optimizer_hook_runs_eagerly_inside_a_compiled_training_step(tmp_path):
    """A loop that compiles its whole step, the optimizer's included: the
    recorder's optimizer hook is never traced (it would run as a graph's
    constant-folded body, `is_compiling()` True) nor compiled; the step
    breaks its graph there (as at a `torch.compiler.disable`d function) and
    runs the hook eagerly, once a step, and every step's facts have their
    gradient norm. The per-call wrapper of `torch.compiler.disable` is gone
    from that hook (`guard.eager_hook`)."""
    from recorders.collectors.params import ParamGradCollector
    from recorders.guard import _EagerHook

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = TinyNet(blocks=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen = []
    original = ParamGradCollector._on_opt_pre

    def spy(self, *args):
        seen.append(torch.compiler.is_compiling())
        return original(self, *args)

    ParamGradCollector._on_opt_pre = spy
    try:
        rec = AmpRecorder(tmp_path / "run", model, optimizer=opt)
        (hook,) = [h for h in opt._optimizer_step_pre_hooks.values() if isinstance(h, _EagerHook)]

        @torch.compile(backend="eager")
        def step(x, y):
            loss = ((model(x).float() - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        for i, (x, y) in enumerate(batches(4)):
            rec.step(step(x, y))
        rec.close()
    finally:
        ParamGradCollector._on_opt_pre = original
    assert seen == [False] * 4
    assert counters["graph_break"]  # the step's graph breaks at the hook
    steps = amp_postmortem.load_run(tmp_path / "run").steps
    assert steps["skipped"].tolist() == [False] * 4
    assert steps["grad_norm"].notna().all() and (steps["grad_norm"] > 0).all()


@pytest.mark.parametrize("attach", ["before", "after"])
def test_a_compiled_model_that_returns_its_loss_has_it_captured(tmp_path, attach):
    """No scaler, `rec.step()` without a loss: the loss the model returns is
    the step's, taken by the tap the root's forward hook carries
    (`loss_tap.OutputLossTap`); attached before compiling, that hook is
    traced, and the tap goes into the graph's side effects."""
    class ReturnsLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x, y):
            return ((self.lin(x) - y) ** 2).mean()

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ReturnsLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = AmpRecorder(tmp_path / "run", model, optimizer=opt) if attach == "before" else None
    compiled = torch.compile(model, backend="aot_eager")
    if rec is None:
        rec = AmpRecorder(tmp_path / "run", compiled, optimizer=opt)
    losses = []
    for x, y in batches(4, d_in=4, d_out=1, shape=(8,)):
        loss = compiled(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        rec.step()
    rec.close()
    recorded = amp_postmortem.load_run(tmp_path / "run").steps["loss"].tolist()
    assert recorded == pytest.approx(losses, rel=1e-6)
