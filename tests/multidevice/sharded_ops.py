"""Every op under ``jax.jit`` with sharded operands and inside ``shard_map``, on 8 virtual CPU
devices. Run by ``tests/test_sharding.py`` in a subprocess that sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before jax is imported (this file's name
keeps the main test run from collecting it).

Each sharded result must equal the unsharded op's (same implementation, same data), and the
compiled module must hold no all-gather: no device receives another's activations.
"""

from __future__ import annotations

import functools

import jax
from jax import config
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import k3pallas as kp
from k3pallas.models import kimi_k3

from bench.inspection.hlo import compiled_text
from support import same_but_ulps

IMPLS = ["interpret", "reference"]
TP = 4


@pytest.fixture(scope="module")
def mesh():
    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    return Mesh(np.array(jax.devices()).reshape(8 // TP, TP), ("dp", "tp"))


def put(mesh, a, *spec):
    return jax.device_put(a, NamedSharding(mesh, P(*spec)))


def rand(key, shape, dtype=jnp.bfloat16, scale=1.0):
    return (jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32) * scale).astype(dtype)


def same(a, b, what="", exact=True):
    """Equal leaves. ``exact``: ``support.same_but_ulps`` (bit for bit but float32 rounding: jax
    0.12.1's XLA CPU backend compiles the interpret-mode kernels' float32 arithmetic differently
    for the sharded shapes). ``exact=False`` (the jnp reference, which XLA compiles differently for
    the sharded shapes): floats within 2e-6 relative, fp8 codes equal but for one step on < 0.1 %."""
    if exact:
        same_but_ulps(a, b, what)
        return
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape, (what, x.shape, y.shape)
        if x.dtype.itemsize == 1:  # fp8: compare the codes
            diff = x.view(np.uint8) != y.view(np.uint8)
            if not diff.any():
                continue
            xf, yf = x.astype(np.float64)[diff], y.astype(np.float64)[diff]
            assert diff.mean() < 1e-3 and np.all(np.abs(xf - yf) <= 0.125 * np.abs(yf)), what
        else:
            np.testing.assert_allclose(x, y, rtol=2e-6, err_msg=what)


def check(mesh, fn, args, specs, *, expect_all_reduce=None, what="", exact=True):
    """fn on sharded args == fn on the whole args; no all-gather in the compiled module."""
    sharded = [put(mesh, a, *s) for a, s in zip(args, specs)]
    out = jax.jit(fn)(*sharded)
    same(out, jax.jit(fn)(*args), what, exact)
    text = compiled_text(fn, *sharded)
    assert "all-gather" not in text, f"{what}: the compiled module gathers"
    if expect_all_reduce is not None:
        assert ("all-reduce" in text) == expect_all_reduce, f"{what}: all-reduce {not expect_all_reduce}"
    return out


TOKENS = (("dp", "tp"),)  # the token axis over all 8 devices


@pytest.mark.parametrize("impl", IMPLS)
def test_norms_token_sharded(mesh, impl):
    q, kv = rand(0, (64, 96), scale=3), rand(1, (64, 32))
    wq, wkv = rand(2, (96,), jnp.float32), rand(3, (32,))
    check(mesh, lambda a, w: kp.rmsnorm(a, w, impl=impl), (q, wq), [TOKENS, ()],
          expect_all_reduce=False, what="rmsnorm")
    out = check(mesh, lambda *a: kp.fused_q_kv_rmsnorm(*a, impl=impl), (q, kv, wq, wkv),
                [TOKENS, TOKENS, (), ()], expect_all_reduce=False, what="fused_q_kv_rmsnorm")
    assert out[0].sharding.spec[0] == ("dp", "tp")
    # leading dims [B, S]: batch over dp, sequence over tp
    q3 = q.reshape(8, 8, 96)
    check(mesh, lambda a, w: kp.rmsnorm(a, w, impl=impl), (q3, wq), [("dp", "tp"), ()],
          expect_all_reduce=False, what="rmsnorm [B, S, D]")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", [None, "fp8_per_token", "mxfp4"])
def test_add_rmsnorm_token_sharded(mesh, impl, fmt):
    """The residual add + norm over tokens (the new residual sharded like the residual, nothing
    gathered; equal to the unsharded op, inside shard_map too); the hidden axis may not be
    sharded (a clear error, eagerly and under jit)."""
    x, r, w = rand(70, (128, 256), scale=2), rand(71, (128, 256)), rand(72, (256,))
    fn = lambda x, r, w: kp.add_rmsnorm(x, r, w, out_format=fmt, impl=impl)  # noqa: E731
    out = check(mesh, fn, (x, r, w), [TOKENS, TOKENS, ()], expect_all_reduce=False,
                what=f"add_rmsnorm {fmt}", exact=impl != "reference")
    assert out[1].sharding.spec[0] == ("dp", "tp")
    if impl == "reference":  # the norms' kernels in interpret mode inside shard_map: jax (0.12)
        # refuses their masked loads ("gather requires varying manual axes to match"), rmsnorm's
        # as well; compiled, the ROCm gate runs every op in shard_map (docs/sharding.md)
        smap = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(TOKENS[0]), P(TOKENS[0]), P()),
                                     out_specs=P(TOKENS[0])))
        same(smap(x, r, w), fn(x, r, w), f"add_rmsnorm {fmt} in shard_map", exact=False)
    xs, rs = put(mesh, x, None, ("dp", "tp")), put(mesh, r, None, ("dp", "tp"))
    with pytest.raises(ValueError, match="normalized"):
        fn(xs, rs, w)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rope", [7, 0])
