"""recorders.hooks: step boundaries and autocast read where the model's
modules run, not only at the root's forward."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn

from framework_runs import read_table
from recorders import AmpRecorder
from recorders.format import schema
from tiny_models import recorder_at, train


class Container(nn.Module):
    """Like a LightningModule: the loop calls its submodules, never it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)


def test_a_root_whose_forward_never_runs_is_recorded_per_micro_batch(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(5, 4, generator=g), None) for _ in range(6)]  # three micro-batches per optimizer step

    def loss_fn(model, x, y, step, accumulate):
        return model.head(model.body(x)).float().pow(2).mean()

    train(Container(), data, recorder=recorder_at(tmp_path / "run", full_every=1, bundles=False), accumulate=3,
          dtype=torch.bfloat16, scaler=None, lr=0.1, loss_fn=loss_fn)
    steps = read_table(tmp_path / "run", "steps")
    assert steps["micro_batches"].tolist() == [3, 3]
    tensors = read_table(tmp_path / "run", "tensors")
    step0 = tensors[tensors.step == 0]
    inputs = step0[step0.kind == "input"]
    assert inputs["name"].tolist() == [schema.INPUT_NAME] and inputs["numel"].tolist() == [3 * 5 * 4]
    assert set(step0[step0.kind == "activation"]["name"]) == {"body", "head"}
    assert set(step0[step0.kind == "param"]["name"]) == {"body.weight", "body.bias", "head.weight", "head.bias"}
    # The batch comes first, then the modules in the order they ran.
    fwd = step0[step0.phase == "forward"].sort_values("order")
    assert fwd["name"].tolist()[:3] == [schema.INPUT_NAME, "body", "head"]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["autocast"]["dtype"] == "bfloat16"


class AutocastInside(nn.Module):
    """Enters autocast inside its forward, after its pre-hooks ran, as
    Accelerate's prepared model does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.fc(x)


def test_autocast_is_read_where_the_children_run(tmp_path):
    model = AutocastInside()
    with AmpRecorder(tmp_path / "run", model, bundles=False) as rec:
        model(torch.randn(2, 4)).float().sum().backward()
        rec.step()
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["autocast"] == {"enabled": True, "device_type": "cpu", "dtype": "bfloat16",
                                    "cache_enabled": True}


class EmbedFirst(nn.Module):
    """The loop looks the embedding up itself, then calls the model on it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 1)

    def forward(self, h):
        return self.fc(h)


def _embed_first_loss(model, tokens, y, step, accumulate):
    return model(model.embed(tokens)).float().sum()


def test_a_submodule_called_before_the_model_opens_no_extra_micro_batch(tmp_path):
    train(EmbedFirst(), [(torch.arange(6), None)] * 6, recorder=recorder_at(tmp_path / "run", bundles=False),
          accumulate=2, dtype=None, scaler=None, loss_fn=_embed_first_loss, pass_loss=False)
    assert read_table(tmp_path / "run", "steps")["micro_batches"].tolist() == [2, 2, 2]


class PreparedEmbedFirst(EmbedFirst):
    """Autocast entered inside the root's forward (as Accelerate prepares a
    model), its embedding looked up by the loop outside it."""

    def forward(self, h):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.fc(h)


def test_a_child_called_outside_autocast_does_not_hide_the_autocast_inside(tmp_path):
    train(PreparedEmbedFirst(), [(torch.arange(6), None)] * 2, recorder=recorder_at(tmp_path / "run", bundles=False),
          dtype=None, scaler=None, loss_fn=_embed_first_loss, pass_loss=False)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["autocast"] == {"enabled": True, "device_type": "cpu", "dtype": "bfloat16",
                                    "cache_enabled": True}
    assert read_table(tmp_path / "run", "steps")["micro_batches"].tolist() == [1, 1]


