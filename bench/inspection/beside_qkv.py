"""``python -m bench.inspection.beside_qkv --out DIR``: k3pallas's ``fused_q_kv_rmsnorm`` timed
beside a PyTorch Triton kernel of vLLM's q/kv design, in ONE process, with ONE clock.

Issue 26 compares our decode times with the seed kernels' times quoted from another session;
small kernels move 2-6 % between H200 machines and the two profilers' clocks differ by a few
32 ns ticks, so only a same-process comparison settles a few-percent question. The reference
kernel follows the design vLLM publishes (grid (T, 2): program (t, 0) normalizes q's row t,
(t, 1) kv's, each in one power-of-two block of the wider width, float32 math, one cast at the
store); it is written here from that description and checked against a float64 NumPy RMSNorm.

Both are timed with ``jax.profiler`` device events (``bench.timing``; CUPTI records the torch
kernels too), per call over 60 calls, cycling through 1, 8, 32 and 128 input sets: with 1 MB
sets (T = 256) the L2 holds 1-32 sets but not 128, so the rows show the cached and the
memory-bound regimes, and the benchmark's own (32 sets) between them. Needs torch and triton
(the H200 image has them; neither is a dependency of k3pallas). Writes ``beside_qkv.md`` /
``.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import k3pallas  # noqa: E402
from bench import timing  # noqa: E402
from bench.report import write_report  # noqa: E402

DQ, DKV, EPS = 1536, 512, 1e-6


def _reference():
    """(run(q, kv, wq, wkv, warps) -> (q_out, kv_out), kernel name) of the torch kernel."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def qkv_design_rmsnorm(q, q_out, wq, kv, kv_out, wkv, eps, QS: tl.constexpr,
                           KS: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        if tl.program_id(1) == 0:
            n = QS
            src = q + t * QS
            dst = q_out + t * QS
            w = wq
        else:
            n = KS
            src = kv + t * KS
            dst = kv_out + t * KS
            w = wkv
        lanes = tl.arange(0, BLOCK)
        m = lanes < n
        x = tl.load(src + lanes, mask=m, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
        y = x * r * tl.load(w + lanes, mask=m, other=0.0).to(tl.float32)
        tl.store(dst + lanes, y.to(dst.dtype.element_ty), mask=m)

    def run(q, kv, wq, wkv, warps):
        q_out, kv_out = torch.empty_like(q), torch.empty_like(kv)
        qkv_design_rmsnorm[(q.shape[0], 2)](
            q, q_out, wq, kv, kv_out, wkv, EPS, QS=q.shape[1], KS=kv.shape[1],
            BLOCK=triton.next_power_of_2(max(q.shape[1], kv.shape[1])), num_warps=warps)
        return q_out, kv_out

    return run, "qkv_design_rmsnorm"


def _spread(us):
    us = sorted(us)
    n = len(us)
    return {"p10": us[n // 10], "median": statistics.median(us), "p90": us[(9 * n) // 10]}


def _torch_times(run, name, sets, weights, warps, calls):
    import torch

    events = timing.traced_events(lambda q, kv: run(q, kv, *weights, warps), sets, calls, 32,
                                  sync=lambda _: torch.cuda.synchronize())
    us = [e.duration_ns / 1e3 for e in events if name in e.name]
    if len(us) != calls:
        raise RuntimeError(f"{len(us)} events of {name} for {calls} calls")
    return us


def _check(run, torch_set, weights, warps):
    """The reference against a float64 NumPy RMSNorm (bf16 output: 2**-7 relative)."""
    q_out, kv_out = run(*torch_set, *weights, warps)
    for x, w, y in ((torch_set[0], weights[0], q_out), (torch_set[1], weights[1], kv_out)):
        x64, w64 = x.double().cpu().numpy(), w.double().cpu().numpy()
        want = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + EPS) * w64
        np.testing.assert_allclose(y.double().cpu().numpy(), want, rtol=2**-7, atol=2**-7)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.inspection.beside_qkv", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,8,64,256")
    p.add_argument("--sets", default="1,8,32,128")
    p.add_argument("--warps", default="4,8", help="the reference kernel's num_warps")
    p.add_argument("--calls", type=int, default=60)
    p.add_argument("--out", default=os.path.join("bench", "out"))
    args = p.parse_args(argv)
    import torch

    run, name = _reference()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tw = (torch.randn(DQ, device="cuda", generator=gen).bfloat16(),
          torch.randn(DKV, device="cuda", generator=gen).bfloat16())
    jw = tuple(jnp.asarray(w.float().cpu().numpy(), jnp.bfloat16) for w in tw)
    ours = jax.jit(lambda q, kv: k3pallas.fused_q_kv_rmsnorm(q, kv, *jw, eps=EPS, impl="pallas"))
    warps = [int(w) for w in args.warps.split(",")]
    n_sets = [int(s) for s in args.sets.split(",")]
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        tsets = [(torch.randn(t, DQ, device="cuda", generator=gen).bfloat16(),
                  torch.randn(t, DKV, device="cuda", generator=gen).bfloat16())
                 for _ in range(max(n_sets))]
        key = jax.random.PRNGKey(t)
        jsets = [(jax.random.normal(jax.random.fold_in(key, 2 * s), (t, DQ), jnp.bfloat16),
                  jax.random.normal(jax.random.fold_in(key, 2 * s + 1), (t, DKV), jnp.bfloat16))
                 for s in range(max(n_sets))]
        for w in warps:
            _check(run, tsets[0], tw, w)
        for s in n_sets:
            events = timing.traced_events(ours, jsets[:s], args.calls, 3)
            ns, _ = timing.per_call_times(events, args.calls)
            row = {"tokens": t, "sets": s, "set_mb": t * (DQ + DKV) * 2 / 2**20,
                   "k3pallas": _spread([x / 1e3 for x in ns])}
            for w in warps:
                row[f"design_w{w}"] = _spread(_torch_times(run, name, tsets[:s], tw, w, args.calls))
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    cols = ["k3pallas"] + [f"design_w{w}" for w in warps]
    lines = [f"# fused q/kv RMSNorm beside a kernel of vLLM's design, {jax.devices()[0].device_kind}",
             "", "Device time per call, us, p10 / median / p90 of "
             f"{args.calls} calls, jax.profiler clock for both, one process "
             "(`python -m bench.inspection.beside_qkv`). `design_wN`: the reference kernel with "
             "N warps. `sets`: input sets cycled (the benchmark cycles 32).", "",
             "| T | sets (MB each) | " + " | ".join(cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for r in rows:
        cells = [" / ".join(f"{r[c][k]:.2f}" for k in ("p10", "median", "p90")) for c in cols]
        lines.append(f"| {r['tokens']} | {r['sets']} ({r['set_mb']:.2f}) | " + " | ".join(cells) + " |")
    md = "\n".join(lines)
    write_report(args.out, "beside_qkv", md, {"jax": jax.__version__, "torch": torch.__version__,
                                              "device_kind": jax.devices()[0].device_kind,
                                              "rows": rows})
    print(md)


if __name__ == "__main__":
    main()
