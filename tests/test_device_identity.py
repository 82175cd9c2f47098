"""The device as jax reports it: platform "gpu" for NVIDIA and AMD alike, in every context a
serving stack calls the ops from (a concrete device, an abstract mesh, ``shard_map``, ``jit``
with ``NamedSharding``), and the launch invariant (threads per program <= 1024) over every op,
benchmark shape and arch.

The devices are built as jax builds them: ``AbstractDevice(kind, cores, "gpu")`` with the kinds
XLA's ROCm plugin gives its topology devices ("MI300X", "MI350X") or that hardware reports
("AMD Instinct MI300X", ...). A ``"rocm"`` platform is never reported by jax.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import k3pallas as kp
from bench import cases as k3ops
from k3pallas import platform, testing
from k3pallas.kernels import hooks, launch

S = jax.ShapeDtypeStruct
FNUZ, FN = jnp.dtype(jnp.float8_e4m3fnuz), jnp.dtype(jnp.float8_e4m3fn)

# (device kind as jax reports it, compute capability or None) -> (backend, arch, warp size)
KINDS = [
    ("MI300X", None, ("rocm", "gfx942", 64)),  # XLA's ROCm plugin, deviceless topology
    ("MI350X", None, ("rocm", "gfx950", 64)),
    ("AMD Instinct MI300X", None, ("rocm", "gfx942", 64)),  # hardware
    ("AMD Instinct MI300X VF", None, ("rocm", "gfx942", 64)),  # SR-IOV guests
    ("AMD Instinct MI300A", None, ("rocm", "gfx942", 64)),
    ("AMD Instinct MI308X", None, ("rocm", "gfx942", 64)),
    ("AMD Instinct MI325X", None, ("rocm", "gfx942", 64)),
    ("AMD Instinct MI350X", None, ("rocm", "gfx950", 64)),
    ("AMD Instinct MI355X", None, ("rocm", "gfx950", 64)),
    ("AMD Instinct MI300X", "gfx942:sramecc+:xnack-", ("rocm", "gfx942", 64)),
    ("gfx942", None, ("rocm", "gfx942", 64)),
    ("gfx950", None, ("rocm", "gfx950", 64)),
    ("AMD Radeon RX 7900 XTX", "gfx1100", ("rocm", "gfx1100", 32)),
    ("AMD Instinct MI400X", None, ("rocm", "gfx_unknown", 64)),  # a part k3pallas does not know
    ("NVIDIA H200", None, ("cuda", "sm_90", 32)),
    ("NVIDIA H200", "9.0", ("cuda", "sm_90", 32)),
    ("NVIDIA GeForce RTX 5090", "12.0", ("cuda", "sm_120", 32)),
]


def triple(t):
    return t.backend, t.arch, t.warp_size


@pytest.mark.parametrize("kind,cc,want", KINDS, ids=lambda v: str(v))
def test_gpu_is_not_cuda_by_default(kind, cc, want):
    assert triple(platform.target_for(kind, "gpu", cc)) == want


def test_a_gpu_that_names_no_vendor_is_an_error():
    with pytest.raises(ValueError, match="NVIDIA or AMD"):
        platform.target_for("Mystery Accelerator 9000", "gpu")


def test_unknown_amd_part_is_safe():
    """An AMD kind without a known arch: a wavefront-64 launch limit and no FP8 default."""
    t = platform.target_for("AMD Instinct MI400X", "gpu")
    assert t.backend == "rocm" and t.max_threads == 1024
    with pytest.raises(ValueError, match="FP8 format of AMD device"):
        kp.default_fp8_dtype(t)
    c = launch.heuristic_config("rmsnorm_gated_fp8_per_token", 1, 96 * 128, 8192, t)
    assert c.num_warps * 64 <= 1024


def _concrete(kind, cc, version):
    client = types.SimpleNamespace(platform="gpu", platform_version=version)
    return types.SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=cc,
                                 client=client, core_count=None)


def test_concrete_devices():
    """Concrete devices: the compute capability or the client's version tell the vendor."""
    mi300 = _concrete("AMD Instinct MI300X", "gfx942:sramecc+:xnack-", "rocm 7.1.0")
    assert triple(platform.target_of_device(mi300)) == ("rocm", "gfx942", 64)
    assert kp.default_fp8_dtype(mi300) == FNUZ
    odd = _concrete("Some Future Part", None, "rocm 8.0")
    assert platform.target_of_device(odd).backend == "rocm"
    h200 = _concrete("NVIDIA H200", "9.0", "cuda 13000")
    assert triple(platform.target_of_device(h200)) == ("cuda", "sm_90", 32)
    assert kp.default_fp8_dtype(h200) == FN


