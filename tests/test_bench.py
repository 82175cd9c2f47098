"""The benchmark: the trace parser on synthetic and recorded events, and the quick mode end to
end on the CPU (what a new user without a GPU runs first)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from bench import timing
from bench.inspection import nv_xla

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plane(name, lines):
    return types.SimpleNamespace(name=name, lines=[
        types.SimpleNamespace(name=ln, events=[types.SimpleNamespace(name=n, start_ns=s, duration_ns=d)
                                               for n, s, d in evs]) for ln, evs in lines.items()])


def test_parser_synthetic():
    planes = [
        _plane("/host:CPU", {"python": [("x", 0, 5)]}),
        _plane("/device:GPU:0", {
            "Stream #14(Compute)": [("k_a", 100, 10), ("k_b", 120, 5), ("k_a", 300, 12), ("k_b", 320, 6)],
            "XLA Ops": [("fusion", 100, 40)],  # an aggregate line: not counted again
        }),
    ]
    events = timing.device_events(planes)
    assert [e.name for e in events] == ["k_a", "k_b", "k_a", "k_b"]
    times, k = timing.per_call_times(events, 2)
    assert k == 2 and times == [15, 18]
    with pytest.raises(ValueError, match="do not split"):
        timing.per_call_times(events, 3)
    with pytest.raises(ValueError, match="other kernels"):
        timing.per_call_times([events[0], events[1], events[3], events[2]], 2)


def test_parser_recorded_h200_trace():
    """A trace recorded on the H200 (bench/inspection/trace_dump.py): 2 calls each of the fused kernel, the
    XLA reference (2 fusions per call) and a copy (MemcpyD2D) on one stream line."""
    with open(os.path.join(ROOT, "tests", "data", "h200_trace_sample.json")) as f:
        rec = json.load(f)
    planes = [_plane(p["name"], {ln["name"]: [(e["name"], e["start_ns"], e["duration_ns"])
                                             for e in ln["events"]] for ln in p["lines"]})
              for p in rec["planes"]]
    events = timing.device_events(planes)
    names = [e.name for e in events]
    assert names[:2] == ["k3pallas_fused_q_kv_rmsnorm"] * 2
    assert names[-2:] == ["MemcpyD2D"] * 2
    fused_times, k = timing.per_call_times(events[:2], 2)
    assert k == 1 and all(5_000 < t < 20_000 for t in fused_times)
    xla_times, k = timing.per_call_times(events[2:6], 2)
    assert k == 2


@pytest.mark.slow
def test_quick_mode_end_to_end(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(out),
                           "--ops", "fused_q_kv_rmsnorm,rmsnorm_gated_fp8_per_token"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "WALL-CLOCK" in proc.stdout  # a CPU run says what its numbers are
    data = json.loads((out / "results.json").read_text())
    env = data["environment"]
    for key in ("jax", "backend", "device_kind", "arch", "dtype", "impl", "clock", "git_commit"):
        assert key in env
    assert env["clock"] == "wall" and env["impl"] == "interpret"
    recs = data["records"]
    assert {r["op"] for r in recs} == {"fused_q_kv_rmsnorm", "rmsnorm_gated_fp8_per_token"}
    assert {r["tokens"] for r in recs} == {1, 64}
    # No encoder column on the CPU: interpret mode's auto is the encoder already.
    assert {r["variant"] for r in recs} == {"k3pallas", "unfused", "xla", "copy"}
    assert {r["variant"] for r in recs if r["op"] == "fused_q_kv_rmsnorm"} == {"k3pallas", "unfused", "xla", "copy"}
    # The FP8 conversion decisions of the run: interpret mode's auto is the encoder.
    assert env["fp8_cast_decisions"] and all(not d["native"] and d["target"] == "interpret"
                                             for d in env["fp8_cast_decisions"])
    for r in recs:
        for key in ("median_us", "min_us", "kernels_per_call", "bytes", "gb_per_s", "pct_of_copy",
                    "config", "dtype", "clock"):
            assert key in r, key
        assert r["median_us"] > 0 and r["bytes"] > 0
    md = (out / "results.md").read_text()
    assert md.startswith("# k3pallas benchmark")
    assert not (out / "results.png").exists()  # no bandwidth plot of CPU wall-clock numbers
    header = next(line for line in md.splitlines() if line.startswith("| T |"))
    assert "% copy" not in header and "GB/s" not in header  # meaningless on the CPU
    assert "CPU wall-clock" in proc.stderr and "s left]" in proc.stderr  # progress with time left
    # The reports are rewritten as the run goes; this run finished, so it is not marked partial.
    assert env["cases_done"] == env["cases"] == 4 and "PARTIAL" not in md
    from bench import run as bench_run

    first = [r for r in recs if (r["op"], r["tokens"]) == (recs[0]["op"], recs[0]["tokens"])]
    cut = bench_run.markdown(first, {**env, "cases_done": 1})
    assert "PARTIAL RUN: 1 of 4 cases" in cut
    # --merge: runs split over several device calls as one report, each run's commit kept.
    other = dict(data, environment={**env, "git_commit": "abc1234", "cases": 2, "cases_done": 1})
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert bench_run.main(["--merge", str(out / "results.json"), str(tmp_path / "other.json"),
                           "--out", str(tmp_path), "--name", "merged"]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert len(merged["records"]) == 2 * len(recs)
    runs = merged["environment"]["runs"]
    assert [r["git_commit"] for r in runs] == [env["git_commit"], "abc1234"]
    md = (tmp_path / "merged.md").read_text()
    assert "abc1234" in md and "PARTIAL RUN: 5 of 6 cases" in md


def test_residual_stream_updates_in_place_and_keeps_the_sets():
    """bench.ops.ResidualStream: each call continues its set's residual stream (the new residual,
    and y as the next x unquantized), from a copy, so the sets themselves stay as made."""
    import jax.numpy as jnp
    import numpy as np

    from bench import ops as bench_ops

    def fn(x, r):
        s = x + r
        return s * 0.5, s
    sets = [(jnp.ones((2, 4)), jnp.full((2, 4), 2.0)), (jnp.zeros((2, 4)), jnp.ones((2, 4)))]
    stream = bench_ops.ResidualStream(fn, quantized=False)
    y, r = stream(*sets[0])
    assert np.all(np.asarray(r) == 3.0) and np.all(np.asarray(y) == 1.5)
    y, r = stream(*sets[0])  # x <- 1.5, r <- 3: the stream goes on
    assert np.all(np.asarray(r) == 4.5)
    _, r1 = stream(*sets[1])  # another set: its own stream
    assert np.all(np.asarray(r1) == 1.0)
    assert np.all(np.asarray(sets[0][0]) == 1.0) and np.all(np.asarray(sets[0][1]) == 2.0)
    quantized = bench_ops.ResidualStream(fn, quantized=True)
    quantized(*sets[0])
    _, r = quantized(*sets[0])  # x stays the set's own: r = 1 + (1 + 2)
    assert np.all(np.asarray(r) == 4.0)
    # The benchmark and the launch-config sweep compile the residual add so, and only it.
    assert isinstance(bench_ops.jit_for("add_rmsnorm", "mxfp8")(fn), bench_ops.ResidualStream)
    assert not isinstance(bench_ops.jit_for("rmsnorm", None)(fn), bench_ops.ResidualStream)
    from bench import tune

    jit = tune._op_fn("add_rmsnorm", "hidden-4096", "bfloat16")[3]
    assert isinstance(jit(fn), bench_ops.ResidualStream)


def test_tune_table_and_merge():
    from bench import tune

    points = [{"op": "a", "row_elems": 8, "tokens": t, "best": {"rows": 1, "warps": w, "split": s}}
              for t, w, s in ((1, 8, 4), (64, 4, 1), (4096, 2, 1))]
    new = tune.table(points)
    assert new == {"a": [[8, 8, 1, 8, 1, 4], [512, 8, 1, 4, 1], [2**31, 8, 1, 2, 1]]}
    old = {"a": [[99, 8, 2, 2, 1], [99, 16, 4, 4, 1]], "b": [[1, 1, 1, 1, 1]]}
    merged = tune.merge(old, new)
    assert merged["b"] == old["b"]
    assert [e for e in merged["a"] if e[1] == 16] == [[99, 16, 4, 4, 1]]
    assert [e for e in merged["a"] if e[1] == 8] == new["a"]
    # A decode-range sweep (up to 256 tokens) replaces only the entries of its range.
    decode = tune.table(points[:2], up_to=256)
    assert decode == {"a": [[8, 8, 1, 8, 1, 4], [256, 8, 1, 4, 1]]}
    merged = tune.merge({"a": [[22, 8, 1, 1, 1], [256, 8, 2, 2, 1], [1448, 8, 1, 2, 1]]}, decode)
    assert merged["a"] == [[8, 8, 1, 8, 1, 4], [256, 8, 1, 4, 1], [1448, 8, 1, 2, 1]]


def test_tune_write_table_names_every_device_of_an_arch(tmp_path, monkeypatch):
    """A partial sweep on another card of the same arch keeps the entries and the name of the
    card that wrote the others."""
    from bench import tune

    shipped = tmp_path / "shipped.json"
    shipped.write_text(json.dumps({"configs": {"sm_90": {"a": [[9, 8, 1, 4, 1]]}},
                                   "sources": {"sm_90": {"device_kind": "NVIDIA H200"}}}))
    monkeypatch.setattr(tune.launch, "TUNED_PATH", str(shipped))
    args = types.SimpleNamespace(up_to=4, dtype="bfloat16")
    point = {"op": "a", "row_elems": 8, "tokens": 1, "best": {"rows": 1, "warps": 2}}
    for _ in range(2):  # written twice: the name once
        tune.write_table(str(tmp_path / "out.json"),
                         types.SimpleNamespace(arch="sm_90", device_kind="NVIDIA H100"), [point], args)
        shipped.write_text((tmp_path / "out.json").read_text())
    data = json.loads(shipped.read_text())
    assert data["sources"]["sm_90"]["device_kind"] == "NVIDIA H200, NVIDIA H100"
    assert data["configs"]["sm_90"]["a"] == [[4, 8, 1, 2, 1], [9, 8, 1, 4, 1]]


@pytest.mark.slow
def test_device_report_end_to_end_without_a_gpu(tmp_path):
    """The GPU owner's one command, here with nothing to install and no GPU: it records what jax
    and k3pallas see and packs one archive."""
    import tarfile

    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "bench.device_report", "--install", "none",
                           "--no-tests", "--bench", "none", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    archive = proc.stdout.strip().splitlines()[-1].split("archive: ")[1]
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {"report/report.json", "report/jax_view.json", "report/jax_view.log"} <= names
    view = json.loads((out / "jax_view.json").read_text())
    assert view["devices"] and view["devices"][0]["default_fp8"] == "float8_e4m3fn"
    report = json.loads((out / "report.json").read_text())
    assert report["steps"]["identify_and_self_check"]["rc"] == 0 and "machine" in report


def test_device_report_ends_only_its_own_process_group(tmp_path):
    from bench import device_report

    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        r = device_report.run([sys.executable, "-c", "import time; time.sleep(60)"],
                              str(tmp_path / "log.txt"), timeout=1)
        assert r["timed_out"] and r["rc"] != 0
        assert bystander.poll() is None  # a process it did not start is untouched
    finally:
        bystander.kill()
        bystander.wait()


# bench.inspection.nv_xla: the parsers on lines as ptxas 12.9 and cuobjdump print them, and the
# whole tool where its environment (python -m bench.inspection.nv_xla --setup) exists.
_PTXAS_LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k3pallas_rmsnorm_gated_fp8_per_token' for 'sm_90a'
ptxas info    : Function properties for k3pallas_rmsnorm_gated_fp8_per_token
    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 127 registers, used 1 barriers
ptxas info    : Compiling entry function 'other' for 'sm_90a'
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 16 registers
"""
_SASS = """
        Function : k3pallas_x
        /*00f0*/                   LDG.E.128 R52, desc[UR6][R60.64] ;                   /* 0x000 */
        /*0340*/                   FSETP.GEU.AND P0, PT, R22, -126, PT ;                /* 0xc2f */
        /*0370*/              @!P0 FMUL R22, R22, 0.5 ;                                 /* 0x3f0 */
        /*0380*/                   MUFU.EX2 R80, R22 ;                                  /* 0x000 */
        /*03b0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;                        /* 0x000 */
        /*0430*/                   FSETP.GEU.AND P3, PT, |R81|, 1.175494350822287508e-38, PT ; /* 0x0 */
        /*04c0*/                   MUFU.RSQ R81, R81 ;                                  /* 0x000 */
        /*04d0*/                   FSETP.GEU.AND P2, PT, R77, R3, PT ;                  /* 0xc2f */
        /*0500*/                   SHFL.BFLY PT, R3, R2, 0x1, 0x1f ;                    /* 0x000 */
        /*0510*/                   STG.E.64 desc[UR6][R4.64], R8 ;                      /* 0x000 */
"""


