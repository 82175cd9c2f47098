"""The gated RMSNorm, the MLA sigmoid-mul and the standalone quantization: Pallas Triton kernels,
one launch each, ``R`` tokens per program; per-token FP8 outputs here (``row_scaled``), block
formats through ``block_scaled``.

The gated kernels load ``x`` and ``gate`` as ``[R, h, D]`` tiles over power-of-two pieces of the
head axis (96 heads: 64 + 32, no padded heads), all before computing any, so their latencies
overlap. The per-token kernels reduce ``amax`` over the whole token and store codes and scale:
``y`` never goes through memory. The epilogue is lean because these kernels sit near the
instruction budget of a memory-bound kernel (measurements: docs/performance.md):

* the sigmoid is ``common.act_fn``: ``rsqrt(1 + exp2(-g * log2(e)))**2``, one hardware
  approximation instead of an IEEE division;
* the scale is applied as one reciprocal per row and a multiply per element;
* the clamp to ``+-fp8_max`` runs only with ``scale_ub`` (without it ``|y / scale|`` exceeds
  ``fp8_max`` only by rounding, which round-to-nearest-even returns to ``fp8_max``);
* ``amax`` is one integer max over ``|y|``'s bit patterns (``common.abs_bits``: NaN and inf
  included), except in the gated FP8 kernel, which has two forms, chosen by shape
  (``amax_beside_norm``): for decode batches it takes ``y = z * inv_rms`` per head
  (``z = x * w * act(g)``), reduces the head's ``amax`` (``max|z| * inv_rms``,
  ``row_scaled.normed_amax``) beside the norm's sum, then ONE integer max over the heads, and the
  codes take ``inv_rms`` and the scale in one multiply: the shortest latency chain. For large
  token counts it reduces ``y`` after the norm with a float max and a sum that carries a NaN
  (Triton's float max drops NaN), which the H200 runs faster there. Padded lanes are 0, so the
  reductions need no mask.

Codes come from the integer encoder or the lowering's own cast, as ``kernels.fp8_cast`` decided.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3pallas import sharding
from k3pallas.kernels import block_scaled, common, launch, row_scaled


def _head_pieces(in_rows, rows, heads, d_index, d_lanes):
    """Yields ``(index, mask)`` of a gated row block's ``[R, h, D]`` tiles, one per power-of-two
    piece of the head axis (``in_rows``: ``common.row_mask`` of the block; ``d_index, d_lanes``:
    ``common.lane_index`` of D). A generator, so that a kernel's loads interleave with it."""
    r = jnp.arange(rows, dtype=jnp.int32)[:, None, None]
    d = d_index[None, None, :]
    for h0, hc in common.pow2_parts(heads):
        h = h0 + jnp.arange(hc, dtype=jnp.int32)[None, :, None]
        mask = common.both(in_rows, None if d_lanes is None else d_lanes[None, None, :])
        if h0 + hc > heads:  # the padded last piece
            mask = common.both(mask, h < heads)
        yield (r, h, d), mask


def _gated_y(x, g, w, *, width, eps, activation, ftz):
    """``rmsnorm(x) * w * act(g)`` of a loaded ``[R, h, D]`` tile pair, in float32 (``w``:
    float32 ``[1, 1, D]``)."""
    x = x.astype(jnp.float32)
    return x * common.row_inv_rms(x, width, eps, ftz, keepdims=True) * w * common.act_fn(
        g.astype(jnp.float32), activation, ftz)


