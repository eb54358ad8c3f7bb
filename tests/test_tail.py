"""`tail.RunTail`: what a running job wrote since the last look, on runs
recorded by the real recorder."""
import os

from amp_postmortem.reading.tail import RunTail

from conftest import OVERFLOW_STEP


def test_published_pairs_are_read_from_their_indexes_once(overflow_run):
    tail = RunTail(overflow_run)
    news = tail.read()
    # The planted overflow: block.boom's Inf, and the step the scaler skipped.
    assert OVERFLOW_STEP in news.alarming_steps and news.last_step == 11
    assert tail.read().alarming_steps == [] and tail.read().last_step == 11


def test_a_journal_is_read_past_the_last_step_seen(running_run):
    journal = running_run / "rank=0" / "journal" / "steps"
    assert any(journal.glob("part-*.arrows")) and not any((running_run / "rank=0" / "index").glob("*.json"))
    tail = RunTail(running_run)
    assert tail.read().last_step == 3
    assert tail.read().alarming_steps == [] and tail.checked == {0: 3}


def test_a_run_not_started_reads_as_nothing(tmp_path):
    assert RunTail(tmp_path).read().last_step is None


def test_rank_selects(two_rank_run):
    tail = RunTail(two_rank_run, rank=1)
    tail.read()
    assert list(tail.checked) == [1]
