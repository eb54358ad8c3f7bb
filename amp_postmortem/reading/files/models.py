"""One declared model per JSON file kind the analyzer reads: the run and
rank manifests, the per-shard index, bundle.json and its argument trees.

pydantic (v2) validates them: a wrong type anywhere is one message naming
the field's path (`world_size`, `micro_batches.0.args.items.2`) and what is
valid, instead of a TypeError deep in an analysis. Every model allows keys
it does not know (the format's evolution rule: readers ignore unknown
fields) and types only the fields the analyzer uses; strict types, so
`"2"` is not a rank and `true` is not a count.
"""
from __future__ import annotations

import math
import re
from typing import Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from .limits import MAX_WORLD_SIZE
from .safe import shown

Number = Union[StrictInt, StrictFloat]  # NaN and Infinity included: the recorder keeps them
Count = Annotated[StrictInt, Field(ge=0)]
Rank = Annotated[StrictInt, Field(ge=0, lt=MAX_WORLD_SIZE)]
Positive = Annotated[Number, Field(gt=0, allow_inf_nan=False)]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


# ------------------------------------------------------------ manifests
class _Autocast(_Open):
    enabled: StrictBool | None = None
    device_type: StrictStr | None = None
    dtype: StrictStr | None = None


class _Scaler(_Open):
    enabled: StrictBool | None = None
    # Any of them may be missing or null (a scaler-like object without the
    # attribute): readers say "?" or leave the step it informs out.
    init_scale: Positive | None = None
    growth_factor: Positive | None = None
    backoff_factor: Positive | None = None
    growth_interval: Count | None = None


class _Param(_Open):
    name: StrictStr
    sharded: StrictBool | None = None
    aliases: list[StrictStr] | None = None


class _Module(_Open):
    name: StrictStr
    watched: StrictBool | None = None


class _BundleEntry(_Open):
    step: StrictInt
    rank: Rank | None = None
    reason: StrictStr | None = None
    reasons: list[StrictStr] | None = None


class _Storage(_Open):
    spool_dropped_steps: Count | None = None


class RunManifest(_Open):
    """manifest.json of a run or of one rank (docs/FORMAT.md, "Manifest")."""
    format: StrictStr | None = None
    schema_version: StrictStr | None = None
    run_id: StrictStr | None = None
    rank: Rank | None = None
    world_size: Annotated[StrictInt, Field(ge=0, le=MAX_WORLD_SIZE)] | None = None
    status: StrictStr | None = None
    dropped_steps: Count | None = None
    disabled_reason: StrictStr | None = None
    disabled_at_step: StrictInt | None = None
    storage: _Storage | None = None
    autocast: _Autocast | None = None
    scaler: _Scaler | None = None
    params: list[_Param] | None = None
    modules: list[_Module] | None = None
    bundles: list[_BundleEntry] | None = None
    model_class: StrictStr | None = None
    model_config_: dict | None = Field(default=None, alias="model_config")
    device_type: StrictStr | None = None


# ---------------------------------------------------------- shard index
class _FirstNonfinite(_Open):
    name: StrictStr
    kind: StrictStr
    phase: StrictStr | None = None
    first_step: StrictInt
    last_step: StrictInt
    steps: Count


class ShardIndex(_Open):
    """index/part-N.json (docs/FORMAT.md, "Table: shard index"); `format`
    and `rank` are checked by the reader first (another file's JSON is
    ignored, not refused)."""
    schema_version: StrictStr
    run_id: StrictStr | None = None
    shard: StrictStr
    first_step: StrictInt
    last_step: StrictInt
    step_rows: Count
    tensor_rows: Count
    nonfinite_rows: Count
    step_bytes: Count
    tensor_bytes: Count
    skipped_steps: list[StrictInt] | None = None
    nonfinite_loss_steps: list[StrictInt] | None = None
    applied_nonfinite_steps: list[StrictInt] | None = None
    loss_scale_first: Number | None = None
    loss_scale_last: Number | None = None
    loss_scale_min: Number | None = None
    loss_scale_max: Number | None = None
    scale_backoffs: Count | None = None
    first_nonfinite: list[_FirstNonfinite] | None = None


