"""Run one saved training step under a chosen precision and capture it.

A `ReplaySession` holds a bundle and the user's model with the bundle's
weights loaded; `session.run(config)` re-runs the step's forward and backward
and returns a `StepCapture`: every module call's floating outputs and the
gradients that reached them, the model outputs and the parameter gradients.

Precision semantics (`RunConfig.precision`):
- `fp64`: model, buffers and floating inputs in float64, autocast off. The
  reference every other run is compared with.
- `fp32`: float32, autocast off, TF32 off.
- `fp16` / `bf16`: float32 master weights under an autocast policy (the
  recorded device's by default), native autocast when replaying on that
  device type, emulated otherwise (see `policy.py`). The backward starts from
  the bundle's gradients of the loss w.r.t. the outputs times the loss scale,
  because the scaled gradient is what travelled in training; captured
  gradients stay scaled and `StepCapture.loss_scale` says by how much. Only
  the outputs no other output was computed from are seeds (`outputs.py`: a
  loss computed inside the model is the one start, as in training: its seed
  is the scale in the loss's own dtype). With `backward_from_loss` and a
  `loss_fn`, the backward starts from loss_fn's loss computed under autocast,
  times a float32 scale as `GradScaler.scale` multiplies it;
  `StepCapture.backward_from` says which start a run used.

What-if replays change a `RunConfig`, not the engine: `fp32_modules` runs
the named modules in float32 (inputs cast up, autocast and its emulation off
inside them), `fp32_lines` the named source lines of the model (`fp32_lines.py`:
the op-level patch of `fix`), `loss_scale` replays the backward at another scale, `batch`
replays a slice of the batch (indices along dimension 0), and
`running_statistics` runs the modules that normalise over the batch
(`batch_statistics_modules`: BatchNorm in training) on their running
statistics, as in eval mode, so that a one-sample slice is valid.
"""
from __future__ import annotations

import copy
from contextlib import ExitStack, contextmanager

import torch

from recorders.format.tensors import iter_tensors

from ..errors import ModelSpecError, PostmortemError
from ..names import BackwardFrom, BackwardStart
from .capture import (AnomalyCatcher, BackwardWatch, CallRecorder, ModuleCall, StepCapture, is_floating, map_tensors,
                      round_to, stateful_copy)
from .fp32_lines import float32_lines
from .model_spec import load_weights
from .op_cost import ReducedWork
from .outputs import backward_roots, find_loss
from .run_config import (DTYPES, POLICY_MODES, PRECISION_OF_DTYPE, PRECISIONS, RunConfig, autocast_device_types,
                         autocast_for, float32_region, numerics_flags, preserved_rng, set_rng)

# The configuration and contexts live in run_config.py; their names stay importable from here.
__all__ = ["ReplaySession", "RunConfig", "StepCapture", "ModuleCall", "PRECISIONS", "DTYPES",
           "PRECISION_OF_DTYPE", "POLICY_MODES", "float32_region", "numerics_flags", "preserved_rng",
           "set_rng", "autocast_for", "fp32_modules_kept", "substitute_mean", "is_floating"]


def _widen(t):
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


@contextmanager
def fp32_modules_kept(model: torch.nn.Module, names, device_types):
    """Run the named submodules in float32 (floating inputs cast up)."""
    patched = []
    try:
        for name in names:
            try:
                module = model.get_submodule(name)
            except AttributeError:
                raise ModelSpecError(f"fp32 module {name!r} is not a submodule of the model") from None
            original = module.forward

            def forward(*args, __f=original, **kwargs):
                with float32_region(*device_types):
                    return __f(*map_tensors(args, _widen), **map_tensors(kwargs, _widen))
            patched.append((module, module.__dict__.get("forward")))
            module.forward = forward
        yield
    finally:
        for module, own in reversed(patched):
            if own is None:
                del module.forward
            else:
                module.forward = own  # the model had patched its own forward


