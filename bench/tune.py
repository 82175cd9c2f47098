"""``python -m bench.tune``: sweep launch configs on the GPU and write the per-platform table.

For each case of ``bench.cases`` (an op with an output format), its model configs and each
token count, it times every (rows per program, num_warps) pair (``hooks.forced``) with
device-side timing (the kernels have no loop, so ``num_stages`` stays 1), and, with
``--splits 1,2``, a row block on one or two programs where the kernel can (the joint norms;
the others skip it), and compares the best with the heuristic default. ``--write`` merges the
winners into ``k3pallas/kernels/tuned_configs.json`` under the device's architecture and the
launch key (the op with its output format), which ``launch.launch_config`` reads. Results (every
point) go to ``--out``/tune.json and a summary table to tune.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp

import k3pallas as kp
from bench import cases as ops
from k3pallas import platform
from k3pallas.kernels import common, hooks, launch

from bench import ops as bench_ops
from bench import timing
from bench.report import write_report

# ------------------------------------------------------------------------------------------------
# The scaled FP8 GEMM (``--gemm``): its configs per (format, N, K) and token bucket
# ------------------------------------------------------------------------------------------------

GEMM_TOKENS = (1, 16, 64, 512, 4096)


def amd_lds_bytes(cfg) -> int:
    """The GEMM's LDS on gfx942 / gfx950 as XLA's ROCm compile gives it (the gate's reports):
    the operand tiles of ``k_unroll`` steps, ``num_stages - 1`` deep."""
    return (cfg.block_m + cfg.block_n) * cfg.block_k * cfg.k_unroll * max(cfg.num_stages - 1, 1)


def gemm_candidates(t: int, block_scales: bool, amd: bool = False) -> list:
    """The GEMM configs swept at ``t`` tokens: decode tiles of 16 rows (narrow column blocks for
    many programs, or the swapped tile), mid-size tiles, prefill tiles; column blocks within the
    weight's 128-blocks where its scales are per block."""
    C = launch.GemmConfig
    if t <= 16:
        c = [C(16, 16, 128, 4, 4), C(16, 32, 128, 4, 4), C(16, 32, 128, 4, 6), C(16, 64, 128, 4, 4),
             C(16, 64, 128, 4, 4, True), C(16, 64, 128, 4, 6, True), C(16, 128, 128, 4, 4, True),
             C(16, 128, 128, 8, 4, True), C(16, 32, 128, 2, 4), C(16, 16, 128, 2, 6),
             # deep pipelines: most of a short K in flight at once
             C(16, 64, 128, 4, 8, True), C(16, 64, 128, 4, 12, True), C(16, 32, 128, 4, 8),
             C(16, 32, 128, 4, 12), C(16, 16, 128, 2, 12),
             # 2 or 4 K steps an iteration (stages count iterations: the same bytes in flight)
             C(16, 64, 128, 4, 4, True, k_unroll=2), C(16, 64, 128, 4, 6, True, k_unroll=2),
             C(16, 64, 128, 4, 3, True, k_unroll=4), C(16, 32, 128, 4, 4, k_unroll=2),
             C(16, 32, 128, 4, 6, k_unroll=2)]
        if not block_scales:
            c += [C(16, 32, 256, 4, 4), C(16, 64, 256, 4, 3, True)]
    elif t <= 128:
        c = [C(16, 32, 128, 4, 4), C(32, 32, 128, 4, 4), C(64, 32, 128, 4, 4), C(64, 64, 128, 4, 4),
             C(64, 64, 128, 4, 3), C(32, 64, 128, 4, 4), C(16, 64, 128, 4, 4), C(64, 128, 128, 4, 4),
             # more of a long K in flight (the 72 programs of 64 x 64 at K = 7168 hold 4.6 MB),
             # and its loop overhead once per 2 or 4 steps (the decode tiles' gain at K = 7168)
             C(64, 64, 128, 4, 6), C(64, 64, 128, 4, 8),
             C(64, 64, 128, 4, 3, k_unroll=2), C(64, 64, 128, 4, 3, k_unroll=4),
             C(64, 64, 128, 4, 2, k_unroll=4), C(64, 32, 128, 4, 3, k_unroll=2),
             C(64, 32, 128, 4, 3, k_unroll=4), C(32, 64, 128, 4, 3, k_unroll=4),
             C(16, 64, 128, 4, 3, True, k_unroll=4)]
    elif t <= 1024:
        c = [C(64, 64, 128, 4, 4), C(64, 128, 128, 4, 3), C(64, 128, 128, 4, 4), C(128, 64, 128, 4, 4),
             C(128, 128, 128, 8, 3), C(128, 128, 128, 4, 3), C(64, 64, 128, 4, 3), C(32, 64, 128, 4, 4),
             C(64, 128, 128, 4, 2, k_unroll=2), C(128, 128, 128, 8, 2, k_unroll=2),
             C(64, 64, 128, 4, 3, k_unroll=2)]
        if not block_scales:
            c += [C(64, 256, 128, 8, 3), C(128, 256, 64, 8, 3)]
    else:
        c = [C(128, 128, 128, 8, 3), C(128, 128, 128, 8, 4), C(128, 128, 128, 4, 3),
             C(64, 128, 128, 4, 4), C(128, 64, 128, 4, 4), C(64, 128, 128, 4, 3)]
        if not block_scales:
            c += [C(128, 256, 128, 8, 3), C(128, 256, 64, 8, 4), C(256, 128, 64, 8, 3)]
    if amd:  # Each tile also 2 stages deep (the AMD heuristic's depth), K steps of 64 where 128
        # do not fit; kept where the gate can pass it (bench.rocm.check: occupancy >= 4 waves a
        # SIMD): 4 KB of gfx942's 64 KB LDS a warp, 8 warps at most.
        c = c + [dataclasses.replace(x, num_stages=2, block_k=bk) for bk in (128, 64) for x in c]
        c = [x for x in dict.fromkeys(c) if x.num_warps <= 8 and amd_lds_bytes(x) <= 4096 * x.num_warps]
    else:
        # Hopper: each tile whose matrix-core M reaches 64 also with its partial sums promoted
        # every 128 products (GemmConfig.mma_acc), the FP8 wgmma (QGMMA) Triton takes then,
        # instead of float16 mma.sync on converted codes (docs/formats.md).
        wide = [x for x in c if (x.block_n if x.swap else x.block_m) >= 64 and x.num_warps % 4 == 0]
        c = c + [dataclasses.replace(x, mma_acc=128) for x in wide]
    # Block scales change along K: each tile also with them loaded a step early (scale_prefetch).
    return c + [dataclasses.replace(x, scale_prefetch=True) for x in c] if block_scales else c


def gemm_sweep(configs, tokens, calls, log=print, on_point=None):
    """Every candidate of ``gemm_candidates`` for each ``bench.cases.LINEAR`` config (UE8M0
    shares the float32 group kernel: its entries are the group's) and token count; each
    candidate's output checked against the heuristic's (same sums: equal up to the float32
    order of the K steps)."""
    target = platform.current_target()
    points = []
    for name in configs:
        cfg = ops.LINEAR[name]
        block = cfg["fmt"] != "fp8_per_token"
        key = f"linear_{cfg['fmt']}"
        for t in tokens:
            sets = [bench_ops.linear_operands(cfg, t, s) for s in range(bench_ops.rotation_sets(
                cfg["k"] * cfg["n"] + t * cfg["k"], bench_ops.cache_bytes(target)))]
            default = launch.gemm_heuristic(t, cfg["n"], cfg["k"], target,
                                            w_block=128 if block else None)

            def fn(config, qa, qw, x, w):
                with hooks.forced(config):
                    return kp.linear(qa, qw, impl="pallas", out_dtype=jnp.float32)
            want = jax.jit(lambda *a: fn(default, *a))(*sets[0])
            results = []
            cands = gemm_candidates(t, block, target.backend == "rocm")
            for config in cands + ([default] if default not in cands else []):
                f = jax.jit(lambda *a, _c=config: fn(_c, *a))
                try:
                    out = f(*sets[0])
                    err = float(jnp.max(jnp.abs(out - want)) / jnp.max(jnp.abs(want)))
                    if not err <= 2.0**-10:  # a wrong tile is O(1) off; wgmma FP8 sums round
                        raise ValueError(f"output differs from the heuristic config's by {err:.2e}")
                    tm = timing.time_device(f, sets, n_calls=calls)
                except Exception as e:  # noqa: BLE001 - a config that fails is data
                    log(f"  {name} T={t} {config.as_entry()}: failed: {str(e)[:160]}")
                    continue
                results.append({"config": config.as_entry(), "us": tm.median_us})
            best = min(results, key=lambda r: r["us"])
            dflt = next((r for r in results if r["config"] == default.as_entry()), None)
            points.append({"op": "linear", "key": key, "config": name, "n": cfg["n"], "k": cfg["k"],
                           "tokens": t, "best": best, "default": {"config": default.as_entry(),
                           "us": dflt and dflt["us"]}, "all": results})
            log(f"linear {name} T={t}: best {best['config']} {best['us']:.2f} us; heuristic "
                f"{default.as_entry()} {dflt['us'] if dflt else float('nan'):.2f} us")
            if on_point is not None:
                on_point(target, points)
    return target, points


def _table_keys(key: str) -> list:
    """The GEMM table's launch keys a sweep point of ``key`` fills: UE8M0 takes the float32
    group's entries (the same kernel)."""
    return [key] + (["linear_fp8_group128_ue8m0"] if key == "linear_fp8_group128" else [])


def gemm_table(points, up_to: int | None = None) -> dict:
    """{launch key: [[max_tokens, n, k, bm, bn, bk, warps, stages, swap(, mma_acc(, scale_prefetch(, k_unroll)))], ...]}: each measured T
    serves token counts up to the geometric mean with the next measured one, the largest all
    above it (or up to ``up_to``: a sweep of part of the range). UE8M0 takes the float32
    group's entries (the same kernel)."""
    out = {}
    by_shape = {}
    for p in points:
        by_shape.setdefault((p["key"], p["n"], p["k"]), []).append(p)
    for (key, n, k), ps in sorted(by_shape.items()):
        ps.sort(key=lambda p: p["tokens"])
        for i, p in enumerate(ps):
            upper = (int(math.sqrt(p["tokens"] * ps[i + 1]["tokens"])) if i + 1 < len(ps)
                     else up_to or 2**31)
            for kk in _table_keys(key):
                out.setdefault(kk, []).append([upper, n, k, *p["best"]["config"]])
    return out


def gemm_markdown(target, points) -> str:
    return _sweep_table(
        f"# GEMM config sweep on {target.device_kind} ({target.arch})",
        "Device time per call (median) of `linear(impl='pallas')` on pre-quantized operands. "
        "Configs: [block_m, block_n, block_k, warps, stages, swap(, mma_acc(, scale_prefetch(, k_unroll)))]; `heuristic`: "
        "`launch.gemm_heuristic`.", ["config", "T", "best", "best us", "heuristic"], points,
        lambda p, b, d: [p["config"], p["tokens"], b["config"], f"{b['us']:.2f}", d["config"]])


def _sweep_table(title, about, head, points, cells) -> str:
    """A sweep's report: ``cells(point, best, default)`` then the heuristic's time and ratio."""
    lines = [title, "", about, "", "| " + " | ".join(head + ["heuristic us", "heuristic / best"])
             + " |", "|" + "---|" * (len(head) + 2)]
    for p in points:
        b, d = p["best"], p["default"]
        ratio = f"{d['us'] / b['us']:.2f}" if d["us"] else "-"
        us = d["us"] if d["us"] is None else format(d["us"], ".2f")
        lines.append("| " + " | ".join(map(str, cells(p, b, d) + [us, ratio])) + " |")
    return "\n".join(lines)

# Decode batches (8..256 tokens per step) besides the prefill sizes; each measured T serves the
# token counts up to the geometric mean with the next (``table``).
TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 4096, 65536)
ROWS = (1, 2, 4)
WARPS = (1, 2, 4, 8, 16)
def _op_fn(name, cfg_name, dtype):
    """(make_inputs(seed, T), fn(config, *inputs), (row_elems, max_tile, launch key)(T), how to
    compile fn: in place for the residual add) of an op of the table, its launch forced to
    ``config`` (``hooks.forced``)."""
    spec = ops.OPS[name]
    dt = jnp.dtype(dtype)

    _, options = spec.example(1, dt, **spec.sizes[cfg_name])  # options do not depend on T

    def make(seed, t):
        structs, _ = spec.example(t, dt, **spec.sizes[cfg_name])
        return bench_ops._fill(jax.random.PRNGKey(seed), structs)

    def fn(config, *a):
        with hooks.forced(config):
            return spec.fn(*a, impl="pallas", **options)

    def key(t):
        structs, _ = spec.example(t, dt, **spec.sizes[cfg_name])
        with hooks.recording() as log:
            jax.jit(lambda *a: spec.fn(*a, impl="pallas", **options)).trace(*structs)
        return log[0].row_elems, log[0].max_tile_row_elems, log[0].op
    return make, fn, key, bench_ops.jit_for(spec.op, options.get("out_format"))


