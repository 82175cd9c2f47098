"""Shared test setup: fresh random data per run (seed printed), GPU-marker handling."""

from __future__ import annotations

import os
import random

import jax
import numpy as np
import pytest

# Fresh data every run; K3PALLAS_TEST_SEED=<n> replays a run.
SEED = int(os.environ.get("K3PALLAS_TEST_SEED", random.SystemRandom().randrange(2**31)))


def pytest_report_header(config):
    return (f"k3pallas: K3PALLAS_TEST_SEED={SEED}, jax {jax.__version__}, "
            f"backend {jax.default_backend()}")


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
    return np.random.default_rng([SEED, abs(hash(request.node.nodeid)) % (2**31)])


@pytest.fixture
def cpu_impl():
    """The implementation CPU tests run the kernels with (the GPU tests use "pallas")."""
    return "interpret"