# ------------------------------------------------------- argument trees
# The devices a replay can put a tensor on; anything else ("cuda:banana",
# "xla:0") is refused here, not by torch's parser halfway through a replay.
DEVICE = re.compile(r"(cpu|cuda|mps|xpu|meta)(:(0|[1-9][0-9]{0,3}))?", re.ASCII)


def _device(value: str) -> str:
    if not DEVICE.fullmatch(value):
        raise ValueError("not a device a replay can use (valid: cpu, cuda, mps, xpu or meta, "
                         "optionally with :<index>, e.g. cuda:0)")
    return value


class _TensorNode(_Open):
    kind: Literal["tensor"]
    name: StrictStr


class _ValueNode(_Open):
    kind: Literal["value"]
    value: StrictBool | StrictInt | StrictFloat | StrictStr | None = None


class _DtypeNode(_Open):
    kind: Literal["dtype"]
    value: StrictStr


class _DeviceNode(_Open):
    kind: Literal["device"]
    value: Annotated[StrictStr, AfterValidator(_device)]


class _SequenceNode(_Open):
    kind: Literal["list", "tuple"]
    items: list["ArgNode"]


class _DictNode(_Open):
    kind: Literal["dict"]
    # [key, node] pairs: JSON has lists, not tuples (hence the pair alone lax).
    items: list[Annotated[tuple[StrictBool | StrictInt | StrictFloat | StrictStr | None, "ArgNode"], Strict(False)]]


class _UnsupportedNode(_Open):
    kind: Literal["unsupported"]


ArgNode = Annotated[Union[_TensorNode, _ValueNode, _DtypeNode, _DeviceNode, _SequenceNode, _DictNode,
                          _UnsupportedNode], Field(discriminator="kind")]
_SequenceNode.model_rebuild()
_DictNode.model_rebuild()


# ----------------------------------------------------------- bundle.json
class _Rng(_Open):
    cpu: StrictStr
    cuda: list[StrictStr] = []


class _MicroBatch(_Open):
    args: ArgNode
    kwargs: ArgNode
    grad_outputs: list[StrictStr | None]
    rng: _Rng


class _Placement(_Open):
    """Where a rank's shard sits in the whole parameter (a sharded job's)."""
    kind: StrictStr  # "flat" or "dtensor"; another kind is refused when the shards are reassembled
    global_shape: list[Count]
    flat_offset: Count | None = None
    numel: Count | None = None
    global_offset: list[Count] | None = None


class _Params(_Open):
    names: list[StrictStr]
    aliases: dict[str, StrictStr] = {}
    exact: StrictBool
    placements: dict[str, _Placement] | None = None


class _Buffers(_Open):
    names: list[StrictStr]
    non_persistent: list[StrictStr] = []
    exact: StrictBool


# What a replay takes from a bundle to run the step as it ran: an autocast
# device type or dtype it cannot enter, or a loss scale that is not a
# positive number, would otherwise replay a different step without a word.
AutocastDevice = Literal["cpu", "cuda", "mps", "xpu", "hpu", "xla"]
AutocastDtype = Literal["float16", "bfloat16", "float32"]


class _BundleAutocast(_Open):
    enabled: StrictBool
    device_type: AutocastDevice | None = None
    dtype: AutocastDtype | None = None
    cache_enabled: StrictBool | None = None


class _BundleScaler(_Open):
    enabled: StrictBool | None = None
    scale: Positive | None = None
    scale_after: Positive | None = None
    init_scale: Positive | None = None
    growth_factor: Positive | None = None
    backoff_factor: Positive | None = None
    growth_interval: Count | None = None
    growth_tracker: Count | None = None
    growth_tracker_after: Count | None = None


class _PrecisionFlags(_Open):
    allow_tf32_matmul: StrictBool | None = None
    allow_tf32_cudnn: StrictBool | None = None
    fp16_reduced_precision_reduction: StrictBool | None = None
    bf16_reduced_precision_reduction: StrictBool | None = None
    float32_matmul_precision: Literal["highest", "high", "medium"] | None = None
    deterministic_algorithms: StrictBool | None = None
    deterministic_warn_only: StrictBool | None = None
    cudnn_enabled: StrictBool | None = None
    cudnn_benchmark: StrictBool | None = None
    cudnn_deterministic: StrictBool | None = None


