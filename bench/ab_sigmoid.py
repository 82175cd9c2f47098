"""``python -m bench.ab_sigmoid``: the gated kernels' sigmoid as the kernels compute it,
``rsqrt(1 + e)**2``, against the IEEE division ``1 / (1 + e)`` it replaced, in the same run on
the same machine (device time per call, each op's own launch config). A measurement of one
design choice (bench/NOTES.md), not part of the benchmark.
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
    """The fused kernel's device time, with the benchmark's inputs and input rotation."""
    case = bench_ops.make_case(name, cfg, t, "bfloat16", "pallas")
    n_sets = bench_ops.rotation_sets(case.input_bytes, bench_ops.cache_bytes(platform.current_target()))
    sets = [case.make_inputs(s) for s in range(n_sets)]
    return timing.time_device(case.variants["k3pallas"], sets, n_calls=calls).median_us


def _measure(variant, tokens, calls):
    """{(op, config, T): us} with the kernels' sigmoid in ``variant`` (in this process only)."""
    if variant == "division":
        gated_fp8._activation = _division
    return {f"{name}|{cfg}|{t}": _time(name, cfg, t, calls) for name, cfg in CASES for t in tokens}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.ab_sigmoid", description=__doc__)
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default=os.path.join("bench", "out"))
    p.add_argument("--variant", choices=("rsqrt", "division"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    tokens = [int(x) for x in args.tokens.split(",")]
    if args.variant:  # one variant, in a fresh process: no trace of the other one is cached
        print(json.dumps(_measure(args.variant, tokens, args.calls)))
        return 0
    got = {}
    for variant in ("rsqrt", "division"):
        out = subprocess.run([sys.executable, "-m", "bench.ab_sigmoid", "--variant", variant,
                              "--tokens", args.tokens, "--calls", str(args.calls)],
                             capture_output=True, text=True, check=True).stdout
        got[variant] = json.loads(out.strip().splitlines()[-1])
    rows = []
    for key, rsqrt_us in got["rsqrt"].items():
        name, cfg, t = key.split("|")
        div_us = got["division"][key]
        rows.append({"op": name, "config": cfg, "tokens": int(t), "rsqrt_us": rsqrt_us, "division_us": div_us})
        print(f"{name} {cfg} T={t}: rsqrt {rsqrt_us:.2f} us, division {div_us:.2f} us, "
              f"{div_us / rsqrt_us:.3f}x", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ab_sigmoid.json"), "w") as f:
        json.dump({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
