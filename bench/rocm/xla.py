"""The XLA-ROCm side of the ROCm compile gate: runs inside the environment of ``bench.rocm.env``.

One process per arch (``python -m bench.rocm.xla ARCH CASES.json OUT.json``, started by
``bench.rocm.check`` with ``bench.rocm.env.worker_environ``): it builds the deviceless topology
from XLA's target config for that arch, compiles every case with ``jax.jit(...).lower().compile()``
through XLA's ROCm backend (XLA's own Triton, its pass pipeline, LLVM AMDGPU: what a MI300X /
MI355X user's jax does), and reads what came out:

* the HSACO XLA writes for every kernel (``TF_XLA_HSACO_CACHE_DIR``): VGPR / SGPR / AGPR / spills
  / scratch from its AMDGPU metadata (``llvm-readobj --notes``), instructions from the
  disassembly (``llvm-objdump --mcpu=<arch>``, LLVM 22);
* the launch (threads, shared memory) from XLA's thunk sequence (``--xla_dump_to``);
* for the whole programs, the optimized HLO: every kernel launch and custom call, and what the FP8
  dot became. Deviceless there is no autotuning: XLA takes its default GEMM choice.

XLA compiles a kernel once per process: a case whose kernel it has already compiled writes no new
HSACO, and takes the resources of the earlier case with the same Triton call as compiled (IR text,
warps, stages; ``triton_calls``). The sharded cases of an arch share one process.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import time

from bench.rocm.check import FP8_CVT

LDS_PER_CU = {"gfx942": 65536, "gfx950": 163840}
TRANSCENDENTAL = ("v_exp_", "v_log_", "v_rcp_", "v_rsq_", "v_sqrt_", "v_sin_", "v_cos_")


def occupancy(arch, vgpr, agpr, sgpr, lds, waves_per_group) -> int:
    """Waves per SIMD that fit (CDNA3/4: 512 unified VGPR+AGPR per lane in granules of 8, 800
    SGPRs in granules of 16, at most 8 waves; LDS per CU shared by the groups). Equal to the
    ``; Occupancy`` that Triton 3.9 prints for all 132 kernels of the pip-triton gate."""
    up = lambda x, g: -(-max(int(x), 1) // g) * g  # noqa: E731
    waves = min(8, 512 // up(up(vgpr, 4) + (agpr or 0), 8), 800 // up(sgpr, 16))
    if lds:
        waves = min(waves, max(1, (LDS_PER_CU[arch] // lds) * waves_per_group // 4))
    return waves


def read_hsaco(path, arch, tools) -> list[dict]:
    notes = subprocess.run([tools["readobj"], "--notes", path], capture_output=True, text=True,
                           check=True).stdout
    dis = subprocess.run([tools["objdump"], "-d", f"--mcpu={arch}", path], capture_output=True,
                         text=True, check=True).stdout
    return [{**k, **parse_code(dis, k["kernel"])} for k in parse_notes(notes)]


def parse_notes(notes: str) -> list[dict]:
    """The kernels' resources from ``llvm-readobj --notes`` (the AMDGPU metadata YAML)."""
    kernels = []
    listing = notes.split("amdhsa.kernels:", 1)[-1].split("amdhsa.target:", 1)[0]
    for block in re.split(r"\n  - (?=\.)", listing)[1:]:
        block = "    " + block  # the kernel's own fields, four spaces in (its args are deeper)

        def field(name, block=block):
            m = re.search(rf"^    \.{name}:\s+(\S+)", block, re.M)
            return m.group(1) if m else None

        kernels.append({"kernel": field("name"), "vgpr": int(field("vgpr_count")),
                        "sgpr": int(field("sgpr_count")), "agpr": int(field("agpr_count") or 0),
                        "vgpr_spill": int(field("vgpr_spill_count") or 0),
                        "sgpr_spill": int(field("sgpr_spill_count") or 0),
                        "scratch": int(field("private_segment_fixed_size") or 0),
                        "static_lds": int(field("group_segment_fixed_size") or 0)})
    return kernels


