"""``python -m bench.inspection.profile_cases OP:CONFIG:T ...``: run each case's fused kernel a few times
(random bf16 inputs, each op's own launch config), for a profiler wrapped around this process
(for example Nsight Compute: ``ncu -k regex:k3pallas ... python -m bench.inspection.profile_cases ...``).
Prints each case's launches. ``copy:OP:CONFIG:T`` runs the benchmark's copy ceiling of that
case's bytes instead (its XLA xor kernel: ``ncu -k regex:xor``). Not part of the benchmark: a
helper for the profiles in docs/performance.md.
"""

from __future__ import annotations

import sys

import jax

from bench import ops as bench_ops


def run(case: str, calls: int = 2) -> None:
    copy = case.startswith("copy:")
    name, cfg, t = case.removeprefix("copy:").split(":")
    c = bench_ops.make_case(name, cfg, int(t), "bfloat16", "pallas")  # the benchmark's inputs
    if copy:  # no random inputs: their PRNG kernels are xor fusions too, and would run first
        make, copies = bench_ops.copy_variants(c.bytes_moved)
        fn, args = copies["xor_kernel"], make(0)
    else:
        fn, args = c.variants["k3pallas"], c.make_inputs(0)
    for _ in range(calls):
        jax.block_until_ready(fn(*args))
    print(case, "copy of the same bytes" if copy else c.launch, flush=True)


if __name__ == "__main__":
    for c in sys.argv[1:]:
        run(c)