# ---------------------------------------------------------------- session
class ReplaySession:
    """A bundle and the user's model, ready to be run under any `RunConfig`.

    The model is never changed: one deep copy per weight dtype holds the
    bundle's weights, reloaded before every run so that buffers updated by a
    run (BatchNorm statistics) never leak into the next.
    """

    def __init__(self, bundle, model: torch.nn.Module, *, device: str = "cpu"):
        self.bundle = bundle
        self.device = torch.device(device)
        base = copy.deepcopy(model)
        load_weights(base, {**bundle.state_dict(), **(getattr(bundle, "extra_buffers", None) or {})})
        self._state = {k: v.detach().clone() for k, v in base.state_dict().items()}
        self._base = base
        self._models: dict = {}
        self.training = bool(bundle.meta.get("training", True)) if isinstance(bundle.meta, dict) else True
        # Where every backward starts: d(loss)/d(outputs), unscaled, per micro-batch.
        self.grad_outputs = list(bundle.grad_outputs)
        self.saved_grad_nonfinite = self.grad_outputs_nonfinite and self._nonfinite_at_roots()
        self.backward_start = BackwardStart.SAVED
        if self.saved_grad_nonfinite:
            self.grad_outputs = substitute_mean(self.grad_outputs)
            self.backward_start = BackwardStart.SUBSTITUTE_MEAN

    @property
    def grad_outputs_nonfinite(self) -> int:
        """NaN/Inf values in the output gradients the backward starts from."""
        return sum(int((~torch.isfinite(g)).sum()) for mb in self.grad_outputs for g in mb if g is not None)

    def _nonfinite_at_roots(self) -> int:
        """NaN/Inf values in the saved gradients of the outputs a backward
        starts from (`backward_roots`): the NaN logits gradient of a model
        whose own loss is NaN does not matter when the loss, whose gradient
        is the loss scale, is the start. Finds the roots with one float64
        forward; a model that fails it counts every output (the run says why)."""
        config = RunConfig("fp64", device=str(self.device))
        model = self.model(torch.float64)
        bad = 0
        try:
            with preserved_rng(self.device), numerics_flags(config):
                for mb, (args, kwargs, grads) in enumerate(self.micro_batches(config)):
                    self._restore_rng(mb)
                    with torch.enable_grad():
                        output = model(*args, **kwargs)
                    wanting = [t for t in iter_tensors(output) if is_floating(t) and t.requires_grad]
                    if len(wanting) != len(grads):
                        return self.grad_outputs_nonfinite
                    seeded = [(t, g) for t, g in zip(wanting, grads) if g is not None]
                    roots = backward_roots([t for t, _ in seeded])
                    bad += sum(int((~torch.isfinite(g)).sum()) for (_, g), root in zip(seeded, roots) if root)
        except Exception:  # noqa: BLE001 - the user's model may raise anything; run() reports it
            return self.grad_outputs_nonfinite
        return bad

    def start_backward(self, loss_fn=None) -> list:
        """The one rule for where every precision's backward starts (replay,
        fix, bisect and recommend all call it), and the note that says so.

        - `saved`: the bundle's d(loss)/d(outputs), when it is finite;
        - `loss_fn`: the saved gradient is non-finite and a `loss_fn` is
          given: d loss_fn(output)/d(outputs) at the float64 run's outputs;
        - `substitute_mean`: the saved gradient is non-finite and no loss_fn:
          its NaN/Inf entries replaced by the gradient of the mean of their
          output (1/numel), its finite entries kept (`substitute_mean`).
        Every precision starts from the same gradient (times the loss scale
        for fp16/bf16), so the comparisons with float64 stay fair; with a
        substitute they measure each precision's arithmetic on a stand-in,
        not the step's true gradient, and the note says so.
        A bundle whose output gradients the recorder let go
        (`grad_outputs_released`) starts from `loss_fn` when given, else its
        backward is not replayed, and the note says which."""
        meta = self.bundle.meta if isinstance(self.bundle.meta, dict) else {}
        if meta.get("grad_outputs_released") and not any(g is not None for mb in self.grad_outputs for g in mb):
            if loss_fn is not None:
                self.derive_grad_outputs(loss_fn)
                return ["the recorder let this step's output gradients go at its close (its facts showed no "
                        "event): every precision's backward starts from the gradient of loss_fn at the float64 "
                        "run's outputs (backward_start: loss_fn)"]
            return ["the recorder let this step's output gradients go at its close (its facts showed no event) "
                    "and no loss function was given: the backward is not replayed, only the forward"]
        if not self.saved_grad_nonfinite:
            return []
        bad = self.saved_grad_nonfinite
        if loss_fn is not None:
            self.derive_grad_outputs(loss_fn)
            return [f"the saved output gradient holds {bad} NaN/Inf values (the training loss was already "
                    "non-finite): every precision's backward starts from the gradient of loss_fn at the "
                    "float64 run's outputs instead (backward_start: loss_fn)"]
        return [f"the saved output gradient holds {bad} NaN/Inf values (the training loss was already "
                "non-finite): every precision's backward starts from a substitute, those entries replaced by "
                "the gradient of the mean of their output (1/numel), the finite ones as saved "
                "(backward_start: substitute_mean); backward statuses and gradient errors compare each "
                "precision with float64 from that same stand-in, not from the step's true gradient"]

    def derive_grad_outputs(self, loss_fn) -> None:
        """Start every backward from d loss_fn(output)/d(outputs) of the float64
        run instead of the saved gradient (for a step whose saved gradient is
        already NaN, or a what-if with another loss)."""
        config = RunConfig("fp64", device=str(self.device))
        model = self.model(torch.float64)
        grads = []
        with preserved_rng(self.device), numerics_flags(config):
            for mb, (args, kwargs, _) in enumerate(self.micro_batches(config, with_grads=False)):
                self._restore_rng(mb)
                with torch.enable_grad():
                    output = model(*args, **kwargs)
                    outs = [t for t in iter_tensors(output) if is_floating(t) and t.requires_grad]
                    loss = loss_fn(output, mb)
                    got = torch.autograd.grad(loss, outs, allow_unused=True)
                grads.append([None if g is None else g.detach() for g in got])
        self.grad_outputs = grads
        self.backward_start = BackwardStart.LOSS_FN

    @property
    def batch_statistics_modules(self) -> tuple:
        """The modules that normalise over the batch as the step ran them
        (`batch_statistics_modules`)."""
        return batch_statistics_modules(self._base, self.training)

    @property
    def running_statistics_available(self) -> bool:
        """Whether every module of `batch_statistics_modules` keeps running
        statistics (`track_running_stats`) a replay can normalise with."""
        names = self.batch_statistics_modules
        return bool(names) and all(_has_running_stats(self._base.get_submodule(n)) for n in names)

    def model(self, dtype: torch.dtype) -> torch.nn.Module:
        m = self._models.get(dtype)
        if m is None:
            m = copy.deepcopy(self._base).to(device=self.device, dtype=dtype)
            self._models[dtype] = m
        else:
            m.load_state_dict(self._state, strict=True)
        for p in m.parameters():
            p.grad = None
        m.train(self.training)
        return m

    def _restore_rng(self, mb: int) -> None:
        """The RNG state saved before micro-batch `mb`'s forward (before the
        first one only, when the bundle has no per-micro-batch states), so
        that dropout draws the masks it drew in training."""
        per_mb = getattr(self.bundle, "micro_batch_rng", None) or []
        if mb < len(per_mb) and per_mb[mb]:
            set_rng(per_mb[mb].get("cpu"), per_mb[mb].get("cuda"), self.device)
        elif mb == 0:
            rng = self.bundle.rng or {}
            set_rng(rng.get("cpu"), rng.get("cuda"), self.device)

    # ---------------------------------------------------------- inputs
    def micro_batches(self, config: RunConfig, with_grads: bool = True):
        """Per micro-batch: (args, kwargs, grad_outputs) on the run's device,
        floating tensors in the run's input dtype, sliced to `config.batch`."""
        out = []
        for mb, (args, kwargs) in enumerate(self.bundle.inputs):
            grads = self.grad_outputs[mb] if with_grads and mb < len(self.grad_outputs) else []
            size = _batch_size((args, kwargs))
            cast = lambda t: self._input(t, config, size)  # noqa: E731
            args, kwargs = map_tensors(tuple(args), cast), map_tensors(dict(kwargs), cast)
            grads = [None if g is None else _slice(g.detach().to(self.device, torch.float64), config.batch, size)
                     for g in grads]
            out.append((args, kwargs, grads))
        return out

    def _input(self, t: torch.Tensor, config: RunConfig, size):
        wants_grad = bool(t.requires_grad)
        t = _slice(t.detach().to(self.device), config.batch, size)
        if is_floating(t):
            if config.precision in ("fp64", "fp32"):
                t = t.to(config.dtype)
            elif t.dtype == torch.float64 or t.dtype not in (torch.float32, config.dtype):
                # Reduced runs keep float32 inputs and those already in their
                # own dtype as recorded; other widths start from float32.
                t = t.float()
        t = t.clone()
        if wants_grad and is_floating(t):
            t.requires_grad_(True)
        return t

    # ---------------------------------------------------------- running
    def run(self, config: RunConfig, *, capture: bool = True, keep_inputs: bool = False,
            anomaly: bool = False, loss_fn=None) -> StepCapture:
        """Run the step's forward and backward under `config`."""
        result = StepCapture(config=config)
        model = self.model(config.weight_dtype)
        if config.running_statistics:
            # Left so until the next run: `rerun_call` reruns this run's modules as it ran them.
            for name in batch_statistics_modules(model, self.training):
                model.get_submodule(name).eval()
        recorder = CallRecorder(model, keep_inputs=keep_inputs) if capture else None
        with ExitStack() as stack:
            stack.enter_context(preserved_rng(self.device))
            stack.enter_context(numerics_flags(config))
            stack.enter_context(fp32_modules_kept(model, config.fp32_modules, autocast_device_types(config)))
            if recorder is not None:
                stack.enter_context(recorder)
            caught = stack.enter_context(AnomalyCatcher()) if anomaly else None
            watch = BackwardWatch(recorder) if anomaly else None
            if watch is not None:
                stack.callback(watch.close)
            try:
                for mb, (args, kwargs, grads) in enumerate(self.micro_batches(config)):
                    self._restore_rng(mb)
                    if recorder is not None:
                        recorder.micro_batch = mb
                    with torch.enable_grad():
                        with autocast_for(config), float32_lines(config.fp32_lines, autocast_device_types(config)):
                            output = model(*args, **kwargs)
                        outs = [t for t in iter_tensors(output) if is_floating(t)]
                        result.outputs.append([t.detach().clone() for t in outs])
                        result.losses.append(_loss_value(output, mb, loss_fn))
                        if watch is not None:
                            watch.watch(outs)
                        if config.backward_from_loss and loss_fn is not None:
                            # Where training computes it: inside autocast.
                            with autocast_for(config), float32_lines(config.fp32_lines,
                                                                     autocast_device_types(config)):
                                loss = loss_fn(output, mb)
                            result.backward_from, result.loss_dtype = BackwardFrom.LOSS_FN, _dtype_name(loss)
                            _backward_from_loss(loss, config)
                        else:
                            result.backward_from, result.loss_dtype = _backward(outs, grads, config,
                                                                                find_loss(output))
            except Exception as exc:  # noqa: BLE001 - the user's model may raise anything
                if caught is not None and caught.is_anomaly(exc):
                    result.anomaly = caught.report(exc)
                    result.error = f"{type(exc).__name__}: {result.anomaly['message']}"
                elif isinstance(exc, PostmortemError):
                    raise
                elif config.precision == "fp64":
                    raise ModelSpecError(f"the model failed to run the step in float64: "
                                         f"{type(exc).__name__}: {exc}") from exc
                else:
                    result.error = f"{type(exc).__name__}: {exc}"
            if anomaly and result.anomaly is None:
                result.anomaly = {"raised": False, "op": None, "message": None, "traceback": None}
            if watch is not None:
                result.anomaly["first_nonfinite_op"] = watch.first
        if recorder is not None:
            result.calls = recorder.calls
        scale = config.backward_scale
        for name, p in model.named_parameters():
            if p.grad is not None:
                result.param_grads[name] = p.grad.detach().to(torch.float64) / scale
                p.grad = None
        return result

    def reduced_work(self, config: RunConfig):
        """(FLOPs of the forward run in float16/bfloat16 (`op_cost.py`), what
        the float32 lines were handed ({line_key: LineInputs})): the step's
        forward passes under `config`, without a backward."""
        model = self.model(config.weight_dtype)
        counter = ReducedWork()
        seen: dict = {}
        with ExitStack() as stack:
            stack.enter_context(preserved_rng(self.device))
            stack.enter_context(numerics_flags(config))
            stack.enter_context(fp32_modules_kept(model, config.fp32_modules, autocast_device_types(config)))
            for mb, (args, kwargs, _) in enumerate(self.micro_batches(config, with_grads=False)):
                self._restore_rng(mb)
                with torch.no_grad(), autocast_for(config), \
                        float32_lines(config.fp32_lines, autocast_device_types(config)) as lines, counter:
                    model(*args, **kwargs)
                for key, got in lines.items():
                    into = seen.setdefault(key, got)
                    if into is not got:
                        into.variables |= got.variables
                        into.others += got.others
                        into.calls += got.calls
        return counter.flops, seen

    def rerun_call(self, config: RunConfig, ref_call: ModuleCall, input_dtypes, *,
                   grads=None, reference: bool = False):
        """Feed one module the inputs kept from another run (normally the
        float64 reference), rounded to `input_dtypes`, under `config`.

        With `reference`, the rounded inputs are widened back to float64 and
        the float64 copy of the module runs them (pass a fp64 `config`): the
        exact result on the same rounded inputs. `grads` (one per floating
        output, or None) starts a backward; each is cast to its output's
        dtype first. Returns (outputs, input_grads): the floating outputs and
        {"input:i" | "param:name": gradient as computed, or None} for the
        floating inputs that required grad and the module's parameters.
        Weights are not reloaded: a module run alone changes none.
        """
        dtype = torch.float64 if reference else config.weight_dtype
        model = self._models.get(dtype)
        if model is None:
            model = self.model(dtype)
        module = model.get_submodule(ref_call.name)
        args, kwargs = ref_call.inputs
        dtypes = iter(list(input_dtypes))
        flags = iter(list(ref_call.input_requires_grad))
        leaves = []

        def feed(t):
            if not is_floating(t):
                return t
            rounded = round_to(t.detach(), next(dtypes, None) or config.dtype)
            if reference:
                rounded = rounded.to(torch.float64)
            leaf = rounded.requires_grad_(bool(next(flags, False) and grads is not None))
            leaves.append(leaf)
            # A non-leaf copy, so an in-place op of the module on its input is allowed.
            return leaf.clone() if leaf.requires_grad else leaf
        # The kept objects stay as they were before the call (a cache the call appends to).
        args = map_tensors(args, feed, other=stateful_copy)
        kwargs = map_tensors(kwargs, feed, other=stateful_copy)
        with ExitStack() as stack:
            stack.enter_context(preserved_rng(self.device))
            stack.enter_context(numerics_flags(config))
            stack.enter_context(fp32_modules_kept(module, _within(config.fp32_modules, ref_call.name),
                                                  autocast_device_types(config)))
            set_rng(ref_call.rng_state, None, self.device)
            if ref_call.cuda_rng_state is not None:
                torch.cuda.set_rng_state(ref_call.cuda_rng_state[1], ref_call.cuda_rng_state[0])
            with torch.enable_grad():
                with autocast_for(config), float32_lines(config.fp32_lines, autocast_device_types(config)):
                    output = module(*args, **kwargs)
                outs = [t for t in iter_tensors(output) if is_floating(t)]
                got = None
                if grads is not None:
                    got = _local_grads(module, leaves, outs, grads)
        return [t.detach() for t in outs], got


