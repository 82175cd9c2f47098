"""MX block-scaled outputs (MXFP8, MXFP4; ``k3pallas.mx``): the tiles, the block epilogue and the
kernels of the MX ops, one launch each, ``R`` tokens per program.

A row's columns are read as blocks of 32: ``[R, b, 32]`` tiles for MXFP8 and ``[R, b, 16, 2]``
for MXFP4 (the pair axis: the two elements of a code byte), over power-of-two pieces of the
block axis (1536 columns: 32 + 16 blocks). MX blocks are independent, so a kernel row is a head
(gated) or at most 64 blocks of a token (quant, sigmoid-mul): a wide token spreads over programs.
Per block: ``amax``, the e8m0 scale code with integer operations (``mx.scale_code``), the exact
reciprocal, the codes (integer encoder, or the native e4m3fn cast where ``fp8_cast`` decided it),
and for MXFP4 the two nibbles of a byte, element ``2j`` low. Codes and scale codes are stored as
bytes; the entries present them as ``float4_e2m1fn`` / ``float8_e4m3fn`` and
``float8_e8m0fnu`` arrays (bitcasts). The normalized or gated values never go through memory.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from k3pallas import fp8 as fp8_lib, mx as mx_lib
from k3pallas.kernels import common, fp8_cast, launch
from k3pallas.kernels.gated_fp8 import act_fn as _activation

BLOCK = mx_lib.BLOCK


def kernel_params(q: mx_lib.MxParams, *, interpret: bool) -> mx_lib.MxParams:
    """``q`` with its conversion decided for this kernel (MXFP4: the encoder, see ``fp8_cast``)."""
    native = fp8_cast.decide(q.dtype, q.cast, interpret=interpret).native
    return dataclasses.replace(q, native=native)


# ------------------------------------------------------------------------------------------------
# Tiles: index arrays of a block piece
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Piece:
    load: tuple  # index of the elements, tile shape [R, b, 32] or [R, b, 16, 2]
    mask: object  # of the elements
    codes: tuple  # index into the code bytes [R, width / per_byte]
    codes_mask: object
    scale: tuple  # index into the scale codes [R, width / 32], shape [R, b]
    scale_mask: object
    blocks: tuple  # (first block, blocks) of this piece, for weights in block layout


def pieces(rows, in_rows, n_blocks, per_byte, col0=0):
    """The block pieces of ``rows`` rows (``in_rows``: their ``[R]`` mask): ``n_blocks`` blocks of
    32 starting at column ``col0`` of the input, as power-of-two pieces of the block axis. Code
    and scale indices count from column 0 of the outputs."""
    r = jnp.arange(rows, dtype=jnp.int32)
    half = BLOCK // 2
    for b0, bs in common.pow2_parts(n_blocks):
        b = b0 + jnp.arange(bs, dtype=jnp.int32)
        mask = in_rows[:, None]
        if b0 + bs > n_blocks:  # the padded last piece
            mask = mask & (b < n_blocks)[None, :]
        if per_byte == 1:
            col = b[None, :, None] * BLOCK + jnp.arange(BLOCK, dtype=jnp.int32)[None, None, :]
            load, codes = (r[:, None, None], col), (r[:, None, None], col)
            load_mask = codes_mask = mask[:, :, None]
        else:
            k = jnp.arange(half, dtype=jnp.int32)
            col = (b[None, :, None, None] * BLOCK + 2 * k[None, None, :, None]
                   + jnp.arange(2, dtype=jnp.int32)[None, None, None, :])
            load, load_mask = (r[:, None, None, None], col), mask[:, :, None, None]
            codes = (r[:, None, None], b[None, :, None] * half + k[None, None, :])
            codes_mask = mask[:, :, None]
        yield Piece(load=(load[0], load[1] + col0 if col0 else load[1]), mask=load_mask,
                    codes=codes, codes_mask=codes_mask, scale=(r[:, None], b[None, :]),
                    scale_mask=mask, blocks=(b0, bs))


def weight_index(piece: Piece, per_byte, col0=0):
    """Index of a ``[D]`` weight in the block layout of ``piece`` (``[b, 32]`` / ``[b, 16, 2]``)."""
    b0, bs = piece.blocks
    b = b0 + jnp.arange(bs, dtype=jnp.int32)
    if per_byte == 1:
        return b[:, None] * BLOCK + jnp.arange(BLOCK, dtype=jnp.int32)[None, :] + col0
    k = jnp.arange(BLOCK // 2, dtype=jnp.int32)[None, :, None]
    p = jnp.arange(2, dtype=jnp.int32)[None, None, :]
    return b[:, None, None] * BLOCK + 2 * k + p + col0


def block_mask(piece: Piece, n_blocks, per_byte):
    """The weight's mask for a padded last block piece (None otherwise)."""
    b0, bs = piece.blocks
    if b0 + bs <= n_blocks:
        return None
    b = b0 + jnp.arange(bs, dtype=jnp.int32)
    return (b < n_blocks)[:, None] if per_byte == 1 else (b < n_blocks)[:, None, None]


