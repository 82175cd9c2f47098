"""Multi-device: runs tests/multidevice/sharded_ops.py on 8 virtual CPU devices in a subprocess
(the device count must be set before jax is imported, so not in this process)."""

from __future__ import annotations

import os
import subprocess
import sys
from xml.etree import ElementTree

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.parametrize("partitioner", ["shardy", "gspmd"])
def test_sharded_ops_on_8_virtual_devices(partitioner, tmp_path):
    """Under Shardy (jax's default) and under GSPMD (``jax_use_shardy_partitioner=False``)."""
    env = dict(os.environ)
    env["JAX_USE_SHARDY_PARTITIONER"] = "true" if partitioner == "shardy" else "false"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.path.join(ROOT, "tests"),
                                                    env.get("PYTHONPATH")) if p)
    report = tmp_path / "report.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         f"--junitxml={report}", os.path.join(ROOT, "tests", "multidevice", "sharded_ops.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    suite = ElementTree.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["tests"] >= 20 and counts["failures"] == counts["errors"] == 0, counts
    assert counts["skipped"] == 0, counts  # every multi-device test ran on the 8 devices