def test_nv_xla_parsers():
    assert nv_xla.parse_ptxas(_PTXAS_LOG) == {
        "k3pallas_rmsnorm_gated_fp8_per_token": {"registers": 127, "spill_stores": 8, "spill_loads": 4},
        "other": {"registers": 16, "spill_stores": 0, "spill_loads": 0}}
    s = nv_xla.sass_stats(_SASS)
    assert s["instructions"] == 10
    assert (s["LDG"], s["STG"], s["BAR"], s["SHFL"], s["MUFU.EX2"], s["MUFU.RSQ"]) == (1, 1, 1, 1, 1, 1)
    assert s["denormal_guards"] == 2  # the -126 and FLT_MIN checks, not the plain compare
    spec = b"\0# proto-message: stream_executor.GpuTargetConfigProto\nname: \"A\"\n" \
           b"device_description_str: \"NVIDIA H200 141GB HBM3e\"\n\0junk"
    assert 'name: "A"' in nv_xla.target_config(b"xx\0other\0" + spec)
    with pytest.raises(RuntimeError, match="no GpuTargetConfigProto"):
        nv_xla.target_config(b"nothing here")


needs_nv_xla = pytest.mark.skipif(
    not os.path.exists(os.path.join(nv_xla.env_dir(), "env.json")),
    reason="no nv_xla environment (python -m bench.inspection.nv_xla --setup)")


