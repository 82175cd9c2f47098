"""The output formats as values and the records that carry them: option checks, defaults by
target, records that validate themselves (and never reinterpret their arrays), dequantization;
the element encoders (FP8, e2m1) against XLA / ml_dtypes exhaustively; the e8m0 scale rule of MX
against jax's rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import k3pallas as kp
from k3pallas import _compat, fp8 as fp8_lib, formats, platform

from support import (FP8, codes_bytes, encode_in_pallas, encoder_inputs, expected_codes, f64,
                     mx_oracle, scale_exponents)

FP8_NAMES = list(FP8)
MX = ["mxfp8", "mxfp4"]


def rand(rng, shape, dtype=jnp.bfloat16, spread=8):
    """Normal values with per-row magnitudes over 2**-spread .. 2**spread."""
    x = rng.standard_normal(shape)
    if spread:
        x = x * np.exp2(rng.integers(-spread, spread + 1, shape[:-1] + (1,)))
    return jnp.asarray(x, dtype)


# ------------------------------------------------------------------------------------------------
# Format values
# ------------------------------------------------------------------------------------------------


def test_names_and_values():
    assert formats.as_format("fp8_per_token") == kp.Fp8PerToken()
    assert formats.as_format("mxfp8") is kp.MXFP8 and formats.as_format("mxfp4") is kp.MXFP4
    assert kp.MXFP4.block == 32 and kp.Fp8PerToken.block is None
    f = kp.Fp8PerToken(jnp.float8_e4m3fnuz, fp8_max=240, groups=np.int64(2))
    assert f.fp8_max == 240.0 and f.groups == 2 and isinstance(f.groups, int)
    assert hash(f) == hash(kp.Fp8PerToken("float8_e4m3fnuz", 240.0, groups=2))  # a static value
    with pytest.raises(ValueError, match="out_format must be a k3pallas format or one of"):
        formats.as_format("mxfp6")
    with pytest.raises(TypeError, match="out_format must be a k3pallas format"):
        formats.as_format(jnp.float8_e4m3fn)


@pytest.mark.parametrize("groups", [0, 0.0, False, True, 2.0, -1, "2"])
def test_groups_is_a_positive_integer(groups):
    """Round 3: 0, 0.0 and False became 1 silently in three ops."""
    with pytest.raises(ValueError, match="groups must be an integer >= 1"):
        kp.Fp8PerToken(groups=groups)
    x = jnp.ones((2, 64))
    for fn in (lambda: kp.per_token_fp8_quant(x, scale_groups=groups),
               lambda: kp.rmsnorm_gated_fp8_per_token(x.reshape(2, 2, 32), jnp.ones(32),
                                                      x.reshape(2, 2, 32), scale_groups=groups)):
        with pytest.raises(ValueError, match="scale_groups must be an integer >= 1"):
            fn()
    with pytest.raises(TypeError, match="groups must be a Python int"):
        jax.jit(lambda g: kp.Fp8PerToken(groups=g))(2)


def test_per_token_options():
    with pytest.raises(TypeError, match="Fp8PerToken: dtype must be one of"):
        kp.Fp8PerToken(jnp.int8)
    with pytest.raises(TypeError, match="Fp8PerToken: dtype must be one of"):
        kp.Fp8PerToken(jnp.bfloat16)
    with pytest.raises(ValueError, match=r"fp8_max=300.0 exceeds the largest finite float8_e4m3fnuz value 240"):
        kp.Fp8PerToken(jnp.float8_e4m3fnuz, fp8_max=300.0)
    with pytest.raises(ValueError, match="exceeds the largest finite float8_e4m3fn value 448"):
        kp.Fp8PerToken(jnp.float8_e4m3fn, fp8_max=449.0)
    for name in ("fp8_max", "min_scale", "scale_ub"):
        with pytest.raises(ValueError, match=f"{name} must be finite and > 0"):
            kp.Fp8PerToken(**{name: 0.0})
        with pytest.raises(ValueError, match=f"{name} must be finite and > 0"):
            kp.Fp8PerToken(**{name: float("inf")})
        with pytest.raises(TypeError, match=f"{name} must be a Python float"):
            kp.Fp8PerToken(**{name: jnp.float32(1.0)})
    # fp8_max checked against the format when the dtype is known (here: by the device).
    with pytest.raises(ValueError, match="exceeds the largest finite float8_e4m3fnuz"):
        kp.Fp8PerToken(fp8_max=300.0).resolve(platform.target_from_name("gfx942"))


def test_defaults_by_target():
    assert kp.FP8_E4M3FN_MAX == 448.0 and kp.FP8_E4M3FNUZ_MAX == 224.0
    assert kp.FP8_E4M3FNUZ_MAX_AITER == 240.0 and kp.FP8_E5M2_MAX == 57344.0
    for name, dtype, fp8_max in (("gfx942", jnp.float8_e4m3fnuz, 224.0), ("MI325X", jnp.float8_e4m3fnuz, 224.0),
                                 ("gfx950", jnp.float8_e4m3fn, 448.0), ("H200", jnp.float8_e4m3fn, 448.0),
                                 ("cpu", jnp.float8_e4m3fn, 448.0)):
        f = kp.Fp8PerToken().resolve(platform.target_from_name(name))
        assert f.dtype == jnp.dtype(dtype) and f.fp8_max == fp8_max, name
        assert f.min_scale == 1.0 / (fp8_max * 512) and f.scale_ub is None and f.groups == 1
        assert kp.default_fp8_dtype(name) == jnp.dtype(dtype)
    assert kp.Fp8PerToken(jnp.float8_e5m2).resolve(platform.target_from_name("gfx942")).fp8_max == 57344.0
    unknown = platform.target_for("AMD Instinct MI999X", "gpu")
    with pytest.raises(ValueError, match="FP8 format of AMD device .* is not known"):
        kp.Fp8PerToken().resolve(unknown)
    assert kp.MXFP8.resolve(unknown) is kp.MXFP8  # MX elements do not depend on the device
    for junk in ("gfxJUNK", "gfx999", "MI400X", "tpu"):
        with pytest.raises(ValueError, match="unknown device name"):
            kp.default_fp8_dtype(junk)
    with pytest.raises(TypeError, match="default_fp8_dtype: device must be"):
        kp.default_fp8_dtype(123)


# ------------------------------------------------------------------------------------------------
# Records: built checked, never reinterpreted
# ------------------------------------------------------------------------------------------------


def test_activation_records_store_their_format(rng):
    x = rand(rng, (3, 96), jnp.float32)
    for fmt in ("fp8_per_token", "mxfp8", "mxfp4"):
        qa = kp.quantize(x, fmt, impl="reference")
        again = kp.QuantizedActivation(qa.data, qa.scale, fmt)
        assert again.format.name == fmt and qa.format.name == fmt
        data, scale = again  # unpacks
        assert len(jax.tree_util.tree_leaves(qa)) == 2
        back = jax.jit(lambda q: q)(qa)
        assert isinstance(back, kp.QuantizedActivation) and back.format == qa.format
    fp8 = kp.quantize(x, "fp8_per_token", impl="reference")
    assert kp.QuantizedActivation(fp8.data, fp8.scale, "fp8_per_token").format == fp8.format


def test_activation_records_refuse_what_does_not_fit(rng):
    """Round 3: e5m2 or float32 data with an e8m0 scale called itself "mxfp8"; an MX scale cut
    to one column dequantized with one scale per row."""
    x = rand(rng, (4, 96), jnp.float32)
    mx = kp.quantize(x, "mxfp8", impl="reference")
    e8m0 = mx.scale
    bad = [
        (x.astype(jnp.float8_e5m2), e8m0, "mxfp8", TypeError, "mxfp8 data must be float8_e4m3fn"),
        (x, e8m0, "mxfp8", TypeError, "mxfp8 data must be float8_e4m3fn, got float32"),
        (mx.data, e8m0[:, :1], "mxfp8", ValueError, r"needs scales of shape \(4, 3\)"),
        (mx.data, e8m0.astype(jnp.float32), "mxfp8", TypeError, "scales must be float8_e8m0fnu"),
        (mx.data[:, :40], e8m0, "mxfp8", ValueError, "multiple of 32"),
        (mx.data, e8m0, "mxfp4", TypeError, "mxfp4 data must be float4_e2m1fn"),
        (mx.data, e8m0, "fp8_per_token", TypeError, "scales must be float32"),
        (x.astype(jnp.float8_e4m3fn), jnp.ones((4, 5)), "fp8_per_token", ValueError,
         r"groups=1 must|needs scales of shape \(4, 1\)"),
        (x.astype(jnp.float8_e4m3fn), jnp.ones((4, 5)), kp.Fp8PerToken(groups=5), ValueError,
         r"groups=5 must divide"),
        (x, jnp.ones((4, 1)), "fp8_per_token", TypeError, "data must have an fp8 dtype"),
        (x.astype(jnp.float8_e4m3fn), jnp.ones((4, 1)), kp.Fp8PerToken(jnp.float8_e5m2), TypeError,
         "data must be float8_e5m2"),
        (x.astype(jnp.float8_e4m3fn), jnp.ones((3, 1)), "fp8_per_token", ValueError, "needs scales of shape"),
        (x.astype(jnp.float8_e4m3fn), jnp.ones((4,)), "fp8_per_token", ValueError, "same rank"),
        ([[1.0]], jnp.ones((1, 1)), "fp8_per_token", TypeError, "data must be an array"),
        (mx.data, e8m0, "nvfp4", ValueError, "out_format must be"),
    ]
    for data, scale, fmt, err, match in bad:
        with pytest.raises(err, match=match):
            kp.QuantizedActivation(data, scale, fmt)
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'format'"):
        kp.QuantizedActivation(mx.data, mx.scale)


def test_dequantize_every_format(rng):
    x = rand(rng, (3, 4, 256), jnp.float32)
    for fmt, tol in (("fp8_per_token", 2**-4), ("mxfp8", 2**-4), ("mxfp4", 0.25)):
        qa = kp.quantize(x, fmt, impl="reference")
        d, ref = np.asarray(qa.dequantize()), np.asarray(x)
        blocks = np.abs(ref).reshape(3, 4, -1, 32).max(-1).repeat(32, -1).reshape(ref.shape)
        assert np.all(np.abs(d - ref) <= tol * blocks + 1e-30), fmt
        assert qa.dequantize(jnp.bfloat16).dtype == jnp.bfloat16
    with pytest.raises(TypeError, match="dtype must be floating"):
        qa.dequantize(jnp.int8)
    # Per scale group: each group of N / G columns times its own scale.
    qa = kp.per_token_fp8_quant(x, scale_groups=4, impl="reference")
    want = (f64(qa.data).reshape(3, 4, 4, 64) * f64(qa.scale)[..., None]).reshape(3, 4, 256)
    np.testing.assert_allclose(np.asarray(qa.dequantize()), want, rtol=1e-6)


def test_weight_records_refuse_what_does_not_fit(rng):
    """Round 3: MX weights transposed with layout "kn", a transposed or truncated scale, K = 48,
    were accepted by linear and dequantize."""
    w = jnp.asarray(rng.standard_normal((96, 64)), jnp.float32)  # [K, N]
    qw = kp.quantize_weight(w, "mxfp8")
    sq = kp.quantize_weight(w[:64], "mxfp8")
    assert qw.data.shape == (64, 96) and qw.scale.shape == (64, 3) and qw.shape == (96, 64)
    bad = [
        (qw.data, qw.scale, "mxfp8", "kn", r"must have shape \(2, 96\)"),  # [N, K] read as [K, N]
        (sq.data, sq.scale, "mxfp8", "kn", r"must have shape \(2, 64\)"),  # a square weight too
        (qw.data, qw.scale.T, "mxfp8", "nk", r"must have shape \(64, 3\)"),
        (qw.data, qw.scale[:, :2], "mxfp8", "nk", r"must have shape \(64, 3\)"),
        (qw.data[:, :48], qw.scale[:, :1], "mxfp8", "nk", "multiple of 32"),
        (qw.data, qw.scale, "mxfp8", "kk", "layout must be"),
        (qw.data[0], qw.scale, "mxfp8", "nk", "must be a matrix"),
    ]
    for data, scale, fmt, layout, match in bad:
        with pytest.raises((ValueError, TypeError), match=match):
            kp.QuantizedWeight(data, scale, fmt, layout)
    f8 = kp.quantize_weight(w, "fp8_per_token")
    with pytest.raises(ValueError, match=r"must have shape \(64,\)"):
        kp.QuantizedWeight(f8.data, f8.scale[:10], "fp8_per_token")
    with pytest.raises(ValueError, match="groups must be 1"):
        kp.QuantizedWeight(f8.data, f8.scale, kp.Fp8PerToken(groups=2))
    with pytest.raises(TypeError, match="fp8 dtype"):
        kp.QuantizedWeight(f8.data.astype(jnp.float32), f8.scale, "fp8_per_token")
    # The same arrays in their own layout are a good record, and dequantize alike.
    kn = kp.QuantizedWeight(qw.data.T, qw.scale.T, "mxfp8", "kn")
    np.testing.assert_array_equal(np.asarray(kn.dequantize()), np.asarray(qw.dequantize()))
    assert kp.QuantizedWeight(f8.data, jnp.float32(0.5), "fp8_per_token").dequantize().shape == (96, 64)


# ------------------------------------------------------------------------------------------------
# Element encoders
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FP8_NAMES)
def test_fp8_encoder_bit_exact_in_xla_and_in_a_kernel(rng, name):
    v = encoder_inputs(name, rng)
    got = np.asarray(jax.jit(lambda a: fp8_lib.encode_fp8(a, jnp.dtype(name)))(v)).astype(np.uint8)
    want = expected_codes(v, name)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(float(v[i]), int(got[i]), int(want[i])) for i in bad[:8]]
    v = encoder_inputs(name, rng, n_random=2_000)
    assert np.array_equal(encode_in_pallas(v, name, interpret=True), expected_codes(v, name))


def test_every_fp8_code_round_trips():
    """Decoding all 256 codes and encoding again gives the code back (NaN codes: the format's
    NaN; fnuz has one code for zero)."""
    for name in FP8_NAMES:
        dt = FP8[name][0]
        vals = np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)
        finite = np.isfinite(vals)
        got = np.asarray(fp8_lib.encode_fp8(jnp.asarray(vals[finite]), jnp.dtype(name))).astype(np.uint8)
        assert np.array_equal(got, np.arange(256, dtype=np.uint8)[finite]), name
    v = np.array([np.nan, -np.nan], np.float32)
    host = v.astype(ml_dtypes.float8_e5m2).view(np.uint8)
    assert np.asarray(fp8_lib.encode_fp8(jnp.asarray(v), jnp.float8_e5m2)).tolist() == host.tolist() == [0x7E, 0xFE]


def e2m1_inputs():
    """Every float32 whose low 16 bits are one of 8 edge patterns: all 65536 high halves (sign,
    exponent, the top 7 mantissa bits), so every rounding class of e2m1 at every exponent,
    within the encoder's domain |v| <= 6."""
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lo = np.array([0, 1, 2, 0x7FFF, 0x8000, 0x8001, 0xFFFE, 0xFFFF], np.uint32)
    v = (hi[:, None] | lo[None, :]).ravel().view(np.float32)
    return v[np.abs(v) <= 6]  # NaN is left out by the comparison


