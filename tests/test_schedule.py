"""The record schedule alone: which step is recorded at which tier."""
from recorders.schedule import RecordSchedule


def tiers(schedule, steps):
    return "".join({"full": "F", "cheap": "c", None: "."}[schedule.tier(s)] for s in range(steps))


def test_cheap_and_full_tiers_follow_their_periods():
    assert tiers(RecordSchedule(cheap_every=1, full_every=4), 9) == "FcccFcccF"
    assert tiers(RecordSchedule(cheap_every=3, full_every=4), 9) == "F..cF.c.F"
    assert tiers(RecordSchedule(cheap_every=2, full_every=0), 6) == "c.c.c."
    assert tiers(RecordSchedule(cheap_every=0, full_every=100), 3) == "Fcc"  # cheap_every is at least 1


def test_the_first_event_of_a_kind_opens_a_burst_of_full_after_event_steps():
    s = RecordSchedule(cheap_every=2, full_every=0, full_after_event=3)
    s.note_event(3, ["skipped"])
    # Steps 4, 5, 6 after the event at 3 (step 3 itself was recorded before
    # the writer thread saw its values).
    assert tiers(s, 9) == "c.c.FFF.c"
    s.note_event(5, ["nonfinite_loss"])  # a new kind extends the burst
    assert tiers(s, 10) == "c.c.FFFFF."
    s.note_event(4, ["nonfinite_forward"])  # an earlier one never shortens it
    assert s.full_window == (4, 8)
    s.note_event(20, ["skipped"])  # a kind seen before: no new burst
    assert s.full_window == (4, 8)
    s.note_event(20, ["skipped", "nonfinite_gradient"])  # with a new kind: a new burst
    assert s.full_window == (21, 23) and tiers(s, 25)[19:] == ".cFFFc"
    assert s.kinds_seen == {"skipped", "nonfinite_loss", "nonfinite_forward", "nonfinite_gradient"}


def test_requested_steps_are_full_whatever_the_period_and_the_bursts():
    s = RecordSchedule(cheap_every=2, full_every=4, full_after_event=2)
    s.request(6)
    s.request(2)
    assert tiers(s, 9) == "F.F.F.F.F"
    s.request(10, current=5)  # forgets the requests before the step in progress
    assert tiers(s, 11) == "F.c.F.F.F.F"
    s.request(9)  # a step the schedule does not record stays unrecorded
    assert s.tier(9) is None


def test_no_window_when_full_after_event_is_zero():
    s = RecordSchedule(cheap_every=1, full_every=0, full_after_event=0)
    s.note_event(1, ["nonfinite_tensor"])
    assert tiers(s, 4) == "cccc" and s.full_window == (0, -1)
    assert s.config() == {"cheap_every": 1, "full_every": 0, "full_after_event": 0}
