"""k3pallas: fused Pallas (Triton backend) kernels for LLM inference on AMD ROCm and NVIDIA GPUs.

Public API (``import k3pallas as kp``):

* ``kp.fused_q_kv_rmsnorm``: MLA's joint q/kv RMSNorm in one launch; ``kp.rmsnorm``: one tensor.
* ``kp.mla_q_kv_norm``: the same straight from MLA's packed ``[q_c | kv_c | k_pe]`` projection.
* ``kp.rmsnorm_gated``: per-head ``rmsnorm(x) * weight * act(gate)`` (Kimi Delta Attention).
* ``kp.rmsnorm_gated_fp8_per_token``: that, fused with dynamic per-token FP8, in one launch.
* ``kp.per_token_fp8_quant``: dynamic per-token FP8 of an already-normed activation.
* ``kp.sigmoid_mul_fp8_per_token``: MLA's output gate ``x * sigmoid(gate)`` fused with per-token
  FP8 (the o_proj input), in one launch.
* ``kp.fused_q_kv_rmsnorm_fp8`` / ``kp.mla_q_kv_norm_fp8``: the joint norm with q quantized to
  per-token FP8 (the q_b projection input), in one launch.
* ``kp.rmsnorm_gated_quant``, ``kp.sigmoid_mul_quant``, ``kp.quantize_activation``,
  ``kp.fused_q_kv_rmsnorm_quant``, ``kp.mla_q_kv_norm_quant``: the quantizing fusions by
  ``out_format``: per-token FP8 (the functions above), MXFP8 or MXFP4 (``k3pallas.mx``; the
  operands of ``jax.nn.scaled_matmul``); ``kp.quantize_weight_mx`` and ``kp.mx_linear``.
* ``kp.quantize_weight_per_channel`` and ``kp.fp8_linear``: the FP8 matmul that consumes the
  quantized activation (``linear.py``; XLA's vendor FP8 GEMM, no Pallas).
* ``kp.QuantizedActivation``, ``kp.default_fp8_dtype`` and the ``FP8_*_MAX`` constants;
  ``kp.fp8_cast_decisions()``: which FP8 conversion the kernels use, and why.

Where things are: ``api.py`` (these functions: argument checks and docs), ``ops.py`` (the op
table: each op's sharding rule, reference, benchmark shapes; the one dispatch),
``reference.py`` (the jnp semantics), ``kernels/`` (the backend: Pallas Triton kernels, their
launch configs in ``kernels/launch.py``, the FP8 conversion choice in ``kernels/fp8_cast.py``),
``platform.py`` (targets), ``fp8.py`` (format rules and the bit encoder), ``mx.py`` (MX
format rules), ``sharding.py``
(partitioning rules), ``linear.py`` (FP8 matmul), ``models/`` (runnable Kimi-K3 blocks),
``testing.py`` (tooling for tests and bench only), ``_compat.py`` (every private-jax use).
"""

from k3pallas import reference
from k3pallas.api import *  # noqa: F403  (the public functions: api.__all__)
from k3pallas.api import __all__ as _api_all
from k3pallas.fp8 import (
    FP8_E4M3FN_MAX,
    FP8_E4M3FNUZ_MAX,
    FP8_E4M3FNUZ_MAX_AITER,
    FP8_E5M2_MAX,
    QuantizedActivation,
    default_fp8_dtype,
)
from k3pallas.kernels.fp8_cast import decisions as fp8_cast_decisions
from k3pallas.linear import (QuantizedWeight, fp8_linear, mx_linear, quantize_weight_mx,
                             quantize_weight_per_channel)
from k3pallas.platform import current_target

__version__ = "0.1.0"

__all__ = [
    *_api_all, "quantize_weight_per_channel", "fp8_linear", "quantize_weight_mx", "mx_linear", "QuantizedActivation", "QuantizedWeight", "default_fp8_dtype", "current_target", "fp8_cast_decisions",
    "FP8_E4M3FN_MAX", "FP8_E4M3FNUZ_MAX", "FP8_E4M3FNUZ_MAX_AITER", "FP8_E5M2_MAX", "reference",
]
