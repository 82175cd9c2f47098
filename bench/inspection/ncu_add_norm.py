"""The residual add's kernel beside Liger's under Nsight Compute: what each launch reads from
DRAM, L2 and L1, and how XLA and torch launch them.

``ncu --clock-control none --kernel-name regex:'k3pallas|fused_add_rms|row_copy2' --section
SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --csv
--page details python -m bench.inspection.ncu_add_norm --hidden 7168 --tokens 16384 > ncu.csv``
launches, each twice (ncu profiles both; the report takes the second), in this order:
``k3pallas`` (``add_rmsnorm`` in place, as the benchmark times it), ``fresh`` (the same kernel into
new buffers, as the peers write), ``pallas_copy`` (the same tiles copied by the library's row
kernel with no weight: read x and r, write them, through jax), ``liger`` (Liger's
``fused_add_rms_norm`` from torch) and ``row_copy`` (a Triton row copy from torch, Liger's warps).
``python -m bench.inspection.ncu_add_norm --report ncu.csv --out DIR`` writes the table
(``ncu_add_norm.md``). Needs torch, pip triton and Liger (wheels on the device: the device
tool's README); not a dependency of k3pallas.
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

ORDER = ("k3pallas", "fresh", "pallas_copy", "liger", "row_copy")
METRICS = ("Block Size", "Grid Size", "Duration", "DRAM Throughput", "L2 Cache Throughput",
           "L1/TEX Hit Rate", "L2 Hit Rate", "Registers Per Thread", "Achieved Occupancy",
           "Function Cache Configuration", "Shared Memory Configuration Size")


def launch(hidden: int, tokens: int) -> None:
    """Each variant of ``ORDER`` twice, one after another (for ncu)."""
    import jax
    import jax.numpy as jnp
    import torch

    import k3pallas
    from bench import ops as bench_ops
    from bench.inspection import beside_add_norm as ban

    eps = ban.EPS
    tw = torch.randn(hidden, device="cuda").bfloat16()
    jw = jnp.asarray(tw.float().cpu().numpy(), jnp.bfloat16)

    def fn(x, r):
        return k3pallas.add_rmsnorm(x, r, jw, eps, impl="pallas")

    x, r = (jax.random.normal(jax.random.PRNGKey(i), (tokens, hidden), jnp.bfloat16)
            for i in (0, 1))
    copy = ban.pallas_copy(fn, x, r)
    in_place, fresh = bench_ops.jit_for("add_rmsnorm", None)(fn), bench_ops.fresh_outputs(fn)
    tx, tr = (torch.randn(tokens, hidden, device="cuda").bfloat16() for _ in range(2))
    liger = ban._peers()["liger"][0]
    row_copy = ban._row_copy()
    runs = {"k3pallas": lambda: in_place(x, r), "fresh": lambda: fresh(x, r),
            "pallas_copy": lambda: copy(x, r), "liger": lambda: liger(tx, tr, tw),
            "row_copy": lambda: row_copy(tx, tr, tw)}
    # Into ncu's output, for ``report``.
    print(f"device: {jax.devices()[0].device_kind}, bf16 [{tokens}, {hidden}]", flush=True)
    for name in ORDER:
        for _ in range(2):
            jax.block_until_ready(runs[name]())
            torch.cuda.synchronize()
        print(f"launched {name}", file=sys.stderr, flush=True)


def report(csv_path: str) -> str:
    """The table of an ncu ``--csv --page details`` file of ``launch``'s run."""
    with open(csv_path) as f:
        raw = f.read().splitlines()
    device = next((line[len("device: "):] for line in raw if line.startswith("device: ")), "?")
    rows = list(csv.reader(line for line in raw if line.startswith('"')))
    head, rows = rows[0], rows[1:]
    col = {h: i for i, h in enumerate(head)}
    kernels = collections.OrderedDict()
    for r in rows:
        kernels.setdefault(r[col["ID"]], {"name": r[col["Kernel Name"]]})[
            r[col["Metric Name"]]] = f"{r[col['Metric Value']]} {r[col['Metric Unit']]}".strip()
    ids = list(kernels)
    if len(ids) != 2 * len(ORDER):
        raise ValueError(f"{len(ids)} kernels profiled; {2 * len(ORDER)} expected ({ORDER}, twice)")
    second = [kernels[i] for i in ids[1::2]]
    lines = [f"# add_rmsnorm beside Liger under Nsight Compute, {device}", "",
             "`ncu --clock-control none` (sections SpeedOfLight, MemoryWorkloadAnalysis, "
             "Occupancy, LaunchStats) of `python -m bench.inspection.ncu_add_norm`; the second "
             "of each variant's two launches. `k3pallas`: in place; `fresh`: into new buffers; "
             "`pallas_copy`: the library's row kernel copying the same tiles, through jax; "
             "`liger`, `row_copy`: from torch.", "",
             "| metric | " + " | ".join(ORDER) + " |", "|---|" + "---|" * len(ORDER),
             "| kernel | " + " | ".join(f"`{k['name'][:32]}`" for k in second) + " |"]
    for m in METRICS:
        lines.append(f"| {m} | " + " | ".join(k.get(m, "") for k in second) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.inspection.ncu_add_norm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--report", help="an ncu CSV of this program's run: write its table")
    p.add_argument("--out", default=os.path.join("bench", "out"))
    args = p.parse_args(argv)
    if args.report is None:
        launch(args.hidden, args.tokens)
        return
    text = report(args.report)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ncu_add_norm.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
