"""The output formats of the quantizing ops as values, and the records that carry them.

A format is a frozen value that carries its rules: the element dtype, how many elements share a
scale, the scale's dtype and rounding, the shapes a record must have, how to quantize (the jnp
semantics every kernel implements) and how to dequantize. Ops take one as ``out_format`` (or its
name); ``QuantizedActivation`` and ``QuantizedWeight`` store theirs and check their arrays
against it when built, so a record never reinterprets its arrays.

=================  ===========================  ==============  ==================================
format             elements                     scale           one scale per
=================  ===========================  ==============  ==================================
``fp8_per_token``  FP8 by target: e4m3fn (NVI-  float32         token, or each of ``groups``
                   DIA, gfx950, CPU), e4m3fnuz                  equal contiguous column groups
                   (gfx94x); or e5m2
``mxfp8``          ``float8_e4m3fn``            float8_e8m0fnu  32 contiguous elements of a row
``mxfp4``          ``float4_e2m1fn``            float8_e8m0fnu  32 contiguous elements of a row
``fp8_group128``   FP8 by target, as per-token  float32         128 contiguous elements of a row
``..._ue8m0``      FP8 by target, as per-token  float32, 2**k   128 contiguous elements of a row
=================  ===========================  ==============  ==================================

``Format.block``: elements per scale along the last axis (32 for MX, 128 for group FP8), or None
for a scale over a whole token (or column group); kernels pick their tiling by it. The exact
semantics, with the numbers behind each default: docs/formats.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from k3pallas import fp8 as fp8_lib
from k3pallas._checks import static_int, static_positive_float

__all__ = ["Format", "Fp8PerToken", "Mx", "Fp8Group", "FP8_PER_TOKEN", "MXFP8", "MXFP4",
           "FP8_GROUP128", "FP8_GROUP128_UE8M0", "FORMATS",
           "as_format", "QuantizedActivation", "QuantizedWeight", "LAYOUTS"]


class Format:
    """What every output format tells (the subclasses are frozen dataclasses: hashable values)."""

    name: ClassVar[str]
    block: ClassVar[int | None]  # elements per scale along the last axis; None: a whole group

    # -- target and record binding ---------------------------------------------------------
    def resolve(self, target) -> "Format":
        """This format with the defaults that depend on the device filled in."""
        return self

    def bind(self, dtype) -> "Format":
        """This format for a record whose data has ``dtype`` (fills a dtype left to the device)."""
        return self

    # -- shapes ----------------------------------------------------------------------------
    @property
    def scale_dtype(self):
        raise NotImplementedError

    def scale_groups(self, n: int) -> int:
        """Scales per row of ``n`` elements."""
        raise NotImplementedError

    def check_width(self, n: int, what: str) -> None:
        """ValueError unless a row of ``n`` elements (``what`` names it) splits into scale groups."""
        raise NotImplementedError

    def check_record(self, data, scale) -> None:
        """TypeError / ValueError unless ``data [..., N]`` and ``scale [..., G]`` are a record of
        this (bound) format."""
        _check_arrays(data, scale)
        if jnp.dtype(data.dtype) != jnp.dtype(self.dtype):
            raise TypeError(f"{self.name} data must be {jnp.dtype(self.dtype).name}, got "
                            f"{jnp.dtype(data.dtype).name}")
        if jnp.dtype(scale.dtype) != jnp.dtype(self.scale_dtype):
            raise TypeError(f"{self.name} scales must be {jnp.dtype(self.scale_dtype).name}, got "
                            f"{jnp.dtype(scale.dtype).name}")
        n = data.shape[-1]
        self.check_width(n, f"the last dim of data {tuple(data.shape)}")
        want = tuple(data.shape[:-1]) + (self.scale_groups(n),)
        if tuple(scale.shape) != want:
            raise ValueError(f"{self.name} data {tuple(data.shape)} needs scales of shape {want} "
                             f"({self._per_scale(n)}); got {tuple(scale.shape)}")

    def _per_scale(self, n: int) -> str:
        return f"one per {n // self.scale_groups(n)} elements of a row"

    # -- semantics -------------------------------------------------------------------------
    def quantize(self, y):
        """``y [..., N]`` (any float dtype; float32 math) -> ``(data [..., N], scale [..., G])``:
        the jnp semantics the kernels implement. Format resolved first."""
        raise NotImplementedError

    def dequantize(self, data, scale, dtype=jnp.float32):
        """``data * scale`` per scale group, ``[..., N]`` in ``dtype`` (a NaN scale: NaN)."""
        n, groups = data.shape[-1], scale.shape[-1]
        lead = data.shape[:-1]
        d = data.astype(jnp.float32).reshape(lead + (groups, n // groups))
        return (d * scale.astype(jnp.float32)[..., None]).reshape(data.shape).astype(dtype)


def _check_arrays(data, scale):
    for name, a in (("data", data), ("scale", scale)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    if data.ndim < 1 or scale.ndim != data.ndim:
        raise ValueError(f"data [..., N] and scale [..., G] must have the same rank >= 1; got "
                         f"shapes {tuple(data.shape)} and {tuple(scale.shape)}")


class _DeviceFp8:
    """What the FP8 formats with a float32 scale share (``Fp8PerToken``, ``Fp8Group``): an fp8
    element dtype left to the device (None) or given, and its ``fp8_max``."""

    def resolve(self, target):
        return self.bind(fp8_lib.default_fp8_dtype(target) if self.dtype is None else self.dtype)

    def _element(self, dtype):
        """(element dtype, fp8_max) of a record whose data has ``dtype``."""
        if self.dtype is None and jnp.dtype(dtype) not in fp8_lib.FP8_DTYPES:
            raise TypeError(f"{self.name} data must have an fp8 dtype, got {jnp.dtype(dtype).name}")
        dtype = jnp.dtype(dtype) if self.dtype is None else self.dtype
        return dtype, fp8_lib.fp8_format(dtype).default_max if self.fp8_max is None else self.fp8_max

    @property
    def scale_dtype(self):
        return jnp.dtype(jnp.float32)

    def check_record(self, data, scale) -> None:
        _check_arrays(data, scale)
        if jnp.dtype(data.dtype) not in fp8_lib.FP8_DTYPES:
            raise TypeError(f"{self.name} data must have an fp8 dtype, got "
                            f"{jnp.dtype(data.dtype).name}")
        super().check_record(data, scale)


class _Blocks(Format):
    """What the block formats share (``Mx``, ``Fp8Group``): one scale per ``block`` contiguous
    elements of a row (a ``unit``: "block" or "group"), which never crosses the row's end; for
    weights one per output channel and block of K unless the format says otherwise."""

    unit: ClassVar[str]

    def scale_groups(self, n: int) -> int:
        return n // self.block

    def check_width(self, n: int, what: str) -> None:
        if n % self.block:
            raise ValueError(f"{self.name} scales {self.unit}s of {self.block} elements, which may "
                             f"not cross {what}: its size ({n}) must be a multiple of {self.block}")

    def _per_scale(self, n):
        return f"one per {self.unit} of {self.block}"

    def weight_scale_shape(self, n: int, k: int) -> tuple[int, int]:
        """The weight scales for data ``[N, K]`` (layout "nk")."""
        return n, k // self.block

    def dequantize_weight(self, data, scale):
        """float32 ``[N, K]`` of weight data ``[N, K]`` and scales of ``weight_scale_shape``."""
        return self.dequantize(data, scale)

    def quantize_weight(self, w_nk):
        """``w [N, K]`` -> ``(data [N, K], scale of weight_scale_shape)``: the activations' rule
        per output channel (row) and block of K."""
        return self.quantize(w_nk)


# ------------------------------------------------------------------------------------------------
# Per-token FP8 (vLLM's dynamic per-token FP8)
# ------------------------------------------------------------------------------------------------

# The kernels and XLA divide by the scale as a multiplication by its reciprocal, which GPUs flush
# to 0 once it is subnormal: scales stay <= 2**126, so every code is exact. With fp8_max >= 4 no
# row of finite float32 values (amax <= 2**128) reaches that; min_scale is capped there.
SCALE_MAX = 2.0**126
FP8_MAX_MIN = 4.0
MIN_SCALE_DIVISOR = 512.0  # min_scale = 1 / (fp8_max * 512), as vLLM


@dataclasses.dataclass(frozen=True)
class Fp8PerToken(_DeviceFp8, Format):
    """Dynamic per-token FP8, per token and scale group: ``amax = max|y|``;
    ``scale = max(min(amax, scale_ub) / fp8_max, min_scale)``;
    ``data = round_to_nearest_even(clamp(y / scale, -fp8_max, fp8_max))``. A zero row gets
    ``min_scale`` and zero codes; a row holding NaN or inf gets a NaN scale and NaN codes.

    Fields (None: the default, filled by ``resolve`` for the target):
      dtype: ``float8_e4m3fn``, ``float8_e4m3fnuz`` or ``float8_e5m2``; default by device
        (``default_fp8_dtype``: e4m3fnuz on gfx94x, e4m3fn elsewhere).
      fp8_max: 448 (e4m3fn), 224 (e4m3fnuz, as vLLM; AITER uses 240), 57344 (e5m2); from 4 to
        the format's largest finite value.
      min_scale: ``1 / (fp8_max * 512)``; from 2**-126 to 2**126.
      scale_ub: an upper bound on ``amax`` (default none).
      groups: ``G`` equal contiguous column groups per token, one scale each (default 1).
    """

    dtype: object = None
    fp8_max: float | None = None
    min_scale: float | None = None
    scale_ub: float | None = None
    groups: int = 1

    name: ClassVar[str] = "fp8_per_token"
    block: ClassVar[None] = None

    def __post_init__(self):
        set_ = functools.partial(object.__setattr__, self)
        try:
            if self.dtype is not None:
                set_("dtype", _fp8_dtype(self.dtype))
            if self.fp8_max is not None:
                set_("fp8_max", static_positive_float("fp8_max", self.fp8_max, low=FP8_MAX_MIN))
                if self.dtype is not None:
                    _check_fp8_max(self.fp8_max, self.dtype)
            if self.min_scale is not None:
                set_("min_scale", static_positive_float("min_scale", self.min_scale, high=SCALE_MAX))
            if self.scale_ub is not None:
                set_("scale_ub", static_positive_float("scale_ub", self.scale_ub))
            set_("groups", static_int("groups", self.groups, 1))
        except (TypeError, ValueError) as e:
            raise type(e)(f"Fp8PerToken: {e}") from None

    def for_weight(self) -> "Fp8PerToken":
        """This format as a weight's (one scale per output channel): the activation-only
        fields (``min_scale``, ``scale_ub``, ``groups``) back to their defaults."""
        return dataclasses.replace(self, min_scale=None, scale_ub=None, groups=1)

    def bind(self, dtype) -> "Fp8PerToken":
        dtype, fp8_max = self._element(dtype)
        _check_fp8_max(fp8_max, dtype)
        min_scale = 1.0 / (fp8_max * MIN_SCALE_DIVISOR) if self.min_scale is None else self.min_scale
        return dataclasses.replace(self, dtype=dtype, fp8_max=fp8_max, min_scale=min_scale)

    def scale_groups(self, n: int) -> int:
        return self.groups

    def check_width(self, n: int, what: str) -> None:
        if n % self.groups:
            raise ValueError(f"fp8_per_token groups={self.groups} must divide {what} ({n})")

    def quantize(self, y):
        y = y.astype(jnp.float32)
        n = y.shape[-1]
        lead = y.shape[:-1]
        yg = y.reshape(lead + (self.groups, n // self.groups))
        amax = jnp.max(jnp.abs(yg), axis=-1, keepdims=True)
        if self.scale_ub is not None:
            amax = jnp.minimum(amax, self.scale_ub)
        scale = jnp.maximum(amax / self.fp8_max, self.min_scale)
        # NaN or inf anywhere in the group: NaN scale, hence NaN codes (explicit: XLA's CPU
        # max-reduction can drop NaN).
        scale = jnp.where(jnp.all(jnp.isfinite(yg), axis=-1, keepdims=True), scale, jnp.nan)
        data = jnp.clip(yg / scale, -self.fp8_max, self.fp8_max).astype(self.dtype)
        return data.reshape(y.shape), scale[..., 0]


def _fp8_dtype(dtype):
    """The element dtype field of an FP8 format: one of the FP8 dtypes; TypeError naming the
    field otherwise."""
    try:
        return fp8_lib.fp8_format(dtype).dtype
    except TypeError:
        names = ", ".join(d.name for d in fp8_lib.FP8_DTYPES)
        raise TypeError(f"dtype must be one of {names} (or None: by device), got {dtype!r}") from None


def _check_fp8_max(fp8_max, dtype):
    fmt = fp8_lib.fp8_format(dtype)
    if fp8_max > fmt.max_finite:
        raise ValueError(f"fp8_max={fp8_max} exceeds the largest finite {fmt.name} value "
                         f"{fmt.max_finite}")


# ------------------------------------------------------------------------------------------------
# MX block-scaled formats (OCP Microscaling), as jax.nn.scaled_matmul takes them
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Mx(_Blocks):
    """MXFP8 / MXFP4: one ``float8_e8m0fnu`` scale (a power of two, ``2**(code - 127)``; code
    255 is NaN) per block of 32 contiguous elements of a row. jax's own MX quantization
    (``jax.nn.scaled_dot_general``'s):

    * ``scale = 2**ceil(log2(amax / elem_max))`` over the block (float32 division, rounded UP
      to a power of two), at least ``2**-127``;
    * ``data = round_to_nearest_even(y / scale)``: never beyond ``elem_max``, nothing saturates;
    * a block holding NaN or inf gets the NaN scale and NaN codes (MXFP4, which has no NaN:
      code 0x8); no other block changes.

    The scale code comes from integer operations (``scale_code``) and the codes from ``y`` times
    the exact reciprocal (``inv_scale``), equal to jax's rule in IEEE arithmetic on every
    platform (XLA's CPU flushes subnormals where a GPU does not). MXFP4 codes are written two per
    byte, element ``2j`` in the low nibble (the order jax reads).
    """

    name: str
    dtype: object  # the element dtype of the array jax.nn.scaled_matmul takes
    elem_max: float
    per_byte: int  # elements stored per byte (2: packed nibbles)

    block: ClassVar[int] = 32
    unit: ClassVar[str] = "block"

    def __post_init__(self):
        """Only the two OCP MX formats, exactly: a hand-built value that mixes their fields would
        write codes of one element type under the name of another."""
        want = _MX_SPECS.get(self.name)
        if want is None:
            raise ValueError(f"Mx: name must be one of {tuple(_MX_SPECS)}, got {self.name!r} "
                             "(use k3pallas.MXFP8 / k3pallas.MXFP4)")
        dtype, elem_max, per_byte = want
        try:
            got = jnp.dtype(self.dtype)
        except TypeError:
            got = None
        if got != jnp.dtype(dtype):
            raise TypeError(f"Mx: {self.name} elements (dtype) are {jnp.dtype(dtype).name}, got "
                            f"{self.dtype!r}")
        object.__setattr__(self, "dtype", got)
        if isinstance(self.elem_max, bool) or not isinstance(self.elem_max, (int, float)) \
                or float(self.elem_max) != elem_max:
            raise ValueError(f"Mx: {self.name} elem_max is {elem_max}, got {self.elem_max!r}")
        object.__setattr__(self, "elem_max", float(elem_max))
        if self.per_byte != per_byte or isinstance(self.per_byte, bool):
            raise ValueError(f"Mx: {self.name} stores {per_byte} element(s) per byte (per_byte), "
                             f"got {self.per_byte!r}")

    @property
    def scale_dtype(self):
        return jnp.dtype(jnp.float8_e8m0fnu)

    @functools.cached_property
    def threshold_bits(self) -> tuple[int, int, int]:
        """(exponent field, mantissa field, subnormal-edge amax bits) of ``elem_max``, for
        ``scale_code``. Computed once per format (the edge by a short host search)."""
        bits = int(np.float32(self.elem_max).view(np.uint32))
        return bits >> 23, bits & 0x7FFFFF, _edge_bits(self.elem_max)

    def scale_code(self, amax, nonfinite=None):
        """The e8m0 code (int32) of jax's rounded-up scale for float32 block maxima ``amax >= 0``,
        with integer operations only (no division: GPU float32 division is not always IEEE).

        jax rounds ``q = fl(amax / elem_max)`` up to a power of two. For normal ``q`` that power
        is ``2**(e_a - e_m)`` times 2 when amax's mantissa exceeds elem_max's (``e``: exponent
        fields): ``fl`` cannot round a quotient above a power of two down onto it (for 6 and 448;
        tested against jax's rule). Below ``2**-126`` the quotient is subnormal and rounds more
        coarsely: code 0 up to the amax whose quotient rounds to ``2**-127``. ``nonfinite``:
        blocks holding NaN or inf, code 255 (NaN).
        """
        e_m, m_m, edge = self.threshold_bits
        bits = lax.bitcast_convert_type(amax, jnp.int32)
        code = (bits >> 23) - e_m + 127 + jnp.where((bits & 0x7FFFFF) > m_m, 1, 0)
        code = jnp.where(bits <= edge, 0, jnp.minimum(code, 254))
        code = jnp.maximum(code, 0)
        if nonfinite is not None:
            code = jnp.where(nonfinite, 255, code)
        return code

    # -- what a kernel's block epilogue needs (jnp, inside the kernel) --------------------------
    scale_store_dtype: ClassVar = jnp.dtype(jnp.uint8)  # the scale codes, stored as bytes
    scale_poison: ClassVar[int] = 0xFF  # the NaN scale: marks an unwritten one

    def block_scale(self, amax, nonfinite):
        """(stored scale code, exact float32 reciprocal of the scale) per block."""
        code = self.scale_code(amax, nonfinite)
        return code, inv_scale(code)

    def scaled(self, y, stored, inv):
        """``y / scale`` as ``y`` times the exact reciprocal (a power of two)."""
        return y * inv

    def scale_from_stored(self, stored):
        return as_e8m0(stored)

    @staticmethod
    def unpack(packed, n):
        return unpack_fp4(packed, n)

    def quantize(self, y):
        y = y.astype(jnp.float32)
        blocks = y.reshape(y.shape[:-1] + (y.shape[-1] // self.block, self.block))
        amax = jnp.max(jnp.abs(blocks), axis=-1)
        nonfinite = ~jnp.all(jnp.isfinite(blocks), axis=-1)  # explicit: XLA's CPU max drops NaN
        code = self.scale_code(amax, nonfinite)
        v = blocks * inv_scale(code)[..., None]
        data = jnp.clip(v, -self.elem_max, self.elem_max).astype(self.dtype)
        return data.reshape(y.shape), as_e8m0(code)


# The OCP MX formats: element dtype, largest element, elements per stored byte.
_MX_SPECS = {"mxfp8": (jnp.float8_e4m3fn, 448.0, 1), "mxfp4": (jnp.float4_e2m1fn, 6.0, 2)}


def _edge_bits(elem_max: float) -> int:
    """The float32 bits of the largest ``amax`` whose float32 quotient ``amax / elem_max`` is
    ``<= 2**-127`` (jax's rounding keeps e8m0 code 0 up to there; see ``Mx.scale_code``)."""
    m = np.float32(elem_max)
    a = np.float32(elem_max * 2.0**-127)
    while (np.float32(np.nextafter(a, np.float32(np.inf))) / m) <= np.float32(2.0**-127):
        a = np.nextafter(a, np.float32(np.inf))
    while a / m > np.float32(2.0**-127):
        a = np.nextafter(a, np.float32(0))
    return int(np.float32(a).view(np.uint32))


def inv_scale(code):
    """``1 / 2**(code - 127)`` exactly, as float32 (NaN for code 255): ``2**(127 - code)`` is a
    normal float32 for every code 0..253, all that finite data produces (254 gives 0)."""
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


# ------------------------------------------------------------------------------------------------
# Group-scaled FP8 (1 x 128): the activations of the DeepSeek-V3 / Kimi-K2 / Qwen3 FP8 checkpoints
# ------------------------------------------------------------------------------------------------

GROUP_EPS = 1e-10  # vLLM's per_token_group_quant_fp8 floor on a group's amax
EPS_MIN_RATIO = 2.0**-100  # eps >= fp8_max * this: scales >= 2**-100 (div_by_constant's domain)


@dataclasses.dataclass(frozen=True)
class Fp8Group(_DeviceFp8, _Blocks):
    """FP8 with one float32 scale per group of 128 contiguous elements of a row (vLLM's
    ``per_token_group_quant_fp8``, DeepSeek's ``act_quant``). Per group:

    * ``s = max(amax, eps) / fp8_max`` (the float32 quotient, as IEEE division gives it);
      ``ue8m0``: ``s = 2**ceil(log2(s))``, the smallest power of two with ``amax / s <= fp8_max``
      (the ``scale_fmt: ue8m0`` checkpoints);
    * ``data = round_to_nearest_even(y / s)`` onto the FP8 grid, of the exact quotient (one
      rounding); ``|y / s| <= fp8_max`` by construction, so nothing saturates;
    * a group holding NaN or inf gets a NaN scale and NaN codes; no other group changes.

    No float32 division is trusted (GPU division is not always IEEE): the scale comes from a
    multiplication by ``1 / fp8_max`` corrected with an exact residual (``div_by_constant``), or
    for UE8M0 from integer operations on the bits; the codes from ``y`` times the reciprocal of
    the scale, corrected by the exact sign of ``|y| - midpoint * s`` at the one rounding midpoint
    that product may have crossed (``exact_quotient``). A UE8M0 reciprocal is exact.

    Fields (None: the default, filled by ``resolve`` for the target):
      dtype: ``float8_e4m3fn``, ``float8_e4m3fnuz`` or ``float8_e5m2``; default by device
        (e4m3fnuz on gfx94x, e4m3fn elsewhere).
      fp8_max: a value of the element format from 4 up (448 e4m3fn, 224 e4m3fnuz as vLLM (240:
        AITER), 57344 e5m2).
      eps: the floor on a group's amax (default 1e-10, vLLM's; DeepSeek's inference code uses
        1e-4); at least ``fp8_max * 2**-100`` (scales stay where the exact arithmetic holds).
      ue8m0: power-of-two scales (default False).
    """

    dtype: object = None
    fp8_max: float | None = None
    eps: float = GROUP_EPS
    ue8m0: bool = False

    block: ClassVar[int] = 128
    unit: ClassVar[str] = "group"
    per_byte: ClassVar[int] = 1
    # What a kernel's block epilogue needs: scales stored as float32, NaN marks an unwritten one.
    scale_store_dtype: ClassVar = jnp.dtype(jnp.float32)
    scale_poison: ClassVar[float] = float("nan")

    @property
    def name(self) -> str:
        return "fp8_group128_ue8m0" if self.ue8m0 else "fp8_group128"

    def __post_init__(self):
        set_ = functools.partial(object.__setattr__, self)
        try:
            if self.dtype is not None:
                set_("dtype", _fp8_dtype(self.dtype))
            if self.fp8_max is not None:
                set_("fp8_max", static_positive_float("fp8_max", self.fp8_max, low=FP8_MAX_MIN))
                if self.dtype is not None:
                    _check_grid_max(self.fp8_max, self.dtype)
            set_("eps", static_positive_float("eps", self.eps))
            if not isinstance(self.ue8m0, (bool, np.bool_)):
                raise TypeError(f"ue8m0 must be True or False, got {self.ue8m0!r} "
                                f"({type(self.ue8m0).__name__})")
            set_("ue8m0", bool(self.ue8m0))
        except (TypeError, ValueError) as e:
            raise type(e)(f"Fp8Group: {e}") from None

    def bind(self, dtype) -> "Fp8Group":
        dtype, fp8_max = self._element(dtype)
        _check_grid_max(fp8_max, dtype)
        if self.eps < fp8_max * EPS_MIN_RATIO:
            raise ValueError(f"eps={self.eps} is below fp8_max * 2**-100 "
                             f"({fp8_max * EPS_MIN_RATIO:g}), where the exact scale arithmetic "
                             "(div_by_constant) stops")
        return dataclasses.replace(self, dtype=dtype, fp8_max=fp8_max)

    def weight_scale_shape(self, n: int, k: int) -> tuple[int, int]:
        """128 x 128 blocks of ``[N, K]`` data, as the checkpoints store ``weight_scale_inv``: a
        partial last block of N (DeepSeek-V3's ``kv_a_proj_with_mqa``: N = 576, 5 blocks)."""
        return -(-n // self.block), k // self.block

    def dequantize_weight(self, data, scale):
        n, k = data.shape
        s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), self.block, 0)[:n], self.block, 1)
        return data.astype(jnp.float32) * s

    def quantize_weight(self, w_nk):
        """``w [N, K]`` (float32 math) in 128 x 128 blocks, each by this format's rule (a partial
        last block of N scaled by its own rows): ``(data [N, K], scale [ceil(N/128), K/128])``."""
        n, k = w_nk.shape
        b = self.block
        pad = -n % b
        w = jnp.pad(w_nk.astype(jnp.float32), ((0, pad), (0, 0)))  # zeros leave amax unchanged
        blocks = w.reshape((n + pad) // b, b, k // b, b)
        amax = jnp.max(jnp.abs(blocks), axis=(1, 3))
        nonfinite = ~jnp.all(jnp.isfinite(blocks), axis=(1, 3))
        scale, inv = self.block_scale(amax, nonfinite)
        v = self.scaled(blocks, scale[:, None, :, None], inv[:, None, :, None])
        data = v.astype(self.dtype).reshape(n + pad, k)[:n]
        return data, scale

    # -- the scale and the codes (jnp: the reference and the kernels' block epilogue) ----------
    def block_scale(self, amax, nonfinite):
        """(float32 scale, float32 reciprocal) per group of maxima ``amax >= 0``; NaN where
        ``nonfinite``. The UE8M0 reciprocal is exact; the other one approximate (``scaled``
        corrects the codes)."""
        a = jnp.maximum(amax, self.eps)
        if self.ue8m0:
            code = pow2_ceil_code(a, self.fp8_max)
            scale = lax.bitcast_convert_type(code << 23, jnp.float32)
            inv = lax.bitcast_convert_type((254 - code) << 23, jnp.float32)
        else:
            scale = div_by_constant(a, self.fp8_max)
            inv = 1.0 / scale
        return jnp.where(nonfinite, jnp.nan, scale), jnp.where(nonfinite, jnp.nan, inv)

    def scaled(self, y, scale, inv):
        """float32 values whose round-to-nearest-even onto the element grid is the code of
        ``y / scale`` (``scale``, ``inv`` broadcast against ``y``)."""
        q = y * inv
        if self.ue8m0:
            return q
        return exact_quotient(y, q, scale, self.dtype)

    def scale_from_stored(self, stored):
        return stored

    def quantize(self, y):
        y = y.astype(jnp.float32)
        g = y.reshape(y.shape[:-1] + (y.shape[-1] // self.block, self.block))
        amax = jnp.max(jnp.abs(g), axis=-1)
        nonfinite = ~jnp.all(jnp.isfinite(g), axis=-1)  # explicit: XLA's CPU max drops NaN
        scale, inv = self.block_scale(amax, nonfinite)
        v = self.scaled(g, scale[..., None], inv[..., None])
        return v.astype(self.dtype).reshape(y.shape), scale


def _check_grid_max(fp8_max, dtype):
    _check_fp8_max(fp8_max, dtype)
    if float(np.array(fp8_max, np.float32).astype(dtype).astype(np.float64)) != fp8_max:
        raise ValueError(f"fp8_max={fp8_max} must be a value of {jnp.dtype(dtype).name} (the "
                         "group formats round every code exactly onto that grid)")


def _bits(x):
    return lax.bitcast_convert_type(x, jnp.int32)


def _float(b):
    return lax.bitcast_convert_type(b, jnp.float32)


_HI_MASK = -4096  # keeps a float32's sign, exponent and top 11 mantissa bits
_SIGN = -(1 << 31)  # a float32's sign bit, as int32


def _split(x):
    """``x = hi + lo`` exactly, each with at most 12 significant bits (float32 ``x``)."""
    hi = _float(_bits(x) & _HI_MASK)
    return hi, x - hi


def _residual(a, q, c: float):
    """``a - q * c`` exactly, for float32 ``a``, ``q`` with ``q * c`` within ``2**-11`` of ``a``
    relative and a constant ``c`` of at most 12 significant bits: ``q = hi + lo`` (12 bits
    each), so ``hi * c`` and ``lo * c`` are exact, ``a - hi * c`` is exact (Sterbenz), and so is
    the last difference (its operands' bits fit in 24)."""
    hi, lo = _split(q)
    return (a - hi * c) - lo * c


def div_by_constant(a, c: float):
    """``fl(a / c)``, the IEEE float32 quotient, for float32 ``a >= c * 2**-100`` (NaN passes) and a
    Python float ``c`` with at most 12 significant bits (fp8_max), without a division: ``a``
    times ``fl(1 / c)``, one correction by the exact residual (within about half an ulp), then
    the exact choice among that float and its neighbours by the residual against the half-ulp
    points (ties to even)."""
    r = float(np.float32(1.0 / c))
    q = a * r
    q = q + _residual(a, q, c) * r
    d = _residual(a, q, c)
    qb = _bits(q)
    half_up = _float((qb & 0x7F800000) - (24 << 23))  # half an ulp of q (q >= 2**-100)
    half_down = jnp.where((qb & 0x7FFFFF) == 0, half_up * 0.5, half_up)  # below a power of two
    odd = (qb & 1) == 1
    up_c, down_c = half_up * c, half_down * c  # exact: powers of two times c
    up = (d > up_c) | ((d == up_c) & odd)
    down = (-d > down_c) | ((-d == down_c) & odd)
    return _float(qb + jnp.where(up, 1, jnp.where(down, -1, 0)))


def pow2_ceil_code(a, c: float):
    """The biased exponent (int32) of ``2**ceil(log2(fl(a / c)))`` for normal float32 ``a > 0``
    and a Python float ``c`` >= 4 of at most 12 significant bits, with integer operations only:
    ``fl(a / c)`` is a power of two iff the mantissas are equal, above ``2**(e_a - e_c)`` iff
    ``a``'s mantissa is the larger (``fl`` cannot round a quotient above a power of two onto it,
    nor one below it beneath the next lower power). Tested against the float rule."""
    cb = int(np.float32(c).view(np.uint32))
    e_c, m_c = cb >> 23, cb & 0x7FFFFF
    b = _bits(a)
    return (b >> 23) - e_c + 127 + jnp.where((b & 0x7FFFFF) > m_c, 1, 0)


def exact_quotient(y, q, s, dtype):
    """float32 values that round (to nearest even, onto ``dtype``'s grid) as the exact ``y / s``
    does, given ``q``, an approximation of it within a few float32 ulp (``y`` times a reciprocal
    of ``s`` that a GPU may compute inexactly: PTX's ``div.full.f32`` errs by up to 2 ulp).

    The exact quotient lies in ``q``'s grid cell or next to it, so one midpoint decides: ``m``,
    the midpoint above the grid point at or below ``|q|``, read off the bits of ``t = |q| + off``;
    ``off`` is the smallest normal ``n`` where ``|q|`` lies below it (the grid step there is
    constant, the same as in ``[n, 2n)``, where float32's bits show it) and 0 elsewhere. ``|q|``
    just under ``n`` keeps ``off = 0`` (``t`` could round up to ``2n``): its cell in float32's
    binade is not one of the grid, but its midpoint lies a quarter step under ``n`` and the side
    it picks rounds to ``n`` as the quotient does. The comparison of ``|y| - m * hi`` with
    ``m * lo`` (``s = hi + lo``, 12 bits each; ``m`` has at most 5) is exact: both products are
    exact, the difference is exact or far from ``m * lo``. ``m``'s float32 neighbour on the
    quotient's side (``m`` itself for a tie) then rounds as the quotient does. About 15 more
    instructions per element than a power-of-two scale's multiply (docs/formats.md)."""
    fmt = fp8_lib.element_format(dtype)
    shift = 23 - fmt.man_bits
    low_mask, half = (1 << shift) - 1, 1 << (shift - 1)
    min_normal = float(2.0 ** (1 - fmt.bias))
    aq = jnp.abs(q)
    off = jnp.where(aq < min_normal * (1 - 2.0**-10), min_normal, 0.0)
    m = _float((_bits(aq + off) & ~low_mask) | half) - off  # exact (Sterbenz)
    hi, lo = _split(s)
    # m * s - |y| = m * lo - (|y| - m * hi): the inner difference exact or far from the product,
    # the outer rounded with its sign (+0 for a tie); the side from its bits (_signed_step).
    return _signed_step(m, q, _bits(m * lo - (jnp.abs(y) - m * hi)))


def _signed_step(m, q, d):
    """``m``'s float32 neighbour with ``q``'s sign: one step of its magnitude's bits down where
    ``d``, the bits of ``m * s - |y|``, is positive, up where negative, none for +0 (a tie); by
    shifts (compares and selects held predicates across the tile, compiled for the H200).
    A NaN ``m`` (a NaN scale) stays NaN. A GPU makes every NaN the canonical 0x7FFFFFFF, one
    step UP from which is the sign bit (-0.0 codes: seen on an H100 with ``d`` the other way
    round), and there ``d`` is that same positive NaN: a step down. Where NaNs keep their
    payload (a CPU), ``m``'s low bits are the midpoint's ``10...0`` and either step stays NaN."""
    return _float((_bits(m) | (_bits(q) & _SIGN)) + (((-d) >> 31) - (d >> 31)))


FP8_PER_TOKEN = Fp8PerToken()
MXFP8 = Mx("mxfp8", jnp.dtype(jnp.float8_e4m3fn), 448.0, 1)
MXFP4 = Mx("mxfp4", jnp.dtype(jnp.float4_e2m1fn), 6.0, 2)
FP8_GROUP128 = Fp8Group()
FP8_GROUP128_UE8M0 = Fp8Group(ue8m0=True)
FORMATS = {f.name: f for f in (FP8_PER_TOKEN, MXFP8, MXFP4, FP8_GROUP128, FP8_GROUP128_UE8M0)}


def as_format(value) -> Format:
    """A format from a ``Format`` value or its name; ValueError / TypeError otherwise."""
    if isinstance(value, Format):
        return value
    if isinstance(value, str):
        if value not in FORMATS:
            raise ValueError(f"out_format must be a k3pallas format or one of {tuple(FORMATS)}, "
                             f"got {value!r}")
        return FORMATS[value]
    raise TypeError(f"out_format must be a k3pallas format (k3pallas.formats) or its name "
                    f"{tuple(FORMATS)}, got {type(value).__name__}")


# ------------------------------------------------------------------------------------------------
# Records
# ------------------------------------------------------------------------------------------------


@jax.tree_util.register_pytree_node_class
class QuantizedActivation:
    """A quantized activation: ``data [..., N]``, ``scale [..., G]`` and the ``format`` that made
    them. Checked when built: data and scale must be what the format writes (dtypes, one scale
    per group; ``format`` as a value or a name). A pytree (the format is static), so it passes
    through ``jax.jit``; ``data, scale = qa`` unpacks the arrays.
    """

    __slots__ = ("data", "scale", "format")

    def __init__(self, data, scale, format):
        try:
            fmt = as_format(format)
            _check_arrays(data, scale)
            fmt = fmt.bind(data.dtype)
            fmt.check_record(data, scale)
        except (TypeError, ValueError) as e:
            raise type(e)(f"QuantizedActivation: {e}") from None
        self.data, self.scale, self.format = data, scale, fmt

    @classmethod
    def _unchecked(cls, data, scale, fmt):
        """Built by an op (whose outputs are right by construction) or by jax (which may rebuild
        a pytree around placeholders): no checks."""
        obj = object.__new__(cls)
        obj.data, obj.scale, obj.format = data, scale, fmt
        return obj

    def tree_flatten(self):
        return (self.data, self.scale), self.format

    @classmethod
    def tree_unflatten(cls, fmt, children):
        return cls._unchecked(*children, fmt)

    def __iter__(self):
        return iter((self.data, self.scale))

    def __len__(self):
        return 2

    def __getitem__(self, i):
        """``qa[0]`` is ``data``, ``qa[1]`` ``scale``: the record reads like vLLM's ``(q, scale)``."""
        return (self.data, self.scale)[i]

    def __repr__(self):
        return (f"QuantizedActivation({self.format.name}: data {_desc(self.data)}, scale "
                f"{_desc(self.scale)})")

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """``data * scale`` per scale group, ``[..., N]`` in ``dtype`` (a floating dtype)."""
        _check_float(dtype, "QuantizedActivation.dequantize")
        return self.format.dequantize(self.data, self.scale, dtype)


def _desc(a):
    return f"{tuple(getattr(a, 'shape', ()))} {getattr(a, 'dtype', '?')}"


def _check_float(dtype, where):
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"{where}: dtype must be a floating dtype (float32, bfloat16, ...), got "
                        f"{dtype!r}") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{where}: dtype must be floating, got {jnp.dtype(dtype).name} (the "
                        "values are not integers)")


LAYOUTS = ("nk", "kn")


@jax.tree_util.register_pytree_node_class
class QuantizedWeight:
    """A quantized weight ``w [K, N]`` (``x @ w``) for ``k3pallas.linear``: ``data``, ``scale``,
    its ``format`` and ``layout``, checked against each other when built.

    ``layout`` orders data and scale alike: ``"nk"`` (default: data ``[N, K]``, K contiguous,
    what the vendor FP8 GEMMs and ``jax.nn.scaled_matmul`` read without a transpose) or ``"kn"``
    (data ``[K, N]``). By format:

    * ``fp8_per_token`` (per output channel): ``scale [N]`` float32, or a per-tensor scalar
      ``[]``; data in an fp8 dtype;
    * ``mxfp8`` / ``mxfp4`` (per output channel and block of 32 along K): ``scale [N, K/32]``
      (``"nk"``) or ``[K/32, N]`` (``"kn"``), e8m0; K a multiple of 32;
    * ``fp8_group128`` / ``fp8_group128_ue8m0`` (per block of 128 x 128, as the DeepSeek-V3 /
      Kimi-K2 / Qwen3 FP8 checkpoints store ``weight_scale_inv``): ``scale [ceil(N/128), K/128]``
      (``"nk"``) or its transpose, float32; K a multiple of 128.

    A square scale stored in the other order cannot be told from its shape: say the layout of
    both. A pytree (format and layout static); ``data, scale = qw`` unpacks the arrays.
    """

    __slots__ = ("data", "scale", "format", "layout")

    def __init__(self, data, scale, format, layout="nk"):
        try:
            fmt = as_format(format)
            if layout not in LAYOUTS:
                raise ValueError(f"layout must be 'nk' or 'kn', got {layout!r}")
            for name, a in (("data", data), ("scale", scale)):
                if not hasattr(a, "shape") or not hasattr(a, "dtype"):
                    raise TypeError(f"{name} must be an array, got {type(a).__name__}")
            if data.ndim != 2:
                raise ValueError(f"data must be a matrix ([N, K] for layout 'nk', [K, N] for "
                                 f"'kn'), got shape {tuple(data.shape)}")
            fmt = fmt.bind(data.dtype)
            _check_weight_record(fmt, data, scale, layout)
        except (TypeError, ValueError) as e:
            raise type(e)(f"QuantizedWeight: {e}") from None
        self.data, self.scale, self.format, self.layout = data, scale, fmt, layout

    @classmethod
    def _unchecked(cls, data, scale, fmt, layout):
        obj = object.__new__(cls)
        obj.data, obj.scale, obj.format, obj.layout = data, scale, fmt, layout
        return obj

    def tree_flatten(self):
        return (self.data, self.scale), (self.format, self.layout)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls._unchecked(*children, *aux)

    def __iter__(self):
        return iter((self.data, self.scale))

    def __len__(self):
        return 2

    def __getitem__(self, i):
        """``qw[0]`` is ``data``, ``qw[1]`` ``scale``."""
        return (self.data, self.scale)[i]

    @property
    def shape(self) -> tuple[int, int]:
        """``(K, N)`` of the weight it stands for."""
        return tuple(self.data.shape) if self.layout == "kn" else tuple(self.data.shape[::-1])

    def __repr__(self):
        return (f"QuantizedWeight({self.format.name}, layout {self.layout!r}: data "
                f"{_desc(self.data)}, scale {_desc(self.scale)})")

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The ``[K, N]`` weight ``data * scale`` in ``dtype``, whatever the stored layout."""
        _check_float(dtype, "QuantizedWeight.dequantize")
        data, scale = self.data, self.scale
        if self.layout == "kn":
            data, scale = data.T, (scale if scale.ndim < 2 else scale.T)
        if self.format.block is None:  # per output channel (rows of the [N, K] data)
            w = data.astype(jnp.float32) * jnp.reshape(scale.astype(jnp.float32), (-1, 1))
        else:
            w = self.format.dequantize_weight(data, scale)
        return w.T.astype(dtype)


def _check_weight_record(fmt: Format, data, scale, layout):
    k, n = data.shape if layout == "kn" else data.shape[::-1]
    if fmt.block is None:
        if jnp.dtype(data.dtype) not in fp8_lib.FP8_DTYPES:
            raise TypeError(f"{fmt.name} weight data must have an fp8 dtype, got {data.dtype}")
        if jnp.dtype(data.dtype) != jnp.dtype(fmt.dtype):
            raise TypeError(f"{fmt.name} data must be {jnp.dtype(fmt.dtype).name}, got {data.dtype}")
        if fmt.groups != 1:
            raise ValueError(f"a weight's scales are per output channel: groups must be 1, got "
                             f"{fmt.groups}")
        if jnp.dtype(scale.dtype) != jnp.dtype(jnp.float32):
            raise TypeError(f"{fmt.name} weight scales must be float32, got {scale.dtype}")
        if tuple(scale.shape) not in ((n,), ()):
            raise ValueError(f"{fmt.name} weight scales must have shape ({n},) (per output "
                             f"channel of the [K, N] = [{k}, {n}] weight) or () (per tensor); got "
                             f"{tuple(scale.shape)}")
        return
    if jnp.dtype(data.dtype) != jnp.dtype(fmt.dtype):
        raise TypeError(f"{fmt.name} data must be {jnp.dtype(fmt.dtype).name}, got {data.dtype}")
    if jnp.dtype(scale.dtype) != jnp.dtype(fmt.scale_dtype):
        raise TypeError(f"{fmt.name} scales must be {jnp.dtype(fmt.scale_dtype).name}, got "
                        f"{scale.dtype}")
    fmt.check_width(k, f"K of the [K, N] = [{k}, {n}] weight")
    want = fmt.weight_scale_shape(n, k)
    want = want if layout == "nk" else want[::-1]
    if tuple(scale.shape) != want:
        raise ValueError(f"{fmt.name} weight scales for data {tuple(data.shape)} (layout "
                         f"{layout!r}, [K, N] = [{k}, {n}]) must have shape {want}; got "
                         f"{tuple(scale.shape)}")
