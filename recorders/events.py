"""In-job events: the first sign that a job started to die, as typed values.

`AmpRecorder(..., on_event=callback)` calls `callback(event)` (off the
training thread, `recorders.event_thread`) at the onset of each of these
conditions, decided by `EventDetector`, a pure function of the step
summaries the writer thread reads (`step_rows.StepRows.rows`), in step
order, testable alone:

- the first non-finite value of the run, as one of three kinds, the most
  upstream one of its step: `NONFINITE_FORWARD` (a NaN/Inf in an input,
  activation or weight of the forward pass; `layer`: the first such row in
  execution order), else `NONFINITE_LOSS` (the loss only), else
  `NONFINITE_GRADIENT` (a gradient of a step that was not skipped: a loss
  scaler's skipped step made its overflowing gradients on purpose, which a
  skip streak reports);
- `SKIP_STREAK`: `skip_streak` consecutive skipped steps. The skips before
  the first step that ran the optimizer are a fresh GradScaler calibrating
  down from its initial scale and do not count;
- `SCALE_COLLAPSE`: the loss scale after `update()` is below `scale_floor`,
  or at most the largest scale of the last `collapse_window` steps divided
  by `2**collapse_bits` (steps from the first that ran the optimizer on,
  for the same reason: calibration halves the scale on purpose).

Each of the three (the non-finite kinds together) fires once per recorder,
at its onset: a diverging job has an event in nearly every step, and the
callback is for the first sign; the run holds the rest.
"""
from __future__ import annotations

import collections
import enum
import math
import threading
from dataclasses import dataclass, field

import numpy as np

from .errors import OptionError, option_float, option_int


class EventKind(str, enum.Enum):
    NONFINITE_FORWARD = "nonfinite_forward"
    NONFINITE_LOSS = "nonfinite_loss"
    NONFINITE_GRADIENT = "nonfinite_gradient"
    SKIP_STREAK = "skip_streak"
    SCALE_COLLAPSE = "scale_collapse"


NONFINITE_KINDS = (EventKind.NONFINITE_FORWARD, EventKind.NONFINITE_LOSS, EventKind.NONFINITE_GRADIENT)


class EventRequests:
    """What callbacks asked the training loop to do: flags set from the
    event thread, taken by the training thread at its next `rec.step()`
    (`take`). A lock, because two threads write them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stop = self._checkpoint = self._bundle = False
        self.pending = False  # read without the lock on every rec.step(): a late read waits a step

    def ask(self, *, stop: bool = False, checkpoint: bool = False, bundle: bool = False) -> None:
        with self._lock:
            self._stop |= stop
            self._checkpoint |= checkpoint
            self._bundle |= bundle
            self.pending = True

    def take(self) -> tuple[bool, bool, bool]:
        """(stop, checkpoint, bundle) asked since the last take, cleared."""
        with self._lock:
            taken = (self._stop, self._checkpoint, self._bundle)
            self._stop = self._checkpoint = self._bundle = False
            self.pending = False
        return taken


@dataclass(frozen=True)
class Event:
    """One event. `kind`: an `EventKind`; `step`: the step it was seen at;
    `layer`: the module (or `<input>`) of the first non-finite tensor in
    execution order, None where no tensor says (a loss, a skip streak, a
    scale); `evidence`: the values that decided it (JSON values).

    The callback may ask, through the event, for what the training thread
    does at its next `rec.step()`: `request_stop()` (`rec.should_stop`
    becomes True), `request_checkpoint()` (`rec.checkpoint_requested`
    becomes True) and `request_bundle()` (a replay bundle of the next step,
    as `rec.save_bundle()`). An event made outside a recorder (a detector
    alone) requests nothing."""

    kind: EventKind
    step: int
    layer: str | None = None
    evidence: dict = field(default_factory=dict, compare=False, hash=False)
    requests: EventRequests | None = field(default=None, compare=False, hash=False, repr=False)

    def request_stop(self) -> None:
        if self.requests is not None:
            self.requests.ask(stop=True)

    def request_checkpoint(self) -> None:
        if self.requests is not None:
            self.requests.ask(checkpoint=True)

    def request_bundle(self) -> None:
        if self.requests is not None:
            self.requests.ask(bundle=True)

    def to_json(self) -> dict:
        """As the manifest's `events.raised` lists it."""
        return {"kind": self.kind.value, "step": self.step, "layer": self.layer, "evidence": dict(self.evidence)}


