"""Recorder overhead on a compiled model (CPU): step time of `torch.compile`
with and without AmpRecorder.

The benchmark model of `recorder_overhead.py` (GPT-style, 4 layers, d_model
256, sequence 128, batch 16), bfloat16 autocast (`--dtype fp32`: none), AdamW, compiled with
inductor. Variants, each its own identical copy of the model:

- `compiled`: `torch.compile(model)`, no recorder;
- `compiled_again`: the same, a second copy: how far two compiled copies
  agree with each other (inductor's own run-to-run determinism);
- `after`:    the recorder attached to the compiled module;
- `before`:   the recorder attached to the model, then compiled;
- `before_rows`: the same with `compiled_rows=True` (every module's cheap
  rows computed inside the graph on every step).

The recorder keeps its defaults (cheap tier every step, full tier every 100
steps): compiled steps record the loss and the parameter gradients and, in
`before_rows`, the cheap tier's rows of every module, computed inside the
graph (`recorders/collectors/graph_stats.py`); full-tier steps run eagerly (none among the measured
rounds). Rounds interleave the variants in a shuffled order after warm-up
(compilation); reported: median step time, its ratio to `compiled` (the
budget: at most `BUDGET`), the graphs compiled after warm-up
(recompilations), the graph breaks and the tensor rows of the last step, per
variant; and the floor: one eager `aminmax` over every tensor the in-graph
rows read, timed in the same rounds, as a ratio to `compiled`
(`floor_aminmax`).

    python benchmarks/compile_overhead.py                  # ~5 min on 2 cores
    python benchmarks/compile_overhead.py --smoke          # seconds (eager backend)

Prints one JSON document on stdout and a table on stderr.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

VARIANTS = ("compiled", "compiled_again", "after", "before", "before_rows")
BUDGET = 1.10  # the recorder's compiled step, at most this times the compiled step without it
FULL_SIZE = dict(vocab=2048, d_model=256, n_layers=4, n_heads=4, seq=128, batch=16)
SMOKE_SIZE = dict(vocab=64, d_model=32, n_layers=1, n_heads=2, seq=16, batch=2)


class Job:
    def __init__(self, variant: str, size: dict, backend, run_dir: Path, seed: int, dtype: str = "bf16"):
        import torch
        torch.manual_seed(seed)
        self.variant, self.size = variant, size
        self.autocast = dtype == "bf16"
        self.loss_fn = _loss_fn(size)
        model = common.gpt_of(size)
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
        self.rec = None
        from recorders import AmpRecorder
        if variant in ("before", "before_rows"):
            self.rec = AmpRecorder(run_dir / variant, model, optimizer=self.opt,
                                   compiled_rows=variant == "before_rows")
        self.model = torch.compile(model, backend=self.counter)
        if variant == "after":
            self.rec = AmpRecorder(run_dir / variant, self.model, optimizer=self.opt)
        self.times: list[float] = []
        self.losses: list[float] = []

    def step(self, batch) -> float:
        import torch
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.loss_fn(self.model, batch)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.rec is not None:
            self.rec.step(loss)
        dt = time.perf_counter() - t0
        self.losses.append(loss.item())
        return dt


def _loss_fn(size: dict):
    def loss_fn(model, batch):
        import torch.nn.functional as F
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, size["vocab"]), batch[:, 1:].reshape(-1))
    return loss_fn


def measure(size: dict, backend: str, steps: int, warmup: int, seed: int, dtype: str = "bf16") -> dict:
    import torch
    from torch._dynamo.utils import counters
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, size["vocab"], (size["batch"], size["seq"] + 1), generator=g)
               for _ in range(warmup + steps)]
    out = {}
    # The floor: one eager aminmax over every tensor the in-graph rows read
    # (each module's outputs, the gradients reaching them and handed to its
    # inputs, the parameters' gradients), timed in the same rounds; the
    # least any recorder of every value pays, in eager kernels.
    import recorder_hot_path
    tensors = recorder_hot_path.recorded_tensors(common.gpt_of(size), _loss_fn(size), batches[0],
                                                 torch.bfloat16 if dtype == "bf16" else torch.float32)
    floor_pass = recorder_hot_path.reduction_pass(tensors, "aminmax")
    floor_times: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        jobs = {v: Job(v, size, backend, Path(tmp), seed, dtype) for v in VARIANTS}
        breaks_before = sum(counters["graph_break"].values())
        for i in range(warmup):  # compilation happens here
            for v in VARIANTS:
                jobs[v].step(batches[i])
        frames_warm = {v: jobs[v].counter.frame_count for v in VARIANTS}
        rng = random.Random(seed)
        for i in range(warmup, warmup + steps):
            order = [*VARIANTS, None]
            rng.shuffle(order)
            for v in order:
                if v is None:
                    floor_times.append(floor_pass())
                else:
                    jobs[v].times.append(jobs[v].step(batches[i]))
        base = common.median(jobs["compiled"].times)
        floor_ms = common.median(floor_times) * 1e3 if floor_times else 0.0
        out["floor_aminmax"] = {"tensors": len(tensors), "values": sum(t.numel() for t in tensors),
                                "ms_per_step": floor_ms, "ratio": (base * 1e3 + floor_ms) / (base * 1e3)}
        for v, job in jobs.items():
            if job.rec is not None:
                job.rec.close()
            med = common.median(job.times)
            rows = 0
            if job.rec is not None:
                import amp_postmortem
                rows = int(amp_postmortem.load_run(job.rec.run_location).steps["tensor_rows"].iloc[-1])
            out[v] = {"median_ms": med * 1e3, "ratio": med / base, "within_budget": med / base <= BUDGET,
                      "tensor_rows_last_step": rows,
                      "graphs_compiled": job.counter.frame_count,
                      "recompiles_after_warmup": job.counter.frame_count - frames_warm[v],
                      "losses_identical_to_compiled": job.losses == jobs["compiled"].losses}
        out["graph_breaks_total"] = sum(counters["graph_break"].values()) - breaks_before
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="measured rounds after warm-up")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"),
                    help="bf16: bfloat16 autocast (the default); fp32: autocast off (a CPU without bf16 "
                         "instructions runs bf16 matmuls tens of times slower)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--smoke", action="store_true", help="tiny model, eager backend, few steps (CI)")
    ap.add_argument("--json", dest="json_path", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    import torch
    import torch._dynamo.testing  # noqa: F401  (CompileCounterWithBackend)
    if args.threads:
        torch.set_num_threads(args.threads)
    size = SMOKE_SIZE if args.smoke else FULL_SIZE
    backend = "eager" if args.smoke else args.backend
    steps, warmup = (3, 2) if args.smoke else (args.steps, args.warmup)
    doc = {"machine": common.machine_info(), "size": size, "backend": backend, "dtype": args.dtype,
           "steps": steps, "warmup": warmup, "variants": measure(size, backend, steps, warmup, args.seed, args.dtype)}
    rows = [{"variant": v, **doc["variants"][v]} for v in VARIANTS]
    common.print_table(rows, ["variant", "median_ms", "ratio", "within_budget", "graphs_compiled",
                              "recompiles_after_warmup", "tensor_rows_last_step", "losses_identical_to_compiled"])
    floor = doc["variants"]["floor_aminmax"]
    print(f"floor: one eager aminmax over the {floor['tensors']} tensors the in-graph rows read "
          f"({floor['values']} values): {floor['ms_per_step']:.1f} ms a step, ratio {floor['ratio']:.3f}",
          file=sys.stderr)
    common.write_json(doc, args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
