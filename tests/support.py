"""What the tests share: independent float64 NumPy oracles and checks, then the encoder's test
inputs and a Pallas kernel that runs it (the encoder tests on the CPU, the GPU tests compiled).

The oracles call nothing of k3pallas: the semantics are written again from the docstrings.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.experimental import pallas as pl

from k3pallas import fp8 as fp8_lib  # the encoder under test (encoder_inputs, encode_in_pallas)

# Output tolerances against the float64 oracle, per output dtype (atol = rtol). bf16 follows
# vLLM's own RMSNorm test; fp16 and fp32 are a few units in the last place of the output.
ORACLE_TOL = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-5}
# Kernel against the jnp reference in the same output dtype: one rounding step apart at most.
REFERENCE_TOL = {"bfloat16": 8e-3, "float16": 1e-3, "float32": 2e-6}


def same_but_ulps(a, b, what=""):
    """Two programs' results of the same computation (interpret-mode kernels split, sharded or
    sized differently) as equal pytrees: bit for bit but float32 leaves (the scales) within
    2**-20 relative, and FP8 codes one step apart on at most one code in 200 (at least one).
    jax 0.12.1's XLA CPU backend compiles the programs' float32 arithmetic differently: per-token
    scales 1-3 ulp apart, and a normalized value an ulp off moves its code across an FP8 midpoint,
    its scale moved or not (seen: one code of 320, same scale; jax 0.10.2 - 0.12.0: none)."""
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b), what
    for x, y in zip(leaves_a, leaves_b):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype, (what, x.shape, y.shape)
        if x.dtype == np.float32:
            np.testing.assert_allclose(x, y, rtol=2.0 ** -20, atol=0, err_msg=what)
        elif x.dtype.itemsize == 1 and x.dtype != np.uint8:  # FP8 codes: adjacent bytes, rarely
            step = np.abs(x.view(np.uint8).astype(int) - y.view(np.uint8).astype(int))
            moved = int((step != 0).sum())
            assert step.max(initial=0) <= 1 and moved <= max(1, step.size // 200), (
                f"{what}: {moved} of {step.size} codes differ, by up to {step.max()} steps")
        else:
            assert np.array_equal(x, y, equal_nan=True), f"{what}: values differ"


def f64(a):
    return np.asarray(a).astype(np.float64)


F32_MAX = float(np.finfo(np.float32).max)


def rmsnorm64(x, w, eps):
    """float64 RMSNorm; a row whose sum of squares leaves the float32 range (the kernels' sum) is
    NaN, the package's defined result there."""
    x = f64(x)
    ss = np.sum(x * x, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        y = x / np.sqrt(ss / x.shape[-1] + eps) * f64(w)
    return np.where(ss < F32_MAX, y, np.nan)


def sigmoid64(g):
    return 1.0 / (1.0 + np.exp(-g))


def gated64(x, w, g, eps, activation):
    g = f64(g)
    act = sigmoid64(g) if activation == "sigmoid" else g * sigmoid64(g)
    return rmsnorm64(x, w, eps) * act


def assert_close(out, ref, tol, what=""):
    out, ref = f64(out), f64(ref)
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    assert not np.isnan(out).any(), f"{what}: NaN in output (unwritten element?)"
    err = np.abs(out - ref)
    bound = tol + tol * np.abs(ref)
    bad = err > bound
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} elements off; worst "
                           f"{err.max():.3g} at {np.unravel_index(err.argmax(), err.shape)}")


# ---------------------------------------------------------------------------------------------
# FP8
# ---------------------------------------------------------------------------------------------

FP8 = {
    "float8_e4m3fn": (ml_dtypes.float8_e4m3fn, 448.0),
    "float8_e4m3fnuz": (ml_dtypes.float8_e4m3fnuz, 240.0),
    "float8_e5m2": (ml_dtypes.float8_e5m2, 57344.0),
}
DEFAULT_FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e4m3fnuz": 224.0, "float8_e5m2": 57344.0}


# The element formats: FP8 and MXFP4's e2m1 (16 codes).
ELEMENTS = {**FP8, "float4_e2m1fn": (ml_dtypes.float4_e2m1fn, 6.0)}


def fp8_grid(name):
    """Sorted distinct finite values of the format (with 0 once); also ``float4_e2m1fn``."""
    dt = ELEMENTS[name][0]
    n_codes = 16 if name == "float4_e2m1fn" else 256
    vals = np.arange(n_codes, dtype=np.uint8).view(dt).astype(np.float64)
    return np.unique(vals[np.isfinite(vals)])


