"""The failing step, re-executed in full inside the job.

A step that is not sampled is recorded as its step facts only. When those
facts show an event, the recorder runs that step's forward and backward
again, at once, with every collector's hook, from what `BundleCapture` holds
for it: the root's inputs and RNG states of each micro-batch, the gradients
that reached the root's outputs (so the loss, wherever the loop computes it,
need not be known), and the weights the forward used. The rows it records
are the step's rows, marked re-executed (`steps.reexecuted`), and the facts
the re-execution measured are compared with the recorded ones
(`steps.reexecution`, `step_rows.ReexecutionCheck`): a step that does not
reproduce is itself a finding
(nondeterminism, a faulty device). Megatron's rerun state machine re-runs a
step for the same reason.

The training's numbers stay bit-identical: the re-execution never steps the
optimizer or the scaler, and restores what a forward and backward change
(parameter gradients, buffers such as BatchNorm's running statistics, the
RNG states, the train/eval mode, and the weights where it had to swap in
the held ones).

What is held, and so what can be re-executed:
- a skipped step (a GradScaler found Inf/NaN): the weights are intact, and
  the skip is a host value (the scaler synchronised for it): re-executed at
  the `rec.step()` that closes it, with no copy of anything;
- a job without a scaler: its optimizer has already stepped when the event
  is known, so the weights of the step's forward are those
  `BundlePolicy.snapshot_params` copies before each update ("auto": every
  step of such a job, one set of the parameters, a second while the writer
  decides; on the CPU only for a step whose gradients are not finite or
  whose gradient norm breaks the spike bound, which the optimizer's
  pre-step hook asks, `ReexecuteTrigger.norm_within`); without them the
  step is refused (`Refusal.WEIGHTS_NOT_HELD`: a loss spike with an
  ordinary gradient norm);
- a device job's loss and gradient counts are device values that
  `rec.step()` never reads (that would synchronise). With a scaler, a
  skipped step (a host value: its scaler synchronised already, so its loss
  is read too) is re-executed at once. Without one (a bf16 job), each
  step's row waits one step (`StepSentinel.hand_over`): at the next
  `rec.step()` its facts' asynchronous copy is on the host (its CUDA event
  done: no wait) and is judged as a CPU step's facts are, the step
  re-executed from the weights held before its update (`snapshot_params`
  keeps two sets: the step's and the next one's). A device more than a
  step behind leaves the row undecided (`StepSentinel.undecided`); the
  writer thread's look at its facts still has the schedule record the
  next step in full (`RecordSchedule.note_event`). A scaled job's finite
  events on a device (a spike, a NaN loss with finite gradients) are not
  re-executed;
- DDP and FSDP: never in the job (its backward would issue collectives the
  other ranks do not join): the saved bundle and the offline `replay` stand
  for it (`Refusal.DISTRIBUTED`);
- a compiled model: re-executed eagerly (`torch.compiler.set_stance(
  "force_eager")`, as its full-tier steps run: no graph is dropped or
  recompiled), its rows then eager's arithmetic; with
  `eager_full_steps=False`, never (`Refusal.COMPILED`).
"""
from __future__ import annotations

import contextlib
import enum
import gc
import math
import sys
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .bundles.held import rng_state, set_rng_state
from .collectors.state import StepState
from .errors import OptionError, option_float, option_int
from .loss_tap import find_loss
from .manifest import scaler_enabled
from .stats import float_tensors, grad_facts

# The events that ask for a re-execution (`ReexecutePolicy.kinds`).
KINDS = ("skipped", "growth_probe", "scale_collapse", "nonfinite_loss", "nonfinite_gradient", "spike")
# A skip at a scale this many times below the largest seen is a collapse's.
COLLAPSE_FACTOR = 16.0
# Steps named per kind of gap in the manifest (capped events, undecided
# steps): the first ones, which are the ones a post-mortem asks about; the
# counts go on.
NOTED_STEPS = 16


