"""The HTML report of a long run: time to write it, its size, time for a
browser to draw it.

Writes a synthetic run in the run format straight with pyarrow (vectorised
per shard, the recorder's footers and row groups): by default 1,000,000
steps x 16 watched tensors (the model's input, then 5 modules' activation,
grad_output and grad_input rows) = 1.6 x 10^7 tensor rows, full tier every
100 steps. The run holds loss spikes, GradScaler growth probes answered by a
skipped step, a late collapse of the loss scale and a late NaN: all of it
must stay visible after downsampling. Then, each in a child process:
`amp-postmortem report` (wall time, file size, points per plot) and headless
chromium loading the page (wall time until every plot is drawn, errors).

    python benchmarks/report_scale.py                       # 1M steps (~1-2 min to write)
    python benchmarks/report_scale.py --steps 200000
    python benchmarks/report_scale.py --smoke               # seconds (CI)

An existing run of the same size is reused unless `--regenerate`.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from analyzer_scale import scale_series  # noqa: E402

from recorders.format import schema  # noqa: E402
from recorders.writer import atomic_write_json  # noqa: E402

MODULES = ("embed", "blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "head")
SMOKE = {"steps": 20_000, "steps_per_shard": 5_000}


def layout():
    """(names, kinds, phases, orders) of one step's rows, execution order."""
    names, kinds, phases, orders = ["<input>"], ["input"], ["forward"], [0]
    for i, m in enumerate(MODULES):
        names.append(m), kinds.append("activation"), phases.append("forward"), orders.append(i + 1)
    for i, m in enumerate(reversed(MODULES)):
        for j, kind in enumerate(("grad_output", "grad_input")):
            names.append(m), kinds.append(kind), phases.append("backward"), orders.append(2 * i + j)
    return names, kinds, phases, np.asarray(orders, np.int32)


