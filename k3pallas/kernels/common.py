"""What every row kernel shares: the launcher, masked access to padded tiles, the float32 math.

The Pallas Triton lowering needs every array an operation touches to have a power-of-two size,
so a row of width 1536 is read through a 2048-wide index range with a mask. The masks are always
explicit: jax 0.12 adds bounds masks for partial blocks by itself, jax 0.11 does not (an unmasked
2048-wide access over 1536-wide rows gave wrong results on an H200).

Offsets: the lowering switches to 64-bit offsets for arrays over 4 GiB, so 2**21 rows of 2048
bf16 elements index correctly; see ``check_offsets`` for the one case it misses.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from k3pallas import _compat
from k3pallas._compat import pl, plgpu
from k3pallas.kernels import fp8_cast, hooks
from k3pallas.kernels.launch import LaunchConfig


class Quant(NamedTuple):
    """The quantized output a kernel writes: its format (``k3pallas.formats``, resolved for the
    target) and its float32 -> element conversion: the hardware's (``native``) or the integer
    encoder, as ``fp8_cast`` decided."""

    fmt: object
    native: bool


def quant(fmt, cast: str, *, interpret: bool, target) -> Quant | None:
    """The ``Quant`` a kernel built for ``target`` writes in format ``fmt`` (None: unquantized)
    with the conversion mode ``cast`` (``fp8_cast.decide`` may run the device self-check once)."""
    if fmt is None:
        return None
    return Quant(fmt, fp8_cast.decide(fmt.dtype, cast, interpret=interpret, target=target).native)


def launch_name(op: str, fmt) -> str:
    """The launch-config key and kernel name of ``op`` writing format ``fmt`` (None: unquantized)."""
    return op if fmt is None else f"{op}_{fmt.name}"


def as_rows(a, trailing: int):
    """View ``a [..., *trailing dims]`` as ``[T, *trailing dims]``."""
    lead = a.shape[: a.ndim - trailing]
    return a.reshape((math.prod(lead),) + a.shape[a.ndim - trailing:])


def pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def check_offsets(shape: Sequence[int], dtype) -> None:
    """Refuse arrays whose element offsets the lowering would compute in signed 32 bits wrongly.

    jax picks 32-bit offsets when an array holds at most 2**32 bytes; with 1-byte elements the
    offsets then reach 2**32 - 1, past int32. Arrays of 2-byte and wider elements are always safe.
    """
    nbytes = math.prod(shape) * jnp.dtype(dtype).itemsize
    if jnp.dtype(dtype).itemsize == 1 and 2**31 <= nbytes <= 2**32:
        raise ValueError(
            f"an fp8 output of shape {tuple(shape)} ({nbytes} bytes) falls in the range where the "
            "Pallas Triton lowering computes 32-bit signed offsets that overflow; split the rows "
            "into calls of under 2**31 elements")


def pow2_parts(n: int, max_parts: int = 3) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``(start, size)`` pieces of power-of-two sizes, largest first.

    Up to ``max_parts - 1`` exact pieces from the binary decomposition of ``n``; whatever remains
    forms the last piece, padded to a power of two (``start + size`` may then exceed ``n``: mask
    it). 12 -> (0, 8), (8, 4); 96 -> (0, 64), (64, 32); 5 -> (0, 4), (4, 1). Tiles over the pieces
    waste no lanes where a single padded tile would (12 heads padded to 16 wastes a quarter).
    """
    parts, start = [], 0
    while start < n:
        rest = n - start
        if len(parts) == max_parts - 1:
            parts.append((start, pow2(rest)))
            break
        size = 1 << (rest.bit_length() - 1)
        parts.append((start, size))
        start += size
    return parts


def tile_index(rows: int, widths: Sequence[int]):
    """Index arrays for a ``[rows, *widths]`` tile padded to powers of two, and the lane mask.

    Returns ``(index_tuple, lane_mask)``: each index broadcasts against the others to the padded
    tile shape; ``lane_mask`` (None where no width needed padding) is True on real lanes.
    """
    nd = 1 + len(widths)

    def along(axis, size):
        shape = [1] * nd
        shape[axis] = size
        return jnp.arange(size, dtype=jnp.int32).reshape(shape)

    index = [along(0, rows)]
    lane_mask = None
    for axis, width in enumerate(widths, start=1):
        padded = pow2(width)
        idx = along(axis, padded)
        index.append(idx)
        if padded != width:
            m = idx < width
            lane_mask = m if lane_mask is None else lane_mask & m
    return tuple(index), lane_mask


def lane_index(width: int):
    """1-D index over ``width`` padded to a power of two, and its mask (None if not padded)."""
    padded = pow2(width)
    idx = jnp.arange(padded, dtype=jnp.int32)
    return idx, (idx < width if padded != width else None)


