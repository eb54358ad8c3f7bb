"""Which saved replay bundle to replay when the user names no step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI's help text reads this module: keep it light
    from ..reading.loader import Run

# Lower first: the step that went non-finite says most; a step the user asked
# for (`rec.save_bundle()`, `bundle_steps`) comes next because the user knew
# something the triggers did not (e.g. a silent float16 norm overflow); a
# skipped step after settling is often one ordinary backoff, and so is the
# Keras and Flax recorders' `nonfinite_gradient` (a NaN/Inf born in the
# backward, the forward and the loss finite: what the loss scale skips).
BUNDLE_PRIORITY = {"nonfinite_loss": 0, "nonfinite_tensor": 0, "request": 1, "step_list": 1,
                   "scale_low": 2, "skipped": 3, "nonfinite_gradient": 3}


def priority_description() -> str:
    """`BUNDLE_PRIORITY` in words, as the recommend help, README and docs
    say it (tests/test_api.py checks that they do)."""
    levels = sorted(set(BUNDLE_PRIORITY.values()))
    groups = [" or ".join(r for r, p in BUNDLE_PRIORITY.items() if p == level) for level in levels]
    return "the earliest bundle saved for " + ", else ".join(groups)


@dataclass(frozen=True)
class SavedBundle:
    """A replay bundle the run saved: its step, rank and why it was saved."""
    step: int
    rank: int
    reasons: tuple

    @property
    def priority(self) -> int:
        """Its place in `BUNDLE_PRIORITY` (lower: says more)."""
        return min((BUNDLE_PRIORITY.get(x, len(BUNDLE_PRIORITY)) for x in self.reasons),
                   default=len(BUNDLE_PRIORITY))

    @property
    def failure(self) -> bool:
        """Saved at a step that went non-finite (a loss or a tensor)."""
        return self.priority == 0

    def to_dict(self) -> dict:
        return {"step": self.step, "rank": self.rank, "reasons": list(self.reasons)}


@dataclass(frozen=True)
class BundleChoice:
    """The bundle a command replays when the user names no step."""
    bundle: SavedBundle

    def to_dict(self) -> dict:
        return {**self.bundle.to_dict(), "failure": self.bundle.failure}

    def sentence(self) -> str:
        """The choice in words (the one place they are made)."""
        b = self.bundle
        why = ", ".join(b.reasons) or "no recorded reason"
        head = f"no --step given: replaying the bundle of step {b.step} (rank {b.rank}, saved for {why})"
        return head + (": the first failure's" if b.failure else
                       ": no bundle of a non-finite step was saved, so " + priority_description())


def saved_bundles(run: Run, rank: int | None = None) -> list[SavedBundle]:
    """Every bundle of the run (of `rank`), by step then rank, with the
    reasons it was saved: from the run and rank manifests (key "bundles"),
    else from the bundle's own bundle.json. BundleError for a bundles
    folder holding a name that is not canonical (`bundle.list_bundles`)."""
    from ..reading.bundle_dirs import list_bundles
    listed = {}
    for m in [run.manifest, *run.rank_manifests.values()]:
        for b in m.get("bundles") or []:
            if isinstance(b, dict) and "step" in b:
                why = b.get("reasons") or ([b["reason"]] if b.get("reason") else [])
                listed[(int(b["step"]), int(b.get("rank", 0)))] = list(why)
    return [SavedBundle(s, r, tuple(listed.get((s, r)) or _bundle_reasons(path)))
            for s, r, path in list_bundles(run.path) if rank is None or r == rank]


def pick_bundle(run: Run, rank: int | None = None) -> tuple[int, int, list] | None:
    """(step, rank, reasons) of the bundle `recommend --model` and `replay`
    without --step replay by default: the one saved for the most telling
    reason (`BUNDLE_PRIORITY`: a non-finite loss or tensor first, then the
    steps the user asked for, then a scale fallen below its floor, then a
    skipped step), the earliest among equals."""
    choice = choose_bundle(run, rank)
    if choice is None:
        return None
    b = choice.bundle
    return b.step, b.rank, list(b.reasons)


def choose_bundle(run: Run, rank: int | None = None) -> BundleChoice | None:
    """`pick_bundle`'s choice, typed; None when the run saved no bundle."""
    found = saved_bundles(run, rank)
    if not found:
        return None
    return BundleChoice(min(found, key=lambda b: (b.priority, b.step, b.rank)))


def _bundle_reasons(path) -> list:
    from ..errors import BundleError
    from ..reading.files.safe import read_json
    try:  # read safely: a FIFO named bundle.json must not hang the choice
        meta = read_json(path / "bundle.json", path, BundleError, "bundle.json")
    except BundleError:
        return []
    if not isinstance(meta, dict):
        return []
    return list(meta.get("reasons") or ([meta["reason"]] if meta.get("reason") else []))