@pytest.mark.slow  # a compile in the nv_xla environment's own process
@needs_nv_xla
def test_nv_xla_compiles_for_a_deviceless_h200():
    rows = nv_xla.kernels("rmsnorm_gated_fp8_per_token:kimi-linear-kda:256", nv_xla.load_env())
    (r,) = rows
    assert r["kernel"] == "k3pallas_rmsnorm_gated_fp8_per_token", r
    assert 16 <= r["registers"] <= 255 and r["spill_stores"] == 0
    assert r["instructions"] > 100 and r["LDG"] >= 2 and r["STG"] >= 1 and r["MUFU.EX2"] >= 1


@pytest.mark.slow  # compiles in the nv_xla environment's own process
@needs_nv_xla
@pytest.mark.parametrize("case", ["add_rmsnorm_fp8_per_token:deepseek-v3-hidden:1",
                                  "add_rmsnorm_mx:deepseek-v3-hidden-mxfp8:1"])
def test_residual_add_codes_share_the_residual_layout(monkeypatch, case):
    """At 8 warps a thread holds 32 elements of the 7168 row: the codes' store and the new
    residual's take one layout (``common.codes_beside``), so nothing converts through shared
    memory and the barriers are the reductions' (3; with the codes' own 16-byte layout, 11)."""
    monkeypatch.setenv("K3PALLAS_NV_XLA_CONFIG", "1,8")
    (r,) = nv_xla.kernels(case, nv_xla.load_env())
    assert r["BAR"] <= 3 and r["STS"] <= 2, r


