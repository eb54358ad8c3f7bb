"""The cheap tier's device statistics reduced many at once
(`recorders/staged_stats.py`): the general path's values bit for bit, one
operation per row and a fixed number per flush, nothing read back to the
host; and a recorded job whose rows go through the stage writes the rows
the host path writes. Without a GPU the stage runs on CPU tensors
(`StatsStage(on_cpu=True)`), the same code a GPU job runs."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import amp_postmortem
from recorders import AmpRecorder
from recorders.staged_stats import StagedRow, StatsStage
from recorders.stats import _device_stats
from tiny_models import BoomNet, TinyNet, planted_job, same_rows, train


def _same(a, b) -> bool:
    return torch.equal(torch.nan_to_num(a, nan=-7.0), torch.nan_to_num(b, nan=-7.0))


def _tensors():
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for shape in [(3, 4), (17,), (), (5, 7, 2)]:
            out.append((torch.randn(shape, generator=g) * 300).to(dtype))
    planted = torch.randn(6, 5, generator=g).half()
    planted[1, 2], planted[0, 0], planted[3, 3] = math.nan, math.inf, -math.inf
    out += [planted, torch.full((9,), math.nan), torch.full((4,), -math.inf, dtype=torch.bfloat16),
            torch.randn(10, 8, generator=g).t(),  # strided
            torch.tensor([65504.0, -65504.0], dtype=torch.float16),
            torch.zeros(3)]
    return out


def test_staged_rows_are_the_general_paths_values_bit_for_bit():
    stage = StatsStage(on_cpu=True, capacity=256, max_numel=128)  # several flushes by capacity
    scale = torch.tensor(2.0 ** 16)
    tensors = _tensors() + [torch.randn(100) for _ in range(4)]
    rows = [stage.put(t) for t in tensors]
    scaled = torch.randn(4, 4) * 3e4
    scaled_row = stage.put(scaled, scale)
    assert all(isinstance(r, StagedRow) for r in rows) and isinstance(scaled_row, StagedRow)
    stage.flush()
    for t, r in zip(tensors, rows):
        assert _same(r.value, _device_stats(t, False, None, None, 65504.0)), (t.dtype, t.shape)
    assert _same(scaled_row.value, _device_stats(scaled, False, None, scale, 65504.0))


def test_a_tensor_seen_twice_is_staged_once_and_again_once_changed():
    stage = StatsStage(on_cpu=True)
    t = torch.tensor([1.0, -3.0])
    first = stage.put(t)
    assert stage.put(t) is first
    t.mul_(10)  # changed in place after its row was staged: a new row, and the first keeps its values
    second = stage.put(t)
    assert second is not first
    t.fill_(math.nan)  # the staged copies are what the rows read
    stage.flush()
    assert first.value[0].item() == 3.0 and second.value[0].item() == 30.0


def test_what_is_not_staged():
    stage = StatsStage()  # a GPU job's stage: CPU tensors keep the host path
    assert stage.put(torch.randn(3)) is None
    cpu = StatsStage(on_cpu=True, max_numel=10)
    assert cpu.put(torch.randn(11)) is None  # large: the general path
    assert cpu.put(torch.randn(3, dtype=torch.float64)) is None  # not exact in float32
    assert cpu.put(torch.empty(0)) is None
    assert cpu.put(torch.arange(3)) is None
    with torch.inference_mode():
        assert cpu.put(torch.randn(3)) is None  # no version counter


class _Ops(TorchDispatchMode):
    """The operations dispatched, views and metadata left out: what would
    be a kernel launch on a GPU."""

    VIEWS = {"slice", "view", "detach", "unbind", "alias", "_unsafe_view", "as_strided"}

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self.VIEWS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rows", [10, 200])
def test_one_operation_per_row_a_fixed_number_per_flush_and_no_host_read(rows):
    stage = StatsStage(on_cpu=True)
    tensors = [torch.randn(5, 3) for _ in range(rows)]
    scale, grad = torch.tensor(1024.0), torch.randn(2)
    stage.put(grad, scale)  # the layout's constants are built once: not counted below
    for t in tensors:
        stage.put(t)
    stage.flush()
    with _Ops() as mode:
        stage.put(grad, scale)
        for t in tensors:
            stage.put(t)
    puts = list(mode.ops)
    with _Ops() as mode:
        stage.flush()
    assert puts == ["copy_"] * (rows + 1)
    assert len(mode.ops) <= 20, mode.ops  # whatever the number of rows
    # `.item()`, `.tolist()`: a host read, a sync on a GPU
    assert "_local_scalar_dense" not in mode.ops


def _rows(run):
    cols = ["step", "name", "kind", "phase", "order", "call", "dtype", "numel",
            "absmax", "nan_count", "inf_count", "input_nonfinite"]
    df = amp_postmortem.load_run(run).scan_tensors(cols)
    return df.sort_values(["step", "kind", "name", "order", "call"]).reset_index(drop=True)


def _staged_on_cpu(run, **options):
    def make(model, opt, sc):
        rec = AmpRecorder(run, model, optimizer=opt, scaler=sc, **options)
        rec.hooks.shared.stage = StatsStage(on_cpu=True, capacity=512)  # flushes by capacity too
        return rec
    return make


def _host(run, **options):
    return lambda model, opt, sc: AmpRecorder(run, model, optimizer=opt, scaler=sc, **options)


@pytest.mark.parametrize("model, plant", [(TinyNet, None), (BoomNet, "forward"), (BoomNet, "backward")])
def test_a_job_recorded_through_the_stage_writes_the_host_paths_rows(tmp_path, model, plant):
    """fp16 autocast, a GradScaler (scaled parameter gradients), two
    micro-batches a step, a NaN/Inf planted in the forward or the backward:
    the same rows, values and counts as the host path's, and the training
    untouched."""
    data, on_step = planted_job(model, plant)

    runs = {}
    for path, make in (("host", _host), ("staged", _staged_on_cpu)):
        torch.manual_seed(0)
        runs[path] = train(model(), data, recorder=make(tmp_path / path, full_every=3), accumulate=2,
                           on_step=on_step)
        assert runs[path].rec.enabled
    assert runs["staged"].rec.hooks.shared.stage.staged > 2 * len(data)  # the rows of the cheap steps
    assert runs["staged"].losses == runs["host"].losses or all(
        a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(runs["staged"].losses, runs["host"].losses))
    host, staged = _rows(tmp_path / "host"), _rows(tmp_path / "staged")
    same_rows(host, staged)
    if plant:
        assert (staged["nan_count"] + staged["inf_count"]).sum() > 0
