"""`NormPlan`: the CPU's grouped gradient norms equal the per-tensor loop's,
in the gradients' own order, and give way to the loop on what the plan did
not foresee."""
import math

import pytest
import torch

from recorders.collectors.grad_norms import (BIG_NUMEL, MIN_GROUP, NormPlan, big_positions, cpu_norms, grad_norms,
                                             settle, square_sum)


def _params(shapes, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=g, dtype=dtype)) for s in shapes]


def _grads(params, scale=1.0):
    """Gradients set on `params` (the plan reads them there), returned in
    the parameters' order."""
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=g, dtype=p.dtype) * scale for p in params]
    for p, grad in zip(params, grads):
        p.grad = grad
    return grads


def _in_params_order(plan, norms):
    """The plan's norms (its order) put back in the parameters' order."""
    out = torch.empty_like(norms)
    out[torch.tensor(plan.order)] = norms
    return out


def test_grouped_norms_match_the_loop_in_the_gradients_order():
    # Interleaved shapes: groups of (16, 16) and (16,), a large one and a lone one.
    shapes = [(16, 16), (16,)] * 6 + [(300, 300), (3, 5), (16, 16), (2, 3, 4)] * 2
    params = _params(shapes)
    plan = NormPlan(params)
    assert plan.useful and len(plan.groups) >= 2
    grads = _grads(params)
    expected = torch.stack([torch.linalg.vector_norm(g) for g in grads])
    # In the plan's order, read off the parameters; `in_order` and `grad_at` agree with it.
    got, sq = settle(plan.norms(), plan.grad_at)
    torch.testing.assert_close(got, expected[plan.order], rtol=1e-6, atol=0)
    assert [plan.grad_at(i) is g for i, g in enumerate(plan.in_order(grads))] == [True] * len(grads)
    assert sq == pytest.approx(float((expected.double() ** 2).sum()), rel=1e-6)
    # The loop the recorder falls back on gives the same, in the gradients' order.
    loop, loop_sq = cpu_norms(grads)
    torch.testing.assert_close(loop, expected, rtol=1e-6, atol=0)
    assert loop_sq == pytest.approx(sq, rel=1e-6)


def test_a_nonfinite_gradient_stays_at_its_position():
    params = _params([(8, 8)] * (MIN_GROUP + 2) + [(5,)])
    grads = _grads(params)
    grads[3][2, 1] = float("nan")
    grads[-1][0] = float("inf")
    plan = NormPlan(params)
    norms, sq = settle(plan.norms(), plan.grad_at)
    bad = torch.nonzero(~torch.isfinite(_in_params_order(plan, norms))).flatten().tolist()
    assert bad == [3, len(grads) - 1]
    assert sq != sq or sq == float("inf")
    loop, _ = cpu_norms(grads)
    assert torch.nonzero(~torch.isfinite(loop)).flatten().tolist() == bad


def test_a_float32_overflow_is_taken_again_in_float64():
    params = _params([(8, 8)] * MIN_GROUP)
    grads = _grads(params)
    grads[1].fill_(1e30)  # finite values whose squares overflow float32
    plan = NormPlan(params)
    norms, sq = settle(plan.norms(), plan.grad_at)
    assert norms.dtype == torch.float64 and torch.isfinite(norms).all() and sq == float((norms ** 2).sum())
    assert _in_params_order(plan, norms)[1].item() == pytest.approx(1e30 * 8, rel=1e-6)


def test_norms_whose_squares_overflow_float32_are_summed_in_float64():
    """Finite float32 norms of ~1e20: their square sum (a float32 dot
    product) overflows, the float64 one does not; a NaN stays NaN."""
    params = _params([(4,)] * MIN_GROUP)
    grads = _grads(params)
    grads[2].fill_(1e20)  # a norm of 2e20: finite in float32, its square is not
    plan = NormPlan(params)
    norms, sq = settle(plan.norms(), plan.grad_at)
    assert torch.isfinite(norms).all() and math.isfinite(sq)
    assert sq == pytest.approx(float((norms.double() ** 2).sum()), rel=1e-6) and sq > 4e40
    assert square_sum(torch.tensor([3.0, 4.0])) == 25.0
    assert math.isnan(square_sum(torch.tensor([1.0, float("nan")])))


