"""One optimizer step, from the hooks' device-side statistics to table rows.

`StepRows.pack` (training thread) stacks a finished step's statistics and
scalars into one tensor and starts its one asynchronous copy to the host;
`StepRows.rows` (writer thread) waits for that copy and turns it into the
step's row, its tensor rows and the host-side summary the bundle triggers
and the record schedule read.
"""
from __future__ import annotations

import enum
import math
import time

import numpy as np
import torch

from .aggregate import MergePlan, event_rows, merge_rows, without_intermediates
from .graph_rows import autocast_info, graph_rows, with_graph_rows
from .manifest import host_float, scaler_enabled
from .stats import CHEAP_WIDTH, FULL_WIDTH, grad_facts, pack_rows


class PendingStep:
    """A finished step on its way to the writer thread. What most steps
    (not sampled, not re-executed, no compiled graph) leave unset is read
    from the class: `pack` runs on every step, and each attribute it need
    not set is a line less on the training path."""

    tier = None
    width = CHEAP_WIDTH
    meta = ()
    lr = None
    stepped = None
    has_scaler = False
    loss_dtype = None
    graph_slots = None
    graph_size = 0
    graph_anchor = None
    eager_micro_batches = 0
    recorded = False
    reexecution = None
    norm_names = None
    host_rows = None
    packed = None
    event = None


def _put(host: dict, dev: list, keys: list, key: str, value, mutable: bool = False) -> None:
    """A step scalar: a host value as it is, a CPU tensor as it is (read by
    the writer thread: no operation here but a read of what the job changes
    in place, `mutable`: the scale, a host value here, no copy), a device
    tensor into `dev` (its key and 0, a scalar, into `keys`)."""
    if isinstance(value, torch.Tensor):
        if value.is_cpu:
            host[key] = (value.item() if value.numel() == 1 else value.detach().clone()) if mutable \
                else value.detach() if value.requires_grad else value
        else:
            dev.append(value.detach().reshape(()).to(torch.float64))
            keys.append((key, 0))
    else:
        host[key] = math.nan if value is None else float(value)


def _put_vector(host: dict, dev: list, keys: list, key: str, value) -> None:
    if value.is_cpu:
        host[key] = value.detach() if value.requires_grad else value
    else:
        keys.append((key, value.numel()))
        dev.append(value.detach().reshape(-1).to(torch.float64))

def _put_grad_facts(host: dict, dev: list, keys: list, prefix: str, state) -> None:
    sq = state.grad_sq_host
    if state.grad_norms is not None or sq is not None:
        if state.grad_norms is not None:
            _put_vector(host, dev, keys, prefix + "grad_norms", state.grad_norms)
        host[prefix + "grad_unscale"] = state.grad_scale is not None
        if sq is not None and math.isfinite(sq):
            # The square sum, taken with the gradients (the CPU): the
            # writer needs each one's norm only when one is not finite
            # (then taken with it: `NormPlan.facts`).
            host[prefix + "grad_sq_host"] = sq
    if state.grad_sqsum is not None:
        _put(host, dev, keys, prefix + "grad_sqsum", state.grad_sqsum)
    if state.grad_nonfinite is not None:
        _put(host, dev, keys, prefix + "grad_nonfinite", state.grad_nonfinite)


