"""MX formats (MXFP8, MXFP4): the e2m1 encoder and the e8m0 rule, exhaustively; every MX op
against a float64 oracle and against jax's own MX quantization; the arrays jax.nn.scaled_matmul
takes; the linear layer; errors. Interpret mode and the jnp reference here; compiled on the GPU
in test_gpu_kernels.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import k3pallas as kp
from k3pallas import _compat, fp8 as fp8_lib, mx as mx_lib, reference, testing

from support import check_codes, f64, fp8_grid

FORMATS = ["mxfp8", "mxfp4"]
ELEM = {"mxfp8": ("float8_e4m3fn", 448.0), "mxfp4": ("float4_e2m1fn", 6.0)}


# ------------------------------------------------------------------------------------------------
# Independent float64 oracle (nothing of k3pallas)
# ------------------------------------------------------------------------------------------------


def mx_oracle(y, fmt):
    """float64 MX of ``y [..., N]``: (scale exponent ``[..., N/32]`` float, NaN for a block with
    NaN / inf; ``v [..., N]``, the exact ``y / scale`` the codes should round to).
    ``scale = 2**ceil(log2(amax / elem_max))``, at least ``2**-127``."""
    y = f64(y)
    elem_max = ELEM[fmt][1]
    blocks = y.reshape(y.shape[:-1] + (-1, 32))
    with np.errstate(invalid="ignore", divide="ignore"):
        amax = np.max(np.abs(blocks), axis=-1)
        e = np.ceil(np.log2(amax / elem_max))
    e = np.where(amax == 0, -127.0, np.maximum(e, -127.0))
    e = np.where(np.isfinite(blocks).all(axis=-1), e, np.nan)
    with np.errstate(invalid="ignore"):
        v = blocks / np.exp2(e)[..., None]
    return e, v.reshape(y.shape)


def scale_exponents(scale):
    """e8m0 scales -> their exponents (code - 127), NaN for code 255."""
    code = np.asarray(jax.lax.bitcast_convert_type(scale, jnp.uint8)).astype(np.float64)
    return np.where(code == 255, np.nan, code - 127)


def check_mx(qa, y64, fmt, what=""):
    """Scales equal the oracle's except where float32 rounding of ``y`` moved amax across a
    power of two (then the block's amax / elem_max is within 1e-5 of one); codes the RNE of the
    exact ``y / scale`` except within 1e-5 of a tie."""
    e_want, _ = mx_oracle(y64, fmt)
    e_got = scale_exponents(qa.scale).reshape(e_want.shape)
    assert np.array_equal(np.isnan(e_got), np.isnan(e_want)), f"{what}: NaN scales differ"
    diff = (e_got != e_want) & ~np.isnan(e_want)
    if diff.any():
        blocks = f64(y64).reshape(e_want.shape + (32,))
        q = np.max(np.abs(blocks), axis=-1)[diff] / ELEM[fmt][1]
        near = np.abs(np.log2(q) - np.round(np.log2(q))) < 1e-5
        assert near.all() and np.all(np.abs(e_got[diff] - e_want[diff]) == 1), (
            f"{what}: {int(diff.sum())} scales differ away from a power of two")
    blocks = f64(y64).reshape(e_got.shape + (32,))
    with np.errstate(invalid="ignore"):
        v = (blocks / np.exp2(e_got)[..., None]).reshape(np.shape(y64))
    data = f64(np.asarray(qa.data.astype(jnp.float32))).reshape(np.shape(y64))
    finite = ~np.isnan(np.repeat(e_got, 32, axis=-1).reshape(np.shape(y64)))
    check_codes(data[finite], v[finite], ELEM[fmt][0], what=what)


def codes_bytes(a):
    """Element codes as bytes (fp4: one code per byte, as numpy holds them)."""
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype != jnp.float4_e2m1fn
                      else jax.lax.bitcast_convert_type(
                          a.reshape(a.shape[:-1] + (-1, 2)), jnp.uint8))


def jax_quantize(y, fmt):
    """jax's own MX quantization (what jax.nn.scaled_dot_general does to its operands)."""
    return _compat.jax_mx_quantize(jnp.asarray(y), mx_lib.mx_format(fmt).dtype)


def rand(rng, shape, dtype=jnp.bfloat16, spread=8):
    """Normal values with per-row magnitudes over 2**-spread .. 2**spread."""
    x = rng.standard_normal(shape)
    if spread:
        x = x * np.exp2(rng.integers(-spread, spread + 1, shape[:-1] + (1,)))
    return jnp.asarray(x, dtype)


# ------------------------------------------------------------------------------------------------
# Conversions
# ------------------------------------------------------------------------------------------------


def e2m1_inputs():
    """Every float32 whose low 16 bits are one of 8 edge patterns: all 65536 high halves (sign,
    exponent, the top 7 mantissa bits), so every rounding class of e2m1 (kept bit, round bit,
    sticky bits) at every exponent, within the encoder's domain |v| <= 6."""
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lo = np.array([0, 1, 2, 0x7FFF, 0x8000, 0x8001, 0xFFFE, 0xFFFF], np.uint32)
    v = (hi[:, None] | lo[None, :]).ravel().view(np.float32)
    return v[np.abs(v) <= 6]  # NaN is left out by the comparison


def test_e2m1_encoder_bit_exact_against_ml_dtypes():
    v = e2m1_inputs()
    got = np.asarray(jax.jit(lambda a: fp8_lib.encode_fp8(a, jnp.float4_e2m1fn))(v))
    want = v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    bad = np.nonzero(got != want)[0]
    assert v.size > 250_000 and bad.size == 0, [(float(v[i]), got[i], want[i]) for i in bad[:8]]


def test_e2m1_encoder_nan_is_xla_s_code():
    """e2m1 has no NaN. XLA converts every NaN to 0x8 (-0); ml_dtypes gives 0x8 for +NaN and 0x0
    for -NaN. The encoder gives 0x8 (the kernels never feed it NaN: a block with NaN has the NaN
    scale)."""
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], np.uint32).view(np.float32)
    got = np.asarray(fp8_lib.encode_fp8(jnp.asarray(nans), jnp.float4_e2m1fn))
    xla = np.asarray(jax.jit(lambda a: a.astype(jnp.float4_e2m1fn))(nans)).view(np.uint8)
    assert (got == 0x8).all() and (xla == 0x8).all()


