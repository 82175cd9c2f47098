"""Block-scaled outputs (a scale per block of ``fmt.block`` contiguous elements of a row: MXFP8,
MXFP4, ``formats.Mx``; group-scaled FP8, ``formats.Fp8Group``): the tiles, the block epilogue
and the block kernels, one launch each, ``R`` rows per program.

A row's columns are read as blocks: ``[R, b, block]`` tiles, or in the norms ``[R, b, block /
2, 2]`` for two elements per byte (the pair axis: the two elements of a code byte), over
power-of-two pieces of the block axis (1536 columns: 32 + 16 blocks of 32). The gated and row
kernels read two per byte as ``[R, b, block]`` too and pair the codes after the encoder: a pair
tile gives a thread one pair (32-bit loads), a block tile contiguous runs (docs/performance.md).
Blocks are independent, so a kernel row is a head (gated) or at most 64 blocks of a token
(quantize, sigmoid-mul): a wide token spreads over programs. Per block: ``amax``, the scale and
its reciprocal from the format (``fmt.block_scale``), the values to round (``fmt.scaled``:
exact), the codes (integer encoder, or the native cast where ``fp8_cast`` decided it), and for
two per byte the two nibbles, element ``2j`` low. Codes and scales are stored as bytes; the
results present them as the format's element and scale arrays (bitcasts). The normalized or
gated values never go through memory. ``q``: a ``common.Quant`` of a block format.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from k3pallas import fp8 as fp8_lib
from k3pallas.kernels import common, fp8_cast, launch


# ------------------------------------------------------------------------------------------------
# Tiles: index arrays of a block piece
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Piece:
    load: tuple  # index of the elements, tile shape [R, b, block] or [R, b, block / 2, 2]
    mask: object  # of the elements
    codes: tuple  # index into the code bytes [R, width / per_byte]
    codes_mask: object
    scale: tuple  # index into the scales [R, width / block], shape [R, b]
    scale_mask: object
    blocks: tuple  # (first block, blocks) of this piece, for weights in block layout
    pairs: bool  # the tile is [R, b, block / 2, 2]

    @property
    def element_axes(self) -> int:
        """A block's axes in the tile: ``[block]``, or ``[block / 2, 2]`` with pairs."""
        return 2 if self.pairs else 1


def block_parts(n_blocks: int, padded: bool = False) -> list[tuple[int, int]]:
    """The power-of-two pieces of a row's block axis: up to three exact ones (1536 columns: 32 +
    16 blocks of 32); with ``padded`` (the norms), one padded piece where that wastes at most an
    eighth of the lanes (7168: 56 groups of 128 in 64). Each piece has its own reductions and
    layout changes through shared memory: one piece of the 7168 row compiles to 11 barriers at
    8 warps, three to 27, and runs 1.2-3x faster (docs/residual.md). The row kernels (quantize,
    sigmoid-mul) keep exact pieces: for them one piece was faster at decode but 3-8 % slower
    from T = 1024 in two formats (H100, docs/residual.md)."""
    size = common.pow2(n_blocks)
    one = padded and 8 * (size - n_blocks) <= size
    return common.pow2_parts(n_blocks, max_parts=1 if one else 3)