def quant_oracle(y, name, fp8_max=None, min_scale=None, scale_ub=None):
    """float64 per-token FP8 of ``y [T, N]``: ``(scale [T], v [T, N])`` where ``v`` is the exact
    clamped ``y / scale`` that the codes should round to."""
    y = f64(y)
    fp8_max = DEFAULT_FP8_MAX[name] if fp8_max is None else fp8_max
    min_scale = 1.0 / (fp8_max * 512.0) if min_scale is None else min_scale
    amax = np.max(np.abs(y), axis=-1) if y.shape[-1] else np.zeros(y.shape[:-1])
    nan_rows = ~np.isfinite(y).all(axis=-1)  # NaN or inf anywhere: NaN scale and codes
    if scale_ub is not None:
        amax = np.minimum(amax, scale_ub)
    scale = np.maximum(amax / fp8_max, min_scale)
    scale[nan_rows] = np.nan
    with np.errstate(invalid="ignore"):
        v = np.clip(y / scale[..., None], -fp8_max, fp8_max)
    return scale, v


def rne_to_grid(v, grid):
    """Round ``v`` to the nearest grid value, ties to the even code (the one with an even
    mantissa: on every fp8 grid those alternate with the grid index of the magnitude)."""
    a = np.abs(v)
    pos = grid[grid >= 0]
    hi = np.clip(np.searchsorted(pos, a), 0, len(pos) - 1)
    lo = np.clip(hi - 1, 0, len(pos) - 1)
    d_lo, d_hi = a - pos[lo], pos[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.sign(v) * pos[pick]


def check_codes(data, v, name, tie_rtol=1e-5, what=""):
    """Codes must be the RNE of ``v`` except within ``tie_rtol`` of a midpoint, and never more
    than one code from it; so the dequantized value is within half a code step (plus that slack).

    ``v`` NaN (a NaN row) requires NaN codes.
    """
    got = f64(data)
    grid = fp8_grid(name)
    nan_v = np.isnan(v)
    assert np.isnan(got[nan_v]).all(), f"{what}: a NaN row has non-NaN codes"
    assert not np.isnan(got[~nan_v]).any(), (
        f"{what}: {int(np.isnan(got[~nan_v]).sum())} NaN codes in finite rows (unwritten?)")
    got, v = got[~nan_v], v[~nan_v]
    want = rne_to_grid(v, grid)
    diff = got != want
    if diff.any():
        # Must be a neighbour of want, with v within tie_rtol of the midpoint between the two.
        gi = np.searchsorted(grid, got[diff])
        wi = np.searchsorted(grid, want[diff])
        assert (np.abs(gi - wi) <= 1).all(), f"{what}: codes more than one step from RNE"
        mid = (got[diff] + want[diff]) / 2
        near = np.abs(v[diff] - mid) <= tie_rtol * np.maximum(np.abs(mid), grid[grid > 0][0])
        assert near.all(), (f"{what}: {int((~near).sum())} codes differ from RNE away from a tie; "
                            f"e.g. v={v[diff][~near][:3]}, got={got[diff][~near][:3]}, "
                            f"want={want[diff][~near][:3]}")
    return diff.sum()


def check_scales(scale, scale64, rtol=1e-6, what=""):
    s = f64(scale).reshape(scale64.shape)
    assert np.array_equal(np.isnan(s), np.isnan(scale64)), f"{what}: NaN scales differ"
    ok = ~np.isnan(scale64)
    rel = np.abs(s[ok] - scale64[ok]) / scale64[ok]
    assert (rel <= rtol).all(), f"{what}: scale rel err {rel.max():.3g} > {rtol}"


# ------------------------------------------------------------------------------------------------
# Shared by the encoder tests (CPU) and the GPU tests
# ------------------------------------------------------------------------------------------------


def encoder_inputs(name, rng, n_random=100_000):
    """Every finite code's value, every midpoint between neighbours and the float32 values either
    side of each, both signs, float32 subnormals, values rounding to zero, zeros, NaN, and random
    values over the whole range and over many binades."""
    dt, fmax = FP8[name]
    vals = np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)
    fin = np.unique(vals[np.isfinite(vals)])
    mids = ((fin[:-1].astype(np.float64) + fin[1:]) / 2).astype(np.float32)
    tiny = np.float32(np.min(fin[fin > 0]))
    parts = [fin, mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf)),
             np.nextafter(fin, np.float32(np.inf)), np.nextafter(fin, np.float32(-np.inf)),
             np.array([0.0, -0.0, tiny / 2, tiny / 4, tiny * 0.49, tiny * 0.51, tiny * 1.5,
                       1e-45, 1e-40, 1e-38, 1e-30, np.nan], np.float32),
             rng.uniform(-fmax, fmax, n_random).astype(np.float32),
             (rng.standard_normal(n_random) * np.exp2(rng.integers(-40, 16, n_random))).astype(np.float32)]
    v = np.concatenate(parts).astype(np.float32)
    v = np.concatenate([v, -v])
    return v[~(np.abs(v) > fmax)]  # the encoder's domain: |v| <= largest finite, or NaN


