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
  reads the packed rows directly, so no XLA slice materializes a copy before it.

Per normalized segment: ``y = x * rsqrt(sum(x**2) / D + eps) * w`` in float32, one cast at the
store.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from k3pallas import fp8 as fp8_lib, mx as mx_lib
from k3pallas._compat import pl
from k3pallas.kernels import common, launch, mx as mx_kernels, quant as quant_lib


class Segment(NamedTuple):
    source: int  # index of the input the columns come from
    start: int  # first column
    width: int
    eps: float | None  # None: copied through, no weight


def _kernel(*refs, n_rows: int, rows: int, n_sources: int, segments: tuple[Segment, ...],
            quant: fp8_lib.Fp8Params | mx_lib.MxParams | None,
            groups: tuple[tuple[int, ...], ...] | None = None):
    """``groups``: None, every segment in each program; else the segments of the programs
    ``pl.program_id(1) = 0, 1, ...`` of a row block (``LaunchConfig.split``)."""
    n_norm = sum(s.eps is not None for s in segments)
    x_refs = refs[:n_sources]
    w_refs = iter(refs[n_sources:n_sources + n_norm])
    o_refs = iter(refs[n_sources + n_norm:])
    # Per segment: its weight ref (or None) and its output refs (the FP8 first segment: 2).
    seg_w = [next(w_refs) if s.eps is not None else None for s in segments]
    seg_o = [[next(o_refs)] + ([next(o_refs)] if i == 0 and quant is not None else [])
             for i in range(len(segments))]
    pid = pl.program_id(0)
    if groups is None:
        _segments(range(len(segments)), x_refs, seg_w, seg_o, n_rows=n_rows, rows=rows,
                  segments=segments, quant=quant, pid=pid)
        return
    for g, ids in enumerate(groups):
        pl.when(pl.program_id(1) == g)(functools.partial(
            _segments, ids, x_refs, seg_w, seg_o, n_rows=n_rows, rows=rows, segments=segments,
            quant=quant, pid=pid))


def _segments(ids, x_refs, seg_w, seg_o, *, n_rows, rows, segments, quant, pid):
    """Normalize (or copy) the segments ``ids`` of this program's rows (``pid``: its row block)."""
    in_rows = common.row_mask(n_rows, rows, 2, pid)
    mx_first = isinstance(quant, mx_lib.MxParams) and 0 in ids  # q as MX: read in blocks
    # Load every tile first: the loads then overlap, and none waits behind another tile's store
    # (a store may alias a later load as far as the compiler knows).
    tiles = []
    for i in ids:
        seg = segments[i]
        if i == 0 and mx_first:
            continue
        index, lanes = common.tile_index(rows, (seg.width,))
        mask = common.both(in_rows, lanes)
        src_index = index if seg.start == 0 else (index[0], index[1] + seg.start)
        x = common.load(x_refs[seg.source], src_index, mask)
        w = None
        if seg.eps is not None:
            w_index, w_lanes = common.lane_index(seg.width)
            w = common.load(seg_w[i], w_index, w_lanes)
        tiles.append((i, index, mask, x, w))
    if mx_first:
        seg = segments[0]
        mx_kernels.normalized_blocks_store(
            x_refs[seg.source], seg_w[0], *seg_o[0], in_rows=common.row_mask(n_rows, rows, 1, pid),
            rows=rows, col0=seg.start, width=seg.width, eps=seg.eps, q=quant)
    for i, index, mask, x, w in tiles:
        seg = segments[i]
        if i == 0 and quant is not None:  # the first segment as FP8: codes and a scale per row
            # y = (x * w) * inv_rms, its amax beside the norm (quant.normed_amax).
            x = x.astype(jnp.float32)
            inv = common.row_inv_rms(x, seg.width, seg.eps)
            z = x * w.astype(jnp.float32)[None, :]
            quant_lib.epilogue([(index, mask, z, inv[:, None])], seg_o[i], None, n_rows=n_rows,
                               rows=rows, quant=quant, mode="dynamic", pid=pid,
                               amax=[quant_lib.normed_amax(z, inv)])
            continue
        if seg.eps is not None:
            x = x.astype(jnp.float32)
            x = x * common.row_inv_rms(x, seg.width, seg.eps, keepdims=True) * w.astype(
                jnp.float32)[None, :]
        common.store(seg_o[i][0], index, x, mask)


