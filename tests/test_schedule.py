"""The record schedule alone: which step is recorded at which tier."""
from recorders.schedule import RecordSchedule


def tiers(schedule, steps):
    return "".join({"full": "F", "cheap": "c", None: "."}[schedule.tier(s)] for s in range(steps))


def test_cheap_and_full_tiers_follow_their_periods():
    assert tiers(RecordSchedule(cheap_every=1, full_every=4), 9) == "FcccFcccF"
    assert tiers(RecordSchedule(cheap_every=3, full_every=4), 9) == "F..cF.c.F"
    assert tiers(RecordSchedule(cheap_every=2, full_every=0), 6) == "c.c.c."
    assert tiers(RecordSchedule(cheap_every=0, full_every=100), 3) == "Fcc"  # cheap_every is at least 1


def test_an_event_opens_a_full_window_of_full_after_event_steps():
    s = RecordSchedule(cheap_every=2, full_every=0, full_after_event=3)
    s.note_event(3, ["skipped"])
    # Steps 4, 5, 6 after the event at 3 (step 3 itself was recorded before
    # the writer thread saw its values).
    assert tiers(s, 9) == "c.c.FFF.c"
    s.note_event(5, ["nonfinite_loss"])  # a later event extends the window
    assert tiers(s, 10) == "c.c.FFFFF."
    s.note_event(4)  # an earlier one never shortens it
    assert s.full_window == (4, 8)
    s.note_event(20)  # an event after the window: a new window
    assert s.full_window == (21, 23) and tiers(s, 25)[19:] == ".cFFFc"


def test_no_window_when_full_after_event_is_zero():
    s = RecordSchedule(cheap_every=1, full_every=0, full_after_event=0)
    s.note_event(1, ["nonfinite_tensor"])
    assert tiers(s, 4) == "cccc" and s.full_window == (0, -1)
    assert s.config() == {"cheap_every": 1, "full_every": 0, "full_after_event": 0}
