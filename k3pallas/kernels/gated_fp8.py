"""Gated RMSNorm, its fusion with dynamic per-token FP8, and standalone per-token FP8: Pallas Triton.

One launch each, ``R`` tokens per program. The gated kernels load ``x`` and ``gate`` as
``[R, H, D]`` tiles (H and D padded to powers of two, masked), normalize per head over D, apply
``weight`` and the gate's activation, and then either store ``y`` or, for the FP8 fusion, reduce
``amax`` over the whole token (all heads), compute the token's scale and store the FP8 codes and
the scale: the gated activation never goes through memory.

FP8 codes are produced either by the integer encoder of ``k3pallas.fp8.encode_fp8`` (stored as
uint8 and bitcast outside: the Triton lowering refuses casts to ``float8_e4m3fnuz``), or by a
native cast where ``platform.native_fp8_cast`` allows it. Both round to nearest even.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from k3pallas import fp8 as fp8_lib
from k3pallas import platform
from k3pallas.kernels import common


def _activation(g, name: str):
    sig = 1.0 / (1.0 + jnp.exp(-g))
    return sig if name == "sigmoid" else g * sig


def _gated(x_ref, g_ref, w_ref, index, mask, w_index, w_lanes, width, eps, activation):
    """float32 ``rmsnorm(x) * w * act(g)`` of a [R, H, D] tile, normalized over the last axis."""
    x = common.load(x_ref, index, mask).astype(jnp.float32)
    g = common.load(g_ref, index, mask).astype(jnp.float32)
    w = common.load(w_ref, w_index, w_lanes).astype(jnp.float32)
    ms = jnp.sum(x * x, axis=-1, keepdims=True) / width
    return x * lax.rsqrt(ms + eps) * w[None, None, :] * _activation(g, activation)


def _quantize(y, valid, q: fp8_lib.Fp8Params):
    """Per-row FP8 of a float32 tile ``y [R, ...]``: returns ``(codes like y, scale [R])``.

    Only ``valid`` lanes enter the amax. A NaN anywhere in a row's valid lanes makes its scale NaN
    explicitly (Triton's max-reduction ignores NaN), so every code of that row is NaN.
    """
    a = jnp.where(valid, jnp.abs(y), 0.0)
    nan = jnp.where(valid & (y != y), 1.0, 0.0)
    while a.ndim > 1:
        a = jnp.max(a, axis=-1)
        nan = jnp.max(nan, axis=-1)
    if q.scale_ub is not None:
        a = jnp.minimum(a, q.scale_ub)
    scale = jnp.maximum(a / q.fp8_max, q.min_scale)
    scale = jnp.where(nan > 0.0, jnp.nan, scale)
    v = y / lax.expand_dims(scale, tuple(range(1, y.ndim)))
    # Clamp with comparisons so that NaN passes through to the encoder (min/max might drop it).
    v = jnp.where(v > q.fp8_max, q.fp8_max, jnp.where(v < -q.fp8_max, -q.fp8_max, v))
    if q.native_cast:
        codes = v.astype(q.dtype)
    else:
        codes = fp8_lib.encode_fp8(v, q.dtype)
    return codes, scale


def _gated_kernel(x_ref, g_ref, w_ref, *out_refs, n_rows, rows, heads, width, eps, activation,
                  quant):
    index, lanes = common.tile_index(rows, (heads, width))
    in_rows = common.row_mask(n_rows, rows, 3)
    mask = common.both(in_rows, lanes)
    w_index, w_lanes = common.lane_index(width)
    y = _gated(x_ref, g_ref, w_ref, index, mask, w_index, w_lanes, width, eps, activation)
    if quant is None:
        (o_ref,) = out_refs
        common.store(o_ref, index, y, mask)
        return
    codes_ref, scale_ref = out_refs
    codes, scale = _quantize(y, lanes if lanes is not None else True, quant)
    common.store(codes_ref, index, codes, mask)
    common.store(scale_ref, jnp.arange(rows, dtype=jnp.int32), scale, common.row_mask(n_rows, rows, 1))


def _quant_kernel(x_ref, codes_ref, scale_ref, *, n_rows, rows, width, quant):
    index, lanes = common.tile_index(rows, (width,))
    in_rows = common.row_mask(n_rows, rows, 2)
    mask = common.both(in_rows, lanes)
    y = common.load(x_ref, index, mask).astype(jnp.float32)
    codes, scale = _quantize(y, lanes if lanes is not None else True, quant)
    common.store(codes_ref, index, codes, mask)
    common.store(scale_ref, jnp.arange(rows, dtype=jnp.int32), scale, common.row_mask(n_rows, rows, 1))


def _codes_struct(shape, quant: fp8_lib.Fp8Params):
    return jax.ShapeDtypeStruct(shape, quant.dtype if quant.native_cast else jnp.uint8)


def _codes_poison(quant: fp8_lib.Fp8Params):
    """A code that decodes to NaN in the output format (for ``common.poisoned_outputs``)."""
    return float("nan") if quant.native_cast else fp8_lib.fp8_format(quant.dtype).nan_code


def _as_fp8(codes, quant: fp8_lib.Fp8Params):
    return codes if quant.native_cast else lax.bitcast_convert_type(codes, quant.dtype)


def gated_row_elems(heads: int, width: int) -> tuple[int, int]:
    """(padded elements one token loads over x and gate, padded elements of one tile row)."""
    tile = common.pow2(heads) * common.pow2(width)
    return 2 * tile, tile


def rmsnorm_gated_rows(x, gate, weight, *, eps: float, activation: str,
                       quant: fp8_lib.Fp8Params | None, interpret: bool,
                       config: platform.LaunchConfig | None = None):
    """``x``, ``gate`` ``[T, H, D]``. Without ``quant``: y ``[T, H, D]`` in x's dtype. With it:
    ``(codes [T, H, D] fp8, scale [T] float32)``."""
    n_rows, heads, width = x.shape
    op = "rmsnorm_gated" if quant is None else "rmsnorm_gated_fp8"
    if config is None:
        config = platform.launch_config(op, n_rows, *gated_row_elems(heads, width))
    kernel = functools.partial(_gated_kernel, n_rows=n_rows, rows=config.rows_per_program,
                               heads=heads, width=width, eps=float(eps), activation=activation,
                               quant=quant)
    if quant is None:
        outs = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    else:
        outs = [_codes_struct(x.shape, quant), jax.ShapeDtypeStruct((n_rows,), jnp.float32)]
    poison = None if quant is None else [_codes_poison(quant), float("nan")]
    result = common.row_call(kernel, name=f"k3pallas_{op}", n_rows=n_rows, config=config,
                             row_inputs=[x, gate], shared_inputs=[weight], out_shapes=outs,
                             interpret=interpret, out_poison=poison)
    if quant is None:
        return result[0]
    codes, scale = result
    return _as_fp8(codes, quant), scale


def per_token_fp8_rows(x, *, quant: fp8_lib.Fp8Params, interpret: bool,
                       config: platform.LaunchConfig | None = None):
    """``x [T, N]`` -> ``(codes [T, N] fp8, scale [T] float32)``."""
    n_rows, width = x.shape
    if config is None:
        padded = common.pow2(width)
        config = platform.launch_config("per_token_fp8_quant", n_rows, padded, padded)
    kernel = functools.partial(_quant_kernel, n_rows=n_rows, rows=config.rows_per_program,
                               width=width, quant=quant)
    codes, scale = common.row_call(
        kernel, name="k3pallas_per_token_fp8_quant", n_rows=n_rows, config=config,
        row_inputs=[x], shared_inputs=[],
        out_shapes=[_codes_struct(x.shape, quant), jax.ShapeDtypeStruct((n_rows,), jnp.float32)],
        interpret=interpret, out_poison=[_codes_poison(quant), float("nan")])
    return _as_fp8(codes, quant), scale
