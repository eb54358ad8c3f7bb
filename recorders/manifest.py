"""The run manifest: what the recorder knows about the job up front, and the
small host-side helpers that describe it as JSON."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from . import schema
from .plain import plain
from .writer import atomic_write_json

try:
    from importlib.metadata import version as _dist_version
    PACKAGE_VERSION = _dist_version("amp-postmortem")
except Exception:  # not installed (running from a source tree)
    PACKAGE_VERSION = "0+unknown"


class ManifestMixin:
    """Builds and writes the manifest (mixed into AmpRecorder; written only
    by the writer thread once recording runs)."""

    def _scaler_config(self):
        if self.scaler is None:
            return None
        s = self.scaler
        return {
            "class": f"{type(s).__module__}.{type(s).__qualname__}",
            "enabled": self._scaler_enabled(),
            "init_scale": _json_float(getattr(s, "_init_scale", None)),
            "growth_factor": _json_float(getattr(s, "_growth_factor", None)),
            "backoff_factor": _json_float(getattr(s, "_backoff_factor", None)),
            "growth_interval": getattr(s, "_growth_interval", None),
        }

    def _initial_manifest(self) -> dict:
        # Tied parameters (one tensor under several names, e.g. an embedding
        # and the output projection) are recorded once, under their first
        # name; the analyzer needs the other names to attribute a gradient
        # overflow to the module whose operation made it.
        shared: dict[int, list] = {}
        for n, p in self.model.named_parameters(remove_duplicate=False):
            shared.setdefault(id(p), []).append(n)
        modules = [{"name": n, "type": f"{type(m).__module__}.{type(m).__qualname__}",
                    "watched": n in set(self._watched)} for m, n in self._module_names.items()]
        device = next((p.device for _, p in self._params), torch.device("cpu"))
        opt = None
        if self.optimizer is not None:
            opt = {"class": f"{type(self.optimizer).__module__}.{type(self.optimizer).__qualname__}",
                   "defaults": plain(getattr(self.optimizer, "defaults", {}), keep_nonfinite=True)}
        return {
            "format": schema.FORMAT_NAME,
            "schema_version": schema.SCHEMA_VERSION,
            "run_id": self.run_id,
            "created_at": time.time(),
            "package_version": PACKAGE_VERSION,
            "torch_version": torch.__version__,
            "rank": self.rank,
            "world_size": self.world_size,
            "device_type": device.type,
            "device_name": _device_name(device),
            "model_class": f"{type(self.model).__module__}.{type(self.model).__qualname__}",
            "autocast": None,
            "scaler": self._scaler_config(),
            "optimizer": opt,
            "recorder": {
                "include": list(self.include), "exclude": list(self.exclude),
                "cheap_every": self.cheap_every, "full_every": self.full_every,
                "full_after_event": self.full_after_event,
                "steps_per_shard": self.steps_per_shard,
                "near_overflow": self.near_overflow,
                "bundles": plain(self.bundles.config, keep_nonfinite=True),
            },
            "modules": modules,
            "params": [{"name": n, "shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", ""),
                        "requires_grad": bool(p.requires_grad), **_aliases(n, p, shared)}
                       for n, p in self._params],
            "bundles": [],
            "status": "open",
            "steps_recorded": 0,
            "first_step": None,
            "last_step": None,
            "dropped_steps": 0,
            "disabled_reason": None,
        }


    def _write_manifest(self) -> None:
        self._manifest["bundles"] = list(self.bundles.saved)
        atomic_write_json(self.rank_dir / schema.MANIFEST_FILE, self._manifest)
        if self.rank == 0:
            atomic_write_json(self.run_dir / schema.MANIFEST_FILE, self._manifest)


def _aliases(name: str, p, shared: dict) -> dict:
    others = [n for n in shared.get(id(p), []) if n != name]
    return {"aliases": others} if others else {}


def _existing_run_id(run_dir: Path, rank: int) -> str | None:
    """A job resumed into its old run directory continues that run: same
    run_id, shard numbering continued, so readers see one run."""
    import json
    for path in (run_dir / schema.RANK_DIR.format(rank=rank) / schema.MANIFEST_FILE,
                 run_dir / schema.MANIFEST_FILE):
        try:
            return json.loads(path.read_text())["run_id"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def _dist_rank_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return 0, 1


def _device_name(device: torch.device) -> str:
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_name(device)
    except Exception:
        pass
    import platform
    return platform.processor() or platform.machine() or device.type


def _json_float(v):
    if isinstance(v, torch.Tensor):
        return float(v.item()) if v.numel() == 1 and v.device.type == "cpu" else None
    if isinstance(v, (int, float)):
        return float(v)
    return None
