"""``sigmoid_mul_fp8_per_token``: MLA's output gate ``x * sigmoid(gate)`` fused with per-token FP8,
against a float64 NumPy oracle, the jnp reference and the unfused sequence; bad input; scale
groups; NaN isolation; one Triton call when lowered for the H200, gfx942 and gfx950."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp
from k3pallas import testing

from support import check_codes, check_scales, f64, quant_oracle, sigmoid64

FNUZ = "float8_e4m3fnuz"
OP = kp.sigmoid_mul_fp8_per_token


def _inputs(rng, shape, dtype="bfloat16", gate_dtype=None):
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-2, 2, shape[:-1] + (1,)))
    g = rng.standard_normal(shape) * 3.0
    return jnp.asarray(x, dtype), jnp.asarray(g, gate_dtype or dtype)


def _oracle(x, g, name, groups=1, **q):
    y = f64(x) * sigmoid64(f64(g))
    lead, n = y.shape[:-1], y.shape[-1]
    scale, v = quant_oracle(y.reshape(lead + (groups, n // groups)), name, **q)
    return scale, v.reshape(y.shape)


CASES = [(t, 1536, "bfloat16", "float8_e4m3fn") for t in (0, 1, 7, 64, 512)]
CASES += [(7, 12288, "bfloat16", FNUZ), (64, 12288, "bfloat16", "float8_e4m3fn"),
          (33, 1000, "float16", "float8_e5m2"), (5, 96, "float32", FNUZ), (3, 1, "float32", "float8_e4m3fn")]


@pytest.mark.parametrize("t,n,dtype,name", CASES)
def test_parity(rng, cpu_impl, t, n, dtype, name):
    x, g = _inputs(rng, (t, n), dtype, gate_dtype="float32" if dtype == "float16" else None)
    with testing.poisoned_outputs():
        out = jax.jit(lambda a, b: OP(a, b, fp8_dtype=jnp.dtype(name), impl=cpu_impl))(x, g)
    assert out.data.shape == (t, n) and out.data.dtype == jnp.dtype(name)
    assert out.scale.shape == (t, 1) and out.scale.dtype == jnp.float32
    scale64, v = _oracle(x, g, name)
    check_scales(out.scale, scale64.reshape(t, 1), 1e-6, "scale vs oracle")
    check_codes(out.data, v, name, what="codes vs oracle")
    ref = OP(x, g, fp8_dtype=jnp.dtype(name), impl="reference")
    check_scales(ref.scale, scale64.reshape(t, 1), 1e-6, "reference scale vs oracle")
    check_codes(ref.data, v, name, what="reference codes vs oracle")


@pytest.mark.parametrize("groups", [2, 12])
def test_scale_groups_and_leading_shape(rng, cpu_impl, groups):
    x, g = _inputs(rng, (2, 5, 1536))
    out = OP(x, g, scale_groups=groups, impl=cpu_impl)
    assert out.data.shape == (2, 5, 1536) and out.scale.shape == (2, 5, groups)
    scale64, v = _oracle(x.reshape(10, 1536), g.reshape(10, 1536), "float8_e4m3fn", groups)
    check_scales(out.scale.reshape(10, groups), scale64, 1e-6, "grouped scale vs oracle")
    check_codes(out.data.reshape(10, 1536), v, "float8_e4m3fn", what="grouped codes")
    deq = out.dequantize()
    y = f64(x) * sigmoid64(f64(g))
    assert np.allclose(f64(deq), y, rtol=0.07, atol=f64(out.scale).max() * 0.5 * 32)


def test_nan_isolation_and_zero_row(rng, cpu_impl):
    x, g = _inputs(rng, (9, 1536), "float32")
    x = np.array(x)
    x[2] = 0.0
    dirty = x.copy()
    dirty[5, 700] = np.nan
    clean = OP(jnp.asarray(x), g, impl=cpu_impl)
    bad = OP(jnp.asarray(dirty), g, impl=cpu_impl)
    assert np.isnan(f64(bad.scale)[5, 0]) and np.isnan(f64(bad.data)[5]).all()
    others = np.arange(9) != 5
    assert np.array_equal(np.asarray(bad.data).view(np.uint8)[others],
                          np.asarray(clean.data).view(np.uint8)[others])
    assert f64(clean.scale)[2, 0] == pytest.approx(1.0 / (448.0 * 512), rel=1e-7)
    assert (f64(clean.data)[2] == 0).all()


def test_unfused_sequence_agrees(rng, cpu_impl):
    """The fused op against ``per_token_fp8_quant`` of the float32 product (same math, two
    launches): scales equal to 1e-6, codes one step apart at most, only at ties."""
    x, g = _inputs(rng, (64, 1536))
    out = OP(x, g, impl=cpu_impl)
    y32 = x.astype(jnp.float32) * jax.nn.sigmoid(g.astype(jnp.float32))
    seq = kp.per_token_fp8_quant(y32, impl=cpu_impl)
    check_scales(out.scale, f64(seq.scale), 1e-6, "fused vs sequential scale")
    _, v = _oracle(x, g, "float8_e4m3fn")
    check_codes(seq.data, v, "float8_e4m3fn", what="sequential codes")


def test_bad_inputs(rng):
    x, g = _inputs(rng, (4, 96))
    with pytest.raises(ValueError, match=r"gate must have the shape of x"):
        OP(x, g[:3])
    with pytest.raises(TypeError, match="gate must have a floating dtype.*int32"):
        OP(x, g.astype(jnp.int32))
    with pytest.raises(ValueError, match=r"scale_groups=5 must divide the last dim of x \(96\)"):
        OP(x, g, scale_groups=5)
    with pytest.raises(ValueError, match="fp8_max=500.0 exceeds"):
        OP(x, g, fp8_max=500.0)
    with pytest.raises(TypeError, match="fp8_dtype must be one of"):
        OP(x, g, fp8_dtype=jnp.int8)
    with pytest.raises(ValueError, match="impl must be one of"):
        OP(x, g, impl="triton")
    with pytest.raises(TypeError, match="inference-only"):
        jax.grad(lambda a: OP(a, g, impl="reference").scale.sum())(x.astype(jnp.float32))


@pytest.mark.parametrize("target", list(testing.KNOWN_TARGETS.values()), ids=lambda t: t[0])
@pytest.mark.parametrize("n", [1536, 12288])
def test_one_triton_call(target, n):
    s = jax.ShapeDtypeStruct((64, n), jnp.bfloat16)
    text = testing.lower_for(lambda a, b: OP(a, b, impl="pallas"), (s, s), *target).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "k3pallas_sigmoid_mul_fp8_per_token" in text


# ------------------------------------------------------------------------------------------------
# Compiled on a GPU (marked gpu: skipped without one)
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 4096])
@pytest.mark.parametrize("n", [1536, 12288])
@pytest.mark.parametrize("name", ["float8_e4m3fn", FNUZ])
def test_compiled(rng, t, n, name):
    """The compiled kernel: poisoned outputs fully written, two runs bit-identical, sampled rows
    against the oracle, every scale against the reference."""
    x, g = _inputs(rng, (t, n))
    fn = jax.jit(lambda a, b: OP(a, b, fp8_dtype=jnp.dtype(name), impl="pallas"))
    with testing.poisoned_outputs():
        poisoned = jax.jit(lambda a, b: OP(a, b, fp8_dtype=jnp.dtype(name), impl="pallas"))(x, g)
    out = fn(x, g)
    as_u8 = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731
    assert np.array_equal(as_u8(out.data), as_u8(fn(x, g).data)), "two runs differ"
    assert np.array_equal(as_u8(out.data), as_u8(poisoned.data)), "poisoned run differs"
    rows = np.unique(np.concatenate([[0, t - 1], rng.integers(0, t, min(256, t))]))
    scale64, v = _oracle(np.asarray(x)[rows], np.asarray(g)[rows], name)
    check_scales(np.asarray(out.scale)[rows], scale64.reshape(-1, 1), 1e-6, "scale vs oracle")
    check_codes(np.asarray(out.data)[rows], v, name, what="codes vs oracle")
    ref = OP(x, g, fp8_dtype=jnp.dtype(name), impl="reference")
    assert np.abs(f64(out.scale) / f64(ref.scale) - 1).max() <= 1e-6
