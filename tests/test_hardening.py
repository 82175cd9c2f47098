"""Option extremes and newcomer traps (issue 23): values float32 cannot hold, the exact range of
the FP8 scale, names and errors, the command lines."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import k3pallas as kp

ROOT = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__)))


@pytest.mark.parametrize("call", [
    lambda: kp.rmsnorm(jnp.zeros((1, 4)), jnp.ones(4), 1e-50),
    lambda: kp.fused_q_kv_rmsnorm(jnp.zeros((1, 4)), jnp.zeros((1, 4)), jnp.ones(4), jnp.ones(4), kv_eps=1e-45),
    lambda: kp.per_token_fp8_quant(jnp.zeros((1, 8)), min_scale=1e-40),
    lambda: kp.per_token_fp8_quant(jnp.zeros((1, 8)), scale_ub=1e-39),
    lambda: kp.rmsnorm(jnp.zeros((1, 4)), jnp.ones(4), 1e39),
], ids=["eps", "kv_eps", "min_scale", "scale_ub", "eps_overflow"])
def test_values_float32_cannot_hold_are_refused(call):
    """They passed "finite and > 0" and became 0 in float32: NaN rows, a zero scale."""
    with pytest.raises(ValueError, match=r"outside \[1\.17549e-38"):
        call()


def test_the_smallest_allowed_values_are_exact():
    tiny = float(np.finfo(np.float32).tiny)
    for impl in ("reference", "interpret"):
        assert np.array_equal(np.asarray(kp.rmsnorm(jnp.zeros((1, 4)), jnp.ones(4), tiny, impl=impl)),
                              np.zeros((1, 4)))
        qa = kp.per_token_fp8_quant(jnp.zeros((1, 8)), min_scale=tiny, impl=impl)
        assert float(qa.scale[0, 0]) == np.float32(tiny) and not np.asarray(qa.data, np.float32).any()


@pytest.mark.parametrize("fp8_max,min_scale", [(1.0, None), (1e-30, None), (3.9, None), (448.0, 1e38)])
def test_scales_whose_reciprocal_flushes_are_refused(fp8_max, min_scale):
    """With fp8_max = 1 a row of 3e38 had scale 3e38, whose reciprocal (what XLA and the kernels
    multiply by) is subnormal and flushed: every code 0."""
    with pytest.raises(ValueError, match="fp8_max|min_scale"):
        kp.per_token_fp8_quant(jnp.full((1, 4), 3e38), fp8_max=fp8_max, min_scale=min_scale)


@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_large_values_are_exact_at_the_smallest_fp8_max(impl):
    x = jnp.asarray([[3e38, -3e38, 1.5e38, 0.0], [1e30, 2e30, -4e30, 3e30]], jnp.float32)
    qa = kp.per_token_fp8_quant(x, fp8_max=4.0, impl=impl)
    out = np.asarray(qa.dequantize(), np.float64)
    want = np.asarray(x, np.float64)
    assert np.all(np.abs(out - want) <= 0.0626 * np.abs(want).max(axis=1, keepdims=True)), out
    assert np.abs(out[0, 0] - 3e38) / 3e38 < 1e-6


def test_names_and_kinds():
    assert kp.default_fp8_dtype("mi300x") == jnp.dtype(jnp.float8_e4m3fnuz)
    assert kp.default_fp8_dtype("h200") == jnp.dtype(jnp.float8_e4m3fn)
    assert kp.default_fp8_dtype("sm_90a") == jnp.dtype(jnp.float8_e4m3fn)
    assert kp.default_fp8_dtype("AMD Instinct MI355X") == jnp.dtype(jnp.float8_e4m3fn)
    for junk in ("gfxJUNK", "gfx999", "MI400X", "tpu"):
        with pytest.raises(ValueError, match="unknown device name"):
            kp.default_fp8_dtype(junk)
    with pytest.raises(TypeError, match="default_fp8_dtype: device must be"):
        kp.default_fp8_dtype(123)


def test_traced_static_options_raise_type_errors_alike():
    a = jnp.zeros((2, 2112), jnp.float32)
    wq, wkv = jnp.ones(1536), jnp.ones(512)
    with pytest.raises(TypeError, match="eps must be a Python float"):
        jax.jit(lambda e: kp.mla_q_kv_norm(a, wq, wkv, e))(1e-6)
    with pytest.raises(TypeError, match="q_size must be a Python int"):
        jax.jit(lambda q: kp.mla_q_kv_norm(a, wq, wkv, q_size=q))(1536)


def test_the_fp8_output_size_refusal_names_the_op_for_every_impl():
    x = jax.ShapeDtypeStruct((2**19, 4096), jnp.bfloat16)  # 2**31 one-byte codes
    for impl in ("reference", "interpret"):
        with pytest.raises(ValueError, match=r"^per_token_fp8_quant: an fp8 output of shape"):
            jax.eval_shape(lambda a: kp.per_token_fp8_quant(a, impl=impl), x)


def test_dequantize_refuses_an_integer_dtype():
    qa = kp.per_token_fp8_quant(jnp.ones((2, 8)), impl="reference")
    with pytest.raises(TypeError, match="dtype must be floating"):
        qa.dequantize(jnp.int8)
    assert qa.dequantize(jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_silu_of_a_minus_inf_gate_is_nan_as_jax(impl):
    """The documented definition: act(-inf) = -inf * sigmoid(-inf) = NaN, as jax.nn.silu."""
    x = jnp.ones((1, 2, 8))
    g = jnp.zeros((1, 2, 8)).at[0, 0, 3].set(-jnp.inf)
    out = np.asarray(kp.rmsnorm_gated(x, jnp.ones(8), g, activation="silu", impl=impl))
    assert np.isnan(float(jax.nn.silu(-jnp.inf)))
    assert np.isnan(out[0, 0, 3]) and np.isfinite(np.delete(out.ravel(), 3)).all()


def test_an_infinite_weight_column_has_an_infinite_scale():
    w = jnp.ones((4, 3)).at[1, 2].set(jnp.inf)
    qw = kp.quantize_weight_per_channel(w, fp8_dtype="float8_e4m3fn", w_layout="kn")
    scale = np.asarray(qw.scale)
    assert np.isinf(scale[2]) and np.isfinite(scale[:2]).all()
    codes = np.asarray(qw.data, np.float32)[:, 2]
    assert np.isnan(codes[1]) and (codes[[0, 2, 3]] == 0).all()


def test_e5m2_nan_bytes_of_the_encoder_are_the_hosts():
    from k3pallas import fp8

    v = np.array([np.nan, -np.nan], np.float32)
    host = v.astype(ml_dtypes.float8_e5m2).view(np.uint8)
    assert np.asarray(fp8.encode_fp8(jnp.asarray(v), jnp.float8_e5m2)).tolist() == host.tolist() == [0x7E, 0xFE]


@pytest.mark.parametrize("cmd,match", [
    (["-m", "k3pallas.models.kimi_k3", "--tokens", "0"], "expected a whole number >= 1, got 0"),
    (["-m", "k3pallas.models.kimi_k3", "--tokens", "-1"], "expected a whole number >= 1"),
    (["-m", "bench", "--tokens", "-3"], "--tokens: expected whole numbers >= 1"),
    (["-m", "bench", "--tokens", "0"], "--tokens: expected whole numbers >= 1"),
    (["-m", "bench", "--tokens", "x"], "--tokens: expected whole numbers >= 1"),
])
def test_command_lines_refuse_bad_token_counts_in_one_line(cmd, match):
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode != 0
    assert match in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