def test_e2m1_encoder():
    v = e2m1_inputs()
    got = np.asarray(jax.jit(lambda a: fp8_lib.encode_fp8(a, jnp.float4_e2m1fn))(v))
    want = v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    bad = np.nonzero(got != want)[0]
    assert v.size > 250_000 and bad.size == 0, [(float(v[i]), got[i], want[i]) for i in bad[:8]]
    vals = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert np.array_equal(np.asarray(fp8_lib.encode_fp8(jnp.asarray(vals), jnp.float4_e2m1fn)),
                          np.arange(16))
    # No NaN in e2m1: XLA converts every NaN to 0x8 (-0); so does the encoder (the kernels never
    # feed it NaN: a block with NaN has the NaN scale).
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], np.uint32).view(np.float32)
    got = np.asarray(fp8_lib.encode_fp8(jnp.asarray(nans), jnp.float4_e2m1fn))
    xla = np.asarray(jax.jit(lambda a: a.astype(jnp.float4_e2m1fn))(nans)).view(np.uint8)
    assert (got == 0x8).all() and (xla == 0x8).all()


# ------------------------------------------------------------------------------------------------
# MX: the e8m0 scale rule
# ------------------------------------------------------------------------------------------------


def ieee_rule(amax, elem_max):
    """jax's e8m0 rounding up of ``amax / elem_max``, on the host with IEEE float32 (numpy)."""
    q = (amax.astype(np.float32) / np.float32(elem_max)).astype(np.float32)
    b = q.view(np.uint32)
    e, m = b >> 23, b & 0x7FFFFF
    up = (m > 0) & (e != 0xFE) & ~((e == 0) & (m <= 0x400000))
    return (e + up).astype(np.int32)