def row_elems(widths: Sequence[int]) -> tuple[int, int]:
    """(padded elements per row over all segments, padded width of the widest segment)."""
    padded = [common.pow2(w) for w in widths]
    return sum(padded), max(padded)


def segments_rows(xs: Sequence[jax.Array], segments: Sequence[Segment],
                  weights: Sequence[jax.Array], *, op: str, interpret: bool,
                  config: launch.LaunchConfig | None = None,
                  fp8: fp8_lib.Fp8Params | mx_lib.MxParams | None = None):
    """Normalize (or copy) ``segments`` of the 2-D row-aligned inputs ``xs [T, *]``.

    ``weights``: one ``[width]`` array per normalized segment, in segment order. Returns one
    ``[T, width]`` array per segment, in its source's dtype; with ``fp8``, the first segment
    (which must be normalized: ValueError if its ``eps`` is None) instead as per-token FP8,
    ``codes [T, width]`` and ``scale [T]`` float32 (two results), or with ``MxParams`` as MX
    (``elements [T, width]``, e8m0 ``scales [T, width / 32]``). ``op`` names the launch and
    picks its launch config.
    """
    n_rows = xs[0].shape[0]
    segments = tuple(Segment(s.source, s.start, s.width, None if s.eps is None else float(s.eps))
                     for s in segments)
    if fp8 is not None and segments[0].eps is None:
        raise ValueError("the quantized (first) segment must be normalized (eps given)")

    splits = (2,) if len(segments) > 1 else ()  # the first segment, and the others
    if config is None:
        config = launch.launch_config(op, n_rows, *row_elems([s.width for s in segments]),
                                      splits=splits)
    groups = ((0,), tuple(range(1, len(segments)))) if config.split in splits else None
    is_mx = isinstance(fp8, mx_lib.MxParams)
    if fp8 is None:
        quant = None
    elif is_mx:
        quant = mx_kernels.kernel_params(fp8, interpret=interpret)
    else:
        quant = quant_lib.kernel_quant(fp8, interpret=interpret)
    kernel = functools.partial(_kernel, n_rows=n_rows, rows=config.rows_per_program,
                               n_sources=len(xs), segments=segments, quant=quant, groups=groups)
    outs = [jax.ShapeDtypeStruct((n_rows, s.width), xs[s.source].dtype) for s in segments]
    poison = [float("nan")] * len(outs)
    if is_mx:  # the first segment's output: MX codes and a scale code per block
        outs[:1], poison[:1] = mx_kernels.outputs((n_rows,), segments[0].width, quant)
    elif quant is not None:  # the first segment's output: FP8 codes and a scale per row
        outs[:1], poison[:1] = quant_lib.outputs(outs[0].shape, n_rows, quant, "dynamic", None)
    result = common.row_call(
        kernel, name=f"k3pallas_{op}" + (f"_{quant.format}" if is_mx else ""), n_rows=n_rows,
        config=config,
        row_inputs=list(xs), shared_inputs=list(weights), out_shapes=outs, interpret=interpret,
        out_poison=poison, programs_per_block=1 if groups is None else len(groups))
    if is_mx:
        result = [*mx_kernels.results(*result[:2], quant, segments[0].width), *result[2:]]
    elif quant is not None:
        result = [*quant_lib.results(result[:2], quant, "dynamic"), *result[2:]]
    return result


def rmsnorm_rows(xs: Sequence[jax.Array], weights: Sequence[jax.Array], eps: Sequence[float], *,
                 op: str, interpret: bool, config: launch.LaunchConfig | None = None,
                 fp8: fp8_lib.Fp8Params | None = None):
    """Normalize whole 2-D row-aligned tensors ``xs[i] [T, D_i]`` with ``weights[i] [D_i]``
    (``fp8``: the first as per-token FP8, see ``segments_rows``)."""
    segments = [Segment(i, 0, x.shape[1], e) for i, (x, e) in enumerate(zip(xs, eps))]
    return segments_rows(xs, segments, weights, op=op, interpret=interpret, config=config, fp8=fp8)