@pytest.mark.slow  # compiles in the nv_xla environment's own process
@needs_nv_xla
def test_gemm_fp8_matrix_instructions_on_the_h200(monkeypatch):
    """The GEMM as XLA's CUDA backend compiles it for sm_90a: by default (Pallas' FP8 dot asks
    for float32 promotion after every instruction) Triton converts the codes to float16 for
    mma.sync (F2FP, HMMA); with ``GemmConfig.mma_acc = 128`` it takes Hopper's FP8 wgmma
    (QGMMA), no conversion; neither spills."""
    case = "linear:deepseek-v3-mlp-tp8-fp8_group128:4096"
    monkeypatch.setenv("K3PALLAS_NV_XLA_GEMM", "128,128,128,8,3,0")
    (d,) = nv_xla.kernels(case, nv_xla.load_env())
    assert d["HMMA"] > 0 and d["QGMMA"] == 0 and d["spill_stores"] == 0, d
    monkeypatch.setenv("K3PALLAS_NV_XLA_GEMM", "128,128,128,8,3,0,128")
    (r,) = nv_xla.kernels(case, nv_xla.load_env())
    assert r["kernel"].endswith("_acc128") and r["QGMMA"] > 0 and r["HMMA"] == 0, r
    # F2FP: the bf16 output's packing in both; the codes' float16 conversions in the default only.
    assert r["F2FP"] < d["F2FP"] and r["spill_stores"] == 0, (r, d)


def test_beside_qkv_design_labels():
    """``--designs`` of bench.inspection.beside_qkv (the tool itself needs torch and a GPU)."""
    from bench.inspection import beside_qkv

    assert beside_qkv._design("w4") == (4, False, False)
    assert beside_qkv._design("w8+pdl") == (8, True, False)
    assert beside_qkv._design("w4+pdl+graph") == (4, True, True)
    assert beside_qkv._design("w2+graph") == (2, False, True)
    for bad in ("4", "w", "wx", "w4+fast", "w4+"):
        with pytest.raises(SystemExit, match="--designs"):
            beside_qkv._design(bad)


def _ncu_csv(path, kernels, device="NVIDIA H200"):
    """An ncu ``--csv --page details`` file as ncu 2025 writes it (the app's stdout mixed in)."""
    head = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
            "Block Size", "Grid Size", "Device", "CC", "Section Name", "Metric Name",
            "Metric Unit", "Metric Value"]
    lines = ["==PROF== Connected to process 1 (python3)", f"device: {device}",
             ",".join(f'"{h}"' for h in head)]
    for i, (name, metrics) in enumerate(kernels):
        for metric, (unit, value) in metrics.items():
            row = [str(i), "1", "python3", "h", name, "1", "7", "(512, 1, 1)", "(16384, 1, 1)",
                   "0", "9.0", "S", metric, unit, value]
            lines.append(",".join(f'"{v}"' for v in row))
    path.write_text("\n".join(lines) + "\n")


