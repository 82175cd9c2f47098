"""``mla_q_kv_norm``: the packed MLA projection normalized in one launch, against a float64
oracle and the jnp reference (interpret mode on the CPU), and its lowered module: one Triton
call and no slice around it, for the H200 and AMD gfx942 / gfx950."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp
from k3pallas import platform
from k3pallas.kernels import launch
from k3pallas import testing

from support import ORACLE_TOL, REFERENCE_TOL, assert_close, rmsnorm64

TARGETS = list(testing.KNOWN_TARGETS.values())
TRITON_CALL = "__gpu$xla.gpu.triton"

# (q_size, kv_size, rope): the MLA sizes, rope width 0, and odd sizes whose kv and rope parts
# start at odd columns.
SIZES = [(1536, 512, 64), (1536, 512, 0), (1000, 72, 3), (7, 5, 9), (512, 3000, 64)]


def _packed(rng, t, sizes, dtype):
    dq, dkv, rope = sizes
    a = rng.standard_normal((t, dq + dkv + rope)) * np.concatenate(
        [np.full(dq, 3.0), np.full(dkv, 0.5), np.full(rope, 7.0)])
    wq = jnp.asarray(rng.uniform(0.5, 1.5, dq), jnp.float32)
    wkv = jnp.asarray(rng.uniform(-1.5, 1.5, dkv), jnp.bfloat16)
    return jnp.asarray(a, dtype), wq, wkv


@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("t", [0, 1, 7, 64, 513])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_parity(rng, cpu_impl, sizes, t, dtype):
    dq, dkv, rope = sizes
    a, wq, wkv = _packed(rng, t, sizes, dtype)
    eps, kv_eps = 1e-6, 1e-5
    with testing.poisoned_outputs():
        q, kv, pe = jax.jit(lambda *x: kp.mla_q_kv_norm(*x, eps, kv_eps=kv_eps, q_size=dq, kv_size=dkv,
                                                        impl=cpu_impl))(a, wq, wkv)
    assert (q.shape, kv.shape, pe.shape) == ((t, dq), (t, dkv), (t, rope))
    assert q.dtype == kv.dtype == pe.dtype == a.dtype
    an = np.asarray(a)
    tol = ORACLE_TOL[dtype]
    assert_close(q, rmsnorm64(an[:, :dq], wq, eps), tol, "q vs oracle")
    assert_close(kv, rmsnorm64(an[:, dq:dq + dkv], wkv, kv_eps), tol, "kv vs oracle")
    assert np.array_equal(np.asarray(pe), an[:, dq + dkv:]), "k_pe must be the input's rope part"
    q_r, kv_r, pe_r = kp.mla_q_kv_norm(a, wq, wkv, eps, kv_eps=kv_eps, q_size=dq, kv_size=dkv,
                                       impl="reference")
    assert_close(q, q_r, REFERENCE_TOL[dtype], "q vs reference")
    assert_close(kv, kv_r, REFERENCE_TOL[dtype], "kv vs reference")
    assert np.array_equal(np.asarray(pe_r), np.asarray(pe))


def test_equals_slicing_then_fused(rng, cpu_impl):
    """The packed op gives what slicing and ``fused_q_kv_rmsnorm`` give, bit for bit."""
    a, wq, wkv = _packed(rng, 37, (1536, 512, 64), "bfloat16")
    q, kv, _ = kp.mla_q_kv_norm(a, wq, wkv, impl=cpu_impl)
    q2, kv2 = kp.fused_q_kv_rmsnorm(a[:, :1536], a[:, 1536:2048], wq, wkv, impl=cpu_impl)
    assert np.array_equal(np.asarray(q), np.asarray(q2))
    assert np.array_equal(np.asarray(kv), np.asarray(kv2))


def test_leading_shape(rng, cpu_impl):
    a, wq, wkv = _packed(rng, 2 * 3 * 4, (1536, 512, 64), "bfloat16")
    a = a.reshape(2, 3, 4, -1)
    q, kv, pe = kp.mla_q_kv_norm(a, wq, wkv, impl=cpu_impl)
    assert q.shape == (2, 3, 4, 1536) and kv.shape == (2, 3, 4, 512) and pe.shape == (2, 3, 4, 64)
    assert_close(q, rmsnorm64(np.asarray(a)[..., :1536], wq, 1e-6), ORACLE_TOL["bfloat16"])


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(q_size=1536, kv_size=600), ValueError, "must hold q_size"),
    (dict(q_size=0), ValueError, "q_size must be an integer >= 1"),
    (dict(kv_size=512.0), ValueError, "kv_size must be an integer"),
    (dict(eps=-1.0), ValueError, "eps"),
    (dict(impl="cuda"), ValueError, "impl must be one of"),
])
def test_bad_arguments(kwargs, err, match):
    a = jnp.zeros((4, 2112), jnp.bfloat16)
    wq, wkv = jnp.ones((1536,)), jnp.ones((512,))
    with pytest.raises(err, match=match):
        kp.mla_q_kv_norm(a, wq, wkv, **kwargs)


def test_bad_weights_and_dtype():
    a = jnp.zeros((4, 2112), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"q_weight must have shape \(1536,\)"):
        kp.mla_q_kv_norm(a, jnp.ones((512,)), jnp.ones((512,)))
    with pytest.raises(TypeError, match="floating dtype"):
        kp.mla_q_kv_norm(a.astype(jnp.int32), jnp.ones((1536,)), jnp.ones((512,)))


def test_no_gradient():
    a = jnp.ones((2, 2112))
    with pytest.raises(TypeError, match="inference-only"):
        jax.grad(lambda x: kp.mla_q_kv_norm(x, jnp.ones(1536), jnp.ones(512),
                                            impl="interpret")[0].sum())(a)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t[0])
@pytest.mark.parametrize("sizes", [(1536, 512, 64), (1536, 512, 0)])
def test_lowered_module_is_one_call_without_slices(target, sizes):
    """The lowered module for a GPU target holds one Triton call reading the packed rows and no
    slice (the reference path, and slicing before ``fused_q_kv_rmsnorm``, hold slices)."""
    dq, dkv, rope = sizes
    args = (jax.ShapeDtypeStruct((4096, dq + dkv + rope), jnp.bfloat16),
            jax.ShapeDtypeStruct((dq,), jnp.bfloat16), jax.ShapeDtypeStruct((dkv,), jnp.bfloat16))
    text = testing.lower_for(lambda *x: kp.mla_q_kv_norm(*x, impl="pallas"), args, *target).as_text()
    assert text.count(TRITON_CALL) == 1
    assert "k3pallas_mla_q_kv_norm" in text
    assert "stablehlo.slice" not in text and "dynamic_slice" not in text
    (launched,) = testing.triton_launches(text)
    # The packed norm can put q and kv on two programs (splits=(2,)), as the kernel asks.
    cfg = launch.launch_config("mla_q_kv_norm", 4096, 2048 + 512 + (64 if rope else 0),
                                 2048, platform.target_for(*target), splits=(2,))
    assert launched["num_warps"] == cfg.num_warps and launched["grid_x"] == -(-4096 // cfg.rows_per_program)
    assert launched["grid_y"] == cfg.split

    def sliced(a, wq, wkv):
        return kp.fused_q_kv_rmsnorm(a[:, :dq], a[:, dq:dq + dkv], wq, wkv, impl="pallas")
    assert "stablehlo.slice" in testing.lower_for(sliced, args, *target).as_text()
