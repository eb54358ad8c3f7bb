"""Float16 reductions read from a JAX step's program
(recorders/jax_program.py, the manifest's `jax_reductions`, and
`summary`'s `fp16_reduction_risk`): a Flax nnx transformer block written
as users write it, in explicit float16 (`dtype=jnp.float16`), whose
attention weights are a `jax.nn.softmax` computed by hand inside the
module's `__call__` (no module output, no row), recorded with
`FlaxRecorder.wrap`. The same block with the softmax cast up to float32
and back is quiet about it; a run recorded before the entry existed reads
as "not traced" (undetermined), never as "none". The story is pinned (the
site, its line, its remedy), not CPU float16 values."""
from __future__ import annotations

import inspect
import json
import shutil

# Imported outright: CI installs the jax extra, and a missing one must fail, not skip.
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from click.testing import CliRunner
from flax import nnx

from amp_postmortem.analyses.fp16_reductions import Program, find_fp16_reductions
from amp_postmortem.cli import main
from amp_postmortem.reading.loader import load_run
from recorders.format import schema
from recorders.flax_recorder import FlaxRecorder
from recorders.jax_program import reduction_sites

BATCH, SEQ, WIDTH = 4, 16, 8
CALLS = {"train_step": 0}


class SelfAttention(nnx.Module):
    def __init__(self, width, float32_softmax, rngs):
        self.qkv = nnx.Linear(width, 3 * width, dtype=jnp.float16, rngs=rngs)
        self.out = nnx.Linear(width, width, dtype=jnp.float16, rngs=rngs)
        self.float32_softmax = float32_softmax

    def __call__(self, x):
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        scores = q @ k.swapaxes(-1, -2) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        if self.float32_softmax:
            weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(scores.dtype)
        else:
            weights = jax.nn.softmax(scores, axis=-1)
        return self.out(weights @ v)


class Classifier(nnx.Module):
    def __init__(self, float32_softmax, rngs):
        self.embed = nnx.Linear(2, WIDTH, dtype=jnp.float16, rngs=rngs)
        self.attention = SelfAttention(WIDTH, float32_softmax, rngs)
        self.head = nnx.Linear(WIDTH, 1, dtype=jnp.float32, rngs=rngs)

    def __call__(self, tokens):
        h = self.attention(self.embed(tokens.astype(jnp.float16)))
        return self.head(h.mean(axis=1).astype(jnp.float32))


def train_step(model, optimizer, tokens, labels):
    CALLS["train_step"] += 1  # runs while jax traces the step, never when it runs
    def loss_fn(model):
        return optax.sigmoid_binary_cross_entropy(model(tokens), labels).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return {"loss": loss, "grads": grads}


