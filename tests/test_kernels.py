"""The kernels' own behaviour below the API, in interpret mode: launch configs (rows per program
with partial blocks, two programs per row block), the gated FP8 kernel's two forms, the
cross-device scale launches, results that do not depend on the token count, rows out of the
float32 range."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp
from bench import cases as bench_cases
from k3pallas import platform, testing
from k3pallas.kernels import common, gated, hooks, launch, norms
from k3pallas.kernels.launch import LaunchConfig

from support import (ORACLE_TOL, assert_close, check_quantized, f64, gated64, quant_oracle,
                     rmsnorm64, same_but_ulps)

CPU = platform.target_from_name("cpu")
E4M3FN = kp.Fp8PerToken(jnp.float8_e4m3fn).resolve(CPU)


def _u8(a):
    return np.asarray(a).view(np.uint8)


# ------------------------------------------------------------------------------------------------
# Launch configs
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows,warps", [(1, 1), (2, 4), (4, 8), (16, 2)])
def test_rows_per_program_with_a_partial_block(rng, rows, warps):
    """Every rows-per-program value, with a partial last block (37 rows), gives the oracle's."""
    q = jnp.asarray(rng.standard_normal((37, 1000)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((37, 72)), jnp.bfloat16)
    wq = jnp.asarray(rng.standard_normal(1000), jnp.float32)
    wkv = jnp.asarray(rng.standard_normal(72), jnp.float32)
    with hooks.forced(LaunchConfig(rows, warps)), testing.poisoned_outputs():
        q_out, kv_out = kp.fused_q_kv_rmsnorm(q, kv, wq, wkv, impl="interpret")
        qa = kp.quantize(q[:, :992], "mxfp4", impl="interpret")
    assert_close(q_out, rmsnorm64(q, wq, 1e-6), ORACLE_TOL["bfloat16"])
    assert_close(kv_out, rmsnorm64(kv, wkv, 1e-6), ORACLE_TOL["bfloat16"])
    check_quantized(qa, f64(q[:, :992]), "mxfp4 quantize")


# Each op at one rows-per-program value in the fast tier, at the other in the slow one.
@pytest.mark.parametrize("name,rows", [
    (name, rows) if (i + rows) % 2 else pytest.param(name, rows, marks=pytest.mark.slow)
    for i, name in enumerate(["fused_q_kv_rmsnorm", "fused_q_kv_rmsnorm_fp8_per_token",
                              "mla_q_kv_norm", "mla_q_kv_norm_mx"]) for rows in (1, 4)])
def test_two_programs_per_row_block(rng, name, rows):
    """split = 2 for the joint norms: q on one program of a row block, kv (and the rope
    columns) on another, in the same launch; the same results as one program, bit for bit but
    for float32 rounding (``support.same_but_ulps``)."""
    spec = bench_cases.OPS[name]
    structs, options = spec.example(5, jnp.dtype(jnp.bfloat16), **spec.sizes["test"])
    args = [jnp.asarray(rng.standard_normal(s.shape), s.dtype) for s in structs]
    whole = spec.fn(*args, impl="interpret", **options)
    with hooks.forced(LaunchConfig(rows, 4, 1, 2)), testing.poisoned_outputs():
        split = spec.fn(*args, impl="interpret", **options)
    same_but_ulps(whole, split, name)
    with hooks.forced(LaunchConfig(rows, 4, 1, 4)):
        with pytest.raises(ValueError, match="cannot do for this row shape"):
            spec.fn(*args, impl="interpret", **options)


def test_split_errors(rng):
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.bfloat16)
    w = jnp.ones(64, jnp.float32)
    with hooks.forced(LaunchConfig(1, 4, 1, 2)):  # one segment: nothing to put on two programs
        with pytest.raises(ValueError, match="cannot do for this row shape"):
            kp.rmsnorm(x, w, impl="interpret")
        with pytest.raises(ValueError, match="cannot do for this row shape"):  # the row kernels
            kp.per_token_fp8_quant(x, impl="interpret")
    g3 = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.bfloat16)
    q = common.Quant(E4M3FN, False)
    with pytest.raises(ValueError, match="cannot do for this row shape"):  # a config passed in
        gated.rmsnorm_gated_rows(g3, g3, w, key="rmsnorm_gated_fp8_per_token", eps=1e-5,
                                 activation="sigmoid", q=q, interpret=True, target=CPU,
                                 config=LaunchConfig(1, 4, 1, 2))
    with pytest.raises(ValueError, match="power of two"):
        LaunchConfig(1, 4, 1, 3)
    with pytest.raises(ValueError, match="quantized \\(first\\) segment must be normalized"):
        norms.segments_rows([x], [norms.Segment(0, 0, 64, None)], [], key="rmsnorm", q=q,
                            interpret=True, target=CPU)


