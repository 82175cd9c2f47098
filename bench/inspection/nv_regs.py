"""``python -m bench.inspection.nv_regs OP:CONFIG:T ...``: registers per thread of the kernels for an H200
(sm_90), offline: the Triton IR from deviceless lowering, compiled by pip ``triton`` and its
``ptxas -v`` (``pip install triton``; not a dependency of the package). An ESTIMATE of what the
GPU's own compile gives (XLA's Triton differs from pip's; on the H200, Nsight Compute read 74
registers for the 96 x 128 gated FP8 kernel where this gives 80; ``bench.inspection.nv_xla``
compiles with XLA's own CUDA backend instead, a closer estimate). For finding register-limited
occupancy without a GPU: ``blocks per SM = 65536 / (registers x threads)``, at most 32.
Not a predictor of speed: a store through a reshaped view that looked ideal here (16-byte loads,
no shared memory) ran 2.6-4x slower as XLA's Triton compiled it on the H200 (docs/performance.md,
the reverted code store).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile

from bench import cases as ops
from k3pallas import testing

from bench.rocm import check as rocm_check


def registers(case: str) -> list[tuple[str, int, int]]:
    """[(kernel, num_warps, registers per thread)] of one ``OP:CONFIG:T`` case."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    name, cfg, t = case.split(":")
    # The ROCm gate's case builder: bf16 arguments; FP8 with the native cast (what the H200 runs).
    fn, args = rocm_check.case_fn({"op": name, "config": cfg, "tokens": int(t),
                                   **({"fp8_cast": "native"} if ops.OPS[name].fp8 else {})})
    lowered = testing.lower_for(fn, args, *testing.KNOWN_TARGETS["h200"])
    out = []
    for mod in testing.triton_ir_modules(lowered):
        with tempfile.TemporaryDirectory() as d:
            ttir, ptx = f"{d}/k.ttir", f"{d}/k.ptx"
            with open(ttir, "w") as f:
                f.write(mod["ir"])
            k = triton.compile(ttir, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": mod["num_warps"]})
            with open(ptx, "w") as f:
                f.write(k.asm["ptx"])
            log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", ptx, "-o",
                                  "/dev/null"], capture_output=True, text=True, check=True).stderr
        out.append((mod["name"], mod["num_warps"], int(re.findall(r"Used (\d+) registers", log)[0])))
    return out


if __name__ == "__main__":
    for c in sys.argv[1:]:
        for kernel, warps, regs in registers(c):
            blocks = min(32, 65536 // (regs * warps * 32))
            print(f"{c}: {kernel} {warps} warps, {regs} registers per thread -> {blocks} blocks "
                  f"({blocks * warps} warps) per SM by registers")
