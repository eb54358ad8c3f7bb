"""What the Keras recorder (TensorFlow and JAX backends) and the Flax
recorder cost a training step, against plain training measured in the same
run (issue 39).

One small model written as users write it, in each framework: an MLP of
four layers (256 -> 256 -> 256 -> 256 -> 10, ReLU), batch 64, float16
compute with a dynamic loss scale, Adam at 1e-3, integer labels,
cross-entropy on float32 logits:

- `keras_tf` / `keras_jax`: `keras.Sequential` under the `mixed_float16`
  policy (the last Dense's softmax in float32, as Keras' mixed-precision
  guide writes it), `compile(LossScaleOptimizer(Adam), "sparse_categorical_crossentropy")`
  (the default `jit_compile`), trained by `model.fit` with the recorder in
  `callbacks=`; the backend is chosen at import by `KERAS_BACKEND`, so each
  backend runs in its own child process;
- `flax`: an `nnx.Module` of `nnx.Linear(dtype=float16)` layers, an
  `nnx.Optimizer` over `optax.adam`, a jmp-style dynamic loss scale
  (scale the loss, unscale the gradients, skip the update and halve the
  scale on a non-finite gradient, double it after 2,000 clean steps; jmp's
  `DynamicLossScale` rule written out, as `tests/test_flax_recorder.py`
  does: jmp is not a dependency); plain is `nnx.jit(train_step)`, recorded
  is `FlaxRecorder.wrap(train_step)`.

Variants: `plain`; `default` (the recorder as shipped: the cheap tier's
rows every step, the full tier every 100th step and in a burst of 20 after
the first event of each kind); `full` (`full_every=1`: the full tier every
step, the upper bound); on `keras_tf` also `no_probe`: the default without
the measured-factor probe (`keras_loss_scaling.grad_loss_ratio`, a
`tf.gradients` of the loss to the last variable that `KerasRecorder._ratio`
adds into the compiled step). The recorder has no option for it: this
benchmark alone subclasses `KerasRecorder` with a `_ratio` that returns NaN
(what the probe gives where it cannot measure), so `default - no_probe` is
the probe's cost.

Each variant is its own model with the template's initial weights and its
own optimizer. Every round steps every variant once on the same batch, in
a shuffled order, so that drifts of a shared machine hit all alike. Keras:
each variant's `fit` runs in its own thread, held in lockstep by a
callback (the last in `callbacks=`, after the recorder): a step is timed
from its `on_train_batch_begin` to its `on_train_batch_end` after the
recorder's own (the host side of the recording included), the loss read
to the host there (a plain step is otherwise asynchronous on JAX); only
one variant runs at a time. Flax: a step is timed from the call until its
outputs are ready (`jax.block_until_ready`). Warm-up rounds (the first
steps trace and compile every tier) are left out. Figures: median ms a
step, `ratio` (median over plain's median), `paired` (median of per-round
ratios to plain's step of the same round), `whole_run` (sum of a variant's
step times over plain's: the default's full-tier steps, one in 100,
counted), `added_ms` (median minus plain's median), `same_bits` (the
losses reported at each step, Keras' running mean of the epoch, equal
plain's bit for bit), `first_diff_step` and `max_rel_diff` (where they
part, and by how much). No target is asserted.

    python benchmarks/xp_recorder_cost.py --json /tmp/xp.json      # ~3-4 min on 2 cores
    python benchmarks/xp_recorder_cost.py --frameworks keras_jax,flax --rounds 5000
    python benchmarks/xp_recorder_cost.py --smoke                  # seconds a framework; CI keeps it working
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import REPO, machine_info, median, print_table, summarize, write_json  # noqa: E402

FRAMEWORKS = ("keras_tf", "keras_jax", "flax")
VARIANTS = {"keras_tf": ("plain", "default", "no_probe", "full"),
            "keras_jax": ("plain", "default", "full"),
            "flax": ("plain", "default", "full")}
BATCH, WIDTH, CLASSES, LAYERS = 64, 256, 10, 4
SMOKE = dict(batch=8, width=32)
# The batches cycled through (shuffle off: every variant sees the same batch at each step).
DATA_BATCHES = 16


def _data(batch: int, width: int):
    import numpy as np
    rng = np.random.default_rng(0)
    x = rng.standard_normal((DATA_BATCHES * batch, width)).astype("float32")
    y = rng.integers(0, CLASSES, DATA_BATCHES * batch).astype("int32")
    return x, y


# ------------------------------------------------------------------ Keras
def _keras_child(backend: str, *, rounds: int, warmup: int, smoke: bool, seed: int) -> dict:
    import keras
    from keras import ops

    from recorders.keras_recorder import KerasRecorder

    class NoProbeRecorder(KerasRecorder):
        """The default recorder without the measured-factor probe: only to
        measure what the probe costs (the recorder has no option for it)."""

        @staticmethod
        def _ratio(trace, grads, variables):
            return ops.convert_to_tensor(math.nan, "float32")

    batch, width = (SMOKE["batch"], SMOKE["width"]) if smoke else (BATCH, WIDTH)
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(seed)

    def build():
        return keras.Sequential(
            [keras.Input((width,))]
            + [keras.layers.Dense(width, activation="relu") for _ in range(LAYERS - 1)]
            + [keras.layers.Dense(CLASSES), keras.layers.Activation("softmax", dtype="float32")])

    template = build()
    x, y = _data(batch, width)
    variants = VARIANTS["keras_tf" if backend == "tensorflow" else "keras_jax"]
    total = warmup + rounds

    class Lockstep(keras.callbacks.Callback):
        """Holds its fit until the coordinator lets one step run; times it."""

        def __init__(self):
            super().__init__()
            self.go, self.done = threading.Semaphore(0), threading.Semaphore(0)
            self.times, self.losses, self.steps, self.t0 = [], [], 0, 0.0

        def on_train_batch_begin(self, batch, logs=None):
            self.go.acquire()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            loss = float(ops.convert_to_numpy(logs["loss"]))  # the step done, on the host
            self.times.append(time.perf_counter() - self.t0)
            self.losses.append(loss)
            self.steps += 1
            if self.steps >= total:
                self.model.stop_training = True
            self.done.release()

    tmp = tempfile.TemporaryDirectory()
    runners = {}
    for v in variants:
        model = build()
        model.set_weights(template.get_weights())
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
                      loss="sparse_categorical_crossentropy")
        rec = None
        if v == "default":
            rec = KerasRecorder(Path(tmp.name) / v, model)
        elif v == "no_probe":
            rec = NoProbeRecorder(Path(tmp.name) / v, model)
        elif v == "full":
            rec = KerasRecorder(Path(tmp.name) / v, model, full_every=1)
        lock = Lockstep()
        errors = []

        def fit(model=model, rec=rec, lock=lock, errors=errors):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model.fit(x, y, batch_size=batch, epochs=math.ceil(total / DATA_BATCHES), shuffle=False,
                              verbose=0, callbacks=[c for c in (rec, lock) if c is not None])
            except BaseException as e:  # noqa: BLE001 - reported by the coordinator
                errors.append(e)
                lock.done.release()

        runners[v] = {"model": model, "rec": rec, "lock": lock, "errors": errors,
                      "thread": threading.Thread(target=fit, name=f"fit-{v}", daemon=True)}
    for r in runners.values():
        r["thread"].start()
    rng = random.Random(seed)
    order = list(variants)
    t_start = time.perf_counter()
    for _ in range(total):
        rng.shuffle(order)
        for v in order:
            r = runners[v]
            r["lock"].go.release()
            r["lock"].done.acquire()
            if r["errors"]:
                raise RuntimeError(f"{backend} {v}: fit failed") from r["errors"][0]
    for r in runners.values():
        r["thread"].join()
        if r["errors"]:
            raise RuntimeError(f"{backend} fit failed") from r["errors"][0]
        if r["rec"] is not None:
            r["rec"].close()
    wall = time.perf_counter() - t_start
    tiers = {}
    for v in variants:
        if runners[v]["rec"] is not None:
            tiers[v] = _tiers(Path(tmp.name) / v)
    tmp.cleanup()
    times = {v: runners[v]["lock"].times[warmup:total] for v in variants}
    losses = {v: runners[v]["lock"].losses[:total] for v in variants}
    out = _figures(times, losses, variants)
    out.update(framework="keras_tf" if backend == "tensorflow" else "keras_jax", backend=backend,
               keras=keras.__version__, rounds=rounds, warmup=warmup, wall_s=wall, tiers=tiers)
    if backend == "tensorflow":
        import tensorflow as tf
        out["tensorflow"] = tf.__version__
        out["probe"] = _probe(times)
    else:
        import jax
        out["jax"] = jax.__version__
    return out


def _probe(times: dict) -> dict:
    """What the measured-factor probe costs: default against no_probe."""
    d, n, p = times["default"], times["no_probe"], times["plain"]
    return {"ms_per_step": (median(d) - median(n)) * 1e3,
            "paired_default_over_no_probe": median([a / b for a, b in zip(d, n)]),
            "share_of_plain_step": (median(d) - median(n)) / median(p)}


def _tiers(run_dir: Path) -> dict:
    """How many steps each tier had (the steps table)."""
    try:
        import pyarrow.dataset as ds
        table = ds.dataset(str(run_dir / "rank=0" / "steps"), format="parquet").to_table(columns=["tier"])
        counts: dict = {}
        for t in table.column("tier").to_pylist():
            counts[str(t)] = counts.get(str(t), 0) + 1
        return counts
    except Exception as e:  # noqa: BLE001 - a fact we could not read
        return {"error": type(e).__name__}


# ------------------------------------------------------------------- Flax
def _flax_child(*, rounds: int, warmup: int, smoke: bool, seed: int) -> dict:
    from dataclasses import dataclass

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from recorders.flax_recorder import FlaxRecorder

    batch, width = (SMOKE["batch"], SMOKE["width"]) if smoke else (BATCH, WIDTH)

    @dataclass
    class DynamicScale:
        """What the manifest reads of jmp's DynamicLossScale."""
        loss_scale: float
        period: int = 2000
        factor: int = 2

    class MLP(nnx.Module):
        def __init__(self, rngs):
            # Named attributes: an `nnx.List` of layers fails under `FlaxRecorder.wrap` with
            # flax 0.12 (TypeError sorting the gradient state's int and str keys).
            self.fc1 = nnx.Linear(width, width, dtype=jnp.float16, rngs=rngs)
            self.fc2 = nnx.Linear(width, width, dtype=jnp.float16, rngs=rngs)
            self.fc3 = nnx.Linear(width, width, dtype=jnp.float16, rngs=rngs)
            self.head = nnx.Linear(width, CLASSES, dtype=jnp.float16, rngs=rngs)

        def __call__(self, x):
            h = x.astype(jnp.float16)
            for layer in (self.fc1, self.fc2, self.fc3):
                h = jax.nn.relu(layer(h))
            return self.head(h)

    def train_step(model, optimizer, scale, good, x, y):
        def loss_fn(model):
            logits = model(x).astype(jnp.float32)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return loss * scale, loss
        (_, loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
        finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        safe = jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads)
        before = nnx.state(model, nnx.Param)
        optimizer.update(model, safe)
        nnx.update(model, jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                       nnx.state(model, nnx.Param), before))
        # jmp's DynamicLossScale.adjust: halve on a non-finite gradient, double after `period` clean steps.
        grown = good + 1 >= 2000
        new_scale = jnp.where(finite, jnp.where(grown, scale * 2, scale), jnp.maximum(scale / 2, 1.0))
        new_good = jnp.where(finite & ~grown, good + 1, 0)
        return {"loss": loss, "grads": grads, "loss_scale_before": scale, "loss_scale": new_scale,
                "skipped": jnp.logical_not(finite), "good": new_good}

    def plain_step(model, optimizer, scale, good, x, y):
        out = train_step(model, optimizer, scale, good, x, y)
        out.pop("grads")  # what a plain step returns: no gradients leave it
        return out

    xs, ys = _data(batch, width)
    xs = [jnp.asarray(xs[i * batch:(i + 1) * batch]) for i in range(DATA_BATCHES)]
    ys = [jnp.asarray(ys[i * batch:(i + 1) * batch]) for i in range(DATA_BATCHES)]
    variants = VARIANTS["flax"]
    tmp = tempfile.TemporaryDirectory()
    runners = {}
    for v in variants:
        model = MLP(nnx.Rngs(seed))  # the same seed: the same initial weights
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        rec = None
        if v == "plain":
            step = nnx.jit(plain_step)
        else:
            rec = FlaxRecorder(Path(tmp.name) / v, model, optimizer=optimizer, loss_scale=DynamicScale(2.0 ** 15),
                               **({"full_every": 1} if v == "full" else {}))
            step = rec.wrap(train_step)
        runners[v] = {"model": model, "opt": optimizer, "rec": rec, "step": step,
                      "scale": jnp.float32(2.0 ** 15), "good": jnp.int32(0), "times": [], "losses": []}
    rng = random.Random(seed)
    order = list(variants)
    total = warmup + rounds
    t_start = time.perf_counter()
    for i in range(total):
        rng.shuffle(order)
        x, y = xs[i % DATA_BATCHES], ys[i % DATA_BATCHES]
        for v in order:
            r = runners[v]
            t0 = time.perf_counter()
            out = jax.block_until_ready(r["step"](r["model"], r["opt"], r["scale"], r["good"], x, y))
            r["times"].append(time.perf_counter() - t0)
            r["scale"], r["good"] = out["loss_scale"], out["good"]
            r["losses"].append(float(out["loss"]))
    wall = time.perf_counter() - t_start
    tiers = {}
    for v in variants:
        if runners[v]["rec"] is not None:
            runners[v]["rec"].close()
            tiers[v] = _tiers(Path(tmp.name) / v)
    tmp.cleanup()
    import flax
    out = _figures({v: runners[v]["times"][warmup:] for v in variants},
                   {v: runners[v]["losses"] for v in variants}, variants)
    out.update(framework="flax", backend=jax.default_backend(), jax=jax.__version__, flax=flax.__version__,
               rounds=rounds, warmup=warmup, wall_s=wall, tiers=tiers)
    return out