@pytest.mark.parametrize("fmt", MX)
def test_scale_code_equals_jax_rule_exhaustively_by_exponent(rng, fmt):
    """Every exponent with every mantissa within 4096 of the boundaries that decide the rule
    (0, elem_max's mantissa, 0x400000, 0x7FFFFF), and random finite values: the integer rule
    equals jax's rounding up of the IEEE quotient."""
    f = formats.as_format(fmt)
    m_m = f.threshold_bits[1]
    around = np.concatenate([np.arange(4096), 0x7FFFFF - np.arange(4096),
                             m_m + np.arange(-4096, 4096), 0x400000 + np.arange(-4096, 4096)])
    mants = np.unique(around.astype(np.int64) & 0x7FFFFF).astype(np.uint32)
    bits = ((np.arange(255, dtype=np.uint32)[:, None] << 23) | mants[None, :]).ravel()
    bits = np.concatenate([bits, rng.integers(0, 0x7F800000, 1_000_000, dtype=np.uint32)])
    amax = bits.view(np.float32)
    got = np.asarray(jax.jit(f.scale_code)(jnp.asarray(amax)))
    want = ieee_rule(amax, f.elem_max)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(hex(int(bits[i])), int(got[i]), int(want[i])) for i in bad[:8]]


def test_scale_codes_of_exact_powers_and_the_exact_reciprocal():
    """Where the rounding-up rule has nothing to round (amax / elem_max a power of two), the code
    is ml_dtypes' own e8m0 conversion of that power; the reciprocal is exact."""
    for fmt in MX:
        f = formats.as_format(fmt)
        k = np.arange(-127, 128)
        amax = f.elem_max * np.exp2(k.astype(np.float64))
        ok = amax < np.finfo(np.float32).max
        got = np.asarray(f.scale_code(jnp.asarray(amax[ok].astype(np.float32))))
        want = np.exp2(k[ok].astype(np.float64)).astype(np.float32).astype(
            ml_dtypes.float8_e8m0fnu).view(np.uint8)
        assert ok.sum() > 240 and np.array_equal(got, want), fmt
    code = jnp.arange(256, dtype=jnp.int32)
    inv = np.asarray(formats.inv_scale(code))
    dec = np.where(np.arange(256) == 255, np.nan, np.exp2(np.arange(256) - 127.0)).astype(np.float32)
    assert np.array_equal(inv[:254] * dec[:254], np.ones(254, np.float32))  # 254: unreachable
    assert np.isnan(inv[255]) and np.isnan(dec[255])
    assert np.array_equal(np.asarray(formats.as_e8m0(code)).astype(np.float32)[:255], dec[:255])


