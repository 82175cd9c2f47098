"""The public API's contract: argument errors (naming the op and the argument), output formats,
impl selection, jit / vmap / any leading shape, zero rows, the seed-named shorthands, and the
inference-only gradient error. Generic tests run every case of ``bench.cases`` (each op with
each family of output formats), so a new op or format gets them without an edit here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp
from bench import cases as bench_cases

from support import ORACLE_TOL, assert_close, codes_bytes, gated64, rmsnorm64


def _qkv(rng, lead=(4,), dq=64, dkv=16, dtype=jnp.float32):
    return (jnp.asarray(rng.standard_normal(lead + (dq,)), dtype),
            jnp.asarray(rng.standard_normal(lead + (dkv,)), dtype),
            jnp.asarray(rng.standard_normal(dq), jnp.float32),
            jnp.asarray(rng.standard_normal(dkv), jnp.float32))


def _gated(rng, lead=(4,), h=3, d=32):
    return (jnp.asarray(rng.standard_normal(lead + (h, d)), jnp.float32),
            jnp.asarray(rng.standard_normal(d), jnp.float32),
            jnp.asarray(rng.standard_normal(lead + (h, d)), jnp.float32))


CASES = list(bench_cases.OPS)


def case(rng, name, tokens=4):
    """(fn(*arrays, **kw), arrays) of a bench case at its "test" size."""
    spec = bench_cases.OPS[name]
    structs, options = spec.example(tokens, jnp.dtype(jnp.float32), **spec.sizes["test"])
    args = tuple(jnp.asarray(rng.standard_normal(s.shape), s.dtype) for s in structs)
    return (lambda *a, **kw: spec.fn(*a, **options, **kw)), args


def _first(out):
    return jax.tree_util.tree_leaves(out)[0]


# ------------------------------------------------------------------------------------------------
# impl
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_impl_choice(rng, name):
    fn, args = case(rng, name)
    with pytest.raises(ValueError, match=f"{bench_cases.OPS[name].op}: impl must be one of"):
        fn(*args, impl="triton")
    if kp.current_target().is_gpu:
        return
    with pytest.raises(RuntimeError, match="needs a GPU target"):
        fn(*args, impl="pallas")


def test_auto_is_the_reference_on_the_cpu(rng):
    if kp.current_target().is_gpu:
        pytest.skip("this machine has a GPU target")
    q, kv, wq, wkv = _qkv(rng)
    text = jax.jit(lambda *a: kp.fused_q_kv_rmsnorm(*a)).lower(q, kv, wq, wkv).as_text()
    assert "pallas" not in text and "triton" not in text


# ------------------------------------------------------------------------------------------------
# Bad input: each error names the op and the argument
# ------------------------------------------------------------------------------------------------


def test_norm_bad_inputs(rng):
    q, kv, wq, wkv = _qkv(rng)
    f = kp.fused_q_kv_rmsnorm
    bad = [
        (lambda: f(q, kv[:3], wq, wkv), ValueError,
         r"fused_q_kv_rmsnorm: q_c and kv_c must have the same leading dims.*\(4, 64\).*\(3, 16\)"),
        (lambda: f(q, kv, wq[:63], wkv), ValueError, r"q_weight must have shape \(64,\).*\(63,\)"),
        (lambda: f(q, kv, wq, wq), ValueError, r"kv_weight must have shape \(16,\)"),
        (lambda: f(q, kv, wq, wkv[None]), ValueError, "kv_weight must have shape"),
        (lambda: f(q.astype(jnp.int32), kv, wq, wkv), TypeError, "q_c must have a floating dtype.*int32"),
        (lambda: f(q, kv, wq, wkv > 0), TypeError, "kv_weight must have a floating dtype.*bool"),
        (lambda: f(q.astype(jnp.float8_e4m3fn), kv, wq, wkv), TypeError, "float8_e4m3fn"),
        (lambda: f(q[0, 0], kv, wq, wkv), ValueError, "q_c must have rank >= 1"),
        (lambda: f([[1.0]], kv, wq, wkv), TypeError, "q_c must be an array"),
        (lambda: f(q, kv, wq, wkv, kv_eps=0.0), ValueError, "kv_eps must be finite and > 0"),
        (lambda: f(q, kv, wq, wkv, "1e-6"), TypeError, "eps must be a Python float"),
        (lambda: jax.jit(lambda e: f(q, kv, wq, wkv, e))(1e-6), TypeError, "eps must be a Python float"),
        (lambda: f(q[:, :0], kv, wq[:0], wkv), ValueError, "non-empty trailing dims"),
        (lambda: kp.rmsnorm(q, wq[:10]), ValueError, r"rmsnorm: weight must have shape \(64,\)"),
        (lambda: kp.rmsnorm(jnp.float32(1.0), wq), ValueError, "x must have rank >= 1"),
        (lambda: kp.rmsnorm(q, wq, -1.0), ValueError, "eps must be finite"),
        (lambda: kp.rmsnorm(q, wq, 1e-50), ValueError, r"outside \[1\.17549e-38"),
        (lambda: kp.mla_q_kv_norm(q, wq, wkv, q_size=64, kv_size=32), ValueError,
         r"must hold q_size \+ kv_size"),
        (lambda: kp.mla_q_kv_norm(q, wq, wkv, q_size=0), ValueError, "q_size must be an integer >= 1"),
        (lambda: jax.jit(lambda s: kp.mla_q_kv_norm(q, wq, wkv, q_size=s))(32), TypeError,
         "q_size must be a Python int"),
    ]
    for call, err, match in bad:
        with pytest.raises(err, match=match):
            call()
    for eps in (0.0, -1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps must be finite and > 0"):
            f(q, kv, wq, wkv, eps)


def test_gated_and_column_bad_inputs(rng):
    x, w, g = _gated(rng)
    for fmt in (None, "fp8_per_token"):
        f = lambda *a, **k: kp.rmsnorm_gated(*a, out_format=fmt, **k)  # noqa: E731
        with pytest.raises(ValueError, match=r"rmsnorm_gated: gate must have the shape of x.*\(4, 3, 31\)"):
            f(x, w, g[..., :31])
        with pytest.raises(ValueError, match=r"weight must have shape \(32,\)"):
            f(x, w[:8], g)
        with pytest.raises(ValueError, match="x must have rank >= 2"):
            f(x[0, 0], w, g[0, 0])
        with pytest.raises(TypeError, match="gate must have a floating dtype.*int32"):
            f(x, w, g.astype(jnp.int32))
        with pytest.raises(ValueError, match="activation must be one of"):
            f(x, w, g, activation="relu")
        with pytest.raises(ValueError, match="non-empty trailing dims"):
            f(x[:, :0], w, g[:, :0])
    with pytest.raises(ValueError, match=r"rank >= 3.*one token: x\[None\]"):
        kp.rmsnorm_gated(x[0], w, g[0], out_format="fp8_per_token")  # [H, D]: which is the token?
    with pytest.raises(ValueError, match=r"groups=2 must divide the number of heads \(3\)"):
        kp.rmsnorm_gated_fp8_per_token(x, w, g, scale_groups=2)
    with pytest.raises(ValueError, match=r"rmsnorm_gated: mxfp4 .*head dim.*\(48\) must be a multiple of 32"):
        kp.rmsnorm_gated(jnp.ones((2, 3, 48)), jnp.ones(48), jnp.ones((2, 3, 48)), out_format="mxfp4")
    a = jnp.ones((4, 96))
    with pytest.raises(ValueError, match="sigmoid_mul: gate must have the shape of x"):
        kp.sigmoid_mul(a, a[:3])
    with pytest.raises(ValueError, match=r"groups=5 must divide the last dim of x \(96\)"):
        kp.per_token_fp8_quant(a, scale_groups=5)
    with pytest.raises(ValueError, match=r"quantize: mxfp8 .*\(40\) must be a multiple of 32"):
        kp.quantize(jnp.ones((2, 40)), "mxfp8")
    with pytest.raises(ValueError, match="mla_q_kv_norm: mxfp4 .*q_size.*multiple of 32"):
        kp.mla_q_kv_norm(jnp.ones((2, 100)), jnp.ones(40), jnp.ones(60), q_size=40, kv_size=60,
                         out_format="mxfp4")


def test_output_format_errors(rng):
    x = jnp.ones((2, 64))
    w = jnp.ones(64)
    with pytest.raises(ValueError, match="rmsnorm: out_format must be a k3pallas format or one of"):
        kp.rmsnorm(x, w, out_format="mxfp6")
    with pytest.raises(TypeError, match="sigmoid_mul: out_format must be a k3pallas format"):
        kp.sigmoid_mul(x, x, out_format=jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="quantize: out_format is required"):
        kp.quantize(x, None)
    with pytest.raises(ValueError, match="rmsnorm: fp8_cast='encoder' applies to a quantized output"):
        kp.rmsnorm(x, w, fp8_cast="encoder")
    with pytest.raises(ValueError, match="quantize: fp8_cast must be one of"):
        kp.quantize(x, "mxfp8", fp8_cast="fast")
    with pytest.raises(ValueError, match="rmsnorm: fp8_per_token groups=2: this op writes one scale per token"):
        kp.rmsnorm(x, w, out_format=kp.Fp8PerToken(groups=2))
    with pytest.raises(ValueError, match="fused_q_kv_rmsnorm: fp8_max=500.0 exceeds"):
        kp.fused_q_kv_rmsnorm(x, x, w, w, out_format=kp.Fp8PerToken(fp8_max=500.0))


@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_native_conversion_refusals_name_the_op_and_the_option(impl):
    """Round 3: fp8_cast="native" with MXFP4 raised "fp8_dtype must be one of ...; got
    float4_e2m1fn" (an option the user did not pass, no op)."""
    x = jnp.ones((2, 64))
    if impl == "reference":  # the reference has no conversion to choose: the mode is ignored
        kp.quantize(x, "mxfp4", fp8_cast="native", impl=impl)
        return
    with pytest.raises(RuntimeError, match=r"^quantize: fp8_cast='native': no native float4 conversion"):
        kp.quantize(x, "mxfp4", fp8_cast="native", impl=impl)
    with pytest.raises(RuntimeError, match=r"^sigmoid_mul: fp8_cast='native'"):
        kp.sigmoid_mul(x, x, out_format="mxfp4", fp8_cast="native", impl=impl)