def test_ncu_add_norm_report(tmp_path):
    """bench.inspection.ncu_add_norm's table: the second launch of each variant, in ORDER, its
    metrics with their units; a file with another number of kernels is refused."""
    from bench.inspection import ncu_add_norm as n

    kernels = []
    for j, name in enumerate(n.ORDER):
        kname = {"liger": "_fused_add_rms_norm_forward_kernel", "row_copy": "row_copy2"}.get(
            name, "k3pallas_add_rmsnorm")
        for launch in range(2):
            kernels.append((kname, {"Duration": ("ns", f"{1000 * j + launch}"),
                                    "DRAM Throughput": ("%", f"{80 + j}.5"),
                                    "Function Cache Configuration": ("", "CachePreferShared")}))
    _ncu_csv(tmp_path / "ncu.csv", kernels)
    table = n.report(str(tmp_path / "ncu.csv"))
    assert "NVIDIA H200" in table.splitlines()[0]
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in table.splitlines()
            if line.startswith("| ")}
    assert rows["metric"][-1].rstrip(" |") == "row_copy"
    assert [c.rstrip(" |") for c in rows["Duration"]] == [f"{1000 * j + 1} ns" for j in range(5)]
    assert [c.rstrip(" |") for c in rows["DRAM Throughput"]] == [f"{80 + j}.5 %" for j in range(5)]
    assert "`row_copy2`" in rows["kernel"][-1]
    _ncu_csv(tmp_path / "short.csv", kernels[:-1])
    with pytest.raises(ValueError, match="9 kernels profiled; 10 expected"):
        n.report(str(tmp_path / "short.csv"))


def test_resident_table():
    """bench.inspection.resident's table: per T, each case's resident time against the first
    case of that T and against its own rotated time; needs a GPU to measure (refused here)."""
    from bench.inspection import resident

    rows = [{"op": op, "config": "c", "tokens": t, "input_mb": 28.0, "resident": res,
             "rotated": 2 * res} for t in (1024, 2048) for op, res in (("plain", 10.0 * t / 1024),
                                                                        ("mxfp4", 15.0 * t / 1024))]
    table = resident.markdown(rows, "NVIDIA H100 80GB HBM3")
    lines = [line for line in table.splitlines() if line.startswith(("| plain", "| mxfp4"))]
    assert ([line.rstrip(" |").split(" | ")[-2:] for line in lines]
            == [["0.50", "1.00"], ["0.50", "1.50"]] * 2)
    if resident.jax.default_backend() != "gpu":
        assert resident.main(["--tokens", "8"]) == 2


def test_two_rounds_reverses_the_order(monkeypatch):
    """``timing.two_rounds`` times every entry in order, then in the opposite order, and keeps
    both rounds and their mean (the A/B and resident tools' timing)."""
    seen = []

    def fake(fn, sets, n_calls):
        seen.append(fn())
        return types.SimpleNamespace(median_us=len(seen) * 1.0)
    monkeypatch.setattr(timing, "time_device", fake)
    row = timing.two_rounds({"base": (lambda: "base", []), "tree": (lambda: "tree", [])}, 5)
    assert seen == ["base", "tree", "tree", "base"]
    assert row == {"base_a": 1.0, "tree_a": 2.0, "tree_b": 3.0, "base_b": 4.0,
                   "base": 2.5, "tree": 2.5}


def test_ir_hashes_tell_a_kernel_change_from_a_rename(tmp_path):
    """The refactoring check: the same tree gives the same hashes; a launch or IR change shows."""
    from bench.inspection import ir_hashes

    a = ir_hashes.hashes([1], ["rmsnorm", "quantize_mx"])
    # rmsnorm, MXFP4 and MXFP8 (the encoder; on gfx950 also the native conversion) per arch
    assert len(a) == 3 * 3 + 1 and ir_hashes.compare(a, a) == []
    key = next(iter(a))
    b = {**a, key: {**a[key], "num_warps": a[key]["num_warps"] * 2}}
    assert ir_hashes.compare(a, b) == [f"{key}: num_warps differ"]
    ir = "module @k3pallas_x {\n  tt.func public @k3pallas_x() loc(#loc1)\n}\n#loc1 = loc(\"f.py\":1:2)"
    assert ir_hashes.normalized(ir, "k3pallas_x") == "module @kernel {\n  tt.func public @kernel()\n}"


