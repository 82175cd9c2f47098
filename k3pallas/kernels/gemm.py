"""The scaled FP8 GEMM behind ``k3pallas.linear``: ``out = dequant(a) @ dequant(w)``, ONE launch.

``a [M, K]`` FP8 codes with a float32 scale per row and group of ``a_group`` columns of K (group
FP8: 128; per-token FP8: K, or K / G); ``w`` FP8 codes ``[N, K]`` (layout "nk") or ``[K, N]``
("kn") with a float32 scale per 128 x 128 block (group FP8), per output channel or per tensor
(per-token FP8). Each program computes a ``[BM, BN]`` tile of the output, looping over K in steps
of ``BK`` with the FP8 operands straight into the matrix cores (``lax.dot`` with a float32
result):

* scales that change along K (group FP8, per-token groups) multiply each step's partial product
  before it joins the float32 accumulator (``acc += dot(a, w) * sa * sw``): the exact scaled
  sum of the products, and the matrix cores' partial sums promoted to float32 registers every
  ``BK`` of K;
* scales constant along K (per-token FP8 with one group, per-channel weights) multiply the
  accumulator once, at the end.

One rounding to ``out_dtype``. Rows beyond M, columns beyond N and a K tail are masked loads
(zeros) and masked stores: nothing is padded or copied in memory. ``GemmConfig.swap`` computes
the transposed tile (``w_tile @ a_tile^T``): the weight's rows fill the matrix cores' M, which
needs 64 on Hopper's wgmma, while a decode step has a few tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from k3pallas import _compat
from k3pallas._compat import pl, plgpu
from k3pallas.kernels import common
from k3pallas.kernels.launch import GemmConfig

# A weight's block scales: 128 x 128 (the DeepSeek-V3 / Kimi-K2 / Qwen3 FP8 checkpoints).
W_BLOCK = 128


def _kernel(a_ref, as_ref, w_ref, ws_ref, o_ref, *, m: int, n: int, k: int, cfg: GemmConfig,
            a_group: int, w_scale: str, kn: bool):
    """``w_scale``: "block" (``[ceil(N/128), K/128]``, transposed for "kn"), "channel" (``[N]``)
    or "tensor" (``[1]``)."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    pid_m, pid_n = pl.program_id(0), pl.program_id(1)
    m0, n0 = pid_m * bm, pid_n * bn
    rm = m0 + jnp.arange(bm, dtype=jnp.int32)
    rn = n0 + jnp.arange(bn, dtype=jnp.int32)
    m_ok, n_ok = rm < m, rn < n
    steps = pl.cdiv(k, bk)
    a_steps = a_group // bk  # K steps per activation scale (in-loop only if a_group < k)
    in_loop_a = a_group < k
    in_loop_w = w_scale == "block"
    # Masked lanes read as zero codes: an fp8 constant (a cast of 0 to e4m3fnuz does not lower).
    a_zero, w_zero = np.zeros((), a_ref.dtype), np.zeros((), w_ref.dtype)

    def tile_dot(a, w):
        """The step's float32 partial product, [BM, BN] (or [BN, BM] with swap)."""
        if cfg.swap:  # w_tile @ a_tile^T
            dims = (((0,), (1,)), ((), ())) if kn else (((1,), (1,)), ((), ()))
            return lax.dot_general(w, a, dims, preferred_element_type=jnp.float32)
        dims = (((1,), (0,)), ((), ())) if kn else (((1,), (1,)), ((), ()))
        return lax.dot_general(a, w, dims, preferred_element_type=jnp.float32)

    def outer(a_s, w_s):
        """Row scales ``a_s [BM, 1]`` times column scales ``w_s [1, BN]`` (either may be a
        scalar ``[1, 1]``), laid out as the accumulator."""
        if cfg.swap:
            return w_s.reshape(-1, 1) * a_s.reshape(1, -1)
        return a_s * w_s

    def step_scales(i):
        """Step ``i``'s K-varying scales, ``(a_s [BM, 1] or None, w_s [1, 1] or None)``. A step
        after the last (an unrolled iteration past K, or the prefetch beyond the loop) reads
        the last one's addresses and gets zeros: its all-zero codes then add exactly 0, even
        where the last block's scale is infinite."""
        past = (i >= steps) if steps % cfg.k_unroll else None  # unrolled steps past K
        i = jnp.minimum(i, steps - 1)
        a_s = (plgpu.load(as_ref.at[pl.ds(m0, bm), pl.ds(i // a_steps, 1)], mask=m_ok[:, None],
                          other=0.0) if in_loop_a else None)
        w_s = None
        if in_loop_w:  # the program's columns lie in one 128-block (BN divides 128)
            kb = (i * bk) // W_BLOCK
            nb = n0 // W_BLOCK
            w_s = plgpu.load(ws_ref.at[pl.ds(kb, 1), pl.ds(nb, 1)] if kn
                             else ws_ref.at[pl.ds(nb, 1), pl.ds(kb, 1)])  # [1, 1]
        if past is not None:
            a_s = None if a_s is None else jnp.where(past, 0.0, a_s)
            w_s = None if w_s is None else jnp.where(past, 0.0, w_s)
        return a_s, w_s

    # With ``scale_prefetch`` the K-varying scales are loaded one iteration before their use and
    # carried through the loop: Triton pipelines only the dot's operands, so a scale loaded in its
    # own step stalls every step on a global load's latency. One iteration, not more: Triton's
    # pipeliner skips a loop with a loop-carried distance over one (docs/formats.md, Consumers).
    # ``k_unroll`` K steps per iteration (each with its own loads, dot and scales): the loop's
    # fixed instructions (barriers, waits, branch) once per ``k_unroll * BK`` of K.
    in_loop = in_loop_a or in_loop_w
    prefetch = cfg.scale_prefetch and in_loop
    unroll = cfg.k_unroll
    k_tail = k % (bk * unroll) != 0

    def iteration_scales(j):
        return tuple(step_scales(j * unroll + u) for u in range(unroll))

    def step(i, acc, scales):
        """K step ``i`` (``scales``: its own, or None to load them here) added to ``acc``."""
        ks = i * bk + jnp.arange(bk, dtype=jnp.int32)
        k_ok = ks < k if k_tail else None
        a_mask = common.both(m_ok[:, None], None if k_ok is None else k_ok[None, :])
        a = plgpu.load(a_ref.at[pl.ds(m0, bm), pl.ds(i * bk, bk)], mask=a_mask, other=a_zero)
        if kn:
            w_mask = common.both(n_ok[None, :], None if k_ok is None else k_ok[:, None])
            w = plgpu.load(w_ref.at[pl.ds(i * bk, bk), pl.ds(n0, bn)], mask=w_mask, other=w_zero)
        else:
            w_mask = common.both(n_ok[:, None], None if k_ok is None else k_ok[None, :])
            w = plgpu.load(w_ref.at[pl.ds(n0, bn), pl.ds(i * bk, bk)], mask=w_mask, other=w_zero)
        part = tile_dot(a, w)
        if not in_loop:
            return acc + part
        a_s, w_s = scales if scales is not None else step_scales(i)
        if a_s is None:
            return acc + part * w_s
        if w_s is None:
            return acc + part * (a_s if not cfg.swap else a_s.reshape(1, -1))
        return acc + part * outer(a_s, w_s)

    def body(j, carry):
        acc, scales = carry
        nxt = iteration_scales(j + 1) if prefetch else ()
        for u in range(unroll):
            acc = step(j * unroll + u, acc, scales[u] if prefetch else None)
        return acc, nxt

    shape = (bn, bm) if cfg.swap else (bm, bn)
    first = iteration_scales(0) if prefetch else ()
    acc, _ = lax.fori_loop(0, pl.cdiv(k, bk * unroll), body,
                           (jnp.zeros(shape, jnp.float32), first))
    # Scales constant along K: once, at the end.
    if not in_loop_a:
        a_s = plgpu.load(as_ref.at[pl.ds(m0, bm), pl.ds(0, 1)], mask=m_ok[:, None], other=0.0)
        acc = acc * (a_s.reshape(1, -1) if cfg.swap else a_s)
    if w_scale == "channel":
        w_s = plgpu.load(ws_ref.at[pl.ds(n0, bn)], mask=n_ok, other=0.0)
        acc = acc * (w_s.reshape(-1, 1) if cfg.swap else w_s.reshape(1, -1))
    elif w_scale == "tensor":
        acc = acc * plgpu.load(ws_ref.at[pl.ds(0, 1)]).reshape(1, 1)
    out = (acc.T if cfg.swap else acc).astype(o_ref.dtype)
    plgpu.store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], out, mask=m_ok[:, None] & n_ok[None, :])


