"""Many ranks: `nans` and `summary` on a 1,024-rank run, local engine vs Dask.

Writes a synthetic run with the real `recorders.writer.ShardWriter` (the
recorder's shard layout, footers, row groups and per-shard index): by
default 1,024 ranks x 3,000 steps x 32 watched tensors = ~10^8 tensor
rows, 1,000 steps per shard (3,072 shard pairs and their indexes). Every
rank holds the same healthy fp16 run (loss scale 2^16, no overflow), except
one planted NaN: the output of one module on rank `--nan-rank` at step
`--nan-at` (its inputs finite: a forward origin). With `--overflow-every N`
every rank also skips a step every N steps with Inf in a few gradients (more
shards to report: the cost of `nans` grows with them).

Then it runs `amp-postmortem nans` and `summary` in child processes (wall
time and the child's peak RSS: the client's memory) with the local engine,
and with `--engine dask` against a `dask.distributed.LocalCluster` started
here (`--workers` process workers), on the indexed run and on the same run
with its indexes hidden (the pre-index reader: every footer opened).
`--s3` also publishes the run to a moto S3 server on loopback through the
recorder's own uploader and times the commands on the `s3://` URI.

    python benchmarks/distributed_scan.py --run-dir /tmp/amp-pm-1024   # full size
    python benchmarks/distributed_scan.py --ranks 256 --steps 2000     # smaller
    python benchmarks/distributed_scan.py --smoke                      # seconds (CI)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import analyzer_scale  # noqa: E402
import common  # noqa: E402

from recorders.format import schema  # noqa: E402
from recorders.writer import ShardWriter, atomic_write_json  # noqa: E402

COMMANDS = ("nans", "summary")
SMOKE = dict(ranks=6, steps=40, tensors=9, steps_per_shard=10, nan_rank=4, nan_at=33)


def generate(run_dir: Path, *, ranks: int, steps: int, tensors: int, steps_per_shard: int, full_every: int,
             nan_rank: int, nan_at: int, overflow_every: int) -> dict:
    """Write the run, rank by rank, through the real ShardWriter."""
    t0 = time.perf_counter()
    if run_dir.exists():
        shutil.rmtree(run_dir)
    layout = analyzer_scale.Layout(tensors)
    run_id = f"synthetic-{ranks}x{steps}x{tensors}"
    before = np.full(steps, 2.0 ** 16)
    skipped = np.zeros(steps, dtype=bool)
    if overflow_every:
        skipped[overflow_every::overflow_every] = True
    after = before.copy()
    n = tensors
    shards = []  # per shard: (idx, column dict without rank) shared by all ranks
    rng = np.random.default_rng(1)
    for first in range(0, steps, steps_per_shard):
        idx = np.arange(first, min(steps, first + steps_per_shard))
        k = len(idx)
        noise = rng.lognormal(0.0, 0.05, size=(k, n))
        absmax = layout.base[None, :] * noise
        absmax = np.where(layout.is_grad[None, :], absmax * before[idx][:, None], absmax)
        absmax = absmax.astype(np.float16).astype(np.float64)
        inf_count = np.zeros((k, n), dtype=np.int64)
        inf_count[np.ix_(skipped[idx], layout.driver_rows)] = 7
        inp = np.where(layout.is_act | layout.is_grad, 0.0, np.nan)
        full = (idx % full_every == 0)[:, None] & np.ones((1, n), dtype=bool)
        cols = {
            "step": np.repeat(idx.astype(np.int64), n), "name": layout.names * k, "kind": layout.kinds * k,
            "phase": layout.phases * k, "order": np.tile(layout.order, k), "call": np.zeros(k * n, np.int32),
            "dtype": ["float16"] * (k * n), "numel": np.tile(layout.numel, k), "absmax": absmax.ravel(),
            "nan_count": np.zeros(k * n, np.int64), "inf_count": inf_count.ravel(),
            "input_nonfinite": np.broadcast_to(inp, (k, n)).ravel().copy(),
            **analyzer_scale.full_tier_columns(layout, absmax, full),
            **analyzer_scale.no_probe_columns(k * n),
        }
        shards.append((idx, cols))
    for rank in range(ranks):
        rank_dir = run_dir / schema.RANK_DIR.format(rank=rank)
        writer = ShardWriter(rank_dir, run_id=run_id, rank=rank, world_size=ranks, steps_per_shard=steps_per_shard)
        for idx, cols in shards:
            cols = dict(cols, rank=np.full(len(cols["step"]), rank, np.int32))
            planted = rank == nan_rank and idx[0] <= nan_at <= idx[-1]
            if planted:
                nan_count = cols["nan_count"].copy()
                nan_count[(nan_at - idx[0]) * n + layout.nan_row] = 1
                cols["nan_count"] = nan_count
            for j, s in enumerate(idx):
                bad = planted and s == nan_at
                writer.add_step({
                    "step": int(s), "rank": rank, "wall_time": 1.7e9 + 0.5 * s,
                    "loss": float("nan") if bad else 3.0 * math.exp(-s / 50000) + 0.01 * math.sin(s),
                    "loss_scale": float(after[s]), "loss_scale_before": float(before[s]),
                    "growth_tracker": int(s), "skipped": bool(skipped[s]) or bad, "lr": [1e-4],
                    "grad_norm": None if skipped[s] else 0.5, "nonfinite_param_grads": 0, "micro_batches": 1,
                    "tier": "full" if s % full_every == 0 else "cheap", "tensor_rows": n, "loss_dtype": "float32",
                }, cols if j == len(idx) - 1 else None)
        writer.roll()
        manifest = analyzer_scale._manifest(run_id, layout, steps, steps_per_shard, 10 ** 6)
        manifest.update(rank=rank, world_size=ranks, model_class="benchmarks.distributed_scan.Synthetic")
        atomic_write_json(rank_dir / schema.MANIFEST_FILE, manifest)
        if rank == 0:
            atomic_write_json(run_dir / schema.MANIFEST_FILE, manifest)
    size = sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file())
    reporting = {(r, s // steps_per_shard) for r in range(ranks) for s in np.flatnonzero(skipped)}
    reporting.add((nan_rank, nan_at // steps_per_shard))
    facts = {"ranks": ranks, "steps": steps, "tensors_per_step": tensors, "tensor_rows": ranks * steps * tensors,
             "steps_per_shard": steps_per_shard, "shard_pairs": ranks * len(shards), "nan_rank": nan_rank,
             "nan_at": nan_at, "nan_layer": layout.names[layout.nan_row], "overflow_every": overflow_every,
             "shards_with_nonfinite": len(reporting), "disk_mib": round(size / 2 ** 20, 1),
             "generate_s": round(time.perf_counter() - t0, 1)}
    (run_dir / "synthetic.json").write_text(json.dumps(facts, indent=2))
    return facts


def hide_indexes(run_dir: Path, hidden: Path) -> None:
    """A copy of the run as an older recorder wrote it (no index): hard
    links, so it costs no disk."""
    if hidden.exists():
        shutil.rmtree(hidden)
    for src in run_dir.rglob("*"):
        rel = src.relative_to(run_dir)
        if schema.INDEX_DIR in rel.parts[:-1] or src.is_dir():
            continue
        dst = hidden / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.link(src, dst)


def measure(command: str, target: str, engine_args: list[str], in_process: bool) -> dict:
    if in_process:
        from click.testing import CliRunner
        from amp_postmortem.cli import main as cli_main
        t0 = time.perf_counter()
        r = CliRunner().invoke(cli_main, [command, target, "--json"] + engine_args)
        res = {"wall_s": round(time.perf_counter() - t0, 3), "rc": r.exit_code,
               "peak_rss_mib": round(common.peak_rss_mib(), 1), "stdout": r.stdout,
               "stderr": r.stderr if r.exit_code else ""}
    else:
        res = analyzer_scale.run_measured(analyzer_scale.cli(command) + [target, "--json"] + engine_args)
    doc = json.loads(res["stdout"]) if res["rc"] in (0, 1) and res["stdout"].strip() else None
    out = {k: res[k] for k in ("wall_s", "rc", "peak_rss_mib")}
    if doc is not None and command == "nans":
        o = doc["origin"] or {}
        out.update(origin=o.get("name"), origin_rank=o.get("rank"), origin_step=o.get("step"),
                   shards_scanned=doc["shards_scanned"], shards_total=doc["shards_total"])
    if doc is not None and command == "summary":
        out["findings"] = [f["kind"] for f in doc["findings"]]
    if doc is None:
        out["stderr"] = res["stderr"][-2000:]
    out["json"] = doc
    return out


def start_s3(run_dir: Path) -> tuple[str, object, float]:
    """Publish the run to a moto S3 server through the recorder's uploader."""
    from moto.server import ThreadedMotoServer
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    import boto3
    boto3.client("s3").create_bucket(Bucket="bench")
    from recorders.storage import SpoolUploader
    spool = Path(tempfile.mkdtemp(prefix="amp-pm-spool-"))
    shutil.copytree(run_dir, spool, dirs_exist_ok=True)
    uri = "s3://bench/runs/many-ranks"
    t0 = time.perf_counter()
    report = SpoolUploader(uri, spool, max_bytes=1 << 40).close(timeout_s=3600)
    upload_s = time.perf_counter() - t0
    assert not report.pending, report
    shutil.rmtree(spool, ignore_errors=True)
    return uri, server, upload_s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--steps-per-shard", type=int, default=1000)
    ap.add_argument("--full-every", type=int, default=100)
    ap.add_argument("--nan-rank", type=int, default=None, help="default: ranks * 2 // 3")
    ap.add_argument("--nan-at", type=int, default=None, help="default: 90%% of the steps")
    ap.add_argument("--overflow-every", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="Dask worker processes")
    ap.add_argument("--run-dir", type=Path, default=None)
    ap.add_argument("--regenerate", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the run directory")
    ap.add_argument("--no-legacy", action="store_true", help="skip the index-less comparison")
    ap.add_argument("--s3", action="store_true", help="also publish to a moto S3 server and read from there")
    ap.add_argument("--smoke", action="store_true", help="a tiny run, in-process, thread workers (CI)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    size = dict(ranks=args.ranks, steps=args.steps, tensors=args.tensors, steps_per_shard=args.steps_per_shard,
                nan_rank=args.nan_rank if args.nan_rank is not None else args.ranks * 2 // 3,
                nan_at=args.nan_at if args.nan_at is not None else args.steps * 9 // 10)
    if args.smoke:
        size = dict(SMOKE)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="amp-pm-ranks-")) / "run"
    facts_file = run_dir / "synthetic.json"
    wanted = {"ranks": size["ranks"], "steps": size["steps"], "tensors_per_step": size["tensors"],
              "overflow_every": args.overflow_every}
    facts = json.loads(facts_file.read_text()) if facts_file.exists() else None
    if args.regenerate or facts is None or any(facts.get(k) != v for k, v in wanted.items()):
        print(f"generating {size['ranks']} ranks x {size['steps']} steps x {size['tensors']} tensors "
              f"in {run_dir} ...", file=sys.stderr)
        facts = generate(run_dir, full_every=args.full_every, overflow_every=args.overflow_every, **size)
    print(json.dumps(facts), file=sys.stderr)

    doc = {"machine": common.machine_info(), "run": facts, "results": []}
    targets = [("indexed", str(run_dir))]
    server = None
    if args.s3:
        # Before the cluster: its worker processes inherit the endpoint and
        # credentials from this environment, as on a real cluster.
        uri, server, upload_s = start_s3(run_dir)
        doc["s3_upload_s"] = round(upload_s, 1)
        targets.append(("s3, indexed", uri))
    from distributed import LocalCluster
    cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=not args.smoke,
                           dashboard_address=None)
    dask_args = ["--engine", "dask", "--scheduler", cluster.scheduler_address]
    legacy = run_dir.parent / (run_dir.name + "-no-index")
    if not args.no_legacy:
        hide_indexes(run_dir, legacy)
        targets.append(("no index", str(legacy)))
    try:
        for label, target in targets:
            for command in COMMANDS:
                for engine, extra in (("local", []), ("dask", dask_args)):
                    r = measure(command, target, extra, in_process=args.smoke)
                    r.update(run=label, command=command, engine=engine)
                    doc["results"].append(r)
                    print(json.dumps({k: v for k, v in r.items() if k != "json"}), file=sys.stderr)
        # The engines agree: the same JSON document, local or on Dask.
        by = {(r["run"], r["command"], r["engine"]): r["json"] for r in doc["results"]}
        doc["dask_matches_local"] = all(by[(t, c, "dask")] == by[(t, c, "local")]
                                        for t, _ in targets for c in COMMANDS)
    finally:
        cluster.close()
        if server is not None:
            server.stop()
        if legacy.exists():
            shutil.rmtree(legacy)
        if not args.keep and args.run_dir is None:
            shutil.rmtree(run_dir.parent, ignore_errors=True)
    for r in doc["results"]:
        r.pop("json")
    common.print_table(doc["results"], ["run", "command", "engine", "wall_s", "peak_rss_mib", "rc",
                                        "shards_scanned", "shards_total", "origin", "origin_rank", "findings"])
    print(f"dask JSON identical to local: {doc['dask_matches_local']}", file=sys.stderr)
    common.write_json(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
