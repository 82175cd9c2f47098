"""Two programs per row block (``LaunchConfig.split = 2``) for the joint norms: q on one
program, kv (and the rope columns) on another, in one launch. Forced in interpret mode (only the
tuned table picks it) and checked bit for bit against one program per row block, with
NaN-poisoned outputs; the errors; the tuned table's lookup; the lowering (one launch, grid
(blocks, 2))."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp
from k3pallas import ops as op_table
from k3pallas import platform, testing
from k3pallas.kernels import hooks, launch
from k3pallas.kernels.launch import LaunchConfig


@pytest.mark.parametrize("op", ["fused_q_kv_rmsnorm", "fused_q_kv_rmsnorm_fp8", "mla_q_kv_norm",
                                "mla_q_kv_norm_fp8"])
@pytest.mark.parametrize("rows", [1, 4])
def test_norm_segments_on_two_programs(rng, op, rows):
    """split = 2 for the joint norms: q on one program of a row block, kv (and the rope
    columns) on another, in the same launch; the same results as one program, bit for bit."""
    from bench import cases as k3ops

    spec = k3ops.OPS[op]
    structs, options = spec.example(5, jnp.dtype(jnp.bfloat16), **spec.sizes["test"])
    args = [jnp.asarray(rng.standard_normal(s.shape), s.dtype) for s in structs]
    whole = spec.fn(*args, impl="interpret", **options)
    with hooks.forced(LaunchConfig(rows, 4, 1, 2)), testing.poisoned_outputs():
        split = spec.fn(*args, impl="interpret", **options)
    for a, b in zip(jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(split)):
        assert a.shape == b.shape
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    with hooks.forced(LaunchConfig(rows, 4, 1, 4)):
        with pytest.raises(ValueError, match="cannot do for this row shape"):
            spec.fn(*args, impl="interpret", **options)


@pytest.mark.parametrize("target", list(testing.KNOWN_TARGETS.values()), ids=lambda t: t[0])
def test_norm_split_lowers_to_one_launch_of_two_programs(target):
    kind, plat = target
    args = (jax.ShapeDtypeStruct((1, 1536), jnp.bfloat16), jax.ShapeDtypeStruct((1, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct((1536,), jnp.bfloat16), jax.ShapeDtypeStruct((512,), jnp.bfloat16))

    def fn(q, kv, wq, wkv):
        with hooks.forced(LaunchConfig(1, 4, 1, 2)):
            return kp.fused_q_kv_rmsnorm(q, kv, wq, wkv, impl="pallas")

    (call,) = testing.triton_launches(testing.lower_for(fn, args, kind, plat).as_text())
    assert (call["grid_x"], call["grid_y"]) == (1, 2), call


def test_split_errors(rng):
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.bfloat16)
    w = jnp.ones(64, jnp.float32)
    with hooks.forced(LaunchConfig(1, 4, 1, 2)):  # one segment: nothing to put on two programs
        with pytest.raises(ValueError, match="cannot do for this row shape"):
            kp.rmsnorm(x, w, impl="interpret")
        with pytest.raises(ValueError, match="cannot do for this row shape"):  # the FP8 row kernels
            kp.per_token_fp8_quant(x, impl="interpret")
    from k3pallas import fp8 as fp8_lib
    from k3pallas.kernels import gated_fp8

    g3 = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.bfloat16)
    with pytest.raises(ValueError, match="cannot do for this row shape"):  # a config passed in
        gated_fp8.rmsnorm_gated_rows(g3, g3, w, eps=1e-5, activation="sigmoid",
                                     op=op_table.RMSNORM_GATED_FP8_PER_TOKEN.name, fp8=fp8_lib.resolve_fp8_params("float8_e4m3fn"),
                                     interpret=True, config=LaunchConfig(1, 4, 1, 2))
    with pytest.raises(ValueError, match="power of two"):
        LaunchConfig(1, 4, 1, 3)


def test_tuned_split_entries(monkeypatch):
    """A tuned entry with split 2 applies to the joint norms; a kernel that cannot split skips
    it for the next entry (or the heuristic)."""
    table = {"sm_90": {"fused_q_kv_rmsnorm": [[8, 2560, 1, 2, 1, 2], [2**31, 2560, 1, 1, 1]],
                       "rmsnorm": [[8, 2048, 1, 2, 1, 2], [2**31, 2048, 1, 8, 1]]}}
    monkeypatch.setattr(launch, "tuned_table", lambda: table)
    h200 = platform.target_for("NVIDIA H200", "cuda")
    assert launch.launch_config("fused_q_kv_rmsnorm", 1, 2560, 2048, h200, splits=(2,)) == \
        LaunchConfig(1, 2, 1, 2)
    assert launch.launch_config("fused_q_kv_rmsnorm", 64, 2560, 2048, h200, splits=(2,)) == \
        LaunchConfig(1, 1, 1)
    assert launch.launch_config("rmsnorm", 1, 2048, 2048, h200) == LaunchConfig(1, 8, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["fused_q_kv_rmsnorm", "fused_q_kv_rmsnorm_fp8", "mla_q_kv_norm",
                                "mla_q_kv_norm_fp8"])
@pytest.mark.parametrize("t", [1, 7, 255, 4096])
@pytest.mark.parametrize("rows, warps", [(1, 2), (2, 4)])
def test_norm_split_compiled(rng, op, t, rows, warps):
    """Compiled: the two-program launch equals the one-program launch of the same rows and warps
    bit for bit (each segment runs the same code), with poisoned outputs; two rows per program
    (the decode entries) with a partial last block at T = 255."""
    from bench import cases as k3ops

    spec = k3ops.OPS[op]
    structs, options = spec.example(t, jnp.dtype(jnp.bfloat16), **spec.sizes["deepseek-v3-mla"])
    args = [jnp.asarray(rng.standard_normal(s.shape), s.dtype) for s in structs]
    outs = []
    for split in (1, 2):
        with hooks.forced(LaunchConfig(rows, warps, 1, split)), testing.poisoned_outputs():
            outs.append(jax.jit(lambda *a: spec.fn(*a, impl="pallas", **options))(*args))
    for a, b in zip(*(jax.tree_util.tree_leaves(o) for o in outs)):
        assert not np.isnan(np.asarray(b, np.float32)).any()
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
