"""The Keras and Flax recorders' bundle decision (recorders/host_bundle.py,
`BundleTriggers`): a pure function of a finished step's host values."""
from __future__ import annotations

import math

import pytest

from recorders.host_bundle import TRIGGERS, BundleTriggers


def test_a_backward_only_overflow_saves_its_step_by_default():
    t = BundleTriggers()  # without a loss scale: the gradients were applied
    assert t.triggers == TRIGGERS and "nonfinite_gradient" in TRIGGERS
    assert t.reasons(0, 0.5, False, False) == []
    # A forward that broke is saved for that; its gradients do not use up the backward's trigger.
    assert t.reasons(1, math.inf, True, True) == ["nonfinite_loss", "nonfinite_tensor"]
    assert t.reasons(2, 0.5, False, True) == ["nonfinite_gradient"]
    assert t.reasons(3, 0.5, False, True) == []  # once
    assert t.saved == 2


def test_a_skip_counts_once_the_scale_has_settled_and_not_when_it_probes():
    t = BundleTriggers(settle_steps=2)
    # A fresh scale calibrating down: skipped on overflowing gradients, no bundle.
    assert t.reasons(0, 0.5, False, True, skipped=True, loss_scale_before=65536.0) == []
    assert t.reasons(1, 0.5, False, False, loss_scale_before=32768.0) == []
    assert t.reasons(2, 0.5, False, False, loss_scale_before=32768.0) == []
    # Settled; the scale grows and its first step overflows: a probe, no bundle.
    assert t.reasons(3, 0.5, False, True, skipped=True, loss_scale_before=65536.0) == []
    # A skip at a scale that had worked: the gradients broke.
    assert t.reasons(4, 0.5, False, True, skipped=True, loss_scale_before=32768.0) == ["nonfinite_gradient"]
    assert t.options()["settle_steps"] == 2 and t.fresh().settle_steps == 2


def test_the_trigger_can_be_left_out():
    t = BundleTriggers(triggers=("nonfinite_loss", "nonfinite_tensor"))
    assert t.reasons(0, 0.5, False, True) == []
    assert t.options()["bundle_triggers"] == ["nonfinite_loss", "nonfinite_tensor"]
    with pytest.raises(ValueError, match="is not one of nonfinite_loss, nonfinite_tensor, nonfinite_gradient"):
        BundleTriggers(triggers=("skipped",))
