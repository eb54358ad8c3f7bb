"""The state the collectors share: the step in progress and its rows.

A row is `meta` (name, kind, phase, order, call, dtype, numel, inputs) and
`stats` (the statistics vector, `stats.row_stats`); `input_nonfinite` is
not computed on the training path: `inputs` names the rows holding the
inputs' NaN/Inf counts and the writer thread adds them up
(`aggregate.fill_input_nonfinite`), so a module costs no tensor op beyond
its own statistics.
"""
from __future__ import annotations

import weakref
from types import MappingProxyType

import torch

from ..layout import PLAIN_TENSORS, local
from ..full_stage import FullRow, FullStage, resolve
from ..staged_stats import StatsStage
from ..stats import cheap_host_stats, row_stats


class CallContext:
    """One forward call of a watched module, kept alive by its backward hooks."""

    __slots__ = ("name", "call", "input_rows", "grad_out_rows", "pending",
                 "is_root", "micro_batch", "step_id", "no_grad")

    def __init__(self, name, call, input_rows, is_root, micro_batch, step_id):
        self.name = name
        self.call = call
        self.input_rows = input_rows  # rows holding the inputs' NaN/Inf counts (None: no input)
        self.grad_out_rows = None  # rows of the gradients that reached the outputs so far
        self.pending = {}  # input index -> [expected, arrived, parts]
        self.is_root = is_root
        self.micro_batch = micro_batch
        self.step_id = step_id
        # Ran under no_grad inside a recorded forward (a reentrant
        # checkpoint region): its backward hooks are set in the recompute.
        self.no_grad = not torch.is_grad_enabled()


class StepState:
    """What the collectors gathered during one optimizer step (training thread).

    Made once a step: its immutable starting values are class attributes
    (an instance sets only what it changes), the containers its own; half
    the attribute stores of a plain `__init__`, on the path of every step."""

    micro_batches = 0
    forward_open = False  # a micro-batch's forward ran, its backward not yet
    opened_by_child = False  # ... and a submodule, not the root, opened it
    micro_batch_start = None  # (rows, contexts) before the micro-batch in progress
    fwd_order = 0
    bwd_order = 0
    last_sum = None  # (weak refs to the parts, their sum): the last grad_input summed
    stepped = False
    grad_sqsum = None  # square sum of this rank's unscaled gradients (local shards), on the device
    sharded_sqsum = None  # its part from the local shards of sharded gradients
    grad_nonfinite = None  # how many of those gradients hold a NaN/Inf (sharded jobs), on the device
    grad_norms = None  # else each gradient's norm (scaled as they were), on the device ...
    grad_norm_names = None  # ... their parameters' names ...
    # ... and whether they are to be divided by the loss scale the step's
    # backward used (the scale tensor, never read: None when unscaled already)
    grad_scale = None
    # On the CPU: the norms' square sum, a host float (finite exactly
    # when every norm is), taken with them; None elsewhere.
    grad_sq_host = None
    backward_task = None  # the autograd graph task whose end is awaited
    backward_passes = 0  # ended backward passes (counts micro-batches a compiled forward hides)
    in_forward = 0  # depth of root forwards being recorded (checkpointing's no_grad regions count)
    device = None
    # Compiled modules: the in-graph statistics' buffer of the step
    # (graph_stats.GraphStats.take; None: no graph wrote it), and the
    # forward order of the eager row a graph's forward rows come before.
    graph_values = None
    graph_anchor = None

    # A step not recorded (most steps) gathers no rows: its containers are
    # these empty, read-only ones (a write raises, and the guard says so),
    # until `containers()` (a step raised to the full tier) makes its own.
    meta = stats = contexts = param_values = leaf_hooks = ()
    calls = stacks = recompute_stacks = param_grads = producers = walks = node_watches = noted_grads = \
        MappingProxyType({})
    producers_walked = False  # a forward's graph was searched for parameters' gradients (`hook_producers`)
    grads_read = None  # the CPU gradients the norms read (`ParamGradCollector._measure_grad_norm`)

    def __init__(self, step_id: int, record: bool, full: bool):
        self.step_id = step_id
        self.record = record
        self.full = full
        if record:
            self.containers()

    def containers(self) -> None:
        """The step's own containers (a recorded step's)."""
        self.meta: list[tuple] = []
        self.stats: list = []  # host tuples or device vectors (stats.row_stats)
        self.calls: dict[str, int] = {}
        self.stacks: dict[str, list] = {}
        self.recompute_stacks: dict[str, list] = {}  # reentrant recomputation: (context, input edges)
        self.param_grads: dict[str, list] = {}  # name -> [order, stats, None, dtype name, numel]
        self.contexts: list[CallContext] = []
        self.producers: dict[int, tuple] = {}  # id(tensor) -> (weakref, row of its statistics)
        # output node of a watched module's call -> (its walk's boundary, the
        # edges that left its walk): see BackwardCollector.watch_call. Held
        # for one forward (node objects, not their saved tensors).
        self.walks: dict = {}
        # autograd node -> the calls watching it (backward._NodeWatch), for
        # one forward: calls sharing a node share its hooks.
        self.node_watches: dict = {}
        self.param_values: list[tuple] = []
        # The gradient hooks put on leaf tensors a watched module returned
        # (a parameter, an input): a leaf outlives the step, and so would
        # they (`BackwardCollector.end_step` removes them).
        self.leaf_hooks: list = []
        # name -> parameter whose gradient the step's graph hands it
        # (ParamGradCollector.hook_producers): read when a backward pass ends.
        self.noted_grads: dict = {}


