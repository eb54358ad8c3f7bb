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
from tiny_models import TinyNet, batches

STEPS = 6
FULL_EVERY = 4  # steps 0 and 4 full (eager), the others compiled
PAUSED_AT = 2  # a paused forward pass (gradients on) in this step
PLANT_AT = 5  # an Inf planted in PLANTED's weight before this step's forward
PLANTED = "blocks.0.mlp.0"  # its Inf reaches mlp.2, the residual sum and the head


def _job(attach, run, backend="inductor", **options):
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
    losses, frames, graphs = [], [], []
    for step, (x, y) in enumerate(batches(STEPS)):
        if step == PLANT_AT:
            with torch.no_grad():
                model.blocks[0].mlp[0].weight[3, 5] = math.inf
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ((compiled(x).float() - y) ** 2).mean()
        if step == PAUSED_AT and rec is not None:
            with rec.paused(), torch.autocast("cpu", dtype=torch.bfloat16):
                compiled(x)  # an eval pass with gradients enabled: not recorded
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rec is not None:
            rec.step(loss)
        losses.append(loss.item())
        frames.append(counter.frame_count)
        graphs.append(counters["stats"]["unique_graphs"])
    breaks = dict(counters["graph_break"])
    if rec is not None:
        rec.close()
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
    buf = stats.buffer
    act = stats.index[("a", "activation")]
    buf[act, [0, 4, 5, 6, 7, 8]] = torch.tensor([2.0, 1, 6, 2, 2, 1], dtype=torch.float64)
    stats.grads[stats.index[("a", "grad_output")]][[0, 2, 4, 5, 7]] = torch.tensor(
        [1.0, 1, 1, 6, 2], dtype=torch.float64)
    stats.grads[stats.index[("a", "grad_input")]][[0, 4, 5, 7]] = torch.tensor([1.0, 1, 4, 2], dtype=torch.float64)
    stats.ran = True
    values = stats.take().numpy()
    assert stats.take() is None and float(buf.abs().sum()) == 0
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
