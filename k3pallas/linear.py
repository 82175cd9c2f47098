"""The consumer of the quantized activations: weight quantization and one linear for every format.

No Pallas here. Per-token FP8: ``jax.lax.dot_general`` on the fp8 operands with
``preferred_element_type=float32``, which XLA's GPU compiler rewrites into a vendor FP8 GEMM
(``__cublas$lt$matmul$f8``: cuBLASLt on NVIDIA sm_89+, hipBLASLt on AMD MI300 and later; see
docs/formats.md for when it does and what it does otherwise); those GEMMs take only scalar
scales, so the per-token and per-channel scales multiply the float32 result afterwards, in one
XLA elementwise fusion. MX: ``jax.nn.scaled_matmul`` on a GPU (on gfx950 XLA's Triton
``scaled-dot`` on the MX matrix cores).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from k3pallas import formats, ops, platform
from k3pallas._checks import FLOAT_DTYPES
from k3pallas.formats import QuantizedActivation, QuantizedWeight

__all__ = ["quantize_weight", "linear"]


def quantize_weight(w, out_format, *, layout="nk") -> QuantizedWeight:
    """Quantize a weight ``w [K, N]`` (``x @ w``) for ``linear`` with activations of
    ``out_format``.

    * per-token FP8 (``"fp8_per_token"`` / ``Fp8PerToken(dtype=, fp8_max=)``): symmetric per
      output channel, ``scale[n] = max_k |w[k, n]| / fp8_max``, ``data = RNE(w / scale)``; a
      column of zeros gets ``scale = 1`` (zero codes), a column holding NaN a NaN scale, one
      holding inf ``scale = inf`` (its finite entries' codes 0, the infinite ones NaN): such a
      weight has no FP8 form. dtype by device (``default_fp8_dtype``) unless given; ``fp8_max``
      the format's per-token default. ``min_scale``, ``scale_ub`` and ``groups`` are refused.
    * MX (``"mxfp8"`` / ``"mxfp4"``): jax's MX rule per output channel and block of 32 along K
      (K a multiple of 32), the activations' rule.

    ``layout``: how data and scale are stored: ``"nk"`` (default, data ``[N, K]``: what the FP8
    GEMMs and ``jax.nn.scaled_matmul`` read without a transpose; with ``"kn"`` XLA transposes
    the weight in every call, twice the time on an H200) or ``"kn"`` (``[K, N]`` like ``w``).

    Returns: a ``QuantizedWeight``. Inference-only: a gradient raises TypeError.
    """
    op = "quantize_weight"
    if not hasattr(w, "shape") or not hasattr(w, "dtype"):
        raise TypeError(f"{op}: w must be an array, got {type(w).__name__}")
    if w.ndim != 2 or 0 in w.shape:
        raise ValueError(f"{op}: w must be a non-empty [K, N] matrix, got shape {tuple(w.shape)}")
    if jnp.dtype(w.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{op}: w must be float16, bfloat16 or float32, got {w.dtype}")
    if layout not in formats.LAYOUTS:
        raise ValueError(f"{op}: layout must be 'nk' or 'kn', got {layout!r}")
    try:
        asked = formats.as_format(out_format)
        if asked.block is None and (asked.min_scale is not None or asked.scale_ub is not None
                                    or asked.groups != 1):
            raise ValueError("min_scale, scale_ub and groups apply to activations; a weight has "
                             "one scale per output channel")
        fmt = asked.resolve(platform.current_target(w))
        if fmt.block is not None:
            fmt.check_width(w.shape[0], "K (the first dim of w)")
    except (TypeError, ValueError) as e:
        raise type(e)(f"{op}: {e}") from None

    def quantize(w):
        wf = w.astype(jnp.float32)
        if fmt.block is None:
            amax = jnp.max(jnp.abs(wf), axis=0)
            scale = jnp.where(amax > 0, amax / fmt.fp8_max, 1.0)
            scale = jnp.where(jnp.any(jnp.isnan(wf), axis=0), jnp.nan, scale)
            codes = jnp.clip(wf / scale, -fmt.fp8_max, fmt.fp8_max).astype(fmt.dtype)
            return codes.T, scale.astype(jnp.float32)  # [N, K], [N]
        return fmt.quantize(wf.T)  # per output channel n, blocks along K: [N, K], [N, K / 32]

    data, scale = ops.inference_only(op, quantize, w)
    if layout == "kn":
        data, scale = data.T, (scale if scale.ndim < 2 else scale.T)
    return QuantizedWeight._unchecked(data, scale, fmt, layout)


def _same_family(op, qa, qw):
    a, b = qa.format, qw.format
    if a.block != b.block or (a.block is not None and a.name != b.name):
        raise TypeError(f"{op}: the activation is {a.name} and the weight {b.name}; quantize the "
                        "weight with the activation's format (quantize_weight)")
    if jnp.dtype(a.dtype) != jnp.dtype(b.dtype):
        raise TypeError(f"{op}: the activation's elements are {jnp.dtype(a.dtype).name} and the "
                        f"weight's {jnp.dtype(b.dtype).name}: they must be the same")


def linear(qa: QuantizedActivation, qw: QuantizedWeight, *, out_dtype=jnp.bfloat16,
           precision=None, impl="auto"):
    """``dequant(qa) @ dequant(qw)``, float32 accumulation, one rounding to ``out_dtype``.

    Args:
      qa: a ``QuantizedActivation`` ``[..., K]`` of any format (from an op or built by hand).
      qw: the ``QuantizedWeight`` of ``quantize_weight`` for the same format (the same element
        dtype; its layout travels with it), standing for ``w [K, N]``.
      out_dtype: float16, bfloat16 (default) or float32.
      precision: per-token FP8 only (ValueError with an MX format): passed to ``dot_general``
        (XLA maps it onto the FP8 GEMM's accumulation mode); ``impl="reference"`` computes at
        ``Precision.HIGHEST`` whatever is given.
      impl: "auto": the vendor path (per-token FP8: ``dot_general`` on the fp8 operands; MX:
        ``jax.nn.scaled_matmul`` on a GPU target, the reference elsewhere: it has no CPU
        lowering); "reference": the dequantized operands' float32 dot (``Precision.HIGHEST``).

    Returns: ``[..., N]`` in ``out_dtype``. Per-token FP8 with ``G`` scale groups:
    ``sum_g (data_g @ w_g)_f32 * scale[..., g] * w_scale``, one batched matmul over the groups.
    """
    op = "linear"
    if not isinstance(qa, QuantizedActivation):
        raise TypeError(f"{op}: qa must be a QuantizedActivation, got {type(qa).__name__}")
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"{op}: qw must be a QuantizedWeight (quantize_weight), got "
                        f"{type(qw).__name__}")
    _same_family(op, qa, qw)
    k, n = qw.shape
    data, scale = qa.data, qa.scale
    if data.shape[-1] != k:
        raise ValueError(f"{op}: qa.data [..., K] and the weight [K, N] = {list(qw.shape)} need the "
                         f"same K; got data {tuple(data.shape)}")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    if impl not in ("auto", "reference"):
        raise ValueError(f"{op}: impl must be 'auto' or 'reference', got {impl!r}")
    if precision is not None and qa.format.block is not None:
        raise ValueError(f"{op}: precision applies to per-token FP8 (dot_general); "
                         f"jax.nn.scaled_matmul takes none for {qa.format.name}")
    lead = data.shape[:-1]
    if impl == "reference":
        a = qa.dequantize().reshape(-1, k)
        out = jnp.dot(a, qw.dequantize(), precision=lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)
    elif qa.format.block is None:
        out = _fp8_per_token(data, scale, qw, k, n, precision)
    elif platform.current_target(data).is_gpu:
        w_data, w_scale = (qw.data, qw.scale) if qw.layout == "nk" else (qw.data.T, qw.scale.T)
        blocks = k // qa.format.block
        out = jax.nn.scaled_matmul(data.reshape(1, -1, k), w_data[None],
                                   scale.reshape(1, -1, blocks), w_scale[None],
                                   preferred_element_type=jnp.float32)
    else:  # jax.nn.scaled_matmul has no CPU lowering: the same sums, dequantized
        return linear(qa, qw, out_dtype=out_dtype, impl="reference")
    return out.reshape(lead + (n,)).astype(out_dtype)


def _fp8_per_token(data, scale, qw, k, n, precision):
    k_axis = 0 if qw.layout == "kn" else 1
    w, w_scale = qw.data, qw.scale
    groups = scale.shape[-1]
    if groups == 1:
        acc = lax.dot_general(data, w, (((data.ndim - 1,), (k_axis,)), ((), ())),
                              precision=precision, preferred_element_type=jnp.float32)
        acc = acc * scale
    else:
        kg = k // groups
        a3 = data.reshape(-1, groups, kg)  # [T, G, K/G]
        if qw.layout == "kn":
            w3, dims = w.reshape(groups, kg, n), (((2,), (1,)), ((1,), (0,)))  # [G, K/G, N]
        else:
            w3, dims = w.reshape(n, groups, kg), (((2,), (2,)), ((1,), (1,)))  # [N, G, K/G]
        part = lax.dot_general(a3, w3, dims, precision=precision,
                               preferred_element_type=jnp.float32)  # [G, T, N]
        s = scale.reshape(-1, groups).T[:, :, None]  # [G, T, 1]
        acc = jnp.sum(part * s, axis=0).reshape(data.shape[:-1] + (n,))
    return acc * w_scale
