"""Pins amp_postmortem.replaying.policy: the op tables equal what the installed
torch registers and what its autocast kernels do (the CUDA ones run on fake
CUDA tensors, which needs no GPU), the emulation gives every op the recording
device's dtype on a CPU, and gradients come back through its casts in the
device's dtypes."""
from __future__ import annotations

import contextlib
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.func import functional_call

from amp_postmortem.replaying.policy import (
    REGISTERED_OPS,
    UnknownPolicyError,
    autocast_context,
    emulate_autocast,
    expected_output_dtype,
    get_policy,
    native_autocast,
)

LOW_DTYPES = (torch.float16, torch.bfloat16)
_REAL_OF_COMPLEX = {torch.complex64: torch.float32, torch.complex128: torch.float64,
                    torch.complex32: torch.float16}


class Inputs:
    """Makes an op's inputs on the CPU or as fake CUDA tensors and records the
    dtypes of the floating ones, in argument order."""

    def __init__(self, device: str, dtype: torch.dtype, other_dtype: torch.dtype | None = None):
        self.device, self.dtype, self.other_dtype = device, dtype, other_dtype or dtype
        self.float_dtypes: list[torch.dtype] = []

    def _float(self, shape, dtype, values=None):
        self.float_dtypes.append(dtype)
        if self.device == "cuda":
            return torch.empty(shape, device="cuda", dtype=dtype)
        return (torch.randn(shape) if values is None else values).to(dtype)

    def __call__(self, *shape):
        return self._float(shape, self.dtype)

    def other(self, *shape):
        """An input in the second dtype, for promote ops."""
        return self._float(shape, self.other_dtype)

    def unit(self, *shape):
        return self._float(shape, self.dtype, torch.rand(shape) * 0.8 + 0.1)

    def spd(self, n, shape=None):
        """Symmetric positive definite, built without any matmul."""
        values = torch.full((n, n), 0.1) + 2 * torch.eye(n)
        return self._float(shape or (n, n), self.dtype, values.reshape(shape or (n, n)))

    def long(self, *shape, high=2, fill=None):
        if self.device == "cuda":
            return torch.zeros(shape, dtype=torch.long, device="cuda")
        return torch.full(shape, fill) if fill is not None else torch.randint(0, high, shape)


def _pool_input(f, dims):
    return f(1, 1, *([2] * dims))


