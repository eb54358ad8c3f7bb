"""Recorder overhead on a CUDA GPU, and proof that it adds no host-device
synchronisation. Ready to run in one go on a CUDA machine; without CUDA it
says so and exits with status 0.

A larger GPT-style model (default 12 layers, d_model 1024, 16 heads,
sequence 1024, batch 8, vocabulary 32768) trained in float16 autocast with
`GradScaler("cuda")`. Three identical copies (model, AdamW, scaler):
`baseline` (no recorder), `default` (AmpRecorder defaults) and `full`
(full tier every step), stepped in a shuffled order each round (A B C,
interleaved); each step is timed between two `torch.cuda.synchronize()`
calls made by this script, outside the step. Target (issue 41): default
(the sentinel) <= 1.02x.

Synchronisation, two independent checks on the recorded variants:
1. `torch.cuda.set_sync_debug_mode("error")` around everything the
   recorder runs on the training thread (forward and backward with its
   hooks, `rec.step()`), leaving out only `scaler.step()`/`update()`, which
   synchronise by design (GradScaler reads `found_inf`). A synchronising
   call raises; the recorder would catch it and disable itself, so the
   check also asserts that the recorder is still enabled.
2. `torch.profiler` over whole steps (scaler included) of each variant:
   the CUDA runtime calls that block the host (`cuda*Synchronize`, and
   synchronous `cudaMemcpy`) made by the training thread are counted per
   step; the recorded variants must count exactly as many as the baseline.

Peak GPU memory: each variant alone for a few steps after
`torch.cuda.reset_peak_memory_stats()`; the recorder's share is the
difference to the baseline.

bf16 without a scaler (`bf16_deferred`): the GPT trained in bfloat16, no
GradScaler, a NaN planted in the logits of one step: every `rec.step()`
but the one that judges it (a step later, where the re-execution may
synchronise) under sync debug mode "error"; the NaN step must be
re-executed in the job and reproduce (`StepSentinel.hand_over`).

Launch-bound (`launch_bound` in the JSON): the deep, narrow model of
`recorder_hot_path.py` (`common.deep_narrow`: 48 residual blocks of width
16, 242 modules, batch 8, SGD, fp16 autocast + GradScaler), baseline and
default recorder interleaved the same way. Its kernels take microseconds,
so the step is the host launching them: the recorder's per-module host
cost, undiluted. Target (issue 41): at most 1.02x, as for the GPT.

    python benchmarks/recorder_overhead_cuda.py                  # ~3-5 min on one GPU
    python benchmarks/recorder_overhead_cuda.py --smoke          # tiny model
    python benchmarks/recorder_overhead_cuda.py --json out.json
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

VARIANTS = ("baseline", "default", "full")
FULL_SIZE = dict(vocab=32768, d_model=1024, n_layers=12, n_heads=16, seq=1024, batch=8)
SMOKE_SIZE = dict(vocab=256, d_model=64, n_layers=2, n_heads=4, seq=64, batch=4)
LAUNCH_FULL = dict(blocks=48, width=16, batch=8)
LAUNCH_SMOKE = dict(blocks=3, width=8, batch=2)
LAUNCH_VARIANTS = ("baseline", "default")
_BLOCKING = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


class Job:
    def __init__(self, variant, model, run_dir, size):
        import torch
        from recorders import AmpRecorder
        self.variant, self.model, self.size = variant, model, size
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        self.scaler = torch.amp.GradScaler("cuda")
        self.rec = None
        if variant != "baseline":
            kw = {"full_every": 1} if variant == "full" else {}
            self.rec = AmpRecorder(run_dir / variant, model, optimizer=self.opt, scaler=self.scaler, **kw)
        self.times: list[float] = []

    def step(self, batch, sync_check: bool = False):
        """One optimizer step. With `sync_check`, everything but the
        scaler's own step/update runs under sync debug mode "error"."""
        import torch
        import torch.nn.functional as F
        debug = (lambda mode: torch.cuda.set_sync_debug_mode(mode)) if sync_check else (lambda mode: None)
        debug("error")
        try:
            with torch.autocast("cuda", dtype=torch.float16):
                logits = self.model(batch[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, self.size["vocab"]), batch[:, 1:].reshape(-1))
            self.scaler.scale(loss).backward()
            debug(0)
            self.scaler.step(self.opt)   # reads found_inf on the host: GradScaler's own sync
            self.scaler.update()
            debug("error")
            self.opt.zero_grad(set_to_none=True)
            if self.rec is not None:
                self.rec.step(loss)
        finally:
            debug(0)
        return loss


class LaunchJob:
    """The launch-bound model: SGD, fp16 autocast, GradScaler; `default`
    with AmpRecorder's defaults."""

    def __init__(self, variant, model, run_dir):
        import torch
        from recorders import AmpRecorder
        self.variant, self.model = variant, model
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.scaler = torch.amp.GradScaler("cuda")
        self.rec = None
        if variant != "baseline":
            self.rec = AmpRecorder(run_dir / f"launch-{variant}", model, optimizer=self.opt, scaler=self.scaler)
        self.times: list[float] = []

    def step(self, x):
        import torch
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(x).float().square().mean()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        if self.rec is not None:
            self.rec.step(loss)
        return loss


