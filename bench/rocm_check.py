"""``python -m bench.rocm_check``: compile every kernel to AMDGCN for gfx942 and gfx950 on the CPU.

No ROCm GPU is needed. For every public kernel, the benchmark's model configs and token counts,
and the launch config the platform module picks for that AMD target, it

1. lowers deviceless for ``rocm`` (an abstract gfx942 / gfx950 device) and takes the Triton IR
   that Pallas stores in the custom call (``k3pallas._compat.triton_ir_modules``);
2. compiles that IR with the PyPI ``triton`` package (the ``rocm-check`` extra) for
   ``GPUTarget("hip", arch, 64)`` through ttgir, llir and amdgcn to a HSACO, in a separate process
   (jax and triton each carry their own LLVM);
3. reads the resources from the AMDGCN text: VGPR, SGPR, AGPR, spills, scratch, occupancy
   (waves per SIMD), instruction count, the FP8 conversion instructions used, and LDS from the
   compiled kernel's metadata.

It also compiles the FP8 encoders alone (``encode_fp8`` in a Pallas kernel, against Triton's own
native casts written in the Triton language) to compare their instruction counts.

``--check`` fails on a compile error, any spill or scratch use, or an occupancy below
``MIN_OCCUPANCY`` waves per SIMD. Why 4: these kernels are memory-bound and do one pass, so they
hide HBM latency only with enough loads in flight. At 4 waves per SIMD a CU runs 16 waves, each
with at least 64 lanes x 16 bytes = 1 KiB of loads outstanding: 16 KiB per CU, about 5 MB on an
MI300X's 304 CUs, which covers 5.3 TB/s x ~1 us of latency (Little's law). Lower occupancy leaves
the memory system idle between a program's load and its store.

XLA's ROCm backend compiles with its own Triton build: treat the figures as close estimates.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from bench.report import write_report

MIN_OCCUPANCY = 4
ARCHS = ("gfx942", "gfx950")
_FP8_CVT = re.compile(r"\b(v_cvt\w*(fp8|bf8)\w*)")


# ------------------------------------------------------------------------------------------------
# Part 1 (jax process): lower deviceless and extract the Triton IR
# ------------------------------------------------------------------------------------------------


def _cases(tokens, ops):
    from bench import shapes

    for op, cfgs in shapes.OP_CONFIGS.items():
        if (ops and op not in ops) or op in shapes.NO_KERNEL_OF_ITS_OWN:
            continue
        for cfg in cfgs:
            for t in tokens:
                yield op, cfg, t


def _op_fn(op, cfg_name, t):
    import jax
    import jax.numpy as jnp

    import k3pallas as kp
    from bench import shapes

    cfg = shapes.config(cfg_name)
    bf16, f32 = jnp.bfloat16, jnp.float32
    s = jax.ShapeDtypeStruct
    if op == "fused_q_kv_rmsnorm":
        return (lambda *a: kp.fused_q_kv_rmsnorm(*a, impl="pallas"),
                [s((t, cfg.q_lora_rank), bf16), s((t, cfg.kv_lora_rank), bf16),
                 s((cfg.q_lora_rank,), bf16), s((cfg.kv_lora_rank,), bf16)])
    if op == "rmsnorm":
        return (lambda *a: kp.rmsnorm(*a, impl="pallas"),
                [s((t, cfg.q_lora_rank), bf16), s((cfg.q_lora_rank,), bf16)])
    if op == "mla_q_kv_norm":
        return (lambda *a: kp.mla_q_kv_norm(*a, impl="pallas"),
                [s((t, cfg.q_lora_rank + cfg.kv_lora_rank + cfg.rope_dim), bf16),
                 s((cfg.q_lora_rank,), bf16), s((cfg.kv_lora_rank,), bf16)])
    h, d = getattr(cfg, "heads", 0), getattr(cfg, "head_dim", 0)
    if op == "rmsnorm_gated":
        return (lambda *a: kp.rmsnorm_gated(*a, impl="pallas"),
                [s((t, h, d), bf16), s((d,), f32), s((t, h, d), bf16)])
    if op == "rmsnorm_gated_fp8_per_token":  # fp8 dtype: the device default (fnuz on gfx942)
        return (lambda *a: kp.rmsnorm_gated_fp8_per_token(*a, impl="pallas"),
                [s((t, h, d), bf16), s((d,), f32), s((t, h, d), bf16)])
    if op == "per_token_fp8_quant":
        return lambda a: kp.per_token_fp8_quant(a, impl="pallas"), [s((t, h * d), bf16)]
    raise KeyError(op)


def _encoder_kernel_ir(arch):
    """A Pallas kernel that only encodes float32 to the arch's default fp8 format."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from k3pallas import _compat, fp8 as fp8_lib, platform

    dtype = fp8_lib.default_fp8_dtype(platform.target_for(arch, "rocm"))

    def kernel(x_ref, o_ref):
        i = jnp.arange(1024)
        o_ref[i] = fp8_lib.encode_fp8(x_ref[i], dtype).astype(jnp.uint8)

    def fn(x):
        return pl.pallas_call(kernel, grid=(x.shape[0] // 1024,),
                              in_specs=[pl.BlockSpec((1024,), lambda i: (i,))],
                              out_specs=pl.BlockSpec((1024,), lambda i: (i,)),
                              out_shape=jax.ShapeDtypeStruct(x.shape, jnp.uint8),
                              name="encode_fp8_" + jnp.dtype(dtype).name)(x)

    lowered = _compat.lower_for(fn, [jax.ShapeDtypeStruct((1 << 20,), jnp.float32)], arch, "rocm")
    (mod,) = _compat.triton_ir_modules(lowered)
    return mod, jnp.dtype(dtype).name


def extract(tokens, ops, workdir, log):
    from k3pallas import _compat

    manifest = []
    for arch in ARCHS:
        for op, cfg, t in _cases(tokens, ops):
            fn, args = _op_fn(op, cfg, t)
            lowered = _compat.lower_for(fn, args, arch, "rocm")
            for mod in _compat.triton_ir_modules(lowered):
                path = os.path.join(workdir, f"{arch}-{op}-{cfg}-{t}.ttir")
                with open(path, "w") as f:
                    f.write(mod["ir"])
                manifest.append({"arch": arch, "op": op, "config": cfg, "tokens": t,
                                 "kernel": mod["name"], "num_warps": mod["num_warps"],
                                 "num_stages": mod["num_stages"], "grid": mod["grid"],
                                 "path": path})
        mod, fmt = _encoder_kernel_ir(arch)
        path = os.path.join(workdir, f"{arch}-encoder.ttir")
        with open(path, "w") as f:
            f.write(mod["ir"])
        manifest.append({"arch": arch, "op": "encode_fp8 (k3pallas, integer)", "config": fmt,
                         "tokens": 1024, "kernel": mod["name"], "num_warps": mod["num_warps"],
                         "num_stages": mod["num_stages"], "grid": mod["grid"], "path": path})
        log(f"{arch}: lowered {sum(m['arch'] == arch for m in manifest)} kernels")
    return manifest


# ------------------------------------------------------------------------------------------------
# Part 2 (triton process): compile to AMDGCN and read the resources
# ------------------------------------------------------------------------------------------------


def _resources(amdgcn: str) -> dict:
    def field(name):
        m = re.search(rf"^\s*-?\s*\.{name}:\s+(\d+)", amdgcn, re.M)
        return int(m.group(1)) if m else None

    occ = re.search(r";\s*Occupancy:\s*(\d+)", amdgcn)
    code = [ln.strip() for ln in amdgcn.splitlines()
            if ln.startswith("\t") and ln.strip() and not ln.strip().startswith((".", ";"))
            and not ln.strip().endswith(":")]
    cvt = sorted({m.group(1) for ln in code for m in [_FP8_CVT.search(ln)] if m})
    return {"vgpr": field("vgpr_count"), "sgpr": field("sgpr_count"), "agpr": field("agpr_count"),
            "vgpr_spill": field("vgpr_spill_count"), "sgpr_spill": field("sgpr_spill_count"),
            "scratch": field("private_segment_fixed_size"),
            "occupancy": int(occ.group(1)) if occ else None, "instructions": len(code),
            "fp8_cvt": cvt}


def _native_cast_kernels(arch):
    """Triton-language kernels that cast float32 to fp8 natively (what the Pallas lowering would
    emit if it accepted the cast): the baseline for the integer encoder's cost."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    formats = {"float8_e4m3fn": tl.float8e4nv, "float8_e4m3fnuz": tl.float8e4b8}

    def make(fp8):
        @triton.jit
        def cast_kernel(x_ptr, o_ptr):
            i = tl.program_id(0) * 1024 + tl.arange(0, 1024)
            tl.store(o_ptr + i, tl.load(x_ptr + i).to(fp8))
        return cast_kernel

    out = []
    for name, fp8 in formats.items():
        src = triton.compiler.ASTSource(fn=make(fp8), signature={"x_ptr": "*fp32", "o_ptr": f"*{'fp8e4nv' if name == 'float8_e4m3fn' else 'fp8e4b8'}"})
        try:
            k = triton.compile(src, target=GPUTarget("hip", arch, 64), options={"num_warps": 4})
            out.append({"arch": arch, "op": "native cast (Triton)", "config": name, "tokens": 1024,
                        "kernel": "cast_" + name, "num_warps": 4, "num_stages": 1,
                        "lds": k.metadata.shared, **_resources(k.asm["amdgcn"])})
        except Exception as e:  # noqa: BLE001 - a format the arch lacks is a finding, not a crash
            out.append({"arch": arch, "op": "native cast (Triton)", "config": name,
                        "error": f"{type(e).__name__}: {str(e)[:200]}"})
    return out


def compile_all(manifest_path: str) -> list[dict]:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, explicitly
    import triton
    from triton.backends.compiler import GPUTarget

    with open(manifest_path) as f:
        manifest = json.load(f)
    results = []
    for m in manifest:
        r = {k: v for k, v in m.items() if k != "path"}
        try:
            k = triton.compile(m["path"], target=GPUTarget("hip", m["arch"], 64),
                               options={"num_warps": m["num_warps"], "num_stages": m["num_stages"]})
            r.update(_resources(k.asm["amdgcn"]), lds=k.metadata.shared)
        except Exception as e:  # noqa: BLE001 - reported as a failed compile
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        results.append(r)
    for arch in sorted({m["arch"] for m in manifest}):
        results += _native_cast_kernels(arch)
    return results


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------


def problems(r) -> list[str]:
    if "error" in r:
        return [] if r["op"] == "native cast (Triton)" else [f"compile error: {r['error']}"]
    out = []
    if (r.get("vgpr_spill") or 0) or (r.get("sgpr_spill") or 0):
        out.append(f"spills ({r['vgpr_spill']} VGPR, {r['sgpr_spill']} SGPR)")
    if r.get("scratch"):
        out.append(f"scratch {r['scratch']} bytes")
    if r["op"].startswith(("fused", "rmsnorm", "per_token")) and (r.get("occupancy") or 0) < MIN_OCCUPANCY:
        out.append(f"occupancy {r.get('occupancy')} < {MIN_OCCUPANCY}")
    return out


def markdown(results, meta) -> str:
    lines = [f"# ROCm compile gate: AMDGCN resources (triton {meta['triton']}, jax {meta['jax']})", "",
             "Compiled on the CPU from the Triton IR that Pallas emits, with the launch config the "
             "platform module picks for each target (wavefront 64). Occupancy: waves per SIMD "
             f"(gate: >= {MIN_OCCUPANCY}). LDS in bytes. `fp8 cvt`: FP8 conversion instructions.", "",
             "| arch | op | config | T | R grid | warps | VGPR | SGPR | AGPR | spills | scratch | LDS | occupancy | instructions | fp8 cvt | gate |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['arch']} | {r['op']} | {r['config']} | {r.get('tokens', '')} | | | "
                         f"| | | | | | | | | {'FAIL' if problems(r) else 'n/a'}: {r['error'][:80]} |")
            continue
        grid = r.get("grid", ["-"])[0] if r.get("grid") else "-"
        p = problems(r)
        lines.append(
            f"| {r['arch']} | {r['op']} | {r['config']} | {r['tokens']} | {grid} | {r['num_warps']} | "
            f"{r['vgpr']} | {r['sgpr']} | {r['agpr']} | {r['vgpr_spill']}/{r['sgpr_spill']} | "
            f"{r['scratch']} | {r.get('lds')} | {r['occupancy']} | {r['instructions']} | "
            f"{', '.join(r['fp8_cvt']) or '-'} | {'; '.join(p) if p else 'ok'} |")
    return "\n".join(lines)


def main(argv=None):
    from bench import shapes

    p = argparse.ArgumentParser(prog="python -m bench.rocm_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=",".join(map(str, shapes.DEFAULT_TOKENS)))
    p.add_argument("--ops", default=None, help="comma-separated ops (default: all)")
    p.add_argument("--out", default=os.path.join("bench", "out"))
    p.add_argument("--check", action="store_true", help="exit 1 on any gate failure")
    p.add_argument("--compile-manifest", default=None, help=argparse.SUPPRESS)  # part 2
    args = p.parse_args(argv)
    if args.compile_manifest:
        json.dump(compile_all(args.compile_manifest), sys.stdout)
        return 0

    import jax

    t0 = time.time()
    log = lambda m: print(f"[{time.time() - t0:6.1f}s] {m}", file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as work:
        manifest = extract([int(t) for t in args.tokens.split(",")],
                           args.ops.split(",") if args.ops else None, work, log)
        path = os.path.join(work, "manifest.json")
        with open(path, "w") as f:
            json.dump(manifest, f)
        proc = subprocess.run([sys.executable, "-m", "bench.rocm_check", "--compile-manifest", path],
                              capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-5000:])
            raise SystemExit("the triton compile process failed (is the rocm-check extra installed?)")
        results = json.loads(proc.stdout)
    triton_version = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"],
                                    capture_output=True, text=True).stdout.strip()
    meta = {"jax": jax.__version__, "triton": triton_version, "min_occupancy": MIN_OCCUPANCY}
    log(f"compiled {len(results)} kernels")
    md = markdown(results, meta)
    write_report(args.out, "rocm_check", md, {"meta": meta, "results": results})
    print(md)
    failures = [(r, problems(r)) for r in results if problems(r)]
    for r, ps in failures:
        print(f"GATE FAIL {r['arch']} {r['op']} {r['config']} T={r.get('tokens')}: {'; '.join(ps)}",
              file=sys.stderr)
    if args.check and failures:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
