"""MX block-scaled formats (OCP Microscaling): MXFP8 and MXFP4, as ``jax.nn.scaled_matmul`` takes
them; the format rules, the e8m0 scale, and the quantized-activation layout.

=========  ===================  =========  ==================================================
format     element              elem_max   codes in memory
=========  ===================  =========  ==================================================
``mxfp8``  ``float8_e4m3fn``    448        one byte per element
``mxfp4``  ``float4_e2m1fn``    6          two per byte, element ``2j`` in the low nibble
=========  ===================  =========  ==================================================

One ``float8_e8m0fnu`` scale (a power of two, ``2**(code - 127)``; code 255 is NaN) per block of
32 contiguous elements of a row. The semantics are jax's own MX quantization
(``jax.nn.scaled_dot_general``'s, ``jax._src.cudnn.scaled_matmul_stablehlo.quantize``), so that
our codes are the codes jax makes of the same float32 values:

* ``scale = 2**ceil(log2(amax / elem_max))`` over the block (float32 division, rounded UP to a
  power of two), at least ``2**-127`` (e8m0 code 0: a zero block, or ``amax <= elem_max *
  2**-127``); no finite float32 block needs more than ``2**126`` (code 253);
* ``data = round_to_nearest_even(clamp(y / scale, -elem_max, elem_max))``: ``|y / scale| <=
  elem_max`` always holds, nothing saturates;
* a block holding a NaN or an infinity gets the NaN scale (code 255) and NaN codes where the
  element format has them (MXFP8; MXFP4 has no NaN: code 0x8, -0), so it dequantizes to NaN
  and no other block changes. jax's own quantize leaves that case unspecified (a NaN amax wraps
  to code 0, an infinite one gives the NaN scale): the parity tests use finite data.

Other rules in the field: the OCP MX spec's ``2**(floor(log2(amax)) - emax_elem)`` (e.g. 2 for
e2m1) uses more of the element range and saturates values above ``elem_max``;
AITER's ``_mxfp4_quant_op`` first rounds amax to a power of two (up from a mantissa of 1.75),
then takes ``2**(log2 - 2)``. Both can give a scale half of jax's for the same block and
saturate at elem_max; data quantized by them is not what jax makes of the same values.

Arithmetic is IEEE float32, as jax's rule runs on a GPU. XLA's CPU flushes subnormals, which
changes jax's own result there in two corners: a quotient ``amax / elem_max`` below ``2**-126``
flushed to zero (code 0 where IEEE gives 1, for amax in ``(elem_max * 2**-127, elem_max *
2**-126)``), and the division by the subnormal ``2**-127`` (a zero block: NaN codes). The
kernels and the jnp reference compute the scale code with integer operations (``scale_code``,
equal to jax's rule on the IEEE quotient: ``tests/test_mx.py``) and multiply by the exact
reciprocal (``inv_scale``): the same codes on every platform.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["MX_FORMATS", "OUT_FORMATS", "BLOCK", "MxFormat", "MxParams", "mx_format",
           "resolve_mx_params", "scale_code", "inv_scale",
           "check_out_format"]

BLOCK = 32  # elements per e8m0 scale (OCP MX; jax's mxfp8 / mxfp4 configs)
MX_FORMATS = ("mxfp8", "mxfp4")
# The output formats of the quantizing ops: today's per-token FP8 and the MX formats.
OUT_FORMATS = ("fp8_per_token",) + MX_FORMATS


@dataclasses.dataclass(frozen=True)
class MxFormat:
    name: str
    dtype: jnp.dtype  # the element dtype of the array jax.nn.scaled_matmul takes
    elem_max: float
    per_byte: int  # elements stored per byte (2: packed nibbles)

    @functools.cached_property
    def threshold_bits(self) -> tuple[int, int, int]:
        """(exponent field, mantissa field, subnormal-edge amax bits) of ``elem_max`` for
        ``scale_code``: see there. Computed once per format (the edge by a short host search)."""
        bits = int(np.float32(self.elem_max).view(np.uint32))
        return bits >> 23, bits & 0x7FFFFF, _edge_bits(self.elem_max)


def _edge_bits(elem_max: float) -> int:
    """The float32 bits of the largest ``amax`` whose float32 quotient ``amax / elem_max`` is
    ``<= 2**-127`` (jax's rounding keeps e8m0 code 0 up to there; see ``scale_code``)."""
    m = np.float32(elem_max)
    a = np.float32(elem_max * 2.0**-127)
    while (np.float32(np.nextafter(a, np.float32(np.inf))) / m) <= np.float32(2.0**-127):
        a = np.nextafter(a, np.float32(np.inf))
    while a / m > np.float32(2.0**-127):
        a = np.nextafter(a, np.float32(0))
    return int(np.float32(a).view(np.uint32))


_MX = {
    "mxfp8": MxFormat("mxfp8", jnp.dtype(jnp.float8_e4m3fn), 448.0, 1),
    "mxfp4": MxFormat("mxfp4", jnp.dtype(jnp.float4_e2m1fn), 6.0, 2),
}


def check_out_format(out_format) -> str:
    if not isinstance(out_format, str) or out_format not in OUT_FORMATS:
        raise ValueError(f"out_format must be one of {OUT_FORMATS}, got {out_format!r}")
    return out_format


def mx_format(name) -> MxFormat:
    if name not in _MX:
        raise ValueError(f"MX format must be one of {MX_FORMATS}, got {name!r}")
    return _MX[name]


@dataclasses.dataclass(frozen=True)
class MxParams:
    """Resolved MX options, as the kernels and the reference take them."""

    format: str  # "mxfp8" | "mxfp4"
    cast: str | None = None  # the float32 -> element conversion asked for (as Fp8Params.cast)
    native: bool | None = None  # the conversion a kernel uses, once decided

    @property
    def fmt(self) -> MxFormat:
        return _MX[self.format]

    @property
    def dtype(self):
        return self.fmt.dtype


def resolve_mx_params(out_format: str, fp8_cast=None) -> MxParams:
    from k3pallas import fp8 as fp8_lib

    mx_format(out_format)
    return MxParams(out_format, fp8_lib.check_cast_mode(fp8_cast))


def scale_code(amax, fmt: MxFormat, nonfinite=None):
    """The e8m0 code (int32) of jax's rounded-up scale for float32 block maxima ``amax >= 0``,
    with integer operations only (no division: GPU float32 division is not always IEEE).

    jax rounds ``q = fl(amax / elem_max)`` up to a power of two. For normal ``q`` that power is
    ``2**(e_a - e_m)`` times 2 when amax's mantissa exceeds elem_max's (``e``: exponent fields):
    ``fl`` cannot round a quotient above a power of two down onto it, because the float32 next
    to ``elem_max * 2**k`` is more than half an ulp of ``2**k`` away after the division (for 6
    and 448; ``tests/test_mx.py`` checks it against jax's rule). Below ``2**-126`` the quotient is
    subnormal and rounds more coarsely: code 0 up to the amax whose quotient rounds to
    ``2**-127`` (``MxFormat.threshold_bits``). ``nonfinite``: rows of blocks holding NaN or inf,
    code 255 (NaN).
    """
    e_m, m_m, edge = fmt.threshold_bits
    bits = lax.bitcast_convert_type(amax, jnp.int32)
    code = (bits >> 23) - e_m + 127 + jnp.where((bits & 0x7FFFFF) > m_m, 1, 0)
    code = jnp.where(bits <= edge, 0, jnp.minimum(code, 254))
    code = jnp.maximum(code, 0)
    if nonfinite is not None:
        code = jnp.where(nonfinite, 255, code)
    return code


def inv_scale(code):
    """``1 / 2**(code - 127)`` exactly, as float32 (NaN for code 255): ``2**(127 - code)`` is
    a normal float32 for every code 0..253, all that finite data produces (254 gives 0)."""
    inv = lax.bitcast_convert_type((254 - code) << 23, jnp.float32)
    return jnp.where(code == 255, jnp.nan, inv)


def as_e8m0(code):
    """int codes -> ``float8_e8m0fnu`` (a bitcast of their low byte)."""
    return lax.bitcast_convert_type(code.astype(jnp.uint8), jnp.float8_e8m0fnu)


def unpack_fp4(packed, n):
    """uint8 ``[..., n / 2]`` (element ``2j`` in the low nibble) -> ``float4_e2m1fn [..., n]``:
    a bitcast (jax splits each byte into ``[low, high]``) and a reshape."""
    f4 = lax.bitcast_convert_type(packed, jnp.float4_e2m1fn)
    return f4.reshape(packed.shape[:-1] + (n,))


def as_elements(codes, fmt: MxFormat, n):
    """A kernel's code bytes as the element array ``jax.nn.scaled_matmul`` takes."""
    if fmt.per_byte == 2:
        return unpack_fp4(codes, n)
    return codes if codes.dtype == fmt.dtype else lax.bitcast_convert_type(codes, fmt.dtype)


__all__ += ["as_e8m0", "unpack_fp4", "as_elements"]
