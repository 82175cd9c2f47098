"""``python -m bench.inspection.ab --base REF --cases OP:CONFIG[,...] [--tokens 1,64,4096]
[--calls 30] [--out DIR]``: the working tree's kernels against those of git ref ``REF``, in ONE
process on ONE clock, as every kernel change is to be timed before it lands.

``REF``'s ``k3pallas`` is taken out of git (``git archive``; or, ``REF`` a folder, copied from
``REF/k3pallas``) into a temporary folder as the
package ``k3pallas_base`` (its import lines renamed; kernel names, tuned configs and all else its
own), and each case (``OP:CONFIG``: a ``bench.cases`` op and one of its size configs, e.g.
``add_rmsnorm_mx:deepseek-v3-hidden-mxfp4``) runs both packages' public function on the same
input sets, built and compiled as the benchmark builds its case (``bench.ops.make_case``,
``input_sets``; ``jit_for``: the residual add in place). Per token count: whether the outputs
are the same bits (NaN equal to NaN), then device time (``bench.timing``) in two rounds, the
second in the opposite order; the ratio is tree / base over the medians of both rounds. Writes
``ab.md`` / ``ab.json`` to ``--out``.

Without a GPU (``--impl interpret``) it only compares the outputs, at the sizes given: a check
that both packages load and agree, no timing.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench import cases, ops as bench_ops, timing  # noqa: E402
from k3pallas import platform  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE_NAME = "k3pallas_base"
_IMPORT = re.compile(r"^(\s*(?:from|import)\s+)k3pallas\b", re.M)


def base_package(ref: str, into: str):
    """``ref``'s ``k3pallas`` imported as ``k3pallas_base`` from ``into``: ``ref`` a git ref, or a
    folder holding a ``k3pallas`` package (a machine without the history, e.g. a GPU lease)."""
    root = os.path.join(into, BASE_NAME)
    if os.path.isdir(os.path.join(ref, "k3pallas")):
        shutil.copytree(os.path.join(ref, "k3pallas"), root,
                        ignore=shutil.ignore_patterns("__pycache__"))
    else:
        blob = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", ref, "k3pallas"],
                              capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
            tar.extractall(into, filter="data")
        os.rename(os.path.join(into, "k3pallas"), root)
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as fh:
                    text = fh.read()
                with open(path, "w") as fh:
                    fh.write(_IMPORT.sub(lambda m: m.group(1) + BASE_NAME, text))
    for name in [m for m in sys.modules if m == BASE_NAME or m.startswith(BASE_NAME + ".")]:
        del sys.modules[name]  # an earlier ref's
    sys.path.insert(0, into)
    try:
        return importlib.import_module(BASE_NAME)
    finally:
        sys.path.remove(into)


def _bits(a) -> np.ndarray:
    return np.asarray(a.astype(np.float32) if a.dtype.itemsize < 4 else a, np.float64)


def same_bits(x, y) -> bool:
    """Every output equal (NaN equal to NaN; narrow floats compared through float32)."""
    xs, ys = jax.tree.leaves(x), jax.tree.leaves(y)
    return len(xs) == len(ys) and all(
        np.array_equal(_bits(a), _bits(b), equal_nan=True) for a, b in zip(xs, ys))


def run_case(name: str, config: str, tokens: int, base, *, impl: str, calls: int,
             n_sets: int | None = None) -> dict:
    case = bench_ops.make_case(name, config, tokens, "bfloat16", impl)  # the benchmark's case
    spec = cases.OPS[name]
    _, options = spec.example(tokens, jax.numpy.bfloat16, **spec.sizes[config])
    sets = (bench_ops.input_sets(case, platform.current_target()) if impl == "pallas"
            else [case.make_inputs(0)])[:n_sets]
    compile_ = bench_ops.jit_for(spec.op, options.get("out_format"))
    fns = {"base": compile_(lambda *a: getattr(base, spec.op)(*a, impl=impl, **options)),
           "tree": case.variants["k3pallas"]}
    outs = {k: jax.device_get(fn(*sets[0])) for k, fn in fns.items()}
    row = {"op": name, "config": config, "tokens": tokens, "same_bits": same_bits(*outs.values())}
    if impl != "pallas":
        return row
    row.update(timing.two_rounds({k: (fn, sets) for k, fn in fns.items()}, calls))
    row["ratio"] = row["tree"] / row["base"]
    return row


def markdown(rows, ref: str, device: str) -> str:
    lines = [f"# The working tree against {ref}: {device}", "",
             "Same process, same clock; us per call (median), a / b: two rounds, b in the opposite "
             "order; ratio: tree / base.", "",
             "| op | config | T | same bits | base us | tree us | ratio |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        timed = "base_a" in r
        b = f"{r['base_a']:.2f} / {r['base_b']:.2f}" if timed else "-"
        t = f"{r['tree_a']:.2f} / {r['tree_b']:.2f}" if timed else "-"
        ratio = f"{r['ratio']:.3f}" if timed else "-"
        lines.append(f"| {r['op']} | {r['config']} | {r['tokens']} | {r['same_bits']} | {b} | {t} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the git ref (or a folder holding a k3pallas package) to compare the working tree with")
    p.add_argument("--cases", required=True, help="comma-separated OP:CONFIG (bench.cases)")
    p.add_argument("--tokens", default="1,64,4096")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--impl", default=None, help="pallas (default on a GPU) or interpret")
    p.add_argument("--sets", type=int, default=None,
                   help="time on the first N input sets only (1: the data resident in L2 where it "
                        "fits, bench.inspection.resident)")
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    impl = args.impl or ("pallas" if jax.default_backend() == "gpu" else "interpret")
    os.makedirs(args.out, exist_ok=True)
    rows, device = [], jax.devices()[0].device_kind
    with tempfile.TemporaryDirectory() as tmp:
        base = base_package(args.base, tmp)
        for item in args.cases.split(","):
            name, config = item.split(":")
            for t in (int(v) for v in args.tokens.split(",")):
                rows.append(run_case(name, config, t, base, impl=impl, calls=args.calls,
                                     n_sets=args.sets))
                print(json.dumps(rows[-1]), flush=True)
                with open(os.path.join(args.out, "ab.json"), "w") as fh:
                    json.dump({"base": args.base, "device": device, "impl": impl, "rows": rows}, fh,
                              indent=1)
                with open(os.path.join(args.out, "ab.md"), "w") as fh:
                    fh.write(markdown(rows, args.base, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