# One call per op name, reaching that aten op. f builds the inputs.
SAMPLES = {
    # lower precision
    # The 12-argument (deprecated) overload: the only one CPU autocast lists.
    "_convolution": lambda f: torch._convolution(f(1, 2, 5, 5), f(3, 2, 3, 3), None, [1, 1], [0, 0], [1, 1],
                                                 False, [0, 0], 1, False, False, True),
    "conv1d": lambda f: F.conv1d(f(1, 2, 5), f(3, 2, 3)),
    "conv2d": lambda f: F.conv2d(f(1, 2, 5, 5), f(3, 2, 3, 3)),
    "conv3d": lambda f: F.conv3d(f(1, 2, 4, 4, 4), f(3, 2, 3, 3, 3)),
    "conv_tbc": lambda f: torch.conv_tbc(f(5, 1, 2), f(3, 2, 4), f(4)),
    "conv_transpose1d": lambda f: F.conv_transpose1d(f(1, 2, 5), f(2, 3, 3)),
    "conv_transpose2d": lambda f: F.conv_transpose2d(f(1, 2, 5, 5), f(2, 3, 3, 3)),
    "conv_transpose3d": lambda f: F.conv_transpose3d(f(1, 2, 3, 3, 3), f(2, 3, 2, 2, 2)),
    "convolution": lambda f: torch.convolution(f(1, 2, 5, 5), f(3, 2, 3, 3), None, [1, 1], [0, 0], [1, 1],
                                               False, [0, 0], 1),
    "prelu": lambda f: F.prelu(f(2, 3), f(1)),
    "addmm": lambda f: torch.addmm(f(2, 3), f(2, 4), f(4, 3)),
    "_addmm_activation": lambda f: torch._addmm_activation(f(2, 3), f(2, 4), f(4, 3)),
    "addmv": lambda f: torch.addmv(f(2), f(2, 3), f(3)),
    "addr": lambda f: torch.addr(f(2, 3), f(2), f(3)),
    "matmul": lambda f: f(2, 3) @ f(3, 4),
    "einsum": lambda f: torch.einsum("ij,jk->ik", f(2, 3), f(3, 4)),
    "mm": lambda f: torch.mm(f(2, 3), f(3, 4)),
    "mv": lambda f: torch.mv(f(2, 3), f(3)),
    "linalg_vecdot": lambda f: torch.linalg.vecdot(f(2, 3), f(2, 3)),
    "linear": lambda f: F.linear(f(2, 3), f(4, 3), f(4)),
    "addbmm": lambda f: torch.addbmm(f(2, 3), f(4, 2, 5), f(4, 5, 3)),
    "baddbmm": lambda f: torch.baddbmm(f(4, 2, 3), f(4, 2, 5), f(4, 5, 3)),
    "bmm": lambda f: torch.bmm(f(4, 2, 5), f(4, 5, 3)),
    "chain_matmul": lambda f: torch.chain_matmul(f(2, 3), f(3, 4), f(4, 2)),
    "linalg_multi_dot": lambda f: torch.linalg.multi_dot([f(2, 3), f(3, 4), f(4, 2)]),
    "lstm_cell": lambda f: torch.lstm_cell(f(2, 3), (f(2, 4), f(2, 4)), f(16, 3), f(16, 4)),
    "gru_cell": lambda f: torch.gru_cell(f(2, 3), f(2, 4), f(12, 3), f(12, 4)),
    "rnn_tanh_cell": lambda f: torch.rnn_tanh_cell(f(2, 3), f(2, 4), f(4, 3), f(4, 4)),
    "rnn_relu_cell": lambda f: torch.rnn_relu_cell(f(2, 3), f(2, 4), f(4, 3), f(4, 4)),
    "_scaled_dot_product_flash_attention": lambda f: torch._scaled_dot_product_flash_attention(
        f(1, 2, 3, 8), f(1, 2, 3, 8), f(1, 2, 3, 8)),
    "scaled_dot_product_attention": lambda f: F.scaled_dot_product_attention(f(1, 2, 3, 4), f(1, 2, 3, 4),
                                                                             f(1, 2, 3, 4)),
    "_native_multi_head_attention": lambda f: torch._native_multi_head_attention(
        f(1, 3, 4), f(1, 3, 4), f(1, 3, 4), 4, 2, f(12, 4), f(12), f(4, 4), f(4)),
    "lstm": lambda f: torch.lstm(f(3, 2, 4), (f(1, 2, 5), f(1, 2, 5)), [f(20, 4), f(20, 5), f(20), f(20)],
                                 True, 1, 0.0, True, False, False),
    "gru": lambda f: torch.gru(f(3, 2, 4), f(1, 2, 5), [f(15, 4), f(15, 5), f(15), f(15)],
                               True, 1, 0.0, True, False, False),
    "rnn_tanh": lambda f: torch.rnn_tanh(f(3, 2, 4), f(1, 2, 5), [f(5, 4), f(5, 5), f(5), f(5)],
                                         True, 1, 0.0, True, False, False),
    "rnn_relu": lambda f: torch.rnn_relu(f(3, 2, 4), f(1, 2, 5), [f(5, 4), f(5, 5), f(5), f(5)],
                                         True, 1, 0.0, True, False, False),
    # float32, casting
    **{name: (lambda name: lambda f: getattr(torch, name)(f(3, 3)))(name) for name in (
        "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan "
        "trace inverse pinverse").split()},
    "pow": lambda f: f(3) ** 2,
    "softplus": lambda f: F.softplus(f(3)),
    "layer_norm": lambda f: F.layer_norm(f(2, 3), (3,), f(3), f(3)),
    "native_layer_norm": lambda f: torch.native_layer_norm(f(2, 3), [3], f(3), f(3), 1e-5),
    "rms_norm": lambda f: F.rms_norm(f(2, 3), (3,)),
    "group_norm": lambda f: F.group_norm(f(2, 4, 3), 2),
    "frobenius_norm": lambda f: torch.frobenius_norm(f(2, 3), [0, 1]),
    "nuclear_norm": lambda f: torch.nuclear_norm(f(3, 3)),
    "cosine_similarity": lambda f: F.cosine_similarity(f(2, 3), f(2, 3)),
    "pairwise_distance": lambda f: F.pairwise_distance(f(2, 3), f(2, 3)),
    "poisson_nll_loss": lambda f: F.poisson_nll_loss(f(3), f(3)),
    "cosine_embedding_loss": lambda f: F.cosine_embedding_loss(f(2, 3), f(2, 3), f.long(2, fill=1)),
    "nll_loss": lambda f: F.nll_loss(f(3, 4), f.long(3, high=4)),
    "nll_loss2d": lambda f: torch._C._nn.nll_loss2d(f(2, 3, 4, 4), f.long(2, 4, 4, high=3)),
    "cross_entropy_loss": lambda f: F.cross_entropy(f(3, 4), f.long(3, high=4)),
    "hinge_embedding_loss": lambda f: F.hinge_embedding_loss(f(3), f(3)),
    "kl_div": lambda f: F.kl_div(f(3), f(3), reduction="batchmean"),
    **{name: (lambda name: lambda f: getattr(F, name)(f(3), f(3)))(name) for name in (
        "l1_loss smooth_l1_loss huber_loss mse_loss soft_margin_loss").split()},
    "margin_ranking_loss": lambda f: F.margin_ranking_loss(f(3), f(3), f(3)),
    "multilabel_margin_loss": lambda f: F.multilabel_margin_loss(f(2, 3), f.long(2, 3, fill=0)),
    "triplet_margin_loss": lambda f: F.triplet_margin_loss(f(2, 3), f(2, 3), f(2, 3)),
    "multi_margin_loss": lambda f: F.multi_margin_loss(f(2, 3), f.long(2, high=3)),
    "binary_cross_entropy_with_logits": lambda f: F.binary_cross_entropy_with_logits(f(3), f.unit(3)),
    "binary_cross_entropy": lambda f: F.binary_cross_entropy(f.unit(3), f.unit(3)),
    "ctc_loss": lambda f: F.ctc_loss(f(5, 1, 3), f.long(1, 2, fill=1), [5], [2]),
    "dist": lambda f: torch.dist(f(3), f(3)),
    "pdist": lambda f: F.pdist(f(3, 2)),
    "cdist": lambda f: torch.cdist(f(2, 3), f(4, 3)),
    "renorm": lambda f: torch.renorm(f(2, 3), 2, 0, 1.0),
    "logsumexp": lambda f: torch.logsumexp(f(2, 3), 1),
    "upsample_nearest1d": lambda f: F.interpolate(f(1, 2, 4), scale_factor=2, mode="nearest"),
    "_upsample_nearest_exact1d": lambda f: F.interpolate(f(1, 2, 4), scale_factor=2, mode="nearest-exact"),
    "upsample_nearest2d": lambda f: F.interpolate(f(1, 2, 4, 4), scale_factor=2, mode="nearest"),
    "_upsample_nearest_exact2d": lambda f: F.interpolate(f(1, 2, 4, 4), scale_factor=2, mode="nearest-exact"),
    "upsample_nearest3d": lambda f: F.interpolate(f(1, 1, 2, 2, 2), scale_factor=2, mode="nearest"),
    "_upsample_nearest_exact3d": lambda f: F.interpolate(f(1, 1, 2, 2, 2), scale_factor=2,
                                                         mode="nearest-exact"),
    "upsample_linear1d": lambda f: F.interpolate(f(1, 2, 4), scale_factor=2, mode="linear"),
    "upsample_bilinear2d": lambda f: F.interpolate(f(1, 2, 4, 4), scale_factor=2, mode="bilinear"),
    "_upsample_bilinear2d_aa": lambda f: F.interpolate(f(1, 2, 4, 4), scale_factor=2, mode="bilinear",
                                                       antialias=True),
    "upsample_trilinear3d": lambda f: F.interpolate(f(1, 1, 2, 2, 2), scale_factor=2, mode="trilinear"),
    "upsample_bicubic2d": lambda f: F.interpolate(f(1, 2, 4, 4), scale_factor=2, mode="bicubic"),
    "_upsample_bicubic2d_aa": lambda f: F.interpolate(f(1, 2, 4, 4), scale_factor=2, mode="bicubic",
                                                      antialias=True),
    "avg_pool3d": lambda f: F.avg_pool3d(_pool_input(f, 3), 2),
    "max_pool3d": lambda f: F.max_pool3d(_pool_input(f, 3), 2),
    "adaptive_avg_pool3d": lambda f: F.adaptive_avg_pool3d(_pool_input(f, 3), 1),
    "adaptive_max_pool3d": lambda f: F.adaptive_max_pool3d(_pool_input(f, 3), 1),
    "max_unpool2d": lambda f: F.max_unpool2d(_pool_input(f, 2), f.long(1, 1, 2, 2, fill=0), 2),
    "max_unpool3d": lambda f: F.max_unpool3d(_pool_input(f, 3), f.long(1, 1, 2, 2, 2, fill=0), 2),
    "fractional_max_pool2d": lambda f: F.fractional_max_pool2d(f(1, 1, 4, 4), 2, output_size=2),
    "fractional_max_pool3d": lambda f: F.fractional_max_pool3d(f(1, 1, 4, 4, 4), 2, output_size=2),
    **{f"{kind}_pad{dims}d": (lambda kind, dims: lambda f: getattr(torch._C._nn, f"{kind}_pad{dims}d")(
        f(1, 1, *([3] * dims)), [1] * (2 * dims)))(kind, dims)
       for kind, dims in [("reflection", 1), ("reflection", 2), ("replication", 1), ("replication", 2),
                          ("replication", 3)]},
    "grid_sampler": lambda f: torch.grid_sampler(f(1, 2, 4, 4), f.other(1, 2, 2, 2), 0, 0, False),
    "grid_sampler_2d": lambda f: torch.grid_sampler_2d(f(1, 2, 4, 4), f(1, 2, 2, 2), 0, 0, False),
    "_grid_sampler_2d_cpu_fallback": lambda f: torch._grid_sampler_2d_cpu_fallback(f(1, 2, 4, 4),
                                                                                   f(1, 2, 2, 2), 0, 0, False),
    "grid_sampler_3d": lambda f: torch.grid_sampler_3d(f(1, 1, 2, 2, 2), f(1, 1, 1, 1, 3), 0, 0, False),
    "polar": lambda f: torch.polar(f(3), f(3)),
    "quantile": lambda f: torch.quantile(f(5), 0.5),
    "nanquantile": lambda f: torch.nanquantile(f(5), 0.5),
    "stft": lambda f: torch.stft(f(64), 16, window=f(16), return_complex=True),
    "view_as_complex": lambda f: torch.view_as_complex(f(3, 2)),
    "fake_quantize_per_tensor_affine": lambda f: torch.fake_quantize_per_tensor_affine(f(3), 0.1, 0, 0, 255),
    **{f"fft_{name}": (lambda name, dims: lambda f: getattr(torch.fft, name)(f(*([4] * dims))))(name, dims)
       for name, dims in [("fft", 1), ("ifft", 1), ("fft2", 2), ("ifft2", 2), ("fftn", 2), ("ifftn", 2),
                          ("rfft", 1), ("irfft", 1), ("rfft2", 2), ("irfft2", 2), ("rfftn", 2),
                          ("irfftn", 2), ("hfft", 1), ("ihfft", 1)]},
    # linear algebra (CPU float32 list)
    "cholesky": lambda f: torch.cholesky(f.spd(3)),
    "cholesky_inverse": lambda f: torch.cholesky_inverse(f.spd(3)),
    "cholesky_solve": lambda f: torch.cholesky_solve(f(3, 1), f.spd(3)),
    "lu_solve": lambda f: torch.lu_solve(f(3, 1), f.spd(3), torch.tensor([[1, 2, 3]], dtype=torch.int32)[0]),
    "orgqr": lambda f: torch.orgqr(f(3, 3), f(3)),
    "ormqr": lambda f: torch.ormqr(f(3, 3), f(3), f(3, 3)),
    "geqrf": lambda f: torch.geqrf(f(3, 3)),
    "_lu_with_info": lambda f: torch._lu_with_info(f.spd(3)),
    "qr": lambda f: torch.qr(f(3, 3)),
    "svd": lambda f: torch.svd(f(3, 3)),
    "triangular_solve": lambda f: torch.triangular_solve(f(3, 1), f.spd(3)),
    "linalg_cond": lambda f: torch.linalg.cond(f.spd(3)),
    "linalg_solve": lambda f: torch.linalg.solve(f.spd(3), f(3, 1)),
    "linalg_cholesky": lambda f: torch.linalg.cholesky(f.spd(3)),
    "linalg_cholesky_ex": lambda f: torch.linalg.cholesky_ex(f.spd(3)),
    "linalg_svdvals": lambda f: torch.linalg.svdvals(f(3, 3)),
    "linalg_svd": lambda f: torch.linalg.svd(f(3, 3)),
    "linalg_eigvals": lambda f: torch.linalg.eigvals(f.spd(3)),
    "linalg_eig": lambda f: torch.linalg.eig(f.spd(3)),
    "linalg_eigvalsh": lambda f: torch.linalg.eigvalsh(f.spd(3)),
    "linalg_eigh": lambda f: torch.linalg.eigh(f.spd(3)),
    "linalg_inv": lambda f: torch.linalg.inv(f.spd(3)),
    "linalg_inv_ex": lambda f: torch.linalg.inv_ex(f.spd(3)),
    "linalg_householder_product": lambda f: torch.linalg.householder_product(f(3, 3), f(3)),
    "linalg_tensorinv": lambda f: torch.linalg.tensorinv(f.spd(4, (4, 2, 2)), ind=1),
    "linalg_tensorsolve": lambda f: torch.linalg.tensorsolve(f.spd(4, (2, 2, 2, 2)), f(2, 2)),
    "linalg_qr": lambda f: torch.linalg.qr(f(3, 3)),
    "linalg_lstsq": lambda f: torch.linalg.lstsq(f.spd(3), f(3, 1)),
    # float32 by dtype=
    "prod": lambda f: torch.prod(f(3)),
    "softmax": lambda f: torch.softmax(f(2, 3), -1),
    "log_softmax": lambda f: F.log_softmax(f(2, 3), -1),
    "cumprod": lambda f: torch.cumprod(f(3), 0),
    "cumsum": lambda f: f(3).cumsum(0),
    "linalg_vector_norm": lambda f: torch.linalg.vector_norm(f(3)),
    "linalg_matrix_norm": lambda f: torch.linalg.matrix_norm(f(3, 3)),
    "sum": lambda f: f(3).sum(),
    "norm": lambda f: f(3).norm(),
    # promote: first input in the low precision type, the other in float32
    "addcdiv": lambda f: torch.addcdiv(f(3), f(3), f.other(3)),
    "addcmul": lambda f: torch.addcmul(f(3), f(3), f.other(3)),
    "atan2": lambda f: torch.atan2(f(3), f.other(3)),
    "bilinear": lambda f: F.bilinear(f(2, 3), f.other(2, 4), f(5, 3, 4)),
    "cross": lambda f: torch.cross(f(2, 3), f.other(2, 3), dim=1),
    "dot": lambda f: torch.dot(f(3), f.other(3)),
    "vdot": lambda f: torch.vdot(f(3), f.other(3)),
    "index_put": lambda f: torch.index_put(f(4), (f.long(2, high=4),), f.other(2)),
    "tensordot": lambda f: torch.tensordot(f(2, 3), f.other(3, 4), dims=1),
    "scatter_add": lambda f: torch.scatter_add(f(4), 0, f.long(2, high=4), f.other(2)),
    "stack": lambda f: torch.stack([f(3), f.other(3)]),
    "cat": lambda f: torch.cat([f(3), f.other(3)]),
    "index_copy": lambda f: torch.index_copy(f(4), 0, f.long(2, high=4), f.other(2)),
}

