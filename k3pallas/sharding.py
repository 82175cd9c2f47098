"""How the kernels run on sharded arrays: ``jax.experimental.custom_partitioning`` rules.

A Pallas call inside ``jax.jit`` with sharded operands and no partitioning rule is replicated
by XLA's SPMD partitioner: every device gathers the whole input and computes all of it. Every
kernel path of the public API goes through ``partitioned``, which tells XLA (Shardy, and GSPMD
where a user turned Shardy off) how the op splits, so that each device runs the kernel on its
own shard and nothing is gathered (the rules per op and format: ``k3pallas.ops``; docs/sharding.md):

* leading (token) axes may be sharded freely: rows are independent;
* heads (the gated ops) and columns (the sigmoid-mul, the quantization) may be sharded. A
  per-token FP8 scale is then local to a device's groups (``groups`` a multiple of the shards)
  or one scale over several devices' columns (``groups=1``: a scale-only launch, an all-reduce
  max, then the codes with that scale, ``fp8_over_shards``); a block-scaled format keeps each
  block on one device (shards of whole blocks, the scales sharded alike);
* the normalized axis (the last one of a norm, the head dim of the gated ops, the packed
  columns of ``mla_q_kv_norm``) may not be sharded: the op raises ValueError naming the axis and
  the mesh axes.

Inside ``shard_map`` the ops see local arrays and need none of this. Rules are written like
einsum: ``"... h d, d -> ... h d"``; ``...`` stands for the leading axes, shared by every row
operand and result.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["Rule", "partitioned", "max_over", "fp8_over_shards", "check_call_shardings",
           "linear_partitioned", "k_split_error"]


@dataclasses.dataclass(frozen=True)
class Rule:
    """A sharding rule: ``spec`` like ``"... h d, d, ... h d -> ... h d"``.

    ``fixed``: factors that must not be sharded (normalized axes), with a name for the error
    (``{}`` in it: the operand's name from ``names``). ``reduced``: factors that an output
    reduces over (the scale's heads); the mesh axes sharding them are passed to the local
    function as ``reduce_axes``. ``names``: the input operands' names, for the errors.
    ``split_whole``: factors whose shards must hold whole units (the columns of a block-scaled
    format: whole blocks), with the unit and a name for the error; every sharded factor must
    split evenly. ``follows``: result factors sharded as an input factor (a block format's scale
    axis as its columns)."""

    spec: str
    fixed: tuple[tuple[str, str], ...] = ()
    reduced: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    split_whole: tuple[tuple[str, int, str], ...] = ()  # (factor, unit, what): shards of whole units
    follows: tuple[tuple[str, str], ...] = ()  # (result factor, input factor): sharded alike
    # Shardy's own form where the spec cannot say it (a compound factor: "... (s e)"), with the
    # sizes of the factors it adds.
    sdy: str | None = None
    sdy_sizes: tuple[tuple[str, int], ...] = ()

    def describe(self, what: str, operand: int) -> str:
        name = self.names[operand] if operand < len(self.names) else f"operand {operand}"
        return what.format(name)

    def sides(self):
        ins, outs = self.spec.split("->")
        parse = lambda side: [tuple(t.split()) for t in side.split(",")]  # noqa: E731
        return parse(ins), parse(outs)


def normalized_axis_error(op, what, axes) -> ValueError:
    return ValueError(
        f"{op}: {what} is sharded over mesh axes {axes!r}; that axis is normalized "
        "(or quantized) whole and cannot be split across devices. Shard the leading "
        "(token) axes, or the head axis where the op has one, and replicate this one.")


def block_split_error(op, what, axes, shards, n, block) -> ValueError:
    return ValueError(
        f"{op}: {what} ({n} columns) is sharded over mesh axes {axes!r} into {shards} shards of "
        f"{n / shards:g} columns; a block-scaled format keeps each block of {block} columns on "
        f"one device, so a shard must hold whole blocks: shard the columns in multiples of "
        f"{block} per device ({block * shards} in all over {shards} devices), or replicate them.")


def check_call_shardings(op, impl, row_operands, whole) -> None:
    """At call time, where the operands' shardings are known (``_compat.known_spec``), for
    every implementation: ValueError if the last axis of an operand of ``whole``
    (``[(array, what, block), ...]``) is sharded, where ``block`` is None (a normalized axis),
    or into shards that are not whole multiples of ``block``. NotImplementedError for the
    kernel paths if a row operand is sharded over ``Explicit`` mesh axes (Pallas kernels cannot
    index such arrays; the jnp reference can)."""
    from k3pallas import _compat

    for a, what, block in whole:
        spec = _compat.known_spec(a)
        if spec is None or spec[-1] is None:
            continue
        if block is None:
            raise normalized_axis_error(op, what, spec[-1])
        shards = _compat.known_shards(a, spec[-1])
        n = a.shape[-1]
        if shards is None or n % shards or (n // shards) % block:
            raise block_split_error(op, what, spec[-1], shards or "?", n, block)
    if impl == "reference":
        return
    for a in row_operands:
        axes = _compat.explicit_axes(a)
        if axes:
            raise NotImplementedError(
                f"{op}: an operand is sharded over the mesh axes {axes}, of type Explicit; "
                f"the kernels (impl={impl!r}) support meshes with AxisType.Auto axes (jax's "
                "default) and shard_map. Use one of those, or impl='reference'.")


def _spec_of(sharding, ndim):
    spec = tuple(getattr(sharding, "spec", ()) or ())
    return spec + (None,) * (ndim - len(spec))


def _plan(op, rule: Rule, mesh, arg_shapes, *, strict: bool):
    """(arg shardings, result shardings, reduce_axes) for the operands' current shardings."""
    ins, outs = rule.sides()
    main = ins[0]
    n_lead = arg_shapes[0].ndim - (len(main) - 1)
    lead = _spec_of(arg_shapes[0].sharding, arg_shapes[0].ndim)[:n_lead]
    factors, source, size = {}, {}, {}
    for i, (shape, tensor) in enumerate(zip(arg_shapes, ins)):
        if tensor[0] != "...":
            continue  # weights: replicated, their sharding does not decide anything
        first = shape.ndim - (len(tensor) - 1)
        named = _spec_of(shape.sharding, shape.ndim)[first:]
        for f, s, n in zip(tensor[1:], named, shape.shape[first:]):
            if s is not None:
                factors.setdefault(f, s)
                source.setdefault(f, i)
                size.setdefault(f, n)
    for f, what in rule.fixed:
        if strict and factors.get(f) is not None:
            raise normalized_axis_error(op, rule.describe(what, source[f]), factors[f])
        factors.pop(f, None)
    if strict:  # a sharded factor must split evenly (into shards of whole blocks, for one)
        whole = {f: (unit, what) for f, unit, what in rule.split_whole}
        sizes = dict(mesh.shape)
        for f, axes in factors.items():
            i, dim = source[f], size[f]
            shards = math.prod(sizes[ax] for ax in (axes if isinstance(axes, tuple) else (axes,)))
            unit, what = whole.get(f, (1, f"axis {f!r} of {{}}"))
            if dim % shards or (dim // shards) % unit:
                if unit > 1:
                    raise block_split_error(op, rule.describe(what, i), axes, shards, dim, unit)
                raise ValueError(f"{op}: {rule.describe(what, i)} ({dim}) cannot be split evenly "
                                 f"over mesh axes {axes!r} ({shards} shards)")
    for out_factor, in_factor in rule.follows:
        if factors.get(in_factor) is not None:
            factors[out_factor] = factors[in_factor]

    def sharding(tensor):
        dims = list(lead) if tensor and tensor[0] == "..." else []
        dims += [factors.get(f) for f in tensor if f != "..."]
        return NamedSharding(mesh, PartitionSpec(*dims))

    reduce_axes = []
    for f in rule.reduced:
        s = factors.get(f)
        if s is not None:
            reduce_axes += list(s) if isinstance(s, tuple) else [s]
    results = [sharding(t) for t in outs]
    return ([sharding(t) for t in ins], results[0] if len(results) == 1 else tuple(results),
            tuple(reduce_axes))


@functools.lru_cache(maxsize=None)
def _build(op: str, rule: Rule, local, statics: tuple, cache_key):
    del cache_key  # only a part of the lru_cache key
    kwargs = dict(statics)

    @custom_partitioning
    def fn(*arrays):
        return local(*arrays, reduce_axes=(), **kwargs)

    def partition(mesh, arg_shapes, result_shape):
        args, results, reduce_axes = _plan(op, rule, mesh, arg_shapes, strict=True)
        return mesh, functools.partial(local, reduce_axes=reduce_axes, **kwargs), results, tuple(args)

    def infer(mesh, arg_shapes, result_shape):
        return _plan(op, rule, mesh, arg_shapes, strict=False)[1]

    extra = dict(rule.sdy_sizes)
    if rule.sdy:  # the factors a block format keeps whole: Shardy may not split them
        extra["need_replication_factors"] = tuple(f for f, _ in rule.sdy_sizes)
    fn.def_partition(partition, infer_sharding_from_operands=infer,
                     sharding_rule=rule.sdy or rule.spec, **extra)
    return _batched_as_rows(fn, rule)


def _batched_as_rows(fn, rule: Rule):
    """``fn`` with a ``vmap`` rule (custom_partitioning has none): a batch axis of the row
    operands is one more leading axis, which the ops take as more rows; a batched weight runs
    ``fn`` once per batch element (``jax.lax.map``)."""
    row_operand = [tensor[0] == "..." for tensor in rule.sides()[0]]

    @jax.custom_batching.custom_vmap
    def call(*arrays):
        return fn(*arrays)

    @call.def_vmap
    def _vmap_rule(axis_size, in_batched, *arrays):
        if all(row or not batched for row, batched in zip(row_operand, in_batched)):
            args = [a if batched or not row else jnp.broadcast_to(a, (axis_size,) + a.shape)
                    for a, row, batched in zip(arrays, row_operand, in_batched)]
            out = call(*args)
        else:
            mapped = tuple(a for a, b in zip(arrays, in_batched) if b)

            def one(slices):
                it = iter(slices)
                return call(*[next(it) if b else a for a, b in zip(arrays, in_batched)])

            out = jax.lax.map(one, mapped)
        return out, jax.tree_util.tree_map(lambda _: True, out)

    return call


def partitioned(name: str, rule: Rule, local, *, cache_key=(), **statics):
    """``local(*arrays, reduce_axes=..., **statics)`` as a function XLA partitions by ``rule``.

    ``local`` runs on each device's shard (or on the whole arrays without sharding);
    ``reduce_axes`` are the mesh axes sharding ``rule.reduced`` factors (empty when none are).
    Built once per (op, rule, local, statics, cache_key): statics must be hashable. jax caches
    the trace of a built function per argument shapes, so ``cache_key`` must hold whatever else
    decides what ``local`` traces (``k3pallas.kernels.hooks.trace_key``).
    """
    return _build(name, rule, local, tuple(sorted(statics.items())), cache_key)


def max_over(x, axes):
    """``jax.lax.pmax`` over mesh ``axes`` that keeps NaN: any device's NaN makes the result NaN
    (whether an all-reduce max propagates NaN is not specified across backends)."""
    if not axes:
        return x
    nan = jnp.isnan(x)
    both = jax.lax.pmax(jnp.stack([jnp.where(nan, -jnp.inf, x), nan.astype(x.dtype)]), axes)
    return jnp.where(both[1] > 0, jnp.nan, both[0])


def fp8_over_shards(launch, reduce_axes):
    """Per-token FP8 codes and scale of rows whose columns may be split over mesh ``reduce_axes``.

    ``launch(mode=..., scale=...)`` runs a kernel's FP8 launch (``kernels.gated``). Without
    reduce axes: one "dynamic" launch. With them: a "scale_only" launch (this device's columns),
    the maximum over the devices (``max_over``; the scale is monotone in the amax, so this is the
    scale of the whole row), then a "given_scale" launch for the codes.
    """
    if not reduce_axes:
        return launch()
    _, scale = launch(mode="scale_only")
    scale = max_over(scale, reduce_axes)
    codes, _ = launch(mode="given_scale", scale=scale)
    return codes, scale


# ------------------------------------------------------------------------------------------------
# The scaled FP8 GEMM (``linear``)
# ------------------------------------------------------------------------------------------------


def k_split_error(axes) -> ValueError:
    return ValueError(
        f"linear: K (the contracted axis of the activation or the weight) is sharded over mesh "
        f"axes {axes!r}. A row-parallel linear needs a sum across devices, which the kernel does "
        "not do: run it in shard_map on each device's K shard and jax.lax.psum the outputs, or "
        "replicate K. Shard the tokens (leading axes) or the weight's output columns (N).")


def _linear_plan(mesh, arg_shapes, *, kn: bool, w_kind: str, strict: bool):
    """(arg shardings, result sharding) of the GEMM for the operands' current shardings: the
    tokens as the activation has them, N as the weight has it (in whole 128-blocks for block
    scales), K never (ValueError when ``strict``)."""
    a, _, w, _ = arg_shapes
    lead = a.ndim - 1
    a_spec, w_spec = _spec_of(a.sharding, a.ndim), _spec_of(w.sharding, 2)
    k_axes = [s for s in (a_spec[-1], w_spec[0] if kn else w_spec[1]) if s is not None]
    if strict and k_axes:
        raise k_split_error(k_axes[0])
    n_axes = w_spec[1] if kn else w_spec[0]
    n = w.shape[1 if kn else 0]
    if n_axes is not None:
        sizes = dict(mesh.shape)
        shards = math.prod(sizes[ax] for ax in (n_axes if isinstance(n_axes, tuple) else (n_axes,)))
        unit = 128 if w_kind == "block" else 1
        if n % shards or (n // shards) % unit:
            if strict:
                if unit > 1:
                    raise block_split_error("linear", "N, the weight's output columns", n_axes,
                                            shards, n, unit)
                raise ValueError(f"linear: N, the weight's output columns ({n}), cannot be split "
                                 f"evenly over mesh axes {n_axes!r} ({shards} shards)")
            n_axes = None
    rows = tuple(a_spec[:lead])
    ns = NamedSharding
    w_sharding = PartitionSpec(None, n_axes) if kn else PartitionSpec(n_axes, None)
    scale = {"block": w_sharding, "channel": PartitionSpec(n_axes), "tensor": PartitionSpec(None)}
    args = (ns(mesh, PartitionSpec(*rows, None)), ns(mesh, PartitionSpec(*rows, None)),
            ns(mesh, w_sharding), ns(mesh, scale[w_kind]))
    return args, ns(mesh, PartitionSpec(*rows, n_axes))


@functools.lru_cache(maxsize=None)
def _build_linear(local, kn: bool, w_kind: str, n: int, statics: tuple, cache_key):
    del cache_key
    kwargs = dict(statics)

    kwargs.update(kn=kn, w_kind=w_kind)

    @custom_partitioning
    def fn(*arrays):
        return local(*arrays, **kwargs)

    def partition(mesh, arg_shapes, result_shape):
        args, result = _linear_plan(mesh, arg_shapes, kn=kn, w_kind=w_kind, strict=True)
        return mesh, functools.partial(local, **kwargs), result, args

    def infer(mesh, arg_shapes, result_shape):
        return _linear_plan(mesh, arg_shapes, kn=kn, w_kind=w_kind, strict=False)[1]

    w = "k n" if kn else "n k"
    scale = {"block": "g b" if kn else "b g", "channel": "n", "tensor": "t"}[w_kind]
    spec = f"... k, ... g, {w}, {scale} -> ... n"
    extra = {}
    if w_kind == "block" and n % 128 == 0:  # N as (blocks, 128): shards of whole blocks only
        spec = spec.replace("n", "(b e)")
        extra = dict(e=128, need_replication_factors=("e",))
    fn.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=spec, **extra)
    return _batched_as_rows(fn, Rule(spec))


def linear_partitioned(local, *, kn: bool, w_kind: str, n: int, cache_key=(), **statics):
    """``local(a [..., K], a_scale [..., G], w, w_scale, kn=, w_kind=, **statics)`` (the GEMM on one device's
    operands) as a function XLA partitions: each device computes its tokens' rows of its shard
    of the weight's output columns, nothing gathered; K may not be sharded (``k_split_error``).
    ``w_kind``: "block" (scales per 128 x 128: N split in whole blocks), "channel" or "tensor"."""
    return _build_linear(local, kn, w_kind, n, tuple(sorted(statics.items())), cache_key)