def test_mla_token_sharded(mesh, impl, rope):
    a = rand(4, (64, 96 + 32 + rope), scale=2)
    wq, wkv = rand(5, (96,)), rand(6, (32,))
    fn = lambda a, wq, wkv: kp.mla_q_kv_norm(a, wq, wkv, q_size=96, kv_size=32, impl=impl)  # noqa: E731
    check(mesh, fn, (a, wq, wkv), [TOKENS, (), ()], expect_all_reduce=False, what="mla_q_kv_norm")


@pytest.mark.parametrize("impl", IMPLS)
def test_gated_token_and_head_sharded(mesh, impl):
    x, g, w = rand(7, (32, 8, 32), scale=2), rand(8, (32, 8, 32)), rand(9, (32,), jnp.float32)
    fn = lambda x, w, g: kp.rmsnorm_gated(x, w, g, impl=impl)  # noqa: E731
    check(mesh, fn, (x, w, g), [TOKENS, (), TOKENS], expect_all_reduce=False, what="tokens")
    out = check(mesh, fn, (x, w, g), [("dp", "tp"), (), ("dp", "tp")], expect_all_reduce=False,
                what="heads over tp")
    assert out.sharding.spec[:2] == ("dp", "tp")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("groups", [1, TP, 2 * TP])
def test_gated_fp8_head_sharded(mesh, impl, groups):
    """Heads over tp. scale_groups a multiple of tp: every scale is local (no communication);
    scale_groups=1: one scale per token over all heads, through an all-reduce max (kernel
    path; the reference's own reduction is XLA's). Equal to the unsharded op either way."""
    x, g, w = rand(10, (32, 16, 32), scale=2), rand(11, (32, 16, 32)), rand(12, (32,), jnp.float32)
    x = x.at[3, 5, 7].set(jnp.nan)  # a NaN token: its scale must be NaN on every device
    fn = lambda x, w, g: kp.rmsnorm_gated_fp8_per_token(x, w, g, scale_groups=groups, impl=impl)  # noqa: E731
    kernel = impl != "reference"
    # One scale over sharded heads (groups == 1) comes from a scale-only launch, whose float32
    # arithmetic XLA compiles differently from the one-launch kernel: a few ulp apart (2 here,
    # up to 4 on the H200), so a code may move one step at a tie. Otherwise bit for bit.
    qa = check(mesh, fn, (x, w, g), [("dp", "tp"), (), ("dp", "tp")],
               expect_all_reduce=(groups == 1) if kernel else None,
               what=f"fp8, {groups} scale groups", exact=kernel and groups != 1)
    assert qa.scale.shape == (32, groups)
    nan_group = 5 // (16 // groups)
    scale = np.asarray(qa.scale)
    assert np.isnan(scale[3, nan_group]) and np.isnan(scale).sum() == 1
    check(mesh, fn, (x, w, g), [TOKENS, (), TOKENS], expect_all_reduce=False, what="fp8, tokens",
          exact=kernel)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("groups", [1, TP])
