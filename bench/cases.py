"""The benchmark's shapes as data: the token counts, and each case's view of an op (``k3pallas.ops``)
with an output format: its model shapes, example arguments, unfused form and bytes moved; then
the integration path that is not an op (the KDA output with its FP8 o_proj). The benchmark, the
tuning sweep, the ROCm gate and the generic API tests read it; the runtime does not.

``OPS[name]``: a ``BenchOp``, named ``op`` (unquantized), ``op_fp8_per_token``, ``op_mx`` (MXFP8
or MXFP4 by its config) or ``op_fp8_group`` (``fp8_group128`` or ``fp8_group128_ue8m0`` by its
config), with

* ``sizes``: named problem sizes: the model configs the benchmark, the sweep and the gate run it
  on (the first is the headline), and ``"test"``, small sizes for the generic API tests; an MX
  size of the MX or group family names its format (``fmt``);
* ``example(tokens, dtype, **size)``: its arguments as ``ShapeDtypeStruct``s and its options
  (``out_format`` among them where it has one);
* ``unfused``: the same results from other ops, the benchmark's "unfused" variant (or None).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

import k3pallas as kp
from k3pallas import formats, ops, platform

S = jax.ShapeDtypeStruct


@dataclasses.dataclass(frozen=True)
class BenchOp:
    op: str  # the op (k3pallas.ops.OPS)
    family: str | None  # None, "fp8_per_token", "mx" or "fp8_group"
    sizes: Mapping[str, dict]
    example: Callable  # (tokens, dtype, **size) -> (tuple of ShapeDtypeStruct, options dict)
    unfused: Callable | None = None  # (impl, *arrays, **options) -> the op's results

    @property
    def name(self) -> str:
        return self.op if self.family is None else f"{self.op}_{self.family}"

    @property
    def fp8(self) -> bool:
        """Writes FP8 elements with a float32 scale, per token or per group (both FP8 conversion
        paths apply)."""
        return self.family in ("fp8_per_token", "fp8_group")

    @property
    def mx(self) -> bool:
        return self.family == "mx"

    @property
    def fn(self):
        """The public function of the op."""
        return getattr(kp, self.op)

    @property
    def configs(self) -> tuple[str, ...]:
        """The model configs it is benchmarked, tuned and gated on (headline first)."""
        return tuple(k for k in self.sizes if k != "test")

    def row_operands(self, structs, options) -> list[bool]:
        """Per operand: whether it has rows (leading token axes) in the op's sharding rule."""
        fmt = options.get("out_format")
        fmt = None if fmt is None else formats.as_format(fmt).resolve(platform.target_from_name("cpu"))
        layout = ops.OPS[self.op].layout(structs, {k: v for k, v in options.items()
                                                   if k != "out_format"}, fmt)
        return [tensor[0] == "..." for tensor in layout.rule.sides()[0]]

    def bytes_moved(self, size: str, tokens: int, dtype=jnp.bfloat16) -> int:
        """Bytes of its inputs and outputs at ``sizes[size]`` (each read or written once)."""
        structs, options = self.example(tokens, jnp.dtype(dtype), **self.sizes[size])
        outs = jax.eval_shape(lambda *a: self.fn(*a, impl="reference", **options), *structs)
        return sum(math.prod(a.shape) * jax.dtypes.itemsize_bits(a.dtype) // 8  # fp4: half a byte
                   for a in list(structs) + jax.tree_util.tree_leaves(outs))


_MLA = {"deepseek-v3-mla": dict(dq=1536, dkv=512, rope=64)}  # DeepSeek-V3, Kimi-K2, Kimi-K3
_KDA = {"kimi-linear-kda": dict(heads=32, dim=128),
        "kimi-k3-kda-tp8": dict(heads=12, dim=128),  # 96 heads over 8 ranks
        "kimi-k3-kda": dict(heads=96, dim=128)}
# The MLA output gate, x * sigmoid(gate) before the o_proj: H * D columns.
_MLA_OUT = {"kimi-k3-mla-out-tp8": dict(n=12 * 128),  # one rank of TP8
            "kimi-k3-mla-out": dict(n=96 * 128)}