def _local_grads(module, leaves, outs, grads) -> dict:
    # A module output computed from another of its outputs already holds
    # that one's share of the gradient (see outputs.backward_roots).
    pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
    pairs = [pair for pair, root in zip(pairs, backward_roots([o for o, _ in pairs])) if root]
    targets = {f"input:{i}": t for i, t in enumerate(leaves) if t.requires_grad}
    targets.update({f"param:{n}": p for n, p in module.named_parameters() if p.requires_grad})
    if not pairs or not targets:
        return {}
    got = torch.autograd.grad([o for o, _ in pairs], list(targets.values()),
                              [g.to(o.dtype) for o, g in pairs], allow_unused=True)
    return {k: None if g is None else g.detach() for k, g in zip(targets, got)}


def _within(names, prefix: str):
    """fp32 module names at or below `prefix`, relative to it ("" when
    `prefix` itself lies inside one)."""
    out = []
    for n in names:
        if prefix == "":
            out.append(n)
        elif n == prefix or n == "" or prefix.startswith(n + "."):
            out.append("")  # the module itself runs inside a float32 module
        elif n.startswith(prefix + "."):
            out.append(n[len(prefix) + 1:])
    return tuple(dict.fromkeys(out))


def batch_statistics_modules(model: torch.nn.Module, training: bool) -> tuple:
    """Names of the modules that normalise over the batch: BatchNorm (every
    class of it: 1d/2d/3d, lazy, SyncBatchNorm) in training, or in eval
    without running statistics. A slice of the batch changes the statistics
    every sample sees; one sample leaves a BatchNorm1d one value per channel
    (torch raises "Expected more than 1 value per channel when training")."""
    from torch.nn.modules.batchnorm import _BatchNorm
    return tuple(name for name, m in model.named_modules()
                 if isinstance(m, _BatchNorm) and (training or not _has_running_stats(m)))