UNCALLABLE = {
    "cudnn_convolution": "needs cuDNN; reached only from conv on a CUDA build",
    "cudnn_convolution_transpose": "needs cuDNN; reached only from conv_transpose on a CUDA build",
    "_thnn_fused_lstm_cell": "CUDA-only kernel behind lstm_cell",
    "_thnn_fused_gru_cell": "CUDA-only kernel behind gru_cell",
    "mkldnn_rnn_layer": "oneDNN kernel behind nn.LSTM on the CPU",
    "_cudnn_rnn": "needs cuDNN; reached from nn.LSTM/GRU/RNN on a CUDA build",
    "multilabel_margin_loss_forward": "not exposed to Python; reached through multilabel_margin_loss",
    "linalg_matrix_rank": "returns an integer tensor, whose dtype cannot show the cast",
}

# The fake CUDA run of these fails inside torch on a CPU-only build, so only
# the table and the emulation are compared for them.
FAKE_CUDA_UNAVAILABLE = {
    "grid_sampler": "its decomposition touches the CUDA runtime",
    "nuclear_norm": "its svd touches the CUDA runtime",
    "lstm_cell": "reaches _thnn_fused_lstm_cell, which has no meta kernel",
    "gru_cell": "reaches _thnn_fused_gru_cell, which has no meta kernel",
    "gru": "reaches _thnn_fused_gru_cell, which has no meta kernel",
}
# No CPU kernel in the low precision type, so the CUDA emulation cannot run
# them on a CPU.
NO_CPU_KERNEL = {"_scaled_dot_product_flash_attention"}
# CUDA autocast refuses it: checked by its own test.
BANNED = {"binary_cross_entropy"}