def test_the_fp8_output_size_refusal_names_the_op_for_every_impl():
    x = jax.ShapeDtypeStruct((2**19, 4096), jnp.bfloat16)  # 2**31 one-byte codes
    for impl in ("reference", "interpret"):
        with pytest.raises(ValueError, match=r"^quantize: an fp8 output of shape"):
            jax.eval_shape(lambda a: kp.per_token_fp8_quant(a, impl=impl), x)


# ------------------------------------------------------------------------------------------------
# jit, vmap, leading shapes, zero rows, shorthands
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["interpret", "reference"])
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
    for fmt in ("fp8_per_token", "mxfp4"):
        xm, gm = (x, g) if fmt != "mxfp4" else (jnp.tile(x, 2), jnp.tile(g, 2))
        wm = w if fmt != "mxfp4" else jnp.tile(w, 2)
        qa = jax.vmap(lambda a, b: kp.rmsnorm_gated(a, wm, b, out_format=fmt, impl=impl))(xm, gm)
        direct = kp.rmsnorm_gated(xm, wm, gm, out_format=fmt, impl=impl)
        assert qa.data.shape == direct.data.shape == (2, 3, 3 * xm.shape[-1])
        assert np.array_equal(codes_bytes(qa.data), codes_bytes(direct.data))
        assert np.array_equal(codes_bytes(qa.scale), codes_bytes(direct.scale))
    qb = jax.jit(jax.vmap(lambda a: kp.quantize(a, "fp8_per_token", impl=impl)))(q)
    assert qb.data.shape == q.shape and qb.scale.shape == (2, 3, 1)
    # A batched weight too (one call per batch element there).
    wb = jnp.stack([wq, 2 * wq])
    yb = jax.jit(jax.vmap(lambda a, w: kp.rmsnorm(a, w, impl=impl)))(q, wb)
    assert_close(yb[1], rmsnorm64(q[1], 2 * wq, 1e-6), ORACLE_TOL["float32"])


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize("name", CASES)
def test_zero_rows(rng, name, impl):
    """Empty outputs of the right shapes, no launch (round 3: MX at 0 tokens raised
    ZeroDivisionError)."""
    fn, _ = case(rng, name, tokens=1)
    spec = bench_cases.OPS[name]
    structs, _ = spec.example(0, jnp.dtype(jnp.float32), **spec.sizes["test"])
    empty = [jnp.zeros(s.shape, s.dtype) for s in structs]
    want = jax.eval_shape(lambda *a: fn(*a, impl="reference"), *empty)
    got = fn(*empty, impl=impl)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert a.shape == b.shape and a.dtype == b.dtype and a.size == 0, name
    if impl != "reference":
        text = jax.jit(lambda *a: fn(*a, impl=impl)).lower(*empty).as_text()
        assert "pallas" not in text.lower(), name


