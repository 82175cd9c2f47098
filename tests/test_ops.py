"""Every op in every output format, one test body: the kernel (interpret mode here, compiled with
``-m gpu``) and the jnp reference against independent float64 NumPy oracles, NaN-poisoned
outputs, at small shapes that still reach every code path: several rows per program and a
partial last block (T = 19, 16 rows per interpret program), non-power-of-two widths (padded
lanes, padded head / block pieces), a token's blocks over two kernel rows (MX, 96 blocks), and
in every input a zero row, a row holding NaN, a row scaled by 1e4 and a tiny one. Formats x
dtypes are sampled, not crossed: every op meets every format, every dtype, both activations.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp
from k3pallas import testing

from support import (ORACLE_TOL, assert_close_nan, check_quantized, f64, gated64, rmsnorm64,
                     sigmoid64)

T = 19  # > 16 rows per interpret program: two programs, the second partial
FORMATS = {
    None: None,
    "e4m3fn": kp.Fp8PerToken(jnp.float8_e4m3fn),
    "e4m3fnuz": kp.Fp8PerToken(jnp.float8_e4m3fnuz),
    "e4m3fnuz-240": kp.Fp8PerToken(jnp.float8_e4m3fnuz, fp8_max=240.0),
    "e5m2": kp.Fp8PerToken(jnp.float8_e5m2),
    "options": kp.Fp8PerToken(jnp.float8_e4m3fn, min_scale=1e-3, scale_ub=2.0),
    "mxfp8": kp.MXFP8,
    "mxfp4": kp.MXFP4,
    "group128": kp.FP8_GROUP128,
    "group128-ue8m0-fnuz": kp.Fp8Group(jnp.float8_e4m3fnuz, ue8m0=True),
    "group128-e5m2": kp.Fp8Group(jnp.float8_e5m2, eps=1e-4),
}
# Widths of the group formats' cases (multiples of 128), where the others' are not.
GROUPED = {name for name, f in FORMATS.items() if isinstance(f, kp.Fp8Group)}
DTYPES = ("bfloat16", "float16", "float32")


def tokens(rng, shape, dtype, specials=True):
    """Per-token magnitudes over 2**-4 .. 2**4; with ``specials``: token 2 zero, token 5 one
    NaN, token 7 scaled by 1e4 (100 in float16), token 11 by 1e-4."""
    x = rng.standard_normal(shape) * 2 * np.exp2(rng.integers(-4, 5, (shape[0],) + (1,) * (len(shape) - 1)))
    if specials:
        x[2] = 0.0
        x[5].flat[3] = np.nan
        x[7] *= 100.0 if dtype == "float16" else 1e4
        x[11] *= 1e-4
    return jnp.asarray(x, dtype)


def rounded(v64, dtype):
    """float64 values rounded once to ``dtype`` (ml_dtypes: round to nearest even)."""
    return np.asarray(v64).astype(jnp.dtype(dtype)).astype(np.float64)


def weight(rng, n, dtype="float32"):
    return jnp.asarray(rng.uniform(0.2, 2.0, n), dtype)


@dataclasses.dataclass(frozen=True)
class Case:
    """An op at one small shape: ``make(rng, dtype) -> arrays``; ``call(arrays, fmt, impl)``;
    ``oracle(arrays) -> float64 outputs``, the quantized one first as ``[..., N]`` per token."""

    make: Callable
    call: Callable
    oracle: Callable
    grouped: Callable | None = None  # ``make`` at widths in whole groups of 128 (group formats)

    def arrays(self, rng, dtype, fmt):
        return (self.grouped if fmt in GROUPED and self.grouped else self.make)(rng, dtype)


def _qkv(rng, dtype, rope, dq=96):
    q, kv = tokens(rng, (T, dq), dtype), tokens(rng, (T, 40), dtype, specials=False)
    pe = tokens(rng, (T, rope), dtype, specials=False)
    return q, kv, pe


def _gated(rng, dt, heads, dim):
    return (tokens(rng, (T, heads, dim), dt), weight(rng, dim),
            jnp.asarray(rng.standard_normal((T, heads, dim)) * 3, "float32" if dt == "float16" else dt))


CASES = {
    # Group formats: 384 columns (3 groups: pieces 2 + 1).
    "rmsnorm": Case(
        lambda rng, dt: (tokens(rng, (T, 96), dt), weight(rng, 96, dt)),
        lambda a, fmt, impl, **kw: kp.rmsnorm(*a, 1e-6, out_format=fmt, impl=impl, **kw),
        lambda a: (rmsnorm64(a[0], a[1], 1e-6),),
        lambda rng, dt: (tokens(rng, (T, 384), dt), weight(rng, 384, dt))),
    # The residual add: x and the residual (specials in x only), the sum rounded to the dtype.
    "add_rmsnorm": Case(
        lambda rng, dt: (tokens(rng, (T, 96), dt), tokens(rng, (T, 96), dt, specials=False),
                         weight(rng, 96, dt)),
        lambda a, fmt, impl, **kw: kp.add_rmsnorm(*a, 1e-6, out_format=fmt, impl=impl, **kw),
        lambda a: (lambda r: (rmsnorm64(r, a[2], 1e-6), r))(rounded(f64(a[0]) + f64(a[1]), a[0].dtype)),
        lambda rng, dt: (tokens(rng, (T, 384), dt), tokens(rng, (T, 384), dt, specials=False),
                         weight(rng, 384, dt))),
    "fused_q_kv_rmsnorm": Case(
        lambda rng, dt: (*_qkv(rng, dt, 0)[:2], weight(rng, 96, dt), weight(rng, 40)),
        lambda a, fmt, impl, **kw: kp.fused_q_kv_rmsnorm(*a, 1e-6, kv_eps=1e-5, out_format=fmt,
                                                         impl=impl, **kw),
        lambda a: (rmsnorm64(a[0], a[2], 1e-6), rmsnorm64(a[1], a[3], 1e-5)),
        lambda rng, dt: (*_qkv(rng, dt, 0, 384)[:2], weight(rng, 384, dt), weight(rng, 40))),
    # The packed sizes come from the weights: q_size = len(q_weight), kv_size = len(kv_weight).
    "mla_q_kv_norm": Case(
        lambda rng, dt: (jnp.concatenate(_qkv(rng, dt, 5), -1), weight(rng, 96), weight(rng, 40, dt)),
        lambda a, fmt, impl, **kw: kp.mla_q_kv_norm(*a, 1e-6, q_size=a[1].shape[0],
                                                    kv_size=a[2].shape[0], out_format=fmt,
                                                    impl=impl, **kw),
        lambda a: (lambda q, k: (rmsnorm64(a[0][:, :q], a[1], 1e-6),
                                 rmsnorm64(a[0][:, q:q + k], a[2], 1e-6),
                                 f64(a[0][:, q + k:])))(a[1].shape[0], a[2].shape[0]),
        lambda rng, dt: (jnp.concatenate(_qkv(rng, dt, 5, 384), -1), weight(rng, 384),
                         weight(rng, 40, dt))),
    # 15 heads: pieces 8 + 4 + (3 padded to 4); head dim 64 (2 blocks of 32). Group formats: 5
    # heads of 128 (pieces 4 + 1), a group per head.
    "rmsnorm_gated": Case(
        lambda rng, dt: _gated(rng, dt, 15, 64),
        lambda a, fmt, impl, act="sigmoid", **kw: kp.rmsnorm_gated(*a, 1e-5, activation=act,
                                                                   out_format=fmt, impl=impl, **kw),
        lambda a, act="sigmoid": (gated64(a[0], a[1], a[2], 1e-5, act),),
        lambda rng, dt: _gated(rng, dt, 5, 128)),
    # 3072 columns: pieces 2048 + 1024; MX: 96 blocks, two kernel rows of 48 per token; group
    # formats: 24 groups, two kernel rows of 12.
    "sigmoid_mul": Case(
        lambda rng, dt: (tokens(rng, (T, 3072), dt), jnp.asarray(rng.standard_normal((T, 3072)) * 3, dt)),
        lambda a, fmt, impl, **kw: kp.sigmoid_mul(*a, out_format=fmt, impl=impl, **kw),
        lambda a: (f64(a[0]) * sigmoid64(f64(a[1])),)),
    # 480 columns: pieces 256 + 128 + (96 padded to 128); MX: 15 blocks, 8 + 4 + (3 padded).
    # Group formats: 1920 columns, 15 groups alike.
    "quantize": Case(
        lambda rng, dt: (tokens(rng, (T, 480), dt),),
        lambda a, fmt, impl, **kw: kp.quantize(*a, fmt, impl=impl, **kw),
        lambda a: (f64(a[0]),),
        lambda rng, dt: (tokens(rng, (T, 1920), dt),)),
}

# (op, format, dtype): every op meets every format, one dtype each (every op meets every dtype).
# The variants of a format family (per-token e4m3fnuz, its 240 range, e5m2; group UE8M0 on
# e4m3fnuz, e5m2 with DeepSeek's eps) meet every other op in the fast tier, the rest in the slow.
VARIANTS = ("e4m3fnuz", "e4m3fnuz-240", "e5m2", "group128-ue8m0-fnuz", "group128-e5m2")
PARAMS = []
for i, op in enumerate(CASES):
    for j, fmt in enumerate(FORMATS):
        if op == "quantize" and fmt is None:
            continue
        if fmt == "options" and op not in ("quantize", "sigmoid_mul", "rmsnorm_gated"):
            continue
        slow = fmt in VARIANTS and (i + j) % 2
        PARAMS.append(pytest.param(op, fmt, DTYPES[(i + j) % 3],
                                   marks=[pytest.mark.slow] if slow else []))


def check(op, arrays, out, fmt, what, exact=False, **oracle_kw):
    """The outputs of ``op`` against its float64 oracle (``exact``: see ``check_quantized``)."""
    want = CASES[op].oracle(arrays, **oracle_kw)
    out = list(out) if isinstance(out, tuple) else [out]
    assert len(out) == len(want), (what, len(out), len(want))
    for i, (o, w) in enumerate(zip(out, want)):
        if isinstance(o, kp.QuantizedActivation):
            assert o.format == fmt, (what, o.format, fmt)
            check_quantized(o, w.reshape(o.data.shape), f"{what} output {i}", exact)
        else:
            dtype = arrays[0].dtype if i != 1 or op == "mla_q_kv_norm" else arrays[1].dtype
            assert o.dtype == dtype, (what, i, o.dtype)
            assert_close_nan(o, w.reshape(o.shape), ORACLE_TOL[jnp.dtype(dtype).name],
                             f"{what} output {i}")


@pytest.mark.parametrize("impl", [
    "interpret", "reference", pytest.param("pallas", marks=pytest.mark.gpu),
    # the jnp reference as XLA compiles it for the GPU: its NaNs are the GPU's (canonical)
    pytest.param("reference", marks=pytest.mark.gpu, id="reference-on-gpu")])
@pytest.mark.parametrize("op,fmt,dtype", PARAMS)
def test_against_the_float64_oracle(rng, op, fmt, dtype, impl):
    case = CASES[op]
    arrays = case.arrays(rng, dtype, fmt)
    f = FORMATS[fmt]
    fmt_value = None if f is None else f.resolve(kp.current_target())
    with testing.poisoned_outputs():
        out = jax.jit(lambda *a: case.call(a, f, impl))(*arrays)
    # The quantization's input is the float32 of x itself: its group codes are exact.
    check(op, arrays, out, fmt_value, f"{op} {fmt} {dtype} {impl}", exact=op == "quantize")


@pytest.mark.parametrize("fmt,width", [("mxfp8", 224), ("mxfp4", 224), ("group128", 896),
                                       ("group128-ue8m0-fnuz", 896)])
def test_one_padded_block_piece(rng, fmt, width):
    """7 blocks per row (DeepSeek-V3's hidden size has 224 and 56): the block axis as ONE piece
    padded to 8, its last block masked, not three exact pieces (``block_scaled.block_parts``)."""
    from k3pallas.kernels import block_scaled
    assert block_scaled.block_parts(7, padded=True) == [(0, 8)]
    assert len(block_scaled.block_parts(6, padded=True)) == 2
    assert len(block_scaled.block_parts(7)) == 3  # the row kernels: exact pieces
    arrays = (tokens(rng, (T, width), "bfloat16"),
              tokens(rng, (T, width), "bfloat16", specials=False), weight(rng, width, "bfloat16"))
    f = FORMATS[fmt]
    with testing.poisoned_outputs():
        out = jax.jit(lambda *a: CASES["add_rmsnorm"].call(a, f, "interpret"))(*arrays)
    check("add_rmsnorm", arrays, out, f.resolve(kp.current_target()), f"padded piece {fmt}")


def test_mxfp4_tiles_pack_alike(rng):
    """The block epilogue's two MXFP4 tiles (``block_scaled.pieces``): pair tiles ``[R, b, 16,
    2]`` (the norms) and block tiles ``[R, b, 32]`` paired after the encoder (the gated and row
    kernels) give the same code bytes and scales, and the bytes hold element 2j low."""
    from k3pallas.kernels import block_scaled, common
    y = rng.standard_normal((4, 3, 32)).astype(np.float32) * np.float32(2.0) ** rng.integers(
        -20, 20, (4, 3, 1))
    y[0, 1] = 0.0
    y[2, 0, 5] = np.nan
    q = common.Quant(kp.MXFP4, native=False)
    codes, scale = block_scaled.block_codes(jnp.asarray(y), q, trail=1)
    pair_codes, pair_scale = block_scaled.block_codes(jnp.asarray(y).reshape(4, 3, 16, 2), q,
                                                      trail=2)
    np.testing.assert_array_equal(np.asarray(codes), np.asarray(pair_codes))
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(pair_scale))
    ref = kp.MXFP4.quantize(jnp.asarray(y.reshape(4, 96)))
    nibbles = np.asarray(ref[0]).view(np.uint8).reshape(4, 3, 16, 2) & 0xF  # NaN blocks: 0x8
    np.testing.assert_array_equal(np.asarray(codes), nibbles[..., 0] | nibbles[..., 1] << 4)
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(ref[1]).view(np.uint8).reshape(4, 3))


@pytest.mark.parametrize("fmt", [None, "e4m3fnuz", "mxfp4"])
def test_silu(rng, fmt):
    """The gated norm's other activation (the body above runs sigmoid)."""
    case = CASES["rmsnorm_gated"]
    arrays = case.make(rng, "bfloat16")
    f = FORMATS[fmt]
    with testing.poisoned_outputs():
        out = jax.jit(lambda *a: case.call(a, f, "interpret", act="silu"))(*arrays)
    check("rmsnorm_gated", arrays, out, None if f is None else f.resolve(kp.current_target()),
          f"silu {fmt}", act="silu")


