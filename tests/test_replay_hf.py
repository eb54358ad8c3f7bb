"""Replay of Hugging Face models: a tiny GPT-2 from `transformers` (built
from a config, never downloaded) called with `labels=`, trained under the
real recorder on the CPU, then replayed: one backward start (the loss), the
loss found among the outputs, a local error for attention blocks (keyword
arguments, a cache object, tuple outputs), and the model rebuilt from the
config saved with the run (`transformers:AutoModelForCausalLM`)."""
from __future__ import annotations

import json

import pytest
import torch

from amp_postmortem.names import BackwardStart
from amp_postmortem.replaying import ReplaySession, RunConfig, replay, resolve_policy
from tiny_models import recorder_at
from tiny_models import train as train_loop

transformers = pytest.importorskip("transformers")  # the `hf` extra; CI installs it

pytestmark = pytest.mark.usefixtures("one_torch_thread")

OVERFLOW_STEP = 2


def gpt2(attn="sdpa"):
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, attn_implementation=attn)
    return transformers.GPT2LMHeadModel(config)


def eager_gpt2():
    return gpt2("eager")


def train(path, model, *, steps, dtype, scaler=None, plant=None, **recorder_kwargs):
    """The shared loop on `model`, the loss computed inside it (`labels=`); returns
    the parameter gradients of every step as training made them."""
    gen = torch.Generator().manual_seed(0)
    data = [(ids, ids) for ids in (torch.randint(0, 64, (4, 16), generator=gen) for _ in range(steps))]
    grads = []
    train_loop(model, data, recorder=recorder_at(path, **recorder_kwargs), dtype=dtype, scaler=scaler, lr=0.01,
               loss_fn=lambda model, x, y, step, accumulate: model(input_ids=x, labels=y).loss,
               on_step=plant and (lambda step, model, x: plant(step, model)),
               before_update=lambda step, model: grads.append(
                   {n: p.grad.detach().clone() for n, p in model.named_parameters()}))
    return grads


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """A healthy bf16 GPT-2 (sdpa attention, dropout on), step 1 saved."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "gpt2_bf16_labels"
    grads = train(path, gpt2(), steps=2, dtype=torch.bfloat16, bundle_steps=(1,))
    return path, grads


def _overflow(step, model):
    # Queries and keys x1000 in block 1 from this step on: each stays far
    # below 65504, their dot products (16 terms) do not, in float16.
    if step == OVERFLOW_STEP:
        with torch.no_grad():
            model.transformer.h[1].attn.c_attn.weight[:, :64].mul_(1000.0)


@pytest.fixture(scope="module")
def overflow_run(tmp_path_factory):
    """fp16 GPT-2 with eager attention: the attention logits of block 1
    overflow at OVERFLOW_STEP (the GradScaler skips it; a bundle is saved)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "gpt2_fp16_attention_overflow"
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    train(path, eager_gpt2(), steps=OVERFLOW_STEP + 1, dtype=torch.float16, scaler=scaler,
          plant=_overflow)
    return path


def test_labels_model_replays_with_one_backward_start_from_its_loss(bf16_run):
    path, trained = bf16_run
    result = replay(path, step=1, model=gpt2, precisions="fp64,bf16", local=False)
    assert result.reproduced is True and result.backward_start is BackwardStart.SAVED
    # The loss is found in the ModelOutput and is the training's, exactly.
    assert result.loss["bf16"] == result.loss["recorded"]
    assert result.loss["fp64"] == pytest.approx(result.loss["recorded"], rel=1e-3)

    from amp_postmortem.reading.bundle import find_bundle, load_bundle
    bundle = load_bundle(find_bundle(path, 1, None))
    session = ReplaySession(bundle, gpt2())
    run = session.run(RunConfig("bf16", policy=resolve_policy("recorded", bundle, "bf16")), capture=False)
    # Every gradient as training made it (not 2x: the logits are not a second start).
    assert set(run.param_grads) == set(trained[1])
    for name, g in trained[1].items():
        assert torch.equal(run.param_grads[name], g.double()), name


def test_run_saves_the_model_config_and_the_auto_class_rebuilds_the_model(bf16_run):
    path, _ = bf16_run
    config = json.loads((path / "manifest.json").read_text())["model_config"]
    assert (config["model_type"], config["n_layer"], config["n_embd"], config["_attn_implementation"]) == \
        ("gpt2", 2, 32, "sdpa")
    by_auto = replay(path, step=1, model="transformers:AutoModelForCausalLM", precisions="fp64,bf16",
                     local=False)
    by_class = replay(path, step=1, model="recorded", precisions="fp64,bf16", local=False)  # the recorded class
    direct = replay(path, step=1, model=gpt2, precisions="fp64,bf16", local=False)
    assert by_auto.reproduced is by_class.reproduced is True
    assert by_auto.loss == by_class.loss == direct.loss


def test_attention_logit_overflow_names_the_attention_block(overflow_run):
    manifest = json.loads((overflow_run / "manifest.json").read_text())
    assert manifest["model_config"]["_attn_implementation"] == "eager"
    result = replay(overflow_run, step=OVERFLOW_STEP, model="transformers:AutoModelForCausalLM",
                    precisions="fp64,fp16")
    assert result.reproduced is True
    assert result.culprit["name"] == "transformer.h.1.attn" and result.culprit["phase"] == "forward"
    attn = next(m for m in result.modules if m["name"] == "transformer.h.1.attn" and m["phase"] == "forward")
    assert attn["status"]["fp16"] == "broken" and attn["broken_inside"]["fp16"] is None
    # Every module, attention blocks included, was replayed alone.
    assert not [m["name"] for m in result.modules if m["status"]["fp16"] == "n/a"]
    # The logits' NaN gradient is no start: the loss (gradient = the loss scale) is.
    assert result.backward_start is BackwardStart.SAVED
    assert result.loss["fp16"] != result.loss["fp16"] and result.loss["fp64"] == pytest.approx(4.18, abs=0.01)


def test_auto_class_without_a_saved_config_is_a_one_line_error(bf16_run, tmp_path):
    import shutil
    from amp_postmortem.errors import ModelSpecError
    path, _ = bf16_run
    alone = tmp_path / "bundle"
    shutil.copytree(path / "bundles" / "step=1" / "rank=0", alone)  # away from its run directory
    with pytest.raises(ModelSpecError, match="is built from a config, and the run saved none"):
        replay(alone, model="transformers:AutoModelForCausalLM", precisions="fp64", local=False)