@dataclass(frozen=True)
class ReexecutePolicy:
    """When the recorder re-executes a step in full: `AmpRecorder(reexecute=...)`
    (keywords; their one definition).

    kinds: the events that ask for one: `skipped` (the scaler skipped the
        step), `growth_probe` (a skip that answers a growth of the scale:
        the scaler's own probe), `scale_collapse` (a skip at a scale 16
        times or more below the largest seen: a collapse under way, apart
        from the run's first skips), `nonfinite_loss`, `nonfinite_gradient` (a NaN/Inf gradient on
        a step the scaler did not skip, or with no scaler), `spike` (the loss
        or the gradient norm above `spike_factor` times the median of its
        last `spike_window` finite values).
    min_interval: steps between two re-executions of a kind already
        re-executed once (the first of each kind always is; 1000).
    max_reexecutions: at most this many in a run (16).
    spike_factor, spike_window: the spike rule (10.0, 50 steps; at least 10
        values before a spike is judged).

    A re-execution costs about a full-tier step; on a diverging job, where
    every step is an event, the cap keeps the job cheap."""

    kinds: tuple = KINDS
    min_interval: int = 1000
    max_reexecutions: int = 16
    spike_factor: float = 10.0
    spike_window: int = 50

    def __post_init__(self):
        kinds = (self.kinds,) if isinstance(self.kinds, str) else tuple(self.kinds)
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            raise OptionError(f"reexecute kinds {unknown}: choose among {', '.join(KINDS)}")
        object.__setattr__(self, "kinds", kinds)
        object.__setattr__(self, "min_interval", max(1, option_int("min_interval", self.min_interval)))
        object.__setattr__(self, "max_reexecutions", option_int("max_reexecutions", self.max_reexecutions))
        object.__setattr__(self, "spike_factor", option_float("spike_factor", self.spike_factor))
        object.__setattr__(self, "spike_window", max(10, option_int("spike_window", self.spike_window)))

    def config(self, refused: "Refusal | None" = None) -> dict:
        """The manifest's `recorder.reexecute`; `refused`: a refusal that
        holds for the whole job (DDP/FSDP)."""
        return {"kinds": list(self.kinds), "min_interval": self.min_interval,
                "max_reexecutions": self.max_reexecutions, "spike_factor": self.spike_factor,
                "spike_window": self.spike_window, "refused": refused.value if refused is not None else None}


def reexecute_policy(value) -> ReexecutePolicy | None:
    """`AmpRecorder(reexecute=)`: True (the default policy), False/None (never)
    or a `ReexecutePolicy`."""
    if isinstance(value, ReexecutePolicy):
        return value
    if value is True:
        return ReexecutePolicy()
    if value is False or value is None:
        return None
    raise OptionError(f"reexecute={value!r}: give True, False or a ReexecutePolicy")


class Refusal(enum.Enum):
    """Why an event's step was not re-executed (the manifest's words: `value`)."""
    NOT_CAPTURED = "not_captured"          # no forward of the root was held for the step
    DISTRIBUTED = "distributed"            # DDP/FSDP: collectives the other ranks do not join
    COMPILED = "compiled"                  # a compiled model, and eager_full_steps=False: no eager run
    WEIGHTS_NOT_HELD = "weights_not_held"  # the optimizer stepped and no copy of the weights was held
    INPUTS_CHANGED = "inputs_changed"      # the loop wrote into the held inputs since
    FAILED = "failed"                      # the re-execution raised (restored; recording goes on)


_new_tuple = tuple.__new__


class StepFacts(NamedTuple):
    """A step's facts as host values (None: unknown); `loss_scale`: the
    scale its backward used. A tuple: made on every step, in one call."""
    step: int
    skipped: bool = False
    loss_scale: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    nonfinite_grads: int | None = None


@dataclass
class Decision:
    kind: str | None = None   # the event's kind (None: no event)
    capped: bool = False      # an event the policy's kinds or cap leave without a re-execution


@dataclass
class Outcome:
    """A re-execution, done (`state`: the re-executed step's `StepState`) or refused."""
    step: int
    kind: str
    refusal: Refusal | None = None
    detail: str | None = None
    state: object = None
    # Re-executed eagerly, the step having run compiled: the compiler's
    # fused kernels round their own way, so the facts may be close, not exact.
    eager: bool = False
    loss: torch.Tensor | None = None
    backward: bool = False  # the backward ran too (gradients of the root's outputs were held)
    facts: dict = field(default_factory=dict)


_NO_EVENT = Decision()  # never changed: the answer of most steps, made once


