"""Rows split over several programs (``LaunchConfig.split``): the FP8 row kernels' decode path,
two launches over row pieces (the pieces' scales, then the codes with the combined scale).

Forced in interpret mode (the heuristic splits only on a GPU) and checked against the float64
oracle, the unsplit kernel and NaN-poisoned outputs; the scale modes of the cross-device path;
the errors; the heuristic's choice; and the lowering (two Triton calls)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp
from k3pallas import fp8 as fp8_lib
from k3pallas import platform, testing
from k3pallas.kernels import gated_fp8, launch
from k3pallas.kernels.launch import LaunchConfig

from oracle import check_codes, check_scales, f64, gated64, quant_oracle, sigmoid64
from test_gated_fp8 import check_pair

FNUZ = "float8_e4m3fnuz"


def _inputs(rng, shape, nan_at=None):
    x = jnp.asarray(rng.standard_normal(shape) * 2, jnp.bfloat16)
    if nan_at is not None:
        x = x.at[nan_at].set(jnp.nan)
    return x


def _ops(rng, t, op):
    """(fn(impl) -> QuantizedActivation, float64 activation [t, N]) of one splittable op; row 1
    (if any) holds a NaN."""
    nan = t > 1
    if op == "gated":
        x, g = _inputs(rng, (t, 96, 128), (1, 50, 3) if nan else None), _inputs(rng, (t, 96, 128))
        w = jnp.asarray(rng.standard_normal(128), jnp.float32)
        fn = lambda impl, **q: kp.rmsnorm_gated_fp8_per_token(x, w, g, impl=impl, **q)  # noqa: E731
        return fn, gated64(x, w, g, 1e-5, "sigmoid").reshape(t, -1)
    x = _inputs(rng, (t, 12288), (1, 9000) if nan else None)
    if op == "sigmoid_mul":
        g = _inputs(rng, (t, 12288))
        fn = lambda impl, **q: kp.sigmoid_mul_fp8_per_token(x, g, impl=impl, **q)  # noqa: E731
        return fn, f64(x) * sigmoid64(f64(g))
    fn = lambda impl, **q: kp.per_token_fp8_quant(x, impl=impl, **q)  # noqa: E731
    return fn, f64(x)


@pytest.mark.parametrize("op,split,rows,name", [
    ("gated", 8, 1, "float8_e4m3fn"), ("gated", 2, 4, FNUZ), ("gated", 4, 2, "float8_e5m2"),
    ("sigmoid_mul", 8, 1, "float8_e4m3fn"), ("sigmoid_mul", 2, 16, FNUZ),
    ("per_token", 4, 1, "float8_e4m3fn")])
def test_split_matches_oracle_and_unsplit(rng, op, split, rows, name):
    t = 3
    fn, y64 = _ops(rng, t, op)
    whole = fn("interpret", fp8_dtype=jnp.dtype(name))
    with launch.forced(LaunchConfig(rows, 4, 1, split)), testing.poisoned_outputs():
        with launch.recording() as log:
            out = fn("interpret", fp8_dtype=jnp.dtype(name))
    assert [entry.config.split for entry in log] == [split]
    assert out.data.shape == (t, y64.shape[1]) and out.scale.shape == (t, 1)
    scale64, v = quant_oracle(y64, name)
    assert np.isnan(scale64[1]) and not np.isnan(np.delete(scale64, 1)).any()
    check_scales(out.scale, scale64, 1e-6, "split scale vs oracle")
    check_codes(out.data, v, name, what="split codes vs oracle")
    # Against the one-launch kernel: the pieces' norms may round differently in the last bit.
    check_scales(out.scale, f64(whole.scale).reshape(-1), 4e-7, "split vs whole scale")
    check_pair(out.data, whole.data, v, name, "split vs whole codes")


@pytest.mark.parametrize("kernel", ["gated", "per_token"])
def test_split_scale_modes(rng, kernel):
    """The cross-device launches with split rows: "scale_only" is the rows' scale, "given_scale"
    quantizes with the scale given, as without the split."""
    q = fp8_lib.resolve_fp8_params("float8_e4m3fn")
    x = _inputs(rng, (5, 16, 64), (2, 9, 1))
    if kernel == "gated":
        g = _inputs(rng, (5, 16, 64))
        w = jnp.asarray(rng.standard_normal(64), jnp.float32)
        rows = functools.partial(gated_fp8.rmsnorm_gated_rows, x, g, w, eps=1e-5,
                                 activation="sigmoid", quant=q, interpret=True)
    else:
        rows = functools.partial(gated_fp8.per_token_fp8_rows, x.reshape(5, -1), quant=q,
                                 interpret=True)
    codes, scale = rows()
    split = functools.partial(rows, config=LaunchConfig(2, 4, 1, 4))
    with testing.poisoned_outputs():
        _, scale_only = split(mode="scale_only")
        given, none = split(mode="given_scale", scale=scale)
        big, _ = split(mode="given_scale", scale=scale * 2)
    assert none is None
    check_scales(scale_only, f64(scale), 4e-7, "split scale_only")
    assert np.isnan(np.asarray(scale_only)[2]) and np.isnan(np.asarray(given, np.float32)[2]).all()
    keep = np.arange(5) != 2
    assert np.array_equal(np.asarray(given).view(np.uint8)[keep], np.asarray(codes).view(np.uint8)[keep])
    assert np.abs(np.asarray(big, np.float64)[keep]).max() <= 224.5


def test_split_errors(rng):
    x, g = _inputs(rng, (2, 12, 64)), _inputs(rng, (2, 12, 64))
    w = jnp.ones(64, jnp.float32)
    with launch.forced(LaunchConfig(1, 4, 1, 8)):  # 12 heads are not 8 pieces
        with pytest.raises(ValueError, match="cannot do for this row shape"):
            kp.rmsnorm_gated_fp8_per_token(x, w, g, impl="interpret")
    with launch.forced(LaunchConfig(1, 4, 1, 2)):  # a kernel without split
        with pytest.raises(ValueError, match="cannot do for this row shape"):
            kp.rmsnorm(x, w, impl="interpret")
    with pytest.raises(ValueError, match="power of two"):
        LaunchConfig(1, 4, 1, 3)


def _pieces(heads, width=128):
    """``pieces`` of the gated FP8 kernel for ``heads x width`` rows."""
    return lambda s: None if heads % s else gated_fp8.gated_row_elems(heads // s, width)


def test_heuristic_splits_only_few_large_rows():
    h200 = platform.target_for("NVIDIA H200", "cuda")
    gfx = platform.target_for("gfx942", "rocm")
    cpu = platform.current_target() if not platform.current_target().is_gpu else None
    big = gated_fp8.gated_row_elems(96, 128)
    for target in (h200, gfx):
        small_t = launch.heuristic_config("rmsnorm_gated_fp8_per_token", 1, *big, target, _pieces(96))
        assert small_t.split > 1 and 96 % small_t.split == 0
        large_t = launch.heuristic_config("rmsnorm_gated_fp8_per_token", 4096, *big, target, _pieces(96))
        assert large_t.split == 1
        narrow = gated_fp8.gated_row_elems(12, 128)
        assert launch.heuristic_config("rmsnorm_gated_fp8_per_token", 1, *narrow, target,
                                       _pieces(12)).split == 1
        assert launch.heuristic_config("rmsnorm_gated_fp8_per_token", 1, *big, target).split == 1
    if cpu is not None:  # interpret mode keeps one fixed launch
        assert launch.heuristic_config("rmsnorm_gated_fp8_per_token", 1, *big, cpu, _pieces(96)).split == 1


@pytest.mark.parametrize("target", list(testing.KNOWN_TARGETS.values()), ids=lambda t: t[0])
def test_split_lowers_to_two_launches(target):
    kind, plat = target
    args = (jax.ShapeDtypeStruct((1, 96, 128), jnp.bfloat16), jax.ShapeDtypeStruct((128,), jnp.float32),
            jax.ShapeDtypeStruct((1, 96, 128), jnp.bfloat16))

    def fn(x, w, g):
        with launch.forced(LaunchConfig(1, 4, 1, 8)):
            return kp.rmsnorm_gated_fp8_per_token(x, w, g, impl="pallas")

    text = testing.lower_for(fn, args, kind, plat).as_text()
    names = [entry["name"] for entry in testing.triton_launches(text)]
    assert names == ["k3pallas_rmsnorm_gated_fp8_per_token_scale_only",
                     "k3pallas_rmsnorm_gated_fp8_per_token_partial_scales"], names


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gated", "sigmoid_mul", "per_token"])
@pytest.mark.parametrize("split", [2, 8])
def test_split_compiled(rng, op, split):
    """The compiled split launches on the GPU: the float64 oracle, poisoned outputs, and the
    heuristic's own choice at T = 1 (which splits the 96-head rows)."""
    name = "float8_e4m3fn" if platform.current_target().backend == "cuda" else FNUZ
    for t in (1, 64):
        fn, y64 = _ops(rng, t, op)
        scale64, v = quant_oracle(y64, name)
        with launch.forced(LaunchConfig(1, 4, 1, split)), testing.poisoned_outputs():
            out = fn("pallas", fp8_dtype=jnp.dtype(name))
        check_scales(out.scale, scale64, 1e-6, f"T={t} compiled split scale vs oracle")
        check_codes(out.data, v, name, what=f"T={t} compiled split codes vs oracle")
        with testing.poisoned_outputs():
            auto = fn("pallas", fp8_dtype=jnp.dtype(name))
        check_scales(auto.scale, scale64, 1e-6, f"T={t} heuristic scale vs oracle")
        check_codes(auto.data, v, name, what=f"T={t} heuristic codes vs oracle")



