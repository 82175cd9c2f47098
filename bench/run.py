"""``python -m bench``: every op, fused against unfused, XLA and the copy ceiling, device-timed.

Writes ``results.md`` (the tables, also printed), ``results.json`` (every number and the
environment) and, with matplotlib installed, ``results.png`` (bandwidth against tokens) to
``--out`` (``--name``: another stem). The two reports are rewritten every 20 s of cases, marked
partial until the last one, so a run cut short (a time limit) still leaves what it measured;
``--merge`` joins runs split over several calls into one report. Without a GPU it runs the
interpret and reference paths at small sizes and labels the numbers as CPU wall-clock.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import platform as py_platform
import signal
import sys
import time

import jax

import k3pallas as kp
from k3pallas import platform

from bench import ops as bench_ops
from bench import cases, timing
from bench.report import git_commit, write_report

CPU_TOKENS = (1, 7, 64)


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def environment(target) -> dict:
    commit = git_commit()
    import jaxlib

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": py_platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "k3pallas": kp.__version__,
        "git_commit": commit,
        "backend": target.backend,
        "device_kind": target.device_kind,
        "arch": target.arch,
        "warp_size": target.warp_size,
        "num_cores": target.num_cores,
        "fp8_dtype": str(kp.default_fp8_dtype()),
    }


# The bytes that cost as much time as one variant's compile, for the time-left estimate (fitted
# to a run's per-case times: on the H200 ~2.4 s per case plus ~0.23 s per GB, the time of making
# and timing the inputs; on the CPU, interpret mode's run time grows with the bytes).
_BYTES_PER_COMPILE = {"gpu": 10 << 30, "cpu": 32 << 20}


def job_weight(op: str, config: str, tokens: int, dtype: str, gpu: bool) -> float:
    """A case's relative cost, for the time-left estimate: per variant (the fused kernel, the
    reference, the unfused form, the encoder on a GPU, the copy), one compile plus its calls."""
    if op in cases.OPS:
        spec = cases.OPS[op]
        variants = 3 + (spec.unfused is not None) + (gpu and (spec.fp8 or spec.mx))
        nbytes = spec.bytes_moved(config, tokens, dtype)
    elif op == "linear":  # the GEMM and its XLA lowerings
        c = {**cases.LINEAR, **cases.LINEAR_TEST}[config]
        variants, nbytes = 6, tokens * c["k"] * 3 + c["k"] * c["n"] * 3
    elif op == "group_linear":  # six variants around a GEMM
        c = cases.GROUP_LINEAR[config]
        k, n = (c["heads"] * c["dim"], c["hidden"]) if "heads" in c else (c["k"], c["n"])
        variants, nbytes = 7, tokens * k * 6 + k * n
    else:  # the KDA output path: four variants around a GEMM
        c = cases.KDA_OUTPUT[config]
        variants, nbytes = 6, tokens * c["heads"] * c["dim"] * 6 + c["heads"] * c["dim"] * c["hidden"]
    return variants * (1.0 + nbytes / _BYTES_PER_COMPILE["gpu" if gpu else "cpu"])


def compile_together(calls: list[tuple]) -> None:
    """Compile (and run once) each ``(fn, inputs)`` in threads, side by side, before any is
    timed: XLA compiles with the GIL released, and a case compiles five to eight programs. Only
    for cases without a GEMM: XLA autotunes its dots on the GPU while compiling, and autotuning
    runs side by side would time each other."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(calls)) as pool:
        for f in [pool.submit(lambda fn, xs: jax.block_until_ready(fn(*xs)), fn, xs)
                  for fn, xs in calls]:
            f.result()


