"""k3pallas: fused Pallas (Triton backend) kernels for LLM inference on AMD ROCm and NVIDIA GPUs.

The public API (``import k3pallas as kp``); each op function takes its output format as
``out_format`` (None: unquantized; a ``k3pallas.formats`` value or its name):

* ``rmsnorm``, ``add_rmsnorm`` (the residual add fused into the norm, the residual updated in
  place), ``fused_q_kv_rmsnorm`` (MLA's joint q/kv norm, one launch), ``mla_q_kv_norm`` (the
  same from the packed ``[q_c | kv_c | k_pe]`` projection), ``rmsnorm_gated`` (Kimi Delta
  Attention's gated norm), ``sigmoid_mul`` (MLA's output gate), ``quantize``;
* ``quantize_weight``, ``weight_from_checkpoint`` (a block-FP8 checkpoint's weight as stored) and
  ``linear``: the matmul that consumes a quantized activation;
* ``rmsnorm_gated_fp8_per_token`` and ``per_token_fp8_quant``: the seed system's names, as
  shorthands for the per-token FP8 format;
* the formats (``Fp8PerToken``, ``MXFP8``, ``MXFP4``, ``Fp8Group``: ``FP8_GROUP128``,
  ``FP8_GROUP128_UE8M0``) and records (``QuantizedActivation``,
  ``QuantizedWeight``); ``default_fp8_dtype``, the ``FP8_*_MAX`` constants; ``current_target``
  and ``compiling_for`` (the device kernels are built for); ``fp8_cast_decisions()``.

Where things are: ``api.py`` (the op functions), ``formats.py`` (the formats and records),
``ops.py`` (the op table and the one call path), ``reference.py`` (the jnp semantics),
``kernels/`` (the Pallas Triton backend), ``linear.py``, ``platform.py`` (targets),
``sharding.py`` (partitioning rules), ``fp8.py`` (FP8 element formats and the bit encoder),
``models/`` (runnable Kimi-K3 blocks), ``testing.py`` (tooling for tests and bench only),
``_compat.py`` (every private-jax use).
"""

from k3pallas import formats, reference
from k3pallas.api import *  # noqa: F403  (the public functions: api.__all__)
from k3pallas.api import __all__ as _api_all
from k3pallas.fp8 import (
    FP8_E4M3FN_MAX,
    FP8_E4M3FNUZ_MAX,
    FP8_E4M3FNUZ_MAX_AITER,
    FP8_E5M2_MAX,
    default_fp8_dtype,
)
from k3pallas.formats import (FP8_GROUP128, FP8_GROUP128_UE8M0, MXFP4, MXFP8, Fp8Group,
                              Fp8PerToken, QuantizedActivation, QuantizedWeight)
from k3pallas.kernels.fp8_cast import decisions as fp8_cast_decisions
from k3pallas.linear import linear, quantize_weight, weight_from_checkpoint
from k3pallas.platform import compiling_for, current_target

__version__ = "0.1.0"

__all__ = [
    *_api_all, "quantize_weight", "weight_from_checkpoint", "linear", "Fp8PerToken", "MXFP8", "MXFP4", "Fp8Group",
    "FP8_GROUP128", "FP8_GROUP128_UE8M0",
    "QuantizedActivation", "QuantizedWeight", "default_fp8_dtype", "current_target",
    "compiling_for", "fp8_cast_decisions", "FP8_E4M3FN_MAX", "FP8_E4M3FNUZ_MAX",
    "FP8_E4M3FNUZ_MAX_AITER", "FP8_E5M2_MAX", "formats", "reference",
]
