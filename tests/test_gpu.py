"""Compiled kernels on a real GPU (marked ``gpu``: skipped without one), at production shapes.

The small-shape body of every op x format runs compiled in test_ops.py (``impl="pallas"``);
here: the model shapes up to T = 131072 against the jnp reference and, on sampled rows, the
float64 oracle; two runs bit-identical; NaN-poisoned outputs fully written; every tuned decode
launch config; the FP8 conversion paths on the device; the consumers' compiled HLO (a vendor FP8
GEMM; ``jax.nn.scaled_matmul``); the Kimi-K3 blocks; shard_map and NamedSharding on the GPUs
there are; 2**21 rows of width 2048 (64-bit offsets); the residual add + norm, in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp
from bench import cases as bench_cases
from bench.inspection import hlo
from k3pallas import _compat, formats, platform, testing
from k3pallas.kernels import common, fp8_cast, gated, hooks
from k3pallas.kernels.launch import LaunchConfig
from k3pallas.models import kimi_k3

from support import (ORACLE_TOL, REFERENCE_TOL, assert_close, check_quantized, codes_bytes,
                     encode_in_pallas, encoder_inputs, expected_codes, f64, gated64, rmsnorm64,
                     sigmoid64, ue8m0_flips)

pytestmark = pytest.mark.gpu
FNUZ = "float8_e4m3fnuz"


def _rand(rng, shape, dtype=jnp.bfloat16, scale=1.0):
    key = jax.random.PRNGKey(int(rng.integers(2**31)))
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def _rows(rng, t, n=512):
    return np.unique(np.concatenate([[0, t - 1], rng.integers(0, t, min(n, t))]))


def _compiled_twice_and_poisoned(fn, *args):
    """(result, result of a second run, result with poisoned outputs): all must be equal."""
    out = jax.jit(fn)(*args)
    again = jax.jit(fn)(*args)
    with testing.poisoned_outputs():
        poisoned = jax.jit(lambda *a: fn(*a))(*args)
    for a, b, c in zip(*(jax.tree_util.tree_leaves(o) for o in (out, again, poisoned))):
        assert np.array_equal(codes_bytes(a), codes_bytes(b)), "two runs differ"
        assert np.array_equal(codes_bytes(a), codes_bytes(c)), "poisoned run differs (unwritten?)"
    return out


def _sampled(qa, rows):
    """The rows ``rows`` of a record (the oracle checks a sample of a large T)."""
    return kp.QuantizedActivation(np.asarray(qa.data)[rows], np.asarray(qa.scale)[rows], qa.format)


# ------------------------------------------------------------------------------------------------
# The ops at production shapes
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 7, 4096, 131072])
@pytest.mark.parametrize("fmt", [None, "fp8_per_token", FNUZ, "mxfp8", "mxfp4", "fp8_group128",
                                 "fp8_group128_ue8m0"])
def test_joint_and_packed_norms(rng, t, fmt):
    q, kv = _rand(rng, (t, 1536), scale=3.0), _rand(rng, (t, 512))
    pe = _rand(rng, (t, 64))
    wq, wkv = _rand(rng, (1536,), jnp.float32), _rand(rng, (512,))
    out_format = kp.Fp8PerToken(FNUZ) if fmt == FNUZ else fmt
    packed = jnp.concatenate([q, kv, pe], -1)
    fused = _compiled_twice_and_poisoned(
        lambda *a: kp.fused_q_kv_rmsnorm(*a, out_format=out_format, impl="pallas"), q, kv, wq, wkv)
    mla = _compiled_twice_and_poisoned(
        lambda *a: kp.mla_q_kv_norm(*a, out_format=out_format, impl="pallas"), packed, wq, wkv)
    rows = _rows(rng, t)
    q64 = rmsnorm64(np.asarray(q)[rows], wq, 1e-6)
    kv_plain = kp.fused_q_kv_rmsnorm(q, kv, wq, wkv, impl="reference")[1]
    for out in (fused, mla):
        if fmt is None:
            assert_close(np.asarray(out[0])[rows], q64, ORACLE_TOL["bfloat16"], "q vs oracle")
        else:
            check_quantized(_sampled(out[0], rows), q64, f"q {fmt}")
        assert_close(out[1], kv_plain, REFERENCE_TOL["bfloat16"], "kv vs reference")
    assert np.array_equal(np.asarray(mla[2]), np.asarray(pe))


def test_packed_norm_compiles_to_one_call():
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


@pytest.mark.parametrize("t", [1, 7, 4096, 131072])
@pytest.mark.parametrize("hd", [(32, 128), (12, 128), (96, 128), (5, 96)], ids=str)
@pytest.mark.parametrize("fmt", ["e4m3fn", FNUZ, "mxfp4", "fp8_group128", "group_ue8m0_fnuz"])
def test_gated_norm(rng, t, hd, fmt):
    h, d = hd
    if t == 131072 and hd != (32, 128):
        pytest.skip("the largest T on the headline shape only")
    if fmt == "mxfp4" and d % 32 or "group" in fmt and d % 128:
        pytest.skip("MX needs a head dim in blocks of 32, the group formats in groups of 128")
    x, g = _rand(rng, (t, h, d), scale=2.0), _rand(rng, (t, h, d), scale=2.0)
    w = jnp.asarray(rng.uniform(0.2, 2.0, d), jnp.float32)
    out_format = {"e4m3fn": kp.Fp8PerToken(jnp.float8_e4m3fn), FNUZ: kp.Fp8PerToken(FNUZ),
                  "group_ue8m0_fnuz": kp.Fp8Group(FNUZ, ue8m0=True)}.get(fmt, fmt)
    out = _compiled_twice_and_poisoned(
        lambda *a: kp.rmsnorm_gated(*a, out_format=out_format, impl="pallas"), x, w, g)
    rows = _rows(rng, t)
    y64 = gated64(np.asarray(x)[rows], w, np.asarray(g)[rows], 1e-5, "sigmoid").reshape(len(rows), h * d)
    check_quantized(_sampled(out, rows), y64, f"gated {fmt}")
    if fmt != "mxfp4":  # every row against the reference: scales, codes at most a step apart
        ref = jax.jit(lambda *a: kp.rmsnorm_gated(*a, out_format=out_format, impl="reference"))(x, w, g)
        s, r = f64(out.scale), f64(ref.scale)
        if getattr(out.format, "ue8m0", False):
            flip = ue8m0_flips(out, ref)  # a group's amax at a power-of-two edge
            assert flip.mean() <= 1e-4, f"{int(flip.sum())} UE8M0 scales flipped"
            s = np.where(flip, r, s)
        assert np.abs(s / r - 1).max() <= 1e-6
        # dequantized values at most a code step apart (codes so, where the scales are equal);
        # float32 products of a code and a scale are exact to 2**-24, far inside the 1 % slack
        @jax.jit
        def near(a, b):
            deq = lambda q: q.data.astype(jnp.float32).reshape(q.scale.shape + (-1,)) * q.scale[..., None]
            d, e = deq(a), deq(b)
            step = jnp.maximum(a.scale, b.scale)[..., None] * 2.0**-9
            return jnp.all(jnp.abs(d - e) <= (jnp.abs(e) / 8 + step) * 1.01)
        assert bool(near(out, ref))
    if fmt == "e4m3fn" and t == 4096:
        y = jax.jit(lambda *a: kp.rmsnorm_gated(*a, impl="pallas"))(x, w, g)
        assert_close(y, kp.rmsnorm_gated(x, w, g, impl="reference"), REFERENCE_TOL["bfloat16"])


@pytest.mark.parametrize("t,n", [(1, 4096), (4096, 4096), (131072, 1536), (33, 3000), (64, 12288)])
@pytest.mark.parametrize("fmt", ["e4m3fn", FNUZ, "e5m2", "mxfp8", "mxfp4", "fp8_group128",
                                 "fp8_group128_ue8m0", "group_fnuz"])
def test_columns(rng, t, n, fmt):
    """The standalone quantization and the sigmoid-mul. The group formats' quantization: scales
    and codes exact on the device (its reciprocal need not be IEEE; up to 4096 rows against the
    float64 oracle), every one equal to XLA's."""
    if fmt.startswith("mx") and n % 32 or "group" in fmt and n % 128:
        pytest.skip("MX needs whole blocks of 32, the group formats groups of 128")
    x, g = _rand(rng, (t, n), scale=3.0), _rand(rng, (t, n), scale=3.0)
    out_format = {"e4m3fn": kp.Fp8PerToken(jnp.float8_e4m3fn), FNUZ: kp.Fp8PerToken(FNUZ),
                  "e5m2": kp.Fp8PerToken(jnp.float8_e5m2),
                  "group_fnuz": kp.Fp8Group(FNUZ, 240.0)}.get(fmt, fmt)
    qa = _compiled_twice_and_poisoned(lambda a: kp.quantize(a, out_format, impl="pallas"), x)
    if "group" in fmt:
        rows = _rows(rng, t, 4096)
        check_quantized(_sampled(qa, rows), f64(np.asarray(x)[rows]), f"quantize {fmt}", exact=True)
        ref = jax.jit(lambda a: kp.quantize(a, out_format, impl="reference"))(x)
        assert np.array_equal(codes_bytes(qa.data), codes_bytes(ref.data))
        assert np.array_equal(codes_bytes(qa.scale), codes_bytes(ref.scale))
    sm = _compiled_twice_and_poisoned(
        lambda a, b: kp.sigmoid_mul(a, b, out_format=out_format, impl="pallas"), x, g)
    rows = _rows(rng, t)
    check_quantized(_sampled(qa, rows), f64(np.asarray(x)[rows]), f"quantize {fmt}")
    check_quantized(_sampled(sm, rows), f64(np.asarray(x)[rows]) * sigmoid64(f64(np.asarray(g)[rows])),
                    f"sigmoid_mul {fmt}")
    if fmt.startswith("mx"):  # the standalone quantization: bit-exact with jax's own
        d, s = _compat.jax_mx_quantize(x.astype(jnp.float32), formats.as_format(fmt).dtype)
        assert np.array_equal(codes_bytes(qa.data), codes_bytes(d))
        assert np.array_equal(codes_bytes(qa.scale), codes_bytes(s))