def measure(case: bench_ops.Case, gpu: bool, calls: int, target) -> list[dict]:
    sets = bench_ops.input_sets(case, target) if gpu else [case.make_inputs(0)]
    n_sets = len(sets)
    clock = timing.time_device if gpu else timing.time_wall
    make_copy, copies = bench_ops.copy_variants(case.bytes_moved)
    copy_sets = [make_copy(s) for s in range(n_sets)]
    if gpu and case.op in cases.OPS:
        compile_together([(fn, sets[0]) for fn in case.variants.values()]
                         + [(fn, copy_sets[0]) for fn in copies.values()])
    rows = []
    for name, fn in case.variants.items():
        t = clock(fn, sets, n_calls=calls)
        rows.append((name, t))
    copy_times = {name: clock(fn, copy_sets, n_calls=calls) for name, fn in copies.items()}
    best = min(copy_times, key=lambda k: copy_times[k].median_us)
    rows.append(("copy", copy_times[best]))
    del sets, copy_sets
    copy_us = rows[-1][1].median_us
    records = []
    for name, t in rows:
        records.append({
            "op": case.op, "config": case.config, "tokens": case.tokens, "dtype": case.dtype,
            "variant": name, "clock": t.clock, "median_us": t.median_us, "min_us": t.min_us,
            "kernels_per_call": t.kernels_per_call, "calls": t.calls,
            "kernel_names": list(t.kernel_names), "bytes": case.bytes_moved,
            "gb_per_s": case.bytes_moved / (t.median_us * 1e3) if t.median_us > 0 else None,
            "pct_of_copy": 100.0 * copy_us / t.median_us if t.median_us > 0 else None,
            "input_sets": n_sets,
            "tflops": (case.flops / (t.median_us * 1e6) if case.flops and t.median_us > 0
                       and name != "copy" else None),
            "copy_kind": best if name == "copy" else None,
            "copy_us_by_kind": ({k: t.median_us for k, t in copy_times.items()}
                                if name == "copy" else None),
            "launch_config": (None if name != "k3pallas" or case.launch is None else
                              {"rows_per_program": case.launch.rows_per_program,
                               "num_warps": case.launch.num_warps,
                               "num_stages": case.launch.num_stages,
                               "split": case.launch.split}),
        })
    return records


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _fmt_gbs(v):
    """GB/s with three significant digits, so small CPU figures do not print as 0."""
    return "-" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.3g}")


