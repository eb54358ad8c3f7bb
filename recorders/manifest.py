"""The run manifest: what the recorder knows about the job, as JSON.

`RunManifest` owns the manifest dictionary and writes it (to the rank's
directory, and to the run directory on rank 0); after construction only the
writer thread changes or writes it. The functions below describe the job's
parts (device, scaler, optimizer, distributed rank) in host-side values.
"""
from __future__ import annotations

import json
import platform
import threading
import time
from pathlib import Path

import torch

from .format import schema
from .layout import all_module_names, fsdp1_shapes, unwrap, user_class
from .format.plain import plain
from .writer import atomic_write_json

try:
    from importlib.metadata import version as _dist_version
    PACKAGE_VERSION = _dist_version("amp-postmortem")
except Exception:  # not installed (running from a source tree)
    PACKAGE_VERSION = "0+unknown"


class RunManifest:
    """The manifest of one rank. `fields`: the description of the job
    (see `describe_job`); the recording counters start empty."""

    def __init__(self, run_dir: Path, rank: int, fields: dict):
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.data = {**fields, "bundles": [], "status": "open", "steps_recorded": 0,
                     "first_step": None, "last_step": None, "dropped_steps": 0,
                     "disabled_reason": None, "disabled_at_step": None}
        # The writer thread writes it; a failure is written from whichever
        # thread noticed it.
        self._write_lock = threading.Lock()

    def set_compiled(self, info: dict) -> None:
        self.data["compiled"] = info

    def set_autocast(self, info: dict) -> None:
        self.data["autocast"] = info

    def note_step(self, step: int) -> None:
        m = self.data
        m["steps_recorded"] += 1
        m["first_step"] = step if m["first_step"] is None else min(m["first_step"], step)
        m["last_step"] = step if m["last_step"] is None else max(m["last_step"], step)

    def set_bundles(self, saved: list, missed: list) -> None:
        self.data["bundles"] = list(saved)
        if missed:
            self.data["bundles_missed"] = list(missed)

    def autocast_enabled(self) -> bool:
        return bool((self.data.get("autocast") or {}).get("enabled"))

    def set_events(self, report: dict) -> None:
        """`EventDispatcher.report()`: the `on_event` detectors' record."""
        self.data["events"] = report

    def set_storage(self, uri: str) -> None:
        """A URI run: its store, and the steps its full spool dropped."""
        self.data["storage"] = {"uri": uri, "spool_dropped_steps": 0}

    def set_spool_dropped(self, steps: int) -> None:
        if "storage" in self.data:
            self.data["storage"]["spool_dropped_steps"] = steps

    def save_bundles(self, saved: list, missed: list) -> None:
        """The bundle lists changed (writer thread): on disk at once."""
        self.set_bundles(saved, missed)
        self.write()

    def note_reexecution(self, entry: dict | None, gaps: dict) -> None:
        """A re-execution's entry (`step_rows.reexecution_check`), and the
        steps left without one so far (`StepSentinel.gaps`: the events the
        cap left, the steps whose device facts were not judged in the job)."""
        if entry is not None:
            self.data.setdefault("reexecutions", []).append(plain(entry, keep_nonfinite=True))
        self.data.update(gaps)

    def set_lost_updates(self, report: dict | None) -> None:
        """`collectors.updates.LostUpdates.report()`: absent when no parameter is held in low precision."""
        if report is not None:
            self.data[schema.LOST_UPDATES_KEY] = report

    def set_recording(self, *, status: str | None = None, dropped_steps: int = 0,
                      failure: BaseException | None = None, failed_at_step: int | None = None) -> None:
        if status is not None:
            self.data["status"] = status
        self.data["dropped_steps"] = dropped_steps
        if failure is not None:
            self.data["disabled_reason"] = failure_reason(failure)
        if failed_at_step is not None:
            self.data["disabled_at_step"] = failed_at_step

    def write(self) -> None:
        rank_dir = self.run_dir / schema.RANK_DIR.format(rank=self.rank)
        with self._write_lock:
            data = dict(self.data)
            atomic_write_json(rank_dir / schema.MANIFEST_FILE, data)
            if self.rank == 0:
                atomic_write_json(self.run_dir / schema.MANIFEST_FILE, data)


def failure_reason(failure: BaseException) -> str:
    """`disabled_reason` as the manifest and the status slot say it."""
    return f"{type(failure).__name__}: {failure}"


def bare_manifest(run_dir: Path, rank: int, world_size: int, run_id: str | None) -> RunManifest:
    """The manifest of a recorder that failed before it could describe the
    job: enough for a reader to say that nothing was recorded, and why."""
    import uuid
    return RunManifest(run_dir, rank, {
        "format": schema.FORMAT_NAME, "schema_version": schema.SCHEMA_VERSION,
        "run_id": run_id or uuid.uuid4().hex, "created_at": time.time(),
        "package_version": PACKAGE_VERSION, "torch_version": torch.__version__,
        "rank": rank, "world_size": world_size})


# What a bundle.json says of the job (`BundleCapture`'s run_info): keys of `describe_job`'s.
RUN_INFO = ("run_id", "rank", "world_size", "package_version", "device_type", "device_name", "scaler")


