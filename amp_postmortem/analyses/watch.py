"""Follow a running job's run, a local directory or a URI (`s3://...`,
any location `load_run` opens): `summary`'s findings as they appear, each
once, and how the watch ended.

`RunWatcher(path).poll()` looks once. It reads what is new (`tail.RunTail`:
the journal's step rows past the last step seen, the indexes of pairs
published since) and, when a file of the run changed since its last
analysis (judged from `os.stat` alone, or on a store from listings: see
below), re-opens the run and runs
`summary.summarize` on it: at once when a new step went wrong (skipped by
the scaler, a NaN/Inf loss, non-finite gradients or tensor rows), when the
job closed or recording stopped, and at the first look; otherwise at most
every `REJUDGE_S` seconds (or 20 times the last analysis's duration, if
longer), so the slow conditions (an overflow risk, underflow, a stuck
scale) are judged again without re-reading the run every step. It returns
the findings it had not returned before and, once there is one, how the
watch ends (`WatchEnd`).
`follow(watcher, interval)` polls every `interval` seconds until then. No
printing here: the CLI renders the events (`amp-postmortem watch`).

A finding is new by its key (`finding_key`): kind, step and layer for an
event (a first non-finite value, instability, recording switched off), kind
and layer for a condition whose step moves while the job runs (an overflow
risk's step is the last step measured; a stuck scale's the last step).

The watch ends (`Outcome`):
- `fail_on`: a finding at or above `fail_on` (a severity, or kinds);
- `closed`: every rank's recorder closed (its status slot or manifest
  says "closed") with no such finding;
- `recording_disabled`: a recorder switched itself off (a full disk, an
  internal error): nothing more will be written to watch;
- `job_gone`: the process that holds a rank's status slot on this host is
  gone and never closed its recorder (killed). Never for a run on a store:
  a pid there names a process of the job's machine, so a remote watch ends
  on `fail_on`, `closed` or `recording_disabled` only (or Ctrl-C).

A run on a store (a URI) is looked at through listings one level deep
(`store.shallow_view`): the run's root, each `rank=R/` and its `index/`,
one request each; the sizes and modification times listed are the
fingerprint. A manifest or status slot is downloaded only when its listing
changed, an index once, a shard only by an analysis. What a store shows is
what the job uploaded: the recorder's uploader sends published shard pairs
(every `steps_per_shard` steps or `flush_interval_s` seconds, then within
about a second), never the journal, so an alert on a store comes at most
that long after its step, plus `interval`. The spool on the job's machine
is no run to watch: it keeps the journal but gives each published pair up
once uploaded (watching it is refused; `on_event` in the job is the
step-level alert there).
"""
from __future__ import annotations

import enum
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa

from recorders.format import schema
from recorders.format.locations import is_spool

from ..errors import EmptyRunError, OptionError, PostmortemError, RunNotFoundError
from ..reading.loader import load_run, read_manifest, with_status_slot
from ..reading.shards import RANK_DIR, error_text, rank_dirs
from ..reading.store import StorePath, fresh_view, run_location, shallow_view
from ..reading.tail import RunTail
from .fail_on import fail_rule
from .summary import Finding, summarize

DEFAULT_FAIL_ON = "critical"
DEFAULT_INTERVAL = 2.0  # seconds between looks: an alert comes at most this (plus one analysis) after a step
# Seconds a watch waits for a run that does not exist yet: a job's recorder
# makes its directory after the imports, the data and the model are ready,
# which takes tens of seconds for a large model.
DEFAULT_WAIT_TIMEOUT = 120.0
# Kinds that are no news while a job runs: "healthy" until something is
# found, "not closed" because the job is still running (`job_gone` says
# when it is not).
_NOT_NEWS = {"healthy", "recording_not_closed"}
# Findings whose step moves as the job goes on: one per kind and layer.
_CONDITIONS = {"overflow_risk", "grad_underflow", "underflow_lapsed",
               "stuck_low_scale", "scale_collapse", "training_instability",
               "unscaled_fp16_backward", "grad_subnormal", "lost_updates"}