_QKV_SIZES = {**_MLA, "test": dict(dq=64, dkv=16, rope=3)}
# The residual add + norm before attention and before the MLP: DeepSeek-V3 / Kimi-K2 / K3's hidden
# size, and 4096 (Llama-3-8B, Qwen3-8B).
_HIDDEN = {"deepseek-v3-hidden": dict(d=7168), "hidden-4096": dict(d=4096)}
_FP8 = "fp8_per_token"
_GROUP = ("fp8_group128", "fp8_group128_ue8m0")


def _add_example(t, dt, d):
    """x (the sublayer's output), the residual and the weight (the residual add + norm)."""
    return (S((t, d), dt), S((t, d), dt), S((d,), dt)), {}


def _add_unfused(impl, x, r, w, out_format=None):
    """XLA's add (the new residual written), then the k3pallas norm reading it again."""
    r = x + r
    y = kp.rmsnorm(r, w, out_format=out_format, impl=impl)
    return y, r


def _qkv_example(t, dt, dq, dkv, rope):
    """q_c, kv_c and their weights (the joint norms)."""
    return (S((t, dq), dt), S((t, dkv), dt), S((dq,), dt), S((dkv,), dt)), {}


def _packed_example(t, dt, dq, dkv, rope):
    """The packed [q_c | kv_c | k_pe] rows and the two weights (the packed norms)."""
    return (S((t, dq + dkv + rope), dt), S((dq,), dt), S((dkv,), dt)), dict(q_size=dq, kv_size=dkv)


def _gated_example(t, dt, heads, dim):
    return (S((t, heads, dim), dt), S((dim,), jnp.float32), S((t, heads, dim), dt)), {}


def _cols_example(inputs):
    return lambda t, dt, n: (tuple(S((t, n), dt) for _ in range(inputs)), {})


def _formatted(example, fmt=None):
    """``example`` with ``out_format``: ``fmt``, or the size's own (``fmt`` of an MX size)."""
    def with_format(t, dt, fmt=fmt, **size):
        structs, options = example(t, dt, **size)
        return structs, dict(options, out_format=fmt)
    return with_format


def _quantized(y, fmt, impl):
    """``y`` quantized to ``fmt``: per token or per group by the k3pallas kernel (a second
    launch); MX by jax's own MX quantization compiled by XLA."""
    if fmt in (_FP8, *_GROUP):
        return kp.quantize(y, fmt, impl=impl)
    from k3pallas import _compat

    return _compat.jax_mx_quantize(y, formats.as_format(fmt).dtype)


def _q_unfused(norm):
    """The joint norms' unfused form: the bf16 norm, then q quantized in another launch."""
    def unfused(impl, *arrays, out_format, **options):
        q, *rest = norm(*arrays, impl=impl, **options)
        return (_quantized(q, out_format, impl), *rest)
    return unfused


def _gated_unfused(impl, x, w, g, out_format, **options):
    y = kp.rmsnorm_gated(x, w, g, impl=impl, **options)
    return _quantized(y.reshape(x.shape[:-2] + (-1,)), out_format, impl)


def _sigmoid_mul_unfused(impl, x, g, out_format):
    """XLA's elementwise gate in x's dtype, then the quantization."""
    y = (x.astype(jnp.float32) * jax.nn.sigmoid(g.astype(jnp.float32))).astype(x.dtype)
    return _quantized(y, out_format, impl)


def _mx_sizes(base: dict, formats_=("mxfp4",), extra=()) -> dict:
    """Configs naming their format: ``<config>-<format>`` for each base config and format (MX:
    MXFP4 first, the MI355X o_proj route)."""
    sizes = {f"{name}-{fmt}": dict(size, fmt=fmt) for fmt in formats_ for name, size in base.items()}
    sizes.update({f"{name}-{fmt}": dict(base[name], fmt=fmt) for name, fmt in extra})
    return sizes


_KDA_MX = {k: _KDA[k] for k in ("kimi-k3-kda-tp8", "kimi-k3-kda")}