def describe_job(*, run_id: str, rank: int, world_size: int, model: torch.nn.Module, optimizer, scaler,
                 recorder_options: dict, survey=None, module_names: dict | None = None,
                 watched: list[str] | None = None, params: list | None = None, model_class: type | None = None,
                 sharded=frozenset(), shapes: dict | None = None, flat_views=()) -> dict:
    """The manifest's description of the job, known before the first step.
    `model_class`: the user's class (default: the model's); `sharded`: ids
    of the parameters sharded across ranks; `shapes`: unsharded shapes by
    parameter id where `.shape` is a local one (FSDP1); `flat_views`:
    (name, `FlatView`) of FSDP1's parameters without `use_orig_params`,
    listed as parameters (with their unsharded shapes). `survey`: a
    `survey.ModelSurvey`, which gives the names, watched modules,
    parameters, sharding and flat views (and the user's class and FSDP1's
    shapes are read off the model)."""
    if survey is not None:
        module_names, watched, params = survey.module_names, survey.watched, survey.params
        sharded, flat_views = survey.sharded, survey.flat_views
        model_class, shapes = user_class(model), fsdp1_shapes(model)
    watched_set = set(watched)
    shapes = shapes or {}
    # Tied parameters (one tensor under several names, e.g. an embedding and
    # the output projection) are recorded once, under their first name; the
    # analyzer needs the other names to attribute a gradient overflow to the
    # module whose operation made it. Names as the unwrapped model gives them.
    shared: dict[int, list] = {}
    for m, mod in all_module_names(model):
        for n, p in mod._parameters.items():
            if p is not None:
                shared.setdefault(id(p), []).append(f"{m}.{n}" if m else n)
    for n, view in flat_views:
        if view.aliases:
            shared[id(view)] = [n, *view.aliases]
    params = list(params) + list(flat_views)
    device = next((p.device for _, p in params), torch.device("cpu"))
    return {
        "format": schema.FORMAT_NAME,
        "schema_version": schema.SCHEMA_VERSION,
        "run_id": run_id,
        "created_at": time.time(),
        "package_version": PACKAGE_VERSION,
        "torch_version": torch.__version__,
        "rank": rank,
        "world_size": world_size,
        "device_type": device.type,
        "device_name": device_name(device),
        "model_class": class_name(model_class or type(model)),
        "model_config": model_config(model),
        "autocast": None,
        "scaler": describe_scaler(scaler),
        "optimizer": describe_optimizer(optimizer),
        "recorder": recorder_options,
        "modules": [{"name": n, "type": class_name(user_class(m)), "watched": n in watched_set}
                    for m, n in module_names.items()],
        "params": [{"name": n, "shape": shapes.get(id(p), list(p.shape)),
                    "dtype": str(p.dtype).replace("torch.", ""), "requires_grad": bool(p.requires_grad),
                    "sharded": id(p) in sharded, **tied_aliases(n, p, shared)} for n, p in params],
    }


def qualified_name(obj) -> str:
    return class_name(type(obj))


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def scaler_enabled(scaler) -> bool:
    return scaler is not None and (scaler.is_enabled() if hasattr(scaler, "is_enabled") else True)


def describe_scaler(scaler) -> dict | None:
    if scaler is None:
        return None
    return {
        "class": qualified_name(scaler),
        "enabled": scaler_enabled(scaler),
        "init_scale": host_float(getattr(scaler, "_init_scale", None)),
        "growth_factor": host_float(getattr(scaler, "_growth_factor", None)),
        "backoff_factor": host_float(getattr(scaler, "_backoff_factor", None)),
        "growth_interval": getattr(scaler, "_growth_interval", None),
    }


def describe_optimizer(optimizer) -> dict | None:
    if optimizer is None:
        return None
    return {"class": qualified_name(optimizer),
            "defaults": plain(getattr(optimizer, "defaults", {}), keep_nonfinite=True)}


def model_config(model) -> dict | None:
    """The JSON of a Hugging Face-style `model.config` (one with
    `to_json_string()` or `to_dict()`), so that a replay can rebuild the model
    from its class and this config without downloading anything; None for
    other models. The attention implementation (eager, sdpa) is not part of
    a transformers config's JSON, yet decides where attention logits are
    materialised in half precision: it is kept as `_attn_implementation`."""
    import json
    inner = unwrap(model)  # compile, DDP, FSDP, checkpoint wrappers
    config = getattr(inner, "config", None)
    try:
        if callable(getattr(config, "to_json_string", None)):
            try:
                out = json.loads(config.to_json_string(use_diff=False))
            except TypeError:  # not transformers' signature
                out = json.loads(config.to_json_string())
        elif callable(getattr(config, "to_dict", None)):
            out = plain(config.to_dict(), keep_nonfinite=True)
        else:
            return None
    except Exception:  # noqa: BLE001 - a config that cannot say itself: the replay needs --model
        return None
    if not isinstance(out, dict):
        return None
    attn = getattr(config, "_attn_implementation", None)
    if isinstance(attn, str):
        out["_attn_implementation"] = attn
    return out


def tied_aliases(name: str, p, shared: dict) -> dict:
    """`{"aliases": [other names of p]}` for a tied parameter, else {}."""
    others = [n for n in shared.get(id(p), []) if n != name]
    return {"aliases": others} if others else {}


def existing_run_id(run_dir: Path, rank: int) -> str | None:
    """A job resumed into its old run directory continues that run: same
    run_id, shard numbering continued, so readers see one run."""
    for path in (Path(run_dir) / schema.RANK_DIR.format(rank=rank) / schema.MANIFEST_FILE,
                 Path(run_dir) / schema.MANIFEST_FILE):
        try:
            return json.loads(path.read_text())["run_id"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def distributed_rank_world() -> tuple[int, int]:
    """(rank, world size) of an initialised torch.distributed group, else (0, 1)."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return 0, 1


def device_name(device: torch.device) -> str:
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_name(device)
    except Exception:
        pass
    return platform.processor() or platform.machine() or device.type


def host_float(v):
    """A float for JSON from a number or a one-element CPU tensor; None for
    anything else (a device tensor is never read: that would synchronise)."""
    if isinstance(v, torch.Tensor):
        return float(v.item()) if v.numel() == 1 and v.device.type == "cpu" else None
    if isinstance(v, (int, float)):
        return float(v)
    return None