class _Deferred:
    """A step whose facts were device values: what packing its row again
    with a re-execution takes (`StepSentinel.hand_over`)."""

    __slots__ = ("state", "loss_t", "compiled", "pending")

    def __init__(self, state, loss_t, compiled):
        self.state, self.loss_t, self.compiled, self.pending = state, loss_t, compiled, None


class ReexecuteTrigger:
    """Which steps' facts ask for a re-execution: the first event of each
    kind, then one per `min_interval` steps of a kind, at most
    `max_reexecutions` (training thread; pure on its inputs)."""

    def __init__(self, policy: ReexecutePolicy):
        self.policy = policy
        self.last: dict[str, int] = {}
        self.count = 0
        self.capped = 0
        self.capped_steps: list[int] = []  # the first `NOTED_STEPS` of them (the manifest's)
        self._losses = _Recent(policy.spike_window, policy.spike_factor)
        self._norms = _Recent(policy.spike_window, policy.spike_factor)
        self._prev_scale: float | None = None
        self._max_scale: float | None = None

    def decide(self, facts: StepFacts) -> Decision:
        if not facts.skipped and not facts.nonfinite_grads and self.quiet(facts.loss, facts.grad_norm,
                                                                           facts.loss_scale):
            return _NO_EVENT
        kind = self._event(facts)
        self._remember(facts)
        if kind is None:
            return _NO_EVENT
        if kind not in self.policy.kinds:
            return Decision(kind, capped=True)
        last = self.last.get(kind)
        if self.count >= self.policy.max_reexecutions or (
                last is not None and facts.step - last < self.policy.min_interval):
            self.capped += 1
            if len(self.capped_steps) < NOTED_STEPS:
                self.capped_steps.append(facts.step)
            return Decision(kind, capped=True)
        self.last[kind] = facts.step
        self.count += 1
        return Decision(kind)

    def quiet(self, loss, norm, scale) -> bool:
        """The facts of a step taken without a non-finite gradient show no
        event: a loss and a gradient norm under their spike bounds, which
        are finite (`_Recent`), so a NaN or an Inf fails. Then they are
        remembered, as `_remember` does (the usual step, in one test: this
        runs on every step); else nothing is."""
        losses, norms = self._losses, self._norms
        if loss is None or norm is None:
            return False
        loss_abs, norm_abs = abs(loss), abs(norm)
        # Each bound's one comparison first (`_Recent.fast`), `within` where it cannot decide.
        if not ((loss_abs <= losses.fast or losses.within(loss_abs))
                and (norm_abs <= norms.fast or norms.within(norm_abs))):
            return False
        if scale is not None:
            self._prev_scale = scale
            if self._max_scale is None or scale > self._max_scale:
                self._max_scale = scale
        self._losses.add(loss)
        self._norms.add(norm)
        return True

    def norm_within(self, norm: float) -> bool:
        """A gradient norm under the spike bound (`quiet`'s test of it):
        asked before the update, where a spike's weights can still be held."""
        norms = self._norms
        return norm <= norms.fast or norms.within(norm)

    def _event(self, f: StepFacts) -> str | None:
        if f.loss is not None and not math.isfinite(f.loss):
            return "nonfinite_loss"  # a skip too with a scaler, but the failure, not the scaler's routine
        if f.skipped:
            scale, prev, top = f.loss_scale, self._prev_scale, self._max_scale
            if scale is not None and prev is not None and scale > prev:
                return "growth_probe"  # the skip that answers a growth: the scaler's own probe
            if scale is not None and top is not None and scale * COLLAPSE_FACTOR <= top:
                return "scale_collapse"
            return "skipped"
        if f.nonfinite_grads:
            return "nonfinite_gradient"
        # Finite values only (a NaN compares False; an Inf norm is no spike:
        # its gradients' count says what it is).
        loss, norm = f.loss, f.grad_norm
        if (loss is not None and abs(loss) > self._losses.limit) or (
                norm is not None and abs(norm) > self._norms.limit and math.isfinite(norm)):
            return "spike"
        return None

    def _remember(self, f: StepFacts) -> None:
        scale = f.loss_scale
        if scale is not None:
            self._prev_scale = scale
            if self._max_scale is None or scale > self._max_scale:
                self._max_scale = scale
        if not f.skipped:
            loss, norm = f.loss, f.grad_norm
            if loss is not None and math.isfinite(loss):
                self._losses.add(loss)
            if norm is not None and math.isfinite(norm):
                self._norms.add(norm)


