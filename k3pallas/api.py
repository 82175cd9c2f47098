"""The public op functions: one per fusion, its output format through one parameter.

No kernel code lives here: each function checks its arguments, resolves the target once (the
device its operands, mesh or ``compiling_for`` name) and its output format for it, and calls
``k3pallas.ops.call``. Every function:

* takes arrays positionally and options as keywords; options are static (Python values), so the
  functions work inside ``jax.jit``, ``jax.vmap`` and ``shard_map``;
* takes ``out_format``: None (default: the output in the input's dtype), a format of
  ``k3pallas.formats`` (``Fp8PerToken(...)``, ``MXFP8``, ``MXFP4``, ``Fp8Group(...)``) or its
  name (``"fp8_per_token"``, ``"mxfp8"``, ``"mxfp4"``, ``"fp8_group128"``,
  ``"fp8_group128_ue8m0"``), and then returns a ``QuantizedActivation``;
  ``fp8_cast`` picks the float32 -> element conversion of the kernels (``k3pallas.kernels.fp8_cast``);
* accepts any leading shape (flattened to rows) and returns empty outputs for zero rows without
  launching anything;
* is inference-only: taking a gradient raises ``TypeError`` saying so;
* runs sharded (``k3pallas.sharding``): XLA splits its kernel over devices instead of gathering;
* chooses an implementation with ``impl``: ``"auto"`` (the Pallas kernel when the target is a GPU,
  cuda or rocm, else the jnp reference), ``"pallas"`` (the compiled kernel; RuntimeError on a
  backend without one, never a silent fallback), ``"interpret"`` (the same kernel in Pallas
  interpret mode, on any backend) or ``"reference"`` (pure jnp, ``k3pallas.reference``).

Errors name the op and the argument: TypeError for a non-array, an unsupported dtype or a traced
option; ValueError for shapes and values; RuntimeError for ``impl="pallas"`` without a GPU.
"""

from __future__ import annotations

import jax.numpy as jnp

from k3pallas import fp8 as fp8_lib, formats, ops, platform
from k3pallas._checks import FLOAT_DTYPES, static_int, static_positive_float
from k3pallas.formats import Fp8PerToken, QuantizedActivation

__all__ = ["rmsnorm", "add_rmsnorm", "fused_q_kv_rmsnorm", "mla_q_kv_norm", "rmsnorm_gated", "sigmoid_mul",
           "quantize", "rmsnorm_gated_fp8_per_token", "per_token_fp8_quant", "IMPLS",
           "ACTIVATIONS"]

IMPLS = ops.IMPLS
ACTIVATIONS = ("sigmoid", "silu")


# ------------------------------------------------------------------------------------------------
# Argument checks (each error names the op, the argument and what it got)
# ------------------------------------------------------------------------------------------------


def _check_array(op, name, a, *, min_rank=1):
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{op}: {name} must be an array, got {type(a).__name__}")
    if a.ndim < min_rank:
        raise ValueError(f"{op}: {name} must have rank >= {min_rank}, got shape {tuple(a.shape)}")
    if jnp.dtype(a.dtype) not in FLOAT_DTYPES:
        names = ", ".join(d.name for d in FLOAT_DTYPES)
        raise TypeError(f"{op}: {name} must have a floating dtype among {names}; got {a.dtype}")
    if any(d == 0 for d in a.shape[a.ndim - min_rank:]):
        raise ValueError(f"{op}: {name} must have non-empty trailing dims (the normalized or "
                         f"quantized ones), got shape {tuple(a.shape)}")


def _check_weight(op, name, w, length, of):
    _check_array(op, name, w, min_rank=1)
    if w.ndim != 1 or w.shape[0] != length:
        raise ValueError(f"{op}: {name} must have shape ({length},) to match the last dim of {of}; "
                         f"got {tuple(w.shape)}")


def _check_same_shape(op, x, gate):
    if gate.shape != x.shape:
        raise ValueError(f"{op}: gate must have the shape of x; got gate {tuple(gate.shape)} and "
                         f"x {tuple(x.shape)}")


def _eps(op, name, eps) -> float:
    try:
        return static_positive_float(name, eps)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{op}: {e}") from None


def _size(op, name, value, minimum) -> int:
    try:
        return static_int(name, value, minimum)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{op}: {e}") from None


