"""First-NaN ranking: which layer made the first non-finite value, and which
only passed it on.

Reads only rows that hold a NaN/Inf (shards whose footer counts none are
never opened) and keeps a bounded summary per layer, so a NaN storm over a
long run costs a scan, not memory.

Origins, per phase, in the first step where that phase has a non-finite row
(the lowest rank holding one):
- forward: a non-finite model input makes the origin `<input>`; otherwise the
  first `activation` row in forward order that is non-finite while the
  module's inputs were finite (`input_nonfinite` 0 or null: no float inputs).
  Forward hooks fire at the end of a module's forward, so a child comes before
  its parent and the innermost module that made the value wins; its parents
  and later layers saw it as input or contain it, and are `propagated`. When
  every activation is finite and the loss is not, the loss function made it:
  `<loss>`.
- backward: `<loss>` when the gradient is already non-finite where it enters
  the model (the root module's `grad_output`); otherwise the first module, in
  backward order, whose `grad_input` (or one of its own parameters'
  `param_grad`) is non-finite while its `grad_output` was finite.
  A tied parameter (the manifest lists its other names as `aliases`, e.g.
  an embedding shared with the output projection) is recorded under its
  first name only, but its gradient is the sum of what every module using
  it computed: the origin is the module among its users whose operation
  made the value (`attribute_shared`): one whose output gradient was finite
  and travelled in float16 (its weight-gradient matmul ran in float16; an
  embedding's float32 gradient cannot overflow there), the one with the
  largest such gradient when several did; `aliases` lists the others.

A rule that rests on a row being finite needs that row recorded: a step
of a compiled model without in-graph rows (`compiled_rows=False`) holds
the loss and the parameter gradients, no module's activation or gradient.
There the absence of a non-finite row says nothing, so each origin carries
its `basis` (`OriginBasis`): the rule met, no row met it, the rows that
would decide were not recorded on that step, or made inside a module whose
watched submodules have no row there. For the last two the first later
step whose rows decide it names the layer (`later_origins`), evidence of
that step, not of the first.

A forward origin whose step ran after an update that applied non-finite
gradients (no loss scaler skipped it) is where those weights were first
used, not where the NaN/Inf was made: when its own parameters' rows show
it (their values at its step where recorded, else their gradients at that
update), its basis is `nonfinite_weights`, and the update's backward origin
is the failure; values recorded finite (weights the job restored) keep the
rule's origin; when that update recorded no rows, whether its weights were
among them is undetermined (`after_nonfinite_update`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np
import pandas as pd

from recorders.format import plain, schema

from ..names import display_name as _display
from ..reading.loader import Run
from ..op_words import run_op_origin_line
from ..display import report_html, report_repr
from ..result import CommandResult
from .reexecution import reexecution_mismatches

LAYER_KINDS = ("input", "activation", "loss", "grad_output", "grad_input", "param_grad")
_COLUMNS = ["step", "rank", "name", "kind", "phase", "order", "call", "nan_count", "inf_count",
            "input_nonfinite"]
LAYER_COLUMNS = ["name", "kind", "phase", "first_step", "order", "rank", "origin", "nan_count",
                 "inf_count", "module", "last_step", "nonfinite_steps"]


class OriginBasis(str, Enum):
    """What an origin rests on (`Origin.basis`; the JSON's `basis`)."""
    RULE = "rule"              # a row met the rule: the origin is certain
    FIRST_ROW = "first_row"    # no row met the rule: the first non-finite row is named
    UNRECORDED = "unrecorded"  # the rows that would decide were not recorded on that step
    WITHIN = "within"          # made inside this module; its watched submodules have no row there
    # Its own weights were NaN/Inf when its step ran (made so by an earlier
    # update that applied non-finite gradients, or by anything else its
    # parameter rows at that step show): the row shows where they were
    # first used.
    WEIGHTS = "nonfinite_weights"
    # Its step ran after such an update, which recorded no rows: whether its
    # weights were among those it made non-finite is undetermined.
    AFTER_UPDATE = "after_nonfinite_update"
    # Its step's rows come from a re-execution that did not reproduce the
    # step (`reexecution`): no evidence of the step as it ran.
    NOT_REPRODUCED = "not_reproduced"


# Kinds whose presence in a step decides the rules (`coverage`).
_DECIDING_KINDS = ("activation", "grad_output", "grad_input")


@dataclass(frozen=True)
class Coverage:
    """What one step recorded on one rank, as far as the origin rules need
    it: the kinds among `_DECIDING_KINDS` with a row, and whether a module
    below the model has an activation row, and a `grad_output` row (not
    only the model's own: a recorder attached to a compiled module records
    its boundary only)."""
    kinds: frozenset
    module_activations: bool
    module_gradients: bool

    def outputs_recorded(self, name: str) -> bool:
        """Whether module `name`'s `grad_output` rows were recorded."""
        return "grad_output" in self.kinds and (name == "" or self.module_gradients)


@dataclass(frozen=True)
class Origin:
    name: str        # module qualified name, or "<input>" / "<loss>"
    phase: str       # "forward" / "backward"
    kind: str        # kind of the row that shows it: activation, grad_input, param_grad, input, loss
    step: int
    rank: int
    order: int | None
    tensor: str      # name of that row (a parameter name for param_grad)
    aliases: tuple = ()   # a tied parameter's other names (param_grad origins)
    basis: OriginBasis = OriginBasis.RULE

    @property
    def certain(self) -> bool:
        """A row met the rule (the JSON's `certain`, beside `basis`)."""
        return self.basis is OriginBasis.RULE

    def to_dict(self) -> dict:
        return {"name": self.name, "phase": self.phase, "kind": self.kind, "step": self.step,
                "rank": self.rank, "order": self.order, "tensor": self.tensor, "certain": self.certain,
                "aliases": list(self.aliases), "basis": self.basis.value}

    @property
    def undetermined(self) -> bool:
        """Its step lacked the rows that decide it: the row named is no origin."""
        return self.basis in (OriginBasis.UNRECORDED, OriginBasis.WITHIN, OriginBasis.AFTER_UPDATE,
                              OriginBasis.NOT_REPRODUCED)


def _uncertain(o: Origin, basis: OriginBasis) -> Origin:
    return replace(o, basis=basis)


@dataclass
class NanReport(CommandResult):
    origin: Origin | None                  # the earlier of the two phase origins
    origins: dict                          # {"forward": Origin | None, "backward": Origin | None}
    layers: pd.DataFrame                   # LAYER_COLUMNS, in first-appearance order
    first_nonfinite_step: int | None
    nonfinite_loss_steps: list[int] = field(default_factory=list)
    skipped_steps: int = 0
    backward_scaler_handled: bool = False  # the backward origin's step was skipped with a finite forward
    backward_calibration: bool = False     # ...and it is one of the scaler's leading calibration skips
    # The run had an enabled loss scaler. Without one a skipped step is the
    # training loop's own skip (the optimizer did not step), never a back-off.
    has_scaler: bool = True
    shards_scanned: int = 0
    shards_total: int = 0
    # With a model: `replaying.run_origin.RunOpOrigin.to_dict()` of a replayed
    # bundle (the API adds it; this analysis never replays). None without one.
    op_origin: dict | None = None
    # Per phase: where the origin's step lacked the rows that decide it
    # (`Origin.undetermined`), the certain origin of the first later step
    # whose module rows hold a NaN/Inf; else None.
    later_origins: dict = field(default_factory=dict)
    compiled_without_rows: bool = False  # a compiled model, no module rows in its graph
    # The step whose optimizer update applied non-finite gradients, when
    # it leaves the later steps' rows unable to decide, or when the forward
    # origin's step ran on the weights it made (None: neither).
    weights_nonfinite_from: int | None = None
    # Steps with a NaN/Inf loss, before the forward origin's (every one when
    # there is none), that recorded no per-layer row: a sentinel's steps
    # neither sampled nor re-executed. The first failure may be among them,
    # where no row can name its layer.
    unrecorded_loss_steps: list[int] = field(default_factory=list)
    # Why the first of them has no re-executed rows (`no_rerun`), or None.
    unrecorded_why: dict | None = None
    # Steps whose rows come from a re-execution that did not reproduce them
    # (`reexecution.reexecution_mismatches`): no evidence of the step as it ran.
    differs_steps: list[int] = field(default_factory=list)
    # Steps whose step facts show NaN/Inf gradients, before the backward
    # origin's (every one when there is none), that recorded no per-layer
    # row, and why the first of them has none (`no_rerun`), or None.
    unrecorded_grad_steps: list[int] = field(default_factory=list)
    unrecorded_grad_why: dict | None = None

    def document(self) -> dict:
        layers = [{k: plain(v) for k, v in row.items()} for row in self.layers.to_dict("records")]
        return {
            "origin": self.origin.to_dict() if self.origin else None,
            "origins": {p: (o.to_dict() if o else None) for p, o in self.origins.items()},
            "later_origins": {p: (o.to_dict() if o else None) for p, o in
                              ((p, self.later_origins.get(p)) for p in ("forward", "backward"))},
            "compiled_without_rows": self.compiled_without_rows,
            "weights_nonfinite_from": self.weights_nonfinite_from,
            "layers": layers,
            "first_nonfinite_step": self.first_nonfinite_step,
            "nonfinite_loss_steps": len(self.nonfinite_loss_steps),
            "first_nonfinite_loss_step": self.nonfinite_loss_steps[0] if self.nonfinite_loss_steps else None,
            "skipped_steps": self.skipped_steps,
            "backward_scaler_handled": self.backward_scaler_handled,
            "backward_calibration": self.backward_calibration,
            "has_scaler": self.has_scaler,
            "shards_scanned": self.shards_scanned,
            "shards_total": self.shards_total,
            "op_origin": self.op_origin,
            "unrecorded_loss_steps": len(self.unrecorded_loss_steps),
            "first_unrecorded_loss_step": self.unrecorded_loss_steps[0] if self.unrecorded_loss_steps else None,
            "first_unrecorded_loss_step_why": self.unrecorded_why,
            "unrecorded_gradient_steps": len(self.unrecorded_grad_steps),
            "first_unrecorded_gradient_step": self.unrecorded_grad_steps[0] if self.unrecorded_grad_steps else None,
            "first_unrecorded_gradient_step_why": self.unrecorded_grad_why,
            "reexecution_differs_steps": list(self.differs_steps),
        }

    # Readable at the prompt and in Jupyter (display.py).
    __repr__ = report_repr
    _repr_html_ = report_html

    def table(self) -> pd.DataFrame:
        t = self.layers.copy()
        role = np.where(t["origin"], "ORIGIN", "propagated").astype(object)
        # The first row of a step without the rows that decide: neither;
        # a layer that ran on non-finite weights: where they were first used.
        for o in self.origins.values():
            if o is not None and o.basis is OriginBasis.WEIGHTS:
                key = _origin_row(o, self.origins)
                hit = (t["name"] == key[0]) & (t["kind"] == key[1]) & (t["first_step"] == o.step)
                role[hit.to_numpy()] = "weights"
            elif o is not None and o.undetermined:
                key = _origin_row(o, self.origins)
                if key is not None:
                    hit = (t["name"] == key[0]) & (t["kind"] == key[1]) & (t["first_step"] == o.step)
                    role[hit.to_numpy()] = "undetermined"
        t.insert(0, "role", role)
        return t.drop(columns=["origin"])

    def lines(self) -> list[str]:
        unrecorded = ([f"non-finite loss at step {self.unrecorded_loss_steps[0]}"
                       + (f" (and {len(self.unrecorded_loss_steps) - 1} more step(s) before any recorded NaN/Inf)"
                          if len(self.unrecorded_loss_steps) > 1 else "")
                       + ": no per-layer row was recorded there (not sampled, not re-executed: "
                       + (no_rerun_words(self.unrecorded_why) if self.unrecorded_why else "reason unknown")
                       + "), so its origin is undetermined"] if self.unrecorded_loss_steps else [])
        if self.first_nonfinite_step is None:
            grads = [self._no_backward_origin()] if self.unrecorded_grad_steps else []
            return unrecorded + grads + ["No NaN/Inf in any recorded tensor."] + self._differs_lines()
        out = list(unrecorded)
        for phase in ("forward", "backward"):
            o = self.origins.get(phase)
            if o is None:
                out.append(self._no_backward_origin() if phase == "backward" and self.unrecorded_grad_steps
                           else f"{phase} origin: none (every {phase} tensor finite)")
                continue
            where = _display(o.name) + (f" ({o.tensor})" if o.tensor not in (o.name, "") and not o.aliases
                                        else "")
            if o.aliases:
                where += f" (its weight gradient; a tied parameter, also named {', '.join(o.aliases)})"
            guess = "" if o.certain else " " + basis_words(o, self.later_origins.get(phase),
                                                           self.compiled_without_rows, self.weights_nonfinite_from)
            absorbed = ""
            if phase == "backward" and self.backward_scaler_handled:
                # "Calibration" only for what the scaler really calibrated:
                # the leading skips of a run that starts at its init_scale.
                if not self.has_scaler:
                    absorbed = (" (a step whose optimizer step did not run: the training loop skipped it, "
                                "the run has no loss scaler; the forward and loss were finite)")
                elif self.backward_calibration:
                    absorbed = " (a calibration skip: the scaler's first steps, backing off from its init_scale)"
                else:
                    absorbed = (" (a step the loss scaler skipped and backed off on; the forward and loss were "
                                "finite)")
            out.append(f"{phase} origin: {where}, {o.kind}, step {o.step}, rank {o.rank}{guess}{absorbed}")
        if self.nonfinite_loss_steps:
            out.append(f"non-finite loss in {len(self.nonfinite_loss_steps)} step(s), "
                       f"first at step {self.nonfinite_loss_steps[0]}")
        if self.op_origin is not None:
            out.append(run_op_origin_line(self.op_origin))
        return out + self._differs_lines()

    def _no_backward_origin(self) -> str:
        """No recorded backward row holds a NaN/Inf, but the step facts show
        NaN/Inf gradients on steps that recorded none."""
        steps = self.unrecorded_grad_steps
        more = f" (and {len(steps) - 1} more step(s))" if len(steps) > 1 else ""
        why = no_rerun_words(self.unrecorded_grad_why) if self.unrecorded_grad_why else "reason unknown"
        return (f"backward origin: undetermined: the gradients were NaN/Inf at step {steps[0]}{more} (the step "
                f"facts), which recorded no per-layer row (not sampled, not re-executed: {why})")

    def _differs_lines(self) -> list[str]:
        if not self.differs_steps:
            return []
        steps = ", ".join(map(str, self.differs_steps[:8])) + (" ..." if len(self.differs_steps) > 8 else "")
        return [f"the rows of step(s) {steps} come from a re-execution that did not reproduce the step "
                f"(summary: reexecution_differs): no evidence of the step as it ran"]


def basis_words(o: Origin, later: Origin | None, compiled_without_rows: bool,
                weights_nonfinite_from: int | None = None) -> str:
    """Why an origin is not certain, and what a later step showed, in
    brackets (`NanReport.lines`, the summary's finding)."""
    if o.basis is OriginBasis.FIRST_ROW:
        return "[no row met the rule: first non-finite row shown]"
    if o.basis is OriginBasis.WEIGHTS:
        if weights_nonfinite_from is None or weights_nonfinite_from >= o.step:
            # Its parameter rows at its step show them non-finite, and no
            # earlier update applied non-finite gradients: something else did.
            return ("[its own weights were already NaN/Inf when this step ran (their rows at this step): the "
                    "first layer to use them, not where the NaN/Inf was made; no update before it applied "
                    "non-finite gradients, so something else made them so (an update from non-finite "
                    "optimizer state or one that overflowed them, a load, an in-place write)]")
        return (f"[its weights were NaN/Inf after step {weights_nonfinite_from}'s update, which applied non-finite "
                f"gradients (nothing skipped that step): the first layer to use them, not where the NaN/Inf was made]")
    if o.basis is OriginBasis.NOT_REPRODUCED:
        return ("[the rows of its step come from a re-execution that did not reproduce the step: no evidence of "
                "the step as it ran" + (f"; step {later.step}, the first later step whose module rows decide it, "
                                        f"names {_display(later.name)} ({later.kind})]" if later is not None else "]"))
    if o.basis is OriginBasis.AFTER_UPDATE:
        return (f"[step {weights_nonfinite_from}'s update applied non-finite gradients and recorded no "
                f"per-layer row: whether this layer's weights were among those it made NaN/Inf is undetermined]")
    what = ("made inside it; which of its modules made it is undetermined: their rows were not recorded "
            "on this step" if o.basis is OriginBasis.WITHIN else
            "the first non-finite row recorded; the layer that made it is undetermined: the rows that "
            "decide it were not recorded on this step")
    if compiled_without_rows:
        what += " (a compiled step: AmpRecorder(compiled_rows=True) records every module inside the graph)"
    if later is not None:
        what += (f"; step {later.step}, the first later step whose module rows decide it, names "
                 f"{_display(later.name)} ({later.kind})")
    elif weights_nonfinite_from is not None:
        what += (f"; the later steps with module rows ran on weights made non-finite by step "
                 f"{weights_nonfinite_from}'s update: they cannot decide it")
    return f"[{what}]"


def find_nans(run: Run, *, from_step: int | None = None, to_step: int | None = None) -> NanReport:
    """Rank layers by first non-finite appearance and name the origins."""
    acc = _Accumulator()
    run.scanned_files.clear()
    # A sharded parameter's gradient: one row per step, whichever ranks
    # hold its non-finite values (the lowest of them names the rank).
    # The weights' non-finite rows come in the same read (`weights_origin`
    # asks for them at the forward origin's step): no shard opened twice.
    bad_weights = set()  # (step, rank, name) of `param` rows holding a NaN/Inf
    for rows in run.iter_tensor_frames(_COLUMNS, nonfinite_only=True, kinds=LAYER_KINDS + ("param",),
                                       step_range=(from_step, to_step), label="scanning for NaN/Inf"):
        weights = (rows["kind"] == "param").to_numpy()
        if weights.any():
            bad_weights.update(zip(rows["step"][weights].tolist(), rows["rank"][weights].tolist(),
                                   rows["name"][weights].tolist()))
            rows = rows[~weights]
        if len(rows):
            acc.add(rows)

    origins = {"forward": None, "backward": None}
    later = {"forward": None, "backward": None}
    corrupted = None  # the step whose update made the weights non-finite, when it voids `later`
    firsts = {p: acc.first_rows.get(p) for p in origins}
    seconds = {p: acc.first_module_rows.get(p) for p in origins}
    below = watched_below(run)
    covered: dict = {}  # the steps' coverage, read once for both phases

    differs = {(m.step, m.rank) for m in reexecution_mismatches(run)}

    def origin_of(phase, rows):
        o = origins_of(run, {0: rows}, phase, below, covered)[0]
        if o is not None and (o.step, o.rank) in differs:
            return _uncertain(o, OriginBasis.NOT_REPRODUCED)  # rows of a re-execution that did not reproduce it
        return o

    for phase in origins:
        if firsts[phase] is not None:
            origins[phase] = origin_of(phase, firsts[phase])
        o = origins[phase]
        if o is not None and o.undetermined and seconds[phase] is not None:
            # The first later step whose module rows hold a NaN/Inf may
            # decide, unless the optimizer applied non-finite gradients in
            # between: that step's NaN then comes from the weights.
            o2 = origin_of(phase, seconds[phase])
            if o2 is not None and o2.certain and o2.step > o.step:
                applied = [s for s in applied_nonfinite_steps(run) if o.step <= s < o2.step]
                if applied:
                    corrupted = applied[0] if corrupted is None else min(corrupted, applied[0])
                else:
                    later[phase] = o2
    weights = weights_origin(run, origins["forward"], bad_weights)
    if weights is not None:
        origins["forward"], step = weights
        if step is not None:
            corrupted = step if corrupted is None else min(corrupted, step)
    candidates = [o for o in origins.values() if o is not None]
    facts = run.step_facts(from_step, to_step)
    if origins["backward"] is not None:
        origins["backward"] = attribute_shared(run, origins["backward"])
    if later["backward"] is not None:
        later["backward"] = attribute_shared(run, later["backward"])
    handled = _scaler_handled(origins["backward"], origins["forward"], facts)
    # The headline origin is the first of the two, except that a backward
    # overflow the loss scaler absorbed (a skipped step whose forward and loss
    # were finite: how a dynamic scaler calibrates) does not outrank a forward
    # origin, which is what turns the loss into NaN.
    headline = [o for o in candidates if not (handled and o.phase == "backward" and origins["forward"])]
    origin = min(headline, key=lambda o: (o.step, o.phase == "backward")) if headline else None

    layers = acc.layers()
    layers["origin"] = False
    # ORIGIN marks a certain origin's row: a first row named for want of
    # rows that decide is no origin, the later step's layer is.
    for o in [o for o in candidates if not o.undetermined and o.basis is not OriginBasis.WEIGHTS] + \
            [o for o in later.values() if o is not None]:
        key = _origin_row(o, origins)
        if key is not None:
            hit = (layers["name"] == key[0]) & (layers["kind"] == key[1]) & (layers["first_step"] == o.step)
            layers.loc[hit, "origin"] = True

    fwd, bwd = origins["forward"], origins["backward"]
    unrecorded = unrecorded_steps(run, [s for s in facts.nonfinite_loss_steps if fwd is None or s < fwd.step])
    grads = unrecorded_steps(run, [s for s in nonfinite_gradient_steps(run, from_step, to_step)
                                   if bwd is None or s < bwd.step])
    return NanReport(
        unrecorded_loss_steps=unrecorded, unrecorded_why=no_rerun(run, unrecorded[0]) if unrecorded else None,
        origin=origin, origins=origins, layers=layers[LAYER_COLUMNS], backward_scaler_handled=handled,
        backward_calibration=handled and origins["backward"].step in calibration_steps(run),
        has_scaler=run.scaler is not None,
        first_nonfinite_step=int(layers["first_step"].min()) if len(layers) else None,
        nonfinite_loss_steps=facts.nonfinite_loss_steps, skipped_steps=facts.skipped_steps,
        shards_scanned=len(set(run.scanned_files)), shards_total=len(run.tensor_shards),
        later_origins=later, compiled_without_rows=compiled_without_rows(run), weights_nonfinite_from=corrupted,
        differs_steps=sorted({step for step, _ in differs}),
        unrecorded_grad_steps=grads, unrecorded_grad_why=no_rerun(run, grads[0]) if grads else None,
    )


def nonfinite_gradient_steps(run: Run, from_step: int | None = None, to_step: int | None = None) -> list[int]:
    """Steps whose step facts count NaN/Inf parameter gradients on any rank
    (skipped or not), ascending, within the range."""
    s = run.step_series().steps
    s = s[s["nonfinite_grads_any"]]
    if from_step is not None:
        s = s[s["step"] >= from_step]
    if to_step is not None:
        s = s[s["step"] <= to_step]
    return sorted(int(v) for v in s["step"])


# At most this many updates that applied non-finite gradients are read for
# a forward origin's weights (the first ones: the weights stay non-finite after).
_APPLIED_READ = 16


def weights_origin(run: Run, o: Origin | None, bad_weights: set | None = None) -> tuple[Origin, int | None] | None:
    """(the forward origin `o` rebased on `WEIGHTS`, the step of the update
    that made its weights NaN/Inf, or None when no update that applied
    non-finite gradients came before it) when `o` is a layer whose own
    weights were non-finite when its step ran; None otherwise (nothing
    shows them non-finite: the rule's answer stands).

    Its own parameters (`<o.name>.<param>`, a tied one by any of its
    names) decide. Their values recorded at its step (a re-executed or
    full-tier step's `param` rows) say it directly, whatever made them so
    (an update, a load, an in-place write): non-finite makes it `WEIGHTS`,
    finite leaves the rule's answer (a job that restored its weights).
    Without such rows, only a step that ran after an update applying
    non-finite gradients is in question: their gradients at those updates
    decide (a non-finite one makes it `WEIGHTS`; none, where such an update
    recorded rows, leaves the rule's answer); no rows there at all:
    `AFTER_UPDATE`. `bad_weights`: the (step, rank, name) of the run's
    `param` rows holding a NaN/Inf, when the caller has read them (`find_nans`'
    scan); else they are read here."""
    if o is None or o.kind != "activation" or not o.certain or not o.name:
        return None
    applied = [s for s in applied_nonfinite_steps(run) if s < o.step][:_APPLIED_READ]
    aliases = tied_aliases(run)  # a tied weight's rows carry its first name only

    def owned(name: str) -> bool:
        return any(n.rpartition(".")[0] == o.name for n in (name, *aliases.get(name, ())))
    if not applied and bad_weights is not None:
        # Without an earlier update in question only a non-finite weight
        # row can change the answer, and the caller's scan holds those.
        values = [1 for step, rank, name in bad_weights if step == o.step and rank == o.rank and owned(name)]
    else:
        values = [bad for df in run.iter_tensor_frames(
                      ["rank", "name", "nan_count", "inf_count"], steps=[o.step], kinds=("param",),
                      nonfinite_only=not applied, label="reading the weights' rows")
                  for rank, name, bad in zip(df["rank"], df["name"], df["nan_count"] + df["inf_count"])
                  if rank == o.rank and owned(name)]
    if values:
        if not any(v > 0 for v in values):
            return None
        return replace(o, basis=OriginBasis.WEIGHTS), (applied[0] if applied else None)
    if not applied:
        return None
    grads = [int(step) for df in run.iter_tensor_frames(
                 ["step", "rank", "name"], steps=applied, kinds=("param_grad",), nonfinite_only=True,
                 label="reading the weights' rows")
             for step, rank, name in zip(df["step"], df["rank"], df["name"]) if rank == o.rank and owned(name)]
    if grads:
        return replace(o, basis=OriginBasis.WEIGHTS), min(grads)
    s = run.step_series().steps
    if s.loc[s["step"].isin(applied), "recorded_any"].any():
        return None  # the update recorded rows, and its own gradients were finite there
    return replace(o, basis=OriginBasis.AFTER_UPDATE), applied[0]


def unrecorded_steps(run: Run, steps: list[int], limit: int = 64) -> list[int]:
    """Of `steps` (the first `limit`), those for which no rank wrote a
    tensor row: a sentinel's steps neither sampled nor re-executed (runs
    before schema 1.5 recorded rows on every recorded step)."""
    steps = steps[:limit]
    if not steps:
        return []
    table = run.steps
    if "tensor_rows" not in table.columns:
        return []
    rows = table[table["step"].isin(steps)].groupby("step")["tensor_rows"].sum()
    return [s for s in steps if int(rows.get(s, 0) or 0) == 0]


class NoRerun(str, Enum):
    """Why a step the sentinel did not sample has no re-executed rows, as
    the run's manifests say (`reexecutions`, `reexecutions_capped_steps`,
    `reexecutions_undecided_steps`)."""
    OFF = "off"                # the recorder re-executes nothing (bundles=False, reexecute=False)
    REFUSED = "refused"        # the event's re-execution was refused: the entry's reason
    CAPPED = "capped"          # the re-execution cap left the event without one
    UNDECIDED = "undecided"    # its device facts were not on the host a step later: not judged in the job
    NOT_RECORDED = "not_recorded"  # the run does not say (older runs; a step past the noted ones)


def no_rerun(run: Run, step: int) -> dict:
    """`{"why": a `NoRerun` value, "reason": the refusal's reason or None, "capped":
    events capped in the run, "undecided": steps not judged}` for `step`,
    read from every rank's manifest."""
    manifests = [m for m in (run.manifest, *getattr(run, "rank_manifests", {}).values()) if isinstance(m, dict)]
    capped = max((_count(m.get("reexecutions_capped")) for m in manifests), default=0)
    undecided = max((_count(m.get("reexecutions_undecided")) for m in manifests), default=0)
    out = {"why": NoRerun.NOT_RECORDED.value, "reason": None, "capped": capped, "undecided": undecided}
    options = run.manifest.get("recorder") if isinstance(run.manifest.get("recorder"), dict) else {}
    if "reexecute" in options:  # absent: a run from before the sentinel
        policy = options["reexecute"]
        if policy is None:
            return dict(out, why=NoRerun.OFF.value)
        if isinstance(policy, dict) and policy.get("refused"):  # the job's layout refuses all (DDP/FSDP)
            return dict(out, why=NoRerun.REFUSED.value, reason=policy["refused"])
    for m in manifests:
        for entry in _listed(m.get("reexecutions")):
            if isinstance(entry, dict) and entry.get("step") == step and entry.get("check") == "refused":
                return dict(out, why=NoRerun.REFUSED.value, reason=entry.get("reason"))
    for key, why in (("reexecutions_capped_steps", NoRerun.CAPPED),
                     ("reexecutions_undecided_steps", NoRerun.UNDECIDED)):
        if any(step in _listed(m.get(key)) for m in manifests):
            return dict(out, why=why.value)
    return out


def _count(value) -> int:
    """A manifest count; anything else (a hand-edited file) counts nothing."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _listed(value) -> list:
    """A manifest list; anything else reads as empty."""
    return value if isinstance(value, list) else []


def no_rerun_words(gap: dict) -> str:
    """Why a step has no re-executed rows, for `NanReport.lines` and the summary."""
    why = NoRerun(gap["why"])
    if why is NoRerun.OFF:
        return "the recorder re-executes no step (AmpRecorder(bundles=False) or reexecute=False)"
    if why is NoRerun.REFUSED:
        return f"its re-execution was refused ({gap['reason'] or 'no reason recorded'})"
    if why is NoRerun.CAPPED:
        return (f"the re-execution cap left its event without one ({gap['capped']} event(s) in the run; "
                f"AmpRecorder(reexecute=ReexecutePolicy(...)) sets the cap)")
    if why is NoRerun.UNDECIDED:
        return ("its device facts were not on the host a step later, so the job did not judge it "
                f"({gap['undecided']} such step(s))")
    return "the run does not say why it was not re-executed" + (
        f" ({gap['capped']} event(s) capped, {gap['undecided']} step(s) not judged in the job)"
        if gap["capped"] or gap["undecided"] else "")


def applied_nonfinite_steps(run: Run) -> list[int]:
    """Steps whose non-finite parameter gradients the optimizer applied (no
    scaler, or it missed them), ascending."""
    s = run.step_series().steps
    return sorted(int(v) for v in s.loc[s["applied_nonfinite_any"], "step"])


def compiled_without_rows(run: Run) -> bool:
    """The recorder saw a compiled model and computed no module rows inside
    its graph (`AmpRecorder(compiled_rows=False)`, the default)."""
    m = run.manifest
    compiled = m.get("compiled") if isinstance(m.get("compiled"), dict) else {}
    options = m.get("recorder") if isinstance(m.get("recorder"), dict) else {}
    return bool(compiled.get("detected")) and not options.get("compiled_rows", False)


def forward_origin(rows: pd.DataFrame, covered: Coverage | None = None,
                   has_submodules=lambda name: False) -> Origin | None:
    """Forward origin among one step's non-finite rows (one rank).
    `covered`: what the step recorded (`coverage`; None: every row, as an
    eager step); `has_submodules(name)`: whether a module has watched
    submodules (`watched_below`)."""
    rows = rows[rows["phase"] == "forward"].sort_values("order", kind="stable")
    if rows.empty:
        return None
    step, rank = int(rows["step"].iloc[0]), int(rows["rank"].iloc[0])
    inputs = rows[rows["kind"] == "input"]
    if len(inputs):
        r = inputs.iloc[0]
        return Origin(schema.INPUT_NAME, "forward", "input", step, rank, int(r["order"]), schema.INPUT_NAME)
    acts = rows[rows["kind"] == "activation"]
    made_here = acts[acts["input_nonfinite"].isna() | (acts["input_nonfinite"] == 0)]
    if len(made_here):
        r = made_here.iloc[0]
        o = Origin(r["name"], "forward", "activation", step, rank, int(r["order"]), r["name"])
        if covered is not None and not covered.module_activations and has_submodules(r["name"]):
            return _uncertain(o, OriginBasis.WITHIN)  # the model's output, its layers unrecorded
        return o
    if acts.empty and (rows["kind"] == "loss").any():
        r = rows[rows["kind"] == "loss"].iloc[0]
        o = Origin(schema.LOSS_NAME, "forward", "loss", step, rank, int(r["order"]), schema.LOSS_NAME)
        # "Every activation was finite" needs activations recorded.
        return o if covered is None or "activation" in covered.kinds else _uncertain(o, OriginBasis.UNRECORDED)
    r = rows.iloc[0]
    return Origin(r["name"], "forward", r["kind"], step, rank, int(r["order"]), r["name"],
                  basis=OriginBasis.FIRST_ROW)


def backward_origin(rows: pd.DataFrame, covered: Coverage | None = None) -> Origin | None:
    """Backward origin among one step's non-finite rows (one rank). A row
    absent from `rows` was finite, or not recorded: `covered` (`coverage`;
    None: every row recorded) says which. Without `grad_output` rows on
    the step (a compiled step without in-graph rows) no module can be shown
    to have received a finite gradient, and the parameter gradients' order
    is that of their hooks, not of the computation."""
    rows = rows[rows["phase"] == "backward"].sort_values("order", kind="stable")
    if rows.empty:
        return None
    step, rank = int(rows["step"].iloc[0]), int(rows["rank"].iloc[0])
    gout = rows[rows["kind"] == "grad_output"]
    root = gout[gout["name"] == ""]
    if len(root):
        r = root.iloc[0]
        return Origin(schema.LOSS_NAME, "backward", "loss", step, rank, int(r["order"]), "")
    bad_out = set(zip(gout["name"], gout["call"]))
    bad_out_modules = set(gout["name"])
    undecided = False  # a rule needed a row the step did not record

    def recorded(name: str) -> bool:
        nonlocal undecided
        ok = covered is None or covered.outputs_recorded(name)
        undecided = undecided or not ok
        return ok

    for r in rows.itertuples(index=False):
        if r.kind == "grad_input":
            if not pd.isna(r.input_nonfinite):
                received_bad = r.input_nonfinite > 0
            elif recorded(r.name):
                received_bad = (r.name, r.call) in bad_out
            else:
                continue
            if not received_bad:
                return Origin(r.name, "backward", "grad_input", step, rank, int(r.order), r.name)
        elif r.kind == "param_grad":
            owner = r.name.rpartition(".")[0]
            if recorded(owner) and owner not in bad_out_modules:
                return Origin(owner, "backward", "param_grad", step, rank, int(r.order), r.name)
    r = rows.iloc[0]
    return Origin(r["name"], "backward", r["kind"], step, rank, int(r["order"]), r["name"],
                  basis=OriginBasis.UNRECORDED if undecided else OriginBasis.FIRST_ROW)


_NOTHING_RECORDED = Coverage(frozenset(), False, False)


def origins_of(run: Run, groups: dict, phase: str | None = None, below=None, covered: dict | None = None) -> dict:
    """{key: Origin | None} of `groups` ({key: one step's non-finite rows,
    one rank}): `phase`'s origin, or (None) the forward origin, else the
    backward one. A step's coverage is read only where it changes the
    answer: where the origin is the same whether every row or none was
    recorded, no shard is opened for it. `covered`: coverage already read
    ({(step, rank): Coverage}), added to here (a caller asking twice)."""
    below = watched_below(run) if below is None else below

    def origin(rows, cov):
        if phase == "forward":
            return forward_origin(rows, cov, below)
        if phase == "backward":
            return backward_origin(rows, cov)
        return forward_origin(rows, cov, below) or backward_origin(rows, cov)

    out, todo = {}, {}
    for key, rows in groups.items():
        either = origin(rows, None)
        if either == origin(rows, _NOTHING_RECORDED):
            out[key] = either
        else:
            todo[key] = rows
    covered = {} if covered is None else covered
    if todo:
        rows = pd.concat(list(todo.values()))
        steps = [s for s in rows["step"].unique() if not any(k[0] == s for k in covered)]
        if steps:
            covered.update(coverage(run, steps, rows))
        for key, g in todo.items():
            out[key] = origin(g, covered.get((int(g["step"].iloc[0]), int(g["rank"].iloc[0]))))
    return {key: out[key] for key in groups}  # in `groups`' order (scale's drivers break ties by it)


def coverage(run: Run, steps, rows: pd.DataFrame | None = None) -> dict[tuple[int, int], Coverage]:
    """{(step, rank): Coverage} of `steps`, streamed (a summary per step
    kept, not its rows). `rows`: those steps' non-finite rows, already
    read: a step where they show module rows of each phase they hold (the
    usual eager case) is not read again."""
    steps = sorted({int(s) for s in steps})
    kinds: dict[tuple[int, int], set] = {}
    below: dict[str, set] = {"activation": set(), "grad_output": set()}

    def add(df):
        for (step, rank, kind), _ in df.groupby(["step", "rank", "kind"], sort=False):
            kinds.setdefault((int(step), int(rank)), set()).add(kind)
        for kind, keys in below.items():
            sub = df[(df["kind"] == kind) & (df["name"] != "")]
            keys.update(zip(sub["step"].astype(int), sub["rank"].astype(int)))

    todo = steps
    if rows is not None and len(rows):
        known = rows[rows["step"].isin(steps) & rows["kind"].isin(_DECIDING_KINDS)]
        add(known)
        settled = set()
        for step, g in rows[rows["step"].isin(steps)].groupby("step"):
            key = (int(step), int(g["rank"].min()))
            need = [("activation" if ph == "forward" else "grad_output") for ph in set(g["phase"])]
            if all(key in below[k] for k in need):
                settled.add(int(step))
        todo = [s for s in steps if s not in settled]
    if todo:
        for batch in run.iter_tensor_batches(["step", "rank", "name", "kind"], steps=todo,
                                             kinds=_DECIDING_KINDS, label="reading what the steps recorded"):
            add(batch.to_pandas())
    return {(s, r): Coverage(frozenset(kinds.get((s, r), ())), (s, r) in below["activation"],
                             (s, r) in below["grad_output"]) for s in steps for r in run.ranks}


def watched_below(run: Run):
    """`has_submodules(name)` for `forward_origin`, from the manifest's
    module list (a run without one: False)."""
    modules = run.manifest.get("modules")
    # A manifest is data from another machine: anything but a list of
    # objects with a string name counts as no module list.
    watched = [m.get("name") for m in (modules if isinstance(modules, list) else [])
               if isinstance(m, dict) and m.get("watched") is True]
    watched = [n for n in watched if isinstance(n, str)]

    def has_submodules(name: str) -> bool:
        return any(n != name and (name == "" or n.startswith(name + ".")) for n in watched)
    return has_submodules


def backward_origins(run: Run, steps) -> dict[int, Origin]:
    """Backward origin of each of `steps` (lowest rank with a non-finite
    backward row), from the non-finite rows only."""
    steps = sorted({int(s) for s in steps})
    if not steps:
        return {}
    df = run.scan_tensors(_COLUMNS, nonfinite_only=True, steps=steps,
                          kinds=("grad_output", "grad_input", "param_grad"),
                          label="reading skipped steps")
    out = {}
    for step, g in df.groupby("step", sort=True):
        rank = int(g["rank"].min())
        o = backward_origin(g[g["rank"] == rank])
        if o is not None:
            out[int(step)] = o
    return attribute_shared_all(run, out)


def attribute_shared_all(run: Run, origins: dict) -> dict:
    """`attribute_shared` for many steps' origins, reading the users'
    rows of every step concerned in one scan."""
    aliases = tied_aliases(run)
    tied = sorted({o.step for o in origins.values() if o.kind == "param_grad" and o.tensor in aliases})
    if not tied:
        return origins
    rows = run.scan_tensors(_USER_COLUMNS, steps=tied, kinds=["grad_output"], label="reading tied parameters' users")
    return {k: attribute_shared(run, o, rows) for k, o in origins.items()}


def calibration_steps(run: Run) -> set[int]:
    """The scaler's calibration skips: the leading run of skipped steps of a
    run whose first recorded scale is the scaler's `init_scale` (a fresh
    GradScaler backing off until the gradients fit)."""
    s = run.step_series().steps
    init = (run.scaler or {}).get("init_scale")
    if s.empty or init is None:
        return set()
    per_step = pd.DataFrame({"skipped": s["skipped_any"].to_numpy(),
                             "scale": s["loss_scale_before_first"].to_numpy()}, index=s["step"])
    if per_step.empty or per_step["scale"].iloc[0] != init:
        return set()
    out = set()
    for step, row in per_step.iterrows():
        if not row["skipped"]:
            break
        out.add(int(step))
    return out


def tied_aliases(run: Run) -> dict[str, list[str]]:
    """{recorded parameter name: its other names} for tied parameters."""
    return {p["name"]: list(p["aliases"]) for p in run.manifest.get("params") or [] if p.get("aliases")}


_USER_COLUMNS = ["step", "rank", "name", "kind", "dtype", "absmax", "nan_count", "inf_count"]


def attribute_shared(run: Run, o: Origin, rows: pd.DataFrame | None = None) -> Origin:
    """A `param_grad` origin of a tied parameter, moved to the module among
    its users whose operation made the value (see the module docstring).
    `rows`: the `grad_output` rows of its step when already read."""
    aliases = tied_aliases(run).get(o.tensor) if o.kind == "param_grad" else None
    if not aliases:
        return o
    names = [o.tensor] + list(aliases)
    users = {n.rpartition(".")[0]: n for n in names}
    if rows is None:
        rows = run.scan_tensors(_USER_COLUMNS, steps=[o.step], kinds=["grad_output"],
                                label="reading a tied parameter's users")
    rows = rows[(rows["step"] == o.step) & (rows["rank"] == o.rank) & rows["name"].isin(list(users))]
    best, best_key = None, None
    for name, g in rows.groupby("name", sort=False):
        if ((g["nan_count"] + g["inf_count"]) > 0).any():
            continue  # it received a non-finite gradient: it only carried one
        key = ((g["dtype"] == "float16").any(), float(g["absmax"].max()))
        if best_key is None or key > best_key:
            best, best_key = name, key
    if best is None:
        best = o.name
    return replace(o, name=best, aliases=tuple(n for n in names if users.get(best) != n))


# ------------------------------------------------------------------ helpers
class _Accumulator:
    """First appearance per (name, kind) and the rows of the first step of
    each phase, merged batch by batch (bounded memory)."""

    def __init__(self):
        self._layers: pd.DataFrame | None = None
        self._last_seen: dict[tuple, int] = {}  # (name, kind, rank) -> last step counted
        self._counts: dict[tuple, int] = {}     # (name, kind) -> non-finite (step, rank) pairs
        self.first_rows: dict[str, pd.DataFrame] = {}
        # Per phase, the rows of the first step with a non-finite row of a
        # module below the model (an activation; a gradient at its output or
        # inputs): a step whose module rows were recorded.
        self.first_module_rows: dict[str, pd.DataFrame] = {}

    def add(self, df: pd.DataFrame) -> None:
        df = df.assign(_ph=(df["phase"] == "backward").astype(np.int8))
        df = df.sort_values(["step", "_ph", "order", "rank"], kind="stable")
        for phase, g in df.groupby("phase"):
            _keep_first(self.first_rows, phase, g, g)
            module = g["kind"].isin(_MODULE_KINDS[phase]) & (g["name"] != "")
            if module.any():
                _keep_first(self.first_module_rows, phase, g, g[module])

        firsts = df.groupby(["name", "kind"], sort=False).head(1)
        firsts = firsts.assign(first_step=firsts["step"], last_step=firsts["step"])
        lasts = df.groupby(["name", "kind"], sort=False)["step"].max()
        firsts = firsts.set_index(["name", "kind"])
        firsts["last_step"] = lasts
        firsts = firsts.reset_index()
        if self._layers is None:
            self._layers = firsts
        else:
            both = pd.concat([self._layers, firsts], ignore_index=True)
            last = both.groupby(["name", "kind"])["last_step"].max()
            both = both.sort_values(["first_step", "_ph", "order", "rank"], kind="stable")
            both = both.groupby(["name", "kind"], sort=False).head(1).set_index(["name", "kind"])
            both["last_step"] = last
            self._layers = both.reset_index()

        for (name, kind, rank), steps in df.groupby(["name", "kind", "rank"], sort=False)["step"]:
            uniq = np.unique(steps.to_numpy())
            n = len(uniq)
            if self._last_seen.get((name, kind, rank)) == uniq[0]:
                n -= 1
            self._last_seen[(name, kind, rank)] = int(uniq[-1])
            self._counts[(name, kind)] = self._counts.get((name, kind), 0) + n

    def layers(self) -> pd.DataFrame:
        if self._layers is None:
            return pd.DataFrame({c: pd.Series(dtype=t) for c, t in (
                ("name", str), ("kind", str), ("phase", str), ("first_step", "int64"), ("order", "int64"),
                ("rank", "int64"), ("origin", bool), ("nan_count", "int64"), ("inf_count", "int64"),
                ("module", str), ("last_step", "int64"), ("nonfinite_steps", "int64"), ("_ph", "int8"))})
        t = self._layers.sort_values(["first_step", "_ph", "order", "rank"], kind="stable").reset_index(drop=True)
        t["module"] = [n.rpartition(".")[0] if k == "param_grad" else n for n, k in zip(t["name"], t["kind"])]
        t["nonfinite_steps"] = [self._counts.get((n, k), 0) for n, k in zip(t["name"], t["kind"])]
        for c in ("first_step", "order", "rank", "nan_count", "inf_count", "last_step", "nonfinite_steps"):
            t[c] = t[c].astype("int64")
        return t


_MODULE_KINDS = {"forward": ("activation",), "backward": ("grad_output", "grad_input")}


def _keep_first(firsts: dict, phase: str, g: pd.DataFrame, which: pd.DataFrame) -> None:
    """Keep in `firsts[phase]` the rows of `g` of the first (step, rank)
    among `which`'s rows, when it comes before the kept one (the same: a
    step split over two batches, joined)."""
    step = int(which["step"].min())
    rank = int(which.loc[which["step"] == step, "rank"].min())
    g = g[(g["step"] == step) & (g["rank"] == rank)]
    cur = firsts.get(phase)
    if cur is None or (step, rank) < (int(cur["step"].iloc[0]), int(cur["rank"].iloc[0])):
        firsts[phase] = g
    elif (step, rank) == (int(cur["step"].iloc[0]), int(cur["rank"].iloc[0])):
        firsts[phase] = pd.concat([cur, g])


def _scaler_handled(backward: Origin | None, forward: Origin | None, facts) -> bool:
    """Whether the backward origin's step is one the loss scaler absorbed:
    skipped, with a finite loss and no forward origin in that step."""
    if backward is None or (forward is not None and forward.step == backward.step):
        return False
    row = facts.row(backward.step, backward.rank)
    return row is not None and row[0] and not row[1]


def _origin_row(o: Origin, origins: dict) -> tuple[str, str] | None:
    """(name, kind) of the layer entry that shows origin `o`, if any."""
    if o.phase == "backward" and o.name == schema.LOSS_NAME:
        fwd = origins.get("forward")
        if fwd is not None and fwd.step == o.step:
            return None  # the loss was already non-finite: backward only carries it
        return ("", "grad_output")
    return (o.tensor, o.kind)