@pytest.mark.parametrize("op,groups", [("quantize", 4), ("sigmoid_mul", 3), ("rmsnorm_gated", 5)])
def test_per_token_groups(rng, op, groups):
    """``groups`` scales per token (of the columns; of the heads for the gated norm)."""
    case = CASES[op]
    arrays = case.make(rng, "bfloat16")
    f = kp.Fp8PerToken(jnp.float8_e4m3fn, groups=groups)
    with testing.poisoned_outputs():
        out = jax.jit(lambda *a: case.call(a, f, "interpret"))(*arrays)
    assert out.scale.shape == (T, groups)
    check(op, arrays, out, f.resolve(kp.current_target()), f"{op} groups={groups}")


@pytest.mark.parametrize("op", ["rmsnorm", "rmsnorm_gated", "quantize"])
def test_a_nan_changes_no_other_token(rng, op):
    """The outputs of every token but the one holding the NaN are those of a clean run, bit for
    bit (per-token FP8; MX likewise per block, checked by the oracle above)."""
    case = CASES[op]
    arrays = case.make(rng, "float32")
    clean = (jnp.where(jnp.isnan(arrays[0]), 1.0, arrays[0]),) + arrays[1:]
    fn = jax.jit(lambda *a: case.call(a, FORMATS["e4m3fn"], "interpret"))
    dirty, ok = fn(*arrays), fn(*clean)
    others = np.arange(T) != 5
    assert np.isnan(np.asarray(dirty.scale)[5]).all()
    assert np.array_equal(np.asarray(dirty.data).view(np.uint8)[others],
                          np.asarray(ok.data).view(np.uint8)[others])
    assert np.array_equal(np.asarray(dirty.scale)[others], np.asarray(ok.scale)[others])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_residual_is_the_rounded_sum(rng, dtype):
    """The new residual is the float32 sum rounded once to the dtype, bit for bit as the
    reference and within the dtype's rounding of the float64 sum; and the norm is that of the
    stored sum (as vLLM's ``fused_add_rms_norm``), not of the unrounded one."""
    case = CASES["add_rmsnorm"]
    x, r, w = case.make(rng, dtype)
    for fmt in (None, "e4m3fn"):
        f = FORMATS[fmt]
        y, new = jax.jit(lambda *a: kp.add_rmsnorm(*a, out_format=f, impl="interpret"))(x, r, w)
        y_ref, new_ref = kp.add_rmsnorm(x, r, w, out_format=f, impl="reference")
        assert new.dtype == r.dtype and np.array_equal(np.asarray(new, np.float64),
                                                       np.asarray(new_ref, np.float64), equal_nan=True)
    want = rounded(f64(x) + f64(r), dtype)
    np.testing.assert_array_equal(f64(new), want)
    y_plain = kp.rmsnorm(new, w, 1e-6, impl="interpret")
    y_fused = kp.add_rmsnorm(x, r, w, 1e-6, impl="interpret")[0]
    assert np.array_equal(np.asarray(y_plain, np.float64), np.asarray(y_fused, np.float64), equal_nan=True)


