"""Recorder overhead on the CPU: step time with and without AmpRecorder.

A GPT-style model (4 layers, d_model 256, sequence 128, batch 16) is trained
in float32, bfloat16 autocast and float16 autocast with
`GradScaler("cpu")`. Each variant is its own identical copy of the model,
optimizer and scaler, so the baseline carries no hooks at all:

- `baseline`: no recorder;
- `default`:  AmpRecorder with its default configuration (cheap tier every
  step, full tier every 100 steps);
- `full`:     AmpRecorder(full_every=1): the full tier on every step;
- `paused`:   a recorder attached but every step inside `rec.paused()`,
  i.e. what hooks that do nothing cost;
- `leaves` (only with `--variants`): the default with the container
  modules excluded (every module with children but the model itself).

Every round runs one step of each variant on the same batch, in a shuffled
order (A B C D, interleaved), so that drifts of the machine hit every
variant alike. Reported: median step time over the measured rounds after
warm-up, its ratio to the baseline (and the ratio of the means, which
counts the rare slow step: a full garbage collection), Python's garbage
collections during each variant's steps, the writer thread's CPU time per step
(work done off the training thread; on a 2-core machine it competes with
torch's intra-op threads, so `ratio_charged` adds it to the step as an upper
bound), the recorder's own buffers, and peak RSS of each variant trained
alone in a child process.

    python benchmarks/recorder_overhead.py                # full size, ~30 min on 2 cores
    python benchmarks/recorder_overhead.py --dtypes fp32,bf16 --steps 30
    python benchmarks/recorder_overhead.py --smoke        # seconds; CI keeps it working

In the same invocation (see `recorder_cost.py`): a diverging job (learning
rate 1e4: NaN from step 2) with and without the default recorder, its ratio
over the whole run; a cProfile of the recorder's hooks per step; the time
inside the statistics' reductions alone (one `aminmax` per distinct tensor:
the floor of the default configuration's cost, whatever the hooks' Python
costs); and the added time per watched module on a deep stack of tiny
layers. `ratio_paired` is the median of per-round ratios (each variant
against the baseline of the same round), a check on `ratio` that drifts of
the machine between rounds do not move.

Prints one JSON document on stdout (figures) and a table on stderr.
"""
from __future__ import annotations

import argparse
import copy
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import recorder_cost  # noqa: E402

DTYPES = ("fp32", "bf16", "fp16")
VARIANTS = ("baseline", "default", "full", "paused")
# Also measurable (--variants): `leaves`, the default with every container
# module but the root excluded (only modules without children watched).

FULL_SIZE = dict(vocab=2048, d_model=256, n_layers=4, n_heads=4, seq=128, batch=16)
SMOKE_SIZE = dict(vocab=64, d_model=32, n_layers=1, n_heads=2, seq=16, batch=2)


def _torch_dtype(name):
    import torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


class Job:
    """One variant: its own model, optimizer, scaler and (maybe) recorder."""

    def __init__(self, variant: str, model, dtype: str, run_dir: Path | None, size: dict,
                 lr: float = 1e-3):
        import torch
        self.variant = variant
        self.model = model
        self.dtype = _torch_dtype(dtype)
        self.size = size
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr)
        self.scaler = torch.amp.GradScaler("cpu") if dtype == "fp16" else None
        self.rec = None
        if variant != "baseline":
            from recorders import AmpRecorder
            kw = {"full_every": 1} if variant == "full" else {}
            if variant == "leaves":
                kw["exclude"] = [n for n, m in model.named_modules() if n and next(m.children(), None) is not None]
            self.rec = AmpRecorder(run_dir / variant, model, optimizer=self.opt,
                                   scaler=self.scaler, **kw)
        self.times: list[float] = []
        self.losses: list[float] = []
        self.tiers: list[str] = []
        self.raw_rows: list[int] = []
        self.max_queue = 0
        self.buffer_bytes_per_step = 0

    def step(self, batch) -> float:
        """One optimizer step; returns its wall time in seconds."""
        import torch
        import torch.nn.functional as F
        rec, vocab = self.rec, self.size["vocab"]
        paused = rec.paused() if self.variant == "paused" else None
        if rec is not None and self.variant != "paused":
            self.tiers.append("full" if rec.hooks.state.full else "cheap")
        t0 = time.perf_counter()
        if paused is not None:
            paused.__enter__()
        with torch.autocast("cpu", dtype=self.dtype, enabled=self.dtype != torch.float32):
            logits = self.model(batch[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), batch[:, 1:].reshape(-1))
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if rec is not None and self.variant != "paused":
            self.raw_rows.append(len(rec.hooks.state.stats))
            rec.step(loss)
        if paused is not None:
            paused.__exit__(None, None, None)
        dt = time.perf_counter() - t0
        if rec is not None:
            self.max_queue = max(self.max_queue, rec.writer.backlog)
            per_step = _writer_bytes_per_step(rec)
            if per_step:
                self.buffer_bytes_per_step = max(self.buffer_bytes_per_step, per_step)
        self.losses.append(loss.item())
        return dt


