"""The inference integration on a real GPU (marked ``gpu``): ``mla_q_kv_norm`` compiled, and the
compiled HLO of it and of ``fp8_linear`` (one custom call and nothing around it; a vendor FP8
GEMM, not an upcast), and the Kimi-K3 blocks with the compiled kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp
from k3pallas.models import kimi_k3
from k3pallas import ops as op_table
from k3pallas import testing

from bench import cases as k3ops
from bench.inspection import hlo
from support import ORACLE_TOL, REFERENCE_TOL, assert_close, f64, rmsnorm64

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("t", [1, 7, 4096, 65536])
@pytest.mark.parametrize("rope", [64, 0])
def test_mla_q_kv_norm_compiled(rng, t, rope):
    a = jax.random.normal(jax.random.PRNGKey(int(rng.integers(2**31))), (t, 2048 + rope)) * 3
    a = a.astype(jnp.bfloat16)
    wq = jnp.asarray(rng.uniform(0.5, 1.5, 1536), jnp.bfloat16)
    wkv = jnp.asarray(rng.uniform(-1.5, 1.5, 512), jnp.float32)
    fn = jax.jit(lambda *x: kp.mla_q_kv_norm(*x, impl="pallas"))
    with testing.poisoned_outputs():
        poisoned = jax.jit(lambda *x: kp.mla_q_kv_norm(*x, impl="pallas"))(a, wq, wkv)
    out = fn(a, wq, wkv)
    ref = kp.mla_q_kv_norm(a, wq, wkv, impl="reference")
    for o, p, r in zip(out, poisoned, ref):
        assert np.array_equal(np.asarray(o), np.asarray(p)), "poisoned run differs"
        assert_close(o, r, REFERENCE_TOL["bfloat16"], "vs reference")
    an = np.asarray(a)
    rows = np.unique(np.concatenate([[0, t - 1], rng.integers(0, t, min(t, 256))]))
    assert_close(np.asarray(out[0])[rows], rmsnorm64(an[rows, :1536], wq, 1e-6), ORACLE_TOL["bfloat16"])
    assert_close(np.asarray(out[1])[rows], rmsnorm64(an[rows, 1536:2048], wkv, 1e-6), ORACLE_TOL["bfloat16"])
    assert np.array_equal(np.asarray(out[2]), an[:, 2048:])


def test_mla_q_kv_norm_compiles_to_one_call():
    """The optimized HLO launches exactly one custom call (the kernel) and nothing else: no slice
    or copy kernels. Slicing before ``fused_q_kv_rmsnorm`` launches more."""
    a = jnp.ones((4096, 2112), jnp.bfloat16)
    wq, wkv = jnp.ones((1536,), jnp.bfloat16), jnp.ones((512,), jnp.bfloat16)
    text = hlo.compiled_text(lambda *x: kp.mla_q_kv_norm(*x, impl="pallas"), a, wq, wkv)
    assert dict(hlo.data_moving_ops(text)) == {"custom-call": 1}, hlo.entry_instructions(text)
    sliced = hlo.compiled_text(
        lambda a, wq, wkv: kp.fused_q_kv_rmsnorm(a[:, :1536], a[:, 1536:2048], wq, wkv, impl="pallas"),
        a, wq, wkv)
    assert sum(hlo.data_moving_ops(sliced).values()) > 1


@pytest.mark.parametrize("w_layout", ["nk", "kn"])
def test_fp8_linear_is_an_fp8_gemm(rng, w_layout):
    """XLA rewrites the fp8 dot into cuBLASLt's FP8 GEMM (with ``"nk"`` weights and nothing but
    the scaling epilogue around it; ``"kn"`` adds a transpose of the weight); the result matches
    the float64 dequantize-then-matmul oracle within the GEMM's accumulation error."""
    t, k, n = 256, 1536, 7168
    x = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
    qa = kp.per_token_fp8_quant(x, fp8_dtype="float8_e4m3fn", impl="pallas")
    w8, ws = kp.quantize_weight_per_channel(jnp.asarray(rng.standard_normal((k, n)) * 0.02, jnp.bfloat16),
                                            fp8_dtype="float8_e4m3fn", w_layout=w_layout)
    fn = lambda qa, w8, ws: kp.fp8_linear(qa, w8, ws, out_dtype=jnp.float32, w_layout=w_layout)  # noqa: E731
    text = hlo.compiled_text(fn, qa, w8, ws)
    assert hlo.FP8_GEMM_TARGET in hlo.custom_call_targets(text), hlo.entry_instructions(text)
    launched = hlo.data_moving_ops(text)
    if w_layout == "nk":
        assert dict(launched) == {"custom-call": 1, "fusion": 1}, hlo.entry_instructions(text)
    out = jax.jit(fn)(qa, w8, ws)
    d = f64(qa.data) * f64(qa.scale)
    w = (f64(w8) if w_layout == "kn" else f64(w8).T) * f64(ws)
    ref, mag = d @ w, np.abs(d) @ np.abs(w)
    ratio = float(np.max(np.abs(f64(out) - ref) / mag))
    print(f"fp8_linear {w_layout}: max |err| / (|a| @ |w|) = {ratio:.3g}")
    # Hopper's FP8 tensor cores accumulate with fewer than 24 mantissa bits (cuBLASLt fast
    # accumulation); the bound is 2**-10 of the accumulated magnitude.
    assert ratio <= 2**-10


def test_model_blocks_on_gpu():
    r = kimi_k3.run(tokens=256, impl="pallas", log=print)
    assert r["mla_front"]["q"] < 1e-2 and r["mla_front"]["kv_c"] < 1e-2
    assert r["mla_front"]["q_fp8_vs_bf16"] < 0.06
    for key in ("kda_out_12x128", "kda_out_96x128", "mla_out_12x128", "mla_out_96x128"):
        assert r[key]["fp8_vs_bf16"] < 0.06


