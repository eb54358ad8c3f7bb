"""Where the recorder's time goes, and what a diverging job costs.

Three measurements that `recorder_overhead.py` runs in the same invocation
as its variants (so every figure comes from one run on one machine state):

- `diverging`: the benchmark model with a learning rate so high that the
  loss is NaN from an early step on, trained with and without the default
  recorder, interleaved; the ratio is over the *whole* run (sum of step
  times), because after an event the recorder switches to the full tier for
  a burst of steps and the cost of that burst is the point.
- `hook_profile`: cProfile over recorded steps of the default variant; the
  recorder's own functions (those defined under `recorders/`) with their
  calls and exclusive time per step, in microseconds.
- `module_cost`: a deep stack of tiny Linear layers, so the recorder's cost
  is its per-module work and not its statistics; the added CPU time of the
  training thread per watched module (with its two parameters) per step, in
  microseconds (wall time beside it). A model with M watched modules and V
  values per step then costs about `M * us_per_module + V * ns_per_value`
  more per step.
"""
from __future__ import annotations

import cProfile
import copy
import math
import pstats
import random
import tempfile
import time
from pathlib import Path

import common

REPO = common.REPO


def _same_losses(a, b) -> bool:
    """Bit-for-bit equal loss series, where NaN equals NaN (a diverged run)."""
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def _run_tiers(run_dir: Path) -> list[str]:
    """The tier of every recorded step, read back from the run."""
    from amp_postmortem.reading.loader import load_run
    steps = load_run(run_dir).steps.sort_values("step")
    return [str(t) for t in steps["tier"]]


def measure_diverging(job_cls, dtype: str, batches: list, lr: float, size: dict, seed: int) -> dict:
    """Whole-run ratio of a job that diverges early, default recorder vs none
    (`job_cls`: recorder_overhead.Job; one step per batch)."""
    import torch
    torch.manual_seed(seed)
    template = common.gpt_of(size)
    steps = len(batches)
    order = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="amp-pm-diverging-") as tmp:
        jobs = {v: job_cls(v, copy.deepcopy(template), dtype, Path(tmp), size, lr=lr)
                for v in ("baseline", "default")}
        for batch in batches:
            names = list(jobs)
            order.shuffle(names)
            for v in names:
                jobs[v].times.append(jobs[v].step(batch))
        rec = jobs["default"].rec
        rec.close()
        if not rec.enabled:
            raise RuntimeError(f"the recorder disabled itself: {rec.failure!r}")
        tiers = _run_tiers(Path(tmp) / "default")
    base, recd = jobs["baseline"], jobs["default"]
    losses = base.losses
    first_bad = next((i for i, x in enumerate(losses) if not math.isfinite(x)), None)
    full_steps = [i for i, t in enumerate(tiers) if t == "full"]
    return {
        "dtype": dtype, "steps": steps, "lr": lr,
        "first_nonfinite_loss_step": first_bad,
        "baseline_total_s": sum(base.times), "recorded_total_s": sum(recd.times),
        "ratio_whole_run": sum(recd.times) / sum(base.times),
        "ratio_median_step": common.median(recd.times) / common.median(base.times),
        "tiers": {k: tiers.count(k) for k in ("cheap", "full")},
        "full_tier_steps": full_steps,
        "losses_identical_to_baseline": _same_losses(recd.losses, losses),
    }