class StepRows:
    """`rank`: stamped on every row; `optimizer`, `scaler`: read for the
    learning rates and the loss scale (the scale as a device tensor: never
    read on the training thread)."""

    def __init__(self, *, rank: int, optimizer=None, scaler=None):
        self.rank = rank
        self.optimizer = optimizer
        self.scaler = scaler if scaler_enabled(scaler) else None
        backoff = host_float(getattr(self.scaler, "_backoff_factor", None)) if self.scaler else None
        self.backoff_factor = backoff or 0.5
        self.scale_before = self._initial_scale()  # the scale the next backward uses
        self._plan = None  # aggregate.MergePlan of the last step's rows (writer thread)

    def _initial_scale(self):
        if self.scaler is None:
            return None
        scale = getattr(self.scaler, "_scale", None)
        if isinstance(scale, torch.Tensor):
            return scale.item() if scale.is_cpu else scale.detach().clone()
        return float(getattr(self.scaler, "_init_scale", math.nan))

    # ------------------------------------------------------ training thread
    def _begin(self, st, step_id: int, loss_dtype: str | None) -> PendingStep:
        """A step's `PendingStep` with what every step's row has: `st` the
        hooks' finished state (the step's facts)."""
        p = PendingStep()
        p.step, p.wall_time, p.loss_dtype = step_id, time.time(), loss_dtype
        # A model compiled after the recorder was attached runs no forward
        # hook: its micro-batches are counted by their backward passes.
        p.micro_batches = st.micro_batches or st.backward_passes
        p.norm_names = st.grad_norm_names
        optimizer = self.optimizer
        if optimizer is not None:
            groups = optimizer.param_groups
            lr = groups[0].get("lr") if len(groups) == 1 else None
            # A float as it is (the usual lr): no call a group, and one
            # group's (the usual optimizer) without a comprehension's frame.
            p.lr = [lr] if type(lr) is float else [
                lr if type(lr := g.get("lr")) is float else host_float(lr) for g in groups]
            p.stepped = st.stepped
        return p

    def pack_host(self, st, step_id: int, loss: float, loss_dtype: str) -> PendingStep:
        """`pack` of a step `quiet_step.QuietStep` closes: not sampled, no
        scaler, its gradients' finite square sum a host value (the CPU),
        `loss` the value of a CPU scalar loss, no re-execution; the same row
        (tests compare the two ways)."""
        p = self._begin(st, step_id, loss_dtype)
        host, dev, keys = {"loss": loss}, [], []
        _put_grad_facts(host, dev, keys, "", st)
        p.host_scalars, p.dev_scalar_keys, p.host_rows = host, keys, st.stats
        return p

    def pack(self, st, step_id: int, loss, loss_t, loss_dtype: str | None = None,
             graph_slots: list | None = None, reexecution=None) -> PendingStep:
        """`st`: the hooks' finished StepState; `loss`: as passed to
        `rec.step()`, `loss_t` its detached tensor (or None); `loss_dtype`:
        the backpropagated loss's dtype name (`loss_tap.loss_dtype`);
        `graph_slots`: the in-graph statistics (`GraphStats`), whose
        values `st.graph_values` holds when a compiled graph wrote them;
        `reexecution`: the step's `reexecute.Outcome` (None: none was
        asked), whose re-executed state gives the step's rows."""
        facts = st
        p = self._begin(facts, step_id, loss_dtype)
        if reexecution is not None:
            p.reexecution = reexecution
            if reexecution.state is not None:
                st = reexecution.state  # the rows: the re-execution's; the facts: the step's
        graph = st.graph_values if graph_slots is not None else None
        if st.record or st.meta or graph is not None:
            p.recorded = facts.record
            p.tier = ("full" if st.full else "cheap") if st.record else None
            p.meta, p.eager_micro_batches, p.graph_anchor = st.meta, st.micro_batches, st.graph_anchor
            if st.full:
                p.width = FULL_WIDTH
            if graph is not None:
                p.graph_slots, p.graph_size = graph_slots, graph.numel()
        host, dev, keys = {}, [], []  # keys: (key, 0 for a scalar, else the vector's length), in dev's order
        if loss_t is not None and loss_t.numel() == 1:
            if loss_t.is_cpu:
                host["loss"] = loss_t  # read by the writer thread
            else:
                _put(host, dev, keys, "loss", loss_t)
        elif isinstance(loss, (int, float)):
            _put(host, dev, keys, "loss", loss)
        else:
            host["loss"] = None  # no loss given: null, never a fake NaN loss
        scaler = self.scaler
        if scaler is not None:
            p.has_scaler = True
            before = self.scale_before
            if type(before) is float:
                host["loss_scale_before"] = before
            else:
                _put(host, dev, keys, "loss_scale_before", before)
            scale = getattr(scaler, "_scale", None)
            tracker = getattr(scaler, "_growth_tracker", None)
            if type(scale) is torch.Tensor and scale.is_cpu and type(tracker) is torch.Tensor and tracker.is_cpu:
                # The CPU: read now (the job changes them in place), and
                # the value just read is the scale the next backward uses.
                host["loss_scale"] = self.scale_before = scale.item()
                host["growth_tracker"] = tracker.item()
            else:
                _put(host, dev, keys, "loss_scale",
                     scale if isinstance(scale, torch.Tensor) else getattr(scaler, "_init_scale", None), mutable=True)
                _put(host, dev, keys, "growth_tracker", tracker if isinstance(tracker, torch.Tensor) else None,
                     mutable=True)
                # The scale the next step's backward uses: on a device a
                # clone, because GradScaler.update() changes it in place.
                if isinstance(scale, torch.Tensor):
                    self.scale_before = host["loss_scale"] if scale.is_cpu else scale.detach().clone()
        # The gradient facts, and what a re-execution measured against them.
        _put_grad_facts(host, dev, keys, "", facts)
        if st is not facts:
            _put_grad_facts(host, dev, keys, "reexec_", st)
            if reexecution.loss is not None:
                _put(host, dev, keys, "reexec_loss", reexecution.loss)
        if facts.sharded_sqsum is not None:
            _put(host, dev, keys, "sharded_grad_sqsum", facts.sharded_sqsum)
        p.host_scalars = host
        p.dev_scalar_keys = keys
        if not dev and graph is None and st.device is None:
            # Every value a host value (the CPU), every row a tuple of host
            # floats: handed over as they are, the writer thread makes the
            # array (building a tensor here cost the training thread ~0.1 ms).
            p.host_rows = st.stats
            return p
        device = st.device or (dev[0].device if dev else torch.device("cpu"))
        if st.device is None and device.type == "cpu":
            p.host_rows = st.stats
            flat = []
        else:
            flat = [pack_rows(st.stats)] if st.stats else []
        flat += [d.to(device).reshape(-1) for d in dev]
        if graph is not None:  # last: `rows` finds it at the end
            flat.append(graph.reshape(-1).to(device))
        if flat:
            packed = torch.cat(flat) if len(flat) > 1 else flat[0]
            if packed.device.type == "cuda":
                # One asynchronous copy per step; the writer thread waits on
                # the event, never the training thread.
                p.packed = packed.to("cpu", non_blocking=True)
                p.event = torch.cuda.Event()
                p.event.record()
            elif packed.is_cpu:
                p.packed = packed
            else:
                p.packed = packed.to("cpu", non_blocking=True)
        return p

    # -------------------------------------------------------- writer thread
    def scalars(self, p: PendingStep, values=None) -> dict:
        """The step's scalar facts as host values (loss, loss scale, the
        gradients' square sum and non-finite count, ...): the writer's, and
        the sentinel's for a step whose facts were device values once their
        copy reached the host (`p.event` done: no wait). `values`: the
        packed copy as a numpy array, when read already."""
        if values is None:
            values = p.packed.numpy() if p.packed is not None else np.empty(0)
        # `packed` holds the device scalars after the rows, if any are there.
        offset = 0 if p.host_rows is not None else len(p.meta) * p.width
        scalars = {k: float(v) if isinstance(v, torch.Tensor) and v.dim() == 0 else v
                   for k, v in p.host_scalars.items()}
        for k, length in p.dev_scalar_keys:
            scalars[k] = float(values[offset]) if not length else values[offset:offset + length]
            offset += max(1, length)
        for prefix in ("", "reexec_"):
            norms = scalars.pop(prefix + "grad_norms", None)
            sq = scalars.pop(prefix + "grad_sq_host", None)
            if norms is not None or sq is not None:
                before = scalars.get("loss_scale_before")
                unscale = before if scalars.get(prefix + "grad_unscale") else None
                if sq is not None and (unscale is None or (unscale and math.isfinite(unscale))):
                    sq, count, bad = (sq / unscale / unscale if unscale else sq), 0, []  # as `host_facts`
                elif norms is not None:
                    sq, count, bad = grad_facts(norms, unscale)
                else:  # a square sum without norms, the scale 0 or Inf since: not unscaled, not guessed
                    continue
                scalars[prefix + "grad_sqsum"], scalars[prefix + "grad_nonfinite"] = sq, count
                if not prefix:
                    scalars["nonfinite_grad_positions"] = bad
        return scalars

    def rows(self, p: PendingStep) -> tuple[dict, dict | None, dict]:
        """(the steps-table row, the tensor columns or None, the step's
        host-side summary: step, skipped, loss, loss_scale,
        loss_scale_before, growth_tracker, nonfinite_rows, columns)."""
        if p.event is not None:
            p.event.synchronize()
        values = p.packed.numpy() if p.packed is not None else np.empty(0)
        n = len(p.meta)
        if p.host_rows is not None:
            rows = np.asarray(p.host_rows, dtype=np.float64).reshape(n, p.width) if n \
                else np.empty((0, p.width))
        else:
            rows = values[: n * p.width].reshape(n, p.width) if n else np.empty((0, p.width))
        scalars = self.scalars(p, values)
        meta, micro_batches, autocast = p.meta, p.micro_batches, None
        if p.graph_slots is not None:
            block = values[len(values) - p.graph_size:]
            gmeta, grows, graph_mb = graph_rows(p.graph_slots, block, p.width)
            autocast = autocast_info(p.graph_slots, block)
            if not p.eager_micro_batches and graph_mb:
                micro_batches = graph_mb  # the root's forward ran in the graph
            if gmeta:
                meta, rows = with_graph_rows(meta, rows, gmeta, grows, p.graph_anchor)
                n = len(meta)
        cols = None
        if n:
            if self._plan is None or self._plan.meta != meta:
                self._plan = MergePlan.of(meta)
            cols = merge_rows(meta, rows, self._plan)

        skipped = False
        before, after = scalars.get("loss_scale_before"), scalars.get("loss_scale")
        if p.has_scaler:
            if before is not None and after is not None and self.backoff_factor < 1 and not math.isnan(before):
                # GradScaler backs off exactly when it found Inf/NaN, i.e.
                # when it skipped optimizer.step(); it never shrinks otherwise.
                skipped = after < before
            elif p.stepped is not None:
                skipped = not p.stepped
        elif p.stepped is not None:
            skipped = not p.stepped and micro_batches > 0

        nonfinite_params = 0
        nonfinite_rows = 0
        if cols is not None:
            g = len(cols["name"])
            cols["step"] = np.full(g, p.step, dtype=np.int64)
            cols["rank"] = np.full(g, self.rank, dtype=np.int32)
            bad = event_rows(cols)
            nonfinite_rows = int(bad.sum())
            kinds = np.array(cols["kind"], dtype=object)
            nonfinite_params = int((bad & (kinds == "param_grad")).sum())
        counted = scalars.get("grad_nonfinite")
        if counted is not None and (not p.recorded or p.reexecution is not None):
            # Not sampled: the facts' count (a re-execution's rows are
            # checked against it, not taken for it).
            nonfinite_params = int(counted)
        sq = scalars.get("grad_sqsum")
        tracker = scalars.get("growth_tracker", math.nan)
        check = reexecution_check(p, scalars, cols) if p.reexecution is not None else None
        step_row = {
            "step": p.step,
            "rank": self.rank,
            "wall_time": p.wall_time,
            "loss": scalars.get("loss"),
            "loss_scale": after if p.has_scaler else None,
            "loss_scale_before": before if p.has_scaler else None,
            "growth_tracker": int(tracker) if p.has_scaler and not math.isnan(tracker) else None,
            "skipped": bool(skipped),
            "lr": p.lr,
            "grad_norm": grad_norm(sq, nonfinite_params),
            "nonfinite_param_grads": nonfinite_params if cols is not None or counted is not None else None,
            "micro_batches": micro_batches,
            "tier": p.tier,
            "tensor_rows": len(cols["name"]) if cols is not None else 0,
            "sharded_grad_sqsum": scalars.get("sharded_grad_sqsum"),
            "loss_dtype": p.loss_dtype,
            "reexecuted": check is not None and check["check"] != ReexecutionCheck.REFUSED.value,
            "reexecution": check["check"] if check is not None else None,
        }
        summary = {
            "step": p.step, "skipped": bool(skipped), "loss": scalars.get("loss"),
            "loss_scale": after, "loss_scale_before": before,
            "growth_tracker": step_row["growth_tracker"],
            # The events, triggers and schedule judge the module rows: an
            # op probe's `intermediate` rows are for the analyzer only.
            "nonfinite_rows": nonfinite_rows,
            "columns": without_intermediates(cols) if cols is not None else None,
            # What autocast a compiled graph ran under (None: no graph, or off).
            "graph_autocast": autocast,
            "reexecution": check,
        }
        return step_row, cols, summary


