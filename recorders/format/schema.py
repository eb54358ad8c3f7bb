"""The run format, defined once in code.

`docs/FORMAT.md` describes the same thing in prose; `tests/test_schema.py`
keeps the two in step (every table there must list exactly these columns with
these Arrow types). Writers (the recorder) and readers (the analyzer) both
import this module, so a column cannot be renamed on one side only.

Evolution rule: readers ignore columns they do not know; a minor version adds
columns or manifest keys; a new major version changes the meaning of existing
ones and makes older readers refuse the run with an upgrade message.
"""
from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

FORMAT_NAME = "amp-postmortem-run"
SCHEMA_VERSION = "1.5"
SCHEMA_MAJOR = int(SCHEMA_VERSION.split(".")[0])

# The manifest's `framework.name` (since 1.5): which framework's recorder
# wrote the run. A manifest without `framework` was written by the PyTorch
# recorder (every run before 1.5 was).
FRAMEWORKS = ("torch", "keras", "flax")

BUNDLE_FORMAT_NAME = "amp-postmortem-bundle"
BUNDLE_SCHEMA_VERSION = "1.3"

# The replay bundles of the Keras and Flax recorders (since run format 1.5):
# `bundle.json` and one `arrays.npz` whose members are .npy arrays read with
# pickle off (docs/FORMAT.md, "Array bundles"). Same place as a PyTorch
# bundle (`bundles/step=N/rank=R/`), another format name.
ARRAY_BUNDLE_FORMAT_NAME = "amp-postmortem-array-bundle"
# 1.1 added `loss_config` (the Keras loss a backward replay compiles) and
# `step_arguments` (the Flax step's own arguments, for its loss function).
ARRAY_BUNDLE_SCHEMA_VERSION = "1.1"
ARRAY_BUNDLE_ARRAYS_FILE = "arrays.npz"
# `param`: a variable by its run name; `input`: a leaf of the model call's
# arguments; `target`, `sample_weight`: Keras' y and sample weights.
ARRAY_BUNDLE_ROLES = ("param", "input", "target", "sample_weight")

# The manifest key of the lost updates (since 1.5): per low-precision
# parameter, the positions a recorded step asked to move and those it left
# unchanged (`collectors/updates.py`; docs/FORMAT.md, "Manifest").
LOST_UPDATES_KEY = "lost_updates"

# The manifest key of the Keras dtype policies (since 1.5): the model's
# policy and each layer's, read at attach time (docs/FORMAT.md, "Manifest");
# the variables' own dtypes are the manifest's `params`.
DTYPE_POLICIES_KEY = "dtype_policies"

# The manifest key of how a Keras step used its LossScaleOptimizer (since
# 1.5): whether the traced step called `scale_loss`, which optimizer applied
# the gradients, and the measured factor between the gradients applied and
# those of the step's own loss (`recorders/keras_loss_scaling.py`).
LOSS_SCALING_KEY = "loss_scaling"

# The manifest key of the float16/bfloat16 reductions in a JAX step's
# program (since 1.5, Flax runs): the jaxpr read once at the first recorded
# step (`recorders/jax_program.py`), one entry per site: its pattern (one of
# JAX_REDUCTION_PATTERNS), dtypes, values reduced per output and the user's
# source line. Absent: the program was not traced (undetermined, not "none").
JAX_REDUCTIONS_KEY = "jax_reductions"
JAX_REDUCTION_PATTERNS = ("softmax", "log_softmax", "logsumexp", "exp_sum", "sum", "mean", "prod", "cumsum",
                          "cumprod", "cumlogsumexp")

# A counterfactual window (`BundlePolicy(window_steps=K)`): the weights,
# buffers, optimizer and scaler state at a window's first step and every
# step's inputs and RNG since, written when a bundle trigger fires.
WINDOW_FORMAT_NAME = "amp-postmortem-window"
WINDOW_SCHEMA_VERSION = "1.2"  # 1.1: the loop's loss calls (micro_batches[].loss, loss); 1.2: reason lost_updates
# A kept loss call's prediction, in its argument tree (window 1.1):
# {WINDOW_PREDICTION_KEY: i, "shape": [...], "dtype": "float16"}
WINDOW_PREDICTION_KEY = "amp_postmortem.prediction"