def profile_hooks(job_cls, dtype: str, batches: list, size: dict, seed: int, top: int = 12) -> dict:
    """cProfile over recorded steps (default configuration; the first batch
    is an unprofiled warm-up step): the recorder's functions per step."""
    import torch
    torch.manual_seed(seed)
    model = common.gpt_of(size)
    steps = len(batches) - 1
    with tempfile.TemporaryDirectory(prefix="amp-pm-profile-") as tmp:
        job = job_cls("default", model, dtype, Path(tmp), size)
        job.step(batches[0])
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for batch in batches[1:]:
            job.step(batch)
        prof.disable()
        wall = time.perf_counter() - t0
        job.rec.close()
    st = pstats.Stats(prof)
    recorders = str(REPO / "recorders")
    rows = []
    total = 0.0
    for (filename, line, func), (_cc, ncalls, tottime, _cum, _callers) in st.stats.items():
        if not filename.startswith(recorders):
            continue
        total += tottime
        # The path inside recorders/ (collectors/forward.py: the hooks
        # live in a package of their own).
        rows.append({"function": f"{Path(filename).relative_to(recorders).as_posix()}:{line}:{func}",
                     "calls_per_step": ncalls / steps, "us_per_step": 1e6 * tottime / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    # Time inside torch ops called by the recorder is not in `total`
    # (exclusive time of our own Python); `inclusive` adds the torch calls
    # made from the hooks, via the cumulative time of the entry points.
    entry = {}
    for (filename, line, func), (_cc, ncalls, _tot, cum, _callers) in st.stats.items():
        if filename.startswith(recorders) and func in ("hook", "pre", "post", "step", "_on_root_pre",
                                                        "_on_opt_pre"):
            key = f"{Path(filename).name}:{func}"
            e = entry.setdefault(key, {"calls_per_step": 0.0, "us_per_step": 0.0})
            e["calls_per_step"] += ncalls / steps
            e["us_per_step"] += 1e6 * cum / steps
    return {"dtype": dtype, "steps": steps, "profiled_step_ms": 1e3 * wall / steps,
            "recorder_python_us_per_step": 1e6 * total / steps,
            "entry_points_inclusive": entry, "top_functions": rows[:top],
            "note": "cProfile inflates Python time; read the shares, not the absolute figures"}


def measure_reductions(job_cls, dtype: str, batches: list, size: dict, seed: int) -> dict:
    """Time inside the statistics' reductions on recorded cheap-tier steps
    (the first batch is a full-tier warm-up step, not counted): the one
    `aminmax` pass that each distinct tensor of the step needs for exact
    absmax and NaN/Inf detection. Whatever the hooks' Python costs, the
    default configuration cannot cost less than this share of the step on
    this machine. `torch.aminmax` is wrapped with a timer while it runs
    (the benchmark's model calls no aminmax of its own)."""
    import torch
    torch.manual_seed(seed)
    model = common.gpt_of(size)
    real = torch.aminmax
    spent, calls, values = [0.0], [0], [0]

    def timed(x, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(x, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0
            calls[0] += 1
            values[0] += x.numel()

    times = []
    with tempfile.TemporaryDirectory(prefix="amp-pm-reductions-") as tmp:
        job = job_cls("default", model, dtype, Path(tmp), size)
        job.step(batches[0])
        torch.aminmax = timed
        try:
            for batch in batches[1:]:
                times.append(job.step(batch))
        finally:
            torch.aminmax = real
        tiers = job.tiers[1:]
        job.rec.close()
    steps = len(batches) - 1
    return {"dtype": dtype, "steps": steps, "tiers": {k: tiers.count(k) for k in set(tiers)},
            "recorded_step_ms": 1e3 * common.median(times),
            "reduction_ms_per_step": 1e3 * spent[0] / steps,
            "reductions_per_step": calls[0] / steps, "values_per_step": values[0] / steps}


def deep_stack(n_layers: int, width: int):
    import torch.nn as nn
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n_layers)])


def measure_module_cost(n_layers: int, steps: int, warmup: int, seed: int, width: int = 16,
                        batch: int = 4) -> dict:
    """Added time per watched module per step (cheap tier), on a model whose
    tensors are tiny: the recorder's per-module work, not its statistics."""
    import torch
    from recorders import AmpRecorder
    torch.manual_seed(seed)
    template = deep_stack(n_layers, width)
    x = torch.randn(batch, width)
    order = random.Random(seed)
    times = {"baseline": [], "default": []}
    cpu = {"baseline": [], "default": []}
    # Tiny tensors: one intra-op thread does all the work, so this thread's
    # CPU time is the step's, and it barely moves when other jobs load the
    # machine (wall time does).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="amp-pm-modules-") as tmp:
        models = {v: copy.deepcopy(template) for v in times}
        opts = {v: torch.optim.SGD(m.parameters(), lr=1e-3) for v, m in models.items()}
        rec = AmpRecorder(Path(tmp) / "run", models["default"], optimizer=opts["default"])
        watched = len(list(models["default"].named_modules()))
        for i in range(warmup + steps):
            names = list(times)
            order.shuffle(names)
            for v in names:
                t0, c0 = time.perf_counter(), time.thread_time()
                loss = models[v](x).square().mean()
                loss.backward()
                opts[v].step()
                opts[v].zero_grad(set_to_none=True)
                if v == "default":
                    rec.step(loss)
                if i >= warmup:
                    times[v].append(time.perf_counter() - t0)
                    cpu[v].append(time.thread_time() - c0)
        rec.close()
    torch.set_num_threads(threads)
    base, recd = common.median(times["baseline"]), common.median(times["default"])
    cbase, crecd = common.median(cpu["baseline"]), common.median(cpu["default"])
    per_module = (crecd - cbase) / watched
    return {"layers": n_layers, "watched_modules": watched, "width": width, "batch": batch,
            "steps": steps, "baseline_ms": 1e3 * base, "recorded_ms": 1e3 * recd,
            "baseline_cpu_ms": 1e3 * cbase, "recorded_cpu_ms": 1e3 * crecd,
            "us_per_watched_module": 1e6 * per_module,
            "us_per_watched_module_wall": 1e6 * (recd - base) / watched,
            "predicted_added_ms_for_10000_modules": 1e3 * per_module * 10_000}
