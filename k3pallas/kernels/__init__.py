"""The kernel backend: Pallas kernels on its Triton backend (AMD ROCm and NVIDIA CUDA).

The public API (``k3pallas.api``, through ``k3pallas.ops``) calls this package through one face:

* ``entry(op)``: the kernel path of op ``op`` (a name of ``k3pallas.ops.OPS``) on one device's
  arrays, ``fn(*arrays, op=..., reduce_axes=..., interpret=..., **options)``, with the arrays and
  options of the op's jnp reference (``k3pallas.reference``) and the results in the layout of the
  op's sharding rule. Each kernel module lists its entries in ``ENTRIES``, functions named after
  their ops; ``op`` names the launches and keys their launch configs.

Everything below that face is the backend's own: how a kernel is launched (``launch``: rows per
program and Triton's ``num_warps`` / ``num_stages``), whether it converts to FP8 natively
(``fp8_cast``), the kernels (``rmsnorm``, ``gated_fp8``), and the tiles and the launcher they
share (``common``). A second backend (for example jax-triton, should Pallas Triton leave jax)
would be one more package with the same ``entry``.
"""

from __future__ import annotations

from k3pallas.kernels import gated_fp8, mx, rmsnorm

_ENTRIES = {fn.__name__: fn for module in (rmsnorm, gated_fp8, mx) for fn in module.ENTRIES}


def entry(op: str):
    """The kernel path of ``op``; KeyError naming the ops the backend has otherwise."""
    try:
        return _ENTRIES[op]
    except KeyError:
        raise KeyError(f"the Pallas Triton backend has no kernel for op {op!r}; it has "
                       f"{sorted(_ENTRIES)}") from None


def ops() -> tuple[str, ...]:
    return tuple(_ENTRIES)
