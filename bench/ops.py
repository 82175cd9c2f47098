"""What the benchmark measures for each op: its inputs, its variants and its minimum bytes.

The cases, their shapes, their unfused form and their output format come from ``bench.cases``;
bytes moved are the inputs' and outputs' sizes. Variants (same inputs, same
process):

* ``k3pallas``: the fused k3pallas kernel (one launch);
* ``unfused``: the case's ``unfused`` form (``bench.cases``: the k3pallas path without the
  fusion, e.g. two ``rmsnorm`` launches; ``rmsnorm_gated`` then ``quantize``), where it has one;
* ``xla``: the jnp reference compiled by XLA (what a JAX user gets without this package);
* ``copy``: a device-to-device copy moving the same number of bytes, the bandwidth ceiling;
* ``encoder`` (FP8 ops): the fused kernel with ``fp8_cast="encoder"``, the integer encoder in
  place of the native conversion (what gfx942 runs without the native path).

One integration path, not an op, is measured the same way: ``kda_output_fp8``, the KDA output
path up to the FP8 o_proj (``k3pallas``: the fused gated FP8 kernel then ``linear``; ``unfused``:
``rmsnorm_gated``, ``quantize``, then ``linear``; ``xla``: the jnp norm and quant, then
``linear``; ``bf16``: the jnp gated norm in bf16 and a bf16 o_proj). The o_proj GEMM dominates
there, so "% copy" says little. Likewise ``group_linear``: the group-FP8 consumers, each XLA
lowering of ``linear`` beside the per-token FP8 path and the bf16 dot (``_group_linear_case``).
``linear``: the scaled FP8 GEMM alone on pre-quantized operands (``_linear_case``): the Pallas
GEMM, every XLA lowering of the format and the bf16 dot, its copy ceiling the bytes the GEMM
must move (weight and scales, activation and scales, output), each input set with its own
weight (a decode step reads each layer's weight once: from DRAM, not from the cache).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

import k3pallas as kp
from bench import cases as ops
from k3pallas import platform
from k3pallas.kernels import hooks, launch
from k3pallas.linear import GROUP_IMPLS, PER_TOKEN_IMPLS



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
    launch: launch.LaunchConfig | None  # the config the k3pallas kernel picks here
    flops: int = 0  # a GEMM's 2 * T * K * N (TFLOPS in the report), else 0


def _rand(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _nbytes(shape, dtype):
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def _fill(key, structs):
    """Random arrays for ``ShapeDtypeStruct``s (normal; weights too)."""
    keys = jax.random.split(key, len(structs))
    return tuple(_rand(k, s.shape, s.dtype) for k, s in zip(keys, structs))


def _launch_of(fn, args) -> launch.LaunchConfig | None:
    """The launch config the first kernel of ``fn`` picks for ``args`` (traced, not run)."""
    with hooks.recording() as log:
        jax.jit(fn).trace(*args)
    return log[0].config if log else None


class ResidualStream:
    """``fn(x, residual, *rest) -> (y, new residual)`` called as a decoder layer calls it: jitted
    with the residual donated (and ``x`` where the output is unquantized: it is written over x's
    buffer), each input set replaced by the call's results (its new residual, and y as the next
    x), so that the call updates the residual in place. Without donation XLA first copies each
    aliased input: two more kernels, about twice the time (docs/residual.md). A set is copied
    at its first call (the warm-up), so the other variants still find the originals."""

    def __init__(self, fn, quantized: bool):
        self._fn = jax.jit(fn, donate_argnums=(1,) if quantized else (0, 1))
        self._quantized = quantized
        self._live = {}  # (id(x), id(residual)) of an input set -> its current (x, residual)

    def __call__(self, x, residual, *rest):
        key = (id(x), id(residual))
        if key not in self._live:
            self._live[key] = (x if self._quantized else jnp.copy(x), jnp.copy(residual))
        x_now, r_now = self._live[key]
        y, new_r = self._fn(x_now, r_now, *rest)
        self._live[key] = (x_now if self._quantized else y, new_r)
        return y, new_r


def _no_aliases(call):
    return dataclasses.replace(call, aliases={})


def fresh_outputs(fn):
    """``fn`` jitted with every launch's input/output aliases removed (``hooks.wrapping``): the
    same kernel writing new buffers, as the PyTorch peers do, beside ``ResidualStream``'s in-place
    call; what the two differ by is the cost of writing over the inputs (docs/residual.md)."""
    # A function of its own: jax caches a trace per function, and fn's may exist without the hook.
    jitted = jax.jit(lambda *args: fn(*args))

    def run(*args):
        with hooks.wrapping(_no_aliases):
            return jitted(*args)
    return run


def jit_for(op: str, out_format):
    """How the benchmark and the sweep compile an op's variants: the residual add in place, as a
    decoder layer runs it (``ResidualStream``), every other op with ``jax.jit``."""
    if op == "add_rmsnorm":
        return lambda fn: ResidualStream(fn, quantized=out_format is not None)
    return jax.jit


def _op_case(spec: ops.BenchOp, config_name: str, tokens: int, dt, impl: str):
    """(make, variants, input bytes, output bytes, launch) of an op from the op table."""
    structs, options = spec.example(tokens, dt, **spec.sizes[config_name])
    j = jit_for(spec.op, options.get("out_format"))

    def make(seed):
        return _fill(jax.random.PRNGKey(seed), structs)
    variants = {"k3pallas": j(lambda *a: spec.fn(*a, impl=impl, **options))}
    if (spec.fp8 or options.get("out_format") == "mxfp8") and impl == "pallas":  # interpret
        # mode's "auto" is the encoder already; MXFP4 has only the encoder
        variants["encoder"] = j(lambda *a: spec.fn(*a, impl=impl, fp8_cast="encoder", **options))
    if spec.unfused is not None:
        variants["unfused"] = j(lambda *a: spec.unfused(impl, *a, **options))
    variants["xla"] = j(lambda *a: spec.fn(*a, impl="reference", **options))
    inb = sum(_nbytes(s.shape, s.dtype) for s in structs)
    outb = spec.bytes_moved(config_name, tokens, dt) - inb
    lc = _launch_of(lambda *a: spec.fn(*a, impl=impl, **options), structs) if impl == "pallas" else None
    return make, variants, inb, outb, lc


def make_case(op: str, config_name: str, tokens: int, dtype: str, impl: str) -> Case:
    """Build the case; ``impl`` is "pallas" on a GPU and "interpret" on the CPU."""
    dt = jnp.dtype(dtype)
    j = jax.jit
    if op in ops.OPS:
        make, variants, inb, outb, launch_cfg = _op_case(ops.OPS[op], config_name, tokens, dt, impl)
        return Case(op, config_name, tokens, dt.name, make, variants, inb + outb, inb, launch_cfg)
    fmt = kp.Fp8PerToken(kp.default_fp8_dtype())
    if op == "kda_output_fp8":
        cfg = ops.KDA_OUTPUT[config_name]
        h, d, eps, hidden = cfg["heads"], cfg["dim"], cfg["eps"], cfg["hidden"]
        # One weight for every input set (it is a parameter; rotation applies to activations).
        w_o = _rand(jax.random.PRNGKey(1234), (h * d, hidden), dt) * (h * d) ** -0.5
        qw = kp.quantize_weight(w_o, fmt)

        def make(seed):
            k = jax.random.split(jax.random.PRNGKey(seed), 3)
            return (_rand(k[0], (tokens, h, d), dt), _rand(k[1], (d,), jnp.float32),
                    _rand(k[2], (tokens, h, d), dt), qw, w_o)

        def o_proj(qa, qw):
            return kp.linear(qa, qw, out_dtype=dt)

        def fused(x, w, g, qw, w_o):
            return o_proj(kp.rmsnorm_gated(x, w, g, eps, out_format=fmt, impl=impl), qw)

        def unfused(x, w, g, qw, w_o):
            y = kp.rmsnorm_gated(x, w, g, eps, impl=impl).reshape(tokens, h * d)
            return o_proj(kp.quantize(y, fmt, impl=impl), qw)

        def xla(x, w, g, qw, w_o):
            return o_proj(kp.rmsnorm_gated(x, w, g, eps, out_format=fmt, impl="reference"), qw)

        def bf16(x, w, g, qw, w_o):
            y = kp.rmsnorm_gated(x, w, g, eps, impl="reference").reshape(tokens, h * d)
            return jnp.dot(y, w_o, preferred_element_type=jnp.float32).astype(dt)
        variants = {"k3pallas": j(fused), "unfused": j(unfused), "xla": j(xla), "bf16": j(bf16)}
        inb = 2 * _nbytes((tokens, h, d), dt) + _nbytes((d,), jnp.float32) + h * d * hidden
        outb = _nbytes((tokens, hidden), dt)
        launch_cfg = None
        if impl == "pallas":
            launch_cfg = _launch_of(fused, jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), make(0)))
        return Case(op, config_name, tokens, dt.name, make, variants, inb + outb, inb, launch_cfg)
    if op == "group_linear":
        return _group_linear_case(config_name, tokens, dt, impl)
    if op == "linear":
        return _linear_case(config_name, tokens, dt, impl)
    raise KeyError(f"unknown op {op!r}; known: {ops.ALL}")


def _group_linear_case(config_name: str, tokens: int, dt, impl: str) -> Case:
    """The group-FP8 consumers (``bench.cases.GROUP_LINEAR``): the producer (the fused gated
    norm, or the quantization) then ``linear``, by each XLA lowering (``k3pallas``: "auto";
    ``per_group``, ``dequantize``, ``scaled_dot``), beside the per-token FP8 path (``fp8``) and
    the bf16 dot on the jnp producer (``bf16``)."""
    cfg = ops.GROUP_LINEAR[config_name]
    j = jax.jit
    group, per_token = kp.Fp8Group(kp.default_fp8_dtype()), kp.Fp8PerToken(kp.default_fp8_dtype())
    kda = "heads" in cfg
    k = cfg["heads"] * cfg["dim"] if kda else cfg["k"]
    n = cfg["hidden"] if kda else cfg["n"]
    w = _rand(jax.random.PRNGKey(1234), (k, n), dt) * k**-0.5  # one weight for every input set
    qw_group, qw_fp8 = kp.quantize_weight(w, group), kp.quantize_weight(w, per_token)

    def make(seed):
        key = jax.random.split(jax.random.PRNGKey(seed), 3)
        if kda:
            x = (_rand(key[0], (tokens, cfg["heads"], cfg["dim"]), dt), _rand(key[1], (cfg["dim"],), jnp.float32),
                 _rand(key[2], (tokens, cfg["heads"], cfg["dim"]), dt))
        else:
            x = (_rand(key[0], (tokens, k), dt),)
        return (*x, qw_group, qw_fp8, w)

    def produce(x, fmt, impl):
        if kda:
            return kp.rmsnorm_gated(*x, cfg["eps"], out_format=fmt, impl=impl)
        return kp.quantize(x[0], fmt, impl=impl)

    def path(lowering):
        def fn(*a):
            *x, qg, _, _ = a
            return kp.linear(produce(x, group, impl), qg, out_dtype=dt, impl=lowering)
        return j(fn)

    def fp8(*a):
        *x, _, qf, _ = a
        return kp.linear(produce(x, per_token, impl), qf, out_dtype=dt)

    def bf16(*a):
        *x, _, _, w = a
        y = (kp.rmsnorm_gated(*x, cfg["eps"], impl="reference").reshape(tokens, k) if kda else x[0])
        return jnp.dot(y, w, preferred_element_type=jnp.float32).astype(dt)
    variants = {"k3pallas": path("auto"), **{name: path(name) for name in GROUP_IMPLS},
                "fp8": j(fp8), "bf16": j(bf16)}
    inb = (2 * _nbytes((tokens, k), dt) + _nbytes((cfg["dim"],), jnp.float32) if kda
           else _nbytes((tokens, k), dt)) + k * n + (k // 128) * -(-n // 128) * 4
    outb = _nbytes((tokens, n), dt)
    return Case("group_linear", config_name, tokens, dt.name, make, variants, inb + outb, inb, None)


def linear_operands(cfg: dict, tokens: int, seed: int, dt=jnp.bfloat16):
    """(qa, qw, x, w) of a ``bench.cases.LINEAR`` config: ``x [T, K]`` and ``w [K, N]`` normal
    (the weight scaled by K**-0.5), quantized to the config's format (the reference
    quantization: the producer is not what is measured)."""
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = _rand(kx, (tokens, cfg["k"]), dt)
    w = _rand(kw, (cfg["k"], cfg["n"]), dt) * cfg["k"] ** -0.5
    return kp.quantize(x, cfg["fmt"], impl="reference"), kp.quantize_weight(w, cfg["fmt"]), x, w


def _linear_case(config_name: str, tokens: int, dt, impl: str) -> Case:
    """The GEMM alone (``bench.cases.LINEAR``): ``linear`` with the Pallas GEMM (``k3pallas``),
    each XLA lowering of the format, and the bf16 dot of the unquantized operands (``bf16``)."""
    cfg = {**ops.LINEAR, **ops.LINEAR_TEST}[config_name]
    k, n, fmt = cfg["k"], cfg["n"], cfg["fmt"]
    group = fmt != "fp8_per_token"
    j = jax.jit

    def make(seed):
        return linear_operands(cfg, tokens, seed, dt)

    def lowering(name):
        return j(lambda qa, qw, x, w: kp.linear(qa, qw, out_dtype=dt, impl=name))
    variants = {"k3pallas": lowering(impl)}
    variants.update({name: lowering(name) for name in (GROUP_IMPLS if group else PER_TOKEN_IMPLS)})
    variants["bf16"] = j(lambda qa, qw, x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(dt))
    structs = jax.eval_shape(lambda: make(0)[:2])
    inb = sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(structs))
    outb = _nbytes((tokens, n), dt)
    return Case("linear", config_name, tokens, dt.name, make, variants, inb + outb, inb, None,
                flops=2 * tokens * k * n)


def copy_variants(bytes_moved: int):
    """Two jitted copies of ``bytes_moved / 2`` bytes (read + write = ``bytes_moved``): XLA's
    device-to-device memcpy, and an XLA elementwise kernel (uint32 xor with a runtime scalar, which
    XLA cannot fold away). The faster is the ceiling: the memcpy is slower at mid sizes. The
    element count is rounded up to a multiple of 64 (at most 512 bytes more): at an odd count
    XLA's kernel loads one word at a time (on an H100 at 11 MB 7.78 us against 4.06-4.11 at even
    counts beside it), which made the ceiling read slow there."""
    n = -(-max(1, bytes_moved // 8) // 64) * 64

    def make(seed):
        return jnp.full((n,), seed, jnp.uint32), jnp.uint32(seed)
    return make, {"memcpy": jax.jit(lambda a, s: a.copy()), "xor_kernel": jax.jit(lambda a, s: a ^ s)}


# Last-level cache per device, for input rotation: H100/H200 L2, MI300X/MI325X/MI355X Infinity Cache.
_CACHE_BYTES = {"sm_90": 60 << 20, "gfx942": 256 << 20, "gfx950": 256 << 20}


def cache_bytes(target: platform.Target) -> int:
    return _CACHE_BYTES.get(target.arch, 256 << 20)


def rotation_sets(input_bytes: int, cache_bytes: int, max_sets: int = 32) -> int:
    """How many input sets to cycle: 3x the last-level cache, at most ``max_sets``. Below
    ``3 * cache_bytes / max_sets`` per set (about 6 MB on the H200: every decode case) the sets
    fit in the cache together, and a call finds part of its inputs there (docs/performance.md)."""
    return int(min(max_sets, max(1, math.ceil(3 * cache_bytes / max(1, input_bytes)))))


def input_sets(case: Case, target: platform.Target) -> list[tuple]:
    """The case's input sets to cycle through on a GPU (``rotation_sets`` of them)."""
    return [case.make_inputs(s) for s in range(rotation_sets(case.input_bytes, cache_bytes(target)))]

