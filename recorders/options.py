"""The recorder's parts a user passes in, and the flat keywords they replace.

`AmpRecorder(run_dir, model, schedule=RecordSchedule(...),
bundles=BundlePolicy(...) | False, storage=StorageOptions(...),
writer=WriterOptions(...), on_event=callback | EventPolicy(...),
probe=[patterns] | ProbeOptions(...))`: each option is defined and documented once, in
its part. The flat keywords of earlier versions (`full_every=`,
`max_bundles=`, `spool_dir=`, ..., and `loss_fn=`: the loss the loop computes
outside the model, kept in the counterfactual window) keep working: `FLAT_OPTIONS` says which
part and field each one is, and `parts_from_flat` is the one place that maps
them. A part and one of its own flat keywords together are an `OptionError`
(which one should win is not for the recorder to guess).
"""
from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass
from pathlib import Path

from .bundles.policy import BundlePolicy
from .errors import OptionError, option_float, option_int
from .events import EventPolicy, event_policy
from .journal import DEFAULT_DURABLE_INTERVAL_S
from .schedule import MODES, RecordSchedule
from .storage import DEFAULT_SPOOL_MAX_BYTES, DEFAULT_UPLOAD_TIMEOUT_S


@dataclass(frozen=True)
class StorageOptions:
    """Where a URI run (`s3://...`, ...) is spooled, and for how long
    `close()` waits for its uploads (keywords; their one definition):

    spool_dir: the local spool's directory (default
        `$AMP_POSTMORTEM_SPOOL_DIR`, else the temp directory; one folder per
        run URI and rank inside).
    spool_max_bytes: the spool's bound (2 GiB per rank); when the store is
        down that long, later shards' steps are dropped and counted.
    upload_timeout_s: how long `close()` waits for the uploads (120 s); what
        is left stays in the spool and is reported (`rec.upload_report`, a
        warning).

    A local run directory uses none of them."""

    spool_dir: str | Path | None = None
    spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES
    upload_timeout_s: float = DEFAULT_UPLOAD_TIMEOUT_S

    def __post_init__(self):
        object.__setattr__(self, "spool_max_bytes", option_int("spool_max_bytes", self.spool_max_bytes))
        object.__setattr__(self, "upload_timeout_s", option_float("upload_timeout_s", self.upload_timeout_s))


@dataclass(frozen=True)
class WriterOptions:
    """How the writer thread turns steps into files (keywords; their one
    definition):

    steps_per_shard: steps per Parquet shard pair (1000; at least 1).
    flush_interval_s: write a shard at least this often (60 s) even when it
        holds fewer than `steps_per_shard` steps.
    durable_interval_s: until its shard is written, every step is in the
        rank's journal (`rank=R/journal/`), handed to the OS as the writer
        thread takes the step (a killed job loses only the steps the writer
        had not taken) and fsynced at least this often (5 s), so that a node
        failure loses at most this much; a step with a NaN/Inf or a skip is
        fsynced at once.
    max_queue: steps waiting for the writer thread (256); beyond it steps
        are dropped and counted, never waited for."""

    steps_per_shard: int = 1000
    flush_interval_s: float = 60.0
    durable_interval_s: float = DEFAULT_DURABLE_INTERVAL_S
    max_queue: int = 256

    def __post_init__(self):
        object.__setattr__(self, "steps_per_shard", max(1, option_int("steps_per_shard", self.steps_per_shard)))
        object.__setattr__(self, "flush_interval_s", option_float("flush_interval_s", self.flush_interval_s))
        object.__setattr__(self, "durable_interval_s",
                           option_float("durable_interval_s", self.durable_interval_s))
        object.__setattr__(self, "max_queue", option_int("max_queue", self.max_queue))


