"""What a replay run is and the contexts it runs inside.

`RunConfig` names one way of running the saved step (precision, device,
autocast policy, loss scale, what-if knobs), and the context managers here
set up the numerics around a run: backend flags (TF32, reduced-precision
reductions), float32 regions, the RNG kept or restored, and the autocast
context of a precision. They are separate from `engine.py` because they are
configuration, testable and reusable without a session; `engine.py` holds
`ReplaySession`, which runs the step (and must stay the module the model is
called from: `capture._model_frames` cuts tracebacks at its frames).
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..names import POLICIES, PRECISIONS  # noqa: F401  (PRECISIONS: re-exported to the engine)

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PRECISION_OF_DTYPE = {"float64": "fp64", "float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
POLICY_MODES = POLICIES


@dataclass(frozen=True)
class RunConfig:
    """One way of running the step. `policy` is an `AutocastPolicy` (fp16 and
    bf16 only); `loss_scale` multiplies the backward of reduced-precision
    runs (fp64/fp32 always start from the unscaled gradient)."""
    precision: str
    device: str = "cpu"
    policy: object = None
    loss_scale: float = 1.0
    fp32_modules: tuple = ()
    fp32_lines: tuple = ()        # (file, line) of model source lines run in float32 (fp32_lines.py)
    batch: object = None          # slice, list of indices or None (whole batch)
    # The modules that normalise over the batch (`engine.batch_statistics_modules`)
    # on their running statistics instead: a one-sample slice they can take.
    running_statistics: bool = False
    precision_flags: dict | None = None  # recorded flags applied to fp16/bf16 runs
    # Start the backward from loss_fn(output) computed under autocast, times
    # the scale as GradScaler multiplies it (the loss in its own dtype), not
    # from the saved output gradient (`ReplaySession.run(loss_fn=...)`).
    backward_from_loss: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    @property
    def reduced(self) -> bool:
        return self.precision in ("fp16", "bf16")

    @property
    def backward_scale(self) -> float:
        return float(self.loss_scale) if self.reduced else 1.0

    @property
    def weight_dtype(self) -> torch.dtype:
        return torch.float64 if self.precision == "fp64" else torch.float32

    def replace(self, **changes) -> "RunConfig":
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------- contexts
@contextmanager
def float32_region(*device_types: str):
    """Run a block in float32 whatever autocast surrounds it: native autocast
    off for the given device types (the run's and the policy's: the emulated
    policy honours its device's flag, as on the device) and every
    TorchFunctionMode suspended until the block ends."""
    modes = []
    while torch._C._len_torch_function_stack() > 0:
        modes.append(torch._C._pop_torch_function_stack())
    saved = [(d, torch.is_autocast_enabled(d)) for d in dict.fromkeys(device_types)]
    try:
        for d, _ in saved:
            torch.set_autocast_enabled(d, False)
        yield
    finally:
        for d, enabled in saved:
            torch.set_autocast_enabled(d, enabled)
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


@contextmanager
def numerics_flags(config: RunConfig):
    """Set the backend flags a precision needs and restore them afterwards:
    fp64/fp32 run with TF32 off; fp16/bf16 take the recorded flags."""
    saved = {
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "fp16_rr": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "bf16_rr": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "f32_precision": torch.get_float32_matmul_precision(),
    }
    flags = config.precision_flags or {}
    try:
        if config.reduced:
            # float32_matmul_precision and allow_tf32 are one switch seen twice: the string wins.
            if flags.get("float32_matmul_precision") in ("highest", "high", "medium"):
                torch.set_float32_matmul_precision(flags["float32_matmul_precision"])
            elif flags.get("allow_tf32_matmul") is not None:
                torch.backends.cuda.matmul.allow_tf32 = bool(flags["allow_tf32_matmul"])
            for key, setter in (("allow_tf32_cudnn", _set_cudnn_tf32),
                                ("fp16_reduced_precision_reduction", _set_fp16_rr),
                                ("bf16_reduced_precision_reduction", _set_bf16_rr)):
                if flags.get(key) is not None:
                    setter(bool(flags[key]))
        else:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            torch.set_float32_matmul_precision("highest")
        yield
    finally:
        torch.set_float32_matmul_precision(saved["f32_precision"])
        torch.backends.cuda.matmul.allow_tf32 = saved["matmul_tf32"]
        torch.backends.cudnn.allow_tf32 = saved["cudnn_tf32"]
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = saved["fp16_rr"]
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = saved["bf16_rr"]


def _set_cudnn_tf32(value: bool) -> None:
    torch.backends.cudnn.allow_tf32 = value


def _set_fp16_rr(value: bool) -> None:
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = value


def _set_bf16_rr(value: bool) -> None:
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = value


@contextmanager
def preserved_rng(device: torch.device):
    """Whatever a replay does to the global RNG is undone when it ends."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def set_rng(cpu_state, cuda_states, device: torch.device) -> None:
    if cpu_state is not None:
        torch.set_rng_state(cpu_state.detach().to("cpu", torch.uint8))
    if device.type == "cuda" and cuda_states:
        if isinstance(cuda_states, torch.Tensor):
            cuda_states = [cuda_states]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.detach().to("cpu", torch.uint8) for s in cuda_states])


def autocast_for(config: RunConfig):
    """The autocast context of a run: none for fp64/fp32; for fp16/bf16 the
    config's policy, or the run device's own when it names none."""
    device_type = torch.device(config.device).type
    if not config.reduced:
        return torch.autocast(device_type=device_type, enabled=False)
    from .policy import autocast_context, get_policy
    return autocast_context(config.policy or get_policy(device_type, config.dtype), device_type)


def autocast_device_types(config: RunConfig) -> tuple:
    policy_device = getattr(config.policy, "device_type", None)
    return tuple(d for d in (torch.device(config.device).type, policy_device) if d)