def write_run(run_dir: Path, *, steps: int, steps_per_shard: int = 10_000, full_every: int = 100) -> dict:
    """A synthetic one-rank float16 run of `steps` steps; returns its facts."""
    t0 = time.perf_counter()
    if run_dir.exists():
        shutil.rmtree(run_dir)
    names, kinds, phases, orders = layout()
    n = len(names)
    collapse_at, nan_at = int(steps * 0.9), int(steps * 0.995)
    before, after, tracker, skipped = scale_series(steps, collapse_at, 2000)
    rng = np.random.default_rng(0)
    is_grad = np.isin(kinds, ["grad_output", "grad_input"])
    base = np.where(is_grad, 10 ** rng.uniform(-4, -2, n), 10 ** rng.uniform(0, 2, n))
    spikes = rng.choice(steps, size=max(1, steps // 50_000), replace=False)  # rare loss spikes
    run_id = f"synthetic-report-{steps}"
    rank_dir = run_dir / schema.RANK_DIR.format(rank=0)
    for d in (schema.STEPS_DIR, schema.TENSORS_DIR):
        (rank_dir / d).mkdir(parents=True, exist_ok=True)
    for index, first in enumerate(range(0, steps, steps_per_shard)):
        idx = np.arange(first, min(steps, first + steps_per_shard), dtype=np.int64)
        k = len(idx)
        absmax = base[None, :] * (1 + 0.2 * np.sin(idx / 5000.0))[:, None] * rng.lognormal(0, 0.05, (k, n))
        absmax = np.where(is_grad[None, :], absmax * before[idx][:, None], absmax)
        absmax = np.minimum(absmax, schema.FP16_MAX).astype(np.float16).astype(np.float64)
        inf = np.zeros((k, n), np.int64)
        inf[skipped[idx]] = np.where(is_grad, 3, 0)[None, :]  # a skipped step's scaled gradients overflowed
        nan = np.zeros((k, n), np.int64)
        bad_loss = idx >= nan_at
        nan[bad_loss, 3:] = np.where(is_grad[3:] | (np.arange(3, n) < 1 + len(MODULES)), 5, 0)[None, :]
        full = (idx % full_every == 0)[:, None] & np.ones((1, n), bool)
        share = np.where(full & is_grad[None, :], np.clip(0.3 / before[idx][:, None] * 2**10, 0, 1), np.nan)
        numel = np.tile(np.where(is_grad, 4096, 8192).astype(np.int64), k)
        cols = {
            "step": np.repeat(idx, n), "rank": np.zeros(k * n, np.int32),
            "name": pa.array(np.tile(np.asarray(names, object), k), pa.string()),
            "kind": pa.array(np.tile(np.asarray(kinds, object), k), pa.string()),
            "phase": pa.array(np.tile(np.asarray(phases, object), k), pa.string()),
            "order": np.tile(orders, k), "call": np.zeros(k * n, np.int32),
            "dtype": pa.array(np.full(k * n, "float16", object), pa.string()), "numel": numel,
            "absmax": absmax.ravel(), "nan_count": nan.ravel(), "inf_count": inf.ravel(),
            # Counted for activation and grad_input rows only: null elsewhere.
            "input_nonfinite": pa.array(np.zeros(k * n, np.int64), pa.int64(), mask=~np.tile(
                (np.asarray(kinds) == "activation") | (np.asarray(kinds) == "grad_input"), k)),
            "min": np.where(full, -absmax, np.nan).ravel(), "max": np.where(full, absmax, np.nan).ravel(),
            "mean": np.where(full, 0.0, np.nan).ravel(), "rms": np.where(full, absmax * 0.2, np.nan).ravel(),
            "zero_share": np.where(full, 0.01, np.nan).ravel(), "below_normal_share": share.ravel(),
            "below_subnormal_share": (share * 0.1).ravel(),
            "near_overflow_share": np.where(full, 0.0, np.nan).ravel(),
            # Every value counted (at most 65,536 per tensor): null in the cheap tier.
            "share_sample_size": pa.array(np.minimum(numel, 65_536), pa.int64(), mask=~full.ravel()),
            # The op probe's columns: null on module rows (no probe in this run).
            "op": pa.nulls(k * n, pa.string()), "op_index": pa.nulls(k * n, pa.int32()),
            "source": pa.nulls(k * n, pa.string()),
        }
        tensors = pa.Table.from_arrays([pa.array(cols[c.name], c.type) if not isinstance(cols[c.name], pa.Array)
                                        else cols[c.name] for c in schema.TENSOR_COLUMNS],
                                       schema=schema.TENSOR_SCHEMA)
        nonfinite = int(((nan > 0) | (inf > 0)).sum())
        loss = 3.0 * np.exp(-idx / (steps / 3)) + 0.05 * np.sin(idx / 97.0) + 0.02 * rng.standard_normal(k)
        loss[np.isin(idx, spikes)] += 5.0
        loss[bad_loss] = np.nan
        steps_table = pa.table({
            "step": idx, "rank": np.zeros(k, np.int32), "wall_time": 1.7e9 + 0.5 * idx, "loss": loss,
            "loss_scale": after[idx], "loss_scale_before": before[idx], "growth_tracker": tracker[idx],
            "skipped": skipped[idx] | bad_loss, "lr": pa.array([[1e-4]] * k, pa.list_(pa.float64())),
            "grad_norm": np.where(skipped[idx] | bad_loss, np.inf, 0.5 + 0.1 * np.sin(idx / 1000.0)),
            "nonfinite_param_grads": np.zeros(k, np.int32), "micro_batches": np.ones(k, np.int32),
            "tier": pa.array(np.where(idx % full_every == 0, "full", "cheap"), pa.string()),
            "tensor_rows": np.full(k, n, np.int32),
            "sharded_grad_sqsum": pa.nulls(k, pa.float64()),
            "loss_dtype": pa.array(["float32"] * k, pa.string()),
            "reexecuted": np.zeros(k, bool), "reexecution": pa.nulls(k, pa.string())}, schema=schema.STEP_SCHEMA)
        name = schema.SHARD_FILE.format(index=index)
        for table, t, bad in (("tensors", tensors, nonfinite), ("steps", steps_table, 0)):
            meta = {schema.META_FORMAT: schema.FORMAT_NAME, schema.META_SCHEMA_VERSION: schema.SCHEMA_VERSION,
                    schema.META_RUN_ID: run_id, schema.META_RANK: "0", schema.META_WORLD_SIZE: "1",
                    schema.META_TABLE: table, schema.META_FIRST_STEP: str(int(idx[0])),
                    schema.META_LAST_STEP: str(int(idx[-1])), schema.META_NONFINITE_ROWS: str(bad)}
            pq.write_table(t.replace_schema_metadata(meta), rank_dir / table / name, row_group_size=1 << 16)
    manifest = {
        "format": schema.FORMAT_NAME, "schema_version": schema.SCHEMA_VERSION, "run_id": run_id,
        "created_at": time.time(), "package_version": "synthetic", "torch_version": "synthetic",
        "rank": 0, "world_size": 1, "device_type": "cuda", "device_name": "synthetic",
        "model_class": "benchmarks.report_scale.Synthetic",
        "autocast": {"enabled": True, "device_type": "cuda", "dtype": "float16", "cache_enabled": True},
        "scaler": {"class": "torch.amp.grad_scaler.GradScaler", "enabled": True, "init_scale": 65536.0,
                   "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000},
        "optimizer": None,
        "recorder": {"cheap_every": 1, "full_every": full_every, "steps_per_shard": steps_per_shard},
        "modules": [{"name": "", "type": "Synthetic", "watched": True}]
        + [{"name": m, "type": "torch.nn.Linear", "watched": True} for m in MODULES],
        "params": [], "bundles": [], "status": "closed", "steps_recorded": steps, "first_step": 0,
        "last_step": steps - 1, "dropped_steps": 0, "disabled_reason": None,
    }
    atomic_write_json(rank_dir / schema.MANIFEST_FILE, manifest)
    atomic_write_json(run_dir / schema.MANIFEST_FILE, manifest)
    return {"steps": steps, "tensors_per_step": n, "tensor_rows": steps * n,
            "skipped_steps": int((skipped | (np.arange(steps) >= nan_at)).sum()), "collapse_at": collapse_at,
            "nan_at": nan_at, "loss_spikes": sorted(int(s) for s in spikes),
            "disk_mib": round(sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file()) / 2**20, 1),
            "generate_s": round(time.perf_counter() - t0, 1)}


def measure(run_dir: Path, html: Path) -> dict:
    """`amp-postmortem report` in a child process, then chromium on the page."""
    t0 = time.perf_counter()
    cpu0 = _children_cpu()
    out = subprocess.run([sys.executable, "-m", "amp_postmortem", "report", str(run_dir), "-o", str(html),
                          "--json"], capture_output=True, text=True, cwd=common.REPO)
    report_s = time.perf_counter() - t0
    # CPU seconds too: on a shared machine the wall time mostly says how busy it was.
    report_cpu_s = _children_cpu() - cpu0
    if out.returncode:
        raise SystemExit(f"report failed:\n{out.stderr}")
    doc = json.loads(out.stdout)
    sys.path.insert(0, str(common.REPO / "tests"))
    from report_browser import check_page
    t0 = time.perf_counter()
    page = check_page(html, html.with_suffix(".png"))
    browser_s = time.perf_counter() - t0
    return {"report_s": round(report_s, 2), "report_cpu_s": round(report_cpu_s, 2), "bytes": doc["bytes"], "mib": round(doc["bytes"] / 2**20, 2),
            "plots": {p["id"]: p["points"] for p in doc["plots"]}, "downsampled": doc["downsampled"],
            "browser_s": round(browser_s, 2), "browser_ready_ms": page.get("ready_ms"),
            "browser_state": page["state"], "browser_errors": page["errors"],
            "total_s": round(report_s + browser_s, 2)}


def _children_cpu() -> float:
    import resource
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", default=None, help="where the synthetic run goes (default: a folder in /tmp)")
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--steps-per-shard", type=int, default=10_000)
    ap.add_argument("--regenerate", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="a small run (CI)")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.steps_per_shard = SMOKE["steps"], SMOKE["steps_per_shard"]
    tmp = None
    if args.run_dir is None:
        tmp = Path(tempfile.mkdtemp(prefix="amp-pm-report-"))
        run_dir = tmp / "run"
    else:
        run_dir = Path(args.run_dir)
    facts_file = run_dir / "synthetic.json"
    if args.regenerate or not facts_file.is_file() or json.loads(facts_file.read_text())["steps"] != args.steps:
        facts = write_run(run_dir, steps=args.steps, steps_per_shard=args.steps_per_shard)
        facts_file.write_text(json.dumps(facts))
    else:
        facts = json.loads(facts_file.read_text())
    result = {"machine": common.machine_info(), "run": facts,
              "report": measure(run_dir, run_dir.parent / f"{run_dir.name}-report.html")}
    r = result["report"]
    print(f"{facts['steps']:,} steps x {facts['tensors_per_step']} tensors: report written in {r['report_s']} s "
          f"({r['report_cpu_s']} s CPU), "
          f"{r['mib']} MiB; chromium drew it in {r['browser_s']} s ({r['browser_state']}, "
          f"{len(r['browser_errors'])} errors); total {r['total_s']} s", file=sys.stderr)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_path:
        Path(args.json_path).write_text(text)
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
