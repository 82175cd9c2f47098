"""``python -m bench.inspection.nv_xla OP:CONFIG:T ...``: the kernels as XLA's own CUDA backend
compiles them for an H200 (sm_90a), on a machine with no GPU: registers, spills and the SASS
instruction mix of each kernel.

``--setup`` (once, ~400 MB of wheels) makes a venv under ``~/.cache/k3pallas/cuda-xla-0.12.0``
(``K3PALLAS_CUDA_ENV``) with jax 0.12.0 and the jax-cuda12 plugin (XLA's CUDA compiler: its
Triton, LLVM NVPTX) and pip ``triton`` for ``ptxas``, ``libdevice`` and ``cuobjdump`` (CUDA
12.9), and takes the H200's ``GpuTargetConfigProto`` out of the plugin binary. Each case then
compiles in that venv, in a process of its own, with ``JAX_PLATFORMS=cpu`` and
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` (the plugin registers with no CUDA libraries, as a
compile-only backend) on a deviceless topology (``jax.experimental.topologies``): the devices
are platform "gpu", kind "NVIDIA H200 141GB HBM3e", compute capability 9.0, and k3pallas picks
its sm_90 launch configs from them as on the H200. XLA writes the module's PTX
(``--xla_gpu_dump_llvmir``), which ``ptxas -v`` compiles and ``cuobjdump`` lists.

An ESTIMATE of the H200 machine's own compile (there: jax 0.11.2, CUDA 13's ptxas), far
closer than ``bench.inspection.nv_regs`` (pip triton's pipeline); not a predictor of time.
``--program PROGRAM:T ...``: a whole program instead (a ``bench.rocm.check.PROGRAMS`` name, or
``PROGRAM_EXTRA`` here), listing what XLA's CUDA backend launches for it: fusions and custom calls
(cuBLASLt GEMMs), as the H200 would run them before autotuning.
``K3PALLAS_NV_XLA_CONFIG=ROWS,WARPS`` compiles the cases with that launch config (a sweep's
candidates before a GPU times them); ``K3PALLAS_NV_XLA_GEMM=BM,BN,BK,WARPS,STAGES,SWAP[,MMA_ACC[,SCALE_PREFETCH]]`` the GEMM
(``linear:CONFIG:T``, a ``bench.cases.LINEAR`` config) with that ``GemmConfig``. ``K3PALLAS_NV_XLA_FLAGS`` adds XLA flags for an experiment
(``--xla_gpu_ftz=true``: the kernels with flush-to-zero). ``denormal_guards``: the ``FSETP`` range checks that ``ex2.approx`` /
``rsqrt.approx`` without flush-to-zero expand to (each with two predicated multiplies).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

JAX_VERSION = "0.12.0"
PACKAGES = [f"jax=={JAX_VERSION}", f"jaxlib=={JAX_VERSION}", f"jax-cuda12-plugin=={JAX_VERSION}",
            f"jax-cuda12-pjrt=={JAX_VERSION}", "triton==3.9.0", "numpy"]
DEVICE = "NVIDIA H200 141GB HBM3e"

# SASS opcodes counted (by prefix), and the constants of the denormal range checks.
OPCODES = ("LDG", "STG", "LDS", "LDSM", "STS", "STSM", "BAR", "SHFL", "REDUX", "MUFU.EX2",
           "MUFU.RSQ", "F2FP", "HGMMA", "QGMMA", "HMMA", "LDGSTS", "UTMALDG")
_DENORMAL_GUARD = re.compile(r"FSETP\.\S+ .*(-126, PT|1\.175494350822287508e-38)")
_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);", re.M)


def env_dir() -> str:
    return os.environ.get("K3PALLAS_CUDA_ENV") or os.path.join(
        os.path.expanduser("~"), ".cache", "k3pallas", f"cuda-xla-{JAX_VERSION}")


def target_config(plugin_bytes: bytes, device: str = DEVICE) -> str:
    """The ``GpuTargetConfigProto`` text of ``device`` from the plugin binary's embedded specs."""
    from bench.rocm.env import target_config_texts

    for text in target_config_texts(plugin_bytes):
        if f'device_description_str: "{device}"' in text:
            return text
    raise RuntimeError(f"no GpuTargetConfigProto for {device!r} in the plugin binary")