# float16 limits the statistics are measured against (IEEE binary16).
FP16_MAX = 65504.0
FP16_MIN_NORMAL = 6.103515625e-05  # 2**-14
FP16_MIN_SUBNORMAL = 5.960464477539063e-08  # 2**-24
# n * absmax**2 at most this: the float32 sums of x and x**2 cannot overflow
# (float32 ends near 2**128), so x is summed as it is, unscaled (`stats.py`,
# `xp_stats.py`: one rule for every framework's statistics).
SQUARES_SAFE = 2.0 ** 120

# The full tier's threshold shares are counted on at most this many values
# per tensor (an evenly strided sample, the same positions every step).
SHARE_SAMPLE_MAX = 65_536

# Names of the pseudo-tensors that are not module outputs.
INPUT_NAME = "<input>"
LOSS_NAME = "<loss>"

# `intermediate`: one operation inside a probed module's forward (the op
# probe, `recorders.ProbeOptions`; since 1.2). Its NaN/Inf are counted in
# the row but are no event: a mask's -Inf inside a module is often meant.
INTERMEDIATE_KIND = "intermediate"
KINDS = ("input", "activation", "grad_output", "grad_input", "param_grad", "param", "loss", INTERMEDIATE_KIND)
PHASES = ("forward", "backward")

# Key-value metadata stamped into every Parquet shard's footer, so a shard
# copied out of its run directory still says what it is.
META_FORMAT = b"amp_postmortem.format"
META_SCHEMA_VERSION = b"amp_postmortem.schema_version"
META_RUN_ID = b"amp_postmortem.run_id"
META_RANK = b"amp_postmortem.rank"
META_WORLD_SIZE = b"amp_postmortem.world_size"
META_TABLE = b"amp_postmortem.table"
META_FIRST_STEP = b"amp_postmortem.first_step"
META_LAST_STEP = b"amp_postmortem.last_step"
META_NONFINITE_ROWS = b"amp_postmortem.nonfinite_rows"


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    unit: str
    description: str
    nullable: bool = True


STEP_COLUMNS: tuple[Column, ...] = (
    Column("step", pa.int64(), "step", "Optimizer step index: counts `rec.step()` calls from 0, or the caller's own step number.", False),
    Column("rank", pa.int32(), "-", "Rank of the process that recorded the row (0 without torch.distributed).", False),
    Column("wall_time", pa.float64(), "s", "Unix time when `rec.step()` was called."),
    Column("loss", pa.float64(), "-", "The loss passed to `rec.step()` (unscaled, as computed), or the micro-batches' captured losses (the sum as backpropagated through the scaler, else the mean the model returned) when none is passed or when one of them was NaN/Inf; NaN/Inf kept as is."),
    Column("loss_scale", pa.float64(), "-", "Loss scale after `scaler.update()`, i.e. the scale the next step uses. Null without an enabled scaler."),
    Column("loss_scale_before", pa.float64(), "-", "Loss scale in force during this step's backward (before `update()`). Null without an enabled scaler."),
    Column("growth_tracker", pa.int64(), "steps", "GradScaler growth tracker after `update()`: clean steps since the last growth or backoff."),
    Column("skipped", pa.bool_(), "-", "True when the scaler found Inf/NaN gradients and the optimizer did not step.", False),
    Column("lr", pa.list_(pa.float64()), "-", "Learning rate of each optimizer parameter group, in group order. Null without an optimizer."),
    Column("grad_norm", pa.float64(), "-", "L2 norm of the unscaled parameter gradients, taken when the last backward pass of the step ended: before any clipping (Inf/NaN when any gradient is non-finite). On disk, this rank's gradients (local shards of sharded ones); the loader combines ranks into the global norm."),
    Column("nonfinite_param_grads", pa.int32(), "params", "Number of parameters whose gradient holds a NaN or Inf."),
    Column("micro_batches", pa.int32(), "-", "Forward passes of the model (in grad mode) aggregated into this step; without a root forward, passes between two backwards."),
    Column("tier", pa.string(), "-", "`cheap` or `full`: which statistics the tensor rows of this step carry; null when the step was not sampled (its step facts only, no tensor rows, unless re-executed: then `full`). Runs before schema 1.5 say `cheap` for such steps."),
    Column("tensor_rows", pa.int32(), "rows", "Number of rows this step wrote to the tensors table."),
    Column("sharded_grad_sqsum", pa.float64(), "-", "Sum of squares of this rank's local shards of sharded (FSDP) gradients, unscaled; part of this rank's `grad_norm`. Null when no gradient is sharded."),
    Column("loss_dtype", pa.string(), "-", "torch dtype of the loss the step backpropagated, e.g. `float16` (a float16 loss under autocast): the first micro-batch's as it went through the scaler (or was handed to `add_loss`), else the one the model returned, else the tensor passed to `rec.step()`. The scale times d(loss)/d(loss) is the backward's first gradient, in this dtype. Null when no loss tensor was seen, and in runs recorded before schema 1.3."),
    Column("reexecuted", pa.bool_(), "-", "True when this step's tensor rows come from a re-execution of the step inside the job (the step was not sampled, its step facts showed an event: the recorder ran its forward and backward again from the held inputs, RNG states, output gradients and weights); its step facts are still the step's own. Null in runs recorded before schema 1.5."),
    Column("reexecution", pa.string(), "-", "How a re-execution asked for by this step's event went: `exact` (the re-executed gradient norm, non-finite gradient count and loss have the recorded bits), `close` (within 1e-3 relative, the same non-finite counts: nondeterministic kernels), `differs` (not reproduced: nondeterminism beyond rounding or a faulty device), `unchecked` (nothing to compare), `refused` (not re-executed; the manifest's `reexecutions` says why). Null when none was asked for."),
)

