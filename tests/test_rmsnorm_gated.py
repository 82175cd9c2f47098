"""Gated RMSNorm, its per-token FP8 fusion and standalone per-token FP8: kernels (interpret mode on
the CPU) against float64 NumPy oracles, the jnp reference and the unfused sequence."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp
from k3pallas import ops as op_table
from k3pallas import testing
from k3pallas.kernels import gated_fp8

from support import (ORACLE_TOL, REFERENCE_TOL, assert_close, check_codes, check_pair, check_scales, f64,
                    fp8_grid, gated64, quant_oracle)

HD = [(32, 128), (12, 128), (96, 128), (1, 64), (5, 96)]
FNUZ = "float8_e4m3fnuz"


def _gated_inputs(rng, t, h, d, dtype="bfloat16", gate_dtype=None, w_scale=1.0):
    x = jnp.asarray(rng.standard_normal((t, h, d)) * 2.0, dtype)
    g = jnp.asarray(rng.standard_normal((t, h, d)) * 2.0, gate_dtype or dtype)
    w = jnp.asarray(rng.uniform(0.2, 2.0, d) * w_scale, jnp.float32)
    return x, w, g


# ------------------------------------------------------------------------------------------------
# rmsnorm_gated
# ------------------------------------------------------------------------------------------------

GATED_CASES = [(t, (32, 128), "sigmoid", "bfloat16") for t in (0, 1, 7, 64, 512, 4096)]
GATED_CASES += [(7, hd, act, "bfloat16") for hd in HD for act in ("sigmoid", "silu")]
GATED_CASES += [(64, (5, 96), "silu", "float16"), (64, (12, 128), "sigmoid", "float32")]


@pytest.mark.parametrize("t,hd,activation,dtype", GATED_CASES)
def test_rmsnorm_gated_parity(rng, cpu_impl, t, hd, activation, dtype):
    h, d = hd
    x, w, g = _gated_inputs(rng, t, h, d, dtype, gate_dtype="float32" if dtype == "float16" else None)
    with testing.poisoned_outputs():
        y = jax.jit(lambda *a: kp.rmsnorm_gated(*a, 1e-5, activation=activation, impl=cpu_impl))(x, w, g)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, gated64(x, w, g, 1e-5, activation), ORACLE_TOL[dtype], "vs oracle")
    ref = kp.rmsnorm_gated(x, w, g, 1e-5, activation=activation, impl="reference")
    assert_close(y, ref, REFERENCE_TOL[dtype], "vs reference")


# ------------------------------------------------------------------------------------------------
# rmsnorm_gated_fp8_per_token: fused vs sequential vs oracle
# ------------------------------------------------------------------------------------------------


def run_gated_fp8(x, w, g, impl, activation="sigmoid", **q):
    fn = jax.jit(lambda *a: kp.rmsnorm_gated_fp8_per_token(*a, 1e-5, activation=activation,
                                                           impl=impl, **q))
    with testing.poisoned_outputs():
        return fn(x, w, g)


def check_gated_fp8(x, w, g, impl, name, activation="sigmoid", **q):
    t, h, d = x.shape
    out = run_gated_fp8(x, w, g, impl, activation, fp8_dtype=jnp.dtype(name), **q)
    assert out.data.shape == (t, h * d) and out.data.dtype == jnp.dtype(name)
    assert out.scale.shape == (t, 1) and out.scale.dtype == jnp.float32
    y64 = gated64(x, w, g, 1e-5, activation).reshape(t, h * d)
    scale64, v = quant_oracle(y64, name, **{k: v for k, v in q.items()})
    check_scales(out.scale, scale64, 1e-6, "fused scale vs oracle")
    check_codes(out.data, v, name, what="fused codes vs oracle")
    # Dequantized within half a code step (plus the tie slack) of the oracle.
    deq = f64(out.data) * f64(out.scale)
    grid = fp8_grid(name)
    step = np.diff(grid)[np.clip(np.searchsorted(grid, np.abs(v)), 0, len(grid) - 2)]
    ok = ~np.isnan(v)
    # With scale_ub the codes saturate at +-fp8_max: the dequantized value then approximates the
    # clamped activation (without it the clamp bound is >= amax and changes nothing).
    fp8_max = q.get("fp8_max") or kp.fp8.default_fp8_max(name)
    s64 = scale64.reshape(t, 1)
    target = np.clip(y64, -fp8_max * s64, fp8_max * s64)
    err = np.abs(deq - target)[ok]
    bound = ((0.5 * step + 1e-5 * np.abs(v)) * s64)[ok]
    if err.size:
        worst = int(np.argmax(err - bound))
        assert (err <= bound).all(), (f"dequantized codes off by {err[worst]:.3g} > "
                                      f"{bound[worst]:.3g} (element {worst} of the non-NaN ones)")
    # Sequential: per_token_fp8_quant of the float32 gated RMSNorm, both kernels.
    y32 = kp.rmsnorm_gated(x.astype(jnp.float32), w, g.astype(jnp.float32), 1e-5,
                           activation=activation, impl=impl)
    seq = kp.per_token_fp8_quant(y32.reshape(t, h * d), fp8_dtype=jnp.dtype(name), impl=impl, **q)
    check_scales(seq.scale, scale64, 1e-6, "sequential scale vs oracle")
    check_scales(out.scale, f64(seq.scale).reshape(-1), 1e-6, "fused vs sequential scale")
    check_pair(out.data, seq.data, v, name, "fused vs sequential codes")
    # And the jnp reference (XLA's own fp8 cast, independent of the kernel's encoder).
    ref = kp.rmsnorm_gated_fp8_per_token(x, w, g, 1e-5, activation=activation,
                                         fp8_dtype=jnp.dtype(name), impl="reference", **q)
    check_scales(ref.scale, scale64, 1e-6, "reference scale vs oracle")
    check_pair(out.data, ref.data, v, name, "fused vs reference codes")
    return out, scale64, v


FP8_CASES = [(t, (32, 128), "sigmoid", "float8_e4m3fn") for t in (0, 1, 7, 64, 512, 4096)]
FP8_CASES += [(4096, (12, 128), "silu", FNUZ)]
FP8_CASES += [(t, hd, act, name)
              for t, hd, act, name in [(7, (12, 128), "silu", FNUZ), (64, (12, 128), "sigmoid", "float8_e5m2"),
                                       (7, (96, 128), "sigmoid", "float8_e4m3fn"),
                                       (64, (96, 128), "silu", FNUZ), (7, (1, 64), "silu", "float8_e5m2"),
                                       (64, (1, 64), "sigmoid", FNUZ), (7, (5, 96), "sigmoid", FNUZ),
                                       (64, (5, 96), "silu", "float8_e4m3fn"),
                                       (512, (5, 96), "sigmoid", "float8_e5m2")]]


@pytest.mark.parametrize("t,hd,activation,name", FP8_CASES)
def test_gated_fp8_parity(rng, cpu_impl, t, hd, activation, name):
    x, w, g = _gated_inputs(rng, *((t,) + hd))
    check_gated_fp8(x, w, g, cpu_impl, name, activation)


@pytest.mark.parametrize("fp8_max", [224.0, 240.0])
def test_gated_fp8_fnuz_max(rng, cpu_impl, fp8_max, gated_form):
    x, w, g = _gated_inputs(rng, 64, 12, 128)
    out, _, _ = check_gated_fp8(x, w, g, cpu_impl, FNUZ, fp8_max=fp8_max)
    # The largest magnitude of every row lands exactly on +-fp8_max.
    assert np.allclose(np.max(np.abs(f64(out.data)), axis=-1), fp8_max)


@pytest.fixture(params=[True, False], ids=["beside_norm", "after_norm"])
def gated_form(request, monkeypatch):
    """Both forms of the gated FP8 kernel's amax (``gated_fp8.amax_beside_norm`` picks one by
    shape) at the same shapes."""
    monkeypatch.setattr(gated_fp8, "amax_beside_norm", lambda n_rows, heads: request.param)
    return request.param


@pytest.mark.parametrize("name", ["float8_e4m3fn", FNUZ, "float8_e5m2"])
def test_gated_fp8_special_rows(rng, cpu_impl, name, gated_form):
    """Zero rows, a NaN row, huge and tiny magnitudes in one call; the NaN touches no other row."""
    t, h, d = 9, 5, 96
    x, w, g = _gated_inputs(rng, t, h, d, "float32")
    x = np.array(x)
    x[2] = 0.0  # zero row: scale = min_scale, zero codes
    x[4] *= 1e4  # rmsnorm is scale invariant in x: same codes as unscaled
    x_nan = x.copy()
    x_nan[6, 3, 17] = np.nan
    big_w = jnp.asarray(np.asarray(w) * 1e4)
    for xx, ww in ((x, w), (x, big_w), (x, jnp.asarray(np.asarray(w) * 1e-30)), (x_nan, w)):
        out, scale64, _ = check_gated_fp8(jnp.asarray(xx), ww, g, cpu_impl, name)
        min_scale = 1.0 / ({"float8_e4m3fn": 448.0, FNUZ: 224.0, "float8_e5m2": 57344.0}[name] * 512)
        assert f64(out.scale)[2, 0] == pytest.approx(min_scale, rel=1e-7)
        assert (f64(out.data)[2] == 0).all()
    clean = run_gated_fp8(jnp.asarray(x), w, g, cpu_impl, fp8_dtype=jnp.dtype(name))
    dirty = run_gated_fp8(jnp.asarray(x_nan), w, g, cpu_impl, fp8_dtype=jnp.dtype(name))
    assert np.isnan(f64(dirty.scale)[6, 0]) and np.isnan(f64(dirty.data)[6]).all()
    others = np.arange(t) != 6
    assert np.array_equal(np.asarray(dirty.data).view(np.uint8)[others],
                          np.asarray(clean.data).view(np.uint8)[others])
    assert np.array_equal(np.asarray(dirty.scale)[others], np.asarray(clean.scale)[others])


def test_gated_fp8_scale_ub(rng, cpu_impl, gated_form):
    x, w, g = _gated_inputs(rng, 33, 12, 128)
    y = gated64(x, w, g, 1e-5, "sigmoid")
    ub = float(np.median(np.max(np.abs(y), axis=(1, 2))))  # about half the rows get clamped
    out, scale64, _ = check_gated_fp8(x, w, g, cpu_impl, "float8_e4m3fn", scale_ub=ub)
    assert np.allclose(f64(out.scale).max(), ub / 448.0, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# per_token_fp8_quant
# ------------------------------------------------------------------------------------------------

QUANT_CASES = [(t, 4096, "bfloat16", "float8_e4m3fn") for t in (0, 1, 7, 64, 512, 4096)]
QUANT_CASES += [(7, 1536, "float32", FNUZ), (64, 1000, "float16", "float8_e5m2"),
                (33, 3000, "bfloat16", FNUZ), (5, 1, "float32", "float8_e4m3fn")]


@pytest.mark.parametrize("t,n,dtype,name", QUANT_CASES)
def test_per_token_fp8_parity(rng, cpu_impl, t, n, dtype, name):
    x = rng.standard_normal((t, n)) * np.exp(rng.uniform(-3, 3, (t, 1)))
    if t > 3:
        x[1] = 0.0
    x = jnp.asarray(x, dtype)
    with testing.poisoned_outputs():
        out = jax.jit(lambda a: kp.per_token_fp8_quant(a, fp8_dtype=jnp.dtype(name), impl=cpu_impl))(x)
    assert out.data.shape == (t, n) and out.scale.shape == (t, 1)
    scale64, v = quant_oracle(x, name)
    check_scales(out.scale, scale64, 1e-6, "scale vs oracle")
    check_codes(out.data, v, name, what="codes vs oracle")
    ref = kp.per_token_fp8_quant(x, fp8_dtype=jnp.dtype(name), impl="reference")
    check_scales(ref.scale, scale64, 1e-6, "reference scale vs oracle")
    check_pair(out.data, ref.data, v, name, "kernel vs reference")


@pytest.mark.parametrize("name", ["float8_e4m3fn", FNUZ, "float8_e5m2"])
def test_per_token_fp8_nan_and_options(rng, cpu_impl, name):
    x = rng.standard_normal((6, 300)).astype(np.float32)
    x[3, 7] = np.nan
    x[4] *= 1e-30
    q = dict(fp8_dtype=jnp.dtype(name), min_scale=1e-3, scale_ub=2.0)
    out = kp.per_token_fp8_quant(jnp.asarray(x), impl=cpu_impl, **q)
    scale64, v = quant_oracle(x, name, min_scale=1e-3, scale_ub=2.0)
    check_scales(out.scale, scale64, 1e-6)
    check_codes(out.data, v, name)
    assert np.isnan(f64(out.scale)[3, 0]) and not np.isnan(f64(out.scale)[[0, 1, 2, 4, 5]]).any()


def test_quantized_activation_container(rng, cpu_impl):
    x = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.float32)
    qa = kp.per_token_fp8_quant(x, impl=cpu_impl)
    data, scale = qa  # unpacks
    assert isinstance(qa, kp.QuantizedActivation) and data.shape == (2, 3, 256) and scale.shape == (2, 3, 1)
    leaves = jax.tree_util.tree_leaves(qa)
    assert len(leaves) == 2
    back = jax.jit(lambda q: q)(qa)
    assert isinstance(back, kp.QuantizedActivation)
    deq = qa.dequantize()
    assert deq.dtype == jnp.float32
    # Half a code step of e4m3fn is at most 1/16 relative; amax maps to 448 exactly.
    assert np.all(np.abs(f64(deq) - f64(x)) <= np.abs(f64(x)) / 16 + f64(scale) * 2**-10)
    assert qa.dequantize(jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.parametrize("quant_op", ["gated", "gated_after_norm", "per_token"])
def test_scale_only_and_given_scale_modes(rng, quant_op):
    """The two launches of the cross-device scale (k3pallas.sharding): "scale_only" gives the
    dynamic launch's scale within 1e-6 (compiled without the codes, its arithmetic may round
    differently: a few ulp on the H200, test_gpu_integration; on XLA 0.12's CPU in the gated
    kernel's beside-the-norm form, up to 2 ulp), the same NaN rows, and "given_scale" with the
    dynamic scale gives its codes, bit for bit; with a larger scale (another device's), the codes
    are those of that scale."""
    from k3pallas import fp8 as fp8_lib
    from k3pallas.kernels import gated_fp8 as kernels

    q = fp8_lib.resolve_fp8_params("float8_e4m3fn")
    x = jnp.asarray(rng.standard_normal((37, 12, 64)) * 2, jnp.bfloat16)
    x = x.at[5, 3, 7].set(jnp.nan)
    if quant_op.startswith("gated"):
        g = jnp.asarray(rng.standard_normal((37, 12, 64)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal(64), jnp.float32)
        rows = functools.partial(kernels.rmsnorm_gated_rows, x, g, w, eps=1e-5,
                                 activation="sigmoid", op=op_table.RMSNORM_GATED_FP8_PER_TOKEN.name, fp8=q, interpret=True,
                                 beside_norm=quant_op == "gated")
    else:
        rows = functools.partial(kernels.per_token_fp8_rows, x.reshape(37, -1), op=op_table.PER_TOKEN_FP8_QUANT.name, fp8=q,
                                 interpret=True)
    with testing.poisoned_outputs():
        codes, scale = rows()
        none, scale_only = rows(mode="scale_only")
        codes_given, none2 = rows(mode="given_scale", scale=scale)
        codes_big, _ = rows(mode="given_scale", scale=scale * 2)
    assert none is None and none2 is None
    s1, s2 = np.asarray(scale), np.asarray(scale_only)
    assert np.array_equal(np.isnan(s1), np.isnan(s2))
    np.testing.assert_allclose(s2, s1, rtol=1e-6)
    assert np.isnan(np.asarray(scale)[5]) and np.isnan(np.asarray(codes, np.float32)[5]).all()
    assert np.array_equal(np.asarray(codes).view(np.uint8), np.asarray(codes_given).view(np.uint8))
    c1 = np.asarray(codes, np.float64)[np.arange(37) != 5]
    c2 = np.asarray(codes_big, np.float64)[np.arange(37) != 5]
    assert np.abs(c2).max() <= 224.5 and np.abs(c1).max() == 448  # half the range used
    with pytest.raises(ValueError, match="mode must be one of"):
        rows(mode="static")
    with pytest.raises(ValueError, match="exactly in mode 'given_scale'"):
        rows(mode="given_scale")
    with pytest.raises(ValueError, match="exactly in mode 'given_scale'"):
        rows(scale=scale)
