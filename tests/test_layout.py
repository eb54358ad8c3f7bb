"""The recorder around wrapped models, in one process: `torch.compile` with
the recorder attached after or before compiling, and activation
checkpointing (reentrant, non-reentrant, `checkpoint_wrapper`). Training
stays bit-identical, rows carry the user's names, compiled graphs have no
graph break and compile once, compiled steps carry every module's rows, and
every module's forward is recorded once."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import amp_postmortem
from recorders import AmpRecorder
from recorders.layout import canonical_modules, user_class
from tiny_models import Block, TinyNet, batches, train

STEPS = 4


def _train(model, data, rec_at=None, compile_=None, full_every=3):
    """bfloat16 autocast, SGD; `rec_at(model, opt)` builds the recorder;
    `compile_(model)`: compile before (`"before"` recorder) or after. Returns
    (losses, final weights, graphs compiled after each step, run)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rec = None
    if rec_at is not None and compile_ != "after":
        rec = rec_at(model, opt, full_every)
    counter = CompileCounter()
    run_model = torch.compile(model, backend=counter) if compile_ else model
    if rec_at is not None and compile_ == "after":
        rec = rec_at(run_model, opt, full_every)
    graphs = []
    trained = train(run_model, data, recorder=(lambda *_: rec) if rec else None, optimizer=opt,
                    dtype=torch.bfloat16, scaler=None, after_update=lambda step, _: graphs.append(counter.frame_count))
    return trained.losses, trained.params, graphs


def _recorder(run, **options):
    return lambda model, opt, full_every: AmpRecorder(run, model, optimizer=opt, full_every=full_every, **options)


def _rows(run, steps=None):
    df = amp_postmortem.load_run(run).scan_tensors(["step", "name", "kind", "call", "absmax"], steps=steps)
    return df.sort_values(["step", "name", "kind", "call"]).reset_index(drop=True)


def _eager_run(root, blocks):
    run = root / f"eager_{blocks}_blocks"
    torch.manual_seed(0)
    _train(TinyNet(blocks=blocks), batches(STEPS), _recorder(run))
    return run


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory):
    return _eager_run(tmp_path_factory.mktemp("layout"), blocks=2)


# The compiled jobs train a one-block TinyNet (its residual sums, LayerNorm,
# attention and MLP are what dynamo traces; a second block doubled the
# tracing time) against the same model's eager run.
COMPILED_BLOCKS = 1


@pytest.fixture(scope="module")
def compiled_eager_run(tmp_path_factory):
    return _eager_run(tmp_path_factory.mktemp("layout"), blocks=COMPILED_BLOCKS)


# ---------------------------------------------------------------- compile
@pytest.mark.parametrize("attach", ["after", "before"])
def test_compiled_model_records_without_graph_breaks_or_recompiles(attach, compiled_eager_run, tmp_path):
    eager_run = compiled_eager_run
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    plain = _train(TinyNet(blocks=COMPILED_BLOCKS), batches(STEPS), compile_=attach)
    plain_breaks = dict(counters["graph_break"])
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    run = tmp_path / "compiled"
    recorded = _train(TinyNet(blocks=COMPILED_BLOCKS), batches(STEPS), _recorder(run, compiled_rows=True),
                      compile_=attach)

    assert recorded[0] == plain[0] and all(torch.equal(a, b) for a, b in zip(recorded[1], plain[1]))
    assert dict(counters["graph_break"]) == plain_breaks == {}
    # Compiled once: the eager full-tier steps (0 and 3 when attached to the
    # compiled module, 3 when attached before) neither recompile nor
    # invalidate the graphs (the root's hooks, traced when attached before
    # compiling, are frames of their own).
    assert len(set(recorded[2][1:])) == 1 and (recorded[2][0] == 0) == (attach == "after")
    assert plain[2] == [1, 1, 1, 1]

    loaded = amp_postmortem.load_run(run)
    assert loaded.manifest["model_class"] == "tiny_models.TinyNet"
    assert loaded.manifest["compiled"]["detected"] is True
    assert loaded.steps["micro_batches"].tolist() == [1] * STEPS
    rows = _rows(run)
    assert not rows["name"].str.contains("_orig_mod").any()
    eager = _rows(eager_run)
    # Full-tier step 3 ran eagerly: every row of the eager run, same values.
    assert rows[rows["step"] == 3].reset_index(drop=True).equals(eager[eager["step"] == 3].reset_index(drop=True))
    # A compiled step: every row of the eager run, computed in the graph
    # (this backend runs the graph's ops eagerly: the same values).
    compiled_step = rows[rows["step"] == 1].reset_index(drop=True)
    assert compiled_step.equals(eager[eager["step"] == 1].reset_index(drop=True))
    assert loaded.steps["grad_norm"].tolist() == amp_postmortem.load_run(eager_run).steps["grad_norm"].tolist()