def bf16_deferred_check(size, seed, run_dir, steps: int = 8, nan_at: int = 4) -> dict:
    """A bf16 job without a scaler (the GPT, AdamW): every `rec.step()`
    but the one after the planted NaN (step `nan_at`, where the waiting
    step's facts ask for a re-execution) runs under sync debug mode
    "error"; the NaN step must be re-executed in the job, a step later,
    and reproduce (`exact` or `close`: the re-execution runs the same
    kernels). Counts the rows that went undecided (the device more than a
    step behind: not read, no re-execution)."""
    import json as _json

    import torch
    import torch.nn.functional as F
    from recorders import AmpRecorder
    torch.manual_seed(seed)
    model = common.gpt_of(size).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rec = AmpRecorder(run_dir / "bf16-deferred", model, optimizer=opt)
    raised = None
    for step, batch in enumerate(_batches(steps, size, seed)):
        debug = step != nan_at + 1  # the event step's re-execution may synchronise
        try:
            torch.cuda.set_sync_debug_mode("error" if debug else 0)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(batch[:, :-1])
                if step == nan_at:
                    logits = logits * float("nan")
                loss = F.cross_entropy(logits.float().reshape(-1, size["vocab"]), batch[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec.step(loss)
        except RuntimeError as exc:  # a synchronising call outside the recorder
            raised = f"step {step}: {exc}"
            break
        finally:
            torch.cuda.set_sync_debug_mode(0)
    enabled, undecided = rec.enabled, rec.sentinel.undecided if rec.sentinel is not None else None
    rec.close()
    manifest = _json.loads((run_dir / "bf16-deferred" / "rank=0" / "manifest.json").read_text())
    entries = [e for e in manifest.get("reexecutions", []) if e.get("step") == nan_at]
    check = entries[0].get("check") if entries else None
    return {"nan_at": nan_at, "recorder_enabled": enabled, "raised": raised, "undecided_rows": undecided,
            "reexecution_check": check, "disabled_reason": manifest.get("disabled_reason"),
            "passed": enabled and raised is None and check in ("exact", "close")}


def launch_bound(size, steps, warmup, seed, run_dir) -> dict:
    import torch
    torch.manual_seed(seed)
    template = common.deep_narrow(size["blocks"], size["width"])
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randn(size["batch"], size["width"], generator=g).cuda() for _ in range(warmup + steps)]
    jobs = {v: LaunchJob(v, copy.deepcopy(template).cuda(), run_dir) for v in LAUNCH_VARIANTS}
    out = {"size": size, "watched_modules": sum(1 for _ in template.modules()),
           "timing": timing(jobs, batches, warmup, seed)}
    for j in jobs.values():
        if j.rec is not None:
            j.rec.close()
            out["recorder_enabled_at_close"] = j.rec.enabled
    return out


def _batches(n, size, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, size["vocab"], (size["batch"], size["seq"] + 1), generator=g).cuda()
            for _ in range(n)]


def timing(jobs, batches, warmup, seed):
    import torch
    order = random.Random(seed)
    for i, batch in enumerate(batches):
        names = list(jobs)
        order.shuffle(names)
        for v in names:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            jobs[v].step(batch)
            torch.cuda.synchronize()
            if i >= warmup:
                jobs[v].times.append(time.perf_counter() - t0)
    base = common.median(jobs["baseline"].times)
    out = {}
    for v, j in jobs.items():
        s = common.summarize(j.times)
        out[v] = {"median_s": s["median"], "p10_s": s["p10"], "p90_s": s["p90"],
                  "ratio": s["median"] / base}
    return out


def sync_debug_check(jobs, batches) -> dict:
    out = {}
    for v, j in jobs.items():
        if j.rec is None:
            continue
        error = None
        try:
            for batch in batches:
                j.step(batch, sync_check=True)
        except RuntimeError as exc:  # a synchronising op outside the recorder's guard
            error = str(exc).splitlines()[0]
        out[v] = {"steps": len(batches), "error": error, "recorder_enabled": j.rec.enabled,
                  "recorder_failure": repr(j.rec.failure) if j.rec.failure is not None else None,
                  "passed": error is None and j.rec.enabled}
    return out


