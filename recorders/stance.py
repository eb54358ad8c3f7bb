"""A compiled model's full-tier steps, run eagerly.

A full-tier step of a compiled model runs eagerly
(`torch.compiler.set_stance("force_eager")`), so that every module's hooks
fire; compiled steps keep their graphs (a stance change neither
invalidates nor recompiles them). `CompileStance` holds whether the model
is compiled, the stance to restore, and the root's two hooks that hold the
stance for its forwards only.

The two options of a compiled job (`AmpRecorder(eager_full_steps=,
compiled_rows=)`):
- `eager_full_steps` (default True): full-tier steps run eagerly, process
  wide while the stance holds (during the model's forwards when the recorder
  is attached to the compiled module, from the previous `step()` when
  attached before compiling: see `enter_tier`), so they record the full
  tier's statistics; such a step computes with eager rounding, which a
  backend like inductor may not share. False: every step stays compiled.
- `compiled_rows` (default False): the cheap tier's rows of every watched
  module are computed inside the compiled graph on every recorded step
  (`collectors.graph_stats`). Off by default: on the CPU it cost 1.08x to
  1.2x the compiled step of the benchmark GPT (`benchmarks/RESULTS.md`), and
  the statistics, which read tensors only, give the compiler more consumers
  of them, which can change its fusion and so the training's rounding by a
  bit. Without it compiled steps carry the loss, the loss scale and the
  parameter gradients, and per-module rows come from the eager full-tier
  steps; with `eager_full_steps=False` too the training is bit-identical to
  the compiled job's without the recorder.
"""
from __future__ import annotations

COMPILED_STEPS_RECORD = (
    "the cheap tier's rows of every watched module (activation, grad_output, grad_input, <input>), "
    "computed by tensor operations inside the compiled graph (inductor's fused rounding), one row "
    "per module and kind (call 0: a module's calls merged), min/max/mean/rms and the shares null; "
    "loss, loss scale, skipped, parameter gradients (param_grad rows, grad_norm) as eager")

COMPILED_STEPS_WITHOUT_ROWS = (
    "loss, loss scale, skipped, parameter gradients (param_grad rows, grad_norm) and, with the "
    "recorder attached to the compiled module, the model's inputs and outputs (compiled_rows=False: "
    "no statistic inside the graph)")


class CompileStance:
    """`eager_full_steps`: run full-tier steps of a compiled model eagerly;
    `compiled_rows`: the cheap rows are computed inside the graph (for the
    manifest's words); `guard`: the recorder's `FailureGuard`."""

    def __init__(self, *, eager_full_steps: bool, compiled_rows: bool, guard, compiled: bool = False):
        self.eager_full_steps = bool(eager_full_steps)
        self.compiled_rows = bool(compiled_rows)
        self.guard = guard
        # Known when attached (an OptimizedModule), else found at a recorded step (`found_compiled`).
        self.compiled = bool(compiled)
        self._prior_stance = None  # the compiler stance to restore after an eager step
        # Whether the next forwards of the model run eagerly (a full-tier step
        # of a compiled model whose root's hooks run outside its graph).
        self._eager_forwards = False
        self._handles: list = []

    def enter_tier(self, tier) -> None:
        """The stance is the whole process's: every compiled function runs
        eagerly while it holds. Where the root's hooks run outside the
        compiled graph (the recorder attached to the compiled module), it
        holds only during the root's forwards (`register_hooks`), so that
        other compiled code (a compiled loss or optimizer step, an EMA or
        evaluation model, another recorded job) keeps its graphs. Attached
        before compiling, the root's hooks run inside the graph, too late to
        choose it: the stance then holds from the previous `step()` to this
        step's."""
        full = self.compiled and self.eager_full_steps and tier == "full"
        if self._handles:
            self._eager_forwards = full
            return
        if full:
            self._force_eager()

    def _force_eager(self) -> None:
        if self._prior_stance is None:
            from torch._dynamo import eval_frame
            self._prior_stance = eval_frame._set_stance(eval_frame.DynamoStance("force_eager"))

    def register_hooks(self, model) -> None:
        """The root's forwards of a full-tier step run eagerly: only for a
        model compiled before it was attached whose own hooks run outside
        the graph (an `OptimizedModule`, or a wrapper around one; not
        `module.compile()`, whose hooks are compiled with it)."""
        if not (self.compiled and self.eager_full_steps) or getattr(model, "_compiled_call_impl", None) is not None:
            return

        def enter(module, args):
            if self._eager_forwards:
                self._force_eager()

        def leave(module, args, output):
            self.leave_tier()
        wrap = self.guard.wrap
        self._handles = [model.register_forward_pre_hook(wrap(enter, traced=False), prepend=True),
                         model.register_forward_hook(wrap(leave, traced=False), always_call=True)]

    def leave_tier(self) -> None:
        if self._prior_stance is None:
            return
        from torch._dynamo import eval_frame
        prior, self._prior_stance = self._prior_stance, None
        eval_frame._set_stance(prior)

    def found_compiled(self, finished) -> bool:
        """A recorded step a traced hook wrote in-graph statistics for, or
        whose gradients arrived with no forward hook run: the model ran as a
        compiled graph, compiled after the recorder was attached. True the
        first time."""
        if self.compiled or not finished.record or not (
                finished.graph_values is not None or (finished.micro_batches == 0 and finished.param_grads)):
            return False
        self.compiled = True
        return True

    def remove(self) -> None:
        self.leave_tier()
        self._eager_forwards = False
        for h in self._handles:
            h.remove()
        self._handles = []

    def info(self) -> dict | None:
        """The manifest's `compiled` entry (None: not compiled)."""
        if not self.compiled:
            return None
        return {"detected": True,
                "compiled_steps": COMPILED_STEPS_RECORD if self.compiled_rows else COMPILED_STEPS_WITHOUT_ROWS,
                "eager_steps": ("full-tier steps run eagerly (torch.compiler.set_stance('force_eager')) "
                                "and carry every row of an eager run, computed with eager rounding"
                                if self.eager_full_steps else "none (eager_full_steps=False)")}