def record(run_dir, float32_softmax):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.normal(size=(BATCH, SEQ, 2)), jnp.float32)
    labels = jnp.asarray(rng.uniform(size=(BATCH, 1)) > 0.5, jnp.float32)
    model = Classifier(float32_softmax, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
    CALLS["train_step"] = 0
    with FlaxRecorder(run_dir, model, optimizer=optimizer, full_every=0) as rec:
        step = rec.wrap(train_step)
        for _ in range(3):
            step(model, optimizer, tokens, labels)
    return run_dir, CALLS["train_step"]


def softmax_line() -> int:
    lines, start = inspect.getsourcelines(SelfAttention.__call__)
    return start + next(i for i, text in enumerate(lines) if "jax.nn.softmax(scores, axis=-1)" in text)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("jax_program")
    float16, traces = record(out / "float16_softmax", False)
    float32, _ = record(out / "float32_softmax", True)
    old = out / "before_jax_reductions"
    shutil.copytree(float16, old)
    for manifest in [*old.glob("manifest.json"), *old.glob("rank=*/manifest.json")]:
        data = json.loads(manifest.read_text())
        data.pop(schema.JAX_REDUCTIONS_KEY, None)
        manifest.write_text(json.dumps(data))
    return {"float16": float16, "float32": float32, "old": old, "traces": traces}


def summary_json(run_dir) -> dict:
    result = CliRunner().invoke(main, ["summary", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_the_program_is_traced_once_without_running_the_step_again(runs):
    # One tier (full_every=0): jax traced the step once; reading its
    # program took jax's cached trace, not a second run of the step's Python.
    assert runs["traces"] == 1
    manifest = json.loads(next(runs["float16"].glob("rank=*/manifest.json")).read_text())
    entry = manifest[schema.JAX_REDUCTIONS_KEY]
    assert entry["traced"] is True and entry["step"] == 0


def test_a_float16_softmax_inside_a_module_is_named_with_its_line_and_remedy(runs):
    doc = summary_json(runs["float16"])
    assert doc["run"]["jax_reductions"] == "traced"
    risk = next(f for f in doc["findings"] if f["kind"] == "fp16_reduction_risk")
    assert risk["severity"] == "warning"
    site = next(s for s in risk["evidence"]["sites"] if s["pattern"] == "softmax" and s["phase"] == "forward")
    assert site["file"] == "tests/test_jax_program.py" and site["line"] == softmax_line()
    assert site["function"] == "SelfAttention.__call__"
    assert site["dtype"] == "float16" and site["values_per_output"] == SEQ and site["shifted"] is True
    assert site["overflowed_at"] == []
    where = f"tests/test_jax_program.py:{softmax_line()}"
    assert f"softmax in float16 at {where} (SelfAttention.__call__)" in risk["message"]
    assert "jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)" in risk["message"]
    assert "not observed to overflow" in risk["message"]
    assert risk["next_command"].startswith("compute it in float32 and cast back: jax.nn.softmax(")
    text = CliRunner().invoke(main, ["summary", str(runs["float16"])]).output
    assert "fp16_reduction_risk" in text and where in text


def test_the_softmax_cast_up_to_float32_and_back_is_quiet(runs):
    found = find_fp16_reductions(load_run(runs["float32"]))
    assert found.program is Program.TRACED
    assert not [s for s in found.sites if s.pattern == "softmax"]
    doc = summary_json(runs["float32"])
    assert doc["run"]["jax_reductions"] == "traced"
    assert "fp16_reduction_risk" not in {f["kind"] for f in doc["findings"]}


def test_a_run_recorded_before_the_entry_reads_as_not_traced(runs):
    found = find_fp16_reductions(load_run(runs["old"]))
    assert found.program is Program.NOT_TRACED and found.sites == []
    assert found.to_dict()["program"] == "not_traced"
    doc = summary_json(runs["old"])
    assert doc["run"]["jax_reductions"] == "not_traced"
    assert "fp16_reduction_risk" not in {f["kind"] for f in doc["findings"]}
    text = CliRunner().invoke(main, ["summary", str(runs["old"])]).output
    assert "float16 reductions in the step's program: undetermined (not traced" in text


def _sites(fn, *args):
    return reduction_sites(jax.jit(fn).trace(*args).jaxpr)


def test_patterns_in_sub_jaxprs_and_dtypes():
    x = jnp.ones((3, 7), jnp.float16)
    forward = lambda fn: {(s["pattern"], s["dtype"]) for s in _sites(fn, x) if s["phase"] == "forward"}
    assert forward(lambda x: jax.nn.log_softmax(x)) == {("log_softmax", "float16")}
    assert ("logsumexp", "float16") in forward(lambda x: jax.nn.logsumexp(x, axis=-1))
    # Inside a remat of a jitted helper, written without the max: its exp overflows float16.
    unshifted = _sites(lambda x: jax.checkpoint(jax.jit(lambda z: jnp.exp(z) / jnp.exp(z).sum(-1, keepdims=True)))(x), x)
    assert [(s["pattern"], s["shifted"]) for s in unshifted] == [("softmax", False)]
    assert forward(lambda x: jnp.cumsum(x, axis=-1)) == {("cumsum", "float16")}
    # A sum held in float16 (jnp sums in float32, then casts back) is one; a mean is not.
    assert forward(lambda x: x.sum(-1)) == {("sum", "float16")}
    assert forward(lambda x: x.mean(-1)) == set()
    assert forward(lambda x: jax.nn.softmax(x.astype(jnp.bfloat16))) == {("softmax", "bfloat16")}
    assert forward(lambda x: jax.nn.softmax(x.astype(jnp.float32)).astype(x.dtype)) == set()
    assert forward(lambda x: jax.lax.cond(x[0, 0] > 0, jax.nn.softmax, lambda y: y, x)) == {("softmax", "float16")}