def test_fp4_packing_is_the_nibble_order_jax_reads():
    """Element 2j in the low nibble: jax's bitcast of a byte to float4_e2m1fn gives [low, high]."""
    packed = jnp.array([[0x21, 0xF7]], jnp.uint8)
    vals = np.asarray(formats.unpack_fp4(packed, 4).astype(jnp.float32))
    assert np.array_equal(vals, [[0.5, 1.0, 6.0, -6.0]])


@pytest.mark.parametrize("fmt", MX)
def test_codes_equal_jax_s_own_quantization(rng, fmt):
    """The standalone quantization, kernel and reference: bytes equal to jax's own MX
    quantization of the same values (finite data), every input dtype."""
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        x = rand(rng, (9, 512), dtype, spread=6 if dtype == jnp.float16 else 20)
        want_d, want_s = _compat.jax_mx_quantize(x.astype(jnp.float32), formats.as_format(fmt).dtype)
        for impl in ("interpret", "reference"):
            qa = kp.quantize(x, fmt, impl=impl)
            assert np.array_equal(codes_bytes(qa.data), codes_bytes(want_d)), (fmt, dtype, impl)
            assert np.array_equal(codes_bytes(qa.scale), codes_bytes(want_s)), (fmt, dtype, impl)


def test_ieee_where_xla_cpu_flushes():
    """Why the kernels and the reference do not divide as jax's own quantize does: XLA's CPU
    flushes subnormals. A block of amax 1.5 * 6 * 2**-127: IEEE says code 1 (2**-126); a zero
    block: zero codes, where jax's CPU division by the subnormal 2**-127 gives NaN."""
    y = np.zeros((2, 32), np.float32)
    y[0, 0] = 6 * 1.5 * 2.0**-127
    assert ieee_rule(np.array([y[0, 0]]), 6.0)[0] == 1
    for impl in ("interpret", "reference"):
        qa = kp.quantize(jnp.asarray(y), "mxfp4", impl=impl)
        assert list(codes_bytes(qa.scale)[:, 0]) == [1, 0]
        assert (np.asarray(qa.data.astype(jnp.float32))[1] == 0).all()
        assert np.asarray(qa.data.astype(jnp.float32))[0, 0] == 6 * 0.75 - 0.5  # 4.5 -> RNE 4