def test_every_e2m1_code_round_trips():
    vals = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert np.array_equal(np.asarray(fp8_lib.encode_fp8(jnp.asarray(vals), jnp.float4_e2m1fn)),
                          np.arange(16))


def ieee_rule(amax, elem_max):
    """jax's e8m0 rounding up of ``amax / elem_max``, on the host with IEEE float32 (numpy)."""
    q = (amax.astype(np.float32) / np.float32(elem_max)).astype(np.float32)
    b = q.view(np.uint32)
    e, m = b >> 23, b & 0x7FFFFF
    up = (m > 0) & (e != 0xFE) & ~((e == 0) & (m <= 0x400000))
    return (e + up).astype(np.int32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_scale_code_equals_jax_rule_exhaustively_by_exponent(rng, fmt):
    """Every exponent with every mantissa within 4096 of the boundaries that decide the rule
    (0, elem_max's mantissa, 0x400000, 0x7FFFFF), and random finite values: the integer rule
    equals jax's rounding up of the IEEE quotient."""
    fmt_ = mx_lib.mx_format(fmt)
    m_m = fmt_.threshold_bits[1]
    around = np.concatenate([np.arange(4096), 0x7FFFFF - np.arange(4096),
                             m_m + np.arange(-4096, 4096), 0x400000 + np.arange(-4096, 4096)])
    mants = np.unique(around.astype(np.int64) & 0x7FFFFF).astype(np.uint32)
    bits = ((np.arange(255, dtype=np.uint32)[:, None] << 23) | mants[None, :]).ravel()
    bits = np.concatenate([bits, rng.integers(0, 0x7F800000, 1_000_000, dtype=np.uint32)])
    amax = bits.view(np.float32)
    got = np.asarray(jax.jit(lambda a: mx_lib.scale_code(a, fmt_))(jnp.asarray(amax)))
    want = ieee_rule(amax, fmt_.elem_max)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(hex(int(bits[i])), int(got[i]), int(want[i])) for i in bad[:8]]


