"""Gated RMSNorm, its fusion with dynamic per-token FP8, standalone per-token FP8 and the MLA
sigmoid-mul FP8: Pallas Triton kernels, one launch each, ``R`` tokens per program.

The gated kernels load ``x`` and ``gate`` as ``[R, h, D]`` tiles over power-of-two pieces of the
head axis (96 heads: 64 + 32, no padded heads), all before computing any, so their latencies
overlap. The FP8 kernels reduce ``amax`` over the whole token and store codes and scale: ``y``
never goes through memory. The epilogue is lean because these kernels sit near the instruction
budget of a memory-bound kernel (measurements: bench/NOTES.md):

* the sigmoid is ``rsqrt(1 + exp2(-g * log2(e)))**2``, one hardware approximation instead of an
  IEEE division, within a few float32 ulp of ``1 / (1 + e)`` (exactly 1 and 0 at the ends);
* the scale is applied as one reciprocal per row and a multiply per element;
* the clamp to ``+-fp8_max`` runs only with ``scale_ub`` (without it ``|y / scale|`` exceeds
  ``fp8_max`` only by rounding, which round-to-nearest-even returns to ``fp8_max``);
* ``amax`` is one integer max over ``|y|``'s bit patterns (``common.abs_bits``: NaN and inf
  included), except in the gated FP8 kernel, which has two forms, chosen by shape
  (``amax_beside_norm``): for decode batches it takes ``y = z * inv_rms`` per head
  (``z = x * w * act(g)``), reduces the head's ``amax`` (``max|z| * inv_rms``,
  ``quant.normed_amax``) beside the norm's sum, then ONE integer max over the heads, and the
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

from k3pallas import fp8 as fp8_lib
from k3pallas import sharding
from k3pallas.kernels import common, launch, quant as quant_lib

_LOG2E = 1.4426950408889634


def act_fn(g, name: str):
    r = common.rsqrt(1.0 + common.exp2(g * -_LOG2E))  # 1 / sqrt(1 + e^-g); see the module doc
    sig = r * r
    return sig if name == "sigmoid" else g * sig


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


def _gated_y(x, g, w, *, width, eps, activation):
    """``rmsnorm(x) * w * act(g)`` of a loaded ``[R, h, D]`` tile pair, in float32 (``w``:
    float32 ``[1, 1, D]``)."""
    x = x.astype(jnp.float32)
    return x * common.row_inv_rms(x, width, eps, keepdims=True) * w * act_fn(
        g.astype(jnp.float32), activation)


def _gated_kernel(x_ref, g_ref, *refs, n_rows, rows, heads, width, eps, activation, quant, mode,
                  amax_beside_norm=False):
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
            inv = common.row_inv_rms(x, width, eps)  # first: needs x alone
            z = x * w * act_fn(g.astype(jnp.float32), activation)
            ys.append((index, mask, z, inv[..., None]))
            amax.append(quant_lib.normed_amax(z, inv))
        quant_lib.epilogue(ys, out_refs, s_ref, n_rows=n_rows, rows=rows, quant=quant,
                           mode=mode, amax=amax)
        return
    ys = [(index, mask, _gated_y(x, g, w, width=width, eps=eps, activation=activation))
          for index, mask, x, g in loaded]
    if quant is None:
        (o_ref,) = out_refs
        for index, mask, y in ys:
            common.store(o_ref, index, y, mask)
        return
    quant_lib.epilogue(ys, out_refs, s_ref, n_rows=n_rows, rows=rows, quant=quant, mode=mode,
                       bits=False)


# The gated FP8 kernel's amax beside the norm for decode batches of up to 32 heads; the other
# form beyond (H200, both forms with flush-to-zero transcendentals, bench/NOTES.md: 32 x 128 at
# T = 256 3.20 vs 3.20 us, at 65536 354 vs 337; 96 x 128 at T = 64 4.22 vs 4.00).
_BESIDE_NORM_MAX_TOKENS = 512
_BESIDE_NORM_MAX_HEADS = 32


def amax_beside_norm(n_rows: int, heads: int) -> bool:
    """Which form of the gated FP8 kernel's amax a launch of ``n_rows`` tokens uses."""
    return n_rows <= _BESIDE_NORM_MAX_TOKENS and heads <= _BESIDE_NORM_MAX_HEADS