@pytest.mark.parametrize("fmt", MX)
def test_nonfinite_blocks_and_range_ends(fmt):
    """A block with NaN or inf: NaN scale (code 255), MXFP8 NaN codes, no other block changes.
    A zero block: code 0 (2**-127), zero codes. Tiny and huge finite blocks stay exact."""
    from k3pallas import testing

    y = np.ones((4, 128), np.float32)
    y[0, 3] = np.nan
    y[1, 40] = np.inf
    y[2, 64:96] = 0.0
    y[3, :32] = 1e-40  # a subnormal block
    y[3, 32:64] = 3e38
    for impl in ("interpret", "reference"):
        with testing.poisoned_outputs():
            qa = kp.quantize(jnp.asarray(y), fmt, impl=impl)
        code = codes_bytes(qa.scale)
        assert code[0, 0] == code[1, 1] == 255 and (np.delete(code.ravel(), [0, 5]) != 255).all()
        assert code[2, 2] == 0 and (np.asarray(qa.data.astype(jnp.float32))[2, 64:96] == 0).all()
        d = np.asarray(qa.dequantize())
        assert np.isnan(d[0, :32]).all() and np.isnan(d[1, 32:64]).all()
        assert np.all(d[0, 32:] == 1) and np.all(d[1, :32] == 1) and np.all(d[1, 64:] == 1)
        if fmt == "mxfp8":
            assert np.isnan(np.asarray(qa.data.astype(jnp.float32))[0, :32]).all()
        assert np.array_equal(scale_exponents(qa.scale)[3:], mx_oracle(y[3:], fmt)[0]), (impl, fmt)


