"""Analyzer at scale: `nans`, `scale`, `ranges`, `summary` on a large run.

Writes a synthetic run with the real `recorders.writer.ShardWriter` (the
recorder's own shard layout, footers and row groups): by default 100,000
steps x 1,000 watched tensors = 10^8 tensor rows, 1,000 steps per shard
(the recorder's default), full tier every 100 steps. The run holds:

- a healthy phase at loss scale 2^16 with `--growth-interval` (default
  1,000,000: the scale never grows, so no step overflows before the
  collapse: non-finite rows only late, as the issue asks). With 2,000 (the
  GradScaler default) each growth is answered by an overflow on the next
  step, the probe a real fp16 run makes at its equilibrium: a skipped step
  with Inf in its backward rows every 2,001 steps, in about half the shards;
- a late collapse from `--collapse-at` (default 90% of the run): a skipped
  step every 600 steps, never 2,000 clean steps in a row, so the scale
  halves about 1.7 times per 1,000 steps; each skipped step has Inf in the
  backward rows of a few "driver" layers;
- one late non-finite value: a NaN in the output of one module at
  `--nan-at` (default 99.5% of the run), its inputs finite (a forward origin).

Then it runs each CLI command in a child process (wall time and that
child's peak RSS, from `wait4`), times each analysis function in a child
(load, analysis, shards opened), and a naive baseline that reads the tensors
table into pandas (on the first `--naive-shards` shards: the whole table
does not fit in memory; the figure is scaled to the run and marked so).

    python benchmarks/analyzer_scale.py --run-dir /tmp/amp-pm-scale   # full size
    python benchmarks/analyzer_scale.py --steps 20000 --tensors 500    # smaller
    python benchmarks/analyzer_scale.py --smoke                        # seconds (CI)

Generation time is reported but is not the benchmark; an existing run of
the same size is reused unless `--regenerate`.

`--memory` measures instead the peak RSS of `ranges` and `summary` (CLI in a
child) on two runs of the same row count: a wide one (`--wide`, default
2,000 tensors x 1,000 steps: one shard of 2M rows) and a long one
(`--long`, default 10 tensors x 200,000 steps), and prints each peak and
the wide/long ratio: memory bounded by the shard, not by modules x steps,
keeps the wide run under `MEMORY_TARGET_MIB`.

    python benchmarks/analyzer_scale.py --memory --run-dir /tmp/amp-pm-mem --keep
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from recorders.format import schema  # noqa: E402
from recorders.writer import ShardWriter, atomic_write_json  # noqa: E402

COMMANDS = ("nans", "scale", "ranges", "summary")
MEMORY_COMMANDS = ("ranges", "summary")
MEMORY_TARGET_MIB = 500  # issue 28: ranges and summary on 2,000 modules x 1,000 steps
_PARTS = ("ln1", "attn.qkv", "attn.proj", "ln2", "mlp.fc")
_KIND_PHASE = (("activation", "forward"), ("grad_output", "backward"),
               ("grad_input", "backward"), ("param_grad", "backward"))


# ---------------------------------------------------------------- the run
class Layout:
    """The watched tensors of one step: `rows` rows, in the recorder's
    execution order (forward, then backward in reverse module order)."""

    def __init__(self, rows: int):
        modules = max(1, math.ceil((rows - 1) / 4))
        self.modules = [f"blocks.{i // len(_PARTS)}.{_PARTS[i % len(_PARTS)]}" for i in range(modules)]
        names, kinds, phases, orders = ["<loss>"], ["loss"], ["forward"], [modules]
        for i, m in enumerate(self.modules):
            names.append(m), kinds.append("activation"), phases.append("forward"), orders.append(i)
        bwd = 0
        for m in reversed(self.modules):
            for kind, name in (("grad_output", m), ("grad_input", m), ("param_grad", m + ".weight")):
                names.append(name), kinds.append(kind), phases.append("backward"), orders.append(bwd)
                bwd += 1
        self.names, self.kinds, self.phases = names[:rows], kinds[:rows], phases[:rows]
        self.order = np.asarray(orders[:rows], dtype=np.int32)
        self.rows = rows
        rng = np.random.default_rng(0)
        self.numel = rng.choice([65536, 262144, 1048576], size=rows).astype(np.int64)
        kinds_a = np.asarray(self.kinds)
        self.is_grad = np.isin(kinds_a, ["grad_output", "grad_input"])
        self.is_act = kinds_a == "activation"
        self.is_param_grad = kinds_a == "param_grad"
        # Typical magnitudes: activations O(1..100), gradients O(1e-4..1e-2)
        # before scaling.
        self.base = np.where(self.is_act, 10 ** rng.uniform(0, 2, rows),
                             10 ** rng.uniform(-4, -2, rows))
        self.base[0] = 3.0  # the loss
        self.driver_rows = np.flatnonzero(self.is_grad)[:6]  # the last layers' gradients overflow first
        self.nan_row = int(np.flatnonzero(self.is_act)[len(self.modules) * 3 // 4])


def no_probe_columns(rows: int) -> dict:
    """The op probe's columns, null on module rows, as the recorder writes
    them when no probe ran (schema 1.2)."""
    return {"op": [None] * rows, "op_index": np.full(rows, np.nan), "source": [None] * rows}


def full_tier_columns(layout: Layout, absmax, full) -> dict:
    """The full-tier statistics columns of steps x rows `absmax` (null
    where `full` is False), flattened as a shard stores them."""
    nanf = np.full(absmax.shape, np.nan)
    return {
        "min": np.where(full, -absmax, nanf).ravel(),
        "max": np.where(full, absmax, nanf).ravel(),
        "mean": np.where(full, absmax * 1e-3, nanf).ravel(),
        "rms": np.where(full, absmax * 0.2, nanf).ravel(),
        "zero_share": np.where(full, 0.01, nanf).ravel(),
        "below_normal_share": np.where(full, 0.002, nanf).ravel(),
        "below_subnormal_share": np.where(full, 0.0, nanf).ravel(),
        "near_overflow_share": np.where(full, 0.0, nanf).ravel(),
        # The recorder counts shares on at most schema.SHARE_SAMPLE_MAX values per tensor.
        "share_sample_size": np.where(full, np.minimum(layout.numel, schema.SHARE_SAMPLE_MAX)[None, :],
                                      nanf).ravel(),
    }


def scale_series(steps: int, collapse_at: int, growth_interval: int):
    """Loss scale before/after each step, growth tracker and skipped flags,
    as GradScaler would produce them: growth after `growth_interval` clean
    steps, which the next step answers with an overflow (the probe a
    healthy fp16 run makes at its equilibrium scale); from `collapse_at`,
    an overflow every 600 steps, so the scale never grows again."""
    scale = 2.0 ** 16
    tracker = 0
    grew = False
    before = np.empty(steps)
    after = np.empty(steps)
    trackers = np.empty(steps, dtype=np.int64)
    skipped = np.zeros(steps, dtype=bool)
    for s in range(steps):
        before[s] = scale
        overflow = (s - collapse_at) % 600 == 0 if s >= collapse_at else grew
        grew = False
        if overflow:
            skipped[s] = True
            scale *= 0.5
            tracker = 0
        else:
            tracker += 1
            if tracker == growth_interval:
                scale *= 2.0
                tracker = 0
                grew = True
        after[s] = scale
        trackers[s] = tracker
    return before, after, trackers, skipped


def _manifest(run_id: str, layout: Layout, steps: int, steps_per_shard: int, growth_interval: int) -> dict:
    return {
        "format": schema.FORMAT_NAME, "schema_version": schema.SCHEMA_VERSION, "run_id": run_id,
        "created_at": time.time(), "package_version": "synthetic", "torch_version": "synthetic",
        "rank": 0, "world_size": 1, "device_type": "cuda", "device_name": "synthetic",
        "model_class": "benchmarks.analyzer_scale.Synthetic",
        "autocast": {"enabled": True, "device_type": "cuda", "dtype": "float16", "cache_enabled": True},
        "scaler": {"class": "torch.amp.grad_scaler.GradScaler", "enabled": True, "init_scale": 65536.0,
                   "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": growth_interval},
        "optimizer": None,
        "recorder": {"include": ["*"], "exclude": [], "cheap_every": 1, "full_every": 100,
                     "full_after_event": 0, "steps_per_shard": steps_per_shard,
                     "near_overflow": schema.FP16_MAX, "bundles": {"bundles": False}},
        "modules": [{"name": "", "type": "Synthetic", "watched": True}]
        + [{"name": m, "type": "torch.nn.Linear", "watched": True} for m in layout.modules],
        "params": [{"name": m + ".weight", "shape": [256, 256], "dtype": "float32", "requires_grad": True}
                   for m in layout.modules],
        "bundles": [], "status": "closed", "steps_recorded": steps, "first_step": 0,
        "last_step": steps - 1, "dropped_steps": 0, "disabled_reason": None,
    }


def generate(run_dir: Path, *, steps: int, rows: int, steps_per_shard: int, full_every: int,
             collapse_at: int, nan_at: int, growth_interval: int) -> dict:
    """Write the run through the real ShardWriter, one shard's rows per
    vectorised batch (the writer's column dicts), and return its facts."""
    t0 = time.perf_counter()
    if run_dir.exists():
        shutil.rmtree(run_dir)
    layout = Layout(rows)
    run_id = f"synthetic-{steps}x{rows}"
    rank_dir = run_dir / schema.RANK_DIR.format(rank=0)
    writer = ShardWriter(rank_dir, run_id=run_id, rank=0, world_size=1,
                         steps_per_shard=steps_per_shard)
    before, after, trackers, skipped = scale_series(steps, collapse_at, growth_interval)
    rng = np.random.default_rng(1)
    n = rows
    for first in range(0, steps, steps_per_shard):
        idx = np.arange(first, min(steps, first + steps_per_shard))
        k = len(idx)
        step_col = np.repeat(idx.astype(np.int64), n)
        # absmax: per-layer base, slow drift, noise; gradients carry the scale.
        drift = 1.0 + 0.2 * np.sin(idx / 5000.0)[:, None]
        noise = rng.lognormal(0.0, 0.05, size=(k, n))
        absmax = layout.base[None, :] * drift * noise
        absmax = np.where(layout.is_grad[None, :], absmax * before[idx][:, None], absmax)
        absmax = absmax.astype(np.float16).astype(np.float64)  # float16 values, as recorded
        nan_count = np.zeros((k, n), dtype=np.int64)
        inf_count = np.zeros((k, n), dtype=np.int64)
        for j, s in enumerate(idx):
            if skipped[s]:
                inf_count[j, layout.driver_rows] = 7
            if s == nan_at:
                nan_count[j, layout.nan_row] = 1
        inp = np.where(layout.is_act | layout.is_grad, 0.0, np.nan)
        input_nonfinite = np.broadcast_to(inp, (k, n)).copy()
        # grad_input rows: NaN/Inf in the gradient the module received.
        input_nonfinite[:, layout.is_grad] = 0.0
        full = (idx % full_every == 0)[:, None] & np.ones((1, n), dtype=bool)
        cols = {
            "step": step_col,
            "rank": np.zeros(k * n, dtype=np.int32),
            "name": layout.names * k,
            "kind": layout.kinds * k,
            "phase": layout.phases * k,
            "order": np.tile(layout.order, k),
            "call": np.zeros(k * n, dtype=np.int32),
            "dtype": ["float16"] * (k * n),
            "numel": np.tile(layout.numel, k),
            "absmax": absmax.ravel(),
            "nan_count": nan_count.ravel(),
            "inf_count": inf_count.ravel(),
            "input_nonfinite": input_nonfinite.ravel(),
            **full_tier_columns(layout, absmax, full),
            **no_probe_columns(k * n),
        }
        for j, s in enumerate(idx):
            step_row = {
                "step": int(s), "rank": 0, "wall_time": 1.7e9 + 0.5 * s,
                "loss": float("nan") if s == nan_at else 3.0 * math.exp(-s / 50000) + 0.01 * math.sin(s),
                "loss_scale": float(after[s]), "loss_scale_before": float(before[s]),
                "growth_tracker": int(trackers[s]), "skipped": bool(skipped[s]) or s == nan_at,
                "lr": [1e-4], "grad_norm": None if skipped[s] else 0.5,
                "nonfinite_param_grads": 0, "micro_batches": 1,
                "tier": "full" if s % full_every == 0 else "cheap", "tensor_rows": n, "loss_dtype": "float32",
            }
            # The writer rolls after the shard's last step: hand it the
            # shard's tensor rows with that step (same rows, same order).
            writer.add_step(step_row, cols if j == k - 1 else None)
    writer.roll()
    manifest = _manifest(run_id, layout, steps, steps_per_shard, growth_interval)
    atomic_write_json(rank_dir / schema.MANIFEST_FILE, manifest)
    atomic_write_json(run_dir / schema.MANIFEST_FILE, manifest)
    size = sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file())
    facts = {"steps": steps, "tensors_per_step": rows, "tensor_rows": steps * rows,
             "steps_per_shard": steps_per_shard, "shards": writer.shards_written,
             "full_every": full_every, "collapse_at": collapse_at, "nan_at": nan_at,
             "nan_layer": layout.names[layout.nan_row], "growth_interval": growth_interval,
             "skipped_steps": int(skipped.sum()) + 1,
             "shards_with_nonfinite": len({int(s) // steps_per_shard for s in np.flatnonzero(skipped)} | {nan_at // steps_per_shard}),
             "disk_mib": round(size / 2**20, 1), "generate_s": round(time.perf_counter() - t0, 1)}
    (run_dir / "synthetic.json").write_text(json.dumps(facts, indent=2))
    return facts


# ------------------------------------------------------------- measuring
def run_measured(cmd: list[str], timeout: float | None = None) -> dict:
    """Run a child; its wall time, exit code, peak RSS and output. Peak RSS:
    the VMHWM_KIB line the child writes to stderr, else wait4's ru_maxrss
    (an upper bound: it includes this process's peak from before the exec)."""
    t0 = time.perf_counter()
    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=common.REPO)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    out.seek(0), err.seek(0)
    stderr = err.read().decode(errors="replace")
    peak = usage.ru_maxrss / 1024
    for line in stderr.splitlines():
        if line.startswith("VMHWM_KIB "):
            peak = int(line.split()[1]) / 1024
    return {"wall_s": round(wall, 3), "rc": proc.returncode, "peak_rss_mib": round(peak, 1),
            "stdout": out.read().decode(errors="replace"), "stderr": stderr}


def run_cli_in_process(command: str, run_dir: Path) -> dict:
    """The CLI through click's test runner (smoke runs: no interpreter start;
    peak RSS is this process's)."""
    from click.testing import CliRunner
    from amp_postmortem.cli import main as cli_main
    t0 = time.perf_counter()
    r = CliRunner().invoke(cli_main, [command, str(run_dir), "--json"])
    return {"wall_s": round(time.perf_counter() - t0, 3), "rc": r.exit_code,
            "peak_rss_mib": round(common.peak_rss_mib(), 1), "stdout": r.stdout,
            "stderr": r.stderr if r.exit_code else ""}


# The CLI's entry point, with its own peak RSS (VmHWM) written to stderr at
# exit: wait4's ru_maxrss would also count this (forking) process's peak.
_CLI = ("import atexit, sys\n"
        "def _hwm():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('VmHWM:'):\n"
        "            sys.stderr.write('\\nVMHWM_KIB ' + line.split()[1] + '\\n')\n"
        "atexit.register(_hwm)\n"
        "sys.argv[0] = 'amp-postmortem'\n"
        "from amp_postmortem.cli import main\n"
        "main()\n")


def cli(command: str) -> list[str]:
    return [sys.executable, "-c", _CLI, command]


def functions_child(run_dir: str) -> dict:
    """In a child: time load_run and each analysis function, count the
    tensor shards each one opened."""
    t0 = time.perf_counter()
    from amp_postmortem import analyses
    from amp_postmortem.reading.loader import load_run
    out = {"import_s": round(time.perf_counter() - t0, 3)}
    t0 = time.perf_counter()
    run = load_run(run_dir)
    out["load_run_s"] = round(time.perf_counter() - t0, 3)
    out["tensor_shards"] = len(run.tensor_shards)
    for name, fn in (("nans", analyses.find_nans), ("scale", analyses.scale_dynamics),
                     ("ranges", analyses.layer_ranges), ("summary", analyses.summarize)):
        run.scanned_files.clear()
        t0 = time.perf_counter()
        fn(run)
        out[f"{name}_s"] = round(time.perf_counter() - t0, 3)
        out[f"{name}_shards_opened"] = len(run.scanned_files)
    out["peak_rss_mib"] = round(common.peak_rss_mib(), 1)
    return out


def naive_child(run_dir: str, shards: int) -> dict:
    """The naive way: every column of the tensors table into pandas, then
    the first non-finite row per layer and the skipped steps' rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    files = sorted((Path(run_dir) / "rank=0" / schema.TENSORS_DIR).glob("part-*.parquet"))
    t0 = time.perf_counter()
    df = pa.concat_tables([pq.read_table(f) for f in (files[:shards] if shards else files)]).to_pandas()
    read_s = time.perf_counter() - t0
    bad = df[(df["nan_count"] > 0) | (df["inf_count"] > 0)]
    first = bad.sort_values(["step", "phase", "order"]).drop_duplicates(["name", "kind"])
    total_s = time.perf_counter() - t0
    return {"rows": len(df), "files": len(files[:shards] if shards else files), "read_s": round(read_s, 3),
            "nans_s": round(total_s, 3), "layers_found": len(first),
            "peak_rss_mib": round(common.peak_rss_mib(), 1)}


def _shape(text: str) -> tuple[int, int]:
    """TENSORSxSTEPS, e.g. 2000x1000."""
    tensors, _, steps = text.lower().partition("x")
    return int(tensors), int(steps)


def memory(args) -> dict:
    """Peak RSS of `ranges` and `summary` on the wide and the long run."""
    base = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="amp-pm-mem-"))
    result = {"benchmark": "analyzer_scale --memory", "machine": common.machine_info(),
              "target_peak_rss_mib": MEMORY_TARGET_MIB, "runs": {}}
    table = []
    for label, shape in (("wide", args.wide), ("long", args.long)):
        tensors, steps = _shape(shape)
        run_dir = base / label
        facts_file = run_dir / "synthetic.json"
        params = dict(steps=steps, rows=tensors, steps_per_shard=args.steps_per_shard,
                      full_every=args.full_every, collapse_at=int(steps * 0.9), nan_at=int(steps * 0.995),
                      growth_interval=args.growth_interval)
        facts = json.loads(facts_file.read_text()) if facts_file.exists() and not args.regenerate else None
        if facts is None or (facts["steps"], facts["tensors_per_step"]) != (steps, tensors) \
                or facts["steps_per_shard"] != args.steps_per_shard:
            facts = generate(run_dir, **params)
        entry = {"tensors_per_step": tensors, "steps": steps, "tensor_rows": facts["tensor_rows"],
                 "shards": facts["shards"]}
        for command in MEMORY_COMMANDS:
            r = run_cli_in_process(command, run_dir) if args.in_process else \
                run_measured(cli(command) + [str(run_dir), "--json"])
            if r["rc"] != 0:
                raise RuntimeError(f"amp-postmortem {command} failed ({r['rc']}): {r['stderr'][-2000:]}")
            json.loads(r["stdout"])  # the answer is JSON
            entry[command] = {"wall_s": r["wall_s"], "peak_rss_mib": r["peak_rss_mib"]}
            table.append({"what": f"{command} {label} ({tensors} x {steps})", "wall_s": r["wall_s"],
                          "peak_rss_mib": r["peak_rss_mib"]})
        result["runs"][label] = entry
    for command in MEMORY_COMMANDS:
        wide, long = (result["runs"][k][command]["peak_rss_mib"] for k in ("wide", "long"))
        result[f"{command}_wide_over_long"] = round(wide / long, 2)
        result[f"{command}_within_target"] = wide < MEMORY_TARGET_MIB
        table.append({"what": f"{command} wide/long", "wall_s": "", "peak_rss_mib": f"x{wide / long:.2f}"})
    common.print_table(table, ["what", "wall_s", "peak_rss_mib"])
    if not args.run_dir and not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", default=None, help="where the synthetic run goes (default: a folder in /tmp)")
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--tensors", type=int, default=1_000, help="watched tensor rows per step")
    ap.add_argument("--steps-per-shard", type=int, default=1_000)
    ap.add_argument("--full-every", type=int, default=100)
    ap.add_argument("--collapse-at", type=int, default=None, help="default: 90%% of the steps")
    ap.add_argument("--nan-at", type=int, default=None, help="default: 99.5%% of the steps")
    ap.add_argument("--growth-interval", type=int, default=1_000_000,
                    help="scaler growth interval; 2000: a growth probe overflows every 2001 steps")
    ap.add_argument("--naive-shards", type=int, default=10,
                    help="shards the naive pandas baseline reads (0: all; scaled to the run)")
    ap.add_argument("--regenerate", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the run directory afterwards")
    ap.add_argument("--generate-only", action="store_true", help="write the run and stop")
    ap.add_argument("--smoke", action="store_true", help="tiny run (CI); implies --in-process")
    ap.add_argument("--in-process", action="store_true",
                    help="run the CLI and the analyses in this process (no child processes)")
    ap.add_argument("--memory", action="store_true",
                    help="peak RSS of ranges and summary on a wide and a long run of as many rows")
    ap.add_argument("--wide", default="2000x1000", help="--memory: the wide run, TENSORSxSTEPS")
    ap.add_argument("--long", default="10x200000", help="--memory: the long run, TENSORSxSTEPS")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--functions-child", help=argparse.SUPPRESS)
    ap.add_argument("--naive-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.functions_child:
        common.write_json(functions_child(args.functions_child), None)
        return 0
    if args.naive_child:
        common.write_json(naive_child(args.naive_child, args.naive_shards), None)
        return 0
    if args.smoke:
        args.steps, args.tensors, args.steps_per_shard, args.full_every = 400, 41, 100, 20
        args.naive_shards, args.in_process = 0, True
        args.wide, args.long = "200x40", "10x800"
    if args.memory:
        common.write_json(memory(args), args.json_path)
        return 0
    collapse_at = args.collapse_at if args.collapse_at is not None else int(args.steps * 0.9)
    nan_at = args.nan_at if args.nan_at is not None else int(args.steps * 0.995)
    tmp = None
    if args.run_dir:
        run_dir = Path(args.run_dir)
    else:
        tmp = tempfile.mkdtemp(prefix="amp-pm-scale-")
        run_dir = Path(tmp) / "run"

    params = dict(steps=args.steps, rows=args.tensors, steps_per_shard=args.steps_per_shard,
                  full_every=args.full_every, collapse_at=collapse_at, nan_at=nan_at,
                  growth_interval=args.growth_interval)
    facts_file = run_dir / "synthetic.json"
    facts = None
    if facts_file.exists() and not args.regenerate:
        old = json.loads(facts_file.read_text())
        if all(old.get(k) == v for k, v in (("steps", args.steps), ("tensors_per_step", args.tensors),
                                            ("steps_per_shard", args.steps_per_shard),
                                            ("full_every", args.full_every), ("collapse_at", collapse_at),
                                            ("nan_at", nan_at), ("growth_interval", args.growth_interval))):
            facts, facts["reused"] = old, True
    if facts is None:
        free = shutil.disk_usage(run_dir.parent if run_dir.parent.exists() else "/").free
        need = args.steps * args.tensors * 12  # about 10 bytes per row on disk, with margin
        if need > free * 0.8:
            raise SystemExit(f"not enough disk for the run under {run_dir.parent}: "
                             f"about {need / 2**30:.1f} GiB needed, {free / 2**30:.1f} GiB free")
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        facts = generate(run_dir, **params)
    if args.generate_only:
        common.write_json(facts, None)
        return 0

    result = {"benchmark": "analyzer_scale", "machine": common.machine_info(),
              "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "run": facts, "targets": {"nans_s_max": 5.0, "scale_s_max": 5.0, "peak_rss_mib_max": 1024},
              "cli": {}}
    table = []
    for command in COMMANDS:
        r = run_cli_in_process(command, run_dir) if args.in_process else \
            run_measured(cli(command) + [str(run_dir), "--json"])
        if r["rc"] != 0:
            raise RuntimeError(f"amp-postmortem {command} failed ({r['rc']}): {r['stderr'][-2000:]}")
        doc = json.loads(r["stdout"])
        entry = {"wall_s": r["wall_s"], "peak_rss_mib": r["peak_rss_mib"]}
        if command == "nans":
            entry["origin"] = doc.get("origin")
            entry["layers"] = len(doc.get("layers", []))
        elif command == "scale":
            entry.update({k: doc.get(k) for k in ("status", "onset_step", "halvings_per_kstep", "skipped_steps")})
        elif command == "summary":
            entry["findings"] = [f.get("kind") for f in doc.get("findings", [])]
        result["cli"][command] = entry
        table.append({"what": f"amp-postmortem {command}", **{k: entry[k] for k in ("wall_s", "peak_rss_mib")}})

    script = str(Path(__file__).resolve())
    if args.in_process:
        result["functions"] = functions_child(str(run_dir))
        nv = {"rc": 0, "stdout": json.dumps(naive_child(str(run_dir), args.naive_shards))}
    else:
        fn = run_measured([sys.executable, script, "--functions-child", str(run_dir)])
        if fn["rc"] != 0:
            raise RuntimeError(f"function timing failed: {fn['stderr'][-2000:]}")
        result["functions"] = json.loads(fn["stdout"])
        nv = run_measured([sys.executable, script, "--naive-child", str(run_dir),
                           "--naive-shards", str(args.naive_shards)])
    if nv["rc"] == 0:
        naive = json.loads(nv["stdout"])
        factor = facts["shards"] / max(1, naive["files"])
        naive["scaled_to_run"] = factor != 1
        naive["nans_s_run"] = round(naive["nans_s"] * factor, 1)
        naive["peak_rss_mib_run"] = round(naive["peak_rss_mib"] * factor, 0)
        result["naive_pandas"] = naive
        table.append({"what": "naive pandas nans" + (" (scaled)" if factor != 1 else ""),
                      "wall_s": naive["nans_s_run"], "peak_rss_mib": naive["peak_rss_mib_run"]})
    else:
        result["naive_pandas"] = {"failed": nv["stderr"][-500:]}
    common.print_table(table, ["what", "wall_s", "peak_rss_mib"])
    common.write_json(result, args.json_path)
    if tmp and not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