def check_config(cfg: GemmConfig, *, a_group: int, w_scale: str, k: int) -> None:
    """ValueError unless ``cfg`` can run this problem: each K step within one activation scale
    group and one weight block, a program's columns within one weight block."""
    if a_group < k and a_group % cfg.block_k:
        raise ValueError(f"block_k={cfg.block_k} must divide the activation's scale groups of "
                         f"{a_group}")
    if w_scale == "block" and (W_BLOCK % cfg.block_k or W_BLOCK % cfg.block_n):
        raise ValueError(f"block_n={cfg.block_n} and block_k={cfg.block_k} must divide the "
                         f"weight's {W_BLOCK} x {W_BLOCK} scale blocks")


def scaled_matmul(a, a_scale, w, w_scale, *, out_dtype, kn: bool, w_scale_kind: str,
                  cfg: GemmConfig, name: str, interpret: bool):
    """``[M, N]`` in ``out_dtype``: the rows of ``a [M, K]`` (fp8) with ``a_scale [M, G]``
    (``K / G`` columns per scale) times ``w`` (fp8, ``[N, K]`` or with ``kn`` ``[K, N]``) with
    ``w_scale`` of kind ``w_scale_kind`` ("block", "channel", "tensor": then ``[1]``). One
    ``pallas_call`` named ``name``, grid ``(cdiv(M, BM), cdiv(N, BN))``."""
    m, k = a.shape
    n = w.shape[1] if kn else w.shape[0]
    a_group = k // a_scale.shape[1]
    check_config(cfg, a_group=a_group, w_scale=w_scale_kind, k=k)
    out_shape = jax.ShapeDtypeStruct((m, n), out_dtype)
    for arr in (a, w):
        common.check_offsets(arr.shape, arr.dtype)
    rows, shared, manual = _compat.match_varying([a, a_scale], [w, w_scale])
    if manual is not None:  # inside shard_map
        out_shape = jax.ShapeDtypeStruct((m, n), out_dtype, manual_axis_type=manual)
    kernel = functools.partial(_kernel, m=m, n=n, k=k, cfg=cfg, a_group=a_group,
                               w_scale=w_scale_kind, kn=kn)
    inputs = [*rows, *shared]
    spec = common.whole_spec  # every program sees whole arrays and indexes its tiles itself
    call = common.RowCall(kernel, inputs, [spec(x.shape) for x in inputs], [out_shape], spec,
                          [float("nan")])
    (out,) = common.launch_call(call, grid=(pl.cdiv(m, cfg.block_m), pl.cdiv(n, cfg.block_n)),
                                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                interpret=interpret,
                                name=_compat.fp8_dot_accumulation(name, cfg.mma_acc))
    return out


__all__ = ["scaled_matmul", "check_config", "W_BLOCK"]