@pytest.mark.parametrize("t", [1, 7, 1023, 4096, 65536])
@pytest.mark.parametrize("d", [7168, 4096])
@pytest.mark.parametrize("fmt", [None, "fp8_per_token", "mxfp8", "fp8_group128"])
def test_add_rmsnorm(rng, t, d, fmt):
    """The residual add + norm at DeepSeek-V3's hidden size and 4096 (T = 1023: the tuned
    several-rows programs, the last one partial): the new residual bit for bit the reference's
    (the float32 sum rounded once), the output against the float64 oracle of the rounded sum on
    sampled rows (every row against the reference unquantized)."""
    if t == 65536 and fmt not in (None, "fp8_group128"):
        pytest.skip("the largest T: unquantized and group FP8")
    x, r = _rand(rng, (t, d), scale=2.0), _rand(rng, (t, d))
    w = _rand(rng, (d,), scale=0.5) + 1
    y, new = _compiled_twice_and_poisoned(
        lambda *a: kp.add_rmsnorm(*a, out_format=fmt, impl="pallas"), x, r, w)
    y_ref, new_ref = jax.jit(lambda *a: kp.add_rmsnorm(*a, out_format=fmt, impl="reference"))(x, r, w)
    assert np.array_equal(codes_bytes(new), codes_bytes(new_ref))
    rows = _rows(rng, t)
    r64 = f64(np.asarray(new)[rows])
    y64 = rmsnorm64(r64, w, 1e-6)
    if fmt is None:
        assert_close(np.asarray(y)[rows], y64, ORACLE_TOL["bfloat16"], "y vs oracle")
        assert_close(y, y_ref, REFERENCE_TOL["bfloat16"], "y vs reference")
    else:
        check_quantized(_sampled(y, rows), y64, f"add_rmsnorm {fmt}")


