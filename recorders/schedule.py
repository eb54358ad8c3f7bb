"""The record schedule: which step is recorded at which tier.

Like `torch.profiler.schedule`, a step -> tier decision that can be tested
alone. A step is recorded at the `full` tier every `full_every` steps, for a
burst of `full_after_event` steps after the *first* event of each kind (a
skipped step, a non-finite value in the forward pass, in the gradients, in
the loss), and when asked for (`request`: a bundle, `rec.request_full()`);
otherwise at the `cheap` tier every `cheap_every` steps; otherwise not at
all (`None`).

Why only the first event of a kind: a diverging job has an event in nearly
every step, and when each event extended the burst, the full tier (1.5x to
2x a step) ran for the rest of the job. The first burst shows how the
failure starts; after it the job is back at `full_every`, with the cheap
tier's exact NaN/Inf counts on every step.

The training thread asks `tier(step)`; the writer thread, which sees the
values one step late, reports events with `note_event(step, kinds)`. The
state shared between the two is one tuple (`full_window`), replaced whole
by one thread and read by the other without a lock (a late read only
shifts the burst by a step), and the set of requested steps.
"""
from __future__ import annotations

from .errors import option_int

CHEAP = "cheap"
FULL = "full"

# The options of `RecordSchedule.every_step()` (`AmpRecorder(mode="every_step")`).
EVERY_STEP = {"cheap_every": 1, "full_every": 100, "full_after_event": 20}
# The sentinel's periods. A sampled step registers every watched module's
# hooks and writes their rows: 3.1x the launch-bound proxy's step at the
# cheap tier and 10x at the full tier, 4.6x and 6.6x the diverging job's
# (benchmarks/sentinel_cost.py, AMD EPYC, benchmarks/RESULTS.md). At every
# 250th and 2500th step that was 1.1 points of the launch-bound job and 1.5
# of the diverging one: with the design's own floor at 1.035-1.04 there, the
# 1.05 target had no room left for any bookkeeping. Every 1000th and 10000th
# step costs a quarter of that; a week-long job still gets hundreds of
# sampled steps (a 2 steps/s job: one every 8 minutes), every statement on
# them says how old it is, and the failing step is seen in full anyway
# (re-executed).
CHEAP_EVERY, FULL_EVERY = 1000, 10000
MODES = ("sentinel", "every_step")

# What `note_event` may be told (a step can be several at once).
EVENT_KINDS = ("skipped", "nonfinite_forward", "nonfinite_gradient", "nonfinite_loss")


class RecordSchedule:
    """Which step is recorded at which tier: `AmpRecorder(schedule=...)`.

    >>> RecordSchedule(full_every=1)           # every step at the full tier
    >>> RecordSchedule(cheap_every=10, full_every=0, full_after_event=50)

    Options (keywords; their one definition):
        cheap_every: record the cheap statistics every N steps (at least 1;
            0 counts as 1).
        full_every: record the full statistics every N steps (0: never by
            period).
        full_after_event: record the full statistics for a burst of N steps
            after the first event of each kind (a skipped step, a NaN/Inf in
            the forward pass, in the gradients of a step that was not
            skipped, in the loss); later events of a kind seen before leave
            the schedule at `full_every` (0: never after events). Steps in
            `BundlePolicy.steps`, a step whose bundle `save_bundle()` asks
            for before its forward, and `request_full()` are full in any
            case.

    A schedule holds the state of one run (its burst, its requests): give
    each recorder its own. A subclass may override `tier` (a pure
    `step -> tier` decision, like `torch.profiler.schedule`)."""

    def __init__(self, *, cheap_every: int = CHEAP_EVERY, full_every: int = FULL_EVERY, full_after_event: int = 0):
        self.cheap_every = max(1, option_int("cheap_every", cheap_every))
        self.full_every = option_int("full_every", full_every)
        self.full_after_event = option_int("full_after_event", full_after_event)
        # (first, last) step of the full-tier burst after the latest new kind
        self.full_window = (0, -1)
        self.kinds_seen: set[str] = set()  # writer thread only
        self._requested: set[int] = set()

    @classmethod
    def every_step(cls, **options) -> "RecordSchedule":
        """Every step recorded (the cheap tier's rows of every module), the
        full tier every 100 steps and in a burst of 20 after the first event
        of each kind (`options` override any of the three): the recorder's
        default before the sentinel (`AmpRecorder(mode="every_step")`).
        Every module's hooks then run on every step (3x a launch-bound
        step: see the README's cost table)."""
        return cls(**{**EVERY_STEP, **options})

    def tier(self, step: int) -> str | None:
        """'full', 'cheap' or None (the step is not recorded)."""
        first, last = self.full_window
        if (self.full_every > 0 and step % self.full_every == 0) or first <= step <= last:
            return FULL
        if step % self.cheap_every:
            return None  # a request raises a recorded step's tier; it records no other step
        return FULL if step in self._requested else CHEAP

    def request(self, step: int, current: int | None = None) -> None:
        """Record `step` at the full tier when it is recorded at all (every
        `cheap_every` steps), whatever the period and the bursts.
        `current`: the step in progress; requests before it are forgotten
        (they are never asked about again)."""
        kept = self._requested if current is None else {s for s in self._requested if s >= current}
        self._requested = kept | {int(step)}

    def note_event(self, step: int, kinds=("event",)) -> None:
        """Events were seen at `step` (writer thread). A kind not seen
        before opens (or extends) a burst over the `full_after_event` steps
        after `step`; a kind already seen changes nothing."""
        new = set(kinds or ("event",)) - self.kinds_seen
        if not new or self.full_after_event <= 0:
            return
        self.kinds_seen |= new
        first, last = self.full_window
        if step + 1 > last + 1:  # apart from the current burst: a new one
            first = step + 1
        self.full_window = (first, max(last, step + self.full_after_event))

    def config(self) -> dict:
        """The options as the manifest records them."""
        return {"cheap_every": self.cheap_every, "full_every": self.full_every,
                "full_after_event": self.full_after_event}
