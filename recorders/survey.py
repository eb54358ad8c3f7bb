"""What the recorder watches of a model, surveyed once at attach time.

Names are the user's model's, whatever wraps it (compile, DDP, FSDP,
checkpoint wrappers); hooks go on the wrapped modules, except the root's,
which stay on the outermost module: the only one that runs eagerly around a
compiled model.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from .layout import (canonical_modules, canonical_parameters, fsdp1_flat_views, is_distributed_wrapper,
                     sharded_param_ids)


@dataclass
class ModelSurvey:
    modules: list          # (name, module), `named_modules()` order, each module once
    module_names: dict     # module -> name
    watched: list          # the names hooked ("" always: the root)
    params: list           # (name, parameter)
    sharded: set           # ids of parameters held as local shards
    flat_views: list       # (name, FlatView): FSDP1 without use_orig_params
    distributed: bool      # DDP/FSDP: a forward or backward takes part in collectives


def name_filter(include, exclude):
    """`include`/`exclude` glob patterns (a string or a sequence) as a
    predicate on module and parameter names."""
    include = tuple([include] if isinstance(include, str) else include)
    exclude = tuple([exclude] if isinstance(exclude, str) else exclude)

    def matches(name: str) -> bool:
        if not any(fnmatch.fnmatchcase(name, p) for p in include):
            return False
        return not any(fnmatch.fnmatchcase(name, p) for p in exclude)
    matches.include, matches.exclude = include, exclude
    return matches


def survey_model(model, matches) -> ModelSurvey:
    modules = canonical_modules(model)
    module_names = {m: name for name, m in modules}
    params = canonical_parameters(modules)
    sharded = sharded_param_ids(model, params)
    # FSDP1 without use_orig_params: the parameters as slices of the flat
    # parameters, recorded and described like the others.
    flat_views = fsdp1_flat_views(model, module_names)
    sharded |= {id(v) for _, v in flat_views if v.sharded}
    return ModelSurvey(modules=modules, module_names=module_names,
                       watched=[name for name, _ in modules if name == "" or matches(name)],
                       params=params, sharded=sharded, flat_views=flat_views,
                       distributed=bool(sharded or flat_views) or is_distributed_wrapper(model))
