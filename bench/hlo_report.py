"""``python -m bench.hlo_report --out DIR``: what XLA compiles the integration paths into.

For each path (the MLA front-end norm on the packed projection and after slicing; the FP8 o_proj
with its weight stored [K, N] and [N, K]; the bf16 o_proj) it writes the optimized HLO text
(``hlo_<name>.txt``), the launched ENTRY instructions, the custom-call targets and, on a GPU, the
device time per call, to ``hlo_report.md`` / ``.json``.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

import k3pallas as kp

from bench import hlo, timing
from bench.report import write_report


def paths(tokens: int, k: int, n: int, impl: str):
    """name -> (fn, args)."""
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    bf = jnp.bfloat16
    qkv = jax.random.normal(keys[0], (tokens, 2112), bf)
    wq, wkv = jnp.ones((1536,), bf), jnp.ones((512,), bf)
    fp8 = kp.default_fp8_dtype()
    x = jax.random.normal(keys[1], (tokens, k), bf)
    w = jax.random.normal(keys[2], (k, n), bf) * 0.02
    w8, ws = kp.quantize_weight_per_channel(w, fp8_dtype=fp8)
    qa = kp.per_token_fp8_quant(x, fp8_dtype=fp8, impl="reference")
    w8_nk = w8.T.copy()

    def sliced(a, wq, wkv):
        q, kv = kp.fused_q_kv_rmsnorm(a[:, :1536], a[:, 1536:2048], wq, wkv, impl=impl)
        return q, kv, a[:, 2048:]

    def linear_nk(qa, w_nk, ws):  # weight stored [N, K]: contracting dim 1 on both operands
        acc = lax.dot_general(qa.data, w_nk, (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.float32)
        return (acc * qa.scale * ws).astype(bf)

    return {
        "mla_q_kv_norm_packed": (lambda a, wq, wkv: kp.mla_q_kv_norm(a, wq, wkv, impl=impl),
                                 (qkv, wq, wkv)),
        "mla_slice_then_fused": (sliced, (qkv, wq, wkv)),
        "fp8_linear_w_kn": (lambda qa, w8, ws: kp.fp8_linear(qa, w8, ws), (qa, w8, ws)),
        "fp8_linear_w_nk": (linear_nk, (qa, w8_nk, ws)),
        "bf16_linear": (lambda x, w: x @ w, (x, w)),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--k", type=int, default=96 * 128, help="o_proj input width (KDA 96 x 128)")
    p.add_argument("--n", type=int, default=7168, help="o_proj output width (hidden size)")
    args = p.parse_args(argv)
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    impl = "pallas" if on_gpu else "interpret"
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name, (fn, fargs) in paths(args.tokens, args.k, args.n, impl).items():
        text = hlo.compiled_text(fn, *fargs)
        with open(os.path.join(args.out, f"hlo_{name}.txt"), "w") as f:
            f.write(text)
        row = {"path": name, "launched": dict(hlo.data_moving_ops(text)),
               "custom_calls": sorted(set(hlo.custom_call_targets(text))),
               "fp8_gemm": hlo.FP8_GEMM_TARGET in text}
        if on_gpu:
            t = timing.time_device(jax.jit(fn), [fargs], n_calls=20)
            row.update(device_us=round(t.median_us, 2), kernels=list(t.kernel_names))
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    lines = [f"# Compiled HLO of the integration paths ({jax.devices()[0].device_kind}, jax "
             f"{jax.__version__}; T={args.tokens}, o_proj K={args.k} N={args.n})", "",
             "| path | launched ENTRY ops | custom calls | FP8 GEMM | device us |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['path']} | {r['launched']} | {', '.join(r['custom_calls'])} | "
                     f"{r['fp8_gemm']} | {r.get('device_us', '-')} |")
    write_report(args.out, "hlo_report", "\n".join(lines) + "\n",
                 {"tokens": args.tokens, "k": args.k, "n": args.n, "rows": rows})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
