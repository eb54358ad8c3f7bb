"""Shared fixtures: runs recorded once per session by the real recorder on
tiny CPU models (float16 CPU autocast, `torch.amp.GradScaler("cpu")`), each
named after the fault planted in it."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# The suite was written against every-step recording, and most of its tests
# are about what every-step recording writes (rows of every module on every
# step): they run in that mode, the one `AmpRecorder(mode="every_step")`
# and `$AMP_POSTMORTEM_MODE` select (subprocesses inherit it). The default
# (the sentinel: step facts every step, sampled rows, the failing step
# re-executed) is tested where it is the point: tests that take the
# `sentinel_mode` fixture (test_sentinel.py, and every comparison of the two
# modes) run without it.
os.environ["AMP_POSTMORTEM_MODE"] = "every_step"


@pytest.fixture
def sentinel_mode(monkeypatch):
    """The recorder's own default mode (no $AMP_POSTMORTEM_MODE)."""
    monkeypatch.delenv("AMP_POSTMORTEM_MODE", raising=False)


# ------------------------------------------------------------ xdist units
# `-n 2` (the README's test command): what a test module shares among its
# tests (module-scoped fixtures: a compiled job, a spawn of ranks, a Keras
# run; the lru-cached runs of tests/*_runs.py; test_readme's cached CLI
# calls) is made once per worker that runs one of its tests. xdist's `load`
# hands out chunks of tests that, late in the run, split modules between the
# workers, so both made them. This scheduler sends as one unit to one
# worker: every test of a module that shares something (SHARES finds it in
# the module's text), and the tests that read the session's short sample
# runs (test_sample_runs and test_sentinel's comparison of the two modes:
# generated once). Every other test is a unit of its own. Units go out
# largest first, so the single tests, last, balance the two workers.
# (`loadgroup` cannot do it: under pytest 9 its marks rename no test.)
SAMPLE_RUNS_GROUP = "short_sample_runs"
_SAMPLE_RUNS_TESTS = ("tests/test_sample_runs.py::",
                      "tests/test_sentinel.py::test_every_sample_run_gets_the_same_answers_in_both_modes[")
SHARES = re.compile(r"""@pytest\.fixture\([^)]*scope\s*=\s*["'](module|session)["']"""
                    r"|^\s*(import|from)\s+\w+_runs\b|^\s*(import|from)\s+test_\w+|lru_cache|functools\.cache",
                    re.MULTILINE)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load":  # `-n 2` alone; an explicit --dist keeps xdist's own
        return None
    from xdist.scheduler import LoadScopeScheduling

    rootpath, shares = config.rootpath, {}

    def shares_state(path: str) -> bool:
        if path not in shares:
            try:
                shares[path] = bool(SHARES.search((rootpath / path).read_text()))
            except OSError:
                shares[path] = True
        return shares[path]

    class SharedStateScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(_SAMPLE_RUNS_TESTS):
                return SAMPLE_RUNS_GROUP
            path = nodeid.split("::", 1)[0]
            return path if shares_state(path) else nodeid

    return SharedStateScheduling(config, log)


SAMPLES = Path(__file__).resolve().parents[1] / "sample_runs"


def generate_short_sample_runs(folder: Path, mode: str) -> Path:
    """sample_runs/generate.py's short schedule into `folder`, recorded in
    `mode` ($AMP_POSTMORTEM_MODE)."""
    subprocess.run([sys.executable, str(SAMPLES / "generate.py"), "--out", str(folder), "--short"],
                   check=True, cwd=SAMPLES.parent, capture_output=True, text=True, timeout=900,
                   env={**os.environ, "AMP_POSTMORTEM_MODE": mode})
    return folder


@pytest.fixture(scope="session")
def short_sample_runs(tmp_path_factory):
    """The sample runs' jobs on the short schedule, recorded every step (the
    suite's mode), generated once for test_sample_runs and test_sentinel
    (tests that take it carry `xdist_group(SAMPLE_RUNS_GROUP)`: one worker).
    Read-only."""
    return generate_short_sample_runs(tmp_path_factory.mktemp("sample_runs"), "every_step")

# ------------------------------------------------------------ analyzer runs
# Planted-fault constants the tests pin against.
OVERFLOW_STEP = 7          # Boom multiplies by 1e6 at this step only
INPUT_NAN_STEP = 3         # the batch of this step holds a NaN
COLLAPSE_ONSET = 40        # GradAmp's gradient gain starts growing here
COLLAPSE_STEPS = 80
TINY_SCALE = 2.0 ** -10    # fixed loss scale of the underflow run