# ---------------------------------------------------------------- figures
def _figures(times: dict, losses: dict, variants) -> dict:
    import struct
    plain = times["plain"]
    bits = {v: [struct.pack("<f", x) for x in losses[v]] for v in variants}
    out = {"variants": {}}
    for v in variants:
        ts = times[v]
        s = summarize(ts)
        out["variants"][v] = {
            "steps": len(ts),
            "median_ms": s["median"] * 1e3, "p10_ms": s["p10"] * 1e3, "p90_ms": s["p90"] * 1e3,
            "ratio": median(ts) / median(plain),
            "paired": median([a / b for a, b in zip(ts, plain)]),
            "whole_run": sum(ts) / sum(plain),
            "added_ms": (median(ts) - median(plain)) * 1e3,
            "same_bits": bits[v] == bits["plain"],
            # Where the losses part from plain's (None: nowhere), and by how much at most (relative).
            "first_diff_step": next((i for i, (a, b) in enumerate(zip(bits[v], bits["plain"])) if a != b), None),
            "max_rel_diff": max((abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses[v], losses["plain"])),
                                default=0.0),
        }
    return out


# ------------------------------------------------------------------- main
def _child_main(args) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if args.child == "flax":
        res = _flax_child(rounds=args.rounds, warmup=args.warmup, smoke=args.smoke, seed=args.seed)
    else:
        res = _keras_child("tensorflow" if args.child == "keras_tf" else "jax", rounds=args.rounds,
                           warmup=args.warmup, smoke=args.smoke, seed=args.seed)
    print(json.dumps(res))
    return 0