# ------------------------------------------------------------------------------------------------
# Group-scaled FP8 (1 x 128)
# ------------------------------------------------------------------------------------------------

GROUP_DTYPES = [("float8_e4m3fn", 448.0), ("float8_e4m3fnuz", 224.0), ("float8_e4m3fnuz", 240.0),
                ("float8_e5m2", 57344.0)]


def test_group_format_values():
    assert formats.as_format("fp8_group128") == kp.Fp8Group() == kp.FP8_GROUP128
    assert formats.as_format("fp8_group128_ue8m0") == kp.Fp8Group(ue8m0=True)
    assert kp.FP8_GROUP128.name == "fp8_group128" and kp.FP8_GROUP128_UE8M0.name == "fp8_group128_ue8m0"
    assert kp.FP8_GROUP128.block == 128 and kp.FP8_GROUP128.eps == 1e-10
    f = kp.FP8_GROUP128.resolve(platform.target_from_name("gfx942"))
    assert f.dtype == jnp.float8_e4m3fnuz and f.fp8_max == 224.0
    f = kp.FP8_GROUP128_UE8M0.resolve(platform.target_from_name("gfx950"))
    assert f.dtype == jnp.float8_e4m3fn and f.fp8_max == 448.0 and f.ue8m0
    assert hash(kp.Fp8Group("float8_e4m3fnuz", 240)) == hash(kp.Fp8Group(jnp.float8_e4m3fnuz, 240.0))
    bad = [(dict(dtype=jnp.float8_e4m3fn, fp8_max=300.0), ValueError, "must be a value of float8_e4m3fn"),
           (dict(dtype=jnp.float8_e4m3fn, fp8_max=480.0), ValueError, "exceeds the largest finite"),
           (dict(fp8_max=2.0), ValueError, "fp8_max"),
           (dict(eps=0.0), ValueError, "eps"),
           (dict(ue8m0=1), TypeError, "ue8m0 must be True or False"),
           (dict(dtype=jnp.int8), TypeError, "Fp8Group: dtype must be one of")]
    for kw, err, match in bad:
        with pytest.raises(err, match=match):
            kp.Fp8Group(**kw).bind(jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"eps=1e-30 is below fp8_max \* 2\*\*-100"):
        kp.Fp8Group(eps=1e-30).resolve(platform.target_from_name("cpu"))
    with pytest.raises(ValueError, match="fp8_max=300.0 must be a value"):  # checked when resolved
        kp.quantize(jnp.ones((2, 128)), kp.Fp8Group(fp8_max=300.0))


