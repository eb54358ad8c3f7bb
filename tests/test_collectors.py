"""recorders/collectors: each collector alone, on tiny models, with a bare
`Shared` (no recorder, no writer, no bundles): the rows it adds to the step
state and nothing else. The recorder's end-to-end row tests (test_hooks,
test_recorder, test_sample_runs) pin what the collectors make together."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from recorders.collectors import backward as backward_mod
from recorders.collectors.autocast import AutocastWatch
from recorders.collectors.backward import BackwardCollector
from recorders.collectors.forward import ForwardCollector
from recorders.collectors.params import ParamGradCollector
from recorders.collectors.recompute import CheckpointRecompute
from recorders.collectors.state import Shared, StepState
from recorders.stats import grad_facts


class _NoBundles:
    """The bundle capture's hooks, doing nothing."""

    def __getattr__(self, name):
        return lambda *a, **k: None


def _guard(fn, traced=True):
    return fn  # a failure surfaces in the test


def _guard_call(fn, a, b):
    return lambda *args: fn(a, b, *args)


def _shared(full=False):
    shared = Shared(near_overflow=65504.0, guard=_guard, guard_call=_guard_call, bundles=_NoBundles())
    shared.state = StepState(0, True, full)
    return shared


def _collectors(model, shared, watched=None, optimizer=None):
    modules = dict(model.named_modules())
    watched = list(modules) if watched is None else watched
    params = ParamGradCollector(shared, params=list(model.named_parameters()), watched_modules=set(watched),
                                watch_param=lambda name: False, scaler=None, optimizer=optimizer)
    backward = BackwardCollector(shared, on_root_grad=params.await_backward_end)
    recompute = CheckpointRecompute(shared, backward)
    forward = ForwardCollector(shared, model=model, modules=modules, watched=watched,
                               params=list(model.named_parameters()), sharded=set(), backward=backward,
                               recompute=recompute,
                               autocast=AutocastWatch(shared, lambda info: None, active=lambda: forward.active()))
    handles: list = []
    forward.register(handles)
    params.register(handles)
    return forward, backward, params, handles


def _rows(st, kind):
    return [(m[0], m[4], st.stats[i]) for i, m in enumerate(st.meta) if m[1] == kind]


def _absmax(t):
    return float(t.detach().abs().max())


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_the_forward_collector_records_inputs_and_outputs_and_where_inputs_came_from():
    model, shared = Chain(), _shared()
    _collectors(model, shared)
    x = torch.randn(5, 4)
    with torch.no_grad():
        pass
    out = model(x)
    st = shared.state
    acts = {name: stats for name, _, stats in _rows(st, "activation")}
    assert set(acts) == {"a", "b", ""}
    assert acts["b"][0] == _absmax(out) and acts[""] is acts["b"]  # the root's output is b's: summarised once
    assert _rows(st, "input")[0][2][0] == _absmax(x)
    # a's input is the model's input row; b's input is a relu no module made:
    # a count-only row of its own.
    by_name = {m[0]: m for m in st.meta if m[1] == "activation"}
    inputs = st.meta[by_name["a"][7][0]]
    assert inputs[1] == "input"
    assert st.meta[by_name["b"][7][0]][1] == "_count"
    assert st.micro_batches == 1 and st.in_forward == 0


def test_the_forward_collector_records_nothing_paused_or_without_grad():
    model, shared = Chain(), _shared()
    _collectors(model, shared)
    shared.paused = 1
    model(torch.randn(2, 4))
    shared.paused = 0
    with torch.no_grad():
        model(torch.randn(2, 4))
    assert shared.state.meta == [] and shared.state.micro_batches == 0


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.fc(torch.tanh(self.norm(x)))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Residual(), Residual())

    def forward(self, x):
        return self.blocks(x)