@pytest.mark.parametrize("op", ["fused_q_kv_rmsnorm", "fused_q_kv_rmsnorm_fp8", "mla_q_kv_norm",
                                "mla_q_kv_norm_fp8"])
@pytest.mark.parametrize("rows", [1, 4])
def test_norm_segments_on_two_programs(rng, op, rows):
    """split = 2 for the joint norms: q on one program of a row block, kv (and the rope
    columns) on another, in the same launch; the same results as one program, bit for bit."""
    from k3pallas import ops as k3ops

    spec = k3ops.OPS[op]
    structs, options = spec.example(5, jnp.dtype(jnp.bfloat16), **spec.sizes["test"])
    args = [jnp.asarray(rng.standard_normal(s.shape), s.dtype) for s in structs]
    whole = spec.fn(*args, impl="interpret", **options)
    with launch.forced(LaunchConfig(rows, 4, 1, 2)), testing.poisoned_outputs():
        split = spec.fn(*args, impl="interpret", **options)
    for a, b in zip(jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(split)):
        assert a.shape == b.shape
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    with launch.forced(LaunchConfig(rows, 4, 1, 4)):
        with pytest.raises(ValueError, match="cannot do for this row shape"):
            spec.fn(*args, impl="interpret", **options)


@pytest.mark.parametrize("target", list(testing.KNOWN_TARGETS.values()), ids=lambda t: t[0])
def test_norm_split_lowers_to_one_launch_of_two_programs(target):
    kind, plat = target
    args = (jax.ShapeDtypeStruct((1, 1536), jnp.bfloat16), jax.ShapeDtypeStruct((1, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct((1536,), jnp.bfloat16), jax.ShapeDtypeStruct((512,), jnp.bfloat16))

    def fn(q, kv, wq, wkv):
        with launch.forced(LaunchConfig(1, 4, 1, 2)):
            return kp.fused_q_kv_rmsnorm(q, kv, wq, wkv, impl="pallas")

    (call,) = testing.triton_launches(testing.lower_for(fn, args, kind, plat).as_text())
    assert (call["grid_x"], call["grid_y"]) == (1, 2), call
