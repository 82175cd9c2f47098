"""Out-of-range and non-finite rows, one defined result everywhere (kernel in interpret mode and
the jnp reference): a row whose float32 sum of squares overflows is NaN, not a silent zero; in
the FP8 ops a token holding a NaN or an infinity (after the norm) gets a NaN scale and NaN codes.
Every other row is unchanged, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp

from support import f64, quant_oracle, rmsnorm64

IMPLS = ["interpret", "reference", pytest.param("pallas", marks=pytest.mark.gpu)]
HUGE = 2.0e19  # its square alone overflows float32


def _nan_rows(a):
    a = f64(a).reshape(a.shape[0], -1)
    return np.isnan(a).all(axis=1), np.isnan(a).any(axis=1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rmsnorm_overflowing_row_is_nan(rng, impl, dtype):
    x = rng.standard_normal((6, 1536)).astype(np.float32)
    x[1, 7] = HUGE           # one huge value
    x[3, :] = 5e17           # all large: the sum of 1536 squares overflows (each square does not)
    x[4, 9] = np.inf
    w = jnp.asarray(rng.standard_normal(1536), jnp.float32)
    xj = jnp.asarray(x, dtype)
    out = kp.rmsnorm(xj, w, impl=impl)
    full, anyn = _nan_rows(out)
    assert full.tolist() == [False, True, False, True, True, False]
    assert not anyn[[0, 2, 5]].any()
    assert np.isnan(rmsnorm64(np.asarray(xj), w, 1e-6)[[1, 3, 4]]).all()  # the oracle says so too
    clean = kp.rmsnorm(xj[np.array([0, 2, 5])], w, impl=impl)
    np.testing.assert_array_equal(f64(out)[[0, 2, 5]], f64(clean))
    # 1e17 everywhere still fits (sum 1.5e37): normalized, not NaN.
    ok = kp.rmsnorm(jnp.full((1, 1536), 1e17, dtype), w, impl=impl)
    assert not np.isnan(f64(ok)).any()


@pytest.mark.parametrize("impl", IMPLS)
def test_gated_fp8_overflow_and_inf_tokens(rng, impl):
    t, h, d = 8, 12, 128
    x = rng.standard_normal((t, h, d)).astype(np.float32)
    g = rng.standard_normal((t, h, d)).astype(np.float32)
    x[2, 5, 3] = HUGE        # overflowing head: NaN head, so NaN token
    g[4, 0, 0] = np.inf      # silu(inf) = inf: an infinity in y
    w = jnp.asarray(rng.uniform(0.5, 2.0, d), jnp.float32)
    for activation, bad in (("sigmoid", [2]), ("silu", [2, 4])):
        qa = kp.rmsnorm_gated_fp8_per_token(jnp.asarray(x), w, jnp.asarray(g), activation=activation,
                                            impl=impl)
        scale = np.asarray(qa.scale)[:, 0]
        assert np.flatnonzero(np.isnan(scale)).tolist() == bad, (activation, scale)
        full, anyn = _nan_rows(qa.data)
        assert np.flatnonzero(full).tolist() == bad and np.flatnonzero(anyn).tolist() == bad
        good = [i for i in range(t) if i not in bad]
        clean = kp.rmsnorm_gated_fp8_per_token(jnp.asarray(x[good]), w, jnp.asarray(g[good]),
                                               activation=activation, impl=impl)
        np.testing.assert_array_equal(scale[good], np.asarray(clean.scale)[:, 0])
        np.testing.assert_array_equal(np.asarray(qa.data)[good].view(np.uint8),
                                      np.asarray(clean.data).view(np.uint8))
    y = kp.rmsnorm_gated(jnp.asarray(x), w, jnp.asarray(g), impl=impl)  # no FP8: only the head
    heads_nan = np.isnan(f64(y)).all(axis=-1)
    assert np.argwhere(heads_nan).tolist() == [[2, 5]]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale_ub", [None, 1.0])
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"])
def test_per_token_fp8_inf_is_nan(rng, impl, scale_ub, name):
    x = rng.standard_normal((5, 256)).astype(np.float32)
    x[1, 3], x[3, 0] = np.inf, -np.inf
    qa = kp.per_token_fp8_quant(jnp.asarray(x), fp8_dtype=name, scale_ub=scale_ub, impl=impl)
    scale = np.asarray(qa.scale)[:, 0]
    assert np.flatnonzero(np.isnan(scale)).tolist() == [1, 3]
    full, anyn = _nan_rows(qa.data)
    assert np.flatnonzero(full).tolist() == [1, 3] and np.flatnonzero(anyn).tolist() == [1, 3]
    s64, _ = quant_oracle(x, name, scale_ub=scale_ub)
    assert np.flatnonzero(np.isnan(s64)).tolist() == [1, 3]
    np.testing.assert_allclose(scale[[0, 2, 4]], s64[[0, 2, 4]], rtol=1e-6)


def test_large_but_representable_values_keep_their_scale(rng):
    """The FP8 scale tracks amax up to the float32 range when no norm overflows (per-token)."""
    x = (rng.standard_normal((3, 512)) * 1e30).astype(np.float32)
    for impl in ("interpret", "reference"):
        qa = kp.per_token_fp8_quant(jnp.asarray(x), fp8_dtype="float8_e4m3fn", impl=impl)
        np.testing.assert_allclose(np.asarray(qa.scale)[:, 0], np.abs(x).max(axis=1) / 448.0, rtol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="documents XLA's CPU behaviour")
def test_denormal_inputs_are_flushed_on_the_cpu():
    """Documented: XLA on the CPU flushes float32 denormals; interpret and reference agree."""
    x, w = jnp.full((2, 64), 1e-39, jnp.float32), jnp.ones(64, jnp.float32)
    for impl in ("interpret", "reference"):
        assert np.array_equal(np.asarray(kp.rmsnorm(x, w, impl=impl)), np.zeros((2, 64), np.float32))
