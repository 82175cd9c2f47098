"""The op table and the one call path every public function uses.

An op (``Op``) is a fusion, named once in its entry here (``RMSNORM``, ...); that name is its
public function (``k3pallas.api``), its kernel entry (``k3pallas.kernels.entry``), and, with its
output format, its launch-config key and the name its kernels launch under
(``rmsnorm_gated_fp8_per_token``). Its entry gives ``reference``, its jnp semantics
(``k3pallas.reference``, on the arrays as the user passed them), and ``layout``: how, for an
output format, its arrays are laid out for its sharding rule (``k3pallas.sharding.Rule``) and its
kernel entry, and how the results come back.

Everything generic about a call, ``call`` does, for a target resolved once by the caller: choose
the implementation, refuse sharded axes the op cannot split where the sharding is known, run the
reference or the kernel (through ``k3pallas.sharding.partitioned``), return empty outputs for
zero rows without a launch, and refuse gradients.
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

__all__ = ["Op", "OPS", "IMPLS", "Layout", "call", "resolve_impl", "inference_only"]

IMPLS = ("auto", "pallas", "interpret", "reference")


@dataclasses.dataclass(frozen=True)
class Layout:
    """An op's arrays as its sharding rule and kernel entry take them, for one output format.

    ``to_rule(arrays)`` reshapes the user's arrays; ``from_rule(outputs)`` brings the kernel's
    results back to the reference's shapes. ``whole``: per user operand index, the
    description of its last axis and the block its shards must hold whole (None: it may not be
    sharded at all), for the call-time check where the sharding is known."""

    rule: Rule
    to_rule: Callable = lambda arrays: arrays
    from_rule: Callable = lambda outs: outs
    whole: tuple = ()


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    reference: Callable  # (*arrays, fmt=None, **options) -> outputs, as the user passed arrays
    layout: Callable  # (arrays, options, fmt) -> Layout

    @functools.cached_property
    def operand_names(self) -> tuple[str, ...]:
        """Its operands' names, for errors: the reference's parameter names (the arrays first)."""
        return tuple(inspect.signature(self.reference).parameters)


# ------------------------------------------------------------------------------------------------
# Layouts
# ------------------------------------------------------------------------------------------------

# The axes that may not be sharded, as the errors name them ("{}": the operand's name).
_NORMALIZED = "the normalized (last) axis of {}"


def _split_last(a, groups):
    """``a [..., N]`` -> ``[..., groups, N / groups]``."""
    return a.reshape(a.shape[:-1] + (groups, a.shape[-1] // groups))


def _merge_last(a):
    return a.reshape(a.shape[:-2] + (a.shape[-2] * a.shape[-1],))


def _rmsnorm_layout(arrays, o, fmt):
    outs = "... d" if fmt is None else "... d, ... s"
    return Layout(Rule(f"... d, d -> {outs}", fixed=(("d", _NORMALIZED),)),
                  whole=((0, _NORMALIZED, None),))


def _add_layout(arrays, o, fmt):
    outs = "... d, ... d" if fmt is None else "... d, ... s, ... d"
    return Layout(Rule(f"... d, ... d, d -> {outs}", fixed=(("d", _NORMALIZED),)),
                  whole=((0, _NORMALIZED, None), (1, _NORMALIZED, None)))


def _qkv_layout(arrays, o, fmt):
    outs = "... q, ... k" if fmt is None else "... q, ... s, ... k"
    return Layout(Rule(f"... q, ... k, q, k -> {outs}",
                       fixed=(("q", "the last axis of {}"), ("k", "the last axis of {}"))),
                  whole=((0, "the last axis of q_c", None), (1, "the last axis of kv_c", None)))


def _packed_layout(arrays, o, fmt):
    outs = "... q, ... k" if fmt is None else "... q, ... s, ... k"
    a = arrays[0]
    rope = a.shape[-1] > o["q_size"] + o["kv_size"]

    def from_rule(results):  # no rope part: the kernel writes none, the result is empty
        return results if rope else (*results, jnp.zeros(a.shape[:-1] + (0,), a.dtype))
    return Layout(Rule(f"... w, q, k -> {outs}" + (", ... r" if rope else ""),
                       fixed=(("w", "the packed (last) axis of {}"),)),
                  from_rule=from_rule, whole=((0, "the packed (last) axis of qkv_a", None),))


_HEAD_DIM = "the head dim (last axis) of {}"


def _gated_layout(arrays, o, fmt):
    x = arrays[0]
    whole = ((0, "the head dim (last axis) of x", None), (2, "the head dim (last axis) of gate", None))
    if fmt is None:
        return Layout(Rule("... h d, d, ... h d -> ... h d", fixed=(("d", _HEAD_DIM),)),
                      whole=whole)
    heads, dim = x.shape[-2:]
    lead = x.shape[:-2]
    if fmt.block is None:  # groups of heads as rows: [..., G, H / G, D]; a scale per group
        g = fmt.scale_groups(heads * dim)

        def to_rule(a):
            x, w, gate = a
            shape = lead + (g, heads // g, dim)
            return x.reshape(shape), w, gate.reshape(shape)
        return Layout(Rule("... g j d, d, ... g j d -> ... g j d, ... g",
                           fixed=(("d", _HEAD_DIM),), reduced=("j",)),
                      to_rule, lambda outs: (outs[0].reshape(lead + (heads * dim,)), outs[1]),
                      whole)
    c = dim // fmt.block  # heads as rows of blocks: [..., H, D / block, block]

    def to_rule(a):
        x, w, gate = a
        return _split_last(x, c), _split_last(w, c), _split_last(gate, c)
    return Layout(Rule("... h c e, c e, ... h c e -> ... h c e, ... h c",
                       fixed=(("c", _HEAD_DIM), ("e", _HEAD_DIM))),
                  to_rule, lambda outs: (outs[0].reshape(lead + (heads * dim,)),
                                         _merge_last(outs[1])), whole)


def _columns_layout(arrays, o, fmt):
    """The column ops (sigmoid-mul, quantize), ``[..., N]``. Per token: as ``[..., G, j]``, a
    scale per group; ``j`` may be sharded (the scale reduced across devices). A block format:
    as they are, the columns sharded in whole blocks only, the scales ``[..., N / block]``
    sharded alike."""
    n = len(arrays)
    if fmt is None:
        return Layout(Rule(", ".join(["... j"] * n) + " -> ... j"))
    if fmt.block is not None:
        whole = tuple((i, f"the last axis of {name}", fmt.block)
                      for i, name in enumerate(("x", "gate")[:n]))
        rule = Rule(", ".join(["... n"] * n) + " -> ... n, ... s", follows=(("s", "n"),),
                    split_whole=(("n", fmt.block, "the last axis of {}"),),
                    sdy=", ".join(["... (s e)"] * n) + " -> ... (s e), ... s",
                    sdy_sizes=(("e", fmt.block),))
        return Layout(rule, whole=whole)
    g = fmt.scale_groups(arrays[0].shape[-1])
    return Layout(Rule(", ".join(["... g j"] * n) + " -> ... g j, ... g", reduced=("j",)),
                  lambda a: tuple(_split_last(x, g) for x in a),
                  lambda outs: (_merge_last(outs[0]), outs[1]))


RMSNORM = Op("rmsnorm", reference.rmsnorm, _rmsnorm_layout)
ADD_RMSNORM = Op("add_rmsnorm", reference.add_rmsnorm, _add_layout)
FUSED_Q_KV_RMSNORM = Op("fused_q_kv_rmsnorm", reference.fused_q_kv_rmsnorm, _qkv_layout)
MLA_Q_KV_NORM = Op("mla_q_kv_norm", reference.mla_q_kv_norm, _packed_layout)
RMSNORM_GATED = Op("rmsnorm_gated", reference.rmsnorm_gated, _gated_layout)
SIGMOID_MUL = Op("sigmoid_mul", reference.sigmoid_mul, _columns_layout)
QUANTIZE = Op("quantize", reference.quantize, _columns_layout)

OPS: dict[str, Op] = {op.name: op for op in (
    RMSNORM, ADD_RMSNORM, FUSED_Q_KV_RMSNORM, MLA_Q_KV_NORM, RMSNORM_GATED, SIGMOID_MUL, QUANTIZE)}


# ------------------------------------------------------------------------------------------------
# The call path
# ------------------------------------------------------------------------------------------------


def resolve_impl(impl, op: str, target: platform.Target) -> str:
    """The implementation that runs on ``target``: "pallas", "interpret" or "reference"."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    if impl in ("interpret", "reference"):
        return impl
    if impl == "auto":
        return "pallas" if target.is_gpu else "reference"
    if not target.is_gpu:
        raise RuntimeError(
            f"{op}: impl='pallas' needs a GPU target (cuda or rocm); the target here is "
            f"{target.backend!r}. Use impl='interpret' to run the kernel on the CPU, or "
            "impl='reference' / 'auto' for the jnp version.")
    return "pallas"