def test_per_token_fp8_sharded(mesh, impl, groups):
    x = rand(13, (32, 256), scale=3)
    fn = lambda x: kp.per_token_fp8_quant(x, scale_groups=groups, impl=impl)  # noqa: E731
    exact = impl != "reference"
    check(mesh, fn, (x,), [TOKENS], expect_all_reduce=False, what="tokens", exact=exact)
    check(mesh, fn, (x,), [("dp", "tp")], expect_all_reduce=(groups == 1) if exact else None,
          what="columns over tp", exact=exact)


NORMALIZED = {
    "rmsnorm": (lambda a, w, impl: kp.rmsnorm(a, w, impl=impl), "normalized"),
    "fused": (lambda a, w, impl: kp.fused_q_kv_rmsnorm(a, a, w, w, impl=impl), "last axis of q_c"),
    "mla": (lambda a, w, impl: kp.mla_q_kv_norm(a, w[:32], w[:16], q_size=32, kv_size=16, impl=impl),
            "packed"),
    "gated": (lambda a, w, impl: kp.rmsnorm_gated(a, w, a, impl=impl), "head dim"),
    "gated_fp8": (lambda a, w, impl: kp.rmsnorm_gated_fp8_per_token(a, w, a, impl=impl), "head dim"),
}
# At call time only (concrete arrays): x replicated, only the gate sharded; the error names the gate.
NORMALIZED_AT_CALL = {**NORMALIZED, "gated_fp8_gate": (
    lambda a, w, impl: kp.rmsnorm_gated_fp8_per_token(
        jax.device_put(a, NamedSharding(a.sharding.mesh, P("dp"))), w, a, impl=impl),
    r"head dim \(last axis\) of gate")}


@pytest.mark.parametrize("impl", IMPLS + ["auto"])
@pytest.mark.parametrize("case", list(NORMALIZED_AT_CALL))
def test_sharded_normalized_axis_is_refused_at_call_time(mesh, case, impl):
    """Where the sharding is known when the op is called (a sharded jax.Array, outside jit):
    ValueError, for every implementation."""
    x, w = rand(14, (16, 8, 64)), rand(15, (64,))
    fn, match = NORMALIZED_AT_CALL[case]
    with pytest.raises(ValueError, match=match + ".*sharded over mesh axes 'tp'"):
        fn(put(mesh, x, "dp", None, "tp"), w, impl)


@pytest.mark.parametrize("case", list(NORMALIZED))
def test_sharded_normalized_axis_under_jit(mesh, case):
    """Under jax.jit with Auto axes the sharding is known only when XLA partitions the program:
    the kernel paths fail to compile with jax's runtime error carrying the same ValueError text;
    the jnp reference runs (XLA adds the communication) and equals the unsharded op."""
    x, w = rand(14, (16, 8, 64)), rand(15, (64,))
    fn, match = NORMALIZED[case]
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"ValueError: .*{match}.*cannot be split"):
        jax.jit(functools.partial(fn, impl="interpret"))(put(mesh, x, "dp", None, "tp"), w)
    ref = functools.partial(fn, impl="reference")
    same(jax.jit(ref)(put(mesh, x, "dp", None, "tp"), w), jax.jit(ref)(x, w), case, exact=False)


