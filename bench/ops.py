"""What the benchmark measures for each op: its inputs, its variants and its minimum bytes.

Variants (same inputs, same process):

* ``k3pallas``: the fused k3pallas kernel (one launch);
* ``unfused``: the k3pallas path without the fusion (two ``rmsnorm`` launches; ``rmsnorm_gated``
  then ``per_token_fp8_quant``), where the op has one;
* ``xla``: the jnp reference compiled by XLA (what a JAX user gets without this package);
* ``copy``: a device-to-device copy moving the same number of bytes, the bandwidth ceiling;
* ``encoder`` (FP8 ops): the fused kernel with ``fp8_cast="encoder"``, the integer encoder in
  place of the native conversion (what gfx942 runs without the native path).

Two integration paths are measured the same way: ``mla_q_kv_norm`` on the packed MLA projection
(``unfused`` there: XLA slices the packed rows, then ``fused_q_kv_rmsnorm``), and
``kda_output_fp8``, the KDA output path up to the FP8 o_proj (``k3pallas``: the fused gated FP8
kernel then ``fp8_linear``; ``unfused``: ``rmsnorm_gated``, ``per_token_fp8_quant``, then
``fp8_linear``; ``xla``: the jnp norm and quant, then ``fp8_linear``; ``bf16``: the jnp gated
norm in bf16 and a bf16 o_proj). The o_proj GEMM dominates there, so "% copy" says little.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

import k3pallas as kp
from k3pallas import platform
from k3pallas.kernels import gated_fp8, rmsnorm as rmsnorm_kernels

from bench import shapes


@dataclasses.dataclass
class Case:
    op: str
    config: str
    tokens: int
    dtype: str
    make_inputs: Callable[[int], tuple]  # seed -> one input set
    variants: dict  # name -> jitted fn
    bytes_moved: int  # each input read once, each output written once
    input_bytes: int
    launch: platform.LaunchConfig | None  # the config the k3pallas kernel picks here


def _rand(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _nbytes(shape, dtype):
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def make_case(op: str, config_name: str, tokens: int, dtype: str, impl: str) -> Case:
    """Build the case; ``impl`` is "pallas" on a GPU and "interpret" on the CPU."""
    dt = jnp.dtype(dtype)
    cfg = shapes.config(config_name)
    fp8_dtype = kp.default_fp8_dtype()
    j = jax.jit

    if op in ("fused_q_kv_rmsnorm", "rmsnorm"):
        dq, dkv, eps = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.eps
        if op == "fused_q_kv_rmsnorm":
            def make(seed):
                k = jax.random.split(jax.random.PRNGKey(seed), 4)
                return (_rand(k[0], (tokens, dq), dt), _rand(k[1], (tokens, dkv), dt),
                        _rand(k[2], (dq,), dt), _rand(k[3], (dkv,), dt))
            variants = {
                "k3pallas": j(lambda q, kv, wq, wkv: kp.fused_q_kv_rmsnorm(q, kv, wq, wkv, eps, impl=impl)),
                "unfused": j(lambda q, kv, wq, wkv: (kp.rmsnorm(q, wq, eps, impl=impl),
                                                     kp.rmsnorm(kv, wkv, eps, impl=impl))),
                "xla": j(lambda q, kv, wq, wkv: kp.fused_q_kv_rmsnorm(q, kv, wq, wkv, eps,
                                                                      impl="reference")),
            }
            inb = _nbytes((tokens, dq + dkv), dt) + _nbytes((dq + dkv,), dt)
            outb = _nbytes((tokens, dq + dkv), dt)
            launch = platform.launch_config(op, tokens, *rmsnorm_kernels.row_elems((dq, dkv)))
        else:
            def make(seed):
                k = jax.random.split(jax.random.PRNGKey(seed), 2)
                return _rand(k[0], (tokens, dq), dt), _rand(k[1], (dq,), dt)
            variants = {
                "k3pallas": j(lambda x, w: kp.rmsnorm(x, w, eps, impl=impl)),
                "xla": j(lambda x, w: kp.rmsnorm(x, w, eps, impl="reference")),
            }
            inb = _nbytes((tokens, dq), dt) + _nbytes((dq,), dt)
            outb = _nbytes((tokens, dq), dt)
            launch = platform.launch_config(op, tokens, *rmsnorm_kernels.row_elems((dq,)))
    elif op in ("rmsnorm_gated", "rmsnorm_gated_fp8_per_token"):
        h, d, eps = cfg.heads, cfg.head_dim, cfg.eps

        def make(seed):
            k = jax.random.split(jax.random.PRNGKey(seed), 3)
            return (_rand(k[0], (tokens, h, d), dt), _rand(k[1], (d,), jnp.float32),
                    _rand(k[2], (tokens, h, d), dt))
        inb = 2 * _nbytes((tokens, h, d), dt) + _nbytes((d,), jnp.float32)
        if op == "rmsnorm_gated":
            variants = {
                "k3pallas": j(lambda x, w, g: kp.rmsnorm_gated(x, w, g, eps, impl=impl)),
                "xla": j(lambda x, w, g: kp.rmsnorm_gated(x, w, g, eps, impl="reference")),
            }
            outb = _nbytes((tokens, h, d), dt)
            launch = platform.launch_config("rmsnorm_gated", tokens, *gated_fp8.gated_row_elems(h, d))
        else:
            def unfused(x, w, g):
                y = kp.rmsnorm_gated(x, w, g, eps, impl=impl)
                return kp.per_token_fp8_quant(y.reshape(tokens, h * d), fp8_dtype=fp8_dtype, impl=impl)
            variants = {
                "k3pallas": j(lambda x, w, g: kp.rmsnorm_gated_fp8_per_token(
                    x, w, g, eps, fp8_dtype=fp8_dtype, impl=impl)),
                "encoder": j(lambda x, w, g: kp.rmsnorm_gated_fp8_per_token(
                    x, w, g, eps, fp8_dtype=fp8_dtype, fp8_cast="encoder", impl=impl)),
                "unfused": j(unfused),
                "xla": j(lambda x, w, g: kp.rmsnorm_gated_fp8_per_token(
                    x, w, g, eps, fp8_dtype=fp8_dtype, impl="reference")),
            }
            outb = tokens * h * d + 4 * tokens
            launch = platform.launch_config("rmsnorm_gated_fp8", tokens, *gated_fp8.gated_row_elems(h, d))
    elif op == "per_token_fp8_quant":
        n = cfg.heads * cfg.head_dim

        def make(seed):
            return (_rand(jax.random.PRNGKey(seed), (tokens, n), dt),)
        variants = {
            "k3pallas": j(lambda x: kp.per_token_fp8_quant(x, fp8_dtype=fp8_dtype, impl=impl)),
            "encoder": j(lambda x: kp.per_token_fp8_quant(x, fp8_dtype=fp8_dtype,
                                                          fp8_cast="encoder", impl=impl)),
            "xla": j(lambda x: kp.per_token_fp8_quant(x, fp8_dtype=fp8_dtype, impl="reference")),
        }
        inb = _nbytes((tokens, n), dt)
        outb = tokens * n + 4 * tokens
        launch = platform.launch_config(op, tokens, *gated_fp8.quant_row_elems(n))
    elif op == "mla_q_kv_norm":
        dq, dkv, rope, eps = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.rope_dim, cfg.eps
        width = dq + dkv + rope

        def make(seed):
            k = jax.random.split(jax.random.PRNGKey(seed), 3)
            return (_rand(k[0], (tokens, width), dt), _rand(k[1], (dq,), dt), _rand(k[2], (dkv,), dt))

        def sliced(a, wq, wkv):
            q, kv = kp.fused_q_kv_rmsnorm(a[:, :dq], a[:, dq:dq + dkv], wq, wkv, eps, impl=impl)
            return q, kv, a[:, dq + dkv:]
        variants = {
            "k3pallas": j(lambda a, wq, wkv: kp.mla_q_kv_norm(a, wq, wkv, eps, q_size=dq,
                                                              kv_size=dkv, impl=impl)),
            "unfused": j(sliced),
            "xla": j(lambda a, wq, wkv: kp.mla_q_kv_norm(a, wq, wkv, eps, q_size=dq, kv_size=dkv,
                                                         impl="reference")),
        }
        inb = _nbytes((tokens, width), dt) + _nbytes((dq + dkv,), dt)
        outb = _nbytes((tokens, width), dt)
        launch = platform.launch_config(op, tokens, *rmsnorm_kernels.row_elems((dq, dkv, rope)))
    elif op == "kda_output_fp8":
        h, d, eps, hidden = cfg.heads, cfg.head_dim, cfg.eps, cfg.hidden
        # One weight for every input set (it is a parameter; rotation applies to activations).
        w_o = _rand(jax.random.PRNGKey(1234), (h * d, hidden), dt) * (h * d) ** -0.5
        w8, ws = kp.quantize_weight_per_channel(w_o, fp8_dtype=fp8_dtype, w_layout="nk")

        def make(seed):
            k = jax.random.split(jax.random.PRNGKey(seed), 3)
            return (_rand(k[0], (tokens, h, d), dt), _rand(k[1], (d,), jnp.float32),
                    _rand(k[2], (tokens, h, d), dt), w8, ws, w_o)

        def o_proj(qa, w8, ws):
            return kp.fp8_linear(qa, w8, ws, out_dtype=dt, w_layout="nk")

        def fused(x, w, g, w8, ws, w_o):
            return o_proj(kp.rmsnorm_gated_fp8_per_token(x, w, g, eps, fp8_dtype=fp8_dtype,
                                                         impl=impl), w8, ws)

        def unfused(x, w, g, w8, ws, w_o):
            y = kp.rmsnorm_gated(x, w, g, eps, impl=impl).reshape(tokens, h * d)
            return o_proj(kp.per_token_fp8_quant(y, fp8_dtype=fp8_dtype, impl=impl), w8, ws)

        def xla(x, w, g, w8, ws, w_o):
            return o_proj(kp.rmsnorm_gated_fp8_per_token(x, w, g, eps, fp8_dtype=fp8_dtype,
                                                         impl="reference"), w8, ws)

        def bf16(x, w, g, w8, ws, w_o):
            y = kp.rmsnorm_gated(x, w, g, eps, impl="reference").reshape(tokens, h * d)
            return jnp.dot(y, w_o, preferred_element_type=jnp.float32).astype(dt)
        variants = {"k3pallas": j(fused), "unfused": j(unfused), "xla": j(xla), "bf16": j(bf16)}
        inb = 2 * _nbytes((tokens, h, d), dt) + _nbytes((d,), jnp.float32) + h * d * hidden
        outb = _nbytes((tokens, hidden), dt)
        launch = platform.launch_config("rmsnorm_gated_fp8", tokens, *gated_fp8.gated_row_elems(h, d))
    else:
        raise KeyError(f"unknown op {op!r}; known: {shapes.OPS}")
    return Case(op, config_name, tokens, dt.name, make, variants, inb + outb, inb,
                launch if impl == "pallas" else None)


def copy_variants(bytes_moved: int):
    """Two jitted copies of ``bytes_moved / 2`` bytes (read + write = ``bytes_moved``): XLA's
    device-to-device memcpy, and an XLA elementwise kernel (uint32 xor with a runtime scalar, which
    XLA cannot fold away). The faster is the ceiling: the memcpy is slower at mid sizes."""
    n = max(1, bytes_moved // 8)

    def make(seed):
        return jnp.full((n,), seed, jnp.uint32), jnp.uint32(seed)
    return make, {"memcpy": jax.jit(lambda a, s: a.copy()), "xor_kernel": jax.jit(lambda a, s: a ^ s)}


# Last-level cache per device, for input rotation: H100/H200 L2, MI300X/MI325X/MI355X Infinity Cache.
_CACHE_BYTES = {"sm_90": 60 << 20, "gfx942": 256 << 20, "gfx950": 256 << 20}


def cache_bytes(target: platform.Target) -> int:
    return _CACHE_BYTES.get(target.arch, 256 << 20)


def rotation_sets(input_bytes: int, cache_bytes: int, max_sets: int = 32) -> int:
    """How many input sets to cycle so that each call misses the last-level cache."""
    return int(min(max_sets, max(1, math.ceil(3 * cache_bytes / max(1, input_bytes)))))

