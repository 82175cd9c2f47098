"""``python -m bench.ab_sigmoid``: the gated kernels' sigmoid as the kernels compute it,
``rsqrt(1 + e)**2``, against the IEEE division ``1 / (1 + e)`` it replaced, in the same run on
the same machine (device time per call, each op's own launch config). A measurement of one
design choice (bench/NOTES.md), not part of the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

from k3pallas import ops, platform
from k3pallas.kernels import gated_fp8

from bench import ops as bench_ops
from bench import timing

CASES = [("rmsnorm_gated_fp8_per_token", "kimi-linear-kda"), ("rmsnorm_gated_fp8_per_token", "kimi-k3-kda-tp8"),
         ("rmsnorm_gated_fp8_per_token", "kimi-k3-kda"), ("sigmoid_mul_fp8_per_token", "kimi-k3-mla-out"),
         ("rmsnorm_gated", "kimi-linear-kda")]
TOKENS = (1, 64, 4096, 65536)


def _division(g, name):
    sig = 1.0 / (1.0 + jnp.exp2(g * -gated_fp8._LOG2E))
    return sig if name == "sigmoid" else g * sig


def _time(name, cfg, t, calls):
    spec = ops.OPS[name]
    structs, options = spec.example(t, jnp.dtype(jnp.bfloat16), **spec.sizes[cfg])
    n_sets = bench_ops.rotation_sets(spec.bytes_moved(cfg, t, jnp.bfloat16), bench_ops.cache_bytes(platform.current_target()))
    sets = [bench_ops._fill(jax.random.PRNGKey(s), structs) for s in range(n_sets)]
    f = jax.jit(lambda *a: spec.fn(*a, impl="pallas", **options))
    return timing.time_device(f, sets, n_calls=calls).median_us


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.ab_sigmoid", description=__doc__)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default=os.path.join("bench", "out"))
    args = p.parse_args(argv)
    rows = []
    kernel_form = gated_fp8._activation
    for name, cfg in CASES:
        for t in [int(x) for x in args.tokens.split(",")]:
            gated_fp8._activation = kernel_form
            rsqrt_us = _time(name, cfg, t, args.calls)
            gated_fp8._activation = _division
            try:
                div_us = _time(name, cfg, t, args.calls)
            finally:
                gated_fp8._activation = kernel_form
            rows.append({"op": name, "config": cfg, "tokens": t, "rsqrt_us": rsqrt_us, "division_us": div_us})
            print(f"{name} {cfg} T={t}: rsqrt {rsqrt_us:.2f} us, division {div_us:.2f} us, "
                  f"{div_us / rsqrt_us:.3f}x", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ab_sigmoid.json"), "w") as f:
        json.dump({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