def parse_code(dis: str, kernel: str) -> dict:
    """Instruction counts of ``kernel`` in an ``llvm-objdump -d`` listing, up to its last
    ``s_endpgm`` (the ``s_nop`` padding after it is not code)."""
    code = []
    for line in dis.split(f"<{kernel}>:", 1)[-1].splitlines()[1:]:
        if not line.startswith("\t"):
            if line.strip().endswith(">:"):
                break
            continue
        code.append(line.strip().split()[0])
    last = max((i for i, op in enumerate(code) if op == "s_endpgm"), default=len(code) - 1)
    code = code[: last + 1]
    cvt = [op for op in code if FP8_CVT.match(op)]
    return {"instructions": len(code), "valu": sum(op.startswith("v_") for op in code),
            "fp8_cvt": sorted(set(cvt)), "fp8_cvt_count": len(cvt),
            "undecoded": sum(op.startswith(".") for op in code),
            "mfma": sorted({op for op in code if op.startswith(("v_mfma", "v_smfmac"))}),
            "fma": sum(op.startswith(("v_fma", "v_fmac", "v_pk_fma")) for op in code),
            # Transcendentals: quarter rate on CDNA (16 clocks per wave64 instruction).
            "trans": sum(op.startswith(TRANSCENDENTAL) for op in code),
            "dot": sum(op.startswith("v_dot") for op in code)}


def triton_calls(hlo: str) -> dict:
    """{kernel name: key} of every Triton call in a compiled program's HLO, as compiled (after
    SPMD partitioning: the per-device kernel). The key hashes the call's Triton IR as text, its
    locations dropped, with the rest of its backend config (name, warps, stages) but not the grid,
    which does not change the machine code. Not the IR's bytecode: the same kernel traced in
    another program can serialize to other bytes (its locations and string table), which XLA
    compiles to the same HSACO and so writes no new one (``Compiler.known``)."""
    out = {}
    for line in hlo.splitlines():
        if "__gpu$xla.gpu.triton" not in line or "backend_config={" not in line:
            continue
        config = line[line.index("backend_config={"):]
        ir = re.search(r'\bir = "((?:[^"\\]|\\.)*)"', config)
        rest = config[ir.end():config.index("}", ir.end()) + 1]
        name = re.search(r'\bname = "([^"]+)"', rest).group(1)
        key = _ir_text(ir.group(1), name) + rest
        out.setdefault(name, hashlib.sha256(key.encode()).hexdigest())
    return out


_ESCAPE = re.compile(r"\\([0-9A-Fa-f]{2}|.)", re.S)


def _ir_text(escaped: str, name: str) -> str:
    """The Triton IR of an HLO-printed bytecode string (MLIR's escapes: ``\\XX`` hex, ``\\\\``,
    ``\\"``) as text, normalized as ``ir_hashes`` hashes it (no locations)."""
    from bench.inspection import ir_hashes
    from k3pallas import _compat

    data = _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)) if len(m.group(1)) == 2 else m.group(1),
                       escaped).encode("latin-1")
    return ir_hashes.normalized(_compat.triton_ir_text(data), name)


_THUNK = re.compile(r"kCustomKernel.*? (\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+) bytes")


def _newest_thunks(dump_dir, seen):
    files = [f for f in glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt")) if f not in seen]
    launches = {}
    for f in files:
        seen.add(f)
        with open(f) as fh:
            for m in _THUNK.finditer(fh.read()):
                launches[m.group(1)] = {"grid": [int(m.group(i)) for i in (2, 3, 4)],
                                        "threads": int(m.group(5)), "lds": int(m.group(8))}
    return launches


# The private jax these patches touch was read in, and the gate checked against, jax 0.12.0
# with jax-rocm7-plugin 0.12.0 (bench.rocm.env pins both).
ROCM_DEVICELESS_JAX = ((0, 12, 0),)


def _jax_version() -> tuple[int, ...]:
    import jax

    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in jax.__version__.split(".")[:3])


