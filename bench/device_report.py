"""``python -m bench.device_report``: a GPU owner's one command, AMD or NVIDIA.

Run it in a clone of the repository on the GPU machine. It

1. installs the package with the extra of the machine's vendor (``.[rocm,test]`` or
   ``.[cuda,test]``; ``--install none`` keeps what is installed, ``auto`` installs only when jax
   sees no GPU);
2. records what the machine reports: the GPUs as jax sees them (kind, platform, compute
   capability, the client's platform version) and as k3pallas identifies them (backend, arch,
   default FP8 format), the driver and ROCm / CUDA versions from ``rocm-smi`` / ``amd-smi`` /
   ``nvidia-smi`` and ``/opt/rocm/.info/version`` where they exist, jax and its plugins;
3. runs the FP8 self-check for each FP8 format on the device (``kp.fp8_cast_decisions()``);
4. runs the GPU tests (``pytest -m gpu``) and the headline benchmark (``python -m bench
   --quick``, or ``--bench full``);
5. packs everything into one archive, ``k3pallas-device-report-<host>-<time>.tar.gz``, to send
   back.

Each step has a time limit; a step that runs over is ended by process group id (only the
processes this command started), and the archive says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as host_platform
import shutil
import signal
import subprocess
import sys
import tarfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, log_path, timeout, env=None) -> dict:
    """Run ``cmd`` in a process group of its own, output to ``log_path``; on timeout end that
    group (by its id) and nothing else."""
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                rc = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
            timed_out = True
    return {"cmd": " ".join(cmd), "rc": rc, "timed_out": timed_out,
            "seconds": round(time.time() - t0, 1), "log": os.path.basename(log_path)}


def _output(cmd, timeout=20) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"failed: {e}"
    return (proc.stdout + proc.stderr).strip()


def vendor() -> str:
    """"rocm", "cuda" or "none", from what the machine has (before jax is installed)."""
    if os.path.exists("/dev/kfd") or shutil.which("rocm-smi") or shutil.which("amd-smi"):
        return "rocm"
    if shutil.which("nvidia-smi") or os.path.exists("/dev/nvidiactl"):
        return "cuda"
    return "none"


def machine_tools() -> dict:
    """What the vendor tools and files say (None where a tool or file is absent)."""
    out = {"host": host_platform.node(), "os": host_platform.platform(), "python": sys.version.split()[0]}
    out["nvidia-smi"] = _output(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                 "--format=csv"])
    out["rocm-smi"] = _output(["rocm-smi", "--showproductname", "--showdriverversion"])
    out["amd-smi"] = _output(["amd-smi", "version"])
    for name, path in (("rocm_version", "/opt/rocm/.info/version"),
                       ("amdgpu_driver", "/sys/module/amdgpu/version")):
        try:
            with open(path) as f:
                out[name] = f.read().strip()
        except OSError:
            out[name] = None
    out["pip"] = _output([sys.executable, "-m", "pip", "list", "--format=freeze"], timeout=60)
    if out["pip"]:
        out["pip"] = [ln for ln in out["pip"].splitlines()
                      if ln.lower().startswith(("jax", "k3pallas", "triton", "numpy", "ml-dtypes"))]
    return out


def jax_view(out_dir) -> dict:
    """The devices as jax reports them and as k3pallas identifies them; the FP8 self-check for
    each format on the first device (in this process: jax imported only here)."""
    import jax
    import jax.numpy as jnp

    import k3pallas as kp
    from k3pallas import platform
    from k3pallas.kernels import fp8_cast

    devices = []
    for d in jax.devices():
        client = getattr(d, "client", None)
        entry = {"id": d.id, "platform": d.platform, "device_kind": d.device_kind,
                 "compute_capability": str(getattr(d, "compute_capability", None)),
                 "client_platform_version": str(getattr(client, "platform_version", None))}
        try:
            t = platform.target_of_device(d)
            entry.update(backend=t.backend, arch=t.arch, warp_size=t.warp_size, cores=t.num_cores)
            entry["default_fp8"] = jnp.dtype(kp.default_fp8_dtype(d)).name
        except ValueError as e:
            entry["identify_error"] = str(e)
        devices.append(entry)
    view = {"jax": jax.__version__, "backend": jax.default_backend(), "devices": devices,
            "self_check": []}
    if jax.default_backend() == "cpu":
        view["self_check"].append("no GPU: nothing to check")
        return view
    target = platform.current_target()
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"):
        try:
            d = fp8_cast.decide(name, "auto", target=target)
            view["self_check"].append({"format": name, "native": d.native, "reason": d.reason,
                                       "mismatches": [list(m) for m in d.mismatches[:20]]})
        except Exception as e:  # noqa: BLE001 - recorded, the report goes on
            view["self_check"].append({"format": name, "error": f"{type(e).__name__}: {e}"})
    return view


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.device_report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--install", choices=("auto", "rocm", "cuda", "none"), default="auto")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "out", "device_report"))
    p.add_argument("--bench", choices=("quick", "full", "none"), default="quick")
    p.add_argument("--tests-timeout", type=int, default=900)
    p.add_argument("--bench-timeout", type=int, default=900)
    p.add_argument("--no-tests", action="store_true")
    p.add_argument("--jax-view", action="store_true", help=argparse.SUPPRESS)  # the child step
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.jax_view:
        with open(os.path.join(args.out, "jax_view.json"), "w") as f:
            json.dump(jax_view(args.out), f, indent=1)
        return 0

    steps = {}
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "vendor": vendor(), "steps": steps}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    extra = args.install if args.install in ("rocm", "cuda") else None
    if args.install == "auto":
        probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                               capture_output=True, text=True)
        if probe.returncode != 0 or probe.stdout.strip() == "cpu":
            extra = report["vendor"] if report["vendor"] != "none" else None
    if extra:
        steps["install"] = run([sys.executable, "-m", "pip", "install", "-e", f".[{extra},test]"],
                               os.path.join(args.out, "install.log"), 1800, env)
    report["machine"] = machine_tools()
    steps["identify_and_self_check"] = run(
        [sys.executable, "-m", "bench.device_report", "--jax-view", "--out", args.out],
        os.path.join(args.out, "jax_view.log"), 300, env)
    if not args.no_tests:
        steps["gpu_tests"] = run([sys.executable, "-m", "pytest", "-m", "gpu", "tests", "-q",
                                  "-rfEs", "-p", "no:cacheprovider"],
                                 os.path.join(args.out, "gpu_tests.log"), args.tests_timeout, env)
    if args.bench != "none":
        steps["bench"] = run([sys.executable, "-m", "bench", "--out", os.path.join(args.out, "bench")]
                             + (["--quick"] if args.bench == "quick" else []),
                             os.path.join(args.out, "bench.log"), args.bench_timeout, env)
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    archive = os.path.join(os.path.dirname(os.path.abspath(args.out)),
                           f"k3pallas-device-report-{host_platform.node()}-{time.strftime('%Y%m%d-%H%M%S')}.tar.gz")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(args.out, arcname=os.path.basename(os.path.abspath(args.out)))
    failed = [k for k, s in steps.items() if s["rc"] != 0]
    for k, s in steps.items():
        print(f"{k}: rc {s['rc']}{' (timed out)' if s['timed_out'] else ''}, {s['seconds']} s, log {s['log']}")
    print(f"archive: {archive}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