def sweep(names, tokens, dtype, calls, log=print, configs=None, splits=(1,), rows_list=ROWS,
          warps_list=WARPS, on_point=None):
    """Every point of the grid; ``on_point(target, points)`` after each (op, config, T): a sweep
    cut by a time limit keeps what it measured."""
    target = platform.current_target()
    points = []
    for name in names:
        for cfg_name in [c for c in ops.OPS[name].configs if configs is None or c in configs]:
            make, fn, key, jit = _op_fn(name, cfg_name, dtype)
            for t in tokens:
                row_elems, max_tile, launch_key = key(t)
                per_set = ops.OPS[name].bytes_moved(cfg_name, t, dtype)
                sets = [make(s, t) for s in range(bench_ops.rotation_sets(per_set, bench_ops.cache_bytes(target)))]
                default = launch.heuristic_config(launch_key, t, row_elems, max_tile, target)
                results = []
                for split, rows, warps in itertools.product(splits, rows_list, warps_list):
                    if rows > max(1, common.pow2(t)):
                        continue
                    config = launch.LaunchConfig(rows, warps, 1, split)
                    # (A split's programs keep the row's largest tile: the q segment.)
                    per_thread = rows * max_tile // (warps * target.warp_size)
                    if per_thread > 128 or per_thread < 2:
                        continue  # spills for sure, or idle threads
                    f = jit(lambda *a, _c=config: fn(_c, *a))
                    try:
                        tm = timing.time_device(f, sets, n_calls=calls)
                    except ValueError as e:
                        if "cannot do for this row shape" in str(e):
                            break  # this op (or row) does not split
                        raise
                    except Exception as e:  # noqa: BLE001 - a config that fails to compile is data
                        log(f"  {name} {cfg_name} T={t} R={rows} w={warps} S={split}: failed: {str(e)[:120]}")
                        continue
                    results.append({"rows": rows, "warps": warps, "split": split, "us": tm.median_us})
                best = min(results, key=lambda r: r["us"])
                dflt = next((r for r in results if r["rows"] == default.rows_per_program
                             and r["warps"] == default.num_warps
                             and r["split"] == default.split), None)
                points.append({"op": name, "key": launch_key, "config": cfg_name, "tokens": t,
                               "row_elems": row_elems,
                               "bytes": per_set, "best": best,
                               "default": {"rows": default.rows_per_program,
                                           "warps": default.num_warps, "split": default.split,
                                           "us": dflt["us"] if dflt else None},
                               "all": results})
                log(f"{name} {cfg_name} T={t}: best R={best['rows']} w={best['warps']} "
                    f"S={best['split']} {best['us']:.2f} us; heuristic R={default.rows_per_program} "
                    f"w={default.num_warps} S={default.split} "
                    f"{dflt['us'] if dflt else float('nan'):.2f} us")
                if on_point is not None:
                    on_point(target, points)
    return target, points