def test_tune_gemm_candidates_can_run():
    """Every GEMM candidate the sweep times is a valid config for its problem (block scales:
    columns and K steps within the 128-blocks), and on AMD its operand tiles (``k_unroll`` steps
    an iteration, ``num_stages - 1`` deep, as the gate's compiles of gfx942 and gfx950 report
    them) leave room for the gate's 4 waves a SIMD in gfx942's 64 KB of LDS."""
    from bench import tune
    from k3pallas.kernels import gemm
    for t in (1, 64, 512, 4096):
        for block in (True, False):
            for amd in (False, True):
                cands = tune.gemm_candidates(t, block, amd)
                assert cands and len(set(cands)) == len(cands), (t, block, amd)
                for c in cands:
                    gemm.check_config(c, a_group=128 if block else 7168,
                                      w_scale="block" if block else "channel", k=7168)
                    if amd:
                        assert tune.amd_lds_bytes(c) * 16 // c.num_warps <= 64 << 10, c
    # The LDS the gate reported (gfx942 and gfx950 alike) for three forced configs.
    C = tune.launch.GemmConfig
    assert [tune.amd_lds_bytes(C(*e)) for e in ((16, 32, 128, 4, 2, False, 0, 1, 2),
                                                (64, 64, 128, 4, 4), (16, 64, 128, 4, 6, True))] \
        == [12288, 49152, 51200]
    assert any(c.k_unroll == 4 for c in tune.gemm_candidates(64, True, False))


@pytest.mark.slow  # an end-to-end run of the tool (fast tier: 9-10 s)
def test_ab_loads_a_git_ref_as_its_own_package(tmp_path):
    """``bench.inspection.ab`` imports a git ref's ``k3pallas`` as ``k3pallas_base`` (every import
    renamed, so its kernels are its own): against HEAD the working tree gives the same bits, and
    a change in the base's kernel alone is seen as other bits."""
    import importlib

    import jax

    from bench.inspection import ab

    base = ab.base_package("HEAD", str(tmp_path))
    blocks = importlib.import_module("k3pallas_base.kernels.block_scaled")
    assert base.__file__.startswith(str(tmp_path)) and blocks.__file__.startswith(str(tmp_path))
    assert ab.run_case("add_rmsnorm_mx", "test", 3, base, impl="interpret", calls=1)["same_bits"]
    orig = blocks.block_codes

    def other_codes(y, q, trail):
        codes, scales = orig(y, q, trail)
        return codes ^ 1, scales

    blocks.block_codes = other_codes
    jax.clear_caches()  # the same case was traced above: trace the patched kernel afresh
    try:
        row = ab.run_case("add_rmsnorm_mx", "test", 3, base, impl="interpret", calls=1)
    finally:
        blocks.block_codes = orig
    assert row["same_bits"] is False and "base_a" not in row  # interpret mode: no timing


def test_ab_loads_a_folder_as_the_base(tmp_path):
    """``--base`` may name a folder holding a ``k3pallas`` package (a GPU lease has no git
    history): the copy is imported from the temporary folder, not the working tree."""
    import shutil

    from bench.inspection import ab

    shutil.copytree(os.path.join(ROOT, "k3pallas"), tmp_path / "src" / "k3pallas")
    base = ab.base_package(str(tmp_path / "src"), str(tmp_path / "into"))
    assert base.__file__.startswith(str(tmp_path / "into"))
    assert ab.run_case("rmsnorm", "test", 2, base, impl="interpret", calls=1)["same_bits"]