def _output_dtype(result) -> torch.dtype:
    if isinstance(result, (tuple, list)):
        return _output_dtype(result[0])
    return _REAL_OF_COMPLEX.get(result.dtype, result.dtype)


def _input_dtypes(policy, op_name):
    """Inputs that show the rule: float32 for ops that go to the low type,
    the low type for ops that go to float32, both for promote ops."""
    rule = policy.rule(op_name)
    if rule == "lower":
        return torch.float32, None
    if rule == "promote":
        return policy.dtype, torch.float32
    return policy.dtype, None


@functools.cache
def _fake_mode():
    return FakeTensorMode()


@contextlib.contextmanager
def _cuda_autocast_on_fake_tensors(dtype):
    """The real CUDA autocast kernels of the installed torch: they run for
    fake CUDA tensors once the CUDA autocast flag is set, no GPU needed."""
    saved = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    mode = _fake_mode()
    try:
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", dtype)
        with mode, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield mode
    finally:
        torch.set_autocast_enabled("cuda", saved[0])
        torch.set_autocast_dtype("cuda", saved[1])


def _run_on_fake_cuda(sample, policy, op_name):
    inputs = Inputs("cuda", *_input_dtypes(policy, op_name))
    with _cuda_autocast_on_fake_tensors(policy.dtype):
        return _output_dtype(sample(inputs)), inputs.float_dtypes


