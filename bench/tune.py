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
import itertools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp

from bench import cases as ops
from k3pallas import platform
from k3pallas.kernels import common, hooks, launch

from bench import ops as bench_ops
from bench import timing
from bench.report import write_report

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
    lines = [f"# Launch-config sweep on {target.device_kind} ({target.arch})", "",
             "Device time per call (median). `best` is the fastest (rows per program, num_warps, "
             "and programs per row block where swept); `heuristic` is `launch.heuristic_config`.", "",
             "| op | config | T | best R, warps(, split) | best us | heuristic R, warps(, split) | heuristic us | heuristic / best |",
             "|---|---|---|---|---|---|---|---|"]
    for p in points:
        b, d = p["best"], p["default"]
        ratio = f"{d['us'] / b['us']:.2f}" if d["us"] else "-"
        bs = f", {b['split']}" if b.get("split", 1) > 1 else ""
        ds = f", {d['split']}" if d.get("split", 1) > 1 else ""
        lines.append(f"| {p['op']} | {p['config']} | {p['tokens']} | {b['rows']}, {b['warps']}{bs} | "
                     f"{b['us']:.2f} | {d['rows']}, {d['warps']}{ds} | "
                     f"{d['us'] if d['us'] is None else format(d['us'], '.2f')} | {ratio} |")
    return "\n".join(lines)


def write_table(path, target, points, args):
    """The shipped table with this sweep's winners merged under ``target.arch``, written to ``path``."""
    try:
        with open(launch.TUNED_PATH) as f:
            data = json.load(f)
    except FileNotFoundError:
        data = {}
    configs = data.setdefault("configs", {})
    configs[target.arch] = merge(configs.get(target.arch, {}), table(points, args.up_to))
    data["note"] = ("written by python -m bench.tune --write; rows: [max_tokens, padded row "
                    "elements, rows_per_program, num_warps, num_stages(, split)]")
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
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--configs", default=None, help="only these model configs (default: all)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--splits", default="1", help="programs per row block to sweep: 1 or 1,2")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="rows per program to sweep")
    p.add_argument("--warps", default=",".join(map(str, WARPS)), help="num_warps to sweep")
    p.add_argument("--out", default=os.path.join("bench", "out"))
    p.add_argument("--up-to", type=int, default=None,
                   help="the largest token count the largest swept one serves (a partial sweep: "
                        "--write keeps the table's entries above it)")
    p.add_argument("--write", action="store_true", help="merge the winners into tuned_configs.json")
    args = p.parse_args(argv)
    target = platform.current_target()
    if not target.is_gpu:
        raise SystemExit("bench.tune needs a GPU (it times compiled kernels)")
    t0 = time.time()

    def save(target, points):
        md = markdown(target, points)
        write_report(args.out, "tune", md, {"device_kind": target.device_kind, "arch": target.arch,
                                            "jax": jax.__version__, "dtype": args.dtype,
                                            "points": points})
        if args.write:
            write_table(os.path.join(args.out, "tuned_configs.json"), target, points, args)
        return md

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