class ReexecutionCheck(str, enum.Enum):
    """How a re-execution's facts compare with the recorded ones (the steps
    column `reexecution`)."""
    EXACT = "exact"          # the same bits: square sum of the gradients, their non-finite count, the loss
    CLOSE = "close"          # the same non-finite gradients; values within 1e-3 (nondeterministic kernels)
    DIFFERS = "differs"      # not reproduced: nondeterminism beyond rounding, or a faulty device
    UNCHECKED = "unchecked"  # nothing to compare (no gradient facts on either side)
    REFUSED = "refused"      # not re-executed (`reexecute.Refusal` says why)


def reexecution_check(p: PendingStep, scalars: dict, cols: dict | None) -> dict:
    """The manifest's entry of a re-execution: the event, and how its facts
    compare with the recorded ones (`ReexecutionCheck`): the gradients' square
    sum, their non-finite count and which parameters' they are (the recorded
    step's norms against the re-executed `param_grad` rows), the loss; or
    why it was refused (`reexecute.Refusal`)."""
    out = p.reexecution
    entry = {"step": p.step, "kind": out.kind}
    if out.state is None:
        entry.update(check=ReexecutionCheck.REFUSED.value, reason=out.refusal.value if out.refusal else None)
        if out.detail:
            entry["detail"] = out.detail
        return entry
    recorded = {"grad_sqsum": scalars.get("grad_sqsum"), "nonfinite_grads": scalars.get("grad_nonfinite"),
                "loss": scalars.get("loss")}
    again = {"grad_sqsum": scalars.get("reexec_grad_sqsum"), "nonfinite_grads": scalars.get("reexec_grad_nonfinite"),
             "loss": scalars.get("reexec_loss")}
    names = p.norm_names or []
    bad_recorded = sorted(names[i] for i in scalars.get("nonfinite_grad_positions", ()) if i < len(names))
    bad_again = sorted(nonfinite_param_names(cols)) if cols is not None else None
    entry["recorded_nonfinite_grads"] = bad_recorded
    entry["backward"] = bool(out.backward)
    if out.eager:  # a compiled step run again eagerly: the compiler's rounding is not eager's
        entry["eager"] = True
    compared = [k for k in recorded if recorded[k] is not None and again[k] is not None]
    same_params = not out.backward or bad_again is None or not names or bad_recorded == bad_again
    if not compared:
        entry["check"] = ReexecutionCheck.UNCHECKED.value
        return entry
    same_bits = all(_same(recorded[k], again[k]) for k in compared) and same_params
    close = same_params and all(_same(recorded[k], again[k]) or (
        math.isfinite(recorded[k]) and math.isfinite(again[k])
        and abs(recorded[k] - again[k]) <= 1e-3 * max(abs(recorded[k]), abs(again[k]))) for k in compared)
    check = ReexecutionCheck.EXACT if same_bits else ReexecutionCheck.CLOSE if close else ReexecutionCheck.DIFFERS
    entry["check"] = check.value
    entry["recorded"] = {k: recorded[k] for k in compared}
    entry["reexecuted"] = {k: again[k] for k in compared}
    if bad_again is not None and out.backward:
        entry["reexecuted_nonfinite_grads"] = bad_again
    return entry


