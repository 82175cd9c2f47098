"""Pure jnp references: the exact semantics every kernel implements, compiled by XLA anywhere.

These are first-class implementations (``impl="reference"`` in the public API calls them) and
differentiable plain functions. They take already-validated arguments; the public API in
``k3pallas.api`` does the checking. Math is float32, with one cast at the end. ``fmt``: the
output format (``k3pallas.formats``, resolved), whose ``quantize`` is the quantization's
semantics; None for an unquantized output in the input's dtype. Quantized outputs are
``(data, scale)`` pairs (``QuantizedActivation``'s arrays).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["rmsnorm", "add_rmsnorm", "fused_q_kv_rmsnorm", "mla_q_kv_norm", "rmsnorm_gated",
           "sigmoid_mul", "quantize", "activation_fn"]


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


def _out(y, dtype, fmt):
    """float32 ``y`` as the op's output: cast to ``dtype``, or quantized to ``fmt``."""
    return y.astype(dtype) if fmt is None else fmt.quantize(y)


def rmsnorm(x, weight, eps, fmt=None):
    """``x * rsqrt(mean(x**2, -1) + eps) * weight`` over the last axis."""
    return _out(_rmsnorm_f32(x, weight, eps), x.dtype, fmt)


def add_rmsnorm(x, residual, weight, eps, fmt=None):
    """``r = x + residual`` (float32 sum, one rounding to ``x.dtype``), then ``rmsnorm(r)`` of that
    stored sum: ``(y, r)``, or with ``fmt`` ``(data, scale, r)``. The barrier keeps the rounding:
    XLA's GPU backend (``xla_allow_excess_precision``, on by default) otherwise drops the
    ``float32 -> bf16 -> float32`` pair and normalizes the unrounded sum."""
    r = (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(x.dtype)
    y = rmsnorm(jax.lax.optimization_barrier(r), weight, eps, fmt)
    return (y, r) if fmt is None else (*y, r)


def fused_q_kv_rmsnorm(q_c, kv_c, q_weight, kv_weight, eps, kv_eps, fmt=None):
    """``(rmsnorm(q_c), rmsnorm(kv_c))``; with ``fmt``, q quantized from its float32 norm (never
    rounded to ``q_c.dtype`` first): ``(q data, q scale, kv_out)``."""
    q = _out(_rmsnorm_f32(q_c, q_weight, eps), q_c.dtype, fmt)
    kv = rmsnorm(kv_c, kv_weight, kv_eps)
    return (q, kv) if fmt is None else (*q, kv)


def mla_q_kv_norm(qkv_a, q_weight, kv_weight, eps, kv_eps, q_size, kv_size, fmt=None):
    """Slice the packed ``[..., q_size + kv_size + rope]`` rows, normalize q and kv as
    ``fused_q_kv_rmsnorm``, pass k_pe through."""
    q = qkv_a[..., :q_size]
    kv = qkv_a[..., q_size:q_size + kv_size]
    return (*fused_q_kv_rmsnorm(q, kv, q_weight, kv_weight, eps, kv_eps, fmt),
            qkv_a[..., q_size + kv_size:])


def activation_fn(name):
    if name == "sigmoid":
        return jax.nn.sigmoid
    if name == "silu":
        return jax.nn.silu
    raise ValueError(f"activation must be 'sigmoid' or 'silu', got {name!r}")


def rmsnorm_gated(x, weight, gate, eps, activation, fmt=None):
    """Per head (last axis of ``x [..., H, D]``): ``rmsnorm(x) * weight * act(gate)``; with
    ``fmt``, that quantized over each token's ``H * D`` values: ``data [..., H * D]``."""
    y = _rmsnorm_f32(x, weight, eps) * activation_fn(activation)(gate.astype(jnp.float32))
    if fmt is None:
        return y.astype(x.dtype)
    return fmt.quantize(y.reshape(y.shape[:-2] + (y.shape[-2] * y.shape[-1],)))


def sigmoid_mul(x, gate, fmt=None):
    """``x * sigmoid(gate)`` in float32 (MLA's output gate)."""
    return _out(x.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32)), x.dtype, fmt)


def quantize(x, fmt):
    """``x`` (any float dtype) quantized to ``fmt``."""
    return fmt.quantize(x)