# How often the whole run is judged again while no new step went wrong:
# the slow conditions move over hundreds of steps, and a full analysis of a
# long run takes seconds that the job's disk and CPU share.
REJUDGE_S = 30.0
_REJUDGE_SHARE = 20  # at most ~5% of the time analysing
# A run being written changes under the reader (a journal removed as its
# pair is published): an error is believed after this many looks in a row.
_RETRIES = 3
_RACES = 3  # immediate re-reads of a local run whose files changed during an analysis (`_moved`)
_WATCHED_DIRS = (f"{schema.JOURNAL_DIR}/{schema.STEPS_DIR}", f"{schema.JOURNAL_DIR}/{schema.TENSORS_DIR}",
                 schema.STEPS_DIR, schema.TENSORS_DIR, schema.INDEX_DIR)


class Outcome(enum.Enum):
    FAIL_ON = "fail_on"
    CLOSED = "closed"
    RECORDING_DISABLED = "recording_disabled"
    JOB_GONE = "job_gone"


# `amp-postmortem watch` exits with these (2: unusable input, as every command).
EXIT_CODES = {Outcome.CLOSED: 0, Outcome.FAIL_ON: 1, Outcome.RECORDING_DISABLED: 3, Outcome.JOB_GONE: 3}


@dataclass
class FindingSeen:
    """A finding seen for the first time, at `seen_at` (Unix time)."""
    finding: Finding
    seen_at: float
    fails: bool  # at or above fail_on

    def to_dict(self) -> dict:
        return {"event": "finding", "seen_at": self.seen_at, "fails": self.fails, **self.finding.to_dict()}

    def lines(self) -> list[str]:
        return self.finding.lines()


@dataclass
class WatchEnd:
    outcome: Outcome
    last_step: int | None
    finding: Finding | None = None  # the one that failed (fail_on)
    ranks: list = field(default_factory=list)  # those disabled or gone
    reason: str | None = None  # the recorder's disabled_reason

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.outcome]

    def to_dict(self) -> dict:
        return {"event": "end", "outcome": self.outcome.value, "exit_code": self.exit_code,
                "last_step": self.last_step, "ranks": self.ranks, "reason": self.reason,
                "failing": None if self.finding is None else {k: self.finding.to_dict()[k]
                                                              for k in ("kind", "severity", "step", "layer")}}

    def lines(self) -> list[str]:
        at = "no step yet" if self.last_step is None else f"last step {self.last_step}"
        ranks = ", ".join(map(str, self.ranks))
        text = {
            Outcome.FAIL_ON: lambda: f"stopped watching: {self.finding.severity} finding {self.finding.kind} "
                                     f"at step {self.finding.step} ({at}); exit code {self.exit_code}",
            Outcome.CLOSED: lambda: f"the job closed its recording ({at}) with no finding at the --fail-on "
                                    f"level; exit code {self.exit_code}",
            Outcome.RECORDING_DISABLED: lambda: f"recording was switched off on rank(s) {ranks} ({self.reason}); "
                                                f"nothing more to watch ({at}); exit code {self.exit_code}",
            Outcome.JOB_GONE: lambda: f"the job's process of rank(s) {ranks} is gone without closing its "
                                      f"recording (killed?) ({at}); exit code {self.exit_code}",
        }[self.outcome]()
        return [text]


@dataclass
class Poll:
    events: list  # FindingSeen, then the WatchEnd if the watch ends
    last_step: int | None = None

    @property
    def end(self) -> WatchEnd | None:
        return next((e for e in self.events if isinstance(e, WatchEnd)), None)


def finding_key(f: Finding) -> tuple:
    return (f.kind, f.layer) if f.kind in _CONDITIONS else (f.kind, f.step, f.layer)