def inference_only(what, fn, *arrays):
    """Call ``fn(*arrays)``; any JVP or gradient through it raises TypeError naming ``what``."""
    wrapped = jax.custom_jvp(fn)

    def _no_gradient(primals, tangents):
        raise TypeError(f"k3pallas.{what} is inference-only: it defines no gradient. Use the jnp "
                        f"version in k3pallas.reference for training code.")

    wrapped.defjvp(_no_gradient)
    return wrapped(*arrays)


@functools.lru_cache(maxsize=256)
def _compiled_reference(name, fmt, options):
    return jax.jit(functools.partial(OPS[name].reference, fmt=fmt, **dict(options)))


def _jitted(name, fmt, options, ref):
    """``ref`` as one jitted function, cached by op, format and options: called eagerly, jnp ops
    run one by one would each be a dispatch (and, at a new shape, a compile) of their own, and
    could round differently from the same code compiled whole (XLA rewrites a division by a
    constant); under jit or vmap it is inlined. ``ref`` itself where an option is unhashable."""
    key = tuple(sorted(options.items()))
    try:
        hash((fmt, key))
    except TypeError:
        return ref
    return _compiled_reference(name, fmt, key)


def call(name: str, impl, arrays, options: dict, *, fmt, fp8_cast, target: platform.Target):
    """Run op ``name`` on ``arrays`` (as the user passed them, checked) with ``options``, writing
    format ``fmt`` (resolved for ``target``; None: unquantized) with the conversion mode
    ``fp8_cast``. Returns the reference's outputs (quantized ones as ``(data, scale)``)."""
    op = OPS[name]
    impl = resolve_impl(impl, name, target)
    ref = functools.partial(op.reference, fmt=fmt, **options)
    if fmt is not None:  # what the kernels cannot index is refused whatever the implementation
        from k3pallas.kernels import common

        for out in jax.tree_util.tree_leaves(jax.eval_shape(ref, *arrays)):
            try:
                common.check_offsets(out.shape, out.dtype)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
    layout = op.layout(arrays, options, fmt)
    rule = dataclasses.replace(layout.rule, names=op.operand_names)
    rows = [a for a, t in zip(arrays, rule.sides()[0]) if t[0] == "..."]
    sharding.check_call_shardings(name, impl, rows,
                                  [(arrays[i], rule.describe(what, i), block)
                                   for i, what, block in layout.whole])
    if impl == "reference":
        return inference_only(name, _jitted(name, fmt, options, ref), *arrays)
    lead = arrays[0].shape[:arrays[0].ndim - 1]
    if math.prod(lead) == 0:
        return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype),
                                      jax.eval_shape(ref, *arrays))
    from k3pallas import kernels
    from k3pallas.kernels import hooks

    cast = None
    if fmt is not None:  # $K3PALLAS_FP8_CAST, read per call: a kernel's traces are cached by
        # their options, so the mode must be one of them
        try:
            cast = fp8_lib.resolve_cast_mode(fp8_cast)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    run = sharding.partitioned(name, rule, kernels.entry(name), cache_key=hooks.trace_key(),
                               interpret=impl == "interpret", target=target, fmt=fmt, cast=cast,
                               op=name, **options)

    def kernel_path(*a):
        return layout.from_rule(run(*layout.to_rule(a)))

    try:
        return inference_only(name, kernel_path, *arrays)
    except (RuntimeError, ValueError) as e:  # the backend's refusals (a native FP8 cast it
        # cannot do, an output it cannot index, a bad $K3PALLAS_FP8_CAST) name the op
        if str(e).startswith(f"{name}:") or type(e) not in (RuntimeError, ValueError):
            raise
        raise type(e)(f"{name}: {e}") from None
