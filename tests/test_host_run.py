"""What the Keras and Flax recorders share (recorders/host_run.py): the
backward rows' order."""
from __future__ import annotations

from recorders.host_run import backward_rows

ROW = [1.0, 0.0, 0.0, 0.0, 4.0]


def test_parameter_gradients_sit_inside_their_layers_backward():
    module_rows = [("", "grad_output", 0, "float16", ROW), ("d2", "grad_output", 0, "float16", ROW),
                   ("d2", "grad_input", 0, "float16", [1.0, 0.0, 2.0, 1.0, 4.0]),
                   ("d1", "grad_output", 0, "float16", ROW)]
    # In variable order; `other.w` has no row of its module: after the variable before it in the backward.
    grads = [("d1.kernel", "float32", ROW), ("d1.bias", "float32", ROW), ("other.w", "float32", ROW),
             ("d2.kernel", "float32", ROW)]
    rows = backward_rows(module_rows, grads)
    assert [(r.name, r.kind) for r in rows] == [
        ("", "grad_output"), ("d2", "grad_output"), ("d2.kernel", "param_grad"), ("other.w", "param_grad"),
        ("d2", "grad_input"), ("d1", "grad_output"), ("d1.bias", "param_grad"), ("d1.kernel", "param_grad")]
    assert [r.order for r in rows] == list(range(8))
    d2_in = rows[4]
    assert (d2_in.inf_count, d2_in.input_nonfinite, d2_in.numel) == (2, 1, 4)
    assert rows[1].input_nonfinite is None and all(r.phase == "backward" for r in rows)