def parse_ptxas(log: str) -> dict:
    """{entry: {"registers", "spill_stores", "spill_loads"}} from ``ptxas -v`` output."""
    out, entry = {}, None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            entry = m.group(1)
            out[entry] = {}
        elif entry and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            out[entry].update(spill_stores=int(m.group(1)), spill_loads=int(m.group(2)))
        elif entry and (m := re.search(r"Used (\d+) registers", line)):
            out[entry]["registers"] = int(m.group(1))
    return out


def sass_stats(sass: str) -> dict:
    """Instruction counts of one kernel's ``cuobjdump --dump-sass`` listing."""
    ops = [(m.group(1), m.group(2)) for m in _SASS_LINE.finditer(sass)]
    stats = {"instructions": len(ops)}
    for op in OPCODES:
        stats[op] = sum(o == op or o.startswith(op + ".") for o, _ in ops)
    stats["denormal_guards"] = sum(bool(_DENORMAL_GUARD.match(f"{o} {rest}")) for o, rest in ops)
    return stats


def _tools(env: dict) -> dict:
    return {k: os.path.join(env["cuda_dir"], "bin", k) for k in ("ptxas", "cuobjdump")}


def setup() -> dict:
    """Build (or reuse) the venv; returns the environment description (also ``env.json``)."""
    root = env_dir()
    os.makedirs(root, exist_ok=True)
    py = os.path.join(root, "venv", "bin", "python")
    if not os.path.exists(py):  # jax 0.12 needs Python >= 3.12 (the ROCm gate's finder)
        from bench.rocm import env as rocm_env

        subprocess.run([rocm_env._find_python(None), "-m", "venv", os.path.join(root, "venv")],
                       check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", *PACKAGES],
                   check=True)
    paths = json.loads(subprocess.run([py, "-c", (
        "import json, os, jax_plugins.xla_cuda12 as p, triton.backends.nvidia as t; "
        "print(json.dumps([os.path.join(os.path.dirname(p.__file__), 'xla_cuda_plugin.so'), "
        "os.path.dirname(t.__file__)]))")], capture_output=True, text=True, check=True).stdout)
    plugin, nv = paths
    with open(plugin, "rb") as fh:
        config = target_config(fh.read())
    with open(os.path.join(root, "h200.txtpb"), "w") as fh:
        fh.write(config)
    # XLA's --xla_gpu_cuda_data_dir layout: bin/ptxas and nvvm/libdevice/libdevice.10.bc.
    cuda_dir = os.path.join(root, "cuda")
    for src, dst in ((os.path.join(nv, "bin", "ptxas"), "bin/ptxas"),
                     (os.path.join(nv, "bin", "cuobjdump"), "bin/cuobjdump"),
                     (os.path.join(nv, "lib", "libdevice.10.bc"), "nvvm/libdevice/libdevice.10.bc")):
        path = os.path.join(cuda_dir, dst)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not os.path.lexists(path):
            os.symlink(src, path)
    env = {"python": py, "target_config": os.path.join(root, "h200.txtpb"), "cuda_dir": cuda_dir}
    with open(os.path.join(root, "env.json"), "w") as fh:
        json.dump(env, fh, indent=1)
    return env


def load_env() -> dict:
    path = os.path.join(env_dir(), "env.json")
    if not os.path.exists(path):
        raise SystemExit(f"no environment at {env_dir()}: run python -m bench.inspection.nv_xla --setup")
    with open(path) as fh:
        return json.load(fh)