def test_tuned_entries(monkeypatch):
    """The tuned table per arch and launch key; a split entry applies where the kernel can split,
    else the next entry (or the heuristic) does."""
    table = {"sm_90": {"fused_q_kv_rmsnorm": [[8, 2560, 1, 2, 1, 2], [2**31, 2560, 1, 1, 1]],
                       "rmsnorm": [[8, 2048, 1, 2, 1, 2], [2**31, 2048, 1, 8, 1]]}}
    monkeypatch.setattr(launch, "tuned_table", lambda: table)
    h200 = platform.target_for("NVIDIA H200", "cuda")
    assert launch.launch_config("fused_q_kv_rmsnorm", 1, 2560, 2048, target=h200, splits=(2,)) == \
        LaunchConfig(1, 2, 1, 2)
    assert launch.launch_config("fused_q_kv_rmsnorm", 64, 2560, 2048, target=h200, splits=(2,)) == \
        LaunchConfig(1, 1, 1)
    assert launch.launch_config("rmsnorm", 1, 2048, 2048, target=h200) == LaunchConfig(1, 8, 1)
    # Another launch key (the op with an output format) has entries of its own.
    assert launch.launch_config("rmsnorm_mxfp4", 1, 2048, 2048, target=h200) == \
        launch.heuristic_config("rmsnorm_mxfp4", 1, 2048, 2048, h200)


def test_the_shipped_table_names_launch_keys_that_exist():
    """Every op of the shipped tuned table is a launch key the kernels use (an op, or an op with
    an output format), so no entry is dead after a rename."""
    keys = set()
    for spec in bench_cases.OPS.values():  # the keys the benchmark's cases launch with
        for sizes in spec.sizes.values():
            structs, options = spec.example(8, jnp.dtype("bfloat16"), **sizes)
            with hooks.recording() as log:
                fn = lambda *a, _s=spec, _o=options: _s.fn(*a, impl="interpret", **_o)  # noqa: E731
                jax.jit(fn).trace(*structs)
            keys |= {launched.op for launched in log}
    for arch, entries in launch.tuned_table().items():
        assert set(entries) <= keys, (arch, set(entries) - keys)


def test_the_residual_add_loads_the_weight_first_at_decode():
    """Per-token ``add_rmsnorm`` loads the weight with x and the residual where its programs fit
    the cores at once (a core each: decode); other outputs, or more programs, after the new
    residual's store."""
    h200 = platform.target_for("NVIDIA H200", "cuda")  # 132 SMs
    per_token = common.Quant(kp.Fp8PerToken(jnp.float8_e4m3fn).resolve(h200), True)
    assert norms.loads_weight_first(per_token, 132, h200)
    assert not norms.loads_weight_first(per_token, 133, h200)
    mxfp8 = common.Quant(kp.MXFP8.resolve(h200), True)
    assert not norms.loads_weight_first(mxfp8, 1, h200)
    assert not norms.loads_weight_first(None, 1, h200)