def _has_running_stats(module) -> bool:
    return getattr(module, "running_mean", None) is not None and getattr(module, "running_var", None) is not None


def _batch_size(obj):
    for t in iter_tensors(obj):
        if t.dim() > 0:
            return t.shape[0]
    return None


def _slice(t: torch.Tensor, batch, size):
    if batch is None or size is None or t.dim() == 0 or t.shape[0] != size:
        return t
    if isinstance(batch, slice):
        return t[batch]
    index = torch.as_tensor(list(batch) if not isinstance(batch, torch.Tensor) else batch,
                            dtype=torch.long, device=t.device)
    return t.index_select(0, index)


def _loss_value(output, mb, loss_fn):
    if loss_fn is not None:
        with torch.no_grad():
            value = loss_fn(output, mb)
        return float(value.detach().double()) if isinstance(value, torch.Tensor) else float(value)
    loss = find_loss(output)
    return None if loss is None else float(loss.detach().double())


def substitute_mean(grad_outputs: list) -> list:
    """Output gradients with every NaN/Inf entry replaced by the gradient of
    the mean of its output (1/numel), finite entries as saved: a finite
    start that still exercises every module at the recorded loss scale."""
    out = []
    for mb in grad_outputs:
        row = []
        for g in mb:
            if g is not None and not bool(torch.isfinite(g).all()):
                g = torch.where(torch.isfinite(g), g, torch.full_like(g, 1.0 / max(g.numel(), 1)))
            row.append(g)
        out.append(row)
    return out