def _run_emulated(sample, policy, op_name):
    inputs = Inputs("cpu", *_input_dtypes(policy, op_name))
    with warnings.catch_warnings(), emulate_autocast(policy):
        warnings.simplefilter("ignore")
        return _output_dtype(sample(inputs)), inputs.float_dtypes


def _run_native_cpu(sample, policy, op_name):
    inputs = Inputs("cpu", *_input_dtypes(policy, op_name))
    with warnings.catch_warnings(), native_autocast(policy):
        warnings.simplefilter("ignore")
        return _output_dtype(sample(inputs)), inputs.float_dtypes


def _cases(device_type, exclude=()):
    return [pytest.param(dtype, op, id=f"{str(dtype)[6:]}-{op}")
            for dtype in LOW_DTYPES
            for op in sorted(get_policy(device_type, dtype).op_names())
            if op in SAMPLES and op not in exclude]


def _registered(dispatch_key):
    names = torch._C._dispatch_get_registrations_for_dispatch_key(dispatch_key)
    return {name.removeprefix("aten::").split(".")[0] for name in names}


@pytest.mark.parametrize("device_type,dispatch_key", [("cuda", "AutocastCUDA"), ("cpu", "AutocastCPU")])
def test_table_ops_are_exactly_the_autocast_kernels_registered_in_installed_torch(device_type, dispatch_key):
    assert set(REGISTERED_OPS[device_type]) == _registered(dispatch_key)


