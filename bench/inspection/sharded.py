"""``python -m bench.inspection.sharded --out DIR``: every op sharded over the local GPUs against one GPU.

Tokens are sharded over all GPUs (a data-parallel split); for the gated ops the heads are
sharded too (tensor parallelism), with the FP8 scale local to each GPU's heads
(``scale_groups`` = GPUs) and with one scale per token across them (``scale_groups=1``, an
all-reduce max). Each sharded case is device-timed per GPU (the slowest GPU's kernel time per
call) next to the single-GPU time of the same global problem, and its compiled module is checked
for all-gathers (there must be none). Writes ``sharded.md`` / ``sharded.json``. Needs >= 2 GPUs
to mean anything; with one it still runs every case (a one-device mesh) as a smoke test.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import k3pallas as kp

from bench import timing
from bench.report import write_report


def _rand(seed, shape, dtype=jnp.bfloat16):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


def cases(tokens: int, n: int):
    """(name, fn, args, specs): specs per arg, for a mesh ("x",) of n GPUs."""
    x32, g32 = _rand(1, (tokens, 32, 128)), _rand(2, (tokens, 32, 128))
    x96, g96 = _rand(3, (tokens, 96, 128)), _rand(4, (tokens, 96, 128))
    w = _rand(5, (128,), jnp.float32)
    q, kv, qkv = _rand(6, (tokens, 1536)), _rand(7, (tokens, 512)), _rand(8, (tokens, 2112))
    wq, wkv = _rand(9, (1536,)), _rand(10, (512,))
    t, h, none = P("x"), P(None, "x"), P()
    yield "fused_q_kv_rmsnorm, tokens", lambda *a: kp.fused_q_kv_rmsnorm(*a), (q, kv, wq, wkv), (t, t, none, none)
    yield "mla_q_kv_norm, tokens", lambda *a: kp.mla_q_kv_norm(*a), (qkv, wq, wkv), (t, none, none)
    yield "rmsnorm, tokens", lambda *a: kp.rmsnorm(*a), (q, wq), (t, none)
    yield "rmsnorm_gated 32x128, tokens", lambda *a: kp.rmsnorm_gated(*a), (x32, w, g32), (t, none, t)
    yield "rmsnorm_gated 32x128, heads", lambda *a: kp.rmsnorm_gated(*a), (x32, w, g32), (h, none, h)
    for name, x, g in (("32x128", x32, g32), ("96x128", x96, g96)):
        yield (f"rmsnorm_gated_fp8 {name}, tokens", lambda *a: kp.rmsnorm_gated_fp8_per_token(*a),
               (x, w, g), (t, none, t))
        yield (f"rmsnorm_gated_fp8 {name}, heads, local scale",
               lambda *a: kp.rmsnorm_gated_fp8_per_token(*a, scale_groups=n), (x, w, g), (h, none, h))
        yield (f"rmsnorm_gated_fp8 {name}, heads, global scale",
               lambda *a: kp.rmsnorm_gated_fp8_per_token(*a, scale_groups=1), (x, w, g), (h, none, h))
    y = _rand(11, (tokens, 4096))
    yield "per_token_fp8_quant 4096, tokens", lambda a: kp.per_token_fp8_quant(a), (y,), (t,)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tokens", default="4096,65536")
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args(argv)
    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("x",))
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, fn, fargs, specs in cases(tokens, n):
            single = timing.time_device(jax.jit(fn), [fargs], n_calls=args.calls)
            sharded_args = tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(fargs, specs))
            text = jax.jit(fn).lower(*sharded_args).compile().as_text()
            multi = timing.time_device_multi(jax.jit(fn), [sharded_args], n_calls=args.calls)
            row = {"case": name, "tokens": tokens, "gpus": n, "single_us": single.median_us,
                   "sharded_us": multi["median_us"], "per_gpu_us": multi["per_gpu_us"],
                   "kernels_per_call": multi["kernels_per_call"],
                   "all_gather": text.count("all-gather-start") + text.count("all-gather("),
                   "all_reduce": "all-reduce" in text}
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    lines = [f"# Sharded over {n} x {devices[0].device_kind} (jax {jax.__version__})", "",
             "Device time per call: single = the whole problem on one GPU; sharded = the slowest "
             "GPU's kernel time per call (collectives included). all-gathers: in the compiled "
             "sharded module (must be 0).", "",
             "| case | T | single us | sharded us | speed-up | all-gathers | all-reduce |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['tokens']} | {r['single_us']:.2f} | {r['sharded_us']:.2f} | "
                     f"{r['single_us'] / r['sharded_us']:.2f} | {r['all_gather']} | {r['all_reduce']} |")
    write_report(args.out, "sharded", "\n".join(lines), {"gpus": n, "rows": rows})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