@pytest.mark.parametrize("c", [448.0, 224.0, 240.0, 57344.0, 4.0, 6.0, 15.0])
def test_scale_is_the_ieee_quotient(rng, c):
    """``div_by_constant(a, c)`` is the IEEE float32 ``a / c`` (numpy's), bit for bit, over
    random mantissas in every binade from ``c * 2**-100`` up, and at the quotients' edges
    (``a`` = ``c`` times powers of two and their neighbours); ``pow2_ceil_code`` is
    ``ceil(log2(a / c))``."""
    n = 200_000
    a = ((2**23 + rng.integers(0, 2**23, n)) * np.exp2(rng.integers(-90, 104, n) - 23.0)).astype(np.float32)
    edge = (np.float32(c) * np.exp2(np.arange(-100, 100.0))).astype(np.float32)
    a = np.concatenate([a, edge, np.nextafter(edge, np.float32(np.inf)), np.nextafter(edge, np.float32(0))])
    a = a[a >= np.float32(c * 2.0**-100)]
    want = a / np.float32(c)
    got = np.asarray(jax.jit(lambda a: formats.div_by_constant(a, c))(a))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), int((got != want).sum())
    code = np.asarray(jax.jit(lambda a: formats.pow2_ceil_code(a, c))(a))
    np.testing.assert_array_equal(code, np.ceil(np.log2(want.astype(np.float64))) + 127)


@pytest.mark.parametrize("name,fp8_max", GROUP_DTYPES)
def test_codes_are_the_rne_of_the_exact_quotient(rng, name, fp8_max):
    """``exact_quotient``: values at, and a few ulp either side of, every rounding midpoint (and
    grid point) times random scales, zeros, subnormal quotients, quotients just under the
    smallest normal; from a product ``y * inv``
    whose reciprocal is off by up to 3 ulp either way (a GPU's ``1 / s`` need not be IEEE):
    the codes are the RNE of the exact quotient, every one. The plain product misses many."""
    from support import fp8_grid, rne_to_grid

    fmt = kp.Fp8Group(name, fp8_max).bind(name)
    grid = fp8_grid(name)
    pos = grid[(grid > 0) & (grid <= fp8_max)]
    # Below the smallest normal at every distance down to its float32 neighbour (where the
    # correction's shift into the next binade would round up to twice it).
    under_normal = float(jnp.finfo(fmt.dtype).smallest_normal) * (1 - 2.0 ** -np.arange(1, 25))
    points = np.concatenate([(pos[:-1] + pos[1:]) / 2, pos, [pos[0] / 2, pos[0] / 4], under_normal])
    g = 4096
    amax = (rng.uniform(1, 2, g) * np.exp2(rng.integers(-40, 40, g))).astype(np.float32)
    s, _ = jax.jit(lambda a: fmt.block_scale(a, jnp.zeros(a.shape, bool)))(amax)
    s = np.asarray(s)
    y = (rng.choice(points, (g, 128)) * s[:, None].astype(np.float64)).astype(np.float32)
    y = (y.view(np.int32) + rng.integers(-3, 4, y.shape).astype(np.int32)).view(np.float32)
    y = np.minimum(y, amax[:, None]) * rng.choice(np.float32([-1, 1]), y.shape)
    y[:, :2] = 0.0
    y[:, 2] = -0.0
    want = rne_to_grid(y.astype(np.float64) / s[:, None], grid)
    inv = (1 / s).astype(np.float32)[:, None]
    for off in (-3, 0, 3):
        inv_off = (inv.view(np.int32) + off).view(np.float32)
        v = jax.jit(lambda y, s, i: fmt.scaled(y, s, i))(y, s[:, None], inv_off)
        got = f64(jnp.asarray(v).astype(fmt.dtype))
        assert np.array_equal(got, want), (off, int((got != want).sum()))
    plain = f64((jnp.asarray(y) * inv).astype(fmt.dtype))
    assert (plain != want).sum() > 100  # the test reaches the cases that need the correction


def test_a_nan_midpoint_stays_nan():
    """``exact_quotient``'s last step keeps a NaN midpoint (a NaN scale's group) NaN, with either
    sign of ``q``, for the NaNs each machine makes: a GPU's canonical 0x7FFFFFFF for both ``m``
    and the difference (one step up from it, as the step was first written, is the sign bit:
    -0.0 codes on an H100, never seen on a CPU, which keeps payloads); payload-keeping NaNs
    (the midpoint's low bits ``10...0``) with a difference of either sign; the quiet NaN.
    Finite midpoints step by one ulp toward the quotient, with ``q``'s sign."""
    nan = lambda b: np.array(b, np.uint32).view(np.float32)  # noqa: E731
    cases = [(0x7FFFFFFF, 0x7FFFFFFF), (0x7FC80000, 0x7FC00000), (0x7FC80000, 0xFFC00000),
             (0x7FF80000, 0xFFFFFFFF), (0x7FC00000, 0x7FC00000), (0x7FC00000, 0xFFC00000)]
    m = nan([c[0] for c in cases]).repeat(2)
    d = nan([c[1] for c in cases]).repeat(2).view(np.int32)
    q = np.tile(np.float32([np.nan, -np.nan]), len(cases))
    got = np.asarray(jax.jit(formats._signed_step)(m, q, d))
    assert np.isnan(got).all(), got.view(np.int32)
    m = np.float32([1.5, 1.5, 1.5, 0.25, 448.0])
    q = np.float32([1.4, -1.6, 1.5, -0.3, 440.0])
    d = np.float32([1e-3, -1e-3, 0.0, 2e-5, -1.0]).view(np.int32)  # m * s - |y|
    want = np.copysign(np.nextafter(m, np.where(d > 0, 0, np.where(d < 0, np.inf, m))), q)
    got = np.asarray(jax.jit(formats._signed_step)(m, q, d))
    assert np.array_equal(got.view(np.int32), want.astype(np.float32).view(np.int32))


