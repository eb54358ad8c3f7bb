"""The autocast op tables of the torch version we pin, as data: which ops
each policy (CUDA/CPU x float16/bfloat16) runs in the lower precision, in
float32, or at the widest input type. `policy.py` applies them."""
from __future__ import annotations

import torch

# ---------------------------------------------------------------------------
# Op tables of torch 2.13 (the version we pin), by aten op name; overloads of
# one op share its entry. CUDA: the AT_FORALL_* lists of the installed
# torch/include/ATen/autocast_mode.h, plus cudnn_convolution(_transpose) and
# the binary_cross_entropy ban from aten/src/ATen/autocast_mode.cpp. CPU: the
# AutocastCPU block of aten/src/ATen/autocast_mode.cpp (which lists only the
# 12-argument, deprecated overload of _convolution). tests/test_policy.py
# checks both sets against the kernels registered in the installed torch and
# the output dtype of every callable op against the real autocast kernels
# (CUDA ones on fake CUDA tensors).
# ---------------------------------------------------------------------------


# A replay under another torch version may meet other tables: worth a warning.
TABLES_TORCH_VERSION = "2.13"


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


_CUDA_LOWER = _names("""
    _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d
    conv_transpose3d convolution cudnn_convolution cudnn_convolution_transpose
    prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm
    baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell
    _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
    _scaled_dot_product_flash_attention scaled_dot_product_attention""")
_CUDA_FP32 = _names("""
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh
    tan pow softplus layer_norm native_layer_norm rms_norm group_norm
    frobenius_norm nuclear_norm cosine_similarity poisson_nll_loss
    cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div
    l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss
    multilabel_margin_loss soft_margin_loss triplet_margin_loss
    multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm
    logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d
    _upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d
    upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa
    upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa""")
# These run in float32 by getting dtype=float32 when the caller gave none,
# not by casting their input (fp32_set_opt_dtype / fp32_append_dtype).
_CUDA_FP32_BY_DTYPE = _names("""
    prod softmax log_softmax cumprod cumsum linalg_vector_norm
    linalg_matrix_norm sum norm""")
_CUDA_PROMOTE = _names("""
    addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put
    tensordot scatter_add""")
# CUDA autocast raises for it; CPU autocast runs it in float32.
_CUDA_BANNED = _names("binary_cross_entropy")

_CPU_LOWER = _names("""
    conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm _addmm_activation
    addbmm linear _convolution matmul conv_tbc mkldnn_rnn_layer conv_transpose1d
    conv_transpose2d conv_transpose3d prelu scaled_dot_product_attention
    _native_multi_head_attention""")
_CPU_FP32 = _names("""
    avg_pool3d binary_cross_entropy grid_sampler polar prod quantile nanquantile
    stft cdist grid_sampler_2d _grid_sampler_2d_cpu_fallback grid_sampler_3d
    trace view_as_complex cholesky cholesky_inverse cholesky_solve inverse
    lu_solve orgqr ormqr pinverse max_pool3d max_unpool2d max_unpool3d
    adaptive_avg_pool3d reflection_pad1d reflection_pad2d replication_pad1d
    replication_pad2d replication_pad3d mse_loss cosine_embedding_loss nll_loss
    nll_loss2d hinge_embedding_loss poisson_nll_loss smooth_l1_loss
    cross_entropy_loss l1_loss huber_loss margin_ranking_loss soft_margin_loss
    triplet_margin_loss multi_margin_loss ctc_loss kl_div multilabel_margin_loss
    binary_cross_entropy_with_logits fft_fft fft_ifft fft_fft2 fft_ifft2
    fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn
    fft_irfftn fft_hfft fft_ihfft linalg_cond linalg_matrix_rank linalg_solve
    linalg_cholesky linalg_svdvals linalg_eigvals linalg_eigvalsh linalg_inv
    linalg_householder_product linalg_tensorinv linalg_tensorsolve
    fake_quantize_per_tensor_affine geqrf _lu_with_info qr svd triangular_solve
    fractional_max_pool2d fractional_max_pool3d adaptive_max_pool3d
    multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex linalg_svd
    linalg_eig linalg_eigh linalg_lstsq linalg_inv_ex""")
_CPU_PROMOTE = _names("stack cat index_copy")

# C++ composites that CUDA does not list but whose inner ops it does, so on
# the device they end up in these dtypes. The emulation cannot see inside a
# C++ composite, so it casts at its entry instead.
_CUDA_COMPOSITES = {
    # log_softmax (float32) then nll_loss (float32).
    "cross_entropy_loss": "fp32",
    # norm (float32) of x1 - x2 + eps. Approximation: on the device the
    # difference is taken in the input dtype, here in float32.
    "pairwise_distance": "fp32",
}
# nn.LSTM/GRU/RNN reach _cudnn_rnn, whose autocast wrapper (registered by
# aten/src/ATen/cudnn/AutocastRNN.cpp, so absent from a CPU build) casts
# input, weights and states to float16 whatever the autocast dtype is. That
# matches a float16 policy only; under bfloat16 these layers are left uncast
# (what a bfloat16 run on CUDA 2.13 does with them is unverified).
_CUDA_FP16_ONLY = {name: "lower" for name in ("_cudnn_rnn", "lstm", "gru", "rnn_tanh", "rnn_relu")}

# Python-visible names that are another name for a table op.
OP_ALIASES = {
    "__matmul__": "matmul", "linalg_matmul": "matmul",
    "arccos": "acos", "arcsin": "asin", "arctan2": "atan2",
    "special_expm1": "expm1", "special_log1p": "log1p", "special_erfinv": "erfinv",
    "special_logsumexp": "logsumexp", "special_softmax": "softmax",
    "special_log_softmax": "log_softmax",
    "linalg_norm": "linalg_vector_norm", "nll_loss_nd": "nll_loss",
}


def _kinds(lower, fp32, fp32_by_dtype, promote, banned) -> dict[str, str]:
    table = {name: "lower" for name in lower}
    table.update({name: "fp32" for name in fp32})
    table.update({name: "fp32_by_dtype" for name in fp32_by_dtype})
    table.update({name: "promote" for name in promote})
    table.update({name: "banned" for name in banned})
    return table


# Registered ops per device: exactly what the kernels of that device list.
REGISTERED_OPS = {
    "cuda": _kinds(_CUDA_LOWER, _CUDA_FP32, _CUDA_FP32_BY_DTYPE, _CUDA_PROMOTE, _CUDA_BANNED),
    "cpu": _kinds(_CPU_LOWER, _CPU_FP32, (), _CPU_PROMOTE, ()),
}
OP_TABLES = {
    ("cuda", torch.float16): {**_CUDA_COMPOSITES, **_CUDA_FP16_ONLY, **REGISTERED_OPS["cuda"]},
    ("cuda", torch.bfloat16): {**_CUDA_COMPOSITES, **REGISTERED_OPS["cuda"]},
    ("cpu", torch.float16): REGISTERED_OPS["cpu"],
    ("cpu", torch.bfloat16): REGISTERED_OPS["cpu"],
}