def test_every_table_op_has_a_sample_or_a_listed_reason_to_skip_it():
    ops = set().union(*(get_policy(d, t).op_names() for d in ("cuda", "cpu") for t in LOW_DTYPES))
    assert ops - set(SAMPLES) == set(UNCALLABLE)


@pytest.mark.parametrize("dtype,op", _cases("cuda", exclude=FAKE_CUDA_UNAVAILABLE.keys() | BANNED))
def test_cuda_table_matches_the_cuda_autocast_kernels(dtype, op):
    policy = get_policy("cuda", dtype)
    actual, input_dtypes = _run_on_fake_cuda(SAMPLES[op], policy, op)
    assert actual == expected_output_dtype(policy, op, input_dtypes)


@pytest.mark.parametrize("dtype,op", _cases("cuda", exclude=NO_CPU_KERNEL | BANNED))
def test_cuda_emulation_on_cpu_gives_each_op_the_cuda_dtype(dtype, op):
    policy = get_policy("cuda", dtype)
    actual, input_dtypes = _run_emulated(SAMPLES[op], policy, op)
    assert actual == expected_output_dtype(policy, op, input_dtypes)


@pytest.mark.parametrize("dtype,op", _cases("cpu"))
def test_cpu_table_and_its_emulation_match_native_cpu_autocast(dtype, op):
    policy = get_policy("cpu", dtype)
    native, input_dtypes = _run_native_cpu(SAMPLES[op], policy, op)
    assert native == expected_output_dtype(policy, op, input_dtypes)
    assert _run_emulated(SAMPLES[op], policy, op)[0] == native


def test_cuda_fp16_emulation_runs_softmax_in_float32():
    x = torch.randn(2, 3, dtype=torch.float16)
    with emulate_autocast(get_policy("cuda", torch.float16)):
        assert x.softmax(-1).dtype == torch.float32
        assert F.softmax(x, -1).dtype == torch.float32
        assert torch.softmax(x, -1).dtype == torch.float32


@pytest.mark.parametrize("call", [
    lambda x: x.softmax(-1), lambda x: F.layer_norm(x, (3,)), lambda x: x.sum(), lambda x: x.exp()])
def test_softmax_layer_norm_sum_and_exp_differ_between_cpu_and_cuda_fp16(call):
    x = torch.randn(2, 3, dtype=torch.float16)
    with native_autocast(get_policy("cpu", torch.float16)):
        assert call(x).dtype == torch.float16
    with emulate_autocast(get_policy("cuda", torch.float16)):
        assert call(x).dtype == torch.float32


def test_backward_through_emulated_casts_gives_float32_param_grads_and_float16_activation_grads():
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with emulate_autocast(get_policy("cuda", torch.float16)):
        logits = linear(x)
        probs = logits.softmax(-1)
    logits.retain_grad()
    probs.retain_grad()
    (probs * torch.arange(3.0)).sum().backward()
    assert (logits.dtype, probs.dtype) == (torch.float16, torch.float32)
    assert (logits.grad.dtype, probs.grad.dtype) == (torch.float16, torch.float32)
    assert linear.weight.grad.dtype == linear.bias.grad.dtype == torch.float32
    # The same numbers as casting by hand, as CUDA autocast would.
    expected = torch.nn.Linear(4, 3)
    expected.load_state_dict(linear.state_dict())
    hand = F.linear(x.half(), expected.weight.half(), expected.bias.half()).float().softmax(-1)
    (hand * torch.arange(3.0)).sum().backward()
    assert torch.equal(linear.weight.grad, expected.weight.grad)


