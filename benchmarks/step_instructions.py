"""The training thread's instructions per step, plain against the floor and
the default recorder, counted by valgrind's callgrind: a figure no noisy
neighbour moves, for what timing cannot resolve.

`sentinel_cost.py` and `sentinel_parts.py` time interleaved copies; on a
shared 2-core machine their figures move by a point or more from run to run,
and by up to a point and a half with where a copy lands in memory (a
recorder built and then left without hooks timed 0.985 of plain,
2026-12-07). A change to the facts-only step worth half a point cannot be
seen there. Instructions can: each variant runs in its own process under
callgrind, instrumentation off until its warm-up is done, on for `--steps`
facts-only steps of the job (`sentinel_cost._Runner`, one copy, one
intra-op thread: torch's worker thread spins between parallel regions, and
callgrind would count its spinning), then off again. The figure is the
main thread's instructions per step (the writer's and other threads'
beside it); the ratio is to plain's in the same run.

What it does not see: cache misses and branch mispredictions on the real
CPU, which is why a step's time grows by more than its instructions (the
floor: +1.7% instructions, +3.4% time, 2026-12-07). It is a diagnostic
beside the timed benchmarks, not a target.

    python benchmarks/step_instructions.py                 # ~5 min: plain, floor, default
    python benchmarks/step_instructions.py --variants plain,default --steps 10
    python benchmarks/step_instructions.py --smoke         # no valgrind: the child loop runs
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info, print_table, write_json  # noqa: E402

VARIANTS = ("plain", "floor", "default")
WARMUP = 30


def child(variant: str, steps: int, job: str, gate: Path | None, smoke: bool) -> None:
    """Train one copy of `job`; between its warm-up and its measured steps,
    and after them, wait for the parent (`gate`: files it creates)."""
    import torch
    from recorders.schedule import RecordSchedule
    from sentinel_cost import _job, _Runner
    torch.set_num_threads(1)
    model, make_opt, dtype, scaler, (x, y), loss_fn = _job(job, smoke)
    options = {"schedule": RecordSchedule(cheap_every=10**9, full_every=0)} if variant == "default" else None
    run = _Runner(variant, model, make_opt, dtype, scaler, loss_fn, tempfile.mkdtemp(prefix="instr-"),
                  job == "diverging", options=options)
    for _ in range(2 if smoke else WARMUP):
        run.step(x, y)
    _handshake(gate, "ready", "go")
    for _ in range(steps):
        run.step(x, y)
    _handshake(gate, "done", "stop")
    run.close()


def _handshake(gate: Path | None, say: str, wait_for: str) -> None:
    if gate is None:
        return
    (gate / say).touch()
    while not (gate / wait_for).exists():
        time.sleep(0.05)


def _wait_for(path: Path, proc, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise SystemExit(f"step_instructions: the child exited ({proc.returncode}) before {path.name}")
        if time.monotonic() > end:
            proc.kill()
            raise SystemExit(f"step_instructions: no {path.name} from the child in {timeout:.0f} s")
        time.sleep(0.1)


def _totals(path: Path) -> int:
    """A callgrind output file's instruction total."""
    text = path.read_text(errors="replace")
    found = re.findall(r"^(?:totals|summary):\s*(\d+)", text, re.M)
    return max(map(int, found)) if found else 0


def measure(variant: str, steps: int, job: str, out_dir: Path) -> dict:
    gate = Path(tempfile.mkdtemp(prefix="gate-", dir=out_dir))
    out = out_dir / f"callgrind.{variant}.out"
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
           f"--callgrind-out-file={out}", sys.executable, __file__, "--child", variant, "--job", job,
           "--steps", str(steps), "--gate", str(gate)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for(gate / "ready", proc, 600)
    subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
    (gate / "go").touch()
    _wait_for(gate / "done", proc, 600)
    subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], check=True, capture_output=True)
    (gate / "stop").touch()
    proc.wait(timeout=600)
    # One file per thread, `-01` the main (training) thread.
    threads = {int(p.name.rsplit("-", 1)[1]): _totals(p) for p in out_dir.glob(f"callgrind.{variant}.out-*")}
    main = threads.pop(1, 0)
    return {"main_per_step": main / steps, "other_threads_per_step": sum(threads.values()) / steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--job", default="launch", choices=("launch", "mlp", "resnet", "diverging"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--smoke", action="store_true", help="no valgrind: each variant's child loop, 2 steps")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--gate", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.steps, args.job, Path(args.gate) if args.gate else None, smoke=False)
        return 0
    variants = ["plain"] + [v for v in args.variants.split(",") if v and v != "plain"]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"step_instructions: unknown variant(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    if args.smoke:
        for v in variants:
            child(v, 2, args.job, None, smoke=True)
        print("smoke: every variant's loop ran")
        return 0
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("step_instructions: needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    out_dir = Path(tempfile.mkdtemp(prefix="step-instructions-"))
    res = {v: measure(v, args.steps, args.job, out_dir) for v in variants}
    base = res["plain"]["main_per_step"]
    for r in res.values():
        r["ratio"] = r["main_per_step"] / base if base else float("nan")
    machine = machine_info()
    print(f"# {args.job}: {args.steps} facts-only steps after {WARMUP}; main thread's instructions; "
          f"{machine.get('cpu_model')}", file=sys.stderr)
    print_table([{"variant": v, "M instructions/step": round(r["main_per_step"] / 1e6, 3),
                  "ratio to plain": round(r["ratio"], 4),
                  "other threads M/step": round(r["other_threads_per_step"] / 1e6, 3)} for v, r in res.items()],
                ["variant", "M instructions/step", "ratio to plain", "other threads M/step"])
    write_json({"machine": machine, "job": args.job, "steps": args.steps, "result": res}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
