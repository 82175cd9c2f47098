"""Property tests (hypothesis, a deterministic profile as jax's Pallas tests use) and trace
counts (chex).

Drawn for every format: shapes, magnitudes from 1e-30 to 1e30 per row, zero rows, NaN and
infinity placements. Checked: the quantization against the float64 oracle bit for bit (the
scale rules: float32 ``amax / fp8_max``, UE8M0 and e8m0 powers of two), the round trip within
the format's bound, a NaN or infinity confined to its own token (per-token) or block,
re-quantization of a dequantized record, mis-built records refused; the kernels in interpret
mode against the reference at drawn row counts, widths and head layouts. chex: each public op
and ``linear`` traced once per shape and option set under ``jax.jit``, records in and out.
Cost: about 50 s of CPU in the fast tier (jax 0.10.2; the examples are few: each new shape
compiles).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import k3pallas as kp
from bench import cases as bench_cases

from support import check_quantized, f64, same_but_ulps

settings.register_profile("k3pallas", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.function_scoped_fixture])
settings.load_profile("k3pallas")

FORMATS = {
    "per_token_e4m3fn": kp.Fp8PerToken(jnp.float8_e4m3fn),
    "per_token_e4m3fnuz": kp.Fp8PerToken(jnp.float8_e4m3fnuz),
    "per_token_e5m2_groups": kp.Fp8PerToken(jnp.float8_e5m2, groups=2),
    "group_f32": kp.Fp8Group(jnp.float8_e4m3fn),
    "group_ue8m0_fnuz": kp.Fp8Group(jnp.float8_e4m3fnuz, ue8m0=True),
    "mxfp8": kp.MXFP8,
    "mxfp4": kp.MXFP4,
}
# Mantissa bits and the smallest subnormal of each element type: a code is within half a step,
# 2**-(m + 1) of the value, or half the smallest subnormal times the scale.
ELEMENT = {"float8_e4m3fn": (3, 2.0**-9), "float8_e4m3fnuz": (3, 2.0**-10),
           "float8_e5m2": (2, 2.0**-16), "float4_e2m1fn": (1, 0.5)}


def _unit(fmt) -> int:
    """Columns per scale unit: the block, or 64 for per-token (any width works)."""
    return fmt.block or 64


@st.composite
def activations(draw, fmt, max_rows=6, max_units=3):
    """float32 ``[T, N]``: each row a magnitude 10**e (e in [-30, 30]) or zero; maybe a NaN or
    an infinity at a drawn place."""
    # Few distinct shapes (each new one compiles the jitted reference): the values vary.
    rows = draw(st.sampled_from(sorted({1, 4, max_rows})))
    units = draw(st.sampled_from(sorted({1, max_units})))
    n = units * _unit(fmt)
    if isinstance(fmt, kp.Fp8PerToken) and fmt.groups > 1:
        n = units * fmt.groups * 32
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    exps = np.array([draw(st.integers(-30, 30)) for _ in range(rows)], np.float64)
    y = rng.standard_normal((rows, n)) * 10.0**exps[:, None]
    zero = draw(st.integers(-1, rows - 1))
    if zero >= 0:
        y[zero] = 0.0
    special = draw(st.sampled_from([None, np.nan, np.inf, -np.inf]))
    if special is not None:
        y[draw(st.integers(0, rows - 1)), draw(st.integers(0, n - 1))] = special
    return y.astype(np.float32)


def _scale_units(fmt, n):
    """Columns each scale covers."""
    if isinstance(fmt, kp.Fp8PerToken):
        return n // fmt.groups
    return fmt.block


@pytest.mark.parametrize("name", list(FORMATS))
@settings(max_examples=6)
@given(data=st.data())
def test_quantize_matches_the_oracle_and_round_trips(name, data):
    fmt = FORMATS[name]
    y = data.draw(activations(fmt))
    qa = kp.quantize(jnp.asarray(y), fmt, impl="reference")
    check_quantized(qa, y.astype(np.float64), what=name, exact=True)
    # The round trip: within half a step of each value, or half the smallest subnormal step.
    m, sub = ELEMENT[jnp.dtype(qa.format.dtype).name]
    n = y.shape[-1]
    per = _scale_units(qa.format, n)
    scale = np.repeat(f64(qa.scale), per, axis=-1)
    back = f64(qa.dequantize())
    finite = np.isfinite(scale)
    err = np.abs(back - y)[finite]
    bound = 2.0**-(m + 1) * np.abs(y.astype(np.float64))[finite] + 0.5 * sub * scale[finite]
    assert np.all(err <= bound * (1 + 2**-20)), name
    # NaN / inf poison their own scale unit only.
    units = y.reshape(y.shape[0], -1, per)
    poisoned = ~np.isfinite(units).all(axis=-1)
    assert np.array_equal(np.isnan(f64(qa.scale)), poisoned), name


@pytest.mark.parametrize("name", list(FORMATS))
@settings(max_examples=5)
@given(data=st.data())
def test_requantizing_a_dequantized_record(name, data):
    """A dequantized record quantizes back: float32 scales to the same codes and the scale
    within an ulp (``max(code) * s / fp8_max`` rounds, and so the values); power-of-two scales
    (UE8M0, MX) to exactly the same values (where a block's largest code sits below half the
    largest element, on a finer scale with other codes)."""
    fmt = FORMATS[name]
    y = data.draw(activations(fmt))
    y[~np.isfinite(y)] = 1.0
    qa = kp.quantize(jnp.asarray(y), fmt, impl="reference")
    back = qa.dequantize()
    qb = kp.quantize(back, fmt, impl="reference")
    if isinstance(fmt, kp.formats.Mx) or getattr(fmt, "ue8m0", False):
        chex.assert_trees_all_equal(qb.dequantize(), back)  # a fixed point in values
    else:
        chex.assert_trees_all_equal(np.asarray(qb.data).view(np.uint8),
                                    np.asarray(qa.data).view(np.uint8))
        chex.assert_trees_all_close(qb.scale, qa.scale, rtol=2**-22, atol=0)  # one float32 ulp
        chex.assert_trees_all_close(qb.dequantize(), back, rtol=2**-22, atol=0)  # one float32 ulp


@pytest.mark.parametrize("name", ["per_token_e4m3fn", "group_f32", "mxfp4"])
@settings(max_examples=5)
@given(data=st.data())
def test_records_refuse_what_their_format_does_not_write(name, data):
    fmt = FORMATS[name].resolve(kp.current_target())
    y = data.draw(activations(fmt, max_rows=3, max_units=2))
    y[~np.isfinite(y)] = 0.0
    qa = kp.quantize(jnp.asarray(y), fmt, impl="reference")
    kp.QuantizedActivation(qa.data, qa.scale, fmt)  # as written: accepted
    cut = data.draw(st.sampled_from(["rows", "groups", "dtype", "rank"]))
    if cut == "rows":
        bad = (qa.data, qa.scale[:-1] if qa.scale.shape[0] > 1 else jnp.concatenate([qa.scale] * 2))
    elif cut == "groups":
        bad = (qa.data, jnp.concatenate([qa.scale, qa.scale], axis=-1))
    elif cut == "dtype":
        bad = (qa.data, qa.scale.astype(jnp.bfloat16) if qa.scale.dtype == jnp.float32
               else qa.scale.view(jnp.uint8))
    else:
        bad = (qa.data, qa.scale[None])
    with pytest.raises((TypeError, ValueError), match="QuantizedActivation"):
        kp.QuantizedActivation(*bad, fmt)


@pytest.mark.parametrize("name", ["per_token_e4m3fn", "group_f32", "mxfp8"])
@settings(max_examples=2)
@given(data=st.data())
def test_kernels_in_interpret_mode_match_the_reference(name, data):
    """The quantization and the gated norm's kernels at drawn row counts, widths and head
    layouts (interpret mode; each example compiles, so few)."""
    fmt = FORMATS[name]
    y = data.draw(activations(fmt, max_rows=20, max_units=3))
    same_but_ulps(kp.quantize(jnp.asarray(y), fmt, impl="interpret"),
                  kp.quantize(jnp.asarray(y), fmt, impl="reference"), name)
    heads = data.draw(st.integers(1, 5))
    dim = 128 if fmt.block in (None, 128) else 64
    rows = data.draw(st.integers(1, 9))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    x = jnp.asarray(rng.standard_normal((rows, heads, dim)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((rows, heads, dim)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((dim,)), jnp.float32)
    outs = [kp.rmsnorm_gated(x, w, g, out_format=fmt, impl=impl) for impl in ("interpret", "reference")]
    same_but_ulps(outs[0], outs[1], f"{name} gated")


# ------------------------------------------------------------------------------------------------
# chex: one trace per shape and option set
# ------------------------------------------------------------------------------------------------


# Each public op once, with an output format where it has one (its first quantized case).
_TRACED = {}
for _name, _spec in bench_cases.OPS.items():
    if "test" in _spec.sizes and (_spec.op not in _TRACED or bench_cases.OPS[_TRACED[_spec.op]].family is None):
        _TRACED[_spec.op] = _name


@pytest.mark.parametrize("case", sorted(_TRACED.values()))
def test_each_op_traces_once_per_shape(case):
    """Under jax.jit, called again with new arrays of the same shapes, an op's function is not
    traced again (records come out)."""
    spec = bench_cases.OPS[case]
    structs, options = spec.example(5, jnp.dtype(jnp.bfloat16), **spec.sizes["test"])
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def fn(*arrays):
        return spec.fn(*arrays, impl="reference", **options)

    for seed in range(3):
        keys = jax.random.split(jax.random.PRNGKey(seed), len(structs))
        args = [jax.random.normal(k, s.shape, jnp.float32).astype(s.dtype) for k, s in zip(keys, structs)]
        jax.block_until_ready(fn(*args))


@pytest.mark.parametrize("fmt", ["fp8_group128", "fp8_per_token", "mxfp8"])
@pytest.mark.parametrize("impl", ["auto", "interpret"])
def test_linear_traces_once_with_records_in_and_out(fmt, impl):
    if impl == "interpret" and fmt == "mxfp8":
        pytest.skip("no Pallas GEMM for MX")
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def layer(x, qw):
        qa = kp.quantize(x, fmt, impl="reference")
        return qa, kp.linear(qa, qw, impl=impl)

    qw = kp.quantize_weight(jnp.ones((256, 64)), fmt)
    for seed in range(3):
        x = jax.random.normal(jax.random.PRNGKey(seed), (4, 256), jnp.bfloat16)
        qa, out = layer(x, qw)
        assert isinstance(qa, kp.QuantizedActivation) and out.shape == (4, 64)


@pytest.mark.slow
def test_a_fresh_process_traces_once(tmp_path):
    """In a fresh process (nothing imported by earlier tests), the first interpret-mode calls
    define no new jit trace-context option: a function jitted before them traces once, not again
    on its second call (jax 0.12 defines one in a module the first interpret call imports;
    ``k3pallas._compat`` imports it up front)."""
    import subprocess
    import sys

    script = tmp_path / "fresh.py"
    script.write_text("""
import chex, jax, jax.numpy as jnp, k3pallas as kp
qw = kp.quantize_weight(jnp.ones((256, 64)), "fp8_group128")
@jax.jit
@chex.assert_max_traces(n=1)
def layer(x):
    qa = kp.rmsnorm(x, jnp.ones(256, jnp.bfloat16), out_format="fp8_group128", impl="interpret")
    return kp.linear(qa, qw, impl="interpret")
for seed in range(3):
    layer(jax.random.normal(jax.random.PRNGKey(seed), (4, 256), jnp.bfloat16))
print("ok")
""")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
