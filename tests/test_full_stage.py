"""The full tier's rows of small CPU tensors reduced by groups
(`recorders/full_stage.py`): the definitions' values bit for bit, whatever
the grouping, a tensor's values as they were when its row was staged; and a
recorded job whose full-tier rows go through the stage writes the rows the
per-tensor path writes."""
from __future__ import annotations

import math

import pytest
import torch

import amp_postmortem
from recorders import stats
from recorders.collectors.state import StepState
from recorders.full_stage import MAX_NUMEL, FullRow, FullStage, resolve
from recorders.format import schema
from tiny_models import BoomNet, TinyNet, planted_job, recorder_at, same_rows, train


def _same(row: FullRow, ref: torch.Tensor) -> bool:
    got = torch.tensor(row.value, dtype=torch.float64)
    return torch.equal(got.nan_to_num(nan=-7.0), ref.nan_to_num(nan=-7.0))


def _random_tensors(seed: int, count: int, sizes=(1, 2, 3, 7, 64, 300)):
    """Tensors of a few sizes (groups of many) and magnitudes from 1e-9 to
    1e9 (subnormal shares, squares beyond float32), in the three dtypes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = sizes[int(torch.randint(0, len(sizes), (), generator=g))]
        magnitude = 10.0 ** float(torch.empty(()).uniform_(-9, 9, generator=g))
        x = torch.randn(n, generator=g) * magnitude
        if i % 5 == 0:
            x[:: max(1, n // 3)] = 0
        dtype = (torch.float16, torch.bfloat16, torch.float32)[i % 3]
        out.append(x.to(dtype))
    return out


@pytest.mark.parametrize("near_overflow", [schema.FP16_MAX, 100.0])
@pytest.mark.parametrize("scale", [None, 1024.0, 3.0])
def test_staged_rows_are_the_definitions_bit_for_bit(scale, near_overflow):
    stage = FullStage(near_overflow)
    s = None if scale is None else torch.tensor(scale)
    tensors = _random_tensors(3, 600)
    rows = [stage.put(t, s) for t in tensors]
    assert all(type(r) is FullRow for r in rows)
    assert stage.flush()
    for i, (t, r) in enumerate(zip(tensors, rows)):
        ref = stats._device_stats(t, True, None, s, near_overflow)
        assert _same(r, ref), (i, t.dtype, t.numel(), float(t.abs().max()))


def test_rows_of_the_largest_staged_size_and_of_2d_tensors():
    g = torch.Generator().manual_seed(5)
    stage = FullStage(schema.FP16_MAX)
    tensors = [torch.randn(MAX_NUMEL, generator=g).half() for _ in range(3)]
    tensors += [torch.randn(16, 24, generator=g).bfloat16() * 1e-6 for _ in range(4)]
    rows = [stage.put(t) for t in tensors]
    stage.flush()
    for t, r in zip(tensors, rows):
        assert _same(r, stats._device_stats(t, True, None, None, schema.FP16_MAX))


def test_nonfinite_and_squares_overflowing_rows_take_the_general_path_among_finite_ones():
    stage = FullStage(schema.FP16_MAX)
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(40, generator=g).half() for _ in range(6)]
    tensors[1][3] = math.nan
    tensors[2][0], tensors[2][5] = math.inf, -math.inf
    tensors[3].fill_(math.nan)
    tensors[4] = torch.full((40,), 3e38)  # float32 squares overflow: divided first
    rows = [stage.put(t) for t in tensors]
    stage.flush()
    for t, r in zip(tensors, rows):
        assert _same(r, stats._device_stats(t, True, None, None, schema.FP16_MAX))
    assert r.value[1] == 0 and rows[1].value[1] == 1 and rows[2].value[2] == 2


def test_a_row_keeps_the_values_of_its_tensor_when_it_was_staged():
    stage = FullStage(schema.FP16_MAX)
    t = torch.tensor([1.0, -3.0, 0.5])
    before = t.clone()
    first = stage.put(t)
    assert stage.put(t) is first  # unchanged: one row
    t.mul_(100)  # in place, before the flush
    second = stage.put(t)
    assert second is not first
    stage.flush()
    assert _same(first, stats._device_stats(before, True, None, None, schema.FP16_MAX))
    assert _same(second, stats._device_stats(t, True, None, None, schema.FP16_MAX))
    assert first.value[5] == 1.0 and second.value[5] == 100.0  # max


def test_tensors_the_stage_leaves_to_the_per_tensor_path():
    stage = FullStage(schema.FP16_MAX)
    assert stage.put(torch.randn(4, dtype=torch.float64)) is None
    assert stage.put(torch.empty(0)) is None
    assert stage.put(torch.randn(MAX_NUMEL + 1)) is None
    assert stage.put(torch.randn(8, 6)[:, ::2]) is None  # not contiguous
    assert stage.put(torch.empty(4, device="meta")) is None  # not on the CPU: its values would be read back

    class Sub(torch.Tensor):
        pass
    assert stage.put(torch.randn(4).as_subclass(Sub)) is None  # a subclass (a DTensor): its own rules
    with torch.inference_mode():
        inference = torch.randn(4)
    assert stage.put(inference) is None
    assert stage.staged == 0 and not stage.flush()


def test_held_values_force_a_flush_and_a_group_of_one_is_summarised_alone(monkeypatch):
    import recorders.full_stage as full_stage
    monkeypatch.setattr(full_stage, "MAX_HELD", 100)
    stage = FullStage(schema.FP16_MAX)
    a, b = torch.randn(60), torch.randn(60)
    ra = stage.put(a)
    rb = stage.put(b)  # over the bound: a's row flushed first
    assert ra.value is not None and rb.value is None
    stage.flush()
    for t, r in ((a, ra), (b, rb)):
        assert _same(r, stats._device_stats(t, True, None, None, schema.FP16_MAX))


def test_resolve_puts_values_in_rows_gradient_slots_and_parameter_values():
    stage = FullStage(schema.FP16_MAX)
    st = StepState(1, True, True)
    x, g, p = torch.randn(5), torch.randn(5), torch.randn(5)
    st.stats.append(stage.put(x))
    st.param_grads["w"] = [0, stage.put(g), None, "float32", 5]
    st.param_values.append(("w", None, stage.put(p)))
    stage.flush()
    resolve(st)
    assert type(st.stats[0]) is tuple and type(st.param_grads["w"][1]) is tuple
    assert type(st.param_values[0][2]) is tuple
    assert st.param_values[0][2][5] == float(p.max())


def _rows(run):
    cols = ["step", "name", "kind", "phase", "order", "call", "dtype", "numel",
            *schema.FULL_STATS]
    df = amp_postmortem.load_run(run).scan_tensors(cols)
    return df.sort_values(["step", "kind", "name", "order", "call"]).reset_index(drop=True)


@pytest.mark.parametrize("model, plant, dtype", [(TinyNet, None, torch.bfloat16), (BoomNet, "forward", torch.float16),
                                                 (BoomNet, "backward", torch.float16)])
def test_a_job_recorded_through_the_stage_writes_the_per_tensor_rows(tmp_path, monkeypatch, model, plant, dtype):
    """Full-tier steps (sampled, and the failing step re-executed by the
    sentinel), a GradScaler (unscaled parameter gradients), two
    micro-batches a step, a NaN/Inf planted in the forward or the backward:
    the rows written through the stage are the per-tensor path's."""
    data, on_step = planted_job(model, plant)

    staged = {"count": 0}
    original = FullStage.put

    def counting(self, t, scale=None):
        row = original(self, t, scale)
        staged["count"] += row is not None
        return row

    runs = {}
    for path, put in (("per_tensor", lambda self, t, scale=None: None), ("staged", counting)):
        monkeypatch.setattr(FullStage, "put", put)
        torch.manual_seed(0)
        runs[path] = train(model(), data, recorder=recorder_at(tmp_path / path, full_every=3), accumulate=2,
                           on_step=on_step, dtype=dtype)
        assert runs[path].rec.enabled
    assert staged["count"] > 2 * len(data)  # the full tier's rows went through the stage
    per_tensor, through = _rows(tmp_path / "per_tensor"), _rows(tmp_path / "staged")
    assert (through["share_sample_size"] > 0).any()  # full-tier rows among them
    same_rows(per_tensor, through)
    if plant:
        assert (through["nan_count"] + through["inf_count"]).sum() > 0