def table(points, up_to: int | None = None) -> dict:
    """{launch key: [[max_tokens, row_elems, rows, warps, 1(, split)], ...]} from the sweep's
    winners (the key: the op with its output format, ``common.launch_name``).

    Each measured token count T_i serves token counts up to the geometric mean of T_i and the next
    measured one; the largest serves everything above it, or up to ``up_to`` (a sweep of part of
    the range, e.g. decode sizes, whose entries ``merge`` then puts below the old larger ones).
    """
    out = {}
    by_shape = {}
    for p in points:
        by_shape.setdefault((p.get("key", p["op"]), p["row_elems"]), []).append(p)
    for (op, row_elems), ps in sorted(by_shape.items()):
        ps.sort(key=lambda p: p["tokens"])
        for i, p in enumerate(ps):
            upper = (int(math.sqrt(p["tokens"] * ps[i + 1]["tokens"])) if i + 1 < len(ps)
                     else up_to or 2**31)
            split = p["best"].get("split", 1)
            out.setdefault(op, []).append([upper, row_elems, p["best"]["rows"], p["best"]["warps"], 1]
                                          + ([split] if split > 1 else []))
    return out


def merge(old: dict, new: dict) -> dict:
    """``old`` (an arch's table) with the token range of each (op, row size) of ``new`` replaced
    by its entries: old entries of that pair up to the new entries' largest ``max_tokens`` go,
    those above it (a partial sweep's ``up_to``) and the other pairs stay."""
    out = {op: list(entries) for op, entries in old.items()}
    for op, entries in new.items():
        top = {}
        for e in entries:
            top[e[1]] = max(top.get(e[1], 0), e[0])
        kept = [e for e in out.get(op, []) if e[1] not in top or e[0] > top[e[1]]]
        out[op] = sorted(kept + entries, key=lambda e: (e[1], e[0]))
    return out


