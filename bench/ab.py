"""``python -m bench.ab VARIANT[,VARIANT...] --cases OP:CONFIG:T,...``: A/B of kernel design
variants in the same run on the same machine (device time per call, the benchmark's inputs and
input rotation, each op's own launch config). Each variant runs in its own process, so no trace
of another variant is cached. A measurement of design choices for bench/NOTES.md, not part of
the benchmark.

Variants (``base`` is the code as it is; the others patch it in the measuring process only):

* ``division``: the gated kernels' sigmoid as the IEEE division ``1 / (1 + e)`` instead of
  ``rsqrt(1 + e)**2``;
* ``store8``: the FP8 codes stored through a ``[..., n / 8, 8]`` view of the tile's last axis,
  a pointer tensor of another shape than the bf16 loads', so that Triton's coalescing gives the
  loads their own 8 values (16 bytes) per thread instead of the 1-byte store's 16 (two 16-byte
  halves); tried and rejected (bench/NOTES.md);
* ``recompute``: the gated FP8 kernel (mode "dynamic") reloads x and gate after the token's
  scale and recomputes y for the codes, instead of keeping y live across the reduction;
* ``persistentK``: every one-program-per-block row kernel as a persistent grid of ``K`` programs
  per SM (``K x`` the target's cores, at most one per row block), each looping over row blocks
  ``pid, pid + P, ...``: against the tail waves of mid-size T (a grid of ``T`` programs with
  ~20 resident per SM runs 1.55 waves for 12 x 128 at T = 4096, bench/NOTES.md). The kernels
  are unchanged: their row refs are offset by the block's first row and ``common.row_mask``
  reads the loop's block index instead of ``pl.program_id(0)``. As such it keeps the token as
  the unit of work, so it cannot remove a tail wave by itself. Measured 7-35 % slower at
  T >= 4096, 4-8 % faster at T = 7..64 for 96 x 128 (``results/ab_persistent_prefetch.json``);
* ``prefetchK``: the gated FP8 kernel on such a persistent grid, loading the next row block's x
  and gate before computing this one's, so that a program's second token overlaps its first.
  Measured slower at every T >= 4096 for every K (0.5-540 %; same file);
* ``whole``: the launch of ``persistentK`` without its loop: one program per row block as on
  main, but every array whole and the block's rows addressed as offsets from
  ``pl.program_id(0)`` in the kernel instead of through the row BlockSpecs. It tells the loop's
  effect from the addressing's: at T = 7..64 the persistent form ran 4-8 % faster for 96 x 128
  (same instructions, another load schedule; bench/NOTES.md), ``whole`` measured equal to main,
  so the one-trip loop is what changes XLA's schedule (``results/ab_loop_smallT.json``).
"""

from __future__ import annotations

import argparse
import contextvars
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax import lax

from k3pallas import _compat, platform
from k3pallas._compat import pl
from k3pallas.kernels import common, gated_fp8, quant as quant_lib

from bench import ops as bench_ops
from bench import timing


def _division():
    def act(g, name):
        sig = 1.0 / (1.0 + jnp.exp2(g * -gated_fp8._LOG2E))
        return sig if name == "sigmoid" else g * sig
    gated_fp8._activation = act