@pytest.mark.parametrize("kind,want", [("MI300X", ("rocm", "gfx942", 64)),
                                       ("AMD Instinct MI300X", ("rocm", "gfx942", 64)),
                                       ("MI350X", ("rocm", "gfx950", 64)),
                                       ("NVIDIA H200", ("cuda", "sm_90", 32))])
def test_same_target_in_every_context(kind, want):
    """The abstract mesh in scope, the body of shard_map, and jit with NamedSharding operands
    (no mesh in scope: the operands' type names the mesh) all give the same target."""
    mesh = testing.abstract_mesh(kind, "gpu", shape=(8,), axis_names=("x",))
    seen = {}
    with jax.sharding.use_abstract_mesh(mesh):
        seen["abstract mesh"] = platform.current_target()

    def body(x):
        seen["shard_map"] = platform.current_target(x)
        return x

    with jax.sharding.use_abstract_mesh(mesh):
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))).trace(
            S((64, 128), jnp.float32))

    def jitted(x):
        seen["jit NamedSharding"] = platform.current_target(x)
        return x

    jax.jit(jitted).trace(S((64, 128), jnp.float32, sharding=NamedSharding(mesh, P("x"))))
    assert {k: triple(t) for k, t in seen.items()} == {k: want for k in seen}, seen


# Each FP8 op as a function of [T, ...] row operands, with its Kimi-K3 shape.
_FP8 = "fp8_per_token"
_FP8_OPS = {
    "rmsnorm_gated": (
        lambda x, w, g: kp.rmsnorm_gated(x, w, g, out_format=_FP8, impl="pallas"),
        lambda t: (S((t, 96, 128), jnp.bfloat16), S((128,), jnp.float32), S((t, 96, 128), jnp.bfloat16)),
        (P("x"), P(), P("x"))),
    "sigmoid_mul": (
        lambda x, g: kp.sigmoid_mul(x, g, out_format=_FP8, impl="pallas"),
        lambda t: (S((t, 96 * 128), jnp.bfloat16), S((t, 96 * 128), jnp.bfloat16)),
        (P("x"), P("x"))),
    "quantize": (
        lambda x: kp.quantize(x, _FP8, impl="pallas"),
        lambda t: (S((t, 12 * 128), jnp.bfloat16),), (P("x"),)),
    "mla_q_kv_norm": (
        lambda a, wq, wkv: kp.mla_q_kv_norm(a, wq, wkv, out_format=_FP8, impl="pallas")[0],
        lambda t: (S((t, 2112), jnp.bfloat16), S((1536,), jnp.bfloat16), S((512,), jnp.bfloat16)),
        (P("x"), P(), P())),
}


@pytest.mark.parametrize("op", list(_FP8_OPS))
@pytest.mark.parametrize("kind,fp8,warp", [("MI300X", FNUZ, 64), ("AMD Instinct MI300X", FNUZ, 64),
                                           ("MI350X", FN, 64), ("NVIDIA H200", FN, 32)])
