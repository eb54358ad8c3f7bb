"""Build the user's model for a replay and load a bundle's weights into it.

`--model SPEC` names a factory: `package.module:factory` (imported) or
`path/to/file.py:factory` (loaded from the file); the factory is called with
no arguments and must return an `nn.Module`. Without a spec, the recorded
class path is tried with a no-argument constructor. A transformers model
class or auto class (`transformers:AutoModelForCausalLM`) is built instead
from the config the recorder saved in the manifest (`model_config`), with
random weights: nothing is downloaded. Weights load strictly: a
key the model lacks or a model key the bundle lacks is an error that lists
them, never a silent partial load.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

from recorders import schema

from ..errors import LossFnSpecError, ModelSpecError

_SPEC_FORMS = "package.module:factory or path/to/file.py:factory"
_LISTED = 8  # keys named in an error message before "and N more"


def resolve_factory(spec: str, *, what: str = "model spec", error=ModelSpecError,
                    forms: str = _SPEC_FORMS):
    """The callable named by `spec`; `what`, `error` and `forms` word the
    errors for the option that gave it (`--model`, `--loss-fn`)."""
    if not isinstance(spec, str) or ":" not in spec:
        raise error(f"{what} {spec!r} is not of the form {forms}")
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise error(f"{what} {spec!r} is not of the form {forms}")
    said = (f"{what} {spec!r}", error)
    if where.endswith(".py") or os.sep in where or "/" in where:
        module = _load_file(where, said)
    else:
        module = _import(where, said)
    return _getattr_path(module, attr, said)


def resolve_loss_fn(loss_fn):
    """`loss_fn(output, micro_batch)` however given: a callable, None, or a
    spec like `--model`'s naming a function (`--loss-fn`)."""
    if loss_fn is None or callable(loss_fn):
        return loss_fn
    return resolve_factory(loss_fn, what="loss-fn spec", error=LossFnSpecError,
                           forms="package.module:function or path/to/file.py:function")


def _load_file(path: str, said: tuple):
    spec, error = said
    file = Path(path).expanduser()
    if not file.is_file():
        raise error(f"{spec}: file {path!r} does not exist")
    name = f"_amp_postmortem_model_{abs(hash(str(file.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(name, file)
    if loader_spec is None or loader_spec.loader is None:
        raise error(f"{spec}: {path!r} is not a Python file")
    module = importlib.util.module_from_spec(loader_spec)
    # Let the file import its neighbours, as it would when run as a script.
    parent = str(file.resolve().parent)
    added = parent not in sys.path
    if added:
        sys.path.insert(0, parent)
    try:
        sys.modules[name] = module
        loader_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's code may raise anything
        sys.modules.pop(name, None)
        raise error(f"{spec}: loading {path!r} failed: "
                    f"{type(exc).__name__}: {exc}") from exc
    finally:
        if added:
            sys.path.remove(parent)
    return module


def _import(module_name: str, said: tuple):
    spec, error = said
    try:
        return importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001
        raise error(f"{spec}: cannot import {module_name!r}: "
                    f"{type(exc).__name__}: {exc}") from exc


def _getattr_path(obj, dotted: str, said: tuple):
    spec, error = said
    for part in dotted.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise error(f"{spec}: {part!r} not found in "
                        f"{getattr(obj, '__name__', obj)!r}") from None
    if not callable(obj):
        raise error(f"{spec}: {dotted!r} is not callable")
    return obj


def _recorded_class(class_path: str):
    """Import `package.module.Class` (or a nested `Outer.Inner`) by trying the
    longest importable module prefix."""
    parts = class_path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except Exception:  # noqa: BLE001 - try a shorter prefix
            continue
        obj = module
        try:
            for p in parts[cut:]:
                obj = getattr(obj, p)
        except AttributeError:
            continue
        return obj
    return None


