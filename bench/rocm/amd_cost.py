"""``python -m bench.rocm.amd_cost``: an ESTIMATE, not a measurement, of the FP8 kernels' time on AMD.

No AMD GPU was reachable for this project, so this is a model built from what the ROCm compile
gate (``python -m bench.rocm.check``, XLA's ROCm compiler) reports for each FP8 kernel, token count
and FP8 conversion path (integer encoder or native conversion), and published figures. Per kernel:

  predicted = launch floor + max(memory time, VALU throughput time, serial time)

* memory time = bytes moved / achievable bandwidth: MI300X ~4.2 TB/s of 5.3 peak, MI355X ~6.9 TB/s
  of 8 (measured figures from public threads, ``../shared/FIELD_NOTES.md``);
* VALU throughput time, with wave quantization: the busiest CU holds ``ceil(waves / CUs)``
  wavefronts and issues one wave64 vector instruction per clock over its four SIMD16s; a
  transcendental (exp, log, rcp, rsq, sqrt) issues at quarter rate (4 clocks of the CU);
* serial time: one wavefront's own chain, which no parallelism hides: each VALU instruction
  takes 4 clocks on its SIMD16 (16 for a transcendental), plus two dependent HBM round trips
  (load, then store: ``HBM_LATENCY_US`` each); repeated for each round of wavefronts when a CU
  cannot hold all of its wavefronts at once (occupancy);
* launch floor: ``LAUNCH_FLOOR_US``, an ASSUMPTION (no AMD device here to measure an empty
  kernel); the one measured anchor is the seed's fused KDA epilogue at 4.2 us per layer in decode
  on MI355X (vLLM PR 54254), which the model's decode rows can be held against.

The scaled FP8 GEMM (``linear``) has its own rows: launch floor + one HBM latency (its first
tile) + the larger of memory time (the bytes the GEMM must move, at the fraction of the
chip's bandwidth its programs occupy when there are fewer than CUs) and matrix time (the busiest
CU's programs, each ``2 * BM * BN * K`` at the CU's share of the datasheet FP8 dense rate,
``FP8_DENSE_FLOPS``: an ASSUMPTION of perfect MFMA issue, so at prefill a lower bound that real
kernels miss by 2x or more). The one measured AMD anchor for it:
AITER's ``gemm_a8w8_blockscale`` at M = 8, N = 7168, K = 2048 in 7.9 us on an MI300X.

The instruction counts are the static counts of the compiled kernels, which are the dynamic
ones (the row kernels are straight-line code). CUs and clock from XLA's own target configs
(MI300X 304 CUs, 2.1 GHz; MI350X 256 CUs, 2.2 GHz; an MI355X clocks 2.4 GHz). Scalar and memory
instruction issue, LDS and imperfect overlap are not modelled: real times are higher.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from bench import cases as ops
from bench.report import write_report

ACHIEVABLE_BW = {"gfx942": 4.2e12, "gfx950": 6.9e12}  # bytes/s, read + write
LAUNCH_FLOOR_US = 2.0  # ASSUMED: an empty kernel's device time on MI300X / MI355X
HBM_LATENCY_US = 0.8  # ASSUMED: one dependent HBM access (pointer-chase figures, ~0.7-1 us)
SIMDS_PER_CU = 4
PARTS = {"gfx942": "MI300X", "gfx950": "MI355X (MI350X config)"}
# Datasheet FP8 dense matrix rates (flop/s): MI300X 2614.9 TFLOPS, MI350X 4614 TFLOPS (the
# gate's gfx950 config is the MI350X's 256 CUs at 2.2 GHz; an MI355X at 2.4 GHz: 5033).
FP8_DENSE_FLOPS = {"gfx942": 2614.9e12, "gfx950": 4614e12}
FP8_OPS = tuple(name for name, op in ops.OPS.items() if op.fp8)


def bytes_moved(op: str, config: str, tokens: int) -> int:
    return ops.OPS[op].bytes_moved(config, tokens)


def estimate(r: dict, device: dict) -> dict:
    """The model's times (us) of one gate result ``r`` on ``device`` (see the module doc)."""
    clock = device["clock_rate_ghz"] * 1e3  # clocks per us
    cus = device["core_count"]
    programs = r["grid"][0] * (r["grid"][1] if len(r["grid"]) > 1 else 1)
    waves = programs * r["num_warps"]
    trans = r.get("trans", 0)
    per_cu = -(-waves // cus)  # wave quantization: the busiest CU
    valu_us = per_cu * (r["valu"] + 3 * trans) / clock
    resident = max(1, (r.get("occupancy") or 1) * SIMDS_PER_CU)  # waves a CU holds at once
    rounds = -(-per_cu // resident)
    serial_us = rounds * ((4 * r["valu"] + 12 * trans) / clock + 2 * HBM_LATENCY_US)
    mem_us = bytes_moved(r["op"], r["config"], r["tokens"]) / ACHIEVABLE_BW[r["arch"]] * 1e6
    bounds = {"memory": mem_us, "VALU": valu_us, "serial": serial_us}
    bound = max(bounds, key=bounds.get)
    return {"memory_us": mem_us, "valu_us": valu_us, "serial_us": serial_us,
            "launch_us": LAUNCH_FLOOR_US, "predicted_us": LAUNCH_FLOOR_US + bounds[bound],
            "bound": bound}


def gemm_estimate(r: dict, device: dict) -> dict:
    """The model's times (us) of one gate row of the GEMM (``linear``) on ``device``."""
    from k3pallas import platform
    from k3pallas.kernels import launch

    c = ops.LINEAR[r["config"]]
    m, n, k = r["tokens"], c["n"], c["k"]
    block = c["fmt"] != "fp8_per_token"
    cfg = launch.gemm_config(f"linear_{c['fmt']}", m, n, k,
                             target=platform.target_from_name(r["arch"]), w_block=128 if block else None)
    cus = device["core_count"]
    programs = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    per_cu = -(-programs // cus)
    mfma_us = per_cu * 2 * cfg.block_m * cfg.block_n * k / (FP8_DENSE_FLOPS[r["arch"]] / cus) * 1e6
    nbytes = m * k + n * k + 2 * m * n + 4 * m * (k // 128 if block else 1) + 4 * (
        -(-n // 128) * (k // 128) if block else n)
    # Fewer programs than CUs stream with that fraction of the chip's bandwidth.
    mem_us = nbytes / (ACHIEVABLE_BW[r["arch"]] * min(1.0, programs / cus)) * 1e6
    bound = "memory" if mem_us >= mfma_us else "matrix"
    return {"memory_us": mem_us, "matrix_us": mfma_us, "predicted_us": LAUNCH_FLOOR_US
            + HBM_LATENCY_US + max(mem_us, mfma_us), "bound": bound, "programs": programs,
            "launch": cfg.as_entry(), "tflops": 2 * m * n * k / (LAUNCH_FLOOR_US + HBM_LATENCY_US
                                                               + max(mem_us, mfma_us)) / 1e6}


def gemm_table(gate: dict) -> list[dict]:
    devices = gate["meta"]["devices"]
    return [{"arch": r["arch"], "config": r["config"], "tokens": r["tokens"],
             **gemm_estimate(r, devices[r["arch"]])}
            for r in gate["results"] if r["op"] == "linear" and "error" not in r
            and "@" not in r["config"]]  # forced loop forms (rocm.check.GEMM_FORCED): not run


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
            row[cast] = {**estimate(r, devices[arch]), "valu": r["valu"], "trans": r.get("trans"),
                         "instructions": r["instructions"], "vgpr": r["vgpr"],
                         "occupancy": r["occupancy"], "fp8_cvt_count": r.get("fp8_cvt_count", 0)}
        rows.append(row)
    return rows


def markdown(rows, gate, gemm_rows=()) -> str:
    devices = gate["meta"]["devices"]
    out = ["# ESTIMATE: FP8 kernels on MI300X / MI355X, integer encoder vs native conversion", "",
           "Not measured (no AMD GPU was reachable): a model from the instruction counts that "
           "XLA's ROCm compiler gives (`python -m bench.rocm.check`, "
           f"{gate['meta'].get('compiler')}), achievable bandwidths and two ASSUMED constants "
           f"(launch floor {LAUNCH_FLOOR_US} us, HBM latency {HBM_LATENCY_US} us). Method and "
           "limits: `bench/rocm/amd_cost.py`. Times in us per call: predicted = launch floor + the "
           "largest of `mem` (bytes / bandwidth), `VALU` (issue time of the busiest CU, "
           "transcendentals at quarter rate) and `serial` (one wavefront's chain and two HBM "
           "round trips, per round of resident wavefronts). The one measured AMD anchor: the "
           "seed's fused KDA epilogue, 4.2 us per layer in decode on MI355X.", ""]
    for arch in sorted({r["arch"] for r in list(rows) + list(gemm_rows)}):
        d = devices[arch]
        out += [f"## {arch}: {PARTS.get(arch, arch)}, {d['core_count']} CUs, {d['clock_rate_ghz']} GHz, "
                f"{ACHIEVABLE_BW[arch] / 1e12:.1f} TB/s achievable", "",
                "| op | config | T | mem | encoder VALU / serial | encoder predicted (bound) | "
                "native VALU / serial | native predicted (bound) | encoder / native | "
                "VALU instr enc / nat (transc.) | occupancy enc / nat |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r["arch"] != arch or "encoder" not in r or "native" not in r:
                continue
            e, n = r["encoder"], r["native"]
            out.append(f"| {r['op']} | {r['config']} | {r['tokens']} | {e['memory_us']:.1f} | "
                       f"{e['valu_us']:.1f} / {e['serial_us']:.1f} | {e['predicted_us']:.1f} ({e['bound']}) | "
                       f"{n['valu_us']:.1f} / {n['serial_us']:.1f} | {n['predicted_us']:.1f} ({n['bound']}) | "
                       f"{e['predicted_us'] / n['predicted_us']:.2f} | {e['valu']} / {n['valu']} "
                       f"({e.get('trans')}) | {e['occupancy']} / {n['occupancy']} |")
        out.append("")
        gemm = [g for g in gemm_rows if g["arch"] == arch]
        if gemm:
            out += [f"### {arch}: the scaled FP8 GEMM (`linear`)", "",
                    "| config | T | [BM, BN, BK, warps, stages, swap] | programs | mem | matrix | "
                    "predicted (bound) | TFLOPS |", "|---|---|---|---|---|---|---|---|"]
            out += [f"| {g['config']} | {g['tokens']} | {g['launch']} | {g['programs']} | "
                    f"{g['memory_us']:.1f} | {g['matrix_us']:.1f} | {g['predicted_us']:.1f} "
                    f"({g['bound']}) | {g['tflops']:.0f} |" for g in gemm]
            out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rocm.amd_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gate", default=os.path.join("bench", "results", "rocm_check.json"),
                   help="the XLA gate's JSON (python -m bench.rocm.check)")
    p.add_argument("--out", default=os.path.join("bench", "out"))
    args = p.parse_args(argv)
    with open(args.gate) as f:
        gate = json.load(f)
    if "devices" not in gate.get("meta", {}):
        print("amd_cost: the gate JSON has no device figures: run it with --compiler xla or both",
              file=sys.stderr)
        return 2
    rows = table(gate)
    gemm_rows = gemm_table(gate)
    md = markdown(rows, gate, gemm_rows)
    write_report(args.out, "amd_cost_model", md, {"gate_meta": gate["meta"], "rows": rows,
                                                  "gemm_rows": gemm_rows,
                                                  "fp8_dense_flops": FP8_DENSE_FLOPS,
                                                  "achievable_bw": ACHIEVABLE_BW,
                                                  "launch_floor_us": LAUNCH_FLOOR_US,
                                                  "hbm_latency_us": HBM_LATENCY_US})
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