def test_tune_gemm_table_and_write(tmp_path, monkeypatch):
    """The GEMM sweep's winners: per (key, N, K), each measured T serves up to the geometric mean
    with the next; UE8M0 takes the float32 group's entries; a new sweep of an (N, K) replaces
    that shape's entries only; ``launch.gemm_config`` reads them."""
    from bench import tune
    from k3pallas import platform
    from k3pallas.kernels import launch
    from k3pallas.kernels.launch import GemmConfig

    def point(t, cfg, key="linear_fp8_group128", n=7168, k=1536):
        return {"key": key, "n": n, "k": k, "tokens": t, "best": {"config": cfg}}
    pts = [point(1, [16, 32, 128, 4, 4, 0]), point(16, [16, 64, 128, 4, 4, 1]),
           point(512, [64, 128, 128, 4, 3, 0])]
    table = tune.gemm_table(pts)
    assert table["linear_fp8_group128"] == table["linear_fp8_group128_ue8m0"] == [
        [4, 7168, 1536, 16, 32, 128, 4, 4, 0], [90, 7168, 1536, 16, 64, 128, 4, 4, 1],
        [2**31, 7168, 1536, 64, 128, 128, 4, 3, 0]]
    shipped = tmp_path / "shipped.json"
    shipped.write_text(json.dumps({"gemm_configs": {"sm_90": {"linear_fp8_group128": [
        [2**31, 4608, 7168, 64, 64, 128, 4, 3, 0], [2**31, 7168, 1536, 16, 16, 128, 4, 4, 0]]}}}))
    monkeypatch.setattr(tune.launch, "TUNED_PATH", str(shipped))
    args = types.SimpleNamespace(up_to=None, dtype="bfloat16", gemm=True)
    tune.write_table(str(tmp_path / "out.json"), types.SimpleNamespace(arch="sm_90", device_kind="H"),
                     pts, args)
    data = json.loads((tmp_path / "out.json").read_text())
    entries = data["gemm_configs"]["sm_90"]["linear_fp8_group128"]
    assert [4608, 7168] == entries[0][1:3] and len(entries) == 4  # the other shape kept
    monkeypatch.setattr(tune.launch, "TUNED_PATH", str(tmp_path / "out.json"))
    launch.gemm_tuned_table.cache_clear()
    try:
        sm90 = platform.target_from_name("sm_90")
        assert launch.gemm_config("linear_fp8_group128", 7, 7168, 1536, target=sm90,
                                  w_block=128).as_entry() == [16, 64, 128, 4, 4, 1]
        assert launch.gemm_config("linear_fp8_group128", 7, 7000, 1536, target=sm90,
                                  w_block=128) == launch.gemm_heuristic(7, 7000, 1536, sm90, w_block=128)
        # A decode-only sweep (--up-to 16) replaces that shape's entries up to 16 tokens only;
        # an entry with scale_prefetch reads back as one.
        monkeypatch.setattr(tune.launch, "TUNED_PATH", str(tmp_path / "out.json"))
        args.up_to = 16
        tune.write_table(str(tmp_path / "out2.json"), types.SimpleNamespace(arch="sm_90", device_kind="H"),
                         [point(1, [16, 64, 128, 4, 8, 1, 128, 1]), point(16, [16, 64, 128, 4, 12, 1])],
                         args)
        entries = json.loads((tmp_path / "out2.json").read_text())["gemm_configs"]["sm_90"][
            "linear_fp8_group128"]
        assert [e for e in entries if e[1] == 7168] == [
            [4, 7168, 1536, 16, 64, 128, 4, 8, 1, 128, 1], [16, 7168, 1536, 16, 64, 128, 4, 12, 1],
            [90, 7168, 1536, 16, 64, 128, 4, 4, 1], [2**31, 7168, 1536, 64, 128, 128, 4, 3, 0]]
        monkeypatch.setattr(tune.launch, "TUNED_PATH", str(tmp_path / "out2.json"))
        launch.gemm_tuned_table.cache_clear()
        assert launch.gemm_config("linear_fp8_group128", 1, 7168, 1536, target=sm90,
                                  w_block=128) == GemmConfig(16, 64, 128, 4, 8, True, 128, True)
        # A mid-range sweep (T = 64 and 512, --up-to 1448) replaces the buckets from 64 to 1448
        # only: the decode entries below 64 and the one above 1448 stay.
        args.up_to = 1448
        tune.write_table(str(tmp_path / "out3.json"), types.SimpleNamespace(arch="sm_90", device_kind="H"),
                         [point(64, [64, 64, 128, 4, 3, 0, 128, 1, 4]),
                          point(512, [64, 128, 128, 4, 2, 0, 128, 0, 2])], args)
        entries = json.loads((tmp_path / "out3.json").read_text())["gemm_configs"]["sm_90"][
            "linear_fp8_group128_ue8m0"]
        assert [e for e in entries if e[1] == 7168] == [
            [4, 7168, 1536, 16, 64, 128, 4, 8, 1, 128, 1], [16, 7168, 1536, 16, 64, 128, 4, 12, 1],
            [181, 7168, 1536, 64, 64, 128, 4, 3, 0, 128, 1, 4],
            [1448, 7168, 1536, 64, 128, 128, 4, 2, 0, 128, 0, 2],
            [2**31, 7168, 1536, 64, 128, 128, 4, 3, 0]]
    finally:
        launch.gemm_tuned_table.cache_clear()