def _dtype_name(t) -> str | None:
    return str(t.dtype).removeprefix("torch.") if isinstance(t, torch.Tensor) else None


def _backward_from_loss(loss, config: RunConfig) -> None:
    """The backward of `loss` at the run's scale as `GradScaler.scale` takes
    it: times a float32 scale, so the loss's own gradient is the scale
    rounded to the loss's dtype (Inf above 65504 for a float16 loss)."""
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        raise ModelSpecError("loss_fn returned no tensor with a gradient to start the backward from")
    scaled = loss * torch.full((), config.backward_scale, dtype=torch.float32, device=loss.device)
    torch.autograd.backward([scaled], [torch.ones_like(scaled)])


def _backward(outs, grads, config: RunConfig, loss=None):
    """Start the backward from the bundle's output gradients (times the scale
    for reduced precision), cast to each output's dtype as autograd would,
    at the outputs with a gradient that no other such output was computed
    from (`backward_roots`: a loss computed inside the model is the one
    start, as in training; a loss_fn on the logits alone seeds the logits)."""
    wanting = [t for t in outs if t.requires_grad]
    if len(grads) != len(wanting):
        raise ModelSpecError(f"the bundle holds {len(grads)} output gradients but the model returned "
                             f"{len(wanting)} floating outputs requiring grad; is this the model the run trained?")
    seeded = [(t, g) for t, g in zip(wanting, grads) if g is not None]
    for t, g in seeded:
        if tuple(g.shape) != tuple(t.shape):
            raise ModelSpecError(f"the bundle's output gradient has shape {tuple(g.shape)} but the "
                                 f"model's output has shape {tuple(t.shape)}; is this the model the run trained?")
    pairs = [(t, (g * config.backward_scale).to(t.dtype))
             for (t, g), root in zip(seeded, backward_roots([t for t, _ in seeded])) if root]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
    # A loss output among the seeds: its seed is the scale in the loss's own
    # dtype, as the scaled loss's backward hands it in training.
    if loss is not None and any(t is loss for t, _ in pairs):
        return BackwardFrom.LOSS, _dtype_name(loss)
    return BackwardFrom.OUTPUT_GRADIENT, None