_CASES = [
    # Unquantized outputs.
    BenchOp("rmsnorm", None, {"deepseek-v3-mla": dict(d=1536), "test": dict(d=64)},  # the q latent
            lambda t, dt, d: ((S((t, d), dt), S((d,), dt)), {})),
    BenchOp("fused_q_kv_rmsnorm", None, _QKV_SIZES, _qkv_example,
            unfused=lambda impl, q, kv, wq, wkv: (kp.rmsnorm(q, wq, impl=impl),
                                                  kp.rmsnorm(kv, wkv, impl=impl))),
    BenchOp("mla_q_kv_norm", None, _QKV_SIZES, _packed_example,
            # What a user writes without it: XLA slices the packed rows, then the joint norm.
            unfused=lambda impl, a, wq, wkv, q_size, kv_size, **o: (
                *kp.fused_q_kv_rmsnorm(a[..., :q_size], a[..., q_size:q_size + kv_size], wq, wkv,
                                       impl=impl), a[..., q_size + kv_size:])),
    BenchOp("rmsnorm_gated", None,
            {k: _KDA[k] for k in ("kimi-linear-kda", "kimi-k3-kda-tp8")} | {"test": dict(heads=3, dim=32)},
            _gated_example),
    BenchOp("sigmoid_mul", None, {"kimi-k3-mla-out-tp8": _MLA_OUT["kimi-k3-mla-out-tp8"],
                                  "test": dict(n=96)}, _cols_example(2)),
    BenchOp("add_rmsnorm", None, {**_HIDDEN, "test": dict(d=64)}, _add_example,
            unfused=_add_unfused),
    # Per-token FP8.
    BenchOp("add_rmsnorm", _FP8, {**_HIDDEN, "test": dict(d=64)}, _formatted(_add_example, _FP8),
            unfused=_add_unfused),
    BenchOp("rmsnorm_gated", _FP8, {**_KDA, "test": dict(heads=3, dim=32)},
            _formatted(_gated_example, _FP8), unfused=_gated_unfused),
    BenchOp("quantize", _FP8, {"kimi-linear-kda": dict(n=32 * 128), "test": dict(n=64)},  # o_proj in
            _formatted(_cols_example(1), _FP8)),
    BenchOp("sigmoid_mul", _FP8, {**_MLA_OUT, "test": dict(n=96)},
            _formatted(_cols_example(2), _FP8), unfused=_sigmoid_mul_unfused),
    BenchOp("fused_q_kv_rmsnorm", _FP8, _QKV_SIZES, _formatted(_qkv_example, _FP8),
            unfused=_q_unfused(kp.fused_q_kv_rmsnorm)),
    BenchOp("mla_q_kv_norm", _FP8, _QKV_SIZES, _formatted(_packed_example, _FP8),
            unfused=_q_unfused(kp.mla_q_kv_norm)),
    BenchOp("rmsnorm", _FP8, {"deepseek-v3-mla": dict(d=1536), "test": dict(d=64)},
            _formatted(lambda t, dt, d: ((S((t, d), dt), S((d,), dt)), {}), _FP8),
            unfused=lambda impl, x, w, out_format: _quantized(kp.rmsnorm(x, w, impl=impl),
                                                               out_format, impl)),
    # MX (MXFP4 / MXFP8 by the config): unfused, the op's bf16 result, then jax's own MX
    # quantization compiled by XLA.
    BenchOp("rmsnorm_gated", "mx", {**_mx_sizes(_KDA_MX, extra=[("kimi-k3-kda-tp8", "mxfp8")]),
                                    "test": dict(heads=3, dim=64, fmt="mxfp4")},
            _formatted(_gated_example), unfused=_gated_unfused),
    BenchOp("quantize", "mx", {**_mx_sizes({"deepseek-v3-mla-q": dict(n=1536)}, ("mxfp4", "mxfp8")),
                               "test": dict(n=96, fmt="mxfp8")},
            _formatted(_cols_example(1)),
            unfused=lambda impl, x, out_format: _quantized(x, out_format, impl)),
    BenchOp("sigmoid_mul", "mx", {**_mx_sizes(_MLA_OUT), "test": dict(n=96, fmt="mxfp4")},
            _formatted(_cols_example(2)), unfused=_sigmoid_mul_unfused),
    BenchOp("fused_q_kv_rmsnorm", "mx", {**_mx_sizes(_MLA), "test": dict(dq=64, dkv=16, rope=3, fmt="mxfp8")},
            _formatted(_qkv_example), unfused=_q_unfused(kp.fused_q_kv_rmsnorm)),
    BenchOp("mla_q_kv_norm", "mx", {**_mx_sizes(_MLA), "test": dict(dq=64, dkv=16, rope=3, fmt="mxfp4")},
            _formatted(_packed_example), unfused=_q_unfused(kp.mla_q_kv_norm)),
    BenchOp("rmsnorm", "mx", {**_mx_sizes({"deepseek-v3-mla": dict(d=1536)}), "test": dict(d=64, fmt="mxfp4")},
            _formatted(lambda t, dt, d: ((S((t, d), dt), S((d,), dt)), {})),
            unfused=lambda impl, x, w, out_format: _quantized(kp.rmsnorm(x, w, impl=impl),
                                                               out_format, impl)),
    BenchOp("add_rmsnorm", "mx", {**_mx_sizes({"deepseek-v3-hidden": dict(d=7168)}, ("mxfp8", "mxfp4")),
                                  "test": dict(d=64, fmt="mxfp8")},
            _formatted(_add_example), unfused=_add_unfused),
    # Group-scaled FP8 (fp8_group128 / fp8_group128_ue8m0 by the config), at the per-token cases'
    # shapes (the comparison the format is held to); unfused: the op's bf16 result, then the
    # k3pallas group quantization.
    BenchOp("rmsnorm_gated", "fp8_group", {**_mx_sizes(_KDA, _GROUP),
                                           "test": dict(heads=3, dim=128, fmt=_GROUP[0])},
            _formatted(_gated_example), unfused=_gated_unfused),
    BenchOp("quantize", "fp8_group", {**_mx_sizes({"kimi-linear-kda": dict(n=32 * 128)}, _GROUP),
                                      "test": dict(n=384, fmt=_GROUP[1])},
            _formatted(_cols_example(1)),
            unfused=lambda impl, x, out_format: _quantized(x, out_format, impl)),
    BenchOp("sigmoid_mul", "fp8_group", {**_mx_sizes(_MLA_OUT, _GROUP),
                                         "test": dict(n=256, fmt=_GROUP[0])},
            _formatted(_cols_example(2)), unfused=_sigmoid_mul_unfused),
    BenchOp("fused_q_kv_rmsnorm", "fp8_group",
            {**_mx_sizes(_MLA, _GROUP), "test": dict(dq=128, dkv=16, rope=3, fmt=_GROUP[1])},
            _formatted(_qkv_example), unfused=_q_unfused(kp.fused_q_kv_rmsnorm)),
    BenchOp("mla_q_kv_norm", "fp8_group",
            {**_mx_sizes(_MLA, _GROUP), "test": dict(dq=256, dkv=16, rope=3, fmt=_GROUP[0])},
            _formatted(_packed_example), unfused=_q_unfused(kp.mla_q_kv_norm)),
    BenchOp("add_rmsnorm", "fp8_group", {**_mx_sizes({"deepseek-v3-hidden": dict(d=7168)}, _GROUP),
                                         "test": dict(d=256, fmt=_GROUP[0])},
            _formatted(_add_example), unfused=_add_unfused),
    BenchOp("rmsnorm", "fp8_group", {**_mx_sizes({"deepseek-v3-mla": dict(d=1536)}, _GROUP),
                                     "test": dict(d=128, fmt=_GROUP[1])},
            _formatted(lambda t, dt, d: ((S((t, d), dt), S((d,), dt)), {})),
            unfused=lambda impl, x, w, out_format: _quantized(kp.rmsnorm(x, w, impl=impl),
                                                               out_format, impl)),
]

