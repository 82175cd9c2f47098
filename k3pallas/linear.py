"""Linear layers that consume ``QuantizedActivation``: per-channel FP8 weight quantization and an
FP8 x FP8 matmul with the per-token and per-channel scales applied to the float32 result; MX
(MXFP8 / MXFP4) weight quantization and ``mx_linear`` on ``jax.nn.scaled_matmul``.

No Pallas here: the matmul is ``jax.lax.dot_general`` on the fp8 operands with
``preferred_element_type=float32``, which XLA's GPU compiler rewrites into a vendor FP8 GEMM
(``__cublas$lt$matmul$f8``: cuBLASLt on NVIDIA sm_89+, hipBLASLt on AMD MI300 and later; see the
README for when it does and what it does otherwise). Those GEMMs take only scalar scales, so the
vector scales (one per token, one per output channel) multiply the float32 result afterwards,
in one XLA elementwise fusion.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from jax import lax

from k3pallas import fp8 as fp8_lib, mx as mx_lib, platform, reference
from k3pallas._checks import FLOAT_DTYPES as _FLOATS

__all__ = ["QuantizedWeight", "quantize_weight_per_channel", "fp8_linear", "quantize_weight_mx",
           "mx_linear"]

W_LAYOUTS = ("kn", "nk")


def _check_layout(op, w_layout):
    if w_layout not in W_LAYOUTS:
        raise ValueError(f"{op}: w_layout must be 'kn' or 'nk', got {w_layout!r}")


@jax.tree_util.register_pytree_node_class
class QuantizedWeight:
    """A per-channel FP8 weight with its layout: ``data`` fp8, ``[K, N]`` (``layout="kn"``) or
    ``[N, K]`` (``"nk"``); ``scale [N]`` float32. A pytree (``layout`` is static), so it passes
    through ``jax.jit``; ``fp8_linear`` reads the layout from it, so the two cannot disagree.
    ``w8, w_scale = qw`` unpacks the arrays (``fp8_linear`` then needs ``w_layout=``)."""

    def __init__(self, data, scale, layout: str):
        _check_layout("QuantizedWeight", layout)
        self.data, self.scale, self.layout = data, scale, layout

    def tree_flatten(self):
        return (self.data, self.scale), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(*children, layout)

    def __iter__(self):
        return iter((self.data, self.scale))

    def __repr__(self):
        return (f"QuantizedWeight(data={getattr(self.data, 'shape', '?')} "
                f"{getattr(self.data, 'dtype', '?')}, layout={self.layout!r})")

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The ``[K, N]`` weight ``data * scale`` (whatever the stored layout), in ``dtype``; an MX
        weight (``scale [N, K / 32]`` e8m0) per block of 32 along K."""
        if jnp.dtype(self.scale.dtype) == jnp.dtype(jnp.float8_e8m0fnu):  # MX, layout "nk":
            # per block of 32 along K, as an activation's rows
            return fp8_lib.QuantizedActivation(self.data, self.scale).dequantize().T.astype(dtype)
        w = self.data.astype(jnp.float32)
        w = w if self.layout == "kn" else w.T
        return (w * self.scale).astype(dtype)


def _check_weight_matrix(op, w):
    if not hasattr(w, "shape") or not hasattr(w, "dtype"):
        raise TypeError(f"{op}: w must be an array, got {type(w).__name__}")
    if w.ndim != 2 or 0 in w.shape:
        raise ValueError(f"{op}: w must be a non-empty [K, N] matrix, got shape {tuple(w.shape)}")
    if jnp.dtype(w.dtype) not in _FLOATS:
        raise TypeError(f"{op}: w must be float16, bfloat16 or float32, got {w.dtype}")