def _gated_kernel(x_ref, g_ref, *refs, n_rows, rows, heads, width, eps, activation, quant, mode,
                  ftz, amax_beside_norm=False):
    s_ref, w_ref, *out_refs = refs if mode == "given_scale" else (None, *refs)
    in_rows = common.row_mask(n_rows, rows, 3)
    d_index, d_lanes = common.lane_index(width)
    loaded = [(index, mask, common.load(x_ref, index, mask), common.load(g_ref, index, mask))
              for index, mask in _head_pieces(in_rows, rows, heads, d_index, d_lanes)]
    w = common.load(w_ref, d_index, d_lanes).astype(jnp.float32)[None, None, :]
    if quant is not None and amax_beside_norm:
        ys, amax = [], []
        for index, mask, x, g in loaded:
            x = x.astype(jnp.float32)
            inv = common.row_inv_rms(x, width, eps, ftz)  # first: needs x alone
            z = x * w * common.act_fn(g.astype(jnp.float32), activation, ftz)
            ys.append((index, mask, z, inv[..., None]))
            amax.append(row_scaled.normed_amax(z, inv))
        row_scaled.epilogue(ys, out_refs, s_ref, n_rows=n_rows, rows=rows, quant=quant,
                            mode=mode, amax=amax)
        return
    ys = [(index, mask, _gated_y(x, g, w, width=width, eps=eps, activation=activation, ftz=ftz))
          for index, mask, x, g in loaded]
    _out(ys, out_refs, s_ref, n_rows=n_rows, rows=rows, quant=quant, mode=mode, bits=False)


def _out(ys, out_refs, s_ref, *, quant, **kw):
    """The float32 tiles ``ys`` [(index, mask, y)] stored in the output's dtype (``quant`` None),
    or quantized per token (``row_scaled.epilogue``)."""
    if quant is None:
        (o_ref,) = out_refs
        for index, mask, y in ys:
            common.store(o_ref, index, y, mask)
        return
    row_scaled.epilogue(ys, out_refs, s_ref, quant=quant, **kw)


# The gated FP8 kernel's amax beside the norm for decode batches of up to 32 heads; the other
# form beyond (H200, both forms with flush-to-zero transcendentals, docs/performance.md: 32 x 128 at
# T = 256 3.20 vs 3.20 us, at 65536 354 vs 337; 96 x 128 at T = 64 4.22 vs 4.00).
_BESIDE_NORM_MAX_TOKENS = 512
_BESIDE_NORM_MAX_HEADS = 32


def amax_beside_norm(n_rows: int, heads: int) -> bool:
    """Which form of the gated FP8 kernel's amax a launch of ``n_rows`` tokens uses."""
    return n_rows <= _BESIDE_NORM_MAX_TOKENS and heads <= _BESIDE_NORM_MAX_HEADS


def _sigmoid_mul_kernel(x_ref, g_ref, *refs, n_rows, rows, width, quant, mode, ftz):
    """``y = x * sigmoid(gate)`` in float32 over power-of-two column pieces (12288 = 8192 +
    4096: no padded lanes), then the row's FP8 (``row_scaled.epilogue``), or ``y`` in x's dtype
    (``quant`` None). Padded lanes of a last piece load 0 and give ``y = 0``."""
    s_ref, *out_refs = refs if mode == "given_scale" else (None, *refs)
    in_rows = common.row_mask(n_rows, rows, 2)
    r = jnp.arange(rows, dtype=jnp.int32)[:, None]
    loaded = []
    for c0, size in common.pow2_parts(width):
        c = c0 + jnp.arange(size, dtype=jnp.int32)[None, :]
        mask = in_rows if c0 + size <= width else common.both(in_rows, c < width)
        index = (r, c)
        loaded.append((index, mask, common.load(x_ref, index, mask), common.load(g_ref, index, mask)))
    ys = [(index, mask, x.astype(jnp.float32) * common.act_fn(g.astype(jnp.float32), "sigmoid", ftz))
          for index, mask, x, g in loaded]
    _out(ys, out_refs, s_ref, n_rows=n_rows, rows=rows, quant=quant, mode=mode)


def _quant_kernel(x_ref, *refs, n_rows, rows, width, quant, mode, ftz):
    del ftz  # no transcendentals
    s_ref, *out_refs = refs if mode == "given_scale" else (None, *refs)
    index, lanes = common.tile_index(rows, (width,))
    mask = common.both(common.row_mask(n_rows, rows, 2), lanes)
    y = common.load(x_ref, index, mask).astype(jnp.float32)
    row_scaled.epilogue([(index, mask, y)], out_refs, s_ref, n_rows=n_rows, rows=rows, quant=quant,
                        mode=mode)


def gated_row_elems(heads: int, width: int) -> tuple[int, int]:
    """(elements one token loads over x and gate, elements of its largest tile row)."""
    parts = common.pow2_parts(heads)
    padded_width = common.pow2(width)
    return 2 * sum(size for _, size in parts) * padded_width, parts[0][1] * padded_width