def pieces(rows, in_rows, n_blocks, block, per_byte, col0=0, padded=False, pairs=False):
    """The block pieces of ``rows`` rows (``in_rows``: their ``[R]`` mask): ``n_blocks`` blocks of
    ``block`` starting at column ``col0`` of the input, as power-of-two pieces of the block axis
    (``block_parts``). Two per byte, ``pairs`` loads ``[R, b, block / 2, 2]`` tiles, else
    ``[R, b, block]`` (the codes ``[R, b, block / 2]`` either way). Code and scale indices count
    from column 0 of the outputs."""
    r = jnp.arange(rows, dtype=jnp.int32)
    for b0, bs in block_parts(n_blocks, padded):
        b = b0 + jnp.arange(bs, dtype=jnp.int32)
        mask = in_rows[:, None]
        if b0 + bs > n_blocks:  # the padded last piece
            mask = mask & (b < n_blocks)[None, :]
        paired = per_byte == 2 and pairs
        k = jnp.arange(block // per_byte, dtype=jnp.int32)  # a block's code bytes
        if paired:
            col = (b[None, :, None, None] * block + 2 * k[None, None, :, None]
                   + jnp.arange(2, dtype=jnp.int32)[None, None, None, :])
            load, load_mask = (r[:, None, None, None], col), mask[:, :, None, None]
        else:
            col = b[None, :, None] * block + jnp.arange(block, dtype=jnp.int32)[None, None, :]
            load, load_mask = (r[:, None, None], col), mask[:, :, None]
        codes = col if per_byte == 1 else b[None, :, None] * (block // per_byte) + k[None, None, :]
        yield Piece(load=(load[0], load[1] + col0 if col0 else load[1]), mask=load_mask,
                    codes=(r[:, None, None], codes), codes_mask=mask[:, :, None],
                    scale=(r[:, None], b[None, :]), scale_mask=mask, blocks=(b0, bs), pairs=paired)


def weight_index(piece: Piece, block, col0=0):
    """Index of a ``[D]`` weight in the block layout of ``piece`` (``[b, block]`` /
    ``[b, block / 2, 2]``)."""
    b0, bs = piece.blocks
    b = b0 + jnp.arange(bs, dtype=jnp.int32)
    if not piece.pairs:
        return b[:, None] * block + jnp.arange(block, dtype=jnp.int32)[None, :] + col0
    k = jnp.arange(block // 2, dtype=jnp.int32)[None, :, None]
    p = jnp.arange(2, dtype=jnp.int32)[None, None, :]
    return b[:, None, None] * block + 2 * k + p + col0


def block_mask(piece: Piece, n_blocks):
    """The weight's mask for a padded last block piece (None otherwise)."""
    b0, bs = piece.blocks
    if b0 + bs <= n_blocks:
        return None
    b = b0 + jnp.arange(bs, dtype=jnp.int32)
    return (b < n_blocks)[:, None, None] if piece.pairs else (b < n_blocks)[:, None]


# ------------------------------------------------------------------------------------------------
# The block epilogue
# ------------------------------------------------------------------------------------------------


def block_codes(y, q: common.Quant, trail: int):
    """float32 blocks ``y [..., block]`` (``trail`` 1) or, two per byte in pairs, ``[..., block / 2,
    2]`` (``trail`` 2: ``Piece.element_axes``) -> (code bytes ``[..., block / per_byte]``, stored
    scales ``[...]``)."""
    fmt = q.fmt
    a = jnp.abs(y)
    if trail == 2 or fmt.block >= 128:
        # A pair tile, or a block tile of 128 (the group formats), spreads a block over 16 lanes:
        # NaN counted as infinity before ONE max (two operations an element) is cheaper than a
        # second, NaN-carrying reduction's shuffles. Blocks of 32 span 4 lanes: there the select
        # was no faster (docs/performance.md).
        amax = jnp.where(y != y, jnp.inf, a)
        for _ in range(trail):
            amax = jnp.max(amax, axis=-1)
        nonfinite = amax == jnp.inf
    else:
        amax, total = a, a
        for _ in range(trail):
            amax, total = jnp.max(amax, axis=-1), jnp.sum(total, axis=-1)
        # NaN: the sum keeps it (Triton's max drops it); infinity: the max keeps it.
        nonfinite = (total != total) | (amax == jnp.inf)
    stored, inv = fmt.block_scale(amax, nonfinite)
    per_element = (Ellipsis,) + (None,) * trail
    v = fmt.scaled(y, stored[per_element], inv[per_element])
    if q.native:
        return fp8_cast.native_codes(v, fmt.dtype), stored
    c = fp8_lib.encode_fp8(v, fmt.dtype)
    if fmt.per_byte == 2 and trail == 2:  # element 2j in the low nibble, 2j + 1 in the high one
        c = jnp.sum(c << (jnp.arange(2, dtype=jnp.int32) * 4), axis=-1)
    elif fmt.per_byte == 2:  # the same from a block tile: shifted in the tile's layout, then
        # pairs summed over ONE leading axis, so the pair stays in a thread (a 4-D reshape took
        # a layout change through shared memory, compiled for the H200)
        lead, n = c.shape[:-1], c.shape[-1]
        c = c << ((jnp.arange(n, dtype=jnp.int32) & 1) * 4)
        c = jnp.sum(c.reshape(math.prod(lead), n // 2, 2), axis=-1).reshape(lead + (n // 2,))
    return c, stored


def store_blocks(piece: Piece, y, codes_ref, scale_ref, q):
    c, stored = block_codes(y, q, piece.element_axes)
    common.store(codes_ref, piece.codes, c, piece.codes_mask)
    common.store(scale_ref, piece.scale, stored, piece.scale_mask)


def outputs(lead_shape, width, q: common.Quant):
    """(output structs, poison values): code bytes ``[*lead, width / per_byte]`` and stored
    scales ``[*lead, width / block]`` (``lead_shape``: the rows). Poison: the element format's NaN
    code (two per byte: 0xFF, -6, -6, which the tests compare exactly) and the format's NaN
    scale."""
    fmt = q.fmt
    native = q.native and fmt.per_byte == 1
    codes = jax.ShapeDtypeStruct(tuple(lead_shape) + (width // fmt.per_byte,),
                                 fmt.dtype if native else jnp.uint8)
    scale = jax.ShapeDtypeStruct(tuple(lead_shape) + (width // fmt.block,), fmt.scale_store_dtype)
    poison = (float("nan") if native else
              fp8_lib.element_format(fmt.dtype).nan_code if fmt.per_byte == 1 else 0xFF)
    return [codes, scale], [poison, fmt.scale_poison]


def results(codes, scale, q: common.Quant, width):
    """The kernel's bytes as (elements ``[..., width]``, scales) of the format."""
    fmt = q.fmt
    if fmt.per_byte == 2:
        elements = fmt.unpack(codes, width)
    elif codes.dtype != fmt.dtype:
        elements = jax.lax.bitcast_convert_type(codes, fmt.dtype)
    else:
        elements = codes
    return elements, fmt.scale_from_stored(scale)


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------

def _rows_kernel(*refs, n_rows, rows, width, n_inputs, q, combine):
    """Row kernels (``[R, width]`` inputs): ``combine(*float32 tiles)`` per block piece, then the
    block epilogue."""
    x_refs, (codes_ref, scale_ref) = refs[:n_inputs], refs[n_inputs:]
    loaded = [(p, [common.load(ref, p.load, p.mask) for ref in x_refs])
              for p in pieces(rows, common.row_mask(n_rows, rows, 1), width // q.fmt.block,
                              q.fmt.block, q.fmt.per_byte)]
    for p, xs in loaded:
        store_blocks(p, combine(*[x.astype(jnp.float32) for x in xs]), codes_ref, scale_ref, q)


def normalized_blocks_store(x_ref, w_ref, codes_ref, scale_ref, *, in_rows, rows, col0, width,
                            eps, q, ftz, g_ref=None, activation="sigmoid", res=None, padded=False,
                            pairs=False):
    """Columns ``col0 .. col0 + width`` of ``x_ref``'s rows (``in_rows``: ``[R]``) normalized with
    ``w_ref``, times ``act(g)`` of ``g_ref``'s same columns where one is given (the gated norm),
    and quantized by blocks: the gated block kernel and the first segment of ``kernels.norms``.
    ``res``: (residual ref, new residual ref): the residual is added first (``common.residual_add``:
    the sum, rounded to x's dtype, is stored and normalized). ``padded``: the block axis as one
    padded piece where ``block_parts`` allows it (the norms; the gated heads are powers of two).
    ``pairs``: two per byte, pair tiles (the norms: block tiles, 5-19 % faster in the gated
    kernel, made ``add_rmsnorm`` at 7168 slower; docs/performance.md)."""
    block, per_byte = q.fmt.block, q.fmt.per_byte
    n_blocks = width // block

    def load_x(p):
        x = common.load(x_ref, p.load, p.mask)
        if res is None:
            return x
        return common.residual_add(x, common.load(res[0], p.load, p.mask), p.load, p.mask, res[1])
    loaded = [(p, load_x(p),
               None if g_ref is None else common.load(g_ref, p.load, p.mask),
               common.load(w_ref, weight_index(p, block), block_mask(p, n_blocks)))
              for p in pieces(rows, in_rows, n_blocks, block, per_byte, col0=col0, padded=padded,
                              pairs=pairs)]
    axes = 1 + loaded[0][0].element_axes  # a tile's block axis and a block's (every piece alike)
    ss = None
    for _, x, _, _ in loaded:  # the row's mean square over all its block pieces
        x = x.astype(jnp.float32)
        s = x * x
        for _ in range(axes):
            s = jnp.sum(s, axis=-1)
        ss = s if ss is None else ss + s
    inv = common.inv_rms(ss / width, eps, ftz)[(Ellipsis,) + (None,) * axes]
    for p, x, g, w in loaded:
        y = x.astype(jnp.float32) * inv * w.astype(jnp.float32)[None]
        if g is not None:
            y = y * common.act_fn(g.astype(jnp.float32), activation, ftz)
        if res is not None and per_byte == 1:  # the new residual was stored from this tile
            p = dataclasses.replace(p, codes=common.codes_beside(p.codes, res[1].dtype))
        store_blocks(p, y, codes_ref, scale_ref, q)


def _gated_kernel(x_ref, g_ref, w_ref, codes_ref, scale_ref, *, n_rows, rows, width, eps,
                  activation, q, ftz):
    """``rmsnorm(x) * w * act(g)`` of one head per row, then the block epilogue."""
    normalized_blocks_store(x_ref, w_ref, codes_ref, scale_ref, g_ref=g_ref,
                            activation=activation, in_rows=common.row_mask(n_rows, rows, 1),
                            rows=rows, col0=0, width=width, eps=eps, q=q, ftz=ftz)


def row_elems(width: int, n_inputs: int, block: int) -> tuple[int, int]:
    """(elements a row loads over the inputs, elements of its largest tile row)."""
    parts = block_parts(width // block)
    return n_inputs * sum(s for _, s in parts) * block, parts[0][1] * block


def _launch(kernel, *, key, q, row_inputs, shared_inputs, interpret, target, config=None):
    """ONE launch of ``kernel`` over rows ``[T, width]``: (elements ``[T, width]``, scales
    ``[T, width / block]``). ``key``: the launch key (``common.launch_name``)."""
    n_rows, width = row_inputs[0].shape
    if config is None:
        config = launch.launch_config(key, n_rows, *row_elems(width, len(row_inputs), q.fmt.block),
                                      target=target)
    outs, poison = outputs((n_rows,), width, q)
    codes, scale = common.row_call(
        functools.partial(kernel, n_rows=n_rows, rows=config.rows_per_program, width=width, q=q),
        name=f"k3pallas_{key}", n_rows=n_rows, config=config, row_inputs=row_inputs,
        shared_inputs=shared_inputs, out_shapes=outs, interpret=interpret, out_poison=poison)
    return results(codes, scale, q, width)


def _identity(x):
    return x


def _sigmoid_mul(x, g, *, ftz):
    return x * common.act_fn(g, "sigmoid", ftz)


def rows(xs, *, key, q, interpret, target, gate: bool = False, config=None):
    """``xs``: ``[x]`` or ``[x, gate]``, each ``[T, N]`` -> the block format of ``x`` or of
    ``x * sigmoid(gate)`` (float32)."""
    combine = (functools.partial(_sigmoid_mul, ftz=common.flush_to_zero(target, interpret))
               if gate else _identity)
    kernel = functools.partial(_rows_kernel, n_inputs=len(xs), combine=combine)
    return _launch(kernel, key=key, q=q, row_inputs=list(xs), shared_inputs=[],
                   interpret=interpret, target=target, config=config)


def gated_rows(x, gate, weight, *, key, eps, activation, q, interpret, target, config=None):
    """``x``, ``gate`` ``[T, D]`` (one head per row), ``weight [D]`` -> the block format of the
    gated RMSNorm."""
    kernel = functools.partial(_gated_kernel, eps=float(eps), activation=activation,
                               ftz=common.flush_to_zero(target, interpret))
    return _launch(kernel, key=key, q=q, row_inputs=[x, gate], shared_inputs=[weight],
                   interpret=interpret, target=target, config=config)


# Blocks are independent, so a token's row may be cut into several kernel rows: a wide row (96 x
# 128 columns) then spreads over many programs at decode instead of one (docs/performance.md).
MAX_ROW_ELEMS = 2048


def kernel_row_blocks(blocks: int, block: int) -> int:
    """Blocks per kernel row: all of a token's, or the largest divisor within MAX_ROW_ELEMS."""
    most = max(1, MAX_ROW_ELEMS // block)
    return max(d for d in range(1, min(blocks, most) + 1) if blocks % d == 0)
