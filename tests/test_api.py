"""The public API's contract: argument errors, impl selection, jit / vmap, zero rows, any leading
shape, and the inference-only gradient error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp
from bench import cases as k3ops
from k3pallas import testing

from support import ORACLE_TOL, assert_close, gated64, rmsnorm64


def _qkv(rng, lead=(4,), dq=64, dkv=16, dtype=jnp.float32):
    return (jnp.asarray(rng.standard_normal(lead + (dq,)), dtype),
            jnp.asarray(rng.standard_normal(lead + (dkv,)), dtype),
            jnp.asarray(rng.standard_normal(dq), jnp.float32),
            jnp.asarray(rng.standard_normal(dkv), jnp.float32))


def _gated(rng, lead=(4,), h=3, d=32):
    return (jnp.asarray(rng.standard_normal(lead + (h, d)), jnp.float32),
            jnp.asarray(rng.standard_normal(d), jnp.float32),
            jnp.asarray(rng.standard_normal(lead + (h, d)), jnp.float32))


# Every op of the op table called with good arguments (its "test" sizes), for the generic tests
# below: a new op gets them without an edit here.
def all_ops(rng):
    out = {}
    for name, spec in k3ops.OPS.items():
        structs, options = spec.example(4, jnp.dtype(jnp.float32), **spec.sizes["test"])
        args = tuple(jnp.asarray(rng.standard_normal(s.shape), s.dtype) for s in structs)
        out[name] = (lambda *a, _f=spec.fn, _o=options, **kw: _f(*a, **_o, **kw), args)
    return out


OPS = list(k3ops.OPS)
IMPLS = ["interpret", "reference"]


def _first_float(out):
    return jax.tree_util.tree_leaves(out)[0]


# ---------------------------------------------------------------------------------------------
# impl
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_unknown_impl(rng, op):
    fn, args = all_ops(rng)[op]
    with pytest.raises(ValueError, match="impl must be one of"):
        fn(*args, impl="triton")


@pytest.mark.parametrize("op", OPS)
def test_pallas_without_gpu_is_an_error_not_a_fallback(rng, op):
    if kp.current_target().is_gpu:
        pytest.skip("this machine has a GPU target")
    fn, args = all_ops(rng)[op]
    with pytest.raises(RuntimeError, match="needs a GPU target"):
        fn(*args, impl="pallas")


def test_auto_is_reference_on_cpu(rng):
    if kp.current_target().is_gpu:
        pytest.skip("this machine has a GPU target")
    q, kv, wq, wkv = _qkv(rng)
    text = jax.jit(lambda *a: kp.fused_q_kv_rmsnorm(*a)).lower(q, kv, wq, wkv).as_text()
    assert "pallas" not in text and "triton" not in text


# ---------------------------------------------------------------------------------------------
# Bad input: each error names the argument
# ---------------------------------------------------------------------------------------------


def test_fused_bad_inputs(rng):
    q, kv, wq, wkv = _qkv(rng)
    f = kp.fused_q_kv_rmsnorm
    with pytest.raises(ValueError, match=r"q_c and kv_c must have the same leading dims.*\(4, 64\).*\(3, 16\)"):
        f(q, kv[:3], wq, wkv)
    with pytest.raises(ValueError, match=r"q_weight must have shape \(64,\).*\(63,\)"):
        f(q, kv, wq[:63], wkv)
    with pytest.raises(ValueError, match=r"kv_weight must have shape \(16,\)"):
        f(q, kv, wq, wq)
    with pytest.raises(ValueError, match="kv_weight must have shape"):
        f(q, kv, wq, wkv[None])
    with pytest.raises(TypeError, match="q_c must have a floating dtype.*int32"):
        f(q.astype(jnp.int32), kv, wq, wkv)
    with pytest.raises(TypeError, match="kv_weight must have a floating dtype.*bool"):
        f(q, kv, wq, wkv > 0)
    with pytest.raises(TypeError, match="q_c must have a floating dtype.*float8_e4m3fn"):
        f(q.astype(jnp.float8_e4m3fn), kv, wq, wkv)
    with pytest.raises(ValueError, match="q_c must have rank >= 1"):
        f(q[0, 0], kv, wq, wkv)
    with pytest.raises(TypeError, match="q_c must be an array"):
        f([[1.0]], kv, wq, wkv)
    for bad in (0.0, -1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps must be finite and > 0"):
            f(q, kv, wq, wkv, bad)
    with pytest.raises(ValueError, match="kv_eps must be finite and > 0"):
        f(q, kv, wq, wkv, kv_eps=0.0)
    with pytest.raises(TypeError, match="eps must be a Python float"):
        f(q, kv, wq, wkv, "1e-6")
    with pytest.raises(TypeError, match="eps must be a Python float"):
        jax.jit(lambda e: f(q, kv, wq, wkv, e))(1e-6)  # a traced eps is not static
    with pytest.raises(ValueError, match="non-empty trailing dims"):
        f(q[:, :0], kv, wq[:0], wkv)


def test_rmsnorm_bad_inputs(rng):
    q, _, wq, _ = _qkv(rng)
    with pytest.raises(ValueError, match=r"weight must have shape \(64,\)"):
        kp.rmsnorm(q, wq[:10])
    with pytest.raises(ValueError, match="x must have rank >= 1"):
        kp.rmsnorm(jnp.float32(1.0), wq)
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        kp.rmsnorm(q.astype(jnp.int8), wq)
    with pytest.raises(ValueError, match="eps must be finite"):
        kp.rmsnorm(q, wq, -1.0)


def test_gated_bad_inputs(rng):
    x, w, g = _gated(rng)
    for f in (kp.rmsnorm_gated, kp.rmsnorm_gated_fp8_per_token):
        with pytest.raises(ValueError, match=r"gate must have the shape of x.*\(4, 3, 31\).*\(4, 3, 32\)"):
            f(x, w, g[..., :31])
        with pytest.raises(ValueError, match=r"weight must have shape \(32,\)"):
            f(x, w[:8], g)
        with pytest.raises(ValueError, match="x must have rank >= 2"):
            f(x[0, 0], w, g[0, 0])
        with pytest.raises(TypeError, match="gate must have a floating dtype.*int32"):
            f(x, w, g.astype(jnp.int32))
        with pytest.raises(ValueError, match="activation must be one of"):
            f(x, w, g, activation="relu")
        with pytest.raises(ValueError, match="eps must be finite"):
            f(x, w, g, float("nan"))
        with pytest.raises(ValueError, match="non-empty trailing dims"):
            f(x[:, :0], w, g[:, :0])


@pytest.mark.parametrize("op", [name for name, spec in k3ops.OPS.items() if spec.fp8])
def test_fp8_option_errors(rng, op):
    fn, args = all_ops(rng)[op]
    with pytest.raises(TypeError, match="fp8_dtype must be one of"):
        fn(*args, fp8_dtype=jnp.int8)
    with pytest.raises(TypeError, match="fp8_dtype must be one of"):
        fn(*args, fp8_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"fp8_max=300.0 exceeds the largest finite float8_e4m3fnuz value 240"):
        fn(*args, fp8_dtype=jnp.float8_e4m3fnuz, fp8_max=300.0)
    with pytest.raises(ValueError, match="exceeds the largest finite float8_e4m3fn value 448"):
        fn(*args, fp8_dtype=jnp.float8_e4m3fn, fp8_max=449.0)
    for name in ("fp8_max", "min_scale", "scale_ub"):
        with pytest.raises(ValueError, match=f"{name} must be finite and > 0"):
            fn(*args, **{name: 0.0})
        with pytest.raises(ValueError, match=f"{name} must be finite and > 0"):
            fn(*args, **{name: float("inf")})
        with pytest.raises(TypeError, match=f"{name} must be a Python float"):
            fn(*args, **{name: jnp.float32(1.0)})
    with pytest.raises(ValueError, match=f"{op}: impl must be one of"):
        fn(*args, impl="cuda")


def test_fp8_defaults():
    assert kp.FP8_E4M3FN_MAX == 448.0 and kp.FP8_E4M3FNUZ_MAX == 224.0
    assert kp.FP8_E4M3FNUZ_MAX_AITER == 240.0 and kp.FP8_E5M2_MAX == 57344.0
    from k3pallas import fp8, platform

    cases = {("gfx942", "rocm"): jnp.float8_e4m3fnuz, ("AMD Instinct MI300X", "rocm"): jnp.float8_e4m3fnuz,
             ("AMD Instinct MI325X", "rocm"): jnp.float8_e4m3fnuz, ("gfx950", "rocm"): jnp.float8_e4m3fn,
             ("AMD Instinct MI355X", "rocm"): jnp.float8_e4m3fn, ("NVIDIA H200", "cuda"): jnp.float8_e4m3fn,
             ("cpu", "cpu"): jnp.float8_e4m3fn}
    for (kind, plat), want in cases.items():
        assert kp.default_fp8_dtype(platform.target_for(kind, plat)) == jnp.dtype(want), kind
    p = fp8.resolve_fp8_params(jnp.float8_e4m3fnuz, target=platform.target_for("gfx942", "rocm"))
    assert p.fp8_max == 224.0 and p.min_scale == 1.0 / (224.0 * 512) and p.scale_ub is None
    assert p.cast is None  # None: $K3PALLAS_FP8_CAST or "auto", read when a kernel is built
    p = fp8.resolve_fp8_params(target=platform.target_for("gfx942", "rocm"))
    assert p.dtype == jnp.float8_e4m3fnuz
    here = kp.current_target()  # this run's device: e4m3fnuz only on AMD gfx94x
    fnuz_here = here.backend == "rocm" and here.arch.startswith("gfx94")
    assert kp.default_fp8_dtype() == jnp.dtype(jnp.float8_e4m3fnuz if fnuz_here else jnp.float8_e4m3fn)
    for name, want in (("gfx942", jnp.float8_e4m3fnuz), ("MI325X", jnp.float8_e4m3fnuz),
                       ("gfx950", jnp.float8_e4m3fn), ("sm_90", jnp.float8_e4m3fn),
                       ("H200", jnp.float8_e4m3fn), ("cpu", jnp.float8_e4m3fn)):
        assert kp.default_fp8_dtype(name) == jnp.dtype(want), name
    with pytest.raises(ValueError, match="unknown device name 'tpu'"):
        kp.default_fp8_dtype("tpu")
    with jax.sharding.use_abstract_mesh(testing.abstract_mesh(*testing.KNOWN_TARGETS["gfx942"])):
        assert kp.default_fp8_dtype() == jnp.dtype(jnp.float8_e4m3fnuz)


# ---------------------------------------------------------------------------------------------
# jit, vmap, leading shapes, zero rows
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_vmap_and_leading_shapes(rng, impl):
    q, kv, wq, wkv = _qkv(rng, lead=(2, 3))
    eager = kp.fused_q_kv_rmsnorm(q, kv, wq, wkv, impl=impl)
    jitted = jax.jit(lambda *a: kp.fused_q_kv_rmsnorm(*a, impl=impl))(q, kv, wq, wkv)
    vmapped = jax.vmap(lambda a, b: kp.fused_q_kv_rmsnorm(a, b, wq, wkv, impl=impl))(q, kv)
    for out in (eager, jitted, vmapped):
        assert_close(out[0], rmsnorm64(q, wq, 1e-6), ORACLE_TOL["float32"])
        assert_close(out[1], rmsnorm64(kv, wkv, 1e-6), ORACLE_TOL["float32"])
    x, w, g = _gated(rng, lead=(2, 3))
    y = jax.vmap(lambda a, b: kp.rmsnorm_gated(a, w, b, impl=impl))(x, g)
    assert_close(y, gated64(x, w, g, 1e-5, "sigmoid"), ORACLE_TOL["float32"])
    qa = jax.vmap(lambda a, b: kp.rmsnorm_gated_fp8_per_token(a, w, b, impl=impl))(x, g)
    assert qa.data.shape == (2, 3, 96) and qa.scale.shape == (2, 3, 1)
    direct = kp.rmsnorm_gated_fp8_per_token(x, w, g, impl=impl)
    assert np.array_equal(np.asarray(qa.scale), np.asarray(direct.scale))
    assert np.array_equal(np.asarray(qa.data).view(np.uint8), np.asarray(direct.data).view(np.uint8))
    qb = jax.jit(jax.vmap(lambda a: kp.per_token_fp8_quant(a, impl=impl)))(q)
    assert qb.data.shape == q.shape and qb.scale.shape == (2, 3, 1)
    # A batched weight too (one call per batch element there).
    wb = jnp.stack([wq, 2 * wq])
    yb = jax.jit(jax.vmap(lambda a, w: kp.rmsnorm(a, w, impl=impl)))(q, wb)
    assert_close(yb[1], rmsnorm64(q[1], 2 * wq, 1e-6), ORACLE_TOL["float32"])


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_rows(rng, impl):
    q, kv, wq, wkv = _qkv(rng, lead=(0, 5))
    x, w, g = _gated(rng, lead=(3, 0))
    outs = {
        "fused": kp.fused_q_kv_rmsnorm(q, kv, wq, wkv, impl=impl),
        "rmsnorm": kp.rmsnorm(q, wq, impl=impl),
        "gated": kp.rmsnorm_gated(x, w, g, impl=impl),
        "gated_fp8": kp.rmsnorm_gated_fp8_per_token(x, w, g, impl=impl),
        "quant": kp.per_token_fp8_quant(q, impl=impl),
    }
    assert outs["fused"][0].shape == (0, 5, 64) and outs["fused"][1].shape == (0, 5, 16)
    assert outs["rmsnorm"].shape == (0, 5, 64)
    assert outs["gated"].shape == (3, 0, 3, 32)
    assert outs["gated_fp8"].data.shape == (3, 0, 96) and outs["gated_fp8"].scale.shape == (3, 0, 1)
    assert outs["quant"].data.shape == (0, 5, 64) and outs["quant"].scale.shape == (0, 5, 1)
    if impl != "reference":  # no kernel is launched for zero rows
        text = jax.jit(lambda *a: kp.fused_q_kv_rmsnorm(*a, impl=impl)).lower(q, kv, wq, wkv).as_text()
        assert "pallas" not in text.lower()


# ---------------------------------------------------------------------------------------------
# Inference only
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
def test_gradient_raises(rng, op, impl):
    fn, args = all_ops(rng)[op]

    def loss(a0):
        return jnp.sum(_first_float(fn(a0, *args[1:], impl=impl)).astype(jnp.float32))

    with pytest.raises(TypeError, match="inference-only"):
        jax.grad(loss)(args[0])
    with pytest.raises(TypeError, match="inference-only"):
        jax.jvp(loss, (args[0],), (jnp.ones_like(args[0]),))


def _primitives(jaxpr):
    """Every primitive name in a jaxpr, sub-jaxprs (pjit, custom_jvp, cond, ...) included."""
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else [v]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names += _primitives(inner)
    return names


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
def test_inference_only_guard_and_no_custom_vjp(rng, op, impl):
    """The traced op holds the custom_jvp guard that raises on differentiation, and no
    custom_vjp (which would define a backward pass)."""
    fn, args = all_ops(rng)[op]
    prims = _primitives(jax.make_jaxpr(lambda *a: fn(*a, impl=impl))(*args).jaxpr)
    assert "custom_jvp_call" in prims, prims
    assert not [p for p in prims if "custom_vjp" in p], prims


def test_dequantize_per_scale_group(rng):
    """scale [..., G]: each group of N / G columns is multiplied by its own scale."""
    x = jnp.asarray(rng.standard_normal((3, 5, 256)) * np.linspace(0.1, 8, 256), jnp.float32)
    qa = kp.per_token_fp8_quant(x, scale_groups=4, impl="interpret")
    assert qa.scale.shape == (3, 5, 4)
    deq = np.asarray(qa.dequantize())
    want = (np.asarray(qa.data, np.float64).reshape(3, 5, 4, 64)
            * np.asarray(qa.scale, np.float64)[..., None]).reshape(3, 5, 256)
    np.testing.assert_allclose(deq, want, rtol=1e-6)
    np.testing.assert_allclose(deq, np.asarray(x), rtol=0.07, atol=float(np.asarray(qa.scale).max()))
    assert qa.dequantize(jnp.bfloat16).dtype == jnp.bfloat16
    bad = kp.QuantizedActivation(qa.data, qa.scale[..., :3])
    with pytest.raises(ValueError, match="does not fit data"):
        bad.dequantize()


def test_integral_options_and_the_fp8_rank_rule(rng):
    x, w, g = _gated(rng, lead=(4,), h=4, d=32)
    a = kp.rmsnorm_gated_fp8_per_token(x, w, g, scale_groups=np.int64(2), impl="interpret")
    b = kp.rmsnorm_gated_fp8_per_token(x, w, g, scale_groups=2, impl="interpret")
    assert np.array_equal(np.asarray(a.scale), np.asarray(b.scale))
    q, kv, wq, wkv = _qkv(rng)
    packed = jnp.concatenate([q, kv], axis=-1)
    out = kp.mla_q_kv_norm(packed, wq, wkv, q_size=np.int32(64), kv_size=np.int64(16), impl="interpret")
    assert out[0].shape == (4, 64) and out[2].shape == (4, 0)
    with pytest.raises(ValueError, match="scale_groups must be an integer >= 1"):
        kp.per_token_fp8_quant(q, scale_groups=True)
    with pytest.raises(ValueError, match="scale_groups must be an integer >= 1"):
        kp.per_token_fp8_quant(q, scale_groups=2.0)
    with pytest.raises(ValueError, match=r"rank >= 3.*one token: x\[None\]"):
        kp.rmsnorm_gated_fp8_per_token(x[0], w, g[0])  # [H, D]: which axis is the token?
    with pytest.raises(ValueError, match=r"rank >= 3"):
        kp.rmsnorm_gated_fp8_per_token(x.reshape(4, -1)[:, :32], w, g.reshape(4, -1)[:, :32])
    assert kp.rmsnorm_gated_fp8_per_token(x[0][None], w, g[0][None]).scale.shape == (1, 1)
