"""Option extremes and newcomer traps: values float32 cannot hold, the exact range of the FP8
scale, the command lines."""

from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("call", [
    lambda: kp.rmsnorm(jnp.zeros((1, 4)), jnp.ones(4), 1e-50),
    lambda: kp.fused_q_kv_rmsnorm(jnp.zeros((1, 4)), jnp.zeros((1, 4)), jnp.ones(4), jnp.ones(4), kv_eps=1e-45),
    lambda: kp.per_token_fp8_quant(jnp.zeros((1, 8)), min_scale=1e-40),
    lambda: kp.quantize(jnp.zeros((1, 8)), kp.Fp8PerToken(scale_ub=1e-39)),
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


@pytest.mark.parametrize("cmd,match", [
    (["-m", "k3pallas.models.kimi_k3", "--tokens", "0"], "expected a whole number >= 1, got 0"),
    (["-m", "bench", "--tokens", "-3"], "--tokens: expected whole numbers >= 1"),
    (["-m", "bench", "--tokens", "x"], "--tokens: expected whole numbers >= 1"),
])
def test_command_lines_refuse_bad_token_counts_in_one_line(cmd, match):
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode != 0
    assert match in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