def _expected_backward(model, x):
    """grad_output and grad_input of every module call as full backward
    hooks report them (on a copy: they reshape the graph)."""
    grads = {}
    for name, m in model.named_modules():
        def hook(module, grad_in, grad_out, name=name):
            grads[name] = (_absmax(grad_out[0]), None if grad_in[0] is None else _absmax(grad_in[0]))
        m.register_full_backward_hook(hook)
    model(x).square().sum().backward()
    return grads


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_the_backward_collector_records_what_reaches_outputs_and_what_inputs_get():
    import copy
    # Not a leaf: an input's gradient is recorded where autograd makes it
    # (a node inside the module hands it to the input's node).
    leaf = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    model = Stack().double()
    expected = _expected_backward(copy.deepcopy(model), leaf * 1.0)
    shared = _shared()
    _collectors(model, shared)
    model(leaf * 1.0).square().sum().backward()
    st = shared.state
    out = {name: stats[0] for name, _, stats in _rows(st, "grad_output")}
    inp = {name: stats[0] for name, _, stats in _rows(st, "grad_input")}
    for name, (g_out, g_in) in expected.items():
        assert out[name] == pytest.approx(g_out, rel=1e-12), name
        assert inp[name] == pytest.approx(g_in, rel=1e-12), name


def test_a_module_graph_is_walked_once_and_followed_by_its_plan_after():
    model, shared = Stack(), _shared()
    _, backward, _, _ = _collectors(model, shared)
    leaf = torch.randn(3, 4, requires_grad=True)
    for _ in range(3):
        shared.state = StepState(0, True, False)
        model(leaf * 1.0).sum().backward()
    assert all(n == 1 for n in backward._misses.values())  # built on the first call only
    assert {name: len(p) for name, p in backward._plans.items()} == {
        name: 1 for name, _ in model.named_modules()}