def _graph_nodes(output, name):
    seen, todo, found = set(), [output.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        found += type(node).__name__ == name
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found


def test_a_float32_weight_used_twice_is_cast_once_per_region():
    weight = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)
    with emulate_autocast(get_policy("cuda", torch.float16)):
        twice = F.linear(x, weight) + F.linear(x, weight)
    assert _graph_nodes(twice, "ToCopyBackward0") == 1
    with emulate_autocast(get_policy("cuda", torch.float16), cache_enabled=False):
        twice = F.linear(x, weight) + F.linear(x, weight)
    assert _graph_nodes(twice, "ToCopyBackward0") == 2


def test_float64_and_integer_inputs_are_left_alone():
    with emulate_autocast(get_policy("cuda", torch.float16)):
        assert torch.mm(torch.randn(2, 2, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)).dtype \
            == torch.float64
        assert torch.arange(3).sum().dtype == torch.int64
        assert torch.exp(torch.randn(2, dtype=torch.float64)).dtype == torch.float64


def test_an_explicit_dtype_or_out_argument_is_respected():
    x = torch.randn(3, dtype=torch.float16)
    out = torch.empty(3, dtype=torch.float16)
    with emulate_autocast(get_policy("cuda", torch.float16)):
        assert x.softmax(0, dtype=torch.float16).dtype == torch.float16
        assert x.sum(dtype=torch.float16).dtype == torch.float16
        assert torch.exp(x, out=out).dtype == torch.float16


@pytest.mark.parametrize("call", [
    lambda x: F.normalize(x, dim=1), lambda x: 1 / x, lambda x: 2 ** x, lambda x: F.softmin(x, 1),
    lambda x: F.cross_entropy(x, torch.zeros(3, dtype=torch.long, device=x.device)),
    lambda x: F.interpolate(x.unsqueeze(0), scale_factor=2),
    lambda x: F.interpolate(x.unsqueeze(0), scale_factor=2, mode="area"),
    lambda x: torch.linalg.norm(x), lambda x: torch.arccos(x), lambda x: x.mean(),
], ids=["normalize", "rdiv", "rpow", "softmin", "cross_entropy", "nearest", "area", "linalg_norm", "arccos",
        "mean"])
def test_python_composites_and_aliases_get_the_cuda_dtype(call):
    policy = get_policy("cuda", torch.float16)
    on_device, _ = _run_on_fake_cuda(lambda f: call(f(3, 4)), policy, "")
    with emulate_autocast(policy):
        assert call(torch.randn(3, 4, dtype=torch.float16)).dtype == on_device


class _AttentionBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.norm, self.head = torch.nn.Linear(16, 48), torch.nn.LayerNorm(16), torch.nn.Linear(16, 10)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))

    def forward(self, x):
        h = self.norm(x + F.scaled_dot_product_attention(*self.qkv(x).chunk(3, -1)))
        return self.head(h + self.mlp(h)).log_softmax(-1)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_every_module_of_a_small_attention_model_gets_the_cuda_dtype_under_emulation(dtype):
    torch.manual_seed(0)
    model, x = _AttentionBlock(), torch.randn(2, 5, 16)

    def module_dtypes(run):
        seen = []
        hooks = [module.register_forward_hook(lambda m, i, out, name=name: seen.append((name, out.dtype)))
                 for name, module in model.named_modules()]
        try:
            run()
        finally:
            for hook in hooks:
                hook.remove()
        return seen

    with emulate_autocast(get_policy("cuda", dtype)):
        emulated = module_dtypes(lambda: model(x))
    with _cuda_autocast_on_fake_tensors(dtype) as mode:
        # Made under the mode's own dispatch, a FakeTensor would refuse real inputs.
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            fake = lambda t: FakeTensor(mode, t.detach().to("meta"), torch.device("cuda"))  # noqa: E731
            params, fake_x = {name: fake(t) for name, t in model.named_parameters()}, fake(x)
        on_device = module_dtypes(lambda: functional_call(model, params, (fake_x,)))
    assert emulated == on_device
    assert dict(emulated)["norm"] == dict(emulated)[""] == torch.float32 and dict(emulated)["head"] == dtype


def test_autocast_disabled_inside_the_model_turns_the_emulation_off_there():
    x = torch.randn(2, 3)
    with emulate_autocast(get_policy("cuda", torch.float16)):
        with warnings.catch_warnings(), torch.autocast("cuda", enabled=False):
            warnings.simplefilter("ignore")
            assert F.linear(x, torch.randn(3, 3)).dtype == torch.float32
        assert F.linear(x, torch.randn(3, 3)).dtype == torch.float16


