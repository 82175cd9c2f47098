"""The op table: every op's facts in one place, and the one dispatch every public function uses.

An op (``Op``) is named once; that name is its public function (``k3pallas.api``), its kernel
entry (``k3pallas.kernels.entry``), its launch-config key and the name its kernels launch under.
Its row here gives:

* ``rule``: how it shards (``k3pallas.sharding.Rule``), given its options and arrays;
* ``reference``: its jnp semantics (``k3pallas.reference``), called with the same arrays and
  options as the kernel entry;
* ``fp8``: whether it writes per-token FP8 (the benchmark adds the encoder variant, the ROCm gate
  compiles both conversion paths);
* ``sizes``: named problem sizes: the model configs the benchmark, the tuning sweep and the ROCm
  gate run it on (the first is the headline), and ``"test"``, small sizes for the generic API
  tests;
* ``example(tokens, dtype, **size)``: its arguments as ``ShapeDtypeStruct``s and its options;
* ``unfused``: the same results from other ops, the benchmark's "unfused" variant (or None).

Everything generic about a call, ``call`` does: choose the implementation, refuse sharded
normalized axes where the sharding is known, run the reference or the kernel (through
``k3pallas.sharding.partitioned``), return empty outputs for zero rows without a launch, and
refuse gradients. The public functions check their arguments, bring them to the layout of the
rule, call ``call`` and shape the results.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from k3pallas import platform, reference, sharding
from k3pallas.sharding import Rule

__all__ = ["Op", "OPS", "IMPLS", "call", "resolve_impl"]

IMPLS = ("auto", "pallas", "interpret", "reference")
S = jax.ShapeDtypeStruct


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    rule: Callable[[dict, tuple], Rule]  # (options, arrays) -> the sharding rule
    reference: Callable
    sizes: Mapping[str, dict]
    example: Callable  # (tokens, dtype, **size) -> (tuple of ShapeDtypeStruct, options dict)
    unfused: Callable | None = None  # (impl, *arrays, **options) -> the op's results
    fp8: bool = False

    @property
    def fn(self):
        """The public function."""
        from k3pallas import api

        return getattr(api, self.name)

    def bytes_moved(self, size: str, tokens: int, dtype=jnp.bfloat16) -> int:
        """Bytes of its inputs and outputs at ``sizes[size]`` (each read or written once)."""
        structs, options = self.example(tokens, jnp.dtype(dtype), **self.sizes[size])
        outs = jax.eval_shape(lambda *a: self.fn(*a, impl="reference", **options), *structs)
        return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
                   for a in list(structs) + jax.tree_util.tree_leaves(outs))

    @functools.cached_property
    def operand_names(self) -> tuple[str, ...]:
        """Its operands' names, for errors: the reference's parameter names (the arrays first)."""
        return tuple(inspect.signature(self.reference).parameters)

    @property
    def configs(self) -> tuple[str, ...]:
        """The model configs it is benchmarked, tuned and gated on (headline first)."""
        return tuple(k for k in self.sizes if k != "test")


# ------------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------------

_MLA = {"deepseek-v3-mla": dict(dq=1536, dkv=512, rope=64)}  # DeepSeek-V3, Kimi-K2, Kimi-K3
_KDA = {"kimi-linear-kda": dict(heads=32, dim=128),
        "kimi-k3-kda-tp8": dict(heads=12, dim=128),  # 96 heads over 8 ranks
        "kimi-k3-kda": dict(heads=96, dim=128)}
# The MLA output gate, x * sigmoid(gate) before the o_proj: H * D columns.
_MLA_OUT = {"kimi-k3-mla-out-tp8": dict(n=12 * 128),  # one rank of TP8
            "kimi-k3-mla-out": dict(n=96 * 128)}


def _kp():
    import k3pallas

    return k3pallas


def _q_fp8_unfused(impl, outs, options):
    """The norm's outputs with q quantized by the per-token FP8 kernel (a second launch)."""
    return (_kp().per_token_fp8_quant(outs[0], impl=impl, **options), *outs[1:])


# The axes that may not be sharded, as the errors name them ("{}": the operand, by the name of
# the reference's parameter).
_NORM_FIXED = (("d", "the normalized (last) axis of {}"),)
_QKV_FIXED = (("q", "the last axis of {}"), ("k", "the last axis of {}"))
_MLA_FIXED = (("w", "the packed (last) axis of {}"),)
_HEAD_FIXED = (("d", "the head dim (last axis) of {}"),)
_QKV_SIZES = {**_MLA, "test": dict(dq=64, dkv=16, rope=3)}


def _qkv_example(t, dt, dq, dkv, rope):
    """q_c, kv_c and their weights (the joint norms)."""
    return (S((t, dq), dt), S((t, dkv), dt), S((dq,), dt), S((dkv,), dt)), {}


def _packed_example(t, dt, dq, dkv, rope):
    """The packed [q_c | kv_c | k_pe] rows and the two weights (the packed norms)."""
    return (S((t, dq + dkv + rope), dt), S((dq,), dt), S((dkv,), dt)), dict(q_size=dq, kv_size=dkv)