@pytest.mark.slow  # an end-to-end run of the tool (fast tier: 9-10 s)
def test_resume_and_suites(tmp_path):
    """``--resume``: a run cut short continues with the same job list, its measured cases kept
    (not measured again), refused for another commit or device; ``--suite headline`` names
    cases that exist, ``--suite full`` holds every op and config and the headline."""
    from bench import cases as bench_cases, run as bench_run

    out = tmp_path / "b"
    argv = ["--ops", "fused_q_kv_rmsnorm", "--tokens", "1,64", "--calls", "2", "--out", str(out)]
    assert bench_run.main(argv[:3] + ["1"] + argv[4:]) == 0  # the first case only
    first = json.loads((out / "results.json").read_text())
    # the first part's conversion decisions and date stay in the report (a later part may make
    # none: it measured only GEMMs)
    cast = {"dtype": "float8_e4m3fn", "target": "first part", "mode": "auto", "native": True,
            "reason": "kept from the first part"}
    partial = dict(first, environment=dict(first["environment"], date="first-date",
                                           fp8_cast_decisions=[cast]))
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    assert bench_run.main(argv + ["--resume", str(tmp_path / "partial.json")]) == 0
    data = json.loads((out / "results.json").read_text())
    assert cast in data["environment"]["fp8_cast_decisions"]
    assert data["environment"]["date"].startswith("first-date, ")
    # (the CPU report prints no conversion line; a GPU one does)
    assert "kept from the first part" in bench_run.markdown(
        [], dict(data["environment"], backend="cuda"))
    assert {r["tokens"] for r in data["records"]} == {1, 64}
    kept = [r for r in data["records"] if r["tokens"] == 1]
    assert kept == [r for r in first["records"]]  # kept as measured, not measured again
    assert data["environment"]["cases_done"] == data["environment"]["cases"] == 2
    other = dict(first, environment=dict(first["environment"], git_commit="0000000"))
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="--resume: .* git_commit '0000000'"):
        bench_run.main(argv + ["--resume", str(tmp_path / "other.json")])
    for op, cfg, tokens in bench_cases.HEADLINE:
        assert cfg in bench_cases.OP_CONFIGS[op] and tokens
    # --suite full: every op and config, the headline's cases among its own
    full = {(op, cfg, t) for op, cfg, ts in bench_cases.FULL for t in ts}
    assert {(op, cfg) for op, cfg, _ in full} == {(op, cfg) for op, cfgs in
                                                  bench_cases.OP_CONFIGS.items() for cfg in cfgs}
    assert {(op, cfg, t) for op, cfg, ts in bench_cases.HEADLINE for t in ts} <= full


def test_compile_together_runs_each_call_once_and_raises_its_error():
    """The benchmark's side-by-side compiles: every ``(fn, inputs)`` run (so compiled) once,
    in threads; a failing one's error reaches the caller."""
    import jax
    import jax.numpy as jnp

    from bench import run as bench_run

    seen = []
    fns = [jax.jit(lambda x, i=i: (seen.append(i), x * i)[1]) for i in range(3)]
    bench_run.compile_together([(fn, (jnp.ones(4),)) for fn in fns])
    assert sorted(seen) == [0, 1, 2]  # each traced once

    def broken(x):
        raise ValueError("broken variant")
    with pytest.raises(ValueError, match="broken variant"):
        bench_run.compile_together([(fns[0], (jnp.ones(4),)), (broken, (jnp.ones(4),))])


@pytest.mark.slow
def test_a_time_limit_saves_the_cases_measured(tmp_path):
    """``timeout``'s SIGTERM mid-run writes the cases measured so far (marked partial) and exits
    124, so ``--resume`` continues from them; without it a run cut short within 20 s of its last
    write would lose those cases."""
    import signal

    out = tmp_path / "b"
    proc = subprocess.Popen([sys.executable, "-m", "bench", "--ops", "rmsnorm", "--calls", "2",
                             "--tokens", "1,7,64,256,512,1024,2048,4096", "--out", str(out)],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # the first case's progress line
            if line.startswith("[1/"):
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 124
    finally:
        proc.kill()
    data = json.loads((out / "results.json").read_text())
    env = data["environment"]
    assert 1 <= env["cases_done"] < env["cases"] == 8
    assert len({r["tokens"] for r in data["records"]}) == env["cases_done"]
    assert "PARTIAL RUN" in (out / "results.md").read_text()


def test_the_copy_ceiling_moves_whole_vectors():
    """The copy's element count is a multiple of 64 at any byte count (an odd count made XLA's
    copy kernel load one word at a time: a slow ceiling), and never fewer bytes than asked."""
    from bench import ops as bench_ops

    for nbytes in (1, 8, 11149852, 33163292, 14823452, 1 << 20):
        make, copies = bench_ops.copy_variants(nbytes)
        a, _ = make(0)
        assert a.shape[0] % 64 == 0 and 2 * a.nbytes >= nbytes and 2 * a.nbytes - nbytes < 1024
        assert set(copies) == {"memcpy", "xor_kernel"}
