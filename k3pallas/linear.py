"""The consumer of the quantized activations: weight quantization and one linear for every format.

Per-token and group FP8: the scaled FP8 GEMM in Pallas (``kernels.gemm``, one launch, the scales
applied inside) on a GPU, or an XLA lowering by name. Per-token through XLA
(``impl="dot_general"``): ``jax.lax.dot_general`` on the fp8 operands with
``preferred_element_type=float32``, which XLA's GPU compiler rewrites into a vendor FP8 GEMM
(``__cublas$lt$matmul$f8``: cuBLASLt on NVIDIA sm_89+, hipBLASLt on AMD MI300 and later; see
docs/formats.md for when it does and what it does otherwise); those GEMMs take only scalar
scales, so the per-token and per-channel scales multiply the float32 result afterwards. MX:
``jax.nn.scaled_matmul`` on a GPU (on gfx950 XLA's Triton ``scaled-dot`` on the MX matrix cores).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from k3pallas import _compat, formats, ops, platform, sharding
from k3pallas._checks import FLOAT_DTYPES
from k3pallas.formats import QuantizedActivation, QuantizedWeight

__all__ = ["quantize_weight", "weight_from_checkpoint", "linear", "GROUP_IMPLS",
           "PER_TOKEN_IMPLS", "PALLAS_IMPLS"]

# The lowerings of a group-FP8 linear through XLA (``linear(impl=...)``). "auto" takes
# "per_group" up to this many rows, "dequantize" beyond: on the H200 per_group was the faster at
# T = 1 ... 64 and dequantize at T = 512 and 4096, at the Kimi-K3 o_proj and a DeepSeek-V3 MLP
# shape (docs/formats.md; between 64 and 512 not measured). per_group's float32 [K/128, T, N]
# partial result grows with T; dequantize's bf16 weight does not.
GROUP_IMPLS = ("dequantize", "per_group", "scaled_dot")
PER_GROUP_MAX_ROWS = 64
# The per-token FP8 linear through XLA's vendor FP8 GEMM.
PER_TOKEN_IMPLS = ("dot_general",)
# The scaled FP8 GEMM in Pallas (per-token and group FP8): compiled, or in interpret mode.
PALLAS_IMPLS = ("pallas", "interpret")
# "auto" on a GPU takes the Pallas GEMM up to these many rows (None: any) and the XLA lowerings
# beyond: the crossovers measured on an H100 (docs/formats.md, Consumers). Group FP8: the kernel
# beat every XLA lowering at T = 7 ... 4096 on the three model shapes (1.1-9x; at T = 1 within
# 2 %). Per-token FP8: the kernel up to 16 rows (1.09-2.07x faster than cuBLASLt's FP8 GEMM
# there) and, at K <= 2048, up to 128 (1.13-1.65x at 24-128 rows); cuBLASLt from 24 rows at
# K = 7168 and at 512 at K <= 2048 (between 128 and 512 not measured).
PALLAS_PER_TOKEN_MAX_ROWS = 16
PALLAS_PER_TOKEN_SHORT_K = (2048, 128)  # (K at most, rows at most)
PALLAS_GROUP_MAX_ROWS = None


def quantize_weight(w, out_format, *, layout="nk") -> QuantizedWeight:
    """Quantize a weight ``w [K, N]`` (``x @ w``) for ``linear`` with activations of
    ``out_format``.

    * per-token FP8 (``"fp8_per_token"`` / ``Fp8PerToken(dtype=, fp8_max=)``): symmetric per
      output channel, ``scale[n] = max_k |w[k, n]| / fp8_max``, ``data = RNE(w / scale)``; a
      column of zeros gets ``scale = 1`` (zero codes), a column holding NaN a NaN scale, one
      holding inf ``scale = inf`` (its finite entries' codes 0, the infinite ones NaN): such a
      weight has no FP8 form. dtype by device (``default_fp8_dtype``) unless given; ``fp8_max``
      the format's per-token default. ``min_scale``, ``scale_ub`` and ``groups`` are refused.
    * MX (``"mxfp8"`` / ``"mxfp4"``): jax's MX rule per output channel and block of 32 along K
      (K a multiple of 32), the activations' rule.
    * group FP8 (``"fp8_group128"``, ``"fp8_group128_ue8m0"``): the activations' rule per block
      of 128 x 128 (K a multiple of 128; a partial last block of N), scales
      ``[ceil(N/128), K/128]`` as the DeepSeek-V3 / Kimi-K2 / Qwen3 FP8 checkpoints store them
      (``weight_from_checkpoint`` takes those as stored).

    ``layout``: how data and scale are stored: ``"nk"`` (default, data ``[N, K]``: what the FP8
    GEMMs and ``jax.nn.scaled_matmul`` read without a transpose; with ``"kn"`` XLA transposes
    the weight in every call, twice the time on an H200) or ``"kn"`` (``[K, N]`` like ``w``).

    Returns: a ``QuantizedWeight``. Inference-only: a gradient raises TypeError.
    """
    op = "quantize_weight"
    if not hasattr(w, "shape") or not hasattr(w, "dtype"):
        raise TypeError(f"{op}: w must be an array, got {type(w).__name__}")
    if w.ndim != 2 or 0 in w.shape:
        raise ValueError(f"{op}: w must be a non-empty [K, N] matrix, got shape {tuple(w.shape)}")
    if jnp.dtype(w.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{op}: w must be float16, bfloat16 or float32, got {w.dtype}")
    if layout not in formats.LAYOUTS:
        raise ValueError(f"{op}: layout must be 'nk' or 'kn', got {layout!r}")
    try:
        asked = formats.as_format(out_format)
        if isinstance(asked, formats.Fp8PerToken):  # an activation's format (qa.format, with
            asked = asked.for_weight()  # min_scale filled in): its activation-only fields go
        fmt = asked.resolve(platform.current_target(w))
        if fmt.block is not None:
            fmt.check_width(w.shape[0], "K (the first dim of w)")
    except (TypeError, ValueError) as e:
        raise type(e)(f"{op}: {e}") from None
    data, scale = ops.inference_only(op, functools.partial(_quantize_weight, fmt=fmt), w)
    if layout == "kn":
        data, scale = data.T, (scale if scale.ndim < 2 else scale.T)
    return QuantizedWeight._unchecked(data, scale, fmt, layout)


# One compiled program per (shape, format): weights are prepared outside jit, where the jnp ops
# one by one would each be a dispatch (and on first use a compile) of their own.
@functools.partial(jax.jit, static_argnames="fmt")
def _quantize_weight(w, fmt):
    wf = w.astype(jnp.float32)
    if fmt.block is None:
        amax = jnp.max(jnp.abs(wf), axis=0)
        scale = jnp.where(amax > 0, amax / fmt.fp8_max, 1.0)
        scale = jnp.where(jnp.any(jnp.isnan(wf), axis=0), jnp.nan, scale)
        codes = jnp.clip(wf / scale, -fmt.fp8_max, fmt.fp8_max).astype(fmt.dtype)
        return codes.T, scale.astype(jnp.float32)  # [N, K], [N]
    return fmt.quantize_weight(wf.T)  # [N, K] and the format's weight scales


def weight_from_checkpoint(weight, weight_scale_inv, *, out_format="fp8_group128"):
    """A block-FP8 checkpoint's weight as stored (DeepSeek-V3 / R1 / V3.1, Kimi-K2, Qwen3 FP8:
    ``weight [N, K]`` float8_e4m3fn, ``weight_scale_inv [ceil(N/128), K/128]`` float32, the
    weight being ``weight * weight_scale_inv`` per 128 x 128 block) as a ``QuantizedWeight``
    (layout "nk") for ``linear`` with activations of ``out_format`` (a group format; UE8M0
    checkpoints store power-of-two scales, which either group format reads).

    Where the activations' FP8 type is e4m3fnuz (AMD gfx94x: MI300X, MI325X), the e4m3fn
    weight becomes e4m3fnuz as vLLM converts it: the same bits, code 0x80 (e4m3fn's -0,
    e4m3fnuz's NaN) set to 0, the scales doubled (an e4m3fnuz code is worth half the e4m3fn code
    of the same bits). The scale values are not checked: a NaN, infinite, zero or negative entry
    reaches every product of its block. Raises TypeError / ValueError for anything else, naming
    the argument.
    """
    op = "weight_from_checkpoint"
    for name, a in (("weight", weight), ("weight_scale_inv", weight_scale_inv)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"{op}: {name} must be an array, got {type(a).__name__}")
    try:
        asked = formats.as_format(out_format)
        if not isinstance(asked, formats.Fp8Group):
            raise ValueError(f"out_format must be a group format (fp8_group128, "
                             f"fp8_group128_ue8m0), got {asked.name}")
        fmt = asked.resolve(platform.current_target(weight))
        stored = jnp.dtype(weight.dtype)
        if weight.ndim != 2:
            raise ValueError(f"weight must be [N, K], got shape {tuple(weight.shape)}")
        if stored == jnp.dtype(jnp.float8_e4m3fn) and fmt.dtype == jnp.dtype(jnp.float8_e4m3fnuz):
            bits = lax.bitcast_convert_type(weight, jnp.uint8)
            weight = lax.bitcast_convert_type(jnp.where(bits == 0x80, 0, bits).astype(jnp.uint8),
                                              jnp.float8_e4m3fnuz)
            weight_scale_inv = weight_scale_inv * 2.0
        elif stored != fmt.dtype:
            raise TypeError(f"weight is {stored.name}; the activations here are "
                            f"{fmt.dtype.name} (only e4m3fn -> e4m3fnuz is converted)")
        return QuantizedWeight(weight, weight_scale_inv, fmt, "nk")
    except (TypeError, ValueError) as e:
        raise type(e)(f"{op}: {e}") from None


def _same_family(op, qa, qw):
    a, b = qa.format, qw.format
    if type(a) is not type(b) or (isinstance(a, formats.Mx) and a.name != b.name):
        raise TypeError(f"{op}: the activation is {a.name} and the weight {b.name}; quantize the "
                        "weight with the activation's format (quantize_weight)")
    if jnp.dtype(a.dtype) != jnp.dtype(b.dtype):
        raise TypeError(f"{op}: the activation's elements are {jnp.dtype(a.dtype).name} and the "
                        f"weight's {jnp.dtype(b.dtype).name}: they must be the same")


def linear(qa: QuantizedActivation, qw: QuantizedWeight, *, out_dtype=jnp.bfloat16,
           precision=None, impl="auto"):
    """``dequant(qa) @ dequant(qw)``, float32 accumulation, one rounding to ``out_dtype``.

    Args:
      qa: a ``QuantizedActivation`` ``[..., K]`` of any format (from an op or built by hand).
      qw: the ``QuantizedWeight`` of ``quantize_weight`` for the same format (the same element
        dtype; its layout travels with it), standing for ``w [K, N]``.
      out_dtype: float16, bfloat16 (default) or float32.
      precision: for the XLA lowerings of per-token and group FP8 (passed to ``dot_general``,
        which XLA maps onto the FP8 GEMM's accumulation mode); None for the Pallas GEMM (it
        accumulates in float32) and MX (ValueError otherwise); ``impl="reference"`` computes
        at ``Precision.HIGHEST`` whatever is given.
      impl: "auto": on a GPU the Pallas GEMM up to ``PALLAS_PER_TOKEN_MAX_ROWS`` (16; 128 at
        K <= 2048, ``PALLAS_PER_TOKEN_SHORT_K``) / ``PALLAS_GROUP_MAX_ROWS`` (any) rows, else,
        and without a GPU, the
        XLA lowerings ("dot_general"; group FP8 "per_group" up to ``PER_GROUP_MAX_ROWS`` rows,
        else "dequantize"); MX ``jax.nn.scaled_matmul`` on a GPU, the reference elsewhere (it
        has no CPU lowering). "pallas" (a GPU target, RuntimeError otherwise) / "interpret": the Pallas
        GEMM (per-token and group FP8); "reference": the dequantized operands' float32 dot
        (``Precision.HIGHEST``); the XLA lowerings by name: per-token "dot_general"
        (``PER_TOKEN_IMPLS``), group "dequantize", "per_group", "scaled_dot" (``GROUP_IMPLS``,
        see ``_fp8_group``).

    Returns: ``[..., N]`` in ``out_dtype``. Per-token FP8 with ``G`` scale groups:
    ``sum_g (data_g @ w_g)_f32 * scale[..., g] * w_scale``. Group FP8 (activation and weight of
    the group formats, either rounding of the scales): ``sum_g (data_g @ w_g) * scale[..., g] *
    w_scale[n // 128, g]`` over the K groups of 128. A NaN scale or code poisons its own rows
    (and a weight's, its own columns), nothing else.
    """
    op = "linear"
    if not isinstance(qa, QuantizedActivation):
        raise TypeError(f"{op}: qa must be a QuantizedActivation, got {type(qa).__name__}")
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"{op}: qw must be a QuantizedWeight (quantize_weight), got "
                        f"{type(qw).__name__}")
    _same_family(op, qa, qw)
    k, n = qw.shape
    data, scale = qa.data, qa.scale
    if data.shape[-1] != k:
        raise ValueError(f"{op}: qa.data [..., K] and the weight [K, N] = {list(qw.shape)} need the "
                         f"same K; got data {tuple(data.shape)}")
    try:
        out_dtype = jnp.dtype(out_dtype)
    except TypeError:
        pass
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: out_dtype must be float16, bfloat16 or float32, got {out_dtype!r}")
    _check_precision(op, precision)
    fmt = qa.format
    group = isinstance(fmt, formats.Fp8Group)
    mx = isinstance(fmt, formats.Mx)
    impls = ("auto", "reference") + (("scaled_matmul",) if mx else PALLAS_IMPLS
                                     + (GROUP_IMPLS if group else PER_TOKEN_IMPLS))
    if impl not in impls:
        raise ValueError(f"{op}: impl must be one of {impls} for {fmt.name}, got {impl!r}")
    if precision is not None and (mx or impl in PALLAS_IMPLS):
        raise ValueError(f"{op}: precision applies to the XLA lowerings of the FP8 formats "
                         f"(dot_general); impl={impl!r} with {fmt.name} takes none")
    lead = data.shape[:-1]
    rows = math.prod(lead)
    target = platform.current_target(data)
    if impl == "auto":
        impl = _auto(fmt, rows, k, target, precision)
    if impl in PALLAS_IMPLS:  # the ops' rule: "pallas" without a GPU is a RuntimeError
        interpret = ops.resolve_impl(impl, op, target) == "interpret"
        return _pallas(qa, qw, out_dtype, interpret, target)
    if impl == "reference":
        a = qa.dequantize().reshape(-1, k)
        out = jnp.dot(a, qw.dequantize(), precision=lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)
    elif group:
        out = _fp8_group(data.reshape(-1, k), scale.reshape(-1, k // fmt.block), qw, impl,
                         precision)
    elif not mx:
        out = _fp8_per_token(data, scale, qw, k, n, precision)
    else:
        w_data, w_scale = (qw.data, qw.scale) if qw.layout == "nk" else (qw.data.T, qw.scale.T)
        blocks = k // fmt.block
        out = jax.nn.scaled_matmul(data.reshape(1, -1, k), w_data[None],
                                   scale.reshape(1, -1, blocks), w_scale[None],
                                   preferred_element_type=jnp.float32)
    return out.reshape(lead + (n,)).astype(out_dtype)


_PRECISIONS = (None, "default", "high", "highest", "fastest", "bfloat16", "tensorfloat32",
               "float32")


def _check_precision(op, precision):
    """None, a ``lax.Precision`` (or its name), a pair of them, or a ``lax.DotAlgorithmPreset``:
    what ``dot_general`` takes; ValueError naming the op and the argument otherwise."""
    ok = (lambda p: p is None or isinstance(p, lax.Precision)  # noqa: E731
          or (isinstance(p, str) and p.lower() in _PRECISIONS[1:]))
    if ok(precision) or isinstance(precision, lax.DotAlgorithmPreset) or (
            isinstance(precision, tuple) and len(precision) == 2 and all(map(ok, precision))):
        return
    raise ValueError(f"{op}: precision must be None, a jax.lax.Precision (or its name: "
                     f"'default', 'high', 'highest'), a pair of them or a "
                     f"jax.lax.DotAlgorithmPreset; got {precision!r}")


def _auto(fmt, rows: int, k: int, target, precision) -> str:
    """The implementation "auto" runs (``linear``'s docstring)."""
    if isinstance(fmt, formats.Mx):
        return "scaled_matmul" if target.is_gpu else "reference"
    group = isinstance(fmt, formats.Fp8Group)
    most = PALLAS_GROUP_MAX_ROWS if group else PALLAS_PER_TOKEN_MAX_ROWS
    if not group and most is not None and k <= PALLAS_PER_TOKEN_SHORT_K[0]:
        most = max(most, PALLAS_PER_TOKEN_SHORT_K[1])
    if target.is_gpu and precision is None and (most is None or rows <= most):
        return "pallas"
    if group:
        return "per_group" if rows <= PER_GROUP_MAX_ROWS else "dequantize"
    return "dot_general"


def _pallas(qa, qw, out_dtype, interpret: bool, target):
    """The Pallas GEMM (``kernels.gemm``) on ``qa`` and ``qw`` as stored: one launch per device,
    partitioned by ``sharding.linear_partitioned`` (tokens and the weight's columns; K refused)."""
    from k3pallas.kernels import hooks

    fmt = qa.format
    k, n = qw.shape
    lead = qa.data.shape[:-1]
    if math.prod(lead) == 0:
        return jnp.zeros(lead + (n,), out_dtype)
    kn = qw.layout == "kn"
    for a, axis in ((qa.data, -1), (qw.data, 0 if kn else 1)):  # eager calls: sharding known
        spec = _compat.known_spec(a)
        if spec is not None and spec[axis] is not None:
            raise sharding.k_split_error(spec[axis])
    w_scale = qw.scale
    if isinstance(fmt, formats.Fp8Group):
        kind = "block"
    elif w_scale.ndim == 0:
        kind, w_scale = "tensor", w_scale.reshape(1)
    else:
        kind = "channel"
    run = sharding.linear_partitioned(
        _local_gemm, kn=kn, w_kind=kind, n=n, cache_key=hooks.trace_key(), out_dtype=out_dtype,
        key=f"linear_{fmt.name}", interpret=interpret, target=target)
    return ops.inference_only("linear", run, qa.data, qa.scale, qw.data, w_scale)


def _local_gemm(a, a_scale, w, w_scale, *, out_dtype, key, interpret, target, w_kind, kn):
    """The GEMM on one device's operands: ``a [..., K]`` as ``[M, K]``, one launch, its config
    for these (local) shapes."""
    from k3pallas.kernels import gemm, launch

    lead, k = a.shape[:-1], a.shape[-1]
    m = math.prod(lead)
    n = w.shape[1] if kn else w.shape[0]
    cfg = launch.gemm_config(key, m, n, k, target=target,
                             w_block=gemm.W_BLOCK if w_kind == "block" else None)
    out = gemm.scaled_matmul(a.reshape(m, k), a_scale.reshape(m, a_scale.shape[-1]), w, w_scale,
                             out_dtype=out_dtype, kn=kn, w_scale_kind=w_kind, cfg=cfg,
                             name=f"k3pallas_{key}", interpret=interpret)
    return out.reshape(lead + (n,))


def _fp8_per_token(data, scale, qw, k, n, precision):
    k_axis = 0 if qw.layout == "kn" else 1
    w, w_scale = qw.data, qw.scale
    groups = scale.shape[-1]
    if groups == 1:
        acc = lax.dot_general(data, w, (((data.ndim - 1,), (k_axis,)), ((), ())),
                              precision=precision, preferred_element_type=jnp.float32)
        acc = acc * scale
    else:
        part = _group_dots(data, qw, groups, precision)  # [G, T, N]
        s = scale.reshape(-1, groups).T[:, :, None]  # [G, T, 1]
        acc = jnp.sum(part * s, axis=0).reshape(data.shape[:-1] + (n,))
    return acc * w_scale


def _group_dots(data, qw, groups, precision):
    """float32 ``[G, T, N]``: each of ``groups`` contiguous K groups of the fp8 ``data [..., K]``
    times the weight's rows of that group, one batched ``dot_general`` (either layout, no
    transpose)."""
    k, n = qw.shape
    kg = k // groups
    a3 = data.reshape(-1, groups, kg)  # [T, G, K/G]
    if qw.layout == "kn":
        w3, dims = qw.data.reshape(groups, kg, n), (((2,), (1,)), ((1,), (0,)))  # [G, K/G, N]
    else:
        w3, dims = qw.data.reshape(n, groups, kg), (((2,), (2,)), ((1,), (1,)))  # [N, G, K/G]
    return lax.dot_general(a3, w3, dims, precision=precision, preferred_element_type=jnp.float32)


def _fp8_group(data, scale, qw, impl, precision):
    """``[T, K]`` group-FP8 activations times a 128 x 128 block-FP8 weight, float32 ``[T, N]``,
    by one of the XLA lowerings (``GROUP_IMPLS``; what XLA emits for each, and their times:
    docs/formats.md):

    * "dequantize": both operands dequantized to bfloat16 (codes times float32 scales, one
      rounding), one bfloat16 GEMM with float32 accumulation;
    * "per_group": one FP8 GEMM per K group of 128 (a batched ``dot_general`` on the fp8 codes,
      float32 results ``[K/128, T, N]``), scaled per (token, group) and (output block, group),
      summed: exact products, float32 sums; memory ``K/128`` times the output's;
    * "scaled_dot": ``jax.lax.scaled_dot`` (XLA's block-scaled dot composite; its fallback
      rounds the scales to bfloat16).
    """
    fmt = qw.format
    if impl == "dequantize":  # [K, N] bfloat16, whatever the stored layout
        return lax.dot_general(fmt.dequantize(data, scale, jnp.bfloat16),
                               qw.dequantize(jnp.bfloat16), (((1,), (0,)), ((), ())),
                               precision=precision, preferred_element_type=jnp.float32)
    w, w_scale = (qw.data, qw.scale) if qw.layout == "nk" else (qw.data.T, qw.scale.T)
    n = w.shape[0]
    w_scale_n = jnp.repeat(w_scale, fmt.block, axis=0)[:n]  # [N, G]: each channel's block scales
    if impl == "per_group":
        part = _group_dots(data, qw, scale.shape[-1], precision)  # [G, T, N]
        return jnp.sum(part * scale.T[:, :, None] * w_scale_n.T[:, None, :], axis=0)
    return lax.scaled_dot(data, w, lhs_scale=scale, rhs_scale=w_scale_n,
                          dimension_numbers=(((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32)