def _compile_in_env(case: str, env: dict) -> None:
    """(Runs in the venv, started by ``kernels``.) Compile one case for the deviceless H200; XLA
    dumps the PTX where ``XLA_FLAGS`` says."""
    import jax
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    from bench import cases as ops
    from bench.rocm import check as rocm_check
    from k3pallas.kernels import hooks
    from k3pallas.kernels.launch import LaunchConfig

    with open(env["target_config"]) as fh:
        topo = topologies.get_topology_desc("h200", "cuda", target_config=fh.read(),
                                            topology="1x1x1")
    mesh = topologies.make_mesh(topo, (1,), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec())
    name, cfg, t = case.split(":")
    fn, args = rocm_check.case_fn({"op": name, "config": cfg, "tokens": int(t),
                                   **({"fp8_cast": "native"} if name in ops.OPS and ops.OPS[name].fp8
                                      else {})})
    structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    forced = os.environ.get("K3PALLAS_NV_XLA_CONFIG")  # "ROWS,WARPS": this launch config instead
    config = LaunchConfig(*map(int, forced.split(",")), 1) if forced else None
    gemm = os.environ.get("K3PALLAS_NV_XLA_GEMM")  # "BM,BN,BK,WARPS,STAGES,SWAP": the GEMM's
    if gemm:
        from k3pallas.kernels.launch import GemmConfig

        config = GemmConfig.from_entry(list(map(int, gemm.split(","))))
    with jax.set_mesh(mesh), (hooks.forced(config) if config else contextlib.nullcontext()):
        jax.jit(fn).trace(*structs).lower().compile()


def _program_in_env(spec: str) -> None:
    """(Runs in the venv.) Compile one whole program (``PROGRAM:T``: a name of
    ``bench.rocm.check.PROGRAMS`` or of ``PROGRAM_EXTRA`` here) for the deviceless H200 and
    print what its entry computation launches (fusions, custom calls: a cuBLASLt call is
    ``__cublas$lt$matmul[$f8]``), one per line, as JSON."""
    import jax
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    from bench.rocm import check as rocm_check

    env = load_env()
    with open(env["target_config"]) as fh:
        topo = topologies.get_topology_desc("h200", "cuda", target_config=fh.read(),
                                            topology="1x1x1")
    mesh = topologies.make_mesh(topo, (1,), ("x",))
    name, tokens = spec.rsplit(":", 1)
    fn, args = (PROGRAM_EXTRA[name] if name in PROGRAM_EXTRA else rocm_check.program_fn)(
        name, int(tokens), mesh)
    sharding = NamedSharding(mesh, PartitionSpec())
    structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    with jax.set_mesh(mesh):
        hlo = jax.jit(fn).trace(*structs).lower().compile().as_text()
    print(json.dumps({"program": spec, "launches": entry_launches(hlo)}))


def entry_launches(hlo: str) -> list[str]:
    """What the entry computation of an optimized HLO module launches, in order: each fusion as
    ``name (kind)``, each custom call as its target (a Pallas kernel by its name)."""
    entry = hlo[hlo.index("\nENTRY "):] if "\nENTRY " in hlo else hlo
    entry = entry[:entry.find("\n}")]
    out = []
    for line in entry.splitlines():
        if m := re.search(r"%?([\w.\-]+) = .*? fusion\(.*?kind=(\w+)", line):
            out.append(f"{m.group(1)} ({m.group(2)})")
        elif m := re.search(r'custom_call_target="([^"]+)"', line):
            ours = re.search(r"(k3pallas_\w+)", line)
            out.append(f"**{ours.group(1)}**" if ours else m.group(1))
    return out