class _Residual(nn.Module):
    """Its input feeds a child and a skip connection: two gradient parts."""

    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class _Nested(nn.Module):
    """Containers inside containers, a module called twice, an input that
    only the first child uses (the Sequential) and one two children use."""

    def __init__(self, width=6):
        super().__init__()
        self.entry = nn.Linear(width, width)
        self.stack = nn.Sequential(_Residual(width), _Residual(width))
        self.shared = nn.Linear(width, width)
        self.side = nn.Linear(width, width)

    def forward(self, x):
        h = self.stack(self.entry(x))
        h = self.shared(torch.tanh(self.shared(h))) + self.side(h)
        return h


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_grad_input_rows_equal_what_each_module_call_hands_its_inputs(tmp_path):
    # Nested modules' walks reuse their children's (hooks._hook_grad_inputs):
    # every module call's grad_input must still be the gradient its own
    # backward hands its input, as a full backward hook reports it.
    torch.manual_seed(0)
    model = _Nested().double()
    reference = copy.deepcopy(model)
    x = torch.randn(5, 6, dtype=torch.float64)

    expected, calls = {}, {}
    for name, m in reference.named_modules():
        def hook(module, grad_in, grad_out, name=name):
            call = calls[name] = calls.get(name, -1) + 1  # backward runs calls last first
            if grad_in[0] is not None:  # None: the model's input, which needs no gradient
                expected[(name, call)] = float(grad_in[0].abs().max())
        m.register_full_backward_hook(hook)
    reference(x).square().sum().backward()

    rec = AmpRecorder(tmp_path / "run", model)
    model(x).square().sum().backward()
    rec.step()
    rec.close()
    rows = read_table(tmp_path / "run", "tensors")
    got = rows[rows["kind"] == "grad_input"]
    n_calls = {name: int((got["name"] == name).sum()) for name in set(got["name"])}
    recorded = {(r.name, n_calls[r.name] - 1 - int(r.call)): float(r.absmax) for r in got.itertuples()}
    assert set(recorded) == set(expected) and len(expected) == 16
    for key, value in expected.items():
        assert recorded[key] == pytest.approx(value, rel=1e-12), key


def _closures_made_in_a_step(model, recorder):
    """Functions and closure cells created by one forward and backward of a
    trained model (the third step), with the garbage collector held off so
    that nothing created is missed."""
    import gc
    import types

    from tiny_models import batches
    made = {}

    def build(*args):
        made["rec"] = recorder(*args)
        return made["rec"]

    def before(step, model, x):
        if step == 2:
            if "rec" in made:
                # The writer thread's work on earlier steps (the manifest's
                # JSON, a journal append) done first: its objects are not
                # the hooks', and gc.get_objects() sees every thread's.
                made["rec"].flush()
            gc.collect()
            gc.disable()
            made["before"] = {id(o) for o in gc.get_objects()}

    def after(step, micro_batch, rec):
        if step == 2:
            count = 0
            for o in gc.get_objects():  # a loop: a comprehension is a function itself
                if type(o) in (types.FunctionType, types.CellType) and id(o) not in made["before"]:
                    count += 1
            made["count"] = count
            gc.enable()

    try:
        train(model, batches(4), recorder=build if recorder else None, on_step=before, after_backward=after)
    finally:
        gc.enable()
    return made["count"]


def test_a_recorded_step_makes_no_closures_for_the_garbage_collector(tmp_path):
    """The backward hooks set for every module call of every step are one
    small object each: as a hook closure inside a guard closure they were
    most of the objects a step allocated (eleven each), enough for a
    garbage collection every step and a full one (~150 ms) every few
    hundred steps."""
    from tiny_models import TinyNet
    torch.manual_seed(0)
    model = TinyNet()
    plain = _closures_made_in_a_step(copy.deepcopy(model), None)
    recorded = _closures_made_in_a_step(model, recorder_at(tmp_path / "run"))
    assert recorded == plain


def test_a_sampled_steps_gradient_hooks_leave_nothing_on_the_parameters(tmp_path):
    """The gradient rows of a sampled step come from hooks on the
    parameters' AccumulateGrad nodes, which torch frees with the step's
    graphs: a tensor's own post-accumulate-grad hook would stay on it for
    good (torch calls its emptied dict on every later backward, for every
    parameter). The rows are there, in backward order, micro-batches
    accumulated; the steps after carry no hook of the recorder's."""
    import amp_postmortem
    from tiny_models import TinyNet, batches
    torch.manual_seed(0)
    model = TinyNet()
    seen = []
    trained = train(model, batches(8), recorder=recorder_at(tmp_path / "run", full_every=4), accumulate=2,
                    scaler=None, dtype=None,
                    after_backward=lambda step, mb, rec: seen.append(
                        [p._post_accumulate_grad_hooks for p in model.parameters()]))
    assert trained.rec is not None and all(h is None for hooks in seen for h in hooks)
    rows = amp_postmortem.load_run(tmp_path / "run").scan_tensors(["step", "name", "kind", "order", "absmax"],
                                                                  steps=[0])
    grads = rows[rows["kind"] == "param_grad"].set_index("name")
    assert set(grads.index) == {n for n, _ in model.named_parameters()}
    assert grads["order"].is_unique  # the order the gradients were made in
    torch.manual_seed(0)
    again = TinyNet()
    for x, y in batches(2):  # the first step by hand: its gradients, both micro-batches accumulated
        (torch.nn.functional.mse_loss(again(x), y) / 2).backward()
    for name, p in again.named_parameters():
        assert grads.loc[name, "absmax"] == pytest.approx(p.grad.abs().max().item(), rel=1e-5)