def test_shorthands_are_the_functions(rng):
    x, w, g = _gated(rng, h=4)
    a = kp.rmsnorm_gated_fp8_per_token(x, w, g, scale_groups=np.int64(2), fp8_max=240.0,
                                       fp8_dtype=jnp.float8_e4m3fnuz, impl="interpret")
    b = kp.rmsnorm_gated(x, w, g, out_format=kp.Fp8PerToken(jnp.float8_e4m3fnuz, 240.0, groups=2),
                         impl="interpret")
    assert a.format == b.format and a.scale.shape == (4, 2)
    assert np.array_equal(codes_bytes(a.data), codes_bytes(b.data))
    assert np.array_equal(np.asarray(a.scale), np.asarray(b.scale))
    q = kp.per_token_fp8_quant(x.reshape(4, -1), scale_ub=2.0, impl="interpret")
    r = kp.quantize(x.reshape(4, -1), kp.Fp8PerToken(scale_ub=2.0), impl="interpret")
    assert q.format == r.format and np.array_equal(codes_bytes(q.data), codes_bytes(r.data))
    q, kv, wq, wkv = _qkv(rng)
    packed = jnp.concatenate([q, kv], axis=-1)
    out = kp.mla_q_kv_norm(packed, wq, wkv, q_size=np.int32(64), kv_size=np.int64(16), impl="interpret")
    assert out[0].shape == (4, 64) and out[2].shape == (4, 0)


