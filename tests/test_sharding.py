"""Multi-device: runs tests/multidevice/sharded_ops.py on 8 virtual CPU devices in a subprocess
(the device count must be set before jax is imported, so not in this process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("partitioner", ["shardy", "gspmd"])
def test_sharded_ops_on_8_virtual_devices(partitioner):
    """Under Shardy (jax's default) and under GSPMD (``jax_use_shardy_partitioner=False``)."""
    env = dict(os.environ)
    env["JAX_USE_SHARDY_PARTITIONER"] = "true" if partitioner == "shardy" else "false"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.path.join(ROOT, "tests"),
                                                    env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         os.path.join(ROOT, "tests", "multidevice", "sharded_ops.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.split("\n")[-2]
