"""The row-scaled epilogue (per-token FP8, ``formats.Fp8PerToken``): one scale per kernel row, the
codes (integer encoder or the native cast, as ``fp8_cast`` decided), and the output structs.
Shared by every kernel with a per-token output (``gated``, ``norms``). ``q``: a ``common.Quant``
whose format is per-token FP8."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from k3pallas import fp8 as fp8_lib
from k3pallas.kernels import common, fp8_cast


def _row_reduce(fn, a):
    while a.ndim > 1:
        a = fn(a, axis=-1)
    return a


def row_scale(tiles, q: common.Quant, *, bits: bool = True):
    """Per-row scale ``[R]`` over float32 tiles ``[R, ...]`` that together hold the rows.

    ``bits``: ONE integer max per tile over ``|y|``'s bit patterns gives the maximum and any NaN
    or inf (``common.abs_bits``). Otherwise a float max and a sum that carries a NaN (Triton's
    float max drops NaN): the form the gated FP8 kernel keeps for large token counts, where it
    measured faster on the H200 (docs/performance.md).
    """
    if bits:
        amax_bits = None
        for y in tiles:
            m = _row_reduce(jnp.max, common.abs_bits(y))
            amax_bits = m if amax_bits is None else jnp.maximum(amax_bits, m)
        nonfinite = amax_bits >= common.INF_BITS
        amax = lax.bitcast_convert_type(amax_bits, jnp.float32)
    else:
        amax = total = None
        for y in tiles:
            a = jnp.abs(y)
            m, s = _row_reduce(jnp.max, a), _row_reduce(jnp.sum, a)
            amax = m if amax is None else jnp.maximum(amax, m)
            total = s if total is None else total + s
        nonfinite = (total != total) | (amax == jnp.inf)
    # A NaN or an infinity anywhere in the row: NaN scale, hence NaN codes. Per-row tests only.
    if q.fmt.scale_ub is not None:
        amax = jnp.minimum(amax, q.fmt.scale_ub)
    scale = jnp.maximum(amax / q.fmt.fp8_max, q.fmt.min_scale)
    return jnp.where(nonfinite, jnp.nan, scale)


def codes(y, inv_scale, q: common.Quant):
    v = y * inv_scale
    if q.fmt.scale_ub is not None:
        # Comparisons, not min/max: NaN must pass through to the encoder.
        m = q.fmt.fp8_max
        v = jnp.where(v > m, m, jnp.where(v < -m, -m, v))
    if q.native:
        return fp8_cast.native_codes(v, q.fmt.dtype)
    return fp8_lib.encode_fp8(v, q.fmt.dtype)


def codes_struct(shape, quant: common.Quant):
    return jax.ShapeDtypeStruct(shape, quant.fmt.dtype if quant.native else jnp.uint8)


def codes_poison(quant: common.Quant):
    """A code that decodes to NaN in the output format (for ``common.poisoned_outputs``)."""
    return float("nan") if quant.native else fp8_lib.fp8_format(quant.fmt.dtype).nan_code


def as_fp8(codes, quant: common.Quant):
    return codes if quant.native else lax.bitcast_convert_type(codes, quant.fmt.dtype)


def normed_amax(z, inv_rms):
    """``max|y|`` per row of a normalized row ``y = z * inv_rms`` (the norm over the last axis;
    ``inv_rms`` without that axis), as ``max|z| * inv_rms``: exactly the same value (rounding by
    a positive factor is monotonic), and its reduction needs only ``z``, so it runs beside the
    norm's instead of after it. ONE integer max over ``|z|``'s bits (``common.abs_bits``) carries
    a NaN or an infinity of ``z`` into the product; a non-finite norm comes in by ``inv_rms``."""
    m = jnp.max(common.abs_bits(z), axis=-1)
    return lax.bitcast_convert_type(m, jnp.float32) * inv_rms


def epilogue(ys, out_refs, s_ref, *, n_rows, rows, quant, mode, pid=None, amax=None,
             bits=True):
    """Per-row FP8 of the float32 tiles ``ys`` (together the rows).

    ``ys``: ``[(index, mask, y)]``, or ``[(index, mask, z, f)]`` for ``y = z * f`` (``f``
    broadcasts against ``z``: a per-row or per-head factor, applied with the scale in one
    multiply per element); then ``amax`` is required: tiles ``[R, ...]`` whose per-row maximum of
    ``|.|`` is the rows' amax (``normed_amax``). ``mode``: "dynamic" (the scale from the rows;
    codes and scale out), "scale_only" (only the scale out) or "given_scale" (the scale read from
    ``s_ref``; only codes out). ``pid``: as in ``common.row_mask``. ``bits``: as in
    ``row_scale``.
    """
    r_index = jnp.arange(rows, dtype=jnp.int32)
    r_mask = common.row_mask(n_rows, rows, 1, pid)
    if mode == "given_scale":
        scale = common.load(s_ref, r_index, r_mask, other=1.0)
    else:
        scale = row_scale(amax if amax is not None else [y for _, _, y in ys], quant, bits=bits)
    if mode == "scale_only":
        (scale_ref,) = out_refs
        common.store(scale_ref, r_index, scale, r_mask)
        return
    codes_ref = out_refs[0]
    inv = 1.0 / scale
    for index, mask, y, *factor in ys:
        f = inv[(slice(None),) + (None,) * (y.ndim - 1)]
        if factor:
            f = factor[0] * f
        common.store(codes_ref, index, codes(y, f, quant), mask)
    if mode == "dynamic":
        common.store(out_refs[1], r_index, scale, r_mask)


SCALE_MODES = ("dynamic", "scale_only", "given_scale")


def outputs(shape, n_rows, quant, mode, scale):
    """(output structs, poison values) of an FP8 launch in ``mode``; checks mode and scale."""
    if mode not in SCALE_MODES:
        raise ValueError(f"mode must be one of {SCALE_MODES}, got {mode!r}")
    if (scale is None) != (mode != "given_scale"):
        raise ValueError(f"a scale is passed exactly in mode 'given_scale' (mode {mode!r})")
    codes = (codes_struct(shape, quant), codes_poison(quant))
    scale = (jax.ShapeDtypeStruct((n_rows,), jnp.float32), float("nan"))
    outs = {"dynamic": [codes, scale], "scale_only": [scale], "given_scale": [codes]}[mode]
    return [o for o, _ in outs], [p for _, p in outs]


def results(result, quant, mode):
    """(codes or None, scale or None) from a launch's outputs."""
    if mode == "scale_only":
        return None, result[0]
    codes = as_fp8(result[0], quant)
    return codes, (result[1] if mode == "dynamic" else None)
