"""recorders.aggregate: a step's raw hook rows become the tensors table's
rows, on the writer thread."""
from __future__ import annotations

import math

import numpy as np

from recorders.format import schema
from recorders.aggregate import COUNT_KIND, merge_rows

NAN = math.nan


def _full(absmax, nan, inf, mean, rms, mn=-1.0, mx=1.0):
    return [absmax, nan, inf, NAN, mn, mx, mean, rms, 0.25, 0.0, 0.0, 0.0, 8.0]


def test_rows_of_one_key_merge_by_max_sum_and_numel_weighted_mean():
    # Two micro-batches of one module call (same name, kind, phase, call).
    meta = [("fc", "activation", "forward", 0, 0, "float16", 10, None),
            ("fc", "activation", "forward", 0, 0, "float16", 30, None)]
    stats = np.array([_full(2.0, 1, 0, 1.0, 2.0, mn=-2.0), _full(3.0, 0, 2, 5.0, 1.0, mx=3.0)])
    cols = merge_rows(meta, stats)
    assert cols["name"] == ["fc"] and cols["numel"].tolist() == [40]
    assert cols["absmax"][0] == 3.0 and cols["nan_count"][0] == 1 and cols["inf_count"][0] == 2
    assert cols["min"][0] == -2.0 and cols["max"][0] == 3.0
    assert cols["mean"][0] == (1.0 * 10 + 5.0 * 30) / 40
    assert math.isclose(cols["rms"][0], math.sqrt((4.0 * 10 + 1.0 * 30) / 40))
    assert cols["share_sample_size"][0] == 16.0


def test_a_step_of_unique_keys_keeps_every_value_in_execution_order():
    # The usual step: each key once. Its values come out bit for bit (no
    # weighted mean of one part), forward rows first, each phase by order.
    rng = np.random.default_rng(0)
    meta = [("b", "grad_output", "backward", 0, 0, "bfloat16", 7, None),
            ("a", "activation", "forward", 1, 0, "bfloat16", 3, None),
            ("c", "activation", "forward", 0, 0, "float32", 5, None)]
    stats = np.array([_full(*rng.random(5)) for _ in meta]) * 1e-3 + 0.1
    stats[:, 1:3] = 0  # counts
    stats[0, 6] = NAN  # a null mean stays null
    cols = merge_rows(meta, stats.copy())
    assert cols["name"] == ["c", "a", "b"] and cols["order"].tolist() == [0, 1, 0]
    for j, name in enumerate(schema.FULL_STATS):
        if name in ("input_nonfinite", "nan_count", "inf_count"):
            continue
        expected = stats[[2, 1, 0], j]
        assert np.array_equal(cols[name], expected, equal_nan=True), name


def test_input_nonfinite_adds_up_the_counts_of_the_rows_that_held_the_inputs():
    meta = [("", "input", "forward", 0, 0, "float32", 4, None),
            ("", COUNT_KIND, "forward", -1, 0, "float32", 4, None),
            ("fc", "activation", "forward", 1, 0, "float32", 4, (0, 1)),
            ("head", "activation", "forward", 2, 0, "float32", 4, ())]
    stats = np.array([[1.0, 2, 0, NAN], [1.0, 0, 3, NAN], [1.0, 0, 0, NAN], [1.0, 0, 0, NAN]])
    cols = merge_rows(meta, stats)
    assert cols["kind"] == ["input", "activation", "activation"]  # the count-only row is not written
    assert math.isnan(cols["input_nonfinite"][0])  # no inputs known: null
    assert cols["input_nonfinite"][1:].tolist() == [5.0, 0.0]