def quantize_weight_per_channel(w, *, fp8_dtype=None, fp8_max=None, w_layout="nk"):
    """Symmetric per-output-channel FP8 quantization of a weight ``w [K, N]`` (``x @ w``).

    ``w_scale[n] = max_k |w[k, n]| / fp8_max`` and ``w_fp8 = round_to_nearest_even(w / w_scale)``;
    a column of zeros gets ``w_scale = 1`` (and zero codes); a column holding NaN gets a NaN scale;
    a column holding an infinity gets ``w_scale = inf`` (its finite entries' codes 0, the
    infinite ones NaN): such a weight has no FP8 form.

    Args:
      w: ``[K, N]`` float16 / bfloat16 / float32.
      fp8_dtype: default by device (``k3pallas.default_fp8_dtype``: e4m3fnuz on MI300-class
        gfx94x, e4m3fn elsewhere).
      fp8_max: default the format's per-token default (448 e4m3fn, 224 e4m3fnuz, 57344 e5m2).
      w_layout: how the codes are stored: ``"nk"`` (default, ``[N, K]``, transposed once here)
        or ``"kn"`` (``[K, N]`` like ``w``). ``"nk"`` is the fast one: the FP8 GEMMs of
        cuBLASLt (Hopper) and hipBLASLt read the weight with K contiguous, so with ``"kn"`` XLA
        transposes the weight in every call (twice the time on an H200: bench/NOTES.md).

    Returns: ``QuantizedWeight(data, scale [N] float32, layout)``: pass it to ``fp8_linear`` as
    it is (``w8, ws = ...`` also unpacks the two arrays).
    """
    op = "quantize_weight_per_channel"
    _check_weight_matrix(op, w)
    _check_layout(op, w_layout)
    try:
        q = fp8_lib.resolve_fp8_params(fp8_dtype, fp8_max, target=platform.current_target(w))
    except (TypeError, ValueError) as e:
        raise type(e)(f"{op}: {e}") from None
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=0)
    scale = jnp.where(amax > 0, amax / q.fp8_max, 1.0)
    scale = jnp.where(jnp.any(jnp.isnan(wf), axis=0), jnp.nan, scale)
    codes = jnp.clip(wf / scale, -q.fp8_max, q.fp8_max).astype(q.dtype)
    return QuantizedWeight(codes if w_layout == "kn" else codes.T, scale.astype(jnp.float32), w_layout)