class TensorInfo:
    """dtype and numel of a tensor, without keeping the tensor alive."""

    __slots__ = ("dtype", "_numel")

    def __init__(self, t):
        self.dtype = t.dtype
        self._numel = local(t).numel()

    def numel(self):
        return self._numel


_DTYPE_NAMES: dict = {}


def dtype_name(dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


# The autograd graph task running on this thread (-1: none), or None on a torch without it.
GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """Inside a backward pass (activation checkpointing re-runs forwards
    there). An older torch without the call: False (record recomputations
    too)."""
    return GRAPH_TASK_ID is not None and GRAPH_TASK_ID() != -1


# The node that accumulates a leaf's gradient (its type: torch has no Python name for it).
ACCUMULATE_GRAD = getattr(getattr(torch._C, "_functions", None), "AccumulateGrad", None)


# The keywords of `Shared.stats` the stage serves (a gradient unscaled by the
# loss scale); any other takes the general path.
_STAGED_OPTIONS = frozenset(("scale", "unscale"))


class Shared:
    """What every collector reads: the step in progress (`state`, replaced
    each step), the `paused()` depth, the options of the statistics, the
    recorder's guards and the bundle capture (its `on_*` hooks).

    `guard(fn)` wraps a long-lived hook (an exception turns recording off,
    never the training); `guard_call(fn, a, b)` is the same for the
    backward hooks set anew for every module call, as one small object.
    `stage`: where the cheap tier's statistics of small device tensors wait
    to be reduced together (`staged_stats`), flushed at each step's end
    (`flush_stage`); `full_stage`: the same for the full tier's rows of
    small CPU tensors (`full_stage`)."""

    def __init__(self, *, near_overflow: float, guard, guard_call, bundles):
        self.state = StepState(0, False, False)
        self.paused = 0
        self.near_overflow = near_overflow
        self.guard = guard
        self.guard_call = guard_call
        self.bundles = bundles
        self.stage = StatsStage()
        self.full_stage = FullStage(near_overflow)

    def add_row(self, st, name, kind, phase, order, call, t, stats, inputs=None) -> int:
        """Append a row for tensor `t`; `inputs`: the rows whose NaN/Inf
        counts add up to its `input_nonfinite` (None: null). Returns the
        row's index."""
        dtype = _DTYPE_NAMES.get(t.dtype) or dtype_name(t.dtype)
        numel = t.numel() if type(t) in PLAIN_TENSORS else local(t).numel()
        return self.append_row(st, name, kind, phase, order, call, dtype, numel, stats, inputs)

    @staticmethod
    def append_row(st, name, kind, phase, order, call, dtype: str, numel: int, stats, inputs=None) -> int:
        """`add_row` with the tensor's dtype name and size given (a
        gradient that may be freed before the row is added)."""
        st.meta.append((name, kind, phase, order, call, dtype, numel, inputs))
        rows = st.stats
        rows.append(stats)
        if st.device is None and type(stats) is not tuple and type(stats) is not FullRow:
            st.device = stats.device
        return len(rows) - 1

    def stats(self, st, t, **kw):
        if not kw and not st.full and type(t) in PLAIN_TENSORS and t.is_cpu and not self.stage.on_cpu:
            # The usual row, without the general path's keyword call.
            values = cheap_host_stats(t)
            if values is not None:
                return values
        if kw.keys() <= _STAGED_OPTIONS and (not kw or kw.get("unscale")):
            scale = kw.get("scale")
            staged = (self.full_stage if st.full else self.stage).put(t, scale)
            if staged is not None:
                return staged
        return row_stats(t, full=st.full, near_overflow=self.near_overflow, **kw)

    def count_stats(self, st, t):
        """The cheap statistics of an input no watched row produced: only
        its NaN/Inf counts are read (a count-only row)."""
        if not st.full:
            return self.stats(st, t)  # the cheap tier's row: host path, stage or general path
        return row_stats(t, full=False, near_overflow=self.near_overflow)

    @property
    def staged(self) -> bool:
        """A row of the step waits in a stage for its values (`flush_stage`)."""
        full = self.full_stage
        return bool(self.stage.rows or full.rows or full.unresolved)

    def flush_stage(self) -> None:
        """Give every staged row of the step its values (device work;
        the full tier's, host values in their places in the step's rows).
        Tested here, not in each stage: a step not sampled has none, and
        this runs at every step's end."""
        if self.stage.rows:
            self.stage.flush()
        full = self.full_stage
        if full.rows or full.unresolved:
            self.flush_full()

    def flush_full(self) -> None:
        """The full tier's staged rows, their values in their places in
        the step's rows (host work; before anything reads those rows)."""
        stage = self.full_stage
        stage.flush()
        if stage.unresolved:
            stage.unresolved = False
            resolve(self.state)

    @staticmethod
    def note_producer(st, t, row):
        try:
            st.producers[id(t)] = (weakref.ref(t), row)
        except TypeError:
            pass
