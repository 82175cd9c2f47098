"""Targets, launch configs and tiling helpers: pure functions, testable without a GPU."""

from __future__ import annotations

import pytest

from k3pallas import platform
from k3pallas.kernels import common
from k3pallas.kernels.launch import LaunchConfig
from k3pallas.kernels import launch
from k3pallas import testing


def test_targets():
    t = platform.target_for("NVIDIA H200", "cuda", "9.0")
    assert (t.backend, t.arch, t.warp_size, t.num_cores) == ("cuda", "sm_90", 32, 132)
    assert platform.target_for("NVIDIA H200", "cuda").arch == "sm_90"  # deviceless: by name
    t = platform.target_for("AMD Instinct MI300X", "rocm", "gfx942:sramecc+:xnack-")
    assert (t.backend, t.arch, t.warp_size, t.num_cores) == ("rocm", "gfx942", 64, 304)
    assert platform.target_for("gfx950", "rocm").warp_size == 64
    assert platform.target_for("AMD Instinct MI355X", "rocm").arch == "gfx950"
    assert platform.target_for("AMD Radeon RX 7900 XTX", "rocm", "gfx1100").warp_size == 32
    assert platform.target_for("cpu", "cpu").is_gpu is False
    assert platform.target_for("NVIDIA H100", "gpu").backend == "cuda"


def test_current_target_in_abstract_mesh():
    import jax

    with jax.sharding.use_abstract_mesh(testing.abstract_mesh(*testing.KNOWN_TARGETS["gfx950"])):
        t = platform.current_target()
    assert (t.backend, t.arch, t.warp_size) == ("rocm", "gfx950", 64)


@pytest.mark.parametrize("name", list(testing.KNOWN_TARGETS))
@pytest.mark.parametrize("op,row_elems,tile", [("fused_q_kv_rmsnorm", 2560, 2048),
                                               ("rmsnorm_gated_fp8_per_token", 8192, 4096),
                                               ("rmsnorm_gated_fp8_per_token", 3072, 1024),
                                               ("quantize_fp8_per_token", 4096, 4096)])
