"""``python -m bench.profile_cases OP:CONFIG:T ...``: run each case's fused kernel a few times
(random bf16 inputs, each op's own launch config), for a profiler wrapped around this process
(for example Nsight Compute: ``ncu -k regex:k3pallas ... python -m bench.profile_cases ...``).
Prints each case's launches. Not part of the benchmark: a helper for bench/NOTES.md's profiles.
"""

from __future__ import annotations

import sys

import jax

from bench import ops as bench_ops


def run(case: str, calls: int = 2) -> None:
    name, cfg, t = case.split(":")
    c = bench_ops.make_case(name, cfg, int(t), "bfloat16", "pallas")  # the benchmark's inputs
    args = c.make_inputs(0)
    for _ in range(calls):
        jax.block_until_ready(c.variants["k3pallas"](*args))
    print(case, c.launch, flush=True)


if __name__ == "__main__":
    for c in sys.argv[1:]:
        run(c)