@pytest.mark.parametrize("fmt", [None, "fp8_per_token"])
def test_add_rmsnorm_in_place_on_the_device(rng, fmt):
    """Under jit with the residual (and, unquantized, x) donated, the compiled module launches
    the one kernel and copies nothing: the new residual is written over the old one."""
    x, r, w = (_rand(rng, (4096, 7168)), _rand(rng, (4096, 7168)), _rand(rng, (7168,)))
    donate = (1,) if fmt else (0, 1)
    fn = jax.jit(lambda *a: kp.add_rmsnorm(*a, out_format=fmt, impl="pallas"), donate_argnums=donate)
    text = fn.lower(x, r, w).compile().as_text()
    assert dict(hlo.data_moving_ops(text)) == {"custom-call": 1}, hlo.entry_instructions(text)
    want = kp.add_rmsnorm(x, r, w, out_format=fmt, impl="reference")[1]
    got = fn(jnp.array(x), jnp.array(r), w)[1]
    assert np.array_equal(codes_bytes(got), codes_bytes(want))


def test_unquantized_rmsnorm_and_sigmoid_mul(rng):
    for t, width in [(131072, 1536), (5, 72), (1000, 3000)]:
        x, w = _rand(rng, (t, width)), _rand(rng, (width,), jnp.float32)
        y = _compiled_twice_and_poisoned(lambda a, b: kp.rmsnorm(a, b, impl="pallas"), x, w)
        assert_close(y, kp.rmsnorm(x, w, impl="reference"), REFERENCE_TOL["bfloat16"])
        z = _compiled_twice_and_poisoned(lambda a, b: kp.sigmoid_mul(a, b, impl="pallas"), x, x)
        assert_close(z, kp.sigmoid_mul(x, x, impl="reference"), REFERENCE_TOL["bfloat16"])


