"""Two Kimi-K3 blocks in plain JAX, with random weights, runnable under ``jax.jit``:

* the MLA front-end: hidden ``[T, 7168]`` -> one fused projection to ``[T, 1536 + 512 + 64]``
  -> ``mla_q_kv_norm`` (q and kv latents normalized, rope part passed) -> the q_b projection to
  ``[T, heads, 128 + 64]``;
* the Kimi Delta Attention output path: attention output and gate ``[T, H, 128]`` ->
  ``rmsnorm_gated`` with per-token FP8 -> FP8 o_proj (``linear`` with a per-channel FP8 weight)
  -> ``[T, 7168]``; with H = 96 (the whole layer) or 12 (one rank of TP8, whose o_proj output is
  the rank's partial sum before the all-reduce);
* both output paths also as MXFP4 (the MI355X route): ``rmsnorm_gated`` / ``sigmoid_mul`` with
  ``out_format="mxfp4"`` -> ``linear`` (``jax.nn.scaled_matmul``) with an MXFP4 copy of the
  o_proj weight (``kda_out_mx`` / ``mla_out_mx``), and as group FP8 with a 128 x 128 block
  weight, the layout of the block-FP8 checkpoints (``kda_out_group`` / ``mla_out_group``; the
  front-end's q_b with ``q_group=True``).

The decoder layer's residual adds: ``decoder_attention_in`` (the residual add and input norm in
one launch, then the front-end) and ``mlp_in`` (the residual add, post-attention norm and group
FP8 in one launch, then DeepSeek-V3's block-FP8 gate / up projections at TP8).

Each has a bf16 reference path (slices and jnp norms; ``rmsnorm_gated`` in bf16 and a bf16
o_proj). ``python -m k3pallas.models.kimi_k3`` runs them and prints the relative error of each
path against its reference (and, for scale, of the bf16 path against float32).

Sizes: hidden 7168, q/kv LoRA ranks 1536 / 512, rope 64, KDA head dim 128 (Kimi-K3 as in the
serving work this package ports). The MLA head count (64, q_b output 64 x 192) is Kimi-K2's;
it only sets the size of the q_b matmul.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp

import k3pallas as kp


@dataclasses.dataclass(frozen=True)
class Config:
    hidden: int = 7168
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    rope_dim: int = 64
    nope_dim: int = 128
    mla_heads: int = 64
    mla_eps: float = 1e-6
    kda_heads: int = 96
    kda_head_dim: int = 128
    kda_eps: float = 1e-5
    rms_eps: float = 1e-6  # the decoder layer's input and post-attention norms
    mlp_inter: int = 18432  # DeepSeek-V3's dense MLP (its first 3 layers); 2304 per TP8 rank
    tp: int = 1  # tensor-parallel ranks the MLP's intermediate size is split over

    @property
    def qkv_a_width(self) -> int:
        return self.q_lora_rank + self.kv_lora_rank + self.rope_dim


KIMI_K3 = Config()
KIMI_K3_TP8 = dataclasses.replace(KIMI_K3, kda_heads=12, tp=8)  # one rank's KDA heads at TP8


def _dense(key, fan_in, fan_out, dtype):
    return (jax.random.normal(key, (fan_in, fan_out), jnp.float32) / fan_in**0.5).astype(dtype)


# ------------------------------------------------------------------------------------------------
# MLA front-end
# ------------------------------------------------------------------------------------------------


def init_mla_front(key, cfg: Config = KIMI_K3, dtype=jnp.bfloat16, fp8_dtype=None) -> dict:
    k = jax.random.split(key, 5)
    w_q_b = _dense(k[3], cfg.q_lora_rank, cfg.mla_heads * (cfg.nope_dim + cfg.rope_dim), dtype)
    return {
        "input_norm": (1 + 0.1 * jax.random.normal(k[4], (cfg.hidden,))).astype(dtype),
        "w_qkv_a": _dense(k[0], cfg.hidden, cfg.qkv_a_width, dtype),
        "q_norm": (1 + 0.1 * jax.random.normal(k[1], (cfg.q_lora_rank,))).astype(dtype),
        "kv_norm": (1 + 0.1 * jax.random.normal(k[2], (cfg.kv_lora_rank,))).astype(dtype),
        "w_q_b": w_q_b, "w_q_b_fp8": kp.quantize_weight(w_q_b, kp.Fp8PerToken(fp8_dtype)),
        "w_q_b_group": kp.quantize_weight(w_q_b, kp.Fp8Group(fp8_dtype)),
    }


# ------------------------------------------------------------------------------------------------
# MLA output path (gated attention output -> FP8 o_proj)
# ------------------------------------------------------------------------------------------------


def init_mla_out(key, cfg: Config = KIMI_K3, dtype=jnp.bfloat16, fp8_dtype=None,
                 heads: int | None = None) -> dict:
    """The MLA o_proj ``[H * 128, hidden]`` (H = ``heads``, default ``cfg.kda_heads``: 96, or 12
    per TP8 rank), its per-channel FP8 copy and its MXFP4 copy (``QuantizedWeight``s, "nk")."""
    heads = cfg.kda_heads if heads is None else heads
    w_o = _dense(key, heads * cfg.kda_head_dim, cfg.hidden, dtype)
    return {"w_o": w_o, "w_o_fp8": kp.quantize_weight(w_o, kp.Fp8PerToken(fp8_dtype)),
            "w_o_mx": kp.quantize_weight(w_o, "mxfp4"),
            "w_o_group": kp.quantize_weight(w_o, kp.Fp8Group(fp8_dtype))}


def mla_out_mx(params: dict, attn, gate, *, impl: str = "auto", out_dtype=jnp.bfloat16):
    """As ``mla_out_fp8`` with MX: ``sigmoid_mul`` (one launch) in the format of
    ``params["w_o_mx"]`` (MXFP4 from ``init_mla_out``), then ``linear``."""
    w = params["w_o_mx"]
    qa = kp.sigmoid_mul(attn, gate, out_format=w.format, impl=impl)
    return kp.linear(qa, w, out_dtype=out_dtype)


def mla_out_group(params: dict, attn, gate, *, impl: str = "auto", out_dtype=jnp.bfloat16,
                  linear_impl: str = "auto"):
    """As ``mla_out_fp8`` with group FP8 (the block-FP8 checkpoints' layout): ``sigmoid_mul``
    (one launch, a scale per group of 128) in the format of ``params["w_o_group"]``, then
    ``linear`` (``linear_impl``: its lowering) with the 128 x 128 block weight."""
    w = params["w_o_group"]
    qa = kp.sigmoid_mul(attn, gate, out_format=w.format, impl=impl)
    return kp.linear(qa, w, out_dtype=out_dtype, impl=linear_impl)


def _per_token(w: kp.QuantizedWeight) -> kp.Fp8PerToken:
    """The activation format matching a per-channel FP8 weight: its element dtype."""
    return kp.Fp8PerToken(w.format.dtype)


def mla_out_fp8(params: dict, attn, gate, *, impl: str = "auto", out_dtype=jnp.bfloat16,
                fp8_cast=None):
    """``attn, gate [T, H * 128]`` -> ``[T, hidden]``: Kimi-K3's MLA output gate
    ``attn * sigmoid(gate)`` fused with per-token FP8 (``sigmoid_mul``, one launch), then the FP8
    o_proj. ``fp8_cast``: passed to the FP8 op."""
    w = params["w_o_fp8"]
    qa = kp.sigmoid_mul(attn, gate, out_format=_per_token(w), fp8_cast=fp8_cast, impl=impl)
    return kp.linear(qa, w, out_dtype=out_dtype)


def mla_out_reference(params: dict, attn, gate, *, dtype=jnp.bfloat16):
    """The bf16 reference: the gate in ``dtype``, then a ``dtype`` o_proj (float32 accumulation)."""
    y = (attn.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(dtype)
    return jnp.dot(y, params["w_o"].astype(dtype), preferred_element_type=jnp.float32).astype(dtype)


def mla_front(params: dict, x, *, cfg: Config = KIMI_K3, impl: str = "auto", q_fp8: bool = False,
              q_group: bool = False):
    """``x [T, hidden]`` -> ``(q [T, heads, 192], kv_c [T, 512], k_pe [T, 64])``.

    ``impl="reference"`` is the bf16 reference path: XLA slices the packed projection and runs
    the jnp norms. ``q_fp8=True``: the norm quantizes q to per-token FP8 in the same launch
    (``mla_q_kv_norm`` with ``out_format``) and q_b is an FP8 matmul with the per-channel FP8
    copy of its weight (``params["w_q_b_fp8"]``, from ``init_mla_front``). ``q_group=True``:
    the same with group FP8 and the 128 x 128 block copy (``params["w_q_b_group"]``), the
    layout of the block-FP8 checkpoints.
    """
    qkv_a = jnp.dot(x, params["w_qkv_a"], preferred_element_type=jnp.float32).astype(x.dtype)
    norm_args = (qkv_a, params["q_norm"], params["kv_norm"], cfg.mla_eps)
    sizes = dict(q_size=cfg.q_lora_rank, kv_size=cfg.kv_lora_rank, impl=impl)
    if q_fp8 or q_group:
        w = params["w_q_b_group"] if q_group else params["w_q_b_fp8"]
        fmt = w.format if q_group else _per_token(w)
        qa, kv_c, k_pe = kp.mla_q_kv_norm(*norm_args, out_format=fmt, **sizes)
        q = kp.linear(qa, w, out_dtype=x.dtype)
    else:
        q_c, kv_c, k_pe = kp.mla_q_kv_norm(*norm_args, **sizes)
        q = jnp.dot(q_c, params["w_q_b"], preferred_element_type=jnp.float32).astype(x.dtype)
    return q.reshape(x.shape[0], cfg.mla_heads, cfg.nope_dim + cfg.rope_dim), kv_c, k_pe


def decoder_attention_in(params: dict, x, residual, *, cfg: Config = KIMI_K3, impl: str = "auto",
                         q_group: bool = False):
    """The decoder layer's way into attention: ``residual = x + residual`` and its input norm in
    ONE launch (``add_rmsnorm``: the new residual written over the old one's buffer), then the
    MLA front-end (``mla_front``) on the normalized hidden state. ``x``: the previous layer's
    output (the embeddings' zeros for the first), ``[T, hidden]``. Returns ``(q, kv_c, k_pe,
    residual)``. ``impl="reference"``: XLA's add and norm, then the reference front-end."""
    h, residual = kp.add_rmsnorm(x, residual, params["input_norm"], cfg.rms_eps, impl=impl)
    return (*mla_front(params, h, cfg=cfg, impl=impl, q_group=q_group), residual)


# ------------------------------------------------------------------------------------------------
# MLP input (DeepSeek-V3 dense MLP, block-FP8 as its checkpoints store it)
# ------------------------------------------------------------------------------------------------


def init_mlp_in(key, cfg: Config = KIMI_K3, dtype=jnp.bfloat16, fp8_dtype=None) -> dict:
    """The post-attention norm and the gate and up projections ``[hidden, 2 * inter / tp]`` in
    bf16 and as a 128 x 128 block-FP8 weight (the layout of the DeepSeek-V3 / Kimi-K2 FP8
    checkpoints)."""
    k = jax.random.split(key, 2)
    w = _dense(k[1], cfg.hidden, 2 * cfg.mlp_inter // cfg.tp, dtype)
    return {"post_attention_norm": (1 + 0.1 * jax.random.normal(k[0], (cfg.hidden,))).astype(dtype),
            "w_gate_up": w, "w_gate_up_group": kp.quantize_weight(w, kp.Fp8Group(fp8_dtype))}


def mlp_in(params: dict, attn_out, residual, *, cfg: Config = KIMI_K3, impl: str = "auto",
           out_dtype=jnp.bfloat16):
    """``residual = attn_out + residual``, its post-attention norm and the group-FP8 quantization
    of the result in ONE launch (``add_rmsnorm`` with the weight's format), then the block-FP8
    gate and up projections (``linear``) and SiLU-and-mul: ``(act [T, inter / tp], residual)``.
    ``impl="reference"``: the bf16 path (XLA's add and norm, a bf16 GEMM)."""
    if impl == "reference":
        h, residual = kp.add_rmsnorm(attn_out, residual, params["post_attention_norm"],
                                     cfg.rms_eps, impl="reference")
        gate_up = jnp.dot(h, params["w_gate_up"], preferred_element_type=jnp.float32)
    else:
        w = params["w_gate_up_group"]
        qa, residual = kp.add_rmsnorm(attn_out, residual, params["post_attention_norm"],
                                      cfg.rms_eps, out_format=w.format, impl=impl)
        gate_up = kp.linear(qa, w, out_dtype=jnp.float32)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(out_dtype), residual


# ------------------------------------------------------------------------------------------------
# KDA output path
# ------------------------------------------------------------------------------------------------


def init_kda_out(key, cfg: Config = KIMI_K3, dtype=jnp.bfloat16, fp8_dtype=None) -> dict:
    """Norm weight, bf16 o_proj ``[H * 128, hidden]`` and its per-channel FP8 copy, stored
    ``[hidden, H * 128]`` (layout "nk": what the FP8 GEMMs read without a transpose), and its
    MXFP4 copy (the MI355X o_proj route)."""
    k = jax.random.split(key, 2)
    w_o = _dense(k[1], cfg.kda_heads * cfg.kda_head_dim, cfg.hidden, dtype)
    return {
        "norm": (1 + 0.1 * jax.random.normal(k[0], (cfg.kda_head_dim,))).astype(jnp.float32),
        "w_o": w_o, "w_o_fp8": kp.quantize_weight(w_o, kp.Fp8PerToken(fp8_dtype)),
        "w_o_mx": kp.quantize_weight(w_o, "mxfp4"),
        "w_o_group": kp.quantize_weight(w_o, kp.Fp8Group(fp8_dtype)),
    }


def kda_out_fp8(params: dict, o, gate, *, cfg: Config = KIMI_K3, impl: str = "auto",
                fused: bool = True, out_dtype=jnp.bfloat16, fp8_cast=None):
    """``o, gate [T, H, 128]`` -> ``[T, hidden]``: gated norm + per-token FP8 + FP8 o_proj.

    ``fused=False`` runs the unfused k3pallas path (``rmsnorm_gated`` to bf16, then
    ``quantize``), for the benchmark. ``fp8_cast``: passed to the FP8 op.
    """
    w = params["w_o_fp8"]
    fp8 = dict(out_format=_per_token(w), fp8_cast=fp8_cast, impl=impl)
    if fused:
        qa = kp.rmsnorm_gated(o, params["norm"], gate, cfg.kda_eps, **fp8)
    else:
        y = kp.rmsnorm_gated(o, params["norm"], gate, cfg.kda_eps, impl=impl)
        qa = kp.quantize(y.reshape(y.shape[0], -1), **fp8)
    return kp.linear(qa, w, out_dtype=out_dtype)


def kda_out_mx(params: dict, o, gate, *, cfg: Config = KIMI_K3, impl: str = "auto",
               out_dtype=jnp.bfloat16):
    """``o, gate [T, H, 128]`` -> ``[T, hidden]``: the gated norm fused with MX (one launch; a
    block of 32 never crosses a head) in the format of ``params["w_o_mx"]`` (MXFP4 from
    ``init_kda_out``), then ``linear``."""
    w = params["w_o_mx"]
    qa = kp.rmsnorm_gated(o, params["norm"], gate, cfg.kda_eps, out_format=w.format, impl=impl)
    return kp.linear(qa, w, out_dtype=out_dtype)


def kda_out_group(params: dict, o, gate, *, cfg: Config = KIMI_K3, impl: str = "auto",
                  out_dtype=jnp.bfloat16, linear_impl: str = "auto"):
    """``o, gate [T, H, 128]`` -> ``[T, hidden]``: the gated norm fused with group FP8 (one
    launch; a group of 128 is one head) in the format of ``params["w_o_group"]``, then
    ``linear`` (``linear_impl``: its lowering) with the 128 x 128 block weight."""
    w = params["w_o_group"]
    qa = kp.rmsnorm_gated(o, params["norm"], gate, cfg.kda_eps, out_format=w.format, impl=impl)
    return kp.linear(qa, w, out_dtype=out_dtype, impl=linear_impl)


def kda_out_reference(params: dict, o, gate, *, cfg: Config = KIMI_K3, dtype=jnp.bfloat16):
    """The bf16 reference path: jnp gated norm in ``dtype``, then a ``dtype`` o_proj (float32
    accumulation). ``dtype=float32`` (inputs and weight upcast) gives the float32 path."""
    y = kp.rmsnorm_gated(o.astype(dtype), params["norm"], gate.astype(dtype), cfg.kda_eps,
                         impl="reference")
    y = y.reshape(y.shape[0], -1)
    return jnp.dot(y, params["w_o"].astype(dtype), preferred_element_type=jnp.float32).astype(dtype)


# ------------------------------------------------------------------------------------------------
# Running them
# ------------------------------------------------------------------------------------------------


def rel_error(a, b) -> float:
    """``||a - b|| / ||b||`` over all elements, in float32."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def run(tokens: int = 64, impl: str = "auto", seed: int = 0, cfg: Config = KIMI_K3,
        kda_heads=(12, 96), log=print) -> dict:
    """Build both blocks with random weights, run every path under ``jax.jit``, return errors."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 8)
    bf = jnp.bfloat16
    results = {}
    mla = init_mla_front(keys[0], cfg)
    x = jax.random.normal(keys[1], (tokens, cfg.hidden), jnp.float32).astype(bf)
    t0 = time.perf_counter()
    q, kv, pe = jax.block_until_ready(jax.jit(lambda p, x: mla_front(p, x, cfg=cfg, impl=impl))(mla, x))
    q_r, kv_r, pe_r = jax.jit(lambda p, x: mla_front(p, x, cfg=cfg, impl="reference"))(mla, x)
    results["mla_front"] = {"q": rel_error(q, q_r), "kv_c": rel_error(kv, kv_r),
                            "k_pe": rel_error(pe, pe_r), "seconds": time.perf_counter() - t0}
    log(f"MLA front-end  T={tokens} hidden={cfg.hidden} qkv_a={cfg.qkv_a_width} impl={impl}: "
        f"q {tuple(q.shape)}; rel. error vs the bf16 reference path: q {results['mla_front']['q']:.2e}, "
        f"kv_c {results['mla_front']['kv_c']:.2e}, k_pe {results['mla_front']['k_pe']:.2e}")
    q8, _, _ = jax.jit(lambda p, x: mla_front(p, x, cfg=cfg, impl=impl, q_fp8=True))(mla, x)
    results["mla_front"]["q_fp8_vs_bf16"] = rel_error(q8, q_r)
    qg, _, _ = jax.jit(lambda p, x: mla_front(p, x, cfg=cfg, impl=impl, q_group=True))(mla, x)
    results["mla_front"]["q_group_vs_bf16"] = rel_error(qg, q_r)
    log(f"MLA front-end with FP8 q (q_b as an FP8 matmul): rel. error of q vs the bf16 path "
        f"{results['mla_front']['q_fp8_vs_bf16']:.2e}; with group FP8 (block-FP8 q_b) "
        f"{results['mla_front']['q_group_vs_bf16']:.2e}")
    r0 = jax.random.normal(keys[5], (tokens, cfg.hidden), jnp.float32).astype(bf)
    got = jax.jit(lambda p, x, r: decoder_attention_in(p, x, r, cfg=cfg, impl=impl))(mla, x, r0)
    want = jax.jit(lambda p, x, r: decoder_attention_in(p, x, r, cfg=cfg, impl="reference"))(mla, x, r0)
    results["decoder_attention_in"] = {"q": rel_error(got[0], want[0]),
                                       "residual": rel_error(got[3], want[3])}
    log(f"decoder layer into attention (residual add + input norm, one launch; then the front-end): "
        f"rel. error vs the reference path: q {results['decoder_attention_in']['q']:.2e}, "
        f"residual {results['decoder_attention_in']['residual']:.2e}")
    tp8 = dataclasses.replace(cfg, tp=8)
    mlp = init_mlp_in(keys[6], tp8)
    a, b = jax.jit(lambda p, x, r: mlp_in(p, x, r, cfg=tp8, impl=impl))(mlp, x, r0)
    a_r, b_r = jax.jit(lambda p, x, r: mlp_in(p, x, r, cfg=tp8, impl="reference"))(mlp, x, r0)
    results["mlp_in_group_tp8"] = {"act_vs_bf16": rel_error(a, a_r), "residual": rel_error(b, b_r)}
    log(f"MLP input at TP8 (residual add + norm + group FP8 in one launch, block-FP8 gate/up): rel. "
        f"error vs the bf16 path {results['mlp_in_group_tp8']['act_vs_bf16']:.2e}, residual "
        f"{results['mlp_in_group_tp8']['residual']:.2e}")
    for i, heads in enumerate(kda_heads):
        params = init_mla_out(keys[4 + i], cfg, heads=heads)
        k = jax.random.split(keys[7 - i % 2], 2)
        n = heads * cfg.kda_head_dim
        a = jax.random.normal(k[0], (tokens, n), jnp.float32).astype(bf)
        g = jax.random.normal(k[1], (tokens, n), jnp.float32).astype(bf)
        y8 = jax.jit(lambda p, a, g: mla_out_fp8(p, a, g, impl=impl))(params, a, g)
        y16 = jax.jit(lambda p, a, g: mla_out_reference(p, a, g))(params, a, g)
        y4 = jax.jit(lambda p, a, g: mla_out_mx(p, a, g, impl=impl))(params, a, g)
        yg = jax.jit(lambda p, a, g: mla_out_group(p, a, g, impl=impl))(params, a, g)
        results[f"mla_out_{heads}x{cfg.kda_head_dim}"] = {"fp8_vs_bf16": rel_error(y8, y16),
                                                         "mxfp4_vs_bf16": rel_error(y4, y16),
                                                         "group_vs_bf16": rel_error(yg, y16)}
        log(f"MLA output gate + FP8 o_proj {heads}x{cfg.kda_head_dim} -> {cfg.hidden}: rel. error "
            f"FP8 path vs bf16 path {rel_error(y8, y16):.2e}; MXFP4 path {rel_error(y4, y16):.2e}; "
            f"group FP8 path {rel_error(yg, y16):.2e}")
    for i, heads in enumerate(kda_heads):
        c = dataclasses.replace(cfg, kda_heads=heads)
        params = init_kda_out(keys[2 + i], c)
        k = jax.random.split(keys[6 + i % 2], 2)
        o = jax.random.normal(k[0], (tokens, heads, c.kda_head_dim), jnp.float32).astype(bf)
        g = jax.random.normal(k[1], (tokens, heads, c.kda_head_dim), jnp.float32).astype(bf)
        t0 = time.perf_counter()
        y8 = jax.jit(lambda p, o, g: kda_out_fp8(p, o, g, cfg=c, impl=impl))(params, o, g)
        y16 = jax.jit(lambda p, o, g: kda_out_reference(p, o, g, cfg=c))(params, o, g)
        y32 = jax.jit(lambda p, o, g: kda_out_reference(p, o, g, cfg=c, dtype=jnp.float32))(params, o, g)
        y4 = jax.jit(lambda p, o, g: kda_out_mx(p, o, g, cfg=c, impl=impl))(params, o, g)
        yg = jax.jit(lambda p, o, g: kda_out_group(p, o, g, cfg=c, impl=impl))(params, o, g)
        r = {"fp8_vs_bf16": rel_error(y8, y16), "fp8_vs_f32": rel_error(y8, y32),
             "mxfp4_vs_bf16": rel_error(y4, y16), "group_vs_f32": rel_error(yg, y32),
             "bf16_vs_f32": rel_error(y16, y32), "seconds": time.perf_counter() - t0,
             "fp8_dtype": str(params["w_o_fp8"].data.dtype)}
        results[f"kda_out_{heads}x{c.kda_head_dim}"] = r
        log(f"KDA output {heads}x{c.kda_head_dim} -> {c.hidden}  T={tokens} impl={impl} "
            f"({r['fp8_dtype']}): rel. error FP8 path vs bf16 path {r['fp8_vs_bf16']:.2e} "
            f"(FP8 vs f32 {r['fp8_vs_f32']:.2e}; bf16 vs f32 {r['bf16_vs_f32']:.2e}); MXFP4 path "
            f"vs bf16 path {r['mxfp4_vs_bf16']:.2e}; group FP8 vs f32 {r['group_vs_f32']:.2e}")
    return results


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def main(argv=None):
    p = argparse.ArgumentParser(description="Run the Kimi-K3 MLA front-end and KDA output blocks.")
    p.add_argument("--tokens", type=_positive_int, default=64)
    p.add_argument("--impl", default="auto", choices=("auto", "pallas", "interpret", "reference"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    target = kp.current_target()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; target {target.arch}")
    if args.impl == "reference" or (args.impl == "auto" and not target.is_gpu):
        print("note: the paths run the jnp reference here (impl=auto without a GPU), so they are "
              "compared with themselves except for FP8; --impl interpret runs the kernels on the CPU")
    run(args.tokens, args.impl, args.seed)


if __name__ == "__main__":
    main()