# ------------------------------------------------------------------------------------------------
# The block epilogue
# ------------------------------------------------------------------------------------------------


def block_codes(y, q: mx_lib.MxParams):
    """float32 blocks ``y [..., 32]`` (MXFP8) or ``[..., 16, 2]`` (MXFP4) -> (code bytes
    ``[..., 32]`` / ``[..., 16]``, e8m0 scale codes ``[...]`` int32)."""
    fmt = q.fmt
    trail = 1 if fmt.per_byte == 1 else 2
    a = jnp.abs(y)
    amax, total = a, a
    for _ in range(trail):
        amax, total = jnp.max(amax, axis=-1), jnp.sum(total, axis=-1)
    # NaN: the sum keeps it (Triton's max drops it); infinity: the max keeps it.
    nonfinite = (total != total) | (amax == jnp.inf)
    code = mx_lib.scale_code(amax, fmt, nonfinite)
    v = y * mx_lib.inv_scale(code)[(Ellipsis,) + (None,) * trail]
    if q.native:
        return fp8_cast.native_codes(v, fmt.dtype), code
    c = fp8_lib.encode_fp8(v, fmt.dtype)
    if fmt.per_byte == 2:  # element 2j in the low nibble, 2j + 1 in the high one
        c = jnp.sum(c << (jnp.arange(2, dtype=jnp.int32) * 4), axis=-1)
    return c, code


def store_blocks(piece: Piece, y, codes_ref, scale_ref, q):
    c, code = block_codes(y, q)
    common.store(codes_ref, piece.codes, c, piece.codes_mask)
    common.store(scale_ref, piece.scale, code, piece.scale_mask)