@pytest.mark.parametrize("impl", IMPLS)
def test_explicit_axis_mesh(impl):
    """Meshes with AxisType.Explicit axes: the kernels raise NotImplementedError naming the
    limitation; the jnp reference runs."""
    from jax.sharding import AxisType

    emesh = jax.make_mesh((2, TP), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    x, g, w = rand(16, (16, 8, 32)), rand(17, (16, 8, 32)), rand(18, (32,), jnp.float32)
    xs, gs = put(emesh, x, "dp", "tp"), put(emesh, g, "dp", "tp")
    set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
    fn = lambda a, w, b: kp.rmsnorm_gated(a, w, b, impl=impl)  # noqa: E731
    with set_mesh(emesh):
        if impl == "reference":
            same(jax.jit(fn)(xs, w, gs), kp.rmsnorm_gated(x, w, g, impl=impl), "explicit", exact=False)
        else:
            with pytest.raises(NotImplementedError, match="of type Explicit.*AxisType.Auto"):
                jax.jit(fn)(xs, w, gs)
            with pytest.raises(NotImplementedError, match="of type Explicit"):
                kp.per_token_fp8_quant(put(emesh, x.reshape(16, -1), "dp", "tp"), impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_inside_shard_map(mesh, impl):
    """Inside shard_map the ops run on local arrays; the FP8 scale covers the device's heads,
    i.e. equals the unsharded op with scale_groups = the number of head shards. Interpret mode
    needs check_vma=False there (its emulation trips jax's varying-axes check); the reference,
    and the compiled kernels (GPU tests), run with the default check."""
    x, g, w = rand(16, (32, 16, 32)), rand(17, (32, 16, 32)), rand(18, (32,), jnp.float32)
    spec = P("dp", "tp")
    smap = functools.partial(jax.shard_map, mesh=mesh, check_vma=impl == "reference")
    body = lambda x, w, g: kp.rmsnorm_gated_fp8_per_token(x, w, g, impl=impl)  # noqa: E731
    qa = jax.jit(smap(body, in_specs=(spec, P(), spec), out_specs=P("dp", "tp")))(x, w, g)
    want = kp.rmsnorm_gated_fp8_per_token(x, w, g, scale_groups=TP, impl=impl)
    same(qa, want, "shard_map fp8", exact=impl != "reference")
    q, wq = rand(19, (64, 96)), rand(20, (96,))
    y = jax.jit(smap(lambda a, w: kp.rmsnorm(a, w, impl=impl), in_specs=(P(("dp", "tp")), P()),
                     out_specs=P(("dp", "tp"))))(q, wq)
    same(y, kp.rmsnorm(q, wq, impl=impl), "shard_map rmsnorm", exact=impl != "reference")


def test_kda_output_tensor_parallel(mesh):
    """The KDA output path at tensor parallelism: heads and the o_proj's input dim over tp, one
    scale group per rank; the o_proj ends in one all-reduce (the row-parallel sum), and nothing
    is gathered. Equal to the unsharded path up to float32 summation order."""
    cfg = kimi_k3.Config(hidden=256, kda_heads=8, kda_head_dim=32)
    params = kimi_k3.init_kda_out(jax.random.PRNGKey(21), cfg)
    o, g = rand(22, (16, 8, 32)), rand(23, (16, 8, 32))

    def path(p, o, g):
        fmt = kp.Fp8PerToken(p["w_o_fp8"].format.dtype, groups=TP)
        qa = kp.rmsnorm_gated(o, p["norm"], g, cfg.kda_eps, out_format=fmt, impl="interpret")
        return kp.linear(qa, p["w_o_fp8"], out_dtype=jnp.float32)

    # Row-parallel o_proj: the FP8 copy's K (its columns: stored [N, K]) over tp.
    specs = {"norm": P(), "w_o": P("tp", None), "w_o_mx": P()}
    w8 = params["w_o_fp8"]
    ps = {k: put(mesh, v, *specs.get(k, ())) for k, v in params.items() if k != "w_o_fp8"}
    ps["w_o_fp8"] = jax.tree.unflatten(jax.tree.structure(w8), [put(mesh, w8.data, None, "tp"),
                                                                put(mesh, w8.scale)])
    os_, gs = put(mesh, o, "dp", "tp"), put(mesh, g, "dp", "tp")
    out = jax.jit(path)(ps, os_, gs)
    ref = jax.jit(path)(params, o, g)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    text = compiled_text(path, ps, os_, gs)
    assert "all-gather" not in text and "all-reduce" in text


@pytest.mark.parametrize("impl,fmt", [("reference", "mxfp8"), ("reference", "mxfp4"),
                                      ("interpret", "mxfp4"), ("reference", "fp8_group128"),
                                      ("reference", "fp8_group128_ue8m0"),
                                      ("interpret", "fp8_group128")])
def test_block_formats_sharded(mesh, impl, fmt):
    """The block formats (MX: blocks of 32; group FP8: groups of 128): a block never crosses a
    head or a shard, so heads (the gated op: a head dim of 64 is 2 MX blocks, of 128 one group)
    and columns in whole blocks (quant, sigmoid-mul) split with no communication at all; the
    joint norms split over tokens. Each equal to the unsharded op, inside shard_map too; a shard
    of part of a block is refused with the block size named. The kernels in interpret mode: the
    gated op only (XLA's CPU compiler takes ~18 s for each sharded interpret-mode MX program; the
    ROCm gate compiles every sharded block kernel for real)."""
    exact = impl != "reference"
    block = kp.formats.as_format(fmt).block
    d = max(64, block)  # head dim
    x, g, w = rand(30, (16, 8, d), scale=3), rand(31, (16, 8, d)), rand(32, (d,), jnp.float32)
    x = x.at[2, 5, 40].set(jnp.nan)  # a NaN in head 5 of token 2: that head's blocks NaN, no other
    fn = lambda x, w, g: kp.rmsnorm_gated(x, w, g, out_format=fmt, impl=impl)  # noqa: E731
    qa = check(mesh, fn, (x, w, g), [("dp", "tp"), (), ("dp", "tp")], expect_all_reduce=False,
               what=f"{fmt} gated, heads over tp", exact=exact)
    per_head = d // block
    scale = np.asarray(qa.scale.astype(jnp.float32))
    assert qa.scale.shape == (16, 8 * per_head) and np.isnan(scale).sum() == per_head
    assert np.isnan(scale[2, 5 * per_head:6 * per_head]).all()
    if impl == "interpret":
        return
    a, b = rand(33, (16, 8 * d), scale=2), rand(34, (16, 8 * d))  # d columns per device
    check(mesh, lambda a, b: kp.sigmoid_mul(a, b, out_format=fmt, impl=impl), (a, b),
          [("dp", "tp"), ("dp", "tp")], expect_all_reduce=False, what=f"{fmt} sigmoid-mul",
          exact=exact)
    check(mesh, lambda a: kp.quantize(a, fmt, impl=impl), (a,),
          [(None, ("dp", "tp"))], expect_all_reduce=False, what=f"{fmt} quant, columns",
          exact=exact)
    dq = 3 * block
    q, kv, wq, wkv = rand(35, (64, dq)), rand(36, (64, 32)), rand(37, (dq,)), rand(38, (32,))
    check(mesh, lambda q, kv, wq, wkv: kp.fused_q_kv_rmsnorm(q, kv, wq, wkv, out_format=fmt,
                                                             impl=impl),
          (q, kv, wq, wkv), [TOKENS, TOKENS, (), ()], expect_all_reduce=False,
          what=f"{fmt} joint norm", exact=exact)
    packed = rand(39, (64, dq + 32 + 8))
    check(mesh, lambda p, wq, wkv: kp.mla_q_kv_norm(p, wq, wkv, q_size=dq, kv_size=32,
                                                    out_format=fmt, impl=impl),
          (packed, wq, wkv), [TOKENS, (), ()], expect_all_reduce=False,
          what=f"{fmt} packed norm", exact=exact)
    smap = functools.partial(jax.shard_map, mesh=mesh)
    got = jax.jit(smap(fn, in_specs=(P("dp", "tp"), P(), P("dp", "tp")),
                       out_specs=P("dp", "tp")))(x, w, g)
    same(got, fn(x, w, g), f"{fmt} gated in shard_map", exact=exact)
    xs = put(mesh, rand(40, (4, 4 * block)), None, ("dp", "tp"))  # half a block per device
    with pytest.raises(ValueError, match=rf"a shard must hold whole blocks.*multiples of {block}"):
        kp.quantize(xs, fmt, impl=impl)


@pytest.mark.parametrize("op", ["quantize", "sigmoid_mul"])
def test_mx_column_sharding_eager_and_jit_agree(mesh, op):
    """Round 3: an eager call on columns sharded in whole blocks was refused while jit took it,
    and under jit fewer than 32 columns per device died in the partitioner (IndivisibleError).
    Now both take whole blocks per shard (the kernel path, equal to the unsharded op, the scales
    sharded alike and nothing gathered), and both refuse shards of part of a block with the
    block size named."""
    call = {"quantize": lambda a: kp.quantize(a, "mxfp4", impl="interpret"),
            "sigmoid_mul": lambda a: kp.sigmoid_mul(a, a, out_format="mxfp4", impl="interpret")}[op]
    x = rand(40, (4, 256), scale=2)  # 32 columns on each of the 8 devices
    xs = put(mesh, x, None, ("dp", "tp"))
    want = call(x)
    for got in (call(xs), jax.jit(call)(xs)):
        same(got, want, f"{op} mxfp4, whole blocks per shard")
    assert jax.jit(call)(xs).scale.sharding.spec[-1] == ("dp", "tp")
    assert "all-gather" not in compiled_text(call, xs)
    for n in (96, 320):  # 12 and 40 columns per device: part of a block
        xs = put(mesh, rand(41, (4, n)), None, ("dp", "tp"))
        with pytest.raises(ValueError, match=r"a shard must hold whole blocks.*multiples of 32"):
            call(xs)
        # Under jit the partitioner's error carries the same text (jax wraps it); with Shardy,
        # 40 columns per device become a split of the block axis that jax cannot express and
        # jax's own IndivisibleError comes first (docs/sharding.md).
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=r"a shard must hold whole blocks|IndivisibleError"):
            jax.jit(call)(xs)
        if n == 96:
            with pytest.raises(jax.errors.JaxRuntimeError, match=r"a shard must hold whole blocks"):
                jax.jit(call)(xs)


@pytest.mark.parametrize("fmt,layout", [("fp8_group128", "nk"), ("fp8_group128_ue8m0", "kn"),
                                        ("fp8_per_token", "nk"), ("fp8_per_token", "kn")])
def test_pallas_linear_sharded(mesh, fmt, layout):
    """The Pallas GEMM (interpret mode) under jax.jit: tokens over all devices (weight
    replicated), the weight's output columns over tp in whole 128-blocks (column parallel, the
    block scales sharded alike), both at once; each equal to the unsharded call bit for bit, no
    all-gather, no all-reduce. K sharded (row parallel) is refused: eagerly with the library's
    message, under jit with jax's error carrying it."""
    k, n = 256, 4 * 128
    x = rand(50, (32, k), scale=3).at[3, 7].set(jnp.nan)
    w = rand(51, (k, n), jnp.float32, scale=0.1)
    qa = kp.quantize(x, fmt, impl="reference")
    qw = kp.quantize_weight(w, fmt, layout=layout)
    fn = lambda qa, qw: kp.linear(qa, qw, impl="interpret")  # noqa: E731
    want = jax.jit(fn)(qa, qw)
    n_axis = 1 if layout == "kn" else 0
    col = lambda a, axis: put(mesh, a, *[("tp" if i == axis else None) for i in range(a.ndim)])  # noqa: E731
    rows = lambda r: kp.QuantizedActivation(put(mesh, r.data, TOKENS[0], None),  # noqa: E731
                                            put(mesh, r.scale, TOKENS[0], None), r.format)
    cols = kp.QuantizedWeight(col(qw.data, n_axis),
                              col(qw.scale, n_axis) if qw.scale.ndim == 2 else col(qw.scale, 0),
                              qw.format, qw.layout)
    dp_rows = kp.QuantizedActivation(put(mesh, qa.data, "dp", None), put(mesh, qa.scale, "dp", None),
                                     qa.format)
    for what, a, b, spec in (("tokens", rows(qa), qw, P(TOKENS[0], None)),
                             ("columns", qa, cols, P(None, "tp")),
                             ("tokens and columns", dp_rows, cols, P("dp", "tp"))):
        got = jax.jit(fn)(a, b)
        same(got, want, f"{fmt} {layout} {what}")
        got_spec = tuple(got.sharding.spec) + (None,) * (2 - len(got.sharding.spec))
        assert got_spec == tuple(spec), (what, got.sharding.spec)
        text = compiled_text(fn, a, b)
        assert "all-gather" not in text and "all-reduce" not in text, what
    k_sharded = kp.QuantizedActivation(put(mesh, qa.data, None, "tp"), qa.scale, qa.format)
    with pytest.raises(ValueError, match="linear: K .* is sharded over mesh axes 'tp'.*psum"):
        fn(k_sharded, qw)
    with pytest.raises(jax.errors.JaxRuntimeError, match="linear: K .* is sharded.*psum"):
        jax.jit(fn)(k_sharded, qw)
    if fmt != "fp8_per_token":  # 64 columns per device: half a 128-block
        eight = (None, ("dp", "tp")) if layout == "kn" else (("dp", "tp"), None)
        half = kp.QuantizedWeight(put(mesh, qw.data, *eight), qw.scale, qw.format, qw.layout)
        with pytest.raises(jax.errors.JaxRuntimeError, match="a shard must hold whole blocks"):
            jax.jit(fn)(qa, half)


def test_eager_sharding_error_names_the_operand(mesh):
    """Round 4: the eager error printed a literal ``{}`` where the operand's name belongs."""
    x = put(mesh, rand(60, (8, 64)), None, "tp")
    with pytest.raises(ValueError, match=r"rmsnorm: the normalized \(last\) axis of x is sharded") as e:
        kp.rmsnorm(x, rand(61, (64,)), impl="reference")
    assert "{}" not in str(e.value)
    with pytest.raises(ValueError, match=r"add_rmsnorm: the normalized \(last\) axis of residual") as e:
        kp.add_rmsnorm(rand(62, (8, 64)), x, rand(61, (64,)), impl="reference")
    assert "{}" not in str(e.value)


# jax 0.10.2 under GSPMD: jax's IndivisibleError surfaces eagerly, and under jit XLA aborts.
OLD_GSPMD = jax.__version_info__ < (0, 11) and not config.jax_use_shardy_partitioner


def _indivisible_cases():
    """(name, fn, sharded operands, eager outcome) of the layouts that jax's custom_partitioning
    cannot express under jit on a mesh of one axis of 8: XLA's propagation splits a group / block
    axis over part of that mesh axis, and jax's conversion of the sharding raises IndivisibleError
    before any rule of the library runs (docs/sharding.md)."""
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("tp",))
    x, g = rand(50, (4, 8, 128)), rand(51, (4, 8, 128))
    w = jnp.ones((128,), jnp.bfloat16)
    per_token = kp.Fp8PerToken(groups=2)  # 1 < groups < 8 shards
    heads, cols = NamedSharding(mesh, P(None, "tp", None)), NamedSharding(mesh, P(None, "tp"))
    return [
        ("per-token groups=2, heads over 8", lambda x, g: kp.rmsnorm_gated(
            x, w, g, out_format=per_token, impl="interpret"),
         (jax.device_put(x, heads), jax.device_put(g, heads)), None),
        ("per-token groups=2, columns over 8", lambda a: kp.quantize(a, per_token, impl="interpret"),
         (jax.device_put(rand(52, (4, 1024)), cols),), None),
        ("group FP8, 64 columns a shard", lambda a: kp.quantize(a, "fp8_group128", impl="interpret"),
         (jax.device_put(rand(53, (4, 512)), cols),), r"a shard must hold whole blocks.*multiples of 128"),
        ("mxfp4, 40 columns a shard", lambda a: kp.quantize(a, "mxfp4", impl="interpret"),
         (jax.device_put(rand(54, (4, 320)), cols),), r"a shard must hold whole blocks.*multiples of 32"),
    ]