def host_facts(st, loss_t, *, skipped: bool, scale=None) -> StepFacts | None:
    """The step's facts when every one is a host value already (a CPU job),
    else None: a device value would have to be read. A skipped step's are
    read on any device: its scaler synchronised for the skip already, after
    the loss was made, so reading the loss waits for nothing. `scale`: the
    loss scale the step's backward used (its gradient norms are divided by
    it; a float on the CPU, where `StepRows` keeps it as the host value it read)."""
    sq = st.grad_sq_host
    if (sq is not None and not skipped and type(scale) is not torch.Tensor and st.grad_sqsum is None
            and (loss_t is None or loss_t.is_cpu) and math.isfinite(sq)):
        # The usual CPU step: every fact a host value, the square sum taken
        # with the norms (finite: no NaN/Inf among the gradients).
        unscale = float(scale) if scale is not None and st.grad_scale is not None else None
        if unscale is None or unscale:
            sq = sq / unscale / unscale if unscale else sq
            # Made in C (the named tuple's `__new__` is a Python call).
            return _new_tuple(StepFacts, (st.step_id, False, float(scale) if scale is not None else None,
                                          loss_t.item() if loss_t is not None and loss_t.numel() == 1 else None,
                                          math.sqrt(sq), 0))
    norms, sqsum = st.grad_norms, st.grad_sqsum
    scale_tensor = isinstance(scale, torch.Tensor)
    # Attribute tests, not a loop: this runs on every step.
    on_host = ((loss_t is None or loss_t.is_cpu) and (not scale_tensor or scale.is_cpu)
               and (norms is None or norms.is_cpu) and (sqsum is None or sqsum.is_cpu)
               and (st.grad_nonfinite is None or st.grad_nonfinite.is_cpu))
    if not (on_host or skipped):
        return None
    scale_value = (scale.item() if scale_tensor else float(scale)) if scale is not None else None
    loss = loss_t.item() if loss_t is not None and loss_t.numel() == 1 else None
    if skipped:
        return StepFacts(st.step_id, skipped=True, loss=loss, loss_scale=scale_value)
    sq, count = None, None
    unscale = scale_value if st.grad_scale is not None else None
    if st.grad_sq_host is not None and math.isfinite(st.grad_sq_host) and (unscale is None or unscale):
        # Summed when the norms were taken (the usual CPU step: no NaN/Inf).
        sq, count = st.grad_sq_host / unscale / unscale if unscale else st.grad_sq_host, 0
    elif norms is not None:
        sq, count, _ = grad_facts(norms, unscale)
    elif sqsum is not None:
        sq = float(sqsum)
        count = int(st.grad_nonfinite) if st.grad_nonfinite is not None else None
    norm = None if sq is None else math.sqrt(sq) if sq >= 0 else math.nan
    return StepFacts(st.step_id, loss=loss, grad_norm=norm, nonfinite_grads=count, loss_scale=scale_value)


# The bound of a series without a spike rule yet: the largest float, so
# that `abs(value) <= limit` also says the value is finite.
_NO_LIMIT = sys.float_info.max


