"""Build the user's model for a replay and load a bundle's weights into it.

`--model SPEC` names a factory: `package.module:factory` (imported) or
`path/to/file.py:factory` (loaded from the file); the factory is called with
no arguments and must return an `nn.Module`. A transformers model class or
auto class (`transformers:AutoModelForCausalLM`) is built instead from the
config the recorder saved in the manifest (`model_config`), with random
weights: nothing is downloaded.

Nothing a run's data names is imported or called unless the user asks for
it: without `--model` a replay stops with an error that says how to pass a
factory. `--model recorded` builds the class the run recorded, and only
when it is an `nn.Module` subclass of code installed on this machine: the
working directory, the run and the bundle are taken off the import path,
a module found there is refused, and what is imported is said on stderr.
Weights load strictly: a key the model lacks or a model key the bundle
lacks is an error that lists them, never a silent partial load.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.machinery
import importlib.util
import os
import re
import sys
from pathlib import Path

import torch

from recorders.format import schema

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
    return _getattr_path(module, attr, said, where)


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


def _getattr_path(obj, dotted: str, said: tuple, where: str):
    """`obj.a.b` for `dotted` "a.b"; a missing name is said in the user's
    words: their file or module (`where`, as they wrote it) and the name,
    never the name this module loaded their file under."""
    spec, error = said
    walked = []
    for part in dotted.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            owner = where if not walked else f"{'.'.join(walked)} of {where}"
            near = difflib.get_close_matches(part, [n for n in dir(obj) if not n.startswith("_")], n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise error(f"{spec}: {part!r} not found in {owner!r}{hint}") from None
        walked.append(part)
    if not callable(obj):
        raise error(f"{spec}: {dotted!r} is not callable")
    return obj


# `--model recorded`: build the class the run recorded (asked for by name,
# never a default: a bundle from another machine must not choose code to run).
RECORDED = "recorded"
_NO_MODEL_HINT = (f"pass --model {_SPEC_FORMS} (a function with no arguments that returns the model), "
                  f"or --model {RECORDED} to import and build the recorded class from installed code")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+\Z", re.ASCII)


def missing_model_error(model_class: str | None) -> ModelSpecError:
    """What a replay without a model says: how to pass one."""
    recorded = f" (the run recorded {model_class!r})" if isinstance(model_class, str) and model_class else ""
    return ModelSpecError(f"the replay needs the model{recorded}: {_NO_MODEL_HINT}")


def recorded_class(class_path, *, forbidden=(), announce=None):
    """The `nn.Module` subclass `package.module.Class` (or a nested
    `Outer.Inner`) that a run recorded, imported from installed code only.

    The name must be a dotted Python identifier path; the longest prefix
    that is an importable module is imported with the working directory and
    every `forbidden` folder (the run, the bundle) off `sys.path`, and its
    top-level package must not live in any of them; the object found must
    be a class deriving from `torch.nn.Module` (checked before it is ever
    called). `announce(text)` is told what is imported (the CLI: stderr)."""
    what = f"the recorded model class {class_path!r}"
    if not isinstance(class_path, str) or not _DOTTED.match(class_path):
        raise ModelSpecError(f"{what} is not a dotted Python name (package.module.Class); "
                             f"pass --model {_SPEC_FORMS}")
    cwd = _real(os.getcwd())
    blocked = [_real(p) for p in forbidden if p]
    parts = class_path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        origin = _installed_origin(module_name, cwd, blocked, what)
        if origin is None:
            continue
        if announce is not None:
            announce(f"--model {RECORDED}: importing {module_name!r} from {origin} for {class_path!r}")
        module = _import_off_path(module_name, cwd, blocked, what)
        if module is None:
            continue
        obj = module
        try:
            for p in parts[cut:]:
                obj = getattr(obj, p)
        except AttributeError:
            continue
        if not (isinstance(obj, type) and issubclass(obj, torch.nn.Module)):
            raise ModelSpecError(f"{what} names {type(obj).__name__} {obj!r}, not a torch.nn.Module "
                                 f"class; pass --model {_SPEC_FORMS}")
        return obj
    raise ModelSpecError(f"cannot import {what} from installed code; pass --model {_SPEC_FORMS}")


def _real(path) -> str:
    return os.path.realpath(os.fspath(path))


def _inside(path: str, folders: list[str]) -> bool:
    path = _real(path)
    return any(path == f or path.startswith(f.rstrip(os.sep) + os.sep) for f in folders)


def _off_path(cwd: str, blocked: list[str]) -> list[str]:
    # "" and "." are the working directory, as is the script folder of
    # `python -m`; a virtual environment inside it stays (installed code).
    return [p for p in sys.path
            if p not in ("", ".") and _real(p) != cwd and not _inside(p, blocked)]


def _installed_origin(module_name: str, cwd: str, blocked: list[str], what: str) -> str | None:
    """Where the top-level package of `module_name` comes from (found
    without importing anything, the working directory and `blocked` off
    the path), or None when it is not installed. A package that sits in the
    working directory or anywhere in the run or the bundle is refused."""
    top = module_name.split(".")[0]
    loaded = sys.modules.get(top)
    if loaded is not None:
        spec = getattr(loaded, "__spec__", None)
    else:
        saved = list(sys.path)
        sys.path[:] = _off_path(cwd, blocked)
        try:
            spec = importlib.util.find_spec(top)  # a top-level name: imports nothing
        except (ImportError, ValueError):
            spec = None
        finally:
            sys.path[:] = saved
    if spec is None:
        try:  # found only where it must not come from: say so rather than "not installed"
            spec = importlib.machinery.PathFinder.find_spec(top, [cwd, *blocked])
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            raise ModelSpecError(f"{what}: refusing to import {top!r} from {spec.origin or cwd} (the working "
                                 f"directory, the run or the bundle); pass --model {_SPEC_FORMS}")
        return None
    places = list(getattr(spec, "submodule_search_locations", None) or ())
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        places.append(spec.origin)
    for place in places:
        real = _real(place)
        # A module file or package folder directly in the working directory
        # (a package's folder is among its search locations).
        if os.path.dirname(real) == cwd or _inside(real, blocked):
            raise ModelSpecError(f"{what}: refusing to import {top!r} from {place} (the working directory, "
                                 f"the run or the bundle); pass --model {_SPEC_FORMS}")
    return spec.origin if spec.origin not in (None, "frozen") else (places[0] if places else "built-in")


def _import_off_path(module_name: str, cwd: str, blocked: list[str], what: str):
    saved = list(sys.path)
    sys.path[:] = _off_path(cwd, blocked)
    try:
        return importlib.import_module(module_name)
    except ImportError:
        return None
    except Exception as exc:  # noqa: BLE001 - an installed module may raise anything on import
        raise ModelSpecError(f"{what}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.path[:] = saved


def build_model(spec: str, model_config: dict | None = None, *, model_class: str | None = None,
                forbidden=(), announce=None) -> torch.nn.Module:
    """Call the factory named by `spec` (`--model recorded`: the recorded
    class, see `recorded_class`) and check that it returns a module. A
    Hugging Face model class or auto class (`transformers:AutoModelForCausalLM`)
    is built from `model_config`, the config the recorder saved with the run;
    anything else is called with no arguments."""
    if spec is None:
        raise missing_model_error(model_class)
    if spec == RECORDED:
        factory = recorded_class(model_class, forbidden=forbidden, announce=announce)
        what = f"recorded model class {model_class!r}"
    else:
        factory = resolve_factory(spec)
        what = f"model spec {spec!r}"
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
            raise ModelSpecError(f"{what} could not be built with no arguments: "
                                 f"{type(exc).__name__}: {exc}; pass --model {_SPEC_FORMS}") from exc
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


def say_on_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def resolve_model(model, model_class: str | None, model_config: dict | None = None, *,
                  forbidden=(), announce=say_on_stderr) -> torch.nn.Module:
    """The user's model, however given: an `nn.Module`, a spec string
    (`pkg.mod:factory`, `file.py:factory`, a transformers class such as
    `transformers:AutoModelForCausalLM`, built from `model_config`, or
    `"recorded"`: the recorded class from installed code, with `forbidden`
    folders and the working directory off the import path), or a no-argument
    factory. None is an error that says how to pass one: the run's data
    never chooses the code a replay runs."""
    if isinstance(model, torch.nn.Module):
        return model
    if model is None:
        raise missing_model_error(model_class)
    if isinstance(model, str):
        return build_model(model, model_config, model_class=model_class, forbidden=forbidden, announce=announce)
    if callable(model):
        built = model()
        if not isinstance(built, torch.nn.Module):
            raise ModelSpecError(f"the model factory returned {type(built).__name__}, not a torch.nn.Module")
        return built
    raise ModelSpecError(f"model {model!r} is not a spec, a module or a factory")


def bundle_folders(bundle, run_dir=None) -> list[str]:
    """The folders a replay of `bundle` must never import from: the bundle's
    own, the run holding it when it sits at `bundles/step=N/rank=R`, and
    `run_dir` (a local one)."""
    out = []
    if getattr(bundle, "path", None):
        here = Path(bundle.path)
        out.append(here)
        if (here.name.startswith("rank=") and here.parent.name.startswith("step=")
                and here.parent.parent.name == schema.BUNDLES_DIR):
            out.append(here.parent.parent.parent)
    if run_dir is not None and "://" not in str(run_dir):
        out.append(Path(run_dir))
    return [str(p) for p in out if str(p)]


def saved_model_config(bundle, run_dir=None) -> dict | None:
    """The model config the recorder saved with the run (`model_config` in
    the rank's manifest, else the run's), found from `run_dir` or from the
    bundle's place inside its run (`bundles/step=N/rank=R`); None when
    there is none."""
    import os
    from ..reading.loader import read_manifest
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