# ------------------------------------------------------------------------------------------------
# Entries (k3pallas.kernels.entry): one device's arrays, in the layout of the op's sharding rule
# ------------------------------------------------------------------------------------------------


def rmsnorm(x, w, *, op, eps, interpret, reduce_axes):
    (y,) = rmsnorm_rows([common.as_rows(x, 1)], [w], [eps], op=op, interpret=interpret)
    return y.reshape(x.shape)


def fused_q_kv_rmsnorm(q, kv, wq, wkv, *, op, eps, kv_eps, interpret, reduce_axes):
    q_out, kv_out = rmsnorm_rows([common.as_rows(q, 1), common.as_rows(kv, 1)], [wq, wkv],
                                 [eps, kv_eps], op=op, interpret=interpret)
    return q_out.reshape(q.shape), kv_out.reshape(kv.shape)


def _packed_segments(a, q_size, kv_size, eps, kv_eps):
    """The packed MLA rows' segments: q and kv normalized, the rope part (if any) copied."""
    rope = a.shape[-1] - q_size - kv_size
    segments = [Segment(0, 0, q_size, eps), Segment(0, q_size, kv_size, kv_eps)]
    return segments + ([Segment(0, q_size + kv_size, rope, None)] if rope else [])


def mla_q_kv_norm(a, wq, wkv, *, op, q_size, kv_size, eps, kv_eps, interpret, reduce_axes):
    outs = segments_rows([common.as_rows(a, 1)], _packed_segments(a, q_size, kv_size, eps, kv_eps),
                         [wq, wkv], op=op, interpret=interpret)
    return tuple(o.reshape(a.shape[:-1] + (o.shape[-1],)) for o in outs)


def _q_quantized(q, kv, wq, wkv, *, op, eps, kv_eps, params, interpret):
    """The joint norm with q quantized (``params``: per-token FP8 or MX): (q codes, q scale
    ``[..., 1]`` / ``[..., Dq / 32]``, kv)."""
    codes, scale, kv_out = rmsnorm_rows([common.as_rows(q, 1), common.as_rows(kv, 1)], [wq, wkv],
                                        [eps, kv_eps], op=op, interpret=interpret, fp8=params)
    return (codes.reshape(q.shape), scale.reshape(q.shape[:-1] + (-1,)),
            kv_out.reshape(kv.shape))


def _packed_quantized(a, wq, wkv, *, op, q_size, kv_size, eps, kv_eps, params, interpret):
    """The packed norm with q quantized: (q codes, q scale, kv, k_pe where there is one)."""
    codes, scale, *rest = segments_rows([common.as_rows(a, 1)],
                                        _packed_segments(a, q_size, kv_size, eps, kv_eps),
                                        [wq, wkv], op=op, interpret=interpret, fp8=params)
    lead = a.shape[:-1]
    return (codes.reshape(lead + (q_size,)), scale.reshape(lead + (-1,)),
            *(o.reshape(lead + (o.shape[-1],)) for o in rest))


def fused_q_kv_rmsnorm_fp8(q, kv, wq, wkv, *, fp8, reduce_axes, **kw):
    return _q_quantized(q, kv, wq, wkv, params=fp8, **kw)


def mla_q_kv_norm_fp8(a, wq, wkv, *, fp8, reduce_axes, **kw):
    return _packed_quantized(a, wq, wkv, params=fp8, **kw)


def fused_q_kv_rmsnorm_mx(q, kv, wq, wkv, *, mx, reduce_axes, **kw):
    return _q_quantized(q, kv, wq, wkv, params=mx, **kw)


def mla_q_kv_norm_mx(a, wq, wkv, *, mx, reduce_axes, **kw):
    return _packed_quantized(a, wq, wkv, params=mx, **kw)


# The op entries (``k3pallas.kernels.entry``), each named after its op.
ENTRIES = (rmsnorm, fused_q_kv_rmsnorm, mla_q_kv_norm, fused_q_kv_rmsnorm_fp8, mla_q_kv_norm_fp8,
           fused_q_kv_rmsnorm_mx, mla_q_kv_norm_mx)
