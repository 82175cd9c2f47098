"""What XLA compiled: the instructions of a compiled module's entry computation.

Used by the GPU tests and ``python -m bench.inspection.hlo_report`` to show that ``mla_q_kv_norm`` runs as
one custom call with no slice or copy around it, and that ``linear`` (per-token FP8) becomes a vendor FP8
GEMM (``__cublas$lt$matmul$f8``) instead of an upcast.
"""

from __future__ import annotations

import collections
import re

import jax

FP8_GEMM_TARGET = "__cublas$lt$matmul$f8"  # XLA's name on NVIDIA (cuBLASLt) and ROCm (hipBLASLt)

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def compiled_text(fn, *args) -> str:
    """The optimized HLO of ``jax.jit(fn)`` for ``args`` on the default device."""
    return jax.jit(fn).lower(*args).compile().as_text()


def entry_instructions(hlo_text: str) -> list[str]:
    """The instruction lines of the ENTRY computation."""
    lines, inside = [], False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY"):
            inside = True
            continue
        if inside:
            if line.startswith("}"):
                break
            if _INSTR.match(line):
                lines.append(line.strip())
    if not inside:
        raise ValueError("no ENTRY computation in the HLO text")
    return lines


def entry_opcodes(hlo_text: str) -> collections.Counter:
    """Opcode -> count over the ENTRY computation (fusions count as one ``fusion`` each)."""
    return collections.Counter(_INSTR.match(line).group(1) for line in entry_instructions(hlo_text))


def custom_call_targets(hlo_text: str) -> list[str]:
    """Targets of every custom call in the module, in order (fused computations included)."""
    return _TARGET.findall(hlo_text)


# Opcodes that move no data on a GPU (a bitcast is a view; the rest is bookkeeping).
FREE_OPCODES = frozenset({"parameter", "bitcast", "get-tuple-element", "tuple", "constant"})


def data_moving_ops(hlo_text: str) -> collections.Counter:
    """The ENTRY opcodes that launch work (everything but ``FREE_OPCODES``)."""
    return collections.Counter({op: n for op, n in entry_opcodes(hlo_text).items()
                                if op not in FREE_OPCODES})