def run_framework(fw: str, *, rounds: int, warmup: int, smoke: bool, seed: int, timeout: float | None = None) -> dict:
    """One framework in its own process (Keras' backend is fixed at import)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if fw.startswith("keras_"):
        env["KERAS_BACKEND"] = "tensorflow" if fw == "keras_tf" else "jax"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", fw, "--rounds", str(rounds),
           "--warmup", str(warmup), "--seed", str(seed)] + (["--smoke"] if smoke else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{fw} child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds (default: 120 keras_tf, "
                    "1500 keras_jax, 2000 flax; smoke 3)")
    ap.add_argument("--warmup", type=int, default=None, help="rounds left out (default 10; smoke 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.rounds = args.rounds if args.rounds is not None else 3
        args.warmup = args.warmup if args.warmup is not None else 2
        return _child_main(args)
    fws = [f for f in args.frameworks.split(",") if f]
    unknown = [f for f in fws if f not in FRAMEWORKS]
    if unknown:
        print(f"error: unknown framework(s) {unknown}; choose among {', '.join(FRAMEWORKS)}", file=sys.stderr)
        return 2
    # ~2 min, ~20 s and ~30 s on 2 cores: TensorFlow's float16 matmuls on a CPU (no XLA under
    # mixed_float16's "auto") take ~200 ms a step here, XLA's (JAX) ~2 ms.
    default_rounds = {"keras_tf": 120, "keras_jax": 1500, "flax": 2000}
    results = {"machine": machine_info(), "model": {"layers": LAYERS, "width": SMOKE["width"] if args.smoke else WIDTH,
                                                    "batch": SMOKE["batch"] if args.smoke else BATCH,
                                                    "classes": CLASSES, "smoke": args.smoke},
               "frameworks": {}}
    rows = []
    for fw in fws:
        rounds = args.rounds if args.rounds is not None else (3 if args.smoke else default_rounds[fw])
        warmup = args.warmup if args.warmup is not None else (2 if args.smoke else 10)
        res = run_framework(fw, rounds=rounds, warmup=warmup, smoke=args.smoke, seed=args.seed)
        results["frameworks"][fw] = res
        for v, f in res["variants"].items():
            rows.append({"framework": fw, "variant": v,
                         **{k: f[k] for k in ("median_ms", "p10_ms", "p90_ms", "added_ms", "ratio", "paired",
                                              "whole_run", "same_bits", "first_diff_step")}})
    m = results["machine"]
    print(f"machine: {m['cpu_model']}, {m['cpu_count']} cores, load {m['loadavg_1m']}", file=sys.stderr)
    print_table(rows, ["framework", "variant", "median_ms", "p10_ms", "p90_ms", "added_ms", "ratio", "paired",
                       "whole_run", "same_bits", "first_diff_step"])
    if "keras_tf" in results["frameworks"]:
        p = results["frameworks"]["keras_tf"]["probe"]
        print(f"keras_tf measured-factor probe: {p['ms_per_step']:.3f} ms a step "
              f"(default / no_probe paired {p['paired_default_over_no_probe']:.3f}; "
              f"{100 * p['share_of_plain_step']:.1f}% of a plain step)", file=sys.stderr)
    write_json(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
