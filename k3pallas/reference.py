"""Pure jnp references: the exact semantics every kernel implements, compiled by XLA anywhere.

These are first-class implementations (``impl="reference"`` in the public API calls them) and
differentiable plain functions. They take already-validated arguments with the fp8 options
resolved; the public API in ``k3pallas.api`` does the checking. Math is float32, with one cast at
the end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3pallas import mx as mx_lib

__all__ = [
    "rmsnorm", "fused_q_kv_rmsnorm", "mla_q_kv_norm", "rmsnorm_gated", "per_token_fp8_quant",
    "rmsnorm_gated_fp8_per_token", "sigmoid_mul_fp8_per_token", "fused_q_kv_rmsnorm_fp8",
    "mla_q_kv_norm_fp8", "activation_fn", "mx_quantize", "mx_quant", "sigmoid_mul_mx",
    "rmsnorm_gated_mx", "fused_q_kv_rmsnorm_mx", "mla_q_kv_norm_mx",
]


def _inv_rms(xf, eps):
    """``rsqrt(mean(xf**2, -1) + eps)``; NaN where the float32 mean square is not finite (it
    overflows from about |x| = 1.8e19: a NaN row, not a silent zero)."""
    ms = jnp.mean(xf * xf, axis=-1, keepdims=True)
    return jnp.where(ms < jnp.inf, jax.lax.rsqrt(ms + eps), jnp.nan)


def _rmsnorm_f32(x, weight, eps):
    """``x * rsqrt(mean(x**2, -1) + eps) * weight`` in float32 (the normalized ``y`` every
    reference norm starts from); a row whose float32 sum of squares is not finite is NaN."""
    xf = x.astype(jnp.float32)
    return xf * _inv_rms(xf, eps) * weight.astype(jnp.float32)


def rmsnorm(x, weight, eps):
    """``_rmsnorm_f32`` cast to ``x.dtype``."""
    return _rmsnorm_f32(x, weight, eps).astype(x.dtype)


def fused_q_kv_rmsnorm(q_c, kv_c, q_weight, kv_weight, eps, kv_eps):
    return rmsnorm(q_c, q_weight, eps), rmsnorm(kv_c, kv_weight, kv_eps)


def mla_q_kv_norm(qkv_a, q_weight, kv_weight, eps, kv_eps, q_size, kv_size):
    """Slice the packed ``[..., q_size + kv_size + rope]`` rows, normalize q and kv, pass k_pe."""
    q = qkv_a[..., :q_size]
    kv = qkv_a[..., q_size:q_size + kv_size]
    return rmsnorm(q, q_weight, eps), rmsnorm(kv, kv_weight, kv_eps), qkv_a[..., q_size + kv_size:]


def activation_fn(name):
    if name == "sigmoid":
        return jax.nn.sigmoid
    if name == "silu":
        return jax.nn.silu
    raise ValueError(f"activation must be 'sigmoid' or 'silu', got {name!r}")


def _gated_f32(x, weight, gate, eps, activation):
    return _rmsnorm_f32(x, weight, eps) * activation_fn(activation)(gate.astype(jnp.float32))


def rmsnorm_gated(x, weight, gate, eps, activation):
    """Per head (last axis): ``rmsnorm(x) * weight * act(gate)``, float32 math, ``x.dtype`` out."""
    return _gated_f32(x, weight, gate, eps, activation).astype(x.dtype)


def per_token_fp8_quant(x, fp8):
    """Dynamic per-token FP8 of ``x [..., N]`` (any float dtype; math in float32), with the
    resolved options ``fp8`` (``k3pallas.fp8.resolve_fp8_params``; its ``cast`` is the kernels'
    business and ignored here: XLA's cast).

    ``amax = max|y|`` over the row; ``scale = max(min(amax, scale_ub) / fp8_max, min_scale)``;
    ``data = clamp(y / scale, -fp8_max, fp8_max).astype(fp8_dtype)`` (XLA's cast rounds to nearest
    even). A row holding a NaN or an infinity gets a NaN scale and NaN codes (made explicit: XLA's
    CPU max-reduction can drop NaN). Returns ``(data [..., N], scale [..., 1] float32)``.
    """
    fp8_dtype, fp8_max, min_scale, scale_ub = fp8.dtype, fp8.fp8_max, fp8.min_scale, fp8.scale_ub
    y = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(y), axis=-1, keepdims=True)
    if scale_ub is not None:
        amax = jnp.minimum(amax, scale_ub)
    scale = jnp.maximum(amax / fp8_max, min_scale)
    scale = jnp.where(jnp.all(jnp.isfinite(y), axis=-1, keepdims=True), scale, jnp.nan)
    data = jnp.clip(y / scale, -fp8_max, fp8_max).astype(fp8_dtype)
    return data, scale


def rmsnorm_gated_fp8_per_token(x, weight, gate, eps, activation, fp8):
    """``per_token_fp8_quant`` of the float32 gated RMSNorm of ``x [..., H, D]``, over all heads."""
    y = _gated_f32(x, weight, gate, eps, activation)
    y = y.reshape(*y.shape[:-2], y.shape[-2] * y.shape[-1])
    return per_token_fp8_quant(y, fp8)


def sigmoid_mul_fp8_per_token(x, gate, fp8):
    """``per_token_fp8_quant`` of ``x * sigmoid(gate)`` computed in float32 (MLA's output gate)."""
    y = x.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))
    return per_token_fp8_quant(y, fp8)