OPS: dict[str, BenchOp] = {case.name: case for case in _CASES}
_missing = set(ops.OPS) - {case.op for case in _CASES}
if _missing:
    raise RuntimeError(f"bench.cases: ops without a benchmark view: {sorted(_missing)}")


# Decode steps (1 to 256 tokens: batch x speculative tokens), then prefill sizes.
DEFAULT_TOKENS = (1, 7, 8, 16, 32, 64, 128, 256, 512, 4096, 16384, 65536)
QUICK_TOKENS = (1, 64)

# The KDA output path with its FP8 o_proj (bench.ops.make_case): Kimi-K3's KDA heads, eps and
# hidden size (the o_proj's output width).
KDA_OUTPUT = {name: dict(_KDA[name], eps=1e-5, hidden=7168) for name in ("kimi-k3-kda-tp8", "kimi-k3-kda")}
# Each case's model configs (headline first), then the integration path's.
# The group-FP8 linear beside the bf16 dot and the per-token FP8 path (bench.ops.make_case,
# ``group_linear``): the Kimi-K3 TP8 KDA o_proj (the gated norm fused with the quantization,
# then the GEMM) and a DeepSeek-V3 dense MLP input at TP8 (the quantization, then the gate and up
# projections 7168 -> 2 x 2304).
GROUP_LINEAR = {"kimi-k3-kda-tp8": dict(KDA_OUTPUT["kimi-k3-kda-tp8"]),
                "deepseek-v3-mlp-tp8": dict(k=7168, n=2 * 2304)}