def nonfinite_param_names(cols: dict) -> list[str]:
    """The parameters whose `param_grad` rows hold a NaN or an Inf."""
    kinds = np.asarray(cols["kind"], dtype=object)
    bad = (np.asarray(cols["nan_count"]) > 0) | (np.asarray(cols["inf_count"]) > 0)
    return [str(n) for n in np.asarray(cols["name"], dtype=object)[bad & (kinds == "param_grad")]]


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def step_events(summary: dict) -> list[str]:
    """What in a step's summary is an event for the record schedule (see
    `schedule.EVENT_KINDS`). Non-finite gradients of a skipped step are that
    skip (a loss scaler's growth probe makes them on purpose), not a kind of
    their own; a NaN born in the forward pass is."""
    events = []
    skipped = summary["skipped"]
    if skipped:
        events.append("skipped")
    cols = summary.get("columns")
    if summary["nonfinite_rows"] > 0 and cols is not None:
        bad = (cols["nan_count"] > 0) | (cols["inf_count"] > 0)
        forward = np.array([p == "forward" for p in cols["phase"]], dtype=bool)
        if (bad & forward).any():
            events.append("nonfinite_forward")
        if not skipped and (bad & ~forward).any():
            events.append("nonfinite_gradient")
    loss = summary["loss"]
    if loss is not None and not math.isfinite(loss):
        events.append("nonfinite_loss")
    return events


def grad_norm(sq, nonfinite_params: int):
    """sqrt of the recorded square sum; a skipped step, whose optimizer never
    ran (no norm taken), has an Inf norm when a gradient was non-finite."""
    if sq is not None and not (sq < 0):
        return math.sqrt(sq)
    return math.inf if nonfinite_params else None
