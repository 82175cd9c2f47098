"""``python -m bench.inspection.beside_qkv --out DIR``: k3pallas's ``fused_q_kv_rmsnorm`` timed
beside a PyTorch Triton kernel of vLLM's q/kv design, in ONE process, with ONE clock.

Issue 26 compares our decode times with the seed kernels' times quoted from another session;
small kernels move 2-6 % between H200 machines and the two profilers' clocks differ by a few
32 ns ticks, so only a same-process comparison settles a few-percent question. The reference
kernel follows the design vLLM publishes (grid (T, 2): program (t, 0) normalizes q's row t,
(t, 1) kv's, each in one power-of-two block of the wider width, float32 math, one cast at the
store, row strides as arguments); it is written here from that description and checked against a
float64 NumPy RMSNorm. It runs launched as ``--designs`` says: 4 or 8 warps, with programmatic
dependent launch (vLLM's launch on Hopper and later: ``gdc_wait`` first, then the next kernel may
launch), and replayed from one CUDA graph (how vLLM runs a decode step).

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
    """(run(q, kv, wq, wkv, warps, pdl) -> (q_out, kv_out), kernel name) of the torch kernel."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def qkv_design_rmsnorm(q, q_out, wq, q_stride, q_out_stride, kv, kv_out, wkv, kv_stride,
                           kv_out_stride, eps, QS: tl.constexpr, KS: tl.constexpr,
                           BLOCK: tl.constexpr, launch_pdl: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        if tl.program_id(1) == 0:
            n = QS
            src = q + t * q_stride
            dst = q_out + t * q_out_stride
            w = wq
        else:
            n = KS
            src = kv + t * kv_stride
            dst = kv_out + t * kv_out_stride
            w = wkv
        if launch_pdl:  # wait for the previous kernel, then let the next one launch
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        lanes = tl.arange(0, BLOCK)
        m = lanes < n
        x = tl.load(src + lanes, mask=m, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
        y = x * r * tl.load(w + lanes, mask=m, other=0.0).to(tl.float32)
        tl.store(dst + lanes, y.to(dst.dtype.element_ty), mask=m)

    def run(q, kv, wq, wkv, warps, pdl):
        q_out, kv_out = torch.empty_like(q), torch.empty_like(kv)
        # ``launch_pdl`` is both the kernel's flag and Triton's launch option (the PDL attribute).
        qkv_design_rmsnorm[(q.shape[0], 2)](
            q, q_out, wq, q.stride(0), q_out.stride(0), kv, kv_out, wkv, kv.stride(0),
            kv_out.stride(0), EPS, QS=q.shape[1], KS=kv.shape[1],
            BLOCK=triton.next_power_of_2(max(q.shape[1], kv.shape[1])), num_warps=warps,
            launch_pdl=pdl)
        return q_out, kv_out

    return run, "qkv_design_rmsnorm"


def _design(label):
    """'w4' -> (4, False, False); '+pdl': programmatic dependent launch; '+graph': the calls
    captured in one CUDA graph and replayed (how vLLM runs decode steps)."""
    warps, *flags = label.split("+")
    if not warps.startswith("w") or not warps[1:].isdigit() or set(flags) - {"pdl", "graph"}:
        raise SystemExit(f"--designs: expected entries like w4, w4+pdl or w4+pdl+graph, got "
                         f"{label!r}")
    return int(warps[1:]), "pdl" in flags, "graph" in flags


def _spread(us):
    us = sorted(us)
    n = len(us)
    return {"p10": us[n // 10], "median": statistics.median(us), "p90": us[(9 * n) // 10]}


def _cell(v):
    """A report cell: p10 / median / p90, and the overlapped calls where there were any."""
    if "error" in v:
        return "failed (json)"
    txt = " / ".join(f"{v[k]:.2f}" for k in ("p10", "median", "p90"))
    return txt + (f" ({v['overlaps']} overlapped)" if v.get("overlaps") else "")


def _torch_times(run, name, sets, weights, design, calls):
    """Per-call device times (us) of the torch kernel and how many calls began before the
    previous one ended (a programmatic dependent launch can overlap them)."""
    import torch

    warps, pdl, graph = design
    call = lambda q, kv: run(q, kv, *weights, warps, pdl)  # noqa: E731
    if graph:
        for i in range(len(sets)):
            call(*sets[i])
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                call(*sets[i % len(sets)])
        events = timing.traced_events(lambda: g.replay(), [()], 1, 3,
                                      sync=lambda _: torch.cuda.synchronize())
    else:
        events = timing.traced_events(call, sets, calls, 32,
                                      sync=lambda _: torch.cuda.synchronize())
    ev = [e for e in events if name in e.name]
    if len(ev) != calls:
        raise RuntimeError(f"{len(ev)} events of {name} for {calls} calls")
    overlaps = sum(b.start_ns < a.start_ns + a.duration_ns for a, b in zip(ev, ev[1:]))
    return [e.duration_ns / 1e3 for e in ev], overlaps


def _check(run, torch_set, weights, warps, pdl):
    """The reference against a float64 NumPy RMSNorm (bf16 output: 2**-7 relative)."""
    q_out, kv_out = run(*torch_set, *weights, warps, pdl)
    for x, w, y in ((torch_set[0], weights[0], q_out), (torch_set[1], weights[1], kv_out)):
        x64, w64 = x.double().cpu().numpy(), w.double().cpu().numpy()
        want = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + EPS) * w64
        np.testing.assert_allclose(y.double().cpu().numpy(), want, rtol=2**-7, atol=2**-7)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.inspection.beside_qkv", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,8,64,256")
    p.add_argument("--sets", default="1,8,32,128")
    p.add_argument("--designs", default="w4,w8,w4+pdl,w4+graph,w4+pdl+graph",
                   help="reference launches: wN = num_warps N (Triton's default is 4); +pdl: "
                        "programmatic dependent launch (vLLM's launch on Hopper and later); "
                        "+graph: the calls replayed from one CUDA graph")
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
    designs = {d: _design(d) for d in args.designs.split(",")}
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
        failed = {}
        for label, (warps, pdl, _) in designs.items():
            try:
                _check(run, tsets[0], tw, warps, pdl)
            except AssertionError:
                raise
            except Exception as e:  # e.g. a Triton without PDL: say so, time the rest
                failed[label] = {"error": f"{type(e).__name__}: {e}"[:300]}
        for s in n_sets:
            events = timing.traced_events(ours, jsets[:s], args.calls, 3)
            ns, _ = timing.per_call_times(events, args.calls)
            row = {"tokens": t, "sets": s, "set_mb": t * (DQ + DKV) * 2 / 2**20,
                   "k3pallas": _spread([x / 1e3 for x in ns])}
            for label, d in designs.items():
                if label in failed:
                    row[f"design_{label}"] = failed[label]
                    continue
                us, overlaps = _torch_times(run, name, tsets[:s], tw, d, args.calls)
                row[f"design_{label}"] = dict(_spread(us), overlaps=overlaps)
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    cols = ["k3pallas"] + [f"design_{d}" for d in designs]
    lines = [f"# fused q/kv RMSNorm beside a kernel of vLLM's design, {jax.devices()[0].device_kind}",
             "", "Device time per call, us, p10 / median / p90 of "
             f"{args.calls} calls, jax.profiler clock for both, one process "
             "(`python -m bench.inspection.beside_qkv`). `design_wN`: the reference kernel with "
             "N warps; `+pdl`: launched with programmatic dependent launch (as vLLM does on "
             "Hopper); `+graph`: the calls replayed from one CUDA graph; `(n overlapped)`: calls "
             "that began before the previous one ended. `sets`: input sets cycled "
             "(the benchmark cycles 32).", "",
             "| T | sets (MB each) | " + " | ".join(cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for r in rows:
        cells = [_cell(r[c]) for c in cols]
        lines.append(f"| {r['tokens']} | {r['sets']} ({r['set_mb']:.2f}) | " + " | ".join(cells) + " |")
    md = "\n".join(lines)
    write_report(args.out, "beside_qkv", md, {"jax": jax.__version__, "torch": torch.__version__,
                                              "device_kind": jax.devices()[0].device_kind,
                                              "rows": rows})
    print(md)


if __name__ == "__main__":
    main()