def deviceless_topology(target_config_text: str, arch: str, device_kind: str, devices: int = 1):
    """A ROCm topology of ``devices`` GPUs of ``arch`` (one host) from XLA's
    ``GpuTargetConfigProto`` text, with the two patches that let the compile-only plugin start
    and Pallas lower for it:

    * ``jax._src.hardware_utils.num_available_amd_gpus`` -> 1: the plugin refuses to initialise
      when the kernel driver shows no GPU;
    * Pallas' GPU-info registry learns ``device_kind`` -> ``arch``
      (``k3pallas.testing.register_deviceless_gpu_kind``): the compile-only device reports its
      marketing name ("MI300X") and no compute capability.

    Call before the first use of the ROCm backend in the process. RuntimeError naming the version
    on a jax these patches were not written for.
    """
    import jax

    if _jax_version() not in ROCM_DEVICELESS_JAX:
        raise RuntimeError(
            f"the deviceless ROCm patches in bench.rocm.xla were written for jax "
            f"{', '.join('.'.join(map(str, v)) for v in ROCM_DEVICELESS_JAX)}; this is jax "
            f"{jax.__version__} (build the environment with python -m bench.rocm.env)")
    from jax._src import hardware_utils
    from jax.experimental import topologies

    from k3pallas import testing

    hardware_utils.num_available_amd_gpus = lambda stop_at=None: 1
    testing.register_deviceless_gpu_kind(device_kind, arch)
    return topologies.get_topology_desc("", "rocm", target_config=target_config_text,
                                        topology=f"1x1x{devices}")


