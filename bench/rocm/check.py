"""``python -m bench.rocm.check``: compile every kernel for gfx942 and gfx950 on the CPU and gate it.

No ROCm GPU is needed. For every public kernel, the benchmark's model configs and token counts,
each FP8 kernel with both FP8 conversion paths (the integer encoder and the native cast), and the
launch config the platform module picks for that AMD target, it compiles the kernel and reads the
resources of the machine code: VGPR, SGPR, AGPR, spills, scratch, LDS, occupancy (waves per
SIMD), instruction count, and the FP8 conversion instructions used.

Two compilers (``--compiler``):

* ``xla`` (default, what CI gates): XLA's own ROCm backend from ``jax-rocm7-pjrt`` /
  ``jax-rocm7-plugin``, deviceless, in the environment ``python -m bench.rocm.env`` builds
  (``bench.rocm.xla`` runs there, one process per arch). This is the compiler a MI300X / MI355X
  user's jax runs: XLA's Triton fork, its pass pipeline, LLVM AMDGPU, and the HSACO it would load.
  It also compiles the Kimi-K3 blocks (``k3pallas.models.kimi_k3``) as whole programs and reports
  what XLA makes of them (``--no-programs`` skips them).
* ``triton``: the Triton IR that Pallas emits, compiled by the PyPI ``triton`` package (the
  ``rocm-check`` extra) for ``GPUTarget("hip", arch, 64)``. Kept for what the XLA path does not
  give: a second, independent compiler's figures (``both`` puts them side by side), and
  Triton's own ``; Occupancy`` line, against which the occupancy formula used on XLA's HSACO
  (``bench.rocm.xla.occupancy``) was checked (equal on all 132 kernels of the last pip gate).

``--check`` fails on a compile error, any spill or scratch use, or an occupancy below
``MIN_OCCUPANCY`` waves per SIMD. Why 4: these kernels are memory-bound and do one pass, so they
hide HBM latency only with enough loads in flight. At 4 waves per SIMD a CU runs 16 waves, each
with at least 64 lanes x 16 bytes = 1 KiB of loads outstanding: 16 KiB per CU, about 5 MB on an
MI300X's 304 CUs, which covers 5.3 TB/s x ~1 us of latency (Little's law). Lower occupancy leaves
the memory system idle between a program's load and its store. ``--broken`` adds a deliberately
broken launch (a 1536-wide RMSNorm with 64 rows on one wavefront: thousands of values per lane),
which must make the gate fail; CI checks that it does.
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
# ``--sample``: one token count per launch config AMD's heuristic gives the row kernels (no
# tuned entries for gfx942 / gfx950): one row a program, the same warps, at every T up to 512 on
# both archs (2 programs per CU need more rows than that), another config at each of 4096, 16384
# and 65536 (tests/test_rocm_check.py holds the rule to it). 1 and 7 (a partial warp of rows)
# stand for the first range. CI compiles this sample (1200 fewer kernels than the full 12 token
# counts); the GEMM keeps its own token counts (GEMM_EXTRA_TOKENS).
SAMPLE_TOKENS = (1, 7, 4096, 16384, 65536)
FP8_CVT = re.compile(r"\b(v_cvt\w*(fp8|bf8)\w*)")  # the FP8 conversion instructions


# ------------------------------------------------------------------------------------------------
# Part 1 (jax process): lower deviceless and extract the Triton IR
# ------------------------------------------------------------------------------------------------


FP8_CASTS = ("encoder", "native")
BROKEN = {"op": "rmsnorm", "config": "deepseek-v3-mla", "tokens": 4096, "launch": [64, 1, 1],
          "broken": True}
# Group FP8 programs per lowering of the block-FP8 linear (the Pallas GEMM, and
# k3pallas.linear.GROUP_IMPLS): the Kimi-K3 TP8 KDA o_proj (12 x 128 -> 7168) and a DeepSeek-V3
# dense MLP input at TP8 (7168 -> 2 x 2304, gate and up).
_GROUP_BASES = ("kda_out_group_tp8", "dsv3_mlp_group_tp8")
GROUP_PROGRAMS = tuple(f"{p}_{impl}" for p in _GROUP_BASES
                       for impl in ("pallas", "dequantize", "per_group", "scaled_dot"))
PROGRAMS = ("mla_front", "kda_out_fp8", "kda_out_fp8_tp8", "kda_out_mxfp4_tp8", "mla_out_mxfp4_tp8",
            *GROUP_PROGRAMS)
PROGRAM_TOKENS = (64, 4096)
# The GEMM's token counts the gate compiles besides the run's --tokens (its decode, mid and
# prefill tiles).
GEMM_EXTRA_TOKENS = (1, 16, 64, 512, 4096)
# The GEMM's loop forms the AMD heuristic does not take (its K-varying scales prefetched, K steps
# unrolled, as on NVIDIA), compiled as forced configs ("CONFIG@ENTRY", a ``GemmConfig.as_entry``)
# so that the gate sees them on gfx942 / gfx950 too: (config, T, entry). The 16 x 64 tile
# unrolled twice takes 20 KB of gfx942's 64 KB LDS (occupancy 3): the 16 x 32 one, 12 KB.
GEMM_FORCED = (("deepseek-v3-mlp-tp8-fp8_group128", 1, (16, 32, 128, 4, 2, 0, 0, 1, 2)),
               ("deepseek-v3-mlp-tp8-fp8_group128", 512, (128, 128, 64, 8, 2, 0, 0, 1)))


def cases(tokens, ops, casts=FP8_CASTS) -> list[dict]:
    """Every (case, config, T[, fp8 cast]) the gate compiles: each case of ``bench.cases`` (an op
    with an output format) on its model configs; per-token FP8 with each conversion path; MXFP8
    too, its native e4m3fn conversion on gfx950 only (gfx942 converts natively to e4m3fnuz only,
    so there MXFP8 is the encoder's); MXFP4 has the encoder only."""
    from bench import cases as op_table

    out = []
    for name, op in op_table.OPS.items():
        if ops and name not in ops:
            continue
        for cfg in op.configs:
            mxfp8 = op.mx and op.sizes[cfg].get("fmt") == "mxfp8"
            for t in tokens:
                for cast in (casts if op.fp8 or mxfp8 else (None,)):
                    out.append({"op": name, "config": cfg, "tokens": t,
                                **({"fp8_cast": cast} if cast else {}),
                                **({"archs": ["gfx950"]} if mxfp8 and cast == "native" else {})})
    if not ops or "linear" in ops:  # the GEMM: every format and shape at the linear op's tokens
        out += [{"op": "linear", "config": cfg, "tokens": t} for cfg in op_table.LINEAR
                for t in op_table.OP_TOKENS["linear"] if not tokens or t in tokens
                or t in GEMM_EXTRA_TOKENS]
        out += [{"op": "linear", "config": f"{cfg}@{','.join(map(str, entry))}", "tokens": t}
                for cfg, t, entry in GEMM_FORCED]
    return out


def case_fn(case, arch=None):
    """(function, ShapeDtypeStructs) of one case, bf16 activations. FP8: the target's default
    format; the cast "native" is requested as "native_unchecked" (compiling ahead of time: no
    device to run the self-check on). A ``launch`` [rows, warps, stages] forces a launch config
    (``--broken``). ``linear``: the GEMM on records in ``arch``'s default FP8 type; a config
    ``NAME@ENTRY`` forces ``GemmConfig.from_entry(ENTRY)``."""
    import contextlib

    import jax.numpy as jnp

    from bench import cases as op_table
    from k3pallas.kernels import hooks, launch

    if case["op"] == "linear":
        import jax

        import k3pallas as kp
        from k3pallas import platform

        name, _, entry = case["config"].partition("@")  # "@ENTRY": a forced GemmConfig
        c = op_table.LINEAR[name]
        with (kp.compiling_for(platform.target_from_name(arch)) if arch
              else contextlib.nullcontext()):  # the records in the arch's FP8 type
            qa, qw = jax.eval_shape(lambda: (
                kp.quantize(jnp.zeros((case["tokens"], c["k"]), jnp.bfloat16), c["fmt"],
                            impl="reference"),
                kp.quantize_weight(jnp.zeros((c["k"], c["n"]), jnp.bfloat16), c["fmt"])))
        forced = launch.GemmConfig.from_entry([int(v) for v in entry.split(",")]) if entry else None

        def gemm(a, w):
            with hooks.forced(forced) if forced else contextlib.nullcontext():
                return kp.linear(a, w, impl="pallas")
        return gemm, [qa, qw]

    spec = op_table.OPS[case["op"]]
    args, options = spec.example(case["tokens"], jnp.dtype(jnp.bfloat16), **spec.sizes[case["config"]])
    if case.get("fp8_cast"):
        options = {**options, "fp8_cast": {"native": "native_unchecked"}.get(case["fp8_cast"], case["fp8_cast"])}
    forced = case.get("launch")

    def fn(*a):
        with hooks.forced(launch.LaunchConfig(*forced)) if forced else contextlib.nullcontext():
            return spec.fn(*a, impl="pallas", **options)
    return fn, list(args)


def program_fn(name, tokens, mesh):
    """(function, ShapeDtypeStructs) of a Kimi-K3 block, weights as arguments (shapes only), in
    the FP8 format of ``mesh``'s devices (the worker's topology)."""
    import jax
    import jax.numpy as jnp

    from k3pallas.models import kimi_k3

    key = jax.random.PRNGKey(0)  # eagerly, on the host: the topology's devices cannot run it
    bf16 = jnp.bfloat16
    if name in GROUP_PROGRAMS:
        import k3pallas as kp

        base, impl = next((p, name[len(p) + 1:]) for p in _GROUP_BASES if name.startswith(p))
        if base == "kda_out_group_tp8":
            cfg = kimi_k3.KIMI_K3_TP8
            with jax.set_mesh(mesh):
                params = jax.eval_shape(lambda: kimi_k3.init_kda_out(key, cfg))
            hd = jax.ShapeDtypeStruct((tokens, cfg.kda_heads, cfg.kda_head_dim), bf16)
            return (lambda p, o, g: kimi_k3.kda_out_group(p, o, g, cfg=cfg, impl="pallas",
                                                          linear_impl=impl), [params, hd, hd])
        with jax.set_mesh(mesh):
            w = jax.eval_shape(lambda: kp.quantize_weight(
                jax.random.normal(key, (7168, 2 * 2304), bf16), "fp8_group128"))
        x = jax.ShapeDtypeStruct((tokens, 7168), bf16)
        return (lambda w, x: kp.linear(kp.quantize(x, w.format, impl="pallas"), w, impl=impl),
                [w, x])
    if name in ("kda_out_mxfp4_tp8", "mla_out_mxfp4_tp8"):  # our MX kernel -> jax.nn.scaled_matmul
        cfg = kimi_k3.KIMI_K3_TP8
        init = kimi_k3.init_kda_out if name.startswith("kda") else kimi_k3.init_mla_out
        with jax.set_mesh(mesh):
            params = jax.eval_shape(lambda: init(key, cfg))
        if name.startswith("kda"):
            hd = jax.ShapeDtypeStruct((tokens, cfg.kda_heads, cfg.kda_head_dim), bf16)
            return (lambda p, o, g: kimi_k3.kda_out_mx(p, o, g, cfg=cfg, impl="pallas"), [params, hd, hd])
        cols = jax.ShapeDtypeStruct((tokens, cfg.kda_heads * cfg.kda_head_dim), bf16)
        return (lambda p, a, g: kimi_k3.mla_out_mx(p, a, g, impl="pallas"), [params, cols, cols])
    if name == "mla_front":
        cfg = kimi_k3.KIMI_K3
        with jax.set_mesh(mesh):
            params = jax.eval_shape(lambda: kimi_k3.init_mla_front(key, cfg))
        return (lambda p, x: kimi_k3.mla_front(p, x, cfg=cfg, impl="pallas"),
                [params, jax.ShapeDtypeStruct((tokens, cfg.hidden), bf16)])
    cfg = kimi_k3.KIMI_K3 if name == "kda_out_fp8" else kimi_k3.KIMI_K3_TP8
    with jax.set_mesh(mesh):
        params = jax.eval_shape(lambda: kimi_k3.init_kda_out(key, cfg))
    hd = jax.ShapeDtypeStruct((tokens, cfg.kda_heads, cfg.kda_head_dim), bf16)
    return (lambda p, o, g: kimi_k3.kda_out_fp8(p, o, g, cfg=cfg, impl="pallas"), [params, hd, hd])


# ------------------------------------------------------------------------------------------------
# Sharded programs: an 8-GPU topology, as a TP8 serving stack calls the ops
# ------------------------------------------------------------------------------------------------

TP = 8
SHARDED_TOKENS = (8, 512)  # 1 and 64 tokens per device
SHARDINGS = ("shard_map", "named")


# The config a case is sharded at: its head / column axis divisible by 8 (into whole blocks).
_SHARDED_CONFIG = {"rmsnorm_gated": "kimi-linear-kda", "rmsnorm_gated_fp8_per_token": "kimi-k3-kda",
                   "sigmoid_mul_fp8_per_token": "kimi-k3-mla-out",
                   "rmsnorm_gated_mx": "kimi-k3-kda-mxfp4",
                   # whole groups of 128 per device: 12288 columns (1536 would leave 192)
                   "sigmoid_mul_fp8_group": "kimi-k3-mla-out-fp8_group128"}
# The ops whose "named" case shards axis 1 (heads of [T, H, D]; columns of [T, N]) besides the
# tokens; the norms over their last axis shard the tokens.
_HEAD_SHARDED_OPS = ("rmsnorm_gated", "sigmoid_mul", "quantize")


SHARDED_PROGRAMS = ("kda_out_fp8_tp8_named", "mla_out_fp8_tp8_shard_map")
SHARDED_PROGRAM_TOKENS = (64, 4096)


def sharded_cases(ops=None) -> list[dict]:
    """Each op under ``shard_map`` (tokens over 8 devices) and under ``jax.jit`` with
    ``NamedSharding`` (heads / columns where the op has them, else tokens), FP8 with the native
    conversion; then the Kimi-K3 output blocks at TP8."""
    from bench import cases as op_table

    out = []
    for name, op in op_table.OPS.items():
        if ops and name not in ops:
            continue
        for mode in SHARDINGS:
            for t in SHARDED_TOKENS:
                out.append({"sharded": mode, "op": name,
                            "config": _SHARDED_CONFIG.get(name, op.configs[0]),
                            "tokens": t, **({"fp8_cast": "native"} if op.fp8 else {})})
    if not ops:
        out += [{"sharded": p.rsplit("_tp8_", 1)[1], "op": p, "config": "kimi-k3 TP8", "tokens": t,
                 "fp8_cast": "native"} for p in SHARDED_PROGRAMS for t in SHARDED_PROGRAM_TOKENS]
    return out


def sharded_fn(case, mesh):
    """(function, ShapeDtypeStructs with their NamedShardings on ``mesh``) of a sharded case."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import k3pallas as kp
    from bench import cases as op_table
    from k3pallas.models import kimi_k3

    def on(a, spec):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))

    cast = "native_unchecked"  # ahead of time: no device to run the self-check on
    t, bf16 = case["tokens"], jnp.bfloat16
    if case["op"] in SHARDED_PROGRAMS:
        cfg = kimi_k3.KIMI_K3
        key = jax.random.PRNGKey(0)
        with jax.set_mesh(mesh):  # the weights' FP8 format: the topology's
            if case["op"].startswith("kda"):
                p = jax.eval_shape(lambda: kimi_k3.init_kda_out(key, cfg))
            else:
                p = jax.eval_shape(lambda: kimi_k3.init_mla_out(key, cfg))
        # Row-parallel o_proj (K split): the bf16 weight's rows, the FP8 copy's columns (it is
        # stored [N, K]); the per-channel scales and the MXFP4 copy replicated.
        specs = {"w_o": P("x", None), "w_o_fp8": (P(None, "x"), P())}

        def place(name, value):
            spec = specs.get(name, P())
            if isinstance(value, kp.QuantizedWeight):
                data_spec, scale_spec = spec if isinstance(spec, tuple) else (P(), P())
                return jax.tree.unflatten(jax.tree.structure(value),
                                          [on(value.data, data_spec), on(value.scale, scale_spec)])
            return on(value, spec)
        params = {k: place(k, v) for k, v in p.items()}
        param_specs = {k: (jax.tree.unflatten(jax.tree.structure(v), list(specs[k]))
                           if isinstance(v, kp.QuantizedWeight) and isinstance(specs.get(k), tuple)
                           else jax.tree.map(lambda _: specs.get(k, P()), v))
                       for k, v in p.items()}
        if case["op"].startswith("kda"):  # jit with NamedSharding: heads over the 8 devices
            hd = on(jax.ShapeDtypeStruct((t, cfg.kda_heads, cfg.kda_head_dim), bf16), P(None, "x", None))
            return (lambda p, o, g: kimi_k3.kda_out_fp8(p, o, g, cfg=cfg, impl="pallas", fp8_cast=cast),
                    [params, hd, hd])
        # shard_map: each rank its 12 heads' columns, its o_proj slice, then the all-reduce.
        cols = on(jax.ShapeDtypeStruct((t, cfg.kda_heads * cfg.kda_head_dim), bf16), P(None, "x"))

        def rank(p, a, g):
            out = kimi_k3.mla_out_fp8(p, a, g, impl="pallas", fp8_cast=cast)
            return jax.lax.psum(out.astype(jnp.float32), "x").astype(bf16)

        fn = jax.shard_map(rank, mesh=mesh, in_specs=(param_specs, P(None, "x"), P(None, "x")),
                           out_specs=P())
        return fn, [params, cols, cols]

    spec = op_table.OPS[case["op"]]
    structs, options = spec.example(t, jnp.dtype(bf16), **spec.sizes[case["config"]])
    if case.get("fp8_cast"):
        options = {**options, "fp8_cast": cast}
    rows = spec.row_operands(structs, options)
    call = lambda *a: spec.fn(*a, impl="pallas", **options)  # noqa: E731
    if case["sharded"] == "shard_map":
        in_specs = tuple(P("x") if r else P() for r in rows)
        fn = jax.shard_map(call, mesh=mesh, in_specs=in_specs, out_specs=P("x"))
        return fn, [on(a, s) for a, s in zip(structs, in_specs)]
    row_spec = P(None, "x") if spec.op in _HEAD_SHARDED_OPS else P("x")
    return call, [on(a, row_spec if r else P()) for a, r in zip(structs, rows)]


def _encoder_kernel_ir(arch):
    """A Pallas kernel that only encodes float32 to the arch's default fp8 format."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from k3pallas import fp8 as fp8_lib, testing

    dtype = fp8_lib.default_fp8_dtype(arch)

    def kernel(x_ref, o_ref):
        i = jnp.arange(1024)
        o_ref[i] = fp8_lib.encode_fp8(x_ref[i], dtype).astype(jnp.uint8)

    def fn(x):
        return pl.pallas_call(kernel, grid=(x.shape[0] // 1024,),
                              in_specs=[pl.BlockSpec((1024,), lambda i: (i,))],
                              out_specs=pl.BlockSpec((1024,), lambda i: (i,)),
                              out_shape=jax.ShapeDtypeStruct(x.shape, jnp.uint8),
                              name="encode_fp8_" + jnp.dtype(dtype).name)(x)

    lowered = testing.lower_for(fn, [jax.ShapeDtypeStruct((1 << 20,), jnp.float32)], arch, "rocm")
    (mod,) = testing.triton_ir_modules(lowered)
    return mod, jnp.dtype(dtype).name


def extract(tokens, ops, workdir, log, broken=False):
    from k3pallas import testing

    manifest = []
    for arch in ARCHS:
        for i, case in enumerate(cases(tokens, ops) + ([BROKEN] if broken else [])):
            fn, args = case_fn(case, arch)
            lowered = testing.lower_for(fn, args, *testing.KNOWN_TARGETS[arch])
            for mod in testing.triton_ir_modules(lowered):
                path = os.path.join(workdir, f"{arch}-{i}.ttir")
                with open(path, "w") as f:
                    f.write(mod["ir"])
                manifest.append({**case, "arch": arch,
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
    cvt = sorted({m.group(1) for ln in code for m in [FP8_CVT.search(ln)] if m})
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


ARCH_FP8 = {"gfx942": "f8e4m3fnuz", "gfx950": "f8e4m3fn"}  # the arch's default FP8 format (HLO)
NATIVE_CVT = {"gfx942": "v_cvt_pk_fp8_f32", "gfx950": "v_cvt_scalef32_pk_fp8_f32"}
MAX_THREADS = 1024
FP8_MFMA = {"gfx942": "_fp8_fp8", "gfx950": "_f8f6f4"}  # the FP8 matrix instructions' suffixes


def problems(r) -> list[str]:
    if "error" in r:
        return [] if r["op"] == "native cast (Triton)" else [f"compile error: {r['error']}"]
    out = []
    threads = r.get("threads") or (r.get("num_warps") or 0) * 64
    if threads > MAX_THREADS:
        out.append(f"{threads} threads per program > {MAX_THREADS}")
    if r.get("sharded"):
        fp8 = r.get("fp8_cast") is not None
        if fp8 and r.get("fp8_formats") != [ARCH_FP8[r["arch"]]]:
            out.append(f"FP8 format {r.get('fp8_formats')}, not the arch's {ARCH_FP8[r['arch']]}")
        if not fp8 and r.get("fp8_formats"):
            out.append(f"FP8 {r['fp8_formats']} in a program without FP8")
        writes_codes = (fp8 and "fp8" in r["kernel"] and not r["kernel"].endswith("_scale_only")
                        and not r["kernel"].startswith("k3pallas_linear"))  # the GEMM reads codes
        if writes_codes and NATIVE_CVT[r["arch"]] not in (r.get("fp8_cvt") or []):
            out.append(f"no native conversion ({NATIVE_CVT[r['arch']]}) in {r['kernel']}: "
                       f"{r.get('fp8_cvt')}")
    if (r.get("vgpr_spill") or 0) or (r.get("sgpr_spill") or 0):
        out.append(f"spills ({r['vgpr_spill']} VGPR, {r['sgpr_spill']} SGPR)")
    if r.get("scratch"):
        out.append(f"scratch {r['scratch']} bytes")
    if r.get("kernel", "").startswith("k3pallas_") and (r.get("occupancy") or 0) < MIN_OCCUPANCY:
        out.append(f"occupancy {r.get('occupancy')} < {MIN_OCCUPANCY}")
    if r.get("kernel", "").startswith("k3pallas_linear") and "mfma" in r:
        # The GEMM's FP8 operands must reach the matrix cores as FP8: gfx942's
        # v_mfma_*_fp8_fp8 (e4m3fnuz), gfx950's v_mfma_*_f8f6f4 (e4m3fn).
        if not any(FP8_MFMA[r["arch"]] in m for m in r["mfma"]):
            out.append(f"no FP8 matrix instruction (*{FP8_MFMA[r['arch']]}*): {r['mfma']}")
    return out


def _key(r):
    return (r["arch"], r["op"], r["config"], r.get("tokens"), r.get("fp8_cast"), bool(r.get("broken")))


def markdown(results, meta, programs=(), other=None) -> str:
    """The gate's table; with ``other`` (the pip-triton results of the same cases) both
    compilers side by side as ``xla/pip``."""
    pair = other is not None
    by_key = {_key(r): r for r in (other or [])}
    title = ("XLA's ROCm compiler (jax-rocm7 %s) vs pip triton %s" % (meta.get("jax_rocm"), meta.get("triton"))
             if pair else f"{meta['compiler']}")
    lines = [f"# ROCm compile gate: AMDGCN resources, {title}", "",
             "Compiled on the CPU, deviceless, with the launch config the platform module picks for "
             "each target (wavefront 64). Occupancy: waves per SIMD (gate: >= "
             f"{MIN_OCCUPANCY}). LDS in bytes. `fp8 cvt`: FP8 conversion instructions (count). "
             "`cast`: the FP8 conversion path of the kernel (encoder: integer bit encoder; native: "
             "the hardware conversion). `linear`: the scaled FP8 GEMM, its matrix instructions in "
             "the `fp8 cvt` column (gate: FP8 ones)." + (" Cells `a/b`: XLA / pip triton." if pair else ""), "",
             "| arch | op | config | T | cast | R grid | warps | VGPR | SGPR | AGPR | spills | scratch | LDS | occupancy | instructions | VALU | fp8 cvt | gate |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(r, o, k):
        v = r.get(k)
        return f"{v}/{o.get(k)}" if pair and o is not None and k in o else f"{v}"

    for r in results:
        name = r["op"] + (" (broken on purpose)" if r.get("broken") else "")
        cast = r.get("fp8_cast") or "-"
        if "error" in r:
            lines.append(f"| {r['arch']} | {name} | {r['config']} | {r.get('tokens', '')} | {cast} | | | "
                         f"| | | | | | | | | | {'FAIL' if problems(r) else 'n/a'}: {r['error'][:80]} |")
            continue
        o = by_key.get(_key(r))
        grid = r.get("grid", ["-"])[0] if r.get("grid") else "-"
        p = problems(r)
        cvt = ", ".join(r.get("fp8_cvt") or r.get("mfma") or []) or "-"
        if r.get("fp8_cvt_count"):
            cvt += f" ({r['fp8_cvt_count']})"
        lines.append(
            f"| {r['arch']} | {name} | {r['config']} | {r['tokens']} | {cast} | {grid} | {r['num_warps']} | "
            f"{cell(r, o, 'vgpr')} | {cell(r, o, 'sgpr')} | {cell(r, o, 'agpr')} | "
            f"{r['vgpr_spill']}/{r['sgpr_spill']} | {r['scratch']} | {cell(r, o, 'lds')} | "
            f"{cell(r, o, 'occupancy')} | {cell(r, o, 'instructions')} | {r.get('valu', '-')} | {cvt} | "
            f"{'; '.join(p) if p else 'ok'} |")
    if programs:
        lines += ["", "## Whole programs: the Kimi-K3 blocks as XLA's ROCm backend compiles them", "",
                  "Deviceless there is no autotuning: XLA takes its default choice for the GEMMs "
                  "(on a MI300X / MI355X with a device it may autotune to another). "
                  "`*_mxfp4_tp8`: one TP8 rank's KDA / MLA output, our MXFP4 kernel feeding "
                  "`jax.nn.scaled_matmul` (`linear`) with an MXFP4 weight; gated: exactly our "
                  "launch and one GEMM (no copy or unpack between), on gfx950 with MX matrix "
                  "instructions (`v_mfma_scale_*`).", "",
                  "| arch | program | T | kernel launches (ours **bold**) | custom calls | the GEMMs become | gate |",
                  "|---|---|---|---|---|---|---|"]
        for pr in programs:
            if "error" in pr:
                lines.append(f"| {pr['arch']} | {pr['program']} | {pr['tokens']} | FAIL: {pr['error'][:100]} | | | FAIL |")
                continue
            ks = ", ".join((f"**{k['kernel']}**" if k["ours"] else k["kernel"]) for k in pr["launches"])
            cc = ", ".join(sorted({c["target"] for c in pr["custom_calls"]})) or "-"
            bad = program_problems(pr)
            lines.append(f"| {pr['arch']} | {pr['program']} | {pr['tokens']} | {ks} | {cc} | "
                         f"{gemm_summary(pr)} | {'; '.join(bad) if bad else 'ok'} |")
    return "\n".join(lines)


def sharded_markdown(rows, gemm_off, programs) -> str:
    """The sharded programs' kernels, and what the FP8 o_proj becomes with Triton GEMMs off."""
    if not rows and not gemm_off:
        return ""
    lines = ["", f"## Sharded programs: {TP}-GPU deviceless topology (XLA's ROCm backend)", "",
             "Traced with no k3pallas override: the library identifies the target from the "
             "topology devices (platform `gpu`, kind `MI300X` / `MI350X`). `shard_map`: tokens over "
             f"the {TP} devices; `named`: `jax.jit` with `NamedSharding` operands (heads or columns "
             "where the op has them, else tokens); the Kimi-K3 output blocks at TP8. FP8 with the "
             "native conversion (`native_unchecked`: no device for the self-check). Checked per "
             f"kernel: the arch's FP8 format, the native conversion instruction, threads <= {MAX_THREADS}, "
             f"no spills or scratch, occupancy >= {MIN_OCCUPANCY}.", "",
             "| arch | sharding | op | T | kernel | FP8 | threads | VGPR | spills | occupancy | fp8 cvt | collectives | gate |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = problems(r)
        if "error" in r:
            lines.append(f"| {r['arch']} | {r['sharded']} | {r['op']} | {r['tokens']} | {r.get('kernel', '')} "
                         f"| | | | | | | | FAIL: {r['error'][:80]} |")
            continue
        lines.append(
            f"| {r['arch']} | {r['sharded']} | {r['op']} | {r['tokens']} | {r['kernel']} | "
            f"{', '.join(r.get('fp8_formats') or []) or '-'} | {r['threads']} | {r['vgpr']} | "
            f"{r['vgpr_spill']}/{r['sgpr_spill']} | {r['occupancy']} | "
            f"{', '.join(r.get('fp8_cvt') or []) or '-'} | {', '.join(r.get('collectives') or []) or '-'} | "
            f"{'; '.join(p) if p else 'ok'} |")
    if gemm_off:
        default = {(pr["arch"], pr["program"], pr["tokens"]): pr for pr in programs}
        lines += ["", "## The FP8 o_proj with Triton GEMMs off (`--xla_gpu_enable_triton_gemm=false`)", "",
                  "What XLA's ROCm backend makes of the FP8 x FP8 `dot_general` (deviceless, no "
                  "autotuning) by default and with Triton GEMMs off.", "",
                  "| arch | program | T | default | Triton GEMMs off |", "|---|---|---|---|---|"]
        for pr in gemm_off:
            d = default.get((pr["arch"], pr["program"], pr["tokens"]))
            off = f"FAIL: {pr['error'][:80]}" if "error" in pr else gemm_summary(pr)
            lines.append(f"| {pr['arch']} | {pr['program']} | {pr['tokens']} | "
                         f"{gemm_summary(d) if d and 'error' not in d else '-'} | {off} |")
    return "\n".join(lines)


MX_PROGRAMS = ("kda_out_mxfp4_tp8", "mla_out_mxfp4_tp8")


def program_problems(pr) -> list[str]:
    """A whole program's failures: a compile error; for an MX program (our MXFP4 kernel feeding
    ``jax.nn.scaled_matmul``), any launch besides ours and the one GEMM (a copy or unpack between
    them), and on gfx950 a GEMM without MX matrix instructions (``v_mfma_scale_*``)."""
    if "error" in pr:
        return [pr["error"]]
    if pr["program"] not in MX_PROGRAMS:
        return []
    others = [k for k in pr["launches"] if not k["ours"]]
    out = []
    if len(others) != 1 or len(pr["launches"]) != 2:
        out.append(f"launches {[k['kernel'] for k in pr['launches']]}: expected ours and one GEMM")
    if pr["arch"] == "gfx950":
        mfma = [m for k in others for m in (k.get("mfma") or [])]
        known = any(k.get("mfma") is not None for k in others)
        if known and not any(m.startswith("v_mfma_scale") for m in mfma):
            out.append(f"no MX matrix instruction (v_mfma_scale_*) in the GEMM: {mfma}")
    return out


def gemm_summary(pr) -> str:
    """What XLA made of the program's GEMMs: vendor-library calls, or its own kernels with their
    matrix-core (MFMA) instructions, FMA count and FP8 conversions."""
    blas = sorted({c["target"] for c in pr["custom_calls"] if "blas" in c["target"].lower()})
    parts = [f"library call {', '.join(blas)}"] if blas else []
    for k in pr["launches"]:
        ours_gemm = k["ours"] and k["kernel"].startswith("k3pallas_linear")
        if (k["ours"] and not ours_gemm) or not (
                "gemm" in k["kernel"] or "dot" in k["kernel"] or k.get("mfma") or ours_gemm
                or pr["program"] in MX_PROGRAMS):
            continue
        if k.get("mfma") is None and "fma" not in k:
            parts.append(f"{k['kernel']}: (machine code as compiled before, not re-read)")
            continue
        mm = ", ".join(k.get("mfma") or []) or (
            f"no MFMA ({k.get('fma', '?')} FMA, {k.get('dot', '?')} dot-product instructions)")
        cvt = ", ".join(k.get("fp8_cvt") or [])
        parts.append(f"{k['kernel']}: {mm}" + (f"; fp8 -> f32 by {cvt}" if cvt else ""))
    return "; ".join(parts) or "-"


def run_xla(all_cases, programs, log, env_dir=None, sharded=(), parallel=2) -> tuple[list, list, dict]:
    """Compile with XLA's ROCm backend: per arch, one worker process for the kernel cases and the
    1-device programs, one for the programs with Triton GEMMs off (what the FP8 o_proj becomes
    then), and one for the sharded cases (8-device topology). ``parallel`` workers at a time, the
    next one started as soon as any finishes."""
    from bench.rocm import env as rocm_env

    env = rocm_env.ensure(env_dir, log=log)
    program_cases = [{"program": p, "tokens": t} for p in programs for t in PROGRAM_TOKENS]
    jobs = []
    for arch in ARCHS:
        jobs.append((arch, "kernels", all_cases + program_cases, {}))
        if programs:
            jobs.append((arch, "gemm_off", [c for c in program_cases if c["program"] != "mla_front"],
                         {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}))
        if sharded:
            jobs.append((arch, "sharded", list(sharded), {}))
    # The longest first, so that the short ones fill the other worker's time.
    jobs.sort(key=lambda job: -len(job[2]))
    kernels, progs, gemm_off, shard_rows = [], [], [], []
    with tempfile.TemporaryDirectory() as work:

        def start(i, job):
            arch, mode, cases, flags = job
            path = os.path.join(work, f"{i}-cases.json")
            with open(path, "w") as f:
                json.dump(cases, f)
            hsaco, dump = os.path.join(work, f"{i}-hsaco"), os.path.join(work, f"{i}-dump")
            os.makedirs(hsaco)
            xla_flags = " ".join(filter(None, [f"--xla_dump_to={dump}", flags.get("XLA_FLAGS")]))
            extra = {"TF_XLA_HSACO_CACHE_DIR": hsaco, "TF_XLA_HSACO_BITCODE_SIZE_THRESHOLD": "0",
                     "K3PALLAS_XLA_DUMP": dump, "XLA_FLAGS": xla_flags}
            out, err = os.path.join(work, f"{i}-out.json"), os.path.join(work, f"{i}-stderr.txt")
            worker_mode = "sharded" if mode == "sharded" else "kernels"
            with open(err, "w") as err_file:  # a file, not a pipe: nothing blocks on a full pipe
                proc = subprocess.Popen([env["python"], "-m", "bench.rocm.xla", arch, path, out, worker_mode],
                                        env=rocm_env.worker_environ(env, extra), cwd=rocm_env._repo_root(),
                                        stdout=subprocess.DEVNULL, stderr=err_file)
            return (job, out, err, proc)

        def finish(job, out, err, proc):
            arch, mode, cases, _ = job
            if proc.returncode != 0:
                with open(err) as f:
                    lines = [ln for ln in f.read().strip().splitlines() if ln.strip()]
                raise SystemExit(f"rocm_check: the XLA ROCm worker ({arch}, {mode}) failed: "
                                 f"{(lines or ['?'])[-1][:400]}")
            with open(out) as f:
                got = json.load(f)
            if mode == "kernels":
                kernels.extend(got["kernels"])
                progs.extend(got["programs"])
                log(f"{arch}: XLA compiled {len(got['kernels'])} kernels, {len(got['programs'])} programs")
            elif mode == "gemm_off":
                gemm_off.extend(got["programs"])
            else:
                shard_rows.extend(got["sharded"])
                log(f"{arch}: sharded: {len(cases)} cases, {len(got['sharded'])} kernels")

        pending, running = list(enumerate(jobs)), []
        try:
            while pending or running:
                while pending and len(running) < parallel:
                    running.append(start(*pending.pop(0)))
                time.sleep(0.5)
                for r in [r for r in running if r[3].poll() is not None]:
                    running.remove(r)
                    finish(*r)
        finally:
            for r in running:
                r[3].kill()
    # The report's order: arch by arch, as the jobs were listed before sorting.
    order = {a: i for i, a in enumerate(ARCHS)}
    for rows in (kernels, progs, gemm_off, shard_rows):
        rows.sort(key=lambda r: order[r["arch"]])
    return kernels, progs, {"jax_rocm": env["jax"], "devices": target_devices(env),
                            "gemm_off": gemm_off, "sharded": shard_rows}


def target_devices(env) -> dict:
    """CUs, clock and bandwidth of each arch, from XLA's own target config (for bench.rocm.amd_cost)."""
    out = {}
    for arch, path in env["targets"].items():
        with open(path) as f:
            text = f.read()
        num = lambda key: float(re.search(rf"\b{key}:\s*([\d.e+]+)", text).group(1))  # noqa: E731
        out[arch] = {"device": env["devices"][arch], "core_count": int(num("core_count")),
                     "clock_rate_ghz": num("clock_rate_ghz"), "memory_bandwidth": num("memory_bandwidth")}
    return out


def run_triton(tokens, ops, log, broken) -> tuple[list, str]:
    from bench.rocm import env as rocm_env

    with tempfile.TemporaryDirectory() as work:
        manifest = extract(tokens, ops, work, log, broken)
        path = os.path.join(work, "manifest.json")
        with open(path, "w") as f:
            json.dump(manifest, f)
        proc = subprocess.run([sys.executable, "-m", "bench.rocm.check", "--compile-manifest", path],
                              capture_output=True, text=True,
                              cwd=rocm_env._repo_root())
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-5000:])
            raise SystemExit("the triton compile process failed (is the rocm-check extra installed?)")
        results = json.loads(proc.stdout)
    version = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    return results, version


def main(argv=None):
    from bench import cases as bench_cases

    p = argparse.ArgumentParser(prog="python -m bench.rocm.check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compiler", choices=("xla", "triton", "both"), default="xla")
    p.add_argument("--tokens", default=",".join(map(str, bench_cases.DEFAULT_TOKENS)))
    p.add_argument("--sample", action="store_true",
                   help=f"the token counts of SAMPLE_TOKENS {SAMPLE_TOKENS} instead of --tokens: "
                        "one per launch config of AMD's heuristic (what CI compiles)")
    p.add_argument("--ops", default=None, help="comma-separated ops (default: all)")
    p.add_argument("--no-programs", action="store_true", help="skip the whole-program report (xla)")
    p.add_argument("--broken", action="store_true", help="add a deliberately broken kernel (the gate must fail)")
    p.add_argument("--env-dir", default=None, help="the bench.rocm.env folder (default: its default)")
    p.add_argument("--out", default=os.path.join("bench", "out"))
    p.add_argument("--stem", default="rocm_check", help="output file names (<stem>.md / .json)")
    p.add_argument("--check", action="store_true", help="exit 1 on any gate failure")
    p.add_argument("--no-sharded", action="store_true",
                   help="skip the sharded programs on the 8-GPU topology (xla)")
    p.add_argument("--compile-manifest", default=None, help=argparse.SUPPRESS)  # triton part 2
    args = p.parse_args(argv)
    if args.compile_manifest:
        json.dump(compile_all(args.compile_manifest), sys.stdout)
        return 0

    import jax

    from bench.rocm import env as rocm_env

    t0 = time.time()
    log = lambda m: print(f"[{time.time() - t0:6.1f}s] {m}", file=sys.stderr, flush=True)  # noqa: E731
    tokens = list(SAMPLE_TOKENS) if args.sample else [int(t) for t in args.tokens.split(",")]
    ops = args.ops.split(",") if args.ops else None
    all_cases = cases(tokens, ops) + ([BROKEN] if args.broken else [])
    meta = {"jax": jax.__version__, "min_occupancy": MIN_OCCUPANCY, "compiler": args.compiler}
    results, programs, other, shard_rows, gemm_off = [], [], None, [], []
    try:
        if args.compiler in ("xla", "both"):
            results, programs, m = run_xla(all_cases, [] if args.no_programs else PROGRAMS, log,
                                           args.env_dir, () if args.no_sharded else sharded_cases(ops))
            shard_rows, gemm_off = m.pop("sharded"), m.pop("gemm_off")
            meta.update(m, compiler="XLA ROCm backend (jax-rocm7-plugin %s)" % m["jax_rocm"])
        if args.compiler in ("triton", "both"):
            tri, meta["triton"] = run_triton(tokens, ops, log, args.broken)
            if args.compiler == "triton":
                results, meta["compiler"] = tri, f"pip triton {meta['triton']}"
            else:
                other = tri
                # The FP8 conversion baselines exist for pip triton only.
                results += [{**r, "op": r["op"] + " [pip triton only]"} for r in tri
                            if r["op"].startswith(("native cast (Triton)", "encode_fp8"))]
    except rocm_env.SetupError as e:
        print(f"rocm_check: {e}", file=sys.stderr)
        return 2
    meta["seconds"] = round(time.time() - t0, 1)
    log(f"compiled {len(results)} kernels")
    md = markdown(results, meta, programs, other) + sharded_markdown(shard_rows, gemm_off, programs)
    write_report(args.out, args.stem, md, {"meta": meta, "results": results, "programs": programs,
                                           "sharded": shard_rows, "gemm_off": gemm_off,
                                           **({"triton": other} if other is not None else {})})
    print(md)
    failures = [(r, problems(r)) for r in results + shard_rows if problems(r)]
    for r, ps in failures:
        print(f"GATE FAIL {r['arch']} {r.get('sharded', '')} {r['op']} {r['config']} "
              f"T={r.get('tokens')} cast={r.get('fp8_cast')}: {'; '.join(ps)}", file=sys.stderr)
    bad_programs = [pr for pr in programs if program_problems(pr)]
    for pr in bad_programs:
        print(f"GATE FAIL program {pr['arch']} {pr['program']} T={pr['tokens']}: "
              f"{'; '.join(program_problems(pr))}", file=sys.stderr)
    print(f"rocm_check: {len(results)} kernels, {len(programs)} programs, {len(shard_rows)} kernels "
          f"in sharded programs, {len(failures)} kernel failures, {len(bad_programs)} program "
          f"failures, {meta['seconds']} s", file=sys.stderr)
    if args.check and (failures or bad_programs):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