@dataclass(frozen=True)
class EventPolicy:
    """Which events are raised and who hears them: `AmpRecorder(on_event=
    EventPolicy(callback, ...))`; `on_event=callback` is
    `EventPolicy(callback)`. Options (keywords; their one definition):

    callback: called with each `Event`, on a thread of its own; it may be
        slow and may raise (caught, reported once per event kind as a
        warning and in the manifest's `events.callback_errors`).
    skip_streak: consecutive skipped steps that make a `SKIP_STREAK` (3; at
        least 1).
    collapse_bits: a `SCALE_COLLAPSE` when the scale fell by a factor of
        `2**collapse_bits` (6: 64x) or more within `collapse_window` steps
        (100); a healthy GradScaler halves once per growth probe.
    scale_floor: a `SCALE_COLLAPSE` as well when the scale falls below
        this (1.0; None: off).
    max_pending: events waiting for a slow callback (16); beyond it they are
        dropped and counted (`events.dropped`), never waited for."""

    callback: object
    skip_streak: int = 3
    collapse_bits: int = 6
    collapse_window: int = 100
    scale_floor: float | None = 1.0
    max_pending: int = 16

    def __post_init__(self):
        if not callable(self.callback):
            raise OptionError(f"on_event={self.callback!r}: give a callable (it is called with each Event)")
        object.__setattr__(self, "skip_streak", max(1, option_int("skip_streak", self.skip_streak)))
        object.__setattr__(self, "collapse_bits", max(1, option_int("collapse_bits", self.collapse_bits)))
        object.__setattr__(self, "collapse_window", max(1, option_int("collapse_window", self.collapse_window)))
        if self.scale_floor is not None:
            object.__setattr__(self, "scale_floor", option_float("scale_floor", self.scale_floor))
        object.__setattr__(self, "max_pending", max(1, option_int("max_pending", self.max_pending)))

    def config(self) -> dict:
        """The options as the manifest records them (the callback by name)."""
        name = getattr(self.callback, "__qualname__", None) or type(self.callback).__qualname__
        return {"callback": name, "skip_streak": self.skip_streak, "collapse_bits": self.collapse_bits,
                "collapse_window": self.collapse_window, "scale_floor": self.scale_floor,
                "max_pending": self.max_pending}


def event_policy(on_event) -> EventPolicy | None:
    """`AmpRecorder(on_event=)` as a policy: None, a callable or an EventPolicy."""
    if on_event is None or isinstance(on_event, EventPolicy):
        return on_event
    return EventPolicy(on_event)