def row_mask(n_rows: int, rows: int, nd: int, pid=None):
    """True for this program's rows that exist, shaped ``[rows, 1, ...]`` with ``nd`` dims.
    ``pid``: ``pl.program_id(0)``, read outside a ``pl.when`` branch (interpret mode cannot
    read it inside one)."""
    r = (pl.program_id(0) if pid is None else pid) * rows + jnp.arange(rows, dtype=jnp.int32)
    return r.reshape((rows,) + (1,) * (nd - 1)) < n_rows


# Flush-to-zero transcendentals (``ftz``, decided by the kernel builder: ``flush_to_zero``): XLA
# compiles exp2 / rsqrt without flush-to-zero, each with a range check and two predicated
# multiplies (a quarter of the gated FP8 kernel's instructions, docs/performance.md); the .ftz
# forms have the same accuracy and differ only for subnormal inputs or results. PTX: CUDA only.


def flush_to_zero(target, interpret: bool) -> bool:
    """Whether kernels built for ``target`` use the flush-to-zero forms: compiled for CUDA."""
    return not interpret and target.backend == "cuda"


def _ptx_unary(x, op):
    (out,) = plgpu.elementwise_inline_asm(
        f"{op} $0, $1;", args=[x], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return out


def exp2(x, ftz: bool):
    """``2 ** x`` of a float32 tile."""
    return _ptx_unary(x, "ex2.approx.ftz.f32") if ftz else jnp.exp2(x)


def rsqrt(x, ftz: bool):
    """``1 / sqrt(x)`` of a float32 tile."""
    return _ptx_unary(x, "rsqrt.approx.ftz.f32") if ftz else jax.lax.rsqrt(x)


def inv_rms(ms, eps, ftz: bool):
    """``rsqrt(ms + eps)`` for a row's float32 mean square ``ms``, NaN where ``ms`` is not finite.

    ``ms`` overflows to inf once the row's sum of squares passes the float32 range (some ``|x|``
    of about 1.8e19 and up, or an inf): ``rsqrt`` would then give 0 and the row a silent zero.
    A NaN row says that it is out of range instead. One compare and select per row.
    """
    return jnp.where(ms < jnp.inf, rsqrt(ms + eps, ftz), jnp.nan)


def row_inv_rms(x, width: int, eps, ftz: bool, keepdims: bool = False):
    """``inv_rms`` of a float32 tile's rows over its last axis of ``width`` real lanes (padded
    lanes hold 0): ``inv_rms(sum(x**2) / width, eps)``."""
    return inv_rms(jnp.sum(x * x, axis=-1, keepdims=keepdims) / width, eps, ftz)


_LOG2E = 1.4426950408889634


def act_fn(g, name: str, ftz: bool):
    """``sigmoid(g)`` or ``silu(g)`` of a float32 tile: the sigmoid as ``rsqrt(1 + exp2(-g log2
    e))**2``, one hardware approximation instead of an IEEE division, within a few float32 ulp of
    ``1 / (1 + e)`` (exactly 1 and 0 at the ends)."""
    r = rsqrt(1.0 + exp2(g * -_LOG2E, ftz), ftz)
    sig = r * r
    return sig if name == "sigmoid" else g * sig


INF_BITS = 0x7F800000  # float32 +inf as int32; NaN patterns of |y| are above it


def abs_bits(y):
    """``|y|`` of a float32 tile as int32 bit patterns. Non-negative floats order as their bits
    do, and every NaN pattern sorts above inf's, so ONE integer max gives the maximum of ``|y|``
    and tells whether a NaN (``> INF_BITS``) or an infinity (``== INF_BITS``) is among the
    values: no second reduction for NaN (Triton's float max drops NaN, as does XLA's CPU one
    over long rows). Padded lanes hold 0."""
    return jax.lax.bitcast_convert_type(y, jnp.int32) & 0x7FFFFFFF


def both(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a & b


def load(ref, index, mask, other=0):
    if mask is None:
        return plgpu.load(ref.at[index])
    return plgpu.load(ref.at[index], mask=mask, other=other)


def store(ref, index, value, mask):
    plgpu.store(ref.at[index], value.astype(ref.dtype), mask=mask)


def codes_beside(index, dtype):
    """``index`` for 1-byte codes stored from the same tile as a ``dtype`` store (the residual
    add's new residual): its last array as ``div(i, n) * n + rem(i, n)``, the same values, in
    which Triton's alignment analysis sees runs of ``n = 16 / itemsize`` contiguous elements. A
    store takes the widest vector the data allows (16 bytes: 16 codes, 8 bf16 values a thread);
    unequal, one of the two stores converts the tile's layout through shared memory. With the
    runs both take n a thread (docs/residual.md, Decode)."""
    n = max(1, 16 // jnp.dtype(dtype).itemsize)
    i = index[-1]
    return (*index[:-1], jax.lax.div(i, n) * n + jax.lax.rem(i, n))


def residual_add(x, r, index, mask, res_out):
    """``x + r`` of two loaded tiles in float32, rounded once to x's dtype (the residual stream's),
    stored to ``res_out`` at ``index``; returns it (the norm's input: the variance is that of the
    stored sum, as vLLM's ``fused_add_rms_norm`` computes it)."""
    s = (x.astype(jnp.float32) + r.astype(jnp.float32)).astype(x.dtype)
    store(res_out, index, s, mask)
    return s


@dataclasses.dataclass
class RowCall:
    """One launch as ``row_call`` is about to make it; a ``wrapping`` hook may change it."""

    kernel: object  # the kernel body: refs in the order inputs, outputs
    inputs: list
    in_specs: list
    out_shapes: list
    row_spec: object  # shape -> the BlockSpec of an array with rows as its first axis
    out_poison: list  # per output: a value that marks an unwritten element (NaN; a NaN fp8 code)
    aliases: dict = dataclasses.field(default_factory=dict)  # input index -> output index


def row_call(kernel, *, name: str, n_rows: int, config: LaunchConfig, row_inputs, shared_inputs,
             out_shapes, interpret: bool, out_poison=None, programs_per_block=1, aliases=None):
    """Launch ``kernel`` once over row blocks: ONE pallas_call, grid ``cdiv(n_rows, R)`` (by
    ``programs_per_block`` when several programs share a row block: ``pl.program_id(1)`` tells
    them apart; it must equal ``config.split``).

    ``row_inputs`` and the arrays of ``out_shapes`` have rows as their first axis and are split
    into ``R``-row blocks; ``shared_inputs`` (weights) are whole in every program. The kernel
    receives refs in the order row inputs, shared inputs, outputs. ``out_poison``: per output, the
    value that marks an element left unwritten (default NaN; see ``RowCall``). ``aliases``:
    {row input index: output index}, an output written over that input's buffer (the residual).
    """
    rows = config.rows_per_program
    if config.split != programs_per_block:  # a forced or passed-in config this kernel cannot run
        raise ValueError(f"{name}: launch config {config} puts a row block on {config.split} "
                         f"programs, which this kernel cannot do for this row shape (it "
                         f"launches {programs_per_block})")

    def row_spec(shape):
        nrest = len(shape) - 1
        return pl.BlockSpec((rows, *shape[1:]), lambda i, *_, _n=nrest: (i,) + (0,) * _n)

    for out in out_shapes:
        check_offsets(out.shape, out.dtype)
    row_inputs, shared_inputs, manual = _compat.match_varying(row_inputs, shared_inputs)
    if manual is not None:  # inside shard_map
        out_shapes = [jax.ShapeDtypeStruct(o.shape, o.dtype, manual_axis_type=manual)
                      for o in out_shapes]
    call = RowCall(kernel, list(row_inputs) + list(shared_inputs),
                   [row_spec(a.shape) for a in row_inputs] + [whole_spec(a.shape) for a in shared_inputs],
                   list(out_shapes), row_spec, list(out_poison or [float("nan")] * len(out_shapes)),
                   dict(aliases or {}))
    grid = (pl.cdiv(n_rows, rows),) + ((programs_per_block,) if programs_per_block > 1 else ())
    return launch_call(call, grid=grid, num_warps=config.num_warps, num_stages=config.num_stages,
                       interpret=interpret, name=name)


def whole_spec(shape):
    """The BlockSpec of an array every program sees whole (weights; the GEMM's operands)."""
    return pl.BlockSpec(tuple(shape), lambda *_, _n=len(shape): (0,) * _n)


def launch_call(call: RowCall, *, grid, num_warps: int, num_stages: int, interpret: bool,
                name: str):
    """ONE ``pallas_call`` of ``call`` (after the tooling's ``wrapping`` hook, if any), its
    outputs blocked by ``call.row_spec``; returns the outputs."""
    wrapper = hooks.wrapper()
    if wrapper is not None:
        call = wrapper(call)
    return pl.pallas_call(
        call.kernel,
        grid=grid,
        in_specs=call.in_specs,
        out_specs=[call.row_spec(o.shape) for o in call.out_shapes],
        out_shape=call.out_shapes,
        input_output_aliases=call.aliases,
        compiler_params=_compat.triton_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=name,
    )(*call.inputs)


__all__ = ["pow2", "pow2_parts", "tile_index", "lane_index", "row_mask", "flush_to_zero", "exp2",
           "rsqrt", "inv_rms", "row_inv_rms", "act_fn", "abs_bits", "INF_BITS", "both", "load",
           "store", "row_call", "launch_call", "whole_spec", "check_offsets", "as_rows", "RowCall", "Quant", "quant", "launch_name",
           "residual_add"]