class RunWatcher:
    """One run (a local directory or a URI) followed; `poll()` looks once."""

    def __init__(self, path, *, rank: int | None = None, fail_on=DEFAULT_FAIL_ON, window: int = 1000):
        self.path = run_location(path)  # a Path, or a StorePath for a URI
        self.remote = isinstance(self.path, StorePath)
        self._look_errors = 0
        if not run_exists(self.path):
            raise RunNotFoundError(f"run directory not found: {self.path}")
        self.rank = rank
        self.window = window
        self.fails = fail_rule(fail_on)
        self.seen: set[tuple] = set()
        self.last_step: int | None = None
        self.analyses = 0  # full analyses run: what watching costs
        self.tail = RunTail(self.path, rank=rank)
        self._states: dict[int, tuple] = {}  # rank -> (its files' versions, its state)
        self._fingerprint = None
        self._errors = 0
        self._alarm = False       # a new step went wrong since the last analysis
        self._next_full = None    # monotonic time of the next due analysis; None: at once
        if not self.remote:
            self._rank_states(self.path)  # a job's spool is refused at once

    def poll(self) -> Poll:
        view = self._look()
        if view is None:  # the store did not answer this time
            return Poll([], self.last_step)
        states = self._rank_states(view)
        closed = bool(states) and all(s.get("status") == "closed" for s in states.values())
        stopped = any(s.get("disabled_reason") for s in states.values())
        news = self.tail.read(view)
        self._alarm |= bool(news.alarming_steps)
        if news.last_step is not None:
            self.last_step = max(news.last_step, self.last_step if self.last_step is not None else -1)
        fingerprint = self._files(view)
        due = (self._alarm or closed or stopped or self._next_full is None
               or time.monotonic() >= self._next_full)
        events: list = []
        if fingerprint != self._fingerprint and due:
            started = time.monotonic()
            events = self._analyse(fingerprint, must=closed)
            if events is not None:
                self._fingerprint, self._alarm = fingerprint, False
                took = time.monotonic() - started
                self._next_full = time.monotonic() + max(REJUDGE_S, _REJUDGE_SHARE * took)
            events = events or []
        failing = next((e.finding for e in events if e.fails), None)
        end = None
        if failing is not None:
            end = WatchEnd(Outcome.FAIL_ON, self.last_step, finding=failing)
        elif disabled := {r: s["disabled_reason"] for r, s in states.items() if s.get("disabled_reason")}:
            end = WatchEnd(Outcome.RECORDING_DISABLED, self.last_step, ranks=sorted(disabled),
                           reason="; ".join(sorted(set(disabled.values()))))
        elif closed:
            end = WatchEnd(Outcome.CLOSED, self.last_step)
        elif not self.remote and (gone := [r for r, s in states.items()
                                           if s.get("status") == "open" and _gone(s)]):
            end = WatchEnd(Outcome.JOB_GONE, self.last_step, ranks=gone)
        return Poll(events + ([end] if end else []), self.last_step)

    def _analyse(self, fingerprint: tuple, must: bool, raced: int = 0) -> list | None:
        """The new findings; None when the run could not be read this time
        (read again at the next look, or, when the job has written no step
        yet, once its files changed)."""
        self.analyses += 1
        try:
            run = load_run(fresh_view(self.path) if self.remote else self.path, rank=self.rank)
            found = summarize(run, window=self.window).findings
        except EmptyRunError:
            if must:
                raise
            self._fingerprint = fingerprint  # no step yet: nothing to read before a file changes
            return None
        except RunNotFoundError:
            if not self.remote and (must or not _starting(self.path)):
                raise
            if not self.remote:
                # An empty directory, or one starting recorders are filling
                # (rank directories come before the run's manifest): the
                # job has not started. Anything else is no run.
                self._fingerprint = fingerprint
                return None
            # On a store: its manifest not uploaded yet, or a transient error.
            self._errors += 1
            if must or self._errors >= _RETRIES:
                raise
            return None
        except (OSError, pa.ArrowException) as exc:
            if (moved := self._moved(fingerprint, raced)) is not None:
                return self._analyse(moved, must, raced + 1)
            self._errors += 1
            if must or self._errors >= _RETRIES:
                if self.remote:
                    raise RunNotFoundError(f"cannot read the run {self.path} ({error_text(exc)})") from None
                raise
            return None
        except PostmortemError:
            if (moved := self._moved(fingerprint, raced)) is not None:
                return self._analyse(moved, must, raced + 1)
            self._errors += 1
            if must or self._errors >= _RETRIES:
                raise
            return None
        self._errors = 0
        if run.last_step is not None:
            self.last_step = max(run.last_step, self.last_step if self.last_step is not None else -1)
        now = time.time()
        out = []
        for f in found:
            key = finding_key(f)
            if f.kind in _NOT_NEWS or key in self.seen:
                continue
            self.seen.add(key)
            out.append(FindingSeen(f, now, self.fails(f)))
        return out

    def _moved(self, fingerprint: tuple, raced: int) -> tuple | None:
        """The files of a local run that changed while it was analysed (None:
        unchanged, a store, or `_RACES` re-reads done): the job published a
        pair and removed the journal this analysis had listed (`cannot be
        read (No such file or directory)`), so it is read again at once, no
        error counted. Under load an analysis can outlast a shard's steps,
        and three such looks in a row ended the watch with exit 2."""
        if self.remote or raced >= _RACES:
            return None
        now = self._files(self.path)
        return now if now != fingerprint else None

    def _look(self):
        """The run as it is now: the local directory, or a new shallow view
        of the store with the root, each rank directory and its index
        listed (None when the store did not answer: after `_RETRIES` looks
        in a row that is an error)."""
        if not self.remote:
            return self.path
        view = shallow_view(self.path)
        try:
            for d in rank_dirs(view).values():
                list((d / schema.INDEX_DIR).iterdir())  # lists the rank directory and its index
        except (OSError, pa.ArrowException) as exc:
            self._look_errors += 1
            if self._look_errors >= _RETRIES:
                raise RunNotFoundError(f"cannot read the run {self.path} ({error_text(exc)})") from None
            return None
        except PostmortemError:
            pass  # a foreign entry: the analysis names it
        self._look_errors = 0
        return view

    def _rank_states(self, view) -> dict[int, dict]:
        """{rank: its manifest with the status slot laid over, plus the
        slot's host and pid}: a few small files per rank, read again only
        when they changed."""
        out = {}
        try:
            found = rank_dirs(view)
        except (PostmortemError, OSError, pa.ArrowException):
            return out
        for r, d in found.items():
            if self.rank is not None and r != self.rank:
                continue
            m, status = d / schema.MANIFEST_FILE, d / schema.STATUS_FILE
            versions = (self._version(view, m), self._version(view, status))
            if r in self._states and self._states[r][0] == versions:
                out[r] = self._states[r][1]
                continue
            try:
                state = with_status_slot(read_manifest(m, view) if m.is_file() else {}, status, [], view)
                slot = {} if self.remote else _slot(status)  # a pid is judged on its own host only
            except (PostmortemError, OSError, pa.ArrowException):
                continue  # being written: the next look reads it
            storage = state.get("storage")
            if not self.remote and isinstance(storage, dict) and is_spool(self.path, storage.get("uri"), r):
                raise OptionError(f"{self.path} is the local spool of the run {storage.get('uri')}: "
                                  f"it gives each shard pair up once uploaded; watch the run's URI instead")
            out[r] = {**state, "host": slot.get("host"), "pid": slot.get("pid")}
            self._states[r] = (versions, out[r])
        return out

    def _version(self, view, p):
        if self.remote:
            return p.version()
        return _stat(p)

    def _files(self, view) -> tuple:
        """(name, size, mtime) of every file the recorder adds or rewrites
        (on a store: of every file the look listed)."""
        if self.remote:
            return tuple(sorted((p, size, mtime) for p, (size, mtime) in view.listed_versions().items()))
        out = []
        for d in sorted(self.path.glob("rank=*")):
            for name in (schema.STATUS_FILE, schema.MANIFEST_FILE):
                out.append(_stat(d / name))
            for sub in _WATCHED_DIRS:
                try:
                    with os.scandir(d / sub) as it:
                        out.extend(_stat(Path(e.path)) for e in it)
                except OSError:
                    continue
        return tuple(sorted(o for o in out if o is not None))


