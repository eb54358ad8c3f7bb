"""Where the default recorder's facts-only step goes beyond the design's
floor, in about a minute a job: the launch-bound proxy (or another job of
`sentinel_cost.py`) trained as plain, `floor`, `facts_floor` and the
default with parts of it turned off, interleaved in one process.

`sentinel_cost.py` judges the targets (every kind of step, 15 copies of a
model, ~12 minutes); this one answers the question its result leaves: is a
cost the design's or the product's way of doing the work? Every variant
takes facts-only steps (`RecordSchedule(cheap_every=10**9, full_every=0)`:
no sampled tier, and no re-execution on a job without events), `--copies`
copies each (3), made in a shuffled order, stepped once a round in a
shuffled order; a variant's figure is the median over rounds of its mean
step's ratio to plain's in the same round (paired). Each recorder runs on a
lone job's clock (`sentinel_cost.lone_job_clock`).

`--segments` splits each step as `sentinel_cost.SEGMENTS` (the forward
with the loss, the backward, the optimizer's step, `zero_grad()` with
`rec.step()`) and prints each part's paired excess over plain's, in
microseconds: which hooks a variant's distance is in.

Variants (`--variants`, comma-separated; plain always first):
- `plain`, `floor` (`sentinel_floor.FloorSentinel`), `facts_floor`
  (`sentinel_floor.FactsFloor`: the floor plus the loss tap, the event
  rules, the learning rate and rows handed to a writer thread, compactly);
- `default` (`AmpRecorder` as shipped), and `default-` followed by parts
  turned off, joined by `-`: `bundles` (`bundles=False`: no held state,
  hence no re-execution), `reexecute` (`reexecute=False`), `loss_tap`
  (`capture_loss=False`), `writer` (the step rows never handed to the
  writer thread), e.g. `default-bundles-loss_tap`.

    python benchmarks/sentinel_parts.py                          # launch-bound, ~1 min on 2 cores
    python benchmarks/sentinel_parts.py --segments --variants plain,floor,facts_floor,default
                                          # and where each variant's excess lies in the step
    python benchmarks/sentinel_parts.py --job diverging --variants plain,floor,facts_floor,default
    python benchmarks/sentinel_parts.py --smoke                  # seconds; CI keeps it working
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info, median, print_table, write_json  # noqa: E402
from sentinel_cost import JOBS, SEGMENTS, _job, _Runner  # noqa: E402

DEFAULT_VARIANTS = "plain,floor,facts_floor,default,default-bundles-reexecute-loss_tap-writer"
PARTS = {"bundles": {"bundles": False}, "reexecute": {"reexecute": False}, "loss_tap": {"capture_loss": False}}


def _variant(name: str, template, make_opt, dtype, scaler, loss_fn, run_dir, diverging, interleaved: int = 1):
    from recorders.schedule import RecordSchedule
    base, *off = name.split("-")
    unknown = [p for p in off if p not in PARTS and p != "writer"]
    if base not in ("plain", "floor", "facts_floor", "default") or (off and base != "default") or unknown:
        raise SystemExit(f"sentinel_parts: unknown variant {name!r}")
    options = {"schedule": RecordSchedule(cheap_every=10**9, full_every=0)}
    for part in off:
        options.update(PARTS.get(part, {}))
    runner = _Runner(base, template, make_opt, dtype, scaler, loss_fn, run_dir, diverging,
                     options=options if base == "default" else None, interleaved=interleaved)
    if "writer" in off:
        # Both ways a step reaches the writer (`QuietStep` queues the usual one).
        runner.rec.run_writer.submit_step = runner.rec.run_writer.queue_step = lambda pending, clean: None
    return runner


def measure(job: str, variants: list[str], *, rounds: int, warmup: int, copies: int, smoke: bool,
            seed: int = 0) -> dict:
    template, make_opt, dtype, scaler, (x, y), loss_fn = _job(job, smoke)
    rng = random.Random(seed)
    made = [v for v in variants for _ in range(copies)]
    rng.shuffle(made)
    runners: dict[str, list] = {v: [] for v in variants}
    per_round, seg_rounds = [], []
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for v in made:
            runners[v].append(_variant(v, template, make_opt, dtype, scaler, loss_fn,
                                       Path(tmp) / f"{v}{len(runners[v])}", job == "diverging", len(made)))
        order = [(v, c) for v in variants for c in range(copies)]
        for r in range(warmup + rounds):
            rng.shuffle(order)
            times = dict.fromkeys(variants, 0.0)
            segs = {v: [0.0] * len(SEGMENTS) for v in variants}
            for v, c in order:
                runner = runners[v][c]
                times[v] += runner.step(x, y) / copies
                for i, t in enumerate(runner.segments[-1]):
                    segs[v][i] += t / copies
            if r >= warmup:
                per_round.append(times)
                seg_rounds.append(segs)
        for rs in runners.values():
            for runner in rs:
                runner.close()
    # Each part's excess over plain's in the same round (paired), median
    # over rounds, in microseconds: where a variant's distance lies.
    return {"job": job, "rounds": rounds, "copies": copies, "segments": list(SEGMENTS), "variants": {
        v: {"median_ms": median([t[v] for t in per_round]) * 1e3,
            "paired": median([t[v] / t["plain"] for t in per_round]),
            "segments_us": {name: median([(s[v][i] - s["plain"][i]) * 1e6 for s in seg_rounds])
                            for i, name in enumerate(SEGMENTS)}} for v in variants}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", default="launch", choices=JOBS)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--segments", action="store_true",
                    help="also each part of the step's excess over plain's (us): forward, backward, optimizer, "
                         "step end")
    ap.add_argument("--smoke", action="store_true", help="tiny model, a few rounds: checks that it runs")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)
    variants = ["plain"] + [v for v in args.variants.split(",") if v and v != "plain"]
    rounds, warmup, copies = (4, 2, 1) if args.smoke else (args.rounds, args.warmup, args.copies)
    res = measure(args.job, variants, rounds=rounds, warmup=warmup, copies=copies, smoke=args.smoke)
    machine = machine_info()
    print(f"# {args.job}: {rounds} rounds, {copies} copies a variant; {machine.get('cpu_model')}, "
          f"load {machine.get('loadavg_1m')}", file=sys.stderr)
    columns = ["variant", "median ms", "paired ratio to plain"]
    if args.segments:
        columns += [f"{name} +us" for name in SEGMENTS]
    print_table([{"variant": v, "median ms": r["median_ms"], "paired ratio to plain": r["paired"],
                  **{f"{name} +us": r["segments_us"][name] for name in SEGMENTS}}
                 for v, r in res["variants"].items()], columns)
    write_json({"machine": machine, "result": res}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