def test_ieee_where_xla_cpu_flushes():
    """Why the kernels and the reference do not divide as jax's own quantize does: XLA's CPU
    flushes subnormals. A block of amax 1.5 * 6 * 2**-127 (quotient 1.5 * 2**-127): IEEE says
    code 1 (2**-126), jax's CPU result may say 0; a zero block: zero codes, where jax's CPU
    division by the subnormal 2**-127 gives NaN. Ours are the IEEE results everywhere."""
    y = np.zeros((2, 32), np.float32)
    y[0, 0] = 6 * 1.5 * 2.0**-127
    assert ieee_rule(np.array([y[0, 0]]), 6.0)[0] == 1
    for impl in ("interpret", "reference"):
        qa = kp.quantize_activation(jnp.asarray(y), out_format="mxfp4", impl=impl)
        assert list(codes_bytes(qa.scale)[:, 0]) == [1, 0]
        assert (np.asarray(qa.data.astype(jnp.float32))[1] == 0).all()
        assert np.asarray(qa.data.astype(jnp.float32))[0, 0] == 6 * 0.75 - 0.5  # 4.5 -> RNE 4


def test_scale_code_of_exact_powers_equals_ml_dtypes():
    """Where the rounding-up rule has nothing to round (amax / elem_max an exact power of two),
    the code is ml_dtypes' own float8_e8m0fnu conversion of that power, at every exponent that
    float32 amax can reach."""
    for fmt in FORMATS:
        f = mx_lib.mx_format(fmt)
        k = np.arange(-127, 128)
        amax = (f.elem_max * np.exp2(k.astype(np.float64)))
        ok = amax < np.finfo(np.float32).max
        got = np.asarray(mx_lib.scale_code(jnp.asarray(amax[ok].astype(np.float32)), f))
        want = np.exp2(k[ok].astype(np.float64)).astype(np.float32).astype(
            ml_dtypes.float8_e8m0fnu).view(np.uint8)
        assert ok.sum() > 240 and np.array_equal(got, want), fmt


def test_inverse_scale_is_exact():
    code = jnp.arange(256, dtype=jnp.int32)
    inv = np.asarray(mx_lib.inv_scale(code))
    dec = np.where(np.arange(256) == 255, np.nan, np.exp2(np.arange(256) - 127.0)).astype(np.float32)
    assert np.array_equal(inv[:254] * dec[:254], np.ones(254, np.float32))  # 254: unreachable
    assert np.isnan(inv[255]) and np.isnan(dec[255])
    e8 = np.asarray(mx_lib.as_e8m0(code)).astype(np.float32)  # ml_dtypes on the host
    assert np.array_equal(e8[:255], dec[:255])


def test_fp4_packing_is_the_nibble_order_jax_reads():
    """Element 2j in the low nibble: jax's bitcast of a byte to float4_e2m1fn gives [low, high]."""
    packed = jnp.array([[0x21, 0xF7]], jnp.uint8)
    vals = np.asarray(mx_lib.unpack_fp4(packed, 4).astype(jnp.float32))
    assert np.array_equal(vals, [[0.5, 1.0, 6.0, -6.0]])


# ------------------------------------------------------------------------------------------------
# The ops
# ------------------------------------------------------------------------------------------------


def _gated64(x, w, g, eps):
    x, w, g = f64(x), f64(w), f64(g)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w
    return y / (1 + np.exp(-g))


def _norm64(x, w, eps):
    x = f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * f64(w)


