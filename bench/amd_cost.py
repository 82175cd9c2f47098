"""``python -m bench.amd_cost``: an ESTIMATE, not a measurement, of the FP8 kernels' time on AMD.

No AMD GPU was reachable for this project, so this is a model built from what the ROCm compile
gate (``python -m bench.rocm_check``, XLA's ROCm compiler) reports for each FP8 kernel, token count
and FP8 conversion path (integer encoder or native conversion), and two published figures. For
each kernel it compares two lower bounds and takes the larger:

* memory time = bytes moved / achievable bandwidth: MI300X ~4.2 TB/s of 5.3 peak, MI355X ~6.9 TB/s
  of 8 (measured figures from public threads, ``../shared/FIELD_NOTES.md``); bytes: x and gate read
  in bf16, codes written (1 byte) and the float32 scale, the weight;
* VALU issue time = (programs x wavefronts per program x VALU instructions per wavefront) /
  (CUs x clock): a CDNA3/4 CU issues one wave64 vector instruction per clock over its four SIMDs
  (each SIMD16 takes four clocks per wave64 instruction). The instruction count is the static count
  of the compiled kernel, which is the dynamic one: the row kernels are straight-line code (no
  loops). CUs and clock from XLA's own target config (MI300X: 304 CUs, 2.1 GHz; MI350X: 256 CUs,
  2.2 GHz; an MI355X clocks 2.4 GHz, ~8 % less VALU time than shown).

It assumes memory and VALU work overlap perfectly and ignores the launch latency (which dominates
below a few hundred tokens), scalar and memory-instruction issue, and LDS; the real time is higher.
What it does tell is which bound each path meets: where the encoder's VALU time exceeds the memory
time, the native conversion is worth that difference. ``bench/NOTES.md`` has the method and how
the model compares with the H200 (where both paths were measured).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from k3pallas import ops
from bench.report import write_report

ACHIEVABLE_BW = {"gfx942": 4.2e12, "gfx950": 6.9e12}  # bytes/s, read + write
PARTS = {"gfx942": "MI300X", "gfx950": "MI355X (MI350X config)"}
FP8_OPS = tuple(name for name, op in ops.OPS.items() if op.fp8)


def bytes_moved(op: str, config: str, tokens: int) -> int:
    return ops.OPS[op].bytes_moved(config, tokens)


def estimate(r: dict, device: dict) -> dict:
    """Memory and VALU-issue times (us) of one gate result ``r`` on ``device``."""
    waves = r["grid"][0] * r["num_warps"]
    valu_us = waves * r["valu"] / (device["core_count"] * device["clock_rate_ghz"] * 1e9) * 1e6
    mem_us = bytes_moved(r["op"], r["config"], r["tokens"]) / ACHIEVABLE_BW[r["arch"]] * 1e6
    return {"memory_us": mem_us, "valu_us": valu_us, "predicted_us": max(mem_us, valu_us),
            "bound": "VALU" if valu_us > mem_us else "memory"}


def table(gate: dict) -> list[dict]:
    devices = gate["meta"]["devices"]
    by_key = {}
    for r in gate["results"]:
        if r["op"] in FP8_OPS and r.get("fp8_cast") and "error" not in r and not r.get("broken"):
            by_key.setdefault((r["arch"], r["op"], r["config"], r["tokens"]), {})[r["fp8_cast"]] = r
    rows = []
    for (arch, op, config, t), paths in sorted(by_key.items()):
        row = {"arch": arch, "op": op, "config": config, "tokens": t}
        for cast, r in paths.items():
            row[cast] = {**estimate(r, devices[arch]), "valu": r["valu"],
                         "instructions": r["instructions"], "vgpr": r["vgpr"],
                         "occupancy": r["occupancy"], "fp8_cvt_count": r.get("fp8_cvt_count", 0)}
        rows.append(row)
    return rows


def markdown(rows, gate) -> str:
    devices = gate["meta"]["devices"]
    out = ["# ESTIMATE: FP8 kernels on MI300X / MI355X, integer encoder vs native conversion", "",
           "Not measured (no AMD GPU was reachable): a bound model from the instruction counts that "
           "XLA's ROCm compiler gives (`python -m bench.rocm_check`, "
           f"{gate['meta'].get('compiler')}) and achievable bandwidths. Method and limits: "
           "`bench/amd_cost.py`, `bench/NOTES.md`. Times in us per call; `mem`: bytes / "
           "achievable bandwidth; `VALU`: vector-instruction issue time; predicted = the larger. "
           "Below ~512 tokens launch latency (not modelled) dominates.", ""]
    for arch in sorted({r["arch"] for r in rows}):
        d = devices[arch]
        out += [f"## {arch}: {PARTS.get(arch, arch)}, {d['core_count']} CUs, {d['clock_rate_ghz']} GHz, "
                f"{ACHIEVABLE_BW[arch] / 1e12:.1f} TB/s achievable", "",
                "| op | config | T | mem us | encoder VALU us | encoder predicted (bound) | native VALU us "
                "| native predicted (bound) | encoder / native | VALU instr enc / nat | occupancy enc / nat |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r["arch"] != arch or "encoder" not in r or "native" not in r:
                continue
            e, n = r["encoder"], r["native"]
            out.append(f"| {r['op']} | {r['config']} | {r['tokens']} | {e['memory_us']:.1f} | "
                       f"{e['valu_us']:.1f} | {e['predicted_us']:.1f} ({e['bound']}) | "
                       f"{n['valu_us']:.1f} | {n['predicted_us']:.1f} ({n['bound']}) | "
                       f"{e['predicted_us'] / n['predicted_us']:.2f} | {e['valu']} / {n['valu']} | "
                       f"{e['occupancy']} / {n['occupancy']} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.amd_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gate", default=os.path.join("bench", "results", "rocm_check.json"),
                   help="the XLA gate's JSON (python -m bench.rocm_check)")
    p.add_argument("--out", default=os.path.join("bench", "out"))
    args = p.parse_args(argv)
    with open(args.gate) as f:
        gate = json.load(f)
    if "devices" not in gate.get("meta", {}):
        print("amd_cost: the gate JSON has no device figures: run it with --compiler xla or both",
              file=sys.stderr)
        return 2
    rows = table(gate)
    md = markdown(rows, gate)
    write_report(args.out, "amd_cost_model", md, {"gate_meta": gate["meta"], "rows": rows,
                                                  "achievable_bw": ACHIEVABLE_BW})
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
