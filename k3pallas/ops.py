"""The op table: every op's runtime facts in one place, and the one dispatch every public function
uses.

An op (``Op``) is named once, in its entry here (``RMSNORM``, ...); that name is its public
function (``k3pallas.api``; the MX ops are reached through the ``*_quant`` functions'
``out_format``), its kernel entry (``k3pallas.kernels.entry``), its launch-config key and the
name its kernels launch under (MX: with the format appended). Its entry gives ``rule``, how it
shards (``k3pallas.sharding.Rule``, given its options and arrays), ``reference``, its jnp
semantics (``k3pallas.reference``, called with the same arrays and options as the kernel entry),
``fp8``, whether it writes per-token FP8, and ``mx``, whether it writes an MX format (option
``mx``). The benchmark's view of each op (model shapes, examples, the unfused form) is the
benchmark's own (``bench/cases.py``).

Everything generic about a call, ``call`` does: find the target, choose the implementation,
refuse sharded normalized axes where the sharding is known, run the reference or the kernel
(through ``k3pallas.sharding.partitioned``), return empty outputs for zero rows without a launch,
and refuse gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Callable

import jax
import jax.numpy as jnp

from k3pallas import fp8 as fp8_lib, platform, reference, sharding
from k3pallas.sharding import Rule

__all__ = ["Op", "OPS", "IMPLS", "call", "resolve_impl"]

IMPLS = ("auto", "pallas", "interpret", "reference")


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    rule: Callable[[dict, tuple], Rule]  # (options, arrays) -> the sharding rule
    reference: Callable
    fp8: bool = False  # writes per-token FP8 (a QuantizedActivation)
    mx: bool = False  # writes an MX format (k3pallas.mx), option ``mx``

    @functools.cached_property
    def operand_names(self) -> tuple[str, ...]:
        """Its operands' names, for errors: the reference's parameter names (the arrays first)."""
        return tuple(inspect.signature(self.reference).parameters)


# ------------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------------

# The axes that may not be sharded, as the errors name them ("{}": the operand, by the name of
# the reference's parameter).
_NORM_FIXED = (("d", "the normalized (last) axis of {}"),)
_QKV_FIXED = (("q", "the last axis of {}"), ("k", "the last axis of {}"))
_MLA_FIXED = (("w", "the packed (last) axis of {}"),)
_HEAD_FIXED = (("d", "the head dim (last axis) of {}"),)


def _packed_rule(outs):
    """The packed norms' rule: ``outs`` from the packed axis, then k_pe where there is one."""
    return lambda o, a: Rule("... w, q, k -> " + outs
                             + (", ... r" if a[0].shape[-1] > o["q_size"] + o["kv_size"] else ""),
                             fixed=_MLA_FIXED)


RMSNORM = Op("rmsnorm", lambda o, a: Rule("... d, d -> ... d", fixed=_NORM_FIXED),
             reference.rmsnorm)
FUSED_Q_KV_RMSNORM = Op("fused_q_kv_rmsnorm",
                        lambda o, a: Rule("... q, ... k, q, k -> ... q, ... k", fixed=_QKV_FIXED),
                        reference.fused_q_kv_rmsnorm)
MLA_Q_KV_NORM = Op("mla_q_kv_norm", _packed_rule("... q, ... k"), reference.mla_q_kv_norm)
RMSNORM_GATED = Op("rmsnorm_gated",
                   lambda o, a: Rule("... h d, d, ... h d -> ... h d", fixed=_HEAD_FIXED),
                   reference.rmsnorm_gated)
# x and gate as [..., G, H / G, D]: the scale reduces over j, the heads of a group.
RMSNORM_GATED_FP8_PER_TOKEN = Op(
    "rmsnorm_gated_fp8_per_token",
    lambda o, a: Rule("... g j d, d, ... g j d -> ... g j d, ... g", fixed=_HEAD_FIXED, reduced=("j",)),
    reference.rmsnorm_gated_fp8_per_token, fp8=True)
PER_TOKEN_FP8_QUANT = Op("per_token_fp8_quant",
                         lambda o, a: Rule("... g j -> ... g j, ... g", reduced=("j",)),
                         reference.per_token_fp8_quant, fp8=True)
SIGMOID_MUL_FP8_PER_TOKEN = Op("sigmoid_mul_fp8_per_token",
                               lambda o, a: Rule("... g j, ... g j -> ... g j, ... g", reduced=("j",)),
                               reference.sigmoid_mul_fp8_per_token, fp8=True)