class Compiler:
    """XLA's ROCm backend on a deviceless topology of ``devices`` GPUs of ``arch``.

    Programs are traced with no k3pallas override: the library finds the target itself from the
    topology devices (platform "gpu", kind "MI300X" / "MI350X"), as on hardware. They are lowered
    under ``jax.set_mesh`` of the topology, where jax's own Pallas lowering reads the device.
    """

    def __init__(self, arch, env, devices=1):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        from k3pallas import platform

        self.arch, self.env = arch, env
        with open(env["targets"][arch]) as fh:
            self.topology = deviceless_topology(fh.read(), arch, env["devices"][arch],
                                                             devices=devices)
        from jax.experimental import topologies

        self.mesh = topologies.make_mesh(self.topology, (devices,), ("x",))
        self.sharding = NamedSharding(self.mesh, PartitionSpec())
        self.target = platform.target_of_device(self.mesh.devices.flat[0])
        self.hsaco_dir = os.environ["TF_XLA_HSACO_CACHE_DIR"]
        self.dump_dir = os.environ["K3PALLAS_XLA_DUMP"]
        self.seen_hsaco, self.seen_dumps, self.by_call = set(), set(), {}
        self.jax = jax

    def structs(self, args):
        """ShapeDtypeStructs on the topology: as sharded where they say so (a NamedSharding on
        this topology's mesh), else replicated."""
        from jax.sharding import NamedSharding

        def one(a):
            sharding = getattr(a, "sharding", None)
            return self.jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding if isinstance(
                sharding, NamedSharding) else self.sharding)
        return self.jax.tree.map(one, args)

    def compile(self, fn, args, trace_in_mesh=True):
        """(compiled, lowered, new kernels {name: resources}, launches {name: launch}).

        Lowered and compiled under ``jax.set_mesh`` of the topology (where jax's own Pallas
        lowering reads the device); traced there too, or, with ``trace_in_mesh=False``, outside
        any mesh (jit with NamedSharding operands: k3pallas finds the target from them)."""
        structs = self.structs(args)
        with self.jax.set_mesh(self.mesh) if trace_in_mesh else contextlib.nullcontext():
            traced = self.jax.jit(fn).trace(*structs)
        with self.jax.set_mesh(self.mesh):
            lowered = traced.lower()
            compiled = lowered.compile()
        new = sorted(set(glob.glob(os.path.join(self.hsaco_dir, "*.hsaco"))) - self.seen_hsaco)
        self.seen_hsaco.update(new)
        kernels = {}
        for path in new:
            for k in read_hsaco(path, self.arch, self.env["llvm"]):
                kernels[k["kernel"]] = k
        return compiled, lowered, kernels, _newest_thunks(self.dump_dir, self.seen_dumps)

    def known(self, hlo, kernels):
        """Fills ``kernels`` (name -> resources) with the kernels of the compiled program ``hlo``
        (its text) that this process compiled before (XLA keeps them in memory and writes no
        new HSACO: the same Triton IR and launch, the earlier resources), and records the new
        ones."""
        for name, key in triton_calls(hlo).items():
            if name in kernels:
                self.by_call.setdefault(key, kernels[name])
            elif key in self.by_call:
                kernels[name] = self.by_call[key]

    def kernel_case(self, case, fn, args) -> list[dict]:
        from k3pallas import testing

        t0 = time.time()
        try:
            compiled, lowered, kernels, launches = self.compile(fn, args)
        except Exception as e:  # noqa: BLE001 - a compile error is the gate's finding
            if os.environ.get("K3PALLAS_ROCM_DEBUG"):
                raise
            return [{**case, "error": f"{type(e).__name__}: {str(e)[:300]}"}]
        seconds = round(time.time() - t0, 2)
        self.known(compiled.as_text(), kernels)
        rows = []
        for mod in testing.triton_ir_modules(lowered):
            res = kernels.get(mod["name"])
            if res is None:
                rows.append({**case, "kernel": mod["name"], "error": "no HSACO found for the kernel"})
                continue
            launch = launches.get(mod["name"], {})
            threads = launch.get("threads", mod["num_warps"] * 64)
            lds = launch.get("lds")
            rows.append({**case, **res, "num_warps": threads // 64, "num_stages": mod["num_stages"],
                         "grid": list(mod["grid"]), "lds": lds, "compile_s": seconds,
                         "occupancy": occupancy(self.arch, res["vgpr"], res["agpr"], res["sgpr"],
                                                max(lds or 0, res["static_lds"]), threads // 64)})
        return rows

    def program(self, name, fn, args) -> dict:
        t0 = time.time()
        compiled, _, kernels, launches = self.compile(fn, args)
        hlo = compiled.as_text()
        self.known(hlo, kernels)
        calls = []
        for line in hlo.splitlines():
            m = re.search(r'custom_call_target="([^"]+)"', line)
            if m:
                n = re.search(r'name = "([^"]+)"', line) or re.search(r"^\s*(?:ROOT )?%?([\w.\-]+) =", line)
                calls.append({"target": m.group(1), "name": n.group(1) if n else "?"})
        fusions = re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? fusion\(.*?kind=(\w+).*?calls=%?([\w.\-]+)",
                             hlo, re.M)
        dots = [ln.strip()[:200] for ln in hlo.splitlines() if re.search(r"\bdot\(|__triton_nested_gemm|gemm", ln)
                and "f8" in ln]
        return {"arch": self.arch, "program": name, "compile_s": round(time.time() - t0, 2),
                "launches": [{"kernel": k, **v, "ours": k.startswith("k3pallas_"),
                              **({kk: kernels[k][kk] for kk in ("vgpr", "sgpr", "instructions", "fp8_cvt",
                                                                "fp8_cvt_count", "mfma", "fma", "dot")}
                                 if k in kernels else {})}
                             for k, v in launches.items()],
                "custom_calls": calls, "fusions": [{"name": a, "kind": b} for a, b, _ in fusions],
                "fp8_dot_lines": dots[:6], "hlo_lines": len(hlo.splitlines())}


def smoke():
    """Compile one small jnp function for gfx942 (``bench.rocm.env``'s check)."""
    import tempfile

    import jax.numpy as jnp

    from bench.rocm import env as rocm_env

    env = rocm_env.load()
    with tempfile.TemporaryDirectory() as d:
        os.environ.setdefault("TF_XLA_HSACO_CACHE_DIR", d)
        os.environ.setdefault("K3PALLAS_XLA_DUMP", d)
        c = Compiler("gfx942", env)
        import jax

        jax.jit(lambda x: x * 2 + 1).trace(*c.structs([jax.ShapeDtypeStruct((1024,), jnp.float32)])).lower().compile()
    print("ok")


_HLO_FP8 = re.compile(r"= \(?(f8e4m3fnuz|f8e4m3fn|f8e5m2)\[[^\n]*__gpu\$xla\.gpu\.triton")


def sharded(comp, case) -> list[dict]:
    """One sharded program (``bench.rocm.check.sharded_fn``) on the 8-device topology: a row per
    k3pallas kernel launched in it, with what the gate checks (FP8 format, native conversion,
    threads, spills, occupancy)."""
    from bench.rocm import check as rocm_check

    t0 = time.time()
    try:
        fn, args = rocm_check.sharded_fn(case, comp.mesh)
        compiled, _, kernels, launches = comp.compile(fn, args, case["sharded"] != "named")
        hlo = compiled.as_text()
        comp.known(hlo, kernels)
    except Exception as e:  # noqa: BLE001 - a compile error is the gate's finding
        if os.environ.get("K3PALLAS_ROCM_DEBUG"):
            raise
        return [{**case, "arch": comp.arch, "error": f"{type(e).__name__}: {str(e)[:300]}"}]
    formats = sorted({m.group(1) for m in _HLO_FP8.finditer(hlo)})
    rows = []
    for name, launch in launches.items():
        if not name.startswith("k3pallas_"):
            continue
        res = kernels.get(name)
        row = {**case, "arch": comp.arch, "kernel": name, "threads": launch["threads"],
               "num_warps": launch["threads"] // 64, "grid": launch["grid"], "lds": launch["lds"],
               "fp8_formats": formats, "target": f"{comp.target.backend} {comp.target.arch}",
               "compile_s": round(time.time() - t0, 2),
               "collectives": sorted({c for c in ("all-reduce", "all-gather", "reduce-scatter",
                                                  "all-to-all") if f" {c}(" in hlo})}
        if res is None:
            row["error"] = "no HSACO found for the kernel"
        else:
            row.update(res, occupancy=occupancy(comp.arch, res["vgpr"], res["agpr"], res["sgpr"],
                                                max(launch["lds"] or 0, res["static_lds"]),
                                                launch["threads"] // 64))
        rows.append(row)
    if not rows:
        rows.append({**case, "arch": comp.arch, "error": "no k3pallas kernel in the compiled program"})
    return rows


def main(arch, cases_path, out_path, mode="kernels"):
    """``mode``: "kernels" (the kernel cases and 1-device programs) or "sharded" (the sharded
    cases, on an 8-device topology)."""
    from bench.rocm import check as rocm_check, env as rocm_env

    env = rocm_env.load()
    with open(cases_path) as fh:
        cases = json.load(fh)
    if mode == "sharded":
        comp = Compiler(arch, env, devices=rocm_check.TP)
        out = {"kernels": [], "programs": [], "sharded": [r for c in cases for r in sharded(comp, c)]}
        with open(out_path, "w") as fh:
            json.dump(out, fh)
        return
    comp = Compiler(arch, env)
    out = {"kernels": [], "programs": []}
    for case in cases:
        if case.get("program"):
            try:
                fn, args = rocm_check.program_fn(case["program"], case["tokens"], comp.mesh)
                out["programs"].append({**comp.program(case["program"], fn, args), "tokens": case["tokens"]})
            except Exception as e:  # noqa: BLE001
                out["programs"].append({"arch": arch, "program": case["program"],
                                        "tokens": case["tokens"], "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        if arch not in case.get("archs", (arch,)):  # e.g. native MXFP8: gfx950 only
            continue
        fn, args = rocm_check.case_fn(case, arch)
        out["kernels"] += comp.kernel_case({**case, "arch": arch}, fn, args)
    with open(out_path, "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main(*sys.argv[1:5])