def fp8_linear(qa, w_fp8, w_scale=None, *, out_dtype=jnp.bfloat16, w_layout=None, precision=None):
    """``dequant(qa) @ dequant(w)``: an FP8 x FP8 matmul with float32 accumulation.

    Args:
      qa: a ``QuantizedActivation`` (or a ``(data, scale)`` pair): ``data [..., K]`` fp8 and
        ``scale [..., G]`` float32, one scale per token for each of ``G`` equal column groups
        of ``data`` (``G = 1``: the per-token scale of ``per_token_fp8_quant`` and
        ``rmsnorm_gated_fp8_per_token``; ``G > 1``: one scale per head group, see
        ``rmsnorm_gated_fp8_per_token(scale_groups=...)``).
      w_fp8: the ``QuantizedWeight`` of ``quantize_weight_per_channel`` (its scale and layout
        come with it); or a bare fp8 array ``[K, N]`` (``w_layout="kn"``) or ``[N, K]``
        (``"nk"``), in the same fp8 dtype as ``data``, with ``w_scale`` and ``w_layout``.
      w_scale: with a bare ``w_fp8`` only: ``[N]`` float32 (per output channel) or a scalar
        (a Python float or a 0-d / ``[1]`` float32 array).
      out_dtype: float16, bfloat16 (default) or float32.
      w_layout: with a bare ``w_fp8``, required: ``"kn"`` or ``"nk"``, as it is stored (there is
        no default, so that a square weight cannot be read transposed by mistake).
      precision: passed to ``dot_general`` (default None: XLA's default). XLA maps it onto the
        FP8 GEMM's accumulation mode; see the README for what was measured on an H200.

    Returns: ``[..., N]`` in ``out_dtype``:
    ``sum_g (data_g @ w_g)_f32 * scale[..., g] * w_scale``, rounded once to ``out_dtype``.
    The fp8 operands go to ``dot_general`` as they are (``preferred_element_type=float32``);
    with ``G > 1`` it is one batched matmul over the groups and a sum.
    """
    op = "fp8_linear"
    if isinstance(w_fp8, QuantizedWeight):
        if w_scale is not None:
            raise TypeError(f"{op}: w_scale comes with the QuantizedWeight; do not pass it too")
        if w_layout not in (None, w_fp8.layout):
            raise ValueError(f"{op}: w_layout={w_layout!r} contradicts the QuantizedWeight's "
                             f"layout {w_fp8.layout!r}")
        w_fp8, w_scale, w_layout = w_fp8.data, w_fp8.scale, w_fp8.layout
    elif w_layout is None or w_scale is None:
        raise TypeError(f"{op}: a bare weight array needs w_scale and w_layout ('kn' or 'nk', as "
                        "it is stored); or pass the QuantizedWeight of quantize_weight_per_channel")
    if isinstance(w_scale, numbers.Real) and not isinstance(w_scale, bool):
        w_scale = jnp.float32(w_scale)
    try:
        data, scale = qa
    except (TypeError, ValueError):
        raise TypeError(f"{op}: qa must be a QuantizedActivation (data, scale), got "
                        f"{type(qa).__name__}") from None
    for name, a in (("qa.data", data), ("qa.scale", scale), ("w_fp8", w_fp8), ("w_scale", w_scale)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"{op}: {name} must be an array, got {type(a).__name__}")
    if jnp.dtype(scale.dtype) == jnp.dtype(jnp.float8_e8m0fnu):
        raise TypeError(f"{op}: qa is MX ({data.dtype} data, e8m0 scales); use mx_linear with a "
                        "weight from quantize_weight_mx")
    if jnp.dtype(data.dtype) not in fp8_lib.FP8_DTYPES:
        raise TypeError(f"{op}: qa.data must have an fp8 dtype, got {data.dtype}")
    if jnp.dtype(w_fp8.dtype) != jnp.dtype(data.dtype):
        raise TypeError(f"{op}: w_fp8 must have qa.data's fp8 dtype {data.dtype}, got {w_fp8.dtype}")
    _check_layout(op, w_layout)
    k_axis = 0 if w_layout == "kn" else 1
    if data.ndim < 1 or w_fp8.ndim != 2 or w_fp8.shape[k_axis] != data.shape[-1]:
        want = "[K, N]" if w_layout == "kn" else "[N, K]"
        raise ValueError(f"{op}: need qa.data [..., K] and w_fp8 {want} (w_layout={w_layout!r}) "
                         f"with the same K; got {tuple(data.shape)} and {tuple(w_fp8.shape)}")
    k, n = w_fp8.shape if w_layout == "kn" else w_fp8.shape[::-1]
    if scale.ndim != data.ndim or scale.shape[:-1] != data.shape[:-1]:
        raise ValueError(f"{op}: qa.scale must have shape data.shape[:-1] + (G,); got data "
                         f"{tuple(data.shape)} and scale {tuple(scale.shape)}")
    groups = scale.shape[-1]
    if groups < 1 or k % groups:
        raise ValueError(f"{op}: the {groups} scale groups of qa.scale must split K = {k} evenly")
    if jnp.dtype(scale.dtype) != jnp.dtype(jnp.float32) or jnp.dtype(w_scale.dtype) != jnp.dtype(jnp.float32):
        raise TypeError(f"{op}: qa.scale and w_scale must be float32; got {scale.dtype} and "
                        f"{w_scale.dtype}")
    if w_scale.shape not in ((), (1,), (n,)):
        raise ValueError(f"{op}: w_scale must have shape ({n},) or be a scalar; got "
                         f"{tuple(w_scale.shape)}")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in _FLOATS:
        raise TypeError(f"{op}: out_dtype must be float16, bfloat16 or float32, got {out_dtype}")

    lead = data.shape[:-1]
    if groups == 1:
        acc = lax.dot_general(data, w_fp8, (((data.ndim - 1,), (k_axis,)), ((), ())),
                              precision=precision, preferred_element_type=jnp.float32)
        acc = acc * scale
    else:
        kg = k // groups
        a3 = data.reshape(-1, groups, kg)  # [T, G, K/G]
        if w_layout == "kn":
            w3, dims = w_fp8.reshape(groups, kg, n), (((2,), (1,)), ((1,), (0,)))  # [G, K/G, N]
        else:
            w3, dims = w_fp8.reshape(n, groups, kg), (((2,), (2,)), ((1,), (1,)))  # [N, G, K/G]
        part = lax.dot_general(a3, w3, dims, precision=precision,
                               preferred_element_type=jnp.float32)  # [G, T, N]
        s = scale.reshape(-1, groups).T[:, :, None]  # [G, T, 1]
        acc = jnp.sum(part * s, axis=0).reshape(lead + (n,))
    return (acc * w_scale).astype(out_dtype)


