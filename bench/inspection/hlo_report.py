"""``python -m bench.inspection.hlo_report --out DIR``: what XLA compiles the integration paths into.

For each path (the MLA front-end norm on the packed projection and after slicing; the FP8 o_proj
with its weight stored [K, N] and [N, K], with the default and the highest precision; the bf16
o_proj) it writes the launched ENTRY instructions, the custom-call targets, on a GPU the device
time per call, and for the FP8 GEMMs the accumulation error, to ``hlo_report.md`` / ``.json``
(with ``--hlo-text`` also each optimized module, ``hlo_<name>.txt``).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

import k3pallas as kp

from bench import timing
from bench.inspection import hlo
from bench.report import write_report


def paths(tokens: int, k: int, n: int, impl: str):
    """name -> (fn, args)."""
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    bf = jnp.bfloat16
    qkv = jax.random.normal(keys[0], (tokens, 2112), bf)
    wq, wkv = jnp.ones((1536,), bf), jnp.ones((512,), bf)
    fmt = kp.Fp8PerToken(kp.default_fp8_dtype())
    x = jax.random.normal(keys[1], (tokens, k), bf)
    w = jax.random.normal(keys[2], (k, n), bf) * 0.02
    qw_kn = kp.quantize_weight(w, fmt, layout="kn")
    qw_nk = kp.quantize_weight(w, fmt, layout="nk")
    qa = kp.quantize(x, fmt, impl="reference")

    def linear(precision=None, out_dtype=bf):
        def fn(qa, qw):
            return kp.linear(qa, qw, precision=precision, out_dtype=out_dtype)
        fn.f32_output = (lambda qa, qw: kp.linear(  # for the accumulation error
            qa, qw, precision=precision, out_dtype=jnp.float32))
        return fn

    def sliced(a, wq, wkv):
        q, kv = kp.fused_q_kv_rmsnorm(a[:, :1536], a[:, 1536:2048], wq, wkv, impl=impl)
        return q, kv, a[:, 2048:]

    return {
        "mla_q_kv_norm_packed": (lambda a, wq, wkv: kp.mla_q_kv_norm(a, wq, wkv, impl=impl),
                                 (qkv, wq, wkv)),
        "mla_slice_then_fused": (sliced, (qkv, wq, wkv)),
        "fp8_linear_w_kn": (linear(), (qa, qw_kn)),
        "fp8_linear_w_nk": (linear(), (qa, qw_nk)),
        "fp8_linear_w_nk_highest": (linear(lax.Precision.HIGHEST), (qa, qw_nk)),
        "bf16_linear": (lambda x, w: x @ w, (x, w)),
    }


def accumulation_error(out, qa, qw, rows=64) -> float:
    """``max |out - exact| / (|a| @ |w|)`` over ``rows`` rows, with ``exact`` the float64 product
    of the dequantized operands: the GEMM's accumulation error relative to the magnitude it
    accumulates (``out`` is the float32-output variant, so no output rounding is included)."""
    import numpy as np

    d = np.asarray(qa.data[:rows].astype(jnp.float32), np.float64) * np.asarray(qa.scale[:rows])
    w = np.asarray(qw.dequantize(), np.float64)
    exact, mag = d @ w, np.abs(d) @ np.abs(w)
    return float(np.max(np.abs(np.asarray(out[:rows], np.float64) - exact) / mag))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--k", type=int, default=96 * 128, help="o_proj input width (KDA 96 x 128)")
    p.add_argument("--n", type=int, default=7168, help="o_proj output width (hidden size)")
    p.add_argument("--hlo-text", action="store_true", help="also write each module's HLO text")
    args = p.parse_args(argv)
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    impl = "pallas" if on_gpu else "interpret"
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name, (fn, fargs) in paths(args.tokens, args.k, args.n, impl).items():
        text = hlo.compiled_text(fn, *fargs)
        if args.hlo_text:
            with open(os.path.join(args.out, f"hlo_{name}.txt"), "w") as f:
                f.write(text)
        row = {"path": name, "launched": dict(hlo.data_moving_ops(text)),
               "custom_calls": sorted(set(hlo.custom_call_targets(text))),
               "fp8_gemm": hlo.FP8_GEMM_TARGET in text}
        if on_gpu:
            t = timing.time_device(jax.jit(fn), [fargs], n_calls=20)
            row.update(device_us=round(t.median_us, 2), kernels=list(t.kernel_names))
        if name.startswith("fp8_linear"):
            row["max_err_over_magnitude"] = accumulation_error(jax.jit(fn.f32_output)(*fargs), *fargs)
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    lines = [f"# Compiled HLO of the integration paths ({jax.devices()[0].device_kind}, jax "
             f"{jax.__version__}; T={args.tokens}, o_proj K={args.k} N={args.n})", "",
             "| path | launched ENTRY ops | custom calls | FP8 GEMM | device us | max err / magnitude |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        err = r.get("max_err_over_magnitude")
        lines.append(f"| {r['path']} | {r['launched']} | {', '.join(r['custom_calls'])} | "
                     f"{r['fp8_gemm']} | {r.get('device_us', '-')} | "
                     f"{'-' if err is None else f'{err:.2e}'} |")
    write_report(args.out, "hlo_report", "\n".join(lines) + "\n",
                 {"tokens": args.tokens, "k": args.k, "n": args.n, "rows": rows})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