def test_rmsnorm_2pow21_rows_of_2048():
    """8 GiB in, 8 GiB out: offsets past 2**32 bytes must not wrap (the lowering picks 64-bit)."""
    t, width = 2**21, 2048
    x = jax.jit(lambda k: (jax.random.normal(k, (t, width), jnp.float32)  # one 8 GiB buffer
                           * jnp.arange(1, t + 1, dtype=jnp.float32)[:, None]).astype(jnp.bfloat16)
                )(jax.random.PRNGKey(1))  # row-dependent
    w = jnp.ones((width,), jnp.float32)
    y = jax.jit(lambda a, b: kp.rmsnorm(a, b, impl="pallas"))(x, w)
    rows = np.array([0, 1, 2**20 - 1, 2**20, 2**20 + 1, t - 2, t - 1])
    assert_close(np.asarray(y[rows]), rmsnorm64(np.asarray(x[rows]), w, 1e-6), ORACLE_TOL["bfloat16"])


def test_nan_and_zero_tokens(rng):
    for name in ("float8_e4m3fn", FNUZ, "float8_e5m2"):
        x = np.asarray(rng.standard_normal((64, 12, 128)), np.float32)
        x[5] = 0.0
        x_nan = x.copy()
        x_nan[9, 0, 0] = np.nan
        g = jnp.asarray(rng.standard_normal((64, 12, 128)), jnp.bfloat16)
        w = jnp.ones((128,), jnp.float32)
        clean = kp.rmsnorm_gated_fp8_per_token(jnp.asarray(x), w, g, fp8_dtype=name, impl="pallas")
        dirty = kp.rmsnorm_gated_fp8_per_token(jnp.asarray(x_nan), w, g, fp8_dtype=name, impl="pallas")
        assert np.isnan(f64(dirty.scale)[9, 0]) and np.isnan(f64(dirty.data)[9]).all()
        keep = np.arange(64) != 9
        assert np.array_equal(codes_bytes(dirty.data)[keep], codes_bytes(clean.data)[keep])
        # A NaN gate: a NaN in y with a finite norm (Triton's float max drops NaN).
        g_nan = np.asarray(g, np.float32)
        g_nan[17, 3, 5] = np.nan
        dirty = kp.rmsnorm_gated_fp8_per_token(jnp.asarray(x), w, jnp.asarray(g_nan, jnp.bfloat16),
                                               fp8_dtype=name, impl="pallas")
        assert np.isnan(f64(dirty.scale)[17, 0]) and np.isnan(f64(dirty.data)[17]).all()
        keep = np.arange(64) != 17
        assert np.array_equal(codes_bytes(dirty.data)[keep], codes_bytes(clean.data)[keep])
        assert f64(clean.scale)[5, 0] == pytest.approx(clean.format.min_scale, rel=1e-7)
        assert (f64(clean.data)[5] == 0).all()


