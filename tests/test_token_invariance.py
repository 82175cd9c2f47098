"""A token's result does not depend on how many tokens are in the call (or on how tokens are
sharded over devices, which changes the local count): the same rows at T = 1, 7, 16, 33 and 130,
at the model sizes. Bit for bit for the kernels in interpret mode (fixed rows per program). The
jnp reference is XLA's code: its CPU reductions vectorize by shape, so another token count can
round a float32 sum's last bit differently (seen in CI on one machine: one FP8 code of 1536 one
step apart); it is held to that: norms within one output ulp, FP8 scales within 4 float32 ulp,
codes within one step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp

TOKENS = (1, 7, 16, 33, 130)
IMPLS = ["interpret", "reference"]


def _close(a, b):
    """Equal up to the last-bit rounding of a float32 reduction (the reference's allowance)."""
    if jnp.dtype(a.dtype).itemsize == 1:  # fp8 codes: at most one step apart, same sign
        ia = a.view(np.uint8).astype(np.int32)
        ib = b.view(np.uint8).astype(np.int32)
        return bool(np.all(((ia ^ ib) & 0x80) == 0) and np.all(np.abs(ia - ib) <= 1))
    fa, fb = a.astype(np.float64), b.astype(np.float64)
    ulp = np.spacing(np.abs(fb).astype(a.dtype)).astype(np.float64)
    tol = ulp * (4 if a.dtype == np.float32 else 1)
    return bool(np.all((np.abs(fa - fb) <= tol) | (np.isnan(fa) & np.isnan(fb))))


def _check(fn, rows, impl, n_first=1):
    """``fn(T)`` on the first T rows: its first ``n_first`` rows equal across TOKENS (bit for bit
    in interpret mode; ``_close`` for the reference)."""
    base = [np.asarray(a)[:n_first] for a in jax.tree_util.tree_leaves(fn(TOKENS[0]))]
    for t in TOKENS[1:]:
        for a, b in zip(base, [np.asarray(a)[:n_first] for a in jax.tree_util.tree_leaves(fn(t))]):
            if impl == "interpret":
                assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), \
                    f"T={t} changes the first rows' bits"
            else:
                assert _close(b, a), f"T={t} changes the first rows by more than rounding"


@pytest.mark.parametrize("impl", IMPLS)
def test_norms_do_not_depend_on_the_token_count(rng, impl):
    t = TOKENS[-1]
    q = jnp.asarray(rng.standard_normal((t, 1536)) * 2, jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((t, 512)) * 2, jnp.bfloat16)
    packed = jnp.asarray(rng.standard_normal((t, 2112)) * 2, jnp.bfloat16)
    wq = jnp.asarray(rng.uniform(0.5, 2, 1536), jnp.bfloat16)
    wkv = jnp.asarray(rng.uniform(0.5, 2, 512), jnp.bfloat16)
    fused = jax.jit(lambda a, b: kp.fused_q_kv_rmsnorm(a, b, wq, wkv, impl=impl))
    _check(lambda n: fused(q[:n], kv[:n]), t, impl)
    mla = jax.jit(lambda a: kp.mla_q_kv_norm(a, wq, wkv, impl=impl))
    _check(lambda n: mla(packed[:n]), t, impl)
    norm = jax.jit(lambda a: kp.rmsnorm(a, wq, impl=impl))
    _check(lambda n: norm(q[:n]), t, impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("heads", [12, 32, 96])
def test_gated_ops_do_not_depend_on_the_token_count(rng, impl, heads):
    t = TOKENS[-1]
    x = jnp.asarray(rng.standard_normal((t, heads, 128)) * 2, jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((t, heads, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.5, 2, 128), jnp.float32)
    gated = jax.jit(lambda a, b: kp.rmsnorm_gated(a, w, b, impl=impl))
    _check(lambda n: gated(x[:n], g[:n]), t, impl)
    fp8 = jax.jit(lambda a, b: kp.rmsnorm_gated_fp8_per_token(a, w, b, impl=impl))
    _check(lambda n: fp8(x[:n], g[:n]), t, impl)
    quant = jax.jit(lambda a: kp.per_token_fp8_quant(a, impl=impl))
    _check(lambda n: quant(x[:n].reshape(n, -1)), t, impl)
