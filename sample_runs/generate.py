"""Rebuild the sample runs: tiny real training jobs recorded with the real recorder.

    python sample_runs/generate.py [--out sample_runs] [--only NAME ...] [--short]

Every run trains on the CPU with one thread and fixed seeds, so a rebuild on
any machine gives the same numbers. Float16 autocast with
`torch.amp.GradScaler("cpu")` unless the scenario says otherwise; each run's
README.md says what happened in it and what the analyzer should say.
`--short` trains on a shortened schedule (for the tests): the same faults,
made to appear earlier.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import models  # noqa: E402
from recorders import AmpRecorder  # noqa: E402

# Files of a run the generator owns; anything else in a run folder (its
# README.md) is left alone on a rebuild.
RUN_OUTPUTS = ("manifest.json", "rank=0", "bundles")


@dataclass
class Job:
    """One recorded training job."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batches: object            # iterator of (inputs, targets)
    steps: int
    loss_fn: object
    amp: bool = True
    scaler: torch.amp.GradScaler | None = None
    recorder_options: dict = field(default_factory=dict)
    needs_inputs: bool = False  # loss_fn reads the batch's inputs (loss_fn.inputs)
    watch_norm: bool = False    # ask for a bundle where model.norm's variance first overflows
    # End the job this many steps after its first non-finite loss (None: run
    # every step). The step of a trajectory-born NaN moves with the CPU's
    # float16 kernels (79 on one machine, 99 on another), so a short schedule
    # runs until the fault appears instead of for a fixed count.
    stop_after_nonfinite: int | None = None


# ----------------------------------------------------------------- data
def copy_task(seed: int, batch: int = 16):
    """Token sequences whose second half repeats the first: the next token is
    unpredictable in the first half and copyable (by attention) in the
    second, so a model that learns reaches a loss near ln(VOCAB)/2."""
    g = torch.Generator().manual_seed(seed)
    half = models.BLOCK // 2
    while True:
        first = torch.randint(0, models.VOCAB, (batch, half + 1), generator=g)
        seq = torch.cat([first, first], dim=1)[:, : models.BLOCK + 1]
        yield seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_optimizer(model, lr: float, qk_lr: float | None = None):
    """Adam; the attention's query/key projections in their own group."""
    qk = [p for n, p in model.named_parameters() if ".q_proj." in n or ".k_proj." in n]
    rest = [p for n, p in model.named_parameters() if not (".q_proj." in n or ".k_proj." in n)]
    return torch.optim.Adam([{"params": rest, "lr": lr}, {"params": qk, "lr": qk_lr or lr}])


# ------------------------------------------------------------ scenarios
def healthy(short: bool) -> Job:
    torch.manual_seed(0)
    model = models.tiny_gpt()
    return Job(model, gpt_optimizer(model, 1e-2), copy_task(0), 40 if short else 200, lm_loss,
               scaler=torch.amp.GradScaler("cpu", growth_interval=20),
               recorder_options={"full_every": 20})


def attention_overflow(short: bool) -> Job:
    torch.manual_seed(0)
    model = models.attention_overflow_gpt()
    return Job(model, gpt_optimizer(model, 1e-2, qk_lr=0.5), copy_task(0), 130, lm_loss,
               scaler=torch.amp.GradScaler("cpu", growth_interval=20),
               recorder_options={"full_every": 10}, stop_after_nonfinite=2 if short else None)


def fp32_baseline(short: bool) -> Job:
    torch.manual_seed(0)
    model = models.attention_overflow_gpt()
    return Job(model, gpt_optimizer(model, 1e-2, qk_lr=0.5), copy_task(0), 85 if short else 130, lm_loss,
               amp=False, recorder_options={"full_every": 10})