class _Call:
    """One call's target, output format and conversion mode, resolved once."""

    def __init__(self, op, arrays, out_format, fp8_cast, *, required=False):
        self.op = op
        self.target = platform.current_target(*arrays)
        try:
            if out_format is None:
                if required:
                    raise ValueError(f"out_format is required (one of {tuple(formats.FORMATS)} "
                                     "or a format value)")
                if fp8_cast is not None:
                    raise ValueError(f"fp8_cast={fp8_cast!r} applies to a quantized output; "
                                     "out_format is None")
                self.fmt = None
            else:
                self.fmt = formats.as_format(out_format).resolve(self.target)
            self.cast = fp8_lib.check_cast_mode(fp8_cast)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{op}: {e}") from None

    def check_width(self, n, what, *, per_token_groups_ok=True):
        """The format must split ``n`` (``what``) into its scale groups."""
        fmt = self.fmt
        if fmt is None:
            return
        if fmt.block is None and fmt.groups != 1 and not per_token_groups_ok:
            raise ValueError(f"{self.op}: fp8_per_token groups={fmt.groups}: this op writes one "
                             "scale per token (its normalized axis is never sharded); use groups=1")
        try:
            fmt.check_width(n, what)
        except ValueError as e:
            raise ValueError(f"{self.op}: {e}") from None

    def run(self, impl, arrays, options):
        return ops.call(self.op, impl, arrays, options, fmt=self.fmt, fp8_cast=self.cast,
                        target=self.target)

    def record(self, data, scale):
        return QuantizedActivation._unchecked(data, scale, self.fmt)


def _per_token(op, fp8_dtype, fp8_max, min_scale, scale_ub, scale_groups):
    """The ``Fp8PerToken`` of the seed-named shorthands' keywords."""
    try:
        return Fp8PerToken(fp8_dtype, fp8_max, min_scale, scale_ub, scale_groups)
    except (TypeError, ValueError) as e:
        msg = str(e).replace("groups must", "scale_groups must")
        raise type(e)(f"{op}: {msg}") from None


# ------------------------------------------------------------------------------------------------
# The norms: rmsnorm, the joint q/kv norm, the packed MLA norm
# ------------------------------------------------------------------------------------------------


def rmsnorm(x, weight, eps=1e-6, *, out_format=None, fp8_cast=None, impl="auto"):
    """RMSNorm over the last axis: ``x * rsqrt(mean(x**2, -1) + eps) * weight``.

    Args:
      x: ``[..., D]`` float16, bfloat16 or float32; any leading shape.
      weight: ``[D]``, any of those dtypes.
      eps: positive finite Python float (default 1e-6, DeepSeek-V3 / Kimi-K2 MLA).
      out_format: None, or a format quantizing the float32 ``y`` in the same launch (per-token
        FP8 with one scale per token; MXFP8 / MXFP4 with ``D`` a multiple of 32).
      fp8_cast, impl: see the module docstring.

    Returns: ``[..., D]`` in ``x.dtype``; or ``QuantizedActivation(data [..., D], scale [..., G])``.

    Equivalent jnp: ``(xf * jax.lax.rsqrt(jnp.mean(xf**2, -1, keepdims=True) + eps)
    * weight.astype(f32)).astype(x.dtype)`` with ``xf = x.astype(f32)``.
    """
    op = ops.RMSNORM.name
    _check_array(op, "x", x)
    _check_weight(op, "weight", weight, x.shape[-1], "x")
    eps = _eps(op, "eps", eps)
    c = _Call(op, (x,), out_format, fp8_cast)
    c.check_width(x.shape[-1], "the last dim of x", per_token_groups_ok=False)
    out = c.run(impl, (x, weight), dict(eps=eps))
    return out if c.fmt is None else c.record(*out)


