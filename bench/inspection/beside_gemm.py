"""``python -m bench.inspection.beside_gemm --vllm-source FILE``: the group-FP8 GEMM beside vLLM's
Triton block-scaled GEMM (``_w8a8_triton_block_scaled_mm``), in ONE process with ONE clock.

vLLM is not a dependency and none of its code is in this repository: ``--vllm-source`` names a
copy of vLLM's ``vllm/model_executor/layers/quantization/utils/fp8_utils.py`` (or any file
holding that kernel); the kernel's function is read from it with ``ast`` and compiled with the
machine's triton, then launched from torch as vLLM's ``w8a8_triton_block_scaled_mm`` launches it:
one program per ``[BLOCK_M, BLOCK_N]`` tile in ``GROUP_SIZE_M`` order, with the config of vLLM's
tuned JSON for (N, K, device) when ``--vllm-configs`` names vLLM's ``configs`` folder and it has
the file, else vLLM's default (64, 128, 128, group 32, 4 warps, 2 stages). Both get the same
operands (``bench.ops.linear_operands``, a weight per input set, rotated as the benchmark does),
the outputs are compared with each other and the float64 oracle, and both are timed from the same
``jax.profiler`` trace (CUPTI records torch's kernels too). Writes ``beside_gemm.md`` / ``.json``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

from bench import cases, ops as bench_ops, timing  # noqa: E402
from bench.report import git_commit, write_report  # noqa: E402

KERNEL = "_w8a8_triton_block_scaled_mm"
DEFAULT_CONFIG = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32,
                  "num_warps": 4, "num_stages": 2}  # vLLM's, where it has no tuned file


def load_kernel(path: str):
    """vLLM's kernel function from ``path``, compiled with this machine's triton."""
    import triton
    import triton.language as tl

    with open(path) as f:
        source = f.read()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == KERNEL:
            namespace = {"triton": triton, "tl": tl}
            exec(compile(ast.Module([node], []), path, "exec"), namespace)  # noqa: S102
            return namespace[KERNEL]
    raise SystemExit(f"beside_gemm: no function {KERNEL} in {path}")


def vllm_config(configs_dir, device_name: str, n: int, k: int, m: int):
    """(config, source): vLLM's tuned entry nearest to ``m`` for (N, K, device), or its default."""
    if configs_dir:
        name = (f"N={n},K={k},device_name={device_name.replace(' ', '_')},dtype=fp8_w8a8,"
                "block_shape=[128,128].json")
        path = os.path.join(configs_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                table = {int(key): v for key, v in json.load(f).items()}
            return table[min(table, key=lambda x: abs(x - m))], "tuned"
    return DEFAULT_CONFIG, "default"


def launch(kernel, a, b, a_s, b_s, out, cfg):
    """vLLM's launch of its kernel: ``a [M, K]``, ``b [N, K]`` fp8, ``a_s [M, K/128]``,
    ``b_s [N/128, K/128]`` float32, ``out [M, N]``."""
    import triton

    m, k = a.shape
    n = b.shape[0]
    grid = (triton.cdiv(m, cfg["BLOCK_SIZE_M"]) * triton.cdiv(n, cfg["BLOCK_SIZE_N"]),)
    kernel[grid](a, b, out, a_s, b_s, m, n, k, 128, 128, a.stride(0), a.stride(1), b.stride(1),
                 b.stride(0), out.stride(0), out.stride(1), a_s.stride(0), a_s.stride(1),
                 b_s.stride(1), b_s.stride(0), **cfg)
    return out


def _torch(a):
    import numpy as np
    import torch

    a = np.asarray(a)
    if a.dtype.itemsize == 1:  # fp8 codes: the bytes, viewed as torch's e4m3fn
        return torch.from_numpy(a.view(np.uint8).copy()).cuda().view(torch.float8_e4m3fn)
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.inspection.beside_gemm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-source", required=True, help="a file holding vLLM's " + KERNEL)
    p.add_argument("--vllm-configs", default=None, help="vLLM's tuned-config folder (optional)")
    p.add_argument("--configs", default=",".join(c for c in cases.LINEAR if c.endswith("fp8_group128")))
    p.add_argument("--tokens", default="1,7,16,64,512,4096")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--out", default=os.path.join("bench", "out"))
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import k3pallas as kp
    from k3pallas import platform

    target = platform.current_target()
    if not target.is_gpu or target.backend != "cuda":
        raise SystemExit("beside_gemm needs an NVIDIA GPU (vLLM's kernel runs from torch)")
    kernel = load_kernel(args.vllm_source)
    device = torch.cuda.get_device_name()
    rows = []
    for name in args.configs.split(","):
        cfg = cases.LINEAR[name]
        for t in [int(x) for x in args.tokens.split(",")]:
            count = bench_ops.rotation_sets(cfg["k"] * cfg["n"], bench_ops.cache_bytes(target))
            sets = [bench_ops.linear_operands(cfg, t, s) for s in range(count)]
            ours = jax.jit(lambda qa, qw, x, w: kp.linear(qa, qw, impl="pallas"))
            tsets = [(_torch(qa.data), _torch(qw.data), _torch(qa.scale), _torch(qw.scale),
                      torch.empty((t, cfg["n"]), dtype=torch.bfloat16, device="cuda"))
                     for qa, qw, _, _ in sets]
            vcfg, source = vllm_config(args.vllm_configs, device, cfg["n"], cfg["k"], t)
            ref = (np.asarray(sets[0][0].dequantize(), np.float64)
                   @ np.asarray(sets[0][1].dequantize(), np.float64))
            mine = np.asarray(ours(*sets[0]).astype(jnp.float32), np.float64)
            theirs = launch(kernel, *tsets[0], vcfg).float().cpu().numpy().astype(np.float64)
            norm = np.linalg.norm(ref)
            ev = timing.traced_events(lambda *a: launch(kernel, *a, vcfg), tsets, args.calls, 3,
                                      sync=lambda _: torch.cuda.synchronize())
            vllm_us = statistics.median(timing.per_call_times(ev, args.calls)[0]) / 1e3
            ours_us = timing.time_device(ours, sets, n_calls=args.calls).median_us
            row = {"config": name, "tokens": t, "k3pallas_us": ours_us, "vllm_us": vllm_us,
                   "vllm_config": vcfg, "vllm_config_source": source,
                   "k3pallas_rel_err": float(np.linalg.norm(mine - ref) / norm),
                   "vllm_rel_err": float(np.linalg.norm(theirs - ref) / norm)}
            rows.append(row)
            print(f"{name} T={t}: k3pallas {ours_us:.2f} us, vLLM {vllm_us:.2f} us ({source}), "
                  f"vLLM / k3pallas {vllm_us / ours_us:.2f}", file=sys.stderr, flush=True)
    commit = git_commit()
    md = [f"# The group-FP8 GEMM beside vLLM's Triton block-scaled GEMM, {target.device_kind}", "",
          f"One process, one clock (`python -m bench.inspection.beside_gemm`, jax {jax.__version__}, "
          f"torch {torch.__version__}, commit {commit or '?'}); device time per call (median), bf16 output; a weight per "
          "input set. `err`: ||out - ref|| / ||ref|| against the float64 product.", "",
          "| config | T | k3pallas us | vLLM us (config) | vLLM / k3pallas | err k3pallas / vLLM |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['config']} | {r['tokens']} | {r['k3pallas_us']:.2f} | {r['vllm_us']:.2f} "
                  f"({r['vllm_config_source']}) | {r['vllm_us'] / r['k3pallas_us']:.2f} | "
                  f"{r['k3pallas_rel_err']:.2e} / {r['vllm_rel_err']:.2e} |")
    text = "\n".join(md)
    write_report(args.out, "beside_gemm", text, {"device": device, "commit": commit, "rows": rows})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
