"""The end of the usual step, in one pass: `QuietStep`.

Most steps of a job are not sampled, their facts are host values (a CPU
job), and they show no event. `rec.step()` closes such a step through the
parts that close any step (the hooks' state, the sentinel's judgement, the
step row, the held bundle state, the writer's hand-over), ~25 calls of a
dozen objects. On a launch-bound step each bytecode of that path runs once a
step with its code and objects out of the caches, ~5-8x its cost in a loop
(`benchmarks/RESULTS.md`, 2026-12-07): the path, not its work, cost a point
of the launch-bound proxy's ratio. `QuietStep.close` tests that the step is
such a step, changing nothing, and closes it with the same parts' narrowest
calls; any other step (sampled, re-executed, a device's, a scaler's, an
event, a captured loss) goes the general way, which stays the reference:
tests record jobs both ways and compare their rows.
"""
from __future__ import annotations

import math

import torch

from .collectors.state import dtype_name


class QuietStep:
    """`close(loss, step_id)`, with the parts of the recorder that closes
    any step (`of`)."""

    @classmethod
    def of(cls, rec) -> "QuietStep | None":
        """For `rec` (an `AmpRecorder` whose parts are built): None where no
        step is quiet, a job with an enabled scaler (its skips and scale are
        the sentinel's to read) or without a sentinel (no re-execution)."""
        if rec.sentinel is None or rec.rows.scaler is not None:
            return None
        return cls(hooks=rec.hooks, losses=rec.losses, sentinel=rec.sentinel, rows=rec.rows, bundles=rec.bundles,
                   run_writer=rec.run_writer, schedule=rec.schedule, stance=rec.stance)

    def __init__(self, *, hooks, losses, sentinel, rows, bundles, run_writer, schedule, stance):
        self.hooks, self.shared, self.losses = hooks, hooks.shared, losses
        self.sentinel, self.trigger = sentinel, sentinel.trigger
        self.rows, self.bundles, self.run_writer = rows, bundles, run_writer
        self.schedule, self.stance = schedule, stance

    def close(self, loss, step_id: int) -> bool:
        """Close step `step_id` and begin the next when it is a quiet step
        (True); else change nothing (False): the general path closes it."""
        hooks, shared = self.hooks, self.shared
        st = shared.state
        # What the general path would find, tested first, in one condition:
        # a step not sampled (whose containers are read-only and empty), no
        # row of any stage, every gradient fact a host value taken with the
        # gradients, the loss a CPU scalar passed as it is (none captured),
        # nothing deferred, no compiled graph.
        if (st.record or st.device is not None or st.grad_sq_host is None
                or st.grad_sqsum is not None or st.grad_nonfinite is not None or st.grad_scale is not None
                or st.sharded_sqsum is not None or st.graph_values is not None
                or type(loss) is not torch.Tensor or not loss.is_cpu or loss.numel() != 1
                or self.losses.captured or self.sentinel.waits or self.stance.compiled
                or hooks.autocast_watch.children_ran or hooks.graph.ran or shared.staged):
            return False
        # No event: the trigger's own test, which remembers the values only
        # when it passes (a NaN, an Inf or a spike leaves them to `decide`).
        # The loss is a CPU tensor here: its read waits for no device. The
        # value read goes on as it is (the row's loss: no detached tensor
        # made here and freed on the writer thread).
        value = loss.item()
        if not self.trigger.quiet(value, math.sqrt(st.grad_sq_host), None):
            return False
        st.grads_read = None  # as `TrainingHooks.end_step`: the gradients go with the loop's
        pending = self.rows.pack_host(st, step_id, value, dtype_name(loss.dtype))
        self.bundles.on_step_end(step_id, loss=value, stepped=pending.stepped, clean=True)
        self.run_writer.queue_step(pending, True)
        hooks.begin_step(step_id + 1, self.schedule.tier(step_id + 1))
        return True