TENSOR_COLUMNS: tuple[Column, ...] = (
    Column("step", pa.int64(), "step", "Optimizer step index (joins the steps table).", False),
    Column("rank", pa.int32(), "-", "Rank of the process that recorded the row.", False),
    Column("name", pa.string(), "-", "Qualified module name as in `named_modules()` (`\"\"` is the model itself), parameter name as in `named_parameters()`, or `<input>` / `<loss>`.", False),
    Column("kind", pa.string(), "-", "One of `input`, `activation`, `grad_output`, `grad_input`, `param_grad`, `param`, `loss`, `intermediate`.", False),
    Column("phase", pa.string(), "-", "`forward` or `backward`.", False),
    Column("order", pa.int32(), "-", "Position in the phase's execution order within the step (hook firing order, from 0; first micro-batch).", False),
    Column("call", pa.int32(), "-", "Which call of the module within a micro-batch (0 for the first) when a module runs several times per step.", False),
    Column("dtype", pa.string(), "-", "torch dtype of the tensor, e.g. `float16`."),
    Column("numel", pa.int64(), "values", "Number of values summarised (summed over micro-batches and over the tensors of a tuple/dict output)."),
    Column("absmax", pa.float64(), "-", "Largest finite absolute value. Gradients of `grad_output`/`grad_input` rows are the scaled values that travelled; `param_grad` rows are unscaled."),
    Column("nan_count", pa.int64(), "values", "Number of NaN values.", False),
    Column("inf_count", pa.int64(), "values", "Number of +Inf or -Inf values.", False),
    Column("input_nonfinite", pa.int64(), "values", "`activation` rows: NaN/Inf values among the module's tensor inputs (positional and keyword); `grad_input` rows: NaN/Inf values in the gradient the module received at its outputs. Null otherwise."),
    Column("min", pa.float64(), "-", "Full tier: smallest finite value (null in the cheap tier)."),
    Column("max", pa.float64(), "-", "Full tier: largest finite value."),
    Column("mean", pa.float64(), "-", "Full tier: mean of the finite values."),
    Column("rms", pa.float64(), "-", "Full tier: root mean square of the finite values."),
    Column("zero_share", pa.float64(), "fraction", "Full tier: share of values that are exactly zero."),
    Column("below_normal_share", pa.float64(), "fraction", "Full tier: share of non-zero finite values with abs(x) < 6.1035e-5 (float16 subnormal or flushed)."),
    Column("below_subnormal_share", pa.float64(), "fraction", "Full tier: share of non-zero finite values with abs(x) < 5.96e-8 (round to zero in float16)."),
    Column("near_overflow_share", pa.float64(), "fraction", "Full tier: share of finite values with abs(x) >= the recorder's near-overflow threshold (default 65504: would be Inf in float16)."),
    Column("share_sample_size", pa.int64(), "values", "Full tier: number of values the four `*_share` columns were counted on: every value of a tensor up to 65,536, else an evenly strided sample of 65,536 or fewer (the same positions every step); summed like `numel`. Null in the cheap tier and in runs recorded before schema 1.1 (there the shares cover every value)."),
    Column("op", pa.string(), "-", "`intermediate` rows: the aten operation inside the probed module (`name`) whose floating outputs the row summarises, e.g. `aten::bmm`, in the dtype it ran in (`dtype`, after autocast). Null for other kinds and in runs recorded before schema 1.2."),
    Column("op_index", pa.int32(), "-", "`intermediate` rows: the operation's position among the recorded operations of that module call (from 0). Null otherwise."),
    Column("source", pa.string(), "-", "`intermediate` rows: the model's source line that called the operation, `file:line` (relative to the training's working directory when under it); null when only torch's code called it. Null for other kinds."),
)