def test_layouts_jax_refuses_under_jit(mesh):
    """Round 4: the layouts whose jit error comes from jax, not the library, under Shardy and
    GSPMD alike, stated exactly in docs/sharding.md. If a jax release starts to express them,
    this test fails and the docs (and the library's own check) must follow. Eagerly the library
    names the block size, or (per-token groups that do not divide the shards) runs the op (jax
    0.12; jax 0.10.2 under GSPMD raises IndivisibleError there too). The
    same per-token groups over a (dp, tp) = (2, 4) mesh run under jit too: there the two groups
    take dp and the columns within a group tp, a layout jax can name."""
    for what, fn, args, eager in _indivisible_cases():
        if eager is None:
            try:
                same(fn(*args), fn(*[np.asarray(a) for a in args]), what)
            except Exception as e:  # noqa: BLE001 - jax 0.10.2 under GSPMD: jax's error eagerly too
                assert "IndivisibleError" in f"{type(e).__name__}{e}", e
                assert OLD_GSPMD, e
            mesh_args = [put(mesh, np.asarray(a), *[("dp", "tp") if s == "tp" else s for s in a.sharding.spec])
                         for a in args]
            same(jax.jit(fn)(*mesh_args), fn(*[np.asarray(a) for a in args]), what + ", (2, 4) mesh")
        else:
            with pytest.raises(ValueError, match=eager):
                fn(*args)
        if OLD_GSPMD:  # XLA aborts the process (CHECK in custom_partition_callback.cc): not testable here
            continue
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"IndivisibleError"):
            jax.jit(fn)(*args)