def _per_token_linear(name, tokens, mesh):
    """``kp.quantize`` per token then ``linear`` at the Kimi-K3 TP8 o_proj (1536 -> 7168); with
    ``_pad16``: the activation's rows padded to a multiple of 16 before the GEMM (what XLA's FP8
    GEMM rewrite pads to) and the result sliced back."""
    import jax
    import jax.numpy as jnp

    import k3pallas as kp

    with jax.set_mesh(mesh):
        w = jax.eval_shape(lambda: kp.quantize_weight(
            jax.random.normal(jax.random.PRNGKey(0), (1536, 7168), jnp.bfloat16), "fp8_per_token"))
    x = jax.ShapeDtypeStruct((tokens, 1536), jnp.bfloat16)
    pad = name.endswith("_pad16")

    def fn(w, x):
        if pad:
            x = jnp.pad(x, ((0, -x.shape[0] % 16), (0, 0)))
        y = kp.linear(kp.quantize(x, w.format, impl="pallas"), w)
        return y[:tokens]
    return fn, [w, x]


# Programs only this tool compiles (name -> (name, tokens, mesh) -> (fn, args)).
PROGRAM_EXTRA = {"per_token_linear_tp8": _per_token_linear,
                 "per_token_linear_tp8_pad16": _per_token_linear}


def program(spec: str, env: dict) -> dict:
    """``{"program", "launches"}`` of one ``PROGRAM:T``, compiled in the venv."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run_env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
               "PYTHONPATH": repo, "XLA_FLAGS": f"--xla_gpu_cuda_data_dir={env['cuda_dir']} "
               + os.environ.get("K3PALLAS_NV_XLA_FLAGS", "")}
    proc = subprocess.run([env["python"], "-m", "bench.inspection.nv_xla", "--program-one", spec],
                          env=run_env, capture_output=True, text=True, cwd=repo)
    if proc.returncode != 0:
        return {"program": spec, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def kernels(case: str, env: dict) -> list[dict]:
    """[{kernel, registers, spills, SASS counts}] of one ``OP:CONFIG:T`` case."""
    tools = _tools(env)
    with tempfile.TemporaryDirectory() as dump:
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        run_env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
                   "PYTHONPATH": repo, "XLA_FLAGS": f"--xla_gpu_cuda_data_dir={env['cuda_dir']} "
                   f"--xla_dump_to={dump} --xla_gpu_dump_llvmir --xla_dump_emitter_re=.* "
                   + os.environ.get("K3PALLAS_NV_XLA_FLAGS", "")}
        proc = subprocess.run([env["python"], "-m", "bench.inspection.nv_xla", "--compile-one", case],
                              env=run_env, capture_output=True, text=True, cwd=repo)
        if proc.returncode != 0:
            return [{"case": case, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}]
        rows = []
        for ptx in sorted(glob.glob(os.path.join(dump, "*.ptx"))):
            cubin = ptx + ".cubin"
            log = subprocess.run([tools["ptxas"], "-v", "--gpu-name=sm_90a", ptx, "-o", cubin],
                                 capture_output=True, text=True, check=True).stderr
            for entry, res in parse_ptxas(log).items():
                if not entry.startswith("k3pallas"):
                    continue
                sass = subprocess.run([tools["cuobjdump"], "--dump-sass", "--function", entry, cubin],
                                      capture_output=True, text=True, check=True).stdout
                rows.append({"case": case, "kernel": entry, **res, **sass_stats(sass)})
        return rows


def main(argv) -> int:
    if argv[:1] == ["--setup"]:
        print(json.dumps(setup(), indent=1))
        return 0
    if argv[:1] == ["--compile-one"]:
        _compile_in_env(argv[1], load_env())
        return 0
    if argv[:1] == ["--program-one"]:
        _program_in_env(argv[1])
        return 0
    env = load_env()
    if argv[:1] == ["--program"]:
        print("| program | launches |\n|---|---|")
        for spec in argv[1:]:
            r = program(spec, env)
            print(f"| {spec} | {r.get('error') or ', '.join(r['launches'])} |")
        return 0
    cols = ("registers", "spill_stores", "instructions", *OPCODES, "denormal_guards")
    print("| case | kernel | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for case in argv:
        for r in kernels(case, env):
            if "error" in r:
                print(f"| {case} | ERROR: {r['error']} |")
                continue
            print(f"| {case} | {r['kernel']} | " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