# The tuned table's decode buckets (91..181 and 182..362 tokens); odd, so that the entries with
# two rows per program end on a partial row block.
DECODE_T = (99, 201, 301)


@pytest.mark.parametrize("t", DECODE_T)
@pytest.mark.parametrize("name", list(bench_cases.OPS))
def test_decode_launch_configs(rng, name, t):
    """Every case at its model shapes with the launch config the table gives at decode T,
    compiled with poisoned outputs, against its reference: outputs within REFERENCE_TOL, FP8
    scales to 1e-6 and codes at most one step apart; MX scales and codes close (the kernel's
    float32 y may round apart from XLA's at a tie)."""
    spec = bench_cases.OPS[name]
    for cfg in spec.configs:
        structs, options = spec.example(t, jnp.dtype(jnp.bfloat16), **spec.sizes[cfg])
        args = [jnp.asarray(rng.standard_normal(s.shape), s.dtype) for s in structs]
        with testing.poisoned_outputs():
            got = jax.jit(lambda *a: spec.fn(*a, impl="pallas", **options))(*args)
        ref = jax.jit(lambda *a: spec.fn(*a, impl="reference", **options))(*args)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
            assert a.shape == b.shape and a.dtype == b.dtype, (cfg, a.shape, b.shape)
            af, bf = f64(np.asarray(a.astype(jnp.float32))), f64(np.asarray(b.astype(jnp.float32)))
            assert not np.isnan(af).any(), (name, cfg, t, "unwritten or NaN")
            if a.dtype in (jnp.float4_e2m1fn, jnp.float8_e8m0fnu) or spec.mx and jnp.dtype(a.dtype).itemsize == 1:
                assert np.mean(af != bf) < 5e-3, (name, cfg, t)  # MX: ties only
            elif jnp.dtype(a.dtype).itemsize == 1:  # FP8 codes
                assert (np.abs(af - bf) <= (np.abs(bf) / 8 + 2.0**-9) * 1.01).all(), (name, cfg, t)
            elif a.dtype == jnp.float32:  # FP8 scales (the other outputs are bf16 here)
                assert np.abs(af / bf - 1).max() <= 1e-6, (name, cfg, t)
            else:
                assert_close(a, b, REFERENCE_TOL[jnp.dtype(a.dtype).name], f"{name} {cfg} T={t}")


@pytest.mark.parametrize("name", ["fused_q_kv_rmsnorm", "fused_q_kv_rmsnorm_fp8_per_token",
                                  "mla_q_kv_norm", "mla_q_kv_norm_mx"])
@pytest.mark.parametrize("t", [1, 7, 255, 4096])
def test_two_programs_per_row_block(rng, name, t):
    """The two-program launch equals the one-program launch of the same rows and warps bit for
    bit (each segment runs the same code), with poisoned outputs; two rows per program (the
    decode entries) with a partial last block at T = 255."""
    spec = bench_cases.OPS[name]
    structs, options = spec.example(t, jnp.dtype(jnp.bfloat16), **spec.sizes[spec.configs[0]])
    args = [jnp.asarray(rng.standard_normal(s.shape), s.dtype) for s in structs]
    for rows, warps in ((1, 2), (2, 4)):
        outs = []
        for split in (1, 2):
            with hooks.forced(LaunchConfig(rows, warps, 1, split)), testing.poisoned_outputs():
                outs.append(jax.jit(lambda *a: spec.fn(*a, impl="pallas", **options))(*args))
        for a, b in zip(*(jax.tree_util.tree_leaves(o) for o in outs)):
            assert np.array_equal(codes_bytes(a), codes_bytes(b))