# The scaled FP8 GEMM alone (``linear`` on pre-quantized operands, bench.ops.make_case,
# ``linear``), per format: the Kimi-K3 TP8 o_proj (1536 -> 7168), the DeepSeek-V3 MLP gate and up
# projections at TP8 (7168 -> 2 x 2304) and its attention o_proj at TP8 (128 heads x 128 / 8 =
# 2048 -> 7168).
LINEAR_SHAPES = {"kimi-k3-oproj-tp8": dict(k=1536, n=7168), "deepseek-v3-mlp-tp8": dict(k=7168, n=4608),
                 "deepseek-v3-oproj-tp8": dict(k=2048, n=7168)}
LINEAR_FORMATS = ("fp8_group128", "fp8_group128_ue8m0", "fp8_per_token")
LINEAR = {f"{name}-{fmt}": dict(size, fmt=fmt) for fmt in LINEAR_FORMATS
          for name, size in LINEAR_SHAPES.items()}
# What a CPU run of ``linear`` measures (interpret mode at the model sizes takes seconds a call):
# a partial last block of N, several K groups.
LINEAR_TEST = {f"test-{fmt}": dict(k=384, n=200, fmt=fmt) for fmt in LINEAR_FORMATS}
OP_CONFIGS = {**{name: case.configs for name, case in OPS.items()}, "kda_output_fp8": tuple(KDA_OUTPUT),
              "group_linear": tuple(GROUP_LINEAR), "linear": tuple(LINEAR)}
ALL = tuple(OP_CONFIGS)
# Default token counts where a path differs from DEFAULT_TOKENS: the KDA output path is bound by
# its o_proj GEMM from a few thousand tokens on (and its large-T cases take minutes to autotune
# and time), so the benchmark stops at 4096 there.
OP_TOKENS = {"kda_output_fp8": (1, 7, 64, 512, 4096), "group_linear": (1, 7, 16, 64, 512, 4096),
             "linear": (1, 7, 16, 64, 512, 4096)}

# The headline suite (``python -m bench --suite headline``): the cases behind the README's table,
# one device call (122 s on an H100 at 9a3f233): (op, config, token counts).
HEADLINE = (
    ("fused_q_kv_rmsnorm", "deepseek-v3-mla", (1, 256, 65536)),
    ("mla_q_kv_norm", "deepseek-v3-mla", (65536,)),
    ("rmsnorm_gated_fp8_per_token", "kimi-linear-kda", (65536,)),
    ("rmsnorm_gated_fp8_per_token", "kimi-k3-kda-tp8", (1, 65536)),
    ("rmsnorm_gated_mx", "kimi-k3-kda-tp8-mxfp4", (1, 65536)),
    ("sigmoid_mul_fp8_per_token", "kimi-k3-mla-out", (65536,)),
    ("add_rmsnorm", "deepseek-v3-hidden", (1, 65536)),
    ("add_rmsnorm_mx", "deepseek-v3-hidden-mxfp8", (1,)),
    ("quantize_mx", "deepseek-v3-mla-q-mxfp8", (65536,)),
    ("linear", "kimi-k3-oproj-tp8-fp8_group128", (1, 16, 64, 512, 4096)),
    ("linear", "deepseek-v3-mlp-tp8-fp8_group128", (1, 16, 64, 512, 4096)),
    ("linear", "deepseek-v3-oproj-tp8-fp8_group128", (1, 16)),
    ("linear", "kimi-k3-oproj-tp8-fp8_per_token", (1, 64, 4096)),
)
# The full suite (``python -m bench --suite full``): every op and config at the token counts the
# docs read (decode, mid, prefill), the headline's among them; about 11 minutes on an H100
# (f42b5c7: 447 + 136 + 81 s in three calls), so two device calls joined by ``--resume`` (one
# commit, one device).
FULL_TOKENS = (1, 16, 64, 256, 512, 4096, 65536)
FULL = tuple((op, cfg, OP_TOKENS.get(op, FULL_TOKENS)) for op, cfgs in OP_CONFIGS.items()
             for cfg in cfgs)
SUITES = {"headline": HEADLINE, "full": FULL}