def _batches(n: int, size: dict, seed: int = 0):
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, size["vocab"], (size["batch"], size["seq"] + 1), generator=g)
            for _ in range(n)]


def _writer_bytes_per_step(rec) -> float:
    """Bytes of rows the writer holds per buffered step (0 when it holds
    none: it has just written a shard). Read from the training thread while
    the writer may append: a sample, not an exact count."""
    w = rec.shards
    batches = list(w._tensor_batches)
    steps = w.pending_steps
    if not batches or not steps:
        return 0
    # The writer holds each step's rows as the Arrow batch it journaled.
    total = sum(batch.nbytes for batch in batches)
    return total / max(steps, len(batches))


def _buffers(job) -> dict:
    """What the recorder holds in memory: the queue to the writer thread
    (bounded by max_queue steps) and the writer's rows not yet in a shard
    (bounded by steps_per_shard steps; also written every flush_interval_s)."""
    rec = job.rec
    w = rec.shards
    per_step = job.buffer_bytes_per_step
    deadline = time.monotonic() + 10.0
    while not per_step and time.monotonic() < deadline:
        # The writer thread runs a step behind the training: in a short run
        # on a loaded machine every sample can come before its first step
        # (seen in CI: a 3-step smoke run sampled 0). Wait for one.
        time.sleep(0.02)
        per_step = _writer_bytes_per_step(rec)
    return {
        "queue_max_steps": rec.writer.max_queue,
        "writer_steps_per_shard": w.steps_per_shard,
        "writer_buffer_bytes_per_step": round(per_step),
        "writer_buffer_bound_mib": round(per_step * w.steps_per_shard / 2**20, 2),
    }


class GcTally:
    """Python's garbage collections during each variant's measured steps:
    how many of each generation, and their time. The objects a recorder's
    hooks allocate and keep through a step trigger them; the training
    itself allocates almost none."""

    def __init__(self):
        self.variant = None
        self.counts: dict = {}
        self.seconds: dict = {}
        self._t0 = None

    def start(self):
        import gc
        gc.callbacks.append(self._callback)

    def stop(self):
        import gc
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        if self._t0 is None or self.variant is None:
            return
        key = (self.variant, info["generation"])
        self.counts[key] = self.counts.get(key, 0) + 1
        self.seconds[self.variant] = self.seconds.get(self.variant, 0.0) + time.perf_counter() - self._t0

    def per_step(self, variant, steps: int) -> dict:
        return {"collections_per_step": {str(g): self.counts.get((variant, g), 0) / steps for g in (0, 1, 2)},
                "ms_per_step": 1e3 * self.seconds.get(variant, 0.0) / steps}


def measure_dtype(dtype: str, variants, steps: int, warmup: int, size: dict, seed: int) -> dict:
    import torch
    torch.manual_seed(seed)
    template = common.gpt_of(size)
    batches = _batches(warmup + steps, size, seed)
    order_rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="amp-pm-overhead-") as tmp:
        jobs = {v: Job(v, copy.deepcopy(template), dtype, Path(tmp), size) for v in variants}
        cpu0 = {}
        collector = GcTally()
        try:
            for i, batch in enumerate(batches):
                if i == warmup:
                    cpu0 = {v: common.thread_cpu_s(j.rec.writer.native_id)
                            for v, j in jobs.items() if j.rec is not None}
                    collector.start()
                names = list(jobs)
                order_rng.shuffle(names)
                for v in names:
                    collector.variant = v
                    jobs[v].times.append(jobs[v].step(batch))
        finally:
            collector.stop()
        cpu1 = {v: common.thread_cpu_s(j.rec.writer.native_id)
                for v, j in jobs.items() if j.rec is not None}
        out = {"dtype": dtype, "steps": steps, "warmup": warmup, "variants": {}}
        base = common.median(jobs["baseline"].times[warmup:]) if "baseline" in jobs else None
        ref_losses = jobs["baseline"].losses if "baseline" in jobs else None
        for v, j in jobs.items():
            t = j.times[warmup:]
            s = common.summarize(t)
            row = {"median_s": s["median"], "p10_s": s["p10"], "p90_s": s["p90"], "mean_s": s["mean"]}
            if base:
                row["ratio"] = s["median"] / base
                # The same variant against the baseline of the same round:
                # the machine's speed drifts between rounds (other jobs, clock),
                # and pairing takes that drift out of the spread.
                row["ratio_paired"] = common.median(
                    [a / b for a, b in zip(t, jobs["baseline"].times[warmup:])])
                # Means: what a whole run pays, the rare slow step included (a
                # full garbage collection, ~150 ms here, every few hundred
                # steps), which the median leaves out.
                row["ratio_mean"] = s["mean"] / common.summarize(jobs["baseline"].times[warmup:])["mean"]
            row["gc"] = collector.per_step(v, steps)
            if j.rec is not None:
                w0, w1 = cpu0.get(v), cpu1.get(v)
                if w0 is not None and w1 is not None:
                    row["writer_cpu_s_per_step"] = (w1 - w0) / steps
                    if base:
                        row["ratio_charged"] = (s["median"] + row["writer_cpu_s_per_step"]) / base
                if v != "paused":
                    tiers = j.tiers[warmup:]
                    row["tiers"] = {k: tiers.count(k) for k in ("cheap", "full") if k in tiers}
                    row["raw_rows_per_step"] = max(j.raw_rows) if j.raw_rows else 0
                    row["max_queue_depth_seen"] = j.max_queue
                    row["buffers"] = _buffers(j)
            if ref_losses is not None:
                row["losses_identical_to_baseline"] = j.losses == ref_losses
            out["variants"][v] = row
        for j in jobs.values():
            if j.rec is not None:
                j.rec.close()
                if not j.rec.enabled:
                    raise RuntimeError(f"recorder of {j.variant} disabled itself: {j.rec.failure!r}")
    if base and "default" in out["variants"] and "full" in out["variants"]:
        # The default configuration runs the full tier one step in 100
        # (full_every=100): its long-run cost mixes both tiers.
        d, f = out["variants"]["default"]["median_s"], out["variants"]["full"]["median_s"]
        out["default_amortised_ratio"] = (0.99 * d + 0.01 * f) / base
    return out