class Switch(nn.Module):
    """Uses its input once or twice depending on a flag: the same count of
    nodes and the same node type either way (x * w, x * x)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), 3.0))
        self.square = False

    def forward(self, x):
        return x * x if self.square else x * self.w


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.switch = Switch()

    def forward(self, x):
        return self.switch(x * 1.0)


def test_a_plan_that_no_longer_fits_the_graph_is_not_followed():
    model, shared = Outer(), _shared()
    _, backward, _, _ = _collectors(model, shared)
    x = torch.full((2, 4), 2.0, requires_grad=True)
    for square, expected in ((False, 3.0), (True, 4.0), (False, 3.0)):
        model.switch.square = square
        shared.state = StepState(0, True, False)
        model(x).sum().backward()
        rows = {name: stats[0] for name, _, stats in _rows(shared.state, "grad_input")}
        assert rows["switch"] == expected  # d(x*w)/dx = w = 3; d(x*x)/dx = 2x = 4
    assert len(backward._plans["switch"]) == 2


def test_a_module_whose_graph_keeps_changing_is_walked_every_call(monkeypatch):
    monkeypatch.setattr(backward_mod, "_MAX_PLANS", 1)
    model, shared = Outer(), _shared()
    _, backward, _, _ = _collectors(model, shared)
    x = torch.full((2, 4), 2.0, requires_grad=True)
    for square, expected in ((False, 3.0), (True, 4.0), (True, 4.0), (False, 3.0)):
        model.switch.square = square
        shared.state = StepState(0, True, False)
        model(x).sum().backward()
        rows = {name: stats[0] for name, _, stats in _rows(shared.state, "grad_input")}
        assert rows["switch"] == expected
    assert len(backward._plans["switch"]) == 1


def test_the_param_grad_collector_records_each_gradient_and_the_norm_at_backward_end():
    model, shared = Chain(), _shared()
    _, _, params, _ = _collectors(model, shared)
    model(torch.randn(5, 4)).square().sum().backward()
    st = shared.state
    assert set(st.param_grads) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        order, stats, _, dtype, numel = st.param_grads[name]
        assert stats[0] == _absmax(p.grad) and dtype == "float32" and numel == p.numel()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    # Each gradient's norm, from one reduction; their square sum is taken by
    # their reader (stats.grad_facts), off the training path.
    assert st.grad_norm_names == [n for n, _ in model.named_parameters()]
    sq, nonfinite, _ = grad_facts(st.grad_norms, None)
    assert sq ** 0.5 == pytest.approx(float(norm), rel=1e-5) and nonfinite == 0
    assert st.backward_passes == 1
    params.end_step(st)
    assert len(_rows(st, "param_grad")) == 4


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Chain()

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=True)


def test_the_recompute_collector_sets_a_reentrant_region_s_backward_hooks():
    model, shared = Checkpointed(), _shared()
    _collectors(model, shared)
    x = torch.randn(5, 4, requires_grad=True)
    model(x).sum().backward()
    st = shared.state
    names = {name for name, _, _ in _rows(st, "grad_output")}
    assert {"inner.a", "inner.b"} <= names  # hooked while recomputed in backward
    assert len([m for m in st.meta if m[1] == "activation" and m[0] == "inner.a"]) == 1  # no second forward row


class MaybeCheckpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        torch.manual_seed(0)
        self.seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.reentrant = reentrant

    def forward(self, x):
        return checkpoint(self.seq, x, use_reentrant=True) if self.reentrant else self.seq(x)


def _backward_rows(model):
    shared = _shared()
    _collectors(model, shared)
    model(torch.randn(3, 4, requires_grad=True) * 1.0).sum().backward()
    st = shared.state
    rows = sorted((m[3], m[0], m[1]) for m in st.meta if m[2] == "backward" and m[0].startswith("seq"))
    return [(name, kind) for _, name, kind in rows], [st.stats[i] for i, m in enumerate(st.meta)
                                                       if m[2] == "backward" and m[0].startswith("seq")]


def test_a_recomputed_region_keeps_the_forward_s_row_order():
    """Calls sharing a node (the container's output is its last child's)
    share its hooks in a recomputed region as in the forward: the
    container's grad_output comes before its last child's grad_input."""
    plain, _ = _backward_rows(MaybeCheckpointed(reentrant=False))
    recomputed, _ = _backward_rows(MaybeCheckpointed(reentrant=True))
    # The region's input is a detached leaf in the recompute (no node hands
    # it a gradient): those grad_input rows are missing, the rest in order.
    assert recomputed == [row for row in plain if row in recomputed]
    assert recomputed.index(("seq", "grad_output")) < recomputed.index(("seq.1", "grad_input"))


def test_the_autocast_watch_reads_what_the_children_ran():
    seen = []
    model, shared = Chain(), _shared()
    fwd, _, _, handles = _collectors(model, shared)
    fwd.autocast._on_autocast = seen.append
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 4))
    assert seen[-1]["enabled"] and seen[-1]["dtype"] == "bfloat16"


def test_the_collectors_remove_every_hook():
    model, shared = Chain(), _shared()
    _, _, _, handles = _collectors(model, shared)
    for h in handles:
        h.remove()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


# ------------------------------------------------------- allocation budget
class Deep(nn.Module):
    """Many small modules: the launch-bound shape, where the recorder's own
    per-row objects would be most of what a step allocates."""

    def __init__(self, n=12, width=8):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Residual4(width) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


class Residual4(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


# Python objects the garbage collector tracks, made by one recorded step
# beyond what the same step makes unrecorded, per row the step records.
# Every such object that lives to the step's end is promoted to the old
# generation, whose growth sets off full collections of the whole process
# (tens of milliseconds with torch loaded). Measured 5.8 when this was set.
OBJECTS_PER_ROW_BUDGET = 6.5


# Its own loop: it counts the objects one bare step makes, which train()'s own would add to.
def _tracked_objects_made(model, rec, x, opt):
    def step():
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):
        loss = step()
        if rec is not None:
            rec.step(loss)
    if rec is not None:
        rec.flush()
    gc.collect()
    gc.disable()
    try:
        before = {id(o) for o in gc.get_objects()}
        step()
        made = 0
        for o in gc.get_objects():  # a loop: a comprehension is an object itself
            if id(o) not in before:
                made += 1
    finally:
        gc.enable()
    return made


def test_a_recorded_step_allocates_a_bounded_number_of_objects_per_row(tmp_path):
    from recorders import AmpRecorder
    x = torch.randn(4, 8)
    plain_model = Deep()
    plain = _tracked_objects_made(plain_model, None, x, torch.optim.SGD(plain_model.parameters(), lr=1e-3))
    model = Deep()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    rec = AmpRecorder(tmp_path / "run", model, optimizer=opt, full_every=0, bundles=False)
    try:
        recorded = _tracked_objects_made(model, rec, x, opt)
        st = rec.hooks.state
        rows = len(st.stats) + len(st.param_grads)
    finally:
        rec.close()
    assert rows > 200
    assert (recorded - plain) / rows <= OBJECTS_PER_ROW_BUDGET, (recorded, plain, rows)


def test_host_statistics_are_tuples_the_collector_stops_tracking():
    from recorders.stats import grad_facts, row_stats
    values = row_stats(torch.randn(16), full=False)
    assert type(values) is tuple
    gc.collect()
    assert not gc.is_tracked(values)