FUSED_Q_KV_RMSNORM_FP8 = Op(
    "fused_q_kv_rmsnorm_fp8",
    lambda o, a: Rule("... q, ... k, q, k -> ... q, ... g, ... k", fixed=_QKV_FIXED),
    reference.fused_q_kv_rmsnorm_fp8, fp8=True)
MLA_Q_KV_NORM_FP8 = Op("mla_q_kv_norm_fp8", _packed_rule("... q, ... g, ... k"),
                       reference.mla_q_kv_norm_fp8, fp8=True)

# The MX ops (MXFP8 / MXFP4 by their ``mx`` option): arrays in blocks of 32, ``[..., B, 32]``
# (``e``), so that a block never crosses a head or a shard boundary; the scales ``[..., B]``.
# Block axes may be sharded where the op allows columns to be (the standalone quant and the
# sigmoid-mul); a head's blocks may not (normalized whole), nor q's in the joint norms.
_BLOCK_FIXED = (("e", "the block (last) axis of {}"),)
_MX_HEAD_FIXED = (("b", "the head dim of {}"), ("e", "the head dim of {}"))
MX_QUANT = Op("mx_quant", lambda o, a: Rule("... b e -> ... b e, ... b", fixed=_BLOCK_FIXED),
              reference.mx_quant, mx=True)
SIGMOID_MUL_MX = Op("sigmoid_mul_mx",
                    lambda o, a: Rule("... b e, ... b e -> ... b e, ... b", fixed=_BLOCK_FIXED),
                    reference.sigmoid_mul_mx, mx=True)
RMSNORM_GATED_MX = Op(
    "rmsnorm_gated_mx",
    lambda o, a: Rule("... h b e, b e, ... h b e -> ... h b e, ... h b", fixed=_MX_HEAD_FIXED),
    reference.rmsnorm_gated_mx, mx=True)
FUSED_Q_KV_RMSNORM_MX = Op(
    "fused_q_kv_rmsnorm_mx",
    lambda o, a: Rule("... q, ... k, q, k -> ... q, ... s, ... k", fixed=_QKV_FIXED),
    reference.fused_q_kv_rmsnorm_mx, mx=True)
MLA_Q_KV_NORM_MX = Op("mla_q_kv_norm_mx", _packed_rule("... q, ... s, ... k"),
                      reference.mla_q_kv_norm_mx, mx=True)

OPS: dict[str, Op] = {op.name: op for op in (
    RMSNORM, FUSED_Q_KV_RMSNORM, MLA_Q_KV_NORM, RMSNORM_GATED, RMSNORM_GATED_FP8_PER_TOKEN,
    PER_TOKEN_FP8_QUANT, SIGMOID_MUL_FP8_PER_TOKEN, FUSED_Q_KV_RMSNORM_FP8, MLA_Q_KV_NORM_FP8,
    MX_QUANT, SIGMOID_MUL_MX, RMSNORM_GATED_MX, FUSED_Q_KV_RMSNORM_MX, MLA_Q_KV_NORM_MX)}


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
def _on_target(local, op: str):
    """The kernel entry ``local`` of ``op``, traced for a given target: ``custom_partitioning``
    traces it later, at compile time, outside the context of the call that found the target."""

    def run(*arrays, target, **kwargs):
        with platform.compiling_for(target):
            return local(*arrays, op=op, **kwargs)
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
    if op.fp8 or op.mx:  # what the kernels cannot index is refused whatever the implementation
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
    from k3pallas.kernels import hooks

    key = "mx" if op.mx else "fp8"
    fp8 = options.get(key)
    if fp8 is not None and fp8.cast is None:  # $K3PALLAS_FP8_CAST, read per call: a kernel's
        # traces are cached by their options, so the mode must be one of them
        try:
            options = {**options, key: dataclasses.replace(fp8, cast=fp8_lib.resolve_cast_mode(None))}
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    run = sharding.partitioned(name, rule, _on_target(kernels.entry(name), name),
                               cache_key=hooks.trace_key(), interpret=impl == "interpret",
                               target=platform.current_target(), **options)
    try:
        return _inference_only(name, run, *arrays)
    except (RuntimeError, ValueError) as e:  # the backend's refusals (a native FP8 cast it
        # cannot do, an output it cannot index, a bad $K3PALLAS_FP8_CAST) name the op
        if str(e).startswith(f"{name}:") or type(e) not in (RuntimeError, ValueError):
            raise
        raise type(e)(f"{name}: {e}") from None