def record_run(path, *, steps, plant=None, scaler_kwargs=None, lr=0.01, fixed_batch=False,
               close=True, seed=0, autocast_dtype="float16", **recorder_kwargs):
    """Train `BoomNet` for `steps` steps under the real recorder (CPU
    autocast to `autocast_dtype`). `plant(step, model, x)` may change the
    model or the batch before each step."""
    import torch
    from tiny_models import BoomNet, recorder_at, train

    torch.manual_seed(seed)
    model = BoomNet()
    gen = torch.Generator().manual_seed(seed)
    x0, y0 = torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)
    data = [(x0.clone(), y0) if fixed_batch else (torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen))
            for _ in range(steps)]
    # Every step held until the writer decides on its bundle: on a loaded
    # machine the writer falls behind the default hold, and which bundles a
    # test run keeps must not depend on the machine's load.
    recorder_kwargs.setdefault("hold_steps", steps + 8)
    rec = train(model, data, recorder=recorder_at(path, **recorder_kwargs), scaler=scaler_kwargs or {},
                lr=lr, dtype=getattr(torch, autocast_dtype), on_step=plant, close=close).rec
    if not close:
        rec.flush()  # leaves the manifest "open", as a killed job would
        rec.hooks.remove()
    return Path(path)


def _overflow(step, model, x):
    model.block.boom.gain = 1e6 if step == OVERFLOW_STEP else 1.0


def _input_nan(step, model, x):
    if step == INPUT_NAN_STEP:
        x[0, 0] = float("nan")


def _collapse(step, model, x):
    # From the onset on, the gradient through `amp` doubles every 2 steps,
    # so the scaler must halve about every 2 steps to keep it finite.
    model.amp.gain = 2.0 ** ((step - COLLAPSE_ONSET + 1) / 2) if step >= COLLAPSE_ONSET else 1.0


@pytest.fixture(scope="session")
def overflow_run(tmp_path_factory):
    """Boom (block.boom) overflows float16 in the forward pass of step 7."""
    return record_run(tmp_path_factory.mktemp("runs") / "overflow_in_block_boom", steps=12,
                      plant=_overflow, scaler_kwargs={"init_scale": 2.0 ** 8, "growth_interval": 10 ** 6},
                      steps_per_shard=5, full_every=5)


@pytest.fixture(scope="session")
def input_nan_run(tmp_path_factory):
    """The batch of step 3 holds a NaN."""
    return record_run(tmp_path_factory.mktemp("runs") / "nan_in_input", steps=6, plant=_input_nan,
                      scaler_kwargs={"init_scale": 2.0 ** 8})


@pytest.fixture(scope="session")
def collapse_run(tmp_path_factory):
    """Default GradScaler (calibrates down from 65536, growth probes every
    10 clean steps); from step 40 the gradient through `amp` grows
    exponentially and the scale collapses."""
    return record_run(tmp_path_factory.mktemp("runs") / "scale_collapse_from_40", steps=COLLAPSE_STEPS,
                      plant=_collapse, scaler_kwargs={"growth_interval": 10}, lr=0.0, fixed_batch=True,
                      steps_per_shard=20, full_every=10)


@pytest.fixture(scope="session")
def healthy_run(tmp_path_factory):
    """A plain, healthy fp16 run with the default GradScaler."""
    return record_run(tmp_path_factory.mktemp("runs") / "healthy", steps=40,
                      scaler_kwargs={"growth_interval": 10}, steps_per_shard=16, full_every=4)


@pytest.fixture(scope="session")
def underflow_run(tmp_path_factory):
    """A fixed tiny loss scale (2**-10, never grows): gradients underflow."""
    return record_run(tmp_path_factory.mktemp("runs") / "grad_underflow_tiny_scale", steps=12,
                      scaler_kwargs={"init_scale": TINY_SCALE, "growth_interval": 10 ** 9}, full_every=1)


@pytest.fixture(scope="session")
def two_rank_run(tmp_path_factory):
    """Two ranks (rank 1 has a different seed) written into one run directory."""
    path = tmp_path_factory.mktemp("runs") / "two_ranks"
    for rank in (0, 1):
        record_run(path, steps=6, seed=rank, rank=rank, world_size=2, run_id="two-rank-run",
                   scaler_kwargs={"init_scale": 2.0 ** 8})
    return path


