"""`amp-postmortem watch` beside a running job: from a planted NaN's step
to the alert, and what watching a clean job costs.

Each round starts a job in a child process (a tiny MLP under the real
`AmpRecorder`, float16 CPU autocast and `GradScaler("cpu")`, `--pause`
seconds of sleep per step) with `amp-postmortem watch --json` beside it.
The job prints when each step has passed `rec.step()` (an upper bound on the
moment its row reaches the journal: the writer thread writes it after);
`latency_s` is the alert's `seen_at` minus that. The issue's bound is
`interval + 2` seconds. A clean job of the same length is watched to the
end: `watch_cpu_s` is the CPU time of the watch process (user + system,
from `wait4`), with its full analyses (`analyses`: one per poll would mean
it re-reads the run every step).

    python benchmarks/watch_latency.py                 # 5 rounds, interval 2 s
    python benchmarks/watch_latency.py --smoke         # 1 round, short job
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from common import REPO, machine_info, print_table, summarize

JOB = textwrap.dedent("""
    import sys, time
    import torch
    import torch.nn as nn
    from recorders import AmpRecorder

    run, steps, nan_step, pause = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    class Boom(nn.Module):
        gain = 1.0
        def forward(self, x):
            return x * self.gain

    model = nn.Sequential(nn.Linear(8, 32), Boom(), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=10 ** 6)
    rec = AmpRecorder(run, model, optimizer=opt, scaler=scaler, steps_per_shard=20)
    for step in range(steps):
        model[1].gain = 1e6 if step == nan_step else 1.0  # float16 Inf in the forward
        x, y = torch.randn(16, 8), torch.randn(16, 1)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ((model(x).float() - y) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        rec.step(loss)
        print(f"stepped {step} {time.time()}", flush=True)
        time.sleep(pause)
    rec.close()
""")


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", NO_COLOR="1")


def one_round(tmp: Path, *, steps: int, nan_step: int, pause: float, interval: float) -> dict:
    run = tmp / f"run-{nan_step}-{time.monotonic_ns()}"
    run.mkdir()
    script = tmp / "job.py"
    script.write_text(JOB)
    watch = subprocess.Popen([sys.executable, "-m", "amp_postmortem", "watch", str(run), "--json",
                              "--interval", str(interval)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=_env())
    job = subprocess.Popen([sys.executable, str(script), str(run), str(steps), str(nan_step), str(pause)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    out, err = watch.communicate(timeout=steps * pause + 300)
    job_out, job_err = (job.communicate(timeout=steps * pause + 300) if nan_step < 0 else
                        (job.kill(), job.communicate(timeout=60))[1])
    stepped = {int(w[1]): float(w[2]) for w in (l.split() for l in job_out.splitlines()) if w[:1] == ["stepped"]}
    events = [json.loads(line) for line in out.splitlines()]
    alert = next((e for e in events if e["event"] == "finding" and e["kind"] == "nonfinite"), None)
    return {"exit_code": watch.returncode, "outcome": events[-1]["outcome"] if events else None,
            "latency_s": alert["seen_at"] - stepped[nan_step] if alert and nan_step in stepped else None,
            "stderr": err.strip().splitlines()[-1:] if watch.returncode not in (0, 1) else []}


def watch_cost(tmp: Path, *, steps: int, pause: float, interval: float) -> dict:
    """A clean job watched to its close: the watch's CPU time and analyses."""
    run = tmp / "clean"
    run.mkdir()
    script = tmp / "job.py"
    script.write_text(JOB)
    # In-process watcher for the analysis count; the CLI's CPU time from a child.
    job = subprocess.Popen([sys.executable, str(script), str(run), str(steps), "-1", str(pause)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
    watch = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import json, sys
        from amp_postmortem.analyses.watch import RunWatcher, follow
        w = RunWatcher({str(run)!r})
        for e in follow(w, interval={interval}):
            pass
        print(json.dumps({{"analyses": w.analyses, "exit_code": e.exit_code}}))
    """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    started = time.monotonic()
    _, _, usage = os.wait4(watch.pid, 0)  # reaped here for its rusage: Popen never waits on it
    wall = time.monotonic() - started
    job.communicate(timeout=60)
    printed = watch.stdout.read()
    if not printed.strip():  # the watcher failed: say why rather than a JSON error
        raise RuntimeError(f"the watcher printed nothing: {watch.stderr.read().strip()[-2000:]}")
    doc = json.loads(printed)
    return {"steps": steps, "wall_s": wall, "watch_cpu_s": usage.ru_utime + usage.ru_stime,
            "polls_max": int(wall / interval) + 1, **doc}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--pause", type=float, default=0.2, help="seconds of sleep per training step")
    ap.add_argument("--steps", type=int, default=150, help="steps of the clean job")
    ap.add_argument("--smoke", action="store_true", help="1 round, a short clean job")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps, args.interval, args.pause = 1, 6, 1.0, 0.05
    with tempfile.TemporaryDirectory(prefix="amp-pm-watch-") as tmp:
        rounds = [one_round(Path(tmp), steps=200, nan_step=8 + 3 * i, pause=args.pause, interval=args.interval)
                  for i in range(args.rounds)]
        cost = watch_cost(Path(tmp), steps=args.steps, pause=args.pause, interval=args.interval)
    latencies = [r["latency_s"] for r in rounds if r["latency_s"] is not None]
    doc = {"machine": machine_info(), "interval_s": args.interval, "pause_s": args.pause, "rounds": rounds,
           "latency_s": summarize(latencies) if latencies else None, "bound_s": args.interval + 2, "clean": cost}
    print_table([{"round": i, "exit": r["exit_code"], "latency_s": r["latency_s"]} for i, r in enumerate(rounds)],
                ["round", "exit", "latency_s"])
    print_table([cost], ["steps", "wall_s", "watch_cpu_s", "analyses", "polls_max", "exit_code"])
    text = json.dumps(doc, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