@pytest.mark.parametrize("first", [True, False], ids=["weight_first", "weight_after_store"])
def test_add_rmsnorm_either_load_order(rng, monkeypatch, first):
    """Both load orders of the residual add: the exact rounded sum over the residual and the
    oracle's per-token FP8 of its norm, from NaN-poisoned outputs."""
    monkeypatch.setattr(norms, "loads_weight_first", lambda *a: first)
    x = jnp.asarray(rng.standard_normal((5, 200)) * 2, jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal((5, 200)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(200) * 0.5 + 1, jnp.float32)
    with testing.poisoned_outputs():
        qa, new = jax.jit(lambda *a: kp.add_rmsnorm(*a, out_format="fp8_per_token",
                                                    impl="interpret"))(x, r, w)
    want = (f64(x) + f64(r)).astype(jnp.bfloat16)  # one rounding of the exact sum (ml_dtypes RNE)
    np.testing.assert_array_equal(f64(new), f64(want))
    check_quantized(qa, rmsnorm64(f64(new), w, 1e-6), f"weight first: {first}")


# ------------------------------------------------------------------------------------------------
# The gated FP8 kernel's two forms; the cross-device scale launches
# ------------------------------------------------------------------------------------------------


@pytest.fixture(params=[True, False], ids=["beside_norm", "after_norm"])
def gated_form(request, monkeypatch):
    """Both forms of the gated FP8 kernel's amax (``gated.amax_beside_norm`` picks one by shape)
    at the same shapes."""
    monkeypatch.setattr(gated, "amax_beside_norm", lambda n_rows, heads: request.param)
    return request.param


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"])
def test_gated_fp8_forms(rng, gated_form, name):
    """Zero rows, a NaN row, huge and tiny magnitudes and scale_ub in one call, both forms."""
    t, h, d = 9, 5, 96
    x = rng.standard_normal((t, h, d)) * 2
    x[2] = 0.0
    x[4] *= 1e4
    x[6, 3, 17] = np.nan
    g = jnp.asarray(rng.standard_normal((t, h, d)) * 2, jnp.float32)
    w = jnp.asarray(rng.uniform(0.2, 2.0, d), jnp.float32)
    x = jnp.asarray(x, jnp.float32)
    y64 = gated64(x, w, g, 1e-5, "sigmoid").reshape(t, h * d)
    ub = float(np.nanmedian(np.max(np.abs(y64), axis=1)))
    for fmt in (kp.Fp8PerToken(name), kp.Fp8PerToken(name, scale_ub=ub)):
        with testing.poisoned_outputs():
            qa = kp.rmsnorm_gated(x, w, g, out_format=fmt, impl="interpret")
        check_quantized(qa, y64, f"{name} {fmt}")
        assert (f64(qa.data)[2] == 0).all() and np.isnan(f64(qa.scale)[6, 0])


@pytest.mark.parametrize("form", ["gated", "gated_after_norm", "quantize", "sigmoid_mul"])
def test_scale_only_and_given_scale_launches(rng, form):
    """The two launches of the cross-device scale (k3pallas.sharding): "scale_only" gives the
    dynamic launch's scale within 1e-6 (compiled without the codes its arithmetic may round
    differently: up to 2 ulp on XLA 0.12's CPU in the gated kernel's beside-the-norm form) and
    the same NaN rows; "given_scale" with the dynamic scale gives its codes bit for bit, and with
    a larger scale (another device's) the codes of that scale."""
    x = jnp.asarray(rng.standard_normal((37, 12, 64)) * 2, jnp.bfloat16).at[5, 3, 7].set(jnp.nan)
    g = jnp.asarray(rng.standard_normal((37, 12, 64)), jnp.bfloat16)
    kw = dict(q=common.Quant(E4M3FN, False), interpret=True, target=CPU)
    if form.startswith("gated"):
        w = jnp.asarray(rng.standard_normal(64), jnp.float32)
        rows = functools.partial(gated.rmsnorm_gated_rows, x, g, w, eps=1e-5, activation="sigmoid",
                                 key="rmsnorm_gated_fp8_per_token", beside_norm=form == "gated",
                                 **kw)
    elif form == "quantize":
        rows = functools.partial(gated.quantize_rows, x.reshape(37, -1), key="quantize_fp8_per_token", **kw)
    else:
        rows = functools.partial(gated.sigmoid_mul_rows, x.reshape(37, -1), g.reshape(37, -1),
                                 key="sigmoid_mul_fp8_per_token", **kw)
    with testing.poisoned_outputs():
        codes, scale = rows()
        none, scale_only = rows(mode="scale_only")
        codes_given, none2 = rows(mode="given_scale", scale=scale)
        codes_big, _ = rows(mode="given_scale", scale=scale * 2)
    assert none is None and none2 is None
    s1, s2 = np.asarray(scale), np.asarray(scale_only)
    assert np.array_equal(np.isnan(s1), np.isnan(s2))
    np.testing.assert_allclose(s2, s1, rtol=1e-6)
    assert np.isnan(s1[5]) and np.isnan(np.asarray(codes, np.float32)[5]).all()
    assert np.array_equal(_u8(codes), _u8(codes_given))
    c1 = np.asarray(codes, np.float64)[np.arange(37) != 5]
    c2 = np.asarray(codes_big, np.float64)[np.arange(37) != 5]
    assert np.abs(c2).max() <= 224.5 and np.abs(c1).max() == 448  # half the range used
    with pytest.raises(ValueError, match="mode must be one of"):
        rows(mode="static")
    with pytest.raises(ValueError, match="exactly in mode 'given_scale'"):
        rows(mode="given_scale")
    with pytest.raises(ValueError, match="exactly in mode 'given_scale'"):
        rows(scale=scale)


# ------------------------------------------------------------------------------------------------
# A token's result does not depend on the token count
# ------------------------------------------------------------------------------------------------


def _first_rows(fn, ns, n_first=1):
    """``fn(T)``'s first rows at each T of ``ns``, the same (interpret mode: fixed rows per
    program, so the same sums whatever T; sharding changes the local T): bit for bit but for
    float32 rounding, which XLA's CPU optimizer may do apart in the programs of two token
    counts on jax 0.12.1 (``support.same_but_ulps``; seen at T = 1 and 33)."""
    def first(out):
        return [np.asarray(a)[:n_first] for a in jax.tree_util.tree_leaves(out)]

    base = first(fn(ns[0]))
    for t in ns[1:]:
        same_but_ulps(base, first(fn(t)), f"T={t} changes the first rows")


@pytest.mark.parametrize("fmt", [None, "fp8_per_token", "mxfp4"])
def test_results_do_not_depend_on_the_token_count(rng, fmt):
    ns = (1, 33)  # one partial row block, then three (the slow tier: five counts)
    t = ns[-1]
    packed = jnp.asarray(rng.standard_normal((t, 96 + 40 + 5)) * 2, jnp.bfloat16)
    wq, wkv = jnp.asarray(rng.uniform(0.5, 2, 96), jnp.bfloat16), jnp.asarray(rng.uniform(0.5, 2, 40), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((t, 12, 64)) * 2, jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((t, 12, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.5, 2, 64), jnp.float32)
    mla = jax.jit(lambda a: kp.mla_q_kv_norm(a, wq, wkv, q_size=96, kv_size=40, out_format=fmt,
                                             impl="interpret"))
    _first_rows(lambda n: mla(packed[:n]), ns)
    gate = jax.jit(lambda a, b: kp.rmsnorm_gated(a, w, b, out_format=fmt, impl="interpret"))
    _first_rows(lambda n: gate(x[:n], g[:n]), ns)
    if fmt is not None:
        quant = jax.jit(lambda a: kp.quantize(a, fmt, impl="interpret"))
        _first_rows(lambda n: quant(x[:n].reshape(n, -1)), ns)


@pytest.mark.slow
@pytest.mark.parametrize("heads", [12, 32, 96])
def test_results_do_not_depend_on_the_token_count_at_model_sizes(rng, heads):
    ns = (1, 7, 16, 33, 130)
    t = ns[-1]
    x = jnp.asarray(rng.standard_normal((t, heads, 128)) * 2, jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((t, heads, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.5, 2, 128), jnp.float32)
    for fmt in (None, "fp8_per_token", "mxfp4"):
        fn = jax.jit(lambda a, b: kp.rmsnorm_gated(a, w, b, out_format=fmt, impl="interpret"))
        _first_rows(lambda n: fn(x[:n], g[:n]), ns)
    q = jnp.asarray(rng.standard_normal((t, 2112)) * 2, jnp.bfloat16)
    wq, wkv = jnp.asarray(rng.uniform(0.5, 2, 1536), jnp.bfloat16), jnp.asarray(rng.uniform(0.5, 2, 512), jnp.bfloat16)
    for fmt in (None, "fp8_per_token"):
        mla = jax.jit(lambda a: kp.mla_q_kv_norm(a, wq, wkv, out_format=fmt, impl="interpret"))
        _first_rows(lambda n: mla(q[:n]), ns)


# ------------------------------------------------------------------------------------------------
# Rows out of the float32 range
# ------------------------------------------------------------------------------------------------

HUGE = 2e19  # its square overflows float32


def _nan_rows(a):
    a = f64(a).reshape(a.shape[0], -1)
    return np.isnan(a).all(axis=1), np.isnan(a).any(axis=1)


@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_an_overflowing_norm_is_a_nan_row(rng, impl):
    x = rng.standard_normal((6, 384)).astype(np.float32)
    x[1, 7] = HUGE           # one huge value
    x[3, :] = 1e18           # all large: the sum of the squares overflows (each square does not)
    x[4, 9] = np.inf
    w = jnp.asarray(rng.standard_normal(384), jnp.float32)
    for dtype in (jnp.bfloat16, jnp.float32):
        xj = jnp.asarray(x, dtype)
        out = kp.rmsnorm(xj, w, impl=impl)
        full, anyn = _nan_rows(out)
        assert full.tolist() == [False, True, False, True, True, False]
        assert not anyn[[0, 2, 5]].any()
        assert np.isnan(rmsnorm64(np.asarray(xj), w, 1e-6)[[1, 3, 4]]).all()  # the oracle too
        clean = kp.rmsnorm(xj[np.array([0, 2, 5])], w, impl=impl)
        np.testing.assert_array_equal(f64(out)[[0, 2, 5]], f64(clean))
        qa = kp.rmsnorm(xj, w, out_format="mxfp8", impl=impl)  # quantized: NaN blocks there
        assert np.isnan(f64(qa.dequantize()))[[1, 3, 4]].all()
        assert not np.isnan(f64(qa.dequantize()))[[0, 2, 5]].any()
    ok = kp.rmsnorm(jnp.full((1, 384), 1e17, jnp.float32), w, impl=impl)  # sum 3.8e36: fits
    assert not np.isnan(f64(ok)).any()


@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_overflow_and_inf_tokens_of_the_gated_fp8_op(rng, impl):
    t, h, d = 8, 12, 64
    x = rng.standard_normal((t, h, d)).astype(np.float32)
    g = rng.standard_normal((t, h, d)).astype(np.float32)
    x[2, 5, 3] = HUGE        # overflowing head: NaN head, so NaN token
    g[4, 0, 0] = np.inf      # silu(inf) = inf: an infinity in y
    g[4, 1, 7] = np.nan      # a NaN in y with a finite norm (sigmoid(inf) is 1): the amax carries it
    w = jnp.asarray(rng.uniform(0.5, 2.0, d), jnp.float32)
    for activation, bad in (("sigmoid", [2, 4]), ("silu", [2, 4])):
        qa = kp.rmsnorm_gated_fp8_per_token(jnp.asarray(x), w, jnp.asarray(g),
                                            activation=activation, impl=impl)
        scale = np.asarray(qa.scale)[:, 0]
        assert np.flatnonzero(np.isnan(scale)).tolist() == bad, (activation, scale)
        full, anyn = _nan_rows(qa.data)
        assert np.flatnonzero(full).tolist() == bad and np.flatnonzero(anyn).tolist() == bad
        good = [i for i in range(t) if i not in bad]
        clean = kp.rmsnorm_gated_fp8_per_token(jnp.asarray(x[good]), w, jnp.asarray(g[good]),
                                               activation=activation, impl=impl)
        np.testing.assert_array_equal(scale[good], np.asarray(clean.scale)[:, 0])
        np.testing.assert_array_equal(_u8(qa.data)[good], _u8(clean.data))
    y = kp.rmsnorm_gated(jnp.asarray(x), w, jnp.asarray(g), impl=impl)  # no FP8: only the head
    assert np.argwhere(np.isnan(f64(y)).all(axis=-1)).tolist() == [[2, 5]]
    # silu(-inf) = -inf * sigmoid(-inf) = NaN, as jax.nn.silu.
    g2 = jnp.zeros((1, 2, 8)).at[0, 0, 3].set(-jnp.inf)
    out = np.asarray(kp.rmsnorm_gated(jnp.ones((1, 2, 8)), jnp.ones(8), g2, activation="silu", impl=impl))
    assert np.isnan(float(jax.nn.silu(-jnp.inf)))
    assert np.isnan(out[0, 0, 3]) and np.isfinite(np.delete(out.ravel(), 3)).all()


# e4m3fn on both paths in the fast tier; e4m3fnuz and e5m2 on one each (the other: slow tier).
@pytest.mark.parametrize("impl,name", [
    ("interpret", "float8_e4m3fn"), ("reference", "float8_e4m3fn"),
    ("interpret", "float8_e4m3fnuz"), ("reference", "float8_e5m2"),
    pytest.param("reference", "float8_e4m3fnuz", marks=pytest.mark.slow),
    pytest.param("interpret", "float8_e5m2", marks=pytest.mark.slow)])
def test_per_token_inf_is_nan_and_large_values_keep_their_scale(rng, impl, name):
    x = rng.standard_normal((5, 256)).astype(np.float32)
    x[1, 3], x[3, 0] = np.inf, -np.inf
    for ub in (None, 1.0):
        qa = kp.quantize(jnp.asarray(x), kp.Fp8PerToken(name, scale_ub=ub), impl=impl)
        scale = np.asarray(qa.scale)[:, 0]
        assert np.flatnonzero(np.isnan(scale)).tolist() == [1, 3]
        full, anyn = _nan_rows(qa.data)
        assert np.flatnonzero(full).tolist() == [1, 3] and np.flatnonzero(anyn).tolist() == [1, 3]
        s64, _ = quant_oracle(x, name, scale_ub=ub)
        np.testing.assert_allclose(scale[[0, 2, 4]], s64[[0, 2, 4]], rtol=1e-6)
    big = (rng.standard_normal((3, 512)) * 1e30).astype(np.float32)
    qa = kp.quantize(jnp.asarray(big), kp.Fp8PerToken(name), impl=impl)
    np.testing.assert_allclose(np.asarray(qa.scale)[:, 0],
                               np.abs(big).max(axis=1) / kp.Fp8PerToken(name).resolve(CPU).fp8_max,
                               rtol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="documents XLA's CPU behaviour")
def test_denormal_inputs_are_flushed_on_the_cpu():
    """Documented: XLA on the CPU flushes float32 denormals; interpret and reference agree."""
    x, w = jnp.full((2, 64), 1e-39, jnp.float32), jnp.ones(64, jnp.float32)
    for impl in ("interpret", "reference"):
        assert np.array_equal(np.asarray(kp.rmsnorm(x, w, impl=impl)), np.zeros((2, 64), np.float32))
