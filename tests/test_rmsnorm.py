"""Joint q/kv RMSNorm and RMSNorm: the kernel (interpret mode on the CPU) against a float64 NumPy
oracle and against the jnp reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp
from k3pallas import testing

from support import ORACLE_TOL, REFERENCE_TOL, assert_close, rmsnorm64

DTYPES = ["bfloat16", "float16", "float32"]
OTHER_WEIGHT_DTYPE = {"bfloat16": "float32", "float16": "bfloat16", "float32": "bfloat16"}


def _inputs(rng, t, dq, dkv, dtype, wdtype):
    q = jnp.asarray(rng.standard_normal((t, dq)) * 3.0, dtype)
    kv = jnp.asarray(rng.standard_normal((t, dkv)) * 0.5, dtype)
    wq = jnp.asarray(rng.uniform(0.5, 1.5, dq), wdtype)
    wkv = jnp.asarray(rng.uniform(-1.5, 1.5, dkv), wdtype)
    return q, kv, wq, wkv


# T in {0, 1, 7, 64, 512, 4096} x widths {(1536, 512), (1000, 72), (512, 3000)} x dtypes, weights of
# another dtype than x. The largest T runs on the MLA widths only (interpret mode is slow there).
CASES = [(t, (1536, 512), d) for t in (0, 1, 7, 64, 512, 4096) for d in DTYPES]
CASES += [(t, w, d) for t in (1, 7, 64, 512) for w in ((1000, 72), (512, 3000)) for d in DTYPES]


@pytest.mark.parametrize("t,widths,dtype", CASES)
def test_fused_q_kv_parity(rng, cpu_impl, t, widths, dtype):
    dq, dkv = widths
    q, kv, wq, wkv = _inputs(rng, t, dq, dkv, dtype, OTHER_WEIGHT_DTYPE[dtype])
    eps, kv_eps = 1e-6, 1e-5
    with testing.poisoned_outputs():
        fn = jax.jit(lambda *a: kp.fused_q_kv_rmsnorm(*a, eps, kv_eps=kv_eps, impl=cpu_impl))
        q_out, kv_out = fn(q, kv, wq, wkv)
    assert q_out.dtype == q.dtype and kv_out.dtype == kv.dtype
    assert q_out.shape == q.shape and kv_out.shape == kv.shape
    tol = ORACLE_TOL[dtype]
    assert_close(q_out, rmsnorm64(q, wq, eps), tol, "q vs oracle")
    assert_close(kv_out, rmsnorm64(kv, wkv, kv_eps), tol, "kv vs oracle")
    q_ref, kv_ref = kp.fused_q_kv_rmsnorm(q, kv, wq, wkv, eps, kv_eps=kv_eps, impl="reference")
    assert_close(q_out, q_ref, REFERENCE_TOL[dtype], "q vs reference")
    assert_close(kv_out, kv_ref, REFERENCE_TOL[dtype], "kv vs reference")


@pytest.mark.parametrize("t,width,dtype", [(1, 1536, "bfloat16"), (7, 512, "float16"),
                                           (64, 1000, "float32"), (513, 72, "bfloat16"),
                                           (130, 3000, "float32"), (3, 1, "float32")])
def test_rmsnorm_parity(rng, cpu_impl, t, width, dtype):
    x = jnp.asarray(rng.standard_normal((t, width)), dtype)
    w = jnp.asarray(rng.uniform(-2, 2, width), OTHER_WEIGHT_DTYPE[dtype])
    with testing.poisoned_outputs():
        y = jax.jit(lambda a, b: kp.rmsnorm(a, b, 1e-6, impl=cpu_impl))(x, w)
    assert y.dtype == x.dtype
    assert_close(y, rmsnorm64(x, w, 1e-6), ORACLE_TOL[dtype], "vs oracle")
    assert_close(y, kp.rmsnorm(x, w, 1e-6, impl="reference"), REFERENCE_TOL[dtype], "vs reference")


def test_leading_shapes_and_mixed_dtypes(rng, cpu_impl):
    """Any leading shape is flattened to rows; q and kv may have different dtypes."""
    q = jnp.asarray(rng.standard_normal((2, 3, 5, 1536)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((2, 3, 5, 512)), jnp.float32)
    wq = jnp.asarray(rng.standard_normal(1536), jnp.float32)
    wkv = jnp.asarray(rng.standard_normal(512), jnp.bfloat16)
    q_out, kv_out = kp.fused_q_kv_rmsnorm(q, kv, wq, wkv, impl=cpu_impl)
    assert q_out.shape == q.shape and q_out.dtype == jnp.bfloat16
    assert kv_out.shape == kv.shape and kv_out.dtype == jnp.float32
    assert_close(q_out, rmsnorm64(q, wq, 1e-6), ORACLE_TOL["bfloat16"])
    assert_close(kv_out, rmsnorm64(kv, wkv, 1e-6), ORACLE_TOL["float32"])


def test_scale_invariance_extremes(rng, cpu_impl):
    """Rows of very different magnitudes in one block; a zero row gives zeros (eps keeps it
    finite)."""
    x = rng.standard_normal((8, 512)) * np.array([1e-3, 1, 1e3, 1e4, 0, 1e-2, 1e2, 5])[:, None]
    x = jnp.asarray(x, jnp.float32)
    w = jnp.asarray(rng.standard_normal(512), jnp.float32)
    y = kp.rmsnorm(x, w, 1e-6, impl=cpu_impl)
    assert_close(y, rmsnorm64(x, w, 1e-6), ORACLE_TOL["float32"])
    assert np.all(np.asarray(y)[4] == 0)


@pytest.mark.parametrize("rows,warps", [(1, 1), (2, 4), (4, 8), (16, 2)])
def test_launch_configs_partial_blocks(rng, rows, warps):
    """Every rows-per-program value, with a partial last block (37 rows), gives the same result."""
    from k3pallas.kernels import rmsnorm as kernels
    from k3pallas.kernels.launch import LaunchConfig

    q = jnp.asarray(rng.standard_normal((37, 1000)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((37, 72)), jnp.bfloat16)
    wq = jnp.asarray(rng.standard_normal(1000), jnp.float32)
    wkv = jnp.asarray(rng.standard_normal(72), jnp.float32)
    with testing.poisoned_outputs():
        q_out, kv_out = kernels.rmsnorm_rows([q, kv], [wq, wkv], [1e-6, 1e-6], op="fused_q_kv_rmsnorm",
                                             interpret=True, config=LaunchConfig(rows, warps))
    assert_close(q_out, rmsnorm64(q, wq, 1e-6), ORACLE_TOL["bfloat16"])
    assert_close(kv_out, rmsnorm64(kv, wkv, 1e-6), ORACLE_TOL["bfloat16"])
