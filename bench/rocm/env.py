"""``python -m bench.rocm.env``: build the compile-only ROCm environment, in one command.

What a MI300X / MI355X user runs is XLA's ROCm backend (``jax-rocm7-pjrt`` + ``jax-rocm7-plugin``)
with its own Triton fork and LLVM AMDGPU. That compiler also runs on a CPU-only machine, deviceless,
given four things this module sets up in one folder (default ``~/.cache/k3pallas/rocm-xla-<jax>``,
or ``$K3PALLAS_ROCM_ENV``, or ``--dir``):

1. ``venv/``: a Python >= 3.12 virtual environment with ``jax``, ``jaxlib``, ``jax-rocm7-pjrt`` and
   ``jax-rocm7-plugin`` pinned to ``JAX_VERSION`` (``jax[rocm7-local]`` of 0.12.0.1 pins a plugin
   that does not exist, hence the explicit pins).
2. ``stubs/``: compile-only stand-ins for the ROCm 7 runtime libraries the plugin links (HIP, HSA,
   hipBLASLt, MIOpen, RCCL, ...), which no PyPI or Debian package provides. They are generated from
   the plugin's own undefined dynamic symbols (``readelf``), with the symbol versions its
   ``.gnu.version_r`` asks of each library, and built with ``gcc``. Every function returns an error
   code; compiling never calls them (only the profiler's start-up hook is called, and its error is
   harmless). A few (``hipGetDeviceCount``, the runtime version queries, fat-binary registration)
   answer "no device" cleanly so that the plugin starts.
3. ``targets/<arch>.txtpb``: the ``stream_executor.GpuTargetConfigProto`` that XLA ships for MI300X
   (gfx942) and MI350X (gfx950), read out of the installed plugin binary (not copied into this
   repository): the deviceless topology is built from it.
4. ``llvm-readobj-22`` / ``llvm-objdump-22`` (Debian's ``llvm-22``, installed with apt-get when
   run as root) to read the HSACO that XLA writes. LLVM 22, not 19: LLVM 19 cannot decode gfx950
   code (its FP8 conversions come out as ``.long`` words).

The result is ``env.json`` in that folder; ``bench.rocm.check`` reads it. A missing piece (no
gcc, no network for pip, no Python 3.12, a plugin without the expected target configs) ends the
command with one line saying what is missing (exit 2), not a traceback.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import os
import re
import shutil
import subprocess
import sys

JAX_VERSION = "0.12.0"
PACKAGES = [f"jax=={JAX_VERSION}", f"jaxlib=={JAX_VERSION}", f"jax-rocm7-pjrt=={JAX_VERSION}",
            f"jax-rocm7-plugin=={JAX_VERSION}", "numpy"]
ARCH_DEVICES = {"gfx942": "MI300X", "gfx950": "MI350X"}  # the device the plugin's config names
LLVM_PACKAGE = "llvm-22"
LLVM_TOOLS = {"readobj": "llvm-readobj-22", "objdump": "llvm-objdump-22"}
ENV_FORMAT = 2

# Stub functions that must answer sensibly for the plugin to start without a GPU.
_STUB_BODIES = {
    "hipGetDeviceCount": "int {f}(int *n) {{ if (n) *n = 0; return 100; }}",  # hipErrorNoDevice
    "hipDriverGetVersion": "int {f}(int *v) {{ if (v) *v = 70100000; return 0; }}",
    "hipRuntimeGetVersion": "int {f}(int *v) {{ if (v) *v = 70100000; return 0; }}",
    "hipGetLastError": "int {f}(void) {{ return 0; }}",
    "__hipRegisterFatBinary": "void **{f}(void *p) {{ static void *h[4]; (void)p; return h; }}",
    "__hipRegisterFunction": "void {f}(void) {{ }}",
    "__hipRegisterVar": "void {f}(void) {{ }}",
    "__hipUnregisterFatBinary": "void {f}(void) {{ }}",
    "numa_available": "int {f}(void) {{ return -1; }}",
    "numa_max_node": "int {f}(void) {{ return 0; }}",
}
_STRING_RESULT = re.compile(r"(ErrorString|ErrorName|status_string|status_to_string|code_to_string)$")


class SetupError(Exception):
    """One line saying what is missing."""


def default_dir() -> str:
    return os.environ.get("K3PALLAS_ROCM_ENV") or os.path.join(
        os.path.expanduser("~"), ".cache", "k3pallas", f"rocm-xla-{JAX_VERSION}")


def _run(cmd, what, **kw):
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    except FileNotFoundError:
        raise SetupError(f"{what}: {cmd[0]} not found") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
        raise SetupError(f"{what} failed ({' '.join(map(str, cmd[:3]))} ...): {tail[0][:300]}")
    return proc.stdout


def _find_python(explicit):
    candidates = [explicit] if explicit else [sys.executable, shutil.which("python3.12"),
                                              shutil.which("python3.13")]
    candidates += sorted(glob.glob("/root/.pyenv/versions/3.1[2-9]*/bin/python3")) if not explicit else []
    for py in filter(None, candidates):
        try:
            out = subprocess.run([py, "-c", "import sys; print(sys.version_info >= (3, 12))"],
                                 capture_output=True, text=True).stdout.strip()
        except OSError:
            continue
        if out == "True":
            return py
    raise SetupError(f"jax {JAX_VERSION} needs Python >= 3.12; none found "
                     f"({explicit or 'tried this interpreter, python3.12, python3.13'}); pass --python")


def _venv(root, python):
    venv = os.path.join(root, "venv")
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        _run([python, "-m", "venv", venv], "creating the venv")
    have = subprocess.run([py, "-c", "import jax, jax_plugins.xla_rocm7; print(jax.__version__)"],
                          capture_output=True, text=True).stdout.strip()
    if have != JAX_VERSION:
        _run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", *PACKAGES],
             f"pip install of {', '.join(PACKAGES[:4])} (network or index unreachable?)")
    site = _run([py, "-c", "import jax_plugins.xla_rocm7 as m, os; print(os.path.dirname(m.__file__))"],
                "locating the ROCm plugin").strip()
    return py, site


def _plugin_libraries(py) -> list[str]:
    out = _run([py, "-c", "import jax_plugins.xla_rocm7 as a, jax_rocm7_plugin as b, os; "
                          "print(os.path.dirname(a.__file__)); print(os.path.dirname(b.__file__))"],
               "locating the plugin libraries")
    libs = []
    for d in out.split():
        libs += sorted(glob.glob(os.path.join(d, "*.so")))
    if not any(os.path.basename(p) == "xla_rocm_plugin.so" for p in libs):
        raise SetupError("xla_rocm_plugin.so not found in the installed jax-rocm7-pjrt")
    return libs


@functools.lru_cache(maxsize=None)
def _system_libraries() -> str:
    return subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout


def _system_has(soname: str) -> bool:
    out = _system_libraries()
    return f"{soname} " in out or f"/{soname}\n" in out


def missing_symbols(libs) -> dict:
    """{soname: {version or None: {symbol, ...}}} for the libraries the plugin needs and the system
    lacks. Versioned symbols go to the library that ``.gnu.version_r`` names for their version
    index; an unversioned symbol could come from any of them, so every missing library of that
    module defines it (the first one loaded wins)."""
    wanted = collections.defaultdict(lambda: collections.defaultdict(set))
    for lib in libs:
        dyn = _run(["readelf", "-d", "-W", lib], "readelf (binutils)")
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn)
        missing = [n for n in needed if not _system_has(n)]
        if not missing:
            continue
        version_file, current = {}, None
        for line in _run(["readelf", "-V", "-W", lib], "readelf -V").splitlines():
            m = re.search(r"File: (\S+)", line)
            if m:
                current = m.group(1)
            m = re.search(r"Name: (\S+)\s+Flags: \S+\s+Version: (\d+)", line)
            if m and current:
                version_file[int(m.group(2))] = (current, m.group(1))
        for line in _run(["readelf", "--dyn-syms", "-W", lib], "readelf --dyn-syms").splitlines():
            f = line.split()
            if len(f) < 8 or f[6] != "UND" or f[4] == "WEAK":
                continue
            name, _, version = f[7].partition("@")
            if version:
                m = re.search(r"\((\d+)\)", line)
                soname, vname = version_file.get(int(m.group(1)) if m else -1, (None, None))
                if soname in missing:
                    wanted[soname][vname].add(name)
            else:
                for soname in missing:
                    wanted[soname][None].add(name)
        for soname in missing:
            wanted[soname]  # a missing library with nothing to define still gets a stub
    return wanted


def build_stubs(libs, out_dir) -> list[str]:
    if shutil.which("gcc") is None:
        raise SetupError("gcc not found: it builds the compile-only ROCm stub libraries "
                         "(apt-get install gcc)")
    os.makedirs(out_dir, exist_ok=True)
    built = []
    for soname, versions in sorted(missing_symbols(libs).items()):
        base = os.path.join(out_dir, soname.split(".so")[0])
        src = ['#include <stdio.h>',
               'static const char msg[] = "k3pallas compile-only stub: no ROCm runtime";']
        n = 0
        for version in sorted(versions, key=str):
            for sym in sorted(versions[version]):
                n += 1
                f = f"stub_{n}"
                if sym in _STUB_BODIES:
                    body = _STUB_BODIES[sym].format(f=f)
                    src += [body.split("{")[0].strip() + f' __asm__("{sym}");', body]
                elif _STRING_RESULT.search(sym):
                    src += [f'const char *{f}(void) __asm__("{sym}");',
                            f"const char *{f}(void) {{ return msg; }}"]
                else:
                    src += [f'int {f}(void) __asm__("{sym}");',
                            f"int {f}(void) {{ return 100; }}"]
        with open(base + ".c", "w") as fh:
            fh.write("\n".join(src) + "\n")
        cmd = ["gcc", "-shared", "-fPIC", "-O1", "-o", os.path.join(out_dir, soname), base + ".c",
               f"-Wl,-soname,{soname}"]
        named = sorted(v for v in versions if v)
        if named:
            with open(base + ".map", "w") as fh:
                for v in named:
                    fh.write(f"{v} {{ global: " + " ".join(f'"{s}";' for s in sorted(versions[v]))
                             + " };\n")
            cmd.append(f"-Wl,--version-script,{base}.map")
        _run(cmd, f"gcc building the stub {soname}")
        built.append(soname)
    return built


def target_config_texts(data: bytes):
    """Yields each ``GpuTargetConfigProto`` text embedded in an XLA plugin binary (XLA's device
    specs, NUL-terminated strings; ``bench.inspection.nv_xla`` reads the CUDA plugin's too)."""
    key = b"proto-message: stream_executor.GpuTargetConfigProto"
    i = 0
    while (i := data.find(key, i)) >= 0:
        start, end = data.rfind(b"\0", 0, i) + 1, data.find(b"\0", i)
        end = len(data) if end < 0 else end
        yield data[start:end].decode("utf-8", "replace")
        i = end


def extract_targets(plugin_so, out_dir) -> dict:
    """The GpuTargetConfigProto text of each arch in ``ARCH_DEVICES``, from the plugin binary."""
    with open(plugin_so, "rb") as fh:
        data = fh.read()
    found = {}
    for text in target_config_texts(data):
        m = re.search(r'gcn_arch_name:\s*"(gfx\w+)', text)
        if m and m.group(1) in ARCH_DEVICES and m.group(1) not in found:
            found[m.group(1)] = text
    missing = sorted(set(ARCH_DEVICES) - set(found))
    if missing:
        raise SetupError(f"the installed plugin carries no GpuTargetConfigProto for {missing}")
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for arch, text in found.items():
        paths[arch] = os.path.join(out_dir, f"{arch}.txtpb")
        with open(paths[arch], "w") as fh:
            fh.write(text)
    return paths


def llvm_tools(install: bool) -> dict:
    tools = {k: shutil.which(t) for k, t in LLVM_TOOLS.items()}
    if all(tools.values()):
        return tools
    if install and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", LLVM_PACKAGE], capture_output=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        tools = {k: shutil.which(t) for k, t in LLVM_TOOLS.items()}
    missing = [LLVM_TOOLS[k] for k, p in tools.items() if not p]
    if missing:
        raise SetupError(f"{', '.join(missing)} not found: install Debian's {LLVM_PACKAGE} "
                         f"(apt-get install {LLVM_PACKAGE}) to read the HSACO")
    return tools


def smoke_test(env) -> None:
    """Compile one jnp function for gfx942 through the plugin: proves the environment works."""
    code = ("import bench.rocm.xla as r; r.smoke()")
    proc = subprocess.run([env["python"], "-c", code], capture_output=True, text=True,
                          env=worker_environ(env), cwd=_repo_root())
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        raise SetupError(f"the XLA ROCm compiler did not start: {(lines or ['?'])[-1][:300]}")


def _repo_root():
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker_environ(env, extra=None) -> dict:
    """The environment of a process that compiles with XLA's ROCm backend on the CPU."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "TF_", "JAX_"))}
    e.update(JAX_PLATFORMS="cpu", PYTHONPATH=_repo_root(),
             LD_LIBRARY_PATH=os.pathsep.join(filter(None, [env["stubs"], os.environ.get("LD_LIBRARY_PATH")])),
             TF_CPP_MIN_LOG_LEVEL="2", K3PALLAS_ROCM_ENV_JSON=env["path"])
    e.update(extra or {})
    return e


def ensure(root=None, python=None, install_llvm=True, log=print) -> dict:
    """Build (or reuse) the environment; return its description (``env.json``)."""
    root = os.path.abspath(root or default_dir())
    path = os.path.join(root, "env.json")
    if os.path.exists(path):
        with open(path) as fh:
            env = json.load(fh)
        if env.get("format") == ENV_FORMAT and env.get("jax") == JAX_VERSION and all(
                os.path.exists(p) for p in [env["python"], *env["targets"].values(), *env["llvm"].values()]):
            return env
    os.makedirs(root, exist_ok=True)
    python = _find_python(python)
    log(f"rocm-xla env in {root}: venv with jax {JAX_VERSION} + ROCm plugin ...")
    py, _ = _venv(root, python)
    libs = _plugin_libraries(py)
    stubs = build_stubs(libs, os.path.join(root, "stubs"))
    log(f"  {len(stubs)} stub libraries built ({', '.join(stubs)})")
    plugin_so = next(p for p in libs if os.path.basename(p) == "xla_rocm_plugin.so")
    targets = extract_targets(plugin_so, os.path.join(root, "targets"))
    env = {"format": ENV_FORMAT, "jax": JAX_VERSION, "path": path, "python": py,
           "stubs": os.path.join(root, "stubs"), "targets": targets,
           "devices": ARCH_DEVICES, "llvm": llvm_tools(install_llvm)}
    with open(path, "w") as fh:
        json.dump(env, fh, indent=1)
    try:
        smoke_test(env)
    except SetupError:
        os.remove(path)
        raise
    log(f"  ok: {path}")
    return env


def load(path=None) -> dict:
    """The environment described by ``path`` (default: the worker's, then the default folder)."""
    path = path or os.environ.get("K3PALLAS_ROCM_ENV_JSON") or os.path.join(default_dir(), "env.json")
    if not os.path.exists(path):
        raise SetupError(f"no ROCm compile environment at {path}: run python -m bench.rocm.env")
    with open(path) as fh:
        return json.load(fh)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rocm.env", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="environment folder (default: %(default)s → "
                   "$K3PALLAS_ROCM_ENV or ~/.cache/k3pallas/rocm-xla-<jax>)")
    p.add_argument("--python", default=None, help="a Python >= 3.12 to build the venv with")
    p.add_argument("--no-apt", action="store_true", help=f"do not apt-get install {LLVM_PACKAGE}")
    args = p.parse_args(argv)
    try:
        env = ensure(args.dir, args.python, install_llvm=not args.no_apt)
    except SetupError as e:
        print(f"rocm-xla env: {e}", file=sys.stderr)
        return 2
    print(env["path"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
