#!/usr/bin/env bash
# The developers' NVIDIA session helper (H200 timeouts, nvidia-smi, ncu). A GPU owner's one
# command, AMD or NVIDIA, is `python -m bench.device_report` (install, versions, self-check, GPU
# tests, headline benchmark, one archive).
# One GPU-machine session: GPU tests, a trace sample, the benchmark and the launch-config sweep,
# all written under $OUT (the device tool brings that folder back). Usage, on the GPU machine:
#   OUT=/some/dir bash bench/gpu_session.sh [tests] [bench] [tune] [trace] [hlo] [model] [sharded] [peers] [ncu] [gemm] [full]
# e.g. a sweep, then the benchmark and the peers on its table, in one call:
#   TUNE_ARGS="--ops add_rmsnorm --write" TUNE_APPLY=1 BENCH_ARGS="--ops add_rmsnorm" ... tune bench peers
# ncu: NCU_CASES="OP:CONFIG:T ..."
# (Nsight Compute on each case's first kernel launch, bench.inspection.profile_cases; all into ncu.txt).
# tests: 378 GPU tests, 153 s on the H200 with 12 pytest-xdist workers (one test then ran out of
# device memory: keep the default 6); the whole benchmark ~26 min: several calls (--ops, --tokens;
# `python -m bench --merge` joins their results.json).
# The GPU machine's copy of .git can be older than the tree sent: pass the commit measured, e.g.
#   K3PALLAS_GIT_COMMIT=<git rev-parse --short HEAD, here> (bench/run.py records it).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT}
steps=${*:-tests trace bench tune}
BENCH_ARGS=${BENCH_ARGS:-}
TUNE_ARGS=${TUNE_ARGS:-}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; python3 -c 'import jax, jaxlib, sys; print(sys.version.split()[0], jax.__version__, jaxlib.__version__, jax.devices())'; } 2>&1 | tee "$OUT/env.txt"
for step in $steps; do
  start=$(date +%s)
  case $step in
    # With pytest-xdist (not on the GPU image: carry its wheels and execnet's), -n 6 runs the
    # compile-bound suite in 86 s instead of 398 (no preallocation: the workers share the GPU).
    tests) xdist=; python3 -c 'import xdist' 2>/dev/null && xdist="-n ${TESTS_WORKERS:-6}"
           XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -m gpu tests -q -p no:cacheprovider -rfEs $xdist 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    trace) timeout 60 python3 -m bench.inspection.trace_dump "$OUT/trace_sample.json" 2>&1 | tail -8 ;;
    bench) timeout ${BENCH_TIMEOUT:-300} python3 -m bench --out "$OUT" $BENCH_ARGS 2>&1 | tee "$OUT/bench.log" | grep -v '^\[' | tail -60 ;;
    # TUNE_APPLY=1 (with --write in TUNE_ARGS): the new table replaces the tree's, so the steps
    # after it in the same call (bench, peers) measure the tuned configs.
    tune) timeout ${TUNE_TIMEOUT:-560} python3 -m bench.tune --out "$OUT" $TUNE_ARGS 2>"$OUT/tune.log" | tail -40
          [[ ${TUNE_APPLY:-0} == 1 && -f "$OUT/tuned_configs.json" ]] && cp "$OUT/tuned_configs.json" k3pallas/kernels/tuned_configs.json && echo "applied $OUT/tuned_configs.json" ;;
    hlo) timeout 180 python3 -m bench.inspection.hlo_report --out "$OUT" 2>"$OUT/hlo_report.log" | tail -12 ;;
    model) timeout 180 python3 -m k3pallas.models.kimi_k3 --tokens ${MODEL_TOKENS:-4096} --impl pallas 2>&1 | grep -v Warning | tee "$OUT/model_block.log" ;;
    ncu) for c in ${NCU_CASES:-}; do
           op=${c#copy:}; op=${op%%:*}; k="regex:k3pallas_${op}\$"; [[ $c == copy:* ]] && k="regex:xor"
           echo "=== $c" >>"$OUT/ncu.txt"
           # No preallocation: ncu saves and restores the process's device memory for each replay pass.
           XLA_PYTHON_CLIENT_PREALLOCATE=false timeout --kill-after=10 ${NCU_TIMEOUT:-90} ncu -k "$k" --launch-count 1 --section SpeedOfLight \
             --section MemoryWorkloadAnalysis --section WarpStateStats --section InstructionStats \
             --section LaunchStats --section Occupancy python3 -m bench.inspection.profile_cases "$c" >>"$OUT/ncu.txt" 2>&1
           echo "ncu $c: rc $?"
         done ;;
    # The scaled FP8 GEMM: its config sweep written into the tree's table (both matrix-core
    # forms, GemmConfig.mma_acc), its GPU tests (the K = 7168 error printed), the linear op's
    # benchmark on that table, and (VLLM_SOURCE: a copy of vLLM's fp8_utils.py; VLLM_CONFIGS:
    # its configs folder) vLLM's Triton block-scaled GEMM beside it.
    # On an H100 the sweep of all six configs took 381 s (with the prefetch and deep-pipeline
    # candidates; the decode-only `--tokens 1,16 --up-to 16` with the unrolled ones 207 s), the
    # tests 50-70 s, the benchmark 208 s, the peer 46 s: more than one call holds, so
    # GEMM_SWEEP=0 skips the sweep (the tree's table) and TUNE_ARGS narrows it. The device brings
    # back 8 files at most: the sweep's points (tune.json) rebuild the table with
    # bench.tune.write_table if its file is lost.
    gemm) [[ ${GEMM_SWEEP:-1} == 1 ]] && timeout ${TUNE_TIMEOUT:-420} python3 -m bench.tune --gemm --write --calls 10 --out "$OUT" $TUNE_ARGS 2>/dev/null | tail -34
          [[ -f "$OUT/tuned_configs.json" ]] && cp "$OUT/tuned_configs.json" k3pallas/kernels/tuned_configs.json
          XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TESTS_TIMEOUT:-90} python3 -m pytest -m gpu tests/test_gemm.py -q -s -p no:cacheprovider -rfEs 2>&1 | tee "$OUT/gpu_gemm_tests.log" | tail -14
          timeout ${BENCH_TIMEOUT:-200} python3 -m bench --ops linear --out "$OUT" $BENCH_ARGS 2>/dev/null | grep "^|" | tail -60
          rm -f "$OUT/results.png" "$OUT/tune.md"  # tune.json holds its points (bench.tune.gemm_markdown)
          [[ -n "${VLLM_SOURCE:-}" ]] && timeout ${PEERS_TIMEOUT:-60} python3 -m bench.inspection.beside_gemm --vllm-source "$VLLM_SOURCE" ${VLLM_CONFIGS:+--vllm-configs "$VLLM_CONFIGS"} --out "$OUT" 2>/dev/null | tail -30 ;;
    # The full suite (bench.cases.FULL, about 11-12 min on an H100) at one commit over two
    # calls: FULL_RESUME=<the last call's full_<card>.json, carried in an ignored folder>
    # continues it (bench/run.py refuses another commit or device). CARD names the report
    # (default: h100 / h200 from nvidia-smi's name, else gpu).
    full) card=${CARD:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oi 'h[12]00' | tr A-Z a-z)}
          timeout ${FULL_TIMEOUT:-540} python3 -m bench --suite full --name "full_${card:-gpu}" --out "$OUT" ${FULL_RESUME:+--resume "$FULL_RESUME"} 2>"$OUT/full.log" | grep "^|" | tail -3
          rm -f "$OUT"/full_*.png ;;
    sharded) timeout ${SHARDED_TIMEOUT:-300} python3 -m bench.inspection.sharded --out "$OUT" 2>"$OUT/sharded.log" | tail -30 ;;
    # The residual add + norm beside Liger's and flash-linear-attention's (their wheels in .whl:
    # carry it; installed under /tmp/site with the image's torch and triton).
    peers) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/liger_kernel-*.whl .whl/fla_core-*.whl \
             && PYTHONPATH="$PYTHONPATH:/tmp/site" timeout ${PEERS_TIMEOUT:-300} python3 -m bench.inspection.beside_add_norm --out "$OUT" 2>"$OUT/peers.log" | tail -30 ;;
  esac
  echo "== $step took $(( $(date +%s) - start )) s"
done