# Statistic columns filled from the device-side statistic vector, in order.
CHEAP_STATS = ("absmax", "nan_count", "inf_count", "input_nonfinite")
FULL_STATS = CHEAP_STATS + (
    "min", "max", "mean", "rms", "zero_share",
    "below_normal_share", "below_subnormal_share", "near_overflow_share",
    "share_sample_size",
)

BUNDLE_TENSOR_COLUMNS: tuple[Column, ...] = (
    Column("name", pa.string(), "-", "Parameter/buffer name as in `state_dict()`, `args.0` / `kwargs.mask` style path of a model input, `output.<i>` for a gradient, `cpu` / `cuda:<i>` for an RNG state.", False),
    Column("role", pa.string(), "-", "One of `param`, `buffer`, `input`, `grad_output`, `rng`.", False),
    Column("micro_batch", pa.int32(), "-", "Micro-batch index for `input`, `grad_output` and `rng` rows, -1 otherwise.", False),
    Column("dtype", pa.string(), "-", "torch dtype, e.g. `bfloat16`.", False),
    Column("shape", pa.list_(pa.int64()), "-", "Tensor shape.", False),
    Column("requires_grad", pa.bool_(), "-", "Whether the tensor required grad when captured.", False),
    Column("offset", pa.int64(), "bytes", "Position of this row's `data` within the tensor's raw bytes: a tensor larger than 64 MiB is split over several rows, in offset order.", False),
    Column("data", pa.large_binary(), "bytes", "Raw little-endian bytes of the contiguous tensor (bit-exact, also for float16/bfloat16).", False),
)

BUNDLE_ROLES = ("param", "buffer", "input", "grad_output", "rng", "optimizer_state")  # optimizer_state: since 1.2
# How a sharded job's rank holds its part of a parameter (bundle.json
# `params.placements`, since bundle 1.2): `flat`, the flattened parameter's
# `[flat_offset : flat_offset + numel]` (FSDP1, both `use_orig_params`
# settings); `dtensor`, a block at `global_offset` of the row's own shape
# (FSDP2 and other DTensor layouts: Shard(dim), Replicate()).
PLACEMENT_KINDS = ("flat", "dtensor")
# A window's tensors file has the bundle tensor columns; its roles add the
# optimizer's state tensors (`optimizer_state`, named `state.<i>` as
# window.json lists them) and the scaler's (`scaler_state`: `scale`,
# `growth_tracker`). `micro_batch` counts the window's micro-batches from 0.
WINDOW_ROLES = ("param", "buffer", "input", "rng", "optimizer_state", "scaler_state")
# A Parquet byte-array value holds at most 2 GiB; smaller chunks also bound
# the writer's and the reader's memory.
BUNDLE_CHUNK_BYTES = 64 << 20


def arrow_schema(columns: tuple[Column, ...], metadata: dict | None = None) -> pa.Schema:
    return pa.schema(
        [pa.field(c.name, c.type, nullable=c.nullable) for c in columns],
        metadata=metadata,
    )


STEP_SCHEMA = arrow_schema(STEP_COLUMNS)
TENSOR_SCHEMA = arrow_schema(TENSOR_COLUMNS)
BUNDLE_TENSOR_SCHEMA = arrow_schema(BUNDLE_TENSOR_COLUMNS)