def add_rmsnorm(x, residual, weight, eps=1e-6, *, out_format=None, fp8_cast=None, impl="auto"):
    """The residual add fused into RMSNorm, as every decoder layer runs it twice:
    ``r = x + residual``, then ``rmsnorm(r) * weight``, in ONE launch that reads ``x`` and
    ``residual`` once and writes ``r`` and the output once.

    ``r`` is the float32 sum rounded once to the dtype, and the norm is that of the stored ``r``
    (as vLLM's ``fused_add_rms_norm``: the residual stream is what the next layer adds to). The
    kernel writes ``r`` over ``residual``'s buffer (``input_output_aliases``): under ``jax.jit``
    with ``residual`` donated (``donate_argnums``), the update is in place, no new buffer.

    Args:
      x: ``[..., D]`` float16, bfloat16 or float32 (the sublayer's output).
      residual: the residual stream, the shape and dtype of ``x``.
      weight: ``[D]``, any of those dtypes.
      eps: positive finite Python float (default 1e-6: DeepSeek-V3, Kimi-K2 / K3).
      out_format: None, or a format quantizing the float32 norm in the same launch (per-token FP8
        with one scale per token, MX with ``D`` a multiple of 32, group FP8 of 128).
      fp8_cast, impl: see the module docstring.

    Returns: ``(y [..., D] in x.dtype, r)``; with a format ``(QuantizedActivation, r)``.
    """
    op = ops.ADD_RMSNORM.name
    _check_array(op, "x", x)
    _check_array(op, "residual", residual)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"{op}: residual must have the shape and dtype of x; got residual "
                         f"{tuple(residual.shape)} {residual.dtype} and x {tuple(x.shape)} {x.dtype}")
    _check_weight(op, "weight", weight, x.shape[-1], "x")
    eps = _eps(op, "eps", eps)
    c = _Call(op, (x, residual), out_format, fp8_cast)
    c.check_width(x.shape[-1], "the last dim of x", per_token_groups_ok=False)
    out = c.run(impl, (x, residual, weight), dict(eps=eps))
    return out if c.fmt is None else (c.record(*out[:2]), out[2])


def _check_qkv(op, q_c, kv_c, q_weight, kv_weight, eps, kv_eps):
    _check_array(op, "q_c", q_c)
    _check_array(op, "kv_c", kv_c)
    if q_c.shape[:-1] != kv_c.shape[:-1]:
        raise ValueError(f"{op}: q_c and kv_c must have the same leading dims; got shapes "
                         f"{tuple(q_c.shape)} and {tuple(kv_c.shape)}")
    _check_weight(op, "q_weight", q_weight, q_c.shape[-1], "q_c")
    _check_weight(op, "kv_weight", kv_weight, kv_c.shape[-1], "kv_c")
    eps = _eps(op, "eps", eps)
    return eps, (eps if kv_eps is None else _eps(op, "kv_eps", kv_eps))


def fused_q_kv_rmsnorm(q_c, kv_c, q_weight, kv_weight, eps=1e-6, *, kv_eps=None, out_format=None,
                       fp8_cast=None, impl="auto"):
    """RMSNorm of MLA's compressed q and kv latents in ONE kernel launch.

    Args:
      q_c: ``[..., Dq]`` (1536 in DeepSeek-V3 / Kimi-K2 / Kimi-K3), float16 / bfloat16 / float32.
      kv_c: ``[..., Dkv]`` (512), same leading dims as ``q_c``; its dtype may differ.
      q_weight, kv_weight: ``[Dq]`` and ``[Dkv]``, any of those dtypes.
      eps: epsilon of the q norm (default 1e-6; Kimi-K2.5 and later use 1e-5).
      kv_eps: epsilon of the kv norm; defaults to ``eps``.
      out_format: q's output format: None, or a format quantizing q's float32 norm in the same
        launch (never rounded to its dtype first: the input of an FP8 / MX q_b projection); kv
        stays in its dtype.
      fp8_cast, impl: see the module docstring.

    Returns: ``(q_out, kv_out)``, each ``rmsnorm`` of its input in its input's dtype; with a
    format, ``(QuantizedActivation q, kv_out)``.
    """
    op = ops.FUSED_Q_KV_RMSNORM.name
    eps, kv_eps = _check_qkv(op, q_c, kv_c, q_weight, kv_weight, eps, kv_eps)
    c = _Call(op, (q_c, kv_c), out_format, fp8_cast)
    c.check_width(q_c.shape[-1], "the last dim of q_c", per_token_groups_ok=False)
    out = c.run(impl, (q_c, kv_c, q_weight, kv_weight), dict(eps=eps, kv_eps=kv_eps))
    return tuple(out) if c.fmt is None else (c.record(*out[:2]), out[2])


