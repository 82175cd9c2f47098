"""``fused_q_kv_rmsnorm_fp8`` and ``mla_q_kv_norm_fp8``: the joint MLA norm with q quantized to
per-token FP8 in the same launch, against a float64 NumPy oracle and the jnp reference; kv and
kv within 1 ulp and k_pe equal to the bf16 ops; bad input; NaN isolation; one Triton call when lowered for the
H200, gfx942 and gfx950."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp
from k3pallas import testing

from support import check_codes, check_scales, f64, quant_oracle, rmsnorm64

FNUZ = "float8_e4m3fnuz"


def _inputs(rng, t, dq=1536, dkv=512, dtype="bfloat16"):
    q = rng.standard_normal((t, dq)) * 2
    kv = rng.standard_normal((t, dkv)) * 2
    return (jnp.asarray(q, dtype), jnp.asarray(kv, dtype),
            jnp.asarray(rng.uniform(0.5, 2, dq), dtype), jnp.asarray(rng.uniform(0.5, 2, dkv), dtype))


def _check_q(qa, q, wq, name, eps=1e-6):
    t = q.shape[0]
    assert qa.data.shape == q.shape and qa.data.dtype == jnp.dtype(name)
    assert qa.scale.shape == (t, 1) and qa.scale.dtype == jnp.float32
    scale64, v = quant_oracle(rmsnorm64(q, wq, eps), name)
    check_scales(qa.scale, scale64.reshape(t, 1), 1e-6, "q scale vs oracle")
    check_codes(qa.data, v, name, what="q codes vs oracle")


CASES = [(t, "bfloat16", "float8_e4m3fn") for t in (0, 1, 7, 64, 512)]
CASES += [(33, "bfloat16", FNUZ), (7, "float32", "float8_e5m2"), (16, "float16", FNUZ)]


@pytest.mark.parametrize("t,dtype,name", CASES)
def test_fused_parity(rng, cpu_impl, t, dtype, name):
    q, kv, wq, wkv = _inputs(rng, t, dtype=dtype)
    fn = jax.jit(lambda *a: kp.fused_q_kv_rmsnorm_fp8(*a, fp8_dtype=jnp.dtype(name), impl=cpu_impl))
    with testing.poisoned_outputs():
        qa, kv_out = fn(q, kv, wq, wkv)
    _check_q(qa, q, wq, name)
    _, kv_plain = kp.fused_q_kv_rmsnorm(q, kv, wq, wkv, impl=cpu_impl)
    assert np.array_equal(np.asarray(kv_out).view(np.uint8), np.asarray(kv_plain).view(np.uint8))
    ref_q, ref_kv = kp.fused_q_kv_rmsnorm_fp8(q, kv, wq, wkv, fp8_dtype=jnp.dtype(name), impl="reference")
    _check_q(ref_q, q, wq, name)
    assert np.allclose(f64(ref_kv), f64(kv_out), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rope", [64, 0])
@pytest.mark.parametrize("t", [1, 37])
def test_packed_parity(rng, cpu_impl, rope, t):
    q, kv, wq, wkv = _inputs(rng, t)
    pe = jnp.asarray(rng.standard_normal((t, rope)), jnp.bfloat16)
    packed = jnp.concatenate([q, kv, pe], axis=-1)
    with testing.poisoned_outputs():
        qa, kv_out, pe_out = jax.jit(lambda *a: kp.mla_q_kv_norm_fp8(*a, impl=cpu_impl))(packed, wq, wkv)
    _check_q(qa, q, wq, "float8_e4m3fn")
    _, kv_plain, pe_plain = kp.mla_q_kv_norm(packed, wq, wkv, impl=cpu_impl)
    assert np.array_equal(np.asarray(kv_out).view(np.uint8), np.asarray(kv_plain).view(np.uint8))
    assert pe_out.shape == (t, rope) and np.array_equal(np.asarray(pe_out), np.asarray(pe))
    ref_q, _, _ = kp.mla_q_kv_norm_fp8(packed, wq, wkv, impl="reference")
    _check_q(ref_q, q, wq, "float8_e4m3fn")


def test_nan_isolation(rng, cpu_impl):
    q, kv, wq, wkv = _inputs(rng, 9, dtype="float32")
    dirty = np.array(q)
    dirty[4, 10] = np.nan
    clean_q, clean_kv = kp.fused_q_kv_rmsnorm_fp8(q, kv, wq, wkv, impl=cpu_impl)
    bad_q, bad_kv = kp.fused_q_kv_rmsnorm_fp8(jnp.asarray(dirty), kv, wq, wkv, impl=cpu_impl)
    assert np.isnan(f64(bad_q.scale)[4, 0]) and np.isnan(f64(bad_q.data)[4]).all()
    others = np.arange(9) != 4
    assert np.array_equal(np.asarray(bad_q.data).view(np.uint8)[others],
                          np.asarray(clean_q.data).view(np.uint8)[others])
    assert np.array_equal(np.asarray(bad_kv), np.asarray(clean_kv))  # kv untouched by q's NaN


def test_bad_inputs(rng):
    q, kv, wq, wkv = _inputs(rng, 4, dq=64, dkv=16)
    f = kp.fused_q_kv_rmsnorm_fp8
    with pytest.raises(ValueError, match="q_c and kv_c must have the same leading dims"):
        f(q, kv[:3], wq, wkv)
    with pytest.raises(ValueError, match=r"q_weight must have shape \(64,\)"):
        f(q, kv, wq[:63], wkv)
    with pytest.raises(ValueError, match="fp8_max=500.0 exceeds"):
        f(q, kv, wq, wkv, fp8_max=500.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'scale_groups'"):
        f(q, kv, wq, wkv, scale_groups=2)
    packed = jnp.concatenate([q, kv], -1)
    with pytest.raises(ValueError, match="must hold q_size \\+ kv_size"):
        kp.mla_q_kv_norm_fp8(packed, wq, wkv, q_size=64, kv_size=32)
    with pytest.raises(TypeError, match="inference-only"):
        jax.grad(lambda a: f(a, kv, wq, wkv, impl="reference")[0].scale.sum())(q.astype(jnp.float32))
    # The kernel layer: only a normalized first segment can be quantized (its amax is taken
    # beside the norm).
    from k3pallas import fp8 as fp8_lib
    from k3pallas.kernels import rmsnorm as rows

    with pytest.raises(ValueError, match="quantized \\(first\\) segment must be normalized"):
        rows.segments_rows([q], [rows.Segment(0, 0, 64, None)], [], op="rmsnorm", interpret=True,
                           fp8=fp8_lib.resolve_fp8_params("float8_e4m3fn"))


@pytest.mark.parametrize("target", list(testing.KNOWN_TARGETS.values()), ids=lambda t: t[0])
def test_one_triton_call(target):
    s = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    args = (s((64, 1536), bf), s((64, 512), bf), s((1536,), bf), s((512,), bf))
    text = testing.lower_for(lambda *a: kp.fused_q_kv_rmsnorm_fp8(*a, impl="pallas"), args, *target).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "k3pallas_fused_q_kv_rmsnorm_fp8" in text
    args = (s((64, 2112), bf), s((1536,), bf), s((512,), bf))
    text = testing.lower_for(lambda *a: kp.mla_q_kv_norm_fp8(*a, impl="pallas"), args, *target).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "k3pallas_mla_q_kv_norm_fp8" in text


# ------------------------------------------------------------------------------------------------
# Compiled on a GPU (marked gpu: skipped without one)
# ------------------------------------------------------------------------------------------------


def _ulps(a, b):
    """Distance in units in the last place between two bf16 arrays of the same sign."""
    a, b = (np.asarray(x).view(np.int16).astype(np.int32) for x in (a, b))
    return np.abs(a - b)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 4096, 65536])
@pytest.mark.parametrize("name", ["float8_e4m3fn", FNUZ])
def test_compiled(rng, t, name):
    """Both ops compiled: poisoned outputs fully written, two runs bit-identical, sampled rows of
    q against the oracle, kv within 1 ulp of the bf16 op's compiled kernel (the launches may
    differ in rows per program and warps, and so in the float32 summation order), k_pe equal."""
    q, kv, wq, wkv = _inputs(rng, t)
    pe = jnp.asarray(rng.standard_normal((t, 64)), jnp.bfloat16)
    packed = jnp.concatenate([q, kv, pe], axis=-1)
    dt = jnp.dtype(name)
    fused = jax.jit(lambda *a: kp.fused_q_kv_rmsnorm_fp8(*a, fp8_dtype=dt, impl="pallas"))
    mla = jax.jit(lambda *a: kp.mla_q_kv_norm_fp8(*a, fp8_dtype=dt, impl="pallas"))
    with testing.poisoned_outputs():
        p_fused = jax.jit(lambda *a: kp.fused_q_kv_rmsnorm_fp8(*a, fp8_dtype=dt, impl="pallas"))(q, kv, wq, wkv)
        p_mla = jax.jit(lambda *a: kp.mla_q_kv_norm_fp8(*a, fp8_dtype=dt, impl="pallas"))(packed, wq, wkv)
    as_u8 = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731
    rows = np.unique(np.concatenate([[0, t - 1], rng.integers(0, t, min(256, t))]))
    _, kv_plain = kp.fused_q_kv_rmsnorm(q, kv, wq, wkv, impl="pallas")
    for out, poisoned, again in ((fused(q, kv, wq, wkv), p_fused, fused(q, kv, wq, wkv)),
                                 (mla(packed, wq, wkv), p_mla, mla(packed, wq, wkv))):
        assert np.array_equal(as_u8(out[0].data), as_u8(again[0].data)), "two runs differ"
        for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(poisoned)):
            assert np.array_equal(as_u8(a), as_u8(b)), "poisoned run differs"
        qa = kp.QuantizedActivation(np.asarray(out[0].data)[rows], np.asarray(out[0].scale)[rows])
        _check_q(qa, np.asarray(q)[rows], wq, name)
        assert _ulps(out[1], kv_plain).max() <= 1
    assert np.array_equal(np.asarray(mla(packed, wq, wkv)[2]), np.asarray(pe))
