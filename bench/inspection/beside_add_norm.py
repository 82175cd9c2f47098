"""``python -m bench.inspection.beside_add_norm --out DIR``: k3pallas's ``add_rmsnorm`` (the
residual add fused into RMSNorm) timed beside the PyTorch peers that fuse the same two steps,
in ONE process with ONE clock: Liger's ``fused_add_rms_norm_forward`` and flash-linear-attention's
``layer_norm_fwd`` (RMSNorm with a residual, its ``prenorm`` path), plus XLA's fusion of the jnp
code and the copy ceiling (read two tensors, write two).

Every variant writes the normalized ``y`` and the new residual ``x + r``; k3pallas and XLA in
place (donated, ``bench.ops.ResidualStream``), the peers into new tensors, and each way once
more: the k3pallas kernel into new buffers (``fresh``: ``bench.ops.fresh_outputs``) and Liger's
kernel over its inputs (``liger_in_place``), which tells what writing over the inputs costs
either of them; both k3pallas variants are timed again after the peers (``again``,
``fresh_again``: whether the order of the timings matters); and the copy ceiling both ways,
XLA's from jax (``copy``), the library's row kernel with no weight through jax (``pallas_copy``:
the norm's tiles and launch config without its arithmetic) and a Triton row copy launched from
torch (``row_copy``: what the peers' launch path, allocator and compiler give without the
arithmetic). Each peer is checked
against a float64 NumPy oracle first (bf16 output: 2**-7 relative; the residual exact). Device
time from ``jax.profiler`` events (``bench.timing``; CUPTI records the torch kernels too), per
call over ``--calls`` calls cycling through input sets (3x the L2 where a set is small). The
peers are not dependencies of k3pallas: they travel to the H200 as wheels (``.whl``, the device
tool's README), with torch and triton from the image. Writes ``beside_add_norm.md`` / ``.json``.
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
from bench import ops as bench_ops, timing  # noqa: E402
from bench.report import write_report  # noqa: E402

EPS = 1e-6


def _peers():
    """{name: (run(x, r, w) -> (y, new_r), kernel-name fragment)} of the peers that import."""
    peers = {}
    try:
        from liger_kernel.ops.fused_add_rms_norm import fused_add_rms_norm_forward

        def liger(x, r, w):
            y, s, *_ = fused_add_rms_norm_forward(x, r, w, EPS, 0.0, "llama")
            return y, s
        peers["liger"] = (liger, "fused_add_rms_norm")
    except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
        print(f"liger: {type(e).__name__}: {e}", file=sys.stderr)
    try:
        from fla.modules.norm.layernorm import layer_norm_fwd

        def fla(x, r, w):
            y, _, _, res = layer_norm_fwd(x, w, None, EPS, residual=r, is_rms_norm=True)
            return y, res
        peers["fla"] = (fla, "layer_norm_fwd")
    except Exception as e:  # noqa: BLE001
        print(f"fla: {type(e).__name__}: {e}", file=sys.stderr)
    if "liger" in peers:  # last: it rewrites the input sets
        peers["liger_in_place"] = (_liger_in_place(), "fused_add_rms_norm")
    return peers


def _liger_in_place():
    """Liger's forward kernel launched over its inputs (y into x, the new residual into r), as
    vLLM's ``fused_add_rms_norm`` and k3pallas run: the in-place peer, like for like. Safe: each
    program reads its row whole before it writes it. Last of the peers (it rewrites the sets)."""
    import torch
    from liger_kernel.ops import fused_add_rms_norm as m

    def run(x, r, w):
        n_rows, n_cols = x.shape
        block, warps = m.calculate_settings(n_cols)  # as fused_add_rms_norm_forward launches it
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        m._fused_add_rms_norm_forward_kernel[(n_rows,)](
            x, x.stride(0), r, r.stride(0), x, x.stride(0), r, r.stride(0), w, w.stride(0),
            rstd, rstd.stride(0), n_cols, EPS, 0.0, m._str_to_casting_mode["llama"],
            BLOCK_SIZE=block, num_warps=warps, num_stages=2)
        return x, r
    return run


def _row_copy():
    """The copy ceiling on the peers' side: a Triton kernel (pip triton) launched from torch that
    reads x and r and writes them into new tensors, one program per row over the row's padded
    power of two of lanes on Liger's warps, as Liger's norm runs without its arithmetic. Beside
    ``copy`` (XLA's, from jax) it tells what the launch path, allocator and compiler give."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def row_copy2(x_ptr, r_ptr, y_ptr, s_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * n_cols
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        tl.store(y_ptr + row + cols, tl.load(x_ptr + row + cols, mask=mask), mask=mask)
        tl.store(s_ptr + row + cols, tl.load(r_ptr + row + cols, mask=mask), mask=mask)

    def run(x, r, w):
        n_rows, n_cols = x.shape
        block = triton.next_power_of_2(n_cols)
        warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
        y, s = torch.empty_like(x), torch.empty_like(r)
        row_copy2[(n_rows,)](x, r, y, s, n_cols, BLOCK=block, num_warps=warps)
        return y, s
    return run


def pallas_copy(fn, x, r):
    """The copy ceiling through jax and the library's own row kernel: ``x`` and ``r`` read and
    written to new buffers by the segments kernel with no weight (``norms.Segment(eps=None)``),
    on the launch config that ``fn``'s ``add_rmsnorm`` kernel has at this shape (rows, warps):
    the same tiles, masks and launch path as the norm, without its arithmetic."""
    from k3pallas.kernels import hooks, norms

    with hooks.recording() as launches:  # a function of its own: jax reuses fn's cached trace
        jax.jit(lambda x, r: fn(x, r)).lower(x, r)
    config = launches[-1].config
    segments = [norms.Segment(0, 0, x.shape[1], None), norms.Segment(1, 0, r.shape[1], None)]
    return jax.jit(lambda x, r: norms.segments_rows(
        [x, r], segments, [], key="copy", q=None, interpret=False,
        target=k3pallas.current_target(), config=config))


def _check(run, x, r, w):
    """A peer against the float64 oracle: the residual the rounded sum, y within bf16."""
    import torch

    y, s = run(x.clone(), r.clone(), w)  # an in-place peer writes over its inputs
    torch.cuda.synchronize()
    s64 = (x.double() + r.double()).bfloat16().double().cpu().numpy()
    np.testing.assert_array_equal(s.double().cpu().numpy(), s64)
    w64 = w.double().cpu().numpy()
    want = s64 / np.sqrt((s64 * s64).mean(-1, keepdims=True) + EPS) * w64
    np.testing.assert_allclose(y.double().cpu().numpy(), want, rtol=2**-7, atol=2**-7)


def _spread(us):
    us = sorted(us)
    n = len(us)
    return {"p10": us[n // 10], "median": statistics.median(us), "p90": us[(9 * n) // 10]}


def _torch_us(run, name, sets, w, calls):
    import torch

    events = timing.traced_events(lambda x, r: run(x, r, w), sets, calls, 3,
                                  sync=lambda _: torch.cuda.synchronize())
    ev = [e for e in events if name in e.name]
    if len(ev) != calls:
        raise RuntimeError(f"{len(ev)} events of {name} for {calls} calls")
    return [e.duration_ns / 1e3 for e in ev]


def _jax_us(fn, sets, calls):
    events = timing.traced_events(fn, sets, calls, 3)
    ns, k = timing.per_call_times(events, calls)
    return [x / 1e3 for x in ns], k


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.inspection.beside_add_norm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", default="7168,4096")
    p.add_argument("--tokens", default="1,8,64,256,1024,4096,16384,65536")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--sets", type=int, default=0,
                   help="input sets to cycle (default: 3x the L2, at most 16); 1: every variant on "
                        "one set, its data in L2 where it fits (the SMs' share of the time: "
                        "bench.inspection.resident)")
    p.add_argument("--out", default=os.path.join("bench", "out"))
    args = p.parse_args(argv)
    import torch

    peers = _peers()
    row_copy = _row_copy()  # compiled at its first call, once per row shape
    target = k3pallas.current_target()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    env = {"jax": jax.__version__, "torch": torch.__version__,
           "device_kind": jax.devices()[0].device_kind, "sets": args.sets or "rotated"}
    for d in (int(v) for v in args.hidden.split(",")):
        tw = torch.randn(d, device="cuda", generator=gen).bfloat16()
        jw = jnp.asarray(tw.float().cpu().numpy(), jnp.bfloat16)
        in_place = bench_ops.jit_for("add_rmsnorm", None)  # as the benchmark times it

        def norm(x, r, jw=jw):
            return k3pallas.add_rmsnorm(x, r, jw, EPS, impl="pallas")
        ours = in_place(norm)
        fresh = bench_ops.fresh_outputs(norm)  # the same kernel into new buffers
        xla = in_place(lambda x, r: k3pallas.add_rmsnorm(x, r, jw, EPS, impl="reference"))
        for t in (int(v) for v in args.tokens.split(",")):
            nbytes = 4 * t * d * 2  # read x and r, write y and the new residual
            n_sets = args.sets or bench_ops.rotation_sets(2 * t * d * 2,
                                                          bench_ops.cache_bytes(target), 16)
            key = jax.random.PRNGKey(t)
            jsets = [tuple(jax.random.normal(jax.random.fold_in(key, 2 * s + i), (t, d), jnp.bfloat16)
                           for i in range(2)) for s in range(n_sets)]
            tsets = [tuple(torch.randn(t, d, device="cuda", generator=gen).bfloat16()
                           for _ in range(2)) for _ in range(n_sets)]
            row = {"hidden": d, "tokens": t, "sets": n_sets}
            us, k = _jax_us(ours, jsets, args.calls)
            row["k3pallas"] = dict(_spread(us), kernels=k)
            us, k = _jax_us(fresh, jsets, args.calls)
            row["fresh"] = dict(_spread(us), kernels=k)
            us, k = _jax_us(xla, jsets, args.calls)
            row["xla"] = dict(_spread(us), kernels=k)
            make_copy, copies = bench_ops.copy_variants(nbytes)
            copy_sets = [make_copy(s) for s in range(n_sets)]
            best = min((_spread(_jax_us(fn, copy_sets, args.calls)[0]) for fn in copies.values()),
                       key=lambda v: v["median"])
            row["copy"] = best
            copy = pallas_copy(norm, *jsets[0])
            y, s = copy(*jsets[0])
            if not all(bool(jnp.array_equal(a, b)) for a, b in zip((y, s), jsets[0])):
                raise RuntimeError("the Pallas copy is not a copy")
            row["pallas_copy"] = _spread(_jax_us(copy, jsets, args.calls)[0])
            try:  # the same bytes copied from torch (one process, one clock)
                y, s = row_copy(*tsets[0], tw)
                if not (torch.equal(y, tsets[0][0]) and torch.equal(s, tsets[0][1])):
                    raise RuntimeError("the row copy is not a copy")
                row["row_copy"] = _spread(_torch_us(row_copy, "row_copy2", tsets, tw, args.calls))
            except Exception as e:  # noqa: BLE001 - reported in the table
                row["row_copy"] = {"error": f"{type(e).__name__}: {e}"[:300]}
            for name, (run, frag) in peers.items():
                try:
                    _check(run, *tsets[0], tw)
                    row[name] = _spread(_torch_us(run, frag, tsets, tw, args.calls))
                except Exception as e:  # noqa: BLE001 - reported in the table
                    row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            for name, fn in (("again", ours), ("fresh_again", fresh)):  # the order's control
                us, k = _jax_us(fn, jsets, args.calls)
                row[name] = dict(_spread(us), kernels=k)
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
            # Rewritten after every row: a run stopped at a time limit keeps what it measured.
            write(args.out, rows, list(peers), args.calls, env)
    print(report(rows, list(peers), args.calls, env))


def report(rows, peer_names, calls, env) -> str:
    fresh = ["fresh"] if rows and "fresh" in rows[0] else []
    again = ["again", "fresh_again"] if rows and "again" in rows[0] else []
    row_copy = [c for c in ("pallas_copy", "row_copy") if rows and c in rows[0]]
    cols = ["k3pallas", *fresh, "xla", *peer_names, *again, "copy", *row_copy]

    def cell(v):
        if "error" in v:
            return "failed (json)"
        return f"{v['median']:.2f}" + (f" ({v['kernels']})" if "kernels" in v else "")
    lines = [f"# add_rmsnorm beside the PyTorch peers, {env['device_kind']}", "",
             f"Device time per call, us, median of {calls} calls (`(n)`: kernels per call), "
             "jax.profiler clock for all, one process (`python -m bench.inspection."
             f"beside_add_norm`, jax {env['jax']}, torch {env['torch']}); bf16; k3pallas and xla "
             "in place (donated), the peers into new tensors (`liger_in_place`: Liger's kernel launched "
             "over its inputs, in place as k3pallas); `fresh`: the k3pallas kernel with its "
             "aliases removed, into new buffers as the peers (`bench.ops.fresh_outputs`); "
             "`again`, `fresh_again`: both timed once more after the peers (the order's control); "
             "`copy`: the copy of the same bytes "
             "(read x and r, write y and the residual; XLA's, from jax); `pallas_copy`: the same "
             "bytes copied by the library's row kernel with no weight, on the norm's launch "
             "config, through jax; `row_copy`: the same "
             "bytes copied by a Triton kernel launched from torch, one program per row on "
             "Liger's warps; `% copy`: copy / k3pallas."
             + (" ONE input set for every variant (`--sets 1`): the data in L2 where it fits."
                if env.get("sets") == 1 else ""), "",
             "| hidden | T | " + " | ".join(cols) + " | % copy |",
             "|---|---|" + "---|" * (len(cols) + 1)]
    for r in rows:
        pct = 100 * r["copy"]["median"] / r["k3pallas"]["median"]
        lines.append(f"| {r['hidden']} | {r['tokens']} | " + " | ".join(cell(r[c]) for c in cols)
                     + f" | {pct:.0f} |")
    return "\n".join(lines)


def write(out, rows, peer_names, calls, env) -> None:
    write_report(out, "beside_add_norm", report(rows, peer_names, calls, env),
                 dict(env, calls=calls, rows=rows))


if __name__ == "__main__":
    main()