def expected_codes(v, name):
    return v.astype(FP8[name][0]).view(np.uint8)


def _encode_kernel(x_ref, o_ref, *, dtype):
    idx = jnp.arange(x_ref.shape[0])
    o_ref[idx] = fp8_lib.encode_fp8(x_ref[idx], dtype).astype(jnp.uint8)


def encode_in_pallas(v, name, interpret):
    n = len(v)
    block = 4096
    pad = (-n) % block
    x = jnp.asarray(np.concatenate([v, np.zeros(pad, np.float32)]))
    out = pl.pallas_call(
        functools.partial(_encode_kernel, dtype=jnp.dtype(name)),
        grid=(x.shape[0] // block,),
        in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
        out_specs=pl.BlockSpec((block,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct(x.shape, jnp.uint8), interpret=interpret)(x)
    return np.asarray(out)[:n]


def check_pair(a, b, v, name, what):
    """Two code arrays for the same values: equal except within a tie of ``v``, one step apart."""
    a, b = f64(a), f64(b)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    if same.all():
        return
    grid = fp8_grid(name)
    ia, ib = np.searchsorted(grid, a[~same]), np.searchsorted(grid, b[~same])
    assert (np.abs(ia - ib) <= 1).all(), f"{what}: codes more than one step apart"
    mid = (a[~same] + b[~same]) / 2
    near = np.abs(v[~same] - mid) <= 1e-5 * np.maximum(np.abs(mid), grid[grid > 0][0])
    assert near.all(), f"{what}: {int((~near).sum())} codes differ away from a rounding tie"


# ------------------------------------------------------------------------------------------------
# MX (MXFP8 / MXFP4): the float64 oracle of jax's rule, and the check of a record against it
# ------------------------------------------------------------------------------------------------

MX_ELEM = {"mxfp8": ("float8_e4m3fn", 448.0), "mxfp4": ("float4_e2m1fn", 6.0)}


def mx_oracle(y, fmt):
    """float64 MX of ``y [..., N]``: (scale exponent ``[..., N/32]`` float, NaN for a block with
    NaN / inf; ``v [..., N]``, the exact ``y / scale`` the codes should round to).
    ``scale = 2**ceil(log2(amax / elem_max))``, at least ``2**-127``."""
    y = f64(y)
    elem_max = MX_ELEM[fmt][1]
    blocks = y.reshape(y.shape[:-1] + (-1, 32))
    with np.errstate(invalid="ignore", divide="ignore"):
        amax = np.max(np.abs(blocks), axis=-1)
        e = np.ceil(np.log2(amax / elem_max))
    e = np.where(amax == 0, -127.0, np.maximum(e, -127.0))
    e = np.where(np.isfinite(blocks).all(axis=-1), e, np.nan)
    with np.errstate(invalid="ignore"):
        v = blocks / np.exp2(e)[..., None]
    return e, v.reshape(y.shape)


def codes_bytes(a):
    """Element or scale codes as bytes (fp4: one code per byte, as numpy holds them)."""
    a = jnp.asarray(a)
    if a.dtype == jnp.float4_e2m1fn:
        return np.asarray(jax.lax.bitcast_convert_type(a.reshape(a.shape[:-1] + (-1, 2)), jnp.uint8))
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def scale_exponents(scale):
    """e8m0 scales -> their exponents (code - 127), NaN for code 255."""
    code = codes_bytes(scale).astype(np.float64)
    return np.where(code == 255, np.nan, code - 127)


def check_mx(qa, y64, fmt, what=""):
    """Scales equal the oracle's except where float32 rounding of ``y`` moved amax across a
    power of two (then the block's amax / elem_max is within 1e-5 of one); codes the RNE of the
    exact ``y / scale`` except within 1e-5 of a tie; a NaN block: NaN scale."""
    e_want, _ = mx_oracle(y64, fmt)
    e_got = scale_exponents(qa.scale).reshape(e_want.shape)
    assert np.array_equal(np.isnan(e_got), np.isnan(e_want)), f"{what}: NaN scales differ"
    diff = (e_got != e_want) & ~np.isnan(e_want)
    if diff.any():
        blocks = f64(y64).reshape(e_want.shape + (32,))
        q = np.max(np.abs(blocks), axis=-1)[diff] / MX_ELEM[fmt][1]
        near = np.abs(np.log2(q) - np.round(np.log2(q))) < 1e-5
        assert near.all() and np.all(np.abs(e_got[diff] - e_want[diff]) == 1), (
            f"{what}: {int(diff.sum())} scales differ away from a power of two")
    blocks = f64(y64).reshape(e_got.shape + (32,))
    with np.errstate(invalid="ignore"):
        v = (blocks / np.exp2(e_got)[..., None]).reshape(np.shape(y64))
    data = f64(np.asarray(jnp.asarray(qa.data).astype(jnp.float32))).reshape(np.shape(y64))
    finite = ~np.isnan(np.repeat(e_got, 32, axis=-1).reshape(np.shape(y64)))
    check_codes(data[finite], v[finite], MX_ELEM[fmt][0], what=what)


# ------------------------------------------------------------------------------------------------
# Group-scaled FP8 (1 x 128): the float64 oracle of vLLM's per_token_group_quant_fp8
# ------------------------------------------------------------------------------------------------

GROUP = 128


def group_oracle(y, name, fp8_max, eps, ue8m0):
    """float64 group FP8 of ``y [..., N]``: ``(scale [..., N/128], v [..., N])``, NaN for a group
    holding NaN or inf. ``scale`` is the float32 ``max(amax, eps) / fp8_max`` (a float64
    quotient of float32 values rounded once more to float32: the IEEE float32 quotient, since
    53 >= 2 * 24 + 2), for UE8M0 then ``2**ceil(log2(.))``; ``v = y / scale`` exactly (float64
    rounds no quotient of float32 values onto an fp8 midpoint it is not on)."""
    y = f64(y)
    g = y.reshape(y.shape[:-1] + (-1, GROUP))
    amax = np.max(np.abs(g), axis=-1)
    a = np.maximum(amax.astype(np.float32), np.float32(eps)).astype(np.float64)
    with np.errstate(invalid="ignore"):
        scale = (a / fp8_max).astype(np.float32).astype(np.float64)
        if ue8m0:
            scale = np.exp2(np.ceil(np.log2(scale)))
    scale[~np.isfinite(g).all(axis=-1)] = np.nan
    with np.errstate(invalid="ignore"):
        v = g / scale[..., None]
    return scale, v.reshape(y.shape)


def check_group(qa, y64, what="", exact=False):
    """Scales: the oracle's of ``y64`` within 1e-6 (``exact``: bit for bit, where ``y64`` holds
    the float32 values the kernel quantized); UE8M0 scales powers of two. Codes: the RNE of the
    exact ``y / scale`` with the record's own scale (``exact``: every one; otherwise but within
    1e-5 of a tie, where the kernel's float32 ``y`` and ``y64`` may round apart)."""
    fmt = qa.format
    name = jnp.dtype(fmt.dtype).name
    y64 = f64(y64)
    assert qa.scale.shape == y64.shape[:-1] + (y64.shape[-1] // GROUP,), what
    assert qa.scale.dtype == jnp.float32, what
    scale64, _ = group_oracle(y64, name, fmt.fp8_max, fmt.eps, fmt.ue8m0)
    got = f64(qa.scale)
    if exact:
        assert np.array_equal(got, scale64, equal_nan=True), f"{what}: scales differ from the oracle"
    elif fmt.ue8m0:  # the power of two above a quotient within 1e-6 of one may be either neighbour
        raw, _ = group_oracle(y64, name, fmt.fp8_max, fmt.eps, False)
        with np.errstate(invalid="ignore", divide="ignore"):
            edge = np.abs(raw / np.exp2(np.round(np.log2(raw))) - 1) <= 1e-6
        ok = (got == scale64) | edge & ((got == 2 * scale64) | (got == scale64 / 2))
        assert np.array_equal(np.isnan(got), np.isnan(scale64)), f"{what}: NaN scales differ"
        assert ok[~np.isnan(scale64)].all(), f"{what}: UE8M0 scales differ from the oracle"
    else:
        check_scales(qa.scale, scale64, 1e-6, what)
    if fmt.ue8m0:
        ok = np.isfinite(got)
        assert np.array_equal(np.exp2(np.round(np.log2(got[ok]))), got[ok]), f"{what}: not powers of two"
    g = y64.reshape(got.shape + (GROUP,))
    with np.errstate(invalid="ignore"):
        v = (g / got[..., None]).reshape(y64.shape)
    data = f64(qa.data)
    if exact:
        want = rne_to_grid(np.where(np.isnan(v), 0.0, v), fp8_grid(name))
        nan = np.isnan(v)
        assert np.isnan(data[nan]).all(), f"{what}: a NaN group has non-NaN codes"
        assert np.array_equal(data[~nan], want[~nan]), (
            f"{what}: {int((data[~nan] != want[~nan]).sum())} codes differ from the RNE of the "
            "exact quotient")
        return
    check_codes(qa.data, v, name, what=what)


def ue8m0_flips(qa, ref):
    """The groups where two UE8M0 group records of nearly equal values (a kernel's and the
    reference's) have different scales. Allowed only at a power-of-two edge of the group's amax:
    scales one power of two apart, the smaller scale's top code fp8_max and the larger's
    fp8_max / 2. Returns the mask of those groups."""
    s, r = f64(qa.scale), f64(ref.scale)
    assert np.array_equal(np.isnan(s), np.isnan(r)), "NaN scales differ"
    flip = (s != r) & ~np.isnan(r)
    if flip.any():
        lo, hi = np.minimum(s, r)[flip], np.maximum(s, r)[flip]
        assert (hi == 2 * lo).all(), "UE8M0 scales more than one power of two apart"
        top = jax.jit(lambda d: jnp.abs(d.astype(jnp.float32)).reshape(s.shape + (-1,)).max(-1))
        top_q, top_r = f64(top(qa.data))[flip], f64(top(ref.data))[flip]
        q_lo = s[flip] < r[flip]
        fmax = qa.format.fp8_max
        assert (np.where(q_lo, top_q, top_r) == fmax).all(), "a flipped scale away from an edge"
        assert (np.where(q_lo, top_r, top_q) == fmax / 2).all(), "a flipped scale away from an edge"
    return flip


def check_quantized(qa, y64, what="", exact=False):
    """A ``QuantizedActivation`` against the float64 ``y64 [..., N]`` it quantizes, by its
    format: per-token FP8 (scales within 1e-6, codes the RNE of the exact ``y / scale`` but at
    ties; the format's fp8_max, min_scale, scale_ub and groups), MX (``check_mx``) or group FP8
    (``check_group``; ``exact``: ``y64`` holds the float32 values quantized)."""
    fmt = qa.format
    y64 = f64(y64)
    assert qa.data.shape == y64.shape, (what, qa.data.shape, y64.shape)
    if fmt.name in MX_ELEM:
        assert qa.scale.shape == y64.shape[:-1] + (y64.shape[-1] // 32,), what
        check_mx(qa, y64, fmt.name, what)
        return
    if fmt.name.startswith("fp8_group"):
        check_group(qa, y64, what, exact)
        return
    name = jnp.dtype(fmt.dtype).name
    lead, n, g = y64.shape[:-1], y64.shape[-1], fmt.groups
    assert qa.scale.shape == lead + (g,) and qa.scale.dtype == jnp.float32, what
    scale64, v = quant_oracle(y64.reshape(lead + (g, n // g)), name, fmt.fp8_max, fmt.min_scale,
                              fmt.scale_ub)
    check_scales(qa.scale, scale64, 1e-6, what)
    check_codes(qa.data, v.reshape(y64.shape), name, what=what)


def assert_close_nan(out, ref, tol, what=""):
    """``assert_close`` where ``ref`` may hold NaN rows: NaN exactly there, close elsewhere."""
    out, ref = f64(out), f64(ref)
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    assert np.array_equal(np.isnan(out), np.isnan(ref)), f"{what}: NaN where the oracle has none, or not where it has"
    ok = ~np.isnan(ref)
    assert_close(out[ok], ref[ok], tol, what)