@dataclass(frozen=True)
class ProbeOptions:
    """The op probe: the largest magnitude of every operation inside some
    modules' forward, so that an overflow that never reaches a module's
    output (an fp16 variance `x * x`, attention logits `q @ k^T` before the
    softmax) is seen before it happens (`intermediate` rows, read by
    `amp-postmortem ranges`). Off unless given:
    `AmpRecorder(probe=["blocks.*.attn"])` or `probe=ProbeOptions(...)`
    (keywords; their one definition):

    modules: glob patterns of module names (as `named_modules()` names them,
        wrappers unwrapped; `""` is the model) probed on every recorded
        step. An operation belongs to the innermost probed module running it.
    full_tier_leaves: also probe every watched module without children on
        full-tier steps (hooks on those modules on every step; they do
        nothing on the others).
    max_ops_per_call: operations recorded per module call (256); later ones
        run unrecorded.

    Per operation with a floating output (views excepted), as torch runs it
    below autograd and autocast: the aten op (`aten::bmm`), its output dtype,
    the largest finite magnitude and the NaN/Inf counts of its outputs
    (device work, copied with the step's other rows) and the model's source
    line that called it. Cost: a `TorchDispatchMode` is pushed while a
    probed module runs, and every op there pays a Python call and the
    cheap-tier statistics of its outputs (several times the module's own
    time for small tensors): probe a few modules, not the whole model.
    Nothing is added to a step, a module or an op when no probe is given.
    The probe changes no value the training computes; backward passes are
    not probed."""

    modules: tuple = ()
    full_tier_leaves: bool = False
    max_ops_per_call: int = 256

    def __post_init__(self):
        modules = (self.modules,) if isinstance(self.modules, str) else self.modules
        try:
            modules = tuple(modules)
        except TypeError:
            raise OptionError(f"probe modules={self.modules!r}: give glob patterns of module names") from None
        bad = [m for m in modules if not isinstance(m, str)]
        if bad:
            raise OptionError(f"probe modules: {bad[0]!r} is not a module name pattern (a string)")
        object.__setattr__(self, "modules", modules)
        object.__setattr__(self, "full_tier_leaves", bool(self.full_tier_leaves))
        ops = option_int("max_ops_per_call", self.max_ops_per_call)
        if ops < 1:
            raise OptionError(f"max_ops_per_call={ops}: at least 1")
        object.__setattr__(self, "max_ops_per_call", ops)

    def config(self) -> dict:
        """The options as the manifest records them (`recorder.probe`)."""
        return {"modules": list(self.modules), "full_tier_leaves": self.full_tier_leaves,
                "max_ops_per_call": self.max_ops_per_call}


def probe_options(probe) -> ProbeOptions | None:
    """`AmpRecorder(probe=)` as options: None or False (off), module name
    patterns (a string or a list), or a ProbeOptions."""
    if probe is None or probe is False:
        return None
    if isinstance(probe, ProbeOptions):
        return probe
    if isinstance(probe, (str, list, tuple)):
        return ProbeOptions(modules=probe)
    raise OptionError(f"probe={probe!r}: give module name patterns or a ProbeOptions")


# flat keyword of AmpRecorder -> (its part's keyword, the part's field)
FLAT_OPTIONS = {
    "cheap_every": ("schedule", "cheap_every"),
    "full_every": ("schedule", "full_every"),
    "full_after_event": ("schedule", "full_after_event"),
    "steps_per_shard": ("writer", "steps_per_shard"),
    "flush_interval_s": ("writer", "flush_interval_s"),
    "durable_interval_s": ("writer", "durable_interval_s"),
    "max_queue": ("writer", "max_queue"),
    "bundle_triggers": ("bundles", "triggers"),
    "bundle_steps": ("bundles", "steps"),
    "max_bundles": ("bundles", "max_bundles"),
    "max_bundle_bytes": ("bundles", "max_bundle_bytes"),
    "min_loss_scale": ("bundles", "min_loss_scale"),
    "settle_steps": ("bundles", "settle_steps"),
    "snapshot_params": ("bundles", "snapshot_params"),
    "snapshot_buffers_bytes": ("bundles", "snapshot_buffers_bytes"),
    "hold_steps": ("bundles", "hold_steps"),
    "clone_inputs": ("bundles", "clone_inputs"),
    "window_steps": ("bundles", "window_steps"),
    "max_window_bytes": ("bundles", "max_window_bytes"),
    "loss_fn": ("bundles", "loss_fn"),
    "spool_dir": ("storage", "spool_dir"),
    "spool_max_bytes": ("storage", "spool_max_bytes"),
    "upload_timeout_s": ("storage", "upload_timeout_s"),
}
PART_TYPES = {"schedule": RecordSchedule, "writer": WriterOptions, "bundles": BundlePolicy,
              "storage": StorageOptions}


class Unset:
    """The default of a flat keyword: not given (its part's default holds)."""

    def __repr__(self):
        return "unset"


UNSET = Unset()


@dataclass(frozen=True)
class RecorderParts:
    """The parts a recorder is built from (`parts_from_flat`)."""

    schedule: RecordSchedule
    bundles_enabled: bool
    bundle_policy: BundlePolicy
    storage: StorageOptions
    writer: WriterOptions
    events: EventPolicy | None = None  # None: no on_event callback, no event detection
    probe: ProbeOptions | None = None  # None: no op probe (no hook, no cost)