def run_exists(location) -> bool:
    """Whether the run's directory (a Path) or prefix on a store (a
    StorePath) exists; a file where the run should be is an error."""
    if isinstance(location, StorePath):
        try:
            return shallow_view(location).exists()
        except (OSError, pa.ArrowException) as exc:
            raise RunNotFoundError(f"cannot read the run {location} ({error_text(exc)})") from None
    if location.exists() and not location.is_dir():
        raise RunNotFoundError(f"{location} is not a run directory (it is a file); pass the directory the "
                               f"recorder writes (the one that holds {schema.MANIFEST_FILE})")
    return location.is_dir()


def await_run(path, *, timeout: float = DEFAULT_WAIT_TIMEOUT, interval: float = DEFAULT_INTERVAL,
              sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic):
    """The run's location once it exists: a job started a moment before its
    watch (`python train.py & amp-postmortem watch RUN`) makes its
    directory only when its recorder starts. Looked at every `interval`
    seconds for up to `timeout` seconds, then RunNotFoundError."""
    location = run_location(path)
    deadline = clock() + timeout
    while not run_exists(location):
        left = deadline - clock()
        if left <= 0:
            waited = f" (waited {timeout:g} s for it to appear; --wait-timeout)" if timeout > 0 else ""
            raise RunNotFoundError(f"run directory not found: {location}{waited}")
        sleep(min(interval, left))
    return location


