"""RMSNorm of row-aligned column segments, in ONE Pallas Triton launch.

A *segment* is a run of columns of one input: ``(source, start, width, eps)``. Segments with an
``eps`` are normalized with their own weight; segments without one are copied through. Each
program takes ``R`` rows and handles every segment of them, so all the tensors of a row are read
once and written once in one launch; or, with ``LaunchConfig.split = 2`` (the tuned table's
choice where it measured faster: decode and mid-size T on the H200), two programs share a row
block, one doing the first segment (q) and one the others (kv, rope), still one launch:

* ``rmsnorm``: one input, one segment;
* ``fused_q_kv_rmsnorm``: MLA's ``q_c [T, 1536]`` and ``kv_c [T, 512]``, two inputs, two
  segments (no lanes wasted on the narrower tensor, unlike a grid (T, 2) with one block width);
* ``mla_q_kv_norm``: the packed projection ``[T, 1536 + 512 + 64]``, one input, three segments at
  column offsets 0, 1536 and 2048 (q normalized, kv normalized, the rope part copied): the kernel
  reads the packed rows directly, so no XLA slice materializes a copy before it;
* ``add_rmsnorm``: ``x`` and the residual, one segment normalized after the residual is added
  (``add``): the sum is written once, over the residual's buffer, and normalized in registers.

Per normalized segment: ``y = x * rsqrt(sum(x**2) / D + eps) * w`` in float32, one cast at the
store; or, for the first segment (q) with an output format, ``y`` quantized from float32 in the
same launch (``row_scaled`` per token, ``block_scaled`` per block).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from k3pallas._compat import pl
from k3pallas.kernels import block_scaled, common, launch, row_scaled


class Segment(NamedTuple):
    source: int  # index of the input the columns come from
    start: int  # first column
    width: int
    eps: float | None  # None: copied through, no weight


def _kernel(*refs, n_rows: int, rows: int, n_sources: int, segments: tuple[Segment, ...],
            quant: common.Quant | None, ftz: bool,
            groups: tuple[tuple[int, ...], ...] | None = None, add: bool = False,
            weight_first: bool = False):
    """``quant``: the first segment's output format (None: every segment in its input's dtype).
    ``groups``: None, every segment in each program; else the segments of the programs
    ``pl.program_id(1) = 0, 1, ...`` of a row block (``LaunchConfig.split``). ``add``: the one
    segment is ``x + residual`` (the last source, same columns), rounded to x's dtype and
    written to the last output (aliased to the residual) before it is normalized;
    ``weight_first``: the weight loaded with x and the residual, before that store."""
    n_norm = sum(s.eps is not None for s in segments)
    x_refs = refs[:n_sources]
    w_refs = iter(refs[n_sources:n_sources + n_norm])
    out_refs = list(refs[n_sources + n_norm:])
    res = (x_refs[-1], out_refs.pop()) if add else None  # (residual in, new residual out)
    o_refs = iter(out_refs)
    # Per segment: its weight ref (or None) and its output refs (the FP8 first segment: 2).
    seg_w = [next(w_refs) if s.eps is not None else None for s in segments]
    seg_o = [[next(o_refs)] + ([next(o_refs)] if i == 0 and quant is not None else [])
             for i in range(len(segments))]
    pid = pl.program_id(0)
    if groups is None:
        _segments(range(len(segments)), x_refs, seg_w, seg_o, n_rows=n_rows, rows=rows,
                  segments=segments, quant=quant, ftz=ftz, pid=pid, res=res,
                  weight_first=weight_first)
        return
    for g, ids in enumerate(groups):
        pl.when(pl.program_id(1) == g)(functools.partial(
            _segments, ids, x_refs, seg_w, seg_o, n_rows=n_rows, rows=rows, segments=segments,
            quant=quant, ftz=ftz, pid=pid))


def _segments(ids, x_refs, seg_w, seg_o, *, n_rows, rows, segments, quant, ftz, pid, res=None,
              weight_first=False):
    """Normalize (or copy) the segments ``ids`` of this program's rows (``pid``: its row block);
    ``res``: (residual ref, new residual ref) of the residual add (``_kernel``'s ``add``, and
    ``weight_first`` its)."""
    in_rows = common.row_mask(n_rows, rows, 2, pid)
    # The first segment in a block format: read in blocks (block_scaled).
    blocks_first = quant is not None and quant.fmt.block is not None and 0 in ids
    # Load every tile first: the loads then overlap, and none waits behind another tile's store
    # (a store may alias a later load as far as the compiler knows). The weight's load waits
    # behind the new residual's store (for x's and the residual's data) unless ``weight_first``.
    tiles = []
    for i in ids:
        seg = segments[i]
        if i == 0 and blocks_first:
            continue
        index, lanes = common.tile_index(rows, (seg.width,))
        mask = common.both(in_rows, lanes)
        src_index = index if seg.start == 0 else (index[0], index[1] + seg.start)
        x = common.load(x_refs[seg.source], src_index, mask)
        r = None if res is None else common.load(res[0], src_index, mask)
        w = None
        if seg.eps is not None and weight_first:
            w = common.load(seg_w[i], *common.lane_index(seg.width))
        if r is not None:
            x = common.residual_add(x, r, index, mask, res[1])
        if seg.eps is not None and not weight_first:
            w = common.load(seg_w[i], *common.lane_index(seg.width))
        tiles.append((i, index, mask, x, w))
    if blocks_first:
        seg = segments[0]
        block_scaled.normalized_blocks_store(
            x_refs[seg.source], seg_w[0], *seg_o[0], in_rows=common.row_mask(n_rows, rows, 1, pid),
            rows=rows, col0=seg.start, width=seg.width, eps=seg.eps, q=quant, ftz=ftz, res=res,
            padded=True, pairs=True)  # MXFP4 pair tiles: block tiles slowed add_rmsnorm
    for i, index, mask, x, w in tiles:
        seg = segments[i]
        if i == 0 and quant is not None:  # the first segment per token: codes and a scale per row
            # y = (x * w) * inv_rms, its amax beside the norm (row_scaled.normed_amax).
            x = x.astype(jnp.float32)
            inv = common.row_inv_rms(x, seg.width, seg.eps, ftz)
            z = x * w.astype(jnp.float32)[None, :]
            if res is not None:  # the new residual was stored from this tile
                index = common.codes_beside(index, res[1].dtype)
            row_scaled.epilogue([(index, mask, z, inv[:, None])], seg_o[i], None, n_rows=n_rows,
                                rows=rows, quant=quant, mode="dynamic", pid=pid,
                                amax=[row_scaled.normed_amax(z, inv)])
            continue
        if seg.eps is not None:
            x = x.astype(jnp.float32)
            x = x * common.row_inv_rms(x, seg.width, seg.eps, ftz, keepdims=True) * w.astype(
                jnp.float32)[None, :]
        common.store(seg_o[i][0], index, x, mask)


def _add_aliases(q, n_outs):
    """The residual add's buffers, as vLLM's ``fused_add_rms_norm`` updates both in place: the new
    residual over the residual; an unquantized output over ``x`` (a quantized one has another
    shape or dtype). With both donated under ``jit`` the launch needs no new buffer; jax pairs a
    donated input with the FIRST output of its shape and dtype, so donating the residual alone
    pairs it with ``y`` and XLA copies it (docs/residual.md)."""
    return {1: n_outs - 1} if q is not None else {0: 0, 1: n_outs - 1}


def loads_weight_first(q: common.Quant | None, n_programs: int, target) -> bool:
    """Whether the residual add loads the weight with x and the residual, before the new
    residual's store (else after it, once x's and the residual's data are in): for a per-token
    output where the programs fit the cores at once (decode). Its amax is taken beside the norm
    (``row_scaled.normed_amax``) and needs the weight before the reduction, so a later load is
    on the critical path of a program that has its core alone. The other outputs need the
    weight after the reduction; with more programs than cores, other programs hide its latency
    and the early load measured slower (docs/residual.md, Decode)."""
    return q is not None and q.fmt.block is None and n_programs <= target.num_cores


def row_elems(widths: Sequence[int]) -> tuple[int, int]:
    """(padded elements per row over all segments, padded width of the widest segment)."""
    padded = [common.pow2(w) for w in widths]
    return sum(padded), max(padded)


def segments_rows(xs: Sequence[jax.Array], segments: Sequence[Segment],
                  weights: Sequence[jax.Array], *, key: str, q: common.Quant | None,
                  interpret: bool, target, config: launch.LaunchConfig | None = None,
                  add: bool = False):
    """Normalize (or copy) ``segments`` of the 2-D row-aligned inputs ``xs [T, *]``.

    ``weights``: one ``[width]`` array per normalized segment, in segment order. Returns one
    ``[T, width]`` array per segment, in its source's dtype; with ``q``, the first segment (which
    must be normalized: ValueError if its ``eps`` is None) instead in ``q``'s format: codes
    ``[T, width]`` and scales ``[T, groups]`` (two results). ``key`` names the launch and picks
    its launch config for ``target``. ``add``: one segment of ``xs[0]``, normalized after
    ``xs[1]`` (the residual, same shape and dtype) is added to it; the sum comes last, written
    over the residual's buffer, an unquantized output over ``xs[0]``'s (``_add_aliases``).
    """
    if add and (len(xs) != 2 or len(segments) != 1):
        raise ValueError("the residual add takes two inputs (x, residual) and one segment")
    n_rows = xs[0].shape[0]
    segments = tuple(Segment(s.source, s.start, s.width, None if s.eps is None else float(s.eps))
                     for s in segments)
    if q is not None and segments[0].eps is None:
        raise ValueError("the quantized (first) segment must be normalized (eps given)")

    splits = (2,) if len(segments) > 1 else ()  # the first segment, and the others
    if config is None:
        widths = [s.width for s in segments] * (2 if add else 1)  # add: two loads per element
        config = launch.launch_config(key, n_rows, *row_elems(widths), target=target,
                                      splits=splits)
    groups = ((0,), tuple(range(1, len(segments)))) if config.split in splits else None
    kernel = functools.partial(_kernel, n_rows=n_rows, rows=config.rows_per_program,
                               n_sources=len(xs), segments=segments, quant=q,
                               ftz=common.flush_to_zero(target, interpret), groups=groups,
                               add=add, weight_first=add and loads_weight_first(
                                   q, -(-n_rows // config.rows_per_program), target))
    outs = [jax.ShapeDtypeStruct((n_rows, s.width), xs[s.source].dtype) for s in segments]
    poison = [float("nan")] * len(outs)
    blocks = q is not None and q.fmt.block is not None
    if blocks:  # the first segment's output: codes and a scale per block
        outs[:1], poison[:1] = block_scaled.outputs((n_rows,), segments[0].width, q)
    elif q is not None:  # the first segment's output: codes and a scale per row
        outs[:1], poison[:1] = row_scaled.outputs(outs[0].shape, n_rows, q, "dynamic", None)
    if add:  # the new residual, in the residual's buffer
        outs.append(jax.ShapeDtypeStruct(xs[1].shape, xs[1].dtype))
        poison.append(float("nan"))
    result = common.row_call(
        kernel, name=f"k3pallas_{key}", n_rows=n_rows, config=config, row_inputs=list(xs),
        shared_inputs=list(weights), out_shapes=outs, interpret=interpret, out_poison=poison,
        programs_per_block=1 if groups is None else len(groups),
        aliases=_add_aliases(q, len(outs)) if add else None)
    if blocks:
        result = [*block_scaled.results(*result[:2], q, segments[0].width), *result[2:]]
    elif q is not None:
        result = [*row_scaled.results(result[:2], q, "dynamic"), *result[2:]]
    return result


# ------------------------------------------------------------------------------------------------
# Entries (k3pallas.kernels.entry): one device's arrays, in the layout of the op's sharding rule
# ------------------------------------------------------------------------------------------------


def _lead(a):
    return a.shape[:-1]


def _quantized(outs, lead, width, q):
    """(codes [..., width], scales [..., G], the other segments...) in the leading shape."""
    if q is None:
        return tuple(o.reshape(lead + (o.shape[-1],)) for o in outs)
    codes, scale, *rest = outs
    return (codes.reshape(lead + (width,)), scale.reshape(lead + (q.fmt.scale_groups(width),)),
            *(o.reshape(lead + (o.shape[-1],)) for o in rest))


def rmsnorm(x, w, *, op, fmt, cast, eps, interpret, target, reduce_axes):
    """``x [..., D]`` -> ``y`` (``fmt`` None) or ``(codes, scales [..., G])``."""
    q = common.quant(fmt, cast, interpret=interpret, target=target)
    outs = segments_rows([common.as_rows(x, 1)], [Segment(0, 0, x.shape[-1], eps)], [w],
                         key=common.launch_name(op, fmt), q=q, interpret=interpret, target=target)
    outs = _quantized(outs, _lead(x), x.shape[-1], q)
    return outs[0] if q is None else outs


def fused_q_kv_rmsnorm(q_c, kv, wq, wkv, *, op, fmt, cast, eps, kv_eps, interpret, target,
                       reduce_axes):
    """``(q, kv)``, or with ``fmt`` ``(q codes, q scales [..., G], kv)``: q quantized from float32."""
    q = common.quant(fmt, cast, interpret=interpret, target=target)
    segments = [Segment(0, 0, q_c.shape[-1], eps), Segment(1, 0, kv.shape[-1], kv_eps)]
    outs = segments_rows([common.as_rows(q_c, 1), common.as_rows(kv, 1)], segments, [wq, wkv],
                         key=common.launch_name(op, fmt), q=q, interpret=interpret, target=target)
    return _quantized(outs, _lead(q_c), q_c.shape[-1], q)


def _packed_segments(a, q_size, kv_size, eps, kv_eps):
    """The packed MLA rows' segments: q and kv normalized, the rope part (if any) copied."""
    rope = a.shape[-1] - q_size - kv_size
    segments = [Segment(0, 0, q_size, eps), Segment(0, q_size, kv_size, kv_eps)]
    return segments + ([Segment(0, q_size + kv_size, rope, None)] if rope else [])