def memory_child(dtype: str, variant: str, steps: int, size: dict, seed: int) -> dict:
    """Train one variant alone and report this process's peak RSS."""
    import torch
    torch.manual_seed(seed)
    model = common.gpt_of(size)
    with tempfile.TemporaryDirectory(prefix="amp-pm-mem-") as tmp:
        job = Job(variant, model, dtype, Path(tmp), size)
        for batch in _batches(steps, size, seed):
            job.step(batch)
        peak = common.peak_rss_mib()
        if job.rec is not None:
            job.rec.close()
    return {"dtype": dtype, "variant": variant, "steps": steps, "peak_rss_mib": round(peak, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=20, help="measured rounds after warm-up")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--memory-steps", type=int, default=4,
                    help="steps of each child process measuring peak RSS (0: skip)")
    ap.add_argument("--diverging-steps", type=int, default=150,
                    help="steps of the diverging job, whole-run ratio (0: skip)")
    ap.add_argument("--diverging-lr", type=float, default=1e4)
    ap.add_argument("--profile-steps", type=int, default=5, help="cProfiled recorded steps (0: skip)")
    ap.add_argument("--reduction-steps", type=int, default=8,
                    help="recorded steps timing the statistics' reductions alone (0: skip)")
    ap.add_argument("--module-layers", type=int, default=400,
                    help="layers of the deep stack measuring the cost per watched module (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--smoke", action="store_true", help="tiny model, few steps (CI)")
    ap.add_argument("--json", dest="json_path", default=None, help="also write the JSON here")
    ap.add_argument("--memory-child", nargs=2, metavar=("DTYPE", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    size = dict(SMOKE_SIZE if args.smoke else FULL_SIZE)
    if args.smoke:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
        args.memory_steps = min(args.memory_steps, 1)
        args.diverging_steps = min(args.diverging_steps, 4)
        args.profile_steps = min(args.profile_steps, 1)
        args.reduction_steps = min(args.reduction_steps, 1)
        args.module_layers = min(args.module_layers, 8)
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.memory_child:
        dtype, variant = args.memory_child
        common.write_json(memory_child(dtype, variant, args.memory_steps, size, args.seed), None)
        return 0

    dtypes = [d for d in args.dtypes.split(",") if d]
    variants = [v for v in args.variants.split(",") if v]
    if "baseline" not in variants:
        variants.insert(0, "baseline")
    result = {"benchmark": "recorder_overhead", "machine": common.machine_info(),
              "torch_threads": torch.get_num_threads(), "size": size,
              "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "targets": {"default_ratio_max": 1.05, "full_ratio_max": 1.5},
              "dtypes": {}}
    table = []
    for dtype in dtypes:
        t0 = time.perf_counter()
        r = measure_dtype(dtype, variants, args.steps, args.warmup, size, args.seed)
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        if args.memory_steps > 0 and not (args.smoke and dtype != dtypes[0]):
            mem_variants = [v for v in variants if v != "paused"]
            if args.smoke:
                mem_variants = mem_variants[:2]
            r["peak_rss_mib"] = {}
            for v in mem_variants:
                child = [str(Path(__file__).resolve()), "--memory-child", dtype, v,
                         "--memory-steps", str(args.memory_steps), "--seed", str(args.seed)]
                if args.smoke:
                    child.append("--smoke")
                if args.threads:
                    child += ["--threads", str(args.threads)]
                r["peak_rss_mib"][v] = common.run_child(child)["peak_rss_mib"]
        result["dtypes"][dtype] = r
        for v, row in r["variants"].items():
            table.append({"dtype": dtype, "variant": v, "median_ms": 1e3 * row["median_s"],
                          "p90_ms": 1e3 * row["p90_s"], "ratio": row.get("ratio"),
                          "paired": row.get("ratio_paired"), "mean_ratio": row.get("ratio_mean"),
                          "gc_ms": row["gc"]["ms_per_step"],
                          "writer_ms": 1e3 * row["writer_cpu_s_per_step"] if "writer_cpu_s_per_step" in row else None,
                          "charged": row.get("ratio_charged"),
                          "tiers": row.get("tiers"),
                          "peak_rss_mib": r.get("peak_rss_mib", {}).get(v),
                          "same_bits": row.get("losses_identical_to_baseline")})
    common.print_table(table, ["dtype", "variant", "median_ms", "p90_ms", "ratio", "paired", "mean_ratio", "gc_ms", "writer_ms",
                               "charged", "tiers", "peak_rss_mib", "same_bits"])
    _cost_sections(result, dtypes, args, size)
    common.write_json(result, args.json_path)
    return 0


def _cost_sections(result: dict, dtypes, args, size) -> None:
    """The diverging job, the hook profile and the per-module cost."""
    if args.diverging_steps > 0:
        result["diverging"] = {}
        rows = []
        for dtype in (d for d in dtypes if d != "fp16"):
            r = recorder_cost.measure_diverging(Job, dtype, _batches(args.diverging_steps, size, args.seed),
                                                args.diverging_lr, size, args.seed)
            result["diverging"][dtype] = r
            rows.append({"dtype": dtype, "steps": r["steps"], "first_nan": r["first_nonfinite_loss_step"],
                         "ratio_whole_run": r["ratio_whole_run"], "tiers": r["tiers"],
                         "same_bits": r["losses_identical_to_baseline"]})
        print("\ndiverging job (target <= 1.15 over the whole run)", file=sys.stderr)
        common.print_table(rows, ["dtype", "steps", "first_nan", "ratio_whole_run", "tiers", "same_bits"])
    if args.profile_steps > 0:
        dtype = "bf16" if "bf16" in dtypes else dtypes[0]
        prof = recorder_cost.profile_hooks(Job, dtype, _batches(args.profile_steps + 1, size, args.seed),
                                           size, args.seed)
        result["hook_profile"] = prof
        print(f"\nrecorder functions per step ({dtype}, cProfile, exclusive time)", file=sys.stderr)
        common.print_table(prof["top_functions"], ["function", "calls_per_step", "us_per_step"])
    if args.reduction_steps > 0:
        result["reductions"] = {}
        rows = []
        for dtype in dtypes:
            r = recorder_cost.measure_reductions(Job, dtype, _batches(args.reduction_steps + 1, size, args.seed),
                                                 size, args.seed)
            base = result["dtypes"].get(dtype, {}).get("variants", {}).get("baseline", {}).get("median_s")
            if base:
                # The floor of the default configuration's ratio on this machine.
                r["reduction_share_of_baseline_step"] = r["reduction_ms_per_step"] / (1e3 * base)
            result["reductions"][dtype] = r
            rows.append({"dtype": dtype, "reductions_per_step": r["reductions_per_step"],
                         "values_per_step": r["values_per_step"], "reduction_ms": r["reduction_ms_per_step"],
                         "share_of_baseline": r.get("reduction_share_of_baseline_step")})
        print("\nthe statistics' reductions alone (one aminmax per distinct tensor, cheap tier)", file=sys.stderr)
        common.print_table(rows, ["dtype", "reductions_per_step", "values_per_step", "reduction_ms",
                                  "share_of_baseline"])
    if args.module_layers > 0:
        mc = recorder_cost.measure_module_cost(args.module_layers, max(args.steps, 2), args.warmup, args.seed)
        result["module_cost"] = mc
        print("\ncost per watched module (deep stack of tiny Linear layers)", file=sys.stderr)
        common.print_table([mc], ["watched_modules", "baseline_cpu_ms", "recorded_cpu_ms", "us_per_watched_module",
                                  "us_per_watched_module_wall", "predicted_added_ms_for_10000_modules"])


if __name__ == "__main__":
    sys.exit(main())