class EventDetector:
    """The events of a run's step summaries, fed in step order (`observe`).
    Summaries are `StepRows.rows`' third value: `step`, `skipped`, `loss`,
    `loss_scale` (after `update()`, None without a scaler), `columns` (the
    step's tensor rows as arrays, or None)."""

    def __init__(self, *, skip_streak: int = 3, collapse_bits: int = 6, collapse_window: int = 100,
                 scale_floor: float | None = 1.0):
        self.skip_streak = skip_streak
        self.collapse_factor = 2.0 ** collapse_bits
        self.scale_floor = scale_floor
        self.fired: set[str] = set()  # "nonfinite", SKIP_STREAK, SCALE_COLLAPSE
        self._stepped = False  # a step ran the optimizer: calibration is over
        self._streak = 0
        self._scales = collections.deque(maxlen=collapse_window)  # (step, scale) since calibration

    @classmethod
    def of(cls, policy: EventPolicy) -> "EventDetector":
        return cls(skip_streak=policy.skip_streak, collapse_bits=policy.collapse_bits,
                   collapse_window=policy.collapse_window, scale_floor=policy.scale_floor)

    def observe(self, summary: dict) -> list[Event]:
        events = []
        if "nonfinite" not in self.fired:
            event = nonfinite_event(summary)
            if event is not None:
                self.fired.add("nonfinite")
                events.append(event)
        for event in (self._skip_streak(summary), self._scale_collapse(summary)):
            if event is not None and event.kind not in self.fired:
                self.fired.add(event.kind)
                events.append(event)
        return events

    def _skip_streak(self, summary: dict) -> Event | None:
        if not summary["skipped"]:
            self._stepped = True
            self._streak = 0
            return None
        if not self._stepped:
            return None  # calibration
        self._streak += 1
        if self._streak < self.skip_streak:
            return None
        return Event(EventKind.SKIP_STREAK, summary["step"], None,
                     {"skipped_steps": self._streak, "first_skipped_step": summary["step"] - self._streak + 1,
                      "loss_scale": summary.get("loss_scale")})

    def _scale_collapse(self, summary: dict) -> Event | None:
        scale = summary.get("loss_scale")
        if scale is None or math.isnan(scale):
            return None
        step = summary["step"]
        if self.scale_floor is not None and scale < self.scale_floor:
            return Event(EventKind.SCALE_COLLAPSE, step, None,
                         {"loss_scale": scale, "scale_floor": self.scale_floor})
        # _skip_streak ran first: `_stepped` includes this step
        if not self._stepped:
            return None
        self._scales.append((step, scale))
        peak_step, peak = max(self._scales, key=lambda s: s[1])
        if scale * self.collapse_factor > peak:
            return None
        return Event(EventKind.SCALE_COLLAPSE, step, None,
                     {"loss_scale": scale, "peak_scale": peak, "peak_step": peak_step,
                      "fell_bits": math.log2(peak / scale) if scale > 0 else math.inf})


def nonfinite_event(summary: dict) -> Event | None:
    """The non-finite event of one step's summary, or None (see the module's
    docstring for which kind a step with several is)."""
    cols = summary.get("columns")
    loss = summary.get("loss")
    loss_bad = loss is not None and not math.isfinite(loss)
    base = {"loss": loss, "skipped": bool(summary["skipped"])}
    if cols is not None and len(cols["name"]) and summary.get("nonfinite_rows", 1):
        bad = (np.asarray(cols["nan_count"]) > 0) | (np.asarray(cols["inf_count"]) > 0)
        kinds = np.asarray(cols["kind"], dtype=object)
        forward = np.asarray(cols["phase"], dtype=object) == "forward"
        base["nonfinite_rows"] = int(bad.sum())
        first = _first(cols, bad & forward & (kinds != "loss"))
        if first is not None:
            return Event(EventKind.NONFINITE_FORWARD, summary["step"], _layer(cols, first),
                         {**base, **_row_evidence(cols, first)})
        if not loss_bad and not summary["skipped"]:
            first = _first(cols, bad & ~forward)
            if first is not None:
                return Event(EventKind.NONFINITE_GRADIENT, summary["step"], _layer(cols, first),
                             {**base, **_row_evidence(cols, first)})
        loss_bad = loss_bad or bool((bad & (kinds == "loss")).any())
    if loss_bad:
        return Event(EventKind.NONFINITE_LOSS, summary["step"], None, base)
    return None


def _first(cols, mask) -> int | None:
    """The row of `mask` first in execution order (the `order` column)."""
    rows = np.flatnonzero(mask)
    if not len(rows):
        return None
    return int(rows[np.argmin(np.asarray(cols["order"])[rows])])


def _layer(cols, i: int) -> str:
    """A module's name; a parameter's (a weight, its gradient) is its module's."""
    name = str(cols["name"][i])
    if cols["kind"][i] in ("param", "param_grad"):
        return name.rpartition(".")[0]
    return name


def _row_evidence(cols, i: int) -> dict:
    return {"tensor": str(cols["name"][i]), "tensor_kind": str(cols["kind"][i]),
            "nan_count": int(cols["nan_count"][i]), "inf_count": int(cols["inf_count"][i])}
