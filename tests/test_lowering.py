"""Deviceless lowering of the compiled path for an H200 (cuda) and AMD gfx942 / gfx950 (rocm):
the Triton IR is generated, and each op in each output format is exactly one Triton custom call,
named after the op and its format. This catches Triton-only lowering failures that interpret
mode cannot (power-of-two shapes, fp8 casts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import k3pallas as kp
from bench import cases as bench_cases
from k3pallas import platform
from k3pallas.kernels import hooks, launch
from k3pallas import testing

TARGETS = list(testing.KNOWN_TARGETS.values())
TRITON_CALL = "__gpu$xla.gpu.triton"
FP8 = [jnp.float8_e4m3fn, jnp.float8_e4m3fnuz, jnp.float8_e5m2]


def sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def lowered_text(fn, args, target):
    kind, plat = target
    return testing.lower_for(fn, args, kind, plat).as_text()


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t[0])
@pytest.mark.parametrize("widths", [(1536, 512), (1000, 72), (512, 3000)])
def test_fused_q_kv_one_launch(target, widths):
    dq, dkv = widths
    args = (sds((4096, dq)), sds((4096, dkv)), sds((dq,), jnp.float32), sds((dkv,), jnp.float32))
    text = lowered_text(lambda *a: kp.fused_q_kv_rmsnorm(*a, impl="pallas"), args, target)
    assert text.count(TRITON_CALL) == 1
    assert "k3pallas_fused_q_kv_rmsnorm" in text
    text = lowered_text(lambda q, kv, wq, wkv: (kp.rmsnorm(q, wq, impl="pallas"),
                                                kp.rmsnorm(kv, wkv, impl="pallas")), args, target)
    assert text.count(TRITON_CALL) == 2  # the unfused baseline


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t[0])
@pytest.mark.parametrize("name", list(bench_cases.OPS))
def test_every_op_and_format_is_one_launch(target, name):
    """Each case of bench.cases at its first model config (MX: its first two, MXFP8 and MXFP4
    by the configs), lowered for the target: one Triton call named after the op and the format."""
    spec = bench_cases.OPS[name]
    for cfg in spec.configs[:2 if spec.mx else 1]:
        structs, options = spec.example(64, jnp.dtype(jnp.bfloat16), **spec.sizes[cfg])
        text = lowered_text(lambda *a: spec.fn(*a, impl="pallas", **options), structs, target)
        fmt = options.get("out_format")
        want = "k3pallas_" + spec.op + ("" if fmt is None else f"_{fmt}")
        (call,) = testing.triton_launches(text)
        assert call["name"] == want, (call["name"], want)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t[0])
@pytest.mark.parametrize("fmt", [None, "fp8_per_token", "fp8_group128"])
def test_add_rmsnorm_writes_over_its_inputs(target, fmt):
    """The residual add's one launch declares its outputs over its inputs' buffers (XLA's
    ``output_operand_aliases``): the new residual over the residual (operand 1, the last
    output), and an unquantized y over x (operand 0, output 0); a quantized y is new."""
    import re

    args = (sds((64, 512)), sds((64, 512)), sds((512,)))
    text = lowered_text(lambda *a: kp.add_rmsnorm(*a, out_format=fmt, impl="pallas"), args, target)
    assert text.count(TRITON_CALL) == 1
    pairs = sorted(re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", text))
    assert pairs == ([("0", "0"), ("1", "1")] if fmt is None else [("2", "1")]), pairs


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t[0])
def test_fresh_outputs_write_new_buffers(target):
    """``bench.ops.fresh_outputs`` (the peers tool's ``fresh`` column): the same one launch with
    no output over an input."""
    from bench import ops as bench_ops

    args = (sds((64, 512)), sds((64, 512)), sds((512,)))
    fn = lambda *a: kp.add_rmsnorm(*a, impl="pallas")  # noqa: E731
    text = lowered_text(bench_ops.fresh_outputs(fn), args, target)
    assert text.count(TRITON_CALL) == 1 and "k3pallas_add_rmsnorm" in text
    assert "output_tuple_indices" not in text
    assert "output_tuple_indices" in lowered_text(fn, args, target)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t[0])
@pytest.mark.parametrize("fp8_dtype", FP8, ids=lambda d: jnp.dtype(d).name)
def test_every_fp8_dtype_lowers(target, fp8_dtype):
    x, w, g = sds((64, 5, 96)), sds((96,), jnp.float32), sds((64, 5, 96))
    fn = lambda *a: kp.rmsnorm_gated_fp8_per_token(*a, fp8_dtype=fp8_dtype, impl="pallas")  # noqa: E731
    assert lowered_text(fn, (x, w, g), target).count(TRITON_CALL) == 1
    fn = lambda a: kp.per_token_fp8_quant(a, fp8_dtype=fp8_dtype, impl="pallas")  # noqa: E731
    assert lowered_text(fn, (sds((64, 480)),), target).count(TRITON_CALL) == 1


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t[0])
def test_flush_to_zero_transcendentals_on_cuda_only(target):
    """On CUDA the kernels' exp2 / rsqrt are the .ftz PTX instructions (common.exp2 / rsqrt);
    on ROCm jax's own ops. The norm alone has an rsqrt, the gated norm both."""
    x, w = sds((64, 32, 128)), sds((128,), jnp.float32)
    gated = lowered_text(lambda *a: kp.rmsnorm_gated_fp8_per_token(*a, impl="pallas"), (x, w, x),
                         target)
    norm = lowered_text(lambda a, b: kp.rmsnorm(a, b, impl="pallas"),
                        (sds((64, 2048)), sds((2048,), jnp.float32)), target)
    cuda = target[0].startswith("NVIDIA")
    assert (gated.count("ex2.approx.ftz.f32"), gated.count("rsqrt.approx.ftz.f32")) == ((1, 1) if cuda else (0, 0))
    assert norm.count("rsqrt.approx.ftz.f32") == int(cuda) and "ex2.approx" not in norm


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t[0])
@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
def test_rmsnorm_gated_one_launch(target, activation):
    args = (sds((7, 12, 128)), sds((128,), jnp.float32), sds((7, 12, 128), jnp.float32))
    fn = lambda *a: kp.rmsnorm_gated(*a, activation=activation, impl="pallas")  # noqa: E731
    assert lowered_text(fn, args, target).count(TRITON_CALL) == 1