def outputs(lead_shape, width, q: mx_lib.MxParams):
    """(output structs, poison values): code bytes ``[*lead, width / per_byte]`` and scale codes
    ``[*lead, width / 32]`` (``lead_shape``: the rows). Poison: a NaN code (MXFP8) or 0xFF (MXFP4: -6, -6; the tests compare
    codes exactly), and the NaN scale 0xFF."""
    fmt = q.fmt
    native = q.native and fmt.per_byte == 1
    codes = jax.ShapeDtypeStruct(tuple(lead_shape) + (width // fmt.per_byte,),
                                 fmt.dtype if native else jnp.uint8)
    scale = jax.ShapeDtypeStruct(tuple(lead_shape) + (width // BLOCK,), jnp.uint8)
    poison = float("nan") if native else (0x7F if fmt.per_byte == 1 else 0xFF)
    return [codes, scale], [poison, 0xFF]


def results(codes, scale, q: mx_lib.MxParams, width):
    """The kernel's bytes as (elements ``[..., width]``, ``float8_e8m0fnu`` scales)."""
    return mx_lib.as_elements(codes, q.fmt, width), mx_lib.as_e8m0(scale)


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------

def _rows_kernel(*refs, n_rows, rows, width, n_inputs, q, combine):
    """Row kernels (``[R, width]`` inputs): ``combine(*float32 tiles)`` per block piece, then MX."""
    x_refs, (codes_ref, scale_ref) = refs[:n_inputs], refs[n_inputs:]
    loaded = [(p, [common.load(ref, p.load, p.mask) for ref in x_refs])
              for p in pieces(rows, common.row_mask(n_rows, rows, 1), width // BLOCK,
                              q.fmt.per_byte)]
    for p, xs in loaded:
        store_blocks(p, combine(*[x.astype(jnp.float32) for x in xs]), codes_ref, scale_ref, q)


def normalized_blocks_store(x_ref, w_ref, codes_ref, scale_ref, *, in_rows, rows, col0, width,
                            eps, q, g_ref=None, activation="sigmoid"):
    """Columns ``col0 .. col0 + width`` of ``x_ref``'s rows (``in_rows``: ``[R]``) normalized with
    ``w_ref``, times ``act(g)`` of ``g_ref``'s same columns where one is given (the gated norm),
    and quantized by blocks: the gated MX kernel and the first segment of ``kernels.rmsnorm``."""
    per_byte, n_blocks = q.fmt.per_byte, width // BLOCK
    trail = 2 if per_byte == 1 else 3  # the block axes of a tile
    loaded = [(p, common.load(x_ref, p.load, p.mask),
               None if g_ref is None else common.load(g_ref, p.load, p.mask),
               common.load(w_ref, weight_index(p, per_byte), block_mask(p, n_blocks, per_byte)))
              for p in pieces(rows, in_rows, n_blocks, per_byte, col0=col0)]
    ss = None
    for _, x, _, _ in loaded:  # the row's mean square over all its block pieces
        x = x.astype(jnp.float32)
        s = x * x
        for _ in range(trail):
            s = jnp.sum(s, axis=-1)
        ss = s if ss is None else ss + s
    inv = common.inv_rms(ss / width, eps)[(Ellipsis,) + (None,) * trail]
    for p, x, g, w in loaded:
        y = x.astype(jnp.float32) * inv * w.astype(jnp.float32)[None]
        if g is not None:
            y = y * _activation(g.astype(jnp.float32), activation)
        store_blocks(p, y, codes_ref, scale_ref, q)


def _gated_kernel(x_ref, g_ref, w_ref, codes_ref, scale_ref, *, n_rows, rows, width, eps,
                  activation, q):
    """``rmsnorm(x) * w * act(g)`` of one head per row, then MX."""
    normalized_blocks_store(x_ref, w_ref, codes_ref, scale_ref, g_ref=g_ref,
                            activation=activation, in_rows=common.row_mask(n_rows, rows, 1),
                            rows=rows, col0=0, width=width, eps=eps, q=q)


def row_elems(width: int, n_inputs: int) -> tuple[int, int]:
    """(elements a row loads over the inputs, elements of its largest tile row)."""
    parts = common.pow2_parts(width // BLOCK)
    return n_inputs * sum(s for _, s in parts) * BLOCK, parts[0][1] * BLOCK


def _launch(kernel, *, op, q, row_inputs, shared_inputs, interpret, config=None):
    """ONE MX launch of ``kernel`` over rows ``[T, width]``: (elements ``[T, width]``, scales
    ``[T, width / 32]``)."""
    n_rows, width = row_inputs[0].shape
    q = kernel_params(q, interpret=interpret)
    if config is None:
        config = launch.launch_config(op, n_rows, *row_elems(width, len(row_inputs)))
    outs, poison = outputs((n_rows,), width, q)
    codes, scale = common.row_call(
        functools.partial(kernel, n_rows=n_rows, rows=config.rows_per_program, width=width, q=q),
        name=f"k3pallas_{op}_{q.format}", n_rows=n_rows, config=config, row_inputs=row_inputs,
        shared_inputs=shared_inputs, out_shapes=outs, interpret=interpret, out_poison=poison)
    return results(codes, scale, q, width)


def mx_rows(xs, *, op, mx, combine, interpret, config=None):
    """``xs``: 1 or 2 inputs ``[T, N]`` -> MX of ``combine(*xs)`` (float32)."""
    kernel = functools.partial(_rows_kernel, n_inputs=len(xs), combine=combine)
    return _launch(kernel, op=op, q=mx, row_inputs=list(xs), shared_inputs=[],
                   interpret=interpret, config=config)


def gated_rows(x, gate, weight, *, op, eps, activation, mx, interpret, config=None):
    """``x``, ``gate`` ``[T, D]`` (one head per row), ``weight [D]`` -> MX of the gated RMSNorm."""
    kernel = functools.partial(_gated_kernel, eps=float(eps), activation=activation)
    return _launch(kernel, op=op, q=mx, row_inputs=[x, gate], shared_inputs=[weight],
                   interpret=interpret, config=config)


# ------------------------------------------------------------------------------------------------
# Entries (k3pallas.kernels.entry): one device's arrays, in the layout of the op's sharding rule
# ------------------------------------------------------------------------------------------------


def _identity(x):
    return x


def _sigmoid_mul(x, g):
    return x * _activation(g, "sigmoid")


# Blocks are independent, so a token's row may be cut into several kernel rows: a wide row (96 x
# 128 columns) then spreads over many programs at decode instead of one (bench/NOTES.md).
MAX_ROW_BLOCKS = 64  # 2048 elements


def _row_blocks(blocks: int) -> int:
    """Blocks per kernel row: all of a token's, or the largest divisor <= MAX_ROW_BLOCKS."""
    return max(d for d in range(1, min(blocks, MAX_ROW_BLOCKS) + 1) if blocks % d == 0)


def mx_quant(x, *, op, mx, interpret, reduce_axes):
    """x ``[..., B, 32]`` -> (elements of that shape, scales ``[..., B]``)."""
    width = _row_blocks(x.shape[-2]) * BLOCK
    data, scale = mx_rows([x.reshape(-1, width)], op=op, mx=mx, combine=_identity,
                          interpret=interpret)
    return data.reshape(x.shape), scale.reshape(x.shape[:-1])


def sigmoid_mul_mx(x, g, *, op, mx, interpret, reduce_axes):
    width = _row_blocks(x.shape[-2]) * BLOCK
    data, scale = mx_rows([x.reshape(-1, width), g.reshape(-1, width)], op=op, mx=mx,
                          combine=_sigmoid_mul, interpret=interpret)
    return data.reshape(x.shape), scale.reshape(x.shape[:-1])


def rmsnorm_gated_mx(x, w, g, *, op, eps, activation, mx, interpret, reduce_axes):
    """x, g ``[..., H, B, 32]``, w ``[B, 32]`` -> (elements of x's shape, scales ``[..., H, B]``).
    Each head is a kernel row (heads are independent here, unlike per-token FP8)."""
    width = x.shape[-2] * BLOCK
    data, scale = gated_rows(x.reshape(-1, width), g.reshape(-1, width), w.reshape(width), op=op,
                             eps=eps, activation=activation, mx=mx, interpret=interpret)
    return data.reshape(x.shape), scale.reshape(x.shape[:-1])


ENTRIES = (mx_quant, sigmoid_mul_mx, rmsnorm_gated_mx)