def test_eager_full_steps_off_keeps_every_step_compiled(tmp_path):
    torch._dynamo.reset()
    torch.manual_seed(0)
    run = tmp_path / "compiled"
    _, _, graphs = _train(TinyNet(blocks=COMPILED_BLOCKS), batches(STEPS),
                          _recorder(run, eager_full_steps=False, compiled_rows=True), compile_="after")
    assert graphs == [1, 1, 1, 1]  # step 0, full tier, compiled too
    rows = _rows(run)
    # The graph's cheap rows on every step, the full tier's own included.
    names = {n for n, _ in canonical_modules(TinyNet(blocks=COMPILED_BLOCKS))}
    for step in range(STEPS):
        assert set(rows.loc[(rows["step"] == step) & (rows["kind"] == "activation"), "name"]) == names
    assert amp_postmortem.load_run(run).manifest["compiled"]["eager_steps"] == "none (eager_full_steps=False)"


# ---------------------------------------------------------- checkpointing
class CheckpointedNet(TinyNet):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


def _wrapped_net():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    model = TinyNet()
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    return model


CHECKPOINTED = {
    "reentrant": lambda: CheckpointedNet(reentrant=True),
    "non_reentrant": lambda: CheckpointedNet(reentrant=False),
    "wrapper": _wrapped_net,
}


@pytest.mark.parametrize("kind", sorted(CHECKPOINTED))
def test_checkpointed_modules_are_recorded_once_per_micro_batch(kind, eager_run, tmp_path):
    torch.manual_seed(0)
    plain = _train(CHECKPOINTED[kind](), batches(STEPS))
    torch.manual_seed(0)
    run = tmp_path / kind
    recorded = _train(CHECKPOINTED[kind](), batches(STEPS), _recorder(run))
    assert recorded[0] == plain[0] and all(torch.equal(a, b) for a, b in zip(recorded[1], plain[1]))

    rows, eager = _rows(run), _rows(eager_run)
    if kind != "wrapper":  # CheckpointedNet runs its blocks one by one, never the Sequential
        eager = eager[eager["name"] != "blocks"]
    forward = rows[rows["kind"].isin(["input", "activation", "loss", "param_grad"])].reset_index(drop=True)
    expected = eager[eager["kind"].isin(["input", "activation", "loss", "param_grad"])].reset_index(drop=True)
    # Every module once (call 0 only), none dropped, the eager values.
    assert forward.equals(expected)
    assert set(rows["call"]) == {0}
    # Gradients reaching every module's outputs: in reentrant mode only the
    # recomputation builds the region's graph, and is hooked for them.
    grad_out = rows.loc[rows["kind"] == "grad_output", ["step", "name"]].reset_index(drop=True)
    assert grad_out.equals(eager.loc[eager["kind"] == "grad_output", ["step", "name"]].reset_index(drop=True))


def test_canonical_names_walk_wrappers_by_type_not_by_string():
    class Holder(torch.nn.Module):  # a user's child named `module` keeps its name
        def __init__(self):
            super().__init__()
            self.module = TinyNet()

    wrapped = torch.compile(_wrapped_net(), backend="eager")
    names = [n for n, _ in canonical_modules(wrapped)]
    assert names == [n for n, _ in TinyNet().named_modules()]
    assert user_class(wrapped) is TinyNet
    assert [n for n, _ in canonical_modules(Holder())][:3] == ["", "module", "module.embed"]