def mla_q_kv_norm(a, wq, wkv, *, op, fmt, cast, q_size, kv_size, eps, kv_eps, interpret, target,
                  reduce_axes):
    """``(q, kv[, k_pe])``, or with ``fmt`` ``(q codes, q scales, kv[, k_pe])`` (k_pe where the
    packed rows have a rope part)."""
    q = common.quant(fmt, cast, interpret=interpret, target=target)
    outs = segments_rows([common.as_rows(a, 1)], _packed_segments(a, q_size, kv_size, eps, kv_eps),
                         [wq, wkv], key=common.launch_name(op, fmt), q=q, interpret=interpret,
                         target=target)
    return _quantized(outs, _lead(a), q_size, q)


def add_rmsnorm(x, r, w, *, op, fmt, cast, eps, interpret, target, reduce_axes):
    """``x + r`` (rounded to the dtype) normalized: ``(y, new r)`` or with ``fmt``
    ``(codes, scales [..., G], new r)``; the new residual written over ``r``'s buffer."""
    q = common.quant(fmt, cast, interpret=interpret, target=target)
    outs = segments_rows([common.as_rows(x, 1), common.as_rows(r, 1)],
                         [Segment(0, 0, x.shape[-1], eps)], [w], key=common.launch_name(op, fmt),
                         q=q, interpret=interpret, target=target, add=True)
    return _quantized(outs, _lead(x), x.shape[-1], q)


# The op entries (``k3pallas.kernels.entry``), each named after its op.
ENTRIES = (rmsnorm, fused_q_kv_rmsnorm, mla_q_kv_norm, add_rmsnorm)