def _sigmoid_mul_kernel(x_ref, g_ref, *refs, n_rows, rows, width, quant, mode):
    """``y = x * sigmoid(gate)`` in float32 over power-of-two column pieces (12288 = 8192 +
    4096: no padded lanes), then the row's FP8 (``quant.epilogue``). Padded lanes of a last
    piece load 0 and give ``y = 0``."""
    s_ref, *out_refs = refs if mode == "given_scale" else (None, *refs)
    in_rows = common.row_mask(n_rows, rows, 2)
    r = jnp.arange(rows, dtype=jnp.int32)[:, None]
    loaded = []
    for c0, size in common.pow2_parts(width):
        c = c0 + jnp.arange(size, dtype=jnp.int32)[None, :]
        mask = in_rows if c0 + size <= width else common.both(in_rows, c < width)
        index = (r, c)
        loaded.append((index, mask, common.load(x_ref, index, mask), common.load(g_ref, index, mask)))
    ys = [(index, mask, x.astype(jnp.float32) * act_fn(g.astype(jnp.float32), "sigmoid"))
          for index, mask, x, g in loaded]
    quant_lib.epilogue(ys, out_refs, s_ref, n_rows=n_rows, rows=rows, quant=quant, mode=mode)


def _quant_kernel(x_ref, *refs, n_rows, rows, width, quant, mode):
    s_ref, *out_refs = refs if mode == "given_scale" else (None, *refs)
    index, lanes = common.tile_index(rows, (width,))
    mask = common.both(common.row_mask(n_rows, rows, 2), lanes)
    y = common.load(x_ref, index, mask).astype(jnp.float32)
    quant_lib.epilogue([(index, mask, y)], out_refs, s_ref, n_rows=n_rows, rows=rows, quant=quant,
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


def _fp8_call(kernel_fn, op, row_inputs, shared_inputs, row_elems, *, fp8, interpret, config,
              mode, scale, **static):
    """ONE FP8 launch of ``kernel_fn`` in ``mode`` (see ``rmsnorm_gated_rows``): codes of the
    first row input's shape and a scale per row. ``row_elems``: (elements a row loads, elements
    of its largest tile row), for the launch config of ``op``."""
    n_rows = row_inputs[0].shape[0]
    quant = quant_lib.kernel_quant(fp8, interpret=interpret)
    if config is None:
        config = launch.launch_config(op, n_rows, *row_elems)
    kernel = functools.partial(kernel_fn, n_rows=n_rows, rows=config.rows_per_program,
                               quant=quant, mode=mode, **static)
    outs, poison = quant_lib.outputs(row_inputs[0].shape, n_rows, quant, mode, scale)
    result = common.row_call(
        kernel, name=f"k3pallas_{op}" + ("" if mode == "dynamic" else f"_{mode}"), n_rows=n_rows,
        config=config, row_inputs=list(row_inputs) + ([scale] if mode == "given_scale" else []),
        shared_inputs=list(shared_inputs), out_shapes=outs, interpret=interpret,
        out_poison=poison)
    return quant_lib.results(result, quant, mode)


def rmsnorm_gated_rows(x, gate, weight, *, op: str, eps: float, activation: str,
                       fp8: fp8_lib.Fp8Params | None, interpret: bool,
                       config: launch.LaunchConfig | None = None, mode: str = "dynamic",
                       scale=None, beside_norm: bool | None = None):
    """``x``, ``gate`` ``[T, H, D]``. Without ``fp8``: y ``[T, H, D]`` in x's dtype. With it,
    by ``mode``: "dynamic" ``(codes [T, H, D] fp8, scale [T] float32)``; "scale_only"
    ``(None, scale)``; "given_scale" ``(codes, None)`` quantized with ``scale [T]`` (a scale
    reduced across devices: see ``k3pallas.sharding``). ``beside_norm``: the FP8 form (see the
    module doc; default ``amax_beside_norm(T, H)``); both meet the same tolerances (their
    roundings differ: a code can move by one step)."""
    n_rows, heads, width = x.shape
    static = dict(heads=heads, width=width, eps=float(eps), activation=activation)
    if fp8 is not None:
        if beside_norm is None:
            beside_norm = amax_beside_norm(n_rows, heads)
        return _fp8_call(_gated_kernel, op, [x, gate], [weight], gated_row_elems(heads, width),
                         fp8=fp8, interpret=interpret, config=config, mode=mode, scale=scale,
                         amax_beside_norm=beside_norm, **static)
    if config is None:
        config = launch.launch_config(op, n_rows, *gated_row_elems(heads, width))
    kernel = functools.partial(_gated_kernel, n_rows=n_rows, rows=config.rows_per_program,
                               quant=None, mode=mode, **static)
    (y,) = common.row_call(kernel, name=f"k3pallas_{op}", n_rows=n_rows, config=config,
                           row_inputs=[x, gate], shared_inputs=[weight],
                           out_shapes=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
                           interpret=interpret)
    return y


def per_token_fp8_rows(x, *, op: str, fp8: fp8_lib.Fp8Params, interpret: bool,
                       config: launch.LaunchConfig | None = None, mode: str = "dynamic",
                       scale=None):
    """``x [T, N]`` -> ``(codes [T, N] fp8, scale [T] float32)``; ``mode`` as in
    ``rmsnorm_gated_rows``."""
    width = x.shape[1]
    return _fp8_call(_quant_kernel, op, [x], [], quant_row_elems(width), fp8=fp8,
                     interpret=interpret, config=config, mode=mode, scale=scale, width=width)


def sigmoid_mul_fp8_rows(x, gate, *, op: str, fp8: fp8_lib.Fp8Params, interpret: bool,
                         config: launch.LaunchConfig | None = None, mode: str = "dynamic",
                         scale=None):
    """``x``, ``gate`` ``[T, N]`` -> FP8 of ``x * sigmoid(gate)``: ``(codes [T, N], scale [T])``;
    ``mode`` as in ``rmsnorm_gated_rows``."""
    width = x.shape[1]
    return _fp8_call(_sigmoid_mul_kernel, op, [x, gate], [], sigmoid_mul_row_elems(width),
                     fp8=fp8, interpret=interpret, config=config, mode=mode, scale=scale,
                     width=width)


# ------------------------------------------------------------------------------------------------
# Entries (k3pallas.kernels.entry): one device's arrays, in the layout of the op's sharding rule
# ------------------------------------------------------------------------------------------------


def rmsnorm_gated(x, w, g, *, op, eps, activation, interpret, reduce_axes):
    y = rmsnorm_gated_rows(common.as_rows(x, 2), common.as_rows(g, 2), w, op=op, eps=eps,
                           activation=activation, fp8=None, interpret=interpret)
    return y.reshape(x.shape)


def rmsnorm_gated_fp8_per_token(x, w, g, *, op, eps, activation, fp8, interpret, reduce_axes):
    """x, g ``[..., G, j, D]`` -> (codes of that shape, scale ``[..., G]``). With the heads of a
    group split over devices (``reduce_axes``): the scale of each device's heads, their maximum
    across the devices, then the codes with it (``sharding.fp8_over_shards``)."""
    run = functools.partial(rmsnorm_gated_rows, common.as_rows(x, 2), common.as_rows(g, 2), w,
                            op=op, eps=eps, activation=activation, fp8=fp8, interpret=interpret)
    codes, scale = sharding.fp8_over_shards(run, reduce_axes)
    return codes.reshape(x.shape), scale.reshape(x.shape[:-2])


def per_token_fp8_quant(x, *, op, fp8, interpret, reduce_axes):
    """x ``[..., G, j]`` -> (codes of that shape, scale ``[..., G]``); ``reduce_axes`` as above."""
    run = functools.partial(per_token_fp8_rows, common.as_rows(x, 1), op=op, fp8=fp8,
                            interpret=interpret)
    codes, scale = sharding.fp8_over_shards(run, reduce_axes)
    return codes.reshape(x.shape), scale.reshape(x.shape[:-1])


def sigmoid_mul_fp8_per_token(x, g, *, op, fp8, interpret, reduce_axes):
    """x, g ``[..., G, j]`` -> (codes of that shape, scale ``[..., G]``); ``reduce_axes`` as above."""
    run = functools.partial(sigmoid_mul_fp8_rows, common.as_rows(x, 1), common.as_rows(g, 1),
                            op=op, fp8=fp8, interpret=interpret)
    codes, scale = sharding.fp8_over_shards(run, reduce_axes)
    return codes.reshape(x.shape), scale.reshape(x.shape[:-1])


# The op entries (``k3pallas.kernels.entry``), each named after its op.
ENTRIES = (rmsnorm_gated, rmsnorm_gated_fp8_per_token, per_token_fp8_quant, sigmoid_mul_fp8_per_token)
