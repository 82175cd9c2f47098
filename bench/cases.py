"""The benchmark's shapes as data: the token counts, and each op's view (``k3pallas.ops``): its
model shapes, example arguments, unfused form and bytes moved; then the integration path that is
not an op (the KDA output with its FP8 o_proj). The benchmark, the tuning sweep, the ROCm gate and
the generic API tests read it; the runtime does not.

``OPS[name]``: a ``BenchOp`` with the op's table entry (``.op``) and

* ``sizes``: named problem sizes: the model configs the benchmark, the sweep and the gate run it
  on (the first is the headline), and ``"test"``, small sizes for the generic API tests;
* ``example(tokens, dtype, **size)``: its arguments as ``ShapeDtypeStruct``s and its options;
* ``unfused``: the same results from other ops, the benchmark's "unfused" variant (or None).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

import k3pallas as kp
from k3pallas import ops

S = jax.ShapeDtypeStruct


@dataclasses.dataclass(frozen=True)
class BenchOp:
    op: ops.Op
    sizes: Mapping[str, dict]
    example: Callable  # (tokens, dtype, **size) -> (tuple of ShapeDtypeStruct, options dict)
    unfused: Callable | None = None  # (impl, *arrays, **options) -> the op's results
    public: str | None = None  # the public function, where it is not named after the op (MX)

    @property
    def name(self) -> str:
        return self.op.name

    @property
    def fp8(self) -> bool:
        return self.op.fp8

    @property
    def mx(self) -> bool:
        return self.op.mx

    @property
    def rule(self):
        return self.op.rule

    @property
    def fn(self):
        """The public function."""
        return getattr(kp, self.public or self.op.name)

    @property
    def configs(self) -> tuple[str, ...]:
        """The model configs it is benchmarked, tuned and gated on (headline first)."""
        return tuple(k for k in self.sizes if k != "test")

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


def _qkv_example(t, dt, dq, dkv, rope):
    """q_c, kv_c and their weights (the joint norms)."""
    return (S((t, dq), dt), S((t, dkv), dt), S((dq,), dt), S((dkv,), dt)), {}


def _packed_example(t, dt, dq, dkv, rope):
    """The packed [q_c | kv_c | k_pe] rows and the two weights (the packed norms)."""
    return (S((t, dq + dkv + rope), dt), S((dq,), dt), S((dkv,), dt)), dict(q_size=dq, kv_size=dkv)


def _gated_example(t, dt, heads, dim):
    return (S((t, heads, dim), dt), S((dim,), jnp.float32), S((t, heads, dim), dt)), {}


def _q_fp8_unfused(impl, outs, options):
    """The norm's outputs with q quantized by the per-token FP8 kernel (a second launch)."""
    return (kp.per_token_fp8_quant(outs[0], impl=impl, **options), *outs[1:])


_CASES = [
    BenchOp(ops.RMSNORM, sizes={"deepseek-v3-mla": dict(d=1536), "test": dict(d=64)},  # the q latent
            example=lambda t, dt, d: ((S((t, d), dt), S((d,), dt)), {})),
    BenchOp(ops.FUSED_Q_KV_RMSNORM, sizes=_QKV_SIZES, example=_qkv_example,
            unfused=lambda impl, q, kv, wq, wkv: (kp.rmsnorm(q, wq, impl=impl),
                                                  kp.rmsnorm(kv, wkv, impl=impl))),
    BenchOp(ops.MLA_Q_KV_NORM, sizes=_QKV_SIZES, example=_packed_example,
            # What a user writes without it: XLA slices the packed rows, then the joint norm.
            unfused=lambda impl, a, wq, wkv, q_size, kv_size, **o: (
                *kp.fused_q_kv_rmsnorm(a[..., :q_size], a[..., q_size:q_size + kv_size], wq, wkv,
                                       impl=impl), a[..., q_size + kv_size:])),
    BenchOp(ops.RMSNORM_GATED,
            sizes={k: _KDA[k] for k in ("kimi-linear-kda", "kimi-k3-kda-tp8")} | {"test": dict(heads=3, dim=32)},
            example=_gated_example),
    BenchOp(ops.RMSNORM_GATED_FP8_PER_TOKEN, sizes={**_KDA, "test": dict(heads=3, dim=32)},
            example=_gated_example,
            unfused=lambda impl, x, w, g, **o: kp.per_token_fp8_quant(
                kp.rmsnorm_gated(x, w, g, impl=impl).reshape(x.shape[:-2] + (-1,)), impl=impl,
                **{k: v for k, v in o.items() if k != "eps"})),
    BenchOp(ops.PER_TOKEN_FP8_QUANT,
            sizes={"kimi-linear-kda": dict(n=32 * 128), "test": dict(n=64)},  # the o_proj input
            example=lambda t, dt, n: ((S((t, n), dt),), {})),
    BenchOp(ops.SIGMOID_MUL_FP8_PER_TOKEN, sizes={**_MLA_OUT, "test": dict(n=96)},
            example=lambda t, dt, n: ((S((t, n), dt), S((t, n), dt)), {}),
            # Unfused: XLA's elementwise gate in x's dtype, then the per-token FP8 kernel.
            unfused=lambda impl, x, g, **o: kp.per_token_fp8_quant(
                (x.astype(jnp.float32) * jax.nn.sigmoid(g.astype(jnp.float32))).astype(x.dtype),
                impl=impl, **o)),
    BenchOp(ops.FUSED_Q_KV_RMSNORM_FP8, sizes=_QKV_SIZES, example=_qkv_example,
            # Unfused: the joint norm to bf16, then the per-token FP8 kernel on q.
            unfused=lambda impl, q, kv, wq, wkv, **o: _q_fp8_unfused(
                impl, kp.fused_q_kv_rmsnorm(q, kv, wq, wkv, impl=impl), o)),
    BenchOp(ops.MLA_Q_KV_NORM_FP8, sizes=_QKV_SIZES, example=_packed_example,
            unfused=lambda impl, a, wq, wkv, **o: _q_fp8_unfused(
                impl, kp.mla_q_kv_norm(a, wq, wkv, impl=impl, q_size=o.pop("q_size"),
                                       kv_size=o.pop("kv_size")), o)),
]


