"""replaying/outputs.py: the loss among a model's outputs and the outputs a
backward starts from, and a nanoGPT-style `(logits, loss)` model recorded by
the real recorder and replayed like the step (one backward start)."""
from __future__ import annotations

import json
from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from amp_postmortem.names import BackwardStart
from amp_postmortem.replaying import ReplaySession, RunConfig, replay, resolve_policy
from amp_postmortem.replaying.outputs import backward_roots, find_loss
from tiny_models import recorder_at, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Out:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


def test_find_loss_takes_the_loss_wherever_the_model_returns_it():
    logits, loss, aux = torch.randn(2, 3), torch.tensor(1.5), torch.tensor(0.25)
    Pair = namedtuple("Pair", "logits loss")
    assert find_loss(loss) is loss
    assert find_loss({"loss": loss, "logits": logits}) is loss
    assert find_loss(OrderedDict(logits=logits)) is None          # an HF output without labels
    assert find_loss(Out(logits, loss)) is loss
    assert find_loss(Out(logits)) is None
    assert find_loss(Pair(logits, loss)) is loss
    assert find_loss((logits, loss)) is loss                      # nanoGPT
    assert find_loss((loss, logits)) is loss                      # HF return_dict=False
    assert find_loss((loss, aux, logits)) is loss                 # the first, as the Trainer takes it
    assert find_loss((logits, loss, aux)) is None                 # ambiguous: a loss_fn says which
    assert find_loss(logits) is None and find_loss(None) is None
    assert find_loss((torch.tensor(3),)) is None                  # integers are not a loss


def test_backward_roots_drop_outputs_another_output_was_computed_from():
    x = torch.randn(4, 3, requires_grad=True)
    logits = x * 2
    loss = logits.square().mean()
    other = x.sum(1)
    assert backward_roots([loss, logits]) == [True, False]
    assert backward_roots([logits, loss, other]) == [False, True, True]
    # A chain: only the last is a start.
    total = loss * 3
    assert backward_roots([logits, loss, total]) == [False, False, True]
    # The same tensor twice: its gradient counted once.
    assert backward_roots([logits, logits]) == [True, False]
    # Two outputs of one node (chunk): independent.
    a, b = logits.chunk(2)
    assert backward_roots([a, b]) == [True, True]


class TupleLM(nn.Module):
    """nanoGPT's contract: forward(idx, targets) -> (logits, loss)."""

    def __init__(self, vocab=16, d=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, targets=None):
        logits = self.head(torch.relu(self.mix(self.embed(idx))))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


@pytest.fixture(scope="module")
def tuple_run(tmp_path_factory):
    """TupleLM trained 2 steps in bf16 under the real recorder, step 1 saved;
    with the parameter gradients training made at step 1."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("runs") / "tuple_logits_loss"
    gen = torch.Generator().manual_seed(0)
    data = [(idx, idx) for idx in (torch.randint(0, 16, (4, 6), generator=gen) for _ in range(2))]
    trained = {}

    def keep_grads(step, model):
        if step == 1:
            trained.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    train(TupleLM(), data, recorder=recorder_at(path, bundle_steps=(1,)), dtype=torch.bfloat16, scaler=None, lr=0.1,
          loss_fn=lambda model, x, y, step, accumulate: model(x, y)[1], before_update=keep_grads)
    return path, trained


def test_tuple_logits_loss_model_replays_like_the_step(tuple_run):
    path, trained = tuple_run
    result = replay(path, step=1, model=TupleLM, precisions="fp64,bf16", local=False)
    assert result.reproduced is True and result.backward_start is BackwardStart.SAVED
    assert result.loss["bf16"] == pytest.approx(result.loss["recorded"], rel=0, abs=0)
    assert not any("not a loss" in line for line in result.lines())
    # A model without a Hugging Face-style config saves none.
    assert json.loads((path / "manifest.json").read_text())["model_config"] is None

    session = ReplaySession(result_bundle(path, 1), TupleLM())
    bundle = session.bundle
    run = session.run(RunConfig("bf16", policy=resolve_policy("recorded", bundle, "bf16")), capture=False)
    # One backward start, from the loss: the training's gradients, bit for bit (not 2x).
    for name, g in trained.items():
        assert torch.equal(run.param_grads[name], g.double()), name


def result_bundle(run_dir, step):
    from amp_postmortem.reading.bundle import find_bundle, load_bundle
    return load_bundle(find_bundle(run_dir, step, None))


def test_a_loss_fn_on_the_logits_alone_starts_the_backward_at_the_logits(tuple_run):
    path, _ = tuple_run
    session = ReplaySession(result_bundle(path, 1), TupleLM())

    def logits_loss(out, mb):
        return out[0].double().square().mean()
    session.derive_grad_outputs(logits_loss)
    # d(loss_fn)/d(model's own loss) is None: the logits are the only start.
    assert session.grad_outputs[0][1] is None and session.grad_outputs[0][0] is not None
    run = session.run(RunConfig("fp64"), capture=False)
    model = session.model(torch.float64)
    args, kwargs = session.bundle.inputs[0]
    logits_loss(model(*args, **kwargs), 0).backward()
    for name, p in model.named_parameters():
        assert torch.allclose(run.param_grads[name], p.grad, rtol=1e-12, atol=0), name


def test_a_bundle_whose_output_gradients_were_let_go_says_how_its_backward_starts(tuple_run):
    """`grad_outputs_released` (a clean step's bundle saved after its output
    gradients were let go): the backward starts from a loss function when
    one is given, else it is not replayed, and the note says which."""
    path, _ = tuple_run
    bundle = result_bundle(path, 1)
    bundle.meta["grad_outputs_released"] = True
    bundle.grad_outputs = [[None] * len(grads) for grads in bundle.grad_outputs]
    notes = ReplaySession(bundle, TupleLM()).start_backward()
    assert len(notes) == 1 and "not replayed" in notes[0]
    session = ReplaySession(bundle, TupleLM())
    notes = session.start_backward(lambda out, mb: out[1])
    assert "loss_fn" in notes[0] and session.backward_start is BackwardStart.LOSS_FN
    assert any(g is not None for g in session.grad_outputs[0])