class _Recent:
    """The last `size` finite values of a series (a ring), and the spike
    rule's bound on the next value: `factor` times their median once there
    are 10 of them and the median is positive (else none: the largest
    float).

    `within(magnitude)` decides `magnitude <= limit` on every step without
    keeping the window sorted: a sorted copy made at the last `_rebuild`
    bounds the median from below. After k values added since (each added
    value moves the median down by at most one rank, each dropped one only
    up), the median is at least the copy's value k ranks below its median,
    so a value within `factor` times that is within the rule. Only a value
    the bound cannot decide (a spike, or ~n/2 steps after the copy) or a
    read of `limit` sorts the window again (a steady series: every ~20
    values). Keeping it sorted as values came (a bisection, an insertion
    and a deletion a value, two series) was the largest piece of the usual
    step's close, ~18 us of the launch-bound proxy's cold step; this way
    the close reads 3-9 us less (`benchmarks/RESULTS.md`, 2026-12-07)."""

    __slots__ = ("values", "pos", "size", "factor", "ranked", "added", "_limit", "bounds", "fast")

    def __init__(self, size: int, factor: float):
        self.values: list = []  # the last `size` values, in a ring from `pos`
        self.pos = 0
        self.size = size
        self.factor = factor
        self.ranked: list = []  # the values sorted, as at the last `_rebuild`
        self.added = 0  # values added since
        self._limit = _NO_LIMIT
        # bounds[k]: the bound after k values added since the last rebuild
        # (the exact limit at 0, then the rank bound; -1 where there is
        # none), made with the sorted copy; `fast` is the current one: the
        # usual step's test is one comparison, `within` decides the rest.
        self.bounds = [_NO_LIMIT]
        self.fast = _NO_LIMIT

    def add(self, value: float) -> None:
        values = self.values
        if len(values) < self.size:
            values.append(value)
        else:
            pos = self.pos
            values[pos] = value  # the oldest goes
            self.pos = pos + 1 if pos + 1 < self.size else 0
        k = self.added = self.added + 1
        bounds = self.bounds
        self.fast = bounds[k] if k < len(bounds) else -1.0

    @property
    def limit(self) -> float:
        """The bound, exactly: `factor` times the median (or the largest float)."""
        if self.added:
            self._rebuild()
        return self._limit

    def within(self, magnitude: float) -> bool:
        """`magnitude <= self.limit` (False for NaN and Inf)."""
        if magnitude <= self.fast:
            return True
        if self.added:  # the rank bound could not decide: the exact limit
            self._rebuild()
            return magnitude <= self._limit
        return False  # `fast` was the exact limit

    def _rebuild(self) -> None:
        ranked = self.ranked = sorted(self.values)
        self.added = 0
        n, factor = len(ranked), self.factor
        median = ranked[n // 2] if n >= 10 else 0.0
        self._limit = min(factor * median, _NO_LIMIT) if median > 0 else _NO_LIMIT
        # After k values added the median is at least the value k ranks
        # below this one (see the class's docstring).
        ranks = [ranked[n // 2 - k] for k in range(1, n // 2 + 1)] if n >= 10 and factor > 0 else []
        self.bounds = [self._limit] + [min(factor * low, _NO_LIMIT) if low > 0 else -1.0 for low in ranks]
        self.fast = self._limit


@contextlib.contextmanager
def _cycles_collected_after():
    """Python's cyclic garbage collector paused for the block. A
    re-execution makes ~10,000 container objects that die with it (hook
    handles, rows, their staged copies, autograd's Python nodes); collected
    while alive, they are promoted and set off full collections of the
    whole process (torch's, pandas' objects): on the diverging benchmark
    a re-execution took 52-63 ms with the collector paused, 57-93 with it
    running. Freed by reference counting at the block's end, they leave no
    collection owed. A collector the job disabled stays disabled."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Reexecutor:
    """Runs a held step again with every hook. `hooks`: the recorder's
    `TrainingHooks`; `bundles`: its `BundleCapture` (what is held);
    `refuse`: a `Refusal` that holds for the whole job (DDP/FSDP), or None;
    `eager_when_compiled`: a compiled model's step is re-executed eagerly
    (the recorder's `eager_full_steps`; False: refused, `Refusal.COMPILED`)."""

    def __init__(self, model, hooks, bundles, *, refuse: Refusal | None = None, eager_when_compiled: bool = True):
        self.model = model
        self.hooks = hooks
        self.bundles = bundles
        self.refuse = refuse
        self.eager_when_compiled = eager_when_compiled
        self.inventory = bundles.inventory

    def run(self, step: int, kind: str, *, scale, compiled: bool, loss=None) -> Outcome:
        """Re-execute the held step `step` (`scale`: the loss scale its
        backward used, None without a scaler; `loss`: the loss tensor the
        step passed to `rec.step()`, detached, or None: its `<loss>` row, as
        every-step recording writes it, whether or not the model computes it). A compiled model's runs
        eagerly (`torch.compiler.set_stance("force_eager")`: its graphs are
        neither dropped nor recompiled), so that every module's hooks fire;
        its rounding is then eager's, not the compiler's (`Outcome.eager`)."""
        if self.refuse is not None:
            return Outcome(step, kind, self.refuse)
        if compiled and not self.eager_when_compiled:
            return Outcome(step, kind, Refusal.COMPILED)
        cap = self.bundles.held(step)
        if cap is None or not cap.micro_batches:
            return Outcome(step, kind, Refusal.NOT_CAPTURED)
        if not all(t._version == v for mb in cap.micro_batches for t, v in mb.input_versions):
            return Outcome(step, kind, Refusal.INPUTS_CHANGED)
        weights = None
        if not self.bundles.unchanged(cap):
            if cap.params is None or not cap.params_exact:
                return Outcome(step, kind, Refusal.WEIGHTS_NOT_HELD)
            weights = cap.params
        if scale is not None and not isinstance(scale, torch.Tensor):
            scale = torch.tensor(float(scale), dtype=torch.float32)  # a host value (the CPU's `StepRows`)
        try:
            with torch.compiler.set_stance("force_eager") if compiled else contextlib.nullcontext(), \
                    _cycles_collected_after():
                out = self._run(cap, kind, weights, scale, loss)
            out.eager = compiled
            return out
        except Exception as exc:  # noqa: BLE001 - restored; the training goes on
            return Outcome(step, kind, Refusal.FAILED, detail=f"{type(exc).__name__}: {exc}")

    def _run(self, cap, kind, weights, scale, step_loss=None) -> Outcome:
        hooks, bundles, model = self.hooks, self.bundles, self.model
        params = list(model.parameters())
        saved = _Saved(model, params, self.inventory.buffers, weights, self.inventory.params)
        prior_state, was_attached = hooks.shared.state, hooks.attached
        st = StepState(cap.step, True, True)
        out = Outcome(cap.step, kind)
        bundles.enabled = False  # the capture must not take the re-execution for a new step
        hooks.params.scale_override = scale
        done = False
        try:
            saved.swap_in()
            hooks.shared.state = st
            hooks.attach()
            model.train(cap.training)
            losses = []
            for mb in cap.micro_batches:
                set_rng_state(mb.rng)
                with _autocast(cap.autocast):
                    output = model(*mb.args, **mb.kwargs)
                loss = find_loss(output)
                if loss is not None:
                    losses.append(loss.detach())
                outs = [t for t in float_tensors(output) if t.requires_grad]
                pairs = [(outs[i], g) for i, g in sorted(mb.grads.items()) if i < len(outs) and g is not None]
                if pairs:
                    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
                    out.backward = True
                del output, outs, pairs
            hooks.end_step(step_loss)
            out.state = st
            if losses and len(losses) == len(cap.micro_batches):
                out.loss = torch.stack([l.float() for l in losses]).mean()
            done = True
        finally:
            if not done:
                # A re-execution that raised left rows in the stages: they
                # take their values now, into its own state (dropped), not
                # at the next step's end, into that step's.
                with contextlib.suppress(Exception):
                    hooks.shared.flush_stage()
            hooks.params.scale_override = None
            hooks.shared.state = prior_state
            if not was_attached:
                hooks.detach()
            saved.restore()
            bundles.enabled = True
        return out


class _Saved:
    """What a forward and backward change, saved to be put back: gradients
    (references), buffers and weights (copies), RNG states, the mode."""

    def __init__(self, model, params, buffers, weights, weight_tensors):
        self.model = model
        self.training = model.training
        self.grads = [(p, p.grad) for p in params]
        self.buffers = [(b, b.detach().clone()) for b in buffers]
        self.rng = rng_state()
        self.weights = weights
        self.weight_tensors = weight_tensors
        self.current = None

    def swap_in(self) -> None:
        for p, _ in self.grads:
            p.grad = None
        if self.weights is not None:
            with torch.no_grad():
                self.current = [t.detach().clone() for t in self.weight_tensors]
                for t, w in zip(self.weight_tensors, self.weights):
                    t.copy_(w)

    def restore(self) -> None:
        with torch.no_grad():
            for p, g in self.grads:
                p.grad = g
            for b, value in self.buffers:
                b.copy_(value)
            if self.current is not None:
                for t, w in zip(self.weight_tensors, self.current):
                    t.copy_(w)
        set_rng_state(self.rng)
        self.model.train(self.training)


def _autocast(info: dict | None):
    """The autocast the step's forward ran under (none: as the re-execution
    is called, outside any)."""
    info = info or {}
    if not info.get("enabled"):
        return contextlib.nullcontext()
    return torch.autocast(info["device_type"], dtype=getattr(torch, info["dtype"]),
                          cache_enabled=info.get("cache_enabled", True))


class StepSentinel:
    """What `rec.step()` does with a step that was not sampled: reads its
    facts where they are host values, asks `ReexecuteTrigger` whether they
    call for a re-execution, runs it (`Reexecutor`), and says whether the
    step is clean (no event: handed to the writer with others). A skip is a
    step the optimizer did not take under an enabled `scaler` (with an
    `optimizer`, whose pre-step hook tells); a scale below `scale_floor`
    (the bundles' `min_loss_scale`, a trigger of its own) is no clean step;
    `losses`: the recorder's `MicroBatchLosses`, emptied of what a
    re-execution's forward handed the loss tap."""

    def __init__(self, policy: ReexecutePolicy, reexecutor: Reexecutor, *, scaler, optimizer, losses,
                 scale_floor: float | None = None, rows=None):
        self.trigger = ReexecuteTrigger(policy)
        self.reexecutor = reexecutor
        self.scaler = scaler if scaler_enabled(scaler) else None
        self.has_scaler = self.scaler is not None and optimizer is not None
        # A job whose update follows every step (no scaler to skip it) has
        # stepped when a gradient-norm spike is judged: the optimizer's
        # pre-step hook asks the spike bound, so that the weights of such a
        # step's forward are copied while they still are (`BundleCapture`).
        if reexecutor is not None:
            reexecutor.hooks.params.norm_within = None if self.has_scaler else self.trigger.norm_within
        self.losses = losses
        self.scale_floor = scale_floor
        # A job without a scaler whose facts are device values: each such
        # step's row waits one step (`hand_over`), until its facts' copy is
        # on the host, and is then judged as a CPU step's is at once.
        self.rows = rows  # the recorder's `StepRows` (None: nothing waits)
        self._deferring: _Deferred | None = None  # the step `close_step` just left undecided
        self._waiting: _Deferred | None = None    # the one whose row waits
        self.undecided = 0  # rows handed on undecided: their copy was not on the host a step later
        self.undecided_steps: list[int] = []  # the first `NOTED_STEPS` of them (the manifest's)

    @property
    def capped(self) -> int:
        return self.trigger.capped

    def gaps(self) -> dict:
        """Events left without a re-execution and steps not judged in the job,
        for the manifest (`RunManifest.note_reexecution`): counts and the
        first `NOTED_STEPS` steps of each, so that the analyzer can say why a
        failing step has no rows."""
        return {"reexecutions_capped": self.trigger.capped,
                "reexecutions_capped_steps": list(self.trigger.capped_steps),
                "reexecutions_undecided": self.undecided,
                "reexecutions_undecided_steps": list(self.undecided_steps)}

    def close_step(self, finished, loss_t, *, scale_before, compiled: bool) -> tuple[Outcome | None, bool]:
        """(the re-execution's `Outcome`, or None when none is asked for or
        the cap says no; whether the step is clean). `scale_before`: the loss
        scale the step's backward used (a device tensor, or a float: the
        host value `StepRows` read, or a scaler's initial scale)."""
        self._deferring = None  # set below for this step only: never a stale one for `hand_over`
        if finished.record:
            return None, False  # sampled: its rows are there
        scale = None if scale_before is None else scale_before if isinstance(scale_before, torch.Tensor) or (
            isinstance(scale_before, float) and math.isfinite(scale_before)) else None
        skipped = (self.has_scaler and finished.stepped is False
                   and (finished.micro_batches or finished.backward_passes) > 0)
        facts = host_facts(finished, loss_t, skipped=skipped, scale=scale)
        if facts is None:
            if self.rows is not None and self.scaler is None:
                self._deferring = _Deferred(finished, loss_t, compiled)
            return None, False
        decision = self.trigger.decide(facts)
        if decision is _NO_EVENT:
            return None, self.scaler is None or self._above_floor(scale)
        if decision.capped:
            return None, False
        return self._reexecute(finished.step_id, decision.kind, scale, compiled, loss_t), False

    def hand_over(self, pending) -> list:
        """The rows to hand to the writer now, in step order, for the
        packed row `pending` of the step just closed: the waiting step's
        (judged on its facts, now host values, and re-executed when they
        show an event), then `pending` unless it waits in turn (a step
        `close_step` left undecided). Training thread, `rec.step()`."""
        out = []
        if self._waiting is not None:
            waited, self._waiting = self._waiting, None
            out.append(self._settle(waited, wait=False))
        deferred, self._deferring = self._deferring, None
        if deferred is not None:  # `pending` is that step's row: packed after `close_step` left it undecided
            deferred.pending = pending
            self._waiting = deferred
        else:
            out.append(pending)
        return out

    @property
    def waits(self) -> bool:
        """A step's row waits, or the step just closed will (`hand_over`)."""
        return self._waiting is not None or self._deferring is not None

    def release(self, judge: bool = True, reexecute: bool = True) -> list:
        """The waiting step's row (`flush()`, `close()`): judged, its copy
        waited for; with `judge` False (recording is off) as packed; with
        `reexecute` False (`close()`: the hooks are gone) judged but not
        re-executed."""
        waited, self._waiting = self._waiting, None
        if waited is None:
            return []
        return [self._settle(waited, wait=True, reexecute=reexecute) if judge else waited.pending]

    def _settle(self, d: "_Deferred", *, wait: bool, reexecute: bool = True):
        """`d`'s row: as packed, or packed again with the re-execution its
        facts asked for (the rows of that step, in full, checked against
        its facts, as a CPU job's step has them at its own `rec.step()`)."""
        p = d.pending
        if p.event is not None:
            if wait:
                p.event.synchronize()
            elif not p.event.query():
                self.undecided += 1  # the device is more than a step behind: not read (no sync)
                if len(self.undecided_steps) < NOTED_STEPS:
                    self.undecided_steps.append(p.step)
                return p
        scalars = self.rows.scalars(p)
        sq, count, loss = scalars.get("grad_sqsum"), scalars.get("grad_nonfinite"), scalars.get("loss")
        facts = StepFacts(p.step, loss=float(loss) if loss is not None else None,
                          grad_norm=None if sq is None else math.sqrt(sq) if sq >= 0 else math.nan,
                          nonfinite_grads=int(count) if count is not None else None)
        decision = self.trigger.decide(facts)
        if decision.kind is None:
            self.reexecutor.bundles.judged_clean(p.step)  # its weight copy serves the next step
        if decision.kind is None or decision.capped or not reexecute:
            return p
        outcome = self._reexecute(p.step, decision.kind, None, d.compiled, d.loss_t)
        again = self.rows.pack(d.state, p.step, d.loss_t, d.loss_t, loss_dtype=p.loss_dtype,
                               graph_slots=self.reexecutor.hooks.graph, reexecution=outcome)
        # As the step was closed, not as it is now (a scheduler moved the lr since).
        again.wall_time, again.lr, again.stepped = p.wall_time, p.lr, p.stepped
        if "loss" in p.host_scalars:  # a host value (a float passed to rec.step()): as recorded
            again.host_scalars["loss"] = p.host_scalars["loss"]
        return again

    def _reexecute(self, step: int, kind: str, scale, compiled: bool, loss=None) -> Outcome:
        outcome = self.reexecutor.run(step, kind, scale=scale, compiled=compiled, loss=loss)
        self.losses.take()  # what the re-execution's forward handed the loss tap
        return outcome

    def _above_floor(self, before=None) -> bool:
        """The scaler's scale is at least `scale_floor` after the update.
        `before`: the scale this step's backward used, as a host float: a
        step not skipped never lowers the scale, so one at the floor
        already needs no read of the scaler's."""
        if self.scaler is None or self.scale_floor is None:
            return True
        if type(before) is float and before >= self.scale_floor:
            return True
        scale = getattr(self.scaler, "_scale", None)
        return isinstance(scale, torch.Tensor) and scale.is_cpu and float(scale) >= self.scale_floor