def markdown(target, points) -> str:
    def launch(c):
        return f"{c['rows']}, {c['warps']}" + (f", {c['split']}" if c.get("split", 1) > 1 else "")
    return _sweep_table(
        f"# Launch-config sweep on {target.device_kind} ({target.arch})",
        "Device time per call (median). `best` is the fastest (rows per program, num_warps, "
        "and programs per row block where swept); `heuristic` is `launch.heuristic_config`.",
        ["op", "config", "T", "best R, warps(, split)", "best us", "heuristic R, warps(, split)"],
        points, lambda p, b, d: [p["op"], p["config"], p["tokens"], launch(b), f"{b['us']:.2f}",
                                 launch(d)])


def write_table(path, target, points, args):
    """The shipped table with this sweep's winners merged under ``target.arch``, written to ``path``."""
    try:
        with open(launch.TUNED_PATH) as f:
            data = json.load(f)
    except FileNotFoundError:
        data = {}
    configs = data.setdefault("configs", {})
    if getattr(args, "gemm", False):
        gemm = data.setdefault("gemm_configs", {})
        new = gemm_table(points, args.up_to)
        # An entry of a shape this sweep measured (same n, k) whose token bucket reaches into the
        # swept range (from its smallest T up to up_to) gives way; those below and above stay.
        lowest = {}
        for p in points:
            for kk in _table_keys(p["key"]):
                shape = (kk, p["n"], p["k"])
                lowest[shape] = min(lowest.get(shape, p["tokens"]), p["tokens"])

        def replaced(key, e):
            low = lowest.get((key, e[1], e[2]))
            return (low is not None and e[0] >= low
                    and (args.up_to is None or e[0] <= args.up_to))
        old = {key: [e for e in entries if not replaced(key, e)]
               for key, entries in gemm.get(target.arch, {}).items()}
        for key, entries in new.items():
            old[key] = sorted(old.get(key, []) + entries, key=lambda e: (e[1], e[2], e[0]))
        gemm[target.arch] = old
    else:
        configs[target.arch] = merge(configs.get(target.arch, {}), table(points, args.up_to))
    data["note"] = ("written by python -m bench.tune --write; configs: [max_tokens, padded row "
                    "elements, rows_per_program, num_warps, num_stages(, split)]; gemm_configs "
                    "(--gemm): [max_tokens, n, k, block_m, block_n, block_k, num_warps, "
                    "num_stages, swap(, mma_acc(, scale_prefetch(, k_unroll)))]")
    sources = data.setdefault("sources", {})
    kinds = [k for k in str(sources.get(target.arch, {}).get("device_kind") or "").split(", ") if k]
    # Every device whose sweep wrote entries of this arch (a partial sweep keeps the others').
    sources[target.arch] = {"device_kind": ", ".join(dict.fromkeys(kinds + [target.device_kind])),
                            "jax": jax.__version__, "dtype": args.dtype}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=",".join(ops.OPS))
    p.add_argument("--tokens", default=None, help=f"default {','.join(map(str, TOKENS))}")
    p.add_argument("--configs", default=None, help="only these model configs (default: all)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--splits", default="1", help="programs per row block to sweep: 1 or 1,2")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="rows per program to sweep")
    p.add_argument("--warps", default=",".join(map(str, WARPS)), help="num_warps to sweep")
    p.add_argument("--out", default=os.path.join("bench", "out"))
    p.add_argument("--up-to", type=int, default=None,
                   help="the largest token count the largest swept one serves (a partial sweep: "
                        "--write keeps the table's entries above it; a --gemm sweep also those below "
                        "its smallest token count)")
    p.add_argument("--write", action="store_true", help="merge the winners into tuned_configs.json")
    p.add_argument("--gemm", action="store_true",
                   help="sweep the scaled FP8 GEMM (linear) instead: --configs from "
                        "bench.cases.LINEAR (default: the float32 group and per-token ones), "
                        f"--tokens default {','.join(map(str, GEMM_TOKENS))}")
    args = p.parse_args(argv)
    args.tokens_given = args.tokens is not None
    args.tokens = args.tokens or ",".join(map(str, TOKENS))
    target = platform.current_target()
    if not target.is_gpu:
        raise SystemExit("bench.tune needs a GPU (it times compiled kernels)")
    t0 = time.time()

    def save(target, points):
        md = (gemm_markdown if args.gemm else markdown)(target, points)
        write_report(args.out, "tune", md, {"device_kind": target.device_kind, "arch": target.arch,
                                            "jax": jax.__version__, "dtype": args.dtype,
                                            "points": points})
        if args.write:
            write_table(os.path.join(args.out, "tuned_configs.json"), target, points, args)
        return md

    if args.gemm:
        names = (args.configs.split(",") if args.configs else
                 [c for c in ops.LINEAR if not c.endswith("ue8m0")])
        tokens = [int(t) for t in args.tokens.split(",")] if args.tokens_given else list(GEMM_TOKENS)
        target, points = gemm_sweep(names, tokens, args.calls, on_point=save, log=lambda m: print(
            f"[{time.time() - t0:6.1f}s] {m}", file=sys.stderr, flush=True))
        print(save(target, points))
        return 0
    target, points = sweep([o for o in args.ops.split(",") if o],
                           [int(t) for t in args.tokens.split(",")], args.dtype, args.calls,
                           log=lambda m: print(f"[{time.time() - t0:6.1f}s] {m}", file=sys.stderr, flush=True),
                           configs=args.configs.split(",") if args.configs else None,
                           splits=[int(s) for s in args.splits.split(",")],
                           rows_list=[int(r) for r in args.rows.split(",")],
                           warps_list=[int(w) for w in args.warps.split(",")],
                           on_point=save)
    print(save(target, points))
    if args.write:
        print(f"wrote {args.out}/tuned_configs.json (copy it to {launch.TUNED_PATH})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