def test_auto_picks_the_kernel_for_a_gpu_target():
    args = (sds((8, 1536)), sds((8, 512)), sds((1536,)), sds((512,)))
    for target in TARGETS:
        assert lowered_text(lambda *a: kp.fused_q_kv_rmsnorm(*a), args, target).count(TRITON_CALL) == 1


@pytest.mark.parametrize("tokens", [1, 64, 4096, 65536])
def test_launch_config_follows_the_target(tokens):
    """The lowered launch carries the config the platform module picks for that target (64-wide
    wavefronts on gfx942 / gfx950), and the grid covers every row."""
    args = (sds((tokens, 1536)), sds((tokens, 512)), sds((1536,)), sds((512,)))
    warps = {}
    for name, target in testing.KNOWN_TARGETS.items():
        text = lowered_text(lambda *a: kp.fused_q_kv_rmsnorm(*a, impl="pallas"), args, target)
        (launched,) = testing.triton_launches(text)
        cfg = launch.launch_config("fused_q_kv_rmsnorm", tokens, 2048 + 512, 2048,
                                   target=platform.target_for(*target), splits=(2,))
        assert launched["num_warps"] == cfg.num_warps and launched["num_stages"] == cfg.num_stages
        assert launched["grid_x"] == -(-tokens // cfg.rows_per_program)
        assert launched["grid_y"] == cfg.split  # q and kv on two programs where tuned so
        assert launched["name"] == "k3pallas_fused_q_kv_rmsnorm"
        warps[name] = cfg.num_warps * platform.target_for(*target).warp_size
    assert all(threads <= 1024 for threads in warps.values())


def test_huge_rows_lower():
    """2**21 rows of width 2048 (bf16, 8 GiB): the lowering uses 64-bit offsets (checked in the
    Triton IR by the ROCm compile gate); here: it lowers for every target."""
    args = (sds((2**21, 2048)), sds((2**21, 512)), sds((2048,)), sds((512,)))
    for target in TARGETS:
        text = lowered_text(lambda *a: kp.fused_q_kv_rmsnorm(*a, impl="pallas"), args, target)
        assert text.count(TRITON_CALL) == 1


def test_fp8_output_offset_window_is_refused():
    """1-byte outputs of 2**31..2**32 bytes would get wrapping 32-bit offsets: refused clearly."""
    x = sds((2**19, 4096))
    with pytest.raises(ValueError, match="^quantize: .*32-bit signed offsets"):
        lowered_text(lambda a: kp.per_token_fp8_quant(a, impl="pallas"), (x,), TARGETS[0])


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t[0])
@pytest.mark.parametrize("mode", ["scale_only", "given_scale"])
def test_cross_device_scale_modes_lower(target, mode):
    """The two launches behind a cross-device FP8 scale (k3pallas.sharding) lower for every
    target, in the target's default fp8 format (e4m3fnuz on gfx942)."""
    from k3pallas.kernels import common, gated as kernels

    t = platform.target_for(*target)
    kw = dict(q=common.Quant(kp.Fp8PerToken().resolve(t), False), interpret=False, target=t,
              mode=mode)

    def gated(x, w, g, s):
        out = kernels.rmsnorm_gated_rows(x, g, w, key="rmsnorm_gated_fp8_per_token", eps=1e-5,
                                         activation="sigmoid",
                                         scale=s if mode == "given_scale" else None, **kw)
        return [o for o in out if o is not None]

    def quant(x, s):
        out = kernels.quantize_rows(x, key="quantize_fp8_per_token",
                                    scale=s if mode == "given_scale" else None, **kw)
        return [o for o in out if o is not None]

    args = (sds((64, 12, 128)), sds((128,), jnp.float32), sds((64, 12, 128)), sds((64,), jnp.float32))
    text = lowered_text(gated, args, target)
    assert text.count(TRITON_CALL) == 1 and f"k3pallas_rmsnorm_gated_fp8_per_token_{mode}" in text
    text = lowered_text(quant, (sds((64, 1536)), sds((64,), jnp.float32)), target)
    assert text.count(TRITON_CALL) == 1 and f"k3pallas_quantize_fp8_per_token_{mode}" in text


def test_hooks_apply_to_a_shape_traced_before():
    """jax (0.11+) caches the trace of the partitioned op per shapes: a second trace of the same
    shape inside ``hooks.forced`` / ``hooks.recording`` must still see the hook
    (``hooks.trace_key`` is part of the cache key)."""
    args = (sds((4, 96, 128)), sds((128,), jnp.float32), sds((4, 96, 128)))
    kind, plat = TARGETS[0]
    for config in (None, launch.LaunchConfig(2, 2, 1), launch.LaunchConfig(1, 16, 1)):
        # A new function each time (as bench.tune makes), so that jit's own cache misses.
        fn = lambda x, w, g: kp.rmsnorm_gated_fp8_per_token(x, w, g, impl="pallas")  # noqa: E731
        with hooks.forced(config) if config else hooks.recording(), hooks.recording() as log:
            text = testing.lower_for(fn, args, kind, plat).as_text()
        assert len(log) == 1 and (config is None or log[0].config == config), log
        (call,) = testing.triton_launches(text)
        assert config is None or call["num_warps"] == config.num_warps