def test_heuristic_is_valid_everywhere(name, op, row_elems, tile):
    target = platform.target_for(*testing.KNOWN_TARGETS[name])
    for t in (1, 2, 7, 64, 512, 4096, 65536, 2**21):
        c = launch.heuristic_config(op, t, row_elems, tile, target)
        assert c.rows_per_program <= max(1, 2 ** (t - 1).bit_length())
        assert c.num_warps * target.warp_size <= 1024
        # A thread holds between 1 and 128 elements of its largest tile.
        per_thread = c.rows_per_program * tile / (c.num_warps * target.warp_size)
        assert 1 <= per_thread <= 128, (t, c)
        # Enough programs to cover every core twice when there are rows enough.
        if t >= 2 * target.num_cores * c.rows_per_program:
            assert -(-t // c.rows_per_program) >= 2 * target.num_cores


def test_heuristic_regimes():
    h200 = platform.target_for("NVIDIA H200", "cuda")
    small = launch.heuristic_config("rmsnorm_gated_fp8_per_token", 1, 8192, 4096, h200)
    large = launch.heuristic_config("rmsnorm_gated_fp8_per_token", 65536, 8192, 4096, h200)
    assert small.num_warps > large.num_warps  # latency: spread a row; throughput: fewer warps
    gfx = platform.target_for("gfx942", "rocm")
    assert launch.heuristic_config("fused_q_kv_rmsnorm", 1, 2560, 2048, gfx).num_warps * 64 <= 1024


def test_tuned_table_lookup(monkeypatch):
    table = {"sm_90": {"fused_q_kv_rmsnorm": [[22, 2560, 1, 4, 1], [2**31, 2560, 2, 1, 1],
                                              [1448, 9999, 4, 8, 1]]}}
    monkeypatch.setattr(launch, "tuned_table", lambda: table)
    h200 = platform.target_for("NVIDIA H200", "cuda")
    cfg = lambda t, elems=2560, tile=2048, target=h200: launch.launch_config(  # noqa: E731
        "fused_q_kv_rmsnorm", t, elems, tile, target=target)
    assert cfg(7) == LaunchConfig(1, 4, 1)
    assert cfg(65536) == LaunchConfig(2, 1, 1)
    # Rows per program never exceed the padded row count.
    assert cfg(23).rows_per_program == 2
    # Another row size, or another arch: the heuristic.
    assert cfg(65536, 1024, 1024) == launch.heuristic_config("fused_q_kv_rmsnorm", 65536, 1024, 1024, h200)
    gfx = platform.target_for("gfx942", "rocm")
    assert cfg(7, target=gfx) == launch.heuristic_config("fused_q_kv_rmsnorm", 7, 2560, 2048, gfx)


def test_shipped_tuned_table_is_well_formed():
    for arch, ops in launch.tuned_table().items():
        for op, entries in ops.items():
            for max_tokens, row_elems, rows, warps, stages, *split in entries:
                LaunchConfig(rows, warps, stages, *split)  # validates powers of two
                assert max_tokens >= 1 and row_elems >= 1 and len(split) <= 1


def test_launch_config_validation():
    with pytest.raises(ValueError, match="power of two"):
        LaunchConfig(3, 4)
    with pytest.raises(ValueError, match="power of two"):
        LaunchConfig(1, 0)
    with pytest.raises(ValueError, match="num_stages"):
        LaunchConfig(1, 1, 0)


@pytest.mark.parametrize("n,parts", [(1, [(0, 1)]), (12, [(0, 8), (8, 4)]), (96, [(0, 64), (64, 32)]),
                                     (5, [(0, 4), (4, 1)]), (32, [(0, 32)]), (7, [(0, 4), (4, 2), (6, 1)]),
                                     (15, [(0, 8), (8, 4), (12, 4)]), (1536, [(0, 1024), (1024, 512)])])
def test_pow2_parts(n, parts):
    assert common.pow2_parts(n) == parts
    covered = sorted(i for s, size in parts for i in range(s, min(s + size, n)))
    assert covered == list(range(n))
    assert all(size & (size - 1) == 0 for _, size in parts)


def test_device_platform_tells_cuda_from_rocm():
    """jax reports both GPU kinds as platform "gpu"; the arch string or the client tells them apart."""
    import types

    import jax.numpy as jnp

    import k3pallas as kp

    client = lambda p, v: types.SimpleNamespace(platform=p, platform_version=v)  # noqa: E731
    mi300 = types.SimpleNamespace(platform="gpu", device_kind="AMD Instinct MI300X",
                                  compute_capability="gfx942:sramecc+:xnack-",
                                  client=client("rocm", "rocm 7.0"))
    mi355 = types.SimpleNamespace(platform="gpu", device_kind="AMD Instinct MI355X",
                                  compute_capability=None, client=client("gpu", "rocm 7.1"))
    h200 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0",
                                 client=client("cuda", "cuda 13000"))
    assert [platform.device_platform(d) for d in (mi300, mi355, h200)] == ["rocm", "rocm", "cuda"]
    assert kp.default_fp8_dtype(mi300) == jnp.dtype(jnp.float8_e4m3fnuz)
    assert kp.default_fp8_dtype(mi355) == jnp.dtype(jnp.float8_e4m3fn)
    assert kp.default_fp8_dtype(h200) == jnp.dtype(jnp.float8_e4m3fn)


def test_compiling_for_overrides_the_target():
    """Ahead-of-time compilation for a device that is not attached (the XLA-ROCm gate)."""
    import jax.numpy as jnp

    import k3pallas as kp

    here = platform.current_target()
    gfx942 = platform.target_for("gfx942", "rocm")
    with platform.compiling_for(gfx942):
        assert platform.current_target() == gfx942
        assert kp.default_fp8_dtype() == jnp.dtype(jnp.float8_e4m3fnuz)
        with platform.compiling_for(platform.target_for("gfx950", "rocm")):
            assert platform.current_target().arch == "gfx950"
        assert platform.current_target() == gfx942
    assert platform.current_target() == here
