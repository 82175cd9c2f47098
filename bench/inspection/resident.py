"""``python -m bench.inspection.resident --cases OP:CONFIG[,...] [--tokens 1024] [--out DIR]``:
each case's k3pallas kernel timed on ONE input set called again and again (its data resident in
the last-level cache where it fits) beside the benchmark's rotated sets (from DRAM), in one
process with one clock.

With its data in L2 a kernel's time approaches what its own work costs the SMs (issue, latency,
L2 traffic), with DRAM out of the way: a floor for the same kernel on a card with the same SM,
L2 and clocks but more DRAM bandwidth (the H100 SXM and the H200 share the GH100 die). It tells
a kernel bound by its instructions from one bound by memory (docs/residual.md: why MXFP4 and
float32-scale group FP8 cannot come within 5 % of the plain residual add on the H200). Pick T
so that one set's inputs and outputs fit the cache (H100 / H200: 50 MB of L2; ``[1024, 7168]``
bf16 holds 28 MB of inputs). Cases are built as the benchmark builds them
(``bench.ops.make_case``: the residual add in place); two rounds, the second in the opposite
order. Writes ``resident.md`` / ``resident.json``.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

from bench import ops as bench_ops, timing  # noqa: E402
from bench.report import write_report  # noqa: E402
from k3pallas import platform  # noqa: E402

DEFAULT_CASES = ("add_rmsnorm:deepseek-v3-hidden,add_rmsnorm_fp8_per_token:deepseek-v3-hidden,"
                 "add_rmsnorm_mx:deepseek-v3-hidden-mxfp8,add_rmsnorm_mx:deepseek-v3-hidden-mxfp4,"
                 "add_rmsnorm_fp8_group:deepseek-v3-hidden-fp8_group128,"
                 "add_rmsnorm_fp8_group:deepseek-v3-hidden-fp8_group128_ue8m0")


def run_case(name: str, config: str, tokens: int, calls: int) -> dict:
    case = bench_ops.make_case(name, config, tokens, "bfloat16", "pallas")
    fn = case.variants["k3pallas"]
    sets = {"resident": [case.make_inputs(0)],
            "rotated": bench_ops.input_sets(case, platform.current_target())}
    row = {"op": name, "config": config, "tokens": tokens, "input_mb": case.input_bytes / 2**20,
           "rotated_sets": len(sets["rotated"])}
    row.update(timing.two_rounds({k: (fn, s) for k, s in sets.items()}, calls))
    return row


def markdown(rows, device: str) -> str:
    lines = [f"# Cache-resident against rotated inputs: {device}", "",
             "us per call (median; mean of two rounds, the second in the opposite order). "
             "`resident`: one input set, called again and again; `rotated`: the benchmark's sets "
             "(3x the cache). `resident / plain`: against the first case of the same T "
             "(the plain op when the default cases run).", "",
             "| op | config | T | inputs MB | resident us | rotated us | resident / rotated "
             "| resident / plain |", "|---|---|---|---|---|---|---|---|"]
    first = {}
    for r in rows:
        first.setdefault(r["tokens"], r["resident"])
        lines.append(f"| {r['op']} | {r['config']} | {r['tokens']} | {r['input_mb']:.1f} | "
                     f"{r['resident']:.2f} | {r['rotated']:.2f} | "
                     f"{r['resident'] / r['rotated']:.2f} | "
                     f"{r['resident'] / first[r['tokens']]:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated OP:CONFIG (bench.cases)")
    p.add_argument("--tokens", default="1024")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("resident: needs a GPU (device-side timing)", file=sys.stderr)
        return 2
    rows, device = [], jax.devices()[0].device_kind
    for t in (int(v) for v in args.tokens.split(",")):
        for item in args.cases.split(","):
            name, config = item.split(":")
            rows.append(run_case(name, config, t, args.calls))
            print(rows[-1], flush=True)
            write_report(args.out, "resident", markdown(rows, device),
                         {"device": device, "jax": jax.__version__, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