@pytest.fixture(scope="session")
def uneven_ranks_run(tmp_path_factory):
    """Three ranks that disagree: rank 0 stops after 8 steps (steps 8-11 have
    no rank-0 row); rank 1 runs without a loss scaler (no scale: the
    optimizer applies its non-finite gradients from step 7 on); rank 2
    overflows at step 7 and skips it. Shards of 3, 4 and 5 steps."""
    path = tmp_path_factory.mktemp("runs") / "uneven_ranks"
    common = dict(world_size=3, run_id="uneven-ranks", full_every=4)
    record_run(path, steps=8, seed=0, rank=0, steps_per_shard=3, scaler_kwargs={"init_scale": 2.0 ** 8}, **common)
    record_run(path, steps=12, seed=1, rank=1, steps_per_shard=4, plant=_overflow,
               scaler_kwargs={"enabled": False}, **common)
    record_run(path, steps=12, seed=2, rank=2, steps_per_shard=5, plant=_overflow,
               scaler_kwargs={"init_scale": 2.0 ** 10, "growth_interval": 3}, **common)
    return path


@pytest.fixture(scope="session")
def open_run(tmp_path_factory):
    """The recorder was never closed (the job was killed after a flush)."""
    return record_run(tmp_path_factory.mktemp("runs") / "never_closed", steps=4, close=False)


@pytest.fixture
def copy_run(tmp_path):
    """copy_run(src) -> a private copy of a session run that a test may damage."""
    def copy(src, name=None):
        dst = tmp_path / (name or Path(src).name)
        shutil.copytree(src, dst)
        return dst
    return copy


@pytest.fixture
def edit_manifest():
    """edit_manifest(path, **changes): overwrite keys of a manifest.json."""
    def edit(path: Path, **changes) -> None:
        m = json.loads(Path(path).read_text())
        m.update(changes)
        Path(path).write_text(json.dumps(m))
    return edit


def _rising(step, model, x):
    # block.boom's output doubles every 2 steps: headroom falls 0.5 bit/step.
    model.block.boom.gain = 2.0 ** (step / 2)


@pytest.fixture(scope="session")
def rising_run(tmp_path_factory):
    """block.boom's activation grows steadily towards float16 overflow."""
    return record_run(tmp_path_factory.mktemp("runs") / "activation_heading_for_overflow", steps=20,
                      plant=_rising, scaler_kwargs={"init_scale": 2.0 ** 4}, lr=0.0, fixed_batch=True)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Replays of tiny models on a shared 2-core machine: OpenMP threads only
    contend (tiny matmuls ran ~1000x slower with two), so these modules run
    torch on one thread and restore the setting after."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def running_run(tmp_path):
    """A job still running: 4 steps recorded, its recorder neither flushed
    nor closed, so its steps sit in the journal (closed at teardown)."""
    import time

    import torch
    from tiny_models import BoomNet, recorder_at, train

    from amp_postmortem.reading.tail import RunTail

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(4)]
    path = tmp_path / "running"
    rec = train(BoomNet(), data, recorder=recorder_at(path, steps_per_shard=100),
                scaler={"init_scale": 2.0 ** 8}, close=False).rec
    deadline = time.monotonic() + 60
    while RunTail(path).read().last_step != 3:  # the writer thread journals each step soon after it
        assert time.monotonic() < deadline, "the recorder journaled no step in 60 s"
        time.sleep(0.05)
    yield path
    rec.close()


PROBE_STEPS = 4


def record_probed_run(path, *, probe=("block.norm", "block.attn"), steps=PROBE_STEPS, **recorder_kwargs):
    """Train `ProbeNet` (float16 CPU autocast, a GradScaler) with the op
    probe on its planted HalfNorm and its masked attention."""
    import torch
    from tiny_models import ProbeNet, batches, recorder_at, train

    torch.manual_seed(0)
    model = ProbeNet()
    trained = train(model, batches(steps, shape=(2, 6)), lr=0.01,
                    recorder=recorder_at(path, probe=probe, **recorder_kwargs))
    return Path(path), trained


@pytest.fixture(scope="session")
def probed_run(tmp_path_factory):
    """ProbeNet's `block.norm` squares values of +-250 in float16 (62,496:
    0.07 bits below 65504) while its output stays near 1; `block.attn`
    masks with -Inf. Probed: both."""
    return record_probed_run(tmp_path_factory.mktemp("runs") / "variance_near_overflow_inside_norm")[0]
