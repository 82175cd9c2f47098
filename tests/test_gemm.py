"""The scaled FP8 GEMM (``linear`` with ``impl="pallas"`` / ``"interpret"``, ``kernels.gemm``)
against a float64 oracle: the dequantized operands' product.

Fast tier: interpret mode at small shapes reaching every path (T = 1 / 7 / 33, a partial last
block of N, K of one group and of several, both layouts, the decode (swapped) and prefill tiles,
per-token groups, per-channel and per-tensor weight scales, every FP8 element type, UE8M0), with
NaN-poisoned outputs; NaN and zero tokens; launch configs; deviceless lowering (one launch, the
FP8 operands straight into ``tt.dot``). GPU tier: production shapes and the accumulation error
at K = 7168.

Error bound (float32 output): the products of FP8 codes are exact in float32 and the scales are
applied in float32, so ``|out - ref| <= gamma * sum_k |a_k w_k|`` (the product of the magnitudes,
``mag``) with gamma a few float32 roundings per K step and per partial sum: 1e-5 here at
K <= 384. On a GPU the matrix cores' partial sums may keep fewer bits (measured at K = 7168 in
the GPU tier; docs/formats.md, Consumers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3pallas as kp
from k3pallas import platform, testing
from k3pallas.kernels import gemm, hooks, launch
from k3pallas.kernels.launch import GemmConfig

from support import f64

S = jax.ShapeDtypeStruct


def _oracle(qa, qw):
    """float64 product of the dequantized operands, and the magnitudes ``|a| @ |w|``."""
    a = f64(qa.dequantize()).reshape(-1, qa.data.shape[-1])
    w = f64(qw.dequantize())
    return a @ w, np.abs(a) @ np.abs(w)


def _operands(rng, t, k, n, fmt, layout="nk"):
    """A quantized activation [t, k] (rows of very different magnitudes, groups too) and weight."""
    x = rng.standard_normal((t, k)) * rng.uniform(0.01, 100, (t, 1))
    x = x * np.repeat(rng.uniform(0.1, 10, k // 64), 64)[None, :k] if k % 64 == 0 else x
    w = rng.standard_normal((k, n)) * np.repeat(rng.uniform(0.01, 1, -(-n // 32)), 32)[None, :n]
    qa = kp.quantize(jnp.asarray(x, jnp.float32), fmt, impl="reference")
    wf = kp.Fp8PerToken(qa.format.dtype) if isinstance(qa.format, kp.Fp8PerToken) else qa.format
    qw = kp.quantize_weight(jnp.asarray(w, jnp.float32), wf, layout=layout)
    return qa, qw


def _run(qa, qw, cfg=None, out_dtype=jnp.float32):
    def f(a, w):
        if cfg is None:
            return kp.linear(a, w, impl="interpret", out_dtype=out_dtype)
        with hooks.forced(cfg):
            return kp.linear(a, w, impl="interpret", out_dtype=out_dtype)
    with testing.poisoned_outputs():
        return jax.jit(f)(qa, qw)


G8 = kp.Fp8Group
CASES = [
    # (T, K, N, format, layout, forced config or None)
    (1, 256, 200, "fp8_group128", "nk", None),
    (1, 128, 200, "fp8_group128", "nk", GemmConfig(16, 64, 128, 4, 2, swap=True)),
    (7, 384, 200, "fp8_group128_ue8m0", "kn", GemmConfig(16, 128, 128, 4, 2, swap=True,
                                                         scale_prefetch=True, k_unroll=2)),
    (7, 384, 130, G8(jnp.float8_e4m3fnuz), "nk", GemmConfig(16, 32, 64, 4, 2, k_unroll=4)),
    (33, 256, 200, "fp8_group128", "kn", GemmConfig(32, 64, 128, 4, 2, scale_prefetch=True)),
    (33, 384, 130, G8(jnp.float8_e4m3fnuz, ue8m0=True), "kn", None),
    (33, 256, 136, G8(jnp.float8_e5m2), "nk", GemmConfig(16, 16, 32, 4, 1, scale_prefetch=True)),
    (1, 200, 72, "fp8_per_token", "nk", None),
    (7, 200, 72, kp.Fp8PerToken(jnp.float8_e4m3fnuz), "kn", GemmConfig(16, 64, 64, 4, 2, True,
                                                                       k_unroll=2)),
    (33, 320, 100, kp.Fp8PerToken(jnp.float8_e5m2, groups=5), "nk",
     GemmConfig(32, 32, 64, 4, 2, scale_prefetch=True, k_unroll=2)),
    (33, 256, 100, kp.Fp8PerToken(groups=2), "kn", GemmConfig(16, 128, 128, 4, 2, True)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-K{c[1]}-N{c[2]}-{kp.formats.as_format(c[3]).name}"
                         f"-{getattr(kp.formats.as_format(c[3]), 'dtype', None)}-{c[4]}-{c[5] and c[5].as_entry()}")
def test_gemm_against_the_oracle(rng, case):
    t, k, n, fmt, layout, cfg = case
    qa, qw = _operands(rng, t, k, n, fmt, layout)
    ref, mag = _oracle(qa, qw)
    out = _run(qa, qw, cfg)
    assert out.shape == (t, n) and out.dtype == jnp.float32
    assert np.all(np.abs(f64(out) - ref) <= 1e-5 * mag + 1e-30), "float32 output vs oracle"
    if case in (CASES[0], CASES[7]):  # a bf16 output: one rounding of the float32 result
        out16 = _run(qa, qw, cfg, jnp.bfloat16)
        assert out16.dtype == jnp.bfloat16
        np.testing.assert_array_equal(f64(out16), f64(out.astype(jnp.bfloat16)))


def test_unrolled_steps_past_k_add_nothing(rng):
    """``k_unroll`` past K (3 steps in iterations of 2): the step past the last adds exactly 0,
    also where the last weight block's scale is infinite (the infinities of one step an
    iteration, no 0 * inf NaN), with and without prefetched scales."""
    qa, qw = _operands(rng, 7, 384, 200, "fp8_group128")
    qw = kp.QuantizedWeight(qw.data, qw.scale.at[0, -1].set(jnp.inf), qw.format, qw.layout)
    for base, unrolled in ((GemmConfig(16, 64, 128, 4, 2), GemmConfig(16, 64, 128, 4, 2, k_unroll=2)),
                           (GemmConfig(16, 64, 128, 4, 2, True),
                            GemmConfig(16, 64, 128, 4, 2, True, scale_prefetch=True, k_unroll=4))):
        want = np.asarray(_run(qa, qw, base))
        assert np.isinf(want).any() and not np.isnan(want).any()
        got = np.asarray(_run(qa, qw, unrolled))  # finite sums may round apart (XLA's fusion)
        finite = np.isfinite(want)
        np.testing.assert_array_equal(got[~finite], want[~finite])
        scale = np.max(np.abs(want[finite]))  # float32 roundings of the largest partial sums
        assert np.max(np.abs(got[finite] - want[finite])) <= 1e-5 * scale


def test_per_tensor_weight_scale_and_leading_axes(rng):
    qa, qw = _operands(rng, 6, 256, 96, "fp8_per_token")
    qa = kp.QuantizedActivation(qa.data.reshape(2, 3, 256), qa.scale.reshape(2, 3, 1), qa.format)
    scalar = kp.QuantizedWeight(qw.data, jnp.float32(0.37), qw.format, qw.layout)
    ref, mag = _oracle(qa, scalar)
    out = _run(qa, scalar)
    assert out.shape == (2, 3, 96)
    assert np.all(np.abs(f64(out).reshape(6, 96) - ref) <= 1e-5 * mag + 1e-30)


@pytest.mark.parametrize("fmt", ["fp8_group128", "fp8_per_token"])
def test_nan_token_poisons_its_row_only_and_zero_tokens(rng, fmt):
    """A token holding NaN gets NaN outputs, its neighbours in the same tile are untouched; a
    zero token gives zeros; a weight block of NaN poisons its own columns only."""
    x = rng.standard_normal((7, 256))
    x[2, 5] = np.nan
    x[4] = 0.0
    qa = kp.quantize(jnp.asarray(x, jnp.float32), fmt, impl="reference")
    w = rng.standard_normal((256, 200))
    qw = kp.quantize_weight(jnp.asarray(w, jnp.float32), fmt)
    out = f64(_run(qa, qw, GemmConfig(16, 64, 128, 4, 2)))
    ref, mag = _oracle(qa, qw)
    assert np.isnan(out[2]).all() if fmt == "fp8_per_token" else np.isnan(out[2]).any()
    others = [0, 1, 3, 4, 5, 6]
    assert not np.isnan(out[others]).any()
    assert np.all(np.abs(out[others] - ref[others]) <= 1e-5 * mag[others] + 1e-30)
    assert (out[4] == 0).all()
    w[130, 150] = np.nan  # the weight block (1, 1): columns 128..199
    qw = kp.quantize_weight(jnp.asarray(w, jnp.float32), fmt)
    out = f64(_run(qa, qw, GemmConfig(16, 64, 128, 4, 2, swap=True)))
    bad = np.arange(128, 200) if fmt != "fp8_per_token" else np.array([150])
    good = np.setdiff1d(np.arange(200), bad)
    assert np.isnan(out[np.ix_(others, bad)]).all() and not np.isnan(out[np.ix_(others, good)]).any()


def test_zero_rows_and_impls(rng):
    qa, qw = _operands(rng, 3, 256, 64, "fp8_group128")
    empty = kp.QuantizedActivation(qa.data[:0], qa.scale[:0], qa.format)
    with hooks.recording() as log:
        out = kp.linear(empty, qw, impl="interpret")
    assert out.shape == (0, 64) and not log  # no launch
    with pytest.raises(RuntimeError, match="linear: impl='pallas' needs a GPU target"):
        kp.linear(qa, qw, impl="pallas")
    with pytest.raises(ValueError, match="linear: precision applies to the XLA lowerings"):
        kp.linear(qa, qw, impl="interpret", precision=jax.lax.Precision.HIGHEST)
    with pytest.raises(ValueError, match="impl must be one of"):
        kp.linear(qa, qw, impl="dot_general")  # per-token's lowering, not group's
    mx = kp.quantize(jnp.ones((2, 64)), "mxfp8", impl="reference")
    with pytest.raises(ValueError, match="impl must be one of"):
        kp.linear(mx, kp.quantize_weight(jnp.ones((64, 8)), "mxfp8"), impl="pallas")


def test_auto_takes_the_kernel_up_to_its_row_limits(rng, monkeypatch):
    """"auto" on a GPU target: the Pallas GEMM up to ``PALLAS_PER_TOKEN_MAX_ROWS`` /
    ``PALLAS_GROUP_MAX_ROWS`` rows (per-token: more at a short K, ``PALLAS_PER_TOKEN_SHORT_K``),
    the XLA lowerings beyond; on the CPU the XLA lowerings."""
    import importlib

    linear_mod = importlib.import_module("k3pallas.linear")
    monkeypatch.setattr(linear_mod, "PALLAS_PER_TOKEN_SHORT_K", (0, 0))
    for fmt, limit in (("fp8_group128", "PALLAS_GROUP_MAX_ROWS"),
                       ("fp8_per_token", "PALLAS_PER_TOKEN_MAX_ROWS")):
        qa, qw = _operands(rng, 4, 256, 64, fmt)
        for most in (3, 4, None):  # None: any row count
            monkeypatch.setattr(linear_mod, limit, most)
            on_cpu = str(jax.make_jaxpr(lambda a, w: kp.linear(a, w))(qa, qw))
            assert "pallas_call" not in on_cpu
            with kp.compiling_for(platform.target_from_name("sm_90")):
                on_gpu = str(jax.make_jaxpr(lambda a, w: kp.linear(a, w))(qa, qw))
                given = str(jax.make_jaxpr(lambda a, w: kp.linear(a, w, precision="highest"))(qa, qw))
            assert ("pallas_call" in on_gpu) == (most is None or 4 <= most), (fmt, most)
            assert "pallas_call" not in given  # precision asks for an XLA lowering
    # per-token FP8 at K = 256 and 4 rows, the row limit 3: the kernel where K is short enough
    qa, qw = _operands(rng, 4, 256, 64, "fp8_per_token")
    monkeypatch.setattr(linear_mod, "PALLAS_PER_TOKEN_MAX_ROWS", 3)
    for short_k, kernel in (((128, 64), False), ((256, 4), True), ((256, 3), False)):
        monkeypatch.setattr(linear_mod, "PALLAS_PER_TOKEN_SHORT_K", short_k)
        with kp.compiling_for(platform.target_from_name("sm_90")):
            on_gpu = str(jax.make_jaxpr(lambda a, w: kp.linear(a, w))(qa, qw))
        assert ("pallas_call" in on_gpu) == kernel, short_k


def test_configs():
    """The heuristic: a pure function of the problem and the target; decode tiles of 16 rows;
    a weight's 128-blocks never split across a program's columns; within 1024 threads."""
    smem_kb = {"sm_90": 227, "sm_89": 99, "sm_86": 99, "sm_80": 163, "gfx942": 64, "gfx950": 160}
    for arch in ("sm_90", "sm_89", "sm_80", "gfx942", "gfx950", "cpu"):
        target = platform.target_from_name(arch)
        for m in (1, 7, 16, 33, 64, 512, 4096, 65536):
            for n, k in ((7168, 1536), (4608, 7168), (200, 256)):
                for w_block in (128, None):
                    cfg = launch.gemm_heuristic(m, n, k, target, w_block=w_block)
                    assert cfg.num_warps * target.warp_size <= max(1024, target.max_threads)
                    # the pipelined operand tiles within the arch's shared memory (LDS)
                    tiles = cfg.num_stages * cfg.k_unroll * (cfg.block_m + cfg.block_n) * cfg.block_k
                    assert tiles <= smem_kb.get(arch, 1 << 20) << 10, (arch, m, k, cfg)
                    if m <= launch.GEMM_DECODE_ROWS:
                        assert cfg.block_m == 16
                    if w_block:
                        gemm.check_config(cfg, a_group=128, w_scale="block", k=k)
    with pytest.raises(ValueError, match="power of two"):
        GemmConfig(16, 48, 128, 4, 2)
    with pytest.raises(ValueError, match="must divide the weight's 128 x 128"):
        gemm.check_config(GemmConfig(16, 256, 128, 4, 2), a_group=128, w_scale="block", k=256)
    with pytest.raises(ValueError, match="must divide the activation's scale groups"):
        gemm.check_config(GemmConfig(16, 64, 128, 4, 2), a_group=64, w_scale="channel", k=256)


def test_mma_acc_reaches_the_fp8_dot(rng):
    """``GemmConfig.mma_acc``: the kernel's FP8 dots carry Triton's ``maxNumImpreciseAcc`` (what
    lets Hopper take wgmma for FP8; the launch is named ``..._acc<k>``); 0 leaves Pallas' dot as
    it is. Interpret mode computes the same sums either way."""
    k, n, t = 1536, 7168, 4096
    dt = jnp.float8_e4m3fn
    fmt = kp.Fp8Group(dt)
    qa = kp.QuantizedActivation(S((t, k), dt), S((t, k // 128), jnp.float32), fmt)
    qw = kp.QuantizedWeight(S((n, k), dt), S((n // 128, k // 128), jnp.float32), fmt)
    for acc in (0, 128):
        cfg = GemmConfig(128, 128, 128, 8, 3, mma_acc=acc)

        def f(a, w, cfg=cfg):
            with hooks.forced(cfg):
                return kp.linear(a, w, impl="pallas")
        (ir,) = testing.triton_ir_modules(testing.lower_for(f, (qa, qw), "NVIDIA H200"))
        assert ir["name"] == "k3pallas_linear_fp8_group128" + (f"_acc{acc}" if acc else "")
        dots = [line for line in ir["ir"].splitlines() if "tt.dot" in line]
        want = f"maxNumImpreciseAcc = {acc}"
        assert dots and all((want in line) == bool(acc) for line in dots), dots[0]
    qa, qw = _operands(rng, 7, 256, 130, "fp8_group128")
    np.testing.assert_array_equal(np.asarray(_run(qa, qw, GemmConfig(16, 64, 128, 4, 2, True, 128))),
                                  np.asarray(_run(qa, qw, GemmConfig(16, 64, 128, 4, 2, True))))
    with pytest.raises(ValueError, match="mma_acc must be 0 or a power of two >= 32"):
        GemmConfig(16, 64, 128, 4, 2, mma_acc=16)


@pytest.mark.parametrize("target", list(testing.KNOWN_TARGETS.values()), ids=lambda t: t[0])
@pytest.mark.parametrize("t", [1, 64, 4096])
def test_one_launch_fp8_operands_into_the_dot(target, t):
    """Lowered deviceless for the H200, MI300X (e4m3fnuz) and MI350X: one Triton call, named
    after the format, whose IR feeds the FP8 codes straight to ``tt.dot``."""
    kind, plat = target
    dtype = jnp.float8_e4m3fnuz if kind == "MI300X" else jnp.float8_e4m3fn
    k, n = 1536, 7168
    for fmt in (kp.Fp8Group(dtype), kp.Fp8PerToken(dtype)):
        group = isinstance(fmt, kp.Fp8Group)
        qa = kp.QuantizedActivation(S((t, k), dtype), S((t, k // 128 if group else 1), jnp.float32), fmt)
        qw = kp.QuantizedWeight(S((n, k), dtype), S((n // 128, k // 128) if group else (n,), jnp.float32), fmt)
        lowered = testing.lower_for(lambda a, w: kp.linear(a, w, impl="pallas"), (qa, qw), kind, plat)
        (call,) = testing.triton_launches(lowered.as_text())
        # FP8 wgmma (GemmConfig.mma_acc) where the config takes it: Hopper only
        hopper = call["name"].endswith("_acc128")
        assert call["name"].removesuffix("_acc128") == f"k3pallas_linear_{fmt.name}"
        assert not hopper or kind == "NVIDIA H200", call["name"]
        (ir,) = testing.triton_ir_modules(lowered)
        f8 = "f8E4M3FNUZ" if kind == "MI300X" else "f8E4M3FN"
        dots = [line for line in ir["ir"].splitlines() if "tt.dot" in line]
        assert dots and all(f8 in line for line in dots), dots[:2]
        assert all(("maxNumImpreciseAcc = 128" in line) == hopper for line in dots), dots[:2]


# ------------------------------------------------------------------------------------------------
# GPU tier
# ------------------------------------------------------------------------------------------------

# |out - ref| <= GPU_TOL * mag on the device: the matrix cores' partial sums of exact FP8
# products, promoted to float32 every K step (group) or every instruction (Pallas' FP8 dot asks
# Triton for full-precision accumulation); measured at K = 7168 in
# test_gemm_accumulation_error_on_gpu (docs/formats.md, Consumers).
GPU_TOL = 2.0**-12


def _gpu_operands(config, t, seed):
    from bench import cases as bench_cases, ops as bench_ops

    return bench_ops.linear_operands(bench_cases.LINEAR[config], t, seed)[:2]


def _sampled_oracle(qa, qw, rows):
    a = f64(qa.dequantize())[rows]
    w = f64(qw.dequantize())
    return a @ w, np.abs(a) @ np.abs(w)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 16, 64, 512, 4096])
@pytest.mark.parametrize("config", ["kimi-k3-oproj-tp8-fp8_group128", "deepseek-v3-mlp-tp8-fp8_group128",
                                    "deepseek-v3-oproj-tp8-fp8_group128_ue8m0",
                                    "kimi-k3-oproj-tp8-fp8_per_token", "deepseek-v3-mlp-tp8-fp8_per_token"])
def test_gemm_production_shapes_on_gpu(rng, config, t):
    """The compiled GEMM at the benchmark's shapes (the tuned or heuristic config): against the
    float64 oracle on sampled rows, two runs bit-identical, every output element written
    (poisoned), the bf16 output one rounding of the float32 one."""
    qa, qw = _gpu_operands(config, t, int(rng.integers(2**31)))
    fn = jax.jit(lambda a, w: kp.linear(a, w, impl="pallas", out_dtype=jnp.float32))
    out = fn(qa, qw)
    assert np.array_equal(np.asarray(out), np.asarray(fn(qa, qw))), "two runs differ"
    with testing.poisoned_outputs():
        poisoned = jax.jit(lambda a, w: kp.linear(a, w, impl="pallas", out_dtype=jnp.float32))(qa, qw)
    assert np.array_equal(np.asarray(out), np.asarray(poisoned)), "poisoned run differs"
    rows = np.unique(np.concatenate([[0, t - 1], rng.integers(0, t, min(t, 64))]))
    ref, mag = _sampled_oracle(qa, qw, rows)
    got = f64(out)[rows]
    assert np.all(np.abs(got - ref) <= GPU_TOL * mag + 1e-30), np.max(np.abs(got - ref) / mag)
    out16 = kp.linear(qa, qw, impl="pallas")
    np.testing.assert_array_equal(f64(out16), f64(out.astype(jnp.bfloat16)))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_group128", "fp8_per_token"])
def test_gemm_accumulation_error_on_gpu(rng, fmt):
    """K = 7168 (the DeepSeek-V3 MLP input): the error against the float64 oracle relative to
    the magnitudes, at the decode and prefill tiles (with the scales prefetched and two K steps
    an iteration too); printed (pytest -s) and bounded."""
    from bench import ops as bench_ops

    cfg = dict(k=7168, n=512, fmt=fmt)
    for t, forced in ((16, None), (512, GemmConfig(128, 128, 128, 8, 3)),
                      (512, GemmConfig(128, 128, 128, 8, 3, mma_acc=128)),
                      (16, GemmConfig(16, 64, 128, 4, 4, True, 128)),
                      (16, GemmConfig(16, 64, 128, 4, 4, True, 128, scale_prefetch=True, k_unroll=2)),
                      (512, GemmConfig(64, 64, 128, 4, 3, mma_acc=128, scale_prefetch=True))):
        qa, qw = bench_ops.linear_operands(cfg, t, int(rng.integers(2**31)))[:2]
        with hooks.forced(forced) if forced else _nothing():
            out = f64(jax.jit(lambda a, w: kp.linear(a, w, impl="pallas", out_dtype=jnp.float32))(qa, qw))
        ref, mag = _oracle(qa, qw)
        ratio = np.max(np.abs(out - ref) / mag)
        rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        print(f"{fmt} T={t} {forced and forced.as_entry()} K=7168: max |err| / mag {ratio:.3g}, "
              f"||err|| / ||ref|| {rel:.3g}")
        assert ratio <= GPU_TOL, ratio


def _nothing():
    import contextlib

    return contextlib.nullcontext()