def _store8():
    plain = common.store

    def store(ref, index, value, mask):
        n = value.shape[-1]
        if jnp.dtype(ref.dtype).itemsize != 1 or n < 16 or n % 8:
            return plain(ref, index, value, mask)

        def view(a):
            a = jnp.asarray(a)
            return a.reshape(a.shape[:-1] + (n // 8, 8)) if a.shape[-1] == n else a[..., None]
        return plain(ref, tuple(view(i) for i in index), view(value),
                     None if mask is None else view(mask))
    common.store = store


def _recompute():
    orig = gated_fp8._gated_kernel

    def kernel(x_ref, g_ref, *refs, n_rows, rows, heads, width, eps, activation, quant, mode):
        if quant is None or mode != "dynamic":
            return orig(x_ref, g_ref, *refs, n_rows=n_rows, rows=rows, heads=heads, width=width,
                        eps=eps, activation=activation, quant=quant, mode=mode)
        w_ref, codes_ref, scale_ref = refs
        d_index, d_lanes = common.lane_index(width)
        pieces = list(gated_fp8.head_pieces(common.row_mask(n_rows, rows, 3), rows, heads,
                                            d_index, d_lanes))
        w = common.load(w_ref, d_index, d_lanes).astype(jnp.float32)[None, None, :]

        def ys():
            return [gated_fp8.gated_y(common.load(x_ref, index, mask), common.load(g_ref, index, mask),
                                      w, width=width, eps=eps, activation=activation)
                    for index, mask in pieces]
        scale = quant_lib.row_scale(ys(), quant)
        r_index = jnp.arange(rows, dtype=jnp.int32)
        common.store(scale_ref, r_index, scale, common.row_mask(n_rows, rows, 1))
        inv = (1.0 / scale)[:, None, None]
        for (index, mask), y in zip(pieces, ys()):
            common.store(codes_ref, index, quant_lib.codes(y, inv, quant), mask)
    gated_fp8._gated_kernel = kernel


_BLOCK = contextvars.ContextVar("bench_ab_block", default=None)


class _RowRef:
    """A row ref of a persistent launch: ``.at[index]`` offsets the row index by ``offset``."""

    def __init__(self, ref, offset):
        self.ref, self.offset, self.dtype, self.shape = ref, offset, ref.dtype, ref.shape

    @property
    def at(self):
        outer = self

        class _At:
            def __getitem__(self, index):
                if isinstance(index, tuple):
                    return outer.ref.at[(index[0] + outer.offset,) + index[1:]]
                return outer.ref.at[index + outer.offset]
        return _At()


def _whole(shape):
    return pl.BlockSpec(tuple(shape), lambda *_, _n=len(shape): (0,) * _n)


def _programs(n_blocks: int, per_sm: int) -> int:
    return max(1, min(n_blocks, per_sm * platform.current_target().num_cores))


def _persistent_launch(body, *, name, config, row_inputs, shared_inputs, out_shapes, out_poison,
                       interpret, programs):
    """ONE pallas_call of grid ``(programs,)`` with every array whole: ``body(*refs)`` (refs in
    ``common.RowCall`` order: row inputs, shared inputs, outputs) loops over the row blocks
    itself. Honors ``common.wrapping`` (poisoned outputs)."""
    call = common.RowCall(body, list(row_inputs) + list(shared_inputs),
                          [_whole(a.shape) for a in list(row_inputs) + list(shared_inputs)],
                          list(out_shapes), _whole,
                          list(out_poison or [float("nan")] * len(out_shapes)))
    wrapper = common._WRAP.get()
    if wrapper is not None:
        call = wrapper(call)
    return pl.pallas_call(
        call.kernel, grid=(programs,), in_specs=call.in_specs,
        out_specs=[_whole(o.shape) for o in call.out_shapes], out_shape=call.out_shapes,
        input_output_aliases=call.aliases,
        compiler_params=_compat.triton_compiler_params(config.num_warps, config.num_stages),
        interpret=interpret, name=name)(*call.inputs)


def _persistent(per_sm: int):
    plain_call, plain_mask = common.row_call, common.row_mask

    def row_mask(n_rows, rows, nd, pid=None):
        block = _BLOCK.get()
        return plain_mask(n_rows, rows, nd, pid if block is None else block)

    def row_call(kernel, *, name, n_rows, config, row_inputs, shared_inputs, out_shapes,
                 interpret, out_poison=None, programs_per_block=1):
        if programs_per_block != 1 or config.split != 1:
            return plain_call(kernel, name=name, n_rows=n_rows, config=config,
                              row_inputs=row_inputs, shared_inputs=shared_inputs,
                              out_shapes=out_shapes, interpret=interpret, out_poison=out_poison,
                              programs_per_block=programs_per_block)
        rows = config.rows_per_program
        n_blocks = pl.cdiv(n_rows, rows)
        # per_sm == 0 is the variant "whole": one program per block, no loop.
        programs = n_blocks if per_sm == 0 else _programs(n_blocks, per_sm)
        n_row, n_shared = len(row_inputs), len(shared_inputs)

        def body(*refs):
            pid = pl.program_id(0)

            def step(i, carry):
                block = pid + i * programs
                token = _BLOCK.set(block)
                try:
                    kernel(*[r if n_row <= j < n_row + n_shared else _RowRef(r, block * rows)
                             for j, r in enumerate(refs)])
                finally:
                    _BLOCK.reset(token)
                return carry
            if per_sm == 0:
                step(0, 0)
            else:
                lax.fori_loop(0, pl.cdiv(n_blocks, programs), step, 0)

        return _persistent_launch(body, name=name, config=config, row_inputs=row_inputs,
                                  shared_inputs=shared_inputs, out_shapes=out_shapes,
                                  out_poison=out_poison, interpret=interpret, programs=programs)
    common.row_call, common.row_mask = row_call, row_mask


def _prefetch(per_sm: int):
    """The gated FP8 kernel (mode "dynamic") on a persistent grid whose loop loads the next row
    block's x and gate before it computes this one's (the loads carried into the next step)."""
    plain = gated_fp8._fp8_call

    def fp8_call(kernel_fn, op, row_inputs, shared_inputs, row_elems, *, quant, interpret,
                 config, mode, scale, **static):
        if kernel_fn is not gated_fp8._gated_kernel or mode != "dynamic":
            return plain(kernel_fn, op, row_inputs, shared_inputs, row_elems, quant=quant,
                         interpret=interpret, config=config, mode=mode, scale=scale, **static)
        from k3pallas.kernels import launch

        x_in, g_in = row_inputs
        n_rows, heads, width = x_in.shape
        eps, activation = static["eps"], static["activation"]
        q = quant_lib.kernel_quant(quant, interpret=interpret)
        if config is None:
            config = launch.launch_config(op, n_rows, *row_elems)
        rows = config.rows_per_program
        n_blocks = pl.cdiv(n_rows, rows)
        programs = _programs(n_blocks, per_sm)
        outs, poison = quant_lib.outputs(x_in.shape, n_rows, q, mode, None)

        def body(x_ref, g_ref, w_ref, codes_ref, scale_ref):
            pid = pl.program_id(0)
            d_index, d_lanes = common.lane_index(width)
            w = common.load(w_ref, d_index, d_lanes).astype(jnp.float32)[None, None, :]

            def pieces(block):  # block-relative indices, masks of this block's rows
                return list(gated_fp8.head_pieces(common.row_mask(n_rows, rows, 3, block), rows,
                                                  heads, d_index, d_lanes))

            def load_block(block):
                off = block * rows
                return tuple(common.load(_RowRef(ref, off), index, mask)
                             for index, mask in pieces(block) for ref in (x_ref, g_ref))

            def step(i, tiles):
                block = pid + i * programs
                nxt = load_block(block + programs)  # masked past the last row
                ys = [(index, mask, gated_fp8.gated_y(tiles[2 * k], tiles[2 * k + 1], w, width=width,
                                                      eps=eps, activation=activation))
                      for k, (index, mask) in enumerate(pieces(block))]
                off = block * rows
                quant_lib.epilogue(ys, [_RowRef(codes_ref, off), _RowRef(scale_ref, off)], None,
                                   n_rows=n_rows, rows=rows, quant=q, mode="dynamic", pid=block)
                return nxt
            lax.fori_loop(0, pl.cdiv(n_blocks, programs), step, load_block(pid))

        result = _persistent_launch(body, name=f"k3pallas_{op}", config=config,
                                    row_inputs=[x_in, g_in], shared_inputs=list(shared_inputs),
                                    out_shapes=outs, out_poison=poison, interpret=interpret,
                                    programs=programs)
        return quant_lib.results(result, q, mode)
    gated_fp8._fp8_call = fp8_call


VARIANTS = {"base": lambda: None, "division": _division, "store8": _store8,
            "recompute": _recompute, "whole": lambda: _persistent(0)}


def _apply(patch: str) -> None:
    m = re.fullmatch(r"(persistent|prefetch)(\d+)", patch)
    if m:
        return (_persistent if m.group(1) == "persistent" else _prefetch)(int(m.group(2)))
    VARIANTS[patch]()


def check() -> dict:
    """Each op a variant patches, in interpret mode on small random inputs, against the package's
    reference, outputs poisoned: {op: (max |scale / ref - 1|, max |decoded codes - ref| / max ref
    scale)}, NaN where an element was left unwritten. A variant
    that computes something else would make its timing meaningless (``--check``; tests)."""
    import numpy as np

    import k3pallas as kp
    from k3pallas import testing

    k = jax.random.split(jax.random.PRNGKey(0), 3)
    x, g = (jax.random.normal(k[i], (5, 3, 32), jnp.bfloat16) * 2 for i in (0, 1))
    w = 1 + 0.1 * jax.random.normal(k[2], (32,), jnp.float32)
    q, kv = x.reshape(5, 96)[:, :64], g.reshape(5, 96)[:, :16]
    runs = {"rmsnorm_gated_fp8_per_token": lambda impl: kp.rmsnorm_gated_fp8_per_token(x, w, g, impl=impl),
            "sigmoid_mul_fp8_per_token": lambda impl: kp.sigmoid_mul_fp8_per_token(
                x.reshape(5, 96), g.reshape(5, 96), impl=impl),
            "per_token_fp8_quant": lambda impl: kp.per_token_fp8_quant(x.reshape(5, 96), impl=impl),
            "fused_q_kv_rmsnorm_fp8 (q)": lambda impl: kp.fused_q_kv_rmsnorm_fp8(
                q, kv, w[:1] + jnp.zeros(64), w[:16], impl=impl)[0]}
    out = {}
    for op, run in runs.items():
        with testing.poisoned_outputs():  # an element left unwritten shows up as NaN
            got = run("interpret")
        ref = run("reference")
        gs, rs = np.asarray(got.scale, np.float64), np.asarray(ref.scale, np.float64)
        dec = lambda q: np.asarray(q.data.astype(jnp.float32), np.float64)  # noqa: E731
        err = np.abs(dec(got) - dec(ref)) * rs.reshape(rs.shape + (1,) * (got.data.ndim - rs.ndim))
        out[op] = (float(np.max(np.abs(gs / rs - 1))), float(np.max(err) / np.max(rs)))
    return out


def _time(case: str, calls: int) -> float:
    name, cfg, t = case.split(":")
    c = bench_ops.make_case(name, cfg, int(t), "bfloat16", "pallas")
    sets = bench_ops.input_sets(c, platform.current_target())
    return timing.time_device(c.variants["k3pallas"], sets, n_calls=calls).median_us


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__)
    p.add_argument("variants", help="comma-separated; '+' combines patches, e.g. base,store8")
    p.add_argument("--cases", help="comma-separated OP:CONFIG:T")
    p.add_argument("--check", action="store_true",
                   help="each variant against the reference in interpret mode (CPU), no timing")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default=os.path.join("bench", "out"))
    p.add_argument("--name", default="ab", help="the JSON file's name under --out")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.check and not args.cases:
        p.error("--cases is required (or --check)")
    cases = [] if args.check else args.cases.split(",")
    if args.one:  # one variant, in this (fresh) process
        for patch in args.variants.split("+"):
            _apply(patch)
        print(json.dumps(check() if args.check else {c: _time(c, args.calls) for c in cases}))
        return 0
    got = {}
    for variant in args.variants.split(","):
        mode = ["--check"] if args.check else ["--cases", args.cases, "--calls", str(args.calls)]
        out = subprocess.run([sys.executable, "-m", "bench.ab", variant, "--one", *mode],
                             capture_output=True, text=True)
        if out.returncode:
            print(f"{variant}: failed\n{out.stderr[-3000:]}", file=sys.stderr, flush=True)
            continue
        got[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        print(variant, json.dumps(got[variant]), flush=True)
    if args.check:
        return 0 if len(got) == len(args.variants.split(",")) else 1
    first = next(iter(got), None)
    for c in cases:
        if first is None:
            break
        print(c + ": " + ", ".join(f"{v} {r[c]:.2f} us ({r[c] / got[first][c]:.3f}x)"
                                   for v, r in got.items()), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                   "calls": args.calls, "us": got}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