def _packed_rule(outs):
    """The packed norms' rule: ``outs`` from the packed axis, then k_pe where there is one."""
    return lambda o, a: Rule("... w, q, k -> " + outs
                             + (", ... r" if a[0].shape[-1] > o["q_size"] + o["kv_size"] else ""),
                             fixed=_MLA_FIXED)

_TABLE = [
    Op("rmsnorm",
       rule=lambda o, a: Rule("... d, d -> ... d", fixed=_NORM_FIXED),
       reference=reference.rmsnorm,
       sizes={"deepseek-v3-mla": dict(d=1536), "test": dict(d=64)},  # the q latent
       example=lambda t, dt, d: ((S((t, d), dt), S((d,), dt)), {})),
    Op("fused_q_kv_rmsnorm",
       rule=lambda o, a: Rule("... q, ... k, q, k -> ... q, ... k", fixed=_QKV_FIXED),
       reference=reference.fused_q_kv_rmsnorm,
       sizes=_QKV_SIZES,
       example=_qkv_example,
       unfused=lambda impl, q, kv, wq, wkv: (_kp().rmsnorm(q, wq, impl=impl),
                                             _kp().rmsnorm(kv, wkv, impl=impl))),
    Op("mla_q_kv_norm",
       rule=_packed_rule("... q, ... k"),
       reference=reference.mla_q_kv_norm,
       sizes=_QKV_SIZES,
       example=_packed_example,
       # What a user writes without it: XLA slices the packed rows, then the joint norm.
       unfused=lambda impl, a, wq, wkv, q_size, kv_size, **o: (
           *_kp().fused_q_kv_rmsnorm(a[..., :q_size], a[..., q_size:q_size + kv_size], wq, wkv,
                                     impl=impl), a[..., q_size + kv_size:])),
    Op("rmsnorm_gated",
       rule=lambda o, a: Rule("... h d, d, ... h d -> ... h d", fixed=_HEAD_FIXED),
       reference=reference.rmsnorm_gated,
       sizes={k: _KDA[k] for k in ("kimi-linear-kda", "kimi-k3-kda-tp8")} | {"test": dict(heads=3, dim=32)},
       example=lambda t, dt, heads, dim: (
           (S((t, heads, dim), dt), S((dim,), jnp.float32), S((t, heads, dim), dt)), {})),
    Op("rmsnorm_gated_fp8_per_token",
       # x and gate as [..., G, H / G, D]: the scale reduces over j, the heads of a group.
       rule=lambda o, a: Rule("... g j d, d, ... g j d -> ... g j d, ... g", fixed=_HEAD_FIXED,
                           reduced=("j",)),
       reference=reference.rmsnorm_gated_fp8_per_token,
       sizes={**_KDA, "test": dict(heads=3, dim=32)},
       example=lambda t, dt, heads, dim: (
           (S((t, heads, dim), dt), S((dim,), jnp.float32), S((t, heads, dim), dt)), {}),
       unfused=lambda impl, x, w, g, **o: _kp().per_token_fp8_quant(
           _kp().rmsnorm_gated(x, w, g, impl=impl).reshape(x.shape[:-2] + (-1,)), impl=impl,
           **{k: v for k, v in o.items() if k != "eps"}),
       fp8=True),
    Op("per_token_fp8_quant",
       rule=lambda o, a: Rule("... g j -> ... g j, ... g", reduced=("j",)),
       reference=reference.per_token_fp8_quant,
       sizes={"kimi-linear-kda": dict(n=32 * 128), "test": dict(n=64)},  # the o_proj input
       example=lambda t, dt, n: ((S((t, n), dt),), {}),
       fp8=True),
    Op("sigmoid_mul_fp8_per_token",
       rule=lambda o, a: Rule("... g j, ... g j -> ... g j, ... g", reduced=("j",)),
       reference=reference.sigmoid_mul_fp8_per_token,
       sizes={**_MLA_OUT, "test": dict(n=96)},
       example=lambda t, dt, n: ((S((t, n), dt), S((t, n), dt)), {}),
       # Unfused: XLA's elementwise gate in x's dtype, then the per-token FP8 kernel.
       unfused=lambda impl, x, g, **o: _kp().per_token_fp8_quant(
           (x.astype(jnp.float32) * jax.nn.sigmoid(g.astype(jnp.float32))).astype(x.dtype),
           impl=impl, **o),
       fp8=True),
    Op("fused_q_kv_rmsnorm_fp8",
       rule=lambda o, a: Rule("... q, ... k, q, k -> ... q, ... g, ... k", fixed=_QKV_FIXED),
       reference=reference.fused_q_kv_rmsnorm_fp8,
       sizes=_QKV_SIZES,
       example=_qkv_example,
       # Unfused: the joint norm to bf16, then the per-token FP8 kernel on q.
       unfused=lambda impl, q, kv, wq, wkv, **o: _q_fp8_unfused(
           impl, _kp().fused_q_kv_rmsnorm(q, kv, wq, wkv, impl=impl), o),
       fp8=True),
    Op("mla_q_kv_norm_fp8",
       rule=_packed_rule("... q, ... g, ... k"),
       reference=reference.mla_q_kv_norm_fp8,
       sizes=_QKV_SIZES,
       example=_packed_example,
       unfused=lambda impl, a, wq, wkv, **o: _q_fp8_unfused(
           impl, _kp().mla_q_kv_norm(a, wq, wkv, impl=impl, q_size=o.pop("q_size"),
                                     kv_size=o.pop("kv_size")), o),
       fp8=True),
]

