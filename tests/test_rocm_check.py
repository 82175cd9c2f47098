"""The ROCm compile gate's parsing and gate logic (the compile itself runs in CI with the
rocm-check extra: ``python -m bench.rocm.check --check``); and the Triton IR it compiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import k3pallas as kp
from bench.rocm import check as rocm_check
from k3pallas import testing

AMDGCN = """
\t.amdhsa_kernel k
\ts_load_dwordx4 s[0:3], s[0:1], 0x0
\tv_cvt_pk_fp8_f32 v1, v2, v3
\tglobal_store_short v0, v1, s[2:3]
.LBB0_1:
\ts_endpgm
; Occupancy: 5
    .agpr_count:     0
    .private_segment_fixed_size: 0
    .sgpr_count:     30
    .sgpr_spill_count: 0
    .vgpr_count:     59
    .vgpr_spill_count: 2
"""


def test_resources_parser():
    r = rocm_check._resources(AMDGCN)
    assert (r["vgpr"], r["sgpr"], r["agpr"], r["vgpr_spill"], r["sgpr_spill"], r["scratch"],
            r["occupancy"], r["instructions"]) == (59, 30, 0, 2, 0, 0, 5, 4)
    assert r["fp8_cvt"] == ["v_cvt_pk_fp8_f32"]


def test_gate():
    base = {"arch": "gfx942", "op": "fused_q_kv_rmsnorm", "kernel": "k3pallas_fused_q_kv_rmsnorm",
            "vgpr_spill": 0, "sgpr_spill": 0, "scratch": 0, "occupancy": 8}
    assert rocm_check.problems(base) == []
    assert rocm_check.problems({**base, "vgpr_spill": 3})
    assert rocm_check.problems({**base, "scratch": 16})
    assert rocm_check.problems({**base, "occupancy": rocm_check.MIN_OCCUPANCY - 1})
    assert rocm_check.problems({**base, "error": "boom"})
    # A native-cast baseline the arch lacks is a finding, not a failure.
    assert rocm_check.problems({**base, "op": "native cast (Triton)", "error": "x"}) == []


@pytest.mark.parametrize("arch", rocm_check.ARCHS)
def test_triton_ir_extracted_for_rocm(arch):
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((4096, 1536), (4096, 512), (1536,), (512,))]
    lowered = testing.lower_for(lambda *a: kp.fused_q_kv_rmsnorm(*a, impl="pallas"), args, *testing.KNOWN_TARGETS[arch])
    (mod,) = testing.triton_ir_modules(lowered)
    assert mod["name"] == "k3pallas_fused_q_kv_rmsnorm" and mod["grid"][0] >= 1
    assert "tt.func public @k3pallas_fused_q_kv_rmsnorm" in mod["ir"]
    assert "tt.load" in mod["ir"] and "tt.store" in mod["ir"]


def test_64bit_offsets_for_huge_arrays():
    """2**21 rows of 2048 bf16 (8 GiB): the IR indexes with i64; 4096 rows: i32 only."""
    def ir_for(t):
        args = [jax.ShapeDtypeStruct((t, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((2048,), jnp.bfloat16)]
        lowered = testing.lower_for(lambda *a: kp.rmsnorm(*a, impl="pallas"), args, *testing.KNOWN_TARGETS["gfx942"])
        return testing.triton_ir_modules(lowered)[0]["ir"]

    assert "xi64>" in ir_for(2**21)
    assert "xi64>" not in ir_for(4096)


# ---------------------------------------------------------------------------------------------
# The XLA-ROCm path: HSACO parsing, occupancy, the environment's errors, the case list
# ---------------------------------------------------------------------------------------------

NOTES = """
AMDGPU Metadata: ---
amdhsa.kernels:
  - .agpr_count:     4
    .args:
      - .address_space:  global
        .name:           arg0
        .offset:         0
    .group_segment_fixed_size: 0
    .max_flat_workgroup_size: 256
    .name:           k3pallas_rmsnorm_gated_fp8
    .private_segment_fixed_size: 16
    .sgpr_count:     24
    .sgpr_spill_count: 0
    .vgpr_count:     76
    .vgpr_spill_count: 3
    .wavefront_size: 64
amdhsa.target:   'amdgcn-amd-amdhsa--gfx942:sramecc+:xnack-'
amdhsa.version:
  - 1
  - 2
