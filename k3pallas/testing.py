"""Tooling for tests, the benchmark and the ROCm gate; nothing at run time imports this module.

* ``KNOWN_TARGETS``: the targets the deviceless tests, the ROCm gate and the docs talk about;
* ``abstract_mesh`` / ``lower_for``: lowering for a GPU that is not attached (deviceless);
* ``triton_launches`` / ``triton_ir_modules``: the Triton calls of a lowered program (launch
  parameters; the Triton IR, which needs private jax and so lives in ``k3pallas._compat``);
* ``poisoned_outputs``: kernels traced inside start from poisoned outputs, so that an element a
  kernel leaves unwritten shows up as NaN.
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp

from k3pallas import platform as platform_lib
from k3pallas._compat import register_deviceless_gpu_kind, triton_ir_modules  # noqa: F401  (re-exported: private jax inside)
from k3pallas.kernels import common, hooks

__all__ = ["KNOWN_TARGETS", "abstract_mesh", "lowering_platform", "lower_for", "register_deviceless_gpu_kind", "triton_launches", "triton_ir_modules",
           "poisoned_outputs"]

# Devices as jax presents them: platform "gpu" for both vendors, with the device kind that
# XLA's ROCm plugin gives its MI300X / MI350X topology devices and that CUDA gives an H200.
KNOWN_TARGETS = {
    "h200": ("NVIDIA H200", "gpu"),
    "gfx942": ("MI300X", "gpu"),
    "gfx950": ("MI350X", "gpu"),
}
# Core counts as the devices report them (XLA's target configs; the H200's 132 SMs).
_CORES = {"NVIDIA H200": 132, "MI300X": 304, "MI350X": 256}


def abstract_mesh(device_kind: str, platform: str = "gpu", shape=(1,), axis_names=("x",)):
    """An abstract mesh of devices of ``device_kind``, as jax builds one from real devices
    (``AbstractDevice(kind, cores, platform)``; a GPU of either vendor says platform "gpu").

    Use it as ``with jax.sharding.use_abstract_mesh(abstract_mesh("MI300X")):`` around
    ``jax.jit(f).trace(...).lower(lowering_platforms=("rocm",))`` to lower for a GPU that is not
    attached (``lower_for`` does both). ``AxisType.Auto``: ``Explicit`` broke two-dimensional
    reductions in that mode.
    """
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    register_deviceless_gpu_kind(device_kind, platform_lib.target_for(
        device_kind, platform).arch)
    return AbstractMesh(tuple(shape), tuple(axis_names), (AxisType.Auto,) * len(shape),
                        abstract_device=AbstractDevice(device_kind, _CORES.get(device_kind), platform))


def lowering_platform(device_kind: str, platform: str = "gpu") -> str:
    """"cuda" or "rocm": the platform to lower for, from what the device says."""
    return platform_lib.target_for(device_kind, platform).backend


def lower_for(fn, args, device_kind: str, platform: str = "gpu"):
    """Lower ``jax.jit(fn)`` for ``args`` (arrays or ShapeDtypeStructs, pytrees allowed) on a
    GPU that is not here. Returns the ``jax.stages.Lowered``; ``.as_text()`` is the StableHLO."""
    structs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    with jax.sharding.use_abstract_mesh(abstract_mesh(device_kind, platform)):
        return jax.jit(fn).trace(*structs).lower(
            lowering_platforms=(lowering_platform(device_kind, platform),))


_LAUNCH_FIELD = re.compile(r"\b(name|num_warps|num_stages|grid_x|grid_y|grid_z) = (\"[^\"]*\"|\d+)")


def triton_launches(module_text: str) -> list[dict]:
    """The Triton custom calls of a lowered module's text, with their launch parameters.

    Each ``__gpu$xla.gpu.triton`` call carries ``name``, ``num_warps``, ``num_stages`` and
    ``grid_x/y/z`` in its ``mhlo.backend_config`` dictionary (the IR itself is bytecode beside
    them, key ``ir``).
    """
    launches = []
    for chunk in module_text.split("__gpu$xla.gpu.triton")[1:]:
        end = chunk.find("\n")
        fields = dict(_LAUNCH_FIELD.findall(chunk[: end if end > 0 else None]))
        launches.append({k: (v.strip('"') if k == "name" else int(v)) for k, v in fields.items()})
    return launches


@contextlib.contextmanager
def poisoned_outputs():
    """Kernels traced inside start from outputs filled with a poison value: NaN for float
    outputs, a code that decodes to NaN for fp8 codes (the kernel's ``out_poison``), passed in
    through ``input_output_aliases``. An element the kernel leaves unwritten then shows up as
    NaN, on the GPU as well as in interpret mode."""

    def poison(call: common.RowCall) -> common.RowCall:
        n_in = len(call.inputs)
        kernel = call.kernel
        # Outputs already written over an input (the residual) keep that input's values.
        outs = [j for j in range(len(call.out_shapes)) if j not in call.aliases.values()]

        def skip_poison_refs(*refs):  # the aliased poison inputs are the outputs' refs
            kernel(*refs[:n_in], *refs[n_in + len(outs):])

        return common.RowCall(
            skip_poison_refs,
            call.inputs + [jnp.full(call.out_shapes[j].shape, call.out_poison[j],
                                    call.out_shapes[j].dtype) for j in outs],
            call.in_specs + [call.row_spec(call.out_shapes[j].shape) for j in outs],
            call.out_shapes, call.row_spec, call.out_poison,
            {**call.aliases, **{n_in + k: j for k, j in enumerate(outs)}})

    with hooks.wrapping(poison):
        yield
