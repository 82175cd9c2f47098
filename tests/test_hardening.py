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


@pytest.mark.slow  # three subprocesses (fast tier: 9.5 s)
@pytest.mark.parametrize("cmd,match", [
    (["-m", "k3pallas.models.kimi_k3", "--tokens", "0"], "expected a whole number >= 1, got 0"),
    (["-m", "bench", "--tokens", "-3"], "--tokens: expected whole numbers >= 1"),
    (["-m", "bench", "--tokens", "x"], "--tokens: expected whole numbers >= 1"),
])
def test_command_lines_refuse_bad_token_counts_in_one_line(cmd, match):
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode != 0
    assert match in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# Round 4 of bad inputs (issue 59): each finding, fixed
# ------------------------------------------------------------------------------------------------


def test_round4_readme_example_weight_from_an_activation_format():
    """The README's API example: ``quantize_weight(w_o, qa.format)`` with ``qa`` from a per-token
    op (its format carries the resolved min_scale, and groups where given): the weight takes the
    format's element type and max, not its activation-only fields."""
    x, g = jnp.ones((4, 2, 128)), jnp.ones((4, 2, 128))
    for fmt in ("fp8_per_token", kp.Fp8PerToken(groups=2, scale_ub=10.0)):
        qa = kp.rmsnorm_gated(x, jnp.ones(128), g, out_format=fmt)
        qw = kp.quantize_weight(jnp.ones((256, 64)), qa.format)
        assert qw.format == kp.Fp8PerToken(qa.format.dtype).resolve(None).bind(qa.format.dtype)
        assert kp.linear(qa, qw).shape == (4, 64)


@pytest.mark.parametrize("args,err,match", [
    (("mxfp8", jnp.float8_e4m3fn, 448.0, 2), ValueError, r"Mx: mxfp8 stores 1 element\(s\) per byte"),
    (("mxfp8", jnp.float16, 448.0, 1), TypeError, r"Mx: mxfp8 elements \(dtype\) are float8_e4m3fn"),
    (("mxfp4", jnp.float4_e2m1fn, 448.0, 2), ValueError, "Mx: mxfp4 elem_max is 6.0"),
    (("mxfp6", jnp.float8_e4m3fn, 448.0, 1), ValueError, "Mx: name must be one of"),
])
def test_round4_hand_built_mx_values_are_validated(args, err, match):
    """A hand-built ``Mx`` mixing the two formats' fields wrote float4 codes under the name mxfp8
    in interpret mode, e4m3fn ones in the reference, silently."""
    with pytest.raises(err, match=match):
        kp.formats.Mx(*args)
    assert kp.formats.Mx("mxfp8", jnp.float8_e4m3fn, 448, 1) == kp.MXFP8


def test_round4_fp8_format_fields_named_in_errors():
    assert kp.Fp8Group(ue8m0=np.True_).ue8m0 is True  # numpy's bool is a bool
    with pytest.raises(TypeError, match=r"Fp8Group: ue8m0 must be True or False, got 1 \(int\)"):
        kp.Fp8Group(ue8m0=1)
    with pytest.raises(TypeError, match="Fp8Group: dtype must be one of float8_e4m3fn"):
        kp.Fp8Group(dtype=jnp.float16)
    with pytest.raises(TypeError, match="Fp8PerToken: dtype must be one of"):
        kp.Fp8PerToken(dtype="int8")
    with pytest.raises(ValueError, match="Fp8PerToken: groups must be an integer"):
        kp.Fp8PerToken(groups=0)


def test_round4_linear_and_dequantize_arguments_named():
    qa = kp.quantize(jnp.ones((2, 256)), "fp8_per_token", impl="reference")
    qw = kp.quantize_weight(jnp.ones((256, 8)), "fp8_per_token")
    with pytest.raises(ValueError, match="linear: precision must be None, a jax.lax.Precision"):
        kp.linear(qa, qw, precision="ultra")
    with pytest.raises(TypeError, match="linear: out_dtype must be float16, bfloat16 or float32, got 'bf16'"):
        kp.linear(qa, qw, out_dtype="bf16")
    assert kp.linear(qa, qw, precision="highest").dtype == jnp.bfloat16
    with pytest.raises(TypeError, match="QuantizedActivation.dequantize: dtype must be a floating dtype"):
        qa.dequantize("bogus")
    with pytest.raises(TypeError, match="QuantizedWeight.dequantize: dtype must be a floating dtype"):
        qw.dequantize("bogus")


def test_round4_records_index_like_the_seed_tuples():
    """The seed's names return ``(q, scale)`` in vLLM; ported code indexes them."""
    x = jnp.ones((3, 2, 64))
    for out in (kp.per_token_fp8_quant(x.reshape(3, 128)),
                kp.rmsnorm_gated_fp8_per_token(x, jnp.ones(64), x)):
        assert len(out) == 2 and out[0] is out.data and out[1] is out.scale and out[-1] is out.scale
        q, s = out
        assert q is out.data and s is out.scale
    qw = kp.quantize_weight(jnp.ones((64, 8)), "fp8_per_token")
    assert len(qw) == 2 and qw[0] is qw.data and qw[1] is qw.scale
