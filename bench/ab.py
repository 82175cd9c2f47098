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
  scale and recomputes y for the codes, instead of keeping y live across the reduction.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp

from k3pallas import platform
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
        in_rows = common.row_mask(n_rows, rows, 3)
        d_index, d_lanes = common.lane_index(width)
        r = jnp.arange(rows, dtype=jnp.int32)[:, None, None]
        pieces = []
        for h0, hc in common.pow2_parts(heads):
            h = h0 + jnp.arange(hc, dtype=jnp.int32)[None, :, None]
            mask = common.both(in_rows, None if d_lanes is None else d_lanes[None, None, :])
            if h0 + hc > heads:
                mask = common.both(mask, h < heads)
            pieces.append(((r, h, d_index[None, None, :]), mask))
        w = common.load(w_ref, d_index, d_lanes).astype(jnp.float32)[None, None, :]

        def ys():
            out = []
            for index, mask in pieces:
                x = common.load(x_ref, index, mask).astype(jnp.float32)
                g = common.load(g_ref, index, mask).astype(jnp.float32)
                ms = jnp.sum(x * x, axis=-1, keepdims=True) / width
                out.append(x * common.inv_rms(ms, eps) * w * gated_fp8._activation(g, activation))
            return out
        scale = quant_lib.row_scale(ys(), quant)
        r_index = jnp.arange(rows, dtype=jnp.int32)
        common.store(scale_ref, r_index, scale, common.row_mask(n_rows, rows, 1))
        inv = (1.0 / scale)[:, None, None]
        for (index, mask), y in zip(pieces, ys()):
            common.store(codes_ref, index, quant_lib.codes(y, inv, quant), mask)
    gated_fp8._gated_kernel = kernel


VARIANTS = {"base": lambda: None, "division": _division, "store8": _store8,
            "recompute": _recompute}


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
    runs = {"rmsnorm_gated_fp8_per_token": lambda impl: kp.rmsnorm_gated_fp8_per_token(x, w, g, impl=impl),
            "sigmoid_mul_fp8_per_token": lambda impl: kp.sigmoid_mul_fp8_per_token(
                x.reshape(5, 96), g.reshape(5, 96), impl=impl)}
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
    n_sets = bench_ops.rotation_sets(c.input_bytes, bench_ops.cache_bytes(platform.current_target()))
    sets = [c.make_inputs(s) for s in range(n_sets)]
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
            VARIANTS[patch]()
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
