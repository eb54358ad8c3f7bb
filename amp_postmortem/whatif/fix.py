"""Which module kept in float32 saves the step (the playbook's step 4).

`find_fix(source, step, model=...)`:

1. Replay the step in its recorded reduced precision (the recorded device's
   autocast policy, the recorded loss scale) and in float64, and rank the
   modules by their own (local) error, as `replay` does. The model itself
   (the root, "") is never a candidate: keeping all of it in float32 is not
   mixed precision.
2. Candidates, worst local error first (ties: the innermost module first),
   at most `max_candidates`; modules whose own arithmetic is `ok` come only
   after the broken and degraded ones.
3. One trial per candidate: the step replayed with that module excluded from
   autocast (its floating inputs cast to float32, native autocast and the
   policy emulation off inside it: `RunConfig.fp32_modules`, which is what
   `recorders.fp32.keep_fp32` does in training). Each trial reports whether
   the forward and the backward are finite, the loss, output and gradient
   error against float64.
4. A trial "saves" the step by the one criterion of fix, bisect and
   recommend (`whatif.judge`): finite, no parameter gradient beyond the
   replay's broken threshold of float64, no module's own arithmetic
   `broken`. The step as recorded is judged the same way: a finite step
   with a broken module still gets a search. The first single module
   that saves it, in candidate order, is the fix. When none
   saves it, a greedy search adds, round by round, the candidate that helps
   most (fewest NaN/Inf values, then lowest gradient error) until the set
   saves the step or `max_set` modules are in it; a found set is then pruned
   of members it does not need.
5. The patch: one `keep_fp32(model.<name>)` line per module of the set.
6. The fix is tried on every other saved step of the run (`saved_steps`,
   `not_saved_steps`): one that saves this step and not the next only
   moves the failure.
7. The cheapest remedy is re-run over the saved window of steps holding
   the step (`window_check.py`: the steps after it too): "verified" only
   when the window stays finite with it; else the step it fails at; with
   no window, "verified on the saved step only" (`window_check`).

Before the modules, the op-level remedy (`op_fix.py`): the culprit's
operation, at its line of the model's source, in float32, verified the same
way, with the line's patch (`op_fix`). Every remedy that saves the step is
ranked by the forward work it moves from float16/bfloat16 to float32
(`remedies`, cheapest first): the op's line before its module. `fix` and
`patch` stay the module-level answer, the fallback when no line saves it.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

import pandas as pd

from recorders.format import plain
from ..names import BackwardStart, Word
from ..names import display_name as _display
from . import NotSavedBy, Trial, fmt_num, prepare, report_progress
from .op_fix import OpFixStatus, find_op_fix, work_cost, work_words
from .saved_steps import not_saved_steps, saved_steps, try_on_saved_steps
from ..result import CommandResult

MAX_CANDIDATES = 12
MAX_SET = 4
_STATUS_RANK = {"broken": 0, "degraded": 1, "ok": 2}
TRIAL_COLUMNS = ["modules", "local_rel_err", "forward_finite", "backward_finite", "loss_scale",
                 "nonfinite_values", "loss_rel_err", "output_rel_err", "grad_rel_err", "saved", "not_saved_by"]


class FixSearch(Word):
    """How the fix was searched for (the module's doc); `value` is the
    `--json` "search"."""
    NOT_NEEDED = "not_needed"      # the step is already saved as recorded
    SINGLE = "single"              # one module saves it
    GREEDY = "greedy"              # modules added round by round
    NONE = "none"                  # no set saves it (or float64 fails too: nothing to search)


@dataclass
class FixReport(CommandResult):
    step: int
    rank: int
    precision: str
    policy: dict
    loss_scale: float
    baseline: Trial                 # the recorded precision, nothing kept in float32 (modules ())
    candidates: list                # [{"name", "phase", "status", "local_rel_err"}], trial order
    trials: list                    # [Trial] with its modules and search round, in trial order
    fix: list | None                # smallest saving set found, or None
    search: FixSearch
    patch: str | None
    notes: list = field(default_factory=list)
    backward_start: BackwardStart = BackwardStart.SAVED   # engine.ReplaySession.start_backward
    # The fix tried on every saved step of the run (this one first): [StepCheck]
    saved_steps_check: list = field(default_factory=list)
    op_fix: object = None           # op_fix.OpFix, or None (nothing to fix)
    remedies: list = field(default_factory=list)   # Remedy: every one that saves the step, cheapest first
    window_check: object = None     # window_check.WindowCheck of remedies[0], or None (no remedy)

    @property
    def saved_steps(self) -> list:
        return saved_steps(self.saved_steps_check)

    @property
    def not_saved_steps(self) -> list:
        return not_saved_steps(self.saved_steps_check)

    def document(self) -> dict:
        return plain({"step": self.step, "rank": self.rank, "precision": self.precision, "policy": self.policy,
                      "loss_scale": self.loss_scale, "baseline": self.baseline.to_dict(),
                      "candidates": self.candidates, "trials": [t.to_dict() for t in self.trials],
                      "fix": self.fix, "search": self.search.value, "patch": self.patch,
                      "saved_steps_check": [c.to_dict() for c in self.saved_steps_check],
                      "saved_steps": self.saved_steps,
                      "not_saved_steps": self.not_saved_steps,
                      "notes": self.notes, "backward_start": self.backward_start.value,
                      "thresholds": _thresholds(), "op_fix": self.op_fix.to_dict() if self.op_fix else None,
                      "remedies": [r.to_dict() for r in self.remedies],
                      "window_check": self.window_check.to_dict() if self.window_check else None})

    def table(self) -> pd.DataFrame:
        local = {c["name"]: c["local_rel_err"] for c in self.candidates}
        rows = [{"modules": ",".join(_display(m) for m in t.modules),
                 "local_rel_err": local.get(t.modules[0]) if len(t.modules) == 1 else None,
                 **{k: getattr(t, k) for k in TRIAL_COLUMNS[2:-1]}, "not_saved_by": not_saved_by(t)}
                for t in self.trials]
        return pd.DataFrame(rows, columns=TRIAL_COLUMNS)

    def lines(self) -> list[str]:
        b = self.baseline
        out = [f"step {self.step}, rank {self.rank}: {self.precision} replay, policy "
               f"{self.policy.get('device_type')}{' (emulated)' if self.policy.get('emulated') else ''}, "
               f"loss scale {self.loss_scale:g}",
               f"as recorded: {_verdict(b)} (grad error vs float64 {fmt_num(b.grad_rel_err)}"
               + ("" if self.backward_start is BackwardStart.SAVED else
                  f", backward from the {self.backward_start.value} start")
               + ")"]
        out += [f"note: {n}" for n in self.notes]
        if self.search is FixSearch.NOT_NEEDED:
            where = ("" if not b.backed_off else
                     f" once the scaler backs off to {b.loss_scale:g} (`scale-window` says more)")
            out.append(f"the step is already saved in the replay{where} (finite, gradients within the "
                       "thresholds of float64, no module broken): nothing to keep in float32")
            return out
        if self.op_fix is not None:
            out += self.op_fix.lines()
        if self.fix:
            how = "one module" if len(self.fix) == 1 else f"{len(self.fix)} modules (greedy search)"
            op_saves = self.op_fix is not None and self.op_fix.saves_step
            costlier = ("" if not op_saves else " (module level, costlier)"
                        if self.remedies and self.remedies[0].kind is RemedyKind.LINE else " (module level)")
            out.append(f"fix{costlier}: keep {', '.join(_display(m) for m in self.fix)} in float32 ({how}); "
                       "apply after building the model:")
            out += ["    " + line for line in self.patch.splitlines()]
        else:
            op_saves = self.op_fix is not None and self.op_fix.saves_step
            out.append(f"no set of up to {MAX_SET} modules kept in float32 saves the step "
                       + ("(the op-level fix above does)" if op_saves else
                          "(see `recommend` for bf16 and the loss scale)"))
        if len(self.saved_steps_check) > 1:
            out.append(f"tried on every saved step of the run: saves step(s) "
                       f"{', '.join(map(str, self.saved_steps)) or 'none'}"
                       + (f"; does NOT save step(s) {', '.join(map(str, self.not_saved_steps))}"
                          if self.not_saved_steps else ""))
            out += [f"  step {c.step}: {c.why}" for c in self.saved_steps_check if not c.saved]
        if len(self.remedies) > 1:
            out.append("remedies by extra float32 work, cheapest first:")
            out += [f"  {i}. {remedy_words(r)}: {work_words(r.fp32_flops, r.fp32_share)}"
                    + ("" if r.saves_every_saved_step else " (does not save every saved step)")
                    for i, r in enumerate(self.remedies, 1)]
        if self.window_check is not None:
            out.append(self.window_check.line())
        return out


def remedy_words(r: Remedy) -> str:
    if r.kind is RemedyKind.LINE:
        return f"line {r.where} in float32"
    return "keep " + ", ".join(_display(m) for m in r.modules) + " in float32"


def find_fix(source, step=None, *, rank=None, model=None, device: str = "cpu", policy: str = "recorded",
             precision: str | None = None, loss_fn=None, max_candidates: int = MAX_CANDIDATES,
             max_set: int = MAX_SET, progress=None, prepared=None, loss=None, command: str = "fix") -> FixReport:
    """Search the modules whose float32 execution saves the step. `loss`:
    the loop's loss for the window check (as for `rerun`); `command`: the
    command it is made for (`recommend` runs it too)."""
    from ..replaying import attribution

    p = prepared or prepare(source, step, rank=rank, model=model, device=device, policy=policy,
                            precision=precision, loss_fn=loss_fn, keep_inputs=True)
    reference = p.reference_for(None, keep_inputs=True)
    baseline = p.trial().with_modules(())
    notes = list(p.notes)
    report = FixReport(step=p.step, rank=p.rank, precision=p.precision, policy=p.policy_dict(),
                       loss_scale=p.loss_scale, baseline=baseline, candidates=[], trials=[], fix=None,
                       search=FixSearch.NOT_NEEDED, patch=None, notes=notes, backward_start=p.backward_start)
    if baseline.saved:
        return report
    if not p.reference_finite:
        report.search = FixSearch.NONE  # no precision setting repairs what float64 cannot compute
        return report
    recorded = p.run(capture=True)
    comparisons = attribution.compare_run(p.session, reference, recorded, local=True)
    report.op_fix = find_op_fix(p, recorded, attribution.find_culprit(comparisons, p.precision), progress)
    report.candidates = candidates = rank_candidates(comparisons, max_candidates)
    names = [c["name"] for c in candidates]
    total = len(names)
    cache: dict[tuple, Trial] = {}

    def trial(modules: tuple, rnd: int) -> Trial:
        key = tuple(sorted(modules))
        if key not in cache:
            cache[key] = p.trial(fp32_modules=tuple(modules)).with_modules(modules, rnd)
            report.trials.append(cache[key])
            report_progress(progress, "keeping modules in float32", len(report.trials), total)
        return cache[key]

    singles = [trial((n,), 1) for n in names]
    saving = [t for t in singles if t.saved]
    if saving:
        # The first saving candidate in candidate order: the module whose own
        # arithmetic is worst. Another that also saves the step (the one
        # feeding it, whose float32 output makes it compute in float32) does
        # so only by side effect and keeps more of the model out of float16.
        report.fix, report.search = list(saving[0].modules), FixSearch.SINGLE
    elif names:
        chosen = _greedy(names, singles, trial, max_set)
        if chosen:
            report.fix, report.search = chosen, FixSearch.GREEDY
        else:
            report.search = FixSearch.NONE
    else:
        report.search = FixSearch.NONE
        notes.append("no module could be replayed alone: no candidate to keep in float32")
    if report.fix:
        net = p.session.model(p.config.weight_dtype)
        position = {name: i for i, (name, _) in enumerate(net.named_modules())}
        report.fix = sorted(report.fix, key=lambda n: position.get(n, len(position)))  # model order
        report.patch = patch_lines(net, report.fix)
        report.saved_steps_check = try_on_saved_steps(p, report.fix, progress)
    report.remedies = ranked_remedies(p, report)
    if report.remedies and model is not None:
        report.window_check = check_remedy(p, report.remedies[0], model=model, device=device, policy=policy,
                                           loss_fn=loss_fn, loss=loss, command=command)
    return report


def check_remedy(p, remedy, *, model, device, policy, loss_fn, loss=None, command: str = "fix"):
    """`remedy` re-run over the saved window holding the step (`window_check`)."""
    from .window_check import check_over_window, run_of_bundle
    lines = ()
    if remedy.kind is RemedyKind.LINE:
        file, _, line = remedy.where.rpartition(":")
        lines = ((file, int(line)),)
    return check_over_window(run_of_bundle(p.bundle), p.step, remedy_words(remedy), model=model, rank=p.rank,
                             fp32_modules=remedy.modules, fp32_lines=lines, precision=p.precision, device=device,
                             policy=policy, loss_fn=loss_fn, loss=loss, command=command)


class RemedyKind(enum.Enum):
    LINE = "line"          # a source line in float32 (op_fix.py)
    MODULES = "modules"    # modules kept in float32 (keep_fp32)


@dataclass(frozen=True)
class Remedy:
    """A remedy that saves the step, with what it costs in float32 work."""
    kind: RemedyKind
    fp32_flops: float
    fp32_share: float | None
    saves_every_saved_step: bool
    where: str | None = None       # LINE: file:line
    op: str | None = None          # LINE: the aten op it was chosen for
    modules: tuple = ()            # MODULES

    def to_dict(self) -> dict:
        return {"kind": self.kind.value, "where": self.where, "op": self.op,
                "modules": list(self.modules) if self.kind is RemedyKind.MODULES else None,
                "fp32_flops": self.fp32_flops, "fp32_share": self.fp32_share,
                "saves_every_saved_step": self.saves_every_saved_step}


def ranked_remedies(p, report: FixReport) -> list:
    """The remedies that save the step, by the work they move to float32
    (those that do not save every saved step last)."""
    out = []
    op = report.op_fix
    if op is not None and op.saves_step:
        out.append(Remedy(RemedyKind.LINE, op.fp32_flops, op.fp32_share, op.status is OpFixStatus.SAVED,
                          where=op.where, op=op.op["op"]))
    if report.fix:
        flops, share, _ = work_cost(p, fp32_modules=tuple(report.fix))
        out.append(Remedy(RemedyKind.MODULES, flops, share, not report.not_saved_steps, modules=tuple(report.fix)))
    # Equal work: the narrower remedy (the line) first.
    return sorted(out, key=lambda r: (not r.saves_every_saved_step, r.fp32_flops, r.kind is not RemedyKind.LINE))


def rank_candidates(comparisons, limit: int = MAX_CANDIDATES) -> list:
    """Modules (root excluded) by local error, worst first; broken before
    degraded before ok; among equals the innermost and earliest first."""
    best: dict[str, dict] = {}
    for c in comparisons:
        if c.name == "" or not c.local_done or c.local.empty:
            continue
        status = c.status[0]
        err = c.local.rel_l2
        row = best.get(c.name)
        key = (_STATUS_RANK.get(status, 3), -err)
        if row is None or key < row["_key"]:
            best[c.name] = {"name": c.name, "phase": c.phase, "status": status, "local_rel_err": err,
                            "ratio_to_rounding": c.local.ratio_to_rounding, "_key": key, "_order": c.order}
    rows = list(best.values())
    depth = {r["name"]: _descendants(r["name"], best) for r in rows}
    rows.sort(key=lambda r: (*r["_key"], depth[r["name"]], r["phase"] != "forward", r["_order"]))
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows[:limit]]


def _descendants(name: str, names) -> int:
    return sum(1 for n in names if n != name and n.startswith(name + "."))


def _greedy(names, singles, trial, max_set) -> list | None:
    current: tuple = ()
    results = {(t.modules[0],): t for t in singles}
    best_now = None
    for rnd in range(1, max_set + 1):
        if rnd > 1:
            results = {}
            for n in names:
                if n in current or any(_inside(n, c) or _inside(c, n) for c in current):
                    continue
                results[current + (n,)] = trial(current + (n,), rnd)
        if not results:
            return None
        chosen, t = min(results.items(), key=lambda kv: _badness(kv[1]))
        if best_now is not None and _badness(t) >= _badness(best_now):
            return None  # no candidate helps any more
        current, best_now = chosen, t
        if t.saved:
            return _prune(list(current), trial)
    return None


def _prune(members: list, trial) -> list:
    """Drop members the set does not need (each removal re-checked)."""
    for m in list(members):
        if len(members) == 1:
            break
        rest = [x for x in members if x != m]
        if trial(tuple(rest), 0).saved:
            members = rest
    return members


def _badness(t: Trial) -> tuple:
    """How far a trial is from saving the step: unsaved first, then NaN/Inf
    values, gradient error, set size (the greedy search's order)."""
    return (not t.saved, t.nonfinite_values, _finite_or_inf(t.grad_rel_err), len(t.modules))


def _finite_or_inf(v):
    return float("inf") if v is None or v != v else v


def _inside(name: str, parent: str) -> bool:
    return parent == "" or name.startswith(parent + ".")


# ------------------------------------------------------------------- patch
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def module_expression(model, name: str, root: str = "model") -> str:
    """Python that reaches submodule `name` from `root`: attributes, `[i]`
    for ModuleList/Sequential, `["k"]` for ModuleDict, `get_submodule`
    when a part is not an identifier."""
    import torch.nn as nn
    expr, module = root, model
    for part in name.split("."):
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and part.isdigit():
            expr += f"[{part}]"
        elif isinstance(module, nn.ModuleDict):
            expr += f"[{part!r}]"
        elif _IDENT.match(part):
            expr += f".{part}"
        else:
            return f"{root}.get_submodule({name!r})"
        module = module.get_submodule(part)
    return expr


def patch_lines(model, names) -> str:
    """The patch a user applies: import the helper, one line per module."""
    lines = ["from recorders.fp32 import keep_fp32"]
    lines += [f"keep_fp32({module_expression(model, n)})" for n in names]
    return "\n".join(lines)


def not_saved_by(t) -> str:
    """Which check of `whatif.judge` a trial failed (`Trial.not_saved_by`),
    in a few words."""
    trial = Trial.of(t)
    by = trial.not_saved_by
    if by is NotSavedBy.NOTHING:
        return ""
    if by is NotSavedBy.NONFINITE:
        return "NaN/Inf"
    if by is NotSavedBy.PARAMS_OFF:
        return f"{len(trial.params_off)} param grads off"
    c = trial.culprit or {}
    return f"{_display(c.get('name', ''))} broken ({c.get('phase')})"


def _thresholds() -> dict:
    from ..replaying import attribution
    return {"param_grad_broken_rel_err": attribution.PROPAGATED_BROKEN_REL,
            "local_broken_rel_err": attribution.BROKEN_REL}


def _verdict(t) -> str:
    trial = Trial.of(t)
    if trial.finite:
        at = f" at loss scale {trial.loss_scale:g}" if trial.backed_off else ""
        return (f"saved{at}" if trial.saved else f"finite{at} but NOT saved: {trial.why}")
    return (f"NON-FINITE in the {' and '.join(trial.nonfinite_phases)} "
            f"({trial.nonfinite_values} NaN/Inf values)")
