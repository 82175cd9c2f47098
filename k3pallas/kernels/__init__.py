"""The kernel backend: Pallas kernels on its Triton backend (AMD ROCm and NVIDIA CUDA).

The dispatch (``k3pallas.ops``) calls this package through one face:

* ``entry(op)``: the kernel path of op ``op`` (a name of ``k3pallas.ops.OPS``) on one device's
  arrays in the layout of the op's sharding rule, ``fn(*arrays, op=, fmt=, cast=, target=,
  interpret=, reduce_axes=, **options)``: ``fmt`` the output format (``k3pallas.formats``,
  resolved for ``target``; None: unquantized), ``cast`` the float32 -> element conversion mode
  asked for, ``target`` the device the kernels are built for (``k3pallas.platform.Target``),
  passed down to everything below. Each kernel module lists its entries in ``ENTRIES``,
  functions named after their ops.

Everything below that face is the backend's own: the kernels by family (``norms``: the segments
kernel of the norms; ``gated``: the gated norm, sigmoid-mul and quantization), the epilogue of
each kind of output format (``row_scaled``: a scale per token; ``block_scaled``: a scale per
block), how a kernel is launched (``launch``: rows per program, Triton's ``num_warps`` /
``num_stages``), whether it converts to FP8 natively (``fp8_cast``), and the tiles, math and
launcher they share (``common``). A second backend (for example jax-triton, should Pallas Triton
leave jax) would be one more package with the same ``entry``.
"""

from __future__ import annotations

from k3pallas.kernels import gated, norms

_ENTRIES = {fn.__name__: fn for module in (norms, gated) for fn in module.ENTRIES}


def entry(op: str):
    """The kernel path of ``op``; KeyError naming the ops the backend has otherwise."""
    try:
        return _ENTRIES[op]
    except KeyError:
        raise KeyError(f"the Pallas Triton backend has no kernel for op {op!r}; it has "
                       f"{sorted(_ENTRIES)}") from None


def ops() -> tuple[str, ...]:
    return tuple(_ENTRIES)
