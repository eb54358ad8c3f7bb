"""The record schedule: which step is recorded at which tier.

Like `torch.profiler.schedule`, a step -> tier decision that can be tested
alone. A step is recorded at the `full` tier every `full_every` steps and
for `full_after_event` steps after an event (a skipped step, a non-finite
value); otherwise at the `cheap` tier every `cheap_every` steps; otherwise
not at all (`None`).

The training thread asks `tier(step)`; the writer thread, which sees the
values one step late, reports events with `note_event(step, kinds)`. The
only state shared between the two is one int (`full_until`), written by
one thread and read by the other without a lock: a late read only shifts
the full-tier window by a step.
"""
from __future__ import annotations

CHEAP = "cheap"
FULL = "full"

# What `note_event` may be told (a step can be several at once).
EVENT_KINDS = ("skipped", "nonfinite_tensor", "nonfinite_loss")


class RecordSchedule:
    """cheap_every: record the cheap statistics every N steps (min 1);
    full_every: the full statistics every N steps (0: never by period);
    full_after_event: the full statistics for N steps after an event."""

    def __init__(self, cheap_every: int = 1, full_every: int = 100, full_after_event: int = 20):
        self.cheap_every = max(1, int(cheap_every))
        self.full_every = int(full_every)
        self.full_after_event = int(full_after_event)
        self.full_until = -1  # last step of the full-tier window after an event

    def tier(self, step: int) -> str | None:
        """'full', 'cheap' or None (the step is not recorded)."""
        if (self.full_every > 0 and step % self.full_every == 0) or step <= self.full_until:
            return FULL
        return CHEAP if step % self.cheap_every == 0 else None

    def note_event(self, step: int, kinds=()) -> None:
        """An event was seen at `step` (writer thread). `kinds` names it
        (see EVENT_KINDS); the window after it does not depend on the kind
        yet."""
        if self.full_after_event > 0:
            self.full_until = max(self.full_until, step + self.full_after_event)

    def config(self) -> dict:
        """The options as the manifest records them."""
        return {"cheap_every": self.cheap_every, "full_every": self.full_every,
                "full_after_event": self.full_after_event}
