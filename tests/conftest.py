"""Shared test setup: fresh random data per run (seed printed), GPU-marker handling."""

from __future__ import annotations

import os
import random
import zlib

import jax
import numpy as np
import pytest

# No GPU here (no device node): XLA's CPU backend compiles without LLVM's optimizations. The fast
# tier is mostly interpret-mode kernels, each compiled once and run on a few rows, so compiling is
# its time: 1.5x less at -O0. Results may differ in the last bit where -O2 fuses a multiply and an
# add (an FMA; some float32 scales moved 1-2 ulp); every oracle's tolerance holds either way, and
# CI runs one Python's fast tier with XLA's defaults (K3PALLAS_TEST_XLA_DEFAULTS=1). Set before jax
# creates a backend. A GPU machine keeps XLA's defaults.
_O0 = "--xla_backend_optimization_level=0"
if not (os.environ.get("K3PALLAS_TEST_XLA_DEFAULTS") or _O0 in os.environ.get("XLA_FLAGS", "")
        or any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd"))):
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), _O0]).strip()

# Fresh data every run; K3PALLAS_TEST_SEED=<n> replays a run.
SEED = int(os.environ.get("K3PALLAS_TEST_SEED", random.SystemRandom().randrange(2**31)))
# pytest-xdist's workers start from this process's environment: one seed for the whole run.
os.environ["K3PALLAS_TEST_SEED"] = str(SEED)


def pytest_report_header(config):
    return (f"k3pallas: K3PALLAS_TEST_SEED={SEED}, jax {jax.__version__}, "
            f"backend {jax.default_backend()}")


def pytest_terminal_summary(terminalreporter):
    """The seed again at the end of every run: ``-q`` (the README's command) hides the header."""
    terminalreporter.write_line(f"k3pallas: K3PALLAS_TEST_SEED={SEED} replays this run's data")


def has_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU (cuda or rocm backend)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A generator seeded from the run's seed and the test's id: fresh per run, replayable."""
    # crc32, not hash(): str hashes change from process to process (PYTHONHASHSEED).
    return np.random.default_rng([SEED, zlib.crc32(request.node.nodeid.encode())])


@pytest.fixture
def cpu_impl():
    """The implementation CPU tests run the kernels with (the GPU tests use "pallas")."""
    return "interpret"