def mla_q_kv_norm(qkv_a, q_weight, kv_weight, eps=1e-6, *, kv_eps=None, q_size=1536, kv_size=512,
                  out_format=None, fp8_cast=None, impl="auto"):
    """MLA's q/kv RMSNorm straight from the packed projection, in ONE kernel launch.

    In DeepSeek-V3 / Kimi-K2 / Kimi-K3, one fused projection of the hidden state gives
    ``qkv_a = [q_c | kv_c | k_pe]`` per token (1536 + 512 + 64 = 2112 columns). The kernel reads
    those packed rows directly (column offsets inside the kernel) and writes the two normalized
    latents and the untouched rope part: no XLA slice materializes a copy of ``q_c`` or ``kv_c``
    before the norm, as slicing then calling ``fused_q_kv_rmsnorm`` under ``jax.jit`` does.

    Args:
      qkv_a: ``[..., q_size + kv_size + rope]`` float16 / bfloat16 / float32, ``rope >= 0``.
      q_weight, kv_weight: ``[q_size]`` and ``[kv_size]``.
      eps, kv_eps, out_format, fp8_cast, impl: as ``fused_q_kv_rmsnorm``.
      q_size, kv_size: the q and kv LoRA ranks (Python ints; default 1536 and 512).

    Returns: ``(q_c [..., q_size], kv_c [..., kv_size], k_pe [..., rope])`` in ``qkv_a.dtype``
    (``rope == 0``: an empty ``k_pe``); with a format, q as a ``QuantizedActivation``.
    """
    op = ops.MLA_Q_KV_NORM.name
    _check_array(op, "qkv_a", qkv_a)
    q_size = _size(op, "q_size", q_size, 1)
    kv_size = _size(op, "kv_size", kv_size, 1)
    if qkv_a.shape[-1] < q_size + kv_size:
        raise ValueError(f"{op}: qkv_a's last dim ({qkv_a.shape[-1]}) must hold q_size + kv_size = "
                         f"{q_size + kv_size} columns and the rope part; got shape "
                         f"{tuple(qkv_a.shape)}")
    _check_weight(op, "q_weight", q_weight, q_size, "q_c (q_size)")
    _check_weight(op, "kv_weight", kv_weight, kv_size, "kv_c (kv_size)")
    eps = _eps(op, "eps", eps)
    kv_eps = eps if kv_eps is None else _eps(op, "kv_eps", kv_eps)
    c = _Call(op, (qkv_a,), out_format, fp8_cast)
    c.check_width(q_size, "q_size", per_token_groups_ok=False)
    out = c.run(impl, (qkv_a, q_weight, kv_weight),
                dict(eps=eps, kv_eps=kv_eps, q_size=q_size, kv_size=kv_size))
    return tuple(out) if c.fmt is None else (c.record(*out[:2]), *out[2:])


# ------------------------------------------------------------------------------------------------
# The gated ops: the gated norm and MLA's sigmoid-mul
# ------------------------------------------------------------------------------------------------


def rmsnorm_gated(x, weight, gate, eps=1e-5, *, activation="sigmoid", out_format=None,
                  fp8_cast=None, impl="auto"):
    """Gated RMSNorm per head: ``rmsnorm(x) * weight * act(gate)``, in that order (Kimi Delta
    Attention's output norm).

    Args:
      x: ``[..., H, D]`` float16 / bfloat16 / float32; normalized over D for each head.
        Quantized outputs need ``[..., T, H, D]`` (rank >= 3: the scale is per token).
      weight: ``[D]``, shared by the heads.
      gate: ``[..., H, D]``, the shape of x; its dtype may differ.
      eps: default 1e-5 (Kimi Delta Attention).
      activation: "sigmoid" (KDA) or "silu" (swish).
      out_format: None, or a format quantizing each token's float32 ``H * D`` values in the same
        launch: per-token FP8 (``groups`` must divide H: one scale per group of heads), MXFP8 /
        MXFP4 (``D`` a multiple of 32: a block never crosses a head).
      fp8_cast, impl: see the module docstring.

    Returns: ``[..., H, D]`` in ``x.dtype``; with a format, ``QuantizedActivation(data
    [..., T, H * D], scale [..., T, G])``: the o_proj input.

    Equivalent jnp: ``(rmsnorm_f32(x) * weight.astype(f32) * act(gate.astype(f32))).astype(x.dtype)``.
    """
    op = ops.RMSNORM_GATED.name
    _check_array(op, "x", x, min_rank=2)
    _check_array(op, "gate", gate, min_rank=2)
    _check_same_shape(op, x, gate)
    _check_weight(op, "weight", weight, x.shape[-1], "x")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    eps = _eps(op, "eps", eps)
    c = _Call(op, (x, gate), out_format, fp8_cast)
    if c.fmt is not None:
        if x.ndim < 3:  # [H, D] or [T, H*D] would be ambiguous: the scale is per token
            raise ValueError(f"{op}: a quantized output needs x and gate [..., T, H, D] (rank >= "
                             f"3: tokens, heads, head dim; one token: x[None]); got shape "
                             f"{tuple(x.shape)}")
        heads, dim = x.shape[-2:]
        if c.fmt.block is None:
            c.check_width(heads, "the number of heads")
        else:
            c.check_width(dim, "the head dim (last axis of x)")
    out = c.run(impl, (x, weight, gate), dict(eps=eps, activation=activation))
    return out if c.fmt is None else c.record(*out)


