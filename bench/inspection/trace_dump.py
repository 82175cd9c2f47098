"""``python -m bench.inspection.trace_dump OUT.json``: record the device events of a few k3pallas and XLA
calls as JSON (planes, lines, events), to check the trace parser against a real GPU trace."""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp

import k3pallas as kp


def main(path):
    q = jnp.ones((4096, 1536), jnp.bfloat16)
    kv = jnp.ones((4096, 512), jnp.bfloat16)
    wq, wkv = jnp.ones((1536,), jnp.bfloat16), jnp.ones((512,), jnp.bfloat16)
    fused = jax.jit(lambda *a: kp.fused_q_kv_rmsnorm(*a))
    xla = jax.jit(lambda *a: kp.fused_q_kv_rmsnorm(*a, impl="reference"))
    copy = jax.jit(lambda a: a.copy())
    for f, args in ((fused, (q, kv, wq, wkv)), (xla, (q, kv, wq, wkv)), (copy, (q,))):
        jax.block_until_ready(f(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for f, args in ((fused, (q, kv, wq, wkv)), (xla, (q, kv, wq, wkv)), (copy, (q,))):
                for _ in range(2):
                    out = f(*args)
                jax.block_until_ready(out)
        data = jax.profiler.ProfileData.from_file(
            glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0])
        planes = []
        for plane in data.planes:
            lines = []
            for line in plane.lines:
                events = [{"name": e.name, "start_ns": e.start_ns, "duration_ns": e.duration_ns}
                          for e in list(line.events)[:200]]
                lines.append({"name": line.name, "events": events})
            planes.append({"name": plane.name, "lines": lines})
    with open(path, "w") as f:
        json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                   "calls": ["fused x2", "xla x2", "copy x2"], "planes": planes}, f, indent=1)
    for p in planes:
        print(p["name"], [(ln["name"], len(ln["events"])) for ln in p["lines"]])


if __name__ == "__main__":
    main(sys.argv[1])
