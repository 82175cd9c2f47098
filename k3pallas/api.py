"""The public functions: check the arguments, pick the implementation, shape rows, and dispatch.

No kernel code lives here, and nothing generic: each function checks its arguments, brings them
to the layout of its op's sharding rule, and calls ``k3pallas.ops.call``. Every function:

* takes arrays positionally and options as keywords; options are static (Python values), so the
  functions work inside ``jax.jit`` and ``jax.vmap``;
* accepts any leading shape (flattened to rows) and returns empty outputs for zero rows without
  launching anything;
* is inference-only: taking a gradient raises ``TypeError`` saying so;
* runs sharded: its kernel path goes through ``k3pallas.sharding.partitioned`` with the op's
  rule (``k3pallas.ops``, the op table), so XLA splits it over devices instead of gathering;
* chooses an implementation with ``impl``: ``"auto"`` (the Pallas kernel when the target is a GPU,
  cuda or rocm, else the jnp reference), ``"pallas"`` (the compiled kernel; RuntimeError on a
  backend without one, never a silent fallback), ``"interpret"`` (the same kernel in Pallas
  interpret mode, on any backend) or ``"reference"`` (pure jnp, compiled by XLA).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from k3pallas import fp8 as fp8_lib, mx as mx_lib, platform
from k3pallas._checks import FLOAT_DTYPES, static_positive_float
from k3pallas.fp8 import QuantizedActivation
from k3pallas import ops as table
from k3pallas.ops import IMPLS, call

__all__ = ["rmsnorm", "fused_q_kv_rmsnorm", "mla_q_kv_norm", "rmsnorm_gated", "rmsnorm_gated_fp8_per_token",
           "per_token_fp8_quant", "sigmoid_mul_fp8_per_token", "fused_q_kv_rmsnorm_fp8",
           "mla_q_kv_norm_fp8", "quantize_activation", "rmsnorm_gated_quant", "sigmoid_mul_quant",
           "fused_q_kv_rmsnorm_quant", "mla_q_kv_norm_quant", "IMPLS", "ACTIVATIONS", "OUT_FORMATS"]

ACTIVATIONS = ("sigmoid", "silu")
OUT_FORMATS = mx_lib.OUT_FORMATS
SUPPORTED_DTYPES = FLOAT_DTYPES


# ------------------------------------------------------------------------------------------------
# Argument checks (each error names the argument and what it got)
# ------------------------------------------------------------------------------------------------


def _check_array(op, name, a, *, min_rank=1, dtypes=SUPPORTED_DTYPES):
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{op}: {name} must be an array, got {type(a).__name__}")
    if a.ndim < min_rank:
        raise ValueError(f"{op}: {name} must have rank >= {min_rank}, got shape {tuple(a.shape)}")
    if jnp.dtype(a.dtype) not in dtypes:
        names = ", ".join(d.name for d in dtypes)
        raise TypeError(f"{op}: {name} must have a floating dtype among {names}; got {a.dtype}")
    if any(d == 0 for d in a.shape[a.ndim - min_rank:]):
        raise ValueError(f"{op}: {name} must have non-empty trailing dims (the normalized or "
                         f"quantized ones), got shape {tuple(a.shape)}")


def _check_weight(op, name, w, length, of):
    _check_array(op, name, w, min_rank=1)
    if w.ndim != 1 or w.shape[0] != length:
        raise ValueError(f"{op}: {name} must have shape ({length},) to match the last dim of {of}; "
                         f"got {tuple(w.shape)}")


def _check_eps(op, name, eps) -> float:
    try:
        return static_positive_float(name, eps)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{op}: {e}") from None


def _check_activation(op, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")


def _fp8_params(op, arrays, fp8_dtype, fp8_max, min_scale, scale_ub, fp8_cast):
    try:
        return fp8_lib.resolve_fp8_params(fp8_dtype, fp8_max, min_scale, scale_ub,
                                          fp8_cast=fp8_cast,
                                          target=platform.current_target(*arrays))
    except (TypeError, ValueError) as e:
        raise type(e)(f"{op}: {e}") from None


# ------------------------------------------------------------------------------------------------
# Joint q/kv RMSNorm and RMSNorm
# ------------------------------------------------------------------------------------------------


def rmsnorm(x, weight, eps=1e-6, *, impl="auto"):
    """RMSNorm over the last axis: ``x * rsqrt(mean(x**2, -1) + eps) * weight``.

    Args:
      x: ``[..., D]`` float16, bfloat16 or float32; any leading shape.
      weight: ``[D]``, any of those dtypes.
      eps: positive finite Python float (default 1e-6, DeepSeek-V3 / Kimi-K2 MLA).
      impl: "auto", "pallas", "interpret" or "reference" (see ``k3pallas.api``).

    Returns: ``[..., D]`` in ``x.dtype``; math in float32, one cast at the end.

    Equivalent jnp: ``(xf * jax.lax.rsqrt(jnp.mean(xf**2, -1, keepdims=True) + eps)
    * weight.astype(f32)).astype(x.dtype)`` with ``xf = x.astype(f32)``.

    Raises: TypeError (non-array, unsupported dtype, traced eps, gradient), ValueError (shapes,
    eps, impl), RuntimeError (impl="pallas" without a GPU target).
    """
    op = table.RMSNORM.name
    _check_array(op, "x", x)
    _check_weight(op, "weight", weight, x.shape[-1], "x")
    eps = _check_eps(op, "eps", eps)
    return call(op, impl, (x, weight), dict(eps=eps))


def fused_q_kv_rmsnorm(q_c, kv_c, q_weight, kv_weight, eps=1e-6, *, kv_eps=None, impl="auto"):
    """RMSNorm of MLA's compressed q and kv latents in ONE kernel launch.

    Args:
      q_c: ``[..., Dq]`` (1536 in DeepSeek-V3 / Kimi-K2 / Kimi-K3), float16 / bfloat16 / float32.
      kv_c: ``[..., Dkv]`` (512), same leading dims as ``q_c``; its dtype may differ.
      q_weight, kv_weight: ``[Dq]`` and ``[Dkv]``, any of those dtypes.
      eps: epsilon of the q norm (default 1e-6; Kimi-K2.5 and later use 1e-5).
      kv_eps: epsilon of the kv norm; defaults to ``eps``.
      impl: "auto", "pallas", "interpret" or "reference".

    Returns: ``(q_out, kv_out)``, each ``rmsnorm`` of its input, in its input's dtype.

    Raises: as ``rmsnorm``; ValueError if the leading dims differ.
    """
    op = table.FUSED_Q_KV_RMSNORM.name
    eps, kv_eps = _check_fused(op, q_c, kv_c, q_weight, kv_weight, eps, kv_eps)
    return tuple(call(op, impl, (q_c, kv_c, q_weight, kv_weight), dict(eps=eps, kv_eps=kv_eps)))


def _check_fused(op, q_c, kv_c, q_weight, kv_weight, eps, kv_eps):
    _check_array(op, "q_c", q_c)
    _check_array(op, "kv_c", kv_c)
    if q_c.shape[:-1] != kv_c.shape[:-1]:
        raise ValueError(f"{op}: q_c and kv_c must have the same leading dims; got shapes "
                         f"{tuple(q_c.shape)} and {tuple(kv_c.shape)}")
    _check_weight(op, "q_weight", q_weight, q_c.shape[-1], "q_c")
    _check_weight(op, "kv_weight", kv_weight, kv_c.shape[-1], "kv_c")
    eps = _check_eps(op, "eps", eps)
    return eps, (eps if kv_eps is None else _check_eps(op, "kv_eps", kv_eps))


def _check_size(op, name, value, minimum):
    """A static integer option (any ``numbers.Integral``, e.g. ``np.int64``; not bool) as int:
    TypeError for an array or traced value (as for eps), ValueError for anything else."""
    if isinstance(value, (jax.Array, jax.core.Tracer)):
        raise TypeError(f"{op}: {name} must be a Python int (a static option), got "
                        f"{type(value).__name__}")
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or value < minimum):
        raise ValueError(f"{op}: {name} must be an integer >= {minimum} (a static option), "
                         f"got {value!r}")
    return int(value)


def mla_q_kv_norm(qkv_a, q_weight, kv_weight, eps=1e-6, *, kv_eps=None, q_size=1536, kv_size=512,
                  impl="auto"):
    """MLA's q/kv RMSNorm straight from the packed projection, in ONE kernel launch.

    In DeepSeek-V3 / Kimi-K2 / Kimi-K3, one fused projection of the hidden state gives
    ``qkv_a = [q_c | kv_c | k_pe]`` per token (1536 + 512 + 64 = 2112 columns). The kernel reads
    those packed rows directly (column offsets inside the kernel) and writes the two normalized
    latents and the untouched rope part: no XLA slice materializes a copy of ``q_c`` or ``kv_c``
    before the norm, as slicing then calling ``fused_q_kv_rmsnorm`` under ``jax.jit`` does.

    Args:
      qkv_a: ``[..., q_size + kv_size + rope]`` float16 / bfloat16 / float32, ``rope >= 0``.
      q_weight, kv_weight: ``[q_size]`` and ``[kv_size]``, any of those dtypes.
      eps: epsilon of the q norm (default 1e-6; Kimi-K2.5 and later use 1e-5).
      kv_eps: epsilon of the kv norm; defaults to ``eps``.
      q_size, kv_size: the q and kv LoRA ranks (Python ints; default 1536 and 512).
      impl: "auto", "pallas", "interpret" or "reference".

    Returns: ``(q_c [..., q_size], kv_c [..., kv_size], k_pe [..., rope])`` in ``qkv_a.dtype``:
    ``rmsnorm`` of the first two column ranges and a copy of the rest (``rope == 0``: an empty
    ``k_pe``).

    Raises: as ``rmsnorm``; ValueError if ``qkv_a`` has fewer than ``q_size + kv_size`` columns.
    """
    op = table.MLA_Q_KV_NORM.name
    options = _check_packed(op, qkv_a, q_weight, kv_weight, eps, kv_eps, q_size, kv_size)
    q_out, kv_out, *pe = call(op, impl, (qkv_a, q_weight, kv_weight), options)
    return q_out, kv_out, _k_pe(qkv_a, pe)


def _k_pe(qkv_a, pe):
    """The rope part among a packed norm's results; empty where there is none (the kernel then
    writes none)."""
    return pe[0] if pe else jnp.zeros(qkv_a.shape[:-1] + (0,), qkv_a.dtype)


def _check_packed(op, qkv_a, q_weight, kv_weight, eps, kv_eps, q_size, kv_size) -> dict:
    _check_array(op, "qkv_a", qkv_a)
    q_size = _check_size(op, "q_size", q_size, 1)
    kv_size = _check_size(op, "kv_size", kv_size, 1)
    rope = qkv_a.shape[-1] - q_size - kv_size
    if rope < 0:
        raise ValueError(f"{op}: qkv_a's last dim ({qkv_a.shape[-1]}) must hold q_size + kv_size = "
                         f"{q_size + kv_size} columns and the rope part; got shape "
                         f"{tuple(qkv_a.shape)}")
    _check_weight(op, "q_weight", q_weight, q_size, "q_c (q_size)")
    _check_weight(op, "kv_weight", kv_weight, kv_size, "kv_c (kv_size)")
    eps = _check_eps(op, "eps", eps)
    kv_eps = eps if kv_eps is None else _check_eps(op, "kv_eps", kv_eps)
    return dict(q_size=q_size, kv_size=kv_size, eps=eps, kv_eps=kv_eps)


# ------------------------------------------------------------------------------------------------
# Gated RMSNorm, its FP8 fusion, and per-token FP8
# ------------------------------------------------------------------------------------------------

def _check_gated(op, x, weight, gate, eps, activation):
    _check_array(op, "x", x, min_rank=2)
    _check_array(op, "gate", gate, min_rank=2)
    if gate.shape != x.shape:
        raise ValueError(f"{op}: gate must have the shape of x; got gate {tuple(gate.shape)} and "
                         f"x {tuple(x.shape)}")
    _check_weight(op, "weight", weight, x.shape[-1], "x")
    _check_activation(op, activation)
    return _check_eps(op, "eps", eps)


def rmsnorm_gated(x, weight, gate, eps=1e-5, *, activation="sigmoid", impl="auto"):
    """Gated RMSNorm per head: ``rmsnorm(x) * weight * act(gate)``, in that order.

    Args:
      x: ``[..., H, D]`` float16 / bfloat16 / float32; normalized over D for each head.
      weight: ``[D]``, shared by the heads.
      gate: ``[..., H, D]``, the shape of x; its dtype may differ.
      eps: default 1e-5 (Kimi Delta Attention).
      activation: "sigmoid" (KDA) or "silu" (swish).
      impl: "auto", "pallas", "interpret" or "reference".

    Returns: ``[..., H, D]`` in ``x.dtype``; float32 math, one cast at the end.

    Equivalent jnp: ``(rmsnorm_f32(x) * weight.astype(f32) * act(gate.astype(f32))).astype(x.dtype)``.
    """
    op = table.RMSNORM_GATED.name
    eps = _check_gated(op, x, weight, gate, eps, activation)
    return call(op, impl, (x, weight, gate), dict(eps=eps, activation=activation))


def _check_groups(op, scale_groups, n, what):
    scale_groups = _check_size(op, "scale_groups", scale_groups, 1)
    if n % scale_groups:
        raise ValueError(f"{op}: scale_groups={scale_groups} must divide {what} ({n})")
    return scale_groups


def rmsnorm_gated_fp8_per_token(x, weight, gate, eps=1e-5, *, activation="sigmoid",
                                fp8_dtype=None, fp8_max=None, min_scale=None, scale_ub=None,
                                scale_groups=1, fp8_cast=None, impl="auto") -> QuantizedActivation:
    """Gated RMSNorm fused with dynamic per-token FP8, ONE launch.

    ``y = rmsnorm(x) * weight * act(gate)`` per head (as ``rmsnorm_gated``, in float32), then one
    FP8 scale per token over all heads; ``y`` itself never goes through memory.

    Args:
      x, gate: ``[..., T, H, D]``, rank >= 3 (tokens, heads, head dim: the scale is per token);
        weight ``[D]``; eps (default 1e-5); activation "sigmoid" | "silu".
      fp8_dtype, fp8_max, min_scale, scale_ub, scale_groups, fp8_cast: as in
        ``per_token_fp8_quant`` (``scale_groups`` counts groups of heads).
      impl: "auto", "pallas", "interpret" or "reference".

    Returns: ``QuantizedActivation(data [..., H*D] fp8, scale [..., G] float32)``.

    Raises: TypeError / ValueError naming the bad argument; RuntimeError for impl="pallas"
    without a GPU target; TypeError on any gradient.
    """
    op = table.RMSNORM_GATED_FP8_PER_TOKEN.name
    eps = _check_gated(op, x, weight, gate, eps, activation)
    if x.ndim < 3:  # [H, D] or [T, H*D] would be ambiguous: the scale is per token
        raise ValueError(f"{op}: x and gate must be [..., T, H, D] (rank >= 3: tokens, heads, head "
                         f"dim; one token: x[None]); got shape {tuple(x.shape)}")
    q = _fp8_params(op, (x, gate), fp8_dtype, fp8_max, min_scale, scale_ub, fp8_cast)
    heads, dim = x.shape[-2:]
    groups = _check_groups(op, scale_groups, heads, "the number of heads")
    lead = x.shape[:-2]
    # Groups of heads as rows of their own: [..., G, H / G, D].
    xg = x.reshape(lead + (groups, heads // groups, dim))
    data, scale = call(op, impl, (xg, weight, gate.reshape(xg.shape)),
                       dict(eps=eps, activation=activation, fp8=q), originals=(x, weight, gate))
    return QuantizedActivation(data.reshape(lead + (heads * dim,)), scale.reshape(lead + (groups,)))




def per_token_fp8_quant(x, *, fp8_dtype=None, fp8_max=None, min_scale=None, scale_ub=None,
                        scale_groups=1, fp8_cast=None, impl="auto") -> QuantizedActivation:
    """Dynamic per-token FP8 of ``x [..., N]`` (an already-normed activation).

    vLLM's semantics, per token (per scale group): ``amax = max|x|``;
    ``scale = max(min(amax, scale_ub) / fp8_max, min_scale)``;
    ``data = round_to_nearest_even(clamp(x / scale, -fp8_max, fp8_max))``. A zero row gets
    ``scale = min_scale`` and zero codes; a row with a NaN or an infinity gets a NaN scale and NaN
    codes, and no other row changes.

    Args:
      x: ``[..., N]`` float16 / bfloat16 / float32.
      fp8_dtype: ``float8_e4m3fn``, ``float8_e4m3fnuz`` or ``float8_e5m2``; default by device
        (``default_fp8_dtype``: e4m3fnuz on gfx94x, e4m3fn elsewhere).
      fp8_max: default 448 (e4m3fn), 224 (e4m3fnuz, as vLLM; AITER uses 240), 57344 (e5m2);
        from 4 to the format's largest finite value.
      min_scale: default ``1 / (fp8_max * 512)``; from 2**-126 to 2**126.
      scale_ub: optional upper bound on ``amax`` (default None).
      scale_groups: ``G`` (default 1) dividing ``N``: one scale per token for each of ``G``
        equal, contiguous column groups, ``scale [..., G]``. Sharded over heads, a multiple of
        the shard count keeps every scale on one device; ``G = 1`` takes the maximum across them
        (``k3pallas.sharding``).
      fp8_cast: the float32 -> FP8 conversion in the kernel: "auto" (the hardware's where a
        device self-check showed it equal to the integer encoder, else the encoder), "native",
        "encoder" or "native_unchecked" (ahead-of-time only); None: ``$K3PALLAS_FP8_CAST``, else
        "auto". The codes are the same either way; ``kp.fp8_cast_decisions()`` says what was
        decided. Ignored by ``impl="reference"``.
      impl: "auto", "pallas", "interpret" or "reference".

    Returns: ``QuantizedActivation(data [..., N] fp8, scale [..., G] float32)``.

    Raises: TypeError / ValueError naming the bad argument; RuntimeError for impl="pallas"
    without a GPU target; TypeError on any gradient.
    """
    op = table.PER_TOKEN_FP8_QUANT.name
    _check_array(op, "x", x)
    q = _fp8_params(op, (x,), fp8_dtype, fp8_max, min_scale, scale_ub, fp8_cast)
    n = x.shape[-1]
    groups = _check_groups(op, scale_groups, n, "the last dim of x")
    lead = x.shape[:-1]
    data, scale = call(op, impl, (x.reshape(lead + (groups, n // groups)),), dict(fp8=q),
                       originals=(x,))
    return QuantizedActivation(data.reshape(x.shape), scale.reshape(lead + (groups,)))




def _check_x_gate(op, x, gate):
    _check_array(op, "x", x)
    _check_array(op, "gate", gate)
    if gate.shape != x.shape:
        raise ValueError(f"{op}: gate must have the shape of x; got gate {tuple(gate.shape)} and "
                         f"x {tuple(x.shape)}")


def sigmoid_mul_fp8_per_token(x, gate, *, fp8_dtype=None, fp8_max=None, min_scale=None,
                              scale_ub=None, scale_groups=1, fp8_cast=None,
                              impl="auto") -> QuantizedActivation:
    """MLA's output gate fused with dynamic per-token FP8, ONE launch.

    ``y = x * sigmoid(gate)`` in float32 (Kimi-K3's gated MLA output, the o_proj input), then
    per-token FP8 of ``y``; ``y`` itself never goes through memory.

    Args:
      x, gate: ``[..., N]`` float16 / bfloat16 / float32, the same shape (``N = H * D``: 96 x 128
        for the whole Kimi-K3 layer, 12 x 128 per TP8 rank); their dtypes may differ.
      fp8_dtype, fp8_max, min_scale, scale_ub, scale_groups, fp8_cast: as in
        ``per_token_fp8_quant``.
      impl: "auto", "pallas", "interpret" or "reference".

    Returns: ``QuantizedActivation(data [..., N] fp8, scale [..., G] float32)``.

    Raises: as ``per_token_fp8_quant``.
    """
    op = table.SIGMOID_MUL_FP8_PER_TOKEN.name
    _check_x_gate(op, x, gate)
    q = _fp8_params(op, (x, gate), fp8_dtype, fp8_max, min_scale, scale_ub, fp8_cast)
    n = x.shape[-1]
    groups = _check_groups(op, scale_groups, n, "the last dim of x")
    lead = x.shape[:-1]
    xg = x.reshape(lead + (groups, n // groups))
    data, scale = call(op, impl, (xg, gate.reshape(xg.shape)), dict(fp8=q), originals=(x, gate))
    return QuantizedActivation(data.reshape(x.shape), scale.reshape(lead + (groups,)))




def fused_q_kv_rmsnorm_fp8(q_c, kv_c, q_weight, kv_weight, eps=1e-6, *, kv_eps=None,
                           fp8_dtype=None, fp8_max=None, min_scale=None, scale_ub=None,
                           fp8_cast=None, impl="auto"):
    """Joint q/kv RMSNorm with q quantized to per-token FP8, ONE launch.

    As ``fused_q_kv_rmsnorm`` (same arguments). q is normalized in float32 and quantized from
    there (never rounded to its dtype first), one scale per token over its ``Dq`` columns: the
    input of an FP8 q_b projection. kv is normalized in its dtype, as in the bf16 op (within one
    ulp of it: the two launches may sum in another order).

    Args: as ``fused_q_kv_rmsnorm``; fp8_dtype, fp8_max, min_scale, scale_ub, fp8_cast as in
    ``per_token_fp8_quant``.

    Returns: ``(QuantizedActivation(q data [..., Dq] fp8, scale [..., 1] float32), kv_out)``.
    """
    op = table.FUSED_Q_KV_RMSNORM_FP8.name
    eps, kv_eps = _check_fused(op, q_c, kv_c, q_weight, kv_weight, eps, kv_eps)
    q = _fp8_params(op, (q_c, kv_c), fp8_dtype, fp8_max, min_scale, scale_ub, fp8_cast)
    data, scale, kv_out = call(op, impl, (q_c, kv_c, q_weight, kv_weight),
                               dict(eps=eps, kv_eps=kv_eps, fp8=q))
    return QuantizedActivation(data, scale), kv_out


def mla_q_kv_norm_fp8(qkv_a, q_weight, kv_weight, eps=1e-6, *, kv_eps=None, q_size=1536,
                      kv_size=512, fp8_dtype=None, fp8_max=None, min_scale=None, scale_ub=None,
                      fp8_cast=None, impl="auto"):
    """``mla_q_kv_norm`` with q quantized to per-token FP8, ONE launch.

    As ``mla_q_kv_norm`` (same arguments), q quantized as in ``fused_q_kv_rmsnorm_fp8``.

    Args: as ``mla_q_kv_norm``; fp8_dtype, fp8_max, min_scale, scale_ub, fp8_cast as in
    ``per_token_fp8_quant``.

    Returns: ``(QuantizedActivation(q data [..., q_size], scale [..., 1]), kv_c, k_pe)``.
    """
    op = table.MLA_Q_KV_NORM_FP8.name
    options = _check_packed(op, qkv_a, q_weight, kv_weight, eps, kv_eps, q_size, kv_size)
    q = _fp8_params(op, (qkv_a,), fp8_dtype, fp8_max, min_scale, scale_ub, fp8_cast)
    data, scale, kv_out, *pe = call(op, impl, (qkv_a, q_weight, kv_weight), dict(options, fp8=q))
    return QuantizedActivation(data, scale), kv_out, _k_pe(qkv_a, pe)






# ------------------------------------------------------------------------------------------------
# The quantizing ops by output format: per-token FP8 (the functions above), MXFP8 or MXFP4
# ------------------------------------------------------------------------------------------------
#
# Each ``*_quant`` function takes ``out_format``: "fp8_per_token" (default) calls the per-token
# FP8 function of the same fusion with every option; "mxfp8" / "mxfp4" run the fusion's MX op
# (``k3pallas.ops``), one launch, and take only ``fp8_cast`` besides ``impl`` (the per-token
# options have no meaning for a power-of-two scale per 32 elements).


def _mx_params(op, out_format, fp8_cast, **per_token):
    """The MX options, or None for per-token FP8; ValueError for a per-token option with MX."""
    try:
        out_format = mx_lib.check_out_format(out_format)
    except ValueError as e:
        raise ValueError(f"{op}: {e}") from None
    if out_format == "fp8_per_token":
        return None
    given = [k for k, v in per_token.items() if v is not None and not (k == "scale_groups" and v == 1)]
    if given:
        raise ValueError(f"{op}: {', '.join(given)} apply to out_format='fp8_per_token' only; "
                         f"{out_format} has one power-of-two (e8m0) scale per {mx_lib.BLOCK} "
                         f"elements and the element format {mx_lib.mx_format(out_format).dtype.name}")
    try:
        return mx_lib.resolve_mx_params(out_format, fp8_cast)
    except ValueError as e:
        raise ValueError(f"{op}: {e}") from None


def _check_blocks(op, what, n):
    if n % mx_lib.BLOCK:
        raise ValueError(f"{op}: MX formats scale blocks of {mx_lib.BLOCK} elements, which may not "
                         f"cross {what}: its size ({n}) must be a multiple of {mx_lib.BLOCK}")


def _blocks(a):
    return a.reshape(a.shape[:-1] + (a.shape[-1] // mx_lib.BLOCK, mx_lib.BLOCK))


def quantize_activation(x, *, out_format="fp8_per_token", fp8_dtype=None, fp8_max=None,
                        min_scale=None, scale_ub=None, scale_groups=None, fp8_cast=None,
                        impl="auto") -> QuantizedActivation:
    """Dynamic quantization of ``x [..., N]`` (an already-normed activation) to ``out_format``.

    ``"fp8_per_token"`` (default): ``per_token_fp8_quant`` with the other options.
    ``"mxfp8"`` / ``"mxfp4"``: MX (``k3pallas.mx``): one e8m0 scale per 32 contiguous elements
    of a row, jax's own MX rounding; ``N`` a multiple of 32. Returns
    ``QuantizedActivation(data [..., N] float8_e4m3fn | float4_e2m1fn, scale [..., N / 32]
    float8_e8m0fnu)``, the operands ``jax.nn.scaled_matmul`` takes (``k3pallas.mx_linear``).
    ``fp8_cast``: the element conversion, as in ``per_token_fp8_quant`` (MXFP4: the encoder).
    """
    op = "quantize_activation"
    mx = _mx_params(op, out_format, fp8_cast, fp8_dtype=fp8_dtype, fp8_max=fp8_max,
                    min_scale=min_scale, scale_ub=scale_ub, scale_groups=scale_groups)
    if mx is None:
        return per_token_fp8_quant(x, fp8_dtype=fp8_dtype, fp8_max=fp8_max, min_scale=min_scale,
                                   scale_ub=scale_ub, scale_groups=scale_groups or 1,
                                   fp8_cast=fp8_cast, impl=impl)
    name = table.MX_QUANT.name
    _check_array(op, "x", x)
    _check_blocks(op, "the last dim of x", x.shape[-1])
    data, scale = call(name, impl, (_blocks(x),), dict(mx=mx), originals=(x,))
    return QuantizedActivation(data.reshape(x.shape), scale)


def sigmoid_mul_quant(x, gate, *, out_format="fp8_per_token", fp8_dtype=None, fp8_max=None,
                      min_scale=None, scale_ub=None, scale_groups=None, fp8_cast=None,
                      impl="auto") -> QuantizedActivation:
    """MLA's output gate ``x * sigmoid(gate)`` fused with quantization to ``out_format``, ONE
    launch: ``sigmoid_mul_fp8_per_token`` for "fp8_per_token" (default); for "mxfp8" / "mxfp4"
    as ``quantize_activation`` of the float32 product (``N`` a multiple of 32; a block never
    crosses a head of 128)."""
    op = "sigmoid_mul_quant"
    mx = _mx_params(op, out_format, fp8_cast, fp8_dtype=fp8_dtype, fp8_max=fp8_max,
                    min_scale=min_scale, scale_ub=scale_ub, scale_groups=scale_groups)
    if mx is None:
        return sigmoid_mul_fp8_per_token(x, gate, fp8_dtype=fp8_dtype, fp8_max=fp8_max,
                                         min_scale=min_scale, scale_ub=scale_ub,
                                         scale_groups=scale_groups or 1, fp8_cast=fp8_cast,
                                         impl=impl)
    name = table.SIGMOID_MUL_MX.name
    _check_x_gate(op, x, gate)
    _check_blocks(op, "the last dim of x", x.shape[-1])
    data, scale = call(name, impl, (_blocks(x), _blocks(gate)), dict(mx=mx), originals=(x, gate))
    return QuantizedActivation(data.reshape(x.shape), scale)


def rmsnorm_gated_quant(x, weight, gate, eps=1e-5, *, activation="sigmoid",
                        out_format="fp8_per_token", fp8_dtype=None, fp8_max=None, min_scale=None,
                        scale_ub=None, scale_groups=None, fp8_cast=None,
                        impl="auto") -> QuantizedActivation:
    """Gated RMSNorm (``rmsnorm_gated``) fused with quantization to ``out_format``, ONE launch:
    ``rmsnorm_gated_fp8_per_token`` for "fp8_per_token" (default); for "mxfp8" / "mxfp4" the
    float32 ``y`` of each head quantized in blocks of 32 of its head dim (``D`` a multiple of
    32; a block never crosses a head). Returns ``QuantizedActivation(data [..., T, H*D],
    scale [..., T, H*D / 32] float8_e8m0fnu)`` for MX: the o_proj input of
    ``jax.nn.scaled_matmul`` (``k3pallas.mx_linear``)."""
    op = "rmsnorm_gated_quant"
    mx = _mx_params(op, out_format, fp8_cast, fp8_dtype=fp8_dtype, fp8_max=fp8_max,
                    min_scale=min_scale, scale_ub=scale_ub, scale_groups=scale_groups)
    if mx is None:
        return rmsnorm_gated_fp8_per_token(x, weight, gate, eps, activation=activation,
                                           fp8_dtype=fp8_dtype, fp8_max=fp8_max,
                                           min_scale=min_scale, scale_ub=scale_ub,
                                           scale_groups=scale_groups or 1, fp8_cast=fp8_cast,
                                           impl=impl)
    name = table.RMSNORM_GATED_MX.name
    eps = _check_gated(op, x, weight, gate, eps, activation)
    if x.ndim < 3:
        raise ValueError(f"{op}: x and gate must be [..., T, H, D] (rank >= 3: tokens, heads, head "
                         f"dim; one token: x[None]); got shape {tuple(x.shape)}")
    _check_blocks(op, "the head dim (last axis of x)", x.shape[-1])
    data, scale = call(name, impl, (_blocks(x), _blocks(weight), _blocks(gate)),
                       dict(eps=eps, activation=activation, mx=mx), originals=(x, weight, gate))
    lead = x.shape[:-2]
    return QuantizedActivation(data.reshape(lead + (-1,)), scale.reshape(lead + (-1,)))


def fused_q_kv_rmsnorm_quant(q_c, kv_c, q_weight, kv_weight, eps=1e-6, *, kv_eps=None,
                             out_format="fp8_per_token", fp8_dtype=None, fp8_max=None,
                             min_scale=None, scale_ub=None, fp8_cast=None, impl="auto"):
    """The joint q/kv RMSNorm with q quantized to ``out_format``, ONE launch:
    ``fused_q_kv_rmsnorm_fp8`` for "fp8_per_token" (default); for "mxfp8" / "mxfp4" q's float32
    norm in blocks of 32 (``Dq`` a multiple of 32): ``(QuantizedActivation(q data [..., Dq],
    scale [..., Dq / 32] float8_e8m0fnu), kv_out)``."""
    op = "fused_q_kv_rmsnorm_quant"
    mx = _mx_params(op, out_format, fp8_cast, fp8_dtype=fp8_dtype, fp8_max=fp8_max,
                    min_scale=min_scale, scale_ub=scale_ub)
    if mx is None:
        return fused_q_kv_rmsnorm_fp8(q_c, kv_c, q_weight, kv_weight, eps, kv_eps=kv_eps,
                                      fp8_dtype=fp8_dtype, fp8_max=fp8_max, min_scale=min_scale,
                                      scale_ub=scale_ub, fp8_cast=fp8_cast, impl=impl)
    name = table.FUSED_Q_KV_RMSNORM_MX.name
    eps, kv_eps = _check_fused(op, q_c, kv_c, q_weight, kv_weight, eps, kv_eps)
    _check_blocks(op, "the last dim of q_c", q_c.shape[-1])
    data, scale, kv_out = call(name, impl, (q_c, kv_c, q_weight, kv_weight),
                               dict(eps=eps, kv_eps=kv_eps, mx=mx))
    return QuantizedActivation(data, scale), kv_out


def mla_q_kv_norm_quant(qkv_a, q_weight, kv_weight, eps=1e-6, *, kv_eps=None, q_size=1536,
                        kv_size=512, out_format="fp8_per_token", fp8_dtype=None, fp8_max=None,
                        min_scale=None, scale_ub=None, fp8_cast=None, impl="auto"):
    """``mla_q_kv_norm`` with q quantized to ``out_format``, ONE launch: ``mla_q_kv_norm_fp8``
    for "fp8_per_token" (default); MX as in ``fused_q_kv_rmsnorm_quant`` (``q_size`` a multiple
    of 32): ``(QuantizedActivation(q data, scale [..., q_size / 32]), kv_c, k_pe)``."""
    op = "mla_q_kv_norm_quant"
    mx = _mx_params(op, out_format, fp8_cast, fp8_dtype=fp8_dtype, fp8_max=fp8_max,
                    min_scale=min_scale, scale_ub=scale_ub)
    if mx is None:
        return mla_q_kv_norm_fp8(qkv_a, q_weight, kv_weight, eps, kv_eps=kv_eps, q_size=q_size,
                                 kv_size=kv_size, fp8_dtype=fp8_dtype, fp8_max=fp8_max,
                                 min_scale=min_scale, scale_ub=scale_ub, fp8_cast=fp8_cast,
                                 impl=impl)
    name = table.MLA_Q_KV_NORM_MX.name
    options = _check_packed(op, qkv_a, q_weight, kv_weight, eps, kv_eps, q_size, kv_size)
    _check_blocks(op, "q_size", options["q_size"])
    data, scale, kv_out, *pe = call(name, impl, (qkv_a, q_weight, kv_weight), dict(options, mx=mx))
    return QuantizedActivation(data, scale), kv_out, _k_pe(qkv_a, pe)