def parts_from_flat(flat: dict, *, schedule=None, bundles=True, storage=None, writer=None,
                    on_event=None, probe=None, mode: str = "sentinel") -> RecorderParts:
    """The parts, from those passed in and the flat keywords given (`flat`:
    name -> value, only the keywords the caller passed). `bundles`: True
    (the policy of the flat keywords, else the default one), False (no
    bundles; the flat keywords still say what the manifest records) or a
    `BundlePolicy`. `on_event`: None, a callable (`EventPolicy(on_event)`)
    or an `EventPolicy`. `probe`: None, module name patterns or a
    `ProbeOptions` (`probe_options`). `mode`: `"sentinel"` (`RecordSchedule()`'s
    defaults) or `"every_step"` (`RecordSchedule.every_step()`'s), for the
    schedule's fields no flat keyword sets."""
    if mode not in MODES:
        raise OptionError(f"mode={mode!r}: give one of {', '.join(map(repr, MODES))}")
    unknown = sorted(set(flat) - set(FLAT_OPTIONS))
    if unknown:
        raise TypeError(f"AmpRecorder() got an unexpected keyword argument {unknown[0]!r}")
    given = {"schedule": schedule, "writer": writer, "storage": storage,
             "bundles": bundles if isinstance(bundles, BundlePolicy) else None}
    fields: dict[str, dict] = {part: {} for part in PART_TYPES}
    for name, value in flat.items():
        part, field = FLAT_OPTIONS[name]
        if given[part] is not None:
            cls = PART_TYPES[part].__name__
            raise OptionError(f"{part}={cls}(...) and {name}= both given: pass {field}= to the {cls} instead")
        fields[part][field] = value
    for part, value in given.items():
        if value is not None and not isinstance(value, PART_TYPES[part]):
            raise OptionError(f"{part}={value!r}: give a {PART_TYPES[part].__name__}")
    # bool() as before parts existed (bundles=0 and None meant False)
    if not isinstance(bundles, (BundlePolicy, bool, int)) and bundles is not None:
        raise OptionError(f"bundles={bundles!r}: give True, False or a BundlePolicy")
    return RecorderParts(
        schedule=schedule if schedule is not None else (
            RecordSchedule.every_step(**fields["schedule"]) if mode == "every_step"
            else RecordSchedule(**fields["schedule"])),
        bundles_enabled=isinstance(bundles, BundlePolicy) or bool(bundles),
        bundle_policy=given["bundles"] or BundlePolicy(**fields["bundles"]),
        storage=storage if storage is not None else StorageOptions(**fields["storage"]),
        writer=writer if writer is not None else WriterOptions(**fields["writer"]),
        events=event_policy(on_event),
        probe=probe_options(probe))


def probe_targets(probe, modules: list, watched: list) -> tuple[list, list]:
    """The modules an op probe hooks: (those its patterns name, probed on
    every recorded step; the watched modules without children, probed on
    full-tier steps when `full_tier_leaves`). A pattern that names no module
    is warned about: a typo would otherwise probe nothing, silently."""
    if probe is None:
        return [], []
    probed = [name for name, _ in modules if any(fnmatch.fnmatchcase(name, p) for p in probe.modules)]
    unmatched = [p for p in probe.modules if not any(fnmatch.fnmatchcase(name, p) for name, _ in modules)]
    if unmatched:
        warnings.warn(f"amp-postmortem: probe pattern(s) {', '.join(map(repr, unmatched))} name no module "
                      f"of the model (names as named_modules() gives them)", RuntimeWarning, stacklevel=4)
    leaves = []
    if probe.full_tier_leaves:
        watched = set(watched)
        leaves = [name for name, m in modules if name in watched and next(m.children(), None) is None]
    return probed, leaves


def recorded_options(parts: RecorderParts, *, matches, near_overflow: float, stance, mode: str,
                     probed: list) -> dict:
    """The manifest's `recorder` entry as far as the options say it (the
    bundles' and the re-execution's are added by who builds them)."""
    writing = parts.writer
    options = {"include": list(matches.include), "exclude": list(matches.exclude), **parts.schedule.config(),
               "steps_per_shard": writing.steps_per_shard, "near_overflow": float(near_overflow),
               "eager_full_steps": stance.eager_full_steps, "compiled_rows": stance.compiled_rows,
               "flush_interval_s": writing.flush_interval_s, "durable_interval_s": writing.durable_interval_s,
               "mode": mode}
    if parts.probe is not None:
        options["probe"] = {**parts.probe.config(), "probed": probed}
    return options
