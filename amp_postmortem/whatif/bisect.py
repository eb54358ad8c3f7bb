"""Which samples of the saved batch make the step non-finite (the playbook's
"reproduce on a small batch").

`bisect_samples(source, step, model=...)` replays the step in its recorded
precision on slices of the batch (indices along dimension 0 of every input
and output gradient, `RunConfig.batch`) and bisects: a failing slice is cut
in two and each half replayed, down to single samples. A slice fails when
its replay holds a NaN/Inf in the forward outputs or the gradients.

A slice fails when its replay does not save the step by the one criterion
of fix and recommend (`whatif.judge`): a NaN/Inf in the outputs or the
gradients, a parameter gradient beyond the replay's broken threshold of
float64, or a module whose own arithmetic is `broken`.

Verdict (`kind`):
- `not_reproduced`: the whole batch replays saved; nothing to bisect;
- `model`: every sample fails alone, or a few do while their inputs look
  ordinary: the model (or its precision) is the problem, which those samples
  trigger (their indices are reported);
- `data`: some samples fail alone and their inputs are suspicious in
  themselves: NaN/Inf in a floating input, or a floating input whose
  largest magnitude is more than `FAR_OUTSIDE` times that of every passing
  sample. Integer inputs (token ids) cannot be NaN/Inf and have no range to
  compare: they are never the evidence (their stats are null);
- `batch`: no half fails alone although the batch does: the samples only
  fail together (batch statistics, a reduction over the batch).
Whether float64 fails on the failing samples too is reported either way
(then no precision setting is the fix).

With several micro-batches the same indices are taken from each of them.
The replay budget (`max_replays`) bounds the search; groups left unsplit are
listed as `unresolved`.

A model that normalises over the batch (BatchNorm in training:
`replaying.engine.batch_statistics_modules`) takes no one-sample slice (a
BatchNorm1d raises; any BatchNorm would normalise the sample by itself), so
the slices keep at least two samples (`SampleSlicing`): a failing group of
two or three is not cut further, and each of its samples is judged paired
with one sample that passed in a slice of its own (`SliceMethod.PAIRED`).
When no sample passed, each is judged alone with those modules on their
running statistics, as in eval mode (`SliceMethod.RUNNING_STATISTICS`; the
group stays unresolved when a module keeps none). The report's `slicing`
says what was done and `slicing_note` puts it in words.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import pandas as pd

from recorders.format import plain

from ..names import Word
from . import Trial, prepare, report_progress
from .fix import not_saved_by
from ..result import CommandResult

MAX_REPLAYS = 256
# A failing sample's floating input this many times larger in magnitude than
# that input in every passing sample is "far outside" their range.
FAR_OUTSIDE = 10.0
SAMPLE_COLUMNS = ["index", "forward_finite", "backward_finite", "not_saved_by", "input_absmax", "passing_absmax",
                  "input_nonfinite", "fp64_finite", "suspicious"]
# Each sample's row also says how it was judged (`judged`: a SliceMethod), in
# the JSON only: the note says it in words where it is not "alone".
# A model that normalises over the batch is replayed on slices of at least this many samples.
MIN_NORMALISED_SLICE = 2


class SliceMethod(str, Enum):
    """How one sample was judged."""
    ALONE = "alone"                            # a slice of that sample only
    PAIRED = "paired"                          # with one sample that passes (batch statistics need two)
    RUNNING_STATISTICS = "running_statistics"  # alone, the batch-normalising modules on running statistics


@dataclass
class SampleSlicing:
    """How the batch was sliced: the modules that normalise over it (none:
    one-sample slices), the passing sample the others were paired with, how
    each judged sample was judged, and the groups too small to cut that no
    method could judge."""
    batch_statistics_modules: tuple = ()
    running_statistics_available: bool = False
    partner: int | None = None
    judged: dict = field(default_factory=dict)     # sample index -> SliceMethod
    unsplit: list = field(default_factory=list)    # failing groups of < 2 * MIN_NORMALISED_SLICE left whole

    @property
    def min_slice(self) -> int:
        return MIN_NORMALISED_SLICE if self.batch_statistics_modules else 1

    def methods(self) -> list[SliceMethod]:
        return [m for m in SliceMethod if m in self.judged.values()]

    def slice_of(self, i: int) -> dict:
        """The what-if changes that replay sample i as it was judged."""
        how = self.judged.get(i, SliceMethod.ALONE)
        if how is SliceMethod.PAIRED:
            return {"batch": sorted([i, self.partner])}
        return {"batch": [i], "running_statistics": how is SliceMethod.RUNNING_STATISTICS}

    def to_dict(self) -> dict:
        return {"batch_statistics_modules": list(self.batch_statistics_modules), "min_slice": self.min_slice,
                "running_statistics_available": self.running_statistics_available, "partner": self.partner,
                "methods": [m.value for m in self.methods()],
                "paired_samples": sorted(i for i, m in self.judged.items() if m is SliceMethod.PAIRED),
                "running_statistics_samples": sorted(i for i, m in self.judged.items()
                                                     if m is SliceMethod.RUNNING_STATISTICS),
                "unsplit": [list(g) for g in self.unsplit]}


@dataclass(frozen=True)
class BadSample:
    """A sample that fails alone (or paired, or on running statistics:
    `judged`), its trial and what its floating inputs look like."""
    index: int
    trial: Trial
    input_absmax: float | None      # None: no floating input
    passing_absmax: float | None
    input_nonfinite: int | None
    fp64_finite: bool
    suspicious: str | None          # why its inputs are suspicious in themselves, or None
    judged: SliceMethod

    def to_dict(self) -> dict:
        """SAMPLE_COLUMNS and `judged` (its `--json` row)."""
        return {"index": self.index, "forward_finite": self.trial.forward_finite,
                "backward_finite": self.trial.backward_finite, "not_saved_by": not_saved_by(self.trial),
                "input_absmax": self.input_absmax, "passing_absmax": self.passing_absmax,
                "input_nonfinite": self.input_nonfinite, "fp64_finite": self.fp64_finite,
                "suspicious": self.suspicious, "judged": self.judged.value}


class BisectKind(Word):
    """The verdict (the module's doc); `value` is the `--json` "kind"."""
    NOT_REPRODUCED = "not_reproduced"
    MODEL = "model"
    DATA = "data"
    BATCH = "batch"


@dataclass
class BisectReport(CommandResult):
    step: int
    rank: int
    precision: str
    batch_size: int | None
    micro_batches: int
    kind: BisectKind
    bad_samples: list
    samples: list                  # [BadSample], per bad sample
    unresolved: list               # index groups that failed but were not split (budget)
    replays: int
    message: str
    notes: list = field(default_factory=list)
    slicing: SampleSlicing = field(default_factory=SampleSlicing)

    def document(self) -> dict:
        return plain({"step": self.step, "rank": self.rank, "precision": self.precision,
                      "batch_size": self.batch_size, "micro_batches": self.micro_batches, "kind": self.kind.value,
                      "bad_samples": self.bad_samples, "bad_share": self.bad_share,
                      "suspicious_samples": self.suspicious_samples,
                      "samples": [x.to_dict() for x in self.samples],
                      "unresolved": self.unresolved, "replays": self.replays, "message": self.message,
                      "notes": self.notes, "slicing": self.slicing.to_dict()})

    @property
    def suspicious_samples(self) -> list:
        """Failing samples whose inputs are suspicious in themselves."""
        return [s.index for s in self.samples if s.suspicious]

    @property
    def bad_share(self) -> float | None:
        return len(self.bad_samples) / self.batch_size if self.batch_size else None

    def table(self) -> pd.DataFrame:
        return pd.DataFrame([x.to_dict() for x in self.samples], columns=SAMPLE_COLUMNS)

    def lines(self) -> list[str]:
        out = [f"step {self.step}, rank {self.rank}: {self.precision} replay of a batch of {self.batch_size}"
               + (f" ({self.micro_batches} micro-batches, same indices in each)" if self.micro_batches > 1 else ""),
               f"{self.kind.value}: {self.message}", f"{self.replays} replays"]
        out += [f"note: {n}" for n in self.notes]
        return out


def bisect_samples(source, step=None, *, rank=None, model=None, device: str = "cpu", policy: str = "recorded",
                   precision: str | None = None, loss_fn=None, fp32_modules=(), max_replays: int = MAX_REPLAYS,
                   progress=None, prepared=None) -> BisectReport:
    """Bisect the saved batch to the samples whose replay does not save the step."""
    from ..replaying import RunConfig

    p = prepared or prepare(source, step, rank=rank, model=model, device=device, policy=policy,
                            precision=precision, loss_fn=loss_fn)
    notes = list(p.notes)
    n = _batch_size(p.bundle.inputs[0] if p.bundle.inputs else None)
    slicing = SampleSlicing(batch_statistics_modules=p.session.batch_statistics_modules,
                            running_statistics_available=p.session.running_statistics_available)
    report = BisectReport(step=p.step, rank=p.rank, precision=p.precision, batch_size=n,
                          micro_batches=len(p.bundle.inputs), kind=BisectKind.NOT_REPRODUCED, bad_samples=[],
                          samples=[], unresolved=[], replays=0, message="", notes=notes, slicing=slicing)
    if not n:
        report.message = "the saved inputs have no batch dimension: nothing to slice"
        return report
    budget = max(1, int(max_replays))
    estimate = 2 * n  # at most 2n-1 replays when every sample fails

    def fails(indices, **changes) -> Trial:
        report.replays += 1
        report_progress(progress, "bisecting the batch", min(report.replays, estimate), estimate)
        return p.trial(backoff=False, batch=list(indices), fp32_modules=tuple(fp32_modules), **changes)

    whole = fails(range(n)) if n > 1 else None
    if whole is not None and whole.saved:
        report.message = (f"the whole batch replays saved in {p.precision} (finite, gradients within the "
                          "thresholds of float64, no module broken): nothing to bisect "
                          "(see `replay` for whether the step reproduces)")
        return report
    alone: dict[int, Trial] = {}
    passed: set[int] = set()   # samples of a slice that passed: partners for a pair
    small: list[list] = []     # failing groups that two valid slices cannot halve

    def search(indices: list) -> None:
        if slicing.min_slice > 1 and len(indices) < 2 * slicing.min_slice:
            small.append(list(indices))
            return
        if len(indices) == 1:
            alone[indices[0]] = fails(indices) if indices[0] not in alone else alone[indices[0]]
            slicing.judged[indices[0]] = SliceMethod.ALONE
            return
        if report.replays + 2 > budget:
            report.unresolved.append(list(indices))
            return
        mid = len(indices) // 2
        halves = [indices[:mid], indices[mid:]]
        results = []
        for h in halves:
            r = fails(h)
            if len(h) == 1:
                alone[h[0]] = r
                slicing.judged[h[0]] = SliceMethod.ALONE
            if r.saved:
                passed.update(h)
            results.append(r)
        if all(r.saved for r in results):
            report.unresolved.append(list(indices))
            return
        for h, r in zip(halves, results):
            if not r.saved and len(h) > 1:
                search(h)

    search(list(range(n)))
    partner = min(passed) if passed else None
    for group in small:
        if partner is None and not slicing.running_statistics_available:
            report.unresolved.append(group)
            slicing.unsplit.append(group)
            continue
        if report.replays + len(group) > budget:
            report.unresolved.append(group)
            continue
        for i in group:
            if partner is not None:
                slicing.partner = partner
                slicing.judged[i] = SliceMethod.PAIRED
            else:
                slicing.judged[i] = SliceMethod.RUNNING_STATISTICS
            one = slicing.slice_of(i)
            alone[i] = fails(one.pop("batch"), **one)
    bad = sorted(i for i, r in alone.items() if not r.saved)
    report.bad_samples = bad
    stats = input_stats(p.bundle.inputs, n)
    if bad:
        unsplit = {i for g in report.unresolved for i in g}
        passing = [i for i in range(n) if i not in alone or alone[i].saved]
        passing = [i for i in passing if i not in unsplit]
        # The failing samples together first (one replay when float64 computes them all); a model
        # normalising over the batch takes them so only when they are enough for a slice.
        together = (_all_finite(p.session.run(RunConfig("fp64", device=p.config.device, batch=bad), capture=False))
                    if len(bad) >= slicing.min_slice else False)
        fp64_per = {i: True for i in bad} if together else {i: _sample_finite(p, slicing.slice_of(i)) for i in bad}
        for i in bad:
            absmax, nonfinite, passing_max = _sample_inputs(stats, i, passing)
            report.samples.append(BadSample(i, alone[i], absmax, passing_max, nonfinite, fp64_per[i],
                                            _suspicious(stats, i, passing), slicing.judged.get(i, SliceMethod.ALONE)))
    report.kind, report.message = _verdict(bad, report.unresolved, n, report.samples, bool(stats), slicing)
    note = slicing_note(slicing)
    if note:
        notes.append(note)
    return report


def _verdict(bad, unresolved, n, samples, floating: bool, slicing: SampleSlicing) -> tuple[BisectKind, str]:
    fp64_bad = [s.index for s in samples if not s.fp64_finite]
    fp64 = (f"; samples {_list(fp64_bad)} fail in float64 too (no precision setting is the fix)" if fp64_bad
            else "; float64 computes them fine")
    more = f"; {sum(len(u) for u in unresolved)} samples left unsplit" if unresolved else ""
    how = judged_words(slicing)
    if len(bad) == n:
        return BisectKind.MODEL, (f"every one of the {n} samples fails {how}: a model (or precision) problem, "
                         f"not a data problem (see `fix`){fp64}")
    if bad:
        odd = [s for s in samples if s.suspicious]
        head = f"{len(bad)} of {n} samples fail {how}: {_list(bad)}"
        if odd:
            what = "; ".join(f"sample {s.index}: {s.suspicious}" for s in odd[:5])
            ordinary = [s.index for s in samples if not s.suspicious]
            rest = (f"; samples {_list(ordinary)} fail with ordinary inputs (a model problem they trigger)"
                    if ordinary else "")
            return BisectKind.DATA, f"{head}; their inputs are suspicious ({what}): a data problem{rest}{fp64}{more}"
        looks = ("their floating inputs are finite and within the range of the passing samples" if floating
                 else "their inputs are integers (e.g. token ids: never NaN/Inf, no range to compare)")
        return BisectKind.MODEL, (f"{head}; {looks}: a model (or precision) problem that these samples trigger, "
                         f"not a data problem (see `fix`){fp64}{more}")
    groups = "; ".join(_list(u) for u in unresolved)
    if unresolved and unresolved == slicing.unsplit:
        return BisectKind.BATCH, (f"the failing samples could not be isolated: the batch-normalising modules need "
                         f"slices of at least {slicing.min_slice} samples and nothing could be paired or run "
                         f"on running statistics (see the note); failing groups: {groups}")
    if [len(u) for u in unresolved] == [n]:
        return BisectKind.BATCH, ("no half of the batch fails alone although the whole batch does: the samples fail "
                         "only together (batch statistics or a reduction over the batch)")
    return BisectKind.BATCH, f"the failing samples could not be isolated; failing groups: {groups}"


# ------------------------------------------------------- slicing in words
def judged_words(slicing: SampleSlicing) -> str:
    """How the samples were judged, as the verdict says it ("fail ...")."""
    methods = slicing.methods()
    if methods in ([], [SliceMethod.ALONE]):
        return "alone"
    if methods == [SliceMethod.PAIRED]:
        return f"paired with sample {slicing.partner} (which passes)"
    if methods == [SliceMethod.RUNNING_STATISTICS]:
        return "alone with batch normalisation on running statistics"
    return "alone, paired or on running statistics (see the note)"


def slicing_note(slicing: SampleSlicing) -> str | None:
    """The note that says how a batch-normalising model was sliced (None
    for a model without one): the one place these words are made."""
    if not slicing.batch_statistics_modules:
        return None
    names = list(slicing.batch_statistics_modules)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    parts = [f"{shown} normalise over the batch (BatchNorm in training): a one-sample slice would be invalid, "
             f"so every slice keeps at least {slicing.min_slice} samples, whose batch statistics are not the "
             "whole batch's"]
    paired = sorted(i for i, m in slicing.judged.items() if m is SliceMethod.PAIRED)
    running = sorted(i for i, m in slicing.judged.items() if m is SliceMethod.RUNNING_STATISTICS)
    if paired:
        parts.append(f"samples {_list(paired)} were each judged paired with sample {slicing.partner}, which "
                     "passes in a slice without them")
    if running:
        parts.append(f"samples {_list(running)} were judged alone with those modules on their running "
                     "statistics (as in eval mode; no sample passed to pair them with), not on the batch "
                     "statistics training used")
    if slicing.unsplit:
        parts.append(f"groups {'; '.join(_list(g) for g in slicing.unsplit)} were left whole: no sample "
                     "passed to pair them with and not every one of those modules keeps running statistics")
    return "; ".join(parts)


def _list(indices) -> str:
    indices = list(indices)
    shown = ", ".join(str(i) for i in indices[:20])
    return shown + (f" and {len(indices) - 20} more" if len(indices) > 20 else "")


def _sample_finite(p, changes: dict) -> bool:
    """Whether float64 computes one sample's slice (`SampleSlicing.slice_of`) finite."""
    from ..replaying import RunConfig
    return _all_finite(p.session.run(RunConfig("fp64", device=p.config.device, **changes), capture=False))


def _all_finite(run) -> bool:
    import torch
    return run.error is None and all(bool(torch.isfinite(t).all()) for mb in run.outputs for t in mb) \
        and not run.nonfinite_param_grads


def _batch_size(inputs):
    from recorders.format.tensors import iter_tensors
    for t in iter_tensors(inputs):
        if t.dim() > 0:
            return int(t.shape[0])
    return None


def input_stats(inputs, n) -> list:
    """Per floating input tensor with a batch dimension n (in every
    micro-batch): each sample's largest finite magnitude and NaN/Inf count,
    as float64 tensors of length n. Integer inputs are left out: token ids
    can be neither NaN/Inf nor meaningfully large."""
    import torch

    from recorders.format.tensors import iter_tensors
    out = []
    for args in inputs:
        for t in iter_tensors(args):
            if t.is_floating_point() and t.dim() > 0 and t.shape[0] == n:
                rows = t.detach().double().reshape(n, -1)
                fin = torch.isfinite(rows)
                absmax = rows.abs().masked_fill(~fin, 0).max(dim=1).values if rows.shape[1] else torch.zeros(n)
                out.append((absmax, (~fin).sum(dim=1)))
    return out


def _sample_inputs(stats, i, passing) -> tuple:
    """(largest magnitude, NaN/Inf count, largest magnitude over the passing
    samples) of sample i's floating inputs; None without floating inputs."""
    if not stats:
        return None, None, None
    absmax = max(float(a[i]) for a, _ in stats)
    nonfinite = sum(int(b[i]) for _, b in stats)
    passing_max = max((float(a[passing].max()) for a, _ in stats), default=None) if passing else None
    return absmax, nonfinite, passing_max


def _suspicious(stats, i, passing) -> str | None:
    """Why sample i's inputs are suspicious in themselves, or None."""
    for j, (absmax, bad) in enumerate(stats):
        if int(bad[i]):
            return f"{int(bad[i])} NaN/Inf in floating input {j}"
        if passing:
            ceiling = float(absmax[passing].max())
            if ceiling > 0 and float(absmax[i]) > FAR_OUTSIDE * ceiling:
                return (f"floating input {j} reaches {float(absmax[i]):.3g}, more than {FAR_OUTSIDE:g}x the "
                        f"passing samples' {ceiling:.3g}")
    return None
