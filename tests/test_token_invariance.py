"""A token's result does not depend on how many tokens are in the call (or on how tokens are
sharded over devices, which changes the local count): the same rows at T = 1, 7, 16, 33 and 130,
bit for bit, at the model sizes, for the kernels in interpret mode and for the jnp reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp

TOKENS = (1, 7, 16, 33, 130)
IMPLS = ["interpret", "reference"]


def _bits(tree, n):
    return [np.asarray(a)[:n].view(np.uint8) for a in jax.tree_util.tree_leaves(tree)]


def _check(fn, rows, n_first=1):
    """``fn(T)`` on the first T rows: its first ``n_first`` rows equal across TOKENS."""
    base = _bits(fn(TOKENS[0]), n_first)
    for t in TOKENS[1:]:
        for a, b in zip(base, _bits(fn(t), n_first)):
            assert np.array_equal(a, b), f"T={t} changes the first rows' bits"


@pytest.mark.parametrize("impl", IMPLS)
def test_norms_do_not_depend_on_the_token_count(rng, impl):
    t = TOKENS[-1]
    q = jnp.asarray(rng.standard_normal((t, 1536)) * 2, jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((t, 512)) * 2, jnp.bfloat16)
    packed = jnp.asarray(rng.standard_normal((t, 2112)) * 2, jnp.bfloat16)
    wq = jnp.asarray(rng.uniform(0.5, 2, 1536), jnp.bfloat16)
    wkv = jnp.asarray(rng.uniform(0.5, 2, 512), jnp.bfloat16)
    fused = jax.jit(lambda a, b: kp.fused_q_kv_rmsnorm(a, b, wq, wkv, impl=impl))
    _check(lambda n: fused(q[:n], kv[:n]), t)
    mla = jax.jit(lambda a: kp.mla_q_kv_norm(a, wq, wkv, impl=impl))
    _check(lambda n: mla(packed[:n]), t)
    norm = jax.jit(lambda a: kp.rmsnorm(a, wq, impl=impl))
    _check(lambda n: norm(q[:n]), t)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("heads", [12, 32, 96])
def test_gated_ops_do_not_depend_on_the_token_count(rng, impl, heads):
    t = TOKENS[-1]
    x = jnp.asarray(rng.standard_normal((t, heads, 128)) * 2, jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((t, heads, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.5, 2, 128), jnp.float32)
    gated = jax.jit(lambda a, b: kp.rmsnorm_gated(a, w, b, impl=impl))
    _check(lambda n: gated(x[:n], g[:n]), t)
    fp8 = jax.jit(lambda a, b: kp.rmsnorm_gated_fp8_per_token(a, w, b, impl=impl))
    _check(lambda n: fp8(x[:n], g[:n]), t)
    quant = jax.jit(lambda a: kp.per_token_fp8_quant(a, impl=impl))
    _check(lambda n: quant(x[:n].reshape(n, -1)), t)
