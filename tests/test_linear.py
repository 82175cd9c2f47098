"""``quantize_weight`` and ``linear`` (every format) against float64 oracles, and the Kimi-K3
model blocks under ``jax.jit`` on the CPU."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp
from k3pallas import _compat, formats, platform
from k3pallas.models import kimi_k3

from support import DEFAULT_FP8_MAX, FP8, check_codes, codes_bytes, f64

FP8_NAMES = list(FP8)


@pytest.mark.parametrize("name", FP8_NAMES)
def test_quantize_weight_per_channel(rng, name):
    k, n = 300, 70
    w = rng.standard_normal((k, n)) * rng.uniform(1e-3, 1e2, n)
    w[:, 3] = 0.0  # a zero column
    w = jnp.asarray(w, "bfloat16" if name == "float8_e5m2" else "float32")
    qw = jax.jit(lambda a: kp.quantize_weight(a, kp.Fp8PerToken(name), layout="kn"))(w)
    assert qw.data.shape == (k, n) and qw.data.dtype == jnp.dtype(name) and qw.layout == "kn"
    assert qw.scale.shape == (n,) and qw.scale.dtype == jnp.float32
    w64 = f64(w)
    fp8_max = DEFAULT_FP8_MAX[name]
    amax = np.abs(w64).max(axis=0)
    np.testing.assert_allclose(f64(qw.scale), np.where(amax > 0, amax / fp8_max, 1.0), rtol=1e-6)
    assert f64(qw.scale)[3] == 1.0 and np.all(f64(qw.data)[:, 3] == 0)
    check_codes(qw.data, w64 / f64(qw.scale)[None, :], name, what="weight codes")
    assert np.abs(f64(qw.data)).max() <= fp8_max


def test_quantize_weight_special_columns_and_errors(rng):
    w = rng.standard_normal((16, 4))
    w[5, 2] = np.nan
    qw = kp.quantize_weight(jnp.asarray(w, jnp.float32), kp.Fp8PerToken("float8_e4m3fnuz", 240.0))
    assert np.isnan(f64(qw.scale)[2]) and not np.isnan(f64(qw.scale)[[0, 1, 3]]).any()
    np.testing.assert_allclose(f64(qw.scale)[0], np.abs(w[:, 0]).max() / 240.0, rtol=1e-6)
    w = jnp.ones((4, 3)).at[1, 2].set(jnp.inf)  # no FP8 form: scale inf, codes 0 and NaN
    qw = kp.quantize_weight(w, kp.Fp8PerToken("float8_e4m3fn"), layout="kn")
    assert np.isinf(np.asarray(qw.scale)[2]) and np.isfinite(np.asarray(qw.scale)[:2]).all()
    codes = np.asarray(qw.data, np.float32)[:, 2]
    assert np.isnan(codes[1]) and (codes[[0, 2, 3]] == 0).all()
    for bad, err, match in [(jnp.zeros((4,)), ValueError, r"\[K, N\] matrix"),
                            (jnp.zeros((4, 4), jnp.int32), TypeError, "float16, bfloat16 or float32"),
                            ("w", TypeError, "must be an array")]:
        with pytest.raises(err, match=f"quantize_weight: .*{match}"):
            kp.quantize_weight(bad, "fp8_per_token")
    w = jnp.ones((48, 8))
    with pytest.raises(ValueError, match=r"quantize_weight: mxfp4 .*\(48\) must be a multiple of 32"):
        kp.quantize_weight(w, "mxfp4")
    # An activation format's own fields (min_scale, scale_ub, groups) do not apply to a weight.
    assert kp.quantize_weight(w, kp.Fp8PerToken(scale_ub=1.0, groups=3)).format == \
        kp.quantize_weight(w, "fp8_per_token").format
    with pytest.raises(ValueError, match="layout must be"):
        kp.quantize_weight(w, "fp8_per_token", layout="nkk")


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_quantize_weight_mx(rng, fmt):
    w = jnp.asarray(rng.standard_normal((256, 48)) * 0.05, jnp.float32)
    for layout in ("nk", "kn"):
        qw = kp.quantize_weight(w, fmt, layout=layout)
        data, scale = (qw.data, qw.scale) if layout == "nk" else (qw.data.T, qw.scale.T)
        assert data.shape == (48, 256) and scale.shape == (48, 8)
        d, s = _compat.jax_mx_quantize(w.T, formats.as_format(fmt).dtype)  # jax's, along K
        assert np.array_equal(codes_bytes(data), codes_bytes(d))
        assert np.array_equal(codes_bytes(scale), codes_bytes(s))


def _oracle(qa, qw):
    """float64: dequantize both operands (per scale group / block), then matmul."""
    d = f64(qa.data)
    g = qa.scale.shape[-1]
    scale = f64(qa.scale.astype(jnp.float32))
    d = (d.reshape(d.shape[:-1] + (g, -1)) * scale[..., None]).reshape(d.shape)
    data, ws = (qw.data, qw.scale) if qw.layout == "nk" else (qw.data.T, (qw.scale if qw.scale.ndim < 2 else qw.scale.T))
    w = f64(data)  # [N, K]
    if qw.format.block is None:
        w = w * f64(ws).reshape(-1, 1)
    elif isinstance(qw.format, kp.Fp8Group):  # 128 x 128 blocks, a partial last one of N
        n = w.shape[0]
        w = w * np.repeat(np.repeat(f64(ws), 128, 0)[:n], 128, 1)
    else:
        w = (w.reshape(w.shape[0], -1, 32) * f64(ws.astype(jnp.float32))[..., None]).reshape(w.shape)
    return d @ w.T, np.abs(d) @ np.abs(w.T)


@pytest.mark.parametrize("fmt,groups,lead,layout", [
    ("float8_e4m3fn", 1, (5,), "nk"), ("float8_e5m2", 4, (2, 3), "kn"),
    ("float8_e4m3fnuz", 4, (5,), "nk"), ("float8_e4m3fnuz", 1, (2, 3), "kn"),
    ("mxfp8", None, (5,), "nk"), ("mxfp4", None, (2, 3), "kn")])
def test_linear_against_the_oracle(rng, fmt, groups, lead, layout):
    k, n = 256, 96
    x = jnp.asarray(rng.standard_normal(lead + (k,)) * np.repeat(rng.uniform(0.1, 10, 4), k // 4),
                    jnp.float32)
    f = fmt if groups is None else kp.Fp8PerToken(fmt, groups=groups)
    wf = kp.Fp8PerToken(fmt) if groups else fmt
    qa = kp.quantize(x, f, impl="reference")
    qw = kp.quantize_weight(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), wf, layout=layout)
    ref, mag = _oracle(qa, qw)
    out32 = jax.jit(lambda a, w: kp.linear(a, w, out_dtype=jnp.float32))(qa, qw)
    assert out32.shape == lead + (n,) and out32.dtype == jnp.float32
    assert np.all(np.abs(f64(out32) - ref) <= 1e-5 * mag + 1e-30), "f32 output vs oracle"
    out16 = kp.linear(qa, qw)
    assert out16.dtype == jnp.bfloat16
    assert np.all(np.abs(f64(out16) - ref) <= 2**-8 * np.abs(ref) + 1e-5 * mag), "bf16 vs oracle"
    np.testing.assert_allclose(np.asarray(kp.linear(qa, qw, out_dtype=jnp.float32, impl="reference")),
                               ref, rtol=1e-5, atol=1e-5 * mag.max())


def test_the_layout_travels_with_the_weight(rng):
    """A square weight: each layout gives the same product (reading one as the other would
    compute x W^T)."""
    k = 64
    w = jnp.asarray(rng.standard_normal((k, k)), jnp.float32)
    qa = kp.quantize(jnp.asarray(rng.standard_normal((5, k)), jnp.float32), "fp8_per_token",
                     impl="reference")
    want = f64(qa.dequantize()) @ f64(w)
    for layout in ("nk", "kn"):
        qw = kp.quantize_weight(w, "fp8_per_token", layout=layout)
        out = jax.jit(lambda a, q: kp.linear(a, q, out_dtype=jnp.float32))(qa, qw)
        assert np.abs(f64(out) - want).max() <= 0.05 * np.abs(want).max()
        err = np.abs(f64(qw.dequantize()) - f64(w))  # e4m3fn: half a step is 2**-4 relative
        assert np.all(err <= 2.0**-4 * np.abs(f64(w)) + 2.0**-10 * f64(qw.scale)[None, :] * 1.001)
        w8, ws = qw  # unpacks
        # A per-tensor (scalar) weight scale.
        scalar = kp.QuantizedWeight(w8, jnp.float32(0.5), "fp8_per_token", layout)
        ref, mag = _oracle(qa, scalar)
        assert np.all(np.abs(f64(kp.linear(qa, scalar, out_dtype=jnp.float32)) - ref) <= 1e-5 * mag)


def test_linear_errors(rng):
    x = jnp.ones((2, 64), jnp.float32)
    w = jnp.ones((64, 8), jnp.float32)
    q4, w4 = kp.quantize(x, "mxfp4"), kp.quantize_weight(w, "mxfp4")
    w8 = kp.quantize_weight(w, "mxfp8")
    f8, wf8 = kp.quantize(x, "fp8_per_token"), kp.quantize_weight(w, "fp8_per_token")
    bad = [
        (lambda: kp.linear(q4, w8), TypeError, "the activation is mxfp4 and the weight mxfp8"),
        (lambda: kp.linear(f8, w4), TypeError, "the activation is fp8_per_token and the weight mxfp4"),
        (lambda: kp.linear(kp.quantize(x, kp.Fp8PerToken("float8_e5m2")), wf8), TypeError,
         "the activation's elements are float8_e5m2 and the weight's float8_e4m3fn"),
        (lambda: kp.linear(kp.quantize(jnp.ones((2, 32)), "mxfp4"), w4), ValueError, "qa.data .* need the same K"),
        (lambda: kp.linear(q4, w4, impl="pallas"), ValueError, "impl must be"),
        (lambda: kp.linear(q4, w4, out_dtype=jnp.int8), TypeError, "out_dtype"),
        (lambda: kp.linear((f8.data, f8.scale), wf8), TypeError, "qa must be a QuantizedActivation"),
        (lambda: kp.linear(f8, (wf8.data, wf8.scale)), TypeError, "qw must be a QuantizedWeight"),
        (lambda: kp.linear(q4, w4, precision=jax.lax.Precision.HIGHEST), ValueError,
         "precision applies to the XLA lowerings"),
    ]
    for call, err, match in bad:
        with pytest.raises(err, match=f"linear: {match}"):
            call()
    # precision: a bad value refused naming the argument; a good one reaches dot_general.
    with pytest.raises(ValueError, match="linear: precision must be None"):
        kp.linear(f8, wf8, precision="bogus")
    np.testing.assert_array_equal(
        np.asarray(kp.linear(f8, wf8, precision=jax.lax.Precision.HIGHEST, out_dtype=jnp.float32)),
        np.asarray(kp.linear(f8, wf8, out_dtype=jnp.float32)))


SMALL = dataclasses.replace(kimi_k3.KIMI_K3, hidden=256, mla_heads=4, kda_heads=6, mlp_inter=2048)


# The kernels in interpret mode take 19 s here (3.11): the slow tier; the fast one runs every
# block's code on the reference path.
@pytest.mark.parametrize("impl", [pytest.param("interpret", marks=pytest.mark.slow), "reference"])
def test_model_blocks_small(impl):
    """Both blocks under jit at small sizes: the kernel path equals the reference path up to
    rounding, and the FP8 o_proj path is within FP8 error of the bf16 one."""
    r = kimi_k3.run(tokens=9, impl=impl, cfg=SMALL, kda_heads=(6,), log=lambda *_: None)
    mla = r["mla_front"]
    assert mla["kv_c"] < 1e-2 and mla["q"] < 1e-2 and mla["k_pe"] == 0.0
    assert 1e-3 < mla["q_fp8_vs_bf16"] < 0.06  # q quantized in the norm, FP8 q_b
    assert 1e-3 < r["mla_out_6x128"]["fp8_vs_bf16"] < 0.06  # gate + FP8 o_proj
    e = r["kda_out_6x128"]
    assert 1e-3 < e["fp8_vs_bf16"] < 0.06, e  # e4m3: ~2**-4 relative per element
    assert e["bf16_vs_f32"] < 1e-2
    assert 0.1 < e["mxfp4_vs_bf16"] < 0.25  # FP4 elements: ~17 %, not a broken path
    assert 1e-3 < e["group_vs_f32"] < 0.06 and 1e-3 < mla["q_group_vs_bf16"] < 0.06  # group FP8
    assert 1e-3 < r["mla_out_6x128"]["group_vs_bf16"] < 0.06
    d = r["decoder_attention_in"]  # the residual add + input norm, then the front-end
    assert d["q"] < 1e-2 and d["residual"] == 0.0
    m = r["mlp_in_group_tp8"]  # add + norm + group FP8, block-FP8 gate / up, SiLU-and-mul
    assert m["act_vs_bf16"] < 0.1 and m["residual"] == 0.0  # 0 with impl="reference": both bf16


@pytest.mark.slow
def test_model_blocks_kimi_k3_sizes():
    """Kimi-K3 sizes (hidden 7168, 2112-wide packed projection, KDA 12 x 128 and 96 x 128), the
    kernels in interpret mode, two tokens."""
    r = kimi_k3.run(tokens=2, impl="interpret", log=lambda *_: None)
    assert r["mla_front"]["q"] < 1e-2 and r["mla_front"]["q_fp8_vs_bf16"] < 0.06
    for key in ("kda_out_12x128", "kda_out_96x128", "mla_out_12x128", "mla_out_96x128"):
        assert r[key]["fp8_vs_bf16"] < 0.06
        assert 0.1 < r[key]["mxfp4_vs_bf16"] < 0.25  # FP4 elements: ~17 %, not a broken path


# ------------------------------------------------------------------------------------------------
# Group FP8: 128 x 128 block weights, checkpoints as stored, the XLA lowerings
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["fp8_group128", "fp8_group128_ue8m0"])
def test_quantize_weight_blocks(rng, fmt):
    """Each 128 x 128 block of ``w.T`` by the activations' rule (the float64 group oracle on the
    block's values: scale and every code exact); N = 200: a partial last block of 72 rows."""
    from support import fp8_grid, group_oracle, rne_to_grid

    k, n = 384, 200
    w = rng.standard_normal((k, n)) * np.exp2(rng.integers(-6, 6, (k // 128, 1)).repeat(128, 0))
    w[:128, 128:] = 0.0  # a zero block
    w = jnp.asarray(w, jnp.float32)
    for layout in ("nk", "kn"):
        qw = jax.jit(lambda a: kp.quantize_weight(a, fmt, layout=layout))(w)
        data, scale = (qw.data, qw.scale) if layout == "nk" else (qw.data.T, qw.scale.T)
        assert data.shape == (n, k) and scale.shape == (2, 3) and scale.dtype == jnp.float32
        f = qw.format
        wt = f64(w).T
        for i in range(2):
            for j in range(3):
                block = wt[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
                amax = np.full((1, 128), np.abs(block).max())  # the block's scale: one group's
                s64, _ = group_oracle(amax, jnp.dtype(f.dtype).name, f.fp8_max, f.eps, f.ue8m0)
                assert f64(scale)[i, j] == s64[0, 0], (layout, i, j)
                want = rne_to_grid(block / s64[0, 0], fp8_grid(jnp.dtype(f.dtype).name))
                assert np.array_equal(f64(data)[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)], want)
        assert (f64(data)[128:, :128] == 0).all()
        np.testing.assert_allclose(np.asarray(qw.dequantize()).T, f64(data) * np.repeat(
            np.repeat(f64(scale), 128, 0)[:n], 128, 1), rtol=2**-24)  # one float32 rounding


@pytest.mark.parametrize("impl", ["auto", "per_group", "dequantize", "scaled_dot", "reference"])
@pytest.mark.parametrize("fmt", ["fp8_group128", "fp8_group128_ue8m0"])
def test_group_linear_against_the_oracle(rng, impl, fmt):
    """Every lowering against the float64 blockwise-dequantized product. ``per_group`` and the
    reference compute the float32 sums of exact products (1e-5 of the magnitudes);
    ``dequantize`` and ``scaled_dot`` round the dequantized operands (``scaled_dot`` also the
    scales) to bfloat16: within 2**-7 of the magnitudes, exact for UE8M0 operands' values."""
    k, n = 512, 200
    x = jnp.asarray(rng.standard_normal((2, 3, k)) * np.repeat(rng.uniform(0.1, 10, 4), 128), jnp.bfloat16)
    qa = kp.quantize(x, fmt, impl="interpret")
    qw = kp.quantize_weight(jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.float32), fmt,
                            layout="kn" if impl == "scaled_dot" else "nk")
    ref, mag = _oracle(qa, qw)
    out = jax.jit(lambda a, w: kp.linear(a, w, out_dtype=jnp.float32, impl=impl))(qa, qw)
    assert out.shape == (2, 3, n) and out.dtype == jnp.float32
    exact_sums = impl in ("auto", "per_group", "reference") or fmt.endswith("ue8m0")
    tol = 1e-5 if exact_sums else 2**-7
    assert np.all(np.abs(f64(out) - ref) <= tol * mag + 1e-30), impl


def test_group_linear_auto_by_rows(rng):
    """"auto": ``per_group`` up to ``PER_GROUP_MAX_ROWS`` rows (a batched dot_general, its result
    ``[K/128, T, N]``), ``dequantize`` beyond (one ``[T, N]`` dot_general)."""
    import importlib

    most = importlib.import_module("k3pallas.linear").PER_GROUP_MAX_ROWS
    qw = kp.quantize_weight(jnp.ones((256, 64)), "fp8_group128")
    for rows, result in ((most, f"f32[2,{most},64] = dot_general"), (most + 1, f"f32[{most + 1},64] = dot_general")):
        qa = kp.quantize(jnp.ones((rows, 256)), "fp8_group128", impl="reference")
        assert result in str(jax.make_jaxpr(lambda a, w: kp.linear(a, w))(qa, qw)), rows


def test_weight_from_checkpoint(rng):
    """A DeepSeek-V3-style block-FP8 weight as stored: ``weight [N, K]`` e4m3fn, scales
    ``[ceil(N/128), K/128]`` (N = 576: 4.5 blocks, as kv_a_proj_with_mqa); as e4m3fn it is read
    as is; where the activations are e4m3fnuz (gfx94x) it is converted as vLLM does (same bits,
    0x80 -> 0, scales doubled) and dequantizes to the same values (0x80, -0, to +0)."""
    n, k = 576, 256
    codes = rng.integers(0, 256, (n, k)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x00  # no e4m3fn NaN in a checkpoint
    codes[3, :5] = 0x80
    weight = jax.lax.bitcast_convert_type(jnp.asarray(codes), jnp.float8_e4m3fn)
    scale = jnp.asarray(rng.uniform(1e-4, 1e-2, (5, 2)), jnp.float32)
    qw = kp.weight_from_checkpoint(weight, scale)
    assert qw.layout == "nk" and qw.data is weight and qw.shape == (k, n)
    want = f64(weight) * np.repeat(np.repeat(f64(scale), 128, 0)[:n], 128, 1)
    np.testing.assert_allclose(f64(qw.dequantize()).T, want, rtol=2**-24)
    fnuz = kp.weight_from_checkpoint(weight, scale, out_format=kp.Fp8Group(jnp.float8_e4m3fnuz))
    assert fnuz.data.dtype == jnp.float8_e4m3fnuz and fnuz.format.fp8_max == 224.0
    bits = np.asarray(jax.lax.bitcast_convert_type(fnuz.data, jnp.uint8))
    assert (bits[3, :5] == 0).all() and np.array_equal(bits[codes != 0x80], codes[codes != 0x80])
    np.testing.assert_array_equal(f64(fnuz.scale), 2 * f64(scale))
    np.testing.assert_array_equal(f64(fnuz.dequantize()), f64(qw.dequantize()))
    with kp.compiling_for(platform.target_from_name("gfx942")):  # the device picks the conversion
        on_mi300 = kp.weight_from_checkpoint(weight, scale)
    assert on_mi300.data.dtype == jnp.float8_e4m3fnuz
    qa = kp.quantize(jnp.asarray(rng.standard_normal((3, k)), jnp.float32), "fp8_group128", impl="reference")
    np.testing.assert_allclose(np.asarray(kp.linear(qa, qw, out_dtype=jnp.float32)),
                               _oracle(qa, qw)[0], rtol=1e-4, atol=1e-4 * np.abs(_oracle(qa, qw)[1]).max())
    bad = [((weight, scale[:4]), {}, ValueError, r"must have shape \(5, 2\)"),
           ((weight[:, :200], scale), {}, ValueError, "multiple of 128"),
           ((weight.astype(jnp.float8_e5m2), scale), {}, TypeError, "only e4m3fn -> e4m3fnuz"),
           ((weight, scale.astype(jnp.bfloat16)), {}, TypeError, "scales must be float32"),
           ((weight, scale), dict(out_format="fp8_per_token"), ValueError, "must be a group format"),
           ((weight[None], scale), {}, ValueError, r"weight must be \[N, K\]"),
           (("w", scale), {}, TypeError, "weight must be an array")]
    for args, kw, err, match in bad:
        with pytest.raises(err, match=f"weight_from_checkpoint: .*{match}"):
            kp.weight_from_checkpoint(*args, **kw)


def test_group_linear_errors(rng):
    qa = kp.quantize(jnp.ones((2, 256)), "fp8_group128", impl="reference")
    qw = kp.quantize_weight(jnp.ones((256, 64)), "fp8_group128")
    mx = kp.quantize_weight(jnp.ones((256, 64)), "mxfp8")
    with pytest.raises(TypeError, match="the activation is fp8_group128 and the weight mxfp8"):
        kp.linear(qa, mx)
    with pytest.raises(ValueError, match="impl must be one of"):
        kp.linear(qa, qw, impl="cutlass")
    with pytest.raises(ValueError, match="impl must be one of"):  # group lowerings: group only
        kp.linear(kp.quantize(jnp.ones((2, 256)), "mxfp8", impl="reference"), mx, impl="per_group")
    ue = kp.quantize(jnp.ones((2, 256)), "fp8_group128_ue8m0", impl="reference")
    assert kp.linear(ue, qw).shape == (2, 64)  # either rounding of the scales reads the other
    with pytest.raises(ValueError, match=r"must be a multiple of 128"):
        kp.quantize_weight(jnp.ones((200, 64)), "fp8_group128")