OPS: dict[str, Op] = {op.name: op for op in _TABLE}


# ------------------------------------------------------------------------------------------------
# The dispatch
# ------------------------------------------------------------------------------------------------


def resolve_impl(impl, op: str) -> str:
    """The implementation that runs: "pallas", "interpret" or "reference"."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    if impl in ("interpret", "reference"):
        return impl
    target = platform.current_target()
    if impl == "auto":
        return "pallas" if target.is_gpu else "reference"
    if not target.is_gpu:
        raise RuntimeError(
            f"{op}: impl='pallas' needs a GPU target (cuda or rocm); the target here is "
            f"{target.backend!r}. Use impl='interpret' to run the kernel on the CPU, or "
            "impl='reference' / 'auto' for the jnp version.")
    return "pallas"


def _inference_only(op, fn, *arrays):
    """Call ``fn(*arrays)``; any JVP or gradient through it raises TypeError."""
    wrapped = jax.custom_jvp(fn)

    def _no_gradient(primals, tangents):
        raise TypeError(f"k3pallas.{op} is inference-only: it defines no gradient. Use the jnp "
                        f"version in k3pallas.reference for training code.")

    wrapped.defjvp(_no_gradient)
    return wrapped(*arrays)


def call(name: str, impl, arrays, options: dict, *, originals=None):
    """Run op ``name`` on ``arrays`` (in the layout of its rule) with ``options``.

    ``originals``: the row operands as the user passed them (before a reshape to the rule's
    layout), for the call-time sharding check of their last axes; default ``arrays``.
    """
    with platform.compiling_for(platform.current_target(*arrays)):
        return _call(OPS[name], impl, arrays, options, originals)


@functools.lru_cache(maxsize=None)
def _on_target(local):
    """``local`` traced for a given target: ``custom_partitioning`` traces it later, at compile
    time, outside the context of the call that found the target."""

    def run(*arrays, target, **kwargs):
        with platform.compiling_for(target):
            return local(*arrays, **kwargs)
    return run


def _call(op: Op, impl, arrays, options, originals):
    name = op.name
    impl = resolve_impl(impl, name)
    rule = dataclasses.replace(op.rule(options, arrays), names=op.operand_names)
    ins = rule.sides()[0]
    fixed = dict(rule.fixed)
    originals = arrays if originals is None else originals
    rows = [a for a, t in zip(originals, ins) if t[0] == "..."]
    checks = [(a, rule.describe(fixed[t[-1]], i)) for i, (a, t) in enumerate(zip(originals, ins))
              if t[0] == "..." and t[-1] in fixed]
    sharding.check_call_shardings(name, impl, rows, checks)
    ref = functools.partial(op.reference, **options)
    if op.fp8:  # what the kernels cannot index is refused whatever the implementation
        from k3pallas.kernels import common

        for out in jax.tree_util.tree_leaves(jax.eval_shape(ref, *arrays)):
            try:
                common.check_offsets(out.shape, out.dtype)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
    if impl == "reference":
        return _inference_only(name, ref, *arrays)
    if math.prod(arrays[0].shape[:arrays[0].ndim - (len(ins[0]) - 1)]) == 0:
        return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype),
                                      jax.eval_shape(ref, *arrays))
    from k3pallas import kernels

    fp8 = options.get("fp8")
    if fp8 is not None and fp8.cast is None:  # $K3PALLAS_FP8_CAST, read per call: a kernel's
        # traces are cached by their options, so the mode must be one of them
        from k3pallas.kernels import fp8_cast

        try:
            options = {**options, "fp8": dataclasses.replace(fp8, cast=fp8_cast.resolve_mode(None))}
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    run = sharding.partitioned(name, rule, _on_target(kernels.entry(name)),
                               cache_key=kernels.trace_context(), interpret=impl == "interpret",
                               target=platform.current_target(), **options)
    try:
        return _inference_only(name, run, *arrays)
    except (RuntimeError, ValueError) as e:  # the backend's refusals (a native FP8 cast it
        # cannot do, an output it cannot index, a bad $K3PALLAS_FP8_CAST) name the op
        if str(e).startswith(f"{name}:") or type(e) not in (RuntimeError, ValueError):
            raise
        raise type(e)(f"{name}: {e}") from None