# The MX variants (out_format "mxfp4" / "mxfp8"): the Kimi-K3 shapes, MXFP4 first (the MI355X o_proj
# route). Unfused: the op's bf16 result, then jax's own MX quantization compiled by XLA.
def _mx_sizes(base: dict, formats=("mxfp4",), extra=()) -> dict:
    sizes = {f"{name}-{fmt}": dict(size, fmt=fmt) for fmt in formats for name, size in base.items()}
    sizes.update({f"{name}-{fmt}": dict(base[name], fmt=fmt) for name, fmt in extra})
    return sizes


def _mx_unfused(y, fmt):
    from k3pallas import _compat, mx

    return _compat.jax_mx_quantize(y, mx.mx_format(fmt).dtype)


def _with_format(example):
    def mx_example(t, dt, fmt, **size):
        structs, options = example(t, dt, **size)
        return structs, dict(options, out_format=fmt)
    return mx_example


_KDA_MX = {k: _KDA[k] for k in ("kimi-k3-kda-tp8", "kimi-k3-kda")}
_CASES += [
    BenchOp(ops.RMSNORM_GATED_MX, public="rmsnorm_gated_quant",
            sizes={**_mx_sizes(_KDA_MX, extra=[("kimi-k3-kda-tp8", "mxfp8")]),
                   "test": dict(heads=3, dim=64, fmt="mxfp4")},
            example=_with_format(_gated_example),
            unfused=lambda impl, x, w, g, out_format: _mx_unfused(
                kp.rmsnorm_gated(x, w, g, impl=impl).reshape(x.shape[:-2] + (-1,)), out_format)),
    BenchOp(ops.MX_QUANT, public="quantize_activation",
            sizes={**_mx_sizes({"deepseek-v3-mla-q": dict(n=1536)}, ("mxfp4", "mxfp8")),
                   "test": dict(n=96, fmt="mxfp8")},
            example=_with_format(lambda t, dt, n: ((S((t, n), dt),), {})),
            unfused=lambda impl, x, out_format: _mx_unfused(x, out_format)),
    BenchOp(ops.SIGMOID_MUL_MX, public="sigmoid_mul_quant",
            sizes={**_mx_sizes(_MLA_OUT), "test": dict(n=96, fmt="mxfp4")},
            example=_with_format(lambda t, dt, n: ((S((t, n), dt), S((t, n), dt)), {})),
            unfused=lambda impl, x, g, out_format: _mx_unfused(
                (x.astype(jnp.float32) * jax.nn.sigmoid(g.astype(jnp.float32))).astype(x.dtype),
                out_format)),
    BenchOp(ops.FUSED_Q_KV_RMSNORM_MX, public="fused_q_kv_rmsnorm_quant",
            sizes={**_mx_sizes(_MLA), "test": dict(dq=64, dkv=16, rope=3, fmt="mxfp8")},
            example=_with_format(_qkv_example),
            unfused=lambda impl, q, kv, wq, wkv, out_format: (lambda outs: (
                _mx_unfused(outs[0], out_format), outs[1]))(kp.fused_q_kv_rmsnorm(q, kv, wq, wkv, impl=impl))),
    BenchOp(ops.MLA_Q_KV_NORM_MX, public="mla_q_kv_norm_quant",
            sizes={**_mx_sizes(_MLA), "test": dict(dq=64, dkv=16, rope=3, fmt="mxfp4")},
            example=_with_format(_packed_example),
            unfused=lambda impl, a, wq, wkv, q_size, kv_size, out_format: (lambda outs: (
                _mx_unfused(outs[0], out_format), *outs[1:]))(
                    kp.mla_q_kv_norm(a, wq, wkv, impl=impl, q_size=q_size, kv_size=kv_size))),
]

OPS: dict[str, BenchOp] = {case.name: case for case in _CASES}
if set(OPS) != set(ops.OPS):
    raise RuntimeError(f"bench.cases: ops without a benchmark view: {sorted(set(ops.OPS) - set(OPS))}")


# Decode steps (1 to 256 tokens: batch x speculative tokens), then prefill sizes.
DEFAULT_TOKENS = (1, 7, 8, 16, 32, 64, 128, 256, 512, 4096, 16384, 65536)
QUICK_TOKENS = (1, 64)

# The KDA output path with its FP8 o_proj (bench.ops.make_case): Kimi-K3's KDA heads, eps and
# hidden size (the o_proj's output width).
KDA_OUTPUT = {name: dict(_KDA[name], eps=1e-5, hidden=7168) for name in ("kimi-k3-kda-tp8", "kimi-k3-kda")}
# Each op's model configs (headline first), then the integration path's.
OP_CONFIGS = {**{name: case.configs for name, case in OPS.items()}, "kda_output_fp8": tuple(KDA_OUTPUT)}
ALL = tuple(OP_CONFIGS)
# Default token counts where a path differs from DEFAULT_TOKENS: the KDA output path is bound by
# its o_proj GEMM from a few thousand tokens on (and its large-T cases take minutes to autotune
# and time), so the benchmark stops at 4096 there.
OP_TOKENS = {"kda_output_fp8": (1, 7, 64, 512, 4096)}
