"""Which saved replay bundle to replay when the user names no step."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI's help text reads this module: keep it light
    from ..loader import Run

# Lower first: the step that went non-finite says most; a step the user asked
# for (`rec.save_bundle()`, `bundle_steps`) comes next because the user knew
# something the triggers did not (e.g. a silent float16 norm overflow); a
# skipped step after settling is often one ordinary backoff.
BUNDLE_PRIORITY = {"nonfinite_loss": 0, "nonfinite_tensor": 0, "request": 1, "step_list": 1,
                   "scale_low": 2, "skipped": 3}


def priority_description() -> str:
    """`BUNDLE_PRIORITY` in words, as the recommend help, README and docs
    say it (tests/test_api.py checks that they do)."""
    levels = sorted(set(BUNDLE_PRIORITY.values()))
    groups = [" or ".join(r for r, p in BUNDLE_PRIORITY.items() if p == level) for level in levels]
    return "the earliest bundle saved for " + ", else ".join(groups)


def pick_bundle(run: Run, rank: int | None = None) -> tuple[int, int, list] | None:
    """(step, rank, reasons) of the bundle `recommend --model` replays by
    default: the one saved for the most telling reason (`BUNDLE_PRIORITY`:
    a non-finite loss or tensor first, then the steps the user asked for,
    then a scale fallen below its floor, then a skipped step), the earliest
    among equals.
    Reasons come from the run and rank manifests (key "bundles"), else from
    the bundle's own bundle.json."""
    from ..bundle import list_bundles
    listed = {}
    for m in [run.manifest, *run.rank_manifests.values()]:
        for b in m.get("bundles") or []:
            if isinstance(b, dict) and "step" in b:
                why = b.get("reasons") or ([b["reason"]] if b.get("reason") else [])
                listed[(int(b["step"]), int(b.get("rank", 0)))] = list(why)
    found = []
    for s, r, path in list_bundles(run.path):
        if rank is not None and r != rank:
            continue
        reasons = listed.get((s, r)) or _bundle_reasons(path)
        best = min((BUNDLE_PRIORITY.get(x, len(BUNDLE_PRIORITY)) for x in reasons),
                   default=len(BUNDLE_PRIORITY))
        found.append((best, s, r, reasons))
    if not found:
        return None
    _, s, r, reasons = min(found, key=lambda t: t[:3])
    return s, r, reasons


def _bundle_reasons(path) -> list:
    from ..errors import BundleError
    from ..files.safe import read_json
    try:  # read safely: a FIFO named bundle.json must not hang the choice
        meta = read_json(path / "bundle.json", path, BundleError, "bundle.json")
    except BundleError:
        return []
    if not isinstance(meta, dict):
        return []
    return list(meta.get("reasons") or ([meta["reason"]] if meta.get("reason") else []))
