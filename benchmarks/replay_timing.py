"""Replay cost: one recorded step of the sample language model replayed in
four precisions (fp64 reference, fp32, fp16, bf16), as a multiple of one
training step of the same model.

The step is a bundle of `sample_runs/attention_overflow` (the failing step 79
by default), the model `sample_runs/models.py:attention_overflow_gpt`. The
training step is what the run did: fp16 CPU autocast, `GradScaler("cpu")`,
Adam, batch 16 of the copy task, forward + backward + optimizer step; median
over `--train-steps` steps after warm-up. The replay is timed with and
without the per-module local replays (`local=True` is what
`amp-postmortem replay` does by default); median over `--repeats`.

    python benchmarks/replay_timing.py
    python benchmarks/replay_timing.py --smoke     # no local replays, one repeat
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

RUN = common.REPO / "sample_runs" / "attention_overflow"
MODEL = str(common.REPO / "sample_runs" / "models.py") + ":attention_overflow_gpt"


def train_step_times(steps: int, warmup: int) -> list[float]:
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, str(common.REPO / "sample_runs"))
    import models
    torch.manual_seed(0)
    model = models.attention_overflow_gpt()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", growth_interval=20)
    g = torch.Generator().manual_seed(0)
    times = []
    for i in range(warmup + steps):
        idx = torch.randint(0, models.VOCAB, (16, models.BLOCK + 1), generator=g)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(idx[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, models.VOCAB), idx[:, 1:].reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def replay_times(step: int, repeats: int, local: bool) -> list[float]:
    from amp_postmortem.replaying import replay
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        replay(RUN, step=step, model=MODEL, precisions=("fp64", "fp32", "fp16", "bf16"), local=local)
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step", type=int, default=79)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--train-steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.repeats, args.train_steps, args.warmup = 1, 3, 1
    import torch
    result = {"benchmark": "replay_timing", "machine": common.machine_info(),
              "torch_threads": torch.get_num_threads(),
              "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "run": str(RUN.relative_to(common.REPO)), "step": args.step, "model": "attention_overflow_gpt"}
    train = common.summarize(train_step_times(args.train_steps, args.warmup))
    result["train_step_s"] = train["median"]
    rows = [{"what": "training step (fp16 autocast + GradScaler)", "median_ms": 1e3 * train["median"],
             "x_train_step": 1.0}]
    for local in ((False,) if args.smoke else (False, True)):
        if not args.smoke:  # one untimed replay first: imports, the bundle's first load
            replay_times(args.step, 1, local)
        r = common.summarize(replay_times(args.step, args.repeats, local))
        key = "replay_local" if local else "replay"
        result[f"{key}_s"] = r["median"]
        result[f"{key}_x_train_step"] = r["median"] / train["median"]
        rows.append({"what": "replay fp64+fp32+fp16+bf16" + (", every module alone too" if local else ""),
                     "median_ms": 1e3 * r["median"], "x_train_step": r["median"] / train["median"]})
    common.print_table(rows, ["what", "median_ms", "x_train_step"])
    common.write_json(result, args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