def quantize_weight_mx(w, *, out_format="mxfp4"):
    """MX quantization of a weight ``w [K, N]`` (``x @ w``) along K, for ``mx_linear``.

    Per output channel ``n`` and block of 32 rows of K: jax's MX rule (``k3pallas.mx``), the
    same as the activations'. Returns ``QuantizedWeight(data [N, K] float4_e2m1fn |
    float8_e4m3fn, scale [N, K / 32] float8_e8m0fnu, layout "nk")``: the ``rhs`` and
    ``rhs_scales`` of ``jax.nn.scaled_matmul``, which reads K contiguous.
    """
    op = "quantize_weight_mx"
    _check_weight_matrix(op, w)
    if out_format not in mx_lib.MX_FORMATS:
        raise ValueError(f"{op}: out_format must be one of {mx_lib.MX_FORMATS}, got {out_format!r}")
    k, n = w.shape
    if k % mx_lib.BLOCK:
        raise ValueError(f"{op}: K ({k}) must be a multiple of {mx_lib.BLOCK} (one scale per block)")
    wt = w.astype(jnp.float32).T.reshape(n, k // mx_lib.BLOCK, mx_lib.BLOCK)
    data, scale = reference.mx_quantize(wt, mx_lib.MxParams(out_format))
    return QuantizedWeight(data.reshape(n, k), scale, "nk")


def mx_linear(qa, qw, *, out_dtype=jnp.bfloat16, impl="auto"):
    """``dequant(qa) @ dequant(qw)`` for MX operands: ``jax.nn.scaled_matmul`` on a GPU.

    Args:
      qa: the ``QuantizedActivation`` of an MX op (``out_format="mxfp8"`` / ``"mxfp4"``):
        ``data [..., K]``, ``scale [..., K / 32]`` float8_e8m0fnu.
      qw: the ``QuantizedWeight`` of ``quantize_weight_mx`` (``[N, K]``), same element dtype.
      out_dtype: float16, bfloat16 (default) or float32.
      impl: "auto" (``scaled_matmul`` on a GPU target, else the reference), "scaled_matmul"
        or "reference": the dequantized operands' float32 dot (``Precision.HIGHEST``), the
        same sums (``jax.nn.scaled_matmul`` has no CPU lowering).

    Returns: ``[..., N]`` in ``out_dtype`` (float32 accumulation, one rounding). On gfx950
    XLA compiles ``scaled_matmul`` to a Triton ``scaled-dot`` on the MX matrix cores
    (``v_mfma_scale_*``); elsewhere XLA dequantizes and runs a GEMM (bench/results/rocm_check.md).
    """
    op = "mx_linear"
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"{op}: qw must be the QuantizedWeight of quantize_weight_mx, got "
                        f"{type(qw).__name__}")
    try:
        data, scale = qa
    except (TypeError, ValueError):
        raise TypeError(f"{op}: qa must be a QuantizedActivation (data, scale), got "
                        f"{type(qa).__name__}") from None
    e8m0 = jnp.dtype(jnp.float8_e8m0fnu)
    if jnp.dtype(scale.dtype) != e8m0 or jnp.dtype(qw.scale.dtype) != e8m0:
        raise TypeError(f"{op}: qa and qw must be MX (float8_e8m0fnu scales; got {scale.dtype} "
                        f"and {qw.scale.dtype}); per-token FP8 goes to fp8_linear")
    if jnp.dtype(data.dtype) != jnp.dtype(qw.data.dtype):
        raise TypeError(f"{op}: qa.data ({data.dtype}) and qw.data ({qw.data.dtype}) must be the "
                        "same MX element format")
    n, k = qw.data.shape
    if data.shape[-1] != k or scale.shape != data.shape[:-1] + (k // mx_lib.BLOCK,):
        raise ValueError(f"{op}: need qa.data [..., K], qa.scale [..., K / 32] and qw [N, K]; got "
                         f"{tuple(data.shape)}, {tuple(scale.shape)} and {tuple(qw.data.shape)}")
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in _FLOATS:
        raise TypeError(f"{op}: out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    if impl not in ("auto", "scaled_matmul", "reference"):
        raise ValueError(f"{op}: impl must be 'auto', 'scaled_matmul' or 'reference', got {impl!r}")
    if impl == "auto":
        impl = "scaled_matmul" if platform.current_target(data).is_gpu else "reference"
    lead = data.shape[:-1]
    if impl == "reference":
        a = fp8_lib.QuantizedActivation(data, scale).dequantize()
        out = jnp.dot(a.reshape(-1, k), qw.dequantize(), precision=lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)
    else:
        out = jax.nn.scaled_matmul(data.reshape(1, -1, k), qw.data[None], scale.reshape(1, -1, k // mx_lib.BLOCK),
                                   qw.scale[None], preferred_element_type=jnp.float32)
    return out.reshape(lead + (n,)).astype(out_dtype)
