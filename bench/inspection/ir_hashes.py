"""``python -m bench.inspection.ir_hashes OUT.json [--tokens 1,256] [--ops a,b]``: the Triton IR of
every ROCm-gate case (``bench.rocm.check.cases``: each case of ``bench.cases`` at its model
configs, per-token FP8 with both conversion paths), lowered deviceless for the H200, gfx942 and
gfx950, as a hash per kernel with its launch (name, warps, stages, grid). ``--compare A.json
B.json`` lists the kernels whose IR or launch differ: the check that a refactor left the
kernels unchanged. The IR is hashed with its source locations stripped and the kernel's name
replaced by ``@kernel`` (a rename alone is no change; the launch names are compared apart).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys

ARCHS = ("h200", "gfx942", "gfx950")


def normalized(ir: str, name: str) -> str:
    ir = re.sub(r"\s*loc\((?:[^()]|\([^()]*\))*\)", "", ir)
    ir = "\n".join(line for line in ir.splitlines() if not line.startswith("#loc"))
    return ir.replace(f"@{name}", "@kernel")


def hashes(tokens, ops=None) -> dict:
    from bench.rocm import check
    from k3pallas import testing

    out = {}
    for arch in ARCHS:
        for case in check.cases(tokens, ops):
            if case.get("archs") and arch not in case["archs"]:
                continue
            fn, args = check.case_fn(case)
            lowered = testing.lower_for(fn, args, *testing.KNOWN_TARGETS[arch])
            for i, mod in enumerate(testing.triton_ir_modules(lowered)):
                key = f"{arch}|{case['op']}|{case['config']}|{case['tokens']}|{case.get('fp8_cast')}|{i}"
                out[key] = {"name": mod["name"], "num_warps": mod["num_warps"],
                            "num_stages": mod["num_stages"], "grid": list(mod["grid"]),
                            "ir_sha256": hashlib.sha256(
                                normalized(mod["ir"], mod["name"]).encode()).hexdigest()}
    return out


def compare(a: dict, b: dict) -> list[str]:
    """The differences between two ``hashes`` results, one line each (empty: the same kernels)."""
    lines = [f"only in the first: {k}" for k in sorted(set(a) - set(b))]
    lines += [f"only in the second: {k}" for k in sorted(set(b) - set(a))]
    for k in sorted(set(a) & set(b)):
        diff = [f for f in ("name", "num_warps", "num_stages", "grid", "ir_sha256") if a[k][f] != b[k][f]]
        if diff:
            lines.append(f"{k}: {', '.join(diff)} differ")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.inspection.ir_hashes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", help="the JSON file to write")
    p.add_argument("--tokens", default=None, help="token counts (default: the benchmark's)")
    p.add_argument("--ops", default=None, help="comma-separated cases (default: all)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two written files")
    args = p.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(path)) for path in args.compare)
        lines = compare(a, b)
        print("\n".join(lines) or f"the same {len(a)} kernels")
        return 1 if lines else 0
    if not args.out:
        p.error("OUT.json is required (or --compare A B)")
    from bench import cases

    tokens = ([int(t) for t in args.tokens.split(",")] if args.tokens else list(cases.DEFAULT_TOKENS))
    out = hashes(tokens, args.ops.split(",") if args.ops else None)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=0)
    print(f"{len(out)} kernels -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