class ReturnsItsWeight(nn.Module):
    """A module whose output is a leaf: its own parameter (a learned
    positional table handed on as it is)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, 8))

    def forward(self):
        return self.table


class UsesATable(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pos = ReturnsItsWeight()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(x + self.pos())


def test_a_leaf_a_module_returns_carries_no_hook_after_its_step(tmp_path):
    """The gradient reaching a watched module's output that is a leaf (a
    parameter it returns) is taken by a hook on the tensor, which outlives
    the step: it goes at the step's end. It stayed, one more per sampled
    step, each called by every later backward and holding its step's call
    context. The module's `grad_output` row is there on every step."""
    import amp_postmortem
    model = UsesATable()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks_after = []
    g = torch.Generator().manual_seed(1)
    with AmpRecorder(tmp_path / "run", model, optimizer=opt, full_every=1) as rec:
        for _ in range(4):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
            rec.step()
            hooks_after.append(len(model.pos.table._backward_hooks or {}))
    assert hooks_after == [0, 0, 0, 0]
    rows = amp_postmortem.load_run(tmp_path / "run").scan_tensors(["step", "name", "kind"])
    outs = rows[(rows["name"] == "pos") & (rows["kind"] == "grad_output")]
    assert sorted(outs["step"]) == [0, 1, 2, 3]


class FailsOnce(nn.Module):
    """Raises in its forward on one call, after its first layer ran (the
    loop catches it and moves on, as a job skipping a bad batch does)."""

    def __init__(self, fail_on_call=None):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        self.fail_on_call = fail_on_call
        self.calls = 0

    def forward(self, x):
        h = self.body(x)
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise ValueError("a bad batch")
        return self.head(torch.relu(h))


def _skip_bad_batches(run, model, batches, accumulate=1):
    # Its own loop: the test is about a loop that drops a batch whose forward raised.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with AmpRecorder(run, model, optimizer=opt, full_every=1) as rec:
        it = iter(batches)
        for x, y in it:
            done = 0
            while done < accumulate:
                try:
                    loss = ((model(x) - y) ** 2).mean()
                except ValueError:
                    x, y = next(it)  # the loop drops the batch and takes the next
                    continue
                loss.backward()
                done += 1
                if done < accumulate:
                    x, y = next(it)
            opt.step()
            opt.zero_grad()
            rec.step(loss)
    cols = ["step", "name", "kind", "call", "numel", "rms"]
    return (read_table(run, schema.TENSORS_DIR)[cols].sort_values(cols[:4]).reset_index(drop=True),
            read_table(run, schema.STEPS_DIR)[["step", "micro_batches"]])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_forward_that_raised_closes_its_micro_batch(tmp_path, accumulate):
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(5, 4, generator=g), torch.randn(5, 1, generator=g)) for _ in range(9)]
    bad = 3  # the fourth batch: the first micro-batch of step 1 (accumulate 2), or step 3's
    failed = _skip_bad_batches(tmp_path / "failed", FailsOnce(fail_on_call=bad + 1), data, accumulate)
    clean = _skip_bad_batches(tmp_path / "clean", FailsOnce(), data[:bad] + data[bad + 1:], accumulate)
    # The same rows as a run that never saw the bad batch: no doubled
    # numel, no extra call or micro-batch in the step after the failure.
    assert failed[1]["micro_batches"].tolist() == [accumulate] * (8 // accumulate)
    assert failed[1].equals(clean[1])
    assert failed[0].equals(clean[0])