class _ParamGroup(_Open):
    params: list[StrictStr] | None = None


class _Optimizer(_Open):
    defaults: dict | None = None
    param_groups: list[_ParamGroup] | None = None


class _File(_Open):
    bytes: Count
    sha256: StrictStr


class BundleMeta(_Open):
    """bundle.json (docs/FORMAT.md, "`bundle.json`"); `format`, `version`
    and `checksum` are checked by the reader first."""
    run_id: StrictStr | None = None
    step: StrictInt
    rank: Rank
    world_size: Annotated[StrictInt, Field(ge=0, le=MAX_WORLD_SIZE)] | None = None
    reason: StrictStr
    reasons: list[StrictStr] | None = None
    loss: Number | None = None
    loss_scale: Positive | None = None
    grad_outputs_scaled: StrictBool | None = None
    training: StrictBool | None = None
    micro_batches: Annotated[list[_MicroBatch], Field(min_length=1)]  # a saved step ran at least one forward
    params: _Params
    buffers: _Buffers
    inputs_exact: StrictBool
    autocast: _BundleAutocast | None = None
    precision_flags: _PrecisionFlags | None = None
    scaler: _BundleScaler | None = None
    model_class: StrictStr
    optimizer: _Optimizer | None = None
    env: dict | None = None
    files: dict[str, _File]


# ----------------------------------------------------------- window.json
class _WindowMicroBatch(_Open):
    index: Count
    args: ArgNode
    kwargs: ArgNode
    rng: _Rng


class _WindowStep(_Open):
    step: StrictInt
    stepped: StrictBool | None = None
    micro_batches: Annotated[list[_WindowMicroBatch], Field(min_length=1)]
    optimizer_groups: list[dict] | None = None


class _WindowNames(_Open):
    names: list[StrictStr]
    aliases: dict[str, StrictStr] = {}
    non_persistent: list[StrictStr] = []


class _StateEntry(_Open):
    param: StrictStr
    key: StrictStr
    tensor: StrictStr | None = None


class _WindowOptimizer(_Optimizer):
    state: list[_StateEntry] = []


class _WindowScaler(_BundleScaler):
    tensors: list[Literal["scale", "growth_tracker"]] = []


class WindowMeta(_Open):
    """window.json (docs/FORMAT.md, "Counterfactual windows"); `format`,
    `version` and `checksum` are checked by the reader first."""
    run_id: StrictStr | None = None
    rank: Rank
    first_step: StrictInt
    last_step: StrictInt
    trigger_step: StrictInt | None = None
    reasons: list[StrictStr] = []
    inputs_exact: StrictBool
    training: StrictBool | None = None
    params: _WindowNames
    buffers: _WindowNames
    optimizer: _WindowOptimizer | None = None
    scaler: _WindowScaler | None = None
    autocast: _BundleAutocast | None = None
    precision_flags: _PrecisionFlags | None = None
    model_class: StrictStr
    steps: Annotated[list[_WindowStep], Field(min_length=1)]
    env: dict | None = None
    files: dict[str, _File]


def validate(model: type[BaseModel], doc, where, error) -> dict:
    """`doc` itself when it fits `model`; else `error` with one line:
    `<file>: <field>: <what is wrong, what is valid>`."""
    try:
        model.model_validate(doc)
    except ValidationError as exc:
        raise error(describe(exc, where)) from None
    return doc


def describe(exc: ValidationError, where) -> str:
    e = exc.errors(include_url=False)[0]
    # A union adds the member's type to the path (`loss.int`): left out.
    loc = [str(p) for p in e["loc"] if not (isinstance(p, str) and p in _UNION_MEMBERS)] or ["(top level)"]
    field = ".".join(loc).replace("model_config_", "model_config")
    got = e.get("input")
    got = "" if e["type"] == "missing" else f", got {_short(got)}"
    msg = e["msg"].removeprefix("Value error, ")
    return f"{shown(where)}: {field}: {msg}{got}"


_UNION_MEMBERS = {"bool", "int", "float", "str", "none", "function-after", "constrained-str"}


def _short(value) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
