"""The per-step journal: a job killed at any moment, or a recorder that
fails, leaves its steps on disk (at most the last 5 s lost), and the
analyzer reads them as it reads shards, once each."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
from click.testing import CliRunner

import amp_postmortem
from amp_postmortem.cli import main
from amp_postmortem.errors import EmptyRunError
from amp_postmortem.reading.loader import load_run
from recorders.format import schema
from recorders.journal import Journal, journal_path
from recorders.step_rows import StepRows
from recorders.writer import ShardWriter
from recorders.storage import SpoolUploader
from tiny_models import PlantedNet, TinyNet, batches, recorder_at, train

TESTS = os.path.dirname(__file__)
INF_STEP = 5
RUN_ID = "journal-test"

# A real job: the real recorder with its defaults (1,000 steps per shard,
# 60 s: no shard is written in the test's lifetime), ~30 ms steps, a side
# log that says when each rec.step() returned. `boom` returns Inf at one
# step when asked to.
# Its own loop: a child process, killed by the test at random moments, logging each rec.step().
CHILD = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {tests!r})
    torch.set_num_threads(1)
    from recorders import AmpRecorder
    from tiny_models import PlantedNet, batches
    torch.manual_seed(0)
    model = PlantedNet(); opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    rec = AmpRecorder({run!r}, model, optimizer=opt, scaler=sc)
    log = open({log!r}, "a")
    data = batches(8)
    for i in range(100_000):
        t0 = time.time()
        x, y = data[i % 8]
        model.boom.gain = float("inf") if i == {inf_step} else 1.0
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ((model(x).float() - y) ** 2).mean()
        sc.scale(loss).backward(); sc.step(opt); sc.update(); opt.zero_grad()
        rec.step(loss)
        print(f"step {{i}} done at {{time.time()!r}}", file=log, flush=True)
        time.sleep(max(0.0, 0.03 - (time.time() - t0)))
""")


class Job:
    def __init__(self, tmp_path: Path, name: str, inf_step: int = -1):
        self.run, self.log = tmp_path / name, tmp_path / f"{name}.log"
        self.log.touch()
        script = CHILD.format(tests=TESTS, run=str(self.run), log=str(self.log), inf_step=inf_step)
        self.stderr = open(tmp_path / f"{name}.stderr", "w")
        self.proc = subprocess.Popen([sys.executable, "-c", script], stderr=self.stderr)
        self.killed_at = None

    def done(self) -> dict[int, float]:
        out = {}
        for line in self.log.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5 and parts[0] == "step":
                out[int(parts[1])] = float(parts[4])
        return out

    def wait_for_step(self, step: int, timeout: float = 60) -> float:
        deadline = time.time() + timeout
        while time.time() < deadline:
            t = self.done().get(step)
            if t is not None:
                return t
            assert self.proc.poll() is None, (self.run / "..").resolve()
            time.sleep(0.005)
        raise AssertionError(f"the job did not reach step {step} in {timeout} s")

    def kill(self) -> None:
        self.killed_at = time.time()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.stderr.close()
        assert self.proc.returncode == -signal.SIGKILL


@pytest.fixture(scope="module")
def killed_jobs(tmp_path_factory):
    """Three real jobs started at once (their imports overlap): two killed
    at random moments 5-6.5 s into training, one killed 0.3 s after it
    reported the step whose `boom` returned Inf."""
    tmp_path = tmp_path_factory.mktemp("killed")
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    jobs = [Job(tmp_path, f"job{i}") for i in range(2)]
    inf = Job(tmp_path, "inf", inf_step=INF_STEP)
    inf.wait_for_step(INF_STEP)
    time.sleep(0.3)  # the writer thread's turn: far under the 5 s bound
    inf.kill()
    kills = sorted(((j.wait_for_step(0) + rng.uniform(5.1, 6.5), i) for i, j in enumerate(jobs)))
    for when, i in kills:
        time.sleep(max(0.0, when - time.time()))
        jobs[i].kill()
    return seed, jobs, inf


