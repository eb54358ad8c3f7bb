"""Runs on an object store: a real S3 endpoint (moto's server, on loopback
and a free port), written by the real recorder, read by every command."""
from __future__ import annotations

import json
import os
import socket
import statistics
import threading
import time

import pytest
import torch
from click.testing import CliRunner

import whatif_runs as W
from amp_postmortem.cli import main
from amp_postmortem.reading.loader import load_run
from recorders import AmpRecorder
from recorders.format import schema
from recorders.storage import SpoolUploader, is_uri, open_filesystem

BUCKET = "amp-runs"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Endpoint:
    """moto in server mode behind a loopback TCP proxy: stop() and start()
    simulate an outage by closing the proxy and every connection through it
    (stopping moto itself would leave keep-alive connections served; its
    objects live in this process and survive)."""

    def __init__(self):
        from moto.server import ThreadedMotoServer
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
        self.server.start()
        self.backend = self.server.get_host_and_port()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._listener = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self):
        self._listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def stop(self):
        # shutdown() first: on Linux it takes the socket out of LISTEN and
        # wakes the accept() blocked on it; close() alone leaves the kernel
        # socket listening (the blocked accept holds it) until one more
        # connection arrives, so "the store is down" would not yet hold.
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for c in self._conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                c.close()
            self._conns.clear()

    def close(self):
        self.stop()
        self.server.stop()

    def _accept(self, listener):
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed: the outage begins
            upstream = socket.create_connection(self.backend)
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src, dst):
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def keys(self, prefix: str) -> list[str]:
        import pyarrow.fs as pafs
        fs, _ = open_filesystem(f"s3://{BUCKET}")
        infos = fs.get_file_info(pafs.FileSelector(f"{BUCKET}/{prefix}", recursive=True, allow_not_found=True))
        return sorted(i.path[len(BUCKET) + 1:] for i in infos if i.type == pafs.FileType.File)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    endpoint = S3Endpoint()
    # Credentials and endpoint only from the environment, as on a cluster.
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint.url,
           "AMP_POSTMORTEM_SPOOL_DIR": str(tmp_path_factory.mktemp("spool")),
           "AMP_POSTMORTEM_CACHE": str(tmp_path_factory.mktemp("cache"))}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    endpoint.start()
    import boto3
    boto3.client("s3", endpoint_url=endpoint.url).create_bucket(Bucket=BUCKET)
    yield endpoint
    endpoint.close()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _train(rec, model, opt, scaler, steps, *, on_step=None, nan_step=None):
    """Tiny fp16-autocast loop; returns each step's wall time (recorder included)."""
    # Its own loop: it times each whole step, rec.step() included, against a store's outage.
    times = []
    for step in range(steps):
        if on_step:
            on_step(step)
        t0 = time.perf_counter()
        x, y = W.batch(step)
        if step == nan_step:
            x[0, 0, 0] = float("nan")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ((model(x).float() - y) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        rec.step(loss)
        times.append(time.perf_counter() - t0)
    return times


def test_uri_detection_keeps_local_paths_local():
    assert is_uri("s3://b/runs") and is_uri("gs://b/x") and is_uri("abfs://c@a.dfs.core.windows.net/r")
    assert not is_uri("runs/exp1") and not is_uri("C:\\runs") and not is_uri("file:///tmp/run")


def test_recorder_writes_to_s3_through_an_outage_without_blocking_or_losing_steps(s3):
    uri = f"s3://{BUCKET}/runs/outage"
    torch.manual_seed(0)
    model = W.AttnNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=W.RECORDED_SCALE, growth_interval=10 ** 6)
    steps = 90

    def outage(step):
        if step == 30:
            s3.stop()      # the store goes down mid-run...
        if 30 <= step < 60:
            # ...for 8 s of training: longer than the S3 client's own
            # retries (~6 s), so that uploads really fail meanwhile.
            time.sleep(0.27)
        if step == 60:
            s3.start()

    rec = AmpRecorder(uri, model, optimizer=opt, scaler=scaler, steps_per_shard=10, flush_interval_s=3600)
    times = _train(rec, model, opt, scaler, steps, on_step=outage, nan_step=75)
    rec.close()

    # Training never waited for the store: a failed upload takes the S3
    # client ~6 s (its own retries), no step came near that, and the steps
    # during the outage were about as fast as before it. The margins are
    # wide (a loaded 2-core machine stalls a step now and then); waiting on
    # the store would exceed them several times over.
    assert max(times) < 4.0, times
    assert statistics.median(times[30:60]) < 3 * statistics.median(times[:30]) + 0.1, times
    report = rec.upload_report
    assert report.pending == [] and report.spool_full_steps == 0
    assert report.failed_attempts >= 1  # the outage was seen, and overcome
    keys = s3.keys("runs/outage")
    for i in range(steps // 10):
        for d in (schema.STEPS_DIR, schema.TENSORS_DIR):
            assert f"runs/outage/rank=0/{d}/part-{i:06d}.parquet" in keys
        assert f"runs/outage/rank=0/{schema.INDEX_DIR}/part-{i:06d}.json" in keys
    assert "runs/outage/manifest.json" in keys and "runs/outage/rank=0/manifest.json" in keys

    run = load_run(uri)
    assert run.steps["step"].tolist() == list(range(steps))
    assert run.manifest["status"] == "closed" and run.manifest["storage"]["uri"] == uri
    assert len(run.tensor_shards) == 9 and run.warnings == []
    res = CliRunner().invoke(main, ["nans", uri, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["origin"]["name"] == "<input>"
    assert json.loads(res.stdout)["origin"]["step"] == 75


def test_a_store_down_at_close_is_reported_and_the_spool_kept(s3, tmp_path):
    uri = f"s3://{BUCKET}/runs/down-at-close"
    torch.manual_seed(0)
    model = W.AttnNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=W.RECORDED_SCALE, growth_interval=10 ** 6)
    rec = AmpRecorder(uri, model, optimizer=opt, scaler=scaler, steps_per_shard=5,
                      spool_dir=tmp_path / "spool", upload_timeout_s=1.0)
    _train(rec, model, opt, scaler, 10)
    rec.flush()
    s3.stop()
    try:
        _train(rec, model, opt, scaler, 10)
        with pytest.warns(RuntimeWarning, match="not uploaded"):
            rec.close()
    finally:
        s3.start()
    report = rec.upload_report
    assert report.pending, "files the store did not take must be reported"
    spool = rec.run_dir
    assert all((spool / p).is_file() for p in report.pending)
    # A later uploader on the same spool finishes the job.
    again = SpoolUploader(uri, spool)
    assert again.close(30).pending == []
    run = load_run(uri)
    assert run.steps["step"].tolist() == list(range(20)) and run.manifest["status"] == "closed"


def test_a_full_spool_drops_steps_and_says_so(s3, tmp_path):
    uri = f"s3://{BUCKET}/runs/full-spool"
    torch.manual_seed(0)
    model = W.AttnNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=W.RECORDED_SCALE, growth_interval=10 ** 6)
    rec = AmpRecorder(uri, model, optimizer=opt, scaler=scaler, steps_per_shard=5,
                      spool_dir=tmp_path / "spool", spool_max_bytes=1)
    _train(rec, model, opt, scaler, 10)
    with pytest.warns(RuntimeWarning, match="10 step\\(s\\) were not recorded because the spool was full"):
        rec.close()
    assert rec.upload_report.spool_full_steps == 10
    # Every shard was dropped: the run holds no step, and says why.
    res = CliRunner().invoke(main, ["summary", uri])
    assert res.exit_code == 2
    assert res.output.strip().endswith("10 step(s) were not recorded because the object store was "
                                       "unreachable and the recorder's local spool was full")


@pytest.fixture(scope="module")
def overflow_on_s3(s3):
    """The what-if overflow run (bundle of step 0), recorded straight to S3."""
    uri = f"s3://{BUCKET}/runs/overflow_in_scores"
    W.record(uri, W.attn_overflow_model(), steps=2)
    return uri


def _json(args):
    res = CliRunner().invoke(main, args + ["--json"])
    assert res.exit_code == 0, (args, res.output)
    return json.loads(res.stdout)


def test_every_command_reads_a_run_on_s3_as_it_reads_the_local_run(overflow_on_s3):
    uri = overflow_on_s3
    local = str(W.attn_overflow_run())
    spec = f"{W.__file__}:AttnNet"

    def same(args_uri, args_local):
        a = json.dumps(_json(args_uri)).replace(uri, "RUN")
        b = json.dumps(_json(args_local)).replace(local, "RUN")
        return json.loads(a), json.loads(b)

    for command in ("summary", "nans", "scale", "ranges"):
        a, b = same([command, uri], [command, local])
        if command == "summary":  # run ids and wall clocks differ between two recordings
            a["run"].pop("run_id"), b["run"].pop("run_id")
        assert a == b, command
    # The same recording twice (deterministic tiny model): no divergence.
    compare = _json(["compare", uri, local])
    assert compare["common_steps"] == 2 and compare["divergence_step"] is None
    # The bundle commands read the run's bundle from the store.
    for args in (["fix", uri, "--step", "0", "--model", spec],
                 ["replay", uri, "--step", "0", "--model", spec, "--precisions", "fp16"],
                 ["scale-window", uri],
                 ["recommend", uri, "--model", spec],
                 ["bisect", uri, "--step", "0", "--model", spec]):
        a = json.dumps(_json(args)).replace(uri, "RUN")
        b = json.dumps(_json([args[0], local] + args[2:])).replace(local, "RUN")
        assert _without_paths(json.loads(a)) == _without_paths(json.loads(b)), args[0]


def test_report_and_export_read_a_run_on_s3(overflow_on_s3, tmp_path):
    doc = _json(["report", overflow_on_s3, "-o", str(tmp_path / "r.html")])
    assert (tmp_path / "r.html").stat().st_size > 0 and doc["warnings"] == []
    _json(["export", "tensorboard", overflow_on_s3, "--logdir", str(tmp_path / "tb")])
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*"))


def _without_paths(doc):
    """A report with local cache paths (where a remote run was copied) and
    timings blanked out."""
    if isinstance(doc, dict):
        return {k: ("-" if k in ("path", "bundle", "seconds", "wall_s") or (k == "run" and isinstance(v, str))
                    else _without_paths(v)) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_without_paths(v) for v in doc]
    return doc


def test_a_missing_remote_run_is_one_error_line(s3):
    res = CliRunner().invoke(main, ["summary", f"s3://{BUCKET}/runs/nothing-here"])
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [f"Error: run directory not found: s3://{BUCKET}/runs/nothing-here"]


def test_dask_workers_read_the_run_from_the_store(overflow_on_s3):
    from distributed import LocalCluster
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster:
        for command in ("nans", "summary"):
            local = _json([command, overflow_on_s3])
            assert _json([command, overflow_on_s3, "--engine", "dask",
                          "--scheduler", cluster.scheduler_address]) == local


def test_a_scheme_pyarrow_lacks_goes_through_fsspec(tmp_path):
    """`memory://` is fsspec's alone: the recorder writes there and every
    analysis command reads it back through pyarrow's fsspec bridge."""
    uri = "memory://amp-tests/runs/fsspec"
    torch.manual_seed(0)
    model = W.AttnNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=W.RECORDED_SCALE, growth_interval=10 ** 6)
    rec = AmpRecorder(uri, model, optimizer=opt, scaler=scaler, steps_per_shard=4, spool_dir=tmp_path)
    _train(rec, model, opt, scaler, 10, nan_step=6)
    rec.close()
    assert rec.upload_report.pending == []
    run = load_run(uri)
    assert run.steps["step"].tolist() == list(range(10)) and len(run.tensor_shards) == 3
    assert _json(["nans", uri])["origin"]["step"] == 6
    for command in ("summary", "scale", "ranges"):
        _json([command, uri])