def op_cases(rng):
    """(name, call(impl, fmt), float64 y of the quantized output, float32 y (the reference's
    own))."""
    T = 5
    x, g, w = rand(rng, (T, 12, 128)), rand(rng, (T, 12, 128), spread=2), rand(rng, (128,), jnp.float32, 0)
    a, b = rand(rng, (T, 1536)), rand(rng, (T, 1536), spread=2)
    q, kv = rand(rng, (T, 1536)), rand(rng, (T, 512))
    wq, wkv = rand(rng, (1536,), jnp.float32, 0), rand(rng, (512,), jnp.float32, 0)
    packed = rand(rng, (T, 1536 + 512 + 64))
    y_gated = _gated64(x, w, g, 1e-5).reshape(T, -1)
    return [
        ("quantize_activation", lambda impl, fmt: (kp.quantize_activation(a, out_format=fmt, impl=impl),),
         f64(a), a.astype(jnp.float32)),
        ("sigmoid_mul_quant", lambda impl, fmt: (kp.sigmoid_mul_quant(a, b, out_format=fmt, impl=impl),),
         f64(a) / (1 + np.exp(-f64(b))),
         a.astype(jnp.float32) * jax.nn.sigmoid(b.astype(jnp.float32))),
        ("rmsnorm_gated_quant", lambda impl, fmt: (kp.rmsnorm_gated_quant(x, w, g, out_format=fmt, impl=impl),),
         y_gated, reference._gated_f32(x, w, g, 1e-5, "sigmoid").reshape(T, -1)),
        ("fused_q_kv_rmsnorm_quant",
         lambda impl, fmt: kp.fused_q_kv_rmsnorm_quant(q, kv, wq, wkv, out_format=fmt, impl=impl),
         _norm64(q, wq, 1e-6), reference._rmsnorm_f32(q, wq, 1e-6)),
        ("mla_q_kv_norm_quant",
         lambda impl, fmt: kp.mla_q_kv_norm_quant(packed, wq, wkv, out_format=fmt, impl=impl),
         _norm64(packed[:, :1536], wq, 1e-6),
         reference._rmsnorm_f32(packed[:, :1536], wq, 1e-6)),
    ]


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_ops_against_the_float64_oracle(rng, impl, fmt):
    """Every MX op, NaN-poisoned outputs (an unwritten scale reads NaN, an unwritten code 0xFF
    or a NaN code), against the float64 oracle; the joint norms' kv and k_pe as the plain op."""
    for name, fn, y64, _ in op_cases(rng):
        with testing.poisoned_outputs():
            out = fn(impl, fmt)
        qa = out[0]
        assert qa.format == fmt and qa.scale.dtype == jnp.float8_e8m0fnu, name
        assert qa.scale.shape == qa.data.shape[:-1] + (qa.data.shape[-1] // 32,), name
        check_mx(qa, y64, fmt, what=f"{name} {impl} {fmt}")
        if name == "fused_q_kv_rmsnorm_quant":
            assert out[1].dtype == jnp.bfloat16 and out[1].shape == (5, 512)
        if name == "mla_q_kv_norm_quant":
            assert out[1].shape == (5, 512) and out[2].shape == (5, 64)


@pytest.mark.parametrize("fmt", FORMATS)
def test_codes_equal_jax_s_own_quantization(rng, fmt):
    """The standalone quant, kernel and reference: bytes equal to jax's own MX quantization of
    the same values, data and scales. The fused ops' references: equal to jax's quantization of
    their float32 ``y``. Their kernels compute a float32 ``y`` that differs from the reference's
    by rounding (their own sum order; the sigmoid as rsqrt / exp2), so a code may be one step
    away where ``y`` sits on a rounding tie: the kernels equal the reference's quantization of
    its ``y`` up to that."""
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        x = rand(rng, (9, 2048), dtype, spread=6 if dtype == jnp.float16 else 20)  # finite
        want_d, want_s = jax_quantize(x.astype(jnp.float32), fmt)
        for impl in ("interpret", "reference"):
            qa = kp.quantize_activation(x, out_format=fmt, impl=impl)
            assert np.array_equal(codes_bytes(qa.data), codes_bytes(want_d)), (fmt, dtype, impl)
            assert np.array_equal(codes_bytes(qa.scale), codes_bytes(want_s)), (fmt, dtype, impl)
    for name, fn, _, y32 in op_cases(rng):
        ref, ker = fn("reference", fmt)[0], fn("interpret", fmt)[0]
        d, s = jax_quantize(y32, fmt)
        assert np.array_equal(codes_bytes(ref.data), codes_bytes(d)), name
        assert np.array_equal(codes_bytes(ref.scale), codes_bytes(s)), name
        check_mx(ker, f64(y32), fmt, what=f"{name} kernel against the reference's y")


@pytest.mark.parametrize("fmt", FORMATS)
def test_nonfinite_blocks_and_range_ends(fmt):
    """A block with NaN or inf: NaN scale (code 255), MXFP8 NaN codes, no other block changes.
    A zero block: code 0 (2**-127), zero codes. Tiny and huge finite blocks stay exact."""
    y = np.ones((4, 128), np.float32)
    y[0, 3] = np.nan
    y[1, 40] = np.inf
    y[2, 64:96] = 0.0
    y[3, :32] = 1e-40  # a subnormal block
    y[3, 32:64] = 3e38
    for impl in ("interpret", "reference"):
        with testing.poisoned_outputs():
            qa = kp.quantize_activation(jnp.asarray(y), out_format=fmt, impl=impl)
        code = np.asarray(jax.lax.bitcast_convert_type(qa.scale, jnp.uint8))
        assert code[0, 0] == code[1, 1] == 255 and (np.delete(code.ravel(), [0, 5]) != 255).all()
        assert code[2, 2] == 0 and (np.asarray(qa.data.astype(jnp.float32))[2, 64:96] == 0).all()
        d = np.asarray(qa.dequantize())
        assert np.isnan(d[0, :32]).all() and np.isnan(d[1, 32:64]).all()
        assert np.all(d[0, 32:] == 1) and np.all(d[1, :32] == 1) and np.all(d[1, 64:] == 1)
        if fmt == "mxfp8":
            assert np.isnan(np.asarray(qa.data.astype(jnp.float32))[0, :32]).all()
        want = mx_oracle(y[3:], fmt)[0]
        assert np.array_equal(scale_exponents(qa.scale)[3:], want), (impl, fmt)


def test_dequantize_every_format(rng):
    x = rand(rng, (3, 4, 256), jnp.float32)
    for fmt, tol in (("fp8_per_token", 2**-4), ("mxfp8", 2**-4), ("mxfp4", 0.25)):
        qa = kp.quantize_activation(x, out_format=fmt, impl="reference")
        assert qa.format == fmt
        d, ref = np.asarray(qa.dequantize()), np.asarray(x)
        blocks = np.abs(ref).reshape(3, 4, -1, 32).max(-1).repeat(32, -1).reshape(ref.shape)
        assert np.all(np.abs(d - ref) <= tol * blocks + 1e-30), fmt


# ------------------------------------------------------------------------------------------------
# The consumer
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_mx_linear_reference_sums(rng, fmt):
    """``mx_linear`` (the reference path here: scaled_matmul has no CPU lowering) equals a
    float64 sum of the dequantized operands; the weight's codes are jax's quantization of its
    columns along K."""
    x = rand(rng, (6, 256), spread=2)
    w = jnp.asarray(rng.standard_normal((256, 48)) * 0.05, jnp.float32)
    qa = kp.quantize_activation(x, out_format=fmt, impl="interpret")
    qw = kp.quantize_weight_mx(w, out_format=fmt)
    assert qw.layout == "nk" and qw.data.shape == (48, 256) and qw.scale.shape == (48, 8)
    d, s = jax_quantize(w.T, fmt)
    assert np.array_equal(codes_bytes(qw.data), codes_bytes(d))
    assert np.array_equal(codes_bytes(qw.scale), codes_bytes(s))
    out = np.asarray(kp.mx_linear(qa, qw, out_dtype=jnp.float32))
    want = f64(qa.dequantize()) @ f64(qw.dequantize())
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    ref = np.asarray(x.astype(jnp.float32) @ w)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < (0.06 if fmt == "mxfp8" else 0.25), err


def test_mx_linear_errors():
    x = jnp.ones((2, 64), jnp.float32)
    w = jnp.ones((64, 8), jnp.float32)
    q4, w4 = kp.quantize_activation(x, out_format="mxfp4"), kp.quantize_weight_mx(w)
    w8 = kp.quantize_weight_mx(w, out_format="mxfp8")
    with pytest.raises(TypeError, match="same MX element format"):
        kp.mx_linear(q4, w8)
    with pytest.raises(TypeError, match="fp8_linear"):
        kp.mx_linear(kp.per_token_fp8_quant(x), w4)
    with pytest.raises(ValueError, match="K"):
        kp.mx_linear(kp.quantize_activation(jnp.ones((2, 32)), out_format="mxfp4"), w4)
    with pytest.raises(ValueError, match="multiple of 32"):
        kp.quantize_weight_mx(jnp.ones((48, 8)))
    with pytest.raises(ValueError, match="out_format must be one of"):
        kp.quantize_weight_mx(w, out_format="fp8_per_token")
    with pytest.raises(ValueError, match="impl must be"):
        kp.mx_linear(q4, w4, impl="pallas")
    with pytest.raises(TypeError, match="out_dtype"):
        kp.mx_linear(q4, w4, out_dtype=jnp.int8)
    with pytest.raises(TypeError, match="use mx_linear"):
        kp.fp8_linear(kp.quantize_activation(x, out_format="mxfp8"),
                      kp.quantize_weight_per_channel(w, fp8_dtype=jnp.float8_e4m3fn))


# ------------------------------------------------------------------------------------------------
# Options and errors
# ------------------------------------------------------------------------------------------------


def test_per_token_default_and_old_names_unchanged(rng):
    x = rand(rng, (4, 256))
    a = kp.quantize_activation(x, impl="interpret")
    b = kp.per_token_fp8_quant(x, impl="interpret")
    assert a.format == "fp8_per_token" and np.array_equal(codes_bytes(a.data), codes_bytes(b.data))
    assert np.array_equal(np.asarray(a.scale), np.asarray(b.scale))


def test_errors_name_the_argument():
    x = jnp.ones((2, 4, 48), jnp.bfloat16)
    with pytest.raises(ValueError, match="out_format must be one of"):
        kp.quantize_activation(x, out_format="mxfp6")
    with pytest.raises(ValueError, match="fp8_max apply to out_format='fp8_per_token' only"):
        kp.quantize_activation(x.reshape(2, -1), out_format="mxfp8", fp8_max=240.0)
    with pytest.raises(ValueError, match="scale_groups"):
        kp.sigmoid_mul_quant(x, x, out_format="mxfp4", scale_groups=2)
    with pytest.raises(ValueError, match="head dim.*multiple of 32"):
        kp.rmsnorm_gated_quant(x, jnp.ones(48), x, out_format="mxfp4")
    with pytest.raises(ValueError, match="multiple of 32"):
        kp.quantize_activation(jnp.ones((2, 40)), out_format="mxfp8")
    with pytest.raises(ValueError, match="q_size"):
        kp.mla_q_kv_norm_quant(jnp.ones((2, 100)), jnp.ones(40), jnp.ones(60), q_size=40,
                               kv_size=60, out_format="mxfp4")


def test_native_fp4_is_refused_and_auto_uses_the_encoder():
    """No native FP4 conversion is used: fp8_cast='native' raises for MXFP4 on any GPU target;
    "auto" takes the encoder (decisions say why)."""
    from k3pallas.kernels import fp8_cast
    from k3pallas import platform

    for kind in ("NVIDIA H200", "MI350X"):
        target = platform.target_for(kind, "gpu")
        assert "float4" in fp8_cast.native_unavailable(target, jnp.float4_e2m1fn)
        with pytest.raises(RuntimeError, match="float4"):
            fp8_cast.decide(jnp.float4_e2m1fn, "native", target=target)
        assert not fp8_cast.decide(jnp.float4_e2m1fn, "auto", target=target).native


@pytest.mark.parametrize("kind", ["NVIDIA H200", "MI300X", "MI350X"])
def test_mx_ops_lower_in_one_launch(kind):
    """Deviceless: each MX op at the Kimi-K3 shapes is ONE Triton launch, within 1024 threads."""
    S = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    cases = [
        (lambda x, w, g: kp.rmsnorm_gated_quant(x, w, g, out_format="mxfp4"), (S(64, 96, 128), S(128), S(64, 96, 128))),
        (lambda x: kp.quantize_activation(x, out_format="mxfp8"), (S(8, 1536),)),
        (lambda x, g: kp.sigmoid_mul_quant(x, g, out_format="mxfp4"), (S(64, 12288), S(64, 12288))),
        (lambda q, kv, wq, wkv: kp.fused_q_kv_rmsnorm_quant(q, kv, wq, wkv, out_format="mxfp8"),
         (S(16, 1536), S(16, 512), S(1536), S(512))),
        (lambda a, wq, wkv: kp.mla_q_kv_norm_quant(a, wq, wkv, out_format="mxfp4"), (S(64, 2112), S(1536), S(512))),
    ]
    for fn, args in cases:
        launches = testing.triton_launches(testing.lower_for(fn, args, kind).as_text())
        assert len(launches) == 1 and "_mx" in launches[0]["name"], launches
        warp = 32 if kind.startswith("NVIDIA") else 64
        assert launches[0]["num_warps"] * warp <= 1024, launches


# ------------------------------------------------------------------------------------------------
# Compiled on a GPU (marked ``gpu``: skipped without one)
# ------------------------------------------------------------------------------------------------


def _mx_pair_close(a, b, what):
    """Two MX results of the same op from float32 ``y`` computed two ways (the compiled kernel's
    sigmoid / sum order vs XLA's): scale codes equal but for < 0.1 % one step apart (amax across
    a power of two), codes equal but for < 0.5 % one step apart (rounding ties)."""
    sa, sb = codes_bytes(a.scale).astype(int), codes_bytes(b.scale).astype(int)
    ds = sa != sb
    assert ds.mean() < 1e-3 and np.all(np.abs(sa - sb)[ds] == 1), f"{what}: scales differ"
    same_blocks = np.repeat(~ds, 32, axis=-1).reshape(a.data.shape)
    va = np.asarray(a.data.astype(jnp.float32))[same_blocks]
    vb = np.asarray(b.data.astype(jnp.float32))[same_blocks]
    d = va != vb
    assert d.mean() < 5e-3, f"{what}: {d.mean():.2%} codes differ"
    grid = fp8_grid("float8_e4m3fn" if a.format == "mxfp8" else "float4_e2m1fn")
    ia, ib = np.searchsorted(grid, va[d]), np.searchsorted(grid, vb[d])
    assert np.all(np.abs(ia - ib) <= 1), f"{what}: codes more than one step apart"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("t", [1, 64, 4096])
def test_mx_ops_compiled(rng, fmt, t):
    """Compiled kernels, NaN-poisoned outputs: the standalone quant bit-exact with jax's own
    quantization; every op against the float64 oracle on its float32 inputs and against its jnp
    reference; two runs identical."""
    x = rand(rng, (t, 2048), spread=20)
    qa = jax.jit(lambda a: kp.quantize_activation(a, out_format=fmt, impl="pallas"))(x)
    d, s = jax_quantize(x.astype(jnp.float32), fmt)
    assert np.array_equal(codes_bytes(qa.data), codes_bytes(d))
    assert np.array_equal(codes_bytes(qa.scale), codes_bytes(s))
    for name, fn, y64, _ in op_cases(rng):
        with testing.poisoned_outputs():
            poisoned = jax.jit(lambda: fn("pallas", fmt))()
        out = jax.jit(lambda: fn("pallas", fmt))()
        ref = jax.jit(lambda: fn("reference", fmt))()
        assert np.array_equal(codes_bytes(out[0].data), codes_bytes(poisoned[0].data)), name
        assert np.array_equal(codes_bytes(out[0].scale), codes_bytes(poisoned[0].scale)), name
        check_mx(out[0], y64, fmt, what=f"{name} compiled {fmt}")
        _mx_pair_close(out[0], ref[0], f"{name} compiled vs reference")


@pytest.mark.gpu
def test_scaled_matmul_on_our_mxfp4_equals_it_on_jax_s_quantization(rng):
    """``jax.nn.scaled_matmul`` (``mx_linear``) on our compiled MXFP4 output equals it on jax's
    own quantization of the same float32 values (the gated op: jax quantizes the reference's
    float32 y; our codes from the compiled kernel may differ at ties, so the standalone quant of
    that y is the exact check, the gated op the close one)."""
    w = jnp.asarray(rng.standard_normal((1536, 512)) * 0.03, jnp.bfloat16)
    qw = kp.quantize_weight_mx(w, out_format="mxfp4")
    y = rand(rng, (64, 1536), jnp.float32, spread=4)
    ours = kp.quantize_activation(y, out_format="mxfp4", impl="pallas")
    theirs = kp.QuantizedActivation(*jax_quantize(y, "mxfp4"))
    mm = jax.jit(lambda qa: kp.mx_linear(qa, qw, out_dtype=jnp.float32, impl="scaled_matmul"))
    a, b = np.asarray(mm(ours)), np.asarray(mm(theirs))
    assert np.array_equal(a, b)
    ref = f64(theirs.dequantize()) @ f64(qw.dequantize())
    np.testing.assert_allclose(a, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