def sigmoid_mul(x, gate, *, out_format=None, fp8_cast=None, impl="auto"):
    """MLA's output gate ``x * sigmoid(gate)`` in float32 (Kimi-K3's gated MLA output, the o_proj
    input), in ONE launch; ``y`` itself never goes through memory when quantized.

    Args:
      x, gate: ``[..., N]`` float16 / bfloat16 / float32, the same shape (``N = H * D``: 96 x 128
        for the whole Kimi-K3 layer, 12 x 128 per TP8 rank); their dtypes may differ.
      out_format: None, or a format over each token's ``N`` values (per-token FP8: ``groups``
        dividing N; MXFP8 / MXFP4: N a multiple of 32).
      fp8_cast, impl: see the module docstring.

    Returns: ``[..., N]`` in ``x.dtype``; or ``QuantizedActivation(data [..., N], scale [..., G])``.
    """
    op = ops.SIGMOID_MUL.name
    _check_array(op, "x", x)
    _check_array(op, "gate", gate)
    _check_same_shape(op, x, gate)
    c = _Call(op, (x, gate), out_format, fp8_cast)
    c.check_width(x.shape[-1], "the last dim of x")
    out = c.run(impl, (x, gate), {})
    return out if c.fmt is None else c.record(*out)


# ------------------------------------------------------------------------------------------------
# Standalone quantization
# ------------------------------------------------------------------------------------------------


def quantize(x, out_format, *, fp8_cast=None, impl="auto") -> QuantizedActivation:
    """Dynamic quantization of ``x [..., N]`` (an already-normed activation) to ``out_format``,
    ONE launch: per-token FP8 (``Fp8PerToken`` / ``"fp8_per_token"``), MXFP8 or MXFP4.

    Args:
      x: ``[..., N]`` float16 / bfloat16 / float32.
      out_format: the format (required); its rules: ``k3pallas.formats``.
      fp8_cast, impl: see the module docstring.

    Returns: ``QuantizedActivation(data [..., N], scale [..., G])``.
    """
    op = ops.QUANTIZE.name
    _check_array(op, "x", x)
    c = _Call(op, (x,), out_format, fp8_cast, required=True)
    c.check_width(x.shape[-1], "the last dim of x")
    return c.record(*c.run(impl, (x,), {}))


# ------------------------------------------------------------------------------------------------
# The seed system's names, as shorthands
# ------------------------------------------------------------------------------------------------


def rmsnorm_gated_fp8_per_token(x, weight, gate, eps=1e-5, *, activation="sigmoid",
                                fp8_dtype=None, fp8_max=None, min_scale=None, scale_ub=None,
                                scale_groups=1, fp8_cast=None,
                                impl="auto") -> QuantizedActivation:
    """Shorthand: ``rmsnorm_gated(x, weight, gate, eps, activation=activation,
    out_format=Fp8PerToken(fp8_dtype, fp8_max, min_scale, scale_ub, scale_groups))``: the gated
    norm fused with dynamic per-token FP8 (the seed fusion), one launch. ``scale_groups`` counts
    groups of heads."""
    fmt = _per_token(ops.RMSNORM_GATED.name, fp8_dtype, fp8_max, min_scale, scale_ub, scale_groups)
    return rmsnorm_gated(x, weight, gate, eps, activation=activation, out_format=fmt,
                         fp8_cast=fp8_cast, impl=impl)


def per_token_fp8_quant(x, *, fp8_dtype=None, fp8_max=None, min_scale=None, scale_ub=None,
                        scale_groups=1, fp8_cast=None, impl="auto") -> QuantizedActivation:
    """Shorthand: ``quantize(x, Fp8PerToken(fp8_dtype, fp8_max, min_scale, scale_ub,
    scale_groups))``: dynamic per-token FP8 of an already-normed ``x [..., N]`` (vLLM's)."""
    fmt = _per_token(ops.QUANTIZE.name, fp8_dtype, fp8_max, min_scale, scale_ub, scale_groups)
    return quantize(x, fmt, fp8_cast=fp8_cast, impl=impl)
