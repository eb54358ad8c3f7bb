"""The record schedule: which step is recorded at which tier.

Like `torch.profiler.schedule`, a step -> tier decision that can be tested
alone. A step is recorded at the `full` tier every `full_every` steps and
for `full_after_event` steps after an event (a skipped step, a non-finite
value); otherwise at the `cheap` tier every `cheap_every` steps; otherwise
not at all (`None`).

The training thread asks `tier(step)`; the writer thread, which sees the
values one step late, reports events with `note_event(step, kinds)`. The
only state shared between the two is one tuple (`full_window`), replaced
whole by one thread and read by the other without a lock: a late read only
shifts the window by a step.
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
        # (first, last) step of the full-tier window after the latest events
        self.full_window = (0, -1)

    def tier(self, step: int) -> str | None:
        """'full', 'cheap' or None (the step is not recorded)."""
        first, last = self.full_window
        if (self.full_every > 0 and step % self.full_every == 0) or first <= step <= last:
            return FULL
        return CHEAP if step % self.cheap_every == 0 else None

    def note_event(self, step: int, kinds=()) -> None:
        """An event was seen at `step` (writer thread): the `full_after_event`
        steps after it are recorded at the full tier. `kinds` names the event
        (see EVENT_KINDS); the window does not depend on the kind yet."""
        if self.full_after_event <= 0:
            return
        first, last = self.full_window
        if step + 1 > last + 1:  # apart from the current window: a new one
            first = step + 1
        self.full_window = (first, max(last, step + self.full_after_event))

    def config(self) -> dict:
        """The options as the manifest records them."""
        return {"cheap_every": self.cheap_every, "full_every": self.full_every,
                "full_after_event": self.full_after_event}