@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_add_rmsnorm_nan_weight_is_a_nan_token(rng, impl):
    """A NaN weight lane gives a NaN in every token's y with a finite norm: every per-token scale
    and code is NaN (the amax beside the norm carries it; Triton's float max would drop it),
    and the new residual is still the exact sum."""
    x, r, w = CASES["add_rmsnorm"].make(rng, jnp.bfloat16)
    w = w.at[w.shape[0] // 3].set(jnp.nan)
    q, new = kp.add_rmsnorm(x, r, w, out_format="fp8_per_token", impl=impl)
    assert np.isnan(f64(q.scale)).all() and np.isnan(f64(q.data)).all()
    np.testing.assert_array_equal(f64(new), rounded(f64(x) + f64(r), jnp.bfloat16))


def test_add_rmsnorm_updates_the_residual_in_place():
    """The kernel writes the new residual over the residual's buffer and an unquantized output
    over x's (``input_output_aliases``, as vLLM updates both): under jit with both donated the
    compiled module aliases them (x -> y, residual -> new residual); a quantized output leaves
    x alone and the residual alone is donated."""
    import re

    x, r, w = jnp.ones((64, 256), jnp.bfloat16), jnp.ones((64, 256), jnp.bfloat16), jnp.ones(256)

    def aliases(fn, donate):
        head = jax.jit(fn, donate_argnums=donate).lower(x, r, w).compile().as_text().splitlines()[0]
        return sorted(re.findall(r"\{(\d+)\}: \((\d+), \{\}", head))
    assert aliases(lambda *a: kp.add_rmsnorm(*a, impl="interpret"), (0, 1)) == [("0", "0"), ("1", "1")]
    assert aliases(lambda *a: kp.add_rmsnorm(*a, out_format="fp8_per_token", impl="interpret"),
                   (1,)) == [("2", "1")]
    with pytest.raises(ValueError, match="add_rmsnorm: residual must have the shape and dtype of x"):
        kp.add_rmsnorm(x, r.astype(jnp.float32), w)
    with pytest.raises(ValueError, match="add_rmsnorm: residual must have the shape and dtype of x"):
        kp.add_rmsnorm(x, r[:3], w)

