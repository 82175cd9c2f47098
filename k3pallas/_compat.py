"""Differences between the supported jax versions (0.10.2 through 0.12.x), in one place.

Nothing else in the package imports private jax internals or checks ``jax.__version__``.
"""

from __future__ import annotations

import contextvars
import inspect
import re

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl  # noqa: F401  (re-exported for the kernel modules)
from jax.experimental.pallas import triton as plgpu

# jax 0.12 defines the config option ``pallas_fuser_disable_nested_fuse``, part of every jit's
# trace context, in a module that the first interpret-mode ``pallas_call`` imports: a function
# jitted before it would trace again on its second call (a new trace context). Imported here,
# the context is whole from the start (tests/test_properties.py: a fresh process).
try:
    import jax.experimental.pallas.fuser  # noqa: F401
except ImportError:  # pragma: no cover - a jax without it has no such option either
    pass


def _parse_version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


JAX_VERSION: tuple[int, ...] = _parse_version(jax.__version__)


def triton_compiler_params(num_warps: int, num_stages: int):
    """Launch options of a Pallas Triton call (``TritonCompilerParams`` was renamed in jax 0.6)."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _varying_axes(arrays) -> frozenset:
    """Mesh axes the arrays vary over inside ``shard_map`` (empty outside it)."""
    axes = frozenset()
    for a in arrays:
        t = getattr(jax.typeof(a), "manual_axis_type", None)
        axes |= frozenset(getattr(t, "varying", None) or ())
    return axes


def match_varying(row_inputs, shared_inputs):
    """Inside ``shard_map`` (default ``check_vma=True``): the row inputs and the weights of a
    kernel, all varying over the same mesh axes, and the ``manual_axis_type`` its outputs need.

    A ``pallas_call`` there must say over which mesh axes each output varies (its inputs' axes),
    and interpret mode mixes the weights with the rows, so replicated weights are marked varying
    too (``jax.lax.pcast(..., to="varying")``: no data moves). Outside shard_map nothing changes
    and the type is None. ``jax.typeof(a).manual_axis_type`` and ``pcast`` exist in jax 0.10.2
    through 0.12.
    """
    axes = _varying_axes(list(row_inputs) + list(shared_inputs))
    if not axes:
        return list(row_inputs), list(shared_inputs), None

    def widen(a):
        missing = tuple(sorted(axes - _varying_axes([a])))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    rows = [widen(a) for a in row_inputs]
    return rows, [widen(a) for a in shared_inputs], jax.typeof(rows[0]).manual_axis_type


def local_devices() -> list:
    """jax's local devices, or [] where no backend can start."""
    try:
        return list(jax.local_devices())
    except RuntimeError:
        return []


def abstract_target_device():
    """The ``AbstractDevice`` of the abstract mesh in scope (deviceless lowering), or None.

    ``jax.sharding.get_abstract_mesh`` exists in every supported version; the attribute
    ``abstract_device`` is None on a mesh that was not given one.
    """
    mesh = jax.sharding.get_abstract_mesh()
    return getattr(mesh, "abstract_device", None)


def operand_device(a):
    """The device an operand's sharding names, or None: for a traced value, the
    ``AbstractDevice`` of its type's mesh (``jax.jit`` with ``NamedSharding``); for a committed
    ``jax.Array``, one of its devices. ``jax.typeof(x).sharding.mesh.abstract_device`` exists in
    jax 0.10.2 through 0.12 (None for a mesh without devices)."""
    if isinstance(a, jax.core.Tracer):
        mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
        return getattr(mesh, "abstract_device", None)
    if isinstance(a, jax.Array) and getattr(a, "committed", False):
        devices = getattr(a.sharding, "device_set", None)
        return next(iter(devices)) if devices else None
    return None


def triton_ir_modules(lowered) -> list[dict]:
    """The Triton IR of every ``__gpu$xla.gpu.triton`` call in a ``jax.stages.Lowered``, as text.

    Pallas stores each kernel's Triton IR as MLIR bytecode under the key ``ir`` of the call's
    ``mhlo.backend_config`` dictionary; it prints as text in an MLIR context with jaxlib's triton
    dialect registered. Returns ``[{"name", "num_warps", "num_stages", "grid", "ir"}, ...]``.
    Uses private jax modules (``jax._src``), which is why it lives here.
    """
    from jax._src.lib.mlir import ir

    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    child = child.operation
                    if child.name == "stablehlo.custom_call":
                        target = ir.StringAttr(child.attributes["call_target_name"]).value
                        if target == "__gpu$xla.gpu.triton":
                            calls.append(ir.DictAttr(child.attributes["mhlo.backend_config"]))
                    walk(child)

    walk(lowered.compiler_ir("stablehlo").operation)
    out = []
    for cfg in calls:
        text = triton_ir_text(ir.StringAttr(cfg["ir"]).value_bytes)
        fields = {k: ir.IntegerAttr(cfg[k]).value for k in ("num_warps", "num_stages", "grid_x",
                                                             "grid_y", "grid_z")}
        out.append({"name": ir.StringAttr(cfg["name"]).value, "num_warps": fields["num_warps"],
                    "num_stages": fields["num_stages"],
                    "grid": (fields["grid_x"], fields["grid_y"], fields["grid_z"]), "ir": text})
    return out


def triton_ir_context():
    """A new MLIR context with jaxlib's triton dialect registered (to parse or write a kernel's
    Triton IR)."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import triton as jax_triton

    ctx = jax_mlir.make_ir_context()
    jax_triton.dialect.register_dialect(ctx)
    return ctx


def triton_ir_text(blob: bytes) -> str:
    """A kernel's Triton IR from its MLIR bytecode (as Pallas stores it), printed as text."""
    from jax._src.lib.mlir import ir

    with triton_ir_context():
        return str(ir.Module.parse(blob))


def register_deviceless_gpu_kind(device_kind: str, arch: str) -> None:
    """Tell Pallas' Triton lowering the arch of an AMD device kind it does not map itself
    ("MI300X", as XLA's ROCm topology devices say), for lowering without that device attached:
    its ``gpu_info.registry`` (jax 0.12.0: ``jax._src.pallas.triton.gpu_info``; 0.12.1:
    ``jax._src.gpu_info``, where an unmapped kind stops the lowering). On hardware jax reads
    the arch from the device (``compute_capability`` "gfx942"); jax 0.10 / 0.11 do not look at
    the kind. No-op for the kinds jax knows (NVIDIA names, "gfx..."), for non-AMD arches, and on
    jax without the module.
    """
    if not arch.startswith("gfx") or arch == "gfx_unknown" or device_kind.startswith("gfx"):
        return
    try:
        from jax._src import gpu_info
    except ImportError:
        try:
            from jax._src.pallas.triton import gpu_info
        except ImportError:
            return
    registry = getattr(gpu_info, "registry", None)
    if registry is not None and device_kind not in registry:
        registry[device_kind] = lambda: gpu_info.GpuInfo(
            gpu_version=None, arch_name=arch, compute_capability=0)


# ------------------------------------------------------------------------------------------------
# The native float32 -> float8_e4m3fnuz cast in Pallas' Triton lowering (k3pallas.fp8_cast).
# ------------------------------------------------------------------------------------------------

# jax versions whose ``jax._src.pallas.triton.lowering`` was read for this patch: the refusal is
# the table entry ``(ir.Float8E4M3FNUZType, "float8_e4m3fnuz", lambda _: False)`` of
# ``_UNSUPPORTED_CAST_DTYPES``, and ``pallas_call_registration`` calls
# ``lowering.lower_jaxpr_to_triton_module`` with the kernel's jaxpr (whose ``debug_info.func_name``
# is the pallas_call's name). Identical in 0.10.2, 0.11.2, 0.12.0 and 0.12.1.
NATIVE_FNUZ_JAX = ((0, 10, 2), (0, 11, 2), (0, 12, 0), (0, 12, 1))
_IN_OWN_KERNEL = contextvars.ContextVar("k3pallas_lowering_own_kernel", default=False)
_FNUZ_PATCHED = []


def native_fnuz_cast_unavailable() -> str | None:
    """None if ``enable_native_fnuz_cast`` can work on this jax, else the reason."""
    if JAX_VERSION[:3] not in NATIVE_FNUZ_JAX:
        return (f"the native e4m3fnuz cast patch was written for jax "
                f"{', '.join('.'.join(map(str, v)) for v in NATIVE_FNUZ_JAX)}, not {jax.__version__}")
    try:
        from jax._src.pallas.triton import lowering
    except ImportError as e:
        return f"jax's Pallas Triton lowering is not importable ({e})"
    if _FNUZ_PATCHED:
        return None
    entries = [e for e in getattr(lowering, "_UNSUPPORTED_CAST_DTYPES", ()) if len(e) == 3
               and e[1] == "float8_e4m3fnuz"]
    fn = getattr(lowering, "lower_jaxpr_to_triton_module", None)
    if len(entries) != 1 or fn is None:
        return "jax's Pallas Triton lowering does not have the expected fp8 cast table"
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    if params[:2] != ["jaxpr", "grid_mapping"]:
        return ("jax's Pallas Triton lowering does not have the expected fp8 cast table "
                f"(lower_jaxpr_to_triton_module{tuple(params)}: not jaxpr, grid_mapping, ...)")
    return None


def enable_native_fnuz_cast() -> None:
    """Let kernels named ``k3pallas_*`` (and only those) cast to ``float8_e4m3fnuz``.

    The lowering refuses every cast to that format through one table entry. This replaces that
    entry's predicate by one that holds while a ``k3pallas_*`` kernel is being lowered, which a
    wrapper of ``lower_jaxpr_to_triton_module`` marks; any other Pallas kernel is refused as
    before. Idempotent. Raises RuntimeError where ``native_fnuz_cast_unavailable()`` says why.
    """
    if _FNUZ_PATCHED:
        return
    reason = native_fnuz_cast_unavailable()
    if reason:
        raise RuntimeError(reason)
    from jax._src.pallas.triton import lowering

    lowering._UNSUPPORTED_CAST_DTYPES = tuple(
        (t, name, (lambda cc: _IN_OWN_KERNEL.get()) if name == "float8_e4m3fnuz" else pred)
        for t, name, pred in lowering._UNSUPPORTED_CAST_DTYPES)
    original = lowering.lower_jaxpr_to_triton_module

    def lower_marking_own_kernels(jaxpr, *args, **kwargs):
        name = getattr(getattr(jaxpr, "debug_info", None), "func_name", "") or ""
        token = _IN_OWN_KERNEL.set(name.startswith("k3pallas_"))
        try:
            return original(jaxpr, *args, **kwargs)
        finally:
            _IN_OWN_KERNEL.reset(token)

    lowering.lower_jaxpr_to_triton_module = lower_marking_own_kernels
    _FNUZ_PATCHED.append(original)


# ------------------------------------------------------------------------------------------------
# What an operand's sharding is, where it is known when an op is called (k3pallas.api).
# ------------------------------------------------------------------------------------------------


def known_spec(a) -> tuple | None:
    """The mesh axes sharding each dim of ``a`` where that is known at call time, else None.

    A committed ``jax.Array`` (outside ``jax.jit``) knows its ``NamedSharding``; inside ``jit``
    a traced value's type carries its sharding only for mesh axes of type ``Explicit`` (with
    ``Auto`` axes XLA decides later, and the type says None for every dim). jax 0.10.2 - 0.12.
    """
    if isinstance(a, jax.core.Tracer):
        sharding = getattr(jax.typeof(a), "sharding", None)
    else:
        sharding = getattr(a, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return None
    spec = tuple(spec)
    return spec + (None,) * (a.ndim - len(spec))


def known_shards(a, axes) -> int | None:
    """How many shards mesh ``axes`` (a name or a tuple, from ``known_spec``) cut a dim of ``a``
    into, from the mesh of its sharding where it is known; None otherwise."""
    if isinstance(a, jax.core.Tracer):
        sharding = getattr(jax.typeof(a), "sharding", None)
    else:
        sharding = getattr(a, "sharding", None)
    shape = dict(getattr(getattr(sharding, "mesh", None), "shape", {}) or {})
    names = axes if isinstance(axes, tuple) else (axes,)
    if not all(n in shape for n in names):
        return None
    out = 1
    for n in names:
        out *= shape[n]
    return out


def explicit_axes(a) -> tuple:
    """The mesh axes of type ``Explicit`` that shard ``a`` in its type (inside ``jit`` or
    eagerly), in order; empty for Auto meshes and unsharded arrays."""
    sharding = getattr(jax.typeof(a), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    types = dict(zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ())))
    names = []
    for entry in tuple(getattr(sharding, "spec", ()) or ()):
        for axis in (entry if isinstance(entry, tuple) else (entry,)):
            if axis is not None and types.get(axis) == jax.sharding.AxisType.Explicit:
                names.append(axis)
    return tuple(names)


def jax_mx_quantize(y, data_type, block_size=32):
    """jax's own MX quantization (``jax.nn.scaled_dot_general``'s, private in every jax we
    support: ``jax._src.cudnn.scaled_matmul_stablehlo.quantize``, present in 0.10.2 to 0.12.1),
    for the benchmark's unfused MX variant and the tests' parity checks: ``(elements [..., N]
    in ``data_type``, float8_e8m0fnu scales [..., N / block_size])``."""
    from jax._src.cudnn.scaled_matmul_stablehlo import BlockScaleConfig, quantize

    cfg = BlockScaleConfig(mode="mxfp8", block_size=block_size, data_type=data_type,
                           scale_type=jnp.float8_e8m0fnu, global_scale=None, infer_only=False)
    return quantize(y.astype(jnp.float32), cfg)


# ------------------------------------------------------------------------------------------------
# FP8 dots: how often the matrix cores' partial sums are promoted (the GEMM, GemmConfig.mma_acc)
# ------------------------------------------------------------------------------------------------

FP8_ACC_SUFFIX = re.compile(r"_acc(\d+)$")


def fp8_dot_accumulation(name: str, mma_acc: int) -> str:
    """The kernel name under which a Pallas Triton kernel's FP8 x FP8 dots are lowered with
    Triton's ``maxNumImpreciseAcc = mma_acc`` (``name`` itself for 0, Pallas' default).

    jax's Triton lowering of ``dot_general`` (``triton_lowering_rules[lax.dot_general_p]``,
    jax 0.10.2 through 0.12.x) creates ``tt.dot`` without that attribute, i.e. 0: promote
    every instruction, which makes Triton's Hopper path refuse wgmma for FP8 operands (it
    converts them to float16 for mma.sync instead). The lowering knows only the kernel's name
    (``ctx.context.name``) when it runs, after the kernel was traced, so the setting travels in
    the name as ``_acc<k>``; a wrapper around the rule sets the attribute on the FP8 dots of such
    kernels. Installed on first use; RuntimeError if this jax's lowering is not the one it was
    written for."""
    if not mma_acc:
        return name
    _install_fp8_dot_rule()
    return f"{name}_acc{mma_acc}"


_FP8_RULE_INSTALLED = []


def _install_fp8_dot_rule() -> None:
    if _FP8_RULE_INSTALLED:
        return
    try:
        from jax._src.lib.mlir import ir
        from jax._src.pallas.triton import lowering as triton_lowering

        rules = triton_lowering.triton_lowering_rules
        original = rules[jax.lax.dot_general_p]
    except (ImportError, AttributeError, KeyError) as e:
        raise RuntimeError(f"GemmConfig.mma_acc needs jax's Pallas Triton dot_general lowering "
                           f"(written for jax 0.10.2 - 0.12.x; this is {jax.__version__}): {e}") from None

    def rule(ctx, a, b, **params):
        out = original(ctx, a, b, **params)
        m = FP8_ACC_SUFFIX.search(getattr(ctx.context, "name", "") or "")
        fp8 = all(jnp.dtype(v.dtype).itemsize == 1 and jnp.issubdtype(v.dtype, jnp.floating)
                  for v in ctx.avals_in)
        owner = getattr(out, "owner", None)
        if m and fp8 and owner is not None and owner.name == "tt.dot":
            owner.attributes["maxNumImpreciseAcc"] = ir.IntegerAttr.get(
                ir.IntegerType.get_signless(32), int(m.group(1)))
        return out

    rules[jax.lax.dot_general_p] = rule
    _FP8_RULE_INSTALLED.append(rule)