def sigmoid_mul_row_elems(width: int) -> tuple[int, int]:
    """(elements one row loads over x and gate, elements of its largest tile row)."""
    parts = common.pow2_parts(width)
    return 2 * sum(size for _, size in parts), parts[0][1]


def quant_row_elems(width: int) -> tuple[int, int]:
    """(elements one token loads, elements of its tile row) for the per-token FP8 kernel."""
    padded = common.pow2(width)
    return padded, padded


def _row_call(kernel_fn, key, row_inputs, shared_inputs, row_elems, *, q, interpret, target,
              config, mode, scale, **static):
    """ONE launch of ``kernel_fn`` in ``mode`` (see ``rmsnorm_gated_rows``): with ``q``
    (per-token FP8) codes of the first row input's shape and a scale per row, else one output of
    that shape in its dtype. ``row_elems``: (elements a row loads, elements of its largest tile
    row), for the launch config of ``key``."""
    n_rows = row_inputs[0].shape[0]
    if config is None:
        config = launch.launch_config(key, n_rows, *row_elems, target=target)
    kernel = functools.partial(kernel_fn, n_rows=n_rows, rows=config.rows_per_program,
                               quant=q, mode=mode, ftz=common.flush_to_zero(target, interpret),
                               **static)
    if q is None:
        outs, poison = [jax.ShapeDtypeStruct(row_inputs[0].shape, row_inputs[0].dtype)], None
    else:
        outs, poison = row_scaled.outputs(row_inputs[0].shape, n_rows, q, mode, scale)
    result = common.row_call(
        kernel, name=f"k3pallas_{key}" + ("" if mode == "dynamic" else f"_{mode}"), n_rows=n_rows,
        config=config, row_inputs=list(row_inputs) + ([scale] if mode == "given_scale" else []),
        shared_inputs=list(shared_inputs), out_shapes=outs, interpret=interpret,
        out_poison=poison)
    return result[0] if q is None else row_scaled.results(result, q, mode)


def rmsnorm_gated_rows(x, gate, weight, *, key: str, eps: float, activation: str,
                       q: common.Quant | None, interpret: bool, target,
                       config: launch.LaunchConfig | None = None, mode: str = "dynamic",
                       scale=None, beside_norm: bool | None = None):
    """``x``, ``gate`` ``[T, H, D]``. Without ``q``: y ``[T, H, D]`` in x's dtype. With it
    (per-token FP8), by ``mode``: "dynamic" ``(codes [T, H, D] fp8, scale [T] float32)``;
    "scale_only" ``(None, scale)``; "given_scale" ``(codes, None)`` quantized with ``scale [T]``
    (a scale reduced across devices: see ``k3pallas.sharding``). ``beside_norm``: the FP8 form
    (see the module doc; default ``amax_beside_norm(T, H)``); both meet the same tolerances
    (their roundings differ: a code can move by one step)."""
    n_rows, heads, width = x.shape
    static = dict(heads=heads, width=width, eps=float(eps), activation=activation)
    if q is not None:
        static["amax_beside_norm"] = (amax_beside_norm(n_rows, heads) if beside_norm is None
                                      else beside_norm)
    return _row_call(_gated_kernel, key, [x, gate], [weight], gated_row_elems(heads, width), q=q,
                     interpret=interpret, target=target, config=config, mode=mode, scale=scale,
                     **static)


def quantize_rows(x, *, key: str, q: common.Quant, interpret: bool, target,
                  config: launch.LaunchConfig | None = None, mode: str = "dynamic", scale=None):
    """``x [T, N]`` -> ``(codes [T, N] fp8, scale [T] float32)``; ``mode`` as in
    ``rmsnorm_gated_rows``."""
    width = x.shape[1]
    return _row_call(_quant_kernel, key, [x], [], quant_row_elems(width), q=q,
                     interpret=interpret, target=target, config=config, mode=mode, scale=scale,
                     width=width)