def fused_q_kv_rmsnorm_fp8(q_c, kv_c, q_weight, kv_weight, eps, kv_eps, fp8):
    """q normalized in float32 and quantized per token (never rounded to ``q_c.dtype`` first);
    kv as ``rmsnorm``. Returns ``(q data [..., Dq], q scale [..., 1], kv_out)``."""
    data, scale = per_token_fp8_quant(_rmsnorm_f32(q_c, q_weight, eps), fp8)
    return data, scale, rmsnorm(kv_c, kv_weight, kv_eps)


def mla_q_kv_norm_fp8(qkv_a, q_weight, kv_weight, eps, kv_eps, q_size, kv_size, fp8):
    """``fused_q_kv_rmsnorm_fp8`` of the packed rows' q and kv, and k_pe passed through:
    ``(q data, q scale [..., 1], kv_out, k_pe)``."""
    q = qkv_a[..., :q_size]
    kv = qkv_a[..., q_size:q_size + kv_size]
    return (*fused_q_kv_rmsnorm_fp8(q, kv, q_weight, kv_weight, eps, kv_eps, fp8),
            qkv_a[..., q_size + kv_size:])


# ------------------------------------------------------------------------------------------------
# MX block-scaled formats (k3pallas.mx): jax's own MX quantization, per block of 32
# ------------------------------------------------------------------------------------------------


def mx_quantize(y, mx):
    """MX of ``y [..., B, 32]`` (math in float32) with the resolved options ``mx``
    (``k3pallas.mx.MxParams``): ``(elements [..., B, 32], float8_e8m0fnu scales [..., B])``.

    As ``jax._src.cudnn.scaled_matmul_stablehlo.quantize`` in IEEE arithmetic: ``scale`` =
    ``amax / elem_max`` rounded up to a power of two (e8m0), ``data = clip(y / scale)`` cast
    with round-to-nearest-even; a block holding NaN or inf gets the NaN scale (code 255) and
    NaN codes (MXFP4: 0x8). The scale code by ``mx.scale_code`` (equal to jax's rule on the
    IEEE quotient) and ``y`` times the exact reciprocal: jax's own division by the subnormal
    ``2**-127`` is flushed on XLA's CPU (a zero block becomes NaN codes there). See
    ``k3pallas.mx``.
    """
    fmt = mx.fmt
    y = y.astype(jnp.float32)
    amax = jnp.max(jnp.abs(y), axis=-1)
    nonfinite = ~jnp.all(jnp.isfinite(y), axis=-1)  # explicit: XLA's CPU max can drop NaN
    code = mx_lib.scale_code(amax, fmt, nonfinite)
    v = y * mx_lib.inv_scale(code)[..., None]
    data = jnp.clip(v, -fmt.elem_max, fmt.elem_max).astype(fmt.dtype)
    return data, mx_lib.as_e8m0(code)


def _blocks(y):
    return y.reshape(*y.shape[:-1], y.shape[-1] // mx_lib.BLOCK, mx_lib.BLOCK)


def mx_quant(x, mx):
    """``x [..., B, 32]`` -> ``mx_quantize(x)``."""
    return mx_quantize(x, mx)


def sigmoid_mul_mx(x, gate, mx):
    """MX of ``x * sigmoid(gate)`` in float32, ``x``, ``gate`` ``[..., B, 32]``."""
    return mx_quantize(x.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32)), mx)


def rmsnorm_gated_mx(x, weight, gate, eps, activation, mx):
    """MX of the float32 gated RMSNorm of ``x [..., H, B, 32]`` per head (``weight [B, 32]``)."""
    heads = x.shape[:-2] + (x.shape[-2] * x.shape[-1],)
    y = _gated_f32(x.reshape(heads), weight.reshape(-1), gate.reshape(heads), eps, activation)
    return mx_quantize(y.reshape(x.shape), mx)


def fused_q_kv_rmsnorm_mx(q_c, kv_c, q_weight, kv_weight, eps, kv_eps, mx):
    """q normalized in float32 and MX-quantized (never rounded to ``q_c.dtype`` first); kv as
    ``rmsnorm``. Returns ``(q elements [..., Dq], q scales [..., Dq / 32], kv_out)``."""
    data, scale = mx_quantize(_blocks(_rmsnorm_f32(q_c, q_weight, eps)), mx)
    return data.reshape(q_c.shape), scale, rmsnorm(kv_c, kv_weight, kv_eps)


def mla_q_kv_norm_mx(qkv_a, q_weight, kv_weight, eps, kv_eps, q_size, kv_size, mx):
    """``fused_q_kv_rmsnorm_mx`` of the packed rows' q and kv, k_pe passed through."""
    q = qkv_a[..., :q_size]
    kv = qkv_a[..., q_size:q_size + kv_size]
    return (*fused_q_kv_rmsnorm_mx(q, kv, q_weight, kv_weight, eps, kv_eps, mx),
            qkv_a[..., q_size + kv_size:])