def test_big_gradients_are_taken_by_dot_in_their_place():
    # Large float32 gradients (BLAS dot, every thread) among small ones and a
    # group: the same norms, in the same order, non-finite ones where they
    # are, and a square that overflows float32 taken again in float64.
    shapes = [(BIG_NUMEL,), (16,)] * 2 + [(16, 16)] * MIN_GROUP + [(2, BIG_NUMEL // 2)]
    params = _params(shapes)
    grads = _grads(params)
    assert big_positions(params, torch.float32) == {0, 2, len(params) - 1}
    assert big_positions(_params([(BIG_NUMEL,)], dtype=torch.float16), torch.float32) == frozenset()
    expected = torch.stack([torch.linalg.vector_norm(g) for g in grads])
    plan = NormPlan(params)
    assert plan.big == {0, 2, len(params) - 1}
    got, sq = settle(plan.norms(), plan.grad_at)
    torch.testing.assert_close(got, expected[plan.order], rtol=1e-5, atol=0)
    loop, loop_sq = cpu_norms(grads, big=plan.big)
    torch.testing.assert_close(loop, expected, rtol=1e-5, atol=0)
    assert loop_sq == pytest.approx(float((expected.double() ** 2).sum()), rel=1e-5)
    grads[2][7] = float("nan")
    grads[1][0] = float("inf")
    loop, _ = cpu_norms(grads, big=plan.big)
    assert torch.nonzero(~torch.isfinite(loop)).flatten().tolist() == [1, 2]
    grads[1].fill_(1.0)
    grads[2].fill_(1e20)  # a finite gradient whose square sum overflows float32
    loop, sq = cpu_norms(grads, big=plan.big)
    assert torch.isfinite(loop).all() and loop[2].item() == pytest.approx(1e20 * BIG_NUMEL ** 0.5, rel=1e-6)


def test_what_the_plan_did_not_foresee_raises_for_the_loop_to_take():
    params = _params([(8, 8)] * MIN_GROUP)
    _grads(params)
    params[2].grad = None  # a parameter that got no gradient this step
    with pytest.raises((TypeError, RuntimeError)):
        NormPlan(params).norms()


def test_float64_and_half_gradients():
    params = _params([(8, 8)] * MIN_GROUP, dtype=torch.float64)
    grads = _grads(params)
    expected = torch.stack([torch.linalg.vector_norm(g) for g in grads])
    torch.testing.assert_close(NormPlan(params).norms(), expected)
    torch.testing.assert_close(grad_norms(grads), expected)
    half = _params([(8, 8)] * MIN_GROUP, dtype=torch.float16)
    hgrads = _grads(half, scale=1000.0)  # squares overflow float16: summed in float32
    norms = NormPlan(half).norms()
    assert norms.dtype == torch.float32 and torch.isfinite(norms).all()
    torch.testing.assert_close(norms, torch.stack([torch.linalg.vector_norm(g.float()) for g in hgrads]))


@pytest.mark.parametrize("fault", [None, "nan", "inf", "float32_overflow", "half"])
def test_facts_give_the_square_sum_alone_when_finite_and_the_norms_otherwise(fault):
    """`NormPlan.facts`: finite gradients give (None, their square sum),
    one norm a group; a NaN, an Inf or a square sum past float32's range
    gives the norms and sum `settle(norms())` gives, in the plan's order."""
    dtype = torch.float16 if fault == "half" else torch.float32
    params = _params([(8, 8)] * (MIN_GROUP + 1) + [(4,)] * MIN_GROUP + [(3, 5)], dtype=dtype)
    grads = _grads(params, scale=1000.0 if fault == "half" else 1.0)
    if fault == "nan":
        grads[2][1, 1] = float("nan")
    elif fault == "inf":
        grads[-1][0, 0] = float("inf")
    elif fault == "float32_overflow":
        grads[MIN_GROUP + 2].fill_(1e20)  # norms of 2e20: finite, their squares are not in float32
    plan = NormPlan(params)
    read = []
    norms, sq = plan.facts(read)
    assert [g for group in read for g in group] == [params[i].grad for i in plan.order]
    want_norms, want_sq = settle(plan.norms(), plan.grad_at)
    if fault in (None, "half", "float32_overflow"):
        exact = sum(float(torch.linalg.vector_norm(g.double())) ** 2 for g in grads)
        assert sq == pytest.approx(exact, rel=1e-5) and sq == pytest.approx(want_sq, rel=1e-5)
    if fault in (None, "half"):
        assert norms is None
    else:
        torch.testing.assert_close(norms, want_norms, equal_nan=True)
        assert sq == want_sq or (math.isnan(sq) and math.isnan(want_sq))


def _recorded_steps(tmp_path, monkeypatch, name: str, plan_on: bool, inf_at: int | None = None):
    """The steps table of a deep narrow model (the plan's case) trained 5
    steps, its gradients taken by the plan or (`plan_on` False: no group
    is worth one) the per-tensor loop; an Inf weight planted at `inf_at`."""
    from recorders import AmpRecorder
    import amp_postmortem as ap

    if not plan_on:
        monkeypatch.setattr("recorders.collectors.grad_norms.MIN_GROUP", 10 ** 9)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    rec = AmpRecorder(tmp_path / name, model, optimizer=opt, mode="sentinel")
    for step in range(5):
        if step == inf_at:
            with torch.no_grad():
                model[4].weight[0, 0] = float("inf")
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        rec.step(loss)
    rec.close()
    monkeypatch.undo()
    return ap.load_run(tmp_path / name).steps


def test_the_recorder_names_a_nonfinite_gradient_with_and_without_the_plan(tmp_path, monkeypatch):
    """A planted Inf weight: the steps from then on count the same
    non-finite gradients whether the plan (square sums, norms only then)
    or the per-tensor loop took them."""
    with_plan = _recorded_steps(tmp_path, monkeypatch, "plan", True, inf_at=3)
    without = _recorded_steps(tmp_path, monkeypatch, "loop", False, inf_at=3)
    counts = with_plan["nonfinite_param_grads"].tolist()
    assert counts[:3] == [0, 0, 0] and all(c > 0 for c in counts[3:])
    assert counts == without["nonfinite_param_grads"].tolist()
    norms = with_plan["grad_norm"].tolist()
    assert all(math.isfinite(v) for v in norms[:3]) and not any(math.isfinite(v) for v in norms[3:])


def test_the_recorder_takes_the_same_facts_with_and_without_the_plan(tmp_path, monkeypatch):
    """A deep narrow model (the plan's case) records the gradient norm the
    per-tensor loop gives."""
    with_plan = _recorded_steps(tmp_path, monkeypatch, "plan", True)["grad_norm"].tolist()
    without = _recorded_steps(tmp_path, monkeypatch, "loop", False)["grad_norm"].tolist()
    assert with_plan == pytest.approx(without, rel=1e-5)
    assert all(v > 0 for v in with_plan)