# ------------------------------------------------------------------------------------------------
# The FP8 conversion on the device
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["float8_e4m3fn", FNUZ, "float8_e5m2"])
def test_encoder_bit_exact_compiled(rng, name):
    v = encoder_inputs(name, rng, n_random=1_000_000)
    assert np.array_equal(encode_in_pallas(v, name, interpret=False), expected_codes(v, name))


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", FNUZ])
def test_fp8_cast_self_check_on_the_device(name):
    """The self-check kernel compiled for this GPU; where the target has a native conversion for
    the format, both paths agree on every value and auto picks native."""
    target = platform.current_target()
    reason = fp8_cast.native_unavailable(target, name)
    d = fp8_cast.decide(name, "auto", target=target)
    if reason:
        assert not d.native and d.reason == reason
        return
    assert fp8_cast.self_check(name, interpret=False) == ()
    assert d.native and "agree on all" in d.reason, d


@pytest.mark.parametrize("op", ["gated", "quantize", "mxfp8"])
@pytest.mark.parametrize("t", [7, 65536])
def test_native_and_encoder_kernels_agree(rng, op, t):
    """The kernels with the native conversion and with the encoder: the same scales and, on
    every non-NaN element, the same bytes."""
    fmt = kp.Fp8PerToken(jnp.float8_e4m3fn if platform.current_target().backend == "cuda"
                         else kp.default_fp8_dtype())
    if op == "gated":
        x, g = _rand(rng, (t, 32, 128), scale=2.0), _rand(rng, (t, 32, 128), scale=2.0)
        w = jnp.asarray(rng.uniform(0.2, 2.0, 128), jnp.float32)
        x = x.at[3].set(jnp.nan).at[5].set(0.0)
        run = lambda c: jax.jit(lambda *a: kp.rmsnorm_gated(  # noqa: E731
            *a, out_format=fmt, fp8_cast=c, impl="pallas"))(x, w, g)
    else:
        x = _rand(rng, (t, 4096), scale=3.0).at[3].set(jnp.nan).at[5].set(0.0)
        f = fmt if op == "quantize" else "mxfp8"
        run = lambda c: jax.jit(lambda a: kp.quantize(a, f, fp8_cast=c, impl="pallas"))(x)  # noqa: E731
    nat, enc = run("native"), run("encoder")
    a, b = codes_bytes(nat.data), codes_bytes(enc.data)
    nan = np.isnan(f64(enc.data.astype(jnp.float32)))
    assert np.array_equal(np.isnan(f64(nat.data.astype(jnp.float32))), nan) and nan[3].any()
    assert np.array_equal(a[~nan], b[~nan])
    assert np.array_equal(codes_bytes(nat.scale), codes_bytes(enc.scale))