def test_autocast_on_the_replay_device_type_inside_the_model_turns_the_emulation_off_there():
    # The Hugging Face rotary-embedding pattern: float32 frequencies whatever the outer autocast.
    x = torch.randn(2, 3)
    with emulate_autocast(get_policy("cuda", torch.float16), run_device_type="cpu"):
        with torch.autocast(x.device.type, enabled=False):
            assert (x @ x.T).dtype == torch.float32
        assert (x @ x.T).dtype == torch.float16
        with torch.autocast("mps", enabled=False):  # neither the policy's nor the replay's device
            assert (x @ x.T).dtype == torch.float16


def test_emulation_restores_native_autocast_state_and_models_see_autocast_enabled():
    before = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda", "xpu")]
    with emulate_autocast(get_policy("cuda", torch.bfloat16)):
        assert torch.is_autocast_enabled() and torch.get_autocast_dtype("cuda") == torch.bfloat16
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert not torch.is_autocast_enabled("xpu")
    assert [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda", "xpu")] == before


def test_checkpointed_blocks_recompute_under_the_emulation_when_backward_runs_inside():
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1), torch.nn.Linear(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    with emulate_autocast(get_policy("cuda", torch.float16)):
        out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        out.float().sum().backward()
    grad = block[0].weight.grad.clone()
    block.zero_grad()
    with emulate_autocast(get_policy("cuda", torch.float16)):
        block(x).float().sum().backward()
    assert out.dtype == torch.float16 and torch.equal(grad, block[0].weight.grad)


def test_binary_cross_entropy_raises_under_the_cuda_policy_like_on_the_device():
    policy = get_policy("cuda", torch.float16)
    with pytest.raises(RuntimeError, match="unsafe to autocast"):
        _run_on_fake_cuda(SAMPLES["binary_cross_entropy"], policy, "binary_cross_entropy")
    with pytest.raises(RuntimeError, match="unsafe to autocast"):
        _run_emulated(SAMPLES["binary_cross_entropy"], policy, "binary_cross_entropy")


def test_promote_of_float16_with_bfloat16_raises_like_the_device():
    with emulate_autocast(get_policy("cuda", torch.float16)), pytest.raises(RuntimeError, match="prioritize"):
        torch.addcmul(torch.randn(2, dtype=torch.float16), torch.randn(2), torch.randn(2, dtype=torch.bfloat16))


@pytest.mark.parametrize("spelling", ["float16", "fp16", "half", "FP16", torch.float16])
def test_get_policy_accepts_dtype_spellings_and_device_indices(spelling):
    assert get_policy("cuda:1", spelling) == get_policy("cuda", torch.float16)


@pytest.mark.parametrize("device_type,dtype", [("xpu", "fp16"), ("cuda", "float32"), ("cuda", "fp8"),
                                               ("gpu", "bf16"), (None, "bf16")])
def test_get_policy_rejects_unknown_combinations_with_a_one_line_message(device_type, dtype):
    with pytest.raises(UnknownPolicyError) as error:
        get_policy(device_type, dtype)
    assert isinstance(error.value, ValueError) and "\n" not in str(error.value)
    assert repr(dtype) in str(error.value)


def test_rule_names_ops_by_aten_name_overload_alias_or_tensor_method():
    policy = get_policy("cuda", torch.float16)
    assert policy.rule("aten::softmax.int") == policy.rule("Tensor.softmax") == "fp32"
    assert policy.rule("__matmul__") == "lower" and policy.rule("arctan2") == "promote"
    assert policy.rule("relu") is None and policy.rule("binary_cross_entropy") is None
    assert get_policy("cpu", torch.float16).rule("softmax") is None


def test_expected_output_dtype_follows_the_rule():
    policy = get_policy("cuda", torch.bfloat16)
    assert expected_output_dtype(policy, "linear", [torch.float32] * 3) == torch.bfloat16
    assert expected_output_dtype(policy, "softmax", [torch.bfloat16]) == torch.float32
    assert expected_output_dtype(policy, "addcmul", [torch.bfloat16, torch.float32, torch.bfloat16]) \
        == torch.float32
    assert expected_output_dtype(policy, "mm", [torch.float64, torch.float64]) == torch.float64
    assert expected_output_dtype(None, "softmax", [torch.float16]) == torch.float16


def test_autocast_context_picks_native_autocast_the_emulation_or_nothing():
    policy = get_policy("cuda", torch.float16)
    x, w = torch.randn(2, 3), torch.randn(3, 3)
    with autocast_context(policy, "cpu"):
        assert F.linear(x, w).dtype == torch.float16
    with autocast_context(get_policy("cpu", torch.bfloat16), torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu") and F.linear(x, w).dtype == torch.bfloat16
    with autocast_context(None, "cpu"):
        assert F.linear(x, w).dtype == torch.float32