# The per-shard index: one small JSON object per shard pair, written beside
# it once both files are complete (`rank=<r>/index/part-N.json`), so that a
# reader learns what a shard holds without opening it. Its keys are typed
# here like columns (JSON numbers, strings, lists and objects).
INDEX_FORMAT_NAME = "amp-postmortem-shard-index"
INDEX_COLUMNS: tuple[Column, ...] = (
    Column("format", pa.string(), "-", "`amp-postmortem-shard-index`.", False),
    Column("schema_version", pa.string(), "-", "Run format version of the shard pair.", False),
    Column("run_id", pa.string(), "-", "Run id, as in the manifest and the shard footers.", False),
    Column("rank", pa.int32(), "-", "Rank that wrote the shard pair.", False),
    Column("shard", pa.string(), "-", "File name of the pair in `steps/` and `tensors/`, e.g. `part-000000.parquet`.", False),
    Column("first_step", pa.int64(), "step", "First step of the pair (inclusive).", False),
    Column("last_step", pa.int64(), "step", "Last step of the pair (inclusive).", False),
    Column("step_rows", pa.int64(), "rows", "Rows of the steps shard.", False),
    Column("tensor_rows", pa.int64(), "rows", "Rows of the tensors shard.", False),
    Column("nonfinite_rows", pa.int64(), "rows", "Tensor rows with `nan_count` or `inf_count` above 0, `intermediate` rows not counted.", False),
    Column("step_bytes", pa.int64(), "bytes", "Size of the steps shard file (a reader that finds another size reads the footer instead).", False),
    Column("tensor_bytes", pa.int64(), "bytes", "Size of the tensors shard file.", False),
    Column("skipped_steps", pa.list_(pa.int64()), "step", "Steps whose optimizer step the scaler skipped.", False),
    Column("nonfinite_loss_steps", pa.list_(pa.int64()), "step", "Steps whose loss was NaN/Inf.", False),
    Column("applied_nonfinite_steps", pa.list_(pa.int64()), "step", "Steps not skipped although a parameter gradient held a NaN/Inf.", False),
    Column("loss_scale_first", pa.float64(), "-", "`loss_scale_before` of the first step (null without an enabled scaler)."),
    Column("loss_scale_last", pa.float64(), "-", "`loss_scale` of the last step."),
    Column("loss_scale_min", pa.float64(), "-", "Smallest `loss_scale` of the pair."),
    Column("loss_scale_max", pa.float64(), "-", "Largest `loss_scale` of the pair."),
    Column("scale_backoffs", pa.int64(), "steps", "Steps where the scale went down (`loss_scale` < `loss_scale_before`).", False),
    Column("first_nonfinite", pa.list_(pa.struct([("name", pa.string()), ("kind", pa.string()),
                                                  ("phase", pa.string()), ("first_step", pa.int64()),
                                                  ("last_step", pa.int64()), ("steps", pa.int64())])),
           "-", "One entry per tensor and kind with a non-finite row in the pair (`intermediate` rows not counted), in the order of their first non-finite row: first and last such step and the number of steps.", False),
)

TABLES = {"steps": STEP_COLUMNS, "tensors": TENSOR_COLUMNS, "bundle tensors": BUNDLE_TENSOR_COLUMNS,
          "shard index": INDEX_COLUMNS}


def parse_version(version: str) -> tuple[int, int]:
    major, _, minor = str(version).partition(".")
    return int(major), int(minor or 0)


# Paths inside a run directory.
MANIFEST_FILE = "manifest.json"
RANK_DIR = "rank={rank}"
STEPS_DIR = "steps"
TENSORS_DIR = "tensors"
SHARD_FILE = "part-{index:06d}.parquet"
INDEX_DIR = "index"
INDEX_FILE = "part-{index:06d}.json"
# The per-step journal of the shard pair not written yet (see
# recorders/journal.py): `rank=<r>/journal/steps/part-N.arrows` and
# `rank=<r>/journal/tensors/part-N.arrows`, Arrow IPC streams with the steps
# and tensors schemas, one record batch per step; N is the number the pair
# will have. The two halves share a file name, as a shard pair does.
JOURNAL_DIR = "journal"
JOURNAL_SUFFIX = ".arrows"
JOURNAL_FILE = "part-{index:06d}" + JOURNAL_SUFFIX
BUNDLES_DIR = "bundles"
BUNDLE_DIR = "step={step}/rank={rank}"
BUNDLE_MANIFEST_FILE = "bundle.json"
BUNDLE_TENSORS_FILE = "tensors.parquet"
WINDOWS_DIR = "windows"
WINDOW_DIR = "step={step}/rank={rank}"   # step: the window's first step
WINDOW_MANIFEST_FILE = "window.json"
WINDOW_TENSORS_FILE = "tensors.parquet"
# The recorder's status slot (reserved at start, overwritten in place) and
# its lease (one writer per rank directory; hidden: readers ignore it).
STATUS_FILE = "status.json"
STATUS_FORMAT = "amp-postmortem-status"
LEASE_FILE = ".writer.lock"