def test_cross_device_scale_launches(rng):
    """The scale-only and given-scale launches, compiled, against the dynamic one: given the
    same scale the codes are bit-identical; the scale-only launch's scale within 1e-6 relative
    of the dynamic launch's (compiled without the codes, its arithmetic may be contracted
    differently: on the H200, 520 of 4096 rows differed, by at most 4 ulp)."""
    target = platform.current_target()
    q = common.Quant(kp.Fp8PerToken().resolve(target), False)
    x = jnp.asarray(rng.standard_normal((4096, 96, 128)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal(x.shape), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(128), jnp.float32)

    def run(mode, scale=None):
        return jax.jit(lambda x, g, w, s: gated.rmsnorm_gated_rows(
            x, g, w, key="rmsnorm_gated_fp8_per_token", eps=1e-5, activation="sigmoid", q=q,
            interpret=False, target=target, mode=mode, scale=s))(x, g, w, scale)

    codes, scale = run("dynamic")
    _, scale_only = run("scale_only")
    codes_given, _ = run("given_scale", scale)
    assert np.array_equal(codes_bytes(codes), codes_bytes(codes_given))
    s1, s2 = np.asarray(scale), np.asarray(scale_only)
    ulps = np.abs(s1.view(np.int32).astype(np.int64) - s2.view(np.int32).astype(np.int64))
    print(f"scale-only vs dynamic: {int((ulps > 0).sum())} of {ulps.size} rows differ, max {ulps.max()} ulp")
    np.testing.assert_allclose(s2, s1, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# The consumers; the blocks; sharding on the GPUs there are
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_the_fp8_linear_is_an_fp8_gemm(rng, layout):
    """XLA rewrites the fp8 dot into cuBLASLt's FP8 GEMM (with ``"nk"`` weights and nothing but
    the scaling epilogue around it; ``"kn"`` adds a transpose of the weight); the result matches
    the float64 dequantize-then-matmul oracle within the GEMM's accumulation error."""
    t, k, n = 256, 1536, 7168
    qa = kp.quantize(_rand(rng, (t, k)), kp.Fp8PerToken(jnp.float8_e4m3fn), impl="pallas")
    qw = kp.quantize_weight(_rand(rng, (k, n), scale=0.02), kp.Fp8PerToken(jnp.float8_e4m3fn),
                            layout=layout)
    fn = lambda qa, qw: kp.linear(qa, qw, out_dtype=jnp.float32)  # noqa: E731
    text = hlo.compiled_text(fn, qa, qw)
    assert hlo.FP8_GEMM_TARGET in hlo.custom_call_targets(text), hlo.entry_instructions(text)
    if layout == "nk":
        assert dict(hlo.data_moving_ops(text)) == {"custom-call": 1, "fusion": 1}, hlo.entry_instructions(text)
    out = jax.jit(fn)(qa, qw)
    d = f64(qa.data) * f64(qa.scale)
    w = f64(qw.dequantize())
    ref, mag = d @ w, np.abs(d) @ np.abs(w)
    ratio = float(np.max(np.abs(f64(out) - ref) / mag))
    print(f"linear fp8 {layout}: max |err| / (|a| @ |w|) = {ratio:.3g}")
    # Hopper's FP8 tensor cores accumulate with fewer than 24 mantissa bits (cuBLASLt fast
    # accumulation); the bound is 2**-10 of the accumulated magnitude.
    assert ratio <= 2**-10


def test_scaled_matmul_on_our_mxfp4_equals_it_on_jax_s_quantization(rng):
    """``linear`` (``jax.nn.scaled_matmul``) on our compiled MXFP4 output equals it on jax's own
    quantization of the same float32 values, and the float64 sum of the dequantized operands."""
    qw = kp.quantize_weight(_rand(rng, (1536, 512), scale=0.03), "mxfp4")
    y = _rand(rng, (64, 1536), jnp.float32, scale=4.0)
    ours = kp.quantize(y, "mxfp4", impl="pallas")
    theirs = kp.QuantizedActivation(*_compat.jax_mx_quantize(y, jnp.float4_e2m1fn), "mxfp4")
    mm = jax.jit(lambda qa: kp.linear(qa, qw, out_dtype=jnp.float32))
    a, b = np.asarray(mm(ours)), np.asarray(mm(theirs))
    assert np.array_equal(a, b)
    ref = f64(theirs.dequantize()) @ f64(qw.dequantize())
    np.testing.assert_allclose(a, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("impl", ["per_group", "dequantize", "scaled_dot"])
@pytest.mark.parametrize("t", [1, 7, 64, 4096])
def test_group_linear_on_the_device(rng, impl, t):
    """Each XLA lowering of the group-FP8 linear compiled for the GPU, at the Kimi-K3 TP8 o_proj
    (1536 -> 7168) on our compiled group quantization, against the float64 blockwise-dequantized
    product: ``per_group`` within the FP8 GEMM's accumulation (2**-10 of the magnitudes, as the
    per-token GEMM), the bfloat16 lowerings within 2**-7. Prints what XLA launched."""
    k, n = 1536, 7168
    qa = kp.quantize(_rand(rng, (t, k), scale=3.0), "fp8_group128", impl="pallas")
    qw = kp.quantize_weight(_rand(rng, (k, n), scale=0.02), "fp8_group128")
    fn = lambda qa, qw: kp.linear(qa, qw, out_dtype=jnp.float32, impl=impl)  # noqa: E731
    print(f"linear fp8_group128 {impl} T={t}:", hlo.entry_instructions(hlo.compiled_text(fn, qa, qw)))
    out = jax.jit(fn)(qa, qw)
    d = f64(qa.dequantize())
    w = f64(qw.dequantize())
    ref, mag = d @ w, np.abs(d) @ np.abs(w)
    assert np.max(np.abs(f64(out) - ref) / mag) <= (2**-10 if impl == "per_group" else 2**-7)


def test_model_blocks(rng):
    r = kimi_k3.run(tokens=256, impl="pallas", log=print)
    assert r["mla_front"]["q"] < 1e-2 and r["mla_front"]["kv_c"] < 1e-2
    assert r["mla_front"]["q_fp8_vs_bf16"] < 0.06 and r["mla_front"]["q_group_vs_bf16"] < 0.06
    for key in ("kda_out_12x128", "kda_out_96x128", "mla_out_12x128", "mla_out_96x128"):
        assert r[key]["fp8_vs_bf16"] < 0.06 and 0.1 < r[key]["mxfp4_vs_bf16"] < 0.25
    for key in ("kda_out_12x128", "kda_out_96x128"):
        assert r[key]["group_vs_f32"] < 0.06
    for key in ("mla_out_12x128", "mla_out_96x128"):
        assert r[key]["group_vs_bf16"] < 0.06
    assert r["decoder_attention_in"]["q"] < 1e-2 and r["decoder_attention_in"]["residual"] == 0
    assert r["mlp_in_group_tp8"]["act_vs_bf16"] < 0.08 and r["mlp_in_group_tp8"]["residual"] == 0


def test_inside_shard_map_and_with_shardings(rng):
    """On the GPUs there are (a one-device mesh here): the compiled kernels inside shard_map
    with its default varying-axes check, and under jit with NamedSharding operands (the
    custom_partitioning path), equal the plain call."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = jax.devices()
    mesh = Mesh(np.array(devices).reshape(len(devices), 1), ("dp", "tp"))
    x = jnp.asarray(rng.standard_normal((64 * len(devices), 12, 128)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal(x.shape), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(128), jnp.float32)
    for fmt in ("fp8_per_token", "mxfp4"):
        fn = lambda x, w, g: kp.rmsnorm_gated(x, w, g, out_format=fmt, impl="pallas")  # noqa: E731
        direct = jax.jit(fn)(x, w, g)
        smapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("dp", "tp"), P(), P("dp", "tp")),
                                        out_specs=P("dp", "tp")))(x, w, g)
        xs = jax.device_put(x, NamedSharding(mesh, P("dp", "tp")))
        gs = jax.device_put(g, NamedSharding(mesh, P("dp", "tp")))
        for other in (smapped, jax.jit(fn)(xs, w, gs)):
            assert np.array_equal(codes_bytes(other.scale), codes_bytes(direct.scale))
            assert np.array_equal(codes_bytes(other.data), codes_bytes(direct.data))
    q = jnp.asarray(rng.standard_normal((256, 2112)), jnp.bfloat16)
    ones = jnp.ones((1536,), jnp.bfloat16), jnp.ones((512,), jnp.bfloat16)
    mla = jax.jit(jax.shard_map(lambda a, wq, wkv: kp.mla_q_kv_norm(a, wq, wkv, impl="pallas"),
                                mesh=mesh, in_specs=(P("dp"), P(), P()), out_specs=P("dp")))
    for o, r in zip(mla(q, *ones), kp.mla_q_kv_norm(q, *ones, impl="pallas")):
        assert np.array_equal(np.asarray(o), np.asarray(r))


def test_pallas_copy_control_copies_on_the_norms_launch_config(rng):
    """bench.inspection.beside_add_norm.pallas_copy (the peers tool's copy through the library's
    row kernel): an exact copy of x and r, launched with the norm's rows and warps."""
    from bench.inspection import beside_add_norm

    x, r = (_rand(rng, (300, 7168)) for _ in range(2))
    w = _rand(rng, (7168,))

    def norm(x, r):
        return kp.add_rmsnorm(x, r, w, 1e-6, impl="pallas")
    copy = beside_add_norm.pallas_copy(norm, x, r)
    y, s = copy(x, r)
    assert np.array_equal(np.asarray(y), np.asarray(x)) and np.array_equal(np.asarray(s), np.asarray(r))
    (ours,) = _compat.triton_ir_modules(jax.jit(norm).lower(x, r))
    (mine,) = _compat.triton_ir_modules(copy.lower(x, r))
    assert (mine["grid"], mine["num_warps"]) == (ours["grid"], ours["num_warps"])