def sigmoid_mul_rows(x, gate, *, key: str, q: common.Quant | None, interpret: bool, target,
                     config: launch.LaunchConfig | None = None, mode: str = "dynamic",
                     scale=None):
    """``x``, ``gate`` ``[T, N]`` -> ``x * sigmoid(gate)`` in x's dtype, or with ``q`` its
    per-token FP8 ``(codes [T, N], scale [T])``; ``mode`` as in ``rmsnorm_gated_rows``."""
    width = x.shape[1]
    return _row_call(_sigmoid_mul_kernel, key, [x, gate], [], sigmoid_mul_row_elems(width), q=q,
                     interpret=interpret, target=target, config=config, mode=mode, scale=scale,
                     width=width)


# ------------------------------------------------------------------------------------------------
# Entries (k3pallas.kernels.entry): one device's arrays, in the layout of the op's sharding rule
# (k3pallas.ops): per-token FP8 rows as [..., G, j(, D)] (j may be split over devices: the scale
# is then reduced across them, sharding.fp8_over_shards); block formats by blocks.
# ------------------------------------------------------------------------------------------------


def rmsnorm_gated(x, w, g, *, op, fmt, cast, eps, activation, interpret, target, reduce_axes):
    """``fmt`` None: x, g ``[..., H, D]`` -> y. Per token: x, g ``[..., G, j, D]`` -> (codes of
    that shape, scale ``[..., G]``). Block format: x, g ``[..., H, C, block]``, w ``[C, block]``
    -> (elements of x's shape, scales ``[..., H, C]``); each head is a kernel row."""
    q = common.quant(fmt, cast, interpret=interpret, target=target)
    key = common.launch_name(op, fmt)
    kw = dict(key=key, q=q, interpret=interpret, target=target)
    if q is not None and fmt.block is not None:
        width = x.shape[-2] * x.shape[-1]
        data, scale = block_scaled.gated_rows(x.reshape(-1, width), g.reshape(-1, width),
                                              w.reshape(width), eps=eps, activation=activation,
                                              **kw)
        return data.reshape(x.shape), scale.reshape(x.shape[:-1])
    run = functools.partial(rmsnorm_gated_rows, common.as_rows(x, 2), common.as_rows(g, 2), w,
                            eps=eps, activation=activation, **kw)
    if q is None:
        return run().reshape(x.shape)
    codes, scale = sharding.fp8_over_shards(run, reduce_axes)
    return codes.reshape(x.shape), scale.reshape(x.shape[:-2])


def _columns(entry_rows, xs, *, op, fmt, cast, interpret, target, reduce_axes):
    """The column ops (sigmoid-mul, quantize) on ``xs`` ``[..., G, j]`` (per token), ``[..., N]``
    (a block format: a token's blocks may spread over several kernel rows) or ``[..., j]`` (None)."""
    q = common.quant(fmt, cast, interpret=interpret, target=target)
    kw = dict(key=common.launch_name(op, fmt), q=q, interpret=interpret, target=target)
    x = xs[0]
    if q is not None and fmt.block is not None:
        blocks = x.shape[-1] // fmt.block
        width = block_scaled.kernel_row_blocks(blocks, fmt.block) * fmt.block
        data, scale = block_scaled.rows([a.reshape(-1, width) for a in xs], gate=len(xs) > 1, **kw)
        return data.reshape(x.shape), scale.reshape(x.shape[:-1] + (blocks,))
    run = functools.partial(entry_rows, *[common.as_rows(a, 1) for a in xs], **kw)
    if q is None:
        return run().reshape(x.shape)
    codes, scale = sharding.fp8_over_shards(run, reduce_axes)
    return codes.reshape(x.shape), scale.reshape(x.shape[:-1])


def sigmoid_mul(x, g, **kw):
    """``x * sigmoid(g)``: in x's dtype (x, g ``[..., N]``), or quantized (see ``_columns``)."""
    return _columns(sigmoid_mul_rows, (x, g), **kw)


def quantize(x, **kw):
    """x quantized (see ``_columns``)."""
    return _columns(quantize_rows, (x,), **kw)


# The op entries (``k3pallas.kernels.entry``), each named after its op.
ENTRIES = (rmsnorm_gated, sigmoid_mul, quantize)