def test_a_store_unreachable_at_start_never_reuses_a_shard_number(tmp_path):
    """A resumed run whose store is down when the recorder starts cannot
    count the shards already published: it numbers after any plausible
    count instead of overwriting one."""
    import pyarrow.fs as pafs
    from fsspec.implementations.memory import MemoryFileSystem

    class Down(MemoryFileSystem):
        def isdir(self, *args, **kwargs):
            raise ConnectionError("store unreachable")

    up = SpoolUploader("memory://down/run", tmp_path, filesystem=pafs.PyFileSystem(pafs.FSSpecHandler(Down())),
                       base="down/run")
    assert up.next_shard_index(0) >= int(time.time()) - 5


def test_a_store_that_refuses_connections_never_blocks_the_constructor(s3, tmp_path):
    """The store is down when the job starts (connection refused on its
    port): the constructor returns at once, the spool takes the rows, and
    the run is complete on the store once it is back."""
    uri = f"s3://{BUCKET}/runs/down-at-start"
    torch.manual_seed(0)
    model = W.AttnNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=W.RECORDED_SCALE, growth_interval=10 ** 6)
    s3.stop()
    try:
        # Nothing listens: refused, not a timeout.
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", s3.port)) != 0
        started = time.time()
        t0 = time.perf_counter()
        rec = AmpRecorder(uri, model, optimizer=opt, scaler=scaler, steps_per_shard=5,
                          spool_dir=tmp_path / "spool", upload_timeout_s=60)
        assert time.perf_counter() - t0 < 1.0  # the S3 client's retries alone take ~6 s a request
        times = _train(rec, model, opt, scaler, 10)
        assert max(times) < 4.0, times
        rec.flush()
        spooled = sorted(p.name for p in (rec.run_dir / "rank=0" / schema.STEPS_DIR).glob("*.parquet"))
        assert len(spooled) == 2  # the spool holds the rows while the store is down
    finally:
        s3.start()
    rec.close()
    assert rec.upload_report.pending == []
    # Numbered after any count the store could hold (it could not be asked).
    assert all(int(name.split("-")[1].split(".")[0]) >= int(started) for name in spooled)
    run = load_run(uri)
    assert run.steps["step"].tolist() == list(range(10)) and run.manifest["status"] == "closed"
    assert run.warnings == []