def test_shard_map_and_named_sharding_on_an_8_gpu_mesh(op, kind, fp8, warp):
    """TP8-style calls: shard_map over 8 devices of ``kind`` (tokens sharded), and jit with
    NamedSharding operands: the arch's FP8 format, and every launch within 1024 threads (at
    64 tokens per device, where 96 heads took 32 warps = 2048 AMD threads when "gpu" meant
    CUDA)."""
    fn, structs, specs = _FP8_OPS[op]
    mesh = testing.abstract_mesh(kind, "gpu", shape=(8,), axis_names=("x",))
    plat = testing.lowering_platform(kind)
    args = structs(8 * 64)

    def body(*a):
        return fn(*a)

    sm = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("x"))
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(sm).trace(*args).lower(lowering_platforms=(plat,))
    out = jax.tree_util.tree_leaves(lowered.out_info)
    assert out[0].dtype == fp8, (kind, out[0].dtype)
    launches = testing.triton_launches(lowered.as_text())
    assert launches and all(c["num_warps"] * warp <= 1024 for c in launches), launches

    # jit with NamedSharding operands, no mesh in scope. Traced only: custom_partitioning needs
    # devices to lower (the ROCm gate compiles this on XLA's deviceless ROCm topology).
    sharded = [S(a.shape, a.dtype, sharding=NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    with hooks.recording() as log:
        out = jax.tree_util.tree_leaves(jax.jit(fn).eval_shape(*sharded))
    assert out[0].dtype == fp8
    assert log and all(r.config.num_warps * warp <= 1024 for r in log), log


def test_fp8_format_from_the_operands_mesh_without_a_mesh_in_scope():
    """jit with NamedSharding operands and no mesh in scope: the format still follows the mesh's
    devices (traced only: jax's own Pallas lowering needs the device in scope to lower)."""
    for kind, want in (("MI300X", FNUZ), ("MI350X", FN)):
        mesh = testing.abstract_mesh(kind, "gpu", shape=(8,), axis_names=("x",))
        x = S((64, 1536), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
        out = jax.jit(lambda a: kp.quantize(a, _FP8, impl="reference")).eval_shape(x)
        assert out.data.dtype == want
        w = S((1536, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
        codes, _ = jax.jit(lambda a: kp.quantize_weight(a, _FP8)).eval_shape(w)
        assert codes.dtype == want


# ------------------------------------------------------------------------------------------------
# The launch invariant
# ------------------------------------------------------------------------------------------------


# Decode and prefill; every benchmark token count in the slow tier (the ROCm gate compiles every
# one for gfx942 / gfx950).
SAMPLED_TOKENS = (1, 65536)


def _fits(arch, tokens):
    """Every case of bench.cases at every benchmark shape and each of ``tokens``, traced for
    ``arch``: each launch's threads per program (num_warps x warp size) within the limit."""
    kind, plat = testing.KNOWN_TARGETS[arch]
    target = platform.target_for(kind, plat)
    n, cases = 0, 0
    with jax.sharding.use_abstract_mesh(testing.abstract_mesh(kind, plat)):
        for name, op, cfg, t in ((name, op, cfg, t) for name, op in k3ops.OPS.items()
                                 for cfg in op.configs for t in tokens):
            cases += 1
            structs, options = op.example(t, jnp.dtype(jnp.bfloat16), **op.sizes[cfg])
            with hooks.recording() as log:
                jax.jit(lambda *a, _op=op, _o=options: _op.fn(*a, impl="pallas", **_o)).trace(*structs)
            assert log, (name, cfg, t)
            for rec in log:
                threads = rec.config.num_warps * target.warp_size
                assert threads <= 1024, (arch, name, cfg, t, rec)
            n += len(log)
    assert cases >= len(tokens) * len(k3ops.OPS) and n >= cases


# gfx950 in the slow tier (the fast one: the H200 and gfx942, 7-9 s each; CI's gate compiles
# every gfx950 launch config).
@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a == "gfx950" else a
                                  for a in testing.KNOWN_TARGETS])
def test_every_launch_fits_the_target(arch):
    _fits(arch, SAMPLED_TOKENS)


# The H200 only: the ROCm gate compiles (and checks the threads of) every kernel for gfx942 and
# gfx950 at one token count per launch config (``--sample``: every config of these counts).
@pytest.mark.slow
def test_every_launch_fits_the_h200_at_every_token_count():
    _fits("h200", k3ops.DEFAULT_TOKENS)


@pytest.mark.parametrize("arch", ["gfx942", "h200"])
def test_forced_and_tuned_configs_over_the_limit_are_refused(arch, monkeypatch):
    target = platform.target_for(*testing.KNOWN_TARGETS[arch])
    over = launch.LaunchConfig(1, 2048 // target.warp_size)
    with hooks.forced(over), pytest.raises(ValueError, match="forced launch config .* threads"):
        launch.launch_config("rmsnorm", 4, 2048, target=target)
    monkeypatch.setattr(launch, "tuned_table", lambda: {target.arch: {"rmsnorm": [[64, 2048, 1, over.num_warps, 1]]}})
    with pytest.raises(ValueError, match="tuned launch config .* threads"):
        launch.launch_config("rmsnorm", 4, 2048, target=target)
    ok = launch.LaunchConfig(1, 1024 // target.warp_size)
    with hooks.forced(ok):
        assert launch.launch_config("rmsnorm", 4, 2048, target=target) == ok