def test_kill_9_at_random_moments_loses_at_most_the_last_5_seconds(killed_jobs):
    seed, jobs, _ = killed_jobs
    for job in jobs:
        done = job.done()
        promised = {s for s, t in done.items() if t < job.killed_at - 5.0}
        assert promised, f"seed {seed}: no step was 5 s old at the kill"
        run = load_run(job.run)
        steps = run.steps["step"].tolist()
        # A prefix of the job, each step once: all the promised ones, and
        # at most the step rec.step() had returned from without its log line.
        assert steps == list(range(len(steps))), f"seed {seed}"
        assert promised <= set(steps) and len(steps) <= max(done) + 2, f"seed {seed}"
        assert len(run.scan_tensors(["step"])["step"].unique()) == len(steps)
        assert list(job.run.glob("rank=0/steps/*.parquet")) == []  # all of it from the journal
    res = CliRunner().invoke(main, ["summary", str(jobs[0].run), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["run"]["last_step"] == len(load_run(jobs[0].run).steps) - 1


def test_a_nonfinite_step_is_on_disk_at_once(killed_jobs):
    job = killed_jobs[2]
    run = load_run(job.run)
    row = run.steps.set_index("step").loc[INF_STEP]
    assert bool(row["skipped"])
    found = amp_postmortem.nans(str(job.run)).to_dict()
    assert found["first_nonfinite_step"] == INF_STEP and found["origin"]["name"] == "boom"


def _spy_syncs(monkeypatch) -> tuple[list[int], list[int]]:
    """(the steps whose append fsynced the journal, the last step journaled
    at each fsync of an idle writer)."""
    on_append, on_idle, last = [], [], []
    append, sync_journal = Journal.append, ShardWriter.sync_journal

    def spy_append(self, index, tensors, steps, urgent=False, soon=False):
        last.append(steps.column("step")[0].as_py())
        before = self.syncs
        append(self, index, tensors, steps, urgent, soon)
        if self.syncs > before:
            on_append.append(last[-1])

    def spy_idle(self):
        before = self.journal.syncs
        sync_journal(self)
        if self.journal.syncs > before:
            on_idle.append(last[-1])

    monkeypatch.setattr(Journal, "append", spy_append)
    monkeypatch.setattr(ShardWriter, "sync_journal", spy_idle)
    return on_append, on_idle


def test_a_skipped_or_nonfinite_step_is_fsynced_at_once_the_others_by_the_interval(tmp_path, monkeypatch):
    on_append, _ = _spy_syncs(monkeypatch)

    def plant(step, model, x):
        model.boom.gain = float("inf") if step == 3 else 1.0

    torch.manual_seed(0)
    train(PlantedNet(), batches(6), recorder=recorder_at(tmp_path / "run", durable_interval_s=3600),
          scaler={"init_scale": 2.0 ** 8}, on_step=plant)
    assert on_append == [3]
    # An interval of 0: every step fsynced as it is written.
    on_append.clear()
    torch.manual_seed(0)
    train(TinyNet(), batches(3), recorder=recorder_at(tmp_path / "run0", durable_interval_s=0))
    assert on_append == [0, 1, 2]


def test_a_burst_fsyncs_each_new_kind_of_trouble_at_once_and_gathers_its_repeats(tmp_path, monkeypatch):
    """A diverging job's steps (the facts only): the first skip is journaled
    and fsynced alone at once; the skips after it, within
    `URGENT_SYNC_GAP_S`, are gathered as clean steps are; the first NaN loss
    among them is a new kind of trouble: journaled and fsynced at once, after
    the gathered steps; its repeats are gathered again; the gathered are
    fsynced once the gap is up; every step reaches the pair, in order."""
    from recorders import journal as rj
    from recorders import writer as rw
    from recorders.journal import read_journal

    rank_dir = tmp_path / "rank=0"
    w = ShardWriter(rank_dir, run_id=RUN_ID, rank=0, world_size=1, steps_per_shard=1000, durable_interval_s=3600)
    # Counted on this writer's journal only: a journal left by an earlier
    # test in the same worker (its writer thread still closing) may sync.
    syncs = []
    sync = w.journal.sync
    monkeypatch.setattr(w.journal, "sync", lambda: (syncs.append(w.journal.index), sync())[1])

    def step(i, *, skipped=False, loss=1.0):
        w.add_step({"step": i, "rank": 0, "wall_time": 0.0, "skipped": skipped, "loss": loss,
                    "grad_norm": float("inf") if skipped else 1.0, "micro_batches": 1, "tensor_rows": 0}, None)

    def journaled():
        found = read_journal(rank_dir, 0)
        return [] if found is None else found[1]["step"].to_pylist()

    # Time stands still until the test moves it: a loaded machine's second
    # between two calls would otherwise write or fsync the gathered early.
    monkeypatch.setattr(rw, "JOURNAL_BATCH_S", 3600.0)
    monkeypatch.setattr(rw, "URGENT_SYNC_GAP_S", 3600.0)
    monkeypatch.setattr(rj, "URGENT_SYNC_GAP_S", 3600.0)
    step(0)
    assert journaled() == [] and syncs == []             # clean: gathered
    step(1, skipped=True)                                # the first skip: at once, after step 0
    assert journaled() == [0, 1] and len(syncs) == 1
    for i in range(2, 6):
        step(i, skipped=True)                            # its repeats: gathered, no fsync each
    assert journaled() == [0, 1] and len(syncs) == 1
    step(6, skipped=True, loss=float("nan"))             # a NaN loss: new, at once, after them
    assert journaled() == list(range(7)) and len(syncs) == 2
    step(7, skipped=True, loss=float("nan"))
    step(8, skipped=True)
    assert journaled() == list(range(7)) and len(syncs) == 2
    monkeypatch.setattr(rw, "JOURNAL_BATCH_S", 0.0)      # the half second is up: written ...
    monkeypatch.setattr(rj, "URGENT_SYNC_GAP_S", 1.0)    # ... and the gap since the last fsync
    monkeypatch.setattr(w.journal, "_last_sync", time.monotonic() - 2.0)
    step(9, skipped=True)                                # ... and, the gap being up, fsynced
    assert journaled() == list(range(10)) and len(syncs) == 3
    w.roll()
    w.wait_published()
    import pyarrow.parquet as pq
    steps = pq.read_table(rank_dir / schema.STEPS_DIR / schema.SHARD_FILE.format(index=0))["step"].to_pylist()
    assert steps == list(range(10))


def test_an_idle_writer_fsyncs_what_it_wrote(tmp_path, monkeypatch):
    _, on_idle = _spy_syncs(monkeypatch)
    torch.manual_seed(0)
    rec = train(TinyNet(), batches(2), recorder=recorder_at(tmp_path / "run", durable_interval_s=3600),
                close=False).rec
    # Nothing comes after step 1: the writer's idle wake-up (1 s at most)
    # fsyncs it, long before the interval.
    deadline = time.time() + 10
    while on_idle[-1:] != [1] and time.time() < deadline:
        time.sleep(0.02)
    assert on_idle[-1:] == [1]
    rec.close()


def test_a_recorder_fault_at_step_30_leaves_steps_0_to_29_on_disk(tmp_path, monkeypatch):
    rows = StepRows.rows

    def failing(self, pending):
        if pending.step == 30:
            raise OSError("planted writer fault")
        return rows(self, pending)

    monkeypatch.setattr(StepRows, "rows", failing)
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="planted writer fault"):
        train(TinyNet(blocks=1), batches(40), recorder=recorder_at(tmp_path / "run"))
    run = load_run(tmp_path / "run")
    assert run.steps["step"].tolist() == list(range(30))
    assert sorted(run.scan_tensors(["step"])["step"].unique()) == list(range(30))
    assert run.rank_manifests[0]["disabled_at_step"] == 30


def test_the_writer_journals_on_while_a_pair_is_published(tmp_path, monkeypatch):
    """A pair's Parquet write (seconds for millions of rows) runs on the
    publisher's thread: held here until released, the writer goes on
    journaling the next steps, which a killed job keeps and the analyzer
    reads; once released every step is in a pair and no journal is left."""
    import threading
    import recorders.writer as rw
    release, started = threading.Event(), threading.Event()
    write = rw.atomic_write_table

    def slow(*args, **kwargs):
        started.set()
        assert release.wait(30)
        return write(*args, **kwargs)

    monkeypatch.setattr(rw, "atomic_write_table", slow)
    torch.manual_seed(0)
    rec = train(TinyNet(), batches(5), recorder=recorder_at(tmp_path / "run", steps_per_shard=2),
                close=False).rec
    try:
        assert started.wait(30)
        # Pair 0 (steps 0-1) is being written, pair 1 (2-3) waits for the
        # publisher, step 4 is in the open journal: the writer never stopped.
        # The barrier returns once the writer has taken every step (waiting
        # for the journal's file alone raced with the step's write into it).
        rec.writer.barrier()
        assert [journal_path(tmp_path / "run" / "rank=0", "steps", i).exists() for i in range(3)] == [True] * 3
        assert not list((tmp_path / "run" / "rank=0" / "steps").glob("*.parquet"))
        assert load_run(tmp_path / "run").steps["step"].tolist() == [0, 1, 2, 3, 4]
    finally:
        release.set()
        rec.close()
    run = load_run(tmp_path / "run")
    assert run.steps["step"].tolist() == [0, 1, 2, 3, 4] and len(run.step_shards) == 3
    assert not list((tmp_path / "run" / "rank=0" / schema.JOURNAL_DIR).rglob("*" + schema.JOURNAL_SUFFIX))


def _journaled_run(tmp_path, steps=6, **options) -> Path:
    """A copy of a run whose recorder journaled `steps` steps and wrote no
    shard (as a killed job leaves it)."""
    torch.manual_seed(0)
    rec = train(TinyNet(), batches(steps), recorder=recorder_at(tmp_path / "live", run_id=RUN_ID, **options),
                close=False).rec
    rec.writer.barrier()
    shutil.copytree(tmp_path / "live", tmp_path / "killed")
    rec.close()
    return tmp_path / "killed"


def test_a_truncated_journal_reads_its_intact_prefix(tmp_path):
    src = _journaled_run(tmp_path)
    steps_file = journal_path(src / "rank=0", schema.STEPS_DIR, 0)
    tensors_file = journal_path(src / "rank=0", schema.TENSORS_DIR, 0)
    for victim in (steps_file, tensors_file):
        size = victim.stat().st_size
        for cut in (1, 9, 200, 700, 3000, size // 2):
            run = tmp_path / f"cut-{victim.parent.name}-{cut}"
            shutil.copytree(src, run)
            os.truncate(run / victim.relative_to(src), size - cut)
            try:
                loaded = load_run(run)
            except EmptyRunError:  # every step message torn
                assert victim is steps_file
                continue
            steps = loaded.steps["step"].tolist()
            assert steps == list(range(len(steps))) and len(steps) <= 6
            if victim is steps_file:
                assert len(steps) < 6
            tensor_steps = sorted(loaded.scan_tensors(["step"])["step"].unique())
            assert set(tensor_steps) <= set(steps)
            assert tensor_steps == list(range(len(tensor_steps)))
            if victim is tensors_file:
                assert len(steps) == 6 and len(tensor_steps) < 6


def test_a_journal_beside_its_published_pair_adds_no_row(tmp_path):
    src = _journaled_run(tmp_path)
    journal = {p: p.read_bytes() for p in (src / "rank=0" / schema.JOURNAL_DIR).rglob("*.arrows")}
    torch.manual_seed(0)
    train(TinyNet(), batches(6), recorder=recorder_at(tmp_path / "published", run_id=RUN_ID))
    rows = len(load_run(tmp_path / "published").scan_tensors(["step"]))
    for p, data in journal.items():  # killed between publishing the pair and removing its journal
        target = tmp_path / "published" / p.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    run = load_run(tmp_path / "published")
    assert run.steps["step"].tolist() == list(range(6)) and run.warnings == []
    assert len(run.scan_tensors(["step"])) == rows and all(p.suffix == ".parquet" for p in run.scanned_files)
    # Killed between the tensors and the steps shard: the journal stands in
    # for the pair, the lone tensors shard is not read twice.
    (tmp_path / "published" / "rank=0" / schema.STEPS_DIR / "part-000000.parquet").unlink()
    (tmp_path / "published" / "rank=0" / schema.INDEX_DIR / "part-000000.json").unlink()
    run = load_run(tmp_path / "published")
    assert run.steps["step"].tolist() == list(range(6)) and run.warnings == []
    assert len(run.scan_tensors(["step"])) == rows
    assert [p.suffix for p in run.scanned_files] == [".arrows"]


def test_a_resumed_job_turns_the_dead_jobs_journal_into_its_shard(tmp_path):
    run = _journaled_run(tmp_path)
    before = load_run(run)
    assert before.steps["step"].tolist() == list(range(6))
    torch.manual_seed(1)
    train(TinyNet(), batches(3), recorder=recorder_at(run))
    assert list((run / "rank=0" / schema.JOURNAL_DIR).rglob("*.arrows")) == []
    names = sorted(p.name for p in (run / "rank=0" / schema.STEPS_DIR).iterdir())
    assert names == ["part-000000.parquet", "part-000001.parquet"]  # never the dead job's number
    after = load_run(run)
    assert after.steps["step"].tolist() == list(range(6))
    assert any("recorded twice" in w for w in after.warnings)  # steps 0-2 again: the resumed job's kept
    old = before.steps.set_index("step")["loss"]
    new = after.steps.set_index("step")["loss"]
    assert new.loc[3:].tolist() == old.loc[3:].tolist() and new.loc[:2].tolist() != old.loc[:2].tolist()


def test_a_remote_runs_journal_stays_in_the_spool(tmp_path):
    spool = tmp_path / "spool"
    shard = spool / "rank=0" / schema.STEPS_DIR / "part-000000.parquet"
    journal = journal_path(spool / "rank=0", schema.STEPS_DIR, 1)
    for p in (shard, journal):
        p.parent.mkdir(parents=True)
        p.write_bytes(b"x")
    (tmp_path / "store").mkdir()
    up = SpoolUploader("file://store", spool, filesystem=pafs.LocalFileSystem(), base=str(tmp_path / "store"))
    report = up.close(timeout_s=5)
    assert (tmp_path / "store" / shard.relative_to(spool)).exists() and not shard.exists()
    assert journal.exists() and not (tmp_path / "store" / journal.relative_to(spool)).exists()
    assert report.pending == []


def test_a_journal_scan_ships_to_a_dask_worker(tmp_path):
    pytest.importorskip("distributed")
    from distributed.protocol import deserialize, serialize
    from amp_postmortem.reading.engines.scan import ShardScan, scan_shard
    run = load_run(_journaled_run(tmp_path))
    shard = run.tensor_shards[0]
    task = ShardScan(path=str(shard.path), columns=("step", "name"), steps=(2, 4))
    part = scan_shard(deserialize(*serialize(task)))
    assert part.error is None and sorted(set(part.table.column("step").to_pylist())) == [2, 4]


@pytest.mark.parametrize("command", ["summary", "nans", "scale", "ranges"])
def test_every_analysis_reads_a_journal_as_the_shard_it_becomes(tmp_path, command):
    """The same steps, once journaled (the job killed) and once published
    (closed): every analysis gives the same answer, but the run's path and
    status and the warning that the recorder was not closed."""
    journaled = _journaled_run(tmp_path, steps=12, full_every=4)
    published = tmp_path / "live"  # the same recorder, closed: one shard pair

    def answer(run):
        res = CliRunner().invoke(main, [command, str(run), "--json"])
        assert res.exit_code == 0, res.output
        text = res.stdout.replace(str(run), "RUN")
        doc = json.loads(text)
        for d in (doc, doc.get("run", {})):
            d.pop("warnings", None)
            d.pop("status", None)
        return doc

    assert list(published.glob("rank=0/steps/*.parquet")) and not list(journaled.glob("rank=0/steps/*"))
    killed, closed = answer(journaled), answer(published)
    if command == "summary":
        # The one difference summary makes: a recorder that never closed is
        # said so (never `healthy`), where the closed one finds nothing.
        assert [f["kind"] for f in killed.pop("findings")] == ["recording_not_closed"]
        assert [f["kind"] for f in closed.pop("findings")] == ["healthy"]
    assert killed == closed


def test_a_writer_that_gathers_rows_journals_them_in_batches_and_an_event_at_once(tmp_path, monkeypatch):
    """`gather_rows` (the Keras and Flax recorders: rows every step, from the
    training thread): steps with rows but nothing urgent wait, in order, for
    64 steps, 0.5 s or the next urgent step; a step with a NaN/Inf row is
    journalled and fsynced at once, after them; every row reaches the pair."""
    import numpy as np

    from recorders import writer as rw
    from recorders.host_run import TensorRow, tensor_columns
    from recorders.journal import read_journal

    syncs = []
    monkeypatch.setattr(Journal, "sync", lambda self, _s=Journal.sync: (syncs.append(self.index), _s(self))[1])
    rank_dir = tmp_path / "rank=0"
    w = ShardWriter(rank_dir, run_id=RUN_ID, rank=0, world_size=1, steps_per_shard=1000,
                    durable_interval_s=3600, gather_rows=True)

    def step(i, nan=0):
        rows = [TensorRow(name=name, kind="activation", phase="forward", order=k, call=0, dtype="float16",
                          numel=4, absmax=1.0, nan_count=nan if name == "b" else 0, inf_count=0)
                for k, name in enumerate(("a", "b"))]
        w.add_step({"step": i, "rank": 0, "wall_time": 0.0, "skipped": False, "loss": 1.0, "micro_batches": 1,
                    "tensor_rows": 2, "tier": "cheap"}, tensor_columns(i, 0, rows))

    def journaled():
        found = read_journal(rank_dir, 0)
        return ([], []) if found is None else (found[1]["step"].to_pylist(), found[2]["step"].to_pylist())

    for i in range(3):
        step(i)
    assert journaled() == ([], [])                       # held: nothing urgent
    step(3, nan=1)                                       # a NaN row: the held steps, then it, at once
    assert journaled() == ([0, 1, 2, 3], [0, 0, 1, 1, 2, 2, 3, 3]) and syncs == [0]
    for i in range(4, 4 + rw.JOURNAL_BATCH_STEPS):
        step(i)
    steps, rows = journaled()
    assert steps == list(range(4 + rw.JOURNAL_BATCH_STEPS)) and len(rows) == 2 * len(steps)
    step(100)
    monkeypatch.setattr(rw, "JOURNAL_BATCH_S", 0.0)      # the half second is up at the next step
    step(101)
    assert journaled()[0][-2:] == [100, 101]
    w.roll()
    w.wait_published()
    import pyarrow.parquet as pq
    steps = pq.read_table(rank_dir / schema.STEPS_DIR / schema.SHARD_FILE.format(index=0))["step"].to_pylist()
    tensors = pq.read_table(rank_dir / schema.TENSORS_DIR / schema.SHARD_FILE.format(index=0))
    assert steps == list(range(4 + rw.JOURNAL_BATCH_STEPS)) + [100, 101]
    assert tensors.num_rows == 2 * len(steps) and sum(tensors["nan_count"].to_pylist()) == 1
    assert tensors["name"].to_pylist() == ["a", "b"] * len(steps)