# ------------------------------------------------------------------------------------------------
# Inference only
# ------------------------------------------------------------------------------------------------


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


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize("name", CASES)
def test_inference_only(rng, name, impl):
    """A gradient or JVP raises TypeError; the traced op holds that guard and no custom_vjp."""
    fn, args = case(rng, name)

    def loss(a0):
        return jnp.sum(_first(fn(a0, *args[1:], impl=impl)).astype(jnp.float32))

    with pytest.raises(TypeError, match="inference-only"):
        jax.grad(loss)(args[0])
    with pytest.raises(TypeError, match="inference-only"):
        jax.jvp(loss, (args[0],), (jnp.ones_like(args[0]),))
    prims = _primitives(jax.make_jaxpr(lambda *a: fn(*a, impl=impl))(*args).jaxpr)
    assert "custom_jvp_call" in prims, prims
    assert not [p for p in prims if "custom_vjp" in p], prims


@pytest.mark.parametrize("fmt", ["fp8_per_token", "mxfp4"])
def test_a_gradient_through_the_weight_quantizer_raises(fmt):
    """Round 3: jax.grad through the weight quantizers returned a gradient (for MX the tangent
    rounded to FP4)."""
    w = jnp.ones((64, 8))
    with pytest.raises(TypeError, match="k3pallas.quantize_weight is inference-only"):
        jax.grad(lambda w: kp.quantize_weight(w, fmt).dequantize().sum())(w)
