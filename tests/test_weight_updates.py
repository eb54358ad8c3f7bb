"""The re-run's watchers of low-precision weights (`whatif/weight_updates.py`):
half an ulp, stochastic rounding, the count of updates left unchanged."""
from __future__ import annotations

import torch

from amp_postmortem.whatif.weight_updates import StochasticRounding, UpdateCount, half_ulp


def test_half_an_ulp_is_the_update_a_weight_rounds_away():
    w = torch.tensor([1.0, 1.5, 3.0, -0.75])
    assert half_ulp(w, torch.bfloat16).tolist() == [2.0 ** -8, 2.0 ** -8, 2.0 ** -7, 2.0 ** -9]
    assert half_ulp(torch.tensor([1.0, 1e-6]), torch.float16).tolist() == [2.0 ** -11, 2.0 ** -25]  # subnormal spacing
    for dtype in (torch.bfloat16, torch.float16):
        below = w + half_ulp(w, dtype) * 0.99 * torch.sign(w)
        assert torch.equal(below.to(dtype), w.to(dtype))      # rounded to nearest: lost
        above = w + half_ulp(w, dtype) * 1.01 * torch.sign(w)
        assert not torch.equal(above.to(dtype), w.to(dtype))  # kept


def test_stochastic_rounding_keeps_an_update_in_expectation():
    x = torch.tensor([1.0 + 1e-4, -3.00071, 0.123456, 1e-6]).repeat(20000)
    for dtype in (torch.bfloat16, torch.float16):
        r = StochasticRounding(seed=1).round(x, dtype)
        assert r.dtype == dtype
        nearest = x.to(dtype).float().view(20000, 4)[0]
        mean = r.float().view(20000, 4).mean(0)
        # each value lies on one of its two neighbours, their mean on the value (within sampling error)
        assert torch.allclose(mean, x[:4], rtol=0, atol=float(half_ulp(x[:4], dtype).max()) * 0.05)
        assert not torch.equal(nearest, x[:4])


def test_the_count_leaves_out_zero_gradients_and_skipped_steps():
    p = torch.nn.Parameter(torch.tensor([1.0, 1.0, 1.0], dtype=torch.bfloat16))
    p.grad = torch.tensor([1.0, 1.0, 0.0], dtype=torch.bfloat16)
    count, params = UpdateCount(), [("w", p)]
    count.before(params)
    with torch.no_grad():
        p.add_(torch.tensor([1e-4, 0.5, 0.5], dtype=torch.float32).to(torch.bfloat16))  # 1e-4 rounds away
    count.after(params, skipped=False)
    count.before(params)
    count.after(params, skipped=True)
    assert (count.moved, count.unchanged) == ([2, 0], [1, 0]) and count.total_share == 0.5