def profiler_sync_count(jobs, batches) -> dict:
    """Blocking CUDA runtime calls per step, per thread. The recorder's
    writer thread waits on its copy event by design (off the training
    path); its native id is listed so that it can be told apart."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    out = {}
    for v, j in jobs.items():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for batch in batches:
                j.step(batch)
            torch.cuda.synchronize()
        by_thread: dict[str, dict[str, float]] = {}
        for e in prof.events():
            name = e.name
            if any(b in name for b in _BLOCKING) or name in ("cudaMemcpy", "cudaMemcpy2D"):
                t = by_thread.setdefault(str(getattr(e, "thread", "?")), {})
                t[name] = t.get(name, 0) + 1
        writer = j.rec.writer.native_id if j.rec is not None else None
        per_step = {tid: {k: c / len(batches) for k, c in sorted(d.items())} for tid, d in by_thread.items()}
        training = sum(c for tid, d in per_step.items() if tid != str(writer) for c in d.values())
        out[v] = {"per_thread_per_step": per_step, "writer_thread": writer,
                  "training_threads_per_step": training}
    base = out["baseline"]["training_threads_per_step"]
    for v in out:
        # The final synchronize() of the profiled block is this script's.
        out[v]["added_per_step"] = out[v]["training_threads_per_step"] - base
    return out


def peak_memory(jobs, batches) -> dict:
    import torch
    out = {}
    for v, j in jobs.items():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for batch in batches:
            j.step(batch)
        torch.cuda.synchronize()
        out[v] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return {"peak_allocated_mib": out,
            "recorder_mib": {v: round(out[v] - out["baseline"], 1) for v in out}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="measured rounds after warm-up")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--check-steps", type=int, default=5, help="steps per sync check and memory phase")
    ap.add_argument("--launch-steps", type=int, default=100,
                    help="measured rounds of the launch-bound model (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args(argv)

    import torch
    if not torch.cuda.is_available():
        print("recorder_overhead_cuda: CUDA is not available on this machine; nothing measured. "
              "Run it on a CUDA machine.", file=sys.stderr)
        common.write_json({"benchmark": "recorder_overhead_cuda", "skipped": "CUDA not available"}, None)
        return 0
    size = dict(SMOKE_SIZE if args.smoke else FULL_SIZE)
    if args.smoke:
        args.steps, args.warmup, args.check_steps = 3, 1, 2
        args.launch_steps = min(args.launch_steps, 3)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    result = {"benchmark": "recorder_overhead_cuda", "machine": common.machine_info(),
              "gpu": torch.cuda.get_device_name(), "size": size,
              "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "targets": {"default_ratio_max": 1.02, "added_syncs_per_step": 0, "launch_bound_ratio_max": 1.02}}
    template = common.gpt_of(size)
    with tempfile.TemporaryDirectory(prefix="amp-pm-cuda-") as tmp:
        jobs = {v: Job(v, copy.deepcopy(template).cuda(), Path(tmp), size) for v in VARIANTS}
        batches = _batches(args.warmup + args.steps, size, args.seed)
        t0 = time.perf_counter()
        result["timing"] = timing(jobs, batches, args.warmup, args.seed)
        result["timing_wall_s"] = round(time.perf_counter() - t0, 1)
        check = batches[: args.check_steps]
        result["sync_debug_error_mode"] = sync_debug_check(jobs, check)
        result["profiler_blocking_calls"] = profiler_sync_count(jobs, check)
        result["memory"] = peak_memory(jobs, check)
        for j in jobs.values():
            if j.rec is not None:
                j.rec.close()
                result.setdefault("recorder_enabled_at_close", {})[j.variant] = j.rec.enabled
        result["bf16_deferred"] = bf16_deferred_check(size, args.seed, Path(tmp))
        if args.launch_steps > 0:
            result["launch_bound"] = launch_bound(LAUNCH_SMOKE if args.smoke else LAUNCH_FULL, args.launch_steps,
                                                  args.warmup, args.seed, Path(tmp))
    t = result["timing"]
    rows = [{"variant": v, "median_ms": 1e3 * t[v]["median_s"], "ratio": t[v]["ratio"],
             "added_syncs": result["profiler_blocking_calls"][v]["added_per_step"],
             "sync_error_mode": result["sync_debug_error_mode"].get(v, {}).get("passed"),
             "peak_mib": result["memory"]["peak_allocated_mib"][v]} for v in VARIANTS]
    common.print_table(rows, ["variant", "median_ms", "ratio", "added_syncs", "sync_error_mode", "peak_mib"])
    bf = result["bf16_deferred"]
    print(f"\nbf16 without a scaler: NaN at step {bf['nan_at']} re-executed a step later: "
          f"{bf['reexecution_check']}; undecided rows {bf['undecided_rows']}; passed {bf['passed']}",
          file=sys.stderr)
    if "launch_bound" in result:
        lb = result["launch_bound"]
        print(f"\nlaunch-bound: {lb['watched_modules']} modules "
              f"(target <= {result['targets']['launch_bound_ratio_max']})",
              file=sys.stderr)
        common.print_table([{"variant": v, "median_ms": 1e3 * lt["median_s"], "ratio": lt["ratio"]}
                            for v, lt in lb["timing"].items()], ["variant", "median_ms", "ratio"])
    common.write_json(result, args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
