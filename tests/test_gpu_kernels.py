"""Compiled kernels on a real GPU (marked ``gpu``: skipped without one).

The compiled kernel against the jnp reference up to T = 131072 and against the float64 oracle on
sampled rows; two runs bit-identical; NaN-poisoned outputs fully written; the FP8 encoder
bit-exact inside a compiled kernel; 2**21 rows of width 2048 (64-bit offsets)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp
from k3pallas import fp8 as fp8_lib
from k3pallas import testing

from support import (ORACLE_TOL, REFERENCE_TOL, assert_close, check_codes, check_scales, f64,
                    gated64, quant_oracle, rmsnorm64)
from support import encode_in_pallas, encoder_inputs, expected_codes
from support import check_pair

pytestmark = pytest.mark.gpu


def _rand(key, shape, dtype, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def _rows_sample(rng, t, n=512):
    return np.unique(np.concatenate([[0, t - 1], rng.integers(0, t, min(n, t))]))


@pytest.mark.parametrize("t", [1, 7, 64, 4096, 131072])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_q_kv_compiled(rng, t, dtype):
    k = jax.random.split(jax.random.PRNGKey(int(rng.integers(2**31))), 4)
    q, kv = _rand(k[0], (t, 1536), dtype, 3.0), _rand(k[1], (t, 512), dtype)
    wq, wkv = _rand(k[2], (1536,), jnp.float32), _rand(k[3], (512,), jnp.bfloat16)
    fn = jax.jit(lambda *a: kp.fused_q_kv_rmsnorm(*a, 1e-6, impl="pallas"))
    with testing.poisoned_outputs():
        poisoned = jax.jit(lambda *a: kp.fused_q_kv_rmsnorm(*a, 1e-6, impl="pallas"))(q, kv, wq, wkv)
    out1 = fn(q, kv, wq, wkv)
    out2 = fn(q, kv, wq, wkv)
    ref = jax.jit(lambda *a: kp.fused_q_kv_rmsnorm(*a, 1e-6, impl="reference"))(q, kv, wq, wkv)
    for o1, o2, p, r, x, w in zip(out1, out2, poisoned, ref, (q, kv), (wq, wkv)):
        assert np.array_equal(np.asarray(o1), np.asarray(o2)), "two runs differ"
        assert np.array_equal(np.asarray(o1), np.asarray(p)), "poisoned run differs"
        assert_close(o1, r, REFERENCE_TOL[dtype], "vs reference")
        rows = _rows_sample(rng, t)
        assert_close(np.asarray(o1)[rows], rmsnorm64(np.asarray(x)[rows], w, 1e-6),
                     ORACLE_TOL[dtype], "vs oracle")


@pytest.mark.parametrize("t,width", [(131072, 1536), (5, 72), (1000, 3000)])
def test_rmsnorm_compiled(rng, t, width):
    k = jax.random.split(jax.random.PRNGKey(int(rng.integers(2**31))), 2)
    x, w = _rand(k[0], (t, width), jnp.bfloat16), _rand(k[1], (width,), jnp.float32)
    with testing.poisoned_outputs():
        y = jax.jit(lambda a, b: kp.rmsnorm(a, b, impl="pallas"))(x, w)
    assert_close(y, kp.rmsnorm(x, w, impl="reference"), REFERENCE_TOL["bfloat16"])


def test_rmsnorm_2pow21_rows_of_2048(rng):
    """8 GiB in, 8 GiB out: offsets past 2**32 bytes must not wrap (the lowering picks 64-bit)."""
    t, width = 2**21, 2048
    x = jax.random.normal(jax.random.PRNGKey(1), (t, width), jnp.float32).astype(jnp.bfloat16)
    x = x * jnp.arange(1, t + 1, dtype=jnp.float32)[:, None].astype(jnp.bfloat16)  # row-dependent
    w = jnp.ones((width,), jnp.float32)
    y = jax.jit(lambda a, b: kp.rmsnorm(a, b, impl="pallas"))(x, w)
    rows = np.array([0, 1, 2**20 - 1, 2**20, 2**20 + 1, t - 2, t - 1])
    assert_close(np.asarray(y[rows]), rmsnorm64(np.asarray(x[rows]), w, 1e-6), ORACLE_TOL["bfloat16"])
    del x, y


HD = [(32, 128), (12, 128), (96, 128), (5, 96)]


@pytest.mark.parametrize("t", [1, 7, 4096, 131072])
@pytest.mark.parametrize("hd", HD, ids=str)
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e4m3fnuz"])
def test_gated_fp8_compiled(rng, t, hd, name):
    h, d = hd
    if t == 131072 and hd != (32, 128):
        pytest.skip("the largest T on the headline shape only")
    k = jax.random.split(jax.random.PRNGKey(int(rng.integers(2**31))), 3)
    x, g = _rand(k[0], (t, h, d), jnp.bfloat16, 2.0), _rand(k[1], (t, h, d), jnp.bfloat16, 2.0)
    w = jax.random.uniform(k[2], (d,), jnp.float32, 0.2, 2.0)
    dt = jnp.dtype(name)
    fn = jax.jit(lambda *a: kp.rmsnorm_gated_fp8_per_token(*a, fp8_dtype=dt, impl="pallas"))
    with testing.poisoned_outputs():
        poisoned = jax.jit(lambda *a: kp.rmsnorm_gated_fp8_per_token(*a, fp8_dtype=dt, impl="pallas"))(x, w, g)
    out1, out2 = fn(x, w, g), fn(x, w, g)
    as_u8 = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731
    assert np.array_equal(as_u8(out1.data), as_u8(out2.data)) and np.array_equal(
        np.asarray(out1.scale), np.asarray(out2.scale)), "two runs differ"
    assert np.array_equal(as_u8(out1.data), as_u8(poisoned.data)), "poisoned run differs"
    rows = _rows_sample(rng, t)
    y64 = gated64(np.asarray(x)[rows], w, np.asarray(g)[rows], 1e-5, "sigmoid").reshape(len(rows), h * d)
    scale64, v = quant_oracle(y64, name)
    check_scales(np.asarray(out1.scale)[rows], scale64, 1e-6, "scale vs oracle")
    check_codes(np.asarray(out1.data)[rows], v, name, what="codes vs oracle")
    ref = jax.jit(lambda *a: kp.rmsnorm_gated_fp8_per_token(*a, fp8_dtype=dt, impl="reference"))(x, w, g)
    check_pair(np.asarray(out1.data)[rows], np.asarray(ref.data)[rows], v, name, "vs reference")
    # All rows against the reference: scales, and codes never more than one step apart.
    rel = np.abs(f64(out1.scale) / f64(ref.scale) - 1)
    assert rel.max() <= 1e-6
    diff = np.abs(f64(out1.data) - f64(ref.data))
    step = np.abs(f64(ref.data)) / 8 + 2.0**-9
    assert (diff <= step * 1.01).all()


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"])
def test_gated_fp8_nan_and_zero_rows_compiled(rng, name):
    x = np.asarray(rng.standard_normal((64, 12, 128)), np.float32)
    x[5] = 0.0
    x_nan = x.copy()
    x_nan[9, 0, 0] = np.nan
    g = jnp.asarray(rng.standard_normal((64, 12, 128)), jnp.bfloat16)
    w = jnp.ones((128,), jnp.float32)
    dt = jnp.dtype(name)
    clean = kp.rmsnorm_gated_fp8_per_token(jnp.asarray(x), w, g, fp8_dtype=dt, impl="pallas")
    dirty = kp.rmsnorm_gated_fp8_per_token(jnp.asarray(x_nan), w, g, fp8_dtype=dt, impl="pallas")
    assert np.isnan(f64(dirty.scale)[9, 0]) and np.isnan(f64(dirty.data)[9]).all()
    keep = np.arange(64) != 9
    assert np.array_equal(np.asarray(dirty.data).view(np.uint8)[keep], np.asarray(clean.data).view(np.uint8)[keep])
    assert f64(clean.scale)[5, 0] == pytest.approx(1 / (fp8_lib.default_fp8_max(dt) * 512), rel=1e-7)
    assert (f64(clean.data)[5] == 0).all()


@pytest.mark.parametrize("t,n", [(1, 4096), (4096, 4096), (131072, 1536), (33, 3000)])
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"])
def test_per_token_fp8_compiled(rng, t, n, name):
    x = _rand(jax.random.PRNGKey(int(rng.integers(2**31))), (t, n), jnp.bfloat16, 3.0)
    dt = jnp.dtype(name)
    with testing.poisoned_outputs():
        out = jax.jit(lambda a: kp.per_token_fp8_quant(a, fp8_dtype=dt, impl="pallas"))(x)
    again = jax.jit(lambda a: kp.per_token_fp8_quant(a, fp8_dtype=dt, impl="pallas"))(x)
    assert np.array_equal(np.asarray(out.data).view(np.uint8), np.asarray(again.data).view(np.uint8))
    rows = _rows_sample(rng, t)
    scale64, v = quant_oracle(np.asarray(x)[rows], name)
    check_scales(np.asarray(out.scale)[rows], scale64, 1e-6)
    check_codes(np.asarray(out.data)[rows], v, name)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"])
def test_software_encoder_bit_exact_compiled(rng, name):
    v = encoder_inputs(name, rng, n_random=1_000_000)
    assert np.array_equal(encode_in_pallas(v, name, interpret=False), expected_codes(v, name))


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_native_cast_matches_software_encoder(rng, name):
    """Where the platform uses the lowering's own cast (cuda: e4m3fn, e5m2), it must round like
    the integer encoder and XLA on every in-range value (the kernels clamp first)."""
    from jax.experimental import pallas as pl

    v = encoder_inputs(name, rng, n_random=1_000_000)
    v = v[~np.isnan(v)]
    n = len(v) - len(v) % 4096
    x = jnp.asarray(v[:n])

    def kernel(x_ref, o_ref):
        i = jnp.arange(4096)
        o_ref[i] = x_ref[i].astype(o_ref.dtype)

    out = pl.pallas_call(kernel, grid=(n // 4096,), in_specs=[pl.BlockSpec((4096,), lambda i: (i,))],
                         out_specs=pl.BlockSpec((4096,), lambda i: (i,)),
                         out_shape=jax.ShapeDtypeStruct((n,), jnp.dtype(name)))(x)
    assert np.array_equal(np.asarray(out).view(np.uint8), expected_codes(v[:n], name))


# ---------------------------------------------------------------------------------------------
# The FP8 conversion choice on the device (k3pallas.kernels.fp8_cast)
# ---------------------------------------------------------------------------------------------


def _device_target():
    from k3pallas import platform

    return platform.current_target()


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz"])
def test_fp8_cast_self_check_on_the_device(name):
    """The self-check kernel compiled for this GPU; where the target has a native conversion for
    the format, both paths agree on every value and auto picks native."""
    from k3pallas.kernels import fp8_cast

    target = _device_target()
    reason = fp8_cast.native_unavailable(target, name)
    d = fp8_cast.decide(name, "auto")
    if reason:
        assert not d.native and d.reason == reason
        return
    assert fp8_cast.self_check(name, interpret=False) == ()
    assert d.native and "agree on all" in d.reason, d


@pytest.mark.parametrize("op", ["gated", "quant"])
@pytest.mark.parametrize("t", [7, 65536])
def test_native_and_encoder_kernels_agree_compiled(rng, op, t):
    """The fused kernels with the native conversion and with the encoder: the same scales and,
    on every non-NaN element, the same bytes."""
    name = "float8_e4m3fn" if _device_target().backend == "cuda" else str(kp.default_fp8_dtype())
    k = jax.random.split(jax.random.PRNGKey(int(rng.integers(2**31))), 3)
    if op == "gated":
        x, g = _rand(k[0], (t, 32, 128), jnp.bfloat16, 2.0), _rand(k[1], (t, 32, 128), jnp.bfloat16, 2.0)
        w = jax.random.uniform(k[2], (128,), jnp.float32, 0.2, 2.0)
        x = x.at[3].set(jnp.nan).at[5].set(0.0)
        run = lambda c: jax.jit(lambda *a: kp.rmsnorm_gated_fp8_per_token(  # noqa: E731
            *a, fp8_dtype=name, fp8_cast=c, impl="pallas"))(x, w, g)
    else:
        x = _rand(k[0], (t, 4096), jnp.bfloat16, 3.0).at[3].set(jnp.nan).at[5].set(0.0)
        run = lambda c: jax.jit(lambda a: kp.per_token_fp8_quant(  # noqa: E731
            a, fp8_dtype=name, fp8_cast=c, impl="pallas"))(x)
    nat, enc = run("native"), run("encoder")
    a, b = np.asarray(nat.data).view(np.uint8), np.asarray(enc.data).view(np.uint8)
    nan = np.isnan(f64(enc.data))
    assert np.array_equal(np.isnan(f64(nat.data)), nan) and nan[3].all()
    assert np.array_equal(a[~nan], b[~nan])
    np.testing.assert_array_equal(np.asarray(nat.scale), np.asarray(enc.scale))