def test_compiled_kernels_inside_shard_map_and_with_shardings(rng):
    """On the GPUs there are (a one-device mesh here): the compiled kernels inside shard_map
    with its default varying-axes check, and under jit with NamedSharding operands (the
    custom_partitioning path), equal the plain call."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = jax.devices()
    mesh = Mesh(np.array(devices).reshape(len(devices), 1), ("dp", "tp"))
    x = jnp.asarray(rng.standard_normal((64 * len(devices), 12, 128)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal(x.shape), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(128), jnp.float32)
    fn = lambda x, w, g: kp.rmsnorm_gated_fp8_per_token(x, w, g, impl="pallas")  # noqa: E731
    direct = jax.jit(fn)(x, w, g)
    smapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("dp", "tp"), P(), P("dp", "tp")),
                                    out_specs=P("dp", "tp")))(x, w, g)
    xs = jax.device_put(x, NamedSharding(mesh, P("dp", "tp")))
    gs = jax.device_put(g, NamedSharding(mesh, P("dp", "tp")))
    sharded = jax.jit(fn)(xs, w, gs)
    for other in (smapped, sharded):
        assert np.array_equal(np.asarray(other.scale), np.asarray(direct.scale), equal_nan=True)
        assert np.array_equal(np.asarray(other.data).view(np.uint8), np.asarray(direct.data).view(np.uint8))
    q = jnp.asarray(rng.standard_normal((256, 2112)), jnp.bfloat16)
    ones = jnp.ones((1536,), jnp.bfloat16), jnp.ones((512,), jnp.bfloat16)
    mla = jax.jit(jax.shard_map(lambda a, wq, wkv: kp.mla_q_kv_norm(a, wq, wkv, impl="pallas"),
                                mesh=mesh, in_specs=(P("dp"), P(), P()), out_specs=P("dp")))
    for o, r in zip(mla(q, *ones), kp.mla_q_kv_norm(q, *ones, impl="pallas")):
        assert np.array_equal(np.asarray(o), np.asarray(r))


def test_cross_device_scale_modes_compiled(rng):
    """The scale-only and given-scale launches, compiled, against the dynamic one: given the
    same scale, the codes are bit-identical; the scale-only launch's scale is within 1e-6
    relative of the dynamic launch's (compiled without the codes, its arithmetic may be
    contracted differently: on the H200, 520 of 4096 rows differed, by at most 4 ulp)."""
    from k3pallas import fp8 as fp8_lib
    from k3pallas.kernels import gated_fp8 as kernels

    q = fp8_lib.resolve_fp8_params()
    x = jnp.asarray(rng.standard_normal((4096, 96, 128)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal(x.shape), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(128), jnp.float32)

    def run(mode, scale=None):
        return jax.jit(lambda x, g, w, s: kernels.rmsnorm_gated_rows(
            x, g, w, eps=1e-5, activation="sigmoid", op=op_table.RMSNORM_GATED_FP8_PER_TOKEN.name, fp8=q, interpret=False, mode=mode,
            scale=s))(x, g, w, scale)

    codes, scale = run("dynamic")
    _, scale_only = run("scale_only")
    codes_given, _ = run("given_scale", scale)
    assert np.array_equal(np.asarray(codes).view(np.uint8), np.asarray(codes_given).view(np.uint8))
    s1, s2 = np.asarray(scale), np.asarray(scale_only)
    ulps = np.abs(s1.view(np.int32).astype(np.int64) - s2.view(np.int32).astype(np.int64))
    print(f"scale-only vs dynamic: {int((ulps > 0).sum())} of {ulps.size} rows differ, max {ulps.max()} ulp")
    np.testing.assert_allclose(s2, s1, rtol=1e-6)


# The tuned table's decode buckets (91..181 and 182..362 tokens); odd, so that the entries with
# two rows per program end on a partial row block.
DECODE_T = (99, 201, 301)


@pytest.mark.parametrize("t", DECODE_T)
@pytest.mark.parametrize("name", [n for n, s in k3ops.OPS.items() if not s.mx])
def test_decode_launch_configs_compiled(rng, name, t):
    """Every non-MX op at its model shapes with the launch config the table gives at decode T,
    compiled with poisoned outputs, against its reference: bf16 outputs within REFERENCE_TOL,
    FP8 scales to 1e-6 and codes at most one step apart."""
    spec = k3ops.OPS[name]
    for cfg in spec.configs:
        structs, options = spec.example(t, jnp.dtype(jnp.bfloat16), **spec.sizes[cfg])
        args = [jnp.asarray(rng.standard_normal(s.shape), s.dtype) for s in structs]
        with testing.poisoned_outputs():
            got = jax.jit(lambda *a: spec.fn(*a, impl="pallas", **options))(*args)
        ref = jax.jit(lambda *a: spec.fn(*a, impl="reference", **options))(*args)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
            assert a.shape == b.shape and a.dtype == b.dtype, (cfg, a.shape, b.shape)
            assert not np.isnan(f64(a)).any(), (name, cfg, t, "unwritten or NaN")
            if jnp.dtype(a.dtype).itemsize == 1:  # FP8 codes
                diff, step = np.abs(f64(a) - f64(b)), np.abs(f64(b)) / 8 + 2.0**-9
                assert (diff <= step * 1.01).all(), (name, cfg, t)
            elif a.dtype == jnp.float32:  # FP8 scales (the other outputs are bf16 here)
                assert np.abs(f64(a) / f64(b) - 1).max() <= 1e-6, (name, cfg, t)
            else:
                assert_close(a, b, REFERENCE_TOL[jnp.dtype(a.dtype).name], f"{name} {cfg} T={t}")
