"""Which samples of the saved batch make the step non-finite (the playbook's
"reproduce on a small batch").

`bisect_samples(source, step, model=...)` replays the step in its recorded
precision on slices of the batch (indices along dimension 0 of every input
and output gradient, `RunConfig.batch`) and bisects: a failing slice is cut
in two and each half replayed, down to single samples. A slice fails when
its replay holds a NaN/Inf in the forward outputs or the gradients.

Verdict (`kind`):
- `not_reproduced`: the whole batch replays finite; nothing to bisect;
- `model`: every sample fails alone: the model (or its precision) is the
  problem, not the data;
- `data`: some samples fail alone (their indices are reported with their
  inputs' largest magnitude and NaN/Inf count, and whether float64 fails on
  them too: then the data itself is broken, not merely outside float16);
- `batch`: no half fails alone although the batch does: the samples only
  fail together (batch statistics, a reduction over the batch).

With several micro-batches the same indices are taken from each of them.
The replay budget (`max_replays`) bounds the search; groups left unsplit are
listed as `unresolved`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from . import plain, prepare, report_progress

MAX_REPLAYS = 256
SAMPLE_COLUMNS = ["index", "forward_finite", "backward_finite", "input_absmax", "input_nonfinite", "fp64_finite"]


@dataclass
class BisectReport:
    step: int
    rank: int
    precision: str
    batch_size: int | None
    micro_batches: int
    kind: str                      # not_reproduced | model | data | batch
    bad_samples: list
    samples: list                  # per bad sample: SAMPLE_COLUMNS
    unresolved: list               # index groups that failed but were not split (budget)
    replays: int
    message: str
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return plain({"step": self.step, "rank": self.rank, "precision": self.precision,
                      "batch_size": self.batch_size, "micro_batches": self.micro_batches, "kind": self.kind,
                      "bad_samples": self.bad_samples, "bad_share": self.bad_share, "samples": self.samples,
                      "unresolved": self.unresolved, "replays": self.replays, "message": self.message,
                      "notes": self.notes})

    @property
    def bad_share(self) -> float | None:
        return len(self.bad_samples) / self.batch_size if self.batch_size else None

    def table(self) -> pd.DataFrame:
        return pd.DataFrame(self.samples if self.kind == "data" else [], columns=SAMPLE_COLUMNS)

    def lines(self) -> list[str]:
        out = [f"step {self.step}, rank {self.rank}: {self.precision} replay of a batch of {self.batch_size}"
               + (f" ({self.micro_batches} micro-batches, same indices in each)" if self.micro_batches > 1 else ""),
               f"{self.kind}: {self.message}", f"{self.replays} replays"]
        out += [f"note: {n}" for n in self.notes]
        return out


def bisect_samples(source, step=None, *, rank=None, model=None, device: str = "cpu", policy: str = "recorded",
                   precision: str | None = None, loss_fn=None, fp32_modules=(), max_replays: int = MAX_REPLAYS,
                   progress=None, prepared=None) -> BisectReport:
    """Bisect the saved batch to the samples whose replay is non-finite."""
    import torch

    from ..replay import RunConfig

    p = prepared or prepare(source, step, rank=rank, model=model, device=device, policy=policy,
                            precision=precision, loss_fn=loss_fn)
    notes = list(p.notes)
    n = _batch_size(p.bundle.inputs[0] if p.bundle.inputs else None)
    report = BisectReport(step=p.step, rank=p.rank, precision=p.precision, batch_size=n,
                          micro_batches=len(p.bundle.inputs), kind="not_reproduced", bad_samples=[], samples=[],
                          unresolved=[], replays=0, message="", notes=notes)
    if not n:
        report.message = "the saved inputs have no batch dimension: nothing to slice"
        return report
    budget = max(1, int(max_replays))
    estimate = 2 * n  # at most 2n-1 replays when every sample fails

    def fails(indices) -> dict:
        report.replays += 1
        report_progress(progress, "bisecting the batch", min(report.replays, estimate), estimate)
        run = p.run(batch=list(indices), fp32_modules=tuple(fp32_modules))
        fwd = run.error is None and all(bool(torch.isfinite(t).all()) for mb in run.outputs for t in mb)
        bwd = run.error is None and not run.nonfinite_param_grads
        return {"forward_finite": fwd, "backward_finite": bwd, "fails": not (fwd and bwd)}

    whole = fails(range(n)) if n > 1 else None
    if whole is not None and not whole["fails"]:
        report.message = (f"the whole batch replays finite in {p.precision}: nothing to bisect "
                          "(see `replay` for whether the step reproduces)")
        return report
    alone: dict[int, dict] = {}

    def search(indices: list) -> None:
        if len(indices) == 1:
            alone[indices[0]] = fails(indices) if indices[0] not in alone else alone[indices[0]]
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
            results.append(r)
        if not any(r["fails"] for r in results):
            report.unresolved.append(list(indices))
            return
        for h, r in zip(halves, results):
            if r["fails"] and len(h) > 1:
                search(h)

    search(list(range(n)))
    bad = sorted(i for i, r in alone.items() if r["fails"])
    report.bad_samples = bad
    if bad:
        ref = p.session.run(RunConfig("fp64", device=p.config.device, batch=bad), capture=False)
        fp64_per = {i: _sample_finite(p, i) for i in bad} if not _all_finite(ref) else {i: True for i in bad}
        for i in bad:
            absmax, nonfinite = _input_stats(p.bundle.inputs, i, n)
            report.samples.append({"index": i, "forward_finite": alone[i]["forward_finite"],
                                   "backward_finite": alone[i]["backward_finite"], "input_absmax": absmax,
                                   "input_nonfinite": nonfinite, "fp64_finite": fp64_per[i]})
    report.kind, report.message = _verdict(bad, report.unresolved, n, report.samples)
    return report


def _verdict(bad, unresolved, n, samples) -> tuple[str, str]:
    if len(bad) == n:
        return "model", (f"every one of the {n} samples fails alone: a model (or precision) problem, "
                         "not a data problem (see `fix`)")
    if bad:
        broken = [s["index"] for s in samples if s["input_nonfinite"] or not s["fp64_finite"]]
        what = (f"; samples {_list(broken)} fail in float64 too (broken data)" if broken else
                "; float64 computes them fine: their values leave the float16 range")
        more = f"; {sum(len(u) for u in unresolved)} samples left unsplit" if unresolved else ""
        return "data", (f"{len(bad)} of {n} samples fail alone: {_list(bad)} (a data problem){what}{more}")
    if [len(u) for u in unresolved] == [n]:
        return "batch", ("no half of the batch fails alone although the whole batch does: the samples fail "
                         "only together (batch statistics or a reduction over the batch)")
    groups = "; ".join(_list(u) for u in unresolved)
    return "batch", f"the failing samples could not be isolated; failing groups: {groups}"


def _list(indices) -> str:
    indices = list(indices)
    shown = ", ".join(str(i) for i in indices[:20])
    return shown + (f" and {len(indices) - 20} more" if len(indices) > 20 else "")


def _sample_finite(p, i) -> bool:
    from ..replay import RunConfig
    return _all_finite(p.session.run(RunConfig("fp64", device=p.config.device, batch=[i]), capture=False))


def _all_finite(run) -> bool:
    import torch
    return run.error is None and all(bool(torch.isfinite(t).all()) for mb in run.outputs for t in mb) \
        and not run.nonfinite_param_grads


def _batch_size(inputs):
    from recorders.stats import iter_tensors
    for t in iter_tensors(inputs):
        if t.dim() > 0:
            return int(t.shape[0])
    return None


def _input_stats(inputs, i, n) -> tuple:
    """Largest finite magnitude and NaN/Inf count of sample i's floating inputs."""
    import torch

    from recorders.stats import iter_tensors
    absmax, bad = 0.0, 0
    for args in inputs:
        for t in iter_tensors(args):
            if t.is_floating_point() and t.dim() > 0 and t.shape[0] == n:
                row = t[i].detach().double()
                fin = torch.isfinite(row)
                bad += int((~fin).sum())
                if bool(fin.any()):
                    absmax = max(absmax, float(row[fin].abs().max()))
    return (absmax if math.isfinite(absmax) else None), bad