def feature_task(seed: int, batch: int = 64, units: float = 1.0, nan_at: int | None = None):
    """Float feature vectors around one random centre per class, with noise
    that makes the classes overlap; `units` scales them (raw sensor units).
    With `nan_at`, the batch of that step has missing readings encoded as
    NaN in feature 5 of its first 3 rows, as an un-imputed CSV gives."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(models.CLASSES, models.FEATURES, generator=g)
    step = 0
    while True:
        y = torch.randint(0, models.CLASSES, (batch,), generator=g)
        x = (centres[y] + 2.0 * torch.randn(batch, models.FEATURES, generator=g)) * units
        if step == nan_at:
            x[:3, 5] = float("nan")
        step += 1
        yield x, y


def bad_batch(short: bool) -> Job:
    torch.manual_seed(0)
    model = models.feature_mlp()
    return Job(model, torch.optim.Adam(model.parameters(), lr=1e-2),
               feature_task(0, nan_at=BAD_BATCH_STEP[short]), 40 if short else 150, F.cross_entropy,
               scaler=torch.amp.GradScaler("cpu", growth_interval=20),
               recorder_options={"full_every": 10})


def scale_collapse(short: bool) -> Job:
    torch.manual_seed(0)
    model = models.multitask_mlp()
    growth = 1.25 if short else 1.08

    def loss_fn(out, y, _state={"step": 0}):
        # The auxiliary weight follows a per-epoch ramp (x1.08 an epoch)
        # that the loop steps once per batch: it grows without bound.
        weight = 0.1 * growth ** _state["step"]
        _state["step"] += 1
        x = loss_fn.inputs
        return F.cross_entropy(out["logits"], y) + weight * F.mse_loss(out["reconstruction"], x)

    job = Job(model, torch.optim.Adam(model.parameters(), lr=1e-2), feature_task(0),
              40 if short else 200, loss_fn,
              scaler=torch.amp.GradScaler("cpu", growth_interval=20),
              recorder_options={"full_every": 10})
    job.needs_inputs = True
    return job


def fp16_layernorm(short: bool) -> Job:
    torch.manual_seed(0)
    model = models.fp16_layernorm_model()
    return Job(model, torch.optim.Adam(model.parameters(), lr=3e-2), feature_task(0, units=25.0),
               60 if short else 200, F.cross_entropy,
               scaler=torch.amp.GradScaler("cpu", growth_interval=20),
               recorder_options={"full_every": 10}, watch_norm=True)


def grad_underflow(short: bool) -> Job:
    torch.manual_seed(0)
    model = models.tiny_gpt()
    # A loss scale of 2**-14 that never grows: the scaled gradients that
    # travel in float16 fall below its subnormal limit (5.96e-8).
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** -14, growth_interval=10 ** 9)
    return Job(model, gpt_optimizer(model, 1e-2), copy_task(0), 20 if short else 60, lm_loss,
               scaler=scaler, recorder_options={"full_every": 1})


BAD_BATCH_STEP = {False: 60, True: 20}

SCENARIOS = {
    "healthy": healthy,
    "attention_overflow": attention_overflow,
    "fp32_baseline": fp32_baseline,
    "grad_underflow": grad_underflow,
    "scale_collapse": scale_collapse,
    "fp16_layernorm": fp16_layernorm,
    "bad_batch": bad_batch,
}


# ------------------------------------------------------------- training
def record(run_dir: Path, job: Job, run_id: str) -> dict:
    """Train `job` under the recorder; return a few facts for the log."""
    model, opt, scaler = job.model, job.optimizer, job.scaler
    losses, scales, overflow_steps = [], [], []
    norm_overflowed = []
    if job.watch_norm:
        def watch(module, args, output):
            x = args[0].detach()
            centred = x - x.mean(-1, keepdim=True)
            norm_overflowed.append(bool(torch.isinf(centred * centred).any()))
        hook = model.norm.register_forward_hook(watch)
    with AmpRecorder(run_dir, model, optimizer=opt, scaler=scaler, run_id=run_id,
                     **job.recorder_options) as rec:
        for step in range(job.steps):
            x, y = next(job.batches)
            if job.needs_inputs:
                job.loss_fn.inputs = x
            with torch.autocast("cpu", dtype=torch.float16, enabled=job.amp):
                loss = job.loss_fn(model(x), y)
            if norm_overflowed and norm_overflowed.pop():
                if not overflow_steps:
                    rec.save_bundle()
                overflow_steps.append(step)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            else:
                loss.backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
            rec.step(loss)
            losses.append(loss.item())
            first_bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
            if job.stop_after_nonfinite is not None and first_bad is not None \
                    and step >= first_bad + job.stop_after_nonfinite:
                break
    if job.watch_norm:
        hook.remove()
    first_nan = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    return {"steps": len(losses), "first_nonfinite_loss": first_nan,
            "first_norm_overflow": overflow_steps[0] if overflow_steps else None,
            "norm_overflow_steps": len(overflow_steps),
            "final_loss": losses[-1], "final_scale": scales[-1] if scales else None}


def generate(name: str, out: Path, short: bool = False) -> dict:
    run_dir = out / name
    for part in RUN_OUTPUTS:
        target = run_dir / part
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    job = SCENARIOS[name](short)
    return record(run_dir, job, run_id=f"sample-{name}{'-short' if short else ''}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="folder of the runs (default: sample_runs/)")
    parser.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), metavar="NAME",
                        help=f"rebuild only these runs ({', '.join(SCENARIOS)})")
    parser.add_argument("--short", action="store_true", help="shortened schedule, for the tests")
    args = parser.parse_args(argv)
    for name in args.only or SCENARIOS:
        t0 = time.perf_counter()
        facts = generate(name, args.out, short=args.short)
        facts["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {json.dumps(facts)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