@pytest.mark.parametrize("fmt", ["fp8_group128", "fp8_group128_ue8m0"])
@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_group_semantics(rng, fmt, impl):
    """Against the float64 oracle, every code and scale exact: groups of every magnitude, a zero
    group (zero codes, the scale ``eps / fp8_max``), groups holding NaN, +inf, -inf (NaN scale
    and codes), the largest finite values; no other group changes. Poisoned outputs."""
    from support import check_quantized

    from k3pallas import testing

    x = np.array(rand(rng, (6, 1024), jnp.float32, spread=30))
    x[0, :128] = 0.0
    x[1, 130] = np.nan
    x[2, 300] = np.inf
    x[3, 700] = -np.inf
    x[4, 900:1024] = np.float32(3.4e38) * np.sign(rng.standard_normal(124))
    x[5, :128] = np.float32(1e-30)
    with testing.poisoned_outputs():
        qa = jax.jit(lambda x: kp.quantize(x, fmt, impl=impl))(jnp.asarray(x))
    check_quantized(qa, x, f"{fmt} {impl}", exact=True)
    f = qa.format
    scale, data = np.asarray(qa.scale), f64(qa.data)
    zero_scale = f.eps / f.fp8_max if not f.ue8m0 else 2.0 ** np.ceil(np.log2(np.float32(f.eps / f.fp8_max)))
    assert np.isclose(scale[0, 0], zero_scale, rtol=1e-7) and (data[0, :128] == 0).all()
    for row, group in ((1, 1), (2, 2), (3, 5)):
        assert np.isnan(scale[row, group]) and np.isnan(data[row, group * 128:(group + 1) * 128]).all()
        assert np.isfinite(np.delete(scale[row], group)).all()
    top = np.max(np.abs(data[4, 896:]))  # the group of the largest floats: no overflow
    assert np.isfinite(scale[4]).all() and (f.fp8_max / 2 < top <= f.fp8_max if f.ue8m0 else top == f.fp8_max)


def test_group_records(rng):
    x = rand(rng, (4, 384), jnp.float32)
    qa = kp.quantize(x, "fp8_group128", impl="reference")
    assert kp.QuantizedActivation(qa.data, qa.scale, "fp8_group128").format == qa.format
    assert kp.QuantizedActivation(qa.data, qa.scale, "fp8_group128_ue8m0").format.ue8m0
    d = f64(qa.data).reshape(4, 3, 128) * f64(qa.scale)[..., None]
    np.testing.assert_array_equal(np.asarray(qa.dequantize()), d.reshape(4, 384).astype(np.float32))
    bad = [(qa.data, qa.scale[:, :1], ValueError, r"needs scales of shape \(4, 3\) \(one per group of 128\)"),
           (qa.data[:, :200], qa.scale, ValueError, "multiple of 128"),
           (qa.data, qa.scale.astype(jnp.bfloat16), TypeError, "scales must be float32"),
           (x, qa.scale, TypeError, "data must have an fp8 dtype"),
           (qa.data.astype(jnp.float8_e5m2), qa.scale, None, None)]
    for data, scale, err, match in bad:
        if err is None:  # the dtype is the record's own: e5m2 data binds an e5m2 format
            assert kp.QuantizedActivation(data, scale, "fp8_group128").format.dtype == jnp.float8_e5m2
            continue
        with pytest.raises(err, match=match):
            kp.QuantizedActivation(data, scale, "fp8_group128")
    for op in (lambda: kp.quantize(jnp.ones((2, 200)), "fp8_group128"),
               lambda: kp.rmsnorm_gated(jnp.ones((2, 4, 64)), jnp.ones(64), jnp.ones((2, 4, 64)),
                                        out_format="fp8_group128")):
        with pytest.raises(ValueError, match="must be a multiple of 128"):
            op()