"""

DISASSEMBLY = """
0000000000001800 <k3pallas_rmsnorm_gated_fp8>:
\ts_load_dwordx8 s[4:11], s[0:1], 0x0   // 000000001800: C00E0100
\tv_cvt_pk_fp8_f32 v1, v2, v3            // 000000001808: D2A20001
\tv_cvt_pk_fp8_f32 v4, v5, v6            // 000000001810: D2A20001
\tv_fmac_f32_e32 v1, v2, v3              // 000000001818: 56020503
\tv_mfma_f32_16x16x8_xf32 a[0:3], v[0:1], v[2:3], 0
\ts_endpgm                               // 000000001820: BF810000
\ts_nop 0
\ts_nop 0
"""


def test_xla_hsaco_parsers():
    from bench.rocm import xla as rocm_xla

    (k,) = rocm_xla.parse_notes(NOTES)
    assert k == {"kernel": "k3pallas_rmsnorm_gated_fp8", "vgpr": 76, "sgpr": 24, "agpr": 4,
                 "vgpr_spill": 3, "sgpr_spill": 0, "scratch": 16, "static_lds": 0}
    c = rocm_xla.parse_code(DISASSEMBLY, "k3pallas_rmsnorm_gated_fp8")
    assert (c["instructions"], c["valu"], c["fp8_cvt_count"], c["fma"], c["dot"]) == (6, 4, 2, 1, 0)
    assert c["fp8_cvt"] == ["v_cvt_pk_fp8_f32"] and c["mfma"] == ["v_mfma_f32_16x16x8_xf32"]
    assert rocm_check.problems({**k, **c, "arch": "gfx942", "op": "rmsnorm_gated_fp8_per_token",
                                "occupancy": 5}) == ["spills (3 VGPR, 0 SGPR)", "scratch 16 bytes"]


def _hlo_call(bytecode: bytes, name="k3pallas_rmsnorm", warps=4) -> str:
    """One compiled-HLO line of a Triton call, its IR escaped as MLIR prints a string."""
    esc = "".join(chr(b) if 32 <= b < 127 and chr(b) not in '\\"' else f"\\{b:02X}" for b in bytecode)
    return (f'  %c = f32[8] custom_call(%p), custom_call_target="__gpu$xla.gpu.triton", '
            f'backend_config={{ir = "{esc}", name = "{name}", num_stages = 1 : i32, '
            f'num_warps = {warps} : i32}}')


def test_the_gate_keys_a_triton_call_by_its_ir_text_not_its_bytes():
    """The same kernel serialized with other locations (as another program traces it) has the
    same key; another kernel or warp count another. XLA compiles the first two to one HSACO and
    writes it once, so a key by the bytes left a kernel with no resources (the gate failed 40
    named sharded cases, depending on which cases ran before them)."""
    import io

    from jax._src.lib.mlir import ir

    from bench.rocm import xla as rocm_xla
    from k3pallas import _compat

    def lowered_ir(d):
        fn = lambda x, w: kp.rmsnorm(x, w, impl="pallas")  # noqa: E731
        args = (jax.ShapeDtypeStruct((8, d), jnp.bfloat16),
                jax.ShapeDtypeStruct((d,), jnp.bfloat16))
        lowered = testing.lower_for(fn, args, *testing.KNOWN_TARGETS["gfx942"])
        (mod,) = testing.triton_ir_modules(lowered)
        return mod["ir"]

    ctx = _compat.triton_ir_context()

    def bytecode(text, loc):
        with ctx:
            m = ir.Module.parse(text)
            for op in m.body.operations:  # another location on the kernel: other bytes, same code
                op.location = ir.Location.name(loc)
            buf = io.BytesIO()
            m.operation.write_bytecode(buf)
        return buf.getvalue()

    text = lowered_ir(256)
    a, b = bytecode(text, "program_a"), bytecode(text, "another_program/with/a/long/name")
    assert a != b
    def key(data, **kw):
        return rocm_xla.triton_calls(_hlo_call(data, **kw))["k3pallas_rmsnorm"]
    assert key(a) == key(b)
    assert key(a) != key(a, warps=8)
    assert key(a) != key(bytecode(lowered_ir(512), "program_a"))


def test_occupancy_formula():
    from bench.rocm.xla import occupancy

    assert occupancy("gfx942", 28, 0, 28, 16, 4) == 8
    assert occupancy("gfx942", 81, 0, 30, 0, 1) == 5  # 88 of 512 VGPRs
    assert occupancy("gfx942", 76, 0, 82, 512, 1) == 6  # 96 SGPRs: 800 // 96 = 8; VGPR 80 -> 6
    assert occupancy("gfx942", 128, 128, 30, 0, 1) == 2
    assert occupancy("gfx942", 512, 256, 80, 0, 1) == 0  # spilling kernels: nothing fits
    assert occupancy("gfx942", 24, 0, 20, 32768, 16) == 8  # 2 groups of 16 waves per CU
    assert occupancy("gfx942", 24, 0, 20, 49152, 4) == 1  # one group of 4 waves per CU
    assert occupancy("gfx950", 24, 0, 20, 49152, 4) == 3  # 160 KiB of LDS on gfx950


def test_rocm_env_errors_are_one_line(monkeypatch, tmp_path, capsys):
    from bench.rocm import env as rocm_env

    with pytest.raises(rocm_env.SetupError, match="needs Python >= 3.12; none found"):
        rocm_env._find_python(str(tmp_path / "no-python"))
    monkeypatch.setattr(rocm_env.shutil, "which", lambda name: None)
    with pytest.raises(rocm_env.SetupError, match="gcc not found"):
        rocm_env.build_stubs([], str(tmp_path / "stubs"))
    with pytest.raises(rocm_env.SetupError, match="llvm-readobj-22, llvm-objdump-22 not found"):
        rocm_env.llvm_tools(install=False)

    def broken(*a, **k):
        raise rocm_env.SetupError("pip install of jax==0.12.0 failed (network?)")

    monkeypatch.setattr(rocm_env, "ensure", broken)
    assert rocm_env.main(["--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["rocm-xla env: pip install of jax==0.12.0 failed (network?)"]
    monkeypatch.setattr(rocm_env, "ensure", broken)
    assert rocm_check.main(["--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("rocm_check: pip install")


def test_target_configs_are_read_from_the_plugin_binary(tmp_path):
    from bench.rocm import env as rocm_env

    def proto(arch, name):
        return (f"# proto-file: x.proto\n# proto-message: stream_executor.GpuTargetConfigProto\n"
                f'gpu_device_info {{ core_count: 304 }}\ndevice_description_str: "{name}"\n'
                f'rocm_compute_capability {{ gcn_arch_name: "{arch}:sramecc+:xnack-" }}\n').encode()

    blob = b"\x00junk\x00" + proto("gfx90a", "MI250") + b"\x00" + proto("gfx942", "MI300X") + \
        b"\x00" + proto("gfx950", "MI350X") + b"\x00tail"
    so = tmp_path / "xla_rocm_plugin.so"
    so.write_bytes(blob)
    paths = rocm_env.extract_targets(str(so), str(tmp_path / "targets"))
    assert sorted(paths) == ["gfx942", "gfx950"]
    assert 'device_description_str: "MI300X"' in open(paths["gfx942"]).read()
    so.write_bytes(proto("gfx942", "MI300X"))
    with pytest.raises(rocm_env.SetupError, match=r"no GpuTargetConfigProto for \['gfx950'\]"):
        rocm_env.extract_targets(str(so), str(tmp_path / "t2"))


def test_gate_cases():
    from bench import cases as op_table
    from k3pallas.kernels import hooks, launch

    FP8_OPS = {name for name, op in op_table.OPS.items() if op.fp8}
    cases = rocm_check.cases((1, 4096), None)
    fp8 = [c for c in cases if c["op"] in FP8_OPS]
    assert fp8 and {c["fp8_cast"] for c in fp8} == {"encoder", "native"}
    mxfp8 = [c for c in cases if c["op"] in op_table.OPS and op_table.OPS[c["op"]].mx
             and c["config"].endswith("-mxfp8")]
    assert mxfp8 and {c["fp8_cast"] for c in mxfp8} == {"encoder", "native"}
    assert all(c.get("archs") == ["gfx950"] for c in mxfp8 if c["fp8_cast"] == "native")
    assert all("fp8_cast" not in c for c in cases if c["op"] not in FP8_OPS and c not in mxfp8)
    assert rocm_check.BROKEN not in cases
    ops = {c["op"] for c in cases}
    assert ops == set(op_table.OPS) | {"linear"}  # every op of the table, with no list of its own
    gemm = [c for c in cases if c["op"] == "linear"]  # every GEMM format and shape, its tiles
    forced = [c for c in gemm if "@" in c["config"]]  # and the loop forms AMD does not choose
    assert {c["config"] for c in gemm if c not in forced} == set(op_table.LINEAR)
    assert {c["tokens"] for c in gemm} == set(rocm_check.GEMM_EXTRA_TOKENS)
    fn, args = rocm_check.case_fn(gemm[0], "gfx942")
    assert args[0].data.dtype == jnp.float8_e4m3fnuz and args[1].data.dtype == jnp.float8_e4m3fnuz
    assert len(forced) == len(rocm_check.GEMM_FORCED)
    for case, (_, _, entry) in zip(forced, rocm_check.GEMM_FORCED):
        with hooks.recording() as launches:
            fn, args = rocm_check.case_fn(case, "gfx950")
            testing.lower_for(fn, args, *testing.KNOWN_TARGETS["gfx950"])
        assert [g.config.as_entry() for g in launches if isinstance(g, launch.GemmLaunch)] == [
            list(entry)]
    assert {"fused_q_kv_rmsnorm", "rmsnorm_gated_fp8_per_token"} <= FP8_OPS | ops
    fn, args = rocm_check.case_fn(rocm_check.BROKEN)  # the forced launch: 64 rows, 1 wavefront
    (launch,) = testing.triton_launches(testing.lower_for(fn, args, *testing.KNOWN_TARGETS["gfx942"]).as_text())
    assert (launch["num_warps"], launch["grid_x"]) == (1, 4096 // 64)


def test_deviceless_rocm_patches_refuse_an_unknown_jax(monkeypatch):
    from bench.rocm import xla as rocm_xla

    monkeypatch.setattr(rocm_xla, "_jax_version", lambda: (0, 11, 2))
    with pytest.raises(RuntimeError, match=r"written for jax 0\.12\.0; this is jax .*bench\.rocm\.env"):
        rocm_xla.deviceless_topology("", "gfx942", "MI300X")


def test_amd_cost_model(tmp_path):
    """The estimate's arithmetic on synthetic gate results: launch floor + the largest of memory,
    VALU issue of the busiest CU (wave quantization, quarter-rate transcendentals) and one
    wavefront's serial chain (per round of resident wavefronts)."""
    import json

    from bench.rocm import amd_cost

    devices = {"gfx942": {"core_count": 304, "clock_rate_ghz": 2.1}}
    base = {"arch": "gfx942", "op": "quantize_fp8_per_token", "config": "kimi-linear-kda",
            "tokens": 65536, "grid": [65536, 1, 1], "num_warps": 1, "instructions": 200,
            "vgpr": 40, "occupancy": 8}
    gate = {"meta": {"devices": devices, "compiler": "test"},
            "results": [{**base, "fp8_cast": "encoder", "valu": 400, "trans": 2},
                        {**base, "fp8_cast": "native", "valu": 100, "trans": 2}]}
    (row,) = amd_cost.table(gate)
    e = row["encoder"]
    mem = (65536 * 4096 * 3 + 4 * 65536) / 4.2e12 * 1e6
    assert abs(e["memory_us"] - mem) < 1e-9
    per_cu = -(-65536 // 304)  # 216 waves on the busiest CU
    assert abs(e["valu_us"] - per_cu * (400 + 3 * 2) / 2100) < 1e-9
    rounds = -(-per_cu // (8 * 4))
    assert abs(e["serial_us"] - rounds * ((4 * 400 + 12 * 2) / 2100 + 2 * amd_cost.HBM_LATENCY_US)) < 1e-9
    assert e["bound"] == "memory" and e["predicted_us"] == amd_cost.LAUNCH_FLOOR_US + e["memory_us"]
    # Decode: one token, one program of 16 wavefronts: the serial chain and the floor decide.
    one = {**base, "tokens": 1, "grid": [1, 1, 1], "num_warps": 16}
    (row,) = amd_cost.table({**gate, "results": [{**one, "fp8_cast": c, "valu": v, "trans": 2}
                                                 for c, v in (("encoder", 400), ("native", 100))]})
    d = row["encoder"]
    assert d["bound"] == "serial" and d["predicted_us"] > amd_cost.LAUNCH_FLOOR_US + 2 * amd_cost.HBM_LATENCY_US
    path = tmp_path / "gate.json"
    path.write_text(json.dumps(gate))
    assert amd_cost.main(["--gate", str(path), "--out", str(tmp_path)]) == 0
    assert "ESTIMATE" in (tmp_path / "amd_cost_model.md").read_text()
    path.write_text(json.dumps({"meta": {}, "results": []}))
    assert amd_cost.main(["--gate", str(path), "--out", str(tmp_path)]) == 2


def test_the_gate_fails_a_gemm_without_fp8_matrix_instructions():
    row = {"arch": "gfx942", "op": "linear", "config": "c", "tokens": 1,
           "kernel": "k3pallas_linear_fp8_group128", "mfma": ["v_mfma_f32_16x16x32_fp8_fp8"],
           "vgpr_spill": 0, "sgpr_spill": 0, "scratch": 0, "occupancy": 6}
    assert rocm_check.problems(row) == []
    assert rocm_check.problems({**row, "mfma": ["v_mfma_f32_16x16x16_bf16"]})
    assert rocm_check.problems({**row, "arch": "gfx950"})  # gfx950's are *_f8f6f4
    assert rocm_check.problems({**row, "arch": "gfx950", "mfma": ["v_mfma_f32_16x16x128_f8f6f4"]}) == []


def test_the_gate_fails_a_wrong_format_or_too_many_threads():
    row = {"arch": "gfx942", "sharded": "named", "op": "quantize_fp8_per_token", "config": "c",
           "tokens": 8, "kernel": "k3pallas_quantize_fp8_per_token", "fp8_cast": "native",
           "fp8_formats": ["f8e4m3fnuz"], "fp8_cvt": ["v_cvt_pk_fp8_f32"], "threads": 256,
           "vgpr_spill": 0, "sgpr_spill": 0, "scratch": 0, "occupancy": 8}
    assert rocm_check.problems(row) == []
    assert rocm_check.problems({**row, "fp8_formats": ["f8e4m3fn"]})
    assert rocm_check.problems({**row, "fp8_cvt": []})
    assert rocm_check.problems({**row, "threads": 2048})


def test_amd_cost_gemm_rows():
    """The GEMM's estimate: launch floor + one HBM latency + the larger of memory time (the
    GEMM's bytes at the fraction of the chip its programs cover) and matrix time (the busiest
    CU's tiles at the datasheet FP8 rate), with the config the heuristic gives the arch."""
    from bench.rocm import amd_cost
    from k3pallas import platform
    from k3pallas.kernels import launch

    devices = {"gfx942": {"core_count": 304, "clock_rate_ghz": 2.1}}
    row = {"arch": "gfx942", "op": "linear", "config": "deepseek-v3-oproj-tp8-fp8_group128",
           "tokens": 8, "kernel": "k3pallas_linear_fp8_group128"}
    (g,) = amd_cost.gemm_table({"meta": {"devices": devices}, "results": [row]})
    cfg = launch.gemm_config("linear_fp8_group128", 8, 7168, 2048,
                             target=platform.target_from_name("gfx942"), w_block=128)
    assert g["launch"] == cfg.as_entry() and g["programs"] == -(-7168 // cfg.block_n)
    nbytes = 8 * 2048 + 7168 * 2048 + 2 * 8 * 7168 + 4 * 8 * 16 + 4 * 56 * 16
    mem = nbytes / (4.2e12 * min(1.0, g["programs"] / 304)) * 1e6
    assert abs(g["memory_us"] - mem) < 1e-9 and g["bound"] == "memory"
    assert g["predicted_us"] == amd_cost.LAUNCH_FLOOR_US + amd_cost.HBM_LATENCY_US + mem


def test_the_sample_holds_every_amd_launch_config():
    """``--sample`` (CI's gate) compiles the row kernels at ``SAMPLE_TOKENS`` only: that is every
    launch config AMD's heuristic gives them at the benchmark's token counts, for row widths from
    64 to 16384 elements, on both archs; and no tuned entry for an AMD arch overrides it."""
    from bench import cases as bench_cases
    from k3pallas import platform
    from k3pallas.kernels import launch

    assert not set(launch.tuned_table()) & set(rocm_check.ARCHS)
    for arch in rocm_check.ARCHS:
        target = platform.target_from_name(arch)
        for width in [1 << e for e in range(6, 15)] + [1536, 7168, 12288]:
            for tile in {min(width, 2048), width}:
                def config(t):
                    return launch.heuristic_config("any", t, width, tile, target)
                sampled = {config(t) for t in rocm_check.SAMPLE_TOKENS}
                assert {config(t) for t in bench_cases.DEFAULT_TOKENS} == sampled, (arch, width)
    assert {1, 7} <= set(rocm_check.SAMPLE_TOKENS)