def watch_run(path, *, rank: int | None = None, fail_on=DEFAULT_FAIL_ON, window: int = 1000,
              interval: float = DEFAULT_INTERVAL, wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
              sleep: Callable[[float], None] = time.sleep) -> Iterator:
    """`amp-postmortem watch`: wait for the run (`await_run`), then follow
    it (`follow`). What can be refused now is: `fail_on`, a file given as a
    local run, a local directory that is no run to watch (a spool); a run
    still to appear is waited for when the first event is asked for."""
    fail_rule(fail_on)
    location = run_location(path)
    if not isinstance(location, StorePath) and run_exists(location):
        return follow(RunWatcher(path, rank=rank, fail_on=fail_on, window=window), interval=interval, sleep=sleep)
    return _awaited(path, rank, fail_on, window, interval, wait_timeout, sleep)


def _awaited(path, rank, fail_on, window, interval, wait_timeout, sleep):
    await_run(path, timeout=wait_timeout, interval=interval, sleep=sleep)
    yield from follow(RunWatcher(path, rank=rank, fail_on=fail_on, window=window), interval=interval, sleep=sleep)


def follow(watcher: RunWatcher, *, interval: float = DEFAULT_INTERVAL,
           sleep: Callable[[float], None] = time.sleep) -> Iterator:
    """The watcher's events as they come, the `WatchEnd` last."""
    while True:
        started = time.monotonic()
        poll = watcher.poll()
        yield from poll.events
        if poll.end is not None:
            return
        # The analysis counts against the interval: a look every `interval`.
        sleep(max(0.0, interval - (time.monotonic() - started)))


def _starting(path: Path) -> bool:
    """Whether `path` holds nothing but what recorders make before the
    run's manifest: rank directories (another rank's may already hold its
    own manifest) and hidden temporary files."""
    try:
        entries = list(path.iterdir())
    except OSError:
        return False
    return all(e.name.startswith(".") or (RANK_DIR.fullmatch(e.name) is not None and e.is_dir())
               for e in entries)


def _stat(p: Path):
    try:
        st = p.stat()
    except OSError:
        return None
    return (str(p), st.st_size, st.st_mtime_ns)


def _slot(path: Path) -> dict:
    try:
        doc = json.loads(path.read_bytes()[:1 << 16])
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _gone(state: dict) -> bool:
    """Whether the process that writes this rank is known dead: only
    judged on its own host (a pid means nothing elsewhere)."""
    pid, host = state.get("pid"), state.get("host")
    if not isinstance(pid, int) or host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, another user's
        return False
    return False