def build_model(spec: str | None, model_class: str | None = None, model_config: dict | None = None
                ) -> torch.nn.Module:
    """Call the factory named by `spec` (or the recorded class when `spec` is
    None) and check that it returns a module. A Hugging Face model class or
    auto class (`transformers:AutoModelForCausalLM`) is built from
    `model_config`, the config the recorder saved with the run; anything
    else is called with no arguments."""
    if spec is not None:
        factory = resolve_factory(spec)
        what = f"model spec {spec!r}"
    else:
        hint = f"pass --model {_SPEC_FORMS} (a function that returns the model)"
        if not model_class:
            raise ModelSpecError(f"the bundle records no model class; {hint}")
        factory = _recorded_class(model_class)
        if factory is None:
            raise ModelSpecError(f"cannot import the recorded model class {model_class!r}; {hint}")
        what = f"recorded model class {model_class!r}"
    if _builds_from_config(factory) and (model_config is not None
                                         or type(factory).__module__.startswith("transformers")
                                         or factory.__module__.startswith("transformers")):
        if model_config is None:
            raise ModelSpecError(f"{what} is built from a config, and the run saved none (a recorder older than "
                                 "the model_config manifest key, or a bundle away from its run directory); "
                                 f"pass --model {_SPEC_FORMS} (a function that returns the model)")
        model = _from_config(factory, model_config, what)
    else:
        try:
            model = factory()
        except Exception as exc:  # noqa: BLE001
            extra = "" if spec is not None else f"; {hint}"
            raise ModelSpecError(f"{what} could not be built with no arguments: "
                                 f"{type(exc).__name__}: {exc}{extra}") from exc
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(f"{what} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _builds_from_config(factory) -> bool:
    """A transformers auto class (`from_config`) or model class (`config_class`)."""
    return isinstance(factory, type) and (callable(getattr(factory, "from_config", None))
                                          or (getattr(factory, "config_class", None) is not None
                                              and callable(getattr(factory, "_from_config", None))))


def _from_config(cls, saved: dict, what: str) -> torch.nn.Module:
    """`cls` built from the saved config JSON: the model's own config class
    when `cls` names one, else transformers' `AutoConfig` by `model_type`.
    The weights are random here (no download); the bundle's replace them."""
    fields = dict(saved)
    attn = fields.pop("_attn_implementation", None)
    kwargs = {"attn_implementation": attn} if attn else {}
    try:
        config_class = getattr(cls, "config_class", None)
        if config_class is not None:
            config = config_class.from_dict(fields)
        else:
            from transformers import AutoConfig
            config = AutoConfig.for_model(**fields)
        builder = getattr(cls, "from_config", None)
        if not callable(builder):
            builder = cls._from_config
        return builder(config, **kwargs)
    except Exception as exc:  # noqa: BLE001 - transformers may raise anything on a config it cannot use
        raise ModelSpecError(f"{what} could not be built from the run's saved config "
                             f"(model_type {saved.get('model_type')!r}): {type(exc).__name__}: {exc}") from exc


def _listed(keys) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:_LISTED])
    return shown + (f" and {len(keys) - _LISTED} more" if len(keys) > _LISTED else "")


def load_weights(model: torch.nn.Module, state: dict) -> None:
    """Load `state` (name -> tensor) into `model` strictly.

    Tied weights may be saved under one of their names only: a model key
    missing from `state` is accepted when it aliases a saved key. Buffers the
    model does not persist (`persistent=False`) are set too when saved.
    """
    own = model.state_dict(keep_vars=True)
    nonpersistent = {n: b for n, b in model.named_buffers() if n not in own}
    aliases: dict = {}
    for name, t in own.items():
        aliases.setdefault(_storage_key(t), []).append(name)
    missing = []
    full = {}
    for name, t in own.items():
        if name in state:
            full[name] = state[name]
            continue
        twin = next((a for a in aliases[_storage_key(t)] if a in state), None)
        if twin is None:
            missing.append(name)
        else:
            full[name] = state[twin]
    unexpected = [k for k in state if k not in own and k not in nonpersistent]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing from the bundle: {_listed(missing)}")
        if unexpected:
            parts.append(f"not in the model: {_listed(unexpected)}")
        raise ModelSpecError(f"the bundle's weights do not fit {type(model).__name__} ("
                             + "; ".join(parts) + "); build the model the run trained")
    bad = [f"{k} {tuple(state_t.shape)} vs {tuple(own[k].shape)}"
           for k, state_t in full.items() if tuple(state_t.shape) != tuple(own[k].shape)]
    if bad:
        raise ModelSpecError(f"the bundle's weights do not fit {type(model).__name__}: shape "
                             f"mismatch for {_listed(bad)}; build the model with the run's configuration")
    model.load_state_dict(full, strict=True)
    with torch.no_grad():
        for name, t in state.items():
            if name in nonpersistent:
                nonpersistent[name].copy_(t)


def _storage_key(t: torch.Tensor):
    try:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
    except Exception:  # noqa: BLE001 - meta or exotic tensors: no aliasing info
        return id(t)


def resolve_model(model, model_class: str | None, model_config: dict | None = None) -> torch.nn.Module:
    """The user's model, however given: an `nn.Module`, a spec string
    (`pkg.mod:factory`, `file.py:factory`, or a transformers class such as
    `transformers:AutoModelForCausalLM`, built from `model_config`), a
    no-argument factory, or None (the recorded class)."""
    if isinstance(model, torch.nn.Module):
        return model
    if model is None or isinstance(model, str):
        return build_model(model, model_class, model_config)
    if callable(model):
        built = model()
        if not isinstance(built, torch.nn.Module):
            raise ModelSpecError(f"the model factory returned {type(built).__name__}, not a torch.nn.Module")
        return built
    raise ModelSpecError(f"model {model!r} is not a spec, a module or a factory")


def saved_model_config(bundle, run_dir=None) -> dict | None:
    """The model config the recorder saved with the run (`model_config` in
    the rank's manifest, else the run's), found from `run_dir` or from the
    bundle's place inside its run (`bundles/step=N/rank=R`); None when
    there is none."""
    import os
    from ..loader import read_manifest
    roots = [Path(run_dir)] if run_dir is not None else []
    if getattr(bundle, "path", None):
        roots.append(Path(bundle.path).parent.parent.parent)
    for root in roots:
        for manifest in (root / schema.RANK_DIR.format(rank=bundle.rank) / schema.MANIFEST_FILE,
                         root / schema.MANIFEST_FILE):
            if not os.path.lexists(manifest):
                continue
            config = read_manifest(manifest, root).get("model_config")  # CorruptRunError when unusable
            if isinstance(config, dict):
                return config
    return None