def markdown(records: list[dict], env: dict) -> str:
    gpu = env["backend"] in ("cuda", "rocm")
    clock = "device time per call (median), from jax.profiler traces" if gpu else (
        "CPU WALL-CLOCK time per call (median), interpret mode for k3pallas: NOT kernel "
        "performance, only a check that the command works")
    if gpu:
        about = ("GB/s counts each input read once and each output written once; % copy = copy "
                 "time / variant time for the same bytes (copy: the faster of XLA's device memcpy "
                 "and an XLA copy kernel). `us (n)`: time and kernels launched per call. Inputs "
                 "rotate over up to 32 sets, 3x the last-level cache where 32 sets reach it (from "
                 "about 6 MB per set on the H200); smaller cases, the decode sizes, are partly "
                 "cache-resident. FP8 conversion: "
                 + ("; ".join(f"{d['dtype']} on {d['target']}: {'native' if d['native'] else 'encoder'} "
                              f"({d['reason']})" for d in env.get("fp8_cast_decisions", [])
                              if d["mode"] != "encoder") or "-")
                 + " (`encoder` column: the same kernel with the integer encoder). `R, warps`: "
                 "rows per program and warps (`, 2`: q and kv on two programs of a row block).")
    else:
        about = ("`us (n)`: time per call (n = 0: kernels are not counted on the CPU). The "
                 "bandwidth columns are left out: on the CPU they say nothing of the kernels.")
    out = [f"# k3pallas benchmark: {env['device_kind']} ({env['arch']}), jax {env['jax']}",
           "", f"Times: {clock}. {about} Commit {env.get('git_commit') or '?'}, {env['date']}.", ""]
    if env.get("cases_done") is not None and env["cases_done"] < env["cases"]:
        out += [f"**PARTIAL RUN: {env['cases_done']} of {env['cases']} cases measured** (the run "
                "was stopped before the rest).", ""]
    groups = {}
    for r in records:
        groups.setdefault((r["op"], r["config"], r["dtype"]), {}).setdefault(r["tokens"], {})[r["variant"]] = r
    for (op, cfg, dtype), by_t in groups.items():
        seen = [v for d in by_t.values() for v in d if v not in ("k3pallas", "copy")]
        known = ("encoder", "unfused", "xla", "bf16")  # then any other (group_linear's lowerings)
        variants = [v for v in known if v in seen] + [v for v in dict.fromkeys(seen) if v not in known]
        out.append(f"## {op} · {cfg} · {dtype}")
        out.append("")
        head = ["T", "k3pallas us (n)"] + (["GB/s", "% copy"] if gpu else [])
        head += [f"{v} us (n)" for v in variants] + [f"x vs {v}" for v in variants]
        gemm = any(d["k3pallas"].get("tflops") for d in by_t.values())
        head += ["copy us", "R, warps"] if gpu else []
        head += ["TFLOPS"] if gpu and gemm else []
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for t in sorted(by_t):
            d = by_t[t]
            k = d["k3pallas"]
            cells = [str(t), f"{k['median_us']:.2f} ({k['kernels_per_call']})"]
            cells += [_fmt_gbs(k["gb_per_s"]), _fmt(k["pct_of_copy"], ".0f")] if gpu else []
            cells += [f"{d[v]['median_us']:.2f} ({d[v]['kernels_per_call']})" for v in variants]
            cells += [f"{d[v]['median_us'] / k['median_us']:.2f}" for v in variants]
            lc = k.get("launch_config")
            split = f", {lc['split']}" if lc and lc.get("split", 1) > 1 else ""
            if gpu:
                cells += [f"{d['copy']['median_us']:.2f}",
                          f"{lc['rows_per_program']}, {lc['num_warps']}{split}" if lc else "-"]
                cells += [_fmt(k.get("tflops"), ".0f")] if gemm else []
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def plot(records: list[dict], env: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return False
    groups = {}
    for r in records:
        groups.setdefault((r["op"], r["config"]), []).append(r)
    n = len(groups)
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
    for ax, ((op, cfg), rs) in zip(axes.flat, groups.items()):
        for variant in ("k3pallas", "unfused", "xla", "bf16", "copy"):
            pts = sorted((r["tokens"], r["gb_per_s"]) for r in rs if r["variant"] == variant)
            if pts:
                style = dict(ls="--", color="gray") if variant == "copy" else dict(marker="o")
                ax.plot(*zip(*pts), label=variant, **style)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel("GB/s (minimum bytes)")
        ax.set_title(f"{op}\n{cfg}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    clock = "device time" if env["backend"] in ("cuda", "rocm") else "CPU wall-clock"
    fig.suptitle(f"k3pallas on {env['device_kind']} ({clock}), jax {env['jax']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=",".join(cases.ALL),
                   help=f"comma-separated ops (default: all of {','.join(cases.ALL)})")
    p.add_argument("--tokens", default=None,
                   help="comma-separated token counts (default: "
                        f"{','.join(map(str, cases.DEFAULT_TOKENS))} on a GPU, "
                        f"{','.join(map(str, CPU_TOKENS))} on the CPU)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--configs", default=None,
                   help="comma-separated model configs (default: each op's own, bench/cases.py)")
    p.add_argument("--out", default=os.path.join("bench", "out"), help="output folder")
    p.add_argument("--calls", type=int, default=30, help="timed calls per variant (>= 20 on GPU)")
    p.add_argument("--quick", action="store_true",
                   help="a small fast run: tokens 1 and 64, each op's first config, 5 calls")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="measure nothing: the records of these runs' results.json (runs split "
                        "over several device calls) as one report, written to --out as --name")
    p.add_argument("--name", default="results", help="the report's file stem (default: results)")
    p.add_argument("--suite", default=None, choices=sorted(cases.SUITES),
                   help="a named set of cases instead of --ops/--configs/--tokens (headline: the "
                        "README's table, one device call)")
    p.add_argument("--resume", default=None, metavar="JSON",
                   help="continue a run cut short: keep that results.json's cases and measure the "
                        "rest of the same job list (refused if made at another commit or on "
                        "another device)")
    return p.parse_args(argv)


def resumed(path: str, env: dict) -> tuple[list[dict], dict]:
    """The records and environment of a partial run to continue; SystemExit unless it was made
    at this commit, on this kind of device, with the same jax."""
    with open(path) as f:
        prev = json.load(f)
    penv = prev.get("environment", {})
    for key in ("git_commit", "device_kind", "jax", "dtype"):
        if penv.get(key) != env.get(key):
            raise SystemExit(f"--resume: {path} was made with {key} {penv.get(key)!r}, this run has "
                             f"{env.get(key)!r}; a report holds one commit on one device")
    return list(prev.get("records", [])), penv


def merge(paths, out_dir: str, stem: str) -> None:
    """One report of several runs' records (same device and jax; their commits, dates and
    arguments kept in the environment, each under ``runs``)."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    envs = [r["environment"] for r in runs]
    if len({(e["device_kind"], e["jax"]) for e in envs}) != 1:
        raise SystemExit("--merge: the runs were made on different devices or jax versions")
    records = [rec for r in runs for rec in r["records"]]
    env = dict(envs[0], runs=[{k: e.get(k) for k in ("git_commit", "date", "argv", "cases",
                                                     "cases_done")} for e in envs])
    env["git_commit"] = ", ".join(dict.fromkeys(str(e.get("git_commit")) for e in envs))
    env["date"] = ", ".join(dict.fromkeys(e["date"] for e in envs))
    env["cases"] = sum(e["cases"] for e in envs)
    env["cases_done"] = sum(e.get("cases_done", e["cases"]) for e in envs)
    write_report(out_dir, stem, markdown(records, env), {"environment": env, "records": records})


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        merge(args.merge, args.out, args.name)
        return 0
    target = platform.current_target()
    gpu = target.is_gpu
    impl = "pallas" if gpu else "interpret"
    op_names = [o for o in args.ops.split(",") if o]
    for o in op_names:
        if o not in cases.OP_CONFIGS:
            raise SystemExit(f"unknown op {o!r}; known: {', '.join(cases.ALL)}")
    if args.tokens:
        try:
            tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise SystemExit(f"--tokens: expected whole numbers >= 1 separated by commas, got "
                             f"{args.tokens!r}") from None
        if not tokens or min(tokens) < 1:
            raise SystemExit(f"--tokens: expected whole numbers >= 1, got {args.tokens!r}")
    elif args.quick:
        tokens = list(cases.QUICK_TOKENS)
    else:
        tokens = list(cases.DEFAULT_TOKENS if gpu else CPU_TOKENS)
    calls = 5 if args.quick else args.calls
    env = environment(target)
    env.update({"impl": impl, "dtype": args.dtype, "calls": calls,
                "clock": "device" if gpu else "wall", "argv": sys.argv[1:] if argv is None else argv})
    if not gpu:
        _log(f"No GPU target ({target.backend}): running the interpret and reference paths; "
             "the numbers are CPU WALL-CLOCK times, not kernel performance.")
    jobs = []
    if args.suite:
        op_names = []
        jobs = [(op, cfg, t) for op, cfg, ts in cases.SUITES[args.suite] for t in ts]
    for op in op_names:
        cfgs = args.configs.split(",") if args.configs else list(cases.OP_CONFIGS[op])
        if op == "linear" and not gpu and not args.configs:  # interpret mode: small sizes
            cfgs = list(cases.LINEAR_TEST)
        if args.quick and not args.configs:
            cfgs = cfgs[:1]
        op_tokens = tokens
        if not args.tokens and not args.quick and gpu and op in cases.OP_TOKENS:
            op_tokens = list(cases.OP_TOKENS[op])
        for cfg in cfgs:
            for t in op_tokens:
                jobs.append((op, cfg, t))
    records, prev_casts = [], []
    if args.resume:
        records, penv = resumed(args.resume, env)
        # The report's dates and FP8 conversion decisions are those of every part of the run
        # (a part that measures only GEMMs makes no conversion decision).
        env["date"] = ", ".join(dict.fromkeys(penv.get("date", "").split(", ") + [env["date"]]))
        prev_casts = penv.get("fp8_cast_decisions", [])
        done = {(r["op"], r["config"], r["tokens"]) for r in records}
        _log(f"--resume: {len(done)} cases of {args.resume} kept")
    else:
        done = set()
    t_start = written = time.time()
    env["cases"] = len(jobs)
    weights = [job_weight(op, cfg, t, args.dtype, gpu) for op, cfg, t in jobs]
    _log(f"{len(jobs)} cases; writing {args.out}/{args.name}.md and {args.name}.json every 20 s")

    def save():
        casts = prev_casts + [dataclasses.asdict(d) for d in kp.fp8_cast_decisions()]
        env["fp8_cast_decisions"] = list({json.dumps(d, sort_keys=True): d for d in casts}.values())
        md = markdown(records, env)
        write_report(args.out, args.name, md, {"environment": env, "records": records})
        return md

    # A time limit's SIGTERM (`timeout`) saves what was measured since the last write.
    before = signal.signal(signal.SIGTERM, lambda *_: (save(), sys.exit(124)))
    try:
        for i, (op, cfg, t) in enumerate(jobs, 1):
            if (op, cfg, t) in done:
                env["cases_done"] = i
                continue
            case = bench_ops.make_case(op, cfg, t, args.dtype, impl)
            recs = measure(case, gpu, calls, target)
            records += recs
            env["cases_done"] = i
            k = next(r for r in recs if r["variant"] == "k3pallas")
            elapsed = time.time() - t_start
            left = elapsed * sum(weights[i:]) / max(1e-9, sum(w for w, j in zip(weights[:i], jobs)
                                                                if j not in done))
            detail = (f"{k['kernels_per_call']} kernels, {_fmt(k['pct_of_copy'], '.0f')}% of copy"
                      if gpu else "CPU wall-clock")
            _log(f"[{i}/{len(jobs)} {elapsed:6.1f}s, ~{left:.0f}s left] {op} {cfg} T={t}: "
                 f"k3pallas {k['median_us']:.2f} us ({detail})")
            # The reports every 20 s and at the end: each write formats every record so far,
            # which after each of hundreds of cases added up.
            if time.time() - written > 20:
                save()
                written = time.time()
        md = save()
    finally:
        signal.signal(signal.SIGTERM, before)
    # The bandwidth plot is a GPU result; CPU wall-clock numbers would only mislead in a picture.
    plotted = gpu and plot(records, env, os.path.join(args.out, f"{args.name}.png"))
    print(md)
    _log(f"wrote {args.out}/{args.name}.md, {args.name}.json"
         + (f", {args.name}.png" if plotted else ""))
    return 0
