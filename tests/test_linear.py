"""``quantize_weight_per_channel`` and ``fp8_linear`` against float64 oracles, and the Kimi-K3
model blocks under ``jax.jit`` on the CPU."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp
from k3pallas.models import kimi_k3

from support import DEFAULT_FP8_MAX, FP8, check_codes, f64

FP8_NAMES = list(FP8)


@pytest.mark.parametrize("name", FP8_NAMES)
@pytest.mark.parametrize("wdtype", ["bfloat16", "float32"])
def test_quantize_weight_per_channel(rng, name, wdtype):
    k, n = 300, 70
    w = rng.standard_normal((k, n)) * rng.uniform(1e-3, 1e2, n)
    w[:, 3] = 0.0  # a zero column
    w = jnp.asarray(w, wdtype)
    w8, ws = jax.jit(lambda a: kp.quantize_weight_per_channel(a, fp8_dtype=name, w_layout="kn"))(w)
    assert w8.shape == (k, n) and w8.dtype == jnp.dtype(name)
    assert ws.shape == (n,) and ws.dtype == jnp.float32
    w64 = f64(w)
    fp8_max = DEFAULT_FP8_MAX[name]
    amax = np.abs(w64).max(axis=0)
    want = np.where(amax > 0, amax / fp8_max, 1.0)
    np.testing.assert_allclose(f64(ws), want, rtol=1e-6)
    assert f64(ws)[3] == 1.0 and np.all(f64(w8)[:, 3] == 0)
    check_codes(w8, w64 / f64(ws)[None, :], name, what="weight codes")
    assert np.abs(f64(w8)).max() <= fp8_max


def test_quantize_weight_nan_column_and_fp8_max(rng):
    w = rng.standard_normal((16, 4))
    w[5, 2] = np.nan
    w8, ws = kp.quantize_weight_per_channel(jnp.asarray(w, jnp.float32), fp8_dtype="float8_e4m3fnuz",
                                            fp8_max=240.0)
    assert np.isnan(f64(ws)[2]) and not np.isnan(f64(ws)[[0, 1, 3]]).any()
    np.testing.assert_allclose(f64(ws)[0], np.abs(w[:, 0]).max() / 240.0, rtol=1e-6)


@pytest.mark.parametrize("bad,err,match", [
    (jnp.zeros((4,)), ValueError, r"\[K, N\] matrix"),
    (jnp.zeros((4, 4), jnp.int32), TypeError, "float16, bfloat16 or float32"),
    ("w", TypeError, "must be an array"),
])
def test_quantize_weight_bad_input(bad, err, match):
    with pytest.raises(err, match=match):
        kp.quantize_weight_per_channel(bad)


def _oracle(data, scale, w8, ws):
    """float64: dequantize both operands, then matmul (per scale group)."""
    d, w = f64(data), f64(w8) * f64(ws)
    groups = scale.shape[-1]
    d = (d.reshape(*d.shape[:-1], groups, -1) * f64(scale)[..., None]).reshape(d.shape)
    return d @ w, np.abs(d) @ np.abs(w)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz"])
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("lead", [(5,), (2, 3)])
@pytest.mark.parametrize("w_layout", ["kn", "nk"])
def test_fp8_linear_against_oracle(rng, name, groups, lead, w_layout):
    k, n = 256, 96
    x = jnp.asarray(rng.standard_normal(lead + (groups, k // groups)) * rng.uniform(0.1, 10, groups)[:, None],
                    jnp.float32)
    # Per-group per-token scales from the reference quantizer (one call per group).
    parts = [kp.per_token_fp8_quant(x[..., g, :], fp8_dtype=name, impl="reference") for g in range(groups)]
    data = jnp.concatenate([p.data for p in parts], axis=-1)
    scale = jnp.concatenate([p.scale for p in parts], axis=-1)
    w8, ws = kp.quantize_weight_per_channel(jnp.asarray(rng.standard_normal((k, n)), jnp.float32),
                                            fp8_dtype=name, w_layout=w_layout)
    assert w8.shape == ((k, n) if w_layout == "kn" else (n, k))
    ref, mag = _oracle(data, scale, w8 if w_layout == "kn" else w8.T, ws)
    out32 = jax.jit(lambda a, s, w, v: kp.fp8_linear(kp.QuantizedActivation(a, s), w, v,
                                                     out_dtype=jnp.float32, w_layout=w_layout))(
        data, scale, w8, ws)
    assert out32.shape == lead + (n,) and out32.dtype == jnp.float32
    assert np.all(np.abs(f64(out32) - ref) <= 1e-5 * mag + 1e-30), "f32 output vs oracle"
    out16 = kp.fp8_linear((data, scale), w8, ws, w_layout=w_layout)  # bf16; a plain tuple works
    assert out16.dtype == jnp.bfloat16
    assert np.all(np.abs(f64(out16) - ref) <= 2**-8 * np.abs(ref) + 1e-5 * mag), "bf16 vs oracle"


def test_fp8_linear_scalar_weight_scale(rng):
    qa = kp.per_token_fp8_quant(jnp.asarray(rng.standard_normal((3, 64)), jnp.float32), impl="reference")
    w8 = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32).astype(jnp.float8_e4m3fn)
    ref, mag = _oracle(qa.data, qa.scale, w8, np.float64(0.5))
    for scalar in (jnp.float32(0.5), 0.5):  # "or a scalar": a Python float too
        out = kp.fp8_linear(qa, w8, scalar, out_dtype=jnp.float32, w_layout="kn")
        assert np.all(np.abs(f64(out) - ref) <= 1e-5 * mag)


@pytest.mark.parametrize("change,err,match", [
    (dict(data=jnp.zeros((3, 64), jnp.bfloat16)), TypeError, "qa.data must have an fp8 dtype"),
    (dict(w8=jnp.zeros((64, 8), jnp.float8_e5m2)), TypeError, "same fp8 dtype|qa.data's fp8 dtype"),
    (dict(w8=jnp.zeros((63, 8), jnp.float8_e4m3fn)), ValueError, "the same K"),
    (dict(scale=jnp.ones((3,), jnp.float32)), ValueError, "qa.scale must have shape"),
    (dict(scale=jnp.ones((3, 3), jnp.float32)), ValueError, "split K"),
    (dict(scale=jnp.ones((3, 1), jnp.bfloat16)), TypeError, "float32"),
    (dict(ws=jnp.ones((7,), jnp.float32)), ValueError, "w_scale must have shape"),
    (dict(out_dtype=jnp.int8), TypeError, "out_dtype"),
    (dict(w_layout="kn8"), ValueError, "w_layout must be"),
    (dict(w_layout="nk"), ValueError, r"w_fp8 \[N, K\]"),
])
def test_fp8_linear_bad_input(change, err, match):
    args = dict(data=jnp.zeros((3, 64), jnp.float8_e4m3fn), scale=jnp.ones((3, 1), jnp.float32),
                w8=jnp.zeros((64, 8), jnp.float8_e4m3fn), ws=jnp.ones((8,), jnp.float32),
                out_dtype=jnp.bfloat16, w_layout="kn")
    args.update(change)
    with pytest.raises(err, match=match):
        kp.fp8_linear(kp.QuantizedActivation(args["data"], args["scale"]), args["w8"], args["ws"],
                      out_dtype=args["out_dtype"], w_layout=args["w_layout"])
    with pytest.raises(TypeError, match="QuantizedActivation"):
        kp.fp8_linear(args["data"], args["w8"], args["ws"], w_layout="kn")


def test_the_layout_travels_with_the_weight(rng):
    """A square weight: the QuantizedWeight carries its layout into fp8_linear; a bare array
    must say its layout (forgetting it silently computed x W^T before)."""
    k = 64
    w = jnp.asarray(rng.standard_normal((k, k)), jnp.float32)
    qa = kp.per_token_fp8_quant(jnp.asarray(rng.standard_normal((5, k)), jnp.float32),
                                fp8_dtype="float8_e4m3fn", impl="reference")
    want = f64(qa.dequantize()) @ f64(w)
    for layout in ("nk", "kn"):
        qw = kp.quantize_weight_per_channel(w, fp8_dtype="float8_e4m3fn", **(
            {} if layout == "nk" else {"w_layout": layout}))
        assert isinstance(qw, kp.QuantizedWeight) and qw.layout == layout  # "nk" by default
        out = jax.jit(lambda a, q: kp.fp8_linear(a, q, out_dtype=jnp.float32))(qa, qw)
        assert np.abs(f64(out) - want).max() <= 0.05 * np.abs(want).max()
        # e4m3fn: half a step is 2**-4 of a normal value, 2**-10 x scale below the normals.
        err = np.abs(f64(qw.dequantize()) - f64(w))
        assert np.all(err <= 2.0**-4 * np.abs(f64(w)) + 2.0**-10 * f64(qw.scale)[None, :] * 1.001)
        w8, ws = qw  # unpacks as before
        with pytest.raises(TypeError, match="needs w_scale and w_layout"):
            kp.fp8_linear(qa, w8, ws)
        with pytest.raises(TypeError, match="comes with the QuantizedWeight"):
            kp.fp8_linear(qa, qw, ws)
        with pytest.raises(ValueError, match="contradicts"):
            kp.fp8_linear(qa, qw, w_layout="kn" if layout == "nk" else "nk")
        np.testing.assert_array_equal(f64(kp.fp8_linear(qa, w8, ws, w_layout=layout, out_dtype=jnp.float32)),
                                      f64(out))


SMALL = dataclasses.replace(kimi_k3.KIMI_K3, hidden=256, mla_heads=4, kda_heads=6)


@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_model_blocks_small(impl):
    """Both blocks under jit at small sizes: the kernel path equals the reference path up to
    rounding, and the FP8 o_proj path is within FP8 error of the bf16 one."""
    r = kimi_k3.run(tokens=9, impl=impl, cfg=SMALL, kda_heads=(6, 12), log=lambda *_: None)
    mla = r["mla_front"]
    assert mla["kv_c"] < 1e-2 and mla["q"] < 1e-2 and mla["k_pe"] == 0.0
    assert 1e-3 < mla["q_fp8_vs_bf16"] < 0.06  # q quantized in the norm, FP8 q_b
    for heads in (6, 12):
        assert 1e-3 < r[f"mla_out_{heads}x128"]["fp8_vs_bf16"] < 0.06  # gate + FP8 o_proj
        e = r[f"kda_out_{heads}x128"]
        assert 1e-3 < e["fp8_vs_bf16"] < 0.06, e  # e4m3: ~2**-4 relative per element
        assert e["bf16_vs_f32"] < 1e-2


def test_model_blocks_kimi_k3_sizes():
    """Kimi-K3 sizes (hidden 7168, 2112-wide packed projection, KDA 12 x 128 and 96 x 128), the
    kernels in interpret mode, two tokens."""
    r = kimi_k3.run(tokens=2, impl="interpret", log=lambda *_: None)
    assert r["mla_front"]["q"] < 1e-2 and r["mla_front"]["q_fp8_vs_bf16"] < 0.06
    for key in ("kda_out_12x128", "kda_out_96x128", "mla_out_12x128", "mla_out_96x128"):
        assert r[key]["fp8_vs_bf16"] < 0.06
        assert 0.1 < r[key]["mxfp4_vs_bf16"] < 0.25  # FP4 elements: ~17 %, not a broken path
