"""FP8 element formats: dtypes per device, fp8_max defaults, the float32 -> FP8 conversion modes,
and a bit-exact integer encoder from float32 that the Pallas kernels use. (The output formats that
use them, per-token FP8 and MX, are values in ``k3pallas.formats``.)

Formats (OCP / AMD naming as in ml_dtypes):

============================  =========  ====  ============  =====================================
dtype                         max        bias  NaN           used by
============================  =========  ====  ============  =====================================
``float8_e4m3fn``             448        7     0x7f / 0xff   NVIDIA sm_89+, AMD gfx950 (MI355X), CPU
``float8_e4m3fnuz``           240        8     0x80 only     AMD gfx94x (MI300X, MI325X); no -0
``float8_e5m2``               57344      15    0x7e / 0xfe   accepted everywhere (gradients-style)
============================  =========  ====  ============  =====================================

Defaults follow vLLM's dynamic per-token FP8: ``fp8_max`` 448 on e4m3fn, 224 on e4m3fnuz (vLLM
avoids 240 on MI300 for accuracy; AITER uses 240, pass it explicitly), 57344 on e5m2;
``min_scale = 1 / (fp8_max * 512)``.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
from jax import lax


__all__ = [
    "FP8_E4M3FN_MAX", "FP8_E4M3FNUZ_MAX", "FP8_E4M3FNUZ_MAX_AITER", "FP8_E5M2_MAX",
    "FP8_DTYPES", "ElementFormat", "default_fp8_dtype", "default_fp8_max", "fp8_format",
    "element_format", "encode_fp8", "CAST_MODES", "CAST_ENV_VAR", "check_cast_mode",
    "resolve_cast_mode",
]

FP8_E4M3FN_MAX = 448.0
FP8_E4M3FNUZ_MAX = 224.0  # vLLM's choice on MI300; the format's largest finite value is 240
FP8_E4M3FNUZ_MAX_AITER = 240.0  # AITER and the Kimi-K3 fused kernel
FP8_E5M2_MAX = 57344.0


@dataclasses.dataclass(frozen=True)
class ElementFormat:
    dtype: jnp.dtype
    exp_bits: int
    man_bits: int
    bias: int
    max_finite: float
    default_max: float
    has_negative_zero: bool
    nan_code: int  # the positive NaN code; fn and e5m2 keep the sign bit, fnuz has one NaN

    @property
    def name(self) -> str:
        return jnp.dtype(self.dtype).name


_FORMATS = {
    jnp.dtype(jnp.float8_e4m3fn): ElementFormat(jnp.dtype(jnp.float8_e4m3fn), 4, 3, 7, 448.0,
                                            FP8_E4M3FN_MAX, True, 0x7F),
    jnp.dtype(jnp.float8_e4m3fnuz): ElementFormat(jnp.dtype(jnp.float8_e4m3fnuz), 4, 3, 8, 240.0,
                                              FP8_E4M3FNUZ_MAX, False, 0x80),
    jnp.dtype(jnp.float8_e5m2): ElementFormat(jnp.dtype(jnp.float8_e5m2), 5, 2, 15, 57344.0,
                                          FP8_E5M2_MAX, True, 0x7E),
}
FP8_DTYPES = tuple(_FORMATS)
# MXFP4's element format (OCP e2m1: no infinity, no NaN; ml_dtypes and XLA convert NaN to 0x8).
# Not an fp8_dtype: only MXFP4 (``k3pallas.formats``) uses it, through ``element_format``.
_E2M1 = ElementFormat(jnp.dtype(jnp.float4_e2m1fn), 2, 1, 1, 6.0, 6.0, True, 0x8)


def element_format(dtype) -> ElementFormat:
    """The format record of an fp8 dtype or of ``float4_e2m1fn``; TypeError otherwise."""
    if jnp.dtype(dtype) == _E2M1.dtype:
        return _E2M1
    return fp8_format(dtype)


def fp8_format(dtype) -> ElementFormat:
    """The format record of an fp8 dtype; TypeError for anything else."""
    try:
        key = jnp.dtype(dtype)
    except TypeError:
        key = None
    if key not in _FORMATS:
        names = ", ".join(d.name for d in FP8_DTYPES)
        raise TypeError(f"the FP8 dtype (fp8_dtype) must be one of {names}; got {dtype!r}")
    return _FORMATS[key]


def default_fp8_max(dtype) -> float:
    """448 for e4m3fn, 224 for e4m3fnuz (as vLLM), 57344 for e5m2."""
    return fp8_format(dtype).default_max


def default_fp8_dtype(device=None):
    """The FP8 activation dtype native to ``device`` (default: the target traced for now).

    AMD gfx94x (MI300X, MI325X) -> ``float8_e4m3fnuz``; gfx950 (MI355X) and later, NVIDIA sm_89
    and later, and the CPU -> ``float8_e4m3fn``. Older NVIDIA parts have no FP8 units; they get
    e4m3fn too (XLA emulates it).

    ``device``: None, a jax device, a ``platform.Target``, or a name: an AMD arch or part
    (``"gfx942"``, ``"MI300X"``), an NVIDIA arch or part (``"sm_90"``, ``"H200"``), or ``"cpu"``.

    Raises: TypeError for anything else; ValueError for an unknown name, and for an AMD device
    whose arch is not known (``gfx_unknown``: its FP8 format cannot be told; pass ``fp8_dtype``).
    """
    from k3pallas import platform  # local import: platform imports jax devices lazily

    if device is None:
        target = platform.current_target()
    elif isinstance(device, platform.Target):
        target = device
    elif isinstance(device, str):
        target = platform.target_from_name(device)
    elif hasattr(device, "device_kind") and hasattr(device, "platform"):
        target = platform.target_of_device(device)
    else:
        raise TypeError("default_fp8_dtype: device must be None, a jax device, a "
                        f"k3pallas.platform.Target or a name; got {type(device).__name__}")
    if target.backend == "rocm" and target.arch == "gfx_unknown":
        raise ValueError(f"the FP8 format of AMD device {target.device_kind!r} is not known to "
                         "k3pallas (e4m3fnuz on gfx94x, e4m3fn on gfx950); pass the dtype "
                         "(fp8_dtype=, or Fp8PerToken(dtype=...))")
    if target.backend == "rocm" and target.arch.startswith("gfx94"):
        return jnp.dtype(jnp.float8_e4m3fnuz)
    return jnp.dtype(jnp.float8_e4m3fn)


# The float32 -> FP8 conversion a kernel uses (k3pallas.kernels.fp8_cast decides it on the
# device): the argument ``fp8_cast``, else the environment variable, else "auto".
CAST_MODES = ("auto", "native", "encoder", "native_unchecked")
CAST_ENV_VAR = "K3PALLAS_FP8_CAST"


def check_cast_mode(fp8_cast):
    """The ``fp8_cast`` argument as given (None: decided later from the environment);
    ValueError for anything but None or one of ``CAST_MODES``."""
    if fp8_cast is not None and (not isinstance(fp8_cast, str) or fp8_cast not in CAST_MODES):
        raise ValueError(f"fp8_cast must be one of {CAST_MODES} (or None: ${CAST_ENV_VAR}, else "
                         f"'auto'); got {fp8_cast!r}")
    return fp8_cast


def resolve_cast_mode(fp8_cast) -> str:
    """``fp8_cast``, else ``$K3PALLAS_FP8_CAST`` (case and surrounding spaces ignored), else
    "auto". ValueError for anything else, and for "native_unchecked" from the environment (an
    ahead-of-time choice: tools pass it as an argument; a variable left set would skip the
    self-check at run time)."""
    if fp8_cast is None:
        raw = os.environ.get(CAST_ENV_VAR, "")
        fp8_cast = raw.strip().lower() or "auto"
        if fp8_cast not in CAST_MODES or fp8_cast == "native_unchecked":
            allowed = tuple(m for m in CAST_MODES if m != "native_unchecked")
            raise ValueError(f"environment variable {CAST_ENV_VAR}={raw!r}: expected one of "
                             f"{allowed} ('native_unchecked' only as the fp8_cast argument)")
    return check_cast_mode(fp8_cast)


def encode_fp8(v, dtype):
    """float32 -> fp8 code (int32 in [0, 255]), round to nearest even, without a float8 cast; for
    ``float4_e2m1fn`` (MXFP4's element) the 4-bit code in [0, 15] the same way.

    Bit-exact with ``v.astype(dtype)`` for every float32 ``v`` with ``|v| <=`` the format's largest
    finite value, and for NaN (fn, e5m2: sign kept; fnuz: 0x80). Larger values are outside its
    domain: the kernels clamp first. Written with jnp ops only, so it runs in XLA and inside
    Pallas Triton kernels on cuda and rocm, where the Triton lowering refuses any cast to
    ``float8_e4m3fnuz``. Constants stay Python numbers: a uint32 literal bitcast inside a kernel
    does not lower.

    Normal results round the float32 mantissa to ``m`` bits with integer arithmetic (a carry moves
    into the exponent, as it should) and re-bias the exponent. Subnormal results use one float32
    addition of ``2**(E)``, where the float32 ulp of ``2**E`` is the format's smallest subnormal:
    the addition itself rounds to nearest even at that position, and the code is the low bits of
    the sum. It costs a few times what a native conversion does (bench/results/rocm_check.md).
    """
    fmt = element_format(dtype)
    m_bits, bias = fmt.man_bits, fmt.bias
    sign_bit = 1 << (fmt.exp_bits + fmt.man_bits)
    shift = 23 - m_bits  # float32 mantissa bits dropped for a normal result
    min_normal_bits = (127 - bias + 1) << 23  # float32 bits of the format's smallest normal
    magic_exp = (127 - bias) + shift + 1  # ulp(2**(magic_exp - 127)) = smallest subnormal
    magic = float(2.0 ** (magic_exp - 127))

    f = v.astype(jnp.float32)
    bits = lax.bitcast_convert_type(f, jnp.int32)
    a = bits & 0x7FFFFFFF  # |v| as bits
    # Normal: RNE on the mantissa (add half-ulp - 1 plus the kept lsb), re-bias, take the bits.
    normal = (a + (((bias - 127) << 23) + (1 << (shift - 1)) - 1) + ((a >> shift) & 1)) >> shift
    # Subnormal or zero: |v| + magic rounds |v| to a multiple of the smallest subnormal.
    aligned = lax.bitcast_convert_type(jnp.abs(f) + magic, jnp.int32)
    sub = aligned - (magic_exp << 23)
    mag = jnp.where(a < min_normal_bits, sub, normal)
    negative = bits < 0
    if fmt.has_negative_zero:
        sign = jnp.where(negative, sign_bit, 0)
        code = mag | sign
        nan = fmt.nan_code | sign
    else:
        code = jnp.where(negative & (mag != 0), mag | sign_bit, mag)
        nan = fmt.nan_code
    return jnp.where(a > 0x7F800000, nan, code)
