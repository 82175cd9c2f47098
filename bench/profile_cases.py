"""``python -m bench.profile_cases OP:CONFIG:T ...``: run each case's fused kernel a few times
(random bf16 inputs, each op's own launch config), for a profiler wrapped around this process
(for example Nsight Compute: ``ncu -k regex:k3pallas ... python -m bench.profile_cases ...``).
Prints each case's launches. Not part of the benchmark: a helper for bench/NOTES.md's profiles.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from k3pallas import ops
from k3pallas.kernels import launch

from bench import ops as bench_ops


def run(case: str, calls: int = 2) -> None:
    name, cfg, t = case.split(":")
    spec = ops.OPS[name]
    structs, options = spec.example(int(t), jnp.dtype(jnp.bfloat16), **spec.sizes[cfg])
    args = bench_ops._fill(jax.random.PRNGKey(0), structs)
    with launch.recording() as log:
        f = jax.jit(lambda *a: spec.fn(*a, impl="pallas", **options))
        jax.block_until_ready(f(*args))
    for _ in range(calls - 1):
        jax.block_until_ready(f(*args))
    print(case, [entry.config for entry in log], flush=True)


if __name__ == "__main__":
    for c in sys.argv[1:]:
        run(c)
